"""AUC and NE against direct definitions; row-wise Adagrad against its formula; the LR schedule."""
import math

import pytest
import torch
import torch.nn.functional as F

from gem_lp.train import RowWiseAdagrad, binary_entropy, normalized_entropy, roc_auc, warmup_decay_lambda


def pairwise_auc(s, y):
    pos, neg = s[y == 1], s[y == 0]
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).double() + 0.5 * (diff == 0).double()).mean())


@pytest.mark.parametrize("n", [7, 100, 1001])
def test_auc_matches_pairwise_count_with_ties(n):
    g = torch.Generator().manual_seed(n)
    s = torch.randint(0, 9, (n,), generator=g).float()  # many ties
    y = (torch.rand(n, generator=g) < 0.4).float()
    y[0], y[1] = 0.0, 1.0
    assert roc_auc(s, y) == pytest.approx(pairwise_auc(s, y), abs=1e-12)
    s = torch.randn(n, generator=g)
    assert roc_auc(s, y) == pytest.approx(pairwise_auc(s, y), abs=1e-12)
    assert roc_auc(-s, y) == pytest.approx(1 - roc_auc(s, y), abs=1e-12)


def test_auc_edge_cases():
    assert math.isnan(roc_auc(torch.randn(5), torch.ones(5)))
    assert roc_auc(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0])) == 1.0
    with pytest.raises(ValueError, match="same length"):
        roc_auc(torch.randn(4), torch.ones(3))
    with pytest.raises(ValueError, match="0 or 1"):
        roc_auc(torch.randn(3), torch.tensor([0.0, 0.5, 1.0]))


def test_normalized_entropy():
    y = (torch.rand(2000, generator=torch.Generator().manual_seed(0)) < 0.2).float()
    p = float(y.double().mean())
    base = torch.full_like(y, math.log(p / (1 - p)))
    assert normalized_entropy(base, y) == pytest.approx(1.0, abs=1e-9)  # predicting the base rate: NE = 1
    good = torch.where(y == 1, 5.0, -5.0)
    assert normalized_entropy(good, y) < 0.05
    logits = torch.randn(2000)
    expect = float(F.binary_cross_entropy_with_logits(logits.double(), y.double())) / binary_entropy(p)
    assert normalized_entropy(logits, y) == pytest.approx(expect, rel=1e-12)
    assert binary_entropy(0.5) == pytest.approx(math.log(2))


def test_rowwise_adagrad_matches_its_formula():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 5))
    w0 = w.detach().clone()
    opt = RowWiseAdagrad([w], lr=0.1, eps=1e-8)
    state = torch.zeros(6)
    expect = w0.clone()
    for _ in range(3):
        grad = torch.randn(6, 5)
        grad[[1, 4]] = 0.0  # untouched rows
        w.grad = grad.clone()
        opt.step()
        state += grad.square().mean(1)
        step = 0.1 * grad / (state.sqrt() + 1e-8)[:, None]
        expect = expect - torch.where((grad != 0).any(1)[:, None], step, torch.zeros_like(step))
    torch.testing.assert_close(w.detach(), expect, rtol=1e-6, atol=1e-6)
    assert torch.equal(w.detach()[[1, 4]], w0[[1, 4]])
    sd = opt.state_dict()
    opt2 = RowWiseAdagrad([torch.nn.Parameter(w.detach().clone())], lr=0.1)
    opt2.load_state_dict(sd)
    assert torch.equal(opt2.state_dict()["state"][0]["sum"], state.float())


def test_rowwise_adagrad_weight_decay_on_touched_rows_only():
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(4, 3, generator=g)
    w = torch.nn.Parameter(w0.clone())
    opt = RowWiseAdagrad([w], lr=0.1, eps=1e-8, weight_decay=0.5)
    grad = torch.randn(4, 3, generator=g)
    grad[2] = 0.0
    w.grad = grad.clone()
    opt.step()
    decayed = grad + 0.5 * w0
    step = 0.1 * decayed / (decayed.square().mean(1).sqrt() + 1e-8)[:, None]
    touched = torch.tensor([True, True, False, True])
    torch.testing.assert_close(w.detach(), torch.where(touched[:, None], w0 - step, w0), rtol=1e-6, atol=1e-6)


def test_rowwise_adagrad_sparse_grad_and_errors():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    dense = torch.nn.Embedding(10, 4)
    dense.load_state_dict(emb.state_dict())
    idx = torch.tensor([1, 3, 3, 7])
    for module in (emb, dense):
        opt = RowWiseAdagrad(module.parameters(), lr=0.05)
        module(idx).sum().backward()
        opt.step()
    torch.testing.assert_close(emb.weight, dense.weight)
    with pytest.raises(ValueError, match="2-D"):
        RowWiseAdagrad([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="lr"):
        RowWiseAdagrad([torch.nn.Parameter(torch.zeros(3, 2))], lr=0.0)


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_warmup_then_decay(decay):
    f = warmup_decay_lambda(10, 110, decay, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    values = [f(s) for s in range(10, 111)]
    assert values[0] == pytest.approx(1.0) and values[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert f(60) == pytest.approx(0.55)  # halfway: both shapes are at the midpoint
    assert f(500) == pytest.approx(0.1)
    assert warmup_decay_lambda(0, 5, "none")(3) == 1.0
    with pytest.raises(ValueError, match="decay"):
        warmup_decay_lambda(1, 5, "step")
