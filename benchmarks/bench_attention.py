"""Jagged attention on one GPU: our Triton kernels (MXFP8 variants, BF16) beside the peers, and accuracy.

Workloads (DESIGN.md §6, same generator and parameters as the anchors):
  jagged         32 sequences, lognormal mean 1024, lengths in [32, 4096], seed 0, H16 D128
  short-history  4096 sequences, lognormal mean 200, lengths in [1, 4096], seed 0, H4 D128
  dense          B8 S2048 H16 D128 (as 8 equal jagged sequences for ours)
  broadcast_q    64 shared queries over the jagged workload's keys, H16 D128
FLOPs: forward 4 H D Σ Lq Lk, backward 2.5x forward; causal counts half.

Peers, each in its own try (a failing peer is a FAILED row, never a stop): torch `varlen_attn`, FlexAttention
with a document mask (`torch.compile(flex_attention)`), cuDNN / FlashAttention-2 SDPA on the dense shape,
cuDNN FP8 (per-tensor scales) SDPA through nvidia-cudnn-frontend (`import cudnn`).

Accuracy: cosine and SQNR of O, dQ, dK, dV against the FP32 reference for ours mxfp8, ours bf16 and the
mxfp8 reference recipe, on randn inputs and on inputs with outlier channels (x20).

Run on the GPU host from the repository root: `python benchmarks/bench_attention.py` (about 4-6 minutes;
`--quick` skips the config sweep and the short-history workload). Prints the accuracy table, then the
timing table last; JSON under $OUT.
"""
from __future__ import annotations

import argparse
import inspect
import math
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Bench, lognormal_lengths, offsets_of  # noqa: E402
from gem_lp.attention import jagged_attention  # noqa: E402
from gem_lp.attention import triton_attention as ta  # noqa: E402
from gem_lp.numerics import cosine, sqnr_db  # noqa: E402

DEV = "cuda"
D = 128


def section(title: str, fn, *args) -> None:
    print(f"== {title}", flush=True)
    try:
        fn(*args)
    except Exception as e:  # one broken section must not hide the others
        print(f"   section FAILED: {type(e).__name__}: {str(e)[:400]}", flush=True)
        traceback.print_exc(limit=3)
    torch.cuda.empty_cache()


def make_inputs(total: int, heads: int, *, requires_grad: bool = True, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.randn(total, heads, D, device=DEV, generator=g, dtype=torch.bfloat16).requires_grad_(requires_grad)
            for _ in range(3)]


def attn_flop(lq: torch.Tensor, lk: torch.Tensor, heads: int, causal: bool) -> float:
    work = float((lq.double() * lk.double()).sum())
    return 4.0 * heads * D * work * (0.5 if causal else 1.0)


def time_fwd_bwd(bench: Bench, group: str, name: str, fwd, inputs, flop: float, *, peer: bool = False,
                 bwd: bool = True, **info) -> None:
    """Time `fwd()` alone, then the backward of its output (autograd.grad with a fixed dO)."""
    with torch.no_grad():
        bench.time(f"{group} fwd", name, fwd, flop=flop, peer=peer, **info)
    if not bwd:
        return
    try:
        out = fwd()
        out = out[0] if isinstance(out, tuple) else out
        do = torch.randn_like(out)
        bench.time(f"{group} bwd", name, lambda: torch.autograd.grad(out, inputs, do, retain_graph=True),
                   flop=2.5 * flop, peer=peer, **info)
        del out, do
    except Exception as e:
        msg = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"  [{group} bwd] {name}: FAILED {msg}", flush=True)
        bench.rows.append(dict(group=f"{group} bwd", name=name, error=msg, peer=peer, **info))


# ----------------------------------------------------------------------------- peers


def varlen_peer(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool):
    from torch.nn.attention.varlen import varlen_attn

    kwargs = {}
    if causal:
        params = inspect.signature(varlen_attn).parameters
        if "is_causal" in params:
            kwargs["is_causal"] = True
        elif "window_size" in params:
            kwargs["window_size"] = (-1, 0)
        else:
            raise RuntimeError("varlen_attn has no causal option in this torch")
    return lambda: varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def flex_peer(q, k, v, lengths: torch.Tensor, causal: bool):
    """FlexAttention over the packed batch `[1, H, T, D]` with a document (and causal) mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    total = int(lengths.sum())
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=DEV), lengths.to(DEV))

    def mask_mod(b, h, qi, ki):
        same = doc[qi] == doc[ki]
        return same & (qi >= ki) if causal else same

    block_mask = create_block_mask(mask_mod, None, None, total, total, device=DEV)
    flex = torch.compile(flex_attention)
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    return lambda: flex(qt, kt, vt, block_mask=block_mask)


def cudnn_fp8_dense(bench: Bench, b: int, s: int, h: int, flop: float) -> None:
    """cuDNN FP8 (per-tensor scales) SDPA forward and backward, dense BSHD, via nvidia-cudnn-frontend."""
    import cudnn

    f8, fl = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    stride = (s * h * D, D, h * D, 1)

    def scalar(g, uid):
        return g.tensor(uid=uid, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=fl)

    def build(g):
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device=DEV)

    n = b * s
    one = torch.ones(1, 1, 1, 1, device=DEV)
    # forward
    g = cudnn.pygraph(io_data_type=f8, intermediate_data_type=fl, compute_data_type=fl, handle=handle)
    qkv = [g.tensor(uid=u, dim=(b, h, s, D), stride=stride, data_type=f8) for u in (1, 2, 3)]
    o, stats, amax_s, amax_o = g.sdpa_fp8(
        q=qkv[0], k=qkv[1], v=qkv[2], descale_q=scalar(g, 5), descale_k=scalar(g, 6), descale_v=scalar(g, 7),
        descale_s=scalar(g, 8), scale_s=scalar(g, 9), scale_o=scalar(g, 10), generate_stats=True,
        attn_scale=1 / math.sqrt(D), use_causal_mask=False)
    o.set_uid(4).set_output(True).set_dim((b, h, s, D)).set_stride(stride).set_data_type(f8)
    stats.set_uid(11).set_output(True).set_dim((b, h, s, 1)).set_stride((s * h, s, 1, 1)).set_data_type(fl)
    amax_s.set_uid(22).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(fl)
    amax_o.set_uid(12).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(fl)
    ws = build(g)
    pack = {u: torch.randn(n, h, D, device=DEV).to(torch.float8_e4m3fn) for u in (1, 2, 3)}
    pack.update({4: torch.empty(n, h, D, device=DEV, dtype=torch.float8_e4m3fn),
                 11: torch.empty(n, h, 1, device=DEV), 12: torch.zeros(1, 1, 1, 1, device=DEV),
                 22: torch.zeros(1, 1, 1, 1, device=DEV)})
    pack.update({u: one for u in (5, 6, 7, 8, 9, 10)})
    bench.time("dense fwd", "cuDNN FP8 per-tensor SDPA (frontend)", lambda: g.execute(pack, ws, handle=handle),
               flop=flop, peer=True)
    # backward
    gb = cudnn.pygraph(io_data_type=f8, intermediate_data_type=fl, compute_data_type=fl, handle=handle)
    t = [gb.tensor(uid=u, dim=(b, h, s, D), stride=stride, data_type=f8) for u in (100, 101, 102, 103, 104)]
    st = gb.tensor(uid=105, dim=(b, h, s, 1), stride=(s * h, s, 1, 1), data_type=fl)
    names = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
             "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")
    sc = {nm: scalar(gb, 106 + i) for i, nm in enumerate(names)}
    dq, dk, dv, aq, ak, av, ap = gb.sdpa_fp8_backward(q=t[0], k=t[1], v=t[2], o=t[3], dO=t[4], stats=st,
                                                      attn_scale=1 / math.sqrt(D), use_causal_mask=False, **sc)
    for uid, tt in ((118, dq), (119, dk), (120, dv)):
        tt.set_uid(uid).set_output(True).set_dim((b, h, s, D)).set_stride(stride).set_data_type(f8)
    for uid, tt in ((121, aq), (122, ak), (123, av), (124, ap)):
        tt.set_uid(uid).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(fl)
    wsb = build(gb)
    packb = {u: torch.randn(n, h, D, device=DEV).to(torch.float8_e4m3fn) for u in (100, 101, 102, 103, 104)}
    packb[105] = torch.randn(n, h, 1, device=DEV).abs() + 5
    packb.update({u: one for u in range(106, 118)})
    packb.update({u: torch.empty(n, h, D, device=DEV, dtype=torch.float8_e4m3fn) for u in (118, 119, 120)})
    packb.update({u: torch.zeros(1, 1, 1, 1, device=DEV) for u in (121, 122, 123, 124)})
    bench.time("dense bwd", "cuDNN FP8 per-tensor SDPA (frontend)", lambda: gb.execute(packb, wsb, handle=handle),
               flop=2.5 * flop, peer=True)


# ----------------------------------------------------------------------------- ours


def ours(q, k, v, offs, kv_offs=None, **kw):
    """Our public entry point. Offsets are checked once per call by the dispatcher on the CPU, so the rows
    pass validate_offsets=False (one row measures the device-side check, a host sync, separately)."""
    kw.setdefault("validate_offsets", False)
    return lambda: ta.jagged_attention_triton(q, k, v, offs, kv_offs, **kw)


def producer_pass_time(bench: Bench, group: str, q, k, v, offs) -> None:
    """The forward's producer pass alone (Q, K hdim and V seq to MX-exact BF16): its share of the forward."""
    nbytes = 3 * q.numel() * (q.element_size() + 2)  # read the input, write the BF16 operand

    def run():
        ta._operands([(q, offs, ta.ORIENT_HDIM, True), (k, offs, ta.ORIENT_HDIM, True),
                      (v, offs, ta.ORIENT_SEQ, True)], hw_cast=True)

    with torch.no_grad():
        bench.time(f"{group} fwd", "ours mxfp8: producer pass alone (Q,K,V -> MX-exact bf16)", run, nbytes=nbytes)


def jagged_workloads(bench: Bench, quick: bool) -> None:
    lengths = lognormal_lengths(32, 1024, seed=0, lo=32, hi=4096)
    heads, total = 16, int(lengths.sum())
    offs = offsets_of(lengths).to(DEV)
    cu = offs.to(torch.int32)
    mx = int(lengths.max())
    bench.extra["jagged_lengths"] = lengths.tolist()
    print(f"   jagged: B={len(lengths)} T={total} max={mx}", flush=True)
    q, k, v = make_inputs(total, heads)
    for causal in (False, True):
        group = "jagged causal" if causal else "jagged"
        flop = attn_flop(lengths, lengths, heads, causal)
        common = dict(causal=causal)
        time_fwd_bwd(bench, group, "ours mxfp8 producer const_p", ours(q, k, v, offs, precision="mxfp8", **common),
                     (q, k, v), flop)
        time_fwd_bwd(bench, group, "ours mxfp8 producer dynamic",
                     ours(q, k, v, offs, precision="mxfp8", p_quant="dynamic", **common), (q, k, v), flop)
        time_fwd_bwd(bench, group, "ours bf16", ours(q, k, v, offs, precision="bf16", **common), (q, k, v), flop)
        if not causal:
            producer_pass_time(bench, group, q.detach(), k.detach(), v.detach(), offs)
            for variant in ("dequant_in_loop", "fp8_qk"):
                time_fwd_bwd(bench, group, f"ours mxfp8 {variant} (incl. quantize_jagged)",
                             ours(q, k, v, offs, precision="mxfp8", variant=variant), (q, k, v), flop, bwd=False)
            time_fwd_bwd(bench, group, "ours mxfp8 producer + warp_specialize",
                         ours(q, k, v, offs, precision="mxfp8", warp_specialize=True), (q, k, v), flop, bwd=False)
            time_fwd_bwd(bench, group, "ours bf16 + warp_specialize",
                         ours(q, k, v, offs, precision="bf16", warp_specialize=True), (q, k, v), flop, bwd=False)
            time_fwd_bwd(bench, group, "ours mxfp8, offsets checked on device (host sync)",
                         ours(q, k, v, offs, precision="mxfp8", validate_offsets=True), (q, k, v), flop, bwd=False)
            time_fwd_bwd(bench, group, "ours mxfp8 bwd atomic dQ (fp32 buffer)",
                         ours(q, k, v, offs, precision="mxfp8", bwd_variant="atomic"), (q, k, v), flop)
            time_fwd_bwd(bench, group, "ours mxfp8 bwd atomic dQ (fp16 buffer, scale 2^8)",
                         ours(q, k, v, offs, precision="mxfp8", bwd_variant="atomic", dq_accum="fp16",
                              dq_static_scale=256.0), (q, k, v), flop)
            try:
                from gem_lp.attention.blackwell import attention_forward_scaled

                with torch.no_grad():
                    bench.time(f"{group} fwd", "ours mxfp8 tl.dot_scaled (sm_90: decomposed to bf16)",
                               lambda: attention_forward_scaled(q, k, v, offs, offs), flop=flop)
            except Exception as e:
                print(f"   dot_scaled variant FAILED: {e}", flush=True)
            if not quick:
                config_sweep(bench, group, q, k, v, offs, flop)
        try:
            time_fwd_bwd(bench, group, "torch varlen_attn bf16", varlen_peer(q, k, v, cu, cu, mx, mx, causal),
                         (q, k, v), flop, peer=True)
        except Exception as e:
            print(f"   varlen_attn FAILED: {e}", flush=True)
        try:
            time_fwd_bwd(bench, group, "FlexAttention doc-mask bf16", flex_peer(q, k, v, lengths, causal),
                         (q, k, v), flop, peer=True)
        except Exception as e:
            print(f"   flex FAILED: {e}", flush=True)

    # broadcast_q: 64 learned queries over every sequence's keys
    lq = 64
    qb = make_inputs(lq, heads, seed=1)[0]
    flop = attn_flop(torch.full_like(lengths, lq), lengths, heads, False)
    group = "broadcast_q 64"
    time_fwd_bwd(bench, group, "ours mxfp8", ours(qb, k, v, None, offs, broadcast_q=True, precision="mxfp8"),
                 (qb, k, v), flop)
    time_fwd_bwd(bench, group, "ours mxfp8, fp16 dQ buffer (scale 2^8)",
                 ours(qb, k, v, None, offs, broadcast_q=True, precision="mxfp8", dq_accum="fp16",
                      dq_static_scale=256.0), (qb, k, v), flop)
    time_fwd_bwd(bench, group, "ours bf16", ours(qb, k, v, None, offs, broadcast_q=True, precision="bf16"),
                 (qb, k, v), flop)
    try:
        from torch.nn.attention.varlen import varlen_attn

        cu_q = (torch.arange(len(lengths) + 1, device=DEV, dtype=torch.int32) * lq)

        def varlen_bcast():  # the peer needs the queries repeated per sequence
            return varlen_attn(qb.repeat(len(lengths), 1, 1), k, v, cu_q, cu, lq, mx)

        time_fwd_bwd(bench, group, "torch varlen_attn bf16 (q repeated)", varlen_bcast, (qb, k, v), flop, peer=True)
    except Exception as e:
        print(f"   varlen broadcast FAILED: {e}", flush=True)


def config_sweep(bench: Bench, group: str, q, k, v, offs, flop: float) -> None:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) alternatives of the mxfp8 producer-path kernels."""
    for cfg in ((128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 8, 2)):
        with torch.no_grad():
            bench.time(f"{group} fwd", f"sweep mxfp8 fwd cfg {cfg}",
                       ours(q, k, v, offs, precision="mxfp8", fwd_config=cfg), flop=flop, config=str(cfg))
    do = None
    sweeps = [dict(bwd_config=c) for c in ((64, 128, 8, 2), (32, 64, 4, 2), (64, 64, 4, 2), (32, 128, 8, 2))]
    sweeps += [dict(dq_config=c) for c in ((128, 64, 8, 2), (64, 128, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2))]
    for kw in sweeps:
        o = ta.jagged_attention_triton(q, k, v, offs, precision="mxfp8", validate_offsets=False, **kw)
        do = torch.randn_like(o) if do is None else do
        bench.time(f"{group} bwd", f"sweep mxfp8 bwd {kw}",
                   lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), flop=2.5 * flop, config=str(kw))


def short_history(bench: Bench) -> None:
    lengths = lognormal_lengths(4096, 200, seed=0, lo=1, hi=4096)
    heads, total = 4, int(lengths.sum())
    offs = offsets_of(lengths).to(DEV)
    cu = offs.to(torch.int32)
    mx = int(lengths.max())
    print(f"   short-history: B={len(lengths)} T={total} max={mx}", flush=True)
    q, k, v = make_inputs(total, heads)
    flop = attn_flop(lengths, lengths, heads, False)
    group = "short-history"
    time_fwd_bwd(bench, group, "ours mxfp8 producer const_p", ours(q, k, v, offs, precision="mxfp8"), (q, k, v), flop)
    time_fwd_bwd(bench, group, "ours bf16", ours(q, k, v, offs, precision="bf16"), (q, k, v), flop)
    time_fwd_bwd(bench, group, "torch varlen_attn bf16", varlen_peer(q, k, v, cu, cu, mx, mx, False), (q, k, v),
                 flop, peer=True)


def dense(bench: Bench) -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, s, heads = 8, 2048, 16
    lengths = torch.full((b,), s)
    offs = offsets_of(lengths).to(DEV)
    flop = attn_flop(lengths, lengths, heads, False)
    q, k, v = make_inputs(b * s, heads)
    group = "dense"
    time_fwd_bwd(bench, group, "ours mxfp8 producer const_p", ours(q, k, v, offs, precision="mxfp8"), (q, k, v), flop)
    time_fwd_bwd(bench, group, "ours bf16", ours(q, k, v, offs, precision="bf16"), (q, k, v), flop)
    qd, kd, vd = (torch.randn(b, heads, s, D, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        def run(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qd, kd, vd)

        time_fwd_bwd(bench, group, f"SDPA {backend.name} bf16", run, (qd, kd, vd), flop, peer=True)
    try:
        cudnn_fp8_dense(bench, b, s, heads, flop)
    except Exception as e:
        print(f"   cuDNN FP8 FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
        bench.rows.append(dict(group="dense fwd", name="cuDNN FP8 per-tensor SDPA (frontend)",
                               error=f"{type(e).__name__}: {str(e)[:200]}", peer=True))


# ----------------------------------------------------------------------------- accuracy


def accuracy(bench: Bench) -> list[tuple]:
    """Cosine and SQNR against the FP32 reference on 8 sequences of the jagged workload, H4, causal."""
    lengths = lognormal_lengths(32, 1024, seed=0, lo=32, hi=4096)[:8]
    offs = offsets_of(lengths).to(DEV)
    total, heads = int(lengths.sum()), 4
    rows = []
    for inputs in ("randn", "outliers x20"):
        g = torch.Generator(device=DEV).manual_seed(7)
        x = [torch.randn(total, heads, D, device=DEV, generator=g) for _ in range(3)]
        if inputs != "randn":
            for t in x:
                t[:, :, torch.randperm(D, device=DEV)[:4]] *= 20.0
        do = torch.randn(total, heads, D, device=DEV, generator=g)
        xr = [t.clone().requires_grad_() for t in x]
        o32 = jagged_attention(*xr, offs, causal=True, precision="fp32", backend="reference")
        o32.backward(do)
        oracle = [o32.detach()] + [t.grad for t in xr]
        runs = {
            "ours mxfp8": lambda a: ta.jagged_attention_triton(*a, offs, causal=True, precision="mxfp8"),
            "ours mxfp8 dynamic": lambda a: ta.jagged_attention_triton(*a, offs, causal=True, precision="mxfp8",
                                                                       p_quant="dynamic"),
            "ours bf16": lambda a: ta.jagged_attention_triton(*a, offs, causal=True, precision="bf16"),
            "reference mxfp8": lambda a: jagged_attention(*a, offs, causal=True, precision="mxfp8",
                                                          backend="reference"),
        }
        for name, fn in runs.items():
            try:
                xb = [t.bfloat16().requires_grad_() for t in x]
                o = fn(xb)
                o.backward(do.bfloat16())
                got = [o.detach()] + [t.grad for t in xb]
                for tensor, a, w in zip(("O", "dQ", "dK", "dV"), got, oracle):
                    rows.append((inputs, name, tensor, cosine(a.float(), w), sqnr_db(a.float(), w)))
            except Exception as e:
                print(f"   accuracy {name} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
    bench.extra["accuracy"] = [dict(inputs=i, name=n, tensor=t, cosine=c, sqnr_db=s) for i, n, t, c, s in rows]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the config sweep and the short-history workload")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA GPU", file=sys.stderr)
        return 1
    bench = Bench("bench_attention")
    acc_rows: list[tuple] = []
    section("accuracy", lambda: acc_rows.extend(accuracy(bench)))
    section("jagged (+ causal, broadcast_q)", jagged_workloads, bench, args.quick)
    section("dense", dense, bench)
    if not args.quick:
        section("short-history", short_history, bench)
    print("\n=== accuracy vs the FP32 reference (8 jagged sequences, H4 D128, causal)")
    print(f"{'inputs':14s} {'kernel':22s} {'tensor':6s} {'cosine':>9s} {'SQNR dB':>8s}")
    for inputs, name, tensor, c, s in acc_rows:
        print(f"{inputs:14s} {name:22s} {tensor:6s} {c:9.5f} {s:8.1f}")
    bench.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
