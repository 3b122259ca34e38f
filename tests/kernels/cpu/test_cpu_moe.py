"""batchgen's bf16 CPU experts kernel (kernels/cpu/moe.py) against the torch per-expert loop: experts
with no row, one row and many; the packed stack; and a model whose experts it runs."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.cpu.moe import bf16_experts, bf16_experts_apply, pack_experts
from batchgen.model import moe

pytestmark = pytest.mark.skipif(
    not bf16_experts_apply(
        torch.zeros(1, 32, 16, dtype=torch.bfloat16), torch.zeros(1, 16, 16, dtype=torch.bfloat16)
    ),
    reason="batchgen's bf16 kernel needs AVX512-BF16 and a C compiler",
)


@pytest.mark.parametrize("counts", [[0, 5, 1, 0, 37, 2], [0, 0, 1], [3, 3, 3, 3]])
def test_matches_torch_loop(counts):
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


def test_pack_layout():
    """Expert e's packed weight is `Bf16Linear`'s packing of its plain weight."""
    from batchgen.kernels.cpu.linear import Bf16Linear

    weight = torch.randn(3, 32, 16).to(torch.bfloat16)
    packed = pack_experts(weight)
    for e in range(3):
        assert torch.equal(packed[e], Bf16Linear.from_weight(weight[e]).packed_weight)


def test_block_on_the_kernel_matches_torch():
    """`use_bf16_kernel` packs a block's stack in place and its output stays the torch path's."""
    torch.manual_seed(1)
    block = moe.SparseMoeBlock(64, moe.MoeSpec(8, 2, 32, True, True)).to(torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
        x = torch.randn(13, 64).to(torch.bfloat16)
        block.experts.matmul = moe.experts_loop
        expected = block(x).float()
        assert moe.use_bf16_kernel(block.experts)
        assert block.experts.gate_up_proj.shape == (8, 4, 32, 16, 2)
        got = block(x).float()
    torch.testing.assert_close(got, expected, rtol=3e-2, atol=3e-2)
