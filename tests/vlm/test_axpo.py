"""AXPO (mmrl.vlm.methods.axpo): which prefixes it resamples and the advantages it gives,
on hand-built groups, then a short run of the bundled tool-using tiny VLM."""

from __future__ import annotations

import math

import pytest
import torch

from mmrl.core.batch import RolloutBatch
from mmrl.core.config import load_config
from mmrl.core.rewards import AtomScores, Sample
from mmrl.vlm.config import VLMTrainConfig
from mmrl.vlm.methods.axpo import AXPO, first_call_confidence


def method(overrides=(), **resample):
    cfg = load_config(VLMTrainConfig, overrides=["method.type=axpo", "rollout.tools.names=[zoom]", *overrides,
                                                  *[f"method.resample.{k}={v}" for k, v in resample.items()]])
    reward = type("R", (), {"atoms": []})()
    return AXPO(cfg.method, cfg, reward)


def group(answers, first_calls, call_probs, gid=7, tags=None):
    """One group: rollout i answered answers[i] (1 right, 0 wrong); its first tool call starts
    at first_calls[i] (-1: none) and spans two tokens of old probability call_probs[i]."""
    n, t = len(answers), 6
    ids = torch.arange(n * t).view(n, t) + 100
    call_mask = torch.zeros((n, t), dtype=torch.bool)
    old_logp = torch.full((n, t), math.log(0.9))
    for i, (f, p) in enumerate(zip(first_calls, call_probs)):
        if f >= 0:
            call_mask[i, f: f + 2] = True
            old_logp[i, f: f + 2] = torch.tensor(p).log()
    values = torch.tensor([[1.0, a] for a in answers])
    scores = AtomScores(names=["format", "answer"], values=values, total=values @ torch.tensor([0.1, 1.0]))
    data = {"completion_ids": ids, "call_mask": call_mask, "first_call": torch.tensor(first_calls),
            "request_tag": torch.tensor(tags or [0] * n)}
    return RolloutBatch(group_ids=torch.full((n,), gid), samples=[Sample("q", "c") for _ in range(n)],
                        mask=torch.ones((n, t), dtype=torch.bool), old_logp=old_logp, scores=scores,
                        data=data, prompts={gid: "the prompt"})


def test_first_call_confidence_is_the_mean_probability_of_the_call_tokens():
    g = group([0, 0], [1, -1], [[0.2, 0.6], [1.0, 1.0]])
    assert first_call_confidence(g, 0).item() == pytest.approx(0.4)  # (0.2 + 0.6) / 2


def test_all_wrong_tool_subgroup_resamples_the_least_confident_prefixes():
    """G = 8, K = 2, budget 0.25: M = round(0.25 * 8 / 2) = 1 prefix, the lowest u_i among
    the tool users (rows 1, 3, 4 with u = 0.5, 0.2, 0.7 -> row 3); prefix = its tokens before
    the call (positions 0..1); K = 2 continuations with tag 1."""
    m = method()
    g = group([0, 0, 1, 0, 0, 1, 0, 0], [-1, 3, -1, 2, 1, -1, -1, -1],
              [[1, 1], [0.5, 0.5], [1, 1], [0.1, 0.3], [0.7, 0.7], [1, 1], [1, 1], [1, 1]])
    reqs = m.extra_requests(g)
    assert len(reqs) == 1
    r = reqs[0]
    assert (r.group, r.prompt, r.n, r.tag) == (7, "the prompt", 2, 1)
    assert r.prefix == g.data["completion_ids"][3, :2].tolist()


def test_force_call_keeps_the_calls_opening_tag_in_the_prefix():
    g = group([0, 0, 1, 0, 0, 1, 0, 0], [-1, 3, -1, 2, 1, -1, -1, -1],
              [[1, 1], [0.5, 0.5], [1, 1], [0.1, 0.3], [0.7, 0.7], [1, 1], [1, 1], [1, 1]])
    (r,) = method(force_call="true").extra_requests(g)
    assert r.prefix == g.data["completion_ids"][3, :3].tolist()  # positions 0..1 and the call's first token


def test_budget_sets_how_many_prefixes_and_never_more_than_the_tool_users():
    m = method(k=2, budget=1.0)  # M = round(1.0 * 4 / 2) = 2
    g = group([0, 0, 0, 1], [0, 1, -1, -1], [[0.3, 0.3], [0.6, 0.6], [1, 1], [1, 1]])
    reqs = m.extra_requests(g)
    assert [r.tag for r in reqs] == [1, 2] and reqs[0].prefix == [] and len(reqs[1].prefix) == 1
    m = method(k=2, budget=2.0)  # M = 4, but only 2 rollouts called a tool
    assert len(m.extra_requests(g)) == 2


def test_no_resampling_when_a_tool_user_is_right_or_nobody_called():
    m = method()
    assert m.extra_requests(group([1, 0, 0, 0], [2, 1, -1, -1], [[.5, .5]] * 4)) == []  # a tool user is right
    assert m.extra_requests(group([0, 0, 0, 0], [-1] * 4, [[1, 1]] * 4)) == []  # no tool user


def test_advantages_of_originals_and_of_each_sibling_set():
    """Originals [1, 0, 0, 0]: mean 0.25, unbiased std 0.5 -> [1.5, -0.5, -0.5, -0.5].
    Tag 1 siblings [1, 0]: mean 0.5, std 0.7071 -> [+0.7071, -0.7071]; tag 2 siblings
    [0, 0]: all equal -> 0. Rewards include the 0.1 format atom, which shifts nothing."""
    m = method()
    g = group([1, 0, 0, 0, 1, 0, 0, 0], [-1] * 8, [[1, 1]] * 8, tags=[0, 0, 0, 0, 1, 1, 2, 2])
    adv = m.advantages(g)
    want = torch.tensor([1.5, -0.5, -0.5, -0.5, 0.7071, -0.7071, 0.0, 0.0])
    torch.testing.assert_close(adv, want, atol=1e-3, rtol=0)
    metrics = m.batch_metrics(g)
    assert metrics["axpo/resampled"] == 4 and metrics["axpo/resampled_accuracy"] == 0.25


def test_m_is_budget_times_g_over_k_rounded_and_at_least_one():
    """M = max(1, round(budget * G / K)): G = 4, K = 2, budget 0.25 -> round(0.5) = 0 -> 1 prefix;
    G = 8, K = 2, budget 0.45 -> round(1.8) = 2 prefixes (not 1, as truncating would give)."""
    g = group([0, 0, 0, 0], [1, 2, -1, -1], [[0.3, 0.3], [0.6, 0.6], [1, 1], [1, 1]])
    assert len(method(k=2, budget=0.25).extra_requests(g)) == 1
    g = group([0] * 8, [1, 2, 3, -1, -1, -1, -1, -1], [[0.3, 0.3], [0.6, 0.6], [0.2, 0.2]] + [[1, 1]] * 5)
    reqs = method(k=2, budget=0.45).extra_requests(g)
    assert [r.prefix for r in reqs] == [g.data["completion_ids"][2, :3].tolist(),  # u = 0.2
                                        g.data["completion_ids"][0, :1].tolist()]  # u = 0.3


def test_a_budget_of_0_resamples_nothing():
    # max(1, round(0)) resampled one prefix: 0 read as "at least one"
    g = group([0, 0, 0, 0], [1, 2, -1, -1], [[0.3, 0.3], [0.6, 0.6], [1, 1], [1, 1]])
    m = method(k=2, budget=0.0)
    assert m.extra_requests(g) == []
    assert m.batch_metrics(g)["axpo/all_wrong_tool_groups"] == 1  # still counted, as GRPO with AXPO's metrics


def test_each_prefix_asks_for_k_continuations():
    """K = 3: G = 8, budget 0.25 -> M = max(1, round(0.67)) = 1 request, for 3 continuations."""
    g = group([0] * 8, [1, -1, -1, -1, -1, -1, -1, -1], [[0.3, 0.3]] + [[1, 1]] * 7)
    assert [r.n for r in method(k=3).extra_requests(g)] == [3]


def test_a_group_without_its_prompt_is_refused_by_name():
    g = group([0, 0, 0, 0], [1, -1, -1, -1], [[0.3, 0.3]] + [[1, 1]] * 3)
    g.prompts = {}
    with pytest.raises(ValueError, match="AXPO needs the prompt of group 7"):
        method().extra_requests(g)


def test_sibling_sets_of_different_groups_with_the_same_tag_are_apart():
    """Groups 7 and 8 each have two originals and two tag-1 siblings. Group 7: originals [1, 0]
    -> mean 0.5, unbiased std 0.7071 -> [+0.7071, -0.7071]; siblings [1, 1] -> 0. Group 8:
    originals [0, 1] -> [-0.7071, +0.7071]; siblings [0, 0] -> 0. (Pooled, the four siblings
    [1, 1, 0, 0] would get +-0.866.)"""
    a = group([1, 0, 1, 1], [-1] * 4, [[1, 1]] * 4, gid=7, tags=[0, 0, 1, 1])
    b = group([0, 1, 0, 0], [-1] * 4, [[1, 1]] * 4, gid=8, tags=[0, 0, 1, 1])
    adv = method().advantages(RolloutBatch.concat([a, b]))
    want = torch.tensor([0.7071, -0.7071, 0.0, 0.0, -0.7071, 0.7071, 0.0, 0.0])
    torch.testing.assert_close(adv, want, atol=1e-3, rtol=0)


def test_right_is_the_answer_atom_at_least_success_not_the_total():
    """The group's rewards: answer [1, 0], total [1.1, 0.1] (the 0.1 format atom). success 1.0:
    an answer of exactly 1.0 is right. success 0.1: a wrong answer is wrong though its total
    (0.1) reaches success."""
    g = group([1, 0], [-1, -1], [[1, 1]] * 2)
    assert method(overrides=["method.success=1.0"]).right(g).tolist() == [True, False]
    assert method(overrides=["method.success=0.1"]).right(g).tolist() == [True, False]


def test_batch_metrics_count_all_wrong_tool_groups_and_rates():
    """Group 7: its tool users (rows 0, 3) all wrong -> all-wrong; its two tag-1 continuations
    (one right and calling, one wrong) do not make it otherwise. Group 8: one of its two tool
    users is right -> not all-wrong. Group 9: nobody called -> not counted. Group 10: its one
    tool user wrong -> all-wrong. 2 groups in all.
    tool_call_rate over the 12 originals: 2 + 2 + 0 + 1 = 5 / 12; the 2 resamples: 1 right,
    1 calling -> accuracy 0.5, tool-call rate 0.5."""
    a = group([0, 0, 1, 0, 1, 0], [1, -1, -1, 2, 0, -1], [[0.5, 0.5]] * 6, gid=7, tags=[0, 0, 0, 0, 1, 1])
    b = group([1, 0, 0, 0], [1, 2, -1, -1], [[0.5, 0.5]] * 4, gid=8)
    c = group([0, 0], [-1, -1], [[1, 1]] * 2, gid=9)
    d = group([0, 0], [0, -1], [[0.5, 0.5], [1, 1]], gid=10)
    out = method().batch_metrics(RolloutBatch.concat([a, b, c, d]))
    assert out["axpo/all_wrong_tool_groups"] == 2 and out["axpo/resampled"] == 2
    assert out["axpo/tool_call_rate"] == pytest.approx(5 / 12)
    assert out["axpo/resampled_accuracy"] == 0.5 and out["axpo/resampled_tool_call_rate"] == 0.5
    no_extras = method().batch_metrics(b)
    assert "axpo/resampled_accuracy" not in no_extras and "axpo/resampled_tool_call_rate" not in no_extras


def test_axpo_needs_tool_rollouts():
    from mmrl.core.config import ConfigError
    from mmrl.vlm import backend

    cfg = load_config(VLMTrainConfig, overrides=["method.type=axpo"])
    with pytest.raises(ConfigError, match="rollout.tools"):
        backend.build(cfg)


def test_axpo_config_trains_the_bundled_tool_vlm(tmp_path, one_thread):
    """configs/vlm/axpo.yaml through the loop for 3 steps with the bundled tool-using tiny
    VLM: tool rollouts, resampled continuations trained after their prefix, AXPO's metrics,
    and the held-out tool-call rate and pass@k in the summary."""
    from pathlib import Path

    from mmrl.core.logging import read_metrics
    from mmrl.core.trainer import Trainer
    from mmrl.vlm import backend

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(backend.CONFIG_CLASS, root / "configs" / "vlm" / "axpo.yaml", [
        f"output_dir={tmp_path}", "train.max_steps=3", "task.num_eval=4", "rollout.eval_samples=2",
        "rollout.prompts_per_step=4", "rollout.num_generations=4", "method.resample.budget=1.0",
        "method.success=2.0",  # no rollout counts as right: every group with a tool user resamples
        "logging.progress=false", "logging.tensorboard=false"], defaults=backend.DEFAULT_CONFIG)
    policy, task = backend.build(cfg)
    before = {k: v.detach().clone() for k, v in policy.model.named_parameters()}
    summary = Trainer(cfg, policy, task, backend=backend).train()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert all(0 <= r["axpo/tool_call_rate"] <= 1 and r["rollout/decoded_tokens"] > 0 for r in rows)
    assert sum(r["axpo/resampled"] for r in rows) == sum(r["rollout/samples_extra"] for r in rows) > 0
    assert any(r["rollout/tool_calls"] > 0 for r in rows)
    assert {"tool_call_rate", "sampled_tool_call_rate", "pass@2", "sampled_accuracy"} <= set(summary["eval_after"])
    moved = [k for k, v in policy.model.named_parameters() if not torch.equal(v, before[k])]
    assert moved


def test_axpo_with_pipelined_tool_rollouts(tmp_path, one_thread):
    """The pipelined scheduler (a background engine with its own weights) runs the tool
    rollouts and AXPO's resampling from a prefix the same way."""
    from pathlib import Path

    from mmrl.core.logging import read_metrics
    from mmrl.core.trainer import Trainer
    from mmrl.vlm import backend

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(backend.CONFIG_CLASS, root / "configs" / "vlm" / "axpo.yaml", [
        f"output_dir={tmp_path}", "train.max_steps=2", "task.num_eval=2", "rollout.eval_samples=0",
        "rollout.prompts_per_step=4", "rollout.num_generations=4", "train.mini_batches=2",
        "rollout.scheduler.mode=pipelined", "method.success=2.0",
        "logging.progress=false", "logging.tensorboard=false"], defaults=backend.DEFAULT_CONFIG)
    policy, task = backend.build(cfg)
    Trainer(cfg, policy, task, backend=backend).train()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["rollout/staleness"] for r in rows] == [0, 0]
    assert sum(r["axpo/resampled"] for r in rows) == sum(r["rollout/samples_extra"] for r in rows) > 0
    assert all(r["rollout/samples"] == 16 + r["axpo/resampled"] for r in rows)
    assert all(r["rollout/decoded_tokens"] > 0 for r in rows)


def test_batch_scale_with_several_processes_is_a_config_error(monkeypatch):
    """The resampled sibling sets get a batch std of their own, computed only by the ranks that
    resampled: with several processes that would leave the others waiting, so it is refused."""
    from mmrl.core import distributed
    from mmrl.core.config import ConfigError

    cfg = load_config(VLMTrainConfig, overrides=["method.type=axpo", "rollout.tools.names=[zoom]",
                                                  "method.advantage.type=group", "method.advantage.scale=batch"])
    reward = type("R", (), {"atoms": []})()
    AXPO(cfg.method, cfg, reward)  # one process: allowed
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    with pytest.raises(ConfigError, match="scale=batch with AXPO"):
        AXPO(cfg.method, cfg, reward)
