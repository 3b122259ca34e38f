"""The `batchgen` command (`python -m batchgen` too)."""

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


if __name__ == "__main__":
    main()
