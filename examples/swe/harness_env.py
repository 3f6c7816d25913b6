"""The swe example's harness virtualenv: mini-swe-agent and litellm exactly as
`locks/swe-harness.txt` pins them (by hash), apart from harnessrl's own environment.

`ensure()` creates `$HARNESSRL_CACHE_DIR/swe-harness-<lock hash>/` (default cache dir
`~/.cache/harnessrl`) once, with `pip install --require-hashes --no-deps -r
locks/swe-harness.txt`, and returns the path of its `mini` executable. A changed lock is a new
folder; an install that did not finish (killed, failed) is not used and is redone. Two callers
at once (two rollouts, setup.sh and a test) are serialised by a lock file: the second waits
and then finds the venv done. Stdlib only. The harness never installs it: its command names the
`mini` this prints (`setup_attempt.commands`), so nothing is installed during a rollout.

`python examples/swe/harness_env.py` installs it if needed and prints the `mini` path
(scripts/setup.sh runs it; it returns at once when the venv is there).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "locks" / "swe-harness.txt"
DONE = ".harnessrl-complete"  # written last: the venv is whole
INSTALL_TIMEOUT_S = 1800.0


class HarnessEnvError(RuntimeError):
    """The harness venv could not be installed (pip's output tail in the message)."""


def cache_dir() -> Path:
    return Path(os.environ.get("HARNESSRL_CACHE_DIR") or Path.home() / ".cache" / "harnessrl")


def lock_hash(lock: Path = LOCK) -> str:
    return hashlib.sha256(lock.read_bytes()).hexdigest()[:16]


def venv_dir(lock: Path = LOCK) -> Path:
    return cache_dir() / f"swe-harness-{lock_hash(lock)}"


def mini_path(venv: Path) -> Path:
    return venv / "bin" / "mini"


def _python() -> str:
    """A Python 3.11 for the venv (the lock is resolved for 3.11): this one if it is."""
    if sys.version_info[:2] == (3, 11):
        return sys.executable
    found = shutil.which("python3.11")
    if found is None:
        raise HarnessEnvError("the swe harness venv needs Python 3.11 (locks/swe-harness.txt "
                              "is resolved for it); none found")
    return found


def ensure(lock: Path = LOCK, quiet: bool = False) -> Path:
    """The `mini` executable of the harness venv, installed first if it is not there."""
    venv = venv_dir(lock)
    if (venv / DONE).exists():
        return mini_path(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # another caller installing: wait for it
        if (venv / DONE).exists():
            return mini_path(venv)
        _install(venv, lock, quiet)
    return mini_path(venv)


def _install(venv: Path, lock: Path, quiet: bool) -> None:
    if venv.exists():  # an earlier install that did not finish
        shutil.rmtree(venv)
    t0 = time.monotonic()
    if not quiet:
        print(f"swe harness: installing {lock.name} into {venv} (a minute or two, once)",
              file=sys.stderr, flush=True)
    steps = [[_python(), "-m", "venv", str(venv)],
             [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
              "--disable-pip-version-check", "--no-input", "--require-hashes", "--no-deps",
              "-r", str(lock)]]
    for argv in steps:
        try:
            out = subprocess.run(argv, capture_output=True, text=True,
                                 timeout=INSTALL_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            shutil.rmtree(venv, ignore_errors=True)
            raise HarnessEnvError(f"swe harness venv: {argv[2]} timed out after "
                                  f"{exc.timeout:g}s") from exc
        if out.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            tail = (out.stdout + out.stderr).strip()[-3000:]
            raise HarnessEnvError(f"swe harness venv: {' '.join(argv[:4])} ... exited with "
                                  f"{out.returncode}:\n{tail}")
    if not mini_path(venv).exists():
        shutil.rmtree(venv, ignore_errors=True)
        raise HarnessEnvError(f"swe harness venv: {lock} installed no `mini` executable")
    (venv / DONE).write_text(f"{lock_hash(lock)} {time.monotonic() - t0:.1f}s\n")
    if not quiet:
        print(f"swe harness: installed in {time.monotonic() - t0:.0f}s", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lock", type=Path, default=LOCK)
    ap.add_argument("--check", action="store_true",
                    help="install nothing: exit 1 when the venv is not there")
    args = ap.parse_args()
    if args.check:
        venv = venv_dir(args.lock)
        print(mini_path(venv))
        return 0 if (venv / DONE).exists() else 1
    try:
        print(ensure(args.lock))
    except HarnessEnvError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
