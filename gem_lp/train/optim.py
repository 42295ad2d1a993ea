"""Optimizers and the learning-rate schedule.

Dense parameters use AdamW. Embedding tables use row-wise Adagrad (one accumulator per row, the
mean squared gradient of the row, as in fbgemm's EXACT_ROWWISE_ADAGRAD): the usual choice for
large, sparsely touched tables — a row's step depends only on its own gradients, and the state is
one float per row instead of one per element.
"""
from __future__ import annotations

import math

import torch

ROWWISE_ADAGRAD_EPS = 1e-8  # also the fused (fbgemm) row-wise Adagrad's, for sharded tables


class RowWiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad for 2-D embedding tables.

    Per row r with gradient g_r (`[D]`): `state_r += mean(g_r^2)`;
    `w_r -= lr * g_r / (sqrt(state_r) + eps)`; rows with an all-zero gradient are left untouched
    (weight decay, when set, is applied to touched rows only, as an L2 term added to g_r).
    Dense or sparse (`torch.sparse_coo`) gradients are accepted. `found_inf` (an attribute, as torch's fused
    optimizers take it from a grad scaler): a 0-dim float tensor on the tables' device, or None; a step
    with `found_inf` nonzero changes no row and no accumulator (decided on the device: no host sync).
    """

    found_inf: torch.Tensor | None = None

    def __init__(self, params, lr: float = 0.05, eps: float = ROWWISE_ADAGRAD_EPS, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0):
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if eps <= 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"RowWiseAdagrad needs 2-D [rows, dim] tables, got shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = torch.full((p.shape[0],), group["initial_accumulator_value"],
                                              dtype=torch.float32, device=p.device)
                    state["step"] = torch.zeros((), dtype=torch.float32)
                state["step"] += 1
                touched = (grad != 0).any(dim=1)
                if self.found_inf is not None:
                    touched &= self.found_inf.to(p.device).reshape(()) == 0
                g = grad.float()
                if group["weight_decay"]:
                    g = torch.where(touched[:, None], g + group["weight_decay"] * p.float(), g)
                state["sum"] += torch.where(touched, g.square().mean(dim=1), 0.0)
                denom = state["sum"].sqrt().add_(group["eps"])
                update = g / denom[:, None] * group["lr"]
                p.sub_(torch.where(touched[:, None], update, torch.zeros_like(update)).to(p.dtype))
        return loss


def warmup_decay_lambda(warmup_steps: int, total_steps: int, decay: str = "cosine", min_ratio: float = 0.1):
    """Multiplier for `LambdaLR`: linear warm-up from 1/warmup to 1, then cosine or linear decay to `min_ratio`."""
    if decay not in ("cosine", "linear", "none"):
        raise ValueError(f"decay must be 'cosine', 'linear' or 'none', got {decay!r}")
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1, got {warmup_steps}, {total_steps}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio}")

    def multiplier(step: int) -> float:  # `step` = optimizer steps taken so far
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if decay == "none":
            return 1.0
        span = max(total_steps - warmup_steps, 1)
        t = min(max(step - warmup_steps, 0) / span, 1.0)
        shape = 0.5 * (1 + math.cos(math.pi * t)) if decay == "cosine" else 1.0 - t
        return min_ratio + (1.0 - min_ratio) * shape

    return multiplier
