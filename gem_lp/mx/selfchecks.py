"""Self-checks of the MX cast kernels (run by `gem_lp.runtime.selfcheck`): every byte against the reference on odd
shapes with special values, twice; with `timed`, the kernel beside a device copy of the same bytes."""
from __future__ import annotations

import torch

from gem_lp.mx.layout import to_blocked
from gem_lp.mx.reference import quantize_reference
from gem_lp.runtime.measure import bench_ms, case_verdict, copy_ms, same_bytes, speed_line

# token counts around the 32-row blocks and 128-row scale tiles; feature widths the kernels tile differently
ROWS = (1, 31, 33, 127, 129, 300)
COLS = (32, 96, 256, 1024)


def special_values(x: torch.Tensor) -> torch.Tensor:
    """`x` with blocks holding NaN, +-inf, zeros, FP32 subnormals, a max of 480 and FP32's largest finite: the
    corners of the scale rule (docs/numerics.md)."""
    x = x.clone()
    flat = x.view(-1)
    specials = [float("nan"), float("inf"), -float("inf"), 0.0, 2.0**-130, 480.0, 3.0e38]
    for i, v in enumerate(specials):
        j = 32 * (3 * i + 1) + 5
        if j < flat.numel():
            flat[j] = v
    return x


def _inputs(device, rows, cols, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-6, 7, (rows, 1), generator=g).float())
    return special_values(x).to(dtype).to(device)


def _verdict(failures: list[str], cases: int, what: str) -> dict:
    return case_verdict(failures, cases, f"{cases} cases, every byte equal to the reference ({what}), repeatable")


def quantize(device: torch.device, timed: bool = False) -> dict:
    from gem_lp.mx.ops import quantize as mx_quantize

    failures, cases = [], 0
    for i, rows in enumerate((32, 64, 96, 160)):
        for cols in COLS[:3]:
            x = _inputs(device, rows, cols, torch.bfloat16, i * 7 + cols)
            for kw in (dict(axis=-1), dict(axis=0), dict(block="square")):
                cases += 1
                want = quantize_reference(x.cpu(), **kw)
                runs = [mx_quantize(x, backend="triton", **kw) for _ in range(2)]
                for got in runs:
                    if not (same_bytes(got.data, want.data) and same_bytes(got.scale, want.scale)):
                        failures.append(f"{rows}x{cols} {kw}")
                        break
    out = _verdict(failures, cases, "1x32 along each axis, 32x32")
    if timed:
        x = torch.randn(32768, 1024, dtype=torch.bfloat16, device=device)
        ours = bench_ms(lambda: mx_quantize(x, backend="triton"))
        out["speed"] = speed_line(ours, copy_ms(x.numel() * 2 + x.numel() * 33 // 32, device), "copy",
                                  "rowwise cast 32768x1024")
    return out


def _dual(device: torch.device, backend: str, timed: bool) -> dict:
    from gem_lp.mx.ops import quantize_dual

    failures, cases = [], 0
    for i, rows in enumerate(ROWS):
        for cols in COLS:
            cases += 1
            x = _inputs(device, rows, cols, torch.bfloat16, 31 * i + cols)
            row_ref = quantize_reference(x.cpu(), axis=1)
            col_ref = quantize_reference(x.cpu().t(), axis=1, allow_partial=True)
            for _ in range(2):
                row, col = quantize_dual(x, backend=backend)
                ok = (same_bytes(row.data, row_ref.data) and same_bytes(row.scale, to_blocked(row_ref.scale))
                      and same_bytes(col.data, col_ref.data) and same_bytes(col.scale, to_blocked(col_ref.scale)))
                if not ok:
                    failures.append(f"{rows}x{cols}")
                    break
    out = _verdict(failures, cases, "rowwise and colwise, blocked scales")
    if timed:
        x = torch.randn(32767, 1024, dtype=torch.bfloat16, device=device)
        ours = bench_ms(lambda: quantize_dual(x, backend=backend))
        moved = x.numel() * 2 + 2 * (x.numel() + x.numel() // 32)
        out["speed"] = speed_line(ours, copy_ms(moved, device), "copy", "dual cast 32767x1024")
    return out


def quantize_dual_cute(device: torch.device, timed: bool = False) -> dict:
    return _dual(device, "cute", timed)


def quantize_dual_triton(device: torch.device, timed: bool = False) -> dict:
    return _dual(device, "triton", timed)
