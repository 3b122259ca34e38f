"""batchgen's C token-mask apply (`kernels/cpu/csrc/token_mask.c`) against xgrammar's own apply,
bit for bit, on random bitmasks with words of every kind (all allowed, none, mixed)."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.cpu import library as cpu_kernels
from batchgen.kernels.cpu.ops import apply_token_bitmask

pytestmark = pytest.mark.skipif(
    cpu_kernels.load_library() is None, reason="no C compiler to build the kernels"
)


def _bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """int32 `[rows, ceil(vocab / 32)]`: a third of the words all allowed, a third none, a third random."""
    g = torch.Generator().manual_seed(seed)
    words = -(-vocab // 32)
    kind = torch.randint(0, 3, (rows, words), generator=g)
    random = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    return torch.where(
        kind == 0, torch.full_like(random, -1), torch.where(kind == 1, torch.zeros_like(random), random)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [49152, 1000, 33])  # the default model's, and two not a multiple of 32
def test_the_c_apply_equals_xgrammars(dtype, vocab) -> None:
    xgrammar = pytest.importorskip("xgrammar")
    logits = torch.randn(7, vocab).to(dtype)
    bitmask = _bitmask(9, vocab, seed=vocab)  # more bitmask rows than logits rows, as the runner's buffer
    rows = [0, 2, 3, 6]  # rows 1, 4 and 5 have no constraint
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask[:7], vocab_size=vocab, indices=rows)
    assert apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[rows]).any() and not torch.isinf(logits[[1, 4, 5]]).any()


def test_a_row_outside_the_logits_is_refused() -> None:
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError, match=r"mask rows must be in \[0, 2\)"):
        apply_token_bitmask(logits, torch.zeros(4, 2, dtype=torch.int32), [2])


def test_tensors_it_does_not_take_are_left_to_xgrammar() -> None:
    """A float64 logits tensor or an int64 bitmask: False, nothing written."""
    logits = torch.zeros(2, 64, dtype=torch.float64)
    assert not apply_token_bitmask(logits, torch.zeros(2, 2, dtype=torch.int32), [0])
    assert not torch.isinf(logits).any()
    assert not apply_token_bitmask(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64), [0])
