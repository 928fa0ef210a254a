"""The vLLM engines with a real vLLM on CUDA (mmrl/vlm/vllm_engine.py), on the bundled tiny
Qwen2.5-VL: batch layout, engine vs trainer log-probs, publish, sleep / wake, and one short
rollout-throughput measurement against the transformers engine (PolicyEngine).

Skipped without vllm or CUDA. The test against a `vllm serve` server starts one (about a
minute more) and runs only with MMRL_TEST_VLLM_SERVER=1. MMRL_BENCH_OUT=<file> appends the
throughput figures there as JSON lines (benchmarks/gpu_check.sh prints them).
MMRL_VLLM_TEST_DTYPE (default float32, as the trainer) sets vLLM's dtype.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM engine tests need vllm (pip install 'mmrl[vllm]')")
if not torch.cuda.is_available():
    pytest.skip("the vLLM engine tests need a CUDA GPU", allow_module_level=True)

from mmrl.core.engine import PolicyEngine, Request, trainable_weights
from mmrl.vlm.config import VLMModelConfig, VLMTrainConfig
from mmrl.vlm.models import bundled_model_dir, load_vlm
from mmrl.vlm.policy import VLMPolicy
from mmrl.vlm.tasks.shapes_qa import ShapesQA
from mmrl.vlm.vllm_engine import VLLMEngine, VLLMServerEngine

pytestmark = pytest.mark.gpu

ITEMS = ShapesQA(seed=0, num_train=16, num_eval=4).train_items()
DTYPE = os.environ.get("MMRL_VLLM_TEST_DTYPE", "float32")
# mean |trainer - engine| per token we accept: kernels only (fp32), or bf16 rounding too
TOLERANCE = 0.02 if DTYPE == "float32" else 0.15


def rollout(**kw):
    return VLMTrainConfig().rollout.model_copy(update={"max_new_tokens": 24, "temperature": 1.0, **kw})


@pytest.fixture(scope="module")
def policy() -> VLMPolicy:
    mcfg = VLMModelConfig()  # the bundled tiny Qwen2.5-VL, float32
    model, processor = load_vlm(mcfg)
    return VLMPolicy(model.to("cuda"), processor, min_pixels=mcfg.min_pixels, max_pixels=mcfg.max_pixels)


@pytest.fixture(scope="module")
def engine(policy):
    # own_weights=False: the trainer-side recompute uses the live model, so the test can see
    # the engine lag the trainer until publish
    e = VLLMEngine(policy, bundled_model_dir(), gpu_memory_utilization=0.2, dtype=DTYPE, seed=0,
                   own_weights=False, enforce_eager=True)
    yield e
    e.close()


def requests(k: int, n: int) -> list[Request]:
    return [Request(group=i, prompt=ITEMS[i], n=n) for i in range(k)]


def record(**figures) -> None:
    print(json.dumps(figures))
    if out := os.environ.get("MMRL_BENCH_OUT"):
        with open(out, "a") as f:
            f.write(json.dumps(figures) + "\n")


def test_generate_gives_a_policy_layout_batch(engine, policy):
    batch = engine.generate(requests(2, 4), rollout(), seed=0)
    n, t = batch.mask.shape
    assert n == 8 and batch.group_ids.tolist() == [0] * 4 + [1] * 4
    assert t <= 24 and batch.data["completion_ids"].shape == (8, t)
    assert batch.data["prompt_ids"].shape == batch.data["prompt_mask"].shape
    assert batch.data["pixel_values"].shape[0] == 8 and batch.data["image_grid_thw"].shape == (8, 1, 3)
    assert batch.mask.any(-1).all()
    assert torch.isfinite(batch.old_logp).all() and (batch.old_logp[batch.mask] <= 0).all()
    generated = batch.data["completion_ids"][batch.mask]
    assert not any(int(x) in policy.banned_ids for x in generated)
    assert len({s.completion for s in batch.samples}) > 1  # sampled, not greedy
    # the trainer's recompute and vLLM's own numbers describe the same distribution
    diff = batch.data["stat/engine_logp_diff"]
    record(test="engine_vs_trainer_logp", dtype=DTYPE, mean_abs_diff=float(diff.mean()),
           max_abs_diff=float((batch.old_logp - batch.data["engine_logp"]).abs().max()))
    assert float(diff.mean()) < TOLERANCE


def test_sleep_frees_memory_and_wakes_to_the_same_samples(engine):
    assert engine.sleep and engine._asleep  # asleep between calls
    engine._wake()
    free_awake = torch.cuda.mem_get_info()[0]
    engine._sleep()
    free_asleep = torch.cuda.mem_get_info()[0]
    assert free_asleep - free_awake > 2**30  # the KV cache (and weights) left the GPU
    a = engine.generate(requests(2, 4), rollout(), seed=3)
    b = engine.generate(requests(2, 4), rollout(), seed=3)
    same = [x.completion == y.completion for x, y in zip(a.samples, b.samples)]
    assert sum(same) >= 6, same  # per-request seeds: the same samples after sleep and wake


def test_publish_moves_the_engine_to_the_trainers_weights(engine, policy):
    before = engine.generate(requests(2, 4), rollout(), seed=1)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in policy.model.parameters():
            scale = p.std().clamp(min=1e-3) if p.numel() > 1 else p.new_tensor(0.05)
            p.add_(torch.randn(p.shape, generator=g, device=p.device) * scale * 0.5)
    lagging = engine.generate(requests(2, 4), rollout(), seed=1)  # engine: old weights, trainer: new
    engine.publish(trainable_weights(policy.model), 1)
    after = engine.generate(requests(2, 4), rollout(), seed=1)
    lag, now = float(lagging.data["stat/engine_logp_diff"].mean()), float(after.data["stat/engine_logp_diff"].mean())
    record(test="publish", mismatch_before_publish=lag, mismatch_after_publish=now)
    assert now < TOLERANCE and lag > 5 * now
    assert engine.version == 1 and after.policy_version == 1
    assert [s.completion for s in after.samples] != [s.completion for s in before.samples]


def test_rollout_throughput_vs_policy_engine(engine, policy):
    """Samples per second for 8 prompts x 8 samples, 24 new tokens: vLLM (with the trainer-side
    old log-prob recompute included) vs transformers' generate (PolicyEngine)."""
    reqs, cfg = requests(8, 8), rollout()
    hf = PolicyEngine(VLMPolicy(policy.model, policy.processor, min_pixels=policy.min_pixels,
                                 max_pixels=policy.max_pixels), own_weights=False, name="hf")
    figures = {}
    for name, e in (("vllm", engine), ("hf", hf)):
        e.generate(reqs[:2], cfg, seed=0)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for seed in range(2):
            batch = e.generate(reqs, cfg, seed=seed)
        torch.cuda.synchronize()
        figures[name] = 2 * len(batch) / (time.perf_counter() - t0)
    record(test="rollout_throughput", samples=64, max_new_tokens=24,
           vllm_samples_per_s=round(figures["vllm"], 1), hf_samples_per_s=round(figures["hf"], 1),
           speedup=round(figures["vllm"] / figures["hf"], 2))
    assert figures["vllm"] > 0 and figures["hf"] > 0


@pytest.mark.skipif(os.environ.get("MMRL_TEST_VLLM_SERVER") != "1",
                    reason="starts a vllm server (about a minute); set MMRL_TEST_VLLM_SERVER=1")
def test_server_engine_against_vllm_serve(policy, tmp_path):
    exe = shutil.which("vllm", path=str(Path(sys.executable).parent)) or shutil.which("vllm")
    if exe is None:
        pytest.skip("no `vllm` command next to this Python")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 -- closed below
    proc = subprocess.Popen(
        [exe, "serve", str(bundled_model_dir()), "--port", str(port), "--gpu-memory-utilization", "0.15",
         "--enforce-eager", "--dtype", DTYPE, "--logprobs-mode", "processed_logprobs"],
        env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"}, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("vllm serve did not start:\n" + (tmp_path / "server.log").read_text()[-3000:])
                time.sleep(2)
        engine = VLLMServerEngine(url, policy, timeout=120, own_weights=False, weights_dir=tmp_path / "w")
        batch = engine.generate(requests(2, 4), rollout(), seed=0)
        assert len(batch) == 8 and batch.mask.any(-1).all() and torch.isfinite(batch.old_logp).all()
        first = float(batch.data["stat/engine_logp_diff"].mean())
        # the policy's weights were perturbed by the publish test: the server must catch up
        engine.publish(trainable_weights(policy.model), 2)
        after = engine.generate(requests(2, 4), rollout(), seed=0)
        now = float(after.data["stat/engine_logp_diff"].mean())
        record(test="server", mismatch_before_publish=first, mismatch_after_publish=now)
        assert now < TOLERANCE
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
