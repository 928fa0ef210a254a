"""shapes-geneval prompts: the vocabulary, the grammar, the atoms of a prompt and the prompt sampler.

Part of diffusion_rl.tasks.shapes_geneval (which re-exports every public name here).

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

Training data: `sample_prompts` (seeded, item i depends only on (split, seed, i));
`split_of` puts a fixed fifth of all prompts in the held-out split.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass

# The vocabulary and the canvas, shared by the grammar, the renderer and the detector.

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
MAX_ATOMS = 7  # a relational prompt's: exist, colour and count of each phrase, and the relation


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


def can_parse(prompt) -> bool:
    """Whether parse_prompt accepts `prompt` (a string the grammar decomposes into atoms).
    TypeError for a non-string."""
    try:
        parse_prompt(prompt)
    except ValueError:
        return False
    return True
