"""Preference models (`preference_atom`): a transformers CLIP model (PickScore's format, kind
"clip") or the user's own scorer from a Python file (kind "custom": ImageReward, HPS, aesthetic
predictors). Scores: diffusion_rl/rewards.py's docstring.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np
import torch

from diffusion_rl.image_rewards.common import (
    _a,
    _cached,
    _check_batch_size,
    _check_device,
    _check_scale,
    _chunks,
    _cosine,
    _describe,
    _existing_dir,
    _images_and_prompts,
    _resolve,
    _unique,
)
from mmrl.core.rewards import RewardAtom, Sample, import_python_file, module_attribute

PREFERENCE_KINDS = ("clip", "custom")


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
