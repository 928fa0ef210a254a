"""Rollouts beside the trainer: RolloutPipe's complete-group pipelining (CGP) and
frontier-group dispatch (FGD), docs/methods.md section 3.

A round is one training step's prompts. A dispatcher thread hands engine calls to
workers (mmrl.core.engine), gathers the samples of each group, and once a group is
complete scores it, applies the method's group hooks and computes its advantages:

    keep_groups     drop the group (DAPO) and admit a fresh prompt instead, up to a cap
    extra_requests  more samples for the group (AXPO's resampling from a fixed prefix);
                    the group completes when they are back too
    advantages      of the complete group
    prune           FastRL's pruning of a group's samples before training

Complete groups go to a FIFO in completion order; with `pipelined` the trainer takes
them as they come (one optimizer step per U groups), otherwise it takes the whole
round at once. Only complete groups ever leave the dispatcher.

FGD: engine calls take samples only from the F_w lowest-numbered incomplete groups,
in order, so groups complete early and one after another. Without FGD every group
is admitted at once and each call takes a few samples of every group in turn, as a
continuously batched engine serving all requests would finish them: groups then
complete late. Weights are published to the engines between rounds only, after the
trainer consumed every group, so every sample's old log-probs come from the weights
the trainer held at the round's start (staleness 0, checked by the trainer).

Faults: a call that raises an engine fault or takes longer than `timeout` marks its
worker dead (one warning names it, the error, and the engines left); its unfinished calls go to the other workers (at most `max_redispatch`
times) or the round stops with an EngineError. Errors in the input (a prompt too long,
a reward atom that fails) stop the round with the original error. An engine dropped for a
fault that a restarted server cures (no answer, or a 409: it restarted) is tried again at
each round's start, once its server answers /health and is idle.
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from mmrl.core.batch import RolloutBatch
from mmrl.core.config import ConfigError, TrainConfig
from mmrl.core.config_checks import check_config, placement  # noqa: F401 -- torch-free there (`config`)
from mmrl.core.device import current_cuda, use_cuda
from mmrl.core.engine import (
    EngineError,
    Job,
    PolicyEngine,
    Request,
    Result,
    Worker,
    trainable_weights,
)
from mmrl.core.method import Method, apply_prune, checked_advantages
from mmrl.core.rewards import Reward, add_atom_times, atom_times
from mmrl.core.scheduler import decoded_tokens, round_metrics


def groups_per_update(cfg: TrainConfig) -> int:
    """U: groups per optimizer step."""
    return max(1, cfg.rollout.prompts_per_step // cfg.train.mini_batches)


def first_pass_on_policy(cfg: TrainConfig) -> bool:
    """Whether each update's first pass runs under the very weights that made its rollouts:
    one mini-batch, rolled out by the trainer's own model in sync mode. The first pass's
    log-probs, detached, are then the old ones, and a method may skip the pass that scores
    them (TRL skips it alike when num_iterations is 1)."""
    sc = cfg.rollout.scheduler
    return cfg.train.mini_batches == 1 and sc.mode == "sync" and placement(cfg) == "inline"


def exactly_on_policy(cfg: TrainConfig) -> bool:
    """first_pass_on_policy with a single pass (ppo_epochs 1): every forward is on-policy."""
    return cfg.train.ppo_epochs == 1 and first_pass_on_policy(cfg)


def build_engines(cfg: TrainConfig, policy, backend=None) -> list:
    """The engines a run's config asks for. `backend` (the backend module) may provide
    `build_engine(kind, cfg, policy, url=None)` for engines of its own (vLLM)."""
    where, sc = placement(cfg), cfg.rollout.scheduler
    own = getattr(backend, "build_engine", None)
    check = getattr(policy, "check_rollout", None)  # a server's batches against the trainer's policy
    if where in ("remote", "process") and policy is not None:
        from mmrl.core.serve import base_fingerprint

        base = base_fingerprint(policy.model)  # a server checks that it holds the same frozen (LoRA base) weights
    else:
        base = None
    if where == "remote":
        engines = []
        for i, url in enumerate(sc.servers):
            if url.startswith("vllm+"):
                if own is None:
                    raise ConfigError(f"rollout.scheduler.servers[{i}]: this backend has no vLLM engine")
                engines.append(own("vllm-server", cfg, policy, url=url[len("vllm+"):]))
            else:
                from mmrl.core.remote import RemoteEngine

                engines.append(RemoteEngine(url, timeout=sc.timeout, check=check, base=base))
        return engines
    if cfg.rollout.engine != "hf":
        if own is None:
            raise ConfigError(f"rollout.engine={cfg.rollout.engine!r} is not available for this backend")
        return [own(cfg.rollout.engine, cfg, policy)]
    if where == "process":
        if backend is None:
            raise ConfigError("rollout.scheduler.placement=process needs the backend module (use the CLI)")
        from mmrl.core.remote import RemoteEngine, spawn_server

        proc, url = spawn_server(backend.__name__, cfg.model_dump(mode="json"), timeout=sc.timeout)
        return [RemoteEngine(url, timeout=sc.timeout, name="process", process=proc, check=check, base=base)]
    return [PolicyEngine(policy, own_weights=True, name="thread")]


def server_may_come_back(error: BaseException) -> bool:
    """Whether an engine fault is one that a restarted server cures: no answer (down, restarting,
    hung), a server that says it restarted (409) or that stayed busy past the client's retries
    (503: its cap of requests at once, perhaps other clients'); not an answer that refuses or does
    not fit, which the same server would give again."""
    from mmrl.core.remote import HTTPStatusError, UnreachableError

    return (isinstance(error, (OSError, UnreachableError))
            or isinstance(error, HTTPStatusError) and error.code in (409, 503))


def describe_engine(w: Worker) -> str:
    """A worker's engine for a message: its name, and its server's URL where it has one."""
    url = getattr(w.engine, "url", None)
    return f"{w.name} ({url})" if url and url.split("//")[-1] != w.name else w.name


@dataclass
class _Group:
    gid: int
    prompt: Any
    todo: list[Request]  # not yet sent to an engine
    parts: list[RolloutBatch] = field(default_factory=list)
    in_flight: int = 0  # samples sent, not back
    extras_asked: bool = False
    done: bool = False
    refill: bool = False  # admitted in place of a dropped group (DAPO), not in the round's draw


class _End:
    pass


_STOP = object()  # put in the engines' inbox to wake a dispatcher that should stop
HEALTH_TIMEOUT = 5.0  # seconds a dropped engine's server has to answer /health at a round's start


class Round:
    """One step's rollouts, produced in the background; iterate to get complete groups."""

    def __init__(self, sched: PipelinedScheduler, version: int, prompts: list, ids: list[int], g: int):
        self.s = sched
        self.version = version
        self.g = g
        self.want = len(prompts)
        self.groups: dict[int, _Group] = {}
        self.order: list[int] = []  # admission order: the frontier is its first incomplete groups
        for p, i in zip(prompts, ids):
            self._admit(p, i)
        self.ready: queue.Queue = queue.Queue()
        self.metrics: dict[str, float] = {"rollout/groups_dropped": 0, "rollout/groups_refilled": 0,
                                          "rollout/groups_extra": 0, "rollout/samples_extra": 0,
                                          "rollout/samples_pruned": 0, "rollout/redispatched": 0,
                                          "time/reward": 0.0, **atom_times(sched.reward.names)}
        self.handed = 0
        self.refills_left = self.want * sched.max_refill_rounds
        self.first_pass: list[RolloutBatch] = []  # every group as first scored, for reward metrics
        self.t0 = time.perf_counter()
        self.wait_seconds = 0.0
        self.busy0 = sum(w.busy_seconds for w in sched.workers)  # the engines' time before this round
        self._stop = threading.Event()
        self._cuda = current_cuda()  # rewards and method hooks run in the dispatcher: on this GPU
        self._thread = threading.Thread(target=self._run, name="mmrl-dispatch", daemon=True)
        self._thread.start()

    def _admit(self, prompt, gid: int, refill: bool = False) -> None:
        self.groups[gid] = _Group(gid, prompt, [Request(gid, prompt, self.g)], refill=refill)
        self.order.append(gid)

    # ------------------------------------------------------------------ trainer side

    def __iter__(self) -> Iterator[RolloutBatch]:
        while True:
            t = time.perf_counter()
            item = self.ready.get()
            self.wait_seconds += time.perf_counter() - t
            if isinstance(item, _End):
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    # ------------------------------------------------------------------ dispatcher

    def _run(self) -> None:
        use_cuda(self._cuda)
        try:
            self._dispatch_loop()
            if self._stop.is_set():
                return
            self.metrics["time/rollout"] = time.perf_counter() - self.t0
            self.metrics.update(round_metrics(RolloutBatch.concat(self.first_pass)))
            self.ready.put(_End())
        except BaseException as e:  # noqa: BLE001 -- handed to the trainer thread
            self.ready.put(e)

    def engine_busy(self) -> float:
        """Seconds the engines spent in calls since this round began (all engines together)."""
        return sum(w.busy_seconds for w in self.s.workers) - self.busy0

    def stop(self, wait: float = 10.0) -> None:
        """End the dispatcher (the trainer gave up on this round: an error, or the run closes);
        wait up to `wait` seconds for it."""
        if not self._stop.is_set():
            self._stop.set()
            self.s.inbox.put(_STOP)  # wakes a dispatcher waiting for an answer
        if self._thread is not threading.current_thread():
            self._thread.join(wait)

    def _dispatch_loop(self) -> None:
        s = self.s
        while not all(g.done for g in self.groups.values()):
            if self._stop.is_set():
                return
            for depth in (1, 2):  # every engine one call first, then one queued: none idles
                for w in s.workers:
                    if w.alive and len(w.outstanding) < depth:
                        requests = self._next_requests()
                        if requests:
                            seed = int(torch.randint(0, 2**62, (1,), generator=s.generator))
                            w.submit(Job(requests, s.cfg.rollout, seed))
            if not any(w.alive for w in s.workers):
                raise EngineError("every rollout engine failed: " + "; ".join(
                    f"{w.name}: {w.dead}" for w in s.workers))
            if not self._in_flight():
                if any(g.todo for g in self.groups.values()):
                    continue
                raise RuntimeError("rollout dispatcher: nothing in flight and nothing to send (a bug)")
            try:
                result = s.inbox.get(timeout=self._time_left())
            except queue.Empty:
                self._expire_hung()
                continue
            if result is not _STOP:
                self._absorb(result)
                self._expire_hung()  # answers from live engines must not hide a hung one

    def _in_flight(self) -> bool:
        return any(w.outstanding for w in self.s.workers)

    def _next_requests(self) -> list[Request]:
        s = self.s
        open_groups = [self.groups[i] for i in self.order if not self.groups[i].done]
        if s.frontier:
            open_groups = open_groups[: s.frontier]
        pending = [g for g in open_groups if g.todo]
        if not pending:
            return []
        budget = s.engine_batch
        taken: dict[int, int] = {}
        if s.frontier:  # in group order: the frontier's groups complete first
            for g in pending:
                while g.todo and budget > 0:
                    budget -= self._take(g, min(budget, g.todo[0].n), taken)
        else:  # one sample of each open group in turn: all progress, none completes early (each call
            # starts again at the first open group, so an engine_batch below the number of open
            # groups fills the first ones first)
            while budget > 0 and any(g.todo for g in pending):
                for g in pending:
                    if g.todo and budget > 0:
                        budget -= self._take(g, 1, taken)
        return self._merge(taken)

    def _take(self, g: _Group, n: int, taken: dict) -> int:
        head = g.todo[0]
        if head.n <= n:
            g.todo.pop(0)
            part = head
        else:
            g.todo[0] = replace(head, n=head.n - n)
            part = replace(head, n=n)
        g.in_flight += part.n
        # one request per group, tag and prefix: a call's rows stay grouped
        taken.setdefault((g.gid, head.tag, id(head.prefix)), []).append(part)
        return part.n

    @staticmethod
    def _merge(taken: dict) -> list[Request]:
        out = []
        for parts in taken.values():
            r = parts[0]
            out.append(replace(r, n=sum(p.n for p in parts), retries=max(p.retries for p in parts)))
        return out

    def _time_left(self) -> float:
        """Until the first call under way reaches the timeout (queued calls are not timed: a
        worker takes them when its call ahead answers, which wakes the dispatcher anyway)."""
        now = time.monotonic()
        starts = [j.started for w in self.s.workers for j in list(w.outstanding.values()) if j.started is not None]
        return max(0.01, min(st + self.s.timeout for st in starts) - now) if starts else self.s.timeout

    def _expire_hung(self) -> None:
        now = time.monotonic()
        for w in self.s.workers:
            if any(j.started is not None and now - j.started > self.s.timeout for j in list(w.outstanding.values())):
                self._fail_worker(w, f"did not answer within {self.s.timeout:g} s (hung)")

    def _fail_worker(self, w: Worker, why: str, error: BaseException | None = None) -> None:
        """`error`: the call's (None: it hung)."""
        was_alive = w.alive
        jobs = w.mark_dead(why)
        self.s.note_gone(w, error)
        left = sum(x.alive for x in self.s.workers)
        if was_alive and left:  # with none left the round stops with an EngineError naming every engine
            warnings.warn(f"rollout engine {describe_engine(w)} {why}; dropped: the run goes on with the "
                          f"other {left} of {len(self.s.workers)} engines", stacklevel=2)
        for job in jobs:
            self.metrics["rollout/redispatched"] += 1
            tried = job.started is not None  # a call still queued never ran: moving it is no retry
            for r in job.requests:  # back to the front of their group's queue
                if tried:
                    r.retries += 1
                    if r.retries > self.s.max_redispatch:
                        raise EngineError(f"engine {w.name} {why}; giving up after {self.s.max_redispatch} "
                                          "re-dispatches of its samples (rollout.scheduler.max_redispatch)")
                g = self.groups[r.group]
                g.in_flight -= r.n
                g.todo.insert(0, r)

    def _absorb(self, result: Result) -> None:
        w, job = result.worker, result.job
        if job.id not in w.outstanding:  # a late answer from a worker already given up on
            return
        if result.error is not None:
            if not isinstance(result.error, (EngineError, OSError)):
                raise result.error  # bad input: the same call would fail anywhere
            self._fail_worker(w, f"failed: {result.error}", result.error)
            return
        del w.outstanding[job.id]
        batch = result.batch
        self.metrics["rollout/engine_calls"] = self.metrics.get("rollout/engine_calls", 0) + 1
        self.metrics["rollout/decoded_tokens"] = self.metrics.get("rollout/decoded_tokens", 0.0) + decoded_tokens(batch)
        for r, rows in zip(job.requests, _split(batch, job.requests)):
            g = self.groups[r.group]
            g.parts.append(rows)
            g.in_flight -= r.n
        for r in job.requests:
            g = self.groups[r.group]
            if not g.done and not g.todo and g.in_flight == 0:
                self._complete(g)

    def _complete(self, g: _Group) -> None:
        s = self.s
        scored = [p for p in g.parts if p.scores is not None]
        unscored = [p for p in g.parts if p.scores is None]
        if unscored:  # one reward call for the group's new samples
            new = RolloutBatch.concat(unscored)
            t = time.perf_counter()
            new.scores = s.reward.score(new.samples)
            self.metrics["time/reward"] += time.perf_counter() - t  # the dispatcher's: engines go on meanwhile
            add_atom_times(self.metrics, new.scores)
            g.parts = [*scored, new]
        batch = RolloutBatch.concat(g.parts)
        batch.prompts = {g.gid: g.prompt}
        if not g.extras_asked:
            if not g.refill:  # the reward metrics are the round's draw, before any drop (as sync's)
                self.first_pass.append(replace(batch))  # a copy: the group gets advantages later
            keep = s.method.keep_groups(batch)
            if keep is not None and not bool(keep.all()):
                g.done = True
                self.metrics["rollout/groups_dropped"] += 1
                if self.refills_left > 0:
                    self.refills_left -= 1
                    self.metrics["rollout/groups_refilled"] += 1
                    (prompt,), (gid,) = s.stream.take(1)
                    self._admit(prompt, gid, refill=True)
                return
            g.extras_asked = True
            extra = s.method.extra_requests(batch)
            if extra:
                if any(r.group != g.gid for r in extra):
                    raise ValueError("method.extra_requests returned requests for another group")
                g.parts = [batch]
                g.todo = list(extra)
                self.metrics["rollout/groups_extra"] += 1
                self.metrics["rollout/samples_extra"] += sum(r.n for r in extra)
                return
        g.done = True
        batch.advantages = checked_advantages(s.method, batch)
        keep = s.method.prune(batch)
        if keep is not None:
            self.metrics["rollout/samples_pruned"] += int((keep <= 0).sum())  # bool or weights
            batch = apply_prune(batch, keep)
            if not len(batch):  # nothing left to train (DAPO's overlong filter took every rollout)
                return
        self.handed += 1
        self.ready.put(batch)


def _split(batch: RolloutBatch, requests: list[Request]) -> list[RolloutBatch]:
    out, start = [], 0
    for r in requests:
        out.append(batch.select(torch.arange(start, start + r.n)))
        start += r.n
    return out


class PipelinedScheduler:
    """Rounds of rollouts on background workers (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, engines: list, stream, reward: Reward, method: Method,
                 generator: torch.Generator, model: torch.nn.Module, reference=None):
        if type(method).annotate is not Method.annotate:
            raise ConfigError(f"method {cfg.method.type!r} re-scores rollouts with the rollout policy "
                              "(Method.annotate): engines beside the trainer (rollout.scheduler placement other than "
                              "inline, or mode=pipelined) do not support that yet")
        sc = cfg.rollout.scheduler
        self.cfg = cfg
        self.model = model  # the trainer's: its trainable weights are what publish sends
        self.reference = reference
        self.stream = stream
        self.reward = reward
        self.method = method
        self.generator = generator
        self.pipelined = sc.mode == "pipelined"
        self.u = groups_per_update(cfg)
        g = cfg.rollout.num_generations
        self.frontier = (self.u if sc.frontier is None else sc.frontier) if self.pipelined else 0
        # Default call size: one mini-batch's samples (pipelined) or the round (sync), shared
        # among the engines so that several engines split even the frontier.
        whole = self.u * g if self.pipelined else cfg.rollout.prompts_per_step * g
        self.engine_batch = sc.engine_batch or -(-whole // max(1, len(engines)))
        self.timeout = sc.timeout
        self.max_redispatch = sc.max_redispatch
        ds = getattr(cfg.method, "dynamic_sampling", None)
        self.max_refill_rounds = ds.max_rounds if ds is not None and ds.enabled else 0
        self.inbox: queue.Queue = queue.Queue()
        self.workers = [Worker(e, self.inbox) for e in engines]
        self.published: int | None = None
        self.gone: set[Worker] = set()  # dropped for a fault that a restarted server cures: tried each round
        self.round: Round | None = None  # the latest round (close() stops its dispatcher)

    def start_round(self, version: int, num_generations: int) -> tuple[Round, float]:
        """Publish the trainer's weights if the engines lag, then start the round's rollouts.
        Returns the round and the seconds spent publishing."""
        seconds = 0.0
        if self.published != version:
            weights = trainable_weights(self.model)
            for w in self.workers:
                if w.alive:
                    try:
                        seconds += w.publish(weights, version, self.timeout)
                    except EngineError as e:  # that engine is out (marked dead); the others go on
                        if not any(x.alive for x in self.workers):
                            raise
                        self.note_gone(w, e.__cause__ or e)
                        warnings.warn(f"{e}; the run goes on with the other engines", stacklevel=2)
            self.published = version
        seconds += self._revive(version)
        prompts, ids = self.stream.take(self.cfg.rollout.prompts_per_step)
        self.round = Round(self, version, prompts, ids, num_generations)
        return self.round, seconds

    def note_gone(self, w: Worker, error: BaseException | None) -> None:
        """A worker just dropped for `error` (None: a hung call): to be tried again if its engine
        has a server to ask (a thread engine's fault is its own) and a restart may cure the fault."""
        if hasattr(w.engine, "health") and (error is None or server_may_come_back(error)):
            self.gone.add(w)

    def _revive(self, version: int) -> float:
        """Take back the engines dropped for a fault that a restarted server cures, once their
        server answers /health and is idle (not still in a call of ours given up on): they get
        the round's weights, then calls again. Returns the seconds spent publishing."""
        seconds = 0.0
        for w in [w for w in self.workers if w in self.gone]:
            try:
                health = w.engine.health(timeout=min(self.timeout, HEALTH_TIMEOUT))
                if not isinstance(health, dict) or health.get("busy", True):
                    continue  # tried again next round
                if health.get("weights") not in (None, getattr(w.engine, "published_tag", None)):
                    self.gone.discard(w)  # another trainer's weights: a server serves one trainer (its 409s)
                    continue
                seconds += w.publish(trainable_weights(self.model), version, self.timeout)
            except EngineError as e:
                if not server_may_come_back(e.__cause__ or e):  # it answers, and refuses: for good
                    self.gone.discard(w)
                continue
            self.gone.discard(w)
            # The worker skipped every call queued while it was dead, before this publish (its
            # queue is FIFO), and no dispatcher runs between rounds: it may take calls again.
            was, w.dead = w.dead, None
            warnings.warn(f"rollout engine {describe_engine(w)} answers again (it was dropped: {was}): it has this "
                          f"round's weights and rolls out again; {sum(x.alive for x in self.workers)} of "
                          f"{len(self.workers)} engines", stacklevel=3)
        return seconds

    def next_groups(self, version: int, num_generations: int | None = None,
                    ) -> tuple[RolloutBatch | None, dict[str, float]]:
        """Sync mode on background engines: the whole round at once, in group order."""
        rnd, publish = self.start_round(version, num_generations or self.cfg.rollout.num_generations)
        groups = list(rnd)
        metrics = {**rnd.metrics, "time/publish": publish, "time/engine_busy": rnd.engine_busy()}
        if not groups:
            return None, metrics
        batch = RolloutBatch.concat(groups)
        batch = batch.select(torch.argsort(batch.group_ids, stable=True))  # independent of timing
        if self.reference is not None:
            with torch.no_grad():
                self.method.annotate_reference(self.reference, batch)
        metrics["rollout/groups"] = batch.num_groups
        metrics["rollout/samples"] = len(batch)
        return batch, metrics

    def close(self, wait: float = 10.0) -> None:
        """Stop the round's dispatcher and every engine thread: all are told first, then all are
        waited for, `wait` seconds in all."""
        deadline = time.monotonic() + wait
        if self.round is not None:
            self.round.stop(wait=0)
        for w in self.workers:
            w.stop()
        if self.round is not None:
            self.round.stop(wait=max(0.0, deadline - time.monotonic()))
        for w in self.workers:
            w.close(wait=max(0.0, deadline - time.monotonic()))
