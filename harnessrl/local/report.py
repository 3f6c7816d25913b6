"""`harnessrl report RUN_DIR`: one self-contained HTML page about a training run.

Reads the trainer's `<RUN_DIR>/metrics.jsonl` (one row a step) and `<RUN_DIR>/rollouts.jsonl`
(rendered rollouts, when the trainer wrote them) and writes `<RUN_DIR>/report.html`: a summary
table, the reward curve (mean, with a band of one standard deviation), KL, entropy, the step time
broken down by phase (generate, train, push), tokens per second, and a few rendered rollouts
(the last steps' first; a rollout its grader found tampered is marked TAMPERED, with the
grader's evidence, and the summary counts them). The charts are matplotlib SVGs inlined into
the page; it loads nothing from anywhere, so it can be mailed or attached to a CI run as it is.

When the trainer evaluated during training (metrics.jsonl lines with "kind": "eval",
services/trainer/evaluation.py) the page also has the eval curve (pass@1, pass@k and avg@k
against the step, step 0 the weights before training) and a table of every evaluation.

`write_eval_report` writes the page of `harnessrl eval` results (harnessrl/local/evaluate.py):
one result, or two side by side (per metric, per task, with the differences), and the failed
samples with their reasons.

Colours are fixed (`COLORS`), and the plot area of every chart has the background `PLOT_BG`:
tests find the curves in a screenshot by them.
"""

from __future__ import annotations

import argparse
import html
import io
import json
import statistics
from pathlib import Path
from typing import Any

COLORS = {"reward": "#d62728", "kl": "#1f77b4", "entropy": "#9467bd", "generate": "#2ca02c",
          "train": "#ff7f0e", "push": "#8c564b", "tokens": "#17becf", "pass@1": "#e377c2",
          "pass@k": "#7f7f7f", "avg@k": "#bcbd22"}
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
        ("tampered rollouts", f"{sum(r.get('rollouts_tampered') or 0 for r in rows)} (their "
                              "grader found the agent's code forged the outcome)"),
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
        tampered = r.get("tampered")
        summary = (f"step {r['step']} &middot; {html.escape(str(r['rollout_id']))} &middot; "
                   f"reward {r['reward']} &middot; {html.escape(str(r['status']))} &middot; "
                   + ('<strong class="tampered">TAMPERED</strong> &middot; ' if tampered else "")
                   + f"{r['calls']} calls")
        evidence = (f'<p class="tampered">Tampered: its grader found the agent\'s code forged '
                    f"the outcome. Evidence: {html.escape(str(r.get('tamper_evidence') or '-'))}"
                    "</p>") if tampered else ""
        attrs = (" open" if i == 0 else "") + (' class="tampered"' if tampered else "")
        parts.append(f"<details{attrs}><summary>{summary}</summary>{evidence}"
                     f"<pre>{html.escape(str(r['text']))}</pre></details>")
    return "".join(parts)


def _eval_keys(evals: list[dict[str, Any]]) -> tuple[str, str, str]:
    """(pass@1, pass@k, avg@k) keys of the evaluations (k from the last one)."""
    k = int(evals[-1].get("k") or 1)
    return "pass@1", f"pass@{k}", f"avg@{k}"


def _eval_curve(evals: list[dict[str, Any]]) -> Any:
    def draw(ax: Any) -> None:
        drawn = set()
        for key, color in zip(_eval_keys(evals), ("pass@1", "pass@k", "avg@k")):
            if key in drawn:  # k = 1: pass@k is pass@1
                continue
            drawn.add(key)
            steps, values = _series(evals, key)
            ax.plot(steps, values, color=COLORS[color], linewidth=2.5, marker="o",
                    markersize=4, label=key)
        ax.set_ylim(-0.02, 1.02)
        ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False,
                  ncols=3)
    return draw


def _eval_table(evals: list[dict[str, Any]]) -> str:
    if not evals:
        return ""
    names = [k for k in evals[-1] if k.startswith(("pass@", "avg@"))]
    head = "".join(f"<th>{html.escape(h)}</th>" for h in
                   ("step", "policy version", *names, "samples (failed)", "seconds", "result"))
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in (
            r["step"], r.get("policy_version"), *(_num3(r.get(n)) for n in names),
            f"{r.get('samples')} ({r.get('samples_failed')})", f"{r.get('eval_s', 0):.0f}",
            Path(str(r.get("result", ""))).name)) + "</tr>" for r in evals)
    return (f'<h2>Evaluation</h2><table class="grid" id="eval-table"><tr>{head}</tr>{body}'
            "</table><p>Each row: an eval run of k samples per held-out task on the weights "
            "of that step (step 0: before training); the result JSON is in the run dir's "
            "<code>eval/</code> folder (<code>harnessrl eval --compare A B</code>).</p>")


def _num3(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


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
table.grid { border-collapse: collapse; font-size: 13px; }
table.grid th, table.grid td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
table.grid td:first-child, table.grid th:first-child { text-align: left; }
td.up { background: #e3f4e3; } td.down { background: #fbe3e3; }
.tampered { color: #8b0000; }  /* not near COLORS["reward"]: tests find that by colour */
details.tampered { border-left: 3px solid #8b0000; padding-left: 6px; }
table.how td, table.how th { text-align: left; }
"""


def render(run_dir: Path) -> str:
    """The report page of `run_dir` as HTML text; ValueError when it has no metrics."""
    lines = read_jsonl(run_dir / "metrics.jsonl")
    rows = [r for r in lines if r.get("kind") != "eval"]
    evals = [r for r in lines if r.get("kind") == "eval"]
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
    if evals:
        charts.insert(1, _chart("Evaluation (held-out tasks)", "score", _eval_curve(evals)))
    title = f"harnessrl run report: {run_dir.resolve().name}"
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
            f"<h1>{html.escape(title)}</h1>{_summary(rows)}"
            f"<h2>Curves</h2><div class=\"charts\">{''.join(charts)}</div>"
            f"{_eval_table(evals)}"
            f"<h2>Rollouts</h2>{_rollouts(rollouts)}</body></html>\n")


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    out = out or run_dir / "report.html"
    out.write_text(render(run_dir), encoding="utf-8")
    return out


# -- evaluation results (`harnessrl eval`) --------------------------------------------------------

def _cell(v: Any, cls: str = "") -> str:
    attr = f' class="{cls}"' if cls else ""
    return f"<td{attr}>{html.escape(_num3(v))}</td>"


def _signed(d: float | None) -> str:
    if d is None:
        return "<td>-</td>"
    cls = "up" if d > 0 else "down" if d < 0 else ""
    return f'<td class="{cls}">{d:+.3f}</td>' if cls else f"<td>{d:+.3f}</td>"


def _how(r: dict[str, Any]) -> list[tuple[str, str]]:
    m = r.get("model", {})
    return [("model", f"{m.get('kind')} {m.get('path') or m.get('url') or ''}".strip()),
            ("served as", str(m.get("served_name"))),
            ("tasks", f"{r['tasks_evaluated']} of {r['tasks_in_file']} in {r['tasks_file']} "
                      f"(sha256 {str(r['tasks_sha256'])[:12]})"),
            ("k, threshold", f"{r['k']}, reward >= {r['threshold']}"),
            ("sampling", ", ".join(f"{k} {'(the harness’s own)' if v is None else v}"
                                   for k, v in r["sampling"].items())),
            ("harness", " ".join(r["harness"])), ("grader", " ".join(r["grader"]) or "-"),
            ("samples (failed)", f"{r['samples']} ({r['samples_failed']})"),
            ("run", str(r["run_id"])),
            ("timings", ", ".join(f"{k} {v:.0f}" for k, v in r.get("timings", {}).items()))]


def render_eval(results: list[tuple[str, dict[str, Any]]]) -> str:
    """The page of one `harnessrl eval` result, or of two side by side (the second's
    differences from the first)."""
    if not 1 <= len(results) <= 2:
        raise ValueError("one or two results")
    names = [n for n, _ in results]
    rs = [r for _, r in results]
    two = len(rs) == 2
    cols = "".join(f"<th>{html.escape(n)}</th>" for n in names) + ("<th>B - A</th>" if two
                                                                    else "")
    metric_names = list(dict.fromkeys(k for r in rs for k in r["metrics"]))
    mrows = ""
    for name in metric_names:
        vals = [r["metrics"].get(name) for r in rs]
        diff = vals[1] - vals[0] if two and None not in vals else None
        mrows += (f"<tr><td>{html.escape(name)}</td>" + "".join(_cell(v) for v in vals) +
                  (_signed(diff) if two else "") + "</tr>")
    how = "".join(f"<tr><td>{html.escape(label)}</td>" +
                  "".join(f"<td>{html.escape(dict(_how(r))[label])}</td>" for r in rs) +
                  "</tr>" for label, _ in _how(rs[0]))
    how_cols = "".join(f"<th>{html.escape(n)}</th>" for n in names)
    by_id = [{t["task_id"]: t for t in r["tasks"]} for r in rs]
    ids = list(dict.fromkeys(t for d in by_id for t in d))
    trows = ""
    for tid in ids:
        ts = [d.get(tid) for d in by_id]
        cells = "".join(f"<td>{t['c']}/{t['n']}</td>" if t else "<td>-</td>" for t in ts)
        diff = (ts[1]["pass@1"] - ts[0]["pass@1"]) if two and ts[0] and ts[1] else None
        rewards = " | ".join(" ".join("x" if x is None else f"{x:g}" for x in t["rewards"])
                             if t else "-" for t in ts)
        trows += (f"<tr><td>{html.escape(tid)}</td>{cells}" + (_signed(diff) if two else "")
                  + f"<td>{html.escape(rewards)}</td></tr>")
    fails = ""
    for n, r in results:
        items = [(t["task_id"], f) for t in r["tasks"] for f in t["failures"]]
        if items:
            fails += (f"<h3>{html.escape(n)}: {len(items)} failed samples</h3><ul>" +
                      "".join(f"<li><code>{html.escape(tid)}</code> #{f['index']} "
                              f"<code>{html.escape(f['rollout_id'])}</code>: "
                              f"{html.escape(f['reason'])}</li>" for tid, f in items[:200]) +
                      "</ul>")
    title = "harnessrl eval: " + " vs ".join(names)
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
            f"<h1>{html.escape(title)}</h1>"
            f'<table class="grid" id="eval-metrics"><tr><th>metric</th>{cols}</tr>{mrows}'
            f"</table><h2>How</h2><table class=\"grid how\"><tr><th></th>{how_cols}</tr>{how}"
            "</table>"
            f'<h2>Tasks</h2><table class="grid" id="eval-tasks"><tr><th>task</th>'
            f"{''.join(f'<th>{html.escape(n)} passed</th>' for n in names)}"
            f"{'<th>pass@1 B - A</th>' if two else ''}<th>rewards</th></tr>{trows}</table>"
            f"<h2>Failures</h2>{fails or '<p>None: every sample was graded.</p>'}"
            "</body></html>\n")


def write_eval_report(results: list[tuple[str, dict[str, Any]]], out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_eval(results), encoding="utf-8")
    return out


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The `report` verb's flags (cli.py calls this)."""
    p = sub.add_parser("report", help="write an HTML report of a training run (curves, step "
                       "times, rendered rollouts)")
    p.add_argument("run_dir", help="the trainer's output dir (holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="HTML file (default: RUN_DIR/report.html)")
    return p


def cmd_report(args: argparse.Namespace, console: Any) -> int:
    try:
        out = write_report(Path(args.run_dir), Path(args.out) if args.out else None)
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        return 1
    print(out)
    return 0
