"""The supervisor of `harnessrl up` (`harnessrl/local/supervisor.py`), on real processes: Redis (AOF),
store, gateway (in front of the stub engine), controller. Each killed with kill -9 comes back
with the same flags on the same port, the event is recorded, and what the store held survives.
Also: a harness whose controller never comes back is ended by its job wrapper's deadline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harnessrl import procs
from harnessrl.clients import GatewayAdminClient, StoreClient
from harnessrl.rpc import health_check
from harnessrl.local.stack import Stack, StackConfig
from harnessrl.v1 import common_pb2 as c
from services.controller.backends import local

WRAPPER = Path(local.__file__).with_name("job_wrapper.py")


def _wait(pred, timeout: float = 60.0) -> float:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.1)
    return time.monotonic() - t0


def test_each_service_killed_comes_back_on_its_port_with_the_event_recorded(
        tmp_path: Path, stub_engine) -> None:  # type: ignore[no-untyped-def]
    cfg = StackConfig(state_dir=tmp_path / "state",
                      redis_url=f"redis://127.0.0.1:{procs.free_port()}/0",
                      external_engines=(stub_engine.base_url,), served_model_name="tiny")
    seen: list[str] = []
    with Stack(cfg) as stack:
        stack.supervise(on_event=lambda ev: seen.append(f"{ev.service} {ev.kind}"))
        assert "redis" in stack.procs  # nothing answered there: the stack started it, with AOF
        store = StoreClient.connect(stack.store_address, timeout=10)
        store.put_run(c.Run(run_id="kept", status=c.RUN_STATUS_RUNNING))
        admin = GatewayAdminClient.connect(stack.gateway_admin_address, timeout=10)
        admin.update_engine("engine0", policy_version=7)
        time.sleep(1.5)  # the supervisor polls the engines' versions every second
        addresses = (stack.store_address, stack.gateway_admin_address,
                     stack.controller_address, stack.redis_url)
        for name in ("store", "gateway", "controller", "redis"):
            old = stack.procs[name]
            old.kill()
            took = _wait(lambda name=name, old=old: stack.procs[name] is not old
                         and f"{name} restarted" in seen)
            print(f"{name}: back in {took:.2f}s")
            assert stack.procs[name].alive
        assert (stack.store_address, stack.gateway_admin_address, stack.controller_address,
                stack.redis_url) == addresses
        for addr, peer in zip(addresses[:3], ("store", "gateway", "controller")):
            _wait(lambda: health_check(addr, timeout=1, peer=peer), 30)  # noqa: B023
        assert store.get_run("kept").run_id == "kept"  # Redis came back from its AOF
        # the restarted gateway kept the engine's policy version (calls must carry it)
        assert admin.list_engines().engines[0].policy_version == 7
        events = [json.loads(x) for x in (stack.state / "events.jsonl").read_text().split("\n")
                  if x]
        died = [e for e in events if e["kind"] == "died"]
        assert [e["service"] for e in died] == ["store", "gateway", "controller", "redis"]
        assert all(e["exit_code"] == -signal.SIGKILL for e in died)
        assert all(e["down_s"] is not None for e in events if e["kind"] == "restarted")
        store.close()
        admin.close()
        # a service stopped by Stack.restart is not restarted a second time by the supervisor
        stack.restart("store")
        time.sleep(1.0)
        assert sum(1 for s in seen if s == "store restarted") == 1
    # stopping the stack stops everything, and nothing restarts it
    assert all(not p.alive for p in stack.procs.values())


def test_a_job_whose_controller_never_returns_is_ended_by_its_wrapper(tmp_path: Path) -> None:
    """The controller died and nobody restarted it: the harness (and what it spawned) still
    ends a few seconds past the attempt's deadline, and says why in its exit file."""
    exit_file = tmp_path / "exit.json"
    script = ("import subprocess, sys, time; "
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
              "print(p.pid, flush=True); time.sleep(120)")
    wrapper = subprocess.Popen(
        [sys.executable, "-I", "-S", str(WRAPPER), str(exit_file),
         f"--deadline={time.time() + 1.5}", sys.executable, "-c", script],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert wrapper.stdout is not None
    grandchild = int(wrapper.stdout.readline())
    t0 = time.monotonic()
    wrapper.wait(timeout=15)
    took = time.monotonic() - t0
    assert took < 6, took
    assert json.loads(exit_file.read_text())["error"].startswith("killed by its job wrapper")

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    _wait(lambda: gone(grandchild), 5)
