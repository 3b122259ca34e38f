"""The columns of a job's output: the final file's, the parts' own, and the names kept columns may not take.

`OUTPUT_SCHEMA` is what every output row has; `LOGPROB_SCHEMA` is added when a row asked for log
probabilities, `PROMPT_LOGPROBS_FIELD` when a row asked for its prompt's and `CHOICES_COLUMN` when a
row asked for n > 1 completions; `INTERNAL_SCHEMA` is kept
in the committed parts only (resume identity and what OpenAI batch output lines need). The parts
(`batchgen.jobs.output.writer`) and the final file (`batchgen.jobs.output.final_output`) are built from these;
the options check (`batchgen.jobs.options`) refuses `--keep-columns` names in `RESERVED_COLUMNS`.
"""

from __future__ import annotations

from dataclasses import dataclass

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
# The prompt tokens' log probabilities (`--prompt-logprobs`, a row's `prompt_logprobs`): per prompt
# token, null for the first, then the token's entry as in `logprobs` plus its `rank` (1 = the most
# likely token there), with the K most likely tokens in `top_logprobs`
# (`batchgen.jobs.requests.prompt_token_logprobs` builds a value). In every part, and in the final
# output when some row asked; a job that keeps an input column of this name writes none.
PROMPT_LOGPROBS_FIELD = pa.field(
    "prompt_logprobs",
    pa.list_(
        pa.struct(
            [*_TOKEN_LOGPROB, ("rank", pa.int32()), ("top_logprobs", pa.list_(pa.struct(_TOKEN_LOGPROB)))]
        )
    ),
)
# The thinking of a reasoning model's output (`--reasoning-parser`; `output` is then the answer):
# in every part, and in the final output of a job with a reasoning parser or some row that has it.
REASONING_FIELD = pa.field("reasoning", pa.string())
# Kept in parts only: resume identity and what OpenAI output lines need, among which the
# completions after the first of a line with n > 1 (`batchgen.jobs.requests.output_result`).
MORE_CHOICES_TYPE = pa.list_(
    pa.struct(
        [
            ("output", pa.string()),
            ("finish_reason", pa.string()),
            ("completion_tokens", pa.int64()),
            *LOGPROB_SCHEMA,
            REASONING_FIELD,
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
RESERVED_COLUMNS = (
    frozenset(OUTPUT_SCHEMA.names) | frozenset(INTERNAL_SCHEMA.names) | {CHOICES_COLUMN, REASONING_FIELD.name}
)


def logprob_fields(keep_columns: tuple[str, ...]) -> list[pa.Field]:
    """The LOGPROB_SCHEMA fields a job's parts carry: none when a kept input column has one of
    their names (its rows then ask for no log probabilities, `batchgen.jobs.input.rows.RowParser`)."""
    return [] if set(keep_columns) & set(LOGPROB_COLUMNS) else list(LOGPROB_SCHEMA)


def prompt_logprob_fields(keep_columns: tuple[str, ...]) -> list[pa.Field]:
    """[PROMPT_LOGPROBS_FIELD] for a job's parts, or none when a kept input column has its name
    (the rows' `prompt_logprobs` is then data, `batchgen.jobs.input.rows.RowParser`)."""
    return [] if PROMPT_LOGPROBS_FIELD.name in keep_columns else [PROMPT_LOGPROBS_FIELD]


def choices_type(logprobs: bool, reasoning: bool = False) -> pa.DataType:
    """The `choices` column: per row, its completions in sample order (the first is the one in
    `output`), each {output, finish_reason, completion_tokens}, with `logprobs` its
    {cumulative_logprob, logprobs} and with `reasoning` its {reasoning}; null for an error row."""
    fields = [("output", pa.string()), ("finish_reason", pa.string()), ("completion_tokens", pa.int64())]
    fields += list(LOGPROB_SCHEMA) if logprobs else []
    return pa.list_(pa.struct(fields + ([REASONING_FIELD] if reasoning else [])))


@dataclass(frozen=True)
class OptionalColumns:
    """Which optional columns a final output has, after OUTPUT_SCHEMA's and in this order:
    REASONING_FIELD (`reasoning`), LOGPROB_SCHEMA's (`logprobs`), PROMPT_LOGPROBS_FIELD
    (`prompt_logprobs`), `choices` (`choices`)."""

    logprobs: bool = False
    prompt_logprobs: bool = False
    choices: bool = False
    reasoning: bool = False

    def fields(self) -> list[pa.Field]:
        fields = [REASONING_FIELD] if self.reasoning else []
        fields += list(LOGPROB_SCHEMA) if self.logprobs else []
        fields += [PROMPT_LOGPROBS_FIELD] if self.prompt_logprobs else []
        fields += (
            [pa.field(CHOICES_COLUMN, choices_type(self.logprobs, self.reasoning))] if self.choices else []
        )
        return fields
