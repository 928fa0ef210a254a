"""The compute a dLLM training step logs (cost/forward_tokens, cost/train_rows): what the method
comparisons (benchmarks/dllm_methods.py) put accuracy against."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmrl.core.rewards import import_python_file
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


def test_smoothed_curve_averages_the_last_k_evaluations_and_keeps_their_compute():
    """benchmarks/dllm_methods.py --smooth: the compute-to-target table on trailing means."""
    bench = import_python_file(Path(__file__).resolve().parents[2] / "benchmarks" / "dllm_methods.py", "benchmark")
    # (step, accuracy, wall, tokens, rows)
    points = [(0, 0.1, 0.0, 0.0, 0.0), (5, 0.3, 1.0, 10.0, 2.0), (10, 0.6, 2.0, 20.0, 4.0),
              (15, 0.0, 3.0, 30.0, 6.0), (20, 0.3, 4.0, 40.0, 8.0)]
    assert bench.smooth(points, 1) == points
    out = bench.smooth(points, 3)
    assert out[0] == points[0]  # step 0 is the start, not averaged into anything
    assert [p[0] for p in out] == [0, 15, 20]
    assert [round(p[1], 6) for p in out[1:]] == [0.3, 0.3]
    assert out[1][2:] == points[3][2:] and out[2][2:] == points[4][2:]
    assert bench.smooth(points, 5) == [points[0]]  # fewer evaluations than K: nothing to compare
    with pytest.raises(SystemExit):
        bench.main(["slim", "--smooth", "0"])


def test_mean_curve_averages_the_seeds_point_by_point(capsys):
    """benchmarks/dllm_methods.py's "mean" row: the compute-to-target reading on seed-mean curves."""
    bench = import_python_file(Path(__file__).resolve().parents[2] / "benchmarks" / "dllm_methods.py", "benchmark")
    a = [(0, 0.1, 0.0, 0.0, 0.0), (5, 0.4, 2.0, 10.0, 4.0), (10, 0.2, 4.0, 20.0, 8.0)]
    b = [(0, 0.1, 0.0, 0.0, 0.0), (5, 0.2, 4.0, 30.0, 2.0), (10, 0.2, 8.0, 60.0, 4.0)]
    mean = bench.mean_curve([a, b])
    assert [p[0] for p in mean] == [0, 5, 10]
    assert mean[1] == pytest.approx((5, 0.3, 3.0, 20.0, 3.0)) and mean[2] == pytest.approx((10, 0.2, 6.0, 40.0, 6.0))
    assert bench.mean_curve([a, a[:2]]) is None  # evaluated at different steps: no mean
    # the baseline's mean curve peaks at 0.3 (step 5); the other reaches it at its step 10
    other = bench.mean_curve([[(0, 0.1, 0, 0, 0), (5, 0.25, 1.0, 5.0, 1.0), (10, 0.35, 2.0, 10.0, 2.0)]] * 2)
    bench.reach_rows("mean", {"base": mean, "other": other}, "base", "best")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| base | mean | 0.300 | 5 | 1.00x | 1.00x | 1.00x |"
    assert lines[1] == "| other | mean | 0.300 | 10 | 0.67x | 0.50x | 0.67x |"


def test_a_method_at_the_target_before_training_is_not_read_as_zero_compute(capsys):
    """Each config scores with its own decoder, and decoders start apart: one that starts at the
    baseline's target has reached nothing by training."""
    bench = import_python_file(Path(__file__).resolve().parents[2] / "benchmarks" / "dllm_methods.py", "benchmark")
    base = [(0, 0.42, 0.0, 0.0, 0.0), (5, 0.45, 10.0, 10.0, 10.0)]
    ahead = [(0, 0.455, 0.0, 0.0, 0.0), (5, 0.5, 1.0, 1.0, 1.0)]
    bench.reach_rows("0", {"ar_grpo": base, "fork_grpo": ahead}, "ar_grpo", "final")
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("| fork_grpo | 0 | 0.450 | 0: at the target before training") and "0.00x" not in lines[1]


def test_reuse_refuses_a_finished_run_made_with_other_settings(make_run, tmp_path):
    from mmrl.core.trainer import read_reused_run

    cfg, policy, task = make_run("method.type=diffu_grpo", "train.max_steps=1")
    Trainer(cfg, policy, task).train()
    out = tmp_path / "run"
    summary, rows = read_reused_run(out, cfg)
    assert summary["steps"] == 1 and len(rows) == 1
    assert read_reused_run(out, cfg.model_copy(update={"output_dir": str(tmp_path / "elsewhere")})) is not None
    other = cfg.model_copy(update={"seed": cfg.seed + 1})
    with pytest.raises(ValueError, match=rf"--reuse: {out} was made with other settings: seed: {cfg.seed} -> {cfg.seed + 1}"):
        read_reused_run(out, other)
