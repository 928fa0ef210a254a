"""With rollout.tools a jsonl task keeps each image at the size the model sees, as without, and a
tool gets the full-resolution original, decoded again from its file or base64 when it is called
(mmrl.vlm.tasks.jsonl.ImageFile): zoom's crops, in the original's pixel coordinates, and the
rollouts are those of a task that held every original decoded for the whole run."""

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from test_agent import Scripted, make_policy, rollout_cfg, tool_call
from test_image_memory import photo, task_of

from mmrl.core.wire import pack, unpack
from mmrl.vlm.agent import _tool_images
from mmrl.vlm.tasks.jsonl import JsonlItem, _decoded, load_jsonl, open_rgb
from mmrl.vlm.tools import ToolContext, build_registry

TOOLS = "rollout.tools.names=[zoom]"


def pixels(image):
    return np.asarray(image)


def test_the_model_view_is_kept_and_a_tool_gets_the_original_pixels(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view: 600 wide and 300 high is viewed 300 x 600
    photo(600, 300).save(tmp_path / "turned.jpg", exif=exif, quality=95)
    buf = io.BytesIO()
    photo(500, 400, seed=1).save(buf, format="PNG")
    task = task_of(tmp_path, [{"question": "a?", "answer": "x", "image": "turned.jpg"},
                              {"question": "b?", "answer": "y", "image_b64": base64.b64encode(buf.getvalue()).decode()}],
                   TOOLS)
    turned, coded = task.train
    assert isinstance(turned, JsonlItem)
    # viewed upright, 300 x 600: beta = sqrt(180000 / 12544) = 3.788; 300 / 3.788 = 79.2 -> 56, 600 / 3.788 -> 140
    assert turned.images[0].size == (56, 140)  # 23 KiB kept, where the decoded photo was 527 KiB
    (full,) = _tool_images(turned)
    assert full.size == (300, 600)  # upright, as the zoom's coordinates always were
    assert np.array_equal(pixels(full), pixels(open_rgb(tmp_path / "turned.jpg")))
    (full,) = _tool_images(coded)
    assert coded.images[0].size == (112, 84) and full.size == (500, 400)
    assert np.array_equal(pixels(full), pixels(photo(500, 400, seed=1)))
    assert _tool_images(task.eval_items[0])[0].size == (300, 600)  # held-out items too


def test_a_zoom_rollout_is_the_one_on_full_resolution_items(tmp_path, qwen25_dir):
    """The same scripted zoom, on the task's items (the model's view kept) and on items that hold
    the decoded original (what the task kept before): the same tokens, log-probs and pixels."""
    photo(448, 448, seed=2).save(tmp_path / "big.png")
    line = {"question": "What colour is the shape in the top left?", "answer": "red", "image": "big.png"}
    (kept,) = task_of(tmp_path, [line], TOOLS).train
    (whole,) = load_jsonl(tmp_path / "data.jsonl")  # no fit: the original itself
    assert kept.images[0].size == (112, 112) and whole.images[0].size == (448, 448)
    batches = []
    for item in (kept, whole):
        policy = make_policy(qwen25_dir)
        Scripted(policy, [[tool_call("zoom", x0=0, y0=0, x1=224, y1=224), "<answer>red</answer><|im_end|>"]]).install()
        batches.append(policy.generate([item], 1, rollout_cfg(), torch.Generator().manual_seed(0)))
    a, b = batches
    assert a.data["stat/tool_calls"].tolist() == [1.0] and a.data["stat/tool_errors"].tolist() == [0.0]
    assert a.data["image_grid_thw"][0, 1].prod() > 0  # the crop was shown
    for key in ("completion_ids", "pixel_values", "image_grid_thw"):
        assert torch.equal(a.data[key], b.data[key]), key
    assert torch.equal(a.old_logp, b.old_logp)


def test_the_context_is_made_only_for_a_tool_that_takes_it():
    """A calculator call decodes no image; a zoom's context is made once, before the tool runs."""
    made = []

    def context():
        made.append(1)
        return ToolContext(images=[photo(64, 48)])

    registry = build_registry(["zoom", "calculator"])
    assert registry.call(tool_call("calculator", expression="2 + 3"), context).content == ["5"]
    assert made == []
    result = registry.call(tool_call("zoom", x0=0, y0=0, x1=32, y1=16), context)
    assert result.ok and result.content[0].size == (32, 16) and made == [1]


def test_a_file_changed_since_load_is_an_error_observation_that_names_it(tmp_path):
    photo(600, 400).save(tmp_path / "big.png")
    (item,) = task_of(tmp_path, [{"question": "a?", "answer": "x", "image": "big.png"}], TOOLS).train
    assert _tool_images(item)[0].size == (600, 400)  # opened once: decoded and cached
    photo(300, 200).save(tmp_path / "big.png")  # replaced while the run goes on
    registry = build_registry(["zoom"])
    result = registry.call(tool_call("zoom", x0=0, y0=0, x1=100, y1=100),
                           lambda: ToolContext(images=_tool_images(item)))
    assert result.kind == "raised" and result.name == "zoom"
    assert result.error.startswith("tool zoom not run: the prompt's images could not be read: ValueError: ")
    assert f"{tmp_path / 'big.png'} ({tmp_path / 'data.jsonl'}, line 1, field 'image') changed since the task " \
           "was loaded" in result.error


def test_a_gone_file_is_named_and_an_item_crosses_the_wire_to_a_rollout_server(tmp_path):
    photo(600, 400).save(tmp_path / "big.png")
    (item,) = task_of(tmp_path, [{"question": "a?", "answer": "x", "image": "big.png"}], TOOLS).train
    # placement process or remote: the original goes as its file's bytes, so a server on another
    # machine needs no copy of the dataset
    sent = unpack(pack(item))
    assert sent.originals[0].path is None and sent.images[0].size == (112, 84)
    assert sent.originals[0].data == (tmp_path / "big.png").read_bytes()
    (tmp_path / "big.png").unlink()
    assert np.array_equal(pixels(_tool_images(sent)[0]), pixels(photo(600, 400)))
    with pytest.raises(ValueError, match=r"big.png \(.*data.jsonl, line 1, field 'image'\) is gone: a tool reads"):
        _tool_images(item)
    assert unpack(pack(item)).originals == item.originals  # a gone file goes as its path: the server names it


def test_a_tool_drawing_on_its_image_leaves_the_original_as_it_was(tmp_path):
    photo(600, 400).save(tmp_path / "big.png")
    item, other = task_of(tmp_path, [{"question": "a?", "answer": "x", "image": "big.png"},
                                     {"question": "b?", "answer": "y", "image": "big.png"}], TOOLS).train
    (drawn,) = _tool_images(item)
    ImageDraw.Draw(drawn).rectangle((0, 0, 599, 399), fill=(255, 0, 0))
    hits = _decoded.cache_info().hits
    (again,) = _tool_images(other)  # another question on the photo: its cached decode, not the drawn copy
    assert _decoded.cache_info().hits == hits + 1
    assert np.array_equal(pixels(again), pixels(Image.open(tmp_path / "big.png").convert("RGB")))


def test_small_images_are_their_own_originals_with_tools(tmp_path):
    photo(100, 90).save(tmp_path / "small.png")
    (item,) = task_of(tmp_path, [{"question": "a?", "answer": "x", "image": "small.png"}], TOOLS).train
    assert item.originals == [None]  # 9000 pixels, under max_pixels: kept whole, nothing to decode again
    (full,) = _tool_images(item)
    assert full is not item.images[0] and np.array_equal(pixels(full), pixels(item.images[0]))
