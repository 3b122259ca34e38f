"""gpt-oss's parts against transformers' own modules (`modeling_gpt_oss`): the clamped SwiGLU, the
router and experts, and an MXFP4 checkpoint that loads (dequantized) and gives transformers' greedy
tokens of the same weights stored as floats."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from batchgen import LLM, SamplingParams
from batchgen.model.gpt_oss import GptOssMoeBlock, clamped_swiglu
from batchgen.model.loading.architectures import (
    UnsupportedModelError,
    check_architecture,
    check_not_quantized,
)
from batchgen.model.mxfp4 import dequantize
from tests.conftest import _tiny_gpt_oss_config
from tests.engine.test_fidelity import TEXT_PROMPTS, hf_greedy


@pytest.fixture(scope="module")
def hf_layer():
    """Layer 0's MLP of a tiny transformers gpt-oss (its default "grouped_mm" experts), with biases."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_tiny_gpt_oss_config(), dtype=torch.float32)
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        mlp.router.weight.mul_(50.0)
        for param in (mlp.experts.gate_up_proj_bias, mlp.experts.down_proj_bias):
            param.normal_(0.0, 0.1)
    return model.config, mlp.eval()


def test_clamped_swiglu_is_transformers_gate(hf_layer):
    _, mlp = hf_layer
    gate_up = torch.randn(50, 64, generator=torch.Generator().manual_seed(0)) * 6  # past the limit 7
    expected = mlp.experts._apply_gate(gate_up)
    got = clamped_swiglu(gate_up, 1.702, 7.0)
    assert torch.equal(got, expected)
    assert (gate_up[:, ::2] > 7).any() and (gate_up[:, 1::2].abs() > 7).any()


def test_moe_block_is_transformers_mlp_to_the_bit(hf_layer):
    """Router (top-k of the logits, then their softmax) and experts (grouped matmul, biases, the
    routing weights, the sum over slots) give transformers' float32 output exactly, on a batch where
    some expert gets no token."""
    config, mlp = hf_layer
    block = GptOssMoeBlock(config)
    block.load_state_dict(mlp.state_dict())
    x = torch.randn(23, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected, _ = mlp(x[None])
        got = block(x)
        chosen = torch.topk(block.router(x), config.num_experts_per_tok).indices
    assert torch.equal(got, expected[0])
    counts = torch.bincount(chosen.flatten(), minlength=config.num_local_experts)
    assert counts.max() > counts.min()


def _mxfp4_experts(weights: dict[str, torch.Tensor], seed: int) -> tuple[dict, dict]:
    """Random MXFP4 expert weights for every layer of a gpt-oss state dict: (the checkpoint's
    `_blocks` / `_scales` tensors, the same weights dequantized under transformers' names)."""
    gen = torch.Generator().manual_seed(seed)
    packed, floats = {}, {}
    for name, tensor in weights.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        experts, inputs, outputs = tensor.shape
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), dtype=torch.uint8, generator=gen)
        scales = torch.randint(118, 122, (experts, outputs, inputs // 32), dtype=torch.uint8, generator=gen)
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        floats[name] = dequantize(blocks, scales).transpose(-2, -1).contiguous()
    return packed, floats


def test_an_mxfp4_checkpoint_loads_dequantized(tiny_model_dir, tmp_path):
    source = tiny_model_dir("gpt_oss")
    weights = load_file(source / "model.safetensors")
    packed, floats = _mxfp4_experts(weights, seed=0)
    as_floats, as_mxfp4 = tmp_path / "float", tmp_path / "mxfp4"
    shutil.copytree(source, as_floats)
    shutil.copytree(source, as_mxfp4)
    save_file(weights | floats, as_floats / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k not in floats} | packed, as_mxfp4 / "model.safetensors")
    config = json.loads((as_mxfp4 / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    (as_mxfp4 / "config.json").write_text(json.dumps(config))

    tok = transformers.AutoTokenizer.from_pretrained(source)
    prompt_ids = [tok(p)["input_ids"] for p in TEXT_PROMPTS[:4]]
    expected = hf_greedy(as_floats, prompt_ids, 12, ignore_eos=True)
    llm = LLM(str(as_mxfp4), dtype="float32", device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    assert [o.outputs[0].token_ids for o in got] == expected
    # The experts changed: the original model's tokens differ.
    assert hf_greedy(source, prompt_ids, 12, ignore_eos=True) != expected


def test_other_quantized_checkpoints_are_still_refused():
    check_not_quantized({"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}, "m")
    with pytest.raises(UnsupportedModelError, match=r"quantized \(mxfp4\)"):
        check_not_quantized({"model_type": "llama", "quantization_config": {"quant_method": "mxfp4"}}, "m")
    with pytest.raises(UnsupportedModelError, match=r"quantized \(gptq\)"):
        check_not_quantized({"model_type": "gpt_oss", "quantization_config": {"quant_method": "gptq"}}, "m")


def test_the_architecture_table_lists_gpt_oss():
    assert (
        check_architecture({"architectures": ["GptOssForCausalLM"], "hidden_act": "silu"})
        == "GptOssForCausalLM"
    )
    assert check_architecture({"model_type": "gpt_oss"}) == "GptOssForCausalLM"
    with pytest.raises(UnsupportedModelError, match="supported: .*MixtralForCausalLM, GptOssForCausalLM"):
        check_architecture({"architectures": ["DeepseekV3ForCausalLM"]})
