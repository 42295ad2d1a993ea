"""The `cute` backend of `jagged_attention`: FlashAttention-4's varlen kernels for `bf16`, and FA4's Hopper kernels
with the LP-FA4 recipe (`fwd_sm90`, `bwd_sm90`) behind a producer pass for `mxfp8`.

Shapes follow `jagged_attention`: q `[Tq, H, D]` (`[Lq, H, D]` with broadcast_q), k, v `[Tk, H, D]`. broadcast_q
runs as B query sequences of length Lq (the shared queries repeated; their gradients summed). LSE is `[H, T]`
inside (FA4's layout) and handed out as a `[T, H]` view.

`mxfp8` operands: the producer pass (`gem_lp.attention.producer`, memory-bound, one launch) writes the MX-exact
BF16 operands: forward Q, K `hdim` and V `seq`; backward Q, K, dO `square` and V `hdim`, blocks aligned to each
sequence's first token. The forward's pass also packs the backward's Q, K and V as MX (E4M3 payload + scales, about
1 byte per element), and that is what the op keeps for its backward instead of q, k, v: the backward's pass decodes
them into the same operands it would have quantized, bit for bit. The kernels' outputs are BF16 (O, dQ, dK, dV), cast
to the input dtype.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from gem_lp.attention.plan import cached_plan
from gem_lp.runtime.device import build_arch
from gem_lp.attention.producer import ORIENT_HDIM, ORIENT_SEQ, ORIENT_SQUARE, PackedMX, mx_operands


# FA4's backward compiles another kernel when the longest sequence fits in one tile (a compile-key flag that guards
# TVM's stride specialization of the non-varlen buffers, whose shapes follow max_seqlen; varlen buffers follow the
# token counts), so a batch of short sequences would build mid-run. A bound above two tiles of 128 keeps the one
# build; the varlen kernels read sequence lengths from cu_seqlens, and max_seqlen only bounds them.
_BWD_MAX_SEQLEN_FLOOR = 257


@dataclasses.dataclass(frozen=True)
class VarlenBatch:
    """Device-side sequence layout of one call: FA4's int32 `cu_seqlens`, int64 offsets for the producer pass,
    and the maximum lengths (host integers, from the validated CPU offsets)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    q_offsets: torch.Tensor  # int64: rows of q as given (`[0, Lq]` with broadcast_q)
    out_offsets: torch.Tensor  # int64: rows of O and dO
    kv_offsets: torch.Tensor
    max_q: int
    max_k: int
    batch: int
    broadcast_q: bool


def _device_offsets(key_tensor: torch.Tensor, make, device: torch.device, tag: tuple):
    """(int32, int64) offsets on `device` from `make()` (a tensor on `device` or on the CPU), once per offsets tensor
    (and version). Made without a host sync: from a tensor on the device by device ops, from one on the CPU by an
    asynchronous copy out of pinned memory (a plain `.to(device)` of pageable memory waits for the stream)."""
    def build():
        offs = make()
        if offs.device == device:
            d64 = offs.to(torch.int64, copy=True)  # a copy: the caller's tensor may be written later
        elif device.type == "cuda":
            d64 = offs.to(torch.int64).pin_memory().to(device, non_blocking=True)
        else:
            d64 = offs.to(device=device, dtype=torch.int64)
        return d64.to(torch.int32), d64
    return cached_plan(key_tensor, ("cute offsets", device, tag), build)


def _max_length(offs: torch.Tensor) -> int:
    """The longest sequence of validated CPU offsets (cached with them: the same CPU tensor comes back for the same
    offsets tensor)."""
    return cached_plan(offs, ("max length",), lambda: int((offs[1:] - offs[:-1]).max()) if offs.numel() > 1 else 0)


def varlen_batch(q_offsets_arg, kv_offsets_arg, q_offs: torch.Tensor | None, kv_offs: torch.Tensor | None,
                 *, broadcast_q: bool, q_rows: int, device: torch.device,
                 max_lengths: tuple[int | None, int] | None = None) -> VarlenBatch:
    """The call's layout. `*_arg`: the offsets tensors the caller passed (cache keys, and the device offsets when
    they are on the device); `q_offs`, `kv_offs`: their validated CPU int64 values (q_offs None with broadcast_q),
    or both None with `max_lengths` (max q, max kv): offsets on the device taken unchecked, those the bounds."""
    key_kv = kv_offsets_arg if kv_offsets_arg is not None else q_offsets_arg
    cu_k, kv64 = _device_offsets(key_kv, lambda: key_kv, device, ("kv",))
    batch = key_kv.numel() - 1
    max_k = _max_length(kv_offs) if max_lengths is None else max_lengths[1]
    if broadcast_q:
        cu_q, out64 = _device_offsets(
            key_kv, lambda: torch.arange(batch + 1, dtype=torch.int64, device=device) * q_rows, device,
            ("broadcast out", q_rows))
        _, q64 = _device_offsets(key_kv, lambda: torch.arange(2, dtype=torch.int64, device=device) * q_rows, device,
                                 ("broadcast q", q_rows))
        max_q = q_rows if batch else 0
    else:
        cu_q, q64 = _device_offsets(q_offsets_arg, lambda: q_offsets_arg, device, ("q",))
        out64 = q64
        max_q = _max_length(q_offs) if max_lengths is None else max_lengths[0]
    return VarlenBatch(cu_q, cu_k, q64, out64, kv64, max_q, max_k, batch, broadcast_q)


def _kernel_dtype(x: torch.Tensor) -> torch.dtype:
    # the bf16 recipe rounds FP32 inputs to BF16 (reference.operand_dtype_16); FA4 takes BF16 and FP16
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as the producer pass reads it: token rows may be strided (a view into a fused projection), heads and
    features contiguous."""
    return x if x.numel() == 0 or (x.stride(2) == 1 and x.stride(1) == x.shape[2]) else x.contiguous()


def _repeat_q(q: torch.Tensor, vb: VarlenBatch) -> torch.Tensor:
    return q.repeat(vb.batch, 1, 1) if vb.broadcast_q else q


def _sum_q(dq: torch.Tensor, vb: VarlenBatch, lq: int) -> torch.Tensor:
    if not vb.broadcast_q:
        return dq
    return dq.view(vb.batch, lq, *dq.shape[1:]).sum(0, dtype=torch.float32)


def _packed_grad(ctx, device) -> tuple[torch.Tensor | None, tuple[torch.Tensor | None, ...]]:
    """The packed input's gradient buffer and the (dQ, dK, dV) views of it the kernels write, None where a kernel's
    output cannot go there (no packing; another dtype than the kernels'; dQ summed over a broadcast)."""
    if ctx.packing is None:
        return None, (None, None, None)
    kind, shape, dtype = ctx.packing
    # FA4 writes the input's dtype (BF16 or FP16; FP32 inputs run as BF16), the MXFP8 kernels BF16: else a cast
    if dtype != torch.bfloat16 and not (dtype == torch.float16 and ctx.precision == "bf16"):
        return None, (None, None, None)
    grad = torch.empty(shape, dtype=dtype, device=device)
    views = grad.unbind(1)
    if kind == "qkv":
        return grad, views
    return grad, (None, *views)


class CuteAttention(torch.autograd.Function):
    """O and LSE `[H, T]` of jagged attention on the CuTe kernels, with the recipe's backward. Inputs: q, k, v; or
    with `packed` (`jagged_attention_qkvpacked` / `_kvpacked`), the packed tensor in place of the views it holds
    (qkv, None, None or q, kv, None), whose gradient the backward writes as one tensor."""

    @staticmethod
    def forward(ctx, a, b, c, vb: VarlenBatch, causal: bool, precision: str, scale: float, p_quant: str,
                packing: str | None, impl: str = "cute_sm90"):
        if packing == "qkv":
            q, k, v = a.unbind(1)
        elif packing == "kv":
            q, (k, v) = a, b.unbind(1)
        else:
            q, k, v = a, b, c
        ctx.packing = None if packing is None else (packing, (a if packing == "qkv" else b).shape, q.dtype)

        ctx.impl = impl
        if impl == "cute_sm100":
            out, lse, saved = _sm100_forward(q, k, v, vb, causal=causal, scale=scale, p_quant=p_quant)
            ctx.save_for_backward(*saved, out, lse)
        elif precision == "bf16":
            from flash_attn.cute import interface as fa4

            dt = _kernel_dtype(q)
            # views into a fused projection go to FA4 as they are: it takes token rows at any 16-byte aligned
            # stride (its `maybe_contiguous` copies only what its kernels cannot read)
            q_, k_, v_ = (t.to(dt) for t in (q, k, v))
            out, lse = fa4._flash_attn_fwd(
                _repeat_q(q_, vb), k_, v_, cu_seqlens_q=vb.cu_q, cu_seqlens_k=vb.cu_k, max_seqlen_q=vb.max_q,
                max_seqlen_k=vb.max_k, softmax_scale=scale, causal=causal, return_lse=True)[:2]
            ctx.save_for_backward(q, k, v, out, lse)
        else:
            from gem_lp.attention.cute.launch import mx_forward

            # the same pass packs what the backward quantizes (Q, K square, V hdim) as MX: kept instead of q, k, v
            (qd, kd, vd), packed = mx_operands(
                [(_rows(q), vb.q_offsets, ORIENT_HDIM), (_rows(k), vb.kv_offsets, ORIENT_HDIM),
                 (_rows(v), vb.kv_offsets, ORIENT_SEQ)], pack=[ORIENT_SQUARE, ORIENT_SQUARE, ORIENT_HDIM])
            out, lse = mx_forward(_repeat_q(qd, vb), kd, vd, vb.cu_q, vb.cu_k, causal=causal, scale=scale,
                                  p_quant=p_quant, arch=build_arch(q.device))
            ctx.save_for_backward(*(t for p in packed for t in (p.payload, p.scales)), out, lse)
            ctx.chunk_rows = packed[0].chunk_rows
        ctx.q_rows, ctx.dtypes = q.shape[0], (q.dtype, k.dtype, v.dtype)
        ctx.vb, ctx.causal, ctx.precision, ctx.scale, ctx.p_quant = vb, causal, precision, scale, p_quant
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), lse.t()

    @staticmethod
    def backward(ctx, d_out, d_lse):
        *inputs, out, lse = ctx.saved_tensors
        vb = ctx.vb
        q_dtype, k_dtype, v_dtype = ctx.dtypes
        if d_out is None:
            d_out = torch.zeros(out.shape, dtype=q_dtype, device=out.device)
        d_out = d_out.contiguous()
        dlse = None if d_lse is None else d_lse.t().contiguous()
        grad, (dq_out, dk_out, dv_out) = _packed_grad(ctx, out.device)
        if vb.broadcast_q:
            dq_out = None
        if ctx.impl == "cute_sm100":
            dq, dk, dv = _sm100_backward(inputs, out, lse, d_out, dlse, vb, causal=ctx.causal, scale=ctx.scale,
                                         p_quant=ctx.p_quant, dq=dq_out, dk=dk_out, dv=dv_out)
        elif ctx.precision == "bf16":
            from flash_attn.cute import interface as fa4

            q, k, v = inputs
            dt = _kernel_dtype(q)
            q_, k_, v_ = (t.to(dt) for t in (q, k, v))
            dq, dk, dv = fa4._flash_attn_bwd(
                _repeat_q(q_, vb), k_, v_, out, d_out.to(out.dtype), lse, softmax_scale=ctx.scale, causal=ctx.causal,
                cu_seqlens_q=vb.cu_q, cu_seqlens_k=vb.cu_k, max_seqlen_q=max(vb.max_q, _BWD_MAX_SEQLEN_FLOOR),
                max_seqlen_k=max(vb.max_k, _BWD_MAX_SEQLEN_FLOOR), dlse=dlse, dq=dq_out, dk=dk_out, dv=dv_out)
        else:
            from gem_lp.attention.cute.launch import mx_backward

            qp, kp, vp = (PackedMX(inputs[2 * i], inputs[2 * i + 1], orient, ctx.chunk_rows)
                          for i, orient in enumerate((ORIENT_SQUARE, ORIENT_SQUARE, ORIENT_HDIM)))
            qs, ks, vh, dos = mx_operands([(qp, vb.q_offsets, ORIENT_SQUARE), (kp, vb.kv_offsets, ORIENT_SQUARE),
                                           (vp, vb.kv_offsets, ORIENT_HDIM), (d_out, vb.out_offsets, ORIENT_SQUARE)])
            dq, dk, dv = mx_backward(_repeat_q(qs, vb), ks, vh, dos, out, lse, dlse, vb.cu_q, vb.cu_k,
                                     causal=ctx.causal, scale=ctx.scale, p_quant=ctx.p_quant,
                                     arch=build_arch(out.device), dq=dq_out, dk=dk_out, dv=dv_out)
        dq = _sum_q(dq, vb, ctx.q_rows).to(q_dtype)
        rest = (None,) * 7
        if ctx.packing is None:
            return (dq, dk.to(k_dtype), dv.to(v_dtype)) + rest
        kind = ctx.packing[0]
        if grad is None:  # the kernels' outputs are in another dtype: one cast into the packed gradient
            grad = torch.stack([dq, dk, dv] if kind == "qkv" else [dk, dv], 1).to(ctx.packing[2])
        return (grad, None, None) + rest if kind == "qkv" else (dq, grad, None) + rest


def jagged_attention_cute(q, k, v, vb: VarlenBatch, *, causal: bool, precision: str, scale: float, p_quant: str,
                          packed: tuple[str, torch.Tensor] | None = None, impl: str = "fa4"
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """O `[T_out, H, D]` in q's dtype and LSE `[T_out, H]` FP32 (arguments validated by `jagged_attention`).
    `packed`: None, or ("qkv" | "kv", the tensor q, k, v (or k, v) are `unbind` views of). `impl`: the table's
    implementation (`fa4` for bf16; `cute_sm90` or `cute_sm100` for mxfp8)."""
    if math.prod(q.shape) and q.shape[2] % 8:
        raise ValueError(f"the cute backend needs a head dim that is a multiple of 8, got D={q.shape[2]}")
    if packed is None:
        return CuteAttention.apply(q, k, v, vb, causal, precision, scale, p_quant, None, impl)
    kind, tensor = packed
    if kind == "qkv":
        return CuteAttention.apply(tensor, None, None, vb, causal, precision, scale, p_quant, kind, impl)
    return CuteAttention.apply(q, tensor, None, vb, causal, precision, scale, p_quant, kind, impl)


# ---------------------------------------------------------------------------------------------- sm_100 (Blackwell)
#
# The block-scaled kernels (`fwd_sm100`, `bwd_sm100`) read E4M3 payloads and blocked E8M0 scales in the zero-gather
# layout of `gem_lp.jagged` (payloads at their packed positions, each sequence's scale rows padded to 128): the
# producer is `quantize_jagged` on a `JaggedLayout.bounded` (no host sync: capture-safe). The forward quantizes Q, K
# in `hdim` and V in `seq` for itself, and Q, K in `square` (one payload, both scale forms) and V in `hdim` for the
# backward, from the same read of each; those MX tensors are what the op keeps (no 16-bit q, k, v). The backward
# quantizes dO in `square`. On CPU tensors (the emulated Blackwell plan, `dispatch.emulate("sm_100")`) the kernels
# are replaced by their CPU model (`sm100_model`), the producer runs as on the GPU.

_SAVED_SM100 = ("payload_square", "scale_square_hdim", "scale_square_seq")


def _layout(offsets: torch.Tensor, rows: int, max_len: int, tag: str):
    from gem_lp.jagged.metadata import JaggedLayout

    return cached_plan(offsets, ("jagged layout", tag, rows, max_len),
                       lambda: JaggedLayout.bounded(offsets, rows, max_len))


def _tiles(layout) -> torch.Tensor:
    return cached_plan(layout.offsets, ("scale tiles", layout.padded_total),
                       lambda: (layout.scale_offsets // 128).to(torch.int32))


def _sm100_kernels(device: torch.device):
    """(forward, backward): the block-scaled kernels' launches on a GPU, their CPU model on CPU tensors."""
    if device.type == "cuda":
        from gem_lp.attention.cute import launch

        def forward(q, k, v, scales, cu_q, cu_k, **kw):
            return launch.mx_forward(q, k, v, cu_q, cu_k, arch=build_arch(device), scales=scales, **kw)

        def backward(q, k, v, do, do_values, out, lse, dlse, scales, cu_q, cu_k, **kw):
            return launch.mx_backward(q, k, v, do, out, lse, dlse, cu_q, cu_k, arch=build_arch(device),
                                      scales=scales, do_values=do_values, **kw)

        return forward, backward
    from gem_lp.attention.cute import sm100_model

    return sm100_model.forward, sm100_model.backward


def _sm100_forward(q, k, v, vb: VarlenBatch, *, causal: bool, scale: float, p_quant: str):
    from gem_lp.attention.cute.sm100_operands import MXScales
    from gem_lp.jagged.ops import quantize_jagged

    q = _repeat_q(q, vb)
    lq, lk = _layout(vb.out_offsets, q.shape[0], vb.max_q, "q"), _layout(vb.kv_offsets, k.shape[0], vb.max_k, "kv")
    qj = quantize_jagged(q, lq, ("hdim", "square"))
    kj = quantize_jagged(k, lk, ("hdim", "square"))
    vj = quantize_jagged(v, lk, ("seq", "hdim"))
    scales = MXScales(qj.scale_hdim, kj.scale_hdim, vj.scale_seq, _tiles(lq), _tiles(lk))
    forward, _ = _sm100_kernels(q.device)
    out, lse = forward(qj.payload_hdim, kj.payload_hdim, vj.payload_seq, scales, vb.cu_q, vb.cu_k, causal=causal,
                       scale=scale, p_quant=p_quant)
    saved = [getattr(j, n) for j in (qj, kj) for n in _SAVED_SM100] + [vj.payload_hdim, vj.scale_hdim]
    return out, lse, saved


def _sm100_backward(saved, out, lse, d_out, dlse, vb: VarlenBatch, *, causal: bool, scale: float, p_quant: str,
                    dq=None, dk=None, dv=None):
    from gem_lp.attention.cute.sm100_operands import MXBwdScales
    from gem_lp.jagged.ops import quantize_jagged
    from gem_lp.jagged.tensor import dequantize_jagged

    q_sq, q_sq_h, q_sq_s, k_sq, k_sq_h, k_sq_s, v_h, v_h_s = saved
    lq = _layout(vb.out_offsets, out.shape[0], vb.max_q, "q")
    lk = _layout(vb.kv_offsets, k_sq.shape[0], vb.max_k, "kv")
    doj = quantize_jagged(d_out, lq, ("square",))
    # Δ = rowsum(dO ⊙ O) from the dO the gradient GEMMs use: its MX values (exact in BF16)
    do_values = dequantize_jagged(doj, "square").to(torch.bfloat16)
    scales = MXBwdScales(q_sq_h, q_sq_s, k_sq_h, k_sq_s, v_h_s, doj.scale_square_hdim, doj.scale_square_seq,
                         _tiles(lq), _tiles(lk))
    _, backward = _sm100_kernels(out.device)
    return backward(q_sq, k_sq, v_h, doj.payload_square, do_values, out, lse, dlse, scales, vb.cu_q, vb.cu_k,
                    causal=causal, scale=scale, p_quant=p_quant, dq=dq, dk=dk, dv=dv)
