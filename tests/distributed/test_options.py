"""The scale-out options without a Ray cluster: `--replicas 1` imports no Ray, shard sizes, part
names, option checks, and the error when Ray is missing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen.distributed.driver import MIN_SHARD_ROWS, shard_size
from batchgen.distributed.pool import ReplicaOptions, import_ray
from batchgen.distributed.replica import Shard
from batchgen.jobs.errors import JobInputError

REPO = Path(__file__).resolve().parents[2]


def test_one_replica_is_the_local_path_and_imports_no_ray(tmp_path, tiny_model_dir):
    src = tmp_path / "job.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"Say {i}."}) + "\n" for i in range(3)))
    out = tmp_path / "job.out.parquet"
    argv = ["batchgen", "run", str(src), "--output", str(out), "--model", str(tiny_model_dir("llama"))]
    argv += [
        "--max-tokens",
        "2",
        "--kv-cache-memory",
        "16MiB",
        "--num-threads",
        "1",
        "--no-dashboard",
        "--replicas",
        "1",
    ]
    script = (
        "import sys\n"
        f"sys.argv = {argv!r}\n"
        "from batchgen.__main__ import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "loaded = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert out.exists()


def test_shard_sizes_keep_the_last_wave_short():
    assert shard_size(1000, 2, 1000) == 125  # four shards a replica
    assert shard_size(200_000, 2, 1000) == 1000  # at most --commit-every
    assert shard_size(24, 2, 1000) == MIN_SHARD_ROWS  # big enough to batch
    assert shard_size(24, 2, 4) == 4
    assert shard_size(None, 2, 500) == 500
    assert shard_size(1000, 2, 1000, override=7) == 7


def test_parts_are_named_by_their_rows():
    assert Shard(120, 239, []).name == "part-r000000000120-000000000239.parquet"


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"replicas": 0}, "--replicas"),
        ({"num_cpus": 0}, "--cpus-per-replica"),
        ({"num_gpus": -1}, "--gpus-per-replica"),
        ({"max_restarts": -2}, "max_restarts"),
    ],
)
def test_bad_replica_options_name_their_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        ReplicaOptions(**kwargs)


def test_without_ray_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(JobInputError, match=r'pip install "batchgen\[ray\]"'):
        import_ray()


def test_ray_address_local_means_a_ray_instance_of_this_run():
    assert ReplicaOptions(1, "local").address is None
    assert ReplicaOptions(1, "auto").address == "auto"
