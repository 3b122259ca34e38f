"""What a bench needs to know about the model before any run: tokenizer, config, dtype, limits.

`model_facts` builds one engine with the bench's options and reads back what the engine resolved
(the maximum length, the KV-cache capacity, the token budget, the dtype), so every configuration
and the workload agree with the engine; `bench_workload` draws the workload's token ids from the
model's vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from batchgen.bench.baselines.hf import resolve_hf_dir
from batchgen.bench.report.metrics import release_memory
from batchgen.bench.spec import WorkloadSpec
from batchgen.bench.workload.distributions import Workload, build_workload
from batchgen.config import EngineConfig, resolve_device
from batchgen.engine.protocol import BenchEngine

EngineFactory = Callable[[EngineConfig], BenchEngine]


def _torch_dtype(requested: str, model_config: Any, device: str) -> torch.dtype:
    """The dtype batchgen would run `requested` in (the engine's rule), for a bench without an engine."""
    from batchgen.engine.sizing import resolve_dtype

    return resolve_dtype(requested, model_config, torch.device(device))


def special_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokenizer's special and added tokens (kept out of random bench prompts)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids |= set((getattr(tokenizer, "added_tokens_decoder", None) or {}).keys())
    return ids


def pad_id(tokenizer: Any) -> int:
    """The id static batches pad with: the tokenizer's pad token, else its (first) EOS, else 0."""
    for value in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            return value
        if isinstance(value, list) and value:
            return int(value[0])
    return 0


@dataclass
class ModelFacts:
    """What the bench needs to know about the model and the engine before running anything."""

    tokenizer: Any
    model_config: Any
    max_model_len: int
    hf_dir: Any
    dtype: torch.dtype
    device: str
    kv_cache_tokens: int | None
    max_num_batched_tokens: int


def model_facts(options: EngineConfig, factory: EngineFactory, probe: EngineConfig | None) -> ModelFacts:
    """Build one engine from `probe` (for `max_model_len`, the KV capacity, the token budget and the
    dtype as the engine resolves them) and drop it; with no probe (a bench of Hugging Face baselines
    only), read the model's Hugging Face directory instead. `options` are the bench's engine options."""
    device = resolve_device(options.device)
    if probe is None:
        from transformers import AutoConfig, AutoTokenizer

        hf_dir = resolve_hf_dir(options.model)
        config = AutoConfig.from_pretrained(hf_dir)
        return ModelFacts(
            tokenizer=AutoTokenizer.from_pretrained(hf_dir),
            model_config=config,
            max_model_len=options.max_model_len or int(config.max_position_embeddings),
            hf_dir=hf_dir,
            dtype=_torch_dtype(options.dtype, config, device),
            device=device,
            kv_cache_tokens=None,
            max_num_batched_tokens=options.max_num_batched_tokens or 2048,
        )
    engine = factory(probe)
    try:
        return ModelFacts(
            tokenizer=engine.tokenizer,
            model_config=engine.model_config,
            max_model_len=engine.max_model_len,
            hf_dir=engine.model_files.path,
            dtype=engine.dtype,
            device=device,
            kv_cache_tokens=engine.num_gpu_blocks * engine.block_size,
            max_num_batched_tokens=engine.max_num_batched_tokens,
        )
    finally:
        del engine
        release_memory()


def bench_workload(spec: WorkloadSpec, tokenizer: Any, model_config: Any, max_model_len: int) -> Workload:
    """The workload of `spec` for this model: token ids drawn from its vocabulary minus special tokens.

    A job file's text prompts are encoded as `batchgen run` encodes them: wrapped as a user message
    in the chat template when the tokenizer has one, so the bench prefills what the job would."""
    from batchgen.engine.tokenize import encode_prompt

    chat = bool(getattr(tokenizer, "chat_template", None))

    def encode(prompt: Any) -> list[int]:
        if chat and isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        return list(encode_prompt(tokenizer, prompt)[1])

    return build_workload(
        spec,
        vocab_size=min(len(tokenizer), int(model_config.vocab_size)),
        special_token_ids=sorted(special_ids(tokenizer)),
        max_model_len=max_model_len,
        encode=encode,
    )
