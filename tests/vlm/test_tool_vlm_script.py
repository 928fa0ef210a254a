"""The demonstrations of scripts/pretrain_tiny_tool_vlm.py: the right box by default, another
quadrant's box (and what its crop shows) with --p-wrong-box, a thought before the call with
--think, and the bundled model's random stream untouched when neither is asked for."""

import importlib.util
import random
from pathlib import Path

import pytest

from mmrl.vlm.tasks.scenes import COLOURS, Scene
from mmrl.vlm.tasks.shapes_zoom import ShapesZoom, quadrant_box, shape_in, zoom_call

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pretrain_tiny_tool_vlm.py"


def _script():
    spec = importlib.util.spec_from_file_location("pretrain_tiny_tool_vlm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ITEMS = ShapesZoom(seed=0, num_train=12, num_eval=1).train_items()


def test_default_demonstrations_zoom_the_asked_quadrant_and_draw_as_before():
    demo = _script().demonstration
    rng = random.Random(3)
    for item in ITEMS:
        turns = demo(item, rng, 1.0)
        assert turns[0] == zoom_call(item.meta["zoom_box"])
        assert turns[1].endswith(f"<answer>{item.answer}</answer>")
    # p_wrong_box = 0 draws exactly what the bundled model's build drew: one draw for the
    # tool, one for a guess
    a, b = random.Random(7), random.Random(7)
    for item in ITEMS:
        turns = demo(item, a, 0.5)
        if b.random() < 0.5:
            assert turns[0] == zoom_call(item.meta["zoom_box"])
        else:  # the items ask colours: a colour guessed without the tool
            guess = b.choice(list(COLOURS))
            assert turns == [f"a {guess} shape <answer>{guess}</answer>"]
    assert a.getstate() == b.getstate()


def test_wrong_box_zooms_another_quadrant_and_answers_its_crop():
    demo = _script().demonstration
    rng = random.Random(0)
    for item in ITEMS:
        scene, asked = Scene.from_dict(item.meta["scene"]), item.meta["params"]["quadrant"]
        call, answer = demo(item, rng, 1.0, p_wrong_box=1.0)
        assert call != zoom_call(item.meta["zoom_box"])
        seen = next(q for q in ("top left", "top right", "bottom left", "bottom right")
                    if call == zoom_call(quadrant_box(q, scene.size)))
        assert seen != asked
        assert answer.endswith(f"<answer>{shape_in(scene, seen).colour}</answer>")


def test_think_names_the_asked_quadrant_before_the_call():
    demo = _script().demonstration
    for item in ITEMS:
        call, _ = demo(item, random.Random(0), 1.0, think=True)
        asked = item.meta["params"]["quadrant"]
        assert call == f"Let me look at the {asked}. " + zoom_call(item.meta["zoom_box"])


def test_first_box_right_reads_the_first_zoom_call():
    first_box_right = _script().first_box_right
    item = ITEMS[0]
    right, other = item.meta["zoom_box"], quadrant_box("top left", 448)
    if list(other) == list(right):
        other = quadrant_box("bottom right", 448)
    obs = "\nuser\n<tool_response>\n\n</tool_response>\nassistant\n"
    assert first_box_right("Let me look. " + zoom_call(right) + obs + "a red square", item) is True
    assert first_box_right(zoom_call(other) + obs + zoom_call(right), item) is False  # the first call counts
    assert first_box_right("a red shape <answer>red</answer>", item) is None  # no call
    assert first_box_right('<tool_call>\n{"name": "zoom", "arguments": {"x0": 0', item) is None  # unreadable
    assert first_box_right('<tool_call>\n{"name": "calculator", "arguments": {}}\n</tool_call>', item) is None


def test_probabilities_out_of_range_are_refused_before_any_work(capsys):
    with pytest.raises(SystemExit):
        _script().main(["--p-wrong-box", "1.5", "--out", "/nonexistent/never-written"])
    assert "--p-wrong-box is a probability" in capsys.readouterr().err
