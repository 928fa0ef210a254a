"""CAST part 2 (a RECONSTRUCTION): the prompt parsers, teacher-forced text attention maps on FLUX-
and SD3-style joint attention, the advantage map, and the per-patch objective (ratio exactly 1
on-policy; with uniform maps its gradient is Flow-GRPO's)."""

from __future__ import annotations

import copy
import math
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from diffusion_rl import backend
from diffusion_rl.attention_maps import (
    TextAttention,
    atom_maps,
    default_layers,
    image_tokens_inside,
    joint_attention_modules,
    text_key_spans,
)
from diffusion_rl.config import CASTConfig, DiffusionTrainConfig
from diffusion_rl.methods import cast as cast_module
from diffusion_rl.methods.cast import CAST, advantage_map
from diffusion_rl.methods.flow_grpo import FlowGRPO
from diffusion_rl.models import build_tiny, load_flow_model, pil_to_tensor
from diffusion_rl.scene_graph import checked_spans, load_parser, shapes_geneval_spans
from diffusion_rl.tasks.shapes_geneval import make_scene, render, sample_prompts
from mmrl.core.batch import RolloutBatch
from mmrl.core.config import ConfigError, load_config
from mmrl.core.rewards import AtomScores, Sample

PROMPT = "two blue triangles left of a red circle"
FAST = ["rollout.num_steps=4", "rollout.window_size=2", "rollout.num_generations=2", "rollout.prompts_per_step=2",
        "task.num_train=16", "task.num_eval=2", "task.grid_prompts=0", "logging.tensorboard=false",
        "logging.progress=false"]


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return build_tiny("sd3", tmp_path_factory.mktemp("sd3"), seed=0)


@pytest.fixture(scope="module")
def bundled():
    # The former bundled model (pixel space, 16 x 16 tokens of 4 x 4 pixels), kept for this: the
    # latent one's 8 x 8 tokens and its middle layers do not localise the objects (RESULTS.md).
    return load_flow_model(backend.bundled_model_dir().parent / "tiny-flow-pixel")


def words(prompt, spans):
    return [prompt[a:b] for a, b in spans]


# ------------------------------------------------------------------ parsers


def test_shapes_geneval_spans_by_hand():
    s = shapes_geneval_spans(PROMPT)
    assert words(PROMPT, s["exist"]) == ["triangles", "circle"]
    assert words(PROMPT, s["colour"]) == ["blue", "triangles", "red", "circle"]
    assert words(PROMPT, s["count"]) == ["two", "triangles", "a", "circle"]
    assert words(PROMPT, s["relation"]) == ["left", "of", "triangles", "circle"]
    one = "Three green circles."
    s = shapes_geneval_spans(one)
    assert set(s) == {"exist", "colour", "count"} and words(one, s["exist"]) == ["circles"]  # no full stop
    spaced = "a red circle below two red circles . "  # the grammar takes a spaced full stop too
    s = shapes_geneval_spans(spaced)
    assert words(spaced, s["count"]) == ["a", "circle", "two", "circles"]
    assert words(spaced, s["relation"]) == ["below", "circle", "circles"]
    long = "a red square to the left of a blue circle"
    assert words(long, shapes_geneval_spans(long)["relation"]) == ["to", "the", "left", "of", "square", "circle"]
    with pytest.raises(ValueError, match="hexagon"):
        shapes_geneval_spans("a red hexagon")


def test_custom_parser_from_a_file_and_its_errors(tmp_path):
    (tmp_path / "p.py").write_text(
        "def parse(prompt):\n    i = prompt.index('cat')\n    return {'exist': [(i, i + 3)]}\n"
        "def bad(prompt):\n    return {'exist': [(0, 999)]}\n")
    parser = load_parser("p.py:parse", tmp_path)
    assert checked_spans(parser, "a cat") == {"exist": [(2, 5)]}
    with pytest.raises(ValueError, match="failed on 'a dog'"):
        checked_spans(parser, "a dog")
    with pytest.raises(ValueError, match="0 <= start < end <= 5"):
        checked_spans(load_parser("p.py:bad", tmp_path), "a cat")
    with pytest.raises(ConfigError, match="file not found"):
        load_parser("missing.py:parse", tmp_path)
    with pytest.raises(ConfigError, match="no attribute 'nope'"):
        load_parser("p.py:nope", tmp_path)
    with pytest.raises(ConfigError, match="shapes-geneval"):
        load_parser("no-such-parser")


def test_checked_spans_and_load_parser_refuse_what_is_not_a_parser_or_spans(tmp_path):
    """A parser must return a dict of lists of (start, end) with 0 <= start < end <= len(prompt):
    a list, an empty span and a triple are refused; so are a non-callable and an empty function name."""
    for out, what in ((["exist"], "returned list"), ({"exist": [(2, 2)]}, "0 <= start < end <= 5"),
                      ({"exist": [(0, 1, 2)]}, "0 <= start < end <= 5")):
        with pytest.raises(ValueError, match=what):
            checked_spans(lambda prompt, out=out: out, "a cat")
    (tmp_path / "p.py").write_text("NAME = 'cat'\n")
    with pytest.raises(ConfigError, match="'NAME' is not callable"):
        load_parser("p.py:NAME", tmp_path)
    with pytest.raises(ConfigError, match="path/to/file.py:function"):
        load_parser("p.py:", tmp_path)


def test_atom_spans_of_unparsed_prompts_and_of_a_failing_custom_parser(tmp_path, monkeypatch):
    """The built-in grammar: a prompt it cannot parse gets no words (uniform maps); a custom
    parser that fails is an error. A custom parser's file is found next to the config."""
    method = CAST(CASTConfig(), None, SimpleNamespace(weights=torch.ones(4)))
    assert method.atom_spans("a red circle") == {"exist": [(6, 12)], "colour": [(2, 5), (6, 12)],
                                                 "count": [(0, 1), (6, 12)]}
    assert method.atom_spans("a photo of a cat") == {}
    (tmp_path / "p.py").write_text("def parse(prompt):\n    i = prompt.index('cat')\n    return {'exist': [(i, i + 3)]}\n")
    monkeypatch.chdir(tmp_path.parent)  # relative to the config's directory, not the current one
    run = SimpleNamespace(base_dir=str(tmp_path), rollout=SimpleNamespace(noise_level=0.7))
    custom = CAST(CASTConfig(parser="p.py:parse"), run, SimpleNamespace(weights=torch.ones(1)))
    assert custom.atom_spans("a cat") == {"exist": [(2, 5)]}
    with pytest.raises(ValueError, match="failed on 'a dog'"):
        custom.atom_spans("a dog")


# ------------------------------------------------------------------ maps


def test_atom_maps_and_advantage_map_by_hand():
    att = torch.tensor([[[0.1, 0.3, 0.0], [0.3, 0.1, 0.0]]])  # [N=1, L=2, S=3]
    keys = [[(0, 3), (4, 7), None]]
    spans = [{"a": [(0, 3)], "b": [(0, 7)], "c": [(10, 12)]}]  # c covers no key
    m = atom_maps(att, keys, spans, ["a", "b", "c", "d"])
    torch.testing.assert_close(m[0, 0], torch.tensor([0.5, 1.5]))  # [0.1, 0.3] / 0.2
    torch.testing.assert_close(m[0, 1], torch.tensor([1.0, 1.0]))  # 0.4 and 0.4
    assert torch.equal(m[0, 2], torch.ones(2)) and torch.equal(m[0, 3], torch.ones(2))
    torch.testing.assert_close(atom_maps(att, keys, spans, ["a"], "max")[0, 0], torch.tensor([1 / 3, 1.0]))
    # A(l) = (w_a A_a M_a(l) + lam A) / (1 + lam): A_a = 2, w_a = 1, A = 2, lam = 1
    a = advantage_map(torch.tensor([[2.0, 0, 0, 0]]), torch.ones(4), m, torch.tensor([2.0]), global_weight=1.0)
    torch.testing.assert_close(a, torch.tensor([[1.5, 2.5]]))
    assert advantage_map(torch.tensor([[2.0, 0, 0, 0]]), torch.ones(4), m, torch.tensor([2.0]), global_weight=1.0,
                         clip=2.0).max() == 2.0
    # uniform maps give back the scalar advantage, whatever lambda
    atom, w = torch.randn(3, 4), torch.rand(4)
    for lam in (0.0, 0.5, 2.0):
        out = advantage_map(atom, w, torch.ones(3, 4, 5), atom @ w, global_weight=lam)
        torch.testing.assert_close(out, (atom @ w)[:, None].expand(3, 5))


def test_atom_maps_touching_spans_unattended_keys_and_the_key_count():
    """A key that only shares an end with a column's span is not in it (either side); keys that
    get no attention anywhere give the uniform map, not 0 / 0; one key span per attended key."""
    att = torch.tensor([[[0.1, 0.3, 0.0], [0.3, 0.1, 0.0]]])  # [N=1, L=2, S=3]
    keys = [[(0, 3), (3, 7), (8, 10)]]
    m = atom_maps(att, keys, [{"a": [(0, 3)], "b": [(3, 7)], "z": [(8, 10)]}], ["a", "b", "z"])
    torch.testing.assert_close(m[0, 0], torch.tensor([0.5, 1.5]))  # key 0 only: [0.1, 0.3] / 0.2
    torch.testing.assert_close(m[0, 1], torch.tensor([1.5, 0.5]))  # key 1 only
    assert torch.equal(m[0, 2], torch.ones(2))  # key 2 is covered but attended 0: uniform
    assert torch.equal(atom_maps(att, keys, [{"z": [(8, 10)]}], ["z"], "max"), torch.ones(1, 1, 2))
    with pytest.raises(ValueError, match="sample 0: 2 text key spans for 3 attended text keys"):
        atom_maps(att, [keys[0][:2]], [{}], ["a"])


def test_image_tokens_inside_by_hand():
    mask = torch.zeros(8, 8, dtype=torch.bool)
    mask[0:4, 4:8] = True  # the top-right quarter: token (0, 1) of a 2 x 2 grid
    mask[4:6, 0:4] = True  # half of token (1, 0): not more than half, so outside
    mask[6:7, 4:8] = True  # a quarter of token (1, 1): outside
    assert image_tokens_inside(mask, 2).tolist() == [False, True, False, False]
    assert image_tokens_inside(mask.numpy(), 4).sum() == 4 + 2  # 2 x 2-pixel tokens: the quarter, and rows 4-5 fill 2
    with pytest.raises(ValueError, match="multiple of 3"):
        image_tokens_inside(mask, 3)


def test_text_attention_leaves_the_forward_alone_and_handles_cfg(flux_dir):
    flow = load_flow_model(flux_dir)
    cond = flow.encode_prompt([PROMPT, "a red circle"])
    x = flow.noise(2, torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.7, 0.7])
    plain = flow.velocity(x, sigma, cond)
    with TextAttention(flow) as rec:
        v = flow.velocity(x, sigma, cond)
    assert torch.equal(v, plain)
    att = rec.result(2)
    s = len(text_key_spans(flow, [PROMPT])[0])
    assert att.shape == (2, flow.seq_len, s)
    assert (att >= 0).all() and (att.sum(-1) <= 1 + 1e-5).all() and (att.sum(-1) > 0).all()
    again = flow.velocity(x, sigma, cond)  # hooks and wrapped primitives are gone after the block
    assert torch.equal(again, plain)
    guided = load_flow_model(flux_dir, guidance_scale=3.0)
    cond_g = guided.encode_prompt([PROMPT, "a red circle"])
    with TextAttention(guided) as rec_g:
        guided.velocity(x, sigma, cond_g)
    torch.testing.assert_close(rec_g.result(2), att)  # the conditional rows of the 2N-row forward
    with TextAttention(guided, rows=2) as rec_rows:  # only those rows computed and held
        guided.velocity(x, sigma, cond_g)
    kept = rec_rows.result()
    torch.testing.assert_close(kept, att)
    assert kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()
    with pytest.raises(ValueError, match="out of range"):
        TextAttention(flow, [len(joint_attention_modules(flow))])


def test_joint_attention_layers_their_default_and_the_indices_taken(flux_dir):
    """The joint-attention modules in forward order (double-stream, then single-stream blocks),
    the default middle half, and the layer indices TextAttention takes (negative ones count from
    the end; none at all is an error)."""
    assert [default_layers(n) for n in (1, 2, 3, 4, 7, 8)] == [[0], [0, 1], [0, 1, 2], [1, 2], [1, 2, 3, 4, 5],
                                                               [2, 3, 4, 5]]
    flow = load_flow_model(flux_dir)
    double, single = flow.transformer.transformer_blocks, flow.transformer.single_transformer_blocks
    mods = joint_attention_modules(flow)
    assert len(double) and len(single) and mods == [b.attn for b in double] + [b.attn for b in single]
    assert TextAttention(flow).modules == [mods[i] for i in default_layers(len(mods))]
    assert TextAttention(flow, [-1]).modules == [mods[-1]]
    assert TextAttention(flow, [-len(mods)]).modules == [mods[0]]
    for bad in ([-len(mods) - 1], []):
        with pytest.raises(ValueError, match="out of range"):
            TextAttention(flow, bad)


def test_recorded_attention_is_the_softmax_each_layer_attends_with(sd3_dir, monkeypatch):
    """Against the query, key and value each layer's attention call got: the probabilities are
    softmax(q k^T / sqrt(D)) over all keys (they give the call's own output), the image rows' text
    columns (SD3: text last), averaged over the heads and then over the layers."""
    flow = load_flow_model(sd3_dir)
    mods = joint_attention_modules(flow)
    module = sys.modules[type(mods[0].processor).__module__]
    functional, calls = module.F, []

    class Seen:  # the processor module's F, its attention primitive keeping what it was called with
        def __getattr__(self, name):
            return getattr(functional, name)

        @staticmethod
        def scaled_dot_product_attention(q, k, v, *args, **kwargs):
            out = functional.scaled_dot_product_attention(q, k, v, *args, **kwargs)
            calls.append((q, k, v, out))
            return out

    monkeypatch.setattr(module, "F", Seen())
    cond = flow.encode_prompt([PROMPT, "a red circle"])
    x = flow.noise(2, torch.Generator().manual_seed(0))
    with TextAttention(flow, range(len(mods))) as rec:
        flow.velocity(x, torch.tensor([0.5, 0.5]), cond)
    assert len(calls) == len(mods) >= 2 and calls[0][0].shape[1] >= 2  # [B, H, S, D]: two layers, two heads
    n, maps = flow.seq_len, []
    for q, k, v, out in calls:
        p = torch.softmax(q.double() @ k.double().transpose(-1, -2) / q.shape[-1] ** 0.5, -1)  # [B, H, S, S]
        torch.testing.assert_close((p @ v.double()).to(out.dtype), out)
        maps.append(p[:, :, :n, n:].mean(1))
    torch.testing.assert_close(rec.result(), torch.stack(maps).mean(0).float())


def test_text_key_spans_follow_the_text_sequence(flux_dir, sd3_dir):
    """Key j's span is text token j's characters, None for special tokens and padding: FLUX's T5
    tokens; SD3's CLIP tokens (after CLIP's start token), then T5's, or without T5 the zero block."""
    def text(spans):
        return [None if s is None else PROMPT[s[0]:s[1]] for s in spans]
    words = PROMPT.split()
    flux = load_flow_model(flux_dir)
    assert text(text_key_spans(flux, [PROMPT, "a red circle"])[0]) == words + [None] * (flux.max_sequence_length - 8)
    sd3 = load_flow_model(sd3_dir)
    clip = [None, *words] + [None] * (sd3.clip_length - 9)
    assert text(text_key_spans(sd3, [PROMPT])[0]) == clip + words + [None] * (sd3.max_sequence_length - 8)
    no_t5 = copy.copy(sd3)
    no_t5.tokenizer_3 = no_t5.text_encoder_3 = None
    keys = text_key_spans(no_t5, [PROMPT])[0]
    assert text(keys) == clip + [None] * no_t5.max_sequence_length
    assert len(keys) == no_t5.encode_prompt([PROMPT])["prompt_embeds"].shape[1]


def test_another_threads_forward_inside_a_chosen_layer_is_not_recorded(flux_dir):
    """A pipelined engine thread samples with its own copy of the model through the same wrapped
    primitives; its attention call may come between the trainer's layer starting and its own
    attention call. Made certain here: the trainer's first chosen layer runs the copy's whole
    forward on another thread before its own attention."""
    import threading

    flow, engine = load_flow_model(flux_dir), load_flow_model(flux_dir)
    cond, x = flow.encode_prompt([PROMPT, "a red circle"]), flow.noise(2, torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.7, 0.7])
    cond3, x3 = engine.encode_prompt(["a red circle"] * 3), engine.noise(3, torch.Generator().manual_seed(1))
    with TextAttention(flow) as alone:
        flow.velocity(x, sigma, cond)
    rec = TextAttention(flow)
    first = rec.modules[0]

    def engine_forward(*_):
        t = threading.Thread(target=engine.velocity, args=(x3, torch.full((3,), 0.5), cond3))
        t.start()
        t.join()

    handle = first.register_forward_pre_hook(engine_forward)  # after the recorder's own pre-hook
    try:
        with rec:
            first._forward_pre_hooks.move_to_end(handle.id)
            flow.velocity(x, sigma, cond)
    finally:
        handle.remove()
    torch.testing.assert_close(rec.result(), alone.result())  # the trainer's rows only, every layer


def test_text_attention_on_sd3_joint_attention(sd3_dir):
    flow = load_flow_model(sd3_dir)
    assert default_layers(len(joint_attention_modules(flow)))
    cond = flow.encode_prompt([PROMPT])
    x = flow.noise(1, torch.Generator().manual_seed(0))
    with TextAttention(flow, [0]) as rec:
        flow.velocity(x, torch.tensor([0.5]), cond)
    att = rec.result(1)
    keys = text_key_spans(flow, [PROMPT])[0]
    assert att.shape == (1, flow.seq_len, cond["prompt_embeds"].shape[1]) and len(keys) == att.shape[-1]
    assert (att.sum(-1) > 0).all() and (att.sum(-1) <= 1 + 1e-5).all()
    assert {"blue", "triangles", "circle"} <= {PROMPT[k[0]:k[1]] for k in keys if k is not None}


def test_maps_of_the_pixel_space_model_find_the_objects(bundled):
    """Teacher-forced on noised renderings of held-out scenes (sigma 0.7), the default layers'
    map of the 'exist' words is higher inside the objects' boxes than outside, for most prompts."""
    prompts = sample_prompts(16, 1, split="eval")
    images, inside = [], []
    for i, p in enumerate(prompts):
        scene = make_scene(p, seed=i)
        images.append(render(scene))
        inside.append(image_tokens_inside(scene.box_mask(), bundled.grid[0]))
    x0 = bundled.encode_images(pil_to_tensor(images))
    eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    with TextAttention(bundled) as rec:
        bundled.velocity(0.3 * x0 + 0.7 * eps, torch.full((16,), 0.7), bundled.encode_prompt(prompts))
    maps = atom_maps(rec.result(16), text_key_spans(bundled, prompts), [shapes_geneval_spans(p) for p in prompts],
                     ["exist"])
    ratio = torch.stack([maps[i, 0][inside[i]].mean() / maps[i, 0][~inside[i]].mean() for i in range(16)])
    assert (ratio > 1).float().mean() >= 0.8 and ratio.median() > 1.5, ratio


# ------------------------------------------------------------------ the objective


def cast_setup(flux_dir, tmp_path, *overrides):
    cfg = load_config(DiffusionTrainConfig, None, defaults=backend.DEFAULT_CONFIG,
                      overrides=[f"model.path={flux_dir}", f"output_dir={tmp_path / 'run'}", "method.type=cast",
                                 *FAST, *overrides])
    policy, task = backend.build(cfg)
    batch = policy.generate(task.train[:2], 2, cfg.rollout, torch.Generator().manual_seed(0))
    batch.scores = task.reward.score(batch.samples)
    batch.scores.values[:, 0] = torch.tensor([1.0, 0, 0, 1])  # make "exist" separate both groups
    batch.scores.total = batch.scores.values @ task.reward.weights
    return cfg, policy, task, batch


def test_per_patch_ratio_is_one_on_policy(flux_dir, tmp_path):
    cfg, policy, task, batch = cast_setup(flux_dir, tmp_path)
    steps = policy.sde_outputs(batch)
    assert torch.equal(torch.stack([s.elem_log_prob.mean(-1) for s in steps], 1), batch.data["token_logp"])
    torch.testing.assert_close(batch.data["token_logp"].mean(-1), batch.old_logp)
    method = CAST(cfg.method, cfg, task.reward)
    out = method.loss(policy, batch, method.advantages(batch))
    assert out.metrics["loss/ratio_min"] == out.metrics["loss/ratio_max"] == 1.0
    assert out.metrics["cast/adv_map_spatial_std"] > 0  # the maps do move the advantage around


def test_the_per_patch_objective_on_sd3(sd3_dir, tmp_path, flat_grads):
    """The whole CAST loss through SD3-style joint attention: ratio 1 on-policy, maps that move
    the advantage, and a finite gradient."""
    cfg, policy, task, batch = cast_setup(sd3_dir, tmp_path)
    assert policy.flow.family == "sd3"
    method = CAST(cfg.method, cfg, task.reward)
    out = method.loss(policy, batch, method.advantages(batch))
    assert out.metrics["loss/ratio_min"] == out.metrics["loss/ratio_max"] == 1.0
    assert out.metrics["cast/adv_map_spatial_std"] > 0
    g = flat_grads(policy.model, out)
    assert torch.isfinite(g).all() and g.abs().max() > 0


def test_with_uniform_maps_the_gradient_is_flow_grpos(flux_dir, tmp_path, flat_grads):
    cfg, policy, task, batch = cast_setup(flux_dir, tmp_path)
    method = CAST(cfg.method, cfg, task.reward)
    method.parser = lambda prompt: {}  # no atom has words: every map is uniform
    adv = method.advantages(batch)
    g_cast = flat_grads(policy.model, method.loss(policy, batch, adv))
    g_flow = flat_grads(policy.model, FlowGRPO(cfg.method, cfg, task.reward).loss(policy, batch, adv))
    assert g_flow.abs().max() > 0
    torch.testing.assert_close(g_cast, g_flow, rtol=1e-4, atol=1e-9)
    method.parser = load_parser("shapes-geneval")  # real maps: a different gradient
    method._spans.clear()
    assert not torch.allclose(flat_grads(policy.model, method.loss(policy, batch, adv)), g_flow, rtol=1e-3, atol=1e-9)


def test_projection_none_is_part_one(flux_dir, tmp_path):
    cfg, policy, task, batch = cast_setup(flux_dir, tmp_path, "method.projection=none")
    method = CAST(cfg.method, cfg, task.reward)
    adv = method.advantages(batch)
    a = method.loss(policy, batch, adv)
    b = FlowGRPO(cfg.method, cfg, task.reward).loss(policy, batch, adv)
    assert torch.equal(a.loss, b.loss) and "cast/adv_map_spatial_std" not in a.metrics


def test_attention_projection_needs_a_family_with_maps(tmp_path):
    qwen = build_tiny("qwen_image", tmp_path / "qwen", seed=0)
    cfg = load_config(DiffusionTrainConfig, None, defaults=backend.DEFAULT_CONFIG,
                      overrides=[f"model.path={qwen}", "method.type=cast", *FAST])
    with pytest.raises(ConfigError, match="projection: none"):
        backend.build(cfg)


# ------------------------------------------------------------------ the objective by hand (no model)


def stub_cast(*, mask=((True, True), (True, True)), kl_beta=0.0, **cfg):
    """CAST (projection: detector) on a hand-made batch with no model: one group of two samples,
    one atom column "exist" scoring (1, 0), so A_i1 = +-1 (population std 0.5) and A_i = +-1;
    sample 0's exist region is the left half of a 1 x 2 token grid (mean-normalised map (2, 0)),
    sample 1 has none (uniform map). Two trained steps, each token's log-prob the mean of its
    4 channels; the stored (old) token log-probs lie 0.1 below at step 0 and 0.1 above at step 1,
    so every ratio is e^0.1 at step 0 and e^-0.1 at step 1."""
    cfg = CASTConfig(**{"projection": "detector", "std_eps": 1e-8, "kl": {"beta": kl_beta}, **cfg})
    reward = SimpleNamespace(weights=torch.tensor([1.0]), names=["exist"])
    method = CAST(cfg, None, reward)
    left = np.zeros((2, 4), dtype=bool)
    left[:, :2] = True
    method.detector_regions = lambda image, prompt, nodes: {"exist": left} if image == "left" else {}
    elem = torch.linspace(-1.0, 1.0, 2 * 2 * 2 * 4).reshape(2, 2, 2, 4)  # [N, T, L, C]
    steps = [SimpleNamespace(elem_log_prob=elem[:, t].clone().requires_grad_(), mean=torch.zeros(2, 3),
                             kl_std=torch.ones(2, 3)) for t in range(2)]
    token = elem.mean(-1)  # [N, T, L]
    old = token - torch.tensor([0.1, -0.1])[None, :, None]
    values = torch.tensor([[1.0], [0.0]])
    batch = RolloutBatch(group_ids=torch.tensor([0, 0]),
                         samples=[Sample(prompt="a red circle", completion=c) for c in ("left", "none")],
                         mask=torch.tensor(mask), scores=AtomScores(names=["exist"], values=values, total=values[:, 0]),
                         data={"token_logp": old, "ref_mean": torch.ones(2, 2, 3)})
    policy = SimpleNamespace(sde_outputs=lambda b: steps, flow=SimpleNamespace(grid=(1, 2), device="cpu"))
    adv = method.advantages(batch)
    return method, policy, batch, adv


E = math.exp(0.1)


def test_per_patch_objective_by_hand_off_policy():
    """A(l) = (A_i1 M_i1(l) + A_i) / 2: sample 0 (1.5, 0.5), sample 1 (-1, -1). With the per-patch
    clip 0.05 (clip_range 0.2 unused): at step 0 (ratio e^0.1) sample 0's tokens are clipped at
    1.05 and sample 1's take the ratio; at step 1 (ratio e^-0.1) sample 0's take the ratio and
    sample 1's are clipped at 0.95."""
    method, policy, batch, adv = stub_cast(clip_range=0.2, patch_clip_range=0.05)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0]))
    out = method.loss(policy, batch, adv)
    per_token = torch.tensor([[-1.05 * (1.5 + 0.5) / 2, -(1.5 + 0.5) / 2 / E],  # [N, T]: minus the mean over L
                              [E, 0.95]])
    torch.testing.assert_close(out.per_token, per_token)
    torch.testing.assert_close(out.loss, per_token.mean())
    assert out.metrics["cast/adv_map_spatial_std"] == pytest.approx(0.5**0.5 / 2)  # std(1.5, 0.5), std(-1, -1)
    # without patch_clip_range the clip is clip_range's 0.2, which no ratio here passes
    method, policy, batch, adv = stub_cast(clip_range=0.2)
    out = method.loss(policy, batch, adv)
    torch.testing.assert_close(out.per_token, torch.tensor([[-E, -1 / E], [E, 1 / E]]))


def test_per_patch_objective_skips_untrained_steps_and_divides_by_the_given_denominator():
    """Sample 1's step 1 is not trained: the mean runs over the 6 other tokens, and the map
    metrics over the 3 trained pairs. A denominator counts (sample, step) pairs, as Flow-GRPO's
    loss_denominator does: twice the pairs of this batch halves the loss, the KL term's included."""
    method, policy, batch, adv = stub_cast(mask=((True, True), (True, False)), clip_range=0.2, kl_beta=0.1)
    out = method.loss(policy, batch, adv)
    policy_part = -(E * (1.5 + 0.5) + (1.5 + 0.5) / E - 2 * E) / 6
    # KL per (sample, step): mean((0 - 1)^2) / (2 * 1^2) = 0.5
    assert out.metrics["loss/kl"] == pytest.approx(0.5)
    torch.testing.assert_close(out.loss, torch.tensor(policy_part + 0.1 * 0.5))
    assert out.per_token[1, 1] == 0
    half = method.loss(policy, batch, adv, denom=2 * 3)
    torch.testing.assert_close(half.loss, out.loss / 2)
    assert half.metrics["loss/kl"] == pytest.approx(0.25)
    # the map metrics too are of the 3 trained pairs: std(1.5, 0.5) twice and std(-1, -1) once
    # (over all 4 pairs: 2 sqrt(0.5) / 4); with adv_clip 1.2, sample 0's 1.5 at 2 of 6 tokens
    assert out.metrics["cast/adv_map_spatial_std"] == pytest.approx(2 * 0.5**0.5 / 3)
    method, policy, batch, adv = stub_cast(mask=((True, True), (True, False)), adv_clip=1.2)
    assert method.loss(policy, batch, adv).metrics["cast/adv_map_clipped"] == pytest.approx(2 / 6)


def test_detector_maps_follow_map_norm_global_weight_and_adv_clip():
    """max norm: sample 0's map (1, 0), A(l) = (1, 0.5); global_weight 3: ((2, 0) + 3) / 4 =
    (1.25, 0.75); adv_clip 1.2 clips sample 0's 1.5 (its A_i = 1 stays): one token in four."""
    def spatial_std(**cfg):
        method, policy, batch, adv = stub_cast(**cfg)
        return method.loss(policy, batch, adv).metrics
    assert spatial_std(map_norm="max")["cast/adv_map_spatial_std"] == pytest.approx(0.5 * 0.5**0.5 / 2)
    assert spatial_std(global_weight=3.0)["cast/adv_map_spatial_std"] == pytest.approx(0.5 * 0.5**0.5 / 2)
    m = spatial_std(adv_clip=1.2)
    assert m["cast/adv_map_spatial_std"] == pytest.approx(0.7 * 0.5**0.5 / 2)  # std(1.2, 0.5)
    assert m["cast/adv_map_clipped"] == pytest.approx(1 / 4)




def attention_cast(monkeypatch, **cfg):
    """CAST (projection: attention) on the hand batch of stub_cast, on-policy, its attention
    maps made by hand: three text keys, the last one "circle" (the exist atom's word); sample
    0's two image tokens attend to it (0.3, 0.1) at step 0 and (0.1, 0.3) at step 1, sample 1's
    (0.2, 0.2). Returns the loss output, the steps and the layers the forward was asked for."""
    method, _, batch, adv = stub_cast(projection="attention", **cfg)
    monkeypatch.setattr(cast_module, "text_key_spans", lambda flow, prompts: [[(0, 1), (2, 5), (6, 12)]] * len(prompts))
    batch.data["token_logp"] = torch.linspace(-1.0, 1.0, 32).reshape(2, 2, 2, 4).mean(-1)  # on-policy
    att = torch.full((2, 2, 2, 3), 0.1)  # [T, N, L, S]
    att[0, 0, :, 2] = torch.tensor([0.3, 0.1])
    att[1, 0, :, 2] = torch.tensor([0.1, 0.3])
    att[:, 1, :, 2] = 0.2
    elem = torch.linspace(-1.0, 1.0, 32).reshape(2, 2, 2, 4)
    steps = [SimpleNamespace(elem_log_prob=elem[:, t].clone().requires_grad_()) for t in range(2)]
    asked = []

    def sde_outputs(b, attention=None):
        asked.append(attention)
        return steps, list(att)

    policy = SimpleNamespace(sde_outputs=sde_outputs, flow=None)
    return method.loss(policy, batch, adv), steps, asked


def test_attention_maps_weight_each_steps_tokens_by_hand(monkeypatch):
    """Sample 0's exist map (mean 1): (1.5, 0.5) at step 0, (0.5, 1.5) at step 1, so A(l) =
    (M(l) + 1) / 2 = (1.25, 0.75) then (0.75, 1.25); sample 1's is uniform: (-1, -1). On-policy
    the gradient of the loss in each channel of token l is -A(l) / (N T L C) = -A(l) / 32."""
    out, steps, asked = attention_cast(monkeypatch, attention_layers=[1])
    assert asked == [[1]]  # the configured layers
    expected = [torch.tensor([[1.25, 0.75], [-1.0, -1.0]]), torch.tensor([[0.75, 1.25], [-1.0, -1.0]])]
    out.loss.backward()
    for s, a in zip(steps, expected):
        torch.testing.assert_close(s.elem_log_prob.grad, (-a / 32)[:, :, None].expand(2, 2, 4))
    # max norm: sample 0's maps (1, 1/3) and (1/3, 1), A(l) = (1, 2/3) and (2/3, 1)
    out, _, _ = attention_cast(monkeypatch, map_norm="max")
    assert out.metrics["cast/adv_map_spatial_std"] == pytest.approx((1 / 3) / 2**0.5 / 2)




def test_advantage_map_clips_both_signs():
    """(A_1 M(l) + A) / 2 with M = (0.5, 1.5) and A_1 = A = +-4 is +-(3, 5); clip 3.5 bounds both signs."""
    maps = torch.tensor([[[0.5, 1.5]], [[0.5, 1.5]]])  # [N=2, K=1, L=2]
    atom, total = torch.tensor([[4.0], [-4.0]]), torch.tensor([4.0, -4.0])
    free = advantage_map(atom, torch.ones(1), maps, total, global_weight=1.0)
    torch.testing.assert_close(free, torch.tensor([[3.0, 5.0], [-3.0, -5.0]]))
    clipped = advantage_map(atom, torch.ones(1), maps, total, global_weight=1.0, clip=3.5)
    torch.testing.assert_close(clipped, torch.tensor([[3.0, 3.5], [-3.0, -3.5]]))


def test_advantage_map_with_a_negative_atom_weight():
    """w = (1, -2), A_i1 = A_i2 = 1, M_1 = (2, 0), M_2 = (0, 2), A_i = -1, lambda 1:
    ((2, 0) - 2 (0, 2) - 1) / 2 = (0.5, -2.5); the same with the weights given per sample."""
    atom, maps, total = torch.tensor([[1.0, 1.0]]), torch.tensor([[[2.0, 0.0], [0.0, 2.0]]]), torch.tensor([-1.0])
    w = torch.tensor([1.0, -2.0])
    for weights in (w, w[None]):
        out = advantage_map(atom, weights, maps, total, global_weight=1.0)
        torch.testing.assert_close(out, torch.tensor([[0.5, -2.5]]))


# ------------------------------------------------------------------ attention maps by hand (no model)


def test_atom_maps_of_two_samples_each_from_its_own_spans_and_attention():
    """Sample 1's maps come from its own row of attention and its own parser spans; a column
    with two spans takes every key that overlaps either of them."""
    att = torch.tensor([[[0.1, 0.3, 0.0], [0.3, 0.1, 0.0]],
                        [[0.0, 0.2, 0.6], [0.0, 0.4, 0.2]]])  # [N=2, L=2, S=3]
    keys = [[(0, 3), (4, 7), None], [(0, 3), (4, 7), (8, 12)]]
    spans = [{"a": [(0, 3)]}, {"a": [(4, 7), (8, 12)], "b": [(8, 12)]}]
    m = atom_maps(att, keys, spans, ["a", "b"])
    torch.testing.assert_close(m[0, 0], torch.tensor([0.5, 1.5]))  # key 0: (0.1, 0.3) / 0.2
    assert torch.equal(m[0, 1], torch.ones(2))  # sample 0 has no "b" spans
    torch.testing.assert_close(m[1, 0], torch.tensor([8 / 7, 6 / 7]))  # keys 1 and 2: (0.8, 0.6) / 0.7
    torch.testing.assert_close(m[1, 1], torch.tensor([1.5, 0.5]))  # key 2: (0.6, 0.2) / 0.4
    with pytest.raises(ValueError, match="map norm must be 'mean' or 'max'; got 'sum'"):
        atom_maps(att, keys, spans, ["a"], "sum")


def test_image_tokens_inside_refuses_a_mask_that_is_not_square():
    with pytest.raises(ValueError, match=r"a square mask .* got shape \(8, 4\)"):
        image_tokens_inside(torch.ones(8, 4, dtype=torch.bool), 2)




def _hand_attention(monkeypatch, family):
    """A one-layer joint attention, by hand, whose processor module holds the primitive the way
    diffusers' do, looked up at call time with an explicit scale ln 2 (FLUX: dispatch_attention_fn
    on [B, S, H, D]; SD3: F.scaled_dot_product_attention on [B, H, S, D]): two heads, D = 1, two
    image tokens and one text token (FLUX: text first; SD3: text last). Every key is 0 but the
    text key's, 1; head 0's image queries are (1, 0), head 1's (0, 0). Softmax over the 3 keys
    with scale ln 2: a query 1 gives the text key 2 / (1 + 1 + 2) = 1/2, a query 0 gives 1/3."""
    import types

    module = types.ModuleType("hand_attention_processor")
    module.F = torch.nn.functional
    if family == "flux":
        module.dispatch_attention_fn = lambda q, k, v, scale=None: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale).transpose(1, 2)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    processor = type("Processor", (), {"__module__": module.__name__})()
    text = [0] if family == "flux" else [2]
    img = [1, 2] if family == "flux" else [0, 1]

    class Attention(torch.nn.Module):
        processor = None

        def forward(self):
            q, k = torch.zeros(1, 2, 3, 1), torch.zeros(1, 2, 3, 1)  # [B, H, S, D]
            q[0, 0, img[0]] = 1.0
            k[0, :, text] = 1.0
            m = sys.modules[module.__name__]
            if family == "flux":
                return m.dispatch_attention_fn(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), scale=math.log(2))
            return m.F.scaled_dot_product_attention(q, k, k, scale=math.log(2))

    attn = Attention()
    attn.processor = processor
    flow = SimpleNamespace(family=family, seq_len=2, transformer=SimpleNamespace(transformer_blocks=[
        SimpleNamespace(attn=attn)]))
    return flow, attn


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_recorded_attention_by_hand_with_the_calls_own_scale(monkeypatch, family):
    flow, attn = _hand_attention(monkeypatch, family)
    rec = TextAttention(flow)
    with pytest.raises(RuntimeError, match="no attention was recorded"):
        rec.result()
    with rec:
        attn()
    # image token 0: heads (1/2, 1/3) -> 5/12; image token 1: (1/3, 1/3) -> 1/3
    torch.testing.assert_close(rec.result(), torch.tensor([[[5 / 12], [1 / 3]]]))
