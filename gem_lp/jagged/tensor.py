"""`JaggedMXTensor` (a jagged batch quantized in one or more orientations), its checks and dequantization."""
from __future__ import annotations

import dataclasses

import torch

from gem_lp.mx.formats import BLOCK, INPUT_DTYPES, ceil_div
from gem_lp.mx.layout import blocked_size, from_blocked
from gem_lp.mx.reference import scale_f32
from gem_lp.jagged.metadata import JaggedLayout

ORIENTATIONS = ("hdim", "seq", "square")


@dataclasses.dataclass
class JaggedMXTensor:
    """MXFP8 payloads of a jagged `[T, H, D]` batch at their packed positions, with blocked scales.

    Each requested orientation has its own payload `[T, H, D]` float8_e4m3fn; the others are None.
    Scales are uint8 E8M0 bytes, per head, in the 128x4 blocked layout of `gem_lp.mx.layout`:

        scale_hdim         [H, blocked_size(Tp, D/32)]   matrix [Tp, D/32]: row = padded token row
        scale_seq          [H, blocked_size(D, Tp/32)]   matrix [D, Tp/32]: column = padded 32-token block
        scale_square_hdim  [H, blocked_size(Tp, D/32)]   each 32x32 scale on its token rows
        scale_square_seq   [H, blocked_size(D, Tp/32)]   each 32x32 scale on its 32 feature rows

    Every padding byte (rows past a sequence's length, padding rows/columns of the tiles) is 0.
    """

    layout: JaggedLayout
    scaling: str
    orig_dtype: torch.dtype
    heads: int
    head_dim: int
    payload_hdim: torch.Tensor | None = None
    payload_seq: torch.Tensor | None = None
    payload_square: torch.Tensor | None = None
    scale_hdim: torch.Tensor | None = None
    scale_seq: torch.Tensor | None = None
    scale_square_hdim: torch.Tensor | None = None
    scale_square_seq: torch.Tensor | None = None

    @property
    def orientations(self) -> tuple[str, ...]:
        return tuple(o for o in ORIENTATIONS if getattr(self, f"payload_{o}") is not None)

    def payload(self, orientation: str) -> torch.Tensor:
        """`[T, H, D]` float8_e4m3fn payload of one orientation."""
        self._check_has(orientation)
        return getattr(self, f"payload_{orientation}")

    def plain_scale(self, orientation: str) -> torch.Tensor:
        """Scales of one orientation as a plain uint8 matrix per head.

        `"hdim"` -> `[H, Tp, D/32]`; `"seq"` -> `[H, D, Tp/32]`; `"square"` -> `[H, Tp/32, D/32]`
        (one byte per 32x32 block, read from `scale_square_seq`).
        """
        self._check_has(orientation)
        tp, nc = self.layout.padded_total, self.head_dim // BLOCK
        if orientation == "hdim":
            return _unblock(self.scale_hdim, tp, nc)
        seq_form = self.scale_seq if orientation == "seq" else self.scale_square_seq
        plain = _unblock(seq_form, self.head_dim, tp // BLOCK)
        if orientation == "seq":
            return plain
        return plain[:, ::BLOCK, :].transpose(1, 2).contiguous()

    def nbytes(self) -> int:
        """Bytes stored: payloads plus scales (metadata not counted)."""
        parts = (self.payload_hdim, self.payload_seq, self.payload_square, self.scale_hdim, self.scale_seq,
                 self.scale_square_hdim, self.scale_square_seq)
        return sum(p.numel() * p.element_size() for p in parts if p is not None)

    def _check_has(self, orientation: str) -> None:
        check_orientation(orientation)
        if getattr(self, f"payload_{orientation}") is None:
            raise ValueError(f"orientation {orientation!r} was not quantized; this tensor has {self.orientations}")


def _unblock(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.stack([from_blocked(blocked[h], rows, cols) for h in range(blocked.shape[0])])


def check_orientation(orientation: str) -> None:
    if orientation not in ORIENTATIONS:
        raise ValueError(f"orientation must be one of {ORIENTATIONS}, got {orientation!r}")


def check_orientations(orientations) -> tuple[str, ...]:
    """Validate a non-empty collection of distinct orientation names; return them as a tuple."""
    if isinstance(orientations, str):
        raise TypeError(f"orientations must be a tuple of names from {ORIENTATIONS}, got the string "
                        f"{orientations!r} (write ({orientations!r},))")
    orientations = tuple(orientations)
    if not orientations:
        raise ValueError(f"orientations must name at least one of {ORIENTATIONS}")
    for o in orientations:
        check_orientation(o)
    if len(set(orientations)) != len(orientations):
        raise ValueError(f"orientations must not repeat a name, got {orientations}")
    return orientations


def check_values(values: torch.Tensor) -> None:
    """`values` must be a `[T, H, D]` float tensor with H >= 1 and D a positive multiple of 32."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor [T, H, D], got {type(values).__name__}")
    if values.dim() != 3:
        raise ValueError(f"values must be 3-D [T, H, D], got shape {tuple(values.shape)}")
    if values.dtype not in INPUT_DTYPES:
        raise TypeError(f"values must be float32, bfloat16 or float16, got {values.dtype}")
    _, h, d = values.shape
    if h < 1:
        raise ValueError(f"values must have H >= 1 heads, got shape {tuple(values.shape)}")
    if d < BLOCK or d % BLOCK:
        raise ValueError(f"values' head dim D must be a positive multiple of {BLOCK}, got D = {d}")


def scale_sizes(padded_total: int, head_dim: int) -> tuple[int, int]:
    """Bytes per head of the hdim-form (`[Tp, D/32]`) and seq-form (`[D, Tp/32]`) blocked scales."""
    return (blocked_size(padded_total, head_dim // BLOCK),
            blocked_size(head_dim, ceil_div(padded_total, BLOCK)))


def token_rows(layout: JaggedLayout) -> torch.Tensor:
    """`[T]` int64 padded scale row of every packed token (on device, no host sync)."""
    b = layout.batch_size
    seq = torch.repeat_interleave(torch.arange(b, device=layout.device), layout.lengths.to(torch.int64),
                                  output_size=layout.total)
    tok = torch.arange(layout.total, device=layout.device)
    return layout.scale_offsets[seq] + (tok - layout.offsets.to(torch.int64)[seq])


def dequantize_jagged(jmx: JaggedMXTensor, orientation: str) -> torch.Tensor:
    """FP32 `[T, H, D]` values of one orientation (exact; NaN where a block's scale byte is 255).

    `"square"` reads `scale_square_hdim`; `plain_scale("square")` reads `scale_square_seq`, so the two
    forms are checked against each other by the tests.
    """
    if not isinstance(jmx, JaggedMXTensor):
        raise TypeError(f"jmx must be a JaggedMXTensor, got {type(jmx).__name__}")
    jmx._check_has(orientation)
    payload = jmx.payload(orientation).to(torch.float32)
    t, h, d = payload.shape
    rows = token_rows(jmx.layout)
    tp = jmx.layout.padded_total
    if orientation == "seq":
        plain = _unblock(jmx.scale_seq, d, tp // BLOCK)  # [H, D, Tp/32]
        byte = plain[:, :, rows // BLOCK].permute(2, 0, 1)  # [T, H, D]
    else:
        blocked = jmx.scale_hdim if orientation == "hdim" else jmx.scale_square_hdim
        plain = _unblock(blocked, tp, d // BLOCK)  # [H, Tp, D/32]
        byte = plain[:, rows, :].permute(1, 0, 2).repeat_interleave(BLOCK, dim=-1)  # [T, H, D]
    return payload * scale_f32(byte)
