"""The per-batch plan cache: one build per offsets tensor and key, rebuilt after an in-place write."""
import gc

import torch

from gem_lp.attention.plan import _PLANS, cached_plan, clear_plan_cache


def test_built_once_per_tensor_and_key():
    clear_plan_cache()
    offs = torch.tensor([0, 3, 7])
    calls = []

    def build(tag):
        calls.append(tag)
        return torch.tensor([len(calls)])

    a = cached_plan(offs, ("fwd", 64), lambda: build("a"))
    b = cached_plan(offs, ("fwd", 64), lambda: build("b"))
    c = cached_plan(offs, ("fwd", 128), lambda: build("c"))
    assert calls == ["a", "c"] and a is b and not torch.equal(a, c)
    other = torch.tensor([0, 3, 7])  # equal values, another tensor: its own entry
    cached_plan(other, ("fwd", 64), lambda: build("d"))
    assert calls == ["a", "c", "d"]


def test_in_place_write_rebuilds():
    clear_plan_cache()
    offs = torch.tensor([0, 3, 7])
    first = cached_plan(offs, "k", lambda: offs.clone())
    offs[2] = 9  # bumps the version counter
    second = cached_plan(offs, "k", lambda: offs.clone())
    assert first.tolist() == [0, 3, 7] and second.tolist() == [0, 3, 9]


def test_entries_die_with_the_offsets():
    clear_plan_cache()
    offs = torch.tensor([0, 5])
    cached_plan(offs, "k", lambda: torch.zeros(1))
    assert len(_PLANS) == 1
    del offs
    gc.collect()
    assert len(_PLANS) == 0


def test_jagged_attention_checks_each_offsets_tensor_once(monkeypatch):
    """The public op validates an offsets tensor (a host copy) once per version, and again after a write."""
    import pytest

    from gem_lp.attention import interface, jagged_attention

    clear_plan_cache()
    seen = []
    real = interface.check_offsets

    def counting(offsets, name, total):
        seen.append(name)
        return real(offsets, name, total)

    monkeypatch.setattr(interface, "check_offsets", counting)
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor([0, 5, 5, 12])
    q, k, v = (torch.randn(12, 2, 32, generator=g) for _ in range(3))
    first = jagged_attention(q, k, v, offs, precision="fp32")
    second = jagged_attention(q, k, v, offs, precision="fp32")
    assert seen == ["q_offsets"] and torch.equal(first, second)
    offs[1] = 13  # now invalid: the write bumps the version, so it is checked again and rejected
    with pytest.raises(ValueError, match="non-decreasing"):
        jagged_attention(q, k, v, offs, precision="fp32")


def test_producer_builds_its_chunk_map_once_per_offsets_tensor():
    """A second producer pass over the same offsets tensor reuses its chunk map (same output); a new tensor gets
    its own."""
    from gem_lp.attention import producer

    clear_plan_cache()
    g = torch.Generator().manual_seed(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled Triton kernels take CUDA tensors
    offs = torch.tensor([0, 33, 34, 70], device=device)
    x = torch.randn(70, 2, 64, generator=g).to(torch.bfloat16).to(device)
    (first,) = producer.mx_operands([(x, offs, producer.ORIENT_SQUARE)])

    def plans():
        return sum(len(entries) for entries in _PLANS.values())

    before = plans()
    (second,) = producer.mx_operands([(x, offs, producer.ORIENT_SQUARE)])
    assert plans() == before and torch.equal(first, second)
    other = offs.clone()
    (third,) = producer.mx_operands([(x, other, producer.ORIENT_SQUARE)])
    assert plans() == before + 1 and torch.equal(third, first)
