"""All decoder layers of a CPU bf16 step in one C call (`csrc/decoder_stack.c`).

The Python forward of a decoder layer makes about ten kernel calls through ctypes, each with its
tensor allocations and argument checks. `DecoderStack` hands the same kernels' whole sequence to C
once a step: the same arithmetic in the same order, so its results equal the Python path's bit for
bit (`tests/model/test_cpu_stack.py`). On the default model's 30 layers (2-core Zen 5, bf16), the
202 decode steps of the bench workload took 3.64 / 3.67 s layer by layer and 3.22 / 3.18 s through
the stack (`python scripts/profile_engine.py [--no-decoder-stack]`): about 2 ms a step.

It applies to bf16 models on the "cpu" attention backend whose linear layers are all `Bf16Linear`
(AVX512-BF16) without biases and without Qwen3's per-head q/k norms; `DecoderStack.for_model`
returns None otherwise, and the model keeps its per-layer path.
"""

from __future__ import annotations

import torch

from batchgen.model import cpu_attention, cpu_kernels
from batchgen.model.attention import AttentionMetadata
from batchgen.model.cpu_linear import Bf16Linear, bf16_kernel_available

# Status codes of decoder_stack_bf16 (csrc/decoder_stack.c); its 1, a kernel refusing a shape,
# cannot follow for_model's and __call__'s checks.
_OUT_OF_MEMORY, _BAD_SLOT = 2, 3


class DecoderStack:
    """Runs every decoder layer of a bf16 Llama-family model for one step in C.

    Build it with `for_model` after the linears are packed (`cpu_linear.prepack_linears`). The
    per-layer table of weight and cache addresses is built on first use and rebuilt when the KV
    caches move.
    """

    def __init__(self, model) -> None:
        """`model`: a `LlamaForCausalLM` for which `for_model` found the stack applicable."""
        config = model.config
        first = model.model.layers[0].self_attn
        self.num_q_heads, self.num_kv_heads, self.head_dim = (
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
        )
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.eps = float(config.rms_norm_eps)
        self.scale = float(first.scale)
        self.layers = list(model.model.layers)
        self._lib = cpu_kernels.load_library()
        self._table: torch.Tensor | None = None
        self._table_caches: tuple[int, ...] = ()
        self._dims: torch.Tensor | None = None
        self._workspace_per_token = 0  # bf16 elements a token needs; set with the table
        self._workspace = torch.empty(0, dtype=torch.bfloat16)

    @classmethod
    def for_model(cls, model) -> DecoderStack | None:
        """A stack for `model`, or None where it does not apply (see the module docstring)."""
        lib = cpu_kernels.load_library()
        if lib is None or not bf16_kernel_available() or not model.model.layers:
            return None
        if not getattr(model.model.layers[0].self_attn.backend, "fused_cpu_ops", False):
            return None
        first = model.model.layers[0].self_attn
        if not (
            cpu_attention.supports(torch.bfloat16, first.head_dim, first.num_heads, first.num_kv_heads)
            and cpu_attention.supports_prefill(
                torch.bfloat16, first.head_dim, first.num_heads, first.num_kv_heads
            )
        ):
            return None
        for layer in model.model.layers:
            linears = (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
            if not all(isinstance(x, Bf16Linear) and x.bias is None for x in linears):
                return None
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if layer.self_attn.qk_norm or not all(
                w.dtype == torch.bfloat16 and w.is_contiguous() for w in norms
            ):
                return None
            if layer.self_attn.scale != first.scale:
                return None
        return cls(model)

    def takes(self, hidden: torch.Tensor, max_rows: int) -> bool:
        """Whether this step's residual stream `hidden` `[T, hidden_size]` goes through the stack:
        bf16, contiguous, at least one row and no more than `max_rows` (the model slices bigger
        steps, `prefill_row_chunk`; 0 means no limit)."""
        rows = hidden.shape[0]
        return (
            hidden.dtype == torch.bfloat16
            and hidden.is_contiguous()
            and rows > 0
            and (max_rows <= 0 or rows <= max_rows)
        )

    def __call__(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Run every layer on `hidden` (bf16 `[T, hidden_size]`, updated in place; `takes` must hold).

        Args:
            hidden: the step's embeddings, bf16 `[T, hidden_size]`, contiguous.
            cos_sin: the step's rotary tables, bf16 `[T, 1, head_dim]` each.
            kv_caches: per layer, bf16 (K, V) `[num_blocks, block_size, Hkv, head_dim]`, contiguous.
            meta: the step's attention metadata (decodes first, then prefill chunks).

        Returns:
            the last layer's MLP output, bf16 `[T, hidden_size]`, not yet added to `hidden` (as the
            per-layer path's last delta).

        Raises:
            ValueError: a table, length or slot outside the cache, or a shape the kernels do not take.
            RuntimeError: a kernel could not allocate memory.
        """
        rows = hidden.shape[0]
        table = self._layer_table(kv_caches)
        k_cache = kv_caches[0][0]
        cos, sin = (t.reshape(rows, self.head_dim) for t in cos_sin)
        if (
            cos.dtype != torch.bfloat16
            or sin.dtype != torch.bfloat16
            or not (cos.is_contiguous() and sin.is_contiguous())
        ):
            raise ValueError("the rotary tables must be contiguous bf16 [T, 1, head_dim]")
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
        if self._workspace.numel() < self._workspace_per_token * rows:  # kept between steps: no page faults
            self._workspace = torch.empty(self._workspace_per_token * rows, dtype=torch.bfloat16)
        delta = torch.empty_like(hidden)
        status = self._lib.decoder_stack_bf16(
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
        )
        if status == _BAD_SLOT:
            num_slots = k_cache.shape[0] * k_cache.shape[1]
            bad = int(((slots < -1) | (slots >= num_slots)).nonzero()[0])
            raise ValueError(
                f"slot_mapping[{bad}] = {int(slots[bad])} is outside the cache's {num_slots} slots"
            )
        if status == _OUT_OF_MEMORY:
            raise RuntimeError("the C decoder stack could not allocate its attention scratch memory")
        if status:  # for_model and the checks above admit only shapes the kernels take
            raise RuntimeError(f"the C decoder stack refused the step (status {status})")
        return delta

    def _layer_table(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """int64 `[num_layers, 8]` addresses (csrc/decoder_stack.c's LAYER_FIELDS order), built when
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
                if t.shape != shape or t.dtype != torch.bfloat16 or not t.is_contiguous() or not t.is_cpu:
                    raise ValueError(
                        f"every KV cache must be a contiguous CPU bf16 tensor of shape {tuple(shape)}"
                    )
        rows = []
        for layer, (k, v) in zip(self.layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            rows.append(
                [
                    layer.input_layernorm.weight.data_ptr(),
                    attn.qkv_proj.packed_weight.data_ptr(),
                    attn.o_proj.packed_weight.data_ptr(),
                    layer.post_attention_layernorm.weight.data_ptr(),
                    mlp.gate_up_proj.packed_weight.data_ptr(),
                    mlp.down_proj.packed_weight.data_ptr(),
                    k.data_ptr(),
                    v.data_ptr(),
                ]
            )
        self._table = torch.tensor(rows, dtype=torch.int64)
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
            ],
            dtype=torch.int64,
        )
        self._workspace_per_token = self._lib.decoder_stack_workspace_per_token(self._dims.data_ptr())
        self._table_caches = addresses
        return self._table
