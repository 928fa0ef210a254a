"""The main job: `mmrl train` with no config runs the bundled tiny Qwen2.5-VL on shapes-qa."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from mmrl.cli import app
from mmrl.core.config import load_config
from mmrl.vlm import backend
from mmrl.vlm.models import bundled_model_dir


def test_bundled_model_is_middling_on_held_out_shapes_qa():
    """The committed checkpoint loads through from_pretrained and sits in the 30-60% band
    the pre-training script stops in (room for RL to show)."""
    assert (bundled_model_dir() / "model.safetensors").is_file()
    record = json.loads((bundled_model_dir() / "pretrain.json").read_text())
    assert record["final"]["accuracy"] >= 0.3
    cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG)
    policy, task = backend.build(cfg)
    metrics = task.evaluate(policy)
    assert 0.3 <= metrics["accuracy"] <= 0.6, metrics
    assert metrics["format"] > 0.9


def test_mmrl_train_default_end_to_end(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "train", "--max-steps", "2", "--output-dir", str(out), "--save-every", "1",
        "--set", "task.num_eval=16", "--set", "rollout.prompts_per_step=2", "--set", "rollout.num_generations=4",
    ])
    assert result.exit_code == 0, result.output
    assert "accuracy" in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and "accuracy" in summary["eval_after"]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and {"reward/answer", "rollout/length", "rollout/entropy"} <= set(rows[0])
    assert (out / "reward_curve.png").is_file()
    assert (out / "checkpoints" / "step-00000002" / "model" / "model.safetensors").is_file()
    # The checkpoint is a from_pretrained directory with its processor: eval loads it.
    result = CliRunner().invoke(app, ["eval", "--checkpoint", str(out), "--set", "task.num_eval=16"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["accuracy"] == summary["eval_after"]["accuracy"]


def test_mmrl_train_bad_key_and_missing_model(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["train", "--set", "model.min_pixel=3", "--output-dir", str(tmp_path)])
    assert result.exit_code == 2 and "model.min_pixel" in result.output
    result = runner.invoke(app, ["train", "--set", f"model.path={tmp_path / 'nope'}", "--output-dir", str(tmp_path)])
    assert result.exit_code == 2 and "not a directory" in result.output and "Traceback" not in result.output
