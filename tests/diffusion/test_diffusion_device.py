"""model.device for the diffusion backend, checked on a CPU machine.

No GPU here, so two stand-ins show a tensor made on the wrong device:

- FakeTensorMode fakes CUDA tensors (shapes and devices, no values): the pure tensor functions
  (CAST's advantage map and atom maps, an EMA swap, one transformer forward) run on fake cuda
  and raise FakeTensorDeviceMismatchError where a CPU tensor meets a cuda one.
- the simulated device of tests/simdevice.py, for whole runs that read values (checks, .item(),
  PIL images): a full `Trainer.train()` of each method with the model on it is the check that
  every rollout, loss, evaluation and checkpoint tensor follows the model.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from simdevice import SIM, _OnDevice, outside, simulated_device

from diffusion_rl import backend
from diffusion_rl.config import DiffusionTrainConfig
from mmrl.core.config import ConfigError, load_config
from mmrl.core.trainer import Trainer

FAST = ["rollout.num_steps=4", "rollout.window_size=2", "rollout.num_generations=2", "rollout.prompts_per_step=2",
        "rollout.window_start=[0,1]", "task.num_train=16", "task.num_eval=2", "task.grid_prompts=2",
        "task.eval_seeds=1", "logging.tensorboard=false", "logging.progress=false", "optim.lr=1e-3",
        "train.max_steps=2"]


@pytest.fixture
def simulated(monkeypatch):
    """model.device resolves to the simulated device; components load (on the real meta device
    and the CPU) outside the simulation; modules move by swapping their parameters."""
    from diffusion_rl import models

    monkeypatch.setattr(models, "_load_component", outside(models._load_component))
    monkeypatch.setattr(backend, "model_device", lambda spec: SIM)
    with simulated_device():
        yield


def _cfg(tmp_path, *overrides):
    return load_config(DiffusionTrainConfig, defaults=backend.DEFAULT_CONFIG,
                       overrides=[f"output_dir={tmp_path / 'run'}", *FAST, *overrides])


def test_the_simulated_device_catches_a_cpu_tensor(simulated):
    x = torch.ones(3, device=SIM)
    assert isinstance(x, _OnDevice) and x.device == SIM and float((x * 2).sum()) == 6.0  # real values
    assert (x + torch.tensor(1.0)).device == SIM  # a 0-d CPU tensor is a scalar, as on CUDA
    with pytest.raises(RuntimeError, match="same device"):
        x + torch.ones(3)
    assert type(x.cpu()) is torch.Tensor and x.cpu().numpy().tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("method", [
    ["method.type=flow_grpo", "method.kl.beta=0.04"],
    ["method.type=flow_grpo", "model.lora.r=4", "method.ema.update_every=1"],
    ["method.type=cast"],
    ["method.type=cast", "method.projection=detector"],
    ["method.type=cast", "method.atoms=nodes"],
    ["method.type=ftfc", "method.anchor=base", "method.target=posterior"],
], ids=["flow_grpo-kl", "flow_grpo-lora-ema", "cast", "cast-detector", "cast-nodes", "ftfc-anchor-posterior"])
def test_training_on_the_device_keeps_every_tensor_there(simulated, tmp_path, reward_spread, method):
    """Rollout, re-scoring, loss, backward, optimizer, EMA swap, evaluation, sample grids and the
    checkpoint: all with the model on the (simulated) device, and the weights stay there."""
    cfg = _cfg(tmp_path, *method)
    policy, task = backend.build(cfg)
    assert policy.flow.device == SIM
    for module in (policy.flow.transformer, policy.flow.components["text_encoder"]):
        assert all(p.device == SIM for p in module.parameters())
    before = {k: v.detach().cpu().clone() for k, v in policy.model.named_parameters() if v.requires_grad}
    summary = Trainer(cfg, policy, task).train()
    assert summary["steps"] == 2 and 0 <= summary["eval_after"]["atom_accuracy"] <= 1
    assert all(p.device == SIM for p in policy.model.parameters())
    changed = [k for k, v in policy.model.named_parameters() if v.requires_grad and not torch.equal(v.cpu(), before[k])]
    assert changed  # the update ran on the device
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [v for r in rows for k, v in r.items() if k.startswith("loss/")]
    assert losses and all(math.isfinite(v) for v in losses)


def test_sample_and_calibrate_window_on_the_device(simulated, tmp_path):
    cfg = _cfg(tmp_path, "method.type=cast", "method.calibration_prompts=2")
    policy, task = backend.build(cfg)
    rows = backend.sample(cfg, policy, task, ["a red circle"], 2)
    assert len(rows) == 2 and all(r["image"].endswith(".png") for r in rows)
    cal, paths = backend.calibrate(cfg, tmp_path / "cal", 2, into_model=False)
    assert 0 <= cal.window_start and paths[0].is_file()


def test_a_seeded_rollout_on_the_device_draws_the_cpu_rollouts_numbers(tmp_path, monkeypatch):
    """The noise comes from CPU generators and moves: the same seed, the same latents and
    log-probs whatever model.device is (up to rounding: the simulation runs op by op, some
    kernels differ from the fused CPU ones)."""
    cfg = _cfg(tmp_path)
    policy, task = backend.build(cfg)
    cpu = policy.generate(task.train[:2], 2, cfg.rollout, torch.Generator().manual_seed(0))
    images = policy.sample_images(task.eval_prompts[:1], [3], 4)
    from diffusion_rl import models

    monkeypatch.setattr(models, "_load_component", outside(models._load_component))
    monkeypatch.setattr(backend, "model_device", lambda spec: SIM)
    with simulated_device():
        policy, task = backend.build(cfg)
        dev = policy.generate(task.train[:2], 2, cfg.rollout, torch.Generator().manual_seed(0))
        dev_images = policy.sample_images(task.eval_prompts[:1], [3], 4)
        assert dev.old_logp.device == SIM and dev.data["final_latents"].device == SIM
        got = {k: dev.data[k].cpu() for k in ("latents", "next_latents", "final_latents")}
        logp = dev.old_logp.cpu()
    torch.testing.assert_close(logp, cpu.old_logp, rtol=0, atol=1e-5)
    for k, v in got.items():
        torch.testing.assert_close(v, cpu.data[k], rtol=0, atol=1e-4)
    diff = np.abs(np.asarray(dev_images[0], dtype=int) - np.asarray(images[0], dtype=int))
    assert diff.max() <= 1  # 8-bit pixels: at most one step of rounding


# ------------------------------------------------------------------ FakeTensorMode: pure functions on fake cuda


def _fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def test_fake_cuda_shows_a_device_mix_up():
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    with _fake(), pytest.raises(FakeTensorDeviceMismatchError):
        torch.empty(3, device="cuda") + torch.ones(3)


def test_cast_maps_follow_the_attention_on_fake_cuda():
    from diffusion_rl.attention_maps import atom_maps
    from diffusion_rl.methods.cast import advantage_map

    with _fake():
        att = torch.rand(2, 4, 3, device="cuda")  # [N, L, S]
        spans = [[(0, 3), None, (4, 7)]] * 2
        maps = atom_maps(att, spans, [{"exist": [(0, 3)]}, {}], ["exist", "colour"])  # [N, K, L]
        assert maps.device.type == "cuda" and maps.shape == (2, 2, 4)
        # the atom advantages and weights come from the CPU scores: the map moves them
        out = advantage_map(torch.zeros(2, 2), torch.ones(2), maps, torch.zeros(2), global_weight=0.5, clip=1.0)
        assert out.device.type == "cuda" and out.shape == (2, 4)


def test_ema_swaps_weights_of_a_fake_cuda_model():
    from diffusion_rl.ema import ParameterEMA

    with _fake():
        params = [torch.nn.Parameter(torch.ones(3, device="cuda")), torch.nn.Parameter(torch.ones(2, 2, device="cuda"))]
        ema = ParameterEMA(params, decay=0.5, update_every=1)
        assert all(a.device.type == "cuda" for a in ema.average)
        ema.update(params)
        with ema.applied(params):  # raw weights parked on the CPU, the average copied in
            assert all(p.device.type == "cuda" for p in params)
        ema.load_state_dict({k: v.cpu() for k, v in ema.state_dict()[0].items()}, {"steps": 1})  # from a file
        assert all(a.device.type == "cuda" for a in ema.average)


def test_one_transformer_forward_of_the_bundled_model_on_fake_cuda():
    """The real FluxTransformer2DModel (assets/tiny-flow) moved to fake cuda, with the latents,
    sigma and conditioning velocity() builds: every input it makes is on the model's device."""
    from diffusion_rl.models import load_flow_model

    flow = load_flow_model(backend.bundled_model_dir())
    cond = flow.encode_prompt(["a red circle", "two blue squares"])  # real, on the CPU
    with _fake():
        flow.transformer.to("cuda")
        flow.device, flow._img_ids = torch.device("cuda"), None
        x = flow.noise(2, torch.Generator().manual_seed(0))  # CPU generator, moved
        assert x.device.type == "cuda"
        v = flow.velocity(x, torch.tensor([1.0, 0.5]), cond)  # the CPU sigmas of a batch, CPU cond rows
        assert v.device.type == "cuda" and v.shape == x.shape


def test_explicit_cpu_trains_as_the_default(tmp_path, reward_spread):
    cfg = _cfg(tmp_path, "model.device=cpu", "train.max_steps=1")
    policy, task = backend.build(cfg)
    assert policy.flow.device == torch.device("cpu")
    before = {k: v.clone() for k, v in policy.model.named_parameters()}
    Trainer(cfg, policy, task).train()
    assert all(p.device.type == "cpu" for p in policy.model.parameters())
    assert [k for k, v in policy.model.named_parameters() if not torch.equal(v, before[k])]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_without_a_gpu_is_a_config_error_naming_the_setting(tmp_path):
    cfg = _cfg(tmp_path, "model.device=cuda")
    with pytest.raises(ConfigError, match="model.device cuda: no CUDA device"):
        backend.build(cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_the_cli_refuses_cuda_without_a_gpu(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "diffusion_rl", "eval", "--set", "model.device=cuda:0",
                        "--set", f"output_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "model.device cuda:0: no CUDA device" in r.stderr + r.stdout
