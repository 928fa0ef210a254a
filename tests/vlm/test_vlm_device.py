"""The VLM backend's device handling (model.device), on a CPU. No GPU here, so PyTorch's
FakeTensorMode fakes CUDA tensors: a helper given its inputs on "cuda" that builds a CPU
tensor to meet them raises FakeTensorDeviceMismatchError, which a CPU run cannot show
(every tensor is on the CPU there). Fake tensors hold no data, so only helpers without
data-dependent ops (.item(), .tolist(), boolean-mask indexing) run under it; the rollout
and update on a real GPU are tests/gpu/test_vlm_cuda.py's. model.device=cpu, said or not,
is the CPU run it always was; model.device=cuda without a GPU is a ConfigError."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from typer.testing import CliRunner

from mmrl.core.config import ConfigError, load_config
from mmrl.vlm import backend
from mmrl.vlm.config import VLMModelConfig
from mmrl.vlm.models import load_vlm
from mmrl.vlm.policy import VLMPolicy, _prepend

CUDA = torch.device("cuda", 0)
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a GPU")


@pytest.fixture(scope="module")
def policy() -> VLMPolicy:
    mcfg = VLMModelConfig()  # the bundled tiny Qwen2.5-VL
    model, processor = load_vlm(mcfg)
    return VLMPolicy(model, processor, min_pixels=mcfg.min_pixels, max_pixels=mcfg.max_pixels)


@functools.cache
def _fakes_cuda_without_a_gpu() -> bool:
    """Whether this torch's FakeTensorMode makes "cuda" tensors with no CUDA driver and names a
    device mismatch with FakeTensorDeviceMismatchError (torch 2.6, the floor, has no such error,
    and its fake model.to("cuda") calls the driver)."""
    from torch._subclasses import fake_tensor

    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            torch.empty(1, device="cuda")
    except (RuntimeError, AssertionError):
        return False
    return hasattr(fake_tensor, "FakeTensorDeviceMismatchError")


def fake_cuda():
    if not _fakes_cuda_without_a_gpu():
        pytest.skip(f"torch {torch.__version__}'s FakeTensorMode has no FakeTensorDeviceMismatchError "
                    "(and calls the CUDA driver when a model moves to a fake GPU)")
    return FakeTensorMode(allow_non_fake_inputs=True)


def test_fake_cuda_catches_a_cpu_tensor_meeting_a_cuda_one():
    """The tool itself: what this file relies on to see a device mix-up without a GPU."""
    mode = fake_cuda()  # (skips first where this torch has no FakeTensorDeviceMismatchError)
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    with mode:
        a = torch.empty(3, device="cuda")
        with pytest.raises(FakeTensorDeviceMismatchError):
            a + torch.ones(3)


def test_mask_ban_and_prefix_helpers_stay_on_the_completions_device(policy):
    with fake_cuda():
        completion = torch.zeros((3, 5), dtype=torch.long, device="cuda")  # [N, T]
        mask = policy.completion_mask(completion)
        assert mask.device == CUDA and mask.shape == (3, 5) and mask.dtype == torch.bool
        logits = torch.zeros((3, 5, policy.model.config.text_config.vocab_size), device="cuda")
        assert policy._ban(logits).device == CUDA
        # prefixes go in front of each row (token ids: Python ints), on the row's device
        out = _prepend([[1, 2], [], [3]], completion, lambda f: f, policy.pad_id)
        assert out.device == CUDA and out.shape == (3, 7)


def test_the_policys_own_tensors_follow_its_model_to_the_device():
    """Vision rows of a round without images and on_device's moves follow the model's device
    (a policy of its own: its parameters turn fake)."""
    mcfg = VLMModelConfig()
    model, processor = load_vlm(mcfg)
    with fake_cuda():
        policy = VLMPolicy(model.to("cuda"), processor, min_pixels=mcfg.min_pixels, max_pixels=mcfg.max_pixels)
        assert policy.device == CUDA
        rows = policy._no_vision_rows(2)
        assert {k: v.device for k, v in rows.items()} == {"pixel_values": CUDA, "image_grid_thw": CUDA}
        moved = policy.on_device({"a": torch.zeros(2), "b": torch.zeros(2, device="cuda")})
        assert all(v.device == CUDA for v in moved.values())
        assert (moved["a"] + moved["b"]).device == CUDA


def test_interventions_follow_the_pixels_device():
    """The Gaussian blur's kernel is built on the images' device (VPPO's blur intervention)."""
    from mmrl.vlm.interventions import gaussian_blur
    from mmrl.vlm.methods.vppo import visual_dependency

    with fake_cuda():
        images = torch.zeros((1, 6, 28, 28), device="cuda")  # [t, planes, H, W]
        assert gaussian_blur(images, 2.0).device == CUDA
        logp = torch.zeros((2, 4), device="cuda")
        mask = torch.ones((2, 4), dtype=torch.bool, device="cuda")
        assert visual_dependency(logp, logp, mask).device == CUDA


def test_dspo_word_tokens_follow_the_masks_device(policy):
    from mmrl.vlm.methods.dspo import _word_tokens

    texts = ["<answer>red", "<answer>blue"]
    t = max(len(policy.tokenizer(x, add_special_tokens=False)["input_ids"]) for x in texts) + 1
    with fake_cuda():
        mask = torch.ones((2, t), dtype=torch.bool, device="cuda")
        out = _word_tokens(policy.tokenizer, ["<answer>", "<answer>"], texts, mask)
        assert out.device == CUDA and out.shape == (2, t)
    # the same helper on the CPU: only the word's tokens (past the 8-character prefix)
    words = _word_tokens(policy.tokenizer, ["<answer>", "<answer>"], texts, torch.ones((2, t), dtype=torch.bool))
    assert words.any(-1).all() and not words[:, 0].any()


def test_claims_on_a_device_stay_there():
    """PACG's claim ids follow the completion ids' device; the (sample, claim) index is CPU
    bookkeeping. Meta tensors stand in for a GPU's here (claims read token values)."""
    from mmrl.vlm.claims import claim_persistence

    logp = torch.zeros((2, 3), device="meta")
    persistence, index = claim_persistence(logp, logp, torch.full((2, 3), -1, dtype=torch.long))
    assert persistence.device == logp.device and persistence.numel() == 0 and index.device.type == "cpu"


def _tiny_run(tmp_path, *extra: str):
    return load_config(backend.CONFIG_CLASS, None, [
        f"output_dir={tmp_path}", "train.max_steps=1", "task.num_train=8", "task.num_eval=2",
        "rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_new_tokens=6",
        "rollout.eval_samples=0", "logging.progress=false", "logging.tensorboard=false", *extra,
    ], defaults=backend.DEFAULT_CONFIG)


def test_model_device_cpu_said_or_not_trains_alike(tmp_path, one_thread):
    """model.device=cpu (the default, or said) puts the policy on the CPU, and a seeded step
    gives the same loss and the same weights either way."""
    from mmrl.core.trainer import Trainer

    weights, losses = [], []
    for name, extra in (("default", ()), ("cpu", ("model.device=cpu",))):
        cfg = _tiny_run(tmp_path / name, *extra)
        assert cfg.model.device == "cpu"
        policy, task = backend.build(cfg)
        assert policy.device == torch.device("cpu")
        before = {k: v.detach().clone() for k, v in policy.model.named_parameters()}
        Trainer(cfg, policy, task, backend=backend).train()
        row = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
        assert torch.isfinite(torch.tensor(row["loss/total"]))
        losses.append(row["loss/total"])
        weights.append({k: v.detach().clone() for k, v in policy.model.named_parameters()})
        if row["reward/advantage_abs"] > 0:  # a group with a reward spread moves the weights
            assert any(not torch.equal(v, before[k]) for k, v in weights[-1].items())
    assert losses[0] == losses[1]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@no_gpu
@pytest.mark.parametrize("spec", ["cuda", "cuda:0"])
def test_model_device_cuda_without_a_gpu_is_a_config_error(spec, tmp_path):
    cfg = _tiny_run(tmp_path, f"model.device={spec}")
    with pytest.raises(ConfigError, match=f"model.device {spec}: no CUDA device"):
        backend.build(cfg)


@no_gpu
def test_model_device_cuda_for_cora_is_a_config_error_about_the_device(tmp_path):
    """CORA's consistency classifier follows model.device: the error names the device, not
    the classifier's path."""
    cfg = _tiny_run(tmp_path, "model.device=cuda", "method.type=cora")
    with pytest.raises(ConfigError, match="model.device cuda: no CUDA device") as info:
        backend.build_task(cfg)
    assert "consistency_model" not in str(info.value)


@no_gpu
def test_the_cli_says_model_device_cuda_needs_a_gpu(tmp_path):
    """`mmrl train --set model.device=cuda` on this machine: a clear error, no traceback, nothing trained."""
    from mmrl.cli import SPEC
    from mmrl.core.cli import make_app

    out = tmp_path / "run"
    result = CliRunner().invoke(make_app(SPEC), [
        "train", "--max-steps", "1", "--output-dir", str(out), "--set", "model.device=cuda"])
    assert result.exit_code != 0
    assert "model.device cuda: no CUDA device" in result.output and "Traceback" not in result.output
    assert not (out / "metrics.jsonl").exists()
    auto = _tiny_run(tmp_path / "auto", "model.device=auto")  # auto falls back to the CPU
    assert backend.build(auto)[0].device == torch.device("cpu")


def test_token_stats_in_chunks_equal_the_whole_batch(monkeypatch):
    """Rollout log-probs and entropies computed a few rows at a time (memory) are the same
    numbers as over the whole [N, T, V] at once, banned tokens and temperature included."""
    import mmrl.vlm.policy as vp

    torch.manual_seed(0)
    pol = vp.VLMPolicy.__new__(vp.VLMPolicy)
    pol.banned_ids = [3, 5]
    steps = [torch.randn(7, 11) for _ in range(4)]  # generate's logits: T tensors [N, V]
    tokens = torch.randint(0, 11, (7, 4))
    tokens[0, 1] = 3  # a banned token: log-prob -inf, as over the whole batch
    whole = (pol._ban(torch.stack(steps, 1)) / 0.7).log_softmax(-1)
    want_logp = whole.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    want_ent = -(whole.exp() * whole.clamp(min=-1e30)).sum(-1)
    for chunk in (1, 2 * 4 * 11, 10**9):  # one row, two rows, all rows per chunk
        monkeypatch.setattr(vp, "STATS_CHUNK", chunk)
        logp, ent = pol.token_stats(steps, tokens, 0.7)
        assert torch.equal(logp, want_logp) and torch.equal(ent, want_ent)
    assert logp[0, 1] == float("-inf")
