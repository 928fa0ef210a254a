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


def test_a_prompt_file_splits_at_line_ends_only_as_an_editor_does(tmp_path):
    # str.splitlines() also split at U+2028, U+0085 and a form feed (two prompts of one line), left a
    # byte-order mark of files joined with `cat` glued to a prompt, and numbered lone-CR lines wrong
    from diffusion_rl.backend import _prompt_file
    from mmrl.core.config import ConfigError

    path = tmp_path / "p.txt"
    path.write_bytes("a red circle\u2028two blue squares\r\ufeffa green triangle\n".encode())
    with pytest.warns(UserWarning, match="1 of 2 prompts cannot be decomposed"):  # one line, one prompt
        assert _prompt_file(str(path), None, "train_path", whole_prompt=["whole"]) == [
            "a red circle\u2028two blue squares", "a green triangle"]
    path.write_bytes(b"a red circle\r\ra blue square\r\xff\r")
    with pytest.raises(ConfigError, match=r"p.txt, line 4: not valid UTF-8"):
        _prompt_file(str(path), None, "train_path")


def test_cps_noise_level_above_one_is_a_config_error():
    from diffusion_rl.config import DiffusionTrainConfig
    from mmrl.core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="noise_level must lie in \\[0, 1\\] for kind cps, got 1.5"):
        load_config(DiffusionTrainConfig, overrides=["rollout.kind=cps", "rollout.noise_level=1.5"])


def test_a_prompt_file_skips_comments_and_blanks_and_names_a_bad_byte_by_its_line(tmp_path):
    """# comments and blank lines are not prompts; a file of nothing else is refused; a byte that
    is not UTF-8 is named with its line, counted from 1 (here line 3, after a blank line 2)."""
    from diffusion_rl.backend import _prompt_file
    from mmrl.core.config import ConfigError

    path = tmp_path / "p.txt"
    path.write_text("# my prompts\n\n  a red circle  \n#a blue square\n")
    assert _prompt_file(str(path), None, "train_path") == ["a red circle"]
    path.write_text("# nothing\n\n")
    with pytest.raises(ConfigError, match=r"task.eval_path: .*p.txt holds no prompts"):
        _prompt_file(str(path), None, "eval_path")
    path.write_bytes(b"a red circle\n\n\xff a blue square\n")
    with pytest.raises(ConfigError, match=r"p.txt, line 3: not valid UTF-8 \(byte 0xff\)"):
        _prompt_file(str(path), None, "train_path")
    assert _prompt_file(None, None, "train_path") is None


def test_whole_prompt_keeps_unparsed_lines_and_warns_once_naming_ten_of_them(tmp_path):
    """With whole-prompt atoms an undecomposable line is kept in its place, and one warning counts
    them against all prompts and names the first 10 by line, then how many more: 11 unparsed of 12
    prompts -> lines 2..11 named, "and 1 more"; exactly 10 -> all named, no "more"."""
    from diffusion_rl.backend import _prompt_file
    from mmrl.core.config import ConfigError

    path = tmp_path / "p.txt"
    lines = ["a red circle", *(f"a cat {i}" for i in range(11))]
    path.write_text("\n".join(lines) + "\n")
    with pytest.warns(UserWarning) as caught:
        assert _prompt_file(str(path), None, "train_path", ["clip_score"]) == lines
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "11 of 12 prompts cannot be decomposed" in text and "(clip_score)" in text
    assert all(f"line {n}: " in text for n in range(2, 12)) and "line 12:" not in text
    assert text.endswith("; and 1 more")
    path.write_text("\n".join(lines[:11]) + "\n")
    with pytest.warns(UserWarning) as caught:
        _prompt_file(str(path), None, "train_path", ["clip_score"])
    text = str(caught[0].message)
    assert "10 of 11 prompts" in text and "line 11: " in text and "more" not in text
    with pytest.raises(ConfigError, match=r"line 2 \('a cat 0'\).*task.unparsed=whole_prompt"):
        _prompt_file(str(path), None, "train_path")  # no whole-prompt atoms: refused


def test_an_image_atom_runs_on_the_models_device_unless_its_spec_names_one(tmp_path, monkeypatch):
    """build_task hands each task.image_atoms spec on with the model's device filled in where the
    spec names none; a spec's own device (a reward model on another card, say) is kept."""
    from diffusion_rl import backend, rewards
    from diffusion_rl.config import DiffusionTrainConfig
    from mmrl.core.config import load_config

    specs = []
    monkeypatch.setattr(rewards, "build_image_reward_atoms", lambda s, base_dir=None: specs.extend(s) or [])
    cfg = load_config(DiffusionTrainConfig, defaults=backend.DEFAULT_CONFIG, overrides=[
        f"output_dir={tmp_path}", "model.device=cpu", "task.num_train=4", "task.num_eval=2",
        "task.image_atoms=[{type: clip_score, device: cuda:1}, {type: clip_score}]"])
    backend.build_task(cfg)
    assert [s["device"] for s in specs] == ["cuda:1", "cpu"]


def test_whole_prompt_needs_an_image_atom_no_shapes_atom_gates(tmp_path, monkeypatch):
    """task.unparsed=whole_prompt scores an undecomposable prompt by the image atoms a shapes atom
    does not gate (a gated one scores it 0): when every image atom is gated, none is left, which is
    a ConfigError naming the fix."""
    from types import SimpleNamespace

    from diffusion_rl import backend, rewards
    from diffusion_rl.config import DiffusionTrainConfig
    from mmrl.core.config import ConfigError, load_config

    monkeypatch.setattr(rewards, "build_image_reward_atoms",
                        lambda specs, base_dir=None: [SimpleNamespace(name="clip_score", parents=("exist",))])
    cfg = load_config(DiffusionTrainConfig, defaults=backend.DEFAULT_CONFIG, overrides=[
        f"output_dir={tmp_path}", "task.num_train=4", "task.num_eval=2", "task.unparsed=whole_prompt",
        "task.image_atoms=[{type: clip_score, parents: [exist]}]"])
    with pytest.raises(ConfigError, match="every image atom is gated by a shapes atom.*add an ungated one"):
        backend.build_task(cfg)


def test_sample_draws_seeds_0_to_n_minus_1_of_the_first_two_held_out_prompts_into_a_new_folder(tmp_path):
    """No prompts given: the first two held-out prompts, each drawn with seeds 0..n-1 (ODE, at
    rollout.eval_steps), one PNG per draw named by its index and seed, in cli_samples/000 and, on
    the next call, 001 (a stray non-numbered folder does not count)."""
    from PIL import Image

    from diffusion_rl import backend

    calls = []

    def sample_images(texts, seeds, steps):
        calls.append((list(texts), list(seeds), steps))
        return [Image.new("RGB", (8, 8)) for _ in texts]

    policy = SimpleNamespace(sample_images=sample_images)
    task = SimpleNamespace(eval_prompts=["a red circle", "a blue square", "a green triangle"], other_atoms=list)
    cfg = SimpleNamespace(output_dir=str(tmp_path), rollout=SimpleNamespace(eval_steps=3, num_steps=10))
    (tmp_path / "cli_samples" / "notes").mkdir(parents=True)
    rows = backend.sample(cfg, policy, task, [], 2)
    assert calls == [(["a red circle", "a red circle", "a blue square", "a blue square"], [0, 1, 0, 1], 3)]
    assert [(r["prompt"], r["seed"]) for r in rows] == list(zip(calls[0][0], calls[0][1]))
    first = tmp_path / "cli_samples" / "000"
    assert [r["image"] for r in rows] == [str(first / n) for n in
                                          ("000_seed0.png", "001_seed1.png", "002_seed0.png", "003_seed1.png")]
    assert all(Path(r["image"]).is_file() for r in rows)
    rows = backend.sample(cfg, policy, task, ["a green triangle"], 1)
    assert [r["image"] for r in rows] == [str(tmp_path / "cli_samples" / "001" / "000_seed0.png")]
    assert calls[-1] == (["a green triangle"], [0], 3)


def test_resolve_settings_reports_the_calibrated_window_it_applies(tmp_path, monkeypatch, capsys):
    """A CAST run whose model carries a calibrated window says which steps it makes stochastic:
    window_start 3 and size 2 of 10 steps are steps 3..4 (the window's first and last step)."""
    from diffusion_rl import backend, calibrate
    from diffusion_rl.config import DiffusionTrainConfig
    from mmrl.core.config import load_config

    def apply_window_file(cfg, path):
        cfg.rollout.window_start, cfg.rollout.window_size = (3, 3), 2
        return "the model's cast_window.json"

    monkeypatch.setattr(calibrate, "apply_window_file", apply_window_file)
    model = tmp_path / "model"
    model.mkdir()
    cfg = load_config(DiffusionTrainConfig, defaults=backend.DEFAULT_CONFIG,
                      overrides=[f"output_dir={tmp_path / 'run'}", f"model.path={model}", "method.type=cast"])
    assert backend.resolve_settings(cfg) == model
    assert "CAST: SDE window steps 3..4 of 10, calibrated (the model's cast_window.json)" in capsys.readouterr().err
