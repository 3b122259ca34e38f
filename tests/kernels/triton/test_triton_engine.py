"""The engine with the triton attention backend gives the torch backend's greedy tokens.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so the
model is tiny and the outputs short.
"""

from __future__ import annotations

import pytest

from batchgen import LLM, SamplingParams

pytest.importorskip("triton", reason="triton is not installed (Linux x86_64 only)")

PROMPTS = [
    "The quick brown fox jumps over the lazy dog because",
    "Hello, my name is",
    "Paged attention stores keys and values in blocks",
]


def test_triton_backend_matches_torch_backend(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    # Small token budget and block size: chunked prefill, decodes and prefills mixed in one step,
    # contexts spanning several blocks.
    options = dict(dtype="float32", block_size=8, max_num_batched_tokens=8)
    torch_out = LLM(path, attention_backend="torch", **options).generate(PROMPTS, params)
    triton_llm = LLM(path, attention_backend="triton", **options)
    assert triton_llm.llm_engine.runner.backend.name == "triton"
    triton_out = triton_llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in triton_out] == [o.outputs[0].token_ids for o in torch_out]


def test_forcing_triton_without_gpu_or_interpreter_is_a_clear_error(monkeypatch):
    import torch

    from batchgen.model.attention import select_backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        select_backend("triton", torch.device("cpu"))


@pytest.mark.parametrize("arch", ["mistral_window", "gemma3"])
def test_triton_backend_matches_hf_with_sliding_windows(tiny_model_dir, arch):
    """Sliding-window layers (every layer of the Mistral, one of Gemma 3's two) on the Triton
    kernels give transformers' greedy tokens; the first prompt and every output pass the window."""
    import transformers

    from tests.engine.test_fidelity import hf_greedy

    path = tiny_model_dir(arch)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
    expected = hf_greedy(path, prompt_ids, 6, ignore_eos=True)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(path), attention_backend="triton", dtype="float32", block_size=8, max_num_batched_tokens=8)
    got = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    assert [o.outputs[0].token_ids for o in got] == expected


def test_triton_backend_refuses_gemma2s_attention_softcap(tiny_model_dir):
    with pytest.raises(ValueError, match="no attention logit soft-capping.*attention_backend='torch'"):
        LLM(str(tiny_model_dir("gemma2")), attention_backend="triton", dtype="float32")


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_on_triton_kernels_matches_hf(tiny_model_dir, arch, monkeypatch):
    """A mixture of experts with Triton attention and the Triton grouped GEMM for its experts (as on
    CUDA) gives Hugging Face `generate`'s greedy tokens."""
    import transformers

    from batchgen.model import moe
    from tests.engine.test_fidelity import hf_greedy

    path = tiny_model_dir(arch)
    used = []

    def triton_experts(*args):
        used.append(True)
        return moe.experts_triton(*args)

    monkeypatch.setattr(moe, "default_experts_matmul", lambda device_type: triton_experts)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
    expected = hf_greedy(path, prompt_ids, 6, ignore_eos=True)
    # kernels="reference": no CPU kernel is measured against the experts' path (the one-call C
    # kernel could win that measurement and leave the Triton grouped GEMM unused).
    llm = LLM(str(path), attention_backend="triton", dtype="float32", block_size=8, max_num_batched_tokens=8,
              kernels="reference")  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    assert [o.outputs[0].token_ids for o in got] == expected
    assert used, "the experts were meant to run on the Triton kernel"


# The Triton interpreter runs a few of the fidelity suite's stress modes on gpt-oss (sinks in both
# kernels, alternating windows): chunked prefill with mixed steps, preemption, a warm prefix cache.
GPT_OSS_MODES = {
    "chunked_prefill": dict(block_size=8, max_num_batched_tokens=8),
    "preempt_recompute": dict(block_size=4, preemption_mode="recompute"),
    "preempt_swap": dict(block_size=4, preemption_mode="swap"),
    "warm_prefix_cache": dict(block_size=4, enable_prefix_caching=True),
}


@pytest.mark.parametrize("mode", list(GPT_OSS_MODES))
def test_gpt_oss_on_triton_kernels_matches_hf(tiny_model_dir, mode):
    """gpt-oss on the Triton attention kernels gives Hugging Face `generate`'s greedy tokens."""
    import transformers

    from tests.engine.test_fidelity import hf_greedy
    from tests.engine.test_fidelity_moe import _block_bytes

    path = tiny_model_dir("gpt_oss")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
    expected = hf_greedy(path, prompt_ids, 6, ignore_eos=True)
    options = dict(GPT_OSS_MODES[mode])
    if mode.startswith("preempt"):  # 6 blocks of 4 tokens: the three rows need 11 at their ends
        options["kv_cache_memory"] = 6 * _block_bytes(path, 4)
    llm = LLM(str(path), attention_backend="triton", dtype="float32", **options)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    requests = [{"prompt_token_ids": ids} for ids in prompt_ids]
    got = [o.outputs[0].token_ids for o in llm.generate(requests, params)]
    assert got == expected
    totals = llm.llm_engine.totals
    if mode.startswith("preempt"):
        assert totals.preemptions > 0, "the cache was meant to force preemption"
    if mode == "warm_prefix_cache":
        hits = totals.prefix_cache_hits
        assert [o.outputs[0].token_ids for o in llm.generate(requests[::-1], params)] == expected[::-1]
        assert llm.llm_engine.totals.prefix_cache_hits > hits
