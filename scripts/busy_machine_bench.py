#!/usr/bin/env python
"""Throughput on a busy machine: the long-tail bench idle, then beside one busy process, in one run.

Issue 29's check: with one of two cores taken by another process, batchgen should keep at least
0.4x of its idle output tok/s (it runs on the cores left free, `batchgen.engine.cpu_threads`).
Each measurement is one `batchgen bench --mode continuous` subprocess on fresh prompts (another
seed each run, so no run reuses another's prefix cache); the busy process is a Python loop.

    python scripts/busy_machine_bench.py --num-prompts 32
    python scripts/busy_machine_bench.py --fixed-threads 2   # also: the thread count pinned, busy

Prints each run's output tok/s and the busy / idle ratios.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def bench(args: argparse.Namespace, seed: int, extra: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "bench.json"
        command = [
            sys.executable, "-m", "batchgen", "bench", "--dist", args.dist, "--num-prompts", str(args.num_prompts),
            "--mode", "continuous", "--no-ceiling", "--seed", str(seed), "--output", str(report), *extra,
        ]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=args.timeout)
        config = json.loads(report.read_text())["configurations"][0]
        return float(config["metrics"]["output_tokens_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dist", default="longtail")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument(
        "--fixed-threads", type=int, default=None, help="also run pinned to this many threads"
    )
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()

    idle = bench(args, seed=1, extra=[])
    print(f"idle: {idle:.1f} output tok/s", flush=True)
    busy_loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        busy = bench(args, seed=2, extra=[])
        print(f"one busy process: {busy:.1f} output tok/s ({busy / idle:.2f}x idle)", flush=True)
        if args.fixed_threads:
            pinned = bench(args, seed=3, extra=["--num-threads", str(args.fixed_threads)])
            print(
                f"one busy process, --num-threads {args.fixed_threads}: {pinned:.1f} output tok/s "
                f"({pinned / idle:.2f}x idle)"
            )
    finally:
        busy_loop.kill()
        busy_loop.wait()


if __name__ == "__main__":
    main()
