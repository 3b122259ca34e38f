"""Structured outputs through `batchgen run` on a tiny model: rows with their own constraints,
the job's flags, OpenAI batch lines' response_format, each bad-input kind an error row while the
others run (exit 0), and `--strict` finding them before any model work."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import xgrammar as xgr
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.sampling_params import StructuredOutputsParams
from tests.jobs.fake_engine import fake_factory
from tests.jobs.real_engine import quiet

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"


def invoke(*args: str):
    return CliRunner().invoke(app, ["run", *args])


def engine_args(model: Path, *more: str) -> list[str]:
    return [
        "--model",
        str(model),
        "--max-tokens",
        "16",
        "--kv-cache-memory",
        "64MiB",
        "--no-dashboard",
        *more,
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def output_rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


BAD_KINDS = {
    "invalid schema": ({"json_schema": {"type": "object", "properties": {"a": {"type": "strng"}}}},
                       "field 'json_schema' is not a JSON schema xgrammar can compile: Unsupported type \"strng\"; fix the schema"),
    "unsupported keyword": ({"json_schema": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
                            "field 'json_schema' uses keyword 'uniqueItems' at #, which xgrammar cannot enforce"),
    "bad regex": ({"regex": "[0-9"}, "field 'regex' is not a regex xgrammar can compile: Regex parsing error at position 5: Unclosed '['"),
    "empty choice list": ({"choice": []}, "field 'choice' must be a non-empty list of strings, got []; give the allowed outputs"),
    "two constraints": ({"regex": DATE, "choice": ["a"]}, "fields 'regex' and 'choice' both set a structured outputs constraint; give one per row"),
}  # fmt: skip
SLOW_REGEX = "[a-z]{3000}"  # about 0.4 s to compile on a 2-core Zen 4, far over the 0.05 s limit below


def mixed_rows() -> list[dict]:
    rows = [
        {"id": "json", "prompt": "Is the sky blue? Answer in JSON.", "json_schema": SCHEMA},
        {"id": "date", "prompt": "When did it happen?", "regex": DATE},
        {"id": "pick", "prompt": "Yes or no?", "choice": ["yes", "no"]},
        {"id": "gram", "prompt": "A word:", "grammar": 'root ::= "w" [a-z] [a-z]'},
        {"id": "free", "prompt": "Say anything."},
    ]
    rows += [{"id": kind, "prompt": "p", **fields} for kind, (fields, _) in BAD_KINDS.items()]
    return rows + [{"id": "slow", "prompt": "p", "regex": SLOW_REGEX}]


def check(so: StructuredOutputsParams, tokenizer, row: dict) -> None:
    """A finished structured row's text fits its constraint: the library's matcher accepts it
    whole (and, for "stop" rows, is complete); JSON rows parse."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    compiler = xgr.GrammarCompiler(info)
    from batchgen.engine.structured_check import library_grammar

    method, text = library_grammar(so)
    compiled = (
        compiler.compile_json_schema(text, any_whitespace=False)
        if method == "json_schema"
        else compiler.compile_regex(text)
        if method == "regex"
        else compiler.compile_grammar(text)
    )
    m = xgr.GrammarMatcher(compiled)
    assert m.accept_string(row["output"]), row
    if row["finish_reason"] == "stop":
        assert m.is_completed(), row


def test_each_bad_input_kind_is_an_error_row_and_the_rest_run(tmp_path, tiny):
    """One job: good structured rows of every kind, a free row, and one row of each bad kind (and a
    constraint over the compile time limit): each bad one is an error row naming its row, field,
    what is wrong and the fix; every other row finishes; exit 0."""
    src = write_jsonl(tmp_path / "mixed.jsonl", mixed_rows())
    out = tmp_path / "mixed.out.parquet"
    result = invoke(str(src), "--output", str(out), *engine_args(tiny, "--grammar-compile-timeout", "0.05"))
    assert result.exit_code == 0, result.output
    rows = {r["id"]: r for r in output_rows(out)}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    for rid, so in [
        ("json", StructuredOutputsParams(json=SCHEMA)),
        ("date", StructuredOutputsParams(regex=DATE)),
        ("pick", StructuredOutputsParams(choice=["yes", "no"])),
        ("gram", StructuredOutputsParams(grammar='root ::= "w" [a-z] [a-z]')),
    ]:
        assert rows[rid]["finish_reason"] in ("stop", "length") and rows[rid]["error"] is None, rows[rid]
        check(so, tokenizer, rows[rid])
    assert rows["pick"]["output"] in ("yes", "no") and rows["pick"]["finish_reason"] == "stop"
    assert rows["free"]["finish_reason"] in ("stop", "length")
    for i, (kind, (_, message)) in enumerate(BAD_KINDS.items(), start=5):
        assert rows[kind]["finish_reason"] == "error"
        assert rows[kind]["error"].startswith(f"row {i} (line {i + 1}): {message}"), rows[kind]["error"]
    slow = rows["slow"]
    assert slow["finish_reason"] == "error"
    assert slow["error"].startswith(
        "row 10 (line 11): field 'regex' did not compile within the time limit of 0.05 s"
    )
    assert slow["error"].endswith("raise grammar_compile_timeout (flag --grammar-compile-timeout)")


def test_strict_finds_the_bad_rows_before_model_work(tmp_path):
    """--strict lists every bad constraint (all but the time limit, which needs the model's
    tokenizer) and exits 2 before any model is loaded."""
    src = write_jsonl(tmp_path / "mixed.jsonl", mixed_rows())
    result = invoke(str(src), "--strict", "--model", "/nonexistent/model")
    assert result.exit_code == 2
    assert f"--strict: {len(BAD_KINDS)} invalid row(s)" in result.output
    for i, (_, message) in enumerate(BAD_KINDS.values(), start=5):
        assert f"row {i} (line {i + 1}): {message[:60]}" in " ".join(result.output.split())


def test_job_flags_apply_to_rows_without_their_own(tmp_path, tiny):
    """--json-schema FILE applies to every row without a constraint column; a row's own column
    wins; a bad flag (unreadable, not JSON, not compilable, two of them) fails the command (exit 2)."""
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    src = write_jsonl(
        tmp_path / "a.jsonl",
        [
            {"prompt": "Is it raining?"},
            {"prompt": "Pick one", "choice": ["red", "blue"]},
            {"prompt": "And now?"},
        ],
    )
    out = tmp_path / "a.out.parquet"
    result = invoke(str(src), "--output", str(out), "--json-schema", str(schema_file), *engine_args(tiny))
    assert result.exit_code == 0, result.output
    first, pick, last = output_rows(out)
    for row in (first, last):
        if row["finish_reason"] == "stop":
            assert set(json.loads(row["output"])) == {"answer", "n"}
        assert row["output"].startswith('{"answer": "')
    assert pick["output"] in ("red", "blue")
    bad_schema = tmp_path / "bad.json"
    bad_schema.write_text('{"type": "object", "not": {}}')
    empty = tmp_path / "empty.gbnf"
    empty.write_text("\n")
    for args, message in [
        (["--json-schema", str(tmp_path / "missing.json")], "cannot read"),
        (["--json-schema", str(src)], "is not JSON"),
        (["--json-schema", str(bad_schema)], "--json-schema uses keyword 'not' at #"),
        (["--regex", "a", "--choice", "x,y"], "give one of --json-schema, --regex, --choice, --grammar"),
        (["--choice", ","], "the choice list is empty"),
        (["--choice", "a,,b"], "an empty choice in 'a,,b'"),
        (["--regex", ""], "the regex is empty"),
        (["--grammar", str(empty)], "is empty; give an EBNF (GBNF) grammar file"),
    ]:
        result = invoke(
            str(src), "--output", str(tmp_path / "x.parquet"), "--model", "/nonexistent/model", *args
        )
        assert result.exit_code == 2 and message in " ".join(result.output.split()), (args, result.output)


def test_openai_batch_response_format(tmp_path, tiny):
    """OpenAI batch lines: response_format json_schema and json_object constrain the answer in
    message.content; {"type": "text"} is no constraint; vLLM's structured_outputs applies."""
    messages = [{"role": "user", "content": "Is water wet? Reply in JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}}
    bodies = {
        "schema": {"messages": messages, "max_tokens": 24, "response_format": fmt},
        "object": {"messages": messages, "max_tokens": 24, "response_format": {"type": "json_object"}},
        "text": {"messages": messages, "max_tokens": 4, "response_format": {"type": "text"}},
        "vllm": {"messages": messages, "max_tokens": 8, "structured_outputs": {"choice": ["wet", "dry"]}},
    }
    src = tmp_path / "batch.jsonl"
    src.write_text(
        "".join(
            json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})
            + "\n"
            for cid, body in bodies.items()
        )
    )
    result = invoke(str(src), *engine_args(tiny))
    assert result.exit_code == 0, result.output
    lines = {
        r["custom_id"]: r["response"]["body"]["choices"][0]
        for r in map(json.loads, (tmp_path / "batch.out.jsonl").read_text().splitlines())
    }
    schema = lines["schema"]
    assert schema["message"]["content"].startswith('{"answer": "')
    if schema["finish_reason"] == "stop":
        assert set(json.loads(schema["message"]["content"])) == {"answer", "n"}
    assert lines["object"]["message"]["content"].startswith("{")
    assert lines["vllm"]["message"]["content"] in ("wet", "dry") and lines["vllm"]["finish_reason"] == "stop"
    assert lines["text"]["finish_reason"] in ("stop", "length")


def test_the_window_starts_compiling_before_admission(tmp_path):
    """Each structured row's constraint is handed to the engine (`Engine.prepare`) as the row enters
    the look-ahead window, before the row is admitted."""
    from batchgen.jobs.runner import JobOptions, run_job

    engines = []

    def factory(config):
        engine = fake_factory()(config)
        engines.append(engine)
        return engine

    rows = [{"prompt": f"p{i}", "regex": f"[a-z]{{{i + 1}}}"} for i in range(6)] + [{"prompt": "free"}]
    src = write_jsonl(tmp_path / "a.jsonl", rows)
    run_job(JobOptions(str(src), max_tokens=4, engine={"max_num_seqs": 1}), factory, dashboard=quiet())
    (engine,) = engines
    assert [p.structured_outputs.regex for p in engine.prepared] == [f"[a-z]{{{i + 1}}}" for i in range(6)]


def test_counts_in_the_log_the_summary_and_prometheus(tmp_path, tiny):
    """Four structured rows with two distinct constraints and two free rows: the line after the
    first window, the summary, the dashboard's line and the Prometheus textfile count 4 structured
    rows and 2 compilations; the masks took some time."""
    import io

    import rich.console

    from batchgen.dashboard import Dashboard
    from batchgen.jobs.runner import JobOptions, run_job
    from batchgen.metrics import MetricsOptions
    from tests.jobs.test_metrics import P, samples

    rows = [
        {"prompt": "a", "choice": ["x", "y"]},
        {"prompt": "b"},
        {"prompt": "c", "regex": DATE},
        {"prompt": "d", "choice": ["x", "y"]},
        {"prompt": "e", "regex": DATE},
        {"prompt": "f"},
    ]
    src, prom = write_jsonl(tmp_path / "a.jsonl", rows), tmp_path / "job.prom"
    stream = io.StringIO()
    dashboard = Dashboard(None, live=False, stream=stream, console=rich.console.Console(file=stream))
    options = JobOptions(
        str(src),
        max_tokens=12,
        engine={"model": str(tiny), "kv_cache_memory": "64MiB"},
        metrics=MetricsOptions(file=str(prom)),
    )
    summary = run_job(options, dashboard=dashboard)
    assert (summary.structured_rows, summary.grammars_compiled) == (4, 2)
    log = stream.getvalue()
    assert "structured outputs: 4 of the first 6 rows read ask for a constraint, 2 distinct" in log
    assert "structured outputs: 4 rows, 2 distinct constraints compiled in " in log
    assert "| structured 4 rows, 2 grammars compiled in " in log
    final = samples(prom.read_text())
    assert final[P + "structured_requests_total"] == 4
    assert final[P + "grammar_compile_seconds_count"] == 2
    assert final[P + "grammar_compile_seconds_sum"] == pytest.approx(summary.grammar_compile_s)
    assert final[P + "structured_mask_seconds_total"] > 0


XSUM = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "xsum" / "test.jsonl"
ARTICLE_SCHEMA = {
    "type": "object",
    "properties": {
        "headline": {"type": "string", "maxLength": 80},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "topic": {"enum": ["politics", "sport", "business", "science", "crime", "other"]},
        "people": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4},
        "place": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "country": {"type": "string", "maxLength": 30},
            },
            "required": ["city", "country"],
            "additionalProperties": False,
        },
    },
    "required": ["headline", "year", "topic", "people", "place"],
    "additionalProperties": False,
}
TOPICS = ["politics", "sport", "business", "science", "crime", "other"]
# A small EBNF grammar: a labelled line, a topic word and a score from 1 to 5.
RATING_GRAMMAR = (
    'root ::= "Topic: " topic "; importance: " [1-5]\ntopic ::= "news" | "sport" | "money" | "other"'
)
RATING = r"Topic: (news|sport|money|other); importance: [1-5]"


@pytest.mark.slow
def test_default_model_on_xsum_rows_every_stop_row_validates(tmp_path, default_model_dir):
    """The default model on 40 XSum articles: 16 rows extract JSON (required string, integer and
    enum fields, an array, a nested object, additionalProperties false), 8 give an ISO date, 8 pick
    a topic from a list, 8 follow a small EBNF grammar. Every "stop" row validates (`jsonschema`
    for JSON); every row ends "stop" or "length"."""
    import re

    import jsonschema

    if not XSUM.exists():
        pytest.skip(f"shared data not found at {XSUM} (needs the ../shared/data folder beside the repo)")
    docs = [json.loads(line)["document"][:1200] for line in XSUM.read_text().splitlines()[:40]]
    rows = []
    for i, doc in enumerate(docs):
        if i % 5 < 2:
            rows.append(
                {
                    "id": f"json{i}",
                    "prompt": f"Extract the facts of this article as JSON.\n\n{doc}",
                    "json_schema": ARTICLE_SCHEMA,
                }
            )
        elif i % 5 == 2:
            rows.append(
                {
                    "id": f"date{i}",
                    "prompt": f"{doc}\n\nOn what date (YYYY-MM-DD) did this happen?",
                    "regex": DATE,
                }
            )
        elif i % 5 == 3:
            rows.append(
                {
                    "id": f"topic{i}",
                    "prompt": f"{doc}\n\nWhich topic is this article about?",
                    "choice": TOPICS,
                }
            )
        else:
            rows.append(
                {"id": f"rate{i}", "prompt": f"{doc}\n\nRate this article.", "grammar": RATING_GRAMMAR}
            )
    src = write_jsonl(tmp_path / "xsum.jsonl", rows)
    out = tmp_path / "xsum.out.parquet"
    from batchgen.jobs.runner import JobOptions, run_job

    summary = run_job(JobOptions(str(src), output=str(out), max_tokens=160), dashboard=quiet())
    assert summary.complete and summary.rows_error == 0 and summary.structured_rows == 40
    got = {r["id"]: r for r in output_rows(out)}
    stops = {"json": 0, "date": 0, "topic": 0, "rate": 0}
    for rid, row in got.items():
        kind = re.sub(r"\d+", "", rid)
        assert row["finish_reason"] in ("stop", "length"), row
        if row["finish_reason"] != "stop":
            continue
        stops[kind] += 1
        text = row["output"]
        if kind == "json":
            jsonschema.validate(json.loads(text), ARTICLE_SCHEMA)
        elif kind == "date":
            assert re.fullmatch(DATE, text), text
        elif kind == "topic":
            assert text in TOPICS
        else:
            assert re.fullmatch(RATING, text), text
    # Choice lists, dates and the grammar are short: they always complete within max_tokens.
    assert stops["date"] == stops["topic"] == stops["rate"] == 8
    assert stops["json"] >= 8, stops  # most extractions complete too (the rest hit max_tokens)


@pytest.mark.slow
def test_sigkill_then_resume_gives_the_uninterrupted_rows(tmp_path, tiny):
    """A structured job killed (SIGKILL) after some rows were committed and run again ends with
    exactly the rows of an uninterrupted run (greedy, float32): committed rows are kept, the others
    run again from their start with new matchers; every "stop" row still fits its constraint."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.jobs.test_kill_resume import committed_parts

    constraints = [{"json_schema": SCHEMA}, {"regex": DATE}, {"choice": ["yes", "no", "maybe"]}]
    rows = [{"id": f"r{i}", "prompt": f"Question {i}: is it so?", **constraints[i % 3]} for i in range(18)]
    src = write_jsonl(tmp_path / "job.jsonl", rows)
    repo = Path(__file__).resolve().parents[2]

    def command(out: Path) -> list[str]:
        return [sys.executable, "-m", "batchgen", "run", str(src), "--output", str(out)] + engine_args(
            tiny, "--dtype", "float32", "--max-num-seqs", "2", "--commit-every", "2", "--num-threads", "1"
        )

    ref = tmp_path / "ref.parquet"
    assert subprocess.run(command(ref), cwd=repo, capture_output=True, timeout=300).returncode == 0
    out = tmp_path / "killed.parquet"
    proc = subprocess.Popen(command(out), cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while proc.poll() is None and committed_parts(out) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    resumed = subprocess.run(command(out), cwd=repo, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming: " in resumed.stdout + resumed.stderr
    keys = ["id", "output", "finish_reason", "completion_tokens", "error"]
    got, want = pq.read_table(out, columns=keys).to_pylist(), pq.read_table(ref, columns=keys).to_pylist()
    assert got == want
    for row in got:
        assert row["finish_reason"] in ("stop", "length")
        if row["finish_reason"] == "stop" and row["id"] in {f"r{i}" for i in range(0, 18, 3)}:
            assert set(json.loads(row["output"])) == {"answer", "n"}
