"""Public jagged MX entry point: checks its arguments and dispatches to the reference or Triton backend."""
from __future__ import annotations

import torch

from gem_lp.runtime import dispatch
from gem_lp.mx.formats import check_scaling
from gem_lp.jagged.metadata import JaggedLayout
from gem_lp.jagged.reference import quantize_jagged_reference
from gem_lp.jagged.tensor import JaggedMXTensor, check_orientations, check_values


def quantize_jagged(
    values: torch.Tensor,
    offsets_or_layout: torch.Tensor | JaggedLayout,
    orientations=("hdim", "seq"),
    scaling: str = "rceil",
    backend: str = "auto",
) -> JaggedMXTensor:
    """Quantize a jagged batch to MXFP8 with its payloads at their packed positions.

    Args:
        values: `[T, H, D]` float32/bfloat16/float16, H >= 1, D a multiple of 32 (any strides).
        offsets_or_layout: TorchRec-style offsets `[B+1]` (int32/int64, on the values' device), or a
            `JaggedLayout` built from them (reuse it to skip the layout's one host sync).
        orientations: any of `"hdim"` (1x32 along D), `"seq"` (32x1 along each sequence's tokens),
            `"square"` (32x32), all computed from one read of `values`.
        scaling: `"rceil"` (default) or `"floor"`.
        backend: `"auto"` (Triton on CUDA, else reference), `"reference"` or `"triton"`.

    Returns:
        `JaggedMXTensor` with a `[T, H, D]` float8_e4m3fn payload per orientation and per-head scales in
        the 128x4 blocked layout, each sequence's scale rows padded to a multiple of 128.
    """
    check_values(values)
    values = values.detach()  # quantization is not differentiable; payloads are plain data
    orientations = check_orientations(orientations)
    check_scaling(scaling)
    if isinstance(offsets_or_layout, JaggedLayout):
        layout = offsets_or_layout
        if layout.device != values.device:
            raise ValueError(f"offsets_or_layout is on {layout.device}, values on {values.device}: "
                             f"they must share a device")
        if layout.total != values.shape[0]:
            raise ValueError(f"offsets_or_layout describes T = {layout.total} tokens, but values.shape[0] = "
                             f"{values.shape[0]}")
    else:
        layout = JaggedLayout.from_offsets(offsets_or_layout, values)
    if layout.offsets.device != values.device:
        if backend not in ("auto", "reference"):
            raise ValueError(f"backend={backend!r} needs the offsets on values' device {values.device}, got "
                             f"{layout.offsets.device}")
        backend = "reference"
    backend = dispatch.choose("quantize_jagged", "mxfp8", values.device, backend)
    if backend == "reference" or (not values.is_cuda and dispatch.emulated_arch()):  # (the kernel's CPU model)
        return quantize_jagged_reference(values, layout, orientations, scaling)
    from gem_lp.jagged.kernels.triton_quantize import quantize_jagged_triton

    return quantize_jagged_triton(values, layout, orientations, scaling)
