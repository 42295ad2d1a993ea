"""How `quantize_jagged` reaches the kernel: eager calls run the op's implementation without the custom-op
dispatcher; under a dispatch mode (fake tensors, tracing) or torch.compile the registered op is called. The
launch plan is reused between calls with the same ints and never between different ones."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gem_lp.jagged.kernels.triton_quantize as tk
import gem_lp.runtime.triton_launch as triton_launch
from launch_fakes import FakeDriver, FakeJit
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
    plan = tk._launch_plan(*longer)
    assert plan.launch.grid != tk._launch_plan(*args).launch.grid and plan.scalars[3] == (layout.padded_total + 128) // 128
    # a lower int32 limit (forced int64 offsets) is a different plan
    assert (tk._launch_plan(*args[:-1], 0).launch.kwargs["LARGE_OFFSETS"]
            and not tk._launch_plan(*args).launch.kwargs["LARGE_OFFSETS"])
    # the constexpr arguments follow the kernel's parameter order
    names = tk._jagged_mx_kernel.arg_names[-len(plan.launch.constexprs):]
    assert names[0] == "H" and plan.launch.constexprs == tuple(plan.launch.kwargs[n] for n in names)


@pytest.mark.parametrize("bad", [dict(rows=16), dict(max_registers=300)])
def test_invalid_options_raise_every_time(mixed_batch, bad):
    """A rejected launch is not cached as accepted."""
    from gem_lp.jagged.kernels.triton_quantize import launch

    values, layout = _batch(mixed_batch)
    payloads, scales = tk._allocate(values, layout.padded_total, True, False, False)
    for _ in range(2):
        with pytest.raises(ValueError):
            launch(values, layout.offsets, layout.scale_offsets, layout.tile_seq, layout.padded_total, payloads,
                   scales, True, **bad)


def test_an_unknown_launch_keyword_is_refused(mixed_batch):
    from gem_lp.jagged.kernels.triton_quantize import launch

    values, layout = _batch(mixed_batch)
    payloads, scales = tk._allocate(values, layout.padded_total, True, False, False)
    with pytest.raises(TypeError, match=r"unknown launch options \['row'\]"):
        launch(values, layout.offsets, layout.scale_offsets, layout.tile_seq, layout.padded_total, payloads,
               scales, True, row=64)


def _compiled_launch_setup(mixed_batch, monkeypatch):
    """A batch with the JIT, the compiled-launch check and the driver faked (as on CUDA, no GPU): values, layout,
    the fake JIT and hdim+seq output buffers."""
    values, layout = _batch(mixed_batch)
    jit = FakeJit(tk._jagged_mx_kernel.arg_names)
    monkeypatch.setattr(tk, "_jagged_mx_kernel", jit)
    monkeypatch.setattr(tk, "_compiled_launch", lambda v: True)
    monkeypatch.setattr(triton_launch, "_driver", FakeDriver)
    tk._launch_plan.cache_clear()
    payloads, scales = tk._allocate(values, layout.padded_total, True, True, False)
    return values, layout, jit, payloads, scales


def test_repeated_launches_skip_the_jit(mixed_batch, monkeypatch):
    """With a compiled kernel (CUDA), the first launch of a plan and pointer specialization
    goes through the JIT and later ones straight to that kernel's launcher with the same arguments plus the
    constexprs in parameter order; other dtypes or a pointer off 16-byte alignment go through the JIT again."""
    values, layout, jit, payloads, scales = _compiled_launch_setup(mixed_batch, monkeypatch)

    def go(v):
        tk.launch(v, layout.offsets, layout.scale_offsets, layout.tile_seq, layout.padded_total, payloads, scales,
                  True)

    go(values)
    assert len(jit.launches) == 1
    grid, args, kwargs = jit.launches[0]
    compiled = jit.compiled[0]
    go(values)
    go(values)
    assert len(jit.launches) == 1 and len(compiled.runs) == 2
    run = compiled.runs[0]
    assert run[:7] == (grid[0], 1, 1, 1234, "function", "packed", None)  # no enter hook: no metadata
    assert run[7:9] == (triton_launch._knobs.runtime.launch_enter_hook, triton_launch._knobs.runtime.launch_exit_hook)
    names = jit.arg_names[len(args):]
    same = [(a.data_ptr(), a.dtype) == (b.data_ptr(), b.dtype) if isinstance(a, torch.Tensor) else a == b
            for a, b in zip(run[9:9 + len(args)], args)]
    assert len(run) == 9 + len(args) + len(names) and all(same), same
    assert run[9 + len(args):] == tuple(kwargs[n] for n in names) and names[0] == "H" 
    # values at an address 2 bytes off 16-byte alignment, same shape and strides: a new specialization
    shifted = torch.empty(values.numel() + 1, dtype=values.dtype)[1:].view(values.shape).copy_(values)
    go(shifted)
    assert len(jit.launches) == 2
    go(values.float())  # another dtype
    assert len(jit.launches) == 3
    go(values)
    assert len(jit.launches) == 3 and len(compiled.runs) == 3
    # the tile table given (int64) instead of its stand-in (tile_seq, int32): another specialization
    tk.launch(values, layout.offsets, layout.scale_offsets, layout.tile_seq, layout.padded_total, payloads, scales,
              True, tile_tokens=layout.tile_tokens)
    assert len(jit.launches) == 4
    # the JIT's debug mode: every launch through the JIT
    monkeypatch.setattr(triton_launch._knobs.runtime, "debug", True)
    go(values)
    assert len(jit.launches) == 5 and len(compiled.runs) == 3
    tk._launch_plan.cache_clear()
