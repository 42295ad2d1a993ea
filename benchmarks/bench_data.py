"""Training throughput on Parquet logs against the synthetic source: `python -m benchmarks.bench_data`.

Writes the synthetic task's training batches (the `trainer=<trainer>` sizes: on the GPU, batch 1024, histories of
mean 256) into a Parquet file, one row per sample with every feature as a column, so that `data=parquet` reads the
very batches of the same shape that `data=synthetic` generates. Then runs `train.py` twice, each in its own process
and with the same settings (`trainer=gpu`, `--steps` steps, loader workers as the trainer config sets them): on the
synthetic source and on the Parquet file. Prints the samples/s of both (metrics.json's `samples_per_s`: training
steps after the first 5, eval excluded) and their ratio; the aim is Parquet within 10% of synthetic. A short
synthetic run first builds the kernels (`--no-warmup` skips it). JSON under $OUT (or ./.bench_out):
`bench_data.json`.

`--tiny` runs the same at CPU test sizes (`trainer=cpu`, a small model, a few steps).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN_PY = ROOT / "train.py"
TINY_MODEL = ["model.embedding_dim=32", "model.d_model=32", "model.head_dim=32", "model.num_blocks=1",
              "model.mlp_hidden=32", "model.dense_hidden=32", "model.head_hidden=32"]


def synthetic_config(trainer: str, overrides: list[str]):
    """The `SyntheticDataConfig` that `python train.py trainer=<trainer> <overrides>` trains on."""
    from hydra import compose, initialize_config_dir

    from gem_lp.train.config import load_run_config

    with initialize_config_dir(config_dir=str(ROOT / "gem_lp" / "configs"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"trainer={trainer}", *overrides])
    return load_run_config(cfg).data


def write_synthetic_parquet(cfg, rows: int, path: Path, seed: int = 0) -> dict:
    """The first `rows` training samples of the synthetic task (seed `seed`) as Parquet rows; returns the
    `data=parquet` settings that read them back as the same batches."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from gem_lp.data import CAND_ITEM, HIST_ACTION, HIST_GAP, HIST_ITEM, SyntheticRecDataset

    def lists(kjt, key):
        jt = kjt[key]
        offsets = jt.offsets().to(torch.int32).numpy()
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(jt.values().numpy()))

    dense_names = [f"dense_{j}" for j in range(cfg.num_dense)]
    writer = None
    written = 0
    for batch in SyntheticRecDataset(cfg, seed, "train", num_batches=-(-rows // cfg.batch_size)):
        n = min(batch.batch_size, rows - written)
        batch = batch.samples(0, n)
        seq, sparse = batch.sequence_features, batch.sparse_features
        columns = {"label": pa.array(batch.labels.numpy()),
                   **{key: lists(seq, key) for key in (HIST_ITEM, HIST_ACTION, HIST_GAP)},
                   CAND_ITEM: pa.array(seq[CAND_ITEM].values().numpy()),
                   **{f.name: lists(sparse, f.name) for f in cfg.sparse_features},
                   **{name: pa.array(batch.dense_features[:, j].numpy()) for j, name in enumerate(dense_names)}}
        table = pa.table(columns)
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
        written += n
    writer.close()
    return {"path": str(path), "label": "label", "history_item": HIST_ITEM, "candidate_item": CAND_ITEM,
            "num_items": cfg.num_items, "batch_size": cfg.batch_size,
            "event_features": [{"column": HIST_ACTION, "num_embeddings": cfg.num_actions},
                               {"column": HIST_GAP, "num_embeddings": cfg.num_time_buckets}],
            "pooled_features": [{"column": f.name, "num_embeddings": f.num_embeddings} for f in cfg.sparse_features],
            "dense_features": dense_names, "dense_standardize": False}  # the synthetic batches' values as they are


def parquet_overrides(data: dict) -> list[str]:
    out = ["data=parquet"]
    for key, value in data.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            value = "[" + ", ".join("{" + ", ".join(f"{k}: {v}" for k, v in f.items()) + "}" for f in value) + "]"
        elif isinstance(value, list):
            value = "[" + ",".join(value) + "]"
        out.append(f"data.{key}={value}")
    return out


def train(run_dir: Path, overrides: list[str]) -> dict:
    """`python train.py <overrides>` in its own process; returns its metrics.json."""
    command = [sys.executable, str(TRAIN_PY), f"hydra.run.dir={run_dir}", *overrides]
    started = time.perf_counter()
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # the project, then the caller's
    done = subprocess.run(command, cwd=run_dir.parent, env={**os.environ, "PYTHONPATH": path},
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n"
                           f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    metrics["process_s"] = time.perf_counter() - started
    return metrics


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_data", description=__doc__.splitlines()[0])
    p.add_argument("--trainer", default="gpu", help="trainer config (default: %(default)s)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rows", type=int, default=131072, help="Parquet rows written (epochs wrap around them)")
    p.add_argument("--workdir", default=None, help="where the Parquet file and the runs go (default: $OUT or "
                                                   "./.bench_out, under bench_data/)")
    p.add_argument("--no-warmup", action="store_true", help="skip the kernel-building synthetic run")
    p.add_argument("--tiny", action="store_true", help="CPU test sizes: trainer=cpu, a small model, a few steps")
    p.add_argument("overrides", nargs="*", help="more train.py overrides, for both runs (e.g. model=gem_mxfp8)")
    a = p.parse_args(argv)
    out = Path(os.environ.get("OUT") or ".bench_out")
    work = Path(a.workdir) if a.workdir else out / "bench_data"
    work.mkdir(parents=True, exist_ok=True)
    common = [*a.overrides, "trainer.progress=false", "trainer.tensorboard=false"]
    if a.tiny:
        a.trainer = "cpu"
        common = [*TINY_MODEL, "data.batch_size=16", "trainer.num_threads=1", *common]
    steps = [f"trainer.max_steps={a.steps}", f"trainer.eval_every={a.steps}", "trainer.eval_batches=2",
             f"trainer.checkpoint_every={a.steps}", f"trainer.warmup_steps={min(50, a.steps // 2)}"]
    cfg = synthetic_config(a.trainer, [o for o in common if o.startswith("data.")])
    path = work / "synthetic.parquet"
    started = time.perf_counter()
    data = write_synthetic_parquet(cfg, a.rows, path)
    write_s = time.perf_counter() - started
    print(f"wrote {a.rows:,} synthetic samples (batch {cfg.batch_size}, history mean {cfg.history_mean:g}) to {path} "
          f"in {write_s:.0f} s", flush=True)
    base = [f"trainer={a.trainer}", *common, *steps]
    parquet_data = [o for o in parquet_overrides(data) if not o.startswith("data.batch_size=")]
    parquet_data.append(f"data.batch_size={cfg.batch_size}")
    parquet_base = [f"trainer={a.trainer}", *parquet_data, *(o for o in common if not o.startswith("data.")), *steps]
    if not a.no_warmup:
        warm = max(2, min(20, a.steps))
        train(work / "warmup", [f"trainer={a.trainer}", *common, f"trainer.max_steps={warm}", "trainer.eval_batches=1",
                                f"trainer.eval_every={warm}", f"trainer.checkpoint_every={warm}", "trainer.warmup_steps=1"])
    runs = {"synthetic": train(work / "synthetic", base), "parquet": train(work / "parquet", parquet_base)}
    keys = ("samples_per_s", "samples_per_s_median_step", "kernel_builds_after_warmup", "steps", "device",
            "peak_mem_bytes", "process_s")
    result = {"trainer": a.trainer, "steps": a.steps, "rows": a.rows, "batch_size": cfg.batch_size,
              "history_mean": cfg.history_mean, "overrides": a.overrides, "write_s": write_s,
              "runs": {name: {k: m.get(k) for k in keys} for name, m in runs.items()},
              "ratio": runs["parquet"]["samples_per_s"] / runs["synthetic"]["samples_per_s"]}
    (out / "bench_data.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\ndevice {runs['synthetic']['device']}, trainer={a.trainer}, {a.steps} steps, batch {cfg.batch_size}")
    print(f"{'source':<10} {'samples/s':>12} {'median step':>12} {'builds':>7}")
    for name, m in runs.items():
        print(f"{name:<10} {m['samples_per_s']:>12,.0f} {m['samples_per_s_median_step']:>12,.0f} "
              f"{m['kernel_builds_after_warmup']:>7}")
    print(f"parquet / synthetic: {result['ratio']:.3f} (aim: >= 0.90)")
    return result


if __name__ == "__main__":
    main()
