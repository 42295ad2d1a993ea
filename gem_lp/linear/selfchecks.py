"""Self-checks of the MX linears' GPU routes (run by `gem_lp.runtime.selfcheck`): forward and backward of
`mx_linear` / `rms_norm_mx_linear` / the MLP op against the reference recipe on odd token counts with an outlier
row, twice; with `timed`, beside `nn.Linear` in BF16 (cuBLAS)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gem_lp.runtime.measure import Agreement, bench_ms, repeats, speed_line

TOKENS = (1, 33, 129, 1000)


def _grads(fn, tensors, dy):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    y = fn(*leaves)
    return (y, *torch.autograd.grad(y, leaves, dy))


def _route(device: torch.device, route: str, timed: bool) -> dict:
    from gem_lp.linear.functions import MXLinearFunction, RMSNormMXLinearFunction, RMSNormMXMLPFunction
    from gem_lp.linear.reference import MXLinearReference, RMSNormMXLinearReference
    from gem_lp.mx.reference import INPUT_ACTIVATIONS

    K, N, H = 256, 96, 128
    worst, cases, repeat_ok = Agreement(), 0, True
    for i, M in enumerate(TOKENS):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(M, K, generator=g)
        x[0] *= 1e3  # an outlier token
        x = x.to(device)
        gw = (torch.rand(K, generator=g) + 0.5).to(device)
        w, b = (torch.randn(N, K, generator=g) / K**0.5).to(device), torch.randn(N, generator=g).to(device)
        w_up, b_up = (torch.randn(H, K, generator=g) / K**0.5).to(device), torch.randn(H, generator=g).to(device)
        w_dn, b_dn = (torch.randn(N, H, generator=g) / H**0.5).to(device), torch.randn(N, generator=g).to(device)
        dy = torch.randn(M, N, generator=g).to(device)
        for dtype in (torch.float32, torch.bfloat16):
            xd, dyd = x.to(dtype), dy.to(dtype)
            calls = (
                ("linear", lambda *a: MXLinearFunction.apply(*a, "rceil", route, None),
                 lambda *a: MXLinearReference.apply(*a, "rceil"), (xd, w, b)),
                ("norm linear", lambda *a: RMSNormMXLinearFunction.apply(*a, 1e-6, "rceil", route),
                 lambda *a: RMSNormMXLinearReference.apply(*a, 1e-6, "rceil"), (xd, gw, w, b)),
                ("mlp", lambda x_, g_, wu, bu, wd, bd: RMSNormMXMLPFunction.apply(
                    x_, g_, wu, bu, wd, bd, 1e-6, "rceil", route, "silu"),
                 lambda x_, g_, wu, bu, wd, bd: MXLinearReference.apply(INPUT_ACTIVATIONS["silu"](
                     RMSNormMXLinearReference.apply(x_, g_, wu, bu, 1e-6, "rceil")), wd, bd, "rceil"),
                 (xd, gw, w_up, b_up, w_dn, b_dn)),
            )
            for name, ours, ref, ins in calls:
                cases += 1
                got = [_grads(ours, ins, dyd) for _ in range(2)]
                # the bias gradients are the dY casts' column sums, added atomically (in varying order)
                biases = {i + 1 for i, t in enumerate(ins) if t.dim() == 1 and t.shape[0] in (N, H)
                          and t is not gw}
                repeat_ok &= repeats(*got, exact=set(range(len(got[0]))) - biases)
                want = _grads(ref, ins, dyd)
                worst.add((f"{name} {dtype} {k}", a, c) for k, a, c in zip(range(len(want)), got[0], want))
    floor = 40.0  # BF16 outputs round once (~50 dB); the GEMMs differ from the reference in FP32 summation order
    out = worst.verdict(cases, floor, repeat_ok, "the MX reference")
    if timed:
        M, K, N = 32767, 1024, 3072
        x = torch.randn(M, K, dtype=torch.bfloat16, device=device, requires_grad=True)
        w = (torch.randn(N, K, device=device) / K**0.5).requires_grad_()
        wb = w.detach().bfloat16().requires_grad_()
        b = torch.zeros(N, device=device, requires_grad=True)
        bb = b.detach().bfloat16().requires_grad_()
        dy = torch.randn(M, N, dtype=torch.bfloat16, device=device)

        def ours():
            torch.autograd.grad(MXLinearFunction.apply(x, w, b, "rceil", route, None), (x, w, b), dy)

        def peer():
            torch.autograd.grad(F.linear(x, wb, bb), (x, wb, bb), dy)

        out["speed"] = speed_line(bench_ms(ours), bench_ms(peer), "nn.Linear bf16", f"fwd+bwd {M}x{K}->{N}")
    return out


def cublas(device: torch.device, timed: bool = False) -> dict:
    return _route(device, "cublas", timed)


def scaled_mm(device: torch.device, timed: bool = False) -> dict:
    return _route(device, "scaled_mm", timed)
