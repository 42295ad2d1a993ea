"""Self-checks of the attention kernels (run by `gem_lp.runtime.selfcheck`): forward and backward against the
reference at the same precision on a batch of odd lengths (an empty sequence, 1, 31, 33, 127-129, 300) with an
outlier channel, self-attention causal or not, target attention and shared (broadcast) queries, twice; with `timed`,
the trainer's batch (1024 sequences, lognormal mean 256, H2, D128) beside FA4's BF16 kernels."""
from __future__ import annotations

import math

import torch

from gem_lp.runtime.measure import Agreement, bench_ms, repeats, speed_line

LENGTHS = (0, 1, 31, 33, 127, 128, 129, 300)


def _offsets(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64, device=device)


def _cases(device, dim):
    """(name, q, k, v, q_offsets, kv_offsets, broadcast_q, causal)."""
    g = torch.Generator().manual_seed(dim)
    t = sum(LENGTHS)

    def rand(rows):
        x = torch.randn(rows, 2, dim, generator=g)
        x[..., 3] *= 20.0  # an outlier channel
        return x.to(device)

    kv = _offsets(LENGTHS, device)
    yield "self", rand(t), rand(t), rand(t), kv, None, False, False
    yield "self causal", rand(t), rand(t), rand(t), kv, None, False, True
    yield "target", rand(len(LENGTHS)), rand(t), rand(t), _offsets([1] * len(LENGTHS), device), kv, False, False
    yield "broadcast", rand(4), rand(t), rand(t), None, kv, True, False


def _run(q, k, v, q_offs, kv_offs, broadcast_q, causal, dy, **kw):
    from gem_lp.attention.interface import jagged_attention

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = jagged_attention(*leaves, q_offs, kv_offs, broadcast_q=broadcast_q, causal=causal, **kw)
    return (o, *torch.autograd.grad(o, leaves, dy))


def _check(device: torch.device, precision: str, dims, p_quants, floor: float) -> dict:
    worst, cases, repeat_ok = Agreement(), 0, True
    for dim in dims:
        for name, q, k, v, q_offs, kv_offs, bq, causal in _cases(device, dim):
            for p_quant in p_quants:
                cases += 1
                q_, k_, v_ = (x.bfloat16() for x in (q, k, v))
                rows = kv_offs.numel() - 1 if bq else q.shape[0]
                dy = torch.randn(rows * (q.shape[0] if bq else 1), 2, dim, generator=torch.Generator().manual_seed(
                    cases)).to(device).bfloat16()
                kw = dict(precision=precision, p_quant=p_quant)
                got = [_run(q_, k_, v_, q_offs, kv_offs, bq, causal, dy, backend="cute", **kw) for _ in range(2)]
                # O, dK, dV bit for bit; dQ is summed over key tiles by atomic adds (FA4's accumulator)
                repeat_ok &= repeats(*got, exact={0, 2, 3})
                want = _run(q_, k_, v_, q_offs, kv_offs, bq, causal, dy, backend="reference", **kw)
                worst.add((f"D{dim} {name} {p_quant} {t}", a, b)
                          for t, a, b in zip(("O", "dQ", "dK", "dV"), got[0], want))
    return worst.verdict(cases, floor, repeat_ok, f"the {precision} reference")


def _trainer_batch(device):
    g = torch.Generator().manual_seed(0)
    lengths = torch.exp(torch.randn(1024, generator=g) * 0.8 + math.log(256) - 0.32).round().clamp(1, 2048).long()
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(device)
    t = int(lengths.sum())
    q, k, v = (torch.randn(t, 2, 128, dtype=torch.bfloat16, device=device, requires_grad=True) for _ in range(3))
    return q, k, v, offsets, int(lengths.max())


def _speed(device, precision: str) -> str:
    from gem_lp.attention.interface import jagged_attention

    q, k, v, offsets, longest = _trainer_batch(device)
    dy = torch.randn_like(q)

    def step(p):
        o = jagged_attention(q, k, v, offsets, precision=p, backend="cute", max_seqlen_q=longest,
                             max_seqlen_k=longest)
        torch.autograd.grad(o, (q, k, v), dy)

    return speed_line(bench_ms(lambda: step(precision)), bench_ms(lambda: step("bf16")), "FA4 bf16",
                      "fwd+bwd, trainer batch")


def fa4(device: torch.device, timed: bool = False) -> dict:
    out = _check(device, "bf16", (64, 128), ("const_p",), floor=35.0)
    if timed:
        out["speed"] = _speed(device, "bf16")
    return out


def _mxfp8(device: torch.device, timed: bool) -> dict:
    # the kernels round the reference's values: agreement to FP32 summation order (docs/numerics.md)
    out = _check(device, "mxfp8", (64, 128), ("const_p", "dynamic"), floor=35.0)
    if timed:
        out["speed"] = _speed(device, "mxfp8")
    return out


def mxfp8_sm90(device: torch.device, timed: bool = False) -> dict:
    return _mxfp8(device, timed)


def mxfp8_sm100(device: torch.device, timed: bool = False) -> dict:
    return _mxfp8(device, timed)
