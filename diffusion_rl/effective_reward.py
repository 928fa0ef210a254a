"""FTFC's learned effective reward g_phi(x, c) (docs/methods.md section 4) -- a RECONSTRUCTION.

The method fits an effective reward g_phi(x, c) (and lambda(c) per prompt) by minimising that
dual on samples of the pretrained model, and freezes the weights w = (f*)'(g_phi). The paper's
network and fitting recipe are unknown; ours:

    network   g_phi(x, c) = MLP([flatten(x1), prompt features of c]) -> a scalar, on the pool's
              clean latents x1 and the model's prompt conditioning (each float conditioning
              tensor averaged over its tokens; position ids and masks left out). Inputs are
              standardised on the pool. The last layer starts at zero: g = 0 is the uniform
              weighting (no tilt), and fitting moves away from it.
    lambda(c) solved per prompt on g (diffusion_rl.ftfc.solve_lambda), as for observed rewards.
    fit       full-batch AdamW on -J(g_phi), J of diffusion_rl.ftfc.primal_value: the primal value
              of the weights g implies, which equals the Fenchel dual's minimum at g = r and is
              below it elsewhere. Unconstrained, the fit would reproduce the observed rewards (up
              to a constant per prompt, which lambda absorbs); the network's capacity, its
              weight decay and the number of steps are what make it an effective reward: a
              smooth function of (x, c) shared across the pool's prompts.
    reported  J(r) - J(g) (the gap left), J(r) - J(0) (the gap of no tilt), and the correlation
              of g with r within prompts.

Deterministic: the network's initial weights come from a seed the caller gives (FTFC: the
run's seed and the pool's step), so a resumed run refits the same g from the restored pool.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from diffusion_rl.ftfc import primal_value
from mmrl.core.advantages import group_stats


def prompt_features(cond: dict[str, Tensor]) -> Tensor:
    """[N, D]: each float conditioning tensor reduced to one row per sample ([N, S, D] -> the mean
    over its S tokens, under `<name>_mask` where there is one), concatenated in name order.
    Names ending in "ids" (positions) or "mask" are not features. A ValueError where a
    `<name>_mask` is not [N, S] of its [N, S, D] tensor."""
    parts = []
    for name in sorted(cond):
        v = cond[name]
        if name.endswith(("ids", "mask")) or not v.is_floating_point():
            continue
        if v.dim() == 3:
            mask = cond.get(f"{name}_mask")
            if mask is None:
                v = v.mean(1)
            else:  # a mask of another [N, S] is a model's bug: a plain mean would hide it
                if mask.shape != v.shape[:2]:
                    raise ValueError(f"prompt conditioning {name}_mask has shape {tuple(mask.shape)}, but {name} "
                                     f"{tuple(v.shape)} needs one of {tuple(v.shape[:2])} (its [N, S])")
                m = mask.to(v).unsqueeze(-1)
                v = (v * m).sum(1) / m.sum(1).clamp_min(1)
        parts.append(v.reshape(len(v), -1).float())
    if not parts:
        raise ValueError(f"a learned effective reward needs a float prompt conditioning; got only {sorted(cond)}")
    return torch.cat(parts, 1)


class EffectiveReward(nn.Module):
    """g_phi(x, c): a two-hidden-layer MLP on the standardised [flatten(x1), prompt features]."""

    def __init__(self, in_features: int, hidden: int):
        super().__init__()
        self.register_buffer("shift", torch.zeros(in_features))
        self.register_buffer("scale", torch.ones(in_features))
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
                                 nn.Linear(hidden, 1))
        nn.init.zeros_(self.net[-1].weight)  # g = 0 at the start: uniform weights, no tilt
        nn.init.zeros_(self.net[-1].bias)

    def standardise_on(self, features: Tensor) -> None:
        self.shift.copy_(features.mean(0))
        self.scale.copy_(features.std(0).nan_to_num(1.0).clamp_min(1e-6))

    def forward(self, features: Tensor) -> Tensor:  # [N, F] -> [N]
        return self.net((features - self.shift) / self.scale).squeeze(-1)


@dataclass
class EffectiveRewardFit:
    g: Tensor  # [N] float32, the fitted effective reward of each pool sample
    gap: float  # J(r) - J(g), mean over prompts: what the fit leaves of the observed tilt's value
    gap_uniform: float  # J(r) - J(0): the same for uniform weights (no tilt)
    corr: float  # Pearson correlation of g and r, each centred within its prompt
    seconds: float
    net: EffectiveReward  # the fitted g_phi: net(sample_features(x1, cond)) scores samples it was not fitted on
    heldout: dict[str, float] = field(default_factory=dict)  # heldout_metrics', when asked for

    def metrics(self) -> dict[str, float]:
        recovered = 1.0 - self.gap / self.gap_uniform if self.gap_uniform > 0 else 1.0
        return {**self.heldout, "ftfc/g_gap": self.gap, "ftfc/g_gap_uniform": self.gap_uniform,
                "ftfc/g_recovered": recovered, "ftfc/g_corr": self.corr, "ftfc/g_fit_s": self.seconds}


def fit_effective_reward(x1: Tensor, cond: dict[str, Tensor], rewards: Tensor, group_ids: Tensor, *, beta: float,
                         divergence: str, hidden: int, steps: int, lr: float, weight_decay: float,
                         seed: int) -> EffectiveRewardFit:
    """Fit g_phi on one pool (x1 [N, ...] clean latents, cond the model's conditioning rows,
    rewards [N], group_ids [N]) by maximising J (module docstring); returns g on the pool."""
    start = time.perf_counter()
    features = sample_features(x1, cond)
    r, group_ids = rewards.detach().to(features.device).double(), group_ids.to(features.device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = EffectiveReward(features.shape[1], hidden).to(features.device)
    net.standardise_on(features)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    with torch.enable_grad():
        for _ in range(steps):
            opt.zero_grad()
            loss = -primal_value(net(features), r, group_ids, beta, divergence, max_iter=30)
            loss.backward()
            opt.step()
    with torch.no_grad():
        g = net(features).double()
    gap, gap_uniform = value_gaps(g, r, group_ids, beta, divergence)
    return EffectiveRewardFit(g.float(), gap, gap_uniform, within_group_corr(g, r, group_ids),
                              time.perf_counter() - start, net.eval())


def value_gaps(g: Tensor, r: Tensor, group_ids: Tensor, beta: float, divergence: str) -> tuple[float, float]:
    """(J(r) - J(g), J(r) - J(0)): what g's tilt leaves of the observed tilt's value, and what
    uniform weights leave."""
    with torch.no_grad():
        best = float(primal_value(r, r, group_ids, beta, divergence))
        return (best - float(primal_value(g, r, group_ids, beta, divergence)),
                best - float(primal_value(torch.zeros_like(r), r, group_ids, beta, divergence)))


def sample_features(x1: Tensor, cond: dict[str, Tensor]) -> Tensor:
    """[N, F]: g_phi's input, the flattened clean latents beside the prompt features."""
    return torch.cat([x1.reshape(len(x1), -1).float(), prompt_features(cond).to(x1.device)], 1).detach()


def within_group_corr(g: Tensor, r: Tensor, group_ids: Tensor) -> float:
    """Pearson correlation of g and r, each centred on its group's mean."""
    a, b = (v.double() - group_stats(v.double(), group_ids)[0] for v in (g, r))
    denom = float(a.norm() * b.norm())
    return float((a * b).sum()) / denom if denom > 0 else 0.0


def heldout_metrics(x1: Tensor, cond: dict[str, Tensor], rewards: Tensor, group_ids: Tensor, fraction: float,
                    **fit: float | str) -> dict[str, float]:
    """Does g_phi generalise? Fit it (the same settings, `fit`) on the pool's prompts less a
    fraction held out (a seeded choice, at least one prompt on each side), predict the held-out
    samples, and score the prediction as the fit is scored: ftfc/g_heldout_recovered =
    1 - (J(r) - J(g)) / (J(r) - J(0)) on the held-out prompts (1: their observed tilt, 0: no
    better than uniform weights, < 0: worse) and ftfc/g_heldout_corr."""
    groups = group_ids.unique()
    if len(groups) < 2:
        raise ValueError("a held-out check of g_phi needs a pool of at least two prompts")
    gen = torch.Generator().manual_seed(int(fit["seed"]))
    k = min(max(1, round(fraction * len(groups))), len(groups) - 1)
    held = groups[torch.randperm(len(groups), generator=gen)[:k].to(groups.device)]
    out = torch.isin(group_ids, held)
    sub = {n: v[~out] for n, v in cond.items()}
    f = fit_effective_reward(x1[~out], sub, rewards[~out], group_ids[~out], **fit)
    with torch.no_grad():
        g = f.net(sample_features(x1[out], {n: v[out] for n, v in cond.items()})).double()
    r, ids = rewards[out].to(g).double(), group_ids[out].to(g.device)
    gap, gap_uniform = value_gaps(g, r, ids, float(fit["beta"]), str(fit["divergence"]))
    return {"ftfc/g_heldout_recovered": 1.0 - gap / gap_uniform if gap_uniform > 0 else 1.0,
            "ftfc/g_heldout_corr": within_group_corr(g, r, ids), "ftfc/g_heldout_prompts": float(k)}
