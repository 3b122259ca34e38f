"""The Triton mixture-of-experts grouped GEMM against the torch path (`moe.experts_loop`, per-expert
`F.linear`) and a float64 reference: experts with no row, one row and many, tiles cut at expert
boundaries, shapes that are not tile multiples; and the whole `FusedExperts` block on it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed: the kernel tests need it (Linux x86-64)")

from batchgen.kernels.triton.fused_moe import expert_tiles, fused_moe_experts  # noqa: E402
from batchgen.model import moe  # noqa: E402


def _reference(x, gate_up, down, counts) -> torch.Tensor:
    """float64, expert by expert over the sorted rows."""
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float64)
    start = 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start : start + n].double().cpu()
        gate, up = (rows @ gate_up[e].double().cpu().T).chunk(2, dim=-1)
        out[start : start + n] = (torch.nn.functional.silu(gate) * up) @ down[e].double().cpu().T
        start += n
    return out


CASES = {
    # counts per expert: empty experts, a single row, an expert over several 16-row tiles
    "uneven": [0, 5, 1, 0, 37, 2],
    "one_row": [0, 0, 1, 0],
    "decode_like": [1, 0, 2, 1, 0, 1, 3, 0],
    "all_to_one": [0, 0, 70],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_path(case, dtype, device, helpers, gen):
    hidden, inter = 48, 40  # neither a multiple of the 32/64 tiles
    counts = torch.tensor(CASES[case])
    num_experts, rows = counts.shape[0], int(counts.sum())
    x = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype).to(device)
    down = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.2).to(dtype).to(device)
    got = fused_moe_experts(x, gate_up, down, counts.to(device))
    ids = torch.repeat_interleave(torch.arange(num_experts), counts).to(device)
    groups = moe.group_by_expert(ids[:, None], num_experts)
    torch_path = moe.experts_loop(x, gate_up, down, groups)
    expected = _reference(x, gate_up, down, counts)
    assert got.shape == (rows, hidden) and got.dtype == dtype
    helpers.assert_close(got.cpu(), expected, dtype, "triton vs float64")
    helpers.assert_close(got.cpu(), torch_path.cpu().double(), dtype, "triton vs torch path")


def test_tiles_never_straddle_experts(device):
    counts = torch.tensor(CASES["uneven"], device=device)
    expert, first, end = (t.cpu().tolist() for t in expert_tiles(counts, 16, 45))
    used = [(e, f, n) for e, f, n in zip(expert, first, end, strict=True) if e >= 0]
    # expert 1: rows 0-4; 2: row 5; 4: rows 6-42 in three tiles; 5: rows 43-44
    assert used == [(1, 0, 5), (2, 5, 6), (4, 6, 43), (4, 22, 43), (4, 38, 43), (5, 43, 45)]
    assert len(expert) == 3 + 6  # the upper bound: cdiv(45, 16) + min(E, S)


def test_block_on_triton_matches_torch(device, helpers, gen):
    """A whole `FusedExperts` (routing weights, regrouping, slot sums) on the Triton kernel."""
    torch.manual_seed(0)
    experts = moe.FusedExperts(8, 32, 24).to(device)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
        x = torch.randn(11, 32, generator=gen).to(device)
        weights = torch.rand(11, 3, generator=gen).to(device)
        ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(11)]).to(device)
        experts.matmul = moe.experts_triton
        got = experts(x, weights, ids)
        experts.matmul = moe.experts_loop
        expected = experts(x, weights, ids)
    helpers.assert_close(got.cpu(), expected.cpu(), torch.float32, "block on triton")


def test_bad_arguments_are_named(device):
    x = torch.zeros(4, 16, device=device)
    with pytest.raises(ValueError, match="down must be"):
        fused_moe_experts(x, torch.zeros(2, 8, 16, device=device), torch.zeros(2, 16, 5, device=device),
                          torch.tensor([2, 2], device=device))  # fmt: skip
    with pytest.raises(TypeError, match="gate_up must have dtype float32"):
        fused_moe_experts(x, torch.zeros(2, 8, 16, device=device).half(), torch.zeros(2, 16, 4, device=device),
                          torch.tensor([2, 2], device=device))  # fmt: skip
