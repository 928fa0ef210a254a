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


@pytest.mark.parametrize("kind, params, objects, message", [
    # nothing listed: the count never read its colour and answered "0"
    ("count_colour", {}, [], "do not fit question kind 'count_colour': no 'colour'"),
    ("count_shape", {"colour": "red"}, [("red", "circle")], "no 'shape'"),
    ("colour_of", {"shape": 3}, [], "'shape' must be a str, got int"),
    ("shape_of", {}, None, "no 'colour'"),  # an unparsed reasoning does not hide it either
    ("left_of", {"a": {"colour": "red", "shape": "circle"}}, [], "no 'b'"),
    ("left_of", {"a": {"colour": "red"}, "b": {"colour": "blue", "shape": "square"}}, [("red", "circle")],
     "'a' must be {\"colour\": str, \"shape\": str}, got {'colour': 'red'}"),
    ("count_colour", ["red"], [], "do not fit question kind 'count_colour': not a dict but list"),
])
def test_implied_answer_checks_its_params_up_front(kind, params, objects, message):
    with pytest.raises(ValueError) as err:
        implied_answer(kind, params, objects)
    assert message in str(err.value)


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


# ---------------------------------------------------------------------------- edges the tests above left open


def _tiny_classifier(labels, dropout=0.0):
    """A random 1-layer ModernBERT pair classifier with the asset's tokenizer, built in memory."""
    from transformers import AutoTokenizer, ModernBertConfig, ModernBertForSequenceClassification

    tok = AutoTokenizer.from_pretrained(repo_root() / ASSET)
    torch.manual_seed(0)
    config = ModernBertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                              intermediate_size=32, layer_types=["full_attention"], pad_token_id=tok.pad_token_id,
                              cls_token_id=tok.cls_token_id, sep_token_id=tok.sep_token_id,
                              num_labels=len(labels), id2label=dict(enumerate(labels)), embedding_dropout=dropout,
                              mlp_dropout=dropout, attention_dropout=dropout, classifier_dropout=dropout)
    return ModernBertForSequenceClassification(config), tok


def test_left_of_needs_two_different_objects_each_listed_once():
    rc, bs = ("red", "circle"), ("blue", "square")
    same = {"a": LEFT["a"], "b": LEFT["a"]}  # "is the red circle left of the red circle?"
    assert implied_answer("left_of", same, [rc, bs]) is None
    assert implied_answer("left_of", LEFT, [rc, bs, bs]) is None  # b listed twice
    assert implied_answer("left_of", LEFT, [bs, rc, bs]) is None


def test_params_of_the_wrong_type_are_a_value_error():
    objs = [("red", "circle")]
    with pytest.raises(ValueError, match="do not fit question kind 'left_of'"):
        implied_answer("left_of", {"a": "red circle", "b": "blue square"}, objs)  # str["colour"]: TypeError
    with pytest.raises(ValueError, match="do not fit question kind 'colour_of'"):
        implied_answer("colour_of", None, objs)


def test_split_completion_reads_the_last_closed_answer_stripped_and_lower_cased():
    assert split_completion("a red circle <answer> Red \n</answer>") == ("a red circle ", "red")
    assert split_completion("no answer") == ("no answer", None)
    assert split_completion("a red circle <answer>\nTwo\n</answer>") == ("a red circle ", "two")  # across lines
    # an <answer> left open is reasoning: the answer is the innermost closed one
    assert split_completion("a red circle <answer>1 <answer>2</answer>") == ("a red circle <answer>1 ", "2")


def test_is_consistent_needs_both_kind_and_params():
    text = "a red circle <answer>1</answer>"
    for meta in ({"kind": "count_colour"}, {"params": {"colour": "red"}}, None):
        with pytest.raises(ValueError, match='"kind" and "params"'):
            is_consistent(Sample("q", text, meta))


def test_hypothesis_collapses_whitespace():
    assert hypothesis(" a red \n circle ") == "The final answer is a red circle."
    assert hypothesis(2) == "The final answer is 2."


def test_prob_refuses_a_batch_size_below_1(model):
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        model.prob(["p"], ["h"], batch_size=0)


def test_prob_truncates_the_premise_to_the_models_limit(model):
    """A pair over max_length is cut to max_length tokens, the (longer) premise losing tokens
    and the hypothesis kept whole."""
    cut = ConsistencyModel(model.model, model.tokenizer)
    cut.max_length = 16
    seen = []
    handle = model.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"]), with_kwargs=True)
    try:
        cut.prob([premise("How many red shapes are there?", " , ".join(["a red circle"] * 20))], [hypothesis("2")])
    finally:
        handle.remove()
    hyp = model.tokenizer(hypothesis("2"), add_special_tokens=False)["input_ids"]
    ids = seen[0][0].tolist()
    assert len(ids) == 16 and ids[-len(hyp) - 1:-1] == hyp  # [CLS] premise... [SEP] hypothesis [SEP]


def test_prob_is_deterministic_after_a_caller_trained_the_model():
    net, tok = _tiny_classifier(["inconsistent", "consistent"], dropout=0.5)
    cm = ConsistencyModel(net, tok)
    net.train()  # e.g. a caller fine-tuning it between scorings
    pairs = [premise("How many red shapes are there?", "a red circle")] * 4, [hypothesis("1")] * 4
    first = cm.prob(*pairs)
    assert not net.training and torch.equal(first, cm.prob(*pairs)) and torch.allclose(first, first[0].expand(4))


def test_the_consistent_label_is_found_whatever_its_case():
    net, tok = _tiny_classifier(["CONSISTENT", "Inconsistent"])
    assert ConsistencyModel(net, tok).index == 0


def test_atom_scores_the_normalised_answer(model):
    atom = consistency_atom(model, parents=())
    q = "How many red shapes are there?"
    words, digits = atom([Sample(q, "a red circle , a red square <answer>Two.</answer>", {}),
                          Sample(q, "a red circle , a red square <answer>2</answer>", {})])
    assert words == digits and digits > 0.5  # both read as hypothesis "The final answer is 2."


def test_atom_defaults_lambda_1_gated_by_format(model):
    cc = {"colour": "red"}
    samples = [sample("count_colour", cc, "a red circle <answer>1</answer>", "How many red shapes are there?"),
               sample("count_colour", cc, "a red circle <answer>1</answer> and more", "How many red shapes are there?")]
    scores = Reward([format_atom, consistency_atom(model)]).score(samples)
    cons = scores.values[:, 1]
    assert consistency_atom(model, parents=())(samples[1:])[0] > 0.5  # ungated, the second scores
    assert cons[0] > 0.5 and cons[1] == 0  # text after </answer>: no format, so no consistency score
    assert torch.allclose(scores.total, torch.tensor([0.1 + 1.0 * float(cons[0]), 0.0]))


def test_atom_needs_text_and_a_text_question(model):
    atom = consistency_atom(model, parents=())
    with pytest.raises(TypeError, match="decoded completion text, got Tensor"):
        atom([Sample("q", torch.tensor([1, 2]), {})])
    with pytest.raises(TypeError, match="question text"):
        atom([Sample(["chat"], "a red circle <answer>1</answer>", {"question": 5})])


def test_from_pretrained_needs_a_path():
    with pytest.raises(ValueError, match="a path is needed"):
        ConsistencyModel.from_pretrained("")


def test_prob_is_float32_for_a_low_precision_model():
    net, tok = _tiny_classifier(["inconsistent", "consistent"])
    probs = ConsistencyModel(net.to(torch.bfloat16), tok).prob(["a red circle"] * 2, [hypothesis("1")] * 2)
    assert probs.dtype == torch.float32 and probs.shape == (2,)


def test_atom_puts_each_score_on_its_own_sample(model):
    """Samples without an answer score 0 wherever they sit in the batch; the others keep their
    own probability, not a neighbour's."""
    q = "How many red shapes are there?"
    texts = ["a red circle", "a red circle , a red square <answer>2</answer>", "a red square",
             "a red circle , a red square <answer>0</answer>"]
    scores = consistency_atom(model, parents=())([Sample(q, t, {}) for t in texts])
    alone = model.prob([premise(q, "a red circle , a red square ")] * 2, [hypothesis("2"), hypothesis("0")])
    assert scores[0] == 0 and scores[2] == 0
    assert scores[1] == pytest.approx(float(alone[0]), abs=1e-5) and scores[3] == pytest.approx(float(alone[1]), abs=1e-5)
    assert scores[1] > 0.5 > scores[3]


def test_every_question_kind_has_its_params_listed():
    """implied_answer checks params against a table of its own: a kind added to shapes_qa
    without a row there would fail every item of that kind with a KeyError."""
    from mmrl.vlm import consistency
    from mmrl.vlm.tasks.shapes_qa import KINDS

    assert set(consistency._PARAMS) == set(KINDS)
