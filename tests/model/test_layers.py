"""RMSNorm's 16-bit fast path stays within bf16 rounding of Hugging Face's float32 arithmetic."""

from __future__ import annotations

import pytest
import torch

from batchgen.model.layers import RMSNorm


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: widen to float32, normalise, round, multiply by the weight."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@pytest.mark.parametrize("rows", [1, RMSNorm.FEW_PASSES_MIN_ROWS - 1, RMSNorm.FEW_PASSES_MIN_ROWS, 2048])
def test_bf16_rms_norm_matches_reference(rows: int) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576) * 0.3 + 1.0
    norm = norm.to(torch.bfloat16)
    x = (torch.randn(rows, 576) * 3).to(torch.bfloat16)
    with torch.inference_mode():
        got = norm(x)
    expected = hf_rms_norm(x, norm.weight, 1e-5)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    # Each bf16 rounding errs by at most 2^-8 relative. The reference rounds twice and the fast path
    # three times (the scale too), so the two are at most five such errors apart.
    torch.testing.assert_close(got.float(), expected.float(), rtol=5 * 2**-8, atol=1e-3)


def test_float32_rms_norm_is_exactly_the_reference() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64)
    x = torch.randn(300, 64)
    with torch.inference_mode():
        assert torch.equal(norm(x), hf_rms_norm(x, norm.weight, 1e-6))


@pytest.mark.parametrize("prefix, chunk", [(5, 3), (100, 256), (37, 600), (700, 513)])
def test_prefix_chunk_attention_matches_one_masked_call(prefix: int, chunk: int) -> None:
    """The query tiles of a chunk after a cached prefix give the single masked SDPA call's output."""
    import torch.nn.functional as F

    from batchgen.model.attention.sdpa import causal_attention

    torch.manual_seed(0)
    total = prefix + chunk
    q = torch.randn(chunk, 6, 32)
    k, v = torch.randn(total, 2, 32), torch.randn(total, 2, 32)
    visible = torch.arange(total)[None, :] <= torch.arange(chunk)[:, None] + prefix
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=visible,
        scale=0.2,
        enable_gqa=True,
    )[0].transpose(0, 1)
    torch.testing.assert_close(causal_attention(q, k, v, 0.2), expected, rtol=1e-5, atol=1e-5)


def test_layer_windows_and_rotary_follow_transformers_configs() -> None:
    """Which layers slide and which rotate, read as transformers reads each config."""
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, Qwen2Config, SmolLM3Config

    from batchgen.model.layers import layer_rotary, layer_windows

    assert layer_windows(MistralConfig(num_hidden_layers=3, sliding_window=64)) == [64, 64, 64]
    assert layer_windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) == [None, None]
    # Qwen2 slides only with use_sliding_window, from max_window_layers on.
    assert layer_windows(Qwen2Config(num_hidden_layers=3, sliding_window=32)) == [None] * 3
    qwen = Qwen2Config(num_hidden_layers=3, sliding_window=32, use_sliding_window=True, max_window_layers=1)
    assert layer_windows(qwen) == [None, 32, 32]
    assert layer_windows(Gemma2Config(num_hidden_layers=4, sliding_window=16)) == [16, None, 16, None]
    assert layer_windows(Gemma3TextConfig(num_hidden_layers=7, sliding_window=8)) == [8] * 5 + [None, 8]
    smol = SmolLM3Config(num_hidden_layers=4, sliding_window=8, use_sliding_window=False)
    assert layer_windows(smol) == [None] * 4
    assert layer_rotary(smol) == [True, True, True, False]
    assert layer_rotary(MistralConfig(num_hidden_layers=2)) == [True, True]
