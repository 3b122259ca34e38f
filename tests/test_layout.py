"""Size limits of the source: no file in batchgen/ or kernels/ over 400 lines and no function there
over 80 lines (Triton kernel files excepted: a kernel and its launcher read best in one file).

A function's lines run from its `def` to its last line, decorators left out. A Typer command's
parameter list is its options' declarations (`batchgen run` has some seventy), so a command is
measured from the first line of its body. A known exception must still be over its limit (else the
test says to drop it from the list), so the list can only shrink.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
# Triton kernels: each file is a kernel and the Python function that checks and launches it.
EXEMPT_FOLDERS = ("kernels/triton",)
# (file, function) over the limit for now; none.
KNOWN_LONG_FUNCTIONS: set[tuple[str, str]] = set()


def source_files(folder: str) -> list[Path]:
    return sorted(
        p
        for p in (ROOT / folder).rglob("*.py")
        if not any(p.relative_to(ROOT).as_posix().startswith(f + "/") for f in EXEMPT_FOLDERS)
    )


def is_typer_command(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether the function's parameters are Typer options: annotated with `typer.Option` /
    `typer.Argument` or with a shared option type of `batchgen.cli_types` (imported as `opt`)."""
    for arg in node.args.args + node.args.kwonlyargs:
        text = ast.unparse(arg.annotation) if arg.annotation is not None else ""
        if "typer.Option" in text or "typer.Argument" in text or text.startswith("opt."):
            return True
    return False


def function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = node.body[0].lineno if is_typer_command(node) else node.lineno
    return node.end_lineno - first + 1


def long_functions(path: Path) -> dict[str, int]:
    """Functions (methods as Class.name) of `path` over MAX_FUNCTION_LINES -> their lines."""
    found = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                if function_lines(child) > MAX_FUNCTION_LINES:
                    found[prefix + child.name] = function_lines(child)
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")

    visit(ast.parse(path.read_text(), str(path)), "")
    return found


def test_no_source_file_over_the_limit() -> None:
    over = {
        p.relative_to(ROOT).as_posix(): n
        for p in source_files("batchgen") + source_files("kernels")
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not over, f"files over {MAX_FILE_LINES} lines (split them by concept): {over}"


def test_no_function_over_the_limit() -> None:
    over = {}
    for path in source_files("batchgen") + source_files("kernels"):
        for name, n in long_functions(path).items():
            over[(path.relative_to(ROOT).as_posix(), name)] = n
    unexpected = {key: n for key, n in over.items() if key not in KNOWN_LONG_FUNCTIONS}
    assert not unexpected, (
        f"functions over {MAX_FUNCTION_LINES} lines (move steps into named helpers): {unexpected}"
    )
    fixed = KNOWN_LONG_FUNCTIONS - set(over)
    assert not fixed, f"now within the limit, drop them from KNOWN_LONG_FUNCTIONS: {sorted(fixed)}"


def test_the_measure_counts_a_command_from_its_body(tmp_path: Path) -> None:
    """The checker itself: a long helper is found, a command's long option list is not counted."""
    options = "".join(f"    a{i}: Annotated[int, typer.Option()] = 0,\n" for i in range(90))
    body = "".join(f"    x = {i}\n" for i in range(85))
    (tmp_path / "m.py").write_text(
        f"def command(\n{options}) -> None:\n    pass\n\n\ndef helper() -> None:\n{body}\n"
        f"class C:\n    def method(self) -> None:\n{''.join('    ' + line + chr(10) for line in body.splitlines())}"
    )
    assert long_functions(tmp_path / "m.py") == {"helper": 86, "C.method": 86}


@pytest.mark.parametrize("module", ["batchgen.metrics", "batchgen.metrics_record", "batchgen.jobs.options"])
def test_a_module_imports_on_its_own(module: str) -> None:
    """Imported first in a fresh interpreter, a module must not meet a half-initialized one."""
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
