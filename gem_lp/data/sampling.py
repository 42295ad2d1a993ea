"""Raw feature sampling for the synthetic task: Zipf ids, lognormal history lengths, actions and time gaps.

Everything is drawn on the CPU from one `torch.Generator`, in a fixed order, so a batch is a pure
function of its seed.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

from .config import SyntheticDataConfig


@functools.lru_cache(maxsize=64)
def _zipf_cdf(num_ids: int, exponent: float) -> torch.Tensor:
    weights = torch.arange(1, num_ids + 1, dtype=torch.float64).pow(-exponent)
    cdf = weights.cumsum(0) / weights.sum()
    cdf[-1] = 1.0  # exact, so a uniform draw in [0, 1) always lands inside the vocabulary
    return cdf


def zipf_ids(n: int, num_ids: int, exponent: float, generator: torch.Generator) -> torch.Tensor:
    """`n` int64 ids in `[0, num_ids)` with P(id = r) proportional to (r + 1)^-exponent (id 0 the most popular)."""
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    return torch.searchsorted(_zipf_cdf(num_ids, exponent), u, right=True)


def lognormal_lengths(n: int, mean: float, sigma: float, lo: int, hi: int, generator: torch.Generator) -> torch.Tensor:
    """`n` int64 lengths: round(LogNormal) with mean `mean` before clipping to `[lo, hi]`."""
    mu = math.log(mean) - 0.5 * sigma**2
    draws = torch.exp(torch.randn(n, generator=generator, dtype=torch.float64) * sigma + mu)
    return draws.round().clamp(lo, hi).to(torch.int64)


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """`[B + 1]` int64 offsets (0, cumsum) of `[B]` lengths, with plain torch ops (any device)."""
    offsets = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


@dataclasses.dataclass
class RawSamples:
    """Flat per-sample features before packing into KJTs (all on CPU).

    Attributes:
        hist_lengths: int64 `[B]`; hist_items / hist_actions / hist_gaps: int64 `[sum(hist_lengths)]`,
            each sample's history oldest first.
        candidates: int64 `[B]`.
        sparse_lengths / sparse_ids: per sparse feature, int64 `[B]` and `[sum(lengths)]`.
        dense: float32 `[B, num_dense]`.
    """

    hist_lengths: torch.Tensor
    hist_items: torch.Tensor
    hist_actions: torch.Tensor
    hist_gaps: torch.Tensor
    candidates: torch.Tensor
    sparse_lengths: list[torch.Tensor]
    sparse_ids: list[torch.Tensor]
    dense: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.candidates.shape[0]


def _action_probs(num_actions: int) -> torch.Tensor:
    # Views dominate, rarer engagements get geometrically smaller shares.
    w = torch.pow(torch.tensor(0.4, dtype=torch.float64), torch.arange(num_actions, dtype=torch.float64))
    return w / w.sum()


def sample_raw(cfg: SyntheticDataConfig, batch_size: int, generator: torch.Generator) -> RawSamples:
    """Draw `batch_size` samples of every feature from `generator`."""
    g = generator
    lengths = lognormal_lengths(batch_size, cfg.history_mean, cfg.history_sigma, cfg.history_min,
                                cfg.history_max, g)
    total = int(lengths.sum())
    items = zipf_ids(total, cfg.num_items, cfg.zipf_exponent, g)
    actions = torch.multinomial(_action_probs(cfg.num_actions), total, replacement=True, generator=g)
    # Time-gap bucket ~ log2 of the age (events before the request) with jitter: recent items, small buckets.
    offsets = offsets_from_lengths(lengths)
    sample_of_token = torch.repeat_interleave(torch.arange(batch_size), lengths)
    age = (offsets[1:][sample_of_token] - torch.arange(total)).to(torch.float64)  # L - j, in 1..L
    jitter = torch.exp2(torch.rand(total, generator=g, dtype=torch.float64) * 2.0 - 1.0)
    gaps = torch.log2(age * jitter).floor().clamp(0, cfg.num_time_buckets - 1).to(torch.int64)

    # Candidate: with probability `candidate_from_history`, one of the user's own history items.
    has_history = lengths > 0
    from_history = (torch.rand(batch_size, generator=g) < cfg.candidate_from_history) & has_history
    pick = (torch.rand(batch_size, generator=g, dtype=torch.float64) * lengths).floor().to(torch.int64)
    fresh = zipf_ids(batch_size, cfg.num_items, cfg.zipf_exponent, g)
    # An empty history has no position to repeat (its start may equal T); such samples take `fresh`.
    position = torch.where(has_history, offsets[:-1] + pick, torch.zeros_like(pick))
    repeated = items[position] if total > 0 else fresh
    candidates = torch.where(from_history, repeated, fresh)

    sparse_lengths, sparse_ids = [], []
    for spec in cfg.sparse_features:
        n = torch.randint(1, spec.max_ids + 1, (batch_size,), generator=g, dtype=torch.int64)
        sparse_lengths.append(n)
        sparse_ids.append(zipf_ids(int(n.sum()), spec.num_embeddings, cfg.zipf_exponent, g))
    dense = torch.randn(batch_size, cfg.num_dense, generator=g, dtype=torch.float32)
    return RawSamples(lengths, items, actions, gaps, candidates, sparse_lengths, sparse_ids, dense)
