"""batchgen's AMX linear kernel (`csrc/amx_linear.c`, `cpu_linear.AmxLinear`) against a float64
reference, batchgen's AVX512-BF16 kernel and itself: every row-block tail (1-32 rows), panel
boundaries (512 rows), one or two strips per tile pair, biases, and the decoder stack on it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchgen.kernels.cpu.linear import (
    AmxLinear,
    Bf16Linear,
    PlainLinear,
    TunedLinear,
    amx_kernel_available,
    amx_linear_applies,
    linear_candidates,
    swiglu_for_rows,
)
from batchgen.kernels.cpu.ops import silu_mul_bf16
from batchgen.model.layers import MLP
from tests.kernels.cpu.test_bf16_linear import assert_close_to_exact, bf16_linear

pytestmark = pytest.mark.skipif(
    not amx_kernel_available(),
    reason="batchgen's AMX linear kernel needs a CPU with AMX (amx_bf16, amx_tile), Linux and a C compiler",
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features,in_features", [(16, 32), (48, 64), (80, 96), (960, 576), (576, 1536)])
def test_matches_the_exact_product_rounded_once(out_features: int, in_features: int, bias: bool) -> None:
    linear = bf16_linear(out_features, in_features, bias)
    layer = AmxLinear.from_linear(linear)
    for rows in [*range(1, 18), 31, 32, 33, 64, 301, 513, 1100]:
        x = torch.randn(rows, in_features).to(torch.bfloat16)
        got = layer(x)
        assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
        assert_close_to_exact(got, x, linear)


def test_agrees_with_the_avx512_kernel_within_one_rounding() -> None:
    linear = bf16_linear(3072, 576, bias=True)
    amx, avx = AmxLinear.from_linear(linear), Bf16Linear.from_linear(linear)
    x = torch.randn(45, 576).to(torch.bfloat16)
    a, b = amx(x).float(), avx(x).float()
    assert ((a - b).abs() <= b.abs() * 2.0**-7 + 1e-6).all()
    assert (a == b).float().mean() > 0.95


def test_a_rows_result_does_not_depend_on_the_rows_beside_it_nor_on_threads() -> None:
    """Each output sums K in the same order wherever its row lies in a tile, panel or thread's share."""
    layer = AmxLinear.from_linear(bf16_linear(80, 96, bias=True))
    x = torch.randn(600, 96).to(torch.bfloat16)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(600)])
    for rows in (2, 15, 16, 17, 33, 600):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, alone)


def test_takes_strided_input_and_no_rows() -> None:
    layer = AmxLinear.from_linear(bf16_linear(48, 64, bias=False))
    wide = torch.randn(20, 130).to(torch.bfloat16)
    columns = wide[:, 3:67]  # rows 130 elements apart, not 64-byte aligned
    torch.testing.assert_close(layer(columns), layer(columns.contiguous()), rtol=0, atol=0)
    assert layer(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 48)


def test_applies_where_k_is_a_multiple_of_32_and_shares_the_packed_weight() -> None:
    assert amx_linear_applies(torch.zeros(16, 64, dtype=torch.bfloat16))
    assert not amx_linear_applies(torch.zeros(16, 48, dtype=torch.bfloat16))  # K % 32
    assert not amx_linear_applies(torch.zeros(16, 64))  # float32
    builders = linear_candidates(torch.randn(32, 64).to(torch.bfloat16), None)
    assert builders["amx_c"]().packed_weight is builders["bf16_c"]().packed_weight


def test_an_emulated_machine_without_amx_has_no_amx_candidate(monkeypatch) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert not amx_kernel_available()
    assert "amx_c" not in linear_candidates(torch.randn(32, 64).to(torch.bfloat16), None)


def test_the_decoder_stack_on_amx_linears_is_bit_identical_to_the_layers_on_them(tiny_model_dir) -> None:
    from tests.kernels.cpu.test_cpu_stack import run_step, step_inputs, tiny_bf16_llm

    runner = tiny_bf16_llm(tiny_model_dir).llm_engine.runner
    stack = runner.model.decoder_stack
    assert stack.amx_applies(stack.dims)
    for name, module in list(runner.model.model.layers.named_modules()):
        if isinstance(module, Bf16Linear):
            parent, _, child = name.rpartition(".")
            setattr(
                runner.model.model.layers.get_submodule(parent), child, AmxLinear(module.packed_weight, None)
            )
    stack.linear_by_bucket = ["amx_c"]
    seqs = step_inputs([(0, 0, 3), (4, 0, 17), (8, 0, 40)])
    before = [t.clone() for pair in runner.kv_caches for t in pair]
    expected = run_step(runner, seqs, use_stack=False)
    for t, saved in zip((t for pair in runner.kv_caches for t in pair), before, strict=True):
        t.copy_(saved)
    assert torch.equal(run_step(runner, seqs, use_stack=True), expected)
    assert stack._linear_at(40) == "amx_c"
    stack.linear_by_bucket = ["bf16_c", "amx_c"]  # by row bucket: 1 row, then 2 and more
    assert (stack._linear_at(1), stack._linear_at(2), stack._linear_at(60)) == ("bf16_c", "amx_c", "amx_c")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("intermediate,hidden", [(16, 32), (48, 64), (1536, 576)])
def test_fused_swiglu_is_bit_for_bit_the_linear_then_silu_and_multiply(intermediate, hidden, bias) -> None:
    """Gate strip j pairs with up strip j, I/16 strips further on; every row-block tail, a panel
    boundary, and one thread against all."""
    layer = AmxLinear.from_linear(bf16_linear(2 * intermediate, hidden, bias))
    for rows in [0, *range(1, 18), 31, 32, 33, 513]:
        x = (2 * torch.randn(rows, hidden)).to(torch.bfloat16)  # gates well into SiLU's both tails
        expected = silu_mul_bf16(layer(x)) if rows else torch.empty(0, intermediate, dtype=torch.bfloat16)
        assert torch.equal(layer.swiglu(x).view(torch.int16), expected.view(torch.int16)), rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(layer.swiglu(x), expected)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="bf16"):
        layer.swiglu(x.float())


def test_the_mlp_runs_fused_exactly_where_its_gate_up_projection_runs_the_amx_kernel() -> None:
    mlp = MLP(64, 48, c_ops=True).to(torch.bfloat16)
    x = torch.randn(40, 64).to(torch.bfloat16)
    unfused = mlp(x)  # nn.Linear: torch's SiLU path
    weight = mlp.gate_up_proj.weight
    amx, calls = AmxLinear.from_weight(weight), []
    fused = amx.swiglu
    amx.swiglu = lambda rows: calls.append(rows.shape[0]) or fused(rows)  # counts the fused calls
    # torch up to 16 rows (buckets 1-16), the AMX kernel from 17
    tuned = TunedLinear({"torch": PlainLinear(weight, None), "amx_c": amx}, ["torch"] * 5 + ["amx_c"])
    assert swiglu_for_rows(tuned, 16) is None and swiglu_for_rows(tuned, 17) is not None
    assert swiglu_for_rows(tuned, 5000) is not None and swiglu_for_rows(amx, 1) is not None
    assert swiglu_for_rows(PlainLinear(weight, None), 40) is None
    mlp.gate_up_proj = tuned
    for rows in (16, 40):
        expected = mlp.down_proj(silu_mul_bf16(tuned(x[:rows])))
        assert torch.equal(mlp(x[:rows]), expected), rows
    assert calls == [40]
    # the fused result is the C SiLU's, within one bf16 rounding of torch's chain
    torch.testing.assert_close(mlp(x).float(), unfused.float(), rtol=2e-2, atol=2e-2)


def test_nn_linear_class_is_untouched() -> None:
    # AmxLinear subclasses Bf16Linear only for its packing and forward: both stay nn.Modules.
    assert issubclass(AmxLinear, nn.Module) and AmxLinear.KERNEL != Bf16Linear.KERNEL


def test_the_layers_on_the_stacks_kernels_run_its_swiglu_too() -> None:
    """`tune_decoder_stack` checks the stack against the per-layer path on the stack's own kernels:
    where the table fused gate/up on AMX, the bf16_c check must not run the AMX SwiGLU (its rounding
    differs from bf16_c's, which dropped the bf16_c stack at 1 row)."""
    from types import SimpleNamespace

    from batchgen.model.kernel_choice.stack import _layers_on

    mlp = MLP(64, 48, c_ops=True).to(torch.bfloat16)
    weight = mlp.gate_up_proj.weight.detach()
    packed = Bf16Linear.from_weight(weight, None)
    tuned = TunedLinear({"bf16_c": packed, "amx_c": AmxLinear(packed.packed_weight, None)}, ["amx_c"])
    mlp.gate_up_proj = tuned
    model = SimpleNamespace(model=SimpleNamespace(layers=nn.ModuleList([mlp])))
    x = torch.randn(3, 64).to(torch.bfloat16)
    before = (tuned.swiglu_at(3), tuned(x))
    with _layers_on(model, "bf16_c"):
        assert swiglu_for_rows(tuned, 3) is None
        assert torch.equal(mlp(x), mlp.down_proj(silu_mul_bf16(packed(x))))
    with _layers_on(model, "amx_c"):
        assert swiglu_for_rows(tuned, 3) is not None
    assert tuned.swiglu_at(3) == before[0] and torch.equal(tuned(x), before[1])
