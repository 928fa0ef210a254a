"""Calls of user code timed in a thread of their own (sync reward atoms, VLM tools).

Python cannot stop a thread: a call that outlasts its timeout is reported as timed out and
left running. One that never returns (a `while True`, a socket without a timeout) then
spins for the rest of the run, and a policy that keeps producing the input that hangs it
piles up such threads, each taking its share of the GIL and the cores, until the run
crawls. `StuckCalls` counts, per name, the calls left running; at `limit` of them a new
call of that name is not started (`Stuck`) until one ends.
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Callable

__all__ = ["Stuck", "StuckCalls"]


class Stuck(Exception):
    """A call not started: args[0] calls of its name still run past their timeout."""


class StuckCalls:
    def __init__(self, max_stuck: int, what: str):
        if isinstance(max_stuck, bool) or not isinstance(max_stuck, numbers.Integral) or max_stuck < 1:
            raise ValueError(f"max_stuck must be an integer >= 1, got {max_stuck!r}")
        self.limit, self.what = int(max_stuck), what  # what: "tool", "reward-atom" (the threads' names)
        self._running: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, name: str) -> int:
        """Calls of `name` left running past their timeout, now."""
        with self._lock:
            return self._running.get(name, 0)

    def run(self, name: str, work: Callable[[], None], timeout: float) -> bool:
        """work() in a daemon thread, waited on at most `timeout` s: True if it finished, False
        if it is left running (counted against `name` until it ends). work must not raise.
        Raises Stuck, starting nothing, while `limit` calls of `name` are left running."""
        with self._lock:
            if self._running.get(name, 0) >= self.limit:
                raise Stuck(self._running[name])
        done, left = threading.Event(), []

        def target():
            try:
                work()
            finally:
                with self._lock:  # done and left behind are decided under one lock: no count leaks
                    done.set()
                    if left:
                        self._running[name] -= 1

        threading.Thread(target=target, name=f"mmrl-{self.what}-{name}", daemon=True).start()
        if done.wait(timeout):
            return True
        with self._lock:
            if done.is_set():  # it finished at the deadline: its result stands
                return True
            left.append(True)
            self._running[name] = self._running.get(name, 0) + 1
            return False
