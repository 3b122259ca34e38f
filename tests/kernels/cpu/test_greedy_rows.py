"""`greedy_rows` (csrc/greedy_rows.c): each row's first maximum and finite flag, against torch's
`max(dim=-1).indices` and a row sum's `isfinite`."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.cpu import library as cpu_kernels
from batchgen.kernels.cpu.ops import greedy_rows

pytestmark = pytest.mark.skipif(
    cpu_kernels.load_library() is None, reason="no C compiler to build the kernels"
)


def _reference(x: torch.Tensor) -> list[list[int]]:
    return [x.max(dim=-1).indices.tolist(), torch.isfinite(x.float().sum(dim=-1)).long().tolist()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 33, 63, 64, 65, 1000, 49152 + 7])
def test_argmax_and_finite_flags_equal_torch(dtype, vocab) -> None:
    gen = torch.Generator().manual_seed(vocab)
    x = (torch.randn(9, vocab, generator=gen) * 4).to(dtype)
    x[1] = -x[1].abs() - 1  # all negative
    if vocab > 40:
        x[2, 5] = x[2, 37] = x[2].max() + 1  # a tie: the first one wins
        x[3, vocab - 1] = 1e4  # the last value, in a partial chunk
    x[4, vocab // 2] = float("nan")
    x[5, 0] = float("inf")
    x[6, vocab - 1] = float("-inf")
    got = greedy_rows(x)
    assert got is not None and got.dtype == torch.int64 and got.shape == (2, 9)
    want = _reference(x)
    assert got[1].tolist() == want[1] == [1, 1, 1, 1, 0, 0, 0, 1, 1]
    finite_rows = [r for r in range(9) if want[1][r]]
    assert [got[0][r].item() for r in finite_rows] == [want[0][r] for r in finite_rows]


def test_rows_apart_in_memory_and_threads() -> None:
    """A view of every other row (stride 2 x vocab), and 300 rows: split over the threads."""
    x = torch.randn(600, 4099).to(torch.bfloat16)[::2]
    got = greedy_rows(x)
    assert got is not None and got.tolist() == _reference(x)


def test_inputs_it_does_not_take() -> None:
    assert greedy_rows(torch.randn(3, 10).half()) is None
    assert greedy_rows(torch.randn(10, 3).t()) is None  # columns not contiguous
    assert greedy_rows(torch.randn(10)) is None
