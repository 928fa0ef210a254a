"""DEDR: the diversity reward of DSPO (Diversity-Aware Subjective Policy Optimization, arXiv 2609.36775).

The K candidate emotions of a response, placed in VAD space (z_k = VAD(e_k)), are compared
with the image's prior N(mu*, diag sigma*^2):

    D(m)     = sqrt(sum_d ((m_d - mu*_d) / sigma*_d)^2)       Mahalanobis, diagonal covariance
    D_all    = D(mean_k z_k)                                  how far the whole set is centred
    D_-k     = D(mean_{j != k} z_j)                           the same without candidate k
    Delta_k  = D_-k - D_all                                   how much candidate k centres the set
    R_div    = exp(-D_all^2 / (2 tau_ctr^2)) * sum_k w_k (1 - exp(-Delta_k / tau_div))

The first factor rewards a set whose mean sits on the prior; the sum rewards sets in which
every candidate is needed to stay there (a collapsed set, K copies of one emotion, gets
Delta_k = 0 and R_div = 0). As written the formula is not bounded below: a candidate whose
removal brings the mean closer (Delta_k < 0) contributes 1 - exp(|Delta_k| / tau_div) < 0.
We keep that, and R_div < 1 always: each term is below 1 and the weights are non-negative and sum
to at most 1 (CVIG's softmax and the task's uniform 1/K; `dedr` refuses others).

Departures / our choices: tau_ctr = 1.0 and tau_div = 0.5 are our defaults (the paper's
values are unknown to us); K = 1 gives 0 (no leave-one-out set exists).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["TAU_CTR", "TAU_DIV", "dedr", "mahalanobis"]

TAU_CTR = 1.0  # our choice
TAU_DIV = 0.5  # our choice


def mahalanobis(m: Tensor, mu: Tensor, sigma: Tensor) -> Tensor:
    """sqrt(sum(((m - mu) / sigma)^2)) over the last dim. m [..., 3], mu [3], sigma [3] -> [...]."""
    return ((m - mu) / sigma).pow(2).sum(-1).sqrt()


def dedr(z, mu, sigma, w, tau_ctr: float = TAU_CTR, tau_div: float = TAU_DIV) -> float:
    """R_div of K candidates (see the module docstring).

    z [K, 3] candidate VADs; mu [3], sigma [3] (> 0) the prior; w [K] candidate weights
    (uniform 1/K in the task reward, softmax_k(dP_ik / tau) from CVIG in DSPO; w >= 0, sum <= 1).
    Computed in float64; returns a Python float."""
    z, mu, sigma, w = (torch.as_tensor(x, dtype=torch.float64) for x in (z, mu, sigma, w))
    if z.ndim != 2 or z.shape[0] == 0 or z.shape[1] != mu.numel() or mu.shape != sigma.shape:
        raise ValueError(f"dedr needs z [K>=1, D], mu [D], sigma [D]; got z {tuple(z.shape)}, "
                         f"mu {tuple(mu.shape)}, sigma {tuple(sigma.shape)}")
    k = z.shape[0]
    if w.shape != (k,):
        raise ValueError(f"dedr needs one weight per candidate: w {tuple(w.shape)} for K={k}")
    if bool((w < 0).any()) or float(w.sum()) > 1 + 1e-6:  # what keeps R_div < 1; float32 softmax sums to 1 +- 1e-7
        raise ValueError(f"dedr needs candidate weights w >= 0 summing to at most 1, got {w.tolist()}")
    if not bool((sigma > 0).all()):
        raise ValueError(f"dedr needs sigma > 0 in every dimension, got {sigma.tolist()}")
    if tau_ctr <= 0 or tau_div <= 0:
        raise ValueError(f"tau_ctr and tau_div must be > 0, got {tau_ctr}, {tau_div}")
    if k == 1:
        return 0.0  # no leave-one-out mean
    d_all = mahalanobis(z.mean(0), mu, sigma)  # []
    loo = (z.sum(0, keepdim=True) - z) / (k - 1)  # [K, 3]: mean without candidate k
    delta = mahalanobis(loo, mu, sigma) - d_all  # [K]
    centred = torch.exp(-d_all**2 / (2 * tau_ctr**2))
    return float(centred * (w * (1 - torch.exp(-delta / tau_div))).sum())
