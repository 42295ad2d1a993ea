"""GEM-like ranker: jagged packing against a loop, forward/backward on every recipe, and config plumbing."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from gem_lp.attention import jagged_attention, jagged_attention_kvpacked, jagged_attention_qkvpacked
from gem_lp.data import CAND_ITEM, HIST_ITEM, PlantedTeacher, SparseFeatureSpec, SyntheticDataConfig, make_batch
from gem_lp.models import GemModelConfig, GemRanker, lengths_to_offsets, prefix_rows, prepend_tokens
from gem_lp.models.blocks import OpSettings, SequenceReadout
from gem_lp.linear import MXLinear, RMSNormMXLinear

DATA = SyntheticDataConfig(batch_size=12, num_items=200, history_mean=9.0, history_min=0, history_max=40,
                           sparse_features=(SparseFeatureSpec("a", 40, 1), SparseFeatureSpec("b", 60, 3)))
SMALL = dict(embedding_dim=32, d_model=64, num_heads=2, head_dim=32, num_blocks=2, mlp_hidden=64,
             dense_hidden=32, head_hidden=64)


@pytest.fixture(scope="module")
def batch():
    return make_batch(DATA, PlantedTeacher(DATA), 0, "train", 0)


def test_prepend_tokens_matches_a_loop():
    lengths = torch.tensor([3, 0, 5, 1, 0, 7])
    b, k, d = lengths.numel(), 2, 4
    prefix = torch.randn(b, k, d, requires_grad=True)
    values = torch.randn(int(lengths.sum()), d, requires_grad=True)
    packed, offsets, value_rows = prepend_tokens(prefix, values, lengths)
    offs = lengths_to_offsets(lengths)
    expect = torch.cat([torch.cat([prefix[i], values[offs[i]:offs[i + 1]]]) for i in range(b)])
    assert torch.equal(packed, expect)
    assert torch.equal(offsets, lengths_to_offsets(lengths + k))
    assert torch.equal(packed[value_rows], values)
    assert torch.equal(packed[prefix_rows(offsets, k)], prefix)
    g = torch.randn_like(packed)
    (packed * g).sum().backward()
    gp, gv = torch.autograd.grad((expect * g).sum(), (prefix, values))
    assert torch.equal(prefix.grad, gp) and torch.equal(values.grad, gv)


def test_prepend_tokens_errors():
    with pytest.raises(ValueError, match="lengths"):
        prepend_tokens(torch.zeros(2, 1, 4), torch.zeros(3, 4), torch.tensor([3]))
    with pytest.raises(ValueError, match="prefix must be"):
        prepend_tokens(torch.zeros(2, 4), torch.zeros(3, 4), torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="dtype"):
        prepend_tokens(torch.zeros(2, 1, 4, dtype=torch.bfloat16), torch.zeros(3, 4), torch.tensor([1, 2]))


@pytest.mark.parametrize("precision", ["bf16", "mxfp8", "fp32"])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_backward(batch, precision, causal):
    torch.manual_seed(0)
    model = GemRanker(GemModelConfig(precision=precision, causal=causal, **SMALL), DATA.feature_spec())
    logits = model(batch)
    assert logits.shape == (DATA.batch_size,) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    F.binary_cross_entropy_with_logits(logits, batch.labels).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without a gradient: {missing}"
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
    assert not bad, f"non-finite gradients: {bad}"
    assert all(float(p.grad.abs().sum()) > 0 for p in model.dense_parameters())


def test_recipes_agree_on_the_same_weights(batch):
    """MXFP8 and BF16 recipes compute the same function up to their rounding (logits and gradients)."""
    torch.manual_seed(0)
    ref = GemRanker(GemModelConfig(precision="fp32", **SMALL), DATA.feature_spec())
    out = {}
    for precision in ("fp32", "bf16", "mxfp8"):
        model = GemRanker(GemModelConfig(precision=precision, **SMALL), DATA.feature_spec())
        model.load_state_dict(ref.state_dict())
        logits = model(batch)
        F.binary_cross_entropy_with_logits(logits, batch.labels).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        out[precision] = (logits.detach(), grads)
    for precision in ("bf16", "mxfp8"):
        logits, grads = out[precision]
        assert (logits - out["fp32"][0]).abs().max() < 0.03, precision
        cos = F.cosine_similarity(grads, out["fp32"][1], dim=0)
        assert cos > 0.98, (precision, float(cos))


def test_ops_get_the_configured_recipe_and_backend():
    model = GemRanker(GemModelConfig(precision="mxfp8", backend="reference", **SMALL), DATA.feature_spec())
    linears = [m for m in model.modules() if isinstance(m, (MXLinear, RMSNormMXLinear))]
    assert len(linears) >= 10
    assert all(m.recipe == "mxfp8" and m.backend == "reference" for m in linears)
    block = model.encoder[0]
    assert block.ops.recipe == "mxfp8" and block.ops.backend == "reference"


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_mlp_hands_silu_to_its_down_projection(activation):
    """SiLU, which the MX linear computes inside its casts, is the down-projection's input activation (the hidden
    activation is never a tensor of the model's); other activations stay a step of their own. Same function."""
    from gem_lp.models.blocks import FeedForward, OpSettings

    torch.manual_seed(0)
    mlp = FeedForward(OpSettings("mxfp8", "reference", "const_p", 1e-6), 64, 96, activation)
    assert mlp.down.input_activation == ("silu" if activation == "silu" else None)
    assert (mlp.act is None) == (activation == "silu")
    x = torch.randn(11, 64)
    plain = mlp.down.__class__(96, 64, recipe="mxfp8", backend="reference")
    plain.load_state_dict(mlp.down.state_dict())
    assert torch.equal(mlp(x), plain(getattr(F, activation)(mlp.up(x))))


def test_attention_calls_are_jagged_and_the_readout_is_one_call(batch, monkeypatch):
    """The encoder attends within [K_sum summary ⊕ history] per user; the readout is one call in which each
    user's sequence has K + 1 queries: the K learned ones, then its candidate's."""
    calls = []
    import gem_lp.models.blocks as blocks

    def self_spy(qkv, offsets, **kw):
        calls.append((qkv[:, 0].detach().clone(), qkv[:, 1].shape, offsets, None, kw))
        return jagged_attention_qkvpacked(qkv, offsets, **kw)

    def cross_spy(q, kv, q_offsets, kv_offsets, **kw):
        calls.append((q.detach().clone(), kv[:, 0].shape, q_offsets, kv_offsets, kw))
        return jagged_attention_kvpacked(q, kv, q_offsets, kv_offsets, **kw)

    monkeypatch.setattr(blocks, "jagged_attention_qkvpacked", self_spy)
    monkeypatch.setattr(blocks, "jagged_attention_kvpacked", cross_spy)
    cfg = GemModelConfig(precision="bf16", num_summary_tokens=3, num_query_tokens=4, **{**SMALL, "num_blocks": 1})
    model = GemRanker(cfg, DATA.feature_spec())
    model(batch)
    lengths = batch.sequence_features.to_dict()[HIST_ITEM].lengths()
    seq_offsets = lengths_to_offsets(lengths + 3)
    (enc_q, enc_k, enc_qo, enc_kvo, enc_kw), (r_q, _, r_qo, r_kvo, r_kw) = calls
    assert enc_q.shape[0] == int(seq_offsets[-1]) and torch.equal(enc_qo, seq_offsets) and enc_kvo is None
    assert enc_kw["causal"] is False and enc_kw["precision"] == "bf16"
    b = DATA.batch_size
    assert r_q.shape[0] == b * 5 and torch.equal(r_qo, torch.arange(b + 1) * 5) and torch.equal(r_kvo, seq_offsets)
    learned = r_q.view(b, 5, *r_q.shape[1:])[:, :4]
    assert torch.equal(learned, learned[:1].expand_as(learned))  # the same K learned queries for every user
    assert enc_kw.get("qk_rotation") is r_kw.get("qk_rotation") is None


def test_readout_is_the_two_reads_it_replaces():
    """The readout's one call equals the learned queries attending over every sequence (`broadcast_q`) and each
    target over its own sequence, as two calls; gradients included (FP32 reference)."""
    torch.manual_seed(0)
    ops = OpSettings("fp32", "reference", "const_p", 1e-6)
    readout = SequenceReadout(ops, 64, 32, 2, 32, 3)
    offsets = torch.tensor([0, 5, 5, 38, 39, 70])
    tokens = torch.randn(70, 64, requires_grad=True)
    target = torch.randn(5, 32, requires_grad=True)
    q_query, q_target = readout.queries(target)
    got = readout.reads(tokens, offsets, q_query, q_target)
    kv = readout.kv(tokens).view(70, 2, 2, 32)
    k, v = kv.unbind(1)
    kw = dict(precision="fp32", backend="reference")
    want = (jagged_attention(q_query, k, v, None, offsets, broadcast_q=True, **kw).reshape(15, 64),
            jagged_attention(q_target, k, v, torch.arange(6), offsets, **kw).reshape(5, 64))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    probe = [torch.randn_like(w) for w in want]
    params = [tokens, target, readout.query_tokens, *readout.kv.parameters()]
    grads_got = torch.autograd.grad(sum((g * p).sum() for g, p in zip(got, probe)), params, retain_graph=True)
    grads_want = torch.autograd.grad(sum((w * p).sum() for w, p in zip(want, probe)), params)
    for g, w in zip(grads_got, grads_want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_qk_rotation_folded_into_the_projections_is_rotation_inside_attention(batch, monkeypatch):
    """`qk_rotation=hadamard` rotates Q and K through the projections' weights; the attention ops get them rotated
    (and no qk_rotation). In FP32 that is the model that rotates inside every attention op instead."""
    import gem_lp.models.blocks as blocks

    calls = []

    def spies(**extra):
        def make(op):
            def spy(*args, **kw):
                calls.append(kw.get("qk_rotation"))
                return op(*args, **{**kw, **extra})
            return spy
        monkeypatch.setattr(blocks, "jagged_attention_qkvpacked", make(jagged_attention_qkvpacked))
        monkeypatch.setattr(blocks, "jagged_attention_kvpacked", make(jagged_attention_kvpacked))

    spies()
    torch.manual_seed(0)
    folded = GemRanker(GemModelConfig(precision="fp32", qk_rotation="hadamard", **SMALL), DATA.feature_spec())
    plain = GemRanker(GemModelConfig(precision="fp32", **SMALL), DATA.feature_spec())
    plain.load_state_dict(folded.state_dict())  # the parameters stay unrotated: one state dict for both
    logits = folded(batch)
    logits.sum().backward()
    assert calls == [None] * (SMALL["num_blocks"] + 1)
    spies(qk_rotation="hadamard")
    expected = plain(batch)
    expected.sum().backward()
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    grads = dict(plain.named_parameters())
    for name, p in folded.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-3, atol=1e-5, msg=name)
    assert folded.encoder[0].qkv.rotated_rows == 2 * SMALL["num_heads"] * SMALL["head_dim"]
    assert plain.encoder[0].qkv.rotated_rows == 0


def test_mxfp8_with_qk_rotation_trains(batch):
    model = GemRanker(GemModelConfig(precision="mxfp8", qk_rotation="hadamard", **SMALL), DATA.feature_spec())
    logits = model(batch)
    logits.sum().backward()
    assert torch.isfinite(logits).all() and torch.isfinite(model.encoder[0].qkv.weight.grad).all()


def test_candidate_shares_the_item_table():
    model = GemRanker(GemModelConfig(**SMALL), DATA.feature_spec())
    tables = {c.name: c.feature_names for c in model.sequence_embeddings.embedding_configs()}
    assert tables["item"] == [HIST_ITEM, CAND_ITEM]
    assert {id(p) for p in model.embedding_parameters()}.isdisjoint({id(p) for p in model.dense_parameters()})
    assert len(model.embedding_parameters()) + len(model.dense_parameters()) == len(list(model.parameters()))


@pytest.mark.parametrize("bad, match", [
    (dict(head_dim=48), "head_dim"),
    (dict(precision="fp8"), "precision"),
    (dict(num_heads=0), "num_heads"),
    (dict(activation="tanh"), "activation"),
    (dict(qk_rotation="none"), "model.qk_rotation must be null or hadamard, got 'none'"),
    (dict(qk_rotation="hadamard", head_dim=96), "qk_rotation=hadamard needs a power-of-two model.head_dim, got 96"),
])
def test_config_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(GemModelConfig(), **bad)
    with pytest.raises(ValueError, match="unknown model config keys"):
        GemModelConfig.from_mapping({"hidden": 64})


def test_bad_dense_features(batch):
    model = GemRanker(GemModelConfig(**SMALL), DATA.feature_spec())
    wrong = dataclasses.replace(batch, dense_features=batch.dense_features[:, :5])
    with pytest.raises(ValueError, match="dense_features"):
        model(wrong)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_forward_backward_on_cuda(batch, precision):
    """KJTs built on the CPU, moved with .to(); embeddings, packing and ops run on the GPU."""
    torch.manual_seed(0)
    model = GemRanker(GemModelConfig(precision=precision, **SMALL), DATA.feature_spec()).cuda()
    b = batch.to("cuda")
    logits = model(b)
    assert logits.is_cuda and logits.shape == (DATA.batch_size,)
    F.binary_cross_entropy_with_logits(logits, b.labels).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    cpu_model = GemRanker(GemModelConfig(precision=precision, **SMALL), DATA.feature_spec())
    cpu_model.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    assert (cpu_model(batch) - logits.detach().cpu()).abs().max() < 0.05


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_users_without_history(precision):
    """An empty history still gives a sequence (its summary tokens), so every op sees Lk > 0."""
    data = dataclasses.replace(DATA, history_mean=1.2, history_sigma=1.0)
    batch = make_batch(data, PlantedTeacher(data), 0, "train", 1)
    lengths = batch.sequence_features.to_dict()[HIST_ITEM].lengths()
    assert int((lengths == 0).sum()) > 0
    model = GemRanker(GemModelConfig(precision=precision, **SMALL), data.feature_spec())
    logits = model(batch)
    F.binary_cross_entropy_with_logits(logits, batch.labels).backward()
    assert torch.isfinite(logits).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_pooled_features_are_read_by_key_not_by_position(batch):
    """A sharded EmbeddingBagCollection returns its features grouped by shard, in another order than the spec's;
    the model reads each feature by its key, so the logits do not depend on that order."""
    from torchrec import KeyedTensor

    torch.manual_seed(0)
    model = GemRanker(GemModelConfig(precision="fp32", **SMALL), DATA.feature_spec())
    expected = model(batch)
    pooled = model.pooled_embeddings

    class ReversedKeys(torch.nn.Module):
        def forward(self, features):
            out = pooled(features)
            keys = out.keys()[::-1]
            return KeyedTensor.from_tensor_list(keys, [out[k] for k in keys])

    model.pooled_embeddings = ReversedKeys()
    assert model.pooled_embeddings(batch.sparse_features).keys() == ["b", "a"]
    assert torch.equal(model(batch), expected)


def test_towers_run_from_captured_graphs_only_when_training_with_their_shapes(batch):
    """`_tower` dispatch (no GPU here: the captured callables are stand-ins that record their calls)."""
    from gem_lp.models.ranker import _CapturedTowers

    torch.manual_seed(0)
    model = GemRanker(GemModelConfig(precision="fp32", **SMALL), DATA.feature_spec())
    expected = model(batch)
    calls = []

    def recording(name):
        def run(*inputs):
            calls.append(name)
            return getattr(model, f"{name}_tower")(*inputs)
        return run

    cfg = model.cfg
    pooled_width = len(DATA.feature_spec().pooled_features) * cfg.embedding_dim
    b, width = DATA.batch_size, cfg.attention_dim
    names = ("dense", "queries", "interaction")
    model._graphs = _CapturedTowers(towers={n: recording(n) for n in names}, shapes={
        "dense": ((b, pooled_width), (b, model.num_dense)), "queries": ((b, cfg.embedding_dim),),
        "interaction": ((b, cfg.num_summary_tokens * cfg.d_model), (b * cfg.num_query_tokens, width), (b, width),
                        (b, pooled_width + cfg.dense_hidden), (b, cfg.embedding_dim))})
    torch.testing.assert_close(model(batch), expected)
    assert calls == list(names)
    with torch.no_grad():
        model(batch)
    model.eval()
    model(batch)
    model.train()
    model._graphs.shapes["interaction"] = ((b + 1, width),)  # another batch size
    model(batch)
    assert calls == [*names, "dense", "queries"]
    model.release_cuda_graphs()
    assert model._graphs is None


def test_capture_needs_a_cuda_model_in_training_mode():
    model = GemRanker(GemModelConfig(**SMALL), DATA.feature_spec())
    with pytest.raises(ValueError, match="needs the model on a CUDA device"):
        model.capture_cuda_graphs(8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_training_steps_with_captured_towers_match_eager_ones(precision):
    """Three optimizer steps on new batches with the towers replayed from CUDA graphs give the eager model's
    parameters (the same kernels run; only who issues them changes)."""
    import copy

    data = dataclasses.replace(DATA, batch_size=64, history_mean=30.0, history_max=120)
    teacher = PlantedTeacher(data)
    torch.manual_seed(0)
    eager = GemRanker(GemModelConfig(precision=precision, **SMALL), data.feature_spec()).cuda()
    graphed = copy.deepcopy(eager)
    batches = [make_batch(data, teacher, 0, "train", i).to("cuda") for i in range(4)]
    results = []
    for model, capture in ((eager, False), (graphed, True)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)  # as the trainer, a fused optimizer
        F.binary_cross_entropy_with_logits(model(batches[0]), batches[0].labels).backward()  # builds the kernels
        opt.step()
        opt.zero_grad(set_to_none=True)
        if capture:
            model.capture_cuda_graphs(data.batch_size)
        losses = []
        for b in batches[1:]:
            loss = F.binary_cross_entropy_with_logits(model(b), b.labels)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        with torch.no_grad():  # a large update: the replays must quantize the new weights, not replay old ones
            for p in model.parameters():
                p.mul_(1.5)
        losses.append(F.binary_cross_entropy_with_logits(model(batches[-1]), batches[-1].labels).item())
        results.append((losses, {k: v.detach().clone() for k, v in model.state_dict().items()}))
    assert graphed._graphs is not None
    # equal up to the order of float32 atomics (the bias gradients' column sums)
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-4, atol=1e-6)
    for name, value in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("precision", ["fp32", "mxfp8"])
def test_graph_towers_match_what_the_forward_passes_and_own_their_parameters(batch, precision, monkeypatch):
    """What `capture_cuda_graphs` hands to `make_graphed_callables`, checked on the CPU: each tower's sample inputs
    have the shapes, dtypes and requires-grad states of the forward's inputs at this batch size, each tower module
    holds exactly the parameters its computation uses (disjoint across towers), and it computes the forward's
    outputs."""
    from gem_lp.models import ranker as ranker_module

    torch.manual_seed(0)
    model = GemRanker(GemModelConfig(precision=precision, **SMALL), DATA.feature_spec())
    seen = {}
    tower = ranker_module.GemRanker._tower

    def recording(self, name, *inputs):
        seen[name] = inputs
        return tower(self, name, *inputs)

    monkeypatch.setattr(ranker_module.GemRanker, "_tower", recording)
    model(batch)
    towers, args = model.graph_towers(DATA.batch_size, torch.device("cpu"))
    assert list(towers) == list(args) == ["dense", "queries", "interaction"]  # the order the forward calls them
    owners = {}
    for name, module in towers.items():
        assert [(t.shape, t.dtype, t.requires_grad) for t in args[name]] == \
            [(t.shape, t.dtype, t.requires_grad) for t in seen[name]], name
        out = module(*seen[name])
        expected = getattr(model, f"{name}_tower")(*seen[name])
        for o, e in zip(out if isinstance(out, tuple) else (out,), expected if isinstance(expected, tuple) else (expected,)):
            torch.testing.assert_close(o, e)
        params = {id(p) for p in module.parameters()}
        outputs = out if isinstance(out, tuple) else (out,)
        grads = torch.autograd.grad([o.float().sum() for o in outputs], list(module.parameters()), allow_unused=True)
        used = {id(p) for p, g in zip(module.parameters(), grads) if g is not None}
        assert used == params, f"{name}: parameters held but unused, or the reverse"
        for pid in params:
            assert pid not in owners, f"a parameter of {name} is also in {owners[pid]}"
            owners[pid] = name
    state_keys = set(model.state_dict())
    assert not any(k.startswith("_") for k in state_keys)  # the towers are not in the model's tree


def test_attention_offsets_come_from_the_host_lengths_that_to_keeps(batch, monkeypatch):
    """`RecBatch.to` keeps the sequence lengths of the CPU batch; the model then hands every attention layer offsets
    made on the CPU from them (no read back from the device), equal to those it packs the tokens with, and computes
    the same logits as without them."""
    import gem_lp.models.blocks as blocks

    moved = batch.to("cpu")
    assert torch.equal(moved.host_sequence_lengths, batch.sequence_features.lengths())
    assert batch.host_sequence_lengths is None  # a pipeline's batch: only `to` sets them
    seen = []

    def self_spy(qkv, offsets, **kwargs):
        seen.append(offsets)
        return jagged_attention_qkvpacked(qkv, offsets, **kwargs)

    def cross_spy(q, kv, q_offsets, kv_offsets, **kwargs):
        seen.append(kv_offsets)
        return jagged_attention_kvpacked(q, kv, q_offsets, kv_offsets, **kwargs)

    monkeypatch.setattr(blocks, "jagged_attention_qkvpacked", self_spy)
    monkeypatch.setattr(blocks, "jagged_attention_kvpacked", cross_spy)
    torch.manual_seed(0)
    model = GemRanker(GemModelConfig(precision="bf16", **SMALL), DATA.feature_spec())
    with_host = model(moved)
    host_offsets = seen[:]
    seen.clear()
    without = model(dataclasses.replace(moved, host_sequence_lengths=None))
    assert torch.equal(with_host, without)
    lengths = batch.sequence_features[HIST_ITEM].lengths()
    expected = lengths_to_offsets(lengths + model.cfg.num_summary_tokens)
    assert len(host_offsets) == len(seen) == SMALL["num_blocks"] + 1  # the encoder, then the readout
    for got, device_side in zip(host_offsets, seen):
        assert got.device.type == "cpu" and torch.equal(got, expected) and torch.equal(device_side, expected)
