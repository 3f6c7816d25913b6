"""Experiment tracking: each step's metrics.jsonl row and its rendered rollouts, also to
TensorBoard and Weights & Biases when the config switches them on (rank 0 only).

- TensorBoard (`tensorboard: true`): event files in `<output_dir>/tensorboard`; every numeric
  field of the row a scalar under `train/<field>` (booleans as 0/1), the text fields (run id,
  checkpoint) and the rendered rollouts as text. A resumed trainer purges the events of steps
  after its checkpoint (they are redone).
- W&B (`wandb_project`): one run whose id is the trainer's run prefix (a resumed trainer goes on
  with it), the config as its config (harness_env values masked), every field of the row under `train/<field>` at the
  step, the rollouts as a table.
- Evaluations (evaluation.py, `log_eval`): every number of the eval line under `eval/<field>`
  (`eval/pass@1`, `eval/avg@4`, ...) at its step, in both. `WANDB_MODE=offline` writes it under `<output_dir>/wandb`
  without an account (`wandb sync` uploads it later).

Both need the `tracking` extra (`pip install harnessrl[tracking]`); asked for without it, the
trainer stops at start-up saying so.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("harnessrl.trainer")

ROLLOUT_COLUMNS = ("step", "rollout_id", "task_id", "reward", "status", "tampered", "calls",
                   "text")


def render_markdown(rollouts: list[dict[str, Any]]) -> str:
    """The rendered rollouts as one Markdown text (TensorBoard shows text as Markdown)."""
    parts = []
    for r in rollouts:
        body = r["text"].replace("```", "'''")
        tampered = f", TAMPERED ({r.get('tamper_evidence') or 'no evidence'})" \
            if r.get("tampered") else ""
        parts.append(f"**{r['rollout_id']}** task {r['task_id']}, reward {r['reward']}, "
                     f"{r['status']}{tampered}, {r['calls']} calls\n\n```\n{body}\n```")
    return "\n\n".join(parts)


class Trackers:
    """The trackers the config asks for; `log_step` sends a step to each."""

    def __init__(self, cfg: Any, output: Path, run_prefix: str, resumed_step: int) -> None:
        self._tb: Any = None
        self._wandb: Any = None
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise RuntimeError("tensorboard: true needs the tensorboard package: pip "
                                   f"install 'harnessrl[tracking]' ({exc})") from exc
            self._tb = SummaryWriter(str(output / "tensorboard"),
                                     purge_step=resumed_step + 1 if resumed_step else None)
            log.info("TensorBoard event files in %s", output / "tensorboard")
        if cfg.wandb_project:
            try:
                import wandb
            except ImportError as exc:
                raise RuntimeError("wandb_project needs the wandb package: pip install "
                                   f"'harnessrl[tracking]' ({exc})") from exc
            (output / "wandb").mkdir(parents=True, exist_ok=True)
            config = cfg.model_dump(mode="json")
            # the harness's environment may carry its own credentials: names only
            config["harness_env"] = {k: "***" for k in config.get("harness_env", {})}
            self._wandb = wandb.init(project=cfg.wandb_project, id=run_prefix, resume="allow",
                                     name=cfg.wandb_run_name or run_prefix, dir=str(output),
                                     config=config)
            log.info("W&B run %s (%s)", self._wandb.id, self._wandb.dir)

    @property
    def active(self) -> bool:
        return self._tb is not None or self._wandb is not None

    def log_step(self, row: dict[str, Any], rollouts: list[dict[str, Any]]) -> None:
        step = int(row["step"])
        numbers: dict[str, float] = {k: float(v) for k, v in row.items()
                   if isinstance(v, (int, float)) and k != "step"}
        texts: dict[str, str] = {k: v for k, v in row.items() if isinstance(v, str)}
        if self._tb is not None:
            for k, number in numbers.items():
                self._tb.add_scalar(f"train/{k}", number, step)
            for k, text in texts.items():
                self._tb.add_text(f"train/{k}", text, step)
            if rollouts:
                self._tb.add_text("rollouts", render_markdown(rollouts), step)
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            data: dict[str, Any] = {f"train/{k}": v for k, v in row.items()
                                    if v is not None and k != "step"}
            if rollouts:
                data["rollouts"] = wandb.Table(
                    columns=list(ROLLOUT_COLUMNS),
                    data=[[r[c] for c in ROLLOUT_COLUMNS] for r in rollouts])
            self._wandb.log(data, step=step)

    def log_eval(self, row: dict[str, Any]) -> None:
        """An evaluation's metrics.jsonl line (evaluation.py): its numbers under
        `eval/<field>` at its step (0: before training)."""
        step = int(row["step"])
        numbers = {k: float(v) for k, v in row.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        if self._tb is not None:
            for k, number in numbers.items():
                self._tb.add_scalar(f"eval/{k}", number, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({f"eval/{k}": v for k, v in numbers.items()}, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


MAX_TEXT_CHARS = 4000


def render_rollouts(groups: list[Any], tokenizer: Any, k: int, step: int
                    ) -> list[dict[str, Any]]:
    """Up to `k` of the step's rollouts (the first of each group, then the second, ...), each
    rendered from its last call's recorded tokens (the whole conversation: every turn extends
    the one before), cut to `MAX_TEXT_CHARS`."""
    from harnessrl.v1 import common_pb2 as c

    longest = max((len(g.rollouts) for g in groups), default=0)
    picked = [g.rollouts[i] for i in range(longest) for g in groups if i < len(g.rollouts)][:k]
    out = []
    for ro in picked:
        last = max(ro.calls, key=lambda call: call.seq) if ro.calls else None
        text = tokenizer.decode(list(last.prompt_token_ids) + list(last.completion_token_ids)) \
            if last is not None else ""
        if len(text) > MAX_TEXT_CHARS:
            text = text[:MAX_TEXT_CHARS] + f"... [{len(text) - MAX_TEXT_CHARS} more characters]"
        out.append({"step": step, "rollout_id": ro.rollout_id, "task_id": ro.task_id,
                    "reward": ro.reward if ro.has_reward else None,
                    "status": c.RolloutStatus.Name(ro.status).removeprefix("ROLLOUT_STATUS_"),
                    "tampered": ro.tampered, "tamper_evidence": ro.tamper_evidence,
                    "calls": len(ro.calls), "text": text})
    return out
