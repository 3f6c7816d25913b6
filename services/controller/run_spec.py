"""A run's spec: defaults, validation, and its tasks (inline or from a JSONL file).

Task ids: a task's own `task_id` (inline), else the rules of `harnessrl.tasks` (its data's
"id" or "task_id" field, else its position), which also reads task files.
A relative `tasks_file` is read relative to the controller's working directory: give absolute
paths (the harness and grader commands run in each attempt's own directory, so their paths
must be absolute too).
"""

from __future__ import annotations

import json
import math
import re

from harnessrl.errors import InvalidArgument
from harnessrl.sampling import unmatched
from harnessrl.tasks import check_task_ids, load_task_file, task_id, task_object
from harnessrl.v1 import common_pb2 as c
from services.controller import tampered_rewards
from services.controller.sandbox import policy as sandbox_policy

DEFAULT_GROUP_SIZE = 1
DEFAULT_CONCURRENCY = 4
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_GRADER_TIMEOUT_S = 60.0
DEFAULT_GROUP_GRADER_TIMEOUT_S = 300.0
DEFAULT_SETUP_TIMEOUT_S = 300.0
DEFAULT_MAX_ATTEMPTS = 1
DEFAULT_STREAM = "train"
MAX_GROUP_SIZE = 4096
MAX_ROLLOUTS_PER_RUN = 100_000  # tasks x group_size; the run's records are built at once
MAX_TIMEOUT_S = 7 * 24 * 3600.0
_RUN_ID = re.compile(r"^[A-Za-z0-9._-]{1,100}$")


def check_run_id(run_id: str) -> str:
    if not _RUN_ID.match(run_id):
        raise InvalidArgument(f"invalid run_id {run_id!r}: use 1-100 of [A-Za-z0-9._-]")
    return run_id


# Credentials a rollout's job must never be handed through RunSpec.env: identities
# (harnessrl/identity.py), the engine's keys (harnessrl/engine_guard.py), the judge's key.
RESERVED_ENV = ("HARNESSRL_TLS_DIR", "HARNESSRL_TLS_PEM", "HARNESSRL_SCOPE_TOKEN",
                "HARNESSRL_TLS_ROOT", "HARNESSRL_INSECURE")
RESERVED_ENV_PREFIXES = ("HARNESSRL_ENGINE_", "HARNESSRL_JUDGE_API_KEY")


def normalize(spec: c.RunSpec, backends: tuple[str, ...], default_backend: str) -> c.RunSpec:
    """A copy of `spec` with defaults filled in (`default_backend` where it names none);
    `InvalidArgument` says what is wrong."""
    s = c.RunSpec()
    s.CopyFrom(spec)
    if s.admission_max_staleness < 0 or s.admission_batch_groups < 0:
        raise InvalidArgument("admission_max_staleness and admission_batch_groups must be >= 0")
    if s.max_rollout_image_bytes < 0:
        raise InvalidArgument(f"max_rollout_image_bytes must be >= 0 (0: the gateway's), got "
                              f"{s.max_rollout_image_bytes}")
    if s.group_size < 0 or s.concurrency < 0 or s.max_attempts < 0:
        raise InvalidArgument("group_size, concurrency and max_attempts must be >= 1 "
                              "(0 takes the default)")
    if s.group_size > MAX_GROUP_SIZE:
        raise InvalidArgument(f"group_size {s.group_size} is over {MAX_GROUP_SIZE}")
    for name in ("timeout_s", "grader_timeout_s", "group_grader_timeout_s", "setup_timeout_s"):
        v = getattr(s, name)
        if v < 0 or not math.isfinite(v) or v > MAX_TIMEOUT_S:
            raise InvalidArgument(f"{name} must be a positive number of seconds up to "
                                  f"{MAX_TIMEOUT_S:.0f} (0: default)")
    s.group_size = s.group_size or DEFAULT_GROUP_SIZE
    s.concurrency = s.concurrency or DEFAULT_CONCURRENCY
    s.timeout_s = s.timeout_s or DEFAULT_TIMEOUT_S
    s.grader_timeout_s = s.grader_timeout_s or DEFAULT_GRADER_TIMEOUT_S
    if s.group_grader_command:
        s.group_grader_timeout_s = s.group_grader_timeout_s or DEFAULT_GROUP_GRADER_TIMEOUT_S
    if s.setup_command:
        s.setup_timeout_s = s.setup_timeout_s or DEFAULT_SETUP_TIMEOUT_S
    s.max_attempts = s.max_attempts or DEFAULT_MAX_ATTEMPTS
    s.stream = s.stream or DEFAULT_STREAM
    s.backend = s.backend or default_backend
    if s.reward_source == c.REWARD_SOURCE_UNSPECIFIED:
        s.reward_source = c.REWARD_SOURCE_GRADER_JSON
    if s.reward_source not in c.RewardSource.values():
        raise InvalidArgument(f"unknown reward_source {s.reward_source}")
    tampered_rewards.normalize(s)
    if s.backend not in backends:
        raise InvalidArgument(f"unknown backend {s.backend!r}; this controller has "
                              f"{', '.join(backends)}")
    if not s.harness_command or not s.harness_command[0]:
        raise InvalidArgument("harness_command is empty")
    if s.setup_command and not s.setup_command[0]:
        raise InvalidArgument("setup_command's program is empty")
    if s.setup_command and s.backend != "local":
        raise InvalidArgument("setup_command runs on the local backend only (on Kubernetes, "
                              "an init container of your Job template does the same)")
    sandbox_policy.check_spec(s)
    if s.group_grader_command and not s.group_grader_command[0]:
        raise InvalidArgument("group_grader_command's program is empty")
    if s.reward_source == c.REWARD_SOURCE_GROUP_GRADER and not s.group_grader_command:
        raise InvalidArgument("REWARD_SOURCE_GROUP_GRADER needs a group_grader_command")
    if s.reward_source in (c.REWARD_SOURCE_HARNESS, c.REWARD_SOURCE_GROUP_GRADER):
        if s.grader_command:
            raise InvalidArgument(f"grader_command is not used with "
                                  f"{c.RewardSource.Name(s.reward_source)} (no per-attempt "
                                  "grader runs); leave it empty")
    elif not s.grader_command or not s.grader_command[0]:
        raise InvalidArgument(f"grader_command is empty but reward_source is "
                              f"{c.RewardSource.Name(s.reward_source)}")
    for k, v in s.env.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise InvalidArgument(f"invalid environment variable {k!r}")
        if k in RESERVED_ENV or k.startswith(RESERVED_ENV_PREFIXES):
            raise InvalidArgument(f"environment variable {k!r} carries a service's credentials "
                                  "and is not a rollout's to set (docs/security.md)")
    if s.HasField("sampling") and (problem := unmatched(s.sampling, s.stream)):
        raise InvalidArgument(problem)
    if s.tasks and s.tasks_file:
        raise InvalidArgument("give tasks inline or as tasks_file, not both")
    if not s.tasks and not s.tasks_file:
        raise InvalidArgument("no tasks: give tasks inline or a tasks_file")
    return s


def resolve_tasks(spec: c.RunSpec) -> list[c.Task]:
    """The run's tasks with ids and canonical JSON; `InvalidArgument` for a bad file or task."""
    if spec.tasks_file:
        tasks = [c.Task(task_id=tid, data_json=json.dumps(data))
                 for tid, data in load_task_file(spec.tasks_file)]
    else:
        tasks = []
        for i, t in enumerate(spec.tasks):
            where = f"task {i}" + (f" ({t.task_id})" if t.task_id else "")
            data = task_object(t.data_json or "{}", where)
            tid = t.task_id or task_id(data, str(i), where)
            tasks.append(c.Task(task_id=tid, data_json=json.dumps(data)))
    if not tasks:
        raise InvalidArgument("the run has no tasks" +
                              (f" ({spec.tasks_file} is empty)" if spec.tasks_file else ""))
    if len(tasks) * max(1, spec.group_size) > MAX_ROLLOUTS_PER_RUN:
        raise InvalidArgument(f"{len(tasks)} tasks x group_size {spec.group_size} is over "
                              f"{MAX_ROLLOUTS_PER_RUN} rollouts per run")
    check_task_ids([t.task_id for t in tasks])
    return tasks


def task_env(task: c.Task) -> dict[str, str]:
    """HARNESSRL_TASK_ID, HARNESSRL_TASK_JSON and HARNESSRL_TASK_<FIELD> for each top-level
    field (name upper-cased, other than [A-Z0-9_] turned into _; strings as they are, other
    values as JSON)."""
    data = json.loads(task.data_json)
    env = {"HARNESSRL_TASK_ID": task.task_id, "HARNESSRL_TASK_JSON": task.data_json}
    for key, value in data.items():
        name = "HARNESSRL_TASK_" + re.sub(r"[^A-Z0-9_]", "_", str(key).upper())
        if name in ("HARNESSRL_TASK_ID", "HARNESSRL_TASK_JSON", "HARNESSRL_TASK_FILE"):
            continue  # those keep their meaning; the field is in HARNESSRL_TASK_JSON
        env[name] = value if isinstance(value, str) else json.dumps(value)
        if "\0" in env[name]:
            env[name] = json.dumps(value)  # NUL cannot travel in an environment variable
    return env
