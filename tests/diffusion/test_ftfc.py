"""FTFC (diffusion_rl/ftfc.py, diffusion_rl/methods/ftfc.py): the tilt weights of each
f-divergence against closed forms worked out by hand, E_p0[w] = 1 per group, KL = the group
softmax, the dual's minimum, the cap and the ESS, domains and bad input; the importance-
weighted flow-matching loss; and real training steps of configs/diffusion/ftfc.yaml on the
tiny flow model (weights move, the frozen pool, exact resume); the learned effective reward
g_phi (diffusion_rl/effective_reward.py): the primal value it is fitted by (no duality gap at
g = r, a bound elsewhere), the fit recovering the observed tilt, and the method using it."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from diffusion_rl import backend
from diffusion_rl.config import DiffusionTrainConfig
from diffusion_rl.effective_reward import fit_effective_reward, heldout_metrics, prompt_features
from diffusion_rl.ftfc import (
    DIVERGENCES,
    cap_weights,
    dual_objective,
    effective_sample_size,
    ftfc_weights,
    generator,
    primal_value,
    solve_lambda,
    tilt_weights,
)
from mmrl.core.config import ConfigError, load_config
from mmrl.core.trainer import Trainer

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "diffusion" / "ftfc.yaml"
E = math.e


def weights(r, beta, div, cap=None, groups=None):
    r = torch.tensor(r, dtype=torch.float32)
    g = torch.zeros(len(r), dtype=torch.long) if groups is None else torch.tensor(groups)
    return ftfc_weights(r, g, beta, div, cap)


# ---------------------------------------------------------------------- closed forms

@pytest.mark.parametrize("div, r, beta, lam, w", [
    # KL, f = w log w: w = exp((r - lam)/beta - 1); mean 1 -> lam = beta log mean e^{r/beta} - beta
    # r = (0, 1), beta 1: lam = log((1 + e) / 2) - 1; w = 2 softmax(r) = (2/(1+e), 2e/(1+e)) = (0.5379, 1.4621)
    ("kl", [0.0, 1.0], 1.0, math.log((1 + E) / 2) - 1, [2 / (1 + E), 2 * E / (1 + E)]),
    # Pearson, f = (w-1)^2: w = max(0, 1 + (r - lam)/(2 beta)); nothing clipped -> lam = mean r = 1,
    # w = 1 + (r - 1)/2 = (0.5, 1, 1.5)
    ("pearson", [0.0, 1.0, 2.0], 1.0, 1.0, [0.5, 1.0, 1.5]),
    # clipped: r = (0, 0, 4), beta 0.5; only the third is active: 1 + (4 - lam) = 3 (mean 1) -> lam = 2;
    # the others 1 + (0 - 2) = -1 -> 0
    ("pearson", [0.0, 0.0, 4.0], 0.5, 2.0, [0.0, 0.0, 3.0]),
    # reverse KL, f = -log w: w = beta/(lam - r); 1/lam + 1/(lam - 1) = 2 -> 2 lam^2 - 4 lam + 1 = 0,
    # lam > max r = 1: lam = 1 + sqrt(2)/2; w = (1/lam, 1/(lam - 1)) = (2 - sqrt 2, sqrt 2)
    ("reverse_kl", [0.0, 1.0], 1.0, 1 + math.sqrt(2) / 2, [2 - math.sqrt(2), math.sqrt(2)]),
    # squared Hellinger, f = (sqrt w - 1)^2: w = (1 - (r - lam)/beta)^-2; 1/(1+lam)^2 + 1/lam^2 = 2;
    # y = lam(lam+1): 2y + 1 = 2y^2 -> y = (1 + sqrt 3)/2, lam = (sqrt(3 + 2 sqrt 3) - 1)/2 = 0.77123;
    # w = ((1 + lam)^-2, lam^-2) = (0.31875, 1.68125)
    ("hellinger", [0.0, 1.0], 1.0, (math.sqrt(3 + 2 * math.sqrt(3)) - 1) / 2,
     [((math.sqrt(3 + 2 * math.sqrt(3)) + 1) / 2) ** -2, ((math.sqrt(3 + 2 * math.sqrt(3)) - 1) / 2) ** -2]),
])
def test_weights_match_the_closed_forms(div, r, beta, lam, w):
    got = solve_lambda(torch.tensor(r), beta, div)
    assert float(got) == pytest.approx(lam, abs=1e-9)
    assert tilt_weights(torch.tensor(r, dtype=torch.float64), got, beta, div).tolist() == pytest.approx(w, abs=1e-9)
    out, stats = weights(r, beta, div)
    assert out.tolist() == pytest.approx(w, abs=1e-6)
    assert float(stats.lam[0]) == pytest.approx(lam, abs=1e-9)


def test_hellinger_numbers():  # the values quoted above
    lam = (math.sqrt(3 + 2 * math.sqrt(3)) - 1) / 2
    assert lam == pytest.approx(0.77123, abs=1e-5)
    assert (1 + lam) ** -2 == pytest.approx(0.31875, abs=1e-5) and lam**-2 == pytest.approx(1.68125, abs=1e-5)


# ---------------------------------------------------------------------- invariants

REWARDS = [0.3, -1.2, 2.0, 0.7, 0.7, 5.0, -0.5, 1.1, 0.0, 3.3, 2.2]
GROUPS = [7, 3, 7, 3, 9, 9, 7, 3, 9, 1, 7]  # interleaved, sizes 4, 3, 3 and 1


@pytest.mark.parametrize("div", DIVERGENCES)
@pytest.mark.parametrize("beta", [0.1, 1.0, 10.0])
def test_mean_weight_is_one_in_every_group_and_lambda_minimises_the_dual(div, beta):
    r, g = torch.tensor(REWARDS).double(), torch.tensor(GROUPS)  # the float32 rewards, in float64
    w, stats = ftfc_weights(r.float(), g, beta, div)
    assert (w >= 0).all()
    for k, gid in enumerate([7, 3, 9, 1]):  # order of first appearance
        rows = g == gid
        rg = r[rows]
        lam = solve_lambda(rg, beta, div)
        assert float(stats.lam[k]) == float(lam)
        raw = tilt_weights(rg, lam, beta, div)  # before self-normalisation: the solver's own answer
        assert float(raw.mean()) == pytest.approx(1.0, abs=1e-9)
        assert float(w[rows].mean()) == pytest.approx(1.0, abs=1e-6)
        # the dual lam + beta mean f*((r - lam)/beta) is smallest at lam, and equals the primal value there
        d = dual_objective(rg, lam, beta, div)
        for step in (1e-3, -1e-3):
            assert float(dual_objective(rg, lam + step * beta, beta, div)) >= float(d) - 1e-12
        primal = (raw * rg).mean() - beta * generator(raw, div).mean()
        assert float(d) == pytest.approx(float(primal), rel=1e-7, abs=1e-9)
    assert w[torch.tensor(GROUPS) == 1].tolist() == [1.0]  # a group of one keeps p0


@pytest.mark.parametrize("beta", [0.05, 0.5, 3.0])
def test_kl_weights_are_the_group_softmax(beta):
    r, g = torch.tensor(REWARDS), torch.tensor(GROUPS)
    w, _ = ftfc_weights(r, g, beta, "kl")
    for gid in set(GROUPS):
        rows = g == gid
        expected = torch.softmax(r[rows].double() / beta, 0) * int(rows.sum())
        assert torch.allclose(w[rows].double(), expected, atol=1e-6)


@pytest.mark.parametrize("div", DIVERGENCES)
def test_equal_rewards_give_equal_weights(div):
    w, stats = weights([0.4] * 5, 0.3, div)
    assert w.tolist() == pytest.approx([1.0] * 5, abs=1e-9)
    assert stats.ess_total == pytest.approx(5.0)


def test_cap_and_effective_sample_size():
    # Pearson, beta 0.5, nothing clipped: w = 1 + r - mean r; r = (0, 0, 0, 2) -> (0.5, 0.5, 0.5, 2.5)
    w, stats = weights([0, 0, 0, 2], 0.5, "pearson")
    assert w.tolist() == pytest.approx([0.5, 0.5, 0.5, 2.5])
    assert stats.ess_total == pytest.approx(16 / 7)  # (sum w)^2 / sum w^2 = 16 / (0.75 + 6.25)
    # cap 2: the last is capped at 2; the other three share 4 - 2 = 2 in proportion: 2/3 each
    # (one clip-and-rescale pass would give (0.571, ..., 2.286), over the cap again)
    w, stats = weights([0, 0, 0, 2], 0.5, "pearson", cap=2.0)
    assert w.tolist() == pytest.approx([2 / 3, 2 / 3, 2 / 3, 2.0])
    assert stats.ess_total == pytest.approx(3.0)  # 16 / (3 * 4/9 + 4)
    assert stats.num_capped == 1 and stats.w_max == pytest.approx(2.0)
    # a cap of G or more never binds; cap 1 makes every weight 1
    assert cap_weights(torch.tensor([0.5, 0.5, 0.5, 2.5]), 4.0)[0].tolist() == [0.5, 0.5, 0.5, 2.5]
    assert cap_weights(torch.tensor([0.5, 0.5, 0.5, 2.5]), 1.0)[0].tolist() == pytest.approx([1.0] * 4)
    # one sample carries the whole group: the cap cannot hold, the weights stay
    out, k = cap_weights(torch.tensor([0.0, 0.0, 0.0, 4.0]), 2.0)
    assert out.tolist() == [0.0, 0.0, 0.0, 4.0] and k == 0
    assert effective_sample_size(torch.tensor([0.0, 0.0, 4.0])) == 1.0
    with pytest.raises(ValueError, match="cap must be >= 1"):
        cap_weights(torch.ones(3), 0.5)


def test_domains_of_reverse_kl_and_hellinger():
    r = torch.tensor(REWARDS, dtype=torch.float64)
    for beta in (0.01, 1.0, 100.0):
        assert float(solve_lambda(r, beta, "reverse_kl")) > float(r.max())
        assert bool((((r - solve_lambda(r, beta, "hellinger")) / beta) < 1).all())
    top = float(r.max())
    with pytest.raises(ValueError, match="lambda > max r"):
        tilt_weights(r, top, 1.0, "reverse_kl")
    with pytest.raises(ValueError, match=r"\(r - lambda\) / beta < 1"):
        tilt_weights(r, top - 1.0, 1.0, "hellinger")
    assert dual_objective(r, top, 1.0, "reverse_kl") == math.inf
    assert dual_objective(r, top - 1.0, 1.0, "hellinger") == math.inf
    assert torch.isfinite(dual_objective(r, top + 0.1, 1.0, "reverse_kl"))


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="beta must be a finite number > 0"):
        weights([0.0, 1.0], 0.0, "kl")
    with pytest.raises(ValueError, match="beta must be a finite number > 0"):
        solve_lambda(torch.tensor([0.0, 1.0]), -1.0, "pearson")
    with pytest.raises(ValueError, match=r"unknown divergence 'tv' \(known: kl, pearson, reverse_kl, hellinger\)"):
        weights([0.0, 1.0], 1.0, "tv")
    with pytest.raises(ValueError, match="sample 1 has reward nan"):
        weights([0.0, float("nan"), 1.0], 1.0, "kl")
    with pytest.raises(ValueError, match="sample 0 has reward inf"):
        weights([float("inf"), 1.0], 1.0, "hellinger")
    for key in ("method.beta=0", "method.divergence=tv", "method.cap=0.5"):
        with pytest.raises(ConfigError, match=key.split("=")[0]):
            load_config(DiffusionTrainConfig, CONFIG, defaults=backend.DEFAULT_CONFIG, overrides=[key])


def test_cap_keeps_a_sample_capped_in_an_earlier_pass():
    """Water-filling over three passes: 3.5 is capped first, which pushes 1.5 over the cap (1.5 * 4/2.5
    = 2.4); the fixed point caps both at 2 and gives the other four (6 - 4) / 4 = 0.5 each. A pass that
    forgot the earlier capped sample would oscillate between them."""
    out, k = cap_weights(torch.tensor([0.25, 0.25, 0.25, 0.25, 1.5, 3.5], dtype=torch.float64), 2.0)
    assert out.tolist() == pytest.approx([0.5, 0.5, 0.5, 0.5, 2.0, 2.0]) and k == 2


def test_the_stats_add_up_over_groups():
    """Two groups, each (0, 0, 0, 2) under Pearson with beta 0.5 and cap 2 (the worked example of
    test_cap_and_effective_sample_size): each caps one sample, so the batch counts 2; each group's ESS
    is 3 and the batch's is (sum w)^2 / sum w^2 = 8^2 / (2 * (3 * 4/9 + 4)) = 6."""
    w, stats = weights([0, 0, 0, 2, 0, 0, 0, 2], 0.5, "pearson", cap=2.0, groups=[0, 0, 0, 0, 1, 1, 1, 1])
    assert w.tolist() == pytest.approx([2 / 3, 2 / 3, 2 / 3, 2.0] * 2)
    assert stats.num_capped == 2
    assert stats.ess.tolist() == pytest.approx([3.0, 3.0]) and stats.ess_total == pytest.approx(6.0)


def test_rewards_and_group_ids_of_different_shapes_are_an_error():
    """rewards and group_ids must both be [N]: a length mismatch and a 2-D batch are each refused."""
    with pytest.raises(ValueError, match=r"must both be \[N\]; got \(3,\) and \(2,\)"):
        ftfc_weights(torch.zeros(3), torch.zeros(2, dtype=torch.long), 1.0, "kl")
    with pytest.raises(ValueError, match=r"must both be \[N\]"):
        ftfc_weights(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long), 1.0, "kl")


def test_reverse_kl_lambda_one_ulp_from_the_domain_edge_still_gives_mean_one_weights():
    """r = (1e6, 0), beta 2e-10: the root lambda is within one float64 ulp (1.16e-10) of max r, the
    edge of reverse KL's domain, so bisection ends with lo = max r. solve_lambda must return hi (inside
    the domain, per its comment), and the self-normalisation must remove the large residual the
    solver leaves there: w = beta / (lambda - r) = (1.72, 2e-16) before it, (2, ~0) after."""
    w, stats = weights([1e6, 0.0], 2e-10, "reverse_kl")
    assert float(stats.lam[0]) > 1e6
    assert w.tolist() == pytest.approx([2.0, 0.0], abs=1e-6)


def test_reverse_kl_with_beta_below_half_an_ulp_of_max_r_still_solves():
    """beta 1e-12 is below half an ulp of 1e6 (1.16e-10), so max r + beta rounds to max r, the
    domain's edge, and the bracket's upper end must be the next float above it instead: the
    weights come out (2, ~0), as for a beta the float can hold, not a domain error."""
    w, stats = weights([1e6, 0.0], 1e-12, "reverse_kl")
    assert float(stats.lam[0]) == math.nextafter(1e6, math.inf)
    assert w.tolist() == pytest.approx([2.0, 0.0], abs=1e-6)


# ---------------------------------------------------------------------- the loss

class _FakePolicy:
    """flow_matching_error returns fixed per-sample errors (and records its inputs)."""

    def __init__(self, err):
        self.err, self.calls = torch.tensor(err), []

    def flow_matching_error(self, x1, t, eps, cond, guided=False):
        self.calls.append((t, eps))
        return self.err[: len(x1)]


def _method(*overrides):
    from diffusion_rl.methods.ftfc import FTFC

    cfg = load_config(DiffusionTrainConfig, CONFIG, defaults=backend.DEFAULT_CONFIG, overrides=list(overrides))
    return FTFC(cfg.method, cfg, None)


def _batch(n=4):
    from mmrl.core.batch import RolloutBatch
    from mmrl.core.rewards import Sample

    return RolloutBatch(group_ids=torch.tensor([5, 5, 6, 6][:n]), samples=[Sample("a red circle", None)] * n,
                        data={"final_latents": torch.randn(n, 3, 2), "cond/x": torch.zeros(n, 1)})


def test_loss_is_the_weighted_mean_of_the_flow_matching_errors():
    m, batch = _method(), _batch()
    from diffusion_rl.methods.ftfc import SAMPLE_ID, _sample_ids

    batch.data[SAMPLE_ID] = _sample_ids(batch.group_ids)
    assert batch.data[SAMPLE_ID].tolist() == [5 * 2**20, 5 * 2**20 + 1, 6 * 2**20, 6 * 2**20 + 1]
    out = m.loss(_FakePolicy([1.0, 2.0, 3.0, 4.0]), batch, torch.tensor([0.5, 1.5, 1.0, 1.0]))
    assert float(out.loss) == pytest.approx(2.625)  # (0.5*1 + 1.5*2 + 1*3 + 1*4) / 4 = 10.5 / 4
    assert out.metrics["loss/flow_matching"] == pytest.approx(2.5)


def test_t_and_eps_are_fresh_per_sample_and_step_but_not_per_micro_batch():
    m, batch = _method("method.t_sampling=uniform"), _batch()
    from diffusion_rl.methods.ftfc import SAMPLE_ID, _sample_ids

    batch.data[SAMPLE_ID] = _sample_ids(batch.group_ids)
    whole = _FakePolicy([1.0] * 4)
    m.loss(whole, batch, torch.ones(4))
    (t, eps), = whole.calls
    assert len(set(t.tolist())) == 4 and ((t > 0) & (t < 1)).all()
    split = _FakePolicy([1.0] * 4)
    for rows in ([0], [1, 2], [3]):
        m.loss(split, batch.select(torch.tensor(rows)), torch.ones(len(rows)))
    assert torch.equal(torch.cat([c[0] for c in split.calls]), t)
    assert torch.equal(torch.cat([c[1] for c in split.calls]), eps)
    m.step = 1  # the next step redraws them
    later = _FakePolicy([1.0] * 4)
    m.loss(later, batch, torch.ones(4))
    assert not (later.calls[0][0] == t).any()


def test_a_pool_kept_across_steps_needs_the_inline_sync_scheduler():
    with pytest.raises(ConfigError, match="method.pool_refresh=0 keeps a pool"):
        _method("rollout.scheduler.mode=pipelined")
    assert _method("rollout.scheduler.mode=pipelined", "method.pool_refresh=1").cfg.pool_refresh == 1
    with pytest.raises(ConfigError, match="method.target=posterior reads each group's whole pool"):
        _method("rollout.scheduler.mode=pipelined", "method.pool_refresh=1", "method.target=posterior")


def test_nan_reward_in_the_method_names_ftfc_and_the_sample():
    from mmrl.core.rewards import AtomScores

    m, batch = _method(), _batch()
    batch.scores = AtomScores(["x"], torch.zeros(4, 1), torch.tensor([0.0, 1.0, float("nan"), 0.0]))
    with pytest.raises(ValueError, match="method ftfc: .*sample 2 has reward nan"):
        m.advantages(batch)


def test_flow_matching_error_interpolates_towards_the_noise(flux_dir):
    cfg = load_config(DiffusionTrainConfig, CONFIG, defaults=backend.DEFAULT_CONFIG,
                      overrides=[f"model.path={flux_dir}"])
    policy, _ = backend.build(cfg)
    x1, eps = torch.randn(2, *policy.flow.noise(1).shape[1:]), torch.randn(2, *policy.flow.noise(1).shape[1:])
    t = torch.tensor([0.25, 0.9])
    seen = {}

    def velocity(x, sigma, cond):
        seen["x"], seen["sigma"] = x, sigma
        return eps - x1 + 1.0  # off by exactly 1 everywhere

    policy.flow.velocity = velocity
    err = policy.flow_matching_error(x1, t, eps, {})
    assert torch.allclose(seen["x"][0], 0.75 * x1[0] + 0.25 * eps[0]) and torch.equal(seen["sigma"], t)
    assert err.tolist() == pytest.approx([1.0, 1.0])


# ---------------------------------------------------------------------- the posterior target

def test_posterior_moments_in_the_limits():
    from diffusion_rl.ftfc import posterior_moments

    g = torch.Generator().manual_seed(0)
    pool, w = torch.randn(3, 4, 2, generator=g), torch.tensor([0.5, 2.0, 0.5])
    eps = torch.randn(4, 2, generator=g)
    # a group of one sample: exactly the sampled target u = eps - x1 and its weight
    t = torch.tensor([0.6])
    m = posterior_moments((1 - 0.6) * pool[1:2] + 0.6 * eps, t, [pool[1:2]], [w[1:2]])
    assert torch.allclose(m.mean_u[0], (eps - pool[1]).double(), atol=1e-6)
    assert float(m.rho[0]) == pytest.approx(2.0) and float(m.ess[0]) == pytest.approx(1.0)
    # little noise: x_t is known to come from sample 0; the pool's other samples do not count
    far = torch.stack([pool[0], pool[0] + 50, pool[0] - 50])
    m = posterior_moments((1 - 0.05) * far[:1] + 0.05 * eps, torch.tensor([0.05]), [far], [w])
    assert torch.allclose(m.mean_wu[0], 0.5 * (eps - far[0]).double(), atol=1e-5)
    assert float(m.ess[0]) == pytest.approx(1.0)
    # pure noise (t = 1): every sample is as likely; E[u | x_t] = x_t - mean x1, E[w | x_t] = mean w
    m = posterior_moments(eps[None], torch.tensor([1.0]), [pool], [w])
    assert torch.allclose(m.mean_u[0], (eps - pool.mean(0)).double(), atol=1e-6)
    assert float(m.rho[0]) == pytest.approx(1.0) and float(m.ess[0]) == pytest.approx(3.0)


def test_the_posterior_target_is_the_conditional_mean_of_the_sampled_one():
    """Monte Carlo in one dimension: draw (i, eps), keep the x_t that land near x*, and average
    w_i and w_i u_i there; they match E[w | x*] and E[w u | x*] (the kernel's centre (1 - t) x1_j
    and width t are right)."""
    from diffusion_rl.ftfc import posterior_moments

    pool, w, t, x_star = torch.tensor([[-1.0], [0.2], [1.5]]), torch.tensor([0.4, 1.0, 1.6]), 0.7, 0.3
    g = torch.Generator().manual_seed(1)
    i = torch.randint(0, 3, (2_000_000,), generator=g)
    eps = torch.randn(2_000_000, generator=g)
    x_t = (1 - t) * pool[i, 0] + t * eps
    near = (x_t - x_star).abs() < 0.01
    u, wi = eps[near] - pool[i[near], 0], w[i[near]]
    m = posterior_moments(torch.tensor([[x_star]]), torch.tensor([t]), [pool], [w])
    assert int(near.sum()) > 10_000
    assert float(wi.mean()) == pytest.approx(float(m.rho[0]), abs=0.01)
    assert float((wi * u).mean()) == pytest.approx(float(m.mean_wu[0, 0]), abs=0.02)
    assert float(u.mean()) == pytest.approx(float(m.mean_u[0, 0]), abs=0.02)


def test_posterior_moments_in_several_dimensions_by_hand():
    """Pool x1 = (0, 1) in D = 4 (all coordinates equal), x_t = 0, t = 0.5: the kernel is summed over
    all D coordinates, log k = -|x_t - (1 - t) x1|^2 / (2 t^2) = (0, -4 * 0.25 / 0.5) = (0, -2), so
    pi = (1, e^-2) / (1 + e^-2). With w = (0.5, 1.5): rho = 0.5 pi_0 + 1.5 pi_1; u_j = (x_t - x1_j) / t =
    (0, -2), so E[u] = -2 pi_1 and E[w u] = -3 pi_1 in every coordinate; ESS = 1 / (pi_0^2 + pi_1^2)."""
    from diffusion_rl.ftfc import posterior_moments

    p1 = math.exp(-2) / (1 + math.exp(-2))
    p0 = 1 - p1
    pool = torch.stack([torch.zeros(2, 2), torch.ones(2, 2)])
    m = posterior_moments(torch.zeros(1, 2, 2), torch.tensor([0.5]), [pool], [torch.tensor([0.5, 1.5])])
    assert float(m.rho[0]) == pytest.approx(0.5 * p0 + 1.5 * p1, abs=1e-12)
    assert m.mean_u[0].flatten().tolist() == pytest.approx([-2 * p1] * 4, abs=1e-12)
    assert m.mean_wu[0].flatten().tolist() == pytest.approx([-3 * p1] * 4, abs=1e-12)
    assert float(m.ess[0]) == pytest.approx(1 / (p0**2 + p1**2), abs=1e-12)  # 1.2656 (1 / max pi would be 1.135)


def test_posterior_moments_at_t_zero_are_finite():
    """U(0, 1) can draw t = 0 exactly: x_t is then the clean sample itself, which the posterior pins
    down (pi one-hot, ESS 1, rho its weight, u = (x_t - x1) / t = 0 there) instead of dividing by 0."""
    from diffusion_rl.ftfc import posterior_moments

    pool = torch.tensor([[0.0, 1.0], [2.0, -1.0], [0.5, 0.5]])
    m = posterior_moments(pool[1:2], torch.tensor([0.0]), [pool], [torch.tensor([0.5, 2.0, 0.5])])
    assert all(bool(torch.isfinite(v).all()) for v in (m.rho, m.mean_u, m.mean_wu, m.ess))
    assert float(m.rho[0]) == pytest.approx(2.0) and float(m.ess[0]) == pytest.approx(1.0)
    assert m.mean_u[0].tolist() == [0.0, 0.0]


class _TargetPolicy:
    """flow_matching_error against a given target with v = 0; a reference returning v0 = 0."""

    def flow_velocity(self, x1, t, eps, cond, guided=False):
        return torch.zeros_like(x1)

    def flow_matching_error(self, x1, t, eps, cond, guided=False, target=None):
        target = eps - x1 if target is None else target
        return (target**2).flatten(1).mean(1)


@pytest.mark.parametrize("anchor", ["none", "base"])
def test_the_posterior_loss_equals_the_sampled_one_where_x_t_identifies_its_sample(anchor):
    """Groups of one sample: the posterior is one-hot, so both targets and both losses agree."""
    from diffusion_rl.methods.ftfc import SAMPLE_ID
    from mmrl.core.rewards import AtomScores

    batch = _batch()
    batch.group_ids = torch.tensor([1, 2, 3, 4])
    batch.scores = AtomScores(["x"], torch.zeros(4, 1), torch.tensor([0.0, 1.0, 2.0, 3.0]))
    sampled, posterior = _method(f"method.anchor={anchor}"), _method(f"method.anchor={anchor}", "method.target=posterior")
    for m in (sampled, posterior):
        m.reference = _TargetPolicy()
    w = sampled.advantages(batch)
    assert torch.equal(w, posterior.advantages(batch)) and SAMPLE_ID in batch.data
    w = torch.tensor([0.5, 1.5, 1.0, 2.0])  # any weights: with one sample per group they pass through
    for k, (x, ww) in enumerate(zip(batch.data["final_latents"], w)):
        posterior._groups[k + 1] = (x[None], ww[None])
    a = sampled.loss(_TargetPolicy(), batch, w)
    b = posterior.loss(_TargetPolicy(), batch, w)
    assert float(b.loss) == pytest.approx(float(a.loss), rel=1e-5)
    assert b.metrics["ftfc/posterior_ess"] == pytest.approx(1.0)


# ---------------------------------------------------------------------- training on the tiny model

FAST = ["rollout.num_steps=4", "rollout.num_generations=2", "rollout.prompts_per_step=2", "task.num_train=16",
        "task.num_eval=2", "task.grid_prompts=0", "logging.tensorboard=false", "logging.progress=false",
        "optim.lr=1e-3"]


def make(path, out, *overrides):
    cfg = load_config(DiffusionTrainConfig, CONFIG, defaults=backend.DEFAULT_CONFIG,
                      overrides=[f"model.path={path}", f"output_dir={out}", *FAST, *overrides])
    return cfg, *backend.build(cfg)


def test_one_ftfc_step_of_the_config_changes_every_trainable_weight(flux_dir, tmp_path, reward_spread):
    cfg, policy, task = make(flux_dir, tmp_path / "run", "train.max_steps=1")
    assert cfg.method.type == "ftfc" and cfg.rollout.noise_level == 0.0  # ODE samples of the model
    before = {k: v.clone() for k, v in policy.model.named_parameters() if v.requires_grad}
    Trainer(cfg, policy, task).train()
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert math.isfinite(row["loss/total"]) and row["train/updates"] == 4  # mini_batches 4
    # rewards 0, 1 in each of the two groups, KL, beta 0.5: w = 2 softmax(0, 2) = (2/(1+e^2), 2e^2/(1+e^2))
    # = (0.2384, 1.7616); ESS = 16 / (2 (0.2384^2 + 1.7616^2)) = 2.5316
    w = [2 / (1 + E**2), 2 * E**2 / (1 + E**2)]
    assert row["ftfc/w_max"] == pytest.approx(w[1], abs=1e-5)
    assert row["ftfc/ess"] == pytest.approx(16 / (2 * (w[0] ** 2 + w[1] ** 2)), abs=1e-4)
    assert row["ftfc/lambda_mean"] == pytest.approx(0.5 * math.log((1 + E**2) / 2) - 0.5, abs=1e-6)
    unchanged = [k for k, v in policy.model.named_parameters() if v.requires_grad and torch.equal(v, before[k])]
    assert not unchanged, unchanged


def test_the_pool_is_frozen_and_a_resume_continues_exactly(flux_dir, tmp_path, reward_spread):
    def run(name, steps, resume=False):
        cfg, policy, task = make(flux_dir, tmp_path / name, f"train.max_steps={steps}", "train.save_every=1",
                                 "train.mini_batches=1")
        trainer = Trainer(cfg, policy, task)
        trainer.train(resume=resume)
        return trainer

    full = run("full", 2)
    assert full.method.pool_step == 0  # pool_refresh 0: step 0's samples of the pretrained model
    rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["ftfc/pool_age"] for r in rows] == [0.0, 1.0] and rows[1]["rollout/staleness"] == 1
    run("split", 1)
    resumed = run("split", 2, resume=True)
    assert torch.equal(resumed.method.pool.data["final_latents"], full.method.pool.data["final_latents"])
    for (k, a), b in zip(full.policy.model.state_dict().items(), resumed.policy.model.state_dict().values()):
        assert torch.equal(a, b), k


def test_without_monitoring_only_the_pool_step_rolls_out(flux_dir, tmp_path, reward_spread):
    """monitor=false: steps after the pool's run no rollout and draw no prompts; with one
    mini-batch (no shuffle) the weights are those of the monitored run, whose rollouts train nothing."""
    def run(name, *overrides):
        cfg, policy, task = make(flux_dir, tmp_path / name, "train.max_steps=3", "train.mini_batches=1", *overrides)
        trainer = Trainer(cfg, policy, task)
        trainer.train()
        return trainer, [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    watched, rows_w = run("monitored", "method.monitor=true")
    quiet, rows_q = run("quiet", "method.monitor=false")
    assert [r["rollout/rounds"] for r in rows_w] == [1, 1, 1] and [r["rollout/rounds"] for r in rows_q] == [1, 0, 0]
    assert "reward/total" in rows_q[0] and "reward/total" not in rows_q[1]
    assert quiet.stream.position == 2 and watched.stream.position == 6  # prompts_per_step 2
    # 4 samples x 4 sampler steps for the pool, then one training row per sample and step
    assert [r["cost/model_evaluations"] for r in rows_q] == [16 + 4, 4, 4]
    assert [r["cost/model_evaluations"] for r in rows_w] == [16 + 4] * 3
    assert [r["rollout/samples"] for r in rows_q] == [4, 4, 4]
    for (k, a), b in zip(watched.policy.model.state_dict().items(), quiet.policy.model.state_dict().values()):
        assert torch.equal(a, b), k


def test_the_anchor_targets_the_pretrained_velocity_plus_the_weighted_correction(flux_dir, tmp_path, reward_spread):
    """anchor=base at the pretrained weights (v_theta = v0): err_i = (w_i - 1)^2 |u_i - v0|^2, i.e.
    (w_i - 1)^2 times plain flow matching's error; w = 1 gives a zero loss and zero gradients (the
    model stays where it is); the reference's rows are counted in the step's model evaluations."""
    from diffusion_rl.methods.ftfc import SAMPLE_ID

    cfg, policy, task = make(flux_dir, tmp_path / "a", "train.max_steps=1", "method.anchor=base")
    trainer = Trainer(cfg, policy, task)
    assert trainer.method.needs_reference and trainer.method.reference is not None
    batch, _ = trainer.scheduler.next_groups(0)
    assert "ref_mean" not in batch.data  # no KL pass ahead of the loss: the loss runs the reference
    w = batch.advantages
    assert not torch.allclose(w, torch.ones_like(w))
    policy.step_costs()
    anchored = trainer.method.loss(policy, batch, w)
    assert policy.step_costs()["cost/model_evaluations"] == 2 * len(batch)  # policy + reference rows
    x1 = batch.data["final_latents"]
    cond = {k[len("cond/"):]: v for k, v in batch.data.items() if k.startswith("cond/")}
    t, eps = trainer.method._noise(batch.data[SAMPLE_ID], x1)
    with torch.no_grad():
        plain_err = policy.flow_matching_error(x1, t, eps, cond)
    anchored_loss = float(anchored.loss.detach())
    assert anchored_loss > 0
    assert anchored_loss == pytest.approx(float(((w - 1) ** 2 * plain_err).mean()), rel=1e-4)
    uniform = trainer.method.loss(policy, batch, torch.ones_like(w))
    uniform.loss.backward()
    assert float(uniform.loss.detach()) == 0.0
    assert all(p.grad is None or not p.grad.any() for p in policy.model.parameters())

    cfg, policy, task = make(flux_dir, tmp_path / "b", "train.max_steps=2", "method.anchor=base",
                             "method.monitor=false")
    Trainer(cfg, policy, task).train()
    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss/total"]) for r in rows)
    assert [r["cost/model_evaluations"] for r in rows] == [16 + 8, 8]  # the pool, then 2 x 4 rows


def test_a_posterior_target_step_trains_and_logs_the_posterior(flux_dir, tmp_path, reward_spread):
    """target=posterior with the anchor on the tiny model: at the pretrained weights uniform weights
    give a zero loss (the target is v0 itself); the config's weights train, and the metrics say how
    many pool samples each x_t could have come from (1 to G = 2)."""
    cfg, policy, task = make(flux_dir, tmp_path / "p", "train.max_steps=1", "method.anchor=base",
                             "method.target=posterior")
    trainer = Trainer(cfg, policy, task)
    batch, _ = trainer.scheduler.next_groups(0)
    groups = trainer.method._groups  # each group's pool and weights, from advantages()
    trainer.method._groups = {g: (x, torch.ones_like(w)) for g, (x, w) in groups.items()}
    uniform = trainer.method.loss(policy, batch, torch.ones(len(batch)))
    assert float(uniform.loss.detach()) == pytest.approx(0.0, abs=1e-10)
    trainer.method._groups = groups
    trained = trainer.method.loss(policy, batch, batch.advantages)
    assert float(trained.loss.detach()) > 0
    assert 1.0 <= trained.metrics["ftfc/posterior_ess"] <= 2.0
    trainer.train()
    row = json.loads((tmp_path / "p" / "metrics.jsonl").read_text().splitlines()[0])
    assert math.isfinite(row["loss/total"]) and 1.0 <= row["ftfc/posterior_ess"] <= 2.0


# ---------------------------------------------------------------------- learned effective reward g_phi


def _pool(n_groups=4, g=8, seed=0):
    """Clean latents [N, 6, 3], a prompt conditioning, and a reward that is a function of x."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_groups * g, 6, 3, generator=gen)
    cond = {"prompt_embeds": torch.randn(n_groups, 5, 4, generator=gen).repeat_interleave(g, 0),
            "text_ids": torch.zeros(n_groups * g, 5, 3)}
    r = (x[:, 0, 0] > 0).float() + (x[:, 2, 1] > 0.5).float()
    return x, cond, r, torch.arange(n_groups).repeat_interleave(g)


@pytest.mark.parametrize("div", DIVERGENCES)
def test_the_primal_value_at_the_rewards_is_the_dual_minimum_and_bounds_every_other_g(div):
    gen = torch.Generator().manual_seed(1)
    r, groups = torch.rand(12, generator=gen) * 3, torch.tensor([0] * 6 + [1] * 6)
    best = float(primal_value(r, r, groups, 0.5, div))
    duals = [float(dual_objective(r[groups == k].double(), solve_lambda(r[groups == k], 0.5, div), 0.5, div))
             for k in (0, 1)]
    assert best == pytest.approx(sum(duals) / 2, abs=1e-9)  # Fenchel: no duality gap
    assert float(primal_value(r + torch.where(groups == 0, 2.0, -1.0), r, groups, 0.5, div)) == pytest.approx(best)
    for _ in range(5):  # any other effective reward tilts worse
        assert float(primal_value(r + torch.randn(12, generator=gen), r, groups, 0.5, div)) < best
    assert float(primal_value(torch.zeros(12), r, groups, 0.5, div)) == pytest.approx(float(r.mean()))  # no tilt


def test_the_fit_recovers_the_observed_tilt_and_starts_from_none():
    x, cond, r, groups = _pool()
    kw = {"beta": 0.5, "divergence": "kl", "hidden": 32, "lr": 3e-3, "weight_decay": 0.0, "seed": 0}
    early = fit_effective_reward(x, cond, r, groups, steps=1, **kw)
    assert early.metrics()["ftfc/g_recovered"] < 0.5  # g starts at 0: the uniform weights
    fit = fit_effective_reward(x, cond, r, groups, steps=150, **kw)
    m = fit.metrics()
    assert m["ftfc/g_gap_uniform"] > 0.1 and m["ftfc/g_recovered"] > 0.98 and m["ftfc/g_corr"] > 0.95
    w_learned, _ = ftfc_weights(fit.g, groups, 0.5, "kl")
    w_observed, _ = ftfc_weights(r, groups, 0.5, "kl")
    assert torch.allclose(w_learned, w_observed, atol=0.1)


def test_the_fit_is_a_function_of_its_seed_and_leaves_the_global_rng_alone():
    x, cond, r, groups = _pool()
    kw = {"beta": 0.5, "divergence": "hellinger", "hidden": 16, "steps": 5, "lr": 1e-3, "weight_decay": 1e-2}
    state = torch.get_rng_state()
    a = fit_effective_reward(x, cond, r, groups, seed=3, **kw)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.g, fit_effective_reward(x, cond, r, groups, seed=3, **kw).g)
    assert not torch.equal(a.g, fit_effective_reward(x, cond, r, groups, seed=4, **kw).g)


def test_the_held_out_check_predicts_a_smooth_reward_and_not_noise():
    x, cond, r, groups = _pool(n_groups=16)
    kw = {"beta": 0.5, "divergence": "kl", "hidden": 32, "steps": 150, "lr": 3e-3, "weight_decay": 0.0, "seed": 0}
    smooth = heldout_metrics(x, cond, x[:, 0, 0], groups, 0.25, **kw)  # a reward linear in one coordinate
    assert smooth["ftfc/g_heldout_prompts"] == 4 and smooth["ftfc/g_heldout_corr"] > 0.8
    assert smooth["ftfc/g_heldout_recovered"] > 0.5
    noise = heldout_metrics(x, cond, torch.randn(len(x), generator=torch.Generator().manual_seed(9)), groups, 0.25, **kw)
    assert noise["ftfc/g_heldout_recovered"] < smooth["ftfc/g_heldout_recovered"] - 0.5
    with pytest.raises(ValueError, match="at least two prompts"):
        heldout_metrics(x[:8], cond, r[:8], groups[:8], 0.5, **kw)


def test_prompt_features_average_the_tokens_under_the_mask_and_skip_ids():
    embeds = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    feats = prompt_features({"prompt_embeds": embeds, "prompt_embeds_mask": torch.tensor([[1, 1, 0]]),
                             "pooled": torch.tensor([[7.0]]), "text_ids": torch.ones(1, 3, 3)})
    assert feats.tolist() == [[7.0, 2.0, 3.0]]  # sorted names: pooled, then prompt_embeds' masked mean
    with pytest.raises(ValueError, match="needs a float prompt conditioning; got only"):
        prompt_features({"text_ids": torch.ones(1, 3, 3)})


def test_prompt_features_mean_over_tokens_without_a_mask_and_with_an_empty_mask():
    """Without a `<name>_mask` a [N, S, D] conditioning is averaged over its S tokens; a row whose
    mask is all zeros gives 0 (the clamp of the token count), not 0 / 0."""
    embeds = torch.tensor([[[1.0, 2.0], [3.0, 6.0]]])
    assert prompt_features({"prompt_embeds": embeds}).tolist() == [[2.0, 4.0]]
    feats = prompt_features({"prompt_embeds": embeds, "prompt_embeds_mask": torch.tensor([[0, 0]])})
    assert feats.tolist() == [[0.0, 0.0]]


def test_g_phi_starts_at_zero_and_standardises_its_inputs():
    """The last layer starts at zero, so g = 0 (no tilt) before any fitting; and the inputs are
    standardised on the pool, so g_phi (same weights) gives the same outputs on a pool whose features
    are all rescaled and shifted, a * x + b with a > 0, once it is standardised on that pool."""
    from diffusion_rl.effective_reward import EffectiveReward

    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    net = EffectiveReward(3, 8)
    assert net(x).tolist() == [0.0] * 6
    torch.nn.init.normal_(net.net[-1].weight)
    net.standardise_on(x)
    before = net(x)
    net.standardise_on(10 * x + 5)
    assert torch.allclose(net(10 * x + 5), before, atol=1e-5)
    assert before.std() > 0.01


def test_within_group_corr_by_hand_and_when_g_is_flat():
    """Within-group Pearson correlation: g = r plus a per-group constant is 1, g = -r is -1 (the
    group means are removed first); a g constant in every group has no spread and gives 0, not 0/0."""
    from diffusion_rl.effective_reward import within_group_corr

    r, groups = torch.tensor([0.0, 1.0, 3.0, 5.0, 4.0, 9.0]), torch.tensor([0, 0, 0, 1, 1, 1])
    assert within_group_corr(r + 10 * groups, r, groups) == pytest.approx(1.0)
    assert within_group_corr(-r, r, groups) == pytest.approx(-1.0)
    assert within_group_corr(torch.ones(6) + groups, r, groups) == 0.0


@pytest.mark.parametrize("fraction", [0.01, 0.99])
def test_the_held_out_split_keeps_a_prompt_on_each_side(fraction):
    """However small or large the fraction, at least one prompt is held out and at least one is fitted
    on: three prompts give 1 held out at 0.01 and 2 at 0.99."""
    x, cond, r, groups = _pool(n_groups=3, g=4)
    kw = {"beta": 0.5, "divergence": "kl", "hidden": 4, "steps": 1, "lr": 1e-3, "weight_decay": 0.0, "seed": 0}
    out = heldout_metrics(x, cond, r, groups, fraction, **kw)
    assert out["ftfc/g_heldout_prompts"] == (1 if fraction < 0.5 else 2)
    assert all(math.isfinite(v) for v in out.values())


def test_the_method_fits_once_per_pool_and_a_pruned_batch_reads_its_rows(monkeypatch):
    import diffusion_rl.methods.ftfc as mod

    calls = []
    real = mod.fit_effective_reward
    monkeypatch.setattr(mod, "fit_effective_reward", lambda *a, **k: calls.append(1) or real(*a, **k))
    m = _method("method.effective_reward=learned", "method.g_steps=30", "method.g_lr=1e-2", "method.g_heldout=0.5")
    m.pool_step = 0
    batch = _batch()
    batch.data["cond/prompt_embeds"] = torch.randn(4, 2, 3)
    from mmrl.core.rewards import AtomScores

    batch.scores = AtomScores(["x"], torch.zeros(4, 1), torch.tensor([0.0, 2.0, 1.0, 0.0]))
    w = m.advantages(batch)
    assert w[:2].mean() == pytest.approx(1.0) and w[2:].mean() == pytest.approx(1.0)
    assert w[1] > w[0] and w[2] > w[3]  # the tilt follows the rewards
    metrics = m.batch_metrics(batch)
    assert metrics["ftfc/g_gap"] < metrics["ftfc/g_gap_uniform"] and metrics["ftfc/g_heldout_prompts"] == 1
    part = batch.select(torch.tensor([1, 3]))
    assert torch.equal(m.effective_reward(part), m.effective_reward(batch)[[1, 3]])
    assert len(calls) == 1
    m.pool_step = 5  # a new pool: a new fit
    m.advantages(batch)
    assert len(calls) == 2


def test_a_learned_effective_reward_needs_the_inline_sync_scheduler():
    with pytest.raises(ConfigError, match="method.effective_reward=learned fits g_phi on each whole pool"):
        _method("rollout.scheduler.mode=pipelined", "method.pool_refresh=1", "method.effective_reward=learned")


def test_nan_reward_stops_the_fit_with_the_sample_named():
    from mmrl.core.rewards import AtomScores

    m, batch = _method("method.effective_reward=learned"), _batch()
    batch.scores = AtomScores(["x"], torch.zeros(4, 1), torch.tensor([0.0, 1.0, float("nan"), 0.0]))
    with pytest.raises(ValueError, match="method ftfc: .*sample 2 has reward nan"):
        m.advantages(batch)


def test_a_learned_run_on_the_tiny_model_logs_its_fit_and_resumes_exactly(flux_dir, tmp_path, reward_spread):
    def run(name, steps, resume=False):
        cfg, policy, task = make(flux_dir, tmp_path / name, f"train.max_steps={steps}", "train.save_every=1",
                                 "train.mini_batches=1", "method.effective_reward=learned", "method.g_steps=20")
        trainer = Trainer(cfg, policy, task)
        trainer.train(resume=resume)
        return trainer

    full = run("full", 2)
    rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["ftfc/g_recovered"]) and r["ftfc/g_gap"] >= -1e-9 for r in rows)
    run("split", 1)
    resumed = run("split", 2, resume=True)  # refits g_phi from the restored pool, same seed
    for (k, a), b in zip(full.policy.model.state_dict().items(), resumed.policy.model.state_dict().values()):
        assert torch.equal(a, b), k


def test_prompt_features_skip_integer_conditioning():
    """Only float tensors are features: an integer conditioning row (token counts, say) is left out
    whatever its name; the tokens are averaged, (1 + 3 + 5) / 3 = 3 and (2 + 4 + 6) / 3 = 4."""
    embeds = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])
    feats = prompt_features({"prompt_embeds": embeds, "token_counts": torch.tensor([[3]])})
    assert feats.tolist() == [[3.0, 4.0]]


@pytest.mark.parametrize("mask", [torch.tensor([[1, 0]]), torch.ones(2, 3), torch.ones(1, 3, 1)])
def test_prompt_features_refuse_a_mask_of_another_shape(mask):
    """A `<name>_mask` whose shape is not the [N, S] of its [N, S, D] tensor (fewer tokens, more rows,
    an extra dim) is refused with both shapes named, not replaced by a plain mean over the tokens."""
    embeds = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])
    with pytest.raises(ValueError, match=rf"prompt_embeds_mask has shape {re.escape(str(tuple(mask.shape)))}, "
                                         r"but prompt_embeds \(1, 3, 2\) needs one of \(1, 3\)"):
        prompt_features({"prompt_embeds": embeds, "prompt_embeds_mask": mask})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_sample_features_are_float32_whatever_the_conditioning_and_latent_dtype(dtype):
    """g_phi is a float32 network: a bfloat16 or float64 conditioning and latents come out float32,
    [flatten(x1), prompt features] in that order (x1 [1, 2, 2] -> 4 columns, then the token mean)."""
    from diffusion_rl.effective_reward import sample_features

    cond = {"prompt_embeds": torch.tensor([[[1.0, 2.0], [3.0, 6.0]]], dtype=dtype)}
    assert prompt_features(cond).dtype == torch.float32
    feats = sample_features(torch.tensor([[[0.5, 1.5], [2.5, 3.5]]], dtype=dtype), cond)
    assert feats.dtype == torch.float32
    assert feats.tolist() == [[0.5, 1.5, 2.5, 3.5, 2.0, 4.0]]
    x1 = torch.ones(1, 2, 2, dtype=torch.float32, requires_grad=True)  # the fit never differentiates into x1
    assert not sample_features(x1, cond).requires_grad


@pytest.mark.filterwarnings("ignore:std\\(\\). degrees of freedom")
def test_g_phi_standardised_on_one_sample_keeps_unit_scale():
    """One sample has no std (torch gives NaN): its scale is 1, not the 1e-6 floor, so g_phi of a
    point 0.5 away from that sample sees 0.5, not 500000."""
    from diffusion_rl.effective_reward import EffectiveReward

    torch.manual_seed(0)
    net = EffectiveReward(2, 4)
    torch.nn.init.ones_(net.net[-1].weight)
    row = torch.tensor([[1.0, -2.0]])
    net.standardise_on(row)
    assert net.shift.tolist() == [1.0, -2.0] and net.scale.tolist() == [1.0, 1.0]
    assert torch.equal(net(row + 0.5), net.net(torch.full((1, 2), 0.5)).squeeze(-1))


def test_a_pool_with_no_tilt_to_recover_reports_it_recovered():
    """Rewards equal within each prompt: the observed tilt is the uniform one, J(r) = J(0) and
    J(r) - J(0) = 0; g = 0 (no fitting steps) leaves nothing, so ftfc/g_recovered is 1, not 0/0 or 0."""
    x, cond, _, groups = _pool(n_groups=2, g=4)
    r = groups.float() * 2.0  # 0, 0, 0, 0, 2, 2, 2, 2
    kw = {"beta": 0.5, "divergence": "kl", "hidden": 4, "lr": 1e-3, "weight_decay": 0.0, "seed": 0}
    fit = fit_effective_reward(x, cond, r, groups, steps=0, **kw)
    assert fit.g.tolist() == [0.0] * 8
    m = fit.metrics()
    assert m["ftfc/g_gap_uniform"] == 0.0 and m["ftfc/g_gap"] == 0.0
    assert m["ftfc/g_recovered"] == 1.0


def test_the_fit_sees_standardised_latents_so_an_affine_rescaling_fits_the_same_g():
    """The inputs are standardised on the pool before fitting: latents 10 x + 5 give g_phi the same
    inputs as x (to rounding), so the same seed fits the same g."""
    x, cond, r, groups = _pool(n_groups=2, g=4)
    kw = {"beta": 0.5, "divergence": "kl", "hidden": 8, "steps": 3, "lr": 1e-2, "weight_decay": 0.0, "seed": 0}
    a = fit_effective_reward(x, cond, r, groups, **kw)
    b = fit_effective_reward(10 * x + 5, cond, r, groups, **kw)
    assert a.g.abs().max() > 1e-3  # it moved
    assert torch.allclose(a.g, b.g, atol=1e-5)


def test_steps_counts_the_fitting_steps_from_g_zero():
    """steps=0 leaves g_phi at its start, g = 0 everywhere; steps=1 is one AdamW step, which moves
    the zero last layer (Adam's first step is lr * sign of the gradient) and so g off 0."""
    x, cond, r, groups = _pool(n_groups=2, g=4)
    kw = {"beta": 0.5, "divergence": "kl", "hidden": 4, "lr": 1e-2, "weight_decay": 0.0, "seed": 0}
    assert fit_effective_reward(x, cond, r, groups, steps=0, **kw).g.abs().max() == 0.0
    assert fit_effective_reward(x, cond, r, groups, steps=1, **kw).g.abs().max() > 1e-4


def test_the_fits_gaps_by_hand_for_kl_at_g_zero():
    """KL, beta 1, each prompt's rewards (0, 1): the observed tilt's value is the dual's minimum
    J(r) = beta log mean e^{r/beta} = log((1 + e) / 2) = 0.62011; no tilt gives J(0) = mean r = 0.5.
    With no fitting steps g = 0, so both gaps are J(r) - J(0) = 0.12011, and g recovers none of it."""
    x, cond, _, groups = _pool(n_groups=2, g=2)
    r = torch.tensor([0.0, 1.0, 0.0, 1.0])
    kw = {"beta": 1.0, "divergence": "kl", "hidden": 4, "lr": 1e-3, "weight_decay": 0.0, "seed": 0}
    m = fit_effective_reward(x, cond, r, groups, steps=0, **kw).metrics()
    assert m["ftfc/g_gap_uniform"] == pytest.approx(math.log((1 + E) / 2) - 0.5, abs=1e-9)
    assert m["ftfc/g_gap"] == pytest.approx(math.log((1 + E) / 2) - 0.5, abs=1e-9)
    assert m["ftfc/g_recovered"] == pytest.approx(0.0, abs=1e-9)


def test_the_held_out_prompts_are_a_seeded_choice_of_round_fraction_times_prompts(monkeypatch):
    """Four prompts at fraction 0.45: round(1.8) = 2 held out, the other 2 fitted on (and reported
    as ftfc/g_heldout_prompts = 2); the fit sees exactly the rows of the prompts not held out; the
    same seed holds out the same prompts, and the seed decides which."""
    import diffusion_rl.effective_reward as mod

    x, cond, r, groups = _pool(n_groups=4, g=2)
    fitted = []
    real = mod.fit_effective_reward

    def spy(x1, c, rewards, group_ids, **kw):
        fitted.append(sorted(set(group_ids.tolist())))
        assert len(x1) == len(rewards) == len(group_ids) == 2 * len(fitted[-1])
        assert all(len(v) == len(x1) for v in c.values())
        return real(x1, c, rewards, group_ids, **kw)

    monkeypatch.setattr(mod, "fit_effective_reward", spy)
    kw = {"beta": 0.5, "divergence": "kl", "hidden": 4, "steps": 0, "lr": 1e-3, "weight_decay": 0.0}
    choices = []
    for seed in range(6):
        out = heldout_metrics(x, cond, r, groups, 0.45, seed=seed, **kw)
        assert out["ftfc/g_heldout_prompts"] == 2.0 and len(fitted[-1]) == 2
        choices.append(tuple(fitted[-1]))
    heldout_metrics(x, cond, r, groups, 0.45, seed=0, **kw)
    assert tuple(fitted[-1]) == choices[0]
    assert len(set(choices)) > 1


def test_held_out_prompts_with_no_tilt_to_recover_report_it_recovered():
    """Rewards equal within every prompt: on the held-out prompts J(r) - J(0) = 0, and g = 0 (no
    fitting steps) leaves nothing, so ftfc/g_heldout_recovered is 1, not 0/0 or 0."""
    x, cond, _, groups = _pool(n_groups=4, g=2)
    kw = {"beta": 0.5, "divergence": "kl", "hidden": 4, "steps": 0, "lr": 1e-3, "weight_decay": 0.0, "seed": 0}
    out = heldout_metrics(x, cond, groups.float(), groups, 0.5, **kw)
    assert out["ftfc/g_heldout_recovered"] == 1.0 and out["ftfc/g_heldout_corr"] == 0.0


def test_the_held_out_prompts_are_scored_on_g_phis_prediction(monkeypatch):
    """Whatever g_phi is fitted, the held-out prompts are scored on its prediction there: with a
    stand-in g_phi that returns the first latent coordinate, a reward equal to that coordinate is
    recovered whole (J(g) = J(r): 1) with correlation 1, and its negation is anti-correlated (-1)
    and tilted the wrong way, worse than uniform weights (< 0)."""
    import dataclasses

    import diffusion_rl.effective_reward as mod

    x, cond, _, groups = _pool(n_groups=4, g=4)
    real = mod.fit_effective_reward
    monkeypatch.setattr(mod, "fit_effective_reward", lambda *a, **k: dataclasses.replace(
        real(*a, **k), net=lambda features: features[:, 0]))  # x1[:, 0, 0], flattened first
    kw = {"beta": 0.5, "divergence": "kl", "hidden": 4, "steps": 0, "lr": 1e-3, "weight_decay": 0.0, "seed": 0}
    same = heldout_metrics(x, cond, x[:, 0, 0], groups, 0.5, **kw)
    assert same["ftfc/g_heldout_recovered"] == pytest.approx(1.0) and same["ftfc/g_heldout_corr"] == pytest.approx(1.0)
    flipped = heldout_metrics(x, cond, -x[:, 0, 0], groups, 0.5, **kw)
    assert flipped["ftfc/g_heldout_corr"] == pytest.approx(-1.0) and flipped["ftfc/g_heldout_recovered"] < 0


def test_kl_weights_at_a_tiny_beta_are_the_argmax_not_nan():
    """beta -> 0 tilts all the weight onto a group's best samples. At beta 1e-20 the KL weights
    exp((r - lambda) / beta - 1) came out NaN: lambda's rounding error (~1e-16) times 1 / beta
    underflowed every weight to 0, then 0 / 0; and r / beta overflowed lambda at beta 1e-310."""
    from diffusion_rl.ftfc import ftfc_weights, primal_value

    r = torch.tensor([0.0, 0.2, 1.0, 1.0, 0.6, 0.6, 0.6, 0.6])
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    for beta in (1e-20, 1e-310):
        w, stats = ftfc_weights(r, ids, beta, "kl")
        # group 0: its two best (r = 1) share G = 4 (2 each); group 1 is constant: uniform
        assert w.tolist() == [0.0, 0.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0]
        assert stats.lam.tolist() == pytest.approx([1.0, 0.6])  # lambda -> max r (+ beta (log 2/4 - 1))
        assert math.isfinite(stats.ess_total)
        assert math.isfinite(float(primal_value(r, r, ids, beta, "kl")))
    w, _ = ftfc_weights(r, ids, 0.5, "kl")  # an ordinary beta: 4 softmax(r / 0.5) in group 0
    assert w[:4].tolist() == pytest.approx((4 * torch.softmax(r[:4] / 0.5, 0)).tolist(), rel=1e-6)
