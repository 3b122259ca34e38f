"""Time from `batchgen run JOB` to its first committed row, for a first start (empty batchgen cache:
the GGUF conversion and the kernel measuring happen) and a second start (both cached).

    python scripts/first_row.py jobs/example.jsonl            # this machine as it is
    ONEDNN_MAX_CPU_ISA=AVX2 BATCHGEN_MAX_CPU_ISA=AVX2 python scripts/first_row.py jobs/example.jsonl

Each run commits every row (`--commit-every 1`), so the first line after the header in the output's
`manifest.jsonl` appears when the first row is on disk; the script polls for it every 50 ms and
lets the run finish. Extra arguments go to `batchgen run` (`--dtype float32`, ...). Prints one line
per start and the run's own "wall time" line. The figures go to docs/benchmarks.md, not here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

POLL_S = 0.05


def _first_row_seconds(job: str, output: str, cache: str, extra: list[str]) -> tuple[float, str]:
    """Seconds from launch to the first committed part, and the run's "wall time" line."""
    manifest = os.path.join(output + ".parts", "manifest.jsonl")
    env = dict(os.environ, BATCHGEN_CACHE=cache)
    cmd = ["batchgen", "run", job, "--output", output, "--no-dashboard", "--commit-every", "1", *extra]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = None
    while proc.poll() is None and first is None:
        try:
            with open(manifest) as f:
                if len(f.readlines()) >= 2:  # line 1 is the header, the next one the first part
                    first = time.monotonic() - start
        except FileNotFoundError:
            pass
        time.sleep(POLL_S)
    out, _ = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"batchgen run failed ({proc.returncode}):\n{out}")
    if first is None:  # finished between two polls: the whole run bounds it
        first = time.monotonic() - start
    wall = next((line for line in out.splitlines() if line.startswith("wall time")), "")
    return first, wall


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    job, extra = sys.argv[1], sys.argv[2:]
    with tempfile.TemporaryDirectory() as work:
        cache = os.path.join(work, "cache")
        for start in ("first", "second"):
            seconds, wall = _first_row_seconds(job, os.path.join(work, f"{start}.parquet"), cache, extra)
            print(f"{start} start: first committed row after {seconds:.1f} s ({wall})")


if __name__ == "__main__":
    main()
