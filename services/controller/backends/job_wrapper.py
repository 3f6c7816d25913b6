"""The session leader of every local job: runs the job's command as its child and writes how it
ended to a file, so that a controller restarted after a crash can still learn the exit status
of a job it did not start itself (a process can only wait for its own children).

Usage: `python -I -S job_wrapper.py EXIT_FILE [--deadline=UNIX_TIME] [--nice=N] [--cpus=0,1]
[--cgroup=PATH ...] [--rlimit-cpu=N] ARGV...`. The exit file gets
`{"exit_code": N, "error": ""}` (N negative: killed by that signal; 127 with `error` set: the
command could not be executed) once the command has ended; the wrapper exits with the same
status. SIGTERM reaches the whole process group: the wrapper outlives it long enough to record
how its child ended (SIGKILL ends it regardless). It imports only the standard library.

`--deadline`: a last resort for a job no controller watches any more (its controller was killed
and not restarted): past that time the wrapper records the job as killed, then ends its whole
process group (SIGTERM, SIGKILL 2 s later, itself included). The controller sets it a little
after its own timeout and grace period, so a watching controller always acts first; the
harness cannot outlive its attempt either way.

`--nice` / `--cpus` (the controller's `local_job_nice` / `local_job_cpus`): the wrapper lowers
its own CPU priority by N and pins itself to those CPUs before it starts the command, which
inherits both (and so does everything the command starts).

A sandboxed job (`services/controller/sandbox`): `--cgroup=PATH` (its `cgroup.procs` files) the
wrapper joins before it starts the command, so the attempt's memory and process limits hold
for all of it; `--rlimit-cpu=N` limits each of its processes to N CPU seconds. The command is
then `bwrap ...`: the wrapper and the files it writes stay outside the sandbox.
"""

import json
import os
import resource
import signal
import subprocess
import sys
import time

EXEC_FAILED = 127


def _record(exit_file: str, exit_code: int, error: str = "") -> None:
    tmp = exit_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"exit_code": exit_code, "error": error}, f)
    os.replace(tmp, exit_file)


def main() -> int:
    exit_file, argv = sys.argv[1], sys.argv[2:]
    deadline = None
    cpu_limit = None
    while argv and argv[0].startswith(("--deadline=", "--nice=", "--cpus=", "--cgroup=",
                                       "--rlimit-cpu=")):
        flag, value = argv[0].split("=", 1)
        argv = argv[1:]
        if flag == "--deadline":
            deadline = float(value)
        elif flag == "--nice":
            os.nice(int(value))
        elif flag == "--cgroup":  # join it (the child and all it starts follow)
            with open(value, "w") as f:
                f.write(str(os.getpid()))
        elif flag == "--rlimit-cpu":
            cpu_limit = int(value)
        else:
            os.sched_setaffinity(0, {int(c) for c in value.split(",")})
    # A handler, not SIG_IGN: handlers are reset by exec, so the child gets the default action.
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        child = subprocess.Popen(argv, preexec_fn=None if cpu_limit is None else
                                 lambda: resource.setrlimit(resource.RLIMIT_CPU,
                                                            (cpu_limit, cpu_limit + 5)))
    except OSError as exc:
        error = f"cannot execute {argv[0]!r}: {exc}"
        print(f"harnessrl: {error}", file=sys.stderr, flush=True)
        _record(exit_file, EXEC_FAILED, error)
        return EXEC_FAILED
    while True:
        try:
            code = child.wait(None if deadline is None else max(0.0, deadline - time.time()))
            break
        except subprocess.TimeoutExpired:  # nobody ended it in time: end the whole group
            _record(exit_file, -signal.SIGKILL, "killed by its job wrapper: past its deadline "
                    "(no controller watched it)")
            os.killpg(0, signal.SIGTERM)
            time.sleep(2.0)
            os.killpg(0, signal.SIGKILL)
        except InterruptedError:  # pragma: no cover - PEP 475 retries for us
            continue
    _record(exit_file, code)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
