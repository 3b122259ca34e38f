"""`batchgen run` writes generated tokens' log probabilities: the `logprobs` / `cumulative_logprob`
columns of Parquet and JSONL outputs (from `--logprobs K`, a row's `logprobs` column, or OpenAI's
`logprobs` / `top_logprobs` fields) and OpenAI batch output's `choices[].logprobs`, equal to what
`LLM.generate` returns for the same request."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.jobs.input.reader import JobReader, ReaderOptions
from batchgen.sampling_params import SamplingParams

PROMPTS = ["List three fruits.", "What is the capital of Peru?", "Say hi.", "Count to five."]
MAX_TOKENS = 6
ENGINE = ["--max-num-seqs", "3", "--kv-cache-memory", "64MiB", "--dtype", "float32"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(tiny):
    """prompt, k -> (token ids, per-token {token_id: Logprob}, cumulative) of `LLM.generate`, one
    request alone, as a chat user turn (how `batchgen run` sends a plain prompt)."""
    from batchgen.llm import LLM

    llm = LLM(str(tiny), dtype="float32", kv_cache_memory="64MiB")
    cache = {}

    def get(prompt: str, k: int):
        if (prompt, k) not in cache:
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=k)
            (out,) = llm.chat([{"role": "user", "content": prompt}], params)
            c = out.outputs[0]
            cache[prompt, k] = (c.token_ids, c.logprobs, c.cumulative_logprob)
        return cache[prompt, k]

    return get


def run(*args: str) -> None:
    r = CliRunner().invoke(app, ["run", *args])
    assert r.exit_code == 0, r.output


def assert_matches(row_logprobs, cumulative, reference, k: int) -> None:
    """An output row's `logprobs` value is the reference request's, position by position."""
    ids, positions, ref_cumulative = reference
    assert [p["token_id"] for p in row_logprobs] == ids
    for p, ref in zip(row_logprobs, positions, strict=True):
        assert p["logprob"] == pytest.approx(ref[p["token_id"]].logprob, abs=1e-4)
        assert p["token"] == ref[p["token_id"]].decoded_token
        top = sorted((lp.rank, t, lp.logprob) for t, lp in ref.items() if lp.rank <= k)
        assert [a["token_id"] for a in p["top_logprobs"]] == [t for _, t, _ in top]
        assert [a["logprob"] for a in p["top_logprobs"]] == pytest.approx([v for *_, v in top], abs=1e-4)
        # most likely first, and greedy picks the most likely
        assert [a["logprob"] for a in p["top_logprobs"]] == sorted(
            (a["logprob"] for a in p["top_logprobs"]), reverse=True
        )
        if k:
            assert p["top_logprobs"][0]["token_id"] == p["token_id"]
    assert cumulative == pytest.approx(ref_cumulative, abs=1e-3)
    assert cumulative == pytest.approx(sum(p["logprob"] for p in row_logprobs), abs=1e-3)


def test_logprobs_flag_and_row_column_parquet(tmp_path, tiny, reference):
    """--logprobs 2 for every row; a row's own `logprobs` (vLLM's K, or chat style `true` with
    `top_logprobs`) wins."""
    rows = [
        {"prompt": PROMPTS[0]},
        {"prompt": PROMPTS[1], "logprobs": 4},
        {"prompt": PROMPTS[2], "logprobs": True, "top_logprobs": 1},
        {"prompt": PROMPTS[3], "logprobs": 0},
    ]
    src = tmp_path / "job.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run(str(src), "--model", str(tiny), "--max-tokens", str(MAX_TOKENS), "--logprobs", "2", *ENGINE)
    t = pq.read_table(tmp_path / "job.out.parquet")
    assert t.schema.names[-2:] == ["cumulative_logprob", "logprobs"]
    out = t.to_pylist()
    for row, k in zip(out, (2, 4, 1, 0), strict=True):
        assert (
            row["finish_reason"] == "length"
            and len(row["logprobs"]) == row["completion_tokens"] == MAX_TOKENS
        )
        assert all(len(p["top_logprobs"]) == k for p in row["logprobs"])
        assert_matches(row["logprobs"], row["cumulative_logprob"], reference(row_prompt(rows, row), k), k)


def row_prompt(rows, row) -> str:
    return rows[row["row_index"]]["prompt"]


def test_only_rows_that_ask_get_values_and_jobs_that_ask_nothing_keep_their_columns(
    tmp_path, tiny, reference
):
    src = tmp_path / "job.jsonl"
    src.write_text(
        json.dumps({"prompt": PROMPTS[0]}) + "\n" + json.dumps({"prompt": PROMPTS[1], "logprobs": 3}) + "\n"
    )
    out = tmp_path / "job.out.jsonl"
    run(str(src), "--model", str(tiny), "--max-tokens", str(MAX_TOKENS), "--output", str(out), *ENGINE)
    a, b = [json.loads(line) for line in out.read_text().splitlines()]
    assert a["logprobs"] is None and a["cumulative_logprob"] is None
    assert_matches(b["logprobs"], b["cumulative_logprob"], reference(PROMPTS[1], 3), 3)

    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n")
    run(str(plain), "--model", str(tiny), "--max-tokens", "2", *ENGINE)
    assert "logprobs" not in pq.read_table(tmp_path / "plain.out.parquet").schema.names


def test_openai_batch_output_logprobs(tmp_path, tiny, reference):
    chat = {"messages": [{"role": "user", "content": PROMPTS[0]}], "logprobs": True, "top_logprobs": 2}
    completion = {"prompt": PROMPTS[1], "logprobs": 1}
    lines = [
        {
            "custom_id": "c",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {**chat, "max_tokens": 5},
        },
        {
            "custom_id": "p",
            "method": "POST",
            "url": "/v1/completions",
            "body": {**completion, "max_tokens": 5},
        },
        {
            "custom_id": "n",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {**chat, "logprobs": False},
        },
    ]
    src = tmp_path / "batch.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run(str(src), "--model", str(tiny), *ENGINE)
    c, p, n = [json.loads(x) for x in (tmp_path / "batch.out.jsonl").read_text().splitlines()]
    assert (
        n["error"] is not None
        and "field 'body.top_logprobs' is 2 but field 'body.logprobs' is not true" in (n["error"]["message"])
    )

    ids, positions, _ = reference(PROMPTS[0], 2)
    content = c["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(content) == c["response"]["body"]["usage"]["completion_tokens"] == 5
    for entry, token_id, ref in zip(content, ids[:5], positions[:5], strict=True):
        assert entry["token"] == ref[token_id].decoded_token
        assert entry["bytes"] == list(entry["token"].encode("utf-8"))
        assert entry["logprob"] == pytest.approx(ref[token_id].logprob, abs=1e-4)
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["token"] == entry["token"]

    lp = p["response"]["body"]["choices"][0]["logprobs"]
    text = p["response"]["body"]["choices"][0]["text"]
    assert (
        len(lp["tokens"])
        == len(lp["token_logprobs"])
        == len(lp["top_logprobs"])
        == len(lp["text_offset"])
        == 5
    )
    assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]) == text
    assert all(lp["text_offset"][i + 1] - lp["text_offset"][i] == len(lp["tokens"][i]) for i in range(4))
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert value <= 0 and math.isfinite(value) and top[token] == value and 1 <= len(top) <= 2


def read(path: Path, **options) -> list:
    reader = JobReader(str(path), ReaderOptions(**options))
    return list(reader)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        (
            {"top_logprobs": 3},
            "field 'top_logprobs' is 3 but field 'logprobs' is not true; set logprobs to true",
        ),
        ({"logprobs": 2, "top_logprobs": 3}, "fields 'logprobs' (2) and 'top_logprobs' are both set"),
        (
            {"logprobs": True, "top_logprobs": 21},
            "field 'top_logprobs' is 21; it must be a whole number from 0 to 20",
        ),
        ({"logprobs": True, "top_logprobs": "3"}, "field 'top_logprobs' is \"3\"; it must be a whole number"),
        ({"logprobs": 21}, "field 'logprobs' is 21; it must be true, false, or a whole number from 0 to 20"),
        ({"logprobs": -1}, "field 'logprobs' is -1; it must be true, false, or a whole number"),
        ({"logprobs": "true"}, "field 'logprobs' is \"true\"; it must be true, false, or a whole number"),
        ({"logprobs": 2.5}, "field 'logprobs' is 2.5; it must be"),
        ({"logprobs": 1e30}, "field 'logprobs' is 1e+30; it must be"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be None or in [0, 20], got -1"),
    ],
)
def test_bad_logprob_fields_fail_their_row_and_name_the_fix(tmp_path, fields, error):
    src = tmp_path / "job.jsonl"
    src.write_text(json.dumps({"prompt": "p", **fields}) + "\n" + json.dumps({"prompt": "q"}) + "\n")
    bad, good = read(src)
    assert bad.sampling_params is None and error in bad.error and bad.error.startswith("row 0 (line 1): ")
    assert good.error is None and good.sampling_params.logprobs is None


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"logprobs": 3}, 3),
        ({"logprobs": 3.0}, 3),  # Parquet and pandas store integer columns with nulls as floats
        ({"logprobs": 0}, 0),
        ({"logprobs": True}, 0),
        ({"logprobs": True, "top_logprobs": 5}, 5),
        ({"logprobs": True, "top_logprobs": 5.0}, 5),
        ({"logprobs": False, "top_logprobs": 0}, None),
        ({"logprobs": False}, None),
        ({"logprobs": None}, None),
        ({"top_logprobs": 0}, None),
    ],
)
def test_logprob_fields_set_sampling_params(tmp_path, fields, expected):
    src = tmp_path / "job.jsonl"
    src.write_text(json.dumps({"prompt": "p", **fields}) + "\n")
    (row,) = read(src)
    assert row.error is None and row.sampling_params.logprobs == expected


def test_openai_chat_takes_a_boolean_and_completions_a_number(tmp_path):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    lines = [
        {"custom_id": "a", "url": "/v1/chat/completions", "body": {**chat, "logprobs": 3}},
        {
            "custom_id": "b",
            "url": "/v1/chat/completions",
            "body": {**chat, "logprobs": True, "top_logprobs": 3},
        },
        {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "p", "logprobs": 3}},
        {"custom_id": "d", "url": "/v1/completions", "body": {"prompt": "p", "logprobs": 0}},
        {"custom_id": "e", "url": "/v1/chat/completions", "body": {**chat, "prompt_logprobs": 1}},
        {"custom_id": "f", "url": "/v1/chat/completions", "body": {**chat, "logprobs": 0}},
    ]
    src = tmp_path / "batch.jsonl"
    src.write_text("".join(json.dumps({"method": "POST", **x}) + "\n" for x in lines))
    a, b, c, d, e, f = read(src)
    assert "field 'body.logprobs' is 3, but the chat API takes true or false there" in a.error
    assert [r.sampling_params.logprobs for r in (b, c, d)] == [3, 3, 0]
    assert e.error is None and e.sampling_params.prompt_logprobs == 1  # vLLM's extra field
    assert f.error is None and f.sampling_params.logprobs is None  # 0 is false


def test_logprobs_take_part_in_the_row_identity(tmp_path):
    """A row asking for log probabilities is another row than the same row asking for none (resume
    must not take one's committed output for the other's); a row asking for none keeps the hash it
    had before the option existed (`logprobs` is left out of the hashed parameters when unset)."""
    hashes = []
    for name, row in (
        ("a", {"prompt": "p"}),
        ("b", {"prompt": "p", "logprobs": None}),
        ("c", {"prompt": "p", "logprobs": 1}),
    ):
        src = tmp_path / f"{name}.jsonl"
        src.write_text(json.dumps(row) + "\n")
        (r,) = read(src)
        hashes.append(r.row_hash)
        if name == "a":
            assert "logprobs" not in r.sampling_params.to_dict()
    assert hashes[0] == hashes[1] != hashes[2]


def test_a_crashed_job_resumes_with_the_same_logprobs(tmp_path, tiny):
    """Rows committed before a crash keep their log probabilities through the final assembly, and
    the rows run after the resume get the values an uninterrupted run gives them."""
    from batchgen.jobs.runner import JobOptions, run_job
    from tests.jobs.real_engine import crashing_factory, quiet

    src = tmp_path / "job.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"{p} ({i})"}) + "\n" for i, p in enumerate(PROMPTS * 2)))
    engine = {"model": str(tiny), "dtype": "float32", "max_num_seqs": 3, "kv_cache_memory": "64MiB"}

    def options(out: str) -> JobOptions:
        return JobOptions(
            str(src), output=out, engine=engine, max_tokens=MAX_TOKENS, logprobs=2, commit_rows=2
        )

    reference = tmp_path / "reference.parquet"
    run_job(options(str(reference)), dashboard=quiet())
    out = tmp_path / "resumed.parquet"
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_job(options(str(out)), crashing_factory(10), dashboard=quiet())
    assert list(Path(str(out) + ".parts").glob("part-*.parquet"))  # some rows were committed
    summary = run_job(options(str(out)), dashboard=quiet())
    assert summary.complete and 0 < summary.rows_resumed < 8
    expected, got = pq.read_table(reference).to_pylist(), pq.read_table(out).to_pylist()
    for a, b in zip(expected, got, strict=True):
        assert [p["token_id"] for p in a["logprobs"]] == [p["token_id"] for p in b["logprobs"]]
        assert [p["logprob"] for p in a["logprobs"]] == pytest.approx(
            [p["logprob"] for p in b["logprobs"]], abs=1e-4
        )
        assert [[t["token_id"] for t in p["top_logprobs"]] for p in a["logprobs"]] == [
            [t["token_id"] for t in p["top_logprobs"]] for p in b["logprobs"]
        ]


def test_parts_without_logprob_columns_are_read_as_nulls(tmp_path):
    """A part written before the columns existed (an older batchgen) joins a final output that has
    them: its rows get nulls."""
    import pyarrow as pa

    from batchgen.jobs.output.final_output import finalize_output
    from batchgen.jobs.output.header import make_header
    from batchgen.jobs.output.resume import prepare_output
    from batchgen.jobs.output.schema import OUTPUT_SCHEMA
    from batchgen.jobs.output.writer import PartWriter

    header = make_header({"path": "/x", "size": 1}, "tiny", {"sampling": {"logprobs": 1}})
    out = str(tmp_path / "o.parquet")
    state = prepare_output(out, header, overwrite=False)
    writer = PartWriter(state, commit_rows=10)
    base = {
        "finish_reason": "length",
        "prompt_tokens": 3,
        "completion_tokens": 1,
        "endpoint": None,
        "created": 1,
    }
    position = {
        "token_id": 7,
        "token": "x",
        "bytes": b"x",
        "logprob": -0.5,
        "top_logprobs": [{"token_id": 7, "token": "x", "bytes": b"x", "logprob": -0.5}],
    }
    writer.add(
        {
            "row_index": 1,
            "id": "1",
            "output": "x",
            "row_hash": 11,
            **base,
            "logprobs": [position],
            "cumulative_logprob": -0.5,
        }
    )
    writer.commit()
    old = pa.table({"row_index": [0], "id": ["0"], "output": ["y"], "finish_reason": ["length"], "prompt_tokens": [3],
                    "completion_tokens": [1], "error": pa.nulls(1, pa.string()), "ttft_s": [0.1], "latency_s": [0.2],
                    "row_hash": [5], "endpoint": pa.nulls(1, pa.string()), "created": [1]})  # fmt: skip
    old_part = os.path.join(state.parts_dir, "part-000001.parquet")
    pq.write_table(old, old_part)
    from batchgen.jobs.output.manifest import PartEntry

    entry = PartEntry("part-000001.parquet", 1, 0, 0)
    state.manifest.append(entry)
    state.entries.append(entry)
    finalize_output(state, 2, "parquet", header)
    t = pq.read_table(out)
    assert t.schema.names == [*OUTPUT_SCHEMA.names, "cumulative_logprob", "logprobs"]
    assert t["cumulative_logprob"].to_pylist() == [None, -0.5]
    assert t["logprobs"].to_pylist() == [None, [position]]


def test_false_opts_a_row_out_of_the_flag_and_null_takes_it(tmp_path):
    rows = [{"prompt": "a", "logprobs": False}, {"prompt": "b", "logprobs": None}, {"prompt": "c"}]
    src = tmp_path / "job.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    off, null, absent = read(src, defaults={"max_tokens": 4, "logprobs": 3})
    assert off.sampling_params.logprobs is None
    assert null.sampling_params.logprobs == absent.sampling_params.logprobs == 3


def test_a_kept_column_named_logprobs_is_data_and_the_job_writes_none(tmp_path, tiny):
    """`--keep-columns logprobs` keeps an input column of that name as data, as before batchgen wrote
    log probabilities: its rows ask for none, the output has the kept column once; with --logprobs
    the two would collide, which is refused before any work."""
    src = tmp_path / "keep.jsonl"
    src.write_text(
        json.dumps({"prompt": "a", "logprobs": "high"})
        + "\n"
        + json.dumps({"prompt": "b", "logprobs": 3})
        + "\n"
    )
    (a, b) = read(src, keep_columns=("logprobs",))
    assert (
        a.error is None
        and b.error is None
        and a.sampling_params.logprobs is None is b.sampling_params.logprobs
    )
    run(str(src), "--model", str(tiny), "--max-tokens", "2", "--keep-columns", "logprobs", *ENGINE)
    t = pq.read_table(tmp_path / "keep.out.parquet")
    assert t.schema.names.count("logprobs") == 1 and "cumulative_logprob" not in t.schema.names
    assert t["logprobs"].to_pylist() == ["high", "3"]  # mixed types are kept as text
    r = CliRunner().invoke(
        app, ["run", str(src), "--keep-columns", "logprobs", "--logprobs", "2", "--model", "/nonexistent"]
    )
    assert r.exit_code == 2 and "--keep-columns logprobs and --logprobs" in r.output


def test_tokens_inside_a_character_have_their_bytes(tmp_path, default_model_dir):
    """A byte-level BPE token that holds part of a UTF-8 character (an emoji is split in two here)
    decodes alone as U+FFFD; the output gives its exact bytes and OpenAI's "bytes:\\xNN" name, so the
    tokens' bytes join into the text."""
    from transformers import AutoTokenizer

    from batchgen.jobs.output.json_lines import chat_logprobs, completion_logprobs
    from batchgen.jobs.output.token_bytes import TokenBytes
    from batchgen.jobs.requests import token_logprobs
    from batchgen.outputs import Logprob

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    text = " Hi 😀 é<|im_end|>"
    ids = tok.encode(text)
    positions = [{i: Logprob(-0.5, 1, tok.decode([i]))} for i in ids]
    entries = token_logprobs(ids, positions, 1, TokenBytes(tok))
    assert b"".join(e["bytes"] for e in entries) == text.encode()
    partial = [e for e in entries if e["token"].startswith("bytes:")]
    assert partial and all("\ufffd" not in e["token"] for e in entries)
    assert partial[0]["token"] == "bytes:" + "".join(f"\\x{b:02x}" for b in partial[0]["bytes"])
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in entries)
    chat = chat_logprobs(entries)["content"]
    assert bytes(sum((c["bytes"] for c in chat), [])).decode() == text
    offsets = completion_logprobs(entries)["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0 and max(offsets) <= len(text)
    assert offsets[-1] == text.index("<|im_end|>")
    # no tokenizer (or a token it does not know): the decoded text's UTF-8
    assert TokenBytes(None)(5, "é") == "é".encode()


def test_logprob_column_names_agree():
    from batchgen.jobs.output.schema import LOGPROB_COLUMNS, LOGPROB_SCHEMA

    assert tuple(LOGPROB_SCHEMA.names) == LOGPROB_COLUMNS == ("cumulative_logprob", "logprobs")


def test_text_offsets_follow_the_text_around_broken_characters():
    """Offsets count the characters of the text as it reads: half an emoji followed by its other half
    is one character; a character's first bytes followed by something else are the one U+FFFD the
    text shows for them."""
    from batchgen.jobs.output.json_lines import completion_logprobs

    def entry(data: bytes) -> dict:
        return {"token": "t", "bytes": data, "logprob": -1.0, "top_logprobs": []}

    split_emoji = [entry(b" \xf0\x9f"), entry(b"\x98\x80"), entry(b" b")]  # " 😀 b"
    assert completion_logprobs(split_emoji)["text_offset"] == [0, 1, 2]
    broken = [entry(b"\xf0\x9f"), entry(b"a"), entry(b" b")]  # "\ufffda b"
    assert b"".join(e["bytes"] for e in broken).decode("utf-8", "replace") == "\ufffda b"
    assert completion_logprobs(broken)["text_offset"] == [0, 1, 2]


def test_entries_committed_without_bytes_fall_back_to_their_text():
    """Parts committed by a batchgen that did not store `bytes` read them as null; the OpenAI output
    then uses the token's text (a resumed job finishes instead of failing at the final write)."""
    from batchgen.jobs.output.json_lines import chat_logprobs, completion_logprobs

    old = [
        {
            "token": "é",
            "bytes": None,
            "logprob": -0.1,
            "top_logprobs": [{"token": "é", "bytes": None, "logprob": -0.1}],
        }
    ]
    assert chat_logprobs(old)["content"][0]["bytes"] == list("é".encode())
    assert chat_logprobs(old)["content"][0]["top_logprobs"][0]["bytes"] == list("é".encode())
    assert completion_logprobs([*old, *old])["text_offset"] == [0, 1]


def test_many_buffered_logprob_entries_make_a_commit_due(tmp_path, monkeypatch):
    """Rows with long log-probability lists are committed by their entry count, not only every
    `commit_rows` rows, so the buffer's Python objects stay bounded."""
    from batchgen.jobs.output import writer as writer_module
    from batchgen.jobs.output.header import make_header
    from batchgen.jobs.output.resume import prepare_output

    monkeypatch.setattr(writer_module, "MAX_BUFFERED_LOGPROBS", 10)
    state = prepare_output(
        str(tmp_path / "o.parquet"), make_header({"path": "/x", "size": 1}, "t", {}), False
    )
    w = writer_module.PartWriter(state, commit_rows=1000, commit_seconds=3600)
    top = [{"token_id": 1, "token": "a", "bytes": b"a", "logprob": -0.1}]
    position = {"token_id": 1, "token": "a", "bytes": b"a", "logprob": -0.1, "top_logprobs": top}
    base = {"finish_reason": "length", "endpoint": None, "created": 1, "cumulative_logprob": -0.4}
    w.add({"row_index": 0, "id": "0", "row_hash": 1, **base, "logprobs": [position] * 4})  # 8 entries
    assert not w.due()
    w.add({"row_index": 1, "id": "1", "row_hash": 2, **base, "logprobs": [position] * 1})  # 10
    assert w.due()
    w.commit()
    assert not w.due() and w.pending == 0
