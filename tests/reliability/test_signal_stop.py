"""A scheduler's SIGTERM / SIGUSR1 during training (mmrl/core/stop.py): the step it came in is
finished and saved, the run stops with 128 + the signal's number, and --resume ends exactly as
the run that was never stopped. In process on the toy backend (the signal raised from inside a
chosen step); tests/reliability/test_kill_resume.py sends a real SIGTERM to a CLI run."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import toy
from runcompare import comparable
from typer.testing import CliRunner

from mmrl.core import stop as stop_module
from mmrl.core.checkpoint import list_checkpoints
from mmrl.core.cli import BackendSpec, make_app
from mmrl.core.config import TrainConfig, load_config
from mmrl.core.logging import read_metrics
from mmrl.core.stop import SignalStop, StoppedBySignal
from mmrl.core.trainer import Trainer
from reliability.toy_cli import signalled_in_step_two

ARGS = ("train.max_steps=5", "train.save_every=0", "optim.schedule=cosine", "optim.warmup_steps=2",
        "train.mini_batches=2")


def make(tmp_path, name, *overrides):
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG,
                      overrides=[f"output_dir={tmp_path / name}", *ARGS, *overrides])
    policy, task = toy.build(cfg)
    return Trainer(cfg, policy, task)


def signal_on_call(obj, name: str, at: int, *signums: int) -> None:
    """obj.<name> raises each of `signums` at this process on its `at`-th call, then works as before."""
    fn, calls = getattr(obj, name), {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == at:
            for s in signums:
                signal.raise_signal(s)
        return fn(*args, **kwargs)

    setattr(obj, name, wrapped)


def weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.policy.model.state_dict().items()}


def test_sigterm_mid_step_saves_that_step_and_resume_is_exact(tmp_path):
    full = make(tmp_path, "full")
    full.train()

    stopped = make(tmp_path, "run")
    signal_on_call(stopped.policy, "generate", 3, signal.SIGTERM)  # in step 3's rollout (evaluation is greedy)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(StoppedBySignal) as info:
        stopped.train()
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the process's again
    e = info.value
    assert (e.signum, e.step, e.exit_code) == (signal.SIGTERM, 3, 143)
    assert "stopped by SIGTERM after step 3 of 5" in str(e)
    assert f"`train -o {tmp_path / 'run'} --resume` goes on from there" in str(e)  # the run's own directory
    assert [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [3]  # save_every 0: only for the stop
    assert e.checkpoint == tmp_path / "run" / "checkpoints" / "step-00000003"
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == 3
    assert not (tmp_path / "run" / "summary.json").exists()  # not finished: no final evaluation
    ended = json.loads((tmp_path / "run" / "environment.json").read_text())[-1]["ended"]
    assert (ended["how"], ended["step"]) == ("stopped by SIGTERM", 3)  # what `runs` shows for it

    resumed = make(tmp_path, "run")
    resumed.train(resume=True)
    for k, v in weights(full).items():
        assert torch.equal(v, weights(resumed)[k]), k
    assert comparable(read_metrics(tmp_path / "full" / "metrics.jsonl")) == comparable(
        read_metrics(tmp_path / "run" / "metrics.jsonl"))
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("full", "run"))
    assert a["eval_before"] == b["eval_before"] and a["eval_after"] == b["eval_after"]


def test_a_later_second_signal_goes_to_the_handler_before_the_run(tmp_path, monkeypatch):
    seen, clock = [], iter([100.0, 100.0 + stop_module.REPEAT_WINDOW_S])  # the second at the window's end
    monkeypatch.setattr(stop_module, "monotonic", lambda: next(clock))
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        trainer = make(tmp_path, "run")
        signal_on_call(trainer.policy, "generate", 2, signal.SIGUSR1, signal.SIGUSR1)
        with pytest.raises(StoppedBySignal) as info:
            trainer.train()
        assert seen == [signal.SIGUSR1]  # the first was the run's, the second the earlier handler's
        assert (info.value.step, info.value.exit_code) == (2, 138)
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_repeat_within_the_window_is_the_same_request(tmp_path, monkeypatch):
    """A launcher passes on the signal the scheduler also sent the worker: the repeat (any stop
    signal, this soon) must not end the step the first one asked to finish."""
    seen, clock = [], iter([100.0, 100.0 + stop_module.REPEAT_WINDOW_S - 0.01, 100.5])
    monkeypatch.setattr(stop_module, "monotonic", lambda: next(clock))
    previous = {s: signal.signal(s, lambda s, f: seen.append(s)) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        trainer = make(tmp_path, "run")
        signal_on_call(trainer.policy, "generate", 2, signal.SIGTERM, signal.SIGTERM, signal.SIGUSR1)
        with pytest.raises(StoppedBySignal) as info:
            trainer.train()
        assert seen == []  # no repeat reached the handlers before the run
        assert (info.value.step, info.value.exit_code) == (2, 143)
        assert [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [2]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_a_signal_before_the_first_step_stops_with_nothing_saved(tmp_path):
    trainer = make(tmp_path, "run")
    signal_on_call(trainer, "evaluate", 1, signal.SIGTERM)  # the evaluation before training
    with pytest.raises(StoppedBySignal, match="before the first step; nothing was trained or saved") as info:
        trainer.train()
    assert info.value.checkpoint is None and info.value.step == 0
    assert list_checkpoints(tmp_path / "run" / "checkpoints") == []
    assert read_metrics(tmp_path / "run" / "metrics.jsonl") == []


def test_the_cli_exits_128_plus_the_signal_and_auto_resume_goes_on_as_a_requeued_job(tmp_path, monkeypatch):
    """The same command twice, as a scheduler requeues a job: --auto-resume starts afresh, the
    SIGTERM in step 2 saves it (exit 143), and the second start resumes and ends as a run that
    was never stopped."""
    app = make_app(BackendSpec(modality="toy", title="toy", command="toy-rl", module="toy"))
    runner = CliRunner()
    full = tmp_path / "full"
    assert runner.invoke(app, ["train", "--max-steps", "4", "--output-dir", str(full)]).exit_code == 0
    generate, calls = toy.ToyPolicy.generate, {"n": 0}

    def signalled(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            signal.raise_signal(signal.SIGTERM)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(toy.ToyPolicy, "generate", signalled)
    out = tmp_path / "run"
    job = ["train", "--max-steps", "4", "--output-dir", str(out), "--auto-resume"]
    result = runner.invoke(app, job)
    assert result.exit_code == 143, result.output
    assert "--auto-resume: no complete checkpoint" in result.output and "starting afresh" in result.output
    assert "stopped by SIGTERM after step 2 of 4" in result.output and "Traceback" not in result.output
    monkeypatch.setattr(toy.ToyPolicy, "generate", generate)
    result = runner.invoke(app, job)
    assert result.exit_code == 0, result.output
    assert "resuming at step 2" in result.output
    assert json.loads((out / "summary.json").read_text())["eval_after"] == json.loads(
        (full / "summary.json").read_text())["eval_after"]
    assert comparable(read_metrics(out / "metrics.jsonl")) == comparable(read_metrics(full / "metrics.jsonl"))
    result = runner.invoke(app, [*job, "--resume"])
    assert result.exit_code == 2 and "--resume and --auto-resume: give one" in result.output


def _signal_rank_1(rank, port, tmp):
    from two_ranks import process_group

    with process_group(rank, port, timeout=60):
        cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG,
                          overrides=[f"output_dir={tmp}", "train.max_steps=4", "logging.tensorboard=false"])
        trainer = Trainer(cfg, *toy.build(cfg))
        if rank == 1:  # only rank 1 is signalled, in step 2's rollout
            signal_on_call(trainer.policy, "generate", 2, signal.SIGTERM)
        try:
            trainer.train()
            stopped = None
        except StoppedBySignal as e:
            stopped = {"step": e.step, "signum": e.signum}
        (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(stopped))


@pytest.mark.two_ranks(body=_signal_rank_1)
def test_two_processes_stop_after_the_same_step_when_one_is_signalled(ranks_ran):
    """A rank stopping alone would leave the other in the next step's collectives (and the
    checkpoint is one too): every rank asks whether any was signalled before each step."""
    for rank in (0, 1):
        assert json.loads((ranks_ran / f"rank{rank}.json").read_text()) == {"step": 2, "signum": signal.SIGTERM}
    assert [s for s, _ in list_checkpoints(ranks_ran / "checkpoints")] == [2]


def test_under_torchrun_the_signal_passed_on_does_not_end_the_step(tmp_path):
    """SLURM signals every process of the job step: each worker gets SIGUSR1 from it, and a
    moment later again from torchrun, which passes on the signals it handles. Both workers still
    finish the step, save it and exit 138 (before, the repeat ended them with nothing saved)."""
    out = tmp_path / "run"
    script = Path(__file__).with_name("toy_cli.py")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1", "--shutdown-timeout", "120"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOY_ROLLOUT_SECONDS": "3"}

    def send(agent, workers):
        assert len(workers) == 2
        for pid in workers:  # the scheduler's signal to each process of the step ...
            os.kill(pid, signal.SIGUSR1)
        time.sleep(0.5)  # ... the workers' handlers have run, mid-step; then the agent's, which passes it on
        agent.send_signal(signal.SIGUSR1)

    _, stderr = signalled_in_step_two([*launcher, str(script), "train", "--max-steps", "100000", "--save-every",
                                       "0", "--output-dir", str(out)], env, out, send)
    ended = json.loads((out / "environment.json").read_text())[-1].get("ended")  # None: killed outright
    assert ended is not None and ended["how"] == "stopped by SIGUSR1", stderr[-3000:]
    assert ended["step"] == 2 and [s for s, _ in list_checkpoints(out / "checkpoints")] == [2]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]
    assert "stopped by SIGUSR1 after step 2 of 100000" in stderr
    assert not (out / "summary.json").exists()


def test_the_first_signal_is_announced_on_stderr_and_only_recorded(capfd):
    with SignalStop() as stop:
        signal.raise_signal(signal.SIGUSR1)  # the handler runs before raise_signal returns
        assert stop.received == signal.SIGUSR1 and stop.requested() == signal.SIGUSR1
    err = capfd.readouterr().err
    assert ("SIGUSR1: the run stops after the step it is in and saves it (send it again, 10 s or more from now, "
            "to stop at once)") in err


def test_requested_is_the_signal_of_the_lowest_rank_that_got_one(monkeypatch):
    sent = []

    def gather(x):  # ranks 0..3: rank 0 (this one) got nothing, rank 2 SIGUSR1, rank 3 SIGTERM
        sent.append(x)
        return [float(x), 0.0, float(signal.SIGUSR1), float(signal.SIGTERM)]

    monkeypatch.setattr(stop_module.distributed, "world_size", lambda: 4)
    monkeypatch.setattr(stop_module.distributed, "gather_scalar", gather)
    stop = SignalStop()
    assert stop.requested() == signal.SIGUSR1 and sent == [0]  # an unsignalled rank sends 0
    monkeypatch.setattr(stop_module.distributed, "gather_scalar", lambda x: [float(x)] * 4)
    assert stop.requested() is None  # no rank signalled: go on
