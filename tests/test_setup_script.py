"""The README's set-up command and its run command agree: `scripts/setup.sh` installs where
`.venv/bin/batchgen` is called, whichever virtual environment is active. Python and pip are stubs
here (a shell script that records its calls), so the test installs nothing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).parents[1]

# A `python` that makes a venv on `-m venv DIR`, answers `import torch`, logs every call, and on
# `pip install -e` puts a `batchgen` script beside itself (as pip does for the console script).
STUB = r"""#!/usr/bin/env bash
echo "$0 $*" >> "$STUB_LOG"
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  mkdir -p "$3/bin"
  cp "$0" "$3/bin/python"
  printf 'export VIRTUAL_ENV=%s\nexport PATH="%s/bin:$PATH"\n' "$(cd "$3" && pwd)" "$(cd "$3" && pwd)" > "$3/bin/activate"
  exit 0
fi
case " $* " in
  *" install "*"-e "*) printf '#!/bin/sh\necho batchgen\n' > "$(dirname "$0")/batchgen"; chmod +x "$(dirname "$0")/batchgen" ;;
esac
exit 0
"""


def make_repo(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    stub = tmp_path / "python3"
    stub.write_text(STUB)
    stub.chmod(0o755)
    log = tmp_path / "calls.log"
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "STUB_LOG": str(log), "HOME": str(tmp_path)}
    return repo, log, env


def readme_run_command() -> str:
    text = (REPO / "README.md").read_text()
    (line,) = [x for x in text.splitlines() if x.startswith("bash scripts/setup.sh && ")]
    return line.split(" && ", 1)[1]


def test_setup_installs_where_the_readme_runs_batchgen_even_with_another_venv_active(tmp_path):
    repo, log, env = make_repo(tmp_path)
    other = tmp_path / "other-venv"
    (other / "bin").mkdir(parents=True)
    shutil.copy(tmp_path / "python3", other / "bin" / "python")
    env = {**env, "VIRTUAL_ENV": str(other), "PATH": f"{other}/bin:{env['PATH']}"}
    proc = subprocess.run(
        ["bash", "scripts/setup.sh"], cwd=repo, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    run = readme_run_command()
    assert run.startswith(".venv/bin/batchgen run ")
    assert (repo / ".venv" / "bin" / "batchgen").exists()  # the README's command now finds it
    assert not (other / "bin" / "batchgen").exists()  # the active venv was left alone, and said so
    assert f"the active virtual environment {other} is left alone" in proc.stderr
    assert "--active" in proc.stderr
    calls = log.read_text().splitlines()
    assert not [c for c in calls if c.startswith(str(other))], calls
    assert re.search(r"run .*\.venv/bin/batchgen", proc.stdout), proc.stdout


def test_setup_active_installs_into_the_active_venv(tmp_path):
    repo, log, env = make_repo(tmp_path)
    other = tmp_path / "gpu-venv"
    (other / "bin").mkdir(parents=True)
    shutil.copy(tmp_path / "python3", other / "bin" / "python")
    env = {**env, "VIRTUAL_ENV": str(other), "PATH": f"{other}/bin:{env['PATH']}"}
    proc = subprocess.run(
        ["bash", "scripts/setup.sh", "--active"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert (other / "bin" / "batchgen").exists() and not (repo / ".venv").exists()
    assert f"run {other}/bin/batchgen" in proc.stdout
    # --active without an active environment is refused, naming the fix.
    env.pop("VIRTUAL_ENV")
    proc = subprocess.run(
        ["bash", "scripts/setup.sh", "--active"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "no virtual environment is active" in proc.stderr
    assert os.path.exists(log)
