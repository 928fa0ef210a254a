"""Whole dLLM runs with the model on the simulated device of tests/simdevice.py: tensors that
say "meta", hold real CPU values and refuse a CPU operand of one or more dims as CUDA would.
A 2-step `Trainer.train()` of each method's config (diffu-GRPO with its KL, TraceRL, SLIM-RL,
ForkGRPO, AR-GRPO), sudoku, LoRA, the pipelined scheduler, dynamic sampling and stop-at-eos;
`eval` with pass@k and `sample` through the CLI; a seeded rollout that draws the CPU's tokens.
Every rollout, estimator, loss, evaluation and checkpoint tensor must follow the model. The
real GPU run is tests/gpu/test_dllm_cuda.py; pieces on fake CUDA, tests/dllm/test_dllm_device.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from simdevice import SIM, outside, simulated_device
from typer.testing import CliRunner

from dllm_rl import backend
from dllm_rl.cli import app
from dllm_rl.config import DLLMTrainConfig
from dllm_rl.policy import DLLMPolicy
from mmrl.core.config import load_config
from mmrl.core.rewards import Reward
from mmrl.core.trainer import Trainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "dllm"
# 2 prompts x 4 answers of 8 tokens (2 blocks of 4, 8 steps), 2 steps, a large lr: weights move
SMALL = ["rollout.prompts_per_step=2", "rollout.num_generations=4", "task.num_train=50", "task.num_eval=4",
         "rollout.gen_length=8", "rollout.block_length=4", "rollout.steps=8", "rollout.eval_batch_size=32",
         "logging.tensorboard=false", "logging.progress=false", "train.max_steps=2", "optim.lr=1e-2"]
RUNS = {  # config file, overrides
    "diffu_grpo-kl": ("diffu_grpo", ["method.kl.beta=0.04"]),
    # the length rule off: reward_spread's 0, 1, 0, 1 reach the update (no random answer ends)
    "slim_rl": ("slim_rl", ["method.accuracy_band=[0,1]", "method.length_limit_wrong=false"]),
    "fork_grpo": ("fork_grpo", ["rollout.temperature=1.5"]),
    "ar_grpo": ("ar_grpo", []),
    # old log-probs scored in passes of their own (mini-batches), micro-batches, a log-prob
    # temperature; threshold rollouts evaluated with the ar decoder; samples logged
    "diffu_grpo-minibatches": ("diffu_grpo", ["train.mini_batches=2", "train.micro_batch_size=2",
                                              "method.logprob_temperature=0.7", "rollout.strategy=threshold",
                                              "rollout.eval_strategy=ar", "train.log_samples_every=1"]),
    "tracerl-minibatches": ("tracerl", ["method.dynamic_sampling.enabled=false", "train.mini_batches=2",
                                        "train.micro_batch_size=2", "method.merge_steps=1"]),
    # a background engine thread with its own copy of the weights, published to it each step
    "pipelined": ("diffu_grpo", ["rollout.scheduler.mode=pipelined"]),
    "pipelined-lora-slim_rl": ("slim_rl", ["rollout.scheduler.mode=pipelined", "model.lora.r=4", "model.lora.alpha=8",
                                           "method.accuracy_band=[0,1]", "method.length_limit_wrong=false"]),
    # DAPO's dynamic sampling: groups whose rewards are alike dropped, the batch refilled
    "dynamic_sampling": ("tracerl", ["method.dynamic_sampling.enabled=true", "method.dynamic_sampling.max_rounds=2"]),
    # the length rule on (it reads the device rollout's truncation): it may zero every reward
    "slim_rl-stop_at_eos": ("slim_rl", ["method.accuracy_band=[0,1]", "rollout.stop_at_eos=true"]),
}
MAY_NOT_MOVE = {"slim_rl-stop_at_eos"}


@pytest.fixture
def simulated(monkeypatch):
    """model.device resolves to the simulated device; the model loads (from_pretrained, which
    may build on the real meta device first) outside the simulation, and the backend's
    `.to(device)` then moves it onto the simulated device by swapping its parameters."""
    import dllm_rl.models

    monkeypatch.setattr(dllm_rl.models, "load_mask_predictor", outside(dllm_rl.models.load_mask_predictor))
    monkeypatch.setattr(backend, "model_device", lambda spec: SIM)
    with simulated_device():
        yield


def _cfg(tiny_dllm, tmp_path, config: str, *overrides: str) -> DLLMTrainConfig:
    return load_config(DLLMTrainConfig, CONFIGS / f"{config}.yaml",
                       [f"model.path={tiny_dllm}", f"output_dir={tmp_path / 'run'}", *SMALL, *overrides],
                       defaults=backend.DEFAULT_CONFIG)


def _first_group_alike(scores):
    """reward_spread's 0, 1, 0, 1, ... with the first group's rewards all 0."""
    scores.total[:4] = 0.0  # num_generations 4
    return scores


def _on_sim(module) -> bool:
    return all(p.device == SIM for p in module.parameters())


def _finite(row: dict) -> bool:
    return all(math.isfinite(v) for v in row.values() if isinstance(v, float))


def test_the_simulated_device_refuses_what_cuda_refuses():
    """Beyond a CPU operand: CPU tensors indexed by device indices, CPU values put into device
    tensors, CPU generators drawing device numbers; and threads started inside (a pipelined
    engine's) are on the simulated device too. What CUDA allows still runs."""
    import threading

    with simulated_device():
        x, cpu, gen = torch.zeros(4, device=SIM), torch.zeros(4), torch.Generator().manual_seed(0)
        x[torch.tensor([0, 1])] = torch.tensor(1.0)  # CPU indices, a 0-d CPU value
        x[torch.tensor([2])] = torch.ones(1, device=SIM)
        assert x.cpu().tolist() == [1.0, 1.0, 1.0, 0.0] and x[torch.tensor([True, False, True, False])].device == SIM
        assert torch.rand(3, generator=gen).to(SIM).device == SIM  # drawn on the CPU, then moved
        refused = {
            "device indices": lambda: cpu[torch.tensor([0], device=SIM)],
            "a CPU value": lambda: x.__setitem__(torch.tensor([0, 1]), torch.ones(2)),
            "rand": lambda: torch.rand(3, device=SIM, generator=gen),
            "bernoulli": lambda: torch.bernoulli(torch.full((3,), 0.5, device=SIM), generator=gen),
            "uniform_": lambda: x.uniform_(generator=gen),
            "multinomial": lambda: torch.multinomial(torch.ones(3, device=SIM), 1, generator=gen),
        }
        for what, op in refused.items():
            with pytest.raises(RuntimeError):
                op()
                pytest.fail(what)
        seen = []
        thread = threading.Thread(target=lambda: seen.append(type(torch.ones(2, device=SIM) + 1).__name__))
        thread.start()
        thread.join()
        assert seen == ["_OnDevice"]


@pytest.mark.parametrize("run", list(RUNS))
def test_training_on_the_device_keeps_every_tensor_there(simulated, tiny_dllm, tmp_path, reward_spread, monkeypatch, run):
    """Rollouts, old log-probs, the estimators' masks and rows, the losses and their KL to the
    reference, backward, the optimizer, evaluation and checkpoints, with the model on the
    (simulated) device: nothing mixes a CPU tensor in, and the weights stay there and move."""
    config, overrides = RUNS[run]
    if run.startswith("dynamic_sampling"):  # the first group of each round scores alike: dropped, refilled
        spread = Reward.score
        monkeypatch.setattr(Reward, "score", lambda self, samples: _first_group_alike(spread(self, samples)))
    cfg = _cfg(tiny_dllm, tmp_path, config, *overrides)
    policy, task = backend.build(cfg)
    assert _on_sim(policy.model)
    before = {k: v.detach().cpu().clone() for k, v in policy.model.named_parameters() if v.requires_grad}
    copies = []  # the policy's deepcopies: a KL reference, a pipelined engine's weights
    reference = DLLMPolicy.reference
    monkeypatch.setattr(DLLMPolicy, "reference", lambda self: copies.append(reference(self)) or copies[-1])
    summary = Trainer(cfg, policy, task).train()
    assert summary["steps"] == 2 and _finite(summary["eval_after"]) and 0 <= summary["eval_after"]["accuracy"] <= 1
    assert _on_sim(policy.model)
    assert all(_on_sim(c.model) for c in copies)  # a deepcopy stays on the device
    assert not any(c.model.training for c in copies)  # in eval mode as the trainer's (LoRA's wrapper too)
    if run == "pipelined":
        assert copies  # the engine's own weights
    changed = [k for k, v in policy.model.named_parameters() if v.requires_grad and not torch.equal(v.cpu(), before[k])]
    assert changed or run in MAY_NOT_MOVE, "no trainable weight moved"
    if cfg.model.lora is not None:
        assert all(".lora_" in k for k in before)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(_finite(r) for r in rows)
    if run.startswith("dynamic_sampling"):
        assert all(r["rollout/groups_dropped"] > 0 and r["rollout/rounds"] > 1 for r in rows)
    losses = [v for r in rows for k, v in r.items() if k.startswith("loss/")]
    assert losses and (run in MAY_NOT_MOVE or any(r.get("loss/grad_norm", 0) > 0 for r in rows))


def _invoke(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, (r.output[-3000:], r.exception)
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


# the checkpoint's load_state_dict copies into the device's parameters; torch warns of a no-op
# only because they say "meta"
@pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter:UserWarning")
def test_eval_with_pass_at_k_and_sample_on_the_device(simulated, tiny_dllm, tmp_path, reward_spread, dllm_builds):
    """`dllm-rl train` then `eval --checkpoint` (weights loaded into the device's parameters,
    greedy and 4 sampled answers per problem) and `sample`, the model on the device."""
    sets = [a for kv in (f"model.path={tiny_dllm}", *SMALL, "train.max_steps=1") for a in ("--set", kv)]
    built = dllm_builds
    run = tmp_path / "run"
    _invoke("train", "--output-dir", run, *sets)
    (metrics,) = _invoke("eval", "--checkpoint", run, *sets, "--set", "rollout.eval_samples=4",
                         "--set", f"output_dir={tmp_path / 'e'}")
    (trained, start), (evaluated, _) = built
    assert _on_sim(evaluated.model) and _finite(metrics) and 0 <= metrics["accuracy"] <= 1
    loaded = dict(evaluated.model.named_parameters())  # the checkpoint's weights, copied into the device's
    assert all(torch.equal(loaded[k].cpu(), v.cpu()) for k, v in trained.model.named_parameters())
    assert not all(torch.equal(loaded[k].cpu(), v) for k, v in start.items())
    passes = [metrics[f"pass@{k}"] for k in range(1, 5)]
    assert passes == sorted(passes) and 0 <= passes[0] <= passes[-1] <= 1
    for extra in ([], ["--greedy"]):
        rows = _invoke("sample", "--checkpoint", run, "--prompt", "12+3=", "--prompt", "7+8=", *extra, *sets,
                       "--set", f"output_dir={tmp_path / 's'}")
        assert len(rows) == (2 if extra else 8) and all("reward" in r and r["nfe"] > 0 for r in rows)
        assert _on_sim(built[-1][0].model)


@pytest.mark.parametrize("overrides", [[], ["rollout.strategy=fork", "method.type=fork_grpo"],
                                       ["rollout.strategy=tau_budget", "method.type=slim_rl"],
                                       ["rollout.stop_at_eos=true"]],
                         ids=["low_confidence", "fork", "tau_budget-slim", "stop_at_eos"])
def test_a_seeded_rollout_on_the_device_draws_the_cpu_rollouts_tokens(tiny_dllm, tmp_path, monkeypatch, overrides):
    """The sampler's noise and the estimators' masks are drawn by CPU generators and moved:
    one seed, the same tokens wherever the model runs (the log-probs up to rounding: the
    simulation runs op by op)."""
    cfg = load_config(DLLMTrainConfig, None, [f"model.path={tiny_dllm}", f"output_dir={tmp_path}", *SMALL,
                                              "method.dynamic_sampling.enabled=false", *overrides],
                      defaults=backend.DEFAULT_CONFIG)

    def rollout():
        policy, task = backend.build(cfg)
        policy.estimator.on_policy = False  # the old log-probs scored, as off-policy runs do
        batch = policy.generate(task.train[:2], 4, cfg.rollout, torch.Generator().manual_seed(0))
        return batch, {k: v.cpu() for k, v in batch.data.items() if torch.is_tensor(v)}, batch.old_logp.cpu()

    cpu, cpu_data, cpu_logp = rollout()
    import dllm_rl.models

    monkeypatch.setattr(dllm_rl.models, "load_mask_predictor", outside(dllm_rl.models.load_mask_predictor))
    monkeypatch.setattr(backend, "model_device", lambda spec: SIM)
    with simulated_device():
        dev, dev_data, dev_logp = rollout()
        assert dev.data["completion"].device == dev.old_logp.device == dev.mask.device == SIM
    assert dev_data.keys() == cpu_data.keys()
    for k, v in cpu_data.items():
        if v.is_floating_point():
            torch.testing.assert_close(dev_data[k], v, rtol=0, atol=1e-5, msg=k)
        else:
            assert torch.equal(dev_data[k], v), k
    torch.testing.assert_close(dev_logp, cpu_logp, rtol=0, atol=1e-5)
    assert dev.samples == cpu.samples and torch.equal(dev.group_ids, cpu.group_ids)
