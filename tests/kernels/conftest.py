"""Kernel tests: on the GPU when CUDA is available, else on CPU through Triton's interpreter.

`TRITON_INTERPRET=1` must be set before `kernels` is imported (Triton decides at decoration time
whether a kernel is compiled or interpreted), so it is set here, when pytest loads this file, before
the test modules import anything. Each test module skips itself when Triton is not installed.

The helpers below (random caches and block tables, a float64 reference written out per sequence, the
tolerances) are handed to tests as fixtures.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

ON_GPU = torch.cuda.is_available()
# Set when another test folder imported `kernels` (compiled for a GPU) before this file could ask for
# the interpreter; the kernel tests then fail with this message instead of an obscure launch error.
IMPORTED_TOO_EARLY = ""
if not ON_GPU:
    if (
        "batchgen.kernels.triton.decode_attention" in sys.modules
        and os.environ.get("TRITON_INTERPRET") != "1"
    ):
        IMPORTED_TOO_EARLY = (
            "kernels was imported (by an earlier test module) before tests/kernels/conftest.py set "
            "TRITON_INTERPRET=1, so its kernels are compiled for a GPU; run with TRITON_INTERPRET=1 in the "
            "environment, or run tests/kernels on its own"
        )
    os.environ["TRITON_INTERPRET"] = "1"

# Absolute and relative tolerance of a kernel output against the float64 reference (and against the
# torch backend in the same dtype), by dtype. float32: the kernels multiply in IEEE float32 (no TF32),
# so only summation order and exp2 differ. float16: P is rounded to fp16 before P@V and the output
# is rounded (half an ulp is 1e-3 at |o| ~ 2). bfloat16 has 8 bits of mantissa; Triton's interpreter
# also truncates float32 -> bfloat16 instead of rounding, doubling the error, hence 3e-2.
TOLERANCES = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert torch.isfinite(actual).all(), f"{what}: non-finite values in the kernel output"
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(
        actual.double(), expected.double(), atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}"
    )


def make_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device, gen
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V caches (never zeros: zeros would hide unread or misplaced rows)."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype).to(device)
    v = torch.randn(shape, generator=gen).to(dtype).to(device)
    return k, v


def make_block_tables(
    seq_lens: list[int], block_size: int, num_blocks: int, gen, device, strided: bool = False
) -> torch.Tensor:
    """int32 `[B, max_blocks]` with each sequence's blocks drawn from a random permutation of the pool.

    Entries past a sequence's last block are 0, as the engine leaves them. `strided=True` returns a
    column-major view (strides (1, B)) to exercise the kernels' stride arguments.
    """
    needed = [(n + block_size - 1) // block_size for n in seq_lens]
    if sum(needed) > num_blocks:
        raise ValueError(f"{sum(needed)} blocks needed, pool has {num_blocks}")
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(1, max(needed))
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    at = 0
    for i, n in enumerate(needed):
        table[i, :n] = perm[at : at + n].to(torch.int32)
        at += n
    if strided:
        table = table.t().contiguous().t()
    return table.to(device)


def gather(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` context rows `[length, Hkv, D]` of one sequence, read block by block."""
    block_size = cache.shape[1]
    positions = torch.arange(length, device=cache.device)
    return cache[table_row.long()[positions // block_size], positions % block_size]


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 reference: q `[Q, Hq, D]` are the last Q of the L positions of k/v `[L, Hkv, D]`.

    Query i (position L - Q + i) attends to keys 0..L - Q + i; query head h reads KV head h // (Hq / Hkv).
    """
    num_q, num_q_heads, _ = q.shape
    length, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    positions = torch.arange(length - num_q, length)[:, None]
    scores = scores.masked_fill(torch.arange(length)[None, :] > positions, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """cuda when available (the compiled kernels), else cpu (Triton's interpreter)."""
    if IMPORTED_TOO_EARLY:
        pytest.fail(IMPORTED_TOO_EARLY)
    return torch.device("cuda" if ON_GPU else "cpu")


@pytest.fixture
def helpers() -> SimpleNamespace:
    return SimpleNamespace(
        assert_close=assert_close,
        make_cache=make_cache,
        make_block_tables=make_block_tables,
        gather=gather,
        naive_attention=naive_attention,
        tolerances=TOLERANCES,
    )


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded from the test's id, so every case draws fresh but reproducible data."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(request.node.nodeid)) % (2**31)
    return torch.Generator().manual_seed(seed)
