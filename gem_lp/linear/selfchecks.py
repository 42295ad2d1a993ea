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


def weight_grad_operands(M: int, K: int, N: int, device: torch.device, seed: int = 0, outlier: bool = True):
    """What a linear layer's backward holds for its dW at M tokens: X's colwise MX payload and blocked scales (the
    cast the forward saves) and dY's colwise operand `[N, rows]` (rows: the cuBLAS route's padded M, rounded up to
    16; zeros past M), from BF16 X `[M, K]` and dY `[M, N]` (an outlier token with `outlier`)."""
    from gem_lp.linear.gemm import gemm_rows
    from gem_lp.linear.kernels.cute_gemm import contracted_tokens
    from gem_lp.linear.operands import casts, dy_operands

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    if outlier and M:
        x[M // 2] *= 1e3
    dy = torch.randn(M, N, generator=g)
    x, dy = x.to(device, torch.bfloat16), dy.to(device, torch.bfloat16)
    col = casts(x, None, scaling="rceil", rowwise=False, colwise=True).colwise
    rows = contracted_tokens(gemm_rows(M))
    dy_col_t = dy_operands(dy, "rceil", "cublas", rows=rows, row=False, col=True)[1]
    return col.data, col.scale, dy_col_t


def _captured_as_eager(device: torch.device) -> bool:
    """`mx_weight_grad_sm90` captured in a CUDA graph (as the trainer's sequence graphs take it, after an eager warm-up
    on a side stream) and replayed twice gives the eager call's bits."""
    from gem_lp.linear.kernels.cute_gemm import mx_weight_grad_sm90

    data, scale, dy_col_t = weight_grad_operands(4097, 256, 256, device, seed=7)
    eager = mx_weight_grad_sm90(data, scale, dy_col_t)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        mx_weight_grad_sm90(data, scale, dy_col_t)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = mx_weight_grad_sm90(data, scale, dy_col_t)
    same = True
    for _ in range(2):
        replayed.zero_()
        graph.replay()
        torch.cuda.synchronize(device)
        same &= torch.equal(replayed, eager)
    return same


def weight_grad_cute(device: torch.device, timed: bool = False) -> dict:
    """`mx_weight_grad_sm90` against the dequantize + cuBLAS route on odd token counts (an outlier token each), FP32
    and BF16 dW, twice (bit-identical: the split-K partials commit in a fixed order); and replayed from a CUDA graph
    (`_captured_as_eager`)."""
    from gem_lp.linear.gemm import gemm_nt
    from gem_lp.linear.kernels.cute_gemm import mx_weight_grad_sm90
    from gem_lp.linear.operands import saved_col_operand

    worst, cases, repeat_ok = Agreement(), 0, True
    for i, (M, K, N) in enumerate(((1, 128, 64), (33, 256, 96), (129, 384, 256), (1000, 256, 768), (20011, 1024, 256))):
        data, scale, dy_col_t = weight_grad_operands(M, K, N, device, seed=i)
        want = gemm_nt(dy_col_t, saved_col_operand(data, scale, "rceil", "cublas", torch.bfloat16,
                                                   dy_col_t.shape[1]), "cublas", torch.float32)
        for dtype in (torch.float32, torch.bfloat16):
            cases += 1
            got = [mx_weight_grad_sm90(data, scale, dy_col_t, dtype) for _ in range(2)]
            repeat_ok &= torch.equal(got[0], got[1])
            worst.add([(f"dW {M}x{K}->{N} {dtype}", got[0], want.to(dtype))])
    out = worst.verdict(cases, 45.0, repeat_ok, "dequantize + cuBLAS")  # BF16 dW rounds once (~50 dB)
    captured = _captured_as_eager(device)
    out["passed"] = out["passed"] and captured
    out["summary"] += "; a CUDA graph's replay " + ("gives the same bits" if captured else "DIFFERS from eager")
    if timed:
        M, K, N = 273044, 1024, 256
        data, scale, dy_col_t = weight_grad_operands(M, K, N, device)

        def peer():
            gemm_nt(dy_col_t, saved_col_operand(data, scale, "rceil", "cublas", torch.bfloat16, dy_col_t.shape[1]),
                    "cublas", torch.float32)

        out["speed"] = speed_line(bench_ms(lambda: mx_weight_grad_sm90(data, scale, dy_col_t)), bench_ms(peer),
                                  "dequantize + cuBLAS", f"dW {M}x{K}->{N}")
    return out
