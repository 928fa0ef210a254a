"""A checkpoint write that fails (disk full, permission denied) on the toy backend
(tests/toy.py): a clear error naming the checkpoint and the cause, the previous
checkpoint byte-identical and loadable, no `.tmp-*` left, and `--resume` afterwards
continuing to the same end as a run that never failed.

We run as root, so chmod cannot make a write fail: the writers used inside
save_checkpoint are replaced by ones that raise the OS's error once, at step 3.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
import toy
from runcompare import assert_same_run
from safetensors import SafetensorError
from typer.testing import CliRunner

from mmrl.core import checkpoint as ckpt
from mmrl.core.cli import BackendSpec, make_app
from mmrl.core.config import TrainConfig, load_config
from mmrl.core.logging import read_metrics
from mmrl.core.trainer import Trainer

ARGS = ("train.max_steps=4", "train.save_every=1", "train.keep_last=2")
app = make_app(BackendSpec(modality="toy", title="toy", command="toy-rl", module="toy"))


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def make(out: Path, *overrides: str) -> Trainer:
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[f"output_dir={out}", *ARGS, *overrides])
    return Trainer(cfg, *toy.build(cfg))


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


def failing_once(original, error: BaseException, at: str):
    """`original`, except that the call writing into checkpoint `at` raises `error`."""

    def writer(*args, **kwargs):
        if any(at in str(a) for a in args):
            raise error
        return original(*args, **kwargs)

    return writer


FAULTS = {
    # the model's own save_pretrained runs out of space (the biggest file: the likeliest to fail)
    "disk-full-model": ("policy", OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
    # the trainer state's safetensors file may not be created
    "permission-denied-state": ("save_file", PermissionError(errno.EACCES, "Permission denied"), "Permission denied"),
    # safetensors' own error for a full disk (it raises SafetensorError, not OSError)
    "disk-full-safetensors": ("save_file", SafetensorError(
        "Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space left on device\" })"),
        "No space left on device"),
}


def inject(monkeypatch, trainer: Trainer | None, where: str, error: BaseException) -> None:
    at = ".tmp-step-00000003-"
    if where == "policy":
        if trainer is not None:
            monkeypatch.setattr(trainer.policy, "save_pretrained", failing_once(trainer.policy.save_pretrained, error, at))
        else:
            monkeypatch.setattr(toy.ToyPolicy, "save_pretrained", failing_once(toy.ToyPolicy.save_pretrained, error, at))
    else:
        monkeypatch.setattr(ckpt, "save_file", failing_once(ckpt.save_file, error, at))


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_failed_write_keeps_the_previous_checkpoint_and_resume_recovers(fault, tmp_path, monkeypatch):
    where, error, cause = FAULTS[fault]
    full = make(tmp_path / "full")
    full.train()

    out = tmp_path / "run"
    trainer = make(out)
    inject(monkeypatch, trainer, where, error)
    seen: dict[str, bytes] = {}
    save = trainer.save

    def save_and_remember():  # the bytes of step 2 as written, before step 3's write fails
        path = save()
        if trainer.step == 2:
            seen.update(snapshot(path))
        return path

    trainer.save = save_and_remember
    with pytest.raises(ckpt.CheckpointError) as info:
        trainer.train()
    message = str(info.value)
    step3 = out / "checkpoints" / "step-00000003"
    assert str(step3) in message and cause in message and "previous checkpoint is intact" in message

    root = out / "checkpoints"
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [1, 2]
    assert not step3.exists()
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000002"]  # no .tmp-* left
    assert seen and snapshot(root / "step-00000002") == seen  # byte-identical to what step 2 wrote
    tensors, state = ckpt.load_checkpoint(root / "step-00000002")
    assert state["step"] == 2 and any(k.startswith("optim.") for k in tensors)
    loaded = toy.ToyPolicy(seed=123)
    loaded.load_weights(root / "step-00000002" / "model")
    assert not torch.equal(loaded.model.lm_head.weight, toy.ToyPolicy(seed=123).model.lm_head.weight)

    monkeypatch.undo()  # the disk has room again
    resumed = make(out)
    resumed.train(resume=True)
    assert_same_run(full.policy, resumed.policy, tmp_path / "full", out)


@pytest.mark.parametrize("fault", ["disk-full-model", "permission-denied-state"])
def test_cli_reports_a_failed_write_in_one_paragraph(fault, tmp_path, monkeypatch):
    where, error, cause = FAULTS[fault]
    out = tmp_path / "run"
    inject(monkeypatch, None, where, error)
    result = CliRunner().invoke(app, ["train", "--output-dir", str(out), "--max-steps", "4", "--save-every", "1"])
    text = " ".join(result.output.split())  # rich may wrap the paragraph
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    assert "error:" in text and "step-00000003" in text and cause in text
    root = out / "checkpoints"
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [1, 2]
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []  # no .tmp-* left
    assert ckpt.load_checkpoint(root / "step-00000002")[1]["step"] == 2

    monkeypatch.undo()
    result = CliRunner().invoke(app, ["train", "--output-dir", str(out), "--max-steps", "4", "--save-every", "1",
                                      "--resume"])
    assert result.exit_code == 0, result.output
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [3, 4]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]


def test_failed_resave_of_an_existing_step_keeps_the_old_copy(tmp_path, monkeypatch):
    """Re-saving a step that exists (a resume that re-reaches it) swaps directories: if the
    new copy cannot be renamed into place, the old one is put back, byte-identical."""
    root = tmp_path / "ckpts"
    t = {"x": torch.arange(4.0)}
    first = ckpt.save_checkpoint(root, 5, lambda p: p.mkdir(), t, {"v": 1})
    before = snapshot(first)
    real_replace = ckpt.os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".tmp-"):
            raise OSError(errno.EACCES, "Permission denied")
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", replace)
    with pytest.raises(ckpt.CheckpointError, match="step-00000005: Permission denied"):
        ckpt.save_checkpoint(root, 5, lambda p: p.mkdir(), {"x": torch.zeros(4)}, {"v": 2})
    monkeypatch.undo()
    assert snapshot(first) == before
    assert sorted(p.name for p in root.iterdir()) == ["step-00000005"]
    assert ckpt.load_checkpoint(first)[1] == {"v": 1}
