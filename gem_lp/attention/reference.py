"""Reference jagged attention: FP32 math with rounding exactly at each recipe's quantization points.

Three recipes (docs/numerics.md), one autograd Function that saves Q, K, V, O and LSE and recomputes P in the
backward (so memory stays that of a flash kernel's inputs and outputs plus one chunk of scores):

* `fp32`:  plain FP32 math (FP64 when the inputs are FP64, for gradcheck); the accuracy oracle.
* `bf16`:  what a BF16 flash kernel does. Operands in the 16-bit input dtype (FP32 inputs are rounded to
  BF16); S, softmax, l, O/l in FP32; P rounded to the operand dtype before P.V; backward rounds P and dS
  to the operand dtype before their GEMMs.
* `mxfp8`: the LP-FA4 recipe. Forward: Q, K `hdim` (1x32 along D), V `seq` (32 tokens x 1 feature);
  P as E4M3, `const_p` (payload e4m3(256 p), scale 2^-8) or `dynamic` (1x32 along kv, rceil), where
  p = exp2(t - m'), t = S * fp32(scale log2 e), and the row max m' = ceil(max t) is snapped up to an integer:
  an online kernel's p against its running max then differs from this p by an exact power of two, which the
  E4M3 rounding commutes with, so kernels round exactly the values this reference rounds. O is normalized by
  the row sum of the rounded P (weights summing to one; a query that sees one key gets its value exactly),
  LSE = m' ln 2 + ln(sum p) by the unrounded one.
  Backward: Q, K, dO in `square` 32x32 blocks, V `hdim` for dP, P recomputed from the square operands
  and LSE, Δ = rowsum(dO * O) from the quantized dO that dP uses, dS (and P for dV when `dynamic`)
  quantized in 32x32 blocks, dQ summed over 128-key tiles in FP32 (or, as an option, in FP16 under a static
  power-of-two scale). `MXRecipe` names these points; the error budget moves them.

Every GEMM takes exactly dequantized (or 16-bit) operands and accumulates in FP32 (autocast is switched
off inside; on CUDA keep `torch.backends.cuda.matmul.allow_tf32` off for the `fp32` oracle, the other two
recipes' operands are exact in TF32). Tensors inside a chunk are `[Bc, H, P, D]` padded per sequence start
(see layout.py), masks `[Bc, 1, Pq, Pk]`.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from gem_lp.mx.reference import dequantize, encode_payload, quantize_reference
from gem_lp.attention.layout import JaggedPlan, chunk_rows, visibility_mask

PRECISIONS = ("fp32", "bf16", "mxfp8")
P_QUANTS = ("const_p", "dynamic")
LOG2E = 1.4426950408889634
# const_p: P is stored as e4m3(256 * p) with the fixed scale 2^-8, i.e. E8M0 byte 127 - 8.
CONST_P_SCALE_BYTE = 119
CONST_P_SCALE = 2.0**-8


# ----------------------------------------------------------------------------- quantization points


def mx_hdim(x: torch.Tensor) -> torch.Tensor:
    """Dequantized 1x32 blocks along the last dim (features) of `[..., P, D]`, FP32."""
    return dequantize(quantize_reference(x, axis=-1))


def mx_seq(x: torch.Tensor) -> torch.Tensor:
    """Dequantized 32x1 blocks along the token dim of `[..., P, D]` (P a multiple of 32, padded per sequence)."""
    return dequantize(quantize_reference(x, axis=-2))


def mx_square(x: torch.Tensor) -> torch.Tensor:
    """Dequantized 32x32 blocks over the last two dims, FP32."""
    return dequantize(quantize_reference(x, block="square"))


def const_p(p: torch.Tensor) -> torch.Tensor:
    """p in [0, 1] through E4M3 with the fixed scale 2^-8: fp32(e4m3(256 p)) * 2^-8."""
    byte = torch.full((), CONST_P_SCALE_BYTE, dtype=torch.uint8, device=p.device)
    return encode_payload(p, byte).to(torch.float32) * CONST_P_SCALE


def quantize_p_forward(p: torch.Tensor, p_quant: str) -> torch.Tensor:
    """P of the forward P.V GEMM: `const_p`, or `dynamic` 1x32 blocks along kv (rceil)."""
    return const_p(p) if p_quant == "const_p" else mx_hdim(p)


def quantize_p_backward(p: torch.Tensor, p_quant: str) -> torch.Tensor:
    """P of the backward dV = P^T dO GEMM: `const_p`, or `dynamic` 32x32 blocks."""
    return const_p(p) if p_quant == "const_p" else mx_square(p)


# ----------------------------------------------------------------------------- the dQ accumulator

DQ_ACCUMS = ("fp32", "fp16")
# LP-FA4's static scale of its FP16 dQ accumulator
DQ_FP16_SCALE_LOG2 = 12
# dQ's accumulator sums key tiles of this many keys, from each sequence's first key (the kernels' tile_n)
DQ_KEY_TILE = 128
FP16_MAX = 65504.0


class DQAccumulatorOverflow(ValueError):
    """A dQ key tile or running sum times 2^dq_scale_log2 is beyond FP16's range: `worst` the |dQ| reached, `limit`
    the largest |dQ| the accumulator holds at that scale."""

    def __init__(self, message: str, worst: float, limit: float):
        super().__init__(message)
        self.worst, self.limit = worst, limit


def accumulate_dq(acc: torch.Tensor, partial: torch.Tensor, softmax_scale: float, dq_accum: str,
                  scale_log2: int) -> torch.Tensor:
    """One key tile's dQ contribution `partial` (the FP32 product dS_n K_n) added into the accumulator `acc`
    (`MXRecipe.dq_accum`). `fp32`: acc + partial (FP32; the softmax scale comes at the end, `finish_dq`). `fp16`:
    FP16(acc + FP16(partial * fp32(softmax_scale * 2^scale_log2))): the tile times one FP32 constant, rounded to FP16,
    and the sum of two FP16 values (exact in FP64) rounded once to FP16; raises `DQAccumulatorOverflow` where a
    finite value would round to FP16's infinity."""
    if dq_accum == "fp32":
        return acc + partial
    factor = torch.tensor(softmax_scale * 2.0**scale_log2, dtype=torch.float32)
    scaled = (partial.to(torch.float32) * factor).to(torch.float64)
    total = acc.to(torch.float64) + scaled.to(torch.float16).to(torch.float64)
    for name, x in (("a key tile's dQ", scaled), ("the dQ sum", total)):
        finite = torch.isfinite(x)
        # what rounds to FP16's infinity: half an ulp (2^4) or more beyond its largest value
        if bool((finite & (x.abs() >= FP16_MAX + 16.0)).any()):
            worst, limit = float(x[finite].abs().max()) * 2.0**-scale_log2, FP16_MAX * 2.0**-scale_log2
            raise DQAccumulatorOverflow(
                f"{name} reaches {worst:.4g}, beyond the FP16 dQ accumulator's range at the static scale 2^{scale_log2} "
                f"(|dQ| < {limit:.4g}); use dq_accum='fp32' or a smaller dq_scale_log2", worst, limit)
    return total.to(torch.float16)


def finish_dq(acc: torch.Tensor, softmax_scale: float, dq_accum: str, scale_log2: int) -> torch.Tensor:
    """dQ in FP32 from its accumulator: `fp32` acc times the softmax scale, `fp16` acc times 2^-scale_log2 (exact)."""
    if dq_accum == "fp32":
        return acc * softmax_scale
    return acc.to(torch.float32) * 2.0**-scale_log2


def dq_from_tiles(ds: torch.Tensor, k: torch.Tensor, softmax_scale: float, recipe: "MXRecipe") -> torch.Tensor:
    """dQ = dS K * softmax_scale through the recipe's accumulator: ds `[..., Pq, Pk]`, k `[..., Pk, D]`, keys padded
    per sequence from its first key, so key tile n is keys 128 n .. 128 n + 127 of every sequence."""
    if recipe.dq_accum == "fp32":
        return ds @ k * softmax_scale
    acc = torch.zeros(*ds.shape[:-1], k.shape[-1], dtype=torch.float16, device=ds.device)
    for start in range(0, ds.shape[-1], DQ_KEY_TILE):
        tile = slice(start, start + DQ_KEY_TILE)
        acc = accumulate_dq(acc, ds[..., tile] @ k[..., tile, :], softmax_scale, "fp16", recipe.dq_scale_log2)
    return finish_dq(acc, softmax_scale, "fp16", recipe.dq_scale_log2).to(ds.dtype)


# ----------------------------------------------------------------------------- the mxfp8 recipe's options


@dataclasses.dataclass(frozen=True)
class MXRecipe:
    """Where the reference's `mxfp8` recipe rounds to MXFP8, and in which blocks.

    The defaults are the recipe of docs/numerics.md (LP-FA4's, with Δ taken from the quantized dO), the one
    `jagged_attention` and the kernels implement. The other settings exist to measure it
    (`gem_lp.attention.error_budget` and its tests), not as user options. The forward's snapped row max and
    its normalization of O by the rounded P's row sum are not options: the kernels round exactly there.

    Quantization points (False keeps that operand in FP32): `qk_forward` (Q, K of S = Q K^T), `v` (V of
    O = P V and of dP = dO V^T), `p` (P of P V and of dV = P^T dO), `qk_backward` (Q, K of the backward),
    `do` (dO), `ds` (dS of dQ and dK). Variants:

    * `qk_recompute`: the backward recomputes P from its own `square` Q, K (`square`, against the forward's
      LSE), or from the forward's `hdim` operands (`forward`: P consistent with LSE).
    * `qk_grad_blocks`: K of dQ = dS K and Q of dK = dS^T Q in `square` blocks or in `seq` blocks (32 tokens
      x 1 feature, along the contraction: an outlier channel keeps its scale to itself).
    * `ds_blocks`: dS in one `square` quantization, or `rowcol`: 1x32 along kv for dQ and 32x1 along the
      queries for dK (two quantizations, each along its GEMM's contraction).
    * `delta`: Δ of dS = P (dP - Δ) as rowsum(dO * O) with the dequantized dO that dP uses (`o_do_q`), with
      dO as given (`o_do`, LP-FA4's), or as rowsum(P * dP) of the backward's own operands (`p_dp`, which
      needs a second pass over the keys in a kernel).
    * `k_smoothing`: subtract each sequence's mean key (per head and channel) before quantizing. Softmax is
      invariant to a per-query constant, so O is unchanged in exact arithmetic; LSE gets q.mean added back.
    * `dq_accum`: the accumulator of dQ = dS K * softmax scale over the key tiles. `fp32` (FA4's, the kernels'):
      an FP32 sum of the tiles' dS_n K_n, times the softmax scale at the end. `fp16` (LP-FA4's throughput option):
      per 128-key tile from each sequence's start, in key order, the tile's FP32 product dS_n K_n times the FP32
      constant softmax scale * 2^`dq_scale_log2` is rounded to FP16 and added into an FP16 accumulator (the sum
      rounded once to FP16), which is multiplied by 2^-`dq_scale_log2` at the end (`accumulate_dq`, `finish_dq`).
      A scaled tile or running sum beyond FP16's range raises `DQAccumulatorOverflow`.
    """

    p_quant: str = "const_p"
    qk_forward: bool = True
    v: bool = True
    p: bool = True
    qk_backward: bool = True
    do: bool = True
    ds: bool = True
    qk_recompute: str = "square"
    qk_grad_blocks: str = "square"
    ds_blocks: str = "square"
    delta: str = "o_do_q"
    k_smoothing: bool = False
    dq_accum: str = "fp32"
    dq_scale_log2: int = DQ_FP16_SCALE_LOG2

    def __post_init__(self):
        choices = {"p_quant": P_QUANTS, "qk_recompute": ("square", "forward"), "qk_grad_blocks": ("square", "seq"),
                   "ds_blocks": ("square", "rowcol"), "delta": ("o_do_q", "o_do", "p_dp"), "dq_accum": DQ_ACCUMS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"MXRecipe.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if isinstance(self.dq_scale_log2, bool) or not isinstance(self.dq_scale_log2, int):
            raise ValueError(f"MXRecipe.dq_scale_log2 must be an int, got {self.dq_scale_log2!r}")

    @staticmethod
    def point(enabled: bool, quantize, x: torch.Tensor, *args) -> torch.Tensor:
        """`quantize(x, *args)` at a quantization point that is on, x itself where it is switched off."""
        return quantize(x, *args) if enabled else x


def scores_forward(q: torch.Tensor, k: torch.Tensor, scale: float, recipe: MXRecipe) -> torch.Tensor:
    """Q K^T * scale from the forward's operands (FP32 q `[..., Pq, D]`, k `[..., Pk, D]`, `hdim` blocks); the
    forward passes fp32(softmax scale * log2 e) for its log2-domain scores, the backward the softmax scale."""
    qd, kd = (recipe.point(recipe.qk_forward, mx_hdim, t) for t in (q, k))
    return qd @ kd.transpose(-1, -2) * scale


def key_mean(k: torch.Tensor, kv_valid: torch.Tensor) -> torch.Tensor:
    """Mean over each sequence's real keys, `[Bc, H, 1, D]` (k `[Bc, H, Pk, D]` holds zeros in the padding)."""
    count = kv_valid.sum(-1).clamp(min=1).to(k.dtype)[:, None, None, None]
    return k.sum(-2, keepdim=True) / count


def smooth_keys(k: torch.Tensor, mean: torch.Tensor, kv_valid: torch.Tensor) -> torch.Tensor:
    """K - mean on the real keys; the padding stays 0 so that it never raises a block's max."""
    return torch.where(kv_valid[:, None, :, None], k - mean, torch.zeros((), dtype=k.dtype, device=k.device))


# ----------------------------------------------------------------------------- softmax pieces


def softmax_parts(s: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalized p = exp2((S - m) log2 e) over visible keys, row max m (0 for empty rows) and l = rowsum p."""
    s = s.masked_fill(~mask, -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(m == -math.inf, torch.zeros((), dtype=s.dtype, device=s.device), m)
    p = torch.exp2((s - m) * LOG2E)
    return p, m, p.sum(-1, keepdim=True)


def snapped_softmax_parts(t: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mxfp8 forward's softmax on log2-domain scores t: p = exp2(t - m') over visible keys with
    m' = ceil(row max of t) (0 for empty rows), the row max in natural units m' ln 2, and l = rowsum p."""
    t = t.masked_fill(~mask, -math.inf)
    m = torch.ceil(t.amax(-1, keepdim=True))
    m = torch.where(m == -math.inf, torch.zeros((), dtype=t.dtype, device=t.device), m)
    p = torch.exp2(t - m)
    return p, m * math.log(2.0), p.sum(-1, keepdim=True)


def normalize(pv: torch.Tensor, m: torch.Tensor, l: torch.Tensor,
              weight_sum: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """O = pv / weight_sum (default l; 0 where no key is visible) and LSE = m + ln l (-inf there), LSE
    `[Bc, H, Pq]`."""
    empty = l == 0
    w = l if weight_sum is None else weight_sum
    o = pv / torch.where(w == 0, torch.ones((), dtype=w.dtype, device=w.device), w)
    lse = torch.where(empty, -math.inf, m + torch.log(l))
    return o, lse.squeeze(-1)


def probabilities(s: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Normalized P = exp2((S - LSE) log2 e) recomputed from LSE; 0 where masked."""
    p = torch.exp2((s - lse[..., None]) * LOG2E)
    return torch.where(mask, p, torch.zeros((), dtype=p.dtype, device=p.device))


def grad_scores(p: torch.Tensor, dp: torch.Tensor, do: torch.Tensor, o: torch.Tensor,
                dlse: torch.Tensor | None) -> torch.Tensor:
    """dS = P * (dP - Δ + dLSE), Δ = rowsum(dO * O) in the compute dtype (dO, O as given)."""
    delta = (do.to(p.dtype) * o.to(p.dtype)).sum(-1, keepdim=True)
    if dlse is not None:
        delta = delta - dlse.to(p.dtype)[..., None]
    return p * (dp - delta)


# ----------------------------------------------------------------------------- recipes on one chunk


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def operand_dtype_16(x: torch.Tensor) -> torch.dtype:
    """Operand dtype of the 16-bit recipe: the input's own when 16-bit, else BF16."""
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def forward_chunk(precision: str, q, k, v, mask, scale: float, recipe: MXRecipe, kv_valid):
    """O (compute dtype) and LSE of one chunk; q `[Bc,H,Pq,D]`, k/v `[Bc,H,Pk,D]` in the input dtype,
    `kv_valid [Bc,Pk]` the real (not padding) keys; `recipe` applies to `mxfp8` only."""
    if precision == "fp32":
        ct = compute_dtype(q)
        q, k, v = q.to(ct), k.to(ct), v.to(ct)
        p, m, l = softmax_parts(q @ k.transpose(-1, -2) * scale, mask)
        return normalize(p @ v, m, l)
    if precision == "bf16":
        od = operand_dtype_16(q)
        q, k, v = (t.to(od).float() for t in (q, k, v))
        p, m, l = softmax_parts(q @ k.transpose(-1, -2) * scale, mask)
        return normalize(p.to(od).float() @ v, m, l)
    q, k, v = q.float(), k.float(), v.float()
    k_mean = key_mean(k, kv_valid) if recipe.k_smoothing else None
    if k_mean is not None:
        k = smooth_keys(k, k_mean, kv_valid)
    scale_log2 = torch.tensor(scale * LOG2E, dtype=torch.float32).item()  # the kernels' FP32 constant
    p, m, l = snapped_softmax_parts(scores_forward(q, k, scale_log2, recipe), mask)
    pq = recipe.point(recipe.p, quantize_p_forward, p, recipe.p_quant)
    o, lse = normalize(pq @ recipe.point(recipe.v, mx_seq, v), m, l, weight_sum=pq.sum(-1, keepdim=True))
    if k_mean is not None:  # S was computed against K - mean: add the per-query constant q.mean back to LSE
        lse = lse + (q @ k_mean.transpose(-1, -2)).squeeze(-1) * scale
    return o, lse


def backward_chunk(precision: str, q, k, v, o, do, lse, dlse, mask, scale: float, recipe: MXRecipe, kv_valid):
    """dQ, dK, dV (compute dtype) of one chunk; o, do in the input dtype, lse/dlse `[Bc,H,Pq]`."""
    if precision == "fp32":
        ct = compute_dtype(q)
        q, k, v, do32 = q.to(ct), k.to(ct), v.to(ct), do.to(ct)
        p = probabilities(q @ k.transpose(-1, -2) * scale, lse.to(ct), mask)
        ds = grad_scores(p, do32 @ v.transpose(-1, -2), do, o, dlse)
        return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ do32
    if precision == "bf16":
        od = operand_dtype_16(q)
        q, k, v, do16 = (t.to(od).float() for t in (q, k, v, do))
        p = probabilities(q @ k.transpose(-1, -2) * scale, lse, mask)
        ds = grad_scores(p, do16 @ v.transpose(-1, -2), do, o, dlse).to(od).float()
        dv = p.to(od).float().transpose(-1, -2) @ do16
        return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, dv
    return mx_backward_chunk(q.float(), k.float(), v.float(), o, do.float(), lse, dlse, mask, scale, recipe, kv_valid)


def mx_backward_chunk(q, k, v, o, do, lse, dlse, mask, scale: float, recipe: MXRecipe, kv_valid):
    """The `mxfp8` backward of one chunk (FP32 inputs), at the rounding points `recipe` names."""
    r = recipe
    k_mean = key_mean(k, kv_valid) if r.k_smoothing else None
    if k_mean is not None:
        # the forward's LSE belongs to the original keys; P is recomputed against the smoothed ones
        lse = lse - (q @ k_mean.transpose(-1, -2)).squeeze(-1) * scale
        k = smooth_keys(k, k_mean, kv_valid)
    qs, ks = (r.point(r.qk_backward, mx_square, t) for t in (q, k))
    dos = r.point(r.do, mx_square, do)
    s = scores_forward(q, k, scale, r) if r.qk_recompute == "forward" else qs @ ks.transpose(-1, -2) * scale
    p = probabilities(s, lse, mask)
    dp = dos @ r.point(r.v, mx_hdim, v).transpose(-1, -2)
    if r.delta == "o_do":
        ds = grad_scores(p, dp, do, o, dlse)
    elif r.delta == "o_do_q":
        ds = grad_scores(p, dp, dos, o, dlse)
    else:  # Δ = rowsum(P * dP) of the backward's own operands: dS's rows then sum to 0 as the true dS's do
        ds = grad_scores(p, dp, p, dp, dlse)
    if r.ds_blocks == "square":
        ds_for_dq = ds_for_dk = r.point(r.ds, mx_square, ds)
    else:  # each GEMM's own 1-D blocks along its contraction: kv for dQ = dS K, queries for dK = dS^T Q
        ds_for_dq, ds_for_dk = r.point(r.ds, mx_hdim, ds), r.point(r.ds, mx_seq, ds)
    if r.qk_grad_blocks == "square":
        k_for_dq, q_for_dk = ks, qs
    else:  # 32 tokens x 1 feature: an outlier channel keeps its scale to itself
        k_for_dq, q_for_dk = (r.point(r.qk_backward, mx_seq, t) for t in (k, q))
    dv = r.point(r.p, quantize_p_backward, p, r.p_quant).transpose(-1, -2) @ dos
    dq = dq_from_tiles(ds_for_dq, k_for_dq, scale, r)
    dk = ds_for_dk.transpose(-1, -2) @ q_for_dk * scale
    if k_mean is not None:  # chain rule through K - mean(K) and through LSE's added q.mean
        count = kv_valid.sum(-1).clamp(min=1).to(dk.dtype)[:, None, None, None]
        valid = kv_valid[:, None, :, None]
        dk_mean = dk.sum(-2, keepdim=True) / count
        if dlse is not None:
            dq = dq + dlse[..., None] * k_mean * scale
            dk_mean = dk_mean - (dlse[..., None] * q).sum(-2, keepdim=True) * scale / count
        dk = torch.where(valid, dk - dk_mean, torch.zeros((), dtype=dk.dtype, device=dk.device))
    return dq, dk, dv


# ----------------------------------------------------------------------------- the autograd Function


class JaggedAttentionFunction(torch.autograd.Function):
    """Jagged attention with the recipe's own backward (not autograd through the forward's rounding).

    Inputs: q `[Tq,H,D]` (`[Lq,H,D]` with broadcast_q), k, v `[Tk,H,D]`, all of one dtype and device.
    Returns O `[num_out,H,D]` in the input dtype and LSE `[num_out,H]` (FP32, FP64 for FP64 inputs).
    """

    @staticmethod
    def forward(ctx, q, k, v, plan: JaggedPlan, causal: bool, precision: str, scale: float, recipe: MXRecipe):
        with torch.autocast(q.device.type, enabled=False):  # the recipe fixes every GEMM's dtype itself
            return JaggedAttentionFunction._forward(ctx, q, k, v, plan, causal, precision, scale, recipe)

    @staticmethod
    def _forward(ctx, q, k, v, plan: JaggedPlan, causal: bool, precision: str, scale: float, recipe: MXRecipe):
        ct = compute_dtype(q) if precision == "fp32" else torch.float32
        heads, dim = q.shape[1], q.shape[2]
        out = q.new_zeros(plan.num_out, heads, dim)
        lse = torch.full((plan.num_out, heads), -math.inf, dtype=ct, device=q.device)
        for chunk in plan.chunks:
            qr, kvr, outr = chunk_rows(plan, chunk, q.device)
            mask = visibility_mask(plan, chunk, qr, kvr, causal)
            o_c, lse_c = forward_chunk(precision, qr.gather(q), kvr.gather(k), kvr.gather(v), mask, scale, recipe,
                                       kvr.valid)
            outr.scatter(out, o_c)
            outr.scatter(lse, lse_c)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.causal, ctx.precision, ctx.scale, ctx.recipe = plan, causal, precision, scale, recipe
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            return JaggedAttentionFunction._backward(ctx, q, k, v, out, lse, d_out, d_lse)

    @staticmethod
    def _backward(ctx, q, k, v, out, lse, d_out, d_lse):
        plan = ctx.plan
        ct = lse.dtype
        dq = torch.zeros(q.shape, dtype=ct, device=q.device)
        dk = torch.zeros(k.shape, dtype=ct, device=k.device)
        dv = torch.zeros(v.shape, dtype=ct, device=v.device)
        if d_out is None:
            d_out = torch.zeros_like(out)
        for chunk in plan.chunks:
            qr, kvr, outr = chunk_rows(plan, chunk, q.device)
            mask = visibility_mask(plan, chunk, qr, kvr, ctx.causal)
            dlse_c = None if d_lse is None else outr.gather_rows(d_lse)
            dq_c, dk_c, dv_c = backward_chunk(
                ctx.precision, qr.gather(q), kvr.gather(k), kvr.gather(v), outr.gather(out),
                outr.gather(d_out), outr.gather_rows(lse), dlse_c, mask, ctx.scale, ctx.recipe, kvr.valid)
            qr.scatter(dq, dq_c, accumulate=plan.broadcast_q)
            kvr.scatter(dk, dk_c)
            kvr.scatter(dv, dv_c)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: JaggedPlan, *,
                        causal: bool, precision: str, scale: float, p_quant: str = "const_p",
                        recipe: MXRecipe | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """O and LSE of jagged attention by the reference recipe (arguments already validated).

    `recipe` (mxfp8 only) overrides the LP-FA4 rounding points for measurements; its `p_quant` is then the
    one used, and a different `p_quant` argument is an error.
    """
    if recipe is None:
        recipe = MXRecipe(p_quant=p_quant)
    elif p_quant != recipe.p_quant:
        raise ValueError(f"p_quant={p_quant!r} disagrees with recipe.p_quant={recipe.p_quant!r}; pass one of them")
    return JaggedAttentionFunction.apply(q, k, v, plan, causal, precision, scale, recipe)
