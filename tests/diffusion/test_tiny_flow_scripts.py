"""The scripts that make the bundled tiny flow model: the VAE's trainer and the flow pre-training,
in pixel and in latent space, shortened to a few steps."""

import importlib.util
import json

import torch
from safetensors.torch import load_file

from diffusion_rl import backend
from diffusion_rl.models import load_flow_model


def _script(name):
    path = backend.bundled_model_dir().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vae_then_latent_flow_pretraining_make_a_loadable_pipeline(tmp_path):
    threads = torch.get_num_threads()
    try:
        assert _script("train_tiny_vae").main(["--out", str(tmp_path / "vae"), "--steps", "2", "--data", "16",
                                               "--batch", "4", "--eval-scenes", "2", "--threads", "1"]) == 0
        record = json.loads((tmp_path / "vae" / "vae_record.json").read_text())
        assert record["scaling_factor"] > 0 and set(record["detector_on_reconstructions"]) >= {"atoms", "count"}
        flow = _script("pretrain_tiny_flow")
        for name in ("a", "b"):
            assert flow.main(["--vae", str(tmp_path / "vae"), "--out", str(tmp_path / name), "--steps", "2",
                              "--data", "16", "--batch", "4", "--eval-every", "2", "--eval-prompts", "2",
                              "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    model = load_flow_model(tmp_path / "a")
    assert model.vae is not None and not model.pixel_space and (model.seq_len, model.channels) == (64, 16)
    assert model.vae.config.scaling_factor == record["scaling_factor"]  # the trained VAE, not a random one
    assert (tmp_path / "a" / "vae" / "vae_record.json").is_file()
    assert json.loads((tmp_path / "a" / "pretrain.json").read_text())["prediction"] == "velocity"
    a, b = (load_file(tmp_path / n / "transformer" / "diffusion_pytorch_model.safetensors") for n in "ab")
    assert all(torch.equal(a[k], b[k]) for k in a)  # deterministic for a seed and thread count
