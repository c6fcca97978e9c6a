"""`agentgym report <run-dir>`: the run's curves as PNGs and one self-contained HTML page.

Figures: reward and success rate vs step; turns used vs step with the horizon schedule overlaid
(AgentGym-RL's Fig. 7); failed / truncated rates; pass@k and max-turn sweep curves from eval results
(`<run>/eval/*.json`, written by `agentgym eval --out`). Plus a short text summary.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: is it a run directory?")
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line of a killed run
    by_step = {int(r["step"]): r for r in rows if "step" in r}  # a resumed run may repeat a step: keep the last
    return [by_step[s] for s in sorted(by_step)]


def env_series(rows: list[dict[str, Any]], key: str, env: str = "all") -> list[float]:
    return [float(r.get("env", {}).get(env, {}).get(key, float("nan"))) for r in rows]


def _figure(
    path: Path,
    title: str,
    xlabel: str,
    series: list[tuple[str, list[float], list[float], str]],
    ylabel: str,
    ylim: tuple[float, float] | None = None,
    log_x: bool = False,
) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, xs, ys, style in series:
        ax.plot(xs, ys, style, label=label)
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def make_report(run_dir: Path, out_dir: Path | None = None) -> dict[str, Any]:
    """Write the PNGs, report.html and summary.txt; return paths and the summary numbers."""
    out = out_dir or run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl holds no step yet")
    steps = [float(r["step"]) for r in rows]
    figures: list[Path] = []
    figures.append(
        _figure(
            out / "reward_success.png",
            "Reward and success rate",
            "step",
            [
                ("reward (mean)", steps, env_series(rows, "reward_mean"), "-o"),
                ("success rate", steps, env_series(rows, "success_rate"), "-s"),
            ],
            "value",
            (0, 1.05),
        )
    )
    figures.append(
        _figure(
            out / "turns_horizon.png",
            "Turns used and the horizon schedule",
            "step",
            [
                ("turns used (mean)", steps, env_series(rows, "turns_mean"), "-o"),
                ("horizon (max turns)", steps, [float(r.get("horizon", float("nan"))) for r in rows], "--"),
            ],
            "turns",
        )
    )
    figures.append(
        _figure(
            out / "failed_truncated.png",
            "Failed and truncated episodes",
            "step",
            [
                ("truncated (hit the horizon)", steps, env_series(rows, "truncation_rate"), "-o"),
                ("failed (errors)", steps, env_series(rows, "failed_rate"), "-s"),
                ("invalid actions", steps, env_series(rows, "invalid_action_rate"), ":"),
            ],
            "rate",
            (0, 1.05),
        )
    )
    evals = sorted((run_dir / "eval").glob("*.json")) if (run_dir / "eval").exists() else []
    eval_summaries = []
    for path in evals:
        result = json.loads(path.read_text())
        by_turns = result.get("by_max_turns", {})
        if not by_turns:
            continue
        name = path.stem
        last = by_turns[max(by_turns, key=int)]
        ks = sorted(last.get("pass@k", {}), key=int)
        figures.append(
            _figure(
                out / f"eval_{name}_pass_at_k.png",
                f"pass@k ({name})",
                "k",
                [
                    (
                        f"max turns {max(by_turns, key=int)}",
                        [float(k) for k in ks],
                        [last["pass@k"][k] for k in ks],
                        "-o",
                    ),
                ],
                "pass@k",
                (0, 1.05),
            )
        )
        turns = sorted(by_turns, key=int)
        avg_key = next((k for k in last if k.startswith("avg@")), None)
        if len(turns) > 1 and avg_key:
            figures.append(
                _figure(
                    out / f"eval_{name}_turn_sweep.png",
                    f"Max-turn sweep ({name})",
                    "max turns",
                    [
                        (avg_key, [float(t) for t in turns], [by_turns[t][avg_key] for t in turns], "-o"),
                    ],
                    "success",
                    (0, 1.05),
                )
            )
        eval_summaries.append((name, last))
    scaling_text, scaling_figures = _test_time_scaling(out, evals)
    figures += scaling_figures

    first, last_row = rows[0], rows[-1]
    summary = {
        "steps": len(rows),
        "first_step": int(first["step"]),
        "last_step": int(last_row["step"]),
        "success_first": first.get("env", {}).get("all", {}).get("success_rate"),
        "success_last": last_row.get("env", {}).get("all", {}).get("success_rate"),
        "reward_first": first.get("env", {}).get("all", {}).get("reward_mean"),
        "reward_last": last_row.get("env", {}).get("all", {}).get("reward_mean"),
        "horizons": sorted({int(r["horizon"]) for r in rows if "horizon" in r}),
    }
    text = (
        f"{summary['steps']} steps ({summary['first_step']}..{summary['last_step']}); success rate "
        f"{_fmt(summary['success_first'])} -> {_fmt(summary['success_last'])}; reward "
        f"{_fmt(summary['reward_first'])} -> {_fmt(summary['reward_last'])}; horizons {summary['horizons']}"
    )
    for name, result in eval_summaries:
        text += f"\neval {name}: " + ", ".join(f"pass@{k} {v:.3f}" for k, v in result.get("pass@k", {}).items())
    text += scaling_text
    (out / "summary.txt").write_text(text + "\n")
    body = "".join(
        f'<figure><img alt="{html.escape(p.stem)}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}"><figcaption>{html.escape(p.stem)}</figcaption></figure>'
        for p in figures
    )
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>agentgym report: {html.escape(run_dir.name)}"
        "</title><style>body{font-family:sans-serif;max-width:960px;margin:2em auto}figure{display:inline-block;"
        "margin:.5em}pre{background:#f4f4f4;padding:1em}</style></head><body>"
        f"<h1>{html.escape(run_dir.name)}</h1><pre>{html.escape(text)}</pre>{body}</body></html>"
    )
    (out / "report.html").write_text(page)
    return {"summary": summary, "text": text, "figures": [str(p) for p in figures], "html": str(out / "report.html")}


def _test_time_scaling(out: Path, evals: list[Path]) -> tuple[str, list[Path]]:
    """The paper's test-time scaling figures over every eval file that swept them, overlaid (e.g. the base policy
    against the trained one): success vs the max-turn budget (Fig. 8) and pass@k vs k (Fig. 9, unbiased pass@k)."""
    sweeps: list[tuple[str, dict[str, Any]]] = []
    for path in evals:
        by_turns = json.loads(path.read_text()).get("by_max_turns", {})
        if by_turns:
            sweeps.append((path.stem, by_turns))
    text, figures = "", []
    turn_sweeps = [(name, by_turns) for name, by_turns in sweeps if len(by_turns) > 1]
    if turn_sweeps:
        series = []
        for name, by_turns in turn_sweeps:
            turns = sorted(by_turns, key=int)
            series.append((name, [float(t) for t in turns], [float(by_turns[t]["success"]) for t in turns], "-o"))
            text += f"\nsuccess by max turns ({name}): " + ", ".join(
                f"{t}: {by_turns[t]['success']:.2f}" for t in turns
            )
        figures.append(
            _figure(out / "test_time_max_turns.png", "Test-time scaling: max turns", "max turns", series,
                    "success", (0, 1.05))
        )  # fmt: skip
    k_sweeps = [
        (name, by_turns[max(by_turns, key=int)]["pass@k"], max(by_turns, key=int))
        for name, by_turns in sweeps
        if len(by_turns[max(by_turns, key=int)].get("pass@k", {})) > 1
    ]
    if k_sweeps:
        series = []
        for name, passes, budget in k_sweeps:
            ks = sorted(passes, key=int)
            series.append((f"{name} ({budget} turns)", [float(k) for k in ks], [float(passes[k]) for k in ks], "-o"))
            text += f"\npass@k at {budget} turns ({name}): " + ", ".join(f"{k}: {passes[k]:.2f}" for k in ks)
        path = _figure(out / "test_time_pass_at_k.png", "Test-time scaling: parallel samples", "k", series,
                       "pass@k", (0, 1.05), log_x=True)  # fmt: skip
        figures.append(path)
    return text, figures


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{float(value):.3f}"
