"""What the dLLM methods share: group advantages with the std dial, the clipped surrogate on
answer tokens with a k3 KL to the pre-update policy, and the estimator registry."""

from __future__ import annotations

import torch
from torch import Tensor

from mmrl.core.advantages import group_advantages, group_stats, zero_variance_groups
from mmrl.core.batch import RolloutBatch
from mmrl.core.losses import LossOutput, aggregate, kl_penalty, loss_denominator, policy_loss
from mmrl.core.method import METHODS, Method
from mmrl.core.pipeline import exactly_on_policy, first_pass_on_policy

ESTIMATORS: dict = {}


def estimator_for(run):
    """The log-prob estimator of the run's method (the policy calls it). A method registered
    without one of its own (a subclass of diffu-GRPO, say) takes its nearest registered base's."""
    name = run.method.type
    if name not in ESTIMATORS:
        bases = METHODS[name].__mro__[1:] if name in METHODS else ()
        inherited = [n for base in bases for n, cls in METHODS.items() if cls is base and n in ESTIMATORS]
        if not inherited:
            raise ValueError(f"dLLM method {name!r} has no log-prob estimator: register one with "
                             f"dllm_rl.methods.common.ESTIMATORS[{name!r}] = <estimator class> "
                             "(diffu-GRPO's mean-field one is ESTIMATORS['diffu_grpo'])")
        name = inherited[0]
    estimator = ESTIMATORS[name](run)
    on_policy = exactly_on_policy if estimator.per_pass_inputs else first_pass_on_policy
    estimator.on_policy = on_policy(run)
    return estimator


# batch.data key, [N] int64 row ids: the estimator scored no old log-probs for these rows,
# because the first pass over them runs under the rollout's weights
# (mmrl.core.pipeline.first_pass_on_policy); the loss takes that pass's. The batch carries
# it, so a loss never mistakes unscored rows for scored ones.
FIRST_PASS = "old_logp/first_pass_row"


class EstimatorBase:
    """What the estimators (dllm_rl.policy.Estimator) share. `on_policy` (set by
    estimator_for): `prepare` draws what the rows need (masks, seeds, targets: the
    generator's draws are the same either way) but scores no old log-probs, a forward pass
    over every row saved; it numbers the rows instead.
    per_pass_inputs: each pass scores other inputs (d1's masks per iteration), so only a
    run with a single pass may skip."""

    on_policy = False
    per_pass_inputs = False
    issued = 0  # row ids handed out so far

    def skip_old(self, batch: RolloutBatch) -> bool:
        """True (and the rows numbered) when the old log-probs need no pass of their own."""
        if self.on_policy:  # row ids stay on the CPU: only read as Python ints (tolist)
            batch.data[FIRST_PASS] = torch.arange(self.issued, self.issued + len(batch))
            self.issued += len(batch)
        return self.on_policy


class DLLMMethod(Method):
    """diffu-GRPO and TraceRL differ only in their estimator; the objective is this one:
    -min(rho A, clip(rho, 1 - clip, 1 + clip) A) per answer token, averaged over the
    mini-batch's tokens, plus beta * k3(logp, old_logp)."""

    def __init__(self, cfg, run, reward):
        super().__init__(cfg, run, reward)
        self.band = getattr(cfg, "accuracy_band", None)
        if self.band is not None:  # 0 <= lo <= hi <= 1 (the config's AccuracyBand)
            self.success_atom = success_atom_of(run)
        self.first_pass: dict[int, Tensor] = {}  # row id -> its log-probs in pass 0 of this step
        self.first_pass_step = -1

    def old_or_first_pass(self, batch: RolloutBatch, logp: Tensor, stored) -> Tensor:
        """The old log-probs to compare logp with: `stored()`, or for rows whose estimator
        scored none (FIRST_PASS), those of the first pass over them, which ran under the
        rollout's weights: logp itself, detached, in pass 0 (ratio exactly 1, KL 0), kept by
        row id for the later passes."""
        ids = batch.data.get(FIRST_PASS)
        if ids is None:
            return stored()
        if self.epoch == 0:
            if self.first_pass_step != self.step:  # a new batch: drop the last one's
                self.first_pass, self.first_pass_step = {}, self.step
            old = logp.detach()
            self.first_pass.update(zip(ids.tolist(), old))
            return old
        missing = [i for i in ids.tolist() if i not in self.first_pass]
        if missing:
            raise RuntimeError(f"pass {self.epoch} over rows whose first pass this method did not run "
                               f"(row ids {missing[:5]}): their old log-probs are unknown")
        return torch.stack([self.first_pass[i] for i in ids.tolist()])

    def keep_groups(self, batch: RolloutBatch) -> Tensor | None:
        """The accuracy band where the method has one (dropped groups are refilled only with
        dynamic_sampling on), else dynamic sampling's zero-variance filter."""
        if self.band is not None:
            return self.band_filter(batch)
        if not self.cfg.dynamic_sampling.enabled:
            return None
        return ~zero_variance_groups(batch.rewards, batch.group_ids)

    def band_filter(self, batch: RolloutBatch) -> Tensor:  # [N] bool
        """Keep the groups whose accuracy (the share of answers scoring >= 0.5 on the task's
        success atom) lies within accuracy_band."""
        names = batch.scores.names
        if self.success_atom not in names:
            raise ValueError(f"method.accuracy_band counts the atom {self.success_atom!r}, which this "
                             f"reward does not have (atoms: {', '.join(names)})")
        success = batch.scores.values[:, names.index(self.success_atom)] >= 0.5  # [N]
        accuracy, _, _ = group_stats(success.double(), batch.group_ids)  # [N]: its group's share right
        return in_band(accuracy, self.band)

    def advantages(self, batch: RolloutBatch) -> Tensor:  # [N]
        return group_advantages(batch.rewards, batch.group_ids, scale=self.cfg.scale)

    def loss_denominator(self, batch: RolloutBatch) -> float:
        return loss_denominator(batch.mask, "token_mean")

    def old_logp(self, batch: RolloutBatch) -> Tensor:  # [N, C]
        return batch.old_logp

    def loss(self, policy, batch: RolloutBatch, advantages: Tensor, denom: float | None = None) -> LossOutput:
        logp = policy.logprobs(batch, iteration=self.epoch)  # [N, C]
        old = self.old_or_first_pass(batch, logp, lambda: self.old_logp(batch))
        c = self.cfg.clip
        out = policy_loss(logp, old, advantages, batch.mask, clip_low=c, clip_high=c,
                          aggregation="token_mean", denom=denom)
        if self.cfg.kl.beta > 0:
            kl = kl_penalty(logp, old, kind="k3")  # [N, C], 0 at the first pass
            kl_term = aggregate(kl, batch.mask, "token_mean", denom=denom)
            out.loss = out.loss + self.cfg.kl.beta * kl_term
            out.metrics["loss/kl"] = float(kl_term.detach())
        return out


def in_band(accuracy: Tensor, band: tuple[float, float]) -> Tensor:  # [N] bool
    """The accuracy-band filter: keep lo <= accuracy <= hi (drop > hi and < lo)."""
    lo, hi = band
    return (accuracy >= lo) & (accuracy <= hi)


def success_atom_of(run) -> str:
    """The atom whose value says an answer is right: the task's success_atom (arith "answer",
    sudoku "solved"); "answer" for a run without a known task."""
    from dllm_rl.tasks import get_task

    task = getattr(getattr(run, "task", None), "type", None)
    if task is None:
        return "answer"
    return get_task(task).success_atom


def scatter_rows(values: Tensor, sample: Tensor, target: Tensor, n: int) -> Tensor:
    """[R, C] per-row values at their target positions -> [N, C] (each token a target of one row)."""
    out = torch.zeros((n, values.shape[1]), dtype=values.dtype, device=values.device)
    return out.index_put((sample[:, None].expand_as(target)[target], target.nonzero()[:, 1]),
                         values[target], accumulate=True)
