"""The diffusion backend with model.device=cuda on a real GPU: `diffusion-rl train` (Flow-GRPO,
CAST, FTFC) for two steps on the bundled tiny flow model, then `eval` and `sample` from its
checkpoint. The CPU machine checks the same paths on a simulated device
(tests/diffusion/test_diffusion_device.py); this is the real one."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the diffusion CUDA tests need a CUDA GPU", allow_module_level=True)

from diffusion_rl import backend
from diffusion_rl.config import DiffusionTrainConfig
from mmrl.core.config import load_config
from mmrl.core.trainer import Trainer

pytestmark = pytest.mark.gpu

SHORT = ["rollout.num_steps=4", "rollout.window_size=2", "rollout.window_start=[0,1]", "rollout.num_generations=4",
         "rollout.prompts_per_step=2", "task.num_train=16", "task.num_eval=4", "task.grid_prompts=2",
         "task.eval_seeds=1", "logging.tensorboard=false", "logging.progress=false", "optim.lr=1e-3",
         "train.max_steps=2", "model.device=cuda"]


def run(*args):
    return subprocess.run([sys.executable, "-m", "diffusion_rl", *args], capture_output=True, text=True,
                          timeout=600, check=False)


@pytest.mark.parametrize("method", [["method.type=flow_grpo", "method.kl.beta=0.04"], ["method.type=cast"],
                                    ["method.type=ftfc", "method.anchor=base"]], ids=["flow_grpo", "cast", "ftfc"])
def test_two_steps_train_on_cuda(tmp_path, reward_spread, method):
    cfg = load_config(DiffusionTrainConfig, defaults=backend.DEFAULT_CONFIG,
                      overrides=[f"output_dir={tmp_path / 'run'}", *SHORT, *method])
    policy, task = backend.build(cfg)
    assert all(p.device.type == "cuda" for p in policy.model.parameters())
    assert all(p.device.type == "cuda" for p in policy.flow.components["text_encoder"].parameters())
    before = {k: v.detach().clone() for k, v in policy.model.named_parameters() if v.requires_grad}
    summary = Trainer(cfg, policy, task).train()
    assert summary["steps"] == 2
    assert all(p.device.type == "cuda" for p in policy.model.parameters())
    unchanged = [k for k, v in policy.model.named_parameters() if v.requires_grad and torch.equal(v, before[k])]
    assert not unchanged, unchanged[:5]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r[k] for r in rows for k in r if k.startswith("loss/")]
    assert losses and all(math.isfinite(v) for v in losses)


def test_cli_train_eval_and_sample_on_cuda(tmp_path):
    sets = [a for s in SHORT for a in ("--set", s)]
    out = tmp_path / "run"
    r = run("train", "--output-dir", str(out), *sets)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    r = run("eval", "--checkpoint", str(out), "--set", f"output_dir={tmp_path / 'eval'}", *sets)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 0 <= json.loads(r.stdout.strip().splitlines()[-1])["atom_accuracy"] <= 1
    r = run("sample", "--checkpoint", str(out), "--prompt", "a red circle", "--num", "2",
            "--set", f"output_dir={tmp_path / 'sampled'}", *sets)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2 and all(Path(row["image"]).stat().st_size > 100 for row in rows)


def test_a_seed_draws_the_same_first_latents_on_cuda_as_on_the_cpu(tmp_path):
    """The noise comes from a CPU generator: the same start on both devices (the velocities
    then differ by kernel rounding only)."""
    cfg = load_config(DiffusionTrainConfig, defaults=backend.DEFAULT_CONFIG,
                      overrides=[f"output_dir={tmp_path / 'run'}", *SHORT])
    policy, _ = backend.build(cfg)
    x = policy.flow.noise(2, torch.Generator().manual_seed(0))
    assert x.device.type == "cuda"
    cpu = backend.build(cfg.model_copy(update={"model": cfg.model.model_copy(update={"device": "cpu"})}))[0]
    assert torch.equal(x.cpu(), cpu.flow.noise(2, torch.Generator().manual_seed(0)))
