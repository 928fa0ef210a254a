"""FastRL (mmrl/core/fastrl.py): MDAP's n-gram pruning and ARS's adaptive group size, with
values worked out by hand, then the GRPO method's hooks and runs of the loop on the toy
backend (tests/toy.py): pruning, a group size that changes at an epoch boundary, exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import toy
from runcompare import comparable
from two_ranks import process_group

from mmrl.core.batch import RolloutBatch
from mmrl.core.checkpoint import list_checkpoints
from mmrl.core.config import ConfigError, TrainConfig, load_config
from mmrl.core.fastrl import (
    AdaptiveGroupSize,
    advantage_sets,
    jaccard_distance,
    mdap_counts,
    mdap_keep,
    ngrams,
    sample_advantages,
    sequences_of,
)
from mmrl.core.logging import read_metrics
from mmrl.core.method import SAMPLE_WEIGHT, apply_prune, build_method
from mmrl.core.rewards import Sample, import_python_file
from mmrl.core.trainer import Trainer

T, F = True, False
ROOT = Path(__file__).resolve().parents[1]


def keep_list(*args, **kwargs) -> list[bool]:
    return mdap_keep(*args, **kwargs).tolist()


# ---------------------------------------------------------------------------- n-grams, Jaccard


def test_ngrams():
    assert ngrams([1, 2, 3], 2) == {(1, 2), (2, 3)}
    assert ngrams([1, 2, 3], 1) == {(1,), (2,), (3,)}
    assert ngrams(["a", "b", "a", "b"], 2) == {("a", "b"), ("b", "a")}  # repeats count once
    assert ngrams([7], 2) == {(7,)}  # shorter than n: the whole sequence
    assert ngrams([4, 5], 3) == {(4, 5)}
    assert ngrams([], 2) == set()


def test_jaccard_distance():
    a, b = ngrams([1, 2, 3], 2), ngrams([1, 2, 4], 2)  # {12, 23} vs {12, 24}
    assert jaccard_distance(a, b) == pytest.approx(2 / 3)  # 1 - |{12}| / |{12, 23, 24}|
    assert jaccard_distance(a, a) == 0.0
    assert jaccard_distance(a, {(9, 9)}) == 1.0  # disjoint
    assert jaccard_distance(set(), set()) == 0.0  # two empty completions are the same
    assert jaccard_distance(set(), a) == 1.0
    assert jaccard_distance(a, b) == jaccard_distance(b, a)


# ---------------------------------------------------------------------------- advantage sets


def test_advantage_sets_group_equal_advantages_in_index_order():
    adv = torch.tensor([0.5, -0.5, 0.5, 0.50005, -0.5])  # 0.50005 is within 1e-4 of 0.5
    assert advantage_sets(adv) == [[0, 2, 3], [1, 4]]
    assert advantage_sets(torch.zeros(4)) == [[0, 1, 2, 3]]  # a zero-variance group: one set
    assert advantage_sets(torch.tensor([1.0, 2.0, 3.0])) == [[0], [1], [2]]


def test_advantage_sets_compare_with_the_first_member():
    # 8e-5 is within 1e-4 of 0 (joins); 1.6e-4 is not within 1e-4 of the set's first, 0,
    # though it is within 1e-4 of 8e-5: it starts a set of its own.
    adv = torch.tensor([0.0, 8e-5, 1.6e-4], dtype=torch.float64)
    assert advantage_sets(adv) == [[0, 1], [2]]
    assert advantage_sets(adv, tol=1e-3) == [[0, 1, 2]]


def test_sample_advantages_of_token_level_advantages():
    adv = torch.tensor([[1.0, 3.0, 5.0], [2.0, 2.0, 0.0]])  # [N, T]
    mask = torch.tensor([[T, T, F], [T, F, F]])
    assert sample_advantages(adv, mask).tolist() == [2.0, 2.0]  # (1 + 3) / 2, 2 / 1
    assert sample_advantages(adv).tolist() == pytest.approx([3.0, 4 / 3])  # no mask: every position
    assert sample_advantages(torch.tensor([0.5, -0.5])).tolist() == [0.5, -0.5]


# ---------------------------------------------------------------------------- MDAP


def test_identical_completions_of_one_advantage_keep_one():
    assert keep_list(torch.zeros(4), [[1, 2, 3]] * 4) == [T, F, F, F]


def test_diverse_completions_are_all_kept():
    # bigram sets {12}, {34}, {56}, {78}: pairwise disjoint, theta = 1 >= 0.8
    assert keep_list(torch.zeros(4), [[1, 2], [3, 4], [5, 6], [7, 8]]) == [T, T, T, T]


def test_advantage_sets_are_pruned_independently():
    # two sets {0, 1} (A = 1) and {2, 3} (A = -1); a completion is only compared inside its set
    assert keep_list(torch.tensor([1.0, 1.0, -1.0, -1.0]), [[1, 2, 3]] * 4) == [T, F, T, F]


def test_tau_is_the_similarity_threshold():
    # bigrams {12, 23, 34} vs {12, 23, 35}: theta = 1 - 2/4 = 0.5
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5]]
    assert keep_list(torch.zeros(2), seqs, tau=0.8) == [T, F]  # 0.5 < 0.8: too similar
    assert keep_list(torch.zeros(2), seqs, tau=0.5) == [T, T]  # 0.5 < 0.5 is false: kept
    # trigrams {123, 234} vs {123, 235}: theta = 1 - 1/3 = 2/3, more apart than with bigrams
    assert keep_list(torch.zeros(2), seqs, tau=0.6, n=3) == [T, T]  # 2/3 >= 0.6
    assert keep_list(torch.zeros(2), seqs, tau=0.6, n=2) == [T, F]  # 0.5 < 0.6
    assert keep_list(torch.zeros(2), seqs, tau=0.7, n=3) == [T, F]  # 2/3 < 0.7


def test_only_kept_samples_are_compared():
    # o1 ({23, 34}) is close to o0 ({12, 23}): theta = 1 - 1/3 < 0.8, dropped. o2 ({34, 45})
    # is as close to o1, but o1 was dropped; against the kept o0 it is disjoint: kept.
    assert keep_list(torch.zeros(3), [[1, 2, 3], [2, 3, 4], [3, 4, 5]]) == [T, F, T]


def test_against_seed_compares_only_with_the_highest_abs_advantage_member():
    # the same three as above: o2 is disjoint from o0 but close to o1. Against the seed o0
    # alone, o1 is dropped and o2 kept, as with "kept"; with o1 as the seed (highest |A|),
    # o0 ({12, 23}) and o2 ({34, 45}) are both within theta 2/3 < 0.8 of it: only o1 stays.
    seqs = [[1, 2, 3], [2, 3, 4], [3, 4, 5]]
    assert keep_list(torch.zeros(3), seqs, against="seed") == [T, F, T]
    assert keep_list(torch.tensor([0.5, 0.6, 0.5]), seqs, tol=0.2, against="seed") == [F, T, F]
    assert keep_list(torch.tensor([0.5, 0.6, 0.5]), seqs, tol=0.2) == [T, F, T]  # greedy: o0 first
    # o2 near o1 but not the seed: "kept" drops it (o1 kept), "seed" keeps it (far from o0)
    seqs = [[1, 2, 9], [5, 6, 7], [5, 6, 8]]
    assert keep_list(torch.zeros(3), seqs) == [T, T, F]
    assert keep_list(torch.zeros(3), seqs, against="seed") == [T, T, T]
    with pytest.raises(ValueError, match="against"):
        mdap_keep(torch.zeros(2), [[1], [2]], against="all")


def test_tau_zero_keeps_everything():
    assert keep_list(torch.zeros(4), [[1, 2, 3]] * 4, tau=0.0) == [T, T, T, T]


def test_padding_re_adds_the_dropped_samples_of_highest_abs_advantage():
    adv = torch.tensor([1.0, 1.0, -0.5, -0.5, -0.5, 0.0])  # sets {0, 1}, {2, 3, 4}, {5}
    seqs = [[7, 7]] * 6  # all identical: each set keeps its first -> 0, 2, 5 (3 samples)
    assert keep_list(adv, seqs) == [T, F, T, F, F, T]
    # to 4: the dropped ones are 1 (|A| = 1), 3 and 4 (|A| = 0.5): 1 comes back
    assert keep_list(adv, seqs, multiple=2) == [T, T, T, F, F, T]
    assert keep_list(adv, seqs, multiple=4) == [T, T, T, F, F, T]
    # to 5: 1, then 3 (ties in |A| go to the lower index)
    assert keep_list(adv, seqs, multiple=5) == [T, T, T, T, F, T]
    assert keep_list(adv, seqs, multiple=3) == [T, F, T, F, F, T]  # already a multiple


def test_padding_never_exceeds_the_group():
    seqs = [[1, 2], [1, 2], [3, 4], [5, 6], [7, 8], [9, 10]]  # 5 kept
    assert keep_list(torch.zeros(6), seqs) == [T, F, T, T, T, T]
    assert keep_list(torch.zeros(6), seqs, multiple=4) == [T] * 6  # 8 > 6: all of them


def random_groups(seed: int, count: int = 200):
    """(advantages [G], G token lists, a padding multiple) of random small groups."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(count):
        g = int(torch.randint(1, 10, (1,), generator=gen))
        adv = torch.randint(-1, 2, (g,), generator=gen).float()
        seqs = [torch.randint(0, 3, (int(torch.randint(0, 4, (1,), generator=gen)),), generator=gen).tolist()
                for _ in range(g)]
        yield adv, seqs, int(torch.randint(1, 4, (1,), generator=gen))


def test_mdap_invariants_on_random_groups():
    for adv, seqs, multiple in random_groups(0):
        g = len(seqs)
        keep = mdap_keep(adv, seqs, multiple=multiple)
        assert keep.dtype == torch.bool and keep.shape == (g,)
        for members in advantage_sets(adv):
            assert keep[members].any()  # every set keeps >= 1: its first
            assert keep[members[0]]
        k = int(keep.sum())
        assert k % multiple == 0 or k == g
        assert mdap_keep(adv, seqs, tau=0.0).all()


def test_counts_give_each_kept_rollout_the_near_copies_dropped_for_it():
    assert mdap_counts(torch.zeros(4), [[1, 2, 3]] * 4).tolist() == [4, 0, 0, 0]
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    assert mdap_counts(adv, [[1, 2, 3]] * 4).tolist() == [2, 0, 2, 0]  # one per advantage set
    # bigrams {12, 29}, {56, 67}, {56, 68}, {12, 27}: o2 is 2/3 from o1, o3 2/3 from o0, the
    # rest disjoint. "kept": o0 and o1 stay; a dropped rollout counts toward the kept one
    # it is too close to
    seqs = [[1, 2, 9], [5, 6, 7], [5, 6, 8], [1, 2, 7]]
    assert mdap_counts(torch.zeros(4), seqs).tolist() == [2, 2, 0, 0]
    # "seed": only o0 drops others; o1 and o2 are far from it and stand for themselves
    assert mdap_counts(torch.zeros(4), seqs, against="seed").tolist() == [2, 1, 1, 0]


def test_a_rollout_re_added_by_padding_stands_for_itself():
    adv = torch.tensor([1.0, 1.0, -0.5, -0.5, -0.5, 0.0])  # sets {0, 1}, {2, 3, 4}, {5}
    seqs = [[7, 7]] * 6
    assert mdap_counts(adv, seqs).tolist() == [2, 0, 3, 0, 0, 1]
    assert mdap_counts(adv, seqs, multiple=2).tolist() == [1, 1, 3, 0, 0, 1]  # 1 comes back
    assert mdap_counts(adv, seqs, multiple=5).tolist() == [1, 1, 2, 1, 0, 1]  # then 3


def test_counts_sum_to_the_group_and_agree_with_the_kept_set():
    for adv, seqs, multiple in random_groups(1):
        for against, zero_sets in (("kept", "prune"), ("seed", "prune"), ("seed", "one")):
            kw = {"multiple": multiple, "against": against, "zero_sets": zero_sets}
            counts = mdap_counts(adv, seqs, **kw)
            assert counts.sum() == len(seqs)
            assert torch.equal(counts > 0, mdap_keep(adv, seqs, **kw))
            for members in advantage_sets(adv):  # a rollout stands only for its own set
                assert counts[members].sum() == len(members)


def test_zero_advantage_sets_can_keep_one_rollout():
    adv = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0])
    seqs = [[1, 2], [3, 4], [5, 6], [1, 2], [3, 4]]  # all diverse: "prune" keeps every one
    assert mdap_counts(adv, seqs).tolist() == [1, 1, 1, 1, 1]
    assert mdap_counts(adv, seqs, zero_sets="one").tolist() == [3, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="zero_sets"):
        mdap_counts(adv, seqs, zero_sets="all")


def test_a_set_is_a_zero_set_by_its_first_member():
    """A set's advantage is its first member's (the sets are formed against it): 9e-5 and
    1.8e-4 are one set (9e-5 apart), a zero set since 9e-5 < 1e-4 though 1.8e-4 is not."""
    adv = torch.tensor([9e-5, 1.8e-4], dtype=torch.float64)
    assert mdap_counts(adv, [[1, 2], [3, 4]], zero_sets="one").tolist() == [0, 2]  # seed: highest |A|


def test_sample_advantages_average_in_float32():
    """The per-sample advantage is a float32 mean whatever the input's dtype: (2048 + 1) / 2 =
    1024.5, which float16 cannot hold (its spacing at 1024 is 1)."""
    out = sample_advantages(torch.tensor([[2048.0, 1.0]], dtype=torch.float16))
    assert out.dtype == torch.float32 and out.tolist() == [1024.5]


def test_sample_advantages_of_a_row_without_trained_tokens_is_zero():
    """A row whose mask is all False (an empty completion) averages over no position: 0, not
    0 / 0 = NaN (the token count is clamped to 1), so it still joins an advantage set."""
    adv = torch.tensor([[1.0, 3.0], [5.0, 7.0]])
    mask = torch.tensor([[T, T], [F, F]])
    assert sample_advantages(adv, mask).tolist() == [2.0, 0.0]


def test_mdap_thresholds_are_strict():
    """|A_i - A_j| < tol, |A| < tol (a zero set) and theta < tau are strict (the spec's "<"):
    a value exactly at the threshold is not equal / zero / too similar (0.5 is exact in binary)."""
    assert advantage_sets(torch.tensor([0.0, 0.5]), tol=0.5) == [[0], [1]]
    # the set {0.5, 0.5} is not a zero set at tol = 0.5: its two disjoint rollouts both stay
    assert mdap_counts(torch.tensor([0.5, 0.5]), [[1, 2], [3, 4]], tol=0.5, zero_sets="one").tolist() == [1, 1]
    # bigrams {12, 23, 34} vs {12, 23, 35}: theta = 1 - 2/4 = 0.5, not < 0.5, against the seed too
    assert keep_list(torch.zeros(2), [[1, 2, 3, 4], [1, 2, 3, 5]], tau=0.5, against="seed") == [T, T]


def test_zero_sets_one_collapses_only_the_zero_set_to_its_seed_and_pads_it():
    """zero_sets="one": only a set within tol of 0 keeps just its seed, the member of highest
    |A| (not the first); a negative set is pruned like any other; the kept count is then
    padded to `multiple` like any other."""
    seqs = [[1, 2], [3, 4]]  # disjoint: "prune" keeps both
    assert mdap_counts(torch.tensor([-1.0, -1.0]), seqs, zero_sets="one").tolist() == [1, 1]
    adv = torch.tensor([0.0, 5e-5], dtype=torch.float64)  # one zero set; its seed is o1 (|A| = 5e-5)
    assert mdap_counts(adv, seqs, zero_sets="one").tolist() == [0, 2]
    # three zero rollouts keep o0 (ties to the lower index); 1 kept is not a multiple of 2: o1 comes back
    assert mdap_counts(torch.zeros(3), [[1], [2], [3]], zero_sets="one", multiple=2).tolist() == [2, 1, 0]


def test_padding_prefers_the_highest_abs_advantage_whatever_its_sign_and_index():
    """Padding re-adds the dropped rollout of highest |A|: here a later, negative one
    (o3, |A| = 1) before an earlier, positive one (o1, |A| = 0.5)."""
    adv = torch.tensor([0.5, 0.5, -1.0, -1.0])  # sets {0, 1}, {2, 3}
    seqs = [[7, 7]] * 4  # identical: o0 and o2 kept, o1 and o3 dropped
    assert mdap_counts(adv, seqs, multiple=3).tolist() == [2, 0, 1, 1]


def test_a_near_copy_of_two_kept_rollouts_counts_toward_the_first():
    """against="kept": a rollout too close to several kept ones is dropped for the first of
    them in index order (mdap_counts' docstring). Bigrams {12, 23} and {45, 56} are disjoint
    (both kept); o2's {12, 23, 34, 45, 56} is 1 - 2/5 = 0.6 < 0.8 from each."""
    seqs = [[1, 2, 3], [4, 5, 6], [1, 2, 3, 4, 5, 6]]
    assert mdap_counts(torch.zeros(3), seqs).tolist() == [2, 1, 0]


def test_invalid_multiple_and_group_sizes_are_refused():
    """multiple < 1 (no multiple to pad to), G_1 < 1 and min_size < 1 are refused with a
    ValueError, each on its own."""
    with pytest.raises(ValueError, match="multiple"):
        mdap_counts(torch.zeros(2), [[1], [1]], multiple=0)
    for base, min_size in ((0, 2), (8, 0)):
        with pytest.raises(ValueError, match="must be >= 1"):
            AdaptiveGroupSize(base, min_size)


def test_apply_prune_selects_and_sets_the_sample_weights():
    batch = RolloutBatch(group_ids=torch.zeros(3, dtype=torch.long),
                         samples=[Sample(0, [i]) for i in range(3)],
                         mask=torch.ones(3, 2, dtype=torch.bool), advantages=torch.tensor([1.0, -2.0, 3.0]))
    out = apply_prune(batch, torch.tensor([T, F, T]))
    assert [s.completion for s in out.samples] == [[0], [2]] and SAMPLE_WEIGHT not in out.data
    out = apply_prune(batch, torch.tensor([2.0, 0.0, 1.0]))
    assert [s.completion for s in out.samples] == [[0], [2]]
    assert out.advantages.tolist() == [1.0, 3.0] and out.data[SAMPLE_WEIGHT].tolist() == [2.0, 1.0]
    assert SAMPLE_WEIGHT not in batch.data  # the input is left as it was
    again = apply_prune(out, torch.tensor([3.0, 1.0]))  # weights multiply
    assert again.data[SAMPLE_WEIGHT].tolist() == [6.0, 1.0]
    assert apply_prune(batch, torch.ones(3, dtype=torch.bool)) is batch


def test_mdap_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="2 advantages but 3 sequences"):
        mdap_keep(torch.zeros(2), [[1], [2], [3]])


# ---------------------------------------------------------------------------- what is compared


def test_sequences_of_uses_the_trained_token_ids():
    batch = RolloutBatch(
        group_ids=torch.zeros(2, dtype=torch.long),
        samples=[Sample(0, "ignored"), Sample(0, "ignored")],
        mask=torch.tensor([[T, T, T], [T, T, F]]),
        data={"completion_ids": torch.tensor([[5, 6, 7], [8, 9, 0]])},
    )
    assert sequences_of(batch) == [[5, 6, 7], [8, 9]]  # the padding 0 is not trained


def test_sequences_of_falls_back_to_the_completion():
    batch = RolloutBatch(group_ids=torch.zeros(2, dtype=torch.long),
                         samples=[Sample(0, "the cat  sat"), Sample(0, [3, 11])])
    assert sequences_of(batch) == [["the", "cat", "sat"], [3, 11]]


def test_sequences_of_takes_a_tuple_completion_as_tokens():
    """A tuple completion is a token list too (not the words of its repr, "(3," and "11)")."""
    batch = RolloutBatch(group_ids=torch.zeros(1, dtype=torch.long), samples=[Sample(0, (3, 11))])
    assert sequences_of(batch) == [[3, 11]]


# ---------------------------------------------------------------------------- ARS


def ars_after(*epochs: list[int], base: int = 8, min_size: int = 2) -> AdaptiveGroupSize:
    ars = AdaptiveGroupSize(base, min_size)
    for kept in epochs:
        for k in kept:
            ars.record(k)
    return ars


def test_first_boundary_compares_the_epoch_with_itself():
    # |S(q)| = 4, 6, 8: mean 6, max 8; G'ref = (6 + 8) / 2 = 7 (no previous epoch yet)
    # alpha = 9/10: G't = 0.9 * 6 + 0.1 * 8 = 6.2 < 7 -> n = round(8 - 0.8) = 7
    assert ars_after([4, 6, 8]).next_size(9, 10) == 7
    # alpha = 1/4: G't = 0.25 * 6 + 0.75 * 8 = 7.5 >= 7 -> G_1
    assert ars_after([4, 6, 8]).next_size(1, 4) == 8
    # alpha = 1/2: G't = 7 = G'ref, not smaller -> G_1
    assert ars_after([4, 6, 8]).next_size(5, 10) == 8


def test_later_boundary_uses_the_epoch_before():
    ars = ars_after([4, 6, 8])
    assert ars.next_size(1, 10) == 8  # alpha 0.1: G't = 7.8 >= 7
    for k in (2, 3, 4):  # the next epoch: mean 3, max 4
        ars.record(k)
    # G'ref = (6 + 8) / 2 = 7 from the epoch before; alpha = 6/10: G't = 0.6 * 3 + 0.4 * 4 = 3.4
    # n = round(8 - (7 - 3.4)) = round(4.4) = 4
    assert ars.next_size(6, 10) == 4
    for k in (3, 3):  # mean 3, max 3; G'ref = (3 + 4) / 2 = 3.5 of (2, 3, 4)
        ars.record(k)
    # alpha = 8/10: G't = 3 < 3.5 -> n = round(8 - 0.5) = round(7.5) = 8 (ties to even)
    assert ars.next_size(8, 10) == 8
    for k in (1, 1):
        ars.record(k)
    # G'ref = (3 + 3) / 2 = 3; G't = 1 -> round(8 - 2) = 6: the base is always G_1, not the last n
    assert ars.next_size(9, 10) == 6


def test_the_group_never_shrinks_below_the_minimum():
    ars = ars_after([8, 8])
    ars.next_size(5, 10)
    ars.record(1)
    # G'ref = 8, G't = 1: round(8 - 7) = 1 -> 2
    assert ars.next_size(9, 10) == 2
    ars = ars_after([8, 8], min_size=3)
    ars.next_size(5, 10)
    ars.record(1)
    assert ars.next_size(9, 10) == 3


def test_an_epoch_without_groups_keeps_g1_and_the_statistics():
    ars = ars_after([4, 6, 8])
    assert ars.next_size(3, 10) == 8  # alpha 0.3: G't = 7.4 >= 7
    before = ars.state_dict()
    assert ars.next_size(9, 10) == 8  # nothing recorded since
    assert ars.state_dict() == before == {"current": {"groups": 0, "kept": 0, "max": 0},
                                          "previous": {"groups": 3, "kept": 18, "max": 8}}


def test_ars_state_round_trips_through_json():
    a = ars_after([4, 6, 8])
    a.next_size(1, 10)
    a.record(2)
    a.record(5)
    b = AdaptiveGroupSize(8)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict()
    assert b.next_size(7, 10) == a.next_size(7, 10)
    assert b.state_dict() == a.state_dict()


def test_alpha_is_clamped_to_the_unit_interval():
    """alpha = step / total_steps within [0, 1]; total_steps = 0 (train.max_steps >= 0)
    divides by 1. |S(q)| = 4, 6, 8: mean 6, max 8, G'ref = 7."""
    assert ars_after([4, 6, 8]).next_size(20, 10) == 7  # alpha 1: G't = 6 -> round(8 - 1)
    assert ars_after([4, 6, 8]).next_size(1, 0) == 7  # alpha = 1 / max(0, 1) = 1
    ars = ars_after([8, 8])
    assert ars.next_size(0, 10) == 8  # G'ref of the next boundary: 8
    for k in (4, 6):
        ars.record(k)
    # alpha = max(-1, 0) = 0: G't = max 6 < 8 -> round(8 - 2) = 6 (alpha -1 would give G't = 7 -> 7)
    assert ars.next_size(-10, 10) == 6


def test_a_size_not_below_the_reference_is_g1_even_under_the_minimum():
    """G't = G'ref is the spec's else branch: n = G_1, with no lower bound applied, even when
    min_size exceeds G_1 (the config allows num_generations 2 with min_group_size 3)."""
    assert ars_after([2, 2], base=2, min_size=3).next_size(5, 10) == 2  # G't = G'ref = 2


def test_ars_max_is_the_largest_count_in_any_order():
    """max|S(q)| is the largest count of the epoch, not the last one recorded: 8, 6, 4 is the
    epoch 4, 6, 8 (mean 6, max 8, G'ref 7; alpha 0.9: G't = 6.2 -> round(8 - 0.8) = 7)."""
    assert ars_after([8, 6, 4]).next_size(9, 10) == 7


# ---------------------------------------------------------------------------- the method


def toy_config(tmp_path, *overrides, name="run"):
    return load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG,
                       overrides=[f"output_dir={tmp_path / name}", *overrides])


def test_grpo_without_fastrl_prunes_nothing(tmp_path):
    cfg = toy_config(tmp_path)
    method = build_method(cfg, toy.ToyTask().reward)
    group = RolloutBatch(group_ids=torch.zeros(2, dtype=torch.long), samples=[Sample(0, [1]), Sample(0, [1])],
                         advantages=torch.zeros(2))
    assert method.prune(group) is None
    assert method.group_size(1, 8) == 8
    assert method.state_dict() == {}


def test_grpo_with_fastrl_prunes_with_mdap_and_records_the_kept_count(tmp_path):
    cfg = toy_config(tmp_path, "method.fastrl.enabled=true", "method.fastrl.ars=true",
                     "rollout.num_generations=4", "train.max_steps=10")
    method = build_method(cfg, toy.ToyTask().reward)
    group = RolloutBatch(
        group_ids=torch.zeros(4, dtype=torch.long),
        samples=[Sample(0, c) for c in ([1, 2, 3], [1, 2, 3], [4, 5, 6], [1, 2, 3])],
        mask=torch.ones(4, 2, dtype=torch.bool),
        advantages=torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [-3.0, -3.0]]),  # [N, T]
    )
    # sets {0, 1, 2} (A = 1) and {3} (A = -3); 1 repeats 0: dropped
    assert method.prune(group).tolist() == [T, F, T, T]
    assert method.state_dict() == {"ars": {"current": {"groups": 1, "kept": 3, "max": 3}, "previous": None}}
    method.step = 9  # alpha 0.9 of max_steps 10: G't = 3 = G'ref -> G_1
    assert method.group_size(1, 4) == 4
    assert method.state_dict()["ars"]["previous"] == {"groups": 1, "kept": 3, "max": 3}


def test_grpo_with_fastrl_but_not_ars_prunes_and_keeps_the_group_size(tmp_path):
    cfg = toy_config(tmp_path, "method.fastrl.enabled=true", "rollout.num_generations=4", "train.max_steps=10")
    method = build_method(cfg, toy.ToyTask().reward)
    group = RolloutBatch(group_ids=torch.zeros(4, dtype=torch.long),
                         samples=[Sample(0, c) for c in ([1, 2, 3], [1, 2, 3], [4, 5, 6], [1, 2, 3])],
                         mask=torch.ones(4, 2, dtype=torch.bool), advantages=torch.tensor([1.0, 1.0, 1.0, -3.0]))
    assert method.prune(group).tolist() == [T, F, T, T]  # MDAP runs: 1 repeats 0
    method.step = 9
    assert method.group_size(1, 8) == 8  # no ARS: the size it is given, not one from the kept counts
    assert method.state_dict() == {}  # and nothing of ARS in the checkpoint


def test_grpo_ars_never_shrinks_the_group_below_the_configured_min_group_size(tmp_path):
    cfg = toy_config(tmp_path, "method.fastrl.enabled=true", "method.fastrl.ars=true", "method.fastrl.min_group_size=6",
                     "rollout.num_generations=8", "train.max_steps=10")
    method = build_method(cfg, toy.ToyTask().reward)
    for kept in (8, 1, 1, 1, 1, 1, 1, 1):
        method.ars.record(kept)
    method.step = 10  # alpha 1: G't = mean 15 / 8 = 1.875, G'ref = (1.875 + 8) / 2 = 4.9375
    # 8 - (4.9375 - 1.875) = 4.9375 rounds to 5, below the floor of 6
    assert method.group_size(1, 8) == 6


def test_an_ars_floor_above_num_generations_is_refused(tmp_path):
    """ARS shrinks the group from num_generations; a floor above it grew the group to the floor at
    the first shrink (a tiny run went from 2 rollouts per prompt to 100). Unread without ARS."""
    with pytest.raises(ConfigError, match=r"method.fastrl.min_group_size \(9\) is above rollout.num_generations "
                                          r"\(8\).*give min_group_size in \[2, 8\]"):  # with the config, before a model
        toy_config(tmp_path, "method.fastrl.enabled=true", "method.fastrl.ars=true", "method.fastrl.min_group_size=9",
                   "rollout.num_generations=8")
    for fine in (("method.fastrl.min_group_size=8",), ("method.fastrl.ars=false", "method.fastrl.min_group_size=9")):
        cfg = toy_config(tmp_path, "method.fastrl.enabled=true", "method.fastrl.ars=true", "rollout.num_generations=8",
                         *fine)
        build_method(cfg, toy.ToyTask().reward)


def test_a_pad_multiple_of_the_whole_group_is_refused(tmp_path):
    """Padding to a multiple of pad_multiple >= G can only reach G: every dropped rollout came back and
    MDAP pruned nothing (a run with pad_multiple 1000 matched plain GRPO), silently."""
    for pad in (8, 1000):
        with pytest.raises(ConfigError, match=rf"method.fastrl.pad_multiple \({pad}\) is not below "
                                              r"rollout.num_generations \(8\): .* MDAP prunes nothing"):
            toy_config(tmp_path, "method.fastrl.enabled=true", f"method.fastrl.pad_multiple={pad}",
                       "rollout.num_generations=8")
    for fine in (("method.fastrl.pad_multiple=7",), ("method.fastrl.enabled=false", "method.fastrl.pad_multiple=8")):
        build_method(toy_config(tmp_path, "method.fastrl.enabled=true", "rollout.num_generations=8", *fine),
                     toy.ToyTask().reward)


def test_a_null_pad_multiple_of_a_world_size_as_large_as_the_group_is_refused(tmp_path, monkeypatch):
    """pad_multiple null pads to the data-parallel world size, which the config cannot see: with 8
    processes and G = 8 every dropped rollout came back and MDAP pruned nothing, silently."""
    from mmrl.core import distributed

    monkeypatch.setattr(distributed, "world_size", lambda: 8)
    with pytest.raises(ConfigError, match=r"method.fastrl.pad_multiple is null: the data-parallel world size \(8\), "
                                          r"which is not below rollout.num_generations \(8\): .* MDAP prunes nothing"):
        build_method(toy_config(tmp_path, "method.fastrl.enabled=true", "rollout.num_generations=8"),
                     toy.ToyTask().reward)
    for fine in (("rollout.num_generations=9",), ("rollout.num_generations=8", "method.fastrl.pad_multiple=1"),
                 ("rollout.num_generations=8", "method.fastrl.enabled=false")):
        build_method(toy_config(tmp_path, "method.fastrl.enabled=true", *fine), toy.ToyTask().reward)


def test_grpo_ars_weighs_the_kept_counts_by_step_over_max_steps(tmp_path):
    def size_at(step):
        cfg = toy_config(tmp_path, "method.fastrl.enabled=true", "method.fastrl.ars=true",
                         "rollout.num_generations=8", "train.max_steps=4")
        method = build_method(cfg, toy.ToyTask().reward)
        for kept in (8, 1, 1, 1, 1, 1, 1, 1):  # mean 1.875, max 8: G'ref = (1.875 + 8) / 2 = 4.9375
            method.ars.record(kept)
        method.step = step
        return method.group_size(1, 8)

    assert size_at(2) == 8  # alpha 2 / 4: G't = 0.5 * 1.875 + 0.5 * 8 = 4.9375, not below G'ref
    # alpha 3 / 4: G't = 0.75 * 1.875 + 0.25 * 8 = 3.40625; 8 - (4.9375 - 3.40625) = 6.47 -> 6
    assert size_at(3) == 6


def test_grpo_with_ars_resumes_from_a_checkpoint_without_ars_state(tmp_path):
    # a run started without ARS and resumed with it: its method state holds no "ars"
    cfg = toy_config(tmp_path, "method.fastrl.enabled=true", "method.fastrl.ars=true")
    method = build_method(cfg, toy.ToyTask().reward)
    method.load_state_dict({})
    assert method.state_dict() == {"ars": {"current": {"groups": 0, "kept": 0, "max": 0}, "previous": None}}


def test_grpo_fastrl_prunes_with_the_configured_mdap_dials(tmp_path):
    def kept(advantages, seqs, *overrides):
        method = build_method(toy_config(tmp_path, "method.fastrl.enabled=true", *overrides), toy.ToyTask().reward)
        group = RolloutBatch(group_ids=torch.zeros(len(seqs), dtype=torch.long),
                             samples=[Sample(0, c) for c in seqs], advantages=torch.tensor(advantages))
        return method.prune(group).tolist()

    # ngram 1 (the default): [1, 2, 3] and [3, 2, 1] have one unigram set, distance 0 < tau
    assert kept([1.0, 1.0], [[1, 2, 3], [3, 2, 1]]) == [T, F]
    assert kept([1.0, 1.0], [[1, 2, 3], [3, 2, 1]], "method.fastrl.ngram=2") == [T, T]  # bigrams disjoint
    # against seed (the default): 2 is compared with the seed 0 only, not with its copy 1
    assert kept([1.0, 1.0, 1.0], [[1, 2], [3, 4], [3, 4]]) == [T, T, T]
    assert kept([1.0, 1.0, 1.0], [[1, 2], [3, 4], [3, 4]], "method.fastrl.against=kept") == [T, T, F]
    assert kept([1.0, 1.0], [[1, 2], [1, 2]], "method.fastrl.tau=0") == [T, T]  # tau 0 keeps everything
    # 1.0 and 1.05 are one advantage set only with adv_tol above 0.05
    assert kept([1.0, 1.05], [[1, 2], [1, 2]]) == [T, T]
    assert kept([1.0, 1.05], [[1, 2], [1, 2]], "method.fastrl.adv_tol=0.1") == [F, T]  # the higher |A| is the seed
    assert kept([0.0, 0.0], [[1, 2], [3, 4]], "method.fastrl.zero_sets=one") == [T, F]  # a zero set keeps its seed
    # three copies keep one, padded to a multiple of pad_multiple 2 (not of the world size 1)
    assert kept([1.0, 1.0, 1.0], [[1, 2]] * 3, "method.fastrl.pad_multiple=2") == [T, T, F]


@pytest.mark.parametrize("base", ["grpo", "dapo"])
def test_count_weights_give_the_unpruned_update_for_exact_copies(tmp_path, base):
    """Three copies of a right answer and one wrong one: the kept copy, counted 3 times in
    the loss and in its normaliser, gives the whole group's gradient exactly (GRPO's mean
    over samples, DAPO's over tokens); unweighted, the right answer pulls a third as hard."""
    policy = toy.ToyPolicy(seed=0)
    ids = torch.tensor([[toy.BOS, 3, 4, toy.EOS]] * 3 + [[toy.BOS, 3, 5, 5]])
    group = RolloutBatch(group_ids=torch.zeros(4, dtype=torch.long),
                         samples=[Sample(3, row[2:].tolist()) for row in ids],
                         mask=torch.ones(4, 2, dtype=torch.bool), data={"input_ids": ids})
    with torch.no_grad():
        group.old_logp = policy.logprobs(group)
    group.advantages = torch.tensor([1.0, 1.0, 1.0, -3.0]) / 3**0.5
    preset = ROOT / "configs" / "vlm" / f"{base}.yaml"

    def build(*sets):
        cfg = load_config(TrainConfig, preset, [f"output_dir={tmp_path}", "rollout.num_generations=4", *sets],
                          defaults=toy.DEFAULT_CONFIG)
        return build_method(cfg, toy.ToyTask().reward)

    def grad(method, batch):
        policy.model.zero_grad()
        method.loss(policy, batch, batch.advantages, denom=method.loss_denominator(batch)).loss.backward()
        return torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None])

    full = grad(build(), group)
    counted = build("method.fastrl.enabled=true", "method.fastrl.weight=count")
    keep = counted.prune(group)
    assert keep.tolist() == [3.0, 0.0, 0.0, 1.0]
    torch.testing.assert_close(grad(counted, apply_prune(group, keep)), full)
    plain = build("method.fastrl.enabled=true")
    keep = plain.prune(group)
    assert keep.tolist() == [T, F, F, T]
    cosine = torch.nn.functional.cosine_similarity(full, grad(plain, apply_prune(group, keep)), dim=0)
    assert cosine < 0.99


def _rank(rank, port, tmp):
    with process_group(rank, port):
        cfg = toy_config(Path(tmp), "method.fastrl.enabled=true", "method.fastrl.ars=true",
                         "rollout.num_generations=4", "train.max_steps=10")
        method = build_method(cfg, toy.ToyTask().reward)
        seqs = [[1, 2]] * 4 if rank == 0 else [[1, 2], [3, 4], [5, 6], [7, 8]]  # keeps 1 (+1 pad) / 4
        group = RolloutBatch(group_ids=torch.zeros(4, dtype=torch.long), samples=[Sample(0, c) for c in seqs],
                             advantages=torch.zeros(4))
        keep = method.prune(group).tolist()
        method.step = 9
        size = method.group_size(1, 4)
        torch.save({"keep": keep, "size": size, "state": method.state_dict()}, f"{tmp}/result.{rank}")


@pytest.mark.two_ranks(body=_rank)
def test_two_processes_share_the_kept_counts(ranks_ran):
    ranks = [torch.load(ranks_ran / f"result.{r}") for r in range(2)]
    assert ranks[0]["keep"] == [T, T, F, F]  # 1 kept, padded to a multiple of the 2 processes
    assert ranks[1]["keep"] == [T, T, T, T]
    # both ranks saw |S(q)| = 2 and 4: mean 3, max 4; alpha 0.9: G't = 3.1 < G'ref = 3.5
    # -> n = round(4 - 0.4) = 4, and the same statistics on both
    assert ranks[0]["size"] == ranks[1]["size"] == 4
    assert ranks[0]["state"] == ranks[1]["state"] == {
        "ars": {"current": {"groups": 0, "kept": 0, "max": 0}, "previous": {"groups": 2, "kept": 6, "max": 4}}}


def test_fastrl_config_bounds(tmp_path):
    with pytest.raises(ConfigError, match="method.fastrl.tau"):
        toy_config(tmp_path, "method.fastrl.tau=1.5")
    with pytest.raises(ConfigError, match="method.fastrl.ngram"):
        toy_config(tmp_path, "method.fastrl.ngram=0")
    with pytest.raises(ConfigError, match="did you mean 'method.fastrl.tau'"):
        toy_config(tmp_path, "method.fastrl.taus=0.5")


# ---------------------------------------------------------------------------- the loop


class CollapsedToy(toy.ToyPolicy):
    """The toy policy, collapsed on even digits: there every sample is the same wrong
    answer ((d + 5) mod 10, repeated), so all its samples share one advantage and MDAP keeps
    one of them. Odd digits sample as usual. Deterministic however rollouts are split."""

    def generate(self, prompts, num_generations, rollout, generator):
        batch = super().generate(prompts, num_generations, rollout, generator)
        ids = batch.data["input_ids"].clone()  # [N, 2 + T]
        for row, s in enumerate(batch.samples):
            if s.prompt % 2 == 0:
                ids[row, 2:] = (s.prompt + 5) % 10
        batch.data["input_ids"] = ids
        batch.samples = [Sample(s.prompt, ids[row, 2:].tolist()) for row, s in enumerate(batch.samples)]
        with torch.no_grad():
            batch.old_logp = self.logprobs(batch)
        return batch

    def reference(self):  # a background engine's frozen copy collapses too
        return CollapsedToy(model=super().reference().model)


# 10 prompts, 5 per step: a data epoch is 2 steps; steps 2, 4, 6 and 8 start epochs 1-4
# (alpha = 0.2, 0.4, 0.6, 0.8 of 10 steps).
FASTRL = ("method.fastrl.enabled=true", "method.fastrl.ars=true", "method.fastrl.ngram=2",
          "method.fastrl.against=kept", "rollout.prompts_per_step=5", "train.max_steps=10")


def test_fastrl_prunes_and_shrinks_the_group_at_an_epoch_boundary(tmp_path):
    cfg = toy_config(tmp_path, *FASTRL)
    trainer = Trainer(cfg, CollapsedToy(seed=cfg.seed), toy.ToyTask())
    trainer.train()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    sizes = [r["rollout/group_size"] for r in rows]
    for r in rows:  # what was pruned plus what trained is the whole round
        assert r["rollout/samples"] + r["rollout/samples_pruned"] == 5 * r["rollout/group_size"]
    for a, b in zip(rows[0::2], rows[1::2]):  # an epoch: the 5 even digits lose all but one sample
        assert a["rollout/samples_pruned"] + b["rollout/samples_pruned"] >= 5 * (a["rollout/group_size"] - 1)
    assert sizes[0] == 8 and min(sizes) < 8  # ARS shrank G ...
    changes = [s for s in range(1, 10) if sizes[s] != sizes[s - 1]]
    assert changes and set(changes) <= {2, 4, 6, 8}  # ... and only where a data epoch begins
    assert all(s >= 2 for s in sizes)
    assert trainer.num_generations == sizes[-1]
    assert all(torch.isfinite(torch.tensor(r["loss/total"])) for r in rows)


def test_fastrl_crash_then_resume_equals_uninterrupted(tmp_path):
    """The run dies in step 9, after the checkpoint at step 7, half-way through epoch 3: the
    resumed run needs the saved kept counts (epoch 2, and step 6 of epoch 3) to pick the same
    group size at step 8 and to end with the same statistics."""
    args = (*FASTRL, "train.save_every=7")
    cfg = toy_config(tmp_path, *args, name="full")
    full = Trainer(cfg, CollapsedToy(seed=cfg.seed), toy.ToyTask())
    full.train()

    cfg = toy_config(tmp_path, *args, name="crash")
    crashing = Trainer(cfg, CollapsedToy(seed=cfg.seed), toy.ToyTask())
    calls = {"n": 0}
    generate = crashing.policy.generate

    def dying_generate(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 9:
            raise KeyboardInterrupt("simulated kill")
        return generate(*a, **kw)

    crashing.policy.generate = dying_generate
    with pytest.raises(KeyboardInterrupt):
        crashing.train()
    assert [s for s, _ in list_checkpoints(tmp_path / "crash" / "checkpoints")] == [7]

    resumed = Trainer(cfg, CollapsedToy(seed=cfg.seed), toy.ToyTask())
    resumed.train(resume=True)
    for k, v in full.policy.model.state_dict().items():
        assert torch.equal(v, resumed.policy.model.state_dict()[k]), k
    full_rows = read_metrics(tmp_path / "full" / "metrics.jsonl")
    assert comparable(full_rows) == comparable(read_metrics(tmp_path / "crash" / "metrics.jsonl"))
    assert min(r["rollout/group_size"] for r in full_rows[7:]) < 8  # G changed after the checkpoint
    assert resumed.method.state_dict() == full.method.state_dict()


def test_fastrl_prunes_in_the_pipelined_scheduler(tmp_path):
    cfg = toy_config(tmp_path, *FASTRL, "train.max_steps=2", "rollout.scheduler.mode=pipelined",
                     "train.mini_batches=5")
    trainer = Trainer(cfg, CollapsedToy(seed=cfg.seed), toy.ToyTask())
    trainer.train()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["train/updates"] for r in rows] == [5, 5]  # one optimizer step per group
    assert all(r["rollout/samples"] + r["rollout/samples_pruned"] == 5 * 8 for r in rows)
    assert sum(r["rollout/samples_pruned"] for r in rows) >= 5 * 7  # one epoch: 5 collapsed groups
    assert trainer.method.ars.state_dict()["current"]["groups"] == 10


@pytest.mark.parametrize("mode", ["sync", "pipelined"])
def test_count_weights_train_in_both_schedulers(tmp_path, mode):
    cfg = toy_config(tmp_path, *FASTRL, "method.fastrl.weight=count", "method.fastrl.ars=false",
                     "train.max_steps=2", f"rollout.scheduler.mode={mode}")
    trainer = Trainer(cfg, CollapsedToy(seed=cfg.seed), toy.ToyTask())
    trainer.train()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert all(r["rollout/samples"] + r["rollout/samples_pruned"] == 5 * 8 for r in rows)
    assert all(r["rollout/samples_pruned"] > 0 for r in rows)
    assert all(torch.isfinite(torch.tensor(r["loss/total"])) for r in rows)


def test_benchmark_time_to_counts_an_evaluation_exactly_at_the_target():
    """benchmarks/fastrl.py: held-out accuracies logged before 2026-12-04 are float32 means, so
    105 of 200 logs as 0.52499998; it reaches a --target of 0.525, and 104 of 200 does not."""
    bench = import_python_file(ROOT / "benchmarks" / "fastrl.py", "fastrl_bench")
    at = float(torch.tensor([1.0] * 105 + [0.0] * 95).mean())
    below = float(torch.tensor([1.0] * 104 + [0.0] * 96).mean())
    assert at < 0.525  # the rounding the comparison has to allow for
    curve = [(0, 0.0, 0.6), (50, 10.0, below), (100, 20.0, at), (150, 30.0, 0.6)]
    assert bench.time_to(curve, 0.525) == 20.0  # step 0 never counts, even above the target
    assert bench.time_to(curve[:3], 0.53) is None


def test_update_cost_subsets_and_fit():
    """benchmarks/update_cost.py: MDAP-like subsets keep every group, the others whole groups;
    the fit recovers a + b rows + c images from exact points."""
    from types import SimpleNamespace

    bench = import_python_file(ROOT / "benchmarks" / "update_cost.py", "update_cost_bench")
    batch = SimpleNamespace(group_ids=torch.arange(8).repeat_interleave(8))
    batch.groups = lambda: RolloutBatch.groups(batch)  # the one field it reads
    cases = bench.subsets(batch)
    assert [(kind[0], rows, images) for kind, rows, images, _ in cases] == [
        ("k", 64, 8), ("k", 32, 8), ("k", 16, 8), ("k", 8, 8), ("w", 32, 4), ("w", 16, 2), ("w", 8, 1)]
    for _, rows, images, idx in cases:
        assert len(idx) == rows == len(set(idx.tolist())) and len(batch.group_ids[idx].unique()) == images
    points = [(r, i, 0.01 + 0.002 * r + 0.005 * i) for _, r, i, _ in cases]
    assert bench.fit(points) == pytest.approx((0.01, 0.002, 0.005))
