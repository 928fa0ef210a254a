"""shapes-geneval: compositional text-to-image prompts and a programmatic verifier.

The diffusion backend's synthetic benchmark, in the spirit of GenEval: a prompt
asks for coloured shapes, possibly in a spatial relation; a detector finds the
shapes in the generated image; every *atom* of the prompt is checked on its own.

The benchmark lives in four sibling modules, one responsibility each; this module holds
the rewards and the evaluation metrics, and re-exports every public name of the four (tests,
CAST, the benchmarks, scripts and users' code import them from here):

- shapes_prompts: the vocabulary (COLOURS, SHAPES, RELATIONS), the prompt grammar
  (`parse_prompt`, `parse_objects`, `format_prompt`), the atoms of a prompt (CAST's causal
  scene graph) and the seeded prompt sampler (`sample_prompts`, `split_of`);
- shapes_scenes: random scenes that satisfy a prompt (`make_scene`) and their rendering
  (`render`: a random scene that satisfies the prompt, solid shapes on white, anti-aliased
  by supersampling), the training images;
- shapes_detector: the detector (`detect`, numpy only) that finds the solid
  palette-coloured shapes of an image, and its known limits;
- shapes_verifier: what each atom checks on the detected objects (`evaluate_atoms`,
  `score_image`, `relation_holds`), with causal gating, and the detections remembered by
  image content (`cached_detect`, `cached_score_image`, `atom_regions`).

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

from collections.abc import Mapping, Sequence

# Re-exported: every public name of the four modules stays importable from here, and so do
# _normalise and _classify, which tests and comments name by this module. A test that
# monkeypatches a function or cache must patch the module that calls it (shapes_verifier's
# detect, _OBJECT_CACHE, _ATOM_CACHE), not this one; score_image is looked up here by callers
# that import it at call time (diffusion_rl.calibrate).
from diffusion_rl.tasks.shapes_detector import (  # noqa: F401
    BACKGROUND_MIN_FILL,
    CHROMA_FRAC,
    CORE_DIV,
    CORE_FRAC,
    HUE_GAP_FRAC,
    HUE_TOL,
    HUE_TOL_LOOSE,
    MAX_ASPECT,
    MIN_AREA_FRAC,
    MIN_AREA_PX,
    MIN_CHROMA,
    MIN_SOLIDITY,
    MIN_VALUE,
    SPLIT_H,
    SPLIT_MIN_H,
    SPLIT_RES,
    SQUARE_MIN_SCORE,
    STRICT_FRAC,
    TRIANGLE_MAX_FILL,
    TRIANGLE_MIN_SCORE,
    Object,
    _classify,
    classify_pixels,
    detect,
    to_rgb,
)
from diffusion_rl.tasks.shapes_prompts import (  # noqa: F401
    ATOM_TYPES,
    BACKGROUND,
    COLOURS,
    COUNT_WORDS,
    EVAL_FRACTION,
    IMAGE_SIZE,
    MAX_ATOMS,
    MAX_COUNT,
    RELATIONS,
    SHAPES,
    Atom,
    ObjectSpec,
    _normalise,
    can_parse,
    format_prompt,
    json_hint,
    parse_objects,
    parse_prompt,
    prompt_key,
    sample_prompts,
    shorten,
    split_of,
)
from diffusion_rl.tasks.shapes_scenes import (  # noqa: F401
    EDGE_FRAC,
    GAP_FRAC,
    MIN_SHAPE_FRAC,
    SHAPE_SIZE_FRAC,
    SUPERSAMPLE,
    Scene,
    Shape,
    make_scene,
    render,
)
from diffusion_rl.tasks.shapes_verifier import (  # noqa: F401
    RELATION_DOMINANCE,
    RELATION_MARGIN,
    atom_regions,
    cached_detect,
    cached_score_image,
    evaluate_atoms,
    relation_holds,
    score_image,
)
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


def _type_means(atoms: Sequence[Atom], scores: Mapping[str, float]) -> dict[str, float]:
    """Mean score per atom type, 1.0 for a type the prompt does not have; "all" too."""
    out = {}
    for kind in ATOM_TYPES:
        vals = [scores[a.name] for a in atoms if a.kind == kind]
        out[kind] = sum(vals) / len(vals) if vals else 1.0
    out["all"] = float(all(v >= 0.5 for v in scores.values()))
    return out


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
