"""Job backends: where harness and grader runs execute. See `base.JobBackend`.

`local` (`local.LocalBackend`) runs process groups on the controller's machine; `kubernetes`
(`kubernetes.KubernetesBackend`, imported only where configured) runs a Job per attempt.
"""

from services.controller.backends.base import (GraderOutput, GraderStep, JobBackend, JobInfo,
                                               JobResult, JobSpec, JobState)
from services.controller.backends.local import LocalBackend

__all__ = ["GraderOutput", "GraderStep", "JobBackend", "JobInfo", "JobResult", "JobSpec",
           "JobState", "LocalBackend"]
