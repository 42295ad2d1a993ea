"""CUDA graphs of the ranker's sequence part (encoder blocks and readout reads), one per bucket of token counts.

The encoder's blocks (jagged self-attention and MLP, MX linears under MXFP8) and the readout's attention issue a few
hundred kernels per step, each behind tens of microseconds of Python, so on a GPU the step waits for the host. Their
shapes are fixed by the token count, which a jagged batch changes every step; a graph is therefore captured per
bucket of token counts (`bucket_rows`, at most 1/16 more rows than the batch has). A batch of T tokens runs in the
graph of its bucket R: its tokens padded with R - T zero rows that form sequences of their own, at most
`PAD_SEQUENCE_ROWS` long (`padded_offsets`): attention never mixes them with the batch's sequences, and their
outputs are dropped. The offsets reach the graph as a device tensor that the attention layers take unchecked
(`jagged_attention`'s `max_seqlen_*`), validated here on the host from the batch's host lengths instead.

Known limit: with the `bf16` recipe at 64 samples a batch (66 sequences), the capture of FlashAttention-4's varlen
backward fails on Hopper ("operation would make the legacy stream depend on a capturing blocking stream"); at 300
and 1024 samples it captures and replays exactly. A failed capture raises, naming the setting that turns the graphs
off. The trainer captures the sequence part only where every op of its plan can be captured (a plan that takes the
reference attention, which copies the offsets to the host, runs it eagerly).

The graphs of all buckets share one memory pool: a step replays one bucket's forward and then its backward, never
another bucket's in between, so what one bucket keeps from its forward for its backward can take the memory that
another's kept; only each graph's outputs and gradients are its own. At most `max_buckets` are captured, only for
buckets of at most `max_rows` rows, and any other batch runs eagerly. The row bound keeps long histories eager:
there the GPU's work per step dwarfs the host's (4x the GPU config's history, about 900k rows: GPU-bound, graphs
no faster) and a capture costs as much memory again as an eager step.
"""
from __future__ import annotations

import torch
from torch import nn

from gem_lp.attention.layout import check_offsets

# Padding rows go into sequences of at most this many rows: one attention tile.
PAD_SEQUENCE_ROWS = 128


def bucket_step(rows: int) -> int:
    """The granularity of the buckets around `rows`: 2^(bit_length(rows) - 5), 16 buckets per power of two."""
    return 1 << max(0, rows.bit_length() - 5)


def bucket_rows(tokens: int) -> int:
    """The bucket of a batch of `tokens` rows: `tokens` rounded up to a multiple of `bucket_step(tokens)` (at most
    1/16 more)."""
    step = bucket_step(tokens)
    return -(-tokens // step) * step


def pad_sequences(rows: int) -> int:
    """How many padding sequences a bucket of `rows` rows has: enough for any batch of the bucket."""
    return -(-bucket_step(rows) // PAD_SEQUENCE_ROWS)


def padded_offsets(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 `[B + 1 + pad_sequences(rows)]`: `offsets` (`[B + 1]`, ending at T <= rows) followed by the padding
    sequences that take the rows T..rows, `PAD_SEQUENCE_ROWS` at a time (the last ones empty)."""
    tokens = int(offsets[-1])
    pad, n = rows - tokens, pad_sequences(rows)
    if not 0 <= pad <= n * PAD_SEQUENCE_ROWS:
        raise ValueError(f"{tokens} tokens do not fit the bucket of {rows} rows")
    lengths = (pad - PAD_SEQUENCE_ROWS * torch.arange(n, dtype=torch.int64)).clamp(0, PAD_SEQUENCE_ROWS)
    return torch.cat([offsets.to(torch.int64), tokens + torch.cumsum(lengths, 0)])


class SequencePart(nn.Module):
    """The ranker's encoder blocks and its readout's reads as the module a graph is captured from: `(tokens [R, d],
    offsets [S + 1], q_query [K, h, d], q_target [B, h, d])` -> (encoded tokens `[R, d]`, reads `[B * K, h * d]`
    and `[B, h * d]`), the offsets taken unchecked, `max_length` bounding every sequence. The first B sequences are
    the batch's; the target queries of the others (padding) are zeros and their reads are dropped."""

    def __init__(self, blocks: nn.ModuleList, readout: nn.Module, max_length: int):
        super().__init__()
        self.blocks = blocks
        # the parameters a graph is captured for are the module's: the readout's reads use its K/V projection only
        self.kv = readout.kv
        object.__setattr__(self, "readout", readout)
        self.max_length = max_length

    def forward(self, tokens, offsets, q_query, q_target):
        for block in self.blocks:
            tokens = block(tokens, offsets, max_length=self.max_length)
        b, sequences = q_target.shape[0], offsets.shape[0] - 1
        q_all = torch.cat([q_target, q_target.new_zeros(sequences - b, *q_target.shape[1:])])
        read_query, read_target = self.readout.reads(tokens, offsets, q_query, q_all, max_length=self.max_length)
        return tokens, read_query[:b * q_query.shape[0]], read_target[:b]


class SequenceGraphs:
    """The sequence part's graphs of one model (see the module's docs); `__call__` runs a training batch through
    them."""

    def __init__(self, blocks: nn.ModuleList, readout: nn.Module, max_buckets: int, max_rows: int):
        if max_buckets < 1 or max_rows < 1:
            raise ValueError(f"max_buckets and max_rows must be >= 1, got {max_buckets} and {max_rows}")
        self.blocks, self.readout = blocks, readout
        self.max_buckets, self.max_rows = max_buckets, max_rows
        self.graphs: dict[tuple[int, int], _GraphedPart] = {}  # (bucket rows, batch size) -> the graphed part
        self.eager_batches = 0  # batches whose bucket had no graph and could not have one
        self.pool = None  # the memory pool all the graphs share, made at the first capture

    def __call__(self, tokens: torch.Tensor, host_offsets: torch.Tensor, q_query: torch.Tensor,
                 q_target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`SequencePart`'s outputs (the encoded tokens cut back to `[T, d]`, the two reads) for `tokens [T, d]` and
        their offsets on the CPU (`[B + 1]`), from the graph of the batch's bucket (captured now when there is room
        for it); None when the batch must run eagerly."""
        t = tokens.shape[0]
        host_offsets = check_offsets(host_offsets, "offsets", t)
        if host_offsets.numel() - 1 != q_target.shape[0]:
            raise ValueError(f"q_target must have one row per sequence ({host_offsets.numel() - 1}), got "
                             f"{q_target.shape[0]}")
        rows = bucket_rows(t)
        key = (rows, q_target.shape[0])  # a graph's inputs have the shapes of its bucket and batch size
        graphed = self.graphs.get(key)
        if graphed is None:
            if len(self.graphs) >= self.max_buckets or rows > self.max_rows:
                self.eager_batches += 1
                return None
            graphed = self.graphs[key] = self._capture(rows, tokens, host_offsets, q_query, q_target)
        offsets = padded_offsets(host_offsets, rows).pin_memory().to(tokens.device, non_blocking=True)
        padded = torch.cat([tokens, tokens.new_zeros(rows - t, tokens.shape[1])])
        encoded, read_query, read_target = graphed(padded, offsets, q_query, q_target)
        return encoded[:t], read_query, read_target

    def _capture(self, rows: int, tokens, host_offsets, q_query, q_target) -> "_GraphedPart":
        """The sequence part graphed for `rows` rows, captured on random inputs laid out as this batch is."""
        part = SequencePart(self.blocks, self.readout, max_length=rows)
        gen = torch.Generator(device=tokens.device).manual_seed(rows)

        def like(t: torch.Tensor, shape=None) -> torch.Tensor:
            sample = torch.randn(shape or t.shape, device=t.device, generator=gen).to(t.dtype)
            return sample.requires_grad_(t.requires_grad)

        offsets = padded_offsets(host_offsets, rows).to(tokens.device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        try:
            return _GraphedPart(part, (like(tokens, (rows, tokens.shape[1])), offsets, like(q_query), like(q_target)),
                                self.pool)
        except RuntimeError as e:
            raise RuntimeError(f"capturing the sequence part for {rows} rows ({offsets.numel() - 1} sequences) "
                               f"failed: {e}. Run it eagerly: trainer.sequence_graph_buckets=0 (or do not call "
                               f"GemRanker.capture_sequence_graphs)") from e


class _GraphedPart:
    """`module` captured as two CUDA graphs, its forward and the backward of its outputs to its differentiable inputs
    and parameters, replayed under autograd by `__call__` (as `torch.cuda.make_graphed_callables` does), both in the
    memory pool `pool`. Captured with `capture_error_mode="thread_local"`: the data loader's pinning thread calls
    CUDA while a step runs, which the global mode counts against the capture."""

    def __init__(self, module: nn.Module, sample_args: tuple, pool, warmup_iters: int = 3):
        self.inputs = tuple(sample_args)
        self.surface = self.inputs + tuple(module.parameters())
        differentiable = tuple(t for t in self.surface if t.requires_grad)
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream()):  # kernels built and the allocator warmed up off the graph
            for _ in range(warmup_iters):
                outputs = tuple(module(*sample_args))
                torch.autograd.grad(outputs, differentiable, tuple(torch.empty_like(o) for o in outputs))
            del outputs
        torch.cuda.synchronize()
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward_graph, pool=pool, capture_error_mode="thread_local"):
            self.outputs = tuple(module(*sample_args))
        self.grad_outputs = tuple(torch.empty_like(o) for o in self.outputs)
        with torch.cuda.graph(self.backward_graph, pool=pool, capture_error_mode="thread_local"):
            grads = iter(torch.autograd.grad(self.outputs, differentiable, self.grad_outputs))
        self.grad_inputs = tuple(next(grads) if t.requires_grad else None for t in self.surface)

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _Replay.apply(self, *args, *self.surface[len(self.inputs):])


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, part: _GraphedPart, *surface: torch.Tensor):
        for static, given in zip(part.inputs, surface):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        part.forward_graph.replay()
        ctx.part = part
        return tuple(o.detach() for o in part.outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor):
        part = ctx.part
        for static, given in zip(part.grad_outputs, grads):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        part.backward_graph.replay()
        return (None, *(None if g is None else g.detach() for g in part.grad_inputs))
