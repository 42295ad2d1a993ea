"""The slow oracle: jagged attention as a Python loop over sequences with plain autograd.

Independent of the chunked reference (no padding, no custom backward); tests compare both to it.
"""
from __future__ import annotations

import math

import torch


def naive_jagged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor | None,
                           kv_offsets: torch.Tensor | None, *, causal: bool = False, broadcast_q: bool = False,
                           softmax_scale: float | None = None, dtype: torch.dtype = torch.float32
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """O `[T_out, H, D]` and LSE `[T_out, H]`, both in `dtype` (FP32 or FP64), differentiable.

    Same semantics as `jagged_attention` (causal bottom-right aligned, no visible key -> O 0 and
    LSE -inf); offsets are trusted.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    kv_offsets = q_offsets if kv_offsets is None else kv_offsets
    kv = kv_offsets.tolist()
    outs, lses = [], []
    for b in range(len(kv) - 1):
        if broadcast_q:
            qb = q
        else:
            qb = q[q_offsets[b]:q_offsets[b + 1]]
        kb, vb = k[kv[b]:kv[b + 1]], v[kv[b]:kv[b + 1]]
        lq, lk = qb.shape[0], kb.shape[0]
        s = torch.einsum("ihd,jhd->hij", qb.to(dtype), kb.to(dtype)) * scale
        visible = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if causal:
            visible = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lq, device=q.device)[:, None] + lk - lq
        s = s.masked_fill(~visible, -math.inf)
        # rows with no visible key are computed on zeros and then replaced (no NaN, no NaN gradient)
        has_key = visible.any(-1)[None, :, None]
        s = torch.where(has_key, s, 0.0)
        lse = torch.where(has_key[..., 0], torch.logsumexp(s, dim=-1), -math.inf)  # [H, Lq]
        p = torch.where(has_key, torch.softmax(s, -1), 0.0)
        outs.append(torch.einsum("hij,jhd->ihd", p, vb.to(dtype)))
        lses.append(lse.transpose(0, 1))
    heads, dim = q.shape[1], q.shape[2]
    if not outs:
        return q.new_zeros(0, heads, dim, dtype=dtype), q.new_zeros(0, heads, dtype=dtype)
    return torch.cat(outs), torch.cat(lses)
