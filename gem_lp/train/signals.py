"""SIGINT / SIGTERM as a request to stop at the next step boundary, with a checkpoint."""
from __future__ import annotations

import os
import signal
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(Exception):
    """The run stopped on a signal after writing a checkpoint (`checkpoint` None: the run writes none,
    `trainer.checkpoint_every=null`); `exit_code` is the shell's 128 + signal number (130 for SIGINT, 143 for
    SIGTERM)."""

    def __init__(self, signum: int, step: int, checkpoint: str | None):
        self.signum = signum
        self.step = step
        self.checkpoint = checkpoint
        self.exit_code = 128 + signum
        saved = (f"checkpoint: {checkpoint} (continue with resume=true)" if checkpoint is not None else
                 "no checkpoint (trainer.checkpoint_every=null): the run cannot be continued")
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}; {saved}")


class StopRequests:
    """While active (a context manager), SIGINT and SIGTERM set `requested` to the signal number instead of
    stopping the process; the trainer checks it between steps. A second SIGINT stops at once
    (KeyboardInterrupt). Outside the main thread, where Python cannot install handlers, it does nothing."""

    def __init__(self, checkpoint: bool = True):
        self.checkpoint = checkpoint  # whether the stop writes one (the message says)
        self.requested: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signum
        # Not through logging: the signal may arrive while the main thread is inside a write to the same stream,
        # and a buffered stream refuses the reentrant write ("--- Logging error ---"). One unbuffered write to
        # stderr instead; the stop itself is logged at the step boundary.
        try:
            how = "with a checkpoint" if self.checkpoint else "without a checkpoint (trainer.checkpoint_every=null)"
            os.write(2, f"{signal.Signals(signum).name} received: stopping after the current step, {how} "
                        f"(Ctrl-C again to stop at once)\n".encode())
        except OSError:  # no stderr to write to
            pass

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


def ignore_sigint_in_worker(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: a Ctrl-C reaches every process of the terminal's group; the workers leave it
    to the main process, which stops at a step boundary and shuts them down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
