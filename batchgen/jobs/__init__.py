"""Job files: streaming reader, look-ahead window, committed-part writer, resume, and the runner."""

from batchgen.jobs.reader import JobInputError, JobReader, JobRow, ReaderOptions
from batchgen.jobs.runner import JobOptions, JobSummary, run_job

__all__ = ["JobInputError", "JobOptions", "JobReader", "JobRow", "JobSummary", "ReaderOptions", "run_job"]
