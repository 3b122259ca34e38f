"""`SamplingParams(prompt_logprobs=K)`: the prompt tokens' log probabilities are Hugging Face's
log-softmax of the prompt's logits (float32), whatever the chunking, the batch, the prefix cache,
preemption or n; the steps of requests that do not ask compute logits of their sampled rows only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from batchgen import LLM, SamplingParams
from batchgen.engine.logprobs import scored_rows
from batchgen.engine.request import Request
from batchgen.model.sampler import SampleLogprobs

# Prompts in pairs sharing a prefix of several 4-token blocks, and a one-token prompt.
PROMPTS = [
    "The quick brown fox jumps over the lazy dog because it was hungry and tired",
    "The quick brown fox jumps over the lazy dog because the dog had eaten its dinner",
    "Paged attention stores the key and value cache in fixed-size blocks, so",
    "Paged attention stores the key and value cache in fixed-size blocks, and prefix caching",
    "a",
]
TOL = 1e-4
ENGINE = dict(dtype="float32", block_size=4, max_num_batched_tokens=7, enable_prefix_caching=True)


def hf_log_softmax(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """`[P, vocab]` float32: log-softmax of Hugging Face's logits of the prompt alone."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_prompt_logprobs(got, ids: list[int], lsm: torch.Tensor, k: int, tokenizer) -> None:
    """`RequestOutput.prompt_logprobs` against the reference `lsm` (`hf_log_softmax`): one entry per
    prompt token, None first; at token i, token i's log probability and rank and the k most likely
    tokens (ranks 1..k) with theirs, from row i - 1."""
    assert got is not None and len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        row, token, entry = lsm[i - 1], ids[i], got[i]
        value = row[token].item()
        assert entry[token].logprob == pytest.approx(value, abs=TOL)
        # Its rank among HF's values, allowing for tokens within the tolerance of it.
        assert int((row > value + TOL).sum()) + 1 <= entry[token].rank <= int((row > value - TOL).sum()) + 1
        top = sorted((lp.rank, t) for t, lp in entry.items() if t != token or lp.rank <= k)
        assert [rank for rank, _ in top] == list(range(1, k + 1))
        assert set(entry) == {t for _, t in top} | {token}
        top_lp = row.topk(k).values.tolist() if k else []
        assert [entry[t].logprob for _, t in top] == pytest.approx(top_lp, abs=TOL)
        assert [entry[t].logprob for _, t in top] == pytest.approx([row[t].item() for _, t in top], abs=TOL)
        assert all(lp.decoded_token == tokenizer.decode([t]) for t, lp in entry.items())


@pytest.fixture(scope="module")
def tiny_case(tiny_model_dir):
    path = tiny_model_dir("llama")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    return path, tok, ids, [hf_log_softmax(path, x) for x in ids]


def count_lm_head_rows(llm: LLM) -> list[int]:
    """A one-element list counting the rows every LM head call of `llm` computes, from now on."""
    rows = [0]
    llm.llm_engine.runner.model.lm_head.register_forward_hook(
        lambda module, args, out: rows.__setitem__(0, rows[0] + out.shape[0])
    )
    return rows


def test_prompt_logprobs_match_hf_with_chunks_prefix_cache_and_a_mixed_batch(tiny_case):
    """Chunks of 7 tokens, 4-token blocks, prefix caching on and the cache warm with every prompt:
    the requests that ask take no hit and get every position, equal to HF's; those that do not
    ask reuse the cached prefixes and get None; greedy outputs are the same either way."""
    path, tok, ids, lsm = tiny_case
    llm = LLM(str(path), **ENGINE)
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": x} for x in ids]
    cold = llm.generate(prompts, plain)
    assert all(out.prompt_logprobs is None for out in cold)
    asks = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=k) for k in (3, 0)]
    params = [asks[0], plain, asks[1], plain, asks[0]]
    warm = llm.generate(prompts, params)
    for out, x, ref, p, c in zip(warm, ids, lsm, params, cold, strict=True):
        assert out.outputs[0].token_ids == c.outputs[0].token_ids
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            assert len(x) < 4 or out.num_cached_tokens > 0, "a plain request reuses the warm cache"
        else:
            assert out.num_cached_tokens == 0, "a request asking for prompt logprobs skips no position"
            assert_prompt_logprobs(out.prompt_logprobs, x, ref, p.prompt_logprobs, tok)


def test_only_requests_that_ask_pay_for_prompt_rows(tiny_case):
    """Without a request asking, the LM head computes one row per sampled token; each request that
    asks adds exactly its prompt length - 1 rows (each position scored once)."""
    path, _, ids, _ = tiny_case
    llm = LLM(str(path), **ENGINE)
    rows = count_lm_head_rows(llm)
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": x} for x in ids]
    llm.generate(prompts, plain)
    assert rows[0] == 3 * len(ids)
    rows[0] = 0
    asks = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    llm.generate(prompts, [asks, plain, plain, asks, plain])
    assert rows[0] == 3 * len(ids) + (len(ids[0]) - 1) + (len(ids[3]) - 1)


def test_n_completions_score_the_prompt_once(tiny_case):
    path, tok, ids, lsm = tiny_case
    llm = LLM(str(path), **ENGINE)
    rows = count_lm_head_rows(llm)
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=3, ignore_eos=True, prompt_logprobs=4)
    (out,) = llm.generate([{"prompt_token_ids": ids[2]}], params)
    assert len(out.outputs) == 3
    assert_prompt_logprobs(out.prompt_logprobs, ids[2], lsm[2], 4, tok)
    assert rows[0] == 3 * 3 + len(ids[2]) - 1


def test_preemption_by_recompute_neither_repeats_nor_loses_positions(tiny_case, monkeypatch):
    """12 blocks of 4 tokens cannot hold the five requests at once: requests are preempted (some
    in the middle of their prompt) and recomputed, and every position comes back once."""
    path, tok, ids, lsm = tiny_case
    llm = LLM(str(path), **{**ENGINE, "kv_cache_memory": 12 * 2048, "max_num_batched_tokens": 9})
    scheduler = llm.llm_engine.scheduler
    preempt, scored_at_preemption = scheduler._preempt, []

    def counted(request, out):
        scored_at_preemption.append((len(request.prompt_logprobs), request.num_prompt_tokens - 1))
        preempt(request, out)

    monkeypatch.setattr(scheduler, "_preempt", counted)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": x} for x in ids], params)
    assert any(0 < done < total for done, total in scored_at_preemption), (
        f"a request was meant to be preempted in the middle of its prompt: {scored_at_preemption}"
    )
    for out, x, ref in zip(outs, ids, lsm, strict=True):
        assert_prompt_logprobs(out.prompt_logprobs, x, ref, 1, tok)


def _request(num_prompt: int, scored: int | None) -> Request:
    return Request(
        "r",
        list(range(100, 100 + num_prompt)),
        SamplingParams(prompt_logprobs=2),
        arrival_time=0.0,
        max_tokens=4,
        prompt_logprobs=None if scored is None else [SampleLogprobs(0, 0.0, 1, [])] * scored,
    )


def test_scored_rows_resume_where_the_scores_stop():
    """After a recompute from position 0 with 4 positions scored, rows 4.. of the chunk are scored
    (targets: the next prompt tokens), never the last prompt position; none once all are done."""
    r = _request(10, 4)
    rows = scored_rows(r, 0, 6)
    assert (rows.first, rows.targets, rows.top) == (4, [105, 106], 2)
    assert scored_rows(r, 4, 7).targets == [105, 106, 107, 108, 109]  # stops before the last one
    r.prompt_logprobs += [SampleLogprobs(0, 0.0, 1, [])] * 5  # 9 = all positions
    assert scored_rows(r, 0, 10) is None and not r.scores_prompt
    assert scored_rows(_request(10, None), 0, 10) is None
    with pytest.raises(RuntimeError, match="would be lost"):
        scored_rows(_request(10, 2), 4, 4)


def test_the_prefix_cache_serves_only_scored_positions():
    r = _request(10, 5)
    assert r.max_cached_prefix == 5
    assert _request(10, 9).max_cached_prefix == 10  # all scored: like any request
    assert _request(10, None).max_cached_prefix == 10


@pytest.mark.slow
def test_default_model_prompt_logprobs_match_hf(default_model_dir):
    """SmolLM2-135M in float32, prompts sharing prefixes, prefix caching on and a warm cache, chunks
    of 7 tokens: equal to HF's log-softmax within 1e-4."""
    tok = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    ids = [tok(p)["input_ids"] for p in PROMPTS[:4]]
    llm = LLM(str(default_model_dir), **ENGINE)
    prompts = [{"prompt_token_ids": x} for x in ids]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2))
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=5)
    outs = llm.generate(prompts, [params, SamplingParams(temperature=0.0, max_tokens=2), params, params])
    for i in (0, 2, 3):
        assert outs[i].num_cached_tokens == 0
        assert_prompt_logprobs(
            outs[i].prompt_logprobs, ids[i], hf_log_softmax(default_model_dir, ids[i]), 5, tok
        )
    assert outs[1].prompt_logprobs is None and outs[1].num_cached_tokens > 0
