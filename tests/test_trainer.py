"""The one RL loop on the toy backend (tests/toy.py): learning, exact resume,
gradient-accumulation equivalence, dynamic sampling, non-finite steps, outputs."""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
import time
import types
import warnings
from pathlib import Path

import pytest
import torch
import toy
import yaml
from runcompare import comparable
from transformers import LlamaForCausalLM

from mmrl.core.checkpoint import list_checkpoints
from mmrl.core.config import TrainConfig, load_config
from mmrl.core.logging import read_metrics
from mmrl.core.rewards import Reward, reward_atom
from mmrl.core.trainer import Trainer, TrainingError


def make(tmp_path, *overrides, name="run"):
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG,
                      overrides=[f"output_dir={tmp_path / name}", *overrides])
    policy, task = toy.build(cfg)
    return Trainer(cfg, policy, task)


def weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.policy.model.state_dict().items()}


def raise_on_call(obj, name: str, at: int, error: BaseException) -> None:
    """obj.<name> raises `error` on its `at`-th call, and works as before on the others."""
    fn, calls = getattr(obj, name), {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == at:
            raise error
        return fn(*args, **kwargs)

    setattr(obj, name, wrapped)


def test_reward_rises_and_every_parameter_changes(tmp_path):
    trainer = make(tmp_path, "train.max_steps=30")
    before = weights(trainer)
    summary = trainer.train()
    after = weights(trainer)
    assert set(before) == set(after)
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert unchanged == [], f"parameters that never changed: {unchanged}"
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 30 and all(torch.isfinite(torch.tensor(r["loss/total"])) for r in rows)
    first = sum(r["reward/total"] for r in rows[:5]) / 5
    last = sum(r["reward/total"] for r in rows[-5:]) / 5
    assert last > first + 0.1, (first, last)  # sampled reward: 0.08 -> 0.25 at seed 0
    # Held-out greedy accuracy on the successor task: ~chance before, most digits after.
    assert summary["eval_after"]["accuracy"] >= summary["eval_before"]["accuracy"] + 0.4


def test_run_writes_its_outputs(tmp_path):
    trainer = make(tmp_path, "train.max_steps=3", "train.log_samples_every=3", "logging.tensorboard=true")
    trainer.train()
    out = tmp_path / "run"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    assert set(summary["eval_before"]) == set(summary["eval_after"]) == {"accuracy"}
    assert summary["config"]["train"]["max_steps"] == 3
    assert len(read_metrics(out / "metrics.jsonl")) == 3
    assert (out / "reward_curve.png").stat().st_size > 1000
    assert (out / "config.yaml").is_file()
    rows = [json.loads(x) for x in (out / "samples" / "step_00000003.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * 8 and {"prompt", "completion", "reward", "atoms", "advantage"} <= set(rows[0])
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tensorboard").iterdir())
    # TensorBoard's held-out curve spans the run: the evaluations before and after it, as summary.json
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    curve = [(e.step, e.value) for e in events.Scalars("eval/accuracy")]
    assert curve == [(0, pytest.approx(summary["eval_before"]["accuracy"])),
                     (3, pytest.approx(summary["eval_after"]["accuracy"]))]
    # The checkpoint loads through the real from_pretrained and equals the trained weights.
    loaded = LlamaForCausalLM.from_pretrained(summary["checkpoint"])
    for k, v in trainer.policy.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_train_returns_the_keys_its_docstring_names(tmp_path):
    """help(Trainer.train) in a notebook: the summary keys it names are the ones returned."""
    named = re.findall(r"`(\w+)`", Trainer.train.__doc__.split("`resume`")[0])
    assert {"eval_before", "eval_after", "steps", "checkpoint", "final_metrics", "config"} <= set(named)
    summary = make(tmp_path, "train.max_steps=1").train()
    assert set(named) <= set(summary) and summary["steps"] == 1
    assert Path(summary["checkpoint"]).is_dir() and summary["final_metrics"]["step"] == 1


def test_resume_2_plus_2_equals_4_steps(tmp_path):
    full = make(tmp_path, "train.max_steps=4", name="full")
    full.train()
    first = make(tmp_path, "train.max_steps=2", name="split")
    first.train()
    second = make(tmp_path, "train.max_steps=4", name="split")
    second.train(resume=True)
    for k, v in weights(full).items():
        assert torch.equal(v, weights(second)[k]), k
    assert comparable(read_metrics(tmp_path / "full" / "metrics.jsonl")) == comparable(
        read_metrics(tmp_path / "split" / "metrics.jsonl"))


def test_crash_then_resume_equals_uninterrupted(tmp_path):
    """A run dies in step 4 (after the step-2 checkpoint, with step 3 logged);
    --resume rewinds to step 2 and ends bit-identical to a run never interrupted.
    The LR schedule is cosine with warm-up, so the schedule state matters too."""
    args = ("train.max_steps=5", "train.save_every=2", "optim.schedule=cosine", "optim.warmup_steps=2",
            "train.mini_batches=2", "train.ppo_epochs=2")
    full = make(tmp_path, *args, name="full")
    full.train()

    crashing = make(tmp_path, *args, name="crash")
    raise_on_call(crashing.policy, "generate", at=4, error=KeyboardInterrupt("simulated kill"))
    with pytest.raises(KeyboardInterrupt):
        crashing.train()
    assert [s for s, _ in list_checkpoints(tmp_path / "crash" / "checkpoints")] == [2]
    assert len(read_metrics(tmp_path / "crash" / "metrics.jsonl")) == 3

    resumed = make(tmp_path, *args, name="crash")
    resumed.train(resume=True)
    for k, v in weights(full).items():
        assert torch.equal(v, weights(resumed)[k]), k
    assert comparable(read_metrics(tmp_path / "full" / "metrics.jsonl")) == comparable(
        read_metrics(tmp_path / "crash" / "metrics.jsonl"))
    full_summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    resumed_summary = json.loads((tmp_path / "crash" / "summary.json").read_text())
    assert full_summary["eval_before"] == resumed_summary["eval_before"]
    assert full_summary["eval_after"] == resumed_summary["eval_after"]


@pytest.mark.parametrize("where", ["reward", "evaluation"])
def test_a_failing_reward_atom_keeps_the_finished_steps(tmp_path, where):
    """A reward atom that raises in step 4's rollout (or an evaluation after step 3) with the
    last checkpoint at step 2: step 3 is saved as it finished, and --resume with the cause
    gone ends bit-identical to a run that never failed."""
    from mmrl.core.rewards import RewardError

    args = ("train.max_steps=5", "train.save_every=2", "train.eval_every=3", "optim.schedule=cosine",
            "optim.warmup_steps=2")
    full = make(tmp_path, *args, name="full")
    full.train()

    failing = make(tmp_path, *args, name="fail")
    if where == "reward":
        score, calls = failing.scheduler.reward.score, {"n": 0}

        def fails_in_step_4(samples):
            calls["n"] += 1
            if calls["n"] == 4:
                raise RewardError("reward atom 'judge' failed on sample 0: ConnectionError", "judge", 0)
            return score(samples)

        failing.scheduler.reward.score = fails_in_step_4
    else:
        evaluate = failing.evaluate
        failing.evaluate = lambda **kw: (_ for _ in ()).throw(RewardError("judge down")) if (
            failing.step == 3 and kw.get("samples_tag") is None) else evaluate(**kw)  # the periodic one
    with (pytest.warns(UserWarning, match=r"RewardError stopped the run (in step 4|in the evaluation after step 3); the steps "
                                         r"finished before it are "
                                         r"saved as checkpoint .*step-00000003: `train -o \S+fail --resume`"),
          pytest.raises(RewardError)):
        failing.train()
    assert [s for s, _ in list_checkpoints(tmp_path / "fail" / "checkpoints")] == [2, 3]
    assert [r["step"] for r in read_metrics(tmp_path / "fail" / "metrics.jsonl")] == [1, 2, 3]

    resumed = make(tmp_path, *args, name="fail")
    resumed.train(resume=True)
    for k, v in weights(full).items():
        assert torch.equal(v, weights(resumed)[k]), k
    full_rows, rows = (comparable(read_metrics(tmp_path / name / "metrics.jsonl")) for name in ("full", "fail"))
    if where == "evaluation":  # step 3's row was logged without the evaluation that failed
        full_rows[2] = {k: v for k, v in full_rows[2].items() if not k.startswith("eval/")}
    assert rows == full_rows


def test_a_failure_inside_the_update_saves_nothing(tmp_path):
    trainer = make(tmp_path, "train.max_steps=4", "train.save_every=2")
    raise_on_call(trainer, "update", at=3, error=RuntimeError("out of memory"))  # one update a step
    with pytest.raises(RuntimeError, match="out of memory"):
        trainer.train()
    assert [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [2]


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_gradient_accumulation_matches_one_big_batch(tmp_path, aggregation):
    """8 micro-batches of 4 samples give the same update as one batch of 32 (float tolerance)."""
    agg = f"method.loss.aggregation={aggregation}"
    one = make(tmp_path, "train.max_steps=1", agg, name="one")
    one.train()
    acc = make(tmp_path, "train.max_steps=1", agg, "train.micro_batch_size=4", name="acc")
    acc.train()
    start = weights(make(tmp_path, name="start"))
    for k, v in weights(one).items():
        w_acc = weights(acc)[k]
        assert not torch.equal(v, start[k])
        torch.testing.assert_close(w_acc, v, rtol=1e-5, atol=1e-6)


def test_dynamic_sampling_drops_and_refills(tmp_path):
    """With dynamic sampling, every trained group has reward variance; dropped groups are counted."""
    trainer = make(tmp_path, "method.dynamic_sampling.enabled=true", "method.dynamic_sampling.max_rounds=5",
                   "rollout.num_generations=2")
    dropped = 0
    for _ in range(3):
        batch, metrics = trainer.scheduler.next_groups(version=0)
        dropped += metrics["rollout/groups_dropped"]
        assert metrics["rollout/rounds"] >= 1
        if batch is None:
            continue
        assert batch.num_groups <= 4
        for rows in batch.groups():
            r = batch.rewards[rows]
            assert r.max() > r.min()  # no zero-variance group reached the trainer
    # At chance level most groups of two samples score equal (both 0): they must be dropped.
    assert dropped > 0


def _counted_rounds(trainer, monkeypatch):
    """Each round's samples report a decoded length of its round number (stat/length), and the
    scheduler's clock ticks by 1 a reading: a round's rollout and its reward each take 1."""
    from types import SimpleNamespace

    from mmrl.core import scheduler

    generate, rounds = trainer.policy.generate, []

    def counted(prompts, n, rc, generator):
        batch = generate(prompts, n, rc, generator)
        rounds.append(len(batch))
        batch.data["stat/length"] = torch.full((len(batch),), float(len(rounds)))
        return batch

    monkeypatch.setattr(trainer.policy, "generate", counted)
    ticks = iter(range(1000))
    monkeypatch.setattr(scheduler, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    return rounds


def test_refill_rounds_draw_only_the_missing_groups_and_count_what_they_cost(tmp_path, monkeypatch):
    """4 prompts a step, a filter dropping every draw index divisible by 3: round 1 draws 0-3 and
    keeps 1, 2; round 2 draws just the 2 missing (4, 5) and keeps both. Rounds, drops, the stream's
    position, the samples (3 generations asked for), the decoded tokens of both rounds (12 x 1 +
    6 x 2 = 24, dropped groups too), the time of both, and the round-1 rollout stats are reported."""
    trainer = make(tmp_path, "method.dynamic_sampling.enabled=true", "method.dynamic_sampling.max_rounds=2",
                   "rollout.num_generations=2")
    trainer.method.keep_groups = lambda b: b.group_ids % 3 != 0
    rounds = _counted_rounds(trainer, monkeypatch)
    batch, metrics = trainer.scheduler.next_groups(version=7, num_generations=3)
    assert rounds == [12, 6] and trainer.stream.position == 6
    assert batch.group_ids.tolist() == [1, 1, 1, 2, 2, 2, 4, 4, 4, 5, 5, 5] and batch.policy_version == 7
    assert batch.data["request_tag"].tolist() == [0] * 12
    assert {k: metrics[k] for k in ("rollout/rounds", "rollout/groups_dropped", "rollout/groups", "rollout/samples",
                                    "rollout/decoded_tokens", "time/rollout", "time/reward", "rollout/length")} == {
        "rollout/rounds": 2, "rollout/groups_dropped": 2, "rollout/groups": 4, "rollout/samples": 12,
        "rollout/decoded_tokens": 24.0, "time/rollout": 2.0, "time/reward": 2.0, "rollout/length": 1.0}


def test_refills_stop_after_max_rounds_and_not_without_dynamic_sampling(tmp_path, monkeypatch):
    """A filter dropping every group: 1 + max_rounds (2) rounds of 4 prompts, then no batch; with
    dynamic sampling off the same filter gets one round and what it kept."""
    trainer = make(tmp_path, "method.dynamic_sampling.enabled=true", "method.dynamic_sampling.max_rounds=2",
                   "rollout.num_generations=2")
    trainer.method.keep_groups = lambda b: torch.zeros(len(b), dtype=torch.bool)
    batch, metrics = trainer.scheduler.next_groups(version=0)
    assert batch is None and trainer.stream.position == 12
    assert metrics["rollout/rounds"] == 3 and metrics["rollout/groups_dropped"] == 12
    off = make(tmp_path, "method.dynamic_sampling.enabled=false", "method.dynamic_sampling.max_rounds=2",
               "rollout.num_generations=2", name="off")
    off.method.keep_groups = lambda b: b.group_ids % 3 != 0
    batch, metrics = off.scheduler.next_groups(version=0)
    assert batch.group_ids.unique().tolist() == [1, 2] and off.stream.position == 4
    assert metrics["rollout/rounds"] == 1 and metrics["rollout/groups_dropped"] == 2


def test_one_process_deals_no_groups_out_and_logs_no_trimmed_count(tmp_path, monkeypatch):
    """Balancing shares is for several processes: one process keeps its groups as rolled out and
    its step logs no rollout/groups_trimmed (not even 0)."""
    trainer = make(tmp_path, "rollout.num_generations=2")
    batch, metrics = trainer.scheduler.next_groups(version=0)
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert "rollout/groups_trimmed" not in metrics


def test_an_engine_returning_too_few_samples_is_an_error(tmp_path, monkeypatch):
    """Groups must be complete: a rollout with a sample missing stops the step."""
    trainer = make(tmp_path, "rollout.num_generations=2")
    generate = trainer.policy.generate

    def one_short(*args):
        batch = generate(*args)
        return batch.select(torch.arange(len(batch) - 1))

    monkeypatch.setattr(trainer.policy, "generate", one_short)
    with pytest.raises(RuntimeError, match="returned 7 samples for 4 prompts x 2 generations"):
        trainer.scheduler.next_groups(version=0)


def test_an_engine_returning_too_many_samples_is_an_error(tmp_path, monkeypatch):
    """A group is exactly num_generations samples: a rollout with one sample too many (9 for
    4 prompts x 2) stops the step like one with a sample missing."""
    trainer = make(tmp_path, "rollout.num_generations=2")
    generate = trainer.policy.generate

    def one_over(*args):
        batch = generate(*args)
        return batch.select(torch.arange(len(batch) + 1) % len(batch))  # rows 0..7, then 0 again

    monkeypatch.setattr(trainer.policy, "generate", one_over)
    with pytest.raises(RuntimeError, match="returned 9 samples for 4 prompts x 2 generations"):
        trainer.scheduler.next_groups(version=0)


def test_decoded_tokens_sum_the_lengths_and_are_zero_without_them():
    """What a round costs: the sum of its "stat/length" (3 + 4 + 0 = 7); a backend that does not
    report lengths costs 0, not one token a sample or a round."""
    from mmrl.core.batch import RolloutBatch
    from mmrl.core.rewards import Sample
    from mmrl.core.scheduler import decoded_tokens

    def batch(data):
        return RolloutBatch(group_ids=torch.tensor([0, 0, 1]), samples=[Sample(1, [2])] * 3, data=data)

    assert decoded_tokens(batch({"stat/length": torch.tensor([3, 4, 0])})) == 7.0
    assert decoded_tokens(batch({})) == 0.0


def test_round_metrics_log_the_mean_of_integer_and_bool_stats():
    """rollout/<x> is the mean of "stat/<x>" whatever its dtype: lengths 3, 4, 6, 7 (long) give
    5.0, truncated True, False, False, True (bool) 0.5; other data is not logged."""
    from mmrl.core.batch import RolloutBatch
    from mmrl.core.rewards import Sample
    from mmrl.core.scheduler import round_metrics

    samples = [Sample(p, [(p + 1) % 10]) for p in range(4)]  # every answer right: reward/total 1
    batch = RolloutBatch(group_ids=torch.tensor([0, 0, 1, 1]), samples=samples,
                         scores=toy.ToyTask().reward.score(samples),
                         data={"stat/length": torch.tensor([3, 4, 6, 7]),
                               "stat/truncated": torch.tensor([True, False, False, True]),
                               "input_ids": torch.zeros(4, 3, dtype=torch.long)})
    metrics = round_metrics(batch)
    assert metrics["rollout/length"] == 5.0 and metrics["rollout/truncated"] == 0.5
    assert metrics["reward/total"] == 1.0
    assert not any("input_ids" in k for k in metrics)


def _with_prune(trainer, prune):
    """The trainer's method with `prune` (group -> bool/float [G] or None) as its own hook."""
    trainer.method.__class__ = type("Pruning", (type(trainer.method),), {"prune": lambda self, group: prune(group)})


def test_prune_answers_mix_per_group_selections_and_weights(tmp_path):
    """Groups 0-3 of 2 samples: group 0 keeps its 2nd sample (bool), group 1 weighs its samples
    0 and 0.5, groups 2, 3 answer None (keep all). One weighted answer turns every answer into
    weights: 6 rows remain, with loss weights 1 1 0.5 1 1 1 (a bool True is weight 1), 2 pruned."""
    from mmrl.core.batch import SAMPLE_WEIGHT

    trainer = make(tmp_path, "rollout.num_generations=2")
    answers = {0: torch.tensor([False, True]), 1: torch.tensor([0.0, 0.5])}
    _with_prune(trainer, lambda group: answers.get(int(group.group_ids[0])))
    batch, metrics = trainer.scheduler.next_groups(version=0)
    assert batch.group_ids.tolist() == [0, 1, 2, 2, 3, 3]
    assert batch.data[SAMPLE_WEIGHT].tolist() == [1.0, 0.5, 1.0, 1.0, 1.0, 1.0]
    assert metrics["rollout/samples_pruned"] == 2 and metrics["rollout/samples"] == 6


def test_prune_answers_of_only_selections_leave_the_loss_weights_alone(tmp_path):
    """Bool answers only: rows are selected, no loss weight is written."""
    from mmrl.core.batch import SAMPLE_WEIGHT

    trainer = make(tmp_path, "rollout.num_generations=2")
    _with_prune(trainer, lambda group: torch.tensor([True, False]) if int(group.group_ids[0]) == 3 else None)
    batch, metrics = trainer.scheduler.next_groups(version=0)
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3] and SAMPLE_WEIGHT not in batch.data
    assert metrics["rollout/samples_pruned"] == 1


def test_prune_weights_are_kept_in_float32(tmp_path):
    """A weighted prune answer is a float32 loss weight as given: 0.1 stays float32's 0.1
    (float16 would make it 0.0999755859375), and a None group weighs exactly 1."""
    from mmrl.core.batch import SAMPLE_WEIGHT

    trainer = make(tmp_path, "rollout.num_generations=2")
    _with_prune(trainer, lambda group: torch.tensor([0.1, 0.3]) if int(group.group_ids[0]) == 0 else None)
    batch, metrics = trainer.scheduler.next_groups(version=0)
    weight = batch.data[SAMPLE_WEIGHT]
    assert weight.dtype == torch.float32 and metrics["rollout/samples_pruned"] == 0
    assert torch.equal(weight, torch.tensor([0.1, 0.3, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float32))


def test_a_methods_extra_samples_join_their_group_and_are_counted(tmp_path, monkeypatch):
    """A method asking 2 more samples (tag 1) of group 1 only: they are generated with the same
    weights, scored, and sit right after the group's own 2 rows; 2 extra samples, 10 in all, and
    their decoded tokens (3 each, on the round's 8 x 1) are counted. The next step's extra
    samples (of group 5) are scored too and drawn with a seed of their own."""
    from mmrl.core.engine import PolicyEngine, Request

    trainer = make(tmp_path, "rollout.num_generations=2")

    def extra_requests(self, group):
        g = int(group.group_ids[0])
        return [Request(g, group.prompts[g], 2, tag=1)] if g % 4 == 1 else []

    trainer.method.__class__ = type("Resampling", (type(trainer.method),), {"extra_requests": extra_requests})
    generate, seeds, scored = PolicyEngine.generate, [], []

    def measured(self, requests, rc, seed):
        seeds.append(seed)
        batch = generate(self, requests, rc, seed)
        batch.data["stat/length"] = torch.full((len(batch),), 3.0)
        return batch

    monkeypatch.setattr(PolicyEngine, "generate", measured)
    _counted_rounds(trainer, monkeypatch)
    score = trainer.scheduler.reward.score
    monkeypatch.setattr(trainer.scheduler.reward, "score", lambda samples: scored.append(len(samples)) or score(samples))
    batch, metrics = trainer.scheduler.next_groups(version=5)
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 1, 1, 2, 2, 3, 3]
    assert batch.data["request_tag"].tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0]
    assert batch.samples[4].prompt == batch.samples[5].prompt == batch.prompts[1] and batch.policy_version == 5
    assert batch.scores is not None and len(batch.scores.total) == 10
    assert metrics["rollout/samples_extra"] == 2 and metrics["rollout/samples"] == 10
    assert metrics["rollout/decoded_tokens"] == 14.0
    batch, _ = trainer.scheduler.next_groups(version=6)
    assert batch.group_ids.tolist() == [4, 4, 5, 5, 5, 5, 6, 6, 7, 7]
    assert scored == [8, 2, 8, 2] and len(seeds) == 2 and seeds[0] != seeds[1]


def test_extra_samples_follow_their_groups_own_rows_in_order(tmp_path):
    """8 groups of 2, one extra sample (tag 1) asked for each: every group is its 2 rows as rolled
    out, in their order, then its extra one (a stable sort by group id; an unstable one mixes
    them from about 6 groups on)."""
    from mmrl.core.engine import Request

    trainer = make(tmp_path, "rollout.num_generations=2", "rollout.prompts_per_step=8")

    def extra_requests(self, group):
        g = int(group.group_ids[0])
        return [Request(g, group.prompts[g], 1, tag=1)]

    trainer.method.__class__ = type("OneMore", (type(trainer.method),), {"extra_requests": extra_requests})
    rolled = []
    generate = trainer.policy.generate
    trainer.policy.generate = lambda *a: rolled.append(generate(*a)) or rolled[-1]
    batch, _ = trainer.scheduler.next_groups(version=0)
    assert batch.group_ids.tolist() == [g for g in range(8) for _ in range(3)]
    assert batch.data["request_tag"].tolist() == [0, 0, 1] * 8
    own = [s.completion for s in rolled[0].samples]  # the round's 16 rows, group by group
    assert [s.completion for i, s in enumerate(batch.samples) if i % 3 != 2] == own


def test_a_batch_the_method_keeps_trains_without_a_rollout(tmp_path):
    """stored_batch: the scheduler draws no prompts and rolls nothing out, but gives that batch
    fresh advantages; the step reports no rounds and the batch's own groups and samples."""
    trainer = make(tmp_path, "rollout.num_generations=2")
    kept, _ = trainer.scheduler.next_groups(version=0)
    kept.advantages = None
    trainer.method.stored_batch = lambda: kept
    batch, metrics = trainer.scheduler.next_groups(version=1)
    assert trainer.stream.position == 4 and batch.group_ids.tolist() == kept.group_ids.tolist()
    assert batch.advantages is not None and batch.policy_version == 0
    assert metrics["rollout/rounds"] == 0 and metrics["rollout/groups"] == 4 and metrics["rollout/samples"] == 8


def test_the_method_hooks_run_in_order_and_the_reference_sees_only_pruned_rows(tmp_path):
    """on_groups (here: keep groups 1 and 3) before annotate, advantages and prune (drop each
    group's 2nd row); the reference pass comes last, on the 2 rows left; pruning everything
    leaves no batch (and no reference pass)."""
    trainer = make(tmp_path, "rollout.num_generations=2")
    method, calls = trainer.method, []

    class Reference:
        def logprobs(self, batch):
            calls.append(("reference", batch.group_ids.tolist()))
            return torch.zeros(len(batch), batch.mask.shape[1])

    method.on_groups = lambda b: b.select(b.group_ids % 2 == 1)
    method.annotate = lambda policy, b: calls.append(("annotate", b.group_ids.tolist()))
    drop_second = [True, False]
    _with_prune(trainer, lambda group: torch.tensor(drop_second))
    trainer.scheduler.reference = Reference()
    batch, _ = trainer.scheduler.next_groups(version=0)
    assert calls == [("annotate", [1, 1, 3, 3]), ("reference", [1, 3])]
    assert batch.group_ids.tolist() == [1, 3] and batch.ref_logp.shape[0] == 2
    calls.clear()
    drop_second[0] = False
    batch, _ = trainer.scheduler.next_groups(version=0)
    assert batch is None and calls == [("annotate", [5, 5, 7, 7])]


def test_step_with_every_group_dropped_skips_the_update_and_counts_its_time(tmp_path):
    trainer = make(tmp_path, "train.max_steps=1")
    trainer.method.keep_groups = lambda batch: torch.zeros(len(batch), dtype=torch.bool)
    before = weights(trainer)
    with pytest.warns(UserWarning, match="every group was dropped"):
        metrics = trainer.train_step()
    assert metrics["train/skipped"] == 1.0 and metrics["rollout/groups_dropped"] > 0
    assert metrics["time/step"] >= metrics["time/rollout"] > 0
    for k, v in weights(trainer).items():
        assert torch.equal(v, before[k]), k
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per run, not once per step
        assert trainer.train_step()["train/skipped"] == 1.0


def test_summary_counts_the_steps_without_update(tmp_path):
    trainer = make(tmp_path, "train.max_steps=3")
    trainer.method.keep_groups = lambda batch: (None if trainer.step == 1 else  # step 2 trains
                                                torch.zeros(len(batch), dtype=torch.bool))
    with pytest.warns(UserWarning, match="every group was dropped"):
        summary = trainer.train()
    assert summary["steps"] == 3 and summary["steps_without_update"] == 2


def test_kl_reference_is_frozen_and_logged(tmp_path):
    trainer = make(tmp_path, "train.max_steps=3", "method.kl.beta=0.1", "method.kl.kind=k3")
    assert trainer.reference is not None
    ref_before = {k: v.clone() for k, v in trainer.reference.model.state_dict().items()}
    trainer.train()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert all("loss/kl" in r for r in rows) and rows[-1]["loss/kl"] > 0
    for k, v in trainer.reference.model.state_dict().items():
        assert torch.equal(v, ref_before[k])
    assert make(tmp_path, name="nokl").reference is None  # beta = 0: no reference at all


def test_non_finite_steps_are_skipped_then_stop_the_run(tmp_path):
    trainer = make(tmp_path, "train.max_steps=6", "train.save_every=1", "train.max_bad_steps=2")
    logprobs = trainer.policy.logprobs
    calls = {"n": 0}

    def poisoned(batch):
        calls["n"] += 1
        out = logprobs(batch)
        return out * float("nan") if calls["n"] > 2 else out

    trainer.policy.logprobs = poisoned
    with pytest.warns(UserWarning, match="non-finite"), pytest.raises(TrainingError, match="2 steps in a row"):
        trainer.train()
    # Steps 1-2 were good and saved; the bad steps 3-4 wrote no checkpoint.
    assert [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [1, 2]
    assert all(torch.isfinite(p).all() for p in trainer.policy.model.parameters())


def test_fresh_run_refuses_a_directory_with_checkpoints(tmp_path):
    make(tmp_path, "train.max_steps=1").train()
    with pytest.raises(TrainingError, match="--resume"):
        make(tmp_path, "train.max_steps=2").train()
    with pytest.raises(TrainingError, match="no complete checkpoint"):
        make(tmp_path, name="empty").train(resume=True)


def test_on_policy_first_update_has_ratio_one(tmp_path):
    """One epoch, one mini-batch: the ratio is 1 up to the rollout/recompute float noise."""
    trainer = make(tmp_path, "train.max_steps=1")
    trainer.train()
    row = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert abs(row["loss/ratio_mean"] - 1.0) < 1e-5
    assert row["loss/clip_frac"] == 0.0


CONFIGS = sorted((__import__("pathlib").Path(__file__).parents[1] / "configs").rglob("*.yaml"))


def _grpo_family(path) -> bool:
    import yaml

    return (yaml.safe_load(path.read_text()) or {}).get("method", {}).get("type") == "grpo"


# The VLM methods beyond the GRPO family (axpo, vppo, pacg, cora, dspo) need the VLM backend
# (tool rollouts, images, their task); tests/vlm runs them.
@pytest.mark.parametrize("path", [p for p in CONFIGS if p.parent.name == "vlm" and _grpo_family(p)],
                         ids=lambda p: p.name)
def test_grpo_family_presets_train_on_the_toy_task(tmp_path, path):
    """Each GRPO-family preset (GRPO, Dr.GRPO, DAPO, GSPO, RLOO) runs the loop: finite loss,
    weights move."""
    cfg = load_config(TrainConfig, path, defaults=toy.DEFAULT_CONFIG,
                      overrides=[f"output_dir={tmp_path}", "train.max_steps=2"])
    policy, task = toy.build(cfg)
    trainer = Trainer(cfg, policy, task)
    start = weights(trainer)
    trainer.train()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2
    assert any(not torch.equal(v, weights(trainer)[k]) for k, v in start.items())
    assert all(isinstance(r.get("loss/total"), float) for r in rows if r.get("train/updates"))


def write_even_first_atom(tmp_path) -> None:
    """tmp_path/atoms.py: a config reward atom, 1 where the completion's first token is even."""
    (tmp_path / "atoms.py").write_text(
        "from mmrl.core.rewards import reward_atom\n"
        "@reward_atom('even_first', weight=0.25)\n"
        "def even_first(sample):\n"
        "    return sample.completion[0] % 2 == 0\n"
    )


def test_config_reward_atoms_join_the_task_reward(tmp_path):
    write_even_first_atom(tmp_path)
    (tmp_path / "run.yaml").write_text("reward:\n  atoms: [atoms.py:even_first]\n  on_error: zero\n")
    cfg = load_config(TrainConfig, tmp_path / "run.yaml", defaults=toy.DEFAULT_CONFIG,
                      overrides=[f"output_dir={tmp_path / 'out'}", "train.max_steps=1"])
    trainer = Trainer(cfg, *toy.build(cfg))
    assert trainer.reward.names == ["answer", "stop", "even_first"]
    assert trainer.reward.on_error == "zero"
    trainer.train()
    row = read_metrics(tmp_path / "out" / "metrics.jsonl")[0]
    assert 0.0 <= row["reward/even_first"] <= 1.0


def test_bad_config_atom_is_a_config_error(tmp_path):
    from mmrl.core.config import ConfigError

    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG,
                      overrides=[f"output_dir={tmp_path}", "reward.atoms=[missing.py:fn]"])
    with pytest.raises(ConfigError, match="reward.atoms.*missing.py"):
        Trainer(cfg, *toy.build(cfg))


@pytest.mark.parametrize("name, refused", [("accuracy", True), ("reward", True), ("nfe", True), ("pass@4", True),
                                           ("hard/count", False), ("atom_accuracy", False)])
def test_config_atom_named_like_one_of_the_tasks_eval_metrics_is_a_config_error(tmp_path, name, refused):
    """Evaluation logs each atom's mean under its bare name: an atom called like one of the
    task's own metrics (its metric_names, metric_prefixes) would overwrite it, so the name is
    refused before the run starts; another task's metric names are free."""
    from mmrl.core.config import ConfigError

    (tmp_path / "atoms.py").write_text(
        "from mmrl.core.rewards import reward_atom\n"
        f"@reward_atom({name!r})\n"
        "def clash(sample):\n"
        "    return 1.0\n"
    )
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG,
                      overrides=[f"output_dir={tmp_path / 'out'}", f"reward.atoms=[{tmp_path / 'atoms.py'}:clash]"])
    policy, task = toy.build(cfg)
    task.metric_names, task.metric_prefixes = ("reward", "accuracy", "nfe"), ("pass@",)  # as the dLLM task's
    if not refused:
        assert name in Trainer(cfg, policy, task).reward.names
        return
    with pytest.raises(ConfigError, match=f"{name!r} is taken by an evaluation metric"):
        Trainer(cfg, policy, task)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.safetensors"))


def test_each_tasks_metric_names_cover_what_its_evaluation_logs():
    """The names a config atom may not take are those the task's evaluate() writes."""
    from diffusion_rl.task import DiffusionTask
    from dllm_rl.task import DLLMTask
    from mmrl.vlm.task import VLMTask

    assert {"reward", "accuracy", "tool_call_rate", "coverage", "inconsistency_rate"} <= set(VLMTask.metric_names)
    assert {"reward", "accuracy", "nfe", "sampled_nfe"} == set(DLLMTask.metric_names)
    assert {"reward", "atom_accuracy", "prompt_accuracy", "unparsed_prompts"} <= set(DiffusionTask.metric_names)
    assert "accuracy" not in DiffusionTask.metric_names  # diffusion logs atom_accuracy: the name is free there


def test_one_sample_per_group_is_a_config_error_before_any_rollout(tmp_path):
    """With G = 1 every advantage is 0 (each sample is its group's mean): a run would spend its
    compute learning nothing from the reward, so it is refused at the start."""
    from mmrl.core.config import ConfigError

    with pytest.raises(ConfigError, match=r"rollout.num_generations must be at least 2 to train"):
        make(tmp_path, "rollout.num_generations=1")
    assert not (tmp_path / "run").exists()
    make(tmp_path, "rollout.num_generations=2")


def test_a_reward_whose_atoms_all_weigh_zero_is_a_config_error_before_any_rollout(tmp_path):
    """Every weight 0: the total, and so every advantage, is 0 for every sample, and the run
    learnt nothing, silently. Training refuses it; evaluation (training=False) still reports
    the atoms' values."""
    from mmrl.core.config import ConfigError
    from mmrl.core.rewards import Reward, RewardAtom

    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[f"output_dir={tmp_path / 'run'}"])
    policy, task = toy.build(cfg)
    task.reward = Reward([RewardAtom(a.name, a.fn, weight=0, parents=a.parents) for a in task.reward.atoms])
    with pytest.raises(ConfigError, match=r"every reward atom has weight 0 \(answer, stop\): the reward's total is 0 "
                                          r"for every sample, so every advantage is 0 and nothing is learnt"):
        Trainer(cfg, policy, task)
    assert not (tmp_path / "run").exists()
    assert Trainer(cfg, policy, task, training=False).reward.names == ["answer", "stop"]
    task.reward = task.base_reward = Reward([RewardAtom("answer", task.reward.atoms[0].fn, weight=-1.0)])  # a negative one trains
    assert Trainer(cfg, policy, task).reward.weights.tolist() == [-1.0]


def test_resume_with_other_settings_keeps_the_earlier_config_and_says_what_changed(tmp_path):
    """--resume rewrites config.yaml with the settings it runs under. Where they differ from the
    run's in more than its length, the earlier record is kept beside it and a warning names the
    changes; a resume that only extends the run warns nothing."""
    make(tmp_path, "train.max_steps=1").train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make(tmp_path, "train.max_steps=2").train(resume=True)
    assert not list((tmp_path / "run").glob("config.before-*"))
    with pytest.warns(UserWarning, match=r"--resume at step 2 with settings that differ from the run's: "
                                         r"optim.lr: 0.003 -> 0.005\. The earlier config.yaml is kept as "
                                         r"config.before-step-2.yaml"):
        make(tmp_path, "train.max_steps=3", "optim.lr=0.005").train(resume=True)
    kept = (tmp_path / "run" / "config.before-step-2.yaml").read_text()
    assert "lr: 0.003" in kept and "lr: 0.005" in (tmp_path / "run" / "config.yaml").read_text()
    # that attempt stops before its first checkpoint; a third resume from step 2 compares with
    # the config that trained steps 1-2, and keeps its record
    for d in (tmp_path / "run" / "checkpoints").glob("step-00000003"):
        shutil.rmtree(d)
    with pytest.warns(UserWarning, match=r"optim.lr: 0.003 -> 0.007\. The earlier config.yaml is kept"):
        make(tmp_path, "train.max_steps=3", "optim.lr=0.007").train(resume=True)
    assert (tmp_path / "run" / "config.before-step-2.yaml").read_text() == kept


def test_resume_of_a_run_older_than_a_setting_warns_only_where_it_is_set_otherwise(tmp_path):
    """A run whose config.yaml predates a setting (written before it existed) resumes without a
    warning where the setting keeps its default, and with one where it is set to something else."""
    make(tmp_path, "train.max_steps=1").train()
    path = tmp_path / "run" / "config.yaml"
    old = yaml.safe_load(path.read_text())
    for key in ("master_weights", "betas", "shard_state"):
        del old["optim"][key]
    path.write_text(yaml.safe_dump(old))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make(tmp_path, "train.max_steps=2").train(resume=True)
    path.write_text(yaml.safe_dump(old))
    with pytest.warns(UserWarning, match=r"differ from the run's: optim.shard_state: None -> True\. "):
        make(tmp_path, "train.max_steps=3", "optim.shard_state=true").train(resume=True)


def test_resume_by_a_relative_path_is_the_same_run(tmp_path, monkeypatch):
    """config.yaml records the output folder's absolute path: a run started as -o run and
    resumed as -o /abs/run (or the reverse) has not changed its settings."""
    monkeypatch.chdir(tmp_path)
    Trainer(*_toy_run("run", "train.max_steps=1")).train()
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["output_dir"] == str(tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make(tmp_path, "train.max_steps=2").train(resume=True)
        Trainer(*_toy_run("run", "train.max_steps=3")).train(resume=True)
    assert not list((tmp_path / "run").glob("config.before-*"))


def _toy_run(output_dir, *overrides):
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[f"output_dir={output_dir}", *overrides])
    return (cfg, *toy.build(cfg))


def test_resume_with_another_lr_weight_decay_or_group_size_trains_with_them(tmp_path):
    """The optimizer and schedule state carry the earlier lr and weight decay, and the trainer
    state the earlier G: the values a resume says it changed are the ones it trains with."""
    make(tmp_path, "train.max_steps=2", "optim.lr=0.003", "rollout.num_generations=2").train()
    trainer = make(tmp_path, "train.max_steps=3", "optim.lr=0.005", "optim.weight_decay=0.5",
                   "optim.betas=[0.8,0.99]", "rollout.num_generations=4")
    with pytest.warns(UserWarning, match="optim.lr: 0.003 -> 0.005"):
        trainer.train(resume=True)
    (group,) = trainer.optimizer.param_groups
    assert (group["lr"], group["weight_decay"], group["betas"]) == (0.005, 0.5, (0.8, 0.99))
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [(r["optim/lr"], r["rollout/group_size"]) for r in rows] == [(0.003, 2), (0.003, 2), (0.005, 4)]


def test_resume_with_another_lr_gives_it_as_the_last_lr_before_any_update(tmp_path):
    """The loaded schedule state carries the earlier run's last lr (0.003 x 0 at the end of its
    linear decay): get_last_lr and the optimizer's lr, which a step whose updates are all
    skipped (non-finite) logs as optim/lr, give the new one at once, not the old lr."""
    make(tmp_path, "train.max_steps=2", "optim.lr=0.003", "optim.schedule=linear").train()
    trainer = make(tmp_path, "train.max_steps=4", "optim.lr=0.005", "optim.schedule=linear")
    trainer.load(list_checkpoints(tmp_path / "run" / "checkpoints")[-1][1])
    # 2 of 4 updates done: 0.005 x (1 - 2 / 4)
    assert trainer.lr_scheduler.get_last_lr() == [pytest.approx(0.0025)] == [trainer.optimizer.param_groups[0]["lr"]]


@pytest.mark.parametrize("tamper", ["missing", "shape"])
def test_resume_refuses_raw_weights_that_do_not_fit_the_model(tmp_path, monkeypatch, tamper):
    """An averaged run's checkpoint keeps the raw weights apart (model/ is the average). One
    missing, or of another shape (a [1, 32] row would spread silently over the [12, 32]
    embedding through copy_'s broadcasting), is refused naming the checkpoint."""
    from safetensors.torch import load_file, save_file

    from diffusion_rl.ema import ParameterEMA
    from mmrl.core.checkpoint import STATE_TENSORS
    from mmrl.core.method import Method

    monkeypatch.setattr(Method, "weight_average", lambda self, params: ParameterEMA(params, 0.5, 1, warmup=False))
    make(tmp_path, "train.max_steps=1").train()
    path = list_checkpoints(tmp_path / "run" / "checkpoints")[-1][1]
    tensors = load_file(path / STATE_TENSORS)
    assert tensors["weights.0"].shape == (12, 32)  # the embedding
    if tamper == "missing":
        del tensors["weights.0"]
    else:
        tensors["weights.0"] = tensors["weights.0"][:1].clone()
    save_file(tensors, path / STATE_TENSORS)
    trainer = make(tmp_path, "train.max_steps=2")
    with pytest.raises(TrainingError, match=rf"--resume: the raw weights saved in {re.escape(str(path))} do not "
                                            rf"fit the model's {len(trainer.params)} trainable parameters"):
        trainer.load(path)


def test_progress_without_a_terminal_is_a_plain_line_every_five_percent(tmp_path, capsys):
    from mmrl.core.logging import RunLogger

    logger = RunLogger(tmp_path, total_steps=40, tensorboard=False, progress=True)  # pytest's stderr: no tty
    for step in range(1, 41):
        logger.log(step, {"reward/total": step / 40})
    logger.close()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[2] for line in lines] == [f"{s}/40" for s in range(2, 41, 2)]
    assert lines[-1].startswith("train step 40/40  reward 1.000  ") and lines[-1].endswith(" s/step")
    assert all(re.search(r" s/step  ~\d+s left$", line) for line in lines[:-1])  # none after the last step
    RunLogger(tmp_path / "quiet", total_steps=40, tensorboard=False, progress=False).log(2, {})
    assert capsys.readouterr().err == ""


def test_a_plain_progress_line_says_the_time_left_at_the_latest_pace(tmp_path, capsys, monkeypatch):
    from mmrl.core import logging as run_logging

    clock = iter([0.0, 30.0, 100.0, 3700.0])  # the logger's start, then after steps 1, 2 and 3
    monkeypatch.setattr(run_logging, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    logger = run_logging.RunLogger(tmp_path, total_steps=4000, tensorboard=False, progress=True)
    logger._every = 1
    for step in (1, 2, 3):
        logger.log(step, {})
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["train step 1/4000  30.00 s/step  ~33h19m left",  # 3999 x 30 s
                     "train step 2/4000  70.00 s/step  ~77h44m left",  # 3998 x 70 s
                     "train step 3/4000  3600.00 s/step  ~3997h00m left"]
    assert [run_logging._duration(s) for s in (0.4, 59.6, 187, 3599, 7500)] == ["0s", "1m00s", "3m07s", "59m59s", "2h05m"]


def test_each_held_out_evaluation_is_said_as_it_starts_and_ends_and_left_out_of_the_pace(tmp_path, capsys, monkeypatch):
    # minutes on a large model: before, nothing was said, and the first s/step took the time in
    from mmrl.core import logging as run_logging

    trainer = make(tmp_path, "train.max_steps=4", "train.eval_every=2", "logging.progress=true",
                   "logging.tensorboard=false")
    evaluate, paused = trainer.evaluate, []
    monkeypatch.setattr(run_logging.RunLogger, "pause", lambda self, seconds: paused.append(seconds))
    monkeypatch.setattr(trainer, "evaluate", lambda **kw: (time.sleep(0.05), evaluate(**kw))[1])
    trainer.train()
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("held-out")]
    assert [line.split(":")[0] for line in said] == [
        "held-out evaluation before training ...", "held-out evaluation before training",
        "held-out evaluation at step 2 ...", "held-out evaluation at step 2",
        "held-out evaluation after training ...", "held-out evaluation after training"]
    assert all(re.fullmatch(r"held-out evaluation .+: \d+\.\d s", line) for line in said[1::2])
    assert len(paused) == 3 and all(s >= 0.05 for s in paused)  # each evaluation's time, out of the pace
    make(tmp_path, "train.max_steps=1", "logging.progress=false", name="quiet").train()
    assert "held-out" not in capsys.readouterr().err


def test_time_spent_outside_the_steps_is_left_out_of_their_pace(tmp_path, capsys, monkeypatch):
    from mmrl.core import logging as run_logging

    clock = iter([0.0, 50.0, 60.0])  # the start; step 1 ends at 50 s, of which 40 s an evaluation; step 2 at 60 s
    monkeypatch.setattr(run_logging, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    logger = run_logging.RunLogger(tmp_path, total_steps=10, tensorboard=False, progress=True)
    logger._every = 1
    logger.pause(40.0)
    logger.log(1, {})
    logger.log(2, {})
    assert capsys.readouterr().err.splitlines() == ["train step 1/10  10.00 s/step  ~1m30s left",
                                                    "train step 2/10  10.00 s/step  ~1m20s left"]


def _grads_at_step(trainer):
    """Record each optimizer step's gradient (after clipping), flattened."""
    seen, step = [], trainer.optimizer.step

    def recording(*a, **kw):
        seen.append(torch.cat([p.grad.flatten() for p in trainer.params if p.grad is not None]).clone())
        return step(*a, **kw)

    trainer.optimizer.step = recording
    return seen


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_gradients_are_clipped_to_max_grad_norm(tmp_path):
    """The step's gradient norm is at most optim.max_grad_norm; the logged norm is the one
    before clipping (Adam would hide a missing clip in the weights: the gradient shows it)."""
    clipped, free = make(tmp_path, "optim.max_grad_norm=0.001", name="a"), make(tmp_path, "optim.max_grad_norm=null", name="b")
    batch, _ = clipped.scheduler.next_groups(version=0)
    grads = [_grads_at_step(t) for t in (clipped, free)]
    metrics = [t.update(batch) for t in (clipped, free)]
    assert metrics[0]["loss/grad_norm"] == pytest.approx(metrics[1]["loss/grad_norm"])
    assert metrics[1]["loss/grad_norm"] > 0.01
    assert float(grads[0][0].norm()) == pytest.approx(0.001, rel=1e-4)
    assert float(grads[1][0].norm()) == pytest.approx(metrics[1]["loss/grad_norm"], rel=1e-5)


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_micro_batches_of_a_method_without_a_denominator_weigh_by_their_share(tmp_path):
    """A method whose loss has no mini-batch normaliser returns each micro-batch's mean: the
    trainer weighs them by their share, so accumulation gives the unsplit gradient."""
    one, acc = make(tmp_path, name="one"), make(tmp_path, "train.micro_batch_size=8", name="acc")
    batch, _ = one.scheduler.next_groups(version=0)
    grads = []
    for t in (one, acc):
        t.method.loss_denominator = lambda b: None
        grads.append(_grads_at_step(t))
        t.update(batch)
    assert len(batch) == 32 and grads[0][0].abs().sum() > 0
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-4, atol=1e-7)


def test_the_kl_term_adds_beta_times_the_kl_to_the_loss(tmp_path):
    trainer = make(tmp_path, "method.kl.beta=0.1", "method.kl.kind=k3")
    batch, _ = trainer.scheduler.next_groups(version=0)
    with torch.no_grad():  # a reference apart from the policy, so the KL is not 0
        for p in trainer.reference.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        batch.ref_logp = trainer.reference.logprobs(batch)
    with_kl = trainer.method.loss(trainer.policy, batch, batch.advantages)
    trainer.method.needs_reference = False
    without = trainer.method.loss(trainer.policy, batch, batch.advantages)
    assert with_kl.metrics["loss/kl"] > 1e-4
    assert float(with_kl.loss) == pytest.approx(float(without.loss) + 0.1 * with_kl.metrics["loss/kl"], rel=1e-5)


def test_lr_warms_up_linearly_then_follows_the_schedule():
    from mmrl.core.config import OptimConfig
    from mmrl.core.trainer import lr_factor

    warm = [lr_factor(OptimConfig(warmup_steps=4, schedule="constant"), 10)(n) for n in range(6)]
    assert warm == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    linear = lr_factor(OptimConfig(warmup_steps=2, schedule="linear"), 12)
    assert [linear(n) for n in (2, 7, 12)] == [1.0, 0.5, 0.0]
    cosine = lr_factor(OptimConfig(warmup_steps=0, schedule="cosine"), 10)
    assert [cosine(n) for n in (0, 5)] == [1.0, pytest.approx(0.5)] and cosine(10) == pytest.approx(0.0)


def test_prompts_come_in_a_new_order_each_epoch_and_a_group_is_one_prompt(tmp_path):
    from mmrl.core.scheduler import PromptStream

    first, second = PromptStream(list(range(10)), seed=0).take(20)[0][:10], PromptStream(list(range(10)), seed=0).take(20)[0][10:]
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    trainer = make(tmp_path, "method.dynamic_sampling.enabled=true", "method.dynamic_sampling.max_rounds=5",
                   "rollout.num_generations=2")
    for _ in range(3):  # refill rounds relabel their groups by draw index: no two prompts share one
        batch, _ = trainer.scheduler.next_groups(version=0)
        if batch is not None:
            assert all(len(rows) == 2 for rows in batch.groups())
            assert set(batch.group_ids.tolist()) <= set(batch.prompts)  # each group's own prompt


def test_a_prompt_stream_draws_across_epochs_with_global_indices_and_resumes_where_it_stopped():
    """take(n): the next n prompts of the seeded epoch orders and their draw indices; the
    position (7 after 3 + 4) is the whole state, and a stream loaded with it goes on alike."""
    from mmrl.core.config import ConfigError
    from mmrl.core.scheduler import PromptStream

    stream = PromptStream(list("abcde"), seed=3)
    assert stream.take(3) == (["d", "a", "c"], [0, 1, 2])
    assert stream.take(4) == (["b", "e", "d", "b"], [3, 4, 5, 6])  # epoch 0 ends after "e"
    assert stream.position == 7 and stream.state_dict() == {"position": 7, "seed": 3, "size": 5}
    resumed = PromptStream(list("abcde"), seed=3)
    resumed.load_state_dict(stream.state_dict())
    assert resumed.position == 7 and resumed.take(3) == stream.take(3)
    for size, seed in ((5, 4), (6, 3)):  # another seed or another task: no resume
        with pytest.raises(ConfigError, match="resume needs the same task and seed"):
            resumed.load_state_dict({"position": 7, "seed": seed, "size": size})
    with pytest.raises(ValueError, match="no training prompts"):
        PromptStream([], seed=0)


def test_a_seeds_later_epochs_are_not_another_seeds_first():
    """Epoch orders are seeded by seed and epoch together: seed 0's second epoch is not seed 1's
    first (a run with seed 1 would otherwise replay a run with seed 0, one epoch behind)."""
    from mmrl.core.scheduler import PromptStream

    prompts = list(range(8))
    assert PromptStream(prompts, seed=0).take(16)[0][8:] != PromptStream(prompts, seed=1).take(8)[0]


def test_an_empty_share_of_a_mini_batch_adds_nothing_to_the_global_normaliser(tmp_path, monkeypatch):
    """With several processes a rank whose mini-batch is empty still joins the step, and its
    share of the loss normaliser is 0 (a method's denominator of no rows is not 0 for every
    aggregation): one row split over 2 mini-batches sums 1 row's normaliser, then 0."""
    from mmrl.core import distributed

    trainer = make(tmp_path, "train.mini_batches=2", "method.loss.aggregation=seq_mean_token_mean")
    batch, _ = trainer.scheduler.next_groups(version=0)
    summed = []
    monkeypatch.setattr(distributed, "sum_scalar", lambda x: summed.append(x) or x)
    monkeypatch.setattr(distributed, "sum_gradients", lambda params: None)
    trainer.world = 2  # as a rank of two
    metrics = trainer.update(batch.select(torch.arange(1)))
    one_row = trainer.method.loss_denominator(batch.select(torch.arange(1)))
    assert metrics["train/updates"] == 2  # both mini-batches stepped, the empty one too
    assert summed[0::2] == [one_row, 0.0]  # denominators (the loss values are summed between)


def test_float16_weights_are_refused_for_training(tmp_path):
    """Plain AdamW on float16 weights (no loss scaling) underflows and turns them inf."""
    from mmrl.core.config import ConfigError

    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[f"output_dir={tmp_path}"])
    policy, task = toy.build(cfg)
    policy.model.half()
    with pytest.raises(ConfigError, match="model.dtype float16 cannot train here"):
        Trainer(cfg, policy, task)
    # a float16 base under float32 LoRA adapters: the trainable weights are float32, the backward is not
    from mmrl.core.lora import LoRAConfig, add_lora

    policy, task = toy.build(cfg)
    policy.model = add_lora(policy.model.half(), LoRAConfig(r=2, target_modules=["q_proj"]))
    assert {p.dtype for p in policy.model.parameters() if p.requires_grad} == {torch.float32}
    with pytest.raises(ConfigError, match="float16 base under LoRA adapters"):
        Trainer(cfg, policy, task)
    Trainer(cfg, policy, task, training=False)  # evaluation takes it


def test_a_run_on_the_cpu_beside_a_gpu_says_so(tmp_path, monkeypatch):
    """The backends do not place models on a GPU yet: where one is present, the run says it trains on the CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.warns(UserWarning, match="a GPU is present but the model is on the CPU"):
        make(tmp_path)


def test_the_last_step_is_evaluated_once_by_the_final_evaluation(tmp_path):
    """eval_every evaluates between steps; the last step's evaluation is the final one
    (summary's eval_after), not a second one logged in its metrics row."""
    trainer = make(tmp_path, "train.max_steps=2", "train.eval_every=1")
    evaluate, calls = trainer.task.evaluate, []
    trainer.task.evaluate = lambda policy: calls.append(trainer.step) or evaluate(policy)
    trainer.train()
    assert calls == [0, 1, 2]  # before, after step 1, final
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert "eval/accuracy" in rows[0] and not any(k.startswith("eval/") for k in rows[1])


def test_mini_batches_are_a_new_shuffle_of_the_batch_each_epoch(tmp_path):
    trainer = make(tmp_path, "train.mini_batches=2", "train.ppo_epochs=2")
    batch, _ = trainer.scheduler.next_groups(version=0)
    seen, select = [], batch.select
    batch.select = lambda idx: seen.append(idx.tolist()) or select(idx)
    trainer.update(batch)
    minis = seen[:4]  # each epoch's two mini-batches
    assert [len(m) for m in minis] == [16] * 4
    assert sorted(minis[0] + minis[1]) == sorted(minis[2] + minis[3]) == list(range(32))
    assert minis[0] != list(range(16)) and minis[0] != minis[2]


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_as_one_of_two_ranks_the_loss_and_its_global_terms_are_scaled_for_the_sum(tmp_path, monkeypatch):
    """The ranks' gradients are summed, so a method without a denominator weighs each rank's mean
    by 1 / world; a share of a global term (loss/policy, with a global denominator) is logged
    times world, since combine_metrics averages the ranks' values. One process plays a rank of
    two whose collectives return its own values: its gradient and terms are those of one process,
    scaled so."""
    from mmrl.core import distributed

    monkeypatch.setattr(distributed, "sum_scalar", lambda x: x)
    monkeypatch.setattr(distributed, "sum_gradients", lambda params: None)
    for denominator in (True, False):
        one, two = (make(tmp_path, "optim.max_grad_norm=null", name=f"{denominator}{n}") for n in (1, 2))
        batch, _ = one.scheduler.next_groups(version=0)
        batch.advantages = batch.advantages + 0.5  # a loss/policy away from 0 (a group's advantages sum to 0)
        two.world = 2
        grads, metrics = [], []
        for t in (one, two):
            if not denominator:
                t.method.loss_denominator = lambda b: None
            grads.append(_grads_at_step(t))
            metrics.append(t.update(batch))
        assert float(grads[0][0].norm()) > 0
        if denominator:
            torch.testing.assert_close(grads[1][0], grads[0][0])
            assert metrics[1]["loss/policy"] == pytest.approx(2 * metrics[0]["loss/policy"])
            assert abs(metrics[0]["loss/policy"]) > 1e-6
        else:
            torch.testing.assert_close(grads[1][0], grads[0][0] / 2)
        assert metrics[1]["loss/ratio_mean"] == pytest.approx(metrics[0]["loss/ratio_mean"])


def update_with_gradient(trainer, batch, value: float) -> dict:
    """trainer.update(batch) with the last parameter's gradient set to `value` (non-finite: the
    update is skipped, with a warning)."""
    handle = trainer.params[-1].register_hook(lambda g: torch.full_like(g, value))
    try:
        with pytest.warns(UserWarning, match="non-finite"):
            return trainer.update(batch)
    finally:
        handle.remove()


def test_a_non_finite_gradient_of_a_finite_loss_skips_the_update(tmp_path):
    trainer = make(tmp_path)
    batch, _ = trainer.scheduler.next_groups(version=0)
    before = weights(trainer)
    metrics = update_with_gradient(trainer, batch, float("inf"))
    assert math.isfinite(metrics["loss/policy"])
    assert metrics["train/bad_step"] == 1.0 and metrics["train/updates"] == 0
    for k, v in weights(trainer).items():
        assert torch.equal(v, before[k]), k


def _poisoned(trainer, steps):
    """The trainer with a non-finite loss in the given steps (numbered from 1)."""
    logprobs = trainer.policy.logprobs
    trainer.policy.logprobs = lambda batch: logprobs(batch) * (float("nan") if trainer.step + 1 in steps else 1.0)
    return trainer


def test_non_finite_steps_stop_the_run_only_in_a_row(tmp_path):
    """train.max_bad_steps counts consecutive bad steps: a good step between two resets the count."""
    trainer = _poisoned(make(tmp_path, "train.max_steps=4", "train.max_bad_steps=2"), steps=(2, 4))
    with pytest.warns(UserWarning, match="non-finite"):
        summary = trainer.train()
    assert summary["steps"] == 4
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r.get("train/bad_step", 0.0) for r in rows] == [0.0, 1.0, 0.0, 1.0]


def test_evaluation_leaves_every_training_rng_where_it_was(tmp_path):
    """A task's evaluation may draw from Python's, NumPy's and torch's global RNGs: the training
    trajectory must not see it (resume reproduces a run whatever its evaluations drew)."""
    import random

    import numpy as np

    trainer = make(tmp_path)
    evaluate = trainer.task.evaluate

    def drawing(policy):
        random.random()
        np.random.rand()
        torch.rand(1)
        return evaluate(policy)

    trainer.task.evaluate = drawing
    python, numpy, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    trainer.evaluate()
    assert random.getstate() == python
    now = np.random.get_state()
    assert now[0] == numpy[0] and np.array_equal(now[1], numpy[1]) and now[2:] == numpy[2:]
    assert torch.equal(torch.get_rng_state(), torch_state)


def test_a_failure_in_the_first_step_saves_no_checkpoint(tmp_path):
    """Nothing finished, nothing to keep: no step-0 checkpoint that a fresh run would refuse."""
    from mmrl.core.rewards import RewardError

    trainer = make(tmp_path, "train.max_steps=2")

    def failing(samples):
        raise RewardError("judge down")

    trainer.scheduler.reward.score = failing
    with pytest.raises(RewardError):
        trainer.train()
    assert list_checkpoints(tmp_path / "run" / "checkpoints") == []
    make(tmp_path, "train.max_steps=1").train()  # a fresh run in the same directory is not refused


def test_resume_keeps_the_count_of_non_finite_steps_in_a_row(tmp_path):
    """A run whose last step was bad saves its count of bad steps in a row: a resumed run whose
    first step is bad again stops at max_bad_steps, as the uninterrupted run would."""
    first = _poisoned(make(tmp_path, "train.max_steps=2", "train.max_bad_steps=2"), steps=(2,))
    with pytest.warns(UserWarning, match="non-finite"):
        first.train()
    resumed = _poisoned(make(tmp_path, "train.max_steps=3", "train.max_bad_steps=2"), steps=(3,))
    with pytest.warns(UserWarning, match="non-finite"), pytest.raises(TrainingError, match="2 steps in a row"):
        resumed.train(resume=True)


def test_a_step_logs_each_loss_metric_as_its_mean_over_the_passes(tmp_path):
    """ppo_epochs x mini_batches optimizer steps, each of several micro-batches: a metric that is
    0.5 in every micro-batch is logged as 0.5."""
    trainer = make(tmp_path, "train.mini_batches=2", "train.ppo_epochs=2", "train.micro_batch_size=4")
    toy.log_constant(trainer.method, "x/constant", 0.5)
    batch, _ = trainer.scheduler.next_groups(version=0)
    metrics = trainer.update(batch)
    assert metrics["train/updates"] == 4
    assert metrics["x/constant"] == pytest.approx(0.5)


def test_a_batch_with_fewer_rows_than_mini_batches_logs_means_over_the_passes_that_ran(tmp_path):
    """Two rows in four mini-batches: two are empty and skipped, so a metric that is 0.5 in each
    pass that ran is logged as 0.5, not diluted by the skipped ones (it was 0.25). At lr 0 no
    pass moves the weights, so each one's ratio is exactly 1 whatever the draws' rewards."""
    trainer = make(tmp_path, "train.mini_batches=4", "optim.lr=0")
    toy.log_constant(trainer.method, "x/constant", 0.5)
    batch, _ = trainer.scheduler.next_groups(version=0)
    metrics = trainer.update(batch.select(torch.arange(2)))
    assert metrics["train/updates"] == 2
    assert metrics["x/constant"] == pytest.approx(0.5)
    assert metrics["loss/ratio_mean"] == pytest.approx(1.0)


def test_non_finite_weights_are_never_saved(tmp_path):
    trainer = make(tmp_path, "train.max_steps=1")
    with torch.no_grad():
        trainer.params[0].view(-1)[0] = float("nan")
    with pytest.raises(TrainingError, match="the weights are not finite"):
        trainer.save()
    assert list_checkpoints(tmp_path / "run" / "checkpoints") == []


def test_the_lr_schedule_spans_every_optimizer_step_of_the_run(tmp_path):
    """max_steps x ppo_epochs x mini_batches optimizer steps: a linear schedule over 2 x 2 x 2 = 8
    is at 0 after the last update. optim/lr is the mean lr of a step's updates: step 1's are
    0.002 x (8, 7, 6, 5) / 8, mean 0.002 x 26/32 = 0.001625; step 2's 0.002 x (4, 3, 2, 1) / 8,
    mean 0.002 x 10/32 = 0.000625."""
    trainer = make(tmp_path, "train.max_steps=2", "train.mini_batches=2", "train.ppo_epochs=2",
                   "optim.schedule=linear", "optim.lr=0.002")
    trainer.train()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["train/updates"] for r in rows] == [4, 4]
    assert [r["optim/lr"] for r in rows] == [pytest.approx(0.001625), pytest.approx(0.000625)]
    assert trainer.lr_scheduler.get_last_lr() == [pytest.approx(0.0, abs=1e-12)]


def test_a_finished_runs_kept_summary_is_never_overwritten(tmp_path):
    """Resumed at its last step with nothing to train, a run writes a second summary of that
    step: a later resume keeps the first (summary.step-N.json, with the run's own final
    evaluation), not the second."""
    trainer = make(tmp_path, "train.max_steps=3")
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.step-2.json").write_text(json.dumps({"steps": 2, "eval_after": {"accuracy": 0.5}}))
    (out / "summary.json").write_text(json.dumps({"steps": 2, "eval_after": {"accuracy": 0.25}}))
    trainer._keep_finished_summary()
    assert json.loads((out / "summary.step-2.json").read_text())["eval_after"] == {"accuracy": 0.5}


def test_resuming_a_run_at_its_last_step_says_there_is_nothing_to_train(tmp_path):
    make(tmp_path, "train.max_steps=1").train()
    with pytest.warns(UserWarning, match="the run is at step 1 and train.max_steps is 1: nothing to train"):
        summary = make(tmp_path, "train.max_steps=1").train(resume=True)
    assert summary["steps"] == 1


def test_the_lr_schedule_stays_at_its_end_past_the_last_update():
    """Past `total` updates the schedule's fraction is held at 1: linear stays at 0 (not below),
    cosine stays at 0 (not back up the cosine); a schedule that is all warm-up does not divide by 0."""
    from mmrl.core.config import OptimConfig
    from mmrl.core.trainer import lr_factor

    linear = lr_factor(OptimConfig(warmup_steps=2, schedule="linear"), 12)
    assert [linear(n) for n in (12, 13, 22)] == [0.0, 0.0, 0.0]  # frac = min(1, 11/10) = 1
    cosine = lr_factor(OptimConfig(warmup_steps=0, schedule="cosine"), 10)
    assert cosine(12) == pytest.approx(0.0, abs=1e-12)  # 0.5 (1 + cos pi), not 0.5 (1 + cos 1.2 pi) = 0.095
    only_warmup = lr_factor(OptimConfig(warmup_steps=4, schedule="linear"), 4)
    assert [only_warmup(n) for n in (3, 4)] == [1.0, 1.0]  # (3+1)/4; then frac = 0 / max(1, 0) = 0


def test_seed_everything_seeds_numpy_with_the_seed_modulo_2_to_the_32():
    import random

    import numpy as np

    from mmrl.core.trainer import seed_everything

    for seed, numpy_seed in ((7, 7), (2**32 + 5, 5)):
        seed_everything(seed)
        assert np.random.rand() == np.random.RandomState(numpy_seed).rand()
        assert random.random() == random.Random(seed).random()
        assert torch.equal(torch.rand(2), torch.rand(2, generator=torch.Generator().manual_seed(seed)))


def test_a_step_logs_the_mean_absolute_advantage(tmp_path):
    trainer = make(tmp_path)
    batch, _ = trainer.scheduler.next_groups(version=0)
    adv = torch.zeros(len(batch))
    adv[:4] = torch.tensor([1.0, -1.0, 3.0, -3.0])  # |.| sums to 8 over 32 rows: 0.25 (the plain mean is 0)
    batch.advantages = adv
    metrics = trainer.update(batch)
    assert metrics["reward/advantage_abs"] == pytest.approx(0.25)


def test_sample_rows_give_each_sample_its_own_group_and_mean_advantage():
    from mmrl.core.batch import RolloutBatch
    from mmrl.core.rewards import AtomScores, Sample
    from mmrl.core.trainer import sample_rows

    batch = RolloutBatch(
        group_ids=torch.tensor([3, 3, 8, 8]), samples=[Sample(f"p{i // 2}", f"c{i}") for i in range(4)],
        scores=AtomScores(["a"], torch.tensor([[1.0], [0.0], [0.5], [0.0]]), torch.tensor([2.0, 0.0, 1.0, 0.0])),
        advantages=torch.tensor([[1.0, 3.0], [-1.0, -1.0], [0.5, 0.5], [0.0, -4.0]]),  # [N, T]: per-token
    )
    rows = sample_rows(batch)
    assert [r["group"] for r in rows] == [3, 3, 8, 8]
    assert [r["advantage"] for r in rows] == [2.0, -1.0, 0.5, -2.0]  # each row's mean over its tokens
    assert [r["reward"] for r in rows] == [2.0, 0.0, 1.0, 0.0]
    assert [r["atoms"] for r in rows] == [{"a": 1.0}, {"a": 0.0}, {"a": 0.5}, {"a": 0.0}]
    assert [(r["prompt"], r["completion"]) for r in rows] == [("p0", "c0"), ("p0", "c1"), ("p1", "c2"), ("p1", "c3")]


def test_one_mini_batch_takes_the_batch_in_order_and_draws_nothing_from_the_rollout_generator(tmp_path):
    """mini_batches=1 needs no shuffle: the generator the next rollout draws from is left as it was."""
    trainer = make(tmp_path, "train.ppo_epochs=2")
    batch, _ = trainer.scheduler.next_groups(version=0)
    seen, select = [], batch.select
    batch.select = lambda idx: seen.append(idx.tolist()) or select(idx)
    state = trainer.generator.get_state()
    trainer.update(batch)
    assert torch.equal(trainer.generator.get_state(), state)
    assert seen[0] == list(range(32))


def test_micro_batch_size_splits_each_mini_batch_into_micro_batches_of_that_size(tmp_path):
    """32 rows in 2 mini-batches of 16, micro_batch_size 6: losses of 6, 6, 4 rows per mini-batch."""
    trainer = make(tmp_path, "train.mini_batches=2", "train.micro_batch_size=6")
    batch, _ = trainer.scheduler.next_groups(version=0)
    sizes, loss = [], trainer.method.loss
    trainer.method.loss = lambda policy, micro, *a, **kw: sizes.append(len(micro)) or loss(policy, micro, *a, **kw)
    trainer.update(batch)
    assert sizes == [6, 6, 4, 6, 6, 4]


def test_the_logged_loss_is_the_mini_batch_loss_whatever_the_micro_batches(tmp_path):
    """loss/total sums the micro-batches' shares: 8 micro-batches of 4 log the loss of one of 32."""
    one, acc = make(tmp_path, name="one"), make(tmp_path, "train.micro_batch_size=4", name="acc")
    batch, _ = one.scheduler.next_groups(version=0)
    batch.advantages = batch.advantages + 0.5  # a loss away from 0 (a group's advantages sum to 0)
    metrics = [t.update(batch) for t in (one, acc)]
    assert abs(metrics[0]["loss/total"]) > 0.1
    assert metrics[1]["loss/total"] == pytest.approx(metrics[0]["loss/total"], rel=1e-5)


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_without_max_grad_norm_a_large_gradient_is_not_clipped(tmp_path):
    trainer = make(tmp_path, "optim.max_grad_norm=null")
    batch, _ = trainer.scheduler.next_groups(version=0)
    batch.advantages = batch.advantages * 1000 + 500  # a gradient norm far above 1
    seen, step = [], trainer.optimizer.step
    trainer.optimizer.step = lambda *a, **kw: seen.append(
        torch.cat([p.grad.flatten() for p in trainer.params if p.grad is not None]).norm()) or step(*a, **kw)
    metrics = trainer.update(batch)
    assert metrics["loss/grad_norm"] > 10
    assert float(seen[0]) == pytest.approx(metrics["loss/grad_norm"], rel=1e-5)


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_the_logged_grad_norm_is_the_mean_over_the_optimizer_steps(tmp_path):
    trainer = make(tmp_path, "train.mini_batches=2", "train.ppo_epochs=2", "optim.max_grad_norm=null")
    batch, _ = trainer.scheduler.next_groups(version=0)
    seen, step = [], trainer.optimizer.step
    trainer.optimizer.step = lambda *a, **kw: seen.append(
        float(torch.cat([p.grad.flatten() for p in trainer.params if p.grad is not None]).norm())) or step(*a, **kw)
    metrics = trainer.update(batch)
    assert len(seen) == 4 and max(seen) - min(seen) > 1e-4
    assert metrics["loss/grad_norm"] == pytest.approx(sum(seen) / 4, rel=1e-5)


def test_one_process_never_warns_that_the_processes_end_with_different_weights(tmp_path, monkeypatch):
    """One process has one checksum: nothing to differ from (the warning is for ranks that drifted)."""
    trainer = make(tmp_path, "train.max_steps=1")
    monkeypatch.setattr(trainer, "write_summary", lambda *a, **kw: {})  # the report is not under test
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert trainer.step == 1
    assert not [w for w in caught if "different weights" in str(w.message)]


def test_a_step_without_any_update_logs_its_loss_and_grad_norm_as_nan(tmp_path):
    """No optimizer step ran: no loss or gradient norm to average (nan, which the loggers leave
    out), not a 0 that would plot as a perfect step."""
    trainer = make(tmp_path)
    batch, _ = trainer.scheduler.next_groups(version=0)
    metrics = update_with_gradient(trainer, batch, float("nan"))
    assert metrics["train/updates"] == 0
    assert math.isnan(metrics["loss/total"]) and math.isnan(metrics["loss/grad_norm"])
    assert math.isfinite(metrics["loss/policy"])  # the forward's own terms are still logged


def test_a_skipped_update_still_counts_in_the_mean_of_the_loss_metrics(tmp_path):
    """Two mini-batches, the second's gradient not finite: a metric that is 0.5 in both passes is
    logged as 0.5 (the mean over the passes that ran), not 1.0 (their sum over the one update)."""
    trainer = make(tmp_path, "train.mini_batches=2")
    toy.log_constant(trainer.method, "x/constant", 0.5)
    batch, _ = trainer.scheduler.next_groups(version=0)
    backwards = []

    def second_not_finite(g):
        backwards.append(1)
        return torch.full_like(g, float("inf")) if len(backwards) == 2 else g

    handle = trainer.params[-1].register_hook(second_not_finite)
    try:
        with pytest.warns(UserWarning, match="1 update"):
            metrics = trainer.update(batch)
    finally:
        handle.remove()
    assert len(backwards) == 2 and metrics["train/updates"] == 1
    assert metrics["x/constant"] == pytest.approx(0.5)


def test_a_method_that_sets_a_group_of_no_samples_is_a_training_error(tmp_path):
    """As a data epoch begins (not one prompt before) the method may set G; 0 samples per group
    is refused, 1 is taken."""
    trainer = make(tmp_path)
    asked = []
    trainer.method.group_size = lambda epoch, current: asked.append(epoch) or 0
    trainer.stream.position = len(trainer.stream.prompts) - 1  # the last prompt of data epoch 0
    trainer._update_group_size()
    assert asked == [] and (trainer.num_generations, trainer.group_epoch) == (8, 0)
    trainer.stream.position = len(trainer.stream.prompts)  # the start of data epoch 1
    with pytest.raises(TrainingError, match="returned 0 for epoch 1"):
        trainer._update_group_size()
    trainer.method.group_size = lambda epoch, current: 1
    trainer._update_group_size()
    assert (trainer.num_generations, trainer.group_epoch) == (1, 1)


def test_a_failure_inside_the_update_after_an_unsaved_step_saves_nothing(tmp_path, monkeypatch):
    """Step 1 finished but not saved (no save_every); step 2's update fails: its weights and
    optimizer may be half stepped, so no checkpoint of step 1 is written from them."""
    trainer = make(tmp_path, "train.max_steps=3", "train.save_every=0")
    raise_on_call(trainer, "update", at=2, error=RuntimeError("out of memory"))
    monkeypatch.setattr(trainer, "evaluate", lambda **kw: {})
    with pytest.raises(RuntimeError, match="out of memory"):
        trainer.train()
    assert trainer.step == 1
    assert list_checkpoints(tmp_path / "run" / "checkpoints") == []


@pytest.mark.parametrize("error", ["TrainingError", "CheckpointError"])
def test_the_trainers_own_stops_save_no_checkpoint_of_the_finished_steps(tmp_path, monkeypatch, error):
    """A TrainingError or CheckpointError is the trainer refusing to go on (or to write): the
    steps finished since the last checkpoint are not saved after it, as they are after a
    reward atom's error."""
    from mmrl.core import checkpoint

    cls = {"TrainingError": TrainingError, "CheckpointError": checkpoint.CheckpointError}[error]
    trainer = make(tmp_path, "train.max_steps=3", "train.save_every=0")
    raise_on_call(trainer.scheduler, "next_groups", at=2, error=cls("stop"))
    monkeypatch.setattr(trainer, "evaluate", lambda **kw: {})
    with pytest.raises(cls, match="stop"):
        trainer.train()
    assert trainer.step == 1
    assert list_checkpoints(tmp_path / "run" / "checkpoints") == []


def test_data_parallel_needs_prompts_per_step_a_multiple_of_the_processes(tmp_path):
    """4 prompts per step: 2 processes take 2 each, 3 cannot split them."""
    from mmrl.core.config import ConfigError
    from mmrl.core.trainer import _check_data_parallel

    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[f"output_dir={tmp_path}"])
    assert cfg.rollout.prompts_per_step == 4
    _check_data_parallel(cfg, 2)
    _check_data_parallel(cfg, 4)
    with pytest.raises(ConfigError, match=r"prompts_per_step \(4\) must be a multiple of the number of processes \(3\)"):
        _check_data_parallel(cfg, 3)


def test_the_waiting_ratio_is_the_share_of_the_step_spent_waiting_for_rollouts():
    from mmrl.core.trainer import _waiting

    assert _waiting(1.0, 3.0) == {"time/trainer_wait": 1.0, "time/trainer_busy": 3.0, "time/waiting_ratio": 0.25}
    assert _waiting(0.0, 0.0)["time/waiting_ratio"] == 0.0  # no time at all: no division by 0


def test_a_sample_table_shows_a_repr_up_to_2000_characters_then_cuts_it():
    from mmrl.core.trainer import _show

    assert _show(["a" * 1996]) == repr(["a" * 1996])  # 2000 characters: whole
    assert _show(["a" * 1997]) == repr(["a" * 1997])[:2000] + "..."  # 2001: cut to 2000
    assert _show("x" * 5000) == "x" * 5000 and _show(None) is None


def _trained_once_with_a_config_atom(tmp_path):
    """A toy run whose config adds the even_first atom, with one Trainer already built on its task."""
    write_even_first_atom(tmp_path)
    (tmp_path / "run.yaml").write_text("reward:\n  atoms: [atoms.py:even_first]\n")
    cfg = load_config(TrainConfig, tmp_path / "run.yaml", defaults=toy.DEFAULT_CONFIG,
                      overrides=[f"output_dir={tmp_path / 'out'}"])
    policy, task = toy.build(cfg)
    Trainer(cfg, policy, task)
    return cfg, policy, task


def test_a_config_atom_joins_the_task_reward_once_whatever_the_trainers_built_on_it(tmp_path):
    """A second trainer on the same task starts from the task's own reward (base_reward), not
    from the first trainer's, which already holds the config's atom."""
    cfg, policy, task = _trained_once_with_a_config_atom(tmp_path)
    second = Trainer(cfg, policy, task)
    assert second.reward.names == task.reward.names == ["answer", "stop", "even_first"]
    assert task.base_reward.names == ["answer", "stop"]


def test_a_task_reward_set_between_two_trainers_is_the_new_base(tmp_path):
    """From Python, `task.reward = Reward([...])` after a first trainer: the second trainer scores
    with it (plus the config's atoms), where it was replaced by the first trainer's base without
    a word."""
    cfg, policy, task = _trained_once_with_a_config_atom(tmp_path)
    own = reward_atom("own")(lambda s: 1.0)
    task.reward = Reward([*task.base_reward.atoms, own])
    second = Trainer(cfg, policy, task)
    assert second.reward.names == task.reward.names == ["answer", "stop", "own", "even_first"]
    assert task.base_reward.names == ["answer", "stop", "own"]
    third = Trainer(cfg, policy, task)  # and no second copy of the config's atom
    assert third.reward.names == ["answer", "stop", "own", "even_first"]


def test_a_sample_table_shows_a_tensor_as_its_values_up_to_512_and_an_image_as_its_size():
    from PIL import Image

    from mmrl.core.trainer import _show

    assert _show(torch.tensor([1, 2, 3])) == [1, 2, 3]  # a tensor has .size and .mode methods: not an image
    assert _show(torch.zeros(512)) == [0.0] * 512 and _show(torch.zeros(2, 257)) == "<tensor (2, 257)>"
    assert _show(Image.new("RGB", (4, 3))) == "<image 4x3 RGB>"


def test_summary_is_strict_json_and_says_when_how_long_and_by_what_command(tmp_path, monkeypatch):
    """A held-out metric without data is NaN: summary.json held a bare NaN, which is not JSON
    (jq, JavaScript and strict parsers refuse the whole file), where `eval` prints null. It also
    says when the run started and finished, its starts, its steps' own time and the command."""
    monkeypatch.setattr(sys, "argv", ["/src/dllm_rl/__main__.py", "train", "-o", "run dir"])  # python -m dllm_rl
    trainer = make(tmp_path, "train.max_steps=2")
    evaluate = trainer.task.evaluate
    monkeypatch.setattr(trainer.task, "evaluate", lambda policy: {**evaluate(policy), "empty": float("nan")})
    trainer.train()
    text = (tmp_path / "run" / "summary.json").read_text()
    summary = json.loads(text, parse_constant=lambda c: pytest.fail(f"summary.json holds {c}"))
    assert summary["eval_before"]["empty"] is None and summary["eval_after"]["empty"] is None
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert summary["step_seconds"] == pytest.approx(sum(r["time/step"] for r in rows))
    assert summary["starts"] == 1 and summary["command"] == "python -m dllm_rl train -o 'run dir'"
    assert summary["started"] <= summary["finished"] and summary["finished"].endswith("Z")


def test_train_seconds_of_a_resumed_run_count_its_earlier_starts(tmp_path):
    """summary.json's train_seconds (report.html's "N s of training", `runs`' "train s") was the
    last start's alone: a run resumed for its last step reported seconds for hours of training."""
    make(tmp_path, "train.max_steps=2").train()
    state_path = tmp_path / "run" / "checkpoints" / "step-00000002" / "trainer_state.json"
    state = json.loads(state_path.read_text())
    assert 0 < state["seconds"] < 1000  # saved with the checkpoint
    state["seconds"] = 1000.0  # as if the first start had trained for 1000 s
    state_path.write_text(json.dumps(state))
    resumed = make(tmp_path, "train.max_steps=3")
    summary = resumed.train(resume=True)
    assert 1000 < summary["train_seconds"] < 1100
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["train_seconds"] == summary["train_seconds"]


def test_summary_command_of_a_launched_run_is_the_launchers_line():
    """Under torchrun the workers' argv is `.../dllm_rl/__main__.py train ...`: summary.json's
    command read `python -m dllm_rl train ...`, one process, not what was run."""
    from mmrl.core.trainer import _command_line

    launcher = ["/venv/bin/python3", "/venv/bin/torchrun", "--nproc_per_node", "2", "-m", "dllm_rl", "train"]
    assert _command_line(launcher) == "/venv/bin/torchrun --nproc_per_node 2 -m dllm_rl train"
    assert _command_line(["/venv/bin/accelerate", "launch", "-m", "mmrl", "train"]) == \
        "/venv/bin/accelerate launch -m mmrl train"


def test_ratio_extremes_are_the_steps_own_whatever_the_micro_batch_size(tmp_path):
    """loss/ratio_min and _max were means of the micro-batches' extremes: the same update logged
    another minimum at micro_batch_size 1 (dLLM: 0.727 against 0.500). They are the step's
    extremes over micro-batches, mini-batches and epochs, as over the ranks."""
    runs = {}
    for name, extra in (("whole", ()), ("micro", ("train.micro_batch_size=1",))):
        make(tmp_path, "train.max_steps=1", "train.mini_batches=2", "train.ppo_epochs=2", *extra, name=name).train()
        (runs[name],) = read_metrics(tmp_path / name / "metrics.jsonl")
    whole, micro = runs["whole"], runs["micro"]
    assert whole["loss/ratio_min"] < whole["loss/ratio_mean"] < whole["loss/ratio_max"]  # off-policy passes
    for k in ("loss/ratio_min", "loss/ratio_max"):
        assert micro[k] == pytest.approx(whole[k], rel=1e-5), k


@pytest.mark.parametrize("damage", ["model-deleted", "weights-cut-short", "state-emptied"])
def test_resume_from_a_damaged_newest_checkpoint_names_it_and_the_one_before(tmp_path, damage):
    """A newest checkpoint damaged by hand (its model/ deleted, its weights cut short, its state
    file emptied; a crash never leaves one listed) is a CheckpointError naming it and the older
    checkpoint to resume from, not from_pretrained's traceback (a hub name) or a KeyError."""
    from mmrl.core.checkpoint import CheckpointError

    make(tmp_path, "train.max_steps=2", "train.save_every=1").train()
    newest = tmp_path / "run" / "checkpoints" / "step-00000002"
    if damage == "model-deleted":
        shutil.rmtree(newest / "model")
    elif damage == "weights-cut-short":
        (weights_file,) = (newest / "model").glob("*.safetensors")
        weights_file.write_bytes(weights_file.read_bytes()[:100])
    else:
        (newest / "trainer_state.json").write_text("{}")
    with pytest.raises(CheckpointError, match=rf"checkpoint {re.escape(str(newest))} is (damaged|unreadable): .*"
                                              r"; remove it to resume from step-00000001 \(the steps after it"):
        make(tmp_path, "train.max_steps=3").train(resume=True)
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step-00000001")
    with pytest.raises(CheckpointError, match="it is the run's only checkpoint: start the run afresh"):
        make(tmp_path, "train.max_steps=3").train(resume=True)


def test_a_run_still_training_on_this_host_is_not_started_again_beside_it(tmp_path):
    """A second start (--resume, or a fresh run before the first checkpoint) while environment.json's
    newest start has no ending and its process is alive is refused, naming the process, and
    changes nothing: it trained the same steps into the same metrics.jsonl, and its clean-up of
    half-written checkpoints deleted the checkpoint the first start was writing."""
    import os
    import socket
    import subprocess

    from mmrl.core import provenance
    from mmrl.core.trainer import OutputDirError

    make(tmp_path, "train.max_steps=1").train()
    env = tmp_path / "run" / "environment.json"
    entries = json.loads(env.read_text())
    other = os.getppid()  # a live process that is not this one, as a start still going
    entries.append({"started": "2026-12-07T05:00:00Z", "step": 1, "host": socket.gethostname(), "pid": other,
                    "pid_started": provenance._process_start(other)})
    env.write_text(json.dumps(entries))
    files = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    for resume in (True, False):
        with pytest.raises(OutputDirError, match=rf"run is being trained by process {other} on this host \(started "
                                                 r"2026-12-07T05:00:00Z at step 1\); wait for it to end"):
            make(tmp_path, "train.max_steps=2").train(resume=resume)
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == files
    if sys.platform == "linux":  # a start killed by a script that never waited for it: signal 0 finds it
        dead = subprocess.Popen(["true"])
        while not (zombie := Path(f"/proc/{dead.pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"):
            time.sleep(0.01)
        entries[-1].update(pid=dead.pid, pid_started=provenance._process_start(dead.pid))
        env.write_text(json.dumps(entries))
        assert zombie and make(tmp_path, "train.max_steps=2").train(resume=True)["steps"] == 2
        dead.wait()
        entries = json.loads(env.read_text())
        entries.append({**entries[-1], "pid": other, "pid_started": provenance._process_start(other)})
        del entries[-1]["ended"]
    del entries[-1]["pid_started"]  # written off Linux: a reused PID cannot be told apart, so no refusal
    env.write_text(json.dumps(entries))
    assert make(tmp_path, "train.max_steps=3").train(resume=True)["steps"] == 3


def test_resume_without_the_run_s_config_yaml_compares_with_the_checkpoint_s_settings(tmp_path):
    """A run whose config.yaml is gone (its checkpoints/ copied alone) resumed with the defaults
    instead of its settings, without a word: the checkpoint's own record of them is the
    comparison then, and is kept as config.before-step-N.yaml."""
    make(tmp_path, "train.max_steps=1", "optim.lr=0.004").train()
    (tmp_path / "run" / "config.yaml").unlink()
    with pytest.warns(UserWarning, match=r"--resume at step 1 with settings that differ from the checkpoint's \(the "
                                         r"run's config.yaml is missing\): optim.lr: 0.004 -> 0.003\. The checkpoint's "
                                         r"settings are kept as config.before-step-1.yaml"):
        make(tmp_path, "train.max_steps=2").train(resume=True)
    assert "lr: 0.004" in (tmp_path / "run" / "config.before-step-1.yaml").read_text()
