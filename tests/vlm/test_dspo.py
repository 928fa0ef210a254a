"""DSPO (mmrl.vlm.methods.dspo): CVIG's teacher-forced candidate probabilities with and without
the cited box, the reward it trains on, and a step of configs/vlm/dspo.yaml."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mmrl.core.config import load_config
from mmrl.core.logging import read_metrics
from mmrl.core.method import build_method
from mmrl.core.trainer import Trainer
from mmrl.vlm import backend
from mmrl.vlm.methods.dspo import DSPO, _word_tokens, emotion_probs
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


class _CharTokenizer:
    """One token a character: offsets (i, i + 1)."""

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        return {"offset_mapping": [(i, i + 1) for i in range(len(text))]}


def test_emotion_probs_by_hand_with_a_scripted_policy(monkeypatch):
    """Every token has log-prob -0.1 under the image and -0.3 with the box blacked out, so a word of
    L characters (one token each, the prefix's last one not among them) has p = e^(-0.1 L) and
    p_cf = e^(-0.3 L). Three rows in chunks of two: each row's own box and prompt, in order."""
    from mmrl.vlm.methods import dspo

    boxes_seen, prompts_seen = [], []

    def fake_mask_box(pixels, grid, box, *, merge, fill):
        boxes_seen.append(box)
        return pixels * 3

    class Policy:
        processor = SimpleNamespace(image_processor=SimpleNamespace(merge_size=1, image_mean=[0.5] * 3,
                                                                    image_std=[0.5] * 3))
        tokenizer = _CharTokenizer()

        def teacher_batch(self, prompts, texts):
            prompts_seen.append(prompts)
            t = max(len(x) for x in texts) + 2
            mask = torch.tensor([[j <= len(x) for j in range(t)] for x in texts])  # text, eos, padding
            return SimpleNamespace(mask=mask, data={"pixel_values": torch.ones((len(texts), 2, 3)),
                                                    "image_grid_thw": torch.ones((len(texts), 1, 3))})

        def logprobs(self, tb):
            return torch.full(tb.mask.shape, -0.1)

        def rescore(self, tb, pixels):  # -0.1 a token per unit of the pixels: -0.3 once masked
            return -0.1 * pixels[:, :1, 0].expand(tb.mask.shape)

    monkeypatch.setattr(dspo, "mask_box", fake_mask_box)
    boxes = [(0.0, 0.0, 0.5, 0.5), (0.5, 0.5, 1.0, 1.0), (0.0, 0.5, 0.5, 1.0)]
    p, p_cf = emotion_probs(Policy(), ["q0", "q1", "q2"], ["ab>", "ab>", "abcd>"], ["joy", "fear", "awe"], boxes,
                            chunk=2)
    torch.testing.assert_close(p, torch.tensor([math.exp(-0.3), math.exp(-0.4), math.exp(-0.3)]))
    torch.testing.assert_close(p_cf, torch.tensor([math.exp(-0.9), math.exp(-1.2), math.exp(-0.9)]))
    assert boxes_seen == boxes and prompts_seen == [["q0", "q1"], ["q2"]]


def test_annotate_scores_each_candidate_after_the_answer_tag_with_its_groups_prompt_and_box(tmp_path, monkeypatch):
    """Two responses in groups 3 and 5; box area 0.41 * 0.411 = 0.16851 for both, keep = 0.83149.
    Response 0: dP = 0.1 keep for each candidate -> R_cf = 0.1 keep, uniform weights. Response 1:
    dP = [0.2 keep, 0, 0, 0, 0] -> R_cf = 0.04 keep, w = softmax(dP / tau 0.1). R_div = DEDR with
    those weights and the configured tau_ctr 0.7, tau_div 0.3."""
    from mmrl.core.batch import RolloutBatch
    from mmrl.core.rewards import Sample
    from mmrl.vlm.methods import dspo

    items = ShapesMood(seed=2, num_train=3, num_eval=1, num_ood=1).train_items()[:2]
    seen = {}

    def fake(policy, prompts, prefixes, words, boxes):
        seen.update(prompts=prompts, prefixes=prefixes, words=words, boxes=boxes)
        return (torch.tensor([0.5] * 5 + [0.6, 0.3, 0.2, 0.1, 0.1]),
                torch.tensor([0.4] * 5 + [0.4, 0.3, 0.2, 0.1, 0.1]))

    monkeypatch.setattr(dspo, "emotion_probs", fake)
    cfg = _cfg(tmp_path, ["method.tau=0.1", "method.tau_ctr=0.7", "method.tau_div=0.3"])
    batch = RolloutBatch(group_ids=torch.tensor([3, 5]), samples=[Sample(it.question, it.reference, it.meta)
                                                                  for it in items],
                         prompts={3: items[0], 5: items[1]})
    dspo.DSPO(cfg.method, cfg, None).annotate(None, batch)
    resp = [parse_mood(it.reference) for it in items]
    assert seen["prompts"] == [items[0]] * 5 + [items[1]] * 5
    assert seen["prefixes"] == [it.reference[: it.reference.index("<answer>") + len("<answer>")]
                                for it in items for _ in range(5)]
    assert seen["prefixes"][0].endswith("excitement</step3> <answer>")
    assert seen["words"] == resp[0].candidates + resp[1].candidates
    assert seen["boxes"] == [(0.536, 0.134, 0.946, 0.545)] * 5 + [(0.446, 0.429, 0.857, 0.839)] * 5
    keep = 1 - 0.41 * 0.411
    torch.testing.assert_close(batch.data["dspo/r_cf"], torch.tensor([0.1 * keep, 0.04 * keep]))
    e = math.exp(0.2 * keep / 0.1)
    w1 = [e / (e + 4)] + [1 / (e + 4)] * 4
    expected = [diversity(resp[0], items[0].meta, w=[0.2] * 5, tau_ctr=0.7, tau_div=0.3),
                diversity(resp[1], items[1].meta, w=w1, tau_ctr=0.7, tau_div=0.3)]
    assert batch.data["dspo/r_div"].tolist() == pytest.approx(expected, rel=1e-5)
    assert expected[0] != pytest.approx(diversity(resp[0], items[0].meta), rel=1e-3)  # the temperatures matter


# "İ".lower() is two characters: a cut found in the lower-cased text took one character too many
@pytest.mark.parametrize("tag, reaction_start", [("<ANSWER>", ""), ("<Answer>", "İ ")])
def test_annotate_cuts_the_prefix_at_an_upper_case_answer_tag(tmp_path, monkeypatch, tag, reaction_start):
    """The format check reads tags in any case, so "<ANSWER>" responses are scored: their CVIG
    prefix runs through that tag, as for "<answer>" (a case-sensitive search cut it at 7 characters)."""
    from mmrl.core.batch import RolloutBatch
    from mmrl.core.rewards import Sample
    from mmrl.vlm.methods import dspo
    from mmrl.vlm.tasks.shapes_mood import format_problem

    item = ShapesMood(seed=2, num_train=3, num_eval=1, num_ood=1).train_items()[0]
    text = item.reference.replace("<step2>", "<step2>" + reaction_start).replace("<answer>", tag)
    text = text.replace("</answer>", tag.replace("<", "</"))
    assert format_problem(text) is None
    seen = {}

    def fake(policy, prompts, prefixes, words, boxes):
        seen["prefixes"] = prefixes
        return torch.ones(len(words)), torch.ones(len(words))

    monkeypatch.setattr(dspo, "emotion_probs", fake)
    cfg = _cfg(tmp_path, [])
    batch = RolloutBatch(group_ids=torch.tensor([0]), samples=[Sample(item.question, text, item.meta)], prompts={0: item})
    dspo.DSPO(cfg.method, cfg, None).annotate(None, batch)
    assert set(seen["prefixes"]) == {text[: text.index(tag) + len(tag)]}


def _rewarded(total, group_ids):
    from mmrl.core.batch import RolloutBatch
    from mmrl.core.rewards import AtomScores, Sample

    total = torch.tensor(total)
    return RolloutBatch(group_ids=torch.tensor(group_ids), samples=[Sample("q", "a")] * len(total),
                        scores=AtomScores(names=["answer"], values=total[:, None], total=total))


@pytest.mark.parametrize("extra,expected", [
    (["method.advantage.scale=none"], [0.5, -0.5, 0.0, 0.0]),  # r - group mean
    (["method.advantage.eps=1.0"], [0.5 / (1 / math.sqrt(2) + 1), -0.5 / (1 / math.sqrt(2) + 1), 0.0, 0.0]),
])
def test_dspo_advantages_follow_the_configured_scale_and_eps(tmp_path, extra, expected):
    """Rewards [1, 0 | 2, 2]: group std 0.7071 and 0."""
    cfg = _cfg(tmp_path, extra)
    adv = DSPO(cfg.method, cfg, None).advantages(_rewarded([1.0, 0.0, 2.0, 2.0], [0, 0, 1, 1]))
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-5, rtol=0)


def test_dspo_metrics_means_over_the_scored_responses_and_warnings_since_the_last_step(tmp_path, monkeypatch):
    from mmrl.vlm.tasks.shapes_mood import MOOD_WARNINGS

    cfg = _cfg(tmp_path)
    method = DSPO(cfg.method, cfg, None)
    batch = _rewarded([1.0, 0.0, 1.0], [0, 0, 0])
    assert method.batch_metrics(batch) == {}  # not annotated
    batch.data.update({"dspo/r_cf": torch.tensor([0.2, 9.0, 0.4]), "dspo/r_div": torch.tensor([0.1, 9.0, 0.3]),
                       "dspo/scored": torch.tensor([True, False, True])})
    monkeypatch.setitem(MOOD_WARNINGS, "bad_box", MOOD_WARNINGS["bad_box"] + 2)
    first = method.batch_metrics(batch)
    assert first["dspo/r_cf"] == pytest.approx(0.3) and first["dspo/r_div"] == pytest.approx(0.2)
    assert first["dspo/cvig_scored"] == pytest.approx(2 / 3) and first["dspo/warnings/bad_box"] == 2.0
    monkeypatch.setitem(MOOD_WARNINGS, "wrong_count", MOOD_WARNINGS["wrong_count"] + 1)
    second = method.batch_metrics(batch)
    assert second["dspo/warnings/bad_box"] == 0.0 and second["dspo/warnings/wrong_count"] == 1.0
    batch.data["dspo/scored"] = torch.zeros(3, dtype=torch.bool)
    none = method.batch_metrics(batch)
    assert none["dspo/cvig_scored"] == 0.0 and "dspo/r_cf" not in none and "dspo/r_div" not in none


def test_dspo_rewards_replace_the_uniform_diversity_atom_by_hand(tmp_path):
    """Atoms answer 1, format 0.1, diversity 0.3 with values [1, 1, 0.5]: total 1.25. Annotated
    R_div 0.8, R_cf 0.2 -> R = 1.25 - 0.3 * 0.5 + 0.3 * 0.8 + 0.1 * 0.2 = 1.36; not annotated, R = 1.25.
    A reward without a diversity atom only gains the two terms: 1 + 0.24 + 0.02."""
    from mmrl.core.batch import RolloutBatch
    from mmrl.core.rewards import AtomScores, Sample

    cfg = _cfg(tmp_path)
    reward = SimpleNamespace(atoms=[SimpleNamespace(weight=w) for w in (1.0, 0.1, 0.3)])
    batch = RolloutBatch(group_ids=torch.tensor([0]), samples=[Sample("q", "a")],
                         scores=AtomScores(names=["answer", "format", "diversity"], values=torch.tensor([[1.0, 1.0, 0.5]]),
                                           total=torch.tensor([1.25])))
    method = DSPO(cfg.method, cfg, reward)
    torch.testing.assert_close(method.rewards(batch), torch.tensor([1.25]))
    batch.data.update({"dspo/r_div": torch.tensor([0.8]), "dspo/r_cf": torch.tensor([0.2])})
    torch.testing.assert_close(method.rewards(batch), torch.tensor([1.36]))
    plain = _rewarded([1.0], [0])
    plain.data.update({"dspo/r_div": torch.tensor([0.8]), "dspo/r_cf": torch.tensor([0.2])})
    torch.testing.assert_close(DSPO(cfg.method, cfg, SimpleNamespace(atoms=[SimpleNamespace(weight=1.0)])).rewards(plain),
                               torch.tensor([1.26]))


def _annotate_with(tmp_path, monkeypatch, extra):
    """DSPO.annotate of item 1's reference with CVIG's probability drop all on candidate 3
    ('contentment', whose removal brings the set's mean closer to the prior: Delta_3 = -0.055)."""
    from mmrl.core.batch import RolloutBatch
    from mmrl.core.rewards import Sample
    from mmrl.vlm.methods import dspo

    item = ShapesMood(seed=2, num_train=3, num_eval=1, num_ood=1).train_items()[1]
    resp = parse_mood(item.reference)
    assert resp.candidates[3] == "contentment"
    p, p_cf = torch.tensor([0.1, 0.1, 0.1, 0.6, 0.1]), torch.full((5,), 0.1)
    monkeypatch.setattr(dspo, "emotion_probs", lambda *args: (p, p_cf))
    cfg = _cfg(tmp_path, extra)
    batch = RolloutBatch(group_ids=torch.tensor([0]), samples=[Sample(item.question, item.reference, item.meta)],
                         prompts={0: item})
    dspo.DSPO(cfg.method, cfg, None).annotate(None, batch)
    return batch, resp, item, cfg


def test_a_tiny_tau_weighs_the_largest_drop_alone_not_nan(tmp_path, monkeypatch):
    """dP / tau overflowed to inf at tau 1e-40, and softmax([.., inf, ..]) is NaN: the run stopped on
    NaN rewards. tau -> 0 is the argmax: all the weight on the candidate of the largest drop."""
    batch, resp, item, cfg = _annotate_with(tmp_path, monkeypatch, ["method.tau=1e-40"])
    expected = diversity(resp, item.meta, w=[0, 0, 0, 1, 0], tau_ctr=cfg.method.tau_ctr, tau_div=cfg.method.tau_div)
    assert expected < 0  # 1 - exp(0.055 / 0.5) weighed by the centring factor
    assert float(batch.data["dspo/r_div"][0]) == pytest.approx(expected, rel=1e-6)


def test_a_tau_div_that_overflows_r_div_is_a_config_error_naming_it(tmp_path, monkeypatch):
    """At tau_div 1e-3, Delta_3 = -0.055 adds 1 - exp(55) ~ -8e23 to R_div: its square overflows the
    group's float32 std, and the advantages were NaN (a traceback); at 1e-4, ~ -1e239 failed to be stored
    in the float32 rewards (a RuntimeError). tau_div 0.5 is fine."""
    from mmrl.core.config import ConfigError

    with pytest.raises(ConfigError, match=r"method.tau_div 0.001 \(with tau_ctr 1.0\) makes R_div -\d.*e\+2\d for "
                                          r"response 0: .*raise tau_div \(DSPO's default is 0.5\)"):
        _annotate_with(tmp_path, monkeypatch, ["method.tau_div=1e-3"])
    with pytest.raises(ConfigError, match=r"method.tau_div 0.0001 .* makes R_div -\d.*e\+23\d"):  # past float32's range
        _annotate_with(tmp_path, monkeypatch, ["method.tau_div=1e-4"])
    batch, *_ = _annotate_with(tmp_path, monkeypatch, [])
    assert math.isfinite(float(batch.data["dspo/r_div"][0]))
