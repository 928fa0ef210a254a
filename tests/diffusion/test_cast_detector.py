"""CAST's detector maps (method.projection: detector; ours, a diagnostic): each atom's region is
the boxes of the detected objects it is about, pooled onto the latent tokens; checked by hand on
rendered scenes, and through a training step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from diffusion_rl.attention_maps import region_maps
from diffusion_rl.methods.cast import CAST
from diffusion_rl.tasks.shapes_geneval import atom_regions, cached_detect, make_scene, render
from mmrl.core.trainer import Trainer

PROMPT = "a red circle left of a blue square"


def box(mask):
    ys, xs = np.nonzero(mask)
    return xs.min(), ys.min(), xs.max() + 1, ys.max() + 1


def test_each_atom_covers_the_objects_it_is_about():
    image = render(make_scene(PROMPT, seed=1))
    circle, square = sorted(cached_detect(image), key=lambda o: o.shape)  # circle < square
    assert (circle.shape, square.shape) == ("circle", "square")
    regions = atom_regions(image, PROMPT)
    assert list(regions) == ["exist[circle]", "colour[red circle]", "count[red circle]=1", "exist[square]",
                             "colour[blue square]", "count[blue square]=1", "relation[red circle left of blue square]"]
    for name in ("exist[circle]", "colour[red circle]", "count[red circle]=1"):
        assert box(regions[name]) == circle.bbox and regions[name].sum() == np.prod(np.subtract(circle.bbox[2:], circle.bbox[:2]))
    for name in ("exist[square]", "colour[blue square]", "count[blue square]=1"):
        assert box(regions[name]) == square.bbox
    rel = regions["relation[red circle left of blue square]"]
    assert rel.sum() == regions["exist[circle]"].sum() + regions["exist[square]"].sum()  # apart: no overlap


def test_a_wrong_colour_keeps_its_region_and_a_missing_shape_has_none():
    image = render(make_scene("a green circle left of a blue triangle", seed=1))
    regions = atom_regions(image, PROMPT)
    assert regions["colour[red circle]"] is not None  # where the colour is wrong
    assert regions["exist[square]"] is None and regions["colour[blue square]"] is None
    rel = regions["relation[red circle left of blue square]"]
    assert rel.sum() == regions["exist[circle]"].sum()  # only the circle is there


def test_a_wrong_count_has_no_region():
    image = render(make_scene("a red circle", seed=0))
    (circle,) = cached_detect(image)
    regions = atom_regions(image, "a red circle")
    assert box(regions["count[red circle]=1"]) == circle.bbox  # right: where the circle is
    regions = atom_regions(image, "two red circles")
    assert regions["count[red circle]=2"] is None  # the missing one has no place
    assert box(regions["exist[circle]"]) == circle.bbox


def test_a_count_region_leaves_out_other_colours_of_the_shape():
    """count[c s]=n points at the objects of kind c s only; exist[s] covers every s."""
    image = render(make_scene("a red circle left of a blue circle", seed=0))
    red, blue = sorted(cached_detect(image), key=lambda o: o.colour, reverse=True)  # red > blue
    assert (red.kind, blue.kind) == ("red circle", "blue circle")
    regions = atom_regions(image, "a red circle")
    assert box(regions["count[red circle]=1"]) == red.bbox
    assert regions["exist[circle]"].sum() == sum(np.prod(np.subtract(o.bbox[2:], o.bbox[:2])) for o in (red, blue))


def test_region_maps_pool_onto_the_token_grid():
    mask = np.zeros((8, 8), dtype=bool)
    mask[0:4, 0:2] = True  # the top-left token of a 2 x 2 grid, half covered
    maps = region_maps([{"a": mask, "b": None}, {}], ["a", "b"], (2, 2))
    torch.testing.assert_close(maps[0, 0], torch.tensor([4.0, 0, 0, 0]))  # mean 1
    assert (maps[0, 1] == 1).all() and (maps[1] == 1).all()  # no mask: uniform
    torch.testing.assert_close(region_maps([{"a": mask}], ["a"], (2, 2), "max")[0, 0], torch.tensor([1.0, 0, 0, 0]))
    assert (region_maps([{"a": np.zeros((8, 8), bool)}], ["a"], (2, 2)) == 1).all()
    with pytest.raises(ValueError, match="map norm"):
        region_maps([{}], ["a"], (2, 2), "sum")


def test_type_columns_take_the_union_of_their_atoms():
    image = render(make_scene(PROMPT, seed=1))
    nodes = CAST.detector_regions(image, PROMPT, nodes=True)
    types = CAST.detector_regions(image, PROMPT, nodes=False)
    assert list(nodes) == [f"atom{j}" for j in range(7)]
    assert np.array_equal(types["colour"], nodes["atom1"] | nodes["atom4"])
    assert np.array_equal(types["relation"], nodes["atom6"])
    assert CAST.detector_regions(image, "a photo of a cat", nodes=True) == {}  # unparsed: uniform maps


def test_detector_maps_train_and_uniform_ones_give_flow_grpos_gradient(node_cast):
    run = node_cast("method.projection=detector", "rollout.num_generations=2", "rollout.prompts_per_step=2",
                    "task.grid_prompts=0", "logging.tensorboard=false", "logging.progress=false", "optim.lr=1e-3",
                    "train.max_steps=1")
    assert run.adv.abs().max() > 0
    run.method.detector_regions = lambda image, prompt, nodes: {}  # the tiny model's images: nothing detected
    torch.testing.assert_close(run.grads(run.method.loss(run.policy, run.batch, run.adv)), run.flow_grpo,
                               rtol=1e-4, atol=1e-9)
    corner = np.zeros((16, 16), dtype=bool)
    corner[:8, :8] = True  # the first atom's object in the top-left quarter
    run.method.detector_regions = lambda image, prompt, nodes: {"atom0": corner}
    out = run.method.loss(run.policy, run.batch, run.adv)
    assert out.metrics["cast/adv_map_spatial_std"] > 0
    assert not torch.allclose(run.grads(out), run.flow_grpo, rtol=1e-3, atol=1e-9)
    before = {k: v.clone() for k, v in run.policy.model.named_parameters() if v.requires_grad}
    Trainer(run.cfg, run.policy, run.task).train()  # the whole step, with the real (empty) detections
    row = json.loads((Path(run.cfg.output_dir) / "metrics.jsonl").read_text().splitlines()[0])
    assert math.isfinite(row["loss/policy"])
    assert any(not torch.equal(v, before[k]) for k, v in run.policy.model.named_parameters() if v.requires_grad)


def test_the_share_of_clipped_patches_is_logged(node_cast):
    run = node_cast("method.projection=detector", "method.adv_clip=0.3")
    run.method.detector_regions = lambda image, prompt, nodes: {}  # uniform maps: a sample's patches share A_i
    out = run.method.loss(run.policy, run.batch, run.adv)
    clipped = float((run.adv.abs() >= 0.3 * (1 - 1e-6)).float().mean())
    assert 0 < clipped and out.metrics["cast/adv_map_clipped"] == pytest.approx(clipped)


def test_type_columns_leave_out_atoms_without_a_region():
    """Only the circle is drawn: the square's atoms have no region, and each type's union is
    that of the atoms that have one (the relation's is the circle's alone)."""
    image = render(make_scene("a red circle", seed=0))
    nodes = CAST.detector_regions(image, PROMPT, nodes=True)
    assert nodes["atom3"] is None and nodes["atom4"] is None and nodes["atom0"] is not None
    types = CAST.detector_regions(image, PROMPT, nodes=False)
    assert set(types) == {"exist", "colour", "count", "relation"}
    for kind, j in (("exist", 0), ("colour", 1), ("count", 2)):
        assert np.array_equal(types[kind], nodes[f"atom{j}"])
    assert np.array_equal(types["relation"], nodes["atom0"])
