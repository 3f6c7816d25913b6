"""The chaos run's harness: runs the example's harness unchanged, as its child, and appends what
it saw to a log outside the stack's state, so that the chaos accounting
(`harnessrl.testing.chaos_accounting`) does not depend on the services under test to know when
each rollout attempt ran.

Usage: `python chaos_harness.py LOG_FILE HARNESS_ARGV...` (the controller's harness command;
the chaos driver sets it with the trainer's `--harness-command`). Per attempt it appends two
JSON lines to LOG_FILE, each with one `os.write` on an `O_APPEND` descriptor (so lines of
concurrent harnesses never interleave):

    {"event": "start", "rollout_id": ..., "attempt": k, "time": <time.time()>, "pid": ...}
    {"event": "end", "rollout_id": ..., "attempt": k, "start": ..., "time": ..., "exit": N}

`rollout_id` and `attempt` come from the environment the controller gives every harness
(`HARNESSRL_ROLLOUT_ID`, `HARNESSRL_ATTEMPT`). `exit` is the child's exit status (negative: the
signal that ended it). SIGTERM (a cancel or a timeout reaches the whole process group) is
noted and the wrapper waits for its child, so the end line is still written; only a SIGKILL of
the wrapper leaves a start line without an end. It imports only the standard library and exits
with its child's status.
"""

import json
import os
import signal
import subprocess
import sys
import time


def _append(path: str, record: dict) -> None:  # type: ignore[type-arg]
    data = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: chaos_harness.py LOG_FILE HARNESS_ARGV...", file=sys.stderr)
        return 2
    log_file, cmd = argv[0], argv[1:]
    rid = os.environ.get("HARNESSRL_ROLLOUT_ID", "")
    attempt = int(os.environ.get("HARNESSRL_ATTEMPT", "0") or 0)
    # a handler, not SIG_IGN: exec resets it, so the child keeps the default action
    signal.signal(signal.SIGTERM, lambda *_: None)
    start = time.time()
    _append(log_file, {"event": "start", "rollout_id": rid, "attempt": attempt,
                       "time": start, "pid": os.getpid()})
    code = subprocess.call(cmd)
    _append(log_file, {"event": "end", "rollout_id": rid, "attempt": attempt, "start": start,
                       "time": time.time(), "exit": code})
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
