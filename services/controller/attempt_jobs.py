"""The jobs of one attempt, specified: its folders, environment, setup, harness and sandbox.

An attempt's folder `<workdir_root>/<run>/<task>-<i>/attempt-<k>` holds the controller's
records of it (the jobs' output, exit records, the grader's output); its `work/` folder is the
harness's: its working directory, `task.json`, whatever the setup step prepared, and the only
place a sandboxed harness or grader may write. The records stay out of their reach.

Sandboxing (docs/sandbox.md) applies on the local backend unless the controller's sandbox is
off or the run opts out (`sandbox.disabled`); the Kubernetes backend runs each attempt in a
pod of its own.
"""

from __future__ import annotations

import os
from pathlib import Path

from harnessrl import identity
from harnessrl.v1 import common_pb2 as c
from services.controller import grading
from services.controller.backends import JobBackend, JobSpec
from services.controller.config import ControllerConfig
from services.controller.run_spec import task_env
from services.controller.sandbox import policy as sandbox_policy

WORK = "work"


class AttemptJobs:
    """Specifies the jobs of a run's attempts."""

    def __init__(self, run: c.Run, tasks: dict[str, c.Task], cfg: ControllerConfig,
                 backend: JobBackend, task_files: set[str]) -> None:
        self.run, self.spec, self.tasks, self.cfg = run, run.spec, tasks, cfg
        self.sandboxed = (backend.name == "local" and cfg.sandbox
                          and not self.spec.sandbox.disabled)
        self._task_files = task_files  # every run's, shared: a harness sees none of them
        self._root = Path(cfg.workdir_root).resolve()
        # The rollouts' folders are the controller's alone: files a sandbox made there (a
        # setuid binary owned by the user the sandbox maps to) are out of other users' reach.
        self._root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._root.chmod(0o700)

    def hidden(self) -> list[Path]:
        """What no sandbox of this controller may see, even inside a path it may read."""
        keys = [os.environ.get(identity.TLS_DIR_ENV, ""), self.cfg.grader_tls_dir]
        return [Path(p).resolve() for p in (self.cfg.secret_file, self.cfg.workdir_root,
                                            *self.cfg.sandbox_hidden_paths, *self._task_files,
                                            *filter(None, keys))]

    def folder(self, ro: c.Rollout, attempt: int) -> Path:
        return (self._root / self.run.run_id / f"{grading.safe_name(ro.task_id)}-"
                f"{ro.index_in_group}" / f"attempt-{attempt}")

    def job_id(self, rid: str, role: str, attempt: int) -> str:
        return f"{self.run.run_id}.{grading.short_hash(rid)}.{role}{attempt}"

    def harness_env(self, ro: c.Rollout, attempt: int, token: str,
                    work: Path) -> dict[str, str]:
        """spec.env, then the task's fields, then what the controller sets (which wins)."""
        env = dict(self.spec.env)
        env.update(task_env(self.tasks[ro.task_id]))
        env.update({
            "OPENAI_BASE_URL": self.cfg.gateway_url,
            "OPENAI_API_KEY": token,
            "HARNESSRL_MODEL": self.spec.model,
            "HARNESSRL_RUN_ID": self.run.run_id,
            "HARNESSRL_ROLLOUT_ID": ro.rollout_id,
            "HARNESSRL_GROUP_ID": ro.group_id,
            "HARNESSRL_INDEX_IN_GROUP": str(ro.index_in_group),
            "HARNESSRL_ATTEMPT": str(attempt),
            "HARNESSRL_TASK_FILE": str(work / "task.json"),
            "HARNESSRL_WORKDIR": str(work),
        })
        return env

    def prepare(self, ro: c.Rollout, attempt: int) -> tuple[Path, Path]:
        """Makes the attempt's folder and work folder (with `task.json`): (folder, work)."""
        folder = self.folder(ro, attempt)
        work = folder / WORK
        work.mkdir(parents=True, exist_ok=True)
        # A resumed attempt's harness may have left a link named task.json: never follow it.
        task = work / "task.json"
        task.unlink(missing_ok=True)
        fd = os.open(task, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(self.tasks[ro.task_id].data_json)
        return folder, work

    def setup(self, rid: str, attempt: int, env: dict[str, str], folder: Path,
              labels: dict[str, str]) -> JobSpec | None:
        """The trusted setup step (outside any sandbox, without the model credential)."""
        if not self.spec.setup_command:
            return None
        return JobSpec(
            job_id=self.job_id(rid, "s", attempt), argv=list(self.spec.setup_command),
            env={k: v for k, v in env.items() if k not in grading.CREDENTIAL_ENV},
            workdir=folder, cwd=folder / WORK, timeout_s=self.spec.setup_timeout_s,
            labels={**labels, "role": "setup"}, stdout_name="setup.stdout.log",
            stderr_name="setup.stderr.log")

    def harness_sandbox(self, work: Path) -> sandbox_policy.SandboxPolicy | None:
        if not self.sandboxed:
            return None
        return sandbox_policy.build(
            self.spec, argv=list(self.spec.harness_command), work=work,
            timeout_s=self.spec.timeout_s, hidden=self.hidden(),
            egress=list(self.spec.sandbox.egress), gateway_url=self.cfg.gateway_url)

    def grader_sandbox(self, work: Path, harness_output: list[Path]
                       ) -> sandbox_policy.SandboxPolicy | None:
        """The per-attempt grader's: the harness's work folder and its output (read-only),
        no gateway; its own egress; it may sandbox the tests it runs (`nested`)."""
        if not self.sandboxed:
            return None
        return sandbox_policy.build(
            self.spec, argv=list(self.spec.grader_command), work=work,
            timeout_s=self.spec.grader_timeout_s, hidden=self.hidden(),
            egress=list(self.spec.sandbox.grader_egress), read_only=harness_output,
            nested=True)
