"""CPU tests of mmrl.core.losses: hand-worked values and invariants."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmrl.core.losses import (
    AGGREGATIONS,
    KL_KINDS,
    LEVELS,
    LossOutput,
    aggregate,
    kl_penalty,
    loss_denominator,
    policy_loss,
)

METRIC_KEYS = {
    "loss/policy",
    "loss/clip_frac",
    "loss/clip_frac_low",
    "loss/clip_frac_high",
    "loss/ratio_mean",
    "loss/ratio_min",
    "loss/ratio_max",
    "loss/approx_kl",
}


def close(actual, expected, atol=1e-5):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


# Hand-worked token-level batch (N = 2, T = 3), clip 0.2 / 0.2.
#   sample 0: A = +1, ratios [1.0, 1.5, 0.9], all three tokens masked
#     t0: -min(1.0 * 1, 1.0 * 1) = -1.0
#     t1: -min(1.5 * 1, clip(1.5) = 1.2 * 1) = -1.2     (clipped high)
#     t2: -min(0.9 * 1, 0.9 * 1) = -0.9
#   sample 1: A = -2, ratios [0.5, 1.0, 2.0], t2 masked out
#     t0: -min(0.5 * -2 = -1.0, clip(0.5) = 0.8 * -2 = -1.6) = 1.6  (clipped low)
#     t1: -min(-2, -2) = 2.0
#     t2: masked (would be -min(-4, -2.4) = 4.0): 0
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.3, -2.0]])
RATIOS = torch.tensor([[1.0, 1.5, 0.9], [0.5, 1.0, 2.0]])
ADV = torch.tensor([1.0, -2.0])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
PER_TOKEN = [[-1.0, -1.2, -0.9], [1.6, 2.0, 0.0]]


def _logp(requires_grad: bool = False) -> torch.Tensor:
    return (OLD + RATIOS.log()).requires_grad_(requires_grad)


# --------------------------------------------------------------------------- policy_loss


def test_policy_loss_token_mean_hand_values():
    out = policy_loss(_logp(), OLD, ADV, MASK)
    assert isinstance(out, LossOutput)
    close(out.per_token, PER_TOKEN)
    # (-1 - 1.2 - 0.9 + 1.6 + 2.0) / 5 masked tokens = 0.5 / 5 = 0.1
    close(out.loss, 0.1)
    assert set(out.metrics) == METRIC_KEYS
    assert all(isinstance(v, float) for v in out.metrics.values())
    m = out.metrics
    assert math.isclose(m["loss/policy"], 0.1, abs_tol=1e-6)
    assert math.isclose(m["loss/clip_frac"], 2 / 5, abs_tol=1e-6)  # s0 t1 and s1 t0
    assert math.isclose(m["loss/clip_frac_high"], 1 / 5, abs_tol=1e-6)  # s0 t1: 1.5 > 1.2, A > 0
    assert math.isclose(m["loss/clip_frac_low"], 1 / 5, abs_tol=1e-6)  # s1 t0: 0.5 < 0.8, A < 0
    # ratios over masked tokens: (1 + 1.5 + 0.9 + 0.5 + 1.0) / 5 = 4.9 / 5 = 0.98 (2.0 excluded)
    assert math.isclose(m["loss/ratio_mean"], 0.98, abs_tol=1e-6)
    assert math.isclose(m["loss/ratio_min"], 0.5, abs_tol=1e-6)
    assert math.isclose(m["loss/ratio_max"], 1.5, abs_tol=1e-6)
    # approx_kl = mean(old - logp) = -mean(log ratio)
    #   = -(0 + ln 1.5 + ln 0.9 + ln 0.5 + 0) / 5 = -(0.405465 - 0.105361 - 0.693147) / 5 = 0.078609
    assert math.isclose(m["loss/approx_kl"], 0.078609, abs_tol=1e-5)


def test_policy_loss_seq_mean_token_mean_hand_values():
    out = policy_loss(_logp(), OLD, ADV, MASK, aggregation="seq_mean_token_mean")
    # sample 0: (-1 - 1.2 - 0.9) / 3 = -1.033333; sample 1: (1.6 + 2.0) / 2 = 1.8
    # mean over samples: (-1.033333 + 1.8) / 2 = 0.383333
    close(out.loss, 0.383333)


def test_policy_loss_seq_mean_token_sum_norm_hand_values():
    out = policy_loss(_logp(), OLD, ADV, MASK, aggregation="seq_mean_token_sum_norm", max_len=4)
    # sample 0: -3.1 / 4 = -0.775; sample 1: 3.6 / 4 = 0.9; mean (-0.775 + 0.9) / 2 = 0.0625
    close(out.loss, 0.0625)


def test_policy_loss_gradient_hand_values():
    logp = _logp(requires_grad=True)
    policy_loss(
        logp, OLD, ADV, MASK, aggregation="seq_mean_token_sum_norm", max_len=4
    ).loss.backward()
    # unclipped token: d/dlogp of -rho * A / max_len / N = -rho * A / 8
    #   s0 t0: -1 * 1 / 8 = -0.125; s0 t2: -0.9 / 8 = -0.1125; s1 t1: -1 * -2 / 8 = 0.25
    # clipped tokens (s0 t1, s1 t0) and the masked token: 0
    close(logp.grad, [[-0.125, 0.0, -0.1125], [0.0, 0.25, 0.0]])


def test_policy_loss_clip_higher():
    out = policy_loss(_logp(), OLD, ADV, MASK, clip_low=0.2, clip_high=0.28)
    # only s0 t1 changes: -min(1.5, 1.28) = -1.28; total -1 - 1.28 - 0.9 + 1.6 + 2 = 0.42; / 5 = 0.084
    close(out.loss, 0.084)
    close(out.per_token[0, 1], -1.28)


def test_policy_loss_token_advantages_2d():
    adv_2d = ADV[:, None].expand(2, 3).clone()
    a = policy_loss(_logp(), OLD, ADV, MASK)
    b = policy_loss(_logp(), OLD, adv_2d, MASK)
    torch.testing.assert_close(a.loss, b.loss)
    # a per-token advantage: make s0 t2's advantage -1: ratio 0.9 with A = -1 -> -min(-0.9, -0.9) = 0.9
    adv_2d[0, 2] = -1.0
    c = policy_loss(_logp(), OLD, adv_2d, MASK)
    # total 0.5 - (-0.9) + 0.9 = 2.3; / 5 = 0.46
    close(c.loss, 0.46)


def test_policy_loss_sequence_level_hand_values():
    old = torch.zeros(2, 3)
    # sample 0: log ratios [0.1, 0.2, 0.3], all masked -> mean 0.2 -> rho = exp(0.2) = 1.221403
    # sample 1: log ratios [-0.3, 0.1, 5.0], t2 masked out -> mean (-0.3 + 0.1) / 2 = -0.1
    #           -> rho = exp(-0.1) = 0.904837 (the 5.0 is ignored)
    logp = torch.tensor([[0.1, 0.2, 0.3], [-0.3, 0.1, 5.0]], requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    out = policy_loss(logp, old, adv, mask, level="sequence")
    # s0: A > 0, 1.221403 > 1.2 -> clipped: -1.2 per token
    # s1: A < 0, 0.904837 inside [0.8, 1.2] -> -(0.904837 * -1) = 0.904837 per token
    close(out.per_token, [[-1.2, -1.2, -1.2], [0.904837, 0.904837, 0.0]])
    # token_mean: (3 * -1.2 + 2 * 0.904837) / 5 = (-3.6 + 1.809675) / 5 = -0.358065
    close(out.loss, -0.358065)
    assert math.isclose(out.metrics["loss/clip_frac"], 3 / 5, abs_tol=1e-6)
    assert math.isclose(out.metrics["loss/clip_frac_high"], 3 / 5, abs_tol=1e-6)
    assert out.metrics["loss/clip_frac_low"] == 0.0
    # ratio_mean over masked tokens: (3 * 1.221403 + 2 * 0.904837) / 5 = 1.094777
    assert math.isclose(out.metrics["loss/ratio_mean"], 1.094777, abs_tol=1e-5)
    out.loss.backward()
    # s0 is clipped -> zero gradient. s1: loss = 2 * (-A * rho) / 5 with rho = exp(mean of 2
    # log-ratios), so d/dlogp_t = 2 * rho / 5 * (1 / 2) = rho / 5 = 0.180967 for t0, t1; t2 masked.
    close(logp.grad, [[0.0, 0.0, 0.0], [0.180967, 0.180967, 0.0]])


def test_policy_loss_empty_sample_no_nan():
    logp = torch.tensor([[-1.0, -2.0], [float("-inf"), float("nan")]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0], [0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])  # float mask; sample 1 has no tokens
    adv = torch.tensor([0.5, 3.0])
    for level in LEVELS:
        for agg in AGGREGATIONS:
            out = policy_loss(logp, old, adv, mask, level=level, aggregation=agg, max_len=2)
            # sample 0 on-policy: per token -0.5; sample 1 contributes 0 (padding garbage ignored)
            # token_mean: -1.0 / 2 = -0.5; seq_mean_token_mean: (-0.5 + 0) / 2 = -0.25;
            # seq_mean_token_sum_norm: (-1.0 / 2 + 0) / 2 = -0.25
            expected = {"token_mean": -0.5}.get(agg, -0.25)
            close(out.loss, expected)
            assert out.per_token[1].tolist() == [0.0, 0.0]
            logp.grad = None
            out.loss.backward()
            assert torch.isfinite(logp.grad).all()


def test_policy_loss_no_tokens_at_all():
    out = policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3))
    assert out.loss.item() == 0.0
    # documented neutral metrics when nothing is masked in
    assert out.metrics["loss/ratio_mean"] == 1.0
    assert out.metrics["loss/ratio_min"] == 1.0
    assert out.metrics["loss/clip_frac"] == 0.0
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_policy_loss_bfloat16_inputs():
    logp = _logp().to(torch.bfloat16).requires_grad_()
    out = policy_loss(logp, OLD.to(torch.bfloat16), ADV, MASK)
    assert out.loss.dtype == torch.float32  # computed in float32
    close(out.loss, 0.1, atol=2e-2)  # bf16 rounding of the log-probs
    out.loss.backward()
    assert logp.grad.dtype == torch.bfloat16


def test_policy_loss_errors():
    logp = _logp()
    with pytest.raises(ValueError, match="'token', 'sequence'"):
        policy_loss(logp, OLD, ADV, MASK, level="seq")
    with pytest.raises(ValueError, match="'token_mean', 'seq_mean_token_mean'"):
        policy_loss(logp, OLD, ADV, MASK, aggregation="mean")
    with pytest.raises(ValueError, match="max_len"):
        policy_loss(logp, OLD, ADV, MASK, aggregation="seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, OLD, torch.ones(3), MASK)
    with pytest.raises(ValueError, match="old_logp"):
        policy_loss(logp, OLD[:, :2], ADV, MASK)
    with pytest.raises(ValueError, match="mask"):
        policy_loss(logp, OLD, ADV, MASK[:, :2])
    for clip_low in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="clip_low and clip_high must be >= 0"):
            policy_loss(logp, OLD, ADV, MASK, clip_low=clip_low)
    policy_loss(logp, OLD, ADV, MASK, clip_low=1.5, clip_high=1.5)  # a lower bound below 0 never binds: allowed
    for bound in (-1.0, 0.0):  # a negative bound clamped every log-ratio to it
        with pytest.raises(ValueError, match="max_log_ratio must be > 0"):
            policy_loss(logp, OLD, ADV, MASK, max_log_ratio=bound)
    assert torch.equal(policy_loss(logp, OLD, ADV.tolist(), MASK).loss, policy_loss(logp, OLD, ADV, MASK).loss)
    with pytest.raises(ValueError, match="denom"):
        policy_loss(logp, OLD, ADV, MASK, denom=0)


# --------------------------------------------------------------------------- dual clip

# Dual-clip batch (N = 2, T = 4), clip 0.2 / 0.2, c = 3:
#   sample 0: A = -2, ratios [4, 2, 0.5, 3]; cap c |A| = 6
#     t0: -min(-8, 1.2 * -2 = -2.4) = 8 > 6: capped to 6 (dual-clipped)
#     t1: -min(-4, -2.4) = 4;  t2: -min(-1, 0.8 * -2 = -1.6) = 1.6
#     t3: -min(-6, -2.4) = 6, equal to the cap: not counted as clipped (strict, as verl)
#   sample 1: A = +1, ratios [5, 1, 0.5, 1], t3 masked out: never capped
#     t0: -min(5, 1.2) = -1.2;  t1: -1;  t2: -min(0.5, 0.8) = -0.5
DC_OLD = torch.tensor([[-1.0, -2.0, -0.5, -1.5], [-0.3, -1.0, -2.0, -0.7]])
DC_RATIOS = torch.tensor([[4.0, 2.0, 0.5, 3.0], [5.0, 1.0, 0.5, 1.0]])
DC_ADV = torch.tensor([-2.0, 1.0])
DC_MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])


def test_dual_clip_caps_a_negative_advantage_at_c_times_its_size_hand_values():
    logp = (DC_OLD + DC_RATIOS.log()).requires_grad_(True)
    out = policy_loss(logp, DC_OLD, DC_ADV, DC_MASK, dual_clip=3.0)
    close(out.per_token, [[6.0, 4.0, 1.6, 6.0], [-1.2, -1.0, -0.5, 0.0]])
    # token_mean: (6 + 4 + 1.6 + 6 - 1.2 - 1 - 0.5) / 7 = 14.9 / 7
    close(out.loss, 14.9 / 7)
    assert set(out.metrics) == METRIC_KEYS | {"loss/dual_clip_frac"}
    assert math.isclose(out.metrics["loss/dual_clip_frac"], 1 / 7, abs_tol=1e-6)  # s0 t0 only
    out.loss.backward()
    # d/dlogp of -rho A / 7 where unclipped: s0 t1 -2 * -2 / 7, s0 t3 -3 * -2 / 7, s1 t1 -1 / 7;
    # the capped s0 t0 (a constant), the PPO-clipped s0 t2 and s1 t0, s1 t2 (0.5 < 0.8, A > 0:
    # unclipped, -0.5 / 7) and the masked s1 t3
    close(logp.grad, [[0.0, 4 / 7, 0.0, 6 / 7], [0.0, -1 / 7, -0.5 / 7, 0.0]])
    # verl's compute_policy_loss (vanilla) re-typed: max of the two PPO losses, then for A < 0
    # the min with -A c
    a, r = DC_ADV[:, None], DC_RATIOS
    ppo = torch.maximum(-a * r, -a * r.clamp(0.8, 1.2))
    verl = torch.where(a < 0, torch.minimum(ppo, -a * 3.0), ppo) * DC_MASK
    close(out.per_token.detach(), verl)
    # TRL's two-sided clip, delta = c (>= 1 + clip_high): the unclipped term's ratio capped at delta
    trl = -torch.minimum(r.clamp(max=3.0) * a, r.clamp(0.8, 1.2) * a) * DC_MASK
    close(out.per_token.detach(), trl)


def test_dual_clip_off_is_bit_identical_to_the_plain_clipped_loss():
    """Off (None, the default) the loss, its gradient, per-token values and metric keys are
    today's; a c so large it never binds gives the same numbers too (only the metric added)."""
    logp = (DC_OLD + DC_RATIOS.log()).requires_grad_(True)
    off = policy_loss(logp, DC_OLD, DC_ADV, DC_MASK, aggregation="seq_mean_token_mean")
    (grad_off,) = torch.autograd.grad(off.loss, logp)
    a, r = DC_ADV[:, None], torch.exp(logp - DC_OLD)
    plain = torch.where(DC_MASK != 0, -torch.minimum(r * a, r.clamp(0.8, 1.2) * a), 0.0)  # the loss before
    expected = aggregate(plain, DC_MASK, "seq_mean_token_mean")
    assert torch.equal(off.per_token, plain) and torch.equal(off.loss, expected)
    assert torch.equal(grad_off, torch.autograd.grad(expected, logp)[0])
    assert set(off.metrics) == METRIC_KEYS
    never = policy_loss(logp, DC_OLD, DC_ADV, DC_MASK, aggregation="seq_mean_token_mean", dual_clip=1e6)
    assert torch.equal(never.loss, off.loss) and never.metrics["loss/dual_clip_frac"] == 0.0
    assert {k: v for k, v in never.metrics.items() if k != "loss/dual_clip_frac"} == off.metrics


def test_dual_clip_must_exceed_1():
    """c <= 1 would cap on-policy tokens (rho = 1, loss |A| > c |A|): refused, as verl does."""
    for c in (1.0, 0.5, float("nan")):
        with pytest.raises(ValueError, match=r"dual_clip must be > 1 \(or None: off\); got"):
            policy_loss(DC_OLD, DC_OLD, DC_ADV, DC_MASK, dual_clip=c)


# --------------------------------------------------------------------------- aggregate


def test_aggregate_hand_values():
    per_token = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, float("nan"), 7.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]]).bool()
    # token_mean: (1 + 2 + 3 + 10) / 4 = 4.0 (the 4, 20, NaN and 7 are masked out)
    close(aggregate(per_token, mask), 4.0)
    # seq_mean_token_mean: ((1 + 2 + 3) / 3 + 10 / 1) / 2 = (2 + 10) / 2 = 6.0
    close(aggregate(per_token, mask, "seq_mean_token_mean"), 6.0)
    # seq_mean_token_sum_norm, max_len 4: (6 / 4 + 10 / 4) / 2 = (1.5 + 2.5) / 2 = 2.0
    close(aggregate(per_token, mask, "seq_mean_token_sum_norm", max_len=4), 2.0)
    # denom overrides the normaliser: token sum 16 / 8 = 2.0; sample sum (2 + 10) / 4 = 3.0
    close(aggregate(per_token, mask, denom=8), 2.0)
    close(aggregate(per_token, mask, "seq_mean_token_mean", denom=4), 3.0)


def test_aggregate_errors():
    x = torch.ones(2, 3)
    with pytest.raises(ValueError, match="seq_mean_token_sum_norm"):
        aggregate(x, x, "sum")
    with pytest.raises(ValueError, match="max_len"):
        aggregate(x, x, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="mask"):
        aggregate(x, torch.ones(2, 2))


def test_loss_denominator():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert loss_denominator(mask, "token_mean") == 3.0  # three masked tokens
    assert loss_denominator(mask, "seq_mean_token_mean") == 3.0  # three samples (rows)
    assert loss_denominator(mask.bool()[:, :1], "seq_mean_token_sum_norm") == 3.0
    assert loss_denominator(torch.zeros(2, 2), "token_mean") == 1.0  # never 0
    with pytest.raises(ValueError, match="aggregation"):
        loss_denominator(mask, "tokens")


# --------------------------------------------------------------------------- kl_penalty


def test_kl_penalty_hand_values():
    ref = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    logp = ref + torch.tensor([0.0, 1.0, -1.0, 0.5])  # d = logp - ref = [0, 1, -1, 0.5]
    close(kl_penalty(logp, ref, "k1"), [0.0, 1.0, -1.0, 0.5])  # d
    close(kl_penalty(logp, ref, "k2"), [0.0, 0.5, 0.5, 0.125])  # d^2 / 2
    # k3 = exp(-d) + d - 1: [1 + 0 - 1, e^-1 + 1 - 1, e + -1 - 1, e^-0.5 + 0.5 - 1]
    #    = [0, 0.367879, 0.718282, 0.106531]
    close(kl_penalty(logp, ref, "k3"), [0.0, 0.367879, 0.718282, 0.106531])
    close(kl_penalty(logp, ref), [0.0, 0.367879, 0.718282, 0.106531])  # default k3


def test_kl_penalty_gradient_and_errors():
    logp = torch.tensor([0.5], requires_grad=True)
    kl_penalty(logp, torch.zeros(1), "k3").sum().backward()
    # d/dd (exp(-d) + d - 1) = 1 - exp(-d) = 1 - e^-0.5 = 0.393469
    close(logp.grad, [0.393469])
    with pytest.raises(ValueError, match="'k1', 'k2', 'k3'"):
        kl_penalty(logp, logp, "k4")
    with pytest.raises(ValueError, match="shape"):
        kl_penalty(torch.zeros(2), torch.zeros(3))


# --------------------------------------------------------------------------- properties


@st.composite
def rollout_batch(draw, max_n=6, max_t=7, spread=2.0):
    """Random (logp, old_logp, advantages [N], mask) with every row holding >= 0 tokens."""
    n = draw(st.integers(1, max_n))
    t = draw(st.integers(1, max_t))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 5
    logp = old + (torch.rand(n, t, generator=g, dtype=torch.float64) - 0.5) * 2 * spread
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, t, generator=g) < draw(st.floats(0.2, 1.0))
    return logp, old, adv, mask


@settings(max_examples=50, deadline=None)
@given(rollout_batch(), st.sampled_from(LEVELS), st.sampled_from(AGGREGATIONS))
def test_property_on_policy_ratio_one_and_loss_is_minus_advantage(batch, level, aggregation):
    _, old, adv, mask = batch
    logp = old.clone()
    out = policy_loss(logp, old, adv, mask, level=level, aggregation=aggregation, max_len=7)
    if mask.any():
        assert out.metrics["loss/ratio_min"] == 1.0
        assert out.metrics["loss/ratio_max"] == 1.0
    assert out.metrics["loss/clip_frac"] == 0.0
    assert out.metrics["loss/approx_kl"] == 0.0
    expected = aggregate(-adv[:, None].expand_as(logp), mask, aggregation, max_len=7)
    torch.testing.assert_close(out.loss, expected, atol=1e-12, rtol=0)


@settings(max_examples=50, deadline=None)
@given(
    rollout_batch(max_n=8),
    st.sampled_from(LEVELS),
    st.sampled_from(AGGREGATIONS),
    st.data(),
)
def test_property_micro_batches_with_denom_sum_to_full_batch(batch, level, aggregation, data):
    logp, old, adv, mask = batch
    n = logp.shape[0]
    cut = data.draw(st.integers(0, n))
    kwargs = {"level": level, "aggregation": aggregation, "max_len": 7}

    full_logp = logp.clone().requires_grad_()
    full = policy_loss(full_logp, old, adv, mask, **kwargs).loss
    full.backward()

    denom = loss_denominator(mask, aggregation)
    micro_logp = logp.clone().requires_grad_()
    total = 0.0
    for sl in (slice(0, cut), slice(cut, n)):  # two micro-batches (one may be empty)
        micro = policy_loss(micro_logp[sl], old[sl], adv[sl], mask[sl], denom=denom, **kwargs)
        micro.loss.backward()
        total = total + micro.loss.detach()
    torch.testing.assert_close(total, full.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(micro_logp.grad, full_logp.grad, atol=1e-12, rtol=0)


@settings(max_examples=50, deadline=None)
@given(rollout_batch(max_n=6), st.sampled_from(LEVELS), st.sampled_from(AGGREGATIONS), st.data())
def test_property_integer_weights_equal_repeated_rows(batch, level, aggregation, data):
    """A sample of weight w counts as w copies of it, in the loss and in loss_denominator;
    weight 0 removes it."""
    logp, old, adv, mask = batch
    n = logp.shape[0]
    w = torch.tensor(data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)), dtype=torch.float32)
    rows = torch.arange(n).repeat_interleave(w.long())
    kwargs = {"level": level, "aggregation": aggregation, "max_len": 7}
    weighted = policy_loss(logp, old, adv, mask, weights=w, **kwargs).loss
    with_denom = policy_loss(logp, old, adv, mask, weights=w, denom=loss_denominator(mask, aggregation, w),
                             **kwargs).loss
    assert bool(torch.isfinite(with_denom))
    if len(rows):
        repeated = policy_loss(logp[rows], old[rows], adv[rows], mask[rows], **kwargs).loss
        torch.testing.assert_close(weighted, repeated, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(with_denom, weighted, atol=1e-10, rtol=1e-10)
        assert loss_denominator(mask, aggregation, w) == loss_denominator(mask[rows], aggregation)


def test_weights_errors():
    x = torch.ones(2, 3)
    with pytest.raises(ValueError, match="weights"):
        aggregate(x, x, weights=torch.ones(3))
    with pytest.raises(ValueError, match="weights"):
        loss_denominator(x, "token_mean", torch.ones(2, 1))
    with pytest.raises(ValueError, match="finite and >= 0"):
        aggregate(x, x, weights=torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="finite and >= 0"):
        loss_denominator(x, "seq_mean_token_mean", torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="finite and >= 0; got inf"):  # the bad value, not the least
        aggregate(x, x, weights=torch.tensor([1.0, float("inf")]))


@settings(max_examples=50, deadline=None)
@given(
    st.floats(0.0, 0.5),  # clip
    st.floats(0.01, 2.0),  # |A|
    st.floats(1e-3, 3.0),  # how far beyond the clip boundary
    st.sampled_from(AGGREGATIONS),
)
def test_property_clipped_tokens_have_zero_gradient(clip, adv_abs, beyond, aggregation):
    old = torch.zeros(2, 2, dtype=torch.float64)
    # token (0, 0): A > 0, rho = 1 + clip + beyond > 1 + clip_high -> clipped, zero gradient
    # token (1, 0): A < 0, rho = (1 - clip) * exp(-beyond) < 1 - clip_low -> clipped, zero gradient
    # tokens (*, 1): on-policy, rho = 1 -> gradient -A * (aggregation weight), nonzero
    logp = torch.tensor(
        [
            [math.log(1 + clip + beyond), 0.0],
            [math.log(1 - clip) - beyond, 0.0],
        ],
        dtype=torch.float64,
        requires_grad=True,
    )
    adv = torch.tensor([adv_abs, -adv_abs], dtype=torch.float64)
    out = policy_loss(
        logp,
        old,
        adv,
        torch.ones(2, 2),
        clip_low=clip,
        clip_high=clip,
        aggregation=aggregation,
        max_len=2,
    )
    out.loss.backward()
    assert logp.grad[0, 0] == 0.0
    assert logp.grad[1, 0] == 0.0
    assert logp.grad[0, 1] < 0 < logp.grad[1, 1]  # -A: lower loss by raising logp when A > 0
    assert out.metrics["loss/clip_frac_high"] == 0.25
    assert out.metrics["loss/clip_frac_low"] == 0.25


@settings(max_examples=50, deadline=None)
@given(rollout_batch(spread=1.0))
def test_property_sequence_ratio_shared_by_tokens(batch):
    logp, old, adv, mask = batch
    # a wide clip range keeps every token unclipped, so per_token = -rho_i * A_i
    out = policy_loss(logp, old, adv, mask, level="sequence", clip_low=0.99, clip_high=1e6)
    for i in range(logp.shape[0]):
        m = mask[i]
        if not m.any():
            continue
        rho = math.exp(float((logp[i] - old[i])[m].mean()))
        values = out.per_token[i][m]
        assert (values == values[0]).all()  # one ratio for all the sample's tokens
        assert math.isclose(float(values[0]), -rho * float(adv[i]), rel_tol=1e-9, abs_tol=1e-12)
        assert (out.per_token[i][~m] == 0).all()


@settings(max_examples=50, deadline=None)
@given(
    rollout_batch(spread=60.0),  # log-ratios up to +-60: exp would overflow float32 unclamped
    st.sampled_from(LEVELS),
    st.sampled_from(AGGREGATIONS),
    st.floats(0.0, 0.5),
    st.floats(0.0, 0.5),
)
def test_property_loss_finite(batch, level, aggregation, clip_low, clip_high):
    logp, old, adv, mask = (x.float() if x.is_floating_point() else x for x in batch)
    logp = logp.requires_grad_()
    out = policy_loss(
        logp,
        old,
        adv * 100,
        mask,
        level=level,
        aggregation=aggregation,
        max_len=7,
        clip_low=clip_low,
        clip_high=clip_high,
    )
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert torch.isfinite(out.per_token).all()
    assert torch.isfinite(logp.grad).all()
    assert all(math.isfinite(v) for v in out.metrics.values())
    assert 0.0 <= out.metrics["loss/clip_frac"] <= 1.0


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(-30, 5, allow_nan=False), min_size=1, max_size=16),
    st.lists(st.floats(-30, 5, allow_nan=False), min_size=1, max_size=16),
)
def test_property_kl_penalty(a, b):
    n = min(len(a), len(b))
    logp, ref = torch.tensor(a[:n]), torch.tensor(b[:n])
    assert (kl_penalty(logp, ref, "k2") >= 0).all()
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    for kind in KL_KINDS:
        assert (kl_penalty(logp, logp.clone(), kind) == 0).all()
        assert (kl_penalty(ref, ref.clone(), kind) == 0).all()


def test_clip_fractions_count_only_the_side_their_advantage_clips():
    """rho below 1 - clip_low counts as clipped low only where A < 0, above 1 + clip_high
    as clipped high only where A > 0: the other sign's tokens are not clipped."""
    ratios = torch.tensor([[0.7, 1.5], [1.5, 0.7]])
    old = torch.zeros(2, 2)
    out = policy_loss(ratios.log(), old, torch.tensor([1.0, -1.0]), torch.ones(2, 2))
    assert math.isclose(out.metrics["loss/clip_frac_high"], 1 / 4, abs_tol=1e-6)  # s0 t1
    assert math.isclose(out.metrics["loss/clip_frac_low"], 1 / 4, abs_tol=1e-6)  # s1 t1
    assert math.isclose(out.metrics["loss/clip_frac"], 2 / 4, abs_tol=1e-6)


# --------------------------------------------------------------------------- edge behaviour


def test_log_ratio_is_clamped_at_max_log_ratio_on_both_sides():
    """logp - old_logp is clamped to [-20, 20] by default before the exponential; another
    bound or None moves or lifts the clamp."""
    old = torch.zeros(1, 2)
    logp = torch.tensor([[30.0, -30.0]])
    adv = torch.tensor([-1.0])
    out = policy_loss(logp, old, adv, torch.ones(1, 2))
    # t0: rho = e^20 (not e^30), A = -1: -min(-e^20, 1.2 * -1) = e^20 = 485165195.4
    # t1: rho = e^-20, A = -1: -min(-e^-20, 0.8 * -1) = 0.8
    assert math.isclose(float(out.per_token[0, 0]), math.exp(20), rel_tol=1e-6)
    assert math.isclose(float(out.per_token[0, 1]), 0.8, rel_tol=1e-6)
    assert math.isclose(out.metrics["loss/ratio_max"], math.exp(20), rel_tol=1e-6)
    assert math.isclose(out.metrics["loss/ratio_min"], math.exp(-20), rel_tol=1e-6)
    five = policy_loss(logp, old, adv, torch.ones(1, 2), max_log_ratio=5.0)
    assert math.isclose(five.metrics["loss/ratio_max"], math.exp(5), rel_tol=1e-6)
    assert math.isclose(five.metrics["loss/ratio_min"], math.exp(-5), rel_tol=1e-6)
    free = policy_loss(logp.double(), old.double(), adv, torch.ones(1, 2), max_log_ratio=None)
    assert math.isclose(free.metrics["loss/ratio_max"], math.exp(30), rel_tol=1e-9)
    assert math.isclose(free.metrics["loss/ratio_min"], math.exp(-30), rel_tol=1e-9)


def test_clip_fractions_ignore_masked_out_tokens_and_zero_advantages():
    # row 0, all masked in: ratios [0.5, 2, 0.5, 2] with A [0, 0, -1, +1]
    #   t0, t1: A = 0, nothing to clip; t2: 0.5 < 0.8 with A < 0 (low); t3: 2 > 1.2 with A > 0 (high)
    # row 1: ratios [0.25, 4, 1, 1] with A [-1, +1, +1, +1]; t0 and t1 (clippable) masked out
    ratios = torch.tensor([[0.5, 2.0, 0.5, 2.0], [0.25, 4.0, 1.0, 1.0]])
    adv = torch.tensor([[0.0, 0.0, -1.0, 1.0], [-1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    out = policy_loss(ratios.log(), torch.zeros(2, 4), adv, mask)
    # per token: row 0 [0, 0, -(0.8 * -1) = 0.8, -1.2]; row 1 [0, 0, -1, -1]
    close(out.per_token, [[0.0, 0.0, 0.8, -1.2], [0.0, 0.0, -1.0, -1.0]])
    close(out.loss, (0.8 - 1.2 - 2.0) / 6)  # 6 masked tokens: -0.4
    m = out.metrics
    assert math.isclose(m["loss/clip_frac_low"], 1 / 6, abs_tol=1e-6)  # row 0 t2 only
    assert math.isclose(m["loss/clip_frac_high"], 1 / 6, abs_tol=1e-6)  # row 0 t3 only
    assert math.isclose(m["loss/clip_frac"], 2 / 6, abs_tol=1e-6)
    # ratio statistics over the 6 masked-in tokens (0.25 and 4 excluded)
    assert math.isclose(m["loss/ratio_min"], 0.5, abs_tol=1e-6)
    assert math.isclose(m["loss/ratio_max"], 2.0, abs_tol=1e-6)
    assert math.isclose(m["loss/ratio_mean"], 7 / 6, abs_tol=1e-6)  # (0.5 + 2 + 0.5 + 2 + 1 + 1) / 6
    assert math.isclose(m["loss/approx_kl"], 0.0, abs_tol=1e-6)  # ln 0.5 + ln 2 + ln 0.5 + ln 2 = 0


def test_clip_fractions_at_zero_clip_width_count_nothing_on_policy():
    # clip range [1, 1]: on-policy ratios equal both bounds, which is not beyond them
    out = policy_loss(torch.zeros(2, 2), torch.zeros(2, 2), torch.tensor([1.0, -1.0]), torch.ones(2, 2),
                      clip_low=0.0, clip_high=0.0)
    assert out.metrics["loss/clip_frac"] == 0.0
    assert out.metrics["loss/clip_frac_low"] == 0.0
    assert out.metrics["loss/clip_frac_high"] == 0.0
    close(out.loss, 0.0)  # (-1 - 1 + 1 + 1) / 4


def test_advantages_and_old_logp_get_no_gradient():
    logp = _logp(requires_grad=True)
    old = OLD.clone().requires_grad_()
    adv = ADV.clone().requires_grad_()
    out = policy_loss(logp, old, adv, MASK)
    out.loss.backward()
    assert old.grad is None
    assert adv.grad is None
    # d/dlogp of the token mean: -rho * A / 5 on unclipped tokens, 0 on clipped and masked ones
    close(logp.grad, [[-0.2, 0.0, -0.18], [0.0, 0.4, 0.0]])


def test_loss_dtype_follows_logp_not_advantages_or_weights():
    logp = _logp().to(torch.bfloat16)
    out = policy_loss(logp, OLD.to(torch.bfloat16), ADV.double(), MASK, weights=torch.ones(2, dtype=torch.float64))
    assert out.loss.dtype == torch.float32
    assert out.per_token.dtype == torch.float32
    out32 = policy_loss(_logp(), OLD, ADV.double(), MASK, weights=torch.ones(2, dtype=torch.float64))
    assert out32.loss.dtype == torch.float32
    close(out32.loss, 0.1)


def test_any_nonzero_mask_entry_counts_whatever_its_sign():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[2.0, -1.0, 0.0], [0.5, 0.0, -3.0]])  # same as [[1, 1, 0], [1, 0, 1]]
    close(aggregate(per_token, mask), 13 / 4)  # (1 + 2 + 4 + 6) / 4
    close(aggregate(per_token, mask, "seq_mean_token_mean"), 3.25)  # ((1 + 2) / 2 + (4 + 6) / 2) / 2
    assert loss_denominator(mask, "token_mean") == 4.0
    a = policy_loss(_logp(), OLD, ADV, torch.tensor([[1.0, -1.0, 1.0], [-2.0, 1.0, 0.0]]))
    b = policy_loss(_logp(), OLD, ADV, MASK)
    torch.testing.assert_close(a.loss, b.loss)
    assert a.metrics == b.metrics


def test_fractional_weights_normalise_by_their_sum():
    per_token = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.ones(2, 2)
    w = torch.tensor([0.25, 0.25])
    # seq_mean_token_mean: (0.25 * 1.5 + 0.25 * 3.5) / (0.25 + 0.25) = 1.25 / 0.5 = 2.5
    close(aggregate(per_token, mask, "seq_mean_token_mean", weights=w), 2.5)
    assert loss_denominator(mask, "seq_mean_token_mean", w) == 0.5
    # seq_mean_token_sum_norm, max_len 4: (0.25 * 3 / 4 + 0.25 * 7 / 4) / 0.5 = 0.625 / 0.5 = 1.25
    close(aggregate(per_token, mask, "seq_mean_token_sum_norm", max_len=4, weights=w), 1.25)
    # token_mean: (0.25 * 3 + 0.25 * 7) / (0.25 * 2 + 0.25 * 2) = 2.5 / 1 = 2.5
    close(aggregate(per_token, mask, weights=w), 2.5)
    assert loss_denominator(mask, "token_mean", w) == 1.0
    # a weighted token count below 1 is divided by as it is: (0.25 * 1 + 0.25 * 2) / (0.25 * 2) = 1.5
    close(aggregate(per_token[:1], mask[:1], weights=w[:1]), 1.5)
    assert loss_denominator(mask[:1], "token_mean", w[:1]) == 0.5
    # integer counts weigh as the same floats: (1 * 1.5 + 2 * 3.5) / 3 = 8.5 / 3
    counts = torch.tensor([1, 2])
    close(aggregate(per_token, mask, "seq_mean_token_mean", weights=counts), 8.5 / 3)
    close(aggregate(per_token, mask, weights=counts), 17 / 6)  # (3 + 2 * 7) / (2 + 2 * 2)


def test_shape_and_bound_errors():
    x = torch.ones(2, 3)
    with pytest.raises(ValueError, match="per_token must have shape"):
        aggregate(torch.ones(3), torch.ones(3))
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_len must be > 0"):
            aggregate(x, x, "seq_mean_token_sum_norm", max_len=bad)
        with pytest.raises(ValueError, match="max_len must be > 0"):
            policy_loss(x, x, torch.ones(2), x, aggregation="seq_mean_token_sum_norm", max_len=bad)
    with pytest.raises(ValueError, match="mask must have shape"):
        loss_denominator(torch.ones(3), "token_mean")
    with pytest.raises(ValueError, match="logp must have shape"):
        policy_loss(torch.zeros(3), torch.zeros(3), torch.ones(3), torch.ones(3))
    for clip_high in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="clip_low and clip_high must be >= 0"):
            policy_loss(x, x, torch.ones(2), x, clip_high=clip_high)


def test_kl_k3_is_clamped_at_max_log_ratio_on_both_sides():
    logp = torch.tensor([30.0, -30.0, 0.5], requires_grad=True)
    ref = torch.zeros(3)
    k3 = kl_penalty(logp, ref)
    k3.sum().backward()
    k3 = k3.detach()
    # d = 30 -> 20: e^-20 + 20 - 1 = 19.000000002; d = -30 -> -20: e^20 - 20 - 1 = 485165174.4
    assert math.isclose(float(k3[0]), 19.0, rel_tol=1e-6)
    assert math.isclose(float(k3[1]), math.exp(20) - 21, rel_tol=1e-6)
    close(k3[2], 0.106531)  # e^-0.5 + 0.5 - 1
    close(logp.grad, [0.0, 0.0, 0.393469])  # beyond the bound: no gradient; 1 - e^-0.5 inside
    free = kl_penalty(logp.detach().double(), ref.double(), max_log_ratio=None)
    assert math.isclose(float(free[0]), 29.0, rel_tol=1e-9)  # e^-30 + 30 - 1
    assert math.isclose(float(free[1]), math.exp(30) - 31, rel_tol=1e-9)
    # k1 and k2 are not clamped
    close(kl_penalty(logp.detach(), ref, "k1"), [30.0, -30.0, 0.5])
    close(kl_penalty(logp.detach(), ref, "k2"), [450.0, 450.0, 0.125])


def test_kl_penalty_computes_in_float32_at_least():
    logp = torch.tensor([0.5, -0.5], dtype=torch.bfloat16)
    ref = torch.zeros(2, dtype=torch.bfloat16)
    for kind in KL_KINDS:
        assert kl_penalty(logp, ref, kind).dtype == torch.float32
    assert kl_penalty(logp.double(), ref.double()).dtype == torch.float64


def test_kl_k3_of_a_tiny_log_ratio_is_its_square_over_two_not_a_rounding_below_zero():
    # d = 1e-4 in float32: exp(-d) - 1 + d rounds to -1.7e-8; expm1(-d) + d gives d^2 / 2 = 5e-9
    k3 = kl_penalty(torch.tensor([1e-4, -1e-4]), torch.zeros(2))
    assert (k3 >= 0).all()
    torch.testing.assert_close(k3, torch.tensor([5e-9, 5e-9]), rtol=1e-3, atol=0)


def test_sequence_level_clip_fractions_count_only_masked_tokens():
    """At sequence level every token of a sample carries its ratio, masked-out ones too: the
    clip fractions still count only the masked-in ones."""
    old = torch.zeros(2, 3)
    # masked-in log-ratios average 0.5 and -0.5 (the 9.0 / -9.0 are masked out)
    logp = torch.tensor([[0.5, 0.5, 9.0], [-0.5, -0.5, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    out = policy_loss(logp, old, torch.tensor([1.0, -1.0]), mask, level="sequence")
    # s0: rho = e^0.5 = 1.648721 > 1.2 with A > 0: -1.2 per token; s1: rho = e^-0.5 = 0.606531 < 0.8
    # with A < 0: -min(-0.606531, -0.8) = 0.8 per token
    close(out.per_token, [[-1.2, -1.2, 0.0], [0.8, 0.8, 0.0]])
    close(out.loss, -0.2)  # (-2.4 + 1.6) / 4
    assert math.isclose(out.metrics["loss/clip_frac_high"], 2 / 4, abs_tol=1e-6)
    assert math.isclose(out.metrics["loss/clip_frac_low"], 2 / 4, abs_tol=1e-6)
    assert math.isclose(out.metrics["loss/clip_frac"], 4 / 4, abs_tol=1e-6)
    assert math.isclose(out.metrics["loss/ratio_max"], math.exp(0.5), rel_tol=1e-6)
    assert math.isclose(out.metrics["loss/ratio_min"], math.exp(-0.5), rel_tol=1e-6)


def test_ratio_extremes_are_over_masked_tokens_only():
    # a masked-out token's ratio is 1 (its log-ratio is zeroed): it must not become the min or max
    mask = torch.tensor([[1, 1, 0]])
    high = policy_loss(torch.tensor([[1.5, 2.0, 1.0]]).log(), torch.zeros(1, 3), torch.ones(1), mask)
    assert math.isclose(high.metrics["loss/ratio_min"], 1.5, rel_tol=1e-6)
    assert math.isclose(high.metrics["loss/ratio_max"], 2.0, rel_tol=1e-6)
    low = policy_loss(torch.tensor([[0.5, 0.9, 1.0]]).log(), torch.zeros(1, 3), torch.ones(1), mask)
    assert math.isclose(low.metrics["loss/ratio_min"], 0.5, rel_tol=1e-6)
    assert math.isclose(low.metrics["loss/ratio_max"], 0.9, rel_tol=1e-6)


def test_kl_penalty_refuses_a_non_positive_max_log_ratio():
    """As policy_loss does: 0 would clamp every d to 0 (the penalty vanishes), -1 every d to -1
    (on-policy k3 = e - 2, not 0)."""
    d = torch.tensor([0.0, 1.0, -1.0])
    for bound in (0.0, -1.0):
        with pytest.raises(ValueError, match="max_log_ratio"):
            kl_penalty(d, torch.zeros(3), max_log_ratio=bound)


def test_aggregate_refuses_an_unknown_aggregation_also_with_max_len():
    # "sum" is not read as Dr.GRPO's seq_mean_token_sum_norm because a max_len came with it
    x = torch.ones(2, 3)
    with pytest.raises(ValueError, match="aggregation must be one of 'token_mean'"):
        aggregate(x, x, "sum", max_len=4)


def test_aggregate_refuses_a_per_token_loss_of_three_dimensions():
    # a mask of the same shape does not make a [N, T, V] loss a per-token one
    with pytest.raises(ValueError, match="per_token must have shape"):
        aggregate(torch.ones(2, 3, 4), torch.ones(2, 3, 4))


def test_an_empty_batch_counts_as_one_sample_and_aggregates_to_zero():
    # no rows: the normaliser is at least 1 (token or sample), so the loss is 0 / 1 = 0, not NaN
    empty = torch.zeros(0, 3)
    for aggregation in AGGREGATIONS:
        assert loss_denominator(empty, aggregation) == 1.0
        assert aggregate(empty, empty, aggregation, max_len=3).item() == 0.0


def test_the_weights_error_names_the_first_bad_weight():
    with pytest.raises(ValueError, match=r"finite and >= 0; got -1\.0"):  # the first, not the least (-5)
        aggregate(torch.ones(2, 3), torch.ones(2, 3), weights=torch.tensor([-1.0, -5.0]))


def test_sample_weights_get_no_gradient():
    # weights are counts (FastRL's), constants of the loss like the advantages
    logp = _logp(requires_grad=True)
    w = torch.tensor([2.0, 1.0], requires_grad=True)
    out = policy_loss(logp, OLD, ADV, MASK, weights=w)
    out.loss.backward()
    assert w.grad is None
    # token_mean with sample 0 counted twice: (2 * -3.1 + 3.6) / (2 * 3 + 2) = -2.6 / 8 = -0.325
    close(out.loss, -0.325)


# --------------------------------------------------------------------------- the GRPO method's loss


def grpo(*overrides):
    """The GRPO family's method for a run config with these overrides; its loss() is given a
    policy whose logprobs() returns a fixed tensor, so no model is built."""
    from mmrl.core.config import load_config
    from mmrl.core.grpo import GRPO
    from mmrl.vlm.config import VLMTrainConfig

    cfg = load_config(VLMTrainConfig, overrides=["rollout.max_new_tokens=8", *overrides])
    return GRPO(cfg.method, cfg, None)


def fake_batch(**fields):
    """What GRPO.loss and loss_denominator read of a RolloutBatch."""
    from types import SimpleNamespace

    return SimpleNamespace(**{"data": {}, "ref_logp": None, **fields})


def method_loss(method, logp, batch, advantages, denom=None):
    from types import SimpleNamespace

    return method.loss(SimpleNamespace(logprobs=lambda b: logp), batch, advantages, denom=denom)


# On-policy (rho = 1) batch: N = 2, T = 2, sample 1's t1 masked out, A = [1, -1], and
# d = logp - ref_logp = [[1, 2], [-1, 9]] (the 9 is masked out).
#   policy per token -A: [[-1, -1], [1, -]]; token sums -2 and 1
#   k2 = d^2 / 2: [[0.5, 2], [0.5, -]]; token sums 2.5 and 0.5
KL_BATCH = {"old_logp": torch.zeros(2, 2), "mask": torch.tensor([[1, 1], [1, 0]]),
            "ref_logp": -torch.tensor([[1.0, 2.0], [-1.0, 9.0]])}
KL_ADV = torch.tensor([1.0, -1.0])


def test_grpo_loss_adds_beta_times_the_configured_kl_aggregated_like_the_policy_term():
    method = grpo("method.kl.beta=0.5", "method.kl.kind=k2", "method.loss.max_len=4",
                  "method.loss.aggregation=seq_mean_token_sum_norm")
    assert method.needs_reference and method.max_len == 4  # loss.max_len, not rollout.max_new_tokens
    out = method_loss(method, torch.zeros(2, 2), fake_batch(**KL_BATCH), KL_ADV)
    # Dr.GRPO, max_len 4: policy (-2 / 4 + 1 / 4) / 2 = -0.125; kl (2.5 / 4 + 0.5 / 4) / 2 = 0.375
    assert math.isclose(out.metrics["loss/policy"], -0.125, abs_tol=1e-6)
    assert math.isclose(out.metrics["loss/kl"], 0.375, abs_tol=1e-6)  # the term, before beta
    close(out.loss, -0.125 + 0.5 * 0.375)  # 0.0625


def test_grpo_loss_max_len_defaults_to_the_token_budget_and_denom_reaches_both_terms():
    method = grpo("method.kl.beta=0.5", "method.kl.kind=k2", "method.loss.aggregation=seq_mean_token_sum_norm")
    assert method.max_len == 8  # rollout.max_new_tokens
    out = method_loss(method, torch.zeros(2, 2), fake_batch(**KL_BATCH), KL_ADV)
    # policy (-2 / 8 + 1 / 8) / 2 = -0.0625; kl (2.5 / 8 + 0.5 / 8) / 2 = 0.1875
    assert math.isclose(out.metrics["loss/policy"], -0.0625, abs_tol=1e-6)
    assert math.isclose(out.metrics["loss/kl"], 0.1875, abs_tol=1e-6)
    # a mini-batch of 4 samples: the sample sums are divided by 4, not by this batch's 2
    out = method_loss(method, torch.zeros(2, 2), fake_batch(**KL_BATCH), KL_ADV, denom=4.0)
    assert math.isclose(out.metrics["loss/policy"], -0.125 / 4, abs_tol=1e-6)  # (-0.25 + 0.125) / 4
    assert math.isclose(out.metrics["loss/kl"], 0.375 / 4, abs_tol=1e-6)  # (0.3125 + 0.0625) / 4
    close(out.loss, -0.125 / 4 + 0.5 * 0.375 / 4)


def test_grpo_loss_sample_weights_count_in_both_terms():
    from mmrl.core.method import SAMPLE_WEIGHT

    method = grpo("method.kl.beta=0.5", "method.kl.kind=k2", "method.loss.max_len=4",
                  "method.loss.aggregation=seq_mean_token_sum_norm")
    batch = fake_batch(**KL_BATCH, data={SAMPLE_WEIGHT: torch.tensor([3.0, 1.0])})
    out = method_loss(method, torch.zeros(2, 2), batch, KL_ADV)
    # sample 0 counts 3 times: policy (3 * -0.5 + 0.25) / 4 = -0.3125; kl (3 * 0.625 + 0.125) / 4 = 0.5
    assert math.isclose(out.metrics["loss/policy"], -0.3125, abs_tol=1e-6)
    assert math.isclose(out.metrics["loss/kl"], 0.5, abs_tol=1e-6)
    assert method.loss_denominator(batch) == 4.0  # 3 + 1 samples


def test_grpo_without_kl_needs_no_reference_and_has_no_kl_term():
    method = grpo()  # kl.beta 0
    assert not method.needs_reference
    out = method_loss(method, torch.zeros(2, 2), fake_batch(**dict(KL_BATCH, ref_logp=None)), KL_ADV)
    assert "loss/kl" not in out.metrics
    # GRPO's seq_mean_token_mean: ((-1 - 1) / 2 + 1 / 1) / 2 = 0
    close(out.loss, 0.0)


def test_grpo_loss_takes_clip_high_and_level_from_the_config():
    # one sample, A = 1, ratios [1.5, 1]: clip 0.2 / 0.28, token_mean
    logp = torch.tensor([[math.log(1.5), 0.0]])
    batch = fake_batch(old_logp=torch.zeros(1, 2), mask=torch.ones(1, 2))
    dapo = grpo("method.loss.clip_high=0.28", "method.loss.aggregation=token_mean")
    # token ratio: -min(1.5, 1.28) and -1: (-1.28 - 1) / 2 = -1.14
    close(method_loss(dapo, logp, batch, torch.ones(1)).loss, -1.14)
    gspo = grpo("method.loss.clip_high=0.28", "method.loss.aggregation=token_mean", "method.loss.level=sequence")
    # sequence ratio exp(ln(1.5) / 2) = sqrt(1.5) = 1.224745 inside [0.8, 1.28]: -1.224745 per token
    close(method_loss(gspo, logp, batch, torch.ones(1)).loss, -1.224745)


def test_grpo_loss_takes_dual_clip_from_the_config():
    """method.loss.dual_clip reaches the loss: one sample, A = -1, ratios [5, 1], c 3:
    -min(-5, -1.2) = 5 capped to 3, and 1: token_mean (3 + 1) / 2 = 2; off, (5 + 1) / 2 = 3."""
    from mmrl.core.config import ConfigError

    logp = torch.tensor([[math.log(5.0), 0.0]])
    batch = fake_batch(old_logp=torch.zeros(1, 2), mask=torch.ones(1, 2))
    on = method_loss(grpo("method.loss.dual_clip=3", "method.loss.aggregation=token_mean"), logp, batch, -torch.ones(1))
    close(on.loss, 2.0)
    assert on.metrics["loss/dual_clip_frac"] == 0.5
    off = method_loss(grpo("method.loss.aggregation=token_mean"), logp, batch, -torch.ones(1))
    close(off.loss, 3.0)
    assert "loss/dual_clip_frac" not in off.metrics
    with pytest.raises(ConfigError, match=r"method\.loss\.dual_clip: Input should be greater than 1"):
        grpo("method.loss.dual_clip=1")
