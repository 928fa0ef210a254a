"""VPPO (mmrl.vlm.methods.vppo): the token visual dependency and the advantage shaping by
hand, then a step of configs/vlm/vppo.yaml through the loop on a tiny Qwen2.5-VL."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from mmrl.core.config import load_config
from mmrl.core.logging import read_metrics
from mmrl.core.trainer import Trainer
from mmrl.vlm import backend
from mmrl.vlm.methods.vppo import shape_advantages, visual_dependency

ROOT = Path(__file__).resolve().parents[2]


def test_visual_dependency_by_hand():
    """d = 0 -> 0; d = 1 -> e - 2 = 0.7183; d = -1 -> 1/e = 0.3679; d = 4 -> e^4 - 5 = 49.6,
    clamped to 10; off the mask 0."""
    logp = torch.zeros((1, 5))
    aug = torch.tensor([[0.0, 1.0, -1.0, 4.0, 3.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    s = visual_dependency(aug, logp, mask)
    torch.testing.assert_close(s, torch.tensor([[0.0, math.e - 2, 1 / math.e, 10.0, 0.0]]))


def test_shape_advantages_by_hand():
    """Sample 0: s = 0..4 (mean 2), sample 1: s = 0 (mean 0) -> n = [1, 0], mean(n) = 0.5,
    scale = 0.9 + n * 0.1 / 0.5 = [1.1, 0.9]. Top 40% of 5 tokens = 2: sample 0 keeps
    tokens 3 and 4 (A = 1.1 there), sample 1 keeps two of its tied tokens (A = -0.9)."""
    adv = torch.tensor([1.0, -1.0])
    s = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 0.0], [0.0] * 6])
    mask = torch.tensor([[True] * 5 + [False], [True] * 5 + [False]])
    out = shape_advantages(adv, s, mask)
    torch.testing.assert_close(out[0], torch.tensor([0.0, 0.0, 0.0, 1.1, 1.1, 0.0]))
    assert int((out[1] != 0).sum()) == 2 and torch.allclose(out[1][out[1] != 0], torch.tensor(-0.9))
    assert not bool((out[:, 5] != 0).any())  # padding never trains


def test_vppo_config_runs_a_step(qwen25_dir, tmp_path, reward_spread, one_thread):
    cfg = load_config(backend.CONFIG_CLASS, ROOT / "configs" / "vlm" / "vppo.yaml", [
        f"model.path={qwen25_dir}", f"output_dir={tmp_path}", "train.max_steps=1", "task.num_train=8",
        "task.num_eval=2", "rollout.eval_samples=0", "rollout.prompts_per_step=2", "rollout.num_generations=4",
        "rollout.max_new_tokens=8", "method.dynamic_sampling.enabled=false", "logging.progress=false",
        "logging.tensorboard=false"], defaults=backend.DEFAULT_CONFIG)
    policy, task = backend.build(cfg)
    before = {k: v.detach().clone() for k, v in policy.model.named_parameters()}
    Trainer(cfg, policy, task, backend=backend).train()
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert row["vppo/visual_dependency"] > 0 and math.isfinite(row["loss/total"])
    assert any(not torch.equal(v, before[k]) for k, v in policy.model.named_parameters())


def test_vppo_refuses_engines_beside_the_trainer(qwen25_dir, tmp_path):
    import pytest

    from mmrl.core.config import ConfigError

    cfg = load_config(backend.CONFIG_CLASS, ROOT / "configs" / "vlm" / "vppo.yaml", [
        f"model.path={qwen25_dir}", f"output_dir={tmp_path}", "rollout.scheduler.mode=pipelined",
        "task.num_train=8", "task.num_eval=2"], defaults=backend.DEFAULT_CONFIG)
    policy, task = backend.build(cfg)
    with pytest.raises(ConfigError, match="re-scores rollouts"):
        Trainer(cfg, policy, task, backend=backend)
