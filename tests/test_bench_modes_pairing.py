"""bench/modes.py pairs its arms' tool latencies (issue 44): a draw is keyed by the seed, the
task id without the pool modes' prefix, the index in the group and the count of draws of that
(task, index) pair so far, so sync's `calc-017` and the pool's `s000001-calc-017` sleep the
same schedule. And the bench's planning: the CLI, the arms' order rotated per seed, `--resume`
keeping the runs of an earlier session on this machine. No training runs here."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import modes  # noqa: E402
from bench._tool_draws import (DIR_ENV, MEDIAN_ENV, SEED_ENV, SIGMA_ENV,  # noqa: E402
                               base_task_id, pairing, read_draws, start_draw)


def env_for(task_id: str, index: int, draws: Path, seed: int = 0, median: float = 8.0
            ) -> dict[str, str]:
    """A harness process's environment as the controller and the bench give it."""
    return {"HARNESSRL_TASK_JSON": json.dumps({"id": task_id, "question": "What is 1 + 2?"}),
            "HARNESSRL_INDEX_IN_GROUP": str(index), MEDIAN_ENV: str(median),
            SIGMA_ENV: "1.2", DIR_ENV: str(draws), SEED_ENV: str(seed)}


def schedule(env: dict[str, str], steps: int = 6) -> tuple[int, list[float]]:
    """The draw count a harness process gets and the sleeps of its first `steps` tool steps."""
    draw = start_draw(env)
    assert draw is not None
    return draw.draw, [draw.next_sleep() for _ in range(steps)]


def test_sync_and_pool_ids_of_a_task_sleep_the_same_schedule(tmp_path: Path) -> None:
    sync_n, sync = schedule(env_for("calc-017", 3, tmp_path / "sync"))
    pool_n, pool = schedule(env_for("s000001-calc-017", 3, tmp_path / "async"))
    assert (sync_n, pool_n) == (0, 0)
    assert sync == pool
    assert len(set(sync)) == len(sync) and all(s > 0 for s in sync)  # a real draw, not a constant
    # the records, as the bench reads them into its results: the same schedule under one key
    s_rec, p_rec = read_draws(tmp_path / "sync"), read_draws(tmp_path / "async")
    assert [(d["task"], d["index"], d["draw"], d["sleeps_s"]) for d in s_rec] == \
        [(d["task"], d["index"], d["draw"], d["sleeps_s"]) for d in p_rec] == \
        [("calc-017", 3, 0, sync)]
    assert (s_rec[0]["raw_id"], p_rec[0]["raw_id"]) == ("calc-017", "s000001-calc-017")
    assert pairing({"sync": s_rec, "async": p_rec}) == \
        {"keys_in_all": 1, "mismatched": 0, "examples": []}


def test_what_keys_a_draw_apart(tmp_path: Path) -> None:
    """Another index, another seed, and a repeat draw of the same pair each get another
    schedule; a repeat of the pair in another arm pairs by its count, not by its step."""
    _, base = schedule(env_for("calc-017", 3, tmp_path / "a"))
    n1, again = schedule(env_for("s000005-calc-017", 3, tmp_path / "a"))  # drawn again
    assert n1 == 1 and again != base
    assert schedule(env_for("calc-017", 4, tmp_path / "a"))[1] not in (base, again)
    assert schedule(env_for("calc-017", 3, tmp_path / "seed1", seed=1))[1] != base
    # sync draws the pair at steps 2 and 7, the pool as s000002- and s000007- (or a spare):
    # the first draws pair, and the second ones
    sync = [schedule(env_for("calc-017", 3, tmp_path / "sync"))[1] for _ in range(2)]
    pool = [schedule(env_for(f"s00000{s}-calc-017", 3, tmp_path / "pool"))[1] for s in (2, 7)]
    assert sync == pool == [base, again]
    assert pairing({"sync": read_draws(tmp_path / "sync"),
                    "pool": read_draws(tmp_path / "pool")})["mismatched"] == 0


def test_the_pairing_check_finds_unpaired_draws(tmp_path: Path) -> None:
    """What the bench's summary reports when arms did not sleep the same schedules."""
    a = [{"task": "t", "index": 0, "draw": 0, "sleeps_s": [1.0, 2.0]},
         {"task": "t", "index": 1, "draw": 0, "sleeps_s": [3.0]}]
    b = [{"task": "t", "index": 0, "draw": 0, "sleeps_s": [1.0]},  # fewer tool steps: fine
         {"task": "t", "index": 1, "draw": 0, "sleeps_s": [4.0]}]
    assert pairing({"x": a, "y": b}) == {"keys_in_all": 2, "mismatched": 1,
                                         "examples": [["t", 1, 0]]}


def claim_one(draws: str, q: Any) -> None:
    draw = start_draw(env_for("s000003-calc-017", 0, Path(draws)))
    assert draw is not None
    q.put(draw.draw)


def test_concurrent_harnesses_get_distinct_counts(tmp_path: Path) -> None:
    """Harness processes of one pair starting at once: counts 0..N-1, no gap, no repeat."""
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=claim_one, args=(str(tmp_path), q)) for _ in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 8
    assert sorted(q.get(timeout=5) for _ in procs) == list(range(8))
    assert [d["draw"] for d in read_draws(tmp_path)] == list(range(8))


def test_no_draw_at_zero_latency_and_no_count_without_the_folder(tmp_path: Path) -> None:
    assert start_draw(env_for("calc-001", 0, tmp_path, median=0.0)) is None
    assert not any(tmp_path.iterdir())
    env = env_for("calc-001", 0, tmp_path)
    del env[DIR_ENV]
    with pytest.raises(RuntimeError, match=DIR_ENV):
        start_draw(env)


def test_the_prefix_taken_off_is_the_trainers_pool_prefix() -> None:
    """Every task id of the pool run (spares too) maps back to the id sync sends for it."""
    from services.trainer.rollouts import pool_tasks, step_tasks

    tasks = [{"id": f"calc-{i:03d}"} for i in range(20)]
    cfg = SimpleNamespace(steps=3, tasks_per_step=4, seed=7,
                          mode=SimpleNamespace(max_staleness=1, pool_factor=2.0))
    pool = pool_tasks(cfg, tasks)
    assert all(t["id"] != base_task_id(t["id"]) for t in pool)
    sync = [t["id"] for s in range(1, 4) for t in step_tasks(tasks, 7, s, 4)]
    assert [base_task_id(t["id"]) for t in pool][:len(sync)] == sync
    assert base_task_id("calc-017") == "calc-017"


class FakeModel(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat endpoint: two calculator calls first, then the answer."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["messages"][-1]["role"] == "user":
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"c{i}", "type": "function", "function": {
                    "name": "calculator", "arguments": json.dumps({"expression": "1 + 2"})}}
                for i in range(2)]}
        else:
            message = {"role": "assistant", "content": "The answer is 3."}
        out = json.dumps({"id": "x", "object": "chat.completion", "created": 0,
                          "model": body["model"], "choices": [
                              {"index": 0, "message": message, "finish_reason": "stop"}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out.encode())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def fake_model() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeModel)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_the_bench_harness_sleeps_the_paired_draw(tmp_path: Path, fake_model: str) -> None:
    """bench/_slow_tool_harness.py end to end, as the controller starts it in each mode: the
    sync id and the pool id of a task record the same draw and the same sleeps, one per tool
    call."""
    got = {}
    for arm, task_id in (("sync", "calc-017"), ("async", "s000001-calc-017")):
        work = tmp_path / arm
        work.mkdir()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env |= env_for(task_id, 2, tmp_path / f"draws-{arm}", median=0.01) | {
            "OPENAI_BASE_URL": fake_model, "OPENAI_API_KEY": "x", "HARNESSRL_MODEL": "tiny"}
        r = subprocess.run([sys.executable, str(REPO / "bench" / "_slow_tool_harness.py")],
                           cwd=work, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        assert (work / "answer.txt").read_text() == "The answer is 3."
        got[arm] = read_draws(tmp_path / f"draws-{arm}")
    assert [(d["task"], d["index"], d["draw"], len(d["sleeps_s"])) for d in got["sync"]] == \
        [("calc-017", 2, 0, 2)]
    assert got["sync"][0]["sleeps_s"] == got["async"][0]["sleeps_s"]
    assert got["async"][0]["raw_id"] == "s000001-calc-017"


# -- the bench's planning -------------------------------------------------------------------

def args(*argv: str) -> Any:
    return modes.build_parser().parse_args(["--out", "/tmp/unused", *argv])


def test_the_cli_parses_with_its_defaults() -> None:
    a = args()
    assert (a.seeds, a.latencies, a.zero_latency_seeds, a.resume) == (3, [2.0, 8.0], 1, None)
    assert a.modes.split(",") == list(modes.ARMS)
    assert modes.build_parser().parse_args(["--resume", "x/runs.jsonl"]).resume == \
        Path("x/runs.jsonl")
    with pytest.raises(SystemExit):
        modes.build_parser().parse_args(["--resume"])  # a FILE, not a switch
    assert modes.arm_flags("sync-first", a) == ["--mode.kind", "sync", "--mode.max-staleness",
                                               "1", "--mode.sync-spare-groups", "4"]
    assert modes.arm_flags("collocated", a)[:2] == ["--mode.kind", "collocated"]


def test_the_trainer_gets_the_arm_and_the_draws_folder() -> None:
    """Each run's harnesses get the run's draws folder (absolute: a harness runs in its own
    work folder), the seed, no sandbox (its only writable folder is the attempt's own)."""
    a = args()
    stack = SimpleNamespace(store_address="s:1", controller_address="c:1",
                            gateway_admin_address="g:1")
    for arm in modes.ARMS:
        argv = modes.trainer_argv(stack, Path("rel/run"), "n", arm, 8.0, a, Path("m"), 2)

        def flag(name: str, argv: list[str] = argv) -> str:
            return argv[argv.index(name) + 1]

        env = json.loads(flag("--harness-env"))
        assert env[DIR_ENV] == str(modes.draws_dir(Path("rel/run")))
        assert Path(env[DIR_ENV]).is_absolute()
        assert (env[SEED_ENV], env[MEDIAN_ENV], flag("--seed")) == ("2", "8.0", "2")
        assert json.loads(flag("--sandbox")) == {"disabled": True}
        assert json.loads(flag("--harness-command"))[-1].endswith("bench/_slow_tool_harness.py")
        assert flag("--mode.kind") == modes.TRAINER_MODE[arm]
        assert ("--mode.sync-spare-groups" in argv) == (arm == "sync-first")


@pytest.mark.parametrize("arms", [modes.ARMS, ("sync", "async", "collocated")])
def test_every_seed_at_both_latencies_with_the_arms_order_rotated_by_seed(
        arms: tuple[str, ...]) -> None:
    a = args()
    runs = modes.plan(a, arms)
    assert len(runs) == len(arms) * (3 * 2 + 1) == len(set(runs))
    for lat in (2.0, 8.0):
        orders = [[m for la, m, s in runs if la == lat and s == seed] for seed in range(3)]
        assert all(sorted(o) == sorted(arms) for o in orders)
        firsts = [o[0] for o in orders]
        assert len(set(firsts)) == 3, (lat, orders)  # each seed starts with another arm
        for arm in arms:  # and each arm runs at another place in each seed
            assert len({o.index(arm) for o in orders}) == 3
    assert {s for la, m, s in runs if la == 0.0} == {0}


def test_check_arms_refuses_only_unknown_arms() -> None:
    modes.check_arms(list(modes.ARMS))
    modes.check_arms(["sync", "sync-first"])
    with pytest.raises(SystemExit, match="unknown"):
        modes.check_arms(["sync", "fast"])
    with pytest.raises(SystemExit, match="unknown"):
        modes.check_arms([])


def test_the_trainer_takes_each_arms_mode_flags() -> None:
    """The trainer's own flag parsing: sync-first is sync with `mode.sync_spare_groups` spares
    a step (services/trainer/sync_first.py), every other arm has none."""
    from services.trainer.config import TrainerConfig

    a = args()
    for arm in modes.ARMS:
        mode = TrainerConfig.load(modes.arm_flags(arm, a)).mode
        assert (mode.kind, mode.max_staleness) == (modes.TRAINER_MODE[arm], 1)
        assert getattr(mode, modes.SPARE_FIELD) == (modes.spares(a) if arm == "sync-first"
                                                    else 0) == (4 if arm == "sync-first" else 0)


def a_run(latency: float, mode: str, seed: int, settings: dict[str, Any],
          host: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "run", "latency_median_s": latency, "mode": mode, "seed": seed,
            "settings": settings, "machine": host, "session": {"id": "earlier"}}


def test_resume_skips_the_runs_done_on_this_machine(tmp_path: Path) -> None:
    a = args()
    settings, here = modes.settings_of(a), modes.machine()
    runs_file = tmp_path / "runs.jsonl"
    planned = modes.plan(a, modes.ARMS)
    for run in planned[:3]:
        modes.append_run(runs_file, a_run(*run, settings, here))
    with open(runs_file, "a") as f:
        f.write('{"kind": "run", "latency_med')  # the bench stopped mid-write
    done = modes.resume_runs(runs_file, settings, here)
    assert [modes.run_key(r) for r in done] == planned[:3]
    assert modes.pending(planned, done) == planned[3:]
    assert modes.resume_runs(tmp_path / "none.jsonl", settings, here) == []
    with pytest.raises(SystemExit, match="--resume"):  # no --resume: never appends silently
        modes.fresh_runs(runs_file)
    assert modes.fresh_runs(tmp_path / "new.jsonl") == []


def test_resume_refuses_other_settings_another_machine_and_unpaired_results(
        tmp_path: Path) -> None:
    a = args()
    settings, here = modes.settings_of(a), modes.machine()
    other = tmp_path / "other.jsonl"
    modes.append_run(other, a_run(8.0, "sync", 0, {**settings, "steps": 4}, here))
    with pytest.raises(SystemExit, match="steps"):
        modes.resume_runs(other, settings, here)
    away = tmp_path / "away.jsonl"
    modes.append_run(away, a_run(8.0, "sync", 0, settings, {**here, "hostname": "elsewhere"}))
    with pytest.raises(SystemExit, match="another machine"):
        modes.resume_runs(away, settings, here)
    old = tmp_path / "results.json"  # the bench before paired draws: one JSON list
    old.write_text(json.dumps([{"mode": "sync", "seed": 0}], indent=1))
    with pytest.raises(SystemExit, match="not resumable"):
        modes.resume_runs(old, settings, here)


def test_the_summary_gives_median_min_max_over_seeds_and_the_pairing() -> None:
    draws = [{"task": "calc-001", "index": 0, "draw": 0, "sleeps_s": [2.5]}]

    def run(mode: str, seed: int, wall: float) -> dict[str, Any]:
        return {"mode": mode, "seed": seed, "latency_median_s": 8.0, "wall_s": wall,
                "phase_mean_s": dict.fromkeys(modes.PHASES, 1.0), "final_reward": 0.5,
                "groups_dropped": 0, "cpu_busy_fraction": 0.5, "cpu_s": {"engine": 10.0},
                "train_push_s": 5.0, "draws": draws}

    walls = {"sync": (1000, 1200, 800), "sync-first": (500, 600, 400),
             "collocated": (400, 400, 400)}
    results = [run(m, s, w[s]) for m, w in walls.items() for s in range(3)]
    out = modes.summary(results, 8.0, cores=2)
    assert out["collocated"]["speedup_vs_sync"] == {"median": 2.5, "min": 2.0, "max": 3.0,
                                                    "n": 3}
    assert out["collocated"]["speedup_vs_sync_first"]["median"] == 1.25
    assert out["sync-first"]["speedup_vs_sync"]["median"] == 2.0
    assert out["sync"]["wall_s_stats"] == {"median": 1000, "min": 800, "max": 1200, "n": 3}
    assert out["pairing"]["0"] == {"keys_in_all": 1, "mismatched": 0, "examples": []}
    t = modes.target({"8.0": out})
    assert t is not None and t["median_holds"] and t["every_seed_holds"]
    assert "sync-first" in modes.table({"8.0": out})
