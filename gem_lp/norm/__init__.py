"""RMSNorm (+ MX cast) kernels by toolchain; the public ops stay in `gem_lp.norm_gemm` (`rms_norm_quantize`) and
`gem_lp.mx` (`quantize_dual`), which dispatch here for `backend="cute"`; the MX norm linears' backward takes the
CuTe RMSNorm backward (`cute/backward.py`) where `gem_lp.norm_gemm.triton_gemm.CUTE_NORM_BACKWARD_ARCHES` says."""
