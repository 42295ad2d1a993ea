"""Ranking metrics: ROC AUC (ties averaged) and normalized entropy (NE)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _check_scores_labels(scores: torch.Tensor, labels: torch.Tensor) -> None:
    if scores.dim() != 1 or labels.shape != scores.shape:
        raise ValueError(f"scores and labels must be 1-D of the same length, got {tuple(scores.shape)} and "
                         f"{tuple(labels.shape)}")
    if not torch.all((labels == 0) | (labels == 1)):
        raise ValueError("labels must be 0 or 1")


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U / (n_pos * n_neg)); tied scores count one half.

    Args:
        scores: `[N]` float (any monotone score: logits or probabilities).
        labels: `[N]` in {0, 1}.
    Returns NaN when only one class is present.
    """
    _check_scores_labels(scores, labels)
    s = scores.detach().double().cpu()
    y = labels.detach().double().cpu()
    n_pos = float(y.sum())
    n_neg = float(y.numel()) - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    # Average ranks (1-based) over tie groups.
    sorted_s, order = torch.sort(s)
    _, inverse, counts = torch.unique_consecutive(sorted_s, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    avg_rank_of_group = ends - (counts.double() - 1) / 2
    ranks = torch.empty_like(s)
    ranks[order] = avg_rank_of_group[inverse]
    u = float(ranks[y == 1].sum()) - n_pos * (n_pos + 1) / 2
    return u / (n_pos * n_neg)


def binary_entropy(p: float) -> float:
    """Entropy in nats of a Bernoulli(p); 0 at p in {0, 1}."""
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


def normalized_entropy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """NE = mean binary cross-entropy (nats) / entropy of the base rate (mean label); lower is better, 1 = base rate.

    Returns NaN when only one class is present (the base-rate entropy is 0).
    """
    _check_scores_labels(logits, labels)
    y = labels.detach().double()
    bce = float(F.binary_cross_entropy_with_logits(logits.detach().double(), y))
    h = binary_entropy(float(y.mean()))
    return bce / h if h > 0 else math.nan


def mean_bce(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy with logits, in nats (float64 accumulation)."""
    _check_scores_labels(logits, labels)
    return float(F.binary_cross_entropy_with_logits(logits.detach().double(), labels.detach().double()))
