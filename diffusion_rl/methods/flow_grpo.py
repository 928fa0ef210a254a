"""Flow-GRPO (Liu et al., arXiv 2505.05470; code: yifan123/flow_grpo), docs/methods.md section 4.

    rollout   G images per prompt by the SDE sampler; each SDE step is a Gaussian transition
              whose log-prob (mean over latent elements) is kept (diffusion_rl.policy)
    advantage A = (R - group mean) / (group std + 1e-4), clipped to +-adv_clip; the population std
              (np.std), as Flow-GRPO's stat tracker (method.adv_std: unbiased for G - 1)
    loss      per trained step: -min(rho A, clip(rho, 1 - eps, 1 + eps) A), rho = exp(logp - old_logp),
              averaged over samples and steps; eps is tiny (1e-4) because the log-prob is a mean
    KL        beta * mean((mean_theta - mean_ref)^2) / (2 std_t^2) per step, std_t = a sqrt(sigma /
              (1 - sigma)) (the SDE's noise scale without the step's sqrt(-Delta), as Flow-GRPO's
              code divides); the reference being the starting weights (or the base under LoRA,
              adapters disabled)

The window (SDE noise on W consecutive steps, ODE elsewhere, train on the window: "Flow-GRPO-
Fast") and step subsampling (rollout.train_fraction) are rollout settings.

EMA (method.ema, off by default; Flow-GRPO's train.ema with decay 0.9, an update every 8
optimizer steps and a warm-up of the decay): an exponential moving average of the trainable
weights (diffusion_rl.ema), which the core loop updates after every optimizer step and swaps
in for evaluation, the sample grids and the checkpoint's model; rollouts and the loss use the
raw weights.

Departures (checked against yifan123/flow_grpo, tests/diffusion/test_flow_grpo_reference.py):
- the advantage's std is the group's by default. Most of Flow-GRPO's SD3 / FLUX configs set
  sample.global_std = True (config/grpo.py; a few, e.g. pickscore_flux_fast, False), dividing
  each prompt's centred rewards by the population std of the whole round's rewards instead
  (flow_grpo/stat_tracking.py): method.adv_std: global.
- samples whose advantage is 0 (groups whose rewards are all equal) stay in the batch: they
  count in the loss's denominator and carry the KL term. Flow-GRPO drops them before training
  (scripts/train_sd3.py, `mask = advantages.abs().sum(dim=1) != 0`), so its mean runs over the
  remaining samples only.
- rollout.train_fraction < 1 trains a random subset of the window's steps, drawn once per
  rollout (with the rollout generator, so a resumed run replays it); Flow-GRPO's
  timestep_fraction trains the first int(N * fraction) steps in order (0.99 at N = 10: steps
  0..8, our window at train_fraction 1).
- the EMA moves once per update_every optimizer steps (Flow-GRPO steps it per micro-batch, so
  gradient accumulation can move it several times in one optimizer step), and a checkpoint also
  keeps the raw weights and the average, so a resumed run goes on exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from diffusion_rl.ema import ParameterEMA
from mmrl.core.advantages import group_advantages
from mmrl.core.batch import RolloutBatch
from mmrl.core.config import ConfigError
from mmrl.core.losses import LossOutput, aggregate, loss_denominator, policy_loss
from mmrl.core.method import Method, register_method


def std_of(adv_std: str) -> dict:
    """The core's advantage scale for method.adv_std: the group's std (population or unbiased),
    or the population std of the whole step's rewards ("global", Flow-GRPO's global_std)."""
    return {"scale": "batch" if adv_std == "global" else "group", "population": adv_std != "unbiased"}


@register_method("flow_grpo")
class FlowGRPO(Method):
    def __init__(self, cfg, run, reward):
        super().__init__(cfg, run, reward)
        if run is not None and run.rollout.noise_level == 0:
            raise ConfigError(f"method {cfg.type} trains on the log-probabilities of its SDE steps, and with "
                              "rollout.noise_level 0 the steps are deterministic (ODE) and have none: set "
                              "rollout.noise_level > 0 (0.7 is Flow-GRPO's)")
        self.needs_reference = cfg.kl.beta > 0

    def weight_average(self, params: list[Tensor]) -> ParameterEMA | None:
        """The EMA the core loop keeps of the trainable weights (None when method.ema is off)."""
        e = self.cfg.ema
        return None if e is None else ParameterEMA(params, e.decay, e.update_every, e.warmup)

    def advantages(self, batch: RolloutBatch) -> Tensor:  # [N]
        adv = group_advantages(batch.rewards, batch.group_ids, eps=self.cfg.std_eps, **std_of(self.cfg.adv_std))
        return adv.clamp(-self.cfg.adv_clip, self.cfg.adv_clip)

    def loss_denominator(self, batch: RolloutBatch) -> float:
        return loss_denominator(batch.mask, "token_mean")  # samples x trained steps

    def loss(self, policy, batch: RolloutBatch, advantages: Tensor, denom: float | None = None) -> LossOutput:
        steps = policy.sde_outputs(batch)
        logp = torch.stack([s.log_prob for s in steps], 1)  # [N, T]
        eps = self.cfg.clip_range
        out = policy_loss(logp, batch.old_logp, advantages, batch.mask, clip_low=eps, clip_high=eps,
                          aggregation="token_mean", denom=denom)
        return self.add_kl(out, steps, batch, denom)

    def add_kl(self, out: LossOutput, steps: list, batch: RolloutBatch, denom: float | None) -> LossOutput:
        """out plus beta * the KL term to the reference (when beta > 0), logged as loss/kl."""
        if self.needs_reference:
            ref = batch.data["ref_mean"]  # [N, T, ...]
            kl = torch.stack([((s.mean - ref[:, t]) ** 2).flatten(1).mean(1) / (2 * s.kl_std.flatten(1)[:, 0] ** 2)
                          for t, s in enumerate(steps)], 1)  # [N, T]
            kl_term = aggregate(kl, batch.mask, "token_mean", denom=denom)
            out.loss = out.loss + self.cfg.kl.beta * kl_term
            out.metrics["loss/kl"] = float(kl_term.detach())
        return out
