"""`batchgen run` writes the prompt tokens' log probabilities: the `prompt_logprobs` column of Parquet
and JSONL outputs (from `--prompt-logprobs K` or a row's `prompt_logprobs`) and vLLM's
`prompt_logprobs` in OpenAI batch output, equal to Hugging Face's log-softmax of the prompt's logits,
kept through a crash and resume."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import transformers
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.jobs.input.reader import JobReader, ReaderOptions

PROMPTS = ["List three fruits.", "List three fruits and their colours.", "Say hi."]
# Chunks of 7 tokens and 4-token blocks with prefix caching on (the default): prompts are chunked,
# and the chat template's shared start is cached.
ENGINE = [
    "--dtype",
    "float32",
    "--kv-cache-memory",
    "64MiB",
    "--max-num-batched-tokens",
    "7",
    "--block-size",
    "4",
]
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def expected(tiny):
    """prompt -> (prompt token ids as `batchgen run` sends it, a chat user turn; HF's float32
    log-softmax of its logits `[P, vocab]`)."""
    from batchgen.llm import LLM

    llm = LLM(str(tiny), dtype="float32", kv_cache_memory="64MiB")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    cache = {}

    def get(prompt: str):
        if prompt not in cache:
            _, ids = llm.llm_engine.encode_prompt([{"role": "user", "content": prompt}])
            with torch.inference_mode():
                logits = model(torch.tensor([ids])).logits[0]
            cache[prompt] = ids, torch.log_softmax(logits.float(), dim=-1)
        return cache[prompt]

    return get


def run(*args: str) -> None:
    r = CliRunner().invoke(app, ["run", *args])
    assert r.exit_code == 0, r.output


def assert_column(value, ids: list[int], lsm: torch.Tensor, k: int) -> None:
    """A row's `prompt_logprobs` value: None first, then per prompt token its id, logprob and rank
    and the k most likely tokens (most likely first), as HF's log-softmax gives them."""
    assert value is not None and len(value) == len(ids) and value[0] is None
    for i in range(1, len(ids)):
        row, p = lsm[i - 1], value[i]
        assert p["token_id"] == ids[i]
        assert p["logprob"] == pytest.approx(row[ids[i]].item(), abs=TOL)
        v = row[ids[i]].item()
        assert int((row > v + TOL).sum()) + 1 <= p["rank"] <= int((row > v - TOL).sum()) + 1
        top = row.topk(k)
        assert [a["logprob"] for a in p["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=TOL)
        assert [row[a["token_id"]].item() for a in p["top_logprobs"]] == pytest.approx(
            [a["logprob"] for a in p["top_logprobs"]], abs=TOL
        )
        assert all(isinstance(a["token"], str) for a in [p, *p["top_logprobs"]])


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_flag_and_row_fields_write_the_column_parquet_and_jsonl(tmp_path, tiny, expected):
    """--prompt-logprobs 2 for every row; a row's own K wins, false opts a row out; the column is
    read back from Parquet and JSON lines alike (bytes as base64 there)."""
    src = write(
        tmp_path / "job.jsonl",
        [
            {"prompt": PROMPTS[0]},
            {"prompt": PROMPTS[1], "prompt_logprobs": 0},
            {"prompt": PROMPTS[2], "prompt_logprobs": False},
        ],
    )
    run(str(src), "--model", str(tiny), "--max-tokens", "3", "--prompt-logprobs", "2", *ENGINE)
    t = pq.read_table(tmp_path / "job.out.parquet")
    assert t.schema.names.index("prompt_logprobs") > t.schema.names.index("latency_s")
    a, b, c = t.to_pylist()
    assert_column(a["prompt_logprobs"], *expected(PROMPTS[0]), 2)
    assert_column(b["prompt_logprobs"], *expected(PROMPTS[1]), 0)
    assert c["prompt_logprobs"] is None and c["finish_reason"] == "length"
    assert b["prompt_tokens"] == len(b["prompt_logprobs"])
    assert all(
        p["bytes"] == p["token"].encode() for p in a["prompt_logprobs"][1:] if "\ufffd" not in p["token"]
    )

    out = tmp_path / "job.out.jsonl"
    run(
        str(src),
        "--model",
        str(tiny),
        "--max-tokens",
        "3",
        "--prompt-logprobs",
        "2",
        "--output",
        str(out),
        *ENGINE,
    )
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert_column(lines[0]["prompt_logprobs"], *expected(PROMPTS[0]), 2)
    assert lines[2]["prompt_logprobs"] is None
    first = lines[0]["prompt_logprobs"][1]
    assert base64.b64decode(first["bytes"]) == a["prompt_logprobs"][1]["bytes"]


def test_jobs_that_ask_nothing_keep_their_columns_and_row_identity(tmp_path, tiny):
    """No row asking: no column, and each row's hash is what it was before the field existed;
    a row asking is another row (resume never takes one's output for the other's)."""
    src = write(tmp_path / "plain.jsonl", [{"prompt": PROMPTS[0]}])
    run(str(src), "--model", str(tiny), "--max-tokens", "2", *ENGINE)
    t = pq.read_table(tmp_path / "plain.out.parquet")
    assert "prompt_logprobs" not in t.schema.names
    header = json.loads(t.schema.metadata[b"batchgen.header"])
    assert "prompt_logprobs" not in header["options"]["sampling"]
    hashes = []
    for name, row in (("a", {"prompt": "p"}), ("b", {"prompt": "p", "prompt_logprobs": None}),
                      ("c", {"prompt": "p", "prompt_logprobs": 0})):  # fmt: skip
        (r,) = JobReader(str(write(tmp_path / f"{name}.jsonl", [row])), ReaderOptions())
        hashes.append(r.row_hash)
    assert hashes[0] == hashes[1] != hashes[2]


def test_openai_batch_output_has_vllms_prompt_logprobs(tmp_path, tiny, expected):
    """vLLM's OpenAI server shape: {token id: {logprob, rank, decoded_token}} per prompt token
    after a leading null, in the body (chat) or in each choice (completions)."""
    chat = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 3, "prompt_logprobs": 1}
    lines = [
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "p", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi there", "max_tokens": 2, "prompt_logprobs": 0, "n": 2}},
        {"custom_id": "n", "method": "POST", "url": "/v1/chat/completions", "body": {**chat, "prompt_logprobs": None}},
    ]  # fmt: skip
    src = write(tmp_path / "batch.jsonl", lines)
    run(str(src), "--model", str(tiny), *ENGINE)
    c, p, n = [
        json.loads(x)["response"]["body"] for x in (tmp_path / "batch.out.jsonl").read_text().splitlines()
    ]
    ids, lsm = expected(PROMPTS[0])
    got = c["prompt_logprobs"]
    assert len(got) == len(ids) == c["usage"]["prompt_tokens"] and got[0] is None
    for i in range(1, len(ids)):
        entry = got[i]
        assert entry[str(ids[i])]["logprob"] == pytest.approx(lsm[i - 1, ids[i]].item(), abs=TOL)
        best = int(lsm[i - 1].argmax())
        assert entry[str(best)]["rank"] == 1 and len(entry) == (1 if ids[i] == best else 2)
    assert "prompt_logprobs" not in n
    completions = p["choices"]
    assert len(completions) == 2 and completions[0]["prompt_logprobs"] == completions[1]["prompt_logprobs"]
    scored = completions[0]["prompt_logprobs"]
    assert (
        scored[0] is None
        and all(len(e) == 1 for e in scored[1:])
        and len(scored) == p["usage"]["prompt_tokens"]
    )


def test_a_crashed_job_resumes_with_the_same_prompt_logprobs(tmp_path, tiny):
    """Rows committed before a crash keep their prompt log probabilities through the final
    assembly; the rows run after the resume get what an uninterrupted run gives them."""
    from batchgen.jobs.runner import JobOptions, run_job
    from tests.jobs.real_engine import crashing_factory, quiet

    src = write(tmp_path / "job.jsonl", [{"prompt": f"{p} ({i})"} for i, p in enumerate(PROMPTS * 3)])
    engine = {"model": str(tiny), "dtype": "float32", "kv_cache_memory": "64MiB", "max_num_batched_tokens": 7}

    def options(out: str) -> JobOptions:
        return JobOptions(str(src), output=out, engine=engine, max_tokens=3, prompt_logprobs=3, commit_rows=2)

    reference = tmp_path / "reference.parquet"
    run_job(options(str(reference)), dashboard=quiet())
    out = tmp_path / "resumed.parquet"
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_job(options(str(out)), crashing_factory(10), dashboard=quiet())
    assert list(Path(str(out) + ".parts").glob("part-*.parquet"))  # some rows were committed
    summary = run_job(options(str(out)), dashboard=quiet())
    assert summary.complete and 0 < summary.rows_resumed < 9
    for a, b in zip(pq.read_table(reference).to_pylist(), pq.read_table(out).to_pylist(), strict=True):
        assert a["prompt_logprobs"][0] is None is b["prompt_logprobs"][0]
        pa_, pb = a["prompt_logprobs"][1:], b["prompt_logprobs"][1:]
        assert [(p["token_id"], p["rank"]) for p in pa_] == [(p["token_id"], p["rank"]) for p in pb]
        assert [p["logprob"] for p in pa_] == pytest.approx([p["logprob"] for p in pb], abs=TOL)
        assert [[t["token_id"] for t in p["top_logprobs"]] for p in pa_] == [
            [t["token_id"] for t in p["top_logprobs"]] for p in pb
        ]


def test_a_kept_column_named_prompt_logprobs_is_data_and_the_job_writes_none(tmp_path, tiny):
    src = write(
        tmp_path / "keep.jsonl",
        [{"prompt": "a", "prompt_logprobs": "note"}, {"prompt": "b", "prompt_logprobs": 2}],
    )
    run(str(src), "--model", str(tiny), "--max-tokens", "2", "--keep-columns", "prompt_logprobs", *ENGINE)
    t = pq.read_table(tmp_path / "keep.out.parquet")
    assert t.schema.names.count("prompt_logprobs") == 1
    assert t["prompt_logprobs"].to_pylist() == ["note", "2"]  # mixed types are kept as text
    r = CliRunner().invoke(
        app, ["run", str(src), "--keep-columns", "prompt_logprobs", "--prompt-logprobs", "2", "--model", "/x"]
    )
    assert r.exit_code == 2 and "--keep-columns prompt_logprobs and --prompt-logprobs" in r.output
