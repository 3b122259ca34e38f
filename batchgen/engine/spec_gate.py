"""The speculative decoding gate: the largest running batch at which verifying drafts is still cheap.

Verifying K drafts turns a request's one decode row into K + 1 rows. While a step is bound by
streaming the weights (small batches), extra rows cost little; once it is bound by compute, every
row costs its share, and speculation only pays if most drafts are accepted (measured by others:
vLLM gates speculation off above a batch size for this reason). The gate is read off this machine's
own cost curve when the engine starts: for batches B = 1, 2, 4, ..., the time of a step of B decode
rows, `t_dec(B)`, and of B requests verifying K drafts each, `t_spec(B)`. Speculation runs while

    t_spec(B) <= GATE_COST_RATIO * t_dec(B)

that is, while the K extra rows of each request cost at most one decode row's share of the step
(`t_dec(B) / B` per request, B of them: `t_spec - t_dec <= t_dec`). At that cost a verification
pays for itself once one draft in K is accepted per step on average; below the gate it costs less.
The boundary between the last batch that passes and the first that fails is interpolated linearly.
The result is cached per machine, model shape, K and kernel choice (`gate_cache_key`), so every
start on one machine gets the same gate (on a shared machine a fresh measurement moves by a batch
or two).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from batchgen.cache import cache_root, write_atomically
from batchgen.engine.spec_decode import NgramProposer
from batchgen.kernels.registry import fastest_seconds, machine_key
from batchgen.model.step import StepInput

logger = logging.getLogger(__name__)

# t_spec(B) / t_dec(B) at the gate: the K extra rows of each request cost one decode row's share.
GATE_COST_RATIO = 2.0
# Context of the synthetic sequences (tokens): attention reads it for every row, as in a real tail.
GATE_CONTEXT = 256
GATE_CACHE_VERSION = 1


@dataclass
class GateMeasurement:
    """The gate and the points it was read from.

    Attributes:
        max_batch: speculation runs while the running batch is at most this (0: never).
        points: per batch measured, (B, t_dec seconds, t_spec seconds).
        cached: read from the cache, not measured in this process.
    """

    max_batch: int
    points: list[tuple[int, float, float]] = field(default_factory=list)
    cached: bool = False

    def describe(self) -> str:
        where = "cached measurement" if self.cached else "measured"
        return f"gate running batch <= {self.max_batch} ({where})"


@dataclass
class SpeculationPlan:
    """What the engine speculates with: the proposer, its gate and where the gate came from."""

    proposer: NgramProposer
    max_batch: int
    source: str

    def describe(self) -> str:
        p = self.proposer
        gate = f"gate running batch <= {self.max_batch} (set)" if self.source == "set" else self.source
        return f"speculative ngram k={p.k} n={p.n_min}-{p.n_max}, {gate}"


def gate_from_points(points: list[tuple[int, float, float]], ratio: float = GATE_COST_RATIO) -> int:
    """The largest batch whose `t_spec / t_dec` is at most `ratio`, interpolated between the last
    measured batch that passes and the next one (points sorted by batch, measured until one fails).
    0 when the first point already fails."""
    gate = 0
    previous: tuple[int, float] | None = None
    for batch, t_dec, t_spec in points:
        cost = t_spec / t_dec
        if cost > ratio:
            if previous is not None:
                last_batch, last_cost = previous
                share = (ratio - last_cost) / (cost - last_cost)
                gate = last_batch + int(share * (batch - last_batch))
            return gate
        gate, previous = batch, (batch, cost)
    return gate


def _synthetic_step(batch: int, drafts: int, context: int, block_table: list[int]) -> list[StepInput]:
    """`batch` greedy rows at position `context`, each with `drafts` draft tokens (0: a decode),
    all on one block table (their K/V writes land on the same slots: harmless at start, before
    any block holds a request's K/V)."""
    return [
        StepInput(
            token_ids=[1] * (drafts + 1),
            start=context,
            block_table=block_table,
            sample=True,
            num_draft_tokens=drafts,
        )
        for _ in range(batch)
    ]


def measure_points(runner: Any, k: int, max_batch: int, ratio: float = GATE_COST_RATIO) -> list[tuple]:
    """(B, t_dec, t_spec) for B = 1, 2, 4, ... up to `max_batch`, until one fails the ratio.

    Each time is the fastest of interleaved rounds (`kernels.registry.fastest_seconds`), after one
    warm-up call of each shape.
    """
    bs = runner.block_size
    context = max(min(GATE_CONTEXT, runner.num_blocks * bs - (k + 1)), 0)
    table = list(range(min(runner.num_blocks, -(-(context + k + 1) // bs))))
    points = []
    batch = 1
    while batch <= max_batch:
        dec = _synthetic_step(batch, 0, context, table)
        spec = _synthetic_step(batch, k, context, table)
        calls = {"dec": lambda s=dec: runner.execute(s), "spec": lambda s=spec: runner.execute(s)}
        for call in calls.values():
            call()
        best = fastest_seconds(calls, min_rounds=3, max_rounds=10, min_total_s=0.05)
        points.append((batch, best["dec"], best["spec"]))
        if best["spec"] > ratio * best["dec"]:
            break
        batch *= 2
    return points


def gate_cache_key(runner: Any, k: int, max_batch: int, dtype: torch.dtype) -> dict[str, str]:
    """What the gate depends on: the kernels' machine key, the GPU if any, the model's shape, the
    attention backend and kernel choice, K and the largest batch measured."""
    config = runner.config
    key = dict(machine_key(dtype))
    if runner.device.type == "cuda":
        key["gpu"] = torch.cuda.get_device_name(runner.device)
    shape = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "vocab_size")  # fmt: skip
    key["model"] = ",".join(str(getattr(config, name, None)) for name in shape)
    key["attention"] = runner.backend.name
    key["kernels"] = runner.kernel_choice.summary() or runner.kernel_choice.mode
    key.update(k=str(k), max_batch=str(max_batch), block_size=str(runner.block_size))
    key["gate_version"] = str(GATE_CACHE_VERSION)
    return key


def measure_gate(
    runner: Any, k: int, max_num_seqs: int, max_num_batched_tokens: int, dtype: torch.dtype
) -> GateMeasurement:
    """The gate for `runner`'s model on this machine: from the cache, else measured and cached.

    Batches are measured up to `max_num_seqs` and to the batch whose verification fits in the token
    budget (`max_num_batched_tokens // (k + 1)`). A cache folder that cannot be written costs a
    warning, not the run.
    """
    limit = max(min(max_num_seqs, max_num_batched_tokens // (k + 1)), 1)
    key = gate_cache_key(runner, k, limit, dtype)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = cache_root() / "spec_gate" / f"{digest}.json"
    try:
        data = json.loads(path.read_text())
        if data.get("key") == key and isinstance(data.get("max_batch"), int):
            points = [tuple(p) for p in data.get("points", [])]
            return GateMeasurement(data["max_batch"], points, cached=True)
    except (OSError, ValueError, AttributeError):
        pass  # no cache yet, or a damaged one: measure again
    points = measure_points(runner, k, limit)
    result = GateMeasurement(min(gate_from_points(points), limit), points)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"key": key, "max_batch": result.max_batch, "points": points}, indent=1)
        write_atomically(path, text.encode())
    except OSError as exc:
        logger.warning("could not write the speculation gate cache %s: %s", path, exc)
    return result
