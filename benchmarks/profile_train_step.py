"""Where a training step's time goes: host (Python, dispatch, launches) against GPU (kernels), by torch.profiler.

    python -m benchmarks.profile_train_step trainer=gpu model=gem_mxfp8 [overrides ...] [--steps 20] [--trace t.json]
    python -m benchmarks.profile_train_step trainer=gpu model=gem_mxfp8 --python   # cProfile of the host instead

Builds the trainer from the same Hydra configs as `train.py` (a temporary run directory), runs warm-up steps
(every kernel built), then profiles `--steps` steps and prints per step: the wall time, the GPU's kernel time, the
host time (wall less the time the host waits in synchronizing calls), and the kernels and host ops that cost the
most; the JSON under `$OUT` lists every kernel's time and calls per step. When host time is above GPU time, the GPU
waits for the host. `--python` runs the same steps under cProfile instead (no torch.profiler), prints the Python
functions that take the host's time and writes the profile to `$OUT/profile_train_step_python.prof`.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import os
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_module
from torch.profiler import ProfilerActivity, profile

# host calls that block until the GPU has caught up: their time is GPU time seen from the host
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    parser.add_argument("--warmup", type=int, default=30, help="steps before profiling (builds, allocator)")
    parser.add_argument("--steps", type=int, default=20, help="profiled steps")
    parser.add_argument("--trace", help="also write a Chrome trace here (must not exist)")
    parser.add_argument("--python", action="store_true", help="profile the host's Python (cProfile) instead")
    args = parser.parse_args()
    if args.trace and os.path.exists(args.trace):
        parser.error(f"--trace {args.trace} exists; give a new path")
    from gem_lp.train.trainer import Trainer

    with initialize_config_module(config_module="gem_lp.configs", version_base=None):
        cfg = compose(config_name="config", overrides=args.overrides)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, run_dir)
        if trainer.device.type != "cuda":
            parser.error("profiles a CUDA run: add trainer=gpu")
        loader = iter(trainer._train_loader())
        # data loading stays out of the profile; every step gets a batch of its own (new token counts, as in a run)
        batches = [next(loader) for _ in range(args.warmup + args.steps * (2 if args.python else 1))]
        for i, batch in enumerate(batches[:args.warmup]):
            trainer.train_step(batch, i + 1)
        torch.cuda.synchronize()
        if args.python:
            python_profile(trainer, batches[args.warmup:], args.warmup, args.steps)
            return
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for i, batch in enumerate(batches[args.warmup:]):
                trainer.train_step(batch, args.warmup + i + 1)
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
    events = prof.key_averages()
    gpu_ms = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    gpu_ms = gpu_ms / 1e3 / args.steps
    waits_ms = sum(e.self_cpu_time_total for e in events if e.key in SYNC_CALLS) / 1e3 / args.steps
    host_ms = wall_ms - waits_ms
    result = {"config": args.overrides, "steps": args.steps, "wall_ms_per_step": wall_ms,
              "gpu_kernel_ms_per_step": gpu_ms, "host_ms_per_step": host_ms, "host_wait_ms_per_step": waits_ms,
              "samples_per_s": trainer.dcfg.batch_size * 1e3 / wall_ms, **trainer._sequence_graph_metrics(),
              # every kernel of the step (the tables below show the top 15): where two precisions differ
              "kernels": sorted(({"name": e.key, "ms_per_step": e.self_device_time_total / 1e3 / args.steps,
                                  "calls_per_step": e.count / args.steps}
                                 for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                                 and e.self_device_time_total > 0), key=lambda k: -k["ms_per_step"])}
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    out = Path(os.environ.get("OUT", ".bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    name = "profile_train_step_" + "_".join(o.replace("=", "-").replace("/", "-") for o in args.overrides)
    (out / f"{name[:150]}.json").write_text(json.dumps(result, indent=1))
    print(f"per step: wall {wall_ms:.2f} ms, GPU kernels {gpu_ms:.2f} ms, host {host_ms:.2f} ms "
          f"(waiting in syncs {waits_ms:.2f} ms), {result['samples_per_s']:,.0f} samples/s; encoder graphs "
          f"{result['sequence_graphs']}, eager batches {result['sequence_graph_eager_batches']}")


def python_profile(trainer, batches: list, first_step: int, steps: int) -> None:
    """The host's time per step by Python function (cProfile), with the unprofiled step time for scale: `steps`
    steps without the profiler, then `steps` under it, each on batches of its own."""
    start = time.perf_counter()
    for i, batch in enumerate(batches[:steps]):
        trainer.train_step(batch, first_step + i + 1)
    torch.cuda.synchronize()
    plain_ms = (time.perf_counter() - start) * 1e3 / steps
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for i, batch in enumerate(batches[steps:]):
        trainer.train_step(batch, first_step + steps + i + 1)
    torch.cuda.synchronize()
    profiler.disable()
    profiled_ms = (time.perf_counter() - start) * 1e3 / steps
    out = Path(os.environ.get("OUT", ".bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(out / "profile_train_step_python.prof")  # for pstats / snakeviz
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(45)
        print(text.getvalue())
    print(f"per step: {plain_ms:.2f} ms unprofiled, {profiled_ms:.2f} ms under cProfile ({steps} steps; the "
          f"table's times are totals over them)")


if __name__ == "__main__":
    main()
