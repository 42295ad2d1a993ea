"""Build every CuTe kernel the public API can launch, for one GPU architecture, on a machine without a GPU.

    python -m gem_lp.compile_check --arch sm_90a|sm_100a [--dump-dir DIR] [--op cast|norm|linear|attention ...]

Kernels are built under `FakeTensorMode` (fake CUDA tensors; nothing is launched) with the architecture set
through the CuTe DSL's and FlashAttention-4's environment. Each build keeps its PTX in the dump dir (tests read it
there, one directory per build, when `GEM_LP_COMPILE_DUMP` names the parent of `sm_90a/` and `sm_100a/` dumps); one
line per kernel gives the
op and direction, the precision, the arch, the build's mode and the MMA instructions in the PTX: `wgmma` for
sm_90a; `tcgen05.mma` and how many of them are block-scaled for sm_100a. Exit status 1 when a build fails or an
mxfp8 GEMM or attention build for sm_100a has no block-scaled MMA, or a GEMM or attention build for sm_90a has no
wgmma (casts and norms have no MMA). Kernel packages list their builds in a `compile_targets(arch)` function (see
`TARGET_MODULES`).

A build is not a run: the sm_100a kernels have never run on a Blackwell GPU (none is available to this project).
What is verified of them without one: these builds and their PTX, the CPU models of the attention kernels
(`gem_lp.attention.cute.sm100_model`), and the self-check a Blackwell GPU runs on first use (`gem_lp.selfcheck`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import tempfile
import time
import traceback
from typing import Callable

ARCHES = ("sm_90a", "sm_100a")
# SM count the builds are specialized for (H100 / H200: 132, B200: 148); FA4's schedulers read it from the driver
# otherwise.
NUM_SMS = {"sm_90a": 132, "sm_100a": 148}
TARGET_MODULES = ("gem_lp.mx.kernels.cute_targets", "gem_lp.norm.kernels.cute_targets", "gem_lp.linear.kernels.cute_targets",
                  "gem_lp.attention.cute.targets")
# What the API runs without a CuTe kernel on an arch, said on every run for that arch.
MISSING: dict[str, list[str]] = {}


@dataclasses.dataclass(frozen=True)
class CompileTarget:
    """One build: `build()` compiles (never launches) under FakeTensorMode; its PTX lands in the dump dir."""

    op: str  # cast, norm, linear, attention
    direction: str  # fwd, bwd, cast
    precision: str  # bf16, mxfp8
    mode: str  # what else selects the kernel (head dim, causal, ...)
    build: Callable[[], None]
    needs_mma: bool = True  # False for kernels without a GEMM (casts, norms): no MMA count is required of them


@dataclasses.dataclass
class KernelReport:
    target: CompileTarget
    kernel: str
    wgmma: int
    tcgen05: int
    block_scaled: int


def mma_counts(ptx: str) -> tuple[int, int, int]:
    """(wgmma, tcgen05.mma, block-scaled tcgen05.mma) instructions in a PTX text."""
    # an instruction may carry a guard predicate (`@p tcgen05.mma ...`); comments do not count
    lines = [s.split("//")[0] for s in ptx.splitlines()]
    wgmma = sum(1 for s in lines if re.search(r"^\s*(@!?\w+\s+)?wgmma\.mma_async", s))
    tc = [s for s in lines if re.search(r"^\s*(@!?\w+\s+)?tcgen05\.mma\b", s)]
    return wgmma, len(tc), sum(1 for s in tc if "block_scale" in s)


# Under the dump dir: the DSL's own dump (whose file names can collide between builds) ...
RAW_DIR = "_raw"


def build_label(target: CompileTarget) -> str:
    """... and one directory per build, named by its op, direction, precision and mode, holding its PTX files."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{target.op}-{target.direction}-{target.precision}-{target.mode}")


def _kernel_name(path: str) -> str:
    """The kernel class of a dumped PTX file (`cutlass___call___<module path><Class>_object_at...`)."""
    base = os.path.basename(path)
    m = re.search(r"([A-Z][A-Za-z0-9]+)_object_at", base)
    return m.group(1) if m else base[:60]


def _dumped(dump_dir: str) -> dict[str, int]:
    """File name -> modification time (ns) of the dump dir's files."""
    return {f: os.stat(os.path.join(dump_dir, f)).st_mtime_ns for f in os.listdir(dump_dir)}


def _configure(arch: str, dump_dir: str) -> None:
    os.environ["CUTE_DSL_ARCH"] = arch
    os.environ["FLASH_ATTENTION_ARCH"] = arch
    os.environ["FLASH_ATTENTION_NUM_SMS"] = str(NUM_SMS[arch])
    os.environ["CUTE_DSL_KEEP"] = "ptx"
    os.environ["CUTE_DSL_DUMP_DIR"] = dump_dir


def run(arch: str, dump_dir: str, out=sys.stdout, ops: tuple[str, ...] | None = None) -> int:
    """Build every target for `arch` (only those of `ops` when given), print one line per kernel; returns the exit
    status."""
    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {ARCHES}, got {arch!r}")
    raw = os.path.join(dump_dir, RAW_DIR)  # where the DSL dumps; each build's files are then copied to their own dir
    os.makedirs(raw, exist_ok=True)
    _configure(arch, raw)
    import importlib
    import shutil

    from torch._subclasses.fake_tensor import FakeTensorMode

    failures = 0
    targets = [t for name in TARGET_MODULES for t in importlib.import_module(name).compile_targets(arch)]
    if ops:
        targets = [t for t in targets if t.op in ops]
    for target in targets:
        label = f"{target.op} {target.direction:3s} {target.precision:5s} {arch:7s} {target.mode}"
        before = _dumped(raw)
        t0 = time.time()
        try:
            with FakeTensorMode():
                target.build()
        except Exception as exc:  # a failed build is reported and counted, the others still run
            failures += 1
            print(f"{label}: BUILD FAILED {type(exc).__name__}: {str(exc)[:300]}", file=out, flush=True)
            traceback.print_exc(limit=3, file=sys.stderr)
            continue
        # new files, and files rewritten by a build whose dump name equals an earlier build's
        new = sorted(f for f, stamp in _dumped(raw).items() if f.endswith(".ptx") and before.get(f) != stamp)
        build_dir = os.path.join(dump_dir, build_label(target))
        os.makedirs(build_dir, exist_ok=True)
        reports = []
        for f in new:
            shutil.copy(os.path.join(raw, f), os.path.join(build_dir, f))
            with open(os.path.join(raw, f)) as fh:
                reports.append(KernelReport(target, _kernel_name(f), *mma_counts(fh.read())))
        for r in reports:
            counts = (f"wgmma={r.wgmma}" if arch == "sm_90a"
                      else f"tcgen05.mma={r.tcgen05} block_scaled={r.block_scaled}")
            print(f"{label} {r.kernel}: {counts}", file=out, flush=True)
        print(f"{label}: built in {time.time() - t0:.1f} s", file=out, flush=True)
        if (target.precision == "mxfp8" and target.needs_mma and arch == "sm_100a"
                and not any(r.block_scaled for r in reports)):
            failures += 1
            print(f"{label}: FAILED no block-scaled tcgen05.mma in its PTX", file=out, flush=True)
        if target.needs_mma and arch == "sm_90a" and not any(r.wgmma for r in reports):
            failures += 1
            print(f"{label}: FAILED no wgmma in its PTX", file=out, flush=True)
    for note in MISSING.get(arch, []):
        print(f"not built: {note}", file=out, flush=True)
    print(f"compile_check {arch}: {len(targets) - failures} passed, {failures} failed", file=out, flush=True)
    return 1 if failures else 0


def _run_arches(arches: list[str], dump_dir: str, ops: tuple[str, ...] | None) -> int:
    """Several arches at once, one child process each (the DSL reads its arch from the environment once per
    process), each into `dump_dir/<arch>`; their reports printed in order."""
    import subprocess

    procs = []
    for arch in arches:
        cmd = [sys.executable, "-m", "gem_lp.compile_check", "--arch", arch, "--dump-dir", os.path.join(dump_dir, arch)]
        for op in ops or ():
            cmd += ["--op", op]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    status = 0
    for proc in procs:
        out, _ = proc.communicate()
        print(out, end="", flush=True)
        status |= proc.returncode
    return 1 if status else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", action="append", choices=ARCHES, default=None,
                    help="the arch to build for (repeatable: several build in parallel, into DIR/<arch>)")
    ap.add_argument("--dump-dir", default=None, help="keep each kernel's PTX here (default: a temporary dir)")
    ap.add_argument("--op", action="append", default=None, help="build only this op's kernels (repeatable)")
    args = ap.parse_args(argv)
    ops = tuple(args.op) if args.op else None
    arches = args.arch or ["sm_90a"]
    with tempfile.TemporaryDirectory() as tmp:
        dump_dir = args.dump_dir if args.dump_dir is not None else tmp
        if len(arches) > 1:
            return _run_arches(arches, dump_dir, ops)
        return run(arches[0], dump_dir, ops=ops)


if __name__ == "__main__":
    sys.exit(main())
