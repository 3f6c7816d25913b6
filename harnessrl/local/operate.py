"""The verbs that work on a stack `harnessrl up --detach` left running: status, runs, rollouts,
show, logs, down. They find it through `<state>/stack.json` (default state dir `.harnessrl`),
which the detached supervisor writes once everything serves and removes when it stops.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from harnessrl.v1 import common_pb2 as c

STATE_FILE = "stack.json"


class NoStack(RuntimeError):
    """No detached stack answers in this state directory; the message names the fix."""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (our own unreaped child) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def write_state(state_dir: Path, data: dict[str, Any]) -> Path:
    path = Path(state_dir) / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def load_state(state_dir: str | Path) -> dict[str, Any]:
    """The running stack's addresses; `NoStack` when there is none (or its supervisor died)."""
    state = Path(state_dir)
    path = state / STATE_FILE
    fix = "start one with harnessrl up --detach"
    if not path.exists():
        raise NoStack(f"no stack running in {state}; {fix}")
    data = json.loads(path.read_text())
    if not pid_alive(int(data["supervisor_pid"])):
        raise NoStack(f"no stack running in {state} (its supervisor, pid "
                      f"{data['supervisor_pid']}, is gone; logs in {data.get('logs')}); {fix}")
    return dict(data)


def _age(t: float) -> str:
    if not t:
        return "-"
    s = time.time() - t
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago"


def _state(x: Any) -> str:
    """READY, or MARKED with the reason, of an engine or an adapter."""
    from harnessrl.v1 import gateway_pb2 as gpb

    return "MARKED: " + x.reason if x.state == gpb.ENGINE_STATE_MARKED else "READY"


def _health(address: str, peer: str) -> str:
    from harnessrl.rpc import health_check

    try:
        return "serving" if health_check(address, timeout=2, peer=peer) else "NOT SERVING"
    except Exception:  # noqa: BLE001 - unreachable
        return "unreachable"


def status(st: dict[str, Any], console: Console) -> int:
    from harnessrl.clients import GatewayAdminClient, StoreClient, TrainerClient

    console.print(f"stack in {st['state_dir']}  (supervisor pid {st['supervisor_pid']}, "
                  f"started {_age(st['started_at'])})")
    t = Table(title="services")
    for col in ("service", "pid", "address", "health"):
        t.add_column(col)
    procs = st.get("procs", {})
    addresses = {"store": st["store"], "gateway": st["gateway_admin"], "redis": st["redis_url"],
                 "controller": st["controller"], "trainer": st.get("trainer", "")}
    for name, info in procs.items():
        pid = info.get("pid")
        addr = addresses.get(name) or info.get("address", "")
        live = pid is not None and pid_alive(int(pid))
        if name in ("store", "gateway", "controller", "trainer") and addr and live:
            health = _health(addr, name)
        else:
            health = "running" if live else "down"
        if info.get("exited"):
            health = f"exited {info['exited']}"
        t.add_row(name, str(pid or "-"), addr, health)
    console.print(t)
    try:
        admin = GatewayAdminClient.connect(st["gateway_admin"], timeout=5)
        t = Table(title="engines")
        for col in ("engine", "url", "state", "policy version", "paused", "in flight", "served"):
            t.add_column(col)
        engines = admin.list_engines().engines
        for e in engines:
            t.add_row(e.name, e.base_url, _state(e), str(e.policy_version), str(e.paused),
                      str(e.inflight), str(e.served_calls))
        admin.close()
        console.print(t)
        adapters = [a for e in engines for a in e.adapters]
        if adapters:  # LoRA runs (docs/lora.md): which adapter versions each engine holds
            t = Table(title="LoRA adapters")
            for col in ("engine", "adapter (run)", "state", "version", "loaded versions",
                        "held", "in flight", "served"):
                t.add_column(col)
            for a in adapters:
                t.add_row(a.engine, a.name, _state(a), str(a.policy_version),
                          ",".join(map(str, a.loaded_versions)), str(a.paused),
                          str(a.inflight), str(a.served_calls))
            console.print(t)
    except Exception as exc:  # noqa: BLE001
        console.print(f"engines: gateway unreachable ({exc.__class__.__name__})")
    try:
        store = StoreClient.connect(st["store"], timeout=5)
        _runs_table(store.list_runs(10).runs, console, "recent runs")
        store.close()
    except Exception as exc:  # noqa: BLE001
        console.print(f"runs: store unreachable ({exc.__class__.__name__})")
    if st.get("trainer"):
        try:
            tr = TrainerClient.connect(st["trainer"], timeout=5)
            s = tr.get_status()
            tr.close()
            last = s.recent[-1] if s.recent else None
            console.print(f"trainer: {s.state}, step {s.step}/{st.get('steps', '?')}, policy "
                          f"version {s.policy_version}"
                          + (f", last reward {last.reward_mean:.3f}" if last else "")
                          + (f", error: {s.error}" if s.error else ""))
        except Exception as exc:  # noqa: BLE001
            console.print(f"trainer: unreachable ({exc.__class__.__name__})")
    events = Path(st["state_dir"]) / "events.jsonl"
    if events.exists():
        from harnessrl.local.events import Event

        lines = events.read_text().splitlines()[-5:]
        if lines:
            console.print("supervisor events (last 5):")
            for line in lines:
                console.print("  " + Event(**json.loads(line)).line(), markup=False)
    return 0


def _runs_table(runs: Any, console: Console, title: str) -> None:
    t = Table(title=title)
    for col in ("run", "status", "rollouts", "succeeded", "failed", "running", "tampered",
                "mean reward", "created"):
        t.add_column(col)
    for r in runs:
        t.add_row(r.run_id, c.RunStatus.Name(r.status).removeprefix("RUN_STATUS_"),
                  str(r.num_rollouts), str(r.num_succeeded), str(r.num_failed),
                  str(r.num_running), str(r.num_tampered), f"{r.mean_reward:.3f}",
                  _age(r.created_at))
    console.print(t)


def runs(st: dict[str, Any], console: Console, limit: int = 50) -> int:
    from harnessrl.clients import StoreClient

    store = StoreClient.connect(st["store"], timeout=10)
    _runs_table(store.list_runs(limit).runs, console, "runs")
    store.close()
    return 0


def rollouts(st: dict[str, Any], console: Console, run_id: str) -> int:
    from harnessrl.clients import StoreClient

    store = StoreClient.connect(st["store"], timeout=10)
    ros = store.list_rollouts(run_id).rollouts
    store.close()
    if not ros:
        console.print(f"run {run_id}: no rollouts (list runs with harnessrl runs)")
        return 1
    t = Table(title=f"rollouts of {run_id}")
    for col in ("rollout", "task", "status", "reward", "attempts", "calls", "error"):
        t.add_column(col, overflow="fold")
    for r in ros:
        t.add_row(r.rollout_id, r.task_id,
                  c.RolloutStatus.Name(r.status).removeprefix("ROLLOUT_STATUS_")
                  + (" TAMPERED" if r.tampered else ""),
                  f"{r.reward:.3f}" if r.has_reward else "-",
                  f"{r.attempt}/{r.max_attempts}",
                  str(r.attempts[-1].num_calls if r.attempts else 0),
                  r.error or "; ".join(a.error for a in r.attempts if a.error))
    console.print(t)
    if tampered := sum(r.tampered for r in ros):
        console.print(f"{tampered} of {len(ros)} rollouts TAMPERED: their grader found the "
                      "agent's code forged the outcome (harnessrl show ROLLOUT: the evidence)")
    return 0


def _tokenizer(model_dir: str) -> Any:
    if not model_dir:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)
    except Exception:  # noqa: BLE001 - shown as ids instead
        try:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(model_dir)
        except Exception:  # noqa: BLE001
            return None


def _render(tok: Any, ids: list[int]) -> str:
    if tok is None:
        return f"(token ids, no tokenizer) {ids[:64]}{' ...' if len(ids) > 64 else ''}"
    try:
        return str(tok.decode(ids, skip_special_tokens=False))
    except Exception as exc:  # noqa: BLE001
        return f"(not decodable by the model's tokenizer: {exc}) {ids[:64]}"


def _tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(none)"
    return "\n".join(lines[-n:]) if lines else "(empty)"


def show(st: dict[str, Any], console: Console, rollout_id: str) -> int:
    from harnessrl.clients import StoreClient

    store = StoreClient.connect(st["store"], timeout=10)
    r = store.get_rollout(rollout_id, include_calls=True)
    store.close()
    tok = _tokenizer(st.get("model_dir", ""))
    console.print(f"[bold]rollout {r.rollout_id}[/bold]  run {r.run_id}  task {r.task_id}  "
                  f"group {r.group_id}  status "
                  f"{c.RolloutStatus.Name(r.status).removeprefix('ROLLOUT_STATUS_')}  reward "
                  f"{r.reward if r.has_reward else '-'}  attempt {r.attempt}/{r.max_attempts}")
    if r.error:
        console.print(f"error: {r.error}", markup=False)
    if r.tampered:
        console.print(f"TAMPERED: the grader found the agent's code forged the outcome; "
                      f"evidence: {r.tamper_evidence or '(none given)'}", markup=False,
                      highlight=False)
    for call in r.calls:
        console.rule(f"call {call.seq}: {call.api}, policy version {call.policy_version}, "
                     f"engine {call.engine}, {len(call.prompt_token_ids)} prompt + "
                     f"{len(call.completion_token_ids)} completion tokens, "
                     f"{call.latency_s * 1000:.0f} ms{', ABORTED' if call.aborted else ''}")
        console.print("[bold]prompt[/bold]")
        console.print(_render(tok, list(call.prompt_token_ids)), markup=False, highlight=False)
        console.print("[bold]completion[/bold]")
        console.print(_render(tok, list(call.completion_token_ids)), markup=False,
                      highlight=False)
    for a in r.attempts:
        console.rule(f"attempt {a.attempt}: "
                     f"{c.RolloutStatus.Name(a.status).removeprefix('ROLLOUT_STATUS_')}, exit "
                     f"{a.exit_code}{', timed out' if a.timed_out else ''}, {a.num_calls} calls"
                     f"{', error: ' + a.error if a.error else ''}")
        if a.workdir:
            for name in ("stdout.log", "stderr.log", "grader.stdout.log", "grader.stderr.log"):
                path = Path(a.workdir) / name
                if path.exists():
                    console.print(f"[bold]{name}[/bold] ({path})")
                    console.print(_tail(path), markup=False, highlight=False)
    return 0


def logs(st: dict[str, Any], console: Console, service: str, lines: int, follow: bool) -> int:
    procs = st.get("procs", {})
    if service == "supervisor":
        path = Path(st["logs"]) / "up.log"
    elif service in procs:
        path = Path(procs[service]["log"])
    else:
        console.print(f"no service {service!r}; one of: {', '.join(['supervisor', *procs])}")
        return 2
    print(_tail(path, lines), flush=True)
    if follow:
        with open(path, errors="replace") as f:
            f.seek(0, os.SEEK_END)
            try:
                while True:
                    line = f.readline()
                    if line:
                        print(line, end="", flush=True)
                    else:
                        time.sleep(0.5)
            except KeyboardInterrupt:
                pass
    return 0


def down(state_dir: Path, console: Console, timeout: float = 90.0) -> int:
    st = load_state(state_dir)
    pid = int(st["supervisor_pid"])
    console.print(f"stopping the stack in {state_dir} (supervisor pid {pid})")
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            console.print(f"still running after {timeout:.0f}s: kill -9 {pid} stops it, "
                          "leaving its children")
            return 1
        time.sleep(0.2)
    console.print("stopped")
    return 0


def detach(args: Any, state: Path, console: Console) -> int:
    """Starts `harnessrl up ... --daemon` in a session of its own (it outlives this shell),
    follows its log until the stack serves, and returns."""
    import subprocess
    import sys

    (state / "logs").mkdir(parents=True, exist_ok=True)
    (state / STATE_FILE).unlink(missing_ok=True)
    log_path = state / "logs" / "up.log"
    given = sys.argv[1:] if args.argv is None else list(args.argv)
    argv = [sys.executable, "-m", "harnessrl.local.cli", *given, "--daemon"]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, "HARNESSRL_UP_DAEMON": "1"})
    console.print(f"starting the stack in the background (pid {proc.pid}, log {log_path})",
                  soft_wrap=True)
    t0, pos = time.monotonic(), log_path.stat().st_size
    while not (state / STATE_FILE).exists():
        with open(log_path, errors="replace") as f:  # its progress lines, as they come
            f.seek(pos)
            chunk = f.read()
            pos = f.tell()
        for line in chunk.splitlines():
            if line.startswith("[harnessrl]") or "error" in line.lower():
                console.print(line, markup=False, highlight=False)
        if proc.poll() is not None:
            console.print(f"[red]the stack did not start (exit {proc.returncode}); log "
                          f"{log_path}:")
            console.print(_tail(log_path, 30), markup=False)
            return 1
        if time.monotonic() - t0 > args.start_timeout:
            console.print(f"[red]not up after {args.start_timeout:.0f}s; stopping it (log "
                          f"{log_path})")
            os.kill(proc.pid, signal.SIGTERM)
            return 1
        time.sleep(0.5)
    st = json.loads((state / STATE_FILE).read_text())
    console.print(f"""stack running (supervisor pid {st['supervisor_pid']}, {time.monotonic() - t0:.0f}s):
  gateway {st['gateway_url']}  store {st['store']}  controller {st['controller']}""" + (
        f"  trainer {st['trainer']}" if st.get("trainer") else "") + f"""
  runs: {', '.join(st.get('runs', [])) or '(the trainer creates one per step)'}
  harnessrl status | runs | rollouts RUN | show ROLLOUT | logs SERVICE | down   (--state-dir {args.state_dir})""",
                  markup=False, highlight=False, soft_wrap=True)
    return 0
