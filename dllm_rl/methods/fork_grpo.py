"""ForkGRPO and its baseline AR-GRPO (Fork-dLLM, arXiv 2609.39859; paper read, no code),
docs/methods.md section 5.

    rollout    G answers per prompt by the Fork-dLLM sampler (rollout.strategy fork,
               lambda = 0.8, T = 0.8): a step commits every masked position of the block with
               confidence > lambda; if there is none it is a FALLBACK step and commits the
               leftmost masked position k alone
    rows       F_i = the fallback steps of rollout i; one training row per fallback state: the
               state before that step, target the one token x_k it committed
    ratio      exactly one token was committed, so rho = q_theta(x_k | state) / q_old(x_k | state)
               is exact, q = softmax(logits / T) at position k
    advantage  A = (r - group mean) / group std; groups with std 0 are skipped
    loss       J = mean over rollouts with |F_i| > 0 of (1 / |F_i|) sum_{t in F_i}
               min(rho A_i, clip(rho, 1 - eps, 1 + eps) A_i), eps = 0.2; loss = -J; beta = 0
               (beta > 0 adds a k3 KL to the pre-update policy, as the other dLLM methods);
               one update per rollout (train.ppo_epochs 1)

AR-GRPO (method type ar_grpo, the paper's baseline): rollouts decoded strictly left to right
(rollout.strategy ar), every step commits one token, so every answer token has an exact
ratio: the same estimator with rows = every step that committed exactly one token (rows: all).

RECONSTRUCTION: the paper publishes no code; the training rows are rebuilt here from its
description. The paper stores each fallback state during the rollout; we store its address
instead: batch.data["fork_row"] [N, C] marks the position k committed at a fallback step,
and the step is commit_step[i, k]. `state_at` rebuilds the state before that step from the
final tokens by masking every token committed at or after it. That is exact because the
sampler never re-masks a token: the state before step t is the prompt plus exactly the tokens
committed at steps < t. An [N, C] mask (rather than a list of (sample, step, position)
triples) is sliced with its rollout by batch.select, so micro-batches keep their own rows.

Choices the paper leaves open:
- A fallback row whose position lies outside `policy.completion_mask` (the <eos> filler
  after the first <eos>) is skipped: those tokens are not part of the answer and no other
  dLLM method trains them. |F_i| counts the rows that train.
- rows: all trains single-token steps only. A step that committed several tokens has no
  single-token ratio (its probability is a joint over the committed set), so it is skipped,
  whatever the strategy: with strategy ar every step qualifies; with fork or threshold only
  the steps that happened to commit one token. rows: fallback needs strategy fork (no other
  sampler flags fallback steps) and ar_grpo needs strategy ar: both are config errors.
- Zero-std groups are dropped by keep_groups (no refill rounds): their A is 0 anyway, and
  keeping them would dilute the mean over rollouts.
- The mean over rollouts with rows is exact under micro-batching: the loss is the sum of
  per-rollout means over the global count of rollouts with rows (loss_denominator, the
  trainer's `denom`); a micro-batch with no rows contributes 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dllm_rl.logprob import token_logprobs
from dllm_rl.methods.common import ESTIMATORS, DLLMMethod, EstimatorBase, scatter_rows
from dllm_rl.samplers import state_at
from mmrl.core.advantages import zero_variance_groups
from mmrl.core.batch import RolloutBatch
from mmrl.core.fsdp import is_sharded
from mmrl.core.losses import LossOutput, aggregate, kl_penalty, policy_loss
from mmrl.core.method import register_method

ROWS = ("fallback", "all")


@dataclass
class ForkRows:
    """Training rows: rollout `sample` at the state before `step`, target `position` (R rows)."""

    sample: Tensor  # [R] long
    step: Tensor  # [R] long: the step that committed the target alone
    position: Tensor  # [R] long: completion index of the target


def commits_per_step(commit_step: Tensor, num_steps: int) -> Tensor:
    """commit_step [B, C] (< 0: never committed) -> [B, S] long: tokens committed at each step."""
    cs = commit_step.long()
    if cs.numel() and int(cs.max()) >= num_steps:
        raise ValueError(f"commit_step holds step {int(cs.max())} but the rollout has {num_steps} steps")
    valid = cs >= 0
    counts = torch.zeros(cs.shape[0], num_steps, dtype=torch.long, device=cs.device)
    return counts.scatter_add_(1, cs.clamp(min=0), valid.long())  # [B, S]


def row_targets(commit_step: Tensor, fallback: Tensor, rows: str) -> Tensor:
    """[B, C] bool: the positions that are the target of a training row.

    commit_step [B, C] long; fallback [B, S] bool (the sampler's fallback steps).
    rows "fallback": positions committed at a fallback step (ForkGRPO); "all": positions
    committed at any step that committed exactly one token (AR-GRPO). A fallback step that
    committed other than one token breaks the sampler's contract: ValueError.
    """
    if rows not in ROWS:
        raise ValueError(f"rows must be one of {ROWS}; got {rows!r}")
    if commit_step.dim() != 2 or fallback.dim() != 2 or fallback.shape[0] != commit_step.shape[0]:
        raise ValueError(f"commit_step {tuple(commit_step.shape)} must be [B, C] and fallback "
                         f"{tuple(fallback.shape)} [B, S]")
    counts = commits_per_step(commit_step, fallback.shape[1])  # [B, S]
    bad = fallback.bool() & (counts != 1)
    if bad.any():
        i, s = bad.nonzero()[0].tolist()
        raise ValueError(f"rollout {i} fell back at step {s} but committed {int(counts[i, s])} tokens "
                         "there; a fallback step commits exactly one")
    single = fallback.bool() if rows == "fallback" else counts == 1  # [B, S]
    cs = commit_step.long()
    return (cs >= 0) & single.gather(1, cs.clamp(min=0))  # [B, C]


def fork_rows(target: Tensor, commit_step: Tensor) -> ForkRows:
    """target [B, C] bool (row_targets, restricted to the trained positions) -> the rows, in
    row-major order of (sample, position)."""
    sample, position = target.nonzero(as_tuple=True)  # [R], [R]
    return ForkRows(sample=sample, step=commit_step.long()[sample, position], position=position)


def row_states(completion: Tensor, commit_step: Tensor, rows: ForkRows, mask_id: int) -> Tensor:
    """[R, C] the completion as it stood before each row's step: mask_id wherever a token was
    committed at or after it (state_at with no prompt columns)."""
    return state_at(completion[rows.sample], commit_step[rows.sample], rows.step, mask_id=mask_id)


class ForkEstimator(EstimatorBase):
    """Exact single-token log-probs at the rows' targets; batch.data["fork_row"] [N, C]."""

    def __init__(self, run):
        self.rows = run.method.rows  # its fit to rollout.strategy: DLLMTrainConfig checks it

    def prepare(self, policy, batch: RolloutBatch, generator: torch.Generator) -> None:
        target = row_targets(batch.data["commit_step"], batch.data["fallback"], self.rows)
        batch.data["fork_row"] = target & batch.mask  # the <eos> filler never trains
        if not self.skip_old(batch):
            batch.old_logp = self.logprobs(policy, batch, 0).detach().float()

    def logprobs(self, policy, batch: RolloutBatch, iteration: int) -> Tensor:  # [N, C]
        completion, cs = batch.data["completion"], batch.data["commit_step"]
        target = batch.data["fork_row"]  # [N, C]
        rows = fork_rows(target, cs)
        if rows.sample.numel() == 0:  # nothing to score; a leaf keeps loss.backward() legal
            zeros = torch.zeros(completion.shape, dtype=torch.float32,
                                device=completion.device).requires_grad_(torch.is_grad_enabled())
            if torch.is_grad_enabled() and is_sharded(policy.model):  # each rank's training pass runs the
                x = torch.cat([batch.data["prompt_ids"][:1], completion[:1]], 1)  # sharded forward alike
                zeros = zeros + 0.0 * policy.logits(x, batch.data["prompt_valid"][:1]).float().sum()
            return zeros
        noisy = row_states(completion, cs, rows, policy.predictor.mask_token_id)  # [R, C]
        x = torch.cat([batch.data["prompt_ids"][rows.sample], noisy], 1)  # [R, P + C]
        logits = policy.logits(x, batch.data["prompt_valid"][rows.sample])[:, policy.prompt_length:]
        logp = token_logprobs(logits, completion[rows.sample], policy.rollout.temperature, policy.logprob_chunk)  # [R, C]
        one_hot = torch.zeros_like(noisy, dtype=torch.bool)
        row = torch.arange(len(rows.sample), device=noisy.device)
        one_hot[row, rows.position] = True  # [R, C]: each row's target
        return scatter_rows(logp, rows.sample, one_hot, len(batch))


ESTIMATORS["fork_grpo"] = ForkEstimator
ESTIMATORS["ar_grpo"] = ForkEstimator


@register_method("fork_grpo")
class ForkGRPO(DLLMMethod):
    """The per-rollout mean of the clipped single-token surrogate over its rows, averaged over
    the rollouts that have rows; zero-std groups are skipped."""

    count_metrics = ("fork/rows",)

    def keep_groups(self, batch: RolloutBatch) -> Tensor | None:
        return ~zero_variance_groups(batch.rewards, batch.group_ids)  # [N]

    def loss_denominator(self, batch: RolloutBatch) -> float:
        """The rollouts with at least one row. It adds over groups (pipelined training sums
        it) and may be 0: then no micro-batch has a row and every loss is 0."""
        return float(batch.data["fork_row"].any(1).sum())

    def loss(self, policy, batch: RolloutBatch, advantages: Tensor, denom: float | None = None) -> LossOutput:
        rows = batch.data["fork_row"]  # [N, C]
        logp = policy.logprobs(batch, iteration=self.epoch)  # [N, C], 0 off the rows
        old = self.old_or_first_pass(batch, logp, lambda: batch.old_logp)
        d = denom if denom else float(max(int(rows.any(1).sum()), 1))  # 0 -> no rows anywhere
        c = self.cfg.clip
        out = policy_loss(logp, old, advantages, rows, clip_low=c, clip_high=c,
                          aggregation="seq_mean_token_mean", denom=d)
        if self.cfg.kl.beta > 0:
            kl = kl_penalty(logp, old, kind="k3")  # [N, C], 0 at the first pass
            kl_term = aggregate(kl, rows, "seq_mean_token_mean", denom=d)
            out.loss = out.loss + self.cfg.kl.beta * kl_term
            out.metrics["loss/kl"] = float(kl_term.detach())
        return out

    def batch_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        has = batch.data["fork_row"].any(1)  # [N]
        return {"fork/rows": float(batch.data["fork_row"].sum()),
                "fork/rollouts_without_rows": float((~has).float().mean()) if len(batch) else 0.0}


@register_method("ar_grpo")
class ARGRPO(ForkGRPO):
    """AR-GRPO: ForkGRPO's objective on left-to-right rollouts, every answer token a row."""
