"""Whole VLM runs with the model on a simulated accelerator (tests/simdevice.py): no GPU here,
so tensors on the simulated device hold real CPU values and raise, as CUDA would, where an op
mixes them with a CPU tensor. A 2-step `Trainer.train()` of each method (rollouts, tool turns,
KL reference, LoRA, interventions, CORA's classifier, FastRL's pruning, the pipelined engine,
mini-batches and PPO epochs, evaluation, the checkpoint), the CLI's `sample` and `eval`, and a
seeded rollout that draws the CPU rollout's tokens: every tensor follows the model there.
tests/vlm/test_vlm_device.py checks the pure helpers on fake CUDA; tests/gpu/ a real GPU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from simdevice import SIM, outside, simulated_device
from typer.testing import CliRunner

from mmrl.core.config import load_config
from mmrl.core.logging import read_metrics
from mmrl.core.trainer import Trainer
from mmrl.vlm import backend

# load_state_dict (--checkpoint) warns that a "meta" parameter ignores the copy: the simulated
# device's parameters say meta, but hold values and take the copy (the test checks they do)
pytestmark = pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter:UserWarning")
ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "assets" / "tiny-qwen2.5-vl"
SMALL = ["train.max_steps=2", "task.num_train=8", "task.num_eval=2", "rollout.prompts_per_step=2",
         "rollout.num_generations=2", "rollout.max_new_tokens=6", "rollout.eval_samples=0",
         "logging.progress=false", "logging.tensorboard=false"]


def _device_loaders(monkeypatch):
    """model.device resolves to the simulated device; the models load on the CPU (transformers
    builds them on the real meta device first) outside the simulation, then the backend's
    .to(device) moves them in it."""
    from transformers import AutoModelForSequenceClassification

    monkeypatch.setattr(backend, "model_device", lambda spec: SIM)
    monkeypatch.setattr(backend, "load_vlm", outside(backend.load_vlm))
    load = AutoModelForSequenceClassification.from_pretrained  # CORA's consistency classifier
    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained", outside(load))


@pytest.fixture
def simulated(monkeypatch, one_thread):
    _device_loaders(monkeypatch)
    with simulated_device():
        yield


def _cfg(tmp_path, config: str | None, *overrides: str):
    return load_config(backend.CONFIG_CLASS, ROOT / "configs" / "vlm" / config if config else None,
                       [f"output_dir={tmp_path / 'run'}", *SMALL, *overrides], defaults=backend.DEFAULT_CONFIG)


def _on_device(module) -> bool:
    return all(p.device == SIM for p in module.parameters())


def _train(tmp_path, config: str | None, *overrides: str):
    cfg = _cfg(tmp_path, config, *overrides)
    policy, task = backend.build(cfg)
    assert policy.device == SIM and _on_device(policy.model)
    before = {k: v.detach().cpu().clone() for k, v in policy.model.named_parameters() if v.requires_grad}
    trainer = Trainer(cfg, policy, task, backend=backend)
    summary = trainer.train()
    assert summary["steps"] == 2 and _on_device(policy.model)
    changed = [k for k, v in policy.model.named_parameters() if v.requires_grad and not torch.equal(v.cpu(), before[k])]
    assert changed  # the updates ran on the device
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    losses = [float(v) for r in rows for k, v in r.items() if k.startswith("loss/")]
    assert len(rows) == 2 and losses and all(math.isfinite(v) for v in losses)
    assert all(r.get("train/bad_step", 0) == 0 for r in rows)
    return policy, task, trainer, summary, rows


def test_the_simulation_runs_what_pytorch_builds_from_python_data(simulated):
    """torch.tensor(..., device=) and a Python-list index are made past dispatch modes: the
    harness makes them on the device (with values), and a CPU operand still raises."""
    x = torch.tensor([1.0, 2.0, 3.0], device=SIM)
    assert x.device == SIM and x.tolist() == [1.0, 2.0, 3.0]
    assert torch.tensor([x[0], x[2]], device=SIM).tolist() == [1.0, 3.0]  # device scalars read on the host
    assert x.new_tensor([5]).device == SIM and x.new_tensor([5]).dtype == torch.float32
    y = x.clone()
    y[[0, 2]] = float("-inf")  # a list index: made on the device, as PyTorch does
    assert y.tolist() == [float("-inf"), 2.0, float("-inf")] and x[[1]].tolist() == [2.0]
    with pytest.raises(RuntimeError, match="same device"):
        x + torch.ones(3)
    with pytest.raises(RuntimeError, match="same device"):
        torch.tensor([1.0, 2.0, 3.0]) * x


def test_the_simulation_refuses_what_cuda_refuses(simulated):
    """The rules past "same device": a CPU tensor indexed by device indices; a value of two or
    more elements put across devices (a 0-d CPU value is a scalar); a CPU generator drawing device
    numbers; and a real meta tensor (no values) meeting the simulation is a harness error."""
    x = torch.zeros(3, device=SIM)
    with pytest.raises(RuntimeError, match="indices should be either on cpu or on the same device"):
        torch.ones(3)[torch.tensor([0, 1], device=SIM)]
    assert x[torch.tensor([0, 2])].tolist() == [0.0, 0.0]  # CPU indices into a device tensor: fine
    with pytest.raises(RuntimeError, match="the value put is on cpu"):
        x[torch.tensor([0, 1], device=SIM)] = torch.ones(2)
    x[torch.tensor([0], device=SIM)] = torch.tensor(5.0)
    assert x.tolist() == [5.0, 0.0, 0.0]
    with pytest.raises(RuntimeError, match="Expected a 'cuda' device type for generator"):
        torch.rand(3, device=SIM, generator=torch.Generator())
    assert torch.rand(3, device=SIM).device == SIM
    hollow = outside(torch.empty)(3, device="meta")
    with pytest.raises(RuntimeError, match="a real meta tensor"):
        x + hollow


@pytest.mark.parametrize("config,extra", [
    (None, ["method.kl.beta=0.04"]),
    (None, ["model.lora.r=4"]),
    ("fastrl.yaml", []),
    (None, ["rollout.scheduler.mode=pipelined"]),
    (None, ["train.mini_batches=2", "train.ppo_epochs=2", "rollout.num_generations=4"]),
], ids=["grpo-kl", "grpo-lora", "grpo-fastrl", "pipelined", "minibatches-epochs"])
def test_grpo_trains_on_the_device(simulated, tmp_path, reward_spread, config, extra):
    policy, _, trainer, _, rows = _train(tmp_path, config, *extra)
    if "method.kl.beta=0.04" in extra:
        assert all("loss/kl" in r for r in rows) and _on_device(trainer.reference.model)
    if "model.lora.r=4" in extra:
        assert policy.is_lora


def test_axpo_with_tool_rollouts_trains_on_the_device(simulated, tmp_path):
    """Zoom tool turns (observation images processed and moved each turn), AXPO's resampling
    from tool-call prefixes, the held-out tool metrics."""
    _, _, _, summary, rows = _train(tmp_path, "axpo.yaml", "rollout.max_new_tokens=48", "rollout.num_generations=4",
                                    "method.resample.budget=1.0", "method.success=2.0", "rollout.eval_samples=2")
    assert any(r["rollout/tool_calls"] > 0 for r in rows)
    assert sum(r["axpo/resampled"] for r in rows) > 0
    assert {"tool_call_rate", "pass@2"} <= set(summary["eval_after"])


@pytest.mark.parametrize("config,extra", [("pacg.yaml", ["method.intervention=blur"]), ("pacg_vppo.yaml", [])],
                         ids=["pacg-blur", "pacg-vppo"])  # PACG (mask intervention by pacg-vppo's VPPO too)
def test_pacg_and_vppo_train_on_the_device(simulated, tmp_path, reward_spread, config, extra):
    """The intervened images (masked patches, the blur's kernel) and the re-scoring pass."""
    _, _, _, _, rows = _train(tmp_path, config, f"model.path={BUNDLED}", "rollout.num_generations=4",
                              "rollout.max_new_tokens=16", "method.dynamic_sampling.enabled=false", *extra)
    assert all(r["pacg/claims"] >= 0 for r in rows)
    assert all("vppo/visual_dependency" in r for r in rows) == (config == "pacg_vppo.yaml")


def test_dspo_trains_on_the_device(simulated, tmp_path, reward_spread):
    _, _, _, summary, rows = _train(tmp_path, "dspo.yaml", "task.num_ood=2", "rollout.num_generations=4",
                                    "rollout.max_new_tokens=16")
    assert all("dspo/cvig_scored" in r for r in rows) and "ood/accuracy" in summary["eval_after"]


def test_cora_trains_on_the_device_with_its_classifier_there(simulated, tmp_path, reward_spread):
    _, task, _, _, rows = _train(tmp_path, "cora.yaml", f"model.path={BUNDLED}", "method.warmup_steps=1",
                                 "rollout.num_generations=4", "rollout.max_new_tokens=24")
    atom = task.reward.atoms[-1]
    judge = next(c.cell_contents for c in atom.fn.__closure__ if hasattr(c.cell_contents, "prob"))
    assert judge.device == SIM and _on_device(judge.model)
    assert all(0 <= r["reward/consistency"] <= 1 for r in rows)


def test_cli_sample_and_eval_on_the_device(monkeypatch, tmp_path, one_thread):
    """`mmrl sample` (sampled, greedy, and --prompt with --image) and `mmrl eval` from a
    checkpoint: the CLI builds the policy on the device and loads the weights into it."""
    from PIL import Image

    from mmrl.cli import SPEC
    from mmrl.core.cli import load_checkpoint, make_app
    from mmrl.vlm.models import load_vlm
    from mmrl.vlm.tasks.shapes_qa import generate_items

    ckpt = tmp_path / "ckpt"
    model, processor = load_vlm(_cfg(tmp_path, None).model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)  # weights of its own: a load that does not copy shows
    saved = {k: v.detach().clone() for k, v in model.named_parameters()}
    model.save_pretrained(ckpt)
    processor.save_pretrained(ckpt)
    image = tmp_path / "shapes.png"
    generate_items(1, seed=5)[0].images[0].save(image)
    assert Image.open(image).size[0] > 0
    sets = [x for o in ["rollout.max_new_tokens=6", "task.num_eval=2", "task.num_train=8",
                        f"output_dir={tmp_path / 'run'}"] for x in ("--set", o)]
    _device_loaders(monkeypatch)
    runner, app = CliRunner(), make_app(SPEC)
    with simulated_device():
        outs = [runner.invoke(app, ["sample", *sets, *args]) for args in (
            ["--num", "2"], ["--greedy", "--checkpoint", str(ckpt)],
            ["--prompt", "What colour is the shape?", "--image", str(image), "--num", "2"])]
        evaluated = runner.invoke(app, ["eval", *sets, "--checkpoint", str(ckpt)])
        policy, _ = backend.build(_cfg(tmp_path, None))  # what --checkpoint does to the policy
        load_checkpoint(policy, ckpt)
        assert _on_device(policy.model)
        assert all(torch.equal(v.cpu(), saved[k]) for k, v in policy.model.named_parameters())
    for out in (*outs, evaluated):
        assert out.exit_code == 0, (out.output, out.exception)
    rows = [[json.loads(line) for line in o.stdout.splitlines() if line.startswith("{")] for o in outs]
    assert [len(r) for r in rows] == [4, 2, 2]
    assert all("reward" in r for r in rows[0] + rows[1]) and all(r["image"] == str(image) for r in rows[2])
    metrics = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert 0 <= metrics["accuracy"] <= 1


def test_sample_and_evaluate_on_the_device(simulated, tmp_path):
    """backend.sample and Trainer.evaluate (what `mmrl sample` / `mmrl eval` run) with a
    policy on the device, tool rollouts included."""
    cfg = _cfg(tmp_path, "axpo.yaml", "rollout.max_new_tokens=48", "rollout.eval_samples=2")
    policy, task = backend.build(cfg)
    assert policy.device == SIM
    assert len(backend.sample(cfg, policy, task, [], 2)) == 4
    assert len(backend.sample(cfg, policy, task, [], 1, greedy=True)) == 2
    metrics = Trainer(cfg, policy, task, output_dir=cfg.output_dir).evaluate()
    assert 0 <= metrics["accuracy"] <= 1 and 0 <= metrics["tool_call_rate"] <= 1


@pytest.mark.parametrize("config,extra", [(None, ["rollout.max_new_tokens=12"]),
                                          ("axpo.yaml", ["rollout.max_new_tokens=48"])], ids=["plain", "tools"])
def test_a_seeded_rollout_on_the_device_draws_the_cpu_rollouts_tokens(tmp_path, monkeypatch, one_thread, config,
                                                                       extra):
    """The sampling seeds come from a CPU generator: the same tokens (and the same log-probs
    up to rounding: the simulation runs op by op) whatever model.device is."""
    cfg = _cfg(tmp_path, config, *extra)
    policy, task = backend.build(cfg)
    items = task.train_prompts()[:2]
    cpu = policy.generate(items, 2, cfg.rollout, torch.Generator().manual_seed(0))
    _device_loaders(monkeypatch)
    with simulated_device():
        policy, task = backend.build(cfg)
        dev = policy.generate(items, 2, cfg.rollout, torch.Generator().manual_seed(0))
        assert dev.old_logp.device == SIM and dev.mask.device == SIM and dev.group_ids.device.type == "cpu"
        assert all(v.device == SIM for v in dev.data.values())
        got = {k: v.cpu() for k, v in dev.data.items()}
        logp, mask = dev.old_logp.cpu(), dev.mask.cpu()
    assert [s.completion for s in dev.samples] == [s.completion for s in cpu.samples]
    assert torch.equal(got["completion_ids"], cpu.data["completion_ids"]) and torch.equal(mask, cpu.mask)
    assert set(got) == set(cpu.data)
    torch.testing.assert_close(logp, cpu.old_logp, rtol=0, atol=1e-5)
