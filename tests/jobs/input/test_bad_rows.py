"""One of each bad row: an error row naming the row, line, field and fix; every other row unaffected."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchgen.dashboard import Dashboard
from batchgen.jobs.errors import JobInputError
from batchgen.jobs.options import flag_hint
from batchgen.jobs.runner import JobOptions, run_job
from tests.jobs.fake_engine import fake_factory

GOOD = [
    {"id": "g1", "prompt": "Name three colours."},
    {"id": "g2", "prompt": "Say hello in French.", "max_tokens": 3},
    {"id": "g3", "prompt": "Count to five."},
]
LONG = "word " * 200


def bad_lines() -> list[str]:
    """Job lines: good rows interleaved with one of each bad kind (expected error fragment in BAD)."""
    return [
        json.dumps(GOOD[0]),
        '{"id": "b1", "prompt": "unterminated',
        json.dumps({"id": "b2", "prompt": None}),
        json.dumps({"id": "b3", "prompt": ""}),
        json.dumps(GOOD[1]),
        json.dumps({"id": "b4", "prompt": LONG}),
        json.dumps({"id": "b5", "prompt": "ok", "temperature": -1}),
        json.dumps({"id": "b6", "prompt": "ok", "top_p": "high"}),
        json.dumps(GOOD[2]),
    ]


BAD = {
    1: "row 1 (line 2): malformed JSON",
    2: "row 2 (line 3): field 'prompt' is null",
    3: "row 3 (line 4): field 'prompt' is empty",
    5: "row 5 (line 6): the prompt is",
    6: "row 6 (line 7): invalid sampling value in field 'temperature'",
    7: "row 7 (line 8): invalid sampling value in field 'top_p'",
}


def quiet() -> Dashboard:
    return Dashboard(None, live=False, stream=io.StringIO(), console=Console(file=io.StringIO()))


def run_lines(tmp_path: Path, name: str, lines: list[str], factory=None, **kw) -> list[dict]:
    src = tmp_path / f"{name}.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / f"{name}.out.parquet"
    run_job(JobOptions(str(src), output=str(out), max_tokens=8, **kw), factory, dashboard=quiet())
    return pq.read_table(out).to_pylist()


def check_bad_job(tmp_path: Path, factory_fn, **kw) -> None:
    rows = run_lines(tmp_path, "bad", bad_lines(), factory_fn(), **kw)
    clean = run_lines(tmp_path, "clean", [json.dumps(g) for g in GOOD], factory_fn(), **kw)
    assert len(rows) == 9 and [r["row_index"] for r in rows] == list(range(9))
    for i, fragment in BAD.items():
        r = rows[i]
        assert r["finish_reason"] == "error" and r["output"] is None, r
        assert r["error"].startswith(fragment), r["error"]
    assert "--truncate-prompt" in rows[5]["error"] and "max_model_len is 64" in rows[5]["error"]
    assert rows[5]["prompt_tokens"] > 64
    assert [rows[i]["id"] for i in (2, 5, 6)] == ["b2", "b4", "b5"]
    good = [rows[i] for i in (0, 4, 8)]
    keys = ("id", "output", "finish_reason", "prompt_tokens", "completion_tokens", "error")
    assert [{k: r[k] for k in keys} for r in good] == [{k: r[k] for k in keys} for r in clean]


def test_bad_rows_fake_engine(tmp_path):
    check_bad_job(tmp_path, fake_factory, engine={"max_model_len": 64})


def test_the_token_summary_counts_only_rows_that_ran(tmp_path):
    src = tmp_path / "mixed.jsonl"
    src.write_text("\n".join(bad_lines()) + "\n")
    summary = run_job(
        JobOptions(str(src), max_tokens=8, engine={"max_model_len": 64}), fake_factory(), dashboard=quiet()
    )
    rows = pq.read_table(tmp_path / "mixed.out.parquet").to_pylist()
    ran = [r for r in rows if r["finish_reason"] != "error"]
    assert rows[5]["prompt_tokens"] > 64  # the rejected long prompt keeps its count in its row
    assert summary.prompt_tokens == sum(r["prompt_tokens"] for r in ran)
    assert summary.completion_tokens == sum(r["completion_tokens"] for r in ran)


def test_bad_rows_tiny_model(tmp_path, tiny_model_dir):
    from batchgen.jobs.runner import default_engine_factory

    model = str(tiny_model_dir("llama"))
    check_bad_job(
        tmp_path,
        lambda: default_engine_factory,
        engine={"model": model, "max_model_len": 64, "dtype": "float32"},
    )


def test_duplicate_custom_id_is_an_error_row(tmp_path):
    def req(cid: str, text: str) -> str:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 4}
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})

    src = tmp_path / "batch.jsonl"
    src.write_text("\n".join([req("a", "one"), req("b", "two"), req("a", "three")]) + "\n")
    run_job(JobOptions(str(src)), fake_factory(), dashboard=quiet())
    lines = [json.loads(x) for x in (tmp_path / "batch.out.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["a", "b", "a"]
    assert lines[0]["error"] is None and lines[1]["error"] is None
    assert lines[2]["error"]["message"].startswith(
        "row 2 (line 3): duplicate custom_id 'a' (first used on line 1)"
    )
    assert lines[2]["response"]["status_code"] == 400


@pytest.mark.parametrize("side", ["left", "right"])
def test_truncate_prompt(tmp_path, side):
    rows = run_lines(
        tmp_path,
        side,
        [json.dumps({"prompt": "a" * 10 + "b" * 100})],
        fake_factory(),
        truncate_prompt=side,
        engine={"max_model_len": 64},
        chat_template=False,
    )
    (r,) = rows
    assert r["error"] is None and r["prompt_tokens"] == 64 - 8  # room kept for max_tokens


def test_a_chat_prompt_its_system_message_keeps_too_long_names_it(tmp_path, tiny_model_dir):
    """--truncate-prompt cannot fit a chat whose system message alone fills max_model_len: the error
    row names the system message (the row's, or --system-prompt where it came from there), its
    tokens and the fix; a row whose system message fits is cut and runs."""
    from batchgen.jobs.runner import default_engine_factory

    long_system = "Answer in the style of a very long preamble. " * 12
    lines = [
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": long_system},
                    {"role": "user", "content": "hi " * 90},
                ]
            }
        ),
        json.dumps({"messages": [{"role": "user", "content": "hello " * 90}]}),
    ]
    engine = {"model": str(tiny_model_dir("llama")), "max_model_len": 64, "dtype": "float32"}
    rows = run_lines(tmp_path, "sys", lines, default_engine_factory, truncate_prompt="right", engine=engine)
    assert rows[0]["finish_reason"] == "error"
    assert rows[0]["error"].startswith("row 0 (line 1): the chat prompt cannot be cut to 56 tokens")
    assert "its system message is " in rows[0]["error"]
    assert "shorten the row's system message or raise --max-model-len" in rows[0]["error"]
    assert rows[1]["error"] is None and rows[1]["prompt_tokens"] <= 56
    rows = run_lines(
        tmp_path,
        "flag",
        lines[1:],
        default_engine_factory,
        truncate_prompt="right",
        system_prompt=long_system,
        engine=engine,
    )
    assert "shorten --system-prompt or raise --max-model-len" in rows[0]["error"]


def test_strict_fails_before_model_work(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(bad_lines()) + "\n")
    factory = fake_factory()
    with pytest.raises(
        JobInputError, match=r"(?s)--strict: 5 invalid row\(s\).*row 1 \(line 2\): malformed JSON"
    ):
        run_job(JobOptions(str(src), strict=True), factory, dashboard=quiet())
    assert factory.engines == [] and not (tmp_path / "bad.out.parquet.parts").exists()


def test_unicode_and_seed_errors_are_rows_and_keep_columns_survive(tmp_path):
    """A lone surrogate (valid JSON, invalid Unicode) and a seed torch cannot take fail their row only;
    error rows keep their --keep-columns values so they can still be joined."""
    lines = [
        json.dumps({"id": "a", "prompt": "fine", "doc": "D0"}),
        '{"id": "b", "prompt": "\\u0000\\ud800 broken", "doc": "D1"}',
        json.dumps({"id": "c", "prompt": "fine", "doc": "D2", "seed": 2**64, "temperature": 1.0}),
        json.dumps({"id": "d", "prompt": "", "doc": "D3"}),
        '{"id": "\\udfff", "prompt": "fine", "doc": "D4"}',
        json.dumps({"id": "f", "prompt": "fine too", "doc": "D5"}),
    ]
    rows = run_lines(tmp_path, "uni", lines, fake_factory(), keep_columns=("doc",))
    assert [r["doc"] for r in rows] == [f"D{i}" for i in range(6)]
    assert [r["finish_reason"] == "error" for r in rows] == [False, True, True, True, True, False]
    assert rows[1]["error"].startswith("row 1 (line 2): field 'prompt' holds a lone surrogate")
    assert rows[2]["error"].startswith("row 2 (line 3): invalid sampling value in field 'seed'")
    assert rows[4]["error"].startswith("row 4 (line 5): the id holds a lone surrogate")
    assert rows[4]["id"] == "\\udfff"  # stored as a visible escape


@pytest.mark.parametrize("depth", [900, 5000])
def test_a_deeply_nested_line_fails_its_row_only(tmp_path, depth):
    """Python's JSON parser gives up past about 1,000 levels (RecursionError, not ValueError): that
    line is an error row; lines that parse still run (a kept one, or one with a bad field too)."""
    nested = "[" * depth + "]" * depth
    lines = [
        json.dumps({"id": "a", "prompt": "x", "doc": [1]}),
        '{"id": "deep", "prompt": "x", "doc": ' + nested + "}",
        '{"id": "deep2", "prompt": "x", "temperature": "hot", "doc": ' + nested + "}",
        json.dumps({"id": "b", "prompt": "x"}),
    ]
    rows = run_lines(tmp_path, f"deep{depth}", lines, fake_factory(), keep_columns=("doc",))
    assert [r["id"] for r in rows][0] == "a" and rows[-1]["id"] == "b"
    assert rows[0]["finish_reason"] == rows[-1]["finish_reason"] == "length"
    assert rows[2]["finish_reason"] == "error"
    deep_error = "too deeply to read" if depth > 1000 else "more than 100 levels deep"
    assert rows[1]["finish_reason"] == "error" and deep_error in rows[1]["error"]
    assert rows[1]["error"].startswith("row 1 (line 2): the line nests JSON")


def test_kept_integers_beyond_int64_do_not_stop_the_job(tmp_path):
    """uint64 ids and hashes are common: a kept column holding one (alone in its part, or beside
    small ones, or beyond uint64 too) is written, never an OverflowError that fails the job."""
    big = 12345678901234567890
    lines = [
        json.dumps({"id": "a", "prompt": "x", "hash": big}),
        json.dumps({"id": "b", "prompt": "x", "hash": 5}),
        json.dumps({"id": "c", "prompt": "x", "hash": 2**70}),
        json.dumps({"id": "d", "prompt": "x", "hash": -3}),
    ]
    for commit_rows in (1, 100):  # a part per row, and one part for all
        rows = run_lines(
            tmp_path,
            f"u64_{commit_rows}",
            lines,
            fake_factory(),
            keep_columns=("hash",),
            commit_rows=commit_rows,
        )
        assert [r["finish_reason"] for r in rows] == ["length"] * 4
        assert [str(r["hash"]) for r in rows] == [str(big), "5", str(2**70), "-3"]


def test_openai_lines_without_a_usable_custom_id_get_none(tmp_path):
    """A made-up custom_id (the row index) could equal a real one: such error lines get null."""

    def req(cid, **body) -> str:
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})

    lines = [
        req("1", max_completion_tokens=None, max_tokens=3),
        '{"custom_id": "2", oops',
        req(7),
        req("4", max_completion_tokens=2, max_tokens=5),
    ]
    src = tmp_path / "oa.jsonl"
    src.write_text("\n".join(lines) + "\n")
    run_job(JobOptions(str(src), max_tokens=8), fake_factory(), dashboard=quiet())
    out = [json.loads(x) for x in (tmp_path / "oa.out.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in out] == ["1", None, None, "4"]
    assert [x["response"]["status_code"] for x in out] == [200, 400, 400, 200]
    # max_completion_tokens wins when set; a null one leaves max_tokens in force.
    assert [out[i]["response"]["body"]["usage"]["completion_tokens"] for i in (0, 3)] == [3, 2]


def test_an_unparsable_template_is_a_usage_error(tmp_path):
    src = tmp_path / "t.jsonl"
    src.write_text(json.dumps({"document": "x"}) + "\n")
    with pytest.raises(JobInputError, match=r"--template '\{document' is not a valid template"):
        run_job(JobOptions(str(src), template="{document"), fake_factory(), dashboard=quiet())


def test_a_typo_in_the_first_openai_line_is_pointed_out(tmp_path):
    good = {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}}
    first = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "bdy": {"messages": []}}
    src = tmp_path / "oa.jsonl"
    src.write_text(json.dumps(first) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(JobInputError, match=r"no prompt column .* looks like an OpenAI batch file.*'body'"):
        run_job(JobOptions(str(src)), fake_factory(), dashboard=quiet())


def test_engine_option_errors_name_the_flag(tmp_path):
    src = tmp_path / "j.jsonl"
    src.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(JobInputError, match=r"max_model_len must be >= 2.*\(flag --max-model-len\)"):
        run_job(JobOptions(str(src), engine={"max_model_len": 1}), fake_factory(), dashboard=quiet())
    # The engine's own message also says "model": the longer field name is the flag meant.
    message = "max_model_len 1000000000 exceeds the model's limit of 8192 tokens"
    assert flag_hint(message) == " (flag --max-model-len)"


def test_a_column_nearly_named_like_a_sampling_field_is_pointed_out(tmp_path):
    """`temprature` is kept as data (plain jobs keep unknown columns), so the row runs with the
    default temperature; the run says so once, naming the field it was probably meant to be."""
    src = tmp_path / "typo.jsonl"
    # Known fields are no one's near miss: max_completion_tokens applies, best_of fails its row.
    lines = [
        {"prompt": "a", "temprature": 0.5, "max_completion_tokens": 3},
        {"prompt": "b", "temprature": 0.7, "topic": "x", "best_of": 2, "presence_penalty": 0},
    ]
    src.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    stream = io.StringIO()
    dashboard = Dashboard(None, live=False, stream=stream, console=Console(file=io.StringIO()))
    run_job(JobOptions(str(src), max_tokens=4), fake_factory(), dashboard=dashboard)
    notes = [line for line in stream.getvalue().splitlines() if line.startswith("note: column")]
    assert notes == [
        "note: column 'temprature' is not a sampling field, so it is kept as data and changes nothing; "
        "did you mean 'temperature'?"
    ]
    rows = pq.read_table(tmp_path / "typo.out.parquet").to_pylist()
    assert rows[0]["finish_reason"] == "length" and rows[0]["completion_tokens"] == 3
    assert rows[1]["finish_reason"] == "error" and "best_of" in rows[1]["error"]


def test_flag_hints_name_options_not_plain_words():
    assert flag_hint("the KV cache holds 32 tokens; raise kv_cache_memory or lower max_model_len") == (
        " (flag --kv-cache-memory)"
    )
    assert flag_hint("dtype must be auto, float32, bfloat16 or float16") == " (flag --dtype)"
    assert flag_hint("shorten the prompt: 8192 tokens is the model's limit") == ""
