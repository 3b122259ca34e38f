"""The measured choice between the one-call C decoder stack and the per-layer path, by step rows.

The stack (`kernels/cpu/stack.py`, built from the model's layers by `build_decoder_stack`) runs every
decoder layer of a step in one C call with batchgen's bf16 linear kernel, or its AMX one (both are
candidates where AMX is there), or its int8 one on an int8-quantized model or a GGUF file's repacked
blocks (in float32, on any CPU, the only kind); the per-layer path runs each layer's ops from Python with the linears
the registry chose per row bucket (oneDNN's, say, where it is faster). The stack saves the Python
and dispatch cost of some ten calls a layer, which is most of a small decode step; its linears
lose to a matrix-unit kernel as rows grow. Where the crossing lies depends on the machine, so
`tune_decoder_stack` times a synthetic decode step of the real model both ways at each row bucket.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from batchgen.kernels.cpu.int8_weight import PackedInt8
from batchgen.kernels.cpu.linear import AmxLinear, Bf16Linear, TunedLinear, fused_swiglu
from batchgen.kernels.cpu.quantized_linear import (
    Int8Bf16DotLinear,
    Int8Linear,
    bf16_dot_available,
)
from batchgen.kernels.cpu.stack import DecoderStack, StackDims, StackLayer
from batchgen.kernels.registry import Run, Setup, TuningTable, buckets_up_to, choose, entry_key, matches
from batchgen.model.attention.base import AttentionMetadata
from batchgen.model.layers import MLP
from batchgen.model.llama import DecoderLayer, decoder_layers

if TYPE_CHECKING:
    from batchgen.model.llama import LlamaForCausalLM

# Context tokens of each synthetic sequence; all but its last block are shared by every sequence
# (read-only), so the caches stay small at any row count. The attention kernel is the same C kernel
# on both paths, so the context length hardly moves the comparison.
_CONTEXT = 64
_BLOCK_SIZE = 16
# Relative tolerance of the stack's logits against the per-layer path on the same kernels (bf16,
# float32 sums): they differ by the order of a few sums at most.
_RTOL = 2e-2

# The "cpu" attention backend's measured choices (`CPUAttentionBackend`); the stack calls the C
# kernels whatever they say.
_ATTENTION_CHOICES = ("decode_by_bucket", "prefill_by_bucket", "prefill_after_prefix_by_bucket")


# A synthetic decode step: input ids `[rows]`, positions `[rows]`, per-layer (K, V) caches, metadata.
_Step = tuple[
    torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], Callable[[], AttentionMetadata]
]


def _decode_step(
    rows: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    vocab: int,
    generator: torch.Generator,
    dtype: torch.dtype,
) -> _Step:
    """Inputs of a decode step of `rows` sequences at `_CONTEXT` tokens each, and its caches (`dtype`)."""
    shared = _CONTEXT // _BLOCK_SIZE - 1
    num_blocks = shared + rows
    shape = (num_blocks, _BLOCK_SIZE, num_kv_heads, head_dim)
    caches = [
        (
            (torch.randn(shape, generator=generator) * 0.5).to(dtype),
            (torch.randn(shape, generator=generator) * 0.5).to(dtype),
        )
        for _ in range(num_layers)
    ]
    tables = torch.tensor([[*range(shared), shared + r] for r in range(rows)], dtype=torch.int32)
    last = _CONTEXT - 1
    slots = (shared + torch.arange(rows)) * _BLOCK_SIZE + last % _BLOCK_SIZE
    input_ids = torch.randint(0, vocab, (rows,), generator=generator)
    positions = torch.full((rows,), last, dtype=torch.int64)

    def meta() -> AttentionMetadata:  # a fresh one a call: backends keep per-step values in it
        return AttentionMetadata.decodes(slots, tables, _CONTEXT)

    return input_ids, positions, caches, meta


def tune_decoder_stack(
    model: LlamaForCausalLM, stack: DecoderStack, table: TuningTable, max_rows: int, quantized: str = ""
) -> tuple[int, list[str]]:
    """Where `stack` runs: the largest row bucket up to which a stack variant is faster than the
    per-layer path at every bucket (0: at none), and the stack's linear kernel at each bucket up to
    there ("bf16_c", "amx_c" where the AMX kernel applies and won, "int8_c_dpbf16" on int8 weights;
    "int8_c" in a float32 stack), from `table` or measured on
    decode steps of `model` (added to `table`).

    Args:
        model: a bf16 (or int8 float32) `LlamaForCausalLM` with its linears chosen; its
            `decoder_stack` is left None.
        stack: the model's decoder stack (no row limit).
        max_rows: the largest step to consider (the decode batch limit, `max_num_seqs`).
        quantized: the format the model's layer linears run quantized ("int8"; "" for
            none): the per-layer path, and the stack's candidates, differ with it, so its choice
            is tabled under a shape of its own.
    """
    config = model.config
    attn = decoder_layers(model)[0].self_attn
    generator = torch.Generator().manual_seed(0)
    steps: dict[int, _Step] = {}

    def step(rows: int) -> _Step:
        if rows not in steps:
            steps.clear()
            layers, heads, vocab = len(model.model.layers), attn.num_kv_heads, config.vocab_size
            steps[rows] = _decode_step(rows, layers, heads, attn.head_dim, vocab, generator, stack.dtype)
        return steps[rows]

    def forward(rows: int, linear: str | None) -> torch.Tensor:
        """One step through the stack running `linear` kernels, or (None) through the per-layer path."""
        input_ids, positions, caches, meta = step(rows)
        model.decoder_stack = stack if linear else None
        stack.linear_by_bucket = [linear] if linear else None
        try:
            return model(input_ids, positions, caches, meta(), torch.arange(rows))
        finally:
            model.decoder_stack = None
            stack.linear_by_bucket = None

    def stack_setup(linear: str) -> Setup:
        def setup(rows: int) -> Run:
            with _layers_on(model, linear):  # the per-layer path on the very kernels the stack runs
                same_kernels = forward(rows, linear=None)
            if not matches(forward(rows, linear), same_kernels, _RTOL):
                raise ValueError(
                    f"its logits differ from the per-layer path on its kernels by more than {_RTOL:g}"
                )
            return lambda: forward(rows, linear)

        return setup

    def layers_setup(rows: int) -> Run:
        return lambda: forward(rows, linear=None)

    candidates: dict[str, Setup] = {"layers": layers_setup}
    candidates.update({kind: stack_setup(_linear_of(kind, stack.dtype)) for kind in _stack_kinds(stack)})
    buckets = buckets_up_to(max_rows)
    chosen = choose(
        table,
        "decoder_stack",
        _shape(model, quantized),
        buckets,
        candidates,
        # The per-layer path is the engine's own (its linears each checked by the registry), and its
        # kernels round differently from the stack's: the stack is checked in `stack_setup`.
        lambda rows: forward(rows, linear=None),
        float("inf"),
        prune=True,  # the stack's linears only fall further behind as rows grow
    )
    kinds = [chosen[rows] for rows in buckets]
    stack_rows = _stack_rows(kinds, buckets)
    linears = [
        _linear_of(kind, stack.dtype) for kind, rows in zip(kinds, buckets, strict=True) if rows <= stack_rows
    ]
    return stack_rows, linears


def _stack_kinds(stack: DecoderStack) -> list[str]:
    """The stack's candidates in the tuning table for this stack: in bf16 "stack" and "stack_amx"
    where it applies; then "stack_int8" where every layer holds int8 weights (a float32 stack's
    only one: its constructor checked)."""
    kinds = []
    if stack.dtype == torch.bfloat16:
        kinds = ["stack"] + (["stack_amx"] if DecoderStack.amx_applies(stack.dims) else [])
    return kinds + (["stack_int8"] if stack.int8_applies() else [])


def _linear_of(kind: str, dtype: torch.dtype) -> str:
    """The linear kernel the stack candidate `kind` runs in `dtype` (`_STACK_LINEARS`; float32's
    int8 kernel is "int8_c", its float32 tiles)."""
    return "int8_c" if dtype == torch.float32 and kind == "stack_int8" else _STACK_LINEARS[kind]


@contextlib.contextmanager
def _layers_on(model: LlamaForCausalLM, linear: str) -> Iterator[None]:
    """Within the block, every tuned linear of the decoder layers runs `linear` ("bf16_c", "amx_c",
    "int8_c_dpbf16" or, float32, "int8_c") on its packed weight at every row count, and attention runs the C kernels the stack calls: the
    per-layer path on the stack's own kernels. (The attention choice measured before may be torch's
    at some batch sizes, on a machine with more threads than free cores for one; torch rounds
    otherwise in bf16, which once dropped a correct stack.)"""
    kernel = AmxLinear if linear == "amx_c" else Bf16Linear
    layer_linears = [m for m in model.model.layers.modules() if isinstance(m, TunedLinear)]
    saved = [(m._by_rows, m._swiglu_by_rows) for m in layer_linears]
    backend = getattr(getattr(model.model.layers[0], "self_attn", None), "backend", None)
    attention_fields = [f for f in _ATTENTION_CHOICES if hasattr(backend, f)]
    saved_attention = {f: getattr(backend, f) for f in attention_fields}
    try:
        for f in attention_fields:
            setattr(backend, f, None)  # None: the C kernel at every batch and chunk length
        for m in layer_linears:
            impl: nn.Module
            int8 = _int8_impl(m) if linear.startswith("int8_c") else None
            if int8 is not None:  # int8 is offered only where every layer linear has one
                impl = (
                    Int8Bf16DotLinear(int8.weight, None)
                    if linear == "int8_c_dpbf16"
                    else Int8Linear(int8.weight, None)
                )
            else:
                packed = next(i for i in m.impls.values() if isinstance(i, Bf16Linear))
                impl = kernel(packed.packed_weight, packed.bias)
            # The MLP's gate/up runs its fused SwiGLU where the table's choice has one: on the
            # stack's kernels it is the stack's (AMX: fused, bit for bit; bf16_c: none).
            m._by_rows, m._swiglu_by_rows = [impl.forward], [fused_swiglu(impl)]
        yield
    finally:
        for m, (by_rows, swiglu_by_rows) in zip(layer_linears, saved, strict=True):
            m._by_rows, m._swiglu_by_rows = by_rows, swiglu_by_rows
        for f, value in saved_attention.items():
            setattr(backend, f, value)


# The stack's candidates in the tuning table -> the linear kernel each runs (bf16; a float32 stack's
# "stack_int8" runs "int8_c").
_STACK_LINEARS = {
    "stack": "bf16_c",
    "stack_amx": "amx_c",
    "stack_int8": "int8_c_dpbf16",
}


def _shape(model: LlamaForCausalLM, quantized: str) -> str:
    """The stack's tuning-table shape: the model's sizes, and "/<format>" where its layer linears run
    quantized (`tune_decoder_stack`)."""
    config, attn = model.config, decoder_layers(model)[0].self_attn
    layers = len(model.model.layers)
    return (
        f"{layers}x{config.hidden_size}x{config.intermediate_size}:"
        f"{attn.num_heads}x{attn.num_kv_heads}x{attn.head_dim}" + (f"/{quantized}" if quantized else "")
    )


def _stack_rows(kinds: list[str], buckets: tuple[int, ...]) -> int:
    """The largest bucket up to which every bucket chose the stack (0: none)."""
    best = 0
    for kind, rows in zip(kinds, buckets, strict=True):
        if kind not in _STACK_LINEARS:
            break
        best = rows
    return best


def cached_stack_rows(
    model: LlamaForCausalLM, table: TuningTable, max_rows: int, quantized: str
) -> int | None:
    """What `tune_decoder_stack` would return (with the same `quantized`), where `table` already
    holds every bucket's choice (None: it must measure). Lets a second start skip the layout the
    stack would need."""
    buckets = buckets_up_to(max_rows)
    entries = [
        table.entries.get(entry_key("decoder_stack", _shape(model, quantized), rows)) for rows in buckets
    ]
    found = [entry for entry in entries if entry is not None]
    if len(found) < len(entries):
        return None
    return _stack_rows([entry["chosen"] for entry in found], buckets)


def _bf16_weight(linear: nn.Module | None) -> torch.Tensor | None:
    """The packed bf16 weight of batchgen's own kernel in `linear` (a `Bf16Linear`, or a
    `TunedLinear` holding one), where it has one and no bias (the stack adds none)."""
    if isinstance(linear, TunedLinear):
        packed = [m for m in linear.impls.values() if isinstance(m, Bf16Linear)]  # AmxLinear is one too
        linear = packed[0] if packed else None
    if not isinstance(linear, Bf16Linear) or linear.bias is not None:
        return None
    return linear.packed_weight


def _int8_impl(linear: nn.Module | None) -> Int8Linear | None:
    """A batchgen int8 kernel in `linear` (an `Int8Linear` or a `TunedLinear` holding one) without a
    bias: its `Int8Weight` is what the stack's int8 linears read."""
    impls = linear.impls.values() if isinstance(linear, TunedLinear) else [linear]
    found = [m for m in impls if isinstance(m, Int8Linear) and m.bias is None]
    return found[0] if found else None


def _stack_int8(
    projections: Sequence[nn.Module], dtype: torch.dtype
) -> tuple[PackedInt8, PackedInt8, PackedInt8, PackedInt8] | None:
    """The four projections' int8 weights packed as the library's int8 kernels read them (the very
    copy their per-layer kernels read), or None where one has none or (bf16) the library has no
    VDPBF16PS tiles."""
    impls = [_int8_impl(p) for p in projections]
    if any(i is None for i in impls) or (dtype == torch.bfloat16 and not bf16_dot_available()):
        return None
    qkv, o, gate_up, down = (i.packed_weight for i in impls if i is not None)
    return qkv, o, gate_up, down


def build_decoder_stack(model: LlamaForCausalLM, max_rows: int) -> DecoderStack | None:
    """The C decoder stack for `model`, or None where it does not apply: a bf16 model on the "cpu"
    attention backend whose layer linears all hold batchgen's bf16 kernel (or a float32 one whose
    layer linears all hold its int8 kernel: `--quantization int8`, or a GGUF file's repacked blocks),
    without biases,
    Qwen3's q/k norms or experts, with one attention scale, Llama-family layers (`DecoderLayer`: the stack's C
    code is their arithmetic) with rotary and no sliding window or softcap (the stack rotates
    every layer and attends globally).
    `max_rows`: the stack's row limit (0: none)."""
    layers = decoder_layers(model)
    if not layers or not getattr(layers[0].self_attn.backend, "fused_cpu_ops", False):
        return None
    if any(
        type(layer) is not DecoderLayer
        or layer.self_attn.window is not None
        or layer.self_attn.softcap is not None
        or not layer.self_attn.rotary
        or not model.fits_decoder_stack
        for layer in layers
    ):
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
    dtype = next(model.parameters()).dtype
    if not DecoderStack.applies(dims, dtype):
        return None
    stack_layers = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(mlp, MLP):  # a mixture of experts: the stack runs dense layers only
            return None
        projections = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        # bf16 runs its bf16 layouts (and may run int8 ones); float32 runs int8 ones only
        weights = [_bf16_weight(p) if dtype == torch.bfloat16 else None for p in projections]
        int8 = _stack_int8(projections, dtype)
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if attn.qk_norm or attn.scale != first.scale:
            return None
        if not all(w.dtype == dtype and w.is_contiguous() for w in norms):
            return None
        qkv, o, gate_up, down = weights
        stack_layers.append(StackLayer(norms[0], qkv, o, norms[1], gate_up, down, int8))
    try:
        return DecoderStack(dims, stack_layers, max_rows=max_rows, dtype=dtype)
    except ValueError:  # its layers lack the weights it runs: bf16 layouts (bf16), int8 ones (float32)
        return None
