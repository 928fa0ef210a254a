"""Side by side on one machine: training steps of each backend's default run (the bundled tiny
model) with model.device=cpu and with model.device=cuda, in one process. The seconds per step
and their ratio are printed and appended to MMRL_BENCH_OUT as JSON lines
(benchmarks/gpu_check.sh prints them). The tiny models are small enough that a GPU may not
win: the figure is what only a GPU can show, and what it shows is recorded as measured.

Skipped without CUDA.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the device speed comparison needs a CUDA GPU", allow_module_level=True)

from mmrl.core.config import load_config
from mmrl.core.trainer import Trainer

pytestmark = pytest.mark.gpu

BACKENDS = {"vlm": "mmrl.vlm.backend", "dllm": "dllm_rl.backend", "diffusion": "diffusion_rl.backend"}
STEPS = 2  # timed, after one warm-up step (kernels, caches, allocator)


def seconds_per_step(module: str, device: str, out) -> float:
    b = importlib.import_module(module)
    cfg = load_config(b.CONFIG_CLASS, None, [f"model.device={device}", f"output_dir={out}", "logging.progress=false",
                                             "logging.tensorboard=false"], defaults=b.DEFAULT_CONFIG)
    policy, task = b.build(cfg)
    trainer = Trainer(cfg, policy, task)
    times = []
    for _ in range(1 + STEPS):
        t0 = time.perf_counter()
        metrics = trainer.train_step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        trainer.step += 1
        assert all(math.isfinite(v) for k, v in metrics.items() if k.startswith("loss/"))
    assert {p.device.type for p in policy.model.parameters()} == {device}
    return sum(times[1:]) / STEPS


@pytest.mark.parametrize("modality", list(BACKENDS))
def test_training_steps_on_cpu_and_gpu_side_by_side(modality, tmp_path):
    cpu = seconds_per_step(BACKENDS[modality], "cpu", tmp_path / "cpu")
    gpu = seconds_per_step(BACKENDS[modality], "cuda", tmp_path / "cuda")
    figures = {"test": "train_step_seconds", "backend": modality, "steps": STEPS, "cpu_threads": torch.get_num_threads(),
               "gpu": torch.cuda.get_device_name(0), "cpu_s": round(cpu, 3), "cuda_s": round(gpu, 3),
               "cpu_over_cuda": round(cpu / gpu, 2)}
    print(json.dumps(figures))
    if out := os.environ.get("MMRL_BENCH_OUT"):
        with open(out, "a") as f:
            f.write(json.dumps(figures) + "\n")
    assert cpu > 0 and gpu > 0
