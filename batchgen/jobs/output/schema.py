"""The columns of a job's output: the final file's, the parts' own, and the names kept columns may not take.

`OUTPUT_SCHEMA` is what every output row has; `LOGPROB_SCHEMA` is added when a row asked for log
probabilities and `CHOICES_COLUMN` when a row asked for n > 1 completions; `INTERNAL_SCHEMA` is kept
in the committed parts only (resume identity and what OpenAI batch output lines need). The parts
(`batchgen.jobs.output.writer`) and the final file (`batchgen.jobs.output.final_output`) are built from these;
the options check (`batchgen.jobs.options`) refuses `--keep-columns` names in `RESERVED_COLUMNS`.
"""

from __future__ import annotations

import pyarrow as pa

OUTPUT_SCHEMA = pa.schema(
    [
        ("row_index", pa.int64()),
        ("id", pa.string()),
        ("output", pa.string()),
        ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("error", pa.string()),
        ("ttft_s", pa.float64()),
        ("latency_s", pa.float64()),
    ]
)
# Generated tokens' log probabilities (`--logprobs`, a row's `logprobs`): in every part, and in the
# final output when some row asked for them (`batchgen.jobs.requests.token_logprobs` builds a value).
_TOKEN_LOGPROB = [
    ("token_id", pa.int32()),
    ("token", pa.string()),
    ("bytes", pa.binary()),
    ("logprob", pa.float32()),
]
LOGPROBS_TYPE = pa.list_(pa.struct([*_TOKEN_LOGPROB, ("top_logprobs", pa.list_(pa.struct(_TOKEN_LOGPROB)))]))
LOGPROB_SCHEMA = pa.schema([("cumulative_logprob", pa.float64()), ("logprobs", LOGPROBS_TYPE)])
# A job that keeps an input column of one of these names as data writes no log probabilities.
LOGPROB_COLUMNS = tuple(LOGPROB_SCHEMA.names)
# Kept in parts only: resume identity and what OpenAI output lines need, among which the
# completions after the first of a line with n > 1 (`batchgen.jobs.requests.output_result`).
MORE_CHOICES_TYPE = pa.list_(
    pa.struct(
        [
            ("output", pa.string()),
            ("finish_reason", pa.string()),
            ("completion_tokens", pa.int64()),
            *LOGPROB_SCHEMA,
        ]
    )
)
INTERNAL_SCHEMA = pa.schema(
    [
        ("row_hash", pa.int64()),
        ("endpoint", pa.string()),
        ("created", pa.int64()),
        ("more_choices", MORE_CHOICES_TYPE),
    ]
)
# The final output's column of every completion of each row, in the Parquet and JSON-lines outputs
# of a job where some row asks for n > 1 (`choices_type`); OpenAI batch output has its own choices.
CHOICES_COLUMN = "choices"
# Names --keep-columns may not take. The LOGPROB_SCHEMA names may be kept (as before batchgen wrote
# log probabilities): such a job writes none (`logprob_fields`).
RESERVED_COLUMNS = frozenset(OUTPUT_SCHEMA.names) | frozenset(INTERNAL_SCHEMA.names) | {CHOICES_COLUMN}


def logprob_fields(keep_columns: tuple[str, ...]) -> list[pa.Field]:
    """The LOGPROB_SCHEMA fields a job's parts carry: none when a kept input column has one of
    their names (its rows then ask for no log probabilities, `batchgen.jobs.input.rows.RowParser`)."""
    return [] if set(keep_columns) & set(LOGPROB_COLUMNS) else list(LOGPROB_SCHEMA)


def choices_type(logprobs: bool) -> pa.DataType:
    """The `choices` column: per row, its completions in sample order (the first is the one in
    `output`), each {output, finish_reason, completion_tokens} and, with `logprobs`, its
    {cumulative_logprob, logprobs}; null for an error row."""
    fields = [("output", pa.string()), ("finish_reason", pa.string()), ("completion_tokens", pa.int64())]
    return pa.list_(pa.struct(fields + (list(LOGPROB_SCHEMA) if logprobs else [])))
