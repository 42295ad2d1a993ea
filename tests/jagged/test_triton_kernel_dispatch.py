"""How `quantize_jagged` reaches the kernel: eager calls run the op's implementation without the custom-op
dispatcher; under a dispatch mode (fake tensors, tracing) or torch.compile the registered op is called. The
launch plan is reused between calls with the same ints and never between different ones."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gem_lp.jagged.triton_kernel as tk
from gem_lp.jagged import JaggedLayout, quantize_jagged

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
OUTPUTS = ("payload_hdim", "payload_seq", "scale_hdim", "scale_seq")


def _batch(mixed_batch):
    values, offsets = mixed_batch(1, 64, torch.bfloat16, lengths=(1, 40, 0, 129))
    return values, JaggedLayout.from_offsets(offsets, values)


def _same(a, b):
    for name in OUTPUTS:
        assert torch.equal(getattr(a, name).view(torch.uint8), getattr(b, name).view(torch.uint8)), name


def test_eager_call_skips_the_dispatcher(mixed_batch, monkeypatch):
    values, layout = _batch(mixed_batch)
    want = quantize_jagged(values, layout, ("hdim", "seq"), backend="reference")

    def no_dispatch(*args):
        raise AssertionError("an eager call went through the custom op")

    monkeypatch.setattr(tk, "jagged_mx_quantize", no_dispatch)
    _same(quantize_jagged(values, layout, ("hdim", "seq"), backend="triton"), want)


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_dispatch_mode_sees_the_custom_op(mixed_batch):
    """With a dispatch mode active (what fake tensors and tracers use) the call goes through the op."""
    values, layout = _batch(mixed_batch)
    want = quantize_jagged(values, layout, ("hdim", "seq"), backend="reference")
    with _OpNames() as mode:
        got = quantize_jagged(values, layout, ("hdim", "seq"), backend="triton")
    assert "gem_lp.jagged_mx_quantize.default" in mode.names, mode.names[:20]
    _same(got, want)


def test_fake_tensors_go_through_the_op(mixed_batch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    values, layout = _batch(mixed_batch)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_values = mode.from_tensor(values)
        jmx = quantize_jagged(fake_values, layout, ("hdim", "seq"), backend="triton")
    assert jmx.payload_hdim.shape == values.shape and jmx.payload_hdim.dtype == torch.float8_e4m3fn
    assert jmx.scale_seq.shape == (1, tk.scale_sizes(layout.padded_total, 64)[1])


def test_launch_plan_reuse_follows_the_ints(mixed_batch):
    """Two batches of other sizes give other plans (grid, scale sizes), the same batch the cached one."""
    values, layout = _batch(mixed_batch)
    args = (values.shape[1], values.shape[2], values.stride(), layout.padded_total, True, True, False, True,
            False, True, None, None, None, None, None, None, False, tk._INT32_SPAN)
    assert tk._launch_plan(*args) is tk._launch_plan(*args)
    longer = (*args[:3], layout.padded_total + 128, *args[4:])
    grid, scalars, _ = tk._launch_plan(*longer)
    assert grid != tk._launch_plan(*args)[0] and scalars[3] == (layout.padded_total + 128) // 128
    # a lower int32 limit (forced int64 offsets) is a different plan
    assert tk._launch_plan(*args[:-1], 0)[2]["LARGE_OFFSETS"] and not tk._launch_plan(*args)[2]["LARGE_OFFSETS"]


@pytest.mark.parametrize("bad", [dict(rows=16), dict(max_registers=300)])
def test_invalid_options_raise_every_time(mixed_batch, bad):
    """A rejected launch is not cached as accepted."""
    from gem_lp.jagged.triton_kernel import launch

    values, layout = _batch(mixed_batch)
    payloads, scales = tk._allocate(values, layout.padded_total, True, False, False)
    for _ in range(2):
        with pytest.raises(ValueError):
            launch(values, layout.offsets, layout.scale_offsets, layout.tile_seq, layout.padded_total, payloads,
                   scales, True, **bad)
