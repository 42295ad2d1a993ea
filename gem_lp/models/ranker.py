"""GEM-like CTR ranking model (after GEM / InterFormer) on TorchRec KJT batches.

Data flow for a batch of B users (shapes for the sequence part are jagged, T = sum of history lengths):

1. Embeddings. `EmbeddingCollection` looks up the history (item and each event feature, e.g. action
   and time-gap bucket; summed per event, `[T, e]`) and the candidate item through the same item
   table (`[B, e]`).
   `EmbeddingBagCollection` mean-pools each non-sequence id feature (`[B, F_sparse * e]`); dense
   features go through an MLP (`[B, dense_hidden]`).
2. Interaction -> sequence: the pooled + dense features become K_sum summary tokens per user,
   prepended to the user's history: `[B*K_sum + T, d_model]`, jagged.
3. Sequence encoder: N pre-norm blocks of jagged self-attention (causal or not) and MLP.
4. Sequence -> interaction: the encoded summary tokens, K learned query tokens that attend over
   every user's encoded sequence, and the candidate's target attention over its user's sequence.
5. Interaction: concat(summaries, pooled sparse, dense, candidate) -> RMSNorm -> DCN cross layers
   -> 2-layer MLP -> logit.

The batch's keys and table sizes come from a `FeatureSpec` (`gem_lp.data.spec`), so any pipeline
that yields `RecBatch`es feeds the model without changing it.

Every projection is an `MXLinear` / `RMSNormMXLinear` and every attention is `jagged_attention`,
with the recipe and backend of the config. The dense input layer (`num_dense` raw features, not
necessarily a multiple of 32) and the final 1-wide logit layer stay ordinary float32 `nn.Linear`s,
as low-precision training recipes keep the first and last layers in high precision.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.modules.embedding_configs import PoolingType

from gem_lp.data.batch import RecBatch
from gem_lp.data.spec import ITEM_TABLE, FeatureSpec
from gem_lp.norm import RMSNorm

from gem_lp.models.blocks import _ACTIVATIONS, CrossNetwork, JaggedSelfAttentionBlock, OpSettings, SequenceReadout
from gem_lp.models.config import GemModelConfig
from gem_lp.models.packing import lengths_to_offsets, prefix_rows, prepend_tokens
from gem_lp.models.sequence_graphs import SequenceGraphs


class GemRanker(nn.Module):
    """CTR model; `forward(batch) -> float32 logits [B]`."""

    def __init__(self, cfg: GemModelConfig, features: FeatureSpec):
        super().__init__()
        self.cfg = cfg
        self.features = features
        ops = OpSettings(cfg.precision, cfg.backend, cfg.p_quant, cfg.norm_eps, cfg.qk_rotation)
        e, d = cfg.embedding_dim, cfg.d_model
        names = self.embedding_tables(features)
        self.sequence_embeddings = EmbeddingCollection(
            tables=[
                EmbeddingConfig(name=names["sequence_embeddings"][0], embedding_dim=e,
                                num_embeddings=features.num_items,
                                feature_names=[features.history_key, features.candidate_key]),
                *(EmbeddingConfig(name=name, embedding_dim=e, num_embeddings=f.num_embeddings, feature_names=[f.key])
                  for name, f in zip(names["sequence_embeddings"][1:], features.event_features)),
            ],
            device=torch.device("cpu"),
        )
        self.pooled_embeddings = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=name, embedding_dim=e, num_embeddings=f.num_embeddings,
                                   feature_names=[f.key], pooling=PoolingType.MEAN)
                for name, f in zip(names["pooled_embeddings"], features.pooled_features)
            ],
            device=torch.device("cpu"),
        )
        self.num_dense = features.num_dense
        self.dense_input = nn.Linear(features.num_dense, cfg.dense_hidden)  # float32: raw inputs, no MX blocks
        self.dense_act = _ACTIVATIONS[cfg.activation]
        self.dense_mlp = ops.linear(cfg.dense_hidden, cfg.dense_hidden)

        non_sequence = len(features.pooled_features) * e + cfg.dense_hidden
        k_sum = cfg.num_summary_tokens
        self.summary_base = nn.Parameter(torch.randn(k_sum, d) * d**-0.5)
        self.summary_proj = ops.norm_linear(non_sequence, k_sum * d)
        self.history_proj = ops.linear(e, d) if e != d else None
        self.encoder = nn.ModuleList(
            JaggedSelfAttentionBlock(ops, d, cfg.num_heads, cfg.head_dim, cfg.mlp_hidden, cfg.activation, cfg.causal)
            for _ in range(cfg.num_blocks)
        )
        self.readout = SequenceReadout(ops, d, e, cfg.num_heads, cfg.head_dim, cfg.num_query_tokens)

        width = d * (k_sum + cfg.num_query_tokens + 1) + non_sequence + e
        self.interaction_width = width
        self.interaction_norm = RMSNorm(width, eps=cfg.norm_eps)
        self.cross = CrossNetwork(ops, width, cfg.num_cross_layers)
        self.head_in = ops.norm_linear(width, cfg.head_hidden)
        self.head_act = _ACTIVATIONS[cfg.activation]
        self.head_mid = ops.linear(cfg.head_hidden, cfg.head_hidden)
        self.logit = nn.Linear(cfg.head_hidden, 1)  # float32 output layer
        self._graphs: _CapturedTowers | None = None  # see capture_cuda_graphs
        self._sequence_graphs: SequenceGraphs | None = None  # see capture_sequence_graphs

    @staticmethod
    def embedding_tables(features: FeatureSpec) -> dict[str, list[str]]:
        """The table names of each TorchRec module of the model built from `features` (what a sharding plan
        names): the item table and the event tables in `sequence_embeddings`, the pooled tables in
        `pooled_embeddings`."""
        return {"sequence_embeddings": [ITEM_TABLE, *(f.table for f in features.event_features)],
                "pooled_embeddings": [f"pooled_{f.table}" for f in features.pooled_features]}

    def embedding_parameters(self) -> list[nn.Parameter]:
        """The TorchRec table weights (optimized with row-wise Adagrad)."""
        return list(self.sequence_embeddings.parameters()) + list(self.pooled_embeddings.parameters())

    def dense_parameters(self) -> list[nn.Parameter]:
        """Everything else (optimized with AdamW)."""
        table_ids = {id(p) for p in self.embedding_parameters()}
        return [p for p in self.parameters() if id(p) not in table_ids]

    def forward(self, batch: RecBatch) -> torch.Tensor:
        cfg = self.cfg
        dtype = cfg.compute_dtype
        b = batch.batch_size
        if batch.dense_features.shape != (b, self.num_dense):
            raise ValueError(f"batch.dense_features must be [B, {self.num_dense}] = [{b}, {self.num_dense}], "
                             f"got {tuple(batch.dense_features.shape)}")

        spec = self.features
        seq = self.sequence_embeddings(batch.sequence_features)
        history = seq[spec.history_key].values()
        for f in spec.event_features:
            event = seq[f.key].values()
            if event.shape[0] != history.shape[0]:
                raise ValueError(f"sequence_features[{f.key!r}] must hold one id per history event "
                                 f"({spec.history_key!r}: {history.shape[0]} ids), got {event.shape[0]}")
            history = history + event
        history = history.to(dtype)
        lengths = seq[spec.history_key].lengths()
        candidate = seq[spec.candidate_key].values().to(dtype)  # [B, e]
        if candidate.shape[0] != b:
            raise ValueError(f"sequence_features[{spec.candidate_key!r}] must hold exactly one id per sample, "
                             f"got {candidate.shape[0]} ids for {b} samples")
        pooled = self.pooled_embeddings(batch.sparse_features)
        keys = [f.key for f in spec.pooled_features]
        # A sharded EmbeddingBagCollection (several processes) returns its features grouped by shard: put them back
        # in the spec's order.
        pooled = pooled.values() if pooled.keys() == keys else torch.cat([pooled[k] for k in keys], dim=1)
        pooled = pooled.to(dtype)  # [B, F_sparse * e]
        k_sum = cfg.num_summary_tokens
        non_sequence, summary = self._tower("dense", pooled, batch.dense_features.float())
        if self.history_proj is not None:
            history = self.history_proj(history)
        tokens, offsets, _ = prepend_tokens(summary, history, lengths)
        # the attention layers validate their offsets on the host: the same offsets made from the host's lengths
        # spare them a copy back from the device
        host_offsets = self._host_offsets(batch, k_sum)
        attention_offsets = offsets if host_offsets is None else host_offsets
        q_query, q_target = self._tower("queries", candidate)
        tokens, read_query, read_target = self._sequence_part(tokens, attention_offsets, host_offsets, q_query,
                                                              q_target)
        encoded_summary = tokens[prefix_rows(offsets, k_sum)].reshape(b, -1)  # [B, K_sum * d]
        return self._tower("interaction", encoded_summary, read_query, read_target, non_sequence, candidate)

    def _sequence_part(self, tokens: torch.Tensor, offsets: torch.Tensor, host_offsets: torch.Tensor | None,
                       q_query: torch.Tensor, q_target: torch.Tensor):
        """The encoder blocks over the packed tokens and the readout's reads of them: (encoded tokens, reads of the
        learned queries, reads of the targets). From a sequence graph when they are on and the batch has host
        offsets (`capture_sequence_graphs`), eagerly otherwise."""
        graphs = self._sequence_graphs
        if graphs is not None and host_offsets is not None and self.training and torch.is_grad_enabled():
            out = graphs(tokens, host_offsets, q_query, q_target)
            if out is not None:
                return out
        for block in self.encoder:
            tokens = block(tokens, offsets)
        return (tokens, *self.readout.reads(tokens, offsets, q_query, q_target))

    def kernel_ops(self) -> list[tuple[str, str]]:
        """The (op, precision) pairs of the dispatch table this model's layers run (`gem_lp.runtime.dispatch`)."""
        return kernel_ops(self.cfg.precision)

    def capture_sequence_graphs(self, max_buckets: int, max_rows: int) -> None:
        """Run the sequence part of training steps (encoder blocks, readout reads) from CUDA graphs, one captured
        per bucket of token counts when a batch of the bucket first comes, at most `max_buckets` of them and for
        buckets of at most `max_rows` rows (`gem_lp.models.sequence_graphs`). Needs the model on a CUDA device and
        batches that carry their host sequence lengths (as the trainer's loaders make them); parameters must be
        updated in place; each training forward's backward must run before the next training forward (the graphs
        share their buffers and one memory pool). Call after a training step (every kernel built)."""
        device = next(self.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"capture_sequence_graphs needs the model on a CUDA device, got {device}")
        self._sequence_graphs = SequenceGraphs(self.encoder, self.readout, max_buckets, max_rows)

    def _host_offsets(self, batch: RecBatch, k_sum: int) -> torch.Tensor | None:
        """The packed sequences' offsets (`prepend_tokens`'s) on the CPU, from `batch.host_sequence_lengths`; None
        without them."""
        host = batch.host_sequence_lengths
        if host is None:
            return None
        keys, b = batch.sequence_features.keys(), batch.batch_size
        i = keys.index(self.features.history_key)
        return lengths_to_offsets(host[i * b:(i + 1) * b].to(torch.int64) + k_sum)

    def dense_tower(self, pooled: torch.Tensor, dense_features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pooled `[B, F_sparse * e]` (compute dtype), dense features `[B, num_dense]` float32 -> (non-sequence
        features `[B, F_sparse * e + dense_hidden]`, summary tokens `[B, K_sum, d_model]`)."""
        cfg = self.cfg
        dense = self.dense_act(self.dense_input(dense_features)).to(pooled.dtype)
        dense = self.dense_act(self.dense_mlp(dense))
        non_sequence = torch.cat([pooled, dense], dim=1)
        summary = self.summary_proj(non_sequence).view(pooled.shape[0], cfg.num_summary_tokens, cfg.d_model)
        return non_sequence, summary + self.summary_base.to(pooled.dtype)

    def queries_tower(self, candidate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """candidate `[B, e]` -> the readout's learned queries `[K, h, d]` and target queries `[B, h, d]`."""
        return self.readout.queries(candidate)

    def interaction_tower(self, encoded_summary: torch.Tensor, read_query: torch.Tensor, read_target: torch.Tensor,
                          non_sequence: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
        """The encoded summary tokens `[B, K_sum * d]`, the readout's reads `[B * K, h * d]` and `[B, h * d]`, the
        non-sequence features and the candidate `[B, e]` -> float32 logits `[B]`."""
        query_summary, target_summary = self.readout.summaries(read_query, read_target)
        features = torch.cat([encoded_summary, query_summary.reshape(encoded_summary.shape[0], -1), target_summary,
                              non_sequence, candidate], dim=1)
        x = self.cross(self.interaction_norm(features))
        x = self.head_act(self.head_mid(self.head_act(self.head_in(x))))
        return self.logit(x.float()).squeeze(1)

    def _tower(self, name: str, *inputs: torch.Tensor):
        """The tower run from its CUDA graph when one was captured for these input shapes and the model trains with
        autograd on; eagerly otherwise (evaluation, another batch size)."""
        graphs = self._graphs
        if graphs is not None and self.training and torch.is_grad_enabled() and graphs.shapes[name] == tuple(
                tuple(t.shape) for t in inputs):
            return graphs.towers[name](*inputs)
        return getattr(self, f"{name}_tower")(*inputs)

    def capture_cuda_graphs(self, batch_size: int) -> None:
        """Capture the dense tower, the readout's queries and the interaction tower (the readout's output
        projections, cross layers, head, logit), forward and backward, as CUDA graphs for batches of `batch_size`
        samples (`torch.cuda.make_graphed_callables`); training steps of that batch size then replay them instead
        of issuing their kernels (11 of the model's linear layers) one by one from the host.

        Every shape in these towers is fixed by the batch size (the sequence part between them is jagged and stays
        eager). The model must be on a CUDA device and in training mode; parameters must be updated in place (as
        torch's optimizers do) and not replaced afterwards. Captures after the kernels were built (a training step
        before this call), so that no kernel compiles inside the capture.
        """
        device = next(self.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"capture_cuda_graphs needs the model on a CUDA device, got {device}")
        if not self.training:
            raise ValueError("capture_cuda_graphs needs the model in training mode (model.train())")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        towers, args = self.graph_towers(batch_size, device)
        # in the order the forward calls them (their backward runs in the reverse order, as the captures assume)
        graphed = torch.cuda.make_graphed_callables(tuple(towers.values()), tuple(args.values()))
        self._graphs = _CapturedTowers(towers=dict(zip(towers, graphed)),
                                       shapes={n: tuple(tuple(t.shape) for t in a) for n, a in args.items()})

    def graph_towers(self, batch_size: int, device: torch.device) -> tuple[dict, dict]:
        """The fixed-shape towers as modules of their own ({name: module}, in the order the forward calls them) and
        random sample inputs of the shapes, dtypes and requires-grad states the forward gives them at `batch_size`
        ({name: inputs}): what `capture_cuda_graphs` hands to `make_graphed_callables`."""
        cfg, dtype = self.cfg, self.cfg.compute_dtype
        gen = torch.Generator(device=device).manual_seed(0)

        def sample(*shape, grad=True, dt=dtype):
            t = torch.randn(*shape, device=device, generator=gen).to(dt)
            return t.requires_grad_() if grad else t

        b, width = batch_size, cfg.attention_dim
        pooled_width = len(self.features.pooled_features) * cfg.embedding_dim
        args = {"dense": (sample(b, pooled_width), sample(b, self.num_dense, grad=False, dt=torch.float32)),
                "queries": (sample(b, cfg.embedding_dim),),
                "interaction": (sample(b, cfg.num_summary_tokens * cfg.d_model), sample(b * cfg.num_query_tokens, width),
                                sample(b, width), sample(b, pooled_width + cfg.dense_hidden),
                                sample(b, cfg.embedding_dim))}
        readout = self.readout
        towers = {
            "dense": _Tower(self.dense_tower, dict(dense_input=self.dense_input, dense_mlp=self.dense_mlp,
                                                   summary_proj=self.summary_proj, summary_base=self.summary_base)),
            "queries": _Tower(self.queries_tower, dict(query_tokens=readout.query_tokens,
                                                       query_proj=readout.query_proj, target_proj=readout.target_proj)),
            "interaction": _Tower(self.interaction_tower, dict(
                query_out=readout.query_out, target_out=readout.target_out, interaction_norm=self.interaction_norm,
                cross=self.cross, head_in=self.head_in, head_mid=self.head_mid, logit=self.logit)),
        }
        return towers, args

    def release_cuda_graphs(self) -> None:
        """Drop the captured graphs (and their memory pools): every tower and the encoder run eagerly again."""
        self._graphs = None
        self._sequence_graphs = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_graphs"] = state["_sequence_graphs"] = None  # CUDA graphs neither pickle nor deep-copy
        return state


class _Tower(nn.Module):
    """One of the ranker's fixed-shape towers as a module of its own, for `make_graphed_callables` (which graphs a
    module with respect to its parameters): `parts` are the ranker's layers and parameters the tower uses (shared,
    not copied); `forward` the ranker's tower method. The ranker's own module tree and state dict do not change."""

    def __init__(self, forward, parts: dict):
        super().__init__()
        for name, part in parts.items():
            setattr(self, name, part)
        object.__setattr__(self, "_tower_forward", forward)

    def forward(self, *inputs):
        return self._tower_forward(*inputs)


class _CapturedTowers(NamedTuple):
    towers: dict
    shapes: dict


def kernel_ops(precision: str) -> list[tuple[str, str]]:
    """The (op, precision) pairs of the dispatch table the ranker runs at `precision`; the first listed are those of
    its sequence part (captured in CUDA graphs on a GPU), up to and including attention."""
    if precision == "mxfp8":
        return [("linear", "mxfp8"), ("linear_weight_grad", "mxfp8"), ("rms_norm_quantize", "mxfp8"),
                ("rms_norm_backward", "fp32"), ("attention", "mxfp8")]
    if precision == "bf16":
        return [("rms_norm", "bf16"), ("attention", "bf16")]
    return [("attention", precision)]
