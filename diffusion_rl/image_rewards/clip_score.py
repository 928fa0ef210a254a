"""CLIP score (`clip_score_atom`): the cosine of an open_clip model's image and prompt
embeddings, from local weights only. Scores and settings: diffusion_rl/rewards.py's docstring.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from diffusion_rl.image_rewards.common import (
    _cached,
    _check_batch_size,
    _check_clamp,
    _check_device,
    _check_precision,
    _check_scale,
    _chunks,
    _cosine,
    _describe,
    _images_and_prompts,
    _unique,
)
from mmrl.core.rewards import RewardAtom, Sample

_OPEN_CLIP_REGISTRY_LOCK = threading.Lock()  # open_clip's config registry is a global


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
    clamp=True) with an open_clip model; see diffusion_rl/rewards.py's docstring for common
    settings.

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
