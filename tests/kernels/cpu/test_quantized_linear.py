"""The linears on int8 weights (`kernels/cpu/quantized_linear.py`; `csrc/int8_w8a16.c`,
`int8_w8a8.c`): each kernel against the float32 product with the same quantized
weights, dequantized (W8A8: and the activations quantized per row as the kernel does), on odd
shapes (K not a multiple of 4, of the group, of the vector width or of 32, one row, 2,049 rows, one
channel), in this machine's build and in the AVX2 build that `BATCHGEN_MAX_CPU_ISA=AVX2` makes
(x86-64-v3, 8 lanes; W8A8 through VPMADDUBSW there, VPDPBUSD with AVX512-VNNI)."""

from __future__ import annotations

import platform

import pytest
import torch
from torch.nn import functional as F

from batchgen.kernels.cpu import attention as cpu_attention
from batchgen.kernels.cpu import library as cpu_kernels
from batchgen.kernels.cpu.int8_weight import int8_weight_bytes
from batchgen.kernels.cpu.quantized_linear import (
    Int8Bf16DotLinear,
    Int8Linear,
    Int8W8A8Linear,
    Int8Weight,
    TorchInt8Linear,
    bf16_dot_available,
    quantized_candidates,
    torch_int8_available,
    w8a8_available,
)

if cpu_kernels.load_library() is None:
    pytest.skip(
        "the C kernels are not built here (no compiler, or BATCHGEN_CPU_KERNELS=0)", allow_module_level=True
    )

# Relative to the reference's largest magnitude: float32 sums in another order; bf16 output rounding.
RTOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}
INT8_SHAPES = [(1, 7, 97), (1, 1, 5), (3, 33, 129), (5, 64, 16), (9, 40, 1536), (2049, 20, 70), (8, 192, 576)]
ISAS = ["native"] + (["AVX2"] if platform.machine() == "x86_64" else [])


@pytest.fixture(scope="module", params=ISAS)
def lanes(request, tmp_path_factory):
    """The library built for this machine, or for AVX2 into a cache of its own; its vector width."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "AVX2":
            patch.setenv("BATCHGEN_MAX_CPU_ISA", "AVX2")
            patch.setenv("BATCHGEN_CACHE", str(tmp_path_factory.mktemp("avx2-cache")))
        cpu_kernels.load_library.cache_clear()
        cpu_attention.supports.cache_clear()
        library = cpu_kernels.load_library()
        assert library is not None
        yield library.int8_linear_lanes()
    cpu_kernels.load_library.cache_clear()
    cpu_attention.supports.cache_clear()


def _case(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator) * 0.05
    bias = torch.randn(n, generator=generator)
    x = torch.randn(m, k, generator=generator)
    return x, weight, bias


def _check(module, x: torch.Tensor, dequantized: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    x = x.to(dtype)
    expected = F.linear(x.float(), dequantized, bias)
    out = module(x)
    assert out.dtype == dtype and out.shape == expected.shape
    error = (out.float() - expected).abs().max().item()
    assert error <= RTOL[dtype] * expected.abs().max().item(), f"max error {error:g}"


def test_this_build_is_avx512_or_avx2_as_asked(lanes):
    flags = open("/proc/cpuinfo").read() if platform.system() == "Linux" else ""
    if cpu_kernels.isa_cap() == "AVX2":
        assert lanes == 8
    elif " avx512f " in flags and " avx512bw " in flags:
        assert lanes == 16


def _quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` float32 `[M, K]` as the W8A8 kernel quantizes it (one scale a row, max |x| / 127, the
    values rounded to nearest even after multiplying by 127 / max |x|), dequantized."""
    absmax = x.abs().amax(dim=1, keepdim=True)
    inverse = torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax))
    return torch.round(x * inverse) * (absmax / 127.0)


@pytest.mark.parametrize("group_size", [64, 12, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), INT8_SHAPES)
def test_int8_kernels_match_the_dequantized_product(lanes, m, n, k, dtype, group_size):
    """W8A16 against the product with the dequantized weight; W8A8 against the product of the
    quantized activations with it (both float32 sums in another order: 1e-5 of the largest
    output), and within 2^-6 of the W8A16 product (what the activations' rounding costs here)."""
    x, weight, bias = _case(m, n, k)
    quantized = Int8Weight.quantize(weight, group_size)
    _check(Int8Linear(quantized, bias), x, quantized.dequantize(), bias, dtype)
    _check(Int8Linear(quantized, None), x, quantized.dequantize(), None, dtype)
    if w8a8_available():
        x = x.to(dtype)
        out = Int8W8A8Linear(quantized, bias)(x)
        assert out.dtype == dtype
        for rows, rtol in ((_quantized_rows(x.float()), RTOL[dtype]), (x.float(), 2**-6)):
            expected = F.linear(rows, quantized.dequantize(), bias)
            assert (out.float() - expected).abs().max().item() <= rtol * expected.abs().max().item()


def _with_offsets(weight: Int8Weight, seed: int = 5) -> Int8Weight:
    """`weight` with random offsets a group (as a GGUF Q4_1 or K-quant block's minimum)."""
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.randn(weight.scales.shape, generator=generator) * weight.scales * 64
    return Int8Weight(weight.qweight, weight.scales, weight.group_size, offsets)


@pytest.mark.parametrize("group_size", [32, 12, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), INT8_SHAPES)
def test_int8_kernels_with_offsets_match_the_dequantized_product(lanes, m, n, k, dtype, group_size):
    """W8A16 adds each group's offset to its scaled weights (`scales * q + offsets`, a GGUF file's
    asymmetric blocks): against the float32 product with the dequantized weight, every tile height
    (1 to 2,049 rows), float32 and bf16 input; the VDPBF16PS tiles too where built. The offsets
    change the output (the kernel does not skip them), and W8A8 and torch's int8 kernel, which take
    no offsets, are not offered."""
    x, weight, bias = _case(m, n, k)
    symmetric = Int8Weight.quantize(weight, group_size)
    quantized = _with_offsets(symmetric)
    _check(Int8Linear(quantized, bias), x, quantized.dequantize(), bias, dtype)
    assert not torch.equal(Int8Linear(quantized, None)(x), Int8Linear(symmetric, None)(x))
    if dtype == torch.bfloat16 and bf16_dot_available():
        _check(Int8Bf16DotLinear(quantized, bias), x, quantized.dequantize().bfloat16().float(), bias, dtype)
    offered = quantized_candidates(quantized, quantized.dequantize().to(dtype), bias, w8a8=True)
    assert "int8_c" in offered and "int8_w8a8" not in offered and "int8_torch" not in offered


def test_offsets_are_exact_where_every_sum_is_exact(lanes):
    """Integer inputs, power-of-two scales and integer offsets: every weight `scale * q + offset` and
    every partial sum is exact, so the kernel gives the reference's value bit for bit."""
    generator = torch.Generator().manual_seed(2)
    m, n, k, group = 6, 19, 256, 32
    qweight = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.int8)  # Q4_1's values
    scales = 2.0 ** torch.randint(-4, 2, (n, k // group), generator=generator).float()
    offsets = torch.randint(-8, 8, (n, k // group), generator=generator).float()
    weight = Int8Weight(qweight, scales, group, offsets)
    x = torch.randint(-16, 17, (m, k), generator=generator).float()
    assert torch.equal(Int8Linear(weight, None)(x), F.linear(x, weight.dequantize()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_row_is_the_same_alone_or_in_any_tile(lanes, dtype):
    """W8A16 takes up to 2 (AVX2) or 4 (AVX-512) rows in full-strip tiles and more in half-strip
    ones (`csrc/int8_w8a16.c`); every batch size from 1 to 29 (every tile size, a last tile of each
    size) gives each row bit for bit what it gives alone, so greedy output does not depend on the
    batch."""
    x, weight, bias = _case(29, 70, 100, seed=3)
    module = Int8Linear(Int8Weight.quantize(weight), bias)
    x = x.to(dtype)
    alone = torch.cat([module(x[i : i + 1]) for i in range(x.shape[0])])
    for rows in range(1, x.shape[0] + 1):
        assert torch.equal(module(x[:rows]), alone[:rows]), rows


@pytest.mark.parametrize(("m", "n", "k"), INT8_SHAPES)
def test_int8_bf16_dot_tiles_match_the_bf16_weights_product(lanes, m, n, k):
    """ "int8_c_dpbf16" against the float32 product of the bf16 input with the dequantized weight
    rounded to bf16 (the float layouts' weight): float32 sums in another order, then the bf16
    output's rounding; each row the same alone or in a batch."""
    if not bf16_dot_available():
        pytest.skip("no AVX512-BF16 tiles in this build")
    x, weight, bias = _case(m, n, k)
    quantized = Int8Weight.quantize(weight)
    module = Int8Bf16DotLinear(quantized, bias)
    _check(module, x, quantized.dequantize().bfloat16().float(), bias, torch.bfloat16)
    rows = x[:9].bfloat16()
    assert torch.equal(module(rows), torch.cat([module(rows[i : i + 1]) for i in range(rows.shape[0])]))
    with pytest.raises(RuntimeError, match="failed"):  # bf16 input only
        module(x)


def test_w8a8_is_built_where_the_cpu_has_vnni_or_avx2(lanes):
    flags = open("/proc/cpuinfo").read() if platform.system() == "Linux" else ""
    if lanes == 8 and " avx2 " in flags:
        assert w8a8_available()
    elif lanes == 16 and " avx512_vnni " in flags and cpu_kernels.isa_cap() is None:
        assert w8a8_available()


def test_exact_where_every_sum_is_exact(lanes):
    """Integer inputs and power-of-two scales: every product and partial sum is an integer below
    2^24 (times the scale), so any order of the sums gives the reference's value bit for bit; W8A8's
    int32 sums too (the inputs are their own int8 values)."""
    generator = torch.Generator().manual_seed(1)
    m, n, k = 7, 21, 333
    qweight = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
    scales = 2.0 ** torch.randint(-8, 2, (n,), generator=generator).float()
    x = torch.randint(-127, 128, (m, k), generator=generator).float()
    x[:, 5] = 127.0  # every row's largest magnitude 127: W8A8 quantizes it to itself (scale 1)
    for group_size in (336, 64):  # one group a channel; groups of 64, one scale a channel repeated
        weight = Int8Weight(qweight, scales[:, None].repeat(1, -(-k // group_size)), group_size)
        expected = F.linear(x, weight.dequantize())
        assert torch.equal(Int8Linear(weight, None)(x), expected)
        if w8a8_available():
            assert torch.equal(Int8W8A8Linear(weight, None)(x), expected)


@pytest.mark.parametrize("fmt", ["int8", "w8a8", "int8_offsets"])
def test_a_row_does_not_depend_on_the_rows_beside_it(lanes, fmt):
    """Row tiles of every height sum each row's products in the same order (W8A8: each row
    quantized by itself), so a row's output is bit for bit the same alone or in a batch (the
    engine's greedy output does not depend on the batch)."""
    x, weight, bias = _case(37, 45, 160)
    if fmt == "w8a8" and not w8a8_available():
        pytest.skip("no W8A8 kernel in this build")
    quantized = Int8Weight.quantize(weight)
    if fmt == "int8_offsets":
        quantized = _with_offsets(quantized)
    module = (Int8W8A8Linear if fmt == "w8a8" else Int8Linear)(quantized, bias)
    together = module(x)
    assert torch.equal(together, torch.cat([module(x[i : i + 1]) for i in range(37)]))
    assert torch.equal(together[:5], module(x[:5]))


def test_strided_rows_and_leading_dimensions(lanes):
    """Rows of a wider tensor (ldx > K) and a 3-D input are taken as they come."""
    x, weight, bias = _case(6, 19, 80)
    wide = torch.randn(6, 200)
    wide[:, 50:130] = x
    quantized = Int8Weight.quantize(weight)
    expected = F.linear(x, quantized.dequantize(), bias)
    module = Int8Linear(quantized, bias)
    torch.testing.assert_close(module(wide[:, 50:130]), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(module(x.view(2, 3, 80)), expected.view(2, 3, 19), rtol=1e-5, atol=1e-5)


def test_int8_quantization_is_symmetric_per_channel_and_group():
    weight = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.5, -0.75]])
    quantized = Int8Weight.quantize(weight)  # K = 3, below a group: one scale a channel
    assert quantized.qweight.dtype == torch.int8 and quantized.scales.dtype == torch.float32
    assert quantized.qweight.tolist() == [[64, -127, 32], [0, 0, 0], [127, 64, -32]]
    torch.testing.assert_close(quantized.scales, torch.tensor([[1 / 127], [1.0], [3 / 127]]))
    assert quantized.nbytes == 9 + 3 * 4
    grouped = Int8Weight.quantize(torch.tensor([[1.0, -0.5, 0.0, 0.25, 4.0, 2.0, -1.0, 0.0, 0.5]]), 4)
    assert grouped.qweight.tolist() == [[127, -64, 0, 32, 127, 64, -32, 0, 127]]
    torch.testing.assert_close(grouped.scales, torch.tensor([[1 / 127, 4 / 127, 0.5 / 127]]))
    assert torch.equal(
        grouped.dequantize(),
        grouped.qweight.float() * torch.tensor([[1 / 127] * 4 + [4 / 127] * 4 + [0.5 / 127]]),
    )
    with pytest.raises(ValueError, match="multiple of 4"):
        Int8Weight.quantize(torch.randn(2, 20), 6)
    with pytest.raises(ValueError, match=r"must be \[3, 1\]"):
        Int8Weight(quantized.qweight, torch.ones(3, 2), 4)


@pytest.mark.parametrize("n, k", [(1, 3), (5, 6), (7, 16), (3, 100), (2, 576), (4, 1536)])
def test_the_weight_bytes_from_a_shape_are_the_quantized_weights(n, k):
    """What `batchgen plan` counts from a config (`int8_weight_bytes`) is what quantizing holds, for K
    below, at and off a group (a partial last group of scales), with offsets too."""
    assert int8_weight_bytes(n, k) == Int8Weight.quantize(torch.randn(n, k)).nbytes
    assert int8_weight_bytes(n, k, 4) == Int8Weight.quantize(torch.randn(n, k), 4).nbytes
    assert (
        int8_weight_bytes(n, k, 4, offsets=True)
        == _with_offsets(Int8Weight.quantize(torch.randn(n, k), 4)).nbytes
    )


def _starting_at(tensor: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of `tensor` whose data starts `offset` bytes past a 64-byte boundary (as a tensor read
    from a safetensors file, or a view into a step's rows, can)."""
    flat = torch.empty(tensor.numel() + 64, dtype=tensor.dtype)
    start = ((offset - flat.data_ptr()) % 64) // tensor.element_size()
    view = flat[start : start + tensor.numel()].view(tensor.shape)
    view.copy_(tensor)
    assert view.data_ptr() % 64 == offset
    return view


@pytest.mark.skipif(not torch_int8_available(), reason="torch has no _weight_int8pack_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_int8_candidate_gets_aligned_operands(dtype):
    """torch's kernel crashes the process on an operand off a 64-byte boundary: weights, scales and
    inputs that start elsewhere reach it as aligned copies."""
    x, weight, bias = _case(5, 24, 64)
    quantized = Int8Weight.quantize(weight, 64)  # one scale a channel, as torch takes
    unaligned = Int8Weight(_starting_at(quantized.qweight, 56), _starting_at(quantized.scales, 8), 64)
    assert unaligned.qweight.data_ptr() % 64 == 0 and torch.equal(unaligned.qweight, quantized.qweight)
    module = TorchInt8Linear(unaligned, bias)
    _check(
        module,
        _starting_at(x.to(dtype), 8 if dtype == torch.float32 else 2),
        quantized.dequantize(),
        bias,
        dtype,
    )


def test_torch_int8_is_offered_only_where_k_is_a_multiple_of_16():
    """K = 104 gave wrong sums and K = 120 crashed torch 2.13's kernel: such layers never reach it;
    nor do weights with more than one scale a channel (torch's kernel takes one)."""
    for k, offered in ((64, True), (97, False), (104, False), (120, False), (576, True)):
        weight = Int8Weight.quantize(torch.randn(8, k), 4096)
        names = quantized_candidates(weight, weight.dequantize(), None)
        assert ("int8_torch" in names) == (offered and torch_int8_available()), k
    grouped = Int8Weight.quantize(torch.randn(8, 576), 64)
    assert "int8_torch" not in quantized_candidates(grouped, grouped.dequantize(), None)


def test_candidates_of_each_format():
    weight = torch.randn(16, 64)
    int8 = Int8Weight.quantize(weight)
    names = set(quantized_candidates(int8, int8.dequantize(), None))
    assert {"int8_c", "torch"} <= names
    assert "int8_w8a8" not in names  # its activations' rounding costs accuracy: only when asked
    assert "int8_c_dpbf16" not in names  # float32 activations
    bf16 = set(quantized_candidates(int8, int8.dequantize().bfloat16(), None))
    assert ("int8_c_dpbf16" in bf16) == bf16_dot_available()
    asked = set(quantized_candidates(int8, int8.dequantize(), None, w8a8=True))
    assert ("int8_w8a8" in asked) == w8a8_available()
