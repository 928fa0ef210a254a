"""The held-out hardest-prompt split (hard/*) and the per-step count of model evaluations
(cost/model_evaluations) that the method comparisons read."""

from __future__ import annotations

import json

import pytest
import torch

from diffusion_rl import backend
from diffusion_rl.config import DiffusionTrainConfig
from diffusion_rl.models import build_tiny
from diffusion_rl.task import DiffusionTask
from diffusion_rl.tasks.shapes_geneval import (
    make_scene,
    parse_prompt,
    render,
    shapes_geneval_reward,
)
from mmrl.core.config import load_config
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
