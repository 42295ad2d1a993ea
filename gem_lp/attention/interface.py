"""`jagged_attention`: argument checks and backend dispatch of jagged (variable-length) attention."""
from __future__ import annotations

import math

import torch

from gem_lp.runtime import dispatch
from gem_lp.mx.formats import BLOCK
from gem_lp.attention.layout import check_offsets, check_offsets_form, check_qkv, make_plan
from gem_lp.attention.plan import cached_plan
from gem_lp.attention.reference import DQ_ACCUMS, P_QUANTS, PRECISIONS, MXRecipe, attention_reference
from gem_lp.rotation import check_qk_rotation, rotate_qk

def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, precision: str) -> None:
    check_qkv(q, k, v)
    dim = q.shape[2]
    if precision == "mxfp8" and dim % BLOCK != 0:
        raise ValueError(f"precision='mxfp8' needs a head dim that is a multiple of {BLOCK} (64 or 128 for the "
                         f"kernels), got D={dim}")


def _checked(offsets: torch.Tensor, name: str, total: int) -> torch.Tensor:
    """`check_offsets` once per offsets tensor (and version) and token count: its copy to the CPU is a host sync,
    and every attention layer of a step passes the same offsets (see `plan.cached_plan`). The check does not
    depend on `name` (only its error message does), so offsets passed as `q_offsets` to one layer and as
    `kv_offsets` to the next are checked once."""
    check_offsets_form(offsets, name)
    return cached_plan(offsets, ("checked", total), lambda: check_offsets(offsets, name, total))


def _bound(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be None or a non-negative int, got {value!r}")
    return value


def _trusted_offsets(q: torch.Tensor, k_rows: int, q_offsets, kv_offsets, broadcast_q: bool, max_seqlen_q,
                     max_seqlen_k) -> bool:
    """Whether the call takes its offsets unchecked (see `jagged_attention`'s `max_seqlen_q`); checks what needs
    no host sync: the bounds, the offsets' form and device, and q_offsets against kv_offsets in length."""
    if max_seqlen_q is not None:
        _bound(max_seqlen_q, "max_seqlen_q")
    if max_seqlen_k is None:
        if max_seqlen_q is not None:
            raise ValueError("max_seqlen_q needs max_seqlen_k as well (the bounds let the offsets go unchecked)")
        return False
    _bound(max_seqlen_k, "max_seqlen_k")
    if broadcast_q:
        if kv_offsets is None or q_offsets is not None:
            raise ValueError("with broadcast_q=True and max_seqlen_k, pass kv_offsets and q_offsets=None")
        given = (("kv_offsets", kv_offsets),)
    else:
        if max_seqlen_q is None:
            raise ValueError("max_seqlen_k without max_seqlen_q: give both (or neither) unless broadcast_q=True")
        if q_offsets is None:
            raise ValueError("q_offsets is required unless broadcast_q=True")
        given = (("q_offsets", q_offsets),) + ((("kv_offsets", kv_offsets),) if kv_offsets is not None else ())
    for name, offs in given:
        check_offsets_form(offs, name)
        if offs.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device} when max_seqlen_k is given (offsets taken "
                             f"unchecked stay on the device), got {offs.device}")
    if len(given) == 2 and q_offsets.shape != kv_offsets.shape:
        raise ValueError(f"q_offsets and kv_offsets must describe the same number of sequences, got "
                         f"B={q_offsets.numel() - 1} and B={kv_offsets.numel() - 1}")
    if not broadcast_q and kv_offsets is None and k_rows != q.shape[0]:
        raise ValueError(f"kv_offsets=None means self-attention: k must have Tq={q.shape[0]} rows, got {k_rows}")
    return True


def jagged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor | None,
                     kv_offsets: torch.Tensor | None = None, *, causal: bool = False, broadcast_q: bool = False,
                     precision: str = "bf16", backend: str = "auto", softmax_scale: float | None = None,
                     p_quant: str = "const_p", return_lse: bool = False, qk_rotation: str | None = None,
                     max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, dq_accum: str = "fp32"
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over jagged (variable-length) sequences, differentiable.

    Args:
        q: `[Tq, H, D]` queries; with `broadcast_q`, `[Lq, H, D]`: one query sequence shared by every
            sequence of the batch (e.g. learned query tokens). bfloat16, float16 or float32.
        k, v: `[Tk, H, D]`, q's dtype and device.
        q_offsets: `[B+1]` int32/int64 offsets into q (start 0, non-decreasing, end Tq); with
            `broadcast_q`, None or `[0, Lq]`.
        kv_offsets: `[B+1]` offsets into k/v; None means `q_offsets` (self-attention); required with
            `broadcast_q`. Sequence b's queries attend over sequence b's keys only.
        causal: query i of a sequence sees keys j <= i + (Lk - Lq) (bottom-right aligned).
        broadcast_q: see q; output row `b * Lq + i` is query i against sequence b; dq sums over b.
        precision: `"fp32"` (the oracle), `"bf16"` (a 16-bit flash kernel's rounding) or `"mxfp8"`
            (LP-FA4 recipe; D a multiple of 32).
        backend: `"auto"` (the table's, `gem_lp.runtime.dispatch`: FA4 for bf16 and the recipe's kernels for mxfp8
            on sm_90 / sm_100 when the CuTe DSL stack imports, the reference elsewhere), `"reference"` or `"cute"`.
        softmax_scale: defaults to `1/sqrt(D)`.
        p_quant: `"const_p"` or `"dynamic"` (how `mxfp8` quantizes P).
        return_lse: also return LSE.
        qk_rotation: None, or `"hadamard"`: q and k are multiplied by an orthonormal Walsh-Hadamard matrix over
            the head dim (D a power of two) before any backend runs. Q K^T is unchanged in exact arithmetic and
            outlier channels are spread over all channels, which keeps `mxfp8` accurate on them
            (docs/numerics.md); dq and dk are rotated back by autograd.
        max_seqlen_q, max_seqlen_k: bounds on the sequence lengths of q (unused with broadcast_q) and of k/v. With
            `max_seqlen_k` (and `max_seqlen_q` unless broadcast_q) given and the offsets on q's device, the kernel
            backends take the offsets as they are, the way flash-attn's varlen functions take theirs: never copied
            to the host nor checked there, so the call makes no host sync and can be captured in a CUDA graph.
            The caller then guarantees what the check would: offsets start at 0, do not decrease, end at the row
            count, and no sequence is longer than its bound. The reference backend checks them anyway.
        dq_accum: `"fp32"` (the default: FA4's FP32 dQ accumulator), or `"fp16"` (`mxfp8` only): dQ summed over
            the key tiles in FP16 with a static power-of-two scale, the LP-FA4 throughput option
            (docs/numerics.md); an overflow of that scale raises `DQAccumulatorOverflow`. No GPU kernel accumulates
            in FP16 yet: it runs the reference recipe (a warning says so once; `backend="cute"` is an error).

    Returns:
        O `[T_out, H, D]` in q's dtype (`T_out` = Tq, or B * Lq with broadcast_q); a query with no
        visible key gives 0. With `return_lse`, also LSE `[T_out, H]` float32, natural log, -inf for
        a query with no visible key.
    """
    return _attention(q, k, v, q_offsets, kv_offsets, None, causal=causal, broadcast_q=broadcast_q,
                      precision=precision, backend=backend, softmax_scale=softmax_scale, p_quant=p_quant,
                      return_lse=return_lse, qk_rotation=qk_rotation, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k, dq_accum=dq_accum)


def _unpacked(packed: torch.Tensor, name: str, parts: int) -> tuple[torch.Tensor, ...]:
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [T, {parts}, H, D], got {type(packed).__name__}")
    if packed.dim() != 4 or packed.shape[1] != parts:
        raise ValueError(f"{name} must be 4-D [T, {parts}, H, D], got shape {tuple(packed.shape)}")
    return packed.unbind(1)


def jagged_attention_qkvpacked(qkv: torch.Tensor, offsets: torch.Tensor, *, causal: bool = False,
                               precision: str = "bf16", backend: str = "auto", softmax_scale: float | None = None,
                               p_quant: str = "const_p", return_lse: bool = False, qk_rotation: str | None = None,
                               max_seqlen: int | None = None, dq_accum: str = "fp32"
                               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Jagged self-attention on q, k, v packed in one tensor `qkv [T, 3, H, D]` (a fused projection's output):
    `jagged_attention(*qkv.unbind(1), offsets, ...)`, whose gradient is one `[T, 3, H, D]` tensor. The kernel
    backends write dQ, dK and dV into it in place; through `unbind` they would be three tensors that autograd then
    copies into one. `max_seqlen`: the bound on the sequence lengths (both of `jagged_attention`'s)."""
    q, k, v = _unpacked(qkv, "qkv", 3)
    return _attention(q, k, v, offsets, None, ("qkv", qkv), causal=causal, broadcast_q=False, precision=precision,
                      backend=backend, softmax_scale=softmax_scale, p_quant=p_quant, return_lse=return_lse,
                      qk_rotation=qk_rotation, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, dq_accum=dq_accum)


def jagged_attention_kvpacked(q: torch.Tensor, kv: torch.Tensor, q_offsets: torch.Tensor | None,
                              kv_offsets: torch.Tensor, *, causal: bool = False, broadcast_q: bool = False,
                              precision: str = "bf16", backend: str = "auto", softmax_scale: float | None = None,
                              p_quant: str = "const_p", return_lse: bool = False, qk_rotation: str | None = None,
                              max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                              dq_accum: str = "fp32") -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`jagged_attention(q, *kv.unbind(1), q_offsets, kv_offsets, ...)` on keys and values packed in one tensor
    `kv [Tk, 2, H, D]`, whose gradient is one `[Tk, 2, H, D]` tensor written in place by the kernel backends (see
    `jagged_attention_qkvpacked`). kv_offsets is required."""
    k, v = _unpacked(kv, "kv", 2)
    if kv_offsets is None:
        raise ValueError("kv_offsets is required by jagged_attention_kvpacked (q and kv are separate sequences)")
    return _attention(q, k, v, q_offsets, kv_offsets, ("kv", kv), causal=causal, broadcast_q=broadcast_q,
                      precision=precision, backend=backend, softmax_scale=softmax_scale, p_quant=p_quant,
                      return_lse=return_lse, qk_rotation=qk_rotation, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k, dq_accum=dq_accum)


def _attention(q, k, v, q_offsets, kv_offsets, packed, *, causal, broadcast_q, precision, backend, softmax_scale,
               p_quant, return_lse, qk_rotation, max_seqlen_q, max_seqlen_k, dq_accum="fp32"):
    """`jagged_attention`; `packed`: None, or ("qkv" | "kv", the tensor q, k, v (or k, v) are `unbind` views of)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if p_quant not in P_QUANTS:
        raise ValueError(f"p_quant must be one of {P_QUANTS}, got {p_quant!r}")
    if dq_accum not in DQ_ACCUMS:
        raise ValueError(f"dq_accum must be one of {DQ_ACCUMS}, got {dq_accum!r}")
    if dq_accum != "fp32" and precision != "mxfp8":
        raise ValueError(f"dq_accum={dq_accum!r} is an option of precision='mxfp8', got precision={precision!r}")
    _check_qkv(q, k, v, precision)
    heads, dim = q.shape[1], q.shape[2]
    check_qk_rotation(qk_rotation, dim)
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(dim)
    elif isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0:
        scale = float(softmax_scale)
    else:
        raise ValueError(f"softmax_scale must be None or a positive finite number, got {softmax_scale!r}")

    trusted = _trusted_offsets(q, k.shape[0], q_offsets, kv_offsets, broadcast_q, max_seqlen_q, max_seqlen_k)
    if trusted:
        q_offs = kv_offs = None
    elif broadcast_q:
        if kv_offsets is None:
            raise ValueError("kv_offsets is required with broadcast_q=True (q is one shared query sequence)")
        if q_offsets is not None:
            q_offs = _checked(q_offsets, "q_offsets", q.shape[0])
            if q_offs.numel() != 2:
                raise ValueError(f"q_offsets must be None or [0, Lq] with broadcast_q=True, got {q_offs.tolist()}")
        kv_offs = _checked(kv_offsets, "kv_offsets", k.shape[0])
        q_offs = None
    else:
        if q_offsets is None:
            raise ValueError("q_offsets is required unless broadcast_q=True")
        q_offs = _checked(q_offsets, "q_offsets", q.shape[0])
        kv_offs = q_offs if kv_offsets is None else _checked(kv_offsets, "kv_offsets", k.shape[0])
        if kv_offs.numel() != q_offs.numel():
            raise ValueError(f"q_offsets and kv_offsets must describe the same number of sequences, got "
                             f"B={q_offs.numel() - 1} and B={kv_offs.numel() - 1}")
        if kv_offsets is None and k.shape[0] != q.shape[0]:
            raise ValueError(f"kv_offsets=None means self-attention: k must have Tq={q.shape[0]} rows, got {k.shape[0]}")
    for name, offs in (("q_offsets", q_offsets), ("kv_offsets", kv_offsets)):
        if offs is not None and offs.device.type != "cpu" and offs.device != q.device:
            raise ValueError(f"{name} must be on the CPU or on q's device {q.device}, got {offs.device}")

    if qk_rotation is not None:
        packed = None  # rotated q and k are new tensors, no longer views of the packed one
    q, k = rotate_qk(q, k, qk_rotation)  # before dispatch, so that every backend gets it
    impl = dispatch.choose("attention", precision, q.device, backend)
    if impl != dispatch.REFERENCE and dq_accum == "fp16":
        why = "no kernel accumulates dQ in FP16 (their backward keeps FA4's FP32 dQ accumulator)"
        if backend == "cute":
            raise ValueError(f"backend='cute' cannot run dq_accum='fp16': {why}")
        dispatch.warn_once("attention", precision, q.device, f"with dq_accum='fp16' runs the reference: {why}")
        impl = dispatch.REFERENCE
    if impl != dispatch.REFERENCE and precision == "mxfp8":
        from gem_lp.attention.cute.config import HEAD_DIMS

        if dim not in HEAD_DIMS:
            why = f"the MXFP8 kernels take head dims {HEAD_DIMS}, got D={dim}"
            if backend == "cute":
                raise ValueError(f"backend='cute' cannot run precision='mxfp8': {why}")
            dispatch.warn_once("attention", precision, q.device, f"{why}: the reference runs instead")
            impl = dispatch.REFERENCE
    if impl != dispatch.REFERENCE:
        from gem_lp.attention.cute.interface import jagged_attention_cute, varlen_batch

        vb = varlen_batch(q_offsets, kv_offsets, q_offs, kv_offs, broadcast_q=broadcast_q, q_rows=q.shape[0],
                          device=q.device, max_lengths=(max_seqlen_q, max_seqlen_k) if trusted else None)
        out, lse = jagged_attention_cute(q, k, v, vb, causal=causal, precision=precision, scale=scale,
                                         p_quant=p_quant, packed=packed, impl=impl)
        return (out, lse) if return_lse else out
    if trusted:  # the reference builds its plan on the host: it checks them as it would untrusted offsets
        q_offs = None if broadcast_q else _checked(q_offsets, "q_offsets", q.shape[0])
        kv_offs = _checked(kv_offsets if kv_offsets is not None else q_offsets, "kv_offsets", k.shape[0])
    plan = make_plan(q_offs, kv_offs, broadcast_q=broadcast_q, q_len=q.shape[0], heads=heads)
    recipe = MXRecipe(p_quant=p_quant, dq_accum=dq_accum) if precision == "mxfp8" else None
    out, lse = attention_reference(q, k, v, plan, causal=causal, precision=precision, scale=scale, p_quant=p_quant,
                                   recipe=recipe)
    return (out, lse) if return_lse else out
