"""The compute a dLLM training step logs (cost/forward_tokens, cost/train_rows): what the method
comparisons (benchmarks/dllm_methods.py) put accuracy against."""

from __future__ import annotations

import json

import torch

from mmrl.core.trainer import Trainer


def test_step_costs_count_every_forward_and_the_training_rows(make_run, tmp_path):
    cfg, policy, task = make_run("method.type=diffu_grpo", "train.max_steps=2", "train.ppo_epochs=2")
    Trainer(cfg, policy, task).train()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    n, width = 2 * 4, policy.prompt_length + cfg.rollout.gen_length
    for row in rows:
        # diffu-GRPO trains one row per answer per inner pass
        assert row["cost/train_rows"] == n * 2
        # rollout: one [N, P + G] forward per decoding step (4 per block with low_confidence at
        # 8 steps for 8 tokens = 1 per step); old log-probs: one per inner pass; training: one per pass
        assert row["cost/forward_tokens"] == (cfg.rollout.steps + 2 + 2) * n * width
    policy.step_costs()
    with torch.no_grad():
        policy.logits(torch.zeros(3, width, dtype=torch.long), torch.ones(3, policy.prompt_length, dtype=torch.bool))
    assert policy.step_costs() == {"cost/forward_tokens": 3.0 * width, "cost/train_rows": 0.0}
