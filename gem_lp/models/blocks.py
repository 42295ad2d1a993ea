"""Transformer pieces over jagged sequences, built only from gem_lp ops (recipe and backend passed in)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gem_lp.attention import jagged_attention_kvpacked, jagged_attention_qkvpacked
from gem_lp.linear import MXLinear, RMSNormMXLinear, rms_norm_mx_mlp
from gem_lp.linear.ops import INPUT_ACTIVATIONS

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


class OpSettings:
    """What every op of the model is told: precision recipe, backend, and attention's P quantization mode and
    Q/K rotation.

    `qk_rotation="hadamard"` is folded into the projections that make Q and K (`qk_linear`, `qk_norm_linear`:
    their Q and K output features rotated per head by the Hadamard matrix, through the weight), so the attention
    ops get rotated Q and K straight from the GEMMs and are called with `qk_rotation=None`: the same attention in
    exact arithmetic as rotating inside `jagged_attention`, without its passes over Q and K (two matmuls and a copy
    each way per call) and without keeping rotated copies of them for the backward.
    """

    def __init__(self, recipe: str, backend: str, p_quant: str, eps: float, qk_rotation: str | None = None):
        self.recipe = recipe
        self.backend = backend
        self.p_quant = p_quant
        self.qk_rotation = qk_rotation
        self.eps = eps

    def linear(self, in_features: int, out_features: int, bias: bool = True,
               input_activation: str | None = None) -> MXLinear:
        return MXLinear(in_features, out_features, bias, recipe=self.recipe, backend=self.backend,
                        input_activation=input_activation)

    def norm_linear(self, in_features: int, out_features: int, bias: bool = True) -> RMSNormMXLinear:
        return RMSNormMXLinear(in_features, out_features, bias, self.eps, recipe=self.recipe, backend=self.backend)

    def _rotation(self, qk_features: int, head_dim: int) -> dict:
        rows = qk_features if self.qk_rotation == "hadamard" else 0
        return dict(rotated_rows=rows, rotation_block=head_dim)

    def qk_linear(self, in_features: int, out_features: int, qk_features: int, head_dim: int,
                  bias: bool = True) -> MXLinear:
        """A projection whose first `qk_features` outputs are attention's Q and/or K heads of `head_dim` features
        (rotated per head by `qk_rotation`)."""
        return MXLinear(in_features, out_features, bias, recipe=self.recipe, backend=self.backend,
                        **self._rotation(qk_features, head_dim))

    def qk_norm_linear(self, in_features: int, out_features: int, qk_features: int, head_dim: int,
                       bias: bool = True) -> RMSNormMXLinear:
        """`norm_linear` whose first `qk_features` outputs are attention's Q and/or K heads (see `qk_linear`)."""
        return RMSNormMXLinear(in_features, out_features, bias, self.eps, recipe=self.recipe, backend=self.backend,
                               **self._rotation(qk_features, head_dim))

    def self_attention(self, qkv, offsets, *, causal=False, max_length=None):
        """Jagged self-attention on `qkv [T, 3, H, D]` from `qk_norm_linear` (Q and K already rotated), whose
        gradient the attention writes as one tensor. `max_length`: offsets on the device taken unchecked, no
        sequence longer than this (`jagged_attention`'s `max_seqlen_*`)."""
        return jagged_attention_qkvpacked(qkv, offsets, causal=causal, precision=self.recipe, backend=self.backend,
                                          p_quant=self.p_quant, max_seqlen=max_length)

    def cross_attention(self, q, kv, q_offsets, kv_offsets, *, max_length=None, max_q_length=None):
        """Jagged attention of q over `kv [Tk, 2, H, D]` (see `self_attention`); `max_q_length`, with `max_length`:
        a tighter bound on the query sequences (the launch's query tiles follow it)."""
        max_q = max_length if max_length is None or max_q_length is None else max_q_length
        return jagged_attention_kvpacked(q, kv, q_offsets, kv_offsets, precision=self.recipe, backend=self.backend,
                                         p_quant=self.p_quant, max_seqlen_q=max_q, max_seqlen_k=max_length)


class FeedForward(nn.Module):
    """Pre-norm MLP: RMSNorm+Linear (fused) -> activation -> Linear. `[N, d] -> [N, d]`.

    An activation the linear layers can take as their input activation (SiLU) is handed to the down-projection,
    whose MXFP8 casts compute it on the fly: the hidden activation is never stored. With the MXFP8 recipe the two
    layers then run as one op (`rms_norm_mx_mlp`), whose up-projection computes the activation's backward in its
    own gradient casts: the activation's gradient is never stored either.
    """

    def __init__(self, ops: OpSettings, dim: int, hidden: int, activation: str):
        super().__init__()
        self.up = ops.norm_linear(dim, hidden)
        fused = activation in INPUT_ACTIVATIONS
        self.act = None if fused else _ACTIVATIONS[activation]
        self.down = ops.linear(hidden, dim, input_activation=activation if fused else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is None and self.up.recipe == "mxfp8":
            return rms_norm_mx_mlp(x, self.up.norm_weight, *self.up.effective_parameters(),
                                   *self.down.effective_parameters(), self.up.eps,
                                   activation=self.down.input_activation, backend=self.up.backend)
        h = self.up(x)
        return self.down(h if self.act is None else self.act(h))


class JaggedSelfAttentionBlock(nn.Module):
    """Pre-norm transformer block over packed jagged sequences.

    x + Out(Attn(QKV(RMSNorm(x)))) then x + MLP(RMSNorm(x)); attention stays within each sequence.
    Input and output `[T, d_model]` in the compute dtype; offsets int64 `[B + 1]`.
    """

    def __init__(self, ops: OpSettings, d_model: int, num_heads: int, head_dim: int, mlp_hidden: int,
                 activation: str, causal: bool):
        super().__init__()
        self.ops = ops
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.causal = causal
        self.qkv = ops.qk_norm_linear(d_model, 3 * num_heads * head_dim, 2 * num_heads * head_dim, head_dim)
        self.out = ops.linear(num_heads * head_dim, d_model)
        self.mlp = FeedForward(ops, d_model, mlp_hidden, activation)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_length: int | None = None) -> torch.Tensor:
        """`max_length`: see `OpSettings.self_attention`."""
        t = x.shape[0]
        # packed: the attention reads q, k, v in place and writes dQKV as one tensor (three gradients would be
        # copied into one by autograd)
        qkv = self.qkv(x).view(t, 3, self.num_heads, self.head_dim)
        attn = self.ops.self_attention(qkv, offsets, causal=self.causal, max_length=max_length)
        x = x + self.out(attn.reshape(t, self.num_heads * self.head_dim))
        return x + self.mlp(x)


class SequenceReadout(nn.Module):
    """Summarizes each encoded sequence with K learned query tokens and with its target (candidate).

    * query tokens: K learned queries `[K, d_model]` attend over every sequence, giving `[B, K, d_model]`;
    * target attention: each candidate embedding `[B, d_target]` attends over its own sequence, giving
      `[B, d_model]`.
    Keys and values come from one fused RMSNorm+projection of the encoded tokens. Both reads are one attention
    call, whose sequence b has K + 1 queries (the learned ones, then b's target): every sequence's keys and values
    are read (and, with MXFP8, quantized) once, not once per kind of query.
    """

    def __init__(self, ops: OpSettings, d_model: int, d_target: int, num_heads: int, head_dim: int,
                 num_query_tokens: int):
        super().__init__()
        self.ops = ops
        self.num_heads = num_heads
        self.head_dim = head_dim
        width = num_heads * head_dim
        self.query_tokens = nn.Parameter(torch.randn(num_query_tokens, d_model) * d_model**-0.5)
        self.query_proj = ops.qk_linear(d_model, width, width, head_dim)
        self.target_proj = ops.qk_norm_linear(d_target, width, width, head_dim)
        self.kv = ops.qk_norm_linear(d_model, 2 * width, width, head_dim)
        self.query_out = ops.linear(width, d_model)
        self.target_out = ops.linear(width, d_model)
        self._query_offsets: dict[tuple[int, int, torch.device], torch.Tensor] = {}

    def query_offsets(self, batch: int, queries: int, device: torch.device) -> torch.Tensor:
        """int64 `[B + 1]` offsets `0, Q, 2Q, ..., BQ` of `queries` queries per sequence on `device`.

        Made once per (B, Q, device) and reused: the attention op validates an offsets tensor once (a copy to the
        CPU, so a host sync) and builds its launch plans once per tensor, so a new tensor each step would cost
        a sync and those device ops every step. Never written in place. Not kept while a CUDA graph is
        being captured (its memory would belong to the graph's pool).
        """
        key = (batch, queries, device)
        offsets = self._query_offsets.get(key)
        if offsets is None:
            offsets = torch.arange(0, (batch + 1) * queries, queries, dtype=torch.int64, device=device)
            if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                self._query_offsets[key] = offsets
        return offsets

    def forward(self, tokens: torch.Tensor, offsets: torch.Tensor, target: torch.Tensor):
        """tokens `[T, d_model]`, offsets int64 `[B + 1]`, target `[B, d_target]` ->
        (`[B, K, d_model]`, `[B, d_model]`) in the compute dtype. The three stages (`queries`, `reads`,
        `summaries`) can also be called one by one: the first and last have shapes fixed by the batch size."""
        q_query, q_target = self.queries(target)
        return self.summaries(*self.reads(tokens, offsets, q_query, q_target))

    def queries(self, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """target `[B, d_target]` -> the learned queries `[K, h, d]` and the target queries `[B, h, d]`, in target's
        dtype."""
        h, d = self.num_heads, self.head_dim
        q_query = self.query_proj(self.query_tokens.to(target.dtype)).view(self.query_tokens.shape[0], h, d)
        return q_query, self.target_proj(target).view(target.shape[0], h, d)

    def reads(self, tokens: torch.Tensor, offsets: torch.Tensor, q_query: torch.Tensor,
              q_target: torch.Tensor, max_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """What the queries read from the encoded tokens: `[B * K, h * d]` and `[B, h * d]` (B: q_target's rows,
        one per sequence of `offsets`). `max_length`: see `OpSettings.self_attention`."""
        t, b, lq = tokens.shape[0], q_target.shape[0], q_query.shape[0]
        h, d = self.num_heads, self.head_dim
        kv = self.kv(tokens).view(t, 2, h, d)  # packed: see JaggedSelfAttentionBlock.forward
        q = torch.cat([q_query.expand(b, lq, h, d), q_target.unsqueeze(1)], dim=1).view(b * (lq + 1), h, d)
        reads = self.ops.cross_attention(q, kv, self.query_offsets(b, lq + 1, tokens.device), offsets,
                                         max_length=max_length, max_q_length=lq + 1).view(b, lq + 1, h * d)
        return reads[:, :lq].reshape(b * lq, h * d), reads[:, lq].contiguous()

    def summaries(self, read_query: torch.Tensor, read_target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reads projected back: `[B, K, d_model]` and `[B, d_model]`."""
        b = read_target.shape[0]
        return self.query_out(read_query).view(b, self.query_tokens.shape[0], -1), self.target_out(read_target)


class CrossNetwork(nn.Module):
    """DCN-v2 cross layers: x_{l+1} = x_0 * W_l(x_l) + x_l, `[B, F] -> [B, F]`."""

    def __init__(self, ops: OpSettings, width: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(ops.linear(width, width) for _ in range(num_layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for layer in self.layers:
            x = x0 * layer(x) + x
        return x
