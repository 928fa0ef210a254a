"""shapes-qa: questions about images of coloured shapes, with exactly checkable answers.

Made to be learnable by a tiny VLM: a 112x112 image holds 1-4 large solid shapes
(see scenes.py); questions come from five fixed templates over a vocabulary of
four colours and three shapes; answers are one word. The SFT target (`reference`)
first describes the scene, left to right, then answers:

    "a red circle , a blue square <answer>1</answer>"

Question kinds (KINDS; each is asked only where its answer is well defined):
    count_colour  "How many red shapes are there?"            -> "0".."4"
    count_shape   "How many circles are there?"               -> "0".."4"
    colour_of     "What colour is the square?"                -> a colour (exactly one square)
    shape_of      "What shape is the green object?"           -> a shape (exactly one green object)
    left_of       "Is the red circle left of the blue square?" -> "yes" / "no"
                  (two objects, each the only one of its colour and shape, clearly apart along x)

Rewards (reward-atom API): `format_atom` ("format", weight 0.1) and `answer_atom`
("answer", weight 1.0, gated by "format"); `shapes_qa_reward()` bundles them.
"""

from __future__ import annotations

import random
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from PIL import Image

from mmrl.core.rewards import Reward, Sample, reward_atom
from mmrl.vlm.tasks.scenes import COLOURS, SHAPES, Scene, describe, is_left_of, random_scene, render

__all__ = [
    "KINDS",
    "QAItem",
    "ShapesQA",
    "accuracy",
    "answer_atom",
    "extract_answer",
    "format_atom",
    "generate_items",
    "normalize",
    "shapes_qa_reward",
    "to_sample",
]

PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles"}
ABSENT_TARGET_P = 0.2  # count questions: chance of asking about a colour/shape not in the scene


@dataclass
class QAItem:
    """One visual question. `reference` is the SFT target completion ("" if unknown);
    meta carries "answer" (what the reward checks) and, for generated items, "kind",
    "params" (the template's slots) and "scene" (Scene.to_dict())."""

    images: list[Image.Image]
    question: str
    answer: str
    reference: str = ""
    meta: dict = field(default_factory=dict)
    where: str = ""  # a data file's item: "FILE, line N", for the messages that name it


# ---------------------------------------------------------------------------- question kinds
# Each kind: (scene, rng) -> (question, answer, params), or None where it cannot be asked.

QA = tuple[str, str, dict]


def _pick_target(rng: random.Random, present: list[str], vocabulary: Sequence[str]) -> str:
    absent = [v for v in vocabulary if v not in present]
    if absent and (not present or rng.random() < ABSENT_TARGET_P):
        return rng.choice(absent)
    return rng.choice(present)


def count_colour(scene: Scene, rng: random.Random) -> QA:
    counts = Counter(s.colour for s in scene.shapes)
    colour = _pick_target(rng, sorted(counts, key=list(COLOURS).index), list(COLOURS))
    return f"How many {colour} shapes are there?", str(counts[colour]), {"colour": colour}


def count_shape(scene: Scene, rng: random.Random) -> QA:
    counts = Counter(s.shape for s in scene.shapes)
    shape = _pick_target(rng, sorted(counts, key=SHAPES.index), SHAPES)
    return f"How many {PLURALS[shape]} are there?", str(counts[shape]), {"shape": shape}


def colour_of(scene: Scene, rng: random.Random) -> QA | None:
    counts = Counter(s.shape for s in scene.shapes)
    unique = [k for k in SHAPES if counts[k] == 1]
    if not unique:
        return None
    shape = rng.choice(unique)
    colour = next(s.colour for s in scene.shapes if s.shape == shape)
    return f"What colour is the {shape}?", colour, {"shape": shape}


def shape_of(scene: Scene, rng: random.Random) -> QA | None:
    counts = Counter(s.colour for s in scene.shapes)
    unique = [c for c in COLOURS if counts[c] == 1]
    if not unique:
        return None
    colour = rng.choice(unique)
    shape = next(s.shape for s in scene.shapes if s.colour == colour)
    return f"What shape is the {colour} object?", shape, {"colour": colour}


def left_of(scene: Scene, rng: random.Random) -> QA | None:
    counts = Counter((s.colour, s.shape) for s in scene.shapes)
    unique = [s for s in scene.shapes if counts[(s.colour, s.shape)] == 1]
    pairs = [
        (a, b)
        for i, a in enumerate(unique)
        for b in unique[i + 1 :]
        if is_left_of(a, b) is not None
    ]
    if not pairs:
        return None
    a, b = rng.choice(pairs)
    if rng.random() < 0.5:
        a, b = b, a
    question = f"Is the {a.colour} {a.shape} left of the {b.colour} {b.shape}?"
    params = {
        "a": {"colour": a.colour, "shape": a.shape},
        "b": {"colour": b.colour, "shape": b.shape},
    }
    return question, "yes" if is_left_of(a, b) else "no", params


KINDS: dict[str, Callable[[Scene, random.Random], QA | None]] = {
    "count_colour": count_colour,
    "count_shape": count_shape,
    "colour_of": colour_of,
    "shape_of": shape_of,
    "left_of": left_of,
}
_MIN_SHAPES_NEEDED = {"colour_of": 1, "shape_of": 1, "left_of": 2}
_ITEM_TRIES = 1000  # scenes drawn for one item before its kind is declared impossible


# ---------------------------------------------------------------------------- generation


def kind_list(kinds: Sequence[str] | str | None, known, default: Sequence[str]) -> list[str]:
    """Question kinds as a checked list: None -> default, one name -> [it]; an empty list or
    a name not in `known` is a ValueError."""
    kinds = list(default) if kinds is None else [kinds] if isinstance(kinds, str) else list(kinds)
    if not kinds:
        raise ValueError("kinds must name at least one question kind")
    for k in kinds:
        if k not in known:
            raise ValueError(f"unknown question kind {k!r} (known: {', '.join(known)})")
    return kinds


def _check_kinds(kinds: Sequence[str] | None, max_shapes: int) -> list[str]:
    kinds = kind_list(kinds, KINDS, KINDS)
    for k in kinds:
        if max_shapes < _MIN_SHAPES_NEEDED.get(k, 0):
            raise ValueError(
                f"question kind {k!r} needs scenes of at least {_MIN_SHAPES_NEEDED[k]} "
                f"shapes, but max_shapes={max_shapes}"
            )
    return kinds


def _shape_size(image_size: int, shape_size) -> tuple[int, int]:
    """Default box sides: 22-32 pixels at 112 pixels, scaled with the image."""
    if shape_size is not None:
        lo, hi = shape_size
        return int(lo), int(hi)
    return max(1, round(22 * image_size / 112)), max(1, round(32 * image_size / 112))


def _item_specs(n, seed, split, image_size, min_shapes, max_shapes, kinds, shape_size=None):
    """(scene, kind, (question, answer, params)) for items 0..n-1 of a stream, unrendered.
    Item i depends only on (split, seed, i) and the settings, so a longer list extends a
    shorter one and the "train" and "eval" streams share no random state."""
    kinds = _check_kinds(kinds, max_shapes)
    shape_size = _shape_size(image_size, shape_size)
    for i in range(n):
        rng = random.Random(f"shapes-qa/{split}/{seed}/{i}")  # str seeds hash with sha512: stable
        kind = rng.choice(kinds)
        for _ in range(_ITEM_TRIES):
            scene = random_scene(rng, image_size, min_shapes, max_shapes, shape_size)
            qa = KINDS[kind](scene, rng)
            if qa is not None:
                break
        else:
            raise ValueError(
                f"could not make a {kind!r} question in {_ITEM_TRIES} scenes "
                f"(min_shapes={min_shapes}, max_shapes={max_shapes})"
            )
        yield scene, kind, qa


def _make_item(scene: Scene, kind: str, qa: QA) -> QAItem:
    question, answer, params = qa
    return QAItem(
        images=[render(scene)],
        question=question,
        answer=answer,
        reference=f"{describe(scene)} <answer>{answer}</answer>",
        meta={"kind": kind, "params": params, "scene": scene.to_dict(), "answer": answer},
    )


def generate_items(
    n: int,
    seed: int,
    *,
    image_size: int = 112,
    min_shapes: int = 1,
    max_shapes: int = 4,
    kinds: Sequence[str] | None = None,
    shape_size: tuple[int, int] | None = None,
    split: str = "train",
) -> list[QAItem]:
    """n items, deterministic given the arguments. Each item picks its kind uniformly from
    `kinds` (default: all of KINDS), then draws scenes until that kind can be asked.
    shape_size: (min, max) box side in pixels; default (22, 32) scaled by image_size / 112.
    `split` names an independent seed stream (ShapesQA uses "train" and "eval")."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    specs = _item_specs(n, seed, split, image_size, min_shapes, max_shapes, kinds, shape_size)
    return [_make_item(*spec) for spec in specs]


def _key(scene: Scene, qa: QA) -> tuple:
    return qa[0], tuple((s.shape, s.colour, s.x, s.y, s.size) for s in scene.shapes)


class ShapesQA:
    """The shapes-qa task: a training set and a held-out evaluation set.

    The eval items come from the "eval" seed stream, and any eval item identical to a
    train item (same question, same scene) is skipped, so eval is strictly held out.
    Both lists are generated on first use and cached.
    """

    name = "shapes-qa"

    def __init__(
        self,
        *,
        seed: int = 0,
        num_train: int = 2000,
        num_eval: int = 200,
        image_size: int = 112,
        min_shapes: int = 1,
        max_shapes: int = 4,
        kinds: Sequence[str] | None = None,
        shape_size: tuple[int, int] | None = None,
    ):
        if num_train < 0 or num_eval < 0:
            raise ValueError(f"num_train and num_eval must be >= 0, got {num_train}, {num_eval}")
        self.seed = seed
        self.num_train = num_train
        self.num_eval = num_eval
        self.image_size = image_size
        self.min_shapes = min_shapes
        self.max_shapes = max_shapes
        self.kinds = _check_kinds(kinds, max_shapes)
        self.shape_size = _shape_size(image_size, shape_size)
        # fail early on bad sizes
        random_scene(random.Random(0), image_size, min_shapes, max_shapes, self.shape_size)
        self._train: list[QAItem] | None = None
        self._eval: list[QAItem] | None = None

    def _specs(self, n: int, split: str):
        return _item_specs(
            n,
            self.seed,
            split,
            self.image_size,
            self.min_shapes,
            self.max_shapes,
            self.kinds,
            self.shape_size,
        )

    def train_items(self) -> list[QAItem]:
        if self._train is None:
            self._train = [_make_item(*spec) for spec in self._specs(self.num_train, "train")]
        return self._train

    def eval_items(self) -> list[QAItem]:
        if self._eval is None:
            key = lambda scene, kind, qa: _key(scene, qa)
            self._eval = held_out(self._specs(self.num_train, "train"),
                                  self._specs(10 * self.num_eval + 1000, "eval"), key, _make_item, self.num_eval)
        return self._eval

    def __repr__(self) -> str:
        return (
            f"ShapesQA(seed={self.seed}, num_train={self.num_train}, num_eval={self.num_eval}, "
            f"image_size={self.image_size}, min_shapes={self.min_shapes}, "
            f"max_shapes={self.max_shapes}, kinds={self.kinds}, shape_size={self.shape_size})"
        )


def held_out(train_specs, eval_specs, key, make, n: int) -> list[QAItem]:
    """The first n items of the eval spec stream whose key no train item shares (strictly
    held out); ValueError if the stream runs out first. Specs are argument tuples of
    `key` and `make`."""
    seen = {key(*spec) for spec in train_specs}
    items: list[QAItem] = []
    for spec in eval_specs:
        if len(items) == n:
            break
        if key(*spec) not in seen:
            items.append(make(*spec))
    if len(items) < n:
        raise ValueError(f"could only make {len(items)} of {n} held-out eval items that differ from "
                         "every train item; use more shapes or fewer items")
    return items


# ---------------------------------------------------------------------------- answer checking

_ANSWER_RE = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)
_NUMBER_WORDS = {
    w: str(i)
    for i, w in enumerate(
        ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    )
}


def extract_answer(completion: str) -> str | None:
    """The text inside the last <answer>...</answer>, stripped and lower-cased; None if
    there is none."""
    found = _ANSWER_RE.findall(completion)
    return found[-1].strip().lower() if found else None


def normalize(ans) -> str:
    """Unicode compatibility form (NFKC: "é" typed as one character or as e + accent, full-width
    "ＴＷＯ"), lower-case, strip, collapse whitespace, drop trailing '.', number words -> digits
    ("Two." -> "2"). Non-strings are str()-ed first; None -> ""."""
    if ans is None:
        return ""
    text = " ".join(unicodedata.normalize("NFKC", str(ans)).lower().split()).rstrip(".").strip()
    return _NUMBER_WORDS.get(text, text)


def _text(sample: Sample) -> str:
    if not isinstance(sample.completion, str):
        raise TypeError(
            f"shapes-qa rewards need the decoded completion text, got "
            f"{type(sample.completion).__name__}"
        )
    return sample.completion


def _has_format(completion: str) -> bool:
    """Exactly one <answer>...</answer> with a non-empty answer, only whitespace after it."""
    if completion.count("<answer>") != 1 or completion.count("</answer>") != 1:
        return False
    m = _ANSWER_RE.search(completion)
    return m is not None and bool(m.group(1).strip()) and not completion[m.end() :].strip()


@reward_atom("format", weight=0.1)
def format_atom(sample: Sample) -> bool:
    """1 if the completion holds exactly one non-empty <answer>...</answer> and nothing
    but whitespace after it."""
    return _has_format(_text(sample))


@reward_atom("answer", weight=1.0, parents=("format",))
def answer_atom(sample: Sample) -> bool:
    """1 if the extracted answer equals sample.meta["answer"] after normalize()."""
    if not sample.meta or "answer" not in sample.meta:
        raise ValueError('sample.meta must hold the reference "answer"')
    got = extract_answer(_text(sample))
    return got is not None and normalize(got) == normalize(sample.meta["answer"])


def shapes_qa_reward(**kwargs) -> Reward:
    """Reward([format (weight 0.1), answer (weight 1.0, gated by format)]); keyword
    arguments (on_error, timeout) go to Reward."""
    return Reward([format_atom, answer_atom], **kwargs)


def to_sample(item: QAItem, completion: str) -> Sample:
    """The Sample the shapes-qa rewards score: prompt = the question, meta = item.meta."""
    return Sample(prompt=item.question, completion=completion, meta=item.meta)


def accuracy(completions: Sequence[str], items: Sequence[QAItem]) -> float:
    """Exact-match rate of the last <answer> of each completion against its item's answer
    (after normalize()); a completion without an answer is wrong. Unlike the "answer"
    reward it does not require the strict format."""
    if len(completions) != len(items):
        raise ValueError(f"{len(completions)} completions for {len(items)} items")
    if not items:
        raise ValueError("accuracy of an empty list")
    right = 0
    for completion, item in zip(completions, items):
        got = extract_answer(completion)
        right += got is not None and normalize(got) == normalize(item.answer)
    return right / len(items)
