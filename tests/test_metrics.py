"""Prometheus /metrics of the store, gateway and controller, scraped from real processes (real
Redis, the stub engine, a harness written here that calls the gateway with the official openai
SDK) while a run goes through them: each named series is there and moves. (The trainer's series:
tests/test_tracking.py.)"""

from __future__ import annotations

import json
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from conftest import TEST_SECRET, GatewayService, StubEngineService
from harnessrl import procs
from harnessrl.clients import ControllerClient, GatewayAdminClient, StoreClient
from harnessrl.v1 import common_pb2 as c

HARNESS = """
import os
from openai import OpenAI
client = OpenAI()
out = client.chat.completions.create(model="tiny", max_tokens=4,
                                     messages=[{"role": "user", "content": "hi"}])
open("answer.txt", "w").write(out.choices[0].message.content or "")
"""
GRADER = 'print(\'{"reward": 1.0}\')'


def scrape(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def wait_for(what: str, probe: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_metrics_of_store_gateway_and_controller_move_with_a_run(
        tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    procs_started: list[procs.ServiceProcess] = []
    try:
        store_proc, info = procs.start_service(
            "store", "services.store",
            ["--bind", "127.0.0.1:0", "--redis-url", redis_url, "--key-prefix", key_prefix,
             "--metrics-bind", "127.0.0.1:0", "--metrics-refresh-s", "0.2"], tmp_path)
        procs_started.append(store_proc)
        store_address, store_m = f"127.0.0.1:{info['grpc_port']}", info["metrics_port"]
        stub = StubEngineService(tmp_path / "stub")
        procs_started.append(stub.proc)
        gateway = GatewayService(tmp_path / "gateway", store_address,
                                 [{"name": "e0", "base_url": stub.base_url, "model": "tiny"}])
        procs_started.append(gateway.proc)
        ctl_proc, info = procs.start_service(
            "controller", "services.controller",
            ["--bind", "127.0.0.1:0", "--store-address", store_address,
             "--gateway-url", gateway.base_url, "--workdir-root", str(tmp_path / "rollouts"),
             "--metrics-bind", "127.0.0.1:0"], tmp_path,
            env={"HARNESSRL_SECRET": TEST_SECRET})
        procs_started.append(ctl_proc)
        ctl_address, ctl_m = f"127.0.0.1:{info['grpc_port']}", info["metrics_port"]
        gw_m = gateway.http_port

        before = {"store": scrape(store_m), "gateway": scrape(gw_m), "controller": scrape(ctl_m)}
        for series in ("process_cpu_seconds_total", "python_info"):  # the process collector
            assert any(k.startswith(series) for k in before["store"]), series

        harness, grader = tmp_path / "harness.py", tmp_path / "grader.py"
        harness.write_text(textwrap.dedent(HARNESS))
        grader.write_text(GRADER)
        admin = GatewayAdminClient.connect(gateway.admin_address)
        admin.pause(["e0"])  # the harnesses' calls are held until resumed
        ctl = ControllerClient.connect(ctl_address)
        run = ctl.create_run(c.RunSpec(
            name="metrics", group_size=2, concurrency=4, stream="mtest",
            tasks=[c.Task(task_id=f"t{i}", data_json=json.dumps({"i": i})) for i in range(2)],
            harness_command=[sys.executable, str(harness)],
            grader_command=[sys.executable, str(grader)], timeout_s=60))

        held = 'harnessrl_gateway_held_requests{route="/v1/chat/completions"}'
        wait_for("4 held calls", lambda: scrape(gw_m).get(held) == 4)
        running = 'harnessrl_controller_rollouts{state="RUNNING"}'
        assert scrape(ctl_m)[running] - before["controller"].get(running, 0) == 4
        admin.resume(["e0"])
        done = threading.Event()
        threading.Thread(target=lambda: (list(ctl.watch_run(run.run_id, timeout=120)),
                                         done.set()), daemon=True).start()
        assert done.wait(120), "run did not finish"
        run = ctl.get_run(run.run_id)
        assert run.num_succeeded == 4, run

        gw = scrape(gw_m)
        assert gw[held] == 0
        ok = 'harnessrl_gateway_requests_total{route="/v1/chat/completions",status="200"}'
        assert gw[ok] - before["gateway"].get(ok, 0) == 4
        count = 'harnessrl_gateway_request_seconds_count{route="/v1/chat/completions"}'
        total = 'harnessrl_gateway_request_seconds_sum{route="/v1/chat/completions"}'
        assert gw[count] - before["gateway"].get(count, 0) == 4
        assert gw[total] > 0  # held calls took time
        metrics_route = 'harnessrl_gateway_requests_total{route="/metrics",status="200"}'
        assert gw[metrics_route] >= 2
        assert "harnessrl_gateway_held_records" in gw

        ctl_after = scrape(ctl_m)
        succeeded = 'harnessrl_controller_rollouts{state="SUCCEEDED"}'
        assert ctl_after[succeeded] - before["controller"].get(succeeded, 0) == 4
        assert ctl_after.get(running, 0) == before["controller"].get(running, 0)
        launches = 'harnessrl_controller_job_launch_seconds_count{backend="local"}'
        assert ctl_after[launches] - before["controller"].get(launches, 0) >= 8  # harness+grader
        assert ctl_after['harnessrl_controller_job_launches_total{backend="local",outcome="ok"}'] \
            >= 8

        stored = 'harnessrl_store_calls_appended_total{result="stored"}'
        assert scrape(store_m)[stored] - before["store"].get(stored, 0) == 4
        entries = 'harnessrl_store_stream_entries{stream="mtest"}'
        lag = 'harnessrl_store_stream_lag{group="trainer",stream="mtest"}'
        pending = 'harnessrl_store_stream_pending{group="trainer",stream="mtest"}'
        wait_for("2 stream entries", lambda: scrape(store_m).get(entries) == 2)
        store = StoreClient.connect(store_address)
        groups = store.read_groups(stream="mtest", consumer_group="trainer", max_groups=1)
        wait_for("lag 1, pending 1",
                 lambda: (scrape(store_m).get(lag), scrape(store_m).get(pending)) == (1, 1))
        store.ack_groups([g.entry_id for g in groups.groups], stream="mtest")
        store.read_groups(stream="mtest", consumer_group="trainer", max_groups=5)
        wait_for("lag 0, pending 1",
                 lambda: (scrape(store_m).get(lag), scrape(store_m).get(pending)) == (0, 1))
        store.close()
        ctl.close()
        admin.close()
    finally:
        for p in reversed(procs_started):
            p.stop()


def test_dashboard_and_prometheus_config_name_only_series_and_ports_that_exist() -> None:
    """Every series the Grafana dashboard queries is one a service declares, every declared
    harnessrl series is on the dashboard, and Prometheus scrapes the compose file's ports."""
    import re

    import yaml
    from prometheus_client import REGISTRY

    import services.controller.metrics
    import services.gateway.metrics
    import services.store.metrics
    import services.trainer.metrics  # noqa: F401 - they register their series

    repo = Path(__file__).resolve().parent.parent
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "gauge": ("",)}
    declared = {m.name + s for m in REGISTRY.collect() if m.name.startswith("harnessrl_")
                for s in suffixes[m.type]}
    dash = json.loads((repo / "deploy/monitoring/grafana/dashboards/harnessrl.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {n for e in exprs for n in re.findall(r"harnessrl_[a-z_]+", e)}
    assert used <= declared, used - declared
    families = {m.name for m in REGISTRY.collect() if m.name.startswith("harnessrl_")}
    assert all(any(u.startswith(f) for u in used) for f in families), \
        {f for f in families if not any(u.startswith(f) for u in used)}
    prom = yaml.safe_load((repo / "deploy/monitoring/prometheus.yml").read_text())
    targets = {j["job_name"]: j["static_configs"][0]["targets"][0]
               for j in prom["scrape_configs"]}
    compose = (repo / "docker-compose.yml").read_text()
    for job, var in (("store", "STORE_METRICS_PORT"), ("controller", "CONTROLLER_METRICS_PORT"),
                     ("trainer", "TRAINER_METRICS_PORT"), ("gateway", "GATEWAY_HTTP_PORT")):
        port = re.search(rf"\${{{var}:-(\d+)}}", compose)
        assert port and targets[job] == f"{job}:{port[1]}", (job, targets[job])
