"""The rollout scheduler: turns prompts into complete, scored groups for the trainer.

`SyncScheduler` rolls out a whole round, scores it, lets the method drop groups
(DAPO's dynamic sampling) and refills the batch with fresh prompts, up to a
cap of extra rounds. Pipelined modes (RolloutPipe) come with the scheduler issue;
they keep this contract: `next_groups()` returns only complete groups.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from mmrl.core import distributed
from mmrl.core.batch import RolloutBatch
from mmrl.core.config import TrainConfig
from mmrl.core.method import Method
from mmrl.core.rewards import Reward


class PromptStream:
    """Prompts in a seeded order, epoch after epoch. `position` (prompts drawn so far)
    is the whole data state: a resumed run continues from the same prompt."""

    def __init__(self, prompts: Sequence[Any], seed: int):
        if len(prompts) == 0:
            raise ValueError("the task has no training prompts")
        self.prompts = prompts
        self.seed = seed
        self.position = 0

    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(len(self.prompts), generator=g).tolist()

    def take(self, n: int) -> tuple[list[Any], list[int]]:
        """The next n prompts and their global draw indices (unique across the run)."""
        out, ids = [], []
        order, epoch = None, -1
        for pos in range(self.position, self.position + n):
            e, i = divmod(pos, len(self.prompts))
            if e != epoch:
                order, epoch = self._order(e), e
            out.append(self.prompts[order[i]])
            ids.append(pos)
        self.position += n
        return out, ids

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "size": len(self.prompts)}

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != len(self.prompts) or state["seed"] != self.seed:
            raise ValueError(
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

    def next_groups(self, version: int) -> tuple[RolloutBatch | None, dict[str, float]]:
        """prompts_per_step complete, scored groups (fewer if dynamic sampling ran out of
        rounds; None if every group was dropped). `version` is recorded on the batch."""
        rc = self.cfg.rollout
        want = rc.prompts_per_step
        kept: list[RolloutBatch] = []
        have = dropped = rounds = 0
        t_rollout = t_reward = 0.0
        max_rounds = 1 + (self.cfg.method.dynamic_sampling.max_rounds
                          if getattr(self.cfg.method, "dynamic_sampling", None)
                          and self.cfg.method.dynamic_sampling.enabled else 0)
        while have < want and rounds < max_rounds:
            rounds += 1
            prompts, ids = distributed.shard(*self.stream.take(want - have))  # this rank's share
            t0 = time.perf_counter()
            with torch.no_grad():
                batch = self.policy.generate(prompts, rc.num_generations, rc, self.generator)
            t1 = time.perf_counter()
            if len(batch) != len(prompts) * rc.num_generations:
                raise RuntimeError(
                    f"the rollout engine returned {len(batch)} samples for {len(prompts)} prompts "
                    f"x {rc.num_generations} generations"
                )
            # Relabel groups by draw index: unique across rounds and steps.
            batch.group_ids = torch.tensor(ids)[batch.group_ids]
            batch.policy_version = version
            batch.scores = self.reward.score(batch.samples)
            t_reward += time.perf_counter() - t1
            if rounds == 1:  # the policy's reward and rollout stats: before any group is dropped
                reward_metrics = batch.scores.metrics()
                reward_metrics.update({
                    f"rollout/{k[len('stat/'):]}": float(v.float().mean())
                    for k, v in batch.data.items() if k.startswith("stat/")
                })
            t_rollout += t1 - t0
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
        }
        if not kept:
            return None, metrics
        batch = RolloutBatch.concat(kept)
        if self.reference is not None:
            with torch.no_grad():
                batch.ref_logp = self.reference.logprobs(batch)
        batch = self.method.on_groups(batch)
        metrics["rollout/groups"] = batch.num_groups
        metrics["rollout/samples"] = len(batch)
        return batch, metrics
