"""The optimizer and the loop's numerics as a researcher tunes them: the logged learning rate,
the warm-up against the run's length, gradient clipping's settings (test_trainer.py's tiny
Llama run; each test a few updates)."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_trainer import make, raise_on_call

from mmrl.core.checkpoint import list_checkpoints
from mmrl.core.config import ConfigError, TrainConfig, load_config
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


def test_a_warmup_as_long_as_the_run_is_warned(tmp_path):
    """3 steps x 1 epoch x 2 mini-batches = 6 optimizer steps under an 8-step warm-up: the lr
    peaks at lr x 6/8 and the cosine decay never starts, which a trial run of a long run's
    config would otherwise do silently. A warm-up shorter than the run says nothing."""
    with pytest.warns(UserWarning, match=r"warmup_steps 8 spans the whole run \(6 optimizer steps.*lr x 6/8 at "
                                         r"most and the cosine decay never starts"):
        make(tmp_path, "train.max_steps=3", "train.mini_batches=2", "optim.warmup_steps=8", "optim.schedule=cosine")
    with pytest.warns(UserWarning, match=r"optim.warmup_ratio 1.0 spans the whole run \(6 optimizer steps.*lr x 6/6"):
        make(tmp_path, "train.max_steps=3", "train.mini_batches=2", "optim.warmup_ratio=1", name="ratio")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make(tmp_path, "train.max_steps=3", "train.mini_batches=2", "optim.warmup_steps=5", name="shorter")


@pytest.mark.parametrize("value", ["0", "-1", "inf", ".inf"])
def test_max_grad_norm_0_or_inf_is_refused_saying_null_turns_clipping_off(value):
    """transformers reads max_grad_norm 0 as no clipping, and inf means none in effect; here
    both are refused (null is how to say it), with a message that says so instead of pydantic's
    bare "greater than 0" / "a finite number"."""
    with pytest.raises(ConfigError, match=r"optim\.max_grad_norm: .* is not a positive, finite norm; for no clipping "
                                          r"set it to null \(--set optim\.max_grad_norm=null\)"):
        load_config(TrainConfig, overrides=[f"optim.max_grad_norm={value}"])
    assert load_config(TrainConfig, overrides=["optim.max_grad_norm=null"]).optim.max_grad_norm is None


def test_a_resume_that_stretches_a_decaying_schedule_says_the_lr_jumps(tmp_path):
    """A finished 1-step linear run (lr 0.004) ends with its schedule at 0; resumed with
    max_steps 2 (extending a run, which the changed-settings warning leaves out) the same
    schedule spans 2 updates and goes on at 0.004 x (1 - 1/2) = 0.002: said, not silent. A
    constant schedule, or a resume of the same length, changes no lr and says nothing."""
    make(tmp_path, *SMALL, "train.max_steps=1", "optim.schedule=linear", "optim.lr=0.004").train()
    longer = make(tmp_path, *SMALL, "train.max_steps=2", "optim.schedule=linear", "optim.lr=0.004")
    path = list_checkpoints(tmp_path / "run" / "checkpoints")[-1][1]
    with pytest.warns(UserWarning, match=r"optimizer step 1: the learning rate goes from 0 \(the checkpoint's "
                                         r"schedule\) to 0.002, as the linear schedule now spans 2 optimizer steps"):
        longer.load(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make(tmp_path, *SMALL, "train.max_steps=1", "optim.schedule=linear", "optim.lr=0.004").load(path)
        make(tmp_path, *SMALL, "train.max_steps=1", name="flat").train()
        make(tmp_path, *SMALL, "train.max_steps=2", name="flat").load(
            list_checkpoints(tmp_path / "flat" / "checkpoints")[-1][1])


def test_min_lr_ratio_is_where_the_decay_ends():
    """f' = r + (1 - r) f: linear over 10 steps with r 0.1 is 0.1 + 0.9 x (1 - 5/10) = 0.55
    half-way and 0.1 at the end (and past it); cosine half-way 0.1 + 0.9 x 0.5 = 0.55; the
    warm-up still rises from lr / warmup_steps. Set with a constant schedule it is said unused."""
    from mmrl.core.config import OptimConfig
    from mmrl.core.trainer import lr_factor

    linear = lr_factor(OptimConfig(schedule="linear", min_lr_ratio=0.1, warmup_steps=2), 12)
    assert [linear(n) for n in (0, 2, 7, 12, 20)] == [0.5, 1.0, pytest.approx(0.55), pytest.approx(0.1),
                                                      pytest.approx(0.1)]
    cosine = lr_factor(OptimConfig(schedule="cosine", min_lr_ratio=0.1), 10)
    assert [cosine(n) for n in (0, 5, 10)] == [1.0, pytest.approx(0.55), pytest.approx(0.1)]
    with pytest.warns(UserWarning, match="optim.min_lr_ratio 0.1 is unused with optim.schedule constant"):
        OptimConfig(min_lr_ratio=0.1)
    with pytest.raises(ConfigError, match=r"optim\.min_lr_ratio: Input should be less than or equal to 1"):
        load_config(TrainConfig, overrides=["optim.schedule=linear", "optim.min_lr_ratio=2"])


def test_lr_0_is_a_control_run_that_changes_no_weight(tmp_path):
    """optim.lr=0 (a no-learning baseline beside a run) trains: the steps log their rewards,
    losses and gradient norms, and every weight ends as it began (AdamW's decoupled weight
    decay is lr x weight_decay: 0 too). Before, pydantic refused it ('greater than 0')."""
    trainer = make(tmp_path, "train.max_steps=2", "optim.lr=0", "optim.weight_decay=0.1")
    before = {k: v.detach().clone() for k, v in trainer.policy.model.named_parameters()}
    trainer.train()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["optim/lr"] for r in rows] == [0.0, 0.0]
    assert any(r["loss/grad_norm"] > 0 for r in rows)  # the gradients were made, only not applied
    after = dict(trainer.policy.model.named_parameters())
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_warmup_ratio_is_a_fraction_of_the_run_rounded_up_as_transformers():
    """warmup_ratio r over a run of U optimizer steps warms up over ceil(r x U) of them (U =
    train.max_steps x ppo_epochs x mini_batches, the count the decay spans): 0.25 of 10 is
    ceil(2.5) = 3, so step n < 3 uses (n + 1) / 3 and the linear decay then spans 10 - 3 = 7.
    The rounding is transformers' own (its get_warmup_steps, float products included), so a
    ported warmup_ratio gives the same warm-up (transformers 5 takes a ratio as a warmup_steps
    below 1; its 1.0 is one step, where warmup_ratio 1 here, as transformers 4's, is the whole run)."""
    from types import SimpleNamespace

    from transformers import TrainingArguments

    from mmrl.core.config import OptimConfig
    from mmrl.core.trainer import lr_factor

    linear = lr_factor(OptimConfig(schedule="linear", warmup_ratio=0.25), 10)
    assert [linear(n) for n in (0, 1, 2, 3, 10)] == [pytest.approx(1 / 3), pytest.approx(2 / 3), 1.0, 1.0, 0.0]
    assert linear(5) == pytest.approx(1 - 2 / 7)
    for ratio in (0.0, 0.01, 0.07, 0.1, 0.25, 0.3, 0.5, 0.99):
        for total in (1, 7, 10, 30, 100, 333):
            theirs = TrainingArguments.get_warmup_steps(SimpleNamespace(warmup_steps=ratio), total)
            assert OptimConfig(warmup_ratio=ratio).warmup(total) == theirs, (ratio, total)
    assert OptimConfig(warmup_ratio=1.0).warmup(7) == 7
    assert OptimConfig(warmup_steps=4).warmup(100) == 4  # a count stays a count


def test_warmup_ratio_with_warmup_steps_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"optim\.warmup_ratio: 0\.1 and optim\.warmup_steps 5 are both set: give "
                                          r"the warm-up as one of them and set the other to 0"):
        load_config(TrainConfig, overrides=["optim.warmup_ratio=0.1", "optim.warmup_steps=5"])
    with pytest.raises(ConfigError, match=r"optim\.warmup_ratio: Input should be less than or equal to 1"):
        load_config(TrainConfig, overrides=["optim.warmup_ratio=1.5"])
    assert load_config(TrainConfig, overrides=["optim.warmup_ratio=0.1", "optim.warmup_steps=0"]).optim.warmup_ratio == 0.1


def test_a_resumed_warmup_ratio_run_goes_on_along_the_same_schedule(tmp_path):
    """3 steps x 2 mini-batches = 6 optimizer steps, warmup_ratio 0.5: 3 warm-up steps, then a
    linear decay over 3. Factors per optimizer step: 1/3, 2/3, 1 | 1, 2/3, 1/3; a step logs the
    mean of its two, x lr 0.004: 0.002, 0.004, 0.002. A run killed in step 3 and resumed from
    its step-2 checkpoint logs the same step 3: the ratio is of the whole run, not of the steps
    left."""
    args = (*SMALL, "train.max_steps=3", "train.mini_batches=2", "train.save_every=2", "optim.lr=0.004",
            "optim.warmup_ratio=0.5", "optim.schedule=linear")
    crashing = make(tmp_path, *args)
    raise_on_call(crashing.policy, "generate", at=3, error=KeyboardInterrupt("simulated kill"))
    with pytest.raises(KeyboardInterrupt):
        crashing.train()
    assert [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [2]
    make(tmp_path, *args).train(resume=True)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["optim/lr"] for r in rows] == [pytest.approx(v) for v in (0.002, 0.004, 0.002)]
