"""The GRPO family as one method with dials (docs/methods.md section 1).

    GRPO     advantage.scale=group, aggregation=seq_mean_token_mean, clip 0.2/0.2
    Dr.GRPO  advantage.scale=none, aggregation=seq_mean_token_sum_norm
    DAPO     clip_high=0.28, aggregation=token_mean, dynamic_sampling.enabled
    GSPO     loss.level=sequence, tiny clips (3e-4 / 4e-4)
    RLOO     advantage.type=rloo
    FastRL   fastrl.enabled on any of them: prune near-duplicate rollouts of equal advantage
             (MDAP) and adapt the group size per data epoch (ARS); see mmrl.core.fastrl

"The std dial": dividing by the std (GRPO), not dividing (Dr.GRPO) and dropping
std = 0 groups (DAPO) are one knob (`scale`) plus one filter (`keep_groups`),
not three code paths. The presets live in configs/<modality>/*.yaml.

DAPO's overlong rules: the soft punishment is a reward atom (`reward.overlong`,
mmrl.core.overlong); overlong filtering is `method.overlong_filter` (prune below).

Departures: none in the estimators.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmrl.core import distributed
from mmrl.core.advantages import (
    group_advantages,
    multi_stream_advantages,
    rloo_advantages,
    zero_variance_groups,
)
from mmrl.core.batch import RolloutBatch
from mmrl.core.config import ConfigError
from mmrl.core.fastrl import AdaptiveGroupSize, mdap_counts, sample_advantages, sequences_of
from mmrl.core.losses import LossOutput, aggregate, kl_penalty, loss_denominator, policy_loss
from mmrl.core.method import SAMPLE_WEIGHT, Method, register_method


@register_method("grpo")
class GRPO(Method):
    def __init__(self, cfg, run, reward):
        super().__init__(cfg, run, reward)
        self.needs_reference = cfg.kl.beta > 0
        self.max_len = cfg.loss.max_len or run.rollout.max_new_tokens
        fastrl = getattr(cfg, "fastrl", None)
        self.fastrl = fastrl if fastrl is not None and fastrl.enabled else None
        g, world = run.rollout.num_generations, distributed.world_size()
        if self.fastrl is not None and fastrl.pad_multiple is None and 1 < g <= world:
            # the config refuses a pad_multiple >= G it is given; null means the world size, known only here
            raise ConfigError(f"method.fastrl.pad_multiple is null: the data-parallel world size ({world}), which is "
                              f"not below rollout.num_generations ({g}): every group's kept rollouts would be padded "
                              f"back to all {g}, so MDAP prunes nothing; set pad_multiple below {g} (1: no padding)")
        self.ars = (AdaptiveGroupSize(run.rollout.num_generations, fastrl.min_group_size)
                    if self.fastrl is not None and fastrl.ars else None)

    def keep_groups(self, batch: RolloutBatch) -> Tensor | None:
        if not self.cfg.dynamic_sampling.enabled:
            return None
        return ~zero_variance_groups(batch.rewards, batch.group_ids)

    def advantages(self, batch: RolloutBatch) -> Tensor:  # [N]
        adv = self.cfg.advantage
        if adv.type == "group":
            return group_advantages(batch.rewards, batch.group_ids, scale=adv.scale, eps=adv.eps)
        if adv.type == "rloo":
            return rloo_advantages(batch.rewards, batch.group_ids)
        weights = torch.tensor([a.weight for a in self.reward.atoms], dtype=torch.float32)
        return multi_stream_advantages(
            batch.scores.values, batch.group_ids, weights, mode=adv.mode, scale=adv.scale, eps=adv.eps
        )

    def prune(self, group: RolloutBatch) -> Tensor | None:  # bool [G], or float [G] weights
        """FastRL's MDAP, then DAPO's overlong filtering (truncated rollouts carry no loss)."""
        keep = self._mdap(group)
        if not self.cfg.overlong_filter:
            return keep
        truncated = group.data.get("stat/truncated")
        if truncated is None:
            raise ValueError("method.overlong_filter needs to know which rollouts were truncated "
                             "(batch.data['stat/truncated']), and this backend's rollouts do not say")
        whole = truncated.to("cpu") == 0
        return whole if keep is None else keep * whole  # bool & bool, or counts zeroed

    def _mdap(self, group: RolloutBatch) -> Tensor | None:
        """FastRL's MDAP; the kept count feeds the adaptive group size. With `weight: count`
        the kept rollouts come with the number of rollouts each stands for."""
        fr = self.fastrl
        if fr is None:
            return None
        counts = mdap_counts(
            sample_advantages(group.advantages, group.mask), sequences_of(group),
            tau=fr.tau, n=fr.ngram, tol=fr.adv_tol, multiple=fr.pad_multiple or distributed.world_size(),
            against=fr.against, zero_sets=fr.zero_sets,
        )
        keep = counts > 0
        if self.ars is not None:  # every rank records every rank's groups: one G for all, saved whole
            for kept in distributed.gather_scalar(int(keep.sum())):
                self.ars.record(int(kept))
        return counts if fr.weight == "count" else keep

    def group_size(self, epoch: int, current: int) -> int:
        """FastRL's ARS: G of the data epoch that starts now, from the kept counts so far."""
        if self.ars is None:
            return current
        return self.ars.next_size(self.step, self.run.train.max_steps)

    def state_dict(self) -> dict:
        return {} if self.ars is None else {"ars": self.ars.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.ars is not None and "ars" in state:
            self.ars.load_state_dict(state["ars"])

    def loss_denominator(self, batch: RolloutBatch) -> float:
        return loss_denominator(batch.mask, self.cfg.loss.aggregation, batch.data.get(SAMPLE_WEIGHT))

    def loss(self, policy, batch: RolloutBatch, advantages: Tensor, denom: float | None = None) -> LossOutput:
        lc = self.cfg.loss
        logp = policy.logprobs(batch)  # [N, T]
        weights = batch.data.get(SAMPLE_WEIGHT)  # [N] or None: FastRL's counts
        out = policy_loss(
            logp, batch.old_logp, advantages, batch.mask,
            clip_low=lc.clip_low, clip_high=lc.clip_high, dual_clip=lc.dual_clip, level=lc.level,
            aggregation=lc.aggregation, max_len=self.max_len, denom=denom, weights=weights,
        )
        if self.needs_reference:
            kl = kl_penalty(logp, batch.ref_logp, kind=self.cfg.kl.kind)  # [N, T]
            kl_term = aggregate(kl, batch.mask, lc.aggregation, max_len=self.max_len, denom=denom,
                                weights=weights)
            out.loss = out.loss + self.cfg.kl.beta * kl_term
            out.metrics["loss/kl"] = float(kl_term.detach())
        return out
