"""Progress (a bar on a terminal, log lines otherwise), TensorBoard scalars, step timing and kernel build counts.

Messages go through Python `logging` (logger `gem_lp.train`): the command line sends them to the console and
to `train.log` in the run directory.
"""
from __future__ import annotations

import contextlib
import logging
import statistics
import sys
import time

from gem_lp.runtime.builds import cute_kernel_builds, cute_kernel_keys

log = logging.getLogger("gem_lp.train")


class Progress:
    """A tqdm bar over the training steps (postfix: loss, samples/s, LR) when `bar` is set, stderr is a terminal
    and tqdm is installed; otherwise an INFO log line every `log_every` steps. While the bar is shown, log
    records to the console are printed above it (`tqdm.contrib.logging`)."""

    def __init__(self, total: int, initial: int, bar: bool, log_every: int, enabled: bool = True):
        self.total = total
        self.log_every = max(1, log_every)
        self.enabled = enabled  # False: shows and logs nothing (the ranks other than 0 of a multi-process run)
        self.bar = None
        self._redirect = contextlib.ExitStack()
        if enabled and bar and sys.stderr.isatty():
            try:
                from tqdm import tqdm
                from tqdm.contrib.logging import logging_redirect_tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr, mininterval=0.5)
            self._redirect.enter_context(logging_redirect_tqdm([logging.getLogger()], tqdm_class=tqdm))

    def update(self, step: int, loss: float, samples_per_s: float, lr: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            if step % self.log_every == 0:
                self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{samples_per_s:,.0f}", lr=f"{lr:.2e}",
                                     refresh=False)
        elif step % self.log_every == 0:
            log.info("step %d/%d  loss %.4f  samples/s %s  lr %.2e", step, self.total, loss,
                     f"{samples_per_s:,.0f}", lr)

    def close(self) -> None:
        self._redirect.close()
        if self.bar is not None:
            self.bar.close()


class Scalars:
    """`torch.utils.tensorboard.SummaryWriter` scalars, or nothing (with one warning) when unavailable."""

    def __init__(self, log_dir: str, enabled: bool):
        self.writer = None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir)
        except ImportError as err:
            log.warning("TensorBoard logging disabled (%s); install `tensorboard` to enable it", err)

    def add(self, tag: str, value: float, step: int) -> None:
        if self.writer is not None:
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


class Stopwatch:
    """Wall time and samples of the training steps only (eval and checkpoints excluded).

    `rate` leaves out the first `warmup` steps timed in this process (allocator and cache warm-up)
    unless there are no others.
    """

    def __init__(self, warmup: int = 5):
        self.warmup = warmup
        self.seconds = 0.0  # steady-state steps
        self.samples = 0
        self.warmup_seconds = 0.0
        self.warmup_samples = 0
        self.step_rates: list[float] = []  # samples/s of each steady-state step timed in this process
        self._steps_this_process = 0
        self._start = 0.0

    @property
    def steady(self) -> bool:
        """The next step counts toward `rate` (the warm-up steps of this process are over)."""
        return self._steps_this_process >= self.warmup

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self, samples: int) -> None:
        elapsed = time.perf_counter() - self._start
        if self._steps_this_process < self.warmup:
            self.warmup_seconds += elapsed
            self.warmup_samples += samples
        else:
            self.seconds += elapsed
            self.samples += samples
            if elapsed > 0:
                self.step_rates.append(samples / elapsed)
        self._steps_this_process += 1

    @property
    def rate(self) -> float:
        if self.seconds > 0:
            return self.samples / self.seconds
        return self.warmup_samples / self.warmup_seconds if self.warmup_seconds > 0 else 0.0

    @property
    def median_rate(self) -> float:
        """Median samples/s over the steady-state steps of this process: a typical step, which a few slow ones
        (a kernel compiled mid-run, a host hiccup) do not move; `rate` where no step was timed."""
        return statistics.median(self.step_rates) if self.step_rates else self.rate


class KernelBuilds:
    """Counts kernel builds while active: Triton's (JIT compiles, or loads from Triton's on-disk cache) through
    `triton.knobs.runtime.jit_post_compile_hook` (a hook already set keeps being called), and CuTe DSL kernels
    newly held by the in-memory caches (`gem_lp.runtime.builds.cute_kernel_builds`). A build during a timed training step
    stalls it; the trainer reports how many happened after its warm-up steps. Counts no Triton builds where Triton
    is not installed."""

    def __init__(self):
        self._triton = 0
        self._triton_builds: list[str] = []
        self._cute_keys: set[str] = set()
        self._cute_end_keys: set[str] | None = None
        self._triton_reported = 0
        self._cute_reported: set[str] = set()
        self._cute_start = None
        self._cute_end = None
        self._runtime = None
        self._previous = None

    @property
    def count(self) -> int:
        if self._cute_start is None:
            return self._triton
        cute_now = self._cute_end if self._cute_end is not None else cute_kernel_builds()
        return self._triton + cute_now - self._cute_start

    def builds(self) -> list[str]:
        """What was built: Triton's description of each build (kernel, launch options, argument
        specializations) and the cache and compile key of each new CuTe kernel."""
        now = self._cute_end_keys if self._cute_end_keys is not None else cute_kernel_keys()
        return self._triton_builds + sorted(now - self._cute_keys)

    def new_builds(self) -> list[str]:
        """What `builds` lists that no earlier call of this method returned."""
        triton = self._triton_builds[self._triton_reported:]
        self._triton_reported = len(self._triton_builds)
        cute = sorted(set(self.builds()[len(self._triton_builds):]) - self._cute_reported)
        self._cute_reported.update(cute)
        return triton + cute

    def _hook(self, *args, **kwargs):
        self._triton += 1
        compiled = kwargs.get("compile") or {}
        # the name, options and argument types, then what a new token count can change: constexprs, specializations
        self._triton_builds.append(f"{kwargs.get('repr', 'a Triton kernel')} constants={compiled.get('constants')} "
                                   f"attrs={compiled.get('configs')}" + (" (warmup)" if kwargs.get("is_manual_warmup")
                                                                        else ""))
        return self._previous(*args, **kwargs) if self._previous is not None else None

    def start(self) -> "KernelBuilds":
        self._cute_start, self._cute_end = cute_kernel_builds(), None
        self._cute_keys, self._cute_end_keys = cute_kernel_keys(), None
        try:
            import triton
            self._runtime = triton.knobs.runtime
        except (ImportError, AttributeError):
            return self
        self._previous = self._runtime.jit_post_compile_hook
        self._runtime.jit_post_compile_hook = self._hook
        return self

    def stop(self) -> None:
        """Put the previous hook back and freeze the count (safe to call twice, or without `start`)."""
        if self._cute_start is not None and self._cute_end is None:
            self._cute_end, self._cute_end_keys = cute_kernel_builds(), cute_kernel_keys()
        if self._runtime is not None:
            self._runtime.jit_post_compile_hook = self._previous
            self._runtime = None

    def __enter__(self) -> "KernelBuilds":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
