"""shapes-geneval: compositional text-to-image prompts and a programmatic verifier.

The diffusion backend's synthetic benchmark, in the spirit of GenEval: a prompt
asks for coloured shapes, possibly in a spatial relation; a detector finds the
shapes in the generated image; every *atom* of the prompt is checked on its own.

Prompt grammar (case-insensitive, extra spaces and one trailing period tolerated)::

    prompt   := phrase [ relation phrase ]
    phrase   := count colour shape        e.g. "two red circles", "a blue square"
    count    := a | an | one | two | three | four
    colour   := red | green | blue | yellow          (the keys of COLOURS)
    shape    := circle | square | triangle, singular or plural (either form with any count)
    relation := left of | right of | above | below   ("to the left of" / "to the right of" too)

Anything else raises ValueError naming the words that could not be parsed.

Atoms (CAST's causal scene graph, docs/methods.md section 4), for
"two red circles left of a blue square", in this order (parents before children):

    exist[circle]                              a circle of any palette colour
    colour[red circle]        <- exist[circle]       at least one *red* circle
    count[red circle]=2       <- colour[red circle]  exactly two red circles
    exist[square]
    colour[blue square]       <- exist[square]
    count[blue square]=1      <- colour[blue square] ("a" means exactly one)
    relation[red circle left of blue square]  <- colour[red circle], colour[blue square]

The colour atom is the "object exists" atom of the graph; splitting it from
exist[shape] makes "right shape, wrong colour" a near miss that keeps exist and
fails colour (and, by gating, the count and relation atoms that hang under it).
A child whose parent scored below 0.5 scores 0. Two phrases share atoms where
they coincide: one exist atom per shape; a phrase repeated on both sides of a
relation ("a red circle left of two red circles") gives one colour atom and one
count atom for the total (3).

What each atom checks on the detected objects (see `detect`):
- exist[s]: some object of shape s; colour[c s]: some object of colour c and shape s;
- count[c s]=n: exactly n objects of colour c and shape s (objects of other kinds
  are ignored: an extra green triangle costs nothing, a third red circle fails the count);
- relation[A rel B]: every pair (a, b) of detected A and B objects satisfies
  `relation_holds(a.bbox, rel, b.bbox)`: the bounding-box centres are apart along the
  relation's axis by at least RELATION_MARGIN x the mean extent of the two along
  that axis, and that distance is at least RELATION_DOMINANCE x their offset across
  the axis (the direction is within ~63 degrees of the axis). Same-kind relations
  sort the objects along the axis and take the first n as A.
  Scores are binary (0.0 / 1.0).

Detector (`detect`), numpy only:
1. Colour: every pixel gets the palette colour of nearest hue, if its chroma
   (max - min of RGB) is at least CHROMA_FRAC of that colour's and it is not dark.
   White, grey and black are background; a pixel half blended with white still
   counts. Two hue tolerances: strict (at most HUE_GAP_FRAC of the hue gap to the
   next palette colour: red and yellow +-15 degrees, green +-23, blue +-25) and
   loose (half the gap). Loose pixels (blurred edges between two colours) join a
   component, but a component needs STRICT_FRAC strict pixels: an orange shape is
   neither red nor yellow and is ignored, as is every unknown hue.
2. Components: 4-connected, per colour (a run-length union-find). Dropped: specks
   under MIN_AREA_FRAC of the image, and thin fringes (less than CORE_FRAC of the
   component survives an erosion of ~1/128 of the image side).
3. Touching shapes of one colour: on a depth map (distance to the outside, by
   repeated erosion) a threshold that splits the component into >= 2 cores that each
   rise well above it separates the shapes; the cores are grown back over the
   component. Convex shapes never split.
4. Shape, rotation invariant, from the convex hull of the pixel centres in the frame
   of its minimum-area rectangle scaled to a unit square: `fill` = hull / rectangle
   area (disc pi/4, square 1, any triangle 1/2) and `roundness` = farthest hull vertex
   / nearest hull edge from the centroid (disc 1, square sqrt 2, triangle >= 2); the
   nearest ideal shape wins (`_classify`). Rectangles up to MAX_ASPECT read as squares
   and ellipses as circles; longer ones (bars) and blobs (solidity < MIN_SOLIDITY) have
   no shape. A component spanning the whole image whose hull fills its rectangle is a
   coloured background (a disc drawn edge to edge is still a disc).
All thresholds are relative to the image size: 64 px renders and 512 px drawings
are judged alike; rotation, anti-aliasing, blur of ~1/64 of the side, noise and
colour drift of +-25 per channel are tolerated (tests/diffusion/test_shapes_geneval.py;
a drift of +25 on one channel and -25 on another can leave the hue band of red, green
or yellow: e.g. red (195, 15, 65) is no colour).

Known limits: shapes under ~10 px are not told apart reliably; same-colour shapes
that share a whole side (two aligned squares make a rectangle) or overlap by more
than ~1/5 of their size are one object (and a split-off part of a disc cut by an
overlap may read as a square); a disc with a tenth or more cut off straight (by the
image border, or hidden under a shape of another colour) reads as a square; regular
polygons with many sides read as circles; an object of an unknown colour does not exist
for the verifier.

Training data: `sample_prompts` (seeded, item i depends only on (split, seed, i))
and `render` (a random scene that satisfies the prompt, solid shapes on white,
anti-aliased by supersampling).

Rewards (mmrl.core.rewards): `shapes_geneval_reward()` has one batched atom per
atom TYPE, each the mean over the prompt's atoms of that type after gating --
"exist", "colour" (parent "exist"), "count" (parent "colour"), "relation" -- and
"all" (1 iff every atom of the prompt passes; parents: the four type atoms). A type
with no atom in the prompt (only "relation" can be missing) scores 1, vacuously:
constant within a prompt's group, it adds nothing to group advantages. The
type-level parents mirror the per-prompt graph and never change a value for this
grammar (a type mean below 0.5 implies its children's atoms already scored 0).
The five atoms share one detection per (image content, prompt). A prompt the grammar
cannot parse is an error, or with `reward_atoms(unparsed="zero")` scores 0 on all five
atoms without a detection (a constant within its group: another atom, such as a CLIP
score, must then carry its reward). Evaluation metrics without vacuous entries:
`atom_accuracy`. Per-atom scores for one prompt (CAST's signed atom advantages
within a group): `score_image` (`cached_score_image` shares the reward's detection).
"""

from __future__ import annotations

import colorsys
import functools
import hashlib
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

from mmrl.core.rewards import Reward, RewardAtom, reward_atom

__all__ = [
    "ATOM_TYPES",
    "COLOURS",
    "IMAGE_SIZE",
    "RELATIONS",
    "SHAPES",
    "Atom",
    "Object",
    "ObjectSpec",
    "Scene",
    "Shape",
    "atom_accuracy",
    "cached_score_image",
    "can_parse",
    "classify_pixels",
    "detect",
    "evaluate_atoms",
    "format_prompt",
    "make_scene",
    "parse_objects",
    "parse_prompt",
    "relation_holds",
    "render",
    "reward_atoms",
    "sample_prompts",
    "score_image",
    "shapes_geneval_reward",
    "to_rgb",
]

# 64 px: small enough for the bundled tiny flow model to learn on a 2-core CPU, large
# enough for shapes of 14-24 px (a fifth to three eighths of the side) to be told apart.
IMAGE_SIZE: int = 64

# The same RGB values as the VLM's scenes (mmrl/vlm/tasks/scenes.py), kept here so the
# benchmark does not move when the VLM task changes. Colours must be saturated (the
# detector works on hue); more can be added: tolerances adapt to the neighbours' hues.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
ATOM_TYPES: tuple[str, ...] = ("exist", "colour", "count", "relation")
COUNT_WORDS: dict[str, int] = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4}
MAX_COUNT = 4
BACKGROUND = (255, 255, 255)

# ---- relations
RELATION_MARGIN = 0.5  # along-axis centre distance >= this x the mean extent along the axis
RELATION_DOMINANCE = 0.5  # along-axis distance >= this x the cross-axis offset (~63 degrees)

# ---- rendering (fractions of the image side)
SHAPE_SIZE_FRAC = (14 / 64, 24 / 64)  # box side range of a rendered shape
MIN_SHAPE_FRAC = 10 / 64  # crowded prompts shrink shapes down to this (the detector tells
# circles from squares reliably from ~10 pixels up)
GAP_FRAC = 3 / 64  # white kept between two shapes' boxes (along at least one axis)
EDGE_FRAC = 2 / 64  # white kept between a box and the image border
SUPERSAMPLE = 4  # anti-aliasing: draw at 4x, downsample with a box filter
_PLACE_TRIES = 60  # tries to place one shape
_SCENE_TRIES = 200  # random tries to place a scene (shapes get smaller every quarter); then a grid
_RENDER_DOMINANCE = 0.75  # the renderer keeps relations within 53 degrees of the axis

# ---- detector
HUE_TOL = 25.0  # strict hue tolerance, degrees; at most HUE_GAP_FRAC x the hue gap to the
HUE_GAP_FRAC = 0.3  # nearest other palette colour: red (0) and yellow (51) get +-15 (orange,
# hue 16-35, is neither), green +-23, blue +-25
HUE_TOL_LOOSE = 40.0  # loose tolerance (at most half the gap): blurred edges, kept only in
STRICT_FRAC = 0.5  # components with at least this fraction of strict pixels
CHROMA_FRAC = 0.45  # a pixel needs >= this x its colour's chroma (max - min of RGB in [0,1])
MIN_CHROMA = 0.12
MIN_VALUE = 0.2  # darker pixels (outlines, shadows) are ignored
CORE_DIV = 128  # core erosion radius = max(1, round(min(H, W) / CORE_DIV)): 1 px at 64-191 px
CORE_FRAC = 0.15  # a component whose eroded core is under this fraction of it is a thin fringe
MIN_AREA_FRAC = 0.003  # components under this fraction of the image are specks (12 px at 64)
MIN_AREA_PX = 8
SPLIT_RES = 48  # the split works on the component downsampled to <= this many pixels
SPLIT_H = 0.15  # a core of a split must rise this x the deepest point above the threshold ...
SPLIT_MIN_H = 2  # ... and at least this many (downsampled) pixels
MIN_SOLIDITY = 0.7  # below: no shape (a blob)
MAX_ASPECT = 2.0  # minimum-rectangle long/short side above this: no shape (a bar)
BACKGROUND_MIN_FILL = 0.95  # a component spanning the image with its hull filling this of its rectangle: background
TRIANGLE_MAX_FILL = 0.8  # shape scores: see _classify
TRIANGLE_MIN_SCORE = 0.35
SQUARE_MIN_SCORE = 0.85


# ============================================================================ grammar


@dataclass(frozen=True)
class ObjectSpec:
    """One noun phrase of a prompt: `count` objects of `colour` and `shape`."""

    count: int
    colour: str
    shape: str

    @property
    def kind(self) -> str:
        return f"{self.colour} {self.shape}"

    def phrase(self) -> str:
        """Canonical wording: "a red circle", "two blue squares"."""
        if self.count == 1:
            word = "an" if self.colour[:1] in "aeiou" else "a"
        else:
            word = {2: "two", 3: "three", 4: "four"}[self.count]
        return f"{word} {self.colour} {self.shape}{'s' if self.count > 1 else ''}"


@dataclass(frozen=True)
class Atom:
    """One checkable unit of a prompt.

    kind: "exist" | "colour" | "count" | "relation".
    name: unique within the prompt and stable, e.g. "count[red circle]=2".
    objects: the phrase(s) it is about (for a relation: subject, object).
    value: exist -> the shape; colour -> the colour; count -> the number required
        (summed over phrases of the same kind); relation -> the relation.
    parents: names of the atoms that gate it (all appear earlier in the list).
    """

    kind: str
    name: str
    objects: tuple[ObjectSpec, ...]
    value: str | int
    parents: tuple[str, ...] = ()


def _normalise(prompt) -> str:
    if not isinstance(prompt, str):
        raise TypeError(f"a shapes-geneval prompt must be a str, got {type(prompt).__name__}")
    text = prompt.strip().lower()
    text = text.removesuffix(".")
    return " ".join(text.split())


def prompt_key(prompt: str) -> str:
    """The prompt as the parser reads it: two prompts that differ only in case, spacing or a
    final period are one prompt to the reward (and, for a held-out check, one prompt)."""
    return _normalise(prompt)


def parse_objects(prompt: str) -> tuple[list[ObjectSpec], str | None]:
    """The prompt's phrases (one, or subject and object) and its relation (or None).
    TypeError for a non-string; ValueError naming the words it cannot parse."""
    return _parse_objects(_normalise(prompt), prompt)


@functools.lru_cache(maxsize=4096)
def _parse_cached(text: str) -> tuple[tuple[ObjectSpec, ...], str | None]:
    words = text.split()
    if not words:
        raise ValueError("empty shapes-geneval prompt")
    first, pos = _phrase(words, 0)
    if pos == len(words):
        return (first,), None
    relation, pos = _relation(words, pos)
    second, pos = _phrase(words, pos)
    if pos != len(words):
        raise _ParseError(words, pos, "the end of the prompt")
    return (first, second), relation


def _parse_objects(text: str, prompt: str) -> tuple[list[ObjectSpec], str | None]:
    try:
        objects, relation = _parse_cached(text)
    except _ParseError as e:
        raise ValueError(f"cannot parse shapes-geneval prompt {shorten(prompt)!r}: {e}{json_hint(prompt)}") from None
    return list(objects), relation


def json_hint(prompt: str) -> str:
    """What a prompt that is JSON text is (a JSON-lines file, or a CSV's quotes, given as a prompt
    file): the grammar's "expected a count" alone says nothing of the file's format."""
    try:
        value = json.loads(prompt)
    except ValueError:
        return ""
    if isinstance(value, dict):
        return (" (a JSON object: a prompt file holds plain text, one prompt per line, such as "
                "'two red circles left of a blue square')")
    return " (in quotes: write the prompt without them)" if isinstance(value, str) else ""


def shorten(text: str, limit: int = 80) -> str:
    """text, cut to `limit` characters with "..." where longer: a long free-form prompt in a
    message (a whole paragraph, repeated, drowned the words at fault)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _ParseError(Exception):
    def __init__(self, words: list[str], pos: int, expected: str):
        if pos < len(words):
            what = f"unparsed words {shorten(' '.join(words[pos:]))!r}"
        else:
            what = f"nothing after {shorten(' '.join(words))!r}"
        super().__init__(f"{what}; expected {expected}")


def _phrase(words: list[str], pos: int) -> tuple[ObjectSpec, int]:
    def word(i: int) -> str | None:
        return words[i] if i < len(words) else None

    if word(pos) not in COUNT_WORDS:
        raise _ParseError(words, pos, "a count (a, an, one, two, three, four)")
    if word(pos + 1) not in COLOURS:
        raise _ParseError(words, pos + 1, f"a colour ({', '.join(COLOURS)})")
    shape = word(pos + 2)
    if shape is not None and shape.endswith("s") and shape[:-1] in SHAPES:
        shape = shape[:-1]
    if shape not in SHAPES:
        raise _ParseError(words, pos + 2, f"a shape ({', '.join(SHAPES)}, or their plurals)")
    return ObjectSpec(COUNT_WORDS[words[pos]], words[pos + 1], shape), pos + 3


def _relation(words: list[str], pos: int) -> tuple[str, int]:
    start = pos
    if words[pos : pos + 2] == ["to", "the"] and words[pos + 2 : pos + 3] in (["left"], ["right"]):
        pos += 2
    for rel in RELATIONS:
        n = len(rel.split())
        if words[pos : pos + n] == rel.split():
            return rel, pos + n
    raise _ParseError(words, start, f"a relation ({', '.join(RELATIONS)}) or the end")


def parse_prompt(prompt: str) -> list[Atom]:
    """The prompt's atoms, parents before children (see the module docstring).
    TypeError for a non-string; ValueError naming the words it cannot parse."""
    objects, relation = parse_objects(prompt)
    return list(_build_atoms(tuple(objects), relation))


@functools.lru_cache(maxsize=4096)
def _build_atoms(objects: tuple[ObjectSpec, ...], relation: str | None) -> tuple[Atom, ...]:
    totals: dict[str, int] = {}
    for o in objects:
        totals[o.kind] = totals.get(o.kind, 0) + o.count
    atoms: list[Atom] = []
    seen: set[str] = set()

    def add(atom: Atom) -> None:
        if atom.name not in seen:
            seen.add(atom.name)
            atoms.append(atom)

    for o in objects:
        exist = f"exist[{o.shape}]"
        colour = f"colour[{o.kind}]"
        add(Atom("exist", exist, (o,), o.shape))
        add(Atom("colour", colour, (o,), o.colour, (exist,)))
        add(Atom("count", f"count[{o.kind}]={totals[o.kind]}", (o,), totals[o.kind], (colour,)))
    if relation is not None:
        a, b = objects
        parents = tuple(dict.fromkeys((f"colour[{a.kind}]", f"colour[{b.kind}]")))
        add(Atom("relation", f"relation[{a.kind} {relation} {b.kind}]", (a, b), relation, parents))
    return tuple(atoms)


def format_prompt(objects: Sequence[ObjectSpec], relation: str | None = None) -> str:
    """Canonical prompt text: "two red circles left of a blue square"."""
    objects = list(objects)
    if relation is None:
        if len(objects) != 1:
            raise ValueError(f"a prompt without a relation has one phrase, got {len(objects)}")
        return objects[0].phrase()
    if relation not in RELATIONS:
        raise ValueError(f"unknown relation {relation!r} (known: {', '.join(RELATIONS)})")
    if len(objects) != 2:
        raise ValueError(f"a prompt with a relation has two phrases, got {len(objects)}")
    return f"{objects[0].phrase()} {relation} {objects[1].phrase()}"


EVAL_FRACTION = 0.2  # of all prompts: the held-out ones, with disjoint=True


def split_of(prompt: str) -> str:
    """"eval" for a fixed EVAL_FRACTION of all prompts (by a sha256 of the prompt), else "train":
    stable across processes and Python versions."""
    digest = hashlib.sha256(f"shapes-geneval\x00{prompt}".encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") < EVAL_FRACTION * 2**64 else "train"


def sample_prompts(
    n: int,
    seed: int = 0,
    *,
    split: str = "train",
    disjoint: bool = False,
    relation_p: float = 0.5,
    max_count: int = MAX_COUNT,
    max_relation_count: int = 2,
    colours: Sequence[str] | None = None,
    shapes: Sequence[str] | None = None,
    relations: Sequence[str] | None = None,
) -> list[str]:
    """n seeded prompts. Prompt i depends only on (split, seed, i) and the settings, so
    a longer list extends a shorter one and the train and eval streams share no state.

    With probability relation_p a relation prompt: two phrases of different kinds
    (colour, shape), counts ~ U{1..max_relation_count}, a uniform relation; else one
    phrase, count ~ U{1..max_count}. Colours and shapes are uniform. Every prompt has
    exist, colour and count atoms; relation prompts add a relation atom.

    disjoint: keep only the prompts of `split` (split_of), so that a train and an eval list
    share no prompt; without it the two streams draw from the whole space, and with 48
    one-phrase prompts most eval prompts are training prompts too."""
    colours = list(COLOURS) if colours is None else list(colours)
    shapes = list(SHAPES) if shapes is None else list(shapes)
    relations = list(RELATIONS) if relations is None else list(relations)
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if not 0.0 <= relation_p <= 1.0:
        raise ValueError(f"relation_p must be in [0, 1], got {relation_p}")
    for name, value in (("max_count", max_count), ("max_relation_count", max_relation_count)):
        if not 1 <= value <= MAX_COUNT:
            raise ValueError(f"{name} must be in 1..{MAX_COUNT}, got {value}")
    for name, given, known in (
        ("colours", colours, COLOURS),
        ("shapes", shapes, SHAPES),
        ("relations", relations, RELATIONS),
    ):
        unknown = [g for g in given if g not in known]
        if not given or unknown:
            raise ValueError(f"{name} must be a non-empty subset of {list(known)}, got {given}")
    kinds = [(c, s) for c in colours for s in shapes]
    if relation_p > 0 and len(kinds) < 2:
        raise ValueError("relation prompts need at least two (colour, shape) kinds")
    prompts: list[str] = []
    i = 0
    while len(prompts) < n:
        if i >= 100 * n + 1000:  # a vocabulary too small to hold n draws of this split
            raise ValueError(f"{i} draws gave {len(prompts)} {split} prompts of the {n} asked for: with "
                             "disjoint=True, these colours, shapes and counts leave too few prompts in the split")
        rng = random.Random(f"shapes-geneval/{split}/{seed}/{i}")  # str seeds: stable sha512
        i += 1
        if rng.random() < relation_p:
            (c1, s1), (c2, s2) = rng.sample(kinds, 2)
            a = ObjectSpec(rng.randint(1, max_relation_count), c1, s1)
            b = ObjectSpec(rng.randint(1, max_relation_count), c2, s2)
            prompt = format_prompt([a, b], rng.choice(relations))
        else:
            c, s = rng.choice(kinds)
            prompt = ObjectSpec(rng.randint(1, max_count), c, s).phrase()
        if not disjoint or split_of(prompt) == split:
            prompts.append(prompt)
    return prompts


# ============================================================================ scenes and rendering


@dataclass
class Shape:
    """One solid shape in a square box of side `size` centred on (x, y), in pixels:
    the circle's diameter, the square's side, the (upright) triangle's base and height."""

    shape: str
    colour: str
    x: float
    y: float
    size: float

    def box(self) -> tuple[float, float, float, float]:
        """(left, top, right, bottom); right and bottom exclusive."""
        h = self.size / 2
        return (self.x - h, self.y - h, self.x + h, self.y + h)


@dataclass
class Scene:
    """A list of shapes on a white `size` x `size` image, and the prompt it satisfies."""

    shapes: list[Shape] = field(default_factory=list)
    size: int = IMAGE_SIZE
    prompt: str | None = None

    def box_mask(self) -> np.ndarray:
        """[size, size] bool: the pixels inside any shape's bounding box (clipped to the image)."""
        mask = np.zeros((self.size, self.size), dtype=bool)
        for s in self.shapes:
            left, top, right, bottom = (round(v) for v in s.box())
            mask[max(top, 0):bottom, max(left, 0):right] = True
        return mask


def _apart(a: tuple, b: tuple, gap: float) -> bool:
    return a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]


def make_scene(prompt: str, seed: int = 0, size: int = IMAGE_SIZE) -> Scene:
    """A random scene that satisfies `prompt`: exactly the objects it asks for, box sides
    ~ U{SHAPE_SIZE_FRAC x size}, inside the image, boxes GAP_FRAC x size apart, and the
    relation (if any) kept with the two groups' boxes on either side of a line across
    its axis and every pair within ~53 degrees of the axis. Crowded prompts get smaller
    shapes, and if random placement keeps failing, a grid. Deterministic in
    (prompt, seed, size)."""
    objects, relation = parse_objects(prompt)
    if not isinstance(size, int) or size < 32:
        raise ValueError(f"size must be an int >= 32, got {size!r}")
    rng = random.Random(f"shapes-geneval-scene/{_normalise(prompt)}/{seed}/{size}")
    gap = max(2, round(GAP_FRAC * size))
    edge = max(1, round(EDGE_FRAC * size))
    # (colour, shape, group): group 0 has the lower coordinate along the relation's axis
    low_first = relation in ("left of", "above")
    instances = []
    for k, o in enumerate(objects):
        group = None if relation is None else (k if low_first else 1 - k)
        instances += [(o.colour, o.shape, group)] * o.count
    axis = 1 if relation in ("above", "below") else 0
    n_low = sum(g == 0 for _, _, g in instances)
    for attempt in range(_SCENE_TRIES):
        scale = 1.0 - 0.1 * (attempt // (_SCENE_TRIES // 4))
        lo = max(round(size * MIN_SHAPE_FRAC), round(size * SHAPE_SIZE_FRAC[0] * scale))
        hi = max(lo, round(size * SHAPE_SIZE_FRAC[1] * scale))
        split = (n_low / len(instances) + rng.uniform(-0.1, 0.1)) * size
        placed: list[tuple[Shape, int | None]] = []
        for colour, shape, group in instances:
            for _ in range(_PLACE_TRIES):
                s = rng.randint(lo, hi)
                lim = [(edge, size - edge - s), (edge, size - edge - s)]  # [x range, y range]
                if group == 0:
                    lim[axis] = (edge, math.floor(split - gap / 2) - s)
                elif group == 1:
                    lim[axis] = (math.ceil(split + gap / 2), size - edge - s)
                if lim[0][0] > lim[0][1] or lim[1][0] > lim[1][1]:
                    continue
                left, top = rng.randint(*lim[0]), rng.randint(*lim[1])
                new = Shape(shape, colour, left + s / 2, top + s / 2, float(s))
                if all(_apart(new.box(), old.box(), gap) for old, _ in placed):
                    placed.append((new, group))
                    break
            else:
                break
        if len(placed) == len(instances) and _relation_kept(placed, axis):
            return Scene([sh for sh, _ in placed], size, prompt)
    placed = _grid_layout(instances, axis, size, gap, edge, rng)
    if placed is None or not _relation_kept(placed, axis):
        raise ValueError(f"could not place the shapes of {prompt!r} in a {size}x{size} image")
    return Scene([sh for sh, _ in placed], size, prompt)


def _relation_kept(placed: list, axis: int) -> bool:
    """Every group-0 box is before every group-1 box along the axis (with the renderer's
    stricter dominance); True when there are no groups."""
    low = [sh.box() for sh, g in placed if g == 0]
    high = [sh.box() for sh, g in placed if g == 1]
    rel = "left of" if axis == 0 else "above"
    return all(relation_holds(a, rel, b, dominance=_RENDER_DOMINANCE) for a in low for b in high)


def _grid_layout(instances, axis, size, gap, edge, rng) -> list | None:
    """Fallback for crowded prompts: each group fills a grid of up to 2 x 2 cells in its
    half of the image (the whole image without a relation), shapes centred in the cells."""
    groups: dict = {}
    for inst in instances:
        groups.setdefault(inst[2], []).append(inst)
    placed = []
    for group, members in groups.items():
        n = len(members)
        cols = 1 if n == 1 else 2  # cells along the axis
        rows = math.ceil(n / cols)  # cells across it
        span = (size - 2 * edge) / (1 if group is None else 2)
        start = edge + (span if group == 1 else 0)
        cell = min(span / cols, (size - 2 * edge) / max(rows, 2))
        s = math.floor(cell - gap)
        if s < max(4, round(size * MIN_SHAPE_FRAC) - 2):
            return None
        cross0 = (size - rows * cell) / 2
        rng.shuffle(members)
        for i, (colour, shape, g) in enumerate(members):
            a = start + (span - cols * cell) / 2 + (i % cols + 0.5) * cell
            c = cross0 + (i // cols + 0.5) * cell
            x, y = (a, c) if axis == 0 else (c, a)
            x, y = round(x - s / 2) + s / 2, round(y - s / 2) + s / 2  # boxes on whole pixels
            placed.append((Shape(shape, colour, x, y, float(s)), g))
    return placed


def render(
    prompt_or_scene: str | Scene, seed: int = 0, size: int = IMAGE_SIZE, antialias: bool = True
) -> Image.Image:
    """An RGB image of a Scene, or of `make_scene(prompt, seed, size)` for a prompt:
    solid shapes on white; anti-aliased by SUPERSAMPLE-x supersampling unless antialias
    is False (then every pixel is white or exactly a palette colour)."""
    scene = prompt_or_scene
    if isinstance(scene, str):
        scene = make_scene(scene, seed, size)
    elif not isinstance(scene, Scene):
        raise TypeError(f"render needs a prompt or a Scene, got {type(scene).__name__}")
    ss = SUPERSAMPLE if antialias else 1
    img = Image.new("RGB", (scene.size * ss, scene.size * ss), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for sh in scene.shapes:
        if sh.colour not in COLOURS:
            raise ValueError(f"unknown colour {sh.colour!r} (known: {', '.join(COLOURS)})")
        fill = COLOURS[sh.colour]
        x0, y0, x1, y1 = (v * ss for v in sh.box())
        x1, y1 = x1 - 1, y1 - 1  # ImageDraw's boxes include their right/bottom edge
        if sh.shape == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif sh.shape == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        elif sh.shape == "triangle":  # upright: apex at the top centre
            draw.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=fill)
        else:
            raise ValueError(f"unknown shape {sh.shape!r} (known: {', '.join(SHAPES)})")
    if ss > 1:
        img = img.resize((scene.size, scene.size), Image.Resampling.BOX)
    return img


# ============================================================================ detector


@dataclass(frozen=True)
class Object:
    """A detected solid shape. Pixel (x, y) covers [x, x+1) x [y, y+1).

    shape: "circle" | "square" | "triangle", or None when unrecognised.
    bbox: (left, top, right, bottom), right and bottom exclusive.
    centroid: (x, y) centre of mass. area: pixels.
    fill: convex-hull area / minimum-area bounding rectangle area (the shape feature).
    solidity: area / convex-hull area. aspect: long / short side of that rectangle.
    """

    colour: str
    shape: str | None
    bbox: tuple[int, int, int, int]
    centroid: tuple[float, float]
    area: int
    fill: float = 0.0
    roundness: float = 1.0
    solidity: float = 1.0
    aspect: float = 1.0

    @property
    def center(self) -> tuple[float, float]:
        """Centre of the bounding box (what relations compare)."""
        x0, y0, x1, y1 = self.bbox
        return ((x0 + x1) / 2, (y0 + y1) / 2)

    @property
    def kind(self) -> str:
        return f"{self.colour} {self.shape}"


def to_rgb(image) -> Image.Image:
    """A PIL RGB image from a PIL image of any mode (transparency over white; 16-bit
    and float greyscale rescaled) or a numpy array [H, W], [H, W, 3] or [H, W, 4]
    (uint8; uint16; other integers, read as 8-bit where none is above 255, else as 16-bit;
    float in [0, 1] or [0, 255]). TypeError for anything else."""
    if isinstance(image, np.ndarray):
        return _array_to_rgb(image)
    if not isinstance(image, Image.Image):
        raise TypeError(
            f"expected a PIL image or a numpy array [H, W(, C)], got {type(image).__name__}"
        )
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        return _array_to_rgb(np.asarray(image))
    if image.mode in ("RGBA", "LA", "PA", "La", "RGBa") or (
        image.mode == "P" and "transparency" in image.info
    ):
        rgba = image.convert("RGBA")
        out = Image.new("RGB", rgba.size, BACKGROUND)
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return image.convert("RGB")


def _array_to_rgb(a: np.ndarray) -> Image.Image:
    if a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[2] not in (1, 3, 4)):
        raise TypeError(f"expected an image array [H, W] or [H, W, 1|3|4], got shape {a.shape}")
    if a.dtype == np.uint8:
        x = a.astype(np.float32) / 255
    elif a.dtype == np.uint16:
        x = a.astype(np.float32) / 65535
    elif np.issubdtype(a.dtype, np.integer):  # 8-bit values in a wider type (np.asarray(img).astype(int)),
        # else 16-bit ones (PIL's mode I), as diffusion_rl.rewards.to_rgb reads them
        x = a.astype(np.float32) / (255 if a.max(initial=0) <= 255 else 65535)
    elif np.issubdtype(a.dtype, np.floating):
        x = a.astype(np.float32)
        if np.nanmax(x, initial=0.0) > 1.0:  # a float image in 0..255
            x = x / 255
    elif a.dtype == np.bool_:
        x = a.astype(np.float32)
    else:
        raise TypeError(f"unsupported image array dtype {a.dtype}")
    x = np.nan_to_num(np.clip(x, 0.0, 1.0))
    if x.ndim == 2:
        x = x[..., None]
    if x.shape[2] == 1:
        x = np.repeat(x, 3, axis=2)
    elif x.shape[2] == 4:
        alpha = x[..., 3:]
        x = x[..., :3] * alpha + (1 - alpha)  # over white
    return Image.fromarray(np.round(x * 255).astype(np.uint8), "RGB")


@functools.lru_cache(maxsize=8)
def _palette(colours: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(hues in degrees [K], strict and loose hue tolerances [K], minimum chroma [K])."""
    hues, chromas = [], []
    for _, rgb in colours:
        r, g, b = (v / 255 for v in rgb)
        hues.append(colorsys.rgb_to_hsv(r, g, b)[0] * 360)
        chromas.append(max(r, g, b) - min(r, g, b))
    hues_a = np.array(hues, dtype=np.float32)
    strict = np.full(len(hues), HUE_TOL, dtype=np.float32)
    loose = np.full(len(hues), HUE_TOL_LOOSE, dtype=np.float32)
    for k in range(len(hues)):
        others = np.delete(hues_a, k)
        if len(others):
            gap = np.min(np.abs((others - hues_a[k] + 180) % 360 - 180))
            strict[k] = min(HUE_TOL, HUE_GAP_FRAC * gap)
            loose[k] = min(HUE_TOL_LOOSE, gap / 2)
    min_chroma = np.maximum(MIN_CHROMA, CHROMA_FRAC * np.array(chromas, dtype=np.float32))
    return hues_a, strict, loose, min_chroma


def _classify_pixels(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([H, W] int8 palette index within the loose tolerance, -1 for none;
    [H, W] bool: within the strict tolerance too)."""
    hues, strict, loose, min_chroma = _palette(tuple(COLOURS.items()))
    h, w = rgb.shape[:2]
    x = rgb.reshape(-1, 3).astype(np.float32) / 255  # [P, 3]
    mx, mn = x.max(axis=1), x.min(axis=1)
    cand = np.flatnonzero((mx - mn >= min_chroma.min()) & (mx >= MIN_VALUE))  # not white/grey
    x, mx, c = x[cand], mx[cand], (mx - mn)[cand]
    r, g, b = x[:, 0], x[:, 1], x[:, 2]
    hue = (
        np.where(mx == r, ((g - b) / c) % 6, np.where(mx == g, (b - r) / c + 2, (r - g) / c + 4))
        * 60
    )  # [P'] degrees
    dist = np.abs((hue[:, None] - hues + 180) % 360 - 180)  # [P', K]
    dist = np.where((dist <= loose) & (c[:, None] >= min_chroma), dist, np.inf)
    best = dist.argmin(axis=1)
    best_dist = dist[np.arange(len(best)), best]
    found = np.isfinite(best_dist)
    cls = np.full(h * w, -1, dtype=np.int8)
    cls[cand[found]] = best[found]
    is_strict = np.zeros(h * w, dtype=bool)
    is_strict[cand[found]] = best_dist[found] <= strict[best[found]]
    return cls.reshape(h, w), is_strict.reshape(h, w)


def classify_pixels(rgb: np.ndarray, strict: bool = True) -> np.ndarray:
    """[H, W, 3] uint8 -> [H, W] int8: the index in COLOURS of each pixel's palette
    colour (nearest hue, chroma and value high enough), -1 for none. strict: within
    the strict hue tolerance; else within the loose one (the detector keeps loose
    pixels only in components that are mostly strict)."""
    cls, is_strict = _classify_pixels(np.asarray(rgb))
    return np.where(is_strict, cls, -1).astype(np.int8) if strict else cls


def _shift(a: np.ndarray, d: int, axis: int) -> np.ndarray:
    """a moved by d pixels along axis (positive: down / right), False shifted in."""
    out = np.zeros_like(a)
    src = [slice(None), slice(None)]
    dst = [slice(None), slice(None)]
    src[axis] = slice(0, -d) if d > 0 else slice(-d, None)
    dst[axis] = slice(d, None) if d > 0 else slice(0, d)
    out[tuple(dst)] = a[tuple(src)]
    return out


def _erode(mask: np.ndarray, r: int) -> np.ndarray:
    """Erosion by a (2r+1) x (2r+1) square (separable); outside the image is background."""
    out = mask
    for axis in (0, 1):
        if r >= out.shape[axis]:
            return np.zeros_like(mask)
        acc = out.copy()
        for k in range(1, r + 1):
            acc &= _shift(out, k, axis) & _shift(out, -k, axis)
        out = acc
    return out


def _label(cls: np.ndarray) -> tuple[np.ndarray, int]:
    """4-connected components of equal non-negative values of `cls` [H, W].
    Returns (labels [H, W] int32, -1 outside; number of components). Works on
    horizontal runs: runs of one row touch runs of the next where they share columns."""
    h, w = cls.shape
    fg = cls >= 0
    start = fg.copy()
    start[:, 1:] &= cls[:, 1:] != cls[:, :-1]
    run_id = (np.cumsum(start.ravel()) - 1).reshape(h, w)  # the run each pixel belongs to
    n_runs = int(start.sum())
    if n_runs == 0:
        return np.full((h, w), -1, dtype=np.int32), 0
    same = fg[:-1] & (cls[:-1] == cls[1:])  # [H-1, W]: pixel and the one below connect
    a, b = run_id[:-1][same], run_id[1:][same]
    pairs = np.unique(a.astype(np.int64) * n_runs + b)
    parent = list(range(n_runs))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for ra, rb in zip((pairs // n_runs).tolist(), (pairs % n_runs).tolist()):
        pa, pb = find(ra), find(rb)
        if pa != pb:
            parent[max(pa, pb)] = min(pa, pb)
    roots = np.array([find(i) for i in range(n_runs)])
    _, comp = np.unique(roots, return_inverse=True)  # consecutive ids, in raster order of roots
    labels = np.where(fg, comp[run_id], -1).astype(np.int32)
    return labels, int(comp.max()) + 1


def _convex_hull(points: np.ndarray) -> np.ndarray:
    """Monotone chain; points [P, 2] -> hull vertices [M, 2] counter-clockwise."""
    pts = sorted(set(map(tuple, points.tolist())))
    if len(pts) <= 2:
        return np.array(pts, dtype=np.float64)

    def cross(o, a, b):
        return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])

    lower: list = []
    for p in pts:
        while len(lower) >= 2 and cross(lower[-2], lower[-1], p) <= 0:
            lower.pop()
        lower.append(p)
    upper: list = []
    for p in reversed(pts):
        while len(upper) >= 2 and cross(upper[-2], upper[-1], p) <= 0:
            upper.pop()
        upper.append(p)
    return np.array(lower[:-1] + upper[:-1], dtype=np.float64)


def _polygon_area(p: np.ndarray) -> float:
    x, y = p[:, 0], p[:, 1]
    return float(abs(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))) / 2)


def _min_rectangle(hull: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """Minimum-area enclosing rectangle of a convex polygon [M, 2] (one side lies on a
    hull edge): (area, its axes [2, 2] as unit rows, origin [2]) such that
    hull @ axes.T - origin spans [0, w] x [0, h]."""
    edges = np.roll(hull, -1, axis=0) - hull  # [M, 2]
    lengths = np.linalg.norm(edges, axis=1)
    edges = edges[lengths > 0] / lengths[lengths > 0, None]  # [E, 2]
    normals = np.stack([-edges[:, 1], edges[:, 0]], axis=1)
    along, across = hull @ edges.T, hull @ normals.T  # [M, E]
    w = along.max(axis=0) - along.min(axis=0)
    h = across.max(axis=0) - across.min(axis=0)
    k = int(np.argmin(w * h))
    axes = np.stack([edges[k], normals[k]])
    origin = np.array([along[:, k].min(), across[:, k].min()])
    return float(w[k] * h[k]), axes, origin


def _shape_features(centres: np.ndarray, centroid: np.ndarray) -> tuple[float, float, float]:
    """(fill, roundness, aspect) of the convex hull of pixel centres [P, 2], measured in
    the frame of its minimum-area rectangle scaled to a unit square (so an ellipse
    scores like a circle and a rectangle like a square):
      fill = hull area / rectangle area (disc pi/4, square 1, any triangle 0.5);
      roundness = largest centroid-to-vertex distance / smallest centroid-to-edge
        distance (disc 1, square sqrt 2, triangle 2 and more);
      aspect = long / short side of the rectangle, in pixels."""
    hull = _convex_hull(centres)
    if len(hull) < 3:  # a line of pixels
        extent = float(np.ptp(centres, axis=0).max()) + 1 if len(centres) else 1.0
        return 1.0, 1.0, extent
    rect, axes, origin = _min_rectangle(hull)
    sides = np.ptp(hull @ axes.T, axis=0) + 1e-9  # [2]: w, h
    fill = min(1.0, _polygon_area(hull) / max(rect, 1e-9))
    unit = (hull @ axes.T - origin) / sides  # [M, 2] in the unit square
    c = (centroid @ axes.T - origin) / sides
    r_max = np.linalg.norm(unit - c, axis=1).max()
    e = np.roll(unit, -1, axis=0) - unit
    length = np.linalg.norm(e, axis=1)
    e, start = e[length > 0] / length[length > 0, None], unit[length > 0] - c
    r_min = np.abs(start[:, 0] * e[:, 1] - start[:, 1] * e[:, 0]).min()
    roundness = float(r_max / max(r_min, 1e-9))
    aspect = float((sides.max() + 1) / (sides.min() + 1))  # + 1: centres lie 0.5 px inside
    return fill, roundness, aspect


def _classify(fill: float, roundness: float) -> str:
    """The nearest of the three shapes in (fill, roundness), by two normalised scores,
    0 at the ideal disc and 1 at the ideal triangle (t) or square (q)."""
    disc = math.pi / 4
    t = (disc - fill) / (disc - 0.5) + (roundness - 1.0) / (2.0 - 1.0)
    q = (fill - disc) / (1.0 - disc) + (roundness - 1.0) / (math.sqrt(2) - 1.0)
    if fill < TRIANGLE_MAX_FILL and t >= TRIANGLE_MIN_SCORE:
        return "triangle"
    return "square" if q >= SQUARE_MIN_SCORE else "circle"


def _measure(ys: np.ndarray, xs: np.ndarray, colour: str) -> Object:
    """An Object from the pixel coordinates of one component, in raster order.
    Solidity uses the hull of the pixels' corners (a pixel square has solidity 1);
    the shape features use the hull of the pixels' centres (less staircase error)."""
    area = len(ys)
    row_start = np.flatnonzero(np.r_[True, ys[1:] != ys[:-1]])
    row_end = np.r_[row_start[1:], area] - 1
    ry, x_lo, x_hi = ys[row_start], xs[row_start], xs[row_end] + 1  # x_hi exclusive
    corners = np.concatenate(
        [np.stack(p, axis=1) for p in ((x_lo, ry), (x_lo, ry + 1), (x_hi, ry), (x_hi, ry + 1))]
    )
    centres = np.concatenate([np.stack(p, axis=1) for p in ((x_lo, ry), (x_hi - 1, ry))])
    corner_hull = _convex_hull(corners)
    corner_area = _polygon_area(corner_hull) if len(corner_hull) >= 3 else float(area)
    solidity = min(1.0, area / max(corner_area, 1e-9))
    centroid = np.array([xs.mean(), ys.mean()])  # in pixel-centre coordinates
    fill, roundness, aspect = _shape_features(centres, centroid)
    if solidity < MIN_SOLIDITY or aspect > MAX_ASPECT:
        shape = None
    else:
        shape = _classify(fill, roundness)
    bbox = (int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1)
    centroid_xy = (float(centroid[0]) + 0.5, float(centroid[1]) + 0.5)
    return Object(colour, shape, bbox, centroid_xy, area, fill, roundness, solidity, aspect)


def _depth(mask: np.ndarray) -> np.ndarray:
    """[h, w] int: how many erosions each pixel of `mask` survives, plus one, alternating
    4-neighbour and 8-neighbour steps (an octagonal, nearly Euclidean distance to the
    outside); 0 outside."""
    depth = np.zeros(mask.shape, dtype=np.int32)
    cur, step = mask, 0
    while cur.any():
        depth += cur
        if step % 2 == 0:  # 4-neighbour (cross) erosion
            cur = (
                cur
                & _shift(cur, 1, 0)
                & _shift(cur, -1, 0)
                & _shift(cur, 1, 1)
                & _shift(cur, -1, 1)
            )
        else:
            cur = _erode(cur, 1)
        step += 1
    return depth


def _split_touching(mask: np.ndarray, min_area: float) -> list[np.ndarray]:
    """Split a component [h, w] with necks (touching same-colour shapes) into pieces.

    On a copy downsampled to <= SPLIT_RES pixels, take the depth map (distance to the
    outside); raise a threshold t until {depth >= t} falls apart into >= 2 cores that
    each rise at least max(SPLIT_MIN_H, SPLIT_H x the deepest point) above t (a body,
    not a ripple of the outline); grow the cores back one pixel per step over the
    component and give every pixel to its core. A convex shape never splits: all its
    threshold sets are connected. Returns [mask] if there is no split, or if a piece
    would be smaller than min_area."""
    h, w = mask.shape
    f = max(1, math.ceil(max(h, w) / SPLIT_RES))
    ph, pw = -(-h // f) * f, -(-w // f) * f
    padded = np.zeros((ph, pw), dtype=np.float32)
    padded[:h, :w] = mask
    coarse = padded.reshape(ph // f, f, pw // f, f).mean(axis=(1, 3)) >= 0.5
    depth = _depth(coarse)
    peak = int(depth.max())
    rise = max(SPLIT_MIN_H, SPLIT_H * peak)
    seeds = None
    for t in range(2, peak + 1):
        lab, n = _label(np.where(depth >= t, 0, -1).astype(np.int8))
        if n < 2:
            continue
        inside = lab >= 0
        peaks = np.zeros(n, dtype=np.int32)
        np.maximum.at(peaks, lab[inside], depth[inside])
        big = np.flatnonzero(peaks - t >= rise)
        if len(big) >= 2:
            remap = np.full(n, -1)
            remap[big] = np.arange(len(big))
            seeds = np.where(inside, remap[lab], -1)
            break
    if seeds is None:
        return [mask]
    grown = seeds
    while True:  # every core grows by one pixel per step, inside the coarse mask
        before = grown
        for d, axis in ((1, 0), (-1, 0), (1, 1), (-1, 1)):
            src = _shift(before + 1, d, axis) - 1  # shifted labels; -1 where none
            grown = np.where(coarse & (grown < 0) & (src >= 0), src, grown)
        if np.array_equal(grown, before):
            break
    full = np.repeat(np.repeat(grown, f, axis=0), f, axis=1)[:h, :w]
    k = int(grown.max()) + 1
    orphan = mask & (full < 0)  # component pixels in coarse cells that fell below half
    if orphan.any():
        cy = np.array([np.nonzero(full == i)[0].mean() for i in range(k)])
        cx = np.array([np.nonzero(full == i)[1].mean() for i in range(k)])
        oy, ox = np.nonzero(orphan)
        nearest = np.argmin((oy[:, None] - cy) ** 2 + (ox[:, None] - cx) ** 2, axis=1)
        full = full.copy()
        full[oy, ox] = nearest
    pieces = [mask & (full == i) for i in range(k)]
    if min(int(p.sum()) for p in pieces) < min_area:
        return [mask]
    return pieces


def detect(image, *, include_unknown: bool = False) -> list[Object]:
    """The solid palette-coloured shapes of an image (see the module docstring), sorted
    left to right (ties: top to bottom). Objects without a recognised shape are left
    out unless include_unknown. TypeError if `image` is not an image."""
    rgb = np.asarray(to_rgb(image))  # [H, W, 3] uint8
    h, w = rgb.shape[:2]
    if h == 0 or w == 0:
        return []
    names = list(COLOURS)
    cls, strict = _classify_pixels(rgb)
    labels, n = _label(cls)
    if n == 0:
        return []
    # keep components that are big, not thin fringes, and mostly of a clear palette hue
    radius = max(1, round(min(h, w) / CORE_DIV))
    core = np.zeros((h, w), dtype=bool)
    for k in range(len(names)):
        m = cls == k
        if m.any():
            core |= _erode(m, radius)
    flat = labels.ravel()
    idx = np.flatnonzero(flat >= 0)
    idx = idx[np.argsort(flat[idx], kind="stable")]  # by component, raster order within
    sizes = np.bincount(flat[idx], minlength=n)
    bounds = np.r_[0, np.cumsum(sizes)]
    min_area = max(MIN_AREA_PX, MIN_AREA_FRAC * h * w)
    keep = (
        (sizes >= min_area)
        & (np.bincount(labels[core], minlength=n) >= CORE_FRAC * sizes)
        & (np.bincount(labels[strict], minlength=n) >= STRICT_FRAC * sizes)
    )
    objects = []
    for comp in np.flatnonzero(keep):
        pix = idx[bounds[comp] : bounds[comp + 1]]
        ys, xs = pix // w, pix % w
        colour = names[int(cls.ravel()[pix[0]])]
        obj = _measure(ys, xs, colour)
        # spans the whole image and fills its rectangle (hull fill ~1): a coloured background; a disc
        # or triangle drawn edge to edge spans it too, but its hull fills pi/4 or 1/2 of it
        if obj.bbox == (0, 0, w, h) and obj.fill >= BACKGROUND_MIN_FILL:
            continue
        if obj.area >= 2 * min_area:
            x0, y0, x1, y1 = obj.bbox
            crop = labels[y0:y1, x0:x1] == comp
            pieces = _split_touching(crop, min_area)
            if len(pieces) > 1:
                for piece in pieces:
                    py, px = np.nonzero(piece)
                    objects.append(_measure(py + y0, px + x0, colour))
                continue
        objects.append(obj)
    if not include_unknown:
        objects = [o for o in objects if o.shape is not None]
    return sorted(objects, key=lambda o: (o.center, o.colour))


# ============================================================================ verifier


def relation_holds(
    a: Sequence[float],
    relation: str,
    b: Sequence[float],
    *,
    margin: float = RELATION_MARGIN,
    dominance: float = RELATION_DOMINANCE,
) -> bool:
    """Whether box a (left, top, right, bottom) is `relation` box b: the box centres are
    apart along the relation's axis by >= margin x the boxes' mean extent along it, and
    that distance is >= dominance x their offset across the axis."""
    ax, ay = (a[0] + a[2]) / 2, (a[1] + a[3]) / 2
    bx, by = (b[0] + b[2]) / 2, (b[1] + b[3]) / 2
    if relation in ("left of", "right of"):
        along = bx - ax if relation == "left of" else ax - bx
        across = abs(by - ay)
        extent = ((a[2] - a[0]) + (b[2] - b[0])) / 2
    elif relation in ("above", "below"):
        along = by - ay if relation == "above" else ay - by
        across = abs(bx - ax)
        extent = ((a[3] - a[1]) + (b[3] - b[1])) / 2
    else:
        raise ValueError(f"unknown relation {relation!r} (known: {', '.join(RELATIONS)})")
    return along >= margin * extent and along >= dominance * across


def _relation_score(atom: Atom, objects: Sequence[Object]) -> bool:
    a, b = atom.objects
    rel = atom.value
    if a.kind == b.kind:  # sort along the axis; the first a.count are the subjects
        axis = 0 if rel in ("left of", "right of") else 1
        sign = 1 if rel in ("left of", "above") else -1
        same = sorted((o for o in objects if o.kind == a.kind), key=lambda o: sign * o.center[axis])
        subjects, others = same[: a.count], same[a.count :]
    else:
        subjects = [o for o in objects if o.kind == a.kind]
        others = [o for o in objects if o.kind == b.kind]
    if not subjects or not others:
        return False
    return all(relation_holds(s.bbox, rel, o.bbox) for s in subjects for o in others)


def evaluate_atoms(atoms: Sequence[Atom], objects: Sequence[Object]) -> dict[str, float]:
    """Score atoms (parents first) on detected objects, with causal gating: an atom
    with a parent below 0.5 scores 0."""
    scores: dict[str, float] = {}
    for atom in atoms:
        if any(scores[p] < 0.5 for p in atom.parents):
            scores[atom.name] = 0.0
            continue
        o = atom.objects[0]
        if atom.kind == "exist":
            ok = any(obj.shape == o.shape for obj in objects)
        elif atom.kind == "colour":
            ok = any(obj.kind == o.kind for obj in objects)
        elif atom.kind == "count":
            ok = sum(obj.kind == o.kind for obj in objects) == atom.value
        elif atom.kind == "relation":
            ok = _relation_score(atom, objects)
        else:
            raise ValueError(f"unknown atom kind {atom.kind!r} (known: {', '.join(ATOM_TYPES)})")
        scores[atom.name] = 1.0 if ok else 0.0
    return scores


def score_image(image, prompt: str) -> dict[str, float]:
    """{atom name: score in [0, 1]} for every atom of the prompt, in parse order, after
    causal gating. ValueError for an unparseable prompt, TypeError for a non-image."""
    atoms = parse_prompt(prompt)  # the prompt is checked before the image is looked at
    return evaluate_atoms(atoms, detect(image))


MAX_ATOMS = 7  # a relational prompt's: exist, colour and count of each phrase, and the relation
_ATOM_CACHE: dict[tuple, dict[str, float]] = {}
_ATOM_CACHE_SIZE = 4096


def cached_score_image(image, prompt: str) -> dict[str, float]:
    """`score_image`, remembered by (image content, prompt): the reward's type atoms and CAST's
    per-atom advantages (method.atoms: nodes) then share one detection per image."""
    image_key = _image_key(image)
    if image_key is None:
        return score_image(image, prompt)
    key = (image_key, prompt)
    if key not in _ATOM_CACHE:
        atoms = parse_prompt(prompt)  # the prompt is checked before the image is looked at
        _remember(_ATOM_CACHE, key, evaluate_atoms(atoms, cached_detect(image)))
    return _ATOM_CACHE[key]


_OBJECT_CACHE: dict[tuple, list[Object]] = {}


def cached_detect(image) -> list[Object]:
    """`detect`, remembered by image content (the verdicts and CAST's detector maps share it)."""
    key = _image_key(image)
    if key is None:
        return detect(image)
    if key not in _OBJECT_CACHE:
        _remember(_OBJECT_CACHE, key, detect(image))
    return _OBJECT_CACHE[key]


def _remember(cache: dict, key, value) -> None:
    while len(cache) >= _ATOM_CACHE_SIZE:  # oldest first
        del cache[next(iter(cache))]
    cache[key] = value


def atom_regions(image, prompt: str) -> dict[str, np.ndarray | None]:
    """{atom name (parse order): [H, W] bool mask of the boxes of the detected objects the atom
    is about, or None when there is no place to point at}. exist[s]: the objects of shape s;
    colour[c s]: the objects of shape s, of any colour (a wrong colour shows there); the
    relation: the objects of either phrase's shape; count[c s]=n: the objects of kind c s when
    there are n of them, else None (a missing instance has no place, and an extra one is not
    told apart from the rest). CAST's detector maps (method.projection: detector) are these,
    pooled onto the latent token grid; None gives a uniform map."""
    atoms = parse_prompt(prompt)
    objects = cached_detect(image)
    verdicts = cached_score_image(image, prompt)  # the reward's, from the same detection
    w, h = to_rgb(image).size
    out: dict[str, np.ndarray | None] = {}
    for atom in atoms:
        if atom.kind == "count":
            if verdicts[atom.name] < 0.5:
                out[atom.name] = None
                continue
            about = [o for o in objects if o.kind == atom.objects[0].kind]
        else:
            shapes = {o.shape for o in atom.objects}
            about = [o for o in objects if o.shape in shapes]
        mask = np.zeros((h, w), dtype=bool)
        for obj in about:
            x0, y0, x1, y1 = obj.bbox
            mask[y0:y1, x0:x1] = True
        out[atom.name] = mask if mask.any() else None
    return out


# ============================================================================ rewards and metrics


def _type_means(atoms: Sequence[Atom], scores: Mapping[str, float]) -> dict[str, float]:
    """Mean score per atom type, 1.0 for a type the prompt does not have; "all" too."""
    out = {}
    for kind in ATOM_TYPES:
        vals = [scores[a.name] for a in atoms if a.kind == kind]
        out[kind] = sum(vals) / len(vals) if vals else 1.0
    out["all"] = float(all(v >= 0.5 for v in scores.values()))
    return out


def _image_key(image) -> tuple | None:
    """A content key for an image (mode, size and a hash of the pixels), None for other
    objects. Content, not identity: a buffer reused for the next batch is not stale."""
    if isinstance(image, Image.Image):
        meta, data = (image.mode, image.size), image.tobytes()
    elif isinstance(image, np.ndarray):
        meta, data = (image.dtype.str, image.shape), np.ascontiguousarray(image).tobytes()
    else:
        return None
    return meta, hashlib.blake2b(data, digest_size=16).digest()


class _Verdicts:
    """Per-type scores of (image, prompt) pairs for the type atoms of one Reward (each atom
    sees the same samples); the detection is done once per image content and prompt
    (`cached_score_image`)."""

    def __init__(self, unparsed: str = "error"):
        self.unparsed = unparsed

    def __call__(self, samples: Sequence) -> list[dict[str, float]]:
        out = []
        for i, s in enumerate(samples):
            try:
                if self.unparsed == "zero" and not can_parse(s.prompt):
                    out.append(dict.fromkeys((*ATOM_TYPES, "all"), 0.0))  # no verdict: 0, no detection
                    continue
                out.append(_type_means(parse_prompt(s.prompt), cached_score_image(s.completion, s.prompt)))
            except (TypeError, ValueError) as e:
                raise type(e)(f"sample {i} of the batch (prompt {s.prompt!r}): {e}") from e
        return out


def can_parse(prompt) -> bool:
    """Whether parse_prompt accepts `prompt` (a string the grammar decomposes into atoms).
    TypeError for a non-string."""
    try:
        parse_prompt(prompt)
    except ValueError:
        return False
    return True


def reward_atoms(weights: Mapping[str, float] | None = None, *, unparsed: str = "error") -> list[RewardAtom]:
    """The batched reward atoms "exist", "colour" (parent "exist"), "count" (parent
    "colour"), "relation" and "all" (parents: the four). Each scores a Sample whose
    prompt is the prompt text and whose completion is the generated image. weights:
    {atom: weight}, default 1.0 each. The atoms of one call share a detection cache.
    unparsed: a prompt the grammar cannot parse raises ("error", naming the unparsed
    words) or scores 0 on every atom ("zero")."""
    weights = dict(weights or {})
    names = (*ATOM_TYPES, "all")
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ValueError(f"unknown shapes-geneval reward atoms {unknown} (known: {list(names)})")
    if unparsed not in ("error", "zero"):
        raise ValueError(f"unparsed must be 'error' or 'zero', got {unparsed!r}")
    verdicts = _Verdicts(unparsed=unparsed)
    parents = {"colour": ("exist",), "count": ("colour",), "all": ATOM_TYPES}

    def make(name: str) -> RewardAtom:
        def fn(samples):
            return [v[name] for v in verdicts(samples)]

        fn.__name__ = f"shapes_geneval_{name}"
        return reward_atom(
            name, weight=weights.get(name, 1.0), parents=parents.get(name, ()), batched=True
        )(fn)

    return [make(name) for name in names]


def shapes_geneval_reward(weights: Mapping[str, float] | None = None, **kwargs) -> Reward:
    """A core Reward of `reward_atoms(weights)`; kwargs (on_error, timeout) go to Reward."""
    return Reward(reward_atoms(weights), **kwargs)


def atom_accuracy(images: Sequence, prompts: Sequence[str]) -> dict[str, float]:
    """Evaluation metrics of generated images against their prompts: per atom type the
    fraction of that type's atoms that pass (over all prompts; nan if no prompt has
    one), "atoms" the fraction of all atoms, "all" the fraction of prompts with every
    atom passing, and "num_images"."""
    images, prompts = list(images), list(prompts)
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
    if not images:
        raise ValueError("atom_accuracy needs at least one image")
    passed = dict.fromkeys(ATOM_TYPES, 0.0)
    total = dict.fromkeys(ATOM_TYPES, 0)
    whole = 0
    for image, prompt in zip(images, prompts):
        atoms = parse_prompt(prompt)
        # cached: evaluation scores its hard/ split's images a second time (a third of its detections)
        scores = evaluate_atoms(atoms, cached_detect(image))
        for a in atoms:
            passed[a.kind] += scores[a.name]
            total[a.kind] += 1
        whole += all(v >= 0.5 for v in scores.values())
    out = {k: passed[k] / total[k] if total[k] else float("nan") for k in ATOM_TYPES}
    out["atoms"] = sum(passed.values()) / sum(total.values())
    out["all"] = whole / len(images)
    out["num_images"] = float(len(images))
    return out
