"""Packed linears compute what `F.linear` computes, and the engine uses them: oneDNN-prepacked
(float32, and bf16 where the CPU has it) and batchgen's bf16 kernel (CPUs with AVX512-BF16;
its own tests are in test_bf16_linear.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchgen import LLM, SamplingParams
from batchgen.kernels.cpu.linear import (
    Bf16Linear,
    PlainLinear,
    PrepackedLinear,
    TunedLinear,
    bf16_kernel_available,
    can_prepack,
    prepack_linears,
)

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN (mkldnn)"
)
NO_NATIVE_BF16 = pytest.mark.skipif(
    not can_prepack(torch.bfloat16, torch.device("cpu")),
    reason="this CPU's oneDNN has no bf16 support, so batchgen keeps F.linear in bf16",
)
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=NO_NATIVE_BF16)]
# float32: MKL and oneDNN sum in different orders (about 1e-6 relative); bf16: one rounding apart.
TOLERANCES = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2}}


# Run in a fresh process, where ONEDNN_MAX_CPU_ISA takes effect: which linears an engine with
# `--kernels native` packed, and (float32) its greedy tokens against the plain-torch engine's.
_PACKING_PROBE = """
import json, sys
import torch
from torch import nn
from batchgen import LLM, SamplingParams

params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 11)]
result = {"native_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())}
for dtype, kinds in (("float32", ("native", "reference")), ("bfloat16", ("native",))):
    tokens = {}
    for kernels in kinds:
        llm = LLM(sys.argv[1], dtype=dtype, device="cpu", kernels=kernels, max_num_seqs=2)
        if kernels == "native":
            modules = llm.llm_engine.runner.model.modules()
            result[dtype + "_plain_linears"] = sum(isinstance(m, nn.Linear) for m in modules)
        tokens[kernels] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    result[dtype + "_same_tokens"] = tokens["native"] == tokens.get("reference", tokens["native"])
print(json.dumps(result))
"""


def test_engines_pack_float32_on_any_cpu_and_bf16_only_where_native(tiny_model_dir) -> None:
    """What the packing rule does, seen from an engine on a CPU without AVX-512 (emulated with
    ONEDNN_MAX_CPU_ISA=AVX2, so without native bf16): with `--kernels native` every float32 linear
    is still packed (oneDNN runs float32 on any x86 CPU) and gives the plain-torch engine's greedy
    tokens, while every bf16 linear stays `F.linear` (emulated bf16 matmuls run about 8x slower than
    float32). On a CPU with native bf16 they are packed (`test_engine_kernels_match_the_reference_engine`).
    float16 and CUDA weights are never packed."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DNNL_MAX_CPU_ISA"}
    env["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    proc = subprocess.run(
        [sys.executable, "-c", _PACKING_PROBE, str(tiny_model_dir("llama"))],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not got["native_bf16"]
    assert got["float32_plain_linears"] == 0 and got["float32_same_tokens"]
    assert got["bfloat16_plain_linears"] == 2 * 4 + 1  # 2 layers x (qkv, o, gate_up, down) + LM head
    assert not can_prepack(torch.float16, torch.device("cpu"))
    assert not can_prepack(torch.float32, torch.device("cuda"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_prepacked_linear_matches_f_linear(bias: bool, rows: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    packed = PrepackedLinear.from_linear(linear)
    with torch.inference_mode():
        expected = F.linear(x, linear.weight, linear.bias)
        got = packed(x)
    assert got.shape == (rows, 160) and got.dtype == dtype
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_prepack_replaces_every_linear_and_keeps_the_tied_embedding(dtype: torch.dtype) -> None:
    model = nn.Module()
    model.embed = nn.Embedding(50, 16)
    model.block = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16, bias=False))
    model.head = nn.Linear(16, 50, bias=False)
    model.head.weight = model.embed.weight  # tied, as in SmolLM2 and Qwen2.5
    model = model.to(dtype)
    assert prepack_linears(model) == 3
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    # out_features 32, 16 and 50: batchgen's bf16 kernel takes multiples of 16, oneDNN the head.
    own = dtype == torch.bfloat16 and bf16_kernel_available()
    assert [type(m) for m in (*model.block, model.head)] == [
        *([Bf16Linear] * 2 if own else [PrepackedLinear] * 2),
        PrepackedLinear,
    ]
    assert isinstance(model.embed.weight, nn.Parameter)  # lookups still use the plain weight
    with torch.inference_mode():
        x = model.embed(torch.tensor([1, 2, 3]))
        assert model.head(model.block(x)).shape == (3, 50)


@pytest.mark.parametrize("kernels", ["native", "auto"])
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=NO_NATIVE_BF16)])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_kernels_match_the_reference_engine(
    tiny_model_dir, arch: str, dtype: str, kernels: str
) -> None:
    """Greedy tokens are identical with batchgen's kernels (native: packed by rule; auto: measured)
    and with plain torch (qwen2: tied head and biases)."""
    path = str(tiny_model_dir(arch))
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    llm = LLM(path, dtype=dtype, max_num_seqs=4, device="cpu", kernels=kernels)
    modules = list(llm.llm_engine.runner.model.modules())
    kinds = (PrepackedLinear, Bf16Linear, PlainLinear, TunedLinear)
    inside_tuned = {id(impl) for m in modules if isinstance(m, TunedLinear) for impl in m.impls.values()}
    replaced = [m for m in modules if isinstance(m, kinds) and id(m) not in inside_tuned]
    assert len(replaced) == 2 * 4 + 1  # 2 layers x (qkv, o, gate_up, down) + LM head
    assert not any(isinstance(m, nn.Linear) for m in modules)
    if kernels == "native":  # bf16 with batchgen's kernel: every layer of the tiny model has shapes it takes
        own_kernel = dtype == "bfloat16" and bf16_kernel_available()
        assert all(isinstance(m, Bf16Linear) == own_kernel for m in replaced)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    plain = LLM(path, dtype=dtype, max_num_seqs=4, device="cpu", kernels="reference")
    plain_modules = list(plain.llm_engine.runner.model.modules())
    assert sum(isinstance(m, nn.Linear) for m in plain_modules) == 2 * 4 + 1
    assert plain.llm_engine.runner.backend.name == "torch"
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert got == expected
    assert all(len(t) == 12 for t in got)


def test_prepack_of_a_model_without_linears_changes_nothing() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4))
    assert prepack_linears(model) == 0
    assert isinstance(model[0], nn.Embedding) and isinstance(model[1], nn.LayerNorm)
