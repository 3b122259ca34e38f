#!/usr/bin/env python
"""Which requests make a job's tail, and how far along each was when it began.

Steps one `LLMEngine` over a `batchgen bench` workload (every request queued at once, as the bench's
continuous mode does for a job file) and, when fewer than `--tail-requests` requests are left
unfinished (issue 27's tail), prints each one left: output tokens done of its target, the step it
was first scheduled at, and its preemptions; then the steps in all and in the tail. Counts steps,
not seconds, so a busy machine does not change what it shows (the speculation gate is read from
the cached kernel table, or measured at start).

    python scripts/tail_anatomy.py --dist file:/tmp/xsum256_1024.jsonl --speculative-method ngram
    python scripts/tail_anatomy.py --dist file:/tmp/xsum256_1024.jsonl --speculative-method none

Quoted in docs/benchmarks.md ("Which rows make the tail with speculation").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from batchgen.bench.baselines.static import bench_sampling_params  # noqa: E402
from batchgen.bench.model_facts import bench_workload  # noqa: E402
from batchgen.bench.spec import WorkloadSpec  # noqa: E402
from batchgen.config import EngineConfig  # noqa: E402
from batchgen.engine.llm_engine import LLMEngine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dist", required=True, help="a bench workload, e.g. file:PATH (all its rows)")
    parser.add_argument("--num-prompts", type=int, default=0)
    parser.add_argument("--speculative-method", default="none", choices=["none", "ngram"])
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--tail-requests", type=int, default=8)
    args = parser.parse_args()
    engine = LLMEngine(
        EngineConfig(
            num_threads=args.num_threads,
            enable_prefix_caching=False,
            speculative_method=None if args.speculative_method == "none" else args.speculative_method,
        )
    )
    workload = bench_workload(
        WorkloadSpec(dist=args.dist, num_prompts=args.num_prompts),
        engine.tokenizer,
        engine.model_config,
        engine.max_model_len,
    )
    targets = {r.request_id: r.output_len for r in workload.requests}
    for r in workload.requests:
        engine.add_request(
            r.request_id,
            {"prompt_token_ids": r.prompt_token_ids},
            bench_sampling_params(r.output_len),
            time.perf_counter(),
        )
    first_step: dict[str, int] = {}
    seen = {}  # request id -> its Request, as last seen running
    unfinished = set(targets)
    step, tail_start = 0, None
    while engine.has_unfinished_requests():
        unfinished -= {out.request_id for out in engine.step() if out.finished}
        step += 1
        for request in engine.scheduler.running:
            first_step.setdefault(request.request_id, step)
            seen[request.request_id] = request
        if tail_start is None and len(unfinished) < args.tail_requests:
            tail_start = step
            print(f"tail starts after step {step}: {len(unfinished)} requests left")
            for rid in sorted(unfinished, key=lambda r: (len(r), r)):
                request = seen.get(rid)
                if request is None:
                    print(f"  request {rid}: not scheduled yet")
                    continue
                print(
                    f"  request {rid}: {request.num_output_tokens} of {targets[rid]} output tokens, first "
                    f"scheduled at step {first_step[rid]}, {request.num_preemptions} preemptions, "
                    f"{request.status.name.lower()}"
                )
    print(f"steps: {step} in all, {step - (tail_start or 0)} in the tail")


if __name__ == "__main__":
    main()
