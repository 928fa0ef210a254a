"""Reproducibility fixes found by running each CLI's configs twice, with another seed, and
stopped and resumed (the runs themselves are in tests/reliability/test_kill_resume.py and the
methods' own resume tests; these pin the bugs those runs found)."""

from __future__ import annotations

from collections import Counter

import torch

from mmrl.core.batch import RolloutBatch
from mmrl.core.config import load_config
from mmrl.core.rewards import AtomScores, Sample
from mmrl.vlm import backend
from mmrl.vlm.methods import dspo
from mmrl.vlm.methods.dspo import DSPO
from mmrl.vlm.tasks import shapes_mood
from mmrl.vlm.tasks.shapes_mood import MOOD_WARNINGS


def test_dspo_step_warnings_leave_out_the_evaluation_before_the_step(monkeypatch):
    """An evaluation between steps scores shapes-mood too; its bad outputs were logged as the
    next training step's, so the step after an evaluation differed between an uninterrupted
    run and one resumed from that step's checkpoint (which runs no evaluation there)."""
    cfg = load_config(backend.CONFIG_CLASS, None, ["method.type=dspo", "task.type=shapes-mood"],
                      defaults=backend.DEFAULT_CONFIG)
    method = DSPO(cfg.method, cfg, None)
    total = torch.tensor([1.0, 0.0])
    batch = RolloutBatch(group_ids=torch.tensor([0, 0]), samples=[Sample("q", "a")] * 2,
                         scores=AtomScores(names=["answer"], values=total[:, None], total=total))
    batch.data.update({"dspo/r_cf": torch.zeros(2), "dspo/r_div": torch.zeros(2),
                       "dspo/scored": torch.tensor([True, False])})
    monkeypatch.setitem(MOOD_WARNINGS, "bad_box", MOOD_WARNINGS["bad_box"] + 50)  # the evaluation's
    method.step = 3  # the trainer, as step 4 begins
    monkeypatch.setitem(MOOD_WARNINGS, "bad_box", MOOD_WARNINGS["bad_box"] + 2)  # the step's rollouts'
    assert method.batch_metrics(batch)["dspo/warnings/bad_box"] == 2.0
    assert method.step == 3


def _dspo_and_batch():
    cfg = load_config(backend.CONFIG_CLASS, None, ["method.type=dspo", "task.type=shapes-mood"],
                      defaults=backend.DEFAULT_CONFIG)
    total = torch.tensor([1.0, 0.0])
    batch = RolloutBatch(group_ids=torch.tensor([0, 0]), samples=[Sample("q", "a")] * 2,
                         scores=AtomScores(names=["answer"], values=total[:, None], total=total))
    batch.data.update({"dspo/r_cf": torch.zeros(2), "dspo/r_div": torch.zeros(2),
                       "dspo/scored": torch.tensor([True, False])})
    return DSPO(cfg.method, cfg, None), batch


def test_dspo_logs_every_warning_reason_whatever_the_process_saw_before(monkeypatch):
    """The warning columns were the reasons seen so far in the process: a run resumed after a
    step with an unknown emotion logged no dspo/warnings/unknown_emotion (0) where the
    uninterrupted run did, so their metrics rows differed."""
    monkeypatch.setattr(shapes_mood, "MOOD_WARNINGS", Counter())  # a fresh process: nothing seen yet
    monkeypatch.setattr(dspo, "MOOD_WARNINGS", shapes_mood.MOOD_WARNINGS)
    method, batch = _dspo_and_batch()
    shapes_mood.MOOD_WARNINGS["bad_box"] += 1
    out = method.batch_metrics(batch)
    assert {k: v for k, v in out.items() if k.startswith("dspo/warnings/")} == {
        "dspo/warnings/missing_part": 0.0, "dspo/warnings/bad_box": 1.0, "dspo/warnings/no_candidates": 0.0,
        "dspo/warnings/wrong_count": 0.0, "dspo/warnings/unknown_emotion": 0.0}


def test_shapes_mood_coverage_adds_in_one_order_whatever_the_hash_seed():
    """coverage summed the candidates' label mass in the order of a set of strings, which
    changes with each process's hash seed: two same-seed runs' ood/coverage differed in the
    last bit. It adds them in sorted order now (checked by the order of the look-ups, over
    three sets of five: a set's order is sorted by chance once in 120)."""

    class Seen(dict):
        def get(self, key, default=None):
            self.order.append(key)
            return super().get(key, default)

    for names in (["joy", "fear", "anger", "awe", "calm"], ["sad", "pride", "love", "envy", "hope"],
                  ["zest", "grief", "shame", "trust", "rage"]):
        dist = Seen({n: 0.1 * (i + 1) for i, n in enumerate(names)})
        dist.order = []
        assert shapes_mood.coverage(names, dist) == sum(dist[n] for n in sorted(names))
        assert dist.order == sorted(names)
