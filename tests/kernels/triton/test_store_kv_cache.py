"""store_kv_cache against the torch reference: exact copies, -1 slots skipped, other slots untouched."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed: the kernel tests need it (Linux x86-64)")

from batchgen.kernels.triton import store_kv_cache  # noqa: E402
from batchgen.model.attention import store_kv_cache_torch  # noqa: E402


@pytest.mark.parametrize(
    "dtype, head_dim, block_size, num_kv_heads",
    [
        (torch.float16, 64, 16, 2),
        (torch.bfloat16, 128, 8, 1),
        (torch.float32, 80, 32, 3),  # padded head_dim, non-power-of-two head count
        (torch.float16, 96, 16, 4),
        (torch.bfloat16, 256, 16, 2),
    ],
)
def test_matches_reference_and_skips_padding(dtype, head_dim, block_size, num_kv_heads, device, helpers, gen):
    num_blocks, num_tokens = 6, 13
    k_cache, v_cache = helpers.make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, gen)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7, 12]] = -1  # padding tokens, one of them the last
    slots = slots.to(device)

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_cache_torch(key, value, k_ref, v_ref, slots)
    k_before = k_cache.clone()
    store_kv_cache(key, value, k_cache, v_cache, slots)

    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)
    # The reference itself must have written the valid rows and nothing else.
    flat = k_cache.view(-1, num_kv_heads, head_dim)
    valid = slots >= 0
    assert torch.equal(flat[slots[valid]], key[valid])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=device)
    untouched[slots[valid]] = False
    assert torch.equal(flat[untouched], k_before.view(-1, num_kv_heads, head_dim)[untouched])


def test_views_of_fused_qkv_and_strided_cache(device, helpers, gen):
    """key/value as column slices of a fused QKV output; caches as views into a wider allocation."""
    num_tokens, num_q_heads, num_kv_heads, head_dim, block_size = 9, 4, 2, 64, 16
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=gen).half().to(device)
    key = qkv[:, num_q_heads : num_q_heads + num_kv_heads]
    value = qkv[:, num_q_heads + num_kv_heads :]
    assert not key.is_contiguous()
    # A cache whose head stride is not head_dim: every other head of a [.., 2 * Hkv, D] allocation.
    base_k, base_v = helpers.make_cache(4, block_size, 2 * num_kv_heads, head_dim, torch.float16, device, gen)
    k_cache, v_cache = base_k[:, :, ::2], base_v[:, :, ::2]
    slots = torch.randperm(4 * block_size, generator=gen)[:num_tokens].to(device)

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_cache_torch(key, value, k_ref, v_ref, slots)
    odd_before = base_k[:, :, 1::2].clone()
    store_kv_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)
    assert torch.equal(base_k[:, :, 1::2], odd_before)


def test_all_padding_and_empty_are_noops(device, helpers, gen):
    k_cache, v_cache = helpers.make_cache(2, 8, 1, 64, torch.float16, device, gen)
    before = k_cache.clone(), v_cache.clone()
    key = torch.randn(3, 1, 64, generator=gen).half().to(device)
    store_kv_cache(key, key, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int64, device=device))
    empty = key[:0]
    store_kv_cache(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=device))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_input_checks(device, helpers, gen):
    k_cache, v_cache = helpers.make_cache(2, 8, 2, 64, torch.float16, device, gen)
    key = torch.randn(3, 2, 64, generator=gen).half().to(device)
    slots = torch.arange(3, device=device)
    with pytest.raises(TypeError, match="slot_mapping"):
        store_kv_cache(key, key, k_cache, v_cache, slots.int())
    with pytest.raises(TypeError, match="key dtype"):
        store_kv_cache(key.float(), key, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="num_kv_heads"):
        store_kv_cache(key[:, :1], key[:, :1], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="entries"):
        store_kv_cache(key, key, k_cache, v_cache, slots[:2])
    with pytest.raises(ValueError, match="stride 1"):
        store_kv_cache(key.transpose(1, 2).contiguous().transpose(1, 2), key, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="differ in shape"):
        store_kv_cache(key, key, k_cache, v_cache[:1], slots)
    with pytest.raises(TypeError, match="torch.Tensor"):
        store_kv_cache(key, key, k_cache, v_cache, [0, 1, 2])
