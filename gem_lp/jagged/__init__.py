"""Zero-gather jagged MXFP8: payloads at their packed positions, only the scales padded per sequence.

A jagged batch is `values [T, H, D]` with TorchRec-style `offsets [B+1]` (int32/int64): sequence b is
tokens `offsets[b] .. offsets[b+1] - 1`, of length L_b. Definitions:

* `scale_offsets[b] = sum_{i<b} ceil(L_i / 128) * 128` (int64, `[B+1]`), `Tp = scale_offsets[B]`.
  Token t of sequence b has padded scale row `scale_offsets[b] + (t - offsets[b])`.
* **hdim** (1x32 along D, per token): per head a scale matrix `[Tp, D/32]` (row = padded token row;
  padding rows hold byte 0), stored in the 128x4 blocked layout: `scale_hdim [H, blocked_size(Tp, D/32)]`.
* **seq** (32x1 along tokens, per feature): blocks start at each sequence's first token and never
  cross a sequence; a last partial block takes its max over the real tokens only. Per head a matrix
  `[D, Tp/32]` (column = padded 32-token block), blocked: `scale_seq [H, blocked_size(D, Tp/32)]`.
* **square** (32x32: 32 tokens of one sequence x 32 features; partial token blocks as in seq): one
  payload, its scales in both forms the GEMMs need: `scale_square_hdim [H, blocked_size(Tp, D/32)]`
  (each block's byte on its token rows; rows past the sequence's end are padding, byte 0) and
  `scale_square_seq [H, blocked_size(D, Tp/32)]` (each block's byte on its 32 feature rows). The square
  payload of a sequence equals the transposed payload of quantizing its transpose.
* Each orientation has its own payload `[T, H, D]` float8_e4m3fn: exactly T*H*D bytes, no padding.
* Every padding byte of every scale buffer is 0. D must be a multiple of 32; H >= 1; zero-length
  sequences, an empty batch (`offsets = [0]`) and T = 0 are supported.

Numerics (scale rules, payload rounding) are those of `gem_lp.mx.reference`.
"""
from gem_lp.jagged.metadata import JaggedLayout
from gem_lp.jagged.ops import quantize_jagged
from gem_lp.jagged.reference import quantize_jagged_reference, quantize_sequence_reference
from gem_lp.jagged.tensor import ORIENTATIONS, JaggedMXTensor, dequantize_jagged

__all__ = [
    "ORIENTATIONS",
    "JaggedLayout",
    "JaggedMXTensor",
    "dequantize_jagged",
    "quantize_jagged",
    "quantize_jagged_reference",
    "quantize_sequence_reference",
]
