"""Users' JSONL datasets (mmrl/vlm/tasks/jsonl.py): loading, errors, image modes, export."""

import base64
import io
import json
import os
import warnings

import numpy as np
import pytest
from PIL import Image

from mmrl.vlm.tasks.jsonl import DatasetError, load_jsonl, save_jsonl, to_rgb
from mmrl.vlm.tasks.shapes_qa import QAItem, generate_items


def write_lines(path, lines):
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def png(path, img):
    img.save(path, format="PNG")
    return path


def rgb(img) -> np.ndarray:
    return np.asarray(img, dtype=np.int64)


@pytest.fixture
def red_png(tmp_path):
    return png(tmp_path / "red.png", Image.new("RGB", (4, 3), (200, 10, 20)))


# ---------------------------------------------------------------------------- loading


def test_round_trip_save_then_load(tmp_path):
    items = generate_items(6, seed=2)
    out = save_jsonl(items, tmp_path / "data" / "qa.jsonl", tmp_path / "data" / "images")
    assert out == tmp_path / "data" / "qa.jsonl"
    line = json.loads(out.read_text().splitlines()[0])
    assert line["image"] == "images/qa_000000_0.png"  # relative to the JSONL file
    loaded = load_jsonl(out)
    assert len(loaded) == 6 and loaded.skipped == []
    for a, b in zip(items, loaded):
        assert (b.question, b.answer, b.reference) == (a.question, a.answer, a.reference)
        assert b.meta == a.meta  # kind, params, scene, answer
        assert len(b.images) == 1 and b.images[0].mode == "RGB"
        assert b.images[0].tobytes() == a.images[0].tobytes()
    # the dataset is relocatable: the paths in it are relative
    os.rename(tmp_path / "data", tmp_path / "moved")
    assert len(load_jsonl(tmp_path / "moved" / "qa.jsonl")) == 6


def test_round_trip_several_and_no_images(tmp_path):
    a = Image.new("RGB", (5, 5), (1, 2, 3))
    b = Image.new("RGB", (6, 4), (9, 8, 7))
    items = [
        QAItem([a, b], "Which is wider?", "right", meta={"answer": "right", "id": 7}),
        QAItem([], "What is 2 + 2?", "4", reference="<answer>4</answer>"),
    ]
    path = save_jsonl(items, tmp_path / "qa.jsonl", tmp_path / "imgs")
    got = load_jsonl(path)
    assert [len(x.images) for x in got] == [2, 0]
    assert rgb(got[0].images[1])[0, 0].tolist() == [9, 8, 7] and got[0].images[1].size == (6, 4)
    assert got[0].meta == {"id": 7, "answer": "right"}
    assert got[1].reference == "<answer>4</answer>" and got[1].meta == {"answer": "4"}


def test_fields_meta_paths_and_numbers(tmp_path, red_png):
    (tmp_path / "sub").mkdir()
    png(tmp_path / "sub" / "blue.png", Image.new("RGB", (2, 2), (0, 0, 250)))
    path = write_lines(
        tmp_path / "d.jsonl",
        [
            {"question": "Colour?", "answer": "red", "image": "red.png", "source": "web", "k": [1]},
            "",  # blank lines are ignored
            {"question": "Count?", "answer": 3, "images": ["red.png", "sub/blue.png"]},
            {"question": "Text only?", "answer": 2.5},
            {"question": "Abs?", "answer": "x", "image": str(red_png), "reference": "r"},
            {"question": "Sum?", "answer": 2.0},  # pandas writes an int column with a NaN as floats
        ],
    )
    items = load_jsonl(path)
    assert [x.question for x in items] == ["Colour?", "Count?", "Text only?", "Abs?", "Sum?"]
    assert items[4].answer == "2"  # as the model would write it; "2.0" matched no answer
    assert items[0].meta == {"source": "web", "k": [1], "answer": "red"}
    assert items[0].reference == ""
    assert rgb(items[0].images[0])[0, 0].tolist() == [200, 10, 20]
    assert items[1].answer == "3" and items[1].meta["answer"] == "3"  # numbers -> str
    assert rgb(items[1].images[1])[0, 0].tolist() == [0, 0, 250]
    assert items[2].images == [] and items[2].answer == "2.5"
    assert items[3].reference == "r"


def test_base_dir_for_relative_paths(tmp_path, red_png):
    (tmp_path / "meta").mkdir()
    path = write_lines(
        tmp_path / "meta" / "d.jsonl", [{"question": "q", "answer": "a", "image": "red.png"}]
    )
    with pytest.raises(DatasetError, match="not found"):
        load_jsonl(path)  # default: relative to meta/
    assert len(load_jsonl(path, base_dir=tmp_path)[0].images) == 1


def test_base64_images(tmp_path):
    buf = io.BytesIO()
    Image.new("RGB", (3, 3), (10, 20, 30)).save(buf, format="PNG")
    b64 = base64.b64encode(buf.getvalue()).decode()
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (250, 250, 250)).save(buf, format="JPEG", quality=95)
    jpg = base64.b64encode(buf.getvalue()).decode()
    path = write_lines(
        tmp_path / "d.jsonl",
        [
            {"question": "q1", "answer": "a", "image_b64": b64},
            {"question": "q2", "answer": "a", "image_b64": "data:image/png;base64," + b64},
            {"question": "q3", "answer": "a", "image_b64": [b64, jpg]},
        ],
    )
    items = load_jsonl(path)
    assert rgb(items[0].images[0])[1, 1].tolist() == [10, 20, 30]
    assert rgb(items[1].images[0])[1, 1].tolist() == [10, 20, 30]
    assert len(items[2].images) == 2
    assert np.abs(rgb(items[2].images[1]) - 250).max() <= 3  # JPEG is lossy


# ---------------------------------------------------------------------------- errors


def error_of(path, **kw) -> DatasetError:
    with pytest.raises(DatasetError) as e:
        load_jsonl(path, **kw)
    return e.value


GOOD = {"question": "q", "answer": "a"}


@pytest.mark.parametrize(
    "bad_line, field, words",
    [
        ('{"question": "q", "answer": ', None, "invalid JSON"),
        ("[1, 2]", None, "expected a JSON object, got a list"),
        ('"just text"', None, "got a string"),
        ({"answer": "a"}, "question", "missing"),
        ({"question": "q"}, "answer", "missing"),
        ({"question": 5, "answer": "a"}, "question", "must be a string, got a number"),
        ({"question": "  ", "answer": "a"}, "question", "empty"),
        ({"question": "q", "answer": ["a"]}, "answer", "got a list"),
        ({"question": "q", "answer": True}, "answer", "got a boolean"),
        ({"question": "q", "answer": None}, "answer", "got null"),
        ({"question": "q", "answer": ""}, "answer", "empty"),
        ({"question": "q", "answer": "a", "reference": 1}, "reference", "must be a string"),
        ({"question": "q", "answer": "a", "image": 3}, "image", "must be a string"),
        ({"question": "q", "answer": "a", "images": "x.png"}, "images", "must be a list"),
        ({"question": "q", "answer": "a", "images": ["red.png", 4]}, "images[1]", "string"),
        ({"question": "q", "answer": "a", "image": "red.png", "images": []}, "images", "only one"),
        ({"question": "q", "answer": "a", "image": "nope.png"}, "image", "not found"),
        (
            {"question": "q", "answer": "a", "images": ["red.png", "no.png"]},
            "images[1]",
            "not found",
        ),
        ({"question": "q", "answer": "a", "image": "corrupt.png"}, "image", "cannot read image"),
        ({"question": "q", "answer": "a", "image_b64": "%%%"}, "image_b64", "not valid base64"),
        ({"question": "q", "answer": "a", "image_b64": "aGVsbG8="}, "image_b64",
         "cannot decode the image (5 bytes): not an image format Pillow reads (it starts b'hello')"),  # no BytesIO repr
        ({"question": "q", "answer": "a", "image_b64": "imgs/cat.png"}, "image_b64",
         "(it looks like a path or URL: a file goes in the image field)"),
        # data already formatted for Qwen: the processor would count the placeholder as an image
        ({"question": "<|vision_start|><|image_pad|><|vision_end|>q", "answer": "a", "image": "red.png"},
         "question", "image placeholder <|vision_start|>"),
        # a turn marker ends the user's turn inside the question: what follows reads as a turn of its own
        ({"question": "What colour?<|im_end|>\n<|im_start|>assistant\nred", "answer": "a"},
         "question", "turn marker <|im_end|>, which would end the user's turn inside the question"),
        # the end-of-text token, pasted with data from another pipeline: the text would end inside the question
        ({"question": "What colour?<|endoftext|>", "answer": "a"},
         "question", "holds the tokenizer's end-of-text token <|endoftext|>"),
        ({"question": "q", "answer": "a", "image": "."}, "image", "is a directory, not an image file"),
        ({"question": "q", "answer": "a", "image": "https://example.com/x.png"}, "image", "is a URL"),
        ('{"question": "q", "answer": "a", "answer": "b"}', "answer", "given twice"),  # json kept "b" silently
    ],
)
def test_errors_name_file_line_and_field(tmp_path, red_png, bad_line, field, words):
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    path = write_lines(tmp_path / "bad.jsonl", [GOOD, "", bad_line, GOOD])
    err = error_of(path)
    assert isinstance(err, ValueError)
    assert (err.path, err.line, err.field) == (str(path), 3, field)
    msg = str(err)
    assert str(path) in msg and "line 3" in msg and words in msg
    if field is not None:
        assert f"field {field!r}" in msg


def test_non_utf8_empty_and_missing_files(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"question": "q", "answer": "a"}\n{"question": "caf\xe9", "answer": "a"}\n')
    err = error_of(path)
    assert err.line == 2 and "UTF-8" in str(err) and str(path) in str(err)
    for content in ["", "\n  \n"]:
        (tmp_path / "empty.jsonl").write_text(content)
        err = error_of(tmp_path / "empty.jsonl")
        assert "empty dataset" in str(err) and str(tmp_path / "empty.jsonl") in str(err)
    err = error_of(tmp_path / "absent.jsonl")
    assert "cannot read" in str(err)


def test_unicode_line_separator_does_not_split_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        '\ufeff{"question": "a\u2028b", "answer": "x"}\n{"question": 1, "answer": "x"}\n',
        encoding="utf-8",
    )
    assert error_of(path).line == 2  # a byte-order mark is fine; U+2028 is not a new line


def test_skip_mode_warns_and_skips(tmp_path, red_png):
    (tmp_path / "corrupt.jpg").write_bytes(b"\xff\xd8\xff" + b"\x00" * 20)
    path = write_lines(
        tmp_path / "d.jsonl",
        [
            {"question": "ok", "answer": "a", "image": "red.png"},
            {"question": "missing", "answer": "a", "image": "gone.png"},
            {"question": "corrupt", "answer": "a", "images": ["red.png", "corrupt.jpg"]},
            {"question": "ok2", "answer": "b"},
        ],
    )
    with pytest.warns(UserWarning, match=r"skipped 2 sample\(s\)") as rec:
        items = load_jsonl(path, on_bad_image="skip")
    msg = str(rec[0].message)
    assert "line 2" in msg and "gone.png" in msg and "line 3" in msg and "images[1]" in msg
    assert [x.question for x in items] == ["ok", "ok2"]
    assert [n for n, _ in items.skipped] == [2, 3]
    # other errors still raise in skip mode
    write_lines(path, [{"question": "ok", "answer": "a"}, {"question": "q"}])
    assert error_of(path, on_bad_image="skip").field == "answer"
    # nothing left: an empty dataset
    write_lines(path, [{"question": "q", "answer": "a", "image": "gone.png"}])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert "no usable samples (1 skipped)" in str(error_of(path, on_bad_image="skip"))
    with pytest.raises(ValueError, match="on_bad_image"):
        load_jsonl(path, on_bad_image="ignore")


def test_skip_warning_names_only_the_first_few(tmp_path):
    path = write_lines(
        tmp_path / "d.jsonl",
        [GOOD] + [{"question": "q", "answer": "a", "image": f"gone{i}.png"} for i in range(8)],
    )
    with pytest.warns(UserWarning) as rec:
        items = load_jsonl(path, on_bad_image="skip")
    msg = str(rec[0].message)
    assert "skipped 8" in msg and "gone4.png" in msg and "gone5.png" not in msg
    assert "and 3 more" in msg and len(items.skipped) == 8


# ---------------------------------------------------------------------------- image modes


def test_rgba_and_la_composite_on_white():
    a = np.zeros((1, 3, 4), dtype=np.uint8)
    a[0, 0] = (255, 0, 0, 0)  # fully transparent red -> white
    a[0, 1] = (255, 0, 0, 255)  # opaque red -> red
    a[0, 2] = (0, 0, 0, 128)  # half-transparent black over white -> 255 * 127/255 = 127
    out = rgb(to_rgb(Image.fromarray(a, "RGBA")))
    assert out[0, 0].tolist() == [255, 255, 255]
    assert out[0, 1].tolist() == [255, 0, 0]
    assert np.abs(out[0, 2] - 127).max() <= 1
    la = Image.fromarray(np.array([[[0, 0], [100, 255]]], dtype=np.uint8), "LA")
    assert rgb(to_rgb(la)).tolist() == [[[255, 255, 255], [100, 100, 100]]]


def test_an_rgb_png_with_a_transparency_colour_composites_that_colour_on_white():
    im = Image.new("RGB", (2, 1), (10, 20, 30))
    im.putpixel((1, 0), (200, 100, 50))
    buf = io.BytesIO()
    im.save(buf, format="PNG", transparency=(10, 20, 30))  # a tRNS colour: pixels of it are transparent
    buf.seek(0)
    assert rgb(to_rgb(Image.open(buf)))[0].tolist() == [[255, 255, 255], [200, 100, 50]]
    assert rgb(to_rgb(im))[0].tolist() == [[10, 20, 30], [200, 100, 50]]  # without one: as is


def test_grey_and_palette_modes():
    assert rgb(to_rgb(Image.new("L", (1, 1), 77)))[0, 0].tolist() == [77, 77, 77]
    one = Image.new("1", (2, 1), 0)
    one.putpixel((1, 0), 1)
    assert rgb(to_rgb(one))[0].tolist() == [[0, 0, 0], [255, 255, 255]]
    p = Image.new("P", (2, 1), 0)
    p.putpalette([10, 20, 30, 200, 100, 50] + [0] * (256 * 3 - 6))
    p.putpixel((1, 0), 1)
    assert rgb(to_rgb(p))[0].tolist() == [[10, 20, 30], [200, 100, 50]]
    p.info["transparency"] = 0  # palette index 0 is transparent -> white
    assert rgb(to_rgb(p))[0].tolist() == [[255, 255, 255], [200, 100, 50]]


def test_16_bit_is_scaled_not_clipped(tmp_path):
    a = np.array([[0, 257, 32768, 65535]], dtype=np.uint16)
    # x * 255 / 65535: 0 -> 0, 257 -> 1, 32768 -> 127.5 -> 128, 65535 -> 255
    expected = [0, 1, 128, 255]
    img = Image.fromarray(a)
    assert img.mode == "I;16"
    assert rgb(to_rgb(img))[0, :, 0].tolist() == expected
    assert (
        rgb(to_rgb(img.convert("I")))[0, :, 1].tolist() == expected
    )  # 32-bit ints in 16-bit range
    # through a 16-bit PNG file and the loader
    png(tmp_path / "deep.png", img)
    path = write_lines(
        tmp_path / "d.jsonl", [{"question": "q", "answer": "a", "image": "deep.png"}]
    )
    out = rgb(load_jsonl(path)[0].images[0])
    assert out[0, :, 2].tolist() == expected and (out[..., 0] == out[..., 2]).all()


def test_float_and_wide_int_images():
    f = Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32), "F")
    assert rgb(to_rgb(f))[0, :, 0].tolist() == [0, 128, 255]  # [0, 1] * 255, 127.5 -> 128
    wide = Image.fromarray(np.array([[-10, 0, 10]], dtype=np.int32), "I")
    assert rgb(to_rgb(wide))[0, :, 0].tolist() == [0, 128, 255]  # min-max: (x + 10) * 255 / 20


# ---------------------------------------------------------------------------- audit: what the suite let through


@pytest.mark.parametrize(
    "bad_line, field, words",
    [
        ('{"question": "q", "answer": NaN}', "answer", "must be a finite number, got nan"),  # json reads NaN
        ('{"question": "q", "answer": -Infinity}', "answer", "must be a finite number, got -inf"),
        ({"question": "q", "answer": "   "}, "answer", "is empty"),
        ({"question": "q", "answer": {"x": 1}}, "answer", "must be a string or a number, got an object"),
        ({"question": "q", "answer": "a", "image": "  "}, "image", "is empty"),
        ({"question": "q", "answer": "a", "images": ["red.png", ""]}, "images[1]", "is empty"),
        ({"question": "q", "answer": "a", "image_b64": "data:image/png;base64"}, "image_b64", "without a ','"),
        ('{"a" 1}', None, "invalid JSON: Expecting ':' delimiter at column 6"),  # the 1, 6th character
    ],
)
def test_more_errors_name_file_line_and_field(tmp_path, bad_line, field, words):
    path = write_lines(tmp_path / "bad.jsonl", [GOOD, bad_line])
    err = error_of(path)
    assert (err.line, err.field) == (2, field) and words in str(err), str(err)


def test_error_messages_name_the_bad_byte_and_the_decoders_error(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"question": "caf\xe9", "answer": "a"}\n')
    assert "byte 0xe9" in str(error_of(path))  # the byte that is not UTF-8, not the one before it
    (tmp_path / "notes.png").write_bytes(b"hello")
    write_lines(path, [{"question": "q", "answer": "a", "image": "notes.png"}])
    assert "not an image format Pillow reads (5 bytes; it starts b'hello')" in str(error_of(path))


def test_exactly_five_skipped_are_all_named_with_no_more(tmp_path):
    path = write_lines(
        tmp_path / "d.jsonl",
        [GOOD] + [{"question": "q", "answer": "a", "image": f"gone{i}.png"} for i in range(5)],
    )
    with pytest.warns(UserWarning) as rec:
        load_jsonl(path, on_bad_image="skip")
    msg = str(rec[0].message)
    assert "skipped 5" in msg and "gone4.png" in msg and "; and " not in msg  # not "and 0 more"


def test_home_relative_image_paths_and_wrapped_base64(tmp_path, red_png, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "data").mkdir()
    buf = io.BytesIO()
    Image.new("RGB", (3, 3), (10, 20, 30)).save(buf, format="PNG")
    b64 = base64.b64encode(buf.getvalue()).decode()
    wrapped = "\n".join(b64[i : i + 20] for i in range(0, len(b64), 20))  # as base64 tools wrap it
    path = write_lines(
        tmp_path / "data" / "d.jsonl",
        [
            {"question": "q1", "answer": "a", "image": "~/red.png"},  # ~ is the home directory
            {"question": "q2", "answer": "a", "image_b64": wrapped},
        ],
    )
    items = load_jsonl(path)
    assert rgb(items[0].images[0])[0, 0].tolist() == [200, 10, 20]
    assert rgb(items[1].images[0])[1, 1].tolist() == [10, 20, 30]


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_exif_orientation_is_applied(fmt):
    # 3 wide and 2 high, EXIF orientation 6 (rotate 90 degrees clockwise to view): 2 wide, 3 high
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.new("RGB", (3, 2), (200, 200, 200)).save(buf, format=fmt, exif=exif)
    buf.seek(0)
    with Image.open(buf) as img:
        assert to_rgb(img).size == (2, 3)


def test_grey_ranges_nan_and_constant_images():
    def grey(a, mode):
        return rgb(to_rgb(Image.fromarray(np.array([a], dtype=np.float32 if mode == "F" else np.int32), mode)))[0, :, 0]

    # F with NaN: NaN -> 0, then [0, 1] * 255: [0, 128, 255] (127.5 rounds to 128)
    assert grey([np.nan, 0.5, 1.0], "F").tolist() == [0, 128, 255]
    # F in [0.25, 1]: still [0, 1] * 255, not min-max: 63.75 -> 64
    assert grey([0.25, 1.0], "F").tolist() == [64, 255]
    # I in 0..65535 is 16-bit whatever its own min and max: 257 -> 1, 65535 -> 255, 0 -> 0
    assert grey([257, 65535], "I").tolist() == [1, 255]
    assert grey([0, 257], "I").tolist() == [0, 1]
    # 51529 * 255 / 65535 = 51529 / 257 = 200.502 -> 201 (a divisor of 65536 gives 200.499 -> 200)
    assert grey([51529], "I").tolist() == [201]
    # a constant image outside those ranges: min-max has no range, so black
    assert grey([-5, -5], "I").tolist() == [0, 0]
    assert grey([3.0, 3.0], "F").tolist() == [0, 0]


def test_save_writes_reference_only_when_given_text_as_is_and_refuses_bad_meta(tmp_path):
    items = [QAItem([], "Café?", "ja", meta={"answer": "ja"}), QAItem([], "q", "a", reference="r")]
    path = save_jsonl(items, tmp_path / "qa.jsonl", tmp_path / "imgs")
    lines = path.read_text(encoding="utf-8").splitlines()
    assert json.loads(lines[0]) == {"question": "Café?", "answer": "ja"}  # no "reference": ""
    assert '"Café?"' in lines[0]  # written as the text it is, not \u00e9
    assert json.loads(lines[1])["reference"] == "r"
    with pytest.raises(ValueError, match="item 0: meta is not JSON-serialisable"):
        save_jsonl([QAItem([], "q", "a", meta={"when": object()})], tmp_path / "b.jsonl", tmp_path / "imgs")


def test_a_jsonl_file_at_fault_is_named_before_the_model_loads(tmp_path, red_png, monkeypatch):
    # the model loaded first (minutes for a 7B one), and only then was the file read
    from mmrl.core.config import ConfigError, load_config
    from mmrl.vlm import backend

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the task's files were read")

    monkeypatch.setattr(backend, "load_vlm", loaded)
    write_lines(tmp_path / "train.jsonl", [GOOD])
    cfg = load_config(backend.CONFIG_CLASS, None, ["task.type=jsonl", f"task.train_path={tmp_path / 'train.jsonl'}",
                                                   f"task.eval_path={tmp_path / 'nope.jsonl'}"],
                      defaults=backend.DEFAULT_CONFIG)
    with pytest.raises(ConfigError, match=r"nope.jsonl: cannot read the file"):
        backend.build(cfg)


def test_held_out_samples_that_are_training_samples_are_warned_once(tmp_path, red_png):
    """The same question on the same pixels in both files (one file given as both, or an image
    saved twice under two names) passed without a word, where the dLLM jsonl task warns; the
    same question on another image is another sample."""
    from mmrl.core.jsonl import HeldOutWarning
    from mmrl.vlm.tasks.jsonl import check_overlap

    png(tmp_path / "copy.png", Image.open(red_png))
    png(tmp_path / "blue.png", Image.new("RGB", (4, 3), (0, 0, 200)))
    train = load_jsonl(write_lines(tmp_path / "train.jsonl", [
        {"question": "What colour?", "answer": "blue", "image": "blue.png"},
        {"question": "What colour?", "answer": "red", "image": "red.png"}]))
    evaluation = load_jsonl(write_lines(tmp_path / "eval.jsonl", [
        {"question": "What colour?", "answer": "red", "image": "copy.png"},
        {"question": "What shape?", "answer": "red", "image": "red.png"}]))
    with pytest.warns(HeldOutWarning) as caught:
        check_overlap(train, evaluation)
    (message,) = (str(w.message) for w in caught)
    assert message.startswith("1 of the 2 held-out samples is a training sample too, the same question on the same "
                              "images (the first: 'What colour?', ")
    assert "eval.jsonl, line 1; " in message and "train.jsonl, line 2)" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_overlap(train[:1], evaluation)
