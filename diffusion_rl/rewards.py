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
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from mmrl.core.rewards import RewardAtom, Sample, import_python_file, module_attribute

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

PREFERENCE_KINDS = ("clip", "custom")
SPEC_TYPES = ("clip_score", "preference")

# ---------------------------------------------------------------------------- model cache

_CACHE: dict[tuple, Any] = {}
_CACHE_LOCK = threading.Lock()  # guards _CACHE and _KEY_LOCKS
_KEY_LOCKS: dict[tuple, threading.Lock] = {}
_OPEN_CLIP_REGISTRY_LOCK = threading.Lock()  # open_clip's config registry is a global


def _cached(key: tuple, load: Callable[[], Any]) -> Any:
    """The value cached under `key`, made by `load()` on first use. Concurrent callers of one
    key wait for a single load; a failed load is not cached (the next call retries)."""
    with _CACHE_LOCK:
        if key in _CACHE:
            return _CACHE[key]
        key_lock = _KEY_LOCKS.setdefault(key, threading.Lock())
    with key_lock:
        with _CACHE_LOCK:
            if key in _CACHE:
                return _CACHE[key]
        value = load()
        with _CACHE_LOCK:
            _CACHE[key] = value
        return value


def clear_model_cache() -> None:
    """Forget every loaded reward model (the next call of an atom loads it again)."""
    with _CACHE_LOCK:
        _CACHE.clear()
        _KEY_LOCKS.clear()


# ---------------------------------------------------------------------------- inputs

_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")


def to_rgb(image: Image.Image) -> Image.Image:
    """`image` as an 8-bit RGB PIL image (see the module docstring for the conversions).
    Raises TypeError for a non-image and ValueError for an image that cannot be converted."""
    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a PIL image, got {_a(type(image).__name__)}")
    if image.width == 0 or image.height == 0:
        raise ValueError(f"the image is empty ({image.width}x{image.height})")
    mode = image.mode
    if mode == "RGB":
        return image
    try:
        if mode in _SIXTEEN_BIT_MODES or mode == "I":
            values = np.asarray(image).astype(np.float64)
            if mode in _SIXTEEN_BIT_MODES or values.max(initial=0) > 255:
                values = values * (255.0 / 65535.0)
            grey = np.clip(np.rint(values), 0, 255).astype(np.uint8)
            return Image.fromarray(grey).convert("RGB")  # 2-D uint8: mode "L"
        if mode in _ALPHA_MODES or "transparency" in image.info:
            rgba = image.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(background, rgba).convert("RGB")
        return image.convert("RGB")
    except (ValueError, OSError) as e:
        raise ValueError(f"cannot convert a {mode!r} image to RGB: {_describe(e)}") from e


def _images_and_prompts(samples: Sequence[Sample]) -> tuple[list[Image.Image], list[str]]:
    """RGB images and prompts of a batch; errors name the sample's index in the batch."""
    images, prompts = [], []
    for i, sample in enumerate(samples):
        if not isinstance(sample, Sample):
            raise TypeError(f"sample {i} of the batch is {_a(type(sample).__name__)}, not a Sample")
        prompt, completion = sample.prompt, sample.completion
        if not isinstance(prompt, str):
            raise TypeError(
                f"sample {i} of the batch: the prompt is {_a(type(prompt).__name__)}, "
                "expected the text prompt (a str)"
            )
        if not isinstance(completion, Image.Image):
            raise TypeError(
                f"sample {i} of the batch (prompt {_short(prompt)}): the completion is "
                f"{_a(type(completion).__name__)}, expected a PIL image"
            )
        try:
            images.append(to_rgb(completion))
        except ValueError as e:
            raise ValueError(f"sample {i} of the batch (prompt {_short(prompt)}): {e}") from e
        prompts.append(prompt)
    return images, prompts


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def _cosine(image_emb: torch.Tensor, text_emb: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine similarity of [B, D] and [B, D], in float32 -> [B]."""
    return (F.normalize(image_emb.float(), dim=-1) * F.normalize(text_emb.float(), dim=-1)).sum(-1)


def _unique(prompts: list[str]) -> tuple[list[str], torch.Tensor]:
    """Distinct prompts (first-seen order) and, per prompt, its index among them: a group of
    samples shares one prompt, which is then encoded once."""
    distinct = list(dict.fromkeys(prompts))
    where = {p: k for k, p in enumerate(distinct)}
    return distinct, torch.tensor([where[p] for p in prompts], dtype=torch.long)


# ---------------------------------------------------------------------------- CLIP score


def clip_score_atom(
    model_name: str | Mapping,
    pretrained: str | os.PathLike | None = None,
    *,
    name: str = "clip_score",
    weight: float = 1.0,
    parents: Sequence[str] | str = (),
    device: str = "cpu",
    batch_size: int = 32,
    scale: float = 1.0,
    clamp: bool = False,
    precision: str = "fp32",
) -> RewardAtom:
    """A batched atom scoring `scale * cos(image, prompt)` (`scale * max(cos, 0)` with
    clamp=True) with an open_clip model; see the module docstring for common settings.

    model_name: the architecture, one of
        - an open_clip built-in name ("ViT-H-14"; `open_clip.list_models()`),
        - a model config: a dict or a path to a JSON file, either the bare model config
          ({"embed_dim", "vision_cfg", "text_cfg"}) or open_clip's open_clip_config.json
          ({"model_cfg": ..., "preprocess_cfg": ...}, whose preprocessing is used),
        - "local-dir:/path": an open_clip model directory (open_clip_config.json + weights).
    pretrained: the weights: a local file (.safetensors, .bin, .pt, .pth; a {"state_dict": ...}
        checkpoint works too), or a local open_clip model directory in the hub layout (then
        its config defines the architecture and model_name only labels it). None only with
        "local-dir:". open_clip's named tags ("laion2b_s32b_b79k") are refused: they download.
    precision: open_clip's precision ("fp32", "fp16", "bf16", "pure_fp16", "pure_bf16").
    The model loads on the first call; `atom.fn.load()` loads it now and returns
    (model, preprocess, tokenizer).
    """
    scorer = _OpenClipScorer(
        _open_clip_source(model_name, pretrained),
        device=_check_device(device),
        batch_size=_check_batch_size(batch_size),
        scale=_check_scale(scale),
        clamp=_check_clamp(clamp),
        precision=_check_precision(precision),
    )
    return RewardAtom(name, scorer, weight=weight, parents=parents, batched=True)


class _OpenClipSource:
    """Where an open_clip model comes from: a directory, or an architecture + a weights file."""

    def __init__(self, *, directory=None, builtin=None, config=None, preprocess=None, weights=None):
        self.directory = directory  # str: a local-dir model
        self.builtin = builtin  # str: a built-in architecture name
        self.config = config  # dict: a custom model config
        self.preprocess = preprocess or {}  # preprocess_cfg of a custom config file
        self.weights = weights  # str: the weights file

    def key(self) -> tuple:
        if self.directory is not None:
            return ("dir", self.directory)
        arch = self.builtin or json.dumps(self.config, sort_keys=True)
        return ("file", arch, json.dumps(self.preprocess, sort_keys=True), self.weights)

    def label(self) -> str:
        if self.directory is not None:
            return f"local-dir:{self.directory}"
        return f"{self.builtin or 'custom config'} + {self.weights}"


def _open_clip_source(model_name, pretrained) -> _OpenClipSource:
    if isinstance(model_name, os.PathLike):
        model_name = os.fspath(model_name)
    if pretrained is not None:
        if not isinstance(pretrained, (str, os.PathLike)) or not os.fspath(pretrained):
            raise ValueError(f"pretrained must be a local path, got {pretrained!r}")
        path = Path(pretrained).expanduser().resolve()
        if path.is_dir():
            return _open_clip_dir(path)
        if not path.is_file():
            raise ValueError(
                f"pretrained {os.fspath(pretrained)!r}: no such file or directory ({path}); "
                "give a local weights file or open_clip model directory (named open_clip "
                "tags would download and are not supported)"
            )
        weights = str(path)
    else:
        weights = None

    if isinstance(model_name, Mapping):
        config, preprocess = _split_open_clip_config(dict(model_name), "the model config")
        return _with_weights(_OpenClipSource(config=config, preprocess=preprocess), weights)
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(
            "model_name must be an open_clip model name, a config (dict or .json path) or "
            f"'local-dir:<path>', got {model_name!r}"
        )
    if model_name.startswith("hf-hub:"):
        raise ValueError(
            f"model_name {model_name!r}: 'hf-hub:' models download; download the repository "
            "yourself and pass its local directory (pretrained=<dir> or 'local-dir:<dir>')"
        )
    if model_name.startswith("local-dir:"):
        if weights is not None:
            raise ValueError(
                f"model_name {model_name!r} is a model directory with its own weights; "
                f"do not also pass pretrained={os.fspath(pretrained)!r}"
            )
        return _open_clip_dir(Path(model_name[len("local-dir:") :]).expanduser().resolve())
    if model_name.endswith(".json"):
        path = Path(model_name).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"model config {model_name!r}: file not found: {path}")
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"model config {path}: cannot read it: {_describe(e)}") from e
        if not isinstance(raw, dict):
            raise ValueError(f"model config {path}: expected a JSON object")
        config, preprocess = _split_open_clip_config(raw, str(path))
        return _with_weights(_OpenClipSource(config=config, preprocess=preprocess), weights)
    import open_clip

    arch = model_name.replace("/", "-")  # as open_clip looks names up
    if arch not in open_clip.list_models():
        raise ValueError(
            f"model_name {model_name!r} is not an open_clip architecture (open_clip."
            "list_models()), a config .json file or 'local-dir:<path>'"
        )
    return _with_weights(_OpenClipSource(builtin=arch), weights)


def _open_clip_dir(path: Path) -> _OpenClipSource:
    if not path.is_dir():
        raise ValueError(f"open_clip model directory not found: {path}")
    if not (path / "open_clip_config.json").is_file():
        raise ValueError(f"open_clip model directory {path} has no open_clip_config.json")
    return _OpenClipSource(directory=str(path))


def _with_weights(source: _OpenClipSource, weights: str | None) -> _OpenClipSource:
    if weights is None:
        raise ValueError(
            "clip_score_atom needs weights: pretrained=<weights file or model directory> "
            "(a randomly initialised CLIP model scores nothing useful)"
        )
    source.weights = weights
    return source


def _split_open_clip_config(raw: dict, where: str) -> tuple[dict, dict]:
    """(model config, preprocess config) of a bare config or an open_clip_config.json."""
    preprocess = {}
    if "model_cfg" in raw:
        preprocess = raw.get("preprocess_cfg") or {}
        raw = raw["model_cfg"]
    missing = [k for k in ("embed_dim", "vision_cfg", "text_cfg") if k not in raw]
    if missing:
        raise ValueError(f"{where}: not an open_clip model config (missing {', '.join(missing)})")
    return raw, dict(preprocess)


class _OpenClipScorer:
    """The function of a clip_score atom: samples -> scale * [clamped] cosine."""

    def __init__(self, source: _OpenClipSource, *, device, batch_size, scale, clamp, precision):
        self.source = source
        self.device = device
        self.batch_size = batch_size
        self.scale = scale
        self.clamp = clamp
        self.precision = precision

    def load(self):
        """(model, preprocess, tokenizer), loaded once per process and shared."""
        key = ("open_clip", *self.source.key(), self.device, self.precision)
        return _cached(key, self._load)

    def _load(self):
        import open_clip

        src = self.source
        try:
            if src.directory is not None:
                name = f"local-dir:{src.directory}"
                model, preprocess = open_clip.create_model_from_pretrained(
                    name, device=self.device, precision=self.precision
                )
                tokenizer = open_clip.get_tokenizer(name)
            else:
                overrides = {
                    "image_mean": src.preprocess.get("mean"),
                    "image_std": src.preprocess.get("std"),
                    "image_interpolation": src.preprocess.get("interpolation"),
                    "image_resize_mode": src.preprocess.get("resize_mode"),
                }
                with _OPEN_CLIP_REGISTRY_LOCK, _registered(src) as name:
                    model, preprocess = open_clip.create_model_from_pretrained(
                        name,
                        pretrained=src.weights,
                        device=self.device,
                        precision=self.precision,
                        **overrides,
                    )
                    tokenizer = open_clip.get_tokenizer(name)
        except Exception as e:
            raise RuntimeError(
                f"loading the open_clip model ({src.label()}) failed: {_describe(e)}"
            ) from e
        model.eval()
        model.requires_grad_(False)
        return model, preprocess, tokenizer

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        images, prompts = _images_and_prompts(samples)
        if not images:
            return []
        model, preprocess, tokenizer = self.load()
        import open_clip

        input_dtype = open_clip.get_input_dtype(self.precision)
        scores = []
        with torch.no_grad():
            for part in _chunks(len(images), self.batch_size):
                pixels = torch.stack([preprocess(im) for im in images[part]])
                pixels = pixels.to(self.device, dtype=input_dtype)
                distinct, where = _unique(prompts[part])
                tokens = tokenizer(distinct).to(self.device)
                image_emb = model.encode_image(pixels)  # [B, D]
                text_emb = model.encode_text(tokens)  # [P, D]
                scores.append(_cosine(image_emb, text_emb[where.to(text_emb.device)]).cpu())
        cos = torch.cat(scores)  # [N]
        if self.clamp:
            cos = cos.clamp(min=0)  # NaN stays NaN, for the core Reward to report
        return (self.scale * cos).tolist()


class _registered:
    """Context manager: register a custom config with open_clip under a name derived from its
    content (so a config never shadows a built-in architecture) and yield that name."""

    def __init__(self, src: _OpenClipSource):
        self.src = src
        self.file: Path | None = None

    def __enter__(self) -> str:
        import open_clip

        if self.src.builtin is not None:
            return self.src.builtin
        text = json.dumps(self.src.config, sort_keys=True)
        name = "mmrl-" + hashlib.sha1(text.encode()).hexdigest()[:16]
        if name not in open_clip.list_models():
            folder = Path(tempfile.mkdtemp(prefix="mmrl-open-clip-"))
            self.file = folder / f"{name}.json"
            self.file.write_text(text)
            open_clip.add_model_config(self.file)
        return name

    def __exit__(self, *exc) -> None:
        if self.file is not None:  # open_clip keeps the parsed config in its registry
            self.file.unlink(missing_ok=True)
            self.file.parent.rmdir()


# ---------------------------------------------------------------------------- preference models


def preference_atom(
    path: str | os.PathLike,
    *,
    kind: str = "clip",
    name: str = "preference",
    weight: float = 1.0,
    parents: Sequence[str] | str = (),
    device: str = "cpu",
    batch_size: int = 16,
    scale: float | None = None,
    processor: str | os.PathLike | None = None,
    dtype: str | None = None,
    base_dir: str | os.PathLike | None = None,
) -> RewardAtom:
    """A batched atom scoring images with a preference model loaded from a local path.

    kind="clip": `path` is a transformers CLIP model directory (save_pretrained layout; the
        PickScore format). Score = s * cos(image_embeds, text_embeds) with s =
        logit_scale.exp() (PickScore's score) or s = `scale` when given (1.0: raw cosine).
        `processor`: a directory with the CLIP processor, when `path` lacks one (PickScore's
        reference code takes its processor from laion/CLIP-ViT-H-14-laion2B-s32B-b79K). `dtype`: "float32" (default), "float16" or "bfloat16".
    kind="custom": `path` is "file.py:factory". `factory(device)` is called once per process
        (on the first call of the atom) and returns a scorer; `scorer(images, prompts)`, with
        images a list of RGB PIL images and prompts a list of str, returns one number per
        image (a list, or a 1-D tensor / array). This is how ImageReward, HPS, aesthetic
        predictors or anything else plug in. The file is imported and the factory looked up
        now; a bad path or name raises ValueError naming the file. `scale` multiplies the
        scores when given.
    base_dir: resolves relative paths (default: the current directory).
    """
    if kind not in PREFERENCE_KINDS:
        raise ValueError(f"preference kind must be one of {PREFERENCE_KINDS}, got {kind!r}")
    device = _check_device(device)
    batch_size = _check_batch_size(batch_size)
    if scale is not None:
        scale = _check_scale(scale)
    if kind == "clip":
        model_dir = _existing_dir(path, base_dir, "preference model directory")
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"preference model directory {model_dir} has no config.json")
        processor_dir = (
            _existing_dir(processor, base_dir, "processor directory")
            if processor is not None
            else model_dir
        )
        if dtype not in (None, "float32", "float16", "bfloat16"):
            raise ValueError(f'dtype must be "float32", "float16" or "bfloat16", got {dtype!r}')
        scorer = _HFClipScorer(
            str(model_dir),
            str(processor_dir),
            device=device,
            batch_size=batch_size,
            scale=scale,
            dtype=dtype,
        )
    else:
        if processor is not None or dtype is not None:
            raise ValueError('processor and dtype apply to kind="clip" only')
        scorer = _CustomScorer(
            *_load_factory(path, base_dir), device=device, batch_size=batch_size, scale=scale
        )
    return RewardAtom(name, scorer, weight=weight, parents=parents, batched=True)


class _HFClipScorer:
    """The function of a preference atom of kind "clip": samples -> s * cosine."""

    def __init__(self, model_dir, processor_dir, *, device, batch_size, scale, dtype):
        self.model_dir = model_dir
        self.processor_dir = processor_dir
        self.device = device
        self.batch_size = batch_size
        self.scale = scale
        self.dtype = dtype

    def load(self):
        """(model, image processor, tokenizer), loaded once per process and shared."""
        key = ("hf_clip", self.model_dir, self.processor_dir, self.device, self.dtype)
        return _cached(key, self._load)

    def _load(self):
        from transformers import AutoModel, AutoProcessor

        try:
            model = AutoModel.from_pretrained(
                self.model_dir,
                local_files_only=True,
                dtype=getattr(torch, self.dtype) if self.dtype else torch.float32,
                use_safetensors=True,  # never unpickle
            )
        except Exception as e:
            raise RuntimeError(
                f"loading the preference model {self.model_dir} failed: {_describe(e)}"
            ) from e
        needed = ("get_image_features", "get_text_features", "logit_scale")
        if not all(hasattr(model, a) for a in needed):
            raise RuntimeError(
                f"preference model {self.model_dir} is a {type(model).__name__}, not a CLIP-style "
                "model (get_image_features, get_text_features, logit_scale)"
            )
        try:
            processor = AutoProcessor.from_pretrained(self.processor_dir, local_files_only=True)
        except Exception as e:
            raise RuntimeError(
                f"loading the processor from {self.processor_dir} failed: {_describe(e)}"
                + (
                    " (pass processor=<dir of a CLIP processor>)"
                    if self.processor_dir == self.model_dir
                    else ""
                )
            ) from e
        image_processor = getattr(processor, "image_processor", None)
        tokenizer = getattr(processor, "tokenizer", None)
        if image_processor is None or tokenizer is None:
            raise RuntimeError(
                f"{self.processor_dir} has no CLIP processor (an image processor and a tokenizer); "
                "pass processor=<dir of a CLIP processor>"
            )
        model.to(self.device).eval()
        model.requires_grad_(False)
        return model, image_processor, tokenizer

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        images, prompts = _images_and_prompts(samples)
        if not images:
            return []
        model, image_processor, tokenizer = self.load()
        text_config = getattr(model.config, "text_config", None)
        max_length = getattr(text_config, "max_position_embeddings", None)
        max_length = max_length or tokenizer.model_max_length
        param = next(model.parameters())
        scores = []
        with torch.no_grad():
            for part in _chunks(len(images), self.batch_size):
                pixels = image_processor(images=images[part], return_tensors="pt")["pixel_values"]
                pixels = pixels.to(param.device, dtype=param.dtype)
                distinct, where = _unique(prompts[part])
                text = tokenizer(
                    distinct,
                    padding=True,
                    truncation=True,
                    max_length=max_length,
                    return_tensors="pt",
                ).to(param.device)
                image_emb = _features(model.get_image_features(pixel_values=pixels))  # [B, D]
                text_emb = _features(
                    model.get_text_features(
                        input_ids=text["input_ids"], attention_mask=text.get("attention_mask")
                    )
                )  # [P, D]
                scores.append(_cosine(image_emb, text_emb[where.to(text_emb.device)]).cpu())
            s = model.logit_scale.float().exp().cpu() if self.scale is None else self.scale
        return (s * torch.cat(scores)).tolist()


def _features(out) -> torch.Tensor:
    """get_*_features returns the projected embeddings (transformers 4) or an output whose
    pooler_output holds them (transformers 5)."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def _load_factory(path, base_dir) -> tuple[Callable, str]:
    """(factory, "/abs/file.py:name" for messages) from "file.py:name"."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or ":" not in path:
        raise ValueError(
            f'a preference model of kind "custom" is "path/to/file.py:factory", got {path!r}'
        )
    file_part, attr = path.rsplit(":", 1)  # rsplit: a Windows drive letter has a ':' too
    if not file_part or not attr.isidentifier():
        raise ValueError(f'preference factory {path!r} must look like "path/to/file.py:factory"')
    file = _resolve(file_part, base_dir)
    if not file.is_file():
        raise ValueError(f"preference factory {path!r}: file not found: {file}")
    module = import_python_file(file, f"preference factory {path!r}")
    label = f"{file}:{attr}"
    factory = module_attribute(module, attr, f"preference factory {path!r}", str(file))
    if isinstance(factory, RewardAtom):
        raise ValueError(  # noqa: TRY004 -- a config error, like the others here
            f"preference factory {path!r}: {attr!r} in {file} is a reward atom; list it as a "
            "reward atom directly, or give a factory(device) -> scorer"
        )
    if not callable(factory):
        raise ValueError(  # noqa: TRY004 -- a config error, like the others here
            f"preference factory {path!r}: {attr!r} in {file} is {_a(type(factory).__name__)}, "
            "not callable"
        )
    return factory, label


class _CustomScorer:
    """The function of a preference atom of kind "custom": the user's scorer, in batches."""

    def __init__(self, factory: Callable, label: str, *, device, batch_size, scale):
        self.factory = factory
        self.label = label
        self.device = device
        self.batch_size = batch_size
        self.scale = scale

    def load(self) -> Callable:
        """The user's scorer: factory(device), called once per process and shared."""
        key = ("custom", self.label, self.device)
        return _cached(key, self._load)

    def _load(self) -> Callable:
        try:
            scorer = self.factory(self.device)
        except Exception as e:
            raise RuntimeError(
                f"preference factory {self.label}(device={self.device!r}) failed: {_describe(e)}"
            ) from e
        if not callable(scorer):
            raise TypeError(
                f"preference factory {self.label} returned {_a(type(scorer).__name__)}, "
                "expected a callable scorer(images, prompts) -> scores"
            )
        return scorer

    def __call__(self, samples: Sequence[Sample]) -> list:
        images, prompts = _images_and_prompts(samples)
        if not images:
            return []
        scorer = self.load()
        scores: list = []
        for part in _chunks(len(images), self.batch_size):
            try:
                with torch.no_grad():  # as the built-in scorers: no graph kept for a score
                    out = scorer(images[part], prompts[part])
            except Exception as e:
                raise RuntimeError(
                    f"preference scorer from {self.label} failed: {_describe(e)}"
                ) from e
            scores.extend(self._as_values(out, part.stop - part.start))
        if self.scale is not None:
            scores = [self.scale * float(v) if _is_number(v) else v for v in scores]
        return scores

    def _as_values(self, out, n: int) -> list:
        if isinstance(out, (torch.Tensor, np.ndarray)):
            if out.ndim != 1:
                raise ValueError(
                    f"preference scorer from {self.label} returned {_a(type(out).__name__)} of "
                    f"shape {tuple(out.shape)}, expected {n} scores"
                )
            out = out.tolist()
        elif isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
            raise TypeError(
                f"preference scorer from {self.label} returned {_a(type(out).__name__)}, "
                f"expected a list of {n} scores"
            )
        if len(out) != n:
            raise ValueError(
                f"preference scorer from {self.label} returned {len(out)} scores for {n} images"
            )
        return list(out)  # values are checked (number, finite) by the core Reward


def _is_number(v) -> bool:
    """A value `scale` may multiply; anything else (a string, an int past float's range) is left
    for the core Reward to refuse, naming the sample."""
    try:
        float(v)
    except (TypeError, ValueError, OverflowError):
        return False
    return not isinstance(v, (str, bytes))


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


def build_tiny_open_clip(out_dir: str | os.PathLike, seed: int = 0) -> tuple[str, str]:
    """Write a tiny random open_clip CLIP (1-layer 32-wide ViT on 32x32 images with 8x8 patches,
    1-layer 32-wide text transformer with the bundled BPE vocabulary, 32-d embeddings) into
    out_dir in open_clip's hub layout: open_clip_config.json + open_clip_model.safetensors.
    Returns (config path, weights path); out_dir itself is also a "local-dir:" model.
    Deterministic for a seed; nothing is downloaded."""
    import open_clip
    from safetensors.torch import save_file

    model_cfg = {
        "embed_dim": 32,
        "vision_cfg": {
            "image_size": 32,
            "layers": 1,
            "width": 32,
            "patch_size": 8,
            "head_width": 16,
        },
        "text_cfg": {
            "context_length": 16,
            "vocab_size": 49408,
            "width": 32,
            "heads": 2,
            "layers": 1,
        },
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = open_clip.CLIP(**model_cfg)
    config_path = out / "open_clip_config.json"
    config_path.write_text(json.dumps({"model_cfg": model_cfg, "preprocess_cfg": {}}, indent=2))
    weights_path = out / "open_clip_model.safetensors"
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(weights_path))
    return str(config_path), str(weights_path)


_CLIP_PRETOKENIZE = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


def build_tiny_hf_clip(out_dir: str | os.PathLike, seed: int = 0) -> str:
    """Write a tiny random transformers CLIPModel with its CLIPProcessor into out_dir
    (save_pretrained layout, the PickScore format) and return out_dir.

    The tokenizer is the real CLIPTokenizer over a byte-level BPE trained offline with the
    `tokenizers` library on prompts of the shapes tasks (CLIP's lower-casing normaliser,
    pre-tokeniser and "</w>" word ends; every byte, with and without "</w>", is in the
    vocabulary, so any text encodes without unknown tokens). The image processor is
    CLIPImageProcessor at 32x32. The model: 1-layer, 32-wide towers, 16-d projections,
    16 text positions. Deterministic for a seed; nothing is downloaded."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import (
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        CLIPProcessor,
        CLIPTokenizer,
    )

    bpe = Tokenizer(BPE(continuing_subword_prefix="", end_of_word_suffix="</w>"))
    bpe.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_CLIP_PRETOKENIZE), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=alphabet,
        end_of_word_suffix="</w>",
        special_tokens=[],
    )
    bpe.train_from_iterator(_tiny_corpus(), trainer=trainer)
    trained = json.loads(bpe.to_str())["model"]
    vocab: dict[str, int] = dict(trained["vocab"])
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    for ch in alphabet:
        for token in (ch, ch + "</w>"):
            vocab.setdefault(token, len(vocab))
    for token in ("<|startoftext|>", "<|endoftext|>"):
        vocab[token] = len(vocab)
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=16)
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    )
    config = CLIPConfig(
        text_config={
            "vocab_size": len(vocab),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": 16,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 8,
        },
        projection_dim=16,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPModel(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out)
    return str(out)


def _tiny_corpus() -> list[str]:
    colours = ("red", "green", "blue", "yellow")
    shapes = ("circle", "square", "triangle")
    counts = ("a", "an", "one", "two", "three", "four")
    relations = ("left of", "right of", "above", "below")
    lines = [
        f"{n} {c} {s}{'s' if n not in ('a', 'an', 'one') else ''}"
        for n in counts
        for c in colours
        for s in shapes
    ]
    lines += [
        f"a {c1} {s1} {r} a {c2} {s2}"
        for c1 in colours
        for s1 in shapes
        for r in relations
        for c2 in colours[:2]
        for s2 in shapes[:2]
    ]
    lines += ["a photo of", "an image of", "on a white background"]
    return lines


# ---------------------------------------------------------------------------- small helpers


def _check_device(device) -> str:
    try:
        where = torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"device {device!r} is not a torch device: {_describe(e)}") from e
    if where.type == "cuda":  # checked now: the model loads at the first score, after a whole rollout
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {device!r}: no CUDA device is visible to this process "
                             "(torch.cuda.is_available() is False); use device cpu")
        if (where.index or 0) >= count:
            raise ValueError(f"device {device!r}: GPU {where.index} does not exist (this process sees {count})")
    return str(device)


def _check_batch_size(batch_size) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    return batch_size


def _check_scale(scale) -> float:
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise ValueError(f"scale must be a number, got {scale!r}") from None
    if isinstance(scale, bool) or not math.isfinite(value):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    return value


def _check_clamp(clamp) -> bool:
    # bool() read the string "false" (a quoted YAML value) as True
    if not isinstance(clamp, (bool, np.bool_)):
        raise ValueError(f"clamp must be true or false, got {clamp!r}")  # noqa: TRY004
    return bool(clamp)


OPEN_CLIP_PRECISIONS = ("fp32", "fp16", "bf16", "pure_fp16", "pure_bf16")


def _check_precision(precision) -> str:
    # open_clip loads any other name ("bfloat16", "fp8") in fp32, saying nothing
    if precision not in OPEN_CLIP_PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(OPEN_CLIP_PRECISIONS)} (open_clip's names), "
                         f"got {precision!r}")
    return precision


def _resolve(path, base_dir) -> Path:
    """As a config's other paths: relative ones from `base_dir` (the config's directory), else
    the working directory (mmrl.core.runconfig.resolve_file)."""
    from mmrl.core.runconfig import resolve_file

    return resolve_file(path, base_dir).resolve()


def _existing_dir(path, base_dir, what: str) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"{what} must be a local path, got {path!r}")
    p = _resolve(path, base_dir)
    if not p.is_dir():
        raise ValueError(f"{what} not found: {p}")
    return p


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _describe(exc: BaseException) -> str:
    msg = str(exc)
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def _short(text: str, limit: int = 60) -> str:
    r = repr(text)
    return r if len(r) <= limit else r[: limit - 3] + "..."
