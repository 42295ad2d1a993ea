"""Sweep report: `python -m gem_lp.report <multirun dir>` -> `report.md` and `curves.png` in that directory.

Finds every run below the directory (a directory with `metrics.json` or a Hydra `.hydra/config.yaml`),
tabulates the final metrics, and gives the eval-NE gap of each MXFP8 run against the BF16 run whose
composed config (`.hydra/config.yaml`) is the same in everything but `model.precision` (and `resume`); where
there is none, the one BF16 run that also differs in `model.qk_rotation`, which belongs to the MXFP8 recipe
(`gem_mxfp8` rotates q and k, `gem_bf16` does not): `100 * (NE_mxfp8 - NE_bf16) / NE_bf16`, positive = MXFP8 worse. Runs it cannot pair, and runs without
`metrics.json` (killed, failed or still running), are listed in the report and on stderr.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import warnings
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

REQUIRED = ("precision", "steps", "train_loss", "eval_loss", "eval_auc", "eval_ne", "samples_per_s",
            "peak_mem_bytes", "device")
NOT_COMPARED = ("model.precision", "resume")  # what a BF16 run and its MXFP8 partner may differ in
# ... and, where no BF16 run equals an MXFP8 run in it, these parts of the MXFP8 recipe too
RECIPE_KEYS = ("model.qk_rotation",)
DEFAULT_TRAIN_LOSS_WINDOW = 50  # metrics.json's train_loss window where the run did not record it


def find_run_dirs(root: Path) -> list[Path]:
    """Directories below `root` (itself included) that hold `metrics.json` or `.hydra/config.yaml`."""
    found = {p.parent for p in root.rglob("metrics.json")}
    found |= {p.parent.parent for p in root.rglob(".hydra/config.yaml")}
    return sorted(found)


def _pair_key(config: dict[str, Any], not_compared: tuple[str, ...] = NOT_COMPARED) -> str:
    config = json.loads(json.dumps(config))
    for dotted in not_compared:
        *parents, leaf = dotted.split(".")
        node = config
        for name in parents:
            node = node.get(name, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(leaf, None)
    return json.dumps(config, sort_keys=True)


def load_runs(root: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The runs below `root` with metrics (their metrics plus `name`, `overrides` and `pair_key`, None when the
    run has no `.hydra/config.yaml`), and the names of the run directories without `metrics.json`."""
    runs, without_metrics = [], []
    for run_dir in find_run_dirs(root):
        name = str(run_dir.relative_to(root)) if run_dir != root else "."
        metrics_file = run_dir / "metrics.json"
        if not metrics_file.is_file():
            without_metrics.append(name)
            continue
        metrics = json.loads(metrics_file.read_text())
        missing = [k for k in REQUIRED if k not in metrics]
        if missing:
            raise ValueError(f"{metrics_file}: metrics.json lacks {missing}")
        hydra_dir = run_dir / ".hydra"
        overrides: list[str] = []
        if (hydra_dir / "overrides.yaml").is_file():
            overrides = [line[2:].strip() for line in (hydra_dir / "overrides.yaml").read_text().splitlines()
                         if line.startswith("- ")]
        key = recipe_key = None
        if (hydra_dir / "config.yaml").is_file():
            from omegaconf import OmegaConf

            config = OmegaConf.to_container(OmegaConf.load(hydra_dir / "config.yaml"), resolve=False)
            key, recipe_key = _pair_key(config), _pair_key(config, NOT_COMPARED + RECIPE_KEYS)
        runs.append({**metrics, "name": name, "pair_key": key, "recipe_key": recipe_key, "overrides": overrides})
    if not runs and not without_metrics:
        raise FileNotFoundError(f"no runs below {root}; pass the directory of a `python train.py -m` sweep")
    return runs, without_metrics


def ne_gaps(runs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """The relative eval-NE gap (%) of each mxfp8 run against the one bf16 run with the same pair key (else the one
    with the same key but for `RECIPE_KEYS`), and the runs left unpaired, each with the reason."""
    gaps, unpaired = [], []
    bf16_partnered: set[str] = set()
    for r in runs:
        if r["precision"] not in ("bf16", "mxfp8"):
            unpaired.append({"run": r["name"],
                             "reason": f"precision {r['precision']}: only MXFP8 and BF16 are compared"})
            continue
        if r["pair_key"] is None:
            unpaired.append({"run": r["name"], "reason": "no .hydra/config.yaml to pair it by"})
            continue
        if r["precision"] != "mxfp8":
            continue
        partners = [b for b in runs if b["precision"] == "bf16" and b["pair_key"] == r["pair_key"]]
        if not partners and r.get("recipe_key") is not None:
            partners = [b for b in runs if b["precision"] == "bf16" and b.get("recipe_key") == r["recipe_key"]]
        if len(partners) != 1:
            reason = ("no BF16 run with the same config but the precision" if not partners else
                      "several BF16 runs with the same config: " + ", ".join(b["name"] for b in partners))
            unpaired.append({"run": r["name"], "reason": reason})
            continue
        base = partners[0]
        bf16_partnered.add(base["name"])
        gap = 100.0 * (r["eval_ne"] - base["eval_ne"]) / base["eval_ne"]
        gaps.append({"mxfp8": r["name"], "bf16": base["name"], "ne_gap_pct": gap,
                     "auc_delta": r["eval_auc"] - base["eval_auc"],
                     "speed_ratio": r["samples_per_s"] / base["samples_per_s"] if base["samples_per_s"] else math.nan})
    for r in runs:
        if r["precision"] == "bf16" and r["pair_key"] is not None and r["name"] not in bf16_partnered:
            unpaired.append({"run": r["name"], "reason": "no MXFP8 run with the same config but the precision"})
    return gaps, unpaired


def _fmt(x: Any, spec: str) -> str:
    if x is None:
        return "-"
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)


def render_markdown(runs: list[dict[str, Any]], gaps: list[dict[str, Any]], curves: str | None,
                    unpaired: list[dict[str, str]] = (), without_metrics: list[str] = ()) -> str:
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
    if not runs:
        lines += ["No run has metrics.json yet.", ""]
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
        lines += ["No MXFP8/BF16 pair with otherwise equal configs: no NE gap computed.", ""]
    if unpaired:
        lines += ["## Runs not paired", "", "| run | why |", "| --- | --- |"]
        lines += [f"| {u['run']} | {u['reason']} |" for u in unpaired]
        lines.append("")
    if without_metrics:
        lines += ["## Runs without metrics.json", "",
                  "Killed, failed or still running; not in the tables above:", ""]
        lines += [f"- {name}" for name in without_metrics]
        lines.append("")
    if runs:
        lines.append(f"![loss and AUC curves]({curves})" if curves
                     else "(curves.png not written: matplotlib unavailable)")
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


def curve_window(runs: list[dict[str, Any]]) -> int:
    """Steps the training-loss curves average over: the window of metrics.json's `train_loss` (one for all runs)."""
    windows = {r.get("train_loss_window", DEFAULT_TRAIN_LOSS_WINDOW) for r in runs}
    return windows.pop() if len(windows) == 1 else DEFAULT_TRAIN_LOSS_WINDOW


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
    window = curve_window(runs)
    for r in runs:
        label = r["name"] if r["precision"] in r["name"] else f"{r['name']} ({r['precision']})"
        losses = r.get("train_loss_history") or []
        if losses:
            line, = ax_loss.plot(range(1, len(losses) + 1), _smooth(losses, window), label=f"{label} train", alpha=0.8)
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
    ax_loss.set(xlabel="step", ylabel="BCE loss",
                title=f"loss (train: {window}-step mean, as metrics.json's train_loss)")
    ax_auc.set(xlabel="step", ylabel="AUC", title="eval AUC")
    for ax in (ax_loss, ax_auc):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
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
    runs, without_metrics = load_runs(root)
    gaps, unpaired = ne_gaps(runs)
    for u in unpaired:
        log.warning("%s: not paired (%s)", u["run"], u["reason"])
    if without_metrics:
        log.warning("runs without metrics.json (killed, failed or still running): %s", ", ".join(without_metrics))
    curves = "curves.png" if runs and plot_curves(runs, root / "curves.png") else None
    report = root / "report.md"
    report.write_text(render_markdown(runs, gaps, curves, unpaired, without_metrics))
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
