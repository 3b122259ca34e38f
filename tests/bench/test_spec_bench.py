"""`batchgen bench --speculative-method none,ngram`: both configurations in one run, the tail time and
the acceptance rate in the report, and the tail's definition."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchgen.bench.report.metrics import TAIL_REQUESTS, RequestRecord, RunResult, StepRecord, summarize
from tests.bench.test_bench_smoke import invoke_bench, tiny_run_args

PROMPTS = [
    "one two three four one two three four one two three four one two three",
    "the cat sat on the mat. the cat sat on the mat. the dog sat on the log. the dog sat on the",
    "a b c d e f g a b c d e f g a b c d e f g a b c",
    "Hello, my name is",
]


def test_bench_runs_with_and_without_speculation(tiny_model_dir, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    job = tmp_path / "job.jsonl"
    # Ten rows as token ids (no chat template: the repetition is the prompt's end), the last two
    # much longer: a tail of two requests.
    rows = [
        {"prompt_token_ids": tok(PROMPTS[i % 4])["input_ids"], "max_tokens": 40 if i >= 8 else 8}
        for i in range(10)
    ]
    job.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = tiny_run_args(tiny_model_dir("llama"), tmp_path, "--dist", f"file:{job}", "--num-prompts", "0")
    result = invoke_bench([*args, "--speculative-method", "none,ngram", "--speculative-max-batch", "4"])
    assert result.exit_code == 0, result.output
    assert "tail: < 8 requests left (s)" in result.output and "draft acceptance rate" in result.output
    report = json.loads((tmp_path / "r.json").read_text())
    configs = {c["name"]: c for c in report["configurations"]}
    assert list(configs) == ["continuous/fcfs", "continuous/fcfs+ngram"]
    plain, spec = configs["continuous/fcfs"]["metrics"], configs["continuous/fcfs+ngram"]["metrics"]
    assert plain["output_tokens"] == spec["output_tokens"] == 8 * 8 + 2 * 40
    assert plain["spec_decode_num_draft_tokens"] == 0 and plain["spec_decode_acceptance_rate"] is None
    assert 0 < spec["spec_decode_num_accepted_tokens"] < spec["spec_decode_num_draft_tokens"]
    assert spec["spec_decode_acceptance_rate"] == pytest.approx(
        spec["spec_decode_num_accepted_tokens"] / spec["spec_decode_num_draft_tokens"]
    )
    assert spec["num_steps"] < plain["num_steps"]  # accepted drafts save steps
    for m in (plain, spec):
        assert 0 < m["tail_s"] < m["wall_s"]
    ratio = configs["continuous/fcfs+ngram"]["ratios"]["tail_s"]
    assert ratio == pytest.approx(spec["tail_s"] / plain["tail_s"])
    assert "tail: output tokens/s" in result.output
    for m in (plain, spec):  # the two long requests' tokens, and maybe a few from the step before
        assert 0 < m["tail_output_tokens_per_s"] * m["tail_s"] <= m["output_tokens"]
    assert (
        "speculative ngram k=4 n=2-4, gate running batch <= 4 (set)"
        in configs["continuous/fcfs+ngram"]["notes"][0]
    )
    # Every request is admitted in the first step: then a step's sequences are the running batch
    # it started with, and drafts come only in steps of at most 4.
    steps = configs["continuous/fcfs+ngram"]["timeline"]
    assert sum(steps["num_generation_tokens"]) == spec["output_tokens"]
    drafted = [n for n, d in zip(steps["num_seqs"], steps["num_draft_tokens"], strict=True) if d]
    assert drafted and max(drafted) <= 4 and max(steps["num_seqs"]) == 10


def test_tail_starts_when_fewer_than_eight_requests_are_left() -> None:
    def result(finishes: list[float], steps: list[StepRecord] | None = None) -> RunResult:
        records = [RequestRecord(str(i), 4, 2, 0.0, 0.0, 0.1, f, None, 0.0) for i, f in enumerate(finishes)]
        steps = steps if steps is not None else [StepRecord(1.0, 1, 1, 1)]
        return RunResult("c", "continuous", "fcfs", requests=records, steps=steps)

    assert TAIL_REQUESTS == 8
    # Ten requests finishing at 1..10 s: after the third (3 s) seven are left; the tail is 7 s.
    assert summarize(result([float(t) for t in range(10, 0, -1)]))["tail_s"] == pytest.approx(7.0)
    # Its speed: the output tokens of the steps ending after 3 s (5 + 9 + 2), over those 7 s.
    steps = [StepRecord(t, 4, 4, n) for t, n in ((1.0, 50), (3.0, 40), (3.5, 5), (6.0, 9), (10.0, 2))]
    tail = summarize(result([float(t) for t in range(10, 0, -1)], steps))
    assert tail["tail_output_tokens_per_s"] == pytest.approx(16 / 7.0)
    # Exactly eight: fewer than eight are left once the first finishes.
    assert summarize(result([2.0, 4.0, 5, 6, 7, 8, 9, 9.5]))["tail_s"] == pytest.approx(7.5)
    # Fewer than eight from the start: the whole run is tail.
    assert summarize(result([1.0, 3.0]))["tail_s"] == pytest.approx(3.0)
    # A static batch's last eight finish together: no moment had fewer left, so no tail (shown "-").
    static = summarize(result([1.0, 1.0] + [5.0] * 8, steps))
    assert static["tail_s"] is None and static["tail_output_tokens_per_s"] is None
    m = summarize(result([1.0, 3.0]))
    assert m["spec_decode_num_draft_tokens"] is None and m["spec_decode_acceptance_rate"] is None


def test_bad_speculative_bench_options_are_usage_errors() -> None:
    for args, message in (
        (["--speculative-method", "none,eagle"], "speculative_method must be one of ngram; got 'eagle'"),
        (["--num-speculative-tokens", "3"], "num_speculative_tokens apply only with speculative decoding"),
        (
            ["--speculative-method", "ngram", "--prompt-lookup-min", "5", "--prompt-lookup-max", "2"],
            "prompt_lookup_min (5) must be <= prompt_lookup_max (2)",
        ),  # fmt: skip
    ):
        result = invoke_bench(args)
        assert result.exit_code == 2 and message in result.output, (args, result.output)
