"""shapes-mood: a subjective task for DSPO (arXiv 2609.36775): which emotion does a scene evoke?

Images are scenes.py scenes (112 px, 1-3 solid shapes of 36-48 px, sizes the tiny VLM reads).
Each colour and each shape carries emotion weights (COLOUR_WEIGHTS, SHAPE_WEIGHTS; every
object also gets BASE_WEIGHT on all eight emotions, the annotators who disagree). An object's
weights are its colour's plus its shape's plus the base, scaled by its visible area (AREA x
size^2). The label distribution p(e) over vad.EMOTIONS is the normalised sum over objects;
the answer is its mode, the trigger the object that adds most to the mode. Single objects:

    red      -> anger (all shapes)          yellow circle -> amusement, else excitement
    blue     triangle -> fear, circle -> contentment, square -> sadness
    green    square -> awe, else contentment                     (disgust: mass, never a mode)

Scenes whose top two emotions are within MIN_MODE_MARGIN are drawn again, so the mode is
decided by what is visible. Prior (for DEDR): mu* = sum_e p(e) VAD(e), sigma* = the
p-weighted std per dimension, at least SIGMA_FLOOR. Out of distribution: the colour-shape
compositions in `ood_compositions` (default yellow triangle, blue circle) never appear in
train or eval scenes, and every OOD scene holds at least one.

Completion (the SFT `reference`; box = [ymin,xmin,ymax,xmax] of the trigger, 0-1000 scale):
    "<step1>[ymin,xmin,ymax,xmax]</step1> <step2>a red triangle</step2>
     <step3>anger, excitement, fear, amusement, sadness</step3> <answer>anger</answer>"
(one line; step3 = the top-K emotions of p, K = 5, most probable first, ties in EMOTIONS order.)

Rewards: format (0.1), answer (1.0) and diversity (0.3, DEDR with uniform w_k = 1/K), the
latter two gated by format; DSPO adds its 0.1 R_cf. Bad model output scores 0 on the atom it
breaks and counts its reason in MOOD_WARNINGS (a warning once per reason per process).
"""

from __future__ import annotations

import math
import random
import re
import warnings
from collections import Counter
from dataclasses import dataclass

from mmrl.core.rewards import Reward, RewardAtom, Sample, reward_atom
from mmrl.vlm.dedr import TAU_CTR, TAU_DIV, dedr
from mmrl.vlm.tasks.scenes import COLOURS, SHAPES, Scene, Shape, random_scene, render
from mmrl.vlm.tasks.shapes_qa import QAItem, held_out
from mmrl.vlm.vad import EMOTIONS, vad

__all__ = [
    "COLOUR_WEIGHTS", "MOOD_REASONS", "MOOD_WARNINGS", "OOD_COMPOSITIONS", "QUESTION", "SHAPE_WEIGHTS", "K",
    "MoodResponse", "ShapesMood", "box_area_fraction", "box_fraction", "coverage", "diversity",
    "format_problem", "label_dist", "mood_answer_atom", "mood_div_atom", "mood_format_atom",
    "mood_metrics", "parse_mood", "prior", "shapes_mood_reward", "top_k", "valid_box",
]

K = 5  # candidate emotions per response
QUESTION = "What emotion does this image evoke?"
OOD_COMPOSITIONS = (("yellow", "triangle"), ("blue", "circle"))
# Warm/bright colours excite or amuse, red angers, blue saddens or calms, green calms or awes;
# rows sum to 1. Shapes shift the colour's mode: a triangle (pointed, "up") raises arousal,
# a circle soothes, a square is static and heavy; rows sum to 0.6.
COLOUR_WEIGHTS = {
    "red": {"anger": 0.50, "excitement": 0.25, "disgust": 0.15, "fear": 0.10},
    "yellow": {"excitement": 0.45, "amusement": 0.35, "contentment": 0.20},
    "blue": {"sadness": 0.40, "fear": 0.20, "awe": 0.20, "contentment": 0.20},
    "green": {"contentment": 0.45, "awe": 0.30, "disgust": 0.15, "amusement": 0.10},
}
SHAPE_WEIGHTS = {
    "triangle": {"fear": 0.30, "excitement": 0.20, "anger": 0.10},
    "circle": {"contentment": 0.30, "amusement": 0.25, "excitement": 0.05},
    "square": {"awe": 0.25, "sadness": 0.20, "disgust": 0.15},
}
BASE_WEIGHT = 0.1
AREA = {"circle": math.pi / 4, "square": 1.0, "triangle": 0.5}  # visible area / size^2
MIN_MODE_MARGIN = 0.02
SIGMA_FLOOR = 0.05
_SCENE_TRIES = 1000

# ---------------------------------------------------------------------------- labels


def object_weights(sh: Shape) -> dict[str, float]:
    c, s = COLOUR_WEIGHTS[sh.colour], SHAPE_WEIGHTS[sh.shape]
    area = AREA[sh.shape] * sh.size**2
    return {e: area * (BASE_WEIGHT + c.get(e, 0.0) + s.get(e, 0.0)) for e in EMOTIONS}


def label_dist(scene: Scene) -> dict[str, float]:
    """p(e): the normalised, area-scaled sum of the objects' weights, in EMOTIONS order."""
    if not scene.shapes:
        raise ValueError("an empty scene has no label distribution")
    total = {e: sum(object_weights(sh)[e] for sh in scene.shapes) for e in EMOTIONS}
    z = sum(total.values())
    return {e: v / z for e, v in total.items()}


def top_k(dist: dict[str, float], k: int = K) -> list[str]:
    """The k most probable emotions, ties in EMOTIONS order."""
    return sorted(EMOTIONS, key=lambda e: (-dist[e], EMOTIONS.index(e)))[:k]


def prior(dist: dict[str, float]) -> tuple[list[float], list[float]]:
    """(mu*, sigma*): the p-weighted mean and std of the lexicon VADs, std >= SIGMA_FLOOR."""
    mu = [sum(p * vad(e)[d] for e, p in dist.items()) for d in range(3)]
    var = [sum(p * (vad(e)[d] - mu[d]) ** 2 for e, p in dist.items()) for d in range(3)]
    return mu, [max(SIGMA_FLOOR, math.sqrt(v)) for v in var]


def trigger(scene: Scene, mode: str) -> Shape:
    """The object adding most to the mode's mass (the first such, in scene order)."""
    return max(scene.shapes, key=lambda sh: object_weights(sh)[mode])


# ---------------------------------------------------------------------------- boxes (0-1000)


def shape_box(sh: Shape, image_size: int) -> list[int]:
    """[ymin, xmin, ymax, xmax] of the shape's box on a 0-1000 scale of the image."""
    x0, y0, x1, y1 = sh.box()
    return [round(1000 * v / image_size) for v in (y0, x0, y1, x1)]


def valid_box(box) -> bool:
    """Four ints with 0 <= ymin < ymax <= 1000 and 0 <= xmin < xmax <= 1000."""
    if not isinstance(box, (tuple, list)) or len(box) != 4 or any(type(v) is not int for v in box):
        return False
    return 0 <= box[0] < box[2] <= 1000 and 0 <= box[1] < box[3] <= 1000


def box_fraction(box) -> tuple[float, float, float, float]:
    """[ymin, xmin, ymax, xmax] (0-1000) -> (x0, y0, x1, y1) as fractions of the image side,
    the form CVIG's intervention takes; ValueError for a box that valid_box rejects."""
    if not valid_box(box):
        raise ValueError(f"not a box [ymin,xmin,ymax,xmax] of ints within 0-1000: {box!r}")
    ymin, xmin, ymax, xmax = box
    return xmin / 1000, ymin / 1000, xmax / 1000, ymax / 1000


def box_area_fraction(box) -> float:
    """area_box / area_image of a valid box."""
    x0, y0, x1, y1 = box_fraction(box)
    return (x1 - x0) * (y1 - y0)


# ---------------------------------------------------------------------------- generation


def _scene(rng, held: set, ood: bool, image_size, min_shapes, max_shapes, shape_size) -> Scene:
    """A scene with a clear mode: without any held-out composition, or (ood) with at least one."""
    for _ in range(_SCENE_TRIES):
        scene = random_scene(rng, image_size, min_shapes, max_shapes, shape_size)
        dist = label_dist(scene)
        first, second = top_k(dist, 2)
        has_held = any((s.colour, s.shape) in held for s in scene.shapes)
        if has_held == ood and dist[first] - dist[second] >= MIN_MODE_MARGIN:
            return scene
    raise ValueError(f"no {'OOD ' if ood else ''}scene with a clear mode in {_SCENE_TRIES} draws")


def _make_item(scene: Scene, split: str) -> QAItem:
    dist = label_dist(scene)
    cands = top_k(dist)
    mode, (mu, sigma) = cands[0], prior(dist)
    trig = trigger(scene, mode)
    box = shape_box(trig, scene.size)
    reference = (f"<step1>[{','.join(map(str, box))}]</step1> <step2>a {trig.colour} {trig.shape}"
                 f"</step2> <step3>{', '.join(cands)}</step3> <answer>{mode}</answer>")
    meta = {"answer": mode, "label_dist": dist, "trigger_box": box, "mu": mu, "sigma": sigma,
            "scene": scene.to_dict(), "kind": "mood", "split": split}
    return QAItem([render(scene)], QUESTION, mode, reference, meta)


def _key(scene: Scene, split: str) -> tuple:
    return tuple((s.shape, s.colour, s.x, s.y, s.size) for s in scene.shapes)


class ShapesMood:
    """The shapes-mood task: train, held-out eval (in distribution, no scene shared with
    train) and OOD items (unseen colour-shape compositions). Generated on first use, cached;
    item i of a split depends only on (split, seed, i) and the settings."""

    name = "shapes-mood"

    def __init__(self, *, seed: int = 0, num_train: int = 2000, num_eval: int = 200,
                 num_ood: int = 200, image_size: int = 112, min_shapes: int = 1,
                 max_shapes: int = 3, shape_size: tuple[int, int] | None = None,
                 ood_compositions=OOD_COMPOSITIONS):
        if min(num_train, num_eval, num_ood) < 0 or min_shapes < 1:
            raise ValueError(f"need item counts >= 0 and min_shapes >= 1, got {num_train}, "
                             f"{num_eval}, {num_ood}, min_shapes={min_shapes}")
        held = {tuple(c) for c in ood_compositions}
        if not held and num_ood:
            raise ValueError(f"no ood_compositions: each of the num_ood={num_ood} OOD items needs an unseen "
                             "colour-shape composition in its scene (hold one out, or set num_ood 0)")
        for colour, shape in held:
            if colour not in COLOURS or shape not in SHAPES:
                raise ValueError(f"unknown composition ({colour!r}, {shape!r}): colours "
                                 f"{', '.join(COLOURS)}; shapes {', '.join(SHAPES)}")
        seen = {(c, s) for c in COLOURS for s in SHAPES} - held
        if {c for c, _ in seen} != set(COLOURS) or {s for _, s in seen} != set(SHAPES):
            raise ValueError("every colour and every shape must keep a training composition, "
                             f"or OOD is not a test of composition; held out: {sorted(held)}")
        self.seed, self.num_train, self.num_eval, self.num_ood = seed, num_train, num_eval, num_ood
        self.image_size, self.min_shapes, self.max_shapes = image_size, min_shapes, max_shapes
        self.shape_size = tuple(shape_size or (round(36 * image_size / 112), round(48 * image_size / 112)))
        self.ood_compositions = sorted(held)
        random_scene(random.Random(0), image_size, self.min_shapes, max_shapes, self.shape_size)
        self._cache: dict[str, list[QAItem]] = {}

    def _specs(self, n: int, split: str):
        held = set(self.ood_compositions)
        for i in range(n):
            rng = random.Random(f"shapes-mood/{split}/{self.seed}/{i}")  # str seeds: stable
            yield _scene(rng, held, split == "ood", self.image_size, self.min_shapes,
                         self.max_shapes, self.shape_size), split

    def _items(self, split: str, make) -> list[QAItem]:
        if split not in self._cache:
            self._cache[split] = make()
        return self._cache[split]

    def train_items(self) -> list[QAItem]:
        return self._items("train", lambda: [_make_item(*s) for s in self._specs(self.num_train, "train")])

    def eval_items(self) -> list[QAItem]:
        return self._items("eval", lambda: held_out(
            self._specs(self.num_train, "train"), self._specs(10 * self.num_eval + 1000, "eval"),
            _key, _make_item, self.num_eval))

    def ood_items(self) -> list[QAItem]:
        return self._items("ood", lambda: [_make_item(*s) for s in self._specs(self.num_ood, "ood")])

    def __repr__(self) -> str:
        return (f"ShapesMood(seed={self.seed}, num_train={self.num_train}, num_eval={self.num_eval}, "
                f"num_ood={self.num_ood}, image_size={self.image_size}, shapes={self.min_shapes}-"
                f"{self.max_shapes}, shape_size={self.shape_size}, ood={self.ood_compositions})")


# ---------------------------------------------------------------------------- parsing


@dataclass
class MoodResponse:
    box: tuple[int, int, int, int] | None  # [ymin, xmin, ymax, xmax] as written, not range-checked
    reaction: str | None
    candidates: list[str] | None  # lower-cased, stripped; [] when step3 is empty
    answer: str | None


_PARTS = ("step1", "step2", "step3", "answer")
# brackets optional, but both or neither: (?(1)...) asks for "]" only where "[" opened
_BOX_RE = re.compile(r"(\[)?\s*(-?\d+)\s*,\s*(-?\d+)\s*,\s*(-?\d+)\s*,\s*(-?\d+)\s*(?(1)\])")


def _tag(text: str, name: str) -> str | None:
    found = re.findall(rf"<{name}>(.*?)</{name}>", text, re.DOTALL | re.IGNORECASE)
    return " ".join(found[-1].split()) if found else None  # the last one, whitespace collapsed


def parse_mood(text: str) -> MoodResponse:
    """The four parts of a completion (the last of each tag); None for a missing part."""
    step1, step2, step3, answer = (_tag(text, t) for t in _PARTS)
    m = _BOX_RE.fullmatch(step1) if step1 is not None else None
    cands = None if step3 is None else [c.strip(" .").lower() for c in re.split(r"[,;]", step3)]
    return MoodResponse(box=tuple(int(v) for v in m.groups()[1:]) if m else None,
                        reaction=step2.lower() if step2 is not None else None,
                        candidates=[c for c in cands if c] if cands is not None else None,
                        answer=answer.strip(" .").lower() if answer is not None else None)


def format_problem(text: str) -> str | None:
    """None if the completion has the format, else the reason: "missing_part" (each tag once,
    in order, non-empty, nothing after </answer>), "bad_box", "no_candidates", "wrong_count"
    (not K distinct candidates)."""
    low, pos = text.lower(), -1
    for t in _PARTS:
        start, end = low.find(f"<{t}>"), low.find(f"</{t}>")
        if low.count(f"<{t}>") != 1 or low.count(f"</{t}>") != 1 or not pos < start < end:
            return "missing_part"
        pos = end
    r = parse_mood(text)
    if low[pos + len("</answer>"):].strip() or not r.reaction or not r.answer:
        return "missing_part"
    if not valid_box(r.box):
        return "bad_box"
    if not r.candidates:
        return "no_candidates"
    if len(r.candidates) != K or len(set(r.candidates)) != K:
        return "wrong_count"
    return None


# ---------------------------------------------------------------------------- rewards

MOOD_WARNINGS: Counter = Counter()  # reason -> how many atom evaluations scored 0 for it
_WARNED: set[str] = set()
_WHY = {"missing_part": "a part is missing, repeated, out of order, empty or followed by text",
        "bad_box": "step1 is not [ymin,xmin,ymax,xmax] integers with 0 <= min < max <= 1000",
        "no_candidates": "step3 lists no candidate emotions",
        "wrong_count": f"step3 does not list {K} distinct candidate emotions"}
MOOD_REASONS = (*_WHY, "unknown_emotion")  # every reason _bad counts, for a fixed set of metric names


def _bad(reason: str, detail: str) -> float:
    MOOD_WARNINGS[reason] += 1
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"shapes-mood: {reason} ({detail}); scored 0 and counted in MOOD_WARNINGS "
                      "(warned once per reason)", RuntimeWarning, stacklevel=3)
    return 0.0


def diversity(resp: MoodResponse, meta: dict, w=None, tau_ctr: float = TAU_CTR,
              tau_div: float = TAU_DIV) -> float:
    """DEDR of the response's candidates against the item's prior (meta "mu", "sigma");
    w None = uniform. 0, counted, for missing candidates or a word outside the lexicon."""
    if not meta or "mu" not in meta or "sigma" not in meta:
        raise ValueError('sample.meta must hold the prior "mu" and "sigma"')
    if not resp.candidates:
        return _bad("no_candidates", "no candidate emotions to score")
    z = [vad(c) for c in resp.candidates]
    if None in z:
        unknown = [c for c, v in zip(resp.candidates, z) if v is None]
        return _bad("unknown_emotion", f"{unknown} not in the VAD lexicon")
    k = len(z)
    return dedr(z, meta["mu"], meta["sigma"], [1 / k] * k if w is None else w, tau_ctr, tau_div)


def _text(sample: Sample) -> str:
    if not isinstance(sample.completion, str):
        raise TypeError("shapes-mood rewards need the completion text, got "
                        f"{type(sample.completion).__name__}")
    return sample.completion


@reward_atom("format", weight=0.1)
def mood_format_atom(sample: Sample) -> float:
    """1 if all four parts are there once, in order, with a valid box and K distinct candidates."""
    problem = format_problem(_text(sample))
    return 1.0 if problem is None else _bad(problem, _WHY[problem])


@reward_atom("answer", weight=1.0, parents=("format",))
def mood_answer_atom(sample: Sample) -> float:
    """1 if the final choice is the label's mode (meta "answer")."""
    if not sample.meta or "answer" not in sample.meta:
        raise ValueError('sample.meta must hold the reference "answer"')
    return float(parse_mood(_text(sample)).answer == sample.meta["answer"])


@reward_atom("diversity", weight=0.3, parents=("format",))
def mood_div_atom(sample: Sample) -> float:
    """DEDR with uniform w_k = 1/K (DSPO replaces w with CVIG's weights)."""
    return diversity(parse_mood(_text(sample)), sample.meta)


def shapes_mood_reward(diversity_weight: float = 0.3, **kwargs) -> Reward:
    """Reward([format 0.1, answer 1.0, diversity `diversity_weight`]), without the diversity
    atom when its weight is 0; kwargs (on_error, timeout) go to Reward."""
    atoms = [mood_format_atom, mood_answer_atom]
    if diversity_weight:
        atoms.append(RewardAtom("diversity", mood_div_atom.fn, weight=diversity_weight, parents=("format",)))
    return Reward(atoms, **kwargs)


# ---------------------------------------------------------------------------- metrics


def coverage(candidates, label_dist: dict[str, float]) -> float:
    """The label probability mass of the distinct candidates among the first K (unknown words add
    0): listing more than K, which the format refuses, does not buy more of it."""
    names = {c.strip().lower() for c in list(candidates or ())[:K] if isinstance(c, str)}
    return sum(label_dist.get(c, 0.0) for c in sorted(names))  # a set's order changes with the process's hash seed


def mood_metrics(completions, items) -> dict[str, float]:
    """accuracy (final choice == mode, any format), coverage (mean), format (rate)."""
    if len(completions) != len(items) or not items:
        raise ValueError(f"need as many completions as items (> 0), got {len(completions)}, {len(items)}")
    acc = cov = fmt = 0.0
    for text, item in zip(completions, items):
        r = parse_mood(text)
        acc += r.answer == item.meta["answer"]
        cov += coverage(r.candidates, item.meta["label_dist"])
        fmt += format_problem(text) is None
    n = len(items)
    return {"accuracy": acc / n, "coverage": cov / n, "format": fmt / n}
