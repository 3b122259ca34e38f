"""The type check bites (`scripts/typecheck.sh`, mypy with pyproject.toml's settings): a module that
reads a wrong attribute of a `SchedulerOutput` or a `Request` fails it, the same module with the
right attributes passes. With the cache of a run before (scripts/test.sh runs the check first) each
call takes seconds; on a cold cache the first one reads torch's types for about two minutes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")

ROOT = Path(__file__).resolve().parent.parent

MODULE = """
from batchgen.engine.request import Request
from batchgen.engine.scheduler_output import SchedulerOutput


def tokens(out: SchedulerOutput) -> int:
    return sum(s.num_new_tokens for s in out.{scheduled})


def computed(request: Request) -> int:
    return request.{computed}
"""


def typecheck(tmp_path: Path, **names: str) -> subprocess.CompletedProcess[str]:
    """scripts/typecheck.sh over batchgen and a throwaway module using `names` as attributes."""
    module = tmp_path / "uses_scheduler_output.py"
    module.write_text(MODULE.format(**names))
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "typecheck.sh"), str(module)],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"},
    )


def test_a_wrong_attribute_on_scheduler_output_or_request_fails_the_check(tmp_path: Path) -> None:
    right = typecheck(tmp_path, scheduled="scheduled", computed="num_computed_tokens")
    assert right.returncode == 0, right.stdout + right.stderr
    wrong = typecheck(tmp_path, scheduled="scheduled_requests", computed="num_computed")
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    assert '"SchedulerOutput" has no attribute "scheduled_requests"' in wrong.stdout
    assert '"Request" has no attribute "num_computed"' in wrong.stdout
    assert "Found 2 errors in 1 file" in wrong.stdout
