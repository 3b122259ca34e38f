"""Job files: streaming reader, look-ahead window, committed-part writer, resume, options, and the runner."""

from batchgen.jobs.options import JobOptions, JobSummary
from batchgen.jobs.reader import JobInputError, JobReader, JobRow, ReaderOptions
from batchgen.jobs.runner import run_job

__all__ = ["JobInputError", "JobOptions", "JobReader", "JobRow", "JobSummary", "ReaderOptions", "run_job"]
