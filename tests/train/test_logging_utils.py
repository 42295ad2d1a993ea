"""Stopwatch (steady-state and median rates) and KernelBuilds (Triton build counter)."""
import pytest

from gem_lp.train.logging_utils import KernelBuilds, Stopwatch


def test_stopwatch_median_ignores_a_slow_step(monkeypatch):
    clock = iter([0.0, 1.0,  # warm-up step: 1 s
                  1.0, 1.1, 1.1, 1.2, 1.2, 3.2, 3.2, 3.3])  # steady: 0.1, 0.1, 2.0 (a mid-run compile), 0.1 s
    monkeypatch.setattr("gem_lp.train.logging_utils.time.perf_counter", lambda: next(clock))
    sw = Stopwatch(warmup=1)
    assert not sw.steady
    for _ in range(5):
        sw.start()
        sw.stop(10)
    assert sw.steady
    assert sw.rate == pytest.approx(40 / 2.3)  # every steady step, the slow one included
    assert sw.median_rate == pytest.approx(100.0)  # a typical step
    assert len(sw.step_rates) == 4


def test_stopwatch_median_falls_back_to_the_warmup_rate(monkeypatch):
    clock = iter([0.0, 2.0])
    monkeypatch.setattr("gem_lp.train.logging_utils.time.perf_counter", lambda: next(clock))
    sw = Stopwatch(warmup=5)
    sw.start()
    sw.stop(10)
    assert sw.median_rate == sw.rate == pytest.approx(5.0)


def test_kernel_builds_counts_and_chains_the_previous_hook():
    triton = pytest.importorskip("triton")
    runtime = triton.knobs.runtime
    seen = []
    previous = runtime.jit_post_compile_hook
    runtime.jit_post_compile_hook = lambda *a, **k: seen.append(k)
    try:
        with KernelBuilds() as builds:
            runtime.jit_post_compile_hook(key="k", fn=None)  # what Triton calls after a build
            runtime.jit_post_compile_hook(key="k2", fn=None)
        assert builds.count == 2 and len(seen) == 2
        runtime.jit_post_compile_hook(key="k3")  # after stop: the previous hook alone
        assert builds.count == 2 and len(seen) == 3
        builds.stop()  # a second stop changes nothing
    finally:
        runtime.jit_post_compile_hook = previous
