"""shapes-zoom: shapes-qa questions whose answer needs the zoom tool.

A full-resolution square image (`image_size`, default 448 px) is split into four
quadrants (QUADRANTS: "top left", "top right", "bottom left", "bottom right"); each
holds exactly one solid shape (scenes.py's shapes and colours; box side ~ U{shape_size},
on integer pixels, at least 4 px inside its quadrant). The VLM sees the whole image
downscaled to ~112 px; the zoom tool (mmrl/vlm/tools.py) on a quadrant's box returns its
224-px crop, seen at 112 px too: twice the scale, one shape filling most of the view.

The defaults (colour questions, shapes of 150-200 px) are set by what the bundled tiny
VLM can and cannot read, as measured (benchmarks/RESULTS.md): it reads the colour of a
view-filling shape, but not which of four shapes sits in the asked quadrant at 112 px
(sampled accuracy 0.60 with the zoom vs 0.26 without, chance 0.25). A stronger model
needs smaller shapes (e.g. shape_size (48, 64) and shape_at questions) to need the tool.

Question kinds (KINDS):
    shape_at   "What shape is in the top left?"                -> circle / square / triangle
    colour_at  "What colour is the shape in the bottom right?" -> a colour

Items are shapes-qa `QAItem`s: images = [the full-resolution image]; reference = the
no-tool SFT target "a {colour} {shape} <answer>{answer}</answer>" (the asked shape);
meta = {"kind", "params": {"quadrant"}, "scene", "answer", "zoom_box"}, where zoom_box
is the asked quadrant [x0, y0, x1, y1] in full-resolution pixels, so that
`zoom_call(meta["zoom_box"])` is the tool call a tool-using SFT target would make.

Rewards: the shapes-qa atoms, format (0.1) and answer (1.0, gated by format);
`shapes_zoom_reward()` bundles them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence

from mmrl.core.rewards import Reward
from mmrl.vlm.tasks.scenes import COLOURS, SHAPES, Scene, Shape, render
from mmrl.vlm.tasks.shapes_qa import QAItem, answer_atom, format_atom, held_out, kind_list

__all__ = [
    "KINDS",
    "QUADRANTS",
    "ShapesZoom",
    "generate_zoom_items",
    "quadrant_box",
    "shape_in",
    "shapes_zoom_reward",
    "zoom_call",
]

# name -> (column, row), each 0 or 1
QUADRANTS: dict[str, tuple[int, int]] = {
    "top left": (0, 0),
    "top right": (1, 0),
    "bottom left": (0, 1),
    "bottom right": (1, 1),
}
MARGIN = 4  # pixels kept free between a shape's box and its quadrant's edges


def quadrant_box(name: str, image_size: int) -> tuple[int, int, int, int]:
    """(x0, y0, x1, y1) of quadrant `name` in an image_size x image_size image, right and
    bottom exclusive. The split is at image_size // 2 (for an odd size the right and
    bottom quadrants are one pixel wider)."""
    if name not in QUADRANTS:
        raise ValueError(f"unknown quadrant {name!r} (known: {', '.join(QUADRANTS)})")
    col, row = QUADRANTS[name]
    half = image_size // 2
    xs, ys = ((0, half), (half, image_size))[col], ((0, half), (half, image_size))[row]
    return xs[0], ys[0], xs[1], ys[1]


def zoom_call(box) -> str:
    """The tool call that zooms into `box` (x0, y0, x1, y1), in Qwen's syntax:
    '<tool_call>\\n{"name": "zoom", "arguments": {"x0": 0, ...}}\\n</tool_call>'."""
    x0, y0, x1, y1 = (int(v) for v in box)
    call = {"name": "zoom", "arguments": {"x0": x0, "y0": y0, "x1": x1, "y1": y1}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def shape_in(scene: Scene, quadrant: str) -> Shape:
    """The one shape whose centre lies in `quadrant`; ValueError if not exactly one."""
    x0, y0, x1, y1 = quadrant_box(quadrant, scene.size)
    found = [s for s in scene.shapes if x0 <= s.x < x1 and y0 <= s.y < y1]
    if len(found) != 1:
        raise ValueError(f"the {quadrant} quadrant holds {len(found)} shapes, expected 1")
    return found[0]


# ---------------------------------------------------------------------------- question kinds
# Each kind: (scene, quadrant) -> (question, answer).


def shape_at(scene: Scene, quadrant: str) -> tuple[str, str]:
    return f"What shape is in the {quadrant}?", shape_in(scene, quadrant).shape


def colour_at(scene: Scene, quadrant: str) -> tuple[str, str]:
    return f"What colour is the shape in the {quadrant}?", shape_in(scene, quadrant).colour


KINDS: dict[str, Callable[[Scene, str], tuple[str, str]]] = {
    "shape_at": shape_at,
    "colour_at": colour_at,
}
DEFAULT_KINDS = ("colour_at",)


# ---------------------------------------------------------------------------- generation


def _check(image_size, shape_size, kinds) -> tuple[int, tuple[int, int], list[str]]:
    """Validated (image_size, shape_size, kinds)."""
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
        raise ValueError(f"image_size must be a positive integer, got {image_size!r}")
    try:
        lo, hi = shape_size
    except (TypeError, ValueError):
        raise ValueError(f"shape_size must be (lo, hi), got {shape_size!r}") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) or not (
        1 <= lo <= hi
    ):
        raise ValueError(
            f"shape_size must be (lo, hi) integers with 1 <= lo <= hi, got {shape_size!r}"
        )
    half = image_size // 2
    if half < hi + 2 * MARGIN:
        raise ValueError(
            f"image_size {image_size} is too small for shapes of up to {hi} px: each quadrant "
            f"({half} px) must be at least {hi + 2 * MARGIN} px (the shape plus a {MARGIN} px "
            "margin on each side)"
        )
    return image_size, (lo, hi), kind_list(kinds, KINDS, DEFAULT_KINDS)


def _random_scene(rng: random.Random, image_size: int, shape_size: tuple[int, int]) -> Scene:
    """One shape of random kind, colour and size per quadrant, in QUADRANTS order."""
    lo, hi = shape_size
    shapes = []
    for quadrant in QUADRANTS:
        x0, y0, x1, y1 = quadrant_box(quadrant, image_size)
        kind, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        s = rng.randint(lo, hi)
        left = rng.randint(x0 + MARGIN, x1 - MARGIN - s)
        top = rng.randint(y0 + MARGIN, y1 - MARGIN - s)
        shapes.append(Shape(kind, colour, left + s / 2, top + s / 2, float(s)))
    return Scene(shapes, image_size)


def _item_specs(n: int, seed: int, split: str, image_size: int, shape_size, kinds):
    """(scene, kind, quadrant) for items 0..n-1 of a stream, unrendered. Item i depends
    only on (split, seed, i) and the settings."""
    for i in range(n):
        rng = random.Random(f"shapes-zoom/{split}/{seed}/{i}")  # str seeds hash with sha512
        kind = rng.choice(kinds)
        scene = _random_scene(rng, image_size, shape_size)
        quadrant = rng.choice(list(QUADRANTS))
        yield scene, kind, quadrant


def _make_item(scene: Scene, kind: str, quadrant: str) -> QAItem:
    question, answer = KINDS[kind](scene, quadrant)
    target = shape_in(scene, quadrant)
    return QAItem(
        images=[render(scene)],
        question=question,
        answer=answer,
        reference=f"a {target.colour} {target.shape} <answer>{answer}</answer>",
        meta={
            "kind": kind,
            "params": {"quadrant": quadrant},
            "scene": scene.to_dict(),
            "answer": answer,
            "zoom_box": list(quadrant_box(quadrant, scene.size)),
        },
    )


def _key(scene: Scene, kind: str, quadrant: str) -> tuple:
    question, _ = KINDS[kind](scene, quadrant)
    return question, tuple((s.shape, s.colour, s.x, s.y, s.size) for s in scene.shapes)


def generate_zoom_items(
    n: int,
    seed: int,
    *,
    image_size: int = 448,
    shape_size: tuple[int, int] = (150, 200),
    kinds: Sequence[str] | None = None,
    split: str = "train",
) -> list[QAItem]:
    """n items, deterministic given the arguments; item i depends only on
    (split, seed, i), so a longer list extends a shorter one. Each item picks its kind
    uniformly from `kinds` (default ["colour_at"]) and its quadrant uniformly.
    shape_size: (min, max) box side in full-resolution pixels."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    image_size, shape_size, kinds = _check(image_size, shape_size, kinds)
    specs = _item_specs(n, seed, split, image_size, shape_size, kinds)
    return [_make_item(*spec) for spec in specs]


class ShapesZoom:
    """The shapes-zoom task: a training set and a held-out evaluation set.

    The eval items come from the "eval" seed stream, and any eval item identical to a
    train item (same question, same scene) is skipped. Both lists are generated on first
    use and cached. `tools` names the tools the task is meant to be rolled out with.
    """

    name = "shapes-zoom"
    tools = ("zoom",)

    def __init__(
        self,
        *,
        seed: int = 0,
        num_train: int = 2000,
        num_eval: int = 200,
        image_size: int = 448,
        shape_size: tuple[int, int] = (150, 200),
        kinds: Sequence[str] | None = None,
    ):
        if num_train < 0 or num_eval < 0:
            raise ValueError(f"num_train and num_eval must be >= 0, got {num_train}, {num_eval}")
        self.seed = seed
        self.num_train = num_train
        self.num_eval = num_eval
        self.image_size, self.shape_size, self.kinds = _check(image_size, shape_size, kinds)
        self._train: list[QAItem] | None = None
        self._eval: list[QAItem] | None = None

    def _specs(self, n: int, split: str):
        return _item_specs(n, self.seed, split, self.image_size, self.shape_size, self.kinds)

    def train_items(self) -> list[QAItem]:
        if self._train is None:
            self._train = [_make_item(*spec) for spec in self._specs(self.num_train, "train")]
        return self._train

    def eval_items(self) -> list[QAItem]:
        if self._eval is None:  # collisions are rare: the stream is ample
            self._eval = held_out(self._specs(self.num_train, "train"),
                                  self._specs(10 * self.num_eval + 1000, "eval"), _key, _make_item, self.num_eval)
        return self._eval

    def __repr__(self) -> str:
        return (
            f"ShapesZoom(seed={self.seed}, num_train={self.num_train}, "
            f"num_eval={self.num_eval}, image_size={self.image_size}, "
            f"shape_size={self.shape_size}, kinds={self.kinds})"
        )


def shapes_zoom_reward(**kwargs) -> Reward:
    """Reward([format (weight 0.1), answer (weight 1.0, gated by format)]), the
    shapes-qa atoms; keyword arguments (on_error, timeout) go to Reward."""
    return Reward([format_atom, answer_atom], **kwargs)
