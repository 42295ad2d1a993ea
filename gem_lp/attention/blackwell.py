"""Blackwell (sm_100) path of the MXFP8 attention forward: both GEMMs as block-scaled MMAs (`tl.dot_scaled`).

Status: compile-checked, not run on Blackwell. No Blackwell GPU is available to this project; the test
`tests/attention/test_blackwell_ptx.py` compiles the kernel for `GPUTarget("cuda", 100, 32)` on a CPU
machine and checks that the PTX holds the native block-scaled MMA
(`tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale`). On Hopper, Triton decomposes `tl.dot_scaled`
into a BF16 upcast and a BF16 MMA, so the same kernel also runs on the H200 (a GPU test compares it
with the default kernel there; Triton releases before the fix of September 2026 decode E8M0 byte 0 as 0
and byte 255 as a number in that decomposition: blocks whose amax is below ~2^-118, or NaN, differ).

The recipe maps onto the MX MMA as it stands, with no conversion of stored operands:

* S = Q K^T: Q, K payloads E4M3 with `hdim` scales (1x32 along D, the contraction axis);
* O += P V: P rounded in registers to E4M3 with its scale per row per 32 kv columns (`dynamic`: the rceil
  rule on the block max; `const_p`: payload e4m3(256 p), byte 119 = 2^-8), V payload with `seq` scales
  (32 tokens x 1 feature: along the contraction axis, per output column).

Operands come from `gem_lp.jagged.quantize_jagged` (payloads at their packed positions, per-sequence
padded scales in the 128x4 blocked layout), read directly by the kernel. Scheduling, masking and the
online softmax are those of `triton_attention._attn_fwd_kernel`.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from ..mx.triton_numerics import encode, scale_byte
from .triton_attention import (
    LOG2E,
    P_QUANTS,
    _fwd_tiles,
    _Geometry,
    _hdim_scale_offset,
    _seq_scale_offset,
    sequence_bounds,
)

BLACKWELL_TARGET = GPUTarget("cuda", 100, 32)
# the native MX MMA in the PTX (a block-scaled tcgen05.mma over E4M3/E5M2/E2M3/E3M2/E2M1 operands)
BLOCK_SCALED_MMA = "tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale"
CONST_P_SCALE_BYTE = 119  # 2^-8


@triton.jit
def _load_hdim_operand(pay_ptr, s_ptr, tok, srow, mask, h, H, s_head_bytes, D: tl.constexpr):
    """E4M3 payload `[R, D]` and E8M0 bytes `[R, D/32]` of an hdim-quantized jagged tensor."""
    d = tl.arange(0, D)
    pay = tl.load(pay_ptr + (tok[:, None] * H + h) * D + d[None, :], mask=mask[:, None], other=0)
    c = tl.arange(0, D // 32)
    byte = tl.load(s_ptr + h * s_head_bytes + _hdim_scale_offset(srow[:, None], c[None, :], (D // 32 + 3) // 4),
                   mask=mask[:, None], other=0)
    return pay.to(tl.float8e4nv, bitcast=True), byte


@triton.jit
def _attn_fwd_scaled_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr,
    q_base_ptr, o_offsets_ptr, kv_offsets_ptr, q_srow_ptr, kv_srow_ptr, tile_seq_ptr, tile_idx_ptr,
    H, qk_scale, q_scale_head, k_scale_head, v_scale_head, v_num_tiles,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, P_QUANT: tl.constexpr,
):
    """One BM-query tile of one sequence and head, both GEMMs block-scaled (P_QUANT: 1 const_p, 2 dynamic)."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(tile_seq_ptr + pid)
    if b < 0:
        return
    qt = tl.load(tile_idx_ptr + pid)
    o_row0, Lq, kv_row0, Lk = sequence_bounds(o_offsets_ptr, kv_offsets_ptr, b)
    kv_srow0 = tl.load(kv_srow_ptr + b)
    shift = Lk - Lq
    offs_m = qt * BM + tl.arange(0, BM)
    m_mask = offs_m < Lq
    d = tl.arange(0, D)
    q, q_byte = _load_hdim_operand(q_ptr, q_scale_ptr, tl.load(q_base_ptr + b) + offs_m,
                                   tl.load(q_srow_ptr + b) + offs_m, m_mask, h, H, q_scale_head, D)
    if CAUSAL:
        end = tl.minimum(tl.maximum(tl.minimum(qt * BM + BM, Lq) + shift, 0), Lk)
    else:
        end = Lk
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    for start_n in tl.range(0, end, BN):
        offs_n = start_n + tl.arange(0, BN)
        n_mask = offs_n < Lk
        tok = kv_row0 + offs_n
        k, k_byte = _load_hdim_operand(k_ptr, k_scale_ptr, tok, kv_srow0 + offs_n, n_mask, h, H, k_scale_head, D)
        visible = tl.broadcast_to(n_mask[None, :], [BM, BN])
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + shift)
        # The mask enters as the MMA's initial accumulator (0 or -inf): Triton 3.6's sm_100 pipeline fails
        # on a zero-initialized dot_scaled accumulator in this loop ('uninitialized alloc' in tmem).
        s = tl.dot_scaled(q, q_byte, "e4m3", tl.trans(k), k_byte, "e4m3",
                          acc=tl.where(visible, 0.0, float("-inf")))
        s = s * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # P to E4M3 with one E8M0 byte per row per 32 kv columns
        pb = tl.reshape(p, [BM, BN // 32, 32])
        if P_QUANT == 1:
            p_byte = tl.full([BM, BN // 32], 119, dtype=tl.int32)
        else:
            p_byte = scale_byte(tl.max(pb.to(tl.int32, bitcast=True), axis=2), True)  # p >= 0: bits order as p
        p_pay = tl.reshape(encode(pb, p_byte[:, :, None], True), [BM, BN]).to(tl.float8e4nv, bitcast=True)
        # V: payload [BN, D], seq scales per (feature, 32-token block) -> [D, BN/32]
        v = tl.load(v_ptr + (tok[:, None] * H + h) * D + d[None, :], mask=n_mask[:, None], other=0)
        col = (kv_srow0 + start_n) // 32 + tl.arange(0, BN // 32)
        v_byte = tl.load(v_scale_ptr + h * v_scale_head + _seq_scale_offset(d[:, None], col[None, :], v_num_tiles),
                         mask=(start_n + tl.arange(0, BN // 32) * 32 < Lk)[None, :], other=0)
        acc = acc * alpha[:, None]
        acc = tl.dot_scaled(p_pay, p_byte.to(tl.uint8), "e4m3", v.to(tl.float8e4nv, bitcast=True), v_byte, "e4m3",
                            acc=acc)
        m_i = m_new
    empty = l_i == 0.0
    denom = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(denom)) * 0.6931471805599453)
    o = acc / denom[:, None]
    o_tok = o_row0 + offs_m
    tl.store(o_ptr + (o_tok[:, None] * H + h) * D + d[None, :], o.to(o_ptr.dtype.element_ty), mask=m_mask[:, None])
    tl.store(lse_ptr + o_tok * H + h, lse, mask=m_mask)


def compile_for_blackwell(head_dim: int = 128, *, p_quant: str = "dynamic", causal: bool = True,
                          block_m: int = 128, block_n: int = 128, num_warps: int = 8, num_stages: int = 2,
                          out_dtype: str = "bf16"):
    """Compile `_attn_fwd_scaled_kernel` for sm_100 (works on a CPU-only machine); returns the CompiledKernel.

    `.asm["ptx"]` holds the PTX (look for `BLOCK_SCALED_MMA`), `.asm["cubin"]` the machine code.
    """
    if head_dim not in (64, 128):
        raise ValueError(f"head_dim must be 64 or 128, got {head_dim}")
    if p_quant not in P_QUANTS:
        raise ValueError(f"p_quant must be one of {P_QUANTS}, got {p_quant!r}")
    if not isinstance(_attn_fwd_scaled_kernel, triton.runtime.JITFunction):
        raise RuntimeError("Triton kernels are interpreted in this process (TRITON_INTERPRET=1 was set before "
                           "import): compile for sm_100 in a process without it")
    ptr = {"q_ptr": "*u8", "k_ptr": "*u8", "v_ptr": "*u8", "o_ptr": f"*{out_dtype}", "lse_ptr": "*fp32",
           "q_scale_ptr": "*u8", "k_scale_ptr": "*u8", "v_scale_ptr": "*u8"}
    idx = {name: "*i64" for name in ("q_base_ptr", "o_offsets_ptr", "kv_offsets_ptr", "q_srow_ptr", "kv_srow_ptr")}
    tiles = {"tile_seq_ptr": "*i32", "tile_idx_ptr": "*i32"}
    scalars = {"H": "i32", "qk_scale": "fp32", "q_scale_head": "i32", "k_scale_head": "i32", "v_scale_head": "i32",
               "v_num_tiles": "i32"}
    constexprs = {"D": head_dim, "BM": block_m, "BN": block_n, "CAUSAL": causal,
                  "P_QUANT": 1 if p_quant == "const_p" else 2}
    src = triton.compiler.ASTSource(fn=_attn_fwd_scaled_kernel, signature={**ptr, **idx, **tiles, **scalars},
                                    constexprs=constexprs)
    return triton.compile(src, target=BLACKWELL_TARGET, options={"num_warps": num_warps, "num_stages": num_stages})


def attention_forward_scaled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor | None,
                             kv_offsets: torch.Tensor, *, causal: bool = False, broadcast_q: bool = False,
                             softmax_scale: float | None = None, p_quant: str = "const_p",
                             block_m: int = 128, block_n: int = 64, num_warps: int = 8, num_stages: int = 2
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 forward (O in q's dtype, LSE FP32) with block-scaled MMAs; CUDA only (native on sm_100,
    decomposed to BF16 MMAs on sm_90). Inputs as for `triton_attention.attention_forward`."""
    from ..jagged import JaggedLayout, quantize_jagged

    if not q.is_cuda:
        raise ValueError(f"attention_forward_scaled needs CUDA tensors (tl.dot_scaled does not run in Triton's "
                         f"interpreter), got {q.device}")
    g = _Geometry(q, k, q_offsets, kv_offsets, broadcast_q)
    heads, dim = q.shape[1], q.shape[2]
    out = torch.empty(g.num_out, heads, dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(g.num_out, heads, dtype=torch.float32, device=q.device)
    if g.num_out == 0 or g.batch == 0:
        return out, lse
    scale = 1.0 / math.sqrt(dim) if softmax_scale is None else float(softmax_scale)
    q_layout = JaggedLayout.from_offsets(g.q_offsets, q)
    kv_layout = JaggedLayout.from_offsets(g.kv_offsets, k)
    qj = quantize_jagged(q, q_layout, ("hdim",))
    kj = quantize_jagged(k, kv_layout, ("hdim",))
    vj = quantize_jagged(v, kv_layout, ("seq",))
    q_srow = (torch.zeros(g.batch, dtype=torch.int64, device=q.device) if broadcast_q
              else q_layout.scale_offsets[:-1].contiguous())
    tile_seq, tile_idx, upper = _fwd_tiles(g, block_m, causal)
    _attn_fwd_scaled_kernel[(upper, heads)](
        qj.payload_hdim.view(torch.uint8), kj.payload_hdim.view(torch.uint8), vj.payload_seq.view(torch.uint8),
        out, lse, qj.scale_hdim, kj.scale_hdim, vj.scale_seq,
        g.q_base, g.o_offsets, g.kv_offsets, q_srow, kv_layout.scale_offsets[:-1].contiguous(), tile_seq, tile_idx,
        heads, scale * LOG2E, qj.scale_hdim.shape[1], kj.scale_hdim.shape[1], vj.scale_seq.shape[1],
        kv_layout.num_tiles,
        D=dim, BM=block_m, BN=block_n, CAUSAL=causal, P_QUANT=1 if p_quant == "const_p" else 2,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out, lse
