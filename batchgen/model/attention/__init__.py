"""Paged attention backends behind one interface (`base.AttentionBackend`), and the registry that
picks one: "torch" (the reference, `torch_backend`), "cpu" (C kernels, `cpu_backend`) and "triton"
(the CUDA kernels, `triton_backend`, imported only when chosen: it needs Triton).

Backends import `base` and each other, never this package, so this registry is the only module that
knows them all.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from batchgen.kernels.cpu import library as cpu_kernels
from batchgen.model.attention.base import AttentionBackend, AttentionMetadata
from batchgen.model.attention.cpu_backend import CPUAttentionBackend
from batchgen.model.attention.torch_backend import TorchAttentionBackend, store_kv_cache_torch

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "CPUAttentionBackend",
    "TorchAttentionBackend",
    "select_backend",
    "store_kv_cache_torch",
]


def _torch(device: torch.device) -> AttentionBackend:
    return TorchAttentionBackend()


def _cpu(device: torch.device) -> AttentionBackend:
    if device.type != "cpu":
        raise ValueError(f"attention_backend='cpu' runs on the CPU; the model is on {device}")
    if cpu_kernels.load_library() is None:
        if cpu_kernels.disabled_by_environment():
            raise ValueError(
                "attention_backend='cpu' needs its C kernels, which BATCHGEN_CPU_KERNELS=0 turns off; "
                "unset BATCHGEN_CPU_KERNELS or use attention_backend='torch'"
            )
        raise ValueError(
            "attention_backend='cpu' needs its C kernels, which could not be built here (see the "
            "warning above; they need a C compiler as $CC or cc); use attention_backend='torch'"
        )
    return CPUAttentionBackend()


def _triton(device: torch.device) -> AttentionBackend:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention_backend='triton' needs a CUDA GPU (or TRITON_INTERPRET=1 to run the kernels "
            "in Triton's CPU interpreter, for tests); use attention_backend='torch' on this machine"
        )
    try:
        from batchgen.model.attention.triton_backend import TritonAttentionBackend  # needs Triton
    except ImportError as e:
        if e.name != "triton":
            raise
        raise ValueError(
            "attention_backend='triton' needs the triton package (torch's CUDA builds bring it): "
            "pip install 'batchgen[gpu]', or use attention_backend='torch'"
        ) from None
    return TritonAttentionBackend()


# attention_backend name -> a function building that backend for a device (raising ValueError,
# naming the fix, where it cannot run there).
BACKENDS: dict[str, Callable[[torch.device], AttentionBackend]] = {
    "torch": _torch,
    "cpu": _cpu,
    "triton": _triton,
}


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """Pick the attention backend: "auto" is triton on CUDA, cpu on a CPU when its kernel builds, else torch.

    Raises:
        ValueError: "triton" forced with no CUDA device and without `TRITON_INTERPRET=1`; "cpu" forced
            on another device or where its kernel cannot be built; an unknown name.
    """
    if name == "auto":
        if device.type == "cuda":
            name = "triton"
        else:
            name = "cpu" if device.type == "cpu" and cpu_kernels.load_library() is not None else "torch"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be auto, torch, cpu or triton; got {name!r}")
    return BACKENDS[name](device)
