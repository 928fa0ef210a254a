"""shapes-geneval verifier: the atoms of a prompt scored on the objects `detect` finds in an
image, with causal gating (`evaluate_atoms`, `score_image`), the detections and verdicts
remembered by image content (`cached_detect`, `cached_score_image`), and the image regions
of the atoms (`atom_regions`, CAST's detector maps).

Part of diffusion_rl.tasks.shapes_geneval (which re-exports every public name here).

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
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
from PIL import Image

from diffusion_rl.tasks.shapes_detector import Object, detect, to_rgb
from diffusion_rl.tasks.shapes_prompts import ATOM_TYPES, RELATIONS, Atom, parse_prompt

# ---- relations
RELATION_MARGIN = 0.5  # along-axis centre distance >= this x the mean extent along the axis
RELATION_DOMINANCE = 0.5  # along-axis distance >= this x the cross-axis offset (~63 degrees)


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
