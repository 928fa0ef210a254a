"""The rollout scheduler (mmrl.core.pipeline): complete-group pipelining, frontier-group
dispatch, the group hooks, weight publication and engine faults, driven by fake engines
around the toy backend (tests/toy.py)."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch
import toy

from mmrl.core.batch import RolloutBatch
from mmrl.core.config import ConfigError, TrainConfig, load_config
from mmrl.core.engine import EngineError, PolicyEngine, Request
from mmrl.core.grpo import GRPO
from mmrl.core.logging import read_metrics
from mmrl.core.method import build_method
from mmrl.core.pipeline import PipelinedScheduler, check_config
from mmrl.core.scheduler import PromptStream
from mmrl.core.trainer import Trainer


class SeededToy(toy.ToyPolicy):
    """The toy policy, but each sample is drawn with its own seed (prompt, index in group),
    so a sample does not depend on how rollouts are split into engine calls."""

    def generate(self, prompts, num_generations, rollout, generator, prefixes=None):
        parts = []
        for i, p in enumerate(prompts):
            for j in range(num_generations):
                continued = prefixes is not None and prefixes[i * num_generations + j] is not None
                g = torch.Generator().manual_seed(1000 * p + j + (100 if continued else 0))
                parts.append(super().generate([p], 1, rollout, g))
        batch = RolloutBatch.concat(parts)
        batch.group_ids = torch.arange(len(prompts)).repeat_interleave(num_generations)
        return batch

    def reference(self):
        ref = SeededToy(model=super().reference().model)
        return ref


class FakeEngine(PolicyEngine):
    """A thread engine that records its calls and can be slow, fail or hang."""

    def __init__(self, policy, name="fake", delay=0.0, fail_after=None, hang_after=None, error=None):
        super().__init__(policy, own_weights=True, name=name)
        self.calls: list[list[tuple]] = []
        self.delay, self.fail_after, self.hang_after = delay, fail_after, hang_after
        self.error = error or EngineError(f"engine {name} crashed")
        self.release = threading.Event()

    def generate(self, requests, rollout, seed):
        k = len(self.calls)
        self.calls.append([(r.group, r.n, r.prefix, r.tag) for r in requests])
        if self.fail_after is not None and k >= self.fail_after:
            raise self.error
        if self.hang_after is not None and k >= self.hang_after:
            self.release.wait(30)
        time.sleep(self.delay)
        return super().generate(requests, rollout, seed)


def config(tmp_path, *overrides):
    return load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[
        f"output_dir={tmp_path / 'run'}", "rollout.prompts_per_step=8", "rollout.num_generations=4",
        "rollout.scheduler.mode=pipelined", "train.mini_batches=4", *overrides])


def scheduler(cfg, engines, method=None):
    policy, task = SeededToy(), toy.ToyTask()
    method = method or build_method(cfg, task.reward)
    return PipelinedScheduler(cfg, engines, PromptStream(task.train_prompts(), 0), task.reward, method,
                              torch.Generator().manual_seed(0), policy.model), policy


def round_over(cfg, engines, **kw):
    """One whole round of groups of 4 on `engines` -> (the closed scheduler, the round, its groups)."""
    sched, _ = scheduler(cfg, engines, **kw)
    rnd, _ = sched.start_round(0, 4)
    groups = list(rnd)
    sched.close()
    return sched, rnd, groups


def one_round(cfg):
    """One round of groups of 4 on a fresh FakeEngine -> (the engine, holding its calls; the groups)."""
    engine = FakeEngine(SeededToy())
    return engine, round_over(cfg, [engine])[2]


def test_frontier_dispatch_sends_only_the_lowest_incomplete_groups(tmp_path):
    cfg = config(tmp_path)  # U = 8 / 4 = 2 groups per step, F_w = U, 2 x 4 samples per call
    engine, groups = one_round(cfg)
    assert [sorted(g for g, *_ in call) for call in engine.calls] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [int(b.group_ids[0]) for b in groups] == list(range(8))  # completion order = frontier order
    assert all(len(b) == 4 and b.advantages is not None and b.scores is not None for b in groups)


def test_frontier_dispatch_never_sends_more_than_engine_batch_samples(tmp_path):
    """A group larger than the engine batch is split across calls, not sent whole."""
    cfg = config(tmp_path, "rollout.scheduler.engine_batch=3")
    engine, groups = one_round(cfg)
    assert max(sum(n for _, n, *_ in call) for call in engine.calls) == 3
    assert sorted(int(b.group_ids[0]) for b in groups) == list(range(8)) and all(len(b) == 4 for b in groups)


def test_without_frontier_every_group_advances_and_none_completes_early(tmp_path):
    cfg = config(tmp_path, "rollout.scheduler.frontier=0")
    engine, groups = one_round(cfg)
    assert len(engine.calls) == 4
    assert all(sorted(g for g, *_ in call) == list(range(8)) for call in engine.calls)  # 1 sample each
    assert sorted(int(b.group_ids[0]) for b in groups) == list(range(8))


def test_groups_reach_the_trainer_while_later_ones_are_still_rolling_out(tmp_path):
    cfg = config(tmp_path)
    engine = FakeEngine(SeededToy(), delay=0.2)
    sched, _ = scheduler(cfg, [engine])
    rnd, _ = sched.start_round(0, 4)
    it = iter(rnd)
    next(it)
    calls_when_first_arrived = len(engine.calls)
    rest = list(it)
    sched.close()
    assert calls_when_first_arrived < 4 and len(rest) == 7


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pipelined_and_sync_make_the_same_updates_for_the_same_samples(tmp_path, dtype):
    """In bfloat16 (float32 master weights) both take one group per micro-batch, since a bfloat16
    forward rounds by the rows batched together, and one step: the float32 sums of the two paths
    differ in their last bits, and a bfloat16 weight that rounds the other way changes the next
    step's samples."""
    runs = {}
    micro = ["train.micro_batch_size=8"] if dtype == "bfloat16" else []
    for mode in ("sync", "pipelined"):
        cfg = config(tmp_path / mode, f"rollout.scheduler.mode={mode}", "train.mini_batches=1",
                     f"train.max_steps={1 if micro else 3}", "method.loss.aggregation=token_mean", *micro)
        policy, task = SeededToy(), toy.ToyTask()
        policy.model.to(getattr(torch, dtype))
        trainer = Trainer(cfg, policy, task)
        trainer.train()
        runs[mode] = (trainer, read_metrics(tmp_path / mode / "run" / "metrics.jsonl"))
    (sync, m_sync), (pipe, m_pipe) = runs["sync"], runs["pipelined"]
    assert type(pipe.scheduler) is PipelinedScheduler and type(sync.scheduler) is not PipelinedScheduler
    assert sync.master.active == pipe.master.active == (dtype == "bfloat16")
    for (k, a), b in zip(sync.policy.model.state_dict().items(), pipe.policy.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)
    for a, b in zip(sync.opt_params, pipe.opt_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert [r["reward/total"] for r in m_sync] == [r["reward/total"] for r in m_pipe]
    assert all(r["rollout/staleness"] == 0 for r in m_pipe)
    assert all(r["train/updates"] == 1 for r in m_pipe)
    assert {"time/trainer_wait", "time/trainer_busy", "time/waiting_ratio", "time/publish",
            "time/rollout", "time/round"} <= set(m_pipe[-1])


def test_later_ppo_epochs_count_in_the_pipelined_steps_metrics_and_bad_steps(tmp_path):
    """ppo_epochs 2: the pipelined step's loss metrics average its streamed and its later epoch as
    sync's do, and a non-finite loss in the later epoch marks the step bad (max_bad_steps stops
    the run, and no checkpoint of a bad step is saved) in both modes."""
    import warnings

    from mmrl.core.trainer import TrainingError

    class NaNLater(SeededToy):
        trainer = None

        def logprobs(self, batch):
            lp = super().logprobs(batch)
            bad = self.trainer is not None and self.trainer.step >= 1 and self.trainer.method.epoch >= 1
            return lp * float("nan") if bad else lp

    runs = {}
    for mode in ("sync", "pipelined"):
        cfg = config(tmp_path / mode, f"rollout.scheduler.mode={mode}", "train.mini_batches=1", "train.ppo_epochs=2",
                     "train.max_steps=2", "method.loss.aggregation=token_mean")
        Trainer(cfg, SeededToy(), toy.ToyTask()).train()
        runs[mode] = read_metrics(tmp_path / mode / "run" / "metrics.jsonl")
        cfg = config(tmp_path / f"{mode}-nan", f"rollout.scheduler.mode={mode}", "train.ppo_epochs=2",
                     "train.mini_batches=2", "train.max_steps=4", "train.max_bad_steps=2", "train.save_every=1")
        policy = NaNLater()
        trainer = policy.trainer = Trainer(cfg, policy, toy.ToyTask())
        with warnings.catch_warnings(), pytest.raises(TrainingError, match="2 steps in a row"):
            warnings.simplefilter("ignore")
            trainer.train()
        rows = read_metrics(tmp_path / f"{mode}-nan" / "run" / "metrics.jsonl")
        assert [r.get("train/bad_step", 0.0) for r in rows] == [0.0, 1.0], mode  # the second bad step stops it
        assert sorted(p.name for p in (tmp_path / f"{mode}-nan" / "run" / "checkpoints").iterdir()) == ["step-00000001"]
    for a, b in zip(runs["sync"], runs["pipelined"]):
        for k in ("loss/policy", "loss/total", "train/updates"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-7), k


def test_loss_terms_are_logged_alike_whatever_the_micro_batches(tmp_path, one_thread):
    """loss/policy and loss/kl are the mini-batches' terms, averaged over the passes: a run with
    micro-batches logged them divided by their number, a pipelined one multiplied (each micro's
    term is a share, or a sum, of its mini-batch's, not a mean to weight). Each scheduler against
    itself: sync shuffles its mini-batches, the streamed epoch takes groups as they come. One
    thread: with two, on a loaded machine, sync's policy loss (a near-cancelling mean, after an
    Adam step that magnifies rounding in tiny gradients) came out 8.5e-4 apart, relatively, at
    every try (also on code where the suite had passed on an idle machine)."""
    runs = {}
    for mode in ("sync", "pipelined"):
        for micro in ([], ["train.micro_batch_size=2"]):
            cfg = config(tmp_path / f"{mode}{len(micro)}", "train.mini_batches=2", "train.ppo_epochs=2",
                         "train.max_steps=2", "method.loss.aggregation=token_mean", "method.kl.beta=0.5",
                         f"rollout.scheduler.mode={mode}", *micro)
            Trainer(cfg, SeededToy(), toy.ToyTask()).train()
            runs[mode, bool(micro)] = read_metrics(tmp_path / f"{mode}{len(micro)}" / "run" / "metrics.jsonl")
    for mode in ("sync", "pipelined"):
        assert runs[mode, False][1]["loss/kl"] > 1e-4  # the second step's KL: not a vanishing term
        for a, b in zip(runs[mode, False], runs[mode, True], strict=True):
            for k in ("loss/policy", "loss/kl", "loss/total"):
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-7), (mode, k)


def test_pipelined_steps_once_every_u_groups(tmp_path):
    cfg = config(tmp_path, "train.max_steps=2")  # 8 groups, U = 2
    trainer = Trainer(cfg, SeededToy(), toy.ToyTask())
    trainer.train()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["train/updates"] for r in rows] == [4, 4]
    assert [r["rollout/staleness"] for r in rows] == [0, 0]


def test_engines_get_new_weights_only_between_rounds(tmp_path):
    cfg = config(tmp_path, "train.max_steps=3")
    policy = SeededToy()
    engine = FakeEngine(policy)
    versions = []
    original = engine.generate

    def spy(requests, rollout, seed):
        versions.append(engine.version)
        w = next(iter(engine.policy.model.parameters()))
        versions.append(float(w.sum()))
        return original(requests, rollout, seed)

    engine.generate = spy
    trainer = Trainer(cfg, policy, toy.ToyTask(), engines=[engine])
    trainer.train()
    by_round = [versions[i::2] for i in range(2)]
    assert by_round[0] == [0] * 4 + [1] * 4 + [2] * 4  # 4 calls per round, one version each
    sums = by_round[1]
    assert len({sums[i] for i in range(4)}) == 1 and sums[3] != sums[4]  # constant within a round


class DropEven(GRPO):
    """Keeps only groups of odd prompts; asks 2 extra samples (a prefix) of prompt-3 groups;
    prunes the last sample of every group."""

    def keep_groups(self, batch):
        return torch.tensor([s.prompt % 2 == 1 for s in batch.samples])

    def extra_requests(self, group):
        s = group.samples[0]
        return [Request(int(group.group_ids[0]), s.prompt, 2, prefix=7, tag=1)] if s.prompt == 3 else []

    def prune(self, group):
        keep = torch.ones(len(group), dtype=torch.bool)
        keep[-1] = False
        return keep


def test_group_hooks_drop_refill_extra_and_prune(tmp_path):
    cfg = config(tmp_path, "method.dynamic_sampling.enabled=true", "method.dynamic_sampling.max_rounds=1")
    policy, task = SeededToy(), toy.ToyTask()
    method = DropEven(cfg.method, cfg, task.reward)
    engine = FakeEngine(policy)
    _, rnd, groups = round_over(cfg, [engine], method=method)
    m = rnd.metrics
    assert all(g.samples[0].prompt % 2 == 1 for g in groups)
    assert m["rollout/groups_dropped"] >= 1 and m["rollout/groups_refilled"] == min(m["rollout/groups_dropped"], 8)
    assert len(groups) == 8 + m["rollout/groups_refilled"] - m["rollout/groups_dropped"]
    for g in groups:
        extra = g.samples[0].prompt == 3
        assert len(g) == (4 + 2 if extra else 4) - 1  # one pruned
        assert int((g.data["request_tag"] == 1).sum()) == (1 if extra else 0)  # its last row pruned
    assert m["rollout/samples_pruned"] == len(groups)
    assert any(r[2] == 7 for call in engine.calls for r in call) == (m["rollout/groups_extra"] > 0)


def test_group_size_changes_at_epoch_boundaries_and_survives_resume(tmp_path, monkeypatch):
    class Shrink(GRPO):
        def group_size(self, epoch, current):
            return max(2, current - 1)

    import mmrl.core.method as method_mod

    monkeypatch.setitem(method_mod.METHODS, "grpo", Shrink)

    def run(max_steps, resume=False):
        cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[
            f"output_dir={tmp_path / 'run'}", "rollout.num_generations=4", f"train.max_steps={max_steps}"])
        trainer = Trainer(cfg, SeededToy(), toy.ToyTask())
        trainer.train(resume=resume)
        return trainer

    run(4)
    trainer = run(7, resume=True)
    # 10 prompts, 4 per step: steps 4 and 6 are the first to draw from epochs 1 and 2
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["rollout/group_size"] for r in rows] == [4, 4, 4, 3, 3, 2, 2]
    assert [r["rollout/samples"] for r in rows] == [16, 16, 16, 12, 12, 8, 8]
    assert trainer.num_generations == 2


def test_a_failing_engine_is_replaced_by_the_others(tmp_path):
    cfg = config(tmp_path)
    bad = FakeEngine(SeededToy(), name="bad", fail_after=1)
    good = FakeEngine(SeededToy(), name="good")
    sched, rnd, groups = round_over(cfg, [bad, good])
    assert sorted(int(g.group_ids[0]) for g in groups) == list(range(8))
    assert all(len(g) == 4 for g in groups)
    assert rnd.metrics["rollout/redispatched"] >= 1
    assert "crashed" in sched.workers[0].dead and sched.workers[1].dead == "closed"  # alive until close()


def test_a_hung_engine_is_detected_within_the_timeout(tmp_path):
    cfg = config(tmp_path, "rollout.scheduler.timeout=0.5")
    engine = FakeEngine(SeededToy(), hang_after=1)
    sched, _ = scheduler(cfg, [engine])
    rnd, _ = sched.start_round(0, 4)
    got = []
    t0 = time.perf_counter()
    with pytest.raises(EngineError, match="within 0.5 s"):
        got.extend(rnd)
    assert time.perf_counter() - t0 < 5
    engine.release.set()
    sched.close()
    assert all(len(g) == 4 for g in got)  # no partial group ever reached the trainer
    assert len(got) <= 2


def test_a_hung_engine_is_redispatched_to_a_live_one(tmp_path):
    cfg = config(tmp_path, "rollout.scheduler.timeout=0.5")
    hung = FakeEngine(SeededToy(), name="hung", hang_after=0)
    good = FakeEngine(SeededToy(), name="good")
    sched, _ = scheduler(cfg, [hung, good])
    rnd, _ = sched.start_round(0, 4)
    groups = list(rnd)
    hung.release.set()
    sched.close()
    assert sorted(int(g.group_ids[0]) for g in groups) == list(range(8))
    assert rnd.metrics["rollout/redispatched"] >= 1


def test_bad_input_errors_are_not_retried(tmp_path):
    cfg = config(tmp_path)
    a = FakeEngine(SeededToy(), name="a", fail_after=0, error=ValueError("prompt 3 is too long"))
    b = FakeEngine(SeededToy(), name="b", fail_after=0, error=ValueError("prompt 3 is too long"))
    sched, _ = scheduler(cfg, [a, b])
    rnd, _ = sched.start_round(0, 4)
    with pytest.raises(ValueError, match="too long"):
        list(rnd)
    sched.close()


def test_trainer_stops_with_a_clear_error_when_every_engine_fails(tmp_path):
    cfg = config(tmp_path, "train.max_steps=2", "rollout.scheduler.max_redispatch=0")
    engine = FakeEngine(SeededToy(), fail_after=2)
    trainer = Trainer(cfg, SeededToy(), toy.ToyTask(), engines=[engine])
    with pytest.raises(EngineError, match="crashed"):
        trainer.train()


def test_pipelined_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="multiple of train.mini_batches"):
        check_config(config(tmp_path, "train.mini_batches=3"), 1)
    with pytest.raises(ConfigError, match="placement=inline cannot pipeline"):
        check_config(config(tmp_path, "rollout.scheduler.placement=inline"), 1)
    with pytest.raises(ConfigError, match="needs the whole round"):
        check_config(config(tmp_path, "method.advantage.scale=batch"), 1)
    # sync mode on an engine beside the trainer completes groups one at a time, too
    with pytest.raises(ConfigError, match="needs the whole round.*placement is 'thread'"):
        check_config(config(tmp_path, "method.advantage.scale=batch", "rollout.scheduler.mode=sync",
                            "rollout.scheduler.placement=thread"), 1)
    check_config(config(tmp_path, "method.advantage.scale=batch", "rollout.scheduler.mode=sync",
                        "rollout.scheduler.placement=inline"), 1)
    with pytest.raises(ConfigError, match="needs rollout.scheduler.servers"):
        check_config(config(tmp_path, "rollout.scheduler.placement=remote"), 1)


def test_worker_reports_results_through_the_inbox():
    inbox: queue.Queue = queue.Queue()
    from mmrl.core.engine import Job, Worker

    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG)
    w = Worker(PolicyEngine(SeededToy(), own_weights=True), inbox)
    w.submit(Job([Request(5, 3, 2), Request(9, 4, 1)], cfg.rollout, seed=1))
    result = inbox.get(timeout=10)
    w.close()
    assert result.error is None and result.batch.group_ids.tolist() == [5, 5, 9]
    assert result.batch.data["request_tag"].tolist() == [0, 0, 0]


class Recording(SeededToy):
    """SeededToy that records each generate call: (prompts, samples per prompt, prefixes)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple] = []

    def generate(self, prompts, num_generations, rollout, generator, prefixes=None):
        self.seen.append((list(prompts), num_generations, prefixes))
        return super().generate(prompts, num_generations, rollout, generator, prefixes)


def test_an_engine_call_mixing_prefixed_and_fresh_requests_passes_every_prefix():
    """One request with a prefix (AXPO's resampling) beside one without: the call goes one row
    per sample with the prefixes (None for the fresh rows), so the prefixed samples continue
    their prefix instead of starting again from the prompt."""
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG)
    policy = Recording()
    batch = PolicyEngine(policy, own_weights=False).generate(
        [Request(5, 3, 2), Request(9, 4, 1, prefix=7, tag=1)], cfg.rollout, seed=1)
    assert policy.seen == [([3, 3, 4], 1, [None, None, 7])]
    assert batch.group_ids.tolist() == [5, 5, 9] and batch.data["request_tag"].tolist() == [0, 0, 1]


def test_a_prefix_for_a_backend_that_cannot_continue_one_is_an_engine_error():
    """A policy whose generate() takes no `prefixes`: the engine says so (an EngineError naming
    it), rather than calling generate with an argument it does not take."""
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG)
    engine = PolicyEngine(toy.ToyPolicy(), own_weights=False, name="plain")
    with pytest.raises(EngineError, match="engine plain: .*cannot continue from a prefix"):
        engine.generate([Request(0, 3, 2), Request(0, 3, 1, prefix=7)], cfg.rollout, seed=1)


def test_an_engine_samples_with_the_seed_of_its_call():
    """The seed the dispatcher draws for a call is the one the engine samples with: the same
    seed gives the same samples, another seed others (SeededToy ignores it; the toy does not)."""
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG)
    engine = PolicyEngine(toy.ToyPolicy(), own_weights=True)
    one, again, other = (engine.generate([Request(0, 3, 16)], cfg.rollout, seed=s) for s in (1, 1, 2))
    assert one.samples == again.samples and torch.equal(one.old_logp, again.old_logp)
    assert one.samples != other.samples


def test_an_engine_seeds_its_generator_with_the_calls_seed_itself():
    """Not merely a function of the seed: the generator the policy gets is seeded with exactly it."""
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG)
    policy = toy.ToyPolicy()
    got = PolicyEngine(policy, own_weights=False).generate([Request(0, 3, 4)], cfg.rollout, seed=5)
    with torch.no_grad():
        want = policy.generate([3], 4, cfg.rollout, torch.Generator().manual_seed(5))
    assert got.samples == want.samples and torch.equal(got.old_logp, want.old_logp)


def test_an_engine_with_its_own_weights_takes_the_backends_rollout_copy():
    """own_weights: the backend's rollout_copy() where it has one, not reference(). A LoRA VLM's
    reference() is the policy with its adapters off, so an engine made from it would sample
    without the adapters the trainer publishes."""

    class WithCopy(SeededToy):
        def rollout_copy(self):
            copy = self.reference()
            copy.made_by = "rollout_copy"
            return copy

    engine = PolicyEngine(WithCopy(), own_weights=True)
    assert getattr(engine.policy, "made_by", None) == "rollout_copy"


def test_a_request_merging_retried_and_fresh_samples_keeps_the_retried_count(tmp_path):
    """A group's retried samples go back to the front of its queue, before its samples not yet
    sent; a call that takes both sends them as one request, whose retries must be the retried
    samples' (the higher) count: the fresh ones' 0 would let max_redispatch be passed."""
    cfg = config(tmp_path, "rollout.scheduler.engine_batch=4")
    sched, _ = scheduler(cfg, [])  # no engine: the round stops at once, its groups as admitted
    rnd, _ = sched.start_round(0, 4)
    with pytest.raises(EngineError, match="every rollout engine failed"):
        list(rnd)
    g = rnd.groups[0]
    g.todo = [Request(0, g.prompt, 1, retries=2), Request(0, g.prompt, 3)]
    assert [(r.group, r.n, r.retries) for r in rnd._next_requests()] == [(0, 4, 2)]
    sched.close()


def test_an_engine_that_returns_fewer_samples_than_asked_is_an_engine_error():
    """A batch short of its requests' samples cannot be labelled (its rows would take the wrong
    groups): an EngineError, so that the scheduler re-dispatches the call elsewhere."""

    class Short(SeededToy):
        def generate(self, *args, **kwargs):
            batch = super().generate(*args, **kwargs)
            return batch.select(torch.arange(len(batch) - 1))

    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG)
    engine = PolicyEngine(Short(), own_weights=False, name="short")
    with pytest.raises(EngineError, match="engine short returned 3 samples for requests of 4"):
        engine.generate([Request(0, 3, 2), Request(1, 4, 2)], cfg.rollout, seed=1)


def test_a_worker_whose_engine_does_not_take_new_weights_in_time_is_dead():
    """publish() waits `timeout` seconds for the engine, no longer: a hung publish is an
    EngineError within the timeout, and the worker gets no more jobs."""
    from mmrl.core.engine import Worker

    class HungPublish(FakeEngine):
        def publish(self, weights, version):
            self.release.wait(30)

    engine = HungPublish(SeededToy(), name="slow")
    w = Worker(engine, queue.Queue())
    t0 = time.perf_counter()
    with pytest.raises(EngineError, match="engine slow did not take new weights within 0.2 s"):
        w.publish({}, 1, timeout=0.2)
    assert time.perf_counter() - t0 < 2 and not w.alive
    engine.release.set()
    w.close()


def test_a_workers_publish_returns_the_seconds_the_engine_took():
    """What the trainer logs as time/publish: the seconds until the engine had the weights."""
    from mmrl.core.engine import Worker

    class SlowPublish(FakeEngine):
        def publish(self, weights, version):
            time.sleep(0.1)
            super().publish(weights, version)

    w = Worker(SlowPublish(SeededToy()), queue.Queue())
    seconds = w.publish({}, 3, timeout=10)
    w.close()
    assert 0.1 <= seconds < 5 and w.engine.version == 3


def test_requests_of_one_size_with_a_prefix_still_pass_it():
    """Every request asks one sample, one of them from a prefix: the call still goes with the
    prefixes (one size alone does not make a call without them)."""
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG)
    policy = Recording()
    PolicyEngine(policy, own_weights=False).generate([Request(5, 3, 1), Request(9, 4, 1, prefix=7, tag=1)],
                                                    cfg.rollout, seed=1)
    assert policy.seen == [([3, 4], 1, [None, 7])]


def test_an_engine_on_the_trainers_weights_samples_without_a_graph():
    """own_weights=False samples with parameters that require grad: the rollout builds no graph."""
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG)
    batch = PolicyEngine(toy.ToyPolicy(), own_weights=False).generate([Request(0, 3, 2)], cfg.rollout, seed=1)
    assert not batch.old_logp.requires_grad


def test_an_engine_on_the_trainers_weights_takes_only_the_version_on_publish():
    """own_weights=False: the engine is the trainer's policy, so publish copies nothing into it."""
    policy = toy.ToyPolicy(seed=0)
    before = {k: p.detach().clone() for k, p in policy.model.named_parameters()}
    engine = PolicyEngine(policy, own_weights=False)
    engine.publish({k: torch.zeros_like(p) for k, p in before.items()}, 6)
    assert engine.version == 6
    assert all(torch.equal(p, before[k]) for k, p in policy.model.named_parameters())


def test_an_engine_that_returns_more_samples_than_asked_is_an_engine_error():
    class Long(SeededToy):
        def generate(self, *args, **kwargs):
            batch = super().generate(*args, **kwargs)
            return batch.select(torch.tensor([0, 1, 2, 3, 3]))

    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG)
    engine = PolicyEngine(Long(), own_weights=False, name="long")
    with pytest.raises(EngineError, match="engine long returned 5 samples for requests of 4"):
        engine.generate([Request(0, 3, 2), Request(1, 4, 2)], cfg.rollout, seed=1)


def test_a_worker_given_up_on_hands_back_its_jobs_once_and_keeps_its_reason():
    """mark_dead returns the jobs submitted and not answered, and forgets them; closing the
    worker afterwards does not overwrite why it died."""
    from mmrl.core.engine import Job, Worker

    engine = FakeEngine(SeededToy(), hang_after=0)
    w = Worker(engine, queue.Queue())
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG)
    jobs = [Job([Request(0, 3, 1)], cfg.rollout, seed=1), Job([Request(1, 4, 1)], cfg.rollout, seed=2)]
    for job in jobs:
        w.submit(job)
    assert set(w.outstanding) == {jobs[0].id, jobs[1].id}
    assert sorted(j.id for j in w.mark_dead("hung")) == sorted(j.id for j in jobs)
    assert w.outstanding == {} and w.mark_dead("hung") == []
    engine.release.set()
    w.close()
    assert w.dead == "hung" and not w.alive


def test_closing_a_worker_waits_for_the_call_under_way():
    """close(): the call the engine is running finishes (its result reaches the inbox) before
    close returns."""
    from mmrl.core.engine import Job, Worker

    started = threading.Event()

    class Slow(FakeEngine):
        def generate(self, requests, rollout, seed):
            started.set()
            time.sleep(0.2)
            return super().generate(requests, rollout, seed)

    inbox: queue.Queue = queue.Queue()
    w = Worker(Slow(SeededToy()), inbox)
    w.submit(Job([Request(0, 3, 1)], load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG).rollout, seed=1))
    assert started.wait(10)
    w.close(wait=10)
    assert not w._thread.is_alive() and inbox.get_nowait().batch is not None


def test_a_late_answer_from_an_engine_given_up_on_is_ignored(tmp_path):
    """An engine declared hung answers after its call went to another: the answer is dropped
    (its samples are already being made again), the round completes with every group whole."""

    class LateOnce(FakeEngine):
        def generate(self, requests, rollout, seed):
            if not self.calls:
                time.sleep(2.0)  # past the 1 s timeout, while the good engine still works
            return super().generate(requests, rollout, seed)

    cfg = config(tmp_path, "rollout.scheduler.timeout=1.0")  # wide margins: a loaded machine is slow
    late, good = LateOnce(SeededToy(), name="late"), FakeEngine(SeededToy(), name="good", delay=0.15)
    sched, _, groups = round_over(cfg, [late, good])
    assert len(late.calls) == 1 and "hung" in sched.workers[0].dead
    assert sorted(int(g.group_ids[0]) for g in groups) == list(range(8)) and all(len(g) == 4 for g in groups)


class TwoPrefixes(GRPO):
    """Asks one extra sample from each of two prefixes of every group (two requests of one group
    and tag, which an engine call takes together)."""

    def extra_requests(self, group):
        s, gid = group.samples[0], int(group.group_ids[0])
        return [Request(gid, s.prompt, 1, prefix=7, tag=1), Request(gid, s.prompt, 1, prefix=8, tag=1)]


def test_extra_requests_of_one_group_from_two_prefixes_stay_apart_and_complete_it_once(tmp_path):
    """The two extras go in one call as two requests (a request has one prefix), and when both
    are back the group completes once: it reaches the trainer once, with 4 + 2 samples."""
    cfg = config(tmp_path)
    engine = FakeEngine(SeededToy())
    sched, _ = scheduler(cfg, [engine], method=TwoPrefixes(cfg.method, cfg, toy.ToyTask().reward))
    rnd, _ = sched.start_round(0, 4)
    groups = list(rnd)
    sched.close()
    assert sorted(int(g.group_ids[0]) for g in groups) == list(range(8)) and all(len(g) == 6 for g in groups)
    extras = sorted((g, n, p) for call in engine.calls for g, n, p, tag in call if tag == 1)
    assert extras == [(g, 1, p) for g in range(8) for p in (7, 8)]


def test_a_closed_worker_drops_its_queued_jobs():
    """close(): the call under way finishes, the jobs queued behind it never reach the engine
    (they are the scheduler's to re-dispatch, or the run is over)."""
    from mmrl.core.engine import Job, Worker

    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG)
    engine = FakeEngine(SeededToy(), delay=0.2)
    w = Worker(engine, queue.Queue())
    for seed in range(3):
        w.submit(Job([Request(0, 3, 1)], cfg.rollout, seed))
    w.close()
    assert len(engine.calls) <= 1


def test_a_workers_busy_seconds_add_up_its_calls():
    """busy_seconds (time/engine_busy is its change over a round) is the sum of every call's
    seconds, not the latest call's."""
    from mmrl.core.engine import Job, Worker

    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG)
    inbox: queue.Queue = queue.Queue()
    w = Worker(FakeEngine(SeededToy(), delay=0.1), inbox)
    for seed in range(3):
        w.submit(Job([Request(0, 3, 1)], cfg.rollout, seed))
    results = [inbox.get(timeout=10) for _ in range(3)]
    w.close()
    assert all(r.error is None and r.seconds >= 0.1 for r in results)
    assert w.busy_seconds == pytest.approx(sum(r.seconds for r in results)) and w.busy_seconds >= 0.3


def test_one_sample_per_group_is_a_config_error_only_for_training(tmp_path):
    """num_generations 1 is refused to train (nothing to compare a sample with), not to evaluate
    or sample (the eval verb checks with training=False)."""
    cfg = config(tmp_path, "rollout.num_generations=1", "rollout.scheduler.mode=sync")
    with pytest.raises(ConfigError, match="num_generations must be at least 2 to train"):
        check_config(cfg, 1)
    check_config(cfg, 1, training=False)


def test_engines_beside_the_trainer_are_refused_with_several_trainer_processes(tmp_path):
    """Any number of trainer processes above one (here 2) with an engine on a thread: refused;
    inline with 2 processes is fine."""
    with pytest.raises(ConfigError, match="several trainer processes"):
        check_config(config(tmp_path), 2)
    check_config(config(tmp_path, "rollout.scheduler.mode=sync"), 2)  # auto: inline


def test_an_engine_other_than_hf_runs_on_a_thread_even_in_sync_mode(tmp_path):
    """placement auto: sync mode with the policy's own generate runs inline; another engine
    (vLLM) always runs as a worker, so check_config accepts it without a placement."""
    from mmrl.core.pipeline import placement

    assert placement(config(tmp_path, "rollout.scheduler.mode=sync")) == "inline"
    cfg = config(tmp_path, "rollout.scheduler.mode=sync", "rollout.engine=vllm")
    assert placement(cfg) == "thread"
    check_config(cfg, 1)


def test_a_vllm_server_goes_to_the_backends_engine_without_the_url_prefix(tmp_path):
    """rollout.scheduler.servers: "vllm+URL" is a vLLM server, made by the backend's
    build_engine with the URL itself (the prefix only says which client to use)."""
    from types import SimpleNamespace

    from mmrl.core.pipeline import build_engines

    made = []
    backend = SimpleNamespace(build_engine=lambda kind, cfg, policy, url=None: made.append((kind, url)) or kind)
    cfg = config(tmp_path, "rollout.scheduler.placement=remote", "rollout.scheduler.servers=[vllm+http://a]")
    assert build_engines(cfg, None, backend) == ["vllm-server"]
    assert made == [("vllm-server", "http://a")]


def test_each_engine_has_one_call_under_way_and_one_queued(tmp_path):
    """The dispatcher keeps two calls per engine, the one it runs and the next, so that an engine
    never waits for the dispatcher between calls; never more (a queued call holds samples that
    another engine could take)."""
    cfg = config(tmp_path, "rollout.scheduler.engine_batch=2")  # the frontier's 8 samples: 4 calls
    engine = FakeEngine(SeededToy(), delay=1.0)
    sched, _ = scheduler(cfg, [engine])
    sched.start_round(0, 4)
    outstanding = []
    for calls in (1, 2):  # while the first call runs, then the second (after an answer)
        deadline = time.monotonic() + 10
        while len(engine.calls) < calls and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.4)  # the call still runs (1 s): the dispatcher has queued what it will
        outstanding.append(len(sched.workers[0].outstanding))
    sched.close()
    assert len(engine.calls) == 2 and outstanding == [2, 2]


def test_a_hung_call_is_given_up_on_soon_after_the_timeout(tmp_path):
    """A call is hung once it has run `timeout` seconds (1 here): not before, and not a
    multiple of it later (the bound leaves a loaded machine 1.5 s; the other test of a hung
    engine allows 5 s)."""
    cfg = config(tmp_path, "rollout.scheduler.timeout=1.0")
    engine = FakeEngine(SeededToy(), hang_after=0)
    sched, _ = scheduler(cfg, [engine])
    t0 = time.perf_counter()
    rnd, _ = sched.start_round(0, 4)
    try:
        with pytest.raises(EngineError, match="within 1 s"):
            list(rnd)
        elapsed = time.perf_counter() - t0
    finally:  # the hung engine's thread must not outlive the test (a later test counts threads)
        engine.release.set()
        sched.close()
    assert 1.0 <= elapsed < 2.5


def test_only_the_call_a_hung_engine_ran_counts_a_retry(tmp_path):
    """The hung engine runs its first call (group 0) and holds the second (group 1) queued: both
    go to the live engine, the first with one retry (max_redispatch 1 allows one), the second
    with none (it never ran)."""

    class Retries(FakeEngine):
        def generate(self, requests, rollout, seed):
            self.retries = [*getattr(self, "retries", []), *((r.group, r.retries) for r in requests)]
            return super().generate(requests, rollout, seed)

    cfg = config(tmp_path, "rollout.scheduler.timeout=0.3", "rollout.scheduler.engine_batch=2",
                 "rollout.scheduler.max_redispatch=1")
    hung, good = FakeEngine(SeededToy(), name="hung", hang_after=0), Retries(SeededToy(), name="good")
    sched, _ = scheduler(cfg, [hung, good])
    rnd, _ = sched.start_round(0, 4)
    groups = list(rnd)
    hung.release.set()
    sched.close()
    assert [sorted({g for g, *_ in call}) for call in hung.calls] == [[0]]  # it ran one call only
    assert sorted(int(g.group_ids[0]) for g in groups) == list(range(8))
    assert sorted(r for _, r in good.retries) == [0] * (len(good.retries) - 1) + [1]
    assert (0, 1) in good.retries


def test_an_engine_losing_its_connection_is_replaced_by_the_others(tmp_path):
    """An OSError (a remote engine's connection reset) is an engine fault like EngineError: the
    call goes to another engine, the round completes; the metrics count every call that answered."""
    cfg = config(tmp_path)
    lost = FakeEngine(SeededToy(), name="lost", fail_after=0, error=ConnectionResetError("connection reset"))
    good = FakeEngine(SeededToy(), name="good")
    sched, rnd, groups = round_over(cfg, [lost, good])
    assert sorted(int(g.group_ids[0]) for g in groups) == list(range(8))
    assert "connection reset" in sched.workers[0].dead
    assert rnd.metrics["rollout/engine_calls"] == len(good.calls)


class KeepSome(GRPO):
    """keep_groups keeps all but one sample of every group (a per-sample mask, not all-or-none)."""

    def keep_groups(self, batch):
        keep = torch.ones(len(batch), dtype=torch.bool)
        keep[0] = False
        return keep


def test_a_group_not_kept_whole_is_dropped(tmp_path):
    """keep_groups drops a group unless it keeps every sample: a mask with one False drops it
    (no dynamic sampling here: no refill, so the round hands nothing)."""
    cfg = config(tmp_path)
    sched, _ = scheduler(cfg, [FakeEngine(SeededToy())], method=KeepSome(cfg.method, cfg, toy.ToyTask().reward))
    rnd, _ = sched.start_round(0, 4)
    groups = list(rnd)
    sched.close()
    assert groups == [] and rnd.metrics["rollout/groups_dropped"] == 8


class ExtraForAnother(GRPO):
    def extra_requests(self, group):
        s = group.samples[0]
        return [Request(int(group.group_ids[0]) + 100, s.prompt, 1, prefix=7)]


def test_extra_requests_for_another_group_stop_the_round(tmp_path):
    """extra_requests may only ask more samples for the group it was given: a request for
    another group is a bug in the method, reported as such."""
    cfg = config(tmp_path)
    sched, _ = scheduler(cfg, [FakeEngine(SeededToy())], method=ExtraForAnother(cfg.method, cfg, toy.ToyTask().reward))
    rnd, _ = sched.start_round(0, 4)
    with pytest.raises(ValueError, match="extra_requests returned requests for another group"):
        list(rnd)
    sched.close()


def test_weights_are_published_once_per_version(tmp_path):
    """start_round publishes only when the engines lag: a second round at the same version (no
    update in between) sends no weights again."""

    class Counting(FakeEngine):
        published = 0

        def publish(self, weights, version):
            self.published += 1
            super().publish(weights, version)

    engine = Counting(SeededToy())
    sched, _ = scheduler(config(tmp_path), [engine])
    for version in (0, 0, 1):
        rnd, _ = sched.start_round(version, 4)
        list(rnd)
    sched.close()
    assert engine.published == 2 and engine.version == 1


def test_a_subprocess_engine_trains_exactly_like_a_thread_engine(tmp_path, monkeypatch):
    import os
    from pathlib import Path

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(toy.__file__).parent),
                                                      os.environ.get("PYTHONPATH", "")]))
    final = {}
    for where in ("thread", "process"):
        cfg = config(tmp_path / where, f"rollout.scheduler.placement={where}", "train.max_steps=2")
        policy, task = toy.build(cfg)
        trainer = Trainer(cfg, policy, task, backend=toy)
        trainer.train()
        final[where] = {k: v.clone() for k, v in policy.model.state_dict().items()}
        rows = read_metrics(tmp_path / where / "run" / "metrics.jsonl")
        assert [r["rollout/staleness"] for r in rows] == [0, 0]
    engine = trainer.scheduler.workers[0].engine
    assert engine.process.poll() is not None  # the run stopped its server
    for k, v in final["thread"].items():
        assert torch.equal(v, final["process"][k]), k


def test_several_servers_share_a_round(tmp_path):
    from mmrl.core.remote import RemoteEngine
    from mmrl.core.serve import ServedPolicyEngine, serve_in_thread

    cfg = config(tmp_path, "rollout.scheduler.placement=remote", "train.max_steps=2",
                 "rollout.scheduler.servers=[http://a, http://b]")
    servers = [serve_in_thread(ServedPolicyEngine(toy.ToyPolicy()), type(cfg.rollout)) for _ in range(2)]
    try:
        engines = [RemoteEngine(s.url, timeout=30) for s in servers]
        trainer = Trainer(cfg, toy.ToyPolicy(), toy.ToyTask(), engines=engines)
        trainer.train()
        busy = [w.busy_seconds for w in trainer.scheduler.workers]
        versions = [e.health()["version"] for e in engines]
    finally:
        for s in servers:
            s.close()
    assert all(b > 0 for b in busy)  # both servers rolled out
    assert versions == [1, 1]  # both got the weights after step 1
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["rollout/staleness"] for r in rows] == [0, 0]


def test_a_call_queued_behind_another_is_not_timed_from_its_submission(tmp_path):
    """Calls of 0.8 s each under a 1.2 s timeout, two per engine at a time: the second one's
    clock starts when the engine takes it (timed from its submission it would pass 1.6 s), so
    no engine is declared hung."""
    cfg = config(tmp_path, "rollout.scheduler.timeout=1.2", "rollout.scheduler.engine_batch=4",
                 "rollout.prompts_per_step=4")
    engine = FakeEngine(SeededToy(), delay=0.8)
    sched, _ = scheduler(cfg, [engine])
    rnd, _ = sched.start_round(0, 4)
    groups = list(rnd)
    sched.close()
    assert len(groups) == 4 and sched.workers[0].dead == "closed" and rnd.metrics["rollout/redispatched"] == 0


def test_an_error_mid_round_stops_the_dispatcher_and_the_engine_threads(tmp_path, monkeypatch):
    """The trainer fails on its second group: train() raises, and neither the round's dispatcher
    nor an engine thread is left running (a thread inside torch at exit can abort the process)."""
    calls = {"n": 0}
    loss = GRPO.loss

    def boom(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom in loss")
        return loss(self, *a, **kw)

    monkeypatch.setattr(GRPO, "loss", boom)
    cfg = config(tmp_path, "train.max_steps=2", "rollout.scheduler.timeout=20")
    engine = FakeEngine(SeededToy(), delay=0.2)
    trainer = Trainer(cfg, SeededToy(), toy.ToyTask(), engines=[engine])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("mmrl-")]
    made = len(engine.calls)
    time.sleep(0.5)
    assert len(engine.calls) == made  # nothing queued runs after the run stopped


def test_an_engine_that_cannot_take_new_weights_is_dropped_and_the_run_goes_on(tmp_path):
    class BadPublish(FakeEngine):
        def publish(self, weights, version):
            if version >= 2:
                raise EngineError("cannot load weights")
            super().publish(weights, version)

    cfg = config(tmp_path, "train.max_steps=4")
    policy = SeededToy()
    trainer = Trainer(cfg, policy, toy.ToyTask(),
                      engines=[BadPublish(SeededToy(), name="bad"), FakeEngine(SeededToy(), name="good")])
    with pytest.warns(UserWarning, match="engine bad failed to take new weights: cannot load weights"):
        trainer.train()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 4 and all(r["rollout/staleness"] == 0 for r in rows)


def test_max_redispatch_counts_the_retries_of_a_calls_samples_not_the_calls_moved(tmp_path):
    """Two of three engines fail their first call: each call is retried once (max_redispatch 2
    allows it), and the calls queued on them move without counting; the live engine finishes."""
    cfg = config(tmp_path, "rollout.scheduler.engine_batch=2")
    engines = [FakeEngine(SeededToy(), name="a", fail_after=0, delay=0.05),
               FakeEngine(SeededToy(), name="b", fail_after=0, delay=0.05), FakeEngine(SeededToy(), name="good")]
    sched, _ = scheduler(cfg, engines)
    rnd, _ = sched.start_round(0, 4)
    groups = list(rnd)
    sched.close()
    assert sorted(int(g.group_ids[0]) for g in groups) == list(range(8))
    assert [w.dead is None or w.dead == "closed" for w in sched.workers] == [False, False, True]
    cfg = config(tmp_path, "rollout.scheduler.engine_batch=2", "rollout.scheduler.max_redispatch=0")
    sched, _ = scheduler(cfg, [FakeEngine(SeededToy(), name="a", fail_after=0), FakeEngine(SeededToy(), name="good")])
    rnd, _ = sched.start_round(0, 4)
    with pytest.raises(EngineError, match="giving up after 0 re-dispatches"):
        list(rnd)
    sched.close()


def test_engine_busy_is_the_rounds_own_time(tmp_path):
    cfg = config(tmp_path, "train.max_steps=3")
    Trainer(cfg, SeededToy(), toy.ToyTask(), engines=[FakeEngine(SeededToy(), delay=0.05)]).train()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert all(0 < r["time/engine_busy"] <= r["time/round"] for r in rows)  # one engine: within its round


def test_reward_metrics_under_dynamic_sampling_are_the_rounds_draw_in_both_modes(tmp_path):
    """With groups dropped and refilled, reward/* describe the round's own draw (before any drop),
    in pipelined mode as in sync mode: the refills are not the policy's reward on the round."""
    rows = {}
    for mode in ("sync", "pipelined"):
        cfg = config(tmp_path / mode, f"rollout.scheduler.mode={mode}", "train.mini_batches=1", "train.max_steps=1",
                     "method.dynamic_sampling.enabled=true")
        Trainer(cfg, SeededToy(), toy.ToyTask()).train()
        rows[mode] = read_metrics(tmp_path / mode / "run" / "metrics.jsonl")
    # the first step (later ones draw refills from the stream at other times: other prompts)
    sync, pipe = rows["sync"][0], rows["pipelined"][0]
    assert sync["rollout/groups_dropped"] > 0 and pipe["rollout/groups_dropped"] > 0  # dropped and refilled
    assert sync["reward/total"] == pipe["reward/total"]


def test_engine_and_dispatcher_threads_take_the_trainers_gpu(tmp_path, monkeypatch):
    """PyTorch's current GPU is per thread and a new thread starts on GPU 0: the engine and the
    dispatcher threads set the one current where they were made (model.device cuda:1). Faked:
    no GPU here."""
    import mmrl.core.engine as engine_mod
    import mmrl.core.pipeline as pipeline_mod

    seen = []
    for mod in (engine_mod, pipeline_mod):
        monkeypatch.setattr(mod, "current_cuda", lambda: 1)
        monkeypatch.setattr(mod, "use_cuda", lambda i: seen.append((threading.current_thread().name, i)))
    sched, _ = scheduler(config(tmp_path), [FakeEngine(SeededToy(), name="e")])
    rnd, _ = sched.start_round(0, 4)
    assert len(list(rnd)) == 8
    sched.close()
    assert sorted(seen) == [("mmrl-dispatch", 1), ("mmrl-engine-e", 1)]


def test_async_atoms_with_loop_bound_state_score_pipelined_rounds(tmp_path):
    """Pipelined rounds score groups as they arrive, over several steps, on the Reward's one
    event loop: an async atom keeping a semaphore (made on its first call) scores every step."""
    (tmp_path / "judge.py").write_text(
        "import asyncio\n"
        "LIMIT = {}\n"
        "async def judge(sample):\n"
        "    async with LIMIT.setdefault('sem', asyncio.Semaphore(2)):\n"
        "        await asyncio.sleep(0)\n"
        "        return float(sample.completion[0] % 2)\n")
    cfg = config(tmp_path, "train.max_steps=3", f'reward.atoms=["{tmp_path / "judge.py"}:judge"]')
    Trainer(cfg, SeededToy(), toy.ToyTask()).train()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 3 and all(r["reward/errors"] == 0 and 0 <= r["reward/judge"] <= 1 for r in rows)


def test_a_pipelined_step_logs_each_loss_metric_as_its_mean_over_the_passes(tmp_path):
    """As in sync mode (test_trainer): a metric that is 0.5 in every micro-batch is logged as 0.5,
    the streamed epoch counting as its mini_batches passes beside the later epoch's."""
    cfg = config(tmp_path, "train.mini_batches=2", "train.ppo_epochs=2", "train.max_steps=1",
                 "train.micro_batch_size=2")
    trainer = Trainer(cfg, SeededToy(), toy.ToyTask())
    toy.log_constant(trainer.method, "x/constant", 0.5)
    trainer.train()
    (row,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert row["train/updates"] == 4
    assert row["x/constant"] == pytest.approx(0.5)


def test_a_pipelined_run_stopped_by_an_error_saves_no_checkpoint_of_the_failure(tmp_path, monkeypatch):
    """The engines run ahead of the trainer and a round's updates are under way as it streams: a
    pipelined run that fails in its second step keeps only the checkpoints it wrote, none made
    from the state it failed in."""
    calls = {"n": 0}
    loss = GRPO.loss

    def boom(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 10:  # step 2's second group (8 a step)
            raise RuntimeError("boom in loss")
        return loss(self, *a, **kw)

    monkeypatch.setattr(GRPO, "loss", boom)
    cfg = config(tmp_path, "train.max_steps=2")
    trainer = Trainer(cfg, SeededToy(), toy.ToyTask(), engines=[FakeEngine(SeededToy())])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    assert trainer.step == 1
    assert not (tmp_path / "run" / "checkpoints").exists() or not list((tmp_path / "run" / "checkpoints").iterdir())


# ---------------------------------------------------------------------------- the dispatcher's steps by hand

def small(tmp_path, *overrides):
    """2 prompts, groups of 4, one group per update (U = 1): a round of two groups."""
    return config(tmp_path, "rollout.prompts_per_step=2", "train.mini_batches=2", *overrides)


def idle_round(cfg, method=None):
    """A round on no engine: its dispatcher stops at once (every engine failed) and leaves the
    groups as admitted, so that a test drives the dispatcher's steps by hand."""
    sched, _ = scheduler(cfg, [], method=method)
    rnd, _ = sched.start_round(0, 4)
    with pytest.raises(EngineError, match="every rollout engine failed"):
        list(rnd)
    return sched, rnd


def held_worker(*jobs):
    """A worker that holds `jobs` as its outstanding calls (not queued: its thread runs none)."""
    from types import SimpleNamespace

    from mmrl.core.engine import Worker

    w = Worker(SimpleNamespace(name="held", close=lambda: None), queue.Queue())
    for job in jobs:
        w.outstanding[job.id] = job
    return w


def test_a_call_is_hung_once_it_ran_past_the_timeout_and_the_dispatcher_wakes_at_the_first_deadline(tmp_path):
    """timeout 1 s: calls that started 0.3 s and 0.6 s ago (and one queued, never timed): the
    dispatcher waits 0.4 s at most (the older call's deadline), and the engine is hung only once
    a call ran past 1 s. With nothing under way it waits the whole timeout."""
    from mmrl.core.engine import Job

    cfg = config(tmp_path, "rollout.scheduler.timeout=1.0")
    sched, rnd = idle_round(cfg)
    now = time.monotonic()
    newer, older, queued = (Job([Request(gid, rnd.groups[gid].prompt, 4)], cfg.rollout, 0, started=started)
                            for gid, started in zip(rnd.order, (now - 0.3, now - 0.6, None)))
    w = sched.workers = [held_worker(newer, older, queued)]
    assert 0.3 < rnd._time_left() <= 0.4  # 0.6 + 0.4 = 1 s
    rnd._expire_hung()
    assert w[0].alive
    older.started = now - 1.1
    rnd._expire_hung()
    assert w[0].dead == "did not answer within 1 s (hung)"
    sched.workers = [held_worker(Job([Request(rnd.order[3], 0, 4)], cfg.rollout, 0))]
    assert rnd._time_left() == 1.0
    for x in (*w, *sched.workers):
        x.close()


def test_a_dead_engines_calls_go_back_to_the_front_of_their_groups_and_only_a_call_it_ran_counts_a_retry(tmp_path):
    """The engine ran a call of group 0's samples (retried once already) and held a queued call of
    groups 1 and 2: both calls move (rollout/redispatched 2), each request to the front of its
    group's queue and out of its in-flight count; the call it ran counts one more retry (2, as
    max_redispatch 2 allows), the queued one none. A third failure of those samples passes it."""
    from mmrl.core.engine import Job

    cfg = config(tmp_path, "rollout.scheduler.max_redispatch=2")
    _, rnd = idle_round(cfg)
    g0, g1, g2 = (rnd.groups[gid] for gid in rnd.order[:3])
    ran = Job([Request(g0.gid, g0.prompt, 2, retries=1)], cfg.rollout, 0, started=time.monotonic())
    queued = Job([Request(g1.gid, g1.prompt, 4), Request(g2.gid, g2.prompt, 4)], cfg.rollout, 1)
    g0.todo, g0.in_flight = [Request(g0.gid, g0.prompt, 2)], 2  # 2 samples sent, 2 not yet
    for g in (g1, g2):
        g.todo, g.in_flight = [], 4
    w = held_worker(ran, queued)
    rnd._fail_worker(w, "failed: boom")
    assert [(r.n, r.retries) for r in g0.todo] == [(2, 2), (2, 0)]
    assert [(r.n, r.retries) for g in (g1, g2) for r in g.todo] == [(4, 0), (4, 0)]
    assert (g0.in_flight, g1.in_flight, g2.in_flight) == (0, 0, 0)
    assert rnd.metrics["rollout/redispatched"] == 2 and w.dead == "failed: boom" and not w.outstanding
    again = held_worker(Job([g0.todo.pop(0)], cfg.rollout, 2, started=time.monotonic()))
    g0.in_flight = 2
    with pytest.raises(EngineError, match="giving up after 2 re-dispatches"):
        rnd._fail_worker(again, "failed: boom")
    w.close()
    again.close()


def test_without_frontier_a_call_takes_one_sample_of_each_group_in_turn_up_to_the_engine_batch(tmp_path):
    """frontier 0, engine_batch 3, 8 groups: a call takes one sample from each of the first three
    groups, not one of every group (8 samples, past the engine batch)."""
    _, rnd = idle_round(config(tmp_path, "rollout.scheduler.frontier=0", "rollout.scheduler.engine_batch=3"))
    assert [(r.group, r.n) for r in rnd._next_requests()] == [(gid, 1) for gid in rnd.order[:3]]


def test_the_default_engine_batch_is_each_engines_share_of_a_mini_batch_or_of_the_sync_round(tmp_path):
    """engine_batch None: U x G = 2 x 4 = 8 samples pipelined, shared by the engines rounding up
    (3 engines: 3 each, 2 engines: 4 each); in sync mode the round's 8 x 4 = 32 on one engine,
    without a frontier (every group admitted at once)."""
    from types import SimpleNamespace

    def sched_of(n, *overrides):
        engines = [SimpleNamespace(name=f"e{i}", close=lambda: None) for i in range(n)]
        sched, _ = scheduler(config(tmp_path, *overrides), engines)
        sched.close()
        return sched.engine_batch, sched.frontier

    assert sched_of(3) == (3, 2) and sched_of(2) == (4, 2)
    assert sched_of(1, "rollout.scheduler.mode=sync", "rollout.scheduler.placement=thread") == (32, 0)


def test_groups_per_update_is_at_least_one(tmp_path):
    """U = prompts_per_step // mini_batches (8 // 4 = 2), and 1 where there are fewer prompts
    than mini-batches (2 // 4 = 0; sync mode allows it): a step takes at least one group."""
    from mmrl.core.pipeline import groups_per_update

    assert groups_per_update(config(tmp_path)) == 2
    assert groups_per_update(config(tmp_path, "rollout.prompts_per_step=2", "rollout.scheduler.mode=sync")) == 1


class ThreeMore(GRPO):
    """Asks 3 more samples of every group, from one prefix (one request of n 3)."""

    def extra_requests(self, group):
        gid = int(group.group_ids[0])
        return [Request(gid, group.prompts[gid], 3, prefix=7, tag=1)]


def test_extra_samples_are_counted_and_every_sample_is_scored_once(tmp_path):
    """Two groups of 4, each asking 3 more: rollout/samples_extra counts samples (6), not requests
    (2); the reward scores each group's 4 samples, then its 3 extras, once each (4 + 3, twice);
    every group carries its prompt under its id."""
    cfg = small(tmp_path)
    sched, _ = scheduler(cfg, [FakeEngine(SeededToy())], method=ThreeMore(cfg.method, cfg, toy.ToyTask().reward))
    scored, score = [], sched.reward.score
    sched.reward.score = lambda samples: scored.append(len(samples)) or score(samples)
    rnd, _ = sched.start_round(0, 4)
    groups = list(rnd)
    sched.close()
    assert sorted(scored) == [3, 3, 4, 4] and [len(g) for g in groups] == [7, 7]
    assert rnd.metrics["rollout/groups_extra"] == 2 and rnd.metrics["rollout/samples_extra"] == 6
    for g in groups:
        gid = int(g.group_ids[0])
        assert g.prompts == {gid: g.samples[0].prompt}


class PruneAll(GRPO):
    def prune(self, group):
        return torch.zeros(len(group))  # weights: 0 drops a sample


def test_a_group_pruned_to_no_sample_is_not_handed_to_the_trainer(tmp_path):
    cfg = small(tmp_path)
    _, rnd, groups = round_over(cfg, [FakeEngine(SeededToy())], method=PruneAll(cfg.method, cfg, toy.ToyTask().reward))
    assert groups == [] and rnd.metrics["rollout/samples_pruned"] == 8


class WithLengths(FakeEngine):
    """Each sample decoded 3 tokens (the stat/length an engine reports)."""

    def generate(self, requests, rollout, seed):
        batch = super().generate(requests, rollout, seed)
        batch.data["stat/length"] = torch.full((len(batch),), 3.0)
        return batch


def test_a_rounds_engine_calls_and_decoded_tokens_add_up_every_call(tmp_path):
    """8 groups of 4 samples of 3 tokens each, two groups a call (U = 2): 4 engine calls (not 8
    requests), 8 x 4 x 3 = 96 decoded tokens, rollout/length 3."""
    engine = WithLengths(SeededToy())
    _, rnd, _ = round_over(config(tmp_path), [engine])
    assert len(engine.calls) == 4 and all(len(call) == 2 for call in engine.calls)
    assert rnd.metrics["rollout/engine_calls"] == 4
    assert rnd.metrics["rollout/decoded_tokens"] == 96.0 and rnd.metrics["rollout/length"] == 3.0


def test_a_rounds_engine_time_and_trainer_wait_are_its_own(tmp_path):
    """Two rounds on one engine whose calls take 0.1 s (one call a group): the second round's
    engine_busy leaves out the first round's calls, and its wait_seconds add up every wait of
    the trainer (at least the two calls' 0.2 s, less the start), not only the last one."""
    sched, _ = scheduler(small(tmp_path), [FakeEngine(SeededToy(), delay=0.1)])
    list(sched.start_round(0, 4)[0])
    before = sched.workers[0].busy_seconds
    rnd, _ = sched.start_round(0, 4)
    assert len(list(rnd)) == 2
    sched.close()
    assert rnd.engine_busy() == pytest.approx(sched.workers[0].busy_seconds - before) and rnd.engine_busy() >= 0.2
    assert rnd.wait_seconds >= 0.15


class Seeds(FakeEngine):
    def generate(self, requests, rollout, seed):
        self.seeds = [*getattr(self, "seeds", []), seed]
        return super().generate(requests, rollout, seed)


def test_each_call_is_seeded_from_the_schedulers_generator(tmp_path):
    """The seeds of a round's calls come from the generator the scheduler was given: distinct
    calls, distinct seeds; another generator seed, other seeds."""

    def seeds(generator_seed):
        policy, task = SeededToy(), toy.ToyTask()
        cfg = small(tmp_path)
        engine = Seeds(policy)
        sched = PipelinedScheduler(cfg, [engine], PromptStream(task.train_prompts(), 0), task.reward,
                                   build_method(cfg, task.reward), torch.Generator().manual_seed(generator_seed),
                                   policy.model)
        list(sched.start_round(0, 4)[0])
        sched.close()
        return engine.seeds

    zero = seeds(0)
    assert len(zero) == 2 and len(set(zero)) == 2 and seeds(1) != zero


def test_build_engines_makes_what_the_config_names(tmp_path):
    """remote: one RemoteEngine per "http://" server, timed by rollout.scheduler.timeout, and a
    "vllm+" server is refused by a backend with no vLLM engine; an engine other than hf comes
    from the backend's build_engine; a thread engine samples with its own copy of the weights."""
    from types import SimpleNamespace

    from mmrl.core.pipeline import build_engines
    from mmrl.core.remote import RemoteEngine

    remote = ("rollout.scheduler.placement=remote", "rollout.scheduler.timeout=7")
    (engine,) = build_engines(config(tmp_path, *remote, "rollout.scheduler.servers=[http://a:1]"), None)
    assert type(engine) is RemoteEngine and engine.url == "http://a:1" and engine.timeout == 7
    with pytest.raises(ConfigError, match=r"servers\[1\]: this backend has no vLLM engine"):
        build_engines(config(tmp_path, *remote, "rollout.scheduler.servers=[http://a:1, vllm+http://b:2]"), None)
    backend = SimpleNamespace(build_engine=lambda kind, cfg, policy, url=None: (kind, url))
    assert build_engines(config(tmp_path, "rollout.engine=sglang"), None, backend) == [("sglang", None)]
    policy = SeededToy()
    (engine,) = build_engines(config(tmp_path), policy)
    assert type(engine) is PolicyEngine and engine.own_weights and engine.policy is not policy


class CountingPublish(FakeEngine):
    published = 0

    def publish(self, weights, version):
        self.published += 1
        super().publish(weights, version)


def test_weights_are_published_to_the_live_engines_only(tmp_path):
    """An engine given up on gets no new weights (its worker would wait for an answer up to the
    timeout); the round runs on the live one."""
    engines = [CountingPublish(SeededToy(), name="dead"), CountingPublish(SeededToy(), name="live")]
    sched, _ = scheduler(small(tmp_path), engines)
    sched.workers[0].mark_dead("did not answer within 1 s (hung)")
    rnd, _ = sched.start_round(1, 4)
    assert len(list(rnd)) == 2
    sched.close()
    assert [e.published for e in engines] == [0, 1] and not engines[0].calls


class ExtraForFirst(GRPO):
    """One more sample of the round's first group (id 0) only: that group completes last."""

    def extra_requests(self, group):
        gid = int(group.group_ids[0])
        return [Request(gid, group.prompts[gid], 1, prefix=7, tag=1)] if gid == 0 else []


def test_sync_mode_on_an_engine_beside_the_trainer_hands_the_round_in_group_order_with_its_reference(tmp_path):
    """next_groups: groups of the size asked (2, not the config's 4), in group order though group
    0 completed last (its extra sample), annotated by the reference; 4 groups, 4 x 2 + 1 samples."""
    cfg = config(tmp_path, "rollout.prompts_per_step=4", "rollout.scheduler.mode=sync",
                 "rollout.scheduler.placement=thread")
    policy, task = SeededToy(), toy.ToyTask()
    sched = PipelinedScheduler(cfg, [FakeEngine(SeededToy())], PromptStream(task.train_prompts(), 0), task.reward,
                               ExtraForFirst(cfg.method, cfg, task.reward), torch.Generator().manual_seed(0),
                               policy.model, reference=policy.reference())
    batch, metrics = sched.next_groups(0, 2)
    sched.close()
    assert batch.group_ids.tolist() == [0, 0, 0, 1, 1, 2, 2, 3, 3]
    assert batch.data["request_tag"].tolist() == [0, 0, 1, 0, 0, 0, 0, 0, 0]
    assert metrics["rollout/groups"] == 4 and metrics["rollout/samples"] == 9
    assert batch.ref_logp is not None and batch.ref_logp.shape == batch.old_logp.shape


def test_reward_metrics_are_every_group_of_the_rounds_draw_and_no_refill(tmp_path):
    """An atom worth each sample's prompt; every group dropped, max_rounds 1: the stream draws
    prompts 4 and 1 (the round), then 7 and 5 (the refills). reward/prompt is the mean over the
    round's draw, (4 + 1) / 2 = 2.5: both groups (the first alone gives 4), no refill (4.25)."""
    from mmrl.core.rewards import Reward, reward_atom

    @reward_atom("prompt")
    def prompt(sample):
        return float(sample.prompt)

    cfg = small(tmp_path, "method.dynamic_sampling.enabled=true", "method.dynamic_sampling.max_rounds=1")
    reward, policy = Reward([prompt]), SeededToy()
    sched = PipelinedScheduler(cfg, [FakeEngine(SeededToy())], PromptStream(toy.ToyTask().train_prompts(), 0),
                               reward, KeepSome(cfg.method, cfg, reward), torch.Generator().manual_seed(0),
                               policy.model)
    rnd, _ = sched.start_round(0, 4)
    assert list(rnd) == []
    sched.close()
    assert rnd.metrics["rollout/groups_refilled"] == 2 and rnd.metrics["reward/prompt"] == 2.5


def test_closing_the_scheduler_waits_for_the_rounds_dispatcher(tmp_path):
    """close() returns once the round's dispatcher thread has ended: here after the reward call
    it was in when told to stop (4 samples at 0.05 s), not at once with the thread still scoring."""
    from mmrl.core.rewards import Reward, reward_atom

    scoring = threading.Event()

    @reward_atom("slow")
    def slow(sample):
        scoring.set()
        time.sleep(0.05)
        return 0.0

    cfg, policy, reward = small(tmp_path), SeededToy(), Reward([slow])
    sched = PipelinedScheduler(cfg, [FakeEngine(SeededToy())], PromptStream(toy.ToyTask().train_prompts(), 0),
                               reward, build_method(cfg, reward), torch.Generator().manual_seed(0), policy.model)
    rnd, _ = sched.start_round(0, 4)
    assert scoring.wait(10)
    sched.close()
    assert not rnd._thread.is_alive()


def test_the_dispatcher_gives_up_on_a_hung_call_at_its_deadline_not_a_whole_timeout_later(tmp_path):
    """timeout 1 s, the one call under way started 0.9 s ago, every other group complete: the
    dispatcher waits the 0.1 s left (not a whole timeout), then the engine is hung and, the only
    one, ends the round."""
    from mmrl.core.engine import Job

    cfg = config(tmp_path, "rollout.scheduler.timeout=1.0")
    sched, rnd = idle_round(cfg)
    for gid in rnd.order[1:]:
        rnd.groups[gid].todo, rnd.groups[gid].done = [], True
    g = rnd.groups[rnd.order[0]]
    g.todo, g.in_flight = [], 4
    sched.workers = [held_worker(Job([Request(g.gid, g.prompt, 4)], cfg.rollout, 0, started=time.monotonic() - 0.9))]
    t0 = time.perf_counter()
    with pytest.raises(EngineError, match=r"every rollout engine failed: held: did not answer within 1 s \(hung\)"):
        rnd._dispatch_loop()
    assert time.perf_counter() - t0 < 0.5
    sched.workers[0].close()


def test_a_stopped_round_sends_no_more_calls(tmp_path):
    """The trainer gives up on a round after its first group (of 8, 4 calls of 0.1 s): stop()
    ends the dispatcher there, with the engine still alive; the round is not rolled out to its
    end (every call made, time/rollout logged)."""
    engine = FakeEngine(SeededToy(), delay=0.1)
    sched, _ = scheduler(config(tmp_path), [engine])
    rnd, _ = sched.start_round(0, 4)
    next(iter(rnd))
    rnd.stop(wait=10)
    made, alive = len(engine.calls), rnd._thread.is_alive()
    sched.close()
    assert not alive and made < 4 and "time/rollout" not in rnd.metrics


def test_more_mini_batches_than_a_steps_samples_is_a_config_error(tmp_path):
    """The empty mini-batches were skipped: fewer optimizer steps than the lr schedule counts."""
    sync = ("rollout.scheduler.mode=sync", "rollout.scheduler.placement=inline")  # 8 prompts x 4 = 32 samples
    check_config(config(tmp_path, *sync, "train.mini_batches=32"), 1)
    with pytest.raises(ConfigError, match=r"train.mini_batches \(33\) is more than the samples each process trains "
                                          r"on in a step \(rollout.prompts_per_step x num_generations = 32\).*at most 32"):
        check_config(config(tmp_path, *sync, "train.mini_batches=33"), 1)
    with pytest.raises(ConfigError, match=r"num_generations / 2 processes = 16\).*at most 16"):
        check_config(config(tmp_path, *sync, "train.mini_batches=17"), 2)
    check_config(config(tmp_path, *sync, "train.mini_batches=33"), 1, training=False)  # eval, sample: no update
