"""The MX GEMM `Y = deq(A) @ B^T` on one H200 (sm_90): ours beside the current route and the BF16 GEMMs.

A: MX `[M, K]` (E4M3 payload + blocked E8M0 scales, rceil cast of randn), B: BF16 `[N, K]` (the MX-exact weight), Y
BF16. Shapes: the model's linears (K -> N) 1024 -> 3072, 1024 -> 4096, 4096 -> 1024, 256 -> 768, 512 -> 1536 at
M = 32767 and 32768 (a jagged token count and its round neighbour), and the GPU trainer's thin-K linears (d_model
256: 256 -> 768, 256 -> 256, 256 -> 1024, and the MLP down projection 1024 -> 256) at the token count of its first
batch (`common.trainer_token_counts`); and the weight-gradient GEMM of the trainer's layers that save X's colwise
payload (group `weight grad MxK->N`: ours, dequantize + cuBLAS, cuBLAS on BF16 operands). Rows per shape (group
`gemm MxKxN`):
  ours mx_gemm_sm90         the launch table's launch (then every other of `cute_gemm.LAUNCH_CANDIDATES` unless
                            --no-candidates), A decoded to BF16 in registers
  dequant + cuBLAS          the cuBLAS route's way: `triton_dequantize.mx_dequantize_operand(A)` (memory-bound pass
                            writing BF16 deq(A)), then cuBLAS `torch.mm` (peer)
  cuBLAS bf16 torch.mm      on deq(A) already in BF16: the GEMM alone, no dequantize (peer)
  quack bf16 gemm           quack's BF16 GEMM on the same operands (peer)
TF/s count 2MNK for every row; `vs_best_peer` in the JSON and the table is the best peer's time over the row's.
Accuracy per row: SQNR in dB (20 log10 |ref| / |Y - ref|) against the FP32 reference `deq(A).float() @ B.float().T`,
and the max abs error over the max |ref|.

Run on the GPU host from the repository root: `python -m benchmarks.bench_mx_gemm [--ms 32767,32768]
[--shapes 1024x3072,...] [--no-candidates]` (`--ms` or `--shapes` given: every shape at every M). Prints the timing
table last; JSON under $OUT. `--dry-run` (no GPU) prints the (M, K, N) it would time.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Bench, trainer_token_counts  # noqa: E402

DEV = "cuda"
MS = (32767, 32768)
SHAPES = ((1024, 3072), (1024, 4096), (4096, 1024), (256, 768), (512, 1536))  # (K, N)
# the GPU trainer's linears (d_model 256, MLP hidden 1024): thin K, timed at the trainer's own token count
TRAINER_SHAPES = ((256, 768), (256, 256), (256, 1024), (1024, 256))


def default_plan() -> list[tuple[int, int, int]]:
    """(M, K, N): SHAPES at MS, then TRAINER_SHAPES at the token count of the GPU trainer's first batch."""
    (trainer_m,) = trainer_token_counts(1)
    return [(M, K, N) for K, N in SHAPES for M in MS] + [(trainer_m, K, N) for K, N in TRAINER_SHAPES]


def accuracy(y: torch.Tensor, ref: torch.Tensor) -> dict:
    y, ref = y.float(), ref.float()
    err = (y - ref).norm().item()
    sqnr = float("inf") if err == 0 else 20 * torch.log10(ref.norm() / err).item()
    return dict(sqnr_db=round(sqnr, 2), max_err_rel=(y - ref).abs().max().item() / ref.abs().max().item())


def operands(M: int, K: int, N: int):
    from gem_lp.mx import quantize_reference, to_blocked

    g = torch.Generator(device=DEV).manual_seed(M + K + N)
    a = quantize_reference(torch.randn(M, K, device=DEV, generator=g), axis=1)
    w = quantize_reference(torch.randn(N, K, device=DEV, generator=g) * K ** -0.5, axis=1)
    b = w.dequantize().to(torch.bfloat16)  # MX-exact BF16 weight
    return a, to_blocked(a.scale), b


def gemm_group(bench: Bench, M: int, K: int, N: int, candidates: bool) -> None:
    from gem_lp.linear.kernels.cute_gemm import mx_gemm_sm90
    from gem_lp.linear.kernels.cute_gemm import launch_for
    from benchmarks.launch_candidates import GEMM_LAUNCH_CANDIDATES as LAUNCH_CANDIDATES
    from gem_lp.runtime.device import build_arch
    from gem_lp.mx import MXTensor
    from gem_lp.mx.kernels.triton_dequantize import mx_dequantize_operand

    group = f"gemm {M}x{K}x{N}"
    flop = 2.0 * M * N * K
    a, a_blocked, b = operands(M, K, N)
    ref = a.dequantize().float() @ b.float().t()
    a_mx = MXTensor(a.data, a_blocked, "1d", 1, "rceil", torch.float32, "blocked")
    default = launch_for(build_arch(a.data.device), N, K)
    launches = [default] + ([c for c in LAUNCH_CANDIDATES if c != default] if candidates else [])
    for launch in launches:
        name = f"ours mx_gemm_sm90 {launch.tile_m}x{launch.tile_n} cluster={launch.cluster_n}" + \
            (" (table)" if launch == default else "")
        try:
            acc = accuracy(mx_gemm_sm90(a.data, a_blocked, b, launch=launch), ref)
        except Exception as e:  # a launch that fails to build or run is recorded; the others still run
            print(f"  [{group}] {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            bench.rows.append(dict(group=group, name=name, error=f"{type(e).__name__}: {e}"))
            continue
        bench.time(group, name + f" [SQNR {acc['sqnr_db']} dB]",
                   lambda launch=launch: mx_gemm_sm90(a.data, a_blocked, b, launch=launch), flop=flop, **acc)
    a_bf16 = mx_dequantize_operand(a_mx)
    acc = accuracy(torch.mm(a_bf16, b.t()), ref)
    bench.time(group, f"dequant + cuBLAS torch.mm (the cuBLAS route's way) [SQNR {acc['sqnr_db']} dB]",
               lambda: torch.mm(mx_dequantize_operand(a_mx), b.t()), flop=flop, peer=True, **acc)
    bench.time(group, "cuBLAS bf16 torch.mm (operand already BF16)", lambda: torch.mm(a_bf16, b.t()), flop=flop,
               peer=True, **acc)
    try:
        from quack.gemm_interface import gemm as quack_gemm

        acc = accuracy(quack_gemm(a_bf16, b.t()), ref)
        bench.time(group, f"quack bf16 gemm (operand already BF16) [SQNR {acc['sqnr_db']} dB]",
                   lambda: quack_gemm(a_bf16, b.t()), flop=flop, peer=True, **acc)
    except Exception as e:  # one failing peer must not hide the others
        print(f"  [{group}] quack gemm: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        bench.rows.append(dict(group=group, name="quack bf16 gemm", error=f"{type(e).__name__}: {e}", peer=True))


# the trainer's layers whose backward reads X's saved colwise payload for dW (K_in -> N)
WEIGHT_GRAD_SHAPES = ((256, 768), (256, 256), (256, 1024), (1024, 256))


# tiles of the weight gradient timed with --launches (the default split for each)
WEIGHT_GRAD_LAUNCHES = ((128, 128, 1), (128, 192, 1), (128, 256, 1), (128, 128, 2))


def weight_grad_group(bench: Bench, M: int, K: int, N: int, splits: bool, launches: bool = False) -> None:
    """dW [N, K] from X's colwise payload `[K, M]` and dY's colwise BF16 operand: ours (`mx_weight_grad_sm90`, the
    payload decoded in registers, the tokens split over CTAs) against the cuBLAS route's way (dequantize the payload,
    then cuBLAS) and cuBLAS on BF16 operands alone (what `nn.Linear`'s dW GEMM costs)."""
    from gem_lp.linear.gemm import gemm_nt
    from gem_lp.linear.kernels.cute_gemm import WGRAD_SM90, GemmLaunch, mx_weight_grad_sm90
    from gem_lp.linear.operands import saved_col_operand
    from gem_lp.linear.selfchecks import weight_grad_operands

    group = f"weight grad {M}x{K}->{N}"
    flop = 2.0 * M * N * K
    data, scale, dy_col_t = weight_grad_operands(M, K, N, DEV, outlier=False)
    rows = dy_col_t.shape[1]
    x_col = saved_col_operand(data, scale, "rceil", "cublas", torch.bfloat16, rows)
    ref = dy_col_t.float() @ x_col.float().t()
    variants = [(WGRAD_SM90, None)] + [(WGRAD_SM90, s) for s in ([1, 2, 4, 8, 16, 32] if splits else [])] + \
        [(GemmLaunch(*t), None) for t in (WEIGHT_GRAD_LAUNCHES[1:] if launches else ())]
    for launch, split in variants:
        name = (f"ours mx_weight_grad_sm90 {launch.tile_m}x{launch.tile_n} cluster={launch.cluster_n} "
                + ("(default split)" if split is None else f"split {split}"))
        try:
            acc = accuracy(mx_weight_grad_sm90(data, scale, dy_col_t, launch=launch, split_k=split), ref)
        except Exception as e:  # a variant that fails is recorded; the others still run
            print(f"  [{group}] {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            bench.rows.append(dict(group=group, name=name, error=f"{type(e).__name__}: {e}"))
            continue
        bench.time(group, name + f" [SQNR {acc['sqnr_db']} dB]",
                   lambda launch=launch, split=split: mx_weight_grad_sm90(data, scale, dy_col_t, launch=launch,
                                                                          split_k=split), flop=flop, **acc)
    acc = accuracy(gemm_nt(dy_col_t, x_col, "cublas", torch.float32), ref)
    bench.time(group, f"dequant + cuBLAS (the cuBLAS route's way) [SQNR {acc['sqnr_db']} dB]",
               lambda: gemm_nt(dy_col_t, saved_col_operand(data, scale, "rceil", "cublas", torch.bfloat16, rows),
                               "cublas", torch.float32), flop=flop, peer=True, **acc)
    bench.time(group, "cuBLAS bf16 (operands already BF16, FP32 dW)",
               lambda: gemm_nt(dy_col_t, x_col, "cublas", torch.float32), flop=flop, peer=True)


def _shapes(text: str, ap) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(v) for v in s.split("x")) for s in text.split(",") if s]
    except ValueError:
        ap.error(f"--shapes must be KxN pairs, comma-separated, got {text!r}")
    if not out or any(len(s) != 2 or s[0] % 32 or s[1] % 8 for s in out):
        ap.error(f"--shapes needs KxN with K a multiple of 32 and N of 8, got {text!r}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", default=None, help="token counts M, comma-separated (default: " + ",".join(map(str, MS))
                    + "; the trainer's shapes at its first batch's)")
    ap.add_argument("--shapes", default=None, help="KxN pairs, comma-separated (default: "
                    + ",".join(f"{k}x{n}" for k, n in SHAPES + TRAINER_SHAPES) + ")")
    ap.add_argument("--no-candidates", action="store_true", help="time only the launch table's launch")
    ap.add_argument("--dry-run", action="store_true", help="print the (M, K, N) to time and exit (no GPU needed)")
    ap.add_argument("--weight-grad", choices=("with", "only", "no"), default="with",
                    help="the weight-gradient GEMM at the trainer's shapes and first token count (default: with the "
                    "forward GEMMs)")
    ap.add_argument("--splits", action="store_true", help="time the weight gradient at every split count too")
    ap.add_argument("--launches", action="store_true", help="time the weight gradient at every tile of "
                    "WEIGHT_GRAD_LAUNCHES too")
    args = ap.parse_args()
    if args.ms is None and args.shapes is None:
        plan = default_plan()
    else:
        try:
            ms = [int(v) for v in (args.ms or ",".join(map(str, MS))).split(",") if v]
        except ValueError:
            ap.error(f"--ms must be comma-separated integers, got {args.ms!r}")
        shapes = _shapes(args.shapes, ap) if args.shapes else list(SHAPES + TRAINER_SHAPES)
        plan = [(M, K, N) for K, N in shapes for M in ms]
    (trainer_m,) = trainer_token_counts(1) if args.weight_grad != "no" else (None,)
    wgrad = [] if args.weight_grad == "no" else [(trainer_m, K, N) for K, N in WEIGHT_GRAD_SHAPES]
    if args.weight_grad == "only":
        plan = []
    if args.dry_run:
        print("\n".join([f"gemm {M}x{K}x{N}" for M, K, N in plan] + [f"weight grad {M}x{K}->{N}" for M, K, N in wgrad]))
        return
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    bench = Bench("bench_mx_gemm")
    for M, K, N in plan:
        try:
            gemm_group(bench, M, K, N, candidates=not args.no_candidates)
        except Exception as e:  # a failing group is recorded; the others still run
            print(f"  [gemm {M}x{K}x{N}] FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc(limit=3)
            bench.rows.append(dict(group=f"gemm {M}x{K}x{N}", name="(group)", error=f"{type(e).__name__}: {e}"))
        torch.cuda.empty_cache()
    for M, K, N in wgrad:
        try:
            weight_grad_group(bench, M, K, N, args.splits, args.launches)
        except Exception as e:  # a failing group is recorded; the others still run
            print(f"  [weight grad {M}x{K}->{N}] FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc(limit=3)
            bench.rows.append(dict(group=f"weight grad {M}x{K}->{N}", name="(group)", error=f"{type(e).__name__}: {e}"))
        torch.cuda.empty_cache()
    bench.finish()


if __name__ == "__main__":
    main()
