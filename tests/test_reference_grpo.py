"""The GRPO core (mmrl/core/advantages.py, losses.py) against TRL's GRPOTrainer, the
reference the docs cite for these formulas: huggingface/trl trl/trainer/grpo_trainer.py at
f2cd577 (read 2026-12-07), `_generate_and_score_completions` (advantages, scale_rewards,
multi_objective_aggregation) and `_compute_loss` (importance_sampling_level, the clipped
surrogate, beta * k3, loss_type grpo / dr_grpo / dapo). The reference lines below are typed
anew from that code, a few lines each, not copied files. Where ours deliberately differs, the
test asserts the difference and names the docs/methods.md line that says so."""

from __future__ import annotations

import math

import pytest
import torch

from mmrl.core.advantages import group_advantages, multi_stream_advantages, rloo_advantages
from mmrl.core.losses import aggregate, kl_penalty, loss_denominator, policy_loss

G = 4  # completions per prompt


def _std(x: torch.Tensor, dim=None) -> torch.Tensor:  # trl.trainer.utils.nanstd without NaNs: Bessel
    return x.std() if dim is None else x.std(dim=dim)


# ------------------------------------------------------------------ TRL, re-typed


def trl_advantages(rewards, scale="group", eps=1e-4):
    """grpo_trainer.py, multi_objective_aggregation == "sum_then_normalize"."""
    mean = rewards.view(-1, G).mean(dim=1).repeat_interleave(G)
    if scale in ("group", "none"):
        std = _std(rewards.view(-1, G), dim=1).repeat_interleave(G)
    else:  # "batch"
        std = _std(rewards).expand_as(rewards)
    adv = rewards - mean
    return adv if scale == "none" else adv / (std + eps)


def trl_normalize_then_sum(per_func, weights, eps=1e-4):
    """grpo_trainer.py, multi_objective_aggregation == "normalize_then_sum" (GDPO)."""
    k = per_func.shape[1]
    grouped = per_func.view(-1, G, k)
    reward_k = ((grouped - grouped.mean(1, keepdim=True)) / (_std(grouped, dim=1)[:, None] + eps)).view(-1, k)
    rewards = (reward_k * weights).sum(1)
    return (rewards - rewards.mean()) / (_std(rewards) + eps)


def trl_loss(logp, old, ref, adv, mask, *, eps_low, eps_high, beta, loss_type, level="token",
             max_completion_length=None, num_items_in_batch=None):
    """grpo_trainer.py `_compute_loss` (one process, no gradient accumulation)."""
    log_ratio = logp - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    assert loss_type == "dapo"  # the normaliser: the masked tokens of the whole batch, all processes
    return (per_token_loss * mask).sum() / num_items_in_batch.clamp(min=1.0)


# ------------------------------------------------------------------ ours, the way GRPO.loss calls it


OURS = {"grpo": "seq_mean_token_mean", "dr_grpo": "seq_mean_token_sum_norm", "dapo": "token_mean"}


def our_loss(logp, old, ref, adv, mask, *, eps_low, eps_high, beta, loss_type, level="token", max_len=None,
             denom=None):
    aggregation = OURS[loss_type]
    out = policy_loss(logp, old, adv, mask, clip_low=eps_low, clip_high=eps_high, level=level,
                      aggregation=aggregation, max_len=max_len, denom=denom)
    if beta == 0:
        return out.loss
    kl = aggregate(kl_penalty(logp, ref, kind="k3"), mask, aggregation, max_len=max_len, denom=denom)
    return out.loss + beta * kl


def _batch(n=8, t=6, seed=0, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3
    logp = old + spread * torch.randn(n, t, generator=g, dtype=torch.float64)  # ratios 0.5..2: clips bind
    ref = old + 0.3 * torch.randn(n, t, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).double()  # right-padded completions
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return logp, old, ref, adv, mask


# ------------------------------------------------------------------ advantages


@pytest.mark.parametrize("scale", ["group", "none", "batch"])
def test_group_advantages_match_trl_scale_rewards(scale):
    """scale_rewards group / none / batch: the group mean is subtracted in all three; group
    divides by the group's Bessel std, batch by the whole batch's (PPO-Lite), none by nothing.
    Same, given TRL's eps."""
    rewards = torch.randn(12, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ids = torch.arange(12) // G
    ours = group_advantages(rewards, ids, scale=scale, eps=1e-4)
    torch.testing.assert_close(ours, trl_advantages(rewards, scale), rtol=1e-12, atol=1e-12)


def test_group_advantage_eps_is_ours_documented_1e_6_not_trls_1e_4():
    """Differs, documented: docs/methods.md line 32, "A_i = (r_i - mean_g) / (std_g + eps), `eps` 1e-6";
    TRL adds 1e-4. With a small group std the two visibly part; an all-equal group is 0 in both."""
    rewards = torch.tensor([0.0, 0.0, 0.0, 1e-3, 5.0, 5.0, 5.0, 5.0], dtype=torch.float64)
    ids = torch.arange(8) // G
    ours = group_advantages(rewards, ids)  # the default eps
    assert ours[3] / trl_advantages(rewards)[3] == pytest.approx((5e-4 + 1e-4) / (5e-4 + 1e-6), rel=1e-9)
    assert ours[4:].tolist() == trl_advantages(rewards)[4:].tolist() == [0.0] * 4


def test_multi_stream_sum_then_normalize_matches_trl():
    g = torch.Generator().manual_seed(2)
    per_func = torch.rand(8, 3, generator=g, dtype=torch.float64)
    w = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    ours = multi_stream_advantages(per_func, torch.arange(8) // G, w, mode="sum_then_normalize", eps=1e-4)
    torch.testing.assert_close(ours, trl_advantages((per_func * w).sum(1)), rtol=1e-12, atol=1e-12)


def test_multi_stream_normalize_then_sum_skips_trls_batch_renormalisation():
    """Differs, documented: docs/methods.md lines 38-39, "A_i = sum_k w_k groupZ(r_ik)"; TRL (after GDPO)
    then standardises that sum over the whole batch. Ours is TRL's before that last step."""
    g = torch.Generator().manual_seed(3)
    per_func = torch.rand(8, 2, generator=g, dtype=torch.float64)
    w = torch.tensor([1.0, 0.3], dtype=torch.float64)
    ours = multi_stream_advantages(per_func, torch.arange(8) // G, w, mode="normalize_then_sum", eps=1e-4)
    ref = trl_normalize_then_sum(per_func, w)
    assert not torch.allclose(ours, ref)
    torch.testing.assert_close((ours - ours.mean()) / (ours.std() + 1e-4), ref, rtol=1e-10, atol=1e-12)


def test_rloo_matches_trls_leave_one_out_baseline():
    """trl/trainer/rloo_trainer.py: baseline = (group sum - r_i) / (G - 1), A = r - baseline
    (its optional normalize_advantages is off by default)."""
    rewards = torch.randn(8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    grouped = rewards.view(-1, G)
    ref = (grouped - (grouped.sum(1, keepdim=True) - grouped) / (G - 1)).view(-1)
    torch.testing.assert_close(rloo_advantages(rewards, torch.arange(8) // G), ref, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ the loss


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_token_level_loss_and_gradient_match_trl(loss_type, beta):
    """TRL's loss_type grpo / dr_grpo / dapo are our aggregations seq_mean_token_mean /
    seq_mean_token_sum_norm / token_mean, with DAPO's asymmetric clip and beta * k3 to the
    reference added per token: same loss, same gradient."""
    logp, old, ref, adv, mask = _batch()
    kw = {"eps_low": 0.2, "eps_high": 0.28, "beta": beta, "loss_type": loss_type}
    a = logp.clone().requires_grad_()
    b = logp.clone().requires_grad_()
    theirs = trl_loss(a, old, ref, adv, mask, max_completion_length=6, num_items_in_batch=mask.sum(), **kw)
    ours = our_loss(b, old, ref, adv, mask, max_len=6, **kw)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    theirs.backward()
    ours.backward()
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batches_sum_to_trls_accumulated_loss(loss_type):
    """Gradient accumulation: TRL divides each micro-batch's grpo / dr_grpo loss by the number of
    accumulation steps and the dapo one by the whole batch's token count; ours passes the
    mini-batch's loss_denominator to every micro-batch. Equal-sized micro-batches: same sum."""
    logp, old, ref, adv, mask = _batch(n=8, seed=5)
    kw = {"eps_low": 0.2, "eps_high": 0.2, "beta": 0.04, "loss_type": loss_type}
    denom = loss_denominator(mask, OURS[loss_type])
    ours = theirs = 0.0
    for idx in torch.arange(8).split(2):  # 4 accumulation steps
        part = (logp[idx], old[idx], ref[idx], adv[idx], mask[idx])
        t = trl_loss(*part, max_completion_length=6, num_items_in_batch=mask.sum(), **kw)
        theirs += t if loss_type == "dapo" else t / 4
        ours += our_loss(*part, max_len=6, denom=denom, **kw)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


def test_sequence_level_gspo_matches_trl():
    """importance_sampling_level="sequence" (GSPO): one ratio per completion, exp of the masked
    mean log-ratio, clipped at GSPO's 3e-4 / 4e-4, loss_type grpo."""
    logp, old, ref, adv, mask = _batch(seed=6, spread=2e-3)
    kw = {"eps_low": 3e-4, "eps_high": 4e-4, "beta": 0.0, "loss_type": "grpo", "level": "sequence"}
    a = logp.clone().requires_grad_()
    b = logp.clone().requires_grad_()
    theirs = trl_loss(a, old, ref, adv, mask, **kw)
    ours = our_loss(b, old, ref, adv, mask, **kw)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-14)
    theirs.backward()
    ours.backward()
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-8, atol=1e-12)
    assert policy_loss(logp, old, adv, mask, clip_low=3e-4, clip_high=4e-4, level="sequence").metrics[
        "loss/clip_frac"] > 0  # the clip did bind somewhere


def test_on_policy_first_iteration_is_trls_detached_logp():
    """num_iterations = 1: TRL takes old_per_token_logps = per_token_logps.detach(); the ratio is 1
    and the gradient is the plain policy gradient -A grad(logp) / |o| (loss_type grpo)."""
    logp, _, _, adv, mask = _batch(seed=7)
    x = logp.clone().requires_grad_()
    policy_loss(x, x.detach(), adv, mask, aggregation="seq_mean_token_mean").loss.backward()
    expected = -adv[:, None] * mask / mask.sum(1, keepdim=True) / len(adv)
    torch.testing.assert_close(x.grad, expected, rtol=1e-12, atol=1e-14)


def test_k3_matches_trl_and_its_clamp_is_documented():
    """per_token_kl = exp(ref - logp) - (ref - logp) - 1: same. Beyond |logp - ref| = 20 ours
    clamps (differs, documented: mmrl/core/losses.py kl_penalty's docstring, "d is clamped to
    [-max_log_ratio, max_log_ratio] first"; TRL does not clamp)."""
    logp, _, ref, _, _ = _batch(seed=8)
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.exp(ref - logp) - (ref - logp) - 1,
                               rtol=1e-10, atol=1e-14)
    far = torch.tensor([-30.0], dtype=torch.float64)
    assert float(kl_penalty(far, torch.zeros(1, dtype=torch.float64))) == pytest.approx(
        math.expm1(20.0) - 20, rel=1e-12)  # d = -30 read as -20: exp(20) - 20 - 1


def test_ratio_clamp_is_documented_and_trl_has_none():
    """Differs, documented: docs/methods.md line 45, "rho_t = exp(logp_t - old_logp_t) (log-ratio
    clamped to +-20)". Within +-20 the two agree (the tests above); at 25 ours reads e^20."""
    logp = torch.tensor([[25.0]], dtype=torch.float64)
    old = torch.zeros(1, 1, dtype=torch.float64)
    adv = torch.tensor([-1.0], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.float64)
    ours = policy_loss(logp, old, adv, mask, aggregation="seq_mean_token_mean").loss
    theirs = trl_loss(logp, old, old, adv, mask, eps_low=0.2, eps_high=0.2, beta=0.0, loss_type="grpo")
    assert float(ours) == pytest.approx(math.exp(20.0), rel=1e-12)
    assert float(theirs) == pytest.approx(math.exp(25.0), rel=1e-12)
