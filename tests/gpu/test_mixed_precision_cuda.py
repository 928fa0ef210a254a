"""bfloat16 training on a real GPU: the bundled dLLM with model.dtype=bfloat16 on cuda trains
two steps with float32 master weights there (optim.master_weights), and a learned reward model
atom scores on the same GPU. The CPU side: tests/test_master_weights.py, tests/test_reward_models.py.

Skipped without CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the mixed-precision CUDA test needs a CUDA GPU", allow_module_level=True)

from test_reward_models import build_rm

from dllm_rl import backend
from mmrl.core.config import load_config
from mmrl.core.trainer import Trainer

pytestmark = pytest.mark.gpu


def test_bfloat16_on_the_gpu_steps_float32_masters_and_scores_with_a_reward_model(tmp_path):
    build_rm(tmp_path / "rm")
    cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG, overrides=[
        "model.device=cuda", "model.dtype=bfloat16", "optim.lr=1e-5", "rollout.prompts_per_step=4",
        "rollout.num_generations=4", "task.num_train=20", "task.num_eval=4", "train.max_steps=2",
        "logging.tensorboard=false", "logging.progress=false", "method.dynamic_sampling.enabled=false",
        f"output_dir={tmp_path / 'run'}"])
    cfg.reward.atoms = [{"reward_model": str(tmp_path / "rm"), "name": "rm", "weight": 0.1}]
    trainer = Trainer(cfg, *backend.build(cfg))
    assert trainer.master.active
    start = [m.detach().clone() for m in trainer.opt_params]
    rows = [trainer.train_step() for _ in range(2)]
    assert {(p.device.type, p.dtype) for p in trainer.params} == {("cuda", torch.bfloat16)}
    assert {(m.device.type, m.dtype) for m in trainer.opt_params} == {("cuda", torch.float32)}
    moved = sum(int((m.detach() != s).sum()) for m, s in zip(trainer.opt_params, start))
    assert moved > 0.5 * sum(s.numel() for s in start)
    for p, m in zip(trainer.params, trainer.opt_params):
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))
    assert all(math.isfinite(r["reward/rm"]) for r in rows)
    rm = next(a for a in trainer.reward.atoms if a.name == "rm")
    assert rm.fn.device.type == "cuda"
