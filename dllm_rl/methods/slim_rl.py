"""SLIM-RL (code: laolaorkkkkk/SLIM-RL; only the paper's abstract was available), docs/methods.md section 5.

    rollout    G answers per prompt by the tau-budget decoder (rollout.strategy tau_budget,
               tau 0.9, m 1): each step commits the confident tokens whose summed risk
               sum(1 - c) fits the budget m (1 - tau); the policy logs that risk per rollout
               as rollout/expected_wrong (summed over the rollout's steps, not per step as the
               method's summary has it; per step it is the sampler's DecodeResult.expected_wrong)
    rows       trace-free: Q-point Gauss-Legendre quadrature over the masking level t in
               (0, 1) (Q = 3: t = 0.1127, 0.5, 0.8873, w = 0.2778, 0.4444, 0.2778), one
               training row per node: Q rows per rollout, whatever path the decoder took
    masks      row q masks each answer token of block j with Bernoulli(p_{q,j}),
               p_{q,j} = t_q + (s/2) cos(pi j / (B - 1)), s = min(max_spread, 2 min(t, 1 - t) - 1e-6):
               a schedule that decreases across the B decoding blocks and averages exactly t_q;
               at least one masked token per row
    log-prob   log pi(o_k) = the row's prediction of o_k at its masked positions, given the
               prompt and the row's unmasked answer tokens
    ratio      s = exp(clamp(mean over the row's masked tokens of (logp - old_logp), +-max_log_ratio))
    advantage  A = r - group mean (Dr.GRPO; scale "group" also divides by the group std)
    loss       -sum over rows of w_q min(s A, clip(s, 1 - eps, 1 + eps) A) / rows
               + beta sum over rows of w_q (k3 summed over the row's masked tokens) / C / rows,
               k3 to the pre-update policy (eps 0.1, beta 0.01, C the answer length)
    groups     drop groups whose accuracy lies outside accuracy_band = [0.2, 0.8]; the step
               trains on the rest, as the code does (dynamic_sampling.enabled refills them
               with extra rollout rounds, as DAPO); an answer with no <eos> within gen_length
               scores 0 on every atom before that

RECONSTRUCTED from the code and the method summary (the paper itself was not available):
the at-least-one-mask rule's choice of position, the accuracy definition and where the length
rule applies. The normalisation and the KL's aggregation follow the code (checked against it,
tests/dllm/test_dllm_reference.py). Choices made here:

- Normalisation: rows = N * Q of the whole mini-batch (`loss_denominator`), so the loss is the
  mean over rows of the w_q-weighted terms, i.e. (1 / Q) x the quadrature estimate of the
  integral over t averaged over samples (a constant factor). The trainer passes this global
  row count to every micro-batch, so micro-batch losses sum to the mini-batch's exactly.
- KL, as SLIM-RL's code (train/slim_rl_sdar.py, read 2026-12-07): k3 per masked token, summed
  within each row and divided by the answer length C (the code's L1, its batch's padded answer
  length), weighted by w_q, then summed over rows / rows (the same denominator, so it too is
  exact under micro-batching). Until 2026-12-07 it was each row's masked-token mean, unweighted.
- A row whose Bernoulli draws mask nothing masks one uniformly chosen answer position.
- Masks are drawn at rollout time from the rollout generator and stored (batch.data
  "slim/mask" [N, Q, C]), so old and new log-probs see the same inputs for every PPO pass
  and a sample's masks do not depend on micro-batching.
- Accuracy of a group = the fraction of its answers whose task success atom
  (dllm_rl.tasks.get_task(task.type).success_atom: arith "answer", sudoku "solved") is >= 0.5,
  as the task's own accuracy counts it.
- The length rule is applied in `keep_groups`, the first hook the scheduler calls after
  scoring (before the filter and the advantages); reward/* metrics of the round are logged
  before it, the rollout/truncated fraction shows how many answers it zeroes.
- batch.old_logp keeps the sampler's commit log-probs (it must be [N, C]); the objective reads
  the row-wise old log-probs from batch.data["slim/old_logp"] [N, Q, C]. The config trains
  exactly on-policy (one pass, one mini-batch), so that pass is skipped and the loss takes the
  new log-probs, detached (dllm_rl.methods.common.EstimatorBase; bit for bit the same loss).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from torch import Tensor

from dllm_rl.logprob import masked_input, token_logprobs, uniform
from dllm_rl.methods.common import ESTIMATORS, DLLMMethod, EstimatorBase
from mmrl.core.batch import RolloutBatch
from mmrl.core.losses import LossOutput, aggregate, kl_penalty, policy_loss
from mmrl.core.method import register_method
from mmrl.core.rewards import AtomScores

# --------------------------------------------------------------------------- pure functions


def quadrature(q: int) -> tuple[Tensor, Tensor]:
    """Gauss-Legendre nodes t [Q] in (0, 1) and weights w [Q] (summing to 1), float64:
    numpy's leggauss on [-1, 1] mapped by t = (x + 1) / 2, w = w / 2."""
    if q < 1:
        raise ValueError(f"quadrature needs at least one point; got {q}")
    x, w = np.polynomial.legendre.leggauss(q)
    return torch.from_numpy((x + 1) / 2), torch.from_numpy(w / 2)


def block_mask_rates(t: float, num_blocks: int, max_spread: float) -> Tensor:  # [B] float64
    """Per-block mask rates p_j = t + (s/2) cos(pi j / (B - 1)), j = 0..B-1, with
    s = min(max_spread, 2 min(t, 1 - t) - 1e-6): non-increasing across blocks (early blocks,
    decoded first, are masked more), mean exactly t (the cosines are symmetric about pi/2),
    every rate strictly inside (0, 1). B = 1 gives [t]."""
    if not 0 < t < 1:
        raise ValueError(f"masking level t must lie in (0, 1); got {t}")
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1; got {num_blocks}")
    if not 0 <= max_spread < 1:
        raise ValueError(f"max_spread must lie in [0, 1); got {max_spread}")
    if num_blocks == 1:
        return torch.tensor([t], dtype=torch.float64)
    s = max(0.0, min(max_spread, 2 * min(t, 1 - t) - 1e-6))
    j = torch.arange(num_blocks, dtype=torch.float64)
    cos = torch.cos(math.pi * j / (num_blocks - 1))
    cos = (cos - cos.flip(0)) / 2  # exactly antisymmetric: the mean is t up to rounding
    return t + (s / 2) * cos


def draw_masks(valid: Tensor, rates: Tensor, block_length: int, generator: torch.Generator) -> Tensor:
    """[N, Q, C] bool: position c of row q masked with probability rates[q, c // block_length],
    only where valid [N, C] (the answer up to its first <eos>); a row with no masked position
    masks one valid position drawn uniformly. rates [Q, B]."""
    n, c = valid.shape
    q, b = rates.shape
    if b * block_length != c:
        raise ValueError(f"{b} blocks of {block_length} tokens do not cover the {c} answer positions")
    if not valid.any(1).all():
        raise ValueError("every answer needs at least one trainable position (its completion mask is empty)")
    p = rates.float().repeat_interleave(block_length, 1)  # [Q, C]
    u = uniform((n, q, c), generator=generator, device=valid.device)  # [N, Q, C]
    v = valid[:, None, :].expand(n, q, c)
    mask = (u < p.to(valid.device)) & v
    # Fallback: the valid position with the largest uniform key (a uniform choice among them).
    key = torch.where(v, uniform((n, q, c), generator=generator, device=valid.device), torch.full_like(u, -1.0))
    one = torch.zeros_like(mask).scatter_(2, key.argmax(2, keepdim=True), True)
    return torch.where(mask.any(2, keepdim=True), mask, one)


def truncated(completion: Tensor, eos_id: int) -> Tensor:  # [N] bool
    """Answers that hit the length limit: no <eos> in their gen_length tokens."""
    return ~(completion == eos_id).any(1)


def zero_truncated(scores: AtomScores, hit_limit: Tensor) -> AtomScores:
    """The length-limit rule: every atom and the total of a truncated answer become 0."""
    keep = (~hit_limit).to(scores.values.device, scores.values.dtype)  # the rollout's device -> the scores
    return AtomScores(list(scores.names), scores.values * keep[:, None], scores.total * keep.to(scores.total.dtype),
                      scores.errors, scores.failed)


# --------------------------------------------------------------------------- estimator


class QuadratureRows(EstimatorBase):
    """SLIM-RL's trace-free estimator: Q masked copies of each answer.

    batch.data: "slim/mask" [N, Q, C] bool, "slim/old_logp" [N, Q, C] (zero off the mask),
    "slim/truncated" [N] bool, "stat/truncated" [N] (logged as rollout/truncated)."""

    def __init__(self, run):
        m, r = run.method, run.rollout
        self.t, self.w = quadrature(m.quadrature_points)  # [Q], [Q]
        self.block_length = r.block_length
        blocks = r.gen_length // r.block_length
        self.rates = torch.stack([block_mask_rates(float(t), blocks, m.max_spread) for t in self.t])  # [Q, B]

    def prepare(self, policy, batch: RolloutBatch, generator: torch.Generator) -> None:
        completion = batch.data["completion"]
        batch.data["slim/mask"] = draw_masks(batch.mask, self.rates, self.block_length, generator)
        hit = truncated(completion, policy.predictor.eos_token_id)
        batch.data["slim/truncated"] = hit
        batch.data["stat/truncated"] = hit.float()
        if not self.skip_old(batch):
            batch.data["slim/old_logp"] = self.logprobs(policy, batch, 0).float()

    def logprobs(self, policy, batch: RolloutBatch, iteration: int) -> Tensor:  # [N, Q, C]
        """The answer tokens' log-probs at each row's masked positions (0 elsewhere)."""
        mask = batch.data["slim/mask"]  # [N, Q, C]
        n, q, c = mask.shape
        completion = batch.data["completion"].repeat_interleave(q, 0)  # [N*Q, C]
        noisy = masked_input(completion, mask.reshape(n * q, c), policy.predictor.mask_token_id)
        x = torch.cat([batch.data["prompt_ids"].repeat_interleave(q, 0), noisy], 1)  # [N*Q, P + C]
        valid = batch.data["prompt_valid"].repeat_interleave(q, 0)
        logits = policy.logits(x, valid)[:, policy.prompt_length:]  # [N*Q, C, V]
        logp = token_logprobs(logits, completion, policy.rollout.temperature, policy.logprob_chunk).reshape(n, q, c)
        return torch.where(mask, logp, torch.zeros_like(logp))


ESTIMATORS["slim_rl"] = QuadratureRows


# --------------------------------------------------------------------------- method


@register_method("slim_rl")
class SLIMRL(DLLMMethod):
    """Sequence-ratio PPO over the quadrature rows, Dr.GRPO advantages (inherited), the
    accuracy band and the length-limit rule."""

    count_metrics = ("slim/rows", "slim/truncated")

    def __init__(self, cfg, run, reward):
        super().__init__(cfg, run, reward)
        self.t, self.w = quadrature(cfg.quadrature_points)  # [Q], [Q]
        strategy = getattr(getattr(run, "rollout", None), "strategy", None)
        if strategy is not None and strategy != "tau_budget":
            warnings.warn(f"SLIM-RL rolls out with the tau_budget decoder; this run uses rollout.strategy="
                          f"{strategy!r} (the objective is trace-free, so it still trains)", stacklevel=2)

    # ------------------------------------------------------------------ groups

    def keep_groups(self, batch: RolloutBatch) -> Tensor:  # [N] bool
        """The length-limit rule (first: it changes the scores), then the accuracy band."""
        if self.cfg.length_limit_wrong and "slim/truncated" in batch.data:
            batch.scores = zero_truncated(batch.scores, batch.data["slim/truncated"])
        return self.band_filter(batch)

    def batch_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        out = {"slim/rows": float(len(batch) * len(self.w))}
        if "slim/truncated" in batch.data:
            out["slim/truncated"] = float(batch.data["slim/truncated"].sum())
        return out

    # ------------------------------------------------------------------ loss

    def loss_denominator(self, batch: RolloutBatch) -> float:
        """The mini-batch's training rows N * Q (adds over groups)."""
        return float(len(batch) * len(self.w))

    def loss(self, policy, batch: RolloutBatch, advantages: Tensor, denom: float | None = None) -> LossOutput:
        logp = policy.logprobs(batch, iteration=self.epoch)  # [N, Q, C]
        old = self.old_or_first_pass(batch, logp, lambda: batch.data["slim/old_logp"])
        return slim_loss(logp, old, batch.data["slim/mask"], advantages, self.w,
                         clip=self.cfg.clip, max_log_ratio=self.cfg.max_log_ratio, beta=self.cfg.kl.beta,
                         denom=denom)


def slim_loss(logp: Tensor, old_logp: Tensor, mask: Tensor, advantages: Tensor, weights: Tensor, *,
              clip: float, max_log_ratio: float, beta: float, denom: float | None = None) -> LossOutput:
    """-sum over rows (i, q) of w_q min(s A_i, clip(s, 1 - clip, 1 + clip) A_i) / denom
    + beta * sum over rows of w_q (row's k3 summed over its masked tokens) / C / denom;
    denom = rows N * Q when None, C the answer length.

    logp, old_logp [N, Q, C]; mask [N, Q, C] bool (the rows' masked positions); advantages [N];
    weights [Q] (> 0, so w_q min(s A, clip(s) A) = min(s w_q A, clip(s) w_q A): GSPO's
    sequence-level policy_loss with advantages w_q A_i, aggregated per row)."""
    if logp.dim() != 3 or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(f"logp, old_logp and mask must share one [N, Q, C] shape; got {tuple(logp.shape)}, "
                         f"{tuple(old_logp.shape)}, {tuple(mask.shape)}")
    n, q, c = logp.shape
    if advantages.shape != (n,) or weights.shape != (q,):
        raise ValueError(f"advantages must be [N] = [{n}] and weights [Q] = [{q}]; got "
                         f"{tuple(advantages.shape)}, {tuple(weights.shape)}")
    rows_logp, rows_old, rows_mask = logp.reshape(n * q, c), old_logp.reshape(n * q, c), mask.reshape(n * q, c)
    weights = weights.to(advantages.device)  # the quadrature weights are made on the CPU
    adv = (advantages.detach().double()[:, None] * weights.double()[None, :]).reshape(n * q)  # [N*Q]
    out = policy_loss(rows_logp, rows_old, adv.to(torch.float32), rows_mask, clip_low=clip, clip_high=clip,
                      level="sequence", aggregation="seq_mean_token_mean", denom=denom,
                      max_log_ratio=max_log_ratio)
    if beta > 0:
        # SLIM-RL's code (train/slim_rl_sdar.py): a row's k3 summed over its masked tokens / the
        # answer length, weighted by w_q like the surrogate, then summed over rows / rows
        kl = kl_penalty(rows_logp, rows_old, kind="k3")  # [N*Q, C], 0 at the first pass
        w_row = weights.to(device=kl.device, dtype=kl.dtype).repeat(n)  # [N*Q]: row (i, q) weighs w_q
        kl_term = aggregate(kl * w_row[:, None], rows_mask, "seq_mean_token_sum_norm", max_len=c, denom=denom)
        out.loss = out.loss + beta * kl_term
        out.metrics["loss/kl"] = float(kl_term.detach())
    return out
