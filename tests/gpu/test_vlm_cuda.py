"""The VLM backend on a CUDA GPU (model.device=cuda): short real `mmrl train` runs of the bundled
tiny Qwen2.5-VL (GRPO, GRPO with LoRA, AXPO with zoom-tool rollouts), `mmrl eval`, and a seeded
rollout whose tensors all sit on the GPU. Skipped without CUDA; tests/vlm/test_vlm_device.py
checks the device handling on a CPU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the VLM CUDA tests need a CUDA GPU", allow_module_level=True)

from typer.testing import CliRunner

from mmrl.cli import SPEC
from mmrl.core.cli import load_checkpoint, make_app
from mmrl.core.config import load_config
from mmrl.core.logging import read_metrics
from mmrl.vlm import backend

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["--set", "model.device=cuda", "--set", "task.num_train=16", "--set", "task.num_eval=4",
         "--set", "rollout.prompts_per_step=2", "--set", "rollout.num_generations=4",
         "--set", "rollout.eval_samples=2", "--set", "logging.progress=false",
         "--set", "logging.tensorboard=false"]


def invoke(*args: str) -> str:
    result = CliRunner().invoke(make_app(SPEC), list(args))
    assert result.exit_code == 0, result.output
    return result.output


def start_and_end(out: Path) -> tuple[dict, dict]:
    """The run's starting trainable weights (built from its own config.yaml, on the GPU) and its
    final ones (its newest checkpoint loaded into that policy, as `mmrl eval --checkpoint` does)."""
    cfg = load_config(backend.CONFIG_CLASS, out / "config.yaml", [f"output_dir={out / 'rebuilt'}"],
                      defaults=backend.DEFAULT_CONFIG)
    policy, _ = backend.build(cfg)
    start = {k: v.detach().clone() for k, v in policy.model.named_parameters() if v.requires_grad}
    load_checkpoint(policy, out)
    assert all(p.device.type == "cuda" for p in policy.model.parameters())
    end = {k: v.detach().clone() for k, v in policy.model.named_parameters() if v.requires_grad}
    return start, end


def check_run(out: Path) -> None:
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["loss/total"]) and math.isfinite(r["loss/grad_norm"])
        assert r["rollout/decoded_tokens"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert all(math.isfinite(v) for v in summary["eval_after"].values() if isinstance(v, float))
    start, end = start_and_end(out)
    moved = [k for k in start if not torch.equal(start[k], end[k])]
    assert moved, "no trainable parameter changed"


@pytest.mark.parametrize("extra", [[], ["--set", "model.lora.r=8"],
                                   ["--set", "model.gradient_checkpointing=true", "--set", "rollout.old_logprobs=forward"]],
                         ids=["grpo", "grpo-lora", "grpo-checkpointing-forward-scores"])
def test_train_grpo_on_cuda(tmp_path, extra):
    """2 GRPO steps of the main job on the GPU (full weights, then LoRA: its KL reference is the
    policy with adapters off, on the same GPU), the weights moved, and `mmrl eval` on the GPU."""
    out = tmp_path / "run"
    invoke("train", "--max-steps", "2", "--output-dir", str(out), *SHORT, *extra,
           "--set", "rollout.max_new_tokens=16", "--set", "method.kl.beta=0.01")
    check_run(out)
    text = invoke("eval", "--checkpoint", str(out), "--set", "model.device=cuda", "--set", "task.num_eval=4")
    assert "accuracy" in text


def test_train_axpo_with_zoom_tool_rollouts_on_cuda(tmp_path):
    """configs/vlm/axpo.yaml (multi-turn zoom rollouts whose crops are re-processed into pixel
    rows on the GPU, resampled continuations) for 2 steps on the GPU."""
    out = tmp_path / "run"
    invoke("train", "--config", str(ROOT / "configs" / "vlm" / "axpo.yaml"), "--max-steps", "2",
           "--output-dir", str(out), *SHORT, "--set", "method.success=2.0")
    check_run(out)
    rows = read_metrics(out / "metrics.jsonl")
    assert any(r["rollout/tool_calls"] > 0 for r in rows)


def test_a_seeded_rollout_lives_on_the_gpu_and_matches_the_training_forward():
    """Every model tensor of a rollout batch (plain and tool) is on the GPU, group ids on the CPU,
    and the rollout's old log-probs equal the training forward's there."""
    for config in (None, ROOT / "configs" / "vlm" / "axpo.yaml"):
        cfg = load_config(backend.CONFIG_CLASS, config, ["model.device=cuda", "rollout.max_new_tokens=48"],
                          defaults=backend.DEFAULT_CONFIG)
        policy, task = backend.build(cfg)
        assert policy.device.type == "cuda"
        batch = policy.generate(task.train_prompts()[:2], 3, cfg.rollout, torch.Generator().manual_seed(0))
        assert batch.group_ids.device.type == "cpu"
        assert batch.mask.device.type == "cuda" and batch.old_logp.device.type == "cuda"
        assert {k: v.device.type for k, v in batch.data.items()} == {k: "cuda" for k in batch.data}
        with torch.no_grad():
            logp = policy.logprobs(batch)
        torch.testing.assert_close(logp[batch.mask], batch.old_logp[batch.mask], atol=2e-3, rtol=1e-3)
        ref = policy.reference()
        assert all(p.device.type == "cuda" for p in ref.model.parameters())
