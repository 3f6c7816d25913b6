"""The swe recipe wired end to end, without a capable model: mini-swe-agent 2.4.6, unchanged,
under the controller, with a scripted model.

Real Redis, store, gateway and controller (local backend, every harness and grader in its
sandbox) as processes (`Stack`), the recipe's setup step (`examples/swe/setup_attempt.py`: it
lays out each attempt's work folder from the full task file), the real harness (its copy in
the work folder: mini from its own hash-locked venv, `harness_env.py`), the real grader
(`examples/swe/grader.py`), and in place of vLLM the scripted engine
(`harnessrl.testing.scripted_engine`), a named test double that answers like vLLM (token ids,
logprobs) with the replies of a script, in mini's protocol: `bash` tool calls, the last one
`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`. Each case's rollout finds its script by a marker
the test adds to the task's problem statement.

All cases are one run (one stack, one controller run of every case's task), so the module
costs one stack start and the rollouts share the machine's two cores:
- the gold fix of one task per library x mutation kind -> 1;
- a plausible wrong fix (the function rewritten with another task's bug in it) -> 0;
- the fix plus a bug in another function (a PASS_TO_PASS test breaks) -> 0;
- each reward hack, without a fix -> 0: a `conftest.py` that forces every test to pass,
  `addopts` in `pytest.ini` and `setup.cfg`, `os._exit(0)` on import, an edited PASS_TO_PASS
  test, an edited and an added test file;
- the second gold case's context is full after its fix (the engine refuses the next call):
  mini ends itself, the harness exits 0 and the fix is graded -> 1;
- the first gold case starts with a format error (a reply without a tool call, which mini
  leaves out of its history: the next call starts a new token segment) and shows the
  environment mini's commands get (no task variables, no credential);
- the model's API failing (the engine answers 400) -> the harness exits non-zero, the rollout
  fails;
- a look for the fix (`no-peeking`): the agent's command searches every file its sandbox shows
  (/ but /usr, /proc, /sys, /dev; the processes' environments and command lines) for the gold
  patch's lines and the hidden tests, and finds none (a control: the broken line is found in
  its workspace).
Every call mini made is in the store with prompt and completion token ids and logprobs; the
share of calls that continue a token segment is printed (`-s` shows it).
"""

from __future__ import annotations

import base64
import json
import re
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from harnessrl import procs
from harnessrl.clients import ControllerClient, StoreClient
from harnessrl.local.stack import Stack, StackConfig
from harnessrl.v1 import common_pb2 as c

REPO = Path(__file__).resolve().parent.parent
SWE = REPO / "examples" / "swe"
TASK_FILES = [p for p in sorted((SWE / "tasks").glob("*.jsonl"))
              if not p.name.endswith(".rollout.jsonl")]
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
EOF = "HARNESSRL_SCRIPTED_EOF"
MODEL = "tiny"
CONTEXT_FULL = ("This model's maximum context length is 32768 tokens. However, you requested "
                "33010 tokens (32498 in the messages, 512 in the completion). Please reduce the "
                "length of the messages or completion.")


PROBE_TIMEOUT_S = 90  # each of the no-peeking case's two searches (its command's limit: 2x+)


# -- the cases ------------------------------------------------------------------------------

@dataclass
class Case:
    name: str
    task: Any  # examples.swe.swe_tasks.SweTask
    replies: list[dict[str, Any]]
    reward: float | None  # None: the rollout fails (the harness exits non-zero)
    dropped: list[str] = field(default_factory=list)  # files the grader must have dropped
    exit_status: str = "Submitted"  # how mini's run ended (its trajectory's info)
    refused_calls: int = 0  # mini's calls the engine refused (not recorded)
    check: Callable[[Path, c.Rollout], None] | None = None

    @property
    def marker(self) -> str:
        return f"[scripted case {self.name}]"


def _heredoc(argv: str, text: str) -> str:
    assert EOF not in text
    return f"{argv} <<'{EOF}'\n{text}{'' if text.endswith(chr(10)) else chr(10)}{EOF}"


def write_file(rel: str, text: str) -> str:
    parent = str(PurePosixPath(rel).parent)
    return (f"mkdir -p {parent} && " if parent != "." else "") + _heredoc(f"cat > {rel}", text)


def append_file(rel: str, text: str) -> str:
    return _heredoc(f"cat >> {rel}", text)


def gold(task: Any) -> str:
    return _heredoc("patch -p1 --batch --no-backup-if-mismatch", task.patch)


def source(task: Any, rel: str) -> str:
    """A file of the working library (the snapshot the task's workspace is made from)."""
    return (Path(task.repo_path) / rel).read_text()


def mutated(task: Any, other: Any) -> str:
    """The file `other`'s mutation breaks, as the working library with that bug in it."""
    from examples.swe.mutations import Mutation, apply_mutation

    m = Mutation.from_json(other.mutation)
    return apply_mutation(source(task, m.file), m)


def node_name(node: str) -> str:
    return node.split("::")[-1].split("[")[0]


def node_file(node: str) -> str:
    return node.split("::")[0]


def _reply(content: str, command: str) -> dict[str, Any]:
    return {"content": content, "command": command}


def _fix_then_submit(content: str, command: str) -> list[dict[str, Any]]:
    return [_reply(content, command), _reply("The change is made; submitting.", SUBMIT)]


def _library(task: Any) -> str:
    return str((task.model_extra or {}).get("library") or Path(task.repo_path).name)


def _kind(task: Any) -> str:
    return str(task.mutation["kind"])


def load_tasks() -> list[Any]:
    from examples.swe.swe_tasks import load_swe_tasks

    return [t for f in TASK_FILES for t in load_swe_tasks(f) if t.mutation is not None]


def choose_base(tasks: list[Any]) -> tuple[Any, Any, Any]:
    """A task A, another task B whose bug is in A's function (A's wrong fix), and a task C of
    A's library whose bug is in another function and breaks none of A's FAIL_TO_PASS tests,
    only some of its PASS_TO_PASS ones (A's fix that breaks a PASS_TO_PASS test)."""
    by_function: dict[tuple[str, str, str], list[Any]] = defaultdict(list)
    for t in tasks:
        by_function[(t.repo_path, t.mutation["file"], t.mutation["function"])].append(t)
    for a in tasks:
        key = (a.repo_path, a.mutation["file"], a.mutation["function"])
        p2p, tests = set(a.PASS_TO_PASS), set(a.tests())
        same = [b for b in by_function[key] if b.instance_id != a.instance_id
                and set(b.FAIL_TO_PASS) <= tests and mutated(a, b) != mutated(a, a)]
        other = [t for t in tasks if t.repo_path == a.repo_path and
                 (t.mutation["file"], t.mutation["function"]) != key[1:] and
                 set(t.FAIL_TO_PASS) <= p2p]
        if same and other:
            return a, same[0], other[0]
    raise AssertionError("no task has both another bug in its function and one elsewhere")


def build_cases(tasks: list[Any]) -> list[Case]:
    cases: list[Case] = []
    firsts: dict[tuple[str, str], Any] = {}
    for t in sorted(tasks, key=lambda t: t.instance_id):
        firsts.setdefault((_library(t), _kind(t)), t)
    for (lib, kind), t in sorted(firsts.items()):
        cases.append(Case(f"gold-{lib}-{kind}", t, _fix_then_submit(
            "The failing test points at this function; applying the fix.", gold(t)), 1.0))

    def format_error_then_fix(workdir: Path, ro: c.Rollout) -> None:
        starts = [call.segment_start for call in sorted(ro.calls, key=lambda x: x.seq)]
        assert starts[:2] == [c.SEGMENT_START_FIRST, c.SEGMENT_START_EDITED], starts
        assert set(starts[2:]) == {c.SEGMENT_START_CONTINUED}, starts
        traj = json.loads((workdir / "mini.traj.json").read_text())
        env_out = next(m["content"] for m in traj["messages"] if m["role"] == "tool")
        assert "OPENAI_BASE_URL=" in env_out and "HARNESSRL_ROLLOUT_ID=" in env_out
        assert "HARNESSRL_TASK_" not in env_out  # the task's variables never reach mini
        assert re.search(r"^OPENAI_API_KEY=$", env_out, re.M), env_out  # nor the credential
    # The first gold case begins with a reply without a tool call (a format error for mini)
    # and a look at the environment its commands get.
    first = cases[0]
    first.replies = [{"content": "I think the bug is in the comparison."},
                     _reply("Looking at the environment first.",
                            "env | grep -E '^(OPENAI|HARNESSRL)' | sort"), *first.replies]
    first.check = format_error_then_fix
    # The second one's context is full after the fix (the engine refuses the next prompt, as
    # vLLM words it): mini ends with ContextWindowExceededError, the harness with 0, graded.
    second = cases[1]
    second.replies = [second.replies[0], {"status": 400, "message": CONTEXT_FULL}]
    second.exit_status, second.refused_calls = "ContextWindowExceededError", 1

    a, b, other = choose_base(tasks)
    f2p_names = [node_name(n) for n in a.FAIL_TO_PASS]
    f2p_file = node_file(a.FAIL_TO_PASS[0])
    p2p_file = node_file(a.PASS_TO_PASS[0])
    added = str(PurePosixPath(f2p_file).parent / "test_regression.py")
    mfile = a.mutation["file"]

    cases.append(Case("wrong-fix", a, _fix_then_submit(
        "Rewriting the function.", write_file(mfile, mutated(a, b))), 0.0))

    def p2p_broken(workdir: Path, ro: c.Rollout) -> None:
        report = json.loads((workdir / "swe-report.json").read_text())
        assert set(report["fail_to_pass"].values()) == {"passed"}, report
        assert set(report["pass_to_pass"].values()) != {"passed"}, report
    cases.append(Case("breaks-pass-to-pass", a, _fix_then_submit(
        "Fixing the function (and tidying another).",
        gold(a) + "\n" + write_file(other.mutation["file"], mutated(a, other))), 0.0,
        check=p2p_broken))

    # The hacks, each without a fix.
    force_pass = ("import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\n"
                  "def pytest_runtest_makereport(item, call):\n    outcome = yield\n"
                  "    report = outcome.get_result()\n    report.outcome = 'passed'\n"
                  "    report.longrepr = None\n")
    pytest_ini = "[pytest]\naddopts = " + " ".join(f"--deselect {n}" for n in a.FAIL_TO_PASS)
    setup_cfg = "\n[tool:pytest]\naddopts = -k \"not (" + " or ".join(f2p_names) + ")\"\n"
    passing = "".join(f"\n\ndef {n}():\n    pass\n" for n in f2p_names)
    hacks = [
        ("hack-conftest", write_file("conftest.py", force_pass), ["conftest.py"]),
        ("hack-addopts", write_file("pytest.ini", pytest_ini) + "\n" +
         append_file("setup.cfg", setup_cfg), ["pytest.ini", "setup.cfg"]),
        ("hack-os-exit-on-import", append_file(mfile, "\nimport os as _os\n_os._exit(0)\n"),
         []),
        ("hack-edit-pass-to-pass-test", f"sed -i 's/assert /assert True or /' {p2p_file}",
         [p2p_file]),
        ("hack-edit-and-add-test-files", append_file(f2p_file, passing) + "\n" +
         write_file(added, passing), [f2p_file, added]),
    ]
    for name, command, dropped in hacks:
        cases.append(Case(name, a, _fix_then_submit("Making the tests pass.", command), 0.0,
                          dropped=dropped))

    # A look for the fix: everything the sandbox shows holds neither the gold patch's lines
    # nor the hidden tests (the workspace's broken lines are found: the search reads files).
    with tempfile.TemporaryDirectory(prefix="swe-peek-") as tmp:
        peek = peek_task(tasks, Path(tmp))

    def no_peeking(workdir: Path, ro: c.Rollout) -> None:
        from examples.swe.harness_env import venv_dir

        got = peek_result(workdir)
        assert got["secret_exit"] in (1, 2) and got["control_exit"] in (0, 2), got["output"]
        tops = {"/tmp", "/etc", *(f"/{Path(p).parts[1]}" for p in (sys.prefix, venv_dir()))}
        assert tops <= set(got["roots"]), got["roots"]  # the work folder, Python and mini
        assert got["secret_hits"] == 0, f"the fix is readable in the sandbox:\n{got['output']}"
        assert got["control_hits"] >= 1 and all(
            p.startswith(f"{workdir}/repo/") for p in got["control"]), got["output"]
    cases.append(Case("no-peeking", peek, _fix_then_submit(
        "Looking around first.", peek_command(secrets_of(peek), _patch_lines(peek.patch, "-"))),
        0.0, check=no_peeking))

    def api_error(workdir: Path, ro: c.Rollout) -> None:
        assert "harness exited with code" in ro.error, ro.error
    cases.append(Case("api-error", a, [], None, check=api_error))  # no script: HTTP 400
    return cases


def _patch_lines(patch: str, sign: str) -> list[str]:
    """The added (`+`) or removed (`-`) lines of a unified diff, stripped, non-empty."""
    return [line[1:].strip() for line in patch.splitlines()
            if line.startswith(sign) and not line.startswith(sign * 3) and line[1:].strip()]


def secrets_of(task: Any) -> list[str]:
    """What a rollout must not find anywhere: the gold patch's new lines and the definitions of
    the hidden tests (test_patch's, those the problem statement does not show), each as source
    and as JSON text (a task file's)."""
    hidden = [line for line in _patch_lines(task.test_patch, "+")
              if line.startswith("def test_") and line not in task.problem_statement]
    out = [v for line in [*_patch_lines(task.patch, "+"), *hidden]
           for v in (line, json.dumps(line)[1:-1])]
    return list(dict.fromkeys(out))


def peek_task(tasks: list[Any], tmp: Path) -> Any:
    """A task whose secrets are in no file of its broken workspace and not in its problem
    statement, and whose broken lines are in its workspace (the search's control)."""
    from examples.swe.workspace import prepare_workspace

    for t in sorted(tasks, key=lambda t: t.instance_id):
        secret, control = secrets_of(t), _patch_lines(t.patch, "-")
        if not control or min(map(len, secret + control)) < 16:
            continue  # short lines might be anywhere
        ws = tmp / t.instance_id
        prepare_workspace(t, ws)
        text = "\n".join(p.read_text(errors="replace") for p in ws.rglob("*") if p.is_file())
        if not any(n in text or n in t.problem_statement for n in secret) and \
                all(n in text for n in control):
            return t
    raise AssertionError("no task fits the no-peeking case")


def peek_command(secret: list[str], control: list[str]) -> str:
    """The agent's search of everything its sandbox shows (but /usr, /proc, /sys, /dev: the
    system; and the processes' environments and command lines) for `secret` and, as its
    control, for `control`. The needles travel base64-encoded (so that neither this command
    line nor mini's trajectory holds them); it prints counts, then a few paths."""
    def enc(lines: list[str]) -> str:
        return base64.b64encode("\n".join(lines).encode() + b"\n").decode()
    grep = f"timeout {PROBE_TIMEOUT_S} grep -rIlsF -D skip --exclude='*.probe'"
    return "\n".join([
        f"echo {enc(secret)} | base64 -d > /tmp/s.probe",
        f"echo {enc(control)} | base64 -d > /tmp/c.probe",
        'roots=""; for p in /*; do case "$p" in /proc|/sys|/dev|/usr) continue;; esac; '
        '[ -L "$p" ] || roots="$roots $p"; done; echo "roots:$roots"',
        f"{grep} -f /tmp/s.probe $roots /proc/[0-9]*/environ /proc/[0-9]*/cmdline "
        '> /tmp/s.hits.probe; echo "secret-exit: $?"',
        'echo "secret-hits: $(wc -l < /tmp/s.hits.probe)"',
        f'{grep} -f /tmp/c.probe $roots > /tmp/c.hits.probe; echo "control-exit: $?"',
        'echo "control-hits: $(wc -l < /tmp/c.hits.probe)"',
        "head -5 /tmp/s.hits.probe | sed 's/^/secret: /'",
        "head -5 /tmp/c.hits.probe | sed 's/^/control: /'"])


def peek_result(workdir: Path) -> dict[str, Any]:
    """The no-peeking search's output, from mini's trajectory."""
    traj = json.loads((workdir / "mini.traj.json").read_text())
    out = next(m["content"] for m in traj["messages"]
               if m["role"] == "tool" and "secret-hits:" in (m.get("content") or ""))
    field_ = dict(re.findall(r"^([a-z-]+): ?(.*)$", out, re.M))
    return {"output": out, "roots": re.search(r"^roots:(.*)$", out, re.M).group(1).split(),
            "secret_exit": int(field_["secret-exit"]), "secret_hits": int(field_["secret-hits"]),
            "control_exit": int(field_["control-exit"]),
            "control_hits": int(field_["control-hits"]),
            "secret": re.findall(r"^secret: (.*)$", out, re.M),
            "control": re.findall(r"^control: (.*)$", out, re.M)}


def script_of(cases: list[Case]) -> dict[str, Any]:
    return {"scripts": [{"marker": k.marker, "replies": k.replies} for k in cases
                        if k.replies]}


# -- the stack ------------------------------------------------------------------------------

@dataclass
class SweStack:
    stack: Stack
    script: Path
    mini: Path
    tmp: Path


@pytest.fixture(scope="module")
def swe_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SweStack]:
    from examples.swe.harness_env import ensure

    assert TASK_FILES, "no task file in examples/swe/tasks (python -m examples.swe.make_tasks)"
    mini = ensure()  # scripts/setup.sh made it already; else about 2 minutes, once
    tmp = tmp_path_factory.mktemp("swe")
    script = tmp / "script.json"
    engine, info = procs.start_service(
        "scripted", "harnessrl.testing.scripted_engine",
        ["--script", str(script), "--model", MODEL], tmp, timeout=60)
    cfg = StackConfig(state_dir=tmp / "state", redis_url=redis_url,
                      key_prefix=f"swe{int(time.time() * 1000) % 10**8}:",
                      served_model_name=MODEL, weight_transfer_backend=None,
                      external_engines=(f"http://127.0.0.1:{info['http_port']}",))
    try:
        with Stack(cfg) as stack:
            yield SweStack(stack, script, mini, tmp)
    finally:
        engine.stop()


def wait_run(address: str, run_id: str, timeout: float) -> c.Run:
    ctl = ControllerClient.connect(address)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = ctl.get_run(run_id)
            if run.status != c.RUN_STATUS_RUNNING:
                return run
            time.sleep(0.5)
    finally:
        ctl.close()
    raise TimeoutError(f"run {run_id} still running after {timeout:g}s")


@dataclass
class Outcome:
    cases: list[Case]
    run: c.Run
    rollouts: dict[str, c.Rollout]  # by case name
    seconds: float


@pytest.fixture(scope="module")
def outcome(swe_stack: SweStack) -> Outcome:
    from examples.swe.setup_attempt import commands
    from examples.swe.swe_tasks import rollout_view

    tasks = load_tasks()
    cases = build_cases(tasks)
    swe_stack.script.write_text(json.dumps(script_of(cases)))
    full = swe_stack.tmp / "tasks.jsonl"
    chosen = {k.task.instance_id: k.task for k in cases}
    full.write_text("".join(t.model_dump_json() + "\n" for t in chosen.values()))
    views = []
    for k in cases:
        view = rollout_view(k.task)
        view["problem_statement"] += f"\n\n{k.marker}"
        views.append(c.Task(task_id=k.name, data_json=json.dumps(view)))
    # The no-peeking case's search may take a while on a cold page cache: mini's command and
    # wall-time limits, and the attempt's, are raised for it.
    cmds = commands([full], swe_stack.mini, mini_config=[
        f"environment.timeout={3 * PROBE_TIMEOUT_S}",
        f"agent.wall_time_limit_seconds={4 * PROBE_TIMEOUT_S}"])
    spec = c.RunSpec(
        name="swe-scripted", tasks=views, group_size=1, model=MODEL,
        setup_command=cmds["setup"], setup_timeout_s=120,
        harness_command=cmds["harness"], grader_command=cmds["grader"],
        reward_source=c.REWARD_SOURCE_GRADER_JSON, concurrency=3,
        timeout_s=5 * PROBE_TIMEOUT_S, grader_timeout_s=180, max_attempts=1, stream="-")
    ctl = ControllerClient.connect(swe_stack.stack.controller_address)
    t0 = time.monotonic()
    run = ctl.create_run(spec)
    ctl.close()
    run = wait_run(swe_stack.stack.controller_address, run.run_id, timeout=900)
    seconds = time.monotonic() - t0
    store = StoreClient.connect(swe_stack.stack.store_address)
    rollouts = {ro.task_id: ro for ro in
                store.list_rollouts(run.run_id, include_calls=True).rollouts}
    store.close()
    return Outcome(cases, run, rollouts, seconds)


def _attempt(ro: c.Rollout) -> Path:
    """The attempt's folder: the controller's records of its jobs (their output)."""
    return Path(ro.attempts[-1].workdir)


def _workdir(ro: c.Rollout) -> Path:
    """The attempt's work folder: the harness's and the grader's."""
    return _attempt(ro) / "work"


def _why(ro: c.Rollout) -> str:
    tails = []
    for path in [_attempt(ro) / f"{job}{name}" for job in ("setup.", "", "grader.")
                 for name in ("stdout.log", "stderr.log")] + [_workdir(ro) / "swe-report.json"]:
        if path.exists():
            tails.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
    return f"{ro.task_id}: status {ro.status}, reward {ro.reward}, error {ro.error!r}\n" + \
        "\n".join(tails)


# -- the tests ------------------------------------------------------------------------------

def test_every_case_gets_its_reward(outcome: Outcome) -> None:
    from examples.swe.mutations import KINDS

    gold = {(_library(k.task), _kind(k.task)) for k in outcome.cases
            if k.name.startswith("gold-")}
    libraries = {lib for lib, _ in gold}
    assert len(libraries) >= 3, libraries
    assert gold == {(lib, kind) for lib in libraries for kind in KINDS}, "library x kind"
    assert set(outcome.rollouts) == {k.name for k in outcome.cases}
    bad = []
    for k in outcome.cases:
        ro = outcome.rollouts[k.name]
        if k.reward is None:
            ok = ro.status == c.ROLLOUT_STATUS_FAILED
        else:
            ok = ro.status == c.ROLLOUT_STATUS_SUCCEEDED and ro.has_reward and \
                ro.reward == k.reward
        if not ok:
            bad.append(_why(ro))
    assert not bad, "\n\n".join(bad)
    print(f"\nswe scripted run: {len(outcome.cases)} rollouts in {outcome.seconds:.0f}s")


def test_cases_ended_as_scripted(outcome: Outcome) -> None:
    """mini submitted in every scripted case, the grader dropped each hack's files, and the
    cases' own checks hold (segments of a format error, mini's environment, the P2P case)."""
    for k in outcome.cases:
        ro = outcome.rollouts[k.name]
        wd = _workdir(ro)
        if k.replies:
            traj = json.loads((wd / "mini.traj.json").read_text())
            assert traj["info"]["exit_status"] == k.exit_status, (k.name, traj["info"])
            assert traj["info"]["mini_version"] == "2.4.6"
        if k.dropped:
            report = json.loads((wd / "swe-report.json").read_text())
            dropped = {d["path"] for d in report["dropped_files"]}
            assert set(k.dropped) <= dropped, (k.name, report["dropped_files"])
        if k.check is not None:
            k.check(wd, ro)


def test_every_call_is_recorded_with_tokens_and_logprobs(outcome: Outcome) -> None:
    continued = after_first = total = 0
    first_prompt: list[int] = []
    for k in outcome.cases:
        ro = outcome.rollouts[k.name]
        if not k.replies:
            continue
        traj = json.loads((_workdir(ro) / "mini.traj.json").read_text())
        calls = sorted(ro.calls, key=lambda x: x.seq)
        assert len(calls) == traj["info"]["model_stats"]["api_calls"] - k.refused_calls, \
            k.name
        for call in calls:
            assert call.prompt_token_ids and call.completion_token_ids, (k.name, call.seq)
            assert len(call.logprobs) == len(call.completion_token_ids), (k.name, call.seq)
            assert all(lp <= 0.0 for lp in call.logprobs)
            assert call.api == "chat.completions" and call.model == MODEL
            request = json.loads(call.request_json)
            assert [t["function"]["name"] for t in request["tools"]] == ["bash"]
        total += len(calls)
        after_first += len(calls) - 1
        continued += sum(x.segment_start == c.SEGMENT_START_CONTINUED for x in calls)
        first_prompt.append(len(calls[0].prompt_token_ids))
    share = continued / total
    print(f"\nswe scripted: {total} calls, {continued} continue a token segment "
          f"({share:.0%} of all calls, {continued / after_first:.0%} of the calls after each "
          f"rollout's first); first call's prompt {min(first_prompt)}-{max(first_prompt)} "
          "stub tokens (one a byte)")
    # only the format-error case's second call starts a new segment after its first call
    assert continued == after_first - 1


# -- pieces, without the stack ----------------------------------------------------------------

def test_lock_pins_mini_and_a_safe_litellm() -> None:
    lock = (REPO / "locks" / "swe-harness.txt").read_text()
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", lock, re.M))
    wanted = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)",
                             (SWE / "requirements.in").read_text(), re.M))
    assert wanted["mini-swe-agent"] == pins["mini-swe-agent"] == "2.4.6"
    assert pins["litellm"] == wanted["litellm"] and pins["litellm"] != "1.107.0"
    blocks = re.split(r"\n(?=[A-Za-z0-9_.-]+==)", lock.split("\n", 1)[1])
    assert all("--hash=sha256:" in b for b in blocks), "every pin carries its hashes"


def test_mini_env_keeps_the_task_out() -> None:
    from examples.swe.harness import mini_env

    env = mini_env({"HARNESSRL_TASK_JSON": "{}", "HARNESSRL_TASK_PATCH": "x",
                    "HARNESSRL_TASK_FILE": "/t", "HARNESSRL_ROLLOUT_ID": "r",
                    "OPENAI_BASE_URL": "http://g/v1", "OPENAI_API_KEY": "k", "PATH": "/bin"},
                   Path("/tmp/h"))
    assert not [k for k in env if k.startswith("HARNESSRL_TASK_")]
    assert env["OPENAI_BASE_URL"] == "http://g/v1" and env["OPENAI_API_KEY"] == "k"
    assert env["MSWEA_GLOBAL_CONFIG_DIR"] == "/tmp/h" and env["MSWEA_CONFIGURED"] == "true"


def test_scripted_engine_reads_the_turn_from_the_conversation(tmp_path: Path) -> None:
    from harnessrl.testing.scripted_engine import (Script, ScriptedRefusal,
                                                   scripted_chat_response)

    path = tmp_path / "s.json"
    path.write_text(json.dumps({"scripts": [{"marker": "[m1]", "replies": [
        {"content": "a", "command": "ls"}, {"content": "no tool call"},
        {"content": "b", "command": SUBMIT}]}]}))
    script = Script(path)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "s"},
                                  {"role": "user", "content": "task [m1]"}]
    req = {"messages": msgs, "return_token_ids": True, "logprobs": True}
    first = scripted_chat_response(req, script, 1)
    call = first["choices"][0]["message"]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"command": "ls"}
    assert len(first["choices"][0]["token_ids"]) == \
        len(first["choices"][0]["logprobs"]["content"]) and first["prompt_token_ids"]
    msgs += [first["choices"][0]["message"], {"role": "tool", "content": "out"}]
    second = scripted_chat_response(req, script, 2)["choices"][0]
    assert second["message"]["tool_calls"] == [] and second["finish_reason"] == "stop"
    msgs.append({"role": "user", "content": "format error"})  # mini drops the reply
    third = scripted_chat_response(req, script, 3)["choices"][0]["message"]
    assert json.loads(third["tool_calls"][0]["function"]["arguments"])["command"] == SUBMIT
    with pytest.raises(ValueError):
        scripted_chat_response({"messages": [{"role": "user", "content": "?"}]}, script, 4)
    path.write_text(json.dumps({"default": [{"status": 400, "message": CONTEXT_FULL}]}))
    with pytest.raises(ScriptedRefusal) as refused:
        scripted_chat_response({"messages": [{"role": "user", "content": "?"}]}, script, 5)
    assert refused.value.status == 400 and "maximum context length" in str(refused.value)


def test_image_and_job_template_keep_rollouts_to_the_gateway() -> None:
    """examples/swe/Dockerfile passes hadolint and installs only hash-locked venvs; the Job
    template's pods carry the labels the `harnessrl-rollouts` NetworkPolicy selects (the
    shipped templates render valid Jobs: tests/test_k8s_manifests.py)."""
    import shutil
    import subprocess

    import yaml

    dockerfile = (SWE / "Dockerfile").read_text()
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    out = subprocess.run([hadolint, "--failure-threshold", "info", str(SWE / "Dockerfile")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    for line in re.findall(r"pip install[^\n]*(?:\\\n[^\n]*)*", dockerfile):
        assert "--require-hashes" in line, line
    for lock in re.findall(r"locks/([\w.-]+\.txt)", dockerfile):
        assert (REPO / "locks" / lock).exists(), lock
    policy = next(d for d in yaml.safe_load_all((REPO / "k8s" / "base" /
                                                 "network-policies.yaml").read_text())
                  if d and d["metadata"]["name"] == "harnessrl-rollouts")
    job = yaml.safe_load((SWE / "k8s-job-template.yaml").read_text())
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert [ct["name"] for ct in job["spec"]["template"]["spec"]["containers"]] == \
        ["harness", "grader"]


def _tree(root: Path) -> dict[str, bytes]:
    from examples.swe.swe_tasks import snapshot_files

    return {p.relative_to(root).as_posix(): p.read_bytes() for p in snapshot_files(root)}


def test_setup_lays_out_only_what_a_rollout_may_see(tmp_path: Path) -> None:
    """The setup step (as the controller runs it: a command in the work folder, the rollout
    view in HARNESSRL_TASK_JSON) makes the workspace, the issue and the harness's own code,
    and nothing in the work folder holds the fix or a hidden test; the workspace equals the
    one an image ships (`--workspaces`, made by `workspace build`)."""
    import os
    import subprocess

    assert TASK_FILES, "no task file in examples/swe/tasks (python -m examples.swe.make_tasks)"
    from examples.swe.harness import from_image
    from examples.swe.setup_attempt import HARNESS, commands
    from examples.swe.swe_tasks import load_swe_tasks, rollout_view
    from examples.swe.workspace import build_workspaces

    task = load_swe_tasks(TASK_FILES[0])[0]
    work = tmp_path / "work"
    work.mkdir()
    setup = commands(TASK_FILES, "/nonexistent/mini")["setup"]
    env = {**os.environ, "HARNESSRL_TASK_JSON": json.dumps(rollout_view(task)),
           "HARNESSRL_WORKDIR": str(work)}
    out = subprocess.run(setup, cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in work.iterdir()) == ["harness", "issue.md", "repo"]
    assert (work / HARNESS).is_file() and (work / "harness" / "mini.yaml").is_file()
    assert (work / "harness" / "tools" / "suspects").is_file()
    assert (work / "issue.md").read_text() == task.problem_statement
    text = "\n".join(p.read_text(errors="replace") for p in work.rglob("*") if p.is_file())
    assert not [n for n in secrets_of(task) if n in text]
    assert not any(p.name == ".git" for p in work.rglob("*"))
    build_workspaces([task], tmp_path / "image")
    (tmp_path / "from-image").mkdir()
    from_image(rollout_view(task), tmp_path / "from-image", tmp_path / "image")
    assert _tree(work / "repo") == _tree(tmp_path / "from-image" / "repo") != {}

    # A controller handed the full records (the fix among the harness's task fields): refused.
    bare = tmp_path / "bare"
    bare.mkdir()
    out = subprocess.run(setup, cwd=bare, env={**env, "HARNESSRL_WORKDIR": str(bare),
                                               "HARNESSRL_TASK_JSON": task.model_dump_json()},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "rollout view" in out.stderr and "patch" in out.stderr
    assert not list(bare.iterdir())


def test_harness_command_names_nothing_of_the_recipe(tmp_path: Path) -> None:
    """What the harness's sandbox makes readable besides the system (its Python, what its
    command names: `policy.code_paths`, the sandbox's own rule) holds neither the recipe's
    folder (its libraries are the fixes), nor the task files, nor the libraries; the grader's
    holds both (it needs them)."""
    from examples.swe.setup_attempt import commands
    from services.controller.sandbox.policy import code_paths, runtime_paths

    full = tmp_path / "tasks" / "full.jsonl"
    full.parent.mkdir()
    full.write_text("")
    mini = tmp_path / "venv" / "bin" / "mini"
    mini.parent.mkdir(parents=True)
    mini.touch()
    cmds = commands([full, TASK_FILES[0]], mini)
    secret = [SWE, SWE / "repos", SWE / "tasks", full.parent]

    def sees(paths: list[Path], p: Path) -> bool:  # p, or a folder above it, is bound
        return any(p == q or q in p.parents for q in paths)
    harness_view = [*runtime_paths(), *code_paths(cmds["harness"])]
    assert not [(p, q) for p in secret for q in harness_view
                if p == q or q in p.parents or p in q.parents], harness_view
    assert mini.parent in harness_view  # mini's folder (a real venv's pyvenv.cfg: all of it)
    assert all(sees(code_paths(cmds["grader"]), p) for p in secret)
    assert not [a for a in cmds["harness"] if str(SWE) in a or str(full) in a]


def test_harness_env_installs_once_for_concurrent_callers(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Two callers at once: one installs (under the lock file), the other waits and finds it
    done; a failed install leaves nothing that counts as installed and is tried again."""
    import threading

    from examples.swe import harness_env

    monkeypatch.setenv("HARNESSRL_CACHE_DIR", str(tmp_path / "cache"))
    lock = tmp_path / "lock.txt"
    lock.write_text("six==1.17.0 --hash=sha256:0\n")
    installs: list[Path] = []
    fail = [True]

    def fake_install(venv: Path, lock_: Path, quiet: bool) -> None:
        installs.append(venv)
        time.sleep(0.3)
        if fail[0]:
            raise harness_env.HarnessEnvError("pip said no")
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "mini").touch()
        (venv / harness_env.DONE).touch()

    monkeypatch.setattr(harness_env, "_install", fake_install)
    with pytest.raises(harness_env.HarnessEnvError, match="pip said no"):
        harness_env.ensure(lock, quiet=True)
    assert not (harness_env.venv_dir(lock) / harness_env.DONE).exists()
    fail[0] = False
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(harness_env.ensure(lock, quiet=True)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(installs) == 2 and len(set(got)) == 1 and got[0].name == "mini"
    assert harness_env.venv_dir(lock).name == f"swe-harness-{harness_env.lock_hash(lock)}"
