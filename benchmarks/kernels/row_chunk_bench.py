"""A CPU prefill step at different row-slice sizes (`llama.prefill_row_chunk`), interleaved and paired.

One step is 6 prompts of 341 tokens (2,046 tokens, the CPU's default token budget) through the
default model (or `--model`). Each round runs the step once under every slice size in turn, so a
slow spell of a shared machine hits them alike; the script prints each size's min and median
milliseconds and, for two sizes, the median of the per-round ratios:

    python benchmarks/kernels/row_chunk_bench.py --rows 512 2048 --rounds 15 --num-threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from batchgen.config import EngineConfig  # noqa: E402
from batchgen.engine.llm_engine import LLMEngine  # noqa: E402
from batchgen.model import llama  # noqa: E402
from batchgen.model.runner import StepInput  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model path (default: the default model)")
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 2048], help="slice sizes to compare")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=341)
    parser.add_argument(
        "--kernels", default="auto", help="the engine's kernel choice: auto, native, reference"
    )
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    engine = LLMEngine(EngineConfig(model=args.model, enable_prefix_caching=False, kernels=args.kernels))
    blocks = -(-args.prompt_len // engine.block_size)
    step = [
        StepInput(token_ids=[100 + i] * args.prompt_len, start=0, block_table=list(range(i * blocks, (i + 1) * blocks)), sample=True)
        for i in range(args.prompts)
    ]  # fmt: skip
    original = llama.prefill_row_chunk
    times: dict[int, list[float]] = {rows: [] for rows in args.rows}
    try:
        for _ in range(args.rounds):
            for rows in args.rows:
                llama.prefill_row_chunk = lambda *_, rows=rows: rows
                engine.runner.execute(step)  # warm: the first call after a change pays allocations
                start = time.perf_counter()
                engine.runner.execute(step)
                times[rows].append(time.perf_counter() - start)
    finally:
        llama.prefill_row_chunk = original
    for rows, ts in times.items():
        print(f"rows {rows:5d}: min {min(ts) * 1e3:7.1f} ms, median {statistics.median(ts) * 1e3:7.1f} ms")
    if len(args.rows) == 2:
        first, second = (times[rows] for rows in args.rows)
        ratios = [b / a for a, b in zip(first, second, strict=True)]
        wins = sum(r < 1 for r in ratios)
        print(
            f"rows {args.rows[1]} / rows {args.rows[0]}: median ratio {statistics.median(ratios):.3f} "
            f"({wins}/{len(ratios)} rounds faster)"
        )


if __name__ == "__main__":
    main()
