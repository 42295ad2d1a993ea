"""The Triton MX cast kernel's tuning space (`gem_lp.mx.kernels.triton_cast`, `benchmarks/cast_candidates.py`): every
candidate launch timed beside the product's default, each checked against the reference (GPU), and the sm_90 builds
of the launches with their registers, spills and instructions per element (no GPU needed).

Run from the project root: `python -m benchmarks.tune_casts` (JSON `tune_casts.json` under $OUT, else ./.bench_out).
Sections (each one guarded: a failing variant or peer is recorded, the rest still runs):

* norm: `rms_norm_mx` (rowwise + colwise MX, blocked scales, rstd) per launch configuration of
  `cast_candidates.CANDIDATE_CONFIGS` (the default first), bytes checked against the reference; then host against
  kernel time: the public `gem_lp.norm.rms_norm_quantize` (plain scales, checked too), the bare Triton
  launch into preallocated outputs and a CUDA-graph replay (no host work) of the default and of the fastest
  launch, each with its host microseconds per call (JSON `norm_host_us_per_call`); peers: `torch.compile` of
  RMSNorm + torchao `to_mx` in both layouts (or, without torchao, of our reference RMSNorm + dual cast) and a
  copy of x. Effective bytes = x read once + every payload, scale and rstd byte written.
* tokens: the default launch at the token counts of a jagged batch (M not a multiple of 32 or 16).
* cast: MXLinear's dY cast (both dequantized operands, with and without the bias gradient's column sums) per launch
  of `cast_candidates.OPERAND_CAST_CANDIDATE_CONFIGS`.

`python -m benchmarks.tune_casts --compile-only` (no GPU needed) builds every launch the GPU run times for sm_90
and prints its registers, spills, programs per SM, sm_90 (SASS) instructions per element and the bytes its resident
programs keep between the two sweeps; it fails if one does not build. (The CuTe cast kernel and the casts of the
MX linears on each kernel: `benchmarks/bench_norm.py`; the linears themselves: `benchmarks/bench_linear.py`.)
"""
from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make the project root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.cast_candidates import CANDIDATE_CONFIGS, OPERAND_CAST_CANDIDATE_CONFIGS  # noqa: E402
from benchmarks.common import Bench, host_us_per_call  # noqa: E402
from gem_lp.mx import dequantize, quantize_reference, to_blocked  # noqa: E402
from gem_lp.mx.kernels import triton_cast as tn  # noqa: E402
from gem_lp.mx.kernels.triton_cast import rms_norm_mx  # noqa: E402
from gem_lp.norm.reference import rms_norm_quantize_reference  # noqa: E402

EPS = 1e-6
DEVICE = "cuda"
NORM_SHAPES = ((32768, 1024), (32768, 4096))  # K of each is a key of CANDIDATE_CONFIGS
NORM_EXTRA_SHAPES = ((32768, 512),)  # timed when --norm-ks names them
# MXLinear's dY cast (no norm, both dequantized operands): K a key of OPERAND_CAST_CANDIDATE_CONFIGS
OPERAND_CAST_SHAPES = ((32768, 3072),)


def _fail(bench: Bench, group: str, name: str, e: Exception) -> None:
    msg = f"{type(e).__name__}: {str(e)[:300]}"
    print(f"  [{group}] {name}: FAILED {msg}", flush=True)
    traceback.print_exc(limit=3)
    bench.rows.append(dict(group=group, name=name, error=msg))


def _free() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- norm


def _norm_bytes(M: int, K: int, out) -> int:
    """x read once plus every byte written (`out`: `NormMXOutputs` or `RMSNormQuantized`)."""
    written = sum(t.numel() * t.element_size() for t in
                  (out.rowwise.data, out.rowwise.scale, out.colwise.data, out.colwise.scale, out.rstd))
    if getattr(out, "row_operand", None) is not None:
        written += out.row_operand.numel() * 2
    return M * K * 2 + written


def _norm_matches_reference(out, x, w) -> bool:
    """Bytes equal the reference quantization of y computed with the kernel's rstd; rstd within 4 ulp of the
    exact value (FP64; torch's CUDA rsqrt is itself approximate, so it is not the oracle here). Scales blocked
    or plain, as `out` says."""
    rstd64 = torch.rsqrt(x.double().square().mean(-1) + EPS)
    ok = bool(((out.rstd.double() - rstd64).abs() <= 4 * torch.finfo(torch.float32).eps * rstd64).all())
    del rstd64
    y = x.float() * out.rstd[:, None] * w.float()
    for got, axis_of in ((out.rowwise, lambda t: t), (out.colwise, lambda t: t.t())):
        want = quantize_reference(axis_of(y), axis=1, allow_partial=True)
        ok &= torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        ok &= torch.equal(got.scale, to_blocked(want.scale) if got.scale_layout == "blocked" else want.scale)
        del want
    return bool(ok)


def _compiled_norm_peers(w: torch.Tensor):
    """(name, fn) pairs of the unfused pipeline under torch.compile."""
    peers = []

    def ours_reference(x):
        q = rms_norm_quantize_reference(x, w, EPS, "rceil")
        return q.rowwise.data, q.rowwise.scale, q.colwise.data, q.colwise.scale, q.rstd

    peers.append(("torch.compile(reference RMSNorm + dual cast)", torch.compile(ours_reference, dynamic=False)))
    try:
        from torchao.prototype.mx_formats.mx_tensor import to_mx

        def torchao_pipeline(x):
            y = F.rms_norm(x.float(), (x.shape[1],), w.float(), EPS)
            s_row, d_row = to_mx(y, torch.float8_e4m3fn, 32)
            s_col, d_col = to_mx(y.t().contiguous(), torch.float8_e4m3fn, 32)
            return d_row, s_row, d_col, s_col

        peers.insert(0, ("torch.compile(F.rms_norm + torchao to_mx rowwise + colwise)",
                         torch.compile(torchao_pipeline, dynamic=False)))
    except Exception as e:  # torchao is optional on the GPU host
        print(f"  torchao unavailable ({type(e).__name__}: {e}); the compiled reference is the peer", flush=True)
    return peers


def norm_configs(K: int) -> list[tn.NormConfig]:
    """The default launch configuration for rows of K first, then the other candidates."""
    default = tn.default_config(K)
    return [default] + [c for c in CANDIDATE_CONFIGS.get(K, ()) if c != default]


def operand_cast_configs(K: int) -> list[tn.NormConfig]:
    """The dual-operand cast without the norm (MXLinear's dY): its default launch for rows of K (M even, hardware
    conversion), then the other candidates."""
    default = tn.default_config(K, True, True, True, False)
    return [default] + [c for c in OPERAND_CAST_CANDIDATE_CONFIGS.get(K, ()) if c != default]


def _operand_cast_matches_reference(out, x) -> bool:
    """Both operands equal the dequantized reference casts of x (rowwise; colwise of x^T, laid out as x)."""
    ok = True
    for got, axis_of in ((out.row_operand, lambda t: t), (out.col_operand, lambda t: t.t())):
        want = dequantize(quantize_reference(axis_of(x), axis=1, allow_partial=True))
        ok &= torch.equal(got, axis_of(want).to(got.dtype))
        del want
    return bool(ok)


def _column_sums_close(sums: torch.Tensor, x: torch.Tensor) -> bool:
    """Within 1e-5 of each column's sum of magnitudes of torch's FP32 column sums (another summation order)."""
    return bool(((sums - x.float().sum(0)).abs() <= 1e-5 * x.float().abs().sum(0)).all())


def bench_operand_cast(bench: Bench, checks: dict) -> None:
    """MXLinear's dY cast: `rms_norm_mx(dy, None, row_operand, col_operand)` (BF16 operands, no payloads) per
    launch of `operand_cast_configs`, operands checked; then the same with `column_sums` (the bias gradient, sums
    checked) beside torch's FP32 column sum alone, the payload-only dual cast of `triton_quantize` and a copy.
    TB/s counts the bytes moved: dY read once and both operands written (and the FP32 sums)."""
    from gem_lp.mx.kernels.triton_quantize import mx_cast_2d

    for M, K in OPERAND_CAST_SHAPES:
        group = f"dY operand cast {M}x{K}"
        g = torch.Generator(device=DEVICE).manual_seed(M * K)
        dy = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16, generator=g)
        moved = 3 * M * K * 2
        configs = operand_cast_configs(K)
        for sums in (False, True):
            for cfg in configs:
                kw = _config_kwargs(cfg)
                name = (f"ours rms_norm_mx(dy, None) operands {cfg!r}" + (" + column sums" if sums else "")
                        + (" (default)" if cfg == configs[0] else ""))

                def run(kw=kw, sums=sums):
                    return rms_norm_mx(dy, None, rowwise=False, colwise=False, row_operand=True, col_operand=True,
                                       column_sums=sums, **kw)

                try:
                    out = run()
                    ok = _operand_cast_matches_reference(out, dy)
                    if sums:
                        ok &= _column_sums_close(out.column_sums, dy)
                    del out
                except Exception as e:
                    _fail(bench, group, name, e)
                    continue
                checks[f"{group} {name}"] = ok
                try:
                    build = {k: v for k, v in build_norm(M, K, cfg, normalize=False, rowwise=False, colwise=False,
                                                         row_operand=True, col_operand=True,
                                                         column_sums=sums).items() if k != "cvt"}
                except Exception as e:
                    build = dict(build_error=f"{type(e).__name__}: {str(e)[:200]}")
                bench.time(group, name, run, nbytes=moved + (4 * K if sums else 0), config=list(cfg),
                           bit_identical=ok, **build)
                _free()
        peers = [("torch dy.sum(0, dtype=float32) (the bias gradient alone)",
                  lambda: dy.sum(0, dtype=torch.float32), M * K * 2 + 4 * K),
                 ("triton_quantize mx_cast_2d rowwise + colwise payloads (blocked scales)",
                  lambda: mx_cast_2d(dy, rowwise=True, colwise=True, blocked_scales=True), M * K * 4)]
        y = torch.empty_like(dy)
        peers.append(("copy dY (read + write)", lambda: y.copy_(dy), 2 * M * K * 2))
        for name, fn, nbytes in peers:
            bench.time(group, name, fn, nbytes=nbytes, peer=True)
        del dy, y
        _free()


def _config_kwargs(cfg: tn.NormConfig) -> dict:
    return dict(zip(tn.CONFIG_FIELDS, cfg))


def _graph_replay(fn):
    """`replay` of a CUDA graph holding one call of `fn` (run once before, outside the capture: compiled, the
    allocator warm). A replay runs the same kernels without the host work of the call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _launch_only(x: torch.Tensor, w: torch.Tensor, cfg: tn.NormConfig):
    """The bare Triton launch of `rms_norm_mx` for `cfg`, into outputs allocated once (no checks, no allocation)."""
    out = rms_norm_mx(x, w, EPS, **_config_kwargs(cfg))
    kernel, grid, args, kwargs = tn.forward_launch(
        x, w, EPS, out.rstd, (out.rowwise.data, out.rowwise.scale), (out.colwise.data, out.colwise.scale), None,
        None, blocked_scales=True, rceil=True, hw_cast=True, config=cfg)
    return lambda: kernel[grid](*args, **kwargs)


def bench_norm_token_counts(bench: Bench, checks: dict) -> None:
    """The default launch at token counts a jagged batch has (M not a multiple of 32 or 16, odd), beside the
    aligned M of the main rows: training meets these (`default_config` gives M not a multiple of 32 its own
    launch). Where K has a measured launch, the unaligned M also time the launch the default did not pick (the
    measured launch or the light one; `MEASURED_UNALIGNED_KS` records the choice)."""
    for K in sorted({k for _, k in NORM_SHAPES}):
        group = f"norm default, M of a batch, K={K}"
        for M in (32768, 32784, 32766, 32767):
            x, w = _norm_inputs(M, K)
            default = tn.default_config(K, M % 32 == 0)
            launches = [(f"ours rms_norm_mx M={M} {default!r}", {})]
            if K in tn.MEASURED_KS and M % 32:  # the other candidate of unaligned M
                other = tn.strip_config(K, False) if default == tn.MEASURED_CONFIG else tn.MEASURED_CONFIG
                launches.append((f"ours rms_norm_mx M={M} {other!r} (the other launch)", _config_kwargs(other)))
            for name, kw in launches:
                checked = _checked_norm_call(bench, checks, group, name, x, w, kw)
                if checked is not None:
                    bench.time(group, name, lambda kw=kw: rms_norm_mx(x, w, EPS, **kw), nbytes=checked[1],
                               bit_identical=checked[0])
            del x
            _free()


def _norm_inputs(M: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bf16 and an FP32 norm weight, seeded by the shape."""
    g = torch.Generator(device=DEVICE).manual_seed(M + K)
    return (torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16, generator=g),
            torch.rand(K, device=DEVICE, generator=g) + 0.5)


def _checked_norm_call(bench: Bench, checks: dict, group: str, name: str, x, w, kw: dict):
    """One `rms_norm_mx(x, w, **kw)` call checked against the reference: (bytes match, useful bytes), recorded
    in `checks`; None (and a FAILED row) when the call raises."""
    try:
        out = rms_norm_mx(x, w, EPS, **kw)
        ok = _norm_matches_reference(out, x, w)
        nbytes = _norm_bytes(x.shape[0], x.shape[1], out)
        del out
    except Exception as e:
        _fail(bench, group, name, e)
        return None
    checks[f"{group} {name}"] = ok
    return ok, nbytes


def bench_norm(bench: Bench, checks: dict, ks: tuple[int, ...] | None = None, match: str | None = None) -> None:
    """Per shape: every candidate launch of `rms_norm_mx` (bytes checked; timed by CUDA-graph replay, so that the
    host work of the call, ~20-80 us, does not hide kernels of ~50 us), then host against kernel time: the
    public `rms_norm_quantize` call, the bare launch into preallocated outputs and CUDA-graph replays of the
    default and the best launch, then the row operand and the peers. `ks`: the K of the shapes to run
    (default NORM_SHAPES'); `match`: time only the candidates whose name contains it (and the default)."""
    from gem_lp.norm import rms_norm_quantize

    shapes = [s for s in NORM_SHAPES + NORM_EXTRA_SHAPES if s[1] in ks] if ks else NORM_SHAPES
    for M, K in shapes:
        group = f"norm {M}x{K}"
        x, w = _norm_inputs(M, K)
        x_bytes = M * K * 2
        best = None
        default = norm_configs(K)[0]
        for cfg in norm_configs(K):
            if match and cfg != default and match not in repr(cfg):
                continue
            kw = _config_kwargs(cfg)
            name = f"ours rms_norm_mx {cfg!r}" + (" (default)" if cfg == default else "")
            checked = _checked_norm_call(bench, checks, group, name, x, w, kw)
            if checked is None:
                continue
            ok, nbytes = checked
            try:  # the sm_90 build's figures beside the timing (instructions per element, registers, ...)
                build = {k: v for k, v in build_norm(M, K, cfg).items() if k != "cvt"}
            except Exception as e:
                build = dict(build_error=f"{type(e).__name__}: {str(e)[:200]}")
            try:
                replay = _graph_replay(lambda kw=kw: rms_norm_mx(x, w, EPS, **kw))
            except Exception as e:
                _fail(bench, group, name, e)
                continue
            ms = bench.time(group, name + " [graph replay]", replay, nbytes=nbytes, config=list(cfg),
                            bit_identical=ok, **build)
            del replay
            if ms is not None and ok and (best is None or ms < best[0]):
                best = (ms, cfg)
        nbytes = _norm_bytes(M, K, rms_norm_mx(x, w, EPS))  # the same useful bytes for every row below
        host_us = bench.extra.setdefault("norm_host_us_per_call", {}).setdefault(group, {})
        timed = [("ours rms_norm_quantize (public op, plain scales)", lambda: rms_norm_quantize(x, w, EPS),
                  "public", None)]
        for cfg in dict.fromkeys([default] + ([best[1]] if best else [])):  # the default, then the best if other
            what = "default" if cfg == default else "best"
            timed += [(f"ours bare launch {cfg!r} ({what}, outputs preallocated)", None, "launch", cfg),
                      (f"ours CUDA graph replay {cfg!r} ({what})", None, "graph", cfg)]
        for name, fn, kind, cfg in timed:
            try:
                if kind == "public":
                    ok = _norm_matches_reference(fn(), x, w)
                    checks[f"{group} {name}"] = ok
                elif kind == "launch":
                    fn = _launch_only(x, w, cfg)
                else:
                    fn = _graph_replay(lambda cfg=cfg: rms_norm_mx(x, w, EPS, **_config_kwargs(cfg)))
                host_us[name] = host_us_per_call(fn)
                print(f"  [{group}] {name}: host {host_us[name]:.1f} us per call", flush=True)
                bench.time(group, name, fn, nbytes=nbytes, host_us_per_call=host_us[name])
            except Exception as e:
                _fail(bench, group, name, e)
            del fn
            _free()
        try:
            host_us["ours rms_norm_mx (default)"] = host_us_per_call(lambda: rms_norm_mx(x, w, EPS))
            print(f"  [{group}] rms_norm_mx default: host {host_us['ours rms_norm_mx (default)']:.1f} us per call",
                  flush=True)
        except Exception as e:
            _fail(bench, group, "host time of rms_norm_mx", e)
        if best is not None:
            bench.extra.setdefault("norm_best_configs", {})[group] = dict(config=list(best[1]), ms=best[0])
            kw = _config_kwargs(best[1])
            try:
                nbytes_op = _norm_bytes(M, K, rms_norm_mx(x, w, EPS, row_operand=True, **kw))
                bench.time(group, f"ours + bf16 row operand {best[1]!r}",
                           lambda: rms_norm_mx(x, w, EPS, row_operand=True, **kw), nbytes=nbytes_op)
            except Exception as e:
                _fail(bench, group, "ours + bf16 row operand", e)
        y = torch.empty_like(x)
        bench.time(group, "copy x (read + write)", lambda: y.copy_(x), nbytes=2 * x_bytes, peer=True)
        del y
        for name, fn in _compiled_norm_peers(w):
            try:
                fn(x)
            except Exception as e:
                _fail(bench, group, name, e)
                continue
            bench.time(group, name, lambda fn=fn: fn(x), nbytes=nbytes, peer=True)
        del x, w
        _free()


# ----------------------------------------------------------------------------- norm, sm_90 builds

H100_REGISTERS_PER_SM, H100_MAX_WARPS_PER_SM, H100_SMEM_PER_SM, H200_SMS = 65536, 64, 228 * 1024, 132


def sass_of(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction) of a cubin's main code, from the cuobjdump bundled with Triton; slow-path
    subroutines reached by CALL (IEEE division and square root) follow the main code and are left out."""
    from triton.backends.nvidia.compiler import get_ptxas

    cuobjdump = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    code = [(int(a, 16), s.strip()) for a, s in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]
    code = [(a, s) for a, s in code if not s.startswith("NOP")]
    calls = [int(t, 16) for _, s in code for t in re.findall(r"CALL\.REL\.NOINC (0x[0-9a-f]+)", s)]
    return [(a, s) for a, s in code if not calls or a < min(calls)]


def sass_per_row_block(code: list[tuple[int, str]], n_chunks: int) -> int:
    """Instructions one thread issues for one row block: the main code, with each innermost loop that loads
    from global memory (a backward branch; one per sweep over K) run n_chunks times. A loop enclosing another
    (the persistent walk over row blocks) counts once, and so does a loop without loads (zeroing the padding of
    the blocked scales, which only runs at unaligned shapes, is counted, once, although aligned ones skip it).
    Loops the compiler unrolled completely are already in the main code."""
    loops = [(int(t, 16), a) for a, s in code for t in re.findall(r"BRA (0x[0-9a-f]+)", s) if int(t, 16) < a]
    innermost = [(t, a) for t, a in loops if not any(t < t2 and a2 < a for t2, a2 in loops)]
    sweeps = [(t, a) for t, a in innermost if any(t <= b <= a and "LDG" in s for b, s in code)]
    extra = sum((n_chunks - 1) * sum(1 for b, _ in code if t <= b <= a) for t, a in sweeps)
    return len(code) + extra


def programs_per_sm(regs: int, num_warps: int, smem: int) -> int:
    """Programs an H200 SM holds at once (registers allocated per warp in units of 256)."""
    regs_per_warp = math.ceil(regs * 32 / 256) * 256
    by_regs = H100_REGISTERS_PER_SM // (regs_per_warp * num_warps)
    by_smem = H100_SMEM_PER_SM // smem if smem else 32
    return max(0, min(by_regs, H100_MAX_WARPS_PER_SM // num_warps, by_smem, 32))


def build_norm(M: int, K: int, cfg: tn.NormConfig, *, rowwise=True, colwise=True, row_operand=False,
               col_operand=False, normalize=True, hw_cast=True, x_dtype=torch.bfloat16, column_sums=False,
               activation=None, activation_input=False) -> dict:
    """sm_90 build of the launch `rms_norm_mx` makes for x [M, K] (bf16 unless `x_dtype`; fp32 weight, blocked
    scales; `column_sums` and `activation` without the norm; `activation_input`: x is the gradient of the activation's
    output, the casts those of its input's gradient), from shapes only (meta tensors): registers, spill bytes,
    programs per SM, SASS instructions per element, 16-byte loads, vector stores, hardware E4M3 conversions, float32
    atomic adds in the PTX (`atomics`), and the re-read bytes in flight (resident row blocks of a multi-pass launch,
    H200)."""
    from gem_lp.mx.layout import blocked_size
    from gem_lp.mx.kernels.triton_quantize import compile_for_target, ptxas_usage

    dev = "meta"
    x = torch.empty(M, K, dtype=x_dtype, device=dev)
    w = torch.empty(K, device=dev) if normalize else None
    rstd = torch.empty(M, device=dev) if normalize else None
    row = (torch.empty(M, K, dtype=torch.float8_e4m3fn, device=dev),
           torch.empty(blocked_size(M, K // 32), dtype=torch.uint8, device=dev)) if rowwise else None
    col = (tn.colwise_payload_buffer(K, M, dev),  # [K, M] view, rows a multiple of 16 bytes apart
           torch.empty(blocked_size(K, math.ceil(M / 32)), dtype=torch.uint8, device=dev)) if colwise else None
    ops = [torch.empty(M, K, dtype=torch.bfloat16, device=dev) if want else None for want in (row_operand, col_operand)]
    sums = torch.empty(K, device=dev) if column_sums else None
    z = torch.empty(M, K, dtype=x_dtype, device=dev) if activation_input else None
    kernel, _, args, kwargs = tn.forward_launch(x, w, 1e-6, rstd, row, col, *ops, blocked_scales=True, rceil=True,
                                                hw_cast=hw_cast, config=cfg, column_sums=sums,
                                                act=tn._activation_code(activation, x_dtype, activation_input),
                                                act_input=z)
    compiled = compile_for_target(kernel, args, kwargs)
    ptx = compiled.asm["ptx"]
    regs, spills = ptxas_usage(ptx)
    bm, bk, nw = cfg[:3]
    n_chunks = 1 if cfg[8] else math.ceil(K / bk)  # tile programs: one chunk a program, no loop
    per_block = sass_per_row_block(sass_of(compiled.asm["cubin"]), n_chunks)
    resident = programs_per_sm(regs, nw, compiled.metadata.shared)
    if cfg[5]:
        resident = min(resident, cfg[5])
    in_flight = resident * H200_SMS * bm * K * x.element_size() if normalize and bk < K else 0
    return dict(regs=regs, spills=spills, programs_per_sm=resident,
                instructions_per_element=per_block * 32 * nw / (bm * n_chunks * bk),
                ld_v4=ptx.count("ld.global.v4"), st_vec=ptx.count("st.global.v2") + ptx.count("st.global.v4"),
                cvt=ptx.count("cvt.rn.satfinite.e4m3x2.f32"),
                atomics=len(re.findall(r"(?:atom|red)\.[\w.]*add(?:\.v[24])?\.f32", ptx)),
                reread_mib_in_flight=in_flight / 2**20)


def _report_build(label: str, build, describe) -> bool:
    """Print the sm_90 figures of `build()` (a `build_norm` result) with `describe(figures)` appended, or its
    failure; True when it built."""
    try:
        b = build()
    except Exception as e:
        print(f"  {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        return False
    print(f"  {label}: {b['instructions_per_element']:5.1f} instructions/element  registers {b['regs']:3d}  "
          f"spill bytes {b['spills']}  programs/SM {b['programs_per_sm']}  {describe(b)}", flush=True)
    return True


def compile_only() -> int:
    """Build every norm launch the GPU run times (RMSNorm + both casts; the dY operand cast with and without
    column sums), for sm_90 on this machine (no GPU); 1 if one fails."""
    failed = 0
    for M, K in NORM_SHAPES:
        for i, cfg in enumerate(norm_configs(K)):
            label = f"{M}x{K} {cfg!r:24s}" + (" (default)" if i == 0 else "")
            failed += not _report_build(label, lambda: build_norm(M, K, cfg),
                                        lambda b: f"re-read in flight {b['reread_mib_in_flight']:6.1f} MiB")
    operands = dict(normalize=False, rowwise=False, colwise=False, row_operand=True, col_operand=True)
    for M, K in OPERAND_CAST_SHAPES:
        for sums in (False, True):
            for i, cfg in enumerate(operand_cast_configs(K)):
                label = (f"{M}x{K} dY operands{' + sums' if sums else '       '} {cfg!r:26s}"
                         + (" (default)" if i == 0 else ""))
                failed += not _report_build(label, lambda: build_norm(M, K, cfg, column_sums=sums, **operands),
                                            lambda b: f"float32 atomics {b['atomics']}")
    print(f"sm_90 builds: {'all built' if not failed else f'{failed} FAILED'}")
    return 1 if failed else 0


SECTIONS = ("norm", "tokens", "cast")


def main(sections: tuple[str, ...] = SECTIONS, norm_ks: tuple[int, ...] | None = None,
         norm_match: str | None = None) -> None:
    t0 = time.time()
    bench = Bench("tune_casts")
    bench.copy_bandwidth()
    checks: dict[str, bool] = {}
    bench.extra.update(checks=checks)  # filled as the sections run (partial runs too)

    def norm(bench: Bench, checks: dict) -> None:
        bench_norm(bench, checks, norm_ks, norm_match)

    for section in [f for n, f in (("norm", norm), ("tokens", bench_norm_token_counts), ("cast", bench_operand_cast))
                    if n in sections]:
        try:
            section(bench, checks)
        except Exception as e:
            _fail(bench, section.__name__, "section", e)
        _free()
    bench.extra.update(checks=checks, wall_s=time.time() - t0)
    n_fail = sum(not ok for ok in checks.values())
    print(f"\nchecks vs reference: {len(checks) - n_fail} PASS, {n_fail} FAIL"
          + "".join(f"\n  FAIL {k}" for k, ok in checks.items() if not ok))
    bench.finish()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true",
                        help="build the launches for sm_90 without a GPU (TRITON_INTERPRET must be unset)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="comma-separated subset of " + ",".join(SECTIONS) + " to run (tokens: the norm's "
                        "default at unaligned token counts; cast: the dY operand cast)")
    parser.add_argument("--norm-ks", default=None,
                        help="comma-separated K of the norm section's shapes (default "
                        + ",".join(str(k) for _, k in NORM_SHAPES) + "; also "
                        + ",".join(str(k) for _, k in NORM_EXTRA_SHAPES) + ")")
    parser.add_argument("--norm-match", default=None,
                        help="the norm section times only the candidates whose name contains this (e.g. prefetch)")
    args = parser.parse_args()
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"--sections: unknown {sorted(unknown)}; expected a subset of {','.join(SECTIONS)}")
    known_ks = {k for _, k in NORM_SHAPES + NORM_EXTRA_SHAPES}
    try:
        norm_ks = None if args.norm_ks is None else tuple(int(k) for k in args.norm_ks.split(","))
    except ValueError:
        parser.error(f"--norm-ks: expected comma-separated integers, got {args.norm_ks!r}")
    if norm_ks is not None and set(norm_ks) - known_ks:
        parser.error(f"--norm-ks: unknown K {sorted(set(norm_ks) - known_ks)}; expected some of {sorted(known_ks)}")
    if args.compile_only:
        sys.exit(compile_only())
    if not torch.cuda.is_available():
        sys.exit("tune_casts needs a CUDA device (or --compile-only)")
    main(tuple(args.sections.split(",")), norm_ks, args.norm_match)
