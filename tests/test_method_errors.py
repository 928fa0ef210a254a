"""A method of one's own that returns the wrong thing from a hook: the run stops with a
MethodError naming the hook and what it must return, not a traceback from deep in the loop
(a float has no .backward) nor, for NaN advantages, every update skipped with a warning."""

from __future__ import annotations

import pytest
import torch
import toy

from mmrl.core.config import ConfigError, TrainConfig, load_config
from mmrl.core.losses import LossOutput
from mmrl.core.trainer import MethodError, Trainer, TrainingError

ADVANTAGES = {
    "a list": (lambda adv: adv.tolist(), "returned a list; it must return a tensor"),
    "a row short": (lambda adv: adv[:-1], r"returned shape \((\d+),\); it must have one row per sample \(N = \d+\)"),
    "NaN": (lambda adv: adv * float("nan"), r"returned non-finite values \(NaN or inf\) in (\d+) of \1 rows \(\[0, 1, 2"),
}
LOSSES = {
    "a float": (lambda out: LossOutput(float(out.loss.detach()), out.metrics), "whose .loss is a float"),
    "a bare tensor": (lambda out: out.loss, "returned a Tensor"),
    "detached": (lambda out: LossOutput(out.loss.detach(), out.metrics), "a .loss without a gradient"),
    "a vector": (lambda out: LossOutput(out.loss.expand(3), out.metrics), r"shape \(3,\).*\.mean\(\)"),
}


def trainer(tmp_path, *overrides):
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[
        f"output_dir={tmp_path}", "rollout.prompts_per_step=4", *overrides])
    return Trainer(cfg, *toy.build(cfg))


def wrap(obj, name, change):
    fn = getattr(obj, name)
    setattr(obj, name, lambda *a, **k: change(fn(*a, **k)))


@pytest.mark.parametrize("mode", ["sync", "pipelined"])
@pytest.mark.parametrize("what", list(ADVANTAGES))
def test_bad_advantages_name_the_method(tmp_path, what, mode):
    t = trainer(tmp_path, f"rollout.scheduler.mode={mode}")
    change, message = ADVANTAGES[what]
    wrap(t.method, "advantages", change)
    try:
        with pytest.raises(MethodError, match=f"{type(t.method).__qualname__}.advantages {message}"):
            t.train_step()
    finally:  # train() closes a pipelined scheduler's engine threads; a bare train_step() does not
        if hasattr(t.scheduler, "close"):
            t.scheduler.close()
    assert issubclass(MethodError, TrainingError)  # the CLI's error paragraph, not a traceback


@pytest.mark.parametrize("what", list(LOSSES))
def test_a_bad_loss_names_the_method_before_backward(tmp_path, what):
    t = trainer(tmp_path)
    change, message = LOSSES[what]
    wrap(t.method, "loss", change)
    before = [p.detach().clone() for p in t.params]
    with pytest.raises(MethodError, match=f"{type(t.method).__qualname__}.loss .*{message}"):
        t.train_step()
    assert all(torch.equal(a, p) for a, p in zip(before, t.params))  # nothing was stepped


def test_a_good_method_still_trains(tmp_path):
    t = trainer(tmp_path)
    before = [p.detach().clone() for p in t.params]
    metrics = t.train_step()
    assert metrics["train/updates"] >= 1 and not metrics.get("train/bad_step")
    assert any(not torch.equal(a, p) for a, p in zip(before, t.params))


# ------------------------------------------------------------ a config changed after it was built


def test_a_config_changed_by_model_copy_is_validated_again_by_the_trainer(tmp_path):
    """pydantic's model_copy(update=...) does not validate: a dict for a section failed with an
    AttributeError inside the trainer, and max_steps=-3 trained nothing without a word."""
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[f"output_dir={tmp_path}"])
    policy, task = toy.build(cfg)
    with pytest.raises(ConfigError, match=r"section train is a dict, not a TrainLoopConfig.*'train': cfg\.train"):
        Trainer(cfg.model_copy(update={"train": {"max_steps": 1}}), policy, task)
    negative = cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_steps": -3})})
    with pytest.raises(ConfigError, match=r"train\.max_steps: Input should be greater than or equal to 0 \(got -3\)"):
        Trainer(negative, policy, task)
    nested = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"scheduler": {"mode": "sync"}})})
    with pytest.raises(ConfigError, match=r"section rollout\.scheduler is a dict"):
        Trainer(nested, policy, task)
    good = cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_steps": 1}), "seed": 3})
    assert Trainer(good, policy, task).cfg is good  # validated, not replaced
