"""Jagged attention (forward and backward) in FP32, BF16 and MXFP8 (LP-FA4 recipe), see docs/numerics.md."""
from gem_lp.attention.interface import jagged_attention, jagged_attention_kvpacked, jagged_attention_qkvpacked
from gem_lp.attention.layout import CHUNK_ELEMENTS, JaggedPlan, check_offsets, make_plan
from gem_lp.attention.naive import naive_jagged_attention
from gem_lp.attention.reference import P_QUANTS, PRECISIONS, attention_reference

__all__ = [
    "CHUNK_ELEMENTS",
    "JaggedPlan",
    "P_QUANTS",
    "PRECISIONS",
    "attention_reference",
    "check_offsets",
    "jagged_attention",
    "jagged_attention_kvpacked",
    "jagged_attention_qkvpacked",
    "make_plan",
    "naive_jagged_attention",
]
