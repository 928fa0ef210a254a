"""Non-finite training: a NaN loss or a NaN/inf gradient skips the step with a warning
naming it, leaves the weights as they were, logs `train/bad_step`, and never produces a
checkpoint; `train.max_bad_steps` bad steps in a row stop the run (TrainingError, or one
paragraph from the CLI); a good step resets the count. Toy backend (tests/toy.py), plus
the diffusion policy's non-finite rollout guard (diffusion_rl.policy.NonFiniteRollout)
on the bundled tiny flow model.

Already covered elsewhere (not repeated): tests/test_trainer.py
test_non_finite_steps_are_skipped_then_stop_the_run (NaN log-probs from step 3 on stop
the run after 2; checkpoints [1, 2]); tests/diffusion/test_flow_grpo.py
test_non_finite_latents_stop_the_step_before_any_checkpoint (NaN velocity in step 1).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import toy
from typer.testing import CliRunner

from mmrl.core import checkpoint as ckpt
from mmrl.core.cli import BackendSpec, make_app
from mmrl.core.config import TrainConfig, load_config
from mmrl.core.logging import read_metrics
from mmrl.core.trainer import Trainer, TrainingError

app = make_app(BackendSpec(modality="toy", title="toy", command="toy-rl", module="toy"))


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def make(out: Path, *overrides: str) -> Trainer:
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[
        f"output_dir={out}", "train.save_every=1", "train.keep_last=10", *overrides])
    return Trainer(cfg, *toy.build(cfg))


def poison(trainer: Trainer, bad_steps: set[int], kind: str) -> None:
    """Make the training forward of steps `bad_steps` (1-based) non-finite: `loss` multiplies
    the log-probs by NaN; `grad` keeps them finite and makes their gradient inf."""
    logprobs = trainer.policy.logprobs

    def poisoned(batch):
        out = logprobs(batch)
        if not torch.is_grad_enabled() or trainer.step + 1 not in bad_steps:
            return out
        if kind == "loss":
            return out * float("nan")
        out.register_hook(lambda g: torch.full_like(g, float("inf")))
        return out

    trainer.policy.logprobs = poisoned


def record_weights(trainer: Trainer) -> list[dict[str, torch.Tensor]]:
    """Weights after every step: [after step 1, after step 2, ...]."""
    seen: list[dict[str, torch.Tensor]] = []
    step = trainer.train_step

    def train_step(*a, **kw):
        try:
            return step(*a, **kw)
        finally:
            seen.append({k: v.detach().clone() for k, v in trainer.policy.model.state_dict().items()})

    trainer.train_step = train_step
    return seen


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["loss", "grad"])
def test_bad_steps_are_skipped_and_a_good_step_resets_the_count(kind, tmp_path):
    """Steps 2 and 4 are bad, max_bad_steps 2: never two in a row, so the run finishes."""
    trainer = make(tmp_path / "run", "train.max_steps=5", "train.max_bad_steps=2")
    poison(trainer, {2, 4}, kind)
    after = record_weights(trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    messages = [str(w.message) for w in caught if "non-finite" in str(w.message)]
    assert len(messages) == 2
    assert messages[0].startswith("step 2:") and messages[1].startswith("step 4:")

    assert same(after[1], after[0]) and same(after[3], after[2])  # a bad step moves nothing
    assert not same(after[2], after[1]) and not same(after[4], after[3])  # good steps do
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r.get("train/bad_step", 0.0) for r in rows] == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert [r["train/updates"] for r in rows] == [1, 0, 1, 0, 1]
    assert trainer.bad_steps == 0  # reset by step 5
    # no checkpoint from a bad step; each good one is a checkpoint holding that step's weights
    listed = ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")
    assert [s for s, _ in listed] == [1, 3, 5]
    for step, d in listed:
        loaded = toy.ToyPolicy(seed=99)
        loaded.load_weights(d / "model")
        assert same(loaded.model.state_dict(), after[step - 1]), step


@pytest.mark.parametrize("kind", ["loss", "grad"])
def test_max_bad_steps_in_a_row_stop_the_run_at_the_last_good_checkpoint(kind, tmp_path):
    trainer = make(tmp_path / "run", "train.max_steps=8", "train.max_bad_steps=3")
    poison(trainer, {3, 4, 5, 6, 7, 8}, kind)
    after = record_weights(trainer)
    with pytest.warns(UserWarning, match=r"step [345]: 1 update\(s\) had a non-finite"), \
            pytest.raises(TrainingError, match=r"3 steps in a row .*train\.max_bad_steps=3") as info:
        trainer.train()
    assert str(tmp_path / "run" / "checkpoints") in str(info.value)  # where the last good one is
    assert len(after) == 5  # it stopped in step 5, the third bad one
    assert same(after[4], after[1])  # the weights are still those of step 2
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")] == [1, 2]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # step 5 raised before it was logged
    assert [r.get("train/bad_step", 0.0) for r in rows] == [0.0, 0.0, 1.0, 1.0]
    # --resume goes back to step 2, and (the fault gone) finishes the run
    resumed = make(tmp_path / "run", "train.max_steps=8", "train.max_bad_steps=3")
    resumed.train(resume=True)
    assert [r.get("train/bad_step", 0.0) for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [0.0] * 8


def test_a_skipped_last_step_saves_the_last_good_weights(tmp_path):
    """The run ends with a checkpoint of max_steps even if that step was skipped: the weights
    in it are the last good step's (the skipped step changed nothing), never a bad state."""
    trainer = make(tmp_path / "run", "train.max_steps=3", "train.max_bad_steps=2")
    poison(trainer, {3}, "grad")
    after = record_weights(trainer)
    with pytest.warns(UserWarning, match="step 3"):
        trainer.train()
    assert same(after[2], after[1])
    listed = ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")
    assert [s for s, _ in listed] == [1, 2, 3]
    loaded = toy.ToyPolicy(seed=99)
    loaded.load_weights(listed[-1][1] / "model")
    assert same(loaded.model.state_dict(), after[1])
    _, state = ckpt.load_checkpoint(listed[-1][1])
    assert state["bad_steps"] == 1  # a resume still counts it:
    resumed = make(tmp_path / "run", "train.max_steps=4")
    resumed.load(listed[-1][1])
    assert resumed.bad_steps == 1


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_non_finite_weights_are_never_saved(tmp_path):
    """A finite loss and gradient can still leave inf weights (an overflowing update): the
    checkpoint of that step is refused, the previous one stays the newest."""
    trainer = make(tmp_path / "run", "train.max_steps=4")
    step = trainer.optimizer.step

    def overflowing(*a, **kw):
        out = step(*a, **kw)
        if trainer.step + 1 == 3:
            with torch.no_grad():
                trainer.params[0].fill_(float("inf"))
        return out

    trainer.optimizer.step = overflowing
    with pytest.raises(TrainingError, match="step 3: the weights are not finite; no checkpoint was written"):
        trainer.train()
    root = tmp_path / "run" / "checkpoints"
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [1, 2]
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []
    loaded = toy.ToyPolicy(seed=99)
    loaded.load_weights(root / "step-00000002" / "model")
    assert all(torch.isfinite(v).all() for v in loaded.model.state_dict().values())


def test_cli_stops_with_one_paragraph_naming_max_bad_steps(tmp_path, monkeypatch):
    logprobs = toy.ToyPolicy.logprobs
    calls = {"n": 0}

    def poisoned(self, batch):
        out = logprobs(self, batch)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] > 1:  # the first training forward is good, every later one NaN
                return out * float("nan")
        return out

    monkeypatch.setattr(toy.ToyPolicy, "logprobs", poisoned)
    out = tmp_path / "run"
    with pytest.warns(UserWarning, match="step 2: 1 update"):
        result = CliRunner().invoke(app, ["train", "--output-dir", str(out), "--max-steps", "6", "--save-every", "1",
                                          "--set", "train.max_bad_steps=2"])
    text = " ".join(result.output.split())
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    assert "error:" in text and "train.max_bad_steps=2" in text and "2 steps in a row" in text
    assert [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")] == [1]


def test_non_finite_diffusion_rollout_in_a_later_step_never_reaches_a_checkpoint(tmp_path):
    """NaN latents in step 2's rollout (step 1 trained and saved): the step stops with a
    message naming the sampling step, and the newest checkpoint is still step 1's."""
    from diffusion_rl import backend
    from diffusion_rl.policy import NonFiniteRollout

    cfg = load_config(backend.CONFIG_CLASS, None, [
        f"output_dir={tmp_path / 'run'}", "train.max_steps=3", "train.save_every=1",
        "logging.tensorboard=false", "logging.progress=false",
        "rollout.prompts_per_step=1", "rollout.num_generations=2", "rollout.num_steps=4", "rollout.window_size=2",
        "task.num_train=8", "task.num_eval=2", "task.grid_prompts=2"], defaults=backend.DEFAULT_CONFIG)
    policy, task = backend.build(cfg)
    trainer = Trainer(cfg, policy, task, backend=backend)
    velocity, generate = policy.flow.velocity, policy.generate
    rollouts = {"n": 0}

    def counted(*a, **kw):
        rollouts["n"] += 1
        return generate(*a, **kw)

    def broken(*a, **kw):
        v = velocity(*a, **kw)
        return v * float("nan") if rollouts["n"] >= 2 else v

    policy.generate, policy.flow.velocity = counted, broken
    with pytest.raises(NonFiniteRollout, match=r"sampling step 0 .*non-finite latents or log-probs, the model's velocity was "
                                               r"not finite"):
        trainer.train()
    assert rollouts["n"] == 2
    root = tmp_path / "run" / "checkpoints"
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [1]
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1]
    _, state = ckpt.load_checkpoint(root / "step-00000001")
    assert state["step"] == 1
    assert all(torch.isfinite(p).all() for p in policy.model.parameters())
