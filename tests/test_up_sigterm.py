"""`harnessrl up` in the foreground, ended by SIGTERM (`kill`, `timeout`, a CI job's cancel):
it stops every service and rollout it started, as Ctrl-C does (it used to die at once and
leave them running, reparented to init)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harnessrl import procs
from harnessrl.local.operate import pid_alive

REPO = Path(__file__).resolve().parent.parent


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_sigterm_to_a_foreground_up_stops_its_services(tmp_path: Path, redis_url: str,
                                                       key_prefix: str) -> None:
    eng, info = procs.start_service("stub-engine", "harnessrl.testing.stub_engine", [],
                                    tmp_path, timeout=60, env={"PYTHONPATH": str(REPO)})
    try:
        (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": "t1", "q": "x"}) + "\n")
        up = subprocess.Popen(
            [sys.executable, "-m", "harnessrl.local.cli", "up", "--rollouts-only",
             "--harness", "sleep 600", "--grader", "echo '{\"reward\": 1}'",
             "--tasks", str(tmp_path / "tasks.jsonl"), "--group-size", "1",
             "--engine-url", f"http://127.0.0.1:{info['http_port']}", "--model-name",
             "stub-model", "--model-dir", str(tmp_path), "--redis-url", redis_url, "--key-prefix", key_prefix,
             "--state-dir", str(tmp_path / "state")],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        started: list[int] = []
        while len(started) < 3:  # store, gateway, controller
            assert up.poll() is None, up.stdout.read() if up.stdout else ""
            assert time.monotonic() < deadline, "the services did not start"
            time.sleep(0.5)
            started = children(up.pid)
        time.sleep(3)  # the run and its rollout under way
        started = children(up.pid)
        up.send_signal(signal.SIGTERM)
        out, _ = up.communicate(timeout=120)
        assert up.returncode == 128 + signal.SIGTERM, out
        left = [p for p in started if pid_alive(p)]
        assert not left, f"still running after SIGTERM: {left}\n{out[-2000:]}"
    finally:
        if "up" in locals() and up.poll() is None:
            up.kill()
        eng.stop()
