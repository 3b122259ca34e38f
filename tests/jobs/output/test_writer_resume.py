"""jobs.window, jobs.writer, jobs.resume and the runner's resume logic (fake engine, no model)."""

from __future__ import annotations

import io
import json
import os
import signal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import rich.console

from batchgen.dashboard import Dashboard
from batchgen.jobs.errors import JobInputError
from batchgen.jobs.output.final_output import finalize_output
from batchgen.jobs.output.header import header_differences, make_header
from batchgen.jobs.output.json_lines import openai_record
from batchgen.jobs.output.manifest import Manifest
from batchgen.jobs.output.resume import parts_dir_for, prepare_output
from batchgen.jobs.output.writer import PartWriter
from batchgen.jobs.runner import JobOptions, run_job
from batchgen.jobs.window import LookaheadWindow
from tests.jobs.fake_engine import fake_factory

COMPARED = ["row_index", "id", "output", "finish_reason", "prompt_tokens", "completion_tokens", "error"]


# ----- window -----


def drain(w: LookaheadWindow) -> list:
    out = []
    while w:
        out.append(w.pop())
    return out


def test_window_fcfs_and_priority():
    w = LookaheadWindow("fcfs", 10)
    for i, work in enumerate([5, 1, 3]):
        w.push(i, work=work)
    assert drain(w) == [0, 1, 2]
    w = LookaheadWindow("priority", 10)
    for i, prio in enumerate([2, 0, 1, 0]):
        w.push(i, priority=prio)
    assert drain(w) == [1, 3, 2, 0]


def test_window_max_throughput_shortest_first_with_aging():
    w = LookaheadWindow("max-throughput", 3)
    for i, work in enumerate([9, 2, 5]):
        w.push(i, work=work)
    assert w.full and w.pop() == 1
    # The long row 0 is passed over while short rows keep arriving, until it has waited `capacity` pops.
    order = []
    for i in range(3, 9):
        w.push(i, work=1)
        order.append(w.pop())
    assert order.index(0) <= 3
    with pytest.raises(ValueError, match="policy must be one of"):
        LookaheadWindow("lifo", 3)


def test_window_pops_as_the_engine_policy_admits():
    """The window orders rows by the engine's policy classes (one entry per configured name); the
    orders below are the ones the window's own earlier string branches gave for these rows."""
    from batchgen.config import POLICY_NAMES
    from batchgen.engine.policy import POLICIES

    assert tuple(POLICIES) == POLICY_NAMES
    work = [40, 3, 17, 3, 90, 1, 8, 60, 2, 2, 5, 70, 4, 1, 33, 6]
    expected = {
        "fcfs": list(range(16)),
        "max-throughput": [1, 3, 5, 6, 0, 2, 4, 8, 7, 9, 13, 10, 11, 12, 15, 14],
        "priority": [1, 3, 4, 0, 7, 5, 2, 6, 11, 12, 13, 14, 15, 8, 9, 10],
    }
    for policy in POLICY_NAMES:
        w = LookaheadWindow(policy, 4)
        order = []
        for i, units in enumerate(work):
            w.push(i, work=units, priority=units % 3)
            if w.full:
                order.append(w.pop())
        assert order + drain(w) == expected[policy], policy


def test_window_queue_stays_the_size_of_what_it_holds():
    """Rows served by aging leave dead entries in the work heap (and rows served by work, in the
    age heap); a long job must not pile them up."""
    w = LookaheadWindow("max-throughput", 4)
    for i in range(20_000):
        w.push(i, work=1000 if i % 5 == 0 else 1)  # every fifth row is long: it ages out
        if w.full:
            w.pop()
    queue = w._queue
    # compacted at a push past twice the rows held (4) plus 16
    assert len(queue) == 3 and len(queue.heap) <= 2 * 4 + 16 and len(queue.by_age) <= 2 * 4 + 16


# ----- writer + manifest -----


def header(**options) -> dict:
    return make_header({"path": "/x", "size": 1}, "tiny", options)


def row(i: int, **kw) -> dict:
    base = {"row_index": i, "id": str(i), "output": f"o{i}", "finish_reason": "stop", "prompt_tokens": 3}
    base.update({"completion_tokens": 2, "row_hash": i * 11, "endpoint": None, "created": 1})
    base.update(kw)
    return base


def test_parts_commit_and_final_output_in_input_order(tmp_path):
    out = str(tmp_path / "o.parquet")
    state = prepare_output(out, header(), overwrite=False)
    writer = PartWriter(state, keep_columns=("topic",), commit_rows=3, commit_seconds=60)
    for i in [4, 0, 2, 5, 1, 3]:
        writer.add(row(i), {"topic": f"t{i}"})
        if writer.due():
            writer.commit()
    assert writer.pending == 0 and len(state.entries) == 2
    first = pq.read_table(os.path.join(state.parts_dir, state.entries[0].part))
    assert first["row_index"].to_pylist() == [0, 2, 4]  # each part sorted
    manifest_lines = Path(state.parts_dir, "manifest.jsonl").read_text().splitlines()
    assert len(manifest_lines) == 3 and "header" in json.loads(manifest_lines[0])
    finalize_output(state, 6, "parquet", header(), ("topic",), chunk_rows=4)
    t = pq.read_table(out)
    assert t["row_index"].to_pylist() == list(range(6)) and t["topic"].to_pylist() == [
        f"t{i}" for i in range(6)
    ]
    assert t.schema.names == [*COMPARED, "ttft_s", "latency_s", "topic"]
    assert not os.path.exists(state.parts_dir)


def test_final_output_detects_missing_rows(tmp_path):
    state = prepare_output(str(tmp_path / "o.parquet"), header(), overwrite=False)
    writer = PartWriter(state, commit_rows=10)
    writer.add(row(0))
    writer.add(row(2))
    writer.commit()
    with pytest.raises(RuntimeError, match="2 committed rows instead of 3"):
        finalize_output(state, 3, "parquet", header())


def test_resume_loads_committed_rows_cleans_orphans_and_torn_lines(tmp_path):
    out = str(tmp_path / "o.parquet")
    state = prepare_output(out, header(), overwrite=False)
    writer = PartWriter(state, commit_rows=2)
    for i in range(4):
        writer.add(row(i))
        if writer.due():
            writer.commit()
    state.release()
    parts = parts_dir_for(out)
    Path(parts, "part-000009.parquet").write_bytes(b"renamed but never recorded")
    Path(parts, ".tmp-part-000010.parquet").write_bytes(b"half written")
    with open(Path(parts, "manifest.jsonl"), "a") as f:
        f.write('{"part": "part-0000')  # torn append
    again = prepare_output(out, header(), overwrite=False)
    assert sorted(os.listdir(parts)) == [
        "lock",
        "manifest.jsonl",
        "part-000000.parquet",
        "part-000001.parquet",
    ]
    assert len(again.committed) == 4
    assert again.committed.is_committed(1, 11) and not again.committed.is_committed(7, 77)
    with pytest.raises(JobInputError, match="another batchgen run"):
        prepare_output(out, header(), overwrite=False)
    again.release()
    with pytest.raises(JobInputError, match=r"4 committed rows.*temperature None -> 0.7.*--overwrite"):
        prepare_output(out, header(temperature=0.7), overwrite=False)
    fresh = prepare_output(out, header(temperature=0.7), overwrite=True)
    assert len(fresh.committed) == 0
    fresh.release()


def test_overwrite_beside_a_live_run_is_refused_and_deletes_nothing(tmp_path):
    out = str(tmp_path / "o.parquet")
    live = prepare_output(out, header(), overwrite=False)
    writer = PartWriter(live, commit_rows=2)
    for i in range(2):
        writer.add(row(i))
    writer.commit()
    before = sorted(os.listdir(parts_dir_for(out)))
    with pytest.raises(JobInputError, match="another batchgen run"):
        prepare_output(out, header(temperature=0.7), overwrite=True)
    assert sorted(os.listdir(parts_dir_for(out))) == before
    live.release()


def test_committed_row_with_another_hash_is_refused(tmp_path):
    out = str(tmp_path / "o.parquet")
    state = prepare_output(out, header(), overwrite=False)
    writer = PartWriter(state)
    writer.add(row(0))
    writer.commit()
    state.release()
    again = prepare_output(out, header(), overwrite=False)
    with pytest.raises(JobInputError, match="row 0 .*differs from the committed result"):
        again.committed.is_committed(0, 12345)
    again.release()


def test_unwritable_output_location(tmp_path, monkeypatch):
    with pytest.raises(JobInputError, match="does not exist"):
        prepare_output(str(tmp_path / "nope" / "o.parquet"), header(), overwrite=False)
    with pytest.raises(JobInputError, match="is a directory"):
        prepare_output(str(tmp_path), header(), overwrite=False)
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    real_access = os.access
    # As root (CI here) permission bits do not stop writes; os.access is what the check asks.
    monkeypatch.setattr(
        os, "access", lambda path, mode: False if str(path) == str(ro) else real_access(path, mode)
    )
    with pytest.raises(JobInputError, match="output directory .* is not writable"):
        prepare_output(str(ro / "o.parquet"), header(), overwrite=False)
    (tmp_path / "taken.parquet").write_bytes(b"")
    monkeypatch.setattr(os, "access", lambda path, mode: not str(path).endswith("taken.parquet"))
    with pytest.raises(JobInputError, match="output .*taken.parquet is not writable"):
        prepare_output(str(tmp_path / "taken.parquet"), header(), overwrite=False)


def test_manifest_header_is_atomic(tmp_path):
    m = Manifest.create(str(tmp_path / "p"), header(a=1))
    h, entries = m.load()
    assert h == header(a=1) and entries == []


def test_openai_record_shapes():
    ok = openai_record(row(0, output="Hi", endpoint="chat", prompt_tokens=4), "tiny")
    assert ok["custom_id"] == "0" and ok["error"] is None and ok["response"]["status_code"] == 200
    body = ok["response"]["body"]
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "Hi"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    text = openai_record(row(1, endpoint="completion"), "tiny")["response"]["body"]
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "o1"
    bad = openai_record(row(2, finish_reason="error", output=None, error="row 2: boom"), "tiny")
    assert bad["response"]["status_code"] == 400 and bad["error"]["message"] == "row 2: boom"


# ----- runner resume with the fake engine -----


def job_file(tmp_path: Path, n: int = 40) -> str:
    path = tmp_path / "job.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            f.write(
                json.dumps(
                    {
                        "id": f"q{i}",
                        "prompt": f"question number {i} " + "x" * (i % 7),
                        "max_tokens": 1 + i % 6,
                    }
                )
                + "\n"
            )
    return str(path)


def quiet() -> Dashboard:
    import io

    return Dashboard(
        None, live=False, stream=io.StringIO(), console=__import__("rich").console.Console(file=io.StringIO())
    )


def run(options: JobOptions, **factory_kw):
    return run_job(options, fake_factory(**factory_kw), dashboard=quiet())


def table_rows(path: str) -> list[dict]:
    return pq.read_table(path, columns=COMPARED).to_pylist()


def test_full_job_then_rerun_is_already_complete(tmp_path):
    opts = JobOptions(
        job_file(tmp_path), engine={"max_num_seqs": 4}, commit_rows=5, policy="max-throughput", window=8
    )
    s = run(opts)
    assert s.complete and s.rows_ok == 40 and s.rows_error == 0
    out = table_rows(str(tmp_path / "job.out.parquet"))
    assert [r["row_index"] for r in out] == list(range(40)) and out[3]["id"] == "q3"
    assert not os.path.exists(str(tmp_path / "job.out.parquet.parts"))
    again = run(opts)
    assert again.already_complete
    with pytest.raises(JobInputError, match="already exists from a run with other settings"):
        run(JobOptions(opts.input, temperature=0.5, engine={"max_num_seqs": 4}))


def test_finished_jsonl_output_rerun_is_already_complete(tmp_path):
    """JSON lines carry no metadata: the run header sits in a hidden sidecar beside the output."""
    out = tmp_path / "job.out.jsonl"
    opts = JobOptions(job_file(tmp_path), output=str(out), engine={"max_num_seqs": 4}, commit_rows=7)
    assert run(opts).complete
    lines = out.read_text().splitlines()
    assert [json.loads(line)["row_index"] for line in lines] == list(range(40))
    assert (tmp_path / ".job.out.jsonl.batchgen.json").exists()
    assert run(opts).already_complete
    with pytest.raises(JobInputError, match="already exists from a run with other settings"):
        run(JobOptions(opts.input, output=str(out), temperature=0.5, engine={"max_num_seqs": 4}))
    # An output edited since (its size changed) is no longer taken for the finished job.
    out.write_text("\n".join(lines[:5]) + "\n")
    with pytest.raises(
        JobInputError, match=r"already exists and is not a finished batchgen output .*Pass --overwrite"
    ):
        run(opts)
    assert run(JobOptions(opts.input, output=str(out), engine={"max_num_seqs": 4}, overwrite=True)).complete
    assert len(out.read_text().splitlines()) == 40 and run(opts).already_complete


def test_a_failed_final_assembly_leaves_no_temp_file_and_keeps_the_parts(tmp_path, monkeypatch):
    import batchgen.jobs.output.final_output as final_output_module

    opts = JobOptions(job_file(tmp_path), engine={"max_num_seqs": 4}, commit_rows=7)

    def broken(*args, **kwargs):
        raise OSError("disk full")
        yield  # a generator, as the real one

    monkeypatch.setattr(final_output_module, "iter_ordered_chunks", broken)
    with pytest.raises(OSError, match="disk full"):
        run(opts)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.jsonl", "job.out.parquet.parts"]
    monkeypatch.undo()
    s = run(opts)  # the rerun assembles the output from the committed parts
    assert s.complete and s.rows_resumed == 40 and len(table_rows(str(tmp_path / "job.out.parquet"))) == 40


def test_a_damaged_part_leaves_the_lock_free(tmp_path):
    out = str(tmp_path / "o.parquet")
    state = prepare_output(out, header(), overwrite=False)
    writer = PartWriter(state, keep_columns=(), commit_rows=1, commit_seconds=60)
    writer.add(row(0), None)
    writer.commit()
    state.release()
    Path(state.parts_dir, state.entries[0].part).write_bytes(b"not parquet")  # a damaged part
    for _ in range(2):  # the second call would say "another batchgen run is writing" if the lock leaked
        with pytest.raises(JobInputError, match="cannot be read .* pass --overwrite"):
            prepare_output(out, header(), overwrite=False)


def test_crash_and_sigint_resume_match_an_uninterrupted_run(tmp_path):
    src = job_file(tmp_path)
    ref = JobOptions(src, output=str(tmp_path / "ref.parquet"), engine={"max_num_seqs": 3})
    run(ref)
    expected = table_rows(ref.output)

    out = str(tmp_path / "resumed.parquet")
    opts = JobOptions(
        src, output=out, engine={"max_num_seqs": 3}, commit_rows=4, commit_seconds=60, policy="max-throughput"
    )

    def crash(step):
        if step == 9:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        run(opts, on_step=crash)
    committed = Manifest(parts_dir_for(out)).load()[1]
    assert committed and not os.path.exists(out)

    def interrupt(step):
        if step == 5:
            os.kill(os.getpid(), signal.SIGINT)

    s = run(opts, on_step=interrupt)
    assert s.interrupted and not s.complete and s.rows_resumed == sum(e.rows for e in committed)
    s = run(opts)
    assert s.complete and s.rows_done == 40
    assert table_rows(out) == expected


def test_keep_columns_and_jsonl_output(tmp_path):
    path = tmp_path / "k.jsonl"
    path.write_text(
        "\n".join(json.dumps({"prompt": f"p{i}", "topic": ["a", 1][i % 2]}) for i in range(5)) + "\n"
    )
    out = str(tmp_path / "k.out.jsonl")
    run(JobOptions(str(path), output=out, keep_columns=("topic",)))
    lines = [json.loads(x) for x in Path(out).read_text().splitlines()]
    assert (
        [x["row_index"] for x in lines] == list(range(5))
        and "topic" in lines[0]
        and "row_hash" not in lines[0]
    )
    with pytest.raises(JobInputError, match="output columns"):
        run(JobOptions(str(path), keep_columns=("output",)))


def test_resume_refuses_a_model_whose_files_changed(tmp_path):
    """Same --model path, edited chat template: the rows so far came from other model files."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "chat_template.jinja").write_text("{{ messages }}")
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(3)))
    opts = JobOptions(str(src), engine={"model": str(model)})
    assert run(opts).complete and run(opts).already_complete
    (model / "chat_template.jinja").write_text("{{ messages }} with a system line")
    with pytest.raises(JobInputError) as e:
        run(opts)
    assert f"the files of model {str(model)!r} changed (weights, configs, tokenizer or chat template)" in str(
        e.value
    )


def test_resume_refuses_another_quantization(tmp_path):
    """int8 weights give other rows than float ones: a run resumes only under the same method (and
    a job written before the option, with "auto", still resumes under "auto")."""
    src = job_file(tmp_path)
    assert run(JobOptions(src, engine={"quantization": "auto"})).complete
    assert run(JobOptions(src)).already_complete  # "auto" is the default and not in the header
    with pytest.raises(JobInputError, match="quantization 'auto' -> 'int8'"):
        run(JobOptions(src, engine={"quantization": "int8"}))


def test_a_moved_input_and_model_resume_by_content(tmp_path):
    """A job restarted where its files are mounted at other paths (another node, another folder)
    resumes: the input and a local model are known by their content, not their paths."""
    first, second = tmp_path / "node1", tmp_path / "node2"
    first.mkdir()
    src = job_file(first)
    model = first / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    out = str(tmp_path / "out.parquet")
    ref = JobOptions(
        src, output=str(tmp_path / "ref.parquet"), engine={"max_num_seqs": 3, "model": str(model)}
    )
    run(ref)

    def crash(step):
        if step == 6:
            raise RuntimeError("simulated crash")

    opts = dict(output=out, commit_rows=4, commit_seconds=60)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(JobOptions(src, engine={"max_num_seqs": 3, "model": str(model)}, **opts), on_step=crash)
    committed = sum(e.rows for e in Manifest(parts_dir_for(out)).load()[1])
    assert committed > 0
    first.rename(second)
    moved = JobOptions(
        str(second / "job.jsonl"), engine={"max_num_seqs": 3, "model": str(second / "m")}, **opts
    )
    s = run(moved)
    assert s.complete and s.rows_resumed == committed
    assert table_rows(out) == table_rows(ref.output)
    assert run(moved).already_complete
    # The same path with other content is still another input.
    (second / "job.jsonl").write_text(json.dumps({"prompt": "another job"}) + "\n")
    with pytest.raises(JobInputError, match="the input file changed"):
        run(moved)


def no_engine(config):
    raise AssertionError("the engine was built for a job with no rows left to run")


def test_empty_job_needs_no_engine(tmp_path):
    """A job without rows stops before any engine (`no_engine` fails if asked), as an empty JSONL
    file does, and writes nothing."""
    path = tmp_path / "e.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    with pytest.raises(JobInputError, match=r"is empty \(no rows\): there is nothing to run"):
        run_job(JobOptions(str(path)), no_engine, dashboard=quiet())
    assert not (tmp_path / "e.out.parquet").exists()


def test_a_crash_before_the_final_write_resumes_without_an_engine(tmp_path, monkeypatch):
    """Every row committed, then the final write failed: the rerun only writes the output."""
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(5)))
    opts = JobOptions(str(src), commit_rows=2)

    def crash(*args, **kwargs):
        raise OSError("disk gone")

    monkeypatch.setattr("batchgen.jobs.runner.finalize_output", crash)
    with pytest.raises(OSError, match="disk gone"):
        run(opts)
    monkeypatch.undo()
    s = run_job(opts, no_engine, dashboard=quiet())
    assert s.complete and s.rows_resumed == 5
    assert [r["row_index"] for r in table_rows(str(tmp_path / "a.out.parquet"))] == list(range(5))


def test_a_same_size_edit_anywhere_in_a_finished_input_is_noticed(tmp_path):
    """The input is identified by its whole content: an edit in the middle of a file larger than
    any sample (same size, same first and last bytes) is not taken for the finished job."""
    src = tmp_path / "big.jsonl"
    lines = [json.dumps({"id": f"q{i}", "prompt": f"say {i:05d} " + "x" * 700}) for i in range(4000)]
    src.write_text("\n".join(lines) + "\n")
    assert src.stat().st_size > 2 * (1 << 20)
    opts = JobOptions(str(src), engine={"max_num_seqs": 8}, commit_rows=1000, max_tokens=2)
    assert run(opts).complete and run(opts).already_complete
    lines[2000] = lines[2000].replace("say 02000", "say 0200X")
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(JobInputError, match=r"from a run with other settings \(the input file changed"):
        run(opts)


def test_a_kill_during_the_final_cleanup_leaves_a_finished_job(tmp_path, monkeypatch):
    """The manifest is deleted first: parts left by a kill mid-cleanup are leftovers of a finished
    job (the rerun says complete and removes them), not a resume with parts missing."""
    import batchgen.jobs.output.writer as writer_module

    opts = JobOptions(job_file(tmp_path), engine={"max_num_seqs": 4}, commit_rows=5)
    real_remove = os.remove
    removed: list[str] = []

    def remove_then_die(path):
        real_remove(path)
        removed.append(os.path.basename(path))
        if len(removed) == 3:  # the manifest and two parts are gone
            raise KeyboardInterrupt("killed")

    monkeypatch.setattr(writer_module.os, "remove", remove_then_die)
    with pytest.raises(KeyboardInterrupt):
        run(opts)
    monkeypatch.undo()
    assert removed[0] == "manifest.jsonl"
    parts = tmp_path / "job.out.parquet.parts"
    assert parts.is_dir() and not (parts / "manifest.jsonl").exists()
    again = run(opts)
    assert again.already_complete and not parts.exists()
    assert [r["row_index"] for r in table_rows(str(tmp_path / "job.out.parquet"))] == list(range(40))


@pytest.mark.parametrize("commit_rows", [1, 100])
def test_mixed_type_kept_values_have_one_text_form_whatever_the_commits(tmp_path, commit_rows):
    src = tmp_path / "mixed.jsonl"
    metas = [1, "two", {"x": [1]}, [1, "a"], None, 3.5]
    src.write_text("\n".join(json.dumps({"prompt": f"p{i}", "meta": m}) for i, m in enumerate(metas)) + "\n")
    run(JobOptions(str(src), keep_columns=["meta"], commit_rows=commit_rows, engine={"max_num_seqs": 1}))
    got = pq.read_table(tmp_path / "mixed.out.parquet")["meta"].to_pylist()
    assert got == ["1", "two", '{"x": [1]}', '[1, "a"]', None, "3.5"]


def test_jsonl_output_writes_bytes_as_base64_and_times_in_iso_8601(tmp_path):
    import datetime

    src = tmp_path / "odd.parquet"
    when = datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)
    pq.write_table(pa.table({"prompt": ["a"], "bin": [b"\x00\xff"], "ts": [when]}), src)
    out = tmp_path / "odd.jsonl"
    run(JobOptions(str(src), output=str(out), keep_columns=["bin", "ts"]))
    (line,) = out.read_text().splitlines()
    rec = json.loads(line)
    assert rec["bin"] == "AP8=" and rec["ts"] == "2020-01-01T00:00:00+00:00"


def test_an_output_folder_removed_mid_run_is_one_clear_error(tmp_path):
    import shutil

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    opts = JobOptions(
        job_file(tmp_path), output=str(out_dir / "x.parquet"), engine={"max_num_seqs": 2}, commit_rows=3
    )

    def remove_folder(step):
        if step == 6:
            shutil.rmtree(out_dir)

    with pytest.raises(OSError) as info:
        run(opts, on_step=remove_folder)
    assert info.value.__context__ is None  # the final commit's own failure does not pile on


def test_the_cli_reports_a_write_failure_without_a_traceback(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import batchgen.jobs.runner as runner_module
    from batchgen.cli import app

    failing_path = [str(tmp_path / "x.parquet.parts" / "part-000001.parquet")]

    def failing_run(options, *args, **kwargs):
        raise OSError(28, "No space left on device", failing_path[0])

    monkeypatch.setattr(runner_module, "run_job", failing_run)
    src = job_file(tmp_path)
    (tmp_path / "x.parquet.parts").mkdir()
    result = CliRunner().invoke(app, ["run", src, "--no-dashboard"])
    assert result.exit_code == 1
    assert "error: cannot write the job's output" in result.stderr
    assert "Rows committed before this are kept; fix the cause and resume with" in result.stderr
    assert "Traceback" not in result.output
    # A folder removed under the run took its committed rows with it: the message does not claim them.
    failing_path[0] = str(tmp_path / "gone" / "x.parquet.parts" / "part-000001.parquet")
    result = CliRunner().invoke(app, ["run", src, "--no-dashboard"])
    assert result.exit_code == 1 and "Rows committed before this are kept" not in result.stderr
    assert f"The folder {tmp_path / 'gone' / 'x.parquet.parts'} is gone" in result.stderr


def test_progress_of_a_resumed_run_starts_from_the_committed_rows(tmp_path):
    opts = JobOptions(job_file(tmp_path), engine={"max_num_seqs": 2}, commit_rows=4)

    def stop(step):
        if step == 12:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(opts, on_step=stop)
    dashboard = quiet()
    seen: list[int] = []
    real_update = dashboard.update

    def record(rows_done, *args):
        seen.append(rows_done)
        real_update(rows_done, *args)

    dashboard.update = record
    updates_before_step: list[int] = []
    summary = run_job(
        opts, fake_factory(on_step=lambda step: updates_before_step.append(len(seen))), dashboard=dashboard
    )
    # The view shows the committed rows before the first step (model loading can take a while).
    assert summary.rows_resumed > 0 and updates_before_step[0] == 1 and seen[0] == summary.rows_resumed


def test_a_parquet_output_filtered_in_place_is_not_taken_for_complete(tmp_path):
    """pyarrow keeps a file's metadata when it rewrites it, so the header alone cannot vouch for the rows."""
    opts = JobOptions(job_file(tmp_path), engine={"max_num_seqs": 4}, commit_rows=7)
    assert run(opts).complete
    out = str(tmp_path / "job.out.parquet")
    pq.write_table(pq.read_table(out).slice(0, 39), out)
    with pytest.raises(JobInputError, match="is not a finished batchgen output"):
        run(opts)


def failing_factory(config):
    raise RuntimeError("the model could not be loaded")


def test_a_run_that_failed_before_committing_a_row_does_not_bind_the_next_one(tmp_path):
    job = job_file(tmp_path)
    with pytest.raises(RuntimeError, match="could not be loaded"):
        run_job(JobOptions(job, temperature=0.5), failing_factory, dashboard=quiet())
    assert not (tmp_path / "job.out.parquet.parts").exists()  # its empty parts directory is gone
    opts = JobOptions(job, engine={"max_num_seqs": 4}, commit_rows=7)  # the corrected command
    s = run(opts)
    assert s.complete and s.rows_ok == 40 and not s.rows_resumed
    # A failed --overwrite with other settings leaves the finished output, and the original
    # command still finds it complete.
    with pytest.raises(RuntimeError, match="could not be loaded"):
        run_job(JobOptions(job, temperature=0.5, overwrite=True), failing_factory, dashboard=quiet())
    again = run(opts)
    assert again.already_complete and not (tmp_path / "job.out.parquet.parts").exists()
    assert len(table_rows(str(tmp_path / "job.out.parquet"))) == 40
    # Nor did the overwrite that never started leave a run behind for its settings to resume: without
    # --overwrite they are still refused over the finished output.
    with pytest.raises(RuntimeError, match="could not be loaded"):
        run_job(JobOptions(job, temperature=0.5, overwrite=True), failing_factory, dashboard=quiet())
    with pytest.raises(JobInputError, match="already exists from a run with other settings"):
        run_job(JobOptions(job, temperature=0.5), fake_factory(), dashboard=quiet())
    assert len(table_rows(str(tmp_path / "job.out.parquet"))) == 40


def test_a_garbage_manifest_line_is_a_clear_error(tmp_path):
    out = str(tmp_path / "o.parquet")
    prepare_output(out, header(), overwrite=False).release()
    with open(os.path.join(parts_dir_for(out), "manifest.jsonl"), "a") as f:
        f.write("garbage{\n")
    with pytest.raises(JobInputError, match=r"line 2 is not a part entry.*--overwrite"):
        prepare_output(out, header(), overwrite=False)


def test_a_keep_column_named_twice_is_refused_before_any_work(tmp_path):
    with pytest.raises(JobInputError, match="names topic more than once"):
        run(JobOptions(job_file(tmp_path), keep_columns=("topic", "id2", "topic")))
    assert not (tmp_path / "job.out.parquet.parts").exists()


def test_jsonl_output_is_strict_json_when_kept_floats_are_not_finite(tmp_path):
    src = tmp_path / "floats.parquet"
    pq.write_table(
        pa.table(
            {"prompt": ["a", "b"], "f": [float("nan"), float("inf")], "v": [[1.0, float("-inf")], [2.0]]}
        ),
        src,
    )
    out = tmp_path / "floats.jsonl"
    run(JobOptions(str(src), output=str(out), keep_columns=["f", "v"]))

    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")

    recs = [json.loads(line, parse_constant=refuse) for line in out.read_text().splitlines()]
    assert [r["f"] for r in recs] == [None, None] and [r["v"] for r in recs] == [[1.0, None], [2.0]]


def test_a_second_signal_goes_to_the_handler_that_was_there_before():
    """The CLI's SIGTERM handler records the signal for the exit code (143), also when a second
    SIGTERM arrives during the job loop."""
    import signal

    from batchgen.jobs.interrupt import Interrupt

    seen = []

    def before(signum, frame):
        seen.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, before)
    try:
        with Interrupt() as interrupt:
            os.kill(os.getpid(), signal.SIGTERM)
            assert interrupt.requested and interrupt.signum == signal.SIGTERM and not seen
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is before  # restored on exit
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_signals_during_a_commit_are_only_recorded():
    """A burst of Ctrl-C must not stop a commit half-way: inside `shielded()` a signal only asks
    the run to stop, however many arrive."""
    import signal

    from batchgen.jobs.interrupt import Interrupt

    with Interrupt() as interrupt:
        with interrupt.shielded():
            for _ in range(3):
                os.kill(os.getpid(), signal.SIGINT)
        assert interrupt.requested and interrupt.signum == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):  # outside the shield a second signal stops at once
            os.kill(os.getpid(), signal.SIGINT)


def test_an_interrupted_overwrite_leaves_no_earlier_output_beside_its_parts(tmp_path):
    """`--overwrite` used to replace the earlier output only at the end: interrupted, it left the
    previous job's complete output next to the new run's parts, where it passed for the new result.
    The earlier output goes once the new run has its engine, and the run says so."""
    import io

    from rich.console import Console

    job = job_file(tmp_path)
    out = tmp_path / "job.out.parquet"
    assert run(JobOptions(job, engine={"max_num_seqs": 4})).complete and out.exists()
    log = io.StringIO()
    board = Dashboard(None, live=False, stream=log, console=Console(file=io.StringIO()))

    def interrupt(step):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    opts = JobOptions(job, temperature=0.5, engine={"max_num_seqs": 4}, commit_rows=2, overwrite=True)
    s = run_job(opts, fake_factory(on_step=interrupt), dashboard=board)
    assert s.interrupted and not out.exists()
    assert f"--overwrite: removed the earlier output {out}" in log.getvalue()
    resumed = run(JobOptions(job, temperature=0.5, engine={"max_num_seqs": 4}, commit_rows=2))
    assert resumed.complete and resumed.rows_resumed > 0 and len(table_rows(str(out))) == 40
    # A JSON-lines output goes with its sidecar (a later run must not take it for complete).
    jout = tmp_path / "job.out.jsonl"
    assert run(JobOptions(job, output=str(jout), engine={"max_num_seqs": 4})).complete
    sidecar = tmp_path / ".job.out.jsonl.batchgen.json"
    assert sidecar.exists()
    opts = JobOptions(job, output=str(jout), top_k=3, engine={"max_num_seqs": 4}, overwrite=True)
    s = run_job(opts, fake_factory(on_step=interrupt), dashboard=quiet())
    assert s.interrupted and not jout.exists() and not sidecar.exists()


def test_an_output_written_from_another_input_says_so(tmp_path):
    """job.jsonl and job.parquet share the default output job.out.parquet: the refusal names the
    other input, not "the input file changed"."""
    job = job_file(tmp_path)
    rows = [json.loads(line) for line in Path(job).read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "job.parquet")
    assert run(JobOptions(job, engine={"max_num_seqs": 4})).complete
    with pytest.raises(JobInputError) as e:
        run(JobOptions(str(tmp_path / "job.parquet"), engine={"max_num_seqs": 4}))
    message = str(e.value)
    assert f"it was written from another input, {job} (this run reads {tmp_path / 'job.parquet'})" in message
    assert "the input file changed" not in message and "--output" in message


def test_a_duplicate_id_gets_one_warning_naming_both_rows(tmp_path):
    import io

    from rich.console import Console

    path = tmp_path / "dup.jsonl"
    ids = ["a", "b", "a", "c", "a", "b"]
    path.write_text("".join(json.dumps({"id": i, "prompt": f"p{n}"}) + "\n" for n, i in enumerate(ids)))
    log = io.StringIO()
    board = Dashboard(None, live=False, stream=log, console=Console(file=io.StringIO()))
    s = run_job(
        JobOptions(str(path), strict=True, engine={"max_num_seqs": 4}), fake_factory(), dashboard=board
    )
    assert s.complete and s.rows_ok == 6  # every row runs
    warnings = [line for line in log.getvalue().splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: row 2 (line 3) has the id 'a' of row 0 (line 1); both run, but rows joined on 'id' "
        "would mix them: make each id unique",
        "warning: row 5 (line 6) has the id 'b' of row 1 (line 2); both run, but rows joined on 'id' "
        "would mix them: make each id unique",
    ]


def test_summary_json_gives_scripts_the_error_rows_of_a_partly_failed_job(tmp_path, monkeypatch):
    """A job whose rows partly failed exits 0 (its output is complete); `--summary-json` gives a
    script its error rows, those of earlier runs included once the output is complete."""
    from typer.testing import CliRunner

    import batchgen.jobs.runner as runner_module
    from batchgen.cli import app

    monkeypatch.setattr(runner_module, "default_engine_factory", fake_factory())
    src = tmp_path / "j.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["one", "", "three", "four"]))
    summary = tmp_path / "summary.json"
    args = ["run", str(src), "--no-dashboard", "--summary-json", str(summary), "--max-num-seqs", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    got = json.loads(summary.read_text())
    assert got["complete"] and not got["interrupted"] and got["exit_code"] == 0
    assert (got["rows"], got["rows_done"], got["error_rows"], got["rows_ok_this_run"]) == (4, 4, 1, 3)
    assert got["first_error"].startswith("row 1 (line 2): field 'prompt' is empty")
    assert got["output"] == str(tmp_path / "j.out.parquet")
    # The rerun of the finished job reports the same error rows.
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0 and "already complete" in result.stdout
    again = json.loads(summary.read_text())
    assert again["error_rows"] == 1 and again["rows"] == 4 and again["complete"]


@pytest.mark.parametrize("where", ["missing folder", "a folder"])
def test_a_summary_json_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch, where):
    """Found by a new user: the whole job ran, then the summary failed to write and the run exited 0."""
    from typer.testing import CliRunner

    import batchgen.jobs.runner as runner_module
    from batchgen.cli import app

    def no_engine(*args, **kwargs):
        raise AssertionError("the summary path is checked before any model work")

    monkeypatch.setattr(runner_module, "default_engine_factory", no_engine)
    src = tmp_path / "j.jsonl"
    src.write_text(json.dumps({"prompt": "one"}) + "\n")
    summary = tmp_path / "nowhere" / "s.json" if where == "missing folder" else tmp_path
    result = CliRunner().invoke(app, ["run", str(src), "--no-dashboard", "--summary-json", str(summary)])
    assert result.exit_code == 2
    assert f"--summary-json {summary} " in result.output
    assert "does not exist" in result.output if where == "missing folder" else "is a folder" in result.output
    assert not (tmp_path / "j.out.parquet").exists()


def test_a_summary_json_that_fails_at_the_end_exits_1_with_the_rows_kept(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import batchgen.cli_run as cli_run
    import batchgen.jobs.runner as runner_module
    from batchgen.cli import app

    monkeypatch.setattr(runner_module, "default_engine_factory", fake_factory())

    def disk_full(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("batchgen.cache.write_atomically", disk_full)
    src = tmp_path / "j.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["one", "two"]))
    summary = tmp_path / "s.json"
    result = CliRunner().invoke(app, ["run", str(src), "--no-dashboard", "--summary-json", str(summary)])
    assert result.exit_code == 1 and "could not be written" in result.output
    assert pq.read_table(tmp_path / "j.out.parquet").num_rows == 2
    assert cli_run.write_summary_json(str(summary), {}) is False


def test_a_changed_sampling_default_is_named_alone_not_as_two_whole_dicts():
    old = {
        "options": {"sampling": {"max_tokens": 48, "temperature": 0.0, "top_p": 1.0}, "chat_template": True}
    }
    new = {
        "options": {"sampling": {"max_tokens": 40, "temperature": 0.0, "top_p": 1.0}, "chat_template": True}
    }
    assert header_differences(old, new) == ["sampling.max_tokens 48 -> 40"]


def test_a_start_says_what_it_loads_before_the_model_loads(tmp_path):
    """The job says what it loads before the engine is built, not after (a GGUF conversion and a
    kernel measurement say so when they happen: tests/test_progress.py)."""
    stream = io.StringIO()
    dashboard = Dashboard(None, live=False, stream=stream, console=rich.console.Console(file=io.StringIO()))
    said_before_load = []
    factory = fake_factory()

    def loading(config):
        said_before_load.append(stream.getvalue())
        return factory(config)

    opts = JobOptions(job_file(tmp_path), engine={"max_num_seqs": 4})
    assert run_job(opts, loading, dashboard=dashboard).complete
    (before,) = said_before_load
    assert before == "[batchgen] loading the default model\n"
    # A finished job loads no model, and says nothing of loading one.
    stream.truncate(0)
    assert run_job(opts, loading, dashboard=dashboard).already_complete
    assert "loading" not in stream.getvalue() and len(said_before_load) == 1
