"""Configuration of the controller service."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from typing import Any, ClassVar, Self

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import SettingsConfigDict

from harnessrl.config import ServiceConfig, read_config_file
from harnessrl.metrics import METRICS_BIND_HELP


class KubernetesSection(BaseModel):
    """The kubernetes job backend (docs/kubernetes-jobs.md): a Job per attempt. Off until
    `job_template` is set. File `k8s: {job_template: ...}`, flag `--k8s.job-template`, env
    `HARNESSRL_CONTROLLER_K8S__JOB_TEMPLATE`."""

    model_config = ConfigDict(extra="forbid")

    job_template: str = Field(
        "", description="Job template (YAML) of the kubernetes backend: your harness image "
                        "and resources (see docs/kubernetes-jobs.md); the backend is "
                        "available when this is set")
    namespace: str = Field(
        "", description="namespace of the rollout Jobs; empty: the service account's "
                        "namespace in a pod, else the kubeconfig context's (else 'default')")
    kubeconfig: str = Field(
        "", description="kubeconfig file; empty: the in-cluster service account inside a pod "
                        "(KUBERNETES_SERVICE_HOST set), else ~/.kube/config or $KUBECONFIG")
    gateway_url: str = Field(
        "", description="the gateway's /v1 URL as rollout pods reach it (its in-cluster "
                        "Service, e.g. http://gateway.harnessrl.svc:8080/v1); empty: "
                        "gateway_url")
    job_creates_per_s: float = Field(
        10.0, gt=0, description="rate limit of Job creations (the API server's protection)")
    relist_s: float = Field(
        30.0, gt=0, description="the Job and Pod watches are re-listed this often (and at "
                                "once after a 410 Gone)")
    pending_timeout_s: float = Field(
        300.0, gt=0, description="an attempt whose pod stays unschedulable this long fails "
                                 "with the scheduler's reason")
    secret_timeout_s: float = Field(
        60.0, gt=0, description="an attempt whose pod cannot start this long for a missing "
                                "Secret (CreateContainerConfigError) fails")
    ttl_after_finished_s: int = Field(
        3600, ge=0, description="ttlSecondsAfterFinished of each Job: how long Kubernetes "
                                "keeps a finished Job and its pod (the controller deletes "
                                "the Jobs it saw end)")
    deadline_margin_s: float = Field(
        30.0, ge=0, description="activeDeadlineSeconds = attempt timeout + this; the "
                                "controller ends a Job at its timeout itself, the deadline "
                                "bounds Jobs no controller watches")


def _renamed(old: str) -> str:
    """The error for a flat `k8s_<field>` setting (the names before the `k8s` section)."""
    new = old.removeprefix("k8s_")
    return (f"controller setting {old} is now k8s.{new} (the k8s_* settings became the k8s "
            f"section): in a config file `k8s: {{{new}: ...}}`, flag "
            f"--k8s.{new.replace('_', '-')}, env HARNESSRL_CONTROLLER_K8S__{new.upper()}")


def _refuse_flat_k8s(names: Iterable[str]) -> None:
    """ValueError naming the new key when `names` hold an old flat `k8s_*` setting."""
    old = set(names) & {f"k8s_{field}" for field in KubernetesSection.model_fields}
    if old:
        raise ValueError(_renamed(sorted(old)[0]))


class _RenamedFlag(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        parser.error(_renamed(self.dest))


class ControllerConfig(ServiceConfig):
    """harnessrl controller: runs harnesses for datasets of tasks, grades them, reports rewards."""

    model_config = SettingsConfigDict(env_prefix="HARNESSRL_CONTROLLER_", extra="forbid",
                                      populate_by_name=True, env_nested_delimiter="__")
    secret_fields: ClassVar[tuple[str, ...]] = ("secret",)

    bind: str = Field("127.0.0.1:50053", description="host:port of the gRPC server (port 0: any)")
    store_address: str = Field("127.0.0.1:50051", description="host:port of the store service")
    gateway_url: str = Field(
        "http://127.0.0.1:8080/v1",
        description="the gateway's OpenAI-compatible base URL (ends in /v1), given to every "
                    "harness as OPENAI_BASE_URL")
    secret: str | None = Field(
        None, validation_alias=AliasChoices("secret", "HARNESSRL_CONTROLLER_SECRET",
                                            "HARNESSRL_SECRET"),
        description="credential signing secret shared with the gateway (env HARNESSRL_SECRET); "
                    "when unset it is read from secret_file")
    secret_file: str = Field(
        ".harnessrl/secret",
        description="file holding the shared secret (created, mode 0600, when missing); the "
                    "gateway reads the same file by default")
    workdir_root: str = Field(
        ".harnessrl/rollouts",
        description="each attempt runs in <workdir_root>/<run>/<rollout>/attempt-<k>, which "
                    "keeps its stdout/stderr and the grader's")
    grader_tls_dir: str = Field(
        "", description="folder of the `grader` identity (ca.crt, tls.crt, tls.key) that the "
                        "controller hands its graders with a scope token per job "
                        "(services/controller/grader_access.py); empty: graders get no store "
                        "access")
    credential_ttl_margin_s: float = Field(
        120.0, description="a rollout credential expires this long after the attempt's "
                           "harness timeout")
    store_retry_s: float = Field(
        120.0, description="how long a run keeps retrying a store that is unavailable (say, "
                           "restarting) before the run fails")
    store_request_retry_s: float = Field(
        10.0, description="the same bound for the store calls CreateRun makes while its "
                          "caller waits")
    store_call_timeout_s: float = Field(15.0, description="deadline of one store RPC")
    kill_grace_s: float = Field(
        2.0, description="a job past its timeout (or cancelled) gets SIGTERM, then SIGKILL "
                         "after this many seconds")
    local_job_nice: int = Field(
        0, ge=0, le=19, description="local backend: each rollout job (and what it starts) "
                                    "runs this much lower in CPU priority (nice), so that it "
                                    "cannot starve an engine or trainer on the same machine")
    local_job_cpus: str = Field(
        "", description="local backend: run rollout jobs on these CPUs only (a list such as "
                        "'4-15'), the engine's and trainer's cores left to them; empty: any")
    local_backend: bool = Field(
        True, description="offer the local backend (rollouts as processes of this controller); "
                          "false where its own container must run none (Compose: the docker "
                          "backend runs them, docs/deploy.md)")
    sandbox: bool = Field(
        True, description="local backend: run each attempt's harness and per-attempt grader "
                          "in a bubblewrap sandbox of its own (docs/sandbox.md); the "
                          "controller refuses to start where none can be made. false: every "
                          "rollout of this controller runs unsandboxed, able to forge its "
                          "reward (logged loudly); a run can opt out alone (sandbox.disabled)")
    sandbox_hidden_paths: list[str] = Field(
        default_factory=list, description="more host paths no sandbox may see, even inside a "
                                          "path it may read (harnessrl up names its state "
                                          "folder); the secret, the rollout folders and every "
                                          "run's task file are hidden always")
    sandbox_doors: str = Field(
        "", description="folder of the sandboxes' doors out (Unix sockets to the gateway and "
                        "allowed egress); empty: a short fixed path in the temp folder, one "
                        "per workdir_root")
    max_jobs: int = Field(
        64, description="harness runs at once over all runs of this controller (each run "
                        "also has its own `concurrency`)", ge=1)
    default_backend: str = Field(
        "local", description="job backend of runs whose spec names none: 'local' (process "
                             "groups on this machine), 'docker' (containers beside this "
                             "one) or 'kubernetes' (a Job per attempt)")
    docker_image: str = Field(
        "", description="image of the docker backend's harness and grader containers; the "
                        "backend is available when this is set (docs/sandbox.md, Compose)")
    docker_socket: str = Field(
        "/var/run/docker.sock", description="the Docker API's Unix socket; in Compose the "
                                            "rollout gate's, which lets rollouts through only")
    docker_network: str = Field(
        "none", description="network of the rollout containers (Compose: the internal one "
                            "that reaches only the gateway); 'none': no network at all")
    docker_gateway_url: str = Field(
        "", description="the gateway's /v1 URL as rollout containers reach it; empty: "
                        "gateway_url")
    docker_memory_mb: int = Field(2048, ge=16, description="memory of each rollout container")
    docker_pids_limit: int = Field(512, ge=8, description="processes of each rollout container")
    docker_cpus: float = Field(1.0, gt=0, description="CPUs of each rollout container")
    k8s: KubernetesSection = Field(default_factory=KubernetesSection,
                                   description="the kubernetes job backend (KubernetesSection)")
    health_interval_s: float = Field(
        1.0, gt=0, description="the store's health is checked this often; gRPC health says "
        "NOT_SERVING while the store (or its Redis) is down (readiness probes use it)")
    ready_file: str = Field("", description="write {pid, grpc_port, metrics_port} here once "
                                           "serving")
    metrics_bind: str = Field("", description=METRICS_BIND_HELP)
    log_level: str = Field("INFO", description="logging level")

    # The flat `k8s_*` settings became the `k8s` section (issue 46). An old name is refused
    # with its new one, never ignored: an environment variable or config file key that no
    # field has is skipped silently, and a controller would start without its kubernetes
    # backend. (Flags: `arg_parser`.)
    @model_validator(mode="before")
    @classmethod
    def _no_flat_k8s(cls, data: Any) -> Any:
        prefix = "HARNESSRL_CONTROLLER_"
        _refuse_flat_k8s([*(data if isinstance(data, dict) else ()),
                          *(k[len(prefix):].lower() for k in os.environ
                            if k.upper().startswith(prefix))])
        return data

    @classmethod
    def load(cls, argv: list[str] | None = None, prog: str | None = None) -> Self:
        first = argparse.ArgumentParser(add_help=False)
        first.add_argument("--config")
        path = first.parse_known_args(argv)[0].config
        if path:  # the old flat names, named anew (before the unknown-key refusal)
            _refuse_flat_k8s(read_config_file(path))
        return super().load(argv, prog)

    @classmethod
    def arg_parser(cls, prog: str | None = None) -> argparse.ArgumentParser:
        parser = super().arg_parser(prog)
        for field in KubernetesSection.model_fields:  # the old flags: refused, named anew
            parser.add_argument(f"--k8s-{field.replace('_', '-')}", dest=f"k8s_{field}",
                                action=_RenamedFlag, default=None, help=argparse.SUPPRESS)
        return parser
