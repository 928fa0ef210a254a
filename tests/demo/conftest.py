"""Tiny finished runs of each modality (one training step from the bundled models), for the
demo's functions and its browser test."""

from __future__ import annotations

import pytest

from mmrl.core.config import load_config
from mmrl.core.trainer import Trainer
from mmrl.demo.runs import backend

QUICK = ["train.max_steps=1", "logging.tensorboard=false", "logging.progress=false"]
SETTINGS = {
    "vlm": ["rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_new_tokens=16",
            "task.num_train=8", "task.num_eval=4", "train.log_samples_every=1"],
    "diffusion": ["rollout.prompts_per_step=1", "rollout.num_generations=2", "rollout.num_steps=4",
                  "rollout.window_size=2", "task.num_train=8", "task.num_eval=2", "task.grid_prompts=2"],
    "dllm": ["rollout.prompts_per_step=2", "rollout.num_generations=2", "task.num_train=8", "task.num_eval=4"],
}


def train_tiny(modality: str, out, *extra: str) -> None:
    b = backend(modality)
    cfg = load_config(b.CONFIG_CLASS, None, [f"output_dir={out}", *QUICK, *SETTINGS[modality], *extra],
                      defaults=b.DEFAULT_CONFIG)
    policy, task = b.build(cfg)
    Trainer(cfg, policy, task, backend=b).train()


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo_runs")
    runs = {}
    for modality in ("vlm", "diffusion", "dllm"):
        runs[modality] = root / modality
        train_tiny(modality, runs[modality])
    return runs


@pytest.fixture
def train_run():
    """train_run(modality, out, *overrides): one more tiny finished run, with its own settings."""
    return train_tiny
