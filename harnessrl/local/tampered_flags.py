"""The command line's `--tampered-rewards` / `--tampered-penalty` (`harnessrl up`, `run`): what
a rollout gets whose grader found it tampered (RunSpec.tampered_rewards,
services/controller/tampered_rewards.py)."""

from __future__ import annotations

import argparse
import math

from harnessrl.v1 import common_pb2 as c

CHOICES = ("zero", "penalty", "drop")
MAX_PENALTY = 1e6


def add(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tampered-rewards", default="zero", help="what a rollout gets whose "
                   "grader found it tampered (its JSON line's \"tampered\": true): zero (reward "
                   "0), penalty (reward -TAMPERED_PENALTY) or drop (no reward: shown, not "
                   "trained on); the grader's own reward is never kept")
    p.add_argument("--tampered-penalty", default=None, help="with --tampered-rewards penalty: "
                   "the reward is minus this (default 1.0)")


def setting(args: argparse.Namespace) -> tuple[str, float]:
    """(choice, penalty) of the flags (or of `--config`'s keys), penalty 0.0 unless the choice
    is "penalty"; ValueError says what is wrong."""
    choice = str(getattr(args, "tampered_rewards", None) or "zero").lower()
    given = getattr(args, "tampered_penalty", None)
    if choice not in CHOICES:
        raise ValueError(f"--tampered-rewards {choice!r}: one of {', '.join(CHOICES)}")
    if given is None:
        return choice, 1.0 if choice == "penalty" else 0.0
    if choice != "penalty":
        raise ValueError(f"--tampered-penalty is for --tampered-rewards penalty (not {choice})")
    try:
        penalty = float(given)
    except (TypeError, ValueError):
        raise ValueError(f"--tampered-penalty {given!r} is not a number") from None
    if not math.isfinite(penalty) or not 0 < penalty <= MAX_PENALTY:
        raise ValueError(f"--tampered-penalty {given!r}: a positive number up to "
                         f"{MAX_PENALTY:g} (the reward is minus it)")
    return choice, penalty


def apply(spec: c.RunSpec, args: argparse.Namespace) -> c.RunSpec:
    """`spec` with the flags' setting (ValueError when they are bad)."""
    choice, penalty = setting(args)
    spec.tampered_rewards = c.TamperedRewards.Value(f"TAMPERED_REWARDS_{choice.upper()}")
    spec.tampered_penalty = penalty
    return spec


def trainer_flags(args: argparse.Namespace) -> list[str]:
    """The same for the trainer's command line (it builds the runs)."""
    choice, penalty = setting(args)
    return ["--tampered-rewards", choice] + (
        ["--tampered-penalty", repr(penalty)] if choice == "penalty" else [])
