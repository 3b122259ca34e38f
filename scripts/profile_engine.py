#!/usr/bin/env python
"""Profile batchgen's engine on a bench workload: where a step's time goes, split by phase.

Runs the `batchgen bench` workload (default: long-tail, 64 prompts) through one `LLMEngine` with
continuous batching and prints:

- per-phase totals: steps that hold prefill tokens ("prefill"), steps that verify speculative drafts
  ("verify", with `--speculative-method ngram`) and steps of decodes only ("decode"),
  with their step count, tokens and wall seconds;
- with `--torch-profiler`, the top operators of each phase by self CPU time (`torch.profiler`);
  batchgen's C kernels, which torch cannot see, are listed as `batchgen::<function>`. The C decoder
  stack runs a step's layers in one call (`batchgen::decoder_stack_bf16`); `--no-decoder-stack`
  runs them layer by layer, so the table shows each kernel (and the Python around them).

This is the profile quoted in the notes of issue 6; run it before and after a speed change::

    python scripts/profile_engine.py --num-threads 1 --torch-profiler --top 15
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from batchgen.bench.baselines.static import bench_sampling_params, warmup_engine, warmup_prompt  # noqa: E402
from batchgen.bench.model_facts import bench_workload  # noqa: E402
from batchgen.bench.spec import WorkloadSpec  # noqa: E402
from batchgen.config import EngineConfig  # noqa: E402
from batchgen.engine.llm_engine import LLMEngine  # noqa: E402
from batchgen.kernels.cpu import library as cpu_kernels  # noqa: E402

# The C library's entry points that run a step's work (the others answer questions about it).
C_KERNELS = (
    "bf16_linear",
    "amx_linear",
    "paged_decode_attention",
    "paged_prefill_attention",
    "paged_prefill_attention_amx",
    "add_rms_norm_bf16",
    "silu_mul_bf16",
    "rotary_bf16",
    "store_kv_rows",
    "decoder_stack_bf16",
)


def label_c_kernels() -> None:
    """Wrap each C kernel of the loaded library in `record_function("batchgen::<name>")`, so the
    torch profiler's table shows their time (ctypes calls are invisible to it otherwise)."""
    lib = cpu_kernels.load_library()
    if lib is None:
        return
    for name in C_KERNELS:
        kernel = getattr(lib, name)

        def labelled(*args, _kernel=kernel, _label=f"batchgen::{name}"):
            with torch.profiler.record_function(_label):
                return _kernel(*args)

        setattr(lib, name, labelled)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--dist", default="longtail")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--scale", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", default="fcfs")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--torch-profiler", action="store_true", help="collect operator times (slower)")
    parser.add_argument("--top", type=int, default=12, help="operators to print per phase")
    parser.add_argument(
        "--profile-steps", type=int, default=0, help="profile only the first N steps (0 = all); prints each"
    )
    parser.add_argument(
        "--no-decoder-stack",
        action="store_true",
        help="run the layers one by one in Python (per-kernel profile) instead of the C decoder stack",
    )
    parser.add_argument("--speculative-method", default=None, help="ngram: prompt-lookup speculation")
    parser.add_argument("--num-speculative-tokens", type=int, default=None)
    args = parser.parse_args()

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.torch_profiler:
        label_c_kernels()
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            policy=args.policy,
            num_threads=args.num_threads,
            max_num_batched_tokens=args.max_num_batched_tokens,
            speculative_method=args.speculative_method,
            num_speculative_tokens=args.num_speculative_tokens,
        )
    )
    spec_args = {"dist": args.dist, "num_prompts": args.num_prompts, "seed": args.seed}
    if args.scale is not None:
        spec_args["scale"] = args.scale
    workload = bench_workload(
        WorkloadSpec(**spec_args), engine.tokenizer, engine.model_config, engine.max_model_len
    )
    if args.no_decoder_stack:
        engine.runner.model.decoder_stack = None
    warmup_engine(engine, warmup_prompt(workload.requests[0].prompt_token_ids))
    for r in workload.requests:
        engine.add_request(
            r.request_id, {"prompt_token_ids": r.prompt_token_ids}, bench_sampling_params(r.output_len)
        )

    phases = {"prefill": [0, 0, 0.0], "verify": [0, 0, 0.0], "decode": [0, 0, 0.0]}  # steps, tokens, s
    step_phase: list[str] = []
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    profiler_stopped = False
    if args.torch_profiler:
        profiler.start()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        with torch.profiler.record_function(f"step {len(step_phase)}"):
            engine.step()
        elapsed = time.perf_counter() - t
        s = engine.last_step
        phase = "prefill" if s.num_prompt_tokens else "verify" if s.num_drafts else "decode"
        step_phase.append(phase)
        if args.profile_steps and len(step_phase) <= args.profile_steps:
            print(
                f"step {len(step_phase) - 1}: {s.num_seqs} sequences, {s.num_batched_tokens} tokens, {elapsed:.3f} s"
            )
            if args.torch_profiler and len(step_phase) == args.profile_steps:
                profiler.stop()
                profiler_stopped = True
        phases[phase][0] += 1
        phases[phase][1] += s.num_batched_tokens
        phases[phase][2] += elapsed
    total = time.perf_counter() - start

    print(
        f"workload {workload.name}: {len(workload.requests)} requests, {workload.total_prompt_tokens} prompt + "
        f"{workload.total_output_tokens} output tokens; threads {torch.get_num_threads()}; wall {total:.1f} s"
    )
    by_phase = operator_times(profiler, step_phase, profiler_stopped) if args.torch_profiler else {}
    for phase, (steps, tokens, seconds) in phases.items():
        rate = tokens / seconds if seconds else 0.0
        print(f"{phase:8s} {steps:5d} steps {tokens:7d} tokens {seconds:7.2f} s {rate:8.1f} tokens/s")
        ops = by_phase.get(phase, {})
        profiled = sum(sec for sec, _ in ops.values()) or 1.0
        for name, (sec, count) in sorted(ops.items(), key=lambda kv: -kv[1][0])[: args.top]:
            print(f"    {sec:8.2f} s {100 * sec / profiled:5.1f}% {count:8d} calls  {name}")


def operator_times(
    profiler: torch.profiler.profile, step_phase: list[str], stopped: bool
) -> dict[str, dict[str, tuple[float, int]]]:
    """Self CPU seconds and calls of each operator, per phase, from one profile of the whole run.

    Every step ran inside `record_function("step N")`; an operator belongs to the phase of the step
    it ran under (found through its chain of parents). `stopped`: the profiler was stopped early
    (`--profile-steps`).
    """
    if not stopped:
        profiler.stop()
    out: dict[str, dict[str, tuple[float, int]]] = {}
    for event in profiler.events():
        root = event
        while root.cpu_parent is not None:
            root = root.cpu_parent
        if root is event or not root.name.startswith("step "):
            continue
        phase = step_phase[int(root.name.split()[1])]
        sec, count = out.setdefault(phase, {}).get(event.name, (0.0, 0))
        out[phase][event.name] = (sec + event.self_cpu_time_total / 1e6, count + 1)
    return out


if __name__ == "__main__":
    main()
