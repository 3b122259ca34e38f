"""Time a SwiGLU layer's gate/up projection with SiLU(gate) * up: batchgen's AMX linear followed by
the C `silu_mul_bf16` pass, against the same kernel with SiLU-and-multiply in its store
(`AmxLinear.swiglu`, csrc/amx_linear.c `amx_swiglu`), and oneDNN's prepacked linear followed by the
same C pass. Checks that the fused output is bit for bit the unfused one first.

Shapes default to SmolLM2-135M's MLP (hidden 576, intermediate 1536), bf16, random weights; each
figure is the fastest quarter's boundary of `--rounds` calls (milliseconds), one output buffer
allocated per call as the model does.

Run from the repository root: `python benchmarks/kernels/swiglu_bench.py --num-threads 2`.
Needs a CPU with AMX (amx_bf16, amx_tile) and a C compiler.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from batchgen.kernels.cpu.linear import AmxLinear, PrepackedLinear, amx_kernel_available  # noqa: E402
from batchgen.kernels.cpu.ops import silu_mul_bf16  # noqa: E402


def quartile_ms(fn, rounds: int) -> float:
    """The first quartile of `rounds` timed calls after one warm-up, in milliseconds."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 4] * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden-size", type=int, default=576)
    parser.add_argument("--intermediate-size", type=int, default=1536)
    parser.add_argument("--rows", default="1,16,64,256,512,2048", help="row counts, comma list")
    parser.add_argument("--num-threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    if not amx_kernel_available():
        print("batchgen's AMX kernel is not available on this machine (needs amx_bf16, amx_tile, Linux, cc)")
        return 1
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(0)
    gate_up = torch.nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False, dtype=torch.bfloat16)
    gate_up.requires_grad_(False)
    amx, onednn = AmxLinear.from_linear(gate_up), PrepackedLinear.from_linear(gate_up)
    print(f"gate/up {2 * args.intermediate_size}x{args.hidden_size} bf16, {args.num_threads} threads (ms)")
    print(
        f"{'rows':>6} {'amx + silu':>11} {'amx fused':>10} {'onednn + silu':>14} {'fused / amx + silu':>19}"
    )
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, args.hidden_size).to(torch.bfloat16)
        if not torch.equal(amx.swiglu(x), silu_mul_bf16(amx(x))):
            print(f"{rows} rows: fused output differs from the unfused one")
            return 1
        unfused = quartile_ms(lambda x=x: silu_mul_bf16(amx(x)), args.rounds)
        fused = quartile_ms(lambda x=x: amx.swiglu(x), args.rounds)
        library = quartile_ms(lambda x=x: silu_mul_bf16(onednn(x)), args.rounds)
        print(f"{rows:>6} {unfused:>11.3f} {fused:>10.3f} {library:>14.3f} {fused / unfused:>18.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
