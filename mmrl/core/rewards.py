"""Reward atoms: the public Python API for custom rewards.

An *atom* is the smallest independently checkable unit of reward: an object
exists, a count, an attribute, a relation, an answer, a format. A `Reward` is a
weighted set of atoms; `Reward.score(samples)` returns every atom's score for
every sample ([N, K]) and the weighted total ([N]).

    @reward_atom("has_answer")
    def has_answer(sample: Sample) -> bool:
        return "<answer>" in sample.completion

    @reward_atom("correct", weight=2.0, parents=("has_answer",))
    async def correct(sample: Sample) -> float:  # async atoms run concurrently
        return await judge(sample.prompt, sample.completion)

    scores = Reward([has_answer, correct]).score(samples)
    scores.total  # [N] = 1.0 * has_answer + 2.0 * correct

Rules:
- An atom returns a number: bool -> 0/1; int, float, 0-d tensor or numpy
  scalar -> float. A batched atom (`batched=True`) takes the list of samples and
  returns one number per sample (a sequence, or a 1-D tensor / ndarray).
- Causal gating: a child atom scores 0 on a sample where any of its parents
  scored below 0.5 (after the parent's own gating), and is not called for that
  sample. A batched child is called once with only the samples it must score.
- Atoms are evaluated level by level in topological order (parents first);
  within a level, sync atoms run one after another, then every call of every
  async atom runs concurrently on the Reward's event loop (one for its life, in a
  thread of its own, so loop-bound state such as a semaphore lasts between calls).
- Errors (an atom raises, returns a non-number or a non-finite value, returns
  the wrong number of values, or times out): `on_error="raise"` raises
  `RewardError` naming the atom, the sample and what went wrong;
  `on_error="zero"` scores that entry 0, counts it in `AtomScores.errors` and
  warns once per `score()` call.
- Configs name atoms as "path/to/file.py:function" (`load_atom`, `Reward.from_config`).
- Time: `AtomScores.seconds` holds each atom's wall seconds in the score() call (an async
  atom's calls overlap: until its last one ended); a training step logs their sums as
  `time/reward/<atom>` beside `time/reward`, so a slow atom (an OCR model, a judge) shows.
"""

from __future__ import annotations

import asyncio
import decimal
import difflib
import importlib.util
import inspect
import itertools
import math
import numbers
import os
import re
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mmrl.core.timeouts import Stuck, StuckCalls

__all__ = [
    "AtomScores",
    "Reward",
    "RewardAtom",
    "RewardError",
    "Sample",
    "load_atom",
    "load_atoms",
    "reward_atom",
]

_RESERVED_NAMES = ("total", "total_std", "errors", "advantage_abs")  # would clash with reward/<name> metrics


@dataclass
class Sample:
    """One generated sample to score."""

    prompt: Any
    completion: Any  # text, token ids or an image
    meta: dict | None = None  # anything else the atoms need: ground truth, task fields


class RewardError(Exception):
    """An atom failed on a sample. `.atom` is its name; `.sample_index` the index of
    the sample in the scored list (None when a batched call failed as a whole)."""

    def __init__(self, message: str, atom: str | None = None, sample_index: int | None = None):
        super().__init__(message)
        self.atom = atom
        self.sample_index = sample_index


class RewardAtom:
    """A named, weighted reward function.

    fn: `fn(sample) -> number`, or with batched=True `fn(samples) -> N numbers`;
        either may be `async def` (detected here, stored as `is_async`).
    weight: the atom's weight in the total; must be finite.
    parents: names of the atoms that gate this one (see module docstring).
    """

    def __init__(
        self,
        name: str,
        fn: Callable,
        weight: float = 1.0,
        parents: Sequence[str] | str = (),
        batched: bool = False,
    ):
        if not isinstance(name, str) or not name:
            raise ValueError(f"reward atom name must be a non-empty string, got {name!r}")
        if not callable(fn):
            raise TypeError(f"reward atom {name!r}: fn must be callable, got {type(fn).__name__}")
        # float(True) is 1.0: `weight: true` in a config would weigh 1, silently (as config keys refuse it)
        if isinstance(weight, bool) or (_is_numpy(weight) and weight.dtype == bool):
            raise ValueError(f"reward atom {name!r}: weight must be a number, got {weight!r} (a boolean)")
        try:
            weight = float(weight)
        except (TypeError, ValueError):
            raise ValueError(f"reward atom {name!r}: weight must be a number, got {weight!r}")
        if not _weight_fits(weight):
            raise ValueError(f"reward atom {name!r}: weight must be finite in float32 (the scores' dtype), "
                             f"got {weight}")
        if isinstance(parents, str):
            parents = (parents,)
        if not isinstance(parents, Sequence) or not all(isinstance(p, str) for p in parents):
            raise ValueError(f"reward atom {name!r}: parents must be a list of atom names, got {parents!r}")
        _check_signature(name, fn, batched)
        self.name = name
        self.fn = fn
        self.weight = weight
        self.parents = tuple(parents)
        self.batched = bool(batched)
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            type(fn).__call__  # an object with an `async def __call__`
        )

    def __call__(self, arg):
        """Call the wrapped function directly (handy for testing an atom by itself)."""
        return self.fn(arg)

    def __repr__(self) -> str:
        extra = "".join(
            [
                f", parents={self.parents!r}" if self.parents else "",
                ", batched=True" if self.batched else "",
                ", async" if self.is_async else "",
            ]
        )
        return f"RewardAtom({self.name!r}, weight={self.weight}{extra})"


def _check_signature(name: str, fn: Callable, batched: bool) -> None:
    """An atom is called with one argument, the Sample (batched: the list of them). A function
    that cannot take it (TRL's reward_func(prompts, completions, **kwargs), one with a second
    required argument) failed only at the first score, after the model had loaded and rolled out."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: found out when called
        return
    params = sig.parameters.values()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    required += [p for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    takes_one = bool(positional) or any(p.kind is p.VAR_POSITIONAL for p in params)
    if len(required) > 1 or not takes_one:
        called = "fn(samples) with the list of samples" if batched else "fn(sample) with one Sample"
        raise ValueError(f"reward atom {name!r}: its function takes {sig}, and an atom is called as {called} "
                         "(the prompt, completion and meta are fields of a Sample)")


def reward_atom(
    name: str, weight: float = 1.0, parents: Sequence[str] | str = (), batched: bool = False
) -> Callable[[Callable], RewardAtom]:
    """Decorator: turn a sync or async function into a `RewardAtom`."""
    if callable(name):
        raise TypeError('reward_atom needs a name: use @reward_atom("my_atom"), not @reward_atom')

    def wrap(fn: Callable) -> RewardAtom:
        return RewardAtom(name, fn, weight=weight, parents=parents, batched=batched)

    return wrap


@dataclass
class AtomScores:
    """Scores of one batch. Column k of `values` is atom `names[k]`."""

    names: list[str]
    values: Tensor  # [N, K] float32, after gating
    total: Tensor  # [N] float32 = sum_k weight_k * values[:, k]
    errors: int = 0  # evaluations that failed and were scored 0 (on_error="zero")
    failed: Tensor | None = None  # [N, K] bool: which entries those were
    # atom name -> wall seconds its calls took in the score() call that made these scores (an async
    # atom: from its level's start to the end of its last call, as its calls overlap); see add_atom_times
    seconds: dict[str, float] | None = None

    def metrics(self) -> dict[str, float]:
        """`reward/<atom>` and `reward/total` means, `reward/total_std` (unbiased;
        0 for fewer than 2 samples) and `reward/errors`. Means of an empty batch are nan."""
        out = {f"reward/{n}": float(self.values[:, k].mean()) for k, n in enumerate(self.names)}
        out["reward/total"] = float(self.total.mean())
        out["reward/total_std"] = float(self.total.std()) if len(self.total) > 1 else 0.0
        out["reward/errors"] = float(self.errors)
        return out

    def per_sample(self) -> list[dict[str, float]]:
        """One {atom name: value} dict per sample, for sample tables."""
        return [dict(zip(self.names, map(shortest, row))) for row in self.values.tolist()]

    def totals(self) -> list[float]:
        """Each sample's total, as sample tables and `sample` print it."""
        return [shortest(v) for v in self.total.tolist()]

    def select(self, idx: Tensor) -> AtomScores:
        """The rows `idx` (indices or a bool mask [N]) as a new AtomScores."""
        idx = torch.as_tensor(idx)
        failed = self.failed[idx] if self.failed is not None else None
        errors = int(failed.sum()) if failed is not None else self.errors
        return AtomScores(list(self.names), self.values[idx], self.total[idx], errors, failed, self.seconds)


def atom_times(names: Sequence[str]) -> dict[str, float]:
    """`time/reward/<atom>` of every atom, at 0: a step's per-atom reward seconds start here
    (an atom gated off everywhere, or a step without rollouts, still logs its 0)."""
    return {f"time/reward/{n}": 0.0 for n in names}


def add_atom_times(times: dict[str, float], scores: AtomScores) -> None:
    """Add the seconds each atom took in the score() call that made `scores` to `times`
    (`time/reward/<atom>`): which atom of a slow reward (an OCR model, a judge, a sandbox)
    the step's time/reward went to."""
    for name, s in (scores.seconds or {}).items():
        key = f"time/reward/{name}"
        times[key] = times.get(key, 0.0) + s


def shortest(value: float) -> float:
    """A float32 value as the shortest decimal that reads back as it: 0.1 where float() of the
    float32 gives 0.10000000149011612 (so `sample` printed a weight of 0.1 scored). A value that
    is no float32 (a float64 total) is kept as it is."""
    single = np.float32(value)
    return float(str(single)) if float(single) == value else value


class Reward:
    """A weighted set of reward atoms.

    on_error: "raise" (RewardError at the first failed evaluation) or "zero"
        (score it 0, count it in AtomScores.errors, warn once per score call).
    timeout: seconds allowed for each call of an atom; None = no limit. A sync atom then runs
        in a thread of its own so that it can be timed; one that hangs is reported as timed
        out and its thread is left behind (Python cannot stop a thread). While `max_stuck` calls
        of one atom are left so, its calls fail as timed out at once, starting no thread, so
        an atom that hangs on every sample neither piles up spinning threads nor waits out a
        timeout per sample (mmrl.core.timeouts). An async atom is
        timed on the event loop; one that blocks the loop (time.sleep, a blocking client)
        cannot be interrupted, and fails as timed out once its own running time is past it.
    """

    def __init__(
        self, atoms: Sequence[RewardAtom], *, on_error: str = "raise", timeout: float | None = None,
        max_stuck: int = 4,
    ):
        if on_error not in ("raise", "zero"):
            raise ValueError(f'on_error must be "raise" or "zero", got {on_error!r}')
        if timeout is not None and not (isinstance(timeout, numbers.Real) and 0 < timeout <= MAX_TIMEOUT):
            raise ValueError(
                f"timeout must be a positive number of seconds up to {MAX_TIMEOUT:.0f} or None, got {timeout!r}"
            )
        self._stuck = StuckCalls(max_stuck, "reward-atom")  # per atom: calls left past the timeout
        atoms = list(atoms)
        if not atoms:
            raise ValueError("a Reward needs at least one atom")
        for a in atoms:
            if not isinstance(a, RewardAtom):
                raise TypeError(
                    f"Reward atoms must be RewardAtom (use @reward_atom), got {type(a).__name__}"
                )
        by_name: dict[str, RewardAtom] = {}
        for a in atoms:
            if a.name in by_name:
                raise ValueError(f"duplicate reward atom name {a.name!r}")
            if a.name in _RESERVED_NAMES:
                raise ValueError(f"reward atom name {a.name!r} is reserved for a metric")
            if not _weight_fits(a.weight):  # changed since RewardAtom checked it
                raise ValueError(f"reward atom {a.name!r}: weight must be finite in float32, got {a.weight}")
            by_name[a.name] = a
        for a in atoms:
            for p in a.parents:
                if p not in by_name:
                    raise ValueError(
                        f"reward atom {a.name!r}: parent {p!r} is not an atom of this Reward "
                        f"(atoms: {', '.join(by_name)})"
                    )
        self.atoms = tuple(atoms)
        self.on_error = on_error
        self.timeout = None if timeout is None else float(timeout)
        self.max_stuck = self._stuck.limit
        self._levels = _topological_levels(self.atoms, by_name)
        self._loop: _EventLoop | None = None  # the async atoms' event loop, from their first call

    def __getstate__(self) -> dict:  # a copy (deepcopy, pickle) makes its own loop when it needs one
        return {**self.__dict__, "_loop": None, "_stuck": None}  # and its own count of stuck calls

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._stuck = StuckCalls(self.max_stuck, "reward-atom")

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.atoms]

    @property
    def weights(self) -> Tensor:
        return torch.tensor([a.weight for a in self.atoms], dtype=torch.float32)  # [K]

    def __repr__(self) -> str:
        return f"Reward({list(self.atoms)!r}, on_error={self.on_error!r}, timeout={self.timeout})"

    @classmethod
    def from_config(
        cls, specs: Sequence[str | Mapping], base_dir: str | Path | None = None, **kwargs
    ) -> Reward:
        """Build a Reward from atom specs (see `load_atoms`). Other keyword arguments
        (on_error, timeout) go to Reward()."""
        return cls(load_atoms(specs, base_dir), **kwargs)

    def score(self, samples: Sequence[Sample]) -> AtomScores:
        """Score every sample with every atom (see the module docstring)."""
        run = _ScoreRun(self, list(samples))
        for level in self._levels:
            async_jobs = []
            for atom in level:
                idx = run.open_indices(atom)
                if not idx:
                    continue
                if atom.is_async:
                    async_jobs.append((atom, idx))
                elif atom.batched:
                    run.settle(atom, idx, self._timed_call(run, atom, [run.samples[i] for i in idx]))
                else:
                    for i in idx:
                        run.settle(atom, [i], self._timed_call(run, atom, run.samples[i]))
            if async_jobs:
                self._run_async(run, async_jobs)
        return run.result()

    def stuck(self, name: str) -> int:
        """Calls of sync atom `name` left running past the timeout, now."""
        return self._stuck(name)

    def _timed_call(self, run: _ScoreRun, atom: RewardAtom, arg) -> tuple[Any, BaseException | None]:
        """_call, its seconds added to the atom's in `run`."""
        t0 = time.perf_counter()
        try:
            return self._call(atom, arg)
        finally:
            run.seconds[atom.name] += time.perf_counter() - t0

    def _call(self, atom: RewardAtom, arg) -> tuple[Any, BaseException | None]:
        """A sync atom's call: (result, None) or (None, what it raised, or an _AtomTimeout)."""
        if self.timeout is None:
            return _call(atom.fn, arg)
        box: list = []

        def work():
            try:
                box.append(_call(atom.fn, arg))
            except BaseException as e:  # noqa: BLE001 -- the KeyboardInterrupt _call passes on is the atom's here
                box.append((None, e))

        try:
            finished = self._stuck.run(atom.name, work, self.timeout)
        except Stuck as e:
            return None, _AtomTimeout(f"not run: {e.args[0]} earlier calls of it are still running past the "
                                      f"timeout of {self.timeout} s")
        return box[0] if finished else (None, _AtomTimeout(f"timed out after {self.timeout} s"))

    def _run_async(self, run: _ScoreRun, jobs: list) -> None:
        """All calls of this level's async atoms, concurrently; settled in atom, sample order."""
        calls = []  # (atom, indices, argument)
        for atom, idx in jobs:
            if atom.batched:
                calls.append((atom, idx, [run.samples[i] for i in idx]))
            else:
                calls.extend((atom, [i], run.samples[i]) for i in idx)
        if getattr(self, "_loop", None) is None or self._loop.pid != os.getpid():  # a forked child has no loop thread
            self._loop = _EventLoop()
        clock = _Clock()
        ends = [0.0] * len(calls)  # when each call finished (perf_counter, as the loop's thread reads it)
        t0 = time.perf_counter()
        outcomes = self._loop.run([_ended(_call_async(a.fn, arg, self.timeout, clock), ends, k)
                                   for k, (a, _, arg) in enumerate(calls)])
        last: dict[str, float] = {}
        for (atom, _, _), end in zip(calls, ends):
            last[atom.name] = max(last.get(atom.name, t0), end)
        for name, end in last.items():  # the calls overlap: an atom took until its last one ended
            run.seconds[name] += end - t0
        for (atom, idx, _), outcome in zip(calls, outcomes):
            if isinstance(outcome, BaseException):  # _call_async reports its own; this is a safety net
                outcome = (None, outcome)
            run.settle(atom, idx, outcome)


# ---------------------------------------------------------------------------- scoring internals


class _BadValue(Exception):
    """What an atom returned is not a usable score; the message says why."""


class _AtomTimeout(TimeoutError):
    pass


class _Escaped(Exception):
    """An async atom raised SystemExit or KeyboardInterrupt (the message names which)."""


def _call(fn: Callable, arg) -> tuple[Any, BaseException | None]:
    """(result, None) or (None, the exception fn raised). A SystemExit (a sys.exit() in the
    atom) is its failure too, as it is in an async atom or under a timeout; KeyboardInterrupt
    goes on up, since on this thread it may be the user's Ctrl-C."""
    try:
        return fn(arg), None
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 -- any failure of user code is reported per atom
        return None, e


async def _call_async(fn: Callable, arg, timeout: float | None, clock: _Clock) -> tuple[Any, BaseException | None]:
    """(result, None) or (None, what went wrong), as _call. The timeout counts the call's own
    time: the time the loop spent running other atoms' code (one that blocks it) is added to its
    deadline, so that only the blocking atom is failed."""
    try:
        timed = _Busy(fn(arg), clock)
        task = asyncio.ensure_future(timed)
        start, others = time.perf_counter(), clock.busy

        def charged() -> float:  # seconds since the start, less those other calls' code held the loop
            return time.perf_counter() - start - (clock.busy - others - timed.busy)

        while True:
            done, _ = await asyncio.wait({task}, timeout=None if timeout is None else max(timeout - charged(), 0.0))
            if done:
                break
            if charged() >= timeout:
                task.cancel()  # it finishes on the loop (or is left behind, where it ignores the cancel)
                return None, _AtomTimeout(f"timed out after {timeout} s")
        if timeout is not None and timed.busy > timeout:  # it blocked the loop: no wait could fire in time
            return None, _AtomTimeout(f"blocked the event loop for {timed.busy:.3g} s, past the timeout of {timeout} s "
                                      "(an async atom must await; blocking work belongs in a sync atom, which "
                                      "runs in a thread of its own)")
        return task.result(), None
    except (Exception, asyncio.CancelledError) as e:  # noqa: BLE001 -- any failure of user code is reported per
        return None, e                                 # atom, a cancellation it raised or awaited included


async def _ended(coro, ends: list, k: int):
    """Await `coro` and write the time it finished to ends[k]."""
    try:
        return await coro
    finally:
        ends[k] = time.perf_counter()


class _Clock:
    """The time the event loop has spent running atoms' own code in one score() call."""

    busy = 0.0


class _Busy:
    """Awaits a coroutine and adds up the time spent running its own code between its awaits
    (to its own `busy` and the call's `clock`): a call that blocks (time.sleep, a blocking
    client) holds the event loop, which no asyncio timeout can interrupt, so its busy time is
    how it is caught afterwards, and how the other calls' timeouts are kept from counting it."""

    def __init__(self, coro, clock: _Clock):
        self.coro, self.busy, self.clock = coro, 0.0, clock

    def __await__(self):
        steps, value, error = self.coro.__await__(), None, None
        while True:
            start = time.perf_counter()
            try:
                out = steps.throw(error) if error is not None else steps.send(value)
            except StopIteration as stop:
                self._add(time.perf_counter() - start)
                return stop.value
            except (SystemExit, KeyboardInterrupt) as e:  # would stop the loop's thread: the atom's failure
                self._add(time.perf_counter() - start)
                raise _Escaped(_describe(e)) from e
            self._add(time.perf_counter() - start)
            try:
                value, error = (yield out), None
            except BaseException as e:  # noqa: BLE001 -- e.g. a cancellation, passed on to the coroutine
                value, error = None, e

    def _add(self, seconds: float) -> None:
        self.busy += seconds
        self.clock.busy += seconds


class _ScoreRun:
    """The state of one score() call: values, failures, and how to settle outcomes."""

    def __init__(self, reward: Reward, samples: list):
        self.reward = reward
        self.samples = samples
        self.col = {a.name: k for k, a in enumerate(reward.atoms)}
        n, k = len(samples), len(reward.atoms)
        self.values = [[0.0] * k for _ in range(n)]
        self.failed = [[False] * k for _ in range(n)]
        self.failures: dict[str, list] = {}  # atom name -> [(sample index or None, message)]
        self.seconds = dict.fromkeys(self.col, 0.0)  # atom name -> wall seconds of its calls

    def open_indices(self, atom: RewardAtom) -> list[int]:
        """Samples on which no parent of `atom` scored below 0.5."""
        cols = [self.col[p] for p in atom.parents]
        return [i for i, row in enumerate(self.values) if all(row[c] >= 0.5 for c in cols)]

    def settle(self, atom: RewardAtom, idx: list[int], outcome: tuple) -> None:
        result, exc = outcome
        if exc is not None:
            what = str(exc) if isinstance(exc, _AtomTimeout | _Escaped) else _describe(exc)
            return self.fail(atom, idx, what, exc, batch=atom.batched)
        if atom.batched:
            try:
                result = _as_list(result, len(idx))
            except _BadValue as e:
                return self.fail(atom, idx, str(e), None, batch=True)
        else:
            result = [result]
        for i, value in zip(idx, result):
            try:
                self.values[i][self.col[atom.name]] = _to_float(value)
            except _BadValue as e:
                self.fail(atom, [i], str(e), None)

    def fail(self, atom, idx, what: str, cause, batch: bool = False) -> None:
        sample_index = None if batch else idx[0]
        if self.reward.on_error == "raise":
            where = (
                f"a batch of {_plural(len(idx), 'sample')} (first prompt: {_short(self.samples[idx[0]])})"
                if batch
                else f"sample {sample_index} (prompt: {_short(self.samples[sample_index])})"
            )
            raise RewardError(
                f"reward atom {atom.name!r} failed on {where}: {what}", atom.name, sample_index
            ) from cause
        for i in idx:  # the values are already 0
            self.failed[i][self.col[atom.name]] = True
        self.failures.setdefault(atom.name, []).append((sample_index, len(idx), what))

    def result(self) -> AtomScores:
        k = len(self.reward.atoms)
        values = torch.tensor(self.values, dtype=torch.float32).reshape(-1, k)  # [N, K]
        failed = torch.tensor(self.failed, dtype=torch.bool).reshape(-1, k)  # [N, K]
        total = values @ self.reward.weights  # [N]
        bad = (~torch.isfinite(total)).nonzero().flatten().tolist()
        if bad:  # every value and weight is finite in float32, their weighted sum need not be
            raise RewardError(f"the weighted total of sample {bad[0]} (prompt: {_short(self.samples[bad[0]])}) is "
                              f"{float(total[bad[0]])}: its atom scores times their weights exceed the float32 range "
                              f"({dict(zip(self.reward.names, values[bad[0]].tolist()))}, weights "
                              f"{self.reward.weights.tolist()})", None, bad[0])
        errors = int(failed.sum())
        if errors:
            parts = []
            for name, fails in self.failures.items():
                i, _, what = fails[0]
                first = "a batch" if i is None else f"sample {i}"
                parts.append(f"{name!r} on {sum(f[1] for f in fails)} (first: {first}: {what})")
            warnings.warn(
                f"{errors} reward evaluation(s) failed and scored 0: " + "; ".join(parts),
                RuntimeWarning,
                stacklevel=3,
            )
        return AtomScores(self.reward.names, values, total, errors, failed, dict(self.seconds))


def _to_float(value) -> float:
    """bool, int, float, Fraction, Decimal, 0-d tensor or numpy scalar -> finite float, else _BadValue."""
    if inspect.isawaitable(value):
        if inspect.iscoroutine(value):
            value.close()  # no "never awaited" warning
        raise _BadValue("returned an awaitable; declare the function with async def")
    if isinstance(value, Tensor) or _is_numpy(value):
        if value.ndim != 0:
            raise _BadValue(
                f"returned {_a(type(value).__name__)} of shape {tuple(value.shape)}, "
                "expected a number"
            )
        value = _read(value, "item")
    if not isinstance(value, numbers.Real | decimal.Decimal):  # Decimal is no numbers.Real, but a real number
        got = "None" if value is None else _a(type(value).__name__)
        raise _BadValue(f"returned {got}, expected a number")
    try:
        x = float(value)
    except OverflowError:
        raise _BadValue("returned a number too large for a float")
    except ValueError:  # Decimal("sNaN"), which float() refuses
        raise _BadValue(f"returned {value!r}, not a finite number")
    if not math.isfinite(x):
        raise _BadValue(f"returned {x}")  # "returned nan", "returned inf", "returned -inf"
    if abs(x) > _FLOAT32_MAX:  # finite here, but inf once stored in the float32 scores
        raise _BadValue(f"returned {x}, beyond the float32 range of the scores")
    return x


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _weight_fits(weight: float) -> bool:
    """A weight the float32 totals can hold."""
    return math.isfinite(weight) and abs(weight) <= _FLOAT32_MAX

MAX_TIMEOUT = threading.TIMEOUT_MAX  # the longest wait a thread allows (sync atoms are timed in threads)


def _as_list(result, n: int) -> list:
    """What a batched atom returned -> a list of n raw values, else _BadValue."""
    if isinstance(result, Tensor) or _is_numpy(result):
        if result.ndim != 1:
            raise _BadValue(
                f"returned {_a(type(result).__name__)} of shape {tuple(result.shape)}, "
                f"expected {n} values"
            )
        result = _read(result, "tolist")
    elif isinstance(result, (str, bytes)) or not isinstance(result, Sequence):
        got = "None" if result is None else _a(type(result).__name__)
        raise _BadValue(f"returned {got}, expected a sequence of {n} numbers")
    if len(result) != n:
        raise _BadValue(f"returned {_plural(len(result), 'value')} for {_plural(n, 'sample')}")
    return list(result)


def _read(array, method: str):
    """A tensor's or ndarray's .item() / .tolist(), which can fail (a tensor on the meta device, one
    on a GPU that has failed): the atom's failure, named, rather than a traceback out of score()."""
    try:
        return getattr(array, method)()
    except Exception as e:  # whatever the array's library raises
        where = f" on device {array.device}" if isinstance(array, Tensor) else ""
        raise _BadValue(f"returned {_a(type(array).__name__)}{where} whose values cannot be read: {_describe(e)}") from e


def _is_numpy(x) -> bool:
    return type(x).__module__ == "numpy" and hasattr(x, "ndim") and hasattr(x, "item")


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _describe(exc: BaseException) -> str:
    msg = str(exc)
    if isinstance(exc, AttributeError) and isinstance(getattr(exc, "obj", None), Sample):
        # an atom reading sample.image or sample.answer: say which fields there are
        msg += " (a Sample has prompt, completion and meta: the answer text, or the image, is sample.completion)"
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def _short(sample, limit: int = 80) -> str:
    text = repr(getattr(sample, "prompt", sample))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _topological_levels(atoms: tuple, by_name: dict) -> list[list[RewardAtom]]:
    """Group atoms by depth (no parents: 0; else 1 + deepest parent), keeping the
    user's order within a level. A parent cycle raises ValueError naming it."""
    depth: dict[str, int] = {}

    def visit(atom: RewardAtom, path: list[str]) -> int:
        if atom.name in path:
            cycle = " -> ".join(path[path.index(atom.name) :] + [atom.name])
            raise ValueError(f"reward atom {atom.name!r} is in a parent cycle: {cycle}")
        if atom.name not in depth:
            parents = [visit(by_name[p], path + [atom.name]) for p in atom.parents]
            depth[atom.name] = 1 + max(parents, default=-1)
        return depth[atom.name]

    for a in atoms:
        visit(a, [])
    levels: list[list[RewardAtom]] = [[] for _ in range(max(depth.values()) + 1)]
    for a in atoms:
        levels[depth[a.name]].append(a)
    return levels


class _EventLoop:
    """A Reward's event loop, running in a daemon thread of its own from its async atoms' first
    call on. Being one loop for the Reward's life, atoms may keep loop-bound state between
    score() calls (a semaphore that rate-limits a judge, a client session); score() may be
    called from async code or from several threads; and work an atom hands to a thread
    (asyncio.to_thread) that outlives its timeout is left behind, not waited for."""

    def __init__(self):
        self.pid = os.getpid()
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(_DaemonThreads())
        threading.Thread(target=_serve, args=(self._loop,), daemon=True, name="mmrl-reward-loop").start()
        # stopped with the Reward; at exit the daemon thread is simply left, as a sync atom's is
        weakref.finalize(self, _stop, self._loop).atexit = False

    def run(self, coros: list) -> list:
        return asyncio.run_coroutine_threadsafe(_gather(coros), self._loop).result()


def _stop(loop: asyncio.AbstractEventLoop) -> None:
    if not loop.is_closed():
        loop.call_soon_threadsafe(loop.stop)


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:  # the Reward is gone: cancel what is left (timed-out calls), briefly let it finish
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=1.0))
        loop.close()


class _DaemonThreads(ThreadPoolExecutor):
    """The loop's default executor (asyncio.to_thread): each call in a daemon thread of its own,
    so that one hanging past its atom's timeout neither holds up the next score() nor the exit
    of the process, as a timed-out sync atom's thread does not."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()

        def work():
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: BLE001 -- handed to the awaiting atom
                    future.set_exception(e)

        threading.Thread(target=work, daemon=True, name="mmrl-reward-thread").start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass  # nothing pooled; threads still running are left behind


async def _gather(aws: list) -> list:
    return await asyncio.gather(*aws, return_exceptions=True)


# ---------------------------------------------------------------------------- loading from files

_module_counter = itertools.count()


def load_atoms(specs: Sequence[str | Mapping], base_dir: str | Path | None = None,
               device: str | None = None, dtype: str | None = None) -> list[RewardAtom]:
    """The atoms of a list of specs, each "file.py:fn" or a dict
    {"path": "file.py:fn", "weight": w, "name": new_name, "parents": [names]}
    (all but "path" optional; given fields override the loaded atom's), or a learned reward
    model {"reward_model": DIR, ...} (mmrl.core.reward_models; `device` and `dtype` are its
    defaults where the spec names none).
    Parents are not checked here: they may name atoms of the Reward these are added to (a task's)."""
    if isinstance(specs, (str, Mapping)) or not isinstance(specs, Sequence):
        raise ValueError(f"reward specs must be a list, got {type(specs).__name__}")  # noqa: TRY004
    modules: dict[Path, Any] = {}  # import each file once, even for several atoms
    atoms = []
    for i, item in enumerate(specs):
        if isinstance(item, str):
            atoms.append(_load_atom(item, base_dir, modules))
            continue
        if isinstance(item, Mapping) and "reward_model" in item:
            from mmrl.core.reward_models import atom_from_spec  # transformers, only when asked for

            atoms.append(atom_from_spec(item, i, base_dir, device, dtype))
            continue
        if not isinstance(item, Mapping) or "path" not in item:
            raise ValueError(
                f"reward spec {i} must be 'file.py:fn' or a dict with a 'path' or a 'reward_model', got {item!r}"
            )
        unknown = set(item) - {"path", "weight", "name", "parents"}
        if unknown:
            raise ValueError(
                f"reward spec {i} ({item['path']}): unknown keys {sorted(unknown)}"
            )
        atom = _load_atom(item["path"], base_dir, modules)
        atoms.append(
            RewardAtom(
                item.get("name", atom.name),
                atom.fn,
                weight=item.get("weight", atom.weight),
                parents=item.get("parents", atom.parents),
                batched=atom.batched,
            )
        )
    first: dict[str, int] = {}  # two specs giving one name: say which, not just "duplicate name" later
    for i, atom in enumerate(atoms):
        if atom.name in first:
            j = first[atom.name]
            raise ValueError(f"reward specs {j} and {i} ({_spec_text(specs[j])}, {_spec_text(specs[i])}) both give "
                             f"an atom named {atom.name!r}; give one of them another 'name'")
        first[atom.name] = i
    return atoms


def _spec_text(spec) -> str:
    return spec if isinstance(spec, str) else str(spec.get("path") or spec.get("reward_model"))


def load_atom(spec: str, base_dir: str | Path | None = None) -> RewardAtom:
    """Load the atom named by "path/to/file.py:function_name".

    A relative path resolves against base_dir (default: the current directory).
    The file is imported under a unique module name. A RewardAtom attribute is used
    as is; a plain callable becomes RewardAtom(name=function_name, fn=it).
    """
    return _load_atom(spec, base_dir, {})


def spec_file(file_part: str, base_dir) -> Path:
    """The file of a "path/to/file.py:name" spec: absolute, or relative to base_dir (the
    config's directory; the working directory when None)."""
    path = Path(file_part).expanduser()
    if not path.is_absolute():
        path = Path(base_dir if base_dir is not None else Path.cwd()) / path
    return path.resolve()


def _load_atom(spec: str, base_dir, modules: dict) -> RewardAtom:
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"reward atom spec {spec!r} must look like 'path/to/file.py:function'")
    file_part, attr = spec.rsplit(":", 1)  # rsplit: a Windows drive letter has a ':' too
    if not file_part or not attr:
        raise ValueError(f"reward atom spec {spec!r} must look like 'path/to/file.py:function'")
    path = spec_file(file_part, base_dir)
    if not path.is_file():
        raise ValueError(f"reward atom spec {spec!r}: file not found: {path}")
    if path not in modules:  # a plugin's file is that module: its registrations run once
        modules[path] = PLUGIN_MODULES.get(path) or _import_file(spec, path)
    obj = module_attribute(modules[path], attr, f"reward atom spec {spec!r}", path.name)
    if isinstance(obj, RewardAtom):
        return obj
    if inspect.isclass(obj):  # called with a sample it would make an instance, failing at the first score
        raise ValueError(f"reward atom spec {spec!r}: {attr!r} is a class; name a function or an instance of it "
                         f"(e.g. add `{attr.lower()} = {attr}()` to {path.name} and name '{file_part}:{attr.lower()}')")
    if not callable(obj):
        raise ValueError(  # noqa: TRY004 -- a config error, like the others here
            f"reward atom spec {spec!r}: {attr!r} is {_a(type(obj).__name__)}, not callable"
        )
    return RewardAtom(attr, obj)


def _import_file(spec: str, path: Path):
    return import_python_file(path, f"reward atom spec {spec!r}")


def module_attribute(module, attr: str, what: str, where: str):
    """`module.attr`, or a ValueError starting with `what` that lists the callables `where` defines."""
    if not hasattr(module, attr):
        defined = sorted(n for n, v in vars(module).items() if _defined_in(module, n, v))
        # @reward_atom("has_answer") on `def check` is found as file.py:check, not by its atom name
        named = [n for n, v in vars(module).items() if isinstance(v, RewardAtom) and v.name == attr and n != attr]
        close = named[:1] or difflib.get_close_matches(attr, defined, n=1)
        hint = f", the name the atom {named[0]!r} is given (a spec names the function)" if named else ""
        hint += f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"{what}: {where} has no attribute {attr!r}{hint} "
            f"(callables defined: {', '.join(defined) or 'none'})"
        )
    return getattr(module, attr)


def _defined_in(module, name: str, value) -> bool:
    """A public callable of the file itself: not a function or class it imports (from
    mmrl.core.rewards import reward_atom), which would only crowd the list of what it defines."""
    if name.startswith("_") or not callable(value):
        return False
    if inspect.isfunction(value) or inspect.isclass(value) or inspect.isbuiltin(value):
        return getattr(value, "__module__", None) == module.__name__
    return True  # an object: an atom, a scorer instance


# files imported as plugins (mmrl.core.plugins), by resolved path, once per process
PLUGIN_MODULES: dict[Path, Any] = {}


def import_python_file(path: Path, what: str):
    """Import a user's Python file as a fresh module (a unique name each time). Errors are
    ValueErrors starting with `what` (e.g. "reward atom spec 'x.py:f'") and naming the file."""
    stem = re.sub(r"\W", "_", path.stem)
    name = f"mmrl_user_{stem}_{next(_module_counter)}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"{what}: cannot import {path} as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickle look the module up here
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # SystemExit: a script's sys.exit() at import
        del sys.modules[name]
        raise ValueError(f"{what}: importing {path} failed: {_describe(e)}") from e
    return module
