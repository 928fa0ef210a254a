"""benchmarks/diffusion_methods.py's readings: "reach" on full trailing windows, train time
from the steps alone."""

from __future__ import annotations

from pathlib import Path

from mmrl.core.rewards import import_python_file

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "diffusion_methods.py"


def test_reach_counts_only_full_windows_and_sums_the_steps_up_to_it():
    bench = import_python_file(BENCH, "benchmark")
    rewards = [0.9, 0.1, 0.1, 0.5, 0.6, 0.7]  # a noisy first step alone is above the target
    rows = [{"step": i + 1, "reward/total": r, "time/step": 1.5, "cost/model_evaluations": 10.0}
            for i, r in enumerate(rewards)]
    assert bench.reach(rows, 0.5, 3) == (6, 9.0, 60.0)  # the first full window with mean >= 0.5
    assert bench.reach(rows, 0.5, 1) == (1, 1.5, 10.0)
    assert bench.reach(rows, 0.95, 3) == (None, None, None)
