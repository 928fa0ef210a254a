"""CPU tests of diffusion_rl.sde: hand-worked steps, on-policy re-scoring, statistics of the
drawn samples, marginals along a whole trajectory, time shifts, the SDE window, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from diffusion_rl.sde import (
    KINDS,
    FlowSDESampler,
    flux_mu,
    flux_shift,
    sd3_shift,
    sde_step_with_logprob,
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def gaussian_velocity(x, sigma, c, s0):
    """Exact v = E[eps - x0 | x_sigma] when x0 ~ N(c, s0^2 I) (s0 = 0: the point mass at c).

    x = (1 - sigma) x0 + sigma eps is Gaussian with mean m = (1 - sigma) c and variance
    var = (1 - sigma)^2 s0^2 + sigma^2, so E[eps | x] = sigma / var (x - m) and
    E[x0 | x] = c + (1 - sigma) s0^2 / var (x - m). For s0 = 0 this is v = (x - c) / sigma.
    """
    m = (1 - sigma) * c
    var = (1 - sigma) ** 2 * s0**2 + sigma**2
    return (sigma - (1 - sigma) * s0**2) / var * (x - m) - c


# --------------------------------------------------------------------------- hand-worked steps


def test_noise_level_zero_is_the_euler_step_exactly():
    g = gen(0)
    x = torch.randn(3, 4, 5, generator=g)
    v = torch.randn(3, 4, 5, generator=g)
    for kind in KINDS:
        # dyadic sigmas: Delta = -0.25 exactly, so x + Delta v has one rounding per element
        out = sde_step_with_logprob(v, x, 0.75, 0.5, noise_level=0.0, kind=kind, generator=g)
        assert torch.equal(out.prev_sample, x + (-0.25) * v)
        assert torch.equal(out.mean, x + (-0.25) * v)
        assert torch.equal(out.log_prob, torch.zeros(3))
        assert torch.equal(out.std, torch.zeros(3, 1, 1))
    # per-sample sigmas: Delta differs per row
    sig, nxt = torch.tensor([1.0, 0.5, 0.25]), torch.tensor([0.75, 0.25, 0.0])
    out = sde_step_with_logprob(v, x, sig, nxt, noise_level=0.0)
    assert torch.equal(out.prev_sample, x + (nxt - sig).view(3, 1, 1) * v)
    # and a -> 0 approaches that step continuously, for both kinds
    for kind in KINDS:
        out = sde_step_with_logprob(v, x, 0.6, 0.45, noise_level=1e-4, kind=kind)
        torch.testing.assert_close(out.mean, x - 0.15 * v, atol=1e-5, rtol=0)


def test_an_ode_step_returns_the_input_dtype():
    """noise_level = 0 rounds its sample to the input dtype like an SDE step does (a bf16 rollout
    stays bf16), while the mean stays float32."""
    g = gen(12)
    x = torch.randn(2, 3, generator=g).to(torch.bfloat16)
    v = torch.randn(2, 3, generator=g).to(torch.bfloat16)
    out = sde_step_with_logprob(v, x, 0.75, 0.5, noise_level=0.0)
    assert out.prev_sample.dtype == torch.bfloat16 and out.mean.dtype == torch.float32
    assert torch.equal(out.prev_sample, out.mean.to(torch.bfloat16))


def test_an_ode_step_returns_a_given_sample_with_zero_log_density():
    """Re-scoring an ODE (noise_level = 0) step returns the given prev_sample itself, and every
    density term is 0: log_prob, the per-element terms CAST averages, std and the KL's std."""
    g = gen(15)
    x, v, prev = (torch.randn(2, 3, generator=g) for _ in range(3))
    out = sde_step_with_logprob(v, x, 0.75, 0.5, noise_level=0.0, prev_sample=prev)
    assert out.prev_sample is prev
    torch.testing.assert_close(out.mean, x - 0.25 * v)
    for zero in (out.log_prob, out.elem_log_prob, out.std, out.kl_std):
        assert torch.equal(zero, torch.zeros_like(zero))


def test_sde_mean_and_std_by_hand():
    # One row per (sigma, sigma_next, a, x, v); float64 so the comparison is tight.
    #  row 0: sigma .5 -> .4, a .7: std_t = .7 sqrt(.5/.5) = .7, std_t^2 = .49, Delta = -.1
    #         x coef 1 + .49/(2*.5)*(-.1) = .951; v coef (1 + .49*.5/(2*.5))*(-.1) = -.1245
    #         mean = .951*1 - .1245*2 = .702;  std = .7 sqrt(.1) = .2213594...
    #  row 1: sigma 1 -> .75, a .5: the denominator uses sigma_next: std_t = .5 sqrt(1/.25) = 1
    #         x coef 1 + 1/2*(-.25) = .875; v coef (1 + 0)*(-.25) = -.25
    #         mean = .875*.5 - .25*(-1) = .6875;  std = 1 * sqrt(.25) = .5
    #  row 2: sigma .8 -> .6, a 1: std_t = sqrt(.8/.2) = 2, std_t^2 = 4, Delta = -.2
    #         x coef 1 + 4/1.6*(-.2) = .5; v coef (1 + 4*.2/1.6)*(-.2) = -.3
    #         mean = .5*2 - .3*.5 = .85;  std = 2 sqrt(.2) = .8944271...
    x = torch.tensor([[1.0], [0.5], [2.0]], dtype=torch.float64)
    v = torch.tensor([[2.0], [-1.0], [0.5]], dtype=torch.float64)
    sig = torch.tensor([0.5, 1.0, 0.8], dtype=torch.float64)
    nxt = torch.tensor([0.4, 0.75, 0.6], dtype=torch.float64)
    for a, rows in ((0.7, [0]), (0.5, [1]), (1.0, [2])):
        out = sde_step_with_logprob(v, x, sig, nxt, noise_level=a, generator=gen(0))
        expected_mean = [0.702, 0.6875, 0.85]
        expected_std = [0.7 * math.sqrt(0.1), 0.5, 2 * math.sqrt(0.2)]
        for r in rows:
            assert out.mean[r, 0].item() == pytest.approx(expected_mean[r], abs=1e-12)
            assert out.std[r, 0].item() == pytest.approx(expected_std[r], abs=1e-12)
        assert out.std.shape == (3, 1)
    # the std is std_t * sqrt(-Delta) with std_t = a sqrt(sigma / (1 - sigma)) off sigma = 1
    out = sde_step_with_logprob(v, x, sig, nxt, noise_level=0.7)
    std_t = 0.7 * torch.sqrt(sig / (1 - torch.where(sig == 1, nxt, sig)))
    torch.testing.assert_close(out.std.flatten(), std_t * torch.sqrt(sig - nxt), rtol=0, atol=1e-12)


def test_cps_mean_std_and_log_prob_by_hand():
    # sigma .5 -> .4, a .5: std = .4 sin(pi/4) = .2828427; x0_hat = 1 - .5*2 = 0;
    # x1_hat = 1 + .5*2 = 2; sqrt(.16 - .08) = .2828427; mean = .6*0 + .2828427*2 = .5656854
    x = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    v = torch.tensor([[2.0, 2.0]], dtype=torch.float64)
    out = sde_step_with_logprob(v, x, 0.5, 0.4, noise_level=0.5, kind="cps")
    r = 0.4 * math.sqrt(0.5)
    assert out.std.item() == pytest.approx(r, abs=1e-12)
    torch.testing.assert_close(out.mean, torch.full((1, 2), 2 * r, dtype=torch.float64))
    # log_prob = -mean((x' - mean)^2): offsets .1 and -.3 -> -(.01 + .09)/2 = -.05
    prev = out.mean + torch.tensor([[0.1, -0.3]], dtype=torch.float64)
    scored = sde_step_with_logprob(v, x, 0.5, 0.4, noise_level=0.5, kind="cps", prev_sample=prev)
    assert scored.log_prob.item() == pytest.approx(-0.05, abs=1e-12)


def test_cps_at_noise_level_one_keeps_no_part_of_the_noise_estimate():
    """a = 1 is allowed for "cps" (a in [0, 1]): std = sigma_next sin(pi / 2) = sigma_next, so
    sqrt(sigma_next^2 - std^2) = 0 and mean = (1 - sigma_next) x0_hat."""
    # sigma .5 -> .4, x = 1, v = 1: x0_hat = 1 - .5 = .5, mean = .6 * .5 = .3, std = .4
    x = torch.ones(1, 2, dtype=torch.float64)
    out = sde_step_with_logprob(x, x, 0.5, 0.4, noise_level=1.0, kind="cps", generator=gen(0))
    assert out.std.item() == pytest.approx(0.4, abs=1e-12)
    torch.testing.assert_close(out.mean, torch.full((1, 2), 0.3, dtype=torch.float64))
    assert torch.isfinite(out.log_prob).all()


def test_sde_log_prob_is_the_mean_gaussian_log_density():
    g = gen(1)
    x = torch.randn(4, 3, 2, 2, generator=g)
    v = torch.randn(4, 3, 2, 2, generator=g)
    sig, nxt = torch.tensor([1.0, 0.9, 0.5, 0.2]), torch.tensor([0.9, 0.7, 0.45, 0.05])
    out = sde_step_with_logprob(v, x, sig, nxt, noise_level=0.8, generator=g)
    normal = torch.distributions.Normal(out.mean, out.std.expand_as(out.mean))
    expected = normal.log_prob(out.prev_sample).mean(dim=(1, 2, 3))
    assert out.log_prob.shape == (4,)
    torch.testing.assert_close(out.log_prob, expected, atol=1e-5, rtol=0)
    # scoring an arbitrary sample, not only the drawn one
    other = torch.randn(4, 3, 2, 2, generator=g)
    scored = sde_step_with_logprob(v, x, sig, nxt, noise_level=0.8, prev_sample=other)
    expected = normal.log_prob(other).mean(dim=(1, 2, 3))
    torch.testing.assert_close(scored.log_prob, expected, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- on-policy re-scoring


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rescoring_the_drawn_sample_gives_the_same_log_prob(kind, dtype):
    """The ratio is exactly 1 on-policy: scoring the returned sample reproduces log_prob bit
    for bit, with per-sample sigmas and bf16 inputs (the sample is scored after rounding)."""
    g = gen(2)
    x = torch.randn(5, 4, 3, 3, generator=g).to(dtype)
    v = torch.randn(5, 4, 3, 3, generator=g).to(dtype)
    sig = torch.tensor([1.0, 0.93, 0.61, 0.3, 0.12])
    nxt = torch.tensor([0.93, 0.8, 0.5, 0.12, 0.0])
    drawn = sde_step_with_logprob(v, x, sig, nxt, noise_level=0.7, kind=kind, generator=g)
    assert drawn.prev_sample.dtype == dtype
    assert drawn.mean.dtype == drawn.log_prob.dtype == torch.float32
    assert torch.isfinite(drawn.log_prob).all()
    again = sde_step_with_logprob(
        v, x, sig, nxt, noise_level=0.7, kind=kind, prev_sample=drawn.prev_sample
    )
    assert torch.equal(again.log_prob, drawn.log_prob)
    assert torch.equal(again.mean, drawn.mean) and torch.equal(again.std, drawn.std)
    assert again.prev_sample is drawn.prev_sample
    ratio = torch.exp(again.log_prob - drawn.log_prob)
    assert torch.equal(ratio, torch.ones(5))


def test_log_prob_gradient_flows_through_the_mean_not_the_sample():
    g = gen(3)
    x = torch.randn(2, 6, generator=g)
    v = torch.randn(2, 6, generator=g, requires_grad=True)
    prev = torch.randn(2, 6, generator=g, requires_grad=True)
    out = sde_step_with_logprob(v, x, 0.7, 0.6, noise_level=0.7, prev_sample=prev)
    out.log_prob.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0
    assert prev.grad is None
    # d log_prob / d v = (x' - mean) / std^2 * d mean / d v / D, with d mean / d v = v coef * Delta
    std_t2 = 0.49 * 0.7 / 0.3
    v_coef = (1 + std_t2 * 0.3 / (2 * 0.7)) * (-0.1)
    expected = (prev.detach() - out.mean.detach()) / out.std.detach() ** 2 * v_coef / 6
    torch.testing.assert_close(v.grad, expected, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("kind", KINDS)
def test_drawn_samples_have_the_reported_mean_and_std(kind):
    # Two (x, v, sigma) rows, each repeated M times: the M draws of a row have the row's
    # mean and std (the std of an average of M draws is std / sqrt(M): 4 of those is loose).
    m = 20000
    g = gen(4)
    x = torch.randn(2, 3, generator=g).repeat_interleave(m, dim=0)
    v = torch.randn(2, 3, generator=g).repeat_interleave(m, dim=0)
    sig = torch.tensor([0.9, 0.4]).repeat_interleave(m)
    nxt = torch.tensor([0.8, 0.25]).repeat_interleave(m)
    out = sde_step_with_logprob(v, x, sig, nxt, noise_level=0.7, kind=kind, generator=g)
    for r in range(2):
        rows = slice(r * m, (r + 1) * m)
        draws, mean, std = out.prev_sample[rows], out.mean[rows][0], out.std[rows][0]
        assert std.item() > 0
        torch.testing.assert_close(draws.mean(0), mean, atol=4 * std.item() / m**0.5, rtol=0)
        torch.testing.assert_close(draws.std(0), std.expand(3), atol=0, rtol=0.03)


def test_generators_make_draws_reproducible_and_per_sample():
    g = gen(5)
    x = torch.randn(3, 4, generator=g)
    v = torch.randn(3, 4, generator=g)
    a = sde_step_with_logprob(v, x, 0.5, 0.4, noise_level=0.7, generator=gen(9))
    b = sde_step_with_logprob(v, x, 0.5, 0.4, noise_level=0.7, generator=gen(9))
    c = sde_step_with_logprob(v, x, 0.5, 0.4, noise_level=0.7, generator=gen(10))
    assert torch.equal(a.prev_sample, b.prev_sample)
    assert not torch.equal(a.prev_sample, c.prev_sample)
    # one generator per sample: row i does not depend on the rest of the batch
    batch = sde_step_with_logprob(
        v, x, 0.5, 0.4, noise_level=0.7, generator=[gen(20), gen(21), gen(22)]
    )
    for i in range(3):
        alone = sde_step_with_logprob(
            v[i : i + 1], x[i : i + 1], 0.5, 0.4, noise_level=0.7, generator=gen(20 + i)
        )
        assert torch.equal(batch.prev_sample[i : i + 1], alone.prev_sample)


@pytest.mark.parametrize("kind", KINDS)
def test_drawn_sample_is_mean_plus_std_times_the_generators_noise(kind):
    """x' = mean + std * eps with eps the generator's standard normal draw (the spec's
    x_next = mean + std_t sqrt(-Delta) eps), not merely a sample with the right law."""
    g = gen(13)
    x, v = torch.randn(2, 3, 2, generator=g), torch.randn(2, 3, 2, generator=g)
    out = sde_step_with_logprob(v, x, 0.6, 0.45, noise_level=0.7, kind=kind, generator=gen(14))
    eps = torch.randn(2, 3, 2, generator=gen(14))
    torch.testing.assert_close(out.prev_sample, out.mean + out.std * eps, atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- marginals


@pytest.mark.parametrize("kind", KINDS)
def test_point_mass_trajectory_ends_at_the_point(kind):
    """x0 = c: the exact velocity is v = (x - c) / sigma. From pure noise, SDE steps everywhere
    but on the last (ODE) step end at c. CPS keeps every intermediate marginal exactly too:
    x_sigma - (1 - sigma) c has std sigma after every step."""
    n = 10
    sampler = FlowSDESampler()
    sampler.set_timesteps(n, shift="sd3")
    g = gen(6)
    c = torch.tensor([1.5, -0.5]).view(1, 2, 1)
    x = torch.randn(2000, 2, 8, generator=g)
    windows = set(sampler.sde_steps())
    assert windows == set(range(n - 1))
    for i in range(n):
        sigma, sigma_next = sampler.sigmas[i].item(), sampler.sigmas[i + 1].item()
        v = gaussian_velocity(x, sigma, c, 0.0)
        out = sampler.step(v, x, i, noise_level=0.7, kind=kind, sde=i in windows, generator=g)
        x = out.prev_sample
        if kind == "cps" and i < n - 1:
            spread = (x - (1 - sigma_next) * c).std().item()
            assert spread == pytest.approx(sigma_next, rel=0.03)
    torch.testing.assert_close(x, c.expand_as(x), atol=1e-5, rtol=0)


def test_sde_trajectory_keeps_the_marginals_of_gaussian_data():
    """x0 ~ N(c, s0^2): the marginal at sigma is N((1 - sigma) c, (1 - sigma)^2 s0^2 + sigma^2).
    Flow-GRPO's SDE (exact velocity, 40 steps) tracks it along the way and ends at the data
    distribution. (A wrong drift correction breaks this: without the x term of the mean the
    spread is ~20% off after the first step.)"""
    n, s0 = 40, 0.5
    sampler = FlowSDESampler()
    sampler.set_timesteps(n, shift="none")
    g = gen(7)
    c = torch.tensor([1.5, -0.5]).view(1, 2, 1)
    x = torch.randn(1000, 2, 16, generator=g)
    for i in range(n):
        sigma, sigma_next = sampler.sigmas[i].item(), sampler.sigmas[i + 1].item()
        v = gaussian_velocity(x, sigma, c, s0)
        x = sampler.step(v, x, i, noise_level=0.7, sde=i < n - 1, generator=g).prev_sample
        target = math.sqrt((1 - sigma_next) ** 2 * s0**2 + sigma_next**2)
        spread = (x - (1 - sigma_next) * c).std().item()
        assert spread == pytest.approx(target, rel=0.1), f"step {i}"
    assert x.std(dim=(0, 2)).tolist() == pytest.approx([s0, s0], rel=0.03)
    assert x.mean(dim=(0, 2)).tolist() == pytest.approx([1.5, -0.5], abs=0.03)


# --------------------------------------------------------------------------- time shifts


def test_time_shifts_by_hand():
    assert sd3_shift(0.5, 3.0) == pytest.approx(0.75)  # 1.5 / (1 + 2 * .5)
    assert sd3_shift(0.0) == 0.0 and sd3_shift(1.0) == 1.0
    assert flux_mu(256) == pytest.approx(0.5)
    assert flux_mu(4096) == pytest.approx(1.15)
    assert flux_mu(1024) == pytest.approx(0.63)  # .5 + .65 * 768 / 3840
    # at sigma = .5: e^mu / (e^mu + 1) = sigmoid(mu)
    assert flux_shift(0.5, 0.63) == pytest.approx(1 / (1 + math.exp(-0.63)))
    # tensors, sigma = 0 included (the 1 / sigma form would divide by zero there)
    shifted = flux_shift(torch.tensor([0.0, 0.3, 1.0]), 1.15)
    e = math.exp(1.15)
    torch.testing.assert_close(shifted, torch.tensor([0.0, e / (e + 1 / 0.3 - 1), 1.0]))


def test_sampler_matches_diffusers_flow_match_euler_scheduler():
    diffusers = pytest.importorskip("diffusers")
    np = pytest.importorskip("numpy")
    n = 12
    # FLUX / Qwen-Image: dynamic shifting, sigmas = linspace(1, 1/N, N) as their pipelines pass
    seq_len = 1024
    ref = diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    ref.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=flux_mu(seq_len))
    ours = FlowSDESampler()
    ours.set_timesteps(n, shift="flux", image_seq_len=seq_len)
    torch.testing.assert_close(ours.sigmas, ref.sigmas, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.timesteps, ref.timesteps, atol=1e-3, rtol=0)
    # SD3's static shift on the same grid
    ref = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    ref.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n))
    ours.set_timesteps(n, shift="sd3", shift_value=3.0)
    torch.testing.assert_close(ours.sigmas, ref.sigmas, atol=1e-6, rtol=0)
    # and its Euler step is our noise_level = 0 step
    g = gen(8)
    x, v = torch.randn(2, 4, 3, generator=g), torch.randn(2, 4, 3, generator=g)
    ref_next = ref.step(v, ref.timesteps[3], x, return_dict=False)[0]
    ours_next = ours.step(v, x, 3, noise_level=0.7, sde=False).prev_sample
    torch.testing.assert_close(ours_next, ref_next, atol=1e-6, rtol=0)


def test_sampler_sigmas_and_timesteps():
    for shift in ("sd3", "flux", "none"):
        sampler = FlowSDESampler()
        sampler.set_timesteps(8, shift=shift, image_seq_len=4096)
        s = sampler.sigmas
        assert s.shape == (9,) and sampler.num_steps == 8
        assert s[0].item() == 1.0 and s[-1].item() == 0.0
        assert (s[1:] < s[:-1]).all()
        torch.testing.assert_close(sampler.timesteps, s[:-1] * 1000)
    sampler.set_timesteps(4, shift="none")
    torch.testing.assert_close(sampler.sigmas, torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))


def test_sampler_schedule_uses_its_shift_and_train_timestep_parameters():
    """set_timesteps passes shift_value and the FLUX calculate_shift parameters on (not the
    defaults), and timesteps scale by the sampler's own num_train_timesteps."""
    sampler = FlowSDESampler(num_train_timesteps=500)
    sampler.set_timesteps(4, shift="sd3", shift_value=2.0)
    # 2 s / (1 + s) at s = .75, .5, .25: 1.5 / 1.75, 1 / 1.5, .5 / 1.25
    expected = torch.tensor([1.0, 6 / 7, 2 / 3, 0.4, 0.0])
    torch.testing.assert_close(sampler.sigmas, expected)
    torch.testing.assert_close(sampler.timesteps, expected[:-1] * 500)
    # image_seq_len = base_seq_len: mu = base_shift = .2 (the defaults would give mu ~ .474)
    sampler.set_timesteps(
        2, shift="flux", image_seq_len=100, base_seq_len=100, max_seq_len=200, base_shift=0.2,
        max_shift=0.9,
    )
    assert sampler.sigmas[1].item() == pytest.approx(1 / (1 + math.exp(-0.2)))  # sigmoid(mu) at .5


def test_shift_terminal_stretches_the_schedule_to_end_there_by_hand():
    """shift_terminal stretches 1 - sigma so the last sigma before 0 is shift_terminal (diffusers'
    stretch_shift_to_terminal). Uniform 4 steps: 1 - sigma = 0, .25, .5, .75 scaled by
    (1 - .1) / .75 = 1.2 -> 0, .3, .6, .9, i.e. sigmas 1, .7, .4, .1, then 0. One step has only
    the starting 1 before 0: it stays [1, 0]; 0 and None are off; a terminal >= 1 is refused."""
    sampler = FlowSDESampler()
    sampler.set_timesteps(4, shift="none", shift_terminal=0.1)
    torch.testing.assert_close(sampler.sigmas, torch.tensor([1.0, 0.7, 0.4, 0.1, 0.0]))
    torch.testing.assert_close(sampler.timesteps, torch.tensor([1000.0, 700.0, 400.0, 100.0]))
    sampler.set_timesteps(1, shift="none", shift_terminal=0.1)
    assert sampler.sigmas.tolist() == [1.0, 0.0]
    plain = FlowSDESampler()
    plain.set_timesteps(10, shift="flux", image_seq_len=1024)
    for off in (None, 0.0):  # bit for bit the unstretched schedule
        sampler.set_timesteps(10, shift="flux", image_seq_len=1024, shift_terminal=off)
        assert torch.equal(sampler.sigmas, plain.sigmas)
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="shift_terminal must lie in"):
            sampler.set_timesteps(4, shift_terminal=bad)


@pytest.mark.parametrize("n", [2, 3, 10, 28])
def test_sde_steps_stay_finite_on_a_stretched_schedule(n):
    """Qwen-Image's stretched schedule (terminal 0.02) keeps sigma < 1 after the first step, so
    every SDE step's std_t = a sqrt(sigma / (1 - sigma)), mean and log-prob are finite, and the
    first step's x coefficient is 1 - a^2 / 2 as on any schedule."""
    sampler = FlowSDESampler()
    sampler.set_timesteps(n, shift="flux", image_seq_len=4096, max_seq_len=8192, max_shift=0.9,
                          shift_terminal=0.02)
    s = sampler.sigmas
    assert s[-2].item() == pytest.approx(0.02) and (s[1:-1] < 1).all() and (s[1:] < s[:-1]).all()
    x = torch.randn(3, 4, 5, generator=gen(11))
    for i in sampler.sde_steps():
        out = sampler.step(torch.zeros_like(x), x, i, noise_level=0.7, generator=gen(i))
        assert torch.isfinite(out.mean).all() and torch.isfinite(out.log_prob).all()
        assert torch.isfinite(out.std).all() and (out.std > 0).all()
        x = out.prev_sample


def test_scheduler_shift_terminal_reaches_the_sampler_and_bad_values_are_config_errors():
    """time_shift_settings passes a truthy shift_terminal on (any family, as diffusers applies it
    where set), none for null or 0 (the bundled tiny-flow configs: their schedules unchanged), and
    refuses a value outside (0, 1) naming the key."""
    from diffusion_rl.models import time_shift_settings
    from mmrl.core.config import ConfigError

    assert time_shift_settings("qwen_image", {"shift_terminal": 0.02}, 64, 10)["shift_terminal"] == 0.02
    assert time_shift_settings("sd3", {"shift": 3.0, "shift_terminal": 0.1}, 64, 10)["shift_terminal"] == 0.1
    for off in (None, 0, 0.0):
        assert "shift_terminal" not in time_shift_settings("flux", {"shift_terminal": off}, 64, 10)
    for bad in (1.0, 1.5, -0.02, "0.02", True):
        with pytest.raises(ConfigError, match="scheduler config: shift_terminal must be a number in"):
            time_shift_settings("qwen_image", {"shift_terminal": bad}, 64, 10)


# --------------------------------------------------------------------------- the SDE window


def test_window_lies_in_range_and_never_takes_the_last_step():
    sampler = FlowSDESampler()
    sampler.set_timesteps(10)
    assert sampler.sde_steps() == list(range(9))
    starts = set()
    for seed in range(200):
        w = sampler.sde_steps(3, (2, 5), generator=gen(seed))
        assert w == list(range(w[0], w[0] + 3))
        assert 2 <= w[0] <= 5 and 9 not in w
        starts.add(w[0])
    assert starts == {2, 3, 4, 5}  # every allowed start is drawn
    # the default range keeps the window off the last step: starts 0 .. N - 1 - W
    starts = {sampler.sde_steps(4, generator=gen(seed))[0] for seed in range(200)}
    assert starts == set(range(6))
    assert sampler.sde_steps(9, generator=gen(0)) == list(range(9))


def test_window_is_reproducible_from_the_generator():
    sampler = FlowSDESampler()
    sampler.set_timesteps(20)
    g1, g2 = gen(3), gen(3)
    a = [sampler.sde_steps(2, (0, 10), generator=g1) for _ in range(5)]
    b = [sampler.sde_steps(2, (0, 10), generator=g2) for _ in range(5)]
    assert a == b
    assert len({w[0] for w in a}) > 1  # the generator advances between draws


def test_sampler_step_per_sample_index_and_the_last_step():
    sampler = FlowSDESampler()
    sampler.set_timesteps(4, shift="none")  # sigmas 1, .75, .5, .25, 0
    g = gen(9)
    x, v = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)
    out = sampler.step(v, x, torch.tensor([0, 2]), noise_level=0.7, generator=g)
    ref = sde_step_with_logprob(
        v,
        x,
        torch.tensor([1.0, 0.5]),
        torch.tensor([0.75, 0.25]),
        noise_level=0.7,
        prev_sample=out.prev_sample,
    )
    assert torch.equal(out.log_prob, ref.log_prob)
    # the last step is an ODE step: refused as an SDE step, exact Euler otherwise
    with pytest.raises(ValueError, match="last step"):
        sampler.step(v, x, 3, noise_level=0.7, generator=g)
    last = sampler.step(v, x, 3, noise_level=0.7, sde=False)
    assert torch.equal(last.prev_sample, x - 0.25 * v)
    assert torch.equal(last.log_prob, torch.zeros(2))


# --------------------------------------------------------------------------- bad input


def test_bad_input_is_refused_with_a_clear_error():
    x = torch.zeros(2, 3)
    v = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="kind"):
        sde_step_with_logprob(v, x, 0.5, 0.4, noise_level=0.7, kind="ode")
    with pytest.raises(ValueError, match="sigma_next must be < sigma"):
        sde_step_with_logprob(v, x, 0.5, 0.5, noise_level=0.7)
    with pytest.raises(ValueError, match="sigma_next must be < sigma"):
        sde_step_with_logprob(
            v, x, torch.tensor([0.5, 0.3]), torch.tensor([0.4, 0.4]), noise_level=0.7
        )
    with pytest.raises(ValueError, match=r"sigma must lie in \(0, 1\]"):
        sde_step_with_logprob(v, x, 1.5, 0.4, noise_level=0.7)
    with pytest.raises(ValueError, match="sigma_next must be >= 0"):
        sde_step_with_logprob(v, x, 0.5, -0.1, noise_level=0.7)
    with pytest.raises(ValueError, match="same shape"):
        sde_step_with_logprob(torch.zeros(2, 4), x, 0.5, 0.4, noise_level=0.7)
    with pytest.raises(ValueError, match="prev_sample"):
        sde_step_with_logprob(v, x, 0.5, 0.4, noise_level=0.7, prev_sample=torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"shape \[B\]"):
        sde_step_with_logprob(v, x, torch.tensor([0.5, 0.5, 0.5]), 0.4, noise_level=0.7)
    with pytest.raises(ValueError, match="at least one more"):
        sde_step_with_logprob(torch.zeros(2), torch.zeros(2), 0.5, 0.4, noise_level=0.7)
    with pytest.raises(ValueError, match="noise_level"):
        sde_step_with_logprob(v, x, 0.5, 0.4, noise_level=-0.1)
    with pytest.raises(ValueError, match="noise_level"):
        sde_step_with_logprob(v, x, 0.5, 0.4, noise_level=1.5, kind="cps")
    with pytest.raises(ValueError, match="generator"):
        sde_step_with_logprob(v, x, 0.5, 0.4, noise_level=0.7, generator=[gen(0)])

    sampler = FlowSDESampler()
    with pytest.raises(RuntimeError, match="set_timesteps"):
        sampler.sde_steps()
    with pytest.raises(ValueError, match="shift"):
        sampler.set_timesteps(10, shift="karras")
    with pytest.raises(ValueError, match="image_seq_len"):
        sampler.set_timesteps(10, shift="flux")
    sampler.set_timesteps(10)
    with pytest.raises(ValueError, match="window_size"):
        sampler.sde_steps(10)  # would take the last step
    with pytest.raises(ValueError, match="window_start_range"):
        sampler.sde_steps(3, (2, 7))  # a start of 7 puts step 9, the last, in the window
    with pytest.raises(ValueError, match="window_start_range"):
        sampler.sde_steps(3, (4, 2))
    with pytest.raises(ValueError, match="index"):
        sampler.step(v, x, 10, noise_level=0.7)


def test_nan_and_zero_sigmas_are_refused():
    """NaN slips through every comparison (sigma <= 0, sigma_next >= sigma are all False), so it
    needs its own check; sigma = 0 is outside (0, 1] and must say so."""
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="sigma must be finite"):
        sde_step_with_logprob(x, x, math.nan, 0.4, noise_level=0.7)
    with pytest.raises(ValueError, match="sigma_next must be finite"):
        sde_step_with_logprob(x, x, 0.5, torch.tensor([0.4, math.nan]), noise_level=0.7)
    with pytest.raises(ValueError, match=r"sigma must lie in \(0, 1\]"):
        sde_step_with_logprob(x, x, 0.0, 0.0, noise_level=0.7)


def test_zero_shift_empty_window_and_bad_indices_are_refused():
    """shift 0 (a schedule of zeros), window_size 0 (an empty window), a float index tensor, and a
    per-sample index with only *some* samples on the last step are all refused."""
    with pytest.raises(ValueError, match="shift"):
        sd3_shift(0.5, 0.0)
    sampler = FlowSDESampler()
    sampler.set_timesteps(10)
    with pytest.raises(ValueError, match="window_size"):
        sampler.sde_steps(0)
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="last step"):
        sampler.step(x, x, torch.tensor([0, 9]), noise_level=0.7)
    with pytest.raises(ValueError, match="index"):
        sampler.step(x, x, torch.tensor([0.0, 1.0]), noise_level=0.7)


def test_zero_steps_integer_velocity_and_vector_noise_level_are_refused():
    """num_steps = 0 (a schedule with no step), an integer velocity next to a float sample, and a
    noise_level tensor with more than one element are refused with a ValueError."""
    with pytest.raises(ValueError, match="num_steps"):
        FlowSDESampler().set_timesteps(0)
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="floating point"):
        sde_step_with_logprob(torch.zeros(2, 3, dtype=torch.long), x, 0.5, 0.4, noise_level=0.7)
    with pytest.raises(ValueError, match="noise_level must be a scalar"):
        sde_step_with_logprob(x, x, 0.5, 0.4, noise_level=torch.tensor([0.7, 0.7]))


@pytest.mark.parametrize("family", ["flux", "qwen_image", "flux2", "schnell", "sd3", "sd3_terminal"])
def test_auto_shift_samples_the_sigmas_each_familys_pipeline_does(family):
    """rollout.shift auto reads the scheduler's config as the family's pipeline does: before, every
    model took FLUX.1's mu line (Qwen-Image's max_shift 0.9 to 8192 tokens read as 1.15 to 4096;
    FLUX.2's empirical mu and FLUX.1-schnell's no shift ignored), and Qwen-Image's shift_terminal
    0.02 (any family's: sd3_terminal) was not applied: its last sigma before 0 was 0.16, not 0.02."""
    from types import SimpleNamespace

    diffusers = pytest.importorskip("diffusers")
    np = pytest.importorskip("numpy")
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    from diffusion_rl.policy import DiffusionPolicy
    from diffusion_rl.tiny import _scheduler

    n, seq_len = 10, 1024
    ref = (diffusers.FlowMatchEulerDiscreteScheduler(shift=1.0) if family == "schnell"
           else diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, shift_terminal=0.1) if family == "sd3_terminal"
           else _scheduler("flux" if family == "flux2" else family))
    config = dict(ref.config)
    family = {"schnell": "flux", "sd3_terminal": "sd3"}.get(family, family)
    if family == "flux2":
        mu = compute_empirical_mu(seq_len, n)
    else:
        mu = calculate_shift(seq_len, config["base_image_seq_len"], config["max_image_seq_len"],
                             config["base_shift"], config["max_shift"])
    ref.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=mu)
    flow = SimpleNamespace(family=family, transformer=None, seq_len=seq_len,
                           scheduler=SimpleNamespace(config=config))
    ours = DiffusionPolicy(flow, SimpleNamespace(shift="auto")).sampler(n)
    torch.testing.assert_close(ours.sigmas, ref.sigmas, atol=1e-6, rtol=0)


def test_a_model_whose_scheduler_sets_a_bad_shift_terminal_is_refused_when_loaded(tmp_path):
    """A scheduler_config.json with shift_terminal 1.5 is a ConfigError naming the file when the
    model loads (before the transformer), not a schedule that rises back to 0 at the first rollout."""
    import json
    import shutil
    from pathlib import Path

    from diffusion_rl.models import load_flow_model
    from mmrl.core.config import ConfigError

    model = tmp_path / "model"
    shutil.copytree(Path(__file__).parents[2] / "assets" / "tiny-flow-pixel", model)
    config = model / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "shift_terminal": 1.5}))
    with pytest.raises(ConfigError, match=r"scheduler_config.json: shift_terminal must be a number in \(0, 1\).*1.5"):
        load_flow_model(model)


def test_sde_first_step_keeps_the_sample_times_one_minus_half_a_squared():
    """At sigma = 1 (std_t^2 = a^2 / (1 - sigma_next), Delta = -(1 - sigma_next)) the mean is
    x (1 - a^2 / 2) + v Delta whatever sigma_next: at a = sqrt(2) it forgets x, at a = 2 it
    flips it (-x), at a = 5 it scales it by -11.5 -- why noise_level above sqrt(2) warns."""
    x, v = torch.tensor([[2.0, -1.0]]), torch.tensor([[0.5, 0.25]])
    for sigma_next in (0.9, 0.5):
        for a, keep in ((math.sqrt(2), 0.0), (2.0, -1.0), (5.0, -11.5)):
            out = sde_step_with_logprob(v, x, 1.0, sigma_next, noise_level=a)
            torch.testing.assert_close(out.mean, keep * x + (sigma_next - 1) * v, atol=1e-5, rtol=0)
            assert out.std.item() == pytest.approx(a)  # std_t sqrt(-Delta) = a at sigma = 1


def test_sde_noise_level_above_sqrt_two_warns_and_cps_and_lower_levels_do_not():
    """rollout.noise_level above sqrt(2) (kind sde) is accepted with a warning that names the key,
    the value and the first step's coefficient 1 - a^2/2 (2: -1); 1.4 (coefficient 0.02) and the
    default 0.7 say nothing, nor does kind cps (bounded to [0, 1] on its own)."""
    import warnings

    from diffusion_rl.config import DiffusionRolloutConfig

    with pytest.warns(UserWarning, match=r"rollout.noise_level 2 is above sqrt\(2\) ~ 1.414, .* 1 - a\^2/2 = -1 "):
        assert DiffusionRolloutConfig(noise_level=2.0).noise_level == 2.0
    with pytest.warns(UserWarning, match=r"rollout.noise_level 1.415 .* = -0.0011"):
        DiffusionRolloutConfig(noise_level=1.415)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for quiet in ({"noise_level": 1.4}, {"noise_level": 0.7}, {"noise_level": 1.0, "kind": "cps"}):
            DiffusionRolloutConfig(**quiet)
