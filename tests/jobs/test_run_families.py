"""`batchgen run` end to end on a tiny model of each family beyond Llama (and a sliding-window
Mistral): one output row per input row, greedy text equal to transformers' `generate` decoded."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import transformers
from typer.testing import CliRunner

from batchgen.cli import app
from tests.engine.test_fidelity import hf_greedy

PROMPTS = [
    "The quick brown fox jumps over the lazy dog because",
    "Paged attention stores the key and value cache in fixed-size blocks, so",
    "Hello",
]


@pytest.mark.parametrize("arch", ["mistral_window", "smollm3", "phi3", "gemma2", "gemma3"])
def test_run_writes_hf_greedy_text(tmp_path, tiny_model_dir, arch):
    model = tiny_model_dir(arch)
    src = tmp_path / "job.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    args = [
        "run",
        str(src),
        "--model",
        str(model),
        "--max-tokens",
        "12",
        "--temperature",
        "0",
        "--ignore-eos",
    ]
    result = CliRunner().invoke(
        app, [*args, "--kv-cache-memory", "16MiB", "--dtype", "float32", "--no-chat-template"]
    )
    assert result.exit_code == 0, result.output
    rows = pq.read_table(tmp_path / "job.out.parquet").to_pylist()
    tok = transformers.AutoTokenizer.from_pretrained(model)
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
    expected = hf_greedy(model, prompt_ids, 12, ignore_eos=True)
    assert [r["id"] for r in rows] == ["r0", "r1", "r2"]
    assert [r["error"] for r in rows] == [None] * 3
    assert [r["prompt_tokens"] for r in rows] == [len(ids) for ids in prompt_ids]
    assert [r["completion_tokens"] for r in rows] == [12] * 3
    assert [r["output"] for r in rows] == [tok.decode(ids, skip_special_tokens=True) for ids in expected]
