"""The RLHFJob API models, rules and loading."""

from .load import JobError, Problem, load_job, problems, validate_job
from .models import RLHFJob, RLHFJobSpec

__all__ = ["JobError", "Problem", "RLHFJob", "RLHFJobSpec", "load_job", "problems", "validate_job"]
