"""Typer options declared once, with vLLM's spellings: the engine's flags (`batchgen run`, `bench`,
`tune` and `plan`) and the sampling defaults of `batchgen run` (and `batchgen plan`).

The engine flags are `EngineConfig`'s fields that carry `batchgen.config.flag` metadata, as vLLM's
`EngineArgs.add_cli_args` derives its flags from its dataclass: `engine_flags` puts one option per
field (`--max-num-seqs`: the field's type, default and help) into a command's signature and hands
the command their values as one dict of `EngineConfig` keyword arguments::

    @engine_flags()
    def run_command(input: ..., window: ... = 1024, engine: EngineArgs = ENGINE_FLAGS, ...): ...

Each sampling option is an `Annotated` type that `run` declares with its default taken from
`SamplingDefaults`; `sampling_options(locals())` collects them as `SamplingDefaults` (and so
`JobOptions`) keyword arguments.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Callable
from dataclasses import Field, fields
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_type_hints

import typer

from batchgen.cli_structured import structured_flags
from batchgen.config import MAX_THROUGHPUT, EngineConfig, choices, parse_memory_size
from batchgen.sampling_params import SamplingDefaults

__all__ = ["choices"]  # re-exported: commands list their own options' values with it

T = TypeVar("T")


def usage_errors(parse: Callable[[str], T]) -> Callable[[str], T]:
    """`parse` for Typer: its ValueError becomes `typer.BadParameter` with the same message (Click
    would otherwise say only that the value is invalid), a usage error that exits 2."""

    @functools.wraps(parse)
    def parse_option(text: str) -> T:
        try:
            return parse(text)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None

    return parse_option


def memory_size(text: str) -> int:
    """`parse_memory_size` for Typer: "1073741824", "2GiB", "512MiB", ... -> bytes.

    Raises:
        typer.BadParameter: not a size (Typer turns it into a usage error, exit 2).
    """
    try:
        return parse_memory_size(text)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


# --- sampling defaults of `batchgen run` (row columns override; `SamplingDefaults` holds the defaults) ---
def _print_version(value: bool) -> None:
    """`--version`: "batchgen <version>" (the installed distribution's, from its metadata), exit 0."""
    if value:
        from importlib.metadata import version

        typer.echo(f"batchgen {version('batchgen')}")
        raise typer.Exit()


# `batchgen --version` (an option of the app itself, read before any command).
Version = Annotated[
    bool,
    typer.Option(
        "--version", callback=_print_version, is_eager=True, help="Print batchgen's version and exit."
    ),
]
MaxTokens = Annotated[int | None, typer.Option(help="Most tokens generated per row")]
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


# --- the engine flags: `EngineConfig`'s fields with `flag` metadata ---
EngineArgs = dict[str, Any]  # `EngineConfig` keyword arguments, as the engine flags give them
# A command's `engine` parameter defaults to this marker; `engine_flags` puts the flags in its place.
ENGINE_FLAGS: EngineArgs = {}
_FLAG_FIELDS: dict[str, Field[Any]] = {f.name: f for f in fields(EngineConfig) if "help" in f.metadata}
# The flags' parameter names (EngineConfig's field names), in the order --help lists them.
ENGINE_OPTIONS = tuple(_FLAG_FIELDS)


def flag_parameter(name: str, place: inspect.Parameter) -> inspect.Parameter:
    """The Typer parameter of the engine flag `name`, of the kind of `place`: `--name-with-dashes`,
    the field's type (what its `parse` returns, when it has one) and default, and its metadata's
    help and metavar."""
    f = _FLAG_FIELDS[name]
    hint = get_type_hints(EngineConfig)[name]
    option: dict[str, Any] = {"help": f.metadata["help"]}
    if f.metadata["metavar"] is not None:
        option["metavar"] = f.metadata["metavar"]
    parse = f.metadata["parse"]
    if parse is not None:
        option["parser"] = usage_errors(parse)
        hint = get_type_hints(parse)["return"]
        hint = hint | None if f.default is None else hint
    return place.replace(name=name, default=f.default, annotation=Annotated[hint, typer.Option(**option)])


def engine_flags(
    only: tuple[str, ...] = ENGINE_OPTIONS,
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorator: the engine flags `only` (default: all of them) as options of a Typer command.

    The command declares a parameter `engine: EngineArgs = ENGINE_FLAGS`; in the signature Typer
    reads, it is replaced at its place by the flags, in `EngineConfig`'s field order (see
    `flag_parameter`). A parameter the command declares under a flag's name is the command's own
    version of that flag (bench's comma list of speculative methods) and is listed at the flag's
    place. When the command runs, the flags' values (its own versions' too) come to it as `engine`,
    one dict, after a warning for each given flag that changes nothing (`engine_options`).

    Raises:
        TypeError: the command has no `engine` parameter, or `only` names a field without flag
            metadata.
    """
    unknown = [name for name in only if name not in _FLAG_FIELDS]
    if unknown:
        raise TypeError(f"{', '.join(unknown)}: not engine flags; give some of {', '.join(ENGINE_OPTIONS)}")

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(command, eval_str=True)
        params = dict(signature.parameters)
        place = params.get("engine")
        if place is None:
            raise TypeError(f"{command.__name__} has no `engine` parameter to put the engine flags at")
        own = {name: params.pop(name) for name in only if name in params}
        flags = [own.get(name) or flag_parameter(name, place) for name in only]
        listed = [q for p in params.values() for q in (flags if p is place else [p])]

        @functools.wraps(command)
        def with_engine_flags(**values: Any) -> None:
            engine = {name: values.pop(name) for name in only}
            command(**values, engine=engine_options(engine, values.get("policy")))

        set_signature(with_engine_flags, signature.replace(parameters=listed))
        return with_engine_flags

    return decorate


def set_signature(command: Callable[..., object], signature: inspect.Signature) -> None:
    """Give `command` the parameters `signature` lists, as Typer reads them: its `__signature__` and
    its evaluated annotations (Typer asks `typing.get_type_hints` too)."""
    command.__dict__["__signature__"] = signature
    command.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()}


def engine_options(engine: EngineArgs, policy: str | None = None) -> EngineArgs:
    """`engine` (the engine flags' values, `EngineConfig` keyword arguments), after one warning line
    on stderr for each flag given on the command line that has no effect with the other options
    (see `inert_options`; `policy` is the command's `--policy`, default fcfs)."""
    try:
        EngineConfig(**engine)
    except (TypeError, ValueError):
        # The command fails on this value with its own message; "--swap-space -1 ... is ignored"
        # before "swap_space must be >= 0" would contradict it.
        return engine
    given = _given_options(tuple(engine))
    for message in inert_options(engine, given, policy or "fcfs"):
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
