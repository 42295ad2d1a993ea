"""GEM-like ranking model built from gem_lp's jagged attention and MX linear ops."""
from .config import GemModelConfig
from .packing import lengths_to_offsets, prefix_rows, prepend_tokens
from .ranker import GemRanker

__all__ = ["GemModelConfig", "GemRanker", "lengths_to_offsets", "prefix_rows", "prepend_tokens"]
