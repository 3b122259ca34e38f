"""`batchgen run` end to end: JSONL, Parquet and OpenAI batch inputs -> expected output schema, one row
per input row, in input order; bad jobs exit with code 2 before the model is loaded."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.cli_types import ENGINE_OPTIONS
from batchgen.config import EngineConfig

SCHEMA = [
    "row_index",
    "id",
    "output",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "error",
    "ttft_s",
    "latency_s",
]
PROMPTS = [
    "Explain what a compiler does.",
    "List three fruits.",
    "Translate 'good morning' to Spanish.",
    "Summarise: the cat sat on the mat all afternoon.",
    "What is the capital of Peru?",
]
NO_MODEL = "/nonexistent/model"  # a pre-flight failure must come before any model loading


def invoke(*args: str):
    return CliRunner().invoke(app, ["run", *args])


def engine_args(model: Path) -> list[str]:
    return ["--model", str(model), "--max-tokens", "8", "--max-num-seqs", "3", "--kv-cache-memory", "64MiB"]


# ----- pre-flight: exit code 2, no model work -----


def test_missing_file_and_unknown_format(tmp_path):
    r = invoke(str(tmp_path / "none.jsonl"), "--model", NO_MODEL)
    assert r.exit_code == 2 and "input not found" in r.stderr
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    r = invoke(str(tmp_path / "x.csv"), "--model", NO_MODEL)
    assert r.exit_code == 2 and "unknown input format" in r.stderr


def test_missing_prompt_column_lists_columns(tmp_path):
    src = tmp_path / "j.jsonl"
    src.write_text(json.dumps({"question": "q", "context": "c"}) + "\n")
    r = invoke(str(src), "--model", NO_MODEL)
    assert (
        r.exit_code == 2
        and "available columns: question, context" in r.stderr
        and "--prompt-column" in r.stderr
    )
    r = invoke(str(src), "--model", NO_MODEL, "--prompt-column", "query")
    assert r.exit_code == 2 and "prompt column 'query' not found" in r.stderr


def test_unwritable_output_and_bad_options(tmp_path):
    src = tmp_path / "j.jsonl"
    src.write_text(json.dumps({"prompt": "p"}) + "\n")
    r = invoke(str(src), "--model", NO_MODEL, "--output", str(tmp_path / "missing_dir" / "o.parquet"))
    assert r.exit_code == 2 and "does not exist" in r.stderr
    r = invoke(str(src), "--model", NO_MODEL, "--policy", "random")
    assert r.exit_code == 2 and "policy must be one of" in r.stderr
    r = invoke(str(src), "--model", NO_MODEL, "--truncate-prompt", "middle")
    assert r.exit_code == 2 and "left or right" in r.stderr
    assert not (tmp_path / "j.out.parquet.parts").exists()


def test_output_that_is_the_input_is_refused_and_the_input_kept(tmp_path):
    src = tmp_path / "j.jsonl"
    text = json.dumps({"prompt": "p"}) + "\n"
    src.write_text(text)
    for output in (str(src), str(tmp_path / "." / "j.jsonl")):
        r = invoke(str(src), "--model", NO_MODEL, "--output", output, "--overwrite")
        assert r.exit_code == 2 and "is the input file" in r.stderr and "j.out.parquet" in r.stderr
    assert src.read_text() == text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--output", "out.csv"], "must end in .parquet"),
        (["--output", ""], "--output is empty; give a file path, or leave --output out for the default"),
        (["--prompt-column", "prompt", "--messages-column", "messages"], "give one of them"),
        (["--template", "{prompt}", "--prompt-column", "prompt"], "--template and --prompt-column"),
        (["--commit-every", "0"], "--commit-every must be >= 1"),
        (["--commit-interval", "-1"], "--commit-interval must be > 0"),
        (["--progress-interval", "0"], "--progress-interval must be > 0"),
        (["--block-size", "7"], "power of two (1, 2, 4"),
    ],
)
def test_conflicting_or_meaningless_job_options_exit_2(tmp_path, args, message):
    src = tmp_path / "j.jsonl"
    src.write_text(json.dumps({"prompt": "p"}) + "\n")
    args = [str(tmp_path / a) if a.endswith(".csv") else a for a in args]
    r = invoke(str(src), "--model", NO_MODEL, *args)
    assert r.exit_code == 2 and message in r.stderr, r.output
    assert not list(tmp_path.glob("j.out*"))


def test_an_output_under_a_file_names_the_file_not_a_missing_directory(tmp_path):
    src = tmp_path / "j.jsonl"
    src.write_text(json.dumps({"prompt": "p"}) + "\n")
    r = invoke(str(src), "--model", NO_MODEL, "--output", str(src / "x.parquet"))
    assert r.exit_code == 2 and f"{src} is a file, not a directory" in r.stderr, r.output


def test_damaged_parquet_input_is_named(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"garbage")
    r = invoke(str(tmp_path / "bad.parquet"), "--model", NO_MODEL)
    assert r.exit_code == 2 and "is not a Parquet file" in r.stderr


def test_an_input_without_rows_exits_2_before_the_model_in_every_format(tmp_path):
    """An empty JSONL file and a 0-row Parquet file (columns but no rows) stop alike: exit 2, the
    same message shape, no output and no model (NO_MODEL would fail to load)."""
    (tmp_path / "e.jsonl").write_text("\n")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "e.parquet")
    for name, what in [("e.jsonl", "no JSON lines"), ("e.parquet", "no rows")]:
        src = tmp_path / name
        r = invoke(str(src), "--model", NO_MODEL, "--output", str(tmp_path / f"out-{name}"))
        assert r.exit_code == 2, r.output
        assert f"{src} is empty ({what}): there is nothing to run; check the " in r.stderr
        assert not (tmp_path / f"out-{name}").exists()


def test_invalid_sampling_flags_exit_2_before_the_model(tmp_path):
    src = tmp_path / "j.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    for flag, value in [
        ("--temperature", "-1"),
        ("--top-p", "0"),
        ("--max-tokens", "0"),
        ("--temperature", "nan"),
        ("--frequency-penalty", "-3"),
    ]:
        r = invoke(str(src), "--model", NO_MODEL, flag, value)
        assert r.exit_code == 2, (flag, value, r.output)
        assert "invalid sampling option" in r.stderr and r.stderr.strip().endswith(f"(flag {flag})"), r.stderr


def test_vllm_sampling_fields_are_job_wide_flags(tmp_path, monkeypatch):
    """--n, --min-p, --min-tokens, --ignore-eos and --stop-token-ids set every row's default, as
    the row fields of those names do; bad values exit 2 naming the flag."""
    import batchgen.jobs.runner as runner_module

    seen = []
    monkeypatch.setattr(runner_module, "run_job", lambda options, *a, **k: seen.append(options) or 1 / 0)
    src = tmp_path / "j.jsonl"
    src.write_text(json.dumps({"prompt": "p"}) + "\n")
    flags = ["--n", "3", "--min-p", "0.05", "--min-tokens", "2", "--ignore-eos"]
    invoke(str(src), *flags, "--stop-token-ids", "7,9", "--stop-token-ids", "11", "--temperature", "0.7")
    (options,) = seen
    defaults = options.sampling_defaults()
    assert {k: defaults[k] for k in ("n", "min_p", "min_tokens", "ignore_eos", "stop_token_ids")} == {
        "n": 3,
        "min_p": 0.05,
        "min_tokens": 2,
        "ignore_eos": True,
        "stop_token_ids": [7, 9, 11],
    }
    monkeypatch.undo()
    for flag, value in [("--min-p", "2"), ("--n", "0"), ("--min-tokens", "-1")]:
        r = invoke(str(src), "--model", NO_MODEL, flag, value)
        assert r.exit_code == 2 and r.stderr.strip().endswith(f"(flag {flag})"), r.stderr
    r = invoke(str(src), "--model", NO_MODEL, "--stop-token-ids", "2,eos")
    assert r.exit_code == 2 and "'eos' is not a token id" in r.stderr
    # Unset, they leave the run header as it was before they existed.
    assert not {"n", "min_p", "min_tokens", "ignore_eos", "stop_token_ids"} & set(
        runner_module.JobOptions("x.jsonl").sampling_defaults()
    )


def test_missing_model_exits_2(tmp_path):
    src = tmp_path / "j.jsonl"
    src.write_text(json.dumps({"prompt": "p"}) + "\n")
    r = invoke(str(src), "--model", NO_MODEL)
    assert r.exit_code == 2 and "cannot start the engine" in r.stderr


def test_run_and_bench_take_the_same_engine_options():
    """Every engine option has the same flag, default and help in `run` and `bench`."""
    import typer.main

    def options(name: str) -> dict[str, tuple]:
        command = typer.main.get_command(app).commands[name]
        return {
            p.name: (tuple(p.opts), p.default, p.help) for p in command.params if p.name in ENGINE_OPTIONS
        }

    run, bench = options("run"), options("bench")
    assert set(run) == set(bench) == set(ENGINE_OPTIONS)
    # bench takes comma lists of methods (each continuous configuration runs once per item).
    lists = {"speculative_method", "quantization"}
    compared = set(ENGINE_OPTIONS) - lists
    assert {k: run[k] for k in compared} == {k: bench[k] for k in compared}
    assert run["speculative_method"][0] == bench["speculative_method"][0] == ("--speculative-method",)
    assert run["quantization"][:2] == bench["quantization"][:2] == (("--quantization",), "auto")
    assert set(ENGINE_OPTIONS) <= set(EngineConfig.__dataclass_fields__)
    assert run["max_num_seqs"][:2] == (("--max-num-seqs",), EngineConfig.max_num_seqs)


def test_run_and_plan_take_every_sampling_default_with_its_default():
    """The sampling flags are declared once (`SamplingDefaults`): `run` and `plan` take each field as
    the flag of its name with the dataclass's default (an empty tuple is no flag value), and the
    resume header's sampling options of a job that sets none of the later ones are the ones
    written before those existed."""
    import dataclasses

    import typer.main

    from batchgen.cli import _job_options
    from batchgen.jobs.options import JobOptions
    from batchgen.sampling_params import SamplingDefaults

    for name in ("run", "plan"):
        params = {p.name: p for p in typer.main.get_command(app).commands[name].params}
        # The job's constraint comes from four flags, one per kind (`cli_types.structured_flags`).
        for flag in ("json_schema", "regex", "choice", "grammar"):
            assert params[flag].opts == [f"--{flag.replace('_', '-')}"] and params[flag].default is None
        for f in dataclasses.fields(SamplingDefaults):
            if f.name == "structured_outputs":
                continue
            assert params[f.name].opts == [f"--{f.name.replace('_', '-')}"], (name, f.name)
            assert params[f.name].default == (None if f.default == () else f.default), (name, f.name)
    assert JobOptions("j.jsonl").sampling_defaults() == {
        "max_tokens": 256,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "seed": None,
        "stop": None,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
    }
    values = {p.name: p.default for p in typer.main.get_command(app).commands["run"].params}
    values.update(input="j.jsonl", stop=["###"], stop_token_ids=["2,13", "7"], n=3, min_p=0.1)
    values["engine"] = {name: values.pop(name) for name in ENGINE_OPTIONS}  # as `engine_flags` gives them
    options = _job_options(values)
    assert options.sampling_defaults() == {
        **JobOptions("j.jsonl").sampling_defaults(),
        "stop": ["###"],
        "min_p": 0.1,
        "stop_token_ids": [2, 13, 7],
        "n": 3,
    }


def test_engine_flags_that_change_nothing_warn_once(tmp_path):
    """--aging-steps under fcfs / priority, --swap-space without swap preemption and
    --gpu-memory-utilization on a CPU were silent no-ops; each given one gets one warning line.
    Defaults and flags that apply warn nothing."""
    src = tmp_path / "j.jsonl"
    src.write_text(json.dumps({"prompt": "p"}) + "\n")
    flags = ["--aging-steps", "10", "--swap-space", "2", "--gpu-memory-utilization", "0.5", "--device", "cpu"]
    r = invoke(str(src), "--model", NO_MODEL, *flags)
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 3, r.stderr
    assert "--aging-steps applies only to --policy max-throughput (this run: fcfs)" in warnings[0]
    assert "--swap-space applies only with --preemption-mode swap" in warnings[1]
    assert "--gpu-memory-utilization applies only on CUDA" in warnings[2]
    r = invoke(str(src), "--model", NO_MODEL, "--policy", "priority", "--aging-steps", "10")
    assert r.stderr.count("warning: --aging-steps") == 1
    applied = ["--policy", "max-throughput", "--aging-steps", "10", "--preemption-mode", "swap"]
    r = invoke(str(src), "--model", NO_MODEL, *applied, "--swap-space", "2", "--device", "cpu")
    assert "warning:" not in r.stderr, r.stderr
    r = invoke(str(src), "--model", NO_MODEL, "--device", "cpu")
    assert "warning:" not in r.stderr, r.stderr
    # An invalid value is the command's error alone, not also "ignored" (found by a new user).
    r = invoke(str(src), "--model", NO_MODEL, "--swap-space", "-1", "--device", "cpu")
    assert r.exit_code == 2 and "swap_space must be >= 0" in r.stderr and "warning:" not in r.stderr, r.stderr


def test_inert_options_for_bench_policy_lists():
    """`batchgen bench` checks the same flags; its --policy is a comma list."""
    from batchgen.cli_types import inert_options

    engine = {"preemption_mode": "recompute", "device": "cpu"}
    assert inert_options(engine, {"aging_steps"}, "fcfs,max-throughput") == []
    assert inert_options(engine, {"aging_steps"}, "fcfs,priority")[0].startswith("--aging-steps applies only")
    assert inert_options({**engine, "preemption_mode": "swap"}, {"swap_space"}, "fcfs") == []
    assert inert_options({**engine, "device": "cuda"}, {"gpu_memory_utilization"}, "fcfs") == []


# ----- real runs on a tiny model -----


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


def test_jsonl_input(tmp_path, tiny):
    src = tmp_path / "job.jsonl"
    src.write_text(
        "\n".join(json.dumps({"id": f"r{i}", "prompt": p, "topic": i}) for i, p in enumerate(PROMPTS)) + "\n"
    )
    # A column named twice is kept once.
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    r = invoke(
        str(src), *engine_args(tiny), "--keep-columns", "topic,topic", "--keep-columns", "topic",
        "--policy", "max-throughput",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    # The command ignores these signals once its rows are committed; an in-process caller gets its
    # own handlers back (processes it starts later would inherit the ignored ones).
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    t = pq.read_table(tmp_path / "job.out.parquet")
    assert t.schema.names == [*SCHEMA, "topic"]
    rows = t.to_pylist()
    assert [x["row_index"] for x in rows] == list(range(5)) and [x["id"] for x in rows] == [
        f"r{i}" for i in range(5)
    ]
    assert [x["topic"] for x in rows] == list(range(5))
    for x in rows:
        assert (
            x["finish_reason"] in ("stop", "length") and x["error"] is None and isinstance(x["output"], str)
        )
        assert (
            x["prompt_tokens"] > 0 and 1 <= x["completion_tokens"] <= 8 and 0 <= x["ttft_s"] <= x["latency_s"]
        )


def test_parquet_input_with_template(tmp_path, tiny):
    src = tmp_path / "docs.parquet"
    # "num": a column the job does not use (a column "n" would be vLLM's n, completions per row).
    pq.write_table(pa.table({"document": PROMPTS, "num": list(range(5))}), src, row_group_size=2)
    out = tmp_path / "summaries.parquet"
    r = invoke(
        str(src),
        *engine_args(tiny),
        "--template",
        "Summarize in one sentence.\n\n{document}",
        "--system-prompt",
        "Be brief.",
        "--output",
        str(out),
    )
    assert r.exit_code == 0, r.output
    t = pq.read_table(out)
    assert t.schema.names == SCHEMA and t.num_rows == 5
    assert t["row_index"].to_pylist() == list(range(5)) and t["id"].to_pylist() == [str(i) for i in range(5)]
    assert not os.path.exists(str(out) + ".parts")
    # The engine saw each document inside the template, after the system prompt, as a chat.
    from transformers import AutoTokenizer

    from batchgen.engine.tokenize import encode_prompt

    tok = AutoTokenizer.from_pretrained(tiny)
    expected = [
        len(
            encode_prompt(
                tok,
                [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": f"Summarize in one sentence.\n\n{doc}"},
                ],
            )[1]
        )
        for doc in PROMPTS
    ]
    assert t["prompt_tokens"].to_pylist() == expected


def test_openai_batch_input(tmp_path, tiny):
    lines = []
    for i, p in enumerate(PROMPTS):
        if i % 2:
            url, body = "/v1/completions", {"model": "x", "prompt": p, "max_tokens": 4}
        else:
            url, body = "/v1/chat/completions", {"model": "x", "messages": [{"role": "user", "content": p}]}
        lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}))
    src = tmp_path / "batch.jsonl"
    src.write_text("\n".join(lines) + "\n")
    r = invoke(str(src), *engine_args(tiny))
    assert r.exit_code == 0, r.output
    out = [json.loads(x) for x in (tmp_path / "batch.out.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in out] == [f"req-{i}" for i in range(5)]
    for i, x in enumerate(out):
        assert x["error"] is None and x["id"].startswith("batch_req_")
        resp = x["response"]
        assert resp["status_code"] == 200 and resp["request_id"]
        body = resp["body"]
        usage = body["usage"]
        assert (
            usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
            and usage["prompt_tokens"] > 0
        )
        choice = body["choices"][0]
        if i % 2:
            assert body["object"] == "text_completion" and isinstance(choice["text"], str)
            assert usage["completion_tokens"] <= 4
        else:
            assert body["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
        assert choice["finish_reason"] in ("stop", "length")


def test_rerun_after_completion_and_changed_settings(tmp_path, tiny):
    src = tmp_path / "job.jsonl"
    src.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS[:2]) + "\n")
    assert invoke(str(src), *engine_args(tiny)).exit_code == 0
    r = invoke(str(src), *engine_args(tiny))
    assert r.exit_code == 0 and "already complete" in r.stdout
    r = invoke(str(src), *engine_args(tiny), "--temperature", "0.8")
    assert r.exit_code == 2 and "--overwrite" in r.stderr
    assert (
        invoke(str(src), *engine_args(tiny), "--temperature", "0.8", "--seed", "1", "--overwrite").exit_code
        == 0
    )


def test_error_rows_are_summarised_and_a_job_of_only_errors_exits_3(tmp_path, tiny):
    src = tmp_path / "job.jsonl"
    src.write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n" + json.dumps({"prompt": ""}) + "\n")
    r = invoke(str(src), *engine_args(tiny))
    assert r.exit_code == 0, r.output
    assert "error rows: 1 this run" in r.stdout and "row 1 (line 2)" in r.stdout
    r = invoke(str(src), *engine_args(tiny))
    assert (
        r.exit_code == 0
        and "already complete (same input and settings), 1 of its 2 rows are error rows" in r.stdout
    )
    # An 8 KiB KV cache (16 tokens of the tiny model in float32) holds none of these prompts: every row
    # fails, the command's problem, so a script checking the exit code must see it. The output is
    # still written.
    src.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS[:3]) + "\n")
    args = [a if a != "64MiB" else "8KiB" for a in engine_args(tiny)] + [
        "--block-size",
        "16",
        "--dtype",
        "float32",
    ]
    r = invoke(str(src), *args, "--overwrite")
    assert r.exit_code == 3, r.output
    assert "every one of the 3 rows failed" in r.stderr and "max_model_len is 16 (lowered" in r.stderr
    assert "give the KV cache more memory" in r.stderr and "raise --max-model-len" not in r.stderr
    rows = pq.read_table(tmp_path / "job.out.parquet").to_pylist()
    assert [x["finish_reason"] for x in rows] == ["error"] * 3
    # Rerunning the finished job reports it complete, and still as a failure a script must see.
    r = invoke(str(src), *args)
    assert (
        r.exit_code == 3 and "already complete" in r.stdout and "every one of the 3 rows failed" in r.stderr
    )


def test_error_rows_are_counted_in_every_output_format(tmp_path):
    from batchgen.jobs.output.final_output import count_output_errors
    from batchgen.jobs.output.json_lines import openai_record, to_json

    base = {"row_hash": 7, "endpoint": "chat", "created": 0, "output": "hi", "prompt_tokens": 3}
    rows = [
        {**base, "id": "a", "finish_reason": "stop", "error": None, "completion_tokens": 1},
        {**base, "id": "b", "finish_reason": "error", "error": "row 1 (line 2): bad", "completion_tokens": 0},
        {
            **base,
            "id": "c",
            "finish_reason": "error",
            "error": "row 2 (line 3): worse",
            "completion_tokens": 0,
        },
    ]
    plain, openai = tmp_path / "out.jsonl", tmp_path / "out.openai.jsonl"
    plain.write_text("".join(to_json(r) + "\n" for r in rows))
    openai.write_text("".join(to_json(openai_record(r, "m")) + "\n" for r in rows))
    pq.write_table(
        pa.Table.from_pylist([{k: r[k] for k in ("id", "finish_reason", "error")} for r in rows]),
        tmp_path / "out.parquet",
    )
    expected = (3, 2, "row 1 (line 2): bad")
    assert count_output_errors(str(plain), "jsonl") == expected
    assert count_output_errors(str(openai), "openai") == expected
    assert count_output_errors(str(tmp_path / "out.parquet"), "parquet") == expected


def test_output_suffixes_are_matched_in_any_case():
    from batchgen.jobs.options import check_output_path, output_format

    check_output_path("OUT.PARQUET", "in.jsonl")
    check_output_path("out.NDJSON", "in.jsonl")
    assert (
        output_format("OUT.JSONL", "jsonl") == "jsonl" and output_format("OUT.PARQUET", "jsonl") == "parquet"
    )
    from batchgen.jobs.errors import JobInputError

    with pytest.raises(JobInputError, match=r"\.jsonl, \.ndjson or \.json"):
        check_output_path("out.csv", "in.jsonl")
