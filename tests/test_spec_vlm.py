"""The shared GRPO core (mmrl.core) and the VLM methods against the equations of
docs/methods.md sections 1-2, each on a small case whose expected value is worked out by hand
in the comment beside it, independently of the code under test."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mmrl.core.advantages import (
    group_advantages,
    multi_stream_advantages,
    rloo_advantages,
    zero_variance_groups,
)
from mmrl.core.fastrl import AdaptiveGroupSize, jaccard_distance, mdap_counts, ngrams
from mmrl.core.losses import kl_penalty, loss_denominator, policy_loss
from mmrl.vlm.claims import claim_persistence
from mmrl.vlm.dedr import dedr
from mmrl.vlm.methods.cora import CORA, hras_advantages
from mmrl.vlm.methods.dspo import DSPO
from mmrl.vlm.methods.pacg import pacg_gate
from mmrl.vlm.methods.vppo import shape_advantages, visual_dependency

LN = math.log
GIDS = torch.tensor([0, 0, 0, 0])


def close(got, want, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(got).double(), torch.as_tensor(want).double(), atol=atol, rtol=0)


# --------------------------------------------------------------------------- advantages


def test_grpo_divides_by_the_groups_sample_std_and_a_constant_group_gets_0():
    """Group 0 rewards [1, 0, 0, 1]: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735 ->
    +-0.5 / 0.57735 = +-0.866025. Group 1 [2, 2]: std 0 -> exactly 0."""
    adv = group_advantages(torch.tensor([1.0, 0, 0, 1, 2, 2]), torch.tensor([0, 0, 0, 0, 1, 1]))
    close(adv, [0.866025, -0.866025, -0.866025, 0.866025, 0, 0])
    assert adv[4] == 0 and adv[5] == 0


def test_dr_grpo_does_not_divide_and_batch_scale_divides_by_the_batch_std():
    """Rewards [1, 0 | 3, 1]: centred [0.5, -0.5, 1, -1]. Dr.GRPO: that. Batch std of
    [1, 0, 3, 1]: mean 1.25, squared deviations 0.0625 + 1.5625 + 3.0625 + 0.0625 = 4.75,
    / 3 = 1.58333, sqrt 1.258306 -> [0.397360, -0.397360, 0.794719, -0.794719]."""
    r, g = torch.tensor([1.0, 0, 3, 1]), torch.tensor([0, 0, 1, 1])
    close(group_advantages(r, g, scale="none"), [0.5, -0.5, 1, -1])
    close(group_advantages(r, g, scale="batch"), [0.397360, -0.397360, 0.794719, -0.794719])


def test_rloo_is_the_reward_minus_the_mean_of_the_others():
    """[1, 0, 0]: 1 - 0 = 1, 0 - 0.5 = -0.5 (twice). [3, 1]: 3 - 1 = 2, 1 - 3 = -2."""
    close(rloo_advantages(torch.tensor([1.0, 0, 0, 3, 1]), torch.tensor([0, 0, 0, 1, 1])), [1, -0.5, -0.5, 2, -2])


def test_multi_stream_normalize_then_sum_and_sum_then_normalize():
    """Scores [[1, 0], [0, 0], [1, 1], [0, 1]], weights [1, 0.5], one group. Each column's
    z-score is +-0.866025 (as above): column 0 [+, -, +, -], column 1 [-, -, +, +] ->
    normalize_then_sum = [0.433013, -1.299038, 1.299038, -0.433013]. Weighted totals
    [1, 0, 1.5, 0.5]: mean 0.75, sample std sqrt(1.25 / 3) = 0.645497 ->
    sum_then_normalize = [0.387298, -1.161895, 1.161895, -0.387298]."""
    s, w = torch.tensor([[1.0, 0], [0, 0], [1, 1], [0, 1]]), torch.tensor([1.0, 0.5])
    close(multi_stream_advantages(s, GIDS, w), [0.433013, -1.299038, 1.299038, -0.433013])
    close(multi_stream_advantages(s, GIDS, w, mode="sum_then_normalize"), [0.387298, -1.161895, 1.161895, -0.387298])


def test_dapo_drops_groups_whose_rewards_are_all_equal():
    keep = ~zero_variance_groups(torch.tensor([1.0, 1, 0, 1, 0, 0, 5]), torch.tensor([0, 0, 1, 1, 2, 2, 3]))
    assert keep.tolist() == [False, False, True, True, False, False, False]  # a group of one too


# --------------------------------------------------------------------------- losses


# Row 0: rho = [1.5, 1, 0.5], A = +1, three tokens; row 1: rho = [1.5, 0.5, (pad)], A = -1.
LOGP = torch.tensor([[LN(1.5), 0.0, LN(0.5)], [LN(1.5), LN(0.5), 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
ADV = torch.tensor([1.0, -1.0])


def test_token_clip_by_hand_in_the_three_aggregations():
    """-min(rho A, clip(rho, 0.8, 1.2) A) per token: row 0 [-1.2, -1, -0.5] (sum -2.7); row 1
    [1.5, 0.8] (sum 2.3; at rho 1.5 with A < 0 the unclipped -1.5 is the min).
    token_mean (DAPO): (-2.7 + 2.3) / 5 = -0.08. seq_mean_token_mean (GRPO): (-0.9 + 1.15) / 2
    = 0.125. seq_mean_token_sum_norm (Dr.GRPO), max_len 4: (-2.7 / 4 + 2.3 / 4) / 2 = -0.05."""
    old = torch.zeros_like(LOGP)
    out = policy_loss(LOGP, old, ADV, MASK, aggregation="token_mean")
    close(out.per_token, [[-1.2, -1.0, -0.5], [1.5, 0.8, 0.0]])
    close(out.loss, -0.08)
    close(policy_loss(LOGP, old, ADV, MASK, aggregation="seq_mean_token_mean").loss, 0.125)
    close(policy_loss(LOGP, old, ADV, MASK, aggregation="seq_mean_token_sum_norm", max_len=4).loss, -0.05)
    # DAPO's clip-higher: row 0's first token is clipped at 1.28, not 1.2 -> (-2.78 + 2.3) / 5
    close(policy_loss(LOGP, old, ADV, MASK, clip_high=0.28).loss, -0.096)


def test_token_clip_gradient_flows_only_through_unclipped_tokens():
    """token_mean, d loss / d logp_t = -A rho_t / 5 where the unclipped term is the min, else 0:
    row 0 [0 (clipped), -0.2, -0.1]; row 1 [+0.3, 0 (clipped), 0 (pad)]. old_logp and A get none."""
    logp = LOGP.clone().requires_grad_()
    old = torch.zeros_like(LOGP).requires_grad_()
    adv = ADV.clone().requires_grad_()
    policy_loss(logp, old, adv, MASK).loss.backward()
    close(logp.grad, [[0.0, -0.2, -0.1], [0.3, 0.0, 0.0]])
    assert old.grad is None and adv.grad is None


def test_gspo_sequence_ratio_by_hand():
    """log-ratios [0.1, 0.3] -> rho = exp(0.2) = 1.221403 shared by both tokens; clip 3e-4 /
    4e-4: A = +1 -> -min(1.2214, 1.0004) = -1.0004; A = -1 with log-ratios [-0.1, -0.3] ->
    rho = 0.818731, -min(-0.8187, -0.9997) = 0.9997. Near policy (log-ratios [2e-4, 0], rho =
    exp(1e-4)), unclipped: d loss / d logp_t = -A rho / 2 for each of the row's 2 tokens."""
    logp = torch.tensor([[0.1, 0.3], [-0.1, -0.3]])
    mask = torch.ones((2, 2), dtype=torch.bool)
    out = policy_loss(logp, torch.zeros_like(logp), ADV, mask, clip_low=3e-4, clip_high=4e-4, level="sequence",
                      aggregation="seq_mean_token_mean")
    close(out.per_token, [[-1.0004, -1.0004], [0.9997, 0.9997]])
    logp = torch.tensor([[2e-4, 0.0]], requires_grad=True)
    policy_loss(logp, torch.zeros((1, 2)), torch.tensor([1.0]), torch.ones((1, 2), dtype=torch.bool),
                clip_low=3e-4, clip_high=4e-4, level="sequence", aggregation="seq_mean_token_mean").loss.backward()
    close(logp.grad, [[-math.exp(1e-4) / 2] * 2])


def test_kl_estimators_by_hand():
    """d = logp - ref = [0.5, -0.5]: k1 = d; k2 = d^2 / 2 = 0.125; k3 = exp(-d) + d - 1 =
    [e^-0.5 - 0.5, e^0.5 - 1.5] = [0.106531, 0.148721]."""
    logp, ref = torch.tensor([0.5, -0.5]), torch.zeros(2)
    close(kl_penalty(logp, ref, "k1"), [0.5, -0.5])
    close(kl_penalty(logp, ref, "k2"), [0.125, 0.125])
    close(kl_penalty(logp, ref, "k3"), [0.106531, 0.148721])


# --------------------------------------------------------------------------- FastRL


def test_mdap_by_hand():
    """A = [1, 1, 1, -1]; 1-gram sets {a b c}, {a b c}, {x y z}, {a b c}. Set {0, 1, 2}: keep 0,
    drop 1 (theta 0 < 0.8, for 0), keep 2 (theta 1). Set {3}: kept. Counts [2, 0, 1, 1].
    Padded to a multiple of 4: the dropped 1 comes back, counts [1, 1, 1, 1]."""
    assert jaccard_distance(ngrams("abc", 1), ngrams("abd", 1)) == pytest.approx(0.5)  # 1 - 2/4
    seqs = ["abc", "abc", "xyz", "abc"]
    a = torch.tensor([1.0, 1, 1, -1])
    assert mdap_counts(a, seqs, n=1, against="kept").tolist() == [2, 0, 1, 1]
    assert mdap_counts(a, seqs, n=1, against="kept", multiple=4).tolist() == [1, 1, 1, 1]


def test_ars_by_hand():
    """G_1 = 8. Epoch 1 kept [4, 6], boundary at step 50 of 100: alpha 0.5, G'_t = 0.5 * 5 +
    0.5 * 6 = 5.5, G'_ref (first boundary: this epoch) = (5 + 6) / 2 = 5.5, not below -> 8.
    Epoch 2 kept [2, 4], step 80: G'_t = 0.8 * 3 + 0.2 * 4 = 3.2 < G'_ref 5.5 ->
    max(round(8 - 2.3), 2) = 6."""
    ars = AdaptiveGroupSize(8)
    ars.record(4), ars.record(6)
    assert ars.next_size(50, 100) == 8
    ars.record(2), ars.record(4)
    assert ars.next_size(80, 100) == 6


# --------------------------------------------------------------------------- VPPO


def test_vppo_visual_dependency_by_hand():
    """d = logp_aug - logp = ln 2 -> 2 - ln 2 - 1 = 0.306853; d = -ln 2 -> 0.5 + ln 2 - 1 = 0.193147."""
    s = visual_dependency(torch.tensor([[LN(2), -LN(2)]]), torch.zeros((1, 2)), torch.ones((1, 2), dtype=torch.bool))
    close(s, [[0.306853, 0.193147]])


def test_vppo_shaping_filter_and_denominator_by_hand():
    """Mean s per response [0.4, 0.1, 0.2] -> n = [1, 0, 1/3], mean(n) = 4/9, scale = 0.9 + n *
    0.1 / (4/9) = [1.125, 0.9, 0.975] (their mean is 1). Top 40% of 5 tokens = 2 per response:
    row 0 tokens 1, 3; row 1 tokens 1, 4; row 2 tokens 0, 2. A = [1, -1, 2] -> 1.125, -0.9, 1.95
    there, 0 elsewhere. On policy, token_mean over all 15 response tokens (the filtered ones
    still count): -(2 * 1.125 - 2 * 0.9 + 2 * 1.95) / 15 = -0.29."""
    s = torch.tensor([[0.1, 0.9, 0.2, 0.7, 0.1], [0.0, 0.2, 0.1, 0.0, 0.2], [0.3, 0.0, 0.5, 0.1, 0.1]])
    mask = torch.ones((3, 5), dtype=torch.bool)
    adv = shape_advantages(torch.tensor([1.0, -1.0, 2.0]), s, mask)
    want = torch.zeros((3, 5))
    want[0, [1, 3]], want[1, [1, 4]], want[2, [0, 2]] = 1.125, -0.9, 1.95
    close(adv, want)
    logp = torch.zeros((3, 5))
    close(policy_loss(logp, logp, adv, mask, clip_high=0.28).loss, -0.29)


def test_vppo_min_max_reads_only_responses_with_tokens():
    """Responses with mean s [0.6, 0.5] and one without tokens: n = [1, 0] over the two,
    scale = 0.9 + n * 0.1 / 0.5 = [1.1, 0.9]. (Counting the empty one as a mean of 0 stretched
    the range to [0, 0.6]: n = [1, 0.833, 0], scale[0] = 1.064.)"""
    s = torch.tensor([[0.6, 0.6], [0.5, 0.5], [0.0, 0.0]])
    mask = torch.tensor([[True, True], [True, True], [False, False]])
    adv = shape_advantages(torch.ones(3), s, mask, top_frac=1.0)
    close(adv, [[1.1, 1.1], [0.9, 0.9], [0.0, 0.0]])


def test_vppo_a_range_of_rounding_noise_leaves_the_advantages_unscaled():
    """Mean s [0.3, 0.3 + 5e-7]: a spread under VPPO's 1e-6 -> scale 1 for both. (Min-max
    stretched it to n = [0, 1], scale [0.9, 1.1]: rounding noise decided the credit.)"""
    s = torch.tensor([[0.3], [0.3000005]])
    adv = shape_advantages(torch.ones(2), s, torch.ones((2, 1), dtype=torch.bool), top_frac=1.0)
    close(adv, [[1.0], [1.0]], atol=1e-7)


# --------------------------------------------------------------------------- PACG


def test_pacg_persistence_is_the_mean_of_min_1_exp():
    """l' - l = [0.5, -ln 2, 0] -> min(1, .) = [1, 0.5, 1], mean 0.833333."""
    p, index = claim_persistence(torch.zeros((1, 3)), torch.tensor([[0.5, -LN(2), 0.0]]), torch.zeros((1, 3)).long())
    close(p, [0.833333])
    assert index.tolist() == [[0, 0]]


def test_pacg_gate_by_hand_positive_credit_only():
    """Persistence [0.9, 0.5, 0.1 | 0.5, 0.9]: mean 0.58, sample std sqrt(0.448 / 4) = 0.334664,
    z = [0.956183, -0.239046, -1.434274, -0.239046, 0.956183]. z0 = 0.5, eta = 0.5: claims (0, 0)
    and (1, 1) get g = max(0.5, 1 - 0.5 * 0.456183) = 0.771909. Row 0 (A = 2) has its claim 0
    tokens scaled to 1.543818; row 1 (A = -1) is never touched; with eta 5 the gate is g_min 0.5."""
    p = torch.tensor([0.9, 0.5, 0.1, 0.5, 0.9])
    index = torch.tensor([[0, 0], [0, 1], [0, 2], [1, 0], [1, 1]])
    ids = torch.tensor([[0, 0, 1, 2, -1], [0, 1, 1, -1, -1]])
    adv = torch.tensor([[2.0] * 5, [-1.0] * 5])
    out, gates = pacg_gate(adv, p, index, ids, z0=0.5, eta=0.5, g_min=0.5)
    close(gates, [0.771909, 1, 1, 1, 0.771909])
    close(out, [[1.543818, 1.543818, 2, 2, 2], [-1.0] * 5])
    _, gates = pacg_gate(adv, p, index, ids, z0=0.5, eta=5.0, g_min=0.5)
    close(gates, [0.5, 1, 1, 1, 0.5])


# --------------------------------------------------------------------------- CORA


def test_cora_hras_and_beta_warmup_by_hand():
    """One group: task [1, 1, 0, 0] -> z = [+, +, -, -] 0.866025; cons [0.9, 0.1, 0.9, 0.1] ->
    [+, -, +, -] 0.866025. alpha 1, beta 0.2: A = 0.866025 * [1.2, 0.8, -0.8, -1.2] =
    [1.039230, 0.692820, -0.692820, -1.039230]. Consistency all equal in the group: A_cons = 0.
    beta_t = 0.2 * min(1, 5 / 20) = 0.05 at step 5."""
    task = torch.tensor([1.0, 1, 0, 0])
    close(hras_advantages(task, torch.tensor([0.9, 0.1, 0.9, 0.1]), GIDS, alpha=1.0, beta=0.2),
          [1.039230, 0.692820, -0.692820, -1.039230])
    close(hras_advantages(task, torch.full((4,), 0.7), GIDS, alpha=1.0, beta=0.2), [0.866025] * 2 + [-0.866025] * 2)
    stub = SimpleNamespace(cfg=SimpleNamespace(beta=0.2, warmup_steps=20), step=5)
    assert CORA.beta_now(stub) == pytest.approx(0.05)


# --------------------------------------------------------------------------- DSPO


def test_dspo_total_reward_and_dedr_by_hand():
    """R = 1.0 R_acc + 0.1 R_fmt + 0.1 R_cf + 0.3 R_div: format 1, answer 1, R_cf 0.2, R_div 0.5
    -> 1 + 0.1 + 0.02 + 0.15 = 1.27 (the task's uniform-weight diversity atom, 0.4 at weight
    0.3, is replaced). DEDR, z = [[1, 0, 0], [-1, 0, 0]], prior N(0, 1): D_all = 0, D_-k = 1,
    Delta = [1, 1] -> R_div = 1 * sum_k 0.5 (1 - e^(-1 / 0.5)) = 1 - e^-2 = 0.864665."""
    names = ["format", "answer", "diversity"]
    scores = SimpleNamespace(names=names, values=torch.tensor([[1.0, 1.0, 0.4]]))
    batch = SimpleNamespace(rewards=torch.tensor([1.22]), scores=scores,
                            data={"dspo/r_cf": torch.tensor([0.2]), "dspo/r_div": torch.tensor([0.5])})
    stub = SimpleNamespace(cfg=SimpleNamespace(div_weight=0.3, cf_weight=0.1),
                           reward=SimpleNamespace(atoms=[SimpleNamespace(weight=w) for w in (0.1, 1.0, 0.3)]))
    close(DSPO.rewards(stub, batch), [1.27])
    z = [[1.0, 0, 0], [-1.0, 0, 0]]
    assert dedr(z, [0.0] * 3, [1.0] * 3, [0.5, 0.5], tau_ctr=1.0, tau_div=0.5) == pytest.approx(1 - math.exp(-2))


def test_loss_denominator_under_accumulation_is_the_whole_minibatchs():
    """DAPO's token_mean over the mini-batch: 5 trained tokens whatever the split."""
    assert loss_denominator(MASK, "token_mean") == 5
    assert loss_denominator(MASK, "seq_mean_token_mean") == 2
