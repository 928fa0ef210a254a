"""Seeded scenes of solid coloured shapes: generation, rendering, description.

Modality-agnostic: the shapes-qa task (VLM) renders scenes and asks about them;
a text-to-image benchmark can reuse the same scenes, colours and vocabulary.

A scene is a few large, solid shapes (circle, square, triangle pointing up) in
four colours on a white background. Every shape fits in a square box of side
`size` centred on (x, y); boxes lie fully inside the image and never overlap
(they are at least `gap` pixels apart along some axis). Rendering uses
PIL.ImageDraw without anti-aliasing, so every pixel is either white or exactly
one of the COLOURS.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

from PIL import Image, ImageDraw

__all__ = [
    "COLOURS",
    "SHAPES",
    "Scene",
    "Shape",
    "describe",
    "is_above",
    "is_left_of",
    "random_scene",
    "render",
]

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
BACKGROUND = (255, 255, 255)

# A relation along an axis holds only if |centre distance| >= RELATION_MARGIN * the larger size.
RELATION_MARGIN = 0.5
_EDGE = 2  # pixels kept free between a shape's box and the image border
_GAP = 4  # pixels kept free between the boxes of two shapes (along at least one axis)
_PLACE_TRIES = 50  # tries to place one shape before the scene keeps fewer shapes
_SCENE_TRIES = 100  # tries to reach min_shapes before giving up


@dataclass
class Shape:
    """One solid shape. (x, y) is the centre of its box, `size` the box side
    (the circle's diameter, the square's side, the triangle's base and height), in pixels."""

    shape: str  # one of SHAPES
    colour: str  # a key of COLOURS
    x: float
    y: float
    size: float

    def box(self) -> tuple[float, float, float, float]:
        """(left, top, right, bottom) of the shape's box; right/bottom exclusive."""
        h = self.size / 2
        return (self.x - h, self.y - h, self.x + h, self.y + h)


@dataclass
class Scene:
    shapes: list[Shape] = field(default_factory=list)
    size: int = 112  # the image is size x size pixels

    def to_dict(self) -> dict:
        """Plain dicts and numbers (JSON-serialisable)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Scene:
        return cls(shapes=[Shape(**s) for s in d["shapes"]], size=int(d["size"]))


def check_ranges(shape_size: tuple[int, int], min_shapes: int = 0, max_shapes: int = 0) -> tuple[int, int]:
    """shape_size's (lo, hi); ValueError unless 1 <= lo <= hi and 0 <= min_shapes <= max_shapes.
    random_scene's check, which the task configs run when they load (mmrl.vlm.config)."""
    lo, hi = shape_size
    if not (1 <= lo <= hi):
        raise ValueError(f"shape_size must be (lo, hi) with 1 <= lo <= hi, got {tuple(shape_size)!r}")
    if not (0 <= min_shapes <= max_shapes):
        raise ValueError(
            f"need 0 <= min_shapes <= max_shapes, got min_shapes={min_shapes}, "
            f"max_shapes={max_shapes}"
        )
    return lo, hi


def random_scene(
    rng: random.Random,
    size: int = 112,
    min_shapes: int = 1,
    max_shapes: int = 4,
    shape_size: tuple[int, int] = (22, 32),
) -> Scene:
    """A random scene: n ~ U{min_shapes..max_shapes} shapes of uniform kind and colour,
    integer box sides ~ U{shape_size}, boxes on integer pixels, fully inside the image
    and not overlapping. A shape that cannot be placed in _PLACE_TRIES tries is dropped
    (the scene has fewer shapes); if that leaves fewer than min_shapes the scene is
    drawn again. Deterministic given the state of `rng`."""
    lo, hi = check_ranges(shape_size, min_shapes, max_shapes)
    if size < hi + 2 * _EDGE:
        raise ValueError(f"image size {size} is too small for shapes of up to {hi} pixels")
    for _ in range(_SCENE_TRIES):
        n = rng.randint(min_shapes, max_shapes)
        shapes: list[Shape] = []
        for _ in range(n):
            kind, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
            for _ in range(_PLACE_TRIES):
                s = rng.randint(lo, hi)
                left = rng.randint(_EDGE, size - _EDGE - s)
                top = rng.randint(_EDGE, size - _EDGE - s)
                new = Shape(kind, colour, left + s / 2, top + s / 2, float(s))
                if all(_apart(new, old) for old in shapes):
                    shapes.append(new)
                    break
        if len(shapes) >= min_shapes:
            return Scene(shapes, size)
    raise ValueError(
        f"could not place {min_shapes} shapes of {lo}-{hi} pixels in a {size}x{size} image"
    )


def _apart(a: Shape, b: Shape) -> bool:
    """Boxes at least _GAP pixels apart along x or along y."""
    ax0, ay0, ax1, ay1 = a.box()
    bx0, by0, bx1, by1 = b.box()
    return ax1 + _GAP <= bx0 or bx1 + _GAP <= ax0 or ay1 + _GAP <= by0 or by1 + _GAP <= ay0


def is_left_of(a: Shape, b: Shape) -> bool | None:
    """True if a is left of b, False if right of it, None if too close along x to say
    (|dx| < RELATION_MARGIN * the larger size)."""
    return _order(a.x, b.x, max(a.size, b.size))


def is_above(a: Shape, b: Shape) -> bool | None:
    """True if a is above b (smaller y), False if below, None if too close along y."""
    return _order(a.y, b.y, max(a.size, b.size))


def _order(pa: float, pb: float, size: float) -> bool | None:
    if abs(pa - pb) < RELATION_MARGIN * size:
        return None
    return pa < pb


def render(scene: Scene) -> Image.Image:
    """The scene as an RGB image: white background, solid shapes, no anti-aliasing.
    A shape of integer box [left, left + size) covers exactly those pixel columns
    (and rows). Deterministic."""
    img = Image.new("RGB", (scene.size, scene.size), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for sh in scene.shapes:
        if sh.colour not in COLOURS:
            raise ValueError(f"unknown colour {sh.colour!r} (known: {', '.join(COLOURS)})")
        fill = COLOURS[sh.colour]
        x0, y0, x1, y1 = sh.box()
        x1, y1 = x1 - 1, y1 - 1  # ImageDraw's boxes include their right/bottom edge
        if sh.shape == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif sh.shape == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        elif sh.shape == "triangle":  # pointing up: apex at the top centre
            draw.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=fill)
        else:
            raise ValueError(f"unknown shape {sh.shape!r} (known: {', '.join(SHAPES)})")
    return img


def describe(scene: Scene) -> str:
    """Canonical short description, objects left to right (ties: top to bottom),
    e.g. "a red circle , a blue square"; "nothing" for an empty scene."""
    ordered = sorted(scene.shapes, key=lambda s: (s.x, s.y))
    return describe_objects([(s.colour, s.shape) for s in ordered])


def describe_objects(objects: list[tuple[str, str]]) -> str:
    """describe() of (colour, shape) pairs in the given order; "nothing" for none
    (mmrl.vlm.consistency.parse_reasoning reads it back)."""
    if not objects:
        return "nothing"
    return " , ".join(f"a {colour} {shape}" for colour, shape in objects)
