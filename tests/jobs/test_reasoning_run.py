"""Reasoning through `batchgen run` on the scripted thinking model (`tests.engine.thinking_model`):
the `reasoning` column beside `output` in Parquet and JSON-lines outputs, `message.reasoning_content`
in OpenAI batch output lines, a row cut inside its thinking, `--chat-template-kwargs` and a row's
own `chat_template_kwargs` reaching Qwen3's real chat template, and bad values as error rows or
usage errors naming the field or flag."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from tests.engine.thinking_model import ANSWER, REASONING, build_thinking_model

ASK = [{"role": "user", "content": "Is it?"}]
OFF = {"enable_thinking": False}


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer_dir) -> Path:
    return build_thinking_model(tmp_path_factory.mktemp("thinking"), tokenizer_dir)


def run(model: Path, *args: str):
    base = ["--model", str(model), "--dtype", "float32", "--kv-cache-memory", "64MiB", "--no-dashboard"]
    return CliRunner().invoke(app, ["run", *args, *base, "--max-tokens", "20"])


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_reasoning_column_in_jsonl_and_parquet(tmp_path, model):
    src = write_jsonl(
        tmp_path / "job.jsonl",
        [
            {"id": "a", "messages": ASK},
            {"id": "off", "messages": ASK, "chat_template_kwargs": OFF},
            {"id": "cut", "messages": ASK, "max_tokens": 3},
            {"id": "bad", "messages": ASK, "chat_template_kwargs": "no thinking"},
        ],
    )
    for out in (tmp_path / "job.out.jsonl", tmp_path / "job.out.parquet"):
        result = run(model, str(src), "--output", str(out), "--reasoning-parser", "qwen3")
        assert result.exit_code == 0, result.output
        rows = (
            [json.loads(line) for line in out.read_text().splitlines()]
            if out.suffix == ".jsonl"
            else pq.read_table(out).to_pylist()
        )
        got = [(r["id"], r["reasoning"], r["output"], r["finish_reason"]) for r in rows]
        assert got[:3] == [
            ("a", REASONING, ANSWER, "stop"),
            ("off", None, "yes.", "stop"),
            ("cut", "I,", "", "length"),
        ]
        assert got[3][3] == "error"
        assert "row 3 (line 4): field 'chat_template_kwargs' must be a JSON object" in rows[3]["error"]


def test_the_flag_applies_to_every_row_and_a_rows_own_value_wins(tmp_path, model):
    src = write_jsonl(
        tmp_path / "job.jsonl",
        [{"messages": ASK}, {"messages": ASK, "chat_template_kwargs": {"enable_thinking": True}}],
    )
    out = tmp_path / "out.jsonl"
    result = run(
        model, str(src), "--output", str(out), "--reasoning-parser", "deepseek_r1",
        "--chat-template-kwargs", json.dumps(OFF),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["reasoning"], r["output"]) for r in rows] == [(None, "yes."), (REASONING, ANSWER)]


def test_without_a_parser_the_output_is_whole_and_has_no_reasoning_column(tmp_path, model):
    src = write_jsonl(tmp_path / "job.jsonl", [{"messages": ASK}])
    out = tmp_path / "out.jsonl"
    assert run(model, str(src), "--output", str(out)).exit_code == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["output"] == f"<think>{REASONING}</think>{ANSWER}" and "reasoning" not in row


@pytest.mark.parametrize(
    ("value", "message"),
    [("{enable_thinking: false}", "is not JSON"), ("[1]", "must be a JSON object")],
)
def test_a_bad_flag_value_is_a_usage_error_naming_the_flag(tmp_path, model, value, message):
    src = write_jsonl(tmp_path / "job.jsonl", [{"messages": ASK}])
    result = run(model, str(src), "--chat-template-kwargs", value)
    said = " ".join(result.stderr.replace("│", " ").split())  # Typer's box may wrap the line
    assert result.exit_code == 2 and "--chat-template-kwargs" in said and message in said, said


def test_openai_batch_lines_carry_reasoning_content(tmp_path, model):
    lines = [
        {"custom_id": "think", "body": {"messages": ASK}},
        {"custom_id": "off", "body": {"messages": ASK, "chat_template_kwargs": OFF}},
        {"custom_id": "cut", "body": {"messages": ASK, "max_tokens": 4}},
        {"custom_id": "bad", "body": {"messages": ASK, "chat_template_kwargs": {"tokenize": True}}},
    ]
    src = write_jsonl(
        tmp_path / "batch.jsonl",
        [{"method": "POST", "url": "/v1/chat/completions", **line} for line in lines],
    )
    result = run(model, str(src), "--reasoning-parser", "qwen3")
    assert result.exit_code == 0, result.output
    records = [json.loads(x) for x in (tmp_path / "batch.out.jsonl").read_text().splitlines()]
    messages = [r["response"]["body"]["choices"][0]["message"] for r in records[:3]]
    assert messages == [
        {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING},
        {"role": "assistant", "content": "yes.", "reasoning_content": None},
        {"role": "assistant", "content": "", "reasoning_content": "I, maybe"},
    ]
    assert records[2]["response"]["body"]["choices"][0]["finish_reason"] == "length"
    assert "field 'body.chat_template_kwargs' may not set tokenize" in records[3]["error"]["message"]


def test_n_completions_each_carry_their_reasoning(tmp_path, model):
    src = write_jsonl(tmp_path / "job.jsonl", [{"messages": ASK, "n": 2}])
    out = tmp_path / "out.jsonl"
    assert run(model, str(src), "--output", str(out), "--reasoning-parser", "qwen3").exit_code == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(c["reasoning"], c["output"]) for c in row["choices"]] == [(REASONING, ANSWER)] * 2


def test_a_rerun_with_another_parser_or_template_kwargs_is_refused(tmp_path, model):
    """Both change the rows, so they are part of the run's identity (its header)."""
    src = write_jsonl(tmp_path / "job.jsonl", [{"messages": ASK}])
    out = tmp_path / "out.parquet"
    assert run(model, str(src), "--output", str(out), "--reasoning-parser", "qwen3").exit_code == 0
    again = run(model, str(src), "--output", str(out), "--reasoning-parser", "qwen3")
    assert again.exit_code == 0 and "already complete" in again.output
    for other in (
        ["--reasoning-parser", "deepseek_r1"],
        ["--reasoning-parser", "qwen3", "--chat-template-kwargs", json.dumps(OFF)],
    ):
        refused = run(model, str(src), "--output", str(out), *other)
        said = " ".join(refused.stderr.split())
        assert refused.exit_code == 2 and "from a run with other settings" in said, said
