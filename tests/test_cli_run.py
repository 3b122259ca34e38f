"""batchgen.cli_run: the resume command printed when a run is interrupted or cannot write names
the program as the user started it, shell-quoted."""

from __future__ import annotations

import sys
import types

import pytest

from batchgen.cli_run import resume_command

ARGS = ["run", "my job.jsonl", "--overwrite", "--max-tokens", "8"]


@pytest.fixture
def started(monkeypatch, tmp_path):
    """Set how the process was started: `main_spec` the `__main__` module's spec name (None: a
    script), `argv`, `orig_argv`; PATH holds only an empty folder unless given."""

    def start(argv: list[str], main_spec: str | None = None, orig_argv: list[str] | None = None, path=None):
        main = types.ModuleType("__main__")
        main.__spec__ = None if main_spec is None else types.SimpleNamespace(name=main_spec)
        monkeypatch.setitem(sys.modules, "__main__", main)
        monkeypatch.setattr(sys, "argv", argv)
        monkeypatch.setattr(sys, "orig_argv", orig_argv or [sys.executable, *argv])
        monkeypatch.setenv("PATH", str(path or tmp_path / "empty"))

    return start


def test_a_script_path_is_kept_as_typed(started):
    started([".venv/bin/batchgen", *ARGS])
    assert resume_command(ARGS) == ".venv/bin/batchgen run 'my job.jsonl' --max-tokens 8"


def test_a_script_found_on_path_is_its_bare_name(started, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "batchgen"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    started([str(script), *ARGS], path=bin_dir)
    assert resume_command(ARGS) == "batchgen run 'my job.jsonl' --max-tokens 8"
    # another batchgen first on PATH: the path as given, which is what ran
    other = tmp_path / "other"
    other.mkdir()
    (other / "batchgen").write_text("#!/bin/sh\n")
    (other / "batchgen").chmod(0o755)
    started([str(script), *ARGS], path=f"{other}:{bin_dir}")
    assert resume_command(ARGS) == f"{script} run 'my job.jsonl' --max-tokens 8"


def test_a_module_run_is_the_interpreter_and_its_options_as_typed(started):
    argv = ["/site-packages/batchgen/__main__.py", *ARGS]
    started(argv, "batchgen.__main__", ["../my env/bin/python", "-X", "utf8", "-m", "batchgen", *ARGS])
    assert (
        resume_command(ARGS) == "'../my env/bin/python' -X utf8 -m batchgen run 'my job.jsonl' --max-tokens 8"
    )
    started(argv, "batchgen.__main__", ["python3", "-mbatchgen", *ARGS])
    assert resume_command(ARGS) == "python3 -mbatchgen run 'my job.jsonl' --max-tokens 8"
    # an interpreter whose original command line is not known (embedded): this one's path
    started(argv, "batchgen.__main__", ["prog"])
    assert resume_command(ARGS) == f"{sys.executable} -m batchgen run 'my job.jsonl' --max-tokens 8"
