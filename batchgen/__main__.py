"""The `batchgen` command (`python -m batchgen` too)."""

import signal
import sys


def main() -> None:
    """Run the command line. A Ctrl-C before a command has taken over (while the CLI itself is
    imported) exits 130 with one line instead of a traceback; commands handle their own."""
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
