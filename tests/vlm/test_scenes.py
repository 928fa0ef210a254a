"""Scenes of coloured shapes (mmrl/vlm/tasks/scenes.py): seeding, geometry, rendering, wording."""

import random

import numpy as np
import pytest

from mmrl.vlm.tasks.scenes import (
    COLOURS,
    SHAPES,
    Scene,
    Shape,
    _apart,
    describe,
    is_above,
    is_left_of,
    random_scene,
    render,
)


def pixels(img) -> np.ndarray:
    return np.asarray(img, dtype=np.int64)  # [H, W, 3]


def test_same_seed_same_scene_and_pixels():
    a = random_scene(random.Random(7))
    b = random_scene(random.Random(7))
    c = random_scene(random.Random(8))
    assert a == b
    assert render(a).tobytes() == render(b).tobytes()
    assert a != c


def test_shapes_inside_bounds_and_apart():
    counts = set()
    for seed in range(300):
        scene = random_scene(random.Random(seed), size=112, min_shapes=1, max_shapes=4)
        counts.add(len(scene.shapes))
        assert 1 <= len(scene.shapes) <= 4
        for s in scene.shapes:
            assert s.shape in SHAPES and s.colour in COLOURS
            assert 22 <= s.size <= 32
            left, top, right, bottom = s.box()
            assert left >= 0 and top >= 0 and right <= 112 and bottom <= 112
        for i, a in enumerate(scene.shapes):
            for b in scene.shapes[i + 1 :]:
                # boxes do not overlap: separated along x or along y
                ax0, ay0, ax1, ay1 = a.box()
                bx0, by0, bx1, by1 = b.box()
                assert ax1 <= bx0 or bx1 <= ax0 or ay1 <= by0 or by1 <= ay0
    assert counts == {1, 2, 3, 4}  # every count occurs


def test_no_pixel_is_shared_by_two_shapes():
    # render each shape alone; the coloured pixel sets of one scene's shapes are disjoint
    for seed in range(20):
        scene = random_scene(random.Random(seed), min_shapes=3, max_shapes=4)
        covered = np.zeros((112, 112), dtype=np.int64)
        for s in scene.shapes:
            alone = pixels(render(Scene([s], 112)))
            covered += (alone != 255).any(axis=-1)
        assert covered.max() == 1


def test_render_colour_at_every_centre():
    for seed in range(100):
        scene = random_scene(random.Random(seed))
        px = pixels(render(scene))
        for s in scene.shapes:
            assert tuple(px[int(s.y), int(s.x)]) == COLOURS[s.colour], (seed, s)


def test_render_is_exact_solid_and_white():
    # a 20-pixel square with box [40, 60) x [10, 30): exactly 20 * 20 = 400 blue pixels,
    # every other pixel white (no anti-aliasing)
    scene = Scene([Shape("square", "blue", x=50.0, y=20.0, size=20.0)], size=64)
    img = render(scene)
    assert img.mode == "RGB" and img.size == (64, 64)
    px = pixels(img)
    blue = (px == COLOURS["blue"]).all(axis=-1)
    white = (px == 255).all(axis=-1)
    assert blue.sum() == 400
    assert (blue | white).all()
    assert blue[10:30, 40:60].all()


def test_triangle_points_up_and_circle_is_round():
    tri = pixels(render(Scene([Shape("triangle", "red", 32.0, 32.0, 30.0)], 64)))
    red = (tri == COLOURS["red"]).all(axis=-1)
    # box [17, 47): the apex is on the top row at the centre column, the base fills the
    # bottom row; the top corners of the box are white
    assert red[17, 31] or red[17, 32]
    assert red[46, 18:46].all()
    assert not red[17, 17] and not red[17, 46]
    circ = pixels(render(Scene([Shape("circle", "green", 32.0, 32.0, 30.0)], 64)))
    green = (circ == COLOURS["green"]).all(axis=-1)
    # area close to pi * 15^2 = 706.9; corners of the box white
    assert abs(int(green.sum()) - 707) < 50
    assert not green[17, 17] and green[32, 17] and green[17, 32]


def test_describe_lists_left_to_right():
    scene = Scene(
        [
            Shape("square", "blue", x=80.0, y=30.0, size=24.0),
            Shape("circle", "red", x=20.0, y=60.0, size=24.0),
            Shape("triangle", "yellow", x=50.0, y=90.0, size=24.0),
        ],
        112,
    )
    assert describe(scene) == "a red circle , a yellow triangle , a blue square"
    assert describe(Scene([], 112)) == "nothing"
    # random scenes: the listed order follows the x coordinates
    for seed in range(50):
        scene = random_scene(random.Random(seed))
        xs = sorted(scene.shapes, key=lambda s: (s.x, s.y))
        assert describe(scene) == " , ".join(f"a {s.colour} {s.shape}" for s in xs)


def test_relations_are_none_when_too_close():
    a = Shape("circle", "red", x=20.0, y=20.0, size=30.0)
    b = Shape("square", "blue", x=60.0, y=30.0, size=30.0)
    # dx = 40 >= 0.5 * 30 = 15: a is left of b; dy = 10 < 15: too close to say
    assert is_left_of(a, b) is True
    assert is_left_of(b, a) is False
    assert is_above(a, b) is None
    c = Shape("square", "blue", x=34.0, y=80.0, size=30.0)
    assert is_left_of(a, c) is None  # dx = 14 < 15
    assert is_above(a, c) is True


def test_scene_dict_round_trip():
    scene = random_scene(random.Random(3), max_shapes=4)
    assert Scene.from_dict(scene.to_dict()) == scene


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="too small"):
        random_scene(random.Random(0), size=30, shape_size=(22, 32))
    with pytest.raises(ValueError, match="min_shapes"):
        random_scene(random.Random(0), min_shapes=3, max_shapes=2)
    with pytest.raises(ValueError, match="could not place"):
        random_scene(random.Random(0), size=40, min_shapes=4, max_shapes=4)
    with pytest.raises(ValueError, match="unknown shape"):
        render(Scene([Shape("star", "red", 20.0, 20.0, 10.0)], 40))


# ---------------------------------------------------------------------------- audit: what the suite let through


class ScriptedRng:
    """Stands in for random.Random: randint returns the scripted values in order (each checked
    against the bounds asked for, which are recorded), choice the first option."""

    def __init__(self, values):
        self.values = list(values)
        self.bounds = []

    def randint(self, a, b):
        v = self.values.pop(0)
        self.bounds.append((a, b))
        assert a <= v <= b, (a, b, v)
        return v

    def choice(self, seq):
        return seq[0]


def test_a_shape_gets_fifty_tries_then_is_dropped():
    # n = 2 shapes of side 22; the first at box [2, 24) x [2, 24); the second tries the same
    # box (overlapping) 49 times, then [60, 82) x [60, 82): placed on its 50th try
    rng = ScriptedRng([2, 22, 2, 2] + [22, 2, 2] * 49 + [22, 60, 60])
    scene = random_scene(rng, min_shapes=1, max_shapes=2, shape_size=(22, 22))
    assert [(s.x, s.y) for s in scene.shapes] == [(13.0, 13.0), (71.0, 71.0)] and rng.values == []
    # 50 overlapping tries: the second shape is dropped; one shape still meets min_shapes
    rng = ScriptedRng([2, 22, 2, 2] + [22, 2, 2] * 50)
    scene = random_scene(rng, min_shapes=1, max_shapes=2, shape_size=(22, 22))
    assert [(s.x, s.y) for s in scene.shapes] == [(13.0, 13.0)] and rng.values == []


def test_a_scene_short_of_min_shapes_is_drawn_again():
    # the first draw places one of its 2 shapes (the second overlaps 50 times): drawn again
    first = [2, 22, 2, 2] + [22, 2, 2] * 50
    second = [2, 22, 2, 2, 22, 60, 60]
    rng = ScriptedRng(first + second)
    scene = random_scene(rng, min_shapes=2, max_shapes=2, shape_size=(22, 22))
    assert [(s.x, s.y) for s in scene.shapes] == [(13.0, 13.0), (71.0, 71.0)] and rng.values == []


def test_boxes_keep_two_pixels_from_the_border_on_integer_pixels():
    # a side of 23 in a 112 image: left and top drawn from [2, 112 - 2 - 23] = [2, 87]; the
    # centre of box [2, 25) is 2 + 23 / 2 = 13.5
    rng = ScriptedRng([1, 23, 2, 87])
    (s,) = random_scene(rng, min_shapes=1, max_shapes=1, shape_size=(22, 32)).shapes
    assert rng.bounds == [(1, 1), (22, 32), (2, 87), (2, 87)]
    assert (s.x, s.y, s.size) == (13.5, 98.5, 23.0)
    assert s.box() == (2.0, 87.0, 25.0, 110.0)


def test_shape_size_and_image_size_bounds_are_inclusive():
    # lo = hi is allowed; lo = 0 is not; an image of exactly hi + 2 * 2 pixels is enough
    scene = random_scene(random.Random(0), min_shapes=2, max_shapes=2, shape_size=(24, 24))
    assert [s.size for s in scene.shapes] == [24.0, 24.0]
    with pytest.raises(ValueError, match="shape_size"):
        random_scene(random.Random(0), shape_size=(0, 5))
    (s,) = random_scene(random.Random(0), size=36, min_shapes=1, max_shapes=1, shape_size=(32, 32)).shapes
    assert s.box()[0] == 2 and s.box()[1] == 2  # the one place a side of 32 fits: [2, 34)
    assert random_scene(random.Random(0), min_shapes=0, max_shapes=0).shapes == []


def test_apart_needs_a_gap_of_four_pixels_along_x_or_y():
    a = Shape("square", "red", x=10.0, y=10.0, size=20.0)  # box [0, 20) x [0, 20)
    for dx, dy in [(24, 0), (-24, 0), (0, 24), (0, -24)]:  # a gap of exactly 4, each side
        b = Shape("square", "blue", x=10.0 + dx, y=10.0 + dy, size=20.0)
        assert _apart(a, b) and _apart(b, a), (dx, dy)
    for dx, dy in [(23, 0), (-23, 0), (0, 23), (0, -23), (23, 23)]:  # a gap of 3
        b = Shape("square", "blue", x=10.0 + dx, y=10.0 + dy, size=20.0)
        assert not _apart(a, b) and not _apart(b, a), (dx, dy)


def test_relations_use_the_larger_size_and_hold_at_the_margin():
    big = Shape("circle", "red", x=20.0, y=20.0, size=40.0)
    small = Shape("square", "blue", x=35.0, y=35.0, size=10.0)
    # |d| = 15 < 0.5 * max(40, 10) = 20: too close to say (the smaller size's 5 would say)
    assert is_left_of(big, small) is None and is_above(small, big) is None
    c = Shape("square", "blue", x=35.0, y=35.0, size=30.0)
    d = Shape("square", "blue", x=20.0, y=20.0, size=30.0)
    # |d| = 15 = 0.5 * 30 exactly: the relation holds
    assert is_left_of(d, c) is True and is_above(c, d) is False


def test_describe_breaks_ties_top_to_bottom_and_render_refuses_unknown_colours():
    scene = Scene([Shape("square", "blue", x=40.0, y=80.0, size=20.0),
                   Shape("circle", "red", x=40.0, y=20.0, size=20.0)], 112)
    assert describe(scene) == "a red circle , a blue square"  # same x: the upper one first
    with pytest.raises(ValueError, match="unknown colour 'purple'"):
        render(Scene([Shape("circle", "purple", 20.0, 20.0, 10.0)], 40))
