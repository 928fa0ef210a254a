"""What a held-out evaluation shows beside its metrics: its progress on stderr (EvalProgress) and
one JSONL row per item it scored (write_rows), so that a researcher sees which items a checkpoint
gets wrong.

A task's `evaluate(policy, progress=None, rows=None)` may take either keyword (the Task
protocol's `evaluate(policy)` still does): it calls `progress.expect(n)` as a stage of n
generations (answers or images) begins and `progress.advance(n)` as each batch of them is done,
and appends to `rows` one dict per item of what it already generated and scored (no extra model
calls).
"""

from __future__ import annotations

import inspect
import math
import sys
import time
from pathlib import Path
from typing import Any

from mmrl.core.jsonl import json_line
from mmrl.core.logging import atomic_path, json_safe
from mmrl.core.rewards import shortest


class EvalProgress:
    """The held-out evaluation's progress, where logging.progress is on and stderr is a terminal:
    a rich bar (generations done of those expected: answers or images, time left), gone once the
    evaluation ends. Elsewhere (a log file, CI) it draws nothing: redraws would leave a line each,
    so the caller says in one line how many generations took how long (`done`, `seconds`).
    `nested`: a training bar is live on rich's shared console; the evaluation's bar goes under it
    there (on rich before 14.1, which cannot show two, the evaluation shows none)."""

    def __init__(self, enabled: bool, description: str = "held-out evaluation", nested: bool = False):
        self.done = self.total = 0
        self._start = time.perf_counter()
        self._bar = None
        if not (enabled and sys.stderr.isatty()):
            return
        from rich.console import Console
        from rich.errors import LiveError
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("generations"), TimeRemainingColumn(), transient=True,
                       **({} if nested else {"console": Console(stderr=True)}))
        self._task = bar.add_task(description, total=None)
        try:
            bar.start()
        except LiveError:  # rich < 14.1 beside the training bar
            return
        self._bar = bar

    def expect(self, n: int) -> None:
        self.total += n
        if self._bar is not None:
            self._bar.update(self._task, total=self.total)

    def advance(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self._start

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def takes(fn, name: str) -> bool:
    """Whether `fn` accepts keyword `name` (a task's evaluate that predates it does not)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or a C callable: called as the protocol says
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


EVAL_SEED = 1234  # the sampled evaluation's seed: fixed, so before and after training are comparable


def eval_temperature(rollout) -> float:
    """The temperature sampled held-out evaluation draws at: rollout.eval_temperature where set,
    else the rollout's own."""
    t = getattr(rollout, "eval_temperature", None)
    return rollout.temperature if t is None else t


def sample_generators(items: int, samples: int, seed: int = EVAL_SEED) -> list:
    """One CPU generator per sampled answer, item-major ([item 0's samples, item 1's, ...]),
    each seeded by (seed, item, sample) alone: an item's samples do not depend on the batch it
    is decoded in (eval_batch_size), the rank that decodes it, or the items before it. A
    sampler draws a row's noise from its row's generator only."""
    import torch

    # distinct seeds for items and samples under 1_000_003 each; modulo 2**64, which manual_seed
    # takes at most (a seed of 2**24 or more, a date such as 20250101, overflowed it), the same
    # seeds below that
    return [torch.Generator().manual_seed(((seed * 1_000_003 + i) * 1_000_003 + j) % 2**64)
            for i in range(items) for j in range(samples)]


def write_rows(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """`rows` as JSONL at `path`, whole or not at all (atomic_path). A float32 score is written as
    its shortest decimal (rewards.shortest: 0.1, not 0.10000000149011612), a non-finite number
    as null (JSON has no NaN), anything else that is no JSON value as its str()."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json_line(json_safe(row, _score, str)) for row in rows)  # text as it is (a lone surrogate escaped)
    return path


def _score(v: float) -> float | None:
    return shortest(v) if math.isfinite(v) else None
