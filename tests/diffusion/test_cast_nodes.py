"""CAST with one column per scene-graph atom (method.atoms: nodes; ours, a RECONSTRUCTION choice):
each atom's words, its verdicts and advantages by hand on rendered scenes, the same totals as the
type columns where every type has one atom, and a training step through the attention maps."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from diffusion_rl import backend
from diffusion_rl.config import CASTConfig
from diffusion_rl.methods.cast import ATOM_ADVANTAGES, ATOM_WEIGHTS, CAST
from diffusion_rl.scene_graph import shapes_geneval_atom_spans
from diffusion_rl.tasks.shapes_geneval import MAX_ATOMS, make_scene, render, shapes_geneval_reward
from mmrl.core.batch import RolloutBatch
from mmrl.core.config import ConfigError, load_config
from mmrl.core.rewards import AtomScores, Sample
from mmrl.core.trainer import Trainer


def words(prompt, spans):
    return [prompt[a:b] for a, b in spans]


def test_each_atom_has_its_own_words():
    p = "two red squares right of a green circle."
    got = {k: words(p, v) for k, v in shapes_geneval_atom_spans(p).items()}
    assert got == {
        "exist[square]": ["squares"], "colour[red square]": ["red", "squares"], "count[red square]=2": ["two", "squares"],
        "exist[circle]": ["circle"], "colour[green circle]": ["green", "circle"], "count[green circle]=1": ["a", "circle"],
        "relation[red square right of green circle]": ["right", "of", "squares", "circle"],
    }
    p = "a red circle above two red circles"  # one kind on both sides: shared atoms cover both phrases
    got = {k: words(p, v) for k, v in shapes_geneval_atom_spans(p).items()}
    assert got["count[red circle]=3"] == ["a", "circle", "two", "circles"]
    assert got["exist[circle]"] == ["circle", "circles"] and len(got) == 4


def test_an_exist_atom_covers_the_shape_word_of_every_phrase_of_its_shape():
    p = "a red circle left of a blue circle"  # two kinds of one shape: one exist atom, two colour atoms
    spans = shapes_geneval_atom_spans(p)
    assert spans["exist[circle]"] == [(6, 12), (28, 34)]  # "circle" at 6..12 and 28..34
    assert spans["colour[red circle]"] == [(2, 5), (6, 12)] and spans["colour[blue circle]"] == [(23, 27), (28, 34)]


def scored_batch(prompt, scene_prompts):
    """One group: `prompt` with images rendered for `scene_prompts` (a scene of another prompt
    fails the atoms it changes), scored by the real reward."""
    samples = [Sample(prompt=prompt, completion=render(make_scene(q, seed=i))) for i, q in enumerate(scene_prompts)]
    reward = shapes_geneval_reward()
    batch = RolloutBatch(group_ids=torch.zeros(len(samples), dtype=torch.long), samples=samples)
    batch.scores = reward.score(samples)
    return batch, reward


def test_node_columns_and_advantages_by_hand():
    prompt = "a red circle left of a blue square"
    batch, reward = scored_batch(prompt, [prompt, "a red circle left of a green square"])
    method = CAST(CASTConfig(atoms="nodes", adv_clip=100.0), None, reward)
    total = method.advantages(batch)
    values, weights = method.node_columns(batch)
    # exist[circle], colour[red circle], count[red circle]=1, exist[square], colour[blue square],
    # count[blue square]=1 (gated by its colour), the relation (gated too); padding; "all"
    torch.testing.assert_close(values, torch.tensor([[1., 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0]]))
    assert weights[0].tolist() == [0.5] * 6 + [1.0, 1.0]  # two atoms of each type but the relation
    atom = batch.data[ATOM_ADVANTAGES]
    # (1, 0): +-0.5 over the population std 0.5 (Flow-GRPO's); +-0.5 / sqrt(1/2) with the unbiased one
    expected = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, -1, -1, -1, -1.]])
    torch.testing.assert_close(atom, expected, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(total, (atom * weights).sum(-1))
    assert torch.equal(batch.data[ATOM_WEIGHTS], weights)
    assert method.node_names(batch.scores.names) == [f"atom{j}" for j in range(MAX_ATOMS)] + ["all"]
    m = method.batch_metrics(batch)
    assert m["cast/adv_nonzero/colour"] == 0.5 and m["cast/adv_nonzero/exist"] == 0.0  # 2 of 4 colour atoms
    assert m["cast/adv_nonzero/relation"] == 1.0 and m["cast/adv_nonzero/all"] == 1.0


def test_with_one_atom_per_type_nodes_and_types_agree():
    prompt = "two red circles"
    batch, reward = scored_batch(prompt, [prompt, "a red circle", "two blue circles", "two red squares"])
    nodes = CAST(CASTConfig(atoms="nodes", adv_clip=100.0), None, reward).advantages(batch)
    types = CAST(CASTConfig(adv_clip=100.0), None, reward).advantages(batch)
    assert nodes.abs().max() > 0
    torch.testing.assert_close(nodes, types)


def test_nodes_need_the_shapes_parser():
    with pytest.raises(ValueError, match="atoms=nodes"):
        CASTConfig(atoms="nodes", parser="my_parser.py:spans")


def test_a_training_step_with_node_columns(flux_dir, tmp_path, varied_verdicts):
    fast = ["rollout.num_steps=4", "rollout.window_size=2", "rollout.num_generations=2", "rollout.prompts_per_step=2",
            "task.num_train=16", "task.num_eval=2", "task.grid_prompts=0", "logging.tensorboard=false",
            "logging.progress=false", "optim.lr=1e-3", "rollout.window_start=[0,1]", "train.max_steps=1"]
    cfg = load_config(backend.CONFIG_CLASS, None, defaults=backend.DEFAULT_CONFIG,
                      overrides=[f"model.path={flux_dir}", f"output_dir={tmp_path / 'run'}", "method.type=cast",
                                 "method.atoms=nodes", *fast])
    policy, task = backend.build(cfg)
    before = {k: v.clone() for k, v in policy.model.named_parameters() if v.requires_grad}
    Trainer(cfg, policy, task).train()
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["cast/adv_abs/exist"] > 0 and math.isfinite(row["loss/policy"])
    assert any(not torch.equal(v, before[k]) for k, v in policy.model.named_parameters() if v.requires_grad)


def test_uniform_node_maps_give_flow_grpos_gradient(node_cast):
    run = node_cast()
    assert run.adv.abs().max() > 0
    real = run.grads(run.method.loss(run.policy, run.batch, run.adv))
    run.method.node_spans = lambda prompt: {}  # no atom has words: every map is uniform
    torch.testing.assert_close(run.grads(run.method.loss(run.policy, run.batch, run.adv)), run.flow_grpo,
                               rtol=1e-4, atol=1e-9)
    assert not torch.allclose(real, run.flow_grpo, rtol=1e-3, atol=1e-9)


def test_nodes_with_another_parser_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="atoms=nodes"):
        load_config(backend.CONFIG_CLASS, None, defaults=backend.DEFAULT_CONFIG,
                    overrides=["method.type=cast", "method.atoms=nodes", "method.parser=x.py:f"])


def test_unparsed_prompts_get_no_node_columns():
    reward = SimpleNamespace(weights=torch.tensor([1.0, 1, 1, 1, 1]))
    names = ["exist", "colour", "count", "relation", "all"]
    batch = RolloutBatch(group_ids=torch.tensor([0, 0]),
                         samples=[Sample(prompt="a photo of a cat", completion=None) for _ in range(2)],
                         scores=AtomScores(names=names, values=torch.tensor([[0., 0, 0, 0, 1], [0, 0, 0, 0, 0]]),
                                           total=torch.tensor([1.0, 0.0])))
    values, weights = CAST(CASTConfig(atoms="nodes"), None, reward).node_columns(batch)
    assert (weights[:, :MAX_ATOMS] == 0).all() and values[:, MAX_ATOMS:].flatten().tolist() == [1.0, 0.0]


def test_node_spans_number_the_atoms_in_parse_order():
    prompt = "a red circle left of a blue square"
    method = CAST(CASTConfig(atoms="nodes"), None, SimpleNamespace(weights=torch.ones(5)))
    assert method.node_spans(prompt) == {f"atom{j}": v for j, v in enumerate(shapes_geneval_atom_spans(prompt).values())}
    assert method.node_spans(prompt)["atom0"] == [(6, 12)]  # exist[circle]: "circle"
    assert method.node_spans("a photo of a cat") == {}
