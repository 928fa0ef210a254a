"""Users' own visual-question data as JSONL, and export of generated items to it.

One JSON object per line (blank lines are ignored):

    {"question": "How many cats?", "answer": 2, "image": "imgs/cats.jpg", "source": "web"}
    {"question": "Which is bigger?", "answer": "left", "images": ["a.png", "b.png"]}
    {"question": "What colour?", "answer": "red", "image_b64": "iVBORw0KGgo..."}
    {"question": "What is 2 + 2?", "answer": "4"}

- "question": a non-empty string (required).
- "answer": a non-empty string or a number (required); meta["answer"] = str(answer).
- images, at most one of: "image" (a path), "images" (a list of paths), "image_b64"
  (base64 PNG/JPEG/..., a "data:image/...;base64," prefix allowed; or a list of them).
  None: a text-only prompt. Relative paths resolve against base_dir (default: the
  JSONL file's directory). The question may place them with "<image>" placeholders
  (LLaVA's and LLaMA-Factory's format), one per image in order; without any, the
  images come before the text.
- "reference": the SFT target completion (optional, default "").
- every other field is copied into meta.

Images are converted to 8-bit RGB: transparency is composited on white; 16-bit
images are scaled (65535 -> 255), not clipped; see `to_rgb`. JPEG EXIF orientation
is applied. `fit` (load_jsonl's argument) may then shrink each image, once: the VLM
backend keeps only the size the model sees, not a photo's full resolution (backend.model_view).
With `originals=True` (tool rollouts: zoom crops the original) the items are JsonlItems that
also say where each shrunk image's original is (`ImageFile`): its file, or an image_b64
field's bytes, decoded again when a tool asks, not held decoded for the whole run.

Every error is a DatasetError naming the file, the 1-based line and the field.
With on_bad_image="skip", a sample whose image is missing or unreadable is left out
with one warning that counts and names them; the returned list's `.skipped` holds
(line, reason) for each.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import hashlib
import io
import json
import os
import unicodedata
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from mmrl.core.jsonl import DatasetError, HeldOutWarning, json_type, read_objects, text_and_answer
from mmrl.vlm.tasks.shapes_qa import QAItem

__all__ = ["DatasetError", "ImageFile", "JsonlItem", "QADataset", "check_overlap", "load_jsonl", "open_rgb",
           "placeholder_problem", "prompt_problem", "question_problem", "save_jsonl", "to_rgb", "warnings_named"]

IMAGE_FIELDS = ("image", "images", "image_b64")
IMAGE_PLACEHOLDER = "<image>"  # where an image goes in the question (VLMPolicy.messages places it)
RESERVED_FIELDS = ("question", "answer", "reference", *IMAGE_FIELDS)
_SKIP_NAMED = 5  # skipped samples named in the warning
# Originals kept decoded (ImageFile.open): a group's rollouts call tools on one prompt in a row,
# so a few spare most decodes, at 36 MB each for a 12-megapixel photo.
ORIGINALS_CACHED = 4


class _BadImage(Exception):
    """An image that is missing or cannot be decoded (skippable)."""

    def __init__(self, field: str, problem: str):
        super().__init__(problem)
        self.field = field
        self.problem = problem


class QADataset(list):
    """A list of QAItem loaded from a file; `.skipped` lists (line, reason) of the
    samples left out for bad images (on_bad_image="skip")."""

    def __init__(self, items=(), skipped=()):
        super().__init__(items)
        self.skipped: list[tuple[int, str]] = list(skipped)


@dataclass(frozen=True)
class ImageFile:
    """Where the full-resolution original of a jsonl image kept smaller (load_jsonl's `fit`) is:
    its file, with the size and modification time it had at load, or an image_b64 field's bytes
    (held as given: the compressed size). `open()` decodes it as load_jsonl did (open_rgb: EXIF
    orientation, 8-bit RGB), so a tool gets the very pixels it got of an image kept whole.
    It crosses the wire to a rollout server (placement process or remote) as the file's bytes
    (wire_form), so a server on another machine needs no copy of the dataset."""

    # "FILE, line N, field F", for the messages; not compared: the questions of one photo share its decode
    where: str = field(compare=False)
    path: str | None = None  # absolute; a str, not a Path: mmrl.core.wire sends it to rollout servers
    data: bytes | None = field(default=None, repr=False)
    stamp: tuple[int, int] | None = None  # the file's (size, mtime_ns) at load

    def open(self) -> Image.Image:
        """The original image, from a cache of the last ORIGINALS_CACHED opened: shared, so copy
        it before changing it. A file that changed since load is refused (ValueError): its
        pixels, even its size, may not be the ones the model saw."""
        if self.path is not None:  # checked on every open, a cached one's too: a stat is microseconds
            try:
                st = os.stat(self.path)
            except FileNotFoundError:
                raise ValueError(f"{self.path} ({self.where}) is gone: a tool reads the full-resolution image from "
                                 "its file (a rollout server too, at the same path)") from None
            if (st.st_size, st.st_mtime_ns) != self.stamp:
                raise ValueError(f"{self.path} ({self.where}) changed since the task was loaded, so its full-"
                                 "resolution image may not be the one the model sees; restore it, or restart the run")
        return _decoded(self)

    def wire_form(self) -> ImageFile:
        """What mmrl.core.wire sends: the file's bytes (its compressed size, read now) where it is
        as it was at load; else the path, so the server's tool call names the file at fault."""
        if self.path is None:
            return self
        try:
            if (st := os.stat(self.path)) and (st.st_size, st.st_mtime_ns) == self.stamp:
                return ImageFile(self.where, data=Path(self.path).read_bytes())
        except OSError:
            pass
        return self


@functools.lru_cache(maxsize=ORIGINALS_CACHED)
def _decoded(source: ImageFile) -> Image.Image:
    with warnings.catch_warnings():  # what decoding it says (corrupt EXIF) was said, named, at load
        warnings.simplefilter("ignore")
        return open_rgb(io.BytesIO(source.data) if source.data is not None else source.path)


@dataclass
class JsonlItem(QAItem):
    """A QAItem of load_jsonl(originals=True): originals[i] is where images[i]'s full-resolution
    original is (an ImageFile) where `fit` kept a smaller image, else None (images[i] is it)."""

    originals: list = field(default_factory=list, repr=False, compare=False)

    def full_images(self) -> list[Image.Image]:
        """The images at full resolution (an original from ImageFile.open is shared: copy it
        before changing it)."""
        return [o.open() if o is not None else im for im, o in zip(self.images, self.originals)]


def load_jsonl(
    path: str | os.PathLike,
    *,
    base_dir: str | os.PathLike | None = None,
    on_bad_image: str = "raise",
    fit: Callable[[Image.Image], Image.Image] | None = None,
    originals: bool = False,
) -> QADataset:
    """Load a JSONL file of visual questions (see the module docstring) as QAItems. `fit`, if
    given, replaces each image once it has been read (whole, so a bad file is refused as without
    it): what the items keep. Only one image at a time is then held at full resolution.
    `originals`: the items are JsonlItems that say where each replaced image's original is."""
    if on_bad_image not in ("raise", "skip"):
        raise ValueError(f'on_bad_image must be "raise" or "skip", got {on_bad_image!r}')
    path = Path(path).expanduser()
    root = Path(base_dir).expanduser() if base_dir is not None else path.parent

    items, skipped = [], []
    for lineno, obj in read_objects(path):
        try:
            items.append(_parse_object(obj, path, lineno, root, fit, originals))
        except _BadImage as e:
            if on_bad_image == "raise":
                raise DatasetError(path, lineno, e.field, e.problem) from e.__cause__
            skipped.append((lineno, f"{e.field}: {e.problem}"))
    if skipped:
        named = "; ".join(f"line {n} ({why})" for n, why in skipped[:_SKIP_NAMED])
        more = f"; and {len(skipped) - _SKIP_NAMED} more" if len(skipped) > _SKIP_NAMED else ""
        warnings.warn(
            f"{path}: skipped {len(skipped)} sample(s) with a missing or unreadable image: "
            f"{named}{more}",
            UserWarning,
            stacklevel=2,
        )
    if not items:
        problem = "no samples" if not skipped else f"no usable samples ({len(skipped)} skipped)"
        raise DatasetError(path, None, None, f"empty dataset: {problem}")
    return QADataset(items, skipped)


_VISION_MARKS = ("<|vision_start|>", "<|image_pad|>", "<|video_pad|>", "<|vision_end|>")  # Qwen's
_TURN_MARKS = ("<|im_start|>", "<|im_end|>")  # Qwen's (ChatML)
_END_MARKS = ("<|endoftext|>",)  # Qwen's end of text (its pad token), also read as one token


def check_overlap(train: Sequence[QAItem], evaluation: Sequence[QAItem]) -> None:
    """Warn, as the dLLM jsonl task does (one warning, naming the first case), where held-out
    samples are training samples too: the same question on the same images (compared by their
    pixels, so one file given as both, or an image saved twice, is found). Held-out accuracy
    then counts samples the model trained on. It may be meant; it was not said."""
    def key(item: QAItem) -> tuple:
        return item.question, tuple(hashlib.sha256(im.tobytes()).hexdigest() + f"{im.size}" for im in item.images)

    asked = {it.question for it in train}
    candidates = [e for e in evaluation if e.question in asked]  # pixels hashed only for these
    questions = {e.question for e in candidates}
    first: dict[tuple, QAItem] = {}
    for it in train:
        if it.question in questions:
            first.setdefault(key(it), it)
    seen = [(e, first[k]) for e in candidates if (k := key(e)) in first]
    if seen:
        (e, t), n = seen[0], len(seen)
        # one file given as both (its "line 1; line 1" read as a typo): say so, as the dLLM task does
        where = (f"{e.where}, the training file itself: task.eval_path is task.train_path" if e.where and
                 e.where == t.where else f"{e.where or 'held-out'}; {t.where or 'train'}")
        warnings.warn(f"{n} of the {len(evaluation)} held-out samples {'is a' if n == 1 else 'are'} training "
                      f"sample{'' if n == 1 else 's'} too, the same question on the same images (the first: "
                      f"{e.question[:60]!r}, {where}): held-out accuracy counts samples the model trains on",
                      HeldOutWarning, stacklevel=2)


def question_problem(question: str) -> str | None:
    """Why `question` cannot go to the chat template as the user's text, or None: it holds the
    chat format's image placeholder or turn marker, each read as one token. A JSONL line with it
    is refused; a question from elsewhere (`sample --prompt`) may be checked here too."""
    marks = [m for m in _VISION_MARKS if m in question]
    if marks:  # the processor would count them as images: a mismatch at the first rollout
        return (f"holds the chat format's image placeholder {marks[0]}: give the images in the image or images "
                "field, and the chat template places them")
    turns = sorted((m for m in _TURN_MARKS if m in question), key=question.index)  # the first in the text
    if turns:  # read as one token: the text after it is a turn of its own, an assistant's if it says so
        return (f"holds the chat format's turn marker {turns[0]}, which would end the user's turn inside the "
                "question: give the question's text alone, and the chat template writes the turns")
    ends = [m for m in _END_MARKS if m in question]
    if ends:  # the model would read the end of the text inside the question
        return (f"holds the tokenizer's end-of-text token {ends[0]}, read as one token that ends the text inside "
                "the question: leave it out")
    return None


def placeholder_problem(question: str, images: int) -> str | None:
    """Why the "<image>" placeholders of `question` cannot place its `images` images, or None:
    their count differs (VLMPolicy.messages would leave them as the text "<image>")."""
    marks = question.count(IMAGE_PLACEHOLDER)
    if not marks or marks == images:
        return None
    return (f"holds {marks} {IMAGE_PLACEHOLDER} placeholder{'s' if marks > 1 else ''} for {images} "
            f"image{'' if images == 1 else 's'}: give one per image, where it goes in the text, or none "
            "(the images then come before the text)")


def prompt_problem(question: str, images: int) -> str | None:
    """Why a question given with `images` images cannot be asked (question_problem, then
    placeholder_problem), or None: what `sample --prompt` and a served prompt are checked by, as a
    data file's line is (which checks the question before its images are read)."""
    return question_problem(question) or placeholder_problem(question, images)


def _parse_object(obj: dict, path: Path, lineno: int, root: Path, fit=None, originals=False) -> QAItem:
    def error(field, problem):
        return DatasetError(path, lineno, field, problem)

    question, answer = text_and_answer(obj, "question", error)
    problem = question_problem(question)
    if problem:
        raise error("question", problem)
    reference = obj.get("reference", "")
    if not isinstance(reference, str):
        raise error("reference", f"must be a string, got {json_type(reference)}")

    given = [f for f in IMAGE_FIELDS if f in obj]
    if len(given) > 1:
        raise error(given[1], f"give only one of {', '.join(IMAGE_FIELDS)} (found {given})")
    images, sources = [], []
    if given:
        name = given[0]
        value = obj[name]
        if name == "images" or (name == "image_b64" and isinstance(value, list)):
            if not isinstance(value, list):
                raise error(name, f"must be a list of strings, got {json_type(value)}")
            entries = [(f"{name}[{i}]", v) for i, v in enumerate(value)]
        else:
            entries = [(name, value)]
        for field, v in entries:
            if not isinstance(v, str):
                raise error(field, f"must be a string, got {json_type(v)}")
            if not v.strip():
                raise error(field, "is empty")
        for field, v in entries:
            where = f"{path}, line {lineno}, field {field!r}"
            with warnings_named(where):
                image, source = _decode_b64(field, v, where) if name == "image_b64" else _open(field, v, root, where)
                kept = fit(image) if fit is not None else image
            images.append(kept)
            sources.append(source if kept is not image else None)  # None: the item keeps the original
    problem = placeholder_problem(question, len(images))
    if problem:
        raise error("question", problem)

    meta = {k: v for k, v in obj.items() if k not in RESERVED_FIELDS}
    meta["answer"] = answer
    if originals:
        return JsonlItem(images=images, question=question, answer=answer, reference=reference, meta=meta,
                         where=f"{path}, line {lineno}", originals=sources)
    return QAItem(images=images, question=question, answer=answer, reference=reference, meta=meta,
                  where=f"{path}, line {lineno}")


def _open(field: str, value: str, root: Path, where: str) -> tuple[Image.Image, ImageFile]:
    p = Path(value).expanduser()
    if not p.is_absolute():
        p = root / p
    if value.startswith(("http://", "https://")):
        raise _BadImage(field, f"{value[:80]} is a URL; images are read from local files or base64 (no downloads)")
    if not p.exists():
        p = _normalised(p)
    if p.is_dir():
        raise _BadImage(field, f"{p} is a directory, not an image file")
    if not p.is_file():
        raise _BadImage(field, f"image file not found: {p}{_unseen(value, root)}")
    try:
        image = open_rgb(p)
    except Exception as e:  # decoders raise many kinds of errors
        raise _BadImage(field, f"cannot read image {p}: {unreadable(p, e)}") from e
    st = p.stat()
    return image, ImageFile(where, path=os.path.abspath(p), stamp=(st.st_size, st.st_mtime_ns))


def unreadable(p: Path, e: BaseException) -> str:
    """Why the image file p did not read (open_rgb raised e). For a file Pillow cannot identify
    ("cannot identify image file"), what it holds: nothing (an interrupted copy), or its first
    bytes (an HTML error page saved as .jpg, a HEIC photo where Pillow has no HEIF plugin)."""
    if not isinstance(e, UnidentifiedImageError):
        return _describe(e)
    with open(p, "rb") as f:
        head = f.read(16)
    if not head:
        return "the file is empty (0 bytes)"
    return f"not an image format Pillow reads ({p.stat().st_size} bytes; it starts {head!r})"


def _normalised(p: Path) -> Path:
    """p with each name that is not there in the other Unicode normal form where that one is:
    "é" typed (NFC, one code point) names a file or folder that macOS wrote as "e" and an accent
    (NFD), or the other way round. The two look the same in any message."""
    out = Path(p.anchor)
    for part in p.parts[len(out.parts):]:
        here = out / part
        if not here.exists():
            here = next((q for form in ("NFC", "NFD") if (q := out / unicodedata.normalize(form, part)).exists()), here)
        out = here
    return out


def _unseen(value: str, root: Path) -> str:
    """What a missing file's name holds that its message would not show: surrounding spaces
    (where the name without them is a file) or invisible characters (a zero-width space
    pasted with it). Else ""."""
    bare = Path(value.strip()).expanduser()
    if value != value.strip() and (bare if bare.is_absolute() else root / bare).is_file():
        return f" (the name has spaces around it: {value!r}; without them it is a file)"
    return "" if value.isprintable() else f" (the name holds invisible characters: {value!r})"


def _decode_b64(field: str, value: str, where: str) -> tuple[Image.Image, ImageFile]:
    data = value.strip()
    if data.startswith("data:"):
        _, sep, data = data.partition(",")
        if not sep:
            raise _BadImage(field, "a data: URI without a ',' before the base64 data")
    try:
        raw = base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        looks = data.lower().startswith(("http://", "https://")) or data.lower().endswith(_IMAGE_SUFFIXES)
        hint = " (it looks like a path or URL: a file goes in the image field)" if looks else ""
        raise _BadImage(field, f"not valid base64: {e}{hint}") from e
    try:
        return open_rgb(io.BytesIO(raw)), ImageFile(where, data=raw)
    except UnidentifiedImageError as e:  # its message is "cannot identify image file <_io.BytesIO object at 0x...>"
        problem = f"cannot decode the image ({len(raw)} bytes): not an image format Pillow reads (it starts {raw[:16]!r})"
        raise _BadImage(field, problem) from e
    except Exception as e:  # decoders raise many kinds of errors
        problem = f"cannot decode the image ({len(raw)} bytes): {_describe(e)}"
        raise _BadImage(field, problem) from e


_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp", ".tif", ".tiff")


def _describe(e: BaseException) -> str:
    if isinstance(e, Image.DecompressionBombError):  # its "could be decompression bomb DOS attack" says no way out
        return (f"{type(e).__name__}: {e} (Pillow refuses images over twice PIL.Image.MAX_IMAGE_PIXELS: "
                "give a smaller copy)")
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


@contextlib.contextmanager
def warnings_named(where: str):
    """Warnings raised inside (Pillow's "Corrupt EXIF data", which names no file) are issued
    again, once it ends, prefixed by `where`: the file and line at fault."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        warnings.warn(f"{where}: {w.message}", w.category, stacklevel=3)


def open_rgb(source) -> Image.Image:
    """to_rgb of an image file (a path or a file object). Pillow's DecompressionBombWarning
    (over Image.MAX_IMAGE_PIXELS, 89 megapixels: a 10000 x 10000 photo) is silenced: the
    user's own image is no attack, the image reads, and the warning would not say which
    file it means. Over twice that Pillow raises DecompressionBombError (see _describe)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with Image.open(source) as img:
            return to_rgb(img)


def to_rgb(img: Image.Image) -> Image.Image:
    """Decode `img` fully and return an 8-bit RGB copy.

    - RGB: as is. JPEG EXIF orientation is applied first.
    - Transparency (RGBA, LA, PA, RGBa, La, P or L/RGB with a transparency colour):
      alpha-composited on white.
    - 1, L, CMYK, YCbCr, P, ...: Pillow's conversion.
    - I;16*: scaled by 255/65535 (rounded), so the full 16-bit range maps to 0..255.
    - I (32-bit int): values in 0..65535 are treated as 16-bit as above (16-bit PNGs and
      TIFFs open this way); otherwise min-max scaled to 0..255.
    - F (float): values in [0, 1] scaled by 255; otherwise min-max scaled; NaN -> 0.
    """
    img.load()
    if img.format == "JPEG" or "exif" in img.info:
        img = ImageOps.exif_transpose(img)
    mode = img.mode
    if mode == "RGB" and "transparency" not in img.info:  # an RGB PNG's transparency colour: composited below
        return img.copy()
    if mode.startswith("I;16") or mode in ("I", "F"):
        return _gray_to_rgb(np.asarray(img), mode)
    if mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def _gray_to_rgb(a: np.ndarray, mode: str) -> Image.Image:
    a = a.astype(np.float64)
    if mode == "F":
        a = np.nan_to_num(a, nan=0.0)
    lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
    if mode.startswith("I;16") or (mode == "I" and lo >= 0 and hi <= 65535):
        a = a * (255.0 / 65535.0)
    elif mode == "F" and lo >= 0 and hi <= 1:
        a = a * 255.0
    else:  # min-max
        a = (a - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(a)
    gray = np.clip(np.rint(a), 0, 255).astype(np.uint8)
    return Image.fromarray(np.stack([gray] * 3, axis=-1), "RGB")


def save_jsonl(
    items: Sequence[QAItem], path: str | os.PathLike, image_dir: str | os.PathLike
) -> Path:
    """Write items as JSONL that load_jsonl reads back: images as PNG files in image_dir
    (referenced relative to the JSONL file's directory when possible), "reference" when
    non-empty, and meta fields (but meta["answer"]) as extra fields. Returns the path."""
    path = Path(path).expanduser()
    image_dir = Path(image_dir).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    image_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, item in enumerate(items):
        clash = sorted(k for k in item.meta if k in RESERVED_FIELDS and k != "answer")
        if clash:
            raise ValueError(f"item {i}: meta keys {clash} clash with the JSONL fields")
        refs = []
        for j, img in enumerate(item.images):
            file = image_dir / f"{path.stem}_{i:06d}_{j}.png"
            to_rgb(img).save(file, format="PNG")
            refs.append(_relative(file, path.parent))
        obj: dict = {"question": item.question, "answer": item.answer}
        if len(refs) == 1:
            obj["image"] = refs[0]
        elif refs:
            obj["images"] = refs
        if item.reference:
            obj["reference"] = item.reference
        obj.update((k, v) for k, v in item.meta.items() if k != "answer")
        try:
            lines.append(json.dumps(obj, ensure_ascii=False))
        except (TypeError, ValueError) as e:
            raise ValueError(f"item {i}: meta is not JSON-serialisable: {e}") from e
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _relative(file: Path, start: Path) -> str:
    try:
        return Path(os.path.relpath(file.resolve(), start.resolve())).as_posix()
    except ValueError:  # another drive on Windows
        return str(file.resolve())
