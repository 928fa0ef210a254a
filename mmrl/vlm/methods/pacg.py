"""PACG, Persistence-Aware Credit Gating (arXiv 2609.36572) -- RECONSTRUCTION from the
abstract (docs/methods.md section 2), on DAPO or on VPPO (`base`).

The paper's finding: under DAPO and VPPO, sensitivity to the image rises, but unsupported
visual claims become more persistent, i.e. they survive an image intervention. PACG
attenuates positive credit only for unusually persistent claims, without labels:

    l_t, l'_t     the rollout's log-probs (old_logp) and the same tokens re-scored with the
                  image intervened (VPPO's random patch masking, p = mask_p: one pass,
                  shared with VPPO's visual dependency when base = vppo)
    claims c      segments of the reasoning naming image content (mmrl.vlm.claims)
    persistence   P(c) = mean_{t in c} min(1, exp(l'_t - l_t))
    z_c           (P(c) - mean) / std over every claim of the step's batch (unbiased std)
    gate          where A_{i,t} > 0 and z_c > z0: A_{i,t in c} <- A_{i,t} * max(g_min, 1 - eta (z_c - z0))
Negative advantages and tokens outside claims are never touched.

Reconstruction choices (each a config option, PACGConfig): the claim rule (segments split
at punctuation that name a word of `claim_words` or a digit), the intervention (VPPO's),
eta = 0.5 (the abstract gives no value), the z-scores over the step's rollout batch, and
no gate at all when the batch has fewer than two claims or they all persist equally.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmrl.core.batch import RolloutBatch
from mmrl.core.method import register_method
from mmrl.vlm.claims import (
    CLAIM_WORDS,
    batch_claims,
    claim_persistence,
    claim_spans,
    shapes_claim_holds,
)
from mmrl.vlm.interventions import black_row, mask_patches
from mmrl.vlm.methods.vppo import VPPO, shape_advantages, visual_dependency

__all__ = ["PACG", "claim_report", "pacg_gate"]


def pacg_gate(adv: Tensor, persistence: Tensor, index: Tensor, claim_ids: Tensor, *, z0: float, eta: float,
              g_min: float) -> tuple[Tensor, Tensor]:
    """adv [N, T]; persistence [C] with its (sample, claim) index [C, 2]; claim_ids [N, T].
    Returns the gated advantages [N, T] and the gates [C] (1 where a claim is not gated)."""
    gates = torch.ones_like(persistence)
    # all equal (max == min, as the group advantages test it): no outlier to gate; std == 0 would
    # miss it where the mean's rounding leaves a std of 1e-8 and z-scores of +-0.9 for every claim
    if persistence.numel() < 2 or bool(persistence.max() == persistence.min()):
        return adv, gates
    z = (persistence - persistence.mean()) / persistence.std()
    gates = torch.where(z > z0, (1 - eta * (z - z0)).clamp(min=g_min), gates)
    out = adv.clone()
    for (i, c), g in zip(index.tolist(), gates.tolist()):
        if g < 1.0:
            at = (claim_ids[i] == c) & (adv[i] > 0)
            out[i, at] = adv[i, at] * g
    return out, gates


@register_method("pacg")
class PACG(VPPO):
    def annotate(self, policy, batch: RolloutBatch) -> None:
        logp_aug = self.intervened_logp(policy, batch)
        if logp_aug is None:
            return
        batch.data["logp_intervened"] = logp_aug
        if self.cfg.base == "vppo":
            batch.data["visual_dependency"] = visual_dependency(logp_aug, batch.old_logp, batch.mask, self.cfg.cap)
        words = self.cfg.claim_words or CLAIM_WORDS
        spans = [claim_spans(s.completion, words, self.cfg.answer_tag) for s in batch.samples]
        batch.data["claim_ids"] = batch_claims(policy.tokenizer, batch.data["completion_ids"], batch.mask, spans)

    def advantages(self, batch: RolloutBatch) -> Tensor:  # [N, T]
        # the GRPO family's [N], from the config (the rewards' device: the CPU), to the tokens' device
        adv = super(VPPO, self).advantages(batch).to(batch.mask.device)
        self._last = None  # this batch's claims only: one without images must not report the last one's
        s = batch.data.get("visual_dependency")
        if s is not None:
            adv = shape_advantages(adv, s, batch.mask, beta_min=self.cfg.beta_min, top_frac=self.cfg.top_frac)
        else:
            adv = adv[:, None].expand_as(batch.mask).clone()
        if "claim_ids" not in batch.data:
            return adv
        persistence, index = claim_persistence(batch.old_logp, batch.data["logp_intervened"], batch.data["claim_ids"])
        adv, gates = pacg_gate(adv, persistence, index, batch.data["claim_ids"],
                               z0=self.cfg.z0, eta=self.cfg.eta, g_min=self.cfg.g_min)
        self._last = (persistence, gates)
        return adv

    def batch_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        out = super().batch_metrics(batch) if self.cfg.base == "vppo" else {}
        last = getattr(self, "_last", None)
        if last is not None and last[0].numel():
            persistence, gates = last
            out.update({"pacg/claims": float(persistence.numel()) / len(batch),
                        "pacg/persistence": float(persistence.mean()),
                        "pacg/gated": float((gates < 1).float().mean()),
                        "pacg/gate_mean": float(gates.mean())})
        return out


@torch.no_grad()
def claim_report(policy, items, *, max_new_tokens: int, mask_p: float = 0.5, seed: int = 0,
                 words=CLAIM_WORDS, batch_size: int = 32, stop: list[str] | None = None) -> dict[str, float]:
    """How persistent a policy's greedy claims are under VPPO's patch masking, split by
    whether they hold in the scene (items with meta["scene"]; claims naming no checkable
    object are left out of the split): the issue's measure of unsupported claims.
    Returns persistence_false / persistence_true (means), claims_false / claims_true
    (counts), false_claim_rate and claims_per_response (all claims, checkable or not).
    `stop`: the rollouts' stop strings (task.stop), so the claims read are the ones training sees."""
    gen = torch.Generator().manual_seed(seed)
    found: dict[bool, list[float]] = {True: [], False: []}
    texts = policy.greedy(items, max_new_tokens, batch_size, stop)
    for start in range(0, len(items), batch_size):
        chunk, done = items[start: start + batch_size], texts[start: start + batch_size]
        batch = policy.teacher_batch(chunk, done)
        logp = policy.logprobs(batch)
        fill = black_row(policy.processor.image_processor, batch.data["pixel_values"].shape[-1])
        masked = mask_patches(batch.data["pixel_values"], batch.data["image_grid_thw"], p=mask_p, fill=fill,
                              generator=gen)
        spans = [claim_spans(t, words) for t in done]
        claim_ids = batch_claims(policy.tokenizer, batch.data["completion_ids"], batch.mask, spans)
        persistence, index = claim_persistence(logp, policy.rescore(batch, masked), claim_ids)
        for p, (i, c) in zip(persistence.tolist(), index.tolist()):
            s, e = spans[i][c]
            holds = shapes_claim_holds(done[i][s:e], chunk[i].meta["scene"])
            if holds is not None:
                found[holds].append(p)
    n_true, n_false = len(found[True]), len(found[False])
    n_claims = sum(len(claim_spans(t, words)) for t in texts)
    return {"persistence_false": _mean(found[False]), "persistence_true": _mean(found[True]),
            "claims_false": float(n_false), "claims_true": float(n_true),
            "false_claim_rate": n_false / max(1, n_true + n_false), "claims_per_response": n_claims / len(items)}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")
