"""The error a job raises before any model work: the CLI turns it into exit code 2."""


class JobInputError(Exception):
    """The job cannot start (missing file, unknown format, missing column, unwritable output,
    changed input on resume). Raised before the model is loaded; the CLI exits with code 2."""
