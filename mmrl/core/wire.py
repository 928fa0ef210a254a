"""What crosses the wire between the trainer and a rollout server, without pickle.

A server must never run what a client sends, so nothing here unpickles: every
message is JSON. Values are encoded by kind:

    None, bool, int, float, str, list     as themselves
    dict                                  as a JSON object (str keys), else tagged pairs
    tuple, bytes                          tagged
    torch.Tensor                          a reference into one safetensors blob per message
                                          (base64), so dtype and shape survive exactly
    PIL image                             base64 PNG with its mode (modes PNG cannot hold,
                                          such as "I" or "F", go as raw pixel bytes instead)
    dataclass                             its class name and fields, for public classes defined in
                                          the project's packages only (ALLOWED_PACKAGES); one with
                                          a wire_form() method sends what that returns

Tagged values are objects with a "__t" key. Decoding rebuilds a dataclass only
after checking that the named class is a dataclass defined in an allowed
package, in a module this process has already imported (a message never makes
the receiver import anything: importing runs code, and `mmrl.__main__` would run
the CLI), and that neither the module nor the class is private ("_x") or a
`__main__`; anything else is refused with `WireError`, as is any failure to
decode or build a value (a batch that does not validate included). Requests,
rollout batches and their samples and scores are dataclasses of mmrl, so they
take the generic path and the batch re-validates itself on decode; a backend's
prompt items are dataclasses of its task module, which building its policy
imports. Weights travel as raw safetensors bytes (`encode_weights`), the format
checkpoints use.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import sys
from collections.abc import Sequence
from typing import Any

import safetensors.torch
from PIL import Image
from torch import Tensor

from mmrl.core.batch import RolloutBatch
from mmrl.core.engine import Request

ALLOWED_PACKAGES = ("mmrl", "diffusion_rl", "dllm_rl")
PNG_MODES = {"1", "L", "LA", "P", "RGB", "RGBA", "I;16"}  # those PNG round-trips exactly
MAX_RAW_PIXELS = 1 << 28  # pixels of all the images of one message, together: each is allocated as it decodes,
# and a PNG of a few kilobytes may be a 12000 x 12000 image (576 MB of RGBA), so a message's bytes do not bound them


class WireError(ValueError):
    """A value cannot be encoded, or a message is malformed or names a class not allowed."""


# --------------------------------------------------------------------------- generic values


def pack(value: Any) -> dict:
    """Encode any supported value as a JSON-able message {"value", "tensors"}."""
    tensors: dict[str, Tensor] = {}
    try:
        encoded = _encode(value, tensors)
    except RecursionError:
        raise WireError("value is nested too deeply (or refers to itself)") from None
    blob = None
    if tensors:
        blob = base64.b64encode(safetensors.torch.save(tensors)).decode("ascii")
    return {"value": encoded, "tensors": blob}


def unpack(message: Any, max_pixels: float | None = None) -> Any:
    """Decode a message made by `pack`; raises WireError on anything malformed or not allowed.
    `max_pixels`: the most pixels its images may have together (default MAX_RAW_PIXELS, what a
    server takes from any client; a trainer takes its own server's batches of images unbounded)."""
    if not isinstance(message, dict) or set(message) != {"value", "tensors"}:
        raise WireError("a message must be an object with exactly the keys 'value' and 'tensors'")
    tensors: dict[str, Tensor] = {}
    if message["tensors"] is not None:
        try:
            tensors = safetensors.torch.load(_b64(message["tensors"], "tensors"))
        except WireError:
            raise
        except Exception as e:  # noqa: BLE001 -- any parse failure of client bytes is bad input
            raise WireError(f"the tensor blob is not valid safetensors: {e}") from None
    try:
        limit = MAX_RAW_PIXELS if max_pixels is None else max_pixels
        return _decode(message["value"], tensors, [limit, limit])
    except RecursionError:
        raise WireError("message is nested too deeply") from None


def _encode(v: Any, tensors: dict[str, Tensor]) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [_encode(x, tensors) for x in v]
    if isinstance(v, tuple):
        return {"__t": "tuple", "items": [_encode(x, tensors) for x in v]}
    if isinstance(v, dict):
        if all(isinstance(k, str) for k in v) and "__t" not in v:
            return {k: _encode(x, tensors) for k, x in v.items()}
        return {"__t": "dict", "items": [[_encode(k, tensors), _encode(x, tensors)] for k, x in v.items()]}
    if isinstance(v, bytes):
        return {"__t": "bytes", "b64": base64.b64encode(v).decode("ascii")}
    if isinstance(v, Tensor):
        key = str(len(tensors))
        # A clone of its own: safetensors refuses tensors that share storage (views).
        tensors[key] = v.detach().cpu().contiguous().clone()
        return {"__t": "tensor", "key": key}
    if isinstance(v, Image.Image):
        return _encode_image(v)
    if hasattr(v, "wire_form"):  # what it sends of itself (a jsonl image's original: its file's bytes)
        v = v.wire_form()
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        name = _class_name(type(v))
        if not _allowed(type(v)):
            raise WireError(f"cannot send a {name}: only public dataclasses of {', '.join(ALLOWED_PACKAGES)} "
                            "cross the wire")
        fields = {f.name: _encode(getattr(v, f.name), tensors) for f in dataclasses.fields(v)}
        return {"__t": "dataclass", "cls": name, "fields": fields}
    raise WireError(f"cannot send a value of type {_class_name(type(v))}")


def _decode(v: Any, tensors: dict[str, Tensor], pixels: list[int]) -> Any:
    """`pixels`: [how many more image pixels this message may decode, how many it may in all]."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [_decode(x, tensors, pixels) for x in v]
    if not isinstance(v, dict):
        raise WireError(f"unexpected JSON value of type {type(v).__name__}")
    if "__t" not in v:
        return {k: _decode(x, tensors, pixels) for k, x in v.items()}
    tag = v["__t"]
    try:
        if tag == "tuple":
            return tuple(_decode(x, tensors, pixels) for x in v["items"])
        if tag == "dict":
            return {_decode(k, tensors, pixels): _decode(x, tensors, pixels) for k, x in v["items"]}
        if tag == "bytes":
            return _b64(v["b64"], "bytes")
        if tag == "tensor":
            return tensors[v["key"]]
        if tag == "image":
            return _decode_image(v, pixels)
        if tag == "dataclass":
            return _decode_dataclass(v, tensors, pixels)
    except (WireError, RecursionError):
        raise
    except Exception as e:  # noqa: BLE001 -- whatever a sender's value breaks (a dataclass that does not
        # validate, a field of the wrong type) is bad input, never the receiver's crash
        raise WireError(f"malformed {tag!r} value: {type(e).__name__}: {e}") from None
    raise WireError(f"unknown value tag {tag!r}")


def _decode_dataclass(v: dict, tensors: dict[str, Tensor], pixels: list[int]) -> Any:
    cls = resolve_class(v["cls"])
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = v["fields"]
    unknown = set(values) - set(fields)
    if unknown:
        raise WireError(f"{v['cls']} has no fields {sorted(unknown)}")
    decoded = {k: _decode(x, tensors, pixels) for k, x in values.items()}
    obj = cls(**{k: x for k, x in decoded.items() if fields[k].init})
    for k, x in decoded.items():  # init=False fields, set as the sender had them
        if not fields[k].init:
            object.__setattr__(obj, k, x)
    return obj


def resolve_class(name: str) -> type:
    """The dataclass named "module:QualName", if it is a public dataclass defined in an allowed
    package, in a module already imported here; else WireError. Nothing is imported."""
    if not isinstance(name, str) or name.count(":") != 1:
        raise WireError(f"bad class name {name!r}: expected 'module:QualName'")
    module_name, qualname = name.split(":")
    if not (_public(module_name) and _public(qualname)
            and module_name.split(".")[0] in ALLOWED_PACKAGES):
        raise WireError(f"refusing class {name}: only public dataclasses of {', '.join(ALLOWED_PACKAGES)} "
                        "are accepted")
    # Security: only sys.modules, never importlib: importing a module runs it (mmrl.__main__ is the CLI).
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split("."):  # plain lookups: no module __getattr__ or descriptor runs
        obj = getattr(obj, "__dict__", {}).get(part)
    if obj is None:
        why = "" if module_name in sys.modules else f" (module {module_name} is not loaded by this process)"
        raise WireError(f"unknown class {name}{why}")
    # Checked before anything is built: a dataclass, and the one of that name, not one reached
    # through another module's attribute.
    if not (isinstance(obj, type) and dataclasses.is_dataclass(obj)) or _class_name(obj) != name:
        raise WireError(f"refusing class {name}: not a dataclass defined there")
    return obj


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _public(dotted: str) -> bool:
    """Every part of a dotted name is an identifier not starting with "_" (so no __main__)."""
    return all(part.isidentifier() and not part.startswith("_") for part in dotted.split("."))


def _allowed(cls: type) -> bool:
    """What may be sent: what resolve_class accepts (defined in an allowed package, public)."""
    return (cls.__module__.split(".")[0] in ALLOWED_PACKAGES and _public(cls.__module__)
            and _public(cls.__qualname__))


def _b64(text: Any, what: str) -> bytes:
    if not isinstance(text, str):
        raise WireError(f"{what} must be a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise WireError(f"{what} is not valid base64") from None


def describe(value: Any) -> str:
    """What a decoded value is, for an error telling a client what it sent ("a string", "a dict")."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return f"a {_class_name(type(value))} dataclass"
    name = {str: "string", int: "integer", float: "number", bool: "boolean", list: "list", dict: "dict",
            tuple: "tuple", bytes: "bytes", type(None): "null"}.get(type(value), type(value).__name__)
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


# --------------------------------------------------------------------------- images


def _encode_image(im: Image.Image) -> dict:
    out = {"__t": "image", "mode": im.mode, "size": list(im.size)}
    if im.mode in PNG_MODES:
        buf = io.BytesIO()
        im.save(buf, format="PNG", compress_level=1)  # speed over size: these are small
        out["png"] = base64.b64encode(buf.getvalue()).decode("ascii")
    else:
        out["raw"] = base64.b64encode(im.tobytes()).decode("ascii")
    return out


def _decode_image(v: dict, pixels: list[int]) -> Image.Image:
    """The image, its size (from the message, checked against a PNG's own header) counted
    against `pixels` before any pixel buffer is made."""
    mode, (w, h) = v["mode"], v["size"]
    if not (isinstance(w, int) and isinstance(h, int) and w >= 0 and h >= 0 and w * h <= MAX_RAW_PIXELS):
        raise WireError(f"bad image size {v['size']!r}")
    if w * h > pixels[0]:
        raise WireError(f"the images of this message have more than {pixels[1]} pixels in all (the {w} x {h} "
                        "image is past that): send them in several messages")
    pixels[0] -= w * h
    try:
        if "png" not in v:
            raw, size = _b64(v["raw"], "raw"), _raw_size(mode, w, h)
            if len(raw) != size:  # before frombytes allocates the image: 2 bytes claimed 1 GiB of RGBA
                raise WireError(f"raw image data is {len(raw)} bytes, a {w} x {h} {mode} image is {size}")
            # an empty image from new(): Pillow 10.0 (the floor) refuses frombytes of one
            return Image.frombytes(mode, (w, h), raw) if w * h else Image.new(mode, (w, h))
        im = Image.open(io.BytesIO(_b64(v["png"], "png")), formats=["PNG"])  # no other decoder
        if im.size != (w, h):  # checked before the pixels are decoded
            raise WireError(f"image is {im.size}, its header says {(w, h)}")
        im.load()
    except (OSError, SyntaxError, Image.DecompressionBombError) as e:
        raise WireError(f"bad image: {e}") from None
    return im if im.mode == mode else im.convert(mode)


def _raw_size(mode: str, w: int, h: int) -> int:
    """The bytes of a w x h image of `mode` as tobytes() gives them, found without allocating
    it (a 1 x 1 image of the mode; an unknown mode is Pillow's ValueError)."""
    if mode == "1":  # a bit a pixel, each row padded to a byte
        return (w + 7) // 8 * h
    return len(Image.new(mode, (1, 1)).tobytes()) * w * h


# --------------------------------------------------------------------------- typed messages


def encode_requests(requests: Sequence[Request]) -> dict:
    return pack(list(requests))


REQUESTS_FORM = ('{"value": [{"__t": "dataclass", "cls": "mmrl.core.engine:Request", "fields": {"group": 0, '
                 '"prompt": "...", "n": 4}}], "tensors": null} (what encode_requests makes)')


def decode_requests(message: Any) -> list[Request]:
    if not isinstance(message, dict) or set(message) != {"value", "tensors"}:  # a client writing it by hand
        raise WireError(f"requests must be {REQUESTS_FORM}, got {describe(message)}")
    requests = unpack(message)
    if not isinstance(requests, list) or not all(isinstance(r, Request) for r in requests):
        raise WireError(f"expected a list of Request (mmrl.core.engine:Request), got {describe(requests)}: "
                        f"requests must be {REQUESTS_FORM}")
    for r in requests:  # what label() and the engines count on
        if not all(type(x) is int for x in (r.group, r.n, r.tag)) or r.n < 1:
            raise WireError("bad request: group, n and tag must be integers and n >= 1, "
                            f"got group={r.group!r}, n={r.n!r}, tag={r.tag!r}")
    return requests


def encode_batch(batch: RolloutBatch) -> dict:
    return pack(batch)


def decode_batch(message: Any) -> RolloutBatch:
    batch = unpack(message, max_pixels=float("inf"))  # a server's reply: a diffusion batch is many images
    if not isinstance(batch, RolloutBatch):
        raise WireError(f"expected a RolloutBatch, got {type(batch).__name__}")
    return batch


def encode_rollout(rollout: Any) -> dict:
    """A rollout config (pydantic model or dataclass) as plain JSON."""
    if hasattr(rollout, "model_dump"):
        return rollout.model_dump(mode="json")
    if dataclasses.is_dataclass(rollout):
        return dataclasses.asdict(rollout)
    raise WireError(f"cannot send a rollout config of type {type(rollout).__name__}")


def decode_rollout(data: Any, cls: type, base: Any = None) -> Any:
    """Rebuild a rollout config with the receiver's own class (which validates it). `base`: the
    served run's rollout config, whose values fill the keys `data` leaves out (a client that
    sends {"temperature": 0.5} gets the run's other settings, not the class defaults)."""
    if not isinstance(data, dict):
        raise WireError("the rollout config must be a JSON object")
    if base is not None:
        from mmrl.core.config import deep_merge

        data = deep_merge(encode_rollout(base), data)
    try:
        return cls.model_validate(data) if hasattr(cls, "model_validate") else cls(**data)
    except (TypeError, ValueError) as e:
        if callable(getattr(e, "errors", None)):  # pydantic's: each key, what is wrong, what was sent
            why = "; ".join(f"rollout.{'.'.join(map(str, err['loc']))}: {err['msg']} (got {err.get('input')!r})"
                            for err in e.errors())
        else:
            why = " ".join(str(e).split())
        raise WireError(f"invalid rollout config: {why}") from None


def encode_weights(weights: dict[str, Tensor]) -> bytes:
    """Weights (name -> tensor) as safetensors bytes."""
    return safetensors.torch.save({k: v.detach().cpu().contiguous() for k, v in weights.items()})


def decode_weights(data: bytes) -> dict[str, Tensor]:
    try:
        return safetensors.torch.load(data)
    except Exception as e:  # noqa: BLE001 -- any parse failure of client bytes is bad input
        raise WireError(f"the weights are not valid safetensors: {e}") from None


__all__ = [
    "ALLOWED_PACKAGES",
    "WireError",
    "decode_batch",
    "decode_requests",
    "decode_rollout",
    "decode_weights",
    "describe",
    "encode_batch",
    "encode_requests",
    "encode_rollout",
    "encode_weights",
    "pack",
    "resolve_class",
    "unpack",
]
