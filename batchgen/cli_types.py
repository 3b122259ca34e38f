"""Typer option parsers shared by `batchgen run` and `batchgen bench`."""

from __future__ import annotations

import typer

from batchgen.config import parse_memory_size


def memory_size(text: str) -> int:
    """`parse_memory_size` for Typer: "1073741824", "2GiB", "512MiB", ... -> bytes.

    Raises:
        typer.BadParameter: not a size (Typer turns it into a usage error, exit 2).
    """
    try:
        return parse_memory_size(text)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
