"""Images as researchers bring them to the VLM backend's JSONL task: placeholders, odd files."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
from PIL import Image

from mmrl.core.config import ConfigError
from mmrl.vlm import backend
from mmrl.vlm.policy import VLMPolicy
from mmrl.vlm.tasks.jsonl import DatasetError, load_jsonl
from mmrl.vlm.tasks.shapes_qa import QAItem


def write(tmp_path, *objs):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in objs), encoding="utf-8")
    return path


@pytest.fixture
def two_pngs(tmp_path):
    Image.new("RGB", (8, 8), (255, 0, 0)).save(tmp_path / "a.png")
    Image.new("RGB", (8, 8), (0, 0, 255)).save(tmp_path / "b.png")
    return ["a.png", "b.png"]


def parts(question, images):
    """The user's turn as VLMPolicy.messages builds it: ("text", str) and ("image", colour)."""
    policy = SimpleNamespace(min_pixels=None, max_pixels=None)  # all messages() reads of the policy
    (turn,) = VLMPolicy.messages(policy, QAItem(images=images, question=question, answer=""))
    return [("text", p["text"]) if p["type"] == "text" else ("image", p["image"].getpixel((0, 0)))
            for p in turn["content"]]


def test_image_placeholders_place_each_image_where_it_stands():
    red, blue = Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))
    # LLaVA's form: the placeholder does not reach the model as the text "<image>"
    assert parts("<image>\nWhat colour?", [red]) == [("image", (255, 0, 0)), ("text", "\nWhat colour?")]
    assert parts("Is <image> redder than <image>?", [red, blue]) == [
        ("text", "Is "), ("image", (255, 0, 0)), ("text", " redder than "), ("image", (0, 0, 255)), ("text", "?")]
    # no placeholder: the images first, then the question, as before
    assert parts("Which is red?", [red, blue]) == [("image", (255, 0, 0)), ("image", (0, 0, 255)),
                                                   ("text", "Which is red?")]


def test_a_jsonl_placeholder_count_that_is_not_the_image_count_names_the_line(tmp_path, two_pngs):
    ok = {"question": "<image> or <image>?", "answer": "a", "images": two_pngs}
    assert len(load_jsonl(write(tmp_path, ok))[0].images) == 2
    for bad, words in (({**ok, "question": "<image>\nWhich is red?"}, "holds 1 <image> placeholder for 2 images"),
                       ({"question": "<image> What?", "answer": "a"}, "holds 1 <image> placeholder for 0 images"),
                       ({"question": "<image><image>", "answer": "a", "image": "a.png"}, "2 <image> placeholders for 1 image:")):
        with pytest.raises(DatasetError, match=r"line 2.*question.*" + words):
            load_jsonl(write(tmp_path, ok, bad))


def test_a_large_image_reads_without_pillows_unnamed_bomb_warning_and_a_huge_one_says_what_to_do(
        tmp_path, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # a 12 x 12 image stands for a 10000 x 10000 photo
    Image.new("RGB", (12, 12), (0, 255, 0)).save(tmp_path / "large.png")  # 144 pixels: over 100, under 200
    Image.new("RGB", (15, 15)).save(tmp_path / "huge.png")  # 225 pixels: over twice the limit
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Pillow's "could be decompression bomb DOS attack", naming no file
        (item,) = load_jsonl(write(tmp_path, {"question": "q", "answer": "a", "image": "large.png"}))
    assert item.images[0].size == (12, 12) and item.images[0].getpixel((5, 5)) == (0, 255, 0)
    with pytest.raises(DatasetError, match=r"line 1.*huge\.png: DecompressionBombError: .*give a smaller copy"):
        load_jsonl(write(tmp_path, {"question": "q", "answer": "a", "image": "huge.png"}))
    with pytest.raises(ConfigError, match=r"--image: cannot read .*huge\.png: DecompressionBombError.*smaller copy"):
        backend._read_image(tmp_path / "huge.png")


def test_a_file_pillow_cannot_identify_says_what_it_holds(tmp_path):
    (tmp_path / "empty.png").write_bytes(b"")  # an interrupted copy
    (tmp_path / "page.jpg").write_bytes(b"<!DOCTYPE html><html>404 Not Found</html>")  # a scraper's error page
    for name, words in (("empty.png", r"empty\.png: the file is empty \(0 bytes\)"),
                        ("page.jpg", (r"page\.jpg: not an image format Pillow reads \(41 bytes; it starts "
                                      r"b'<!DOCTYPE html><'\)"))):
        with pytest.raises(DatasetError, match=r"line 1, field 'image': cannot read image .*" + words):
            load_jsonl(write(tmp_path, {"question": "q", "answer": "a", "image": name}))


def test_sample_refuses_placeholders_its_images_cannot_fill_and_names_an_empty_image(tmp_path):
    (tmp_path / "empty.png").write_bytes(b"")
    red = tmp_path / "red.png"
    Image.new("RGB", (8, 8), (255, 0, 0)).save(red)
    for prompts, images, words in ((["ok", "a <image> b <image>"], [red], "--prompt 2 .*2 <image> placeholders for 1 image"),
                                   (["<image> what?"], [], "--prompt 1 .*holds 1 <image> placeholder for 0 images")):
        with pytest.raises(ConfigError, match=words):  # checked before the policy is asked anything
            backend.sample(None, None, None, prompts, 1, images=images)
    with pytest.raises(ConfigError, match=r"--image: cannot read .*empty\.png: the file is empty \(0 bytes\)"):
        backend._read_image(tmp_path / "empty.png")


def test_a_served_question_whose_placeholders_its_images_cannot_fill_is_a_400():
    policy = SimpleNamespace()  # refused before the policy is asked anything
    red = Image.new("RGB", (8, 8), (255, 0, 0))
    for prompt in ("<image> what?", QAItem(images=[red], question="<image> or <image>?", answer="")):
        with pytest.raises(ValueError, match="the question holds .* <image> placeholders? for .* images?: give one"):
            VLMPolicy.serve_prompt(policy, prompt, rollout=None)
    for question in ("q<|endoftext|>", "q<|im_end|>"):  # a served question is checked as a data file's
        with pytest.raises(ValueError, match=r"the question holds the (tokenizer's end-of-text token|chat format's "
                                             r"turn marker)"):
            VLMPolicy.serve_prompt(policy, question, rollout=None)


def test_an_rgb_photo_opened_in_python_reaches_the_model_upright_and_a_loaded_one_uncopied(tmp_path):
    photo = Image.new("RGB", (80, 40), (255, 0, 0))
    exif = photo.getexif()
    exif[0x0112] = 6  # "rotate 90 clockwise to view": a phone held upright
    photo.save(tmp_path / "phone.jpg", exif=exif)
    policy = SimpleNamespace(min_pixels=None, max_pixels=None)
    with Image.open(tmp_path / "phone.jpg") as opened:  # as a Python caller passes it
        (turn,) = VLMPolicy.messages(policy, QAItem(images=[opened], question="q", answer=""))
        assert turn["content"][0]["image"].size == (40, 80)  # as a viewer shows it, not (80, 40)
    (item,) = load_jsonl(write(tmp_path, {"question": "q", "answer": "a", "image": "phone.jpg"}))
    (turn,) = VLMPolicy.messages(policy, item)
    assert turn["content"][0]["image"] is item.images[0] and item.images[0].size == (40, 80)


def test_pillows_warning_about_a_photos_corrupt_exif_names_the_file_line_and_field(tmp_path):
    # an Orientation entry (6) whose IFD ends before its next-IFD pointer: "Corrupt EXIF data"
    exif = b"Exif\x00\x00MM\x00\x2a\x00\x00\x00\x08\x00\x01\x01\x12\x00\x03\x00\x00\x00\x01\x00\x06\x00\x00"
    Image.new("RGB", (80, 40), (255, 0, 0)).save(tmp_path / "odd.jpg", exif=exif)
    rows = [{"question": "q", "answer": "a"}, {"question": "q2", "answer": "a", "images": ["odd.jpg"]}]
    with pytest.warns(UserWarning, match=r"data\.jsonl, line 2, field 'images\[0\]': Corrupt EXIF data"):
        (_, item) = load_jsonl(write(tmp_path, *rows))
    assert item.images[0].size == (40, 80)  # the orientation it could read is still applied
    with pytest.warns(UserWarning, match=r"--image .*odd\.jpg: Corrupt EXIF data"):
        backend._read_image(tmp_path / "odd.jpg")
