"""Job backends: where harness and grader runs execute. See `base.JobBackend`."""

from services.controller.backends.base import (GraderOutput, GraderStep, JobBackend, JobInfo,
                                               JobResult, JobSpec, JobState)
from services.controller.backends.local import LocalBackend

# Names a RunSpec's `backend` field may take ("" means "local").
BACKEND_NAMES = ("local",)

__all__ = ["BACKEND_NAMES", "GraderOutput", "GraderStep", "JobBackend", "JobInfo", "JobResult", "JobSpec", "JobState",
           "LocalBackend"]
