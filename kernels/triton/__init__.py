"""Triton kernels: the paged KV-cache write, decode attention, chunked-prefill attention, and the
mixture-of-experts grouped GEMM.

Importable on its own (it does not import batchgen). Set `TRITON_INTERPRET=1` before importing to run
the kernels on CPU tensors in Triton's interpreter (slow; for tests).
"""

from batchgen.kernels.triton.decode_attention import choose_num_splits, paged_decode_attention
from batchgen.kernels.triton.fused_moe import fused_moe_experts
from batchgen.kernels.triton.prefill_attention import paged_prefill_attention
from batchgen.kernels.triton.store_kv_cache import store_kv_cache

__all__ = [
    "choose_num_splits",
    "fused_moe_experts",
    "paged_decode_attention",
    "paged_prefill_attention",
    "store_kv_cache",
]
