"""The `batchgen` command (`python -m batchgen` too)."""

import os
import signal
import sys
from typing import TextIO

# The progress bars of the libraries batchgen calls: tqdm (transformers' GGUF conversion and weight
# loading), huggingface_hub's downloads and datasets' loading. Each reads its switch when imported.
THIRD_PARTY_PROGRESS_OFF = {
    "TQDM_DISABLE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
}


def quiet_third_party_progress(stream: TextIO | None = None) -> bool:
    """Turn the third-party progress bars off when `stream` (default: stderr, where they draw) is
    not a terminal: in a log file or CI their carriage-return redraws are one long garbled line
    each. A switch the user set is kept. Call before those libraries are imported; returns whether
    the bars were turned off."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return False
    for name, value in THIRD_PARTY_PROGRESS_OFF.items():
        os.environ.setdefault(name, value)
    return True


def main() -> None:
    """Run the command line. A Ctrl-C before a command has taken over (while the CLI itself is
    imported) exits 130 with one line instead of a traceback; commands handle their own."""
    quiet_third_party_progress()
    try:
        from batchgen.cli import app

        app(prog_name="batchgen")
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        # The command is over (its rows committed, its exit code chosen): a Ctrl-C or SIGTERM while
        # the interpreter shuts down (torch takes a while) must not turn exit 0 into a kill.
        from batchgen.stop_signals import STOP_SIGNALS

        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)


if __name__ == "__main__":
    main()
