"""What the image reward atoms (clip_score.py, preference.py) share: the per-process cache of
loaded reward models (`clear_model_cache`), a batch's images and prompts (`to_rgb` and the
conversions diffusion_rl/rewards.py's docstring lists), the checks of an atom's arguments,
path resolution and message helpers.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from mmrl.core.rewards import Sample

# ---------------------------------------------------------------------------- model cache

_CACHE: dict[tuple, Any] = {}
_CACHE_LOCK = threading.Lock()  # guards _CACHE and _KEY_LOCKS
_KEY_LOCKS: dict[tuple, threading.Lock] = {}


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
    """`image` as an 8-bit RGB PIL image (see diffusion_rl/rewards.py's docstring for the
    conversions).
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
