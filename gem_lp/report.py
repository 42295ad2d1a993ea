"""Sweep report: `python -m gem_lp.report <multirun dir>` -> `report.md` and `curves.png` in that directory.

Reads every `metrics.json` below the directory (one per run of `python train.py -m ...`), tabulates
the final metrics, and gives the eval-NE gap of each MXFP8 run against the BF16 run with the same
other overrides (same seed, sizes, ...): `100 * (NE_mxfp8 - NE_bf16) / NE_bf16`, positive = MXFP8 worse.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

PRECISION_KEYS = ("model", "model.precision")
REQUIRED = ("precision", "steps", "train_loss", "eval_loss", "eval_auc", "eval_ne", "samples_per_s",
            "peak_mem_bytes", "device")


def load_runs(root: Path) -> list[dict[str, Any]]:
    """Every run below `root`: its metrics plus `name` (path relative to root) and `pair_key`."""
    runs = []
    for path in sorted(root.rglob("metrics.json")):
        metrics = json.loads(path.read_text())
        missing = [k for k in REQUIRED if k not in metrics]
        if missing:
            raise ValueError(f"{path}: metrics.json lacks {missing}")
        run_dir = path.parent
        overrides_file = run_dir / ".hydra" / "overrides.yaml"
        overrides: list[str] = []
        if overrides_file.is_file():
            overrides = [line[2:].strip() for line in overrides_file.read_text().splitlines() if line.startswith("- ")]
        # Runs pair up when they differ only in the precision: the model choice (gem_bf16 / gem_mxfp8) or
        # model.precision. Other model keys (model.qk_rotation=..., sizes) must match.
        key = tuple(sorted(o for o in overrides if o.split("=")[0].lstrip("+~") not in PRECISION_KEYS))
        runs.append({**metrics, "name": str(run_dir.relative_to(root)) or ".", "pair_key": key,
                     "overrides": overrides})
    if not runs:
        raise FileNotFoundError(f"no metrics.json below {root}; pass the directory of a `python train.py -m` sweep")
    return runs


def ne_gaps(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Relative eval-NE gap (%) of each mxfp8 run against the bf16 run with the same pair key."""
    bf16 = {}
    for r in runs:
        if r["precision"] == "bf16":
            bf16.setdefault(r["pair_key"], r)
    gaps = []
    for r in runs:
        base = bf16.get(r["pair_key"])
        if r["precision"] == "mxfp8" and base is not None:
            gap = 100.0 * (r["eval_ne"] - base["eval_ne"]) / base["eval_ne"]
            gaps.append({"mxfp8": r["name"], "bf16": base["name"], "ne_gap_pct": gap,
                         "auc_delta": r["eval_auc"] - base["eval_auc"],
                         "speed_ratio": r["samples_per_s"] / base["samples_per_s"] if base["samples_per_s"] else math.nan})
    return gaps


def _fmt(x: Any, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)


def render_markdown(runs: list[dict[str, Any]], gaps: list[dict[str, Any]], curves: str | None) -> str:
    lines = ["# Sweep report", ""]
    lines += ["| run | precision | steps | train loss | eval loss | eval AUC | teacher AUC | eval NE | teacher NE "
              "| samples/s | peak mem (MiB) | device |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in runs:
        lines.append(
            f"| {r['name']} | {r['precision']} | {r['steps']} | {_fmt(r['train_loss'], '.4f')} | "
            f"{_fmt(r['eval_loss'], '.4f')} | {_fmt(r['eval_auc'], '.4f')} | {_fmt(r.get('teacher_auc', '-'), '.4f')} | "
            f"{_fmt(r['eval_ne'], '.4f')} | {_fmt(r.get('teacher_ne', '-'), '.4f')} | {_fmt(r['samples_per_s'], ',.0f')} | "
            f"{r['peak_mem_bytes'] / 2**20:,.0f} | {r['device']} |")
    lines.append("")
    stalled = [r for r in runs if r.get("kernel_builds_after_warmup")]
    if stalled:
        lines += ["Triton kernels were built during timed steps of " + ", ".join(
            f"{r['name']} ({r['kernel_builds_after_warmup']} builds; a typical step: "
            f"{_fmt(r.get('samples_per_s_median_step', '-'), ',.0f')} samples/s)" for r in stalled)
            + ": their samples/s count those builds.", ""]
    if any(r["device"] == "cpu" for r in runs):
        lines += ["On the CPU, peak memory is the process's peak resident set size; the runs of one "
                  "`train.py -m` sweep share a process, so a later run's figure includes the earlier ones.", ""]
    if gaps:
        lines += ["## MXFP8 vs BF16", "",
                  "NE gap = 100 * (NE_mxfp8 - NE_bf16) / NE_bf16 (positive: MXFP8 worse).", "",
                  "| mxfp8 run | bf16 run | NE gap (%) | AUC delta | speed (mxfp8 / bf16) |",
                  "| --- | --- | ---: | ---: | ---: |"]
        for g in gaps:
            lines.append(f"| {g['mxfp8']} | {g['bf16']} | {g['ne_gap_pct']:+.3f} | {g['auc_delta']:+.4f} | "
                         f"{g['speed_ratio']:.2f}x |")
        lines.append("")
    else:
        lines += ["No MXFP8/BF16 pair with otherwise equal overrides: no NE gap computed.", ""]
    lines.append(f"![loss and AUC curves]({curves})" if curves else "(curves.png not written: matplotlib unavailable)")
    lines.append("")
    return "\n".join(lines)


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_curves(runs: list[dict[str, Any]], path: Path) -> bool:
    """Training loss (smoothed), eval loss and eval AUC against steps for every run; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        warnings.warn(f"curves.png not written ({err})")
        return False
    fig, (ax_loss, ax_auc) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in runs:
        label = r["name"] if r["precision"] in r["name"] else f"{r['name']} ({r['precision']})"
        losses = r.get("train_loss_history") or []
        if losses:
            line, = ax_loss.plot(range(1, len(losses) + 1), _smooth(losses, 25), label=f"{label} train", alpha=0.8)
            color = line.get_color()
        else:
            color = None
        history = r.get("eval_history") or []
        if history:
            steps = [p["step"] for p in history]
            ax_loss.plot(steps, [p["eval_loss"] for p in history], "o--", color=color, label=f"{label} eval")
            ax_auc.plot(steps, [p["eval_auc"] for p in history], "o-", color=color, label=label)
    teacher = [r["teacher_auc"] for r in runs if isinstance(r.get("teacher_auc"), (int, float))]
    if teacher:
        ax_auc.axhline(teacher[0], color="gray", linestyle=":", label="teacher (best achievable)")
    ax_loss.set(xlabel="step", ylabel="BCE loss", title="loss (train: 25-step mean)")
    ax_auc.set(xlabel="step", ylabel="AUC", title="eval AUC")
    for ax in (ax_loss, ax_auc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(root: str | Path) -> Path:
    """Write `report.md` (and `curves.png`) into `root`; returns the report's path."""
    root = Path(root)
    if not root.is_dir():
        raise NotADirectoryError(f"multirun dir {root} does not exist")
    runs = load_runs(root)
    gaps = ne_gaps(runs)
    curves = "curves.png" if plot_curves(runs, root / "curves.png") else None
    report = root / "report.md"
    report.write_text(render_markdown(runs, gaps, curves))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gem_lp.report", description=__doc__.splitlines()[0])
    parser.add_argument("multirun_dir", help="directory of a `python train.py -m ...` sweep")
    args = parser.parse_args(argv)
    report = write_report(args.multirun_dir)
    print(report.read_text())
    print(f"wrote {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
