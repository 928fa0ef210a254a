"""The dLLM methods against their authors' public code, each reference formula typed anew here
in a few lines (no file of theirs is copied), on random tensors:

- d1 (dllm-reasoning/d1 at 837888f, diffu-grpo/diffu_grpo_trainer.py): `forward_process` (the
  masked prompt), `_get_per_token_logps`, `compute_loss`, `generate`'s Gumbel draw and
  `get_num_transfer_tokens`, the group advantage of `_generate_and_score_completions`.
- TraceRL (Gen-Verse/dLLM-RL at 10b4fd1): train/rl_llada.py (`collapse_k_unique`, the
  "TraceRL" rows, `forward_process`'s loss), train/rl_sdar.py (`one_round_vectorized`, the
  per-block rows), reward/rl_reward.py (`z_score_normalize`).
- SLIM-RL (laolaorkkkkk/SLIM-RL at 0c4960b): train/utils.py (`get_gdpo_config`,
  `generate_monotonic_pmasks_df`), train/slim_rl_sdar.py (`forward_process`, sequence level).
- ForkGRPO has no public code: its objective is checked against the formula of
  /work/shared/METHODS.md section 5 instead.

Where ours deliberately differs, the test asserts the difference and names the
docs/methods.md line that says so."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dllm_rl.config import DiffuGRPOConfig, ForkGRPOConfig, TraceRLConfig
from dllm_rl.logprob import d1_masked_input, token_logprobs, trace_rows
from dllm_rl.methods.diffu_grpo import DiffuGRPO
from dllm_rl.methods.fork_grpo import ForkGRPO
from dllm_rl.methods.slim_rl import block_mask_rates, quadrature, slim_loss
from dllm_rl.methods.tracerl import TraceRL
from dllm_rl.samplers import _draw, num_transfer_tokens
from mmrl.core.advantages import group_advantages
from mmrl.core.batch import RolloutBatch
from mmrl.core.rewards import AtomScores

MASK = 99


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _fake_policy(logp):
    return SimpleNamespace(logprobs=lambda batch, iteration: logp)


# =================================================================== d1 (diffu-GRPO)


def d1_forward_process(batch, prompt_index, mask_id, p_mask_prompt, random_matrix):
    """diffu_grpo_trainer.py forward_process, with set_seed(seed); torch.rand((b, l)) passed in."""
    is_mask_prompt = prompt_index & (random_matrix < p_mask_prompt)
    is_mask = is_mask_prompt | ~prompt_index  # every completion token masked
    return torch.where(is_mask, mask_id, batch)


def test_d1_masked_prompt_is_d1s_forward_process():
    """Same: the completion fully masked, each prompt token masked where u < p_mask, for the
    same uniforms (ours draws them from a local generator seeded like d1's set_seed)."""
    prompt = torch.randint(0, 50, (3, 7), generator=_gen(0))
    completion = torch.randint(0, 50, (3, 5), generator=_gen(1))
    ours = d1_masked_input(prompt, completion, mask_id=MASK, p_mask=0.3, seed=11)
    u = torch.rand(prompt.shape, generator=_gen(11))  # what d1_masked_input draws for seed 11
    random_matrix = torch.cat([u, torch.rand(completion.shape)], 1)  # completion columns are unread
    index = torch.arange(12) < 7
    theirs = d1_forward_process(torch.cat([prompt, completion], 1), index, MASK, 0.3, random_matrix)
    assert torch.equal(ours, theirs) and (ours[:, :7] == MASK).any()


def test_d1_masks_prompt_padding_and_we_do_not():
    """Differs, documented: docs/methods.md line 501, "each valid prompt token masked with
    probability `p_mask_prompt`" (d1 masks left padding too: dllm_rl/logprob.py's docstring)."""
    prompt = torch.randint(0, 50, (2, 6), generator=_gen(2))
    valid = torch.tensor([[False, False, True, True, True, True]] * 2)
    ours = d1_masked_input(prompt, prompt[:, :3], mask_id=MASK, p_mask=0.999, seed=3, prompt_valid=valid)
    assert torch.equal(ours[:, :2], prompt[:, :2])  # padding kept
    assert (ours[:, 2:6] == MASK).all()
    u = torch.rand(prompt.shape, generator=_gen(3))
    theirs = d1_forward_process(torch.cat([prompt, prompt[:, :3]], 1), torch.arange(9) < 6, MASK, 0.999,
                                torch.cat([u, u[:, :3]], 1))
    assert (theirs[:, :2] == MASK).all()


def test_d1_per_token_logps_are_minus_cross_entropy():
    """_get_per_token_logps: -cross_entropy(logits, targets) at the completion, float32; ours at
    temperature 1 (d1 reads unscaled logits: method.logprob_temperature 1.0, docs/methods.md
    line 459)."""
    logits = 4 * torch.randn(3, 5, 11, generator=_gen(4))
    targets = torch.randint(0, 11, (3, 5), generator=_gen(5))
    theirs = -F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1), reduction="none").view(3, 5)
    torch.testing.assert_close(token_logprobs(logits, targets, 1.0), theirs, rtol=1e-6, atol=1e-6)


def d1_compute_loss(logp, old, ref, adv, mask, *, epsilon, beta):
    """diffu_grpo_trainer.py compute_loss (one micro-batch)."""
    per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon)
    per_token_loss = -torch.min(coef_1 * adv.unsqueeze(1), coef_2 * adv.unsqueeze(1))
    per_token_loss = per_token_loss + beta * per_token_kl
    return (per_token_loss * mask).sum() / mask.sum()


@pytest.mark.parametrize("iteration", [0, 1, 2])
def test_diffu_grpo_loss_is_d1s_compute_loss_with_the_kl_to_the_old_policy(iteration):
    """Same objective, pass k reading the old log-probs of mask seed k (this_itr_idx); the KL
    reference is the pre-update policy instead of d1's frozen base (differs, documented:
    docs/methods.md line 515), so d1's formula is evaluated with ref = old."""
    n, mu, c = 6, 3, 5
    old_mu = -3 * torch.rand(n, mu, c, generator=_gen(6), dtype=torch.float64)
    logp = (old_mu[:, iteration] + 0.5 * torch.randn(n, c, generator=_gen(7), dtype=torch.float64))
    mask = torch.rand(n, c, generator=_gen(8)) < 0.7
    adv = torch.randn(n, generator=_gen(9), dtype=torch.float64)
    batch = RolloutBatch(group_ids=torch.arange(n) // 3, samples=[None] * n, mask=mask, old_logp=old_mu[:, 0])
    batch.data["old_logp_mu"] = old_mu
    method = DiffuGRPO(DiffuGRPOConfig(kl={"beta": 0.04}), None, reward=None)
    method.epoch = iteration
    ours_logp = logp.clone().requires_grad_()
    ours = method.loss(_fake_policy(ours_logp), batch, adv).loss
    theirs_logp = logp.clone().requires_grad_()
    old = old_mu[:, iteration]
    theirs = d1_compute_loss(theirs_logp, old, old, adv, mask.double(), epsilon=0.5, beta=0.04)
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-6, atol=1e-7)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours_logp.grad, theirs_logp.grad, rtol=1e-5, atol=1e-7)


def test_diffu_grpo_advantage_is_d1s_reward_minus_group_mean():
    """_generate_and_score_completions: advantages = rewards - mean_grouped_rewards (the std
    only logged): the default scale none."""
    rewards = torch.rand(12, generator=_gen(10))
    batch = RolloutBatch(group_ids=torch.arange(12) // 4, samples=[None] * 12)
    batch.scores = AtomScores(["answer"], rewards[:, None], rewards)
    theirs = rewards - rewards.view(-1, 4).mean(1).repeat_interleave(4)
    torch.testing.assert_close(DiffuGRPO(DiffuGRPOConfig(), None, reward=None).advantages(batch), theirs)


def test_sampler_gumbel_draw_and_transfer_counts_are_d1s():
    """generate: x0 = argmax(exp(logits) / (-log u)^T) (add_gumbel_noise, float64), the confidence
    softmax(logits)[x0] without temperature; get_num_transfer_tokens: an even split, the
    remainder to the first steps. Ours: argmax(logits / T - log(-log u)), the same argmax."""
    logits = 3 * torch.randn(2, 6, 9, generator=_gen(12), dtype=torch.float64)
    for temperature in (0.5, 0.9, 1.0):
        x0, conf, _ = _draw(logits, temperature, _gen(13))
        noise = torch.rand(logits.shape, dtype=torch.float64, generator=_gen(13))
        theirs = torch.argmax(logits.exp() / (-torch.log(noise)) ** temperature, dim=-1)
        assert torch.equal(x0, theirs)
        torch.testing.assert_close(conf, F.softmax(logits, -1).gather(-1, theirs[..., None])[..., 0])

    mask_num = torch.tensor([[10], [3], [0], [8]])
    steps = 4
    base, remainder = mask_num // steps, mask_num % steps
    theirs = base.expand(-1, steps).clone()
    theirs[torch.arange(steps).unsqueeze(0) < remainder] += 1
    assert torch.equal(num_transfer_tokens(mask_num[:, 0], steps), theirs)


# =================================================================== TraceRL (dLLM-RL)


def collapse_k_unique(lst, k):
    """rl_llada.py / rl_sdar.py: each step -> the last step of its group of k distinct steps."""
    uniq = sorted(set(lst))
    mapping = {val: uniq[min((idx // k + 1) * k - 1, len(uniq) - 1)] for idx, val in enumerate(uniq)}
    return [mapping[x] for x in lst]


def dllm_rl_llada_rows(step_map, k):
    """rl_llada.py, method "TraceRL" (post_num None, nothing after start_pos padded):
    one row per distinct collapsed step v; input masked where order >= v, targets order == v."""
    rows = []
    for b, steps in enumerate(step_map.tolist()):
        order = torch.tensor(collapse_k_unique(steps, k))
        for v in torch.unique(order, sorted=True):
            rows.append((b, tuple((order >= v).tolist()), tuple((order == v).tolist())))
    return rows


def dllm_rl_sdar_rows(step_map, k, block_size):
    """rl_sdar.py, method "TraceRL": collapse within each block, then rounds of
    one_round_vectorized (each block's smallest remaining step is the round's target; the
    input masks, per block, the remaining steps >= it; used positions leave the map)."""
    rows = []
    for b, steps in enumerate(step_map.tolist()):
        for j in range(0, len(steps), block_size):
            steps[j:j + block_size] = collapse_k_unique(steps[j:j + block_size], k)
        blk = torch.tensor(steps).view(-1, block_size)
        while True:
            valid = blk >= 0
            mins = blk.masked_fill(~valid, 10**9).min(1, keepdim=True).values
            target = blk.eq(mins) & valid
            if not target.any():
                break
            rows.append((b, tuple((blk.ge(mins) & valid).view(-1).tolist()), tuple(target.view(-1).tolist())))
            blk = blk.masked_fill(target, -1)
    return rows


def _ours(rows):
    return [(int(b), tuple(m.tolist()), tuple(t.tolist()))
            for b, m, t in zip(rows.sample, rows.input_masked, rows.target)]


@pytest.mark.parametrize("s", [1, 2, 3])
def test_trace_rows_are_dllm_rls_full_attention_rows(s):
    """Same rows (rollout, masked input, targets), in the same order, for random commit-step
    maps with several tokens per step and gaps between steps."""
    step_map = torch.randint(0, 9, (4, 12), generator=_gen(20 + s)) * 2
    assert _ours(trace_rows(step_map, s=s)) == dllm_rl_llada_rows(step_map, s)


@pytest.mark.parametrize("s", [1, 2])
def test_trace_rows_with_blocks_are_dllm_rls_sdar_rows(s):
    """block_length: the SDAR packing's rows, the r-th group of every block in one row."""
    step_map = torch.randint(0, 12, (3, 12), generator=_gen(30 + s))
    assert _ours(trace_rows(step_map, s=s, block_length=4)) == dllm_rl_sdar_rows(step_map, s, 4)


def dllm_rl_loss(logp_rows, old_rows, adv_rows, p_mask, *, eps, beta):
    """rl_llada.py forward_process: per row, the clipped surrogate's mean over its targets, then
    the mean over rows; the k3 KL summed over each row's targets, then the mean over rows."""
    ratio = torch.exp(logp_rows - old_rows)
    clipped = torch.clamp(ratio, 1 - eps, 1 + eps)
    surrogate = torch.min(ratio * adv_rows[:, None], clipped * adv_rows[:, None]) * p_mask
    n_rows = logp_rows.shape[0]
    policy = -((surrogate.sum(1) / p_mask.sum(1).clamp(min=1)).sum() / n_rows)
    kl = logp_rows - old_rows
    kl = ((-kl).exp() - 1.0 + kl) * p_mask
    return policy + beta * kl.sum(1).sum() / n_rows


def _trace_case(step_map, seed):
    n, c = step_map.shape
    rows = trace_rows(step_map, s=1)
    old = -2 * torch.rand(n, c, generator=_gen(seed), dtype=torch.float64)
    logp = old + 0.4 * torch.randn(n, c, generator=_gen(seed + 1), dtype=torch.float64)
    adv = torch.randn(n, generator=_gen(seed + 2), dtype=torch.float64)
    mask = torch.ones(n, c, dtype=torch.bool)
    batch = RolloutBatch(group_ids=torch.zeros(n, dtype=torch.long), samples=[None] * n, mask=mask, old_logp=old)
    theirs = dllm_rl_loss(logp[rows.sample], old[rows.sample], adv[rows.sample], rows.target.double(), eps=0.2,
                          beta=0.0)
    return batch, logp, adv, theirs


def test_tracerl_aggregation_differs_from_dllm_rls_per_row_mean_as_documented():
    """Differs, documented: docs/methods.md lines 463-464 ("a token-level clipped surrogate
    averaged over the mini-batch's answer tokens") and 527; dLLM-RL averages within each row
    (merged step) first, then over rows. The two agree when every row targets as many tokens
    (here: 2 per step), and part otherwise."""
    even = torch.tensor([[0, 0, 1, 1, 2, 2], [1, 0, 1, 0, 2, 2]])
    batch, logp, adv, theirs = _trace_case(even, 40)
    method = TraceRL(TraceRLConfig(kl={"beta": 0.0}), None, reward=None)
    torch.testing.assert_close(method.loss(_fake_policy(logp), batch, adv).loss.double(), theirs, rtol=1e-6,
                               atol=1e-7)
    uneven = torch.tensor([[0, 0, 0, 0, 1, 2], [0, 1, 1, 1, 1, 1]])
    batch, logp, adv, theirs = _trace_case(uneven, 50)
    ours = method.loss(_fake_policy(logp), batch, adv).loss.double()
    assert abs(float(ours - theirs)) > 1e-3


def test_tracerl_kl_is_a_token_mean_not_dllm_rls_per_row_sum():
    """Differs, documented (docs/methods.md line 527, "0.01 k3 KL ... over answer tokens", as the
    surrogate): dLLM-RL sums k3 over each row's targets and averages over rows, so with rows of
    m tokens its KL term is m times a token mean."""
    step_map = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1]])  # rows of 3 tokens
    n, c = step_map.shape
    rows = trace_rows(step_map, s=1)
    old = -torch.rand(n, c, generator=_gen(60), dtype=torch.float64)
    logp = old + 0.3 * torch.randn(n, c, generator=_gen(61), dtype=torch.float64)
    zero = torch.zeros(len(rows.sample), dtype=torch.float64)
    theirs = dllm_rl_loss(logp[rows.sample], old[rows.sample], zero, rows.target.double(), eps=0.2, beta=1.0)
    batch = RolloutBatch(group_ids=torch.zeros(n, dtype=torch.long), samples=[None] * n,
                         mask=torch.ones(n, c, dtype=torch.bool), old_logp=old)
    out = TraceRL(TraceRLConfig(kl={"beta": 1.0}), None, reward=None).loss(_fake_policy(logp), batch, torch.zeros(n))
    assert out.metrics["loss/kl"] == pytest.approx(float(theirs) / 3, rel=1e-6)


def test_tracerl_advantage_uses_the_unbiased_std_not_dllm_rls_population_z_score():
    """Differs, documented: docs/methods.md lines 17 (std_g "unbiased") and 526; dLLM-RL's
    z_score_normalize divides by the population std with no eps: ours is sqrt((G - 1) / G)
    times theirs (up to eps); an all-equal group is 0 in both."""
    g = 8
    correctness = (torch.rand(16, generator=_gen(70)) < 0.5).double()
    correctness[8:] = 1.0
    batch = RolloutBatch(group_ids=torch.arange(16) // g, samples=[None] * 16)
    batch.scores = AtomScores(["answer"], correctness[:, None], correctness)
    ours = TraceRL(TraceRLConfig(), None, reward=None).advantages(batch).double()

    def z_score_normalize(lst):
        mean = sum(lst) / len(lst)
        std = (sum((x - mean) ** 2 for x in lst) / len(lst)) ** 0.5
        return [0 for _ in lst] if std == 0 else [(x - mean) / std for x in lst]

    theirs = torch.tensor(z_score_normalize(correctness[:8].tolist()) + z_score_normalize(correctness[8:].tolist()),
                          dtype=torch.float64)
    torch.testing.assert_close(ours[:8], theirs[:8] * math.sqrt((g - 1) / g), rtol=1e-5, atol=1e-6)
    assert ours[8:].tolist() == theirs[8:].tolist() == [0.0] * 8
    # with the population std (group_advantages' Flow-GRPO flag) and no eps, exactly theirs
    torch.testing.assert_close(group_advantages(correctness, batch.group_ids, eps=0.0, population=True), theirs)


# =================================================================== SLIM-RL


def test_slim_quadrature_and_block_rates_are_slim_rls():
    """get_gdpo_config: leggauss nodes and weights mapped to [0, 1]; generate_monotonic_pmasks_df
    with shape cosine, flipped (mask_increasing False, the config's): the same rates."""
    for n_points in (1, 3, 5):
        x, w = np.polynomial.legendre.leggauss(n_points)
        t, ours_w = quadrature(n_points)
        np.testing.assert_allclose(t.numpy(), 0.5 * (x + 1), rtol=0, atol=1e-15)
        np.testing.assert_allclose(ours_w.numpy(), 0.5 * w, rtol=0, atol=1e-15)
    for t_node in (0.1127, 0.5, 0.8873, 0.03):
        for num_blocks in (1, 2, 5, 16):
            if num_blocks == 1:
                theirs = torch.tensor([t_node], dtype=torch.float64)
            else:
                spread = max(0.0, min(0.2, 2.0 * min(t_node, 1.0 - t_node) - 1e-6))
                x = torch.linspace(0, 1, num_blocks, dtype=torch.float64)
                theirs = (t_node + spread * (0.5 * (1 - torch.cos(np.pi * x)) - 0.5)).flip(0)
            torch.testing.assert_close(block_mask_rates(t_node, num_blocks, 0.2), theirs, rtol=0, atol=1e-12)


def slim_reference_loss(logp, old, p_mask, adv_rows, w_rows, *, clip, beta):
    """slim_rl_sdar.py forward_process, importance_sampling_level "sequence", k3: the clamped
    mean log-ratio per row, w_q * min(s A, clip(s) A) summed over rows / rows; the KL
    exp(clamp(-d, +-10)) - 1 + d summed over the row's masked tokens / L1, w_q-weighted, / rows."""
    n_rows, length = p_mask.shape
    log_ratios = torch.where(p_mask, logp - old, torch.zeros_like(logp))
    mean_log_ratio = (log_ratios.sum(1) / p_mask.sum(1).clamp(min=1)).clamp(-10.0, 10.0)
    ratio = torch.exp(mean_log_ratio)
    surrogate = torch.min(ratio * adv_rows, ratio.clamp(1 - clip, 1 + clip) * adv_rows)
    policy = -(surrogate * w_rows).sum() / n_rows
    d = torch.where(p_mask, logp - old, torch.zeros_like(logp))
    kl = ((-d).clamp(-10.0, 10.0).exp() - 1.0 + d)
    kl_seq = (kl * p_mask).sum(1) / length
    return policy + beta * (kl_seq * w_rows).sum() / n_rows


def test_slim_loss_is_slim_rls_sequence_level_loss_with_its_kl():
    """Same loss and gradient, the KL term included: each row's k3 summed over its masked
    tokens / the answer length, weighted by w_q (fixed 2026-12-07: it was the row's mean, unweighted)."""
    n, q, c = 4, 3, 7
    t, w = quadrature(q)
    mask = torch.rand(n, q, c, generator=_gen(80)) < t.float()[None, :, None]
    mask[..., 0] |= ~mask.any(-1)  # every row masks something, as draw_masks makes sure
    old = -2 * torch.rand(n, q, c, generator=_gen(81), dtype=torch.float64)
    logp = old + 0.3 * torch.randn(n, q, c, generator=_gen(82), dtype=torch.float64)
    adv = torch.randn(n, generator=_gen(83))
    a = logp.clone().requires_grad_()
    ours = slim_loss(a, old, mask, adv, w, clip=0.1, max_log_ratio=10.0, beta=0.5)
    b = logp.clone().requires_grad_()
    theirs = slim_reference_loss(b.reshape(n * q, c), old.reshape(n * q, c), mask.reshape(n * q, c),
                                 adv.double().repeat_interleave(q), w.repeat(n), clip=0.1, beta=0.5)
    torch.testing.assert_close(ours.loss.double(), theirs, rtol=1e-5, atol=1e-6)
    assert ours.metrics["loss/clip_frac"] > 0 and ours.metrics["loss/kl"] > 0
    ours.loss.backward()
    theirs.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


def slim_tau_budget(confidence, mask_index, num_to_transfer, tau, m):
    """SLIM-RL sample/jetengine_ext/engine/scheduler.py, "tau_budget_dynamic", one row."""
    confidence = torch.where(mask_index, confidence, torch.tensor(-np.inf, dtype=confidence.dtype))
    above_conf = confidence[confidence > tau]
    k_budget = 0
    if above_conf.numel() > 0:
        sorted_conf = torch.sort(above_conf, descending=True).values
        k_budget = int((torch.cumsum(1.0 - sorted_conf, 0) <= m * (1.0 - tau)).sum())
    k = min(max(k_budget, num_to_transfer), int(mask_index.sum()))
    out = torch.zeros_like(mask_index)
    out[torch.topk(confidence, k).indices] = True
    return out


def test_tau_budget_commits_are_slim_rls():
    """Same commits: the confident tokens whose summed risk fits m (1 - tau), at least n_s."""
    from dllm_rl.samplers import select_commits

    g = _gen(100)
    conf = 1 - 0.12 * torch.rand(64, 8, generator=g, dtype=torch.float64) ** 2  # many above tau = 0.9
    masked = torch.rand(64, 8, generator=g) < 0.8
    for n_s, m in ((1, 1.0), (2, 1.0), (1, 2.5)):
        ours = select_commits(conf, masked, strategy="tau_budget", num_commit=n_s, tau=0.9, m=m).mask
        theirs = torch.stack([slim_tau_budget(conf[i], masked[i], n_s, 0.9, m) for i in range(64)])
        assert torch.equal(ours, theirs)
        assert (ours.sum(1) > n_s).any()  # the budget did commit more than n_s somewhere


# =================================================================== ForkGRPO (no public code)


def test_fork_grpo_loss_is_the_spec_formula():
    """METHODS.md section 5: J = mean over rollouts with |F_i| > 0 of (1/|F_i|) sum_{t in F_i}
    min(rho A_i, clip(rho, 0.8, 1.2) A_i), loss = -J, beta 0; rollouts without rows count nowhere."""
    n, c = 5, 6
    rows = torch.rand(n, c, generator=_gen(90)) < 0.4
    rows[2] = False  # a rollout without a fallback step
    rows[0, 0] = True
    old = -torch.rand(n, c, generator=_gen(91), dtype=torch.float64)
    logp = old + 0.5 * torch.randn(n, c, generator=_gen(92), dtype=torch.float64)
    adv = torch.randn(n, generator=_gen(93), dtype=torch.float64)
    batch = RolloutBatch(group_ids=torch.zeros(n, dtype=torch.long), samples=[None] * n,
                         mask=torch.ones(n, c, dtype=torch.bool), old_logp=old)
    batch.data["fork_row"] = rows
    ours = ForkGRPO(ForkGRPOConfig(), None, reward=None).loss(_fake_policy(logp), batch, adv).loss
    per_rollout = []
    for i in range(n):
        if rows[i].any():
            rho = torch.exp(logp[i][rows[i]] - old[i][rows[i]])
            per_rollout.append(torch.min(rho * adv[i], rho.clamp(0.8, 1.2) * adv[i]).mean())
    torch.testing.assert_close(ours.double(), -torch.stack(per_rollout).mean(), rtol=1e-6, atol=1e-7)


def test_slim_loss_kl_weights_follow_the_log_probs_device():
    """The KL's w_q (made on the CPU) meet the log-probs on their device, the advantages on the
    CPU (the scheduler's): on a simulated accelerator nothing mixes devices."""
    from simdevice import simulated_device

    _, w = quadrature(3)
    with simulated_device() as sim:
        logp = torch.randn(2, 3, 4).to(sim)
        out = slim_loss(logp, logp - 0.1, torch.ones(2, 3, 4, dtype=torch.bool).to(sim), torch.ones(2), w,
                        clip=0.1, max_log_ratio=10.0, beta=0.5)
        assert out.metrics["loss/kl"] > 0
