"""Sampling and stopping: seeded rows independent of their batch, top-k/top-p/min-p filters, stop
strings across token boundaries, EOS handling (two EOS ids, ignore_eos, min_tokens) and incremental
detokenization of multi-byte text."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen import LLM
from batchgen.engine.detokenizer import check_stop, detokenize_incrementally
from batchgen.engine.request import Request
from batchgen.model.loading.loader import load_tokenizer, resolve_model
from batchgen.model.sampler import Sampler, SamplingBatch, filter_probs
from batchgen.sampling_params import SamplingParams

EOS_IDS = frozenset({2, 0})  # the tiny models' generation config lists [2, 0]
# One intra-op thread: on a shared 2-core machine two OpenMP threads spin against other jobs and are
# many times slower. The engine sets torch's thread count process-wide, so `restore_threads` resets it.
ENGINE_OPTIONS = dict(dtype="float32", kv_cache_memory=1 << 20, num_threads=1)


@pytest.fixture(scope="module", autouse=True)
def restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir: Callable[[str], Path]) -> LLM:
    return LLM(str(tiny_model_dir("llama")), **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):
    return load_tokenizer(resolve_model(str(default_model_dir)))


def make_request(
    params: SamplingParams,
    prompt: list[int] | None = None,
    max_tokens: int = 64,
    eos: frozenset[int] = frozenset(),
) -> Request:
    return Request("req", list(prompt or [1, 5, 6]), params, 0.0, max_tokens, eos_token_ids=eos)


def batch(n: int, **row) -> SamplingBatch:
    """`n` rows with the same settings (temperature 1, filters off unless given), shared generator."""
    return SamplingBatch(
        temperatures=[row.get("temperature", 1.0)] * n,
        top_ks=[row.get("top_k", 0)] * n,
        top_ps=[row.get("top_p", 1.0)] * n,
        min_ps=[row.get("min_p", 0.0)] * n,
        generators=[None] * n,
        banned_token_ids=[row.get("banned")] * n,
    )


def crafted_logits(probs: list[float], seed: int = 0) -> tuple[torch.Tensor, list[int]]:
    """Log-probabilities placed at shuffled vocabulary positions, so sorting is exercised.
    Returns ([1, V] logits, vocabulary ids in descending probability order)."""
    order = torch.randperm(len(probs), generator=torch.Generator().manual_seed(seed)).tolist()
    logits = torch.empty(1, len(probs))
    for rank, token in enumerate(order):
        logits[0, token] = torch.tensor(probs[rank]).log()
    return logits, order


PROBS = [0.42, 0.25, 0.13, 0.08, 0.05, 0.03, 0.02, 0.01, 0.006, 0.004]  # sorted, sums to 1


# ---- seeded rows ----


def test_seeded_row_ignores_its_neighbours(tiny_llm: LLM) -> None:
    prompt = "The quick brown fox jumps over"
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)

    def tokens(outs, i: int = 0) -> list[int]:
        return outs[i].outputs[0].token_ids

    alone = tokens(tiny_llm.generate([prompt], seeded))
    assert len(alone) == 12
    unseeded = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    with_unseeded = tiny_llm.generate(
        ["Hello there", prompt, "A much longer neighbour prompt that shifts every row of the batch", "x"],
        [unseeded, seeded, unseeded, unseeded],
    )
    assert tokens(with_unseeded, 1) == alone
    mixed = [
        SamplingParams(temperature=0.7, top_p=0.5, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=1.3, top_k=5, max_tokens=6, ignore_eos=True),
        seeded,
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=0.2, seed=7, max_tokens=12, ignore_eos=True),
    ]
    with_others = tiny_llm.generate(["Once", "Twice upon a time", prompt, prompt, prompt], mixed)
    assert tokens(with_others, 2) == alone
    # The seed does matter: another seed, or greedy, gives other tokens.
    other_seed = SamplingParams(temperature=1.0, seed=4321, max_tokens=12, ignore_eos=True)
    assert tokens(tiny_llm.generate([prompt], other_seed)) != alone
    assert tokens(with_others, 3) != alone
    assert tokens(with_others, 4) != alone


def test_top_k_1_equals_greedy(tiny_llm: LLM) -> None:
    prompts = ["Paged attention stores", "1 2 3 4", "Bonjour"]
    greedy = tiny_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    top1 = tiny_llm.generate(
        prompts, SamplingParams(temperature=1.0, top_k=1, max_tokens=10, ignore_eos=True)
    )
    assert [o.outputs[0].token_ids for o in top1] == [o.outputs[0].token_ids for o in greedy]
    # The sampler's own path (not the engine's greedy shortcut) agrees too.
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(torch.Generator().manual_seed(1))
    for temperature in (1.0, 0.6, 2.0):
        picked = sampler(logits.clone(), batch(64, temperature=temperature, top_k=1))
        assert torch.equal(picked, logits.argmax(dim=-1))


# ---- filters ----


def test_top_p_never_samples_outside_the_nucleus() -> None:
    logits, order = crafted_logits(PROBS)
    top_p = 0.7  # mass before each rank: 0, .42, .67, .80 -> the three most likely tokens
    nucleus = set(order[:3])
    probs = filter_probs(logits, [0], [top_p], [0.0])[0]
    kept = {i for i in range(len(PROBS)) if probs[i] > 0}
    assert kept == nucleus
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-6)
    for rank, token in enumerate(order[:3]):
        assert probs[token].item() == pytest.approx(PROBS[rank] / sum(PROBS[:3]), rel=1e-5)

    n = 4000
    sampler = Sampler(torch.Generator().manual_seed(0))
    draws = sampler(logits.repeat(n, 1), batch(n, top_p=top_p)).tolist()
    assert set(draws) == nucleus  # never outside, and every member is reached
    freq = draws.count(order[0]) / n
    assert freq == pytest.approx(PROBS[0] / sum(PROBS[:3]), abs=0.04)
    # The filter is per row: unfiltered rows of the same batch do leave the nucleus.
    rows = batch(2 * n, top_p=top_p)
    rows.top_ps = [top_p, 1.0] * n
    mixed = sampler(logits.repeat(2 * n, 1), rows)
    assert set(mixed[0::2].tolist()) <= nucleus
    assert set(mixed[1::2].tolist()) - nucleus


@pytest.mark.parametrize("min_p", [0.25, 0.5])
def test_min_p_filter(min_p: float) -> None:
    logits, order = crafted_logits(PROBS, seed=3)
    keep_ranks = [rank for rank, p in enumerate(PROBS) if p >= min_p * PROBS[0]]
    assert 1 < len(keep_ranks) < len(PROBS)
    kept_tokens = {order[r] for r in keep_ranks}
    probs = filter_probs(logits, [0], [1.0], [min_p])[0]
    assert {i for i in range(len(PROBS)) if probs[i] > 0} == kept_tokens
    mass = sum(PROBS[r] for r in keep_ranks)
    for r in keep_ranks:
        assert probs[order[r]].item() == pytest.approx(PROBS[r] / mass, rel=1e-5)
    draws = Sampler(torch.Generator().manual_seed(2))(logits.repeat(3000, 1), batch(3000, min_p=min_p))
    assert set(draws.tolist()) == kept_tokens


def test_banned_tokens_are_never_sampled() -> None:
    logits = torch.zeros(500, 50)
    logits[:, 2] = 30.0  # EOS would win every draw
    logits[:, 0] = 29.0
    sampler = Sampler(torch.Generator().manual_seed(0))
    for temperature in (0.0, 1.0):
        picked = sampler(logits.clone(), batch(500, temperature=temperature, banned=[2, 0]))
        assert not set(picked.tolist()) & {0, 2}
    assert set(sampler(logits.clone(), batch(500, temperature=0.0)).tolist()) == {2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_picks_the_first_maximum(dtype: torch.dtype) -> None:
    """Greedy rows take the lowest token id among tied maxima, as `argmax` and HF `generate` do."""
    logits = torch.randn(64, 49152).to(dtype)
    logits[0, [7, 30000, 49151]] = 100.0  # three-way tie
    logits[1, [49151, 2]] = 100.0
    picked = Sampler(torch.Generator().manual_seed(0))(logits.clone(), batch(64, temperature=0.0))
    assert picked.tolist() == logits.float().argmax(dim=-1).tolist()
    assert picked[:2].tolist() == [7, 2]


# ---- stop strings ----


def straddling_stop(tokenizer, token_ids: list[int], start: int = 0) -> tuple[str, int, int] | None:
    """A stop string made of the end of one token's text and the start of the next one's, whose
    first occurrence in the decoded text is at that boundary.

    Returns (stop string, index of the token that completes it, character position of the match).
    """
    for i in range(start, len(token_ids) - 1):
        before = tokenizer.decode(token_ids[: i + 1])
        after = tokenizer.decode(token_ids[: i + 2])
        new = after[len(before) :]
        if not after.startswith(before) or "\ufffd" in after or not before.strip() or not new.strip():
            continue
        k = min(2, len(before), len(new))
        stop = before[-k:] + new[:k]
        pos = len(before) - k
        if after.find(stop) == pos and stop.strip():
            return stop, i + 1, pos
    return None


def test_stop_string_spanning_two_tokens_is_cut_exactly(tokenizer) -> None:
    text = "Hello world, paged attention stores keys and values in blocks."
    ids = tokenizer.encode(text, add_special_tokens=False)
    found = straddling_stop(tokenizer, ids, start=1)
    assert found is not None
    stop, completes_at, pos = found
    assert stop not in tokenizer.decode(ids[:completes_at])  # neither token holds it alone
    assert stop not in tokenizer.decode(ids[completes_at : completes_at + 1])
    request = make_request(SamplingParams(stop=["never-matches", stop]), max_tokens=len(ids))
    reasons = []
    for token in ids:
        request.token_ids.append(token)
        reasons.append(check_stop(request, tokenizer, max_model_len=4096))
        if reasons[-1]:
            break
    assert reasons == [None] * completes_at + ["stop"]
    full = tokenizer.decode(ids[: completes_at + 1])
    assert request.output_text == full[:pos] == full[: full.find(stop)]
    assert request.stop_reason == stop


def test_stop_strings_wait_for_min_tokens(tokenizer) -> None:
    """As vLLM: a stop string ends a request only once it has more than `min_tokens` tokens; one
    completed before then stays in the text, and a later occurrence stops it."""
    text = "1, 2, 3, 4, 5, 6, 5, 7"
    ids = tokenizer.encode(text, add_special_tokens=False)

    def run(min_tokens: int) -> tuple[int, str | None, str]:
        request = make_request(SamplingParams(stop=[" 5"], min_tokens=min_tokens), max_tokens=len(ids))
        for token in ids:
            request.token_ids.append(token)
            if check_stop(request, tokenizer, max_model_len=4096):
                break
        return request.num_output_tokens, request.stop_reason, request.output_text

    first = tokenizer.decode(ids).find(" 5")
    count, reason, out = run(0)
    assert reason == " 5" and out == text[:first]
    late = text.find(" 5", first + 1)
    # min_tokens past the first " 5": the text keeps it and stops at the second one
    tokens_to_first = len(tokenizer.encode(text[: first + 2], add_special_tokens=False))
    count, reason, out = run(tokens_to_first)
    assert count > tokens_to_first and reason == " 5" and out == text[:late]


def test_stop_string_inside_multibyte_characters(tokenizer) -> None:
    text = "Hi 😀 你好世界 🎉 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    request = make_request(SamplingParams(stop="好世"), max_tokens=len(ids))
    for token in ids:
        request.token_ids.append(token)
        if check_stop(request, tokenizer, max_model_len=4096):
            break
    assert request.stop_reason == "好世"
    assert request.output_text == text[: text.find("好世")]


def test_stop_string_end_to_end(tiny_llm: LLM) -> None:
    tokenizer = tiny_llm.get_tokenizer()
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    found = None
    for prompt in ["The capital of France is", "Paged attention", "Once upon a time", "1 2 3"]:
        tokens = tiny_llm.generate([prompt], free)[0].outputs[0].token_ids
        found = straddling_stop(tokenizer, tokens)
        if found:
            break
    assert found is not None, "no usable token boundary in the tiny model's outputs"
    stop, completes_at, pos = found
    out = tiny_llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    )
    result = out[0].outputs[0]
    assert result.finish_reason == "stop" and result.stop_reason == stop
    assert result.token_ids == tokens[: completes_at + 1]  # generation ends at the completing token
    decoded = tokenizer.decode(result.token_ids)
    assert result.text == decoded[: decoded.find(stop)] == decoded[:pos]
    kept = tiny_llm.generate(
        [prompt],
        SamplingParams(
            temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
        ),
    )[0].outputs[0]
    assert kept.token_ids == result.token_ids and kept.text == decoded[:pos] + stop


def test_a_stop_tokens_text_is_left_out_unless_asked_for_as_in_vllm(tiny_llm: LLM, tokenizer) -> None:
    """vLLM's detokenizer leaves the token that stopped a request (a stop token id, or EOS with
    skip_special_tokens=False) out of `text`; it stays in `token_ids`."""
    prompt = [{"prompt_token_ids": [5, 6, 7, 8]}]
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = tiny_llm.generate(prompt, free)[0].outputs[0].token_ids
    stop_at = next(
        i for i in range(1, 8) if tokenizer.decode(tokens[i : i + 1]).strip() and tokens[i] not in tokens[:i]
    )
    for include in (False, True):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=8,
            stop_token_ids=[tokens[stop_at]],
            include_stop_str_in_output=include,
        )
        out = tiny_llm.generate(prompt, params)[0].outputs[0]
        assert out.token_ids == tokens[: stop_at + 1] and out.finish_reason == "stop"
        assert out.text == tokenizer.decode(out.token_ids if include else out.token_ids[:-1]), include
    length = tiny_llm.generate(prompt, free)[0].outputs[0]  # ended by max_tokens: every token's text
    assert length.finish_reason == "length" and length.text == tokenizer.decode(length.token_ids)


# ---- EOS ----


def test_ignore_eos_gives_the_request_no_eos_ids(tiny_llm: LLM, tokenizer) -> None:
    """`ignore_eos` works by the engine giving the request an empty EOS set: an EOS token then runs
    on to `max_tokens`."""
    engine = tiny_llm.llm_engine
    assert engine.eos_token_ids  # the tiny model has EOS ids to ignore
    engine.add_request("keeps", {"prompt_token_ids": [1, 5, 6]}, SamplingParams(max_tokens=3))
    engine.add_request(
        "ignores", {"prompt_token_ids": [1, 5, 6]}, SamplingParams(max_tokens=3, ignore_eos=True)
    )
    keeps, ignores = engine.requests["keeps"], engine.requests["ignores"]
    assert keeps.eos_token_ids == engine.eos_token_ids and ignores.eos_token_ids == frozenset()
    for request_id in ("keeps", "ignores"):
        engine.abort_request(request_id)
    eos = min(engine.eos_token_ids)
    for _ in range(2):
        ignores.token_ids.append(eos)
        assert check_stop(ignores, tokenizer, 4096) is None
    ignores.token_ids.append(eos)
    assert check_stop(ignores, tokenizer, 4096) == "length"


def test_check_stop_on_each_eos_id(tokenizer) -> None:
    for eos in sorted(EOS_IDS):
        request = make_request(SamplingParams(), eos=EOS_IDS)
        request.token_ids.append(eos)
        assert check_stop(request, tokenizer, 4096) == "stop"
        # min_tokens: an EOS before the minimum does not stop the request.
        early = make_request(SamplingParams(min_tokens=2), eos=EOS_IDS)
        early.token_ids.append(eos)
        assert check_stop(early, tokenizer, 4096) is None
        early.token_ids.append(eos)
        assert check_stop(early, tokenizer, 4096) == "stop"


def eos_model(src: Path, dst: Path, winner: int) -> Path:
    """A copy of the tiny model whose every greedy token is `winner`: attention and MLP outputs are
    zeroed (the residual is the embedding), every embedding gets +1 in dimension 0, the final norm
    keeps only that dimension, and only the `winner` row of the LM head reads it."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    weights["model.embed_tokens.weight"][:, 0] = 1.0
    weights["model.norm.weight"].zero_()
    weights["model.norm.weight"][0] = 1.0
    weights["lm_head.weight"].zero_()
    weights["lm_head.weight"][winner, 0] = 1.0
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("winner", sorted(EOS_IDS))
def test_eos_ignore_eos_and_min_tokens_end_to_end(
    winner: int, tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    llm = LLM(str(eos_model(tiny_model_dir("llama"), tmp_path / "eos", winner)), **ENGINE_OPTIONS)
    assert llm.llm_engine.eos_token_ids == EOS_IDS
    prompt = "Tell me a story"
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0]
    assert plain.token_ids == [winner] and plain.finish_reason == "stop"

    ignoring = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[
        0
    ].outputs[0]
    assert ignoring.token_ids == [winner] * 8 and ignoring.finish_reason == "length"

    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    assert len(llm.generate([prompt], sampled)[0].outputs[0].token_ids) == 6

    delayed = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3))[0].outputs[
        0
    ]
    assert len(delayed.token_ids) == 4 and delayed.finish_reason == "stop"
    assert not set(delayed.token_ids[:3]) & EOS_IDS  # both EOS ids banned until 3 tokens exist
    assert delayed.token_ids[3] == winner


# ---- incremental detokenization ----


@pytest.mark.parametrize(
    "text",
    [
        "Hi 😀 你好世界 🎉 naïve café — ünïcödé 🇫🇷 done",
        "日本語のテキスト、絵文字👩‍👩‍👧‍👦と混在。",
        "  leading spaces\n\ttabs and\nnewlines 🙂🙂🙂",
    ],
)
def test_incremental_detokenization_matches_one_shot(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert any("\ufffd" in p for p in pieces), "the text should split characters across tokens"
    request = make_request(SamplingParams(), prompt=tokenizer.encode("Say:", add_special_tokens=False))
    held_back = 0
    for i, token in enumerate(ids):
        request.token_ids.append(token)
        new = detokenize_incrementally(tokenizer, request)
        held_back += new == ""
        assert "\ufffd" not in request.output_text
        assert tokenizer.decode(ids[: i + 1]).startswith(request.output_text)
    assert request.output_text == tokenizer.decode(ids) == text
    assert held_back > 0  # partial characters were held back, not emitted as U+FFFD


def test_penalties_by_hand() -> None:
    """Prompt [1, 2], output [3, 3, 4]: repetition 2 on 1-4, then presence 0.5 and frequency 0.25
    on the output's 3 (twice) and 4 (once); token 5 was never seen; row 1 has no penalty."""
    from batchgen.model.sampler import RowPenalty, apply_penalties

    logits = torch.tensor([[1.0, 2.0, -2.0, 4.0, 6.0, 8.0], [1.0, 2.0, -2.0, 4.0, 6.0, 8.0]])
    penalty = RowPenalty([1, 2, 3, 3, 4], 2, presence=0.5, frequency=0.25, repetition=2.0)
    apply_penalties(logits, [penalty, None])
    assert logits[0].tolist() == [1.0, 1.0, -4.0, 2.0 - 0.5 - 0.5, 3.0 - 0.25 - 0.5, 8.0]
    assert logits[1].tolist() == [1.0, 2.0, -2.0, 4.0, 6.0, 8.0]


def test_penalties_turn_greedy_away_from_repeats() -> None:
    """A frequency penalty larger than the gap moves greedy off the repeated token; bf16 logits
    are penalized in float32."""
    from batchgen.model.sampler import RowPenalty

    logits = torch.tensor([[0.0, 3.0, 2.5]], dtype=torch.bfloat16)
    rows = batch(1, temperature=0.0)
    assert Sampler(torch.Generator())(logits.clone(), rows).tolist() == [1]
    rows.penalties = [RowPenalty([0, 1, 1], 1, frequency=0.3)]
    assert Sampler(torch.Generator())(logits.clone(), rows).tolist() == [2]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", "x"),
    ],
)
def test_penalty_ranges(field, value) -> None:
    with pytest.raises((ValueError, TypeError), match=field):
        SamplingParams(**{field: value})


def test_neutral_penalties_keep_the_row_hash_fields() -> None:
    """Rows hashed before the penalties existed keep their identity (resume): neutral penalties are
    not in `to_dict`, set ones are."""
    assert "presence_penalty" not in SamplingParams().to_dict()
    assert SamplingParams(repetition_penalty=1.2).to_dict()["repetition_penalty"] == 1.2


def test_sample_logprobs_by_hand() -> None:
    """Logits [0, 1, 2, 3]: log-softmax is logit - log(1 + e + e^2 + e^3); a sampled token outside the
    top k keeps its own rank."""
    import math

    from batchgen.model.sampler import sample_logprobs

    norm = math.log(sum(math.exp(x) for x in range(4)))
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]], dtype=torch.bfloat16)
    a, b = sample_logprobs(logits, [0, 3], [2, 0])
    assert (a.token_id, a.rank, b.rank, b.top) == (0, 4, 1, [])
    assert a.logprob == pytest.approx(-norm) and b.logprob == pytest.approx(3 - norm)
    assert [t for t, _ in a.top] == [3, 2] and [v for _, v in a.top] == pytest.approx([3 - norm, 2 - norm])


@pytest.mark.parametrize("case", ["greedy", "sampled", "mixed"])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_sample_logprobs_ranks_match_a_full_count(case: str, k: int) -> None:
    """Ranks read off the top k (every chosen token among them) equal the count over the whole
    vocabulary, with tied logits (small integers) in every row; so do the log probabilities."""
    from batchgen.model.sampler import sample_logprobs

    gen = torch.Generator().manual_seed(k)
    logits = torch.randint(0, 4, (6, 40), generator=gen).float()
    best = logits.argmax(dim=-1)
    other = torch.randint(0, 40, (6,), generator=gen)
    chosen = {"greedy": best, "sampled": other, "mixed": torch.where(torch.arange(6) % 2 == 0, best, other)}[
        case
    ]
    found = sample_logprobs(logits, chosen.tolist(), [k] * 6)
    lp = torch.log_softmax(logits, dim=-1)
    for row, f in enumerate(found):
        token = int(chosen[row])
        assert f.rank == 1 + int((lp[row] > lp[row, token]).sum())
        assert f.logprob == pytest.approx(float(lp[row, token]))
        assert [v for _, v in f.top] == pytest.approx(sorted(lp[row].tolist(), reverse=True)[:k])


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_the_sampled_token_comes_first_among_its_ties(k: int) -> None:
    """topk orders tied log probabilities arbitrarily: the top list named another token of the same
    probability before the one greedy picked. The sampled token is listed first among its ties, at
    its rank, and the list keeps k entries (another tied token drops out when k is full)."""
    from batchgen.model.sampler import sample_logprobs

    logits = torch.zeros(4, 40)
    logits[:, [3, 9, 17, 30]] = 5.0  # four tokens tied for the top
    logits[2, 1] = 6.0  # row 2: one token above the tie
    chosen = [30, 17, 30, 9]
    for row, f in enumerate(sample_logprobs(logits, chosen, [k] * 4)):
        ids = [t for t, _ in f.top]
        assert len(ids) == k and len(set(ids)) == k
        assert ids[f.rank - 1 : f.rank] == [chosen[row]][: max(0, k - f.rank + 1)], (row, ids)
        assert f.rank == (2 if row == 2 else 1)
        lps = [v for _, v in f.top]
        assert lps == sorted(lps, reverse=True)


def test_logprobs_zero_gives_the_sampled_token_only(tiny_llm) -> None:
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=5, ignore_eos=True, logprobs=0)
    (out,) = tiny_llm.generate([{"prompt_token_ids": [1, 5, 6]}], params)
    completion = out.outputs[0]
    assert [list(d) for d in completion.logprobs] == [[t] for t in completion.token_ids]
    assert all(
        d[t].rank >= 1 and d[t].logprob <= 0
        for d, t in zip(completion.logprobs, completion.token_ids, strict=True)
    )
    assert completion.cumulative_logprob == pytest.approx(
        sum(d[t].logprob for d, t in zip(completion.logprobs, completion.token_ids, strict=True))
    )
    (plain,) = tiny_llm.generate([{"prompt_token_ids": [1, 5, 6]}], SamplingParams(max_tokens=2))
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None


@pytest.mark.parametrize("value", [-1, 21, 2.5, True])
def test_logprobs_range(value) -> None:
    with pytest.raises((ValueError, TypeError), match="logprobs"):
        SamplingParams(logprobs=value)


def test_an_extreme_repetition_penalty_saturates_instead_of_overflowing() -> None:
    """1e-38 divides a positive logit past float32's range: the result is the largest finite float,
    so temperature sampling still sees a distribution (no NaN, no token picked by accident)."""
    from batchgen.model.sampler import RowPenalty, apply_penalties

    logits = torch.tensor([[5.0, 1.0, -1.0, 0.5]])
    apply_penalties(logits, [RowPenalty([0, 2], 1, repetition=1e-38)])
    assert torch.isfinite(logits).all() and logits[0, 0] == torch.finfo(torch.float32).max
    rows = batch(1, temperature=1.0)
    rows.penalties = [RowPenalty([0, 2], 1, repetition=1e-38)]
    assert Sampler(torch.Generator().manual_seed(0))(
        torch.tensor([[5.0, 1.0, -1.0, 0.5]]), rows
    ).tolist() == [0]


def _penalize_row_by_row(logits: torch.Tensor, penalties) -> None:
    """The penalties written the plain way, one row and one token at a time (the reference)."""
    for row, p in enumerate(penalties):
        if p is None:
            continue
        for token in set(p.token_ids):
            value = logits[row, token]
            logits[row, token] = value / p.repetition if value > 0 else value * p.repetition
        output = p.token_ids[p.num_prompt_tokens :]
        for token in set(output):
            logits[row, token] -= p.frequency * output.count(token) + p.presence


@pytest.mark.parametrize("seed", range(6))
def test_batched_penalties_equal_the_row_by_row_reference(seed) -> None:
    """Random batches: some rows without penalties, repeated tokens, empty outputs, mixed penalties."""
    from batchgen.model.sampler import RowPenalty, apply_penalties

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 50, generator=g) * 3

    def draw() -> float:
        return float(torch.rand(1, generator=g)) * 4 - 2

    penalties = []
    for row in range(6):
        if row % 3 == seed % 3:
            penalties.append(None)
            continue
        ids = torch.randint(0, 50, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        prompt = int(torch.randint(0, len(ids) + 1, (1,), generator=g))
        penalties.append(RowPenalty(ids, prompt, draw(), draw(), [1.0, 1.5, 0.6][row % 3]))
    expected = logits.clone()
    _penalize_row_by_row(expected, penalties)
    apply_penalties(logits, penalties)
    assert torch.allclose(logits, expected, rtol=0, atol=1e-6)


def test_nan_logits_fail_their_request_not_the_batch(tiny_llm) -> None:
    """A row whose logits hold a NaN is not sampled as some token: that request ends with
    finish_reason "error" and the reason, and the others in the batch are unchanged."""
    prompts = [{"prompt_token_ids": [1, 5, 6]}, {"prompt_token_ids": [7, 8, 9, 10]}]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    clean = tiny_llm.generate(prompts, params)
    runner = tiny_llm.llm_engine.runner
    model = runner.model
    calls = []

    def poisoned(*args, **kwargs):
        logits = model(*args, **kwargs)
        calls.append(1)
        if len(calls) == 3:  # the third step: decodes of both, the second row's logits go bad
            logits[1, 7] = float("nan")
        return logits

    runner.model = poisoned
    try:
        ok, bad = tiny_llm.generate(prompts, params)
    finally:
        runner.model = model
    assert ok.outputs[0].token_ids == clean[0].outputs[0].token_ids and ok.error is None
    assert bad.outputs[0].finish_reason == "error" and "NaN or infinite logits" in bad.error
    assert bad.outputs[0].token_ids == clean[1].outputs[0].token_ids[:2]  # what it had before
