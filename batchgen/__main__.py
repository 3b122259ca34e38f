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
        for name in ("SIGINT", "SIGTERM", "SIGHUP"):
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), signal.SIG_IGN)


if __name__ == "__main__":
    main()
