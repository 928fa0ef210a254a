"""Runs whose first pass is on-policy skip the old-log-prob pass (mmrl.core.pipeline.
first_pass_on_policy): when it applies, that the rollouts and the generator's draws are
unchanged, that the rows are numbered, that the rollout costs fewer forward tokens, that the
loss and its gradient equal those computed from scored old log-probs, for every dLLM
estimator, and that two-pass training ends with the same weights either way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dllm_rl import backend
from dllm_rl.config import TraceRLConfig
from dllm_rl.methods.common import FIRST_PASS, EstimatorBase
from dllm_rl.methods.tracerl import TraceRL
from mmrl.core.batch import RolloutBatch
from mmrl.core.config import load_config
from mmrl.core.method import build_method
from mmrl.core.pipeline import exactly_on_policy, first_pass_on_policy
from mmrl.core.trainer import Trainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "dllm"
SMALL = ["task.num_train=50", "task.num_eval=4", "logging.tensorboard=false", "logging.progress=false",
         "train.ppo_epochs=1"]
# where each estimator keeps its scored old log-probs
SCORED = {"slim_rl": "slim/old_logp", "diffu_grpo": "old_logp_mu"}


def config(name: str, *overrides: str):
    return load_config(backend.CONFIG_CLASS, CONFIGS / f"{name}.yaml", [*SMALL, *overrides],
                       defaults=backend.DEFAULT_CONFIG)


@pytest.mark.parametrize("overrides, exactly, first_pass", [
    ((), True, True),
    (("train.ppo_epochs=2",), False, True),
    (("train.mini_batches=2",), False, False),
    (("rollout.scheduler.mode=pipelined",), False, False),
    (("rollout.scheduler.placement=thread",), False, False),
])
def test_which_runs_are_on_policy(overrides, exactly, first_pass):
    cfg = config("slim_rl", *overrides)
    assert exactly_on_policy(cfg) is exactly and first_pass_on_policy(cfg) is first_pass


def test_two_passes_skip_unless_each_pass_scores_other_inputs():
    assert backend.build(config("tracerl", "train.ppo_epochs=2"))[0].estimator.on_policy
    # d1's pass k masks the prompt with seed k: pass 1's inputs were never scored on-policy
    assert not backend.build(config("diffu_grpo", "train.ppo_epochs=2"))[0].estimator.on_policy


@pytest.mark.parametrize("name", ["slim_rl", "fork_grpo", "ar_grpo", "diffu_grpo", "tracerl"])
def test_skipping_the_old_pass_changes_no_rollout_and_no_gradient(name):
    cfg = config(name)
    policy, task = backend.build(cfg)
    assert policy.estimator.on_policy  # built from an exactly on-policy config

    def rollout(on_policy: bool):
        policy.estimator.on_policy = on_policy
        policy.step_costs()
        generator = torch.Generator().manual_seed(0)
        batch = policy.generate(task.train[:2], 4, cfg.rollout, generator)
        return batch, policy.step_costs()["cost/forward_tokens"], generator.get_state()

    skipped, tokens_skipped, state_skipped = rollout(True)
    scored, tokens_scored, state_scored = rollout(False)
    assert torch.equal(state_skipped, state_scored)  # the estimator drew the same numbers
    assert skipped.data[FIRST_PASS].tolist() == list(range(8)) and FIRST_PASS not in scored.data
    assert set(scored.data) - set(skipped.data) == ({SCORED[name]} if name in SCORED else set())
    for key, value in skipped.data.items():
        if key != FIRST_PASS:
            assert torch.equal(value, scored.data[key]), key
    assert tokens_skipped < tokens_scored

    method = build_method(cfg, task.reward)
    advantages = torch.linspace(-1, 1, len(skipped))

    def loss_and_grads(batch):
        policy.model.zero_grad()
        out = method.loss(policy, batch, advantages, denom=method.loss_denominator(batch))
        out.loss.backward()
        grads = [p.grad.clone() for p in policy.model.parameters() if p.grad is not None]
        return out, grads

    out_skipped, grads_skipped = loss_and_grads(skipped)
    out_scored, grads_scored = loss_and_grads(scored)
    assert grads_skipped and len(grads_skipped) == len(grads_scored)
    assert torch.allclose(out_skipped.loss, out_scored.loss, atol=1e-6)
    for a, b in zip(grads_skipped, grads_scored):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert out_skipped.metrics["loss/clip_frac"] == 0


@pytest.mark.parametrize("name", ["tracerl", "slim_rl"])
def test_two_pass_training_takes_the_first_pass_as_old(name, tmp_path):
    """Two passes with micro-batches: the weights after two steps equal those of the run that
    scored its old log-probs, and the second pass still sees a ratio other than 1."""
    overrides = ["train.ppo_epochs=2", "train.micro_batch_size=8", "rollout.prompts_per_step=2",
                 "rollout.num_generations=8", "train.max_steps=2", "optim.lr=1e-3",
                 "method.dynamic_sampling.enabled=false"]
    if name == "slim_rl":
        overrides.append("method.accuracy_band=[0,1]")  # keep every group: something to train
    runs = []
    for skip in (True, False):
        cfg = config(name, *overrides, f"output_dir={tmp_path / str(skip)}")
        policy, task = backend.build(cfg)
        assert policy.estimator.on_policy
        policy.estimator.on_policy = skip
        summary = Trainer(cfg, policy, task).train()
        assert summary["steps"] == 2
        rows = [json.loads(x) for x in (tmp_path / str(skip) / "metrics.jsonl").read_text().splitlines()]
        runs.append((rows, [p.detach().clone() for p in policy.model.parameters()]))
    (skipped, w_skipped), (scored, w_scored) = runs
    for a, b in zip(w_skipped, w_scored):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    for a, b in zip(skipped, scored):
        assert a["loss/ratio_max"] == pytest.approx(b["loss/ratio_max"], abs=1e-6)
    assert max(a["loss/ratio_max"] for a in skipped) > 1  # averaged over the passes: pass 1's moved off 1
    changed = sum(not torch.equal(a, b) for a, b in zip(w_skipped, backend.build(cfg)[0].model.parameters()))
    assert changed > 0


def _rows(n: int) -> RolloutBatch:
    return RolloutBatch(group_ids=torch.zeros(n, dtype=torch.long), samples=[None] * n,
                        mask=torch.ones(n, 2, dtype=torch.bool))


def test_row_ids_run_on_across_the_batches_of_a_step():
    """Two batches in one step (a refill, say): the second's rows are numbered after the first's,
    so pass 1 of each reads its own pass-0 log-probs; a new step keeps only its own."""
    est = EstimatorBase()
    est.on_policy = True
    a, b = _rows(3), _rows(2)
    assert est.skip_old(a) and est.skip_old(b)
    assert a.data[FIRST_PASS].tolist() == [0, 1, 2] and b.data[FIRST_PASS].tolist() == [3, 4]
    method = TraceRL(TraceRLConfig(), None, reward=None)
    la, lb = torch.full((3, 2), -1.0), torch.full((2, 2), -2.0)
    assert torch.equal(method.old_or_first_pass(a, la, None), la)  # pass 0: its own log-probs
    assert torch.equal(method.old_or_first_pass(b, lb, None), lb)
    method.epoch = 1
    assert torch.equal(method.old_or_first_pass(a, torch.zeros(3, 2), None), la)
    assert torch.equal(method.old_or_first_pass(b, torch.zeros(2, 2), None), lb)
    method.step, method.epoch = 1, 0
    c = _rows(2)
    est.skip_old(c)
    method.old_or_first_pass(c, torch.full((2, 2), -3.0), None)
    assert sorted(method.first_pass) == [5, 6]  # the last step's rows are dropped


def test_a_later_pass_reads_each_rows_first_pass_in_the_batchs_order():
    """Pass 1 over the rows in another order (a shuffled mini-batch) gets each row its own
    pass-0 log-probs; a row whose first pass this method never ran is an error."""
    est = EstimatorBase()
    est.on_policy = True
    batch = _rows(3)
    est.skip_old(batch)
    method = TraceRL(TraceRLConfig(), None, reward=None)
    first = torch.tensor([[-1.0, -1.5], [-2.0, -2.5], [-3.0, -3.5]], requires_grad=True)
    old = method.old_or_first_pass(batch, first, None)
    assert not old.requires_grad  # detached: the old log-probs carry no gradient
    method.epoch = 1
    got = method.old_or_first_pass(batch.select([2, 0, 1]), torch.zeros(3, 2), None)
    assert got.tolist() == [[-3.0, -3.5], [-1.0, -1.5], [-2.0, -2.5]]
    other = _rows(1)
    est.skip_old(other)  # row 3: numbered, never passed
    with pytest.raises(RuntimeError, match=r"pass 1 over rows whose first pass this method did not run "
                                           r"\(row ids \[3\]\)"):
        method.old_or_first_pass(other, torch.zeros(1, 2), None)
