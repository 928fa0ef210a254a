"""CORA, Consistency-Oriented Reasoning Alignment (arXiv 2606.14691) -- partly RECONSTRUCTION
(docs/methods.md section 2).

The reasoning trace often fails to support, or contradicts, the final answer, and GRPO
does not fix it. A consistency reward model, an NLI classifier with premise = question +
reasoning and hypothesis = "The final answer is {a}.", gives r_cons = lambda * P(consistent)
(mmrl.vlm.consistency; the bundled model is a tiny ModernBERT trained by
scripts/train_consistency_model.py, the paper's is ModernBERT-large). HRAS, Hybrid Reward
Advantage Splitting, normalises the task and consistency streams in their groups, then sums:

    A = alpha * groupZ(r_task) + beta_t * groupZ(r_cons),   beta_t = beta * min(1, step / warmup_steps)

r_task is the weighted sum of the task's own atoms (accuracy and format); groupZ is the
GRPO z-score, so A_cons = 0 in a group whose consistency scores are all equal.

Reconstruction choices (CORAConfig): alpha = 1, beta = 0.2 with a linear warm-up (the
abstract gives "beta warmed up"; the values are ours), and the consistency atom gated by
the task's format atom (a response without an answer has nothing to be consistent with).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmrl.core.advantages import group_advantages
from mmrl.core.batch import RolloutBatch
from mmrl.core.grpo import GRPO
from mmrl.core.method import register_method

CONSISTENCY = "consistency"  # the consistency atom's name in the run's reward


def hras_advantages(task: Tensor, cons: Tensor, group_ids: Tensor, *, alpha: float, beta: float,
                    eps: float = 1e-6) -> Tensor:
    """[N]: alpha * groupZ(task) + beta * groupZ(cons)."""
    return (alpha * group_advantages(task, group_ids, scale="group", eps=eps)
            + beta * group_advantages(cons, group_ids, scale="group", eps=eps))


@register_method("cora")
class CORA(GRPO):
    def beta_now(self) -> float:
        """beta_t: linear warm-up from 0 over warmup_steps steps (step counts from 0)."""
        w = self.cfg.warmup_steps
        return self.cfg.beta * (min(1.0, self.step / w) if w else 1.0)

    def streams(self, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
        """(r_task, r_cons) [N]: the weighted task atoms and the weighted consistency atom."""
        names = batch.scores.names
        if CONSISTENCY not in names:
            raise ValueError(f"CORA needs the {CONSISTENCY!r} reward atom; the reward has {names}")
        weights = torch.tensor([a.weight for a in self.reward.atoms], dtype=torch.float32,
                               device=batch.scores.values.device)
        weighted = batch.scores.values * weights
        k = names.index(CONSISTENCY)
        return weighted.sum(-1) - weighted[:, k], weighted[:, k]

    def advantages(self, batch: RolloutBatch) -> Tensor:  # [N]
        task, cons = self.streams(batch)
        return hras_advantages(task, cons, batch.group_ids, alpha=self.cfg.alpha, beta=self.beta_now())

    def batch_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        return {"cora/beta": self.beta_now()}
