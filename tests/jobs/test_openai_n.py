"""`n` > 1: n completions of a row, equal to `LLM.chat`'s with the same SamplingParams, kept through a
crash and resume: in an OpenAI batch line's `choices`, and in the `choices` column of Parquet and
JSON-lines outputs (a plain job's `n` column or `--n`)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchgen.jobs.input.reader import JobReader, ReaderOptions
from batchgen.jobs.runner import JobOptions, run_job
from batchgen.sampling_params import SamplingParams
from tests.jobs.real_engine import crashing_factory, quiet

MESSAGES = [{"role": "user", "content": "Name a fruit."}]
ENGINE = {"dtype": "float32", "max_num_seqs": 4, "kv_cache_memory": "64MiB"}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


def batch_file(path: Path, lines: list[tuple[str, str, dict]]) -> Path:
    path.write_text(
        "".join(
            json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}) + "\n"
            for cid, url, body in lines
        )
    )
    return path


def test_n_completions_fill_choices(tmp_path, tiny):
    from batchgen.llm import LLM

    chat = {"messages": MESSAGES, "n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 5}
    completion = {
        "prompt": "Once upon a time",
        "n": 2,
        "temperature": 0.9,
        "seed": 3,
        "max_tokens": 4,
        "logprobs": 1,
    }
    src = batch_file(
        tmp_path / "batch.jsonl",
        [
            ("chat", "/v1/chat/completions", chat),
            ("completion", "/v1/completions", completion),
            ("one", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
        ],
    )
    summary = run_job(JobOptions(str(src), engine={"model": str(tiny), **ENGINE}), dashboard=quiet())
    assert summary.complete and summary.rows_ok == 3
    c, p, one = [json.loads(x) for x in (tmp_path / "batch.out.jsonl").read_text().splitlines()]

    llm = LLM(str(tiny), **ENGINE)
    (ref,) = llm.chat(MESSAGES, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=5))
    choices = c["response"]["body"]["choices"]
    assert [x["index"] for x in choices] == [0, 1, 2]
    assert [x["message"]["content"] for x in choices] == [o.text for o in ref.outputs]
    assert [x["finish_reason"] for x in choices] == [o.finish_reason for o in ref.outputs]
    assert c["response"]["body"]["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in ref.outputs)
    assert len({x["message"]["content"] for x in choices}) > 1  # seeds seed + i: different samples

    (ref_p,) = llm.generate(
        ["Once upon a time"], SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=4, logprobs=1)
    )
    choices = p["response"]["body"]["choices"]
    assert [x["text"] for x in choices] == [o.text for o in ref_p.outputs]
    for x, o in zip(choices, ref_p.outputs, strict=True):
        assert len(x["logprobs"]["tokens"]) == len(o.token_ids)
        assert x["logprobs"]["token_logprobs"] == pytest.approx(
            [o.logprobs[i][t].logprob for i, t in enumerate(o.token_ids)], abs=1e-4
        )
    assert len(one["response"]["body"]["choices"]) == 1


def test_openai_lines_with_n_into_parquet_fill_the_choices_column(tmp_path, tiny):
    """A Parquet output (one row a line) holds a line's n completions in its `choices` column."""
    src = batch_file(
        tmp_path / "batch.jsonl",
        [
            ("two", "/v1/chat/completions", {"messages": MESSAGES, "n": 2, "max_tokens": 3, "seed": 4}),
            ("one", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
        ],
    )
    out = tmp_path / "batch.parquet"
    run_job(JobOptions(str(src), output=str(out), engine={"model": str(tiny), **ENGINE}), dashboard=quiet())
    two, one = pq.read_table(out).to_pylist()
    assert two["error"] is None and len(two["choices"]) == 2 and two["choices"][0]["output"] == two["output"]
    assert sum(c["completion_tokens"] for c in two["choices"]) == two["completion_tokens"]
    assert [c["output"] for c in one["choices"]] == [one["output"]]


def plain_file(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_plain_jobs_n_column_gives_n_completions_in_choices(tmp_path, tiny):
    """vLLM's n in a plain job: the row's n completions, all in `choices` (the first also in
    `output`), equal to LLM.chat's with the same SamplingParams; rows without n get one."""
    from batchgen.llm import LLM

    src = plain_file(
        tmp_path / "job.jsonl",
        [
            {"id": "a", "messages": MESSAGES, "n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 5},
            {"id": "b", "messages": MESSAGES, "max_tokens": 2},
            {"id": "c", "messages": MESSAGES, "n": 0},
        ],
    )
    summary = run_job(JobOptions(str(src), engine={"model": str(tiny), **ENGINE}), dashboard=quiet())
    assert summary.complete and summary.rows_ok == 2 and summary.rows_error == 1
    a, b, c = pq.read_table(tmp_path / "job.out.parquet").to_pylist()
    llm = LLM(str(tiny), **ENGINE)
    (ref,) = llm.chat(MESSAGES, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=5))
    assert [x["output"] for x in a["choices"]] == [o.text for o in ref.outputs]
    assert [x["finish_reason"] for x in a["choices"]] == [o.finish_reason for o in ref.outputs]
    assert [x["completion_tokens"] for x in a["choices"]] == [len(o.token_ids) for o in ref.outputs]
    assert a["output"] == ref.outputs[0].text and a["completion_tokens"] == sum(
        len(o.token_ids) for o in ref.outputs
    )
    assert len(b["choices"]) == 1 and b["choices"][0]["output"] == b["output"]
    assert c["choices"] is None and "field 'n'" in c["error"] and "--keep-columns n" in c["error"]


def test_the_n_flag_applies_to_every_row_and_jsonl_output_lists_the_choices(tmp_path, tiny):
    src = plain_file(tmp_path / "job.jsonl", [{"prompt": "Once upon a time"}, {"prompt": "Hi", "n": 1}])
    out = tmp_path / "job.out.jsonl"
    options = JobOptions(
        str(src),
        output=str(out),
        n=2,
        temperature=0.8,
        seed=1,
        max_tokens=3,
        logprobs=1,
        engine={"model": str(tiny), **ENGINE},
    )
    assert run_job(options, dashboard=quiet()).complete
    first, second = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(first["choices"]) == 2 and len(second["choices"]) == 1  # a row's n wins over --n
    assert all(len(c["logprobs"]) == c["completion_tokens"] for c in first["choices"])
    assert first["choices"][0]["logprobs"] == first["logprobs"]


def test_a_column_n_that_is_data_is_left_alone(tmp_path):
    src = plain_file(tmp_path / "job.jsonl", [{"prompt": "Count to {n}", "n": "three"}])
    reader_rows = list(JobReader(str(src), ReaderOptions(keep_columns=("n",))))
    assert reader_rows[0].error is None and reader_rows[0].sampling_params.n == 1
    (templated,) = JobReader(str(src), ReaderOptions(template="Count to {n}"))
    assert templated.error is None and templated.prompt == "Count to three"


@pytest.mark.parametrize(
    ("n", "message"),
    [(0, "n must be in [1, 128]"), (129, "n must be in [1, 128]"), ("2", "n must be an integer")],
)
def test_bad_n_fails_its_line(tmp_path, n, message):
    src = batch_file(
        tmp_path / "batch.jsonl", [("a", "/v1/chat/completions", {"messages": MESSAGES, "n": n})]
    )
    (row,) = list(JobReader(str(src)))
    assert message in row.error and "field 'body.n'" in row.error


def test_a_crashed_job_with_n_resumes_with_every_choice(tmp_path, tiny):
    lines = [
        (
            f"r{i}",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": f"Count to {i}."}], "n": 2, "max_tokens": 4},
        )
        for i in range(6)
    ]
    src = batch_file(tmp_path / "batch.jsonl", lines)

    def options(out: Path) -> JobOptions:
        return JobOptions(str(src), output=str(out), engine={"model": str(tiny), **ENGINE}, commit_rows=1)

    reference = tmp_path / "reference.jsonl"
    run_job(options(reference), dashboard=quiet())
    out = tmp_path / "resumed.jsonl"
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_job(options(out), crashing_factory(8), dashboard=quiet())
    summary = run_job(options(out), dashboard=quiet())
    assert summary.complete and 0 < summary.rows_resumed < 6

    def choices(path: Path) -> list:
        return [
            (
                x["custom_id"],
                [
                    (c["index"], c["message"]["content"], c["finish_reason"])
                    for c in x["response"]["body"]["choices"]
                ],
            )
            for x in map(json.loads, path.read_text().splitlines())
        ]

    assert choices(out) == choices(reference) and all(len(c) == 2 for _, c in choices(out))
