"""Progress notes: what a command tells its user while the engine starts, such as a GGUF file's
one-time conversion or the first measurement of this machine's kernels.

They are log records at INFO carrying `PROGRESS` as `extra`, so the code that knows (the GGUF cache,
the kernel registry) says so where it happens, and a command shows exactly these records
(`shown`) without turning on every INFO log.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

PROGRESS = {"batchgen_progress": True}
_LOGGER = "batchgen"


class _Forward(logging.Handler):
    def __init__(self, show: Callable[[str], None]) -> None:
        super().__init__(logging.INFO)
        self.show = show

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "batchgen_progress", False):
            self.show(record.getMessage())
        elif record.levelno >= logging.WARNING:
            # This handler's presence keeps Python's last-resort handler, which prints warnings when
            # a logger has none, from printing them: so it shows them itself.
            self.show(f"{record.levelname.lower()}: {record.getMessage()}")


@contextlib.contextmanager
def shown(show: Callable[[str], None]) -> Iterator[None]:
    """Within the block, pass every progress note logged under `batchgen` to `show` (one line each),
    and every warning or error ("warning: ..."); other records stay unshown."""
    logger = logging.getLogger(_LOGGER)
    handler, level = _Forward(show), logger.level
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)  # INFO records reach the handler; nothing else prints them
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
