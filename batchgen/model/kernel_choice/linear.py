"""The measured choice of each linear layer's implementation, per row bucket, and of the weight
layouts a layer keeps (`kernels.registry.choose` over `kernels.cpu.linear.linear_candidates`)."""

from __future__ import annotations

import torch
from torch import nn

from batchgen.kernels.cpu.linear import WEIGHT_LAYOUTS, linear_candidates
from batchgen.kernels.registry import Run, Setup, TuningTable, buckets_up_to, choose, entry_key

# Relative tolerance of a linear candidate against the float32 product of the same inputs: float32
# kernels differ in summation order only; bf16 rounds the output (2^-8) and may sum in bf16 pairs.
_LINEAR_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
# A second weight layout (and its memory) is kept only for buckets where it is this much faster.
SECOND_LAYOUT_GAIN = 1.10
# The weight bytes one linear timing call runs over at up to `_STREAMED_ROWS` rows (`_timing_copies`).
_STREAMED_BYTES = 64 * 2**20
_STREAMED_ROWS = 16


def shape_name(linear: nn.Linear) -> str:
    return f"{linear.out_features}x{linear.in_features}" + ("+bias" if linear.bias is not None else "")


def table_shape(shape: str, dtype: torch.dtype) -> str:
    """A linear's shape name in the tuning table: its `shape_name` and dtype, e.g. "576x1536:bfloat16"."""
    return f"{shape}:{str(dtype).removeprefix('torch.')}"


def tune_linear(table: TuningTable, linear: nn.Linear, max_rows: int) -> list[dict[str, float | None]]:
    """Each candidate's time (ms; None where not timed or dropped) at each row bucket up to
    `max_rows`, for `linear`'s shape and dtype, from `table` or measured (added to `table`).

    Measured on random inputs, each call running the candidate over `_timing_copies` weights of
    the shape (the layer's own first, checked against the float32 reference): a model step runs
    dozens of layers, so their weights come from memory, not from a core's cache, and one weight
    timed over and over would favour the kernels that gain most from a warm cache. That matters
    while rows are few; with more, each weight is reused across the rows and the call is
    compute-bound, so fewer copies keep a timed call's work about constant instead of growing with
    the rows (most of a first start's measuring was the largest buckets over 32 weight copies).
    """
    builders = linear_candidates(linear.weight, linear.bias)
    buckets = buckets_up_to(max_rows)
    if len(builders) == 1:
        return [{next(iter(builders)): 0.0}] * len(buckets)
    weight = linear.weight.detach()
    dtype = weight.dtype
    generator = torch.Generator().manual_seed(0)
    most_copies = _timing_copies(weight, 1)
    scale = weight.float().std().item() or 0.02
    others: list[torch.Tensor] = []  # made on first timing: a cached table needs none
    inputs: dict[int, torch.Tensor] = {}
    built: dict[str, list[nn.Module]] = {}

    def x(rows: int) -> torch.Tensor:
        if rows not in inputs:
            inputs.clear()  # one bucket's input at a time: 2,048 rows of a wide layer are megabytes
            inputs[rows] = torch.randn(rows, linear.in_features, generator=generator).to(dtype)
        return inputs[rows]

    def reference(rows: int) -> torch.Tensor:
        bias = None if linear.bias is None else linear.bias.float()
        return nn.functional.linear(x(rows).float(), weight.float(), bias)

    def candidate(name: str) -> Setup:
        def setup(rows: int) -> Run:
            if not others:
                others.extend(
                    (torch.randn(weight.shape, generator=generator) * scale).to(dtype)
                    for _ in range(most_copies - 1)
                )
            if name not in built:
                built[name] = [builders[name]()] + [
                    linear_candidates(other, linear.bias)[name]() for other in others
                ]
            modules, data = built[name][: _timing_copies(weight, rows)], x(rows)
            first, rest = modules[0], modules[1:]

            def call() -> torch.Tensor:
                for module in rest:
                    module(data)
                return first(data)

            return call

        return setup

    shape = table_shape(shape_name(linear), dtype)
    choose(
        table,
        "linear",
        shape,
        buckets,
        {name: candidate(name) for name in builders},
        reference,
        _LINEAR_RTOL.get(dtype, 2e-2),
        work=lambda rows: 2.0 * rows * linear.in_features * linear.out_features,
        calls_per_run=lambda rows: _timing_copies(weight, rows),
    )
    return [table.entries[entry_key("linear", shape, rows)]["ms"] for rows in buckets]


def _timing_copies(weight: torch.Tensor, rows: int) -> int:
    """How many weights of `weight`'s shape one timing call at `rows` rows runs: up to
    `_STREAMED_ROWS` rows enough to hold `_STREAMED_BYTES` (more than a core's L2 cache on current
    x86 server CPUs, 1-2 MiB), at most 32; beyond, that many divided by rows / `_STREAMED_ROWS`,
    at least 1."""
    weight_bytes = weight.numel() * weight.element_size()
    streamed = max(1, min(32, -(-_STREAMED_BYTES // weight_bytes)))
    return max(1, streamed * _STREAMED_ROWS // max(rows, _STREAMED_ROWS))


def plan_layouts(times: list[dict[str, float | None]], one_layout: bool = False) -> list[str]:
    """The implementation to run at each bucket, given each candidate's time there.

    Every weight layout a layer runs holds its own copy of the weight (`WEIGHT_LAYOUTS`: batchgen's
    two C kernels share one), so a second layout must pay for its memory: one primary layout (the
    least total slowdown against the fastest over all buckets, each bucket running that layout's
    fastest implementation) runs everywhere, except at the buckets where another layout is more
    than `SECOND_LAYOUT_GAIN` faster (so the result is always within that of the fastest). With
    `one_layout`, the primary layout runs everywhere.
    """
    names = list(dict.fromkeys(name for bucket in times for name in bucket))
    layouts = list(dict.fromkeys(WEIGHT_LAYOUTS.get(name, name) for name in names))

    def best_of(layout: str, bucket: dict[str, float | None]) -> str | None:
        timed = {n: t for n, t in bucket.items() if t is not None and WEIGHT_LAYOUTS.get(n, n) == layout}
        return min(timed, key=timed.__getitem__) if timed else None

    def slowdown(layout: str) -> float:
        total = 0.0
        for bucket in times:
            timed = [t for t in bucket.values() if t is not None]
            mine = best_of(layout, bucket)
            mine_ms = None if mine is None else bucket[mine]
            total += float("inf") if mine_ms is None else mine_ms / max(min(timed), 1e-9)
        return total

    primary = min(layouts, key=slowdown)
    plan = []
    for bucket in times:
        timed = {n: t for n, t in bucket.items() if t is not None}
        fastest = min(timed, key=timed.__getitem__)
        mine = best_of(primary, bucket)
        if one_layout or len(layouts) == 1:
            plan.append(mine if mine is not None else fastest)
        else:
            plan.append(
                fastest if mine is None or timed[mine] > SECOND_LAYOUT_GAIN * timed[fastest] else mine
            )
    return plan
