"""Which kernels the loaded model runs: `--kernels auto|reference|native`.

- "auto" (default): every linear shape of the model gets, per row bucket, the implementation measured
  fastest on this machine (`kernels.registry.choose` over `kernels.cpu.linear.linear_candidates`),
  prefill chunks get the faster of the C attention kernel and torch's SDPA (`attention_choice`),
  and the one-call C decoder stack runs the steps up to the row count where it was measured faster
  than the per-layer path (`stack_choice`).
- "reference": plain torch (`F.linear`, the torch attention backend): the oracle, and a fallback.
- "native": batchgen's own kernels wherever they apply, unmeasured (the bf16 C linear on a CPU with
  AVX512-BF16, else oneDNN-prepacked weights; the decoder stack for every step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from batchgen.config import KERNEL_MODES
from batchgen.kernels.cpu import attention as cpu_attention
from batchgen.kernels.cpu.linear import (
    WEIGHT_LAYOUTS,
    Bf16Linear,
    TunedLinear,
    can_prepack,
    linear_candidates,
    prepack_linears,
    release_freed_heap,
)
from batchgen.kernels.cpu.stack import DecoderStack, StackDims, StackLayer
from batchgen.kernels.registry import ROW_BUCKETS, TuningTable, buckets_up_to, choose, machine_key
from batchgen.model.attention.cpu_backend import CPUAttentionBackend
from batchgen.model.attention_choice import tune_decode_attention, tune_prefill_attention
from batchgen.model.stack_choice import cached_stack_rows, tune_decoder_stack

logger = logging.getLogger(__name__)

# Relative tolerance of a linear candidate against the float32 product of the same inputs: float32
# kernels differ in summation order only; bf16 rounds the output (2^-8) and may sum in bf16 pairs.
_LINEAR_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
# A second weight layout (and its memory) is kept only for buckets where it is this much faster.
SECOND_LAYOUT_GAIN = 1.10
# The weight bytes one linear timing call runs over (`_timing_copies`).
_STREAMED_BYTES = 64 * 2**20


@dataclass
class KernelChoice:
    """What `apply_kernels` chose: per linear shape the implementation at each row bucket, the rows
    up to which the decoder stack runs (None: not at all; 0: every step), and the tuning table
    (None unless "auto")."""

    mode: str
    linears: dict[str, list[str]] = field(default_factory=dict)
    stack_max_rows: int | None = None
    stack_linears: list[str] = field(default_factory=list)  # per row bucket: "bf16_c" or "amx_c"
    table: TuningTable | None = None
    prefill_attention: list[str] = field(default_factory=list)  # per row bucket: "c", "amx" or "sdpa"
    prefill_after_prefix_attention: list[str] = field(default_factory=list)  # the same, after a prefix
    decode_attention: list[str] = field(default_factory=list)  # per decode-batch bucket: "c" or "torch"
    seconds: float = 0.0  # spent choosing: measuring, or looking up a cached table, and packing
    extra_weight_bytes: int = 0  # weight copies held for a second layout (`plan_layouts`)

    def summary(self) -> str:
        """A few words for the start line, e.g. "auto: linear onednn 80%, torch 20%" (shares of the
        (shape, row bucket) pairs)."""
        if self.mode == "native":
            return "native: batchgen's own kernels where they apply" + (
                "; decoder stack" if self.stack_max_rows is not None else ""
            )
        if self.mode == "reference" or not self.linears:
            return f"{self.mode}: plain torch"
        uses: dict[str, int] = {}
        for by_bucket in self.linears.values():
            for name in by_bucket:
                uses[name] = uses.get(name, 0) + 1
        total = sum(uses.values())
        parts = [f"{name} {100 * n / total:.0f}%" for name, n in sorted(uses.items(), key=lambda x: -x[1])]
        stack = ""
        if self.stack_max_rows is not None:
            stack = f"; decoder stack up to {self.stack_max_rows or 'any'} rows"
            if "amx_c" in self.stack_linears:
                stack += f" (AMX linears from {ROW_BUCKETS[self.stack_linears.index('amx_c')]} rows)"
        extra = self.extra_weight_bytes / 2**20
        memory = f"; second weight layouts {extra:.0f} MiB" if extra else ""
        attention = ""
        if self.prefill_attention:
            attention = f"; prefill attention {_by_rows(self.prefill_attention)}"
        if self.prefill_after_prefix_attention:
            attention += f" (after a cached prefix {_by_rows(self.prefill_after_prefix_attention)})"
        if "torch" in self.decode_attention:
            first = ROW_BUCKETS[self.decode_attention.index("torch")]
            attention += f"; decode attention torch from {first} sequences"
        return f"{self.mode}: linear " + ", ".join(parts) + stack + attention + memory


def _by_rows(kinds: list[str]) -> str:
    """A per-bucket choice in a few words: "c to 64 rows, amx from 128"."""
    runs: list[tuple[str, int, int]] = []  # kind, first bucket, last bucket
    for kind, rows in zip(kinds, ROW_BUCKETS, strict=False):
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1], rows)
        else:
            runs.append((kind, rows, rows))
    if len(runs) == 1:
        return runs[0][0]
    words = [f"{kind} {first}-{last}" if first != last else f"{kind} {first}" for kind, first, last in runs]
    return ", ".join(words) + " rows"


def _named_linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            yield name, module


def _shape_name(linear: nn.Linear) -> str:
    return f"{linear.out_features}x{linear.in_features}" + ("+bias" if linear.bias is not None else "")


def tune_linear(table: TuningTable, linear: nn.Linear, max_rows: int) -> list[dict[str, float | None]]:
    """Each candidate's time (ms; None where not timed or dropped) at each row bucket up to
    `max_rows`, for `linear`'s shape and dtype, from `table` or measured (added to `table`).

    Measured on random inputs, each call running the candidate over `_timing_copies` weights of
    the shape (the layer's own first, checked against the float32 reference): a model step runs
    dozens of layers, so their weights come from memory, not from a core's cache, and one weight
    timed over and over would favour the kernels that gain most from a warm cache.
    """
    builders = linear_candidates(linear.weight, linear.bias)
    buckets = buckets_up_to(max_rows)
    if len(builders) == 1:
        return [{next(iter(builders)): 0.0}] * len(buckets)
    weight = linear.weight.detach()
    dtype = weight.dtype
    generator = torch.Generator().manual_seed(0)
    copies = _timing_copies(weight)
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

    def candidate(name: str):
        def setup(rows: int):
            if not others:
                others.extend(
                    (torch.randn(weight.shape, generator=generator) * scale).to(dtype)
                    for _ in range(copies - 1)
                )
            if name not in built:
                built[name] = [builders[name]()] + [
                    linear_candidates(other, linear.bias)[name]() for other in others
                ]
            modules, data = built[name], x(rows)
            first, rest = modules[0], modules[1:]

            def call() -> torch.Tensor:
                for module in rest:
                    module(data)
                return first(data)

            return call

        return setup

    shape = f"{_shape_name(linear)}:{str(dtype).removeprefix('torch.')}"
    choose(
        table,
        "linear",
        shape,
        buckets,
        {name: candidate(name) for name in builders},
        reference,
        _LINEAR_RTOL.get(dtype, 2e-2),
        work=lambda rows: 2.0 * rows * linear.in_features * linear.out_features,
        calls_per_run=copies,
    )
    return [table.entries[f"linear|{shape}|{rows}"]["ms"] for rows in buckets]


def _timing_copies(weight: torch.Tensor) -> int:
    """How many weights of `weight`'s shape one timing call runs: enough to hold
    `_STREAMED_BYTES` (more than a core's L2 cache on current x86 server CPUs, 1-2 MiB), at most 32."""
    weight_bytes = weight.numel() * weight.element_size()
    return max(1, min(32, -(-_STREAMED_BYTES // weight_bytes)))


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
            total += float("inf") if mine is None else bucket[mine] / max(min(timed), 1e-9)
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


def apply_kernels(
    model: nn.Module,
    mode: str,
    device: torch.device,
    max_rows: int,
    max_logit_rows: int,
    one_layout: bool = False,
) -> KernelChoice:
    """Put the chosen linear implementations into `model` (weights loaded) and set its decoder stack.

    Args:
        model: a `LlamaForCausalLM` with its weights loaded, on `device`.
        mode: one of `KERNEL_MODES`.
        max_rows: the most rows a step can have (`max_num_batched_tokens`): the largest bucket timed.
        max_logit_rows: the most rows the LM head sees in a step (`max_num_seqs`).
        one_layout: hold one weight layout per linear (`plan_layouts`), at some speed.

    Raises:
        ValueError: an unknown `mode`.
    """
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_MODES)}; got {mode!r}")
    dtype = next(model.parameters()).dtype
    if mode == "reference" or not can_prepack(dtype, device):
        return KernelChoice(mode if device.type == "cpu" else "reference")
    if mode == "native":
        prepack_linears(model)
        model.decoder_stack = build_decoder_stack(model, max_rows=0)
        return KernelChoice("native", stack_max_rows=0 if model.decoder_stack is not None else None)
    start = time.perf_counter()
    table = TuningTable.load(machine_key(dtype))
    choice = KernelChoice("auto", table=table)
    # The decoder stack needs every layer linear in batchgen's bf16 layout: held for its measurement
    # even where the per-layer path does not use it, and dropped again where the stack loses.
    stack_possible = dtype == torch.bfloat16 and not one_layout and _fused_cpu_backend(model)
    stack_possible = stack_possible and cached_stack_rows(model, table, max_logit_rows) != 0
    by_shape: dict[str, list[str]] = {}
    for name, linear in list(_named_linears(model)):
        is_head = name.endswith("lm_head")
        rows = max_logit_rows if is_head else max_rows
        key = f"{_shape_name(linear)}@{rows}"
        if key not in by_shape:
            by_shape[key] = plan_layouts(tune_linear(table, linear, rows), one_layout)
        by_bucket = by_shape[key]
        choice.linears[key] = by_bucket
        builders = linear_candidates(linear.weight, linear.bias)
        kinds = list(dict.fromkeys(by_bucket))
        packed = {k for k in kinds if WEIGHT_LAYOUTS.get(k) == "packed_bf16"}
        if stack_possible and not is_head and "bf16_c" in builders and not packed:
            kinds.append("bf16_c")
        impls = {kind: builders[kind]() for kind in kinds}
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(
            parent, child, TunedLinear(impls, by_bucket) if len(impls) > 1 else next(iter(impls.values()))
        )
    _choose_attention(model, table, dtype, max_rows, max_logit_rows, choice)
    stack = build_decoder_stack(model, max_rows=0)
    stack_rows, stack_linears = (
        tune_decoder_stack(model, stack, table, max_logit_rows) if stack is not None else (0, [])
    )
    if stack_rows:
        stack.max_rows = stack_rows
        stack.linear_by_bucket = stack_linears
        choice.stack_linears = stack_linears
    model.decoder_stack = stack if stack_rows else None
    choice.stack_max_rows = stack_rows or None
    choice.extra_weight_bytes = _drop_unused_layouts(
        model, keep_stack_layout=bool(stack_rows), element_size=torch.empty((), dtype=dtype).element_size()
    )
    table.save()
    release_freed_heap()  # the plain weights, and the layouts, that no implementation kept
    choice.seconds = time.perf_counter() - start
    return choice


def _fused_cpu_backend(model: nn.Module) -> bool:
    layers = model.model.layers
    return bool(layers) and getattr(layers[0].self_attn.backend, "fused_cpu_ops", False)


def _drop_unused_layouts(model: nn.Module, keep_stack_layout: bool, element_size: int) -> int:
    """Remove the implementations no row bucket runs (the bf16 layout held for the stack's
    measurement, unless the stack runs); a layer left with one is replaced by it. Returns the bytes
    of the second weight layouts still held."""
    extra = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, TunedLinear):
            continue
        keep = set(module.by_bucket)
        if keep_stack_layout and not any(WEIGHT_LAYOUTS.get(k) == "packed_bf16" for k in keep):
            keep.add("bf16_c")
        for kind in [k for k in module.impls if k not in keep]:
            del module.impls[kind]
        weight_bytes = module.in_features * module.out_features * element_size
        layouts = {WEIGHT_LAYOUTS.get(kind, kind) for kind in module.impls}
        extra += (len(layouts) - 1) * weight_bytes
        if len(module.impls) == 1:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, next(iter(module.impls.values())))
    return extra


def _choose_attention(
    model: nn.Module,
    table: TuningTable,
    dtype: torch.dtype,
    max_rows: int,
    max_decodes: int,
    choice: KernelChoice,
) -> None:
    """Measure and set the "cpu" backend's prefill attention per chunk-length bucket and its decode
    attention per decode-batch bucket (`attention_choice`)."""
    layers = model.model.layers
    backend = layers[0].self_attn.backend if layers else None
    if not isinstance(backend, CPUAttentionBackend):
        return
    attn = layers[0].self_attn
    if not cpu_attention.supports_prefill(dtype, attn.head_dim, attn.num_heads, attn.num_kv_heads):
        return
    heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim, dtype, max_rows)
    backend.prefill_by_bucket = tune_prefill_attention(table, *heads)
    backend.prefill_after_prefix_by_bucket = tune_prefill_attention(table, *heads, prefix=True)
    choice.prefill_attention = backend.prefill_by_bucket
    choice.prefill_after_prefix_attention = backend.prefill_after_prefix_by_bucket
    if cpu_attention.supports(dtype, attn.head_dim, attn.num_heads, attn.num_kv_heads):
        backend.decode_by_bucket = tune_decode_attention(
            table, attn.num_heads, attn.num_kv_heads, attn.head_dim, dtype, max_decodes
        )
        choice.decode_attention = backend.decode_by_bucket


def _bf16_weight(linear: nn.Module) -> torch.Tensor | None:
    """The packed bf16 weight of batchgen's own kernel in `linear` (a `Bf16Linear`, or a
    `TunedLinear` holding one), where it has one and no bias (the stack adds none)."""
    if isinstance(linear, TunedLinear):
        packed = [m for m in linear.impls.values() if isinstance(m, Bf16Linear)]  # AmxLinear is one too
        linear = packed[0] if packed else None
    if not isinstance(linear, Bf16Linear) or linear.bias is not None:
        return None
    return linear.packed_weight


def build_decoder_stack(model: nn.Module, max_rows: int) -> DecoderStack | None:
    """The C decoder stack for `model`, or None where it does not apply: a bf16 model on the "cpu"
    attention backend whose layer linears all hold batchgen's bf16 kernel, without biases or
    Qwen3's q/k norms, with one attention scale. `max_rows`: the stack's row limit (0: none)."""
    layers = model.model.layers
    if not layers or not getattr(layers[0].self_attn.backend, "fused_cpu_ops", False):
        return None
    first = layers[0].self_attn
    config = model.config
    dims = StackDims(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_q_heads=first.num_heads,
        num_kv_heads=first.num_kv_heads,
        head_dim=first.head_dim,
        eps=float(config.rms_norm_eps),
        scale=float(first.scale),
    )
    if not DecoderStack.applies(dims):
        return None
    stack_layers = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        weights = [_bf16_weight(p) for p in projections]
        if any(w is None for w in weights):
            return None
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if attn.qk_norm or attn.scale != first.scale:
            return None
        if not all(w.dtype == torch.bfloat16 and w.is_contiguous() for w in norms):
            return None
        qkv, o, gate_up, down = weights
        stack_layers.append(StackLayer(norms[0], qkv, o, norms[1], gate_up, down))
    return DecoderStack(dims, stack_layers, max_rows=max_rows)
