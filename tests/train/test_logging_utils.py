"""Progress (a bar on a terminal only, log lines otherwise), Stopwatch (steady-state and median rates), KernelBuilds
(Triton build counter), and the quiet torch.fx deprecation."""
import logging

import sys

import pytest

from gem_lp.train.logging_utils import KernelBuilds, Progress, Stopwatch


@pytest.mark.parametrize("bar", [True, False])
def test_progress_logs_a_line_every_log_every_steps_without_a_terminal(monkeypatch, caplog, bar):
    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    caplog.set_level(logging.INFO, logger="gem_lp.train")
    progress = Progress(total=7, initial=0, bar=bar, log_every=3)
    assert progress.bar is None
    for step in range(1, 8):
        progress.update(step, loss=0.5 + step / 100, samples_per_s=1234.5, lr=1e-3)
    progress.close()
    assert [r.getMessage() for r in caplog.records] == [
        "step 3/7  loss 0.5300  samples/s 1,234  lr 1.00e-03", "step 6/7  loss 0.5600  samples/s 1,234  lr 1.00e-03"]


def test_progress_shows_a_bar_on_a_terminal(monkeypatch, caplog):
    pytest.importorskip("tqdm")
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    caplog.set_level(logging.INFO, logger="gem_lp.train")
    progress = Progress(total=4, initial=1, bar=True, log_every=1)
    assert progress.bar is not None and progress.bar.n == 1
    progress.update(2, loss=0.5, samples_per_s=10.0, lr=1e-3)
    assert progress.bar.n == 2 and not caplog.records  # the bar, not log lines
    progress.close()
    off = Progress(total=4, initial=0, bar=False, log_every=1)
    assert off.bar is None  # trainer.progress=false: log lines even on a terminal


def test_torch_fx_tracing_deprecation_is_not_logged(caplog):
    """torch's KJT metaclass calls the deprecated is_fx_tracing() on every KJT built; its warning is dropped."""
    import torch.fx._symbolic_trace as symbolic_trace

    import gem_lp.data  # noqa: F401  (installs the filter)

    caplog.set_level(logging.WARNING)
    symbolic_trace.is_fx_tracing_warning.__wrapped__()  # the warning itself, past its once-per-process cache
    logging.getLogger("torch.fx._symbolic_trace").warning("another warning of that module")
    assert [r.getMessage() for r in caplog.records] == ["another warning of that module"]


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


def test_kernel_builds_counts_cute_kernels_added_to_the_caches(monkeypatch):
    """A CuTe kernel newly held by a registered kernel cache counts as a build; after stop the count is frozen."""
    from gem_lp.runtime import builds as registry

    monkeypatch.setattr(registry, "_CACHES", {})
    cache = registry.register_cache("fake_cute_launch", {"warm": object()})
    with KernelBuilds() as builds:
        assert builds.count == 0  # what was built before start does not count
        cache["a"] = object()
        cache["b"] = object()
        assert builds.count == 2
    cache["c"] = object()
    assert builds.count == 2
    assert len(builds.builds()) == 2 and all(b.startswith("fake_cute_launch: ") for b in builds.builds())
    assert builds.new_builds() == builds.builds() and builds.new_builds() == []
