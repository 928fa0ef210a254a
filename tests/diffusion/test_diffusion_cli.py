"""`diffusion-rl` end to end on the bundled tiny flow model (assets/tiny-flow), shortened. The
commands run in this process (typer's CliRunner): a subprocess would spend most of its time on
imports. `python -m diffusion_rl` itself is run by tests/reliability/test_kill_resume.py and
tests/test_config.py's --help check."""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from diffusion_rl.cli import app

SHORT = ["--set", "rollout.num_steps=4", "--set", "rollout.window_size=2", "--set", "rollout.num_generations=2",
         "--set", "rollout.prompts_per_step=2", "--set", "task.num_eval=4", "--set", "task.grid_prompts=2",
         "--set", "logging.tensorboard=false"]


def run(*args):
    """`diffusion-rl *args`: its exit code, stdout and stderr (with the traceback of an exception
    the CLI let out, which exits 1)."""
    result = CliRunner().invoke(app, list(args))
    error = result.exception if result.exception and not isinstance(result.exception, SystemExit) else None
    trace = "".join(traceback.format_exception(error)) if error else ""
    return SimpleNamespace(returncode=result.exit_code, stdout=result.stdout, stderr=result.stderr + trace)


def test_train_writes_summary_grids_and_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "run"
    r = run("train", "--max-steps", "1", "--output-dir", str(out), *SHORT)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and 0 <= summary["eval_before"]["atom_accuracy"] <= 1
    assert {"exist", "colour", "count", "relation", "prompt_accuracy"} <= set(summary["eval_after"])
    for name in ("grid_before.png", "grid_after.png"):
        assert (out / "samples" / name).stat().st_size > 500
    assert (out / "reward_curve.png").is_file() and (out / "metrics.jsonl").is_file()
    r = run("sample", "--checkpoint", str(out), "--prompt", "a red circle", "--num", "2",
            "--set", f"output_dir={tmp_path / 'sampled'}", *SHORT)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2 and all(Path(row["image"]).stat().st_size > 100 for row in rows)
    assert {Path(row["image"]).parent for row in rows} == {tmp_path / "sampled" / "cli_samples" / "000"}
    assert {"exist[circle]", "colour[red circle]", "count[red circle]=1"} <= set(rows[0])
    again = run("sample", "--checkpoint", str(out), "--prompt", "a red circle", "--num", "1",
                "--set", f"output_dir={tmp_path / 'sampled'}", *SHORT)
    (row,) = [json.loads(line) for line in again.stdout.splitlines() if line.startswith("{")]
    assert Path(row["image"]).parent.name == "001" and Path(rows[0]["image"]).is_file()  # nothing overwritten


def test_eval_and_sample_score_the_configs_own_atoms(tmp_path):
    """An atom added by reward.atoms is scored in held-out evaluation and by `sample`, as in training."""
    (tmp_path / "atoms.py").write_text(
        "def bright(sample):\n    return sum(sample.completion.convert('L').tobytes()) / 255 / "
        "(sample.completion.width * sample.completion.height)\n")
    atom = ["--set", f'reward.atoms=["{tmp_path / "atoms.py"}:bright"]', "--set", f"output_dir={tmp_path / 'run'}"]
    r = run("eval", *SHORT, *atom)
    assert r.returncode == 0, r.stderr[-2000:]
    metrics = json.loads(r.stdout.strip().splitlines()[-1])
    assert 0.0 < metrics["bright"] <= 1.0 and metrics["reward"] > metrics["bright"] and "atom_accuracy" in metrics
    r = run("sample", *SHORT, *atom, "--num", "1", "--prompt", "a red circle")
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert 0.0 < row["bright"] <= 1.0 and "colour[red circle]" in row and row["reward"] >= row["bright"]


def test_sample_greedy_is_refused_before_the_model_is_built(tmp_path):
    r = run("sample", "--greedy", "--set", f"model.path={tmp_path / 'not-built'}")
    assert r.returncode == 3 and "no greedy decode" in r.stderr and "seed 0" in r.stderr


def test_bad_prompt_file_exits_2_naming_the_line(tmp_path):
    bad = tmp_path / "p.txt"
    bad.write_text("a red circle\nthree pink clouds\n")
    r = run("train", "--max-steps", "1", "--output-dir", str(tmp_path / "x"), "--set", f"task.train_path={bad}")
    assert r.returncode == 2
    assert "line 2" in r.stderr and "pink" in r.stderr and "Traceback" not in r.stderr


def test_a_prompt_file_with_a_byte_order_mark_reads_its_first_line(tmp_path):
    from diffusion_rl.backend import _prompt_file

    path = tmp_path / "p.txt"
    path.write_bytes("a red circle\ntwo blue squares\n".encode("utf-8-sig"))
    assert _prompt_file(str(path), None, "train_path") == ["a red circle", "two blue squares"]


def test_cps_noise_level_above_one_is_a_config_error():
    from diffusion_rl.config import DiffusionTrainConfig
    from mmrl.core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="noise_level must lie in \\[0, 1\\] for kind cps, got 1.5"):
        load_config(DiffusionTrainConfig, overrides=["rollout.kind=cps", "rollout.noise_level=1.5"])
