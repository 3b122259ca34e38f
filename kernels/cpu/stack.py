"""All decoder layers of a CPU bf16 or float32 step in one C call (`csrc/decoder_stack.c`).

The Python forward of a decoder layer makes about ten kernel calls through ctypes, each with its
tensor allocations and argument checks. `DecoderStack` hands the same kernels' whole sequence to C
once a step: the same arithmetic in the same order, so its results equal the Python path's bit for
bit (`tests/kernels/cpu/test_cpu_stack.py`); `batchgen bench --profile` shows its share of a step.

It applies to bf16 models on the "cpu" attention backend whose linear layers hold batchgen's packed
bf16 weights (run by its AVX512-BF16 kernel, or its AMX kernel where measured faster) without biases and without Qwen3's per-head q/k norms, for the row counts
where that kernel was measured fastest (`batchgen.model.kernel_choice.stack.build_decoder_stack`);
and to float32 models whose linears are all int8 (`--quantization int8`, or a GGUF file's blocks
repacked; any CPU the library builds for, AVX2 among them), run by the W8A16 kernel's float32
tiles. In float32 the norms, rotary and
SiLU are `csrc/f32_ops.c`'s where the per-layer path runs torch's: equal up to float32 rounding,
not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from batchgen.kernels.cpu import attention as cpu_attention
from batchgen.kernels.cpu import library as cpu_kernels
from batchgen.kernels.cpu.int8_weight import PackedInt8
from batchgen.kernels.cpu.linear import amx_kernel_available, bf16_kernel_available
from batchgen.kernels.cpu.quantized_linear import bf16_dot_available
from batchgen.kernels.registry import bucket_index


class StepMetadata(Protocol):
    """What the stack reads of a step's attention metadata (`batchgen.model.attention.AttentionMetadata`)."""

    @property
    def slot_mapping(self) -> torch.Tensor: ...
    @property
    def block_tables(self) -> torch.Tensor: ...
    @property
    def seq_lens(self) -> torch.Tensor: ...
    @property
    def query_start_loc(self) -> torch.Tensor: ...
    @property
    def num_decodes(self) -> int: ...
    @property
    def num_seqs(self) -> int: ...
    @property
    def verifies_drafts(self) -> bool: ...


# Status codes of decoder_stack_bf16 / _f32 (csrc/decoder_stack.c); its 1, a kernel refusing a shape,
# cannot follow the builder's and __call__'s checks.
_OUT_OF_MEMORY, _BAD_SLOT = 2, 3


@dataclass(frozen=True)
class StackDims:
    """A Llama-family decoder's sizes, as the stack needs them (no model object below the model layer).

    Attributes:
        hidden_size / intermediate_size: model and MLP widths.
        num_q_heads / num_kv_heads / head_dim: attention heads (query heads a multiple of KV heads).
        eps: RMSNorm epsilon; scale: attention softmax scale (1/sqrt(head_dim) unless configured).
    """

    hidden_size: int
    intermediate_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float


@dataclass(frozen=True)
class StackLayer:
    """One decoder layer's weights for the stack: RMSNorm weights `[hidden]` (contiguous, the model's
    dtype) and the four projections as `Bf16Linear` packed weights (bf16 `[N/16, K/2, 16, 2]`, no
    biases; None in a float32 stack); `int8`: the same four as `PackedInt8` weights for the int8
    kernels' lanes (a `--quantization int8` model's or a GGUF file's, one scale group size for
    all), or None."""

    input_norm: torch.Tensor
    qkv_proj: torch.Tensor | None
    o_proj: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_proj: torch.Tensor | None
    down_proj: torch.Tensor | None
    int8: tuple[PackedInt8, PackedInt8, PackedInt8, PackedInt8] | None = None


# The stack's linear kernels by registry name -> `linear_kind` of csrc/decoder_stack.c ("int8_c":
# the same int8 kernel's float32 tiles, a float32 stack's int8 kind).
STACK_LINEAR_KINDS = {"bf16_c": 0, "amx_c": 1, "int8_c_dpbf16": 2, "int8_c": 2}


class DecoderStack:
    """Runs every decoder layer of a bf16 (or int8 float32) Llama-family model for one step in C.

    The model side builds it (`batchgen.model.kernel_choice.stack.build_decoder_stack`) from the layers' packed
    weights. The per-layer table of weight and cache addresses is built on first use and rebuilt
    when the KV caches move.
    """

    def __init__(
        self,
        dims: StackDims,
        layers: list[StackLayer],
        max_rows: int = 0,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        """`dims` and `layers` as above; `max_rows`: the most rows of a step the stack takes (0: no
        limit); bigger steps take the per-layer path (chosen by measurement, `kernels.registry`);
        `dtype`: the model's, torch.bfloat16 or torch.float32 (whose layers must all hold int8
        weights).

        Raises:
            RuntimeError: the C library, or its bf16 linear kernel for a bf16 stack, is not built
                here (`applies`).
            ValueError: a float32 stack whose layers do not all hold int8 weights of one group size;
                a bf16 one whose layers do not all hold packed bf16 weights.
        """
        if not self.applies(dims, dtype):
            raise RuntimeError(
                f"the C decoder stack needs batchgen's {dtype} kernels, which are not built here"
            )
        self.dtype = dtype
        self.dims = dims
        self.num_q_heads, self.num_kv_heads, self.head_dim = (
            dims.num_q_heads,
            dims.num_kv_heads,
            dims.head_dim,
        )
        self.hidden_size = dims.hidden_size
        self.intermediate_size = dims.intermediate_size
        self.eps = float(dims.eps)
        self.scale = float(dims.scale)
        self.layers = list(layers)
        self.max_rows = max_rows
        # Per row bucket (`kernels.registry.ROW_BUCKETS`), the linear kernel the stack runs on its
        # packed weights: "bf16_c" (csrc/bf16_linear.c), "amx_c" (csrc/amx_linear.c, where
        # `amx_applies`), "int8_c_dpbf16" (csrc/int8_w8a16.c, where `int8_applies`) or in float32
        # "int8_c"; None: "bf16_c" at every row count (float32: "int8_c"). Chosen by measurement
        # (kernel_choice/stack.py).
        self.linear_by_bucket: list[str] | None = None
        self._lib = cpu_kernels.require_library()
        self._table: torch.Tensor | None = None
        self._table_caches: tuple[int, ...] = ()
        self._dims = torch.empty(0, dtype=torch.int64)  # set with the table
        self._workspace_per_token = 0  # elements a token needs; set with the table
        self._workspace = torch.empty(0, dtype=dtype)
        if dtype == torch.float32 and not self.int8_applies():
            raise ValueError(
                "a float32 decoder stack runs int8 linears only: every layer needs int8 weights of one group size"
            )
        bf16_weights = [w for x in layers for w in (x.qkv_proj, x.o_proj, x.gate_up_proj, x.down_proj)]
        if dtype == torch.bfloat16 and any(w is None for w in bf16_weights):
            raise ValueError("a bf16 decoder stack needs every layer's packed bf16 weights")
        # The linear kernel without a measured choice (`linear_by_bucket` None).
        self._default_linear = "bf16_c" if dtype == torch.bfloat16 else "int8_c"

    @staticmethod
    def applies(dims: StackDims, dtype: torch.dtype = torch.bfloat16) -> bool:
        """Whether the library is built (with its bf16 linear kernel, for bf16) and both attention
        kernels take these head sizes in `dtype` (bf16 or float32)."""
        lib = cpu_kernels.load_library()
        if lib is None or dtype not in (torch.bfloat16, torch.float32):
            return False
        if dtype == torch.bfloat16 and not bf16_kernel_available():
            return False
        heads = (dtype, dims.head_dim, dims.num_q_heads, dims.num_kv_heads)
        return cpu_attention.supports(*heads) and cpu_attention.supports_prefill(*heads)

    @staticmethod
    def amx_applies(dims: StackDims) -> bool:
        """Whether the stack can run its linears on the AMX kernel: it is available here and every
        linear's K (hidden size, query width, intermediate size) is a multiple of 32."""
        widths = (dims.hidden_size, dims.num_q_heads * dims.head_dim, dims.intermediate_size)
        return all(w % 32 == 0 for w in widths) and amx_kernel_available()

    def int8_applies(self) -> bool:
        """Whether the stack can run its linears on int8 weights: every layer holds them, with one
        scale group size, and (bf16) the library has the int8 kernel's VDPBF16PS tiles (AVX512-BF16)."""
        if any(layer.int8 is None for layer in self.layers):
            return False
        groups = {packed.group for layer in self.layers for packed in layer.int8 or ()}
        return len(groups) == 1 and (self.dtype == torch.float32 or bf16_dot_available())

    def takes(self, hidden: torch.Tensor, max_rows: int) -> bool:
        """Whether this step's residual stream `hidden` `[T, hidden_size]` goes through the stack:
        the stack's dtype, contiguous, at least one row and no more than `max_rows` (the model slices bigger
        steps, `prefill_row_chunk`) nor the stack's own `max_rows` (0 means no limit)."""
        rows = hidden.shape[0]
        return (
            hidden.dtype == self.dtype
            and hidden.is_contiguous()
            and rows > 0
            and all(limit <= 0 or rows <= limit for limit in (max_rows, self.max_rows))
        )

    def __call__(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: StepMetadata,
    ) -> torch.Tensor:
        """Run every layer on `hidden` (`[T, hidden_size]` of the stack's dtype, updated in place;
        `takes` must hold). Every tensor below is of the stack's dtype (bf16 or float32).

        Args:
            hidden: the step's embeddings, `[T, hidden_size]`, contiguous.
            cos_sin: the step's rotary tables, `[T, 1, head_dim]` each.
            kv_caches: per layer, (K, V) `[num_blocks, block_size, Hkv, head_dim]`, contiguous.
            meta: the step's attention metadata (decodes first, then prefill chunks): an object with
                `slot_mapping`, `block_tables`, `seq_lens`, `query_start_loc`, `num_decodes`,
                `num_seqs` and `verifies_drafts` as `batchgen.model.attention.AttentionMetadata` has
                them.

        Returns:
            the last layer's MLP output, `[T, hidden_size]`, not yet added to `hidden` (as the
            per-layer path's last delta).

        Raises:
            ValueError: a table, length or slot outside the cache, or a shape the kernels do not take.
            RuntimeError: a kernel could not allocate memory.
        """
        rows = hidden.shape[0]
        table = self._layer_table(kv_caches)
        k_cache = kv_caches[0][0]
        cos, sin, query_starts = self._checked_step(rows, cos_sin, k_cache, meta)
        slots, block_tables, seq_lens = meta.slot_mapping, meta.block_tables, meta.seq_lens
        nd, num_seqs = meta.num_decodes, meta.num_seqs
        if self._workspace.numel() < self._workspace_per_token * rows:  # kept between steps: no page faults
            self._workspace = torch.empty(self._workspace_per_token * rows, dtype=self.dtype)
        delta = torch.empty_like(hidden)
        run = self._lib.decoder_stack_f32 if self.dtype == torch.float32 else self._lib.decoder_stack_bf16
        status = run(
            table.data_ptr(),
            len(self.layers),
            self._dims.data_ptr(),
            self.eps,
            self.scale,
            rows,
            hidden.data_ptr(),
            delta.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            seq_lens.data_ptr(),
            nd,
            num_seqs,
            query_starts.data_ptr(),
            self._workspace.data_ptr(),
            torch.get_num_threads(),
            STACK_LINEAR_KINDS[self._linear_at(rows)],
            meta.verifies_drafts,
        )
        _check_status(status, slots, k_cache)
        return delta

    def _checked_step(
        self, rows: int, cos_sin: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor, meta: StepMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's rotary tables as `[T, head_dim]` of the stack's dtype and its prefill chunks' int32 query
        starts (`[num_seqs - num_decodes + 1]`, from 0), after checking the metadata of `__call__`
        against the cache.

        Raises:
            ValueError: a dtype, shape or layout the kernels do not take, or a table or length
                outside the cache.
        """
        cos, sin = (t.reshape(rows, self.head_dim) for t in cos_sin)
        if (
            cos.dtype != self.dtype
            or sin.dtype != self.dtype
            or not (cos.is_contiguous() and sin.is_contiguous())
        ):
            raise ValueError(f"the rotary tables must be contiguous {self.dtype} [T, 1, head_dim]")
        slots, block_tables, seq_lens = meta.slot_mapping, meta.block_tables, meta.seq_lens
        if slots.dtype != torch.int64 or slots.shape != (rows,) or not slots.is_contiguous():
            raise ValueError(f"slot_mapping must be a contiguous int64 [{rows}] tensor")
        nd, num_seqs = meta.num_decodes, meta.num_seqs
        if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or block_tables.stride(1) != 1:
            raise ValueError("block_tables and seq_lens must be int32 (block table rows contiguous)")
        if block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,) or not seq_lens.is_contiguous():
            raise ValueError(f"block_tables / seq_lens do not match the step's {num_seqs} sequences")
        if nd:
            cpu_attention.check_table_bounds(k_cache, block_tables[:nd], seq_lens[:nd], min_len=1)
        starts = meta.query_start_loc[nd:]
        query_starts = (starts - starts[0]).to(torch.int32)
        if nd < num_seqs:
            cpu_attention.check_query_starts(query_starts, seq_lens[nd:], rows - nd)
            cpu_attention.check_table_bounds(k_cache, block_tables[nd:], seq_lens[nd:], min_len=0)
        return cos, sin, query_starts

    def _linear_at(self, rows: int) -> str:
        by_bucket = self.linear_by_bucket
        if by_bucket is None:
            return self._default_linear
        return by_bucket[min(bucket_index(rows), len(by_bucket) - 1)]

    def _layer_table(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """int64 `[num_layers, 20]` addresses (csrc/decoder_stack.c's LAYER_FIELDS order), built when
        the caches are new; the caches' shapes are checked then."""
        addresses = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if self._table is not None and addresses == self._table_caches:
            return self._table
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self.layers)} layers")
        shape = kv_caches[0][0].shape
        if len(shape) != 4 or tuple(shape[2:]) != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"KV caches must be [num_blocks, block_size, {self.num_kv_heads}, {self.head_dim}]"
            )
        for k, v in kv_caches:
            for t in (k, v):
                if t.shape != shape or t.dtype != self.dtype or not t.is_contiguous() or not t.is_cpu:
                    raise ValueError(
                        f"every KV cache must be a contiguous CPU {self.dtype} tensor of shape {tuple(shape)}"
                    )
        rows = []
        for layer, (k, v) in zip(self.layers, kv_caches, strict=True):
            weights: tuple[torch.Tensor | None, ...] = (layer.input_norm, layer.qkv_proj, layer.o_proj)
            weights += (layer.post_norm, layer.gate_up_proj, layer.down_proj)
            int8 = [_address(t) for p in layer.int8 or () for t in (p.values, p.scales, p.offsets)] or [
                0
            ] * 12
            pointers = [0 if w is None else w.data_ptr() for w in weights] + [k.data_ptr(), v.data_ptr()]
            rows.append(pointers + int8)
        self._table = torch.tensor(rows, dtype=torch.int64)
        group = self.layers[0].int8[0].group if self.int8_applies() and self.layers[0].int8 else 0
        num_blocks, block_size = shape[0], shape[1]
        self._dims = torch.tensor(
            [
                self.hidden_size,
                self.num_q_heads,
                self.num_kv_heads,
                self.head_dim,
                self.intermediate_size,
                block_size,
                num_blocks * block_size,
                group,
            ],
            dtype=torch.int64,
        )
        self._workspace_per_token = self._lib.decoder_stack_workspace_per_token(self._dims.data_ptr())
        self._table_caches = addresses
        return self._table


def _address(tensor: torch.Tensor | None) -> int:
    """A tensor's address for the layer table; 0 for None (a symmetric int8 weight's offsets)."""
    return 0 if tensor is None else tensor.data_ptr()


def _check_status(status: int, slots: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Raise for a failed `decoder_stack_bf16` / `_f32` call (`status` not 0), naming the cause.

    Raises:
        ValueError: a slot outside the cache (`slots`: the step's int64 slot mapping).
        RuntimeError: the kernel could not allocate memory, or refused the step.
    """
    if status == _BAD_SLOT:
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        bad = int(((slots < -1) | (slots >= num_slots)).nonzero()[0])
        raise ValueError(f"slot_mapping[{bad}] = {int(slots[bad])} is outside the cache's {num_slots} slots")
    if status == _OUT_OF_MEMORY:
        raise RuntimeError("the C decoder stack could not allocate its attention scratch memory")
    if status:  # the builder and the checks above admit only shapes the kernels take
        raise RuntimeError(f"the C decoder stack refused the step (status {status})")
