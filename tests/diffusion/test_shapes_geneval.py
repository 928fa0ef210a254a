"""shapes-geneval (diffusion_rl/tasks/shapes_geneval.py): grammar and atoms, prompt
sampling, rendering, the detector on drawings made here with PIL directly, near
misses, causal gating, the core Reward and the evaluation metrics."""

import io
import math
import random

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFilter

import diffusion_rl.tasks.shapes_geneval as sg
from diffusion_rl.tasks import shapes_verifier
from diffusion_rl.tasks.shapes_geneval import (
    COLOURS,
    IMAGE_SIZE,
    RELATIONS,
    SHAPES,
    Atom,
    Object,
    ObjectSpec,
    atom_accuracy,
    detect,
    evaluate_atoms,
    format_prompt,
    make_scene,
    parse_objects,
    parse_prompt,
    relation_holds,
    render,
    reward_atoms,
    sample_prompts,
    score_image,
    shapes_geneval_reward,
)
from mmrl.core.rewards import Reward, RewardError, Sample

# ---------------------------------------------------------------------------- drawing helpers

# Not the renderer's RGB values: the verifier must judge any image of the style.
HAND = {"red": (255, 0, 0), "green": (0, 170, 0), "blue": (0, 0, 255), "yellow": (255, 220, 0)}


def polygon(shape: str, cx: float, cy: float, s: float, angle: float) -> list:
    """Vertices of a square of side s or an upright triangle of base and height s,
    centred on (cx, cy) and rotated by angle degrees."""
    if shape == "square":
        pts = [(-s / 2, -s / 2), (s / 2, -s / 2), (s / 2, s / 2), (-s / 2, s / 2)]
    else:
        pts = [(0, -s / 2), (s / 2, s / 2), (-s / 2, s / 2)]
    a = math.radians(angle)
    return [
        (cx + x * math.cos(a) - y * math.sin(a), cy + x * math.sin(a) + y * math.cos(a))
        for x, y in pts
    ]


def draw(size: int, items, blur: float = 0.0) -> Image.Image:
    """items: (shape, colour name or RGB, cx, cy, s, angle). White background."""
    img = Image.new("RGB", (size, size), "white")
    d = ImageDraw.Draw(img)
    for shape, colour, cx, cy, s, angle in items:
        fill = HAND[colour] if isinstance(colour, str) else colour
        if shape == "circle":
            d.ellipse((cx - s / 2, cy - s / 2, cx + s / 2, cy + s / 2), fill=fill)
        else:
            d.polygon(polygon(shape, cx, cy, s, angle), fill=fill)
    return img.filter(ImageFilter.GaussianBlur(blur)) if blur else img


def kinds(img) -> list[tuple[str, str]]:
    return sorted((o.colour, o.shape) for o in detect(img))


# ---------------------------------------------------------------------------- grammar


def atom_table(prompt):
    return [(a.kind, a.name, a.value, a.parents) for a in parse_prompt(prompt)]


def test_parse_single_phrase():
    assert atom_table("a red circle") == [
        ("exist", "exist[circle]", "circle", ()),
        ("colour", "colour[red circle]", "red", ("exist[circle]",)),
        ("count", "count[red circle]=1", 1, ("colour[red circle]",)),
    ]


def test_parse_relation_prompt():
    assert atom_table("two red circles left of a blue square") == [
        ("exist", "exist[circle]", "circle", ()),
        ("colour", "colour[red circle]", "red", ("exist[circle]",)),
        ("count", "count[red circle]=2", 2, ("colour[red circle]",)),
        ("exist", "exist[square]", "square", ()),
        ("colour", "colour[blue square]", "blue", ("exist[square]",)),
        ("count", "count[blue square]=1", 1, ("colour[blue square]",)),
        (
            "relation",
            "relation[red circle left of blue square]",
            "left of",
            ("colour[red circle]", "colour[blue square]"),
        ),
    ]
    rel = parse_prompt("two red circles left of a blue square")[-1]
    assert rel.objects == (ObjectSpec(2, "red", "circle"), ObjectSpec(1, "blue", "square"))


def test_parse_tolerates_case_spaces_plurals_article_and_period():
    canonical = atom_table("a yellow triangle above three green squares")
    for messy in (
        "  An YELLOW   Triangle above THREE green squares. ",
        "one yellow triangles above three green square.",
        "a yellow triangle\tabove three green squares",
    ):
        assert atom_table(messy) == canonical


@pytest.mark.parametrize(
    "word,n", [("a", 1), ("an", 1), ("one", 1), ("two", 2), ("three", 3), ("four", 4)]
)
@pytest.mark.parametrize("shape", SHAPES)
def test_parse_every_count_and_shape(word, n, shape):
    plural = shape + ("s" if n > 1 else "")
    atoms = parse_prompt(f"{word} blue {plural}")
    assert [a.name for a in atoms] == [
        f"exist[{shape}]",
        f"colour[blue {shape}]",
        f"count[blue {shape}]={n}",
    ]


@pytest.mark.parametrize("relation", RELATIONS)
def test_parse_every_relation(relation):
    objects, rel = parse_objects(f"a green circle {relation} two yellow triangles")
    assert rel == relation
    assert objects == [ObjectSpec(1, "green", "circle"), ObjectSpec(2, "yellow", "triangle")]
    assert parse_prompt(f"a green circle {relation} a red square")[-1].name == (
        f"relation[green circle {relation} red square]"
    )


def test_parse_to_the_left_of():
    assert parse_objects("a red circle to the left of a blue square")[1] == "left of"
    assert parse_objects("a red circle to the right of a blue square")[1] == "right of"


def test_shared_atoms_one_exist_per_shape_and_summed_same_kind_counts():
    # same shape, two colours: one exist atom, two colour atoms under it
    names = [a.name for a in parse_prompt("a red circle left of a blue circle")]
    assert names == [
        "exist[circle]",
        "colour[red circle]",
        "count[red circle]=1",
        "colour[blue circle]",
        "count[blue circle]=1",
        "relation[red circle left of blue circle]",
    ]
    # the same kind on both sides: one colour atom, the count is the total (1 + 2)
    atoms = parse_prompt("a red circle left of two red circles")
    assert [a.name for a in atoms] == [
        "exist[circle]",
        "colour[red circle]",
        "count[red circle]=3",
        "relation[red circle left of red circle]",
    ]
    assert atoms[-1].parents == ("colour[red circle]",)
    for prompt in (
        "four blue squares below a blue square",
        "two red circles left of a blue square",
    ):
        names = [a.name for a in parse_prompt(prompt)]
        assert len(names) == len(set(names))  # unique


@pytest.mark.parametrize(
    "prompt,unparsed",
    [
        ("a purple circle", "'purple circle'"),
        ("two red circles next to a blue square", "'next to a blue square'"),
        ("five red circles", "'five red circles'"),
        ("a red hexagon", "'hexagon'"),
        ("a red circle left of a blue square please", "'please'"),
        ("red circle", "'red circle'"),
        ("a red circle left a blue square", "'left a blue square'"),
        ("a red circle and a blue square", "'and a blue square'"),
        ("two red", "nothing after 'two red'"),
        ("a red circle left of", "nothing after 'a red circle left of'"),
        ("   ", "empty"),
        ("a red circle..", "'circle.'"),
    ],
)
def test_parse_errors_name_the_unparsed_words(prompt, unparsed):
    with pytest.raises(ValueError, match="parse|empty") as err:
        parse_prompt(prompt)
    assert unparsed in str(err.value)


def test_parse_rejects_non_strings():
    with pytest.raises(TypeError, match="str"):
        parse_prompt(3)
    with pytest.raises(TypeError):
        score_image(render("a red circle"), None)


def test_format_prompt_round_trips():
    objs = [ObjectSpec(2, "red", "circle"), ObjectSpec(1, "blue", "square")]
    text = format_prompt(objs, "left of")
    assert text == "two red circles left of a blue square"
    assert parse_objects(text) == (objs, "left of")
    assert format_prompt([ObjectSpec(4, "yellow", "triangle")]) == "four yellow triangles"
    with pytest.raises(ValueError):
        format_prompt(objs)  # two phrases need a relation
    with pytest.raises(ValueError):
        format_prompt(objs, "near")


def test_parse_error_quotes_the_words_from_where_the_relation_should_start():
    """"to the" opens a relation; when none follows, the error quotes the words from "to" (where
    the relation was expected), not from where the scan of "to the" stopped."""
    with pytest.raises(ValueError, match="unparsed words 'to the left a blue square'"):
        parse_prompt("a red circle to the left a blue square")


def test_format_prompt_counts_the_phrases():
    one = ObjectSpec(1, "red", "circle")
    with pytest.raises(ValueError, match="one phrase, got 0"):
        format_prompt([])
    with pytest.raises(ValueError, match="two phrases, got 3"):
        format_prompt([one, one, one], "left of")
    with pytest.raises(ValueError, match="two phrases, got 1"):
        format_prompt([one], "left of")


# ---------------------------------------------------------------------------- prompt sampling


def test_sample_prompts_seeded_prefix_stable_and_parseable():
    a = sample_prompts(50, seed=3)
    assert a == sample_prompts(50, seed=3)
    assert sample_prompts(20, seed=3) == a[:20]  # a longer list extends a shorter one
    assert a != sample_prompts(50, seed=4)
    assert a != sample_prompts(50, seed=3, split="eval")
    for p in a:
        parse_prompt(p)


def test_disjoint_splits_share_no_prompt_and_the_task_uses_them_by_default(tmp_path):
    """Drawn independently from 48 one-phrase prompts and ~2,100 relational ones, 43 of the 64
    default held-out prompts were training prompts too; disjoint splits by a hash of the prompt."""
    from diffusion_rl import backend
    from diffusion_rl.config import DiffusionTrainConfig
    from diffusion_rl.tasks.shapes_geneval import split_of
    from mmrl.core.config import load_config

    train, held_out = sample_prompts(2000, 0, disjoint=True), sample_prompts(64, 0, split="eval", disjoint=True)
    assert not set(train) & set(held_out)
    assert {split_of(p) for p in train} == {"train"} and {split_of(p) for p in held_out} == {"eval"}
    assert sample_prompts(20, 0, split="eval", disjoint=True) == held_out[:20]  # still a stable prefix
    overlapping = set(sample_prompts(2000, 0)) & set(sample_prompts(64, 0, split="eval"))
    assert len(overlapping) > 20  # what the old default held out
    one = {"relation_p": 0.0, "colours": ["red"], "shapes": ["square"], "max_count": 1}  # "a red square" alone
    assert split_of("a red square") == "train" and sample_prompts(2, 0, disjoint=True, **one) == ["a red square"] * 2
    with pytest.raises(ValueError, match="gave 0 eval prompts of the 3 asked for.*too few prompts in the split"):
        sample_prompts(3, 0, split="eval", disjoint=True, **one)
    cfg = load_config(DiffusionTrainConfig, defaults=backend.DEFAULT_CONFIG, overrides=[f"output_dir={tmp_path}"])
    task = backend.build_task(cfg)
    assert cfg.task.held_out == "disjoint" and not set(task.train) & set(task.eval_prompts)
    cfg = load_config(DiffusionTrainConfig, defaults=backend.DEFAULT_CONFIG,
                      overrides=[f"output_dir={tmp_path}", "task.held_out=overlapping"])
    assert backend.build_task(cfg).eval_prompts == sample_prompts(cfg.task.num_eval, 0, split="eval")


def test_split_of_is_pinned_so_held_out_sets_stay_the_same_across_versions():
    """split_of hashes a salted prompt: a changed salt, hash or threshold silently moves prompts
    between the train and held-out sets of runs already made (and their checkpoints' evaluations)."""
    from diffusion_rl.tasks.shapes_geneval import split_of

    pinned = {
        "a red square": "train",
        "a green circle right of a blue circle": "eval",
        "two red circles above two yellow squares": "eval",
        "a yellow circle": "eval",
        "two blue circles left of two yellow circles": "eval",
    }
    assert {p: split_of(p) for p in pinned} == pinned
    drawn = sample_prompts(40, 0)
    assert [p for p in drawn if split_of(p) == "eval"][:3] == list(pinned)[1:4]


def test_sample_prompts_guards_name_the_bad_setting():
    with pytest.raises(ValueError, match="need at least two"):
        sample_prompts(3, colours=["red"], shapes=["square"])  # one kind: no relation prompt exists
    assert sample_prompts(3, colours=["red"], shapes=["square"], relation_p=0.0, max_count=1) == ["a red square"] * 3
    for key in ("max_count", "max_relation_count"):
        with pytest.raises(ValueError, match=f"{key} must be in 1..4, got 0"):
            sample_prompts(3, relation_p=0.5, **{key: 0})
    assert all(" of " in p or " above " in p or " below " in p for p in sample_prompts(20, relation_p=1.0))
    with pytest.raises(ValueError, match="relation_p must be in"):
        sample_prompts(3, relation_p=1.01)


def test_sample_prompts_cover_every_atom_type_and_word():
    prompts = sample_prompts(400, seed=0)
    parsed = [parse_objects(p) for p in prompts]
    with_relation = sum(rel is not None for _, rel in parsed)
    assert 150 <= with_relation <= 250  # relation_p = 0.5
    kinds_seen = {a.kind for p in prompts for a in parse_prompt(p)}
    assert kinds_seen == {"exist", "colour", "count", "relation"}
    objs = [o for objects, _ in parsed for o in objects]
    assert {o.colour for o in objs} == set(COLOURS)
    assert {o.shape for o in objs} == set(SHAPES)
    assert {rel for _, rel in parsed} == set(RELATIONS) | {None}
    assert {objects[0].count for objects, rel in parsed if rel is None} == {1, 2, 3, 4}
    for objects, rel in parsed:
        if rel is not None:
            assert objects[0].kind != objects[1].kind
            assert all(o.count <= 2 for o in objects)  # max_relation_count
    only = sample_prompts(30, seed=1, relation_p=0.0, colours=["red"], shapes=["square"])
    assert all(parse_objects(p)[0][0].kind == "red square" for p in only)
    with pytest.raises(ValueError, match="colours"):
        sample_prompts(3, colours=["purple"])
    with pytest.raises(ValueError, match="relation_p"):
        sample_prompts(3, relation_p=1.5)


def test_sample_prompts_refuses_an_empty_vocabulary():
    for key in ("colours", "shapes", "relations"):
        with pytest.raises(ValueError, match=f"{key} must be a non-empty subset"):
            sample_prompts(3, relation_p=0.0, **{key: []})


# ---------------------------------------------------------------------------- rendering


def test_renders_of_100_random_prompts_score_one_on_every_atom():
    prompts = sample_prompts(100, seed=11)
    for i, prompt in enumerate(prompts):
        img = render(prompt, seed=i)
        assert img.size == (IMAGE_SIZE, IMAGE_SIZE) and img.mode == "RGB"
        scores = score_image(img, prompt)
        assert list(scores) == [a.name for a in parse_prompt(prompt)]
        assert all(v == 1.0 for v in scores.values()), (prompt, i, scores)


@pytest.mark.parametrize("size", [64, 128, 256])
def test_renders_at_other_sizes_and_without_antialiasing(size):
    for i, prompt in enumerate(sample_prompts(10, seed=size)):
        for antialias in (True, False):
            img = render(prompt, seed=i, size=size, antialias=antialias)
            assert img.size == (size, size)
            assert min(score_image(img, prompt).values()) == 1.0, (prompt, antialias)


def test_box_mask_is_the_union_of_the_boxes_and_covers_every_drawn_pixel():
    scene = make_scene("two red circles left of a blue square", seed=3)
    mask = scene.box_mask()
    assert mask.shape == (scene.size, scene.size) and mask.dtype == bool
    ink = (np.asarray(render(scene, antialias=False)) != 255).any(-1)
    assert ink.any() and not (ink & ~mask).any()  # every drawn pixel lies in a box
    area = sum((s.box()[2] - s.box()[0]) * (s.box()[3] - s.box()[1]) for s in scene.shapes)
    assert mask.sum() == round(area)  # the boxes are apart, so their areas add up


def test_make_scene_matches_the_prompt_and_is_deterministic():
    prompt = "three yellow triangles below two green squares"
    scene = make_scene(prompt, seed=5)
    assert scene == make_scene(prompt, seed=5)
    assert scene != make_scene(prompt, seed=6)
    assert render(scene).tobytes() == render(prompt, seed=5).tobytes()
    got = sorted((s.colour, s.shape) for s in scene.shapes)
    assert got == [("green", "square")] * 2 + [("yellow", "triangle")] * 3
    for s in scene.shapes:
        x0, y0, x1, y1 = s.box()
        assert 0 <= x0 and 0 <= y0 and x1 <= scene.size and y1 <= scene.size
    # boxes stay apart (>= 2 px gap)
    boxes = [s.box() for s in scene.shapes]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert a[2] + 2 <= b[0] or b[2] + 2 <= a[0] or a[3] + 2 <= b[1] or b[3] + 2 <= a[1]
    # triangles below squares: every triangle box is below every square box
    tri = [s for s in scene.shapes if s.shape == "triangle"]
    sq = [s for s in scene.shapes if s.shape == "square"]
    assert all(t.box()[1] >= q.box()[3] for t in tri for q in sq)


@pytest.mark.parametrize(
    "prompt",
    ["four red circles left of four blue squares", "four red triangles above four red triangles"],
)
def test_crowded_prompts_still_render_correctly(prompt):
    img = render(prompt, seed=0)
    assert min(score_image(img, prompt).values()) == 1.0


def test_render_rejects_bad_input():
    with pytest.raises(TypeError):
        render(42)
    with pytest.raises(ValueError, match="purple"):
        render("a purple circle")


# ---------------------------------------------------------------------------- detector


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "size,side,blur",
    [
        (64, 12, 0.0),
        (64, 18, 0.0),
        (64, 26, 1.0),
        (128, 40, 0.0),
        (256, 60, 2.0),
        (256, 110, 0.0),
        (512, 150, 4.0),
    ],
)
@pytest.mark.parametrize("angle", [0, 20, 45, 90, 180])
def test_detector_classifies_shapes_of_any_size_and_rotation(shape, size, side, blur, angle):
    c = size / 2 + 0.3
    img = draw(size, [(shape, "blue", c, c, side, angle)], blur=blur)
    objs = detect(img)
    assert [(o.colour, o.shape) for o in objs] == [("blue", shape)], objs
    ideal = {"circle": math.pi / 4, "square": 1.0, "triangle": 0.5}[shape] * side * side
    assert abs(objs[0].area - ideal) <= 0.25 * ideal + 4 * side  # edge pixels either way
    cx, cy = objs[0].center
    assert abs(cx - c) < 0.2 * side + 1 and abs(cy - c) < 0.2 * side + 1


def test_detector_features_match_the_ideal_shapes():
    """fill: hull / minimum rectangle (disc pi/4, square 1, triangle 1/2); roundness:
    farthest vertex / nearest edge from the centroid (disc 1, square sqrt 2, triangle 2+)."""
    img = draw(
        256,
        [
            ("circle", "red", 50, 60, 80, 0),
            ("square", "green", 170, 60, 80, 30),
            ("triangle", "blue", 110, 190, 90, 0),
        ],
    )
    by_shape = {o.shape: o for o in detect(img)}
    assert by_shape["circle"].fill == pytest.approx(math.pi / 4, abs=0.04)
    assert by_shape["circle"].roundness == pytest.approx(1.0, abs=0.08)
    assert by_shape["square"].fill == pytest.approx(1.0, abs=0.04)
    assert by_shape["square"].roundness == pytest.approx(math.sqrt(2), abs=0.1)
    assert by_shape["triangle"].fill == pytest.approx(0.5, abs=0.05)
    assert by_shape["triangle"].roundness > 1.9
    for o in by_shape.values():
        assert o.solidity > 0.9 and o.aspect < 1.3  # a triangle's rectangle may lie on a slant side


def test_detector_colours_pure_palette_variants_and_ignores_unknown_colours():
    known = {
        "red": (200, 20, 60),
        "green": (90, 200, 90),
        "blue": (20, 110, 230),
        "yellow": (250, 240, 40),
    }  # off-palette shades of the four colours
    unknown = [
        (255, 140, 0),
        (150, 40, 200),
        (0, 200, 200),
        (0, 0, 0),
        (128, 128, 128),
        (255, 160, 200),
    ]  # orange, purple, cyan, black, grey, pink
    items = [("circle", rgb, 20 + 42 * i, 30, 30, 0) for i, rgb in enumerate(known.values())]
    items += [
        ("square", rgb, 20 + 42 * (i % 6), 100 + 60 * (i // 6), 30, 0)
        for i, rgb in enumerate(unknown)
    ]
    objs = detect(draw(256, items))
    assert sorted(o.colour for o in objs) == sorted(known)
    assert all(o.shape == "circle" for o in objs)


def test_detector_ignores_a_coloured_background_and_bars():
    assert detect(Image.new("RGB", (64, 64), HAND["red"])) == []  # not "a red square"
    for size in (64, 256):  # a disc drawn edge to edge spans the image too, but it is a disc
        assert kinds(draw(size, [("circle", "red", size / 2, size / 2, size, 0)])) == [("red", "circle")]
    holes = Image.new("RGB", (128, 128), HAND["red"])  # a coloured background behind shapes: still none
    ImageDraw.Draw(holes).ellipse((20, 20, 60, 60), fill=HAND["blue"])
    assert kinds(holes) == [("blue", "circle")]
    bar = draw(128, [("square", "blue", 64, 64, 30, 0)])
    ImageDraw.Draw(bar).rectangle((10, 100, 118, 112), fill=HAND["green"])  # 9:1
    assert kinds(bar) == [("blue", "square")]
    assert [o.shape for o in detect(bar, include_unknown=True)] == ["square", None]


def test_detector_separates_touching_shapes_of_one_colour():
    touching_discs = draw(
        256, [("circle", "red", 70, 128, 64, 0), ("circle", "red", 134, 128, 64, 0)]
    )
    assert kinds(touching_discs) == [("red", "circle")] * 2
    disc_and_square = draw(
        256, [("circle", "red", 70, 110, 64, 0), ("square", "red", 137, 128, 70, 0)]
    )
    assert kinds(disc_and_square) == [("red", "circle"), ("red", "square")]
    triangles = draw(64, [("triangle", "blue", 18, 20, 20, 0), ("triangle", "blue", 38, 20, 20, 0)])
    assert kinds(triangles) == [("blue", "triangle")] * 2


def red_blocks(size, *rects):
    """A white image with red blocks, rects as ImageDraw's (x0, y0, x1, y1), inclusive."""
    img = Image.new("RGB", (size, size), "white")
    for rect in rects:
        ImageDraw.Draw(img).rectangle(rect, fill=HAND["red"])
    return img


def test_a_knob_on_a_neck_is_a_second_object_only_if_its_core_rises_enough():
    """No downsampling (crop under SPLIT_RES). Depth peels one layer per erosion: a 30 x 30 square
    has depth 15, so a core must rise max(2, 0.15 x 15) = 2.25 above the threshold. A 2-px neck
    (depth 1) cuts the knob off at t = 2: an 8 x 8 knob (depth 4) rises 2, a ripple of one object;
    a 9 x 9 knob (depth 5) rises 3, a second square."""
    body, neck = (4, 17, 33, 46), (34, 31, 35, 32)
    ripple = detect(red_blocks(64, body, neck, (36, 28, 43, 35)))  # 8 x 8
    assert [(o.shape, o.area) for o in ripple] == [("square", 900 + 4 + 64)]
    second = detect(red_blocks(64, body, neck, (36, 28, 44, 36)))  # 9 x 9
    assert [o.shape for o in second] == ["square", "square"] and sum(o.area for o in second) == 900 + 4 + 81


def test_a_ripple_core_does_not_end_the_search_for_two_bodies():
    """Two 20 x 20 squares (depth 10) joined by a 6-px-wide neck (depth 3), and a 6 x 6 knob
    (depth 3) on a 2-px neck under the left one. At t = 2 the knob is cut off but rises only 1 < 2:
    not a body, so t goes on; at t = 4 the squares part, each rising 6: two objects (the knob
    goes with the nearer one)."""
    img = red_blocks(64, (4, 20, 23, 39), (24, 27, 27, 32), (28, 20, 47, 39), (12, 40, 13, 41), (10, 42, 15, 47))
    objs = detect(img)
    assert [o.shape for o in objs] == ["square", "square"]
    assert sum(o.area for o in objs) == 400 + 24 + 400 + 4 + 36


def test_a_split_piece_under_the_minimum_area_is_no_object():
    """256 px (minimum area 0.003 x 256^2 = 196.6): a 26 x 26 square (depth 13, rise
    max(2, 1.95) = 2) with a 7 x 7 knob (depth 4) on a 2-px neck. At t = 2 both cores rise
    enough, but the knob's piece (~50 px) is under the minimum area: no split, one object."""
    objs = detect(red_blocks(256, (100, 100, 125, 125), (126, 112, 127, 113), (128, 109, 134, 115)))
    assert [(o.shape, o.area) for o in objs] == [("square", 676 + 4 + 49)]


def test_detector_ignores_specks_noise_jpeg_and_blurred_fringes():
    rng = np.random.default_rng(0)
    prompt = "two red circles left of a blue square"
    img = np.asarray(render(prompt, seed=3)).astype(float)
    noisy = img + rng.normal(0, 12, img.shape)
    salt = rng.random(img.shape[:2]) < 0.02  # 2% of pixels: random colours
    noisy[salt] = rng.integers(0, 256, (int(salt.sum()), 3))
    noisy = Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))
    assert min(score_image(noisy, prompt).values()) == 1.0
    buf = io.BytesIO()
    render(prompt, seed=3).resize((256, 256)).save(buf, "JPEG", quality=30)
    assert min(score_image(Image.open(buf), prompt).values()) == 1.0
    # red touching green, blurred: the blend between them is orange-ish, not a yellow object
    fringe = draw(64, [("circle", "red", 20, 32, 20, 0), ("square", "green", 40, 32, 20, 0)], 1.0)
    assert kinds(fringe) == [("green", "square"), ("red", "circle")]


def test_detector_random_hand_drawn_scenes():
    """Random sizes, rotations, colour shades, blur and noise, 64 to 512 px."""
    rng = random.Random(0)
    nrng = np.random.default_rng(0)
    for _ in range(40):
        n = rng.choice([64, 128, 256, 512])
        items, boxes = [], []
        for _ in range(rng.randint(1, 4)):
            s = rng.uniform(0.18, 0.33) * n
            cx, cy = rng.uniform(0.75 * s, n - 0.75 * s), rng.uniform(0.75 * s, n - 0.75 * s)
            box = (cx - 0.75 * s, cy - 0.75 * s, cx + 0.75 * s, cy + 0.75 * s)
            if any(
                not (box[2] < b[0] or b[2] < box[0] or box[3] < b[1] or b[3] < box[1])
                for b in boxes
            ):
                continue
            boxes.append(box)
            colour = rng.choice(list(COLOURS))
            rgb = tuple(int(np.clip(v + rng.uniform(-25, 25), 0, 255)) for v in COLOURS[colour])
            items.append((rng.choice(SHAPES), colour, rgb, cx, cy, s, rng.uniform(0, 360)))
        img = draw(
            n,
            [(sh, rgb, cx, cy, s, a) for sh, _, rgb, cx, cy, s, a in items],
            blur=rng.uniform(0, 1) * n / 64,
        )
        noisy = np.asarray(img) + nrng.normal(0, 8, (n, n, 3))
        img = Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))
        assert kinds(img) == sorted((c, sh) for sh, c, *_ in items)


def test_image_modes_arrays_and_non_images():
    img = render("a red circle above a green triangle", seed=0)
    want = [("green", "triangle"), ("red", "circle")]
    for mode in ("RGBA", "P", "CMYK"):
        assert kinds(img.convert(mode)) == want, mode
    assert kinds(np.asarray(img)) == want
    assert kinds(np.asarray(img) / 255.0) == want  # float in [0, 1]
    for dtype in (np.int64, np.int32, np.int16):  # 8-bit values in a wider integer type (read as near-black)
        assert kinds(np.asarray(img).astype(dtype)) == want, dtype
    assert kinds(np.asarray(img).astype(np.uint32) * 257) == want  # 16-bit values
    rgba = np.zeros((64, 64, 4), np.uint8)  # transparent black = white background
    rgba[10:40, 10:40] = (*HAND["blue"], 255)
    assert kinds(Image.fromarray(rgba, "RGBA")) == [("blue", "square")]
    grey16 = Image.fromarray(np.asarray(img.convert("L")).astype(np.uint16) * 257)
    for grey in (img.convert("L"), img.convert("1"), grey16, img.convert("F")):
        assert detect(grey) == []  # no colour, no object, no error
    for bad in ("a picture", None, [[1, 2], [3, 4]], np.zeros((4, 4, 2))):
        with pytest.raises(TypeError):
            detect(bad)
    with pytest.raises(TypeError, match="PIL image"):
        score_image(b"png bytes", "a red circle")
    with pytest.raises(ValueError, match="purple"):
        score_image(img, "a purple circle")  # the prompt is checked first


def test_classify_pixels_hue_and_chroma_bands_by_hand():
    """Palette hues: red 0, yellow 51, green 129.2, blue 226.7 degrees. Red's and yellow's nearest
    neighbours are 51 apart: strict +-0.3 x 51 = 15.3, loose +-51 / 2 = 25.5. Red's chroma
    (220 - 40) / 255 = 0.706 asks a pixel for >= 0.45 x 0.706 = 0.318."""
    px = np.array([[
        (237, 147, 147),  # red half blended with white: chroma 90 / 255 = 0.353, hue 0: red, strict
        (255, 180, 180),  # paler: chroma 75 / 255 = 0.294 < 0.318: no colour
        (255, 127, 0),  # orange, hue 29.9: 21.1 from yellow (loose, not strict), 29.9 from red (> 25.5)
        (255, 0, 128),  # hue 329.9: 30.1 from red (> 25.5): no colour, even loosely
    ]], dtype=np.uint8)
    assert list(COLOURS).index("yellow") == 3
    assert sg.classify_pixels(px).tolist() == [[0, -1, -1, -1]]
    assert sg.classify_pixels(px, strict=False).tolist() == [[0, -1, 3, -1]]


def test_an_rgba_array_is_composited_over_white():
    rgba = np.array([[(255, 0, 0, 128), (0, 0, 0, 0), (0, 0, 255, 255)]], dtype=np.uint8)
    # alpha a = 128 / 255: red 255 a + 255 (1 - a) = 255; green and blue 255 (1 - a) = 127
    want = [[[255, 127, 127], [255, 255, 255], [0, 0, 255]]]
    assert np.asarray(sg.to_rgb(rgba)).tolist() == want
    assert np.asarray(sg.to_rgb(Image.fromarray(rgba, "RGBA"))).tolist() == want  # a PIL image alike


def test_classify_never_calls_a_fill_of_at_least_four_fifths_a_triangle():
    """t = (pi/4 - fill) / (pi/4 - 0.5) + (roundness - 1): fill 0.82, roundness 2 gives
    t = -0.12 + 1 = 0.88 >= 0.35, but a hull filling >= TRIANGLE_MAX_FILL = 0.8 of its rectangle
    is no triangle; q = (0.82 - pi/4) / (1 - pi/4) + 1 / (sqrt 2 - 1) = 2.57 >= 0.85: a square.
    Below 0.8 the same roundness is a triangle."""
    assert sg._classify(0.82, 2.0) == "square"
    assert sg._classify(0.78, 2.0) == "triangle"


def test_detected_box_and_centroid_of_an_exact_square():
    """A 20 x 20 block on pixels 10..29: bbox (10, 10, 30, 30), right and bottom exclusive; the
    centroid is the mean pixel centre, (10 + 29) / 2 + 0.5 = 20."""
    img = Image.new("RGB", (64, 64), "white")
    ImageDraw.Draw(img).rectangle((10, 10, 29, 29), fill=HAND["blue"])
    [o] = detect(img)
    assert (o.colour, o.shape, o.bbox, o.centroid, o.area) == ("blue", "square", (10, 10, 30, 30), (20.0, 20.0), 400)
    assert o.center == (20.0, 20.0)


def test_a_two_to_one_rectangle_is_a_square_and_a_longer_one_a_bar():
    """aspect = (long + 1) / (short + 1) sides of the pixel centres' rectangle (+ 1: the centres
    lie half a pixel inside): 24 x 12 px gives (23 + 1) / (11 + 1) = 2.0, at MAX_ASPECT still a
    square; 26 x 12 px gives 26 / 12 = 2.167, a bar with no shape."""
    img = Image.new("RGB", (64, 64), "white")
    d = ImageDraw.Draw(img)
    d.rectangle((4, 4, 27, 15), fill=HAND["red"])  # 24 x 12
    d.rectangle((4, 40, 29, 51), fill=HAND["green"])  # 26 x 12
    got = sorted((o.colour, o.shape, round(o.aspect, 3)) for o in detect(img, include_unknown=True))
    assert got == [("green", None, 2.167), ("red", "square", 2.0)]


def test_specks_under_the_area_fraction_are_dropped():
    """Minimum area max(8, 0.003 x 64 x 64) = 12.3 px: a 3 x 4 block (12 px) is a speck, a
    4 x 4 one (16 px) a square."""
    img = Image.new("RGB", (64, 64), "white")
    d = ImageDraw.Draw(img)
    d.rectangle((5, 5, 7, 8), fill=HAND["red"])  # 3 x 4
    d.rectangle((40, 40, 43, 43), fill=HAND["blue"])  # 4 x 4
    assert [(o.colour, o.shape, o.area) for o in detect(img, include_unknown=True)] == [("blue", "square", 16)]


def test_a_one_pixel_outline_is_a_thin_fringe_not_an_object():
    """At 64 px the core erosion radius is max(1, round(64 / 128)) = 1: none of a 1-px outline
    survives it (under CORE_FRAC of the component), so it is dropped, even with include_unknown."""
    img = Image.new("RGB", (64, 64), "white")
    d = ImageDraw.Draw(img)
    d.rectangle((10, 10, 40, 40), outline=HAND["red"], width=1)
    d.rectangle((45, 45, 60, 60), fill=HAND["blue"])  # a solid square beside it stays
    assert [(o.colour, o.shape) for o in detect(img, include_unknown=True)] == [("blue", "square")]


def test_a_coloured_background_of_a_wide_image_is_no_object():
    """The background check compares the bbox with (0, 0, width, height): a 96 x 64 red image
    is a background, not a red square (its aspect 1.5 would read as one)."""
    assert detect(Image.new("RGB", (96, 64), HAND["red"])) == []
    assert detect(Image.new("RGB", (64, 96), HAND["red"])) == []


# ---------------------------------------------------------------------------- near misses (256 px, blurred)

PROMPT = "two red circles left of a blue square"
ALL_PASS = {
    "exist[circle]": 1.0,
    "colour[red circle]": 1.0,
    "count[red circle]=2": 1.0,
    "exist[square]": 1.0,
    "colour[blue square]": 1.0,
    "count[blue square]=1": 1.0,
    "relation[red circle left of blue square]": 1.0,
}
CIRCLE_A = ("circle", "red", 60, 70, 60, 0)
CIRCLE_B = ("circle", "red", 55, 185, 50, 0)
SQUARE = ("square", "blue", 190, 128, 64, 10)


def near_miss(items, **changes):
    scores = score_image(draw(256, items, blur=1.5), PROMPT)
    assert scores == {**ALL_PASS, **changes}


def test_hand_drawn_scene_passes_every_atom():
    near_miss([CIRCLE_A, CIRCLE_B, SQUARE])


def test_one_object_missing_fails_only_its_count():
    near_miss([CIRCLE_A, SQUARE], **{"count[red circle]=2": 0.0})


def test_relation_flipped_fails_only_the_relation():
    flipped = [(s, c, 256 - x, y, d, a) for s, c, x, y, d, a in (CIRCLE_A, CIRCLE_B, SQUARE)]
    near_miss(flipped, **{"relation[red circle left of blue square]": 0.0})


def test_wrong_colour_keeps_exist_fails_colour_and_gates_its_children():
    green = [("circle", "green", *CIRCLE_A[2:]), ("circle", "green", *CIRCLE_B[2:]), SQUARE]
    near_miss(
        green,
        **{
            "colour[red circle]": 0.0,
            "count[red circle]=2": 0.0,  # gated by colour
            "relation[red circle left of blue square]": 0.0,  # gated by colour
        },
    )


def test_extra_object_fails_the_count_only_if_it_is_of_a_named_kind():
    third = ("circle", "red", 128, 220, 40, 0)
    near_miss([CIRCLE_A, CIRCLE_B, SQUARE, third], **{"count[red circle]=2": 0.0})
    other = ("triangle", "green", 128, 30, 40, 0)
    near_miss([CIRCLE_A, CIRCLE_B, SQUARE, other])


def test_shape_missing_fails_its_whole_branch():
    near_miss(
        [CIRCLE_A, CIRCLE_B],
        **{
            "exist[square]": 0.0,
            "colour[blue square]": 0.0,
            "count[blue square]=1": 0.0,
            "relation[red circle left of blue square]": 0.0,
        },
    )


# ---------------------------------------------------------------------------- relations and gating


def box(cx, cy, s):
    return (cx - s / 2, cy - s / 2, cx + s / 2, cy + s / 2)


def test_relation_holds_margin_and_dominance():
    a = box(20, 50, 10)
    assert relation_holds(a, "left of", box(40, 50, 10))
    assert relation_holds(box(40, 50, 10), "right of", a)
    assert not relation_holds(a, "right of", box(40, 50, 10))
    assert not relation_holds(a, "left of", box(24, 50, 10))  # 4 < 0.5 x 10
    assert relation_holds(a, "left of", box(25, 50, 10))  # 5 = 0.5 x 10
    assert relation_holds(a, "left of", box(40, 90, 10))  # dx 20 >= 0.5 x dy 40
    assert not relation_holds(a, "left of", box(40, 91, 10))  # 20 < 0.5 x 41
    assert relation_holds(box(50, 10, 10), "above", box(50, 30, 10))
    assert relation_holds(box(50, 30, 10), "below", box(50, 10, 10))
    with pytest.raises(ValueError):
        relation_holds(a, "near", a)


def test_relation_cross_axis_offset_counts_on_either_side():
    """Dominance takes |offset| across the axis: 41 px above fails as 41 px below does
    (dx 20 < 0.5 x 41), and likewise across the vertical axis."""
    a = box(20, 50, 10)
    assert not relation_holds(a, "left of", box(40, 9, 10))
    assert not relation_holds(box(40, 9, 10), "right of", a)
    assert not relation_holds(box(50, 10, 10), "above", box(9, 30, 10))
    assert not relation_holds(box(91, 30, 10), "below", box(50, 10, 10))


def test_relation_margin_is_half_the_mean_extent_of_both_boxes_along_the_axis():
    # widths 10 and 30: mean extent 20, margin 0.5 x 20 = 10, whichever box is the wide one
    assert not relation_holds(box(20, 50, 10), "left of", box(28, 50, 30))  # dx 8 < 10
    assert relation_holds(box(20, 50, 30), "left of", box(32, 50, 10))  # dx 12 >= 10
    # boxes 10 wide and 30 high: the heights count along the vertical axis (margin 15), not the widths
    top = (0, 0, 10, 30)
    assert not relation_holds(top, "above", (0, 12, 10, 42))  # dy 12 < 15
    assert not relation_holds((0, 12, 10, 42), "below", top)
    assert relation_holds(top, "above", (0, 16, 10, 46))  # dy 16 >= 15


def obj(colour, shape, cx, cy, s=10):
    x0, y0, x1, y1 = (round(v) for v in box(cx, cy, s))
    return Object(colour, shape, (x0, y0, x1, y1), (cx, cy), s * s)


def test_same_kind_relation_splits_the_sorted_objects():
    atoms = parse_prompt("a red circle left of two red circles")
    ok = [obj("red", "circle", 10, 50), obj("red", "circle", 40, 40), obj("red", "circle", 45, 60)]
    assert min(evaluate_atoms(atoms, ok).values()) == 1.0
    middle = [
        obj("red", "circle", 10, 50),
        obj("red", "circle", 12, 70),
        obj("red", "circle", 45, 60),
    ]
    scores = evaluate_atoms(atoms, middle)  # the leftmost is not left of the second
    assert scores["relation[red circle left of red circle]"] == 0.0
    assert scores["count[red circle]=3"] == 1.0
    lone = evaluate_atoms(atoms, [obj("red", "circle", 10, 50)])
    assert lone["relation[red circle left of red circle]"] == 0.0  # nothing to be left of


def test_same_kind_relation_sorts_toward_the_subject_for_right_of_and_below():
    """Same-kind prompts sort along the axis in the relation's direction: for "right of" and
    "below" the subjects are the rightmost / lowest objects, not the leftmost / highest."""
    for rel, far, near in (("right of", (45, 50), (10, 50)), ("below", (50, 45), (50, 10))):
        atoms = parse_prompt(f"a red circle {rel} a red circle")
        name = f"relation[red circle {rel} red circle]"
        scores = evaluate_atoms(atoms, [obj("red", "circle", *near), obj("red", "circle", *far)])
        assert scores[name] == 1.0, rel
        two = parse_prompt(f"two red circles {rel} a red circle")
        objects = [obj("red", "circle", *near), obj("red", "circle", *far),
                   obj("red", "circle", *(v + 25 if v > 40 else v for v in far))]
        assert evaluate_atoms(two, objects)[f"relation[red circle {rel} red circle]"] == 1.0, rel


def test_causal_gating_zeroes_a_child_of_a_failed_parent():
    """A hand-made graph where the child would pass on its own: gating must zero it."""
    red = ObjectSpec(1, "red", "circle")
    blue = ObjectSpec(1, "blue", "square")
    atoms = [
        Atom("exist", "exist[square]", (blue,), "square"),
        Atom("count", "count[red circle]=1", (red,), 1, ("exist[square]",)),
        Atom("count", "grandchild", (red,), 1, ("count[red circle]=1",)),
        Atom("exist", "exist[circle]", (red,), "circle"),
    ]
    objects = [obj("red", "circle", 20, 20)]
    assert evaluate_atoms(atoms, objects) == {
        "exist[square]": 0.0,
        "count[red circle]=1": 0.0,
        "grandchild": 0.0,
        "exist[circle]": 1.0,
    }
    objects.append(obj("blue", "square", 60, 20))
    assert min(evaluate_atoms(atoms, objects).values()) == 1.0


# ---------------------------------------------------------------------------- core Reward


def test_reward_scores_samples_by_atom_type(monkeypatch):
    good = render(PROMPT, seed=1)
    wrong_colour = draw(256, [("circle", "green", *CIRCLE_A[2:]), CIRCLE_B, SQUARE])
    single = render("three yellow triangles", seed=2)
    missing = draw(
        64, [("triangle", "yellow", 15, 15, 18, 0), ("triangle", "yellow", 45, 45, 18, 0)]
    )
    samples = [
        Sample(PROMPT, good),
        Sample(PROMPT, wrong_colour),  # one red circle left: colour 2/2, count 1/2
        Sample("three yellow triangles", single),
        Sample("three yellow triangles", missing),
    ]
    calls = []
    real_detect = sg.detect
    # the verifier's detect and caches (shapes_geneval re-exports the function, not the global)
    monkeypatch.setattr(shapes_verifier, "detect", lambda img, **kw: calls.append(1) or real_detect(img, **kw))
    # empty caches: an earlier test (evaluation's atom_accuracy) may have detected these images
    monkeypatch.setattr(shapes_verifier, "_OBJECT_CACHE", {})
    monkeypatch.setattr(shapes_verifier, "_ATOM_CACHE", {})
    reward = shapes_geneval_reward()
    assert isinstance(reward, Reward)
    scores = reward.score(samples)
    assert scores.names == ["exist", "colour", "count", "relation", "all"]
    assert len(calls) == len(samples)  # one detection per sample, shared by the five atoms
    # wrong_colour: exist 2/2; colour[red circle] 1 (CIRCLE_B), colour[blue square] 1;
    # count[red circle]=2 fails (one red circle), count[blue square]=1 passes -> 1/2;
    # relation passes (the red circle is left of the square); all 0.
    # missing: exist 1, colour 1, count 0, relation vacuous 1, all 0.
    assert scores.values.tolist() == [
        [1.0, 1.0, 1.0, 1.0, 1.0],
        [1.0, 1.0, 0.5, 1.0, 0.0],
        [1.0, 1.0, 1.0, 1.0, 1.0],
        [1.0, 1.0, 0.0, 1.0, 0.0],
    ]
    assert scores.total.tolist() == [5.0, 3.5, 5.0, 3.0]
    parents = {a.name: a.parents for a in reward.atoms}
    assert parents == {
        "exist": (),
        "colour": ("exist",),
        "count": ("colour",),
        "relation": (),
        "all": ("exist", "colour", "count", "relation"),
    }
    assert all(a.batched for a in reward.atoms)


def test_reward_gates_all_when_a_type_mean_is_below_half():
    # a single-object prompt with the wrong colour: exist 1, colour 0, count 0 (gated), all 0
    img = render("a green square", seed=0)
    scores = shapes_geneval_reward().score([Sample("a red square", img)])
    assert scores.values.tolist() == [[1.0, 0.0, 0.0, 1.0, 0.0]]
    nothing = Image.new("RGB", (64, 64), "white")
    scores = shapes_geneval_reward().score([Sample("a red square left of a blue circle", nothing)])
    assert scores.values.tolist() == [[0.0, 0.0, 0.0, 0.0, 0.0]]


def test_reward_weights_and_errors():
    atoms = reward_atoms({"all": 2.0, "relation": 0.5})
    assert {a.name: a.weight for a in atoms} == {
        "exist": 1.0,
        "colour": 1.0,
        "count": 1.0,
        "relation": 0.5,
        "all": 2.0,
    }
    with pytest.raises(ValueError, match="unknown"):
        reward_atoms({"colour_count": 1.0})
    reward = shapes_geneval_reward()
    with pytest.raises(RewardError, match="exist") as err:
        reward.score([Sample("a red circle", "not an image")])
    assert "TypeError" in str(err.value)
    with pytest.raises(RewardError, match="purple"):
        reward.score([Sample("a purple circle", render("a red circle"))])
    with pytest.raises(RewardError, match="sample 1 of the batch"):
        reward.score([Sample("a red circle", render("a red circle")), Sample("a red circle", None)])
    # atoms are batched: a bad completion (a bug, not a model output) fails the batch
    zeroed = shapes_geneval_reward(on_error="zero")
    with pytest.warns(RuntimeWarning, match="failed and scored 0"):
        out = zeroed.score(
            [Sample("a red circle", None), Sample("a red circle", render("a red circle"))]
        )
    assert out.errors > 0 and out.values.sum() == 0


def test_unparsed_zero_scores_an_unparsed_prompt_zero_and_a_parsed_one_as_usual():
    img = render("a red circle", seed=0)
    scores = Reward(reward_atoms(unparsed="zero")).score([Sample("a pink cloud", img), Sample("a red circle", img)])
    assert scores.values.tolist() == [[0.0] * 5, [1.0] * 5]
    with pytest.raises(ValueError, match="'error' or 'zero', got 'skip'"):
        reward_atoms(unparsed="skip")
    assert [a.weight for a in shapes_geneval_reward({"all": 2.0}).atoms] == [1.0, 1.0, 1.0, 1.0, 2.0]


def test_reward_cache_does_not_confuse_batches():
    reward = shapes_geneval_reward()
    red = render("a red circle", seed=0)
    first = reward.score([Sample("a red circle", red)])
    assert first.total.tolist() == [5.0]
    # same image object, other prompt: a different key, scored afresh
    second = reward.score([Sample("a blue circle", red)])
    assert second.values.tolist() == [[1.0, 0.0, 0.0, 1.0, 0.0]]
    third = reward.score([Sample("a red circle", render("a blue circle", seed=0))])
    assert third.values.tolist() == [[1.0, 0.0, 0.0, 1.0, 0.0]]
    # a buffer overwritten in place for the next batch is judged on its new pixels
    buf = np.asarray(render("a red circle", seed=0)).copy()
    assert reward.score([Sample("a red circle", buf)]).total.tolist() == [5.0]
    buf[:] = np.asarray(render("a blue circle", seed=0))
    assert reward.score([Sample("a red circle", buf)]).total.tolist() == [2.0]


# ---------------------------------------------------------------------------- evaluation metrics


def test_atom_accuracy_on_a_mixed_set():
    images = [
        render(PROMPT, seed=0),  # 7/7
        draw(256, [("circle", "green", *CIRCLE_A[2:]), CIRCLE_B, SQUARE]),  # see below
        render("a blue triangle", seed=0),  # 3/3
        draw(64, [("triangle", "yellow", 15, 15, 18, 0), ("triangle", "yellow", 45, 45, 18, 0)]),
    ]
    prompts = [PROMPT, PROMPT, "a blue triangle", "three yellow triangles"]
    acc = atom_accuracy(images, prompts)
    # exist:    2 + 2 + 1 + 1 of 6          colour: 2 + 2 + 1 + 1 of 6
    # count:    2 + 1 + 1 + 0 of 6 = 4/6    relation: 1 + 1 of 2 (one red circle is left)
    # atoms: (6 + 6 + 4 + 2) / 20 = 0.9;    all: 2 of 4 prompts
    assert acc == pytest.approx(
        {
            "exist": 1.0,
            "colour": 1.0,
            "count": 4 / 6,
            "relation": 1.0,
            "atoms": 0.9,
            "all": 0.5,
            "num_images": 4.0,
        }
    )
    flipped = [(s, c, 256 - x, y, d, a) for s, c, x, y, d, a in (CIRCLE_A, CIRCLE_B, SQUARE)]
    acc = atom_accuracy(
        [draw(256, flipped), render("a red square", seed=0)], [PROMPT, "a red circle"]
    )
    # relation 0/1; the red square is no circle: exist 1 + 0, colour 1 + 0, count 2 + 0
    assert acc["relation"] == 0.0 and acc["exist"] == pytest.approx(2 / 3)
    assert acc["count"] == pytest.approx(2 / 3) and acc["all"] == 0.0
    assert math.isnan(atom_accuracy([render("a red square")], ["a red square"])["relation"])
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        atom_accuracy(images[:2], prompts[:1])
    with pytest.raises(ValueError):
        atom_accuracy([], [])


# ---------------------------------------------------------------------------- module layout


def test_every_public_name_of_the_split_modules_is_importable_from_shapes_geneval():
    """shapes_geneval re-exports what its four modules define (tests, CAST, scripts and users'
    code import them from there), the same objects, and its __all__ names exist."""
    import inspect

    from diffusion_rl.tasks import shapes_detector, shapes_prompts, shapes_scenes

    for module in (shapes_prompts, shapes_scenes, shapes_detector, shapes_verifier):
        for name, value in vars(module).items():
            defined_here = getattr(value, "__module__", module.__name__) == module.__name__
            if name.startswith("_") or inspect.ismodule(value) or not defined_here:
                continue
            assert getattr(sg, name, None) is value, f"{module.__name__}.{name}"
    assert all(hasattr(sg, name) for name in sg.__all__)
    assert sg.STRICT_FRAC == 0.5 and sg.MAX_ATOMS == 7  # constants too, not only functions
