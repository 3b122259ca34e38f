"""Structured outputs in the engine: masks, fidelity to Hugging Face with the same library's mask,
preemption, n > 1, seeds, stop conditions, speculation, and bad constraints failing their own
request only.

The model is a tiny random Llama whose vocabulary (49,187 logits) is padded past its tokenizer's
(49,152 tokens) and is not a multiple of 32, so every test also covers the bitmask's padding.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest
import torch
import transformers
import xgrammar as xgr

from batchgen import LLM, SamplingParams
from batchgen.engine.structured import GrammarCache
from batchgen.engine.structured_check import library_grammar
from batchgen.model.loading.loader import TOKENIZER_FILES
from batchgen.model.sampler import TokenMasks
from batchgen.sampling_params import StructuredOutputsParams

VOCAB = 49_187  # the tokenizer has 49,152: 35 padded ids, and 49,187 % 32 != 0
EOS_IDS = [0, 2]  # the tiny model's generation config: <|endoftext|>, <|im_end|>
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "age", "kind", "tags"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    "choice": StructuredOutputsParams(choice=["yes", "no", 'say "maybe"']),
    "grammar": StructuredOutputsParams(grammar='root ::= "(" [a-z]+ ")" | "n" [0-9] [0-9]'),
    "json_object": StructuredOutputsParams(json_object=True),
}
PROMPTS = ["Hello, my name is", "The date today is", "Answer yes or no:", "a", "Once upon a time, in a"]


@pytest.fixture(scope="module")
def padded_llama(tmp_path_factory, tokenizer_dir) -> Path:
    """A tiny random Llama (2 layers, hidden 64, float32) with the default model's tokenizer and a
    padded vocabulary of `VOCAB` logits."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=1, eos_token_id=EOS_IDS, pad_token_id=2
    )
    path = tmp_path_factory.mktemp("padded-llama")
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def tokenizer(padded_llama):
    return transformers.AutoTokenizer.from_pretrained(padded_llama)


@pytest.fixture(scope="module")
def library(tokenizer):
    """xgrammar's own compiler for the model, set up as its documentation says (the reference)."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB, stop_token_ids=EOS_IDS)
    compiler = xgr.GrammarCompiler(info)

    def compile_(params: StructuredOutputsParams):
        method, text = library_grammar(params)
        if method == "json_schema":
            return compiler.compile_json_schema(text, any_whitespace=False)
        return compiler.compile_regex(text) if method == "regex" else compiler.compile_grammar(text)

    return compile_


@pytest.fixture(scope="module")
def llm(padded_llama) -> LLM:
    return LLM(str(padded_llama), dtype="float32", num_threads=1)


def accepted(compiled, token_ids: list[int]) -> tuple[bool, bool]:
    """(whether a fresh library matcher accepts every token, whether it is then terminated)."""
    m = xgr.GrammarMatcher(compiled)
    return all(m.accept_token(t) for t in token_ids), m.is_terminated()


def assert_valid(library, params: SamplingParams, completion) -> None:
    """The completion fits its constraint: every token accepted, ended by the grammar when "stop";
    a "stop" JSON row parses, a choice row is one of the choices."""
    so = params.structured_outputs
    ok, terminated = accepted(library(so), completion.token_ids)
    assert ok, completion
    assert completion.finish_reason in ("stop", "length")
    if completion.finish_reason == "stop":
        assert terminated
        if so.kind in ("json", "json_object"):
            assert isinstance(json.loads(completion.text), dict)
        if so.kind == "choice":
            assert completion.text in so.choice


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_the_engine_mask_is_the_library_matchers_mask(tokenizer, library, kind):
    """Along random token paths (each token drawn from the allowed ones), the bitmask and masked
    logits the runner applies are those of xgrammar's own matcher, bitmask and apply, the padded ids
    beyond the tokenizer are never allowed, and a matcher rebuilt halfway by replaying the path
    (`RequestGrammar.sync`, as after a recompute) goes on with the same masks."""
    cache = GrammarCache(tokenizer, VOCAB, set(EOS_IDS), timeout_s=60)
    entry = cache.submit(CONSTRAINTS[kind])
    assert entry.done.wait(60) and entry.state(60) == "ready"
    masks = TokenMasks(VOCAB, torch.device("cpu"))
    rng = random.Random(kind)
    for _ in range(3):
        ours, theirs = cache.matcher(entry), xgr.GrammarMatcher(library(CONSTRAINTS[kind]))
        reference = xgr.allocate_token_bitmask(1, VOCAB)
        path: list[int] = []
        for step in range(40):
            if step == 20:  # a fresh matcher replays the path so far
                ours = cache.matcher(entry)
                assert ours.sync(path) and ours.num_accepted == len(path)
            filled = masks.fill([None, ours])
            theirs.fill_next_token_bitmask(reference, 0)
            bits = filled[0][1] if filled else torch.full_like(reference[0], -1)
            assert torch.equal(bits, reference[0])
            logits = torch.randn(2, VOCAB)
            expected = logits[1:].clone()
            xgr.apply_token_bitmask_inplace(expected, reference)
            if filled:
                assert filled[1] == [1]
                masks.apply(logits, filled)
            assert torch.equal(logits[1:], expected)
            assert torch.isinf(logits[1, len(tokenizer) :]).all()  # padded ids: never allowed
            allowed = torch.isfinite(expected[0]).nonzero()[:, 0].tolist()
            token = rng.choice(allowed)
            assert ours.accept(token) and theirs.accept_token(token)
            path.append(token)
            if theirs.is_terminated():
                assert ours.terminated
                break


def hf_structured(model, compiled, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face `generate`, greedy float32, with xgrammar's own Hugging Face logits processor
    (`xgrammar.contrib.hf.LogitsProcessor`) masking each step's logits."""
    from xgrammar.contrib.hf import LogitsProcessor

    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=2,
            logits_processor=[LogitsProcessor(compiled)],
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module")
def hf_case(padded_llama, tokenizer, library):
    """Each prompt with each constraint, and Hugging Face's structured greedy tokens for them."""
    model = transformers.AutoModelForCausalLM.from_pretrained(padded_llama, dtype=torch.float32).eval()
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    cases = [(ids, kind) for ids in prompt_ids for kind in CONSTRAINTS]
    expected = [hf_structured(model, library(CONSTRAINTS[k]), ids, 24) for ids, k in cases]
    return cases, expected


BATCHING = {
    "one_batch": {},
    "chunked_prefill": dict(max_num_batched_tokens=5),
    "prefix_caching": dict(block_size=4),
    "preempt_recompute": dict(kv_cache_memory=12 * 4096, block_size=8, preemption_mode="recompute"),
    "preempt_swap": dict(kv_cache_memory=12 * 4096, block_size=8, preemption_mode="swap"),
}


@pytest.mark.parametrize("name", list(BATCHING))
def test_greedy_output_is_hf_generate_with_the_library_mask(padded_llama, hf_case, library, name):
    """Float32 greedy: the engine's tokens are Hugging Face's with xgrammar's mask, one batch of
    all constraints, whatever the batching (chunked prefill, prefix caching, preemption by
    recompute and by swap); each completion fits its constraint."""
    cases, expected = hf_case
    llm = LLM(str(padded_llama), dtype="float32", num_threads=1, **BATCHING[name])
    params = [
        SamplingParams(temperature=0, max_tokens=24, structured_outputs=CONSTRAINTS[k]) for _, k in cases
    ]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids, _ in cases], params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for p, o in zip(params, outputs, strict=True):
        assert_valid(library, p, o.outputs[0])
    assert {o.outputs[0].finish_reason for o in outputs} == {"stop", "length"}
    if name.startswith("preempt"):
        assert llm.llm_engine.totals.preemptions > 0, "the cache was meant to force preemption"
    assert llm.llm_engine.totals.mask_time_s > 0


def test_n2_and_seeds_are_valid_and_batch_independent(llm, padded_llama, library):
    """n=2 seeded completions: each fits its constraint (a matcher each) and equals the n=1 request
    seeded with seed + i; the same under preemption by recompute and by swap (8 blocks of 8 tokens
    for 10 sequences of up to 32)."""
    prompt = {"prompt_token_ids": [1, *range(5, 16)]}
    runs = {}
    for mode in (None, "recompute", "swap"):
        small = dict(kv_cache_memory=8 * 4096, block_size=8, preemption_mode=mode)
        engine = llm if mode is None else LLM(str(padded_llama), dtype="float32", num_threads=1, **small)
        params = [
            SamplingParams(temperature=1.0, top_p=0.9, seed=7, n=2, max_tokens=20, structured_outputs=so)
            for so in CONSTRAINTS.values()
        ]
        outputs = engine.generate([prompt] * len(params), params)
        assert mode is None or engine.llm_engine.totals.preemptions > 0
        for p, o in zip(params, outputs, strict=True):
            assert len(o.outputs) == 2
            for c in o.outputs:
                assert_valid(library, p, c)
        runs[mode] = [[c.token_ids for c in o.outputs] for o in outputs]
    assert runs[None] == runs["recompute"] == runs["swap"]
    so = CONSTRAINTS["json"]
    alone = [
        llm.generate(
            [prompt],
            SamplingParams(temperature=1.0, top_p=0.9, seed=7 + i, max_tokens=20, structured_outputs=so),
        )[0]
        .outputs[0]
        .token_ids
        for i in range(2)
    ]
    assert runs[None][0] == alone


def test_stop_strings_max_tokens_and_ignore_eos(llm, library, tokenizer):
    """A stop string ends a structured row ("stop", text cut before it), max_tokens ends it
    ("length", its partial text kept), and with ignore_eos the grammar still ends it ("stop",
    without the EOS in its text)."""
    prompt = {"prompt_token_ids": [1, 5, 6, 7]}
    so = CONSTRAINTS["json"]
    (full,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, structured_outputs=so))
    text = full.outputs[0].text
    assert text.startswith('{"name": "')
    cut = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=60, stop=['"age"'], structured_outputs=so)
    )[0]
    assert cut.outputs[0].finish_reason == "stop" and text.startswith(cut.outputs[0].text)
    assert cut.outputs[0].text == text[: text.index('"age"')]
    short = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, structured_outputs=so))[
        0
    ].outputs[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3
    assert full.outputs[0].token_ids[:3] == short.token_ids and text.startswith(short.text)
    choice = CONSTRAINTS["choice"]
    kept = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, structured_outputs=choice)
    )
    c = kept[0].outputs[0]
    assert c.finish_reason == "stop" and c.text in choice.choice and c.token_ids[-1] in EOS_IDS


def test_structured_rows_do_not_speculate(padded_llama, llm):
    """With speculation on and a proposer that always has drafts, structured rows still decode one
    token a step (no drafts) and give the same tokens; a plain greedy row does get drafts."""
    spec = LLM(
        str(padded_llama),
        dtype="float32",
        num_threads=1,
        speculative_method="ngram",
        speculative_max_batch=64,
    )
    proposer = spec.llm_engine.scheduler.proposer
    proposer.propose = lambda token_ids, room: [token_ids[-1]] * min(room, 2)
    prompt = {"prompt_token_ids": [1, 5, 6, 7]}
    params = [
        SamplingParams(temperature=0, max_tokens=16, structured_outputs=so) for so in CONSTRAINTS.values()
    ]
    got = [o.outputs[0].token_ids for o in spec.generate([prompt] * len(params), params)]
    assert got == [o.outputs[0].token_ids for o in llm.generate([prompt] * len(params), params)]
    assert spec.llm_engine.totals.spec_decode_num_drafts == 0
    spec.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert spec.llm_engine.totals.spec_decode_num_drafts > 0


BAD = {
    "invalid schema": (StructuredOutputsParams(json={"type": "strng"}), 'Unsupported type "strng"'),
    "unsupported keyword": (
        StructuredOutputsParams(
            json={"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}
        ),
        "keyword 'uniqueItems' at #/properties/t",
    ),
    "bad regex": (StructuredOutputsParams(regex="([0-9]"), "is not a regex xgrammar can compile"),
    "bad grammar": (StructuredOutputsParams(grammar="root ::= item"), 'Rule "item" is not defined'),
}


def test_bad_constraints_fail_their_own_request_only(llm):
    """Each bad constraint is its request's error (finish_reason "error", naming the field, what is
    wrong and the fix); the good requests in the same batch finish as usual."""
    prompt = {"prompt_token_ids": [1, 5, 6, 7]}
    good = SamplingParams(temperature=0, max_tokens=8, structured_outputs=CONSTRAINTS["choice"])
    params = [good] + [SamplingParams(max_tokens=8, structured_outputs=so) for so, _ in BAD.values()] + [good]
    outputs = llm.generate([prompt] * len(params), params)
    assert outputs[0].outputs[0].finish_reason == outputs[-1].outputs[0].finish_reason == "stop"
    for out, (so, message) in zip(outputs[1:-1], BAD.values(), strict=True):
        assert out.outputs[0].finish_reason == "error"
        assert out.error.startswith(f"structured_outputs.{so.kind} ") and message in out.error
        assert "; " in out.error  # the fix follows


def test_a_schema_over_the_compile_time_limit_fails_its_requests_only(padded_llama, monkeypatch):
    """A constraint still compiling at the time limit is an error for each request that asks for
    it, while the others run (they do not wait for it); the engine stays usable."""
    llm = LLM(str(padded_llama), dtype="float32", num_threads=1, grammar_compile_timeout=0.5)
    slow = StructuredOutputsParams(regex="[a-z]{2}")
    real = GrammarCache._compile

    def compile_(self, params):
        if params.key == slow.key:
            time.sleep(3.0)
        return real(self, params)

    monkeypatch.setattr(GrammarCache, "_compile", compile_)
    prompt = {"prompt_token_ids": [1, 5, 6, 7]}
    params = [
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=slow),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=CONSTRAINTS["choice"]),
        SamplingParams(temperature=0, max_tokens=8, n=2, structured_outputs=slow),
        SamplingParams(temperature=0, max_tokens=8),
    ]
    start = time.perf_counter()
    outputs = llm.generate([prompt] * len(params), params)
    assert time.perf_counter() - start < 3.0  # nobody waited for the slow compile to end
    assert [o.outputs[0].finish_reason for o in outputs] == ["error", "stop", "error", "length"]
    for o in (outputs[0], outputs[2]):
        assert o.error.startswith("structured_outputs.regex did not compile within the time limit of 0.5 s")
    again = llm.generate([prompt], params[1])[0]
    assert again.outputs[0].finish_reason == "stop"
