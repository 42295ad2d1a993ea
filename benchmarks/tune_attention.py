"""Where the MXFP8 attention's time goes, and the kernels' variants: the producer passes alone, the sm_90 kernels
alone on MX-exact operands and FlashAttention-4's BF16 kernels, each forward at the candidate tiles, per workload.

Run on the GPU host: `python -m benchmarks.tune_attention [--workloads A,trainer]` (workloads of
bench_attention). Prints the table last; JSON under $OUT.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_attention import D, WORKLOADS, visible_pairs, workload  # noqa: E402
from benchmarks.common import Bench  # noqa: E402
from gem_lp.attention.cute.config import FwdTiles  # noqa: E402

# forward tiles tried beside the launch table's (the first): shorter query tiles waste less on short sequences
FWD_TILES = (FwdTiles(128, 128), FwdTiles(64, 128), FwdTiles(64, 64), FwdTiles(128, 64))


def run(bench: Bench, name: str, causal: bool) -> None:
    from flash_attn.cute import interface as fa4

    from gem_lp.attention.cute.launch import mx_backward, mx_forward
    from gem_lp.attention.producer import ORIENT_HDIM, ORIENT_SEQ, ORIENT_SQUARE, mx_operands

    lengths, offs, heads, q, k, v = workload(name)
    flop = 4.0 * heads * D * visible_pairs(lengths, causal)
    tag = f"{name} {'causal' if causal else 'full'}"
    o64 = offs.to("cuda")
    cu = offs.to("cuda", torch.int32)
    mx = int(lengths.max())
    scale = D ** -0.5
    nbytes = q.numel() * q.element_size()
    fwd_specs = [(q, o64, ORIENT_HDIM), (k, o64, ORIENT_HDIM), (v, o64, ORIENT_SEQ)]
    bench.time(f"{tag} producer", "fwd: q, k hdim, v seq", lambda: mx_operands(fwd_specs), nbytes=6 * nbytes)
    do = torch.randn_like(q)
    bwd_specs = [(q, o64, ORIENT_SQUARE), (k, o64, ORIENT_SQUARE), (v, o64, ORIENT_HDIM), (do, o64, ORIENT_SQUARE)]
    bench.time(f"{tag} producer", "bwd: q, k, do square, v hdim", lambda: mx_operands(bwd_specs),
               nbytes=8 * nbytes)
    qd, kd, vd = mx_operands(fwd_specs)
    qs, ks, vh, dos = mx_operands(bwd_specs)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx, softmax_scale=scale,
              causal=causal)
    out, lse = fa4._flash_attn_fwd(q, k, v, return_lse=True, **kw)[:2]
    bench.time(f"{tag} fwd kernel", "FA4 bf16", lambda: fa4._flash_attn_fwd(q, k, v, return_lse=True, **kw),
               flop=flop, peer=True)
    for tiles in FWD_TILES:
        t = f"{tiles.tile_m}x{tiles.tile_n}"
        bench.time(f"{tag} fwd kernel", f"FA4 bf16 {t}",
                   lambda: fa4._flash_attn_fwd(q, k, v, return_lse=True, tile_mn=(tiles.tile_m, tiles.tile_n),
                                               **kw), flop=flop)
        for p_quant in ("const_p", "dynamic"):
            bench.time(f"{tag} fwd kernel", f"mxfp8 {p_quant} {t}",
                       lambda: mx_forward(qd, kd, vd, cu, cu, causal=causal, scale=scale, p_quant=p_quant,
                                          arch="sm_90a", tiles=tiles), flop=flop)
    bench.time(f"{tag} bwd kernel", "FA4 bf16", lambda: fa4._flash_attn_bwd(q, k, v, out, do, lse, **kw),
               flop=2.5 * flop, peer=True)
    for p_quant in ("const_p", "dynamic"):
        bench.time(f"{tag} bwd kernel", f"mxfp8 {p_quant}",
                   lambda: mx_backward(qs, ks, vh, dos, out, lse, None, cu, cu, causal=causal, scale=scale,
                                       p_quant=p_quant, arch="sm_90a"), flop=2.5 * flop)
    del qd, kd, vd, qs, ks, vh, dos, out, lse
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="A,trainer", help=f"comma-separated, of {list(WORKLOADS)}")
    ap.add_argument("--no-causal", action="store_true")
    args = ap.parse_args()
    names = [w for w in args.workloads.split(",") if w]
    bad = [w for w in names if w not in WORKLOADS]
    if bad:
        ap.error(f"--workloads: unknown {bad}; expected names from {list(WORKLOADS)}")
    bench = Bench("tune_attention")
    bench.copy_bandwidth()
    for name in names:
        for causal in ((False,) if args.no_causal else (False, True)):
            run(bench, name, causal)
    bench.finish()


if __name__ == "__main__":
    main()
