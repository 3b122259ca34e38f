"""A row's structured outputs constraint: plain columns, vLLM's structured_outputs, OpenAI's
response_format; each bad kind is an error row naming the row, the field, what is wrong and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.jobs.input.reader import JobReader, ReaderOptions
from batchgen.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def read(path: Path, rows: list[dict], **options) -> list:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return list(JobReader(str(path), ReaderOptions(**options)))


def batch_line(cid: str, body: dict) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}


MESSAGES = [{"role": "user", "content": "hi"}]


def test_plain_columns_set_the_rows_constraint(tmp_path):
    rows = [
        {"prompt": "a", "json_schema": SCHEMA},
        {"prompt": "b", "json_schema": json.dumps(SCHEMA)},
        {"prompt": "c", "regex": "[0-9]+"},
        {"prompt": "d", "choice": ["yes", "no"]},
        {"prompt": "e", "grammar": 'root ::= "x"'},
        {"prompt": "f", "structured_outputs": {"choice": ["p", "q"], "regex": None}},
        {
            "prompt": "g",
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
        },
        {"prompt": "h", "json_schema": None, "regex": None},
        {"prompt": "i"},
    ]
    parsed = read(tmp_path / "a.jsonl", rows)
    assert [r.error for r in parsed] == [None] * len(rows)
    got = [r.sampling_params.structured_outputs for r in parsed]
    assert got[0].key == got[1].key == got[6].key == StructuredOutputsParams(json=SCHEMA).key
    assert (got[2].regex, got[3].choice, got[4].grammar, got[5].choice) == (
        "[0-9]+",
        ["yes", "no"],
        'root ::= "x"',
        ["p", "q"],
    )
    assert got[7] is None and got[8] is None
    assert [r.constraint_field for r in parsed] == [
        "field 'json_schema'",
        "field 'json_schema'",
        "field 'regex'",
        "field 'choice'",
        "field 'grammar'",
        "field 'structured_outputs'",
        "field 'response_format.json_schema.schema'",
        None,
        None,
    ]
    # the constraint is part of the row's identity on resume
    assert parsed[0].row_hash != read(tmp_path / "b.jsonl", [{"prompt": "a"}])[0].row_hash


def test_a_rows_column_wins_over_the_jobs_flag_and_data_columns_stay_data(tmp_path):
    rows = [{"prompt": "a", "regex": "[a-z]"}, {"prompt": "b"}, {"prompt": "c", "choice": ["x"]}]
    a, b, c = read(tmp_path / "a.jsonl", rows, defaults={"structured_outputs": {"json": SCHEMA}})
    assert a.sampling_params.structured_outputs.regex == "[a-z]" and a.constraint_field == "field 'regex'"
    assert b.sampling_params.structured_outputs.schema == SCHEMA and b.constraint_field == "--json-schema"
    assert c.sampling_params.structured_outputs.choice == ["x"]
    (kept,) = read(tmp_path / "b.jsonl", [{"prompt": "a", "choice": ["x"]}], keep_columns=("choice",))
    assert (
        kept.error is None
        and kept.sampling_params.structured_outputs is None
        and kept.keep == {"choice": ["x"]}
    )


BAD_ROWS = [
    (
        {"json_schema": {"type": "strng"}},
        "field 'json_schema' is not a JSON schema xgrammar can compile: Unsupported type",
    ),
    ({"json_schema": "{oops"}, "field 'json_schema' is not valid JSON"),
    ({"json_schema": [1]}, "field 'json_schema' must be a JSON schema object or its JSON text"),
    (
        {"json_schema": {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}},
        "field 'json_schema' uses keyword 'multipleOf' at #/properties/n, which xgrammar cannot enforce",
    ),
    ({"json_schema": {"type": "string", "format": "color"}}, "uses format 'color' at #"),
    ({"regex": "(unclosed"}, "field 'regex' is not a regex xgrammar can compile: Regex parsing error"),
    ({"regex": 5}, "field 'regex' must be a string"),
    ({"choice": []}, "field 'choice' must be a non-empty list of strings"),
    ({"choice": "yes,no"}, "field 'choice' must be a list of strings"),
    ({"grammar": "root ::= missing"}, "field 'grammar' is not an EBNF grammar xgrammar can compile: "),
    ({"regex": "a", "choice": ["b"]}, "fields 'regex' and 'choice' both set a structured outputs constraint"),
    (
        {"structured_outputs": {"guided_json": {}}},
        "field 'structured_outputs' has unknown key(s) 'guided_json'",
    ),
    (
        {"response_format": {"type": "xml"}},
        "field 'response_format' must be an object whose 'type' is one of",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "'response_format.json_schema.schema' is missing",
    ),
    ({"regex": "a", "min_tokens": 2}, "min_tokens (2) cannot be combined with structured_outputs"),
]


def test_each_bad_constraint_is_its_rows_error(tmp_path):
    rows = [{"prompt": "ok", "regex": "a"}] + [{"prompt": "p", **fields} for fields, _ in BAD_ROWS]
    parsed = read(tmp_path / "a.jsonl", rows)
    assert parsed[0].error is None
    for i, (row, (_, message)) in enumerate(zip(parsed[1:], BAD_ROWS, strict=True), start=1):
        assert row.error.startswith(f"row {i} (line {i + 1}): "), row.error
        assert message in row.error, row.error
        assert "; " in row.error  # what to do follows what is wrong


def test_openai_batch_lines_take_response_format_and_structured_outputs(tmp_path):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    lines = [
        batch_line("a", {"messages": MESSAGES, "response_format": fmt}),
        batch_line("b", {"messages": MESSAGES, "response_format": {"type": "json_object"}}),
        batch_line("c", {"messages": MESSAGES, "response_format": {"type": "text"}}),
        batch_line("d", {"messages": MESSAGES, "structured_outputs": {"choice": ["x", "y"]}}),
        batch_line(
            "e",
            {
                "messages": MESSAGES,
                "response_format": {"type": "json_object"},
                "structured_outputs": {"regex": "a"},
            },
        ),
        batch_line(
            "f",
            {
                "messages": MESSAGES,
                "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strng"}}},
            },
        ),
        batch_line("g", {"messages": MESSAGES, "regex": "a"}),
    ]
    a, b, c, d, e, f, g = read(tmp_path / "batch.jsonl", lines)
    assert a.sampling_params.structured_outputs.schema == SCHEMA
    assert a.constraint_field == "field 'body.response_format.json_schema.schema'"
    assert b.sampling_params.structured_outputs.json_object is True
    assert c.error is None and c.sampling_params.structured_outputs is None
    assert d.sampling_params.structured_outputs.choice == ["x", "y"]
    assert "fields 'body.structured_outputs' and 'body.response_format' both set" in e.error
    assert (
        "field 'body.response_format.json_schema.schema' is not a JSON schema xgrammar can compile" in f.error
    )
    assert "field 'body.regex' is not supported by batchgen" in g.error


def test_parquet_columns(tmp_path):
    """Parquet holds schemas as JSON text (a struct column would give every row every key) and
    choices as list columns."""
    table = pa.table(
        {
            "prompt": ["a", "b", "c"],
            "json_schema": [json.dumps(SCHEMA), None, None],
            "choice": [None, ["yes", "no"], None],
        }
    )
    pq.write_table(table, tmp_path / "a.parquet")
    a, b, c = JobReader(str(tmp_path / "a.parquet"))
    assert a.sampling_params.structured_outputs.schema == SCHEMA
    assert b.sampling_params.structured_outputs.choice == ["yes", "no"]
    assert c.sampling_params.structured_outputs is None


@pytest.mark.parametrize("typo", ["jsonschema", "json_shema", "choices"])
def test_a_near_miss_column_gets_a_notice(tmp_path, typo):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"prompt": "a", typo: "x"}) + "\n")
    reader = JobReader(str(path))
    (row,) = reader
    assert row.sampling_params.structured_outputs is None
    assert any(f"column '{typo}' is not a sampling field" in n for n in reader.parser.notices)
