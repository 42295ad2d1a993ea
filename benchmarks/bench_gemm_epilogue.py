"""Measurements for the GEMM + MX epilogue design on sm_90 (docs/PERF.md, "GEMM + MX epilogue"): quack's GEMM with
`cu_seqlens_m` and one weight for every sequence, and quack epilogues (`quack.epilogue.frontend`) that write y's
MX-exact BF16 operands along N, along M, and y itself, beside cuBLAS + our Triton casts. Prototype epilogues, kept in
git history with their numbers; not used by the package.

    python -m benchmarks.bench_gemm_epilogue
"""
import sys, time, math, traceback
import torch
from triton.testing import do_bench

torch.manual_seed(0)
dev = "cuda"
# trainer-like jagged batch: 1024 sequences, lognormal lengths mean ~256 in [1, 2048]
g = torch.Generator().manual_seed(0)
L = 1024
lens = torch.exp(torch.randn(L, generator=g) * 0.8 + math.log(256) - 0.32).round().clamp(1, 2048).long()
T = int(lens.sum())
cu = torch.zeros(L + 1, dtype=torch.int32); cu[1:] = torch.cumsum(lens, 0)
cu = cu.to(dev)
K, N = 256, 768
A = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
W = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 16
bias = torch.randn(N, device=dev) / 4
print(f"T={T} K={K} N={N} sequences={L}", flush=True)
ref = (A.float() @ W.float().t())
ms_cublas = do_bench(lambda: torch.mm(A, W.t()))
print(f"cuBLAS mm: {ms_cublas:.4f} ms  {2*T*K*N/ms_cublas/1e9:.0f} TF/s", flush=True)

# ---- E1: quack varlen_m GEMM, one weight for every sequence
try:
    from quack.gemm_interface import gemm
    out = torch.empty(T, N, device=dev, dtype=torch.bfloat16)
    gemm(A, W.t(), out, tuned=False)
    print("quack dense err", float((out.float() - ref).abs().max()), flush=True)
    ms = do_bench(lambda: gemm(A, W.t(), out, tuned=False))
    print(f"quack dense: {ms:.4f} ms", flush=True)
    for label, Bv in (("expand (stride 0)", W.t().unsqueeze(0).expand(L, K, N)),
                      ("materialized", W.t().unsqueeze(0).expand(L, K, N).contiguous())):
        try:
            out2 = torch.full((T, N), float("nan"), device=dev, dtype=torch.bfloat16)
            gemm(A, Bv, out2, cu_seqlens_m=cu, tuned=False)
            torch.cuda.synchronize()
            err = float((out2.float() - ref).abs().max())
            print(f"quack varlen_m {label}: err {err}", flush=True)
            ms = do_bench(lambda: gemm(A, Bv, out2, cu_seqlens_m=cu, tuned=False))
            print(f"quack varlen_m {label}: {ms:.4f} ms", flush=True)
        except Exception as e:
            print(f"quack varlen_m {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
except Exception:
    traceback.print_exc()

# ---- E2: GEMM whose epilogue writes y's MX-exact operands along N and along M (tile-aligned 32-row blocks)
try:
    # quack fingerprints epilogue functions by their globals, and treats only files under site-packages as installed
    # code; the GPU host's CuTe stack lives elsewhere (/tmp/gem-cute/site)
    import quack.gemm_runtime.identity as _qid
    _ext = _qid._is_extern_function
    _qid._is_extern_function = lambda fn: _ext(fn) or "/tmp/gem-cute/site/" in getattr(getattr(fn, "__code__", None), "co_filename", "")
    import cutlass, cutlass.cute as cute
    from cutlass import Float32, Int32, const_expr
    from cutlass.cutlass_dsl import T as TT, dsl_user_op
    from quack.epilogue.ops import GroupedColStatsBase, EpiSmemBytes
    from quack.epilogue.frontend import gemm_epilogue
    from gem_lp.mx.cute_device import _asm, scale_byte
    BLOCK = 32

    @dsl_user_op
    def abs_nan_inf(y: Float32, *, loc=None, ip=None) -> Float32:
        return Float32(_asm(TT.f32(), [Float32(y)],
            "{\n\t.reg .f32 a;\n\t.reg .pred p;\n\tabs.f32 a, $1;\n\ttestp.notanumber.f32 p, a;\n\t"
            "selp.f32 $0, 0f7F800000, a, p;\n\t}", "=f,f", loc, ip))

    @dsl_user_op
    def mx_value(y: Float32, byte: Int32, *, loc=None, ip=None) -> Float32:
        body = ("{\n\t.reg .b32 ib, sb, h16;\n\t.reg .f32 inv, s, x, f;\n\t.reg .b16 h8, lo, hi;\n\t.reg .pred p;\n\t"
                "sub.u32 ib, 254, $2;\n\tshl.b32 ib, ib, 23;\n\tsetp.eq.u32 p, $2, 254;\n\t"
                "selp.b32 ib, 0x00400000, ib, p;\n\tmov.b32 inv, ib;\n\tmul.rn.f32 x, $1, inv;\n\t"
                "cvt.rn.satfinite.e4m3x2.f32 h8, x, x;\n\tcvt.rn.f16x2.e4m3x2 h16, h8;\n\t"
                "mov.b32 {lo, hi}, h16;\n\tcvt.f32.f16 f, lo;\n\t"
                "shl.b32 sb, $2, 23;\n\tsetp.eq.u32 p, $2, 0;\n\tselp.b32 sb, 0x00400000, sb, p;\n\t"
                "setp.eq.u32 p, $2, 255;\n\tselp.b32 sb, 0x7FC00000, sb, p;\n\tmov.b32 s, sb;\n\t"
                "mul.rn.f32 $0, f, s;\n\t}")
        return Float32(_asm(TT.f32(), [Float32(y), Int32(byte)], body, "=f,f,r", loc, ip))

    class BlockColMax(GroupedColStatsBase):
        combine = "max"

        def host_validate(self, value, *, n, tile_N, **_):
            pass

        def to_params(self, gemm, args):
            tensor = getattr(args, self.name)
            setattr(gemm, self._stats_shape_attr(), (gemm.cta_tile_shape_mnk[0] // BLOCK, gemm.cta_tile_shape_mnk[1]))
            return {self.name: tensor}

        def smem_bytes(self, arg_tensor, cta_tile_shape_mnk, epi_tile, warp_shape_mnk=None):
            return EpiSmemBytes(unstaged=(cta_tile_shape_mnk[0] // BLOCK) * cta_tile_shape_mnk[1] * 4)

        @cute.jit
        def begin(self, gemm, param, smem_tensor, ctx):
            tDcC = ctx.partition_for_epilogue_fn(cute.make_identity_tensor((ctx.tile_M, ctx.tile_N)))
            if const_expr(ctx.tiled_copy_t2r is not None):
                tDcC = ctx.tiled_copy_r2s.retile(tDcC)
            tDcC = cute.group_modes(tDcC, 3, cute.rank(tDcC))
            total = const_expr(cute.size(smem_tensor.shape))
            sFlat = cute.make_tensor(smem_tensor.iterator, cute.make_layout(total))
            for i0 in cutlass.range(0, total, ctx.num_epi_threads, unroll_full=True):
                i = i0 + ctx.tidx
                if i < total:
                    sFlat[i] = Float32(0.0)
            ctx.epilogue_barrier.arrive_and_wait()
            return (smem_tensor, tDcC)

        @cute.jit
        def begin_loop(self, gemm, state, epi_coord):
            smem_tensor, tDcC = state
            return (smem_tensor, tDcC[None, None, None, epi_coord])

        @cute.jit
        def fn_sink_flush(self, gemm, state, frag):
            smem_tensor, coords = state
            for i in cutlass.range(cute.size(frag), unroll_full=True):
                m, n = coords[i]
                cute.arch.atomic_fmax((smem_tensor.iterator + (m // BLOCK) * smem_tensor.shape[1] + n).llvm_ptr,
                                      frag[i], sign_bit=False)

        @cute.jit
        def fn_prepass_end(self, gemm, state):
            pass

        def prepass_resolve_needed(self, gemm):
            return False

        @cute.jit
        def fn_prepare(self, gemm, state, paired):
            smem_tensor, coords = state
            out = cute.make_rmem_tensor(coords.layout.shape, Float32)
            for i in cutlass.range(cute.size(out), unroll_full=True):
                m, n = coords[i]
                out[i] = smem_tensor[m // BLOCK, n]
            return out

    def _bf16(v):
        return v.to(cutlass.BFloat16).to(Float32)

    class BlockRowMax(GroupedColStatsBase):
        combine = "max"

        @cute.jit
        def begin(self, gemm, param, smem_tensor, ctx):
            return (self.stats_begin(gemm, smem_tensor, ctx, self._group_cols(param)),)

        @cute.jit
        def stat_value(self, total, group_cols):
            return total

    def _prepass(acc, bias):
        a = abs_nan_inf(_bf16(acc + bias))
        return {"amax_c": a, "amax_r": a}

    @gemm_epilogue(ops={"amax_c": BlockColMax("amax_c"), "amax_r": BlockRowMax("amax_r")}, prepass=_prepass,
                   prepass_outs=("amax_c", "amax_r"), outputs=("colop",))
    def mx_cols_epi(acc, amax_c, amax_r, bias):
        y = _bf16(acc + bias)
        return {"D": mx_value(y, scale_byte(amax_r, rceil=True)), "colop": mx_value(y, scale_byte(amax_c, rceil=True))}

    def _row_only_prepass(acc, bias):
        return {"amax_r": abs_nan_inf(_bf16(acc + bias))}

    @gemm_epilogue(ops={"amax_r": BlockRowMax("amax_r")}, prepass=_row_only_prepass, prepass_outs=("amax_r",),
                   outputs=("raw",))
    def mx_rows_epi(acc, amax_r, bias):
        y = _bf16(acc + bias)
        return {"D": mx_value(y, scale_byte(amax_r, rceil=True)), "raw": y}

    from gem_lp.mx.reference import quantize_reference, dequantize
    from gem_lp.norm_gemm.triton_norm import rms_norm_mx
    M = T
    y_ref = (ref + bias).bfloat16()
    row_ref = dequantize(quantize_reference(y_ref, axis=-1)).bfloat16()
    col_ref = dequantize(quantize_reference(y_ref, axis=0, allow_partial=True)).bfloat16()
    for tm, tn in ((128, 256), (128, 128)):
        try:
            D = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
            colop = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
            b2 = bias.view(1, N).contiguous()
            t0 = time.time()
            run = lambda: mx_cols_epi.gemm(A, W, D, epi_args={"amax_c": 32, "amax_r": 32, "bias": b2, "colop": colop},
                                           tile_M=tm, tile_N=tn, cluster_M=1)
            run(); torch.cuda.synchronize()
            print(f"E2 rows+cols {tm}x{tn}: built+ran in {time.time()-t0:.1f}s", flush=True)
            for name, got, want in (("row", D, row_ref), ("col", colop, col_ref)):
                diff = (got.float() != want.float()) & ~(got.isnan() & want.isnan())
                print(f"  {name}: mismatches {int(diff.sum())} of {diff.numel()} "
                      f"max|d| {float((got.float()-want.float()).nan_to_num().abs().max()):.3g}", flush=True)
            ms = do_bench(run)
            print(f"  E2 rows+cols {tm}x{tn}: {ms:.4f} ms", flush=True)
        except Exception as e:
            print(f"E2 rows+cols {tm}x{tn}: FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
            traceback.print_exc()
    try:
        D = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
        raw = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
        b2 = bias.view(1, N).contiguous()
        run = lambda: mx_rows_epi.gemm(A, W, D, epi_args={"amax_r": 32, "bias": b2, "raw": raw}, tile_M=128, tile_N=256, cluster_M=1)
        run(); torch.cuda.synchronize()
        diff = (D.float() != row_ref.float())
        print(f"E2 rows+raw: row mismatches {int(diff.sum())}, raw mismatches {int((raw != y_ref).sum())}", flush=True)
        print(f"  E2 rows+raw: {do_bench(run):.4f} ms", flush=True)
    except Exception as e:
        print(f"E2 rows+raw: FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
    # the route it replaces: cuBLAS GEMM + bias, then the Triton cast that writes both operands
    y = torch.addmm(bias.bfloat16(), A, W.t())
    ms_g = do_bench(lambda: torch.addmm(bias.bfloat16(), A, W.t()))
    ms_c = do_bench(lambda: rms_norm_mx(y, None, rowwise=False, colwise=False, row_operand=True, col_operand=True))
    print(f"route: cuBLAS addmm {ms_g:.4f} ms + Triton cast (row+col operands) {ms_c:.4f} ms = {ms_g+ms_c:.4f}", flush=True)
    ms_c1 = do_bench(lambda: rms_norm_mx(y, None, rowwise=False, colwise=False, row_operand=True))
    print(f"route: Triton cast (row operand only) {ms_c1:.4f} ms", flush=True)
except Exception:
    traceback.print_exc()
