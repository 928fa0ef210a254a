"""VPPO, visually-perceptive policy optimization (arXiv 2510.09285; public code).

On top of the GRPO family (here DAPO's settings, configs/vlm/vppo.yaml), one extra no-grad
forward re-scores each sampled response with its image perturbed: random patches
blacked out with probability p = 0.5 (mmrl.vlm.interventions.mask_patches; 14-px
patches on Qwen2/2.5-VL, 16-px on Qwen3-VL). Per token,

    d_t = logp_aug_t - logp_t,    s_t = clamp(exp(d_t) - d_t - 1, 0, 10)    (visual dependency)

(1) trajectory advantage shaping: n_i = min-max normalised mean_t s_t over the batch;
    A_i <- A_i * (beta_min + n_i * (1 - beta_min) / mean(n)),  beta_min = 0.9
    (means that span 1e-6 or less are not shaped, as in VPPO's code)
(2) token gradient filtering: only the top 40% tokens of each response by s_t keep their
    policy-gradient term; the loss denominator still counts every response token
    (advantages [N, T] with zeros, through the shared loss).

logp_t is the rollout's own log-prob (old_logp: the same weights, exact). Departures:
the min-max normalisation runs over the step's rollout batch (the paper: the
mini-batch), so that advantages exist before the batch is split, and over the responses
with at least one token (one without any has no mean s_t, and trains nothing); the mask draw is
seeded by the run's seed and the batch's first group id, so resuming reproduces it.
A batch without images gets plain GRPO-family advantages. `intervention: blur` replaces
the masking with a Gaussian blur of the whole image (an option of ours, for comparison).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mmrl.core.batch import RolloutBatch
from mmrl.core.grpo import GRPO
from mmrl.core.method import register_method
from mmrl.vlm.interventions import black_row, blur, mask_patches
from mmrl.vlm.policy import has_images


def visual_dependency(logp_aug: Tensor, logp: Tensor, mask: Tensor, cap: float = 10.0) -> Tensor:
    """[N, T]: s_t = clamp(exp(d) - d - 1, 0, cap), d = logp_aug - logp; 0 off the mask."""
    d = (logp_aug - logp).masked_fill(~mask, 0.0)
    return (d.exp() - d - 1).clamp(0.0, cap).masked_fill(~mask, 0.0)


def shape_advantages(adv: Tensor, s: Tensor, mask: Tensor, *, beta_min: float = 0.9,
                     top_frac: float = 0.4, eps: float = 1e-8, range_min: float = 1e-6) -> Tensor:
    """[N] advantages and [N, T] dependencies -> [N, T]: trajectory shaping, then the
    top-`top_frac` token filter of each response. Mean dependencies that span no more than
    `range_min` leave every scale at 1."""
    lengths = mask.sum(-1)
    mean_s = (s * mask).sum(-1) / lengths.clamp(min=1)  # [N]
    # a response without tokens has no mean dependency: its 0 would stretch the min-max range of
    # the others (and it trains nothing whatever its scale), so only responses with tokens count
    has = lengths > 0
    scale = torch.ones_like(mean_s)
    if bool(has.any()):
        lo, hi = mean_s[has].min(), mean_s[has].max()
        # a spread of rounding noise is no signal: min-max would stretch it to [0, 1] and scale one
        # response up to 1 + (N - 1)(1 - beta_min); VPPO's code leaves a range <= 1e-6 unscaled
        if float(hi - lo) > range_min:
            n = (mean_s[has] - lo) / (hi - lo)
            scale[has] = beta_min + n * (1 - beta_min) / (n.mean() + eps)
    keep = torch.zeros_like(mask)
    for i in range(len(adv)):
        k = math.ceil(top_frac * int(lengths[i]))
        if k:
            ranked = s[i].masked_fill(~mask[i], float("-inf"))
            keep[i, ranked.topk(k).indices] = True
    return (adv.to(scale) * scale)[:, None] * keep


@register_method("vppo")
class VPPO(GRPO):
    def annotate(self, policy, batch: RolloutBatch) -> None:
        logp_aug = self.intervened_logp(policy, batch)
        if logp_aug is not None:
            batch.data["visual_dependency"] = visual_dependency(logp_aug, batch.old_logp, batch.mask, self.cfg.cap)

    def intervened_logp(self, policy, batch: RolloutBatch) -> Tensor | None:
        """[N, T] log-probs of the batch's responses re-scored with the image intervened:
        random patches blacked out, or blurred (None for a batch without images)."""
        if not has_images(batch.data):
            return None
        pixels, grid = batch.data["pixel_values"], batch.data["image_grid_thw"]
        ip = policy.processor.image_processor
        if self.cfg.intervention == "blur":
            return policy.rescore(batch, blur(pixels, grid, merge=ip.merge_size, patch=ip.patch_size,
                                              sigma=self.cfg.blur_sigma))
        gen = torch.Generator().manual_seed(self.run.seed * 1_000_003 + int(batch.group_ids.min()))
        masked = mask_patches(pixels, grid, p=self.cfg.mask_p, fill=black_row(ip, pixels.shape[-1]), generator=gen)
        return policy.rescore(batch, masked)

    def advantages(self, batch: RolloutBatch) -> Tensor:  # [N, T]
        adv = super().advantages(batch)
        s = batch.data.get("visual_dependency")
        if s is None:
            return adv
        return shape_advantages(adv, s, batch.mask, beta_min=self.cfg.beta_min, top_frac=self.cfg.top_frac)

    def batch_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        s = batch.data.get("visual_dependency")
        if s is None:
            return {}
        return {"vppo/visual_dependency": float((s * batch.mask).sum() / batch.mask.sum().clamp(min=1))}
