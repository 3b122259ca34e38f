"""`python -m batchgen`: the same command line as the `batchgen` script."""

from batchgen.cli import app

if __name__ == "__main__":
    app(prog_name="batchgen")
