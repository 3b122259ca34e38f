"""Batched sampling: token masks (structured outputs), presence / frequency / repetition penalties,
greedy, temperature, top-k, top-p (nucleus), min-p, per-request seeded generators."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from batchgen.kernels.cpu.ops import apply_token_bitmask, greedy_rows


@dataclass
class RowPenalty:
    """One row's penalties and the tokens they apply to (see `SamplingParams` for each penalty).

    Attributes:
        token_ids: the sequence so far, prompt then output (the request's own list, read only).
        num_prompt_tokens: how many of `token_ids` are the prompt (presence and frequency
            penalties count only the output; the repetition penalty counts both, as in vLLM and HF).
    """

    token_ids: list[int]
    num_prompt_tokens: int
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0


@dataclass
class SamplingBatch:
    """Per-row sampling settings for a `[B, vocab]` logits tensor.

    Attributes:
        temperatures / top_ps / min_ps: float lists of length B (temperature 0 = greedy row).
        top_ks: int list; 0 or -1 = off.
        generators: the row's own generator (seeded request) or None (the engine's shared one).
        banned_token_ids: per row, token ids that may not be sampled now (EOS and stop ids while
            fewer than `min_tokens` tokens exist).
        penalties: per row, its `RowPenalty` or None (no penalty); None for the whole batch = none.
    """

    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    min_ps: list[float]
    generators: list[torch.Generator | None]
    banned_token_ids: list[list[int] | None]
    penalties: list[RowPenalty | None] | None = None

    # Cached: the runner keeps a batch while a step decodes the same rows (`step_rows`); the
    # lists are never changed after the batch is built.
    @cached_property
    def all_greedy(self) -> bool:
        """Whether every row has temperature 0 (then the batch is one argmax)."""
        return all(t == 0.0 for t in self.temperatures)

    @cached_property
    def plain_greedy(self) -> bool:
        """Whether every row is greedy with no banned ids or penalty (one argmax, nothing else)."""
        penalized = self.penalties is not None and any(p is not None for p in self.penalties)
        return self.all_greedy and not any(self.banned_token_ids) and not penalized


class Sampler:
    """Turns logits `[B, vocab]` (any float dtype) into token ids `[B]` (int64).

    Random rows use the exponential-race trick: `argmax(probs / q)` with `q ~ Exp(1)` draws from
    `probs` exactly (the Gumbel-max trick in another form), and lets each seeded row draw its noise from
    its own generator, so its tokens do not depend on the other rows of the batch.

    Args:
        generator: shared generator for rows without their own seed.
    """

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def greedy_rows(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor | None:
        """For a batch of greedy rows only, without banned ids or penalties: int64 `[2, B]`, each
        row's argmax (as `__call__` gives it) and finite flag (as `runner.finite_rows`, 1 or 0), in
        one pass of the C kernel (`kernels/cpu/csrc/greedy_rows.c`: 7x torch's `max` and row sum
        on 256 bf16 rows of a 49k vocabulary, docs/benchmarks.md). None for any other batch, or
        where the kernel does not take the logits (not on the CPU, float16, no C library)."""
        return greedy_rows(logits) if batch.plain_greedy else None

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Token ids int64 `[B]` from logits `[B, vocab]` (float32 or the model dtype).

        `logits` is modified in place: banned ids (EOS before `min_tokens`) are set to -inf and
        the filters mask rows; pass a copy to keep the original. With any penalty in the batch the
        logits are widened to float32 first (as vLLM computes them), then penalized
        (`apply_penalties`), then banned, then sampled.
        """
        if batch.penalties and any(p is not None for p in batch.penalties):
            logits = logits.float()
            apply_penalties(logits, batch.penalties)
        for row, banned in enumerate(batch.banned_token_ids):
            if banned:
                logits[row, banned] = float("-inf")
        if batch.all_greedy:
            # `max(dim).indices` is argmax (first maximum on ties) but faster on CPU (measured:
            # docs/benchmarks.md). Widening to float32 is exact,
            # so the model dtype picks the same token.
            return logits.max(dim=-1).indices
        logits = logits.float()
        greedy = torch.tensor([t == 0.0 for t in batch.temperatures], device=logits.device)
        temps = torch.tensor([t if t > 0 else 1.0 for t in batch.temperatures], device=logits.device)
        probs = filter_probs(logits / temps[:, None], batch.top_ks, batch.top_ps, batch.min_ps)
        noise = torch.empty_like(probs)
        shared = [i for i, g in enumerate(batch.generators) if g is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1], device=probs.device).exponential_(
                generator=self.generator
            )
        for i, gen in enumerate(batch.generators):
            if gen is not None:
                noise[i].exponential_(generator=gen)
        # An Exp(1) draw of exactly 0 would turn 0/0 into NaN and win the argmax.
        sampled = (probs / noise.clamp_(min=1e-20)).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)


class TokenMasks:
    """The step's token bitmasks: filled on the CPU by each sampled row's `TokenMask`
    (`batchgen.model.step`), applied to the logits before sampling (masked tokens to -inf).

    One int32 buffer `[rows, ceil(vocab_size / 32)]` (pinned on CUDA, so its copy to the device
    is asynchronous) is kept and grown as needed. Its width covers the logits' whole vocabulary,
    the ids a model pads its lm_head with past the tokenizer's included (the grammar never allows
    those). The apply is batchgen's C kernel on the CPU (`kernels/cpu/csrc/token_mask.c`: xgrammar's
    C++ one took 9.5 ms for 64 rows of a 49k vocabulary, docs/benchmarks.md), xgrammar's Triton one
    on CUDA and its C++ one where the C library is not built.

    Args:
        vocab_size: the logits' width.
        device: where the logits are.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.width = -(-vocab_size // 32)
        self.device = device
        self._host: torch.Tensor | None = None

    def fill(self, masks: list[Any]) -> tuple[torch.Tensor, list[int]] | None:
        """Fill the rows of the sampled rows that have a mask (`masks[i]` None: no mask); returns
        (bitmask `[len(masks), width]` int32 on the CPU, the rows that need masking) or None when
        none does."""
        if all(m is None for m in masks):
            return None
        if self._host is None or self._host.shape[0] < len(masks):
            rows = max(len(masks), 2 * (0 if self._host is None else self._host.shape[0]))
            pin = self.device.type == "cuda"
            self._host = torch.empty((rows, self.width), dtype=torch.int32, pin_memory=pin)
        bitmask = self._host[: len(masks)]
        masked = [i for i, m in enumerate(masks) if m is not None and m.fill_bitmask(bitmask, i)]
        return (bitmask, masked) if masked else None

    def apply(self, logits: torch.Tensor, filled: tuple[torch.Tensor, list[int]]) -> None:
        """Set the masked tokens of `filled`'s rows of `logits` `[rows, vocab_size]` (float32,
        bfloat16 or float16) to -inf, in place."""
        from xgrammar import apply_token_bitmask_inplace

        bitmask, rows = filled
        if apply_token_bitmask(logits, bitmask, rows):  # batchgen's C kernel, on the CPU
            return
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)


@dataclass
class SampleLogprobs:
    """Log probabilities at one sampled position (natural log of the raw logits' softmax).

    Attributes:
        token_id / logprob / rank: the sampled token, its log probability and its rank (1 = most likely).
        top: the `k` most likely (token id, log probability) pairs, most likely first.
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


def sample_logprobs(
    raw_logits: torch.Tensor, token_ids: list[int], top_ks: list[int]
) -> list[SampleLogprobs]:
    """Log probabilities of `token_ids` and the `top_ks[i]` best tokens of each row of `raw_logits`
    `[R, vocab]` (any float dtype; computed in float32). Ranks count the tokens strictly more likely,
    plus one: read off the top k when every chosen token is among them (always for greedy rows),
    else counted over the whole vocabulary (a pass as long as the log-softmax; on a subset of rows
    it would cost a copy of them first).
    """
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
    chosen_lp = logprobs.gather(1, torch.tensor(token_ids, device=logprobs.device)[:, None])
    k = max(top_ks)
    if k:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        ranks = (top_lp > chosen_lp).sum(dim=-1) + 1
        outside = bool((chosen_lp[:, 0] < top_lp[:, -1]).any())
    else:  # only the chosen tokens: the row max says whether a rank needs counting
        top_lp = top_ids = logprobs[:, :0]
        ranks = torch.ones(len(token_ids), dtype=torch.long, device=logprobs.device)
        outside = bool((chosen_lp[:, 0] < logprobs.amax(dim=-1)).any())
    if outside:
        ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    top_lps, top_id_rows = top_lp.tolist(), top_ids.tolist()  # to the host once, not per row
    return [
        SampleLogprobs(
            token, value, rank, _chosen_first(token, value, rank, top_id_rows[i][:k], top_lps[i][:k])
        )
        for i, (token, value, rank, k) in enumerate(
            zip(token_ids, chosen_lp[:, 0].tolist(), ranks.tolist(), top_ks, strict=True)
        )
    ]


def _chosen_first(
    token: int, value: float, rank: int, ids: list[int], lps: list[float]
) -> list[tuple[int, float]]:
    """The top (token id, log probability) pairs with the sampled `token` first among the tokens
    tied with it, at its `rank` (topk orders ties arbitrarily: greedy picked the token but the list
    could name another of equal probability first). A sampled token outside the top k stays out."""
    top = list(zip(ids, lps, strict=True))
    if rank > len(top) or top[rank - 1][0] == token:
        return top
    others = [pair for pair in top if pair[0] != token]
    return (others[: rank - 1] + [(token, value)] + others[rank - 1 :])[: len(top)]


def apply_penalties(logits: torch.Tensor, penalties: list[RowPenalty | None]) -> None:
    """Penalize float32 logits `[B, vocab]` in place (rows with None are left alone).

    Repetition (Keskar et al. 2019): every distinct token of the prompt and output has its logit
    divided by the penalty when positive, multiplied when negative. Then presence and frequency
    (OpenAI's definition): logit -= frequency x count + presence, for each distinct output token.
    The order and the token sets follow vLLM's `apply_penalties`; HF `generate`'s repetition
    penalty is the same operation. All rows are done at once on the flat indices (row x vocab +
    token) of the tokens they hold: a few kernels a step whatever the batch (on a GPU, per-row
    calls would each pay a launch and a host sync), and no `[rows, vocab]` temporaries.
    """
    chosen = [(row, p) for row, p in enumerate(penalties) if p is not None]
    if not chosen:
        return
    vocab, device = logits.shape[1], logits.device
    lengths = np.fromiter((len(p.token_ids) for _, p in chosen), dtype=np.int64, count=len(chosen))
    tokens = np.fromiter(
        itertools.chain.from_iterable(p.token_ids for _, p in chosen),
        dtype=np.int64,
        count=int(lengths.sum()),
    )
    owner = np.repeat(np.arange(len(chosen)), lengths)  # index into `chosen` of each token
    start = np.repeat(np.cumsum(lengths) - lengths, lengths)
    prompt_len = np.repeat(
        np.fromiter((p.num_prompt_tokens for _, p in chosen), np.int64, len(chosen)), lengths
    )
    is_output = np.arange(tokens.size) - start >= prompt_len
    rows = np.fromiter((row for row, _ in chosen), dtype=np.int64, count=len(chosen))
    flat = logits.view(-1)

    def per_token(values: list[float], where: np.ndarray) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=device)[torch.from_numpy(where).to(device)]

    repetition = [p.repetition for _, p in chosen]
    if any(r != 1.0 for r in repetition):
        keys, first = np.unique(rows[owner] * vocab + tokens, return_index=True)
        index = torch.from_numpy(keys).to(device)
        factor = per_token(repetition, owner[first])
        values = flat[index]
        # An extreme penalty (1e-38 divides a logit, 1e38 multiplies one, past float32's range):
        # saturate at the largest finite values rather than hand the sampler infinities (and
        # softmax a NaN). The bans come after this, so no -inf is lost here.
        largest = torch.finfo(logits.dtype).max
        flat[index] = torch.where(values > 0, values / factor, values * factor).clamp_(-largest, largest)
    presence = [p.presence for _, p in chosen]
    frequency = [p.frequency for _, p in chosen]
    if is_output.any() and (any(presence) or any(frequency)):
        keys, first, counts = np.unique(
            rows[owner[is_output]] * vocab + tokens[is_output], return_index=True, return_counts=True
        )
        out_owner = owner[is_output][first]
        index = torch.from_numpy(keys).to(device)
        counts_t = torch.from_numpy(counts).to(device=device, dtype=logits.dtype)
        flat[index] -= per_token(frequency, out_owner) * counts_t + per_token(presence, out_owner)


def filter_probs(
    logits: torch.Tensor, top_ks: list[int], top_ps: list[float], min_ps: list[float]
) -> torch.Tensor:
    """Softmax of `logits` `[B, V]` with top-k, top-p and min-p applied per row; returns `[B, V]` float32.

    top-p keeps the smallest set of most likely tokens whose mass reaches `top_p` (Holtzman et al.
    2020); min-p drops tokens below `min_p` x the top probability (Nguyen et al. 2024). The most likely
    token always survives.
    """
    vocab = logits.shape[1]
    ks = [k if 0 < k < vocab else vocab for k in top_ks]
    if any(k < vocab for k in ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= torch.tensor(ks, device=logits.device)[:, None]
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Mass of the tokens strictly before each one: a token is kept while that is below top_p.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= torch.tensor(top_ps, device=logits.device)[:, None]
        drop[:, 0] = False
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    if any(p > 0.0 for p in min_ps):
        threshold = (
            probs.max(dim=-1, keepdim=True).values * torch.tensor(min_ps, device=logits.device)[:, None]
        )
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
