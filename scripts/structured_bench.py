#!/usr/bin/env python
"""Issue 42's structured outputs benchmarks: job files over XSum articles, a check of a job's
output against its schemas, and the token masks' share of the step time at a full batch.

    # the job files: extract.jsonl (200 rows, one 5-field schema with an enum, an array and a
    # nested object), plain.jsonl (the same prompts, no constraint), distinct.jsonl (1,000 rows,
    # each its own schema) and shared.jsonl (the same 1,000 rows, one schema)
    python scripts/structured_bench.py jobs --out-dir /tmp/s42

    # 1. extraction: every "stop" row valid, the share of "length" rows
    batchgen run /tmp/s42/extract.jsonl --max-tokens 256 --overwrite --summary-json /tmp/s42/extract.json
    python scripts/structured_bench.py check /tmp/s42/extract.jsonl /tmp/s42/extract.out.parquet

    # 2. masks at 64 running structured rows (step profile), and output tok/s against the same
    # prompts unconstrained, each row generating as many tokens as its structured run did
    # (max_tokens = its completion tokens, ignore_eos): the two runs' "generated tok/s"
    python scripts/structured_bench.py mask --rows 128 --max-num-seqs 64
    python scripts/structured_bench.py matched /tmp/s42/extract.out.parquet /tmp/s42/plain.jsonl /tmp/s42/matched.jsonl
    batchgen run /tmp/s42/matched.jsonl --overwrite --summary-json /tmp/s42/matched.json

    # 3. 1,000 distinct schemas against one shared schema: wall time
    batchgen run /tmp/s42/distinct.jsonl --max-tokens 96 --overwrite --summary-json /tmp/s42/distinct.json
    batchgen run /tmp/s42/shared.jsonl --max-tokens 96 --overwrite --summary-json /tmp/s42/shared.json

Quoted in docs/benchmarks.md ("Structured outputs").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

DEFAULT_XSUM = Path(__file__).resolve().parents[2] / "shared" / "data" / "xsum" / "test.jsonl"
TOPICS = ["politics", "sport", "business", "science", "crime", "health", "other"]
INSTRUCTION = "Extract the facts of this news article as JSON.\n\n"


def article_schema(i: int | None = None) -> dict:
    """The extraction schema: headline, year, topic (an enum), people (an array) and place (a
    nested object), no other properties. With `i`, a variant of its own (its own topic list and
    field names), so each row of the distinct job compiles its own grammar."""
    tag = "" if i is None else f"_{i}"
    topics = TOPICS if i is None else [*TOPICS[: 3 + i % 4], f"topic{i}"]
    return {
        "type": "object",
        "properties": {
            f"headline{tag}": {"type": "string", "maxLength": 100},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "topic": {"enum": topics},
            "people": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 5},
            "place": {
                "type": "object",
                "properties": {
                    f"city{tag}": {"type": "string", "maxLength": 40},
                    "country": {"type": "string", "maxLength": 40},
                },
                "required": [f"city{tag}", "country"],
                "additionalProperties": False,
            },
        },
        "required": [f"headline{tag}", "year", "topic", "people", "place"],
        "additionalProperties": False,
    }


def articles(path: Path, n: int, chars: int) -> list[str]:
    docs = []
    with path.open() as f:
        for line in f:
            doc = json.loads(line).get("document", "").strip()
            if doc:
                docs.append(doc[:chars])
            if len(docs) == n:
                break
    return docs


def write_jobs(args: argparse.Namespace) -> None:
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    docs = articles(args.xsum, max(args.rows, args.distinct_rows), args.chars)

    def write(name: str, rows: list[dict]) -> None:
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {out / name} ({len(rows)} rows)")

    prompts = [{"id": str(i), "prompt": INSTRUCTION + d} for i, d in enumerate(docs)]
    write("extract.jsonl", [{**p, "json_schema": article_schema()} for p in prompts[: args.rows]])
    write("plain.jsonl", prompts[: args.rows])
    many = [prompts[i % len(prompts)] | {"id": str(i)} for i in range(args.distinct_rows)]
    write("distinct.jsonl", [{**p, "json_schema": article_schema(i)} for i, p in enumerate(many)])
    write("shared.jsonl", [{**p, "json_schema": article_schema()} for p in many])


def check(args: argparse.Namespace) -> None:
    """Every "stop" row of an output validates (jsonschema) against its input row's schema."""
    import jsonschema
    import pyarrow.parquet as pq

    schemas = {}
    for line in args.job.read_text().splitlines():
        row = json.loads(line)
        schemas[row["id"]] = row["json_schema"]
    rows = pq.read_table(args.output).to_pylist()
    reasons: dict[str, int] = {}
    invalid = []
    for row in rows:
        reasons[row["finish_reason"]] = reasons.get(row["finish_reason"], 0) + 1
        if row["finish_reason"] == "stop":
            try:
                jsonschema.validate(json.loads(row["output"]), schemas[row["id"]])
            except (ValueError, jsonschema.ValidationError) as e:
                invalid.append((row["id"], str(e)[:200]))
    stops = reasons.get("stop", 0)
    print(
        f"rows {len(rows)}: "
        + ", ".join(f"{k} {v} ({100 * v / len(rows):.1f}%)" for k, v in sorted(reasons.items()))
    )
    print(
        f"valid stop rows: {stops - len(invalid)} of {stops}"
        + (f" ({100 * (stops - len(invalid)) / stops:.1f}%)" if stops else "")
    )
    for rid, why in invalid[:10]:
        print(f"  invalid: row id {rid}: {why}")
    sys.exit(1 if invalid else 0)


def matched(args: argparse.Namespace) -> None:
    """The unconstrained job with each row's output length fixed to its structured run's: the
    plain rows with `max_tokens` = that row's completion tokens and `ignore_eos`, so both runs
    generate the same tokens."""
    import pyarrow.parquet as pq

    lengths = {r["id"]: r["completion_tokens"] for r in pq.read_table(args.output).to_pylist()}
    rows = [json.loads(line) for line in args.plain.read_text().splitlines()]
    kept = [{**r, "max_tokens": lengths[r["id"]], "ignore_eos": True} for r in rows if lengths.get(r["id"])]
    args.to.write_text("".join(json.dumps(r) + "\n" for r in kept))
    print(f"wrote {args.to} ({len(kept)} rows, {sum(r['max_tokens'] for r in kept)} output tokens)")


def mask_profile(args: argparse.Namespace) -> None:
    """Step profile of the token masks: one engine, `--rows` extraction requests queued at once;
    for the decode steps that sampled `--max-num-seqs` structured rows, the median mask time (fill
    on the CPU + apply), the median step time and their ratio."""
    from batchgen import EngineConfig, SamplingParams
    from batchgen.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(max_num_seqs=args.max_num_seqs, num_threads=args.num_threads))
    params = SamplingParams(
        temperature=0, max_tokens=args.max_tokens, structured_outputs={"json": article_schema()}
    )
    for i, doc in enumerate(articles(args.xsum, args.rows, args.chars)):
        engine.add_request(str(i), [{"role": "user", "content": INSTRUCTION + doc}], params)
    full = []
    while engine.has_unfinished_requests():
        engine.step()
        s = engine.last_step
        if s is not None and s.num_structured_seqs == args.max_num_seqs and s.num_prompt_tokens == 0:
            full.append((s.mask_time_s, s.step_time_s))
    if not full:
        sys.exit(f"no decode step ran {args.max_num_seqs} structured rows; queue more --rows")
    mask = statistics.median(m for m, _ in full)
    step = statistics.median(t for _, t in full)
    t = engine.totals
    print(
        f"{len(full)} decode steps at {args.max_num_seqs} structured rows: mask fill + apply median "
        f"{1e3 * mask:.2f} ms, step median {1e3 * step:.1f} ms ({100 * mask / step:.1f}% of the step); "
        f"whole run: masks {t.mask_time_s:.2f} s of {t.step_time_s:.1f} s of steps ({100 * t.mask_time_s / t.step_time_s:.1f}%)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--xsum", type=Path, default=DEFAULT_XSUM, help="XSum test.jsonl")
    parser.add_argument("--chars", type=int, default=1500, help="characters kept of each article")
    sub = parser.add_subparsers(dest="command", required=True)
    jobs = sub.add_parser("jobs", help="write the job files")
    jobs.add_argument("--out-dir", type=Path, required=True)
    jobs.add_argument("--rows", type=int, default=200)
    jobs.add_argument("--distinct-rows", type=int, default=1000)
    checker = sub.add_parser("check", help="validate a job's output against its rows' schemas")
    checker.add_argument("job", type=Path)
    checker.add_argument("output", type=Path)
    same = sub.add_parser("matched", help="the plain job with the structured run's output lengths")
    same.add_argument("output", type=Path, help="the structured run's output")
    same.add_argument("plain", type=Path, help="the plain job (jobs' plain.jsonl)")
    same.add_argument("to", type=Path, help="the job to write")
    mask = sub.add_parser("mask", help="the token masks' share of the step time")
    mask.add_argument("--rows", type=int, default=128)
    mask.add_argument("--max-num-seqs", type=int, default=64)
    mask.add_argument("--max-tokens", type=int, default=128)
    mask.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    {"jobs": write_jobs, "check": check, "matched": matched, "mask": mask_profile}[args.command](args)


if __name__ == "__main__":
    main()
