"""Direct relaunch of compiled Triton kernels (`gem_lp.runtime.triton_launch`), with the JIT and driver faked (no GPU)."""
import pytest
import torch

import gem_lp.runtime.triton_launch as triton_launch
from gem_lp.runtime.triton_launch import KernelLaunch, constexpr_values
from launch_fakes import FakeDriver, FakeJit


@pytest.fixture
def jit(monkeypatch):
    monkeypatch.setattr(triton_launch, "_driver", FakeDriver)
    return FakeJit(["a", "n", "b", "BLOCK", "FLAG"], defaults=dict(FLAG=True))  # k(a, n, b, BLOCK, FLAG=True)


def test_constexprs_in_parameter_order_with_defaults(jit):
    assert constexpr_values(jit, 3, dict(BLOCK=64, num_warps=4)) == (64, True)
    assert constexpr_values(jit, 3, dict(BLOCK=64, FLAG=False)) == (64, False)
    with pytest.raises(TypeError, match="BLOCK"):
        constexpr_values(jit, 3, dict(FLAG=False))


def test_first_launch_through_the_jit_then_directly(jit):
    launch = KernelLaunch(jit, (7, 2), 3, dict(BLOCK=64, num_warps=4))
    a, b = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    launch((a, 5, b), True)
    assert len(jit.launches) == 1 and jit.launches[0] == ((7, 2), (a, 5, b), dict(BLOCK=64, num_warps=4))
    launch((a, 5, b), True)
    launch((a.clone(), 5, b), True)  # another aligned float32 tensor: the same build
    compiled = jit.compiled[0]
    assert len(jit.launches) == 1 and len(compiled.runs) == 2
    run = compiled.runs[0]
    assert run[:9] == (7, 2, 1, 1234, "function", "packed", None, triton_launch._knobs.runtime.launch_enter_hook,
                       triton_launch._knobs.runtime.launch_exit_hook)
    assert run[9] is a and run[10:] == (5, b, 64, True)  # the arguments, then the constexprs with defaults


def test_another_build_goes_through_the_jit(jit):
    launch = KernelLaunch(jit, (1,), 3, dict(BLOCK=32))
    a, b = torch.zeros(64), torch.zeros(64)
    launch((a, 1, b), True)
    launch((a.double(), 1, b), True)  # another dtype
    shifted = torch.zeros(65)[1:]  # 4 bytes off 16-byte alignment
    launch((shifted, 1, b), True)
    launch((a, 1, None), True)  # None where a tensor was
    assert len(jit.launches) == 4
    for args in ((a, 1, b), (a.double(), 1, b), (shifted, 1, b), (a, 1, None)):
        launch(args, True)
    assert len(jit.launches) == 4 and [len(c.runs) for c in jit.compiled] == [1, 1, 1, 1]


def test_the_jit_every_time_off_the_gpu_in_debug_mode_or_when_switched_off(jit, monkeypatch):
    launch = KernelLaunch(jit, (1,), 3, dict(BLOCK=32))
    args = (torch.zeros(8), 1, torch.zeros(8))
    for _ in range(2):
        launch(args, False)  # the interpreter
    assert len(jit.launches) == 2
    launch(args, True)
    monkeypatch.setattr(triton_launch._knobs.runtime, "debug", True)
    launch(args, True)
    monkeypatch.setattr(triton_launch._knobs.runtime, "debug", False)
    assert len(jit.launches) == 4 and not any(c.runs for c in jit.compiled)
    launch(args, True)
    assert len(jit.compiled[2].runs) == 1


def test_launches_of_the_same_kernel_and_keywords_share_builds_keyed_as_the_jit_specializes(jit):
    a, b = torch.zeros(64), torch.zeros(64)
    KernelLaunch(jit, (3,), 3, dict(BLOCK=64))((a, 4096, b), True)
    other_m = KernelLaunch(jit, (5,), 3, dict(BLOCK=64))  # another plan (grid, M) of the same class
    other_m((a, 4112, b), True)  # divisible by 16 too: the build found above, launched directly on its own grid
    assert len(jit.launches) == 1 and jit.compiled[0].runs[0][:2] == (5, 1)
    for m in (4097, 1, 1 << 40):  # not divisible by 16, the constant 1, an int64: other builds, through the JIT
        other_m((a, m, b), True)
    KernelLaunch(jit, (5,), 3, dict(BLOCK=32))((a, 4096, b), True)  # other keywords: another build
    assert len(jit.launches) == 5
    other_m((a, 4099, b), True)
    assert len(jit.launches) == 5 and len(jit.compiled[1].runs) == 1


def test_constexprs_passed_by_position_select_builds_by_value(jit):
    jit.params[1].is_constexpr = True  # k(a, n: tl.constexpr, b, ...)
    launch = KernelLaunch(jit, (1,), 3, dict(BLOCK=64))
    a, b = torch.zeros(64), torch.zeros(64)
    for n in (256, 1024, 256, 1024):
        launch((a, n, b), True)
    assert len(jit.launches) == 2 and [len(c.runs) for c in jit.compiled] == [1, 1]
    assert jit.compiled[0].runs[0][10] == 256 and jit.compiled[1].runs[0][10] == 1024


def test_a_new_grid_reuses_the_setup_of_its_kernel_and_keywords(jit):
    """A plan for a new token count (a new grid, the same kernel and keywords) reuses the constexpr values and the
    builds found: nothing is recomputed from the kernel's signature."""
    first, second = KernelLaunch(jit, (3,), 3, dict(BLOCK=64)), KernelLaunch(jit, (9,), 3, dict(BLOCK=64))
    assert first.constexprs is second.constexprs and first.compiled is second.compiled
    assert KernelLaunch(jit, (3,), 3, dict(BLOCK=32)).compiled is not first.compiled
