"""CPU tests of mmrl.core.advantages: hand-worked values and invariants."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmrl.core.advantages import (
    SCALES,
    atom_advantages,
    batch_across,
    group_advantages,
    group_stats,
    multi_stream_advantages,
    rloo_advantages,
    zero_variance_groups,
)

EPS = 1e-6


def close(actual, expected, atol=1e-5):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


# Shared fixture: non-contiguous, unsorted group labels.
#   group 42: samples 0, 4 -> rewards [10, 6]
#   group 7:  samples 1, 3, 5 -> rewards [1, 2, 3]
#   group -2: sample 2 alone -> reward [5]
REWARDS = torch.tensor([10.0, 1.0, 5.0, 2.0, 6.0, 3.0])
GROUP_IDS = torch.tensor([42, 7, -2, 7, 42, 7])


# --------------------------------------------------------------------------- group_stats


def test_group_stats_hand_values():
    mean, std, count = group_stats(REWARDS, GROUP_IDS)
    # group 42: mean (10 + 6) / 2 = 8; deviations +-2, var = (4 + 4) / (2 - 1) = 8, std = 2.8284
    # group 7:  mean (1 + 2 + 3) / 3 = 2; deviations -1, 0, 1, var = 2 / 2 = 1, std = 1
    # group -2: one sample, mean 5, std defined as 0 (torch.std would give NaN)
    close(mean, [8.0, 2.0, 5.0, 2.0, 8.0, 2.0])
    close(std, [2.828427, 1.0, 0.0, 1.0, 2.828427, 1.0])
    assert count.tolist() == [2, 3, 1, 3, 2, 3]
    assert count.dtype == torch.int64


def test_group_stats_per_column():
    values = torch.tensor([[1.0, 0.0], [3.0, 4.0]])
    mean, std, count = group_stats(values, torch.tensor([5, 5]))
    # column 0: [1, 3] mean 2, std sqrt(2) = 1.41421; column 1: [0, 4] mean 2, std sqrt(8) = 2.82843
    close(mean, [[2.0, 2.0], [2.0, 2.0]])
    close(std, [[1.414214, 2.828427], [1.414214, 2.828427]])
    assert count.tolist() == [2, 2]


# --------------------------------------------------------------------------- group_advantages


def test_group_advantages_grpo_one_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv = group_advantages(rewards, torch.zeros(4, dtype=torch.long))
    # mean 0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std 0.57735 -> A = +-0.5 / 0.57735 = +-0.866025
    close(adv, [0.866025, -0.866025, -0.866025, 0.866025])


def test_group_advantages_scale_group_unsorted_ids():
    adv = group_advantages(REWARDS, GROUP_IDS, scale="group")
    # group 42: (10 - 8) / 2.828427 = +0.707107, (6 - 8) / 2.828427 = -0.707107
    # group 7:  (1 - 2) / 1 = -1, (2 - 2) / 1 = 0, (3 - 2) / 1 = +1
    # group -2: one sample -> 0
    close(adv, [0.707107, -1.0, 0.0, 0.0, -0.707107, 1.0])


def test_group_advantages_scale_none():
    adv = group_advantages(REWARDS, GROUP_IDS, scale="none")
    # Dr.GRPO: only the group mean is subtracted: 10-8, 1-2, 0 (alone), 2-2, 6-8, 3-2
    close(adv, [2.0, -1.0, 0.0, 0.0, -2.0, 1.0])


def test_group_advantages_scale_batch():
    adv = group_advantages(REWARDS, GROUP_IDS, scale="batch")
    # batch: mean 27 / 6 = 4.5; squared deviations 30.25 + 12.25 + 0.25 + 6.25 + 2.25 + 2.25
    # = 53.5; unbiased var 53.5 / 5 = 10.7; std 3.271085.
    # A = (r - group mean) / 3.271085: 2 / 3.271085 = 0.611418, 1 / 3.271085 = 0.305709
    close(adv, [0.611418, -0.305709, 0.0, 0.0, -0.611418, 0.305709])


@pytest.mark.parametrize("scale", SCALES)
def test_group_of_one_gets_zero(scale):
    adv = group_advantages(torch.tensor([3.5]), torch.tensor([9]), scale=scale)
    # one sample: r - mean = 0 exactly, std undefined -> defined as advantage 0
    assert adv.tolist() == [0.0]


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_zero_variance_group_is_exactly_zero(scale, eps):
    # 0.1 is not exact in binary: mean(0.1, 0.1, 0.1) may differ from 0.1 by rounding;
    # the group is still recognised as all-equal and gets exactly 0 (not 1e-8 / 1e-6 noise).
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0])
    adv = group_advantages(rewards, torch.tensor([3, 3, 3, 8, 8]), scale=scale, eps=eps)
    assert torch.isfinite(adv).all()
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    # group 8: [1, 0], mean 0.5, std sqrt(0.5) = 0.707107 -> +-0.5 / 0.707107 = +-0.707107
    # for "batch": batch mean 1.3 / 5 = 0.26; sq. dev 3 * 0.0256 + 0.5476 + 0.0676 = 0.6920;
    # var 0.6920 / 4 = 0.1730; std 0.415933 -> +-0.5 / 0.415933 = +-1.202117; "none": +-0.5
    expected = {"group": 0.707107, "batch": 1.202117, "none": 0.5}[scale]
    close(adv[3:], [expected, -expected])


def test_group_advantages_all_equal_batch_no_nan():
    # every reward equal: batch std is 0 too; no NaN even with eps = 0
    adv = group_advantages(torch.ones(4), torch.tensor([0, 0, 1, 1]), scale="batch", eps=0.0)
    assert adv.tolist() == [0.0] * 4


def test_group_advantages_dtypes():
    ids = torch.tensor([0, 0])
    # [1, 2]: mean 1.5, std sqrt(0.5) = 0.707107 -> -+0.5 / 0.707107 = -+0.707106 (eps)
    half = group_advantages(torch.tensor([1.0, 2.0], dtype=torch.float16), ids)
    assert half.dtype == torch.float16
    close(half.float(), [-0.707106, 0.707106], atol=1e-3)
    ints = group_advantages(torch.tensor([1, 2]), ids)
    assert ints.dtype == torch.float32
    close(ints, [-0.707106, 0.707106])
    f64 = group_advantages(torch.tensor([1.0, 2.0], dtype=torch.float64), ids)
    assert f64.dtype == torch.float64


def test_group_advantages_empty_batch():
    adv = group_advantages(torch.empty(0), torch.empty(0, dtype=torch.long))
    assert adv.shape == (0,)


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="'group', 'batch', 'none'"):
        group_advantages(REWARDS, GROUP_IDS, scale="std")
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(REWARDS, GROUP_IDS[:-1])
    with pytest.raises(ValueError, match=r"\[N\]"):
        group_advantages(REWARDS[:, None], GROUP_IDS)
    with pytest.raises(ValueError, match="integer"):
        group_advantages(REWARDS, GROUP_IDS.float())
    with pytest.raises(ValueError, match="eps"):
        group_advantages(REWARDS, GROUP_IDS, eps=-1.0)


# --------------------------------------------------------------------------- rloo


def test_rloo_hand_values():
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([4, 4, 4, 4]))
    # r = 1: others (0 + 0 + 1) / 3 = 1/3 -> 1 - 1/3 = +0.666667
    # r = 0: others (1 + 0 + 1) / 3 = 2/3 -> 0 - 2/3 = -0.666667
    close(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_rloo_unsorted_ids_and_group_of_one():
    adv = rloo_advantages(REWARDS, GROUP_IDS)
    # group 42 [10, 6]: 10 - 6 = 4, 6 - 10 = -4
    # group 7 [1, 2, 3]: 1 - 2.5 = -1.5, 2 - 2 = 0, 3 - 1.5 = 1.5
    # group -2 (alone): 0
    close(adv, [4.0, -1.5, 0.0, 0.0, -4.0, 1.5])


def test_rloo_matches_leave_one_out_definition():
    rewards = torch.tensor([0.3, 0.9, 0.1, 0.4, 0.8], dtype=torch.float64)
    ids = torch.tensor([1, 1, 1, 2, 2])
    adv = rloo_advantages(rewards, ids)
    expected = []
    for i in range(5):  # the literal definition, loop only in the test
        others = [rewards[j] for j in range(5) if j != i and ids[j] == ids[i]]
        expected.append(float(rewards[i] - sum(others) / len(others)))
    close(adv, expected, atol=1e-12)


# --------------------------------------------------------------------------- atoms / streams

ATOM_SCORES = torch.tensor([[1.0, 0.0], [4.0, 2.0], [3.0, 0.0], [4.0, 6.0]])
ATOM_IDS = torch.tensor([3, 8, 3, 8])


def test_atom_advantages_group():
    adv = atom_advantages(ATOM_SCORES, ATOM_IDS)
    # column 0: group 3 [1, 3] mean 2, std sqrt(2) -> -+1 / 1.414214 = -+0.707107; group 8 [4, 4] -> 0
    # column 1: group 3 [0, 0] -> 0; group 8 [2, 6] mean 4, std sqrt(8) -> -+2 / 2.828427 = -+0.707107
    close(adv, [[-0.707107, 0.0], [0.0, -0.707107], [0.707107, 0.0], [0.0, 0.707107]])


def test_atom_advantages_batch_and_none():
    adv = atom_advantages(ATOM_SCORES, ATOM_IDS, scale="batch")
    # column 0 over the batch [1, 4, 3, 4]: mean 3, sq. dev 4 + 1 + 0 + 1 = 6, var 2, std 1.414214
    #   centred in group: [-1, 0, 1, 0] -> / 1.414214 = [-0.707107, 0, 0.707107, 0]
    # column 1 over the batch [0, 2, 0, 6]: mean 2, sq. dev 4 + 0 + 4 + 16 = 24, var 8, std 2.828427
    #   centred in group: [0, -2, 0, 2] -> / 2.828427 = [0, -0.707107, 0, 0.707107]
    close(adv, [[-0.707107, 0.0], [0.0, -0.707107], [0.707107, 0.0], [0.0, 0.707107]])
    adv_none = atom_advantages(ATOM_SCORES, ATOM_IDS, scale="none")
    # only the group mean removed: column 0 [1-2, 4-4, 3-2, 4-4], column 1 [0-0, 2-4, 0-0, 6-4]
    close(adv_none, [[-1.0, 0.0], [0.0, -2.0], [1.0, 0.0], [0.0, 2.0]])


@pytest.mark.parametrize("scale", SCALES)
def test_atom_advantages_equal_group_advantages_per_column(scale):
    adv = atom_advantages(ATOM_SCORES, ATOM_IDS, scale=scale)
    for k in range(ATOM_SCORES.shape[1]):
        expected = group_advantages(ATOM_SCORES[:, k], ATOM_IDS, scale=scale)
        torch.testing.assert_close(adv[:, k], expected)


def test_atom_advantages_errors():
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        atom_advantages(ATOM_SCORES[:, 0], ATOM_IDS)
    with pytest.raises(ValueError, match="scale"):
        atom_advantages(ATOM_SCORES, ATOM_IDS, scale="atom")


STREAMS = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
STREAM_WEIGHTS = torch.tensor([1.0, 0.5])


def test_multi_stream_normalize_then_sum():
    adv = multi_stream_advantages(STREAMS, torch.zeros(4, dtype=torch.long), STREAM_WEIGHTS)
    # stream 0 [1, 0, 0, 1] -> [+a, -a, -a, +a], stream 1 [0, 0, 1, 1] -> [-a, -a, +a, +a],
    # a = 0.866025 (see test_group_advantages_grpo_one_group).
    # A = 1 * stream0 + 0.5 * stream1 = [0.5a, -1.5a, -0.5a, 1.5a] = [0.433013, -1.299038, ...]
    close(adv, [0.433013, -1.299038, -0.433013, 1.299038])


def test_multi_stream_sum_then_normalize():
    adv = multi_stream_advantages(
        STREAMS, torch.zeros(4, dtype=torch.long), STREAM_WEIGHTS, mode="sum_then_normalize"
    )
    # totals = scores @ [1, 0.5] = [1, 0, 0.5, 1.5]; mean 0.75; deviations [0.25, -0.75, -0.25, 0.75]
    # var = (0.0625 + 0.5625 + 0.0625 + 0.5625) / 3 = 0.416667; std 0.645497
    # A = [0.387298, -1.161895, -0.387298, 1.161895]
    close(adv, [0.387298, -1.161895, -0.387298, 1.161895])


def test_multi_stream_scale_none_and_groups():
    # two groups; scale "none": normalize_then_sum == sum_then_normalize (centring is linear)
    ids = torch.tensor([5, 5, 1, 1])
    a = multi_stream_advantages(STREAMS, ids, STREAM_WEIGHTS, scale="none")
    b = multi_stream_advantages(
        STREAMS, ids, STREAM_WEIGHTS, scale="none", mode="sum_then_normalize"
    )
    # totals [1, 0, 0.5, 1.5]: group 5 mean 0.5 -> [0.5, -0.5]; group 1 mean 1 -> [-0.5, 0.5]
    close(a, [0.5, -0.5, -0.5, 0.5])
    close(b, [0.5, -0.5, -0.5, 0.5])


def test_multi_stream_errors():
    ids = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="normalize_then_sum"):
        multi_stream_advantages(STREAMS, ids, STREAM_WEIGHTS, mode="mean")
    with pytest.raises(ValueError, match="weights"):
        multi_stream_advantages(STREAMS, ids, torch.ones(3))


# --------------------------------------------------------------------------- zero variance


def test_zero_variance_groups():
    zv = zero_variance_groups(
        torch.tensor([1.0, 1.0, 0.0, 2.0, 5.0]), torch.tensor([4, 4, 1, 1, 9])
    )
    # group 4: [1, 1] all equal; group 1: [0, 2] differ; group 9: one sample counts as equal
    assert zv.dtype == torch.bool
    assert zv.tolist() == [True, True, False, False, True]


def test_zero_variance_matches_zero_advantages():
    rewards = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    ids = torch.tensor([10, 10, 20, 20, 30, 30])
    zv = zero_variance_groups(rewards, ids)
    adv = group_advantages(rewards, ids)
    # groups 10 ([0, 0]) and 20 ([1, 1]) carry no signal: dropped by DAPO, advantage 0
    assert zv.tolist() == [True, True, True, True, False, False]
    assert (adv[zv] == 0).all()
    assert (adv[~zv] != 0).all()


# --------------------------------------------------------------------------- properties


@st.composite
def grouped_rewards(draw, max_n=24):
    n = draw(st.integers(1, max_n))
    labels = draw(st.lists(st.integers(-50, 1000), min_size=1, max_size=6, unique=True))
    ids = draw(st.lists(st.sampled_from(labels), min_size=n, max_size=n))
    values = draw(
        st.lists(
            st.one_of(
                st.sampled_from([0.0, 0.5, 1.0]),  # ties, so zero-variance groups happen
                st.floats(-10, 10, allow_nan=False, allow_infinity=False),
            ),
            min_size=n,
            max_size=n,
        )
    )
    return torch.tensor(values, dtype=torch.float64), torch.tensor(ids)


def _group_sums(values: torch.Tensor, ids: torch.Tensor) -> list[float]:
    return [float(values[ids == g].sum()) for g in ids.unique()]


@settings(max_examples=50, deadline=None)
@given(grouped_rewards(), st.sampled_from(SCALES))
def test_property_group_advantages_sum_to_zero_per_group(data, scale):
    rewards, ids = data
    adv = group_advantages(rewards, ids, scale=scale)
    assert torch.isfinite(adv).all()
    for s in _group_sums(adv, ids):
        assert abs(s) < 1e-6


@settings(max_examples=50, deadline=None)
@given(grouped_rewards())
def test_property_rloo_sums_to_zero_per_group(data):
    rewards, ids = data
    adv = rloo_advantages(rewards, ids)
    assert torch.isfinite(adv).all()
    for s in _group_sums(adv, ids):
        assert abs(s) < 1e-9


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(-100, 100, allow_nan=False), min_size=1, max_size=12),
    st.sampled_from(SCALES),
)
def test_property_groups_of_one_get_zero(values, scale):
    rewards = torch.tensor(values)
    ids = torch.arange(len(values)) * 7 - 3  # all distinct, non-contiguous
    assert group_advantages(rewards, ids, scale=scale).abs().max().item() == 0.0
    assert rloo_advantages(rewards, ids).abs().max().item() == 0.0
    assert zero_variance_groups(rewards, ids).all()


@settings(max_examples=50, deadline=None)
@given(grouped_rewards(), st.sampled_from(SCALES))
def test_property_single_atom_modes_agree(data, scale):
    rewards, ids = data
    scores = rewards[:, None]  # K = 1
    weights = torch.ones(1, dtype=torch.float64)
    a = multi_stream_advantages(scores, ids, weights, mode="normalize_then_sum", scale=scale)
    b = multi_stream_advantages(scores, ids, weights, mode="sum_then_normalize", scale=scale)
    torch.testing.assert_close(a, b, atol=1e-9, rtol=0)
    torch.testing.assert_close(a, group_advantages(rewards, ids, scale=scale), atol=1e-9, rtol=0)


@settings(max_examples=50, deadline=None)
@given(grouped_rewards())
def test_property_zero_variance_iff_all_equal(data):
    rewards, ids = data
    zv = zero_variance_groups(rewards, ids)
    for i in range(len(rewards)):
        group = rewards[ids == ids[i]]
        assert bool(zv[i]) == bool((group == group[0]).all())


def test_grpo_advantage_unit_variance_in_group():
    # a sanity invariant: with scale="group" the advantages of a non-degenerate group have
    # unbiased std 1 (up to eps): rewards [2, 4, 9] -> std of A = std / (std + 1e-6)
    adv = group_advantages(
        torch.tensor([2.0, 4.0, 9.0], dtype=torch.float64), torch.tensor([1, 1, 1])
    )
    std = torch.tensor([2.0, 4.0, 9.0], dtype=torch.float64).std().item()
    assert math.isclose(adv.std().item(), std / (std + EPS), rel_tol=1e-12)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_rewards_are_refused_naming_the_entry(bad):
    """One NaN would spread through its group (under batch scale, through every group)."""
    from mmrl.core.advantages import (
        atom_advantages,
        group_advantages,
        multi_stream_advantages,
        rloo_advantages,
        zero_variance_groups,
    )

    r, g = torch.tensor([1.0, bad, 0.0, 1.0]), torch.tensor([0, 0, 1, 1])
    for fn in (group_advantages, rloo_advantages, zero_variance_groups):
        with pytest.raises(ValueError, match=r"rewards must be finite; entry 1 is"):
            fn(r, g)
    scores = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, bad], [0.0, 0.0]])
    with pytest.raises(ValueError, match=r"scores must be finite; entry \(2, 1\) is"):
        atom_advantages(scores, g)
    with pytest.raises(ValueError, match="weights must be finite"):
        multi_stream_advantages(torch.zeros(4, 2), g, torch.tensor([1.0, bad]))
    with pytest.raises(ValueError, match="eps must be >= 0; got nan"):
        group_advantages(torch.ones(4), g, eps=float("nan"))


def test_a_tiny_difference_is_not_an_all_equal_group():
    """Only exactly equal rewards make a zero-variance group: 1e-4 apart still teaches."""
    adv = group_advantages(torch.tensor([0.0, 1e-4]), torch.tensor([0, 0]))
    assert adv[1] > 0 > adv[0]
    assert not zero_variance_groups(torch.tensor([0.0, 1e-4]), torch.tensor([0, 0])).any()


def test_population_std_divides_by_g_as_numpy():
    """population=True: the group std of np.std (ddof 0), for group and per-atom advantages;
    all-equal groups and groups of one stay exactly 0."""
    import numpy as np

    from mmrl.core.advantages import atom_advantages, group_advantages

    r = torch.tensor([0.1, 0.7, 0.3, 0.9, 0.5, 0.5, 2.0], dtype=torch.float64)
    g = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    got = group_advantages(r, g, eps=1e-4, population=True)
    x = r[:4].numpy()
    np.testing.assert_allclose(got[:4].numpy(), (x - x.mean()) / (np.std(x) + 1e-4), rtol=1e-12)
    assert got[4:].tolist() == [0.0, 0.0, 0.0]
    scores = torch.stack([r, 2 * r], 1)
    both = atom_advantages(scores, g, eps=1e-4, population=True)
    torch.testing.assert_close(both[:, 0], got)
    assert not torch.allclose(group_advantages(r, g, eps=1e-4), got)  # the default stays unbiased


def test_batch_scale_across_processes_uses_the_std_of_every_process_rows():
    """Inside batch_across, scale="batch" divides by the unbiased std of every process's rows.
    One process (the sum is the identity): the plain batch std of [1, 3], sqrt(2). A second
    process with the same rows (the sum doubles each partial sum): [1, 3, 1, 3], std sqrt(4/3)."""
    r, g = torch.tensor([1.0, 3.0]), torch.tensor([0, 0])
    close(group_advantages(r, g, scale="batch"), [-1 / math.sqrt(2), 1 / math.sqrt(2)])
    with batch_across(lambda t: t):
        close(group_advantages(r, g, scale="batch"), [-1 / math.sqrt(2), 1 / math.sqrt(2)])
    with batch_across(lambda t: 2 * t):
        close(group_advantages(r, g, scale="batch"), [-math.sqrt(3) / 2, math.sqrt(3) / 2])


def test_batch_scale_adds_eps_to_the_std():
    """scale="batch" divides by (batch std + eps), as "group" does: with eps = 1 the rewards
    [1, 3] (centred -1, 1; std sqrt(2)) give -+1 / (sqrt(2) + 1) = -+(sqrt(2) - 1)."""
    adv = group_advantages(torch.tensor([1.0, 3.0]), torch.tensor([0, 0]), scale="batch", eps=1.0)
    close(adv, [1 - math.sqrt(2), math.sqrt(2) - 1])


def test_float64_statistics_keep_float64_precision():
    """float64 stays float64 (the module's dtype convention): group_stats gives a mean that
    float32 cannot hold (1e8 + 1.5), and rewards 1e-12 apart (one value in float32) are not
    an all-equal group."""
    mean, std, _ = group_stats(torch.tensor([1e8 + 1, 1e8 + 2], dtype=torch.float64), torch.tensor([0, 0]))
    assert mean.dtype == std.dtype == torch.float64 and mean.tolist() == [1e8 + 1.5] * 2
    r = torch.tensor([1.0, 1.0 + 1e-12], dtype=torch.float64)
    assert not zero_variance_groups(r, torch.tensor([0, 0])).any()


def test_rloo_of_an_all_equal_group_is_exactly_zero():
    """RLOO of equal rewards is exactly 0 (the module's convention), not the rounding error of
    the group mean: in float32 the mean of seven rewards 0.9 is not exactly 0.9."""
    adv = rloo_advantages(torch.full((7,), 0.9), torch.zeros(7, dtype=torch.long))
    assert adv.tolist() == [0.0] * 7


def test_atom_batch_scale_across_processes_is_per_column():
    """Inside batch_across (one process: the sum is the identity) every atom column is divided
    by its own batch std: [0, 1, 2] (mean 1, std 1) and [0, 0, 6] (mean 2, std sqrt(12))."""
    scores = torch.tensor([[0.0, 0.0], [1.0, 0.0], [2.0, 6.0]])
    r3 = 1 / math.sqrt(3)  # (-2, -2, 4) / sqrt(12)
    with batch_across(lambda t: t):
        adv = atom_advantages(scores, torch.zeros(3, dtype=torch.long), scale="batch")
    close(adv, [[-1.0, -r3], [0.0, -r3], [1.0, 2 * r3]])


def test_multi_stream_accepts_integer_weights():
    """Weights are cast to the compute dtype, so Python-int weights work: sum_then_normalize of
    [1, 0], [0, 1], [1, 1] with weights [1, 2] normalises the totals [1, 2, 3] to [-1, 0, 1]."""
    scores = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    adv = multi_stream_advantages(scores, torch.zeros(3, dtype=torch.long), [1, 2], mode="sum_then_normalize")
    close(adv, [-1.0, 0.0, 1.0])


def test_multi_stream_eps_comes_from_the_config():
    """advantage.eps reaches the multi_stream advantages as it does type group's: one group of
    two samples whose atom "a" scores 0 and 2 (unbiased std sqrt 2) gives +-1/(sqrt 2 + eps)."""
    from types import SimpleNamespace

    from mmrl.core.config import load_config
    from mmrl.core.grpo import GRPO
    from mmrl.core.rewards import Reward, reward_atom
    from mmrl.vlm.config import VLMTrainConfig

    reward = Reward([reward_atom("a")(lambda s: 0.0), reward_atom("b", weight=0.5)(lambda s: 0.0)])
    batch = SimpleNamespace(scores=SimpleNamespace(values=torch.tensor([[0.0, 1.0], [2.0, 1.0]])),
                            group_ids=torch.tensor([0, 0]))
    for eps in (1e-6, 1.0):
        cfg = load_config(VLMTrainConfig, overrides=["method.advantage.type=multi_stream",
                                                     f"method.advantage.eps={eps}"])
        adv = GRPO(cfg.method, cfg, reward).advantages(batch)
        close(adv, [-1 / (math.sqrt(2) + eps), 1 / (math.sqrt(2) + eps)])


def test_grpo_method_advantages_follow_the_configured_dials():
    """advantage.type, scale, eps and multi_stream's mode reach the estimators, and multi_stream
    weighs each atom by its weight. One group of three samples."""
    from types import SimpleNamespace

    from mmrl.core.config import load_config
    from mmrl.core.grpo import GRPO
    from mmrl.core.rewards import Reward, reward_atom
    from mmrl.vlm.config import VLMTrainConfig

    reward = Reward([reward_atom("a")(lambda s: 0.0), reward_atom("b", weight=0.5)(lambda s: 0.0)])
    # atom a scores 0 2 4, atom b 0 3 3; the weighted total a + 0.5 b is 0 3.5 5.5 (batch.rewards)
    batch = SimpleNamespace(rewards=torch.tensor([0.0, 3.5, 5.5]), group_ids=torch.zeros(3, dtype=torch.long),
                            scores=SimpleNamespace(values=torch.tensor([[0.0, 0.0], [2.0, 3.0], [4.0, 3.0]])))

    def advantages(*overrides):
        cfg = load_config(VLMTrainConfig, overrides=list(overrides))
        return GRPO(cfg.method, cfg, reward).advantages(batch)

    # total: mean 3, r - mean = -3 0.5 2.5, unbiased std sqrt((9 + 0.25 + 6.25) / 2) = sqrt(7.75) = 2.783882
    close(advantages("method.advantage.scale=none"), [-3.0, 0.5, 2.5])  # Dr.GRPO: not divided
    close(advantages("method.advantage.eps=1.0"), [-3 / 3.783882, 0.5 / 3.783882, 2.5 / 3.783882])
    # RLOO: r_i - mean of the others: 0 - 4.5, 3.5 - 2.75, 5.5 - 1.75
    close(advantages("method.advantage.type=rloo"), [-4.5, 0.75, 3.75])
    # multi_stream, sum_then_normalize: the weighted total normalised in its group, as GRPO's
    close(advantages("method.advantage.type=multi_stream", "method.advantage.mode=sum_then_normalize"),
          [-3 / 2.783882, 0.5 / 2.783882, 2.5 / 2.783882])
    # normalize_then_sum: a (std 2) -> -1 0 1; b (mean 2, std sqrt 3) -> (-2 1 1) / 1.732051, times 0.5
    close(advantages("method.advantage.type=multi_stream"),
          [-1 - 1 / 1.732051, 0.5 / 1.732051, 1 + 0.5 / 1.732051])
    # ... with scale none: a - 2 = -2 0 2 plus 0.5 (b - 2) = -1 0.5 0.5
    close(advantages("method.advantage.type=multi_stream", "method.advantage.scale=none"), [-3.0, 0.5, 2.5])


def test_grpo_dynamic_sampling_keeps_only_the_groups_whose_rewards_differ():
    from types import SimpleNamespace

    from mmrl.core.config import load_config
    from mmrl.core.grpo import GRPO
    from mmrl.vlm.config import VLMTrainConfig

    # group 0 all right, group 1 half right, group 2 all wrong
    batch = SimpleNamespace(rewards=torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]),
                            group_ids=torch.tensor([0, 0, 1, 1, 2, 2]))
    cfg = load_config(VLMTrainConfig, overrides=["method.dynamic_sampling.enabled=true"])
    assert GRPO(cfg.method, cfg, None).keep_groups(batch).tolist() == [False, False, True, True, False, False]
    cfg = load_config(VLMTrainConfig)
    assert GRPO(cfg.method, cfg, None).keep_groups(batch) is None  # off: every group trains


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_float32_rewards_whose_squares_overflow_still_get_their_advantages(scale):
    # (4e19)^2 is past float32's 3.4e38: the std read inf and every advantage 0, silently
    ids = torch.zeros(4, dtype=torch.long)
    small = torch.tensor([1.0, 2.0, 3.0, 4.0])
    big = group_advantages(small * 1e19, ids, scale=scale)
    assert big.dtype == torch.float32
    torch.testing.assert_close(big, group_advantages(small, ids, scale=scale))
    atoms = atom_advantages((small * 1e19)[:, None], ids, scale=scale)
    torch.testing.assert_close(atoms[:, 0], group_advantages(small, ids, scale=scale))


def test_rewards_beyond_float64_statistics_are_refused_with_their_size():
    with pytest.raises(ValueError, match=r"too large .* 1e\+200"):
        group_advantages(torch.tensor([1e200, -1e200], dtype=torch.float64), torch.tensor([0, 0]))
