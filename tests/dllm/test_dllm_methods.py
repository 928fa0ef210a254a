"""The dLLM policy and its two methods on a tiny real mask predictor (dllm_rl.tiny, loaded
through from_pretrained): the rollout batch, diffu-GRPO's mean-field estimator and TraceRL's
trajectory rows (the ratio exactly 1 on-policy, the KL 0 at the first pass), one Trainer
step per method that changes every trainable weight, pass@k by hand, and bad configs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dllm_rl import backend
from dllm_rl.config import DLLMTrainConfig, TraceRLConfig
from dllm_rl.logprob import token_logprobs, trace_rows
from dllm_rl.methods.common import ESTIMATORS, scatter_rows
from dllm_rl.methods.diffu_grpo import DiffuGRPO, MeanField
from dllm_rl.methods.tracerl import TraceRL
from dllm_rl.task import pass_at_k
from dllm_rl.tiny import CHARSET, build_tiny_dllm
from mmrl.core.batch import RolloutBatch
from mmrl.core.config import ConfigError, load_config
from mmrl.core.rewards import AtomScores, Sample
from mmrl.core.trainer import Trainer

PAD, MASK, EOS = 0, 1, 2  # the tiny tokenizer's special ids; CHARSET[i] has id i + 3
TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64}  # as conftest.py
BLOCKS = ["rollout.gen_length=8", "rollout.block_length=4", "rollout.steps=8"]


def chars(ids) -> str:
    """Hand decoding of the tiny character vocabulary (special tokens dropped)."""
    return "".join(CHARSET[t - 3] for t in ids if t >= 3)


def bias_eos(policy, amount: float = 4.0) -> None:
    """Raise the <eos> logit everywhere (rollout and log-probs alike), so a random model ends
    some answers early: p(eos) ~ e^4 / (e^4 + 52) ~ 0.5."""
    logits = policy.logits

    def biased(x, valid):
        out = logits(x, valid).clone()
        out[..., EOS] += amount
        return out

    policy.logits = biased


def rollout(policy, task, cfg, seed: int = 0) -> RolloutBatch:
    return policy.generate(task.train[:2], 4, cfg.rollout, torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- the rollout batch


def test_completion_mask_and_answer_text_by_hand(make_run):
    _, policy, _ = make_run()
    completion = torch.tensor([[5, EOS, 7, EOS],   # "2" then <eos>; the filler after it is not trained
                               [5, 6, 7, 8],       # no <eos>: all four train
                               [EOS, 4, 4, 4]])    # empty answer: only the <eos> trains
    assert policy.completion_mask(completion).tolist() == [[True, True, False, False],
                                                           [True, True, True, True],
                                                           [True, False, False, False]]
    assert policy.answer_text(completion) == ["2", "2345", ""]


def test_stop_at_eos_gives_the_same_greedy_answers_with_fewer_nfe(make_run):
    """rollout.stop_at_eos: an answer stops at its <eos>; greedy decoding draws nothing at
    random, so every answer is the one the whole decode gives, for fewer NFE."""
    _, policy, task = make_run(*BLOCKS)
    bias_eos(policy, 2.0)
    texts = [p.prompt for p in task.eval_problems[:8]]
    for strategy in ("low_confidence", "ar"):
        full, _ = policy.decode(texts, None, temperature=0.0, strategy=strategy)
        policy.rollout.stop_at_eos = True
        cut, _ = policy.decode(texts, None, temperature=0.0, strategy=strategy)
        policy.rollout.stop_at_eos = False
        assert policy.answer_text(cut.completion) == policy.answer_text(full.completion)
        assert (cut.nfe <= full.nfe).all() and (cut.nfe < full.nfe).any()


def test_decoded_tokens_count_the_positions_decoded(make_run):
    """rollout/decoded_tokens (the core reads stat/length): every position of every answer,
    fewer where answers stop at their <eos>."""
    from mmrl.core.scheduler import decoded_tokens

    cfg, policy, task = make_run()
    bias_eos(policy, 2.0)
    full = decoded_tokens(rollout(policy, task, cfg))
    policy.rollout.stop_at_eos = True
    cut = decoded_tokens(rollout(policy, task, cfg))
    policy.rollout.stop_at_eos = False
    assert full == 8 * 8 and 0 < cut < full


def test_generate_batch_layout(make_run):
    cfg, policy, task = make_run()
    bias_eos(policy)
    batch = rollout(policy, task, cfg)
    n, c, p, mu = 8, 8, policy.prompt_length, cfg.train.ppo_epochs
    assert batch.mask.shape == batch.old_logp.shape == (n, c) and batch.mask.dtype == torch.bool
    assert batch.group_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    d = batch.data
    assert {"prompt_ids", "prompt_valid", "completion", "commit_step", "commit_logp", "fallback", "active",
            "stat/nfe", "mask_seed", "old_logp_mu"} <= set(d)
    assert d["prompt_ids"].shape == d["prompt_valid"].shape == (n, p)
    assert d["completion"].shape == d["commit_step"].shape == d["commit_logp"].shape == (n, c)
    assert d["mask_seed"].shape == (n, mu) and d["old_logp_mu"].shape == (n, mu, c)
    # every answer token was committed at one of the 8 steps, block 0 (4 steps) before block 1
    cs = d["commit_step"]
    assert ((cs >= 0) & (cs < 8)).all() and (cs[:, :4].amax(1) < cs[:, 4:].amin(1)).all()
    assert (d["stat/nfe"] == 8).all()  # low_confidence: 4 steps per block, one token each
    assert (d["stat/length"] == c).all()  # every position decoded: rollout/decoded_tokens counts them
    # prompts: left padded, padding invalid, the valid tail is the prompt's characters
    for i, s in enumerate(batch.samples):
        problem = task.train[i // 4]
        assert s.prompt == problem.prompt and s.meta["answer"] == problem.answer
        row, valid = d["prompt_ids"][i], d["prompt_valid"][i]
        assert chars(row[valid].tolist()) == problem.prompt and (row[~valid] == PAD).all()
        assert valid.long().diff().ge(0).all()  # padding on the left only
    # the mask covers everything up to and including the first <eos>; the text stops before it
    ends = 0
    for i, row in enumerate(d["completion"].tolist()):
        cut = row.index(EOS) if EOS in row else c
        ends += cut < c - 1
        assert batch.mask[i].tolist() == [j <= cut for j in range(c)]
        assert batch.samples[i].completion == chars(row[:cut])
    assert ends >= 2  # the <eos> bias ended some answers early, so the rule was exercised


def test_same_seed_same_batch(make_run):
    cfg, policy, task = make_run()
    a, b, other = rollout(policy, task, cfg, 0), rollout(policy, task, cfg, 0), rollout(policy, task, cfg, 1)
    assert torch.equal(a.old_logp, b.old_logp) and torch.equal(a.mask, b.mask)
    for k in a.data:
        assert torch.equal(a.data[k], b.data[k]), k
    assert [s.completion for s in a.samples] == [s.completion for s in b.samples]
    assert not torch.equal(a.data["completion"], other.data["completion"])


# --------------------------------------------------------------------------- diffu-GRPO


def test_diffu_grpo_ratio_is_exactly_one_on_policy_and_kl_zero(make_run):
    cfg, policy, task = make_run("train.ppo_epochs=2", "method.kl.beta=0.04")
    batch = rollout(policy, task, cfg)
    old = batch.data["old_logp_mu"]  # [N, mu, C], under the rollout's weights
    assert torch.equal(batch.old_logp, old[:, 0])
    with torch.no_grad():
        for k in range(2):
            assert torch.allclose(policy.logprobs(batch, iteration=k), old[:, k], atol=1e-5)
        assert not torch.allclose(old[:, 0], old[:, 1])  # two prompt masks, two estimates
    method = DiffuGRPO(cfg.method, cfg, task.reward)
    adv = torch.tensor([1.0, 1, 1, 1, 1, 1, 1, -1])
    for epoch in range(2):  # each pass reads the old log-probs of its own mask
        method.epoch = epoch
        out = method.loss(policy, batch, adv)
        m = out.metrics
        assert m["loss/ratio_min"] == pytest.approx(1, abs=1e-5) and m["loss/ratio_max"] == pytest.approx(1, abs=1e-5)
        assert m["loss/kl"] == pytest.approx(0, abs=1e-8) and m["loss/clip_frac"] == 0
        # ratio 1: the surrogate is -A averaged over answer tokens: all 8 tokens of each row
        # train here (no <eos>), so -(7 - 1) * 8 / 64 = -0.75
        assert batch.mask.all()
        assert float(out.loss.detach()) == pytest.approx(-0.75, abs=1e-5)


def test_diffu_grpo_prompt_mask_per_row_seed(make_run):
    cfg, policy, task = make_run("train.ppo_epochs=3", "method.p_mask_prompt=0.5")
    batch = rollout(policy, task, cfg)
    est, p = policy.estimator, policy.prompt_length
    valid, prompt = batch.data["prompt_valid"], batch.data["prompt_ids"]
    assert (~valid).any()  # some prompts are padded, so "never mask padding" is exercised
    sub_rows = [5, 2, 7]
    sub = batch.select(sub_rows)
    xs = []
    for k in range(3):
        x = est.masked_input(policy, batch, k)  # [N, P + C]
        assert torch.equal(est.masked_input(policy, sub, k), x[sub_rows])  # depends only on the row's seed
        assert torch.equal(est.masked_input(policy, batch, k + 3), x)  # iteration k and k + mu share it
        assert (x[:, p:] == MASK).all()  # the answer fully masked
        assert torch.equal(x[:, :p][~valid], prompt[~valid])  # padding never masked
        hidden = x[:, :p] == MASK
        assert torch.equal(x[:, :p][~hidden], prompt[~hidden])  # the rest of the prompt is kept
        assert hidden.any()
        xs.append(x)
    assert not torch.equal(xs[0], xs[1]) and not torch.equal(xs[1], xs[2])  # a new mask per iteration


@pytest.mark.parametrize("logprob_temperature", [None, 1.0])
def test_diffu_grpo_logprob_temperature(make_run, logprob_temperature):
    """The log-probs score the mean-field logits at logprob_temperature, or at the rollout's
    temperature when it is unset (d1's code samples at 0.9 and scores at 1.0)."""
    sets = ["rollout.temperature=0.5"] + ([f"method.logprob_temperature={logprob_temperature}"]
                                          if logprob_temperature else [])
    cfg, policy, task = make_run(*sets)
    batch = rollout(policy, task, cfg)
    with torch.no_grad():
        x = policy.estimator.masked_input(policy, batch, 0)
        logits = policy.logits(x, batch.data["prompt_valid"])[:, policy.prompt_length:]
    by_t = {t: token_logprobs(logits, batch.data["completion"], t) for t in (0.5, 1.0)}
    expected, other = (by_t[1.0], by_t[0.5]) if logprob_temperature else (by_t[0.5], by_t[1.0])
    assert torch.allclose(batch.data["old_logp_mu"][:, 0], expected, atol=1e-5)
    assert not torch.allclose(expected, other, atol=1e-3)


@pytest.mark.parametrize("logprob_temperature", [None, 1.0])
def test_tracerl_logprob_temperature(make_run, monkeypatch, logprob_temperature):
    """TraceRL's rows are scored at method.logprob_temperature, or at the rollout's temperature
    when it is unset (dLLM-RL's code samples at its rollout temperature and scores at 1.0)."""
    from dllm_rl.methods import tracerl

    sets = ["method.type=tracerl", "rollout.temperature=0.5"] + (
        [f"method.logprob_temperature={logprob_temperature}"] if logprob_temperature else [])
    cfg, policy, task = make_run(*sets)
    used = []
    real = tracerl.token_logprobs
    monkeypatch.setattr(tracerl, "token_logprobs", lambda *a, **k: used.append(a[2]) or real(*a, **k))
    batch = rollout(policy, task, cfg)
    with torch.no_grad():
        policy.estimator.logprobs(policy, batch, 0)
    assert used and set(used) == {logprob_temperature or 0.5}


def mean_field_batch(p: float, mu: int = 1, n: int = 500):
    """MeanField at p_mask_prompt = p and mu passes, and a hand-made batch (no model): n rows of 8
    prompt tokens, the first 2 padding, and 4 answer tokens."""
    run = SimpleNamespace(method=SimpleNamespace(p_mask_prompt=p, logprob_temperature=None),
                          train=SimpleNamespace(ppo_epochs=mu))
    prompt = torch.randint(3, 53, (n, 8), generator=torch.Generator().manual_seed(0))
    valid = torch.ones(n, 8, dtype=torch.bool)
    valid[:, :2] = False
    batch = RolloutBatch(group_ids=torch.zeros(n, dtype=torch.long), samples=[None] * n,
                         data={"prompt_ids": prompt, "prompt_valid": valid, "completion": torch.full((n, 4), 5)})
    return MeanField(run), batch


@pytest.mark.parametrize("p", [0.15, 0.4])
def test_mean_field_masks_prompt_tokens_at_rate_p(p):
    """500 rows x 6 valid prompt tokens at method.p_mask_prompt = p: the masked share is within
    4 sigma = 4 sqrt(p (1 - p) / 3000) of p (0.026 at p = 0.15, 0.036 at 0.4)."""
    est, batch = mean_field_batch(p)
    batch.data["mask_seed"] = torch.arange(len(batch))[:, None] * 7919
    policy = SimpleNamespace(predictor=SimpleNamespace(mask_token_id=MASK))
    x = est.masked_input(policy, batch, 0)
    prompt = batch.data["prompt_ids"]
    assert (x[:, :2] == prompt[:, :2]).all()
    assert float((x[:, 2:8] == MASK).float().mean()) == pytest.approx(p, abs=4 * math.sqrt(p * (1 - p) / 3000))


def test_mean_field_draws_a_distinct_prompt_mask_seed_per_row_and_pass():
    """prepare draws one seed per row and pass from the rollout generator (the same generator
    state, the same seeds); with the old pass skipped it scores nothing. The masks those seeds
    give hide the prompt at rate p over the whole batch."""
    est, batch = mean_field_batch(0.15, mu=3)
    est.on_policy = True  # no old pass: prepare only draws the seeds
    est.prepare(None, batch, torch.Generator().manual_seed(0))
    seeds = batch.data["mask_seed"]
    assert seeds.shape == (500, 3) and len(set(seeds.flatten().tolist())) == 1500
    assert "old_logp_mu" not in batch.data
    again, other = mean_field_batch(0.15, mu=3)
    again.on_policy = True
    again.prepare(None, other, torch.Generator().manual_seed(0))
    assert torch.equal(other.data["mask_seed"], seeds)
    policy = SimpleNamespace(predictor=SimpleNamespace(mask_token_id=MASK))
    hidden = torch.stack([est.masked_input(policy, batch, k)[:, 2:8] == MASK for k in range(3)])  # [mu, N, 6]
    assert float(hidden.float().mean()) == pytest.approx(0.15, abs=4 * math.sqrt(0.15 * 0.85 / 9000))
    assert len({tuple(row) for row in hidden[0].tolist()}) > 20  # rows do not share one mask


# --------------------------------------------------------------------------- TraceRL


def test_tracerl_ratio_is_exactly_one_on_policy_and_kl_zero(make_run):
    cfg, policy, task = make_run("method.type=tracerl", "method.merge_steps=2", "method.kl.beta=0.01",
                                 score_old=True)
    bias_eos(policy)
    batch = rollout(policy, task, cfg)
    with torch.no_grad():
        assert torch.allclose(policy.logprobs(batch), batch.old_logp, atol=1e-5)
    assert (batch.old_logp[~batch.mask] == 0).all()  # the <eos> filler gets no log-prob
    method = TraceRL(cfg.method, cfg, task.reward)
    adv = torch.linspace(-1, 1, 8)
    for epoch in range(2):  # TraceRL's old log-probs do not depend on the pass
        method.epoch = epoch
        m = method.loss(policy, batch, adv).metrics
        assert m["loss/ratio_min"] == pytest.approx(1, abs=1e-5) and m["loss/ratio_max"] == pytest.approx(1, abs=1e-5)
        assert m["loss/kl"] == pytest.approx(0, abs=1e-8)


@pytest.mark.parametrize("s", [1, 3])
def test_tracerl_rows_cover_each_answer_token_once(make_run, s):
    # steps 4: 2 per block of 4, so low_confidence commits 2 tokens per step: K = 4 steps
    cfg, policy, task = make_run("method.type=tracerl", f"method.merge_steps={s}", "rollout.steps=4")
    bias_eos(policy)
    batch = rollout(policy, task, cfg)
    cs = batch.data["commit_step"]
    rows = trace_rows(cs, s=s)
    target = rows.target & batch.mask[rows.sample]  # what Trace.logprobs trains
    hits = torch.zeros_like(cs).index_add_(0, rows.sample, target.long())  # [N, C]
    assert torch.equal(hits, batch.mask.long())  # every answer token from exactly one row
    assert (~batch.mask).any()  # and the filler after <eos> from none
    for i in range(len(batch)):
        k = len(set(cs[i].tolist()))
        assert k == 4
        assert int((rows.sample == i).sum()) <= math.ceil(k / s)  # s=1: 4 rows, s=3: 2 rows
    # a row's input hides exactly the tokens committed at or after its first step
    for r in range(len(rows.sample)):
        i = int(rows.sample[r])
        assert torch.equal(rows.input_masked[r], cs[i] >= rows.step[r])


def test_tracerl_runs_no_row_that_commits_only_filler(make_run):
    """A row whose steps committed only the filler after <eos> has no target: the estimator
    runs no forward pass for it, and every answer token gets the log-prob it has when all the
    rows run."""
    cfg, policy, task = make_run("method.type=tracerl", "method.merge_steps=1", *BLOCKS)
    bias_eos(policy, 2.0)
    batch = rollout(policy, task, cfg)
    rows = trace_rows(batch.data["commit_step"], s=1)
    target = rows.target & batch.mask[rows.sample]
    trained = int(target.any(-1).sum())
    assert 0 < trained < len(rows.sample)  # some rows commit filler alone: the check is not vacuous
    completion = batch.data["completion"][rows.sample]
    x = torch.cat([batch.data["prompt_ids"][rows.sample],
                   completion.masked_fill(rows.input_masked, policy.predictor.mask_token_id)], 1)
    with torch.no_grad():
        logits = policy.logits(x, batch.data["prompt_valid"][rows.sample])[:, policy.prompt_length:]
    every_row = scatter_rows(token_logprobs(logits, completion, cfg.rollout.temperature), rows.sample, target,
                             len(batch))
    policy.step_costs()
    got = ESTIMATORS["tracerl"](cfg).logprobs(policy, batch, 0)
    assert policy.step_costs()["cost/train_rows"] == trained
    torch.testing.assert_close(got.detach(), every_row, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_tracerl_s1_logprob_is_the_rollout_commit_logprob(make_run, temperature):
    """With s = 1 a row's input is exactly the state at which its tokens were drawn, and both
    the sampler and the estimator score them under log_softmax(logits / T)."""
    cfg, policy, task = make_run("method.type=tracerl", "method.merge_steps=1", "rollout.steps=4",
                                 f"rollout.temperature={temperature}", score_old=True)
    bias_eos(policy)
    batch = rollout(policy, task, cfg)
    commit = batch.data["commit_logp"]
    assert (commit[batch.mask] < 0).all()
    assert torch.allclose(batch.old_logp[batch.mask], commit[batch.mask], atol=1e-4)


def test_tracerl_merged_rows_differ_from_commit_logprob(make_run):
    """s = 2 conditions the second step of a group on less context than the sampler had, so
    its estimate is not the commit log-prob (the check above is not vacuous)."""
    cfg, policy, task = make_run("method.type=tracerl", "method.merge_steps=2", score_old=True)
    batch = rollout(policy, task, cfg)
    assert not torch.allclose(batch.old_logp[batch.mask], batch.data["commit_logp"][batch.mask], atol=1e-4)


def test_tracerl_accuracy_band_as_dllm_rl_code():
    """dLLM-RL's code drops groups whose accuracy lies outside [0.2, 0.8]; without a band
    TraceRL drops only the groups whose rewards are all equal."""
    # groups of 5 with 5, 3, 1, 0 right answers (accuracy 1.0, 0.6, 0.2, 0.0)
    answer = [1.0] * 5 + [1.0] * 3 + [0.0] * 2 + [1.0] + [0.0] * 4 + [0.0] * 5
    values = torch.tensor([[1.0, a] for a in answer])  # atoms: format, answer
    batch = RolloutBatch(group_ids=torch.arange(20) // 5, samples=[Sample("p", "c")] * 20,
                         scores=AtomScores(["format", "answer"], values, values.sum(1)))
    run = SimpleNamespace(task=SimpleNamespace(type="arith"))
    banded = TraceRL(TraceRLConfig(accuracy_band=(0.2, 0.8)), run, reward=None)
    assert banded.keep_groups(batch).tolist() == [False] * 5 + [True] * 10 + [False] * 5
    default = TraceRL(TraceRLConfig(dynamic_sampling={"enabled": True}), run, reward=None)  # zero variance
    assert default.keep_groups(batch).tolist() == [False] * 5 + [True] * 10 + [False] * 5
    values[15:, 0] = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0])  # all wrong, rewards differ
    batch.scores = AtomScores(["format", "answer"], values, values.sum(1))
    assert default.keep_groups(batch)[15:].all() and not banded.keep_groups(batch)[15:].any()
    with pytest.raises(ValueError, match="accuracy_band"):
        TraceRL(TraceRLConfig(accuracy_band=(0.8, 0.2)), run, reward=None)
    sudoku = SimpleNamespace(task=SimpleNamespace(type="sudoku"))  # counts "solved", absent here
    with pytest.raises(ValueError, match="'solved'"):
        TraceRL(TraceRLConfig(accuracy_band=(0.2, 0.8)), sudoku, reward=None).keep_groups(batch)


# --------------------------------------------------------------------------- one training step


@pytest.mark.parametrize("method", ["diffu_grpo", "tracerl"])
def test_one_trainer_step_changes_every_trainable_weight(make_run, tmp_path, reward_spread, method):
    cfg, policy, task = make_run(f"method.type={method}", "train.max_steps=1", "train.ppo_epochs=2",
                                 "optim.lr=1e-2", "method.dynamic_sampling.enabled=false",
                                 "method.scale=group")  # z-scores: mean |A| near 0.8 when rewards differ
    before = {k: v.detach().clone() for k, v in policy.model.named_parameters() if v.requires_grad}
    summary = Trainer(cfg, policy, task, output_dir=tmp_path / "out").train()
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["train/updates"] == 2  # ppo_epochs x mini_batches
    assert math.isfinite(rows[0]["loss/total"]) and rows[0]["reward/advantage_abs"] > 0.5
    unchanged = [k for k, v in policy.model.named_parameters() if v.requires_grad and torch.equal(v, before[k])]
    assert not unchanged, unchanged
    assert {"accuracy", "nfe", "reward"} <= set(summary["eval_after"]) and summary["steps"] == 1


# --------------------------------------------------------------------------- pass@k


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # 1 - C(3,1)/C(4,1) = 1 - 3/4
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # n - c = 1 < k: every pair holds a correct one
    assert pass_at_k(4, 4, 4) == 1.0
    with pytest.raises(ValueError, match="pass@5 needs at least 5 samples, got 4"):
        pass_at_k(4, 1, 5)


# --------------------------------------------------------------------------- bad configs


def _config(*overrides):
    return load_config(DLLMTrainConfig, None, list(overrides), defaults=backend.DEFAULT_CONFIG)


def test_blocks_must_divide_the_answer_and_the_steps():
    with pytest.raises(ConfigError, match=r"gen_length \(10\) must be divisible by block_length \(4\)"):
        _config("rollout.gen_length=10", "rollout.block_length=4", "rollout.steps=8")
    # 8 / 2 = 4 blocks; 6 steps do not split into 4
    with pytest.raises(ConfigError, match=r"steps \(6\) must be divisible by the number of blocks .*= 4\)"):
        _config("rollout.gen_length=8", "rollout.block_length=2", "rollout.steps=6")


def test_prompt_longer_than_the_context_fails_at_build(tmp_path, monkeypatch):
    short = build_tiny_dllm(tmp_path / "short", kind="llada", seed=0, max_position_embeddings=16, **TINY)

    def no_rollout(*a, **kw):
        raise AssertionError("decoded before the config was checked")

    monkeypatch.setattr("dllm_rl.policy.decode", no_rollout)
    cfg = _config(f"model.path={short}", "task.type=sudoku", "task.num_train=4", "task.num_eval=2", *BLOCKS)
    # a sudoku prompt "1204|0012|2100|4320=" is 20 tokens; + 8 answer tokens > 16 positions
    with pytest.raises(ConfigError, match=r"rollout.gen_length / task: .*20 tokens plus gen_length 8 .*16 positions"):
        backend.build(cfg)


def test_answers_longer_than_gen_length_fail_at_build(tiny_dllm):
    """sudoku's grids (19 characters and an <eos>) at arith's 8 positions: no rollout could be
    right, so the config is refused before any decoding, counting the answers (every grid is as long)
    and naming the length needed."""
    cfg = _config(f"model.path={tiny_dllm}", "task.type=sudoku", "task.num_train=4", "task.num_eval=2", *BLOCKS)
    with pytest.raises(ConfigError, match=r"rollout.gen_length \(8\) cannot hold the task's answers: [2-6] references "
                                          r"\('[1-4|]{19}', '[1-4|]{19}'.*\) are 19 tokens, 20 with their <eos>. "
                                          r"Set rollout.gen_length to at least 20"):
        backend.build(cfg)
    backend.build(_config(f"model.path={tiny_dllm}", "task.type=sudoku", "task.num_train=4", "task.num_eval=2",
                          "rollout.gen_length=20", "rollout.block_length=4", "rollout.steps=20"))


def test_mask_token_outside_the_vocabulary_is_a_config_error(tiny_dllm):
    # 53 tokens: ids 0..52, so 53 is the first id outside
    with pytest.raises(ConfigError, match=r"mask_token_id 53 is not in the model's vocabulary"):
        backend.build(_config(f"model.path={tiny_dllm}", "model.mask_token_id=53", *BLOCKS))


def run_of_method(name: str) -> SimpleNamespace:
    """diffu-GRPO's run config with method.type `name` (a method the test registers)."""
    cfg = load_config(DLLMTrainConfig, overrides=["method.type=diffu_grpo"])
    return SimpleNamespace(**{**dict(cfg), "method": SimpleNamespace(**{**dict(cfg.method), "type": name})})


def test_a_registered_subclass_takes_its_base_methods_estimator(monkeypatch):
    """A researcher's method built on diffu-GRPO needs no estimator of its own; a method with
    no registered base is told how to register one (it was a bare KeyError)."""
    from dllm_rl.methods.common import estimator_for
    from mmrl.core.method import METHODS, Method

    class DiffuPos(DiffuGRPO):
        pass

    class Fresh(Method):
        pass

    monkeypatch.setitem(METHODS, "diffu_pos", DiffuPos)
    monkeypatch.setitem(METHODS, "fresh", Fresh)
    run = run_of_method("diffu_pos")
    assert isinstance(estimator_for(run), MeanField)
    run.method.type = "fresh"
    with pytest.raises(ValueError, match=r"'fresh' has no log-prob estimator: register one with .*ESTIMATORS\['fresh'\]"):
        estimator_for(run)


def test_a_relative_model_path_in_a_config_file_is_read_from_the_files_folder(tmp_path, monkeypatch):
    """As every other path a config names: the config file's folder, else the working
    directory, else the repository ("assets/..." from anywhere)."""
    from mmrl.core.runconfig import resolve_dir

    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "models").mkdir()
    (conf / "models" / "mine").symlink_to(backend.bundled_model_dir(), target_is_directory=True)
    (conf / "run.yaml").write_text("model: {path: models/mine}\n")
    monkeypatch.chdir(tmp_path)  # the path does not exist from here
    cfg = load_config(DLLMTrainConfig, conf / "run.yaml", overrides=["method.type=diffu_grpo"])
    policy, _task = backend.build(cfg)
    assert policy.model is not None
    assert resolve_dir("models/mine", conf) == conf / "models" / "mine"
    assert resolve_dir("assets/tiny-dllm") == backend.bundled_model_dir()  # from the repository
    assert resolve_dir("nowhere/model", conf) == Path("nowhere/model")  # the caller names it
    with pytest.raises(ConfigError, match="model.path: nowhere/model is not a directory"):
        backend.build(load_config(DLLMTrainConfig, overrides=["model.path=nowhere/model"]))


def test_a_jsonl_task_trains_and_evaluates_on_the_files_problems(tmp_path, monkeypatch):
    """Your own problems: every line of each file, the files named relative to the config."""
    (tmp_path / "train.jsonl").write_text("".join(f'{{"prompt": "{a}+{b}=", "answer": {a + b}}}\n'
                                                  for a in range(3) for b in range(3)))
    (tmp_path / "eval.jsonl").write_text('{"prompt": "4+4=", "answer": 8}\n{"prompt": "5+1=", "answer": "6"}\n')
    (tmp_path / "run.yaml").write_text("task: {type: jsonl, train_path: train.jsonl, eval_path: eval.jsonl}\n")
    monkeypatch.chdir(tmp_path.parent)
    cfg = load_config(DLLMTrainConfig, tmp_path / "run.yaml", defaults=backend.DEFAULT_CONFIG, overrides=[
        f"output_dir={tmp_path / 'run'}", "train.max_steps=1", "rollout.prompts_per_step=2",
        "rollout.num_generations=2", *BLOCKS])
    policy, task = backend.build(cfg)
    assert len(task.train) == 9 and [p.answer for p in task.eval_problems] == ["8", "6"]
    summary = Trainer(cfg, policy, task).train()
    assert summary["steps"] == 1 and 0.0 <= summary["eval_after"]["accuracy"] <= 1.0
    assert set(summary["eval_after"]) >= {"accuracy", "reward", "nfe"}
    assert set(summary["eval_after"]) - set(task.reward.names) <= set(task.metric_names)  # what atoms may not be named


def test_pass_at_k_when_the_wrong_samples_exactly_fill_k():
    """n - c == k is not the shortcut 1.0: one k-subset of all-wrong samples remains."""
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)  # 1 - C(2,2)/C(4,2) = 1 - 1/6
    assert pass_at_k(3, 2, 1) == pytest.approx(2 / 3)  # 1 - C(1,1)/C(3,1)
    assert pass_at_k(4, 0, 4) == 0.0  # all wrong, k = n: 1 - C(4,4)/C(4,4)


def test_a_model_without_a_pad_token_pads_prompts_with_eos():
    """Prompts are left-padded (the padding is never attended): a tokenizer without a pad
    token (many causal LMs') pads with eos, and decodes as with one; it crashed at the first rollout."""
    cfg = load_config(DLLMTrainConfig, overrides=["method.type=diffu_grpo", "task.num_eval=8"])
    policy, task = backend.build(cfg)
    problems = task.eval_problems[:8]
    before = task.answers(policy, problems, temperature=0.0)
    policy.predictor.pad_token_id = None
    ids, valid = policy.encode_prompts([p.prompt for p in problems])
    assert (ids[~valid] == policy.predictor.eos_token_id).all() and (~valid).any()
    assert task.answers(policy, problems, temperature=0.0)[0] == before[0]


# --------------------------------------------------------------------------- the shared objective, by hand


def _loss_batch():
    """Two rows of 3 answer tokens: row 0 trains all three, row 1 only its first (4 tokens).
    The new log-probs sit at ratios rho = 1.5, 0.5, 1 (row 0) and 1.5 (row 1) to the old."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]])
    rho = torch.tensor([[1.5, 0.5, 1.0], [1.5, 3.0, 0.1]])  # row 1's last two are not trained
    logp = (old + rho.log()).requires_grad_()
    mask = torch.tensor([[True, True, True], [True, False, False]])
    batch = RolloutBatch(group_ids=torch.tensor([0, 0]), samples=[None, None], mask=mask, old_logp=old)
    return batch, logp, SimpleNamespace(logprobs=lambda batch, iteration: logp)


def test_dllm_loss_clips_the_token_ratio_and_adds_k3_kl_to_the_old_by_hand():
    """TraceRL's defaults (clip 0.2, beta 0.01), A = +1 for row 0 and -1 for row 1:
    -min(rho A, clip(rho, 0.8, 1.2) A) per token: 1.5 -> 1.2 (clipped), 0.5 -> 0.5, 1 -> 1,
    row 1's 1.5 -> -1.5 (A < 0 keeps the unclipped term), so the surrogate is
    -(1.2 + 0.5 + 1 - 1.5) / 4 = -0.3 (a per-row mean first would give +0.3).
    k3(logp, old) = 1/rho + ln rho - 1: 0.0721318 at 1.5, 0.3068528 at 0.5, 0 at 1 ->
    (2 * 0.0721318 + 0.3068528) / 4 = 0.1127791 (the reverse order, rho - ln rho - 1, gives 0.0956)."""
    batch, logp, policy = _loss_batch()
    method = TraceRL(TraceRLConfig(), None, reward=None)
    out = method.loss(policy, batch, torch.tensor([1.0, -1.0]))
    assert out.metrics["loss/kl"] == pytest.approx(0.1127791, abs=1e-6)
    assert float(out.loss.detach()) == pytest.approx(-0.3 + 0.01 * 0.1127791, abs=1e-6)
    out.loss.backward()
    # d/dlogp: the unclipped surrogate -A rho / 4, the clipped one 0; the KL beta (1 - 1/rho) / 4
    kl = [0.01 * (1 - 1 / 1.5) / 4, 0.01 * (1 - 2) / 4]
    expected = torch.tensor([[0 + kl[0], -0.5 / 4 + kl[1], -1 / 4], [1.5 / 4 + kl[0], 0, 0]])
    torch.testing.assert_close(logp.grad, expected, atol=1e-6, rtol=1e-5)
    # the clip is the method's: at 0.5 no ratio here lies outside [0.5, 1.5]
    logp.grad = None
    wide = TraceRL(TraceRLConfig(clip=0.5, kl={"beta": 0.0}), None, reward=None)
    out = wide.loss(policy, batch, torch.tensor([1.0, -1.0]))
    assert float(out.loss.detach()) == pytest.approx(-(1.5 + 0.5 + 1 - 1.5) / 4, abs=1e-6)
    assert "loss/kl" not in out.metrics  # beta 0: no KL term is computed
    narrow = TraceRL(TraceRLConfig(clip=0.2, kl={"beta": 0.0}), None, reward=None)
    out = narrow.loss(policy, batch, torch.tensor([-1.0, 1.0]))  # the low edge, 0.8, binds
    # row 0 at A = -1: 1.5 -> -1.5, 0.5 -> -min(-0.5, -0.8) = 0.8, 1 -> -1; row 1 at A = +1: 1.5 -> 1.2
    assert float(out.loss.detach()) == pytest.approx(-(-1.5 - 0.8 - 1 + 1.2) / 4, abs=1e-6)


def test_dllm_loss_divides_by_the_mini_batch_denominator_it_is_given():
    """A micro-batch's loss is its sum over the mini-batch's token count (denom), the surrogate
    and the KL alike: with denom 8 (twice this batch's 4 tokens) both halve."""
    batch, _, policy = _loss_batch()
    method = TraceRL(TraceRLConfig(), None, reward=None)
    out = method.loss(policy, batch, torch.tensor([1.0, -1.0]), denom=8.0)
    assert out.metrics["loss/kl"] == pytest.approx(0.4511164 / 8, abs=1e-6)
    assert float(out.loss.detach()) == pytest.approx(-1.2 / 8 + 0.01 * 0.4511164 / 8, abs=1e-6)


def test_dllm_advantages_follow_the_scale_dial():
    """diffu-GRPO's default (d1's code) is r - group mean; TraceRL's divides by the group std.
    Rewards 1, 0, 0, 0: mean 0.25, unbiased std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5."""
    from dllm_rl.config import DiffuGRPOConfig

    batch = RolloutBatch(group_ids=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), samples=[None] * 8)
    values = torch.tensor([[1.0], [0], [0], [0], [2], [2], [2], [2]])
    batch.scores = AtomScores(["answer"], values, values.sum(1))
    d1 = DiffuGRPO(DiffuGRPOConfig(), None, reward=None).advantages(batch)
    assert d1.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0], abs=1e-6)
    trace = TraceRL(TraceRLConfig(), None, reward=None).advantages(batch)
    assert trace.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0], abs=1e-5)


def test_accuracy_band_keeps_its_edges_and_counts_half_right_answers():
    """The band is closed at both ends; an answer right means its success atom >= 0.5, read
    from that atom's own column (here the first). Groups of 5 at band [0.2, 0.8]: 4 right (0.8,
    kept), one answer at exactly 0.5 (0.2, kept), all right (1.0, dropped)."""
    answer = [1.0, 1, 1, 1, 0] + [0.5, 0, 0, 0, 0] + [1.0] * 5
    values = torch.tensor([[a, 1.0] for a in answer])  # atoms: answer, format (every answer formatted)
    batch = RolloutBatch(group_ids=torch.arange(15) // 5, samples=[Sample("p", "c")] * 15,
                         scores=AtomScores(["answer", "format"], values, values.sum(1)))
    run = SimpleNamespace(task=SimpleNamespace(type="arith"))
    banded = TraceRL(TraceRLConfig(accuracy_band=(0.2, 0.8)), run, reward=None)
    assert banded.keep_groups(batch).tolist() == [True] * 10 + [False] * 5
    # the band bounds the share right (0.8, 0.2, 1.0), not its spread (std 0.45, 0.45, 0)
    upper = TraceRL(TraceRLConfig(accuracy_band=(0.5, 1.0)), run, reward=None)
    assert upper.keep_groups(batch).tolist() == [True] * 5 + [False] * 5 + [True] * 5


def test_a_subclass_of_a_subclass_takes_its_nearest_registered_estimator(monkeypatch):
    """Leaf(Mid(DiffuGRPO)) with Mid's own estimator registered: Leaf gets Mid's, not d1's."""
    from dllm_rl.methods.common import estimator_for
    from mmrl.core.method import METHODS

    class Mid(DiffuGRPO):
        pass

    class Leaf(Mid):
        pass

    class MidEstimator(MeanField):
        pass

    monkeypatch.setitem(METHODS, "mid", Mid)
    monkeypatch.setitem(METHODS, "leaf", Leaf)
    monkeypatch.setitem(ESTIMATORS, "mid", MidEstimator)
    run = run_of_method("leaf")
    assert type(estimator_for(run)) is MidEstimator


def test_mean_field_pass_k_masks_the_prompt_with_seed_column_k():
    """Pass k (and k + mu) hides the valid prompt tokens where torch.rand(P) drawn from
    mask_seed[:, k] is below p: each pass its own seed, in the order drawn."""
    est, batch = mean_field_batch(0.5, mu=3, n=4)
    batch.data["mask_seed"] = torch.arange(12).reshape(4, 3) * 101 + 7
    policy = SimpleNamespace(predictor=SimpleNamespace(mask_token_id=MASK))
    valid = batch.data["prompt_valid"]
    for k in range(3):
        expected = torch.stack([torch.rand(8, generator=torch.Generator().manual_seed(int(s))) < 0.5
                                for s in batch.data["mask_seed"][:, k]]) & valid
        for iteration in (k, k + 3):
            assert torch.equal(est.masked_input(policy, batch, iteration)[:, :8] == MASK, expected)


def test_dllm_loss_denominator_counts_the_trained_answer_tokens():
    """token_mean over the mini-batch: the answer tokens up to each <eos> (4 here), not the filler."""
    batch, _, _ = _loss_batch()
    assert TraceRL(TraceRLConfig(), None, reward=None).loss_denominator(batch) == 4.0


def test_diffu_grpo_pass_k_compares_with_the_old_log_probs_of_mask_k():
    """Pass k reads old_logp_mu[:, k], however few rows the micro-batch holds (2 rows, mu = 3)."""
    from dllm_rl.config import DiffuGRPOConfig

    old = torch.tensor([[[-1.0], [-2.0], [-3.0]], [[-4.0], [-5.0], [-6.0]]])  # [N, mu, C]
    batch = RolloutBatch(group_ids=torch.zeros(2, dtype=torch.long), samples=[None] * 2,
                         data={"old_logp_mu": old})
    method = DiffuGRPO(DiffuGRPOConfig(), None, reward=None)
    for epoch, expected in enumerate([[-1.0, -4.0], [-2.0, -5.0], [-3.0, -6.0]]):
        method.epoch = epoch
        assert method.old_logp(batch)[:, 0].tolist() == expected


# --------------------------------------------------------------------------- the policy on a stand-in predictor


class _Predictor:
    """What DLLMPolicy reads of a MaskPredictor: the special ids, the context, the tiny
    character tokenizer, a model, and a call that returns zero logits and keeps `valid`."""

    def __init__(self, pad=PAD, eos=EOS, mask=MASK, max_length=16):
        from dllm_rl.tiny import build_tokenizer

        self.mask_token_id, self.pad_token_id, self.eos_token_id, self.max_length = mask, pad, eos, max_length
        self.tokenizer = build_tokenizer()
        self.model = torch.nn.Linear(2, 2)
        self.valid = []

    def __call__(self, x, *, prompt_length, valid):
        self.valid.append(valid)
        return torch.zeros(*x.shape, 53)


def _policy(predictor=None, prompt_length=4, gen_length=4, estimator=None):
    from dllm_rl.policy import DLLMPolicy

    return DLLMPolicy(predictor or _Predictor(), SimpleNamespace(gen_length=gen_length), prompt_length, estimator)


def test_policy_logits_ban_mask_and_pad_but_never_eos_and_see_the_whole_answer():
    policy = _policy()
    assert policy.banned.tolist() == [PAD, MASK]
    x = torch.full((2, 6), 5)
    prompt_valid = torch.tensor([[False, True, True, True], [True, True, True, True]])
    with torch.no_grad():
        out = policy.logits(x, prompt_valid)
    # the prompt's own validity, then every answer position valid
    assert policy.predictor.valid[-1].tolist() == [[False, True, True, True, True, True], [True] * 6]
    assert out[..., [PAD, MASK]].eq(float("-inf")).all() and out[..., EOS:].eq(0).all()
    assert policy.step_costs() == {"cost/forward_tokens": 12.0, "cost/train_rows": 0.0}  # 2 rows x 6, no grad
    # a tokenizer without a pad token pads with eos: eos stays an answer token
    assert _policy(_Predictor(pad=EOS)).banned.tolist() == [MASK]


def test_a_prompt_and_answer_that_exactly_fill_the_context_fit():
    from dllm_rl.policy import PromptTooLong

    assert _policy(_Predictor(max_length=16), prompt_length=12, gen_length=4).prompt_length == 12  # 12 + 4 = 16
    with pytest.raises(PromptTooLong, match="13 tokens plus gen_length 4 exceed the model's context of 16"):
        _policy(_Predictor(max_length=16), prompt_length=13, gen_length=4)


def test_encode_prompts_left_pads_with_the_pad_token_by_hand():
    from dllm_rl.policy import PromptTooLong

    ids, valid = _policy(prompt_length=4).encode_prompts(["12", "1234", ""])
    # CHARSET[i] is id i + 3: "1" -> 4, "2" -> 5, "3" -> 6, "4" -> 7
    assert ids.tolist() == [[PAD, PAD, 4, 5], [4, 5, 6, 7], [PAD] * 4]
    assert valid.tolist() == [[False, False, True, True], [True] * 4, [False] * 4]
    with pytest.raises(PromptTooLong, match="'12345' has 5 tokens; this run's prompts may have at most 4"):
        _policy(prompt_length=4).encode_prompts(["12345"])


def test_generate_refuses_prefixes_and_a_policy_without_an_estimator_has_no_logprobs():
    policy = _policy()
    with pytest.raises(ValueError, match="does not continue fixed prefixes"):
        policy.generate([], 1, None, torch.Generator(), prefixes=["12"])
    with pytest.raises(ValueError, match="has no log-prob estimator"):
        policy.logprobs(None)


def test_generate_by_hand_on_a_stand_in_decode():
    """Two prompts x 2 answers of 3 tokens from a fixed decode: the groups, the texts, the
    stats, the training mode given back, and the estimator run without gradients."""
    from dllm_rl.samplers import DecodeResult

    seen = {}

    class Estimator:
        def prepare(self, policy, batch, generator):
            seen["grad"] = torch.is_grad_enabled()
            seen["training"] = policy.model.training

    policy = _policy(prompt_length=2, gen_length=3, estimator=Estimator())
    policy.model.train()
    completion = torch.tensor([[4, EOS, EOS], [5, 6, EOS], [7, 7, 7], [EOS, 4, 4]])
    commit_step = torch.tensor([[0, 1, 2], [2, 1, 0], [0, 0, -1], [1, -1, -1]])  # -1: never decoded

    def decode(texts, generator, *, temperature, strategy=None, record_states=False):
        seen["texts"] = list(texts)
        result = DecodeResult(
            tokens=torch.cat([torch.full((4, 2), 3), completion], 1), completion=completion,
            commit_step=commit_step, commit_logp=torch.zeros(4, 3, dtype=torch.float64),
            commit_confidence=torch.ones(4, 3), fallback=torch.tensor([[True, False]] * 4),
            active=torch.ones(4, 2, dtype=torch.bool), nfe=torch.full((4,), 2),
            expected_wrong=torch.full((4, 2), 0.25), block_length=3, prompt_length=2, mask_id=MASK)
        return result, torch.ones(4, 2, dtype=torch.bool)

    policy.decode = decode
    problems = [SimpleNamespace(prompt="1+", answer="1", meta={"answer": "stale", "k": 0}),
                SimpleNamespace(prompt="2+", answer="2", meta={})]
    batch = policy.generate(problems, 2, SimpleNamespace(temperature=1.0, strategy=None), torch.Generator())
    assert seen["texts"] == ["1+", "1+", "2+", "2+"]
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    assert [s.completion for s in batch.samples] == ["1", "23", "444", ""]  # "1" is id 4, up to the first <eos>
    assert batch.samples[0].meta == {"answer": "1", "k": 0}  # the problem's answer, not a stale meta entry
    assert batch.mask.tolist() == [[True, True, False], [True, True, True], [True] * 3, [True, False, False]]
    d = batch.data
    assert d["stat/length"].tolist() == [3.0, 3.0, 2.0, 1.0]  # positions with a commit step, step 0 included
    assert d["stat/answer_tokens"].tolist() == [2.0, 3.0, 3.0, 1.0]
    assert d["stat/fallback_steps"].tolist() == [1.0] * 4 and d["stat/expected_wrong"].tolist() == [0.5] * 4
    assert batch.old_logp.dtype == torch.float32
    assert seen["grad"] is False and seen["training"] is True  # prepare runs after the mode is given back
    assert policy.model.training


def test_reference_is_a_frozen_copy_that_leaves_the_policy_trainable():
    policy = _policy()
    ref = policy.reference()
    assert ref.model is ref.predictor.model and ref.model is not policy.model
    assert not any(p.requires_grad for p in ref.model.parameters())
    assert all(p.requires_grad for p in policy.model.parameters())
    with torch.no_grad():
        policy.model.weight.add_(1.0)
    assert not torch.equal(ref.model.weight, policy.model.weight)


def test_a_copys_forwards_count_at_every_step_not_only_the_first():
    """reference() (also what a pipelined engine samples with) shares the policy's counters:
    step_costs zeroes them in place, so the copy's forwards still count after the first step."""
    policy = _policy()  # prompt 4 + answer 4
    copy_ = policy.reference()
    x, prompt_valid = torch.full((2, 8), 5), torch.ones(2, 4, dtype=torch.bool)
    for _ in range(2):
        with torch.no_grad():
            copy_.logits(x, prompt_valid)
        assert policy.step_costs()["cost/forward_tokens"] == 2 * 8


# ---------------------------------------------------------------------------- audit: the backend's build_task, checks and sample


class _CharTok:
    """One token per character."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(range(len(text)))}


def _room_task():
    from dllm_rl.tasks import Problem

    return SimpleNamespace(train=[Problem("1+1=", "2", "12")], eval_problems=[Problem("9+9=", "18", "12345")])


def test_answer_room_is_the_longest_reference_and_its_eos():
    """The longest reference (12345, held out) is 5 tokens, 6 with <eos>: gen_length 6 holds it, 5 does not."""
    backend.check_answer_room(_room_task(), _CharTok(), SimpleNamespace(gen_length=6, block_length=2))
    with pytest.raises(ConfigError, match=r"'12345' is 5 tokens, 6 with its <eos>. Set rollout.gen_length to "
                                          r"at least 6 \(a multiple of rollout.block_length 2"):
        backend.check_answer_room(_room_task(), _CharTok(), SimpleNamespace(gen_length=5, block_length=2))


def test_answer_room_names_every_reference_of_the_longest_length():
    """Where several references share the longest length (sudoku's 19-character grids all do), the
    message counts them and names the first three, not one as if it were the only one."""
    from dllm_rl.tasks import Problem

    two = SimpleNamespace(train=[Problem("1+1=", "2", "12345")], eval_problems=[Problem("9+9=", "18", "54321")])
    with pytest.raises(ConfigError, match=r"answers: 2 references \('12345', '54321'\) are 5 tokens, 6 with their <eos>"):
        backend.check_answer_room(two, _CharTok(), SimpleNamespace(gen_length=5, block_length=2))
    many = SimpleNamespace(train=[Problem(f"{i}=", str(i), f"{i}" * 4) for i in range(1, 6)], eval_problems=[])
    with pytest.raises(ConfigError, match=r"answers: 5 references \('1111', '2222', '3333', \.\.\.\) are 4 tokens"):
        backend.check_answer_room(many, _CharTok(), SimpleNamespace(gen_length=4, block_length=2))
    # exactly three: all named, no "..."; one a token shorter is not among them
    three = SimpleNamespace(train=[Problem(f"{i}=", str(i), f"{i}" * 4) for i in range(1, 4)],
                            eval_problems=[Problem("9=", "9", "999")])
    with pytest.raises(ConfigError, match=r"answers: 3 references \('1111', '2222', '3333'\) are 4 tokens"):
        backend.check_answer_room(three, _CharTok(), SimpleNamespace(gen_length=4, block_length=2))
    one = SimpleNamespace(train=[Problem("1=", "1", "1111")], eval_problems=[Problem("9=", "9", "999")])
    with pytest.raises(ConfigError, match=r"answers: '1111' is 4 tokens, 5 with its <eos>"):
        backend.check_answer_room(one, _CharTok(), SimpleNamespace(gen_length=4, block_length=2))


def test_dllm_build_task_draws_held_out_problems_and_passes_the_settings():
    from dllm_rl.tasks import split_of

    cfg = load_config(DLLMTrainConfig, overrides=["task.num_train=6", "task.num_eval=4", "rollout.eval_samples=3",
                                                  "rollout.eval_batch_size=5", "reward.on_error=zero"])
    task = backend.build_task(cfg)
    assert (len(task.train), len(task.eval_problems)) == (6, 4)
    assert {split_of("arith", p.prompt) for p in task.eval_problems} == {"eval"}
    assert {split_of("arith", p.prompt) for p in task.train} == {"train"}
    assert (task.eval_samples, task.batch_size, task.answer_atom) == (3, 5, "answer")
    assert task.reward.on_error == "zero"


class _SampleDecoder:
    """A stand-in policy for backend.sample: prompts of up to 20 characters fit; each answer
    is its prompt's row number in the call; NFE 3 a row. It records each decode's arguments."""

    def __init__(self):
        self.predictor, self.prompt_length, self.calls = SimpleNamespace(tokenizer=_CharTok(), vocab_size=1000), 20, []

    def decode(self, texts, generator, temperature, strategy=None):
        seed = (None if generator is None else [g.initial_seed() for g in generator]
                if isinstance(generator, list) else generator.initial_seed())
        self.calls.append((list(texts), seed, temperature, strategy))
        return SimpleNamespace(completion=[str(k) for k in range(len(texts))], nfe=torch.full((len(texts),), 3)), None

    def answer_text(self, completion):
        return list(completion)

    def encode_prompts(self, texts):  # sample checks every prompt first: these all encode
        return None, None


def test_dllm_sample_scores_prompts_in_the_tasks_format_for_each_of_n_answers():
    """"12+3=" (arith: gold 15) and "hello" (not scored), n = 2: rows 0-1 the first, 2-3 the
    second; answers are the row numbers, so none is 15: reward 0 (the format atom aside)."""
    cfg = load_config(DLLMTrainConfig, overrides=["seed=7", "rollout.temperature=0.5", "rollout.eval_strategy=ar",
                                                  "task.num_train=2", "task.num_eval=3"])
    task, policy = backend.build_task(cfg), _SampleDecoder()
    rows = backend.sample(cfg, policy, task, ["12+3=", "hello"], n=2)
    assert [r["prompt"] for r in rows] == ["12+3=", "12+3=", "hello", "hello"]
    assert [r.get("gold") for r in rows] == ["15", "15", None, None]
    assert [r["completion"] for r in rows] == ["0", "1", "2", "3"] and {r["nfe"] for r in rows} == {3}
    assert rows[0]["atoms"]["answer"] == 0.0 and "reward" not in rows[2]
    from mmrl.core.held_out import sample_generators

    # one generator per answer, seeded by (cfg.seed, prompt, answer), at the rollout temperature
    assert policy.calls[-1][1:] == ([g.initial_seed() for g in sample_generators(2, 2, 7)], 0.5, None)
    backend.sample(cfg, policy, task, ["12+3="], n=1, greedy=True)
    assert policy.calls[-1][1:] == (None, 0.0, "ar")  # greedy: temperature 0, rollout.eval_strategy
    rows = backend.sample(cfg, policy, task, [], n=1)  # no prompt: the first two held-out problems
    assert [r["prompt"] for r in rows] == [p.prompt for p in task.eval_problems[:2]]
    assert [r["gold"] for r in rows] == [p.answer for p in task.eval_problems[:2]]


def test_fit_prompts_keeps_the_policy_for_prompts_no_longer_than_its_width():
    policy = _SampleDecoder()  # width 20
    assert backend.fit_prompts(policy, ["x" * 20, "y" * 3]) is policy
