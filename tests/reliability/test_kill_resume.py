"""kill -9 at named and at random moments of each modality's default run, then
`train --resume`: the resumed run ends bit-identical to an uninterrupted one (same final
weights, same metrics.jsonl apart from wall-clock timings), and whatever moment the kill
hit, the newest complete checkpoint is loadable and no half checkpoint is listed.

The runs are the real CLIs (`python -m mmrl|diffusion_rl|dllm_rl train`) in subprocesses,
killed for real: by mmrl.core.faults (MMRL_CRASH_AT=<point>:<step>, a SIGKILL from inside
at a chosen point) or by this test (os.kill after a seeded random delay). Each modality's
embedded DEFAULT_CONFIG on its bundled tiny model in assets/, shrunk to 4 steps with a
checkpoint after every step.

Cost (one thread): a run is ~10 s, mostly imports and evaluation, so all four crash points
run on the dLLM run (the fastest) and one point each on the VLM and diffusion runs. The full
runs, and each selected case's kill, snapshot and resume, are made up front two at a time
(one thread each); the random-moment kill runs alone.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from runcompare import comparable
from safetensors.torch import load_file

from mmrl.core import checkpoint as ckpt
from mmrl.core.config import load_config
from mmrl.core.logging import read_metrics

pytestmark = pytest.mark.slow  # 3 full runs + 7 killed-and-resumed ones: about 1 min on 2 cores

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
CRASH_STEP = 3
COMMON = ["logging.tensorboard=false", "logging.progress=false", "train.save_every=1",
          f"train.max_steps={STEPS}"]
MODALITIES = {
    # module of `python -m`, backend module, tiny settings (as tests/demo/conftest.py SETTINGS)
    "dllm": ("dllm_rl", "dllm_rl.backend", [
        "rollout.prompts_per_step=2", "rollout.num_generations=2", "task.num_train=8", "task.num_eval=4",
        # the tiny model scores most groups alike: keep them, so every step updates the weights
        "method.dynamic_sampling.enabled=false"]),
    "vlm": ("mmrl", "mmrl.vlm.backend", [
        "rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_new_tokens=16",
        "task.num_train=8", "task.num_eval=4"]),
    "diffusion": ("diffusion_rl", "diffusion_rl.backend", [
        "rollout.prompts_per_step=1", "rollout.num_generations=2", "rollout.num_steps=4",
        "rollout.window_size=2", "task.num_train=8", "task.num_eval=2", "task.grid_prompts=2"]),
}
ASSETS = {"dllm": "tiny-dllm", "vlm": "tiny-qwen2.5-vl", "diffusion": "tiny-flow"}
# Where each checkpoint-dir state lands after a crash at step 3 (save_every 1).
NEWEST_AFTER = {"rollout": 2, "update": 2, "checkpoint-write": 2, "after-checkpoint": 3}


def overrides(modality: str) -> list[str]:
    return COMMON + MODALITIES[modality][2]


def command(modality: str, out: Path, resume: bool = False) -> list[str]:
    sets = [a for kv in overrides(modality) for a in ("--set", kv)]
    return [sys.executable, "-m", MODALITIES[modality][0], "train", *sets, "--output-dir", str(out),
            *(["--resume"] if resume else [])]


def env(crash_at: str | None = None) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k != "MMRL_CRASH_AT"}
    e.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if crash_at:
        e["MMRL_CRASH_AT"] = crash_at
    return e


def run(modality: str, out: Path, resume: bool = False, crash_at: str | None = None):
    return subprocess.run(command(modality, out, resume), check=False, cwd=ROOT, env=env(crash_at),
                          capture_output=True, text=True, timeout=300)


def finished(proc) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]


def weight_files(model_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {str(f.relative_to(model_dir)): load_file(f) for f in sorted(model_dir.rglob("*.safetensors"))}


def assert_same_run(a: Path, b: Path) -> None:
    final = f"checkpoints/step-{STEPS:08d}/model"
    wa, wb = weight_files(a / final), weight_files(b / final)
    assert wa and set(wa) == set(wb)
    for name in wa:
        assert set(wa[name]) == set(wb[name]), name
        for k in wa[name]:
            assert torch.equal(wa[name][k], wb[name][k]), f"{name}:{k} differs after the resume"
    ra, rb = read_metrics(a / "metrics.jsonl"), read_metrics(b / "metrics.jsonl")
    assert [r["step"] for r in rb] == list(range(1, STEPS + 1))
    assert comparable(ra) == comparable(rb)
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert sa["eval_before"] == sb["eval_before"] and sa["eval_after"] == sb["eval_after"]


def assert_checkpoints_sound(modality: str, out: Path, policy) -> int:
    """Every listed checkpoint is complete; the newest loads (weights through the backend,
    trainer state through load_checkpoint). Returns the newest step."""
    root = out / "checkpoints"
    listed = ckpt.list_checkpoints(root)
    assert listed, f"no complete checkpoint in {root}"
    for step, d in listed:
        assert (d / ckpt.STATE_JSON).is_file() and (d / ckpt.STATE_TENSORS).is_file(), d
        assert any((d / "model").rglob("*.safetensors")), f"{d} has no weights"
    # anything else in the directory is a leftover of the kill, never a step-* directory
    others = [p.name for p in root.iterdir() if p not in {d for _, d in listed}]
    assert all(n.startswith((".tmp-", ".old-")) for n in others), others
    newest = ckpt.latest_checkpoint(root)
    tensors, state = ckpt.load_checkpoint(newest)
    assert state["step"] == listed[-1][0] and any(k.startswith("optim.") for k in tensors)
    policy.load_weights(newest / "model")
    return listed[-1][0]


_FULL: dict[str, Path] = {}
_POLICY: dict[str, object] = {}
_CRASHED: dict[tuple[str, str], tuple[subprocess.CompletedProcess, subprocess.CompletedProcess, Path]] = {}


def _check_full(modality: str, out: Path) -> None:
    # the comparison means something only if training moved the weights
    start = weight_files(ROOT / "assets" / ASSETS[modality])
    final = weight_files(out / f"checkpoints/step-{STEPS:08d}/model")
    moved = [f"{n}:{k}" for n in set(start) & set(final) for k in set(start[n]) & set(final[n])
             if not torch.equal(start[n][k], final[n][k])]
    assert moved, f"{modality}: {STEPS} steps left every weight as it was"


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The uninterrupted run of a modality (once per module)."""

    def get(modality: str) -> Path:
        if modality not in _FULL:
            out = tmp_path_factory.mktemp(f"full_{modality}") / "run"
            finished(run(modality, out))
            _check_full(modality, out)
            _FULL[modality] = out
        return _FULL[modality]

    return get


@pytest.fixture(scope="module")
def crashed_runs(request, tmp_path_factory):
    """For each selected case: the killed run, a copy of its directory as the kill left it, and
    the same directory after `--resume`; and the full runs they compare with. Made up front two
    at a time: each is a one-thread subprocess, so two share the two cores (about half the wall
    time of running them one by one)."""
    wanted = []
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if item.fspath == request.fspath and spec and "point" in spec.params:
            wanted.append((spec.params["modality"], spec.params["point"]))
    jobs = {("full", m): tmp_path_factory.mktemp(f"full_{m}") / "run"
            for m in dict.fromkeys(m for m, _ in wanted) if m not in _FULL}
    jobs.update({case: tmp_path_factory.mktemp(f"crash_{case[0]}_{case[1]}") / "run"
                 for case in wanted if case not in _CRASHED})

    def launch(key):
        if key[0] == "full":
            return run(key[1], jobs[key])
        out = jobs[key]
        crashed = run(key[0], out, crash_at=f"{key[1]}:{CRASH_STEP}")
        # the tests read the directory as the kill left it from this copy, then the resume
        shutil.copytree(out, out.with_name("killed"), symlinks=True)
        return crashed, run(key[0], out, resume=True)

    with ThreadPoolExecutor(max_workers=2) as pool:
        done = dict(zip(jobs, pool.map(launch, jobs)))
    for key, proc in done.items():
        if key[0] == "full":
            finished(proc)
            _check_full(key[1], jobs[key])
            _FULL[key[1]] = jobs[key]
        else:
            _CRASHED[key] = (*proc, jobs[key])
    return _CRASHED


def backend_policy(modality: str, out: Path):
    """The modality's policy, built as the CLI builds it (once), to load checkpoints into."""
    if modality not in _POLICY:
        import importlib

        backend = importlib.import_module(MODALITIES[modality][1])
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            cfg = load_config(backend.CONFIG_CLASS, None, [f"output_dir={out}", *overrides(modality)],
                              defaults=backend.DEFAULT_CONFIG)
            _POLICY[modality] = backend.build(cfg)[0]
        finally:
            torch.set_num_threads(n)
    return _POLICY[modality]


CASES = [("dllm", p) for p in NEWEST_AFTER] + [("vlm", "checkpoint-write"), ("diffusion", "update")]


@pytest.mark.parametrize(("modality", "point"), CASES, ids=[f"{m}-{p}" for m, p in CASES])
def test_kill_at_a_point_then_resume_is_bit_identical(modality, point, crashed_runs, full_run):
    full = full_run(modality)
    crashed, resumed, out = crashed_runs[(modality, point)]
    killed = out.with_name("killed")  # the directory as the kill left it
    assert crashed.returncode == -signal.SIGKILL, (crashed.returncode, crashed.stderr[-2000:])
    assert not (killed / "summary.json").exists()  # it really died mid-run
    newest = assert_checkpoints_sound(modality, killed, backend_policy(modality, killed))
    assert newest == NEWEST_AFTER[point]
    leftovers = [p.name for p in (killed / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    if point == "checkpoint-write":  # the half-written step 3 is a .tmp-* directory, never listed
        assert len(leftovers) == 1 and leftovers[0].startswith(f".tmp-step-{CRASH_STEP:08d}-"), leftovers
        assert (killed / "checkpoints" / leftovers[0] / "model").is_dir()
    else:
        assert leftovers == []

    finished(resumed)
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith((".tmp-", ".old-"))]
    assert_same_run(full, out)


def test_kill_at_a_random_moment_then_resume_is_bit_identical(full_run, tmp_path):
    """A kill -9 from outside, at a seeded random moment once training has begun (the first
    checkpoint exists): wherever it lands (rollout, update, a checkpoint or metrics write,
    the final evaluation), the newest checkpoint loads and --resume ends as the full run."""
    modality = "dllm"
    full = full_run(modality)
    out = tmp_path / "run"
    delay = random.Random(20240607).uniform(0.0, 1.5)
    proc = subprocess.Popen(command(modality, out), cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not ckpt.list_checkpoints(out / "checkpoints"):
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "the run wrote no checkpoint in time"
            time.sleep(0.02)
        time.sleep(delay)
        assert proc.poll() is None, "the run ended before the kill: shorten the delay"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    # The kill may also land after summary.json, while report.html is written or the process
    # exits: resuming must end as the full run wherever it landed.
    assert_checkpoints_sound(modality, out, backend_policy(modality, out))
    finished(run(modality, out, resume=True))
    assert_same_run(full, out)


def test_sigterm_from_outside_saves_the_step_it_came_in_then_resume_is_bit_identical(full_run, tmp_path):
    """A scheduler's SIGTERM (mmrl.core.stop) to a run that saves no checkpoint on its own
    (save_every 0), once its first step is logged: the run finishes the step it is in, saves it,
    and exits 143; --resume ends as the full run."""
    modality = "dllm"
    full = full_run(modality)
    out = tmp_path / "run"
    proc = subprocess.Popen([*command(modality, out), "--set", "train.save_every=0"], cwd=ROOT, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not read_metrics(out / "metrics.jsonl"):
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "the run logged no step in time"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        stderr = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, stderr[-2000:])
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < STEPS
    assert f"stopped by SIGTERM after step {len(steps)} of {STEPS}" in stderr and "Traceback" not in stderr
    assert [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")] == [len(steps)]
    assert not (out / "summary.json").exists()
    assert_checkpoints_sound(modality, out, backend_policy(modality, out))
    finished(run(modality, out, resume=True))
    assert_same_run(full, out)
