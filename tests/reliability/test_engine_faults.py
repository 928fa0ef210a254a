"""Rollout engines that die or hang, seen from the whole run (mmrl.core.pipeline): the run
stops with an EngineError naming the engine, the checkpoints written before are intact
(byte-identical) and loadable, and `--resume` with a healthy engine ends as a run that
never failed. Toy backend (tests/toy.py) on thread engines.

The scheduler's own fault handling is tested in tests/test_pipeline.py (re-dispatch to a
live engine, hang detection within the timeout, bad input not retried, every engine
failing) and tests/test_remote.py (HTTP errors, timeouts and a killed server process
become EngineErrors); this file adds what they do not: the run around it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import toy
from runcompare import assert_same_run
from typer.testing import CliRunner

from mmrl.core import checkpoint as ckpt
from mmrl.core.cli import BackendSpec, make_app
from mmrl.core.config import TrainConfig, load_config
from mmrl.core.engine import EngineError, PolicyEngine
from mmrl.core.logging import read_metrics
from mmrl.core.trainer import Trainer

ARGS = ("train.max_steps=4", "train.save_every=1", "train.keep_last=10", "rollout.scheduler.placement=thread",
        "rollout.scheduler.max_redispatch=0")
app = make_app(BackendSpec(modality="toy", title="toy", command="toy-rl", module="toy"))


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


class FaultyEngine(PolicyEngine):
    """A thread engine on the toy policy that, from its `at`-th generate call (0-based), raises
    (`mode="raise"`), hangs until released (`"hang"`), or fails to take weights (`"publish"`)."""

    def __init__(self, policy, mode: str, at: int, name: str = "faulty"):
        super().__init__(policy, own_weights=True, name=name)
        self.mode, self.at, self.calls, self.publishes = mode, at, 0, 0
        self.release = threading.Event()

    def generate(self, requests, rollout, seed):
        k, self.calls = self.calls, self.calls + 1
        if k >= self.at and self.mode == "raise":
            raise EngineError(f"engine {self.name}: CUDA error: an illegal memory access was encountered")
        if k >= self.at and self.mode == "hang":
            self.release.wait(30)
        return super().generate(requests, rollout, seed)

    def publish(self, weights, version):
        self.publishes += 1
        if self.mode == "publish" and version >= self.at:
            raise RuntimeError("NCCL timeout while receiving weights")
        super().publish(weights, version)


def config(out: Path, *overrides: str) -> TrainConfig:
    return load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[f"output_dir={out}", *ARGS, *overrides])


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


def remember_saves(trainer: Trainer) -> dict[int, dict[str, bytes]]:
    saved: dict[int, dict[str, bytes]] = {}
    save = trainer.save

    def save_and_remember():
        path = save()
        saved[trainer.step] = snapshot(path)
        return path

    trainer.save = save_and_remember
    return saved


CASES = {
    # the engine raises in step 3's rollout (each step is one call: 4 prompts x 8 in one batch)
    "raises": (("raise", 2), (), "engine faulty failed: engine faulty: CUDA error"),
    # the engine hangs in step 3, past rollout.scheduler.timeout
    "hangs": (("hang", 2), ("rollout.scheduler.timeout=0.5",), r"engine faulty did not answer within 0.5 s \(hung\)"),
    # the engine cannot take step 2's weights (published before step 3's rollout)
    "publish-fails": (("publish", 2), (), "engine faulty failed to take new weights: NCCL timeout"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_fault_stops_the_run_with_checkpoints_intact_then_resume(case, tmp_path):
    (mode, at), extra, message = CASES[case]
    full = Trainer(config(tmp_path / "full", *extra), toy.ToyPolicy(), toy.ToyTask(),
                   engines=[PolicyEngine(toy.ToyPolicy(), own_weights=True, name="thread")])
    full.train()

    out = tmp_path / "run"
    engine = FaultyEngine(toy.ToyPolicy(), mode, at)
    trainer = Trainer(config(out, *extra), toy.ToyPolicy(), toy.ToyTask(), engines=[engine])
    saved = remember_saves(trainer)
    t0 = time.perf_counter()
    try:
        with pytest.raises(EngineError, match=message):
            trainer.train()
    finally:
        engine.release.set()
    assert time.perf_counter() - t0 < 20  # a hang is cut at the timeout, not waited out
    assert trainer.step == 2  # it stopped in step 3

    root = out / "checkpoints"
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [1, 2]
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []
    for step in (1, 2):
        assert snapshot(ckpt.step_dir(root, step)) == saved[step], f"checkpoint {step} changed"
    _, state = ckpt.load_checkpoint(ckpt.step_dir(root, 2))
    assert state["step"] == 2
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]

    resumed = Trainer(config(out, *extra), toy.ToyPolicy(), toy.ToyTask(),
                      engines=[PolicyEngine(toy.ToyPolicy(), own_weights=True, name="thread")])
    resumed.train(resume=True)
    assert_same_run(full.policy, resumed.policy, tmp_path / "full", out)


def test_a_dying_engine_is_replaced_and_the_run_is_unchanged(tmp_path):
    """With a second engine (max_redispatch 2), the dying engine's calls go to the live one:
    the run finishes every step and every checkpoint."""
    cfg = config(tmp_path / "run", "rollout.scheduler.max_redispatch=2")
    dying = FaultyEngine(toy.ToyPolicy(), "raise", 1, name="dying")
    live = PolicyEngine(toy.ToyPolicy(), own_weights=True, name="live")
    trainer = Trainer(cfg, toy.ToyPolicy(), toy.ToyTask(), engines=[dying, live])
    trainer.train()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert sum(r.get("rollout/redispatched", 0) for r in rows) >= 1
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")] == [1, 2, 3, 4]
    assert not dying.release.is_set() and dying.calls >= 2  # it was called, and failed, in step 2


def test_cli_reports_a_dead_engine_in_one_paragraph(tmp_path, monkeypatch):
    generate = PolicyEngine.generate
    calls = {"n": 0}

    def dying(self, requests, rollout, seed):
        calls["n"] += 1
        if calls["n"] >= 3:
            raise EngineError(f"engine {self.name}: the server process exited (killed by signal 9)")
        return generate(self, requests, rollout, seed)

    monkeypatch.setattr(PolicyEngine, "generate", dying)
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "--output-dir", str(out), "--max-steps", "4", "--save-every", "1",
                                      "--set", "rollout.scheduler.placement=thread",
                                      "--set", "rollout.scheduler.max_redispatch=0"])
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    assert "error:" in text and "engine thread" in text and "killed by signal 9" in text
    assert [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")] == [1, 2]
