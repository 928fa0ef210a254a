"""The shapes-mood task (mmrl/vlm/tasks/shapes_mood.py), its VAD lexicon and DEDR (mmrl/vlm/dedr.py)."""

import json
import math
import warnings

import pytest
import torch

from mmrl.core.config import ConfigError, load_config
from mmrl.core.rewards import Sample
from mmrl.vlm import backend
from mmrl.vlm.config import ShapesMoodTaskConfig, VLMTrainConfig
from mmrl.vlm.dedr import dedr
from mmrl.vlm.tasks import shapes_mood as sm
from mmrl.vlm.tasks.scenes import Scene, Shape, render
from mmrl.vlm.tasks.shapes_mood import (
    MOOD_WARNINGS,
    QUESTION,
    K,
    ShapesMood,
    box_area_fraction,
    box_fraction,
    coverage,
    label_dist,
    mood_metrics,
    parse_mood,
    prior,
    shapes_mood_reward,
    top_k,
)
from mmrl.vlm.tasks.shapes_qa import QAItem
from mmrl.vlm.vad import EMOTIONS, VAD, vad

REF = ("<step1>[98,107,527,536]</step1> <step2>a red triangle</step2> "
       "<step3>anger, excitement, fear, disgust, amusement</step3> <answer>anger</answer>")


@pytest.fixture(scope="module")
def task():
    return ShapesMood(seed=0, num_train=200, num_eval=40, num_ood=40)


def scene_key(item):
    return json.dumps(item.meta["scene"], sort_keys=True)


def compositions(item):
    return {(s["colour"], s["shape"]) for s in item.meta["scene"]["shapes"]}


def score(text, meta):
    s = shapes_mood_reward().score([Sample(QUESTION, text, meta)])
    return dict(zip(s.names, s.values[0].tolist())), float(s.total[0])


# ---------------------------------------------------------------------------- lexicon


def test_lexicon_covers_the_eight_mikels_emotions():
    assert set(EMOTIONS) == set(VAD) and len(EMOTIONS) == 8
    assert all(len(v) == 3 and all(0 <= x <= 1 for x in v) for v in VAD.values())
    assert VAD["sadness"] == (0.052, 0.288, 0.164)  # NRC VAD v1.0, row "sadness"
    assert vad("  Fear ") == VAD["fear"] and vad("boredom") is None and vad(None) is None


# ---------------------------------------------------------------------------- generation


def test_generation_is_deterministic_by_seed(task):
    again = ShapesMood(seed=0, num_train=200, num_eval=40, num_ood=40)
    other = ShapesMood(seed=1, num_train=200, num_eval=40, num_ood=40)
    for split in ("train_items", "eval_items", "ood_items"):
        a, b = getattr(task, split)(), getattr(again, split)()
        assert [(x.reference, x.meta) for x in a] == [(x.reference, x.meta) for x in b]
        assert all(x.images[0].tobytes() == y.images[0].tobytes() for x, y in zip(a, b))
    assert [scene_key(x) for x in task.train_items()] != [scene_key(x) for x in other.train_items()]
    # item i depends only on (split, seed, i)
    short = ShapesMood(seed=0, num_train=20, num_eval=5, num_ood=5)
    assert [scene_key(x) for x in short.train_items()] == [scene_key(x) for x in task.train_items()[:20]]
    assert task.train_items() is task.train_items()  # cached


def test_items_label_distribution_mode_prior_and_reference(task):
    for item in task.train_items() + task.eval_items() + task.ood_items():
        meta, scene = item.meta, Scene.from_dict(item.meta["scene"])
        assert item.question == QUESTION and item.images[0].size == (112, 112)
        assert item.images[0].tobytes() == render(scene).tobytes()
        assert 1 <= len(scene.shapes) <= 3 and all(36 <= s.size <= 48 for s in scene.shapes)
        dist = meta["label_dist"]
        assert list(dist) == list(EMOTIONS) and math.isclose(sum(dist.values()), 1.0)
        assert all(p > 0 for p in dist.values())  # the base weight: every emotion has mass
        assert meta["answer"] == item.answer == max(dist, key=dist.get)
        first, second = sorted(dist.values())[::-1][:2]
        assert first - second >= sm.MIN_MODE_MARGIN
        mu, sigma = prior(dist)
        assert meta["mu"] == mu and meta["sigma"] == sigma and min(sigma) >= sm.SIGMA_FLOOR
        assert meta["kind"] == "mood" and meta["split"] in ("train", "eval", "ood")
        r = parse_mood(item.reference)
        assert r.candidates == top_k(dist) and r.answer == item.answer
        assert list(r.box) == meta["trigger_box"] and all(type(v) is int for v in r.box)
        # the trigger box is one of the scene's shapes, named in step2
        boxes = {tuple(sm.shape_box(s, 112)): f"a {s.colour} {s.shape}" for s in scene.shapes}
        assert boxes[r.box] == r.reaction
        json.dumps(meta)


def test_label_distribution_by_hand():
    # one red triangle: weights = 0.1 base + red + triangle, all scaled by the same area
    # anger .1+.5+.1=.7, excitement .1+.25+.2=.55, fear .1+.1+.3=.5, disgust .1+.15=.25,
    # the other four .1 each -> total 2.4
    dist = label_dist(Scene([Shape("triangle", "red", 56, 56, 40)], 112))
    assert dist["anger"] == pytest.approx(0.7 / 2.4) and dist["sadness"] == pytest.approx(0.1 / 2.4)
    assert top_k(dist) == ["anger", "excitement", "fear", "disgust", "amusement"]
    # a large square outweighs a small triangle of the same colour's mode: blue square (sadness)
    big = Scene([Shape("triangle", "blue", 30, 30, 36), Shape("square", "blue", 80, 80, 48)], 112)
    assert top_k(label_dist(big))[0] == "sadness"


def test_ood_compositions_never_in_train_or_eval_and_in_every_ood_item(task):
    held = {("yellow", "triangle"), ("blue", "circle")}
    assert set(task.ood_compositions) == held
    for item in task.train_items() + task.eval_items():
        assert not compositions(item) & held
    assert all(compositions(item) & held for item in task.ood_items())
    assert {c for item in task.ood_items() for c in compositions(item) & held} == held


def test_eval_is_held_out_from_train(task):
    train = {scene_key(x) for x in task.train_items()}
    assert len(task.eval_items()) == 40 and not train & {scene_key(x) for x in task.eval_items()}


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="unknown composition"):
        ShapesMood(ood_compositions=[("purple", "circle")])
    with pytest.raises(ValueError, match="every colour and every shape"):
        ShapesMood(ood_compositions=[("red", s) for s in ("circle", "square", "triangle")])


# ---------------------------------------------------------------------------- parsing, boxes


def test_parse_is_tolerant_of_whitespace_and_case():
    r = parse_mood("<STEP1> [ 98 , 107,527 ,536 ] </step1><step2> A  Red\ntriangle </step2>"
                   "<step3>Anger ,excitement;  FEAR, disgust , amusement.</step3><answer> Anger. </answer>")
    assert r == sm.MoodResponse((98, 107, 527, 536), "a red triangle",
                                ["anger", "excitement", "fear", "disgust", "amusement"], "anger")
    assert parse_mood("nothing here") == sm.MoodResponse(None, None, None, None)
    assert parse_mood("<step1>[1.5,2,3,4]</step1><step3></step3>").box is None
    assert parse_mood("<step3></step3>").candidates == []


def test_box_fractions():
    assert box_fraction([100, 200, 500, 600]) == (0.2, 0.1, 0.6, 0.5)  # (x0, y0, x1, y1)
    assert box_area_fraction([100, 200, 500, 600]) == pytest.approx(0.4 * 0.4)
    for bad in ([0, 0, 2000, 10], [5, 5, 5, 9], [1, 2, 3], (0, 0, 10.0, 10)):
        with pytest.raises(ValueError, match="not a box"):
            box_fraction(bad)


# ---------------------------------------------------------------------------- rewards


def test_reference_scores_answer_format_and_positive_diversity(task):
    item = task.train_items()[0]
    values, total = score(item.reference, item.meta)
    assert values["format"] == 1 and values["answer"] == 1 and 0 < values["diversity"] <= 1
    assert total == pytest.approx(1.0 + 0.1 + 0.3 * values["diversity"])
    # DEDR is not bounded below (see dedr.py): the top-5 of p can hold a candidate that pulls the
    # mean off mu*, so a few references score slightly below 0; none reaches 1.
    items = task.train_items()
    s = shapes_mood_reward().score([Sample(QUESTION, x.reference, x.meta) for x in items])
    div = s.values[:, 2]
    assert (s.values[:, :2] == 1).all() and (div < 1).all() and (div > -0.2).all()
    assert (div > 0).float().mean() > 0.9


def test_wrong_answer_and_answer_gated_by_format(task):
    item = task.train_items()[0]
    wrong = item.reference.replace(f"<answer>{item.answer}</answer>", "<answer>boredom</answer>")
    values, _ = score(wrong, item.meta)
    assert values["format"] == 1 and values["answer"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # missing_part; warning once per reason is tested below
        values, total = score(item.reference + " extra", item.meta)  # text after </answer>
    assert values == {"format": 0, "answer": 0, "diversity": 0} and total == 0


def _bump(reason, text, meta):
    before = MOOD_WARNINGS[reason]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        values, _ = score(text, meta)
    assert MOOD_WARNINGS[reason] == before + 1, reason
    return values


def test_bad_inputs_score_zero_on_their_atom_and_are_counted(task):
    meta = task.train_items()[0].meta
    meta = {**meta, "answer": "anger"}
    cases = {
        "bad_box": REF.replace("[98,107,527,536]", "the red one"),  # no parseable box
        "wrong_count": REF.replace(", amusement", ""),  # 4 candidates
        "no_candidates": REF.replace("anger, excitement, fear, disgust, amusement", " "),
        "missing_part": REF.replace("<step2>a red triangle</step2> ", ""),
    }
    for reason, text in cases.items():
        assert _bump(reason, text, meta) == {"format": 0, "answer": 0, "diversity": 0}
    assert _bump("bad_box", REF.replace("[98,107,527,536]", "[0,0,2000,10]"), meta)["format"] == 0
    # an emotion outside the lexicon: the format holds, the answer counts, diversity is 0
    values = _bump("unknown_emotion", REF.replace("disgust", "boredom"), meta)
    assert values == {"format": 1, "answer": 1, "diversity": 0}


def test_each_reason_warns_once_per_process(task):
    meta = task.train_items()[0].meta
    sm._WARNED.discard("bad_box")
    text = REF.replace("[98,107,527,536]", "[5,5,5,5]")
    with pytest.warns(RuntimeWarning, match="bad_box"):
        score(text, meta)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        score(text, meta)  # the second time: counted, not warned


# ---------------------------------------------------------------------------- DEDR


def test_dedr_by_hand():
    # K=3, z = e0, e_x, e_y; mu = 0, sigma = 1: the mean (1/3, 1/3, 0) has D_all = sqrt(2)/3;
    # without z0 the mean is (1/2, 1/2, 0): D = sqrt(1/2); without z1 or z2: D = 1/2.
    d_all = math.sqrt(2) / 3
    delta = [math.sqrt(0.5) - d_all, 0.5 - d_all, 0.5 - d_all]  # 0.2357, 0.0286, 0.0286
    w = [0.2, 0.3, 0.5]
    expected = math.exp(-d_all**2 / 2) * sum(wk * (1 - math.exp(-dk / 0.5)) for wk, dk in zip(w, delta))
    assert expected == pytest.approx(0.1071, abs=1e-4)  # 0.8948 * (0.2*0.3759 + 0.8*0.0556)
    z = [[0, 0, 0], [1, 0, 0], [0, 1, 0]]
    assert dedr(z, [0, 0, 0], [1, 1, 1], w, tau_ctr=1.0, tau_div=0.5) == pytest.approx(expected)
    # centred pair, diagonal sigma: D_all = 0, each leave-one-out mean is 1 sigma away: 1 - e^-2
    pair = dedr([[0, 0, 0], [1, 0, 0]], [0.5, 0, 0], [0.5, 1, 1], [0.5, 0.5])
    assert pair == pytest.approx(1 - math.exp(-2))
    assert dedr([[0.3, 0.2, 0.1]], [0, 0, 0], [1, 1, 1], [1.0]) == 0.0  # K = 1
    with pytest.raises(ValueError, match="sigma > 0"):
        dedr(z, [0, 0, 0], [1, 0, 1], w)
    with pytest.raises(ValueError, match="one weight per candidate"):
        dedr(z, [0, 0, 0], [1, 1, 1], [0.5, 0.5])


def test_dedr_is_computed_in_float64():
    # the centred pair of test_dedr_by_hand moved to mu = 1e7 + 0.5: float32 spaces numbers 1 apart
    # there (mu would round to 1e7), float64 keeps the 0.5, so R_div is still 1 - e^-2
    c = 1e7
    pair = dedr([[c, 0, 0], [c + 1, 0, 0]], [c + 0.5, 0, 0], [0.5, 1, 1], [0.5, 0.5])
    assert pair == pytest.approx(1 - math.exp(-2), abs=1e-9)


@pytest.mark.parametrize(("z", "mu", "sigma", "w"), [
    ([0.1, 0.2, 0.3], [0, 0, 0], [1, 1, 1], [1.0]),  # z not [K, D]
    ([[0.1, 0.2, 0.3]] * 2 + [[0.0, 0.0, 0.0]], [0, 0, 0], [1, 1, 1], [[0.3], [0.3], [0.4]]),  # w [K, 1]
    (torch.zeros(0, 3), [0, 0, 0], [1, 1, 1], []),  # K = 0
    ([[0.1, 0.2, 0.3], [0.0, 0.0, 0.0]], [0.0], [1.0], [0.5, 0.5]),  # a 1-D prior for 3-D candidates
    ([[0.1, 0.2, 0.3], [0.0, 0.0, 0.0]], [0, 0, 0], [1.0], [0.5, 0.5]),  # one sigma for three dims
])
def test_dedr_refuses_shapes_that_would_broadcast(z, mu, sigma, w):
    with pytest.raises(ValueError, match="dedr needs"):
        dedr(z, mu, sigma, w)


@pytest.mark.parametrize("w", [[0.7, 0.7], [1.5, -0.5], [-0.1, 0.1]])
def test_dedr_refuses_weights_that_would_lift_r_div_to_1_or_above(w):
    """R_div < 1 needs w >= 0 with sum(w) <= 1: the centred pair of test_dedr_by_hand (each term
    1 - e^-2 = 0.865) would give 1.4 x 0.865 = 1.21 with [0.7, 0.7]; a negative weight is refused
    too (on a term with Delta_k < 0 it would add). CVIG's float32 softmax weights pass."""
    z, mu, sigma = [[0, 0, 0], [1, 0, 0]], [0.5, 0, 0], [0.5, 1, 1]
    with pytest.raises(ValueError, match=r"dedr needs candidate weights w >= 0 summing to at most 1, got \["):
        dedr(z, mu, sigma, w)
    assert dedr(z, mu, sigma, [0.5, 0.5]) < 1 and dedr(z, mu, sigma, [0.3, 0.2]) < 1  # sum 1, and below 1
    assert dedr(z, mu, sigma, [1.0, 0.0]) < 1  # a zero weight (a softmax that underflowed) is fine
    with pytest.raises(ValueError, match="summing to at most 1"):  # float32 rounding is 1e-7, not this
        dedr(z, mu, sigma, [0.5, 0.5001])
    soft = torch.softmax(torch.tensor([0.3, -1.2, 0.05, 2.0, 0.7]) / 0.05, 0).tolist()  # CVIG's float32 weights
    assert dedr([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0]], [0.4, 0.4, 0.2], [1, 1, 1], soft) < 1


def test_dedr_refuses_a_zero_temperature_either_one():
    z, w = [[0, 0, 0], [1, 0, 0]], [0.5, 0.5]
    with pytest.raises(ValueError, match="tau_ctr and tau_div must be > 0, got 0.0, 0.5"):
        dedr(z, [0, 0, 0], [1, 1, 1], w, tau_ctr=0.0, tau_div=0.5)
    with pytest.raises(ValueError, match="tau_ctr and tau_div must be > 0, got 1.0, 0.0"):
        dedr(z, [0, 0, 0], [1, 1, 1], w, tau_ctr=1.0, tau_div=0.0)


def test_spread_candidates_around_the_prior_beat_a_collapsed_set():
    scene = Scene([Shape("circle", "green", 30, 30, 40), Shape("triangle", "red", 80, 80, 44)], 112)
    dist = label_dist(scene)
    mu, sigma = prior(dist)
    w = [1 / K] * K
    spread = dedr([VAD[e] for e in top_k(dist)], mu, sigma, w)
    collapsed = dedr([VAD[top_k(dist)[0]]] * K, mu, sigma, w)  # Delta_k = 0 for every k
    off = dedr([VAD[e] for e in ("sadness", "fear", "disgust", "anger", "awe")], mu, sigma, w)
    assert collapsed == pytest.approx(0.0) and spread > 0.05 and spread > off


# ---------------------------------------------------------------------------- metrics, config


def test_coverage_and_metrics(task):
    dist = {e: 0.0 for e in EMOTIONS} | {"anger": 0.5, "fear": 0.3, "awe": 0.2}
    assert coverage(["anger", "Fear ", "anger", "boredom"], dist) == pytest.approx(0.8)
    assert coverage(None, dist) == 0.0
    # the first K (5) only: a list of every emotion would cover the whole distribution
    assert coverage(["boredom", "joy", "sadness", "disgust", "contentment", "anger", "fear", "awe"], dist) == 0.0
    items = task.eval_items()[:4]
    texts = [items[0].reference, items[1].reference.replace("<answer>", "<answer>x"), "junk", ""]
    m = mood_metrics(texts, items)
    cov = [coverage(top_k(it.meta["label_dist"]), it.meta["label_dist"]) for it in items[:2]]
    assert m == pytest.approx({"accuracy": 0.25, "coverage": sum(cov) / 4, "format": 0.5})
    with pytest.raises(ValueError, match="as many completions"):
        mood_metrics(texts[:2], items)


def test_config_builds_the_task_with_its_reward():
    cfg = load_config(VLMTrainConfig, overrides=["task.type=shapes-mood", "task.num_train=30",
                                                 "task.num_eval=10", "task.num_ood=5"])
    assert isinstance(cfg.task, ShapesMoodTaskConfig)
    task = backend.build_task(cfg)
    assert task.name == "shapes-mood" and len(task.train) == 30 and len(task.eval_items) == 10
    assert list(task.reward.names) == ["format", "answer", "diversity"]
    data = ShapesMood(**cfg.task.model_dump(exclude={"type", "diversity_weight"}))
    assert [x.reference for x in data.train_items()] == [x.reference for x in task.train]
    assert len(data.ood_items()) == 5
    plain = backend.build_task(load_config(VLMTrainConfig, overrides=[
        "task.type=shapes-mood", "task.num_train=5", "task.num_eval=5", "task.diversity_weight=0"]))
    assert list(plain.reward.names) == ["format", "answer"]  # GRPO's reward in the DSPO comparison
    half = backend.build_task(load_config(VLMTrainConfig, overrides=[
        "task.type=shapes-mood", "task.num_train=5", "task.num_eval=5", "task.diversity_weight=0.5"]))
    assert half.reward.atoms[-1].weight == 0.5 and half.reward.atoms[-1].parents == ("format",)
    # the other tasks keep the shapes-qa atoms
    qa = backend.build_task(load_config(VLMTrainConfig, overrides=["task.num_train=5", "task.num_eval=5"]))
    assert list(qa.reward.names) == ["format", "answer"]
    bad = load_config(VLMTrainConfig, overrides=["task.type=shapes-mood",
                                                 "task.ood_compositions=[[red, mauve]]"])
    with pytest.raises(ConfigError, match="shapes-mood"):
        backend.build_task(bad)


# ---------------------------------------------------------------------------- what a mutation audit found unpinned


def test_reference_cites_the_trigger_in_ymin_xmin_order():
    # a blue square (48 px, centred x 80, y 30) and a blue triangle (36 px, centred x 30, y 80).
    # sadness: square 48^2 (.1 + .4 + .2) = 1612.8, triangle .5 * 36^2 (.1 + .4) = 324 -> the mode,
    # the square its trigger; awe 1267.2 + 194.4 = 1461.6, fear 691.2 + 388.8 = 1080,
    # contentment 691.2 + 194.4 = 885.6, disgust 576 + 64.8 = 640.8 (then excitement 424.8).
    # The square spans x 56-104, y 6-54 of 112 px: [ymin, xmin, ymax, xmax] = [54, 500, 482, 929]
    scene = Scene([Shape("square", "blue", 80, 30, 48), Shape("triangle", "blue", 30, 80, 36)], 112)
    item = sm._make_item(scene, "train")
    assert item.reference == ("<step1>[54,500,482,929]</step1> <step2>a blue square</step2> "
                              "<step3>sadness, awe, fear, contentment, disgust</step3> <answer>sadness</answer>")
    assert item.answer == item.meta["answer"] == "sadness" and item.meta["trigger_box"] == [54, 500, 482, 929]


def test_box_edges_and_the_area_of_a_box_that_is_not_square():
    # [ymin, xmin, ymax, xmax] = [100, 200, 300, 600]: 0.2 of the side high, 0.4 wide
    assert box_area_fraction([100, 200, 300, 600]) == pytest.approx(0.08)
    assert sm.valid_box([0, 0, 1000, 1000]) and box_area_fraction([0, 0, 1000, 1000]) == 1.0  # the whole image
    for bad in ([5, 5, 9, 5], [0, 0, 10, 1001], [-1, 0, 10, 10], [0, -1, 10, 10]):
        assert not sm.valid_box(bad), bad


def test_parse_reads_the_last_of_each_tag_and_a_box_that_is_only_a_box():
    r = parse_mood("<answer>fear</answer> <step1>[1,2,3,4]</step1> <step1>[5,6,7,8]</step1> <answer>anger</answer>")
    assert r.answer == "anger" and r.box == (5, 6, 7, 8)
    assert parse_mood("<step1>[1,2,3,4] and [5,6,7,8]</step1>").box is None
    assert parse_mood("<step1>[1,2,3,4] px</step1>").box is None
    assert parse_mood("<step1>1, 2, 3, 4</step1>").box == (1, 2, 3, 4)  # the brackets are optional
    assert parse_mood("<step1>[1, 2, 3, 4</step1>").box is None  # ... but both or neither
    assert parse_mood("<step1>1, 2, 3, 4]</step1>").box is None
    assert parse_mood("<step2>A Red  Triangle</step2>").reaction == "a red triangle"


@pytest.mark.parametrize("text, reason", [
    (REF, None),
    (REF.replace("[98,107,527,536]", "[0,0,1000,1000]"), None),  # the whole image is a box
    (REF.replace("<step2>a red", "<step2>a <step2>red"), "missing_part"),  # a tag opened twice
    (REF.replace("<step1>[98,107,527,536]</step1> <step2>a red triangle</step2>",
                 "<step2>a red triangle</step2> <step1>[98,107,527,536]</step1>"), "missing_part"),  # out of order
    (REF.replace("<step2>a red triangle</step2>", "<step2> </step2>"), "missing_part"),  # empty reaction
    (REF.replace("<answer>anger</answer>", "<answer> . </answer>"), "missing_part"),  # empty answer
    (REF.replace("[98,107,527,536]", "[98,107,527,536] px"), "bad_box"),
    (REF.replace("[98,107,527,536]", "[98,107,527,1001]"), "bad_box"),
    (REF.replace("excitement", "anger"), "wrong_count"),  # five, but anger twice
    (REF.replace("amusement", "amusement, sadness"), "wrong_count"),  # six
    (REF.replace("amusement", "amusement, anger"), "wrong_count"),  # six, five of them distinct
])
def test_format_problem_names_each_broken_rule(text, reason):
    assert sm.format_problem(text) == reason


def test_a_right_answer_with_a_repeated_candidate_scores_nothing():
    meta = {"answer": "anger", "mu": [0.5, 0.5, 0.5], "sigma": [0.2, 0.2, 0.2]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        values, total = score(REF.replace("excitement", "anger"), meta)
    assert values == {"format": 0, "answer": 0, "diversity": 0} and total == 0


def test_answer_atom_needs_the_whole_emotion():
    meta = {"answer": "anger", "mu": [0.5, 0.5, 0.5], "sigma": [0.2, 0.2, 0.2]}
    for answer, right in (("anger", 1), (" Anger. ", 1), ("ang", 0), ("nger", 0), ("fear", 0)):
        values, _ = score(REF.replace("<answer>anger</answer>", f"<answer>{answer}</answer>"), meta)
        assert values["format"] == 1 and values["answer"] == right, answer
    with pytest.raises(ValueError, match='reference "answer"'):
        sm.mood_answer_atom.fn(Sample(QUESTION, REF, {"mu": [0.5] * 3, "sigma": [0.2] * 3}))


def test_diversity_by_hand_with_two_candidates():
    # candidates anger, sadness; prior mu = VAD(sadness), sigma = 1. d = |VAD(anger) - VAD(sadness)|
    # = sqrt(.115^2 + .577^2 + .493^2) = 0.7676; D_all = d/2, Delta = (-d/2, +d/2) (dropping anger
    # lands on mu). Uniform w = 1/2 each, tau_ctr 1, tau_div 0.5:
    # R = exp(-(d/2)^2 / 2) * 1/2 ((1 - e^(d/2/0.5)) + (1 - e^(-d/2/0.5))) = 0.9290 (1 - cosh 0.7676) = -0.2874
    resp = sm.MoodResponse(None, None, ["anger", "sadness"], None)
    meta = {"mu": list(VAD["sadness"]), "sigma": [1.0, 1.0, 1.0]}
    assert sm.diversity(resp, meta) == pytest.approx(-0.28739, abs=1e-4)
    # the reward's atom takes the prior from the sample's meta: sigma 0.5 doubles every distance,
    # D_all = 0.7676, Delta = (-0.7676, +0.7676): exp(-0.7676^2 / 2) (1 - cosh(0.7676 / 0.5)) = 0.7448 * -1.4288
    half = {**meta, "sigma": [0.5, 0.5, 0.5]}
    text = "<step3>anger, sadness</step3>"
    assert sm.mood_div_atom.fn(Sample(QUESTION, text, half)) == pytest.approx(-1.06422, abs=1e-4)
    with pytest.raises(ValueError, match='prior "mu" and "sigma"'):
        sm.diversity(resp, {"mu": meta["mu"]})


def test_metrics_accuracy_ignores_the_format_and_needs_items():
    dist = {e: 0.0 for e in EMOTIONS} | {"anger": 0.6, "fear": 0.4}
    item = QAItem([], QUESTION, "anger", REF, {"answer": "anger", "label_dist": dist})
    m = mood_metrics([REF + " and more"], [item])  # text after </answer>: no format, the answer still right
    assert m == pytest.approx({"accuracy": 1.0, "coverage": 1.0, "format": 0.0})
    with pytest.raises(ValueError, match="as many completions"):
        mood_metrics([], [])
