"""Tokens/s of `LLM.generate` on XSum summarization prompts (the default model, greedy).

Usage: python scripts/generate_throughput.py [--num-prompts 64] [--dtype bfloat16] [--max-tokens 64]
       [--num-threads N]
Reads ../shared/data/xsum/test.jsonl; prints prompt and generated tokens, wall time and tokens/s.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from batchgen import LLM, SamplingParams
from batchgen.bench.workload.job import read_job_rows

XSUM = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "xsum" / "test.jsonl"
INSTRUCTION = "Summarize the following article in one sentence.\n\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    docs = [row["document"] for row in read_job_rows(XSUM) if row["document"].strip()][: args.num_prompts]
    messages = [[{"role": "user", "content": INSTRUCTION + d}] for d in docs]
    llm = LLM(dtype=args.dtype, num_threads=args.num_threads)
    llm.generate(messages[:2], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(messages, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    wall = time.perf_counter() - start
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(
        f"{args.dtype}: {len(outputs)} prompts, {prompt} prompt + {generated} generated tokens in {wall:.1f} s: "
        f"{generated / wall:.1f} generated tok/s, {(prompt + generated) / wall:.1f} total tok/s"
    )


if __name__ == "__main__":
    main()
