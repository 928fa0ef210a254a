"""The held-out hardest-prompt split (hard/*) and the per-step count of model evaluations
(cost/model_evaluations) that the method comparisons read."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from PIL import Image

from diffusion_rl import backend
from diffusion_rl.config import DiffusionTrainConfig
from diffusion_rl.models import build_tiny
from diffusion_rl.task import DiffusionTask
from diffusion_rl.tasks.shapes_geneval import (
    make_scene,
    parse_prompt,
    render,
    reward_atoms,
    shapes_geneval_reward,
)
from mmrl.core.config import load_config
from mmrl.core.rewards import Reward, reward_atom
from mmrl.core.trainer import Trainer

PROMPTS = ["a red circle", "two blue squares left of a green triangle", "three yellow triangles",
           "a blue circle above two red squares"]


class Renderer:
    """A 'policy' that draws each prompt's own training scene, or a blank image for `blank` prompts."""

    def __init__(self, blank=()):
        self.blank = set(blank)

    def sample_images(self, prompts, seeds, num_steps):
        return [render(make_scene("a red circle" if p in self.blank else p, seed=s)) for p, s in zip(prompts, seeds)]


def test_hard_split_scores_the_relational_prompts_alone():
    task = DiffusionTask("shapes-geneval", PROMPTS, PROMPTS, shapes_geneval_reward())
    out = task.evaluate(Renderer())
    assert out["hard/num_prompts"] == 2 and out["hard/atom_accuracy"] == pytest.approx(1.0)
    # drawing the relational prompts wrong moves only their split (and the overall score)
    worse = task.evaluate(Renderer(blank=[p for p in PROMPTS if len(parse_prompt(p)) == 7]))
    assert worse["hard/atom_accuracy"] < 0.5 and worse["hard/relation"] == 0.0
    assert worse["atom_accuracy"] > worse["hard/atom_accuracy"]
    with pytest.warns(UserWarning, match="hard_min_atoms=8: no held-out prompt has that many atoms"):
        none = DiffusionTask("shapes-geneval", PROMPTS, PROMPTS, shapes_geneval_reward(), hard_min_atoms=8)
    assert not any(k.startswith("hard/") for k in none.evaluate(Renderer()))


def test_evaluation_detects_each_image_once_though_the_hard_split_scores_it_again(monkeypatch):
    """4 prompts, 2 of them relational (the hard/ split): 4 detections, not 4 + 2; the same metrics."""
    from diffusion_rl.tasks import shapes_verifier  # where cached_detect's detect and cache live

    task = DiffusionTask("shapes-geneval", PROMPTS, PROMPTS, shapes_geneval_reward())
    expected = task.evaluate(Renderer())
    calls = []
    monkeypatch.setattr(shapes_verifier, "_OBJECT_CACHE", {})  # nothing detected yet
    monkeypatch.setattr(shapes_verifier, "detect", lambda image, detect=shapes_verifier.detect: calls.append(1) or detect(image))
    assert task.evaluate(Renderer()) == expected and expected["hard/num_prompts"] == 2
    assert len(calls) == 4


def test_model_evaluations_are_counted_per_step(tmp_path):
    path = build_tiny("flux", tmp_path / "flux", seed=0, pixel_space=True)
    cfg = load_config(DiffusionTrainConfig, None, defaults=backend.DEFAULT_CONFIG, overrides=[
        f"model.path={path}", f"output_dir={tmp_path / 'run'}", "rollout.num_steps=4", "rollout.window_size=2",
        "rollout.num_generations=2", "rollout.prompts_per_step=2", "task.num_train=8", "task.num_eval=2",
        "task.grid_prompts=0", "logging.tensorboard=false", "logging.progress=false", "train.max_steps=2"])
    policy, task = backend.build(cfg)
    Trainer(cfg, policy, task).train()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # 4 samples: 4 ODE/SDE steps of rollout each, then the 2 window steps re-run with gradients;
    # the held-out evaluations before and after are not counted
    assert [r["cost/model_evaluations"] for r in rows] == [4 * 4 + 4 * 2] * 2
    assert policy.flow.evaluations > 2 * 24  # they did run
    policy.step_costs()
    policy.flow.velocity(torch.zeros(3, policy.flow.seq_len, policy.flow.channels), 0.5,
                         policy.flow.encode_prompt(["a red circle"] * 3))
    assert policy.step_costs() == {"cost/model_evaluations": 3.0}


# ---------------------------------------------------------------------------- audit: DiffusionTask's evaluation and grid


class Blank:
    """A 'policy' drawing 8 x 8 white images; it records the prompts and seeds of each call."""

    def __init__(self):
        self.calls = []

    def sample_images(self, prompts, seeds, num_steps):
        self.calls.append((list(prompts), list(seeds)))
        return [Image.new("RGB", (8, 8), "white") for _ in prompts]


def _clip_reward(good):
    """One image atom, clip: 1 for the prompts in `good`, else 0."""
    return Reward([reward_atom("clip")(lambda s: float(s.prompt in good))])


def test_seed_j_of_prompt_i_is_1000_j_plus_i():
    task = DiffusionTask("shapes-geneval", PROMPTS, PROMPTS, shapes_geneval_reward(), eval_seeds=2)
    assert task._jobs(["a red circle", "three yellow triangles"]) == (
        ["a red circle", "a red circle", "three yellow triangles", "three yellow triangles"], [0, 1000, 1, 1001])


def test_other_atoms_are_the_rewards_atoms_besides_the_scene_graph_ones():
    assert DiffusionTask("shapes-geneval", PROMPTS, PROMPTS, shapes_geneval_reward()).other_atoms() == []
    both = Reward([*shapes_geneval_reward().atoms, *_clip_reward(()).atoms])
    assert DiffusionTask("shapes-geneval", PROMPTS, PROMPTS, both).other_atoms() == ["clip"]


def test_a_hard_prompt_has_at_least_hard_min_atoms_counted_once_per_prompt():
    """hard_min_atoms = 7, the relational prompts' count: both are hard (>=), no warning; with
    two seeds each, hard/num_prompts still counts prompts (2), not images (4)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        task = DiffusionTask("shapes-geneval", PROMPTS, PROMPTS, shapes_geneval_reward(), hard_min_atoms=7,
                             eval_seeds=2)
    out = task.evaluate(Renderer())
    assert out["hard/num_prompts"] == 2.0 and out["hard/atom_accuracy"] == pytest.approx(1.0)
    assert "num_images" not in out and "hard/num_images" not in out


def test_unparsed_prompts_are_counted_once_and_scored_by_the_reward_alone():
    """Two parsed prompts (drawn right) and one the grammar cannot read, two seeds each:
    accuracies over the parsed images alone (1.0), unparsed_prompts 1, whole_prompt_reward
    the mean total over the unparsed prompt's images (shapes atoms with unparsed=zero: 0). Batches of 4
    images: calls of 4 and 2."""
    prompts = ["a red circle", "a photo of a cat", "three yellow triangles"]
    with pytest.warns(UserWarning, match="no held-out prompt"):
        task = DiffusionTask("shapes-geneval", prompts, prompts, Reward(reward_atoms(unparsed="zero")), eval_seeds=2)
    out = task.evaluate(Renderer(blank=["a photo of a cat"]), batch_size=4)
    assert out["atom_accuracy"] == pytest.approx(1.0) and out["prompt_accuracy"] == pytest.approx(1.0)
    assert out["unparsed_prompts"] == 1.0 and out["whole_prompt_reward"] == 0.0
    policy = Blank()
    task.evaluate(policy, batch_size=4)
    assert [len(p) for p, _ in policy.calls] == [4, 2]


def test_other_atoms_and_reward_are_exact_float64_means_over_every_image():
    """clip 1 on 105 of 200 unparsed prompts: reward and clip 0.525, not float32's 0.52499998."""
    prompts = [f"a photo number {i}" for i in range(200)]
    with pytest.warns(UserWarning, match="no held-out prompt"):
        task = DiffusionTask("clip", prompts, prompts, _clip_reward(set(prompts[:105])))
    out = task.evaluate(Blank(), batch_size=256)
    assert out["reward"] == 0.525 and out["clip"] == 0.525 and out["unparsed_prompts"] == 200.0
    assert out["whole_prompt_reward"] == 0.525  # the unparsed prompts' mean total, in float64 too


def test_save_samples_draws_the_first_grid_prompts_one_row_each_one_column_per_seed(tmp_path):
    """grid_prompts 2, eval_seeds 3, 8 x 8 images: a sheet 10 + 3 * (8 + 2) + 2 = 42 wide and
    2 * (8 + 2) + 2 = 22 high; the JSON names the rows and seeds 1000 j + i."""
    task = DiffusionTask("shapes-geneval", PROMPTS, PROMPTS, shapes_geneval_reward(), eval_seeds=3, grid_prompts=2)
    path = task.save_samples(Blank(), tmp_path, "before")
    assert path == tmp_path / "grid_before.png" and Image.open(path).size == (42, 22)
    assert json.loads((tmp_path / "grid_before.json").read_text()) == {
        "rows": PROMPTS[:2], "seeds": [0, 1000, 2000, 1, 1001, 2001]}


def test_save_samples_right_after_evaluate_takes_its_images_instead_of_drawing_them_again(tmp_path):
    """The trainer saves the grid just after evaluating, under the same weights: the grid's 2 x 2
    images are the evaluation's (one call of 8), the same sheet as a fresh draw of them; taken
    once (a second save draws again: 4 images), and never for another policy."""
    task = DiffusionTask("shapes-geneval", PROMPTS, PROMPTS, shapes_geneval_reward(), eval_seeds=2, grid_prompts=2)
    policy = Blank()
    task.evaluate(policy, batch_size=8)
    task.save_samples(policy, tmp_path, "before")
    assert [len(p) for p, _ in policy.calls] == [8]
    task.save_samples(policy, tmp_path, "again")
    assert [len(p) for p, _ in policy.calls] == [8, 4] and policy.calls[1][1] == [0, 1000, 1, 1001]
    assert (tmp_path / "grid_before.png").read_bytes() == (tmp_path / "grid_again.png").read_bytes()
    other = Blank()
    task.evaluate(policy, batch_size=8)
    task.save_samples(other, tmp_path, "other")
    assert [len(p) for p, _ in other.calls] == [4]


def test_grid_places_images_row_major_and_labels_every_row():
    """Four 16 x 16 images in 3 columns (pad 2, label 10): image k at (12 + 18 c, 2 + 18 r)
    for (r, c) = divmod(k, 3); the sheet 10 + 3 * 18 + 2 = 66 by 2 * 18 + 2 = 38; a row number
    left of each row, row 1's though it holds one image."""
    from diffusion_rl.task import grid

    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)]
    sheet = grid([Image.new("RGB", (16, 16), c) for c in colours], rows=2, cols=3)
    assert sheet.size == (66, 38)
    at = [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert [sheet.getpixel((12 + 18 * c + 8, 2 + 18 * r + 8)) for r, c in at] == colours
    assert sheet.getpixel((12 + 18 + 8, 20 + 8)) == (255, 255, 255)  # nothing at row 1, column 1
    for r in (0, 1):
        band = [sheet.getpixel((x, y)) for x in range(10) for y in range(2 + 18 * r, 18 + 18 * r)]
        assert any(px != (255, 255, 255) for px in band)  # the label's ink
