"""Shared benchmark harness: CUDA-event medians, the copy ceiling, a printed table and JSON under $OUT.

Every script builds a `Bench`, records rows with `bench.time(...)`, and calls `bench.finish()`, which
prints the table last (the part of the output that is read) and writes `<name>.json` under $OUT
(or ./.bench_out when $OUT is unset). A run stopped by SIGTERM (`timeout`) does the same with the rows it has,
marked `partial` in the JSON.
"""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
import traceback
from typing import Callable

import torch


def lognormal_lengths(batch: int, mean: float, *, seed: int = 0, lo: int = 1, hi: int = 4096,
                      sigma: float = 0.8) -> torch.Tensor:
    """Sequence lengths of the benchmark workloads: lognormal with mean `mean` and log-std `sigma`, rounded and
    clamped to [lo, hi], from a generator seeded with `seed` (so every script and peer sees the same batch)."""
    g = torch.Generator().manual_seed(seed)
    mu = math.log(mean) - 0.5 * sigma**2
    return torch.exp(torch.randn(batch, generator=g) * sigma + mu).round().clamp(lo, hi).long()


def trainer_token_counts(batches: int = 2, seed: int = 0) -> list[int]:
    """The token counts the sequence part of the GPU trainer (`trainer=gpu data=synthetic`) feeds its linears in its
    first `batches` training batches of `seed`: each sample's history (lognormal lengths, drawn as the trainer draws
    them: `gem_lp.data.sampling`, seeded as `gem_lp.data.synthetic.make_batch`) plus its summary tokens, summed over
    the batch. Read from the package's configs (`data/synthetic.yaml` with `data_sizes/gpu_synthetic.yaml`, the
    model's `num_summary_tokens`)."""
    import yaml

    from gem_lp.data.sampling import lognormal_lengths
    from gem_lp.data.synthetic import batch_seed

    configs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gem_lp", "configs")

    def load(*path: str) -> dict:
        with open(os.path.join(configs, *path)) as f:
            return {k: v for k, v in yaml.safe_load(f).items() if k != "defaults"}

    data = {**load("data", "synthetic.yaml"), **load("data_sizes", "gpu_synthetic.yaml")}
    summary = load("model", "gem_bf16.yaml")["num_summary_tokens"]
    b = data["batch_size"]
    counts = []
    for i in range(batches):
        g = torch.Generator().manual_seed(batch_seed(seed, "train", i))
        lengths = lognormal_lengths(b, data["history_mean"], data["history_sigma"], data["history_min"],
                                    data["history_max"], g)
        counts.append(int(lengths.sum()) + summary * b)
    return counts


def offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    offs = torch.zeros(len(lengths) + 1, dtype=torch.long)
    offs[1:] = torch.cumsum(lengths, 0)
    return offs


def host_us_per_call(fn: Callable[[], object], calls: int = 200) -> float:
    """Host microseconds per call of `fn`, called back to back without synchronizing (the GPU queue absorbs the
    launches): when above the GPU time of a call, the GPU waits for the host."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / calls * 1e6


class Bench:
    def __init__(self, name: str, *, finish_on_sigterm: bool = True, cuda_graphs: bool = False):
        """`cuda_graphs`: time each row by replaying a CUDA graph of its calls (`do_bench_cudagraph`): the GPU's time
        without the host's launch work, as the trainer's captured sequence part runs; L2 is not flushed between calls
        (an input smaller than L2 may stay cached); a row that cannot be captured is timed eagerly and says so
        (`eager` in its info)."""
        self.name = name
        self.cuda_graphs = cuda_graphs
        self.rows: list[dict] = []
        self.extra: dict = {}
        self.env = self._env()
        print(self.env, flush=True)
        if finish_on_sigterm:  # a run stopped by `timeout` still prints its table and writes its JSON
            signal.signal(signal.SIGTERM, self._finish_on_sigterm)

    def _finish_on_sigterm(self, signum, frame) -> None:
        print(f"\nstopped by signal {signum}: the rows measured so far", flush=True)
        self.extra["partial"] = True
        try:
            self.finish()
        finally:
            sys.stdout.flush()
            os._exit(124)

    @staticmethod
    def _env() -> dict:
        import triton

        env = dict(torch=torch.__version__, triton=triton.__version__, python=sys.version.split()[0])
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env.update(gpu=p.name, sms=p.multi_processor_count, cuda=torch.version.cuda)
        return env

    def measure(self, fn: Callable[[], object], *, warmup: int = 25, rep: int = 100) -> float:
        """Median milliseconds of `fn` (triton.testing.do_bench, CUDA events; replayed from a CUDA graph with
        `cuda_graphs`)."""
        from triton.testing import do_bench, do_bench_cudagraph

        if self.cuda_graphs:
            return do_bench_cudagraph(fn, rep=rep, return_mode="median")
        return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")

    def time(self, group: str, name: str, fn: Callable[[], object], *, flop: float | None = None,
             nbytes: float | None = None, peer: bool = False, **info) -> float | None:
        """Time `fn` and record a row; a failure is recorded (and printed) instead of raised."""
        try:
            try:
                ms = self.measure(fn)
            except Exception as e:
                if not self.cuda_graphs:
                    raise
                print(f"  [{group}] {name}: not capturable ({type(e).__name__}), timed eagerly", flush=True)
                torch.cuda.synchronize()
                graphs, self.cuda_graphs = self.cuda_graphs, False
                try:
                    ms = self.measure(fn)
                finally:
                    self.cuda_graphs = graphs
                info = dict(info, eager=True)
        except Exception as e:  # one failing variant must not hide the others
            msg = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"  [{group}] {name}: FAILED {msg}", flush=True)
            traceback.print_exc(limit=2)
            self.rows.append(dict(group=group, name=name, error=msg, peer=peer, **info))
            return None
        row = dict(group=group, name=name, ms=ms, peer=peer, **info)
        if flop:
            row["tflops"] = flop / ms / 1e9
        if nbytes:
            row["tbps"] = nbytes / ms / 1e9
        self.rows.append(row)
        print(f"  [{group}] {name}: {ms:.4f} ms" + (f"  {row['tflops']:.1f} TF/s" if flop else "")
              + (f"  {row['tbps']:.3f} TB/s" if nbytes else ""), flush=True)
        return ms

    def copy_bandwidth(self, nbytes: int = 2 << 30) -> float:
        """Device-to-device copy TB/s (bytes read + written), measured in this run."""
        a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_()
        b = torch.empty_like(a)
        ms = self.measure(lambda: b.copy_(a))
        tbps = 2 * a.numel() / ms / 1e9
        self.extra["copy_tbps"] = tbps
        self.rows.append(dict(group="ceiling", name=f"copy d2d {nbytes >> 20} MiB", ms=ms, tbps=tbps, peer=True))
        print(f"  copy bandwidth: {tbps:.3f} TB/s", flush=True)
        del a, b
        torch.cuda.empty_cache()
        return tbps

    def finish(self) -> None:
        """Add ratios (to the copy ceiling and to the best peer of each group), print, write JSON."""
        copy = self.extra.get("copy_tbps")
        groups: dict[str, list[dict]] = {}
        for r in self.rows:
            groups.setdefault(r["group"], []).append(r)
        for rows in groups.values():
            peers = [r for r in rows if r.get("peer") and "ms" in r]
            best = min((r["ms"] for r in peers), default=None)
            for r in rows:
                if "ms" not in r:
                    continue
                if best:
                    r["vs_best_peer"] = best / r["ms"]
                if copy and "tbps" in r:
                    r["pct_copy"] = 100 * r["tbps"] / copy
        out = os.environ.get("OUT") or ".bench_out"
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, f"{self.name}.json")
        with open(path, "w") as f:
            json.dump(dict(env=self.env, extra=self.extra, rows=self.rows), f, indent=1, default=str)
        print(f"\n=== {self.name} (json: {path})")
        print(f"{'group':28s} {'name':52s} {'ms':>9s} {'TF/s':>7s} {'TB/s':>7s} {'%copy':>6s} {'xpeer':>6s}")
        for r in self.rows:
            if "ms" not in r:
                print(f"{r['group'][:28]:28s} {r['name'][:52]:52s}  FAILED {r.get('error', '')[:60]}")
                continue
            print(f"{r['group'][:28]:28s} {r['name'][:52]:52s} {r['ms']:9.4f} {r.get('tflops', 0):7.1f} "
                  f"{r.get('tbps', 0):7.3f} {r.get('pct_copy', 0):6.1f} {r.get('vs_best_peer', 0):6.2f}"
                  + ("  (peer)" if r.get("peer") else ""))
