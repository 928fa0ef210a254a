"""shapes-geneval scenes: random layouts that satisfy a prompt (`make_scene`) and their
rendering (`render`: solid shapes on white, anti-aliased by supersampling), the training
images of the benchmark and the references of its tests.

Part of diffusion_rl.tasks.shapes_geneval (which re-exports every public name here).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

from diffusion_rl.tasks.shapes_prompts import (
    BACKGROUND,
    COLOURS,
    IMAGE_SIZE,
    SHAPES,
    _normalise,
    parse_objects,
)
from diffusion_rl.tasks.shapes_verifier import relation_holds

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
