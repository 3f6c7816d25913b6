"""The sandbox of the local backend (services/controller/sandbox), job by job: real bubblewrap,
real cgroups, real sockets. What a sandboxed job sees is read from inside (its own report) and
checked from outside (files, processes); each test has an unsandboxed control where the same
thing is possible, so the test can fail.

The whole stack under attack: tests/test_sandbox_redteam.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harnessrl import procs
from harnessrl.clients import ControllerClient, StoreClient
from harnessrl.v1 import common_pb2 as c, controller_pb2 as cpb
from services.controller.backends import JobSpec, LocalBackend
from services.controller.sandbox import Sandbox
from services.controller.sandbox.egress import Target
from services.controller.sandbox.policy import SandboxPolicy, runtime_paths

SECRET = "s" * 32


def _run(tmp: Path, code: str, policy: SandboxPolicy | None, base_env: dict[str, str] | None =
         None, timeout_s: float = 30) -> tuple[int, str, str]:
    """Runs `python3 -c code` as one job (sandboxed under `policy`, or not); (exit code,
    stdout, stderr)."""
    async def go() -> tuple[int, str, str]:
        sandbox = Sandbox(tmp / "doors")
        sandbox.check()
        backend = LocalBackend(kill_grace_s=0.5, sandbox=sandbox,
                               base_env=base_env if base_env is not None else dict(os.environ))
        records = tmp / "attempt"
        work = records / "work"
        work.mkdir(parents=True, exist_ok=True)
        await backend.launch(JobSpec(job_id=f"j{time.monotonic_ns()}",
                                     argv=[sys.executable, "-c", code], env={"MINE": "1"},
                                     workdir=records, cwd=work, timeout_s=timeout_s,
                                     sandbox=policy))
        result = (await asyncio.gather(*(backend.wait(j) for j in list(backend._jobs))))[0]
        await backend.close()
        return (result.exit_code, result.stdout_path.read_text(),
                result.stderr_path.read_text())
    return asyncio.run(go())


def _policy(tmp: Path, **kw: object) -> SandboxPolicy:
    kw.setdefault("read_only", tuple(runtime_paths()))
    return SandboxPolicy(work=tmp / "attempt" / "work", **kw)  # type: ignore[arg-type]


def test_the_environment_is_what_the_run_and_the_controller_set(tmp_path: Path) -> None:
    leaky = {**os.environ, "WANDB_API_KEY": "w", "HF_TOKEN": "h", "DOCKER_HOST": "d"}
    code = "import os, json; print(json.dumps(sorted(os.environ)))"
    rc, out, err = _run(tmp_path, code, _policy(tmp_path), base_env=leaky)
    assert rc == 0, err
    names = set(json.loads(out))
    assert "MINE" in names and not names & {"WANDB_API_KEY", "HF_TOKEN", "DOCKER_HOST"}
    assert names <= {"MINE", "PATH", "HOME", "LANG", "TMPDIR", "USER", "LOGNAME", "PWD"}
    rc, out, _ = _run(tmp_path, code, None, base_env=leaky)  # control: the backend's base env
    assert {"WANDB_API_KEY", "HF_TOKEN", "DOCKER_HOST"} <= set(json.loads(out))


def test_the_filesystem_is_an_allow_list(tmp_path: Path) -> None:
    code_dir = tmp_path / "agent"
    code_dir.mkdir()
    (code_dir / "tool.py").write_text("print('tool')")
    (code_dir / "tasks.jsonl").write_text('{"answer": 42}\n')
    (code_dir / "secret").write_text(SECRET)
    other = tmp_path / "elsewhere.txt"
    other.write_text("not named")
    probe = f"""
import json, os
def readable(p):
    try:
        open(p).read(); return True
    except OSError:
        return False
print(json.dumps({{
    "tool": readable({str(code_dir / 'tool.py')!r}),
    "tasks": readable({str(code_dir / 'tasks.jsonl')!r}),
    "secret": readable({str(code_dir / 'secret')!r}),
    "elsewhere": readable({str(other)!r}),
    "home": os.path.exists({str(Path.home() / '.cache')!r}),
    "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
    "uid": os.getuid(),
    "write_work": open("mine.txt", "w").write("x") == 1,
}}))
"""
    assert (Path.home() / ".cache").exists()  # (it is there, for the control below)
    policy = _policy(tmp_path, read_only=(*runtime_paths(), code_dir),
                     hidden=(code_dir / "tasks.jsonl", code_dir / "secret"))
    rc, out, err = _run(tmp_path, probe, policy)
    assert rc == 0, err
    seen = json.loads(out)
    assert seen["tool"] and seen["write_work"]
    assert not (seen["tasks"] or seen["secret"] or seen["elsewhere"] or seen["home"]), seen
    assert seen["uid"] != 0 and len(seen["pids"]) <= 4, seen  # bwrap, init, the job (+ a child)
    assert (tmp_path / "attempt" / "work" / "mine.txt").read_text() == "x"
    rc, out, _ = _run(tmp_path, probe, None)  # control
    seen = json.loads(out)
    assert seen["tasks"] and seen["secret"] and seen["elsewhere"] and seen["home"]
    assert len(seen["pids"]) > 4


def test_only_a_graders_sandbox_may_make_the_nested_one(tmp_path: Path) -> None:
    """A harness's sandbox cannot make a user namespace (no sandbox of its own inside); a
    grader's (`nested`) can: the one its tests run in (harnessrl.graders.nested_sandbox),
    which itself forbids any further one."""
    probe = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print("userns" if libc.unshare(0x10000000) == 0 else "no userns")  # CLONE_NEWUSER
"""
    nest = """
import subprocess, sys
from pathlib import Path
from harnessrl.graders.nested_sandbox import NestedSandbox
box = NestedSandbox(sys.executable, Path.cwd())
box.check()
inner = ("import ctypes; print('again' if ctypes.CDLL(None).unshare(0x10000000) == 0 "
         "else 'no further')")
print(subprocess.run(box.argv([sys.executable, "-I", "-c", inner]), capture_output=True,
                     text=True).stdout.strip())
"""
    rc, out, err = _run(tmp_path, probe, _policy(tmp_path))
    assert (rc, out.strip()) == (0, "no userns"), err
    rc, out, err = _run(tmp_path, probe, _policy(tmp_path, nested=True))
    assert (rc, out.strip()) == (0, "userns"), err
    rc, out, err = _run(tmp_path, nest, _policy(tmp_path, nested=True))
    assert (rc, out.strip()) == (0, "no further"), err


def test_the_records_above_the_work_folder_are_out_of_reach(tmp_path: Path) -> None:
    code = ("import os\nfor n in ('forged.exit.json', 'stdout.log'):\n"
            "    try:\n        open(os.path.join('..', n), 'a').write('{\"reward\": 1}')\n"
            "    except OSError as e:\n        print('refused', n)\n")
    rc, out, err = _run(tmp_path, code, _policy(tmp_path))
    assert rc == 0, err
    assert not (tmp_path / "attempt" / "forged.exit.json").exists()
    assert "reward" not in (tmp_path / "attempt" / "stdout.log").read_text().replace(
        "refused", "")
    _run(tmp_path, code, None)  # control
    assert (tmp_path / "attempt" / "forged.exit.json").exists()


def test_only_the_named_targets_are_reached(tmp_path: Path) -> None:
    async def serve() -> tuple[asyncio.AbstractServer, int]:
        srv = await asyncio.start_server(
            lambda r, w: (w.write(b"HTTP/1.0 200 OK\r\n\r\nhello"), w.close()), "127.0.0.1", 0)
        return srv, srv.sockets[0].getsockname()[1]

    import socket
    allowed, blocked = socket.socket(), socket.socket()
    for s in (allowed, blocked):
        s.bind(("127.0.0.1", 0))
        s.listen()
    a_port, b_port = allowed.getsockname()[1], blocked.getsockname()[1]
    code = f"""
import socket
for port in ({a_port}, {b_port}):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close(); print(port, "open")
    except OSError:
        print(port, "refused")
"""
    rc, out, err = _run(tmp_path, code, _policy(
        tmp_path, targets=((Target("127.0.0.1", a_port), a_port),)))
    assert rc == 0, err
    assert f"{a_port} open" in out and f"{b_port} refused" in out, out
    rc, out, _ = _run(tmp_path, code, None)  # control
    assert f"{b_port} open" in out
    allowed.close()
    blocked.close()


def test_a_timeout_ends_everything_the_sandboxed_job_started(tmp_path: Path) -> None:
    """A grandchild that leaves the process group (setsid) and ignores SIGTERM still ends:
    the pid namespace ends with the job."""
    marker = f"hrl-escape-{time.monotonic_ns()}"
    code = (f"import os, signal, time, subprocess\n"
            f"subprocess.Popen(['sh', '-c', 'trap \"\" TERM; exec -a {marker} sleep 300'], "
            f"start_new_session=True)\ntime.sleep(300)\n")
    t0 = time.monotonic()
    rc, _, _ = _run(tmp_path, code, _policy(tmp_path), timeout_s=2)
    assert time.monotonic() - t0 < 20

    def alive() -> list[str]:
        found = []
        for pid in os.listdir("/proc"):
            try:
                if marker in Path(f"/proc/{pid}/cmdline").read_text():
                    found.append(pid)
            except OSError:
                pass
        return found
    assert alive() == []


# -- through the controller ------------------------------------------------------------------

class Controller:
    def __init__(self, tmp: Path, redis_url: str, *flags: str,
                 gateway_url: str = "http://127.0.0.1:9/v1") -> None:
        self.tmp, self.flags, self.gateway_url = tmp, flags, gateway_url
        self.store, info = procs.start_service(
            "store", "services.store", ["--bind", "127.0.0.1:0", "--redis-url", redis_url,
                                        "--key-prefix", f"sbx{time.monotonic_ns()}:"],
            tmp, timeout=30)
        self.store_address = f"127.0.0.1:{info['grpc_port']}"
        self.start()

    def start(self) -> None:
        self.proc, info = procs.start_service(
            "controller", "services.controller",
            ["--bind", "127.0.0.1:0", "--store-address", self.store_address,
             "--gateway-url", self.gateway_url, "--workdir-root", str(self.tmp / "rollouts"),
             "--kill-grace-s", "0.5", *self.flags], self.tmp, {"HARNESSRL_SECRET": SECRET},
            timeout=30)
        self.ctl = ControllerClient.connect(f"127.0.0.1:{info['grpc_port']}")

    def run(self, spec: c.RunSpec) -> tuple[c.Run, list[c.Rollout]]:
        return self.run_after(self.ctl.create_run(spec).run_id)

    def run_after(self, run_id: str) -> tuple[c.Run, list[c.Rollout]]:
        """The run's record and rollouts once it ended."""
        run = c.Run(run_id=run_id)
        for ev in self.ctl.stub.WatchRun(cpb.WatchRunRequest(run_id=run.run_id), timeout=120):
            if ev.kind == cpb.RunEvent.KIND_RUN_DONE:
                run = ev.run
                break
        store = StoreClient.connect(self.store_address)
        rollouts = list(store.list_rollouts(run.run_id).rollouts)
        store.close()
        return run, rollouts

    def log(self) -> str:
        return (self.tmp / "controller.log").read_text()

    def stop(self) -> None:
        self.ctl.close()
        self.proc.stop()
        self.store.stop()


@pytest.fixture
def controller(tmp_path: Path, redis_url: str) -> Iterator[Controller]:
    ctl = Controller(tmp_path, redis_url)
    yield ctl
    ctl.stop()


SETUP = """
import json, os, sys
full = [json.loads(l) for l in open(sys.argv[1])]
task = json.loads(os.environ["HARNESSRL_TASK_JSON"])
fix = next(t["fix"] for t in full if t["id"] == task["id"])
open("workspace.txt", "w").write("bug in " + task["id"])
assert "OPENAI_API_KEY" not in os.environ
open(os.path.join(os.environ["HARNESSRL_WORKDIR"], "..", "setup-saw-fix"), "w").write(fix)
"""
HARNESS = """
import os
ws = open("workspace.txt").read()
try:
    open(os.environ["FULL_TASKS"]).read(); full = "read"
except OSError:
    full = "hidden"
open("answer.txt", "w").write(ws + " " + full)
"""
GRADER = """
import os
answer = open("answer.txt").read()
out = open(os.environ["HARNESSRL_HARNESS_STDERR"]).read()
print('{"reward": %s}' % (1.0 if answer.endswith("hidden") and out == "" else 0.0))
"""


def test_a_trusted_setup_step_prepares_what_the_sandboxed_harness_sees(
        controller: Controller, tmp_path: Path) -> None:
    full = tmp_path / "full.jsonl"
    full.write_text(json.dumps({"id": "t1", "fix": "the gold patch"}) + "\n")
    (tmp_path / "setup.py").write_text(SETUP)
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "harness.py").write_text(HARNESS)
    (tmp_path / "code" / "grader.py").write_text(GRADER)
    spec = c.RunSpec(
        name="setup", tasks=[c.Task(task_id="t1", data_json=json.dumps({"id": "t1"}))],
        setup_command=[sys.executable, str(tmp_path / "setup.py"), str(full)],
        harness_command=[sys.executable, str(tmp_path / "code" / "harness.py")],
        grader_command=[sys.executable, str(tmp_path / "code" / "grader.py")],
        env={"FULL_TASKS": str(full)}, stream="-")
    spec.sandbox.hidden_paths.append(str(full))
    run, (ro,) = controller.run(spec)
    assert ro.status == c.ROLLOUT_STATUS_SUCCEEDED and ro.reward == 1.0, ro
    folder = Path(ro.attempts[0].workdir)
    assert (folder / "setup-saw-fix").read_text() == "the gold patch"
    assert (folder / "work" / "answer.txt").read_text() == "bug in t1 hidden"


def test_a_failing_setup_fails_the_attempt_with_its_output(controller: Controller,
                                                            tmp_path: Path) -> None:
    spec = c.RunSpec(
        name="bad-setup", tasks=[c.Task(task_id="t1", data_json="{}")],
        setup_command=[sys.executable, "-c", "import sys; sys.exit('no workspace for t1')"],
        harness_command=["true"], grader_command=["true"],
        reward_source=c.REWARD_SOURCE_GRADER_EXIT_CODE, stream="-")
    _, (ro,) = controller.run(spec)
    assert ro.status == c.ROLLOUT_STATUS_FAILED
    assert ro.error.startswith("setup failed") and "no workspace for t1" in ro.error, ro.error


def test_a_run_that_opts_out_runs_unsandboxed_and_says_so(controller: Controller) -> None:
    code = "import os; print(len([p for p in os.listdir('/proc') if p.isdigit()]))"
    spec = c.RunSpec(name="trusted", tasks=[c.Task(task_id="t", data_json="{}")],
                     harness_command=[sys.executable, "-c", code], grader_command=["true"],
                     reward_source=c.REWARD_SOURCE_GRADER_EXIT_CODE, stream="-")
    spec.sandbox.disabled = True
    _, (ro,) = controller.run(spec)
    assert ro.status == c.ROLLOUT_STATUS_SUCCEEDED
    assert int((Path(ro.attempts[0].workdir) / "stdout.log").read_text()) > 4  # the host's
    assert "its harnesses run UNSANDBOXED (the run's sandbox.disabled)" in controller.log()


def test_bad_sandbox_settings_are_refused_at_create_run(controller: Controller) -> None:
    import grpc
    for field, value, says in (("egress", ["10.0.0.5:8080"], "only loopback"),
                               ("egress", ["127.0.0.1:22"], "below 1024"),
                               ("read_only_paths", ["relative/path"], "not an absolute path")):
        spec = c.RunSpec(name="bad", tasks=[c.Task(task_id="t", data_json="{}")],
                         harness_command=["true"], grader_command=["true"], stream="-")
        getattr(spec.sandbox, field).extend(value)
        with pytest.raises(grpc.RpcError) as err:
            controller.ctl.create_run(spec)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in \
            err.value.details(), err.value.details()


def test_the_controller_refuses_to_start_where_no_sandbox_can_be_made(
        tmp_path: Path) -> None:
    """No bubblewrap on PATH: the controller exits at once with the reason and the fix; it
    never runs a rollout unsandboxed unless told to (--no-sandbox), and then says so."""
    env = {**os.environ, "PATH": str(Path(sys.executable).parent), "HARNESSRL_SECRET": SECRET}
    argv = [sys.executable, "-m", "services.controller", "--bind", "127.0.0.1:0",
            "--store-address", "127.0.0.1:9", "--workdir-root", str(tmp_path / "r")]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "bubblewrap (bwrap) is not installed: `apt-get install bubblewrap`" in out.stderr
    proc = subprocess.Popen([*argv, "--no-sandbox"], env=env, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 30
        seen = ""
        while "SANDBOX OFF" not in seen and time.monotonic() < deadline:
            seen += proc.stderr.readline()  # type: ignore[union-attr]
        assert "SANDBOX OFF (--sandbox false)" in seen
    finally:
        proc.kill()
        proc.wait()


WAITING_HARNESS = """
import os, time, urllib.request
open("started", "w").close()
while not os.path.exists("go"):
    time.sleep(0.05)
with urllib.request.urlopen(os.environ["OPENAI_BASE_URL"] + "/models", timeout=10) as r:
    open("answer.txt", "w").write(r.read().decode())
"""


def test_an_adopted_sandboxed_job_still_reaches_the_gateway(tmp_path: Path,
                                                              redis_url: str) -> None:
    """kill -9 of the controller while a sandboxed harness runs: the next controller adopts
    the job and opens the sandbox's door again, and the harness's next call goes through."""
    import socket
    import threading

    gateway = socket.socket()
    gateway.bind(("127.0.0.1", 0))
    gateway.listen()

    def answer() -> None:
        while True:
            try:
                conn, _ = gateway.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 9\r\n\r\nthe reply")
            conn.close()
    threading.Thread(target=answer, daemon=True).start()
    ctl = Controller(tmp_path, redis_url,
                     gateway_url=f"http://127.0.0.1:{gateway.getsockname()[1]}/v1")
    try:
        (tmp_path / "h.py").write_text(WAITING_HARNESS)
        spec = c.RunSpec(name="adopt", tasks=[c.Task(task_id="t", data_json="{}")],
                         harness_command=[sys.executable, str(tmp_path / "h.py")],
                         grader_command=["true"], reward_source=c.REWARD_SOURCE_GRADER_EXIT_CODE,
                         stream="-", timeout_s=60)
        run = ctl.ctl.create_run(spec)
        work = tmp_path / "rollouts" / run.run_id / "t-0" / "attempt-1" / "work"
        deadline = time.monotonic() + 30
        while not (work / "started").exists():
            assert time.monotonic() < deadline, "the harness did not start"
            time.sleep(0.05)
        ctl.proc.kill()  # kill -9: the harness runs on, its door closed
        ctl.ctl.close()
        ctl.start()
        (work / "go").write_text("")
        _, (ro,) = ctl.run_after(run.run_id)
        assert ro.status == c.ROLLOUT_STATUS_SUCCEEDED, ro
        assert (work / "answer.txt").read_text() == "the reply"
        assert "adopted from an earlier controller (still running)" in ctl.log()
    finally:
        ctl.stop()
        gateway.close()


# -- found by a second read (each reproduced first, then fixed) --------------------------------

def test_a_hidden_file_stays_hidden_through_a_symlinked_spelling(tmp_path: Path) -> None:
    from services.controller.sandbox import policy as sandbox_policy

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "agent.py").write_text("print('agent ran')")
    (proj / "tasks.jsonl").write_text('{"answer": 42}')
    (tmp_path / "link").symlink_to(proj)
    spec = c.RunSpec()
    spec.sandbox.hidden_paths.append(str(proj / "tasks.jsonl"))
    code = (f"import os\nfor p in ({str(tmp_path / 'link' / 'tasks.jsonl')!r}, "
            f"{str(proj / '..' / 'proj' / 'tasks.jsonl')!r}):\n"
            "    try:\n        open(p).read(); print('READ', p)\n"
            "    except OSError:\n        print('hidden', p)\n"
            f"exec(open({str(tmp_path / 'link' / 'agent.py')!r}).read())\n")
    policy = sandbox_policy.build(spec, argv=["python3", str(tmp_path / "link" / "agent.py")],
                                  work=tmp_path / "attempt" / "work", timeout_s=30,
                                  hidden=[], egress=[])
    rc, out, err = _run(tmp_path, code, policy)
    assert rc == 0, err
    lines = out.splitlines()
    assert [ln.split()[0] for ln in lines] == ["hidden", "hidden", "agent"], out


def test_a_link_the_harness_left_as_task_json_is_not_followed_on_resume(tmp_path: Path) -> None:
    """A resumed attempt rewrites task.json outside the sandbox: a link planted there by the
    harness must not carry that write to another file."""
    from services.controller.attempt_jobs import AttemptJobs
    from services.controller.config import ControllerConfig

    victim = tmp_path / "secret"
    victim.write_text(SECRET)
    run = c.Run(run_id="r", spec=c.RunSpec())
    jobs = AttemptJobs(run, {"t": c.Task(task_id="t", data_json='{"q": 1}')},
                       ControllerConfig(workdir_root=str(tmp_path / "rollouts"),
                                        secret_file=str(victim)),
                       LocalBackend(), set())
    ro = c.Rollout(rollout_id="r/t/0", task_id="t")
    _, work = jobs.prepare(ro, 1)
    (work / "task.json").unlink()
    (work / "task.json").symlink_to(victim)  # what the harness did
    _, work = jobs.prepare(ro, 1)  # the attempt resumed by a restarted controller
    assert victim.read_text() == SECRET
    assert (work / "task.json").read_text() == '{"q": 1}' and not (work / "task.json").is_symlink()
    # the rollout folders are the controller's alone (a setuid file made in a sandbox is
    # owned by the user the sandbox maps to: other users must not reach it)
    assert (tmp_path / "rollouts").stat().st_mode & 0o777 == 0o700


def test_a_file_in_a_shared_folder_is_shown_alone(tmp_path: Path) -> None:
    from services.controller.sandbox.policy import SHARED_FOLDERS, code_paths

    import tempfile
    shared = Path(tempfile.gettempdir())
    assert shared in SHARED_FOLDERS
    f = shared / f"hrl-agent-{os.getpid()}.py"
    f.write_text("")
    try:
        assert code_paths(["python3", str(f)]) == [f]
        assert code_paths(["python3", str(tmp_path / "x.py")]) == []  # (not there)
        (tmp_path / "x.py").write_text("")
        assert code_paths(["python3", str(tmp_path / "x.py")]) == [tmp_path]
    finally:
        f.unlink()
