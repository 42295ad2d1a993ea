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

Our variants (rows named after their options) are timed beside the default of their group, and each row says
whether its output matches the default's: `match exact` (every bit), or `match ~` with the largest
|difference| / max|default| over O (forward) or dQ, dK, dV (backward); a config that fails to build or runs
out of shared memory is a FAILED row. `host ms/call` (default and broadcast_q rows): Python time per call with
the launches queued asynchronously; at or above the row's GPU time, the row measures the host, not the GPU.
The producer pass is also timed alone (blocks and strips kernels, the strips launch candidates), with its
bytes checked against the blocks kernel's.

Accuracy: cosine and SQNR of O, dQ, dK, dV against the FP32 reference for ours mxfp8, ours bf16 and the
mxfp8 reference recipe, on randn inputs and on inputs with outlier channels (x20).

Run on the GPU host from the repository root: `python benchmarks/bench_attention.py` (every section, with the
config sweeps; about 8-10 minutes with cold Triton caches), `--quick` (no sweeps, no short-history), or
`--sections jagged,broadcast` (any of accuracy, jagged, broadcast, sweep, dense, short). Prints the accuracy
table, the variants table (match and host time), then the timing table last; JSON under $OUT.
`--compile-only` (no GPU; TRITON_INTERPRET unset) builds every kernel launch the run makes for sm_90 on this
machine and prints registers, spills, shared memory, programs per SM and whether ptxas serializes the wgmma
instructions (`--defaults` only the default launches); it exits 1 when a default launch fails to build or
exceeds a program's shared memory.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Bench, host_us_per_call, lognormal_lengths, offsets_of  # noqa: E402
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


# ----------------------------------------------------------------------------- timing with output checks


def agreement(got, want) -> str:
    """'exact' when every tensor equals its default bit for bit (NaN where the default has NaN), else
    '~' and the largest |got - want| / max|want| over the tensors."""
    worst, exact = 0.0, True
    for a, b in zip(got, want):
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)} != {tuple(b.shape)}"
        if torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)):
            continue
        exact = False
        a, b = a.float(), b.float()
        worst = max(worst, float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)))
    return "exact" if exact else f"~ {worst:.1e}"


def note(bench: Bench, group: str, name: str, **fields) -> None:
    """Add fields (match, host time) to the latest row of (group, name) and to the variants table."""
    for r in reversed(bench.rows):
        if r["group"] == group and r["name"] == name:
            r.update(fields)
            break
    bench.extra.setdefault("variants", []).append(dict(group=group, name=name, **fields))
    print(f"  [{group}] {name}: " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                             for k, v in fields.items()), flush=True)


def outputs(fwd, inputs, do, bwd: bool = True):
    """(O,) and, with bwd, (dQ, dK, dV) of one call of `fwd` against the fixed dO."""
    out = fwd()
    out = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(out, inputs, do) if bwd else None
    return (out.detach(),), grads


def default_outputs(mx_fwd, bf16_fwd, inputs, do):
    """`outputs` of the mxfp8 and bf16 default launches, which variant rows are compared with; (None, None) when
    they fail (the rows then carry no match)."""
    try:
        return outputs(mx_fwd, inputs, do), outputs(bf16_fwd, inputs, do)
    except Exception as e:
        print(f"   default outputs FAILED (rows carry no match): {type(e).__name__}: {str(e)[:300]}", flush=True)
        return None, None


def time_fwd_bwd(bench: Bench, group: str, name: str, fwd, inputs, flop: float, *, peer: bool = False,
                 bwd: bool = True, ref=None, do=None, host: bool = False, **info) -> None:
    """Time `fwd()` alone, then the backward of its output (autograd.grad with dO `do`, or a random one).

    ref: the group default's `outputs(...)`; each timed pass then reports whether this row's output matches it.
    host: also report the forward's Python time per call (`host_ms`).
    """
    with torch.no_grad():
        bench.time(f"{group} fwd", name, fwd, flop=flop, peer=peer, **info)
    if ref is not None or host:
        try:
            fields = {}
            if ref is not None:
                with torch.no_grad():
                    o = fwd()
                fields["match"] = agreement((o[0] if isinstance(o, tuple) else o,), ref[0])
            if host:
                with torch.no_grad():
                    fields["host_ms"] = host_us_per_call(fwd, calls=20) / 1e3
            note(bench, f"{group} fwd", name, **fields)
        except Exception as e:
            print(f"  [{group} fwd] {name}: output check FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    if not bwd:
        return
    try:
        out = fwd()
        out = out[0] if isinstance(out, tuple) else out
        do = torch.randn_like(out) if do is None or do.shape != out.shape else do  # a peer's own layout
        bench.time(f"{group} bwd", name, lambda: torch.autograd.grad(out, inputs, do, retain_graph=True),
                   flop=2.5 * flop, peer=peer, **info)
        if ref is not None and ref[1] is not None:
            note(bench, f"{group} bwd", name, match=agreement(torch.autograd.grad(out, inputs, do), ref[1]))
        del out
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


def fixed_do(rows: int, heads: int, seed: int = 11) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(rows, heads, D, device=DEV, generator=g, dtype=torch.bfloat16)


def jagged_batch():
    """The jagged workload: lengths, offsets (device), q, k, v (BF16, requiring grad)."""
    lengths = lognormal_lengths(32, 1024, seed=0, lo=32, hi=4096)
    offs = offsets_of(lengths).to(DEV)
    q, k, v = make_inputs(int(lengths.sum()), 16)
    return lengths, offs, q, k, v


# Variants of the default MXFP8 forward (and, where the option reaches it, backward) on the jagged workload:
# (row name, options, time the backward too).
MX_VARIANTS = (
    ("ours mxfp8 Q rounded in the prologue (q_in_kernel=True)", dict(q_in_kernel=True), False),
    ("ours mxfp8 producer=blocks", dict(producer="blocks"), True),
    ("ours mxfp8 previous default (producer=blocks, q_in_kernel=False)", dict(producer="blocks", q_in_kernel=False),
     True),
    ("ours mxfp8 kv_tma", dict(kv_tma=True), False),
    ("ours mxfp8 kv_tma, q_in_kernel=True", dict(kv_tma=True, q_in_kernel=True), False),
    ("ours mxfp8 kv_in_kernel (K, V rounded in the loop)", dict(kv_in_kernel=True), False),
)
BF16_VARIANTS = (("ours bf16 kv_tma", dict(kv_tma=True)),)


def producer_pass_time(bench: Bench, group: str, q, k, v, offs, do, quick: bool) -> None:
    """The producer pass alone, blocks and strips kernels: the forward's K hdim + V seq (Q rounded in the forward
    kernel), Q, K hdim + V seq (q_in_kernel=False), and the backward's Q, K, dO square + V hdim with Δ. Bytes are
    checked against the blocks kernel's (operands exactly; Δ to FP32 summation order)."""
    elt = q.element_size()
    sets = {
        "fwd K hdim, V seq": ([(k, offs, ta.ORIENT_HDIM, True), (v, offs, ta.ORIENT_SEQ, True)], {}, 2 * (elt + 2)),
        "fwd Q, K hdim, V seq": ([(q, offs, ta.ORIENT_HDIM, True), (k, offs, ta.ORIENT_HDIM, True),
                                  (v, offs, ta.ORIENT_SEQ, True)], {}, 3 * (elt + 2)),
        "bwd Q, K, dO square, V hdim + delta": (
            [(q, offs, ta.ORIENT_SQUARE, True), (k, offs, ta.ORIENT_SQUARE, True), (v, offs, ta.ORIENT_HDIM, True),
             (do, offs, ta.ORIENT_SQUARE, True)], dict(o=q), 4 * (elt + 2) + elt + 4 / D),
    }
    launches = [None] if quick else [None] + [c for c in ta.STRIPS_CANDIDATES if c != ta.STRIPS_LAUNCH]
    for label, (specs, extra, bytes_per_elt) in sets.items():
        nbytes = q.numel() * bytes_per_elt
        with torch.no_grad():
            want = ta._operands(specs, hw_cast=True, producer="blocks", **extra)
            bench.time(f"{group} producer", f"blocks: {label}",
                       lambda: ta._operands(specs, hw_cast=True, producer="blocks", **extra), nbytes=nbytes)
            for strips in launches:
                name = f"strips {strips or ta.STRIPS_LAUNCH}{' (default)' if strips is None else ''}: {label}"
                try:
                    got = ta._operands(specs, hw_cast=True, producer="strips", strips=strips, **extra)
                    match = agreement(got[0], want[0])
                    if got[1] is not None:
                        match += f", delta {agreement((got[1],), (want[1],))}"
                except Exception as e:
                    print(f"  [{group} producer] {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    bench.rows.append(dict(group=f"{group} producer", name=name, error=str(e)[:200]))
                    continue
                bench.time(f"{group} producer", name,
                           lambda: ta._operands(specs, hw_cast=True, producer="strips", strips=strips, **extra),
                           nbytes=nbytes)
                note(bench, f"{group} producer", name, match=match)
            del want


def jagged_workloads(bench: Bench, quick: bool) -> None:
    lengths, offs, q, k, v = jagged_batch()
    heads, total = q.shape[1], q.shape[0]
    cu = offs.to(torch.int32)
    mx = int(lengths.max())
    bench.extra["jagged_lengths"] = lengths.tolist()
    print(f"   jagged: B={len(lengths)} T={total} max={mx}", flush=True)
    do = fixed_do(total, heads)
    for causal in (False, True):
        group = "jagged causal" if causal else "jagged"
        flop = attn_flop(lengths, lengths, heads, causal)
        common = dict(causal=causal)
        mx_default = ours(q, k, v, offs, precision="mxfp8", **common)
        bf16_default = ours(q, k, v, offs, precision="bf16", **common)
        ref_mx, ref_bf16 = default_outputs(mx_default, bf16_default, (q, k, v), do)
        time_fwd_bwd(bench, group, "ours mxfp8 producer const_p", mx_default, (q, k, v), flop, do=do, host=True)
        time_fwd_bwd(bench, group, "ours mxfp8 producer dynamic",
                     ours(q, k, v, offs, precision="mxfp8", p_quant="dynamic", **common), (q, k, v), flop, do=do)
        time_fwd_bwd(bench, group, "ours bf16", bf16_default, (q, k, v), flop, do=do, host=True)
        for name, kw, bwd in MX_VARIANTS if not causal else MX_VARIANTS[2:4]:
            time_fwd_bwd(bench, group, name, ours(q, k, v, offs, precision="mxfp8", **kw, **common), (q, k, v), flop,
                         bwd=bwd, ref=ref_mx, do=do)
        for name, kw in BF16_VARIANTS:
            time_fwd_bwd(bench, group, name, ours(q, k, v, offs, precision="bf16", **kw, **common), (q, k, v), flop,
                         bwd=False, ref=ref_bf16, do=do)
        if not causal:
            producer_pass_time(bench, group, q.detach(), k.detach(), v.detach(), offs, do, quick)
            for variant in ("dequant_in_loop", "fp8_qk"):
                time_fwd_bwd(bench, group, f"ours mxfp8 {variant} (incl. quantize_jagged)",
                             ours(q, k, v, offs, precision="mxfp8", variant=variant), (q, k, v), flop, bwd=False,
                             ref=ref_mx)
            time_fwd_bwd(bench, group, "ours mxfp8 producer + warp_specialize",
                         ours(q, k, v, offs, precision="mxfp8", warp_specialize=True), (q, k, v), flop, bwd=False,
                         ref=ref_mx)
            time_fwd_bwd(bench, group, "ours bf16 + warp_specialize",
                         ours(q, k, v, offs, precision="bf16", warp_specialize=True), (q, k, v), flop, bwd=False,
                         ref=ref_bf16)
            time_fwd_bwd(bench, group, "ours mxfp8, offsets checked on device (host sync)",
                         ours(q, k, v, offs, precision="mxfp8", validate_offsets=True), (q, k, v), flop, bwd=False,
                         host=True)
            time_fwd_bwd(bench, group, "ours mxfp8 bwd atomic dQ (fp32 buffer)",
                         ours(q, k, v, offs, precision="mxfp8", bwd_variant="atomic"), (q, k, v), flop, ref=ref_mx,
                         do=do)
            time_fwd_bwd(bench, group, "ours mxfp8 bwd atomic dQ (fp16 buffer, scale 2^8)",
                         ours(q, k, v, offs, precision="mxfp8", bwd_variant="atomic", dq_accum="fp16",
                              dq_static_scale=256.0), (q, k, v), flop, ref=ref_mx, do=do)
            try:
                from gem_lp.attention.blackwell import attention_forward_scaled

                with torch.no_grad():
                    bench.time(f"{group} fwd", "ours mxfp8 tl.dot_scaled (sm_90: decomposed to bf16)",
                               lambda: attention_forward_scaled(q, k, v, offs, offs), flop=flop)
            except Exception as e:
                print(f"   dot_scaled variant FAILED: {e}", flush=True)
        try:
            time_fwd_bwd(bench, group, "torch varlen_attn bf16", varlen_peer(q, k, v, cu, cu, mx, mx, causal),
                         (q, k, v), flop, peer=True, do=do)
        except Exception as e:
            print(f"   varlen_attn FAILED: {e}", flush=True)
        try:
            time_fwd_bwd(bench, group, "FlexAttention doc-mask bf16", flex_peer(q, k, v, lengths, causal),
                         (q, k, v), flop, peer=True, do=do)
        except Exception as e:
            print(f"   flex FAILED: {e}", flush=True)
        del ref_mx, ref_bf16


def broadcast(bench: Bench) -> None:
    """64 learned queries over every sequence's keys (the jagged workload's K, V)."""
    lengths, offs, _, k, v = jagged_batch()
    heads, lq, batch = k.shape[1], 64, len(lengths)
    cu = offs.to(torch.int32)
    qb = make_inputs(lq, heads, seed=1)[0]
    flop = attn_flop(torch.full_like(lengths, lq), lengths, heads, False)
    group = "broadcast_q 64"
    do = fixed_do(batch * lq, heads)
    args = (qb, k, v, None, offs)
    mx_default = ours(*args, broadcast_q=True, precision="mxfp8")
    bf16_default = ours(*args, broadcast_q=True, precision="bf16")
    ref_mx, ref_bf16 = default_outputs(mx_default, bf16_default, (qb, k, v), do)
    time_fwd_bwd(bench, group, "ours mxfp8", mx_default, (qb, k, v), flop, do=do, host=True)
    rows = (
        ("ours mxfp8 K, V through the producer pass (kv_in_kernel=False)",
         dict(precision="mxfp8", kv_in_kernel=False), False),
        ("ours mxfp8 kv_in_kernel, kv_tma", dict(precision="mxfp8", kv_in_kernel=True, kv_tma=True), False),
        ("ours mxfp8 kv_in_kernel, fwd cfg (64, 32, 4, 3)",
         dict(precision="mxfp8", kv_in_kernel=True, fwd_config=(64, 32, 4, 3)), False),
        ("ours mxfp8 bwd atomic dQ (previous: fp32 atomics)", dict(precision="mxfp8", bwd_variant="atomic"), True),
        ("ours mxfp8 bwd atomic dQ (fp16 buffer, scale 2^8)",
         dict(precision="mxfp8", bwd_variant="atomic", dq_accum="fp16", dq_static_scale=256.0), True),
    )
    for name, kw, bwd in rows:
        time_fwd_bwd(bench, group, name, ours(*args, broadcast_q=True, **kw), (qb, k, v), flop, bwd=bwd, ref=ref_mx,
                     do=do, host=True)
    time_fwd_bwd(bench, group, "ours bf16", bf16_default, (qb, k, v), flop, do=do, host=True)
    for name, kw in (("ours bf16 fwd cfg (64, 64, 4, 3)", dict(fwd_config=(64, 64, 4, 3))),
                     ("ours bf16 kv_tma, fwd cfg (64, 64, 4, 3)", dict(kv_tma=True, fwd_config=(64, 64, 4, 3)))):
        time_fwd_bwd(bench, group, name, ours(*args, broadcast_q=True, precision="bf16", **kw), (qb, k, v), flop,
                     bwd=False, ref=ref_bf16, do=do, host=True)
    try:
        from torch.nn.attention.varlen import varlen_attn

        cu_q = (torch.arange(batch + 1, device=DEV, dtype=torch.int32) * lq)
        mx = int(lengths.max())

        def varlen_bcast():  # the peer needs the queries repeated per sequence
            return varlen_attn(qb.repeat(batch, 1, 1), k, v, cu_q, cu, lq, mx)

        time_fwd_bwd(bench, group, "torch varlen_attn bf16 (q repeated)", varlen_bcast, (qb, k, v), flop, peer=True,
                     do=do, host=True)
    except Exception as e:
        print(f"   varlen broadcast FAILED: {e}", flush=True)


# Launch configs (BLOCK_M, BLOCK_N, num_warps, num_stages) the sweep times beside the defaults.
FWD_SWEEP = ((128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 3),
             (64, 64, 4, 3), (64, 128, 4, 3), (128, 32, 4, 3))
FWD_TMA_SWEEP = ((128, 128, 8, 2), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3))
# Backward: deeper software pipelining (3-5 stages) of the loop's loads, and the tile shapes of Triton's Hopper
# fused-attention tutorial (key tile 128 x query step 32, dQ tile 128 queries x key step 32, 4 warps).
BWD_KV_SWEEP = ((64, 128, 8, 2), (32, 64, 4, 2), (64, 64, 4, 2), (32, 128, 8, 2), (128, 64, 8, 2), (64, 128, 8, 3),
                (128, 128, 8, 2), (32, 128, 4, 3), (32, 128, 4, 4), (32, 128, 4, 5), (64, 64, 4, 3), (64, 64, 4, 4),
                (64, 128, 4, 3), (32, 64, 4, 3), (64, 64, 8, 3))
BWD_Q_SWEEP = ((128, 64, 8, 2), (64, 128, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2), (128, 128, 8, 2), (128, 32, 4, 3),
               (128, 32, 4, 4), (128, 32, 4, 5), (64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 4, 3), (64, 32, 4, 3))


def config_sweep(bench: Bench) -> None:
    """Launch configs of the forward (mxfp8 and bf16, pointer and TMA loads) and of the backward's key-tile and
    dQ kernels (mxfp8) on the jagged workload, each checked against its default's output."""
    lengths, offs, q, k, v = jagged_batch()
    flop = attn_flop(lengths, lengths, q.shape[1], False)
    do = fixed_do(q.shape[0], q.shape[1])
    group = "jagged sweep"
    for precision in ("mxfp8", "bf16"):
        try:
            ref = outputs(ours(q, k, v, offs, precision=precision), (q, k, v), do, bwd=precision == "mxfp8")
        except Exception as e:
            print(f"   {precision} default FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
            ref = None
        default = (ta.FWD_MX_CONFIGS if precision == "mxfp8" else ta.FWD_CONFIGS)[D]
        for tma, configs in ((False, FWD_SWEEP), (True, FWD_TMA_SWEEP)):
            for cfg in configs:
                name = (f"{precision} fwd cfg {cfg}{' kv_tma' if tma else ''}"
                        f"{' (default cfg)' if cfg == default else ''}")
                time_fwd_bwd(bench, group, name, ours(q, k, v, offs, precision=precision, fwd_config=cfg, kv_tma=tma),
                             (q, k, v), flop, bwd=False, ref=ref, config=str(cfg))
        if precision != "mxfp8":
            continue
        sweeps = [("bwd kv cfg", dict(bwd_config=c)) for c in BWD_KV_SWEEP]
        sweeps += [("bwd dq cfg", dict(dq_config=c)) for c in BWD_Q_SWEEP]
        for label, kw in sweeps:
            cfg = next(iter(kw.values()))
            default = (ta.BWD_KV_CONFIGS if "bwd_config" in kw else ta.BWD_Q_CONFIGS)[D]
            name = f"mxfp8 {label} {cfg}{' (default cfg)' if cfg == default else ''}"
            try:
                o = ta.jagged_attention_triton(q, k, v, offs, precision="mxfp8", validate_offsets=False, **kw)
                bench.time(f"{group} bwd", name, lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
                           flop=2.5 * flop, config=str(kw))
                if ref is not None and any(r["name"] == name and "ms" in r for r in bench.rows):
                    note(bench, f"{group} bwd", name, match=agreement(torch.autograd.grad(o, (q, k, v), do), ref[1]))
                del o
            except Exception as e:
                msg = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"  [{group} bwd] {name}: FAILED {msg}", flush=True)
                bench.rows.append(dict(group=f"{group} bwd", name=name, error=msg, config=str(kw)))



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


# ----------------------------------------------------------------------------- sm_90 builds (no GPU)

H200_REGISTERS, H200_MAX_WARPS, H200_SMEM_PER_SM, H200_SMEM_PER_PROGRAM = 65536, 64, 228 * 1024, 227 * 1024
KERNELS = ("_attn_fwd_kernel", "_operand_kernel", "_operand_strips_kernel", "_attn_bwd_kv_kernel",
           "_attn_bwd_q_kernel")


class _Recorder:
    """Stands in for a kernel of `triton_attention`: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


@contextlib.contextmanager
def recorded_launches():
    """The kernel launches of the host code run inside, recorded instead of run (CPU tensors are fine)."""
    launches: list = []
    saved = {name: getattr(ta, name) for name in KERNELS}
    try:
        for name, kernel in saved.items():
            setattr(ta, name, _Recorder(kernel, launches))
        yield launches
    finally:
        for name, kernel in saved.items():
            setattr(ta, name, kernel)


def programs_per_sm(regs: int, num_warps: int, smem: int) -> int:
    """Programs an H200 SM holds at once (registers allocated per warp in units of 256)."""
    by_regs = H200_REGISTERS // (math.ceil(regs * 32 / 256) * 256 * num_warps)
    by_smem = H200_SMEM_PER_SM // (smem + 1024) if smem else 32
    return max(0, min(by_regs, H200_MAX_WARPS // num_warps, by_smem, 32))


def build_cases(defaults_only: bool):
    """(label, is a default launch, host call on CPU tensors) of every launch the GPU run makes (D=128, H16)."""
    t, heads = 1000, 16
    offs = torch.tensor([0, 300, 301, 700, 1000])
    q, k, v, do = (torch.empty(t, heads, D, dtype=torch.bfloat16) for _ in range(4))
    lse = torch.empty(t, heads)
    qb = torch.empty(64, heads, D, dtype=torch.bfloat16)
    fwd = lambda **kw: (lambda: ta.attention_forward(q, k, v, offs, offs, hw_cast=True, **kw))  # noqa: E731
    bwd = lambda **kw: (lambda: ta.attention_backward(do, q, k, v, q, lse, offs, offs, hw_cast=True, **kw))  # noqa
    mx_cfg, bf_cfg = ta.FWD_MX_CONFIGS[D], ta.FWD_CONFIGS[D]
    kv_cfg, q_cfg = ta.BWD_KV_CONFIGS[D], ta.BWD_Q_CONFIGS[D]
    cases = [
        ("fwd mxfp8 default", True, fwd(precision="mxfp8", config=mx_cfg)),
        ("fwd mxfp8 dynamic causal", True, fwd(precision="mxfp8", p_quant="dynamic", causal=True, config=mx_cfg)),
        ("fwd bf16 default", True, fwd(precision="bf16", config=bf_cfg)),
        ("bwd mxfp8 default (strips producer + delta)", True,
         bwd(precision="mxfp8", config=kv_cfg, dq_config=q_cfg)),
        ("broadcast_q fwd mxfp8", True, lambda: ta.attention_forward(qb, k, v, None, offs, broadcast_q=True,
                                                                     hw_cast=True, precision="mxfp8", config=mx_cfg)),
        ("broadcast_q bwd mxfp8 (partial dQ per sequence)", True,
         lambda: ta.attention_backward(do[:256], qb, k, v, q[:256], lse[:256], None, offs, broadcast_q=True,
                                       hw_cast=True, precision="mxfp8", config=kv_cfg, dq_config=q_cfg)),
    ]
    if defaults_only:
        return cases
    cases += [
        ("fwd mxfp8 q_in_kernel=True", False, fwd(precision="mxfp8", config=mx_cfg, q_in_kernel=True)),
        ("fwd mxfp8 producer=blocks", False, fwd(precision="mxfp8", config=mx_cfg, producer="blocks")),
        ("fwd mxfp8 kv_in_kernel", False, fwd(precision="mxfp8", config=mx_cfg, kv_in_kernel=True)),
        ("fwd mxfp8 kv_in_kernel cfg (64, 32, 4, 3)", False,
         fwd(precision="mxfp8", config=(64, 32, 4, 3), kv_in_kernel=True)),
        ("bwd mxfp8 producer=blocks", False, bwd(precision="mxfp8", config=kv_cfg, dq_config=q_cfg, producer="blocks")),
    ]
    for precision in ("mxfp8", "bf16"):
        for cfg in FWD_SWEEP:
            cases.append((f"fwd {precision} cfg {cfg}", False, fwd(precision=precision, config=cfg)))
        for cfg in FWD_TMA_SWEEP:
            cases.append((f"fwd {precision} cfg {cfg} kv_tma", False,
                          fwd(precision=precision, config=cfg, kv_tma=True)))
    for cfg in BWD_KV_SWEEP:
        cases.append((f"bwd mxfp8 kv cfg {cfg}", False, bwd(precision="mxfp8", config=cfg, dq_config=q_cfg)))
    for cfg in BWD_Q_SWEEP:
        cases.append((f"bwd mxfp8 dq cfg {cfg}", False, bwd(precision="mxfp8", config=kv_cfg, dq_config=cfg)))
    for strips in ta.STRIPS_CANDIDATES:
        specs = [(k, offs, ta.ORIENT_HDIM, True), (v, offs, ta.ORIENT_SEQ, True)]
        cases.append((f"producer strips {strips}: fwd K hdim, V seq", False,
                      lambda s=strips, sp=specs: ta._operands(sp, hw_cast=True, producer="strips", strips=s)))
    return cases


def wgmma_serialized(ptx: str) -> bool:
    """Whether ptxas serializes the kernel's wgmma instructions for sm_90a (its "Potential Performance Loss:
    wgmma.mma_async instructions are serialized" note): each HGMMA then waits for the one before, a slowdown that
    registers and spills do not show."""
    import subprocess

    from triton.backends.nvidia.compiler import get_ptxas

    log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", "-", "-o", os.devnull], input=ptx,
                         capture_output=True, text=True, check=True).stderr
    return "wgmma.mma_async instructions are serialized" in log


def compile_only(defaults_only: bool) -> int:
    """Build every launch of `build_cases` for sm_90; 1 when a default launch fails to build or does not fit
    (spills and serialized wgmma are reported, not failed)."""
    from gem_lp.mx.triton_quantize import compile_for_target, ptxas_usage

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("--compile-only needs TRITON_INTERPRET unset (interpreted kernels cannot be compiled)", file=sys.stderr)
        return 2
    bad_defaults, seen = 0, {}
    for label, is_default, call in build_cases(defaults_only):
        with recorded_launches() as launches:
            try:
                call()
            except Exception as e:
                print(f"  {label}: host code FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                bad_defaults += is_default
                continue
        for kernel, args, kwargs in launches:
            name = kernel.fn.__name__
            key = (name, tuple(sorted((k, str(v)) for k, v in kwargs.items())))
            try:
                if key not in seen:
                    compiled = compile_for_target(kernel, args, kwargs)
                    ptx = compiled.asm["ptx"]
                    seen[key] = (*ptxas_usage(ptx), compiled.metadata.shared, wgmma_serialized(ptx))
                regs, spills, smem, serialized = seen[key]
            except Exception as e:
                print(f"  {label}: {name} FAILED to build: {type(e).__name__}: {str(e)[:300]}", flush=True)
                bad_defaults += is_default
                continue
            warps = kwargs.get("num_warps", 4)
            fits = smem <= H200_SMEM_PER_PROGRAM
            per_sm = programs_per_sm(regs, warps, smem) if fits else 0
            flag = "" if fits else "  EXCEEDS the shared memory of a program (OutOfResources on the GPU)"
            flag += "  SPILLS" if spills else ""
            flag += "  WGMMA SERIALIZED" if serialized else ""
            print(f"  {label:52s} {name:24s} warps {warps} stages {kwargs.get('num_stages', '-')}  registers {regs:3d}"
                  f"  spill bytes {spills:4d}  shared {smem:6d} B  programs/SM {per_sm}{flag}", flush=True)
            bad_defaults += is_default and not fits
    verdict = f"{bad_defaults} default launches FAILED or do not fit" if bad_defaults else "defaults all built and fit"
    print(f"sm_90 builds: {verdict}")
    return 1 if bad_defaults else 0


# ----------------------------------------------------------------------------- main

SECTIONS = ("accuracy", "jagged", "broadcast", "sweep", "dense", "short")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="skip the config sweeps (and the strips launch candidates) and the short-history workload")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default all; --quick: no sweep, short)")
    parser.add_argument("--compile-only", action="store_true",
                        help="build every launch for sm_90 on this machine (no GPU; TRITON_INTERPRET unset)")
    parser.add_argument("--defaults", action="store_true", help="with --compile-only: the default launches only")
    args = parser.parse_args()
    if args.compile_only:
        return compile_only(args.defaults)
    sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {SECTIONS}")
    if args.quick:
        sections = [s for s in sections if s not in ("sweep", "short")]
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA GPU (or --compile-only)", file=sys.stderr)
        return 1
    bench = Bench("bench_attention")
    acc_rows: list[tuple] = []
    if "accuracy" in sections:
        section("accuracy", lambda: acc_rows.extend(accuracy(bench)))
    if "jagged" in sections:
        section("jagged (+ causal)", jagged_workloads, bench, args.quick)
    if "broadcast" in sections:
        section("broadcast_q", broadcast, bench)
    if "sweep" in sections:
        section("config sweep", config_sweep, bench)
    if "dense" in sections:
        section("dense", dense, bench)
    if "short" in sections:
        section("short-history", short_history, bench)
    if acc_rows:
        print("\n=== accuracy vs the FP32 reference (8 jagged sequences, H4 D128, causal)")
        print(f"{'inputs':14s} {'kernel':22s} {'tensor':6s} {'cosine':>9s} {'SQNR dB':>8s}")
        for inputs, name, tensor, c, s in acc_rows:
            print(f"{inputs:14s} {name:22s} {tensor:6s} {c:9.5f} {s:8.1f}")
    print("\n=== variants: output vs the group default (match) and Python time per call (host_ms)")
    ms = {(r["group"], r["name"]): r for r in bench.rows if "ms" in r}
    for v in bench.extra.get("variants", []):
        r = ms.get((v["group"], v["name"]), {})
        gpu = f"{r['ms']:8.4f} ms {r.get('tflops', 0):6.1f} TF/s" if r else "       (no timing)     "
        host = f"host {v['host_ms']:.3f} ms/call" if "host_ms" in v else ""
        print(f"{v['group'][:22]:22s} {v['name'][:70]:70s} {gpu}  {v.get('match', ''):12s} {host}")
    bench.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
