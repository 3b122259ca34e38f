"""batchgen's CPU experts kernels (kernels/cpu/moe.py) against the torch per-expert loop: the bf16
linear one expert at a time on the packed stack, and the one-call kernel (`fused_experts`) on plain
and packed stacks, in float32 and bf16, in this machine's build and the AVX2 one; experts with no
token, one token and all tokens; widths that are not multiples of the vector length."""

from __future__ import annotations

import platform

import pytest
import torch

from batchgen.kernels.cpu import library as cpu_kernels
from batchgen.kernels.cpu.moe import (
    bf16_experts,
    bf16_experts_apply,
    fused_experts,
    fused_experts_apply,
    pack_experts,
)
from batchgen.model import moe

if cpu_kernels.load_library() is None:
    pytest.skip(
        "the C kernels are not built here (no compiler, or BATCHGEN_CPU_KERNELS=0)", allow_module_level=True
    )

needs_bf16_kernel = pytest.mark.skipif(
    not bf16_experts_apply(
        torch.zeros(1, 32, 16, dtype=torch.bfloat16), torch.zeros(1, 16, 16, dtype=torch.bfloat16)
    ),
    reason="batchgen's bf16 kernel needs AVX512-BF16 and a C compiler",
)
# The largest difference from the torch loop, relative to the output's largest magnitude: float32
# sums in another order; bf16 adds a product's rounding in another place (the slot sum is float32
# here, torch rounds each weighted output first): a couple of bf16 ulps.
RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
ISAS = ["native"] + (["AVX2"] if platform.machine() == "x86_64" else [])


@pytest.fixture(scope="module")
def avx2_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("avx2-cache")


@pytest.fixture(params=ISAS)
def isa(request, avx2_cache):
    """The library built for this machine, or for AVX2 (x86-64-v3) into a cache of its own (built
    once, loaded again for each test: the other tests run on the machine's build)."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "AVX2":
            patch.setenv("BATCHGEN_MAX_CPU_ISA", "AVX2")
            patch.setenv("BATCHGEN_CACHE", str(avx2_cache))
        cpu_kernels.load_library.cache_clear()
        assert cpu_kernels.load_library() is not None
        yield request.param
    cpu_kernels.load_library.cache_clear()


def _case(experts, hidden, inter, ids, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=generator) * 0.2).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=generator) * 0.2).to(dtype)
    x = torch.randn(ids.shape[0], hidden, generator=generator).to(dtype)
    weights = torch.rand(ids.shape, generator=generator).to(dtype)
    return x, weights, gate_up, down


def _torch_loop(x, weights, ids, gate_up, down) -> torch.Tensor:
    """The reference: transformers' order (grouped, one `F.linear` pair per expert) in x's dtype."""
    experts = moe.FusedExperts(gate_up.shape[0], x.shape[1], down.shape[2]).to(x.dtype)
    experts.gate_up_proj.data, experts.down_proj.data = gate_up, down
    experts.matmul = moe.experts_loop
    return experts(x, weights, ids)


def _assert_near(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    error = (got.float() - expected.float()).abs().max().item()
    assert error <= RTOL[got.dtype] * expected.float().abs().max().item(), f"max error {error:g}"


# Expert ids [tokens, top_k] over 6 experts: 0 and 5 get no token, 4 one, 1 all five (uneven); one
# token; every token to the same single expert; more tokens an expert than a tile has rows.
ROUTINGS = {
    "uneven": torch.tensor([[1, 2], [1, 3], [2, 1], [1, 4], [3, 1]]),
    "one_token": torch.tensor([[3, 0, 5]]),
    "all_to_one": torch.tensor([[2], [2], [2], [2]]),
    "many_rows": torch.tensor([[e % 6, (e + 1) % 6, (e + 3) % 6] for e in range(29)]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("hidden, inter", [(64, 48), (40, 24), (33, 13)])
def test_fused_matches_torch_loop(isa, dtype, routing, hidden, inter):
    ids = ROUTINGS[routing]
    x, weights, gate_up, down = _case(6, hidden, inter, ids, dtype)
    assert fused_experts_apply(gate_up, down)
    _assert_near(fused_experts(x, weights, ids, gate_up, down), _torch_loop(x, weights, ids, gate_up, down))


@needs_bf16_kernel
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("hidden, inter", [(64, 48), (48, 16), (32, 80)])
def test_fused_on_the_packed_stack_matches_torch_loop_and_the_plain_stack(routing, hidden, inter):
    """Packed strips of 16 columns, 1-4 output strips and odd gate strip counts at the shares' ends."""
    ids = ROUTINGS[routing]
    x, weights, gate_up, down = _case(6, hidden, inter, ids, torch.bfloat16)
    packed = (pack_experts(gate_up), pack_experts(down))
    assert fused_experts_apply(*packed)
    got = fused_experts(x, weights, ids, *packed)
    _assert_near(got, _torch_loop(x, weights, ids, gate_up, down))
    torch.testing.assert_close(got, fused_experts(x, weights, ids, gate_up, down), rtol=0, atol=0)


def test_fused_refuses_ids_out_of_range_and_mismatched_stacks():
    x, weights, gate_up, down = _case(6, 32, 16, ROUTINGS["uneven"], torch.float32)
    with pytest.raises(ValueError, match="outside"):
        fused_experts(x, weights, ROUTINGS["uneven"] + 5, gate_up, down)
    with pytest.raises(ValueError, match="do not fit"):
        fused_experts(x, weights, ROUTINGS["uneven"], gate_up, down[:, :, :8].contiguous())
    with pytest.raises(ValueError, match="float32"):
        fused_experts(x.bfloat16(), weights, ROUTINGS["uneven"], gate_up, down)


@needs_bf16_kernel
@pytest.mark.parametrize("counts", [[0, 5, 1, 0, 37, 2], [0, 0, 1], [3, 3, 3, 3]])
def test_per_expert_bf16_matches_torch_loop(counts):
    torch.manual_seed(0)
    hidden, inter = 64, 48
    experts = len(counts)
    gate_up = (torch.randn(experts, 2 * inter, hidden) * 0.2).to(torch.bfloat16)
    down = (torch.randn(experts, hidden, inter) * 0.2).to(torch.bfloat16)
    x = torch.randn(sum(counts), hidden).to(torch.bfloat16)
    got = bf16_experts(x, pack_experts(gate_up), pack_experts(down), counts)
    ids = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts))
    expected = moe.experts_loop(
        x.float(), gate_up.float(), down.float(), moe.group_by_expert(ids[:, None], experts)
    )
    assert got.dtype == torch.bfloat16 and got.shape == (sum(counts), hidden)
    torch.testing.assert_close(got.float(), expected, rtol=3e-2, atol=3e-2)


@needs_bf16_kernel
def test_pack_layout():
    """Expert e's packed weight is `Bf16Linear`'s packing of its plain weight."""
    from batchgen.kernels.cpu.linear import Bf16Linear

    weight = torch.randn(3, 32, 16).to(torch.bfloat16)
    packed = pack_experts(weight)
    for e in range(3):
        assert torch.equal(packed[e], Bf16Linear.from_weight(weight[e]).packed_weight)


def test_the_packed_kernel_is_offered_only_with_avx512_bf16(isa):
    flags = open("/proc/cpuinfo").read() if platform.system() == "Linux" else ""
    available = cpu_kernels.load_library().moe_experts_packed_available()
    # "native" is the machine's build, under the cap a whole run may set (the AVX2 emulation).
    uncapped = cpu_kernels.isa_cap() in (None, *cpu_kernels._ISAS_WITH_AVX512_BF16)
    assert available == (isa == "native" and uncapped and " avx512_bf16" in flags)
