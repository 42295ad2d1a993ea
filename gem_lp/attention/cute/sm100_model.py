"""CPU models of the sm_100a MXFP8 attention kernels, with the launchers' arguments and semantics, so that a kernel
launch can be swapped for its model on CPU tensors:

* `forward(q, k, v, scales: MXScales, cu_q, cu_k, *, causal, scale, p_quant) -> (O bf16 [Tq, H, D], LSE fp32 [H, Tq])`
  as `launch._mx_forward_sm100` (`fwd_sm100.MXAttentionForwardSm100`);
* `backward(q, k, v, do, do_values, out, lse, dlse, scales: MXBwdScales, cu_q, cu_k, *, causal, scale, p_quant,
  dq=None, dk=None, dv=None) -> (dq, dk, dv)` as `launch._mx_backward_sm100` (FA4's preprocess,
  `bwd_sm100.MXAttentionBackwardSm100`, FA4's dQ postprocess).

Each executes the kernel's own schedule (tile map, masks, scale-tile addresses, MMA order, tensor-memory columns,
the recipe's roundings where the kernel does them); `forward_trace` / `backward_trace` also return what they did
(tiles, scale-tile reads, the tensor-memory ledger). The modules in `gem_lp.attention.cute.model` say which kernel
or FA4 function each step follows. Plain PyTorch on the CPU; the scales arguments are read by field name, so
`launch.MXScales` / `MXBwdScales` or any object with those fields will do.
"""
from gem_lp.attention.cute.model.backward import BackwardTrace, backward, backward_trace
from gem_lp.attention.cute.model.common import ScaleTileOutOfBounds
from gem_lp.attention.cute.model.forward import ForwardTrace, forward, forward_trace

__all__ = ["BackwardTrace", "ForwardTrace", "ScaleTileOutOfBounds", "backward", "backward_trace", "forward",
           "forward_trace"]
