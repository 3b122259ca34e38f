"""`file:PATH` bench workloads: a job file's prompts, with output lengths from each row's `max_tokens`.

The file is read by the jobs layer's reader (`batchgen.jobs.input.reader.iter_records`: JSON lines line
by line with `batchgen run`'s per-line errors, Parquet by record batches), so the bench reads what
`batchgen run` reads. A record is then taken as the bench needs it, prompt and output length only,
and more leniently than `run` takes a row: `prompt_token_ids` rows, `sampling_params.max_tokens`
and an OpenAI batch `body` in any file. As `batchgen run` turns a bad row into an error row, the
bench skips rows it cannot use (a line that is not a JSON object, no prompt, an empty prompt, a bad
`max_tokens`) and says so in one warning; only a file with no usable row is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.bench.spec import BenchInputError, WorkloadSpec
from batchgen.jobs.errors import JobInputError
from batchgen.jobs.input.reader import iter_records

# Turns a job-file prompt (a string or chat messages) into token ids.
PromptEncoder = Callable[[Any], list[int]]


def read_job_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL (`.jsonl`, `.json`) or Parquet (`.parquet`) job file as dicts.

    Raises:
        FileNotFoundError: when the file is absent.
        ValueError: naming the line of a JSONL record that is not a JSON object, or a Parquet
            file that cannot be read (`BenchInputError`).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"job file {path} not found")
    rows = []
    for number, row, reason in iter_job_records(path):
        if row is None:
            raise ValueError(f"{path}:{number}: {reason}")
        rows.append(row)
    return rows


def iter_job_records(path: Path) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """Each record of a job file as `(number, row, None)`, or `(number, None, reason)` for a JSONL
    line that is not a JSON object. `number` is the line of a JSONL file (from 1; blank lines are
    skipped) or the row of a Parquet file (from 0, as `batchgen run` counts rows). The format is
    taken from the suffix (`.parquet`, else JSON lines).

    Raises:
        BenchInputError: a Parquet file pyarrow cannot read (truncated or damaged), naming it.
    """
    fmt = "parquet" if path.suffix == ".parquet" else "jsonl"
    try:
        for row_index, (line_number, row, error) in enumerate(iter_records(str(path), fmt)):
            number = row_index if line_number is None else line_number
            yield (number, None, f"not JSON ({error})") if error is not None else (number, row, None)
    except JobInputError as exc:
        raise BenchInputError(str(exc)) from exc
    except (OSError, pa.ArrowException) as exc:  # a damaged page after a readable footer
        if fmt != "parquet":
            raise
        raise BenchInputError(
            f"cannot read Parquet file {path}: {exc}; check that the file is whole (not truncated or damaged)"
        ) from exc


MAX_TOKENS_LIMIT = 2**31 - 1


def _row_prompt_and_max_tokens(row: dict[str, Any]) -> tuple[Any, int | None]:
    body: dict[str, Any] = row["body"] if isinstance(row.get("body"), dict) else {}
    sp: dict[str, Any] = row["sampling_params"] if isinstance(row.get("sampling_params"), dict) else {}
    if row.get("prompt_token_ids") is not None:
        prompt: Any = {"prompt_token_ids": list(row["prompt_token_ids"])}
    elif row.get("messages") is not None:
        prompt = list(row["messages"])
    elif row.get("prompt") is not None:
        prompt = row["prompt"]
    elif body.get("messages") is not None:
        prompt = list(body["messages"])
    elif body.get("prompt") is not None:
        prompt = body["prompt"]
    else:
        raise ValueError("row has no prompt, messages, prompt_token_ids or body.messages")
    for value in (
        row.get("max_completion_tokens"),  # the newer name wins, as in `batchgen run`
        row.get("max_tokens"),
        sp.get("max_tokens"),
        body.get("max_completion_tokens"),
        body.get("max_tokens"),
    ):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
                raise ValueError(f"max_tokens must be an integer, got {value!r}")
            if not 1 <= value <= MAX_TOKENS_LIMIT:  # 1e20 would overflow the int64 lengths
                raise ValueError(f"max_tokens must be in [1, {MAX_TOKENS_LIMIT}], got {value}")
            return prompt, int(value)
    return prompt, None


def _row_request(row: dict[str, Any], encode: PromptEncoder, output_len: int) -> tuple[list[int], int]:
    """A row's prompt token ids and output length (`output_len` when the row has no `max_tokens`).

    Raises:
        ValueError / TypeError / KeyError: the row cannot be benched (no prompt, an empty one, bad
            token ids or max_tokens), saying why.
    """
    prompt, max_tokens = _row_prompt_and_max_tokens(row)
    if isinstance(prompt, dict):
        ids = prompt["prompt_token_ids"]
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError("prompt_token_ids must be a list of non-negative integers")
    else:
        ids = encode(prompt)
    if not ids:
        raise ValueError("the prompt is empty")
    return list(ids), max_tokens if max_tokens is not None else output_len


# Sampling fields a job row may carry that a bench does not use: it runs every request greedy to
# exactly its output length (`ignore_eos`), as vLLM's throughput benchmarks do.
UNUSED_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "n", "stop", "stop_token_ids",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs",
)  # fmt: skip


def unused_sampling_fields(row: dict[str, Any]) -> set[str]:
    """The `UNUSED_SAMPLING_FIELDS` a row sets (top level, `sampling_params` or an OpenAI `body`)."""
    places = [row, row.get("sampling_params"), row.get("body")]
    return {
        name
        for place in places
        if isinstance(place, dict)
        for name in UNUSED_SAMPLING_FIELDS
        if place.get(name) is not None
    }


def read_workload_rows(
    spec: WorkloadSpec, encode: PromptEncoder
) -> tuple[list[list[int]], list[int], list[str], set[str]]:
    """The first `spec.num_prompts` usable rows (0 = all) of the job file `spec.dist[5:]`: their
    prompt token ids, their output lengths, a note per unusable row skipped ("line 3: not JSON
    (...)") and the sampling fields the rows set that the bench does not use
    (`unused_sampling_fields`); `workloads.build_workload` makes the workload of them.

    Prompts are tokenized by `encode` (rows with `prompt_token_ids` are taken as they are); a row
    without `max_tokens` runs `spec.output_len` tokens.

    Raises:
        BenchInputError: the file is absent or unreadable, or has no usable row (naming the first bad one).
    """
    spec.check_inputs()
    path = Path(spec.dist[5:])
    unit = "row" if path.suffix == ".parquet" else "line"
    prompts: list[list[int]] = []
    outs: list[int] = []
    skipped: list[str] = []
    unused: set[str] = set()
    for number, row, reason in iter_job_records(path):
        if spec.num_prompts and len(prompts) == spec.num_prompts:
            break
        if row is not None:
            try:
                ids, out = _row_request(row, encode, spec.output_len)
            except (ValueError, TypeError, KeyError) as exc:
                reason = str(exc)
        if reason is not None:
            skipped.append(f"{unit} {number}: {reason}")
            continue
        assert row is not None  # a record without a reason
        prompts.append(ids)
        outs.append(out)
        unused |= unused_sampling_fields(row)
    if not prompts:
        found = f"all {len(skipped)} rows are unusable (first: {skipped[0]})" if skipped else "it has no rows"
        raise BenchInputError(
            f"--dist {spec.dist}: no usable row in {path}: {found}; "
            "give rows with a prompt, messages or prompt_token_ids"
        )
    return prompts, outs, skipped, unused
