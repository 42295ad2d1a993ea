"""Helpers of the self-checks: kernel time beside a peer's, and agreement with the reference."""
from __future__ import annotations

import torch

from gem_lp.accuracy import sqnr_db


def bench_ms(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median time of `fn()` in ms (CUDA events, `triton.testing.do_bench`)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def copy_ms(nbytes: int, device: torch.device) -> float:
    """A device-to-device copy moving `nbytes` in all (half read, half written): what a memory-bound pass that reads
    and writes `nbytes` in all compares to."""
    src = torch.empty(max(nbytes // 4, 1), dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    return bench_ms(lambda: dst.copy_(src))


def case_verdict(failures: list[str], cases: int, passed_summary: str) -> dict:
    """The verdict of a check over `cases` cases: failed with the first three `failures`, else `passed_summary`."""
    if failures:
        return {"passed": False, "summary": f"{len(failures)} of {cases} cases off the reference: "
                                            + "; ".join(failures[:3])}
    return {"passed": True, "summary": passed_summary}


def speed_line(ours_ms: float, peer_ms: float, peer: str, work: str) -> str:
    return f"{work}: ours {ours_ms:.3f} ms, {peer} {peer_ms:.3f} ms, {peer_ms / ours_ms:.2f}x"


class Agreement:
    """The worst agreement with the reference over a check's outputs: the lowest SQNR (dB), the output it belongs to
    and that output's largest absolute error."""

    def __init__(self):
        self.db, self.name, self.max_err = float("inf"), "", 0.0

    def add(self, pairs) -> None:
        """Take `(name, got, want)` triples into account."""
        for name, got, want in pairs:
            got, want = got.detach().float(), want.detach().float()
            s = sqnr_db(got, want)
            if s < self.db:
                d = (got - want).abs()
                d = d[torch.isfinite(d)]
                self.db, self.name, self.max_err = s, name, float(d.max()) if d.numel() else 0.0

    def verdict(self, cases: int, floor: float, repeat_ok: bool, against: str) -> dict:
        """Passed when the worst SQNR reaches `floor` and two runs agreed (`repeats`)."""
        return {"passed": self.db >= floor and repeat_ok,
                "summary": f"{cases} cases, {self.db:.1f} dB worst against {against} ({self.name}, max error "
                           f"{self.max_err:.3g}; floor {floor:.0f} dB), "
                           + ("repeatable" if repeat_ok else "NOT repeatable"),
                "sqnr_db": self.db, "max_abs_err": self.max_err}


def repeats(first, second, exact, close_db: float = 90.0) -> bool:
    """Two runs agree: bit for bit on the tensors named in `exact` (indices), and to within FP32 summation order on
    the others (at least `close_db` dB), which atomic adds (dQ's accumulator, column sums) may order differently."""
    return all(torch.equal(a, b) if i in exact else sqnr_db(a.float(), b.float()) >= close_db
               for i, (a, b) in enumerate(zip(first, second)))


def same_bytes(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bytes (payloads, scales), NaN patterns included."""
    g = got.contiguous().view(torch.uint8) if got.dtype.itemsize == 1 else got.contiguous()
    w = want.contiguous().view(torch.uint8) if want.dtype.itemsize == 1 else want.contiguous()
    return g.shape == w.shape and bool(torch.equal(g.cpu(), w.cpu()))
