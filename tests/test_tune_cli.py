"""`batchgen tune`: the measured kernel table of a model on this machine, printed; bad options are
one-line errors (exit 2), as `run` and `bench` give them."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from batchgen.cli import app


def tune(*args: str):
    return CliRunner().invoke(app, ["tune", *args])


@pytest.mark.parametrize(
    "args, says",
    [
        (["--model", "/nonexistent/model"], "model directory not found: /nonexistent/model (flag --model)"),
        (["--dtype", "int8"], "dtype must be one of"),
        (["--kv-cache-memory", "1KiB"], "less than one KV block"),
        (["--num-threads", str((os.cpu_count() or 1) + 1)], "(flag --num-threads)"),
        (["--quantization", "nf4"], "quantization must be one of auto, none, int8; got 'nf4'"),
    ],
)
def test_bad_options_are_one_line_errors(tiny_model_dir, args, says):
    model = [] if args[0] == "--model" else ["--model", str(tiny_model_dir("llama"))]
    r = tune(*model, *args)
    assert r.exit_code == 2, r.output
    assert says in r.stderr and "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1


def test_prints_the_measured_table_and_a_second_call_measures_nothing(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    args = ["--model", str(tiny_model_dir("llama")), "--dtype", "float32", "--num-threads", "1", "--json"]
    first = tune(*args)
    assert first.exit_code == 0, first.output
    rows = [json.loads(line) for line in first.stdout.splitlines()]
    linears = [r for r in rows if r["op"] == "linear"]
    assert linears and all(r["chosen"] in r["ms"] for r in rows)
    assert all(r["ms"][r["chosen"]] == min(t for t in r["ms"].values() if t) for r in linears)
    second = tune(*args)
    assert second.exit_code == 0 and [json.loads(line) for line in second.stdout.splitlines()] == rows


def test_a_quantized_model_is_tuned_and_named(tiny_model_dir, tmp_path, monkeypatch):
    """`--quantization int8`: the title names it, and the decoder's linears are timed as int8 shapes."""
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    args = ["--model", str(tiny_model_dir("llama")), "--dtype", "float32", "--num-threads", "1"]
    result = CliRunner().invoke(app, ["tune", *args, "--quantization", "int8"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert "kernel choice (quantization int8 (9 linears" in result.stdout  # and the LM head
    assert "256x64/int8:float32" in result.stdout and "int8_c" in result.stdout
