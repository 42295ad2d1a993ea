"""The encoder's CUDA graphs per bucket of token counts: the buckets and padding layout (CPU), the padded encoder
against the plain one (CPU, reference ops), and graphed training steps against eager ones (GPU)."""
import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from gem_lp.attention.layout import check_offsets
from gem_lp.models.blocks import JaggedSelfAttentionBlock, OpSettings, SequenceReadout
from gem_lp.models.sequence_graphs import (PAD_SEQUENCE_ROWS, SequenceGraphs, SequencePart, bucket_rows,
                                           bucket_step, pad_sequences, padded_offsets)

TOKEN_COUNTS = [0, 1, 31, 33, 127, 128, 129, 1000, 4095, 4097, 255_000, 262_143, 262_144, 262_145, 270_001]


@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
def test_a_bucket_holds_its_batch_and_its_padding(tokens):
    rows = bucket_rows(tokens)
    assert tokens <= rows < tokens + bucket_step(tokens)
    assert rows - tokens <= rows // 16 or rows < 32
    assert bucket_rows(rows) == rows  # a bucket is its own bucket
    lengths = torch.randint(0, 50, (7,))
    lengths[-1] += tokens - int(lengths.sum()) if int(lengths.sum()) <= tokens else 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    if int(offsets[-1]) != tokens:  # fewer tokens than the random lengths: one sequence holds them all
        offsets = torch.tensor([0, tokens])
    padded = padded_offsets(offsets, rows)
    check_offsets(padded, "padded", rows)
    assert padded.numel() == offsets.numel() + pad_sequences(rows)
    assert torch.equal(padded[:offsets.numel()], offsets)
    assert int((padded[offsets.numel():] - padded[offsets.numel() - 1:-1]).max()) <= PAD_SEQUENCE_ROWS


def test_the_layout_of_a_bucket_does_not_depend_on_the_batch():
    """Every batch of a bucket gives the same number of sequences (the graph's offsets have one shape)."""
    rows = bucket_rows(262_145)
    sizes = {padded_offsets(torch.tensor([0, t]), rows).numel() for t in range(rows - bucket_step(262_145) + 1,
                                                                               rows + 1, 997)}
    assert sizes == {2 + pad_sequences(rows)}
    with pytest.raises(ValueError, match="do not fit the bucket"):
        padded_offsets(torch.tensor([0, rows + 1]), rows)


def test_batches_past_the_bounds_run_eagerly():
    """A bucket above `max_rows`, or a new bucket once `max_buckets` are captured, gets no graph: the call says so
    (None) and counts the batch; nothing is captured (this runs on the CPU)."""
    ops = OpSettings("fp32", "reference", "const_p", 1e-6)
    blocks = torch.nn.ModuleList([JaggedSelfAttentionBlock(ops, 64, 2, 32, 96, "silu", causal=True)])
    graphs = SequenceGraphs(blocks, SequenceReadout(ops, 64, 32, 2, 32, 3), max_buckets=1, max_rows=1000)
    q_query, q_target = torch.randn(3, 2, 32), torch.randn(2, 2, 32)
    tokens = torch.randn(1500, 64)
    assert graphs(tokens, torch.tensor([0, 700, 1500]), q_query, q_target) is None  # bucket 1536 > 1000 rows
    graphs.graphs[(bucket_rows(600), 3)] = object()  # one graph captured (another batch size): no room for another
    assert graphs(tokens[:600], torch.tensor([0, 100, 600]), q_query, q_target) is None
    assert graphs.eager_batches == 2 and len(graphs.graphs) == 1
    with pytest.raises(ValueError, match="offsets must end at the number of tokens 600"):
        graphs(tokens[:600], torch.tensor([0, 100, 601]), q_query, q_target)
    with pytest.raises(ValueError, match="q_target must have one row per sequence"):
        graphs(tokens[:600], torch.tensor([0, 100, 600]), q_query, q_target[:1])
    with pytest.raises(ValueError, match="max_buckets and max_rows must be >= 1"):
        SequenceGraphs(blocks, graphs.readout, max_buckets=0, max_rows=1000)


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("mxfp8", torch.bfloat16)])
@pytest.mark.parametrize("lengths", [[9, 0, 21, 7], [1], [31, 33, 64]])
def test_the_padded_sequence_part_is_the_sequence_part(precision, dtype, lengths):
    """The encoder blocks and the readout's reads on the batch padded to its bucket (padding in sequences of their
    own, offsets unchecked): the batch's rows of every output and every gradient are the plain ones' (reference
    ops)."""
    torch.manual_seed(1)
    ops = OpSettings(precision, "reference", "const_p", 1e-6)
    blocks = torch.nn.ModuleList(JaggedSelfAttentionBlock(ops, 64, 2, 32, 96, "silu", causal=True) for _ in range(2))
    readout = SequenceReadout(ops, 64, 32, 2, 32, 3)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(lengths), 0)])
    t, b = int(offsets[-1]), len(lengths)
    rows = bucket_rows(t) + 3 * 32  # past the bucket too: several padding sequences, some empty
    inputs = [torch.randn(t, 64).to(dtype), torch.randn(3, 2, 32).to(dtype), torch.randn(b, 2, 32).to(dtype)]
    grads = [torch.randn(t, 64).to(dtype), torch.randn(b * 3, 64).to(dtype), torch.randn(b, 64).to(dtype)]
    params = list(blocks.parameters()) + list(readout.kv.parameters())  # what the reads use
    results = []
    for padded in (False, True):
        for p in params:
            p.grad = None
        x, q_query, q_target = (i.clone().requires_grad_() for i in inputs)
        if padded:
            part = SequencePart(blocks, readout, max_length=rows)
            y, *reads = part(torch.cat([x, x.new_zeros(rows - t, 64)]), padded_offsets(offsets, rows), q_query,
                             q_target)
            y = y[:t]
        else:
            y = x
            for block in blocks:
                y = block(y, offsets)
            reads = readout.reads(y, offsets, q_query, q_target)
        torch.autograd.backward([y, *reads], grads)
        results.append([y.detach(), *(r.detach() for r in reads), x.grad, q_query.grad, q_target.grad,
                        *(p.grad.clone() for p in params)])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert len(results[0]) == len(results[1]) == 6 + len(params)
    for i, (a, b_) in enumerate(zip(results[1], results[0])):
        torch.testing.assert_close(a, b_, **tol, msg=lambda m: f"output {i}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("precision, batch_size", [
    # the attention schedulers take a tile table above 256 sequences
    pytest.param("bf16", 64, marks=pytest.mark.xfail(
        strict=True, raises=RuntimeError, reason="FA4's varlen backward fails capture at 66 sequences (the "
        "module's docs)")),
    ("bf16", 300), ("mxfp8", 64), ("mxfp8", 300)])
def test_graphed_training_steps_are_the_eager_ones(precision, batch_size):
    """The ranker with its encoder in sequence graphs (two buckets allowed, batches of three buckets, each graph
    replayed on batches other than the one it was captured with) trains as the eager ranker: the same losses and
    parameters after a few steps, up to accumulation order."""
    from gem_lp.data import PlantedTeacher, SyntheticDataConfig, make_batch
    from gem_lp.models import GemModelConfig, GemRanker

    data = SyntheticDataConfig(batch_size=batch_size, num_items=5000, history_min=1, history_max=600, history_sigma=0.5)
    teacher = PlantedTeacher(data)
    torch.manual_seed(0)
    model_cfg = GemModelConfig(precision=precision, embedding_dim=128, d_model=256, num_heads=2, head_dim=128,
                               num_blocks=2, mlp_hidden=512, dense_hidden=128, head_hidden=256)
    eager = GemRanker(model_cfg, data.feature_spec()).cuda()
    graphed = copy.deepcopy(eager)
    by_bucket = {}
    for i in range(40):
        batch = make_batch(dataclasses.replace(data, history_mean=100), teacher, 0, "train", i)
        history = batch.sequence_features[data.feature_spec().history_key].lengths()
        tokens = int(history.sum()) + data.batch_size * model_cfg.num_summary_tokens
        by_bucket.setdefault(bucket_rows(tokens), []).append(batch)
    a, b, c = sorted(by_bucket, key=lambda r: -len(by_bucket[r]))[:3]
    assert len(by_bucket[a]) >= 3 and len(by_bucket[b]) >= 2, {r: len(v) for r, v in by_bucket.items()}
    # the first step eager (kernels built), then buckets a, b captured and replayed on other batches, c eager
    order = [by_bucket[a][0], by_bucket[a][1], by_bucket[b][0], by_bucket[c][0], by_bucket[a][2], by_bucket[b][1]]
    batches = [batch.to("cuda") for batch in order]
    losses = {}
    for name, model in (("eager", eager), ("graphed", graphed)):
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        losses[name] = []
        for i, batch in enumerate(batches):
            if name == "graphed" and i == 1:
                model.capture_sequence_graphs(max_buckets=2, max_rows=1 << 20)
            loss = F.binary_cross_entropy_with_logits(model(batch), batch.labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    graphs = graphed._sequence_graphs
    assert sorted(graphs.graphs) == sorted([(a, batch_size), (b, batch_size)]) and graphs.eager_batches == 1, (
        graphs.graphs.keys(), graphs.eager_batches)
    torch.testing.assert_close(torch.tensor(losses["graphed"]), torch.tensor(losses["eager"]), rtol=2e-3, atol=2e-3)
    for (name, a), b in zip(graphed.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3, msg=lambda m: f"{name}: {m}")
