"""The measured choice of each linear layer's implementation, per row bucket, and of the weight
layouts a layer keeps (`kernels.registry.choose` over `kernels.cpu.linear.linear_candidates`, or
`kernels.cpu.quantized_linear.quantized_candidates` for a layer with a quantized weight)."""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from torch import nn

from batchgen.kernels.cpu.linear import WEIGHT_LAYOUTS, TunedLinear, linear_candidates
from batchgen.kernels.cpu.quantized_linear import QUANTIZED_LAYOUTS, QuantizedWeight, quantized_candidates
from batchgen.kernels.registry import Run, Setup, TuningTable, buckets_up_to, choose, entry_key

# Relative tolerance of a linear candidate against the float32 product of the same inputs: float32
# kernels differ in summation order only; bf16 rounds the output (2^-8) and may sum in bf16 pairs.
_LINEAR_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
# A second weight layout (and its memory) is kept only for buckets where it is this much faster.
SECOND_LAYOUT_GAIN = 1.10
# The weight bytes one linear timing call runs over at up to `_STREAMED_ROWS` rows (`_timing_copies`).
_STREAMED_BYTES = 64 * 2**20
_STREAMED_ROWS = 16


def shape_name(linear: nn.Linear, quantized: QuantizedWeight | None = None) -> str:
    """ "576x1536" (outputs x inputs), with "+bias" where it has one and "/int8" (the weight's
    `tag`, e.g. "/int8g32o" for a GGUF Q4_1 file's) where it runs a quantized weight."""
    name = f"{linear.out_features}x{linear.in_features}" + ("+bias" if linear.bias is not None else "")
    return name + (f"/{quantized.tag}" if quantized is not None else "")


def table_shape(shape: str, dtype: torch.dtype) -> str:
    """A linear's shape name in the tuning table: its `shape_name` and dtype, e.g. "576x1536:bfloat16"."""
    return f"{shape}:{str(dtype).removeprefix('torch.')}"


def layout_of(name: str) -> str:
    """The weight layout implementation `name` holds (`WEIGHT_LAYOUTS`, `QUANTIZED_LAYOUTS`)."""
    return WEIGHT_LAYOUTS.get(name) or QUANTIZED_LAYOUTS.get(name) or name


def candidates_for(
    linear: nn.Linear, quantized: QuantizedWeight | None
) -> dict[str, Callable[[], nn.Module]]:
    """The implementations of `linear`: `quantized_candidates` where it runs a quantized weight
    (its float weight being the dequantized one), else `linear_candidates`."""
    if quantized is None:
        return linear_candidates(linear.weight, linear.bias)
    return quantized_candidates(quantized, linear.weight.detach(), linear.bias)


def tune_linear(
    table: TuningTable, linear: nn.Linear, max_rows: int, quantized: QuantizedWeight | None = None
) -> list[dict[str, float | None]]:
    """Each candidate's time (ms; None where not timed or dropped) at each row bucket up to
    `max_rows`, for `linear`'s shape, dtype (and `quantized`'s format), from `table` or measured.

    Measured on random inputs, each call running the candidate over `_timing_copies` weights of
    the shape (the layer's own first, checked against the float32 product with its weight, or with
    the dequantized `quantized`): a model step runs dozens of layers, so their weights come from
    memory, not from a core's cache, and one weight timed over and over would favour the kernels
    that gain most from a warm cache. That matters while rows are few; with more, each weight is
    reused across the rows and the call is compute-bound, so fewer copies keep a timed call's work
    about constant instead of growing with the rows. A quantized weight's candidates are timed at
    every bucket: its float copy loses few rows by the bytes it reads and wins many by its matmul.
    """
    builders = candidates_for(linear, quantized)
    buckets = buckets_up_to(max_rows)
    if len(builders) == 1:
        return [{next(iter(builders)): 0.0}] * len(buckets)
    weight = linear.weight.detach()
    dtype = weight.dtype
    generator = torch.Generator().manual_seed(0)
    weight_bytes = weight.numel() * weight.element_size() if quantized is None else quantized.nbytes
    most_copies = _timing_copies(weight_bytes, 1)
    scale = weight.float().std().item() or 0.02
    others: list[Callable[[str], nn.Module]] = []  # made on first timing: a cached table needs none
    inputs: dict[int, torch.Tensor] = {}
    built: dict[str, list[nn.Module]] = {}
    reference_weight = weight.float() if quantized is None else quantized.dequantize()

    def x(rows: int) -> torch.Tensor:
        if rows not in inputs:
            inputs.clear()  # one bucket's input at a time: 2,048 rows of a wide layer are megabytes
            inputs[rows] = torch.randn(rows, linear.in_features, generator=generator).to(dtype)
        return inputs[rows]

    def reference(rows: int) -> torch.Tensor:
        bias = None if linear.bias is None else linear.bias.float()
        return nn.functional.linear(x(rows).float(), reference_weight, bias)

    def other_builder() -> Callable[[str], nn.Module]:
        """A random weight of the shape (quantized as `quantized` is), as `name` -> its module."""
        random = torch.randn(weight.shape, generator=generator) * scale
        if quantized is None:
            return lambda name: linear_candidates(random.to(dtype), linear.bias)[name]()
        other = type(quantized).quantize(random)
        return lambda name: quantized_candidates(other, other.dequantize().to(dtype), linear.bias)[name]()

    def candidate(name: str) -> Setup:
        def setup(rows: int) -> Run:
            if not others:
                others.extend(other_builder() for _ in range(most_copies - 1))
            if name not in built:
                built[name] = [builders[name]()] + [build(name) for build in others]
            modules, data = built[name][: _timing_copies(weight_bytes, rows)], x(rows)
            first, rest = modules[0], modules[1:]

            def call() -> torch.Tensor:
                for module in rest:
                    module(data)
                return first(data)

            return call

        return setup

    shape = table_shape(shape_name(linear, quantized), dtype)
    choose(
        table,
        "linear",
        shape,
        buckets,
        {name: candidate(name) for name in builders},
        reference,
        _LINEAR_RTOL.get(dtype, 2e-2),
        work=lambda rows: 2.0 * rows * linear.in_features * linear.out_features,
        calls_per_run=lambda rows: _timing_copies(weight_bytes, rows),
        prune=quantized is None,
    )
    return [table.entries[entry_key("linear", shape, rows)]["ms"] for rows in buckets]


def _timing_copies(weight_bytes: int, rows: int) -> int:
    """How many weights of `weight_bytes` one timing call at `rows` rows runs: up to
    `_STREAMED_ROWS` rows enough to hold `_STREAMED_BYTES` (more than a core's L2 cache on current
    x86 server CPUs, 1-2 MiB), at most 32; beyond, that many divided by rows / `_STREAMED_ROWS`,
    at least 1."""
    streamed = max(1, min(32, -(-_STREAMED_BYTES // max(weight_bytes, 1))))
    return max(1, streamed * _STREAMED_ROWS // max(rows, _STREAMED_ROWS))


def plan_layouts(
    times: list[dict[str, float | None]], one_layout: bool = False, primary: str | None = None
) -> list[str]:
    """The implementation to run at each bucket, given each candidate's time there.

    Every weight layout a layer runs holds its own copy of the weight (`layout_of`: batchgen's
    two C kernels share one), so a second layout must pay for its memory: one primary layout (the
    least total slowdown against the fastest over all buckets, each bucket running that layout's
    fastest implementation; `primary` where given, e.g. "int8" for a quantized layer, whose float
    layouts are copies kept only where they win) runs everywhere, except at the buckets where
    another layout is more than `SECOND_LAYOUT_GAIN` faster (so the result is always within that
    of the fastest). One second layout at most: where two would each win some buckets (torch's
    plain copy at some, oneDNN's prepacked one at others), the one with the least slowdown over
    the buckets the primary leaves takes them all, and the primary runs where that one does not
    beat it. With `one_layout`, the primary layout runs everywhere it has a correct implementation.
    """
    names = list(dict.fromkeys(name for bucket in times for name in bucket))
    layouts = list(dict.fromkeys(layout_of(name) for name in names))

    def best_of(layout: str, bucket: dict[str, float | None]) -> str | None:
        timed = {n: t for n, t in bucket.items() if t is not None and layout_of(n) == layout}
        return min(timed, key=timed.__getitem__) if timed else None

    def slowdown(layout: str, buckets: list[dict[str, float | None]] = times) -> float:
        total = 0.0
        for bucket in buckets:
            timed = [t for t in bucket.values() if t is not None]
            mine = best_of(layout, bucket)
            mine_ms = None if mine is None else bucket[mine]
            total += float("inf") if mine_ms is None else mine_ms / max(min(timed), 1e-9)
        return total

    if primary is None or primary not in layouts:
        primary = min(layouts, key=slowdown)

    def plan_among(allowed: set[str] | None) -> list[str]:
        """Each bucket's implementation with the layouts `allowed` (None: every layout)."""
        plan = []
        for bucket in times:
            timed = {n: t for n, t in bucket.items() if t is not None}
            usable = {n: t for n, t in timed.items() if allowed is None or layout_of(n) in allowed} or timed
            fastest = min(usable, key=usable.__getitem__)
            mine = best_of(primary, bucket)
            if one_layout or len(layouts) == 1:
                plan.append(mine if mine is not None else fastest)
            else:
                plan.append(
                    fastest if mine is None or timed[mine] > SECOND_LAYOUT_GAIN * timed[fastest] else mine
                )
        return plan

    plan = plan_among(None)
    seconds = list(dict.fromkeys(layout_of(n) for n in plan if layout_of(n) != primary))
    if len(seconds) > 1:  # one second layout: the one that loses least where the primary is left
        left = [times[i] for i, n in enumerate(plan) if layout_of(n) != primary]
        plan = plan_among({primary, min(seconds, key=lambda layout: slowdown(layout, left))})
    return plan


def named_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Every `nn.Linear` of `model` with its module name, listed before any is replaced."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def choose_linears(
    model: nn.Module,
    table: TuningTable,
    rows_for: Callable[[str], int],
    one_layout: bool,
    stack_possible: bool,
    quantized: dict[str, QuantizedWeight],
    chosen: dict[str, list[str]],
) -> list[str]:
    """Measure (or look up) each linear shape's implementation per row bucket, put them into `model`
    (a `TunedLinear` where buckets differ) and record them in `chosen` (by shape and rows); with
    `stack_possible` every layer linear also holds the layouts the decoder stack can run for its
    measurement: batchgen's bf16 layout (bf16) and its int8 one (an int8 model's or a GGUF file's).

    Args:
        rows_for: module name -> the most rows a call of it has (the LM head: logit rows).
        quantized: module name -> the quantized weight it runs (its float weight the dequantized
            one); its layout is the primary one (`plan_layouts`).

    Returns:
        The table shape of every layer linear (the LM head aside), repeats included.
    """
    by_shape: dict[str, list[str]] = {}
    layer_shapes: list[str] = []  # one entry per layer linear, for `table_linear_rate`
    for name, linear in named_linears(model):
        weight = quantized.get(name)
        is_head = name.endswith("lm_head")
        shape = shape_name(linear, weight)
        if not is_head:
            layer_shapes.append(shape)
        key = f"{shape}@{rows_for(name)}"
        if key not in by_shape:
            times = tune_linear(table, linear, rows_for(name), weight)
            by_shape[key] = plan_layouts(times, one_layout, None if weight is None else weight.format)
        by_bucket = chosen[key] = by_shape[key]
        builders = candidates_for(linear, weight)
        kinds = list(dict.fromkeys(by_bucket))
        packed = {k for k in kinds if layout_of(k) == "packed_bf16"}
        if stack_possible and not is_head and "bf16_c" in builders and not packed:
            kinds.append("bf16_c")
        # The stack's int8 linears read the layer's int8 weight: held for its measurement too.
        int8 = {k for k in kinds if layout_of(k) == "int8"}
        int8_kind = "int8_c" if linear.weight.dtype == torch.float32 else "int8_c_dpbf16"
        if stack_possible and not is_head and int8_kind in builders and not int8:
            kinds.append(int8_kind)
        impls = {kind: builders[kind]() for kind in kinds}
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(
            parent, child, TunedLinear(impls, by_bucket) if len(impls) > 1 else next(iter(impls.values()))
        )
    return layer_shapes


def drop_unused_layouts(model: nn.Module, stack_kinds: Collection[str], element_size: int) -> int:
    """Remove the implementations no row bucket runs, but for the layouts of `stack_kinds`, the
    kernels whose weights the decoder stack reads (empty where no stack runs: the bf16 layout held
    for its measurement goes too); a layer left with one is replaced by it. Returns the bytes of the
    second weight layouts still held (each counted as a float copy)."""
    extra = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, TunedLinear):
            continue
        keep = set(module.by_bucket)
        for kind in stack_kinds:
            if kind in module.impls and layout_of(kind) not in {layout_of(k) for k in keep}:
                keep.add(kind)
        for kind in [k for k in module.impls if k not in keep]:
            del module.impls[kind]
        weight_bytes = module.in_features * module.out_features * element_size
        layouts = {layout_of(kind) for kind in module.impls}
        extra += (len(layouts) - 1) * weight_bytes
        if len(module.impls) == 1:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, next(iter(module.impls.values())))
    return extra
