"""The diffusion and dLLM methods against the equations of docs/methods.md sections 4 and 5.

Every expected number is worked out by hand from the spec's equation (in the comment next to
it, or with plain `math` in the test), never from the code under test."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from diffusion_rl.calibrate import commit_step, window_from_commits
from diffusion_rl.ftfc import cap_weights, effective_sample_size, ftfc_weights
from diffusion_rl.methods.cast import advantage_map, cast_advantages
from diffusion_rl.methods.flow_grpo import FlowGRPO
from diffusion_rl.sde import FlowSDESampler, flux_mu, flux_shift, sd3_shift, sde_step_with_logprob
from dllm_rl.logprob import d1_masked_input, elbo_loss, forward_mask, trace_rows
from dllm_rl.methods.fork_grpo import ForkGRPO, fork_rows, row_targets
from dllm_rl.methods.slim_rl import block_mask_rates, quadrature, slim_loss
from dllm_rl.samplers import decode, num_transfer_tokens, select_commits
from mmrl.core.batch import RolloutBatch
from mmrl.core.rewards import AtomScores, Sample

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def _t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


# ============================================================ Flow-GRPO: the SDE step


def test_sde_step_mean_std_and_logprob_by_hand():
    # sigma 0.5 -> 0.25, a = 0.7, x = 1, v = 2: Delta = -0.25, std_t = 0.7 sqrt(0.5 / 0.5) = 0.7,
    # mean = 1 (1 + 0.49 / 1 * -0.25) + 2 (1 + 0.49 * 0.5 / 1) * -0.25 = 0.8775 - 0.6225 = 0.255,
    # std = 0.7 sqrt(0.25) = 0.35
    x, v = torch.ones(1, 2, dtype=torch.float64), 2 * torch.ones(1, 2, dtype=torch.float64)
    nxt = _t([0.3, 0.155])  # 0.255 + 0.045 and 0.255 - 0.1
    out = sde_step_with_logprob(v, x, 0.5, 0.25, noise_level=0.7, prev_sample=nxt)
    assert torch.allclose(out.mean, torch.full_like(x, 0.255))
    assert float(out.std) == pytest.approx(0.35)
    assert float(out.kl_std) == pytest.approx(0.7)  # std_t, without sqrt(-Delta)
    # log_prob: the MEAN over the elements of -(x' - mean)^2 / (2 std^2) - log std - log sqrt(2 pi)
    terms = [-(d**2) / (2 * 0.35**2) - math.log(0.35) - LOG_SQRT_2PI for d in (0.045, -0.1)]
    assert float(out.log_prob) == pytest.approx(sum(terms) / 2, rel=1e-12)
    assert out.elem_log_prob.flatten().tolist() == pytest.approx(terms, rel=1e-12)


def test_sde_step_at_sigma_one_uses_the_next_sigma_in_the_denominator():
    # sigma 1 -> 0.8, a = 0.5: std_t = 0.5 sqrt(1 / (1 - 0.8)) = 0.5 sqrt(5); std = std_t sqrt(0.2)
    x, v = _t([0.4]), _t([-1.0])
    out = sde_step_with_logprob(v, x, 1.0, 0.8, noise_level=0.5, prev_sample=x)
    std_t = 0.5 * math.sqrt(5)
    assert float(out.kl_std) == pytest.approx(std_t)
    assert float(out.std) == pytest.approx(std_t * math.sqrt(0.2))
    mean = 0.4 * (1 + std_t**2 / 2 * -0.2) + -1.0 * (1 + 0) * -0.2  # (1 - sigma) = 0 kills v's extra term
    assert float(out.mean) == pytest.approx(mean)


def test_cps_step_by_hand():
    # sigma 0.5 -> 0.25, a = 0.5: std = 0.25 sin(pi / 4); x0_hat = x - 0.5 v, x1_hat = x + 0.5 v,
    # mean = 0.75 x0_hat + sqrt(0.0625 - std^2) x1_hat; log_prob = -mean((x' - mean)^2)
    x, v = _t([1.0, -1.0]), _t([2.0, 0.0])
    std = 0.25 * math.sin(math.pi / 4)
    keep = math.sqrt(0.0625 - std**2)
    means = [0.75 * (1 - 1) + keep * (1 + 1), 0.75 * -1 + keep * -1]
    nxt = _t([means[0] + 0.1, means[1] - 0.3])
    out = sde_step_with_logprob(v, x, 0.5, 0.25, noise_level=0.5, kind="cps", prev_sample=nxt)
    assert out.mean.flatten().tolist() == pytest.approx(means)
    assert float(out.std) == pytest.approx(std)
    assert float(out.log_prob) == pytest.approx(-(0.01 + 0.09) / 2)


def test_ode_step_is_euler_and_rescoring_gives_ratio_one():
    x, v = _t([0.3, -0.2]), _t([1.0, 2.0])
    ode = sde_step_with_logprob(v, x, 0.6, 0.4, noise_level=0.0)
    assert ode.prev_sample.flatten().tolist() == pytest.approx([0.3 - 0.2, -0.2 - 0.4])  # x + Delta v
    assert float(ode.log_prob) == 0.0
    g = torch.Generator().manual_seed(0)
    drawn = sde_step_with_logprob(v.float(), x.float(), 0.6, 0.4, noise_level=0.7, generator=g)
    again = sde_step_with_logprob(v.float(), x.float(), 0.6, 0.4, noise_level=0.7, prev_sample=drawn.prev_sample)
    assert torch.equal(torch.exp(again.log_prob - drawn.log_prob), torch.ones(1))  # exactly 1 on-policy


def test_time_shifts_by_hand():
    assert sd3_shift(0.5, 3.0) == pytest.approx(0.75)  # 3 * 0.5 / (1 + 2 * 0.5)
    m = (1.15 - 0.5) / (4096 - 256)
    b = 0.5 - 256 * m
    assert flux_mu(256) == pytest.approx(0.5)
    assert flux_mu(4096) == pytest.approx(1.15)
    assert flux_mu(1024) == pytest.approx(m * 1024 + b)
    mu = 0.8
    for s in (0.25, 0.5, 0.9):  # e^mu / (e^mu + 1 / sigma - 1)
        assert flux_shift(s, mu) == pytest.approx(math.exp(mu) / (math.exp(mu) + 1 / s - 1))
    sampler = FlowSDESampler()
    sampler.set_timesteps(4, shift="sd3")
    grid = [1.0, 0.75, 0.5, 0.25, 0.0]
    assert sampler.sigmas.tolist() == pytest.approx([3 * s / (1 + 2 * s) for s in grid])
    assert sampler.timesteps.tolist() == pytest.approx([1000 * 3 * s / (1 + 2 * s) for s in grid[:-1]])


def test_window_never_takes_the_last_step():
    sampler = FlowSDESampler()
    sampler.set_timesteps(6, shift="none")
    assert sampler.sde_steps() == [0, 1, 2, 3, 4]  # plain Flow-GRPO: every step but the last
    starts = set()
    for seed in range(40):
        w = sampler.sde_steps(2, (1, 3), generator=torch.Generator().manual_seed(seed))
        assert w == [w[0], w[0] + 1] and 1 <= w[0] <= 3  # W consecutive, start in the range
        starts.add(w[0])
    assert starts == {1, 2, 3}
    with pytest.raises(ValueError, match="never an SDE step"):
        sampler.step(torch.zeros(1, 1), torch.zeros(1, 1), 5, noise_level=0.7)


# ============================================================ Flow-GRPO: advantages and KL


def _scored(values, groups, names=("r",)):
    values = torch.tensor(values, dtype=torch.float32).reshape(len(groups), -1)
    return AtomScores(list(names), values, values.sum(1))


def _flow_cfg():
    return SimpleNamespace(type="flow_grpo", std_eps=1e-4, adv_clip=5.0, adv_std="population", clip_range=1e-4,
                           kl=SimpleNamespace(beta=0.02), ema=None)


def test_flow_grpo_advantage_population_std_eps_and_clip():
    method = FlowGRPO(_flow_cfg(), None, None)
    # group 0: 1, 2, 3, 4 -> mean 2.5, population std sqrt(1.25); group 1: one 1 among 64 zeros+1
    r = [1, 2, 3, 4] + [1] + [0] * 63
    g = [0] * 4 + [1] * 64
    batch = RolloutBatch(torch.tensor(g), [Sample("p", None)] * len(g), scores=_scored(r, g))
    adv = method.advantages(batch)
    sd = math.sqrt(1.25)
    assert adv[:4].tolist() == pytest.approx([(x - 2.5) / (sd + 1e-4) for x in (1, 2, 3, 4)], rel=1e-6)
    # (1 - 1/64) / (sqrt(63) / 64 + 1e-4) = 7.93 -> clipped to 5; the zeros: -(1/64) / 0.124 = -0.126
    assert float(adv[4]) == 5.0
    assert float(adv[5]) == pytest.approx(-(1 / 64) / (math.sqrt(63) / 64 + 1e-4), rel=1e-6)


def test_flow_grpo_kl_term_by_hand():
    method = FlowGRPO(_flow_cfg(), None, None)
    x, v = torch.zeros(1, 3), torch.ones(1, 3)
    step = sde_step_with_logprob(v, x, 0.5, 0.25, noise_level=0.7, prev_sample=x)
    ref = step.mean - torch.tensor([[0.1, 0.2, 0.0]])
    batch = RolloutBatch(torch.tensor([0]), [Sample("p", None)], mask=torch.ones(1, 1, dtype=torch.bool),
                         data={"ref_mean": ref[:, None]})
    from mmrl.core.losses import LossOutput

    out = method.add_kl(LossOutput(torch.zeros(()), {}), [step], batch, None)
    # mean((mean - ref)^2) / (2 std_t^2), std_t = 0.7: (0.01 + 0.04 + 0) / 3 / 0.98
    kl = (0.01 + 0.04) / 3 / (2 * 0.49)
    assert out.metrics["loss/kl"] == pytest.approx(kl, rel=1e-5)
    assert float(out.loss) == pytest.approx(0.02 * kl, rel=1e-5)


# ============================================================ CAST


def test_cast_atom_advantages_and_map_by_hand():
    # one group of 2 samples, 2 atoms; population std: atom 0 scores (1, 0) -> A = +-0.5 / (0.5 + eps),
    # atom 1 scores (1, 1) -> constant -> A = 0
    scores = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    w = torch.tensor([2.0, 1.0])
    out = cast_advantages(scores, torch.tensor([0, 0]), w, eps=1e-4, population=True)
    a = 0.5 / (0.5 + 1e-4)
    assert out.atom.flatten().tolist() == pytest.approx([a, 0.0, -a, 0.0])
    assert out.total.tolist() == pytest.approx([2 * a, -2 * a])
    # A_i(l) = (sum_k w_k A_ik M_ik(l) + lambda A_i) / (1 + lambda), lambda = 1, L = 2 patches
    maps = torch.tensor([[[2.0, 0.0], [1.0, 1.0]], [[1.0, 1.0], [1.0, 1.0]]])
    amap = advantage_map(out.atom, w, maps, out.total, global_weight=1.0)
    assert amap[0].tolist() == pytest.approx([(2 * a * 2 + 2 * a) / 2, (0 + 2 * a) / 2])
    assert amap[1].tolist() == pytest.approx([-2 * a, -2 * a])  # uniform maps give back A_i


def test_cast_window_ends_at_the_commit_step():
    # verdicts change at step 1 -> 2 and are stable from step 2 on: t* = 2
    assert commit_step([(0,), (1,), (0,), (0,), (0,)]) == 2
    assert commit_step([(1,)] * 4) == 0
    # lower median of (1, 3, 5, 7) = 3; W = 2 ends at 3 -> start 2; the end is clamped to N - 2
    assert window_from_commits([7, 1, 5, 3], 10, 2) == (2, 2, 3)
    assert window_from_commits([9, 9, 9], 10, 3) == (6, 3, 9)  # end min(9, 8) = 8


# ============================================================ FTFC


@pytest.mark.parametrize("divergence", ["kl", "pearson", "reverse_kl", "hellinger"])
def test_ftfc_weights_match_the_closed_forms(divergence):
    r, beta = torch.tensor([0.0, 0.5, 1.0, 0.2]), 0.7
    w, stats = ftfc_weights(r, torch.zeros(4, dtype=torch.long), beta, divergence)
    lam = float(stats.lam[0])
    rd = r.double()
    closed = {"kl": torch.exp(rd / beta),  # then a softmax in the group
              "pearson": (1 + (rd - lam) / (2 * beta)).clamp(min=0),
              "reverse_kl": beta / (lam - rd),
              "hellinger": (1 - (rd - lam) / beta) ** -2}[divergence]
    if divergence != "kl":
        assert float(closed.mean()) == pytest.approx(1.0, abs=1e-9)  # lambda solves E_p0[w] = 1
    expected = closed / closed.mean()
    assert w.tolist() == pytest.approx(expected.tolist(), rel=1e-5)
    assert effective_sample_size(w) == pytest.approx(float(w.sum() ** 2 / (w**2).sum()))


def test_ftfc_cap_clips_the_largest_weight_and_renormalises():
    # weights 2.5, 0.5, 0.5, 0.5 (mean 1), cap 2: the first -> 2, the rest x s with 2 + 1.5 s = 4, s = 4/3
    w, n = cap_weights(torch.tensor([2.5, 0.5, 0.5, 0.5], dtype=torch.float64), 2.0)
    assert w.tolist() == pytest.approx([2.0, 2 / 3, 2 / 3, 2 / 3]) and n == 1


# ============================================================ dLLM samplers


def test_tau_budget_spec_example_and_cases():
    masked = torch.ones(1, 4, dtype=torch.bool)
    # the spec's example: 0.97, 0.96, 0.95 with n_s = 1 -> 2 (risks 0.03 + 0.04 <= 0.1; + 0.05 > 0.1)
    c = select_commits(torch.tensor([[0.95, 0.97, 0.5, 0.96]]), masked, strategy="tau_budget", num_commit=1)
    assert c.mask.tolist() == [[False, True, False, True]]
    assert float(c.expected_wrong) == pytest.approx(0.03 + 0.04)
    # nothing above tau: k_budget = 0, the static n_s = 2 most confident
    c = select_commits(torch.tensor([[0.5, 0.8, 0.7, 0.1]]), masked, strategy="tau_budget", num_commit=2)
    assert c.mask.tolist() == [[False, True, True, False]]
    # m = 2 doubles the budget to 0.2: 0.03 + 0.04 + 0.05 = 0.12 <= 0.2 -> all three above tau
    c = select_commits(torch.tensor([[0.95, 0.97, 0.5, 0.96]]), masked, strategy="tau_budget", num_commit=1, m=2.0)
    assert c.mask.tolist() == [[True, True, False, True]]


def test_fork_fallback_is_leftmost_threshold_is_most_confident():
    conf = torch.tensor([[0.1, 0.3, 0.7, 0.2], [0.9, 0.85, 0.2, 0.95]])
    masked = torch.tensor([[False, True, True, True], [True, True, True, True]])
    fork = select_commits(conf, masked, strategy="fork", threshold=0.8)
    thr = select_commits(conf, masked, strategy="threshold", threshold=0.8)
    # row 0: none > 0.8 -> fork commits the leftmost MASKED position (1), threshold the most confident (2)
    assert fork.mask[0].tolist() == [False, True, False, False] and bool(fork.fallback[0])
    assert thr.mask[0].tolist() == [False, False, True, False]
    # row 1: every c > 0.8 commits, no fallback
    assert fork.mask[1].tolist() == [True, True, False, True] and not bool(fork.fallback[1])


def test_llada_low_confidence_decode_by_hand():
    # gen 4 in 2 blocks of 2, 2 steps: 1 step per block, LLaDA's schedule commits both tokens of a
    # block in its one step; T = 0: x0 = argmax, the confidence softmax(logits)[x0]
    def logits_fn(x):
        out = torch.zeros(x.shape[0], x.shape[1], 3)
        out[:, 1:, 1] = torch.tensor([2.0, 1.0, 3.0, 0.0])  # answer positions 0..3 prefer token 1
        return out

    res = decode(logits_fn, torch.zeros(1, 1, dtype=torch.long), gen_length=4, block_length=2, steps=2,
                 mask_id=2, strategy="low_confidence")
    assert res.completion.tolist() == [[1, 1, 1, 0]]  # position 3: all logits 0, argmax is token 0
    assert res.commit_step.tolist() == [[0, 0, 1, 1]]
    conf = [math.exp(z) / (math.exp(z) + 2) for z in (2.0, 1.0, 3.0)] + [1 / 3]
    assert res.commit_confidence[0].tolist() == pytest.approx(conf, rel=1e-6)
    # 4 steps: one token per step, the more confident of the block first (position 0, then 1; 2, then 3)
    res = decode(logits_fn, torch.zeros(1, 1, dtype=torch.long), gen_length=4, block_length=2, steps=4,
                 mask_id=2, strategy="low_confidence")
    assert res.commit_step.tolist() == [[0, 1, 2, 3]]


def test_llada_schedule_and_fork_decode_flags_fallback_steps():
    assert num_transfer_tokens(torch.tensor([10]), 4).tolist() == [[3, 3, 2, 2]]
    # logits that make token 1 certain at position 0 only: every other step is a fallback
    def logits_fn(x):
        out = torch.zeros(x.shape[0], x.shape[1], 3)
        out[:, 1, 1] = 20.0  # completion position 0 (the prompt has 1 token)
        return out

    res = decode(logits_fn, torch.zeros(1, 1, dtype=torch.long), gen_length=4, block_length=4, steps=4,
                 mask_id=2, strategy="fork", threshold=0.8)
    # step 0 commits position 0 (c ~ 1 > 0.8); then c = 1/3 everywhere: leftmost one per step
    assert res.commit_step.tolist() == [[0, 1, 2, 3]]
    assert res.fallback.tolist() == [[False, True, True, True]]


# ============================================================ dLLM log-prob inputs


def test_d1_input_masks_the_whole_completion_and_about_15pc_of_the_prompt():
    prompt = torch.arange(1, 2001).reshape(1, 2000)
    valid = torch.ones(1, 2000, dtype=torch.bool)
    valid[0, :100] = False  # left padding: never masked
    x = d1_masked_input(prompt, torch.tensor([[5, 6, 7]]), mask_id=0, seed=3, prompt_valid=valid)
    assert x[0, 2000:].tolist() == [0, 0, 0]
    assert not (x[0, :100] == 0).any()
    rate = float((x[0, 100:2000] == 0).float().mean())
    assert 0.12 < rate < 0.18  # Bernoulli(0.15) over 1900 tokens: sd ~0.008
    again = d1_masked_input(prompt, torch.tensor([[5, 6, 7]]), mask_id=0, seed=3, prompt_valid=valid)
    assert torch.equal(x, again)  # one seed, one mask: old and new log-probs see the same input


def test_trace_rows_by_hand():
    # steps 0, 0, 1, 2, 3 and padding; s = 2 -> groups {0, 1}, {2, 3}: ceil(4 / 2) = 2 rows
    rows = trace_rows(torch.tensor([[0, 0, 1, 2, 3, -1]]), s=2)
    assert rows.target.int().tolist() == [[1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 0]]
    # the input masks every token committed at or after the row's first step (0, then 2)
    assert rows.input_masked.int().tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 0]]
    assert rows.step.tolist() == [0, 2]


def test_llada_forward_process_and_elbo_by_hand():
    g = torch.Generator().manual_seed(0)
    masked, p = forward_mask(torch.ones(2000, 1, dtype=torch.bool), generator=g)
    t = torch.rand(2000, generator=torch.Generator().manual_seed(0))  # the same first draw: t ~ U(0, 1)
    assert p.tolist() == pytest.approx(((1 - 1e-3) * t + 1e-3).tolist())
    assert abs(float(masked.float().mean()) - float(p.mean())) < 0.05  # each token masked w.p. p
    # 2 tokens, V = 2, uniform logits -> CE = log 2 each; only token 0 masked, p = 0.5: (log 2 / 0.5) / 2
    loss = elbo_loss(torch.zeros(1, 2, 2), torch.tensor([[0, 1]]), torch.tensor([[True, False]]),
                     torch.tensor([0.5]), torch.ones(1, 2, dtype=torch.bool))
    assert float(loss) == pytest.approx(math.log(2) / 0.5 / 2)


# ============================================================ SLIM-RL


def test_slim_quadrature_and_block_rates_by_hand():
    t, w = quadrature(3)
    assert t.tolist() == pytest.approx([0.5 - math.sqrt(0.15), 0.5, 0.5 + math.sqrt(0.15)])  # 0.1127, 0.5, 0.8873
    assert w.tolist() == pytest.approx([5 / 18, 8 / 18, 5 / 18])  # 0.2778, 0.4444, 0.2778
    # t = 0.5, B = 3: s = min(0.2, 1 - 1e-6) = 0.2 -> 0.5 + 0.1 cos(0, pi/2, pi) = 0.6, 0.5, 0.4
    assert block_mask_rates(0.5, 3, 0.2).tolist() == pytest.approx([0.6, 0.5, 0.4])
    # t = 0.05: s = 2 * 0.05 - 1e-6 (under 0.2), B = 2 -> 0.05 +- s / 2, mean exactly t
    s = 0.1 - 1e-6
    assert block_mask_rates(0.05, 2, 0.2).tolist() == pytest.approx([0.05 + s / 2, 0.05 - s / 2])


def test_slim_loss_sequence_ratio_clip_and_kl_by_hand():
    # one sample, Q = 2 rows, A = 1; row 0: logp - old = 0.2, 0.0 on its 2 masked tokens -> l = 0.1,
    # s = e^0.1 = 1.105 -> min(1.105, clip 1.1) = 1.1; row 1: l = -0.05 -> s = e^-0.05 (inside the clip)
    old = torch.zeros(1, 2, 3)
    logp = torch.tensor([[[0.2, 0.0, 9.0], [-0.05, 0.0, 0.0]]])
    mask = torch.tensor([[[True, True, False], [True, False, False]]])
    w = torch.tensor([0.25, 0.75], dtype=torch.float64)
    out = slim_loss(logp, old, mask, torch.tensor([1.0]), w, clip=0.1, max_log_ratio=10.0, beta=0.5)
    pg = -(0.25 * 1.1 + 0.75 * math.exp(-0.05)) / 2  # / rows = N * Q = 2

    def k3(d):  # exp(-d) + d - 1, d = logp - old
        return math.exp(-d) + d - 1

    kl = (0.25 * (k3(0.2) + k3(0.0)) / 3 + 0.75 * k3(-0.05) / 3) / 2  # w_q * row sum / C = 3, then / rows
    assert float(out.loss) == pytest.approx(pg + 0.5 * kl, rel=1e-5)
    # the mean log-ratio is clamped to +-max_log_ratio before exp; A < 0: min(sA, clip(s)A) = s A
    big = slim_loss(torch.full((1, 1, 1), 30.0), torch.zeros(1, 1, 1), torch.ones(1, 1, 1, dtype=torch.bool),
                    torch.tensor([-1.0]), torch.tensor([1.0], dtype=torch.float64), clip=0.1, max_log_ratio=10.0,
                    beta=0.0)
    assert float(big.loss) == pytest.approx(math.exp(10.0), rel=1e-5)
    # it is the MEAN that is clamped: log-ratios 30 and -10 average 10 (a per-token clamp would give 0)
    two = slim_loss(torch.tensor([[[30.0, -10.0]]]), torch.zeros(1, 1, 2), torch.ones(1, 1, 2, dtype=torch.bool),
                    torch.tensor([-1.0]), torch.tensor([1.0], dtype=torch.float64), clip=0.1, max_log_ratio=10.0,
                    beta=0.0)
    assert float(two.loss) == pytest.approx(math.exp(10.0), rel=1e-5)


# ============================================================ ForkGRPO


def test_fork_rows_are_the_fallback_positions():
    # rollout 0: steps 0 (two tokens), 1 (fallback, position 2), 2 (fallback, position 3)
    cs = torch.tensor([[0, 0, 1, 2], [0, 1, 1, -1]])
    fb = torch.tensor([[False, True, True], [True, False, False]])
    target = row_targets(cs, fb, "fallback")
    assert target.tolist() == [[False, False, True, True], [True, False, False, False]]
    rows = fork_rows(target, cs)
    assert rows.sample.tolist() == [0, 0, 1] and rows.step.tolist() == [1, 2, 0]
    assert rows.position.tolist() == [2, 3, 0]
    # a fallback step must commit exactly one token
    with pytest.raises(ValueError, match="committed 2 tokens"):
        row_targets(cs, torch.tensor([[True, False, False], [False, False, False]]), "fallback")


def test_fork_grpo_objective_is_a_mean_over_rollouts_of_per_rollout_means():
    # rollout 0 has 2 rows (ratios e^0.1 and e^-0.1), rollout 1 has 1 row (ratio e^0.5), rollout 2 none;
    # A = (1, -1, 0.5), clip 0.2:
    #   rollout 0: (min(1.105, 1.105) + min(0.905, 0.905)) / 2 = (e^0.1 + e^-0.1) / 2
    #   rollout 1: A < 0, rho = 1.6487 > 1.2: min(-1.6487, -1.2) = -1.6487
    # J = (that + (-e^0.5)) / 2 rollouts with rows; loss = -J
    rows = torch.tensor([[True, True, False], [False, True, False], [False, False, False]])
    logp = torch.tensor([[0.1, -0.1, 0.0], [0.0, 0.5, 0.0], [0.0, 0.0, 0.0]])
    cfg = SimpleNamespace(clip=0.2, kl=SimpleNamespace(beta=0.0), scale="group")
    method = ForkGRPO(cfg, SimpleNamespace(), None)
    method.epoch = 0
    batch = RolloutBatch(torch.tensor([0, 0, 1]), [Sample("p", None)] * 3, mask=rows,
                         old_logp=torch.zeros(3, 3), data={"fork_row": rows})
    policy = SimpleNamespace(logprobs=lambda b, iteration: logp)
    out = method.loss(policy, batch, torch.tensor([1.0, -1.0, 0.5]), denom=method.loss_denominator(batch))
    j = ((math.exp(0.1) + math.exp(-0.1)) / 2 - math.exp(0.5)) / 2
    assert method.loss_denominator(batch) == 2.0
    assert float(out.loss) == pytest.approx(-j, rel=1e-5)
