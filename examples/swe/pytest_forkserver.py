"""Runs pytest sessions in forked children of one process that imported pytest once (a fork
server), so a task builder or validator that runs hundreds of test sessions does not pay
pytest's import (~0.3 s) each time. Standard library and pytest only; run as
`python -I -B pytest_forkserver.py` by `examples.swe.testrun.TestRunner`.

Requests are JSON lines on stdin: {"cwd": DIR, "args": [...pytest arguments], "out": FILE,
"timeout_s": SECONDS}. Each runs as `pytest.main(args)` in a child of its own session (its
stdout and stderr to FILE, stdin from /dev/null); a child past its time is killed with its
whole process group. Each answer is a JSON line: {"exit_code": N or null, "timed_out": bool}.
A child never imports what an earlier one did: each is a fresh fork of this process, which
imports nothing of the code under test.

`--reap`: this server is the first process of a pid namespace of its own (pid 2 under
bubblewrap's init, `harnessrl.graders.nested_sandbox`); after each session it kills every other
process in the namespace, so nothing a session started (a daemon rewriting the report while
the grader reads it) outlives the session. Refused outside such a namespace.
"""

import json
import os
import signal
import sys
import time

import pytest


def _child(req: dict) -> None:
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    code = 3
    try:
        os.chdir(req["cwd"])
        sys.argv = ["pytest", *req["args"]]
        code = int(pytest.main(req["args"]))
    except BaseException:  # noqa: BLE001 - any end of the session is its exit code
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap() -> None:
    """Kills every process of the namespace but its init and this one (see `--reap`)."""
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def main() -> int:
    reap = "--reap" in sys.argv[1:]
    if reap and os.getpid() != 2:
        print(f"--reap needs a pid namespace of its own (pid 2, not {os.getpid()})",
              file=sys.stderr)
        return 2
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        deadline = time.monotonic() + float(req["timeout_s"])
        timed_out, status = False, 0
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                timed_out = True
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                os.waitpid(pid, 0)
                break
            time.sleep(0.005)
        code = None if timed_out else os.waitstatus_to_exitcode(status)
        if reap:
            _reap()
        print(json.dumps({"exit_code": code, "timed_out": timed_out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
