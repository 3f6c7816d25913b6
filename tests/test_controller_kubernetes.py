"""The controller with the kubernetes backend: every attempt a Job on the fake API server
(`harnessrl.testing.fake_kube`, its own process, driven through the real client and a
kubeconfig), against a real store. Retries as new attempts, both reward paths, credentials
that travel only in Secrets, and a controller killed with kill -9 mid-run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from harnessrl.v1 import common_pb2 as c
from test_controller import Services

TEMPLATE = {"apiVersion": "batch/v1", "kind": "Job", "spec": {"template": {"spec": {
    "containers": [{"name": "harness", "image": "harnessrl/harness:dev"}]}}}}


def k8s_services(tmp: Path, redis_url: str, prefix: str, fake_kube) -> Services:  # type: ignore[no-untyped-def]
    template = tmp / "job-template.yaml"
    template.write_text(yaml.safe_dump(TEMPLATE))
    return Services(tmp, redis_url, prefix, controller_flags=(
        "--default-backend", "kubernetes", "--k8s.job-template", str(template),
        "--k8s.kubeconfig", str(fake_kube.kubeconfig), "--k8s.relist-s", "5",
        "--k8s.job-creates-per-s", "100"))


def job_creations(fake_kube, run_id: str) -> int:  # type: ignore[no-untyped-def]
    """Job creations the fake API server accepted for this run (by the run label)."""
    return sum(1 for q in fake_kube.requests()
               if q["method"] == "POST" and q["path"].endswith("/jobs") and
               (q.get("body") or {}).get("metadata", {}).get("labels", {})
               .get("harnessrl.dev/run") == run_id)


def pods(fake_kube, run_id: str) -> list:  # type: ignore[no-untyped-def,type-arg]
    from kubernetes import client, config

    api = config.new_client_from_config(config_file=str(fake_kube.kubeconfig))
    try:
        return client.CoreV1Api(api).list_namespaced_pod(
            fake_kube.namespace, label_selector=f"harnessrl.dev/run={run_id}").items
    finally:
        api.close()


def harnesses_running(fake_kube, run_id: str) -> int:  # type: ignore[no-untyped-def]
    """Pods whose harness runs (an init container: the pod is Pending meanwhile)."""
    return sum(1 for p in pods(fake_kube, run_id)
               for cs in p.status.init_container_statuses or []
               if cs.name == "harness" and cs.state.running is not None)


def pods_succeeded(fake_kube, run_id: str) -> int:  # type: ignore[no-untyped-def]
    return sum(p.status.phase == "Succeeded" for p in pods(fake_kube, run_id))


def test_pod_failure_is_retried_and_credentials_stay_in_secrets(
        redis_url: str, key_prefix: str, tmp_path: Path, fake_kube) -> None:  # type: ignore[no-untyped-def]
    s = k8s_services(tmp_path, redis_url, key_prefix, fake_kube)
    try:
        spec = s.spec([{"id": "flaky", "behavior": "crash_once", "x": 2},
                       {"id": "broken", "behavior": "crash", "x": 1},
                       {"id": "fine", "x": 3}], max_attempts=2)
        run, _ = s.run_to_end(spec)
        assert run.status == c.RUN_STATUS_SUCCEEDED and run.num_succeeded == 2, run
        ro = s.rollouts(run.run_id)
        assert [a.status for a in ro["flaky/0"].attempts] == [c.ROLLOUT_STATUS_FAILED,
                                                             c.ROLLOUT_STATUS_SUCCEEDED]
        assert ro["flaky/0"].reward == 1.0 and ro["fine/0"].reward == 1.0
        broken = ro["broken/0"]
        assert [a.status for a in broken.attempts] == [c.ROLLOUT_STATUS_FAILED] * 2
        assert "exited with code 3" in broken.error and "boom on attempt 2" in broken.error
        # the harness's log and the in-pod grader's output are in the attempt's workdir
        fine = Path(ro["fine/0"].attempts[0].workdir)
        assert "harness ran" in (fine / "stdout.log").read_text()
        assert '"reward": 1.0' in (fine / "grader.stdout.log").read_text()
        assert job_creations(fake_kube, run.run_id) == 5  # one Job per attempt
        # every credential the controller minted went into a Secret, and nowhere else
        sent = fake_kube.requests()
        tokens = [q["body"]["stringData"]["openai-api-key"] for q in sent
                  if q["method"] == "POST" and q["path"].endswith("/secrets") and
                  q["body"]["metadata"]["labels"].get("harnessrl.dev/run") == run.run_id]
        assert len(set(tokens)) == 5 and all(len(t) > 20 for t in tokens)
        others = json.dumps([q for q in sent if not q["path"].endswith("/secrets")])
        assert not any(t in others for t in tokens)
    finally:
        s.stop()


def test_timeout_deletes_the_job_and_fails_the_attempt(redis_url: str, key_prefix: str,
                                                       tmp_path: Path, fake_kube) -> None:  # type: ignore[no-untyped-def]
    s = k8s_services(tmp_path, redis_url, key_prefix, fake_kube)
    try:
        run, _ = s.run_to_end(s.spec([{"id": "h", "behavior": "hang", "x": 1}], timeout_s=2))
        ro = s.rollouts(run.run_id)["h/0"]
        assert ro.status == c.ROLLOUT_STATUS_FAILED and ro.attempts[0].timed_out
        assert "timed out after 2s" in ro.error, ro.error
        assert not [p for p in pods(fake_kube, run.run_id)]  # Job and pod deleted
    finally:
        s.stop()


def test_harness_reported_reward_on_kubernetes(redis_url: str, key_prefix: str,
                                               tmp_path: Path, fake_kube) -> None:  # type: ignore[no-untyped-def]
    s = k8s_services(tmp_path, redis_url, key_prefix, fake_kube)
    try:
        spec = s.spec([{"id": "r", "behavior": "report", "reward": 0.25, "x": 1}],
                      reward_source=c.REWARD_SOURCE_HARNESS, grader_command=[])
        run, _ = s.run_to_end(spec)
        assert run.status == c.RUN_STATUS_SUCCEEDED, run
        assert s.rollouts(run.run_id)["r/0"].reward == 0.25
    finally:
        s.stop()


def test_controller_killed_mid_run_adopts_its_jobs_on_kubernetes(
        redis_url: str, key_prefix: str, tmp_path: Path, fake_kube) -> None:  # type: ignore[no-untyped-def]
    """kill -9 of the controller while two pods run; one ends before the restart. The new
    controller resumes the run, adopts both Jobs, and creates no Job twice."""
    s = k8s_services(tmp_path, redis_url, key_prefix, fake_kube)
    try:
        run_id = "k8s-resumed"
        spec = s.spec([{"id": "fast", "behavior": "sleep", "sleep": 1.0, "x": 1},
                       {"id": "slow", "behavior": "sleep", "sleep": 8.0, "x": 1},
                       {"id": "later", "x": 2}],
                      group_size=1, concurrency=2, max_attempts=2)
        s.ctl.create_run(spec, run_id=run_id)
        deadline = time.monotonic() + 30
        while harnesses_running(fake_kube, run_id) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        s.controller.kill()  # kill -9
        s.ctl.close()
        while pods_succeeded(fake_kube, run_id) < 1:  # "fast" ends unwatched
            assert time.monotonic() < deadline
            time.sleep(0.1)
        s.start_controller()
        done = list(s.ctl.watch_run(run_id, timeout=90))[-1].run
        assert done.status == c.RUN_STATUS_SUCCEEDED and done.num_succeeded == 3, done
        rollouts = s.rollouts(run_id)
        for ro in rollouts.values():
            assert [a.status for a in ro.attempts] == [c.ROLLOUT_STATUS_SUCCEEDED], ro
        attempts = sum(len(ro.attempts) for ro in rollouts.values())
        assert job_creations(fake_kube, run_id) == attempts == 3
        assert "adopted Job" in s.controller.log_tail(400)
    finally:
        s.stop()



def test_the_k8s_section_and_its_old_flat_names(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The backend's settings are the `k8s` section (file, env, flags); the flat `k8s_*`
    names they had before are refused with the new name wherever they come from, never
    ignored (an unknown environment variable would be, and the backend would be missing)."""
    import pytest

    from services.controller.config import ControllerConfig

    monkeypatch.setenv("HARNESSRL_CONTROLLER_K8S__NAMESPACE", "from-env")
    conf = tmp_path / "controller.yaml"
    conf.write_text("k8s: {job_template: t.yaml, relist_s: 7}\n")
    cfg = ControllerConfig.load(["--config", str(conf), "--k8s.kubeconfig", "kc"])
    assert (cfg.k8s.job_template, cfg.k8s.relist_s, cfg.k8s.namespace, cfg.k8s.kubeconfig) \
        == ("t.yaml", 7.0, "from-env", "kc")
    monkeypatch.delenv("HARNESSRL_CONTROLLER_K8S__NAMESPACE")

    conf.write_text("k8s_relist_s: 7\n")
    with pytest.raises(ValueError, match=r"k8s_relist_s is now k8s\.relist_s"):
        ControllerConfig.load(["--config", str(conf)])
    monkeypatch.setenv("HARNESSRL_CONTROLLER_K8S_JOB_TEMPLATE", "t.yaml")
    with pytest.raises(ValueError, match="HARNESSRL_CONTROLLER_K8S__JOB_TEMPLATE"):
        ControllerConfig.load([])
    monkeypatch.delenv("HARNESSRL_CONTROLLER_K8S_JOB_TEMPLATE")
    with pytest.raises(SystemExit):
        ControllerConfig.load(["--k8s-job-template", "t.yaml"])
