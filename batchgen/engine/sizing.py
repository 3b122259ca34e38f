"""How big things are: the compute dtype, the model's usable length and the KV cache's block count.

The engine's sizing decisions, apart from the step loop: what `--dtype auto` means, how long a
sequence the model serves exactly, how many bytes a KV block takes and how many blocks a memory
budget holds. `plan_engine` makes them all at once and returns them as one `EnginePlan`.
"""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING

import torch

from batchgen.config import EngineConfig
from batchgen.engine.engine_plan import EnginePlan
from batchgen.engine.weight_memory import estimate_weights
from batchgen.kernels.cpu.linear import cpu_has_native_bf16
from batchgen.model.layers import attention_heads
from batchgen.model.loading.model_defaults import model_max_len

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """The compute dtype for `--dtype name`.

    "auto" runs 16-bit, as vLLM's "auto" does (it downcasts float32 checkpoints too): float16 for a
    float16 checkpoint on CUDA, bfloat16 for everything else, float32 checkpoints included (the
    default model's GGUF file is dequantized to float32 but was trained in 16-bit). The exception is
    a CPU without native bf16 (`cpu_has_native_bf16`: no AVX-512 bf16 or AMX), where bf16 matmuls
    are emulated at about an eighth of the float32 rate: "auto" runs float32 there. Pass "float32"
    for full precision anywhere.

    Raises:
        KeyError: `name` is not "auto", "float32", "bfloat16" or "float16" (`EngineConfig` checks it first).
    """
    if name != "auto":
        return _DTYPES[name]
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if str(stored).replace("torch.", "") == "float16" and device.type == "cuda":
        return torch.float16
    if device.type == "cpu" and not cpu_has_native_bf16():
        return torch.float32
    return torch.bfloat16


def slow_dtype_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why `dtype` runs far below this CPU's speed (a warning for an explicit `--dtype`), else None:
    float16 has no fast matmul kernels on a CPU, and bfloat16 is emulated on one without AVX-512
    bf16 or AMX (`cpu_has_native_bf16`)."""
    if device.type != "cpu":
        return None
    if dtype == torch.float16:
        return "float16 on a CPU has no fast matmul kernels and runs many times slower than bfloat16"
    if dtype == torch.bfloat16 and not cpu_has_native_bf16():
        return "this CPU has no native bfloat16 (AVX-512 bf16 or AMX): bfloat16 matmuls are emulated, far below float32"
    return None


def plan_engine(
    config: EngineConfig, model_config: PretrainedConfig, device: torch.device, dtype: torch.dtype
) -> EnginePlan:
    """Size the engine: KV blocks from the memory budget, max_model_len within the model's limit
    and the cache, the step's token budget.

    Raises:
        ValueError: an explicit `max_model_len` above the model's limit or above what the cache
            holds; a token budget below max_model_len with chunked prefill off; a CPU cache larger
            than the memory available, or smaller than one block (`num_kv_blocks`).
    """
    model_len = model_max_len(model_config)
    per_block = kv_cache_bytes_per_block(model_config, config.block_size, dtype)
    num_blocks = num_kv_blocks(config, device, dtype, per_block, model_config)
    if config.max_model_len is not None and config.max_model_len > model_len:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's limit of {model_len} tokens"
        )
    capacity = num_blocks * config.block_size
    more_memory = "kv_cache_memory" + (" (or gpu_memory_utilization)" if device.type == "cuda" else "")
    if config.max_model_len is not None and config.max_model_len > capacity:
        # As vLLM: a cache that cannot hold one full-length sequence is a configuration error.
        raise ValueError(
            f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {config.block_size}), fewer "
            f"than max_model_len {config.max_model_len}: raise {more_memory} or lower max_model_len"
        )
    max_model_len = min(config.max_model_len or model_len, capacity)
    note, fix = "", "shorten or truncate the prompt, or raise max_model_len"
    if max_model_len == model_len:  # at the model's own limit, raising max_model_len is no option
        fix = f"shorten or truncate the prompt: {model_len} tokens is the model's limit"
    elif config.max_model_len is None:  # lowered to what the cache holds
        note = (
            f" (lowered from the model's {model_len}: the KV cache holds only {capacity} tokens; "
            f"raise {more_memory})"
        )
        fix = "shorten or truncate the prompt, or give the KV cache more memory"
        logger.warning("max_model_len is %d%s", max_model_len, note)
    return EnginePlan(
        num_blocks=num_blocks,
        num_swap_blocks=config.swap_bytes // per_block if config.preemption_mode == "swap" else 0,
        bytes_per_block=per_block,
        max_model_len=max_model_len,
        max_num_batched_tokens=token_budget(config, device, max_model_len),
        max_model_len_note=note,
        too_long_fix=fix,
    )


def token_budget(config: EngineConfig, device: torch.device, max_model_len: int) -> int:
    """`max_num_batched_tokens`: as given, else 8192 on CUDA and 2048 on a CPU (at least
    max_model_len with chunked prefill off, so a whole prompt fits a step).

    Raises:
        ValueError: a given budget below max_model_len with chunked prefill off.
    """
    if config.max_num_batched_tokens is not None:
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) is below max_model_len "
                f"({max_model_len}) with chunked prefill off: raise it, lower max_model_len, "
                "or enable chunked prefill"
            )
        return config.max_num_batched_tokens
    default = 8192 if device.type == "cuda" else 2048
    return default if config.enable_chunked_prefill else max(default, max_model_len)


def kv_cache_bytes_per_block(config: PretrainedConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block: K and V, in every layer, `block_size` tokens x KV heads x head_dim x
    the dtype's size (the cache layout is `[num_blocks, block_size, num_kv_heads, head_dim]`)."""
    _, kv_heads, head_dim = attention_heads(config)
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * kv_heads * head_dim * elem


def num_kv_blocks(
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    per_block: int,
    model_config: PretrainedConfig,
) -> int:
    """KV blocks of `per_block` bytes: an explicit `kv_cache_memory` on any device (as vLLM's
    `kv_cache_memory_bytes` overrides `gpu_memory_utilization`), else the CUDA memory budget,
    else 1 GiB on a CPU.

    Raises:
        ValueError: a CPU cache (plus swap space) larger than the memory available; a
            `kv_cache_memory` smaller than one block.
    """
    if device.type == "cuda" and config.kv_cache_memory is None:
        free, total = free_cuda_memory(device)
        budget = int(total * config.gpu_memory_utilization) - (total - free)
        # Leave room for the weights and activations: estimated as the weights' bytes x 1.5 (at the
        # dtype's size: no GPU kernel runs quantized weights, which `estimate_weights` knows).
        weights = estimate_weights(model_config, dtype, config.quantization, device)
        budget -= int(weights.total_bytes * 1.5)
        return max(budget // per_block, 1)
    if device.type == "cpu":
        swap = config.swap_bytes if config.preemption_mode == "swap" else 0
        check_fits_in_memory(config.kv_cache_bytes + swap)
    if config.kv_cache_bytes < per_block:  # rounding up to one block would use more than was given
        raise ValueError(
            f"kv_cache_memory is {config.kv_cache_bytes} bytes, less than one KV block of this model "
            f"({per_block} bytes for block_size {config.block_size} tokens); give --kv-cache-memory at "
            f"least {per_block} bytes (a useful cache holds thousands of tokens: 1GiB or more)"
        )
    return config.kv_cache_bytes // per_block


def free_cuda_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of `device` for a new KV cache, after handing back what this process holds
    but no longer uses: an earlier engine's cache, dropped (or held only by a reference cycle), stays
    reserved by torch's caching allocator, and `torch.cuda.mem_get_info` counts it as used. Without
    this a second `LLM` in one process (tests, a notebook) sizes its cache from the leftovers and
    lowers max_model_len to a few tokens. vLLM also collects and empties the cache before measuring."""
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)


def check_fits_in_memory(cache_bytes: int) -> None:
    """Refuse a CPU KV cache (plus swap space) larger than the memory available now, before
    allocating it: the allocation would fail with a bare OSError, or push the machine into swap.

    Raises:
        ValueError: naming kv_cache_memory / swap_space, both sizes in GiB, and the fix.
    """
    import psutil

    available = psutil.virtual_memory().available
    if cache_bytes > available:
        raise ValueError(
            f"kv_cache_memory plus swap_space is {cache_bytes / 2**30:.1f} GiB but only "
            f"{available / 2**30:.1f} GiB of memory is available; lower --kv-cache-memory (or --swap-space)"
        )
