"""The shapes-zoom task (mmrl/vlm/tasks/shapes_zoom.py): generation, held-out split, zoom."""

import json

import numpy as np
import pytest
from PIL import Image

from mmrl.core.rewards import Sample
from mmrl.vlm.tasks import shapes_zoom
from mmrl.vlm.tasks.scenes import COLOURS, SHAPES, Scene, Shape, render
from mmrl.vlm.tasks.shapes_qa import QAItem
from mmrl.vlm.tasks.shapes_zoom import (
    KINDS,
    QUADRANTS,
    ShapesZoom,
    generate_zoom_items,
    quadrant_box,
    shape_in,
    shapes_zoom_reward,
    zoom_call,
)
from mmrl.vlm.tools import ToolContext, build_registry, parse_tool_call, zoom

WHITE = np.array([255, 255, 255])


def key(item):
    return item.question, str(item.meta["scene"])


def shape_for(item):
    """The scene's shape in the asked quadrant (by its centre)."""
    x0, y0, x1, y1 = item.meta["zoom_box"]
    scene = Scene.from_dict(item.meta["scene"])
    (shape,) = [s for s in scene.shapes if x0 <= s.x < x1 and y0 <= s.y < y1]
    return shape


def test_quadrant_boxes():
    assert quadrant_box("top left", 448) == (0, 0, 224, 224)
    assert quadrant_box("top right", 448) == (224, 0, 448, 224)
    assert quadrant_box("bottom left", 448) == (0, 224, 224, 448)
    assert quadrant_box("bottom right", 448) == (224, 224, 448, 448)
    # odd sizes: the four boxes still tile the image
    assert quadrant_box("bottom right", 101) == (50, 50, 101, 101)
    assert list(QUADRANTS) == ["top left", "top right", "bottom left", "bottom right"]
    with pytest.raises(ValueError, match="unknown quadrant 'middle'"):
        quadrant_box("middle", 448)


def test_zoom_call_text():
    assert zoom_call((0, 224, 224, 448)) == (
        '<tool_call>\n{"name": "zoom", "arguments": {"x0": 0, "y0": 224, "x1": 224, "y1": 448}}'
        "\n</tool_call>"
    )
    assert parse_tool_call(zoom_call([1, 2, 3, 4])) == (
        "zoom",
        {"x0": 1, "y0": 2, "x1": 3, "y1": 4},
    )


def test_generation_is_deterministic():
    a = generate_zoom_items(20, seed=3)
    b = generate_zoom_items(20, seed=3)
    c = generate_zoom_items(20, seed=4)
    assert [(x.question, x.answer, x.reference, x.meta) for x in a] == [
        (x.question, x.answer, x.reference, x.meta) for x in b
    ]
    assert all(x.images[0].tobytes() == y.images[0].tobytes() for x, y in zip(a, b))
    assert [key(x) for x in a] != [key(x) for x in c]
    # item i depends only on (split, seed, i)
    assert [key(x) for x in generate_zoom_items(5, seed=3)] == [key(x) for x in a[:5]]
    assert [key(x) for x in generate_zoom_items(5, seed=3, split="eval")] != [key(x) for x in a[:5]]


def test_one_shape_per_quadrant_fully_inside_with_margin():
    for item in generate_zoom_items(50, seed=0):
        scene = Scene.from_dict(item.meta["scene"])
        assert scene.size == 448 and len(scene.shapes) == 4
        for name in QUADRANTS:
            qx0, qy0, qx1, qy1 = quadrant_box(name, 448)
            inside = [s for s in scene.shapes if qx0 <= s.x < qx1 and qy0 <= s.y < qy1]
            assert len(inside) == 1
            (s,) = inside
            x0, y0, x1, y1 = s.box()
            assert 150 <= s.size <= 200 and float(x0).is_integer() and float(y0).is_integer()
            assert qx0 + 4 <= x0 and x1 <= qx1 - 4 and qy0 + 4 <= y0 and y1 <= qy1 - 4
            assert s.shape in SHAPES and s.colour in COLOURS


def test_item_fields_and_answers_match_the_scene():
    kinds_seen, quadrants_seen = set(), set()
    for item in generate_zoom_items(80, seed=1, kinds=["shape_at", "colour_at"]):
        assert isinstance(item, QAItem) and len(item.images) == 1
        assert item.images[0].mode == "RGB" and item.images[0].size == (448, 448)
        scene = Scene.from_dict(item.meta["scene"])
        assert item.images[0].tobytes() == render(scene).tobytes()
        quadrant = item.meta["params"]["quadrant"]
        assert item.meta["zoom_box"] == list(quadrant_box(quadrant, 448))
        assert all(type(v) is int for v in item.meta["zoom_box"])
        s = shape_for(item)
        kind = item.meta["kind"]
        if kind == "shape_at":
            assert item.question == f"What shape is in the {quadrant}?"
            assert item.answer == s.shape
        else:
            assert item.question == f"What colour is the shape in the {quadrant}?"
            assert item.answer == s.colour
        assert item.meta["answer"] == item.answer
        assert item.reference == f"a {s.colour} {s.shape} <answer>{item.answer}</answer>"
        json.dumps(item.meta)
        kinds_seen.add(kind)
        quadrants_seen.add(quadrant)
    assert kinds_seen == set(KINDS)
    assert quadrants_seen == set(QUADRANTS)


def test_default_kind_is_colour_at():
    items = generate_zoom_items(20, seed=0)
    assert {i.meta["kind"] for i in items} == {"colour_at"}
    assert ShapesZoom().kinds == ["colour_at"]


def test_zoom_crop_shows_the_asked_shape_and_the_downscaled_image_hides_it():
    for item in generate_zoom_items(12, seed=2, kinds=["shape_at", "colour_at"], shape_size=(48, 64)):
        s = shape_for(item)
        crop = zoom(*item.meta["zoom_box"], ctx=ToolContext(images=item.images))
        assert crop.size == (224, 224)
        pixels = np.asarray(crop).reshape(-1, 3)
        colour_pixels = (pixels == np.array(COLOURS[s.colour])).all(-1).sum()
        assert colour_pixels > 0.3 * s.size**2  # a triangle covers about half its box
        # every non-white pixel of the crop is the asked shape's
        non_white = pixels[(pixels != WHITE).any(-1)]
        assert (non_white == np.array(COLOURS[s.colour])).all()

        small = np.asarray(item.images[0].resize((112, 112))).astype(int)
        x0, y0, x1, y1 = (v // 4 for v in item.meta["zoom_box"])
        ys, xs = np.nonzero((small[y0:y1, x0:x1] != 255).any(-1))
        assert 0 < xs.max() - xs.min() + 1 < 20 and 0 < ys.max() - ys.min() + 1 < 20
        # the crop seen at 112 px: the shape is twice as large
        zoomed = np.asarray(crop.resize((112, 112))).astype(int)
        ys, xs = np.nonzero((zoomed != 255).any(-1))
        assert max(xs.max() - xs.min(), ys.max() - ys.min()) + 1 >= 24


def test_zoom_call_runs_through_the_registry():
    item = generate_zoom_items(1, seed=5)[0]
    res = build_registry(["zoom"]).call(zoom_call(item.meta["zoom_box"]), ToolContext(item.images))
    assert res.kind == "ok"
    (crop,) = res.content
    assert isinstance(crop, Image.Image)
    x0, y0, x1, y1 = item.meta["zoom_box"]
    np.testing.assert_array_equal(np.asarray(crop), np.asarray(item.images[0])[y0:y1, x0:x1])


def test_task_splits_are_held_out():
    task = ShapesZoom(seed=0, num_train=150, num_eval=40)
    train, evals = task.train_items(), task.eval_items()
    assert task.name == "shapes-zoom" and task.tools == ("zoom",)
    assert len(train) == 150 and len(evals) == 40
    assert not {key(x) for x in train} & {key(x) for x in evals}
    assert task.train_items() is train  # cached
    assert [key(x) for x in train] == [key(x) for x in generate_zoom_items(150, seed=0)]


def test_eval_skips_items_identical_to_train(monkeypatch):
    # red circles of one size with 2 positions per axis: 4**4 scenes x 4 questions, so a
    # train set of 300 items makes the raw eval stream collide with it
    monkeypatch.setattr(shapes_zoom, "SHAPES", ("circle",))
    monkeypatch.setattr(shapes_zoom, "COLOURS", {"red": COLOURS["red"]})
    settings = {"image_size": 74, "shape_size": (28, 28)}
    task = ShapesZoom(seed=0, num_train=300, num_eval=30, **settings)
    train_keys = {key(x) for x in task.train_items()}
    raw_eval = generate_zoom_items(30, seed=0, split="eval", **settings)
    assert any(key(x) in train_keys for x in raw_eval)  # the raw stream does collide
    evals = task.eval_items()
    assert len(evals) == 30 and not {key(x) for x in evals} & train_keys
    # one position per quadrant: only 4 distinct items exist, all taken by train
    task = ShapesZoom(seed=0, num_train=100, num_eval=1, image_size=72, shape_size=(28, 28))
    with pytest.raises(ValueError, match="could only make 0 of 1 held-out eval items"):
        task.eval_items()


def test_reward_uses_the_shapes_qa_atoms():
    reward = shapes_zoom_reward()
    assert reward.names == ["format", "answer"]
    item = generate_zoom_items(1, seed=0)[0]
    samples = [
        Sample(item.question, item.reference, item.meta),
        Sample(item.question, "<answer>nonsense</answer>", item.meta),
        Sample(item.question, item.answer, item.meta),
    ]
    scores = reward.score(samples)
    assert scores.values.tolist() == [[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]]
    assert scores.total.tolist() == pytest.approx([1.1, 0.1, 0.0])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"image_size": 100}, "image_size 100 is too small for shapes of up to 200 px"),
        ({"image_size": 415}, "must be at least 208 px"),
        ({"image_size": 0}, "image_size must be a positive integer"),
        ({"image_size": 448.0}, "image_size must be a positive integer"),
        ({"shape_size": (64, 48)}, "1 <= lo <= hi"),
        ({"shape_size": (0, 10)}, "1 <= lo <= hi"),
        ({"shape_size": (10.5, 20)}, "integers"),
        ({"shape_size": 48}, "shape_size must be (lo, hi)"),
        ({"kinds": ["count"]}, "unknown question kind 'count' (known: shape_at, colour_at)"),
        ({"kinds": []}, "at least one question kind"),
        ({"num_train": -1}, "num_train and num_eval must be >= 0"),
        ({"num_eval": -1}, "num_train and num_eval must be >= 0"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=None) as err:
        ShapesZoom(**kwargs)
    assert message in str(err.value)


def test_bad_arguments_generate():
    with pytest.raises(ValueError, match="n must be >= 0"):
        generate_zoom_items(-1, seed=0)
    with pytest.raises(ValueError, match="too small"):
        generate_zoom_items(1, seed=0, image_size=415)
    assert len(generate_zoom_items(1, seed=0, image_size=416)) == 1  # 208 = 200 + 2 * 4: fits


def test_shape_in_takes_the_centre_and_refuses_an_empty_quadrant():
    # 200 px: the split is at 100; a centre on x = 100 belongs to the right quadrants (a right edge is exclusive)
    scene = Scene([Shape("circle", "red", 100, 50, 20)], 200)
    assert shape_in(scene, "top right").colour == "red"
    for empty in ("top left", "bottom left", "bottom right"):
        with pytest.raises(ValueError, match=f"the {empty} quadrant holds 0 shapes, expected 1"):
            shape_in(scene, empty)


def test_eval_keeps_a_train_scene_asked_another_question(monkeypatch):
    # red circles of one size with one position per quadrant: a single scene, so the items
    # differ only by question (2 kinds x 4 quadrants = 8); one train item leaves 7 questions for eval
    monkeypatch.setattr(shapes_zoom, "SHAPES", ("circle",))
    monkeypatch.setattr(shapes_zoom, "COLOURS", {"red": COLOURS["red"]})
    task = ShapesZoom(seed=0, num_train=1, num_eval=7, image_size=72, shape_size=(28, 28),
                      kinds=["shape_at", "colour_at"])
    (train,) = task.train_items()
    evals = task.eval_items()
    assert len(evals) == 7 and len({str(x.meta["scene"]) for x in evals + [train]}) == 1
    assert train.question not in {x.question for x in evals}


def test_sizes_span_both_ends_and_no_items_is_no_error():
    sizes = {s.size for item in generate_zoom_items(10, seed=0, shape_size=(150, 151))
             for s in Scene.from_dict(item.meta["scene"]).shapes}
    assert sizes == {150.0, 151.0}  # 40 draws from U{150, 151}
    assert generate_zoom_items(0, seed=0) == []
