"""Stopping a run on a scheduler's signal (SIGTERM, SIGUSR1) without losing its finished steps.

Cluster schedulers stop a job with a signal some time before they kill it: SLURM sends SIGTERM
at the time limit or on preemption and SIGKILL `KillWait` seconds later (30 by default;
`sbatch --signal=USR1@120` sends SIGUSR1 two minutes before the end), Kubernetes sends SIGTERM
and SIGKILL after the pod's grace period (30 s). Python's default for either signal ends the
process at once, so every step since the last checkpoint (`train.save_every`) was lost.

During training, under `SignalStop`, the first such signal only sets a flag. The trainer
finishes the step it is in, saves that step's checkpoint and stops with `StoppedBySignal`, and
the CLI exits with 128 + the signal's number (143 for SIGTERM), as a process the signal ended
would; a W&B run ends preempted with that exit code (mmrl.core.wandb_run). `--resume` then goes
on as if the run had not stopped (the checkpoint is an ordinary one). A second signal acts as it
did without the handler (ends the process now): a step too long for the grace period still
leaves the previous checkpoint. Only a second signal REPEAT_WINDOW_S or more after the first
does: under a launcher (torchrun, `accelerate launch`) a worker gets the scheduler's signal
twice, once from the scheduler (SLURM signals every process of the job step) and once passed on
by the launcher a moment later, and the repeat must not end the step the first one asked to
finish. Signals before the first step (the evaluation before training) stop the run there, with
nothing to save; the final evaluation runs with the default handlers again (its step is saved
before it starts).

With several processes every rank asks, before each step, whether any rank got a signal (one
all-gather of a number), so all stop after the same step: a checkpoint is a collective.
"""

from __future__ import annotations

import os
import signal
import threading
from time import monotonic

from mmrl.core import distributed

SIGNALS = ("SIGTERM", "SIGUSR1")  # SIGINT (Ctrl-C) stays an interrupt: a person at the terminal means now
# A signal this soon after the first is the same request arriving again (a launcher passes on
# within milliseconds what the scheduler also sent the worker); later, it means "now".
REPEAT_WINDOW_S = 10.0


def stop_signals() -> list[signal.Signals]:
    """SIGNALS as this platform has them (no SIGUSR1 on Windows)."""
    return [getattr(signal, name) for name in SIGNALS if hasattr(signal, name)]


class StoppedBySignal(Exception):
    """The run stopped after `step` on `signum`; `checkpoint` holds that step (None at step 0)."""

    def __init__(self, message: str, signum: int, step: int, checkpoint):
        super().__init__(message)
        self.signum, self.step, self.checkpoint = signum, step, checkpoint

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class SignalStop:
    """While entered (in the main thread; elsewhere Python cannot install handlers and nothing
    changes), the first of SIGNALS sets `received`; `requested()` is any rank's."""

    def __init__(self):
        self.received: int | None = None
        self._received_at = 0.0  # monotonic() when the first came
        self._previous: dict[int, object] = {}

    def __enter__(self):  # -> the entered SignalStop
        if threading.current_thread() is threading.main_thread():
            for sig in stop_signals():
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)  # None: set outside Python
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        now = monotonic()
        if self.received is not None:
            if now - self._received_at < REPEAT_WINDOW_S:  # the first one again, passed on by a launcher
                return
            self.__exit__()  # a later one: as without us
            signal.raise_signal(signum)
            return
        self.received, self._received_at = signum, now
        if distributed.is_main():  # os.write: print() may be in the middle of a line in this very thread
            try:
                os.write(2, f"\n{signal.Signals(signum).name}: the run stops after the step it is in and saves it "
                            f"(send it again, {REPEAT_WINDOW_S:g} s or more from now, to stop at once)\n".encode())
            except OSError:  # stderr's reader is gone (`2>&1 | head`): raised here, it ended the step as an error
                pass

    def requested(self) -> int | None:
        """The signal any rank received (the lowest rank's that did), else None; a collective."""
        if distributed.world_size() == 1:
            return self.received
        got = [int(x) for x in distributed.gather_scalar(self.received or 0) if x]
        return got[0] if got else None
