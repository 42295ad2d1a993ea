"""BF16 against MXFP8 training on one GPU, side by side: `python -m benchmarks.bench_train [--steps 1000]`.

Runs `train.py trainer=<trainer> model=gem_bf16` and `model=gem_mxfp8`, each in its own process with the same
settings (the GPU config, `--steps` steps, eval at the end on 8 batches, 20 warm-up steps of the schedule), and prints
one table: samples/s over the timed steps and of the median step, MXFP8's ratio to BF16, eval NE and MXFP8's
difference to BF16 in percent, peak memory and its ratio, kernel builds after warm-up, the card. The two runs share the
card and the process set-up, so the ratios are the comparison (the same command on another card gives that card's).
`--history-mean 1024` is the 4x-history run. Set `GEM_LP_SELFCHECK=off` to leave out the first-use self-checks (their
time is not in samples/s either way). JSON under $OUT (or ./.bench_out): `bench_train.json`; the runs' directories
(metrics.json, train.log) under `--workdir`.

`--tiny` runs the same at CPU test sizes (`trainer=cpu`, a small model, a few steps).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchmarks.bench_data import TINY_MODEL, train

PRECISIONS = ("bf16", "mxfp8")
KEYS = ("samples_per_s", "samples_per_s_median_step", "eval_ne", "eval_auc", "peak_mem_bytes",
        "kernel_builds_after_warmup", "steps", "device", "process_s")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_train", description=__doc__.splitlines()[0])
    p.add_argument("--trainer", default="gpu", help="trainer config (default: %(default)s)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--history-mean", type=float, default=None, help="data.history_mean (the GPU config: 256)")
    p.add_argument("--workdir", default=None, help="where the runs go (default: $OUT or ./.bench_out, under "
                                                   "bench_train/); must not hold earlier runs")
    p.add_argument("--tiny", action="store_true", help="CPU test sizes: trainer=cpu, a small model, a few steps")
    p.add_argument("overrides", nargs="*", help="more train.py overrides, for both runs")
    a = p.parse_args(argv)
    if a.steps < 2:
        p.error(f"--steps must be >= 2, got {a.steps}")
    out = Path(os.environ.get("OUT") or ".bench_out")
    work = Path(a.workdir) if a.workdir else out / "bench_train"
    taken = [work / precision for precision in PRECISIONS if (work / precision).exists()]
    if taken:
        p.error(f"{', '.join(map(str, taken))} already exist: give another --workdir (runs are never overwritten)")
    work.mkdir(parents=True, exist_ok=True)
    common = [*a.overrides, "trainer.progress=false", "trainer.tensorboard=false"]
    if a.tiny:
        a.trainer = "cpu"
        common = [*TINY_MODEL, "data.batch_size=16", "trainer.num_threads=1", *common]
    if a.history_mean is not None:
        common.append(f"data.history_mean={a.history_mean:g}")
    base = [f"trainer={a.trainer}", *common, f"trainer.max_steps={a.steps}", f"trainer.eval_every={a.steps}",
            "trainer.eval_batches=8", f"trainer.warmup_steps={min(20, a.steps // 2)}",
            f"trainer.checkpoint_every={a.steps}"]
    runs = {precision: train(work / precision, [*base, f"model=gem_{precision}"]) for precision in PRECISIONS}
    bf16, mx = runs["bf16"], runs["mxfp8"]
    result = {"trainer": a.trainer, "steps": a.steps, "overrides": common,
              "runs": {name: {k: m.get(k) for k in KEYS} for name, m in runs.items()},
              "samples_per_s_ratio": mx["samples_per_s"] / bf16["samples_per_s"],
              "median_step_ratio": mx["samples_per_s_median_step"] / bf16["samples_per_s_median_step"],
              "eval_ne_diff_percent": 100 * (mx["eval_ne"] / bf16["eval_ne"] - 1),
              "peak_mem_ratio": mx["peak_mem_bytes"] / bf16["peak_mem_bytes"] if bf16["peak_mem_bytes"] else None}
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_train.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\ndevice {bf16['device']}, trainer={a.trainer}, {a.steps} steps" +
          (f", history mean {a.history_mean:g}" if a.history_mean is not None else ""))
    print(f"{'precision':<10} {'samples/s':>10} {'median step':>12} {'eval NE':>8} {'peak GB':>8} {'builds':>7}")
    for name, m in runs.items():
        print(f"{name:<10} {m['samples_per_s']:>10,.0f} {m['samples_per_s_median_step']:>12,.0f} {m['eval_ne']:>8.4f} "
              f"{m['peak_mem_bytes'] / 1e9:>8.2f} {m['kernel_builds_after_warmup']:>7}")
    peak = f"{result['peak_mem_ratio']:.2f}x" if result["peak_mem_ratio"] else "n/a"
    print(f"mxfp8 / bf16: samples/s {result['samples_per_s_ratio']:.3f}x (median step "
          f"{result['median_step_ratio']:.3f}x), eval NE {result['eval_ne_diff_percent']:+.2f}%, peak memory {peak}")
    return result


if __name__ == "__main__":
    main()
