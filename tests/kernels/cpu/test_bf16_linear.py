"""batchgen's AVX512-BF16 linear kernel (`csrc/bf16_linear.c`, `cpu_linear.Bf16Linear`) against a
float64 reference and oneDNN, over the shapes that exercise its tiles (1-8 rows, 1-4 strips of 16
columns, per-thread shares of strips, several row tiles prefetching the next strips)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchgen.kernels.cpu.linear import (
    Bf16Linear,
    PrepackedLinear,
    bf16_kernel_available,
    bf16_linear_applies,
    can_prepack,
)

pytestmark = pytest.mark.skipif(
    not bf16_kernel_available(),
    reason="batchgen's bf16 linear kernel needs a CPU with AVX512-BF16 and a C compiler",
)


def bf16_linear(out_features: int, in_features: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16).requires_grad_(False)


def assert_close_to_exact(got: torch.Tensor, x: torch.Tensor, linear: nn.Linear) -> None:
    """`got` is the exact product rounded once to bf16, up to float32 summation error.

    bf16 x bf16 products are exact in float32, so the only errors are the float32 sums (at most
    about K * 2^-24 of sum |x w|, bounded here by 2^-20 of it for K <= 1536 * 2) and the final
    rounding to bf16 (half an ulp: 2^-9 of the value).
    """
    w = linear.weight.double()
    exact = x.double() @ w.T
    if linear.bias is not None:
        exact += linear.bias.double()
    magnitude = x.double().abs() @ w.abs().T
    bound = exact.abs() * 2.0**-8 + magnitude * 2.0**-20 + 1e-30
    error = (got.double() - exact).abs()
    assert (error <= bound).all(), f"max error/bound {(error / bound).max().item():.3f}"


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "out_features,in_features",
    [(16, 2), (48, 96), (80, 64), (160, 96), (960, 576), (576, 1536)],
)
def test_matches_the_exact_product_rounded_once(out_features: int, in_features: int, bias: bool) -> None:
    linear = bf16_linear(out_features, in_features, bias)
    layer = Bf16Linear.from_linear(linear)
    for rows in [*range(1, 14), 64, 301]:
        x = torch.randn(rows, in_features).to(torch.bfloat16)
        got = layer(x)
        assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
        assert_close_to_exact(got, x, linear)


@pytest.mark.skipif(
    not can_prepack(torch.bfloat16, torch.device("cpu")), reason="this torch's oneDNN has no bf16"
)
def test_agrees_with_onednn_within_one_rounding() -> None:
    linear = bf16_linear(3072, 576, bias=False)
    ours, onednn = Bf16Linear.from_linear(linear), PrepackedLinear.from_linear(linear)
    x = torch.randn(37, 576).to(torch.bfloat16)
    a, b = ours(x).float(), onednn(x).float()
    # both sum in float32, in different orders: at most one bf16 step (2^-7 relative) apart
    assert ((a - b).abs() <= b.abs() * 2.0**-7 + 1e-6).all()
    assert (a == b).float().mean() > 0.95


def test_a_rows_result_does_not_depend_on_the_rows_beside_it() -> None:
    """Every tiling (one tile of up to 8 rows x 3-4 strips, several 6-row tiles) sums each output in
    the same order, so a row computed alone equals the same row inside any batch."""
    layer = Bf16Linear.from_linear(bf16_linear(80, 96, bias=True))
    x = torch.randn(40, 96).to(torch.bfloat16)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(40)])
    for rows in (2, 6, 7, 8, 9, 13, 40):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows


def test_thread_count_does_not_change_the_result() -> None:
    """Each output is summed by one thread in one order, so 1 and 2 threads agree bit for bit."""
    layer = Bf16Linear.from_linear(bf16_linear(80, 64, bias=True))
    x = torch.randn(300, 64).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(2)
        two = layer(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_takes_strided_and_batched_input() -> None:
    linear = bf16_linear(48, 96, bias=True)
    layer = Bf16Linear.from_linear(linear)
    wide = torch.randn(9, 130).to(torch.bfloat16)
    columns = wide[:, 20:116]  # rows 130 elements apart
    assert columns.stride() == (130, 1)
    torch.testing.assert_close(layer(columns), layer(columns.contiguous()), rtol=0, atol=0)
    transposed = torch.randn(96, 5).to(torch.bfloat16).T  # no unit stride: copied first
    torch.testing.assert_close(layer(transposed), layer(transposed.contiguous()), rtol=0, atol=0)
    batched = torch.randn(2, 7, 96).to(torch.bfloat16)
    got = layer(batched)
    assert got.shape == (2, 7, 48)
    torch.testing.assert_close(got, layer(batched.reshape(14, 96)).reshape(2, 7, 48), rtol=0, atol=0)
    assert layer(torch.empty(0, 96, dtype=torch.bfloat16)).shape == (0, 48)


def test_refuses_input_it_cannot_take() -> None:
    layer = Bf16Linear.from_linear(bf16_linear(48, 96, bias=False))
    with pytest.raises(ValueError, match=r"bf16 \[\.\.\., 96\]"):
        layer(torch.randn(3, 96))
    with pytest.raises(ValueError, match=r"bf16 \[\.\.\., 96\]"):
        layer(torch.randn(3, 95).to(torch.bfloat16))


def test_applies_only_to_shapes_and_dtypes_it_takes() -> None:
    assert bf16_linear_applies(torch.zeros(64, 96, dtype=torch.bfloat16))
    assert not bf16_linear_applies(torch.zeros(50, 96, dtype=torch.bfloat16))  # 50 % 16
    assert not bf16_linear_applies(torch.zeros(64, 95, dtype=torch.bfloat16))  # odd K
    assert not bf16_linear_applies(torch.zeros(64, 96))  # float32: oneDNN's path


def test_building_one_without_the_kernel_says_why(monkeypatch):
    from batchgen.kernels.cpu import linear as cpu_linear

    monkeypatch.setattr(cpu_linear, "bf16_kernel_available", lambda: False)
    assert not cpu_linear.bf16_linear_applies(torch.zeros(64, 96, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="needs a CPU with AVX512-BF16"):
        Bf16Linear.from_weight(torch.zeros(64, 96, dtype=torch.bfloat16))
