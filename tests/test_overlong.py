"""DAPO's overlong rules (mmrl.core.overlong): the soft punishment as a reward atom, and
overlong filtering as the GRPO family's prune, on the toy backend (tests/toy.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import toy
from pydantic import ValidationError

from mmrl.core.batch import RolloutBatch
from mmrl.core.config import ConfigError, TrainConfig, load_config
from mmrl.core.logging import read_metrics
from mmrl.core.method import build_method
from mmrl.core.overlong import overlong_atom, overlong_penalty
from mmrl.core.rewards import Reward, RewardError, Sample
from mmrl.core.trainer import Trainer, combined_reward


def test_overlong_penalty_is_dapo_eq13():
    # L_max 20, L_cache 4: free up to 16 tokens, then (16 - |y|) / 4, and -1 from 20 on
    assert [overlong_penalty(n, 20, 4) for n in (0, 16, 17, 18, 19, 20, 25)] == [0, 0, -0.25, -0.5, -0.75, -1, -1]
    assert overlong_penalty(18, 20, 4, penalty=2.0) == -1.0  # (16 - 18) / 4 x 2
    assert overlong_penalty(1, 8, 8) == -0.125  # a buffer as long as the budget: every token costs


def test_overlong_atom_reads_the_token_count_and_names_what_is_missing():
    atom = overlong_atom(max_len=10, buffer=5)
    assert atom.name == "overlong" and atom.weight == 1.0
    scores = Reward([atom]).score([Sample("q", "a", {"completion_tokens": n}) for n in (3, 7, 10)])
    assert scores.values[:, 0].tolist() == pytest.approx([0.0, -0.4, -1.0])  # (5 - 7) / 5, (5 - 10) / 5
    with pytest.raises(RewardError, match="completion_tokens"):
        Reward([atom]).score([Sample("q", "text without a length")])
    with pytest.raises(ValueError, match="buffer must be 1..max_len"):
        overlong_atom(max_len=4, buffer=5)


def config(tmp_path, *overrides):
    return load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[
        f"output_dir={tmp_path / 'run'}", "rollout.prompts_per_step=4", "rollout.num_generations=4",
        "train.max_steps=2", *overrides])


def test_overlong_config_is_checked_at_load(tmp_path):
    with pytest.raises(ConfigError, match=r"buffer \(3\) is longer than rollout.max_new_tokens \(2\)"):
        config(tmp_path, "reward.overlong.buffer=3")
    with pytest.raises(ConfigError, match=r"buffer \(3\) is longer than reward.overlong.max_len \(2\)"):
        config(tmp_path, "reward.overlong.buffer=3", "reward.overlong.max_len=2")
    with pytest.raises(ConfigError, match="buffer"):
        config(tmp_path, "reward.overlong.max_len=8")  # no buffer: the one field without a default
    cfg = config(tmp_path, "rollout.max_new_tokens=6", "reward.overlong.buffer=2")
    reward = combined_reward(toy.ToyTask().reward, cfg)
    assert reward.names == ["answer", "stop", "overlong"]
    assert reward.score([Sample(1, [2], {"completion_tokens": 5})]).values[0, 2] == -0.5  # max_len 6: (4 - 5) / 2
    # max_len set: it, not the budget, is L_max (and the buffer may outgrow the budget)
    cfg = config(tmp_path, "reward.overlong.buffer=4", "reward.overlong.max_len=8")
    long = combined_reward(toy.ToyTask().reward, cfg).score([Sample(1, [2], {"completion_tokens": 5})])
    assert long.values[0, 2] == -0.25  # (4 - 5) / 4


def test_overlong_is_refused_where_samples_have_no_token_budget():
    from diffusion_rl.config import DiffusionTrainConfig
    from dllm_rl.config import DLLMTrainConfig
    from mmrl.vlm.config import VLMTrainConfig

    with pytest.raises(ValidationError, match="fixed-length canvas"):
        DLLMTrainConfig(reward={"overlong": {"buffer": 2}})
    with pytest.raises(ValidationError, match="samples are images"):
        DiffusionTrainConfig(reward={"overlong": {"buffer": 2}})
    tools = {"max_new_tokens": 16, "tools": {"max_turns": 3}}
    with pytest.raises(ValidationError, match=r"per turn.*max_turns x max_new_tokens = 48"):
        VLMTrainConfig(rollout=tools, reward={"overlong": {"buffer": 4}})
    assert VLMTrainConfig(rollout=tools, reward={"overlong": {"buffer": 4, "max_len": 40}}).reward.overlong.max_len == 40


class TruncatingToy(toy.ToyPolicy):
    """The toy policy whose rollouts say which completions ran out of budget: those whose last
    token is not EOS (as a VLM rollout's "stat/truncated")."""

    def generate(self, prompts, num_generations, rollout, generator):
        batch = super().generate(prompts, num_generations, rollout, generator)
        ids = batch.data["input_ids"][:, 2:]
        batch.data["stat/truncated"] = (ids[:, -1] != toy.EOS).float()
        return batch

    def reference(self):  # what a pipelined run's engine samples with
        return TruncatingToy(model=super().reference().model)


def group(truncated, rewards=(0.0, 1.0, 0.0, 1.0)):
    n = len(truncated)
    scores = Reward([toy.answer]).score([Sample(0, [1 if r else 0]) for r in rewards])
    return RolloutBatch(group_ids=torch.zeros(n, dtype=torch.long), samples=[Sample(0, [0])] * n,
                        mask=torch.ones(n, 2, dtype=torch.bool), scores=scores,
                        data={"stat/truncated": torch.tensor(truncated, dtype=torch.float32),
                              "input_ids": torch.zeros(n, 4, dtype=torch.long)})


def test_overlong_filter_drops_truncated_rollouts_after_their_advantages(tmp_path):
    cfg = config(tmp_path, "method.overlong_filter=true")
    method = build_method(cfg, toy.ToyTask().reward)
    g = group([0.0, 1.0, 0.0, 0.0])
    g.advantages = method.advantages(g)  # the truncated one still counts in its group's statistics
    # rewards 0 1 0 1: (r - 0.5) / 0.5774 (the sample std, sqrt(4 x 0.25 / 3)) = -+0.866
    assert g.advantages.tolist() == pytest.approx([-0.866, 0.866, -0.866, 0.866], abs=1e-3)
    assert method.prune(g).tolist() == [True, False, True, True]
    off = build_method(config(tmp_path), toy.ToyTask().reward)
    assert off.prune(g) is None
    with pytest.raises(ValueError, match="stat/truncated"):
        method.prune(RolloutBatch(group_ids=g.group_ids, samples=g.samples, mask=g.mask, scores=g.scores))


def test_overlong_filter_zeroes_fastrl_counts_of_truncated_rollouts(tmp_path):
    cfg = config(tmp_path, "method.overlong_filter=true", "method.fastrl.enabled=true",
                 "method.fastrl.weight=count", "method.fastrl.pad_multiple=1")
    method = build_method(cfg, toy.ToyTask().reward)
    g = group([1.0, 0.0, 0.0, 0.0])  # four identical token rows, advantages - + - +
    g.advantages = method.advantages(g)
    assert method._mdap(g).tolist() == [2, 2, 0, 0]  # one kept per advantage set, standing for two
    assert method.prune(g).tolist() == [0, 2, 0, 0]  # row 0 is truncated: it and what it stood for go


@pytest.mark.parametrize("mode", ["sync", "pipelined"])
def test_a_run_with_overlong_filtering_trains_only_what_ended(tmp_path, mode):
    """Most of the toy's random completions do not end in EOS, so whole groups are filtered
    out; the run still steps, logging what it pruned."""
    cfg = config(tmp_path, "method.overlong_filter=true", f"rollout.scheduler.mode={mode}")
    Trainer(cfg, TruncatingToy(seed=0), toy.ToyTask()).train()
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "rollout/samples_pruned" in r]
    assert len(rows) == 2
    for r in rows:  # no other pruning: every truncated rollout, and only those
        assert r["rollout/samples_pruned"] == round(r["rollout/truncated"] * 16)
        assert r["rollout/samples"] == 16 - r["rollout/samples_pruned"]
    assert any(r["rollout/samples_pruned"] > 0 for r in rows)


class AllTruncated(TruncatingToy):
    truncated = 1.0

    def generate(self, *a):
        batch = super().generate(*a)
        batch.data["stat/truncated"] = torch.full((len(batch),), self.truncated)
        return batch

    def reference(self):
        return type(self)(model=super().reference().model)


class NoneTruncated(AllTruncated):
    truncated = 0.0


@pytest.mark.parametrize("mode", ["sync", "pipelined"])
def test_a_step_whose_every_rollout_is_truncated_trains_nothing_and_goes_on(tmp_path, mode):
    policy = AllTruncated(seed=0)
    before = [p.detach().clone() for p in policy.model.parameters()]
    cfg = config(tmp_path, "method.overlong_filter=true", f"rollout.scheduler.mode={mode}")
    with pytest.warns(UserWarning, match="every group was dropped; no update"):
        summary = Trainer(cfg, policy, toy.ToyTask()).train()
    assert summary["steps"] == 2 and summary["steps_without_update"] == 2
    assert all(torch.equal(a, p) for a, p in zip(before, policy.model.parameters()))
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["rollout/samples_pruned"] for r in rows if "train/skipped" in r] == [16, 16]


def _filtered_rank(rank, port, tmp):
    """Rank 0's rollouts are all truncated, rank 1's none: rank 0 trains an empty share."""
    from test_data_parallel import distributed_checksum
    from two_ranks import process_group

    with process_group(rank, port, timeout=120):
        cfg = config(Path(tmp), "method.overlong_filter=true", "logging.tensorboard=false")
        trainer = Trainer(cfg, (AllTruncated if rank == 0 else NoneTruncated)(seed=0), toy.ToyTask())
        summary = trainer.train()
        torch.save({"checksum": distributed_checksum(trainer), "steps": summary["steps"]}, f"{tmp}/record.{rank}")


@pytest.mark.two_ranks(body=_filtered_rank)
def test_a_rank_whose_every_rollout_is_filtered_still_steps_with_the_other(ranks_ran):
    r0, r1 = (torch.load(ranks_ran / f"record.{r}", weights_only=True) for r in range(2))
    assert r0["steps"] == r1["steps"] == 2 and r0["checksum"] == r1["checksum"]
    rows = read_metrics(ranks_ran / "run" / "metrics.jsonl")
    assert [(r["rollout/samples"], r["rollout/samples_pruned"], r["train/updates"]) for r in rows] == [(8, 8, 1)] * 2


def test_overlong_atom_accepts_a_buffer_as_long_as_the_budget_and_scales_by_penalty():
    atom = overlong_atom(max_len=4, buffer=4, penalty=2.0)  # every token of the budget costs
    scores = Reward([atom]).score([Sample("q", "a", {"completion_tokens": n}) for n in (0, 1, 3, 4, 9)])
    # (0 - n) / 4 x 2, and -2 past max_len
    assert scores.values[:, 0].tolist() == pytest.approx([0.0, -0.5, -1.5, -2.0, -2.0])
    assert atom.weight == 1.0  # the scale is the penalty, not the weight


def test_overlong_atom_refuses_an_empty_buffer_and_non_positive_or_non_finite_penalties():
    with pytest.raises(ValueError, match="buffer must be 1..max_len"):
        overlong_atom(max_len=4, buffer=0)
    for penalty in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="penalty must be a positive number"):
            overlong_atom(max_len=4, buffer=2, penalty=penalty)
