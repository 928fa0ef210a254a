"""The optimizer and the loop's numerics as a researcher tunes them: the logged learning rate,
the warm-up against the run's length, gradient clipping's settings (test_trainer.py's tiny
Llama run; each test a few updates)."""

from __future__ import annotations

import pytest
from test_trainer import make

from mmrl.core.logging import read_metrics

SMALL = ("rollout.prompts_per_step=2", "rollout.num_generations=2")  # a quicker run


def test_optim_lr_is_the_lr_each_step_trained_with(tmp_path):
    """Warm-up over 2 optimizer steps, one per training step: step k (from 1) trains at
    lr x k / 2 and logs that, not the next step's lr x (k + 1) / 2 (the schedule has already
    moved on when the metrics are gathered)."""
    make(tmp_path, *SMALL, "train.max_steps=3", "optim.warmup_steps=2", "optim.lr=0.004").train()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    # 0.004 x (1, 2, 2) / 2; before, (2, 2, 2) / 2: the warm-up's first step was never shown
    assert [r["optim/lr"] for r in rows] == [pytest.approx(v) for v in (0.002, 0.004, 0.004)]
