"""Prototype: RMSNorm + rowwise + colwise MXFP8 with the row block staged in shared memory by TMA (Gluon).
Restrictions of the prototype: bf16 x, fp32 weight, M % 128 == 0, K % CHUNK == 0, blocked scales, rceil."""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, fence_async_shared
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gem_lp.mx.triton_quantize import block_scale, block_payload


@gluon.jit
def _rstd(sum_sq, K: gl.constexpr, eps):
    if K & (K - 1) == 0:
        mean_sq = sum_sq * (1.0 / K)
    else:
        mean_sq = gl.div_rn(sum_sq, gl.full(sum_sq.shape, K, gl.float32, sum_sq.type.layout))
    return gl.div_rn(gl.full(sum_sq.shape, 1.0, gl.float32, sum_sq.type.layout), gl.sqrt_rn(mean_sq + eps))


@gluon.jit
def _issue(x_desc, smem, bar, m0, first, NCH: gl.constexpr, CHUNK: gl.constexpr):
    mbarrier.expect(bar, NCH * x_desc.block_type.nbytes)
    for c in gl.static_range(NCH):
        tma.async_copy_global_to_shared(x_desc, [m0, c * CHUNK], bar, smem.index(first + c))


@gluon.jit
def _f32(v):
    return (v.to(gl.uint16, bitcast=True).to(gl.uint32) << 16).to(gl.float32, bitcast=True)


@gluon.jit
def norm_staged_kernel(x_desc, w_ptr, M, K: gl.constexpr, eps, rstd_ptr, row_data_ptr, row_scale_ptr,
                       col_data_ptr, col_stride, col_scale_ptr,
                       BLOCK_M: gl.constexpr, CHUNK: gl.constexpr, STAGES: gl.constexpr, THREAD_ROWS: gl.constexpr):
    NCH: gl.constexpr = K // CHUNK
    NKB: gl.constexpr = CHUNK // 32
    NW: gl.constexpr = gl.num_warps()
    WR: gl.constexpr = NW // NKB  # warps along rows (when there are more warps than 32-column blocks)
    L3: gl.constexpr = gl.BlockedLayout([THREAD_ROWS, 1, 8], [BLOCK_M // THREAD_ROWS // WR, 1, 4], [WR, NKB, 1],
                                        [2, 1, 0])
    L_MK: gl.constexpr = gl.SliceLayout(2, L3)  # [BLOCK_M, NKB]
    L_KE: gl.constexpr = gl.SliceLayout(0, L3)  # [NKB, 32]
    L_M: gl.constexpr = gl.SliceLayout(1, L_MK)  # [BLOCK_M]
    L_KB: gl.constexpr = gl.SliceLayout(0, L_MK)  # [NKB]
    L_E: gl.constexpr = gl.SliceLayout(0, L_KE)  # [32]
    VIEW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])

    smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * NCH, BLOCK_M, CHUNK], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_blocks = M // BLOCK_M
    n_mine = (n_blocks - pid + nprog - 1) // nprog
    for i in gl.static_range(STAGES):
        if i < n_mine:
            _issue(x_desc, smem, bars.index(i), (pid + i * nprog) * BLOCK_M, i * NCH, NCH, CHUNK)

    r1 = gl.arange(0, BLOCK_M, layout=L_M)
    kb1 = gl.arange(0, NKB, layout=L_KB)
    e1 = gl.arange(0, 32, layout=L_E)
    r3 = gl.expand_dims(gl.expand_dims(r1, 1), 2)  # [BLOCK_M, 1, 1]
    kb3 = gl.expand_dims(gl.expand_dims(kb1, 0), 2)  # [1, NKB, 1]
    e3 = gl.expand_dims(gl.expand_dims(e1, 0), 0)  # [1, 1, 32]
    col3 = kb3 * 32 + e3  # column within a chunk
    r2 = gl.expand_dims(r1, 1)  # [BLOCK_M, 1] in L_MK
    kb2 = gl.expand_dims(kb1, 0)  # [1, NKB] in L_MK
    kb_ke = gl.expand_dims(gl.arange(0, NKB, layout=gl.SliceLayout(1, L_KE)), 1)  # [NKB, 1] in L_KE
    e_ke = gl.expand_dims(e1, 0)  # [1, 32] in L_KE
    N_KB_ROW: gl.constexpr = K // 32  # columns of the rowwise scale matrix
    n_mb = M // 32  # columns of the colwise scale matrix

    for it in range(n_mine):
        s = it % STAGES
        mbarrier.wait(bars.index(s), (it // STAGES) & 1)
        m0 = (pid + it * nprog) * BLOCK_M
        acc = gl.zeros([BLOCK_M, NKB, 32], gl.float32, L3)
        for c in range(NCH):
            xc = _f32(smem.index(s * NCH + c)._reinterpret(gl.bfloat16, [BLOCK_M, NKB, 32], VIEW).load(L3))
            acc += xc * xc
        sum_sq = gl.sum(gl.sum(acc, axis=2), axis=1)
        rstd = _rstd(sum_sq, K, eps)
        gl.store(rstd_ptr + m0 + r1, rstd)
        rstd3 = gl.expand_dims(gl.expand_dims(rstd, 1), 2)
        for c in range(NCH):
            xc = _f32(smem.index(s * NCH + c)._reinterpret(gl.bfloat16, [BLOCK_M, NKB, 32], VIEW).load(L3))
            w3 = gl.load(w_ptr + c * CHUNK + col3)
            y = (xc * rstd3) * w3
            ab = y.to(gl.int32, bitcast=True) & 0x7FFFFFFF
            rbyte = block_scale(gl.max(ab, axis=2), True)  # [BLOCK_M, NKB]
            q = block_payload(y, gl.expand_dims(rbyte, 2), True)
            gl.store(row_data_ptr + (m0 + r3).to(gl.int64) * K + c * CHUNK + col3, q)
            rr = m0 + r2
            cc = c * NKB + kb2
            gl.store(row_scale_ptr + ((rr // 128) * (N_KB_ROW // 4) + cc // 4) * 512 + (rr % 32) * 16
                     + ((rr % 128) // 32) * 4 + (cc % 4), rbyte.to(gl.uint8))
            cbyte = block_scale(gl.max(ab, axis=0), True)  # [NKB, 32]
            qc = block_payload(y, gl.expand_dims(cbyte, 0), True)
            gl.store(col_data_ptr + (c * CHUNK + col3).to(gl.int64) * col_stride + m0 + r3, qc)
            kk = c * CHUNK + kb_ke * 32 + e_ke
            mb = m0 // 32
            gl.store(col_scale_ptr + ((kk // 128) * (n_mb // 4) + mb // 4) * 512 + (kk % 32) * 16
                     + ((kk % 128) // 32) * 4 + (mb % 4), cbyte.to(gl.uint8))
        gl.thread_barrier()  # every warp is done with stage s
        nxt = it + STAGES
        if nxt < n_mine:
            _issue(x_desc, smem, bars.index(s), (pid + nxt * nprog) * BLOCK_M, s * NCH, NCH, CHUNK)


def launch_args(x, w, eps, chunk=128, stages=2, thread_rows=4, num_warps=4, programs=None, outs=None):
    from gem_lp.mx.layout import blocked_size
    M, K = x.shape
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    desc = TensorDescriptor.from_tensor(x, [32, chunk], layout)
    dev = x.device
    if outs is None:
        outs = dict(rstd=torch.empty(M, device=dev), row=torch.empty(M, K, dtype=torch.uint8, device=dev),
                    row_scale=torch.empty(blocked_size(M, K // 32), dtype=torch.uint8, device=dev),
                    col=torch.empty(K, M, dtype=torch.uint8, device=dev),
                    col_scale=torch.empty(blocked_size(K, M // 32), dtype=torch.uint8, device=dev))
    args = (desc, w, M, K, eps, outs["rstd"], outs["row"], outs["row_scale"], outs["col"], M, outs["col_scale"])
    kw = dict(BLOCK_M=32, CHUNK=chunk, STAGES=stages, THREAD_ROWS=thread_rows, num_warps=num_warps)
    return args, kw, outs


if __name__ == "__main__":  # compile for sm_90 without a GPU
    import re, sys
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature
    from gem_lp.mx.triton_quantize import ptxas_usage
    kernel = norm_staged_kernel
    for chunk, warps, stages, tr in [(128, 4, 2, 4), (256, 8, 2, 4), (128, 8, 3, 2), (256, 16, 2, 2)]:
        x = torch.empty(32768, 1024, dtype=torch.bfloat16)
        w = torch.empty(1024)
        args, kw, _ = launch_args(x, w, 1e-6, chunk, stages, tr, warps)
        target = GPUTarget("cuda", 90, 32)
        backend = make_backend(target)
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*args, **kw)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kw, bound, specialization, options)
        c = triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)
        ptx = c.asm["ptx"]
        print(chunk, warps, stages, tr, ptxas_usage(ptx), "smem", c.metadata.shared, "tma", ptx.count("cp.async.bulk.tensor"), flush=True)
