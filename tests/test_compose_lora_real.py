"""docker-compose.lora.yml run for real, layered on docker-compose.yml's CPU profile, with the
images tests/test_compose_real.py builds (or reuses), against the same kind of daemon.

What it shows: `lora-zero-cpu` writes the zero adapter on the `adapters` volume before the
engine starts and the engine serves it; the trainer trains an adapter (the base frozen) for 3
steps and each version it pushes is a PEFT folder on that volume, loaded by the engine through
vLLM's runtime API (its own log says so) and served to the run's calls, which the store records
with that version; when the run is done its adapter is removed from the engine and the gateway
and its folders are deleted. Only the number of steps is overridden.

Opt-in (HARNESSRL_LONG_TESTS=1): about 3 minutes more once the images exist (186 s here), and
CI already runs the compose stack for real (tests/test_compose_real.py), LoRA against vLLM
(tests/test_lora_vllm.py) and the volume-ownership check that this test's first run called for
(tests/test_deploy.py).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

import pytest

from harnessrl.clients import GatewayAdminClient, StoreClient
from harnessrl.identity import Identity
from test_compose_real import REPO, Compose, project_env, seed_models, wait_for

STEPS = 3
LONG = os.environ.get("HARNESSRL_LONG_TESTS") == "1"
pytestmark = [pytest.mark.slow, pytest.mark.containers, pytest.mark.timeout(3600),
              pytest.mark.skipif(not LONG, reason="set HARNESSRL_LONG_TESTS=1")]


def test_lora_compose_trains_an_adapter_pushed_through_the_shared_volume(  # type: ignore[no-untyped-def]
        docker_daemon, built_images, tiny_model_dir: Path, tmp_path: Path) -> None:
    project = f"hrllora{secrets.token_hex(3)}"
    env, override = project_env(docker_daemon, built_images, tmp_path, STEPS)
    dc = Compose(project, [REPO / "docker-compose.yml", REPO / "docker-compose.lora.yml",
                           override], env)
    try:
        seed_models(dc, project, tiny_model_dir, built_images["trainer"]["tag"])
        t0 = time.monotonic()
        dc.compose("up", "-d", "--no-build", timeout=900)
        up_s = time.monotonic() - t0
        out = dc.volume("checkpoints") / "calc"
        prefix = wait_for("the trainer's run.json", lambda: (out / "run.json").exists() and
                          json.loads((out / "run.json").read_text())["run_prefix"], 600)
        # the test reads as the project's operator (its CA is not the test session's)
        operator = Identity.from_folder(dc.volume("pki") / "operator")
        admin = GatewayAdminClient.connect(f"{dc.ip('gateway')}:{env['GATEWAY_GRPC_PORT']}",
                                           ident=operator)
        (engine,) = admin.list_engines().engines
        assert engine.lora.enabled and engine.lora.base_adapter == "base", engine
        seen: dict[int, str] = {}  # the run's adapter versions the gateway listed, by version

        def trainer_done() -> bool:
            for a in admin.list_engines().engines[0].adapters:
                if a.name == prefix and a.lora_name:
                    seen[a.policy_version] = a.lora_name
            st = dc.state("trainer-cpu")
            return st["Status"] == "exited" and not st["Restarting"]

        wait_for("the trainer's last step", trainer_done, 1500, every=0.5)
        train_s = time.monotonic() - t0 - up_s
        assert dc.state("trainer-cpu")["ExitCode"] == 0
        assert dc.state("lora-zero-cpu")["ExitCode"] == 0
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == STEPS and rows[-1]["policy_version"] >= 1, rows
        trainer_log = dc.compose("logs", "--no-color", "trainer-cpu").stdout
        assert "LoRA rank 8" in trainer_log and f"adapter {prefix} removed" in trainer_log

        # the engine's own account: every version loaded by path from the shared volume, the
        # last one unloaded at the run's end
        engine_log = dc.compose("logs", "--no-color", "engine-cpu").stdout
        p = re.escape(prefix)
        loaded = dict(re.findall(rf"Loaded new LoRA adapter: name '({p}-v\d+-[0-9a-f]{{8}})', "
                                 rf"path '(/adapters/{p}/v\d+-[0-9a-f]{{8}})'", engine_log))
        removed = set(re.findall(rf"Removed LoRA adapter: name '({p}-v\d+-[0-9a-f]{{8}})'",
                                 engine_log))
        versions = {int(re.search(r"-v(\d+)-", n)[1]) for n in loaded}  # type: ignore[index]
        assert versions == set(range(rows[-1]["policy_version"] + 1)), (versions, rows)
        assert seen and set(seen.values()) <= set(loaded), (seen, loaded)
        assert removed == set(loaded), (removed, loaded)  # replaced ones, then the last
        assert not [a for a in admin.list_engines().engines[0].adapters if a.name == prefix]
        adapters_vol = dc.volume("adapters")
        assert (adapters_vol / "zero" / "adapter_config.json").exists()
        assert not (adapters_vol / prefix).exists()  # its version folders deleted at the end

        # the store: each step's calls served by the version the step was generated with
        store = StoreClient.connect(f"{dc.ip('store')}:{env['STORE_PORT']}", timeout=30,
                                    ident=operator)
        calls: dict[int, set[int]] = {}
        for row in rows:
            run = store.get_run(row["run_id"])
            assert run.spec.adapter == prefix, run.spec
            for ro in store.list_rollouts(row["run_id"], include_calls=True).rollouts:
                calls.setdefault(row["step"], set()).update(
                    c.policy_version for c in ro.calls if not c.aborted)
        store.close()
        admin.close()
        print(f"LORA-COMPOSE up {up_s:.0f} s, 3 steps {train_s:.0f} s; versions loaded "
              f"{sorted(versions)}; calls' versions by step {calls}; rewards "
              f"{[round(r['reward_mean'], 3) for r in rows]}")
        assert {s: {r["behaviour_version"]} for s, r in
                ((r["step"], r) for r in rows)} == calls
    finally:
        logs: Any = dc.compose("logs", "--no-color", "--timestamps", timeout=120, check=False)
        (tmp_path / "compose.log").write_text(logs.stdout + logs.stderr)
        dc.compose("down", "-v", "--remove-orphans", "-t", "20", timeout=300, check=False)
