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
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TIMEOUT_S = 120.0
FORKSERVER = Path(__file__).resolve().with_name("pytest_forkserver.py")


@dataclass
class TestRun:
    outcomes: dict[str, str]  # node id -> passed | failed | error | skipped
    messages: dict[str, str]  # node id -> the failure's text
    exit_code: int | None  # None: killed at its time limit
    timed_out: bool
    duration_s: float
    output_tail: str


class TestRunner:
    """Runs test sessions one after another through one fork server (see the module
    docstring); one session at a time per runner (use one runner per thread)."""

    def __init__(self, python: str = sys.executable, plugins: bool = False):
        self.python, self.plugins = python, plugins
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def _server(self) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:
            env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
            if not self.plugins:
                env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
            self._proc = subprocess.Popen([self.python, "-I", "-B", str(FORKSERVER)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          text=True, env=env, start_new_session=True)
        return self._proc

    def run(self, repo: Path, tests: list[str], *,
            timeout_s: float = DEFAULT_TIMEOUT_S) -> TestRun:
        """Runs `tests` (pytest node ids; all of them when empty) in `repo`."""
        repo = repo.resolve()
        with self._lock, tempfile.TemporaryDirectory(prefix="swe-tests-") as tmp:
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
            outcomes, messages = read_junit(xml) if xml.exists() else ({}, {})
            tail = out.read_text(errors="replace")[-4000:] if out.exists() else ""
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

    def __enter__(self) -> TestRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_tests(repo: Path, tests: list[str], *, timeout_s: float = DEFAULT_TIMEOUT_S,
              python: str = sys.executable, plugins: bool = False) -> TestRun:
    """One test session (see `TestRunner.run`)."""
    with TestRunner(python, plugins) as runner:
        return runner.run(repo, tests, timeout_s=timeout_s)


def read_junit(xml: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Each test's outcome (and failure text) from a JUnit XML report (pytest's xunit1, whose
    test cases name their file); an unreadable report gives none."""
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    try:
        root = ET.parse(xml).getroot()
    except ET.ParseError:
        return outcomes, messages
    for case in root.iter("testcase"):
        file, name = case.get("file"), case.get("name")
        if not file or not name:
            continue
        node = f"{file}::{name}"
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
