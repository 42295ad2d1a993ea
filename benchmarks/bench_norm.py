"""RMSNorm + both MX casts (and the dual cast alone) on one GPU: the CuTe kernel beside a device copy of the same
bytes (the ceiling), quack's BF16 `rmsnorm_fwd`, `torch.compile` of the reference, and the Triton kernels.

Shapes: BF16 x `[M, K]`, M = 32767, 262143, 300001 (odd token counts of jagged batches: the colwise payload's padded
rows, partial row blocks) and the token count of the GPU trainer's first batch (`common.trainer_token_counts`);
K = 256, 512, 1024, 4096 (the model's widths and the kernels' launch-table entries).
Rows per shape (group `norm MxK`):
  copy                 a device copy of as many bytes as ours moves (the ceiling of the group)
  ours cute            `norm_mx_cast` (blocked scales, the launch table's choice), then every other launch of
                       `LAUNCH_CANDIDATES` (same bytes, checked), to keep the table honest
  ours public op       `rms_norm_quantize(backend="cute")`, plain and blocked scales (host checks included); its
                       host microseconds per call in the JSON (`host_us_per_call`)
  triton               `rms_norm_quantize(backend="triton")`
  torch.compile        of `rms_norm_quantize_reference` (RMSNorm + both casts, unfused)
  quack rmsnorm_fwd    BF16 RMSNorm only (reads x, writes BF16 y): what copy speed looks like for a norm
and per shape a `dual MxK` group: `quantize_dual` on cute beside Triton and the copy; with `--casts`, a `casts MxK`
group: each cast the MX linears make on the cuBLAS route (`gem_lp.linear.operands.casts`: the forward operand with
and without the norm, the SiLU operand, dY's two operands with its column sums) by the CuTe kernel and by the Triton
kernel (forced through the per-arch table `cute_cast_config.LINEAR_CASTS_FROM_K`: every cast from K = 0, or none),
the outputs compared byte for byte (`same` in the JSON); with `--backward`, a `norm backward MxK` group: the Triton
norm backward the MX linears use (its launch candidates too) and the CuTe one beside quack's `rmsnorm_bwd`
(`--only casts|backward` runs just those groups).
TB/s counts x read once plus every byte written (payloads, scales, rstd); quack's rows count its own bytes. Each
of our rows is checked byte for byte (`exact` in the JSON): payloads and scales against the reference quantization of
y computed with the kernel's rstd, rstd within 4 ulp of the FP64 value.

Run on the GPU host from the repository root: `python -m benchmarks.bench_norm [--ms 32767,262143] [--ks 1024]
[--no-candidates] [--cuda-graphs]`. Prints the timing table last; JSON under $OUT. `--dry-run` (no GPU) prints the shapes.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Bench, host_us_per_call, trainer_token_counts  # noqa: E402
from gem_lp.mx import quantize_dual, quantize_reference, to_blocked  # noqa: E402
from gem_lp.norm import rms_norm_quantize  # noqa: E402
from gem_lp.norm.reference import rms_norm_quantize_reference  # noqa: E402

DEV = "cuda"
EPS = 1e-6
MS = (32767, 262143, 300001)  # and the GPU trainer's first batch (`default_ms`)
KS = (256, 512, 1024, 4096)
# Launches (tile_k, cluster_n) timed beside the table's, per K
LAUNCH_CANDIDATES = {256: ((128, 2), (256, 1)), 512: ((128, 4), (256, 2), (512, 1)),
                     1024: ((128, 8), (256, 4), (512, 2), (1024, 1)), 4096: ((256, 16), (512, 8), (1024, 4))}


def default_ms() -> tuple[int, ...]:
    return MS + tuple(trainer_token_counts(1))


def moved_bytes(x: torch.Tensor, tensors) -> int:
    """x read once plus the bytes of every output tensor (a padded colwise payload counts its logical bytes)."""
    return x.numel() * x.element_size() + sum(t.numel() * t.element_size() for t in tensors if t is not None)


def exact(out_row, out_col, rstd, x, w) -> bool:
    """Payloads and scales equal the reference quantization of y (x when w is None) with the kernel's rstd; rstd
    within 4 ulp of the FP64 value. `out_row` / `out_col`: (payload, scales, blocked) triples."""
    ok = True
    if w is None:
        y = x.float()
    else:
        rstd64 = torch.rsqrt(x.double().square().mean(-1) + EPS)
        ok = bool(((rstd.double() - rstd64).abs() <= 4 * torch.finfo(torch.float32).eps * rstd64).all())
        del rstd64
        y = x.float() * rstd[:, None] * w.float()
    for (data, scale, blocked), t in ((out_row, y), (out_col, y.t())):
        want = quantize_reference(t, axis=1, allow_partial=True)
        ok &= torch.equal(data.view(torch.uint8), want.data.view(torch.uint8))
        ok &= torch.equal(scale, to_blocked(want.scale) if blocked else want.scale)
        del want
    return bool(ok)


def tag(ok: bool) -> str:
    return " [exact]" if ok else " [BYTES DIFFER]"


def copy_row(bench: Bench, group: str, nbytes: int) -> None:
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    bench.time(group, "copy (same bytes)", lambda: dst.copy_(src), nbytes=2 * src.numel(), peer=True)


def norm_group(bench: Bench, M: int, K: int, candidates: bool) -> None:
    from gem_lp.mx.kernels.cute_cast_config import NormLaunch, launch_for
    from gem_lp.mx.kernels.cute_cast_launch import norm_mx_cast
    from gem_lp.runtime.device import build_arch

    group = f"norm {M}x{K}"
    g = torch.Generator(device=DEV).manual_seed(M + K)
    x = torch.randn(M, K, device=DEV, generator=g).bfloat16()
    w = (torch.rand(K, device=DEV, generator=g) + 0.5).bfloat16()
    default = launch_for(build_arch(x.device), K)
    launches = [default] + ([NormLaunch(*c) for c in LAUNCH_CANDIDATES.get(K, ()) if NormLaunch(*c) != default]
                            if candidates else [])
    out = norm_mx_cast(x, w, EPS)
    nbytes = moved_bytes(x, (out.row_data, out.row_scale, out.col_data, out.col_scale, out.rstd))
    copy_row(bench, group, nbytes)
    for launch in launches:
        out = norm_mx_cast(x, w, EPS, launch=launch)
        ok = exact((out.row_data, out.row_scale, True), (out.col_data, out.col_scale, True), out.rstd, x, w)
        name = f"ours cute tile_k={launch.tile_k} cluster={launch.cluster_n}" + (" (table)" if launch == default else "")
        bench.time(group, name + tag(ok), lambda launch=launch: norm_mx_cast(x, w, EPS, launch=launch), nbytes=nbytes,
                   exact=ok)
    for layout in ("plain", "blocked"):
        def op(layout=layout):
            return rms_norm_quantize(x, w, EPS, scale_layout=layout, backend="cute")

        q, blocked = op(), layout == "blocked"
        ok = exact((q.rowwise.data, q.rowwise.scale, blocked), (q.colwise.data, q.colwise.scale, blocked), q.rstd,
                   x, w)
        host = host_us_per_call(op)
        print(f"  [{group}] public op ({layout} scales) host time: {host:.1f} us per call", flush=True)
        bench.time(group, f"ours public op rms_norm_quantize(cute, {layout} scales)" + tag(ok), op, nbytes=nbytes,
                   exact=ok, host_us_per_call=host)
    try:
        q = rms_norm_quantize(x, w, EPS, backend="triton")
        ok = exact((q.rowwise.data, q.rowwise.scale, False), (q.colwise.data, q.colwise.scale, False), q.rstd, x, w)
        bench.time(group, "triton rms_norm_quantize" + tag(ok), lambda: rms_norm_quantize(x, w, EPS, backend="triton"),
                   nbytes=nbytes, exact=ok, peer=True)
    except Exception as e:  # one failing peer must not hide the others
        print(f"  [{group}] triton: FAILED {type(e).__name__}: {e}", flush=True)
    compiled = torch.compile(lambda t: rms_norm_quantize_reference(t, w, EPS, "rceil"), dynamic=False)
    bench.time(group, "torch.compile(reference RMSNorm + both casts)", lambda: compiled(x), nbytes=nbytes, peer=True)
    try:
        from quack.rmsnorm import rmsnorm_fwd

        bench.time(group, "quack rmsnorm_fwd bf16 (norm only)", lambda: rmsnorm_fwd(x, w, eps=EPS),
                   nbytes=2 * x.numel() * x.element_size(), peer=True)
    except Exception as e:
        print(f"  [{group}] quack: FAILED {type(e).__name__}: {e}", flush=True)
    del x, out, q
    torch.cuda.empty_cache()


def dual_group(bench: Bench, M: int, K: int) -> None:
    group = f"dual {M}x{K}"
    g = torch.Generator(device=DEV).manual_seed(M * K)
    x = torch.randn(M, K, device=DEV, generator=g).bfloat16()
    row, col = quantize_dual(x, backend="cute")
    nbytes = moved_bytes(x, (row.data, row.scale, col.data, col.scale))
    copy_row(bench, group, nbytes)
    ok = exact((row.data, row.scale, True), (col.data, col.scale, True), None, x, None)
    bench.time(group, "ours quantize_dual(cute)" + tag(ok), lambda: quantize_dual(x, backend="cute"), nbytes=nbytes, exact=ok)
    row, col = quantize_dual(x, backend="triton")
    ok = exact((row.data, row.scale, True), (col.data, col.scale, True), None, x, None)
    bench.time(group, "triton quantize_dual" + tag(ok), lambda: quantize_dual(x, backend="triton"), nbytes=nbytes, exact=ok,
               peer=True)
    del x, row, col
    torch.cuda.empty_cache()


# what each call site of the MX linears asks `operands.casts` for (`benchmarks.bench_norm --casts`)
CAST_CALLS = {
    "forward operand + colwise, norm": dict(norm=True, rowwise=False, colwise=True, row_operand=True),
    "forward operand + colwise": dict(norm=False, rowwise=False, colwise=True, row_operand=True),
    "SiLU forward operand": dict(norm=False, rowwise=False, colwise=False, row_operand=True, activation="silu"),
    "dY operands + column sums": dict(norm=False, rowwise=False, colwise=False, row_operand=True, col_operand=True,
                                      column_sums=True),
}


def _cast_tensors(out) -> list:
    """Every tensor a `casts` call wrote (None where not asked for), in a fixed order."""
    mx = [t for m in (out.rowwise, out.colwise) for t in ((None, None) if m is None else (m.data, m.scale))]
    return [out.row_operand, out.col_operand, out.rstd, *mx]


def _same_bytes(a, b) -> bool:
    if (a is None) != (b is None):
        return False
    return a is None or (a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                            b.contiguous().view(torch.uint8)))


def casts_group(bench: Bench, M: int, K: int) -> None:
    from gem_lp.linear import operands as lo
    from gem_lp.linear.gemm import gemm_rows
    from gem_lp.mx.kernels import cute_cast_config
    from gem_lp.runtime.device import build_arch

    group = f"casts {M}x{K}"
    g = torch.Generator(device=DEV).manual_seed(M + 3 * K)
    x = torch.randn(M, K, device=DEV, generator=g).bfloat16()
    w = (torch.rand(K, device=DEV, generator=g) + 0.5).bfloat16()
    rows = gemm_rows(M)
    arch = build_arch(x.device)
    saved = cute_cast_config.LINEAR_CASTS_FROM_K

    def use_cute(on: bool) -> None:  # every cast the CuTe kernel can take, or none
        cute_cast_config.LINEAR_CASTS_FROM_K = {**saved, arch: (0, 0) if on else (None, None)}

    try:
        for call, opts in CAST_CALLS.items():
            opts = dict(opts)
            weight = w if opts.pop("norm") else None

            def run(opts=opts, weight=weight):
                return lo.casts(x, weight, EPS, scaling="rceil", operand_rows=rows, **opts)

            outs = {}
            for on in (True, False):
                use_cute(on)
                if lo._cute_cast(x, weight) != on:
                    raise RuntimeError(f"the CuTe cast kernel {'cannot' if on else 'must not'} take {call} here "
                                       "(the dispatch table's rms_norm_quantize choice on this GPU)")
                outs[on] = run()
            # rstd and the normalized casts may differ in last bits (the kernels sum squares in other orders);
            # column sums are atomic adds in any order: neither is compared
            same = all(_same_bytes(a, b) for a, b in zip(_cast_tensors(outs[True]), _cast_tensors(outs[False]))) \
                if weight is None else None
            nbytes = moved_bytes(x, [*_cast_tensors(outs[True]), outs[True].column_sums])
            for on, name in ((True, "ours cute"), (False, "triton")):
                use_cute(on)
                label = f"{call}: {name}" + ("" if same is None or not on else tag(same))
                bench.time(group, label, run, nbytes=nbytes, same=same, peer=not on)
    finally:
        cute_cast_config.LINEAR_CASTS_FROM_K = saved
    del x
    torch.cuda.empty_cache()


# (block_m, num_warps) of the Triton norm backward timed beside its launch table's
BACKWARD_CANDIDATES = ((16, 4), (16, 8), (32, 4), (32, 8), (64, 8), (64, 16))


def backward_group(bench: Bench, M: int, K: int, candidates: bool) -> None:
    """The RMSNorm backward as the MX linears run it (dY of the normalized x in FP32, from the GEMM that makes it):
    ours (Triton, `rms_norm_backward`) at its table's launch and the candidates, and on the CuTe kernel (quack's kernel
    built by `gem_lp.norm.kernels.cute_backward`, which the MX linears take where the dispatch table says), beside
    quack's `rmsnorm_bwd` on the same FP32 dY and on BF16 dY (what the BF16 model's norm sees), and a copy of the same
    bytes. dx checked against the FP64 formula (largest error over the largest |dx|, `dx_rel_err` in the JSON; BF16
    rounding alone: ~2^-9)."""
    from gem_lp.norm.kernels.triton_backward import rms_norm_backward

    group = f"norm backward {M}x{K}"
    g = torch.Generator(device=DEV).manual_seed(M + 5 * K)
    x = torch.randn(M, K, device=DEV, generator=g).bfloat16()
    w = torch.rand(K, device=DEV, generator=g) + 0.5  # the modules keep the norm weight in FP32
    dy = torch.randn(M, K, device=DEV, generator=g)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + EPS)
    xhat = x.double() * rstd.double()[:, None]
    dxhat = dy.double() * w.double()
    want = rstd.double()[:, None] * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))

    def rel_err(dx: torch.Tensor) -> float:
        return float((dx.double() - want).abs().max() / want.abs().max())

    nbytes = x.numel() * (x.element_size() + dy.element_size() + x.element_size())
    copy_row(bench, group, nbytes)
    runs = [("ours triton (table)", {})]
    if candidates:
        runs += [(f"ours triton block_m={bm} warps={nw}", dict(block_m=bm, num_warps=nw))
                 for bm, nw in BACKWARD_CANDIDATES]
    for name, kw in runs:
        dx, _ = rms_norm_backward(x, w, rstd, dy, **kw)
        err = rel_err(dx)
        bench.time(group, name, lambda kw=kw: rms_norm_backward(x, w, rstd, dy, **kw), nbytes=nbytes, dx_rel_err=err)
    try:
        from gem_lp.norm.kernels.cute_backward import rms_norm_backward_cute

        dx, _ = rms_norm_backward_cute(x, w, rstd, dy)
        bench.time(group, "ours cute (quack's kernel, one build per K)", lambda: rms_norm_backward_cute(x, w, rstd, dy),
                   nbytes=nbytes, dx_rel_err=rel_err(dx))
    except Exception as e:
        print(f"  [{group}] ours cute: FAILED {type(e).__name__}: {e}", flush=True)
    try:
        from quack.rmsnorm import rmsnorm_bwd

        for label, d in (("FP32 dy", dy), ("BF16 dy", dy.bfloat16())):
            dx = rmsnorm_bwd(x, w, d, rstd)[0]
            err = rel_err(dx) if d is dy else None
            bench.time(group, f"quack rmsnorm_bwd, {label}", lambda d=d: rmsnorm_bwd(x, w, d, rstd), peer=True,
                       nbytes=x.numel() * (2 * x.element_size() + d.element_size()), dx_rel_err=err)
    except Exception as e:  # one failing peer must not hide the others
        print(f"  [{group}] quack: FAILED {type(e).__name__}: {e}", flush=True)
    del x, dy, want, xhat, dxhat
    torch.cuda.empty_cache()


def _ints(text: str, what: str, ap: argparse.ArgumentParser) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        ap.error(f"{what} must be comma-separated integers, got {text!r}")
    if not values or any(v <= 0 for v in values):
        ap.error(f"{what} must list positive integers, got {text!r}")
    return values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", default=None, help="token counts M, comma-separated (default: "
                    + ",".join(map(str, MS)) + " and the GPU trainer's first batch)")
    ap.add_argument("--ks", default=",".join(map(str, KS)), help="row widths K (multiples of 32), comma-separated")
    ap.add_argument("--no-candidates", action="store_true", help="time only the launch table's launch")
    ap.add_argument("--no-dual", action="store_true", help="skip the dual cast groups")
    ap.add_argument("--casts", action="store_true", help="also the MX linears' casts, CuTe against Triton")
    ap.add_argument("--backward", action="store_true", help="also the norm backward, ours against quack's")
    ap.add_argument("--only", choices=("casts", "backward"), help="only these groups (no norm or dual groups)")
    ap.add_argument("--cuda-graphs", action="store_true", help="time every row by replaying a CUDA graph (GPU time "
                    "without the host's launch work, as the trainer's captured sequence part runs)")
    ap.add_argument("--dry-run", action="store_true", help="print the shapes and exit (no GPU needed)")
    args = ap.parse_args()
    ms = default_ms() if args.ms is None else _ints(args.ms, "--ms", ap)
    ks = _ints(args.ks, "--ks", ap)
    if any(k % 32 for k in ks):
        ap.error(f"--ks must be multiples of 32, got {ks}")
    if args.dry_run:
        print(f"M: {list(ms)}; K: {ks}")
        return
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    bench = Bench("bench_norm", cuda_graphs=args.cuda_graphs)
    bench.copy_bandwidth()
    for K in ks:
        for M in ms:
            groups = []
            if args.only is None:
                groups.append(("norm", lambda: norm_group(bench, M, K, candidates=not args.no_candidates)))
                if not args.no_dual:
                    groups.append(("dual", lambda: dual_group(bench, M, K)))
            if args.casts or args.only == "casts":
                groups.append(("casts", lambda: casts_group(bench, M, K)))
            if args.backward or args.only == "backward":
                groups.append(("backward", lambda: backward_group(bench, M, K, candidates=not args.no_candidates)))
            for what, run in groups:
                try:
                    run()
                except Exception as e:  # a failing group is recorded; the others still run
                    print(f"  [{what} {M}x{K}] FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    traceback.print_exc(limit=3)
                    bench.rows.append(dict(group=f"{what} {M}x{K}", name="(group)", error=f"{type(e).__name__}: {e}"))
                    torch.cuda.empty_cache()
    bench.finish()


if __name__ == "__main__":
    main()
