"""Fault injection for the reliability tests (tests/reliability/): a real `kill -9` at a
named point of a run.

    MMRL_CRASH_AT=checkpoint-write:3 python -m dllm_rl train ...

kills the process with SIGKILL -- no cleanup, no `finally`, no atexit, exactly like the
OOM killer or a pre-empted node -- the first time the loop reaches `checkpoint-write`
for step 3. The points, each called once per place from the loop:

    rollout           step N's rollout batch exists, no optimizer step has run yet
                      (pipelined mode: the round's first group has arrived)
    update            right after an optimizer step of step N (the first of several when
                      ppo_epochs x mini_batches > 1: the update is half done)
    checkpoint-write  inside save_checkpoint of step N: model/ written into the .tmp-*
                      directory, trainer state not yet, nothing renamed
    after-checkpoint  right after checkpoint N was renamed into place, before older
                      checkpoints are pruned

Steps are numbered as in metrics.jsonl and the checkpoint names (the first step is 1).
Without the variable a call is one comparison against None (the variable is read once,
at import).
"""

from __future__ import annotations

import os
import signal

ENV = "MMRL_CRASH_AT"
POINTS = ("rollout", "update", "checkpoint-write", "after-checkpoint")

_TARGET = os.environ.get(ENV) or None


def crash_point(name: str, step: int) -> None:
    """SIGKILL this process if MMRL_CRASH_AT == f"{name}:{step}"; otherwise nothing."""
    if _TARGET is not None and _TARGET == f"{name}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
