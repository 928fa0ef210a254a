"""model.device in the dLLM backend, without a GPU. Two stand-ins for one: PyTorch's
FakeTensorMode, in which a tensor may claim to be on "cuda" (shapes and devices are tracked,
no data; an op mixing cuda and cpu raises FakeTensorDeviceMismatchError), and the "meta"
device. Neither can run an op whose result depends on data (.item(), .tolist(), nonzero), so
they cover the sampler's steps, the estimators and the losses one by one; the whole loop on a
GPU is tests/gpu/test_dllm_cuda.py. Also: model.device=cpu trains as the default did, and
model.device=cuda on a machine without one is a clean ConfigError through the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from typer.testing import CliRunner

from dllm_rl.cli import app
from dllm_rl.logprob import coupled_masks, d1_masked_input, forward_mask, uniform
from dllm_rl.methods.slim_rl import quadrature, slim_loss, zero_truncated
from dllm_rl.samplers import STRATEGIES, _draw, num_transfer_tokens, select_commits, state_at
from mmrl.core.rewards import AtomScores

CUDA = torch.device("cuda", 0)
META = torch.device("meta")


def fake():
    """Fake mode: tensors made inside may be on "cuda"; real CPU tensors may come in (as the
    generators' draws and the CPU bookkeeping do) and mixing them with cuda ones raises."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def rollout_on(policy, task, cfg, device):
    """A real (CPU) rollout, every field a model reads moved to `device`; the ids and the
    seeds stay on the CPU, as the policy makes them."""
    policy.estimator.on_policy = False
    batch = policy.generate(task.train[:2], 4, cfg.rollout, torch.Generator().manual_seed(0))
    moved = batch.to(device)
    for key in ("mask_seed", "old_logp/first_pass_row"):
        if key in batch.data:
            moved.data[key] = batch.data[key]
    moved.group_ids = batch.group_ids
    return moved


# --------------------------------------------------------------------------- the fake tool itself


def test_fake_mode_catches_a_cpu_tensor_meeting_a_cuda_one():
    with fake():
        a = torch.empty(3, device="cuda")
        with pytest.raises(Exception, match="cuda:0 and cpu"):
            a + torch.ones(3)


# --------------------------------------------------------------------------- sampler steps


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_select_commits_stays_on_the_confidences_device(strategy):
    with fake():
        conf = torch.rand(3, 4, device="cuda")
        masked = torch.ones(3, 4, dtype=torch.bool, device="cuda")
        for n in (2, torch.full((3,), 2, device="cuda")):  # an int or the schedule's [B]
            c = select_commits(conf, masked, strategy=strategy, num_commit=n)
            assert c.mask.device == c.fallback.device == c.expected_wrong.device == CUDA


def test_schedule_and_states_stay_on_the_tokens_device():
    with fake():
        assert num_transfer_tokens(torch.full((2,), 3, device="cuda"), 2).device == CUDA
        tokens = torch.zeros(2, 6, dtype=torch.long, device="cuda")
        commit_step = torch.zeros(2, 4, dtype=torch.long, device="cuda")
        assert state_at(tokens, commit_step, 1, mask_id=5).device == CUDA
        assert state_at(tokens, commit_step, torch.ones(2, dtype=torch.long, device="cuda"), mask_id=5).device == CUDA


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_gumbel_draws_from_a_cpu_generator_land_on_the_logits_device(temperature):
    with fake():
        logits = torch.randn(2, 4, 7, dtype=torch.float64, device="cuda")
        for generator in (torch.Generator().manual_seed(0), None):  # the trainer's CPU generator; none
            x0, conf, logp = _draw(logits, temperature, generator)
            assert x0.device == conf.device == logp.device == CUDA


def test_gumbel_draws_of_a_seed_do_not_depend_on_the_logits_device():
    """The noise is drawn on the generator's CPU and moved: the cuda run of a seed draws the
    very numbers the CPU run did (here: the CPU and the meta logits consume the same draws)."""
    logits = torch.randn(2, 4, 7, dtype=torch.float64)
    gen_cpu, gen_meta = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    _draw(logits, 0.7, gen_cpu)
    _draw(logits.to(META), 0.7, gen_meta)
    assert torch.equal(torch.rand(5, generator=gen_cpu), torch.rand(5, generator=gen_meta))


# --------------------------------------------------------------------------- masks and estimators


def test_seeded_masks_follow_the_inputs_device_and_match_the_cpus():
    with fake():
        ids = torch.zeros(2, 3, dtype=torch.long, device="cuda")
        valid = torch.ones(2, 4, dtype=torch.bool, device="cuda")
        assert uniform((2, 3), generator=torch.Generator(), device=CUDA).device == CUDA
        assert d1_masked_input(ids, ids, mask_id=5, seed=1).device == CUDA
        assert all(m.device == CUDA for m in coupled_masks(valid, generator=torch.Generator().manual_seed(0)))
        masked, p = forward_mask(valid, generator=torch.Generator().manual_seed(0))
        assert masked.device == p.device == CUDA
    # the draws are the generator's, wherever they land: the meta mask is the CPU one's shape,
    # and the generator advanced as on the CPU
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    forward_mask(torch.ones(2, 4, dtype=torch.bool), generator=g1)
    forward_mask(torch.ones(2, 4, dtype=torch.bool, device=META), generator=g2)
    assert torch.equal(torch.rand(3, generator=g1), torch.rand(3, generator=g2))


def test_prompts_and_answers_are_encoded_on_the_models_device(make_run):
    _, policy, task = make_run()
    policy.predictor.to(META)
    ids, valid = policy.encode_prompts([p.prompt for p in task.train[:3]])
    assert ids.device == valid.device == META and ids.shape == valid.shape == (3, policy.prompt_length)
    assert policy.predictor.answer_ids(["12", "7"], 8).device == META


def test_logits_and_slim_rows_on_a_fake_gpu(make_run):
    """The policy's forward and SLIM-RL's estimator, the model and the rollout on (fake) cuda;
    the policy's banned tokens are a CPU tensor moved to the logits."""
    cfg, policy, task = make_run("method.type=slim_rl", "rollout.strategy=tau_budget")
    batch = policy.generate(task.train[:2], 4, cfg.rollout, torch.Generator().manual_seed(0))
    with fake():
        policy.predictor.to("cuda")
        on = batch.to("cuda")
        x = torch.cat([on.data["prompt_ids"], on.data["completion"]], 1)
        logits = policy.logits(x, on.data["prompt_valid"])
        assert logits.device == CUDA and logits.shape[:2] == x.shape
        logp = policy.logprobs(on)  # [N, Q, C]
        assert logp.device == CUDA and logp.shape == on.data["slim/mask"].shape


def test_diffu_grpo_mean_field_on_meta_with_its_seeds_on_the_cpu(make_run):
    """d1's prompt masks are seeded on the CPU (mask_seed stays there, read as ints) and moved
    to the rollout's device; the old log-probs it scores are the model's device's."""
    cfg, policy, task = make_run(score_old=True)
    batch = rollout_on(policy, task, cfg, META)
    assert batch.data["mask_seed"].device.type == "cpu"
    policy.predictor.to(META)
    x = policy.estimator.masked_input(policy, batch, 1)
    assert x.device == META and x.shape == (len(batch), policy.prompt_length + cfg.rollout.gen_length)
    logp = policy.logprobs(batch, iteration=1)
    assert logp.device == META and logp.shape == batch.mask.shape


# --------------------------------------------------------------------------- SLIM-RL's loss and rules


@pytest.mark.parametrize("adv_device", ["cpu", "cuda"])
def test_slim_loss_meets_its_cpu_quadrature_weights_on_the_gpu(monkeypatch, adv_device):
    """The row advantages w_q A_i: weights made on the CPU, advantages on the CPU (the
    scheduler's) or on the GPU; everything slim_loss hands the core loss is on one device.
    The core loss itself reads metrics (.tolist()), which fake mode cannot: it is recorded."""
    import dllm_rl.methods.slim_rl as slim

    seen = {}

    def record(logp, old, adv, mask, **kwargs):
        seen.update(logp=logp.device, old=old.device, adv=adv.device, mask=mask.device)
        return slim.LossOutput(loss=(logp * adv.to(logp.device)[:, None]).sum(), metrics={})  # as the core loss

    monkeypatch.setattr(slim, "policy_loss", record)
    _, w = quadrature(3)
    with fake():
        logp = torch.randn(4, 3, 5, device="cuda")
        out = slim_loss(logp, logp, torch.ones(4, 3, 5, dtype=torch.bool, device="cuda"),
                        torch.randn(4, device=adv_device), w, clip=0.1, max_log_ratio=5.0, beta=0.0)
        adv = seen.pop("adv")
        assert set(seen.values()) == {CUDA} and out.loss.device == CUDA
        assert adv.type == adv_device  # the core loss moves the advantages (mmrl.core.losses.policy_loss)


def test_the_length_rule_zeroes_cpu_scores_from_a_gpu_rollout():
    scores = AtomScores(["answer"], torch.ones(3, 1), torch.ones(3), [None] * 3, torch.zeros(3, dtype=torch.bool))
    with fake():
        out = zero_truncated(scores, torch.tensor([True, False, True], device="cuda"))
        assert out.values.device.type == out.total.device.type == "cpu"
    real = zero_truncated(scores, torch.tensor([True, False, True]))
    assert real.total.tolist() == [0.0, 1.0, 0.0]


# --------------------------------------------------------------------------- the CLI path


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def metrics(run) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/") and "per_sec" not in k} for r in rows]


def test_an_explicit_cpu_device_trains_as_the_default(small_sets, tmp_path, reward_spread):
    from safetensors.torch import load_file

    runs = {}
    for name, extra in (("default", []), ("cpu", ["--set", "model.device=cpu"]), ("auto", ["--set", "model.device=auto"])):
        if name == "auto" and torch.cuda.is_available():
            continue  # auto is the GPU there
        out = tmp_path / name
        r = invoke("train", "--max-steps", 1, "--output-dir", out, *small_sets, *extra)
        assert r.exit_code == 0, (r.output[-2000:], r.exception)
        runs[name] = out
    weights = {name: load_file(out / "checkpoints/step-00000001/model/model.safetensors") for name, out in runs.items()}
    for name, out in runs.items():
        assert metrics(out) == metrics(runs["default"])
        assert weights[name].keys() == weights["default"].keys()
        assert all(torch.equal(weights[name][k], weights["default"][k]) for k in weights[name])
    assert metrics(runs["default"])[0]["loss/grad_norm"] > 0  # it trained (reward_spread)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("command", ["train", "eval", "sample"])
@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_a_gpu_device_without_one_is_a_config_error(small_sets, tmp_path, command, spec):
    r = invoke(command, *small_sets, "--set", f"model.device={spec}", "--set", f"output_dir={tmp_path}")
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (r.output[-2000:], r.exception)
    assert f"model.device {spec}: no CUDA device is visible" in r.stderr and "Traceback" not in r.output
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_build_refuses_a_missing_gpu_before_loading_the_model(make_run, monkeypatch):
    import dllm_rl.models
    from mmrl.core.config import ConfigError

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(dllm_rl.models, "load_mask_predictor", never)
    with pytest.raises(ConfigError, match="model.device cuda: no CUDA device"):
        make_run("model.device=cuda")
