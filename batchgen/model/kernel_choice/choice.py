"""Which kernels the loaded model runs: `--kernels auto|reference|native`.

- "auto" (default): every linear shape of the model gets, per row bucket, the implementation measured
  fastest on this machine (`kernels.registry.choose` over `kernels.cpu.linear.linear_candidates`),
  prefill chunks get the faster of the C attention kernel and torch's SDPA (`attention_choice`),
  and the one-call C decoder stack runs the steps up to the row count where it was measured faster
  than the per-layer path (`stack_choice`). On CUDA the linears are torch's, and the Triton backend's
  prefill chunks without a cached prefix get the faster of its kernel and torch's SDPA
  (`attention_choice.tune_triton_prefill_attention`).
- "reference": plain torch (`F.linear`, the torch attention backend): the oracle, and a fallback.
- "native": batchgen's own kernels wherever they apply, unmeasured (the bf16 C linear on a CPU with
  AVX512-BF16, else oneDNN-prepacked weights; the decoder stack for every step).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from batchgen.config import KERNEL_MODES
from batchgen.kernels.cpu import attention as cpu_attention
from batchgen.kernels.cpu.linear import can_prepack, prepack_linears, release_freed_heap
from batchgen.kernels.cpu.quantized_linear import QuantizedWeight, quantized_candidates
from batchgen.kernels.machine_load import LoadSample
from batchgen.kernels.registry import (
    ROW_BUCKETS,
    TuningTable,
    buckets_up_to,
    entry_key,
    files_hash,
    machine_key,
)
from batchgen.model.attention.cpu_backend import CPUAttentionBackend
from batchgen.model.kernel_choice.attention import (
    tune_decode_attention,
    tune_prefill_attention,
    tune_triton_prefill_attention,
)
from batchgen.model.kernel_choice.experts import choose_experts
from batchgen.model.kernel_choice.linear import (
    choose_linears,
    drop_unused_layouts,
    named_linears,
    table_shape,
)
from batchgen.model.kernel_choice.stack import build_decoder_stack, cached_stack_rows, tune_decoder_stack
from batchgen.model.layers import MLP
from batchgen.model.llama import decoder_layers

if TYPE_CHECKING:
    from batchgen.model.attention.triton_backend import TritonAttentionBackend
    from batchgen.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# The modules that measure the choices (what a candidate is timed on, how it is checked), and torch's
# SDPA candidate (`attention/sdpa.py`): a change to one of them makes a cached table stale as surely as
# a change to a kernel does.
_CHOOSER_SOURCES = (
    "kernel_choice/choice.py",
    "kernel_choice/linear.py",
    "kernel_choice/stack.py",
    "kernel_choice/attention.py",
    "kernel_choice/experts.py",
    "attention/sdpa.py",
)


def tuning_key(
    dtype: torch.dtype, num_threads: int | None = None, device: torch.device | None = None
) -> dict[str, str]:
    """The kernel tuning table's key: `machine_key` (CPU, threads, torch, dtype, kernel sources), the
    source hash of the modules that measure the choices, and for a CUDA `device` the GPU's name and
    compute capability and the CUDA and Triton versions."""
    key = {**machine_key(dtype, num_threads), "choosers": _chooser_source_hash()}
    if device is not None and device.type == "cuda":
        import triton  # the CUDA path's choices are between Triton kernels and torch's

        key["gpu"] = torch.cuda.get_device_name(device)
        key["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        key["cuda"] = str(torch.version.cuda)
        key["triton"] = triton.__version__
    return key


@functools.cache
def _chooser_source_hash() -> str:
    model = Path(__file__).parent.parent  # batchgen/model: the names above are relative to it
    return files_hash(model, [model / name for name in _CHOOSER_SOURCES])


@dataclass
class KernelChoice:
    """What `apply_kernels` chose: per linear shape the implementation at each row bucket, the rows
    up to which the decoder stack runs (None: not at all; 0: every step), and the tuning table
    (None unless "auto")."""

    mode: str
    linears: dict[str, list[str]] = field(default_factory=dict)
    stack_max_rows: int | None = None
    # per row bucket up to `stack_max_rows`: "bf16_c", "amx_c", "int8_c_dpbf16" or (float32) "int8_c"
    stack_linears: list[str] = field(default_factory=list)
    table: TuningTable | None = None
    prefill_attention: list[str] = field(default_factory=list)  # per row bucket: "c", "amx" or "sdpa"
    prefill_after_prefix_attention: list[str] = field(default_factory=list)  # the same, after a prefix
    decode_attention: list[str] = field(default_factory=list)  # per decode-batch bucket: "c" or "torch"
    seconds: float = 0.0  # spent choosing: measuring, or looking up a cached table, and packing
    extra_weight_bytes: int = 0  # weight copies held for a second layout (`plan_layouts`)
    # FLOP/s of the model's layer linears at the largest row bucket, each at its chosen candidate's
    # time in the table (`table_linear_rate`): the registry's own figure for the machine's matmul rate.
    largest_bucket_flops_per_s: float | None = None
    device_type: str = "cpu"  # on CUDA: torch's linears, and only `prefill_attention` is measured
    # a mixture of experts' kernels by row bucket (`choose_experts`), e.g. "fused_c 1-32, bf16_c 64-2048 rows"
    experts: str = ""

    def summary(self) -> str:
        """A few words for the start line, e.g. "auto: linear onednn 80%, torch 20%" (shares of the
        (shape, row bucket) pairs)."""
        if self.device_type != "cpu":
            if self.prefill_attention:
                return (
                    f"{self.device_type}: torch linears; first prefill chunks {_by_rows(self.prefill_attention)}"
                    " (after a cached prefix: triton)"
                )
            return f"{self.device_type}: torch linears; attention from the attention backend (not measured)"
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
            rows = self.stack_max_rows
            stack = f"; decoder stack up to {rows or 'any'} row{'' if rows == 1 else 's'}"
            if "amx_c" in self.stack_linears:
                stack += f" (AMX linears from {ROW_BUCKETS[self.stack_linears.index('amx_c')]} rows)"
            at = [r for r, k in zip(ROW_BUCKETS, self.stack_linears, strict=False) if k.startswith("int8_c")]
            if at:
                span = f"{at[0]}-{at[-1]} rows" if len(at) > 1 else f"{at[0]} row{'' if at[0] == 1 else 's'}"
                stack += f" (int8 linears at {span})"
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
        experts = f"; experts {self.experts}" if self.experts else ""
        return f"{self.mode}: linear " + ", ".join(parts) + stack + attention + experts + memory


def _by_rows(kinds: list[str]) -> str:
    """A per-bucket choice in a few words: "c 1-64, amx 128-2048 rows" ("" for none)."""
    if not kinds:
        return ""
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


def apply_kernels(
    model: LlamaForCausalLM,
    mode: str,
    device: torch.device,
    max_rows: int,
    max_logit_rows: int,
    one_layout: bool = False,
    block_size: int = 16,
    quantized: dict[str, QuantizedWeight] | None = None,
) -> KernelChoice:
    """Put the chosen linear implementations into `model` (weights loaded) and set its decoder stack;
    on CUDA, set the Triton backend's measured prefill attention (`_choose_triton_attention`).

    Args:
        model: a `LlamaForCausalLM` with its weights loaded, on `device`.
        mode: one of `KERNEL_MODES`.
        max_rows: the most rows a step can have (`max_num_batched_tokens`): the largest bucket timed.
        max_logit_rows: the most rows the LM head sees in a step (`max_num_seqs`).
        one_layout: hold one weight layout per linear (`plan_layouts`), at some speed.
        block_size: tokens per KV-cache block, as the engine's cache holds them.
        quantized: module name -> the quantized weight that linear runs (`model.quantization`; its
            float weight is the dequantized one, which "reference" runs). Not on CUDA.

    Raises:
        ValueError: an unknown `mode`.
    """
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_MODES)}; got {mode!r}")
    dtype = next(model.parameters()).dtype
    if device.type == "cuda" and mode == "auto":
        return _choose_triton_attention(model, dtype, device, max_rows, block_size)
    if mode == "reference" or not can_prepack(dtype, device):
        return KernelChoice(mode if device.type == "cpu" else "reference", device_type=device.type)
    quantized = quantized or {}
    if mode == "native":
        experts = _by_rows(choose_experts(model, None, max_rows))
        _native_quantized(model, quantized)
        prepack_linears(model)
        model.decoder_stack = build_decoder_stack(model, max_rows=0)
        stack_rows = 0 if model.decoder_stack is not None else None
        return KernelChoice("native", stack_max_rows=stack_rows, experts=experts)
    start, load_before = time.perf_counter(), LoadSample()
    table = TuningTable.load(tuning_key(dtype))
    choice = KernelChoice("auto", table=table, experts=_by_rows(choose_experts(model, table, max_rows)))
    # The decoder stack needs every layer linear in batchgen's bf16 layout (and may run int8 ones),
    # or in float32 its int8 one: held for its measurement even where the
    # per-layer path does not use it, dropped where it loses.
    # The layer linears' int8 layouts (`Int8Weight.tag`; the LM head is not the stack's): the
    # stack's timings are tabled under them.
    quantized_format = "/".join(
        sorted({w.tag for name, w in quantized.items() if not name.endswith("lm_head")})
    )
    stack_dtype = dtype == torch.bfloat16 or (dtype == torch.float32 and bool(quantized_format))
    stack_possible = stack_dtype and not one_layout and _fused_cpu_backend(model)
    stack_possible = stack_possible and cached_stack_rows(model, table, max_logit_rows, quantized_format) != 0
    layer_shapes = choose_linears(
        model,
        table,
        lambda name: max_logit_rows if name.endswith("lm_head") else max_rows,
        one_layout,
        stack_possible,
        quantized,
        choice.linears,
    )
    choice.largest_bucket_flops_per_s = table_linear_rate(layer_shapes, table, dtype, max_rows)
    _choose_attention(model, table, dtype, max_rows, max_logit_rows, choice)
    stack_kinds = _choose_stack(model, table, max_logit_rows, quantized_format, choice)
    choice.extra_weight_bytes = drop_unused_layouts(
        model, stack_kinds, element_size=torch.empty((), dtype=dtype).element_size()
    )
    table.note_load(LoadSample().other_cores_since(load_before))
    table.save()
    release_freed_heap()  # the plain weights, and the layouts, that no implementation kept
    choice.seconds = time.perf_counter() - start
    return choice


def _choose_stack(
    model: LlamaForCausalLM,
    table: TuningTable,
    max_logit_rows: int,
    quantized_format: str,
    choice: KernelChoice,
) -> set[str]:
    """Build `model`'s decoder stack where it applies, time it against the per-layer path
    (`tune_decoder_stack`) and set it where it wins, recording the outcome in `choice`. Returns the
    linear kinds whose weight layouts the stack reads (empty where it does not run)."""
    stack = build_decoder_stack(model, max_rows=0)
    stack_rows, stack_linears = (
        tune_decoder_stack(model, stack, table, max_logit_rows, quantized_format)
        if stack is not None
        else (0, [])
    )
    model.decoder_stack = stack if stack_rows else None
    choice.stack_max_rows = stack_rows or None
    if stack is None or not stack_rows:
        return set()
    stack.max_rows = stack_rows
    stack.linear_by_bucket = stack_linears
    choice.stack_linears = stack_linears
    # A bf16 stack reads its bf16 layout whichever kinds it runs (`StackLayer` holds it).
    return {*stack_linears, *(["bf16_c"] if stack.dtype == torch.bfloat16 else [])}


def table_linear_rate(
    layer_shapes: list[str], table: TuningTable, dtype: torch.dtype, max_rows: int
) -> float | None:
    """FLOP/s of a model's layer linears at the largest row bucket up to `max_rows`: their FLOPs
    summed over the chosen candidates' times in `table`, one call per linear as a step makes them.

    Args:
        layer_shapes: `shape_name` of every layer linear (the LM head aside), repeats included.

    Returns:
        FLOP/s, or None where an entry is missing or has no time. Reads `table` after
        `tune_linear` filled it; measures nothing.
    """
    rows = buckets_up_to(max_rows)[-1]
    flops = seconds = 0.0
    for shape in layer_shapes:
        entry = table.entries.get(entry_key("linear", table_shape(shape, dtype), rows))
        ms = entry["ms"].get(entry["chosen"]) if entry else None
        if entry is None or not ms or not entry.get("work"):
            return None
        flops += entry["work"]
        seconds += ms * 1e-3
    return flops / seconds if seconds else None


def _native_quantized(model: LlamaForCausalLM, quantized: dict[str, QuantizedWeight]) -> None:
    """`--kernels native` on quantized linears: batchgen's C kernel for each (the float candidates
    only where the library is not built)."""
    for name, linear in named_linears(model):
        weight = quantized.get(name)
        if weight is None:
            continue
        builders = quantized_candidates(weight, linear.weight.detach(), linear.bias)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, builders[next(iter(builders))]())


def _fused_cpu_backend(model: LlamaForCausalLM) -> bool:
    """Whether `model` runs on the "cpu" backend with dense layers only (the decoder stack's case)."""
    layers = decoder_layers(model)
    dense = all(isinstance(layer.mlp, MLP) for layer in layers)
    return bool(layers) and dense and getattr(layers[0].self_attn.backend, "fused_cpu_ops", False)


def _choose_attention(
    model: LlamaForCausalLM,
    table: TuningTable,
    dtype: torch.dtype,
    max_rows: int,
    max_decodes: int,
    choice: KernelChoice,
) -> None:
    """Measure and set the "cpu" backend's prefill attention per chunk-length bucket and its decode
    attention per decode-batch bucket (`attention_choice`)."""
    layers = decoder_layers(model)
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


def _choose_triton_attention(
    model: LlamaForCausalLM, dtype: torch.dtype, device: torch.device, max_rows: int, block_size: int
) -> KernelChoice:
    """Measure and set the Triton backend's prefill attention for chunks without a cached prefix, per
    chunk-length bucket up to `max_rows` (`tune_triton_prefill_attention`, cached like the CPU's
    table under a key that names the GPU). A model on another backend keeps it, unmeasured."""
    choice = KernelChoice("auto", device_type=device.type)
    layers = decoder_layers(model)
    backend = layers[0].self_attn.backend if layers else None
    if backend is None or backend.name != "triton":
        return choice
    backend = cast("TritonAttentionBackend", backend)  # its module imports Triton: not imported here
    start, load_before = time.perf_counter(), LoadSample()
    table = TuningTable.load(tuning_key(dtype, device=device))
    attn = layers[0].self_attn
    heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim, dtype, max_rows)
    backend.prefill_by_bucket = tune_triton_prefill_attention(table, *heads, device, block_size)
    choice.table, choice.prefill_attention = table, backend.prefill_by_bucket
    table.note_load(LoadSample().other_cores_since(load_before))
    table.save()
    if device.type == "cuda":
        # The timed cases' memory goes back before the KV cache (already sized) is allocated.
        torch.cuda.empty_cache()
    choice.seconds = time.perf_counter() - start
    return choice
