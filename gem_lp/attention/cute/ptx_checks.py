"""Checks of the sm_100a attention kernels' PTX: what their MMAs, TMA byte counts and tensor-memory allocation are,
read from the PTX text, and what ptxas makes of it (registers, spills).

* `build_ptx(arch, dump_dir)` builds every attention target of `gem_lp.compile_check` (`attention/cute/targets.py`)
  and keeps each build's PTX in a directory of its own (`dump_dir/<op>-<direction>-<precision>-<mode>/`), since
  builds of one kernel class write PTX files of one name. Run it in a fresh process (`python -m
  gem_lp.attention.cute.ptx_checks --arch sm_100a --dump-dir D`): the CuTe DSL reads its architecture once.
* `mma_instructions(ptx)`: every `tcgen05.mma` with its kind, cta_group, operands and the constants behind them (the
  instruction descriptor decoded by `decode_idesc`, the tensor-memory column of D, of A when it comes from tensor
  memory, and of the scale factors with their byte index).
* `expect_tx_sites(ptx)`: every `mbarrier.arrive.expect_tx` with its byte count and the TMA loads that complete on
  its barrier before the next wait.
* `alloc_columns(ptx)`, `ptxas_info(path)`.

The instruction descriptor of `kind::mxf8f6f4` (PTX ISA, "Instruction descriptor"): bits 4-5 B's scale-factor ID,
7-9 A's type, 10-12 B's type (E4M3 = 0), 15 / 16 transpose A / B (1 = MN-major), 17-22 N >> 3, 23 the scale type
(1 = UE8M0), 27-28 M >> 7, 29-30 A's scale-factor ID. A tensor-memory address is lane << 16 | column; a scale
factor's address carries its byte within the 32-bit column in bits 30-31.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile

# `.version` ptxas of CUDA 13.0 accepts; the DSL writes 9.4
PTXAS_MAX_VERSION = "9.0"


@dataclasses.dataclass(frozen=True)
class Mma:
    line: int
    kind: str
    cta_group: int
    block_scale: bool
    d_col: int | None
    a_tmem: bool  # A from tensor memory (else a shared-memory descriptor)
    a_tmem_col: int | None
    idesc: dict | None
    sfa: tuple[int, int] | None  # (column, byte)
    sfb: tuple[int, int] | None


@dataclasses.dataclass(frozen=True)
class ExpectTx:
    line: int
    bytes: int | None
    tensor_loads: list  # (line, first coordinate constant or None)
    bulk_bytes: list  # byte counts of non-tensor bulk copies (None where not a constant)


def decode_idesc(v: int) -> dict:
    """The fields of a `kind::mxf8f6f4` instruction descriptor."""
    return dict(sfb_id=(v >> 4) & 3, a_type=(v >> 7) & 7, b_type=(v >> 10) & 7, neg_a=(v >> 13) & 1,
                neg_b=(v >> 14) & 1, a_major="MN" if (v >> 15) & 1 else "K", b_major="MN" if (v >> 16) & 1 else "K",
                n=((v >> 17) & 0x3F) * 8, ue8m0=bool((v >> 23) & 1), m=((v >> 27) & 3) * 128, sfa_id=(v >> 29) & 3)


_MOV_CONST = re.compile(r"^\s*mov\.(?:b|u|s)32\s+(%r\d+),\s*(-?\d+);")


def _constants(lines: list[str]) -> dict[int, dict[str, int]]:
    """Per line, the registers holding an integer constant from the nearest `mov` above it (straight-line view: a
    register the DSL sets once with `mov` right before its use)."""
    known: dict[str, int] = {}
    out = {}
    for i, line in enumerate(lines):
        out[i] = known
        m = _MOV_CONST.match(line)
        if m:
            known = dict(known)
            known[m.group(1)] = int(m.group(2)) & 0xFFFFFFFF
    return out


def _strip(ptx: str) -> list[str]:
    return [line.split("//")[0] for line in ptx.splitlines()]


_MMA = re.compile(r"^\s*(?:@!?%?\w+\s+)?tcgen05\.mma\.cta_group::(\d)\.kind::(\w+)([\w.:]*)\s+(.*);")


def mma_instructions(ptx: str) -> list[Mma]:
    lines = _strip(ptx)
    consts = _constants(lines)
    out = []
    for i, line in enumerate(lines):
        m = _MMA.match(line)
        if not m:
            continue
        ops = [o.strip() for o in m.group(4).split(",")]
        known = consts[i]

        def value(op):
            reg = op.strip("[]")
            return known.get(reg)

        d, a = value(ops[0]), value(ops[1]) if ops[1].startswith("[") else None
        block_scale = ".block_scale" in m.group(3)
        idesc = value(ops[3])
        sf = [value(o) for o in ops[4:6]] if block_scale else [None, None]
        out.append(Mma(
            line=i + 1, kind=m.group(2), cta_group=int(m.group(1)), block_scale=block_scale,
            d_col=None if d is None else d & 0xFFFF, a_tmem=ops[1].startswith("["),
            a_tmem_col=None if a is None else a & 0xFFFF,
            idesc=None if idesc is None else decode_idesc(idesc),
            sfa=None if sf[0] is None else (sf[0] & 0xFFFF, sf[0] >> 30),
            sfb=None if sf[1] is None else (sf[1] & 0xFFFF, sf[1] >> 30)))
    return out


_EXPECT = re.compile(r"mbarrier\.arrive\.expect_tx\.\S+\s+\S+,\s*(\[[^\]]+\]),\s*(%r\d+|\d+);")
_TENSOR_LOAD = re.compile(r"cp\.async\.bulk\.tensor\.\w+\.shared::\w+\.global\S*\s+\[[^\]]+\],\s*\[[^,]+,\s*\{([^}]*)\}\],"
                          r"\s*(\[[^\]]+\])")
_BULK_LOAD = re.compile(r"cp\.async\.bulk\.shared::\w+\.global\S*\s+\[[^\]]+\],\s*\[[^\]]+\],\s*(%r\d+|\d+),\s*"
                        r"(\[[^\]]+\])")


def expect_tx_sites(ptx: str) -> list[ExpectTx]:
    """Each expect_tx and the TMA loads that complete on its barrier before the next wait, expect_tx, unconditional
    branch or return (the load warp's pattern: arm a stage's barrier, then issue that stage's loads)."""
    lines = _strip(ptx)
    consts = _constants(lines)
    out = []
    for i, line in enumerate(lines):
        m = _EXPECT.search(line)
        if not m:
            continue
        bar, count = m.group(1), m.group(2)
        nbytes = int(count) if count.isdigit() else consts[i].get(count)
        tensor, bulk = [], []
        for j in range(i + 1, len(lines)):
            nxt = lines[j]
            if (_EXPECT.search(nxt) or "mbarrier.try_wait" in nxt or re.search(r"^\s*bra\.uni\b", nxt)
                    or re.search(r"^\s*ret;", nxt)):
                break
            t = _TENSOR_LOAD.search(nxt)
            if t and t.group(2) == bar:
                first = t.group(1).split(",")[0].strip()
                tensor.append((j + 1, int(first) if first.lstrip("-").isdigit() else consts[j].get(first)))
            b = _BULK_LOAD.search(nxt)
            if b and b.group(2) == bar:
                size = b.group(1)
                bulk.append(int(size) if size.isdigit() else consts[j].get(size))
        out.append(ExpectTx(i + 1, nbytes, tensor, bulk))
    return out


def alloc_columns(ptx: str) -> list[int | None]:
    """The column counts of the PTX's `tcgen05.alloc` instructions."""
    lines = _strip(ptx)
    consts = _constants(lines)
    out = []
    for i, line in enumerate(lines):
        m = re.search(r"tcgen05\.alloc\.\S+\s+\[[^\]]+\],\s*(%r\d+|\d+);", line)
        if m:
            n = m.group(1)
            out.append(int(n) if n.isdigit() else consts[i].get(n))
    return out


def ptxas_info(path: str, arch: str = "sm_100a", ptxas: str | None = None) -> dict:
    """ptxas -v on a PTX file: `registers`, `stack`, `spill_stores`, `spill_loads` (bytes), `version_lowered`
    (`.version` lowered to what this ptxas accepts when it rejected the original). Raises on a compile error."""
    ptxas = ptxas or shutil.which("ptxas")
    text = open(path).read()
    lowered = False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        for attempt in range(2):
            with open(src, "w") as f:
                f.write(text)
            done = subprocess.run([ptxas, f"-arch={arch}", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                                  capture_output=True, text=True)
            if done.returncode == 0:
                break
            if attempt == 0 and "version" in done.stderr.lower() and ".version" in text:
                text = re.sub(r"^\.version\s+\S+", f".version {PTXAS_MAX_VERSION}", text, count=1, flags=re.M)
                lowered = True
                continue
            raise RuntimeError(f"ptxas failed on {os.path.basename(path)}: {done.stderr[-2000:]}")
    log = done.stdout + done.stderr
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return dict(registers=max(regs) if regs else None, stack=sum(int(f[0]) for f in frames),
                spill_stores=sum(int(f[1]) for f in frames), spill_loads=sum(int(f[2]) for f in frames),
                version_lowered=lowered)


def kernel_name(path: str) -> str:
    """The kernel class of a dumped PTX file (`..._<module path><Class>_object_at...`)."""
    m = re.search(r"([A-Z][A-Za-z0-9]+)_object_at", os.path.basename(path))
    return m.group(1) if m else os.path.basename(path)[:60]


def build_ptx(arch: str, dump_dir: str, ops: tuple[str, ...] = ("attention",)) -> dict[str, list[str]]:
    """Build every target of `ops` for `arch` as compile_check does (one directory of PTX per build under
    `dump_dir`). Returns label -> PTX paths. Needs a fresh process (see module docstring)."""
    import io

    from gem_lp import compile_check

    if compile_check.run(arch, dump_dir, out=io.StringIO(), ops=ops):
        raise RuntimeError(f"compile_check failed for {arch} {ops}")
    return ptx_files(dump_dir)


def ptx_files(dump_dir: str) -> dict[str, list[str]]:
    """label -> PTX paths of a compile_check dump dir (one directory per build)."""
    from gem_lp import compile_check

    out = {}
    for entry in sorted(os.listdir(dump_dir)):
        path = os.path.join(dump_dir, entry)
        if os.path.isdir(path) and entry != compile_check.RAW_DIR:
            out[entry] = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".ptx"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="build the attention kernels' PTX (one directory per build) and list it")
    ap.add_argument("--arch", default="sm_100a")
    ap.add_argument("--dump-dir", required=True)
    args = ap.parse_args(argv)
    built = build_ptx(args.arch, args.dump_dir)
    for label, files in built.items():
        print(label, len(files), flush=True)
    return 0 if built and all(built.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
