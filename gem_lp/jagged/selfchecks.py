"""Self-check of the jagged MX cast kernel (run by `gem_lp.runtime.selfcheck`): every payload and scale byte of
every orientation against the reference on odd lengths with special values, twice."""
from __future__ import annotations

import torch

from gem_lp.mx.selfchecks import special_values
from gem_lp.runtime.measure import bench_ms, case_verdict, copy_ms, same_bytes, speed_line

LENGTHS = (0, 1, 31, 32, 33, 127, 128, 129, 255, 300)


def quantize_jagged(device: torch.device, timed: bool = False) -> dict:
    from gem_lp.jagged.ops import quantize_jagged as qj

    failures, cases = [], 0
    for heads, dim in ((1, 64), (2, 128)):
        cases += 1
        offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int64)
        g = torch.Generator().manual_seed(dim)
        x = special_values(torch.randn(int(offsets[-1]), heads, dim, generator=g)).to(torch.bfloat16)
        want = qj(x, offsets, ("hdim", "seq", "square"), backend="reference")
        for _ in range(2):
            got = qj(x.to(device), offsets.to(device), ("hdim", "seq", "square"), backend="triton")
            parts = ("payload_hdim", "payload_seq", "payload_square", "scale_hdim", "scale_seq", "scale_square_hdim",
                     "scale_square_seq")
            bad = [p for p in parts if not same_bytes(getattr(got, p), getattr(want, p))]
            if bad:
                failures.append(f"H{heads} D{dim}: {', '.join(bad)}")
                break
    out = case_verdict(failures, cases, f"{cases} batches of odd lengths, every byte of hdim, seq and square equal "
                                        "to the reference, repeatable")
    if timed:
        lengths = torch.full((32,), 1024)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(device)
        x = torch.randn(int(lengths.sum()), 16, 128, dtype=torch.bfloat16, device=device)
        from gem_lp.jagged.metadata import JaggedLayout

        layout = JaggedLayout.from_offsets(offsets, x)  # built once per batch (one host sync), as the ops reuse it
        ours = bench_ms(lambda: qj(x, layout, ("hdim", "seq"), backend="triton"))
        moved = x.numel() * 2 + 2 * x.numel() * 33 // 32
        out["speed"] = speed_line(ours, copy_ms(moved, device), "copy", "hdim + seq of 32x1024 tokens H16 D128")
    return out
