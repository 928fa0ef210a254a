"""ForkGRPO and AR-GRPO (dllm_rl.methods.fork_grpo): the rows of a hand-made trajectory and
their rebuilt states, the exact on-policy ratio and a brute-force recomputation of the old
log-probs on the bundled model, the per-rollout mean by hand and under micro-batching, the
zero-std group filter, AR-GRPO's one row per answer step, bad configs, and one Trainer step
of each preset config."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dllm_rl import backend
from dllm_rl.methods.fork_grpo import ForkGRPO, commits_per_step, fork_rows, row_states, row_targets
from dllm_rl.samplers import state_at
from mmrl.core.batch import RolloutBatch
from mmrl.core.config import ConfigError, load_config
from mmrl.core.rewards import AtomScores, Reward
from mmrl.core.trainer import Trainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "dllm"
M = 1  # a stand-in mask id for the hand-made states
SMALL = ["task.num_train=50", "task.num_eval=4", "rollout.eval_batch_size=32",
         "logging.tensorboard=false", "logging.progress=false"]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def config_run(name: str, *overrides: str, tmp_path=None, score_old: bool = True):
    """(cfg, policy, task) of configs/dllm/<name>.yaml on the bundled model, made small.
    score_old: the rollouts get scored old log-probs, as off-policy runs do (these configs
    train exactly on-policy, which skips that pass)."""
    out = [f"output_dir={tmp_path / 'out'}"] if tmp_path is not None else []
    cfg = load_config(backend.CONFIG_CLASS, CONFIGS / f"{name}.yaml", [*SMALL, *out, *overrides],
                      defaults=backend.DEFAULT_CONFIG)
    policy, task = backend.build(cfg)
    if score_old:
        policy.estimator.on_policy = False
    return cfg, policy, task


def rollout(policy, task, cfg, seed=0, prompts=4, g=4) -> RolloutBatch:
    return policy.generate(task.train[:prompts], g, cfg.rollout, torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- rows by hand


# Two rollouts of 4 tokens in two blocks of 2 (positions 0-1, then 2-3), 4 steps.
#   rollout 0: step 0 commits 0 and 1 (both > lambda); steps 1, 2 fall back to 2, then 3.
#   rollout 1: step 0 commits 1 alone (> lambda, not a fallback); step 1 falls back to 0;
#              step 2 falls back to 2; step 3 commits 3 alone (> lambda).
COMMIT = torch.tensor([[0, 0, 1, 2], [1, 0, 2, 3]])
FALLBACK = torch.tensor([[False, True, True, False], [False, True, True, False]])
COMPLETION = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])


def test_fallback_rows_and_their_states_by_hand():
    target = row_targets(COMMIT, FALLBACK, "fallback")
    assert target.tolist() == [[False, False, True, True], [True, False, True, False]]
    rows = fork_rows(target, COMMIT)
    # (sample, step, position): the fallback steps and the one position each committed
    assert list(zip(rows.sample.tolist(), rows.step.tolist(), rows.position.tolist())) == [
        (0, 1, 2), (0, 2, 3), (1, 1, 0), (1, 2, 2)]
    states = row_states(COMPLETION, COMMIT, rows, M)
    # mask exactly where a token was committed at or after the row's step
    assert states.tolist() == [[10, 11, M, M],   # rollout 0 before step 1: 2 and 3 still masked
                               [10, 11, 12, M],  # rollout 0 before step 2
                               [M, 21, M, M],    # rollout 1 before step 1: only 1 is decoded
                               [20, 21, M, M]]   # rollout 1 before step 2
    for r in range(4):
        i = int(rows.sample[r])
        assert torch.equal(states[r] == M, COMMIT[i] >= rows.step[r])


def test_all_rows_take_every_single_token_step_by_hand():
    target = row_targets(COMMIT, FALLBACK, "all")
    # rollout 0's step 0 committed two tokens: skipped; every step of rollout 1 committed one
    assert target.tolist() == [[False, False, True, True], [True, True, True, True]]
    rows = fork_rows(target, COMMIT)
    assert list(zip(rows.sample.tolist(), rows.step.tolist(), rows.position.tolist())) == [
        (0, 1, 2), (0, 2, 3), (1, 1, 0), (1, 0, 1), (1, 2, 2), (1, 3, 3)]
    assert row_states(COMPLETION, COMMIT, rows, M)[3].tolist() == [M, M, M, M]  # before step 0


def test_rows_reject_bad_input():
    with pytest.raises(ValueError, match="rollout 0 fell back at step 0 but committed 2 tokens"):
        row_targets(COMMIT, torch.tensor([[True, False, False, False], [False] * 4]), "fallback")
    with pytest.raises(ValueError, match="rows must be one of"):
        row_targets(COMMIT, FALLBACK, "some")
    with pytest.raises(ValueError, match="commit_step holds step 3 but the rollout has 2 steps"):
        row_targets(COMMIT, FALLBACK[:, :2], "all")
    # never-committed positions (commit_step < 0) are never targets
    assert row_targets(torch.tensor([[0, -1]]), torch.tensor([[True]]), "fallback").tolist() == [[True, False]]


# --------------------------------------------------------------------------- the bundled model


@pytest.fixture(scope="module")
def fork_batch():
    cfg, policy, task = config_run("fork_grpo")
    return cfg, policy, task, rollout(policy, task, cfg)


def test_old_logp_is_exact_and_equals_a_brute_force_recomputation(fork_batch):
    cfg, policy, _, batch = fork_batch
    rows, cs, comp = batch.data["fork_row"], batch.data["commit_step"], batch.data["completion"]
    fallback = batch.data["fallback"]
    assert cfg.rollout.strategy == "fork" and cfg.rollout.temperature == 0.8
    assert rows.sum() > 4 and rows.any(1).sum() >= 8
    # every row is the one token of a fallback step, inside the answer
    assert torch.equal(rows, row_targets(cs, fallback, "fallback") & batch.mask)
    assert int(rows.sum()) <= int(fallback.sum())
    assert (batch.old_logp[~rows] == 0).all() and (batch.old_logp[rows] < 0).all()
    # brute force: each row's state alone through the model, log_softmax(logits / T) at k
    P, T, tokens = policy.prompt_length, cfg.rollout.temperature, torch.cat([batch.data["prompt_ids"], comp], 1)
    with torch.no_grad():
        for i, k in rows.nonzero().tolist():
            step = int(cs[i, k])
            assert bool(fallback[i, step])
            x = state_at(tokens[i:i + 1], cs[i:i + 1], step, mask_id=policy.predictor.mask_token_id)
            assert int((x[0, P:] == policy.predictor.mask_token_id).sum()) == int((cs[i] >= step).sum())
            logits = policy.logits(x, batch.data["prompt_valid"][i:i + 1])[0, P + k]
            brute = torch.log_softmax(logits.double() / T, -1)[comp[i, k]]
            assert float(batch.old_logp[i, k]) == pytest.approx(float(brute), abs=1e-5)
            assert float(batch.data["commit_logp"][i, k]) == pytest.approx(float(brute), abs=1e-5)
    assert torch.allclose(batch.old_logp[rows], batch.data["commit_logp"][rows], atol=1e-5)


def test_ratio_is_exactly_one_on_policy(fork_batch):
    cfg, policy, task, batch = fork_batch
    with torch.no_grad():
        assert torch.equal(policy.logprobs(batch), batch.old_logp)
    method = ForkGRPO(cfg.method, cfg, task.reward)
    adv = torch.linspace(-1, 1, len(batch))
    m = method.loss(policy, batch, adv, denom=method.loss_denominator(batch)).metrics
    assert m["loss/ratio_min"] == 1.0 and m["loss/ratio_max"] == 1.0 and m["loss/clip_frac"] == 0
    with_kl = cfg.method.model_copy(deep=True)
    with_kl.kl.beta = 0.1  # k3 to the pre-update policy: 0 on-policy, the loss unchanged
    out = ForkGRPO(with_kl, cfg, task.reward).loss(policy, batch, adv)
    assert out.metrics["loss/kl"] == 0.0 and float(out.loss.detach()) == pytest.approx(m["loss/policy"], abs=1e-7)
    metrics = method.batch_metrics(batch)
    assert metrics["fork/rows"] == float(batch.data["fork_row"].sum())
    assert metrics["fork/rollouts_without_rows"] == pytest.approx(float((~batch.data["fork_row"].any(1)).float().mean()))


def test_micro_batches_give_the_full_batch_loss_on_the_model(fork_batch):
    cfg, policy, task, batch = fork_batch
    method = ForkGRPO(cfg.method, cfg, task.reward)
    adv = torch.linspace(-1, 1, len(batch))
    denom = method.loss_denominator(batch)
    assert denom == float(batch.data["fork_row"].any(1).sum())
    with torch.no_grad():
        full = float(method.loss(policy, batch, adv, denom=denom).loss)
        parts = [method.loss(policy, batch.select(idx), adv[idx], denom=denom).loss
                 for idx in torch.arange(len(batch)).split(3)]
    assert full != 0 and sum(float(p) for p in parts) == pytest.approx(full, abs=1e-6)


# --------------------------------------------------------------------------- the objective by hand


class HandPolicy:
    """logprobs = rows of a leaf tensor, picked by batch.data["idx"] (so select keeps them)."""

    def __init__(self, logp):
        self.logp = logp

    def logprobs(self, batch, iteration=0):
        return self.logp[batch.data["idx"]]


def hand_batch():
    # rollout 0: 1 row (rho 1.1); rollout 1: 3 rows (rho 1.0, 1.5, 0.5); rollout 2: no row
    rows = torch.tensor([[True, False, False, False], [True, True, False, True], [False] * 4])
    ratio = torch.tensor([[1.1, 1, 1, 1], [1.0, 1.5, 1, 0.5], [1, 1, 1, 1]])
    logp = ratio.log().requires_grad_(True)
    batch = RolloutBatch(group_ids=torch.tensor([0, 0, 0]), samples=[None] * 3, mask=torch.ones(3, 4, dtype=torch.bool),
                         old_logp=torch.zeros(3, 4), data={"fork_row": rows, "idx": torch.arange(3)})
    return batch, HandPolicy(logp), torch.tensor([2.0, -1.0, 5.0])


def test_per_rollout_mean_by_hand_and_under_micro_batches():
    cfg = load_config(backend.CONFIG_CLASS, CONFIGS / "fork_grpo.yaml", SMALL, defaults=backend.DEFAULT_CONFIG)
    method = ForkGRPO(cfg.method, cfg, None)
    batch, policy, adv = hand_batch()
    # rollout 0: min(1.1 * 2, clip(1.1, 0.8, 1.2) * 2) = 2.2
    # rollout 1 (A = -1): min(-1, -1) = -1; min(-1.5, -1.2) = -1.5; min(-0.5, -0.8) = -0.8;
    #   mean -3.3 / 3 = -1.1.  rollout 2 has no row: not counted.  J = (2.2 - 1.1) / 2 = 0.55
    denom = method.loss_denominator(batch)
    assert denom == 2.0
    out = method.loss(policy, batch, adv, denom=denom)
    assert float(out.loss.detach()) == pytest.approx(-0.55, abs=1e-6)
    assert float(method.loss(policy, batch, adv).loss.detach()) == pytest.approx(-0.55, abs=1e-6)  # own denom
    out.loss.backward()
    full_grad = policy.logp.grad.clone()
    # d loss / d logp = -rho A / (|F_i| * 2) where the min took the unclipped term: rollout 0
    # -1.1 * 2 / 2 = -1.1 (clip(1.1) = 1.1); rollout 1 (A = -1) rho 1.0 -> 1 / 6, rho 1.5
    # (-1.5 < -1.2) -> 1.5 / 6 = 0.25; rho 0.5 took the clipped -0.8: 0
    assert full_grad[0, 0] == pytest.approx(-1.1) and full_grad[1, 0] == pytest.approx(1 / 6)
    assert full_grad[1, 1] == pytest.approx(0.25) and full_grad[1, 3] == 0 and (full_grad[2] == 0).all()
    policy.logp.grad = None
    total = 0.0
    for idx in (torch.tensor([0]), torch.tensor([1, 2])):  # micro-batches with 1 and 0 + 3 rows
        micro = batch.select(idx)
        part = method.loss(policy, micro, adv[idx], denom=denom)
        part.loss.backward()
        total += float(part.loss.detach())
    assert total == pytest.approx(-0.55, abs=1e-6)
    assert torch.allclose(policy.logp.grad, full_grad, atol=1e-7)
    # a micro-batch (or mini-batch) with no row at all: loss 0, not NaN; denominator 0 is allowed
    empty = batch.select(torch.tensor([2]))
    assert method.loss_denominator(empty) == 0.0
    assert float(method.loss(policy, empty, adv[2:], denom=0.0).loss.detach()) == 0.0


def test_zero_std_groups_are_skipped():
    cfg = load_config(backend.CONFIG_CLASS, CONFIGS / "fork_grpo.yaml", SMALL, defaults=backend.DEFAULT_CONFIG)
    method = ForkGRPO(cfg.method, cfg, None)
    total = torch.tensor([1.0, 1, 1, 0, 1, 0, 0.5, 0.5])  # group 0 all alike, group 1 spread, group 2 alike
    batch = RolloutBatch(group_ids=torch.tensor([0, 0, 0, 1, 1, 1, 2, 2]), samples=[None] * 8,
                         scores=AtomScores(names=["r"], values=total[:, None], total=total))
    assert method.keep_groups(batch).tolist() == [False] * 3 + [True] * 3 + [False] * 2


# --------------------------------------------------------------------------- AR-GRPO and configs


def test_ar_grpo_rows_are_every_answer_step():
    cfg, policy, task = config_run("ar_grpo")
    batch = rollout(policy, task, cfg, prompts=2)
    cs, active = batch.data["commit_step"], batch.data["active"]
    C = cs.shape[1]
    assert (active.sum(1) == C).all()  # one token per step: 8 steps for 8 tokens
    assert sorted(cs[0].tolist()) == list(range(C))
    # before the eos filler is removed, every step is a row: as many as active steps
    assert int(row_targets(cs, batch.data["fallback"], "all").sum()) == int(active.sum())
    assert torch.equal(batch.data["fork_row"], batch.mask)  # every answer token trains
    with torch.no_grad():
        assert torch.equal(policy.logprobs(batch), batch.old_logp)
    m = batch.mask
    assert torch.allclose(batch.old_logp[m], batch.data["commit_logp"][m], atol=1e-5)


def test_rows_all_skips_steps_that_commit_several_tokens():
    # low_confidence with 6 steps for one block of 8 commits 2, 2, then 1 a step: the two-token
    # steps have no exact ratio (2 a step throughout is a config error: test_rows_all_on_low_...)
    cfg, policy, task = config_run("fork_grpo", "method.rows=all", "rollout.strategy=low_confidence",
                                   "rollout.block_length=8", "rollout.steps=6")
    batch = rollout(policy, task, cfg, prompts=1)
    cs = batch.data["commit_step"]
    counts = commits_per_step(cs, batch.data["active"].shape[1])  # [N, S]
    assert counts.shape[1] == 6 and (counts[:, :2] == 2).all() and (counts[:, 2:] == 1).all()
    assert batch.data["fork_row"].equal((cs >= 2) & batch.mask)  # the single-token steps' answer tokens alone
    assert (batch.old_logp[cs < 2] == 0).all()
    # with a fork rollout, rows: all adds the single-token threshold steps to the fallback rows
    cfg, policy, task = config_run("fork_grpo", "method.rows=all")
    batch = rollout(policy, task, cfg)
    fallback_rows = row_targets(batch.data["commit_step"], batch.data["fallback"], "fallback") & batch.mask
    assert (batch.data["fork_row"] | fallback_rows).equal(batch.data["fork_row"])
    assert batch.data["fork_row"].sum() > fallback_rows.sum()


def test_bad_configs_are_errors():
    with pytest.raises(ConfigError, match="rows: fallback trains on the fork sampler's fallback steps"):
        config_run("fork_grpo", "rollout.strategy=threshold")
    with pytest.raises(ConfigError, match="ar_grpo decodes left to right: rollout.strategy must be ar"):
        config_run("ar_grpo", "rollout.strategy=fork")
    # by the config itself, before any model: `dllm-rl config` printed these, and train loaded the model first
    from dllm_rl.config import DLLMTrainConfig
    from mmrl.core.config import load_config

    for overrides in (["method.type=fork_grpo", "rollout.strategy=threshold"],
                      ["method.type=ar_grpo", "rollout.strategy=fork"]):
        with pytest.raises(ConfigError, match="rollout.strategy"):
            load_config(DLLMTrainConfig, None, overrides)


# --------------------------------------------------------------------------- one training step


@pytest.mark.parametrize("name", ["fork_grpo", "ar_grpo"])
def test_one_trainer_step_of_the_preset(tmp_path, monkeypatch, name):
    # rewards: group 0 all alike (skipped), the others 0, 1, 0, 1 (advantages +-0.87)
    def spread(self, samples):
        n = len(samples)
        total = (torch.arange(n) % 2).float()
        total[:4] = 1.0
        return AtomScores(names=["r"], values=total[:, None], total=total)

    monkeypatch.setattr(Reward, "score", spread)
    cfg, policy, task = config_run(name, "rollout.prompts_per_step=3", "rollout.num_generations=4",
                                   "train.max_steps=1", "optim.lr=1e-2", tmp_path=tmp_path, score_old=False)
    assert cfg.train.ppo_epochs == 1
    before = {k: v.detach().clone() for k, v in policy.model.named_parameters() if v.requires_grad}
    Trainer(cfg, policy, task, output_dir=tmp_path / "out").train()
    row = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    # on-policy the loss is -mean(A) over rollouts with rows (0 when they all have rows, since
    # a group's advantages sum to 0); its gradient is not
    assert row["train/updates"] == 1 and math.isfinite(row["loss/total"]) and row["loss/grad_norm"] > 0
    assert row["rollout/groups_dropped"] == 1 and row["rollout/groups"] == 2
    assert row["fork/rows"] > 0 and 0 <= row["fork/rollouts_without_rows"] < 1
    assert row["loss/ratio_min"] == pytest.approx(1.0, abs=1e-5)
    changed = [k for k, v in policy.model.named_parameters() if v.requires_grad and not torch.equal(v, before[k])]
    assert changed and len(changed) == len(before), sorted(set(before) - set(changed))


# --------------------------------------------------------------------------- edges, clips and KL terms by hand


def test_fallback_step_that_committed_nothing_and_step_past_the_end_are_errors():
    """The sampler's contract is exactly one token per fallback step: a fallback step that
    committed no token (not only one that committed several) is a ValueError; so is a commit
    step equal to the step count (steps are 0..S-1), caught before the scatter indexes past S."""
    with pytest.raises(ValueError, match="commit_step holds step 3 but the rollout has 3 steps"):
        row_targets(COMMIT, FALLBACK[:, :3], "all")
    with pytest.raises(ValueError, match="fell back at step 1 but committed 0 tokens"):
        row_targets(torch.tensor([[0, 0]]), torch.tensor([[False, True]]), "fallback")


def test_upper_clip_and_kl_term_by_hand():
    """eps = 0.2 clips a ratio above 1.2 for A > 0 (min(1.5, 1.2) = 1.2), and beta > 0 adds
    + beta * k3 KL, k3 = 1/rho + log rho - 1 per row, averaged within each rollout, then over
    the rollouts with rows (a token-level mean would differ: 2 rows and 1 row)."""
    cfg = load_config(backend.CONFIG_CLASS, CONFIGS / "fork_grpo.yaml", SMALL, defaults=backend.DEFAULT_CONFIG)
    mcfg = cfg.method.model_copy(deep=True)
    mcfg.kl.beta = 0.1
    method = ForkGRPO(mcfg, cfg, None)
    rows = torch.tensor([[True, True, False], [True, False, False]])
    ratio = torch.tensor([[1.5, 1.0, 1.0], [0.5, 1.0, 1.0]])
    batch = RolloutBatch(group_ids=torch.tensor([0, 0]), samples=[None] * 2, mask=torch.ones(2, 3, dtype=torch.bool),
                         old_logp=torch.zeros(2, 3), data={"fork_row": rows, "idx": torch.arange(2)})
    out = method.loss(HandPolicy(ratio.log()), batch, torch.tensor([1.0, -1.0]), denom=2.0)
    # rollout 0 (A = 1): min(1.5, 1.2) = 1.2 and 1.0 -> mean 1.1; rollout 1 (A = -1):
    # min(-0.5, -0.8) = -0.8.  J = (1.1 - 0.8) / 2 = 0.15
    def k3(rho):
        return 1 / rho + math.log(rho) - 1

    kl = ((k3(1.5) + k3(1.0)) / 2 + k3(0.5)) / 2
    assert out.metrics["loss/kl"] == pytest.approx(kl, abs=1e-6)
    assert float(out.loss.detach()) == pytest.approx(-0.15 + 0.1 * kl, abs=1e-6)


def test_a_micro_batch_without_rows_still_backpropagates(fork_batch):
    """A (micro-)batch with no row scores zeros that still take part in autograd while grad is
    on (a leaf that requires grad), so the trainer's loss.backward() is legal and the loss is 0."""
    cfg, policy, task, batch = fork_batch
    empty = batch.select(torch.arange(len(batch)))
    empty.data["fork_row"] = torch.zeros_like(batch.data["fork_row"])
    out = ForkGRPO(cfg.method, cfg, task.reward).loss(policy, empty, torch.linspace(-1, 1, len(batch)), denom=0.0)
    assert float(out.loss.detach()) == 0.0
    out.loss.backward()


def test_rows_all_on_low_confidence_rollouts_that_never_commit_one_token_is_an_error():
    """fork_grpo rows: all under low_confidence with 2 tokens a step (gen_length 8, block 4, steps 4)
    has no single-token step: every step of the run trained no row (loss 0, grad 0) without a word."""
    from dllm_rl.config import DLLMTrainConfig
    from mmrl.core.config import load_config

    base = ["method.type=fork_grpo", "method.rows=all", "rollout.strategy=low_confidence",
            "rollout.gen_length=8", "rollout.block_length=4"]
    with pytest.raises(ConfigError, match=r"low_confidence with rollout.steps 4 commits at least 2 tokens at every "
                                          r"step .* no row would train; set rollout.steps to gen_length \(8\)"):
        load_config(DLLMTrainConfig, None, [*base, "rollout.steps=4"])
    # one token a step (steps = gen_length), or a 4-3 split (1 or 2 a step): rows exist, no error
    assert load_config(DLLMTrainConfig, None, [*base, "rollout.steps=8"]).rollout.steps == 8
    assert load_config(DLLMTrainConfig, None, [*base, "rollout.block_length=8", "rollout.steps=6"]).rollout.steps == 6
