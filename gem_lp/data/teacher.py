"""The planted teacher: a fixed random model over the same features that defines the labels.

logit = bias + sum_k w_k * z_k, where each term z_k is standardized (unit std on a calibration
sample, fixed at construction) and the weights come from `TeacherWeights`:

* `interest`: the candidate attends over the user's history (softmax of temperature *
  <e(cand), e(item_t) + g(gap_t)>) and reads values a(action_t) * decay(gap_t) * e(item_t); the
  term is <e(cand), read-out>. Users like candidates resembling what they recently engaged with.
* `affinity`: <sum over sparse features of the mean id embedding, A e(cand)>.
* `sparse_bias`: sum over sparse features of the mean per-id bias.
* `dense`: a linear plus a pairwise (x^T U x) function of the dense features.
* `item_bias`: a per-candidate bias.

Labels are Bernoulli(sigmoid(logit)), so the teacher's own AUC on held-out data is the best any
model can reach.
"""
from __future__ import annotations

import math

import torch

from .config import SyntheticDataConfig
from .sampling import RawSamples, sample_raw

TERMS = ("interest", "affinity", "sparse_bias", "dense", "item_bias")
_CALIBRATION_SAMPLES = 8192


def _segment_ids(lengths: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)


def _segment_mean(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Mean over each segment of `values` `[N, ...]` -> `[B, ...]` (0 for empty segments)."""
    out = torch.zeros((lengths.shape[0],) + values.shape[1:], dtype=values.dtype)
    out.index_add_(0, _segment_ids(lengths), values)
    denom = lengths.clamp(min=1).to(values.dtype)
    return out / denom.view((-1,) + (1,) * (values.dim() - 1))


class PlantedTeacher:
    """Fixed random parameters drawn from `cfg.teacher_seed`; call `logits(raw)` for float32 `[B]` logits."""

    def __init__(self, cfg: SyntheticDataConfig):
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.teacher_seed)
        d = cfg.teacher_dim
        scale = 1.0 / math.sqrt(d)

        def randn(*shape):
            return torch.randn(*shape, generator=g, dtype=torch.float32)

        self.item_emb = randn(cfg.num_items, d) * scale
        self.gap_key = randn(cfg.num_time_buckets, d) * (0.5 * scale)
        self.action_weight = randn(cfg.num_actions)
        self.gap_decay = torch.exp(-torch.arange(cfg.num_time_buckets, dtype=torch.float32) / 3.0)
        self.sparse_emb = [randn(f.num_embeddings, d) * scale for f in cfg.sparse_features]
        self.sparse_bias = [randn(f.num_embeddings) for f in cfg.sparse_features]
        self.affinity = randn(d, d) * scale
        self.dense_linear = randn(cfg.num_dense)
        self.dense_pairwise = torch.triu(randn(cfg.num_dense, cfg.num_dense), diagonal=1)
        self.item_bias = randn(cfg.num_items)
        self.term_std = {k: 1.0 for k in TERMS}
        calibration = sample_raw(cfg, _CALIBRATION_SAMPLES, torch.Generator().manual_seed(cfg.teacher_seed + 1))
        raw_terms = self.terms(calibration)
        self.term_std = {k: float(v.std()) or 1.0 for k, v in raw_terms.items()}

    def terms(self, raw: RawSamples) -> dict[str, torch.Tensor]:
        """Standardized float32 `[B]` terms of the logit (see module docstring)."""
        cfg = self.cfg
        cand = self.item_emb[raw.candidates]  # [B, d]
        seg = _segment_ids(raw.hist_lengths)
        hist_emb = self.item_emb[raw.hist_items]  # [T, d], gathered once for the keys and the values
        keys = hist_emb + self.gap_key[raw.hist_gaps]
        scores = cfg.teacher_temperature * (cand[seg] * keys).sum(-1)  # [T]
        seg_max = torch.full((raw.batch_size,), -torch.inf).scatter_reduce(0, seg, scores, "amax")
        p = torch.exp(scores - seg_max[seg])
        denom = torch.zeros(raw.batch_size).index_add_(0, seg, p)
        weight = self.action_weight[raw.hist_actions] * self.gap_decay[raw.hist_gaps]
        values = weight[:, None] * hist_emb
        readout = torch.zeros_like(cand).index_add_(0, seg, p[:, None] * values)
        readout = readout / denom.clamp(min=1e-30)[:, None]  # users without history read 0
        interest = (cand * readout).sum(-1)

        user = sum(_segment_mean(emb[ids], n) for emb, ids, n in
                   zip(self.sparse_emb, raw.sparse_ids, raw.sparse_lengths))
        affinity = (user * (cand @ self.affinity.T)).sum(-1)
        sparse_bias = sum(_segment_mean(b[ids], n) for b, ids, n in
                          zip(self.sparse_bias, raw.sparse_ids, raw.sparse_lengths))
        x = raw.dense
        dense = x @ self.dense_linear + ((x @ self.dense_pairwise) * x).sum(-1)
        item_bias = self.item_bias[raw.candidates]
        raw_terms = dict(interest=interest, affinity=affinity, sparse_bias=sparse_bias, dense=dense,
                         item_bias=item_bias)
        return {k: v / self.term_std[k] for k, v in raw_terms.items()}

    def logits(self, raw: RawSamples) -> torch.Tensor:
        w = self.cfg.teacher_weights
        terms = self.terms(raw)
        out = torch.full((raw.batch_size,), float(w.bias))
        for k in TERMS:
            out = out + getattr(w, k) * terms[k]
        return out
