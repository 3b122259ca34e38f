"""What `batchgen run` takes (`JobOptions`), what it reports (`JobSummary`), and the checks on both
the options and the output path that run before the input is read or a model is loaded.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from batchgen.config import FCFS, EngineConfig
from batchgen.jobs.errors import JobInputError
from batchgen.jobs.input.formats import JOB_FILE_SUFFIXES, JSONL_SUFFIXES
from batchgen.jobs.output.schema import LOGPROB_COLUMNS, PROMPT_LOGPROBS_FIELD, RESERVED_COLUMNS
from batchgen.metrics import MetricsOptions
from batchgen.sampling_params import SamplingDefaults

TRUNCATE_SIDES = ("left", "right")


@dataclass
class JobOptions(SamplingDefaults):
    """Everything `batchgen run` takes (see `batchgen run --help` for each flag).

    Attributes:
        input: job file, dataset directory, or "hf://NAME[:CONFIG]:SPLIT".
        limit: run only the first `limit` rows of the input (None: all).
        output: output path; None: `default_output_path` ("<input stem>.out.parquet").
        engine: EngineConfig keyword arguments (model, dtype, max_num_seqs, ...), without `policy`.
        policy: "fcfs", "max-throughput" or "priority" (window order and engine scheduling).
        window: look-ahead window size in rows.
        max_tokens, temperature, ... n: the sampling defaults (`SamplingDefaults`' fields, taken as
            keywords); row columns override. With `logprobs` (0-20) the output gets columns
            `logprobs` (per generated token: its id, text, log probability and the `logprobs` most
            likely alternatives) and `cumulative_logprob`; with `prompt_logprobs` (0-20) a
            `prompt_logprobs` column (per prompt token after the first: its log probability,
            rank and the most likely alternatives); with `n` > 1 (or a row's `n`), a
            `choices` column holding each row's n completions.
        truncate_prompt: None (an over-long prompt is an error row), "left" or "right" (tokens cut there).
        chat_template_kwargs: extra variables for the chat template of every chat row
            (`--chat-template-kwargs`, vLLM's name); a row's own `chat_template_kwargs` wins key by key.
        commit_rows / commit_seconds: commit a part at least this often (rows, seconds).
        dashboard: show the Rich live view when stdout is a terminal.
        resume_command: printed on SIGINT so the user can continue.
        metrics: Prometheus metrics over HTTP and / or in a textfile (`batchgen.metrics`).
    """

    input: str
    output: str | None = None
    overwrite: bool = False
    strict: bool = False
    prompt_column: str | None = None
    messages_column: str | None = None
    id_column: str | None = None
    template: str | None = None
    system_prompt: str | None = None
    chat_template: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    keep_columns: tuple[str, ...] = ()
    limit: int | None = None
    truncate_prompt: str | None = None
    policy: str = FCFS
    window: int = 1024
    engine: dict[str, Any] = field(default_factory=dict)
    commit_rows: int = 1000
    commit_seconds: float = 10.0
    dashboard: bool = True
    progress_interval: float = 5.0
    resume_command: str | None = None
    metrics: MetricsOptions = field(default_factory=MetricsOptions)

    def output_path(self, input_format: str) -> str:
        """`output` as given (an empty one too: `check_output_path` refuses it), else the default
        beside the input (`default_output_path`)."""
        return self.output if self.output is not None else default_output_path(self.input, input_format)


@dataclass
class JobSummary:
    """How a run ended. Row counts cover the whole job (rows committed by earlier runs included);
    `prompt_tokens` / `completion_tokens` count the tokens of rows that ran, not of error rows;
    `generated_tokens` every token the engine generated in this run, those of rows an interrupt left
    unfinished (not committed: a resume generates them again) included."""

    output_path: str
    rows_total: int
    rows_ok: int = 0
    rows_error: int = 0
    rows_resumed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0
    interrupted: bool = False
    stop_signal: int | None = None  # the signal that interrupted the run (SIGINT or SIGTERM)
    complete: bool = False
    already_complete: bool = False
    first_error: str | None = None  # this run's first error row's message, for the summary
    output_error_rows: int | None = None  # error rows in the whole finished output (earlier runs' too)
    # Structured outputs in this run: requests with a constraint, distinct constraints compiled and
    # the seconds their compilations took (summed over the compile threads).
    structured_rows: int = 0
    grammars_compiled: int = 0
    grammar_compile_s: float = 0.0
    mask_time_s: float = 0.0  # the steps' token masks (fill + apply), of `step_time_s` in all
    step_time_s: float = 0.0

    @property
    def rows_done(self) -> int:
        return self.rows_ok + self.rows_error + self.rows_resumed

    def to_dict(self, exit_code: int) -> dict[str, Any]:
        """The summary a script reads (`batchgen run --summary-json`): the output, whether it is
        complete, row counts (`error_rows`: error rows in the whole output once it is complete,
        else this run's), the first error message of this run and the command's exit code."""
        return {
            "output": self.output_path,
            "complete": self.complete,
            "interrupted": self.interrupted,
            "rows": self.rows_total,
            "rows_done": self.rows_done,
            "rows_ok_this_run": self.rows_ok,
            "rows_error_this_run": self.rows_error,
            "rows_from_earlier_runs": self.rows_resumed,
            "error_rows": self.output_error_rows if self.output_error_rows is not None else self.rows_error,
            "first_error": self.first_error,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "generated_tokens": max(self.generated_tokens, self.completion_tokens),
            "structured_rows": self.structured_rows,
            "grammars_compiled": self.grammars_compiled,
            "grammar_compile_s": round(self.grammar_compile_s, 3),
            "wall_s": round(self.wall_s, 3),
            "exit_code": exit_code,
        }

    @property
    def every_row_failed(self) -> bool:
        """A finished job none of whose rows ran: almost always the command's fault (a KV cache too
        small for any prompt, a wrong column, a template that fits no row), not the rows'."""
        return self.complete and self.rows_error > 0 and self.rows_ok == 0 and self.rows_resumed == 0


def default_output_path(source: str, input_format: str) -> str:
    """The input's path without its job-file suffix (.parquet, .jsonl, .json, .ndjson; another is
    kept) plus ".out.parquet" (".out.jsonl" for OpenAI batch input): jobs/a.jsonl ->
    jobs/a.out.parquet, notes.txt -> notes.txt.out.parquet."""
    suffix = ".out.jsonl" if input_format == "openai" else ".out.parquet"
    if source.startswith("hf://"):
        return source[len("hf://") :].replace("/", "_").replace(":", "_") + suffix
    path = source.rstrip("/")
    stem, ext = os.path.splitext(path)
    return (stem if ext.lower() in JOB_FILE_SUFFIXES else path) + suffix


def output_format(output_path: str, input_format: str) -> str:
    """ "openai" for a .jsonl output of OpenAI batch input, "jsonl" for other .jsonl, else "parquet"."""
    if output_path.lower().endswith(JSONL_SUFFIXES):  # suffixes are matched in any case
        return "openai" if input_format == "openai" else "jsonl"
    return "parquet"


def check_output_path(output: str, source: str) -> None:
    """Refuse an output that is the input file itself, or whose suffix names no output format.

    Raises:
        JobInputError: naming the output path and the fix.
    """
    if not output.strip():
        raise JobInputError(
            f"--output is empty; give a file path, or leave --output out for the default "
            f"({default_output_path(source, 'parquet')})"
        )
    if not output.lower().endswith(JOB_FILE_SUFFIXES):
        raise JobInputError(
            f"--output {output}: the name must end in .parquet, or in .jsonl, .ndjson or .json for JSON "
            "lines: the suffix picks the format written"
        )
    if not source.startswith("hf://") and os.path.exists(output) and os.path.exists(source):
        if os.path.samefile(output, source):
            raise JobInputError(
                f"--output {output} is the input file; choose another path "
                f"(the default is {default_output_path(source, 'parquet')})"
            )


def check_job_options(options: JobOptions) -> None:
    """The checks on `options` that need neither the input nor a model (engine options aside).

    Raises:
        JobInputError: naming the flag, its value and what it may be.
    """
    if options.truncate_prompt not in (None, *TRUNCATE_SIDES):
        raise JobInputError(f"--truncate-prompt must be left or right, got {options.truncate_prompt!r}")
    bad = [c for c in options.keep_columns if c in RESERVED_COLUMNS]
    if bad:
        raise JobInputError(
            f"--keep-columns {', '.join(bad)}: these names are output columns; keep other columns"
        )
    kept_logprobs = [c for c in options.keep_columns if c in LOGPROB_COLUMNS]
    if kept_logprobs and options.logprobs is not None:
        raise JobInputError(
            f"--keep-columns {', '.join(kept_logprobs)} and --logprobs: with --logprobs the output has "
            f"columns {' and '.join(LOGPROB_COLUMNS)}; keep other columns, or rename that input column"
        )
    if PROMPT_LOGPROBS_FIELD.name in options.keep_columns and options.prompt_logprobs is not None:
        raise JobInputError(
            "--keep-columns prompt_logprobs and --prompt-logprobs: with --prompt-logprobs the output has "
            "a column prompt_logprobs; keep other columns, or rename that input column"
        )
    twice = sorted({c for c in options.keep_columns if options.keep_columns.count(c) > 1})
    if twice:
        raise JobInputError(f"--keep-columns names {', '.join(twice)} more than once; name each column once")
    if options.window < 1:
        raise JobInputError(f"--window must be >= 1 row, got {options.window}")
    if options.template is not None and (options.prompt_column or options.messages_column):
        flag = "--prompt-column" if options.prompt_column else "--messages-column"
        raise JobInputError(
            f"--template and {flag}: the template builds each prompt from its {{column}} fields, so "
            f"{flag} would be ignored; give one of them"
        )
    if options.prompt_column and options.messages_column:
        raise JobInputError(
            f"--prompt-column {options.prompt_column} and --messages-column {options.messages_column}: "
            "give one of them (text prompts or chat messages)"
        )
    if not isinstance(options.commit_rows, int) or options.commit_rows < 1:
        raise JobInputError(f"--commit-every must be >= 1 row, got {options.commit_rows}")
    for flag, value in (
        ("--commit-interval", options.commit_seconds),
        ("--progress-interval", options.progress_interval),
    ):
        if not value > 0:
            raise JobInputError(f"{flag} must be > 0 seconds, got {value}")


_PLAIN_WORDS = frozenset({"model", "device", "policy", "seed", "dtype"})


def flag_hint(message: str) -> str:
    """The hint ' (flag --max-model-len)' for the first engine option a message names by its field
    name: the engine speaks in `EngineConfig` fields, the command line in flags."""
    # Longest names first: "max_model_len" must win over a "model" elsewhere in the message; and
    # option names that are also plain words ("the model's limit") count only where a validation
    # message names its field: at the start ("dtype must be ...").
    for name in sorted(EngineConfig.__dataclass_fields__, key=len, reverse=True):
        plain = name in _PLAIN_WORDS
        if message.startswith(f"{name} ") if plain else re.search(rf"\b{name}\b", message):
            return f" (flag --{name.replace('_', '-')})"
    return ""
