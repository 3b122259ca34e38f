"""Typer options declared once: the engine's (shared by `batchgen run` and `batchgen bench`) and the
sampling defaults of `batchgen run` (and `batchgen plan`), with vLLM's spellings.

Each option is an `Annotated` type that a command declares with its default taken from the
dataclass that owns it (`EngineConfig`, `SamplingDefaults`), so commands and dataclasses cannot
drift apart in names, help or defaults::

    def run_command(max_num_seqs: MaxNumSeqs = EngineConfig.max_num_seqs, ...): ...

`engine_options(locals())` then collects the values into `EngineConfig` keyword arguments, and
`sampling_options(locals())` into `SamplingDefaults` (and so `JobOptions`) keyword arguments.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any

import typer

from batchgen.cli_structured import structured_flags
from batchgen.config import (
    ATTENTION_BACKENDS,
    DEVICES,
    DTYPES,
    KERNEL_MODES,
    MAX_THROUGHPUT,
    PREEMPTION_MODES,
    SPECULATIVE_METHODS,
    EngineConfig,
    parse_memory_size,
)
from batchgen.sampling_params import SamplingDefaults


def memory_size(text: str) -> int:
    """`parse_memory_size` for Typer: "1073741824", "2GiB", "512MiB", ... -> bytes.

    Raises:
        typer.BadParameter: not a size (Typer turns it into a usage error, exit 2).
    """
    try:
        return parse_memory_size(text)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def choices(values: tuple[str, ...]) -> str:
    """Help text listing the allowed values of an option: "a | b | c"."""
    return " | ".join(values)


Model = Annotated[
    str | None, typer.Option(help="HF directory, hub id or .gguf file (default: SmolLM2-135M-Instruct)")
]
Dtype = Annotated[
    str,
    typer.Option(
        help=choices(DTYPES)
        + "; auto: bfloat16 (float16 for a float16 checkpoint on CUDA; float32 on a CPU without native bf16)"
    ),
]
MaxNumSeqs = Annotated[int, typer.Option(help="Most sequences per step")]
MaxNumBatchedTokens = Annotated[int | None, typer.Option(help="Most tokens per step")]
BlockSize = Annotated[int, typer.Option(help="Tokens per KV-cache block")]
MaxModelLen = Annotated[int | None, typer.Option(help="Longest prompt + output in tokens")]
GpuMemoryUtilization = Annotated[float, typer.Option(help="Fraction of GPU memory to use (CUDA)")]
KvCacheMemory = Annotated[
    int | None,
    typer.Option(
        parser=memory_size,
        metavar="SIZE",
        help="KV cache size: bytes or 2GiB, 512MiB (default 1GiB on CPU; on CUDA, set, it replaces --gpu-memory-utilization)",
    ),
]
SwapSpace = Annotated[float, typer.Option(help="GiB of CPU swap space for preempted blocks")]
EnablePrefixCaching = Annotated[bool, typer.Option(help="Reuse KV blocks of shared prompt prefixes")]
EnableChunkedPrefill = Annotated[bool, typer.Option(help="Split long prompts across steps")]
PreemptionMode = Annotated[str, typer.Option(help=choices(PREEMPTION_MODES))]
AgingSteps = Annotated[
    int, typer.Option(help="max-throughput: a request waiting this many steps is served next")
]
AttentionBackend = Annotated[str, typer.Option(help=choices(ATTENTION_BACKENDS))]
Kernels = Annotated[
    str,
    typer.Option(
        help=choices(KERNEL_MODES)
        + ": auto times each kernel on this machine (cached), reference is plain torch, native is batchgen's own"
    ),
]
OneWeightLayout = Annotated[
    bool, typer.Option(help="--kernels auto: one weight copy per linear (less memory, maybe slower)")
]
Device = Annotated[str, typer.Option(help=choices(DEVICES))]
NumThreads = Annotated[int | None, typer.Option(help="torch CPU threads")]
SpeculativeMethod = Annotated[
    str | None,
    typer.Option(
        help=choices(SPECULATIVE_METHODS) + ": prompt-lookup speculative decoding for greedy rows "
        "(token-identical output; sampled rows decode as before); default off"
    ),
]
NumSpeculativeTokens = Annotated[
    int | None, typer.Option(help="Draft tokens verified per request and step (default 4)")
]
PromptLookupMin = Annotated[int | None, typer.Option(help="Shortest n-gram matched for drafts (default 2)")]
PromptLookupMax = Annotated[int | None, typer.Option(help="Longest n-gram matched for drafts (default 4)")]
SpeculativeMaxBatch = Annotated[
    int | None,
    typer.Option(
        help="Speculate only while at most this many requests run (0 = never; default: measured "
        "at start from this machine's step costs, cached)"
    ),
]
GrammarCompileTimeout = Annotated[
    float,
    typer.Option(
        help="Seconds a structured outputs constraint (--json-schema, a row's json_schema, ...) may "
        "take to compile; a row whose constraint takes longer is an error row"
    ),
]

# The parameter names above, as both commands spell them (EngineConfig's field names).
ENGINE_OPTIONS = (
    "model",
    "dtype",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "max_model_len",
    "gpu_memory_utilization",
    "kv_cache_memory",
    "swap_space",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "preemption_mode",
    "aging_steps",
    "attention_backend",
    "kernels",
    "one_weight_layout",
    "device",
    "num_threads",
    "speculative_method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "speculative_max_batch",
    "grammar_compile_timeout",
)


# --- sampling defaults of `batchgen run` (row columns override; `SamplingDefaults` holds the defaults) ---
MaxTokens = Annotated[int, typer.Option(help="Most tokens generated per row")]
Temperature = Annotated[float, typer.Option(help="0 = greedy")]
TopP = Annotated[float, typer.Option()]
TopK = Annotated[int, typer.Option(help="0 or -1 = off")]
Seed = Annotated[int | None, typer.Option(help="Per-request sampling seed")]
Stop = Annotated[list[str] | None, typer.Option(help="Stop string (repeatable)")]
StopTokenIds = Annotated[
    list[str] | None,
    typer.Option(help="Token ids that end a row, besides EOS (comma-separated or repeated)", metavar="IDS"),
]
MinP = Annotated[float, typer.Option(help="Drop tokens below min_p x the top token's probability")]
MinTokens = Annotated[int, typer.Option(help="EOS and stop token ids count only after this many tokens")]
IgnoreEos = Annotated[bool, typer.Option("--ignore-eos", help="Generate past EOS up to max_tokens")]
N = Annotated[
    int,
    typer.Option(
        "--n",
        help="Completions per row (vLLM's n): all n in a 'choices' column, the first also in "
        "'output' (OpenAI batch output: the line's choices)",
    ),
]
PresencePenalty = Annotated[float, typer.Option(help="Subtracted from generated tokens' logits, [-2, 2]")]
FrequencyPenalty = Annotated[float, typer.Option(help="Subtracted per repeat of a generated token, [-2, 2]")]
RepetitionPenalty = Annotated[
    float, typer.Option(help="Divides logits of prompt and output tokens (HF/vLLM), 1 = off")
]
Logprobs = Annotated[
    int | None,
    typer.Option(
        help="Write each generated token's log probability and its K most likely alternatives "
        "(0-20, vLLM's logprobs) in a 'logprobs' column (OpenAI batch output: choices' logprobs)",
        metavar="K",
    ),
]
PromptLogprobs = Annotated[
    int | None,
    typer.Option(
        help="Write each prompt token's log probability, rank and its K most likely alternatives "
        "(0-20, vLLM's prompt_logprobs; null for the first token) in a 'prompt_logprobs' column "
        "(OpenAI batch output: vLLM's prompt_logprobs); such rows take no prefix-cache hits",
        metavar="K",
    ),
]


JsonSchema = Annotated[
    Path | None,
    typer.Option(
        help="JSON schema file that every row's output must match (a row's own json_schema, regex, "
        "choice or grammar column wins)",
        metavar="FILE",
    ),
]
Regex = Annotated[str | None, typer.Option(help="Regular expression every row's output must match")]
Choice = Annotated[
    list[str] | None,
    typer.Option(
        help="Every row's output is one of these strings (comma-separated or repeated)", metavar="A,B"
    ),
]
Grammar = Annotated[
    Path | None,
    typer.Option(
        help="EBNF grammar file (GBNF form, root ::= ...) every row's output must match", metavar="FILE"
    ),
]


def sampling_options(values: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults out of a command's parameters (`locals()`): `SamplingDefaults` keyword
    arguments, `--stop` and `--stop-token-ids` as tuples (the latter's comma lists split), and the
    job's structured outputs constraint from `--json-schema`, `--regex`, `--choice` or `--grammar`
    (`structured_flags`).

    Raises:
        typer.BadParameter: a `--stop-token-ids` value that is not a whole number, or a bad
            constraint flag (exit 2).
    """
    sampling = {f.name: values[f.name] for f in fields(SamplingDefaults) if f.name != "structured_outputs"}
    sampling["stop"] = tuple(sampling["stop"] or ())
    sampling["stop_token_ids"] = _token_ids(sampling["stop_token_ids"])
    sampling["structured_outputs"] = structured_flags(values)
    return sampling


def _token_ids(values: list[str] | None) -> tuple[int, ...]:
    """`--stop-token-ids` values (each a comma list) as token ids.

    Raises:
        typer.BadParameter: a value that is not a whole number (a usage error, exit 2).
    """
    ids = []
    for item in values or ():
        for part in item.split(","):
            if not part.strip():
                continue
            try:
                ids.append(int(part))
            except ValueError:
                raise typer.BadParameter(
                    f"{part.strip()!r} is not a token id; give whole numbers, e.g. --stop-token-ids 2,13",
                    param_hint="--stop-token-ids",
                ) from None
    return tuple(ids)


def engine_options(values: dict[str, Any]) -> dict[str, Any]:
    """The engine options out of a command's parameters (`locals()`): `EngineConfig` keyword arguments.

    Inside a command, each engine flag given on the command line that has no effect with the other
    options (see `inert_options`) gets one warning line on stderr."""
    engine = {name: values[name] for name in ENGINE_OPTIONS}
    try:
        EngineConfig(**engine)
    except (TypeError, ValueError):
        # The command fails on this value with its own message; "--swap-space -1 ... is ignored"
        # before "swap_space must be >= 0" would contradict it.
        return engine
    given = _given_options(ENGINE_OPTIONS)
    for message in inert_options(engine, given, str(values.get("policy") or "fcfs")):
        typer.echo(f"warning: {message}", err=True)
    return engine


def _given_options(names: tuple[str, ...]) -> set[str]:
    """The parameters among `names` that the running command got from its command line (or the
    environment), not from their defaults; empty outside a command.

    Typer runs on Click, its own copy of it in recent versions: the context functions are taken
    from the package `typer.Context` is built on, whichever it is."""
    core = importlib.import_module(typer.Context.__mro__[1].__module__)  # click.core or its copy
    context = importlib.import_module(core.__name__.rsplit(".", 1)[0] + ".globals")
    ctx = context.get_current_context(silent=True)
    if ctx is None:
        return set()
    unset = (None, core.ParameterSource.DEFAULT, core.ParameterSource.DEFAULT_MAP)
    return {name for name in names if ctx.get_parameter_source(name) not in unset}


def inert_options(engine: dict[str, Any], given: set[str], policy: str) -> list[str]:
    """Why each engine option in `given` (the ones the user set) changes nothing with the others.

    Args:
        engine: `EngineConfig` keyword arguments.
        given: names of the options set on the command line.
        policy: the command's `--policy` value (a comma list for `batchgen bench`).

    Returns:
        One message per such option, naming its flag and what would make it apply: `--aging-steps`
        outside max-throughput, `--swap-space` without `--preemption-mode swap`, and
        `--gpu-memory-utilization` when the engine runs on a CPU (resolving `--device auto` imports
        torch, only then).
    """
    messages = []
    policies = {p.strip() for p in policy.split(",") if p.strip()}
    if "aging_steps" in given and MAX_THROUGHPUT not in policies:
        messages.append(
            f"--aging-steps applies only to --policy max-throughput (this run: {policy}); it is ignored"
        )
    if "swap_space" in given and engine.get("preemption_mode") != "swap":
        messages.append(
            "--swap-space applies only with --preemption-mode swap (this run preempts by "
            f"{engine.get('preemption_mode')}); it is ignored"
        )
    if "gpu_memory_utilization" in given and _runs_on_cpu(engine.get("device") or "auto"):
        messages.append(
            "--gpu-memory-utilization applies only on CUDA; this run is on the CPU, whose KV cache "
            "size is --kv-cache-memory (default 1GiB); it is ignored"
        )
    return messages


def _runs_on_cpu(device: str) -> bool:
    if device == "cpu":
        return True
    if device == "cuda":
        return False
    import torch  # --device auto: what it resolves to (only asked when the flag was given)

    return not torch.cuda.is_available()


def output_file_problem(path: Path) -> str | None:
    """Why `path` cannot be written, or None: its folder is missing or not writable, `path` is a
    folder or a read-only file, or opening it for writing fails (a file that did not exist is created
    and removed again; permission bits alone miss read-only file systems, /proc and the like). The
    text follows the path in a message and ends with the fix."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        return "is a folder; give a file path"
    if not parent.is_dir():
        return f"cannot be written: the folder {parent} does not exist; create it or give another path"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be written: the folder {parent} is not writable; give another path"
    if path.exists() and not os.access(path, os.W_OK):
        return "exists and is not writable; give another path"
    existed = path.exists()
    try:
        with path.open("a"):  # "a": an existing file keeps its contents
            pass
        if not existed:
            path.unlink()
    except OSError as exc:
        return f"cannot be written ({exc.strerror or exc}); give another path"
    return None
