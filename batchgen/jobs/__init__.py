"""Job files: streaming reader, look-ahead window, committed-part writer, resume, options, and the runner."""

from batchgen.jobs.errors import JobInputError
from batchgen.jobs.input.reader import JobReader, ReaderOptions
from batchgen.jobs.input.rows import JobRow
from batchgen.jobs.options import JobOptions, JobSummary
from batchgen.jobs.runner import run_job

__all__ = ["JobInputError", "JobOptions", "JobReader", "JobRow", "JobSummary", "ReaderOptions", "run_job"]
