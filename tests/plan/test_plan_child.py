"""A plan that keeps torch out of its process (`batchgen.plan.child`) says what one with torch says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen.jobs.errors import JobInputError
from batchgen.jobs.runner import JobOptions
from batchgen.plan.child import can_hide_torch, hide_torch
from batchgen.plan.job_plan import plan_job
from batchgen.plan.wall_time import WallTimeOptions
from tests.jobs.input.test_bad_rows import bad_lines

REPO = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter: plans the job of argv[1] with the engine options of argv[2] (JSON),
# the calibration cache argv[3] and --calibrate when argv[4] is "1", without torch; prints the plan
# (or the error) as JSON, then whether torch got imported.
_PLAN_WITHOUT_TORCH = """
import json, sys
from batchgen.jobs.errors import JobInputError
from batchgen.plan.job_plan import plan_job
from batchgen.jobs.runner import JobOptions
from batchgen.plan.wall_time import WallTimeOptions
options = JobOptions(sys.argv[1], max_tokens=8, engine=json.loads(sys.argv[2]))
try:
    wall_time = WallTimeOptions(calibrate=sys.argv[4] == "1", cache_dir=sys.argv[3])
    plan = plan_job(options, wall_time=wall_time, torch_free=True)
    print(json.dumps(plan.to_dict()))
except JobInputError as e:
    print(json.dumps({"error": str(e)}))
print(sys.modules.get("torch") is not None)
"""


def _plan_without_torch(src: Path, engine: dict, cache_dir: Path, calibrate: bool = False) -> dict:
    args = [str(src), json.dumps(engine), str(cache_dir), "1" if calibrate else "0"]
    proc = subprocess.run(
        [sys.executable, "-c", _PLAN_WITHOUT_TORCH, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    answer, has_torch = proc.stdout.strip().splitlines()[-2:]
    assert has_torch == "False", "the plan imported torch"
    return json.loads(answer)


def test_a_plan_without_torch_equals_the_plan_with_it(tmp_path, tiny_model_dir):
    """Error rows, token counts, KV sizes (a lowered max_model_len included) and the wall-time note
    are the same, whichever process decides them."""
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(bad_lines()) + "\n")
    engine = {"model": str(tiny_model_dir("qwen2")), "max_model_len": 64, "kv_cache_memory": "1MiB"}
    without = _plan_without_torch(src, engine, tmp_path / "none")
    options = JobOptions(str(src), max_tokens=8, engine=engine)
    with_torch = plan_job(options, wall_time=WallTimeOptions(calibrate=False, cache_dir=tmp_path / "none"))
    assert without == with_torch.to_dict()
    assert without["rows_error"] == 6 and without["rows_valid"] == 3
    assert without["kv_cache_tokens"] == with_torch.kv_cache_tokens > 0
    assert "--no-calibrate" in without["wall_time_note"]


def test_a_plan_without_torch_names_the_device_and_model_errors_as_run_does(tmp_path, tiny_model_dir):
    src = tmp_path / "job.jsonl"
    src.write_text(json.dumps({"prompt": "Hello?"}) + "\n")
    cuda = _plan_without_torch(src, {"model": str(tiny_model_dir("llama")), "device": "cuda"}, tmp_path)
    if "error" not in cuda:
        pytest.skip("this machine has a GPU: --device cuda is no error here")
    assert cuda["error"].startswith("invalid engine option: device is 'cuda' but torch.cuda.is_available()")
    missing = _plan_without_torch(src, {"model": str(tmp_path / "no-such-model")}, tmp_path)
    assert missing["error"].startswith(f"cannot plan for model {tmp_path / 'no-such-model'}: ")
    with pytest.raises(JobInputError) as in_process:
        plan_job(JobOptions(str(src), max_tokens=8, engine={"model": str(tmp_path / "no-such-model")}))
    assert missing["error"] == str(in_process.value)


def test_torch_cannot_be_hidden_once_imported():
    """This test's process holds torch: a torch-free plan here plans in-process, and hiding refuses."""
    assert not can_hide_torch()
    with pytest.raises(RuntimeError, match="imported already"):
        hide_torch()


def test_damaged_weights_fail_the_calibration_in_one_line(tmp_path, tiny_model_dir):
    """The calibration child's crash reaches the user as one error naming its cause, no traceback."""
    import shutil

    model = tmp_path / "damaged"
    shutil.copytree(tiny_model_dir("llama"), model)
    (model / "model.safetensors").write_bytes(b"garbage")
    src = tmp_path / "job.jsonl"
    src.write_text(json.dumps({"prompt": "Hello?"}) + "\n")
    answer = _plan_without_torch(src, {"model": str(model)}, tmp_path / "cache", calibrate=True)
    assert answer["error"].startswith(f"cannot calibrate model {model}: SafetensorError: ")
    assert "\n" not in answer["error"]


def _plan_children(pid: int, task: str) -> list[int]:
    """Processes whose parent is `pid`, running `batchgen.plan.child TASK`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and argv[-2:] == [task.encode(), b""]:
            if b"batchgen.plan.child" in argv:
                found.append(int(entry.name))
    return found


def _plan_in_calibration(tmp_path: Path, model: Path) -> tuple[subprocess.Popen, int]:
    """`batchgen plan --calibrate` in a session of its own, once its calibration child runs."""
    import os
    import time

    tmp_path.mkdir()
    src = tmp_path / "job.jsonl"
    src.write_text("\n".join(json.dumps({"prompt": f"Question {i}?"}) for i in range(20)) + "\n")
    cmd = [sys.executable, "-m", "batchgen", "plan", str(src), "--model", str(model), "--calibrate"]
    env = {**os.environ, "BATCHGEN_CACHE": str(tmp_path / "cache")}  # nothing cached: it measures
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if children := _plan_children(proc.pid, "measure"):
            return proc, children[0]
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no calibration child seen: {proc.communicate()}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux's")
def test_killing_the_plan_ends_its_child_and_ctrl_c_prints_no_traceback(tmp_path, tiny_model_dir):
    import os
    import signal
    import time

    model = tiny_model_dir("llama")
    proc, child = _plan_in_calibration(tmp_path / "term", model)
    os.kill(proc.pid, signal.SIGTERM)  # the plan's process alone, as `kill PID` does
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists(), "the calibration child outlived the plan"

    proc, child = _plan_in_calibration(tmp_path / "int", model)
    os.killpg(proc.pid, signal.SIGINT)  # the whole group, as Ctrl-C in a terminal does
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "Traceback" not in err, err


def test_sizes_say_whether_the_runs_kernel_table_is_cached(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """No table under a fresh cache: a run would measure; after one engine start it would not."""
    from batchgen import LLM
    from batchgen.config import EngineConfig
    from batchgen.plan.child import sizes

    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    config = EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32", num_threads=1, max_num_seqs=2)
    assert sizes(config)["kernels_cached"] is False
    LLM(str(tiny_model_dir("llama")), dtype="float32", num_threads=1, max_num_seqs=2)
    assert sizes(config)["kernels_cached"] is True
    reference = EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32", kernels="reference")
    assert sizes(reference)["kernels_cached"] is True  # plain torch measures nothing
