"""Rollout engines and the workers that run them beside the trainer.

An engine turns requests (a prompt, how many samples, optionally a fixed prefix
to continue from) into a `RolloutBatch` whose old log-probs come from the
engine's own weights, the version it was last published. Every modality's
engine has the same three calls:

    generate(requests, rollout, seed) -> RolloutBatch   rows in request order, request.n each,
                                                        group_ids = request.group
    publish(weights, version)         take the trainer's trainable weights (by parameter name)
    close()

`PolicyEngine` makes an engine of any backend policy (mmrl.core.protocols.Policy),
sharing the trainer's weights or holding its own frozen copy. Proxies for other
places (a subprocess, an `mmrl serve` server, a vLLM server) implement the same
calls. A `Worker` runs one engine in a background thread, one job at a time, and
reports every result or failure to the scheduler's inbox; the scheduler owns
timeouts and re-dispatch (mmrl.core.pipeline).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from mmrl.core.batch import RolloutBatch
from mmrl.core.device import current_cuda, use_cuda


class EngineError(RuntimeError):
    """An engine failed, died or hung; the message names the engine and the job."""


@dataclass
class Request:
    group: int
    """The group the samples join (the prompt's global draw index)."""
    prompt: Any
    n: int
    """Samples wanted."""
    prefix: Any = None
    """Continue from this fixed start of a completion instead of the prompt (AXPO's
    resampling); its format is the backend's. None = sample from the prompt."""
    tag: int = 0
    """0 for a group's own samples; a method's extra requests use other tags, copied
    into batch.data["request_tag"] so its advantages can tell them apart."""
    retries: int = 0
    """Engine calls of these samples that failed or hung (the scheduler's count, against
    rollout.scheduler.max_redispatch)."""


class Engine(Protocol):
    name: str

    def generate(self, requests: Sequence[Request], rollout, seed: int) -> RolloutBatch: ...

    def publish(self, weights: dict[str, Tensor], version: int) -> None: ...

    def close(self) -> None: ...


def trainable_weights(model: torch.nn.Module) -> dict[str, Tensor]:
    """What changes in training (all weights, or only the LoRA adapters): what publish sends."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def load_named(model: torch.nn.Module, weights: dict[str, Tensor]) -> None:
    """Copy weights into a module's parameters of the same names, in place (cast to each
    parameter's dtype and device). All or nothing: every name, shape and kind of dtype is checked
    before the first copy, so weights that do not fit leave the model as it was."""
    params = dict(model.named_parameters())
    # by name: weights decoded from safetensors bytes come in no fixed order (a hash map's), and
    # the message names the first three
    missing = sorted(k for k in weights if k not in params)
    if missing:
        raise EngineError(f"published weights do not fit the engine's model: unknown {missing[:3]}")
    wrong = [f"{k}: {_describe(v)}, the model's is {_describe(params[k])}" for k, v in sorted(weights.items())
             if not _fits(v, params[k])]
    if wrong:
        raise EngineError(f"published weights do not fit the engine's model ({len(wrong)} of {len(weights)}): "
                          + "; ".join(wrong[:3]))
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value.to(params[name].device, params[name].dtype))


def _fits(value: Any, param: Tensor) -> bool:
    """Same shape (copy_ would broadcast a smaller one) and same kind of number (a float dtype
    casts to another; bool or integer weights for a float parameter are someone else's)."""
    return (isinstance(value, Tensor) and value.shape == param.shape
            and value.is_floating_point() == param.is_floating_point() and value.is_complex() == param.is_complex())


def _describe(t: Any) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" if isinstance(t, Tensor) else type(t).__name__


class PolicyEngine:
    """A backend policy as an engine. `own_weights=True` keeps a frozen copy
    (policy.rollout_copy() where the backend has one, else policy.reference()) that changes
    only on publish, so the trainer may step while the engine samples; False samples with
    the trainer's own weights."""

    def __init__(self, policy, *, own_weights: bool, name: str = "local"):
        self.name = name
        self.policy = getattr(policy, "rollout_copy", policy.reference)() if own_weights else policy
        self.own_weights = own_weights
        self.version = 0
        self._prefixes = "prefixes" in inspect.signature(self.policy.generate).parameters

    def generate(self, requests: Sequence[Request], rollout, seed: int) -> RolloutBatch:
        gen = torch.Generator().manual_seed(seed)
        counts = [r.n for r in requests]
        with_prefix = any(r.prefix is not None for r in requests)
        if with_prefix and not self._prefixes:
            raise EngineError(f"engine {self.name}: this backend's policy cannot continue from a prefix "
                              "(its generate() takes no `prefixes`)")
        with torch.no_grad():
            if len(set(counts)) == 1 and not with_prefix:
                batch = self.policy.generate([r.prompt for r in requests], counts[0], rollout, gen)
            else:  # mixed group sizes or prefixes: one row per sample
                prompts = [r.prompt for r in requests for _ in range(r.n)]
                kwargs = {"prefixes": [r.prefix for r in requests for _ in range(r.n)]} if with_prefix else {}
                batch = self.policy.generate(prompts, 1, rollout, gen, **kwargs)
        batch.policy_version = self.version
        return label(batch, requests, self.name)

    def publish(self, weights: dict[str, Tensor], version: int) -> None:
        if self.own_weights:
            load_named(self.policy.model, weights)
        self.version = version

    def close(self) -> None:
        pass


def label(batch: RolloutBatch, requests: Sequence[Request], engine: str) -> RolloutBatch:
    """Check an engine's batch against its requests and set group ids and request tags."""
    counts = [r.n for r in requests]
    if len(batch) != sum(counts):
        raise EngineError(f"engine {engine} returned {len(batch)} samples for requests of {sum(counts)}")
    rep = torch.tensor(counts)
    batch.group_ids = torch.tensor([r.group for r in requests]).repeat_interleave(rep)
    batch.data["request_tag"] = torch.tensor([r.tag for r in requests]).repeat_interleave(rep)
    return batch


# --------------------------------------------------------------------------- workers

_job_ids = itertools.count()


@dataclass
class Job:
    requests: list[Request]
    rollout: Any  # the run's rollout config (sampling settings)
    seed: int
    id: int = field(default_factory=lambda: next(_job_ids))
    started: float | None = None  # when the worker took it (time.monotonic); None while queued


@dataclass
class Result:
    worker: Worker
    job: Job
    batch: RolloutBatch | None = None
    error: BaseException | None = None
    seconds: float = 0.0


class Worker:
    """One engine in a background thread: takes jobs one at a time, puts a `Result`
    (batch or error) in the scheduler's inbox. A worker whose engine raised or hung
    is marked dead and gets no more jobs."""

    def __init__(self, engine: Engine, inbox: queue.Queue):
        self.engine = engine
        self.name = engine.name
        self.inbox = inbox
        self.jobs: queue.Queue = queue.Queue()
        self.outstanding: dict[int, Job] = {}
        self.dead: str | None = None  # why, once dead
        self.busy_seconds = 0.0
        self._cuda = current_cuda()  # the thread's GPU: the one current here (per-thread in PyTorch)
        self._lock = threading.Lock()  # a job starts, or the worker is given up on: one or the other first
        self._thread = threading.Thread(target=self._loop, name=f"mmrl-engine-{self.name}", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self.outstanding[job.id] = job
        self.jobs.put(("generate", job))

    def publish(self, weights: dict[str, Tensor], version: int, timeout: float) -> float:
        """Hand the engine new weights; blocks until it has them. Returns the seconds taken."""
        done: queue.Queue = queue.Queue()
        t0 = time.perf_counter()
        self.jobs.put(("publish", (weights, version, done)))
        try:
            error = done.get(timeout=timeout)
        except queue.Empty:
            self.dead = f"did not take new weights within {timeout:g} s"
            raise EngineError(f"engine {self.name} {self.dead}") from None
        if error is not None:
            self.dead = f"failed to take new weights: {error}"
            raise EngineError(f"engine {self.name} {self.dead}") from error
        return time.perf_counter() - t0

    def mark_dead(self, why: str) -> list[Job]:
        """Stop using this worker; returns its unfinished jobs for re-dispatch."""
        with self._lock:
            self.dead = why
            jobs = list(self.outstanding.values())
            self.outstanding.clear()
        return jobs

    @property
    def alive(self) -> bool:
        return self.dead is None

    def stop(self) -> None:
        """Ask the thread to end: queued jobs are dropped, a call under way finishes first."""
        with self._lock:
            self.dead = self.dead or "closed"
        self.jobs.put(("stop", None))

    def close(self, wait: float = 10.0) -> None:
        """stop(), wait up to `wait` seconds for the thread (a process that exits while a thread
        is inside torch can abort), and close the engine."""
        self.stop()
        if self._thread is not threading.current_thread():
            self._thread.join(wait)
        with contextlib.suppress(Exception):  # closing a broken engine must not hide the real error
            self.engine.close()

    def _loop(self) -> None:
        use_cuda(self._cuda)
        while True:
            kind, payload = self.jobs.get()
            if kind == "stop":
                return
            if kind == "publish":
                weights, version, done = payload
                try:
                    self.engine.publish(weights, version)
                    done.put(None)
                except BaseException as e:  # noqa: BLE001 -- reported to the caller
                    done.put(e)
                continue
            job: Job = payload
            with self._lock:
                if self.dead is not None:  # given up on (or closed) while this job was queued
                    continue
                job.started = time.monotonic()  # a queued job's wait is not the engine's time
            t0 = time.perf_counter()
            try:
                batch = self.engine.generate(job.requests, job.rollout, job.seed)
                result = Result(self, job, batch=batch)
            except BaseException as e:  # noqa: BLE001 -- the scheduler decides: re-dispatch or stop
                result = Result(self, job, error=e)
            result.seconds = time.perf_counter() - t0
            self.busy_seconds += result.seconds
            self.inbox.put(result)
