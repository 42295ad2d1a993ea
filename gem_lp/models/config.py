"""Configuration of the GEM-like ranking model (`gem_lp/configs/model/*.yaml` fill this dataclass, Hydra's schema
for them: types are checked at composition, ranges in `__post_init__`)."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

PRECISIONS = ("bf16", "mxfp8", "fp32")
ACTIVATIONS = ("silu", "gelu", "relu")
P_QUANTS = ("const_p", "dynamic")
QK_ROTATIONS = (None, "hadamard")
MX_BLOCK = 32


@dataclasses.dataclass
class GemModelConfig:
    """Sizes and numerics of `GemRanker`.

    `precision` is the recipe of every projection and attention op (`bf16`, `mxfp8`, or `fp32`);
    `backend` is passed through to them unchanged; `p_quant` and `qk_rotation` (None or `hadamard`, which
    needs a power-of-two `head_dim`) go to every attention op. Activations between ops are bfloat16 for the
    `bf16` and `mxfp8` recipes and float32 for `fp32`; parameters are float32 (master weights).
    GEMM widths (`d_model`, `num_heads * head_dim`, hidden sizes, `embedding_dim`) must be
    multiples of 32 so that every MX block is a whole 32-element block.
    """

    precision: str = "bf16"
    backend: str = "auto"
    p_quant: str = "const_p"
    qk_rotation: str | None = None
    embedding_dim: int = 64
    d_model: int = 64
    num_heads: int = 2
    head_dim: int = 32
    num_blocks: int = 2
    mlp_hidden: int = 128
    num_summary_tokens: int = 2  # K_sum tokens prepended to each history (built from non-sequence features)
    num_query_tokens: int = 2  # K learned queries that read every user's encoded sequence
    causal: bool = False
    dense_hidden: int = 64
    num_cross_layers: int = 1
    head_hidden: int = 128
    activation: str = "silu"
    norm_eps: float = 1e-6

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"model.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"model.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.p_quant not in P_QUANTS:
            raise ValueError(f"model.p_quant must be one of {P_QUANTS}, got {self.p_quant!r}")
        if self.qk_rotation not in QK_ROTATIONS:
            raise ValueError(f"model.qk_rotation must be null or hadamard, got {self.qk_rotation!r}")
        widths = ("embedding_dim", "d_model", "head_dim", "mlp_hidden", "dense_hidden", "head_hidden")
        for name in widths:
            v = getattr(self, name)
            if v < MX_BLOCK or v % MX_BLOCK:
                raise ValueError(f"model.{name} must be a positive multiple of {MX_BLOCK}, got {v}")
        if self.qk_rotation == "hadamard" and self.head_dim & (self.head_dim - 1):
            raise ValueError(f"model.qk_rotation=hadamard needs a power-of-two model.head_dim, got {self.head_dim}")
        counts = ("num_heads", "num_blocks", "num_summary_tokens", "num_query_tokens")
        for name in counts:
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_cross_layers < 0:
            raise ValueError(f"model.num_cross_layers must be >= 0, got {self.num_cross_layers}")

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype of the activations fed to the ops."""
        return torch.float32 if self.precision == "fp32" else torch.bfloat16

    @property
    def attention_dim(self) -> int:
        return self.num_heads * self.head_dim

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> "GemModelConfig":
        """Build from a plain mapping (e.g. `OmegaConf.to_container(cfg.model)`); unknown keys are errors."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; expected a subset of {sorted(known)}")
        return cls(**dict(cfg))
