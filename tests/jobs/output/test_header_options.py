"""A resumed run whose options differ from the first run's in wording only resumes; one whose
options mean something else is refused with the run header's message (`header_options`)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from batchgen.jobs.errors import JobInputError
from batchgen.jobs.output.header_options import canonical_options
from batchgen.jobs.output.manifest import Manifest
from batchgen.jobs.output.resume import parts_dir_for
from batchgen.jobs.runner import JobOptions, job_header, job_reader
from tests.jobs.output.test_writer_resume import job_file, run

LIMIT = 512  # the model's max_position_embeddings


@pytest.fixture
def job(tmp_path):
    """options(**kw) -> the job's JobOptions (the fake engine; a model folder whose config says
    its limit, so the header can resolve max_model_len and quantization against it)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": LIMIT}))
    src = job_file(tmp_path)
    out = str(tmp_path / "out.parquet")

    def options(engine: dict[str, Any] | None = None, **kw: Any) -> JobOptions:
        engine = {"model": str(model), "max_num_seqs": 3, **(engine or {})}
        return JobOptions(src, output=out, engine=engine, commit_rows=4, commit_seconds=60, **kw)

    return options


def interrupt(options: JobOptions) -> int:
    """Run the job until a simulated crash after some commits; the rows committed."""

    def crash(step: int) -> None:
        if step == 9:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        run(options, on_step=crash)
    committed = sum(e.rows for e in Manifest(parts_dir_for(options.output)).load()[1])
    assert committed > 0 and not os.path.exists(options.output)
    return committed


SAME = [
    ("top_k -1 and 0 (both off)", {"top_k": -1}, {"top_k": 0}),
    ("chat_template_kwargs {} and none", {"chat_template_kwargs": {}}, {}),
    ("max_model_len as the model's limit and the default", {"engine": {"max_model_len": LIMIT}}, {}),
    ("quantization none and auto (a float checkpoint)", {"engine": {"quantization": "none"}}, {}),
]


@pytest.mark.parametrize("first, again", [(a, b) for _, a, b in SAME] + [(b, a) for _, a, b in SAME])
def test_an_option_worded_otherwise_resumes(job, first, again):
    committed = interrupt(job(**first))
    s = run(job(**again))
    assert s.complete and s.rows_resumed == committed and s.rows_done == 40
    assert run(job(**first)).already_complete  # and the finished output is this job's too


@pytest.mark.parametrize(
    "first, again, says",
    [
        ({"top_k": 0}, {"top_k": 5}, "sampling.top_k 0 -> 5"),
        ({}, {"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs None -> {"),
        ({}, {"engine": {"max_model_len": 256}}, "max_model_len None -> 256"),
        (
            {"engine": {"quantization": "none"}},
            {"engine": {"quantization": "int8"}},
            "quantization 'auto' -> 'int8'",
        ),
    ],
)
def test_an_option_that_means_something_else_is_refused(job, first, again, says):
    committed = interrupt(job(**first))
    with pytest.raises(JobInputError) as refused:
        run(job(**again))
    message = str(refused.value)
    assert f"has {committed} committed rows from a run with other settings ({says}" in message
    assert "Pass --overwrite to discard them and start over, or choose another --output" in message


def test_a_header_written_in_another_form_compares_in_this_one(tmp_path):
    """A header written before the forms were chosen (top_k -1, {} kwargs) reads as today's;
    a model whose limit or weights cannot be told keeps max_model_len and quantization as given."""
    old = {"sampling": {"top_k": -1, "max_tokens": 8}, "chat_template_kwargs": {}, "max_model_len": 2048}
    assert canonical_options(old, str(tmp_path / "missing")) == {
        "sampling": {"top_k": 0, "max_tokens": 8},
        "chat_template_kwargs": None,
        "max_model_len": 2048,
    }
    assert canonical_options({"quantization": "none"}, str(tmp_path / "missing")) == {"quantization": "none"}
    assert old["sampling"]["top_k"] == -1  # the caller's dict is left as it was


def test_the_header_records_the_one_form(job):
    options = job(top_k=-1, chat_template_kwargs={}, engine={"max_model_len": LIMIT, "quantization": "none"})
    header = job_header(options, job_reader(options), "parquet")["options"]
    assert header["sampling"]["top_k"] == 0 and header["chat_template_kwargs"] is None
    assert header["max_model_len"] is None and "quantization" not in header
    assert job_header(options, job_reader(options), "parquet") == job_header(
        job(), job_reader(job()), "parquet"
    )
