"""DSPO, Diversity-Aware Subjective Policy Optimization (arXiv 2609.36775; docs/methods.md section 2).

Emotion reasoning with a trigger box, a reaction and K candidate emotions, then the choice
(the shapes-mood template, mmrl.vlm.tasks.shapes_mood). On GRPO (eps 0.2, KL beta 0.01):

CVIG, counterfactual visual information gain, one pair of teacher-forced passes per
response i and candidate e_k (no grad):
    p_ik    = P(e_k | V, q, t_i)      t_i = the response up to its answer tag
    p_ik_cf = P(e_k | V_cf, q, t_i)   V_cf: the image with the cited box blacked out
    dP_ik   = (p_ik - p_ik_cf) (1 - area_box / area_image)
    R_cf    = mean_k dP_ik,   w_ik = softmax_k(dP_ik / tau)
DEDR, distribution-aware diversity (mmrl.vlm.dedr) of the candidates' VAD vectors around
the item's prior, with the CVIG weights w_ik in place of the task atom's uniform 1/K.
Total reward R = 1.0 R_acc + 0.1 R_fmt + 0.1 R_cf + 0.3 R_div; A = groupZ(R).

Departures: the box intervention blacks out the box's patches in pixel space
(mmrl.vlm.interventions.mask_box: the vision tower sees black patches; the paper zeroes the
box's visual features); tau = 0.05 is ours (the paper's value is unknown to us). A response
not in the template (format atom 0: no valid box, not K candidates, ...) gets R_cf = R_div
= 0, never an error; a candidate outside the VAD lexicon gives R_div = 0, counted in
shapes_mood.MOOD_WARNINGS.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from mmrl.core.advantages import group_advantages
from mmrl.core.batch import RolloutBatch
from mmrl.core.config import ConfigError
from mmrl.core.grpo import GRPO
from mmrl.core.method import register_method
from mmrl.vlm.interventions import black_row, mask_box
from mmrl.vlm.tasks.shapes_mood import (
    MOOD_REASONS,
    MOOD_WARNINGS,
    box_area_fraction,
    box_fraction,
    diversity,
    format_problem,
    parse_mood,
)

ANSWER_TAG = "<answer>"


@torch.no_grad()
def emotion_probs(policy, prompts, prefixes: list[str], words: list[str], boxes: list, *,
                  chunk: int = 64) -> tuple[Tensor, Tensor]:
    """Teacher-forced P(word | image, prompt, prefix) under the image and with `boxes`
    (x0, y0, x1, y1 fractions) blacked out: two [M] tensors for M (prompt, prefix, word, box) rows."""
    merge = policy.processor.image_processor.merge_size
    p, p_cf = [], []
    for s in range(0, len(words), chunk):
        rows = range(s, min(s + chunk, len(words)))
        texts = [prefixes[r] + words[r] for r in rows]
        tb = policy.teacher_batch([prompts[r] for r in rows], texts)
        pixels, grid = tb.data["pixel_values"], tb.data["image_grid_thw"]
        fill = black_row(policy.processor.image_processor, pixels.shape[-1])
        masked = torch.cat([mask_box(pixels[j: j + 1], grid[j: j + 1], boxes[r], merge=merge, fill=fill)
                            for j, r in enumerate(rows)])
        word_tok = _word_tokens(policy.tokenizer, [prefixes[r] for r in rows], texts, tb.mask)
        p.append((policy.logprobs(tb) * word_tok).sum(-1).exp())
        p_cf.append((policy.rescore(tb, masked) * word_tok).sum(-1).exp())
    return torch.cat(p), torch.cat(p_cf)


def _word_tokens(tokenizer, prefixes: list[str], texts: list[str], mask: Tensor) -> Tensor:
    """[M, T] bool: the tokens of each text that reach past its prefix (the word's tokens; a
    token that merges the prefix's last character with the word counts, the same under both images)."""
    out = torch.zeros(mask.shape, dtype=torch.bool)  # filled element by element on the CPU, then moved
    for j, (pre, text) in enumerate(zip(prefixes, texts)):
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        for t, (_, end) in enumerate(offsets):
            out[j, t] = end > len(pre)
    return out.to(mask.device) & mask


@register_method("dspo")
class DSPO(GRPO):
    _step = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._warned = MOOD_WARNINGS.copy()

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        # The trainer sets it as each step begins: count MOOD_WARNINGS from here, so the held-out
        # evaluations before it (scored by the same task) stay out of the step's warnings, and a
        # resumed run, which skips the evaluation at its checkpoint, logs what an uninterrupted one does.
        self._step = value
        self._warned = MOOD_WARNINGS.copy()

    def annotate(self, policy, batch: RolloutBatch) -> None:
        """R_cf and the CVIG-weighted R_div of every response in the template (0 elsewhere)."""
        n = len(batch)
        # R_div in float64 until checked: a value past float32's range would fail to be stored
        r_cf, r_div, scored = torch.zeros(n), torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.bool)
        rows, prompts, prefixes, words, boxes = [], [], [], [], []
        responses = [parse_mood(s.completion) for s in batch.samples]
        for i, (sample, resp) in enumerate(zip(batch.samples, responses)):
            if format_problem(sample.completion) is not None:
                continue  # no box or candidates to score: the format atom already says so
            scored[i] = True
            # tags are read case-insensitively (format_problem): "<ANSWER>" ends the prefix too; re's
            # case folding, as "İ".lower() is two characters and would shift a cut found in .lower()
            cut = [*re.finditer(re.escape(ANSWER_TAG), sample.completion, re.IGNORECASE)][-1].end()
            for word in resp.candidates:
                rows.append(i)
                prompts.append(batch.prompts[int(batch.group_ids[i])])
                prefixes.append(sample.completion[:cut])
                words.append(word)
                boxes.append(box_fraction(resp.box))
        if rows:
            p, p_cf = emotion_probs(policy, prompts, prefixes, words, boxes)
            p, p_cf = p.cpu(), p_cf.cpu()  # rewards: on the CPU, with the task's scores they add to
            idx = torch.tensor(rows)
            for i in torch.unique(idx).tolist():
                dp = (p[idx == i] - p_cf[idx == i]) * (1 - box_area_fraction(responses[i].box))
                r_cf[i] = dp.mean()
                # shifted before dividing: dp / tau overflows to inf at a tiny tau, and softmax([inf, ..])
                # is NaN; shifted, tau -> 0 is the argmax, the limit of the softmax
                w = torch.softmax((dp - dp.max()) / self.cfg.tau, 0).tolist()
                r_div[i] = diversity(responses[i], batch.samples[i].meta, w=w, tau_ctr=self.cfg.tau_ctr,
                                     tau_div=self.cfg.tau_div)
        # float32 rewards: an inf or NaN R_div, or one whose squared deviations (at most (2 |R_div|)^2 each)
        # overflow in the group's std, would make the advantages NaN
        if not bool(4 * r_div.square().sum() <= torch.finfo(torch.float32).max):  # NaN fails it too
            i = int(r_div.abs().nan_to_num(nan=float("inf")).argmax())
            raise ConfigError(
                f"method.tau_div {self.cfg.tau_div} (with tau_ctr {self.cfg.tau_ctr}) makes R_div {float(r_div[i])} "
                f"for response {i}: a candidate whose removal would bring the set's mean closer to the prior, "
                f"by |Delta|, adds 1 - exp(|Delta| / tau_div), which overflows when tau_div is small; raise tau_div "
                f"(DSPO's default is {type(self.cfg).model_fields['tau_div'].default})")
        batch.data.update({"dspo/r_cf": r_cf, "dspo/r_div": r_div.float(), "dspo/scored": scored})

    def rewards(self, batch: RolloutBatch) -> Tensor:
        """[N] R = the task's atoms (a uniform-weight "diversity" atom, if the task has one,
        is replaced) + div_weight R_div + cf_weight R_cf."""
        total = batch.rewards
        if "dspo/r_cf" not in batch.data:
            return total
        names = batch.scores.names
        if "diversity" in names:
            k = names.index("diversity")
            total = total - self.reward.atoms[k].weight * batch.scores.values[:, k]
        return total + self.cfg.div_weight * batch.data["dspo/r_div"] + self.cfg.cf_weight * batch.data["dspo/r_cf"]

    def advantages(self, batch: RolloutBatch) -> Tensor:  # [N]
        adv = self.cfg.advantage
        return group_advantages(self.rewards(batch), batch.group_ids, scale=adv.scale, eps=adv.eps)

    def batch_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        if "dspo/r_cf" not in batch.data:
            return {}
        scored = batch.data["dspo/scored"]
        new = MOOD_WARNINGS - self._warned  # the task's bad-output counts since the last step
        self._warned = MOOD_WARNINGS.copy()
        out = {"dspo/cvig_scored": float(scored.float().mean()),
               # every reason, not those seen so far in this process: a resumed run logs the same columns
               **{f"dspo/warnings/{k}": float(new.get(k, 0)) for k in MOOD_REASONS}}
        if bool(scored.any()):
            out["dspo/r_cf"] = float(batch.data["dspo/r_cf"][scored].mean())
            out["dspo/r_div"] = float(batch.data["dspo/r_div"][scored].mean())
        return out
