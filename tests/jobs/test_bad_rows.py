"""One of each bad row: an error row naming the row, line, field and fix; every other row unaffected."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchgen.dashboard import Dashboard
from batchgen.jobs.reader import JobInputError
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
    2: "row 2 (line 3): field 'prompt' is null or empty",
    3: "row 3 (line 4): field 'prompt' is null or empty",
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


def test_strict_fails_before_model_work(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(bad_lines()) + "\n")
    factory = fake_factory()
    with pytest.raises(
        JobInputError, match=r"(?s)--strict: 5 invalid row\(s\).*row 1 \(line 2\): malformed JSON"
    ):
        run_job(JobOptions(str(src), strict=True), factory, dashboard=quiet())
    assert factory.engines == [] and not (tmp_path / "bad.out.parquet.parts").exists()
