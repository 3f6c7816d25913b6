"""`harnessrl report RUN_DIR`: one self-contained HTML page about a training run.

Reads the trainer's `<RUN_DIR>/metrics.jsonl` (one row a step) and `<RUN_DIR>/rollouts.jsonl`
(rendered rollouts, when the trainer wrote them) and writes `<RUN_DIR>/report.html`: a summary
table, the reward curve (mean, with a band of one standard deviation), KL, entropy, the step time
broken down by phase (generate, train, push), tokens per second, and a few rendered rollouts
(the last steps' first). The charts are matplotlib SVGs inlined into the page; it loads nothing
from anywhere, so it can be mailed or attached to a CI run as it is.

Colours are fixed (`COLORS`), and the plot area of every chart has the background `PLOT_BG`:
tests find the curves in a screenshot by them.
"""

from __future__ import annotations

import html
import io
import json
import statistics
from pathlib import Path
from typing import Any

COLORS = {"reward": "#d62728", "kl": "#1f77b4", "entropy": "#9467bd", "generate": "#2ca02c",
          "train": "#ff7f0e", "push": "#8c564b", "tokens": "#17becf"}
PLOT_BG = "#f2f4f8"
ROLLOUTS_SHOWN = 6


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [s for s, _ in pts], [float(v) for _, v in pts]


def _svg(fig: Any) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and doctype: inlined in HTML


def _chart(title: str, ylabel: str, draw: Any) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    with plt.rc_context({"svg.fonttype": "none", "font.size": 10}):
        fig, ax = plt.subplots(figsize=(6.4, 3.2), dpi=100)
        ax.set_facecolor(PLOT_BG)
        ax.grid(True, color="white", linewidth=1.0)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        draw(ax)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")
        ax.set_title(title, loc="left", fontsize=11)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        svg = _svg(fig)
        plt.close(fig)
    return f'<figure class="chart" id="chart-{title.split()[0].lower()}">{svg}</figure>'


def _line(key: str, color: str, rows: list[dict[str, Any]]) -> Any:
    def draw(ax: Any) -> None:
        steps, values = _series(rows, key)
        if not steps:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center")
            return
        ax.plot(steps, values, color=color, linewidth=2.5, marker="o", markersize=3)
    return draw


def _reward(rows: list[dict[str, Any]]) -> Any:
    def draw(ax: Any) -> None:
        steps, mean = _series(rows, "reward_mean")
        if not steps:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center")
            return
        std = [float(r.get("reward_std") or 0.0) for r in rows if r.get("reward_mean") is not None]
        ax.fill_between(steps, [m - s for m, s in zip(mean, std)],
                        [m + s for m, s in zip(mean, std)], color=COLORS["reward"], alpha=0.12,
                        linewidth=0)
        ax.plot(steps, mean, color=COLORS["reward"], linewidth=2.5, marker="o", markersize=3)
    return draw


def _phases(rows: list[dict[str, Any]]) -> Any:
    def draw(ax: Any) -> None:
        steps = [r["step"] for r in rows]
        bottom = [0.0] * len(rows)
        for phase in ("generate", "train", "push"):
            values = [float(r.get(f"{phase}_s") or 0.0) for r in rows]
            ax.bar(steps, values, bottom=bottom, color=COLORS[phase], label=phase, width=0.8)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False,
                  ncols=3)
    return draw


def _summary(rows: list[dict[str, Any]]) -> str:
    last = rows[-1]
    rewards = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
    head = rewards[: max(1, len(rewards) // 5)]
    tail = rewards[-max(1, len(rewards) // 5):]
    total_s = sum(float(r.get("step_time_s") or 0.0) for r in rows)
    items = [
        ("steps", f"{last['step']}"),
        ("policy version", f"{last.get('policy_version')}"),
        ("mean reward, first / last fifth",
         f"{statistics.fmean(head):.3f} / {statistics.fmean(tail):.3f}" if rewards else "n/a"),
        ("rollouts (failed)", f"{sum(r.get('rollouts', 0) for r in rows)} "
                              f"({sum(r.get('rollouts_failed', 0) for r in rows)})"),
        ("training time", f"{total_s:.0f} s ({total_s / len(rows):.1f} s a step)"),
        ("last checkpoint", next((r["checkpoint"] for r in reversed(rows) if r.get("checkpoint")),
                                 "none")),
    ]
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                    for k, v in items)
    return f'<table class="summary">{cells}</table>'


def _rollouts(rollouts: list[dict[str, Any]]) -> str:
    if not rollouts:
        return "<p>No rendered rollouts (the trainer's <code>sample_rollouts</code> was 0).</p>"
    shown = sorted(rollouts, key=lambda r: -int(r["step"]))[:ROLLOUTS_SHOWN]
    parts = []
    for i, r in enumerate(shown):
        summary = (f"step {r['step']} &middot; {html.escape(str(r['rollout_id']))} &middot; "
                   f"reward {r['reward']} &middot; {html.escape(str(r['status']))} &middot; "
                   f"{r['calls']} calls")
        parts.append(f"<details{' open' if i == 0 else ''}><summary>{summary}</summary>"
                     f"<pre>{html.escape(str(r['text']))}</pre></details>")
    return "".join(parts)


STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; background: #fff; }
h1 { font-size: 20px; margin: 0 0 12px; } h2 { font-size: 16px; margin: 24px 0 8px; }
.charts { display: flex; flex-wrap: wrap; gap: 8px; }
figure.chart { margin: 0; } figure.chart svg { width: 640px; height: auto; }
table.summary { border-collapse: collapse; } table.summary th { text-align: left;
  font-weight: normal; color: #555; padding: 2px 16px 2px 0; }
pre { white-space: pre-wrap; background: #fafafa; border: 1px solid #ddd; padding: 8px;
  max-height: 24em; overflow: auto; font-size: 12px; }
details { margin: 4px 0; } summary { cursor: pointer; }
"""


def render(run_dir: Path) -> str:
    """The report page of `run_dir` as HTML text; ValueError when it has no metrics."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl is missing or empty: is {run_dir} a "
                         "trainer's output_dir?")
    rollouts = read_jsonl(run_dir / "rollouts.jsonl")
    charts = [
        _chart("Reward (mean ± std)", "reward", _reward(rows)),
        _chart("KL (behaviour ‖ policy)", "kl", _line("kl", COLORS["kl"], rows)),
        _chart("Entropy", "nats / token", _line("entropy", COLORS["entropy"], rows)),
        _chart("Step time by phase", "seconds", _phases(rows)),
        _chart("Tokens per second (training)", "tokens / s",
               _line("tokens_per_s", COLORS["tokens"], rows)),
    ]
    title = f"harnessrl run report: {run_dir.resolve().name}"
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
            f"<h1>{html.escape(title)}</h1>{_summary(rows)}"
            f"<h2>Curves</h2><div class=\"charts\">{''.join(charts)}</div>"
            f"<h2>Rollouts</h2>{_rollouts(rollouts)}</body></html>\n")


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    out = out or run_dir / "report.html"
    out.write_text(render(run_dir), encoding="utf-8")
    return out
