"""The dLLM backend with model.device=cuda on a real GPU: short `dllm-rl train` runs of the
bundled tiny model (diffu-GRPO, SLIM-RL, ForkGRPO) whose parameters live on the GPU and move,
with finite metrics; `dllm-rl eval` of the checkpoint on the GPU (pass@k); `dllm-rl sample`
reproducible from its seed there. The CPU side of model.device is tests/dllm/test_dllm_device.py.

Skipped without CUDA.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

if not torch.cuda.is_available():
    pytest.skip("the dLLM CUDA tests need a CUDA GPU", allow_module_level=True)

from dllm_rl.cli import app

pytestmark = pytest.mark.gpu

# 4 prompts x 8 answers of 8 tokens (2 blocks of 4, 8 steps), the bundled model, on the GPU
SETS = ["model.device=cuda", "rollout.prompts_per_step=4", "rollout.num_generations=8", "rollout.temperature=1.0",
        "task.num_train=50", "task.num_eval=8", "rollout.gen_length=8", "rollout.block_length=4", "rollout.steps=8",
        "rollout.eval_batch_size=32", "logging.tensorboard=false", "logging.progress=false",
        "method.dynamic_sampling.enabled=false"]
METHODS = {
    "diffu_grpo": [],
    "slim_rl": ["method.type=slim_rl", "rollout.strategy=tau_budget", "method.accuracy_band=[0,1]"],
    "fork_grpo": ["method.type=fork_grpo", "rollout.strategy=fork", "rollout.temperature=1.5"],
}


def invoke(*args, sets=()):
    flags = [a for kv in (*SETS, *sets) for a in ("--set", kv)]
    r = CliRunner().invoke(app, [str(a) for a in (*args, *flags)])
    assert r.exit_code == 0, (r.output[-3000:], r.exception)
    return r


def finite_numbers(row: dict) -> bool:
    return all(math.isfinite(v) for v in row.values() if isinstance(v, float))


@pytest.mark.parametrize("method", list(METHODS))
def test_train_on_the_gpu_moves_every_parameter_there(method, dllm_builds, reward_spread, tmp_path):
    run = tmp_path / method
    invoke("train", "--max-steps", 2, "--output-dir", run, sets=METHODS[method])
    ((policy, start),) = dllm_builds
    params = dict(policy.model.named_parameters())
    assert {p.device.type for p in params.values()} == {"cuda"}
    assert next(policy.reference().model.parameters()).device.type == "cuda"  # a deepcopy stays there
    unchanged = [k for k, p in params.items() if p.requires_grad and torch.equal(p.detach().cpu(), start[k])]
    assert not unchanged, f"{method}: parameters that did not train: {unchanged[:5]}"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(finite_numbers(r) for r in rows)
    assert any(r.get("loss/grad_norm", 0) > 0 for r in rows)
    summary = json.loads((run / "summary.json").read_text())
    for key in ("eval_before", "eval_after"):
        assert finite_numbers(summary[key]) and 0 <= summary[key]["accuracy"] <= 1


def test_eval_of_a_checkpoint_on_the_gpu(dllm_builds, tmp_path):
    run = tmp_path / "run"
    invoke("train", "--max-steps", 1, "--output-dir", run)
    r = invoke("eval", "--checkpoint", run, sets=["rollout.eval_samples=4", f"output_dir={tmp_path / 'e'}"])
    (metrics,) = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    policy, _ = dllm_builds[-1]
    assert next(policy.model.parameters()).device.type == "cuda"
    assert finite_numbers(metrics) and 0 <= metrics["accuracy"] <= 1 and metrics["nfe"] == 8
    passes = [metrics[f"pass@{k}"] for k in range(1, 5)]
    assert passes == sorted(passes) and 0 <= passes[0] <= passes[-1] <= 1


def test_sample_on_the_gpu_is_reproducible_from_its_seed(tmp_path):
    args = ("sample", "--prompt", "12+3=", "--prompt", "7+8=", "--num", 4)
    runs = [invoke(*args, sets=[f"output_dir={tmp_path}"]).stdout for _ in range(2)]
    rows = [json.loads(line) for line in runs[0].splitlines() if line.startswith("{")]
    assert len(rows) == 8 and all("reward" in row for row in rows)
    assert runs[0] == runs[1]
