import math, sys, torch, triton
sys.path.insert(0, "tests/norm_gemm"); sys.path.insert(0, "tests")
from gluon_norm import norm_staged_kernel, launch_args
from gem_lp.norm_gemm.triton_norm import rms_norm_mx
from test_triton_norm import exact_sum_input, norm_weight, cpu_reference, reference_casts_of_y
from gem_lp.mx import to_blocked

def replay(fn):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay

sms = torch.cuda.get_device_properties(0).multi_processor_count
a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda"); b = torch.empty_like(a)
copy = 2 * a.numel() / triton.testing.do_bench(lambda: b.copy_(a)) / 1e9
del a, b
print(f"copy {copy:.3f} TB/s", flush=True)
VARIANTS = {1024: [(128, 4, 2, 4, 1), (128, 4, 1, 4, 3), (128, 8, 3, 2, 1), (256, 16, 2, 2, 1), (256, 8, 1, 4, 1),
                   (128, 8, 1, 2, 2), (128, 8, 2, 2, 1)],
            512: [(128, 4, 3, 4, 2), (128, 4, 2, 4, 3), (128, 8, 4, 2, 1), (128, 8, 2, 2, 2), (256, 8, 3, 4, 1)]}
for K in (1024, 512):
    M = 32768
    # correctness: exact-sum input with NaN and Inf, against the reference (bytes and rstd)
    x = exact_sum_input(M, K, torch.bfloat16, 3).cuda()
    x[3, 5] = math.nan
    x[7] = math.inf
    w = norm_weight(K, torch.float32, 3).cuda()
    ref = cpu_reference(x.cpu(), w.cpu(), 1e-6, "rceil")
    row, col = reference_casts_of_y(x.cpu(), w.cpu(), ref.rstd, "rceil")
    xg = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    nbytes = M * K * 4 + 2 * M * K // 32
    base = triton.testing.do_bench(replay(lambda: rms_norm_mx(xg, w, 1e-6)))
    print(f"K={K} default rms_norm_mx (graph replay) {base:.4f} ms {nbytes / base / 1e9:.3f} TB/s {100 * nbytes / base / 1e9 / copy:.1f}% copy", flush=True)
    for chunk, warps, stages, tr, per_sm in VARIANTS[K]:
        name = f"chunk{chunk} w{warps} stages{stages} r{tr} {per_sm}/SM"
        try:
            args, kw, outs = launch_args(x, w, 1e-6, chunk, stages, tr, warps)
            grid = (min(M // 32, sms * per_sm),)
            norm_staged_kernel[grid](*args, **kw)
            torch.cuda.synchronize()
            ok = (bool(((outs["rstd"].cpu() == ref.rstd) | (outs["rstd"].cpu().isnan() & ref.rstd.isnan())).all()) and torch.equal(outs["row"].cpu(), row.data.view(torch.uint8))
                  and torch.equal(outs["row_scale"].cpu(), to_blocked(row.scale)) and torch.equal(outs["col"].cpu(), col.data.view(torch.uint8))
                  and torch.equal(outs["col_scale"].cpu(), to_blocked(col.scale)))
            args, kw, outs = launch_args(xg, w, 1e-6, chunk, stages, tr, warps)
            ms = triton.testing.do_bench(lambda: norm_staged_kernel[grid](*args, **kw))
            tb = nbytes / ms / 1e9
            print(f"K={K} {name:34s} {ms:.4f} ms {tb:.3f} TB/s {100 * tb / copy:5.1f}% copy  exact={ok}", flush=True)
        except Exception as e:
            print(f"K={K} {name} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
