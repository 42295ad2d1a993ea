"""Jagged MXFP8 quantization on the GPU: our one-launch zero-gather kernel against the padded path.

Workloads (as in `benchmarks.bench_attention`): A = 32 sequences, lognormal mean 1024 (lo 32, hi 4096), H16 D128 (32088 tokens,
max 3274); B = 4096 sequences, mean 200 (lo 1, hi 4096), H4 D128; trainer = the GPU trainer's batch, 1024 sequences,
mean 256 (lo 1, hi 2048), H2 D128 (the attention producer's input). bf16 values, rceil.

Rows per workload:
  "<W> hdim+seq": ours hdim+seq (one launch), ours square (one payload, scales in both forms), and the
      peer a user would write: scatter into a zero-padded [B, Lmax32, H, D] then a torch.compile'd dense
      MX cast (`quantize_reference`) along D and along tokens, timed end to end (plain scales, no blocked
      permute: that favours the peer).
  "<W> hdim only": ours hdim only, and the peer that needs no padding: the compiled dense cast of the
      packed [T*H, D].
  "<W> host overhead": hdim+seq through the public `quantize_jagged` (direct relaunch of the compiled
      kernel), the bare kernel through the JIT, the custom op's dispatcher, a `launch` into preallocated outputs, and replayed from a
      CUDA graph (GPU time alone); each row holds the host time per call (host_us) and its ms above the
      replay's (ms_over_replay_us).
  "<W> tuning <set>": every launch of `CANDIDATE_LAUNCHES` and `PERSISTENT_LAUNCHES` (default first;
      `LaunchOptions` tuples (rows, thread_rows, row_blocks_in_thread, num_warps, max_registers,
      programs_per_sm)) for hdim+seq, hdim and square, launch only, each checked byte for byte against the
      default launch (PASS/FAIL), with its sm_90 build figures (registers, spills, programs per SM, SASS
      instructions per element; a persistent walk: whether its programs per SM all fit at once); the best is
      printed.
TB/s is effective: bf16 read once + payloads + scales written (the useful bytes of ours; the padded peer
is credited with the same useful bytes). Each row's info holds the bytes it moves and stores, the padding
ratio B*Lmax/T and the speed-up over the peer. Bit-identity against the per-sequence reference is checked
on a sample of sequences (PASS/FAIL printed). Run: python benchmarks/bench_jagged.py
(`--workloads B --sets hdim+seq` for a part).
`python benchmarks/bench_jagged.py --compile-only` (no GPU needed) builds every launch for sm_90 as the GPU
run would and prints its registers, spills, programs per SM and SASS instruction count, then what the register
limits 128, 96 and 80 cost the hdim+seq and hdim defaults in spills; it fails if one does not build.
"""
from __future__ import annotations

import math
import os
import sys
import time
import traceback

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.common import Bench, host_us_per_call, lognormal_lengths, offsets_of
from gem_lp.jagged import JaggedLayout, quantize_jagged, quantize_jagged_reference
from gem_lp.jagged.tensor import scale_sizes
from gem_lp.jagged.kernels.triton_quantize import LAUNCH_SETS, LaunchOptions, default_launch, launch
from benchmarks.launch_candidates import CANDIDATE_LAUNCHES, PERSISTENT_LAUNCHES
from gem_lp.mx.formats import BLOCK, PAYLOAD_DTYPE
from gem_lp.mx.layout import from_blocked
from gem_lp.mx.reference import quantize_reference

WORKLOADS = {
    "A": dict(batch=32, mean=1024, lo=32, hi=4096, heads=16, dim=128),
    "B": dict(batch=4096, mean=200, lo=1, hi=4096, heads=4, dim=128),
    "trainer": dict(batch=1024, mean=256, lo=1, hi=2048, heads=2, dim=128),  # the GPU trainer's batch
}
SCALE_FORMS = ("scale_hdim", "scale_seq", "scale_square_hdim", "scale_square_seq")
START = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def useful_bytes(values: torch.Tensor, n_payloads: int, scale_bytes: int) -> int:
    """bf16 read once + payloads + scales written."""
    return values.numel() * values.element_size() + n_payloads * values.numel() + scale_bytes


# --- the padded path ----------------------------------------------------------------------------------


def padded_cast(values, seq_id, pos, batch: int, lmax32: int):
    """Scatter into zeros [B, Lmax32, H, D], then MX-cast along D (1x32) and along tokens (32x1)."""
    padded = values.new_zeros(batch, lmax32, values.shape[1], values.shape[2])
    padded[seq_id, pos] = values
    hdim = quantize_reference(padded, axis=-1)
    seq = quantize_reference(padded, axis=1)
    return hdim.data, hdim.scale, seq.data, seq.scale


def packed_hdim_cast(values):
    """The hdim cast needs no sequence structure: dense 1x32 cast of the packed [T*H, D]."""
    mx = quantize_reference(values.reshape(-1, values.shape[-1]), axis=-1)
    return mx.data, mx.scale


# --- verification against the per-sequence reference --------------------------------------------------


def unblocked(jmx, name: str) -> torch.Tensor:
    """Plain per-head matrix of one blocked scale buffer (padding rows/columns of the sequences included)."""
    tp, d = jmx.layout.padded_total, jmx.head_dim
    rows, cols = (tp, d // BLOCK) if name.endswith("hdim") else (d, tp // BLOCK)
    blocked = getattr(jmx, name)
    return torch.stack([from_blocked(blocked[h], rows, cols) for h in range(blocked.shape[0])])


def verify_sample(values, layout, ours, n_random: int = 10, seed: int = 0) -> tuple[bool, str]:
    """Bit-identity of every payload byte and every scale byte (padding included) of a sample of
    sequences: the longest, the shortest and `n_random` others, quantized by the reference as a sub-batch."""
    lengths = layout.lengths.cpu()
    g = torch.Generator().manual_seed(seed)
    pick = {int(lengths.argmax()), int(lengths.argmin())}
    pick |= set(torch.randperm(len(lengths), generator=g)[:n_random].tolist())
    pick = sorted(pick)
    offs, so = layout.offsets.tolist(), layout.scale_offsets.tolist()
    sub_values = torch.cat([values[offs[b]:offs[b + 1]] for b in pick])
    sub_offsets = offsets_of(lengths[pick]).to(values.device)
    sub_layout = JaggedLayout.from_offsets(sub_offsets, sub_values)
    ref = quantize_jagged_reference(sub_values, sub_layout, ours.orientations, ours.scaling)
    sub_offs, sub_so = sub_offsets.tolist(), sub_layout.scale_offsets.tolist()
    bad = []
    for o in ours.orientations:
        p_ours, p_ref = ours.payload(o).view(torch.uint8), ref.payload(o).view(torch.uint8)
        for i, b in enumerate(pick):
            if not torch.equal(p_ours[offs[b]:offs[b + 1]], p_ref[sub_offs[i]:sub_offs[i + 1]]):
                bad.append(f"payload_{o} seq {b}")
    for name in SCALE_FORMS:
        if getattr(ours, name) is None:
            continue
        s_ours, s_ref = unblocked(ours, name), unblocked(ref, name)
        for i, b in enumerate(pick):
            rows_ours = slice(so[b], so[b + 1])
            rows_ref = slice(sub_so[i], sub_so[i + 1])
            if name.endswith("hdim"):
                same = torch.equal(s_ours[:, rows_ours], s_ref[:, rows_ref])
            else:
                same = torch.equal(s_ours[:, :, so[b] // BLOCK:so[b + 1] // BLOCK],
                                   s_ref[:, :, sub_so[i] // BLOCK:sub_so[i + 1] // BLOCK])
            if not same:
                bad.append(f"{name} seq {b}")
    return not bad, f"{len(pick)} sequences ({sum(int(lengths[b]) for b in pick)} tokens)" + (
        f"; mismatches: {bad[:6]}" if bad else "")


# --- one workload -------------------------------------------------------------------------------------


def run_workload(bench: Bench, name: str, cfg: dict, sets: tuple[str, ...] = tuple(LAUNCH_SETS)) -> None:
    lengths = lognormal_lengths(cfg["batch"], cfg["mean"], seed=0, lo=cfg["lo"], hi=cfg["hi"])
    heads, dim, batch = cfg["heads"], cfg["dim"], cfg["batch"]
    total, max_len = int(lengths.sum()), int(lengths.max())
    lmax32 = math.ceil(max_len / BLOCK) * BLOCK
    padding_ratio = batch * max_len / total
    offsets = offsets_of(lengths).cuda()
    values = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
    log(f"workload {name}: B={batch} T={total} max={max_len} H={heads} D={dim} padding ratio B*Lmax/T="
        f"{padding_ratio:.2f}")
    bench.extra[f"{name}_workload"] = dict(cfg, tokens=total, max_len=max_len, padding_ratio=padding_ratio)

    bench.time(f"{name} layout", "JaggedLayout.from_offsets (one host sync)",
               lambda: JaggedLayout.from_offsets(offsets, values), tokens=total)
    layout = JaggedLayout.from_offsets(offsets, values)
    hdim_bytes, seq_bytes = scale_sizes(layout.padded_total, dim)
    scales_hs = heads * (hdim_bytes + seq_bytes)
    group = f"{name} hdim+seq"
    ours_rows = {}
    for label, orients, n_pay, sbytes, grp in [
        ("ours hdim+seq (one launch)", ("hdim", "seq"), 2, scales_hs, group),
        ("ours square (both scale forms)", ("square",), 1, scales_hs, group),
        ("ours hdim only", ("hdim",), 1, heads * hdim_bytes, f"{name} hdim only"),
    ]:
        nbytes = useful_bytes(values, n_pay, sbytes)
        bench.time(grp, label, lambda o=orients: quantize_jagged(values, layout, o, backend="triton"),
                   nbytes=nbytes, bytes_moved=nbytes, bytes_stored=n_pay * values.numel() + sbytes,
                   padded_rows=layout.padded_total, padding_ratio=padding_ratio)
        ours_rows[label] = (bench.rows[-1], grp)

    graph_row = host_overhead(bench, name, values, layout, useful_bytes(values, 2, scales_hs), padding_ratio)
    if graph_row is not None:
        ours_rows["ours hdim+seq (CUDA graph replay)"] = (graph_row, group)

    # bit-identity on a sample of sequences (and every orientation)
    ours = quantize_jagged(values, layout, ("hdim", "seq", "square"), backend="triton")
    try:
        ok, what = verify_sample(values, layout, ours)
        bench.extra[f"{name}_bit_identical"] = ok
        log(f"{name}: bit-identity vs per-sequence reference on {what}: {'PASS' if ok else 'FAIL'}")
    except Exception as e:
        bench.extra[f"{name}_bit_identical"] = f"error: {e}"
        log(f"{name}: bit-identity check FAILED to run: {type(e).__name__}: {e}")
        traceback.print_exc(limit=3)

    # the padded path
    try:
        seq_id = torch.repeat_interleave(torch.arange(batch, device="cuda"), lengths.cuda(), output_size=total)
        pos = torch.arange(total, device="cuda") - offsets[:-1][seq_id]
        padded_fn = torch.compile(padded_cast, dynamic=False)
        p_elems = batch * lmax32 * heads * dim
        # zero-fill + scatter (read T, write T) + two casts reading the padded bf16 + payloads + plain scales
        moved = 2 * p_elems + 4 * total * heads * dim + 2 * 2 * p_elems + 2 * p_elems + 2 * p_elems // BLOCK
        stored = 2 * p_elems + 2 * p_elems + 2 * p_elems // BLOCK
        t0 = time.time()
        out = padded_fn(values, seq_id, pos, batch, lmax32)
        torch.cuda.synchronize()
        log(f"{name}: padded path compiled in {time.time() - t0:.1f}s")
        same = (torch.equal(out[0][seq_id, pos].view(torch.uint8), ours.payload_hdim.view(torch.uint8))
                and torch.equal(out[2][seq_id, pos].view(torch.uint8), ours.payload_seq.view(torch.uint8)))
        log(f"{name}: padded path payloads at the real tokens equal ours: {'PASS' if same else 'FAIL'}")
        bench.extra[f"{name}_padded_payloads_equal"] = same
        del out
        bench.time(group, "padded [B,Lmax32,H,D] scatter + compiled MX cast x2",
                   lambda: padded_fn(values, seq_id, pos, batch, lmax32), peer=True,
                   nbytes=useful_bytes(values, 2, scales_hs), bytes_moved=moved, bytes_stored=stored,
                   padding_ratio=padding_ratio)
    except Exception as e:
        log(f"{name}: padded path failed: {type(e).__name__}: {str(e)[:300]}")
        bench.rows.append(dict(group=group, name="padded path", error=str(e)[:300], peer=True))
    torch.cuda.empty_cache()

    try:
        packed_fn = torch.compile(packed_hdim_cast, dynamic=False)
        nb = useful_bytes(values, 1, heads * hdim_bytes)
        bench.time(f"{name} hdim only", "packed [T*H,D] compiled MX cast (plain scales)", lambda: packed_fn(values),
                   peer=True, nbytes=nb, bytes_moved=2 * values.numel() + values.numel() + values.numel() // BLOCK,
                   bytes_stored=values.numel() + values.numel() // BLOCK)
    except Exception as e:
        log(f"{name}: packed hdim peer failed: {type(e).__name__}: {str(e)[:300]}")

    # speed-up beside the padding ratio, in each of our rows
    peer_ms = {r["group"]: r["ms"] for r in bench.rows if r.get("peer") and "ms" in r}
    for label, (row, peer_group) in ours_rows.items():
        if "ms" in row and peer_group in peer_ms:
            row["speedup_vs_peer"] = peer_ms[peer_group] / row["ms"]
            log(f"{name}: {label}: {row['speedup_vs_peer']:.2f}x the peer of its group "
                f"(padding ratio {padding_ratio:.2f})")

    tune(bench, name, values, layout, padding_ratio, sets)
    del values, ours
    torch.cuda.empty_cache()


def host_overhead(bench: Bench, name: str, values: torch.Tensor, layout: JaggedLayout, nbytes: int,
                  padding_ratio: float) -> dict | None:
    """hdim+seq five ways, in group "<W> host overhead": the public `quantize_jagged` call (its kernel relaunched
    directly after the first call), the bare kernel through Triton's JIT, the custom op through the dispatcher (what
    compiled graphs call), the kernel launched into preallocated outputs (`launch`: the Triton launch only)
    and the CUDA-graph replay of the public call (GPU time alone). Each
    row holds `host_us`, the host time per call; ms above the replay's is host time the GPU waited for.
    Returns the replay's row (None if it failed)."""
    group = f"{name} host overhead"
    orients = ("hdim", "seq")
    payloads, scales = allocate_outputs(values, layout.padded_total, orients)
    op_args = (values, layout.offsets, layout.scale_offsets, layout.tile_seq, layout.tile_tokens,
               layout.padded_total, True, True, False, True)
    from gem_lp.jagged.kernels.triton_quantize import _jagged_mx_kernel, launch_args

    grid, jit_args, jit_kwargs = launch_args(values, layout.offsets, layout.scale_offsets, layout.tile_seq,
                                             layout.padded_total, payloads, scales, True,
                                             tile_tokens=layout.tile_tokens)
    ways = [
        ("quantize_jagged (public call)", lambda: quantize_jagged(values, layout, orients, backend="triton")),
        ("Triton JIT launch every call (no direct relaunch)",
         lambda: _jagged_mx_kernel[grid](*jit_args, **jit_kwargs)),
        ("torch.ops.gem_lp.jagged_mx_quantize (custom-op dispatch)",
         lambda: torch.ops.gem_lp.jagged_mx_quantize(*op_args)),
        ("launch into preallocated outputs (Triton launch only)",
         lambda: launch(values, layout.offsets, layout.scale_offsets, layout.tile_seq, layout.padded_total,
                        payloads, scales, True, tile_tokens=layout.tile_tokens)),
    ]
    graph_row = None
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (compile) outside the capture
            quantize_jagged(values, layout, orients, backend="triton")
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            quantize_jagged(values, layout, orients, backend="triton")
        ways.append(("ours hdim+seq (CUDA graph replay)", graph.replay))
    except Exception as e:
        log(f"{name}: CUDA graph capture failed: {type(e).__name__}: {str(e)[:300]}")
    for label, fn in ways:
        try:
            host_us = host_us_per_call(fn)
        except Exception as e:
            log(f"{group} {label}: FAILED {type(e).__name__}: {str(e)[:300]}")
            bench.rows.append(dict(group=group, name=label, error=f"{type(e).__name__}: {str(e)[:300]}"))
            continue
        ms = bench.time(group, label, fn, nbytes=nbytes, bytes_moved=nbytes, host_us=host_us,
                        padding_ratio=padding_ratio)
        log(f"{group} {label}: host {host_us:.1f} us per call")
        if ms is not None and label.endswith("(CUDA graph replay)"):
            graph_row = bench.rows[-1]
    replay = graph_row["ms"] if graph_row else None
    for row in bench.rows:
        if row.get("group") == group and "ms" in row and replay:
            row["ms_over_replay_us"] = (row["ms"] - replay) * 1e3
    del payloads, scales
    return graph_row


def allocate_outputs(values: torch.Tensor, padded_total: int, orientations: tuple[str, ...]):
    """Uninitialized `launch` outputs (payloads, scales) of these orientations for `values [T, H, D]`."""
    t, h, d = values.shape
    hdim_bytes, seq_bytes = scale_sizes(padded_total, d)
    payloads = {o: torch.empty(t, h, d, dtype=PAYLOAD_DTYPE, device=values.device) for o in orientations}
    names = [n for o in orientations for n in ((o,) if o != "square" else ("square_hdim", "square_seq"))]
    scales = {n: torch.empty(h, hdim_bytes if n.endswith("hdim") else seq_bytes, dtype=torch.uint8,
                             device=values.device) for n in names}
    return payloads, scales


def launch_label(opts: LaunchOptions, default: LaunchOptions) -> str:
    return (f"rows={opts.rows} thread_rows={opts.thread_rows}{' row_blocks' if opts.row_blocks_in_thread else ''} "
            f"num_warps={opts.num_warps}" + (f" max_registers={opts.max_registers}" if opts.max_registers else "")
            + (f" programs_per_sm={opts.programs_per_sm}" if opts.programs_per_sm else "")
            + (" direct_inverse" if opts.direct_inverse else "") + (" tile_table" if opts.tile_table else "")
            + (" unmasked_full" if opts.unmasked_full else "") + (" const_strides" if opts.const_strides else "")
            + (" shift_offsets" if opts.shift_offsets else "") + (" float_max" if opts.float_max else "")
            + (" (default)" if opts == default else ""))


def candidates(set_name: str) -> tuple[LaunchOptions, list[LaunchOptions]]:
    """(default launch, every launch to time with the default first) of one orientation set: the
    one-program-per-chunk candidates, then the persistent walks."""
    default = default_launch(LAUNCH_SETS[set_name], True)
    pool = (*CANDIDATE_LAUNCHES[set_name], *PERSISTENT_LAUNCHES.get(set_name, ()))
    return default, [default] + [LaunchOptions(*c) for c in pool if LaunchOptions(*c) != default]


def tune(bench: Bench, name: str, values: torch.Tensor, layout: JaggedLayout, padding_ratio: float,
         sets: tuple[str, ...] = tuple(LAUNCH_SETS)) -> None:
    """Every launch of `CANDIDATE_LAUNCHES` (default first) per orientation set, launch only; each one's
    bytes compared with the default launch's (checked against the reference above and, for every launch,
    by the GPU tests): PASS/FAIL. Each row also holds the launch's sm_90 build figures (registers, spills,
    programs per SM, SASS instructions per element, whether a persistent walk's programs all fit)."""
    t, h, d = values.shape
    hdim_bytes, seq_bytes = scale_sizes(layout.padded_total, d)
    scale_bytes = {"hdim+seq": h * (hdim_bytes + seq_bytes), "hdim": h * hdim_bytes,
                   "square": h * (hdim_bytes + seq_bytes)}
    for set_name, orients in LAUNCH_SETS.items():
        if set_name not in sets:
            continue
        group = f"{name} tuning {set_name}"
        default, launches = candidates(set_name)
        want_payloads, want_scales = allocate_outputs(values, layout.padded_total, orients)
        launch(values, layout.offsets, layout.scale_offsets, layout.tile_seq, layout.padded_total, want_payloads,
               want_scales, True, tile_tokens=layout.tile_tokens)
        nb = useful_bytes(values, 1 if set_name != "hdim+seq" else 2, scale_bytes[set_name])
        timed = []
        for opts in launches:
            label = launch_label(opts, default)
            payloads, scales = allocate_outputs(values, layout.padded_total, orients)

            def run(opts=opts):
                launch(values, layout.offsets, layout.scale_offsets, layout.tile_seq, layout.padded_total,
                       payloads, scales, True, tile_tokens=layout.tile_tokens, **opts._asdict())

            try:
                for out in (*payloads.values(), *scales.values()):
                    out.view(torch.uint8).fill_(0xA5)  # every byte must be written
                run()
                ok = all(torch.equal(payloads[o].view(torch.uint8), want_payloads[o].view(torch.uint8))
                         for o in payloads) and all(torch.equal(scales[n], want_scales[n]) for n in scales)
            except Exception as e:
                log(f"{group} {label}: FAILED {type(e).__name__}: {str(e)[:300]}")
                bench.rows.append(dict(group=group, name=label, error=f"{type(e).__name__}: {str(e)[:300]}"))
                continue
            bench.extra.setdefault(f"{name}_launch_checks", {})[f"{set_name} {label}"] = ok
            log(f"{group} {label}: bytes vs the default launch {'PASS' if ok else 'FAIL'}")
            try:
                build = build_figures(orients, h, d, opts)
            except Exception as e:
                build = dict(build_error=f"{type(e).__name__}: {str(e)[:200]}")
            ms = bench.time(group, label, run, nbytes=nb, launch=list(opts), bit_identical=ok,
                            padding_ratio=padding_ratio, **build)
            if ms is not None and ok:
                timed.append((ms, label))
            del payloads, scales
        if timed:
            ms, label = min(timed)
            bench.extra.setdefault("best_launches", {})[group] = dict(launch=label, ms=ms)
            log(f"{group}: best {label}: {ms:.4f} ms")
        del want_payloads, want_scales
        if values.is_cuda:
            torch.cuda.empty_cache()


def main(workloads: tuple[str, ...] = tuple(WORKLOADS), sets: tuple[str, ...] = tuple(LAUNCH_SETS)) -> None:
    bench = Bench("bench_jagged")
    if not torch.cuda.is_available():
        print("bench_jagged needs a CUDA device (or --compile-only)", flush=True)
        return
    torch.manual_seed(0)
    bench.copy_bandwidth()
    for name, cfg in WORKLOADS.items():
        if name not in workloads:
            continue
        try:
            run_workload(bench, name, cfg, sets)
        except Exception as e:  # one workload failing must not hide the other
            log(f"workload {name} failed: {type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc(limit=4)
        torch.cuda.empty_cache()
    verdicts = {k: v for k, v in bench.extra.items() if k.endswith("bit_identical")}
    log("bit-identity: " + ", ".join(f"{k}={'PASS' if v is True else 'FAIL'}" for k, v in verdicts.items()))
    launch_checks = {f"{w} {k}": v for w in WORKLOADS for k, v in bench.extra.get(f"{w}_launch_checks", {}).items()}
    n_fail = sum(not ok for ok in launch_checks.values())
    log(f"launches vs the default launch: {len(launch_checks) - n_fail} PASS, {n_fail} FAIL"
        + "".join(f"\n  FAIL {k}" for k, ok in launch_checks.items() if not ok))
    for group, b in bench.extra.get("best_launches", {}).items():
        log(f"best {group}: {b['launch']}  {b['ms']:.4f} ms")
    bench.finish()


# --- sm_90 builds (no GPU needed) ----------------------------------------------------------------------

SM90_REGISTERS, SM90_MAX_WARPS, SM90_MAX_PROGRAMS = 65536, 64, 32
# per-thread register limits at the occupancy steps of 64-thread programs (8, 10, 12 programs per SM)
REGISTER_LIMITS = (128, 96, 80)


def programs_per_sm(regs: int, num_warps: int) -> int:
    """Programs an sm_90 SM holds at once (registers allocated per warp in units of 256; no shared memory)."""
    per_warp = math.ceil(regs * 32 / 256) * 256
    return min(SM90_REGISTERS // (per_warp * num_warps), SM90_MAX_WARPS // num_warps, SM90_MAX_PROGRAMS)


def sass_of(cubin: bytes) -> list[str]:
    """Instructions of a cubin in order (NOPs left out), from the cuobjdump bundled with Triton."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    cuobjdump = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    code = [s.strip() for s in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", text)]
    return [s for s in code if not s.startswith("NOP")]


def loads_before_first_use(code: list[str]) -> tuple[int, int]:
    """(16-byte loads issued before an instruction first reads a register one of them filled, all 16-byte
    loads). The first number below the second means the loads go out in more than one wave: the thread
    waits a memory latency for its first rows before it requests the others."""
    import re

    loads = [i for i, s in enumerate(code) if "LDG.E.128" in s]
    if not loads:
        return 0, 0
    filled: set[int] = set()
    issued = 0
    for s in code[loads[0]:]:
        body = re.sub(r"^@!?U?P\w+\s+", "", s)
        op, _, operands = body.partition(" ")
        if "LDG.E.128" in op:
            first = int(re.match(r"R(\d+)", operands).group(1))
            filled |= set(range(first, first + 4))
            issued += 1
            continue
        sources = operands if op.startswith(("ST", "BRA", "BAR", "EXIT")) else operands.partition(",")[2]
        if any(int(n) in filled for n in re.findall(r"\bR(\d+)", sources)):
            break
    return issued, len(loads)


def build_figures(orientations: tuple[str, ...], heads: int, dim: int, opts: LaunchOptions) -> dict:
    """The sm_90 build of one launch (bf16 values, rceil, hardware cast), from shapes only: registers, spill
    bytes, programs per SM, SASS instructions (whole kernel; D = 128 runs it once per program: one feature
    chunk, no padding code) and per element of a full chunk, 16-byte loads per thread and how many of them
    go out before the first is used (`loads_before_first_use`; a persistent walk: counted from its first
    load, the prologue's); for a persistent walk, `walk_fits`: its programs per SM are all resident at once
    (else the grid's last programs start only when others end)."""
    from gem_lp.jagged.kernels.triton_quantize import _jagged_mx_kernel, launch_args
    from gem_lp.mx.kernels.triton_quantize import compile_for_target, ptxas_usage

    t, tp = 1000, 1280  # the build depends on H, D and the launch options, not on the batch
    values = torch.empty(t, heads, dim, dtype=torch.bfloat16)
    offsets, scale_offsets = torch.tensor([0, 600, 1000]), torch.tensor([0, 640, 1280])
    tile_seq = torch.zeros(tp // 128, dtype=torch.int32)
    tile_tokens = torch.zeros(tp // 128, 2, dtype=torch.int64)
    payloads, scales = allocate_outputs(values, tp, orientations)
    grid, args, kwargs = launch_args(values, offsets, scale_offsets, tile_seq, tp, payloads, scales, True,
                                     tile_tokens=tile_tokens, hw_cast=True, **opts._asdict())
    compiled = compile_for_target(_jagged_mx_kernel, args, kwargs)
    ptx = compiled.asm["ptx"]
    regs, spills = ptxas_usage(ptx)
    code = sass_of(compiled.asm["cubin"])
    first_wave, loads = loads_before_first_use(code)
    resident = programs_per_sm(regs, opts.num_warps)
    figures = dict(regs=regs, spills=spills, programs_per_sm=resident, sass=len(code),
                   sass_per_element=len(code) * 32 * opts.num_warps / (opts.rows * dim), ld_v4=loads,
                   ld_v4_first_wave=first_wave)
    if opts.programs_per_sm:
        figures["walk_fits"] = opts.programs_per_sm <= resident
    return figures


def compile_only() -> int:
    """Build every launch the GPU run times, for each workload's (H, D), for sm_90 on this machine (no GPU)."""
    failed = 0
    for name, cfg in WORKLOADS.items():
        for set_name, orients in LAUNCH_SETS.items():
            default, launches = candidates(set_name)
            for opts in launches:
                label = f"{name} {set_name:8s} {launch_label(opts, default)}"
                try:
                    b = build_figures(orients, cfg["heads"], cfg["dim"], opts)
                except Exception as e:
                    failed += 1
                    print(f"  {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                walk = ("" if "walk_fits" not in b else
                        f"  walk of {opts.programs_per_sm}/SM {'fits' if b['walk_fits'] else 'DOES NOT FIT'}")
                print(f"  {label}: registers {b['regs']:3d}  spill bytes {b['spills']}  programs/SM "
                      f"{b['programs_per_sm']}  SASS {b['sass']} ({b['sass_per_element']:.1f}/element)  "
                      f"16-byte loads {b['ld_v4']} ({b['ld_v4_first_wave']} before the first use){walk}",
                      flush=True)
    # what each register limit of an occupancy step costs the defaults (a candidate lists only spill-free ones)
    for set_name in ("hdim+seq", "hdim"):
        default = default_launch(LAUNCH_SETS[set_name], True)
        for limit in REGISTER_LIMITS:
            opts = default._replace(max_registers=limit)
            try:
                b = build_figures(LAUNCH_SETS[set_name], 4, 128, opts)
            except Exception as e:
                failed += 1
                print(f"  limit {set_name:8s} {launch_label(opts, default)}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            print(f"  limit {set_name:8s} {launch_label(opts, default)}: registers {b['regs']:3d}  spill bytes "
                  f"{b['spills']}  programs/SM {b['programs_per_sm']}  SASS {b['sass']}", flush=True)
    print(f"sm_90 builds: {'all built' if not failed else f'{failed} FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true", help="build every launch for sm_90, no GPU needed")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="comma-separated subset of " + ",".join(WORKLOADS))
    parser.add_argument("--sets", default=",".join(LAUNCH_SETS),
                        help="tuning groups to time, a comma-separated subset of " + ",".join(LAUNCH_SETS))
    args = parser.parse_args()
    for given, known, what in ((args.workloads, WORKLOADS, "--workloads"), (args.sets, LAUNCH_SETS, "--sets")):
        unknown = set(given.split(",")) - set(known)
        if unknown:
            parser.error(f"{what}: unknown {sorted(unknown)}; expected a subset of {','.join(known)}")
    if args.compile_only:
        sys.exit(compile_only())
    main(tuple(args.workloads.split(",")), tuple(args.sets.split(",")))
