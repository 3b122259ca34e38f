"""The measured choice of a mixture of experts' kernels (batchgen/model/kernel_choice/experts.py): per
row bucket the faster correct one of batchgen's one-call kernel and the per-expert path, on every
layer, and the layer's output stays the per-expert path's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchgen.kernels.cpu import library as cpu_kernels
from batchgen.kernels.registry import TuningTable, entry_key
from batchgen.model import moe
from batchgen.model.kernel_choice import experts as experts_choice

if cpu_kernels.load_library() is None:
    pytest.skip("the C kernels are not built here", allow_module_level=True)

HIDDEN, WIDTH, EXPERTS, TOP_K = 64, 48, 8, 2


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    spec = moe.MoeSpec(EXPERTS, TOP_K, WIDTH, True, False)
    model = nn.ModuleList([moe.SparseMoeBlock(HIDDEN, spec), moe.SparseMoeBlock(HIDDEN, spec)]).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def _table(tmp_path) -> TuningTable:
    return TuningTable(key={"test": "experts"}, path=tmp_path / "table.json")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_bucket_runs_its_faster_kernel_and_the_output_stays_the_per_expert_paths(tmp_path, dtype):
    model = _model(dtype)
    x = torch.randn(37, HIDDEN).to(dtype)
    with torch.no_grad():
        expected = [block(x) for block in model]  # the default torch path on the plain stack
    table = _table(tmp_path)
    chosen = experts_choice.choose_experts(model, table, max_rows=64)
    entries = {k: v for k, v in table.entries.items() if k.startswith("moe_experts|")}
    assert len(entries) == 7  # buckets 1 .. 64
    for rows, fused in zip((1, 2, 4, 8, 16, 32, 64), model[0].experts.fused_by_bucket, strict=True):
        entry = next(v for k, v in entries.items() if k.endswith(f"|{rows}"))
        timed = {name: ms for name, ms in entry["ms"].items() if ms is not None}
        assert entry["chosen"] == min(timed, key=timed.__getitem__) and fused == (
            entry["chosen"] == "fused_c"
        )
    assert model[1].experts.fused_by_bucket == model[0].experts.fused_by_bucket
    assert chosen == [
        entry["chosen"] for _, entry in sorted(entries.items(), key=lambda kv: int(kv[0].split("|")[-1]))
    ]
    rtol = 1e-5 if dtype == torch.float32 else 1e-2
    with torch.no_grad():
        for block, before in zip(model, expected, strict=True):
            error = (block(x).float() - before.float()).abs().max().item()
            assert error <= rtol * before.float().abs().max().item()


def test_a_slow_fused_kernel_is_not_chosen_and_a_wrong_one_is_dropped(tmp_path, monkeypatch):
    """The choice follows the timings (the one-call kernel timed 1000x slower here, whatever the
    machine's load) and drops a kernel whose output differs."""
    from batchgen.kernels import registry

    real = experts_choice.fused_experts
    monkeypatch.setattr(
        registry, "fastest_seconds", lambda ready, **_: {n: 1.0 if n == "fused_c" else 1e-3 for n in ready}
    )
    model = _model(torch.float32)
    table = _table(tmp_path)
    assert experts_choice.choose_experts(model, table, max_rows=4) == ["torch"] * 3
    assert model[0].experts.fused_by_bucket == [False, False, False]

    monkeypatch.setattr(experts_choice, "fused_experts", lambda *args: torch.zeros_like(real(*args)))
    model = _model(torch.float32)
    table = _table(tmp_path)
    experts_choice.choose_experts(model, table, max_rows=2)
    assert model[0].experts.fused_by_bucket == [False, False]
    entry = table.entries[entry_key("moe_experts", f"{EXPERTS}x{HIDDEN}x{WIDTH}x{TOP_K}:float32", 1)]
    assert "differs" in entry["dropped"]["fused_c"]


def test_native_runs_the_fused_kernel_at_every_bucket_and_a_dense_model_has_nothing_to_choose(tmp_path):
    model = _model(torch.float32)
    assert experts_choice.choose_experts(model, None, max_rows=16) == ["fused_c"] * 5
    assert model[0].experts.fused_by_bucket == [True] * 5
    assert experts_choice.choose_experts(nn.Linear(4, 4), _table(tmp_path), max_rows=16) == []


def test_a_step_past_the_last_bucket_uses_the_last_buckets_kernel(monkeypatch):
    model = _model(torch.float32)
    calls = []
    monkeypatch.setattr(moe, "fused_experts", lambda *args: calls.append(args[0].shape[0]) or args[0])
    model[0].experts.fused_by_bucket = [False, False, True]  # buckets 1, 2, 4
    with torch.no_grad():
        for rows in (1, 2, 3, 4, 9):
            model[0](torch.randn(rows, HIDDEN))
    assert calls == [3, 4, 9]
