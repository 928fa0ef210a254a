"""CAST, Causal Advantage-Structured Training (METHODS.md section 4) -- part 1.

RECONSTRUCTION: no paper text or code was available. What is here follows the method's
summary in METHODS.md section 4; every choice below that the summary leaves open is ours,
and where it matters it is a config option (diffusion_rl.config.CASTConfig).

What CAST changes against Flow-GRPO (diffusion_rl/methods/flow_grpo.py):

    advantage   per reward atom k (the columns of batch.scores: shapes-geneval's exist, colour,
                count, relation and all, already causally gated -- a child whose parent failed
                scores 0 -- plus any image atoms) a signed group advantage
                    A_ik = (r_ik - mean_group_k) / (std_group_k + std_eps)      [N, K]
                (exactly 0 in a group whose column is constant), combined per sample as
                    A_i = sum_k w_k A_ik                                         [N]
                with the reward's atom weights w_k, clipped to +-adv_clip. A_ik is kept in
                batch.data["cast/atom_advantages"] for the pixel projection (part 2).
    window      the SDE window comes from the model's own trajectory (diffusion_rl.calibrate:
                the median step at which the detector's atom verdicts on x0_hat commit), stored
                in a window.json by `diffusion-rl calibrate-window` and read at build time
                (method.window_from; diffusion_rl.calibrate.apply_window_file).
    loss        Flow-GRPO's clipped ratio loss per trained step, unchanged (for now).

Not implemented yet (CAST part 2): the projection of A_ik to pixels through the text-to-image
attention maps of each atom's tokens, and the spatially weighted per-patch ratio objective.

Departures / open choices: the group std is the unbiased one (as Flow-GRPO's and GRPO's); the
atoms are the reward's atom TYPES (a type's score is the mean over the prompt's atoms of that
type), not one column per scene-graph node, since that is what the batch carries; the sum over
atoms is not normalised by the number of atoms, so adv_clip binds more often than in Flow-GRPO.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from diffusion_rl.methods.flow_grpo import FlowGRPO
from mmrl.core.advantages import atom_advantages
from mmrl.core.batch import RolloutBatch
from mmrl.core.method import register_method

ATOM_ADVANTAGES = "cast/atom_advantages"


@dataclass
class CASTAdvantages:
    atom: Tensor  # [N, K] signed per-atom group advantages A_ik
    total: Tensor  # [N]    A_i = sum_k w_k A_ik, clipped to +-clip


def cast_advantages(scores: Tensor, group_ids: Tensor, weights: Tensor, *, eps: float = 1e-4,
                    clip: float | None = None) -> CASTAdvantages:
    """Per-atom signed group advantages and their weighted sum, a pure tensor function.

    scores [N, K] atom scores (already gated), group_ids [N], weights [K]. A column that is
    constant within a group (a gated child at 0 for every sample, a vacuous atom at 1, a group
    of one) gives exactly 0 there."""
    atom = atom_advantages(scores.float(), group_ids, scale="group", eps=eps)  # [N, K]
    w = torch.as_tensor(weights, dtype=atom.dtype, device=atom.device)
    if w.shape != (atom.shape[1],):
        raise ValueError(f"weights must have shape [{atom.shape[1]}] (one per atom); got {tuple(w.shape)}")
    total = atom @ w  # [N]
    if clip is not None:
        total = total.clamp(-clip, clip)
    return CASTAdvantages(atom=atom, total=total)


@register_method("cast")
class CAST(FlowGRPO):
    """Flow-GRPO with CAST's per-atom advantages (the window is set at build time)."""

    def advantages(self, batch: RolloutBatch) -> Tensor:  # [N]
        if batch.scores is None:
            raise ValueError("CAST needs the per-atom scores of the batch (batch.scores is None)")
        out = cast_advantages(batch.scores.values, batch.group_ids, self.reward.weights,
                              eps=self.cfg.std_eps, clip=self.cfg.adv_clip)
        batch.data[ATOM_ADVANTAGES] = out.atom
        return out.total

    def batch_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        """Per atom: the mean |A_ik| and the fraction of samples with a non-zero A_ik (how
        often that atom separates the samples of a group)."""
        atom = batch.data.get(ATOM_ADVANTAGES)
        if atom is None or batch.scores is None:
            return {}
        out = {}
        for k, name in enumerate(batch.scores.names):
            col = atom[:, k].float()
            out[f"cast/adv_abs/{name}"] = float(col.abs().mean())
            out[f"cast/adv_nonzero/{name}"] = float((col != 0).float().mean())
        return out
