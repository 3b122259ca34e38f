"""The engine's host time a step at a full decode batch: what a step spends outside the model's
forward and the sampler (scheduling, inputs, token masks, update, outputs), from `StepStats`.

    python scripts/host_time.py                      # default model, 256 rows, bf16 where native
    python scripts/host_time.py --rows 256 --output-len 24 --profile   # and a cProfile of the steps

`--rows` prompts of `--input-len` random token ids each generate exactly `--output-len` tokens
(ignore_eos) with `max_num_seqs = rows`, so every step after the prefills decodes all rows. Prints
the medians over those decode steps of the host time and its parts (ms), the forward and the
sampler. The figures go to docs/benchmarks.md, not here.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics

import numpy as np

from batchgen.config import EngineConfig
from batchgen.engine.llm_engine import LLMEngine
from batchgen.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the decode steps")
    args = parser.parse_args()

    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            max_num_seqs=args.rows,
            max_num_batched_tokens=max(2048, args.rows * args.input_len),
            num_threads=args.num_threads,
        )
    )
    rng = np.random.default_rng(0)
    vocab = engine.vocab_limit
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    for i in range(args.rows):
        prompt = {"prompt_token_ids": rng.integers(100, vocab, args.input_len).tolist()}
        engine.add_request(str(i), prompt, params)
    profiler = cProfile.Profile() if args.profile else None
    decode_steps = []
    while engine.has_unfinished_requests():
        full = engine.scheduler.running and len(engine.scheduler.running) == args.rows
        if profiler is not None and full:
            profiler.enable()
        engine.step()
        if profiler is not None:
            profiler.disable()
        stats = engine.last_step
        if stats is not None and stats.num_prompt_tokens == 0 and stats.num_seqs == args.rows:
            decode_steps.append(stats)
    if not decode_steps:
        raise SystemExit("no decode step ran all rows: raise --output-len")

    def median_ms(values: list[float]) -> float:
        return 1000 * statistics.median(values)

    phases = [s.phases for s in decode_steps]
    print(f"{len(decode_steps)} decode steps at {args.rows} rows; {engine.start_line}")
    print(
        f"host {median_ms([s.host_time_s for s in decode_steps]):.3f} ms a step "
        f"(schedule {median_ms([p.schedule_s for p in phases]):.3f}, "
        f"inputs {median_ms([p.inputs_s for p in phases]):.3f}, "
        f"update {median_ms([p.update_s for p in phases]):.3f}, "
        f"masks {median_ms([s.mask_time_s for s in decode_steps]):.3f}); "
        f"forward {median_ms([p.forward_s for p in phases]):.1f}, "
        f"sampler {median_ms([p.sample_s for p in phases]):.1f}, "
        f"step {median_ms([s.step_time_s for s in decode_steps]):.1f}"
    )
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
