"""The mixture-of-experts block (batchgen/model/moe.py) against transformers' own Qwen3-MoE and
Mixtral blocks and against a per-expert loop written here; its loading from per-expert and fused
checkpoint names; which layers are sparse."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeSparseMoeBlock

from batchgen.model import moe

HIDDEN, WIDTH, EXPERTS = 32, 16, 6


def per_expert_loop(x, gate_up, down, weights, ids) -> torch.Tensor:
    """The textbook mixture in float64: for each token, for each of its slots, the chosen expert's
    SwiGLU scaled by the slot's weight, summed."""
    x, gate_up, down, weights = (t.double() for t in (x, gate_up, down, weights))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            gate, up = F.linear(x[t], gate_up[e]).chunk(2)
            out[t] += weights[t, slot] * F.linear(F.silu(gate) * up, down[e])
    return out


def random_experts(seed: int = 0) -> moe.FusedExperts:
    torch.manual_seed(seed)
    experts = moe.FusedExperts(EXPERTS, HIDDEN, WIDTH)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    return experts


# Expert ids `[tokens, top_k]`: expert 0 and 5 get no token, 4 gets one, 1 gets five (uneven).
ROUTINGS = {
    "uneven": torch.tensor([[1, 2], [1, 3], [2, 1], [1, 4], [3, 1]]),
    "one_token": torch.tensor([[3, 0, 5]]),
    "all_to_one": torch.tensor([[2], [2], [2], [2]]),
}


@pytest.mark.parametrize("matmul", ["loop", "grouped_mm"])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_experts_match_per_expert_loop(matmul, routing):
    if matmul == "grouped_mm" and not hasattr(F, "grouped_mm"):
        pytest.skip("this torch has no grouped_mm")
    experts = random_experts()
    experts.matmul = moe.experts_loop if matmul == "loop" else moe.experts_grouped_mm
    ids = ROUTINGS[routing]
    x = torch.randn(ids.shape[0], HIDDEN)
    weights = torch.rand(ids.shape)
    with torch.no_grad():
        got = experts(x, weights, ids)
    expected = per_expert_loop(x, experts.gate_up_proj, experts.down_proj, weights, ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


def test_grouping_counts_and_order():
    groups = moe.group_by_expert(ROUTINGS["uneven"], EXPERTS)
    assert groups.counts.tolist() == [0, 5, 2, 2, 1, 0]
    assert groups.offsets.tolist() == [0, 5, 7, 9, 10, 10]
    # pairs token * 2 + slot: expert 1's, then 2's, 3's, 4's (within an expert in sort's order)
    order = groups.order.tolist()
    assert [sorted(order[a:b]) for a, b in ((0, 5), (5, 7), (7, 9), (9, 10))] == [
        [0, 2, 5, 6, 9], [1, 4], [3, 8], [7]
    ]  # fmt: skip


def test_loop_skips_experts_without_tokens(monkeypatch):
    """The loop multiplies only the experts that received rows: one call pair each."""
    calls = []
    real = F.linear

    def counting(x, w, *args):
        calls.append(tuple(w.shape))
        return real(x, w, *args)

    monkeypatch.setattr(moe.F, "linear", counting)
    experts = random_experts()
    experts.matmul = moe.experts_loop
    with torch.no_grad():
        experts(torch.randn(5, HIDDEN), torch.rand(5, 2), ROUTINGS["uneven"])
    assert len(calls) == 2 * 4  # experts 1, 2, 3, 4


def _hf_block(kind: str, norm_topk_prob: bool = False, top_k: int = 2):
    torch.manual_seed(1)
    if kind == "mixtral":
        config = MixtralConfig(
            hidden_size=HIDDEN, intermediate_size=WIDTH, num_local_experts=EXPERTS, num_experts_per_tok=top_k
        )
        block = MixtralSparseMoeBlock(config)
    else:
        config = Qwen3MoeConfig(
            hidden_size=HIDDEN,
            moe_intermediate_size=WIDTH,
            num_experts=EXPERTS,
            num_experts_per_tok=top_k,
            norm_topk_prob=norm_topk_prob,
        )
        block = Qwen3MoeSparseMoeBlock(config)
    config._experts_implementation = "grouped_mm"  # transformers' default where torch has it
    with torch.no_grad():
        block.gate.weight.normal_(0, 1.0)
        block.experts.gate_up_proj.normal_(0, 0.2)
        block.experts.down_proj.normal_(0, 0.2)
    return config, block.eval()


@pytest.mark.parametrize(
    "kind, norm_topk_prob, top_k",
    [("mixtral", True, 2), ("qwen3_moe", False, 3), ("qwen3_moe", True, 4)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_matches_transformers(kind, norm_topk_prob, top_k, dtype):
    """Router and experts together give transformers' block output, to the bit in float32 on the
    grouped matmul both run, and within bf16 rounding in bf16."""
    config, hf = _hf_block(kind, norm_topk_prob, top_k)
    spec = moe.moe_spec(config)
    assert spec is not None and spec.top_k == top_k and spec.norm_topk_prob == norm_topk_prob
    ours = moe.SparseMoeBlock(HIDDEN, spec)
    ours.load_state_dict(hf.state_dict())
    hf, ours = hf.to(dtype), ours.to(dtype)
    x = torch.randn(1, 23, HIDDEN).to(dtype)
    with torch.no_grad():
        expected = hf(x)[0]
        got = ours(x[0])
        weights, ids = moe.route(ours.gate(x[0]), top_k, norm_topk_prob, torch.float32)
    counts = torch.bincount(ids.reshape(-1), minlength=EXPERTS)
    assert counts.max() > counts.min()  # the routing is uneven
    assert got.dtype == dtype
    if dtype == torch.float32 and hasattr(F, "grouped_mm"):
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def test_route_matches_transformers_router():
    config, hf = _hf_block("qwen3_moe", norm_topk_prob=True, top_k=3)
    x = torch.randn(9, HIDDEN)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf.gate(x)
        weights, ids = moe.route(F.linear(x, hf.gate.weight), 3, True, torch.float32)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
    assert torch.allclose(weights.sum(-1), torch.ones(9))


def test_sparse_layers_follow_transformers():
    config = Qwen3MoeConfig(
        hidden_size=HIDDEN,
        intermediate_size=64,
        moe_intermediate_size=WIDTH,
        num_experts=EXPERTS,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    )
    hf = [isinstance(Qwen3MoeDecoderLayer(config, i).mlp, Qwen3MoeSparseMoeBlock) for i in range(6)]
    assert hf == [False, True, False, False, False, True]
    assert [moe.is_sparse_layer(config, i) for i in range(6)] == hf
    assert moe.sparse_layer_count(config) == 2
    assert all(moe.is_sparse_layer(MixtralConfig(num_hidden_layers=2), i) for i in range(2))


class _Holder(torch.nn.Module):
    """`model.layers.0.mlp` holding a sparse block, as the decoder names it."""

    def __init__(self, spec: moe.MoeSpec) -> None:
        super().__init__()
        layer = torch.nn.Module()
        layer.mlp = moe.SparseMoeBlock(HIDDEN, spec)
        self.layers = torch.nn.ModuleList([layer])


def test_per_expert_names_load_into_the_stack():
    spec = moe.MoeSpec(EXPERTS, 2, WIDTH, True, True)
    model = _Holder(spec)
    gate = [torch.randn(WIDTH, HIDDEN) for _ in range(EXPERTS)]
    up = [torch.randn(WIDTH, HIDDEN) for _ in range(EXPERTS)]
    down = [torch.randn(HIDDEN, WIDTH) for _ in range(EXPERTS)]
    loaded = set()
    for e in range(EXPERTS):  # Mixtral's names: w1 gate, w3 up, w2 down, under block_sparse_moe
        for proj, tensor in (("w1", gate[e]), ("w3", up[e]), ("w2", down[e])):
            name = moe.checkpoint_name(f"layers.0.block_sparse_moe.experts.{e}.{proj}.weight")
            key = moe.load_expert_weight(model, name, tensor)
            assert key is not None
            loaded.add(key)
    experts = model.layers[0].mlp.experts
    assert torch.equal(
        experts.gate_up_proj, torch.stack([torch.cat((g, u)) for g, u in zip(gate, up, strict=True)])
    )
    assert torch.equal(experts.down_proj, torch.stack(down))
    assert experts.missing("layers.0.mlp.experts.gate_up_proj", loaded) == []
    loaded.discard("layers.0.mlp.experts.down_proj#4.down")
    assert experts.missing("layers.0.mlp.experts.down_proj", loaded) == [
        "layers.0.mlp.experts.down_proj#4.down"
    ]
    # the fused name counts whole
    assert experts.missing("layers.0.mlp.experts.down_proj", {"layers.0.mlp.experts.down_proj"}) == []
    # not an expert weight: left to the caller
    assert moe.load_expert_weight(model, "layers.0.mlp.gate.weight", torch.zeros(EXPERTS, HIDDEN)) is None


def test_bad_expert_weights_are_named():
    model = _Holder(moe.MoeSpec(EXPERTS, 2, WIDTH, False, False))
    with pytest.raises(ValueError, match=r"experts\.0\.up_proj\.weight.*shape \(3, 3\)"):
        moe.load_expert_weight(model, "layers.0.mlp.experts.0.up_proj.weight", torch.zeros(3, 3))
    with pytest.raises(ValueError, match=f"expert 9 of {EXPERTS}"):
        moe.load_expert_weight(model, "layers.0.mlp.experts.9.up_proj.weight", torch.zeros(WIDTH, HIDDEN))
    with pytest.raises(ValueError, match="that layer has no experts"):
        moe.load_expert_weight(model, "layers.7.mlp.experts.0.up_proj.weight", torch.zeros(WIDTH, HIDDEN))
