"""Plain-PyTorch jagged MX quantization: a loop over sequences and heads, the oracle of the Triton kernel.

Each (sequence, head) slice `x [L, D]` is quantized on its own with `quantize_reference`, so blocks
cannot cross a sequence boundary by construction; the scales are then placed on the sequence's padded
rows of a zero matrix and permuted with `to_blocked`. Clarity over speed: it syncs with the host.
"""
from __future__ import annotations

import torch

from gem_lp.mx.formats import BLOCK, PAYLOAD_DTYPE, ceil_div
from gem_lp.mx.layout import to_blocked
from gem_lp.mx.reference import quantize_reference
from gem_lp.jagged.metadata import JaggedLayout
from gem_lp.jagged.tensor import JaggedMXTensor


def quantize_sequence_reference(x: torch.Tensor, orientation: str, scaling: str = "rceil"):
    """Quantize one sequence `x [L, D]` of one head.

    Returns `(payload [L, D] float8_e4m3fn, scale)` with plain uint8 scales:
    `"hdim"` -> `[L, D/32]`; `"seq"` -> `[ceil(L/32), D]`; `"square"` -> `[ceil(L/32), D/32]`.
    A last partial token block takes its max over the real tokens only.
    """
    if orientation == "hdim":
        mx = quantize_reference(x, axis=1, scaling=scaling)
    elif orientation == "seq":
        mx = quantize_reference(x, axis=0, scaling=scaling, allow_partial=True)
    elif orientation == "square":
        mx = quantize_reference(x, block="square", scaling=scaling, allow_partial=True)
    else:
        raise ValueError(f"orientation must be 'hdim', 'seq' or 'square', got {orientation!r}")
    return mx.data, mx.scale


def quantize_jagged_reference(values: torch.Tensor, layout: JaggedLayout, orientations: tuple[str, ...],
                              scaling: str) -> JaggedMXTensor:
    """Reference backend of `quantize_jagged` (arguments already checked there)."""
    t, heads, d = values.shape
    tp, nc = layout.padded_total, d // BLOCK
    dev = values.device
    offsets = layout.offsets.tolist()
    scale_offsets = layout.scale_offsets.tolist()
    payloads = {o: torch.zeros(t, heads, d, dtype=torch.uint8, device=dev) for o in orientations}
    # plain per-head scale matrices; rows/columns no sequence writes stay 0 (the padding bytes)
    hdim_form = {o: torch.zeros(heads, tp, nc, dtype=torch.uint8, device=dev) for o in orientations if o != "seq"}
    seq_form = {o: torch.zeros(heads, d, tp // BLOCK, dtype=torch.uint8, device=dev)
                for o in orientations if o != "hdim"}
    for b in range(layout.batch_size):
        start, end, row0 = offsets[b], offsets[b + 1], scale_offsets[b]
        n, n_blocks, col0 = end - start, ceil_div(end - start, BLOCK), row0 // BLOCK
        if n == 0:
            continue
        for h in range(heads):
            x = values[start:end, h, :]
            for o in orientations:
                data, scale = quantize_sequence_reference(x, o, scaling)
                payloads[o][start:end, h] = data.view(torch.uint8)
                if o == "hdim":
                    hdim_form[o][h, row0:row0 + n] = scale
                elif o == "seq":
                    seq_form[o][h, :, col0:col0 + n_blocks] = scale.T
                else:  # square: each 32x32 byte on its (real) token rows and on its 32 feature rows
                    hdim_form[o][h, row0:row0 + n] = scale.repeat_interleave(BLOCK, dim=0)[:n]
                    seq_form[o][h, :, col0:col0 + n_blocks] = scale.T.repeat_interleave(BLOCK, dim=0)

    def blocked(plain: torch.Tensor) -> torch.Tensor:
        return torch.stack([to_blocked(plain[h]) for h in range(heads)])

    out = JaggedMXTensor(layout, scaling, values.dtype, heads, d)
    for o in orientations:
        setattr(out, f"payload_{o}", payloads[o].view(PAYLOAD_DTYPE))
    if "hdim" in orientations:
        out.scale_hdim = blocked(hdim_form["hdim"])
    if "seq" in orientations:
        out.scale_seq = blocked(seq_form["seq"])
    if "square" in orientations:
        out.scale_square_hdim = blocked(hdim_form["square"])
        out.scale_square_seq = blocked(seq_form["square"])
    return out
