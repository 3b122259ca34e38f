"""`batchgen run` end to end on tiny mixture-of-experts models: every row written, float32 greedy text
equal to Hugging Face `generate`'s, and the default dtype and kernels (bf16, measured on CPU) run too."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch
import transformers
from typer.testing import CliRunner

from batchgen.cli import app

PROMPTS = [
    "Explain what a compiler does.",
    "List three fruits.",
    "Translate 'good morning' to Spanish.",
    "Summarise: the cat sat on the mat all afternoon.",
    "What is the capital of Peru?",
]
MAX_TOKENS = 8


def _hf_texts(path) -> list[str]:
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    texts = []
    for prompt in PROMPTS:
        # `batchgen run` sends a plain prompt as the chat template's user turn
        chat = [{"role": "user", "content": prompt}]
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
        with torch.inference_mode():
            seq = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
            )  # fmt: skip
        texts.append(tok.decode(seq[0, len(ids) :].tolist(), skip_special_tokens=True))
    return texts


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_run_moe_job(tmp_path, tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    src = tmp_path / "job.jsonl"
    src.write_text("\n".join(json.dumps({"id": f"r{i}", "prompt": p}) for i, p in enumerate(PROMPTS)) + "\n")
    common = ["--model", str(path), "--max-tokens", str(MAX_TOKENS), "--temperature", "0",
              "--max-num-seqs", "3", "--kv-cache-memory", "64MiB"]  # fmt: skip
    exact = tmp_path / "f32.parquet"
    r = CliRunner().invoke(app, ["run", str(src), "--output", str(exact), "--dtype", "float32", *common])
    assert r.exit_code == 0, r.output
    rows = pq.read_table(exact).to_pylist()
    assert [row["id"] for row in rows] == [f"r{i}" for i in range(len(PROMPTS))]
    assert all(row["error"] is None for row in rows)
    assert [row["output"] for row in rows] == _hf_texts(path)
    default = tmp_path / "default.parquet"
    r = CliRunner().invoke(app, ["run", str(src), "--output", str(default), *common])
    assert r.exit_code == 0, r.output
    rows = pq.read_table(default).to_pylist()
    assert len(rows) == len(PROMPTS)
    for row in rows:
        assert row["error"] is None and row["finish_reason"] in ("stop", "length")
        assert 1 <= row["completion_tokens"] <= MAX_TOKENS
