"""Jagged attention layout: offsets checks, the per-sequence plan, and padded gather/scatter.

The reference pads every sequence to a multiple of 32 tokens *from its own first token*, so a 32-token
MX block of the padded tensor is exactly a block of that sequence (zeros in the padding never raise a
block's max). Sequences are processed in chunks of similar length so that the `[B_chunk, H, Lq, Lk]`
score tensors stay bounded whatever the batch.
"""
from __future__ import annotations

import dataclasses

import torch

from gem_lp.jagged.metadata import check_offsets_form as check_jagged_offsets_form
from gem_lp.mx.formats import BLOCK, INPUT_DTYPES, ceil_div

def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Checks every backend shares: q/k/v tensors `[T, H, D]` of one float dtype and device, k and v alike,
    q and k with the same heads and head dim, at least one head."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor [T, H, D], got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [T, H, D], got shape {tuple(t.shape)}")
        if t.dtype not in INPUT_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape [Tk, H, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[1:] != k.shape[1:]:
        raise ValueError(f"q and k must have the same heads and head dim, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if q.shape[2] == 0 or q.shape[1] == 0:
        raise ValueError(f"q must have at least one head and a non-zero head dim, got shape {tuple(q.shape)}")


def check_offsets_form(offsets, name: str, device: torch.device | None = None) -> None:
    """The offsets checks that need no host sync (`gem_lp.jagged`'s): a 1-D int32/int64 tensor `[B+1]`, on the
    CPU or `device`."""
    check_jagged_offsets_form(offsets, name=name)
    if device is not None and offsets.device.type != "cpu" and offsets.device != device:
        raise ValueError(f"{name} must be on the CPU or on q's device {device}, got {offsets.device}")


# Most score elements (B_chunk * H * Lq_pad * Lk_pad) one chunk may hold: 2^27 fp32 = 512 MiB per tensor.
CHUNK_ELEMENTS = 1 << 27


def check_offsets(offsets: torch.Tensor, name: str, total: int) -> torch.Tensor:
    """Validate jagged offsets `[B+1]` for `total` tokens; returns them as int64 on the CPU."""
    check_offsets_form(offsets, name)
    offs = offsets.detach().to("cpu", torch.int64)
    if offs[0].item() != 0:
        raise ValueError(f"{name} must start at 0, got {offs[0].item()}")
    if offs.numel() > 1 and bool((offs[1:] < offs[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing, got {offs.tolist()[:16]}...")
    if offs[-1].item() != total:
        raise ValueError(f"{name} must end at the number of tokens {total}, got {offs[-1].item()}")
    return offs


def pad32(n: int) -> int:
    return ceil_div(n, BLOCK) * BLOCK


@dataclasses.dataclass
class JaggedPlan:
    """Where each sequence's queries, keys and outputs live, and how sequences are chunked.

    All tensors are int64 on the CPU, `[B]`. With `broadcast_q`, every sequence reads queries
    `0..Lq` and writes its outputs at rows `b * Lq`.
    """

    q_starts: torch.Tensor
    q_lens: torch.Tensor
    kv_starts: torch.Tensor
    kv_lens: torch.Tensor
    out_starts: torch.Tensor
    num_out: int
    broadcast_q: bool
    chunks: list[torch.Tensor]  # sequence indices of each chunk (only sequences with Lq > 0 and Lk > 0)


def make_plan(q_offs: torch.Tensor, kv_offs: torch.Tensor, *, broadcast_q: bool, q_len: int, heads: int,
              chunk_elements: int = CHUNK_ELEMENTS) -> JaggedPlan:
    """Plan of a batch from validated CPU int64 offsets (`q_offs` unused with `broadcast_q`)."""
    kv_starts, kv_lens = kv_offs[:-1], kv_offs[1:] - kv_offs[:-1]
    batch = kv_lens.numel()
    if broadcast_q:
        q_starts = torch.zeros(batch, dtype=torch.int64)
        q_lens = torch.full((batch,), q_len, dtype=torch.int64)
        out_starts = torch.arange(batch, dtype=torch.int64) * q_len
        num_out = batch * q_len
    else:
        q_starts, q_lens = q_offs[:-1], q_offs[1:] - q_offs[:-1]
        out_starts = q_starts
        num_out = int(q_offs[-1].item())
    active = torch.nonzero((q_lens > 0) & (kv_lens > 0)).flatten()
    qp = (q_lens[active] + BLOCK - 1) // BLOCK * BLOCK
    kp = (kv_lens[active] + BLOCK - 1) // BLOCK * BLOCK
    order = active[torch.argsort(qp * kp, descending=True, stable=True)]
    chunks, current, max_q, max_k = [], [], 0, 0
    for b in order.tolist():
        lq, lk = pad32(int(q_lens[b])), pad32(int(kv_lens[b]))
        new_q, new_k = max(max_q, lq), max(max_k, lk)
        if current and (len(current) + 1) * heads * new_q * new_k > chunk_elements:
            chunks.append(torch.tensor(current, dtype=torch.int64))
            current, new_q, new_k = [], lq, lk
        current.append(b)
        max_q, max_k = new_q, new_k
    if current:
        chunks.append(torch.tensor(current, dtype=torch.int64))
    return JaggedPlan(q_starts, q_lens, kv_starts, kv_lens, out_starts, num_out, broadcast_q, chunks)


@dataclasses.dataclass
class Rows:
    """Token rows of a chunk padded per sequence: `tok [Bc, P]` (0 in padding), `valid [Bc, P]` bool."""

    tok: torch.Tensor
    valid: torch.Tensor

    @staticmethod
    def of(starts: torch.Tensor, lens: torch.Tensor, device: torch.device) -> "Rows":
        padded = pad32(int(lens.max().item()))
        pos = torch.arange(padded, dtype=torch.int64)
        valid = pos[None, :] < lens[:, None]
        tok = torch.where(valid, starts[:, None] + pos[None, :], torch.zeros((), dtype=torch.int64))
        return Rows(tok.to(device), valid.to(device))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """`x [T, H, D]` -> `[Bc, H, P, D]` in x's dtype, zeros in the padding."""
        g = x[self.tok]  # [Bc, P, H, D]
        g = torch.where(self.valid[:, :, None, None], g, torch.zeros((), dtype=x.dtype, device=x.device))
        return g.permute(0, 2, 1, 3)

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """`x [T, H]` -> `[Bc, H, P]`, zeros in the padding."""
        g = torch.where(self.valid[:, :, None], x[self.tok], torch.zeros((), dtype=x.dtype, device=x.device))
        return g.permute(0, 2, 1)

    def scatter(self, dst: torch.Tensor, src: torch.Tensor, *, accumulate: bool = False) -> None:
        """Write the real rows of `src [Bc, H, P, ...]` into `dst [T, H, ...]` (summed when `accumulate`)."""
        rows = src.transpose(1, 2)[self.valid]  # [n, H, ...]
        dst.index_put_((self.tok[self.valid],), rows.to(dst.dtype), accumulate=accumulate)


def chunk_rows(plan: JaggedPlan, chunk: torch.Tensor, device: torch.device) -> tuple[Rows, Rows, Rows]:
    """Rows of the queries, keys and outputs of one chunk of sequences."""
    q = Rows.of(plan.q_starts[chunk], plan.q_lens[chunk], device)
    kv = Rows.of(plan.kv_starts[chunk], plan.kv_lens[chunk], device)
    out = Rows.of(plan.out_starts[chunk], plan.q_lens[chunk], device)
    return q, kv, out


def visibility_mask(plan: JaggedPlan, chunk: torch.Tensor, q: Rows, kv: Rows, causal: bool) -> torch.Tensor:
    """`[Bc, 1, Pq, Pk]` bool: real query i may see real key j (causal: j <= i + Lk - Lq)."""
    mask = q.valid[:, :, None] & kv.valid[:, None, :]
    if causal:
        device = q.valid.device
        shift = (plan.kv_lens[chunk] - plan.q_lens[chunk]).to(device)
        i = torch.arange(q.valid.shape[1], device=device)
        j = torch.arange(kv.valid.shape[1], device=device)
        mask = mask & (j[None, None, :] <= i[None, :, None] + shift[:, None, None])
    return mask[:, None]
