"""Exactly on-policy runs skip the old-log-prob pass (mmrl.core.pipeline.exactly_on_policy):
when it applies, that the rollouts and the generator's draws are unchanged, that the batch is
marked, that the rollout costs fewer forward tokens, and that the loss and its gradient equal
those computed from scored old log-probs, for every dLLM estimator."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dllm_rl import backend
from dllm_rl.methods.common import OLD_IS_NEW
from mmrl.core.config import load_config
from mmrl.core.method import build_method
from mmrl.core.pipeline import exactly_on_policy

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "dllm"
SMALL = ["task.num_train=50", "task.num_eval=4", "logging.tensorboard=false", "logging.progress=false",
         "train.ppo_epochs=1"]
# where each estimator keeps its scored old log-probs
SCORED = {"slim_rl": "slim/old_logp", "diffu_grpo": "old_logp_mu"}


def config(name: str, *overrides: str):
    return load_config(backend.CONFIG_CLASS, CONFIGS / f"{name}.yaml", [*SMALL, *overrides],
                       defaults=backend.DEFAULT_CONFIG)


@pytest.mark.parametrize("overrides, expected", [
    ((), True),
    (("train.ppo_epochs=2",), False),
    (("train.mini_batches=2",), False),
    (("rollout.scheduler.mode=pipelined",), False),
    (("rollout.scheduler.placement=thread",), False),
])
def test_which_runs_are_exactly_on_policy(overrides, expected):
    assert exactly_on_policy(config("slim_rl", *overrides)) is expected


@pytest.mark.parametrize("name", ["slim_rl", "fork_grpo", "ar_grpo", "diffu_grpo", "tracerl"])
def test_skipping_the_old_pass_changes_no_rollout_and_no_gradient(name):
    cfg = config(name)
    policy, task = backend.build(cfg)
    assert policy.estimator.on_policy  # built from an exactly on-policy config

    def rollout(on_policy: bool):
        policy.estimator.on_policy = on_policy
        policy.step_costs()
        generator = torch.Generator().manual_seed(0)
        batch = policy.generate(task.train[:2], 4, cfg.rollout, generator)
        return batch, policy.step_costs()["cost/forward_tokens"], generator.get_state()

    skipped, tokens_skipped, state_skipped = rollout(True)
    scored, tokens_scored, state_scored = rollout(False)
    assert torch.equal(state_skipped, state_scored)  # the estimator drew the same numbers
    assert OLD_IS_NEW in skipped.data and OLD_IS_NEW not in scored.data
    assert set(scored.data) - set(skipped.data) - {OLD_IS_NEW} == ({SCORED[name]} if name in SCORED else set())
    for key, value in skipped.data.items():
        if key != OLD_IS_NEW:
            assert torch.equal(value, scored.data[key]), key
    assert tokens_skipped < tokens_scored

    method = build_method(cfg, task.reward)
    advantages = torch.linspace(-1, 1, len(skipped))

    def loss_and_grads(batch):
        policy.model.zero_grad()
        out = method.loss(policy, batch, advantages, denom=method.loss_denominator(batch))
        out.loss.backward()
        grads = [p.grad.clone() for p in policy.model.parameters() if p.grad is not None]
        return out, grads

    out_skipped, grads_skipped = loss_and_grads(skipped)
    out_scored, grads_scored = loss_and_grads(scored)
    assert grads_skipped and len(grads_skipped) == len(grads_scored)
    assert torch.allclose(out_skipped.loss, out_scored.loss, atol=1e-6)
    for a, b in zip(grads_skipped, grads_scored):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert out_skipped.metrics["loss/clip_frac"] == 0
