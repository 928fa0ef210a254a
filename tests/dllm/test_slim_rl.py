"""SLIM-RL (dllm_rl.methods.slim_rl): the Gauss-Legendre rows and the per-block mask schedule,
the rollout-time masks, the sequence ratio (exactly 1 on-policy, clamped, clipped by hand),
micro-batch losses that sum to the mini-batch's, the accuracy band and the length-limit rule
by hand, and one real Trainer step of configs/dllm/slim_rl.yaml on a tiny model."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dllm_rl import backend
from dllm_rl.config import DLLMTrainConfig, SLIMRLConfig
from dllm_rl.methods.slim_rl import (
    SLIMRL,
    block_mask_rates,
    draw_masks,
    quadrature,
    slim_loss,
    truncated,
)
from mmrl.core.batch import RolloutBatch
from mmrl.core.config import load_config
from mmrl.core.rewards import AtomScores, Sample
from mmrl.core.trainer import Trainer

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "dllm" / "slim_rl.yaml"
EOS = 2  # the tiny tokenizer's <eos>
SLIM = ["method.type=slim_rl", "rollout.strategy=tau_budget"]


def rollout(policy, task, cfg, seed: int = 0) -> RolloutBatch:
    return policy.generate(task.train[:2], 4, cfg.rollout, torch.Generator().manual_seed(seed))


def slim_method(**cfg) -> SLIMRL:
    run = SimpleNamespace(task=SimpleNamespace(type="arith"), rollout=SimpleNamespace(strategy="tau_budget"))
    return SLIMRL(SLIMRLConfig(**cfg), run, reward=None)


# --------------------------------------------------------------------------- quadrature and schedule


def test_quadrature_three_points():
    t, w = quadrature(3)
    # leggauss(3): x = -sqrt(3/5), 0, sqrt(3/5); w = 5/9, 8/9, 5/9 -> t = (x + 1)/2, w / 2
    assert t.tolist() == pytest.approx([0.1127, 0.5, 0.8873], abs=1e-4)
    assert w.tolist() == pytest.approx([0.2778, 0.4444, 0.2778], abs=1e-4)
    assert float(w.sum()) == pytest.approx(1.0, abs=1e-12)
    with pytest.raises(ValueError, match="at least one point"):
        quadrature(0)


@pytest.mark.parametrize("t", [0.01, 0.1127, 0.3, 0.5, 0.8873, 0.99])
@pytest.mark.parametrize("blocks", [2, 3, 4, 7, 32])
def test_block_mask_rates_mean_is_t_and_decreasing(t, blocks):
    p = block_mask_rates(t, blocks, 0.2)
    assert p.shape == (blocks,) and p.dtype == torch.float64
    assert abs(float(p.mean()) - t) < 1e-12
    assert (p[1:] <= p[:-1]).all()  # non-increasing across blocks
    assert ((p > 0) & (p < 1)).all()
    s = min(0.2, 2 * min(t, 1 - t) - 1e-6)
    assert float(p[0] - p[-1]) == pytest.approx(s, abs=1e-12)  # the spread: t + s/2 down to t - s/2


def test_block_mask_rates_by_hand_and_bad_input():
    # t = 0.5, B = 3, s = 0.2: 0.5 + 0.1 cos(0, pi/2, pi) = 0.6, 0.5, 0.4
    assert block_mask_rates(0.5, 3, 0.2).tolist() == pytest.approx([0.6, 0.5, 0.4], abs=1e-12)
    assert block_mask_rates(0.3, 1, 0.2).tolist() == [0.3]  # one block: the rate is t
    with pytest.raises(ValueError, match="masking level"):
        block_mask_rates(1.0, 2, 0.2)
    with pytest.raises(ValueError, match="num_blocks"):
        block_mask_rates(0.5, 0, 0.2)


# --------------------------------------------------------------------------- masks


def test_masks_rate_per_block_and_validity():
    t, _ = quadrature(3)
    rates = torch.stack([block_mask_rates(float(x), 4, 0.2) for x in t])  # [Q, B]
    n, c = 2000, 64  # 4 blocks of 16: P(no Bernoulli mask in a row) <= e^-7 for t = 0.11
    valid = torch.ones((n, c), dtype=torch.bool)
    valid[: n // 4, 40:] = False  # a quarter of the answers end at position 39
    mask = draw_masks(valid, rates, 16, torch.Generator().manual_seed(0))
    assert mask.shape == (n, 3, c) and mask.dtype == torch.bool
    assert not (mask & ~valid[:, None]).any()  # never outside the completion mask
    assert mask.any(2).all()  # at least one per row
    full = mask[n // 4:]  # rows with every position valid
    for q in range(3):
        for j in range(4):
            rate = float(full[:, q, 16 * j: 16 * (j + 1)].float().mean())
            assert rate == pytest.approx(float(rates[q, j]), abs=0.01), (q, j)


def test_masks_fallback_masks_one_valid_position():
    valid = torch.tensor([[True, True, False, False], [True, False, False, False]])
    rates = torch.full((2, 2), 1e-12, dtype=torch.float64)  # Bernoulli never fires
    mask = draw_masks(valid, rates, 2, torch.Generator().manual_seed(1))
    assert (mask.sum(2) == 1).all() and not (mask & ~valid[:, None]).any()
    assert mask[1, :, 0].all()  # the only valid position of answer 1
    with pytest.raises(ValueError, match="blocks"):
        draw_masks(valid, rates, 3, torch.Generator())


# --------------------------------------------------------------------------- the sequence ratio


def test_rollout_masks_and_on_policy_ratio_is_one(make_run):
    cfg, policy, task = make_run(*SLIM, "method.kl.beta=0.01", score_old=True)
    batch = rollout(policy, task, cfg)
    mask, old = batch.data["slim/mask"], batch.data["slim/old_logp"]  # [N, Q, C]
    assert mask.shape == old.shape == (8, 3, 8)
    assert not (mask & ~batch.mask[:, None]).any() and mask.any(2).all()
    assert (old[~mask] == 0).all() and (old[mask] < 0).all()
    assert "stat/expected_wrong" in batch.data and "stat/truncated" in batch.data  # tau_budget's risk
    with torch.no_grad():
        assert torch.allclose(policy.logprobs(batch), old, atol=1e-5)
    method = SLIMRL(cfg.method, cfg, task.reward)
    adv = torch.tensor([1.0, 1, 1, 1, 1, 1, 1, -1])
    out = method.loss(policy, batch, adv)
    m = out.metrics
    assert m["loss/ratio_min"] == pytest.approx(1, abs=1e-5) and m["loss/ratio_max"] == pytest.approx(1, abs=1e-5)
    assert m["loss/kl"] == pytest.approx(0, abs=1e-8) and m["loss/clip_frac"] == 0
    # ratio 1: -sum_i sum_q w_q A_i / (N Q) = -(7 - 1) * 1 / 24 = -0.25
    assert float(out.loss.detach()) == pytest.approx(-0.25, abs=1e-5)


def test_sequence_ratio_clipped_by_hand():
    w = torch.tensor([0.25, 0.75])
    mask = torch.tensor([[[1, 1, 0], [1, 0, 0]], [[0, 0, 1], [1, 1, 1]]], dtype=torch.bool)  # [N=2, Q=2, C=3]
    old = torch.full((2, 2, 3), -1.0)
    diff = torch.tensor([[[0.2, 0.0, 9.0], [-0.2, 9.0, 9.0]], [[9.0, 9.0, 0.3], [0.0, 0.0, -0.3]]])  # 9: unmasked
    adv = torch.tensor([1.0, -2.0])
    out = slim_loss(old + diff, old, mask, adv, w, clip=0.1, max_log_ratio=10.0, beta=0.0)
    # row (0,0): l = 0.1, s = e^0.1 = 1.105 -> min(1.105, 1.1) = 1.1;        w 0.25 -> 0.275
    # row (0,1): l = -0.2, s = 0.8187 -> min(0.8187, 0.9) = 0.8187;           w 0.75 -> 0.6140
    # row (1,0): l = 0.3, s = 1.3499 -> min(-2.6997, -2.2) = -2.6997;         w 0.25 -> -0.6749
    # row (1,1): l = -0.1, s = 0.9048 (inside the clip) -> -1.8097;           w 0.75 -> -1.3573
    terms = [0.25 * 1.1, 0.75 * math.exp(-0.2), 0.25 * -2 * math.exp(0.3), 0.75 * -2 * math.exp(-0.1)]
    assert float(out.loss) == pytest.approx(-sum(terms) / 4, abs=1e-6)  # 0.28578
    assert out.metrics["loss/ratio_max"] == pytest.approx(math.exp(0.3), abs=1e-6)
    assert out.metrics["loss/ratio_min"] == pytest.approx(math.exp(-0.2), abs=1e-6)


def test_sequence_ratio_clamped_at_max_log_ratio():
    mask = torch.ones((1, 1, 2), dtype=torch.bool)
    old = torch.zeros((1, 1, 2))
    w = torch.ones(1)
    # mean log-ratio 20 -> clamped to 10: s = e^10; A = -1: min(-e^10, -1.1) = -e^10 -> loss e^10
    out = slim_loss(old + 20, old, mask, torch.tensor([-1.0]), w, clip=0.1, max_log_ratio=10.0, beta=0.0)
    assert float(out.loss) == pytest.approx(math.exp(10), rel=1e-5)
    out = slim_loss(old - 20, old, mask, torch.tensor([1.0]), w, clip=0.1, max_log_ratio=10.0, beta=0.0)
    assert out.metrics["loss/ratio_min"] == pytest.approx(math.exp(-10), rel=1e-5)
    assert float(out.loss) == pytest.approx(-math.exp(-10), rel=1e-5)  # min(e^-10, 0.9) = e^-10
    with pytest.raises(ValueError, match="shape"):
        slim_loss(old[0], old[0], mask[0], torch.ones(1), w, clip=0.1, max_log_ratio=10.0, beta=0.0)


def test_micro_batch_losses_sum_to_the_batch_loss(make_run):
    cfg, policy, task = make_run(*SLIM, "method.kl.beta=0.5", score_old=True)
    batch = rollout(policy, task, cfg)
    noise = torch.randn(batch.data["slim/old_logp"].shape, generator=torch.Generator().manual_seed(3))
    batch.data["slim/old_logp"] = batch.data["slim/old_logp"] + 0.3 * noise  # off-policy: clipping and KL
    method = SLIMRL(cfg.method, cfg, task.reward)
    adv = torch.linspace(-1, 1, 8)
    denom = method.loss_denominator(batch)
    assert denom == 8 * 3  # rows N * Q
    whole = method.loss(policy, batch, adv, denom=denom)
    parts = [method.loss(policy, batch.select(idx), adv[idx], denom=denom) for idx in torch.arange(8).split(3)]
    assert whole.metrics["loss/kl"] > 0 and whole.metrics["loss/clip_frac"] > 0
    assert float(whole.loss.detach()) == pytest.approx(sum(float(p.loss.detach()) for p in parts), abs=1e-5)
    assert float(whole.loss.detach()) == pytest.approx(float(method.loss(policy, batch, adv).loss.detach()), abs=1e-6)  # default denom


# --------------------------------------------------------------------------- groups


def scored_batch(answer: list[float], hit_limit: list[bool], group_size: int) -> RolloutBatch:
    n = len(answer)
    values = torch.tensor([[1.0, a] for a in answer])  # atoms: format (always 1), answer
    scores = AtomScores(["format", "answer"], values, values.sum(1))
    return RolloutBatch(group_ids=torch.arange(n) // group_size, samples=[Sample("p", "c")] * n, scores=scores,
                        data={"slim/truncated": torch.tensor(hit_limit)})


def test_accuracy_band_by_hand():
    # groups of 10 with 9, 5, 1 right answers: accuracy 0.9 (dropped), 0.5 (kept), 0.1 (dropped)
    answer = [1.0] * 9 + [0.0] + [1.0] * 5 + [0.0] * 5 + [1.0] + [0.0] * 9
    batch = scored_batch(answer, [False] * 30, 10)
    keep = slim_method().keep_groups(batch)
    assert keep.tolist() == [False] * 10 + [True] * 10 + [False] * 10
    assert slim_method(accuracy_band=(0.0, 1.0)).keep_groups(batch).all()
    assert slim_method(accuracy_band=(0.9, 0.9)).keep_groups(batch).tolist() == [True] * 10 + [False] * 20
    with pytest.raises(ValueError, match="accuracy_band"):
        slim_method(accuracy_band=(0.8, 0.2))


def test_length_limit_rule_by_hand():
    # one group of 5, all right; answers 0 and 3 ran out of tokens: they score 0 on every atom,
    # so the group's accuracy is 3/5 = 0.6 (kept) instead of 1.0 (dropped)
    batch = scored_batch([1.0] * 5, [True, False, False, True, False], 5)
    method = slim_method()
    assert method.keep_groups(batch).all()
    assert batch.scores.values.tolist() == [[0, 0], [1, 1], [1, 1], [0, 0], [1, 1]]
    assert batch.rewards.tolist() == [0, 2, 2, 0, 2]
    # Dr.GRPO: A = r - group mean (1.2), no std
    assert method.advantages(batch).tolist() == pytest.approx([-1.2, 0.8, 0.8, -1.2, 0.8])
    assert method.batch_metrics(batch) == {"slim/rows": 15.0, "slim/truncated": 2.0}
    off = scored_batch([1.0] * 5, [True, False, False, True, False], 5)
    assert not slim_method(length_limit_wrong=False).keep_groups(off).any()  # accuracy 1.0
    assert truncated(torch.tensor([[5, 6, EOS], [5, 6, 7], [EOS, 4, 4]]), EOS).tolist() == [False, True, False]


def test_other_strategy_warns_and_unknown_atom_fails():
    run = SimpleNamespace(task=SimpleNamespace(type="arith"), rollout=SimpleNamespace(strategy="low_confidence"))
    with pytest.warns(UserWarning, match="tau_budget"):
        SLIMRL(SLIMRLConfig(), run, reward=None)
    batch = scored_batch([1.0] * 2, [False] * 2, 2)
    batch.scores.names = ["format", "correct"]
    with pytest.raises(ValueError, match="'answer'"):
        slim_method().keep_groups(batch)


# --------------------------------------------------------------------------- one training step


def test_one_trainer_step_of_the_config(tiny_dllm, tmp_path, reward_spread):
    # The random tiny model answers nothing right and rarely ends early: widen the band and
    # switch the length rule off so that reward_spread's 0, 1, 0, 1 rewards reach the update.
    overrides = [f"model.path={tiny_dllm}", f"output_dir={tmp_path / 'run'}", "rollout.prompts_per_step=2",
                 "rollout.num_generations=4", "task.num_train=50", "task.num_eval=8", "rollout.eval_batch_size=32",
                 "logging.tensorboard=false", "logging.progress=false", "train.max_steps=1", "optim.lr=1e-2",
                 "method.accuracy_band=[0.0, 1.0]", "method.length_limit_wrong=false"]
    cfg = load_config(DLLMTrainConfig, CONFIG, overrides, defaults=backend.DEFAULT_CONFIG)
    assert cfg.method.type == "slim_rl" and cfg.rollout.strategy == "tau_budget" and cfg.train.ppo_epochs == 1
    policy, task = backend.build(cfg)
    before = {k: v.detach().clone() for k, v in policy.model.named_parameters() if v.requires_grad}
    summary = Trainer(cfg, policy, task, output_dir=tmp_path / "out").train()
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["train/updates"] == 1
    assert math.isfinite(rows[0]["loss/total"]) and rows[0]["reward/advantage_abs"] == pytest.approx(0.5)
    assert rows[0]["slim/rows"] == 8 * 3 and "rollout/expected_wrong" in rows[0] and "slim/truncated" in rows[0]
    unchanged = [k for k, v in policy.model.named_parameters() if v.requires_grad and torch.equal(v, before[k])]
    assert not unchanged, unchanged
    assert summary["steps"] == 1


# --------------------------------------------------------------------------- edges, clips and KL terms by hand


def test_block_mask_rates_domain_edges_and_zero_spread():
    """t must lie strictly inside (0, 1) and max_spread in [0, 1) (the docstring's domain);
    max_spread 0 is the flat schedule [t] * B; and a level so small that 2t - 1e-6 < 0 gets
    spread 0 (s is floored at 0: a negative s would make the schedule increase and put the
    first block's rate t + s/2 below 0)."""
    with pytest.raises(ValueError, match="masking level"):
        block_mask_rates(0.0, 2, 0.2)
    with pytest.raises(ValueError, match="max_spread"):
        block_mask_rates(0.5, 2, 1.0)
    assert block_mask_rates(0.5, 3, 0.0).tolist() == [0.5, 0.5, 0.5]
    assert block_mask_rates(1e-7, 3, 0.2).tolist() == [1e-7] * 3  # 2e-7 - 1e-6 < 0 -> s = 0


def test_masks_reject_an_answer_with_no_valid_position():
    """draw_masks needs every answer to have a trainable position; one empty answer among valid
    ones is an error (not silently masked at an invalid position by the fallback)."""
    valid = torch.tensor([[True, False], [False, False]])
    rates = torch.full((1, 2), 0.5, dtype=torch.float64)
    with pytest.raises(ValueError, match="at least one trainable position"):
        draw_masks(valid, rates, 1, torch.Generator().manual_seed(0))


def test_row_logprobs_equal_a_brute_force_recomputation(make_run):
    """Row (i, q)'s log-prob at a masked position c is log_softmax(logits / T)[o_c], the logits
    being the model's at P + c for answer i's prompt and its answer with row q's mask applied,
    one row at a time: pins the batched [N*Q] forward's row order (prompt and answer of row
    i*Q + q both belong to answer i) and the answer columns' alignment."""
    cfg, policy, task = make_run(*SLIM, score_old=True)
    batch = rollout(policy, task, cfg)
    mask, old, comp = batch.data["slim/mask"], batch.data["slim/old_logp"], batch.data["completion"]
    P, T, M = policy.prompt_length, cfg.rollout.temperature, policy.predictor.mask_token_id
    assert not torch.equal(batch.data["prompt_ids"][0], batch.data["prompt_ids"][-1])  # two prompts
    with torch.no_grad():
        for i in range(len(batch)):
            for q in range(mask.shape[1]):
                x = torch.cat([batch.data["prompt_ids"][i], torch.where(mask[i, q], M, comp[i])])[None]
                logits = policy.logits(x, batch.data["prompt_valid"][i:i + 1])[0, P:].double()
                brute = torch.log_softmax(logits / T, -1).gather(1, comp[i][:, None])[:, 0]
                m = mask[i, q]
                assert torch.allclose(old[i, q][m].double(), brute[m], atol=1e-5), (i, q)


def test_sequence_ratio_low_clip_and_kl_term_by_hand():
    """A < 0 with s < 1 - eps takes the lower clip bound (min(-s, -0.9) = -0.9), and the k3 KL
    term is exp(-d) + d - 1 per masked token, summed within each row / the answer length C = 2,
    weighted by w_q, summed over rows / rows and added as + beta * KL (SLIM-RL's code)."""
    w = torch.tensor([0.5, 0.5])
    mask = torch.tensor([[[True, True], [True, False]]])  # N = 1, Q = 2, C = 2
    old = torch.zeros(1, 2, 2)
    d = torch.tensor([[[-0.2, -0.4], [0.1, 5.0]]])  # row 0: l = -0.3, s = 0.741; row 1: l = 0.1, s = 1.105
    out = slim_loss(old + d, old, mask, torch.tensor([-1.0]), w, clip=0.1, max_log_ratio=10.0, beta=0.5)
    # A = -1: row 0 min(-0.741, -0.9) = -0.9 (lower bound); row 1 min(-1.105, -1.1) = -1.105
    policy = -(0.5 * -0.9 + 0.5 * -math.exp(0.1)) / 2

    def k3(x):
        return math.exp(-x) + x - 1

    kl = (0.5 * (k3(-0.2) + k3(-0.4)) / 2 + 0.5 * k3(0.1) / 2) / 2
    assert out.metrics["loss/kl"] == pytest.approx(kl, abs=1e-6)
    assert float(out.loss) == pytest.approx(policy + 0.5 * kl, abs=1e-6)
    with pytest.raises(ValueError, match="advantages must be"):  # one A per answer, not per row
        slim_loss(old + d, old, mask, torch.tensor([-1.0, 1.0]), w, clip=0.1, max_log_ratio=10.0, beta=0.5)


def test_the_kl_description_says_a_single_pass_makes_it_zero():
    """method.kl.beta of SLIM-RL's config (0.01, train.ppo_epochs 1) weighs a KL to the
    pre-update policy that is exactly 0 in a batch's only pass (the loss by hand above: 0 at the
    first pass); its description said nothing of it, so `config --keys method` read as a live KL."""
    from dllm_rl.config import KLOldConfig

    said = " ".join(KLOldConfig.model_fields["beta"].description.split())
    assert "train.ppo_epochs 1 and train.mini_batches 1" in said and "exactly 0" in said


@pytest.mark.parametrize("method", ["diffu_grpo", "tracerl", "slim_rl"])
def test_a_kl_beta_that_a_single_pass_makes_zero_is_said(method):
    """A dLLM method's KL is to the pre-update policy: with one pass over one mini-batch (sync) it
    and its gradient are 0 whatever beta, so a beta sweep trained alike without a word."""
    import warnings

    from dllm_rl.config import DLLMTrainConfig
    from mmrl.core.config import load_config

    run = [f"method.type={method}", "rollout.strategy=tau_budget", "train.ppo_epochs=1"]
    with pytest.warns(UserWarning, match=r"method.kl.beta 0.2 weighs a KL to the pre-update policy, which is 0 with "
                                         r"train.ppo_epochs 1 and train.mini_batches 1"):
        load_config(DLLMTrainConfig, None, [*run, "method.kl.beta=0.2"])
    with warnings.catch_warnings():  # a second pass or mini-batch reads it; the method's own beta, or 0, is quiet
        warnings.simplefilter("error")
        load_config(DLLMTrainConfig, None, [*run, "method.kl.beta=0.2", "train.ppo_epochs=2"])
        load_config(DLLMTrainConfig, None, [*run, "method.kl.beta=0.2", "train.mini_batches=2"])
        load_config(DLLMTrainConfig, None, run)
        load_config(DLLMTrainConfig, None, [*run, "method.kl.beta=0"])


def test_max_spread_with_one_decoding_block_is_said_to_be_unused():
    """With gen_length = block_length the schedule has one block, masked at t itself
    (block_mask_rates(t, 1, ...) = [t]): a max_spread sweep trained alike without a word."""
    import warnings

    from dllm_rl.config import DLLMTrainConfig
    from mmrl.core.config import load_config

    slim = ["method.type=slim_rl", "rollout.strategy=tau_budget", "rollout.gen_length=8", "rollout.steps=8"]
    with pytest.warns(UserWarning, match=r"method.max_spread 0.5 is unused with one decoding block \(rollout.gen_length "
                                         r"= block_length = 8\)"):
        load_config(DLLMTrainConfig, None, [*slim, "rollout.block_length=8", "method.max_spread=0.5"])
    assert block_mask_rates(0.3, 1, 0.5).tolist() == [0.3]
    with warnings.catch_warnings():  # two blocks read it; one block at the default says nothing
        warnings.simplefilter("error")
        load_config(DLLMTrainConfig, None, [*slim, "rollout.block_length=4", "method.max_spread=0.5"])
        load_config(DLLMTrainConfig, None, [*slim, "rollout.block_length=8"])
