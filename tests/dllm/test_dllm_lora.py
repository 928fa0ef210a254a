"""LoRA on the dLLM backend (`model.lora`): only the adapters train, a checkpoint holds the
adapter alone and resumes to the same weights, `eval --checkpoint` scores the trained adapter,
a pipelined engine samples with published adapters, and mismatches are clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from dllm_rl import backend
from dllm_rl.cli import app
from mmrl.core.config import ConfigError
from mmrl.core.engine import PolicyEngine, trainable_weights
from mmrl.core.trainer import Trainer

LORA = ["model.lora.r=4", "model.lora.alpha=8", "optim.lr=1e-2"]


def adapters(policy) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in policy.model.named_parameters() if ".lora_" in k}


def test_only_the_adapters_train(make_run, tmp_path, reward_spread):
    cfg, policy, task = make_run(*LORA, "train.max_steps=1")
    trainable = [k for k, v in policy.model.named_parameters() if v.requires_grad]
    assert trainable and all(".lora_" in k for k in trainable)
    base = {k: v.detach().clone() for k, v in policy.model.named_parameters() if not v.requires_grad}
    before = adapters(policy)
    Trainer(cfg, policy, task, output_dir=tmp_path / "out").train()
    after = adapters(policy)
    assert all(torch.equal(v, base[k]) for k, v in policy.model.named_parameters() if k in base)
    assert any(not torch.equal(after[k], before[k]) for k in before)
    model_dir = next((tmp_path / "out" / "checkpoints").iterdir()) / "model"
    assert (model_dir / "adapter_model.safetensors").is_file() and (model_dir / "dllm.json").is_file()
    assert not (model_dir / "model.safetensors").exists()  # the adapter alone, not the whole model
    _, fresh, _ = make_run(*LORA)
    fresh.load_weights(model_dir)
    assert all(torch.equal(v, after[k]) for k, v in adapters(fresh).items())


def test_a_resumed_run_ends_with_the_uninterrupted_runs_adapters(make_run, tmp_path, reward_spread):
    def run(name, steps, resume=False):
        cfg, policy, task = make_run(*LORA, f"train.max_steps={steps}", "train.save_every=1",
                                     f"output_dir={tmp_path / name}")
        Trainer(cfg, policy, task).train(resume=resume)
        return adapters(policy)

    full = run("full", 2)
    run("split", 1)
    resumed = run("split", 2, resume=True)
    assert full.keys() == resumed.keys()
    for k in full:
        assert torch.equal(full[k], resumed[k]), k


def test_eval_checkpoint_loads_the_adapter_and_refuses_a_mismatch(make_run, tmp_path, reward_spread, small_sets):
    cfg, policy, task = make_run(*LORA, "train.max_steps=1")
    Trainer(cfg, policy, task, output_dir=tmp_path / "out").train()
    trained = Trainer(cfg, policy, task, output_dir=tmp_path / "eval").evaluate()
    runner = CliRunner()

    def cli_eval(*extra, checkpoint=tmp_path / "out"):
        return runner.invoke(app, ["eval", "--checkpoint", str(checkpoint), *small_sets,
                                   "--set", f"output_dir={tmp_path / 'e'}", "--set", "rollout.eval_samples=0", *extra])

    # the run's config.yaml brings its model.lora; so do the flags, for a model outside its run
    alone = tmp_path / "alone"
    shutil.copytree(tmp_path / "out" / "checkpoints" / "step-00000001" / "model", alone)
    for result in (cli_eval(), cli_eval("--set", "model.lora.r=4", "--set", "model.lora.alpha=8", checkpoint=alone)):
        assert result.exit_code == 0, result.output
        (line,) = [x for x in result.stdout.splitlines() if x.startswith("{")]
        assert json.loads(line) == pytest.approx(trained)
    for extra, checkpoint, words in [((), alone, "holds a LoRA adapter, not full weights"),
                                     (("--set", "model.lora.r=8"), tmp_path / "out", "does not fit this run's model.lora")]:
        result = cli_eval(*extra, checkpoint=checkpoint)
        assert result.exit_code == 2 and words in result.output, result.output


def test_target_modules_that_name_no_layer_are_a_config_error(make_run):
    with pytest.raises(ConfigError, match=r"target_modules \['query'\] do not name layers.*q_proj"):
        make_run("model.lora.r=4", 'model.lora.target_modules=["query"]')


def test_a_pipelined_engine_samples_with_the_published_adapters(make_run, reward_spread):
    cfg, policy, task = make_run(*LORA)
    engine = PolicyEngine(policy, own_weights=True)

    def answers(p):
        return p.generate(task.train[:2], 4, cfg.rollout, torch.Generator().manual_seed(0)).data["completion"]

    start = answers(engine.policy)
    assert torch.equal(start, answers(policy))
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if ".lora_B" in name:  # B starts at 0: moving it changes the adapted layers' output
                p.add_(torch.randn_like(p))
    moved = answers(policy)
    assert not torch.equal(moved, start) and torch.equal(answers(engine.policy), start)
    engine.publish(trainable_weights(policy.model), 1)
    assert torch.equal(answers(engine.policy), moved)


def test_build_applies_lora_before_the_policy_keeps_the_model_and_seeds_it(make_run):
    _, policy, _ = make_run("model.lora.r=4")
    assert policy.model is policy.predictor.model and hasattr(policy.model, "peft_config")
    assert backend.CONFIG_CLASS().model.lora is None  # full fine-tuning stays the default
    torch.rand(11)  # the global RNG elsewhere: the run's seed alone draws the adapters
    again, other = adapters(make_run("model.lora.r=4")[1]), adapters(make_run("model.lora.r=4", "seed=1")[1])
    first = adapters(policy)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)
