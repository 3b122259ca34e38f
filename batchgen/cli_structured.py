"""`batchgen run`'s structured outputs flags (`--json-schema FILE`, `--regex`, `--choice a,b,c`,
`--grammar FILE`) as the job's constraint; the flags themselves are declared in
`batchgen.cli_types`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

STRUCTURED_FLAGS = ("json_schema", "regex", "choice", "grammar")


def structured_flags(values: dict[str, Any]) -> dict[str, Any] | None:
    """The job-wide constraint of the constraint flags in `values`, as `StructuredOutputsParams`
    fields ({"json": schema} read from `--json-schema`'s file, {"regex": ...}, {"choice": [...]}
    with `--choice`'s comma lists split, {"grammar": text} read from `--grammar`'s file); None
    when none is given. Whether the library can compile it is checked with the job's options.

    Raises:
        typer.BadParameter: two flags, a file that cannot be read, a schema that is not JSON, an
            empty regex, grammar file or choice list, or an empty choice in the list (exit 2).
    """
    # An empty --regex '' is given (and refused below), not "no constraint".
    given = [name for name in STRUCTURED_FLAGS if values.get(name) not in (None, [], ())]
    if not given:
        return None
    flag = f"--{given[0].replace('_', '-')}"
    if len(given) > 1:
        raise typer.BadParameter(
            f"give one of --json-schema, --regex, --choice, --grammar (got {len(given)}); a row's own "
            "column can set another constraint",
            param_hint=flag,
        )
    value = values[given[0]]
    if given[0] == "regex":
        if not value:
            raise typer.BadParameter(
                "the regex is empty; give a pattern, e.g. --regex '[0-9]+'", param_hint=flag
            )
        return {"regex": value}
    if given[0] == "choice":
        choices = [c.strip() for item in value for c in item.split(",")]
        if not any(choices):
            raise typer.BadParameter(
                "the choice list is empty; give the strings, e.g. --choice yes,no", param_hint=flag
            )
        if not all(choices):  # as a row's list with an empty string: an error, not dropped
            raise typer.BadParameter(
                f"an empty choice in {','.join(value)!r}; give non-empty strings, e.g. --choice yes,no",
                param_hint=flag,
            )
        return {"choice": choices}
    try:
        text = Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise typer.BadParameter(f"cannot read {value}: {e}", param_hint=flag) from None
    if given[0] == "grammar":
        if not text.strip():
            raise typer.BadParameter(f"{value} is empty; give an EBNF (GBNF) grammar file", param_hint=flag)
        return {"grammar": text}
    import json

    try:
        return {"json": json.loads(text)}
    except ValueError as e:
        raise typer.BadParameter(
            f"{value} is not JSON ({e}); give a JSON schema file", param_hint=flag
        ) from None
