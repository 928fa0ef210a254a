"""Remote rollout engines: the wire format, the HTTP server, the client and a child-process server,
on the toy backend (tests/toy.py)."""

from __future__ import annotations

import base64
import collections
import io
import json
import os
import pickle
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from toy import ToyPolicy
from typer.testing import CliRunner

from mmrl.core import remote, serve, wire
from mmrl.core.batch import RolloutBatch
from mmrl.core.cli import BackendSpec, make_app
from mmrl.core.config import RolloutConfig
from mmrl.core.engine import EngineError, PolicyEngine, Request, load_named, trainable_weights
from mmrl.core.rewards import AtomScores, Sample
from mmrl.vlm.tasks.shapes_qa import QAItem

ROOT = Path(__file__).resolve().parents[1]
ROLLOUT = RolloutConfig(max_new_tokens=2)
REQUESTS = [Request(group=5, prompt=3, n=2), Request(group=9, prompt=7, n=2, tag=1)]


def images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    rgba = Image.fromarray(rng.integers(0, 256, (6, 5, 4), dtype=np.uint8), mode="RGBA")
    grey = Image.fromarray(rng.integers(0, 256, (4, 3), dtype=np.uint8), mode="L")
    deep = Image.frombytes("I;16", (3, 2), rng.integers(0, 65536, 6, dtype=np.uint16).tobytes())
    wide = Image.frombytes("I", (2, 2), np.array([-5, 0, 70000, 2**31 - 1], dtype=np.int32).tobytes())
    return [rgba, grey, deep, wide]  # "I" does not fit PNG: it goes raw


def same_image(a: Image.Image, b: Image.Image) -> bool:
    return a.mode == b.mode and a.size == b.size and a.tobytes() == b.tobytes()


def same_batch(a: RolloutBatch, b: RolloutBatch) -> bool:
    tensors = ("group_ids", "mask", "old_logp", "ref_logp", "advantages")
    return (all(_same(getattr(a, k), getattr(b, k)) for k in tensors)
            and a.samples == b.samples and a.policy_version == b.policy_version
            and a.data.keys() == b.data.keys() and all(_same(a.data[k], b.data[k]) for k in a.data))


def _same(x, y) -> bool:
    if x is None or y is None:
        return x is None and y is None
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def roundtrip(value):
    message = json.loads(json.dumps(wire.pack(value)))  # what actually crosses: JSON text
    return wire.unpack(message)


# --------------------------------------------------------------------------- wire


def test_requests_roundtrip_with_images_tensors_and_dataclasses():
    ims = images()
    item = QAItem(images=ims[:3], question="How many circles?", answer="2", meta={"kind": "count_shape"})
    prompt = {"item": item, "ids": torch.tensor([1, 2, 3]), "mixed": [None, 1.5, "x", (1, 2)],
              "by_int": {3: "three"}, "raw": ims[3], "blob": b"\x00\xff"}
    requests = [Request(group=0, prompt=prompt, n=2, prefix=torch.tensor([[True, False]]), tag=2),
                Request(group=1, prompt=4, n=1)]
    back = wire.decode_requests(json.loads(json.dumps(wire.encode_requests(requests))))

    assert [(r.group, r.n, r.tag) for r in back] == [(0, 2, 2), (1, 1, 0)]
    assert back[1].prompt == 4 and back[1].prefix is None
    got = back[0].prompt
    assert isinstance(got["item"], QAItem) and got["item"].question == item.question
    assert got["item"].meta == {"kind": "count_shape"} and got["item"].answer == "2"
    assert all(same_image(a, b) for a, b in zip(got["item"].images, ims[:3]))
    assert [im.mode for im in got["item"].images] == ["RGBA", "L", "I;16"]
    assert same_image(got["raw"], ims[3])
    assert got["mixed"] == [None, 1.5, "x", (1, 2)] and got["by_int"] == {3: "three"}
    assert got["blob"] == b"\x00\xff"
    assert _same(got["ids"], prompt["ids"]) and _same(back[0].prefix, requests[0].prefix)


def test_batch_roundtrip_is_exact_for_every_dtype():
    n = 3
    batch = RolloutBatch(
        group_ids=torch.tensor([4, 4, 7]),
        samples=[Sample(prompt=i, completion=[i, 11], meta={"answer": str(i)} if i else None) for i in range(n)],
        mask=torch.tensor([[True, False]] * n),
        old_logp=torch.randn(n, 2, dtype=torch.float64),
        advantages=torch.randn(n).bfloat16(),
        policy_version=12,
        data={"input_ids": torch.arange(n * 4).view(n, 4), "pixels": torch.rand(n, 1, 2, 2).half(),
              "stat/steps": torch.ones(n, dtype=torch.int8), "empty": torch.zeros(n, 0)},
    )
    back = wire.decode_batch(json.loads(json.dumps(wire.encode_batch(batch))))
    assert same_batch(back, batch) and back.scores is None

    batch.scores = AtomScores(["a", "b"], torch.rand(n, 2), torch.rand(n), errors=1,
                              failed=torch.tensor([[False, True], [False, False], [False, False]]))
    back = roundtrip(batch)
    assert back.scores.names == ["a", "b"] and back.scores.errors == 1
    assert all(_same(getattr(back.scores, k), getattr(batch.scores, k)) for k in ("values", "total", "failed"))


def test_weights_and_rollout_roundtrip():
    weights = trainable_weights(ToyPolicy(seed=0).model)
    weights["extra"] = torch.randn(3, 2).bfloat16()
    back = wire.decode_weights(wire.encode_weights(weights))
    assert back.keys() == weights.keys() and all(_same(back[k], weights[k]) for k in weights)

    rollout = RolloutConfig(max_new_tokens=5, temperature=0.7)
    assert wire.decode_rollout(json.loads(json.dumps(wire.encode_rollout(rollout))), RolloutConfig) == rollout
    with pytest.raises(wire.WireError, match="temperature"):
        wire.decode_rollout({"temperature": -1}, RolloutConfig)


@dataclass
class Outsider:  # defined in a test module, not in an allowed package
    x: int = 0


@pytest.mark.parametrize("cls, needle", [
    ("os:system", "refusing class os:system"),
    ("subprocess:Popen", "refusing"),
    ("builtins:eval", "refusing"),
    ("mmrl.core.engine:PolicyEngine", "not a dataclass"),  # allowed package, but not data
    ("mmrl.core.engine:torch.Tensor", "not a dataclass"),  # reached through a module attribute
    ("mmrl.core.wire:Request", "not a dataclass defined there"),  # a dataclass, imported from elsewhere
    ("mmrl.nowhere:Thing", "unknown class"),
    ("mmrl.core.engine.Request", "expected 'module:QualName'"),
    ("mmrl.core.engine:Request:x", "expected 'module:QualName'"),
    # a public dataclass in a module this process has loaded, outside the allowed packages
    (f"{Outsider.__module__}:Outsider", f"refusing class {Outsider.__module__}:Outsider"),
])
def test_decode_refuses_classes_outside_the_allow_list(cls, needle):
    message = {"value": {"__t": "dataclass", "cls": cls, "fields": {}}, "tensors": None}
    with pytest.raises(wire.WireError, match=needle):
        wire.unpack(message)


@pytest.mark.parametrize("cls", [
    "mmrl.__main__:Nothing",  # importing it runs the CLI: `mmrl serve` started a second server
    "dllm_rl.__main__:Nothing",
    "diffusion_rl.__main__:Nothing",
    "mmrl.core._private:Thing",
    "mmrl.core.pipeline:_Group",  # a dataclass, but private
])
def test_decode_refuses_main_and_private_names_without_importing_them(cls):
    message = {"value": {"__t": "dataclass", "cls": cls, "fields": {}}, "tensors": None}
    with pytest.raises(wire.WireError, match="refusing"):
        wire.unpack(message)
    assert not any(m.endswith(".__main__") for m in sys.modules)


def test_decode_never_imports_a_module(monkeypatch):
    # A dataclass of an allowed package, in a module this process has not imported: decoding
    # must not import it (importing runs code); the receiver's backend imports what it uses.
    monkeypatch.delitem(sys.modules, "mmrl.demo.compare", raising=False)
    message = {"value": {"__t": "dataclass", "cls": "mmrl.demo.compare:Shown",
                         "fields": {"label": "x", "output": 1, "atoms": {}, "total": None}}, "tensors": None}
    with pytest.raises(wire.WireError, match="unknown class mmrl.demo.compare:Shown"):
        wire.unpack(message)
    assert "mmrl.demo.compare" not in sys.modules


def test_an_unknown_class_of_a_loaded_module_is_named_without_the_not_loaded_note():
    with pytest.raises(wire.WireError) as err:
        wire.resolve_class("mmrl.core.engine:Nothing")  # mmrl.core.engine is loaded here
    assert str(err.value) == "unknown class mmrl.core.engine:Nothing"
    with pytest.raises(wire.WireError) as err:
        wire.resolve_class("mmrl.not_a_module:Thing")
    assert str(err.value) == ("unknown class mmrl.not_a_module:Thing "
                              "(module mmrl.not_a_module is not loaded by this process)")


def test_plain_dict_values_are_encoded_and_decoded_too():
    """The values of a str-keyed dict are values like any other: a tuple, bytes and a tensor inside."""
    back = roundtrip({"t": (1, 2), "b": b"\x01", "x": torch.tensor([1.5])})
    assert back["t"] == (1, 2) and back["b"] == b"\x01" and back["x"].tolist() == [1.5]
    message = wire.pack({"t": (1, 2)})
    assert message["value"] == {"t": {"__t": "tuple", "items": [1, 2]}}


def test_a_dict_with_a_tag_key_roundtrips_as_a_dict():
    """A str-keyed dict holding "__t" must not be read back as a tagged value."""
    for value in ({"__t": "tuple", "items": [1, 2]}, {"__t": "tensor", "key": "0"}, {1: "a", "b": (2,)}):
        assert wire.unpack(json.loads(json.dumps(wire.pack(value)))) == value


def test_init_false_fields_are_set_as_the_sender_had_them(monkeypatch):
    import types
    from dataclasses import field

    module = types.ModuleType("mmrl.wire_probe")

    @dataclass
    class Counted:
        x: int
        seen: int = field(default=0, init=False)

    Counted.__module__, Counted.__qualname__ = module.__name__, "Counted"
    module.Counted = Counted
    monkeypatch.setitem(sys.modules, module.__name__, module)
    sent = Counted(3)
    sent.seen = 7
    back = wire.unpack(json.loads(json.dumps(wire.pack(sent))))
    assert type(back) is Counted and (back.x, back.seen) == (3, 7)


def test_a_palette_image_keeps_its_palette():
    """"P" goes as PNG, which holds the palette; raw bytes would carry the indices only."""
    image = Image.new("P", (2, 1))
    image.putpalette([10, 20, 30, 200, 100, 50] + [0] * (3 * 254))
    image.putpixel((1, 0), 1)
    back = wire.unpack(json.loads(json.dumps(wire.pack(image))))
    assert same_image(back, image) and back.getpalette()[:6] == [10, 20, 30, 200, 100, 50]
    assert back.convert("RGB").getpixel((1, 0)) == (200, 100, 50)


def test_a_raw_image_past_the_pixel_bound_is_refused_before_it_is_built(monkeypatch):
    monkeypatch.setattr(wire, "MAX_RAW_PIXELS", 100)
    value = wire.pack(Image.new("F", (10, 10)))["value"]  # "F": raw bytes, not PNG
    assert wire.unpack({"value": value, "tensors": None}).size == (10, 10)  # at the bound
    big = wire.pack(Image.new("F", (11, 10)))["value"]
    with pytest.raises(wire.WireError, match=r"bad image size \[11, 10\]"):
        wire.unpack({"value": big, "tensors": None})


def test_a_png_image_comes_back_in_the_mode_its_message_names():
    value = wire.pack(Image.new("RGB", (4, 3), (200, 10, 10)))["value"]
    back = wire.unpack({"value": {**value, "mode": "L"}, "tensors": None})
    assert (back.mode, back.size) == ("L", (4, 3))


def test_class_lookup_runs_no_module_getattr(monkeypatch):
    """resolve_class reads module and class dicts only: a module's __getattr__ (code) never runs."""
    import types

    module, calls = types.ModuleType("mmrl.wire_lazy"), []

    def lazy(name):
        calls.append(name)
        raise AttributeError(name)

    module.__getattr__ = lazy
    monkeypatch.setitem(sys.modules, module.__name__, module)
    message = {"value": {"__t": "dataclass", "cls": "mmrl.wire_lazy:Thing", "fields": {}}, "tensors": None}
    with pytest.raises(wire.WireError, match="unknown class mmrl.wire_lazy:Thing"):
        wire.unpack(message)
    assert calls == []


def test_a_message_with_other_keys_or_requests_with_bool_counts_are_refused():
    with pytest.raises(wire.WireError, match="exactly the keys 'value' and 'tensors'"):
        wire.unpack({"value": 1, "tensors": None, "extra": 0})
    with pytest.raises(wire.WireError, match="must be integers"):
        wire.decode_requests(wire.pack([Request(group=0, prompt=1, n=True)]))
    with pytest.raises(wire.WireError, match="expected a RolloutBatch, got list"):
        wire.decode_batch(wire.pack([Request(group=0, prompt=1, n=1)]))


def test_views_of_one_tensor_travel_as_tensors_of_their_own():
    """safetensors refuses tensors that share storage: views (a batch's rows of one tensor) are sent."""
    t = torch.arange(6.0)
    back = wire.unpack(json.loads(json.dumps(wire.pack({"a": t[:3], "b": t[3:], "all": t}))))
    assert back["a"].tolist() == [0.0, 1.0, 2.0] and back["b"].tolist() == [3.0, 4.0, 5.0]
    assert torch.equal(back["all"], t)


def test_sender_refuses_what_the_receiver_would():
    from mmrl.core.pipeline import _Group

    with pytest.raises(wire.WireError, match="only public dataclasses"):
        wire.pack(_Group.__new__(_Group))


def test_a_batch_that_does_not_validate_is_a_wire_error():
    bad = {"__t": "dataclass", "cls": "mmrl.core.batch:RolloutBatch",
           "fields": {"group_ids": [0, 0], "samples": []}}  # a list, not a tensor: AttributeError inside
    with pytest.raises(wire.WireError, match="malformed 'dataclass' value: AttributeError"):
        wire.unpack({"value": bad, "tensors": None})
    with pytest.raises(wire.WireError, match="malformed 'dataclass' value"):
        wire.decode_batch({"value": {**bad, "fields": {"group_ids": 3, "samples": [1]}}, "tensors": None})


def test_encode_refuses_foreign_classes_and_bad_input_is_a_wire_error():
    with pytest.raises(wire.WireError, match="test_remote:Outsider"):
        wire.pack([Outsider()])
    with pytest.raises(wire.WireError, match="cannot send a value of type"):
        wire.pack({"f": lambda: 0})
    with pytest.raises(wire.WireError, match="no fields"):
        wire.unpack({"value": {"__t": "dataclass", "cls": "mmrl.core.engine:Request",
                               "fields": {"group": 0, "prompt": 1, "n": 1, "evil": 2}}, "tensors": None})
    with pytest.raises(wire.WireError, match="safetensors"):
        wire.unpack({"value": None, "tensors": "bm90IHNhZmV0ZW5zb3Jz"})
    with pytest.raises(wire.WireError, match="safetensors"):
        wire.decode_weights(pickle.dumps({"w": 1}))
    for image, needle in [({"size": [-4, -4], "raw": ""}, "bad image size"),
                          ({"size": [1, 1], "png": "aGVsbG8="}, "bad image"),  # not a PNG
                          ({"size": [9, 9], "png": wire.pack(images()[0])["value"]["png"]}, "header says")]:
        with pytest.raises(wire.WireError, match=needle):
            wire.unpack({"value": {"__t": "image", "mode": "RGBA", **image}, "tensors": None})
    with pytest.raises(wire.WireError, match="n >= 1"):
        wire.decode_requests(wire.pack([Request(group=0, prompt=1, n=0)]))


def test_no_pickle_is_involved(monkeypatch):
    for name in ("wire", "serve", "remote"):
        source = (ROOT / "mmrl" / "core" / f"{name}.py").read_text()
        uses = r"import pickle|pickle\.\w|Unpickler|(?<![\w.])torch\.load\("  # torch.load unpickles
        assert not re.search(uses, source)

    def refuse(*args, **kwargs):
        raise AssertionError("pickle was used")

    for attr in ("loads", "load", "Unpickler", "dumps", "dump", "Pickler"):
        monkeypatch.setattr(pickle, attr, refuse)
    batch = ToyPolicy(seed=0).generate([1, 2], 2, ROLLOUT, torch.Generator().manual_seed(0))
    assert same_batch(roundtrip(batch), batch)
    assert wire.decode_weights(wire.encode_weights({"w": torch.ones(2)}))["w"].sum() == 2


def test_png_modes_travel_as_png_and_the_others_as_raw_pixels():
    for mode, kind in [("L", "png"), ("RGB", "png"), ("I;16", "png"), ("I", "raw"), ("F", "raw"),
                       ("CMYK", "raw"), ("YCbCr", "raw")]:
        image = Image.new(mode, (2, 1))
        value = wire.pack(image)["value"]
        assert kind in value and value["size"] == [2, 1] and value["mode"] == mode, mode
        assert same_image(wire.unpack({"value": value, "tensors": None}), image)


def test_an_image_size_that_is_not_two_integers_is_refused():
    png = wire.pack(Image.new("L", (2, 1)))["value"]
    assert wire.unpack({"value": png, "tensors": None}).size == (2, 1)
    for size in ([2.0, 1], [2, "1"], [2, None]):
        with pytest.raises(wire.WireError, match="bad image size"):
            wire.unpack({"value": {**png, "size": size}, "tensors": None})


def test_an_empty_raw_image_travels():
    """A size of 0 is a size (only a negative one is refused): an "F" image 0 wide, 3 high."""
    back = wire.unpack(json.loads(json.dumps(wire.pack(Image.new("F", (0, 3))))))
    assert (back.mode, back.size, back.tobytes()) == ("F", (0, 3), b"")


def test_the_raw_pixel_bound_is_two_to_the_28():
    assert wire.MAX_RAW_PIXELS == 2**28
    # 16384 x 16385 = 2**28 + 16384 pixels: refused on its header, with no pixel buffer made
    big = {"__t": "image", "mode": "L", "size": [16384, 16385], "raw": ""}
    with pytest.raises(wire.WireError, match=r"bad image size \[16384, 16385\]"):
        wire.unpack({"value": big, "tensors": None})


def test_values_nested_past_the_recursion_limit_are_wire_errors():
    loop: list = []
    loop.append(loop)  # refers to itself
    with pytest.raises(wire.WireError, match="nested too deeply"):
        wire.pack(loop)
    deep: list = [1]
    for _ in range(sys.getrecursionlimit() + 10):
        deep = [deep]
    with pytest.raises(wire.WireError, match="nested too deeply"):
        wire.unpack({"value": deep, "tensors": None})


def test_tagged_values_nested_past_the_recursion_limit_are_too_deep_not_malformed():
    """The recursion inside a tagged value (a tuple in a tuple ...) reaches unpack as
    "nested too deeply", not as a malformed tuple."""
    deep: dict | int = 1
    for _ in range(sys.getrecursionlimit() + 10):
        deep = {"__t": "tuple", "items": [deep]}
    with pytest.raises(wire.WireError, match="message is nested too deeply"):
        wire.unpack({"value": deep, "tensors": None})


def test_a_message_without_tensors_carries_no_blob():
    assert wire.pack([1, "a", (2,)]) == {"value": [1, "a", {"__t": "tuple", "items": [2]}], "tensors": None}
    assert wire.pack({"t": torch.ones(1)})["tensors"] is not None


def test_a_tensor_that_is_not_contiguous_travels_as_its_values():
    t = torch.arange(6.0).view(2, 3).t()  # a transposed view: strides (1, 3)
    back = wire.unpack(json.loads(json.dumps(wire.pack({"t": t}))))
    assert back["t"].tolist() == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]


def test_a_dataclass_type_itself_is_not_sent():
    """The class Request, not an instance of it: a value of type `type`, refused as such."""
    with pytest.raises(wire.WireError, match="cannot send a value of type builtins:type"):
        wire.pack([Request])


def test_a_tensor_blob_that_is_empty_or_not_a_string_is_refused():
    for blob, needle in [("", "not valid safetensors"), ([], "must be a base64 string"),
                         (0, "must be a base64 string"), ("a", "not valid base64")]:
        with pytest.raises(wire.WireError, match=needle):
            wire.unpack({"value": 1, "tensors": blob})


def test_sets_are_not_sent_as_tuples():
    with pytest.raises(wire.WireError, match="cannot send a value of type builtins:set"):
        wire.pack({"s": {1, 2}})


def test_an_unknown_tag_is_refused():
    with pytest.raises(wire.WireError, match="unknown value tag 'set'"):
        wire.unpack({"value": {"__t": "set", "items": [1]}, "tensors": None})
    with pytest.raises(wire.WireError, match="unexpected JSON value of type bytes"):
        wire.unpack({"value": [b"x"], "tensors": None})


def test_a_package_whose_name_only_starts_like_an_allowed_one_is_refused(monkeypatch):
    import types

    module = types.ModuleType("mmrl_extra")

    @dataclass
    class Thing:
        x: int = 0

    Thing.__module__, Thing.__qualname__ = module.__name__, "Thing"
    module.Thing = Thing
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(wire.WireError, match="refusing class mmrl_extra:Thing"):
        wire.resolve_class("mmrl_extra:Thing")
    with pytest.raises(wire.WireError, match="only public dataclasses"):
        wire.pack(Thing())


def test_a_dataclass_defined_inside_a_function_is_not_sent():
    @dataclass
    class Local:
        x: int = 0

    Local.__module__ = "mmrl.core.engine"  # an allowed package, but its qualname is "...<locals>.Local"
    with pytest.raises(wire.WireError, match="only public dataclasses"):
        wire.pack(Local())
    with pytest.raises(wire.WireError, match="refusing class mmrl.core.engine:Request "):
        wire.resolve_class("mmrl.core.engine:Request ")
    Local.__module__, Local.__qualname__ = "mmrl.core._hidden", "Local"  # a private module
    with pytest.raises(wire.WireError, match="cannot send a mmrl.core._hidden:Local"):
        wire.pack(Local())


def test_base64_with_characters_outside_its_alphabet_is_refused():
    assert wire.unpack({"value": {"__t": "bytes", "b64": "AAA="}, "tensors": None}) == b"\x00\x00"
    for text in ("AA!A=", "AA A=", "AAA=\n"):
        with pytest.raises(wire.WireError, match="bytes is not valid base64"):
            wire.unpack({"value": {"__t": "bytes", "b64": text}, "tensors": None})


def test_only_png_bytes_are_read_as_an_image():
    buf = io.BytesIO()
    Image.new("L", (2, 1)).save(buf, format="BMP")  # an image, but not a PNG
    bmp = {"__t": "image", "mode": "L", "size": [2, 1], "png": base64.b64encode(buf.getvalue()).decode()}
    with pytest.raises(wire.WireError, match="bad image"):
        wire.unpack({"value": bmp, "tensors": None})


def test_requests_must_be_requests_with_integer_tags():
    for value in ([1], [Request(group=0, prompt=1, n=1), "x"], {"r": Request(group=0, prompt=1, n=1)}):
        with pytest.raises(wire.WireError, match="expected a list of Request"):
            wire.decode_requests(wire.pack(value))
    for bad in (Request(group=0, prompt=1, n=1, tag="1"), Request(group=1.0, prompt=1, n=1)):
        with pytest.raises(wire.WireError, match="must be integers"):
            wire.decode_requests(wire.pack([bad]))


def test_a_rollout_config_travels_as_json_values():
    import pydantic

    class WithPath(pydantic.BaseModel):
        out: Path = Path("a/b")
        sizes: tuple[int, int] = (1, 2)

    assert wire.encode_rollout(WithPath()) == {"out": "a/b", "sizes": [1, 2]}
    assert wire.decode_rollout({"out": "c", "sizes": [3, 4]}, WithPath) == WithPath(out=Path("c"), sizes=(3, 4))

    @dataclass
    class Plain:
        steps: int = 2

    assert wire.encode_rollout(Plain(5)) == {"steps": 5} and wire.decode_rollout({"steps": 5}, Plain) == Plain(5)
    with pytest.raises(wire.WireError, match="invalid rollout config"):
        wire.decode_rollout({"nope": 1}, Plain)
    with pytest.raises(wire.WireError, match="cannot send a rollout config of type dict"):
        wire.encode_rollout({"steps": 5})
    with pytest.raises(wire.WireError, match="must be a JSON object"):
        wire.decode_rollout([["steps", 5]], Plain)


def test_weights_that_are_not_contiguous_travel_as_their_values():
    w = torch.arange(6.0).view(2, 3).t()  # a transposed view
    back = wire.decode_weights(wire.encode_weights({"w": w}))
    assert back["w"].tolist() == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]


# --------------------------------------------------------------------------- server + client


@pytest.fixture
def served():
    """A ToyPolicy engine served in a thread; yields (server, client)."""
    server = serve.serve_in_thread(serve.ServedPolicyEngine(ToyPolicy(seed=0)), RolloutConfig)
    yield server, remote.RemoteEngine(server.url, timeout=5)
    server.close()


def test_generate_matches_the_local_engine(served):
    _, client = served
    local = PolicyEngine(ToyPolicy(seed=0), own_weights=False)
    got = client.generate(REQUESTS, ROLLOUT, seed=3)
    want = local.generate(REQUESTS, ROLLOUT, seed=3)
    assert same_batch(got, want)
    assert got.group_ids.tolist() == [5, 5, 9, 9] and got.data["request_tag"].tolist() == [0, 0, 1, 1]
    assert client.health() == {"name": "served", "version": 0, "busy": False, "weights": None}


def test_publish_changes_the_server_weights(served):
    _, client = served
    before = client.generate(REQUESTS, ROLLOUT, seed=3)
    other = ToyPolicy(seed=1)
    client.publish(trainable_weights(other.model), version=7)
    after = client.generate(REQUESTS, ROLLOUT, seed=3)
    want = PolicyEngine(other, own_weights=False).generate(REQUESTS, ROLLOUT, seed=3)
    assert torch.equal(after.old_logp, want.old_logp) and after.samples == want.samples
    assert not torch.equal(after.old_logp, before.old_logp)
    assert client.health()["version"] == 7

    with pytest.raises(EngineError, match=r"HTTP 400: bad request to /weights: .*unknown \['nope'\]\. This server "
                                          r"serves toy\.ToyPolicy \(LlamaForCausalLM\): serve the trainer's backend"):
        client.publish({"nope": torch.zeros(1)}, version=8)
    assert client.health()["version"] == 7


def test_weights_that_do_not_fit_change_nothing(served):
    server, client = served
    model = server.engine.policy.model
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    first, second = list(before)[:2]
    # The first tensor fits, the second does not: nothing may be copied (the first used to be).
    bad = {first: torch.full_like(before[first], 7.0), second: torch.zeros(3, 3, 3)}
    with pytest.raises(EngineError, match=rf"HTTP 400: .*{re.escape(second)}: \(3, 3, 3\) float32, "
                                          r"the model's is \(32, 32\) float32"):
        client.publish(bad, version=5)
    assert all(torch.equal(p, before[k]) for k, p in model.named_parameters())
    assert client.health()["version"] == 0
    # A row copy_ would broadcast over the whole matrix, and bool weights for a float parameter.
    for value in (torch.ones(1, 32), torch.ones(12, 32, dtype=torch.bool)):
        with pytest.raises(EngineError, match=f"do not fit the engine's model \\(1 of 1\\): {re.escape(first)}"):
            load_named(model, {first: value})
    assert torch.equal(model.get_parameter(first), before[first])
    load_named(model, {first: torch.ones(12, 32, dtype=torch.bfloat16)})  # another float dtype is cast
    assert model.get_parameter(first).dtype == torch.float32 and bool((model.get_parameter(first) == 1).all())


def test_trainable_weights_are_the_detached_parameters_that_train():
    model = torch.nn.Linear(2, 3)
    model.bias.requires_grad_(False)  # frozen: not published
    weights = trainable_weights(model)
    assert list(weights) == ["weight"]
    assert not weights["weight"].requires_grad and torch.equal(weights["weight"], model.weight.detach())


def test_unknown_weight_names_are_listed_up_to_three():
    model = torch.nn.Linear(2, 3)
    with pytest.raises(EngineError) as err:
        load_named(model, {"a": torch.zeros(1), "b": torch.zeros(1), "weight": torch.zeros(3, 2),
                           "c": torch.zeros(1), "d": torch.zeros(1)})
    assert str(err.value) == "published weights do not fit the engine's model: unknown ['a', 'b', 'c']"
    # by name, whatever order they came in (safetensors decodes them in a hash map's order, which
    # changed the three named from one process to the next)
    with pytest.raises(EngineError) as err:
        load_named(model, {"d": torch.zeros(1), "c": torch.zeros(1), "b": torch.zeros(1), "a": torch.zeros(1)})
    assert str(err.value) == "published weights do not fit the engine's model: unknown ['a', 'b', 'c']"


def test_weights_that_do_not_fit_are_listed_up_to_three():
    model = torch.nn.Module()
    for name in "abcd":
        model.register_parameter(name, torch.nn.Parameter(torch.zeros(2)))
    with pytest.raises(EngineError) as err:
        load_named(model, {name: torch.zeros(3) for name in "abcd"})
    assert str(err.value) == ("published weights do not fit the engine's model (4 of 4): a: (3,) float32, the model's "
                              "is (2,) float32; b: (3,) float32, the model's is (2,) float32; c: (3,) float32, the "
                              "model's is (2,) float32")


def test_weights_of_the_same_size_but_another_shape_do_not_fit():
    """(3, 2) for a (2, 3) parameter: as many numbers, but not the parameter's shape; nothing is copied."""
    model = torch.nn.Module()
    model.a, model.b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, 3))
    with pytest.raises(EngineError, match=r"\(1 of 2\): b: \(3, 2\) float32, the model's is \(2, 3\) float32$"):
        load_named(model, {"a": torch.ones(2), "b": torch.ones(3, 2)})
    assert model.a.tolist() == [0.0, 0.0]


def test_weights_of_another_kind_of_number_do_not_fit_a_complex_parameter():
    """Integer weights for a complex parameter are refused like complex ones for a real parameter:
    neither is a float of another precision (copy_ would cast them, changing the model)."""
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.full((2,), 1 + 1j, dtype=torch.complex64))
    for value in (torch.ones(2, dtype=torch.int64), torch.ones(2, dtype=torch.float32)):
        with pytest.raises(EngineError, match=r"do not fit the engine's model \(1 of 1\): w: \(2,\)"):
            load_named(model, {"w": value})
    real = ToyPolicy(seed=0).model
    name, param = next(iter(real.named_parameters()))
    with pytest.raises(EngineError, match=rf"{re.escape(name)}: .* complex64, the model's is .* float32"):
        load_named(real, {name: torch.full(param.shape, 2 + 1j, dtype=torch.complex64)})
    assert torch.equal(model.w.detach(), torch.full((2,), 1 + 1j, dtype=torch.complex64))


def test_a_reply_that_does_not_decode_is_an_engine_error(served, monkeypatch):
    # The server's reply names a batch whose group_ids is a JSON list: the client must raise
    # EngineError (the scheduler drops the server), not the AttributeError that stopped the run.
    _, client = served
    bad = {"value": {"__t": "dataclass", "cls": "mmrl.core.batch:RolloutBatch",
                     "fields": {"group_ids": [0, 0], "samples": []}}, "tensors": None}
    monkeypatch.setattr(wire, "encode_batch", lambda batch: bad)  # what the server sends
    with pytest.raises(EngineError, match=r"bad reply from http://127\.0\.0\.1:\d+/generate: .*AttributeError"):
        client.generate(REQUESTS, ROLLOUT, seed=3)


def test_the_url_loses_its_trailing_slash_and_the_name_defaults_to_host_and_port():
    engine = remote.RemoteEngine("http://10.1.2.3:8401/", timeout=1)
    assert (engine.url, engine.name) == ("http://10.1.2.3:8401", "10.1.2.3:8401")
    assert remote.RemoteEngine("http://10.1.2.3:8401", timeout=1, name="gpu-3").name == "gpu-3"


def test_the_client_sends_a_json_integer_seed_and_labels_the_reply_itself(monkeypatch):
    """A numpy seed goes as a plain integer; the reply's rows take the requests' groups and tags
    whatever the server put there."""
    client = remote.RemoteEngine("http://127.0.0.1:9", timeout=1)
    reply = ToyPolicy(seed=0).generate([3, 7], 2, ROLLOUT, torch.Generator().manual_seed(0))  # group_ids 0,0,1,1
    sent = []

    def call(path, body=None, content_type=None, headers=None):
        sent.append((path, json.loads(body)))
        return json.dumps(wire.encode_batch(reply)).encode()

    monkeypatch.setattr(client, "_call", call)
    batch = client.generate(REQUESTS, ROLLOUT, seed=np.int64(3))
    assert sent[0][0] == "/generate" and type(sent[0][1]["seed"]) is int and sent[0][1]["seed"] == 3
    assert batch.group_ids.tolist() == [5, 5, 9, 9] and batch.data["request_tag"].tolist() == [0, 0, 1, 1]


def http_error(body: bytes) -> urllib.error.HTTPError:
    return urllib.error.HTTPError("http://x/generate", 400, "Bad Request", {}, io.BytesIO(body))


def test_error_text_reads_mmrl_vllm_and_fastapi_error_bodies():
    assert remote._error_text(http_error(b'{"error": "bad seed"}')) == "bad seed"
    assert remote._error_text(http_error(b'{"error": {"message": "too long", "code": 400}}')) == "too long"
    assert remote._error_text(http_error(b'{"message": "no model"}')) == "no model"
    assert remote._error_text(http_error(b'{"detail": "Not Found"}')) == "Not Found"
    assert remote._error_text(http_error(b"x" * 600)) == "x" * 500  # not JSON: its start
    assert remote._error_text(http_error(b"")) == "Bad Request"


def test_a_health_reply_that_is_not_json_is_an_engine_error(monkeypatch):
    client = remote.RemoteEngine("http://127.0.0.1:9", timeout=1, name="h")
    monkeypatch.setattr(client, "_call", lambda path, **kw: b"<html>proxy</html>")
    with pytest.raises(EngineError, match=r"engine h: bad reply from http://127\.0\.0\.1:9/health: "):
        client.health()


def test_closing_an_engine_stops_the_server_process_it_owns():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        remote.RemoteEngine("http://127.0.0.1:9", timeout=1, process=proc).close()
        assert proc.poll() is not None  # killed and reaped
    finally:
        proc.kill()
        proc.wait()


class Failing:
    name = "failing"

    def __init__(self):
        self.release = threading.Event()

    def generate(self, requests, rollout, seed):
        if seed == 1:
            self.release.wait(10)  # hangs until the test lets go
        raise RuntimeError("CUDA out of memory (simulated)")

    def publish(self, weights, version):
        pass

    def close(self):
        pass


def test_engine_errors_timeouts_and_bad_input_become_engine_errors():
    engine = Failing()
    server = serve.serve_in_thread(engine, RolloutConfig)
    try:
        client = remote.RemoteEngine(server.url, timeout=0.5)
        with pytest.raises(EngineError, match=r"HTTP 500: engine failing failed in /generate: "
                                              r"RuntimeError: CUDA out of memory \(simulated\)"):
            client.generate(REQUESTS, ROLLOUT, seed=0)

        t0 = time.monotonic()
        with pytest.raises(EngineError, match=r"no answer from http://127\.0\.0\.1:\d+/generate within 0\.5 s"):
            client.generate(REQUESTS, ROLLOUT, seed=1)
        assert time.monotonic() - t0 < 2.0
        assert client.health()["busy"] is True  # the hung call still holds the engine
        engine.release.set()

        with pytest.raises(EngineError, match="HTTP 400: .*refusing class os:system"):
            client._call("/generate", json.dumps({"requests": {"value": {"__t": "dataclass", "cls": "os:system",
                                                                         "fields": {}}, "tensors": None},
                                                  "rollout": {}, "seed": 0}).encode())
        with pytest.raises(EngineError, match="HTTP 400: body of /generate is not valid JSON"):
            client._call("/generate", b"{not json")
        with pytest.raises(EngineError, match="HTTP 400: .*X-MMRL-Version"):
            client._call("/weights", wire.encode_weights({"w": torch.ones(1)}))
        with pytest.raises(EngineError, match="HTTP 404"):
            client._call("/nope")
        server.max_request_bytes = 10
        with pytest.raises(EngineError, match="over this server's limit of 10"):
            client.generate(REQUESTS, ROLLOUT, seed=0)
    finally:
        engine.release.set()
        server.close()
    with pytest.raises(EngineError, match="cannot reach http://127.0.0.1"):  # closed port
        client.generate(REQUESTS, ROLLOUT, seed=0)


def test_a_client_that_hangs_up_during_a_generation_costs_the_server_no_traceback(capsys, caplog):
    # its timeout ran out: the reply then failed with BrokenPipeError, logged as the engine's
    # failure, and the 500 sent in its place failed too, with a traceback from the server loop
    class Slow(ToyPolicy):
        def generate(self, *args, **kwargs):
            time.sleep(0.4)
            return super().generate(*args, **kwargs)

    server = serve.serve_in_thread(serve.ServedPolicyEngine(Slow()), RolloutConfig)
    try:
        with pytest.raises(EngineError, match="within 0.1 s"):
            remote.RemoteEngine(server.url, timeout=0.1).generate(REQUESTS, ROLLOUT, seed=0)
        deadline = time.monotonic() + 5
        while server.lock.locked() and time.monotonic() < deadline:
            time.sleep(0.02)  # the engine finishes, then tries to answer
        time.sleep(0.1)
        assert len(remote.RemoteEngine(server.url, timeout=5).generate(REQUESTS, ROLLOUT, seed=0)) == 4
    finally:
        server.close()
    assert "Traceback" not in capsys.readouterr().err
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_a_client_that_stops_sending_is_dropped():
    server = serve.serve_in_thread(serve.ServedPolicyEngine(ToyPolicy(seed=0)), RolloutConfig, read_timeout=0.3)
    host, port = server.server_address[:2]
    try:
        # A body that stops after 10 of its 100 bytes: 408, then the connection is closed.
        # Headers that stop midway: the connection is closed. Either used to hold a thread forever.
        for sent in (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"requests",
                     b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Le"):
            t0 = time.monotonic()
            with socket.create_connection((host, port), timeout=5) as sock:
                sock.sendall(sent)
                reply = b""
                while chunk := sock.recv(65536):  # until the server closes (socket.timeout after 5 s)
                    reply += chunk
            assert time.monotonic() - t0 < 3.0
            if b"Content-Length: 100" in sent:
                assert reply.startswith(b"HTTP/1.0 408 ") and b"stopped arriving: nothing for 0.3 s" in reply
            else:
                assert reply == b""
        assert remote.RemoteEngine(server.url, timeout=5).health()["busy"] is False  # still serving
    finally:
        server.close()
    with pytest.raises(ValueError, match="read_timeout must be > 0"):
        serve.EngineServer(Failing(), RolloutConfig, read_timeout=0)


def exchange(server, head: bytes, body: bytes = b"") -> tuple[int, bytes, dict]:
    """(status, raw headers, JSON reply) of one request sent as raw bytes (HTTP/1.0: the server closes)."""
    with socket.create_connection(server.server_address[:2], timeout=5) as sock:
        sock.sendall(head + b"\r\n\r\n" + body)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    headers, _, data = reply.partition(b"\r\n\r\n")
    return int(headers.split(b" ")[1]), headers, json.loads(data)


def test_body_limits_length_header_and_request_shape_are_checked():
    engine = serve.ServedPolicyEngine(ToyPolicy(seed=0))
    server = serve.serve_in_thread(engine, RolloutConfig, max_request_bytes=10, max_weights_bytes=30,
                                  read_timeout=1.0)
    try:
        body = json.dumps({"requests": wire.encode_requests(REQUESTS[:1]), "rollout": {}, "seed": 0}).encode()
        n = server.max_request_bytes = len(body)  # exactly at the limit: served
        status, _, reply = exchange(server, b"POST /generate HTTP/1.0\r\nContent-Length: %d" % n, body)
        assert status == 200 and reply["value"]["cls"] == "mmrl.core.batch:RolloutBatch"
        status, _, reply = exchange(server, b"POST /generate HTTP/1.0\r\nContent-Length: %d" % (n + 1), body + b" ")
        assert (status, reply["error"]) == (413, f"body of {n + 1} bytes is over this server's limit of {n}")
        # /weights has its own limit
        status, _, reply = exchange(server, b"POST /weights HTTP/1.0\r\nX-MMRL-Version: 1\r\nContent-Length: 31",
                                    b"x" * 31)
        assert (status, reply["error"]) == (413, "body of 31 bytes is over this server's limit of 30")
        status, _, reply = exchange(server, b"POST /weights HTTP/1.0\r\nX-MMRL-Version: 1\r\nContent-Length: 30",
                                    b"x" * 30)
        assert status == 400 and "not valid safetensors" in reply["error"]
        for head in (b"POST /generate HTTP/1.0", b"POST /generate HTTP/1.0\r\nContent-Length: -1",
                     b"POST /generate HTTP/1.0\r\nContent-Length: 1e1"):
            status, _, reply = exchange(server, head)
            assert (status, reply["error"]) == (411, "a Content-Length header is required"), head

        def generate(obj) -> tuple[int, dict]:
            data = json.dumps(obj).encode()
            status, _, reply = exchange(server, b"POST /generate HTTP/1.0\r\nContent-Length: %d" % len(data), data)
            return status, reply

        server.max_request_bytes = 1 << 20
        good = {"requests": wire.encode_requests(REQUESTS), "rollout": ROLLOUT.model_dump(), "seed": 3}
        assert generate(good)[0] == 200
        assert generate({**good, "extra": 1}) == (400, {"error": "body of /generate must be an object "
                                                                 "with keys requests, rollout, seed"})
        assert generate([good])[0] == 400
        for seed in (True, 1.0, "3", None):
            assert generate({**good, "seed": seed}) == (400, {"error": f"seed must be an integer, got {seed!r}"})
        deep = "[" * 100_000 + "]" * 100_000  # deeper than the JSON decoder can recurse
        status, _, reply = exchange(server, b"POST /generate HTTP/1.0\r\nContent-Length: 200000", deep.encode())
        assert status == 400 and reply["error"].startswith("body of /generate is not valid JSON")
    finally:
        server.close()


def test_health_reports_the_engine_version_and_publish_sets_it():
    engine = serve.ServedPolicyEngine(ToyPolicy(seed=0), name="toy-7")
    engine.version = 3
    server = serve.serve_in_thread(engine, RolloutConfig)
    try:
        client = remote.RemoteEngine(server.url, timeout=5)
        assert client.health() == {"name": "toy-7", "version": 3, "busy": False, "weights": None}
        other = ToyPolicy(seed=1)
        client.publish(trainable_weights(other.model), version=9)
        assert engine.version == 9 and client.health()["version"] == 9
        assert client.health()["weights"] == client.published_tag == f"{client._client}/9"  # whose weights
        assert all(torch.equal(p, q) for p, q in zip(engine.policy.model.parameters(), other.model.parameters()))
    finally:
        server.close()


def test_a_server_that_restarted_or_took_another_trainers_weights_refuses_to_sample_with_them():
    # both used to answer with samples of other weights than the trainer's, without a word: a
    # restarted server with those it started with, a shared one with the other trainer's
    server = serve.serve_in_thread(serve.ServedPolicyEngine(ToyPolicy(seed=0)), RolloutConfig)
    port = server.server_address[1]
    mine, theirs = remote.RemoteEngine(server.url, timeout=5), remote.RemoteEngine(server.url, timeout=5)
    try:
        mine.publish(trainable_weights(ToyPolicy(seed=1).model), version=1)
        want = PolicyEngine(ToyPolicy(seed=1), own_weights=False).generate(REQUESTS, ROLLOUT, seed=3)
        assert mine.generate(REQUESTS, ROLLOUT, seed=3).samples == want.samples
        theirs.publish(trainable_weights(ToyPolicy(seed=2).model), version=1)  # the same version, other weights
        with pytest.raises(EngineError, match=rf"answered HTTP 409: this server would sample with other weights than "
                                              rf"the client's: it holds version 1 of client {theirs._client}, published "
                                              rf"after this client's version 1 of client {mine._client}: another "
                                              r"trainer .* a server serves one trainer, start one for each"):
            mine.generate(REQUESTS, ROLLOUT, seed=3)
        assert len(theirs.generate(REQUESTS, ROLLOUT, seed=3)) == 4  # the latest to publish samples on
    finally:
        server.close()
    restarted = serve.serve_in_thread(serve.ServedPolicyEngine(ToyPolicy(seed=0)), RolloutConfig, port=port)
    try:
        with pytest.raises(EngineError, match=r"HTTP 409: .*it holds the weights it started with, not version 1 of "
                                              rf"client {mine._client} that this client published: it restarted since"):
            mine.generate(REQUESTS, ROLLOUT, seed=3)
        fresh = remote.RemoteEngine(restarted.url, timeout=5)  # a client that never published: no check
        assert len(fresh.generate(REQUESTS, ROLLOUT, seed=3)) == 4
        mine.publish(trainable_weights(ToyPolicy(seed=1).model), version=2)  # publishing again makes it ours
        assert mine.generate(REQUESTS, ROLLOUT, seed=3).samples == want.samples
    finally:
        restarted.close()


def test_serve_calls_ready_with_the_url_it_bound(monkeypatch):
    urls = []
    monkeypatch.setattr(serve.EngineServer, "serve_forever", lambda self, *a: urls.append(self.url))
    serve.serve(Failing(), RolloutConfig, port=0, ready=urls.append)
    assert len(urls) == 2 and urls[0] == urls[1] and re.fullmatch(r"http://127\.0\.0\.1:\d+", urls[0])


def test_build_policy_loads_the_checkpoint_it_is_given(monkeypatch):
    from mmrl.core import cli

    loaded = []
    monkeypatch.setattr(cli, "load_checkpoint", lambda policy, path: loaded.append((policy, path)))
    policy, cfg = serve.build_policy("toy", {"seed": 3}, checkpoint="runs/a")
    assert isinstance(policy, ToyPolicy) and cfg.seed == 3 and loaded == [(policy, "runs/a")]
    serve.build_policy("toy", {})
    assert len(loaded) == 1  # no checkpoint: nothing loaded


# --------------------------------------------------------------------------- child process


def test_spawned_server_serves_and_its_death_is_an_engine_error():
    proc, url = remote.spawn_server("tests.toy", {"seed": 0, "rollout": {"max_new_tokens": 2}}, cwd=ROOT, timeout=60)
    try:
        assert url.startswith("http://127.0.0.1:")
        client = remote.RemoteEngine(url, timeout=30, token=proc.mmrl_token)  # spawn_server's random one
        with pytest.raises(remote.HTTPStatusError, match="HTTP 401"):  # anyone else on the machine
            remote.RemoteEngine(url, timeout=30, token="").health()
        got = client.generate(REQUESTS, ROLLOUT, seed=3)
        want = PolicyEngine(ToyPolicy(seed=0), own_weights=False).generate(REQUESTS, ROLLOUT, seed=3)
        assert got.samples == want.samples  # the same tiny model, built from the same seed
        torch.testing.assert_close(got.old_logp, want.old_logp)
        # a scheduler's SIGTERM to every process of the job leaves the engine to its trainer,
        # which finishes its step on it (mmrl.core.stop) and then kills it
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert proc.poll() is None and client.generate(REQUESTS, ROLLOUT, seed=3).samples == want.samples
        # its parent gone without killing it (SIGKILL, OOM: its end of the stdin pipe closes), it
        # exits by itself (it stayed, an orphan holding its memory and GPU)
        proc.stdin.close()
        assert proc.wait(timeout=10) == 0
        assert "exiting: stdin closed: the process that started this server is gone" in "".join(proc.stderr_tail)
    finally:
        proc.kill()
        proc.wait()
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=f"cannot reach {url}/generate"):
        client.generate(REQUESTS, ROLLOUT, seed=3)
    assert time.monotonic() - t0 < 2.0


def test_a_server_whose_starter_is_gone_exits_even_with_no_one_to_read_its_stderr(monkeypatch):
    # a trainer killed outright (SIGKILL, OOM) left its spawned server running for good; and once
    # the watcher was there, saying why on a stderr pipe with no reader raised BrokenPipeError and
    # ended the watcher instead of the process
    class Broken:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        flush = write

    exits = []
    monkeypatch.setattr(serve.os, "_exit", exits.append)
    monkeypatch.setattr(serve.sys, "stderr", Broken())
    read, write = os.pipe()
    try:
        watcher = serve.exit_when_closed(read, "stdin closed")
        time.sleep(0.05)
        assert exits == [] and watcher.is_alive()  # waits while the other end is open
        os.close(write)
        watcher.join(5)
        assert exits == [0]
    finally:
        os.close(read)


def test_spawn_server_passes_the_checkpoint_and_removes_its_config_file(monkeypatch):
    """The command line the child gets (its config file, --checkpoint, port 0), and the config
    file gone once the child printed its URL; a stand-in child that only prints that line."""
    seen = {}
    real_popen = subprocess.Popen

    def popen(cmd, **kwargs):
        seen["cmd"], seen["env"] = cmd, kwargs["env"]
        seen["config"] = json.loads(Path(cmd[cmd.index("--config-json") + 1]).read_text())
        return real_popen([sys.executable, "-c", f"print({serve.READY + 'http://127.0.0.1:5'!r})"], **kwargs)

    monkeypatch.setattr(remote.subprocess, "Popen", popen)
    proc, url = remote.spawn_server("tests.toy", {"seed": 4}, checkpoint=Path("runs/a"), timeout=30, token="tk")
    proc.wait()
    cmd = seen["cmd"]
    assert url == "http://127.0.0.1:5" and seen["config"] == {"seed": 4} and seen["env"][serve.TOKEN_ENV] == "tk"
    assert cmd[cmd.index("--checkpoint") + 1] == "runs/a" and cmd[cmd.index("--port") + 1] == "0"
    assert cmd[cmd.index("--backend") + 1] == "tests.toy" and "tk" not in cmd
    assert not Path(cmd[cmd.index("--config-json") + 1]).exists()
    remote.spawn_server("tests.toy", {}, timeout=30)
    assert "--checkpoint" not in seen["cmd"]


def test_the_url_line_is_read_without_its_newline_and_stderr_keeps_its_tail():
    urls: queue.Queue = queue.Queue()
    tail: collections.deque = collections.deque(maxlen=2)
    remote._drain(io.StringIO(f"loading\n{serve.READY}http://127.0.0.1:7 \nbye\n"), urls, tail)
    assert urls.get_nowait() == "http://127.0.0.1:7" and urls.empty()
    assert list(tail) == [f"{serve.READY}http://127.0.0.1:7 \n", "bye\n"]


def test_spawn_failure_quotes_the_child_stderr():
    with pytest.raises(EngineError, match=r"exited with code 2 during start-up:\n.*No module named 'mmrl\.nowhere'"):
        remote.spawn_server("mmrl.nowhere", {}, cwd=ROOT, timeout=60)


# --------------------------------------------------------------------------- command line


def test_serve_verb_and_module_help(capsys):
    runner = CliRunner()
    app = make_app(BackendSpec(modality="toy", title="toy", command="toy-rl", module="toy"))
    result = runner.invoke(app, ["serve", "--help"])
    assert result.exit_code == 0
    assert all(flag in result.output for flag in ("--checkpoint", "--host", "--port", "--set", "--read-timeout",
                                                  "--max-samples"))
    result = runner.invoke(app, ["serve", "--read-timeout", "0"])
    assert result.exit_code == 2 and "--read-timeout" in result.output
    result = runner.invoke(app, ["serve", "--set", "rollout.temperature=0"])
    assert result.exit_code == 2 and "rollout.temperature" in result.output and "Traceback" not in result.output
    result = runner.invoke(app, ["serve", "--max-samples", "0"])
    assert result.exit_code == 2 and "--max-samples" in result.output

    with pytest.raises(SystemExit) as exit_:
        serve.main(["--help"])
    assert exit_.value.code == 0
    assert "--backend" in capsys.readouterr().out


def test_serve_module_checks_read_timeout_and_hands_it_to_the_server(monkeypatch, capsys):
    """`python -m mmrl.core.serve --read-timeout`: 0 or less is refused before a model is built;
    a valid value reaches the server, as do the body limits."""
    built, served = [], []
    monkeypatch.setattr(serve, "build_policy", lambda *a: built.append(a) or (ToyPolicy(), SimpleNamespace(
        rollout=RolloutConfig())))
    monkeypatch.setattr(serve, "serve", lambda *a, **kw: served.append(kw))
    for bad in ("0", "-1"):
        with pytest.raises(SystemExit) as exit_:
            serve.main(["--backend", "toy", "--read-timeout", bad])
        assert exit_.value.code == 2 and "--read-timeout must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        serve.main(["--backend", "toy", "--max-samples", "0"])
    assert exit_.value.code == 2 and "--max-samples must be at least 1, got 0" in capsys.readouterr().err
    assert built == [] and served == []
    serve.main(["--backend", "toy", "--port", "0", "--read-timeout", "7.5", "--max-request-bytes", "1000",
                "--max-weights-bytes", "2000", "--max-samples", "64"])
    assert len(built) == 1 and served[0]["read_timeout"] == 7.5
    assert served[0]["max_request_bytes"] == 1000 and served[0]["max_weights_bytes"] == 2000
    assert served[0]["max_samples"] == 64

