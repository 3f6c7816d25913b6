"""The fake kubelet's container mode: each pod container runs as a real Docker container of its
image, through the `docker` CLI against the daemon `DOCKER_HOST` names.

Images are never pulled: an image the daemon does not have is ErrImagePull (then
ImagePullBackOff), as with the process runtime's list. A container is `docker create`d with
what the pod spec and the objects the fake holds say, then started; its output goes to the
pod log (`docker logs -f`), and `docker wait` gives its exit status. Applied:

- securityContext (container over pod): runAsUser/runAsGroup (`--user`), supplementalGroups
  and fsGroup (`--group-add`; volume ownership is not changed: emptyDirs are mode 0777),
  runAsNonRoot (a container whose effective user is 0, or an image user that is not
  numeric, is refused with CreateContainerConfigError, as the kubelet does),
  readOnlyRootFilesystem (`--read-only`, with no tmpfs: a writable /tmp is an emptyDir the
  pod mounts there), capabilities drop/add (`--cap-drop`/`--cap-add`),
  allowPrivilegeEscalation: false (`--security-opt no-new-privileges`), privileged
  (`--privileged`), seccompProfile (RuntimeDefault: Docker's default profile; Unconfined or
  none: `seccomp=unconfined`, Kubernetes' default; Localhost: CreateContainerConfigError).
- volumes: emptyDir and secret volumes are host directories under the pod's directory,
  bind-mounted at each volumeMount's mountPath (subPath, readOnly; secret volumes always
  read-only).
- env: the declared environment resolved from the fake's objects (values, secretKeyRef,
  fieldRef), handed to the CLI through its own environment (`-e NAME`), never in its argv;
  the image's ENV underneath. command/args replace the image's ENTRYPOINT/CMD as Kubernetes
  says; workingDir is `-w`.
- resources: limits.cpu `--cpus`, limits.memory `--memory` (an OOM kill reads as reason
  OOMKilled), requests.cpu `--cpu-shares` (runc, cgroup v1 here); the node's podPidsLimit
  (`--pod-pids-limit`) as `--pids-limit` on each container (a real kubelet caps the pod).
- termination: `docker kill --signal` (SIGTERM, then SIGKILL after the grace period) on pod
  deletion or activeDeadlineSeconds; a signal N reads as exit code 128+N, as in process mode.
  An exec failure (no such command) is a StartError with the runtime's message.

- network: the host's (`--network host`: pods reach the gateway on 127.0.0.1), or with
  `--endpoints` a namespace of each pod's own under its NetworkPolicies (`pod_network.py`).

Not enforced: AppArmor and SELinux options, sysctls, procMount, ephemeral-storage limits,
hugepages, Windows options, imagePullPolicy (never pulls), probes and lifecycle hooks (as in
process mode), and the service account token (pods get none).

Every container is labelled `harnessrl.fake-kube=<the server's root>` (and `.pod=<ns>/<pod>`,
`.container=<name>`) and named `hrl-fk-<root hash>-<ns>-<pod>-<container>-<restart>`; it is
removed when its container ends, and all of them when the server stops or starts again with
the same root (a killed server's leftovers).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

from .objects import parse_quantity
from .pod_network import PodNetworks
from .runtime import ConfigError, Exit, Launch, Obj, Running, expand

LABEL = "harnessrl.fake-kube"
CLI_TIMEOUT = 60.0
_CLI_ENV = ("PATH", "HOME", "XDG_CONFIG_HOME", "TMPDIR")  # what the CLI itself reads


class DockerError(RuntimeError):
    """The docker CLI failed; the message is its stderr."""


def _security(spec: Obj, c: Obj) -> tuple[Obj, Obj]:
    return spec.get("securityContext") or {}, c.get("securityContext") or {}


def _user_id(user: str) -> int | None:
    """The uid of an image's USER (`""` is root), None when not numeric."""
    name = user.split(":")[0]
    if not name:
        return 0
    return int(name) if name.isdigit() else None


class _Container:
    """A created and started container, followed by `docker logs -f` and `docker wait`."""

    def __init__(self, rt: "ContainerRuntime", name: str, container_id: str, image_id: str,
                 log: Path) -> None:
        self.rt = rt
        self.name = name
        self.container_id = f"docker://{container_id}"
        self.image_id = image_id
        with open(log, "ab") as out:
            self.logs = subprocess.Popen([rt.docker, "logs", "-f", name], env=rt.env,
                                         stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT)
        self.waiter = subprocess.Popen([rt.docker, "wait", name], env=rt.env,
                                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE)
        self.ended: Exit | None = None

    def poll(self) -> Exit | None:
        if self.ended is None and self.waiter.poll() is not None:
            self.ended = self._exit()
        return self.ended

    def _exit(self) -> Exit:
        out, err = self.waiter.communicate()
        try:
            self.logs.wait(CLI_TIMEOUT)   # the log is complete once the container stopped
        except subprocess.TimeoutExpired:
            self.logs.kill()
        try:
            state = json.loads(self.rt.cli("inspect", "--format", "{{json .State}}", self.name))
        except DockerError as e:  # removed under us (the server stopping)
            return Exit(137, "Error", f"container {self.name} gone: {e}; docker wait: "
                                      f"{(out + err).decode(errors='replace').strip()}")
        code = int(state["ExitCode"])
        if state.get("OOMKilled"):
            return Exit(code, "OOMKilled")
        return Exit(code, "Completed" if code == 0 else "Error")

    def signal(self, sig: int) -> None:
        if self.waiter.poll() is None:  # (not self.poll(): the pod's worker thread reaps)
            subprocess.run([self.rt.docker, "kill", "--signal", str(int(sig)), self.name],
                           env=self.rt.env, capture_output=True, timeout=CLI_TIMEOUT)

    def wait_gone(self) -> Exit:
        try:
            self.waiter.wait(CLI_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.rt.remove(self.name)
        ended = self.poll()
        return ended if ended is not None else Exit(137, "Error", "not stopped in time")

    def remove(self) -> None:
        self.rt.remove(self.name)
        for proc in (self.waiter, self.logs):
            try:
                proc.wait(CLI_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()


class ContainerRuntime:
    """Pod containers as Docker containers (see the module docstring); `root` is the fake
    server's state directory, which names its containers."""

    def __init__(self, root: Path, networks: PodNetworks | None = None,
                 pids_limit: int | None = None) -> None:
        self.networks = networks
        self.pids_limit = pids_limit
        docker = shutil.which("docker")
        if docker is None:
            raise RuntimeError("container mode needs the docker CLI (apt-get install docker.io)")
        self.docker = docker
        self.env = dict(os.environ)
        self.root = str(root)
        self.prefix = f"hrl-fk-{hashlib.sha256(self.root.encode()).hexdigest()[:8]}"
        self.images: dict[str, Obj] = {}  # image -> `docker image inspect`, once found
        self.cli("version", "--format", "{{.Server.Version}}")  # the daemon answers, or fail
        self.shutdown()  # a killed server's leftovers

    def cli(self, *args: str, env: dict[str, str] | None = None) -> str:
        out = subprocess.run([self.docker, *args], env=env or self.env, capture_output=True,
                             stdin=subprocess.DEVNULL, timeout=CLI_TIMEOUT)
        if out.returncode != 0:
            raise DockerError(out.stderr.decode(errors="replace").strip())
        return out.stdout.decode(errors="replace").strip()

    def remove(self, *names: str) -> None:
        if names:
            subprocess.run([self.docker, "rm", "-f", *names], env=self.env,
                           capture_output=True, timeout=CLI_TIMEOUT)

    def shutdown(self) -> None:
        ids = self.cli("ps", "-aq", "--filter", f"label={LABEL}={self.root}").split()
        self.remove(*ids)
        if self.networks is not None:
            self.networks.close_all(self)

    def pod_gone(self, uid: str) -> None:
        if self.networks is not None:
            self.networks.close(self, uid)

    def _network(self, launch: Launch, labels: dict[str, str]) -> list[str]:
        """`--network` for a container of the pod: the host's (no endpoints declared), or the
        pod's own (pod_network.py)."""
        if self.networks is None:
            return ["--network", "host"]
        infra = self.networks.join(self, f"{self.prefix}-{launch.namespace}-{launch.pod}-infra",
                                   launch, labels)
        return ["--network", f"container:{infra}"]

    def has_image(self, image: str) -> bool:
        if image not in self.images:
            try:
                self.images[image] = json.loads(self.cli("image", "inspect", image))[0]
            except DockerError:
                return False
        return True

    def check(self, spec: Obj, c: Obj) -> None:
        self._user(spec, c)
        self._seccomp(spec, c)

    def _user(self, spec: Obj, c: Obj) -> str | None:
        """`--user`'s value (None: the image's), after the runAsNonRoot check."""
        pod, ctr = _security(spec, c)
        uid, gid = ctr.get("runAsUser", pod.get("runAsUser")), \
            ctr.get("runAsGroup", pod.get("runAsGroup"))
        image_user = str((self.images[c["image"]].get("Config") or {}).get("User") or "")
        where = f"(container: {c['name']})"
        if ctr.get("runAsNonRoot", pod.get("runAsNonRoot")):
            effective = uid if uid is not None else _user_id(image_user)
            if uid is not None and uid == 0:
                raise ConfigError(f"container's runAsUser breaks non-root policy {where}")
            if effective is None:
                raise ConfigError(f"container has runAsNonRoot and image has non-numeric user "
                                  f"({image_user}), cannot verify user is non-root {where}")
            if effective == 0:
                raise ConfigError(f"container has runAsNonRoot and image will run as root "
                                  f"{where}")
        if uid is None and gid is None:
            return None
        user = str(uid) if uid is not None else (image_user.split(":")[0] or "0")
        return user if gid is None else f"{user}:{gid}"

    @staticmethod
    def _seccomp(spec: Obj, c: Obj) -> list[str]:
        pod, ctr = _security(spec, c)
        profile = (ctr.get("seccompProfile") or pod.get("seccompProfile") or {}).get("type")
        if profile == "Localhost":
            raise ConfigError("seccompProfile Localhost is not supported by the fake kubelet")
        return [] if profile == "RuntimeDefault" else ["--security-opt", "seccomp=unconfined"]

    def _options(self, launch: Launch, labels: dict[str, str]) -> list[str]:
        """`docker create`'s options from the pod spec (see the module docstring)."""
        spec, c = launch.spec, launch.container
        pod, ctr = _security(spec, c)
        opts = self._network(launch, labels)
        user = self._user(spec, c)
        if user is not None:
            opts += ["--user", user]
        for gid in list(pod.get("supplementalGroups") or []) + \
                ([pod["fsGroup"]] if pod.get("fsGroup") is not None else []):
            opts += ["--group-add", str(gid)]
        if ctr.get("readOnlyRootFilesystem"):
            opts.append("--read-only")
        for cap in (ctr.get("capabilities") or {}).get("drop") or []:
            opts += ["--cap-drop", cap]
        for cap in (ctr.get("capabilities") or {}).get("add") or []:
            opts += ["--cap-add", cap]
        if ctr.get("allowPrivilegeEscalation") is False:
            opts += ["--security-opt", "no-new-privileges"]
        if ctr.get("privileged"):
            opts.append("--privileged")
        opts += self._seccomp(spec, c)
        resources = c.get("resources") or {}
        limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
        if "cpu" in limits:
            opts += ["--cpus", f"{parse_quantity(limits['cpu']):g}"]
        if "memory" in limits:
            opts += ["--memory", f"{int(parse_quantity(limits['memory']))}b"]
        if self.pids_limit is not None:
            opts += ["--pids-limit", str(self.pids_limit)]
        if "cpu" in requests:
            opts += ["--cpu-shares", str(max(2, int(parse_quantity(requests["cpu"]) * 1024)))]
        secret_volumes = {v["name"] for v in spec.get("volumes") or [] if "secret" in v}
        for m in c.get("volumeMounts") or []:
            source = launch.volumes[m["name"]] / m.get("subPath", "")
            readonly = m.get("readOnly") or m["name"] in secret_volumes
            opts += ["--mount", f"type=bind,source={source},target={m['mountPath']}"
                                + (",readonly" if readonly else "")]
        if c.get("workingDir"):
            opts += ["-w", c["workingDir"]]
        return opts

    def start(self, launch: Launch) -> Running | str:
        c = launch.container
        name = f"{self.prefix}-{launch.namespace}-{launch.pod}-{c['name']}-{launch.restart}"
        labels = {LABEL: self.root, f"{LABEL}.pod": f"{launch.namespace}/{launch.pod}",
                  f"{LABEL}.container": c["name"]}
        argv = ["create", "--name", name]
        for k, v in labels.items():
            argv += ["--label", f"{k}={v}"]
        try:
            argv += self._options(launch, {LABEL: self.root,
                                           f"{LABEL}.pod": labels[f"{LABEL}.pod"],
                                           f"{LABEL}.container": "infra"})
        except (ConfigError, DockerError, OSError) as e:
            return str(e)
        cli_env = dict(self.env)
        for k, v in launch.env.items():  # values through the CLI's environment, not argv,
            if k in _CLI_ENV or k.startswith("DOCKER_"):  # except those the CLI reads itself
                argv += ["-e", f"{k}={v}"]
            else:
                argv += ["-e", k]
                cli_env[k] = v
        command = [expand(a, launch.env) for a in c.get("command") or []]
        args = [expand(a, launch.env) for a in c.get("args") or []]
        if command:
            argv += ["--entrypoint", command[0], c["image"], *command[1:], *args]
        else:
            argv += [c["image"], *args]
        try:
            container_id = self.cli(*argv, env=cli_env)
            self.cli("start", name)
        except DockerError as e:
            self.remove(name)
            return str(e)
        return _Container(self, name, container_id, str(self.images[c["image"]]["Id"]),
                          launch.log)

