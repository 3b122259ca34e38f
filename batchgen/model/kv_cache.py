"""The paged KV cache's memory: the device caches of every layer and the CPU swap space for
preempted requests' blocks."""

from __future__ import annotations

import math
import mmap

import torch


def allocate_kv_caches(
    num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zero-filled (K, V) caches of `shape` `[num_blocks, block_size, Hkv, D]` for each layer.

    Zeros, so that padded block-table entries read finite values. On CPU all layers share one
    anonymous memory map: the kernel hands out zero pages and commits memory only when a block is
    first written, so a job that uses 40% of the cache adds about 40% of it to the resident set
    (`torch.zeros` would write, and so commit, every page up front).
    """
    if device.type != "cpu":
        return [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
    per_cache = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    per_cache += -per_cache % 64  # keep every cache 64-byte aligned (the gather reads int64 words)
    memory = torch.frombuffer(mmap.mmap(-1, 2 * num_layers * per_cache), dtype=torch.uint8)
    numel = math.prod(shape)

    def view(i: int) -> torch.Tensor:
        return memory[i * per_cache : (i + 1) * per_cache].view(dtype)[:numel].view(shape)

    return [(view(2 * layer), view(2 * layer + 1)) for layer in range(num_layers)]


def allocate_swap_caches(
    num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """CPU (K, V) swap caches of `shape` `[num_swap_blocks, block_size, Hkv, D]` for each layer
    (pinned when `device` is CUDA, so copies to and from it are asynchronous); none without blocks."""
    if not shape[0]:
        return []
    pin = device.type == "cuda"
    return [
        (torch.empty(shape, dtype=dtype, pin_memory=pin), torch.empty(shape, dtype=dtype, pin_memory=pin))
        for _ in range(num_layers)
    ]
