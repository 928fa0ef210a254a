"""The shapes-qa task (mmrl/vlm/tasks/shapes_qa.py): generation, held-out split, rewards."""

import random
import re
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mmrl.core.rewards import Reward, Sample, reward_atom
from mmrl.vlm.policy import to_sample as vlm_sample
from mmrl.vlm.task import VLMTask
from mmrl.vlm.tasks.scenes import COLOURS, SHAPES, Scene, Shape, describe, render
from mmrl.vlm.tasks.shapes_qa import (
    KINDS,
    QAItem,
    ShapesQA,
    accuracy,
    answer_atom,
    extract_answer,
    format_atom,
    generate_items,
    normalize,
    shapes_qa_reward,
    to_sample,
)


def key(item):
    return item.question, str(item.meta["scene"])


def score(completion, answer):
    s = shapes_qa_reward().score([Sample("q", completion, {"answer": answer})])
    return s.values[0].tolist(), float(s.total[0])


# ---------------------------------------------------------------------------- generation


def test_generation_is_deterministic():
    a = generate_items(30, seed=3)
    b = generate_items(30, seed=3)
    c = generate_items(30, seed=4)
    assert [(x.question, x.answer, x.reference, x.meta) for x in a] == [
        (x.question, x.answer, x.reference, x.meta) for x in b
    ]
    assert all(x.images[0].tobytes() == y.images[0].tobytes() for x, y in zip(a, b))
    assert [key(x) for x in a] != [key(x) for x in c]
    # item i depends only on (seed, i): a longer list extends a shorter one
    assert [key(x) for x in generate_items(10, seed=3)] == [key(x) for x in a[:10]]


def test_item_fields():
    for item in generate_items(40, seed=0):
        assert len(item.images) == 1
        assert item.images[0].mode == "RGB" and item.images[0].size == (112, 112)
        scene = Scene.from_dict(item.meta["scene"])
        assert item.images[0].tobytes() == render(scene).tobytes()
        assert item.reference == f"{describe(scene)} <answer>{item.answer}</answer>"
        assert item.meta["answer"] == item.answer
        assert item.meta["kind"] in KINDS
        assert re.fullmatch(r"[A-Z][a-z ]+\?", item.question)


def test_kinds_are_uniform_and_restrictable():
    kinds = Counter(item.meta["kind"] for item in generate_items(500, seed=1))
    assert set(kinds) == set(KINDS)
    assert min(kinds.values()) > 500 / 5 * 0.6  # roughly 100 each
    only = generate_items(20, seed=1, kinds=["left_of", "count_shape"])
    assert {item.meta["kind"] for item in only} == {"left_of", "count_shape"}
    with pytest.raises(ValueError, match="unknown question kind"):
        generate_items(2, seed=0, kinds=["size_of"])
    with pytest.raises(ValueError, match="left_of"):
        generate_items(2, seed=0, kinds=["left_of"], max_shapes=1)


def recount(item) -> str:
    """The answer worked out again from the stored scene, independently of the generator."""
    shapes = item.meta["scene"]["shapes"]
    q = item.question
    if m := re.fullmatch(r"How many (red|green|blue|yellow) shapes are there\?", q):
        return str(sum(s["colour"] == m[1] for s in shapes))
    if m := re.fullmatch(r"How many (circle|square|triangle)s are there\?", q):
        return str(sum(s["shape"] == m[1] for s in shapes))
    if m := re.fullmatch(r"What colour is the (circle|square|triangle)\?", q):
        (match,) = [s for s in shapes if s["shape"] == m[1]]  # exactly one
        return match["colour"]
    if m := re.fullmatch(r"What shape is the (red|green|blue|yellow) object\?", q):
        (match,) = [s for s in shapes if s["colour"] == m[1]]
        return match["shape"]
    if m := re.fullmatch(r"Is the (\w+) (\w+) left of the (\w+) (\w+)\?", q):
        (a,) = [s for s in shapes if (s["colour"], s["shape"]) == (m[1], m[2])]
        (b,) = [s for s in shapes if (s["colour"], s["shape"]) == (m[3], m[4])]
        assert abs(a["x"] - b["x"]) >= max(a["size"], b["size"]) / 2  # clearly apart
        return "yes" if a["x"] < b["x"] else "no"
    raise AssertionError(f"unexpected question {q!r}")


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_answers_correctly(kind):
    items = generate_items(60, seed=11, kinds=[kind])
    for item in items:
        assert item.meta["kind"] == kind
        assert recount(item) == item.answer, item.question
    answers = Counter(item.answer for item in items)
    assert len(answers) >= 2  # not a constant answer
    if kind.startswith("count"):
        assert "0" in answers  # absent targets are asked sometimes ...
        assert answers["0"] < len(items) / 2  # ... but not mostly


def test_kinds_on_a_hand_made_scene():
    # two red circles (left), a blue square (right): every possible question's answer
    scene = Scene(
        [
            Shape("circle", "red", 20.0, 20.0, 24.0),
            Shape("circle", "red", 20.0, 80.0, 24.0),
            Shape("square", "blue", 80.0, 50.0, 24.0),
        ],
        112,
    )
    expected_counts = {"red": "2", "blue": "1", "green": "0", "yellow": "0"}
    for seed in range(30):
        rng = random.Random(seed)
        q, a, p = KINDS["count_colour"](scene, rng)
        assert (
            a == expected_counts[p["colour"]] and q == f"How many {p['colour']} shapes are there?"
        )
        q, a, p = KINDS["count_shape"](scene, rng)
        assert a == {"circle": "2", "square": "1", "triangle": "0"}[p["shape"]]
        # only the square is unique as a shape, only blue as a colour
        assert KINDS["colour_of"](scene, rng)[:2] == ("What colour is the square?", "blue")
        assert KINDS["shape_of"](scene, rng)[:2] == ("What shape is the blue object?", "square")
        # the red circles are not uniquely named: no relation question can be asked
        assert KINDS["left_of"](scene, rng) is None
    two = Scene(
        [Shape("circle", "red", 20.0, 20.0, 24.0), Shape("square", "blue", 80.0, 50.0, 24.0)]
    )
    asked = {KINDS["left_of"](two, random.Random(s))[:2] for s in range(30)}
    assert asked == {
        ("Is the red circle left of the blue square?", "yes"),
        ("Is the blue square left of the red circle?", "no"),
    }


def test_train_and_eval_are_disjoint_and_cached():
    task = ShapesQA(seed=0, num_train=600, num_eval=150)
    assert task.name == "shapes-qa"
    train, ev = task.train_items(), task.eval_items()
    assert len(train) == 600 and len(ev) == 150
    assert not {key(x) for x in train} & {key(x) for x in ev}
    assert task.eval_items() is ev and task.train_items() is train  # cached
    # same arguments, same sets
    again = ShapesQA(seed=0, num_train=600, num_eval=150)
    assert [key(x) for x in again.eval_items()] == [key(x) for x in ev]
    # the eval stream is not the train stream of another seed
    assert [key(x) for x in ev[:20]] != [key(x) for x in generate_items(20, seed=0)]


def test_eval_skips_items_identical_to_train():
    # one 20-pixel shape in a 24-pixel image fits in one place only: 3 shapes x 4 colours
    # = 12 scenes, so the raw eval stream repeats train items
    args = {"image_size": 24, "max_shapes": 1, "kinds": ["count_shape"], "shape_size": (20, 20)}
    task = ShapesQA(seed=0, num_train=300, num_eval=10, **args)
    train_keys = {key(x) for x in task.train_items()}
    stream = generate_items(50, seed=0, split="eval", **args)
    assert any(key(x) in train_keys for x in stream)  # the raw stream does collide ...
    assert not {key(x) for x in task.eval_items()} & train_keys  # ... the eval set does not


# ---------------------------------------------------------------------------- answer checking


def test_extract_answer_and_normalize():
    assert extract_answer("a red circle <answer> Red </answer>") == "red"
    assert extract_answer("<answer>1</answer> then <answer>2</answer>") == "2"  # the last one
    assert extract_answer("<answer>a<answer>b</answer>") == "b"
    assert extract_answer("no tags") is None
    assert extract_answer("<answer>3") is None
    assert normalize("Two.") == "2"
    assert normalize("  zero ") == "0"
    assert normalize("FOUR") == "4"
    assert normalize("light   Blue.") == "light blue"
    assert normalize(3) == "3"
    assert normalize("yes") == "yes"


def test_reference_scores_one_on_both_atoms():
    reward = shapes_qa_reward()
    assert reward.names == ["format", "answer"]
    assert reward.weights.tolist() == pytest.approx([0.1, 1.0])
    items = generate_items(25, seed=5)
    scores = reward.score([to_sample(x, x.reference) for x in items])
    assert scores.values.tolist() == [[1.0, 1.0]] * 25
    assert scores.total.tolist() == pytest.approx([1.1] * 25)  # 0.1 * 1 + 1.0 * 1


@pytest.mark.parametrize(
    "completion, answer, expected_values, expected_total",
    [
        ("a red circle <answer>2</answer>", "2", [1.0, 1.0], 1.1),  # right: 0.1 + 1.0
        ("a red circle <answer>2</answer>\n  ", "2", [1.0, 1.0], 1.1),  # trailing whitespace ok
        ("<answer>Two.</answer>", "2", [1.0, 1.0], 1.1),  # number word normalised
        ("<answer>three</answer>", "3", [1.0, 1.0], 1.1),
        ("<answer> YES </answer>", "yes", [1.0, 1.0], 1.1),
        ("a red circle <answer>3</answer>", "2", [1.0, 0.0], 0.1),  # wrong answer: format only
        ("a red circle , 2", "2", [0.0, 0.0], 0.0),  # no tags
        ("<answer>2", "2", [0.0, 0.0], 0.0),  # unclosed tag
        ("<answer>2</answer> because", "2", [0.0, 0.0], 0.0),  # text after the tag
        ("<answer>2</answer><answer>2</answer>", "2", [0.0, 0.0], 0.0),  # two answer tags
        ("<answer>1</answer> <answer>2</answer>", "2", [0.0, 0.0], 0.0),
        ("<answer> </answer>", "2", [0.0, 0.0], 0.0),  # empty answer
    ],
)
def test_atom_scores(completion, answer, expected_values, expected_total):
    values, total = score(completion, answer)
    assert values == expected_values
    assert total == pytest.approx(expected_total)


def test_answer_is_gated_by_format():
    # the right answer followed by extra text: the answer atom alone would say 1 ...
    sample = Sample("q", "<answer>2</answer> extra", {"answer": "2"})
    assert format_atom(sample) is False
    assert answer_atom(sample) is True
    # ... but it scores 0 because its parent "format" scored 0
    scores = Reward([format_atom, answer_atom]).score([sample])
    assert scores.values.tolist() == [[0.0, 0.0]]


def test_atoms_reject_bad_samples():
    with pytest.raises(Exception, match="decoded completion text"):
        shapes_qa_reward().score([Sample("q", [1, 2, 3], {"answer": "2"})])
    with pytest.raises(Exception, match='"answer"'):
        shapes_qa_reward().score([Sample("q", "<answer>2</answer>", {})])


def test_accuracy():
    items = [
        QAItem([], "How many circles are there?", "2"),
        QAItem([], "What colour is the square?", "blue"),
        QAItem([], "Is the red circle left of the blue square?", "yes"),
    ]
    completions = ["<answer>two</answer>", "<answer>red</answer>", "<answer>Yes.</answer> hm"]
    # right, wrong, right (accuracy reads the last answer tag; the format is not required)
    assert accuracy(completions, items) == pytest.approx(2 / 3)
    assert accuracy(["no answer"] * 3, items) == 0.0
    assert accuracy([x.reference for x in generate_items(10, 2)], generate_items(10, 2)) == 1.0
    with pytest.raises(ValueError):
        accuracy(["a"], items)


def test_vocabulary_is_small():
    # every word of every question and reference comes from a small fixed vocabulary
    words = set()
    for item in generate_items(300, seed=9):
        words |= set(item.question.replace("?", " ?").split())
        words |= set(re.sub(r"</?answer>", " ", item.reference).split())
    expected = set(COLOURS) | set(SHAPES) | {s + "s" for s in SHAPES} | set("01234")
    expected |= {
        "How",
        "many",
        "shapes",
        "are",
        "there",
        "?",
        "What",
        "colour",
        "is",
        "the",
        "shape",
        "object",
        "Is",
        "left",
        "of",
        "a",
        ",",
        "yes",
        "no",
    }
    assert words <= expected
    assert len(np.unique(sorted(words))) < 40


def test_heldout_accuracy_is_exact_share():
    """105 right of 200 is 0.525, not float32's 0.52499998 (which misses a 0.525 target)."""
    from types import SimpleNamespace

    from mmrl.vlm.policy import to_sample
    from mmrl.vlm.task import VLMTask

    items = [QAItem([], "What colour is the square?", "blue")] * 200
    texts = iter(["<answer>blue</answer>"] * 105 + ["<answer>red</answer>"] * 95)  # in order, batch by batch
    policy = SimpleNamespace(greedy_batches=lambda its, n, bs, stop: [
        SimpleNamespace(samples=[to_sample(it, t) for it, t in zip(its, texts)], data={})])
    task = VLMTask("qa", items, items, shapes_qa_reward(), max_new_tokens=8)
    assert task.evaluate(policy)["accuracy"] == 0.525


# ---------------------------------------------------------------------------- audit: what the suite let through


def test_count_questions_on_an_empty_scene_ask_an_absent_target():
    # nothing is present: every count question is about an absent colour or shape -> "0"
    empty = Scene([], 112)
    for seed in range(20):
        rng = random.Random(seed)
        assert KINDS["count_colour"](empty, rng)[1] == "0"
        assert KINDS["count_shape"](empty, rng)[1] == "0"


def test_kinds_need_only_as_many_shapes_as_they_name():
    # colour_of / shape_of need one shape, left_of two: max_shapes 1 and 2 are enough
    one = generate_items(10, seed=0, kinds=["colour_of", "shape_of"], max_shapes=1)
    assert {len(x.meta["scene"]["shapes"]) for x in one} == {1}
    two = generate_items(10, seed=0, kinds=["left_of"], min_shapes=2, max_shapes=2)
    assert {x.answer for x in two} <= {"yes", "no"} and len(two) == 10
    with pytest.raises(ValueError, match="at least one question kind"):
        generate_items(2, seed=0, kinds=[])


def test_shape_sizes_default_to_22_32_scaled_with_the_image_and_keep_a_given_pair():
    assert ShapesQA().shape_size == (22, 32)
    assert ShapesQA(image_size=224).shape_size == (44, 64)  # 22 * 2, 32 * 2
    assert ShapesQA(image_size=56).shape_size == (11, 16)  # 22 / 2, 32 / 2
    assert ShapesQA(shape_size=(20, 30)).shape_size == (20, 30)


def test_bad_counts_and_sizes_fail_when_the_task_is_built():
    assert generate_items(0, seed=0) == []
    with pytest.raises(ValueError, match="n must be >= 0"):
        generate_items(-1, seed=0)
    for kwargs in ({"num_train": -1}, {"num_eval": -1}):
        with pytest.raises(ValueError, match="num_train and num_eval"):
            ShapesQA(**kwargs)
    with pytest.raises(ValueError, match="too small"):  # 40-pixel shapes in a 40-pixel image
        ShapesQA(image_size=40, shape_size=(30, 40))


def test_an_answer_written_over_several_lines_scores():
    # "\n2\n" inside the tags is the answer "2" (stripped), for the atoms and accuracy alike
    assert extract_answer("<answer>\nTwo\n</answer>") == "two"
    assert score("a red circle <answer>\n2\n</answer>", "2") == ([1.0, 1.0], pytest.approx(1.1))
    assert accuracy(["<answer>\nyes\n</answer>"], [QAItem([], "q", "yes")]) == 1.0


def test_extract_answer_stops_at_the_first_closing_tag():
    assert extract_answer("<answer>2</answer> not </answer>") == "2"


def test_a_stray_closing_tag_fails_the_format():
    # one <answer>, two </answer>: not exactly one answer tag pair
    assert score("</answer> <answer>2</answer>", "2") == ([0.0, 0.0], 0.0)
    assert score("<answer>2</answer></answer>", "2") == ([0.0, 0.0], 0.0)


def test_the_reference_answer_is_normalised_too():
    # "Two." and "2" are the same answer whichever side writes it
    assert score("<answer>2</answer>", "Two.") == ([1.0, 1.0], pytest.approx(1.1))
    assert accuracy(["<answer>2</answer>"], [QAItem([], "How many circles are there?", "Two.")]) == 1.0
    assert normalize(None) == ""


def test_accuracy_of_no_items_is_refused():
    with pytest.raises(ValueError, match="empty"):
        accuracy([], [])


def test_eval_counts_a_scene_as_a_train_scene_only_if_every_shape_matches():
    from mmrl.vlm.tasks.shapes_qa import _key

    qa = ("How many circles are there?", "1", {"shape": "circle"})
    scene = Scene([Shape("circle", "red", 40.0, 40.0, 24.0)], 112)
    assert _key(scene, qa) == _key(Scene([Shape("circle", "red", 40.0, 40.0, 24.0)], 112), qa)
    for other in (Shape("circle", "red", 40.0, 40.0, 26.0), Shape("circle", "blue", 40.0, 40.0, 24.0),
                  Shape("square", "red", 40.0, 40.0, 24.0), Shape("circle", "red", 41.0, 40.0, 24.0),
                  Shape("circle", "red", 40.0, 41.0, 24.0)):
        assert _key(Scene([other], 112), qa) != _key(scene, qa)
    assert _key(scene, ("How many squares are there?", "0", {"shape": "square"})) != _key(scene, qa)


# ---------------------------------------------------------------------------- audit: VLMTask's held-out evaluation


class _Scripted:
    """A stand-in policy: greedy answer `greedy[q]` to question q, and `sampled[q][j]` as its
    j-th sampled completion; `called` marks tool calls the same way (None: no tool rollouts).
    `sizes` records how many items each generate call was given."""

    def __init__(self, greedy, sampled=None, called=None, sampled_called=None):
        self.greedy, self.sampled, self.called, self.sampled_called = greedy, sampled, called, sampled_called
        self.sizes = []

    def greedy_batches(self, items, max_new_tokens, batch_size=64, stop=None):
        data = {} if self.called is None else {"stat/called": torch.tensor([self.called[it.question] for it in items])}
        return [SimpleNamespace(samples=[vlm_sample(it, self.greedy[it.question]) for it in items], data=data)]

    def generate(self, items, k, rollout, generator):
        self.sizes.append(len(items))
        samples = [vlm_sample(it, self.sampled[it.question][j]) for it in items for j in range(k)]  # rows contiguous
        data = {} if self.sampled_called is None else {
            "stat/called": torch.tensor([self.sampled_called[it.question][j] for it in items for j in range(k)])}
        return SimpleNamespace(samples=samples, data=data)


def _items(n):
    return [QAItem([], f"q{i}", "blue") for i in range(n)]


def _answer_only():
    """One atom named answer (weight 1): the total is the answer atom itself."""

    return Reward([reward_atom("answer")(lambda s: float(s.completion == s.meta["answer"]))])


def test_a_vlm_task_without_training_or_evaluation_items_is_refused():
    with pytest.raises(ValueError, match="has no training items"):
        VLMTask("qa", [], _items(1), _answer_only(), max_new_tokens=4)
    with pytest.raises(ValueError, match="has no evaluation items"):
        VLMTask("qa", _items(1), [], _answer_only(), max_new_tokens=4)


def test_an_empty_extra_evaluation_split_is_left_out():
    items = _items(2)
    task = VLMTask("qa", items, items, _answer_only(), max_new_tokens=4, extra_eval={"ood": [], "far": items[:1]})
    assert task.extra_eval == {"far": items[:1]}
    out = task.evaluate(_Scripted({"q0": "blue", "q1": "red"}))
    assert out["accuracy"] == 0.5 and out["far/accuracy"] == 1.0  # q0 alone: right
    assert not any(k.startswith("ood/") for k in out)


def test_stop_is_none_for_no_rollout_or_an_empty_stop_list():
    items = _items(1)
    assert VLMTask("qa", items, items, _answer_only(), max_new_tokens=4).stop is None
    task = VLMTask("qa", items, items, _answer_only(), max_new_tokens=4, rollout=SimpleNamespace(stop=[]))
    assert task.stop is None
    task.rollout = SimpleNamespace(stop=["</answer>"])
    assert task.stop == ["</answer>"]


def test_greedy_reward_and_tool_call_rate_are_exact_shares():
    """105 of 200 right (and calling a tool) is 0.525 exactly, as accuracy is: float64 means."""
    items = _items(200)
    greedy = {it.question: "blue" if i < 105 else "red" for i, it in enumerate(items)}
    called = {it.question: int(i < 105) for i, it in enumerate(items)}
    out = VLMTask("qa", items, items, _answer_only(), max_new_tokens=4).evaluate(_Scripted(greedy, called=called))
    assert out["reward"] == 0.525 and out["accuracy"] == 0.525 and out["tool_call_rate"] == 0.525
    assert "answer" not in out  # the answer atom is reported as accuracy


def test_sampled_accuracy_and_pass_at_k_by_hand():
    """3 items, k = 3 samples each: q0 right 1 of 3, q1 none, q2 all three. sampled_accuracy
    = 4 / 9; pass@3 = 2 of 3 items with a right sample; tool calls 2 of 9. eval batch 6 rows
    = 6 // 3 = 2 items per generate call: calls of 2 then 1 item."""
    items = _items(3)
    sampled = {"q0": ["blue", "red", "red"], "q1": ["red", "red", "red"], "q2": ["blue", "blue", "blue"]}
    calls = {"q0": [1, 0, 0], "q1": [0, 0, 0], "q2": [0, 0, 1]}
    task = VLMTask("qa", items, items, _answer_only(), max_new_tokens=4, batch_size=6,
                   rollout=SimpleNamespace(stop=None), eval_samples=3)
    policy = _Scripted(dict.fromkeys(("q0", "q1", "q2"), "blue"), sampled, sampled_called=calls)
    out = task.evaluate(policy)
    assert out["sampled_accuracy"] == pytest.approx(4 / 9) and out["pass@3"] == pytest.approx(2 / 3)
    assert out["sampled_tool_call_rate"] == pytest.approx(2 / 9)
    assert policy.sizes == [2, 1]
    # without tool rollouts there is no sampled tool-call rate
    assert "sampled_tool_call_rate" not in task.evaluate(_Scripted(policy.greedy, sampled))


def test_pass_at_k_counts_an_answer_score_of_one_half_as_a_success():
    """A partial-credit answer check (0.5 for "purple", 0 otherwise): q0's best sample scores
    0.5, q1's 0. pass@2 = 1 / 2, as the dLLM's pass@k counts a score of 0.5; sampled accuracy
    0.5 / 4 samples = 0.125."""
    items = _items(2)
    half = Reward([reward_atom("answer")(lambda s: 0.5 if s.completion == "purple" else 0.0)])
    task = VLMTask("qa", items, items, half, max_new_tokens=4, rollout=SimpleNamespace(stop=None), eval_samples=2)
    out = task.evaluate(_Scripted({"q0": "red", "q1": "red"}, {"q0": ["purple", "red"], "q1": ["red", "red"]}))
    assert out["pass@2"] == 0.5 and out["sampled_accuracy"] == pytest.approx(0.125)


def test_an_eval_batch_smaller_than_k_still_samples_one_item_per_call():
    items = _items(2)
    task = VLMTask("qa", items, items, _answer_only(), max_new_tokens=4, batch_size=2,
                   rollout=SimpleNamespace(stop=None), eval_samples=4)
    policy = _Scripted({"q0": "blue", "q1": "blue"}, {"q0": ["blue"] * 4, "q1": ["red", "red", "red", "blue"]})
    out = task.evaluate(policy)
    assert policy.sizes == [1, 1]
    assert out["sampled_accuracy"] == pytest.approx(5 / 8) and out["pass@4"] == 1.0


def test_sampled_metrics_need_an_answer_atom_and_eval_samples():
    items = _items(1)
    policy = _Scripted({"q0": "blue"}, {"q0": ["blue"]})
    other = Reward([reward_atom("match")(lambda s: 1.0)])
    task = VLMTask("qa", items, items, other, max_new_tokens=4, rollout=SimpleNamespace(stop=None), eval_samples=1)
    assert task.evaluate(policy) == {"reward": 1.0, "match": 1.0}
    task = VLMTask("qa", items, items, _answer_only(), max_new_tokens=4, rollout=SimpleNamespace(stop=None))
    assert "sampled_accuracy" not in task.evaluate(policy)  # eval_samples 0: greedy only
