"""Benchmark the Triton paged-attention kernels on a CUDA GPU.

Measures, with `triton.testing.do_bench` (CUDA events, L2 flushed between runs, median):
  1. the device's copy bandwidth: a large device-to-device copy, bytes read + written / time;
  2. decode attention at batch 1/16/64/256 and context 512/4096/32768 (bf16, head_dim 128, 32 query
     heads, 8 KV heads, block_size 16, random permuted block tables): achieved GB/s counting the K/V
     bytes read plus q and out, and its fraction of the copy bandwidth; with the automatic num_splits,
     the best of a num_splits sweep, and a tile sweep at batch 64 / context 4096;
  3. prefill attention TFLOP/s for 4 chunks of 2048 tokens, without and with a 2048-token cached
     prefix (causal FLOPs: 4 * head_dim per query-key pair), next to torch SDPA on the same causal
     problem without a prefix, and a tile sweep.

Every stage runs on its own: a failure is recorded in the JSON and the next stage runs. Stages stop
starting new configurations once `--budget-s` seconds have passed. `--quick` runs every stage at
tiny sizes (64 MB copy, contexts of 256 and 1,024, one 256-token prefill chunk, two tiles a sweep):
a check that it runs, in seconds, not a measurement. Prints a table and writes JSON to
`$OUT/kernel_bench.json` when $OUT is set, else `kernel_bench.json` (or `--out`).

Run from the repository root: `PYTHONPATH=. python benchmarks/kernels/kernel_bench.py`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback

import torch

DEVICE = "cuda"
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
COPY_BYTES = 2 * 1024**3
TARGET = (64, 4096)  # (batch, context) of the decode bandwidth target and the tile sweep
PREFILL_BATCH, PREFILL_CHUNK = 4, 2048
DTYPE = torch.bfloat16
DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXTS = (512, 4096, 32768)
MAX_CACHE_BYTES = 60e9
SPLIT_SWEEP = (1, 2, 4, 8, 16, 32, 64)
DECODE_TILE_SWEEP = [  # (BLOCK_N, num_warps, num_stages)
    (32, 4, 3),
    (64, 4, 2),
    (64, 4, 3),
    (64, 4, 4),
    (64, 8, 3),
    (128, 4, 2),
    (128, 4, 3),
    (128, 8, 3),
    (256, 8, 2),
]
PREFILL_TILE_SWEEP = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    (128, 64, 8, 3),
    (128, 64, 8, 2),
    (128, 128, 8, 2),
    (64, 64, 4, 3),
    (128, 32, 4, 3),
    (64, 128, 4, 2),
]

# --quick: every stage at tiny sizes (tests/benchmarks/test_kernel_benchmarks.py).
QUICK_SIZES = {
    "COPY_BYTES": 64 * 1024**2,
    "TARGET": (4, 1024),
    "PREFILL_BATCH": 1,
    "PREFILL_CHUNK": 256,
    "DECODE_BATCHES": (1, 4),
    "DECODE_CONTEXTS": (256, 1024),
    "DECODE_TILE_SWEEP": DECODE_TILE_SWEEP[:2],
    "PREFILL_TILE_SWEEP": PREFILL_TILE_SWEEP[:2],
}


class Bench:
    def __init__(self, budget_s: float, out_path: str):
        self.start = time.perf_counter()
        self.budget_s = budget_s
        self.out_path = out_path
        self.results: dict = {"errors": [], "skipped": []}

    def save(self) -> None:
        """Write the JSON (after every stage, so a run killed by a time limit still leaves its numbers)."""
        self.results["wall_s"] = time.perf_counter() - self.start
        try:
            with open(self.out_path, "w") as f:
                json.dump(self.results, f, indent=1)
        except OSError as exc:
            print(f"could not write {self.out_path}: {exc}", file=sys.stderr)

    def time_left(self) -> bool:
        return time.perf_counter() - self.start < self.budget_s

    def stage(self, name, fn):
        print(f"--- {name}", flush=True)
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # one failing stage must not stop the others
            self.results["errors"].append(
                {"stage": name, "error": repr(exc), "traceback": traceback.format_exc()}
            )
            print(f"    FAILED: {exc!r}", flush=True)
        torch.cuda.empty_cache()  # the stage's tensors are gone with its frame
        print(f"    ({time.perf_counter() - t0:.1f} s)", flush=True)
        self.save()


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    try:
        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    except (TypeError, AssertionError, ValueError):  # an older Triton without return_mode="median"
        return float(do_bench(fn, warmup=25, rep=100, quantiles=[0.5])[0])


def copy_bandwidth(bench: Bench) -> None:
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=DEVICE).random_(0, 255)
    dst = torch.empty_like(src)
    ms = bench_ms(functools.partial(dst.copy_, src))
    gbps = 2 * src.numel() / (ms * 1e-3) / 1e9
    bench.results["copy"] = {"bytes_moved": 2 * src.numel(), "ms": ms, "GBps": gbps}
    print(f"    copy {src.numel() / 1e9:.2f} GB: {ms:.3f} ms, {gbps:.0f} GB/s (read + written)")


def decode_bytes(batch: int, context: int) -> int:
    kv = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    q_and_out = 2 * batch * NUM_Q_HEADS * HEAD_DIM * DTYPE.itemsize
    return kv + q_and_out


def decode_configs() -> list[tuple[int, int]]:
    return [(b, c) for b in DECODE_BATCHES for c in DECODE_CONTEXTS]


def make_decode_inputs(k_all, v_all, batch, context, gen):
    """(query, k_cache, v_cache, block_tables, seq_lens): the argument order of paged_decode_attention."""
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    tables = (
        torch.randperm(num_blocks, device=DEVICE, generator=gen).to(torch.int32).view(batch, blocks_per_seq)
    )
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    query = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE, generator=gen)
    return query, k_all[:num_blocks], v_all[:num_blocks], tables, seq_lens


def decode(bench: Bench) -> None:
    from batchgen.kernels.triton import paged_decode_attention
    from batchgen.kernels.triton.decode_attention import choose_num_splits, num_sms

    copy_gbps = bench.results.get("copy", {}).get("GBps")
    configs = []
    for batch, context in decode_configs():
        cache_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
        if cache_bytes > MAX_CACHE_BYTES:
            bench.results["skipped"].append(
                f"decode batch {batch} context {context}: cache {cache_bytes / 1e9:.0f} GB"
            )
            continue
        configs.append((batch, context))
    max_blocks = max(b * c for b, c in configs) // BLOCK_SIZE
    shape = (max_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    k_all = torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_(generator=gen)
    v_all = torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_(generator=gen)
    sms = num_sms(torch.device(DEVICE))
    rows = bench.results["decode"] = []
    scale = HEAD_DIM**-0.5
    for batch, context in configs:
        if not bench.time_left():
            bench.results["skipped"].append(f"decode batch {batch} context {context}: out of time")
            continue
        inputs = make_decode_inputs(k_all, v_all, batch, context, gen)
        nbytes = decode_bytes(batch, context)
        auto = choose_num_splits(batch, NUM_KV_HEADS, context, sms)
        row = {"batch": batch, "context": context, "bytes": nbytes, "auto_splits": auto}
        row["ms"] = bench_ms(functools.partial(paged_decode_attention, *inputs, scale, max_seq_len=context))
        row["GBps"] = nbytes / (row["ms"] * 1e-3) / 1e9
        row["frac_copy"] = row["GBps"] / copy_gbps if copy_gbps else None
        # Split sweep wherever splitting could matter (fewer programs than ~4 per SM).
        if batch * NUM_KV_HEADS < 4 * sms and bench.time_left():
            sweep = {}
            for splits in SPLIT_SWEEP:
                if splits == 1 or context // splits >= 64:
                    sweep[splits] = bench_ms(
                        functools.partial(paged_decode_attention, *inputs, scale, splits)
                    )
            best = min(sweep, key=sweep.get)
            row["split_sweep_ms"] = sweep
            row["best_splits"] = best
            row["best_GBps"] = nbytes / (sweep[best] * 1e-3) / 1e9
        rows.append(row)
        frac = f"{row['frac_copy']:.0%}" if row["frac_copy"] else "-"
        best = (
            f"best splits {row['best_splits']}: {row['best_GBps']:.0f} GB/s" if "best_splits" in row else ""
        )
        print(
            f"    batch {batch:4d} context {context:6d}  splits {auto:2d}  {row['ms']:8.3f} ms  "
            f"{row['GBps']:6.0f} GB/s  {frac:>4s} of copy  {best}",
            flush=True,
        )


def decode_tiles(bench: Bench) -> None:
    """Tile sweep at the target point (TARGET); each config checked against the default config."""
    from batchgen.kernels.triton import paged_decode_attention

    batch, context = TARGET
    blocks = batch * context // BLOCK_SIZE
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    shape = (blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_all = torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_(generator=gen)
    v_all = torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_(generator=gen)
    inputs = make_decode_inputs(k_all, v_all, batch, context, gen)
    scale = HEAD_DIM**-0.5
    reference = paged_decode_attention(*inputs, scale, 1).float()
    copy_gbps = bench.results.get("copy", {}).get("GBps")
    nbytes = decode_bytes(batch, context)
    rows = bench.results["decode_tiles"] = []
    for block_n, warps, stages in DECODE_TILE_SWEEP:
        if not bench.time_left():
            bench.results["skipped"].append(f"decode tile {block_n}/{warps}/{stages}: out of time")
            continue
        cfg = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
        row = {"config": cfg}
        try:
            run = functools.partial(paged_decode_attention, *inputs, scale, 1, config=cfg)
            row["max_abs_diff"] = float((run().float() - reference).abs().max())
            row["ms"] = bench_ms(run)
            row["GBps"] = nbytes / (row["ms"] * 1e-3) / 1e9
            row["frac_copy"] = row["GBps"] / copy_gbps if copy_gbps else None
            print(
                f"    {cfg}: {row['ms']:.3f} ms {row['GBps']:.0f} GB/s diff {row['max_abs_diff']:.1e}",
                flush=True,
            )
        except Exception as exc:
            row["error"] = repr(exc)
            print(f"    {cfg}: FAILED {exc!r}", flush=True)
        rows.append(row)


def prefill_flops(query_len: int, prefix: int, batch: int) -> float:
    pairs = query_len * prefix + query_len * (query_len + 1) / 2
    return 4.0 * HEAD_DIM * pairs * NUM_Q_HEADS * batch


def make_prefill_inputs(batch, query_len, prefix, gen):
    """(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens), as paged_prefill_attention takes them."""
    seq_len = query_len + prefix
    blocks_per_seq = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, dtype=DTYPE, device=DEVICE, generator=gen)
    v = torch.randn(shape, dtype=DTYPE, device=DEVICE, generator=gen)
    tables = (
        torch.randperm(num_blocks, device=DEVICE, generator=gen).to(torch.int32).view(batch, blocks_per_seq)
    )
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE) * query_len
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=DEVICE)
    query = torch.randn(batch * query_len, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE, generator=gen)
    return query, k, v, tables, qsl, seq_lens


def prefill(bench: Bench) -> None:
    import torch.nn.functional as F

    from batchgen.kernels.triton import paged_prefill_attention

    batch, query_len = PREFILL_BATCH, PREFILL_CHUNK
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    scale = HEAD_DIM**-0.5
    rows = bench.results["prefill"] = []
    for prefix in (0, query_len):
        inputs = make_prefill_inputs(batch, query_len, prefix, gen)
        flops = prefill_flops(query_len, prefix, batch)
        ms = bench_ms(functools.partial(paged_prefill_attention, *inputs, query_len, scale))
        row = {
            "batch": batch,
            "query_len": query_len,
            "prefix": prefix,
            "flops": flops,
            "ms": ms,
            "TFLOPs": flops / (ms * 1e-3) / 1e12,
        }
        if prefix == 0:
            # torch SDPA (flash / cuDNN) on the same causal problem, contiguous K/V, as a yardstick.
            q = torch.randn(
                batch, NUM_Q_HEADS, query_len, HEAD_DIM, dtype=DTYPE, device=DEVICE, generator=gen
            )
            kk = torch.randn(
                batch, NUM_KV_HEADS, query_len, HEAD_DIM, dtype=DTYPE, device=DEVICE, generator=gen
            )
            vv = torch.randn_like(kk)
            try:
                sdpa = functools.partial(
                    F.scaled_dot_product_attention, q, kk, vv, is_causal=True, enable_gqa=True
                )
                sdpa_ms = bench_ms(sdpa)
                row["sdpa_ms"] = sdpa_ms
                row["sdpa_TFLOPs"] = flops / (sdpa_ms * 1e-3) / 1e12
            except Exception as exc:
                row["sdpa_error"] = repr(exc)
        rows.append(row)
        note = f"(torch SDPA {row['sdpa_TFLOPs']:.0f})" if "sdpa_TFLOPs" in row else ""
        print(
            f"    {batch} x {query_len} chunk, prefix {prefix:4d}: {ms:.3f} ms {row['TFLOPs']:.0f} TFLOP/s {note}",
            flush=True,
        )
        del inputs


def prefill_tiles(bench: Bench) -> None:
    from batchgen.kernels.triton import paged_prefill_attention

    batch, query_len = PREFILL_BATCH, PREFILL_CHUNK
    prefix = query_len
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    inputs = make_prefill_inputs(batch, query_len, prefix, gen)
    scale = HEAD_DIM**-0.5
    reference = paged_prefill_attention(*inputs, query_len, scale).float()
    flops = prefill_flops(query_len, prefix, batch)
    rows = bench.results["prefill_tiles"] = []
    for block_m, block_n, warps, stages in PREFILL_TILE_SWEEP:
        if not bench.time_left():
            bench.results["skipped"].append(f"prefill tile {block_m}/{block_n}/{warps}/{stages}: out of time")
            continue
        cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
        row = {"config": cfg}
        try:
            run = functools.partial(paged_prefill_attention, *inputs, query_len, scale, config=cfg)
            row["max_abs_diff"] = float((run().float() - reference).abs().max())
            row["ms"] = bench_ms(run)
            row["TFLOPs"] = flops / (row["ms"] * 1e-3) / 1e12
            print(
                f"    {cfg}: {row['ms']:.3f} ms {row['TFLOPs']:.0f} TFLOP/s diff {row['max_abs_diff']:.1e}",
                flush=True,
            )
        except Exception as exc:
            row["error"] = repr(exc)
            print(f"    {cfg}: FAILED {exc!r}", flush=True)
        rows.append(row)


def print_table(results: dict) -> None:
    copy = results.get("copy", {}).get("GBps")
    print("\n=== kernel_bench summary ===")
    print(
        f"device: {results.get('device')}   copy bandwidth: {copy:.0f} GB/s"
        if copy
        else f"device: {results.get('device')}"
    )
    print(
        f"{'decode':>8s} {'batch':>6s} {'context':>8s} {'splits':>6s} {'ms':>9s} {'GB/s':>7s} {'of copy':>8s} {'best split':>11s} {'GB/s':>7s}"
    )
    for r in results.get("decode", []):
        frac = f"{r['frac_copy']:.0%}" if r.get("frac_copy") else "-"
        best = f"{r['best_splits']:>11d} {r['best_GBps']:7.0f}" if "best_splits" in r else ""
        print(
            f"{'':>8s} {r['batch']:6d} {r['context']:8d} {r['auto_splits']:6d} {r['ms']:9.3f} {r['GBps']:7.0f} {frac:>8s} {best}"
        )
    tiles = [r for r in results.get("decode_tiles", []) if "ms" in r]
    if tiles:
        best = min(tiles, key=lambda r: r["ms"])
        print(f"decode tiles (batch, context {TARGET}): best {best['config']} {best['GBps']:.0f} GB/s")
    for r in results.get("prefill", []):
        sdpa = f"   torch SDPA {r['sdpa_TFLOPs']:.0f} TFLOP/s" if "sdpa_TFLOPs" in r else ""
        print(
            f"prefill {r['batch']} x {r['query_len']} prefix {r['prefix']:4d}: {r['ms']:.3f} ms {r['TFLOPs']:.0f} TFLOP/s{sdpa}"
        )
    tiles = [r for r in results.get("prefill_tiles", []) if "ms" in r]
    if tiles:
        best = min(tiles, key=lambda r: r["ms"])
        print(f"prefill tiles (prefix = chunk): best {best['config']} {best['TFLOPs']:.0f} TFLOP/s")
    target = next((r for r in results.get("decode", []) if (r["batch"], r["context"]) == TARGET), None)
    if target and target.get("frac_copy"):
        verdict = "MET" if target["frac_copy"] >= 0.70 else "NOT MET"
        print(
            f"target decode >= 70% of copy bandwidth at (batch, context) {TARGET}: {target['frac_copy']:.0%} {verdict}"
        )
    for e in results["errors"]:
        print(f"ERROR in {e['stage']}: {e['error']}")
    for s in results["skipped"]:
        print(f"skipped: {s}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget-s", type=float, default=300.0, help="stop starting new configs after this long"
    )
    parser.add_argument(
        "--out", default=None, help="JSON path (default $OUT/kernel_bench.json or kernel_bench.json)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: check that it runs, in seconds")
    args = parser.parse_args()
    if args.quick:
        globals().update(QUICK_SIZES)  # the stages read the sizes from the module
    out_path = args.out or os.path.join(os.environ.get("OUT") or ".", "kernel_bench.json")
    if not torch.cuda.is_available():
        print("kernel_bench: no CUDA device; nothing to measure", file=sys.stderr)
        return 1
    bench = Bench(args.budget_s, out_path)
    import triton

    bench.results["device"] = torch.cuda.get_device_name()
    bench.results["versions"] = {"torch": torch.__version__, "triton": triton.__version__}
    bench.results["shape"] = {
        "dtype": str(DTYPE),
        "num_q_heads": NUM_Q_HEADS,
        "num_kv_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "block_size": BLOCK_SIZE,
    }
    bench.stage("copy bandwidth", lambda: copy_bandwidth(bench))
    bench.stage("decode attention", lambda: decode(bench))
    bench.stage("prefill attention", lambda: prefill(bench))
    bench.stage("decode tile sweep", lambda: decode_tiles(bench))
    bench.stage("prefill tile sweep", lambda: prefill_tiles(bench))
    bench.save()
    print(f"wrote {out_path}")
    print_table(bench.results)
    return 1 if bench.results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
