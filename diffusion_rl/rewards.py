"""Image reward atoms for the flow / diffusion backend: CLIP score and preference models.

Every atom here is a batched `mmrl.core.rewards.RewardAtom` that scores `Sample`s whose
`prompt` is the text prompt and whose `completion` is a PIL image. Models load from local
paths only (nothing here downloads), lazily on the first call, once per process: the loaded
model is cached by (source, device, precision) and shared by every atom that names it; loading
is thread-safe, scoring runs in eval mode without gradients.

    atoms = [
        clip_score_atom("ViT-H-14", "/models/open_clip_vit_h14.safetensors", weight=0.5),
        preference_atom("/models/PickScore_v1", kind="clip", processor="/models/clip-vit-h14"),
        preference_atom("my_rewards.py:load_image_reward", kind="custom"),
    ]
    scores = Reward(atoms).score([Sample(prompt, image) for prompt, image in pairs])

Score definitions (cos = cosine similarity of the image and prompt embeddings):

- `clip_score_atom`: `scale * cos`, or `scale * max(cos, 0)` with `clamp=True`. The default
  (scale=1, no clamp) is the raw cosine, in [-1, 1]. `scale=100, clamp=True` is torchmetrics'
  CLIPScore, `scale=2.5, clamp=True` the CLIP-S of Hessel et al. (2021), and `scale=1,
  clamp=True` "CLIP score / 100", in [0, 1]. An HPS v2 checkpoint (an open_clip ViT-H-14
  fine-tune saved as {"state_dict": ...}) loads here too; HPS v2 reports the plain cosine.
- `preference_atom(kind="clip")`: `s * cos` with `s = logit_scale.exp()` of the model, as
  PickScore computes its score (`model.logit_scale.exp() * text_embs @ image_embs.T`), or
  `s = scale` when one is given (`scale=1.0`: the raw cosine, in [-1, 1]).
- `preference_atom(kind="custom")`: whatever the user's scorer returns, one number per image.

Inputs: a completion must be a PIL image. Other modes are converted to RGB: modes with an alpha
channel (or a transparency key) are composited over white, as transformers' `convert_to_rgb`
does; 16-bit greyscale ("I;16*", and "I" with values above 255) is scaled by 255/65535;
anything else goes through `Image.convert("RGB")`. A completion that is not a PIL image, a
prompt that is not a string, or an image that cannot be converted raises an error naming the
sample's index in the batch the atom was given (the core `Reward` adds the atom's name).
Non-finite scores are returned as they are: the core `Reward` rejects them, naming the atom
and the sample.

`build_tiny_open_clip` and `build_tiny_hf_clip` write tiny random models of the real classes
(offline, from a seed) for tests and smoke runs.

Files: this one reads the config specs (`build_image_reward_atoms`); each kind of atom is in
diffusion_rl/image_rewards/ (clip_score.py, preference.py; the model cache, `to_rgb` and the
argument checks in common.py; the tiny models in tiny_clip.py). This module re-exports them all:
import them from here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Every name of the files this module was split into stays importable from here.
from diffusion_rl.image_rewards.clip_score import (  # noqa: F401 (re-exported)
    _OPEN_CLIP_REGISTRY_LOCK,
    _open_clip_dir,
    _open_clip_source,
    _OpenClipScorer,
    _OpenClipSource,
    _registered,
    _split_open_clip_config,
    _with_weights,
    clip_score_atom,
)
from diffusion_rl.image_rewards.common import (  # noqa: F401 (re-exported)
    _ALPHA_MODES,
    _CACHE,
    _CACHE_LOCK,
    _KEY_LOCKS,
    _SIXTEEN_BIT_MODES,
    OPEN_CLIP_PRECISIONS,
    _a,
    _cached,
    _check_batch_size,
    _check_clamp,
    _check_device,
    _check_precision,
    _check_scale,
    _chunks,
    _cosine,
    _describe,
    _existing_dir,
    _images_and_prompts,
    _resolve,
    _short,
    _unique,
    clear_model_cache,
    to_rgb,
)
from diffusion_rl.image_rewards.preference import (  # noqa: F401 (re-exported)
    PREFERENCE_KINDS,
    _CustomScorer,
    _features,
    _HFClipScorer,
    _is_number,
    _load_factory,
    preference_atom,
)
from diffusion_rl.image_rewards.tiny_clip import (  # noqa: F401 (re-exported)
    _CLIP_PRETOKENIZE,
    _tiny_corpus,
    build_tiny_hf_clip,
    build_tiny_open_clip,
)
from mmrl.core.rewards import RewardAtom

__all__ = [
    "PREFERENCE_KINDS",
    "SPEC_TYPES",
    "build_image_reward_atoms",
    "build_tiny_hf_clip",
    "build_tiny_open_clip",
    "clear_model_cache",
    "clip_score_atom",
    "preference_atom",
    "to_rgb",
]

SPEC_TYPES = ("clip_score", "preference")

# ---------------------------------------------------------------------------- config specs

_COMMON_KEYS = ("type", "name", "weight", "parents", "device", "batch_size", "scale")
_SPEC_KEYS = {
    "clip_score": _COMMON_KEYS + ("model", "pretrained", "clamp", "precision"),
    "preference": _COMMON_KEYS + ("path", "kind", "processor", "dtype"),
}
_DEFAULT_NAMES = {"clip_score": "clip_score", "preference": "preference"}


def build_image_reward_atoms(
    specs: Sequence[Mapping], base_dir: str | os.PathLike | None = None
) -> list[RewardAtom]:
    """Atoms from config specs, one dict each:

        {"type": "clip_score", "model": "ViT-H-14" | "cfg.json" | "local-dir:DIR",
         "pretrained": FILE_OR_DIR, "scale": 1.0, "clamp": false, "precision": "fp32"}
        {"type": "preference", "path": DIR | "file.py:factory", "kind": "clip" | "custom",
         "processor": DIR, "scale": null, "dtype": null}

    plus, for both, the optional "name", "weight", "parents", "device", "batch_size".
    Relative paths resolve against base_dir (default: the current directory). A bad spec
    (not a dict, unknown type or key, missing key, missing file, duplicate name) raises
    ValueError naming the spec's index and the key.
    """
    if isinstance(specs, (str, Mapping)) or not isinstance(specs, Sequence):
        raise ValueError(f"image reward specs must be a list of dicts, got {type(specs).__name__}")  # noqa: TRY004
    atoms: list[RewardAtom] = []
    names: dict[str, int] = {}
    for i, spec in enumerate(specs):
        if not isinstance(spec, Mapping):
            raise ValueError(f"image reward spec {i}: expected a dict, got {spec!r}")  # noqa: TRY004
        kind = spec.get("type")
        if kind not in SPEC_TYPES:
            raise ValueError(
                f"image reward spec {i}: key 'type': unknown type {kind!r} "
                f"(known: {', '.join(SPEC_TYPES)})"
            )
        unknown = sorted(set(spec) - set(_SPEC_KEYS[kind]))
        if unknown:
            raise ValueError(
                f"image reward spec {i} ({kind}): unknown key {unknown[0]!r} "
                f"(allowed: {', '.join(_SPEC_KEYS[kind])})"
            )
        name = spec.get("name", _DEFAULT_NAMES[kind])
        if name in names:
            raise ValueError(
                f"image reward spec {i} ({kind}): key 'name': atom name {name!r} is already used "
                f"by spec {names[name]}; give this one another 'name'"
            )
        names[name] = i
        if kind == "preference" and spec.get("kind", "clip") not in PREFERENCE_KINDS:
            raise ValueError(
                f"image reward spec {i} (preference): key 'kind': unknown kind "
                f"{spec['kind']!r} (known: {', '.join(PREFERENCE_KINDS)})"
            )
        common = {
            k: spec[k] for k in ("weight", "parents", "device", "batch_size", "scale") if k in spec
        }
        try:
            if kind == "clip_score":
                model, pretrained = _clip_spec_paths(spec, i, base_dir)
                extra = {k: spec[k] for k in ("clamp", "precision") if k in spec}
                atom = clip_score_atom(model, pretrained, name=name, **common, **extra)
            else:
                path, processor = _preference_spec_paths(spec, i, base_dir)
                extra = {k: spec[k] for k in ("kind", "dtype") if k in spec}
                atom = preference_atom(
                    path, name=name, processor=processor, base_dir=base_dir, **common, **extra
                )
        except _SpecError:
            raise
        except (ValueError, TypeError) as e:
            raise ValueError(f"image reward spec {i} ({kind}): {e}") from e
        atoms.append(atom)
    return atoms


class _SpecError(ValueError):
    pass


def _spec_path(spec, i: int, key: str, base_dir, what: str) -> Path:
    """spec[key] resolved against base_dir; must exist (what: "file", "dir" or "any")."""
    kind = spec["type"]
    value = spec[key]
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise _SpecError(
            f"image reward spec {i} ({kind}): key {key!r}: expected a path, got {value!r}"
        )
    path = _resolve(value, base_dir)
    ok = {"file": path.is_file, "dir": path.is_dir, "any": path.exists}[what]()
    if not ok:
        noun = {"file": "file", "dir": "directory", "any": "file or directory"}[what]
        raise _SpecError(f"image reward spec {i} ({kind}): key {key!r}: {noun} not found: {path}")
    return path


def _clip_spec_paths(spec, i: int, base_dir) -> tuple[Any, Any]:
    if "model" not in spec:
        raise _SpecError(f"image reward spec {i} (clip_score): missing key 'model'")
    model = spec["model"]
    if isinstance(model, str) and model.startswith("local-dir:"):
        directory = _spec_path(
            {**spec, "model": model[len("local-dir:") :]}, i, "model", base_dir, "dir"
        )
        model = f"local-dir:{directory}"
    elif isinstance(model, (str, os.PathLike)) and os.fspath(model).endswith(".json"):
        model = str(_spec_path(spec, i, "model", base_dir, "file"))
    pretrained = spec.get("pretrained")
    if pretrained is not None:
        # open_clip's README writes `pretrained: laion2b_s34b_b79k`, a tag it downloads: say that,
        # rather than that <config dir>/laion2b_s34b_b79k is not found
        missing = isinstance(pretrained, str) and not _resolve(pretrained, base_dir).exists()
        if missing and _open_clip_tag(pretrained):
            raise _SpecError(
                f"image reward spec {i} (clip_score): key 'pretrained': {pretrained!r} is an open_clip "
                "tag, which downloads, and nothing downloads here: give a local weights file or "
                "open_clip model directory (fetched beforehand, e.g. with huggingface-cli download)"
            )
        pretrained = str(_spec_path(spec, i, "pretrained", base_dir, "any"))
    elif not (isinstance(model, str) and model.startswith("local-dir:")):
        raise _SpecError(f"image reward spec {i} (clip_score): missing key 'pretrained'")
    return model, pretrained


def _open_clip_tag(name: str) -> bool:
    """Whether `name` is one of open_clip's pretrained tags ("openai", "laion2b_s34b_b79k")."""
    import open_clip

    return any(name == tag for _, tag in open_clip.list_pretrained())


def _preference_spec_paths(spec, i: int, base_dir) -> tuple[Any, Any]:
    if "path" not in spec:
        raise _SpecError(f"image reward spec {i} (preference): missing key 'path'")
    kind = spec.get("kind", "clip")
    path = spec["path"]
    if kind == "custom":
        if not isinstance(path, str) or ":" not in path:
            raise _SpecError(
                f"image reward spec {i} (preference): key 'path': expected "
                f'"path/to/file.py:factory" for kind "custom", got {path!r}'
            )
        file_part, attr = path.rsplit(":", 1)
        file = _spec_path({**spec, "path": file_part}, i, "path", base_dir, "file")
        path = f"{file}:{attr}"
    elif kind == "clip":
        path = str(_spec_path(spec, i, "path", base_dir, "dir"))
    processor = spec.get("processor")
    if processor is not None:
        processor = str(_spec_path(spec, i, "processor", base_dir, "dir"))
    return path, processor


# ---------------------------------------------------------------------------- tiny models
