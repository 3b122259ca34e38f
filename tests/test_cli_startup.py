"""The command line starts without torch: `--help` and option errors answer at once."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[1]


def test_importing_the_cli_does_not_import_torch() -> None:
    code = "import sys, batchgen, batchgen.cli; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_llm_is_still_importable_from_the_package() -> None:
    from batchgen import LLM
    from batchgen.llm import LLM as LLMClass

    assert LLM is LLMClass


def test_help_runs_through_the_console_entry_point() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "batchgen", "--help"], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "run" in proc.stdout and "bench" in proc.stdout


def test_version_prints_the_installed_version_and_exits_0() -> None:
    from importlib.metadata import version

    proc = subprocess.run(
        [sys.executable, "-m", "batchgen", "--version"], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    declared = re.search(r'^version = "(.+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert declared and version("batchgen") == declared.group(1)  # the metadata of this checkout's
    assert proc.stdout == f"batchgen {declared.group(1)}\n"


def test_plan_help_lists_only_the_options_that_change_a_plan() -> None:
    def help_of(command: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "batchgen", command, "--help"],
            capture_output=True, text=True, cwd=REPO, timeout=60, env={**os.environ, "COLUMNS": "200"},
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    plan, run = help_of("plan"), help_of("run")
    for option in ("--metrics-port", "--commit-every", "--no-dashboard", "--replicas", "--ray-address"):
        assert option in run and option not in plan, option
    for option in ("--max-tokens", "--kv-cache-memory", "--limit", "--json", "--calibrate"):
        assert option in plan, option


def test_an_import_error_in_the_bench_fails_loudly() -> None:
    """`batchgen bench` was registered inside `try/except ImportError`: a broken import silently
    removed the command. It must stop the CLI with the import error instead."""
    code = "import sys; sys.modules['batchgen.bench.cli'] = None; import batchgen.cli"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode != 0
    assert "ModuleNotFoundError: import of batchgen.bench.cli halted" in proc.stderr


def test_third_party_progress_bars_are_off_without_a_terminal() -> None:
    """GGUF conversion and weight loading draw tqdm bars on stderr; in a log (no terminal) each is
    one long line of carriage-return redraws. The command turns them off there, before the
    libraries that read the switches are imported; a switch the user set is kept."""
    code = (
        "import os, sys\n"
        "sys.argv = ['batchgen', '--help']\n"
        "import batchgen.__main__ as m\n"
        "try:\n    m.main()\nexcept SystemExit:\n    pass\n"
        "from tqdm import tqdm\n"
        "for _ in tqdm(range(3), desc='Converting and de-quantizing GGUF tensors'): pass\n"
        "print(os.environ.get('TQDM_DISABLE'), os.environ.get('HF_HUB_DISABLE_PROGRESS_BARS'))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "1 1"
    assert "GGUF tensors" not in proc.stderr
    env = {**__import__("os").environ, "HF_HUB_DISABLE_PROGRESS_BARS": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60, env=env
    )
    assert proc.stdout.strip().splitlines()[-1] == "1 0"


def test_third_party_progress_bars_stay_on_a_terminal() -> None:
    from batchgen.__main__ import quiet_third_party_progress

    class Terminal:
        def isatty(self) -> bool:
            return True

    assert quiet_third_party_progress(Terminal()) is False
