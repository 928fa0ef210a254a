"""CPU tests of diffusion_rl.models / diffusion_rl.tiny: tiny FLUX.1, FLUX.2, SD3 and Qwen-Image
pipelines built offline, loaded through the real from_pretrained, checked against diffusers' own
pipelines, trained one step, saved and reloaded, with LoRA, and in pixel space."""

from __future__ import annotations

import copy
import itertools
import json
import shutil
import socket
import warnings
from types import SimpleNamespace

import huggingface_hub.constants
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from diffusion_rl.models import (
    FlowModel,
    Flux2FlowModel,
    FluxFlowModel,
    ImageSizeError,
    QwenImageFlowModel,
    SD3FlowModel,
    _load_component,
    load_flow_model,
    pack,
    pil_to_tensor,
    unpack,
)
from diffusion_rl.tiny import (
    FAMILIES,
    build_clip_tokenizer,
    build_t5_tokenizer,
    build_tiny,
)
from mmrl.core.config import ConfigError

PROMPTS = ["two red circles left of a blue square", "a green triangle"]
PROMPTS_4 = PROMPTS + ["three yellow squares above one red circle", "four blue triangles"]
COND_KEYS = {
    "flux": {"prompt_embeds", "pooled_prompt_embeds", "text_ids"},
    "sd3": {"prompt_embeds", "pooled_prompt_embeds"},
    "qwen_image": {"prompt_embeds", "prompt_embeds_mask"},
    "flux2": {"prompt_embeds", "text_ids"},
}
# Parameters that get no gradient by construction: the last block's text-stream *outputs* are
# thrown away (SD3's last block is context_pre_only; Qwen-Image keeps only the image stream),
# so the text queries, the text output projection and the text MLP of that block never reach
# the prediction. FLUX.1 / FLUX.2 feed both streams into their single-stream blocks: no gaps.
NO_GRAD = {
    "flux": (),
    "sd3": ("transformer_blocks.1.attn.add_q_proj.", "transformer_blocks.1.attn.norm_added_q."),
    "qwen_image": (
        "transformer_blocks.1.attn.add_q_proj.",
        "transformer_blocks.1.attn.norm_added_q.",
        "transformer_blocks.1.attn.to_add_out.",
        "transformer_blocks.1.txt_mlp.",
    ),
    "flux2": (),
}




@pytest.fixture(scope="module", autouse=True)
def offline():
    """Hub off and every socket connection refused, for the whole module."""

    def refuse(*args, **kwargs):
        raise OSError("network access attempted in an offline test")

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        mp.setattr(socket.socket, "connect", refuse)
        mp.setattr(socket, "create_connection", refuse)
        yield


@pytest.fixture(scope="module")
def built(tmp_path_factory, offline):
    """family -> tiny pipeline directory (seed 0); "flux_pixel" -> the pixel-space FLUX."""
    root = tmp_path_factory.mktemp("tiny_flow")
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        torch.set_num_threads(1)
        dirs = {f: build_tiny(f, root / f, seed=0) for f in FAMILIES}
        dirs["flux_pixel"] = build_tiny(
            "flux", root / "flux_pixel", seed=0, pixel_space=True, patch_size=4
        )
    torch.set_num_threads(threads)  # later tests (bit-exact rebuilds) depend on it
    return dirs


def _inputs(model: FlowModel, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = model.noise(n, g)
    sigma = torch.linspace(0.9, 0.2, n)
    return x, sigma


def _family_of(key: str) -> str:
    return "flux" if key == "flux_pixel" else key


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("key", [*FAMILIES, "flux_pixel"])
def test_encode_noise_velocity_euler_decode(built, key):
    family = _family_of(key)
    model = load_flow_model(built[key])
    assert model.family == family and model.pixel_space == (key == "flux_pixel")
    assert (model.height, model.width) == (64, 64)  # sample_size written by build_tiny
    assert model.guidance_scale == 1.0
    cond = model.encode_prompt(PROMPTS)
    assert set(cond) == COND_KEYS[family]
    assert all(v.shape[0] == 2 and not v.requires_grad for v in cond.values())
    # 64 px / (VAE 4x * 2x2 packing) = 8 -> 64 tokens of 4 ch x 2 x 2; pixel space: 16 x 16 of 3 x 4 x 4
    assert (model.seq_len, model.channels) == ((256, 48) if model.pixel_space else (64, 16))
    x = model.noise(2, torch.Generator().manual_seed(0))
    assert x.shape == (2, model.seq_len, model.channels) and x.dtype == torch.float32
    assert torch.equal(x, model.noise(2, torch.Generator().manual_seed(0)))
    sigmas = torch.linspace(1.0, 0.0, 5)
    with torch.no_grad():
        for s, s_next in itertools.pairwise(sigmas):
            v = model.velocity(x, s.expand(2), cond)
            assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
            x = x + (s_next - s) * v
    images = model.decode(x)
    assert len(images) == 2
    assert all(im.size == (64, 64) and im.mode == "RGB" for im in images)
    pt = model.decode(x, output_type="pt")
    assert pt.shape == (2, 3, 64, 64) and 0 <= pt.min() and pt.max() <= 1
    # the frozen parts really are frozen
    for name, comp in model.components.items():
        if isinstance(comp, torch.nn.Module) and name != "transformer":
            assert not comp.training and not any(p.requires_grad for p in comp.parameters())


# The strongest check of packing, position ids, prompt encoding, time conditioning, CFG, noise
# and decoding: a few Euler steps of ours reproduce diffusers' own pipeline __call__ on the
# same directory (the tiny tokenizers pad to 32 / 96 tokens: passed as max_sequence_length).
PIPELINE_KWARGS = {
    "flux": [
        (1.0, {"guidance_scale": 3.5, "max_sequence_length": 32}),
        (
            3.0,
            {
                "guidance_scale": 3.5,
                "max_sequence_length": 32,
                "true_cfg_scale": 3.0,
                "negative_prompt": "",
            },
        ),
    ],
    "sd3": [
        (1.0, {"guidance_scale": 1.0, "max_sequence_length": 32}),
        (5.0, {"guidance_scale": 5.0, "max_sequence_length": 32}),
    ],
    "qwen_image": [
        (1.0, {"true_cfg_scale": 1.0}),
        (4.0, {"true_cfg_scale": 4.0, "negative_prompt": ""}),
    ],
    "flux2": [(1.0, {"guidance_scale": 4.0, "max_sequence_length": 96})],  # no CFG in Flux2Pipeline
}


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_the_diffusers_pipeline(built, family):
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(built[family], local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    for guidance_scale, kwargs in PIPELINE_KWARGS[family]:
        model = load_flow_model(built[family], guidance_scale=guidance_scale)
        ref = {}
        for output_type in ("latent", "pt"):
            ref[output_type] = pipe(
                prompt=PROMPTS, height=64, width=64, num_inference_steps=3,
                generator=torch.Generator().manual_seed(0), output_type=output_type, **kwargs,
            ).images  # fmt: skip
        sigmas = pipe.scheduler.sigmas
        cond = model.encode_prompt(PROMPTS)
        x = model.noise(2, torch.Generator().manual_seed(0))
        with torch.no_grad():
            for i in range(3):
                x = x + (sigmas[i + 1] - sigmas[i]) * model.velocity(x, sigmas[i].expand(2), cond)
        latents = ref["latent"]
        if latents.ndim == 4:  # SD3 returns unpacked latents
            latents = pack(latents, model.patch)
        torch.testing.assert_close(x, latents, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            model.decode(x, output_type="pt"), ref["pt"], atol=1e-5, rtol=1e-5
        )


# --------------------------------------------------------------------------- training


def _flow_matching_loss(model: FlowModel, cond, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x0 = 0.5 * torch.randn(2, model.seq_len, model.channels, generator=g)
    eps = model.noise(2, g)
    s = torch.tensor([0.3, 0.8])
    x = (1 - s[:, None, None]) * x0 + s[:, None, None] * eps
    return ((model.velocity(x, s, cond) - (eps - x0)) ** 2).mean()


@pytest.mark.parametrize("key", [*FAMILIES, "flux_pixel"])
def test_one_step_changes_every_trainable_parameter(built, key):
    model = load_flow_model(built[key])
    cond = model.encode_prompt(PROMPTS)
    params = {n: p for n, p in model.transformer.named_parameters() if p.requires_grad}
    assert len(params) == len(list(model.transformer.parameters()))  # full fine-tuning
    before = {n: p.detach().clone() for n, p in params.items()}
    opt = torch.optim.Adam(params.values(), lr=1e-3)
    loss = _flow_matching_loss(model, cond)
    assert torch.isfinite(loss)
    loss.backward()
    opt.step()
    excluded = NO_GRAD[_family_of(key)]
    unchanged = [n for n, p in params.items() if torch.equal(p, before[n])]
    assert sorted(unchanged) == sorted(n for n in params if n.startswith(excluded))
    assert all(n in params for n in unchanged)  # the exclusions name real parameters
    # the text side had no gradient at all
    assert all(
        p.grad is None
        for name, comp in model.components.items()
        if isinstance(comp, torch.nn.Module) and name != "transformer"
        for p in comp.parameters()
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_are_independent(built, family):
    model = load_flow_model(built[family])
    cond = model.encode_prompt(PROMPTS_4)
    x, sigma = _inputs(model, 4)
    with torch.no_grad():
        whole = model.velocity(x, sigma, cond)
        halves = [
            model.velocity(
                x[i : i + 2], sigma[i : i + 2], {k: v[i : i + 2] for k, v in cond.items()}
            )
            for i in (0, 2)
        ]
        # and conditioning encoded in other batches concatenates row-wise
        mixed = {k: torch.cat([a, b]) for (k, a), b in zip(
            model.encode_prompt(PROMPTS_4[:1]).items(), model.encode_prompt(PROMPTS_4[1:]).values(), strict=True
        )}  # fmt: skip
        again = model.velocity(x, sigma, mixed)
    torch.testing.assert_close(whole, torch.cat(halves), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(whole, again, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_classifier_free_guidance(built, family):
    plain = load_flow_model(built[family])
    guided = load_flow_model(built[family], guidance_scale=4.0)
    cond = guided.encode_prompt(PROMPTS)
    assert set(cond) == COND_KEYS[family] | {f"neg/{k}" for k in COND_KEYS[family]}
    for k in COND_KEYS[family]:
        torch.testing.assert_close(cond[k], plain.encode_prompt(PROMPTS)[k])
        assert torch.equal(cond[f"neg/{k}"][0], cond[f"neg/{k}"][1])  # the empty prompt, per row
    x, sigma = _inputs(plain, 2)
    with torch.no_grad():
        v = guided.velocity(x, sigma, cond)
        v_cond = plain.velocity(x, sigma, {k: cond[k] for k in COND_KEYS[family]})
        v_uncond = plain.velocity(x, sigma, {k: cond[f"neg/{k}"] for k in COND_KEYS[family]})
    assert not torch.allclose(v, v_cond, atol=1e-3)
    expected = v_uncond + 4.0 * (v_cond - v_uncond)
    if family == "qwen_image":  # the pipeline rescales to the conditional prediction's norm
        expected = (
            expected * v_cond.norm(dim=-1, keepdim=True) / expected.norm(dim=-1, keepdim=True)
        )
    torch.testing.assert_close(v, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(KeyError, match="neg/"):
        guided.velocity(x, sigma, {k: cond[k] for k in COND_KEYS[family]})


# --------------------------------------------------------------------------- saving, loading, LoRA


@pytest.mark.parametrize("key", [*FAMILIES, "flux_pixel"])
def test_save_pretrained_round_trip(built, key, tmp_path):
    model = load_flow_model(built[key])
    cond = model.encode_prompt(PROMPTS)
    x, sigma = _inputs(model, 2)
    loss = _flow_matching_loss(model, cond)  # a trained model, not the one on disk
    loss.backward()
    torch.optim.SGD(model.transformer.parameters(), lr=0.1).step()
    out = model.save_pretrained(tmp_path / "saved")
    index = json.loads((out / "model_index.json").read_text())
    assert index == {
        **json.loads((built[key] / "model_index.json").read_text()),
        "_diffusers_version": index["_diffusers_version"],
    }
    assert not list(out.rglob("*.bin"))  # safetensors only
    again = load_flow_model(out)
    assert again.pixel_space == model.pixel_space and again.seq_len == model.seq_len
    with torch.no_grad():
        assert torch.equal(
            again.velocity(x, sigma, again.encode_prompt(PROMPTS)), model.velocity(x, sigma, cond)
        )


def test_lora_init_follows_the_seed(built):
    def initial(seed, draws=0):
        model = load_flow_model(built["flux"])
        torch.rand(draws)  # wherever the global RNG is
        model.add_lora(r=4, alpha=8, seed=seed)
        return {n: p.detach().clone() for n, p in model.transformer.named_parameters() if ".lora_A." in n}

    a, b, c = initial(0), initial(0, draws=7), initial(1)
    assert a and all(torch.equal(a[k], b[k]) for k in a)
    assert not any(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora(built, family, tmp_path):
    model = load_flow_model(built[family])
    cond = model.encode_prompt(PROMPTS)
    x, sigma = _inputs(model, 2)
    with torch.no_grad():
        base = model.velocity(x, sigma, cond)
    with pytest.raises(RuntimeError, match="LoRA"), model.disable_adapter():
        pass
    model.add_lora(r=4, alpha=8)
    trainable = [n for n, p in model.transformer.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable} >= {"to_q", "to_k", "to_v"}
    with torch.no_grad():
        assert torch.equal(model.velocity(x, sigma, cond), base)  # B = 0 at init
    params = [p for p in model.transformer.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-2)
    _flow_matching_loss(model, cond).backward()
    opt.step()
    with torch.no_grad():
        tuned = model.velocity(x, sigma, cond)
        with model.disable_adapter():
            assert torch.equal(model.velocity(x, sigma, cond), base)
        assert torch.equal(model.velocity(x, sigma, cond), tuned)  # adapters back on
    assert not torch.allclose(tuned, base, atol=1e-4)
    assert [p for p in model.transformer.parameters() if p.requires_grad] == params

    # the adapter alone: saved, then loaded in place into a fresh model with its own LoRA
    adapter = model.save_transformer_weights(tmp_path / "adapter")
    assert (adapter / "adapter_config.json").is_file() and (
        adapter / "adapter_model.safetensors"
    ).is_file()
    other = load_flow_model(built[family])
    other.add_lora(r=4, alpha=8)
    ids = [id(p) for p in other.transformer.parameters()]
    other.load_transformer_weights(adapter)
    assert [id(p) for p in other.transformer.parameters()] == ids
    with torch.no_grad():
        assert torch.equal(other.velocity(x, sigma, cond), tuned)
    scaled = load_flow_model(built[family])
    scaled.add_lora(r=4, alpha=32)  # the same shapes, another scaling: refused, not loaded
    with pytest.raises(ConfigError, match=r"other LoRA settings \(alpha 8 there, 32 here\)"):
        scaled.load_transformer_weights(adapter)
    # and into a model without one (the adapter is added from adapter_config.json)
    fresh = load_flow_model(built[family])
    fresh.load_transformer_weights(adapter)
    with torch.no_grad():
        assert torch.equal(fresh.velocity(x, sigma, cond), tuned)

    # the whole pipeline, LoRA merged into plain weights (which a LoRA model refuses to load)
    merged = load_flow_model(model.save_pretrained(tmp_path / "merged"))
    with pytest.raises(ConfigError, match="LoRA adapter"):
        other.load_transformer_weights(tmp_path / "merged")
    assert not merged.has_lora
    assert not any(
        "lora" in k
        for k in load_file(tmp_path / "merged/transformer/diffusion_pytorch_model.safetensors")
    )
    with torch.no_grad():
        torch.testing.assert_close(merged.velocity(x, sigma, cond), tuned, atol=1e-5, rtol=1e-5)


def test_load_full_transformer_weights_in_place(built, tmp_path):
    trained = load_flow_model(built["flux"])
    cond = trained.encode_prompt(PROMPTS)
    _flow_matching_loss(trained, cond).backward()
    torch.optim.SGD(trained.transformer.parameters(), lr=0.1).step()
    saved = trained.save_transformer_weights(tmp_path / "transformer")
    target = load_flow_model(built["flux"])
    params = list(target.transformer.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    target.load_transformer_weights(saved)
    assert all(a is b for a, b in zip(params, target.transformer.parameters(), strict=True))
    assert opt.param_groups[0]["params"][0] is params[0]
    x, sigma = _inputs(target, 2)
    with torch.no_grad():
        assert torch.equal(target.velocity(x, sigma, cond), trained.velocity(x, sigma, cond))
    # a pipeline directory works too (its transformer/), a mismatched one is refused by name
    target.load_transformer_weights(built["flux"])
    with pytest.raises(ConfigError, match="do not match"):
        target.load_transformer_weights(built["sd3"] / "transformer")
    with pytest.raises(ConfigError, match="neither a transformer"):
        target.load_transformer_weights(tmp_path)


# --------------------------------------------------------------------------- pixel space, packing


@pytest.mark.parametrize("p", [1, 2, 4])
def test_pack_unpack_bijection(p):
    x = torch.randn(3, 5, 8, 12)
    tokens = pack(x, p)
    assert tokens.shape == (3, (8 // p) * (12 // p), 5 * p * p)
    assert torch.equal(unpack(tokens, 8, 12, p), x)
    assert torch.equal(pack(unpack(tokens, 8, 12, p), p), tokens)
    # token (i, j) holds exactly the pixels of patch (i, j), channel-major
    i, j = 1, 2
    assert torch.equal(
        tokens[:, i * (12 // p) + j],
        x[:, :, i * p : (i + 1) * p, j * p : (j + 1) * p].reshape(3, -1),
    )
    with pytest.raises(ValueError):
        pack(torch.zeros(1, 3, 6, 6), 4)


def test_pixel_space_model(built):
    path = built["flux_pixel"]
    index = json.loads((path / "model_index.json").read_text())
    assert index["vae"] == [None, None] and not (path / "vae").exists()
    assert json.loads((path / "pixel_space.json").read_text())["patch_size"] == 4
    model = load_flow_model(path)
    assert (
        model.vae is None and model.pixel_patch == 4 and model.transformer.config.in_channels == 48
    )
    noise_images = model.decode(model.noise(2, torch.Generator().manual_seed(0)))
    assert [im.size for im in noise_images] == [(64, 64)] * 2
    # the latents are the image: a known image in [-1, 1] decodes to itself
    image = torch.zeros(1, 3, 64, 64)
    image[:, 0, 8:24, 8:40] = 1.0  # red-ish rectangle: R = 255
    image[:, 2] = -1.0  # B = 0 everywhere
    decoded = model.decode(pack(image, 4), output_type="pt")
    torch.testing.assert_close(decoded, image / 2 + 0.5)
    pil = model.decode(pack(image, 4))[0]
    assert pil.getpixel((10, 10)) == (255, 128, 0) and pil.getpixel((50, 50)) == (128, 128, 0)


def test_encode_images_inverts_decode(built):
    """Pixel space: the patches themselves. FLUX with a VAE: the posterior mean under the
    pipeline's (z - shift) * scale, 2 x 2-packed -- what decode undoes."""
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    pixel = load_flow_model(built["flux_pixel"])
    torch.testing.assert_close(pixel.decode(pixel.encode_images(images), output_type="pt"), images / 2 + 0.5)
    flux = load_flow_model(built["flux"])
    z = flux.encode_images(images)
    assert z.shape == (2, flux.seq_len, flux.channels)
    c = flux.vae.config
    want = flux.vae.encode(images).latent_dist.mean
    torch.testing.assert_close(unpack(z, 16, 16, 2) / c.scaling_factor + c.shift_factor, want)
    with pytest.raises(NotImplementedError, match="FLUX"):
        load_flow_model(built["sd3"]).encode_images(images)


def test_pil_to_tensor_is_the_inverse_of_decodes_pil_output(built):
    """PIL -> [-1, 1] tensor -> (through the pixel-space model) PIL gives the same pixels back."""
    pixel = load_flow_model(built["flux_pixel"])
    images = pixel.decode(pixel.noise(2, torch.Generator().manual_seed(3)))
    x = pil_to_tensor(images)
    assert x.shape == (2, 3, 64, 64) and x.min() >= -1 and x.max() <= 1
    again = pixel.decode(pixel.encode_images(x))
    assert all((np.asarray(a) == np.asarray(b)).all() for a, b in zip(images, again))
    gray = Image.new("L", (64, 64), 255)  # converted to RGB: white is +1 in every channel
    assert (pil_to_tensor([gray]) == 1).all()


def test_pixel_space_x_prediction_returns_the_implied_velocity(tmp_path):
    """prediction "sample": the transformer's output is x0_hat and velocity() gives
    (x - x0_hat) / max(sigma, 0.05); the setting survives save_pretrained."""
    path = build_tiny("flux", tmp_path / "x", seed=0, pixel_space=True, prediction="sample")
    model = load_flow_model(path)
    assert model.prediction == "sample"
    cond = model.encode_prompt(["a red circle", "two blue squares"])
    x = model.noise(2, torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.8, 0.01])
    with torch.no_grad():
        x0_hat = model._forward(x, sigma, model._rows(cond, 2)).float()
        v = model.velocity(x, sigma, cond)
    torch.testing.assert_close(v, (x - x0_hat) / torch.tensor([0.8, 0.05])[:, None, None])
    model.save_pretrained(tmp_path / "saved")
    assert load_flow_model(tmp_path / "saved").prediction == "sample"


# --------------------------------------------------------------------------- building, errors


def test_build_tiny_is_deterministic(built, tmp_path):
    torch.manual_seed(123)
    state = torch.get_rng_state()
    again = build_tiny("flux", tmp_path / "a", seed=0)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG is left untouched
    other = build_tiny("flux", tmp_path / "b", seed=1)
    for sub in (
        "transformer/diffusion_pytorch_model.safetensors",
        "text_encoder/model.safetensors",
    ):
        ref, same, diff = (load_file(d / sub) for d in (built["flux"], again, other))
        assert ref.keys() == same.keys() and all(torch.equal(ref[k], same[k]) for k in ref)
        assert any(not torch.equal(ref[k], diff[k]) for k in ref)
    assert (again / "tokenizer_2/tokenizer.json").read_text() == (
        built["flux"] / "tokenizer_2/tokenizer.json"
    ).read_text()
    with pytest.raises(ValueError, match="pixel_space"):
        build_tiny("sd3", tmp_path / "c", pixel_space=True)
    with pytest.raises(ValueError, match="family"):
        build_tiny("sdxl", tmp_path / "d")


@pytest.mark.parametrize("kwargs, message", [
    ({"height": 64, "width": 32}, "tiny models are square; got height=64, width=32"),
    ({"height": 36, "width": 36}, "height/width 36 must be a multiple of 8"),  # 4x VAE, 2 x 2 packing
    ({"height": 66, "width": 66, "pixel_space": True}, "height/width 66 must be a multiple of 4"),
    ({"height": 40, "width": 40, "pixel_space": True, "patch_size": 16}, "must be a multiple of 16"),
])
def test_build_tiny_refuses_a_size_off_its_grid_before_building(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        build_tiny("flux", tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()  # refused before anything is written


def test_each_family_has_its_released_scheduler_config(built):
    def scheduler(key):
        return json.loads((built[key] / "scheduler" / "scheduler_config.json").read_text())

    assert scheduler("sd3")["shift"] == 3.0 and not scheduler("sd3")["use_dynamic_shifting"]
    for key in ("flux", "flux2", "flux_pixel"):
        got = scheduler(key)
        assert got["use_dynamic_shifting"] and (got["base_shift"], got["max_shift"]) == (0.5, 1.15), key
        assert (got["base_image_seq_len"], got["max_image_seq_len"]) == (256, 4096), key
    got = scheduler("qwen_image")
    assert got["use_dynamic_shifting"] and (got["base_shift"], got["max_shift"], got["shift_terminal"]) == (0.5, 0.9, 0.02)
    assert got["max_image_seq_len"] == 8192


def test_tiny_tokenizer_ids_scores_sd3_positions_and_vae_factors_are_the_documented_ones(built):
    clip = build_clip_tokenizer()
    assert (clip.bos_token_id, clip.eos_token_id) == (len(clip) - 2, len(clip) - 1)  # the last two, as in CLIP
    assert clip.pad_token_id == clip.eos_token_id
    pieces = json.loads(build_t5_tokenizer()._tokenizer.to_str())["model"]["vocab"]
    assert [p for p, _ in pieces[:3]] == ["<pad>", "</s>", "<unk>"]
    scores = dict(pieces)
    words = [s for p, s in pieces[3:] if p.startswith("▁") and len(p) > 1]
    # a corpus word beats "▁", which beats a single character: other words spell out
    assert min(words) > scores["▁"] > scores["a"] == scores["Z"] == scores["7"]
    sd3 = json.loads((built["sd3"] / "transformer" / "config.json").read_text())
    assert sd3["sample_size"] == 16 and sd3["pos_embed_max_size"] == 16  # room for 128 px, not only 64
    for key, factors in (("flux", (0.3611, 0.1159)), ("sd3", (1.5305, 0.0609))):  # the real VAEs' values
        vae = json.loads((built[key] / "vae" / "config.json").read_text())
        assert (vae["scaling_factor"], vae["shift_factor"]) == factors, key


def test_qwen_image_pads_right_and_flux2_latent_statistics_are_not_the_identity(built):
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(built["qwen_image"] / "tokenizer").padding_side == "right"
    vae = load_file(built["flux2"] / "vae" / "diffusion_pytorch_model.safetensors")
    # made-up statistics, so that decode's de-normalisation does something a test can see
    assert not torch.equal(vae["bn.running_mean"], torch.zeros(4 * 4))
    assert not torch.equal(vae["bn.running_var"], torch.ones(4 * 4))


def test_tiny_tokenizers_cover_the_task_vocabulary():
    clip, t5 = build_clip_tokenizer(), build_t5_tokenizer()
    words = "a an one two three four red green blue yellow circle circles square squares triangle triangles"
    words += " left right of above below"
    for w in words.split():
        assert clip.tokenize(w) == [w + "</w>"], w
        assert t5.tokenize(w) == ["▁" + w], w
    # anything else still encodes: byte-level BPE never needs <unk>; T5 spells it out
    assert clip.unk_token_id not in clip("Zebra! 123 é").input_ids[1:-1]
    assert t5.decode(t5("Zebra 123").input_ids, skip_special_tokens=True) == "Zebra 123"
    ids = t5(["a red circle"], padding="max_length", max_length=32).input_ids[0]
    assert len(ids) == 32 and ids[3] == t5.eos_token_id and ids[4:] == [t5.pad_token_id] * 28


def test_bad_directories_give_clear_errors(built, tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        load_flow_model(tmp_path / "nope")
    with pytest.raises(ConfigError, match="no model_index.json"):
        load_flow_model(tmp_path)
    sdxl = tmp_path / "sdxl"
    sdxl.mkdir()
    (sdxl / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(ValueError, match="StableDiffusionXLPipeline.*FluxPipeline.*Flux2Pipeline"):
        load_flow_model(sdxl)
    # a folder gone, and a component not listed
    broken = shutil.copytree(built["sd3"], tmp_path / "broken")
    shutil.rmtree(broken / "vae")
    index = json.loads((broken / "model_index.json").read_text())
    del index["text_encoder_2"]
    (broken / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="incomplete") as err:
        load_flow_model(broken)
    assert "the vae/ folder is missing" in str(err.value)
    assert "'text_encoder_2' is not listed in model_index.json" in str(err.value)
    # a corrupt component names the component
    corrupt = shutil.copytree(built["flux"], tmp_path / "corrupt")
    (corrupt / "transformer/config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="'transformer'"):
        load_flow_model(corrupt)
    with pytest.raises(ConfigError, match="multiples of 8"):
        load_flow_model(built["flux"], height=60, width=64)
    with pytest.raises(ConfigError, match="dtype"):
        load_flow_model(built["flux"], dtype="float33")
    with pytest.raises(ConfigError, match="guidance_scale"):
        load_flow_model(built["flux"], guidance_scale=0.5)


def test_other_sizes_and_dtypes(built):
    model = load_flow_model(built["flux"], height=32, width=48, dtype="bfloat16")
    assert model.seq_len == 4 * 6 and model.dtype == torch.bfloat16
    cond = model.encode_prompt(PROMPTS)
    x, sigma = _inputs(model, 2)
    v = model.velocity(x, sigma, cond)
    assert v.dtype == torch.float32 and v.shape == x.shape and torch.isfinite(v).all()
    assert [im.size for im in model.decode(x)] == [(48, 32)] * 2


@pytest.mark.parametrize("family", ["flux", "sd3", "qwen_image"])  # FLUX.2's chat template is not measured
def test_a_prompt_cut_by_a_text_encoder_is_said_once(built, family):
    """The pipelines cut a long prompt at the encoder's length; that is said, once per model."""
    import warnings

    model = load_flow_model(built[family])
    long = " ".join(["a red circle left of a blue square"] * (150 if family == "qwen_image" else 40))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model.encode_prompt(["a red circle"])
        assert not said
        model.encode_prompt([long, long])
        model.encode_prompt([long + " and a green triangle"])
    cut = [w for w in said if "is cut there" in str(w.message)]
    assert len(cut) == 1 and "tokens and is cut there (said once per model)" in str(cut[0].message)


# --------------------------------------------------------------------------- edges, by hand


@pytest.fixture(scope="module")
def loaded(built):
    """key -> a model loaded once from `built`, for tests that only read it (a test that
    changes a model builds its own with `_fresh`)."""
    cache = {}

    def get(key):
        if key not in cache:
            cache[key] = load_flow_model(built[key])
        return cache[key]

    return get


def _fresh(model: FlowModel, *, copy_transformer: bool = False, **kwargs) -> FlowModel:
    """Another model of `model`'s class on its components (its own counters, caches and, with
    copy_transformer, its own transformer to train, add LoRA to or load into)."""
    components = dict(model.components)
    if copy_transformer:
        components["transformer"] = copy.deepcopy(model.transformer)
    pixel = {"patch_size": model.pixel_patch, "prediction": model.prediction} if model.pixel_space else None
    kwargs = {"height": model.height, "width": model.width, "pixel_space": pixel, **kwargs}
    return type(model)(components, **kwargs)


def test_pack_and_unpack_refuse_a_grid_one_side_does_not_fit():
    with pytest.raises(ValueError, match="cannot pack a 8x6 grid into 4x4 patches"):
        pack(torch.zeros(1, 3, 8, 6), 4)  # 8 fits, 6 does not
    with pytest.raises(ValueError, match="cannot pack a 6x8 grid"):
        pack(torch.zeros(1, 3, 6, 8), 4)
    # 4 tokens = (4/2)(4/2) is right, but 5 values per token are not whole 2x2 patches
    with pytest.raises(ValueError, match="do not unpack to 4x4 in 2x2 patches"):
        unpack(torch.zeros(1, 4, 5), 4, 4, 2)
    with pytest.raises(ValueError, match="do not unpack"):
        unpack(torch.zeros(1, 5, 4), 4, 4, 2)  # 5 tokens for a 2x2 grid


def test_a_pixel_space_prediction_other_than_velocity_or_sample_is_refused(loaded):
    pixel = loaded("flux_pixel")
    with pytest.raises(ConfigError, match="prediction must be 'velocity' or 'sample', not 'epsilon'"):
        FluxFlowModel(pixel.components, height=64, width=64,
                      pixel_space={"patch_size": 4, "prediction": "epsilon"})


@pytest.mark.parametrize("height, width", [(0, 64), (64, 0), (-8, 64), (64, 60), (60, 64)])
def test_a_size_of_0_or_off_the_token_grid_is_refused(loaded, height, width):
    """FLUX with the tiny 4x VAE: 8 pixels per token side; 0 is a multiple of 8 but no image. An
    ImageSizeError: the CLI names model.height / model.width for it, not model.path."""
    with pytest.raises(ImageSizeError, match="must be positive multiples of 8"):
        _fresh(loaded("flux"), height=height, width=width)


def test_a_prompt_exactly_as_long_as_clip_reads_is_not_said_cut(loaded):
    """The tiny CLIP reads 32 tokens: <start> + 30 one-token words + <end> = 32 is whole, one
    word more is cut (T5 adds only </s>: 31 and 32 tokens, never cut)."""
    model = _fresh(loaded("flux"))
    assert model.clip_length == 32 and model.max_sequence_length == 32
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model.encode_prompt(" ".join(["red"] * 30))
        assert not [w for w in said if "is cut there" in str(w.message)]
        model.encode_prompt(" ".join(["red"] * 31))
    assert [str(w.message) for w in said if "is cut there" in str(w.message)] == [
        "a prompt is longer than the CLIP text encoder's 32 tokens and is cut there (said once per model): "
        + repr(" ".join(["red"] * 31)[:120])
    ]


def test_encode_prompt_takes_a_string_as_one_prompt_and_refuses_none(loaded):
    model = loaded("flux")
    one, listed = model.encode_prompt("a red circle"), model.encode_prompt(["a red circle"])
    assert one["prompt_embeds"].shape[0] == 1  # one row, not one per character
    assert one.keys() == listed.keys() and all(torch.equal(one[k], listed[k]) for k in one)
    with pytest.raises(ValueError, match="at least one prompt"):
        model.encode_prompt([])


def test_velocity_takes_sigma_as_a_number_or_one_per_row(loaded):
    model = loaded("flux")
    cond = model.encode_prompt(PROMPTS)
    x = model.noise(2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        per_row = model.velocity(x, torch.tensor([0.5, 0.5]), cond)
        assert torch.equal(model.velocity(x, 0.5, cond), per_row)
        assert torch.equal(model.velocity(x, torch.tensor(0.5), cond), per_row)
        assert torch.equal(model.velocity(x, torch.tensor([[0.5], [0.5]]), cond), per_row)


def test_conditioning_with_other_rows_than_latents_is_refused(loaded):
    model = loaded("flux")
    cond = model.encode_prompt(PROMPTS[:1])
    x = model.noise(2, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="'prompt_embeds' has 1 rows for 2 latents"), torch.no_grad():
        model.velocity(x, 0.5, cond)


def test_evaluations_count_two_rows_per_sample_under_cfg(loaded):
    plain = _fresh(loaded("flux"))
    guided = _fresh(loaded("flux"), guidance_scale=2.0)
    x = plain.noise(3, torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain.velocity(x, 0.5, plain.encode_prompt(PROMPTS_4[:3]))
        guided.velocity(x, 0.5, guided.encode_prompt(PROMPTS_4[:3]))
    assert (plain.evaluations, guided.evaluations) == (3, 6)  # 3 rows; 3 conditional + 3 empty-prompt rows


def test_decode_clamps_to_the_unit_range_and_refuses_other_output_types(loaded):
    """Pixel space decodes x to x / 2 + 1/2 clamped to [0, 1]: 3 -> 2 -> 1, -3 -> -1 -> 0,
    0.5 -> 0.75 (255 * 0.75 = 191.25 -> 191)."""
    model = loaded("flux_pixel")
    image = torch.full((1, 3, 64, 64), 0.5)
    image[:, 0], image[:, 1] = 3.0, -3.0
    pt = model.decode(pack(image, 4), output_type="pt")
    assert pt.shape == (1, 3, 64, 64)
    assert (pt[:, 0] == 1).all() and (pt[:, 1] == 0).all() and (pt[:, 2] == 0.75).all()
    assert model.decode(pack(image, 4))[0].getpixel((5, 7)) == (255, 0, 191)
    with pytest.raises(ValueError, match="output_type must be 'pil' or 'pt', not 'np'"):
        model.decode(pack(image, 4), output_type="np")


def test_distilled_guidance_is_the_given_one_else_the_pipelines(loaded):
    """FLUX.1-dev embeds the guidance (FluxPipeline's default 3.5), per row, float32; a
    transformer without guidance_embeds (SD3) gets none."""
    flux = loaded("flux")
    assert torch.equal(flux._guidance(2), torch.tensor([3.5, 3.5]))
    given = _fresh(flux, distilled_guidance=7)
    assert given._guidance(3).dtype == torch.float32 and torch.equal(given._guidance(3), torch.tensor([7.0] * 3))
    assert loaded("sd3")._guidance(2) is None
    cond = flux.encode_prompt(PROMPTS)
    x = flux.noise(2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.allclose(given.velocity(x, 0.5, cond), flux.velocity(x, 0.5, cond))


def test_add_lora_twice_is_refused(loaded):
    model = _fresh(loaded("flux"), copy_transformer=True)
    model.add_lora(r=2, alpha=2)
    with pytest.raises(RuntimeError, match="already has a LoRA adapter"):
        model.add_lora(r=4, alpha=8)
    assert model.transformer.peft_config["default"].r == 2


def test_lora_targets_that_are_not_linear_layers_name_the_key_and_the_layers(loaded):
    """Was `LoRA target_modules {'attn'}: Target module FluxAttention(` and then the whole
    attention block printed over many lines; a name matching nothing did not list the layers;
    and add_lora after a refusal failed with an AttributeError (diffusers' half-set state)."""
    model = _fresh(loaded("flux"), copy_transformer=True)
    with pytest.raises(ConfigError) as err:
        model.add_lora(r=2, target_modules=["attn"])
    msg = str(err.value)
    assert msg.startswith("model.lora.target_modules ['attn']: 'attn' names FluxAttention") and "\n" not in msg
    assert "to_out.0" in msg and "to_q" in msg  # the layers it could name
    with pytest.raises(ConfigError, match=r"\['nothing'\] do not name layers of FluxTransformer2DModel .*to_q"):
        model.add_lora(r=2, target_modules=["nothing"])
    model.add_lora(r=2, target_modules=["to_q"])  # a refusal leaves the model as it was: this one works
    assert model.has_lora


def test_copy_carried_files_skips_a_file_that_is_gone(loaded, tmp_path):
    model = _fresh(loaded("flux"))
    (tmp_path / "cast_window.json").write_text('{"window": [0, 1]}')
    model.carried_files = [tmp_path / "cast_window.json", tmp_path / "gone.json"]
    (tmp_path / "out").mkdir()
    model.copy_carried_files(tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["cast_window.json"]
    assert (tmp_path / "out/cast_window.json").read_text() == '{"window": [0, 1]}'


def test_full_weights_missing_a_tensor_or_of_another_shape_are_refused(loaded, tmp_path):
    """Keys and shapes must match exactly: a weight [o, i] saved as its first row [i] would
    broadcast into every row if copied."""
    model = _fresh(loaded("flux"), copy_transformer=True)
    state = {k: v.detach().clone() for k, v in model._base_tensors().items()}
    name = "proj_out.weight"
    assert state[name].ndim == 2 and state[name].shape[0] > 1
    before = state[name].clone()

    def write(folder, tensors):
        (tmp_path / folder).mkdir()
        save_file(tensors, tmp_path / folder / "diffusion_pytorch_model.safetensors")
        return tmp_path / folder

    short = write("short", {k: v for k, v in state.items() if k != name})
    with pytest.raises(ConfigError, match=r"missing \['proj_out.weight'\], unexpected \[\]"):
        model.load_transformer_weights(short)
    row = write("row", {**state, name: torch.full_like(state[name][0], 7.0)})
    with pytest.raises(ConfigError, match=rf"proj_out.weight has shape \({before.shape[1]},\), expected"):
        model.load_transformer_weights(row)
    assert torch.equal(dict(model.transformer.named_parameters())[name], before)
    # a refusal leaves every weight as it was, also those before the one of the wrong shape
    first, *_, last = state  # the first tensor copied and the last
    late = write("late", {**state, first: state[first] + 1.0, last: torch.zeros(*state[last].shape, 2)})
    with pytest.raises(ConfigError, match=rf"{last} has shape"):
        model.load_transformer_weights(late)
    assert torch.equal(model._base_tensors()[first], state[first])


def test_a_lora_adapter_of_another_rank_is_refused_by_name(loaded, tmp_path):
    trained = _fresh(loaded("flux"), copy_transformer=True)
    trained.add_lora(r=4, alpha=4)
    adapter = trained.save_transformer_weights(tmp_path / "adapter")
    other = _fresh(loaded("flux"), copy_transformer=True)
    other.add_lora(r=8, alpha=4)  # the same alpha: only the rank differs
    with pytest.raises(ConfigError, match=r"\(r=4, targets .*\) does not match this model's \(r=8"):
        other.load_transformer_weights(adapter)


def test_a_lora_adapter_with_keys_the_model_lacks_is_refused(loaded, tmp_path):
    trained = _fresh(loaded("flux"), copy_transformer=True)
    trained.add_lora(r=4, alpha=4)
    adapter = trained.save_transformer_weights(tmp_path / "adapter")
    state = load_file(adapter / "adapter_model.safetensors")
    key = next(k for k in state if "lora_A" in k)
    extra = key.replace("transformer_blocks.0.", "transformer_blocks.9.")
    assert extra != key and extra not in state
    save_file({**state, extra: state[key].clone()}, adapter / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match=r"has keys this model lacks: \[.*transformer_blocks\.9\."):
        _fresh(loaded("flux"), copy_transformer=True).load_transformer_weights(adapter)


def test_sd3_without_t5_reads_256_zero_tokens(loaded):
    """SD3's T5 is optional: without it the pipeline's T5 part is zeros of its default
    max_sequence_length 256 x joint_attention_dim (64 here), after the 32 CLIP tokens (CLIP-L 16 +
    CLIP-G 32 wide, zero-padded to 64)."""
    sd3 = loaded("sd3")
    components = {**sd3.components, "text_encoder_3": None, "tokenizer_3": None}
    no_t5 = SD3FlowModel(components, height=64, width=64)
    assert no_t5.max_sequence_length == 256
    embeds = no_t5.encode_prompt(PROMPTS)["prompt_embeds"]
    assert embeds.shape == (2, 32 + 256, 64)
    assert (embeds[:, 32:] == 0).all() and (embeds[:, :32, 48:] == 0).all()
    torch.testing.assert_close(embeds[:, :32], sd3.encode_prompt(PROMPTS)["prompt_embeds"][:, :32])


def test_qwen_image_prompt_room_is_the_tokenizers_after_the_template_at_most_512(loaded):
    """The template's prefix takes drop_idx tokens of model_max_length; what is left is read, up
    to the pipeline's default max_sequence_length 512: one token more than the prefix leaves a
    prompt of 1 token, none more leaves nothing."""
    qwen = loaded("qwen_image")
    tokenizer = copy.deepcopy(qwen.tokenizer)
    components = {**qwen.components, "tokenizer": tokenizer}
    assert qwen.max_sequence_length == 128 - qwen.drop_idx  # the tiny tokenizer's 128
    tokenizer.model_max_length = qwen.drop_idx + 600
    assert QwenImageFlowModel(components, height=64, width=64).max_sequence_length == 512
    tokenizer.model_max_length = qwen.drop_idx + 1
    assert QwenImageFlowModel(components, height=64, width=64).max_sequence_length == 1
    tokenizer.model_max_length = qwen.drop_idx
    with pytest.raises(ConfigError, match=f"model_max_length {qwen.drop_idx} leaves no room for a prompt"):
        QwenImageFlowModel(components, height=64, width=64)


def _pipeline_dir(root, index, pixel=None):
    """A directory with just this model_index.json (and pixel_space.json): what is refused
    before any component is read."""
    root.mkdir()
    (root / "model_index.json").write_text(json.dumps(index))
    if pixel is not None:
        (root / "pixel_space.json").write_text(json.dumps(pixel))
    return root


@pytest.mark.parametrize("index, pixel, message", [
    ({"_class_name": "FluxPipeline"}, [4, 3], r"pixel-space spec .* is not a JSON object"),
    (["FluxPipeline"], None, r"pipeline index .* is not a JSON object"),
    ({"_class_name": "StableDiffusion3Pipeline"}, {"patch_size": 4}, "supported for FluxPipeline only, not StableDiffusion3Pipeline"),
    ({"_class_name": "FluxPipeline"}, {"patch_size": 0}, "needs an integer patch_size >= 1 and channels 3"),
    ({"_class_name": "FluxPipeline"}, {"patch_size": "4"}, "needs an integer patch_size >= 1 and channels 3"),
    ({"_class_name": "FluxPipeline"}, {"patch_size": 4, "channels": 4}, "needs an integer patch_size >= 1 and channels 3"),
    ({"_class_name": "FluxPipeline", "vae": ["diffusers", "AutoencoderKL"]}, {"patch_size": 4}, "has both a vae and pixel_space.json"),
    ({"_class_name": "FluxPipeline", "transformer": ["diffusers", None]}, None, "'transformer' is not listed in model_index.json"),
])  # fmt: skip
def test_a_bad_index_or_pixel_space_spec_is_refused_by_name(tmp_path, index, pixel, message):
    with pytest.raises(ConfigError, match=message):
        load_flow_model(_pipeline_dir(tmp_path / "model", index, pixel))


def test_dtype_must_name_a_torch_dtype(built):
    with pytest.raises(ConfigError, match="dtype 'Tensor' is not a torch dtype"):
        load_flow_model(built["flux"], dtype="Tensor")  # torch.Tensor exists, but is no dtype


@pytest.mark.parametrize("entry, message", [
    (["json", "JSONDecoder"], "comes from 'json'; only diffusers and transformers components are loaded"),
    (["diffusers", "NoSuchScheduler"], "diffusers has no class 'NoSuchScheduler' \\(component 'scheduler'\\)"),
])  # fmt: skip
def test_a_component_class_outside_diffusers_and_transformers_or_unknown_is_refused(built, tmp_path, entry, message):
    model = shutil.copytree(built["flux"], tmp_path / "model")
    index = json.loads((model / "model_index.json").read_text())
    (model / "model_index.json").write_text(json.dumps({**index, "scheduler": entry}))
    with pytest.raises(ConfigError, match=message):
        load_flow_model(model)


@pytest.mark.parametrize("dropped", [3, 4])
def test_weights_missing_from_a_component_are_named_three_at_most(built, tmp_path, dropped):
    """The first three missing names are listed; past three, how many more there are."""
    model = shutil.copytree(built["flux"], tmp_path / "model")
    state = load_file(model / "text_encoder/model.safetensors")
    gone = sorted(state)[:dropped]
    save_file({k: v for k, v in state.items() if k not in gone}, model / "text_encoder/model.safetensors")
    with pytest.raises(ConfigError, match=f"{dropped} weight\\(s\\) it needs are missing") as err:
        load_flow_model(model)
    more = "" if dropped == 3 else ", ... and 1 more"
    assert str(err.value).endswith(f"({', '.join(gone[:3])}{more})")


def test_a_height_or_width_given_alone_keeps_the_other_from_the_directory(built):
    tall, wide = load_flow_model(built["flux"], height=32), load_flow_model(built["flux"], width=48)
    assert (tall.height, tall.width, wide.height, wide.width) == (32, 64, 64, 48)
    with pytest.raises(ConfigError, match="must be positive multiples of 8"):
        load_flow_model(built["flux"], height=0)  # a 0 given is refused, not read as "not given"


def test_the_default_size_comes_from_pixel_space_json_and_sd3s_transformer(built, tmp_path):
    """pixel_space.json's sample_size is in pixels; SD3's transformer sample_size is in latent
    units: 8 x the tiny VAE's 2^(3 blocks - 1) = 4 -> 32 px, before the VAE's own 64."""
    pixel = shutil.copytree(built["flux_pixel"], tmp_path / "pixel")
    spec = json.loads((pixel / "pixel_space.json").read_text())
    (pixel / "pixel_space.json").write_text(json.dumps({**spec, "sample_size": 32}))
    model = load_flow_model(pixel)
    assert (model.height, model.width, model.seq_len) == (32, 32, 8 * 8)
    sd3 = shutil.copytree(built["sd3"], tmp_path / "sd3")
    config = json.loads((sd3 / "transformer/config.json").read_text())
    assert json.loads((sd3 / "vae/config.json").read_text())["sample_size"] == 64
    (sd3 / "transformer/config.json").write_text(json.dumps({**config, "sample_size": 8}))
    model = load_flow_model(sd3)
    assert (model.height, model.width) == (32, 32)


def test_a_non_square_pixel_space_model_reloads_at_its_own_size(built, tmp_path):
    """save_pretrained stores a non-square pixel-space model's [height, width] in pixel_space.json (a
    square one keeps the single side older files hold), so it reloads at 32 x 64, not 32 x 32; a
    sample_size that is neither is refused by name."""
    tall = load_flow_model(built["flux_pixel"], height=32, width=64)
    saved = tall.save_pretrained(tmp_path / "tall")
    assert json.loads((saved / "pixel_space.json").read_text())["sample_size"] == [32, 64]
    again = load_flow_model(saved)
    assert (again.height, again.width, again.grid, again.seq_len) == (32, 64, (8, 16), 8 * 16)
    square = load_flow_model(built["flux_pixel"]).save_pretrained(tmp_path / "square")
    assert json.loads((square / "pixel_space.json").read_text())["sample_size"] == 64
    spec = json.loads((saved / "pixel_space.json").read_text())
    for bad in ([32], [32, 0], "64", [32, 64.0], 0, True):
        (saved / "pixel_space.json").write_text(json.dumps({**spec, "sample_size": bad}))
        with pytest.raises(ConfigError, match=r"pixel_space.json: sample_size must be a side in pixels or "
                                              r"\[height, width\], not"):
            load_flow_model(saved)


def test_qwen_image_conditioning_of_padding_only_keeps_one_masked_column(loaded):
    """velocity trims the all-padding tail of prompt_embeds but keeps one column (masked out) where
    every row is padding: the transformer needs a text token, and what a masked one holds is unread."""
    qwen = loaded("qwen_image")
    x = qwen.noise(2, torch.Generator().manual_seed(0))
    s, d = qwen.max_sequence_length, qwen.transformer.config.joint_attention_dim
    mask = torch.zeros(2, s, dtype=torch.long)
    noise = torch.randn(2, s, d, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        v = qwen.velocity(x, 0.5, {"prompt_embeds": noise, "prompt_embeds_mask": mask})
        zeros = qwen.velocity(x, 0.5, {"prompt_embeds": torch.zeros(2, s, d), "prompt_embeds_mask": mask})
    assert v.shape == x.shape and torch.isfinite(v).all() and torch.equal(v, zeros)


def test_flux2_refuses_a_text_encoder_without_hidden_state_30(built):
    """FLUX.2 stacks hidden states 10, 20 and 30: hidden_states[30] is the output of layer 30, so
    a 30-layer encoder is enough and a 29-layer one is refused (a stand-in: only its config is read)."""
    root = built["flux2"]
    index = json.loads((root / "model_index.json").read_text())
    components = {n: _load_component(root, n, index[n], torch.float32) for n in ("transformer", "vae", "tokenizer", "scheduler")}

    def encoder(layers):
        return SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: SimpleNamespace(num_hidden_layers=layers)))

    assert Flux2FlowModel({**components, "text_encoder": encoder(30)}, height=64, width=64).seq_len == 64
    with pytest.raises(ConfigError, match=r"hidden states \(10, 20, 30\), but the text encoder has only 29 layers"):
        Flux2FlowModel({**components, "text_encoder": encoder(29)}, height=64, width=64)


def test_pixel_space_flux_refuses_a_transformer_whose_width_is_not_3_p_squared(loaded):
    """A token of a p x p RGB patch holds 3 p^2 values: the tiny pixel model's transformer takes
    48 = 3 x 4^2, which fits patch 4 and not patch 2 (12)."""
    pixel = loaded("flux_pixel")
    assert _fresh(pixel).channels == 48
    with pytest.raises(ConfigError, match=r"patch_size 2 needs a transformer with in_channels = 3 x 2\^2 = 12, not 48"):
        _fresh(pixel, pixel_space={"patch_size": 2})


def test_t5_reads_the_pipelines_default_length_at_most(loaded):
    """FluxPipeline reads up to 512 T5 tokens by default, StableDiffusion3Pipeline 256; a
    tokenizer that reads fewer (the tiny ones: 32) sets the length."""
    flux, sd3 = loaded("flux"), loaded("sd3")
    assert flux.max_sequence_length == sd3.max_sequence_length == 32
    long_t5 = copy.deepcopy(flux.tokenizer_2)
    long_t5.model_max_length = 1024
    assert FluxFlowModel({**flux.components, "tokenizer_2": long_t5}, height=64, width=64).max_sequence_length == 512
    long_t5 = copy.deepcopy(sd3.tokenizer_3)
    long_t5.model_max_length = 1024
    assert SD3FlowModel({**sd3.components, "tokenizer_3": long_t5}, height=64, width=64).max_sequence_length == 256


def test_the_default_size_is_the_vaes_sample_size(built, tmp_path):
    """FLUX.1 has no size of its own: the VAE config's sample_size, in pixels (tiny: 64)."""
    model = shutil.copytree(built["flux"], tmp_path / "model")
    config = json.loads((model / "vae/config.json").read_text())
    (model / "vae/config.json").write_text(json.dumps({**config, "sample_size": 32}))
    loaded = load_flow_model(model)
    assert (loaded.height, loaded.width, loaded.seq_len) == (32, 32, 4 * 4)


def test_a_lora_model_given_an_empty_directory_is_told_it_holds_neither(loaded, tmp_path):
    """Only a directory with full weights is refused for holding them; an empty one holds neither."""
    model = _fresh(loaded("flux"), copy_transformer=True)
    model.add_lora(r=2, alpha=2)
    with pytest.raises(ConfigError, match="holds neither a transformer .* nor a LoRA adapter"):
        model.load_transformer_weights(tmp_path)


# --------------------------------------------------------------------------- a user's own pipeline


def _printed_kwargs(text: str) -> dict:
    """The keyword arguments an export's usage line names ("... call the pipeline with a=1, b=\"\"")."""
    import ast
    import re

    args = text.split("call the pipeline with ", 1)[1]
    return {k: ast.literal_eval(v) for k, v in re.findall(r'(\w+)=("[^"]*"|\[[^]]*\]|[^,\s]+)', args)}


@pytest.mark.parametrize("family, guidance_scale, distilled", [("sd3", 1.0, None), ("flux", 3.0, None),
                                                               ("flux", 1.0, 2.5)])  # model.distilled_guidance
def test_an_exports_printed_arguments_make_its_pipeline_sample_as_the_run_did(built, loaded, family, guidance_scale,
                                                                             distilled):
    """The run's image, not the pipeline's defaults: SD3's guidance_scale is CFG at 7.0 and FLUX
    takes CFG as true_cfg_scale with a negative prompt, and the tiny models read 32 text tokens
    where the pipelines pad to 512 (FLUX) or 256 (SD3). The usage line said height, width and
    steps alone, so the export sampled another image than the run's. (SD3Pipeline also gets the
    run's sigmas: its own schedule runs from linspace(1, 1/1000) where FluxPipeline's is ours.)"""
    import diffusers

    from diffusion_rl.policy import DiffusionPolicy

    model = _fresh(loaded(family), guidance_scale=guidance_scale, distilled_guidance=distilled)
    policy = DiffusionPolicy(model, SimpleNamespace(eval_steps=None, num_steps=3, shift="auto"))
    kwargs = _printed_kwargs(policy.export_usage())
    assert kwargs["max_sequence_length"] == 32
    pipe = diffusers.DiffusionPipeline.from_pretrained(built[family], local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(prompt=PROMPTS[:1], generator=torch.Generator().manual_seed(0), output_type="pt", **kwargs).images
    ours = pil_to_tensor(policy.sample_images(PROMPTS[:1], [0], 3)) / 2 + 0.5  # the run's ODE sample, seed 0
    torch.testing.assert_close(ours, ref, atol=1 / 255 + 1e-3, rtol=0)  # PNG's rounding, 4-digit sigmas


def test_a_pixel_space_exports_usage_says_diffusers_cannot_sample_it(loaded):
    """FluxPipeline refuses a directory without a vae: the usage line said to call it all the same."""
    from diffusion_rl.policy import DiffusionPolicy

    usage = DiffusionPolicy(loaded("flux_pixel"), SimpleNamespace(eval_steps=None, num_steps=3, shift="auto")).export_usage()
    assert usage == ("this run samples 64x64 px in 3 steps; diffusers cannot sample this pixel-space model "
                     "(FluxPipeline needs a vae): load it with diffusion_rl.models.load_flow_model")


def _with_scheduler(built, tmp_path, scheduler):
    """A copy of the tiny FLUX with `scheduler` saved in place of its own."""
    root = tmp_path / "model"
    shutil.copytree(built["flux"], root)
    shutil.rmtree(root / "scheduler")
    scheduler.save_pretrained(root / "scheduler")
    index = json.loads((root / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", type(scheduler).__name__]
    (root / "model_index.json").write_text(json.dumps(index))
    return root


def test_a_scheduler_that_is_not_flow_matching_is_refused_by_name(built, tmp_path):
    """The sampler never calls the pipeline's scheduler: a DDIM pipeline was sampled and trained as
    a velocity predictor without a word. A flow-matching multistep solver (UniPC with flow sigmas,
    as Wan and SANA ship) is one."""
    from diffusers import DDIMScheduler, UniPCMultistepScheduler

    with pytest.raises(ConfigError, match=r"model/scheduler: DDIMScheduler is not a flow-matching scheduler; .* "
                                          "save the pipeline with its FlowMatchEulerDiscreteScheduler"):
        load_flow_model(_with_scheduler(built, tmp_path, DDIMScheduler()))
    shutil.rmtree(tmp_path / "model")
    flow = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True)
    assert load_flow_model(_with_scheduler(built, tmp_path, flow)).family == "flux"


def test_flux2_lora_on_q_k_v_reaches_the_single_stream_blocks_fused_projection(loaded, tmp_path):
    """FLUX.2's single-stream blocks have no to_q / to_k / to_v (one fused attn.to_qkv_mlp_proj):
    the CLI's default targets left every one of them (48 of FLUX.2-dev's 56 blocks) without an
    adapter, without a word. Now the fused projection gets one too, said in a warning; the saved
    adapter reloads into a model built the same way; naming attn.to_q keeps them off."""
    def blocks_with_adapters(model):
        return {n.split(".attn.")[0] for n, p in model.transformer.named_parameters() if p.requires_grad}

    model = _fresh(loaded("flux2"), copy_transformer=True)
    with pytest.warns(UserWarning, match=r"FLUX.2's 1 single-stream block\(s\) fuse q, k, v .* attn.to_qkv_mlp_proj"):
        model.add_lora(r=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    assert blocks_with_adapters(model) == {"transformer_blocks.0", "single_transformer_blocks.0"}
    model.save_transformer_weights(tmp_path / "adapter")
    again = _fresh(loaded("flux2"), copy_transformer=True)
    with pytest.warns(UserWarning, match="fuse q, k, v"):  # resuming: the run's model.lora, then its adapter
        again.add_lora(r=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    again.load_transformer_weights(tmp_path / "adapter")
    alone = _fresh(loaded("flux2"), copy_transformer=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        alone.add_lora(r=4, target_modules=["attn.to_q", "attn.to_k"])
    assert blocks_with_adapters(alone) == {"transformer_blocks.0"}


def test_a_single_safetensors_file_as_model_path_says_how_to_make_a_pipeline_directory(built, tmp_path):
    """Checkpoints are often downloaded as one .safetensors file: 'is not a directory' gave no way on."""
    from diffusion_rl import backend
    from mmrl.core.config import load_config

    file = tmp_path / "flux1-dev.safetensors"
    shutil.copyfile(built["flux"] / "transformer" / "diffusion_pytorch_model.safetensors", file)
    said = (r"flux1-dev.safetensors is a single file; a diffusers pipeline directory is expected \(model_index.json "
            r"and a folder per component: .*from_single_file\(FILE\)\).* then save_pretrained\(DIR\) and set "
            "model.path to DIR")
    with pytest.raises(ConfigError, match=said):
        load_flow_model(file)
    cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG, overrides=[f"model.path={file}"])
    with pytest.raises(ConfigError, match="^model.path: .*" + said):
        backend.build(cfg)


def test_a_directory_that_names_no_image_size_is_drawn_at_64_px_with_a_warning(built):
    """Qwen-Image's VAE carries no sample_size: a real Qwen-Image loaded without model.height /
    model.width was drawn at 64 x 64 px without a word. Sizes given, or found, say nothing."""
    with pytest.warns(UserWarning, match=r"qwen_image names no image size .*: height and width default to 64 px, "
                                         r"the tiny models' size; set model.height and model.width \(QwenImagePipeline"):
        model = load_flow_model(built["qwen_image"])
    assert (model.height, model.width) == (64, 64)
    with pytest.warns(UserWarning, match=r": width defaults to 64 px"):
        assert load_flow_model(built["qwen_image"], height=32).width == 64
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_flow_model(built["qwen_image"], height=32, width=48)
        assert load_flow_model(built["sd3"]).height == 64  # SD3's transformer sample_size x the VAE's factor


def test_an_sd3_size_past_its_position_embedding_is_refused_as_an_image_size(loaded):
    """SD3 crops its position embedding from a pos_embed_max_size square (16 tokens of 8 px for
    the tiny one): a larger side was a diffusers ValueError traceback at the first forward."""
    sd3 = loaded("sd3")
    with pytest.raises(ImageSizeError, match=r"height x width = 136 x 64 exceeds this sd3 model's largest side, "
                                             r"128 px \(its transformer's pos_embed_max_size 16 x 8 px per token\)"):
        _fresh(sd3, height=136, width=64)
    model = _fresh(sd3, height=64, width=128)  # the largest side: drawn
    assert model.velocity(model.noise(1), 0.5, model.encode_prompt("a red circle")).shape == (1, 128, 16)


@pytest.mark.parametrize("name, wrong", [("transformer", "SD3Transformer2DModel"), ("vae", "AutoencoderTiny")])
def test_an_index_naming_another_diffusers_class_than_the_folder_was_saved_from_says_so(built, tmp_path, name, wrong):
    """The index's class was built and its weights reported as not fitting it (shapes, or 134
    weights missing): the user looked for a damaged checkpoint where one word was wrong."""
    root = tmp_path / "model"
    shutil.copytree(built["flux"], root)
    index = json.loads((root / "model_index.json").read_text())
    right, index[name] = index[name][1], ["diffusers", wrong]
    (root / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=rf"model_index.json names {wrong} for component '{name}', but .*model/{name}/"
                                          rf'config.json was saved from {right}: if that is the model, list "{name}": '
                                          rf'\["diffusers", "{right}"\] in model_index.json'):
        load_flow_model(root)


def test_a_pipeline_component_that_ships_code_is_refused_before_transformers_reads_it(tmp_path):
    """A text encoder listed as ["transformers", "AutoModel"] whose config.json has an auto_map:
    transformers asked on a terminal whether to run its code (and ran it on "y"), where the
    docs say diffusion pipelines never run a model directory's code. Refused, named."""
    import json

    (tmp_path / "text_encoder").mkdir()
    (tmp_path / "text_encoder" / "config.json").write_text(json.dumps(
        {"model_type": "mine", "auto_map": {"AutoModel": "modeling_mine.MineModel"}}))
    (tmp_path / "text_encoder" / "modeling_mine.py").write_text("raise SystemExit('ran')\n")
    with pytest.raises(ConfigError, match=r"component 'text_encoder' in .*text_encoder ships its own Python code "
                                          r"\(auto_map in config.json\); diffusion pipelines never run"):
        _load_component(tmp_path, "text_encoder", ["transformers", "AutoModel"], torch.float32)
