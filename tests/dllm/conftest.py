"""Shared by the dLLM policy, method and CLI tests: one thread, one tiny real model, and a
small run config built the way the CLI builds it."""

from __future__ import annotations

import pytest

from dllm_rl import backend
from dllm_rl.config import DLLMTrainConfig
from dllm_rl.tiny import build_tiny_dllm
from mmrl.core.config import load_config

TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64}

# 2 prompts x 4 answers of 8 tokens: 2 blocks of 4, 8 denoising steps (4 per block).
SMALL = ["rollout.prompts_per_step=2", "rollout.num_generations=4", "task.num_train=50", "task.num_eval=8",
         "rollout.gen_length=8", "rollout.block_length=4", "rollout.steps=8", "rollout.eval_batch_size=32",
         "logging.tensorboard=false", "logging.progress=false",
         # the random tiny model scores every answer alike: keep its groups (the default drops them)
         "method.dynamic_sampling.enabled=false"]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="session")
def tiny_dllm(tmp_path_factory):
    """A 2-layer, 32-wide LLaDA-style (Llama, full attention) mask predictor, seed 0."""
    return build_tiny_dllm(tmp_path_factory.mktemp("tiny_dllm") / "llada", kind="llada", seed=0, **TINY)


@pytest.fixture
def make_run(tiny_dllm, tmp_path):
    """make_run(*overrides, score_old=False) -> (cfg, policy, task) of the tiny model with the
    SMALL settings. score_old: rollouts get scored old log-probs, as off-policy runs do (runs
    whose first pass is on-policy skip that pass)."""

    def make(*overrides: str, score_old: bool = False):
        cfg = load_config(DLLMTrainConfig, None,
                          [f"model.path={tiny_dllm}", f"output_dir={tmp_path / 'run'}", *SMALL, *overrides],
                          defaults=backend.DEFAULT_CONFIG)
        policy, task = backend.build(cfg)
        if score_old:
            policy.estimator.on_policy = False
        return cfg, policy, task

    return make


@pytest.fixture(scope="session")
def small_sets(tiny_dllm):
    """The SMALL run on the tiny model as CLI arguments: --set key=value ..."""
    return [arg for kv in (f"model.path={tiny_dllm}", *SMALL) for arg in ("--set", kv)]
