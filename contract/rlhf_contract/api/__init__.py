"""The RLHFJob API models, rules and loading."""

from .load import STDIN, JobError, Problem, job_source, load_job, problems, read_job_document, validate_job
from .models import RLHFJob, RLHFJobSpec

__all__ = ["STDIN", "JobError", "Problem", "RLHFJob", "RLHFJobSpec", "job_source", "load_job", "problems",
           "read_job_document", "validate_job"]
