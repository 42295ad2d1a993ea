"""Error budget of the `mxfp8` attention recipe on the reference backend.

`python -m gem_lp.attention.error_budget [--dim 128] [--json PATH]` prints, for a suite of inputs (randn;
Q and K with shared outlier channels 10x, 20x, 50x; disjoint ones; token outliers; a K channel offset; each
causal and not), the SQNR of O, dQ, dK and dV against the `fp32` recipe (computed in FP64) for BF16, for the
mxfp8 recipe, for the recipe with each quantization point switched off in turn, and for its variants
(`MXRecipe`) with and without `qk_rotation="hadamard"`, then where dQ overflows an FP16 accumulator at LP-FA4's
static scale 2^12 (`dq_fp16_range`). docs/numerics.md holds the table and what it decided; a test pins the figures
(`tests/attention/test_error_budget.py`). Small shapes on one thread: the
whole suite takes about 20 s of CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import torch

from gem_lp.accuracy import sqnr_db
from gem_lp.attention.layout import make_plan
from gem_lp.attention.reference import DQ_FP16_SCALE_LOG2, DQAccumulatorOverflow, MXRecipe, attention_reference
from gem_lp.rotation import rotate_qk

TENSORS = ("O", "dQ", "dK", "dV")
# Jagged lengths with partial 32-token blocks: 4 sequences, 354 tokens.
LENGTHS = (160, 97, 64, 33)
HEADS = 2


def outlier_channels(dim: int, which: str = "q") -> list[int]:
    """The two channels that carry outliers: 9 and D/2 + 5 (`q`), or 3 and D/2 + 1 (`k` of `disjoint`)."""
    return [9, dim // 2 + 5] if which == "q" else [3, dim // 2 + 1]


@dataclasses.dataclass(frozen=True)
class InputKind:
    """One input distribution of the suite; all start from randn q, k, v, dO.

    `kind`: `randn`; `channels` (two channels scaled by `factor`, the same ones in q and k, as real models'
    outlier channels are: their products make the large logits); `disjoint` (q's two and k's two outlier
    channels differ); `tokens` (per sequence, two q tokens and two other k tokens scaled by `factor`);
    `k_offset` (k's two channels shifted by `factor`: a per-channel bias, which attention ignores).
    """

    name: str
    kind: str
    factor: float = 1.0


INPUT_KINDS = (
    InputKind("randn", "randn"),
    InputKind("channels x10", "channels", 10.0),
    InputKind("channels x20", "channels", 20.0),
    InputKind("channels x50", "channels", 50.0),
    InputKind("disjoint x20", "disjoint", 20.0),
    InputKind("tokens x20", "tokens", 20.0),
    InputKind("K offset 20", "k_offset", 20.0),
)


@dataclasses.dataclass(frozen=True)
class Variant:
    """How the attention is computed: a reference `precision`, the mxfp8 `recipe`, and `qk_rotation`."""

    name: str
    precision: str = "mxfp8"
    recipe: MXRecipe = MXRecipe()
    qk_rotation: str | None = None


# the FP16 dQ accumulator's static scale in the table: 2^12 (LP-FA4's) overflows on the outlier inputs
DQ_FP16_BUDGET_SCALE_LOG2 = 8


# The switch-offs start from the recipe with P recomputed from the forward's operands ("consistent Q/K", which
# measures the same as the recipe): switching Q/K off on one side of the LSE only would measure the mismatch
# of an FP32 LSE against quantized scores, not what quantizing Q/K costs.
_CONSISTENT = MXRecipe(qk_recompute="forward")
VARIANTS = (
    Variant("bf16", precision="bf16"),
    Variant("bf16 + hadamard", precision="bf16", qk_rotation="hadamard"),
    Variant("mxfp8"),
    # each quantization point switched off in turn (that operand stays FP32)
    Variant("  Q/K fwd off", recipe=dataclasses.replace(_CONSISTENT, qk_forward=False)),
    Variant("  V off", recipe=dataclasses.replace(_CONSISTENT, v=False)),
    Variant("  P off", recipe=dataclasses.replace(_CONSISTENT, p=False)),
    Variant("  Q/K bwd off", recipe=dataclasses.replace(_CONSISTENT, qk_backward=False)),
    Variant("  dO off", recipe=dataclasses.replace(_CONSISTENT, do=False)),
    Variant("  dS off", recipe=dataclasses.replace(_CONSISTENT, ds=False)),
    # variants of the recipe
    Variant("Δ from dO as given (LP-FA4)", recipe=MXRecipe(delta="o_do")),
    Variant("Δ = rowsum(P dP)", recipe=MXRecipe(delta="p_dp")),
    Variant("consistent Q/K", recipe=_CONSISTENT),
    Variant("seq Q/K + rowcol dS", recipe=MXRecipe(qk_grad_blocks="seq", ds_blocks="rowcol")),
    Variant("dynamic P", recipe=MXRecipe(p_quant="dynamic")),
    Variant("K smoothing", recipe=MXRecipe(k_smoothing=True)),
    # dQ in an FP16 accumulator; at LP-FA4's static 2^12 the suite's outlier inputs overflow it (`dq_fp16_range`)
    Variant("dQ FP16 accumulator, 2^8", recipe=MXRecipe(dq_accum="fp16", dq_scale_log2=DQ_FP16_BUDGET_SCALE_LOG2)),
    # with the Hadamard rotation of Q and K
    Variant("hadamard", qk_rotation="hadamard"),
    Variant("hadamard, Δ from dO as given", recipe=MXRecipe(delta="o_do"), qk_rotation="hadamard"),
    Variant("hadamard + K smoothing", recipe=MXRecipe(k_smoothing=True), qk_rotation="hadamard"),
)


def make_inputs(kind: InputKind, *, dim: int = 128, seed: int = 0, lengths: tuple[int, ...] = LENGTHS):
    """q, k, v, d_out `[T, HEADS, dim]` FP32 and offsets int64 `[B+1]` of one input kind (deterministic)."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    t = int(offsets[-1])
    q, k, v, d_out = (torch.randn(t, HEADS, dim, generator=g) for _ in range(4))
    if kind.kind == "channels":
        q[..., outlier_channels(dim)] *= kind.factor
        k[..., outlier_channels(dim)] *= kind.factor
    elif kind.kind == "disjoint":
        q[..., outlier_channels(dim)] *= kind.factor
        k[..., outlier_channels(dim, "k")] *= kind.factor
    elif kind.kind == "tokens":
        for start, n in zip(offsets[:-1].tolist(), lengths):
            rows = start + torch.randperm(n, generator=g)[:4]
            q[rows[:2]] *= kind.factor
            k[rows[2:]] *= kind.factor
    elif kind.kind == "k_offset":
        k[..., outlier_channels(dim)] += kind.factor
    elif kind.kind != "randn":
        raise ValueError(f"unknown input kind {kind.kind!r}")
    return q, k, v, d_out, offsets


def attention_with_grads(q, k, v, d_out, offsets, *, causal: bool, precision: str, recipe: MXRecipe = MXRecipe(),
                         qk_rotation: str | None = None) -> list[torch.Tensor]:
    """[O, dQ, dK, dV] of self-attention by the reference (`fp32` runs in q's dtype, e.g. FP64)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    plan = make_plan(offsets, offsets, broadcast_q=False, q_len=q.shape[0], heads=q.shape[1])
    qr, kr = rotate_qk(q, k, qk_rotation)
    kwargs = dict(recipe=recipe, p_quant=recipe.p_quant) if precision == "mxfp8" else {}
    out, _ = attention_reference(qr, kr, v, plan, causal=causal, precision=precision,
                                 scale=1.0 / math.sqrt(q.shape[-1]), **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), d_out.to(out.dtype))
    return [out.detach(), *grads]


def run_budget(*, dim: int = 128, seed: int = 0, kinds=INPUT_KINDS, variants=VARIANTS,
               causals=(False, True)) -> list[dict]:
    """One row per (input kind, causal, variant): `{"input", "causal", "variant", "O", "dQ", "dK", "dV"}` in dB.

    Runs on one CPU thread (restored after): its ops are small, threads only contend on a busy machine; it also
    fixes the FP32 summation order the pinned figures come from.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_budget(dim, seed, kinds, variants, causals)
    finally:
        torch.set_num_threads(threads)


def _run_budget(dim, seed, kinds, variants, causals) -> list[dict]:
    rows = []
    for kind in kinds:
        q, k, v, d_out, offsets = make_inputs(kind, dim=dim, seed=seed)
        for causal in causals:
            ref = attention_with_grads(q.double(), k.double(), v.double(), d_out.double(), offsets, causal=causal,
                                       precision="fp32")
            for variant in variants:
                got = attention_with_grads(q, k, v, d_out, offsets, causal=causal, precision=variant.precision,
                                           recipe=variant.recipe, qk_rotation=variant.qk_rotation)
                row = {"input": kind.name, "causal": causal, "variant": variant.name}
                row.update({name: round(sqnr_db(a, b), 2) for name, a, b in zip(TENSORS, got, ref)})
                rows.append(row)
    return rows


def dq_fp16_range(*, dim: int = 128, seed: int = 0, kinds=INPUT_KINDS, causals=(False, True),
                   scale_log2: int = DQ_FP16_SCALE_LOG2) -> list[dict]:
    """Whether dQ fits the FP16 accumulator at the static scale 2^scale_log2, per input and causality: rows
    `{"input", "causal", "fits", "dq_max", "limit"}` (`dq_max` the |dQ| that overflowed it, None when it fits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for kind in kinds:
            q, k, v, d_out, offsets = make_inputs(kind, dim=dim, seed=seed)
            for causal in causals:
                row = {"input": kind.name, "causal": causal, "fits": True, "dq_max": None,
                       "limit": 65504.0 * 2.0**-scale_log2}
                try:
                    attention_with_grads(q, k, v, d_out, offsets, causal=causal, precision="mxfp8",
                                         recipe=MXRecipe(dq_accum="fp16", dq_scale_log2=scale_log2))
                except DQAccumulatorOverflow as err:
                    row.update(fits=False, dq_max=round(err.worst, 2))
                rows.append(row)
    finally:
        torch.set_num_threads(threads)
    return rows


def format_table(rows: list[dict], *, causal: bool) -> str:
    """Markdown: one row per variant, one column per input kind, cells `O / dQ / dK / dV` in dB."""
    rows = [r for r in rows if r["causal"] == causal]
    kinds = list(dict.fromkeys(r["input"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    cell = {(r["variant"], r["input"]): " / ".join(f"{r[t]:.0f}" for t in TENSORS) for r in rows}
    lines = ["| " + ("causal" if causal else "non-causal") + ": O / dQ / dK / dV (dB) | " + " | ".join(kinds) + " |",
             "| --- |" + " ---: |" * len(kinds)]
    for variant in variants:
        name = variant.replace("  ", "&nbsp;&nbsp;") if variant.startswith("  ") else variant
        lines.append(f"| {name} | " + " | ".join(cell.get((variant, kind), "") for kind in kinds) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=128, help="head dim (a power of two for the hadamard rows)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the rows to this file (refuses to overwrite)")
    args = parser.parse_args(argv)
    if args.json and os.path.exists(args.json):  # checked before the run, and again by the exclusive open
        raise FileExistsError(f"--json {args.json} exists; pass a new path")
    rows = run_budget(dim=args.dim, seed=args.seed)
    print(f"D={args.dim}, {HEADS} heads, lengths {list(LENGTHS)}, seed {args.seed}; SQNR against FP64\n")
    for causal in (False, True):
        print(format_table(rows, causal=causal) + "\n")
    print(f"FP16 dQ accumulator at 2^{DQ_FP16_SCALE_LOG2} (|dQ| < {65504.0 * 2.0**-DQ_FP16_SCALE_LOG2:.4g}):")
    for r in dq_fp16_range(dim=args.dim, seed=args.seed):
        fit = "fits" if r["fits"] else f"overflows (|dQ| reaches {r['dq_max']})"
        print(f"  {r['input']}, {'causal' if r['causal'] else 'non-causal'}: {fit}")
    if args.json:
        with open(args.json, "x") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
