"""shapes-geneval detector: the solid palette-coloured shapes of an image (`detect`), numpy only.

Part of diffusion_rl.tasks.shapes_geneval (which re-exports every public name here).

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
"""

from __future__ import annotations

import colorsys
import functools
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from diffusion_rl.tasks.shapes_prompts import BACKGROUND, COLOURS

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
