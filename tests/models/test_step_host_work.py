"""Host work of a training step: offsets validated (a host sync on a GPU) once per tensor, per-step metadata
reused, and the q/k/v split whose backward is one stack; numerics as before."""
import pytest
import torch
import torch.nn.functional as F

from gem_lp.attention import interface, jagged_attention
from gem_lp.attention.plan import clear_plan_cache
from gem_lp.data import PlantedTeacher, SparseFeatureSpec, SyntheticDataConfig, make_batch
from gem_lp.models import GemModelConfig, GemRanker
from gem_lp.models.blocks import JaggedSelfAttentionBlock, OpSettings, SequenceReadout

DATA = SyntheticDataConfig(batch_size=6, num_items=100, history_mean=7.0, history_min=0, history_max=30,
                           sparse_features=(SparseFeatureSpec("a", 20, 1), SparseFeatureSpec("b", 30, 2)))
SMALL = dict(embedding_dim=32, d_model=64, num_heads=2, head_dim=32, num_blocks=2, mlp_hidden=64,
             dense_hidden=32, head_hidden=64)


@pytest.fixture
def checked(monkeypatch):
    """Names under which `jagged_attention` validated an offsets tensor (each a host sync on a GPU)."""
    clear_plan_cache()
    seen = []
    real = interface.check_offsets
    monkeypatch.setattr(interface, "check_offsets", lambda offs, name, total: seen.append(name) or real(offs, name, total))
    return seen


def test_offsets_are_checked_once_whatever_their_role(checked):
    """The same offsets as q_offsets of a self-attention, then as kv_offsets of a broadcast and of a cross
    attention: one check."""
    g = torch.Generator().manual_seed(3)
    offs = torch.tensor([0, 4, 4, 11])
    x = torch.randn(11, 2, 32, generator=g)
    lq = torch.randn(3, 2, 32, generator=g)
    one_per_seq = torch.randn(3, 2, 32, generator=g)
    jagged_attention(x, x, x, offs, precision="fp32")
    jagged_attention(lq, x, x, None, offs, broadcast_q=True, precision="fp32")
    jagged_attention(one_per_seq, x, x, torch.arange(4), offs, precision="fp32")
    assert checked == ["q_offsets", "q_offsets"]  # the batch offsets, then the new arange
    bad = torch.tensor([0, 5, 4, 11])
    with pytest.raises(ValueError, match="kv_offsets must be non-decreasing"):
        jagged_attention(lq, x, x, None, bad, broadcast_q=True, precision="fp32")
    with pytest.raises(ValueError, match="q_offsets must end at the number of tokens 10, got 11"):
        jagged_attention(x[:10], x[:10], x[:10], offs, precision="fp32")  # same tensor, other token count


def _batches():
    teacher = PlantedTeacher(DATA)
    return [make_batch(DATA, teacher, 0, "train", i) for i in range(3)]


def test_a_step_checks_only_the_new_batch_offsets(checked, monkeypatch):
    """After the first step, one offsets check per step (the batch's): the readout reuses its query offsets
    `0, K + 1, ..., B (K + 1)`."""
    import gem_lp.models.blocks as blocks

    torch.manual_seed(0)
    model = GemRanker(GemModelConfig(precision="mxfp8", **SMALL), DATA.feature_spec())
    query_offsets = []
    real = blocks.jagged_attention_kvpacked

    def spy(q, kv, q_offsets, kv_offsets, **kw):
        query_offsets.append(q_offsets)
        return real(q, kv, q_offsets, kv_offsets, **kw)

    monkeypatch.setattr(blocks, "jagged_attention_kvpacked", spy)
    per_step = []
    for batch in _batches():
        before = len(checked)
        F.binary_cross_entropy_with_logits(model(batch), batch.labels).backward()
        per_step.append(len(checked) - before)
    assert per_step == [2, 1, 1]
    assert len(query_offsets) == 3 and all(t is query_offsets[0] for t in query_offsets)
    per_sequence = model.cfg.num_query_tokens + 1
    assert torch.equal(query_offsets[0], torch.arange(DATA.batch_size + 1) * per_sequence)
    assert query_offsets[0].dtype == torch.int64


def test_query_offsets_per_batch_size():
    readout = SequenceReadout(OpSettings("fp32", "reference", "const_p", 1e-6), 64, 32, 2, 32, 2)
    cpu = torch.device("cpu")
    a, b = readout.query_offsets(5, 3, cpu), readout.query_offsets(3, 3, cpu)
    assert torch.equal(a, torch.arange(6) * 3) and torch.equal(b, torch.arange(4) * 3)
    assert readout.query_offsets(5, 3, cpu) is a and not torch.equal(readout.query_offsets(5, 2, cpu), a)
    assert "_query_offsets" not in dict(readout.state_dict())


def _old_split_block_forward(block, x, offsets):
    """`JaggedSelfAttentionBlock.forward` as it was: q, k, v as three selects of the QKV projection."""
    t = x.shape[0]
    qkv = block.qkv(x).view(t, 3, block.num_heads, block.head_dim)
    q, k, v = (qkv[:, i].contiguous() for i in range(3))
    ops = block.ops
    attn = jagged_attention(q, k, v, offsets, causal=block.causal, precision=ops.recipe, backend=ops.backend,
                            p_quant=ops.p_quant)
    x = x + block.out(attn.reshape(t, block.num_heads * block.head_dim))
    return x + block.mlp(x)


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("mxfp8", torch.bfloat16)])
def test_block_split_is_bitwise_the_old_one(precision, dtype):
    """The packed attention gives the same output and the same gradients (input and every parameter)."""
    torch.manual_seed(1)
    block = JaggedSelfAttentionBlock(OpSettings(precision, "reference", "const_p", 1e-6), 64, 2, 32, 96, "silu",
                                     causal=True)
    offsets = torch.tensor([0, 9, 9, 30, 37])
    x = torch.randn(37, 64).to(dtype)
    dy = torch.randn(37, 64).to(dtype)
    results = []
    for forward in (block.forward, lambda x, o: _old_split_block_forward(block, x, o)):
        block.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y = forward(xi, offsets)
        y.backward(dy)
        results.append((y.detach(), xi.grad, [p.grad.clone() for p in block.parameters()]))
    (y_new, dx_new, dp_new), (y_old, dx_old, dp_old) = results
    assert torch.equal(y_new, y_old) and torch.equal(dx_new, dx_old)
    assert all(torch.equal(a, b) for a, b in zip(dp_new, dp_old))


def test_readout_split_matches_the_old_one():
    """The readout with unbind, no learned-query offsets and cached target offsets equals the one with
    selects, explicit `[0, K]` offsets and a fresh `0..B`."""
    torch.manual_seed(2)
    readout = SequenceReadout(OpSettings("fp32", "reference", "const_p", 1e-6), 64, 32, 2, 32, 3)
    offsets = torch.tensor([0, 4, 4, 15, 20])
    tokens, target = torch.randn(20, 64), torch.randn(4, 32)
    new = readout(tokens, offsets, target)

    kv = readout.kv(tokens).view(20, 2, 2, 32)
    k, v = kv[:, 0].contiguous(), kv[:, 1].contiguous()
    q = readout.query_proj(readout.query_tokens).view(3, 2, 32)
    read = jagged_attention(q, k, v, torch.tensor([0, 3]), offsets, broadcast_q=True, precision="fp32",
                            backend="reference")
    query_summary = readout.query_out(read.reshape(12, 64)).view(4, 3, -1)
    read = jagged_attention(readout.target_proj(target).view(4, 2, 32), k, v, torch.arange(5), offsets,
                            precision="fp32", backend="reference")
    assert torch.equal(new[0], query_summary)
    assert torch.equal(new[1], readout.target_out(read.reshape(4, 64)))


def test_block_backward_writes_no_zero_filled_qkv_gradients():
    """The backward of the q/k/v split is one stack (no `select_backward`, which zero-fills a [T, 3, H, D]
    tensor per part before the three are added)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(4)
    block = JaggedSelfAttentionBlock(OpSettings("fp32", "reference", "const_p", 1e-6), 64, 2, 32, 64, "silu",
                                     causal=False)
    x = torch.randn(21, 64, requires_grad=True)
    y = block(x, torch.tensor([0, 8, 21]))
    with Ops() as ops:
        y.sum().backward()
    assert "aten.select_backward" not in ops.names
    assert "aten.stack" in ops.names or "aten.cat" in ops.names
