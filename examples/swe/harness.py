"""The swe example's harness: mini-swe-agent 2.4.6, unchanged, on one SWE task.

Run by the controller in the attempt's work folder, after the recipe's setup step
(`examples/swe/setup_attempt.py`, the run's `setup_command`) laid that folder out:

    work/repo/      the broken workspace (mini's commands run here)
    work/issue.md   the problem statement (the tools read its reproduction)
    work/harness/   this file, mini's config (`mini.yaml`) and the tools (`tools/`)

so the run's harness command is `python harness/harness.py --mini MINI` (a path relative to
the work folder: the harness's sandbox then holds nothing of the recipe's folder, whose
libraries and task files are the fixes; `setup_attempt.commands` builds the three commands).
Its environment is the controller's: `OPENAI_BASE_URL`, `OPENAI_API_KEY` (the gateway and the
rollout's credential), `HARNESSRL_MODEL`, `HARNESSRL_TASK_JSON` (the task's rollout view:
`instance_id`, `problem_statement`, `repo`, `base_commit`). It

1. finds the workspace in `./repo`, or, with `--workspaces DIR` (what the harness image ships,
   made by `python -m examples.swe.workspace build`; no setup step there), copies
   `DIR/<instance_id>/` to `./repo` and writes `./issue.md`;
2. runs mini-swe-agent's own `mini` executable, from its own virtualenv (`--mini PATH`, else
   `$HARNESSRL_SWE_MINI`; `python examples/swe/harness_env.py` installs it once and prints its
   path: scripts/setup.sh runs it, nothing is installed during a rollout), configured only by
   its config file (`mini.yaml` beside this file, or `--config`), its flags (model
   `openai/$HARNESSRL_MODEL` through litellm's OpenAI provider, the problem statement as the
   task, the workspace as its commands' folder, `--mini-config KEY=VALUE` for more of mini's own
   `-c` specs) and its environment: the harness's own, less every `HARNESSRL_TASK_*` variable,
   plus mini's and litellm's settings (`MINI_ENV`) and the example's tools (`tools/` beside
   this file, first on `PATH`: `suspects`, run by this Python, reading the problem statement
   from `./issue.md`, `$SWE_ISSUE`);
3. leaves mini's trajectory in `./mini.traj.json` (mini writes it after every step).

Exit status: 0 when mini ran to its end, whatever the agent did (submitted, ran out of steps,
repeated format errors, its context full); mini's own non-zero status otherwise (an API error
that mini's retries did not get past, a crash), as the calc harness fails on an API error.
No workspace (no setup step ran, or its image has none for the task) or no `mini`: exit 2.
Standard library only: it runs from its copy in the work folder, beside nothing of the recipe.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "mini.yaml"
WORKSPACE = "repo"
ISSUE = "issue.md"  # beside the workspace, for the tools
TRAJECTORY = "mini.traj.json"
TOOLS = HERE / "tools"  # shipped beside the harness, outside the workspace
MINI_HOME = ".mini"  # mini's global config folder (its .env, input history): the attempt's own
# mini's and litellm's own settings, by environment.
MINI_ENV = {
    "MSWEA_CONFIGURED": "true",  # no first-run set-up dialogue
    "MSWEA_COST_TRACKING": "ignore_errors",  # as cost_tracking in mini.yaml: no price known
    # one try per model call: the gateway holds calls while engines are paused, so a failure
    # that reaches mini is real (mini's default: 10 tries, backing off up to a minute)
    "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm reads no price list from the network
    "PYTHONUNBUFFERED": "1",
}
# How a run that mini ended itself with an error still counts as the agent's run: its context
# was full (the gateway's 400 for a too-long prompt, as litellm names it).
FINISHED_ERRORS = {"ContextWindowExceededError"}


def from_image(task: dict[str, Any], work: Path, workspaces: Path) -> None:
    """`--workspaces DIR`: the task's prepared workspace copied to `work/repo`, its statement
    to `work/issue.md` (what the setup step lays out elsewhere)."""
    src = workspaces / task["instance_id"]
    if not src.is_dir():
        raise ValueError(f"no prepared workspace {src}")
    dest = work / WORKSPACE
    if dest.exists():  # a folder left from an earlier try of this attempt
        shutil.rmtree(dest)
    shutil.copytree(src, dest, symlinks=True)
    (work / ISSUE).write_text(task["problem_statement"])


def tools_env(environ: dict[str, str], issue: Path | None = None) -> dict[str, str]:
    """The example's tools for the agent's commands: `TOOLS` first on `PATH`, run by this
    Python (it has pytest); `issue`: a file with the problem statement (outside the
    workspace), which `suspects` reads for the reproduction."""
    env = {"PATH": f"{TOOLS}{os.pathsep}{environ.get('PATH', os.defpath)}",
           "SWE_TOOLS_PYTHON": environ.get("SWE_TOOLS_PYTHON", sys.executable)}
    if issue is not None:
        env["SWE_ISSUE"] = str(issue)
    return env


def mini_env(environ: dict[str, str], home: Path, issue: Path | None = None) -> dict[str, str]:
    """mini's environment: the harness's, less the task's variables, plus mini's settings
    and the example's tools."""
    env = {k: v for k, v in environ.items() if not k.startswith("HARNESSRL_TASK_")}
    env.update(MINI_ENV)
    env.update(tools_env(environ, issue))
    env["MSWEA_GLOBAL_CONFIG_DIR"] = str(home)
    return env


def mini_argv(mini: str, config: Path, model: str, task: str, repo: Path, trajectory: Path,
              extra: list[str]) -> list[str]:
    specs = [str(config), f"environment.cwd={repo}", *extra]
    return [mini, *[a for s in specs for a in ("-c", s)], f"--model=openai/{model}",
            f"--task={task}", f"--output={trajectory}", "--yolo", "--exit-immediately"]


def exit_status(trajectory: Path) -> str:
    try:
        return str(json.loads(trajectory.read_text())["info"]["exit_status"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def find_mini(flag: str | None) -> str:
    """mini's executable: `--mini`, else `$HARNESSRL_SWE_MINI`; `ValueError` when neither
    names one (it is installed before any rollout, never during one)."""
    mini = flag or os.environ.get("HARNESSRL_SWE_MINI", "")
    if not mini:
        raise ValueError("give mini's executable: --mini PATH or $HARNESSRL_SWE_MINI (`python "
                         "examples/swe/harness_env.py` installs it and prints its path)")
    if not os.access(mini, os.X_OK):
        raise ValueError(f"mini's executable {mini} is not there (in a sandbox: name it by its "
                         "absolute path in the harness's command, which makes its venv "
                         "readable)")
    return mini


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workspaces", type=Path, help="prepared workspaces: DIR/<instance_id>/ "
                    "(an image's; without it the setup step made ./repo)")
    ap.add_argument("--mini", help="mini-swe-agent's `mini` executable (default: "
                                   "$HARNESSRL_SWE_MINI)")
    ap.add_argument("--config", type=Path, default=CONFIG,
                    help="mini's config file (default: mini.yaml beside this file; a sandbox "
                         "shows the folder of an absolute path named here)")
    ap.add_argument("--mini-config", action="append", default=[], metavar="KEY=VALUE",
                    help="one more of mini's -c specs (e.g. agent.step_limit=4); repeatable")
    a = ap.parse_args(argv)
    task = json.loads(os.environ["HARNESSRL_TASK_JSON"])
    model = os.environ["HARNESSRL_MODEL"]
    cwd = Path.cwd()
    repo = cwd / WORKSPACE
    try:
        if a.workspaces is not None:
            from_image(task, cwd, a.workspaces)
        elif not repo.is_dir() or not (cwd / ISSUE).is_file():
            raise ValueError(f"no ./{WORKSPACE} and ./{ISSUE} in {cwd}: the run's setup step "
                             "(examples/swe/setup_attempt.py) makes them")
        mini = find_mini(a.mini)
    except Exception as exc:  # noqa: BLE001 - any failure to make it: the harness's error
        print(f"swe harness: cannot start on {task.get('instance_id')!r}: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    home = cwd / MINI_HOME
    home.mkdir(exist_ok=True)
    trajectory = cwd / TRAJECTORY
    argv_ = mini_argv(mini, a.config.resolve(), model, task["problem_statement"], repo,
                      trajectory, a.mini_config)
    sys.stdout.flush()
    code = subprocess.run(argv_, cwd=repo, env=mini_env(dict(os.environ), home, cwd / ISSUE),
                          stdin=subprocess.DEVNULL).returncode
    status = exit_status(trajectory)
    print(f"swe harness: mini exited with {code}, exit status {status or '(none)'}",
          flush=True)
    if code != 0 and status in FINISHED_ERRORS:
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
