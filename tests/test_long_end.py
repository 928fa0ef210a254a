"""The end of a long run (100,000+ steps): what it reads and writes once the steps are done,
and what piles up while they run (sample tables), kept to a fixed cost."""

from __future__ import annotations

import toy

from mmrl.core import logging as mlog
from mmrl.core.config import TrainConfig, load_config
from mmrl.core.trainer import Trainer


def toy_trainer(out, *overrides: str) -> Trainer:
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[
        f"output_dir={out}", "train.max_steps=1", "rollout.prompts_per_step=2", "rollout.num_generations=2",
        "logging.tensorboard=false", "logging.progress=false", *overrides])
    return Trainer(cfg, *toy.build(cfg))


def test_the_end_of_a_run_parses_metrics_jsonl_once(tmp_path, monkeypatch):
    # summary.json, reward_curve.png and report.html each parsed it: 3 x 5 s of a 100,000-row file
    trainer = toy_trainer(tmp_path / "run")
    reads, during = [], []
    read = mlog._read_metrics
    monkeypatch.setattr(mlog, "_read_metrics", lambda path: reads.append(path) or read(path))
    write_summary = trainer.write_summary

    def counted(*a, **kw):
        before = len(reads)
        try:
            return write_summary(*a, **kw)
        finally:
            during.append(len(reads) - before)

    monkeypatch.setattr(trainer, "write_summary", counted)
    summary = trainer.train()
    assert during == [1]
    run = tmp_path / "run"
    assert summary["final_metrics"]["step"] == 1
    assert (run / "reward_curve.png").stat().st_size > 0
    assert "1 steps" in (run / "report.html").read_text()
