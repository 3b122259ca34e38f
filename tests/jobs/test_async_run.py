"""`batchgen run --async-scheduling`: the same rows as a synchronous run, with stop strings and
max_tokens ending rows at different steps, and with a row whose log probabilities make the steps
synchronous while it lives."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
from typer.testing import CliRunner

from batchgen.cli import app

ROWS = [
    {"id": "a", "prompt": "The quick brown fox jumps over the lazy dog because", "max_tokens": 20},
    {"id": "b", "prompt": "Paged attention stores the key and value cache in", "max_tokens": 7},
    {"id": "c", "prompt": "Hello", "max_tokens": 16, "stop": [" the", "."]},
    {"id": "d", "prompt": "1 2 3 4 5", "max_tokens": 11, "logprobs": 2},
    {"id": "e", "prompt": "Once upon a time", "max_tokens": 3},
]


def _run(tmp_path, model, name: str, *extra: str) -> list[dict]:
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    args = ["run", str(src), "--model", str(model), "--temperature", "0", "--dtype", "float32"]
    result = CliRunner().invoke(app, [*args, "--kv-cache-memory", "16MiB", "--no-chat-template", *extra])
    assert result.exit_code == 0, result.output
    rows = pq.read_table(tmp_path / f"{name}.out.parquet").to_pylist()
    keep = ("id", "output", "finish_reason", "completion_tokens", "error")
    return [{k: r[k] for k in keep} for r in rows]


def test_async_scheduling_writes_the_rows_of_a_synchronous_run(tmp_path, tiny_model_dir) -> None:
    model = tiny_model_dir("llama")
    want = _run(tmp_path, model, "sync")
    got = _run(tmp_path, model, "async", "--async-scheduling")
    assert got == want
    assert [r["id"] for r in got] == ["a", "b", "c", "d", "e"] and all(r["error"] is None for r in got)
    assert [r["completion_tokens"] for r in got if r["id"] in "abde"] == [20, 7, 11, 3]
