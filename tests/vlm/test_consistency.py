"""CORA's consistency check (mmrl/vlm/consistency.py): the exact shapes-qa checker, the
bundled NLI-style classifier (assets/tiny-consistency-modernbert) and its reward atom."""

import importlib.util
import json
import math

import pytest
import torch

from mmrl.core.rewards import Reward, Sample
from mmrl.vlm.consistency import (
    ConsistencyModel,
    consistency_atom,
    hypothesis,
    implied_answer,
    inconsistency_rate,
    is_consistent,
    parse_reasoning,
    premise,
    split_completion,
)
from mmrl.vlm.models import repo_root
from mmrl.vlm.tasks.shapes_qa import format_atom, generate_items, to_sample

ASSET = "assets/tiny-consistency-modernbert"
THRESHOLD = 0.93  # the asset measured 0.977 on 2000 held-out pairs (its train.json), 0.985 on these
LEFT = {"a": {"colour": "red", "shape": "circle"}, "b": {"colour": "blue", "shape": "square"}}


def _script():
    spec = importlib.util.spec_from_file_location(
        "train_consistency_model", repo_root() / "scripts" / "train_consistency_model.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def model():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only add contention
    yield ConsistencyModel.from_pretrained(ASSET)
    torch.set_num_threads(n)


def sample(kind, params, completion, question="q"):
    return Sample(question, completion, {"kind": kind, "params": params})


# ---------------------------------------------------------------------------- exact check


def test_parse_reasoning():
    rc, bs = ("red", "circle"), ("blue", "square")
    assert parse_reasoning("a red circle , a blue square") == [rc, bs]
    assert parse_reasoning("  A Red circle,a blue   square.\n") == [rc, bs]  # case, spacing, "."
    assert parse_reasoning("a yellow triangle") == [("yellow", "triangle")]
    assert parse_reasoning("nothing") == []  # describe() of an empty scene
    for bad in ["", "  ", "a red circle a blue square", "a purple circle", "a red hexagon",
                "red circle", "the red circle", "a red circles", "a red circle ,", ", a red circle",
                "two red circles", "a red circle , a blue"]:
        assert parse_reasoning(bad) is None, bad


def test_implied_answer_counts():
    objs = [("red", "circle"), ("red", "square"), ("blue", "circle")]
    assert implied_answer("count_colour", {"colour": "red"}, objs) == "2"
    assert implied_answer("count_colour", {"colour": "green"}, objs) == "0"
    assert implied_answer("count_shape", {"shape": "circle"}, objs) == "2"
    assert implied_answer("count_shape", {"shape": "triangle"}, []) == "0"


def test_implied_answer_colour_and_shape_of():
    objs = [("red", "circle"), ("green", "square"), ("blue", "circle")]
    assert implied_answer("colour_of", {"shape": "square"}, objs) == "green"
    assert implied_answer("colour_of", {"shape": "circle"}, objs) is None  # two circles
    assert implied_answer("colour_of", {"shape": "triangle"}, objs) is None  # none
    assert implied_answer("shape_of", {"colour": "green"}, objs) == "square"
    assert implied_answer("shape_of", {"colour": "yellow"}, objs) is None
    assert implied_answer("shape_of", {"colour": "red"}, objs + [("red", "square")]) is None


def test_implied_answer_left_of():
    rc, bs, gt = ("red", "circle"), ("blue", "square"), ("green", "triangle")
    assert implied_answer("left_of", LEFT, [rc, gt, bs]) == "yes"
    assert implied_answer("left_of", LEFT, [bs, rc]) == "no"
    assert implied_answer("left_of", LEFT, [rc, gt]) is None  # b missing
    assert implied_answer("left_of", LEFT, [rc, bs, rc]) is None  # a listed twice
    assert implied_answer("left_of", LEFT, None) is None


def test_implied_answer_bad_input():
    with pytest.raises(ValueError, match="unknown question kind 'size_of'"):
        implied_answer("size_of", {}, [])
    with pytest.raises(ValueError, match="do not fit question kind 'left_of'"):
        implied_answer("left_of", {"colour": "red"}, [("red", "circle")])


def test_reference_completions_are_consistent():
    """The SFT target describes the scene, so its reasoning implies the true answer."""
    items = generate_items(200, seed=5)
    assert {it.meta["kind"] for it in items} == {"count_colour", "count_shape", "colour_of", "shape_of", "left_of"}
    for it in items:
        reasoning, answer = split_completion(it.reference)
        assert answer == it.answer
        assert implied_answer(it.meta["kind"], it.meta["params"], parse_reasoning(reasoning)) == it.answer
        assert is_consistent(to_sample(it, it.reference)) is True


def test_is_consistent():
    cc = {"colour": "red"}
    assert is_consistent(sample("count_colour", cc, "a red circle , a red square <answer>2</answer>"))
    assert is_consistent(sample("count_colour", cc, "a red circle , a red square <answer>Two.</answer>"))
    assert is_consistent(sample("count_colour", cc, "a red circle <answer>2</answer>")) is False
    # wrong about the image but consistent with itself: consistency does not see the image
    assert is_consistent(sample("left_of", LEFT, "a blue square , a red circle <answer>no</answer>"))
    # the reasoning lists no square, so no colour follows from it
    assert is_consistent(sample("colour_of", {"shape": "square"}, "a red circle <answer>red</answer>")) is False
    assert is_consistent(sample("count_colour", cc, "a red circle")) is None  # no answer
    assert is_consistent(sample("count_colour", cc, "I see shapes <answer>1</answer>")) is None
    assert is_consistent(sample("count_colour", cc, "a red circle <answer>1</answer> <answer>1</answer>")) is None
    with pytest.raises(ValueError, match='"kind" and "params"'):
        is_consistent(Sample("q", "a red circle <answer>1</answer>", {"answer": "1"}))


def test_inconsistency_rate():
    cc = {"colour": "red"}
    samples = [
        sample("count_colour", cc, "a red circle <answer>1</answer>"),  # consistent
        sample("count_colour", cc, "a red circle <answer>3</answer>"),  # inconsistent
        sample("count_colour", cc, "a blue circle <answer>1</answer>"),  # inconsistent
        sample("count_colour", cc, "no answer here"),  # not checkable
    ]
    assert inconsistency_rate(samples) == (2 / 3, 3)
    rate, n = inconsistency_rate(samples[3:])
    assert math.isnan(rate) and n == 0


def test_premise_and_hypothesis():
    assert premise("How many red shapes are there?", " a red circle \n") == (
        "How many red shapes are there? a red circle"
    )
    assert hypothesis("2") == "The final answer is 2."


# ---------------------------------------------------------------------------- the classifier


def test_training_role_labels():
    """The training script's auxiliary labels: which listed objects the question names and,
    for left_of, whether object a comes before b; they sit on colour and shape words."""
    script = _script()
    objs = [("red", "circle"), ("red", "square"), ("blue", "square")]
    assert script.roles("count_colour", {"colour": "red"}, objs) == [1, 1, 0]
    assert script.roles("colour_of", {"shape": "circle"}, objs) == [1, 0, 0]
    assert script.roles("left_of", LEFT, objs) == [2, 0, 1]  # a listed before b: "yes"
    assert script.roles("left_of", LEFT, objs[::-1]) == [1, 0, 3]
    assert script.roles("left_of", LEFT, objs[:2]) == [3, 0]  # b missing: no answer follows
    tok = script.build_tokenizer(256)
    pairs = script.make_pairs(40, seed=3, split="test")
    ids, mask, labels, role = script.encode(tok, pairs)
    assert ids.shape == mask.shape == role.shape and labels.tolist() == [1, 0] * 20
    assert (ids != tok.unk_token_id).all()
    assert (role >= 0).sum() == 2 * sum(len(p["roles"]) for p in pairs)


def test_asset_is_small_and_recorded():
    folder = repo_root() / ASSET
    assert sum(f.stat().st_size for f in folder.iterdir()) < 3 * 2**20
    record = json.loads((folder / "train.json").read_text())
    assert set(record["held_out"]["accuracy"]) >= {"count_colour", "left_of", "all"}


def test_asset_scores_held_out_pairs(model):
    """Fresh pairs (a seed and split training never used): the labels agree with the exact
    checker, and the bundled model (held-out accuracy in its train.json) gets most right."""
    pairs = _script().make_pairs(400, seed=4242, split="test")
    assert sum(p["label"] for p in pairs) == 200  # balanced
    for p in pairs:
        s = sample(p["kind"], p["params"], f"{p['reasoning']} <answer>{p['answer']}</answer>")
        assert is_consistent(s) is bool(p["label"])
    probs = model.prob([p["premise"] for p in pairs], [p["hypothesis"] for p in pairs])
    assert probs.shape == (400,) and ((probs >= 0) & (probs <= 1)).all()
    labels = torch.tensor([p["label"] for p in pairs])
    accuracy = ((probs > 0.5).long() == labels).float().mean().item()
    assert accuracy > THRESHOLD, accuracy


def test_prob_batching_and_bad_input(model):
    premises = [premise("How many red shapes are there?", "a red circle , a red square")] * 3
    hypotheses = [hypothesis(a) for a in ("2", "1", "0")]
    one_batch = model.prob(premises, hypotheses)
    assert torch.allclose(model.prob(premises, hypotheses, batch_size=1), one_batch, atol=1e-5)
    assert one_batch[0] > 0.5 > one_batch[1]  # 2 red shapes listed: "2" follows, "1" does not
    assert model.prob([], []).shape == (0,)
    with pytest.raises(ValueError, match="3 premises for 2 hypotheses"):
        model.prob(premises, hypotheses[:2])


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        ConsistencyModel.from_pretrained(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="not a sequence classifier"):
        ConsistencyModel.from_pretrained("assets/tiny-dllm")  # a causal LM
    from transformers import ModernBertConfig, ModernBertForSequenceClassification

    config = ModernBertConfig(vocab_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                              intermediate_size=32, layer_types=["full_attention"], pad_token_id=0,
                              bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    ModernBertForSequenceClassification(config).save_pretrained(tmp_path / "unlabelled")
    with pytest.raises(ValueError, match="no 'consistent' label"):
        ConsistencyModel.from_pretrained(tmp_path / "unlabelled")


# ---------------------------------------------------------------------------- the reward atom


def test_atom_in_a_reward(model):
    cc = {"colour": "red"}
    q = "How many red shapes are there?"
    samples = [
        sample("count_colour", cc, "a red circle , a red square <answer>2</answer>", q),
        sample("count_colour", cc, "a red circle , a red square <answer>0</answer>", q),
        sample("count_colour", cc, "a red circle , a red square", q),  # no answer
    ]
    ungated = Reward([format_atom, consistency_atom(model, weight=0.5, parents=())])
    scores = ungated.score(samples)
    cons = scores.values[:, 1]
    assert ((cons >= 0) & (cons <= 1)).all()
    assert cons[2] == 0  # called on it, and scored 0 rather than crashing
    assert cons[0] > 0.5 > cons[1]  # consistent vs inconsistent answer
    assert torch.allclose(scores.total, 0.1 * scores.values[:, 0] + 0.5 * cons)  # lambda = weight
    gated = Reward([format_atom, consistency_atom(ASSET, name="cons")]).score(samples)  # from a path
    assert gated.names == ["format", "cons"]
    assert torch.allclose(gated.values[:2, 1], cons[:2], atol=1e-5) and gated.values[2, 1] == 0


def test_atom_reads_the_question_from_meta(model):
    atom = consistency_atom(model, parents=())
    q, text = "How many red shapes are there?", "a red circle <answer>1</answer>"
    from_meta = atom([Sample(["chat", "messages"], text, {"question": q})])[0]
    assert from_meta == pytest.approx(atom([Sample(q, text, {})])[0]) and from_meta > 0.5
    with pytest.raises(TypeError, match="question text"):
        atom([Sample(["chat"], "a red circle <answer>1</answer>", {})])


def test_answers_of_another_kind_are_inconsistent(model):
    """A policy trained on the classifier's score found that "1" to a shape question scored
    as consistent when the classifier had never seen an answer of the wrong kind; the
    training pairs now hold such negatives."""
    q = "What shape is the red object?"
    p = model.prob([premise(q, "a red triangle")] * 4, [hypothesis(a) for a in ("triangle", "1", "square", "yes")])
    assert float(p[0]) > 0.9 and bool((p[1:] < 0.1).all())
    q = "How many red shapes are there?"
    p = model.prob([premise(q, "a red triangle , a blue square")] * 3, [hypothesis(a) for a in ("1", "red", "no")])
    assert float(p[0]) > 0.9 and bool((p[1:] < 0.1).all())
