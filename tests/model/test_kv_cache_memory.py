"""The CPU KV cache: zero-filled, one separate region per layer and K/V, memory committed on first write."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from batchgen.model.kv_cache import allocate_kv_caches

STATM = Path("/proc/self/statm")


def resident_bytes() -> int:
    return int(STATM.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_caches_are_zero_distinct_and_aligned() -> None:
    caches = allocate_kv_caches(3, (10, 16, 3, 64), torch.bfloat16, torch.device("cpu"))
    assert len(caches) == 3
    flat = [t for pair in caches for t in pair]
    assert all(t.shape == (10, 16, 3, 64) and t.dtype == torch.bfloat16 and t.is_contiguous() for t in flat)
    assert all(t.data_ptr() % 64 == 0 for t in flat)
    assert all(not t.any() for t in flat)
    caches[1][0].fill_(1.0)  # layer 1's K only
    assert [bool(t.any()) for t in flat] == [False, False, True, False, False, False]


@pytest.mark.skipif(not STATM.exists(), reason="needs Linux /proc/self/statm to read the resident set size")
def test_cpu_cache_memory_is_committed_only_when_written() -> None:
    shape = (1024, 16, 4, 64)  # 8 MiB per cache in bf16: 512 MiB for 32 layers of K and V
    before = resident_bytes()
    caches = allocate_kv_caches(32, shape, torch.bfloat16, torch.device("cpu"))
    assert resident_bytes() - before < 16 * 2**20
    for k, v in caches:  # write a quarter of every cache
        k[:256].fill_(1.0)
        v[:256].fill_(1.0)
    grown = resident_bytes() - before
    assert 120 * 2**20 < grown < 160 * 2**20, grown / 2**20
