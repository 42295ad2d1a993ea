"""Self-checks of the RMSNorm kernels (run by `gem_lp.runtime.selfcheck`) against the reference on odd token
counts with large and tiny rows, twice; with `timed`, beside torch's kernels."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gem_lp.mx.selfchecks import COLS as CAST_COLS, ROWS as CAST_ROWS, _inputs as _cast_inputs
from gem_lp.runtime.measure import Agreement, bench_ms, case_verdict, copy_ms, same_bytes, speed_line

ROWS = (1, 31, 33, 129, 300)
COLS = (256, 1024)


def _inputs(device, rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-8, 9, (rows, 1), generator=g).float())
    w = torch.rand(cols, generator=g) + 0.5
    dy = torch.randn(rows, cols, generator=g)
    return x.to(device), w.to(device), dy.to(device)


def rms_norm_cute(device: torch.device, timed: bool = False) -> dict:
    """The BF16 recipe's norm (quack's forward and backward) against torch's `F.rms_norm` in FP32."""
    from gem_lp.norm.kernels.cute_forward import RMSNormCute

    worst, cases, repeat_ok = Agreement(), 0, True
    for i, rows in enumerate(ROWS):
        for cols in COLS:
            cases += 1
            x, w, dy = _inputs(device, rows, cols, 3 * i + cols)
            xb, wb = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
            outs = []
            for _ in range(2):
                y = RMSNormCute.apply(xb, wb, 1e-6)
                outs.append((y, *torch.autograd.grad(y, (xb, wb), dy.bfloat16())))
            repeat_ok &= all(torch.equal(a, b) for a, b in zip(*outs))
            x32, w32 = x.clone().requires_grad_(), w.clone().requires_grad_()
            y32 = F.rms_norm(x32, (cols,), w32, 1e-6)
            ref = (y32, *torch.autograd.grad(y32, (x32, w32), dy))
            worst.add(zip(("y", "dx", "dw"), outs[0], ref))
    out = worst.verdict(cases, 40.0, repeat_ok, "FP32 (BF16 y, dx, dw)")
    if timed:
        x = torch.randn(32767, 1024, dtype=torch.bfloat16, device=device)
        w = torch.ones(1024, dtype=torch.bfloat16, device=device)
        ours = bench_ms(lambda: RMSNormCute.apply(x, w, 1e-6))
        out["speed"] = speed_line(ours, bench_ms(lambda: F.rms_norm(x, (1024,), w, 1e-6)), "torch F.rms_norm",
                                  "forward 32767x1024 bf16")
    return out


def _backward(device: torch.device, impl: str, timed: bool) -> dict:
    from gem_lp.mx.reference import rms_norm_fp32
    from gem_lp.norm.kernels import rms_norm_backward
    from gem_lp.norm.reference import rms_norm_backward_reference

    worst, cases, repeat_ok = Agreement(), 0, True
    for i, rows in enumerate(ROWS):
        for cols in COLS:
            cases += 1
            x, w, dy = _inputs(device, rows, cols, 5 * i + cols)
            x = x.bfloat16()
            _, rstd = rms_norm_fp32(x, w, 1e-6)
            got = [rms_norm_backward(x, w, rstd, dy, impl) for _ in range(2)]
            repeat_ok &= all(torch.equal(a, b) for a, b in zip(*got))
            want = rms_norm_backward_reference(x, w, rstd, dy)
            worst.add(zip(("dx", "dw"), got[0], want))
    out = worst.verdict(cases, 40.0, repeat_ok, "the FP32 reference (dx in x's dtype, dw FP32)")
    if timed:
        x = torch.randn(32767, 1024, dtype=torch.bfloat16, device=device)
        w, dy = torch.ones(1024, device=device), torch.randn(32767, 1024, dtype=torch.bfloat16, device=device)
        rstd = torch.ones(32767, device=device)
        ours = bench_ms(lambda: rms_norm_backward(x, w, rstd, dy, impl))
        peer = bench_ms(lambda: rms_norm_backward_reference(x, w, rstd, dy))
        out["speed"] = speed_line(ours, peer, "torch ops", "backward 32767x1024")
    return out


def backward_cute(device: torch.device, timed: bool = False) -> dict:
    return _backward(device, "cute", timed)


def backward_triton(device: torch.device, timed: bool = False) -> dict:
    return _backward(device, "triton", timed)


def _norm_cast(device: torch.device, backend: str, timed: bool) -> dict:
    from gem_lp.accuracy import sqnr_db
    from gem_lp.mx.reference import dequantize
    from gem_lp.norm.ops import rms_norm_quantize
    from gem_lp.norm.reference import rms_norm_quantize_reference

    failures, cases, worst = [], 0, float("inf")
    for i, rows in enumerate(CAST_ROWS):
        for cols in CAST_COLS:
            cases += 1
            x = _cast_inputs(device, rows, cols, torch.bfloat16, 17 * i + cols)
            x[x.isnan() | x.isinf()] = 1.0  # RMSNorm of a row holding NaN is NaN: the other corners stay
            w = (torch.rand(cols, generator=torch.Generator().manual_seed(i)) + 0.5).to(device)
            want = rms_norm_quantize_reference(x.cpu(), w.cpu(), 1e-6, "rceil")
            first = None
            for _ in range(2):
                got = rms_norm_quantize(x, w, 1e-6, backend=backend)
                # rstd may differ from torch's in its last bit (summation order), which can move a payload byte
                # across a rounding boundary: values to within that, scales byte for byte almost everywhere
                s = min(sqnr_db(dequantize(got.rowwise).cpu(), dequantize(want.rowwise)),
                        sqnr_db(dequantize(got.colwise).cpu().contiguous(), dequantize(want.colwise)))
                scale_agree = float((got.rowwise.scale.cpu() == want.rowwise.scale).float().mean())
                worst = min(worst, s)
                if s < 45 or scale_agree < 0.99:
                    failures.append(f"{rows}x{cols}: {s:.1f} dB, scales {scale_agree:.3f}")
                    break
                if first is None:
                    first = got
                elif not (same_bytes(got.rowwise.data, first.rowwise.data)
                          and same_bytes(got.colwise.data, first.colwise.data)):
                    failures.append(f"{rows}x{cols}: not repeatable")
    out = case_verdict(failures, cases, f"{cases} cases, {worst:.1f} dB worst against the reference, repeatable")
    if timed:
        x = torch.randn(32767, 1024, dtype=torch.bfloat16, device=device)
        w = torch.ones(1024, device=device)
        ours = bench_ms(lambda: rms_norm_quantize(x, w, backend=backend))
        moved = x.numel() * 2 + 2 * (x.numel() + x.numel() // 32)
        out["speed"] = speed_line(ours, copy_ms(moved, device), "copy", "RMSNorm + both casts 32767x1024")
    return out


def norm_cast_cute(device: torch.device, timed: bool = False) -> dict:
    return _norm_cast(device, "cute", timed)


def norm_cast_triton(device: torch.device, timed: bool = False) -> dict:
    return _norm_cast(device, "triton", timed)
