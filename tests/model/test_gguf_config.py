"""What a GGUF file's metadata adds to transformers' reading of it (`batchgen/model/loading/gguf_config.py`):
the architecture check and each rule, on metadata alone (the files themselves: test_gguf_cache.py)."""

from __future__ import annotations

import numpy as np
import pytest

from batchgen.model.loading.architectures import UnsupportedModelError
from batchgen.model.loading.gguf_config import gguf_architecture, gguf_config_fixes


def _gemma(arch: str, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    return {
        "general.architecture": arch,
        f"{arch}.block_count": layers,
        f"{arch}.embedding_length": hidden,
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.key_length": head_dim,
    }


@pytest.mark.parametrize(
    ("arch", "layers", "hidden", "heads", "head_dim", "scalar"),
    [
        ("gemma2", 26, 2304, 8, 256, 256),  # Gemma 2 2B: head_dim
        ("gemma2", 46, 4608, 32, 128, 144),  # Gemma 2 27B: hidden / heads
        ("gemma3", 26, 1152, 4, 256, 256),  # Gemma 3 1B: head_dim (hidden / heads would be 288)
        ("gemma3", 62, 5376, 32, 128, 168),  # Gemma 3 27B: hidden / heads
    ],
)
def test_gemmas_attention_scale_follows_llama_cpps_rule(arch, layers, hidden, heads, head_dim, scalar):
    """A GGUF file has no query_pre_attn_scalar; llama.cpp scales by head_dim but for the 27B models
    (by their layer count), as the Hugging Face configs of those models say."""
    fixes = gguf_config_fixes(_gemma(arch, layers, hidden, heads, head_dim), {}, {})
    assert fixes["query_pre_attn_scalar"] == scalar


def test_gemma3s_linear_scaling_and_local_base_are_read():
    fields = _gemma("gemma3", 34, 2560, 8, 256) | {
        "gemma3.rope.scaling.type": "linear",
        "gemma3.rope.scaling.factor": np.float32(8.0),
        "gemma3.rope.freq_base_swa": np.float32(10000.0),
        "gemma3.final_logit_softcapping": np.float32(30.0),
    }
    rope = {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default"},
    }
    fixes = gguf_config_fixes(fields, {}, {"rope_parameters": rope})
    assert fixes["rope_parameters"] == {
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    assert fixes["final_logit_softcapping"] == 30.0


def test_phi3_fields_and_float32_values():
    """Phi-3: rotary dimensions a head -> partial_rotary_factor, a window of 0 -> none, LongRoPE
    from the factor tensors; float32 metadata reads as the decimal it was written from."""
    fields = {
        "general.architecture": "phi3",
        "phi3.embedding_length": 3072,
        "phi3.attention.head_count": 24,
        "phi3.rope.dimension_count": 96,
        "phi3.attention.sliding_window": 0,
        "phi3.rope.scaling.original_context_length": 4096,
        "phi3.attention.layer_norm_rms_epsilon": np.float32(1e-5),
    }
    factors = {
        "rope_factors_long.weight": np.float32([1.0, 2.5]),
        "rope_factors_short.weight": np.float32([1.0, 1.1]),
    }
    fixes = gguf_config_fixes(
        fields, factors, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    )
    assert fixes["sliding_window"] is None and fixes["rms_norm_eps"] == 1e-5
    assert fixes["original_max_position_embeddings"] == 4096
    assert fixes["rope_parameters"] == {
        "rope_type": "longrope",
        "rope_theta": 1e4,
        "partial_rotary_factor": 0.75,
        "long_factor": [1.0, 2.5],
        "short_factor": [1.0, 1.1],
        "original_max_position_embeddings": 4096,
    }
    fields["phi3.attention.sliding_window"] = 2047
    assert gguf_config_fixes(fields, {}, {})["sliding_window"] == 2047


def test_architectures_outside_the_supported_set_are_refused_in_one_line():
    assert gguf_architecture({"general.architecture": "llama", "llama.expert_count": 0}, "m.gguf") == "llama"
    assert (
        gguf_architecture({"general.architecture": "qwen3moe", "qwen3moe.expert_count": 128}, "m.gguf")
        == "qwen3moe"
    )
    for fields, message in [
        ({"general.architecture": "smollm3"}, "m.gguf: GGUF architecture 'smollm3' is not supported"),
        ({"general.architecture": "qwen2moe"}, "GGUF architecture 'qwen2moe' is not supported"),
        ({"general.architecture": "llama", "llama.expert_count": 8}, "8 experts \\(Mixtral\\)"),
    ]:
        with pytest.raises(UnsupportedModelError, match=message) as error:
            gguf_architecture(fields, "m.gguf")
        assert "\n" not in str(error.value)
