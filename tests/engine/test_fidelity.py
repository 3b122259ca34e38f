"""Greedy float32 outputs are token-identical to Hugging Face `generate`, whatever the batching.

The reference runs each prompt alone through `transformers` (no padding), so any difference comes
from our engine: batching, chunked prefill, preemption or prefix caching.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers

from batchgen import LLM, SamplingParams
from batchgen.bench.workload.job import read_job_rows
from batchgen.kernels.cpu import attention as cpu_attention

XSUM = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "xsum" / "test.jsonl"
INSTRUCTION = "Summarize the following article in one sentence.\n\n"
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

TEXT_PROMPTS = [
    "The quick brown fox jumps over the lazy dog because",
    "Hello, my name is",
    "In 1492, Columbus sailed across the ocean blue and found a land of many rivers, mountains and",
    "a",
    "Paged attention stores the key and value cache in fixed-size blocks, so",
    "The quick brown fox jumps over the lazy dog because it",  # shares a prefix with the first prompt
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30",
    "Once upon a time",
]


def hf_greedy(
    model_dir: Path, prompt_ids: list[list[int]], max_new_tokens: int, ignore_eos: bool, **generate_kwargs
) -> list[list[int]]:
    """Hugging Face `generate` on each prompt alone, float32, greedy (plus `generate_kwargs`)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    outs = []
    for ids in prompt_ids:
        kwargs = {"eos_token_id": None} if ignore_eos else {}
        if ignore_eos:
            kwargs["min_new_tokens"] = max_new_tokens
        with torch.inference_mode():
            seq = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
                **kwargs,
                **generate_kwargs,
            )
        outs.append(seq[0, len(ids) :].tolist())
    return outs


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def llama_case(tiny_model_dir):
    """The tiny Llama (GQA, llama3 rope scaling) with its prompts and Hugging Face's outputs."""
    path = tiny_model_dir("llama")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok(p)["input_ids"] for p in TEXT_PROMPTS]
    return path, prompt_ids, hf_greedy(path, prompt_ids, GREEDY.max_tokens, ignore_eos=True)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_tiny_architectures_match_hf(tiny_model_dir, arch, backend):
    """Both CPU attention backends: plain torch, and the C decode kernel (the default on CPU)."""
    if backend == "cpu" and cpu_attention.load_library() is None:
        pytest.skip("no C compiler here to build the CPU attention kernel")
    path = tiny_model_dir(arch)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok(p)["input_ids"] for p in TEXT_PROMPTS]
    expected = hf_greedy(path, prompt_ids, GREEDY.max_tokens, ignore_eos=True)
    # "cpu" is the C backend, which runs on the CPU whatever else the machine has.
    device = "cpu" if backend == "cpu" else "auto"
    llm = LLM(str(path), dtype="float32", attention_backend=backend, device=device)
    got = token_ids(llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY))
    assert got == expected


BATCHING_OPTIONS = {
    "max_num_seqs=1": dict(max_num_seqs=1),
    "max_num_seqs=4": dict(max_num_seqs=4),
    "max_num_seqs=64": dict(max_num_seqs=64),
    # Every prompt is longer than 5 tokens, so each is prefilled in several chunks.
    "chunked_prefill": dict(max_num_batched_tokens=5),
    # 16 blocks of 8 tokens (128) cannot hold 8 requests of up to 104 tokens at once: preemption is forced.
    "preempt_recompute": dict(kv_cache_memory=16 * 4096, block_size=8, preemption_mode="recompute"),
    "preempt_swap": dict(kv_cache_memory=16 * 4096, block_size=8, preemption_mode="swap"),
    # 4-token blocks: the prompt that repeats the first one's start reuses its first full blocks.
    "prefix_caching": dict(block_size=4, max_num_seqs=1),
    "no_prefix_caching": dict(block_size=4, max_num_seqs=1, enable_prefix_caching=False),
}


@pytest.mark.parametrize("name", list(BATCHING_OPTIONS))
def test_batching_does_not_change_outputs(llama_case, name, monkeypatch):
    path, prompt_ids, expected = llama_case
    llm = LLM(str(path), dtype="float32", **BATCHING_OPTIONS[name])
    # Count the blocks copied out to swap space and back: a swap case that fell back to recompute
    # (swap space full or refused) would pass the token comparison without testing swap at all.
    blocks = llm.llm_engine.scheduler.block_manager
    swapped = {"out": 0, "in": 0}

    def counted(method, key):
        def call(*args, **kwargs):
            copies = method(*args, **kwargs)
            swapped[key] += len(copies)
            return copies

        return call

    monkeypatch.setattr(blocks, "swap_out", counted(blocks.swap_out, "out"))
    monkeypatch.setattr(blocks, "swap_in", counted(blocks.swap_in, "in"))
    # Count the steps that decoded the rows of the step before from kept arrays (`DecodeRows`):
    # the tokens above must also hold for them, blocks opened mid-run included.
    rows = llm.llm_engine.runner.decode_rows
    kept_steps = []

    def flatten(seqs, *args):
        flat = type(rows).flatten(rows, seqs, *args)
        kept_steps.append(rows.kept)
        return flat

    monkeypatch.setattr(rows, "flatten", flatten)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY)
    assert token_ids(outputs) == expected
    assert sum(kept_steps) >= GREEDY.max_tokens // 2, "decode steps were meant to keep their rows"
    totals = llm.llm_engine.totals
    if name.startswith("preempt"):
        assert totals.preemptions > 0, "the cache was meant to force preemption"
    if name == "preempt_swap":
        assert swapped["out"] > 0, "preemption was meant to swap blocks out, not recompute"
        assert swapped["in"] == swapped["out"], "every swapped-out block was meant to come back"
    else:
        assert swapped == {"out": 0, "in": 0}
    if name == "prefix_caching":
        assert totals.prefix_cache_hits >= 8, "the repeated prompt start was meant to hit the cache"
    if name == "no_prefix_caching":
        assert totals.prefix_cache_hits == 0
    if name == "chunked_prefill":
        # With at most 5 tokens a step, the steps must cover every prompt and decode token.
        total = sum(len(ids) for ids in prompt_ids) + len(prompt_ids) * (GREEDY.max_tokens - 1)
        assert llm.llm_engine.totals.steps >= -(-total // 5)


@pytest.mark.parametrize("row_chunk", [1, 7])
def test_row_sliced_layers_do_not_change_outputs(llama_case, monkeypatch, row_chunk):
    """The CPU's row slices (`prefill_row_chunk`) give HF's tokens; the tiny model is too small to
    slice by itself, so the slice is forced down to 1 and 7 rows (7 does not divide the steps)."""
    import batchgen.model.llama as llama

    path, prompt_ids, expected = llama_case
    monkeypatch.setattr(llama, "prefill_row_chunk", lambda config, dtype, device: row_chunk)
    llm = LLM(str(path), dtype="float32")
    assert token_ids(llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY)) == expected


def test_prefix_cache_cold_and_warm(llama_case):
    path, prompt_ids, expected = llama_case
    llm = LLM(str(path), dtype="float32", block_size=8, enable_prefix_caching=True)
    cold = token_ids(llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY))
    hits_before = llm.llm_engine.totals.prefix_cache_hits
    warm = token_ids(llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY))
    assert cold == expected
    assert warm == expected
    assert llm.llm_engine.totals.prefix_cache_hits > hits_before, "the second pass should hit the cache"


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_matches_hf(llama_case, penalty):
    """`repetition_penalty` gives HF `generate`'s greedy tokens, batched and with chunked prefill,
    and changes some output (so the comparison is not of two unpenalized runs)."""
    path, prompt_ids, unpenalized = llama_case
    expected = hf_greedy(path, prompt_ids, GREEDY.max_tokens, ignore_eos=True, repetition_penalty=penalty)
    assert expected != unpenalized
    params = SamplingParams(
        temperature=0.0, max_tokens=GREEDY.max_tokens, ignore_eos=True, repetition_penalty=penalty
    )
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=16)
    assert token_ids(llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)) == expected


def test_logprobs_match_hf_raw_logits(llama_case):
    """`logprobs=k`: at every output position the k most likely tokens and their log probabilities
    are HF's (log-softmax of `generate`'s raw logits, float32), batched with chunked prefill; the
    greedy token is rank 1 and the cumulative log probability is the sum over positions."""
    path, prompt_ids, expected = llama_case
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    k, steps = 5, 6
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=k)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=16)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    for ids, out, hf_tokens in zip(prompt_ids, outputs, expected, strict=True):
        completion = out.outputs[0]
        assert completion.token_ids == hf_tokens[:steps]
        with torch.inference_mode():
            hf = model.generate(
                torch.tensor([ids]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                pad_token_id=0, output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
        assert len(completion.logprobs) == steps
        total = 0.0
        for position, (ours, raw) in enumerate(zip(completion.logprobs, hf.logits, strict=True)):
            top_lp, top_ids = torch.log_softmax(raw[0].float(), dim=-1).topk(k)
            token = completion.token_ids[position]
            assert list(ours)[:k] == top_ids.tolist() and len(ours) == k  # greedy: the sampled is the top
            assert [ours[t].logprob for t in top_ids.tolist()] == pytest.approx(top_lp.tolist(), abs=1e-4)
            assert [ours[t].rank for t in top_ids.tolist()] == list(range(1, k + 1))
            assert ours[token].rank == 1 and ours[token].decoded_token == llm.get_tokenizer().decode([token])
            total += ours[token].logprob
        assert completion.cumulative_logprob == pytest.approx(total)


def test_shuffled_and_alone(llama_case):
    path, prompt_ids, expected = llama_case
    llm = LLM(str(path), dtype="float32")
    order = list(range(len(prompt_ids)))
    random.Random(7).shuffle(order)
    shuffled = token_ids(llm.generate([{"prompt_token_ids": prompt_ids[i]} for i in order], GREEDY))
    assert [shuffled[order.index(i)] for i in range(len(order))] == expected
    alone = [token_ids(llm.generate([{"prompt_token_ids": ids}], GREEDY))[0] for ids in prompt_ids]
    assert alone == expected


def _xsum_documents(n: int) -> list[str]:
    if not XSUM.exists():
        pytest.skip(f"shared data not found at {XSUM} (needs the ../shared/data folder beside the repo)")
    return [row["document"] for row in read_job_rows(XSUM) if row["document"].strip()][:n]


@pytest.mark.slow
def test_default_model_matches_hf_on_xsum(default_model_dir):
    """SmolLM2-135M-Instruct (the default model), chat template, summarization, max_tokens 32."""
    messages = [[{"role": "user", "content": INSTRUCTION + doc}] for doc in _xsum_documents(8)]
    tok = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    prompt_ids = [
        tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        for m in messages
    ]
    expected = hf_greedy(default_model_dir, prompt_ids, 32, ignore_eos=False)
    llm = LLM(dtype="float32")  # no model: the default one
    outputs = llm.generate(messages, SamplingParams(temperature=0.0, max_tokens=32))
    assert [o.prompt_token_ids for o in outputs] == prompt_ids
    assert token_ids(outputs) == expected
    for out in outputs:
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
        assert out.outputs[0].finish_reason in ("stop", "length")
