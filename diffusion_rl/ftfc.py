"""FTFC's tilt weights: the f-divergence-regularised optimum and its Fenchel dual (pure tensors).

RECONSTRUCTION: neither the FTFC paper's text nor its code was available; this follows
docs/methods.md section 4 and our own derivation. Target, for one prompt c with pretrained p0:

    max_p  E_p[r] - beta D_f(p || p0),      D_f(p || p0) = E_p0[f(w)],  w = dp / dp0 >= 0.

Pointwise stationarity of E_p0[w r - beta f(w) - lambda w] (lambda: the multiplier of
E_p0[w] = 1) gives w* = (f')^{-1}(u) = (f*)'(u) with u = (r - lambda) / beta, and the dual

    min_lambda  lambda + beta E_p0[f*((r - lambda) / beta)],

whose derivative 1 - E_p0[(f*)'(u)] vanishes exactly where E_p0[w] = 1. Generators (each
f(1) = 0, f convex, on w >= 0) and what follows from them:

    kl          f = w log w        f*(u) = exp(u - 1)               w = exp(u - 1)
                lambda = beta log mean exp(r / beta) - beta, so w = G softmax(r / beta) in the group
                (the "- beta" is the convention of this generator; w log w - w + 1 drops it)
    pearson     f = (w - 1)^2      f*(u) = u + u^2/4 (u >= -2), -1 (u < -2)
                w = max(0, 1 + u / 2)                  [the method's form; (w-1)^2/2 gives 1 + u]
    reverse_kl  f = -log w         f*(u) = -1 - log(-u) (u < 0), +inf otherwise
                w = -1 / u = beta / (lambda - r)       needs lambda > max r
    hellinger   f = (sqrt(w) - 1)^2   f*(u) = u / (1 - u) (u < 1), +inf otherwise
                w = (1 - u)^-2                         needs (r - lambda) / beta < 1

All four agree with the closed forms of docs/methods.md section 4. lambda is solved per group so that the sample
mean of w is 1 (the sample version of E_p0[w] = 1): in closed form for kl, by bisection on a
bracket that provably holds the root for the others (comments in `solve_lambda`).

The weights may come from an effective reward g in place of r: w = (f*)'((g - lambda) / beta),
lambda again solved on g. `primal_value` scores such weights on the observed rewards,
J(g) = mean_i [w_i r_i - beta f(w_i)] with mean w = 1: the objective the tilt maximises. By
Fenchel's equality f(w) = u w - f*(u) at w = (f*)'(u), J(r) equals the dual's minimum (no
duality gap), and J(g) <= J(r) for every g; so J is what a learned g_phi(x, c) is fitted by
(diffusion_rl.effective_reward), and J(r) - J(g) is how far its tilt is from the observed one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

DIVERGENCES = ("kl", "pearson", "reverse_kl", "hellinger")


def _check(divergence: str, beta: float) -> None:
    if divergence not in DIVERGENCES:
        raise ValueError(f"unknown divergence {divergence!r} (known: {', '.join(DIVERGENCES)})")
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0):
        raise ValueError(f"beta must be a finite number > 0 (the strength of the divergence penalty); got {beta!r}")


def generator(w: Tensor, divergence: str) -> Tensor:
    """f(w), elementwise, w >= 0."""
    _check(divergence, 1.0)
    if divergence == "kl":
        return torch.xlogy(w, w)
    if divergence == "pearson":
        return (w - 1) ** 2
    if divergence == "reverse_kl":
        return -torch.log(w)
    return (w.sqrt() - 1) ** 2


def conjugate(u: Tensor, divergence: str) -> Tensor:
    """f*(u) = sup_{w >= 0} (u w - f(w)), elementwise; +inf outside its domain."""
    _check(divergence, 1.0)
    inf = torch.full_like(u, math.inf)
    if divergence == "kl":
        return torch.exp(u - 1)
    if divergence == "pearson":
        return torch.where(u >= -2, u + u**2 / 4, -torch.ones_like(u))
    if divergence == "reverse_kl":
        return torch.where(u < 0, -1 - torch.log((-u).clamp(min=1e-300)), inf)
    return torch.where(u < 1, u / (1 - u).clamp(min=1e-300), inf)


def tilt_weights(r: Tensor, lam: Tensor | float, beta: float, divergence: str) -> Tensor:
    """w = (f*)'((r - lambda) / beta), elementwise. ValueError if some u leaves f*'s domain."""
    _check(divergence, beta)
    u = (r - lam) / beta
    if divergence == "kl":
        return torch.exp(u - 1)
    if divergence == "pearson":
        return (1 + u / 2).clamp(min=0)
    if divergence == "reverse_kl":
        if bool((u >= 0).any()):
            raise ValueError("reverse_kl weights beta / (lambda - r) need lambda > max r")
        return -1 / u
    if bool((u >= 1).any()):
        raise ValueError("hellinger weights (1 - (r - lambda) / beta)^-2 need (r - lambda) / beta < 1")
    return (1 - u) ** -2


def dual_objective(r: Tensor, lam: Tensor | float, beta: float, divergence: str) -> Tensor:
    """lambda + beta mean f*((r - lambda) / beta) over the samples r [G] of one prompt (+inf off
    the domain). Convex in lambda; its minimiser is `solve_lambda`'s root."""
    _check(divergence, beta)
    return lam + beta * conjugate((r - lam) / beta, divergence).mean()


def primal_value(g: Tensor, r: Tensor, group_ids: Tensor, beta: float, divergence: str,
                 *, max_iter: int = 200) -> Tensor:
    """mean over groups of J = mean_i [w_i r_i - beta f(w_i)], w = (f*)'((g - lambda) / beta)
    self-normalised to mean 1 in the group, lambda solved on g (held fixed: the normalisation
    carries the constraint to first order). Differentiable in g; J(r) is the dual's minimum."""
    _check(divergence, beta)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    values = []
    for k in range(int(inverse.max()) + 1):
        rows = inverse == k
        gk = g[rows].double()
        w = group_weights(gk, solve_lambda(gk.detach(), beta, divergence, max_iter=max_iter), beta, divergence)
        values.append((w * r[rows].double()).mean() - beta * generator(w, divergence).mean())
    return torch.stack(values).mean()


def group_weights(r: Tensor, lam: Tensor | float, beta: float, divergence: str) -> Tensor:
    """One group's weights w = (f*)'((r - lambda) / beta) [G], lambda its `solve_lambda`,
    self-normalised to mean 1 (which removes the solver's residual only). kl in its closed form
    G softmax(r / beta): exp((r - lambda) / beta - 1) multiplies lambda's rounding error by
    1 / beta, and at beta 1e-20 every weight underflowed to 0 and the group's came out NaN (0 / 0)."""
    if divergence == "kl":
        return len(r) * torch.softmax((r - r.max()) / beta, 0)
    w = tilt_weights(r, lam, beta, divergence)
    return w / w.mean()


def _mean_weight(r: Tensor, lam: float, beta: float, divergence: str) -> float:
    """mean w at lambda: decreasing in lambda; +inf where lambda is below the domain."""
    try:
        return float(tilt_weights(r, lam, beta, divergence).mean())
    except ValueError:
        return math.inf


def solve_lambda(r: Tensor, beta: float, divergence: str, *, max_iter: int = 200) -> Tensor:
    """The lambda of one group's rewards r [G] with mean_i w(r_i, lambda) = 1 (float64 scalar)."""
    _check(divergence, beta)
    r = r.double()
    if divergence == "kl":  # about max r: r / beta itself overflows at a tiny beta (lambda -> max r)
        top = r.max()
        return top + beta * (torch.logsumexp((r - top) / beta, 0) - math.log(len(r))) - beta
    mean, top = float(r.mean()), float(r.max())
    # Brackets [lo, hi] with mean w >= 1 at lo and <= 1 at hi. Jensen (each w convex in r) puts the
    # root at or above lo; at hi every single weight is <= 1.
    if divergence == "pearson":  # w = max(0, 1 + (r - lam) / 2beta) >= its linear part, mean 1 at lam = mean r
        lo, hi = mean, top
    elif divergence == "reverse_kl":  # 1/x convex: mean w >= beta / (lam - mean r); w <= 1 at lam = max r + beta
        # (or at the next float above max r, where beta is below half its ulp and max r + beta rounds to max r)
        lo, hi = max(top, mean + beta), max(top + beta, math.nextafter(top, math.inf))
    else:  # hellinger, x^-2 convex: mean w >= (1 - (mean r - lam)/beta)^-2; domain lam > max r - beta
        lo, hi = max(mean, top - beta), top
    for _ in range(max_iter):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if _mean_weight(r, mid, beta, divergence) > 1:
            lo = mid
        else:
            hi = mid
    return torch.tensor(hi, dtype=torch.float64, device=r.device)  # hi: inside the domain even when lo is its edge


def cap_weights(w: Tensor, cap: float) -> tuple[Tensor, int]:
    """Cap one group's weights w [G] (mean 1) at `cap` and renormalise to mean 1, to the fixed
    point of "clip, then rescale": capped samples get exactly `cap`, the others w * s with the
    one s that restores mean 1 (water-filling; cap >= 1 makes it feasible). When the uncapped
    samples weigh nothing the cap cannot hold and the group keeps its weights. Returns the
    weights and the number capped."""
    if cap < 1:
        raise ValueError(f"cap must be >= 1 (times the mean weight); got {cap}")
    g = len(w)
    capped = torch.zeros(g, dtype=torch.bool, device=w.device)
    for _ in range(g):
        mass = float(w[~capped].sum())
        if mass <= 0:
            return w, 0
        out = torch.where(capped, torch.full_like(w, cap), w * (g - cap * int(capped.sum())) / mass)
        over = out > cap * (1 + 1e-12)
        if not bool(over.any()):
            return out, int(capped.sum())
        capped |= over
    return w, 0


def effective_sample_size(w: Tensor) -> float:
    """(sum w)^2 / sum w^2: G for equal weights, 1 when one sample carries everything."""
    return float(w.sum() ** 2 / (w**2).sum())


@dataclass
class FTFCStats:
    lam: Tensor  # [groups] float64, the dual's lambda of each group (in order of first appearance)
    ess: Tensor  # [groups] effective sample size of each group's final weights
    ess_total: float  # over the whole batch
    w_max: float
    num_capped: int

    def metrics(self) -> dict[str, float]:
        return {"ftfc/ess": self.ess_total, "ftfc/ess_group_mean": float(self.ess.mean()),
                "ftfc/lambda_mean": float(self.lam.mean()), "ftfc/w_max": self.w_max,
                "ftfc/num_capped": float(self.num_capped)}


def check_finite(rewards: Tensor) -> None:
    """ValueError naming the first sample whose reward is NaN or infinite."""
    bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"FTFC weights need finite rewards; sample {bad[0]} has reward {float(rewards[bad[0]])}"
                         + (f" (and {len(bad) - 1} more samples)" if len(bad) > 1 else ""))


def ftfc_weights(rewards: Tensor, group_ids: Tensor, beta: float, divergence: str,
                 cap: float | None = None) -> tuple[Tensor, FTFCStats]:
    """rewards [N], group_ids [N] -> weights [N] (float32) with mean 1 in every group, and stats.

    Per group: `group_weights` (lambda by `solve_lambda`, w = (f*)'((r - lambda) / beta), mean 1),
    then `cap_weights` when cap is given."""
    _check(divergence, beta)
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards and group_ids must both be [N]; got {tuple(rewards.shape)} and "
                         f"{tuple(group_ids.shape)}")
    check_finite(rewards)
    w = torch.zeros(len(rewards), dtype=torch.float64, device=rewards.device)
    lams, ess, capped = [], [], 0
    _, inverse = torch.unique(group_ids, return_inverse=True)
    order = dict.fromkeys(inverse.tolist())  # groups in order of first appearance
    for g in order:
        rows = (inverse == g).nonzero().flatten()
        r = rewards[rows].double()
        lam = solve_lambda(r, beta, divergence)
        wg = group_weights(r, lam, beta, divergence)
        if cap is not None:
            wg, k = cap_weights(wg, cap)
            capped += k
        w[rows] = wg
        lams.append(lam)
        ess.append(effective_sample_size(wg))
    stats = FTFCStats(torch.stack(lams), torch.tensor(ess, dtype=torch.float64),
                      effective_sample_size(w), float(w.max()), capped)
    return w.float(), stats


@dataclass
class PosteriorMoments:
    """Moments over the pool given a noisy latent x_t (one row per x_t): which pool sample made
    it is uncertain, pi_j = softmax_j(-|x_t - (1 - t) x1_j|^2 / (2 t^2)) over the group's pool."""

    rho: Tensor  # [n]         E[w | x_t]
    mean_u: Tensor  # [n, ...]  E[u | x_t],    u_j = (x_t - x1_j) / t = eps_j - x1_j
    mean_wu: Tensor  # [n, ...] E[w u | x_t]
    ess: Tensor  # [n]         1 / sum_j pi_j^2: how many pool samples x_t could have come from


def posterior_moments(x_t: Tensor, t: Tensor, pools: list[Tensor], weights: list[Tensor]) -> PosteriorMoments:
    """The Rao-Blackwellised flow-matching target of a pool (ours; not part of the published method).

    Flow matching on a pool draws x_t = (1 - t) x1_i + t eps from one sample i and regresses
    on u_i = eps - x1_i. Given x_t, though, i is only known up to the posterior pi above (the
    Gaussian kernel of each pool sample), so E_i,eps[w_i |v - u_i|^2] = E_x_t[sum_j pi_j w_j
    |v - u_j|^2], whose per-x_t minimiser is E[w u | x_t] / E[w | x_t]: the same optimum as the
    sampled target, with the noise of guessing i integrated out. Where the pool's samples are
    far apart at this t (low noise) pi is one-hot and nothing changes; at high noise, where a
    sample's layout is decided, pi spreads over the group and the target averages its samples.

    x_t [n, ...], t [n] in (0, 1]; pools[r] [G_r, ...] the clean latents of row r's group (row r's
    own sample among them), weights[r] [G_r] their tilt weights. Computed in float64."""
    rho, mean_u, mean_wu, ess = [], [], [], []
    for x, tt, pool, w in zip(x_t.double(), t.double().tolist(), pools, weights):
        pool, w, tt = pool.to(x), w.to(x), max(tt, 1e-6)  # U(0, 1) can draw t = 0 exactly
        u = (x - pool) / tt  # [G, ...]
        log_k = -((x - (1 - tt) * pool) ** 2).flatten(1).sum(1) / (2 * tt * tt)
        pi = torch.softmax(log_k, 0)
        shape = (-1,) + (1,) * (u.dim() - 1)
        rho.append((pi * w).sum())
        mean_u.append((pi.reshape(shape) * u).sum(0))
        mean_wu.append(((pi * w).reshape(shape) * u).sum(0))
        ess.append(1.0 / (pi**2).sum())
    return PosteriorMoments(torch.stack(rho), torch.stack(mean_u), torch.stack(mean_wu), torch.stack(ess))
