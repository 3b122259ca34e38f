"""Workload generation: distribution shapes, seeds, bounds, Azure trace parsing, job files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from batchgen.bench.spec import BenchInputError, WorkloadSpec
from batchgen.bench.workload.distributions import (
    allowed_token_ids,
    arrival_times,
    build_workload,
    sample_lengths,
)
from batchgen.bench.workload.job import read_job_rows
from batchgen.bench.workload.traces import (
    LONGTAIL_INPUT,
    LONGTAIL_OUTPUT,
    TICKS_PER_SECOND,
    fit_lognormal,
    load_azure_trace,
    parse_trace_timestamp,
)

DATA_DIR = Path(__file__).parents[2] / ".." / "shared" / "data"
needs_data = pytest.mark.skipif(
    not (DATA_DIR / "AzureLLMInferenceTrace_conv.csv").is_file(),
    reason=f"Azure traces not found in {DATA_DIR} (the shared data folder next to the repository)",
)
BIG = 10**7  # a max_model_len that never clips


def lengths(**kw) -> tuple[np.ndarray, np.ndarray]:
    max_model_len = kw.pop("max_model_len", BIG)
    plan = sample_lengths(WorkloadSpec(**kw), max_model_len)
    return plan.input_lens, plan.output_lens


def test_longtail_matches_the_fitted_lognormals() -> None:
    inputs, outputs = lengths(num_prompts=20000, scale=1.0)
    assert np.median(inputs) == pytest.approx(LONGTAIL_INPUT.median, rel=0.05)
    assert np.median(outputs) == pytest.approx(LONGTAIL_OUTPUT.median, rel=0.05)
    # heavy right tail: mean above median, p99 many times the median, clipped at the trace maxima
    for a, dist in ((inputs, LONGTAIL_INPUT), (outputs, LONGTAIL_OUTPUT)):
        assert a.mean() > np.median(a)
        assert np.percentile(a, 99) > 4 * np.median(a)
        assert a.max() <= dist.max_value
    mu, sigma = fit_lognormal(inputs[inputs < LONGTAIL_INPUT.max_value])
    assert mu == pytest.approx(LONGTAIL_INPUT.mu, abs=0.05)
    assert sigma == pytest.approx(LONGTAIL_INPUT.sigma, abs=0.05)


def test_scale_multiplies_lengths() -> None:
    full_in, full_out = lengths(num_prompts=5000, scale=1.0)
    quarter_in, quarter_out = lengths(num_prompts=5000, scale=0.25)
    assert np.median(quarter_in) == pytest.approx(np.median(full_in) / 4, rel=0.02)
    assert np.median(quarter_out) == pytest.approx(np.median(full_out) / 4, rel=0.05)


@pytest.mark.parametrize("dist", ["longtail", "uniform", "fixed"])
def test_seed_reproducible(dist: str) -> None:
    kw = dict(dist=dist, num_prompts=50, range_ratio=0.5 if dist == "uniform" else 0.0)
    a = build_workload(WorkloadSpec(seed=3, **kw), vocab_size=1000, special_token_ids=[0], max_model_len=4096)
    b = build_workload(WorkloadSpec(seed=3, **kw), vocab_size=1000, special_token_ids=[0], max_model_len=4096)
    c = build_workload(WorkloadSpec(seed=4, **kw), vocab_size=1000, special_token_ids=[0], max_model_len=4096)
    assert [(r.prompt_token_ids, r.output_len) for r in a.requests] == [
        (r.prompt_token_ids, r.output_len) for r in b.requests
    ]
    assert [r.prompt_token_ids for r in a.requests] != [r.prompt_token_ids for r in c.requests]


def test_lengths_do_not_depend_on_vocabulary() -> None:
    a = build_workload(WorkloadSpec(num_prompts=20), vocab_size=100, max_model_len=8192)
    b = build_workload(WorkloadSpec(num_prompts=20), vocab_size=50000, max_model_len=8192)
    assert [(r.prompt_len, r.output_len) for r in a.requests] == [
        (r.prompt_len, r.output_len) for r in b.requests
    ]


@pytest.mark.parametrize("dist", ["longtail", "uniform", "fixed"])
@pytest.mark.parametrize("max_model_len", [2, 64, 2048])
def test_lengths_within_bounds(dist: str, max_model_len: int) -> None:
    inputs, outputs = lengths(
        dist=dist,
        num_prompts=500,
        scale=1.0,
        input_len=300,
        output_len=50,
        range_ratio=0.9 if dist == "uniform" else 0.0,
        max_model_len=max_model_len,
    )
    assert inputs.min() >= 1 and outputs.min() >= 1
    assert (inputs + outputs).max() <= max_model_len


def test_uniform_follows_vllm_random_dataset() -> None:
    inputs, outputs = lengths(dist="uniform", num_prompts=4000, input_len=200, output_len=40, range_ratio=0.5)
    assert inputs.min() >= 100 and inputs.max() <= 300
    assert outputs.min() >= 20 and outputs.max() <= 60
    assert inputs.mean() == pytest.approx(200, rel=0.03)
    assert len(np.unique(inputs)) > 150  # spread over the whole range


def test_fixed_is_exact() -> None:
    inputs, outputs = lengths(dist="fixed", num_prompts=10, input_len=17, output_len=5)
    assert set(inputs.tolist()) == {17} and set(outputs.tolist()) == {5}


def test_prompts_avoid_special_tokens_and_match_lengths() -> None:
    w = build_workload(
        WorkloadSpec(dist="uniform", num_prompts=30, input_len=40, range_ratio=0.5),
        vocab_size=10,
        special_token_ids=[0, 1, 2],
        max_model_len=1000,
    )
    for r in w.requests:
        assert set(r.prompt_token_ids) <= set(range(3, 10))
    assert w.total_prompt_tokens == sum(r.prompt_len for r in w.requests)
    with pytest.raises(ValueError, match="no ordinary token ids in a vocabulary of 3"):
        allowed_token_ids(3, [0, 1, 2])


def test_poisson_arrivals() -> None:
    spec = WorkloadSpec(num_prompts=5000, request_rate=4.0, seed=1)
    t = arrival_times(spec, 5000)
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
    assert np.diff(t).mean() == pytest.approx(0.25, rel=0.05)
    assert np.all(arrival_times(WorkloadSpec(), 7) == 0.0)  # offline by default


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"dist": "zipf"}, "dist must be one of"),
        ({"dist": "file:"}, "needs a path"),
        ({"num_prompts": 0}, "num_prompts must be an int >= 1"),
        ({"seed": -5}, "seed must be an int >= 0"),
        ({"scale": 0.0}, "scale must be > 0"),
        ({"range_ratio": 1.0}, r"range_ratio must be in \[0, 1\)"),
        ({"request_rate": 0.0}, "request_rate must be > 0"),
        ({"trace_arrivals": True}, "trace_arrivals needs dist azure-conv or azure-code"),
        ({"dist": "azure-conv", "trace_arrivals": True, "request_rate": 2.0}, "not both"),
    ],
)
def test_spec_validation(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkloadSpec(**kw)


# --- Azure traces -----------------------------------------------------------------------------------


def test_timestamp_keeps_seven_fractional_digits() -> None:
    a = parse_trace_timestamp("2023-11-16 18:15:46.6805900")
    b = parse_trace_timestamp("2023-11-16 18:15:46.6805901")
    assert b - a == 1
    assert parse_trace_timestamp("2023-11-16 18:15:47") - a == 3194100
    assert parse_trace_timestamp("2023-11-16 18:15:46.68059") == a
    for bad in ("2023-11-16T18:15:46.6805900", "2023-11-16 18:15:46.68059001", "yesterday"):
        with pytest.raises(ValueError):
            parse_trace_timestamp(bad)


def test_load_trace_with_crlf_and_no_final_newline(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    # Made-up rows in the trace's format (the shared data's own rows stay in ../shared/data).
    path.write_bytes(
        b"TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
        b"2024-01-02 03:04:05.1000000,120,30\r\n"
        b"2024-01-02 03:04:05.1000001,250,80\r\n"
        b"2024-01-02 03:04:09.4145790,5,1"
    )
    trace = load_azure_trace(path)
    assert len(trace) == 3
    assert trace.context_tokens.tolist() == [120, 250, 5]
    assert trace.generated_tokens.tolist() == [30, 80, 1]
    assert trace.times[0] == 0.0
    assert trace.times[1] == pytest.approx(1 / TICKS_PER_SECOND, abs=1e-12)
    assert trace.times[2] == pytest.approx(4.314579, abs=1e-9)


def test_load_trace_errors_name_the_line(tmp_path: Path) -> None:
    bad_header = tmp_path / "a.csv"
    bad_header.write_text("time,in,out\n2023-11-16 18:15:46.6805900,1,2\n")
    with pytest.raises(ValueError, match="header"):
        load_azure_trace(bad_header)
    bad_row = tmp_path / "b.csv"
    bad_row.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:15:46.6805900,1,2\r\nnope,1,2\r\n"
    )
    with pytest.raises(ValueError, match=":3:"):
        load_azure_trace(bad_row)


@needs_data
def test_conv_trace_statistics_and_longtail_fit() -> None:
    trace = load_azure_trace(DATA_DIR / "AzureLLMInferenceTrace_conv.csv")
    assert len(trace) == 19366
    assert trace.context_tokens.mean() == pytest.approx(1155, abs=1)
    assert np.median(trace.context_tokens) == 1020
    assert trace.context_tokens.max() == LONGTAIL_INPUT.max_value
    assert trace.generated_tokens.max() == LONGTAIL_OUTPUT.max_value
    assert np.all(np.diff(trace.times) >= 0) and 3400 < trace.times[-1] < 3600  # one hour
    mu_in, sigma_in = fit_lognormal(trace.context_tokens)
    mu_out, sigma_out = fit_lognormal(trace.generated_tokens)
    assert (mu_in, sigma_in) == pytest.approx((LONGTAIL_INPUT.mu, LONGTAIL_INPUT.sigma), abs=1e-3)
    assert (mu_out, sigma_out) == pytest.approx((LONGTAIL_OUTPUT.mu, LONGTAIL_OUTPUT.sigma), abs=1e-3)


@needs_data
@pytest.mark.parametrize("dist", ["azure-conv", "azure-code"])
def test_azure_workload_samples_a_window_of_the_trace(dist: str) -> None:
    spec = WorkloadSpec(dist=dist, num_prompts=40, scale=1.0, seed=5, trace_arrivals=True, data_dir=DATA_DIR)
    w = build_workload(spec, vocab_size=1000, max_model_len=BIG)
    trace = load_azure_trace(DATA_DIR / ("AzureLLMInferenceTrace_" + dist.split("-")[1] + ".csv"))
    start = w.params["first_record"]
    assert [r.prompt_len for r in w.requests] == trace.context_tokens[start : start + 40].tolist()
    assert [r.output_len for r in w.requests] == trace.generated_tokens[start : start + 40].tolist()
    arrivals = [r.arrival_time for r in w.requests]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert arrivals[-1] == pytest.approx(trace.times[start + 39] - trace.times[start])
    offline = build_workload(
        WorkloadSpec(dist=dist, num_prompts=5, data_dir=DATA_DIR), vocab_size=1000, max_model_len=BIG
    )
    assert all(r.arrival_time == 0.0 for r in offline.requests)


def test_azure_missing_trace_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="data-dir"):
        sample_lengths(WorkloadSpec(dist="azure-conv", data_dir=tmp_path), 4096)


# --- job files --------------------------------------------------------------------------------------


def test_file_workload(tmp_path: Path) -> None:
    path = tmp_path / "job.jsonl"
    rows = [
        {"prompt": "hello there", "max_tokens": 7},
        {"messages": [{"role": "user", "content": "hi"}], "sampling_params": {"max_tokens": 3}},
        {
            "custom_id": "x",
            "body": {"messages": [{"role": "user", "content": "yo"}], "max_completion_tokens": 5},
        },
        {"prompt_token_ids": [5, 6, 7, 8]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")

    def encode(prompt) -> list[int]:
        text = prompt if isinstance(prompt, str) else " ".join(m["content"] for m in prompt)
        return [ord(c) for c in text]

    w = build_workload(
        WorkloadSpec(dist=f"file:{path}", num_prompts=0, output_len=9),
        vocab_size=0,
        max_model_len=4096,
        encode=encode,
    )
    assert [r.output_len for r in w.requests] == [7, 3, 5, 9]
    assert w.requests[0].prompt_token_ids == encode("hello there")
    assert w.requests[3].prompt_token_ids == [5, 6, 7, 8]
    assert (
        len(
            build_workload(
                WorkloadSpec(dist=f"file:{path}", num_prompts=2),
                vocab_size=0,
                max_model_len=64,
                encode=encode,
            ).requests
        )
        == 2
    )
    path.write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(ValueError, match=":2:"):
        read_job_rows(path)  # strict, for scripts that read a data set


def test_file_workload_names_the_sampling_fields_it_does_not_use(tmp_path: Path) -> None:
    """Found by a new user: `temperature: -1` in a row ran without a word (a bench runs greedy to
    exact lengths). The fields are named once; rows without them get no note."""
    path = tmp_path / "job.jsonl"
    rows = [
        {"prompt": "a", "temperature": -1, "max_tokens": 2},
        {"prompt": "b", "sampling_params": {"top_p": 0.5, "seed": 3}},
        {"custom_id": "c", "body": {"messages": [{"role": "user", "content": "c"}], "n": 2}},
        {"prompt": "d"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = WorkloadSpec(dist=f"file:{path}", num_prompts=0, output_len=4)
    w = build_workload(spec, vocab_size=0, max_model_len=64, encode=encode_chars)
    assert len(w.requests) == 4 and w.params["unused_sampling_fields"] == [
        "n",
        "seed",
        "temperature",
        "top_p",
    ]
    (note,) = w.warnings()
    assert note.startswith(
        "note: the rows' n, seed, temperature, top_p are not used: a bench runs every request greedy"
    )
    path.write_text(json.dumps({"prompt": "d", "max_tokens": 3}) + "\n")
    assert build_workload(spec, vocab_size=0, max_model_len=64, encode=encode_chars).warnings() == []


def test_file_workload_with_fewer_rows_than_asked_says_so(tmp_path: Path) -> None:
    path = tmp_path / "job.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "max_tokens": 2}) + "\n" for p in "abc"))
    for asked, notes in ((8, 1), (3, 0), (0, 0)):
        spec = WorkloadSpec(dist=f"file:{path}", num_prompts=asked)
        w = build_workload(spec, vocab_size=0, max_model_len=64, encode=encode_chars)
        assert len(w.requests) == 3 and len(w.warnings()) == notes, asked
    assert w.warnings() == [] and build_workload(
        WorkloadSpec(dist=f"file:{path}", num_prompts=8), vocab_size=0, max_model_len=64, encode=encode_chars
    ).warnings() == [
        f"note: {path} has 3 usable rows, fewer than --num-prompts 8: the workload is all 3 (0 takes every row)"
    ]


def test_file_workload_skips_unusable_rows(tmp_path: Path) -> None:
    """As `batchgen run` turns bad rows into error rows, the bench skips them: one warning, a count."""
    path = tmp_path / "job.jsonl"
    lines = [
        '{"prompt": "ok", "max_tokens": 2}',
        "not json",
        '{"prompt": ""}',
        "[1, 2]",
        '{"prompt": "x", "max_tokens": 0}',
        '{"prompt": "x", "max_tokens": 1e20}',
        '{"prompt_token_ids": ["a"]}',
        '{"other": 1}',
        '{"prompt": "fine"}',
    ]
    path.write_text("\n".join(lines) + "\n")
    spec = WorkloadSpec(dist=f"file:{path}", num_prompts=0, output_len=4)
    w = build_workload(spec, vocab_size=0, max_model_len=64, encode=encode_chars)
    assert [r.prompt_token_ids for r in w.requests] == [encode_chars("ok"), encode_chars("fine")]
    assert w.params["num_skipped"] == 7 and w.params["first_skipped"].startswith("line 2: not JSON")
    (warning,) = w.warnings()
    assert f"skipped 7 unusable rows of {path} (first: line 2: not JSON" in warning
    # num_prompts counts usable rows: the first one is enough, and nothing after it is read
    first = build_workload(
        WorkloadSpec(dist=f"file:{path}", num_prompts=1), vocab_size=0, max_model_len=64, encode=encode_chars
    )
    assert len(first.requests) == 1 and first.params["num_skipped"] == 0 and first.warnings() == []

    path.write_text('{"prompt": ""}\nnot json\n')
    with pytest.raises(
        BenchInputError, match=r"no usable row .*all 2 rows are unusable \(first: line 1: the prompt is empty"
    ):
        build_workload(spec, vocab_size=0, max_model_len=64, encode=encode_chars)
    path.write_text("\n")
    with pytest.raises(BenchInputError, match="no usable row .* it has no rows"):
        build_workload(spec, vocab_size=0, max_model_len=64, encode=encode_chars)


def test_missing_workload_files_name_the_option_and_path(tmp_path: Path) -> None:
    job = tmp_path / "nonexistent.jsonl"
    with pytest.raises(BenchInputError, match=f"--dist file:{job}: the job file {job} does not exist"):
        WorkloadSpec(dist=f"file:{job}").check_inputs()
    with pytest.raises(
        BenchInputError, match=f"--data-dir {tmp_path} has no AzureLLMInferenceTrace_code.csv"
    ):
        WorkloadSpec(dist="azure-code", data_dir=tmp_path).check_inputs()
    WorkloadSpec(dist="fixed", data_dir=tmp_path).check_inputs()  # reads no file


def encode_chars(prompt) -> list[int]:
    """A stand-in tokenizer: one id per character (of the text or of the messages' contents)."""
    text = prompt if isinstance(prompt, str) else " ".join(m["content"] for m in prompt)
    return [ord(c) for c in text]


CLIPPING_SPECS = {
    "fixed": dict(dist="fixed", input_len=9000, output_len=2),
    "uniform": dict(dist="uniform", input_len=100, output_len=10, range_ratio=0.3),
    "longtail": dict(dist="longtail", scale=1.0),
    "azure-conv": pytest.param(dict(dist="azure-conv", scale=1.0, data_dir=DATA_DIR), marks=needs_data),
}


@pytest.mark.parametrize("kw", list(CLIPPING_SPECS.values()), ids=list(CLIPPING_SPECS))
def test_every_clipping_distribution_warns_with_the_count_and_the_limit(kw: dict) -> None:
    w = build_workload(WorkloadSpec(num_prompts=8, **kw), vocab_size=50, max_model_len=64)
    clipped = sum(r.prompt_len + r.output_len == 64 for r in w.requests)
    assert clipped > 0 and w.params["num_clipped"] == clipped
    assert w.warnings() == [
        f"warning: {clipped} requests were shortened to fit max_model_len 64 (prompt + output tokens: "
        "prompts cut to 63 tokens, then outputs to the room left); raise --max-model-len or lower the "
        "lengths to run them whole"
    ]


def test_file_workload_clipping_warns(tmp_path: Path) -> None:
    path = tmp_path / "job.jsonl"
    path.write_text('{"prompt_token_ids": [1, 2, 3], "max_tokens": 100}\n{"prompt": "ab", "max_tokens": 3}\n')
    spec = WorkloadSpec(dist=f"file:{path}", num_prompts=0)
    w = build_workload(spec, vocab_size=0, max_model_len=16, encode=encode_chars)
    assert [(r.prompt_len, r.output_len) for r in w.requests] == [(3, 13), (2, 3)]
    assert w.warnings() == [
        "warning: 1 requests were shortened to fit max_model_len 16 (prompt + output tokens: prompts cut "
        "to 15 tokens, then outputs to the room left); raise --max-model-len or lower the lengths to run "
        "them whole"
    ]


@pytest.mark.parametrize("dist", ["longtail", pytest.param("azure-code", marks=needs_data)])
def test_lengths_raised_to_one_token_are_not_counted_as_clipped(dist: str) -> None:
    """A tiny scale rounds some lengths to 0, raised to 1 token: nothing was shortened, no warning."""
    plan = sample_lengths(WorkloadSpec(dist=dist, num_prompts=500, scale=0.01, data_dir=DATA_DIR), BIG)
    assert plan.output_lens.min() == 1 and plan.input_lens.min() >= 1
    assert plan.params["num_clipped"] == 0


def test_summary_reports_token_totals() -> None:
    w = build_workload(
        WorkloadSpec(dist="fixed", num_prompts=4, input_len=10, output_len=3),
        vocab_size=50,
        max_model_len=100,
    )
    s = w.summary()
    assert s["total_prompt_tokens"] == 40 and s["total_output_tokens"] == 12
    assert s["params"]["arrivals"] == "offline"
    assert math.isclose(s["input_len"]["mean"], 10)


def test_parquet_job_rows_are_numbered_from_0_as_batchgen_run_numbers_them(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "job.parquet"
    pq.write_table(pa.table({"prompt": ["", "fine"]}), path)
    w = build_workload(
        WorkloadSpec(dist=f"file:{path}", num_prompts=0, output_len=4), vocab_size=0, max_model_len=64,
        encode=encode_chars,
    )  # fmt: skip
    assert w.params["first_skipped"].startswith("row 0: the prompt is empty")
