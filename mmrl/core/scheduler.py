"""The rollout scheduler: turns prompts into complete, scored groups with advantages.

`SyncScheduler` rolls out a whole round in the trainer's thread with the trainer's
own weights, scores it, lets the method drop groups (DAPO's dynamic sampling) and
refills the batch with fresh prompts, up to a cap of extra rounds; then asks the
method for extra samples (AXPO), computes advantages and prunes (FastRL).
Engines beside the trainer and pipelining (RolloutPipe) live in mmrl.core.pipeline,
with the same hooks and the same contract: only complete groups reach the trainer.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import torch

from mmrl.core import distributed
from mmrl.core.advantages import batch_across
from mmrl.core.batch import RolloutBatch
from mmrl.core.config import ConfigError, TrainConfig
from mmrl.core.engine import PolicyEngine
from mmrl.core.method import Method, apply_prune, checked_advantages
from mmrl.core.rewards import Reward, add_atom_times, atom_times


class PromptStream:
    """Prompts in a seeded order, epoch after epoch. `position` (prompts drawn so far)
    is the whole data state: a resumed run continues from the same prompt."""

    def __init__(self, prompts: Sequence[Any], seed: int):
        if len(prompts) == 0:
            raise ValueError("the task has no training prompts")
        self.prompts = prompts
        self.seed = seed
        self.position = 0
        self._cached: tuple[int, torch.Tensor] | None = None  # (epoch, its order)

    def _order(self, epoch: int) -> torch.Tensor:
        """Epoch `epoch`'s permutation of the prompts, made once per epoch: drawn afresh at every
        step it cost a permutation of the whole dataset per step (70 ms at a million prompts)."""
        cached = self._cached
        if cached is None or cached[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            cached = self._cached = (epoch, torch.randperm(len(self.prompts), generator=g))
        return cached[1]

    def take(self, n: int) -> tuple[list[Any], list[int]]:
        """The next n prompts and their global draw indices (unique across the run)."""
        out, ids = [], []
        for pos in range(self.position, self.position + n):
            e, i = divmod(pos, len(self.prompts))
            out.append(self.prompts[int(self._order(e)[i])])
            ids.append(pos)
        self.position += n
        return out, ids

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "size": len(self.prompts)}

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != len(self.prompts) or state["seed"] != self.seed:
            raise ConfigError(
                f"the checkpoint's data ({state['size']} prompts, seed {state['seed']}) differs from "
                f"this run's ({len(self.prompts)} prompts, seed {self.seed}); resume needs the same task and seed"
            )
        self.position = state["position"]


class SyncScheduler:
    def __init__(self, cfg: TrainConfig, policy, stream: PromptStream, reward: Reward,
                 method: Method, generator: torch.Generator, reference=None):
        self.cfg = cfg
        self.policy = policy
        self.stream = stream
        self.reward = reward
        self.method = method
        self.generator = generator
        self.reference = reference

    def next_groups(self, version: int, num_generations: int | None = None,
                    ) -> tuple[RolloutBatch | None, dict[str, float]]:
        """prompts_per_step complete, scored groups with advantages (fewer if dynamic sampling
        ran out of rounds; None if every group was dropped). `version` is recorded on the batch."""
        stored = self.method.stored_batch()
        if stored is not None:  # no rollout this step: the method trains on a batch it keeps
            return self._prepare(stored, {"rollout/rounds": 0, "rollout/groups_dropped": 0, "time/rollout": 0.0,
                                          "time/reward": 0.0, **atom_times(self.reward.names),
                                          "rollout/decoded_tokens": 0.0})
        rc = self.cfg.rollout
        num_generations = num_generations or rc.num_generations
        world = distributed.world_size()
        want = rc.prompts_per_step // world  # this rank's groups (prompts_per_step is a multiple of world)
        kept: list[RolloutBatch] = []
        have = dropped = rounds = 0
        decoded = 0.0
        t_rollout = t_reward = 0.0
        t_atoms = atom_times(self.reward.names)  # time/reward/<atom>: where time/reward went
        max_rounds = 1 + (self.cfg.method.dynamic_sampling.max_rounds
                          if getattr(self.cfg.method, "dynamic_sampling", None)
                          and self.cfg.method.dynamic_sampling.enabled else 0)
        while rounds < max_rounds:
            # With several processes a refill round draws for the rank short of the most groups,
            # so every rank takes the same prompts and rounds; _balance deals out the surplus below.
            need = int(max(distributed.gather_scalar(want - have)))
            if need <= 0:
                break
            rounds += 1
            prompts, ids = distributed.shard(*self.stream.take(need * world))  # this rank's share
            t0 = time.perf_counter()
            # a rank whose rollout or reward fails stops every rank with its error, not a hang
            with distributed.failing_together():
                with torch.no_grad():
                    batch = self.policy.generate(prompts, num_generations, rc, self.generator)
                t1 = time.perf_counter()
                if len(batch) != len(prompts) * num_generations:
                    raise RuntimeError(
                        f"the rollout engine returned {len(batch)} samples for {len(prompts)} prompts "
                        f"x {num_generations} generations"
                    )
                batch.scores = self.reward.score(batch.samples)
                t_reward += time.perf_counter() - t1  # not the wait for the other ranks at the block's end
                add_atom_times(t_atoms, batch.scores)
            batch.data["request_tag"] = torch.zeros(len(batch), dtype=torch.long)
            # Relabel groups by draw index: unique across rounds and steps.
            batch.group_ids = torch.tensor(ids)[batch.group_ids]
            batch.prompts = dict(zip(ids, prompts))
            batch.policy_version = version
            rolled = batch  # where this rank's rollouts live (for groups from other ranks)
            if rounds == 1:  # the policy's reward and rollout stats: before any group is dropped
                reward_metrics = round_metrics(batch)
            t_rollout += t1 - t0
            decoded += decoded_tokens(batch)
            keep = self.method.keep_groups(batch)
            if keep is not None and not bool(keep.all()):
                n_groups = batch.num_groups
                batch = batch.select(keep)
                dropped += n_groups - batch.num_groups
            if len(batch):
                kept.append(batch)
                have += batch.num_groups
        metrics = {
            **reward_metrics,
            "rollout/rounds": rounds,
            "rollout/groups_dropped": dropped,
            "time/rollout": t_rollout,
            "time/reward": t_reward,
            **t_atoms,
            "rollout/decoded_tokens": decoded,  # the extra samples add theirs
        }
        if world > 1:  # equal shares (a filter may keep more on one rank): the ranks' steps match
            kept, metrics["rollout/groups_trimmed"] = _balance(kept, want, local=rolled)
        if not kept:
            return None, metrics
        batch = RolloutBatch.concat(kept)
        batch = self._extra_samples(batch, version, metrics)
        return self._prepare(self.method.on_groups(batch), metrics)

    def _prepare(self, batch: RolloutBatch, metrics: dict) -> tuple[RolloutBatch | None, dict[str, float]]:
        """A round's batch, ready to train: annotations, advantages, pruning, reference pass."""
        with torch.no_grad():
            self.method.annotate(self.policy, batch)
        with batch_across(distributed.sum_tensor) if distributed.world_size() > 1 else contextlib.nullcontext():
            batch.advantages = checked_advantages(self.method, batch)  # scale=batch: the std of every rank's rows
        batch = self._prune(batch, metrics)
        if distributed.sum_scalar(float(len(batch))) == 0:  # every rank joins: one rank's empty share still trains
            return None, metrics  # every sample pruned on every rank (DAPO's overlong filter): a step without update
        if self.reference is not None:  # after pruning: pruned samples need no reference pass
            with torch.no_grad():
                self.method.annotate_reference(self.reference, batch)
        metrics["rollout/groups"] = batch.num_groups
        metrics["rollout/samples"] = len(batch)
        return batch, metrics

    def _extra_samples(self, batch: RolloutBatch, version: int, metrics: dict) -> RolloutBatch:
        requests = [r for rows in batch.groups() for r in self.method.extra_requests(batch.select(rows))]
        metrics["rollout/samples_extra"] = sum(r.n for r in requests)
        if not requests:
            return batch
        engine = PolicyEngine(self.policy, own_weights=False)
        seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        t0 = time.perf_counter()
        extra = engine.generate(requests, self.cfg.rollout, seed)
        t1 = time.perf_counter()
        metrics["rollout/decoded_tokens"] += decoded_tokens(extra)
        extra.policy_version = version
        extra.scores = self.reward.score(extra.samples)
        # the extra samples' time is the step's too, as their tokens are (the pipelined round counts both)
        metrics["time/rollout"] += t1 - t0
        metrics["time/reward"] += time.perf_counter() - t1
        add_atom_times(metrics, extra.scores)
        merged = RolloutBatch.concat([batch, extra])
        order = torch.argsort(merged.group_ids, stable=True)  # a group's rows stay together
        return merged.select(order)

    def _prune(self, batch: RolloutBatch, metrics: dict) -> RolloutBatch:
        if type(self.method).prune is Method.prune:
            return batch
        answers = [(rows, self.method.prune(batch.select(rows))) for rows in batch.groups()]
        weighted = any(k is not None and k.dtype != torch.bool for _, k in answers)
        keep = torch.ones(len(batch), dtype=torch.float32 if weighted else torch.bool)
        for rows, k in answers:
            if k is not None:
                keep[rows] = k.to(keep.dtype)
        metrics["rollout/samples_pruned"] = int((keep <= 0).sum())
        return apply_prune(batch, keep)


def _balance(kept: list[RolloutBatch], want: int, local: RolloutBatch) -> tuple[list[RolloutBatch], int]:
    """Deal the ranks' kept groups out equally: share = min(total // world, want) each. A rank
    keeps its first `share` groups and gives the rest to a pool, from which the ranks short of
    a share take theirs, in rank order and draw order (only the surplus groups and their
    prompts cross processes, by the CPU; they land on the devices of `local`, a batch this
    rank rolled out). Returns this rank's batches and the groups no rank trains on (counted
    on the main rank)."""
    world, rank = distributed.world_size(), distributed.rank()
    mine = RolloutBatch.concat(kept) if kept else None
    ids = mine.group_ids.unique() if mine is not None else torch.empty(0, dtype=torch.long)
    counts = [int(c) for c in distributed.gather_scalar(len(ids))]
    share = min(sum(counts) // world, want)
    trimmed = sum(counts) - share * world if rank == 0 else 0
    if all(c == share for c in counts):
        return kept, trimmed
    surplus = None
    if len(ids) > share:
        surplus = mine.select(torch.isin(mine.group_ids, ids[share:])).to("cpu")  # with those groups' prompts only
    pool = [b for b in distributed.gather_objects(surplus) if b is not None]
    out = [mine.select(torch.isin(mine.group_ids, ids[:share]))] if share and len(ids) else []
    need = max(0, share - counts[rank])
    if need:
        pooled = RolloutBatch.concat(pool)
        start = sum(max(0, share - c) for c in counts[:rank])
        got = pooled.select(torch.isin(pooled.group_ids, pooled.group_ids.unique()[start: start + need]))
        out.append(got.to(local))
    return out, trimmed


def decoded_tokens(batch: RolloutBatch) -> float:
    """Tokens the engine decoded for a batch (its "stat/length", else 0): what rollouts cost."""
    length = batch.data.get("stat/length")
    return float(length.sum()) if length is not None else 0.0


def annotate_reference(reference, batch: RolloutBatch) -> None:
    """What the method's KL needs of the reference policy: its log-probs (batch.ref_logp),
    or whatever its `reference_data(batch)` returns, into batch.data (e.g. step means)."""
    if hasattr(reference, "reference_data"):
        batch.data.update(reference.reference_data(batch))
    else:
        batch.ref_logp = reference.logprobs(batch)


def round_metrics(batch: RolloutBatch) -> dict[str, float]:
    """Reward atoms and per-sample rollout stats ("stat/<x>" data) of a round, as logged."""
    out = batch.scores.metrics()
    out.update({f"rollout/{k[len('stat/'):]}": float(v.float().mean())
                for k, v in batch.data.items() if k.startswith("stat/")})
    return out
