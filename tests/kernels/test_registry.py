"""The kernel registry: the fastest correct candidate is chosen, a wrong or crashing one is dropped,
a slow one never wins, and the on-disk table is keyed by what changes a timing and rebuilt when bad."""

from __future__ import annotations

import json
import logging
import shutil
import time

import pytest
import torch

from batchgen.kernels import registry
from batchgen.kernels.registry import TuningTable, bucket_index, choose, machine_key

KEY = {"cpu": "test", "threads": "2"}


def _table(tmp_path) -> TuningTable:
    return TuningTable.load(KEY, directory=tmp_path)


def _op(outputs: dict[str, callable], calls: list[str] | None = None):
    """Candidates computing `2 * x` their own way, each `outputs[name](x)`; `calls` records setups."""
    x = torch.arange(8.0)

    def setup_of(name):
        def setup(rows):
            if calls is not None:
                calls.append(name)
            return lambda: outputs[name](x)

        return setup

    return {name: setup_of(name) for name in outputs}, (lambda rows: 2 * x)


def _slow(x):
    time.sleep(0.005)
    return 2 * x


def test_the_fastest_correct_candidate_is_chosen_and_a_slow_one_never(tmp_path) -> None:
    candidates, reference = _op({"slow": _slow, "fast": lambda x: x + x})
    chosen = choose(_table(tmp_path), "double", "8", (1, 2, 4), candidates, reference, rtol=1e-6)
    assert chosen == {1: "fast", 2: "fast", 4: "fast"}


def test_a_wrong_or_crashing_candidate_is_dropped_with_one_warning(tmp_path, caplog) -> None:
    def crash(x):
        raise RuntimeError("illegal instruction")

    # The wrong one is the fastest: only the check keeps it out.
    candidates, reference = _op({"wrong": lambda x: 2 * x + 0.1, "crash": crash, "slow": _slow})
    table = _table(tmp_path)
    with caplog.at_level(logging.WARNING, logger="batchgen.kernels.registry"):
        chosen = choose(table, "double", "8", (1, 2), candidates, reference, rtol=1e-6)
    assert chosen == {1: "slow", 2: "slow"}
    dropped = [r.getMessage() for r in caplog.records]
    assert len(dropped) == 2  # once per candidate, not per bucket
    assert any("wrong" in m and "differs" in m for m in dropped)
    assert any("crash" in m and "illegal instruction" in m for m in dropped)
    entry = table.entries["double|8|2"]
    assert set(entry["dropped"]) == {"wrong", "crash"} and entry["ms"]["wrong"] is None


def test_no_correct_candidate_is_an_error(tmp_path) -> None:
    candidates, reference = _op({"wrong": lambda x: x})
    with pytest.raises(RuntimeError, match="no correct kernel"):
        choose(_table(tmp_path), "double", "8", (1,), candidates, reference, rtol=1e-6)


def test_a_candidate_far_slower_at_two_buckets_is_not_timed_at_larger_ones(tmp_path) -> None:
    calls: list[str] = []
    candidates, reference = _op({"slow": _slow, "fast": lambda x: x + x}, calls)
    table = _table(tmp_path)
    choose(table, "double", "8", (1, 2, 4, 8), candidates, reference, rtol=1e-6)
    assert calls.count("slow") == 2 and calls.count("fast") == 4
    assert table.entries["double|8|4"]["ms"]["slow"] is None


def test_a_saved_table_is_used_without_measuring(tmp_path) -> None:
    candidates, reference = _op({"slow": _slow, "fast": lambda x: x + x})
    table = _table(tmp_path)
    choose(table, "double", "8", (1, 2), candidates, reference, rtol=1e-6)
    table.save()
    calls: list[str] = []
    candidates, reference = _op({"slow": _slow, "fast": lambda x: x + x}, calls)
    again = _table(tmp_path)
    assert choose(again, "double", "8", (1, 2), candidates, reference, rtol=1e-6) == {1: "fast", 2: "fast"}
    assert calls == [] and not again.dirty
    rows = again.rows()
    assert [(r["op"], r["rows"], r["chosen"]) for r in rows] == [("double", 1, "fast"), ("double", 2, "fast")]


def test_a_table_measured_on_a_busy_machine_is_measured_again_once_it_is_quiet(tmp_path, caplog) -> None:
    """Timings beside another busy process are not the kernels' own (seen: every candidate of a
    0.1 ms linear at about 8 ms, and choices at random). The table records the load; a later start
    uses it while the machine stays busy and measures again once it is quiet."""
    candidates, reference = _op({"slow": _slow, "fast": lambda x: x + x})
    table = _table(tmp_path)
    choose(table, "double", "8", (1, 2), candidates, reference, rtol=1e-6)
    table.note_load(1.2)  # cores of other processes' work while it measured
    table.save()

    still_busy = TuningTable.load(KEY, directory=tmp_path, load_now=lambda: 1.5)
    assert set(still_busy.entries) == {"double|8|1", "double|8|2"} and still_busy.others_load == 1.2
    unknown = TuningTable.load(KEY, directory=tmp_path, load_now=lambda: None)  # no /proc/stat
    assert unknown.entries
    with caplog.at_level(logging.WARNING, logger="batchgen.kernels.registry"):
        quiet = TuningTable.load(KEY, directory=tmp_path, load_now=lambda: 0.1)
    assert quiet.entries == {} and "measured while other processes used 1.2 cores" in caplog.text

    choose(quiet, "double", "8", (1, 2), candidates, reference, rtol=1e-6)
    quiet.note_load(0.1)
    quiet.save()

    def not_asked() -> float:
        raise AssertionError("a table measured on a quiet machine needs no new measurement of the load")

    trusted = TuningTable.load(KEY, directory=tmp_path, load_now=not_asked)
    assert set(trusted.entries) == {"double|8|1", "double|8|2"} and trusted.others_load == 0.1


def test_only_a_measurement_records_the_load(tmp_path) -> None:
    """A start that looked every choice up measured nothing: the load it ran beside is not the table's."""
    candidates, reference = _op({"fast": lambda x: x + x})
    table = _table(tmp_path)
    choose(table, "double", "8", (1,), candidates, reference, rtol=1e-6)
    table.save()
    again = _table(tmp_path)
    choose(again, "double", "8", (1,), candidates, reference, rtol=1e-6)
    again.note_load(1.9)
    assert again.others_load is None and not again.dirty


@pytest.mark.parametrize("damage", ["truncate", "other-key", "not-json-object"])
def test_a_corrupt_or_stale_table_is_rebuilt(tmp_path, damage: str, caplog) -> None:
    candidates, reference = _op({"slow": _slow, "fast": lambda x: x + x})
    table = _table(tmp_path)
    choose(table, "double", "8", (1,), candidates, reference, rtol=1e-6)
    table.save()
    text = table.path.read_text()
    if damage == "truncate":
        table.path.write_text(text[: len(text) // 2])
    elif damage == "other-key":
        data = json.loads(text)
        data["key"] = {**KEY, "threads": "64"}
        table.path.write_text(json.dumps(data))
    else:
        table.path.write_text("[1, 2]")
    calls: list[str] = []
    candidates, reference = _op({"slow": _slow, "fast": lambda x: x + x}, calls)
    with caplog.at_level(logging.WARNING, logger="batchgen.kernels.registry"):
        rebuilt = _table(tmp_path)
    assert rebuilt.entries == {} and "measuring again" in caplog.text
    assert choose(rebuilt, "double", "8", (1,), candidates, reference, rtol=1e-6) == {1: "fast"}
    assert calls  # measured again, not trusted
    rebuilt.save()
    assert _table(tmp_path).entries.keys() == {"double|8|1"}


def test_the_cache_key_changes_with_threads_dtype_isa_cap_and_kernel_source(tmp_path, monkeypatch) -> None:
    base = machine_key(torch.float32, num_threads=2)
    assert machine_key(torch.float32, num_threads=1) != base
    assert machine_key(torch.bfloat16, num_threads=2) != base
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert machine_key(torch.float32, num_threads=2) == {**base, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    # The kernels' source hash covers the C and Python sources.
    same, changed = tmp_path / "same", tmp_path / "changed"
    for copy in (same, changed):
        shutil.copytree(registry.KERNELS_ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    source = changed / "cpu" / "csrc" / "bf16_linear.c"
    source.write_text(source.read_text() + "\n/* changed */\n")
    assert registry.kernel_source_hash(same) == registry.kernel_source_hash()
    assert registry.kernel_source_hash(changed) != registry.kernel_source_hash()
    different = TuningTable.load({**KEY, "kernels": registry.kernel_source_hash(changed)}, directory=tmp_path)
    assert different.path != _table(tmp_path).path


def test_row_buckets() -> None:
    assert [bucket_index(r) for r in (1, 2, 3, 4, 5, 64, 65, 2048, 9000)] == [0, 1, 2, 2, 3, 6, 7, 11, 11]
    assert registry.buckets_up_to(100) == (1, 2, 4, 8, 16, 32, 64, 128)
