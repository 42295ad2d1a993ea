"""GEM-like ranking model built from gem_lp's jagged attention and MX linear ops."""
from gem_lp.models.config import GemModelConfig
from gem_lp.models.packing import lengths_to_offsets, prefix_rows, prepend_tokens
from gem_lp.models.ranker import GemRanker

__all__ = ["GemModelConfig", "GemRanker", "lengths_to_offsets", "prefix_rows", "prepend_tokens"]
