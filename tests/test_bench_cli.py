"""The benchmarks run from a fresh clone as the README and docs/ give them.

The clone is this checkout's tracked files as a fresh `git clone` has them (`git archive` of
HEAD, or of `git stash create` when tracked files are edited: what a commit of them would
hold), without `.git`, the venv or anything untracked. Each bench runs there with this
environment's Python and the clone's root as cwd, as `python bench/X.py` from the README, and
without PYTHONPATH: the editable install of `harnessrl` maps only the `harnessrl` and
`services` packages, so `bench`, a folder of the checkout, is importable in a bench's child
process only if the bench makes it so. A PYTHONPATH naming a checkout (as a developer's shell
may set) would hide exactly that.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from harnessrl import identity, procs

REPO = Path(__file__).resolve().parent.parent
BENCHES = sorted(p.name for p in (REPO / "bench").glob("*.py") if not p.name.startswith("_"))
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def documented_flags() -> dict[str, set[str]]:
    """{bench file: every --flag the README and docs/ give after `bench/X.py`, up to the end of
    the code span, table cell or command (continuation lines included)}."""
    out: dict[str, set[str]] = {}
    for doc in DOCS:
        text = doc.read_text().replace("\\\n", " ")
        for name, rest in re.findall(r"bench/([a-z]\w*\.py)([^`\n|]*)", text):
            out.setdefault(name, set()).update(re.findall(r"(?<![\w-])--[a-z][\w-]*", rest))
    return out


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    def git(*args: str) -> bytes:  # (an identity for `stash create`'s commit object)
        return subprocess.run(["git", "-C", str(REPO), "-c", "user.name=test", "-c",
                               "user.email=test@localhost", *args], check=True,
                              capture_output=True, timeout=60).stdout

    # the suite runs from a git checkout (a clone, in CI): a failure here is the test's own
    commit = git("stash", "create").decode().strip() or "HEAD"
    archive = git("archive", "--format=tar", commit)
    root = tmp_path_factory.mktemp("clone")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="tar")
    return root


def clone_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return env | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def helps(clone: Path) -> dict[str, tuple[int, str, str]]:
    """{bench: (exit status, stdout, stderr) of `python bench/X.py --help`}, all started at
    once (several import torch before they parse their arguments)."""
    running = {b: subprocess.Popen([sys.executable, f"bench/{b}", "--help"], cwd=clone,
                                   env=clone_env(), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for b in BENCHES}
    deadline = time.monotonic() + 600  # importing torch takes minutes on a crowded machine
    out = {}
    try:
        for bench, proc in running.items():
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out[bench] = (proc.returncode, stdout, stderr)
    finally:
        for proc in running.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


def test_the_docs_name_only_benches_that_exist() -> None:
    assert set(documented_flags()) <= set(BENCHES)
    assert "gateway_overhead.py" in documented_flags()


@pytest.mark.parametrize("bench", BENCHES)
def test_a_bench_answers_help_from_a_fresh_clone_with_every_flag_the_docs_give(
        helps: dict[str, tuple[int, str, str]], bench: str) -> None:
    rc, stdout, stderr = helps[bench]
    assert rc == 0, stderr
    assert stdout.startswith("usage:"), stdout
    missing = documented_flags().get(bench, set()) - set(re.findall(r"--[\w-]+", stdout))
    assert not missing, f"the docs give {bench} flags it does not take: {sorted(missing)}"


def test_the_gateway_bench_runs_from_a_fresh_clone_and_prints_its_json_line(
        clone: Path) -> None:
    """The short run (`--quick`) of `python bench/gateway_overhead.py --no-vllm`, with one
    HTTP-layer arm: the arms run as a bench helper in a child process of their own. (No
    baseline: a clone without `.git` has no commit to check out.) The bench's own PKI: the
    test session's $HARNESSRL_TLS_ROOT is not passed on, as a shell running it has none."""
    env = {k: v for k, v in clone_env().items() if k not in identity.IDENTITY_ENV
           and k != procs.TLS_ROOT_ENV}
    r = subprocess.run([sys.executable, "bench/gateway_overhead.py", "--no-vllm", "--quick",
                        "--arms", "uvicorn+builtin", "--baseline", ""], cwd=clone, env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads(r.stdout.splitlines()[-1])
    assert summary["quick"] and summary["recorded_calls"] > 0
    assert summary["throughput_ratio"] > 0 and summary["replicas_ratio"] > 0
    assert set(summary["arms"]) == {"uvicorn+builtin"}
    assert summary["arms"]["uvicorn+builtin"]["throughput_ratio"] > 0
    # authentication's cost: mTLS and plaintext stores measured side by side
    for kind in ("record_stream", "unary_c1", "unary"):
        auth = summary["auth"][kind]
        assert auth["ratio"] > 0 and auth["cpu_ratio"] > 0, auth
        assert auth["mtls"]["calls_per_s"] > 0 and auth["plaintext"]["calls_per_s"] > 0, auth
