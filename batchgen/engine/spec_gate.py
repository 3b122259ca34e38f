"""The speculative decoding gate: the largest running batch at which verifying drafts still pays.

Verifying K drafts turns a request's one decode row into K + 1 rows. While a step is bound by
streaming the weights (small batches), extra rows cost little; once it is bound by compute, every
row costs its share, and speculation only pays if most drafts are accepted (measured by others:
vLLM gates speculation off above a batch size for this reason). The gate is read off this machine's
own cost curve when the engine starts: for batches B = 1, 2, 4, ..., the time of a step of B decode
rows, `t_dec(B)`, and of B requests verifying K drafts each, `t_spec(B)`. A verification that keeps
`a` drafts makes `1 + a` tokens where a decode makes one, so speculation runs while

    t_spec(B) <= (1 + a) * t_dec(B)

with `a` the job's mean accepted drafts per verification so far (`SpeculationGate`; while the gate
is closed, drafts proposed but not verified count too, settled by the tokens the rows go on to
produce: `spec_decode.ShadowDrafts`), starting from a prior of one: at the start the K extra rows of each request may cost one decode row's share of the
step (`t_dec(B) / B` per request, B of them: `t_spec - t_dec <= t_dec`), and the gate widens or
narrows as the job's acceptance shows. A summary copies whole phrases, and a small model's loops
accept nearly every draft, so the gate a job settles on is its own. The boundary between the last
batch that passes and the first that fails is interpolated linearly. The points are cached per
machine, threads, model shape, K and kernel mode (`gate_cache_key`), so every start on one machine reads
the same curve (on a shared machine a fresh measurement moves by a batch or two).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from batchgen.cache import cache_root, write_atomically
from batchgen.engine.spec_decode import NgramProposer
from batchgen.kernels.registry import fastest_seconds

if TYPE_CHECKING:
    from batchgen.config import EngineConfig
    from batchgen.engine.scheduler_output import SchedulerOutput
    from batchgen.model.runner import ModelRunner
from batchgen.model.kernel_choice.choice import tuning_key
from batchgen.model.step import StepInput

logger = logging.getLogger(__name__)

# The prior of accepted drafts per verification, and its weight in verifications: the gate starts at
# t_spec <= 2 t_dec (the K extra rows cost one decode row's share) and follows the job's own mean
# once a few verifications have been seen.
PRIOR_ACCEPTED = 1.0
PRIOR_WEIGHT = 4
# Context of the synthetic sequences (tokens): attention reads it for every row, as in a real tail.
GATE_CONTEXT = 256
GATE_CACHE_VERSION = 2


class SpeculationGate:
    """The running-batch limit of speculation: set (`fixed`), or read off measured cost points at
    the job's acceptance so far (`observe`).

    Args:
        points: (B, t_dec seconds, t_spec seconds) per batch measured, by batch.
        limit: the largest batch measurable (`max_num_seqs`, or the token budget's).
        fixed: the user's `speculative_max_batch` (then `points` are unused).
        cached: the points were read from the cache.
    """

    def __init__(
        self,
        points: list[tuple[int, float, float]],
        limit: int,
        fixed: int | None = None,
        cached: bool = False,
    ) -> None:
        self.points, self.limit, self.fixed, self.cached = points, limit, fixed, cached
        self.num_drafts = 0
        self.num_accepted_tokens = 0
        self.max_batch = fixed if fixed is not None else self._from_points()

    @property
    def accepted_per_verification(self) -> float:
        """The job's mean accepted drafts per verification, with the prior's weight."""
        return (self.num_accepted_tokens + PRIOR_ACCEPTED * PRIOR_WEIGHT) / (self.num_drafts + PRIOR_WEIGHT)

    def _from_points(self) -> int:
        return min(gate_from_points(self.points, 1.0 + self.accepted_per_verification), self.limit)

    def observe(self, num_drafts: int, num_accepted_tokens: int) -> None:
        """Count a step's verifications (real or shadow) and accepted drafts; the gate follows
        (unless fixed)."""
        if not num_drafts:
            return
        self.num_drafts += num_drafts
        self.num_accepted_tokens += num_accepted_tokens
        if self.fixed is None:
            self.max_batch = self._from_points()

    def describe(self) -> str:
        if self.fixed is not None:
            return f"gate running batch <= {self.fixed} (set)"
        where = "cached measurement" if self.cached else "measured"
        return (
            f"gate running batch <= {self.max_batch} at {self.accepted_per_verification:.2f} accepted "
            f"drafts per verification ({where}; follows the job's acceptance)"
        )


@dataclass
class SpeculationPlan:
    """What the engine speculates with: the proposer and its gate."""

    proposer: NgramProposer
    gate: SpeculationGate

    def observe(self, sched: SchedulerOutput) -> int:
        """Feed a step's verifications, real and shadow (a `SchedulerOutput`), to the gate;
        returns the gate's running-batch limit for the next step."""
        self.gate.observe(
            sched.num_drafts + sched.num_shadow_drafts,
            sched.num_accepted_tokens + sched.num_shadow_accepted_tokens,
        )
        return self.gate.max_batch

    def describe(self) -> str:
        p = self.proposer
        return f"speculative ngram k={p.k} n={p.n_min}-{p.n_max}, {self.gate.describe()}"


def gate_from_points(points: list[tuple[int, float, float]], ratio: float) -> int:
    """The largest batch whose `t_spec / t_dec` is at most `ratio`, interpolated between the last
    measured batch that passes and the next one (points sorted by batch). 0 when the first point
    already fails; the last batch when every point passes."""
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


def measure_points(runner: ModelRunner, k: int, max_batch: int) -> list[tuple]:
    """(B, t_dec, t_spec) for B = 1, 2, 4, ... up to `max_batch`, until `t_spec / t_dec` passes
    `1 + k` (no acceptance can pay for more: a verification makes at most k + 1 tokens).

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
        # At least 0.3 s a batch: the minimum of a few rounds still moved by a batch on a busy machine.
        best = fastest_seconds(calls, min_rounds=5, max_rounds=20, min_total_s=0.3)
        points.append((batch, best["dec"], best["spec"]))
        if best["spec"] > (1 + k) * best["dec"]:
            break
        batch *= 2
    return points


def gate_cache_key(runner: ModelRunner, k: int, max_batch: int, dtype: torch.dtype) -> dict[str, str]:
    """What the gate depends on: the kernels' machine key (the GPU's too), the model's shape, the
    attention backend and kernel mode, K and the largest batch measured."""
    config = runner.config
    key = tuning_key(dtype, device=runner.device)  # on CUDA it names the GPU, CUDA and Triton too
    shape = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "vocab_size")  # fmt: skip
    key["model"] = ",".join(str(getattr(config, name, None)) for name in shape)
    key["attention"] = runner.backend.name
    # The mode, not the choice itself: a choice remeasured on a busy machine moves a bucket or two.
    key["kernel_mode"] = runner.kernel_choice.mode
    key.update(k=str(k), max_batch=str(max_batch), block_size=str(runner.block_size))
    key["gate_version"] = str(GATE_CACHE_VERSION)
    return key


def measure_gate(
    runner: Any, k: int, max_num_seqs: int, max_num_batched_tokens: int, dtype: torch.dtype
) -> SpeculationGate:
    """The gate for `runner`'s model on this machine, on points from the cache, else measured and
    cached.

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
        if data.get("key") == key and data.get("points"):
            return SpeculationGate([tuple(p) for p in data["points"]], limit, cached=True)
    except (OSError, ValueError, AttributeError, TypeError):
        pass  # no cache yet, or a damaged one: measure again
    points = measure_points(runner, k, limit)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps({"key": key, "points": points}, indent=1).encode())
    except OSError as exc:
        logger.warning("could not write the speculation gate cache %s: %s", path, exc)
    return SpeculationGate(points, limit)


def plan_speculation(
    config: EngineConfig, runner: ModelRunner, max_num_batched_tokens: int, dtype: torch.dtype
) -> SpeculationPlan | None:
    """The engine's proposer and gate for `config` (an `EngineConfig`): None without a
    `speculative_method`; the gate set by `speculative_max_batch`, else `measure_gate`'s."""
    if config.speculative_method is None:
        return None
    k, low, high = config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
    assert k is not None and low is not None and high is not None  # EngineConfig resolved them
    proposer = NgramProposer(k, low, high)
    if config.speculative_max_batch is not None:
        return SpeculationPlan(proposer, SpeculationGate([], 0, fixed=config.speculative_max_batch))
    gate = measure_gate(runner, proposer.k, config.max_num_seqs, max_num_batched_tokens, dtype)
    return SpeculationPlan(proposer, gate)
