"""Where a step's reward time goes: `time/reward/<atom>`, the seconds of each atom's calls
(mmrl.core.rewards: AtomScores.seconds, add_atom_times), logged by the sync scheduler and the
pipelined one, whatever the backend (every backend's atoms are scored by the core Reward)."""

from __future__ import annotations

import asyncio
import types

import pytest
import toy
from test_pipeline import FakeEngine, SeededToy, config, scheduler
from test_trainer import make

from mmrl.core import rewards
from mmrl.core.rewards import Reward, RewardAtom, Sample, add_atom_times, atom_times


@pytest.fixture
def clock(monkeypatch):
    """The rewards module's clock, advanced only by the atoms (costing() below): exact seconds."""
    now = types.SimpleNamespace(t=0.0)
    monkeypatch.setattr(rewards, "time", types.SimpleNamespace(perf_counter=lambda: now.t))
    return now


def costing(clock, seconds, fn):
    """fn, taking `seconds` of the fake clock a call."""
    def call(arg):
        clock.t += seconds
        return fn(arg)
    return call


SAMPLES = [Sample(p, c) for p, c in [(1, 1), (2, 0), (3, 1), (4, 1)]]


def test_each_atom_is_charged_its_own_calls(clock):
    """`ocr` (2 s a sample) gates `judge` (0.5 s a sample) and a batched `rm` (3 s a call): ocr
    scores 1 on 3 of 4 samples, so judge is called 3 times, 1.5 s; rm once for all 4, 3 s."""
    ocr = RewardAtom("ocr", costing(clock, 2.0, lambda s: s.completion))
    judge = RewardAtom("judge", costing(clock, 0.5, lambda s: 1.0), parents=("ocr",))
    rm = RewardAtom("rm", costing(clock, 3.0, lambda ss: [0.0] * len(ss)), batched=True)
    scores = Reward([ocr, judge, rm]).score(SAMPLES)
    assert scores.seconds == {"ocr": 8.0, "judge": 1.5, "rm": 3.0}
    assert scores.select([0, 1]).seconds == scores.seconds  # the calls' time, whatever rows are kept
    times = atom_times(["ocr", "judge", "rm", "never"])
    add_atom_times(times, scores)
    add_atom_times(times, scores)  # a second round adds up
    assert times == {"time/reward/ocr": 16.0, "time/reward/judge": 3.0, "time/reward/rm": 6.0,
                     "time/reward/never": 0.0}


def test_a_failed_or_timed_out_call_is_charged_too(clock):
    """Time spent in a call that raised counts (on_error="zero": scored 0, its time was spent)."""
    def broken(s):
        clock.t += 1.0
        raise RuntimeError("sandbox died")
    with pytest.warns(RuntimeWarning, match="sandbox died"):
        scores = Reward([RewardAtom("sandbox", broken)], on_error="zero").score(SAMPLES)
    assert scores.errors == 4 and scores.seconds == {"sandbox": 4.0}


def test_async_atoms_are_charged_their_wall_time_not_the_sum_of_overlapping_calls():
    """4 calls of a 0.2 s judge run together: about 0.2 s, not 0.8; a quick async atom in the
    same level is charged its own calls, not the judge's."""
    async def judge(s):
        await asyncio.sleep(0.2)
        return 1.0

    async def quick(s):
        return 1.0

    scores = Reward([RewardAtom("judge", judge), RewardAtom("quick", quick)]).score(SAMPLES)
    assert 0.2 <= scores.seconds["judge"] < 0.6 and scores.seconds["quick"] < 0.1


def slow_toy_reward(clock):
    """The toy task's atoms, `answer` at 1 s a sample and `stop` (gated by answer) at 2 s."""
    return Reward([RewardAtom("answer", costing(clock, 1.0, toy.answer.fn)),
                   RewardAtom("stop", costing(clock, 2.0, toy.stop.fn), weight=0.5, parents=("answer",))])


def test_the_sync_scheduler_logs_each_atoms_seconds_over_the_steps_rounds(tmp_path, clock):
    trainer = make(tmp_path, "rollout.num_generations=2")  # 4 prompts x 2 samples
    trainer.scheduler.reward = slow_toy_reward(clock)
    batch, metrics = trainer.scheduler.next_groups(version=0)
    answered = int(batch.scores.values[:, 0].sum())  # stop is called on these only
    assert metrics["time/reward/answer"] == 8.0 and metrics["time/reward/stop"] == 2.0 * answered


def test_the_pipelined_scheduler_logs_reward_time_and_each_atoms(tmp_path, clock):
    """The pipelined round (8 groups of 4) scores in its dispatcher: time/reward, which it did not
    log before, and time/reward/<atom>."""
    sched, _ = scheduler(config(tmp_path), [FakeEngine(SeededToy())])
    sched.reward = slow_toy_reward(clock)
    rnd, _ = sched.start_round(0, 4)
    groups = list(rnd)
    sched.close()
    answered = sum(int(b.scores.values[:, 0].sum()) for b in groups)
    assert rnd.metrics["time/reward/answer"] == 32.0 and rnd.metrics["time/reward/stop"] == 2.0 * answered
    assert rnd.metrics["time/reward"] >= 0.0


def test_the_sync_schedulers_extra_samples_are_charged_to_the_step(tmp_path, clock, monkeypatch):
    """A method asking 2 more samples of every group (AXPO's continuations): they are scored, and
    their reward seconds join time/reward and time/reward/<atom>, where they were left out. The
    scheduler reads the atoms' clock too, which only the atoms advance: time/reward is exactly
    the atoms' seconds, 1 s of `answer` per sample for 8 + 4 * 2 samples, plus 2 s of `stop` each
    sample that answered."""
    from mmrl.core import scheduler
    from mmrl.core.engine import Request

    trainer = make(tmp_path, "rollout.num_generations=2")  # 4 prompts x 2 samples
    monkeypatch.setattr(scheduler, "time", rewards.time)

    def extra_requests(self, group):
        g = int(group.group_ids[0])
        return [Request(g, group.prompts[g], 2, tag=1)]

    trainer.method.__class__ = type("Resampling", (type(trainer.method),), {"extra_requests": extra_requests})
    trainer.scheduler.reward = slow_toy_reward(clock)
    batch, metrics = trainer.scheduler.next_groups(version=0)
    answered = int(batch.scores.values[:, 0].sum())
    assert len(batch) == 16 and metrics["rollout/samples_extra"] == 8
    assert metrics["time/reward/answer"] == 16.0 and metrics["time/reward/stop"] == 2.0 * answered
    assert metrics["time/reward"] == 16.0 + 2.0 * answered
