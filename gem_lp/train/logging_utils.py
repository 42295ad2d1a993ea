"""Progress (a bar on a terminal, log lines otherwise), TensorBoard scalars, step timing and Triton build counts.

Messages go through Python `logging` (logger `gem_lp.train`): the command line sends them to the console and
to `train.log` in the run directory.
"""
from __future__ import annotations

import contextlib
import logging
import statistics
import sys
import time

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
    """Counts Triton kernel builds (JIT compiles, or loads from Triton's on-disk cache) while active, through
    `triton.knobs.runtime.jit_post_compile_hook` (a hook already set keeps being called). A build during a timed
    training step stalls it; the trainer reports how many happened after its warm-up steps. Counts nothing
    where Triton is not installed."""

    def __init__(self):
        self.count = 0
        self._runtime = None
        self._previous = None

    def _hook(self, *args, **kwargs):
        self.count += 1
        return self._previous(*args, **kwargs) if self._previous is not None else None

    def start(self) -> "KernelBuilds":
        try:
            import triton
            self._runtime = triton.knobs.runtime
        except (ImportError, AttributeError):
            return self
        self._previous = self._runtime.jit_post_compile_hook
        self._runtime.jit_post_compile_hook = self._hook
        return self

    def stop(self) -> None:
        """Put the previous hook back (safe to call twice, or without `start`)."""
        if self._runtime is not None:
            self._runtime.jit_post_compile_hook = self._previous
            self._runtime = None

    def __enter__(self) -> "KernelBuilds":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
