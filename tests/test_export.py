"""`<cli> export`: a checkpoint as a standalone model directory. A LoRA checkpoint's adapters are
merged into the base weights, so the plain library loader (transformers, dllm_rl's loader,
diffusers) gives the LoRA policy's outputs without mmrl's LoRA settings; --out is never left
half written or written over."""

from __future__ import annotations

import importlib

import pytest
import torch
from typer.testing import CliRunner

from mmrl.core.config import load_config

IDS = torch.tensor([[3, 5, 7, 9, 11, 13]])


def lora_policy(modality: str, tmp_path, *overrides: str):
    """The bundled model of `modality` under LoRA r 4, its adapters' B drawn at random (they start
    at 0, which would make a merge a no-op), saved as a checkpoint; with the run's config file."""
    backend = importlib.import_module({"vlm": "mmrl.vlm.backend", "dllm": "dllm_rl.backend",
                                       "diffusion": "diffusion_rl.backend"}[modality])
    settings = ["model.lora.r=4", "model.lora.alpha=8", *overrides]
    cfg = load_config(backend.CONFIG_CLASS, None, settings, defaults=backend.DEFAULT_CONFIG)
    policy, _ = backend.build(cfg)
    model = policy.flow.transformer if modality == "diffusion" else policy.model
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    policy.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "run.yaml").write_text("model:\n  lora: {r: 4, alpha: 8}\n")
    return policy, backend


def export(modality: str, *args: str):
    app = importlib.import_module({"vlm": "mmrl.cli", "dllm": "dllm_rl.cli", "diffusion": "diffusion_rl.cli"}[modality]).app
    result = CliRunner().invoke(app, ["export", *args])
    return result.exit_code, " ".join(result.output.split())


def exported(modality: str, tmp_path):
    """`export` of lora_policy's checkpoint with its run config, into tmp_path / "out"."""
    code, text = export(modality, "--checkpoint", str(tmp_path / "ckpt"), "--config", str(tmp_path / "run.yaml"),
                        "-o", str(tmp_path / "out"))
    assert code == 0 and f"wrote {tmp_path / 'out'}" in text, text
    return tmp_path / "out"


def assert_same_logits(lora_model, plain, base):
    """The export gives the LoRA model's logits, and those differ from the base model's (the
    adapters change the model: the merge is not a no-op)."""
    with torch.no_grad():
        want = lora_model.eval()(input_ids=IDS).logits
        got, before = plain.eval()(input_ids=IDS).logits, base.eval()(input_ids=IDS).logits
    assert not any("lora" in n for n, _ in plain.named_parameters())
    assert (want - before).abs().max() > 1e-3
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def image_lora(tmp_path_factory):
    """lora_policy's image model and its checkpoint directory, built once for the tests that load it."""
    tmp = tmp_path_factory.mktemp("image_lora")
    policy, _ = lora_policy("diffusion", tmp)
    return policy, tmp / "ckpt"


def assert_same_transformer(policy, plain):
    """`plain` (a FluxTransformer2DModel loaded without mmrl) gives the LoRA policy's velocity, and
    that differs from the base's (the adapter is not a no-op)."""
    g, c = torch.Generator().manual_seed(0), plain.config
    inputs = {"hidden_states": torch.randn(1, 16, c.in_channels, generator=g), "timestep": torch.tensor([0.5]),
              "encoder_hidden_states": torch.randn(1, 5, c.joint_attention_dim, generator=g),
              "pooled_projections": torch.randn(1, c.pooled_projection_dim, generator=g),
              "img_ids": torch.randn(16, 3, generator=g), "txt_ids": torch.zeros(5, 3), "guidance": torch.tensor([3.5])}
    with torch.no_grad():
        want, got = policy.flow.transformer.eval()(**inputs)[0], plain.eval()(**inputs)[0]
        with policy.flow.disable_adapter():
            before = policy.flow.transformer(**inputs)[0]
    assert (want - before).abs().max() > 1e-3
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_vlm_lora_checkpoint_exports_as_one_plain_transformers_model(tmp_path):
    from transformers import AutoModelForImageTextToText

    from mmrl.vlm.models import bundled_model_dir

    policy, _ = lora_policy("vlm", tmp_path)
    out = exported("vlm", tmp_path)
    assert not (out / "adapter_config.json").exists() and (out / "processor_config.json").exists()
    assert_same_logits(policy.model, AutoModelForImageTextToText.from_pretrained(out),
                       AutoModelForImageTextToText.from_pretrained(bundled_model_dir()))


def test_a_vlm_export_shows_a_plain_processor_images_at_the_runs_size(tmp_path):
    """The run saw each image within model.max_pixels (qwen-vl-utils' resize); the exported
    processor keeps that bound, where the base's own (12544 px for the bundled model) gave a
    plain AutoProcessor, or vLLM, other pixels. The image processor is also written alone
    (preprocessor_config.json), where tools built on transformers 4 look for it."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoProcessor

    policy, _ = lora_policy("vlm", tmp_path, "model.max_pixels=6272")
    (tmp_path / "run.yaml").write_text("model:\n  lora: {r: 4, alpha: 8}\n  max_pixels: 6272\n")
    image = Image.new("RGB", (112, 112), (200, 30, 30))  # 12544 px: within the base's bound, not the run's
    want = policy.processor.image_processor(images=policy.resize_images([image]), return_tensors="pt")
    out = exported("vlm", tmp_path)
    got = AutoProcessor.from_pretrained(out).image_processor(images=[image], return_tensors="pt")
    assert want["image_grid_thw"].prod() < 64  # 112 x 112 px is 8 x 8 patches: the run's bound shrank it
    assert torch.equal(got["image_grid_thw"], want["image_grid_thw"])
    torch.testing.assert_close(got["pixel_values"], want["pixel_values"])
    alone = AutoImageProcessor.from_pretrained(out)
    assert (out / "preprocessor_config.json").is_file() and alone.size["longest_edge"] == 6272


def test_a_vlm_checkpoint_holds_the_runs_image_bounds_and_leaves_the_runs_processor(tmp_path):
    """A checkpoint's processor (checkpoints/step-N/model, read by a plain AutoProcessor as the
    export's is) keeps images within the run's model.max_pixels too; the processor the run goes
    on with is not changed by saving."""
    from transformers import AutoProcessor

    policy, _ = lora_policy("vlm", tmp_path, "model.max_pixels=6272")
    before = dict(policy.processor.image_processor.size)
    policy.save_pretrained(tmp_path / "ckpt")
    assert AutoProcessor.from_pretrained(tmp_path / "ckpt").image_processor.size["longest_edge"] == 6272
    assert policy.processor.image_processor.size == before and before["longest_edge"] == 12544


def test_a_vlm_jsonl_run_exports_without_its_data_files(tmp_path):
    # export decodes nothing: a run copied to another machine without its train.jsonl exports
    from transformers import AutoModelForImageTextToText

    policy, _ = lora_policy("vlm", tmp_path)
    (tmp_path / "run.yaml").write_text("model:\n  lora: {r: 4, alpha: 8}\n"
                                       "task: {type: jsonl, train_path: gone/train.jsonl, eval_path: gone/eval.jsonl}\n")
    out = exported("vlm", tmp_path)
    plain = AutoModelForImageTextToText.from_pretrained(out)
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(input_ids=IDS).logits, policy.model.eval()(input_ids=IDS).logits,
                                   atol=1e-5, rtol=1e-5)


def test_an_image_run_of_prompt_files_exports_without_them(tmp_path):
    # export draws nothing: a run copied to another machine without its prompt files exports
    from diffusion_rl.models import load_flow_model

    policy, _ = lora_policy("diffusion", tmp_path)
    (tmp_path / "run.yaml").write_text("model:\n  lora: {r: 4, alpha: 8}\n"
                                       "task: {train_path: gone/train.txt, eval_path: gone/eval.txt}\n")
    plain = dict(load_flow_model(exported("diffusion", tmp_path)).transformer.named_parameters())
    own = dict(policy.flow.transformer.named_parameters())
    untouched = [n for n in plain if n in own]  # the layers LoRA left alone (its layers' names have base_layer)
    assert untouched and len(untouched) < len(plain) and all(torch.equal(plain[n], own[n]) for n in untouched)


def test_an_image_export_says_how_to_sample_it_at_the_runs_size(tmp_path):
    """FluxPipeline draws the exported tiny model at its own default, 512 x 512 px, where the run
    sampled 64 x 64: export prints the arguments that sample it as the run did, and they do."""
    from diffusers import DiffusionPipeline

    from diffusion_rl.backend import bundled_model_dir

    code, text = export("diffusion", "--checkpoint", str(bundled_model_dir()), "--set", "rollout.eval_steps=3",
                        "-o", str(tmp_path / "out"))
    assert code == 0, text
    assert "this run samples 64x64 px in 3 steps: call the pipeline with height=64, width=64, num_inference_steps=3" in text
    pipe = DiffusionPipeline.from_pretrained(tmp_path / "out")
    image = pipe("a red circle", height=64, width=64, num_inference_steps=3, output_type="pil").images[0]
    assert image.size == (64, 64)


def test_a_dllm_lora_checkpoint_exports_as_a_mask_predictor_directory(tmp_path):
    from dllm_rl.models import load_mask_predictor

    policy, backend = lora_policy("dllm", tmp_path)
    out = exported("dllm", tmp_path)
    assert (out / "dllm.json").is_file() and not (out / "adapter_config.json").exists()
    assert_same_logits(policy.model, load_mask_predictor(out).model,
                       load_mask_predictor(backend.bundled_model_dir()).model)


def test_an_image_lora_checkpoint_exports_as_a_whole_diffusers_pipeline(image_lora):
    from diffusion_rl.models import load_flow_model

    policy, ckpt = image_lora
    out = exported("diffusion", ckpt.parent)
    assert (out / "model_index.json").is_file() and (out / "vae").is_dir()
    # merged: no LoRA file for pipe.load_lora_weights, which would apply the adapter a second time
    assert not list(out.rglob("*lora*")) and not list(out.rglob("adapter_*"))
    plain = dict(load_flow_model(out).transformer.named_parameters())
    lora = dict(policy.flow.transformer.named_parameters())
    layers = {n.removesuffix(".lora_A.default.weight") for n in lora if n.endswith(".lora_A.default.weight")}
    assert layers and not any("lora" in n for n in plain)
    for layer in layers:  # W + B A alpha / r (alpha 8, r 4), worked here rather than by PEFT
        a, b = lora[f"{layer}.lora_A.default.weight"], lora[f"{layer}.lora_B.default.weight"]
        merged = lora[f"{layer}.base_layer.weight"] + 2.0 * b @ a
        assert (merged - lora[f"{layer}.base_layer.weight"]).abs().max() > 1e-3
        torch.testing.assert_close(plain[f"{layer}.weight"], merged, atol=1e-6, rtol=1e-6)
    rest = {n for n in lora if "lora_" not in n and ".base_layer.weight" not in n}
    for name in rest:
        torch.testing.assert_close(plain[name.replace(".base_layer.", ".")], lora[name])


def test_export_writes_nothing_over_files_and_leaves_no_partial_directory(tmp_path, monkeypatch):
    lora_policy("dllm", tmp_path)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    code, text = export("dllm", "--checkpoint", str(tmp_path / "ckpt"), "--config", str(tmp_path / "run.yaml"),
                        "-o", str(tmp_path / "taken"))
    assert code == 2 and "is not a new or empty directory" in text, text
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]

    from dllm_rl.policy import DLLMPolicy

    def breaks(self, path):
        path.mkdir()
        (path / "half.safetensors").write_text("")
        raise OSError("No space left on device")

    monkeypatch.setattr(DLLMPolicy, "save_pretrained", breaks)
    (tmp_path / "empty").mkdir()
    code, text = export("dllm", "--checkpoint", str(tmp_path / "ckpt"), "--config", str(tmp_path / "run.yaml"),
                        "-o", str(tmp_path / "empty"))
    assert code == 2 and "failed, nothing was written there: No space left on device" in text, text
    assert list((tmp_path / "empty").iterdir()) == [] and not (tmp_path / ".empty.partial").exists()


@pytest.mark.parametrize("modality", ["dllm"])
def test_a_lora_checkpoint_without_its_lora_settings_is_one_clear_error(modality, tmp_path):
    lora_policy(modality, tmp_path)
    code, text = export(modality, "--checkpoint", str(tmp_path / "ckpt"), "-o", str(tmp_path / "out"))
    assert code == 2 and "holds a LoRA adapter, not full weights" in text and "Traceback" not in text, text
    assert not (tmp_path / "out").exists()


def test_an_image_lora_checkpoint_loads_with_diffusers_alone(image_lora):
    """A LoRA run's checkpoint holds the adapter alone: its adapter_config.json names the base
    transformer (PEFT leaves it null for a diffusers model), and diffusers' load_lora_adapter
    gives the run's transformer, scaled by alpha / r (without the safetensors' LoRA metadata it
    scaled by 1, a silently other model)."""
    import json

    from diffusers import FluxTransformer2DModel

    from diffusion_rl.backend import bundled_model_dir

    policy, ckpt = image_lora
    saved = json.loads((ckpt / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str((bundled_model_dir() / "transformer").resolve())
    plain = FluxTransformer2DModel.from_pretrained(saved["base_model_name_or_path"])
    plain.load_lora_adapter(ckpt, weight_name="adapter_model.safetensors", prefix=None)
    assert_same_transformer(policy, plain)


def test_an_image_lora_checkpoint_loads_with_the_pipelines_load_lora_weights(image_lora):
    """The call researchers use, and the Hub's LoRA format: `pipe.load_lora_weights(dir)` reads
    pytorch_lora_weights.safetensors (keys under `transformer.`, as FluxPipeline.save_lora_weights
    writes them), written beside the adapter_model.safetensors that resuming reads. Before, it
    found no `transformer.` key in adapter_model.safetensors, warned and loaded nothing: the base."""
    from diffusers import FluxPipeline

    from diffusion_rl.backend import bundled_model_dir

    policy, ckpt = image_lora
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in ckpt.iterdir()}
    pipe = FluxPipeline.from_pretrained(bundled_model_dir())
    pipe.load_lora_weights(ckpt)
    assert_same_transformer(policy, pipe.transformer)
