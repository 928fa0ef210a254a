"""A jsonl dataset's images are kept at the size the model sees (mmrl.vlm.backend.model_view),
not decoded at full resolution for the whole run; with tools too (zoom decodes the original again:
tests/vlm/test_tool_images.py)."""

import io
import json

import numpy as np
import pytest
from PIL import Image

from mmrl.core.config import ConfigError, load_config
from mmrl.vlm import backend
from mmrl.vlm.policy import resize_for_model

MAX = 112 * 112  # model.max_pixels' default
MIN = 56 * 56


def photo(w, h, seed=0):
    """A photo-like image: a gradient with noise (no two neighbours alike, so resampling shows)."""
    yy, xx = np.mgrid[0:h, 0:w]
    noise = np.random.default_rng(seed).integers(0, 40, (h, w, 3))
    a = np.stack([xx * 200 // w, yy * 200 // h, (xx + yy) * 100 // (w + h)], -1) + noise
    return Image.fromarray(a.astype(np.uint8), "RGB")


def task_of(tmp_path, lines, *overrides):
    """The task of `lines` for training; held out: the same images, asked another question."""
    path, held_out = tmp_path / "data.jsonl", tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    held_out.write_text("".join(json.dumps({**ln, "question": "Held out?"}) + "\n" for ln in lines))
    cfg = load_config(backend.CONFIG_CLASS, None, ["task.type=jsonl", f"task.train_path={path}",
                                                   f"task.eval_path={held_out}", *overrides],
                      defaults=backend.DEFAULT_CONFIG)
    return backend.build_task(cfg)


def test_a_large_photo_is_kept_as_the_model_sees_it_with_the_same_pixels(tmp_path):
    big = photo(600, 400)
    big.save(tmp_path / "big.jpg", quality=95)
    original = Image.open(tmp_path / "big.jpg").convert("RGB")
    task = task_of(tmp_path, [{"question": "What?", "answer": "x", "image": "big.jpg"}])
    (kept,) = task.train[0].images
    # smart_resize of 400 x 600 within 112*112: beta = sqrt(240000 / 12544) = 4.374;
    # 400 / 4.374 = 91.4 -> 84, 600 / 4.374 = 137.2 -> 112 (floored to multiples of 28)
    assert kept.size == (112, 84)  # 28 KiB, where the decoded photo was 703 KiB
    # what rollouts and training get of it: exactly what they got of the full-resolution photo
    (now,) = resize_for_model([kept], MIN, MAX)
    (before,) = resize_for_model([original], MIN, MAX)
    assert now.size == before.size
    assert np.array_equal(np.asarray(now), np.asarray(before))
    assert task.eval_items[0].images[0].size == (112, 84)  # held-out images too


def test_small_images_stay_as_they_are_with_tools_too(tmp_path):
    photo(100, 90).save(tmp_path / "small.png")
    photo(600, 400).save(tmp_path / "big.png")
    lines = [{"question": "a?", "answer": "x", "image": "small.png"},
             {"question": "b?", "answer": "y", "image": "big.png"}]
    small = task_of(tmp_path, lines).train[0].images[0]
    assert small.size == (100, 90)  # 9000 pixels, under max_pixels: the model's resize does the rest, as before
    assert np.array_equal(np.asarray(small), np.asarray(Image.open(tmp_path / "small.png")))
    # with tools as without: zoom gets the original, decoded again when called (tests/vlm/test_tool_images.py)
    small, big = task_of(tmp_path, lines, "rollout.tools.names=[zoom]").train
    assert small.images[0].size == (100, 90) and big.images[0].size == (112, 84)


def test_exif_orientation_and_transparency_come_before_the_shrinking(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view: 600 wide and 300 high is viewed 300 x 600
    photo(600, 300).save(tmp_path / "turned.jpg", exif=exif, quality=95)
    clear = Image.new("RGBA", (500, 500), (255, 0, 0, 0))  # fully transparent red: white once composited
    clear.save(tmp_path / "clear.png")
    task = task_of(tmp_path, [{"question": "a?", "answer": "x", "image": "turned.jpg"},
                              {"question": "b?", "answer": "y", "image": "clear.png"}])
    turned, white = task.train[0].images[0], task.train[1].images[0]
    # viewed upright, 300 x 600: beta = sqrt(180000 / 12544) = 3.788; 300 / 3.788 = 79.2 -> 56, 600 / 3.788 -> 140
    assert turned.size == (56, 140)
    assert white.mode == "RGB" and white.size == (112, 112)
    assert np.asarray(white).min() == 255


def test_an_image_the_resize_refuses_is_kept_so_its_own_size_is_named(tmp_path):
    """A 1700 x 100 image (the model's resize leaves it no rows) is not shrunk: the check that
    follows names it by its size, as before (tests/vlm/test_vlm_policy.py)."""
    fit = backend.model_view(MIN, MAX)
    wide = Image.new("RGB", (1700, 100))
    assert fit(wide) is wide
    too_wide = Image.new("RGB", (4020, 20))  # aspect ratio 201: qwen-vl-utils raises
    assert fit(too_wide) is too_wide


def test_bad_files_are_still_refused_with_their_messages(tmp_path):
    (tmp_path / "page.jpg").write_bytes(b"<html>Not found</html>")
    buf = io.BytesIO()
    photo(600, 400).save(buf, format="JPEG")
    (tmp_path / "cut.jpg").write_bytes(buf.getvalue()[:2000])  # an interrupted copy
    with pytest.raises(ConfigError, match=r"data.jsonl, line 1.*not an image format Pillow reads"):
        task_of(tmp_path, [{"question": "a?", "answer": "x", "image": "page.jpg"}])
    with pytest.raises(ConfigError, match=r"data.jsonl, line 1.*cannot read image .*cut.jpg: OSError"):
        task_of(tmp_path, [{"question": "a?", "answer": "x", "image": "cut.jpg"}])
