"""oneDNN-prepacked linears (bf16 on CPU) compute what `F.linear` computes, and the engine uses them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchgen import LLM, SamplingParams
from batchgen.model import runner as runner_module
from batchgen.model.cpu_linear import PrepackedLinear, can_prepack, prepack_linears

pytestmark = pytest.mark.skipif(
    not can_prepack(torch.bfloat16, torch.device("cpu")),
    reason="this CPU's oneDNN has no bf16 support, so batchgen keeps F.linear",
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_prepacked_linear_matches_f_linear(bias: bool, rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    packed = PrepackedLinear.from_linear(linear)
    with torch.inference_mode():
        expected = F.linear(x, linear.weight, linear.bias)
        got = packed(x)
    assert got.shape == (rows, 160) and got.dtype == torch.bfloat16
    # Same oneDNN kernel with the reorder done once: at most one bf16 rounding apart.
    torch.testing.assert_close(got, expected, rtol=1.6e-2, atol=1e-2)


def test_prepack_replaces_every_linear_and_keeps_the_tied_embedding() -> None:
    model = nn.Module()
    model.embed = nn.Embedding(50, 16)
    model.block = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16, bias=False))
    model.head = nn.Linear(16, 50, bias=False)
    model.head.weight = model.embed.weight  # tied, as in SmolLM2 and Qwen2.5
    model = model.to(torch.bfloat16)
    assert prepack_linears(model) == 3
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.embed.weight, nn.Parameter)  # lookups still use the plain weight
    with torch.inference_mode():
        x = model.embed(torch.tensor([1, 2, 3]))
        assert model.head(model.block(x)).shape == (3, 50)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_engine_prepacks_and_matches_the_unpacked_engine(tiny_model_dir, monkeypatch, arch: str) -> None:
    """Greedy bf16 tokens are identical with and without prepacking (qwen2: tied head and biases)."""
    path = str(tiny_model_dir(arch))
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    llm = LLM(path, dtype="bfloat16", max_num_seqs=4, device="cpu")
    packed = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, PrepackedLinear)]
    assert len(packed) == 2 * 4 + 1  # 2 layers x (qkv, o, gate_up, down) + LM head
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    monkeypatch.setattr(runner_module, "can_prepack", lambda dtype, device: False)
    plain = LLM(path, dtype="bfloat16", max_num_seqs=4, device="cpu")
    assert not any(isinstance(m, PrepackedLinear) for m in plain.llm_engine.runner.model.modules())
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert got == expected
    assert all(len(t) == 12 for t in got)
