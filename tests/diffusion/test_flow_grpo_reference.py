"""Our flow RL formulas against the authors' public code, on random tensors.

Each `ref_*` helper below is re-typed here from the equation in Flow-GRPO's code
(github.com/yifan123/flow_grpo; mirror commit ac4c86e "fix imagereward", and the newer index
commit 54809b5 for the CPS branch, the SDE window and the configs), not copied; a test then
asserts that our function gives the same numbers. Where we differ on purpose, the test asserts
the difference is exactly the documented one and names the line that documents it. CAST and
FTFC have no public code (docs/methods.md marks them as reconstructions): for them the
reference is the equation of /work/shared/METHODS.md section 4.

Reference lines (flow_grpo/diffusers_patch/sd3_sde_with_logprob.py @ac4c86e):
  47  std_dev_t = sqrt(sigma / (1 - where(sigma == 1, sigmas[1], sigma))) * noise_level
  50  prev_sample_mean = x (1 + std_dev_t^2 / (2 sigma) dt) + v (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) dt
  59  prev_sample = prev_sample_mean + std_dev_t sqrt(-dt) eps
  61  log_prob = -(x' - mean)^2 / (2 (std_dev_t sqrt(-dt))^2) - log(std_dev_t sqrt(-dt)) - log sqrt(2 pi)
  68  log_prob averaged over every dim but the batch
scripts/train_sd3.py @ac4c86e:
  886-893  ratio = exp(logp - old_logp); loss = mean(max(-A ratio, -A clamp(ratio, 1 -+ clip_range)))
  881-884  A clamped to +-adv_clip_max
  895-896  kl = mean_{C,H,W}((mean - mean_ref)^2) / (2 std_dev_t^2), then mean over the batch
flow_grpo/stat_tracking.py @ac4c86e:
  25-31  A = (r - per-prompt mean) / (np.std(per-prompt r or, global_std, all r) + 1e-4)
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from diffusion_rl.sde import FlowSDESampler, sde_step_with_logprob

A = 0.7  # Flow-GRPO's noise_level


def bcast(s, ndim):
    return s.reshape(-1, *([1] * (ndim - 1)))


# --------------------------------------------------------------------------- re-typed references


def ref_sde(v, x, sigma, sigma_prev, sigma_max, a, prev=None, eps=None):
    """Flow-GRPO's 'sde' step, typed from its equation. Returns (x', log_prob [B], mean, std_dev_t)."""
    sigma, sigma_prev = bcast(sigma, x.dim()), bcast(sigma_prev, x.dim())
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, torch.full_like(sigma, sigma_max), sigma))) * a
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    s = std_dev_t * torch.sqrt(-dt)
    if prev is None:
        prev = mean + s * eps
    lp = -((prev - mean) ** 2) / (2 * s**2) - torch.log(s) - math.log(math.sqrt(2 * math.pi))
    return prev, lp.mean(dim=tuple(range(1, lp.dim()))), mean, std_dev_t


def ref_cps(v, x, sigma, sigma_prev, a, prev):
    """Flow-GRPO's (Flow-CPS's) 'cps' step, typed from its equation."""
    sigma, sigma_prev = bcast(sigma, x.dim()), bcast(sigma_prev, x.dim())
    std_dev_t = sigma_prev * math.sin(a * math.pi / 2)
    x0 = x - sigma * v
    x1 = x + v * (1 - sigma)
    mean = x0 * (1 - sigma_prev) + x1 * torch.sqrt(sigma_prev**2 - std_dev_t**2)
    lp = -((prev - mean) ** 2)
    return lp.mean(dim=tuple(range(1, lp.dim()))), mean, std_dev_t


def ref_advantages(prompts, rewards, global_std=False):
    """PerPromptStatTracker.update(type='grpo'): per prompt text, population std + 1e-4."""
    prompts, rewards = np.array(prompts), np.asarray(rewards, dtype=np.float64)
    adv = np.zeros_like(rewards)
    for p in np.unique(prompts):
        r = rewards[prompts == p]
        std = np.std(rewards if global_std else r) + 1e-4
        adv[prompts == p] = (r - r.mean()) / std
    return adv


def sd3_sigmas(n=10):
    s = FlowSDESampler()
    s.set_timesteps(n, shift="sd3")
    return s.sigmas.double()


# --------------------------------------------------------------------------- the SDE step


@pytest.mark.parametrize("shape", [(3, 4, 6, 6), (3, 36, 4)])  # SD3's [B, C, H, W] and packed [B, L, C]
def test_sde_step_mean_std_and_log_prob_match_flow_grpo_at_every_sde_step(shape):
    """SAME: every step of a shifted 10-step schedule but the last, std_dev_t with sigmas[1] at
    sigma = 1, sqrt(-dt) only in the transition std, log-prob averaged over all non-batch dims."""
    g = torch.Generator().manual_seed(0)
    sig = sd3_sigmas()
    for i in range(len(sig) - 2):
        x, v = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)
        prev = x + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
        ours = sde_step_with_logprob(v, x, sig[i], sig[i + 1], noise_level=A, prev_sample=prev)
        _, lp, mean, std_dev_t = ref_sde(v, x, sig[i].expand(3), sig[i + 1].expand(3), float(sig[1]), A, prev=prev)
        torch.testing.assert_close(ours.mean, mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ours.log_prob, lp, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ours.kl_std, std_dev_t, rtol=1e-12, atol=0)  # the KL's std: std_dev_t
        torch.testing.assert_close(ours.std, std_dev_t * (sig[i] - sig[i + 1]).sqrt(), rtol=1e-12, atol=0)


def test_the_drawn_sample_is_flow_grpos_mean_plus_std_sqrt_minus_dt_noise():
    """SAME: x' = mean + std_dev_t sqrt(-dt) eps, eps from the generator (randn_tensor on the CPU
    is torch.randn), and its log-prob scores x' itself (float32 in, float32 out: no rounding)."""
    sig = sd3_sigmas().float()
    x, v = torch.randn(2, 16, 8), torch.randn(2, 16, 8)
    ours = sde_step_with_logprob(v, x, sig[3], sig[4], noise_level=A, generator=torch.Generator().manual_seed(5))
    eps = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(5))
    prev, lp, _, _ = ref_sde(v, x, sig[3].expand(2), sig[4].expand(2), float(sig[1]), A, eps=eps)
    torch.testing.assert_close(ours.prev_sample, prev, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.log_prob, lp, rtol=1e-5, atol=1e-5)


def test_at_sigma_one_we_put_the_steps_own_sigma_next_in_the_std_where_flow_grpo_puts_sigmas_1():
    """DIFFERS, documented (diffusion_rl/sde.py docstring "Where we depart", first item;
    docs/methods.md line 324 "(at sigma = 1: sigma_next in the denominator)"): inside a sampler
    the two are the same number; for a step whose sigma_next is not the schedule's sigmas[1]
    ours is Flow-GRPO's formula with sigma_max := sigma_next."""
    x, v = torch.randn(2, 5, 3, dtype=torch.float64), torch.randn(2, 5, 3, dtype=torch.float64)
    prev = x + 0.2
    one, nxt = torch.ones(2, dtype=torch.float64), torch.full((2,), 0.9, dtype=torch.float64)
    ours = sde_step_with_logprob(v, x, one, nxt, noise_level=A, prev_sample=prev)
    _, lp_own, _, std_own = ref_sde(v, x, one, nxt, 0.9, A, prev=prev)
    torch.testing.assert_close(ours.kl_std.flatten(), torch.full((2,), A * math.sqrt(1 / 0.1), dtype=torch.float64))
    torch.testing.assert_close(ours.log_prob, lp_own, rtol=1e-12, atol=1e-12)
    _, lp_sched, _, std_sched = ref_sde(v, x, one, nxt, 0.95, A, prev=prev)  # a schedule whose sigmas[1] is 0.95
    assert not torch.allclose(std_sched, std_own) and not torch.allclose(lp_sched, lp_own)


def test_cps_step_matches_flow_grpos_cps_branch():
    """SAME: std = sigma_prev sin(a pi / 2), mean from x0_hat and x1_hat, log-prob -mean((x' - mean)^2)
    with the constants dropped; the KL's std is that same std."""
    g = torch.Generator().manual_seed(1)
    sig = sd3_sigmas()
    for i in range(len(sig) - 2):
        x, v = torch.randn(3, 8, 4, generator=g, dtype=torch.float64), torch.randn(3, 8, 4, generator=g, dtype=torch.float64)
        prev = x + 0.1 * torch.randn(3, 8, 4, generator=g, dtype=torch.float64)
        ours = sde_step_with_logprob(v, x, sig[i], sig[i + 1], noise_level=0.8, kind="cps", prev_sample=prev)
        lp, mean, std = ref_cps(v, x, sig[i].expand(3), sig[i + 1].expand(3), 0.8, prev)
        torch.testing.assert_close(ours.mean, mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ours.log_prob, lp, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ours.std, std, rtol=1e-12, atol=0)
        torch.testing.assert_close(ours.kl_std, std, rtol=1e-12, atol=0)


def test_noise_level_zero_is_flow_grpos_ode_step_with_log_prob_zero_instead_of_nan():
    """SAME step, DIFFERS log-prob, documented (docs/methods.md line 335 "noise_level: 0 is the
    exact Euler step with log_prob 0"): Flow-GRPO's window pipeline passes noise_level 0 outside
    the window, which gives x + v dt and a log-prob of 0/0 (NaN) that it never reads."""
    x, v = torch.randn(2, 6, 3, dtype=torch.float64), torch.randn(2, 6, 3, dtype=torch.float64)
    s, sn = torch.full((2,), 0.6, dtype=torch.float64), torch.full((2,), 0.45, dtype=torch.float64)
    ours = sde_step_with_logprob(v, x, s, sn, noise_level=0.0)
    prev, lp, mean, _ = ref_sde(v, x, s, sn, 0.95, 0.0, eps=torch.randn(2, 6, 3, dtype=torch.float64))
    torch.testing.assert_close(ours.prev_sample, prev, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.mean, mean, rtol=1e-12, atol=1e-12)
    assert torch.isnan(lp).all() and torch.equal(ours.log_prob, torch.zeros(2, dtype=torch.float64))


def test_the_log_prob_is_a_mean_over_the_same_elements_packed_or_not_and_cast_tokens_average_to_it():
    """SAME: Flow-GRPO averages over C, H, W of [B, C, H, W]; ours over the packed [B, L, C]
    latents (the same elements), and CAST's per-token log-probs (mean over a token's channels)
    average back to it over the L tokens."""
    g = torch.Generator().manual_seed(2)
    x, v = torch.randn(2, 4, 6, 6, generator=g, dtype=torch.float64), torch.randn(2, 4, 6, 6, generator=g, dtype=torch.float64)
    prev = x + 0.3 * torch.randn(2, 4, 6, 6, generator=g, dtype=torch.float64)
    s, sn = torch.full((2,), 0.7, dtype=torch.float64), torch.full((2,), 0.55, dtype=torch.float64)
    _, lp_ref, _, _ = ref_sde(v, x, s, sn, 0.95, A, prev=prev)
    def pack(t):  # [B, C, H, W] -> [B, H*W, C]
        return t.flatten(2).transpose(1, 2)

    ours = sde_step_with_logprob(pack(v), pack(x), s, sn, noise_level=A, prev_sample=pack(prev))
    torch.testing.assert_close(ours.log_prob, lp_ref, rtol=1e-12, atol=1e-12)
    token_logp = ours.elem_log_prob.mean(-1)  # [B, L]: what policy.generate stores for CAST
    torch.testing.assert_close(token_logp.mean(-1), lp_ref, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- advantages


def flow_grpo_batch(rewards, group_ids, t=2):
    from mmrl.core.batch import RolloutBatch
    from mmrl.core.rewards import AtomScores, Sample

    r = torch.tensor(rewards, dtype=torch.float32)
    return RolloutBatch(group_ids=torch.tensor(group_ids), samples=[Sample(f"p{g}", None) for g in group_ids],
                        scores=AtomScores(names=["r"], values=r[:, None], total=r), data={},
                        mask=torch.ones(len(rewards), t, dtype=torch.bool))


def test_group_advantages_match_the_per_prompt_stat_tracker_then_the_clip():
    """SAME as PerPromptStatTracker(global_std=False): per-prompt mean, np.std (ddof 0) + 1e-4,
    then clamp to +-adv_clip_max 5 at train time. A group of 30 with one outlier reaches
    sqrt(29) = 5.39 stds, so the clip binds."""
    from diffusion_rl.config import FlowGRPOConfig
    from diffusion_rl.methods.flow_grpo import FlowGRPO

    rng = np.random.default_rng(0)
    rewards = np.concatenate([rng.random(8), [0.0] * 29 + [1.0], rng.random(5)])
    groups = [0] * 8 + [1] * 30 + [2] * 5
    want = np.clip(ref_advantages([f"p{g}" for g in groups], rewards), -5, 5)
    got = FlowGRPO(FlowGRPOConfig(), None, None).advantages(flow_grpo_batch(rewards.tolist(), groups))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    assert got.max() == 5.0  # the outlier, clipped


def test_flow_grpos_configs_divide_by_the_whole_rounds_std_and_we_by_the_groups():
    """DIFFERS (departure listed in diffusion_rl/methods/flow_grpo.py's docstring; not in
    docs/methods.md, which writes the group std): most of Flow-GRPO's SD3 / FLUX configs set
    sample.global_std = True (config/grpo.py, e.g. geneval_sd3), dividing the per-prompt
    centred rewards by the population std of ALL the round's rewards. The centring is the
    same; only the scale differs, by (global std + 1e-4) / (group std + 1e-4) per group."""
    from diffusion_rl.config import FlowGRPOConfig
    from diffusion_rl.methods.flow_grpo import FlowGRPO

    rewards = np.array([0.1, 0.9, 0.5, 0.3, 0.0, 0.0, 0.2, 1.0])
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    prompts = [f"p{g}" for g in groups]
    ref = ref_advantages(prompts, rewards, global_std=True)
    ours = FlowGRPO(FlowGRPOConfig(), None, None).advantages(flow_grpo_batch(rewards.tolist(), groups)).double().numpy()
    scale = np.array([(np.std(rewards) + 1e-4) / (np.std(rewards[np.array(groups) == g]) + 1e-4) for g in groups])
    np.testing.assert_allclose(ours, ref * scale, rtol=1e-5)
    assert not np.allclose(ours, ref)


# --------------------------------------------------------------------------- the loss and the KL


def stub(logp, old_logp, *, means=None, ref_mean=None, kl_std=None, beta=0.0, clip_range=1e-4):
    """FlowGRPO on a batch with no model: the policy's steps are given tensors."""
    from diffusion_rl.config import FlowGRPOConfig
    from diffusion_rl.methods.flow_grpo import FlowGRPO
    from mmrl.core.config import KLConfig

    n, t = logp.shape
    method = FlowGRPO(FlowGRPOConfig(kl=KLConfig(beta=beta), clip_range=clip_range), None, None)
    steps = [SimpleNamespace(log_prob=logp[:, j], mean=None if means is None else means[j],
                             kl_std=None if kl_std is None else kl_std[j]) for j in range(t)]
    batch = flow_grpo_batch([0.0] * n, list(range(n)), t)
    batch.old_logp = old_logp
    if ref_mean is not None:
        batch.data["ref_mean"] = ref_mean
    return method, SimpleNamespace(sde_outputs=lambda b: steps), batch


def test_the_clipped_objective_and_its_gradient_match_flow_grpos_per_step_loss():
    """SAME: Flow-GRPO's loss at step j is mean_batch max(-A r, -A clamp(r, 1 -+ eps)); its
    accelerator accumulates over the trained steps, i.e. the mean over steps: our token mean
    over [N, T]. Log-ratios straddle eps = 1e-4 so both branches of the clip are taken."""
    g = torch.Generator().manual_seed(3)
    n, t = 6, 3
    old = torch.randn(n, t, generator=g)
    logp = (old + 2e-4 * torch.randn(n, t, generator=g)).requires_grad_()
    adv = torch.randn(n, generator=g) * 2
    ref_logp = logp.detach().clone().requires_grad_()
    ref = torch.stack([torch.maximum(-adv * torch.exp(ref_logp[:, j] - old[:, j]),
                                     -adv * torch.exp(ref_logp[:, j] - old[:, j]).clamp(1 - 1e-4, 1 + 1e-4)).mean()
                       for j in range(t)]).mean()
    method, policy, batch = stub(logp, old)
    out = method.loss(policy, batch, adv)
    torch.testing.assert_close(out.loss, ref, rtol=1e-6, atol=1e-9)
    ratio = (logp - old).exp()
    assert ((ratio - 1).abs() > 1e-4).any() and ((ratio - 1).abs() < 1e-4).any()  # both branches
    out.loss.backward()
    ref.backward()
    torch.testing.assert_close(logp.grad, ref_logp.grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_the_kl_matches_flow_grpos_mean_gap_over_two_std_dev_t_squared(kind):
    """SAME: per step mean over latent elements of (mean - mean_ref)^2 / (2 std_dev_t^2), with
    Flow-GRPO's std_dev_t (no sqrt(-dt) for 'sde'; the CPS std for 'cps'), averaged over the
    batch and the trained steps, weighted by beta; on real steps of our sampler."""
    g = torch.Generator().manual_seed(4)
    sig = sd3_sigmas()
    n, t, a = 4, 3, (A if kind == "sde" else 0.8)
    steps, ref_means, terms = [], [], []
    for j in range(t):
        i = j + 1  # steps 1..3 of 10
        x, v = torch.randn(n, 8, 4, generator=g, dtype=torch.float64), torch.randn(n, 8, 4, generator=g, dtype=torch.float64)
        step = sde_step_with_logprob(v, x, sig[i], sig[i + 1], noise_level=a, kind=kind, prev_sample=x)
        ref_mean = step.mean + 0.05 * torch.randn(n, 8, 4, generator=g, dtype=torch.float64)
        if kind == "sde":
            std_dev_t = ref_sde(v, x, sig[i].expand(n), sig[i + 1].expand(n), float(sig[1]), a, prev=x)[3]
        else:
            std_dev_t = ref_cps(v, x, sig[i].expand(n), sig[i + 1].expand(n), a, x)[2]
        terms.append((((step.mean - ref_mean) ** 2).mean(dim=(1, 2), keepdim=True) / (2 * std_dev_t**2)).mean())
        steps.append(step)
        ref_means.append(ref_mean)
    logp = torch.stack([s.log_prob for s in steps], 1)
    method, policy, batch = stub(logp, logp, means=[s.mean for s in steps], ref_mean=torch.stack(ref_means, 1),
                                 kl_std=[s.kl_std for s in steps], beta=0.04)
    out = method.loss(policy, batch, torch.zeros(n))  # A = 0: the loss is the KL term alone
    want = torch.stack(terms).mean()
    assert out.metrics["loss/kl"] == pytest.approx(float(want), rel=1e-6)
    assert float(out.loss) == pytest.approx(0.04 * float(want), rel=1e-6)


# --------------------------------------------------------------------------- the trained steps


def ref_window(n, size, window_range, rng):
    """sd3_pipeline_with_logprob_fast: the SDE window's [start, end) (end exclusive)."""
    if size > 0:
        start = rng.randint(window_range[0], window_range[1] - size)
        return list(range(start, start + size))
    return list(range(n - 1))  # no window: every step but the last


def test_sde_windows_are_flow_grpo_fasts_with_the_range_given_as_starts():
    """SAME windows (sde.py docstring, last departure: our window_start is Flow-GRPO's
    sde_window_range minus the window size): Flow-GRPO-Fast's geneval/pickscore *_fast_nocfg
    configs (10 steps, window 3, range (0, 5)) draw the windows starting at 0, 1, 2, as ours with
    window_start (0, 2); with no window both make every step but the last stochastic."""
    s = FlowSDESampler()
    s.set_timesteps(10, shift="sd3")
    rng = random.Random(0)
    ref = {tuple(ref_window(10, 3, (0, 5), rng)) for _ in range(200)}
    ours = {tuple(s.sde_steps(3, (0, 2), torch.Generator().manual_seed(k))) for k in range(200)}
    assert ours == ref == {(0, 1, 2), (1, 2, 3), (2, 3, 4)}
    assert s.sde_steps(None) == ref_window(10, 0, None, rng) == list(range(9))


def test_a_window_on_the_last_step_which_flow_grpos_default_range_allows_is_refused():
    """DIFFERS, documented (docs/methods.md line 336 "The last step (to sigma = 0) is never
    stochastic"): Flow-GRPO's base config (window 2, range (0, 10), 10 steps) can draw the
    window (8, 9), whose second step goes to sigma = 0; ours refuses that start."""
    rng = random.Random(0)
    assert any(ref_window(10, 2, (0, 10), rng) == [8, 9] for _ in range(500))
    s = FlowSDESampler()
    s.set_timesteps(10, shift="sd3")
    with pytest.raises(ValueError, match="window_start_range"):
        s.sde_steps(2, (0, 8))


def test_timestep_fraction_0_99_trains_the_steps_ours_trains_at_train_fraction_1():
    """SAME at the configs' value: Flow-GRPO trains range(int(N * timestep_fraction)), the first
    steps in order (train_sd3.py lines 345, 864); at N = 10, 0.99 that is steps 0..8, ours'
    default window at train_fraction 1. DIFFERS below 1 (not documented: config.py calls
    rollout.train_fraction "Flow-GRPO's timestep_fraction"): ours trains a random subset of
    round(W f) window steps, Flow-GRPO the first int(N f) steps."""
    from diffusion_rl.policy import _subset

    window = FlowSDESampler()
    window.set_timesteps(10, shift="sd3")
    window = window.sde_steps(None)
    assert _subset(window, 1.0, None) == list(range(int(10 * 0.99)))
    picks = {tuple(_subset(window, 0.5, torch.Generator().manual_seed(k))) for k in range(20)}
    assert all(len(p) == round(9 * 0.5) for p in picks)
    assert len(picks) > 1  # a random subset, not Flow-GRPO's first int(10 * 0.5) = 5 steps


# --------------------------------------------------------------------------- CAST and FTFC (no public code)


def test_cast_atom_advantages_are_the_per_prompt_tracker_per_atom_then_the_weighted_sum():
    """METHODS.md CAST step 3: A_ik = (r_ik - mean_k) / (std_k + eps) in the prompt's group
    (Flow-GRPO's tracker per column: population std, eps 1e-4), A_i = clip(sum_k w_k A_ik)."""
    from diffusion_rl.methods.cast import cast_advantages

    rng = np.random.default_rng(5)
    scores = (rng.random((12, 3)) > 0.5).astype(float)
    scores[:4, 2] = 1.0  # a constant column in group 0: A = 0 there
    groups = [0] * 4 + [1] * 4 + [2] * 4
    w = np.array([0.5, 1.0, 2.0])
    want_atom = np.stack([ref_advantages(groups, scores[:, k]) for k in range(3)], 1)
    out = cast_advantages(torch.tensor(scores), torch.tensor(groups), torch.tensor(w), eps=1e-4, clip=5.0,
                          population=True)
    np.testing.assert_allclose(out.atom.double().numpy(), want_atom, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.total.double().numpy(), np.clip(want_atom @ w, -5, 5), rtol=1e-5, atol=1e-6)
    assert (out.atom[:4, 2] == 0).all()


@pytest.mark.parametrize("div", ["kl", "pearson", "reverse_kl", "hellinger"])
def test_ftfc_weights_have_the_closed_forms_of_methods_md(div):
    """METHODS.md FTFC: KL w = G softmax(r / beta); Pearson w = 1 + (r - lambda) / (2 beta)
    (all positive here, so lambda = mean r); reverse KL w = beta / (lambda - r); Hellinger
    w = (1 - (r - lambda) / beta)^-2; each with mean 1 in the group. For the last two, lambda
    is checked through 1/w (resp. w^-1/2) being linear in r with slope -1/beta (resp. 1/beta)."""
    from diffusion_rl.ftfc import ftfc_weights

    r = torch.tensor([0.1, 0.4, 0.35, 0.9, 0.0], dtype=torch.float64)
    beta = 0.5
    w, _ = ftfc_weights(r, torch.zeros(5, dtype=torch.long), beta, div)
    w = w.double()
    assert float(w.mean()) == pytest.approx(1.0, abs=1e-6)
    if div == "kl":
        torch.testing.assert_close(w, 5 * torch.softmax(r / beta, 0), rtol=1e-6, atol=1e-6)
    elif div == "pearson":
        torch.testing.assert_close(w, 1 + (r - r.mean()) / (2 * beta), rtol=1e-6, atol=1e-6)
    elif div == "reverse_kl":  # 1/w = (lambda - r) / beta
        torch.testing.assert_close(1 / w - 1 / w[0], -(r - r[0]) / beta, rtol=1e-5, atol=1e-5)
    else:  # w^-1/2 = 1 - (r - lambda) / beta
        torch.testing.assert_close(w.rsqrt() - w[0].rsqrt(), -(r - r[0]) / beta, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- CFG in training


def test_training_differentiates_both_cfg_branches_as_flow_grpos_current_scripts(flux_dir):
    """SAME as the current scripts/train_sd3.py, train_sd3_fast.py, train_flux.py (train.cfg =
    True: the sampling guidance scale s in the training forward, gradient through both rows):
    grad v_guided = (1 - s) grad v_uncond + s grad v_cond. (The July 2025 train_sd3.py,
    @ac4c86e line 190, detached the unconditional row, which would give s grad v_cond alone.)"""
    from diffusion_rl.models import load_flow_model

    s = 2.0
    model = load_flow_model(flux_dir, guidance_scale=s)
    cond = model.encode_prompt(["a red circle"] * 2)
    x, sigma = model.noise(2, torch.Generator().manual_seed(0)), torch.tensor([0.8, 0.4])
    params = [p for p in model.transformer.parameters() if p.requires_grad]

    def grad_of(fn):
        return torch.cat([g.flatten() for g in torch.autograd.grad(fn().sum(), params, allow_unused=True)
                          if g is not None])

    guided = grad_of(lambda: model.velocity(x, sigma, cond))
    model.guidance_scale = 1.0
    g_cond = grad_of(lambda: model.velocity(x, sigma, {k: v for k, v in cond.items() if not k.startswith("neg/")}))
    g_uncond = grad_of(lambda: model.velocity(x, sigma, {k[4:]: v for k, v in cond.items() if k.startswith("neg/")}))
    torch.testing.assert_close(guided, (1 - s) * g_uncond + s * g_cond, rtol=1e-3, atol=1e-4)
    assert not torch.allclose(guided, s * g_cond, rtol=1e-3, atol=1e-4)


def test_without_a_generator_the_noise_comes_from_the_global_rng_as_flow_grpos_randn_tensor():
    """SAME (the sde.py docstring said otherwise until this test): Flow-GRPO draws its noise with
    diffusers' randn_tensor(shape, generator=None), i.e. torch.randn from the global RNG, so a
    step without a generator is stochastic there too, and reproducible under torch.manual_seed."""
    sig = sd3_sigmas().float()
    x, v = torch.randn(2, 6, 4), torch.randn(2, 6, 4)
    torch.manual_seed(11)
    ours = sde_step_with_logprob(v, x, sig[2], sig[3], noise_level=A)
    torch.manual_seed(11)
    prev, _, _, _ = ref_sde(v, x, sig[2].expand(2), sig[3].expand(2), float(sig[1]), A, eps=torch.randn(2, 6, 4))
    torch.testing.assert_close(ours.prev_sample, prev, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(ours.prev_sample, ours.mean)  # noise was drawn: not a deterministic step
