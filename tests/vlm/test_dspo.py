"""DSPO (mmrl.vlm.methods.dspo): CVIG's teacher-forced candidate probabilities with and without
the cited box, the reward it trains on, and a step of configs/vlm/dspo.yaml."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mmrl.core.config import load_config
from mmrl.core.logging import read_metrics
from mmrl.core.method import build_method
from mmrl.core.trainer import Trainer
from mmrl.vlm import backend
from mmrl.vlm.methods.dspo import _word_tokens, emotion_probs
from mmrl.vlm.tasks.shapes_mood import ShapesMood, box_fraction, diversity, parse_mood

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "assets" / "tiny-qwen2.5-vl"


def _cfg(tmp_path, extra=()):
    return load_config(backend.CONFIG_CLASS, ROOT / "configs" / "vlm" / "dspo.yaml", [
        f"model.path={BUNDLED}", f"output_dir={tmp_path}", "train.max_steps=1", "task.num_train=8",
        "task.num_eval=2", "task.num_ood=2", "rollout.eval_samples=0", "rollout.prompts_per_step=2",
        "rollout.num_generations=4", "rollout.max_new_tokens=16", "logging.progress=false",
        "logging.tensorboard=false", *extra], defaults=backend.DEFAULT_CONFIG)


@pytest.fixture(scope="module")
def policy_and_items(tmp_path_factory):
    cfg = _cfg(tmp_path_factory.mktemp("dspo"))
    policy, task = backend.build(cfg)
    return cfg, policy, task, ShapesMood(seed=2, num_train=3, num_eval=1, num_ood=1).train_items()


def test_word_tokens_are_the_word_and_what_it_merged_with(policy_and_items):
    _, policy, _, _ = policy_and_items
    tok = policy.tokenizer
    pre = "<step3>anger, fear</step3> <answer>"
    text = pre + "contentment"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    mask = torch.ones((1, len(ids) + 3), dtype=torch.bool)  # as in a teacher batch: eos, padding
    sel = _word_tokens(tok, [pre], [text], mask)[0, : len(ids)]
    picked = tok.decode([i for i, s in zip(ids, sel) if s])
    assert picked.endswith("contentment") and len(picked) <= len("contentment") + 1  # at most '>' merged in
    assert not bool(_word_tokens(tok, [pre], [text], mask)[0, len(ids):].any())


def test_emotion_probs_with_and_without_the_box(policy_and_items, one_thread):
    _, policy, _, items = policy_and_items
    item = items[0]
    resp = parse_mood(item.reference)
    cut = item.reference.rfind("<answer>") + len("<answer>")
    words = resp.candidates
    p, p_cf = emotion_probs(policy, [item] * len(words), [item.reference[:cut]] * len(words), words,
                            [box_fraction(resp.box)] * len(words), chunk=2)  # chunks of 2 rows
    assert p.shape == p_cf.shape == (len(words),)
    assert bool(((p > 0) & (p <= 1) & (p_cf > 0) & (p_cf <= 1)).all())
    assert not torch.allclose(p.log(), p_cf.log())  # blacking out the trigger changes the prediction
    whole, _ = emotion_probs(policy, [item], [item.reference[:cut]], [words[0]], [(0.0, 0.0, 1.0, 1.0)])
    torch.testing.assert_close(whole, p[:1])  # the unmasked pass does not depend on the box


def test_annotate_and_the_reward_it_trains_on(policy_and_items, one_thread):
    cfg, policy, task, items = policy_and_items
    method = build_method(cfg, task.reward)
    broken = items[2].reference.replace("<step1>", "<step1>no box")
    texts = [items[0].reference, items[1].reference, broken]
    batch = policy.teacher_batch(items, texts)
    batch.prompts = dict(enumerate(items))
    batch.scores = task.reward.score(batch.samples)
    method.annotate(policy, batch)
    assert batch.data["dspo/scored"].tolist() == [True, True, False]
    assert float(batch.data["dspo/r_cf"][2]) == 0.0 and float(batch.data["dspo/r_div"][2]) == 0.0
    # R_div is DEDR with CVIG's weights: not the uniform-weight atom's value in general, same formula
    assert all(math.isfinite(float(v)) for v in batch.data["dspo/r_div"])
    names = batch.scores.names
    k = names.index("diversity")
    expected = (batch.scores.total - 0.3 * batch.scores.values[:, k]
                + 0.3 * batch.data["dspo/r_div"] + 0.1 * batch.data["dspo/r_cf"])
    torch.testing.assert_close(method.rewards(batch), expected)
    uniform = diversity(parse_mood(texts[0]), items[0].meta)
    assert float(batch.scores.values[0, k]) == pytest.approx(uniform)
    assert method.batch_metrics(batch)["dspo/cvig_scored"] == pytest.approx(2 / 3)


def test_dspo_config_runs_a_step(tmp_path, reward_spread, one_thread):
    cfg = _cfg(tmp_path)
    assert cfg.method.kl.beta == 0.01  # the paper's KL: a reference model is built
    policy, task = backend.build(cfg)
    before = {k: v.detach().clone() for k, v in policy.model.named_parameters()}
    summary = Trainer(cfg, policy, task, backend=backend).train()
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert "dspo/cvig_scored" in row and math.isfinite(row["loss/total"])
    assert {"coverage", "mode_accuracy", "ood/accuracy", "ood/coverage"} <= set(summary["eval_after"])
    assert any(not torch.equal(v, before[k]) for k, v in policy.model.named_parameters())


def test_advantage_types_dspo_cannot_use_are_refused(tmp_path):
    """DSPO z-scores in each group (scale and eps of type group): other types stopped at step 1."""
    from mmrl.core.config import ConfigError

    assert _cfg(tmp_path, ["method.advantage.scale=none"]).method.advantage.scale == "none"
    for kind in ("rloo", "multi_stream"):
        with pytest.raises(ConfigError, match=f"invalid config: method: DSPO .*advantage.type '{kind}'"):
            _cfg(tmp_path, [f"method.advantage.type={kind}"])


def test_annotate_r_cf_and_r_div_from_hand_set_probabilities(tmp_path, monkeypatch):
    """R_cf = mean_k (p - p_cf)(1 - box area); R_div = DEDR weighted by softmax_k(dP / tau), not softmax(-dP / tau)."""
    from mmrl.core.batch import RolloutBatch
    from mmrl.core.rewards import Sample
    from mmrl.vlm.methods import dspo

    item = ShapesMood(seed=2, num_train=3, num_eval=1, num_ood=1).train_items()[0]
    resp = parse_mood(item.reference)
    assert resp.box == (134, 536, 545, 946) and len(resp.candidates) == 5  # area 0.41 * 0.411 = 0.16851
    p, p_cf = torch.tensor([0.6, 0.3, 0.2, 0.1, 0.05]), torch.tensor([0.2, 0.3, 0.25, 0.1, 0.05])
    seen = {}

    def fake(policy, prompts, prefixes, words, boxes):
        seen["words"] = words
        return p, p_cf

    monkeypatch.setattr(dspo, "emotion_probs", fake)
    cfg = _cfg(tmp_path)
    batch = RolloutBatch(group_ids=torch.tensor([0]), samples=[Sample(item.question, item.reference, item.meta)],
                         prompts={0: item})
    dspo.DSPO(cfg.method, cfg, None).annotate(None, batch)
    assert seen["words"] == resp.candidates
    keep = 1 - 0.41 * 0.411
    dp = [0.4 * keep, 0.0, -0.05 * keep, 0.0, 0.0]
    assert float(batch.data["dspo/r_cf"][0]) == pytest.approx(0.35 / 5 * keep, rel=1e-5)
    e = [math.exp(d / 0.05) for d in dp]  # tau 0.05
    w = [x / sum(e) for x in e]
    expected = diversity(resp, item.meta, w=w, tau_ctr=cfg.method.tau_ctr, tau_div=cfg.method.tau_div)
    assert float(batch.data["dspo/r_div"][0]) == pytest.approx(expected, rel=1e-5)
    assert expected != pytest.approx(diversity(resp, item.meta), rel=1e-3)  # the weights matter here
