"""What grows with the number of steps of a long run: work per step that is O(steps) or
O(dataset), files read whole, checkpoints that pile up. Counted on the toy trainer or on
the pieces themselves rather than measured in memory or seconds (except where only time
shows a quadratic)."""

from __future__ import annotations

import json
import random
import time
import tracemalloc

import pytest
import torch
import toy

from mmrl.core import logging as mlog
from mmrl.core.checkpoint import list_checkpoints
from mmrl.core.config import TrainConfig, load_config
from mmrl.core.logging import read_metrics, running_mean
from mmrl.core.scheduler import PromptStream
from mmrl.core.trainer import Trainer


def test_running_mean_matches_the_window_mean_and_is_linear_in_the_steps():
    rng = random.Random(0)
    values = [rng.uniform(-1, 1) for _ in range(95)]
    window = 9  # 95 // 10
    expected = [sum(values[max(0, i - window + 1): i + 1]) / min(i + 1, window) for i in range(len(values))]
    assert running_mean(values) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    # 40,000 steps: summing every window afresh (4,000 values each) took 1.7 s; prefix sums ~20 ms
    long = [float(i % 7) for i in range(40_000)]
    t0 = time.perf_counter()
    out = running_mean(long)
    assert time.perf_counter() - t0 < 0.5
    assert out[-1] == pytest.approx(sum(long[-4000:]) / 4000)


def test_read_metrics_never_holds_the_whole_file(tmp_path):
    # rows padded with blanks: large as text, small as dicts. Reading the text whole (and then
    # its lines) held twice the file; line by line holds one line beside the rows.
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": i}) + " " * 4000 + "\n" for i in range(1, 501)))
    size = path.stat().st_size  # ~2 MB
    tracemalloc.start()
    try:
        rows = read_metrics(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [r["step"] for r in rows] == list(range(1, 501))
    assert peak < size / 4, (peak, size)


def test_a_torn_last_line_is_still_dropped_and_a_bad_terminated_one_still_refused(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "los')  # a kill mid-write
    assert mlog._read_metrics(path) == ([{"step": 1}, {"step": 2}], True)
    path.write_text('{"step": 1}\nnot json\n')  # ended by a newline: written whole, so damaged
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not a JSON metrics row"):
        read_metrics(path)


def test_the_prompt_order_is_drawn_once_per_epoch_not_per_step(monkeypatch):
    # A permutation of the whole dataset per step cost 70 ms a step at a million prompts.
    calls = []
    randperm = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **kw: calls.append(a[0]) or randperm(*a, **kw))
    stream = PromptStream(list(range(10)), seed=3)
    taken = [p for _ in range(20) for p in stream.take(2)[0]]  # 40 prompts: 4 epochs
    assert len(calls) == 4
    for e in range(4):  # each epoch is its own seeded permutation, as before
        g = torch.Generator().manual_seed(3 * 100_003 + e)
        assert taken[10 * e: 10 * e + 10] == randperm(10, generator=g).tolist()
    stream.load_state_dict({"position": 5, "seed": 3, "size": 10})  # a resume into epoch 0 again
    assert stream.take(5)[0] == taken[5:10]


def test_the_steps_never_reread_metrics_and_checkpoints_stay_bounded(tmp_path, monkeypatch):
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[
        f"output_dir={tmp_path / 'run'}", "train.max_steps=12", "train.eval_every=2", "train.save_every=2",
        "train.log_samples_every=1", "train.keep_last=2", "train.best_metric=accuracy",
        "rollout.prompts_per_step=2", "rollout.num_generations=2"])
    trainer = Trainer(cfg, *toy.build(cfg))
    reads, during = [], []
    read = mlog._read_metrics
    monkeypatch.setattr(mlog, "_read_metrics", lambda path: reads.append(path) or read(path))
    steps = trainer._train_steps

    def counted(*a, **kw):
        before = len(reads)
        try:
            return steps(*a, **kw)
        finally:
            during.append(len(reads) - before)

    monkeypatch.setattr(trainer, "_train_steps", counted)
    trainer.train()
    assert during == [0]  # no step reads the growing metrics.jsonl; the end reads it a fixed few times
    assert len(list_checkpoints(tmp_path / "run" / "checkpoints")) <= 3  # keep_last + the best
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == 12


def test_the_reports_reward_curve_takes_the_linear_running_mean_and_skips_a_json_nan(tmp_path, monkeypatch):
    # report.html's curve (mmrl.demo.runs.plot_curves) summed each window afresh too: 23 s of the
    # end of a 100,000-step run; a NaN written as JSON's NaN would spread over every later prefix sum
    from mmrl.demo import runs

    calls = []
    monkeypatch.setattr(runs, "running_mean", lambda values: calls.append(list(values)) or running_mean(values))
    rows = [{"step": k, "reward/total": float(k % 3)} for k in range(1, 41)] + [{"step": 41, "reward/total": float("nan")}]
    run = runs.RunInfo(path=tmp_path, config={}, modality="dllm", metrics=rows)
    assert run.curves()["reward/total"][0] == list(range(1, 41))  # the NaN step is a gap
    runs.plot_curves(run, tmp_path / "curve.png")
    assert calls == [[float(k % 3) for k in range(1, 41)]] and (tmp_path / "curve.png").stat().st_size > 0
