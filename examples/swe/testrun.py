"""How the SWE example runs a repository's tests: pytest with the grader's own configuration,
outcomes read from a JUnit XML file of its own.

`run_tests(repo, tests)` runs one session; `TestRunner` runs many (the task builder, the task
set's validation) through a fork server (`pytest_forkserver.py`): one process imports pytest
once and forks a child per session, which then imports the code under test afresh. A session
is the same either way: `python -I -B` (no user site, no environment variables of Python's,
no bytecode written into the repository), `-c` an ini file outside the repository (so its
`pytest.ini`, `setup.cfg`, `tox.ini` or `pyproject.toml` and their `addopts` are never read)
that puts the repository on `sys.path`, the cache plugin off, installed plugins not loaded
unless asked (`plugins`), `PYTEST_*` variables cleared, and a time limit after which the
session's whole process group is killed.

By default (`sandbox=True`) the fork server and every session run in the nested sandbox of
`harnessrl.graders.nested_sandbox`: the tests run the agent's code, and there it sees no task
file, none of the grader's processes or output, no network; after each session every process
it left is killed. The runner's scratch folder (`scratch()`: the repository copies, the
report files) is the one writable folder the sandbox shares with the grader. Reports are read
without following links and up to `MAX_REPORT_BYTES`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harnessrl.graders.nested_sandbox import NestedSandbox

DEFAULT_TIMEOUT_S = 120.0
MAX_REPORT_BYTES = 32 << 20
FORKSERVER = Path(__file__).resolve().with_name("pytest_forkserver.py")


@dataclass
class TestRun:
    __test__ = False  # (not a test class, for pytest)
    outcomes: dict[str, str]  # node id -> passed | failed | error | skipped
    messages: dict[str, str]  # node id -> the failure's text
    exit_code: int | None  # None: killed at its time limit
    timed_out: bool
    duration_s: float
    output_tail: str


class TestRunner:
    """Runs test sessions one after another through one fork server (see the module
    docstring); one session at a time per runner (use one runner per thread). `sandbox`: run
    them in the nested sandbox, with `hide` (the task files) masked in it."""

    __test__ = False  # (not a test class, for pytest)

    def __init__(self, python: str = sys.executable, plugins: bool = False, *,
                 sandbox: bool = True, hide: Iterable[Path] = ()):
        self.python, self.plugins = python, plugins
        self.root = Path(tempfile.mkdtemp(prefix="swe-runner-")).resolve()
        self.sandbox: NestedSandbox | None = None
        if sandbox:
            try:
                self.sandbox = NestedSandbox(python, self.root, hide=hide, files=[FORKSERVER])
                self.sandbox.check()
            except BaseException:
                shutil.rmtree(self.root, ignore_errors=True)
                raise
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def scratch(self, prefix: str = "swe-") -> tempfile.TemporaryDirectory[str]:
        """A folder the test sessions may read and write (a repository copy goes here)."""
        return tempfile.TemporaryDirectory(prefix=prefix, dir=self.root)

    def _server(self) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:
            env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
            extra = {} if self.plugins else {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
            argv = [self.python, "-I", "-B", str(FORKSERVER)]
            if self.sandbox is not None:
                argv = self.sandbox.argv([self.python, "-I", "-B",
                                          self.sandbox.inside(FORKSERVER), "--reap"], extra)
            self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          text=True, env={**env, **extra},
                                          start_new_session=True)
        return self._proc

    def run(self, repo: Path, tests: list[str], *,
            timeout_s: float = DEFAULT_TIMEOUT_S) -> TestRun:
        """Runs `tests` (pytest node ids; all of them when empty) in `repo`."""
        repo = repo.resolve()
        if self.sandbox is not None and self.root not in repo.parents:
            raise ValueError(f"{repo} is not in the runner's scratch folder {self.root}: the "
                             f"sandboxed tests see only that (copy it into scratch())")
        with self._lock, self.scratch("swe-tests-") as tmp:
            ini, xml, out = Path(tmp) / "pytest.ini", Path(tmp) / "junit.xml", Path(tmp) / "out"
            ini.write_text(f"[pytest]\npythonpath = {repo}\njunit_family = xunit1\naddopts =\n")
            args = ["-c", str(ini), "--rootdir", str(repo), "-p", "no:cacheprovider", "-q",
                    "--no-header", f"--junitxml={xml}", *(tests or ["."])]
            start = time.monotonic()
            server = self._server()
            assert server.stdin is not None and server.stdout is not None
            try:
                server.stdin.write(json.dumps({"cwd": str(repo), "args": args, "out": str(out),
                                               "timeout_s": timeout_s}) + "\n")
                server.stdin.flush()
                answer = server.stdout.readline()
            except BrokenPipeError:
                answer = ""
            if not answer:  # the server died (a test run can kill its parent): not graded
                self.close()
                raise RuntimeError(f"the test runner ended while running tests in {repo}")
            reply = json.loads(answer)
            outcomes, messages = read_junit(xml)
            tail = read_own(out, MAX_REPORT_BYTES).decode(errors="replace")[-4000:]
            return TestRun(outcomes, messages, reply["exit_code"], reply["timed_out"],
                           time.monotonic() - start, tail)

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.stdin:
                self._proc.stdin.close()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            if self._proc.stdout:
                self._proc.stdout.close()
            self._proc = None
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> TestRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_tests(repo: Path, tests: list[str], *, timeout_s: float = DEFAULT_TIMEOUT_S,
              python: str = sys.executable, plugins: bool = False,
              sandbox: bool = False) -> TestRun:
    """One test session (see `TestRunner.run`) in `repo` itself, unsandboxed: for trusted code
    (the task builder's libraries); with `sandbox`, in a sandboxed copy of `repo`."""
    with TestRunner(python, plugins, sandbox=sandbox) as runner:
        if not sandbox:
            return runner.run(repo, tests, timeout_s=timeout_s)
        with runner.scratch() as tmp:
            copy = Path(tmp) / repo.name
            shutil.copytree(repo, copy, symlinks=True)
            return runner.run(copy, tests, timeout_s=timeout_s)


def read_own(path: Path, limit: int) -> bytes:
    """A file the test session wrote, not followed if it is a link, at most `limit` bytes;
    b"" when it is missing, a link or larger."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return b""
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    return b"" if len(data) > limit else data


def read_junit(xml: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Each test's outcome (and failure text) from a JUnit XML report (pytest's xunit1, whose
    test cases name their file, and their class in `classname`); a report that is missing,
    a link, over `MAX_REPORT_BYTES` or unreadable gives none."""
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    try:
        root = ET.fromstring(read_own(xml, MAX_REPORT_BYTES))
    except ET.ParseError:
        return outcomes, messages
    for case in root.iter("testcase"):
        file, name = case.get("file"), case.get("name")
        if not file or not name:
            continue
        module = file.removesuffix(".py").replace("/", ".")
        classname = case.get("classname") or ""
        cls = classname[len(module) + 1:] if classname.startswith(module + ".") else ""
        node = f"{file}::{cls.replace('.', '::')}::{name}" if cls else f"{file}::{name}"
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                messages[node] = f"{child.get('message', '')}\n{child.text or ''}".strip()
                break
        # A test that fails in teardown is listed twice: the worse outcome stays.
        if outcomes.get(node, "passed") == "passed":
            outcomes[node] = outcome
    return outcomes, messages
