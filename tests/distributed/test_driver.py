"""The driver's loop without Ray: replicas run in this process on the model-free fake engine, so
shards, their commits and a resume after a failed replica are checked in a second."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchgen.config import EngineConfig
from batchgen.distributed.driver import replica_loop
from batchgen.distributed.pool import ReplicaOptions
from batchgen.distributed.replica import Replica, ReplicaInfo, Shard
from batchgen.jobs.errors import JobInputError
from batchgen.jobs.output.writer import PartWriter
from batchgen.jobs.runner import JobOptions, run_job
from tests.jobs.fake_engine import FakeEngine, fake_factory
from tests.jobs.real_engine import quiet

NUM_ROWS = 50


class InlinePool:
    """A `ReplicaPool` stand-in: `Replica`s on fake engines, each shard run when it is submitted.

    Args:
        fail_at: the submitted shard (0-based) whose result raises as a replica beyond its restarts.
    """

    def __init__(
        self,
        options: JobOptions,
        replicas: int = 2,
        shard_rows: int | None = 6,
        fail_at=None,
        engine=FakeEngine,
    ):
        self.options = ReplicaOptions(replicas=replicas, shard_rows=shard_rows)
        self.replicas = []
        for i in range(replicas):
            r = Replica.__new__(Replica)
            r.index, r.options, r.config, r.error = i, options, EngineConfig(), None
            r.engine = engine()
            self.replicas.append(r)
        self.infos = [ReplicaInfo(i, 1000 + i, "here") for i in range(replicas)]
        self.model_name = "fake"
        self.start_line = ""
        self.fail_at = fail_at
        self.shards: list[Shard] = []
        self._results: dict[int, object] = {}

    def submit(self, replica: int, shard: Shard) -> int:
        self.shards.append(shard)
        ref = len(self.shards) - 1
        self._results[ref] = self.replicas[replica].run_shard(shard)
        return ref

    def wait(self, refs, timeout):
        return list(refs)

    def result(self, ref, replica, shard):
        if ref == self.fail_at:
            raise JobInputError(f"replica {replica} failed on rows {shard[0]}..{shard[1]}")
        return self._results.pop(ref)


def write_job(path: Path) -> None:
    lines = []
    for i in range(NUM_ROWS):
        if i == 7:
            lines.append('{"id": "r7", "prompt": "unterminated')
        else:
            lines.append(
                json.dumps({"id": f"r{i}", "prompt": f"Tell me about {i}.", "max_tokens": 1 + i % 9})
            )
    path.write_text("\n".join(lines) + "\n")


def run(src: Path, out: Path, pool=None, **kw):
    options = JobOptions(str(src), output=str(out), **kw)
    if pool is None:
        return run_job(options, fake_factory(), dashboard=quiet())
    return run_job(options, lambda config: pool(options), dashboard=quiet(), loop=replica_loop)


def test_replicas_write_the_rows_of_one_engine_in_parts_named_by_rows(tmp_path, monkeypatch):
    src = tmp_path / "job.jsonl"
    write_job(src)
    run(src, tmp_path / "local.parquet")
    pools = []

    def make(options):
        pools.append(InlinePool(options))
        return pools[-1]

    parts = []
    commit = PartWriter.commit

    def recorded(self, name=None):
        entry = commit(self, name)
        if entry is not None:
            parts.append((entry.part, entry.min_row, entry.max_row, entry.rows))
        return entry

    monkeypatch.setattr(PartWriter, "commit", recorded)
    out = tmp_path / "replicas.parquet"
    summary = run(src, out, make)
    assert summary.complete and summary.rows_error == 1 and summary.rows_ok == NUM_ROWS - 1
    keys = ["row_index", "id", "output", "finish_reason", "prompt_tokens", "completion_tokens", "error"]
    assert (
        pq.read_table(out, columns=keys).to_pylist()
        == pq.read_table(tmp_path / "local.parquet", columns=keys).to_pylist()
    )
    shards = pools[0].shards
    assert [len(s.rows) for s in shards] == [6] * 8 + [2]
    assert parts == sorted(parts) and [p[0] for p in parts] == [s.name for s in shards]
    assert all(p[1:] == (s.first, s.last, len(s.rows)) for p, s in zip(parts, shards, strict=True))
    assert {s.first for s in shards[::2]} == {0, 12, 24, 36, 48}  # shards alternate between replicas


def test_a_replica_failing_keeps_committed_shards_and_a_rerun_runs_only_the_rest(tmp_path):
    src = tmp_path / "job.jsonl"
    write_job(src)
    run(src, tmp_path / "local.parquet")
    out = tmp_path / "replicas.parquet"
    with pytest.raises(JobInputError, match="replica 1 failed on rows 18..23"):
        run(src, out, lambda options: InlinePool(options, fail_at=3))
    manifest = (Path(str(out) + ".parts") / "manifest.jsonl").read_text().splitlines()[1:]
    assert [json.loads(line)["part"] for line in manifest] == [Shard(a, a + 5, []).name for a in (0, 6, 12)]
    pools = []

    def make(options):
        pools.append(InlinePool(options, shard_rows=None))
        return pools[-1]

    summary = run(src, out, make)
    assert summary.rows_resumed == 18 and summary.complete
    ran = [r.row_index for s in pools[0].shards for r in s.rows]
    assert ran == list(range(18, NUM_ROWS))
    keys = ["row_index", "id", "output", "finish_reason", "prompt_tokens", "completion_tokens", "error"]
    assert (
        pq.read_table(out, columns=keys).to_pylist()
        == pq.read_table(tmp_path / "local.parquet", columns=keys).to_pylist()
    )


def test_the_driver_does_not_need_the_replicas_device(tmp_path):
    """--device cuda from a driver without a GPU (a CPU head node): the replicas check their own."""
    src = tmp_path / "job.jsonl"
    write_job(src)
    summary = run(
        src, tmp_path / "out.parquet", lambda options: InlinePool(options), engine={"device": "cuda"}
    )
    assert summary.complete and summary.rows_ok == NUM_ROWS - 1


class SpeculatingEngine(FakeEngine):
    """A FakeEngine whose every step verifies 3 draft tokens per request in its batch and accepts 1
    of them (counters only: the rows are FakeEngine's)."""

    def step(self):
        seqs = min(len(self.queue), self.config.max_num_seqs)
        finished = super().step()
        self.totals.spec_decode_num_drafts += seqs
        self.totals.spec_decode_num_draft_tokens += 3 * seqs
        self.totals.spec_decode_num_accepted_tokens += seqs
        return finished


def test_the_dashboard_gets_every_counter_of_every_replica(tmp_path):
    """Two replicas that speculate: the totals the driver hands the dashboard are both replicas'
    counters, the speculative-decoding ones included (and the plain line shows them)."""
    src = tmp_path / "job.jsonl"
    write_job(src)
    pools = []

    def make(config):
        pools.append(InlinePool(options, engine=SpeculatingEngine))
        return pools[-1]

    options = JobOptions(str(src), output=str(tmp_path / "out.parquet"))
    dashboard = quiet()
    summary = run_job(options, make, dashboard=dashboard, loop=replica_loop)
    assert summary.complete
    engines = [r.engine.totals for r in pools[0].replicas]
    assert all(t.spec_decode_num_drafts > 0 for t in engines)  # both replicas ran shards
    totals = dashboard.totals
    assert totals.generation_tokens == sum(t.generation_tokens for t in engines)
    assert totals.spec_decode_num_drafts == sum(t.spec_decode_num_drafts for t in engines)
    assert totals.spec_decode_num_draft_tokens == 3 * totals.spec_decode_num_drafts
    assert totals.spec_decode_num_accepted_tokens == totals.spec_decode_num_drafts
    drafts = totals.spec_decode_num_draft_tokens
    assert f"spec {drafts // 3}/{drafts} drafts accepted (33%)" in dashboard.stream.getvalue()
