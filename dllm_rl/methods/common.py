"""What the dLLM methods share: group advantages with the std dial, the clipped surrogate on
answer tokens with a k3 KL to the pre-update policy, and the estimator registry."""

from __future__ import annotations

import torch
from torch import Tensor

from mmrl.core.advantages import group_advantages, zero_variance_groups
from mmrl.core.batch import RolloutBatch
from mmrl.core.losses import LossOutput, aggregate, kl_penalty, loss_denominator, policy_loss
from mmrl.core.method import Method

ESTIMATORS: dict = {}


def estimator_for(run):
    """The log-prob estimator of the run's method (the policy calls it)."""
    return ESTIMATORS[run.method.type](run)


class DLLMMethod(Method):
    """diffu-GRPO and TraceRL differ only in their estimator; the objective is this one:
    -min(rho A, clip(rho, 1 - clip, 1 + clip) A) per answer token, averaged over the
    mini-batch's tokens, plus beta * k3(logp, old_logp)."""

    def keep_groups(self, batch: RolloutBatch) -> Tensor | None:
        if not self.cfg.dynamic_sampling.enabled:
            return None
        return ~zero_variance_groups(batch.rewards, batch.group_ids)

    def advantages(self, batch: RolloutBatch) -> Tensor:  # [N]
        return group_advantages(batch.rewards, batch.group_ids, scale=self.cfg.scale)

    def loss_denominator(self, batch: RolloutBatch) -> float:
        return loss_denominator(batch.mask, "token_mean")

    def old_logp(self, batch: RolloutBatch) -> Tensor:  # [N, C]
        return batch.old_logp

    def loss(self, policy, batch: RolloutBatch, advantages: Tensor, denom: float | None = None) -> LossOutput:
        logp = policy.logprobs(batch, iteration=self.epoch)  # [N, C]
        old = self.old_logp(batch)
        c = self.cfg.clip
        out = policy_loss(logp, old, advantages, batch.mask, clip_low=c, clip_high=c,
                          aggregation="token_mean", denom=denom)
        if self.cfg.kl.beta > 0:
            kl = kl_penalty(logp, old, kind="k3")  # [N, C], 0 at the first pass
            kl_term = aggregate(kl, batch.mask, "token_mean", denom=denom)
            out.loss = out.loss + self.cfg.kl.beta * kl_term
            out.metrics["loss/kl"] = float(kl_term.detach())
        return out


def scatter_rows(values: Tensor, sample: Tensor, target: Tensor, n: int) -> Tensor:
    """[R, C] per-row values at their target positions -> [N, C] (each token a target of one row)."""
    out = torch.zeros((n, values.shape[1]), dtype=values.dtype, device=values.device)
    return out.index_put((sample[:, None].expand_as(target)[target], target.nonzero()[:, 1]),
                         values[target], accumulate=True)
