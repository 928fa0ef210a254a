"""The typed rollout batch (mmrl/core/batch.py): validation, select, concat, groups."""

from dataclasses import replace

import pytest
import torch

from mmrl.core.batch import SAMPLE_WEIGHT, RolloutBatch
from mmrl.core.rewards import AtomScores, Sample


def samples(n: int, tag: str = "s") -> list[Sample]:
    return [Sample(prompt=f"p{i}", completion=f"{tag}{i}", meta={"row": i}) for i in range(n)]


def scores(n: int, names=("fmt", "ok"), offset: float = 0.0) -> AtomScores:
    # row i: values [i, 10 i] (+ offset); total = values.sum(1) = 11 i (+ 2 offset)
    values = torch.stack([torch.arange(n) + offset, 10 * torch.arange(n) + offset], dim=1).float()
    return AtomScores(names=list(names), values=values, total=values.sum(1))


def make_batch(n: int = 4, t: int = 3, gids=None, tag: str = "s", offset: float = 0.0, **kw):
    """Row i: mask has the first (i % t) + 1 positions True; old_logp[i, j] = -(10 i + j)."""
    gids = torch.tensor(gids if gids is not None else [i // 2 for i in range(n)])
    mask = torch.arange(t).expand(n, t) <= (torch.arange(n) % t)[:, None]
    old = -(10 * torch.arange(n)[:, None] + torch.arange(t)[None, :]).float()
    fields = {
        "group_ids": gids,
        "samples": samples(n, tag),
        "mask": mask,
        "old_logp": old,
        "scores": scores(n, offset=offset),
        "advantages": torch.arange(n).float() - 1.5,
        "data": {
            "input_ids": torch.arange(n * t).view(n, t),
            "pixels": torch.arange(n * 2).float().view(n, 2),
        },
    }
    fields.update(kw)
    return RolloutBatch(**fields)


# ---------------------------------------------------------------------------- validation


def test_valid_batch_basics():
    b = make_batch(4, 3, gids=[5, 5, 9, 9], policy_version=2)
    assert len(b) == 4
    assert b.num_groups == 2
    assert torch.equal(b.rewards, torch.tensor([0.0, 11.0, 22.0, 33.0]))  # 11 i
    assert b.summary() == {"samples": 4, "groups": 2, "version": 2}


def test_minimal_batch():
    b = RolloutBatch(group_ids=torch.tensor([0, 0]), samples=samples(2))
    assert len(b) == 2 and b.mask is None and b.data == {}


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("samples", samples(3), "samples"),
        ("mask", torch.ones(3, 3, dtype=torch.bool), "batch.mask"),
        ("old_logp", torch.zeros(5, 3), "batch.old_logp"),
        ("old_logp", torch.zeros(4, 2), "batch.old_logp shape"),  # rows right, T wrong
        ("ref_logp", torch.zeros(4, 4), "batch.ref_logp shape"),
        ("advantages", torch.zeros(3), "batch.advantages"),
        ("scores", scores(5), "batch.scores"),
        ("data", {"input_ids": torch.zeros(2, 3)}, "batch.data['input_ids']"),
        ("group_ids", torch.zeros(2, 2, dtype=torch.long), "group_ids must be 1-D"),
    ],
)
def test_mismatched_rows_raise_naming_the_field(field, value, needle):
    with pytest.raises(ValueError) as info:
        make_batch(4, 3, **{field: value})
    assert needle in str(info.value)


def test_old_logp_vs_mask_shape_only_checked_with_a_mask():
    b = make_batch(4, 3, mask=None, old_logp=torch.zeros(4, 7))
    assert b.old_logp.shape == (4, 7)


def test_rewards_unscored_raises():
    b = make_batch(scores=None)
    with pytest.raises(ValueError, match="not been scored"):
        _ = b.rewards


# ---------------------------------------------------------------------------- groups


def test_groups_in_first_appearance_order():
    # group 7 appears first, then 2, then 5; rows interleaved
    b = make_batch(6, 2, gids=[7, 2, 7, 5, 2, 5])
    assert b.num_groups == 3
    assert [g.tolist() for g in b.groups()] == [[0, 2], [1, 4], [3, 5]]
    assert all(g.dtype == torch.long for g in b.groups())


def test_groups_cover_every_row_once():
    b = make_batch(8, 2, gids=[3, 1, 1, 3, 0, 0, 2, 2])
    rows = torch.cat(b.groups()).sort().values
    assert torch.equal(rows, torch.arange(8))
    for g in b.groups():
        assert b.group_ids[g].unique().numel() == 1


# ---------------------------------------------------------------------------- select


def assert_rows(sub: RolloutBatch, full: RolloutBatch, rows: list[int]) -> None:
    idx = torch.tensor(rows, dtype=torch.long)
    assert len(sub) == len(rows)
    assert torch.equal(sub.group_ids, full.group_ids[idx])
    assert sub.samples == [full.samples[i] for i in rows]
    assert torch.equal(sub.mask, full.mask[idx])
    assert torch.equal(sub.old_logp, full.old_logp[idx])
    assert torch.equal(sub.advantages, full.advantages[idx])
    assert sub.scores.names == full.scores.names
    assert torch.equal(sub.scores.values, full.scores.values[idx])
    assert torch.equal(sub.scores.total, full.scores.total[idx])
    assert sub.data.keys() == full.data.keys()
    for k in full.data:
        assert torch.equal(sub.data[k], full.data[k][idx]), k
    assert sub.policy_version == full.policy_version


def test_select_long_indices():
    b = make_batch(4, 3, gids=[0, 0, 1, 1], policy_version=3)
    sub = b.select(torch.tensor([3, 1]))
    assert_rows(sub, b, [3, 1])
    # hand-worked: row 3 has (3 % 3) + 1 = 1 True position, row 1 has (1 % 3) + 1 = 2;
    # old_logp[i, j] = -(10 i + j); reward 11 i; advantage i - 1.5
    assert sub.mask.tolist() == [[True, False, False], [True, True, False]]
    assert sub.old_logp.tolist() == [[-30.0, -31.0, -32.0], [-10.0, -11.0, -12.0]]
    assert sub.rewards.tolist() == [33.0, 11.0]
    assert sub.advantages.tolist() == [1.5, -0.5]
    assert sub.group_ids.tolist() == [1, 0]
    assert [s.completion for s in sub.samples] == ["s3", "s1"]


def test_select_bool_mask():
    b = make_batch(4, 3, gids=[0, 0, 1, 1])
    keep = torch.tensor([False, True, True, False])
    sub = b.select(keep)
    assert_rows(sub, b, [1, 2])
    assert sub.rewards.tolist() == [11.0, 22.0]
    assert sub.num_groups == 2


def test_select_list_and_empty():
    b = make_batch(4, 3)
    assert_rows(b.select([2]), b, [2])
    empty = b.select(torch.zeros(4, dtype=torch.bool))
    assert len(empty) == 0 and empty.samples == [] and empty.mask.shape == (0, 3)


def test_select_keeps_the_prompts_of_the_groups_left():
    """A selection carries the prompt objects of its own groups only (what crosses ranks when
    the scheduler deals out surplus groups), and the original keeps them all."""
    b = make_batch(6, 3, gids=[4, 4, 7, 7, 9, 9], prompts={4: "four", 7: "seven", 9: "nine"})
    assert b.select(torch.tensor([3, 0, 2])).prompts == {4: "four", 7: "seven"}
    assert b.select(torch.tensor([False, False, False, False, True, False])).prompts == {9: "nine"}
    assert b.select(torch.zeros(6, dtype=torch.bool)).prompts == {}
    assert b.prompts == {4: "four", 7: "seven", 9: "nine"}


def test_select_does_not_alias_the_original_sample_list():
    b = make_batch(4, 3)
    sub = b.select(torch.arange(4))
    sub.samples.pop()
    assert len(b.samples) == 4


# ---------------------------------------------------------------------------- concat


def test_concat_pads_to_the_longer_t():
    a = make_batch(2, 2, gids=[0, 0], policy_version=4)
    b = make_batch(2, 3, gids=[1, 1], tag="b", offset=100.0, policy_version=3)
    c = RolloutBatch.concat([a, b])
    assert len(c) == 4 and c.num_groups == 2
    assert c.group_ids.tolist() == [0, 0, 1, 1]
    assert [s.completion for s in c.samples] == ["s0", "s1", "b0", "b1"]
    # a's rows padded from T=2 to T=3 with False / 0
    assert c.mask.tolist() == [
        [True, False, False],
        [True, True, False],
        [True, False, False],
        [True, True, False],
    ]
    assert c.mask.dtype == torch.bool
    assert c.old_logp.tolist() == [
        [-0.0, -1.0, 0.0],
        [-10.0, -11.0, 0.0],
        [-0.0, -1.0, -2.0],
        [-10.0, -11.0, -12.0],
    ]
    assert c.data["input_ids"].tolist() == [[0, 1, 0], [2, 3, 0], [0, 1, 2], [3, 4, 5]]
    assert c.data["pixels"].shape == (4, 2)  # same width: plain cat
    assert c.advantages.tolist() == [-1.5, -0.5, -1.5, -0.5]
    # scores kept: a rows 11 i, b rows 11 i + 200
    assert c.scores.names == ["fmt", "ok"]
    assert c.rewards.tolist() == [0.0, 11.0, 200.0, 211.0]
    assert c.scores.values.tolist() == [[0, 0], [1, 10], [100, 100], [101, 110]]
    assert c.policy_version == 3  # the oldest weights in the batch


def test_concat_3d_data_pads_dim_1():
    a = make_batch(2, 2, data={"x": torch.ones(2, 1, 2)})
    b = make_batch(2, 2, data={"x": torch.ones(2, 3, 2)})
    x = RolloutBatch.concat([a, b]).data["x"]
    assert x.shape == (4, 3, 2)
    assert x.sum().item() == 2 * 1 * 2 + 2 * 3 * 2  # padding is zeros


def test_concat_gives_unweighted_batches_weight_one():
    """Groups pruned with weights (FastRL's counts) and groups left whole concat: a row of a
    batch without SAMPLE_WEIGHT weighs 1. Other missing data keys still raise."""
    a = make_batch(2, 2, data={"x": torch.zeros(2), SAMPLE_WEIGHT: torch.tensor([3.0, 1.0])})
    b = make_batch(2, 2, data={"x": torch.zeros(2)})
    assert RolloutBatch.concat([b, a]).data[SAMPLE_WEIGHT].tolist() == [1.0, 1.0, 3.0, 1.0]
    assert SAMPLE_WEIGHT not in b.data  # the input is left as it was
    with pytest.raises(ValueError, match="different data keys"):
        RolloutBatch.concat([a, make_batch(2, 2, data={"y": torch.zeros(2)})])


def test_concat_single_and_empty():
    a = make_batch()
    assert RolloutBatch.concat([a]) is a
    with pytest.raises(ValueError, match="at least one"):
        RolloutBatch.concat([])


def test_concat_different_atoms_raises():
    a = make_batch()
    b = make_batch(scores=scores(4, names=("fmt", "other")))
    with pytest.raises(ValueError, match="different reward atoms"):
        RolloutBatch.concat([a, b])


def test_concat_data_key_mismatch_raises():
    a = make_batch()
    b = make_batch(data={"input_ids": torch.zeros(4, 3, dtype=torch.long)})
    with pytest.raises(ValueError, match="different data keys"):
        RolloutBatch.concat([a, b])


def test_concat_only_some_with_a_field_raises():
    a = make_batch()
    b = make_batch(old_logp=None)
    with pytest.raises(ValueError, match="only some have old_logp"):
        RolloutBatch.concat([a, b])


def test_concat_differing_beyond_dim_1_raises():
    a = make_batch(2, 2, data={"x": torch.ones(2, 1, 2)})
    b = make_batch(2, 2, data={"x": torch.ones(2, 3, 4)})
    with pytest.raises(ValueError, match="beyond their second dimension"):
        RolloutBatch.concat([a, b])


def test_concat_then_select_round_trip():
    a = make_batch(2, 2, gids=[0, 0])
    b = make_batch(2, 3, gids=[1, 1], tag="b", offset=100.0)
    c = RolloutBatch.concat([a, b])
    back = c.select(torch.tensor([2, 3]))
    assert torch.equal(back.mask, b.mask)
    assert torch.equal(back.old_logp, b.old_logp)
    assert torch.equal(back.rewards, b.rewards)
    assert back.samples == b.samples


def test_concat_padding_stays_on_the_tensors_device():
    # "meta" stands in for CUDA: a non-CPU device available everywhere
    def meta_batch(t):
        return RolloutBatch(
            group_ids=torch.tensor([0, 0]),
            samples=samples(2),
            mask=torch.ones(2, t, dtype=torch.bool, device="meta"),
        )

    c = RolloutBatch.concat([meta_batch(2), meta_batch(3)])
    assert c.mask.device.type == "meta" and c.mask.shape == (4, 3)


def test_concat_keeps_failed_entries():
    a = make_batch(
        2,
        2,
        scores=AtomScores(
            ["fmt"], torch.zeros(2, 1), torch.zeros(2), 1, torch.tensor([[True], [False]])
        ),
    )
    b = make_batch(
        2,
        2,
        scores=AtomScores(
            ["fmt"], torch.zeros(2, 1), torch.zeros(2), 0, torch.tensor([[False], [False]])
        ),
    )
    c = RolloutBatch.concat([a, b])
    assert c.scores.errors == 1
    assert c.scores.failed.tolist() == [[True], [False], [False], [False]]
    assert c.select(torch.tensor([2, 3])).scores.errors == 0  # recounted from `failed`
    assert c.select(torch.tensor([0, 3])).scores.errors == 1


def test_to_a_device_or_to_the_devices_of_another_batch():
    """A batch that crossed processes (by the CPU) goes back field by field to where the rank's
    own rollouts live: ids stay on the CPU, model inputs go to the accelerator ("meta" here)."""
    local = make_batch(2)
    local = RolloutBatch(**{**local.__dict__, "mask": local.mask.to("meta"),
                            "data": {"input_ids": local.data["input_ids"].to("meta"), "pixels": local.data["pixels"]}})
    moved = make_batch(4).to(local)
    assert moved.group_ids.device.type == "cpu" and moved.old_logp.device.type == "cpu"
    assert moved.mask.device.type == "meta" and moved.data["input_ids"].device.type == "meta"
    assert moved.data["pixels"].device.type == "cpu" and moved.scores.total.device.type == "cpu"
    everything = make_batch(4).to("meta")
    assert {t.device.type for t in (everything.group_ids, everything.scores.values, *everything.data.values())} == {"meta"}


def test_onto_moves_what_models_read_and_keeps_the_bookkeeping():
    """A batch from an engine elsewhere comes onto the policy's device: mask, log-probs,
    advantages and data move; group ids and scores (read as Python numbers) stay."""
    import torch

    from mmrl.core.batch import RolloutBatch
    from mmrl.core.rewards import AtomScores

    meta = torch.device("meta")
    b = RolloutBatch(group_ids=torch.tensor([0, 0]), samples=[None, None], mask=torch.ones(2, 3, dtype=torch.bool),
                     old_logp=torch.zeros(2, 3), advantages=torch.zeros(2), data={"x": torch.zeros(2, 4)},
                     scores=AtomScores(names=["a"], values=torch.zeros(2, 1), total=torch.zeros(2)))
    out = b.onto(meta)
    assert {out.mask.device, out.old_logp.device, out.advantages.device, out.data["x"].device} == {meta}
    assert out.ref_logp is None and out.group_ids.device.type == "cpu" and out.scores.total.device.type == "cpu"


# ---------------------------------------------------------------------------- what the suite let through


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("samples", samples(5), "batch has 4 group ids but 5 samples"),
        ("scores", scores(3), "batch.scores has 3 rows, expected 4"),
        ("data", {"input_ids": torch.zeros(6, 3)}, "batch.data['input_ids'] has 6 rows, expected 4"),
    ],
)
def test_more_or_fewer_rows_than_group_ids_are_refused_both_ways(field, value, needle):
    """The row checks are equalities: 5 samples for 4 group ids fail as 3 would, and so do
    3 score rows and 6 data rows (the cases above have the other direction)."""
    with pytest.raises(ValueError) as info:
        make_batch(4, 3, **{field: value})
    assert needle in str(info.value)


@pytest.mark.parametrize("field", ["old_logp", "ref_logp"])
def test_log_prob_rows_are_checked_without_a_mask(field):
    """With no mask to compare shapes against, old_logp and ref_logp still need N rows."""
    with pytest.raises(ValueError, match=rf"batch.{field} has 5 rows, expected 4"):
        make_batch(4, 3, mask=None, **{field: torch.zeros(5, 3)})


def test_select_slices_ref_logp_like_old_logp():
    # ref_logp[i, j] = 100 i + j: rows 3 and 1 are [300, 301, 302] and [100, 101, 102]
    ref = (100 * torch.arange(4)[:, None] + torch.arange(3)[None, :]).float()
    sub = make_batch(4, 3, ref_logp=ref).select(torch.tensor([3, 1]))
    assert sub.ref_logp.tolist() == [[300.0, 301.0, 302.0], [100.0, 101.0, 102.0]]
    assert make_batch(4, 3, ref_logp=ref).select(torch.tensor([True, False, False, True])).ref_logp[:, 0].tolist() == [
        0.0, 300.0]


def full_batch(n: int = 2) -> RolloutBatch:
    """Every optional field set, scores with their `failed` entries."""
    failed = torch.zeros(n, 2, dtype=torch.bool)
    s = scores(n)
    return make_batch(n, 3, ref_logp=torch.zeros(n, 3),
                      scores=AtomScores(s.names, s.values, s.total, 0, failed))


def test_to_a_device_moves_every_tensor_of_the_batch():
    b = full_batch().to("meta")
    tensors = {"group_ids": b.group_ids, "mask": b.mask, "old_logp": b.old_logp, "ref_logp": b.ref_logp,
               "advantages": b.advantages, "values": b.scores.values, "total": b.scores.total,
               "failed": b.scores.failed, **b.data}
    assert {k: t.device.type for k, t in tensors.items()} == dict.fromkeys(tensors, "meta")


def test_to_another_batch_moves_each_field_to_where_that_batchs_own_is():
    """Field by field: what the other batch keeps on "meta" (its log-probs, advantages and
    scores here) goes there, what it keeps on the CPU (ids, mask, data) stays."""
    like = full_batch()
    meta = {n: getattr(like, n).to("meta") for n in ("old_logp", "ref_logp", "advantages")}
    like = replace(like, scores=replace(like.scores, values=like.scores.values.to("meta"),
                                        total=like.scores.total.to("meta"), failed=like.scores.failed.to("meta")),
                   **meta)
    b = full_batch(4).to(like)
    assert {n: getattr(b, n).device.type for n in ("old_logp", "ref_logp", "advantages")} == dict.fromkeys(meta, "meta")
    assert {t.device.type for t in (b.scores.values, b.scores.total, b.scores.failed)} == {"meta"}
    assert {t.device.type for t in (b.group_ids, b.mask, *b.data.values())} == {"cpu"}


def test_onto_moves_ref_logp_too():
    b = full_batch().onto("meta")
    assert b.ref_logp.device.type == "meta" and b.old_logp.device.type == "meta"


def test_concat_refuses_batches_where_only_some_are_scored():
    with pytest.raises(ValueError, match="only some have scores"):
        RolloutBatch.concat([make_batch(2, 2), make_batch(2, 2, scores=None)])
    with pytest.raises(ValueError, match="only some have scores"):
        RolloutBatch.concat([make_batch(2, 2, scores=None), make_batch(2, 2)])


def test_concat_adds_up_the_errors_and_drops_failed_unless_every_batch_has_it():
    """errors 1 + 2 = 3; a batch whose scores have no `failed` makes the whole batch's None
    (its error count stays in `errors`)."""
    def scored(errors: int, failed: bool) -> RolloutBatch:
        return make_batch(2, 2, scores=AtomScores(["fmt"], torch.zeros(2, 1), torch.zeros(2), errors,
                                                  torch.ones(2, 1, dtype=torch.bool) if failed else None))

    both = RolloutBatch.concat([scored(1, True), scored(2, True)]).scores
    assert both.errors == 3 and both.failed.shape == (4, 1)
    for batches in ([scored(1, True), scored(2, False)], [scored(1, False), scored(2, True)]):
        mixed = RolloutBatch.concat(batches).scores
        assert mixed.errors == 3 and mixed.failed is None


def test_concat_keeps_every_batchs_prompts():
    a = make_batch(2, 2, gids=[0, 0], prompts={0: "zero"})
    b = make_batch(2, 2, gids=[1, 1], prompts={1: "one"})
    c = make_batch(2, 2, gids=[2, 2])
    assert RolloutBatch.concat([a, b, c]).prompts == {0: "zero", 1: "one"}
    assert RolloutBatch.concat([c, b, a]).prompts == {1: "one", 0: "zero"}


def test_concat_refuses_one_group_id_with_different_prompts():
    """A group's parts (or its extra samples) carry its one prompt; two draws under one id are a
    caller's bug, where keeping the later prompt paired the earlier rows with the wrong prompt."""
    a = make_batch(2, 2, gids=[3, 3], prompts={3: "three"})
    with pytest.raises(ValueError, match=r"group 3 different prompts \('three' and 'other'\)"):
        RolloutBatch.concat([a, make_batch(2, 2, gids=[3, 3], prompts={3: "other"})])
    # the same prompt again (one object, or an equal copy from another process) is fine
    item = {"question": "q", "answer": 1}
    for again in (item, dict(item)):
        merged = RolloutBatch.concat([make_batch(2, 2, gids=[3, 3], prompts={3: item}),
                                      make_batch(2, 2, gids=[3, 3], prompts={3: again})])
        assert merged.prompts == {3: item} and len(merged) == 4
    # a part without prompts (an engine's batch, labelled by the scheduler later) never clashes
    assert RolloutBatch.concat([a, make_batch(2, 2, gids=[3, 3])]).prompts == {3: "three"}
    # prompts holding tensors compare element-wise: no single truth value, so they pass
    class Undecidable:  # == that cannot answer with a TypeError (a third-party prompt type)
        def __eq__(self, other):
            raise TypeError("cannot compare")

    assert RolloutBatch.concat([make_batch(2, 2, gids=[3, 3], prompts={3: Undecidable()}),
                                make_batch(2, 2, gids=[3, 3], prompts={3: Undecidable()})]).prompts.keys() == {3}
    # a long prompt is shortened in the message (its repr to 60 characters)
    with pytest.raises(ValueError, match=r"group 3 different prompts \('x{56}\.\.\. and 'y{56}\.\.\.\)"):
        RolloutBatch.concat([make_batch(2, 2, gids=[3, 3], prompts={3: "x" * 100}),
                             make_batch(2, 2, gids=[3, 3], prompts={3: "y" * 100})])
    t = {3: torch.zeros(2)}
    assert RolloutBatch.concat([make_batch(2, 2, gids=[3, 3], prompts=t),
                                make_batch(2, 2, gids=[3, 3], prompts={3: torch.zeros(2)})]).prompts.keys() == {3}
