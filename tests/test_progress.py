"""Progress notes: a start says it measures kernels only when it does (a first start on a machine),
warnings reach the user, and nothing else logged at INFO does."""

from __future__ import annotations

import json
import logging

from typer.testing import CliRunner

from batchgen import progress
from batchgen.cli import app

MEASURING = "measuring this machine's kernels"


def test_only_progress_records_are_shown_and_only_inside_the_block() -> None:
    shown: list[str] = []
    logger = logging.getLogger("batchgen.some.module")
    with progress.shown(shown.append):
        logger.info("converting a.gguf", extra=progress.PROGRESS)
        logger.info("an ordinary INFO record")
        logger.warning("a cache file is damaged; quantizing again")  # a warning still reaches the user
    logger.info("after the block", extra=progress.PROGRESS)
    assert shown == ["converting a.gguf", "warning: a cache file is damaged; quantizing again"]
    assert logging.getLogger("batchgen").level == logging.NOTSET  # restored


def test_a_run_says_it_measures_kernels_on_its_first_start_only(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))  # no kernel table yet
    job = tmp_path / "job.jsonl"
    job.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(3)))
    args = ["--model", str(tiny_model_dir("llama")), "--max-tokens", "4", "--dtype", "float32",
            "--kv-cache-memory", "64MiB", "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]  # fmt: skip
    outputs = []
    for run in range(2):
        result = CliRunner().invoke(
            app, ["run", str(job), "--output", str(tmp_path / f"o{run}.parquet"), *args]
        )
        assert result.exit_code == 0, result.output
        outputs.append(result.stderr)
    first, second = outputs
    assert "[batchgen] loading " in first and "also measures its kernels" not in first
    assert f"[batchgen] {MEASURING}" in first and str(tmp_path / "cache") in first
    assert MEASURING not in second  # the table is cached: nothing is measured, nothing is said
