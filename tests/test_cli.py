"""The shared CLI (mmrl.core.cli) end to end on the toy backend, in process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mmrl.core.checkpoint import STATE_JSON
from mmrl.core.cli import BackendSpec, make_app, resolve_checkpoint

runner = CliRunner()
app = make_app(BackendSpec(modality="toy", title="toy", command="toy-rl", module="toy"))
missing = make_app(BackendSpec(modality="vlm", title="vision-language", command="mmrl", module="mmrl.vlm.nope"))


def invoke(application, *args):
    result = runner.invoke(application, list(args))
    return result.exit_code, result.output


def test_train_resume_eval_sample(tmp_path):
    out = tmp_path / "[red]run"  # not rich markup
    result = runner.invoke(app, ["train", "--max-steps", "2", "--output-dir", str(out), "--seed", "3"],
                           env={"COLUMNS": "40"})
    code, text = result.exit_code, result.output
    assert code == 0, text
    # the lines that name paths are whole on a narrow console (and in a log file: 80 columns)
    assert f"toy-rl train: method grpo, output {out}" in text.splitlines()
    assert f"wrote {out}/summary.json; checkpoint {out}/checkpoints/step-00000002/model" in text.splitlines()
    # and where to look next, with commands that work as printed (the path quoted for a shell)
    q = f"'{out}'"
    assert (f"see {out}/report.html (curves, samples, config) or `toy-rl runs {q}`; next: `toy-rl sample "
            f"--checkpoint {q}`, `toy-rl eval --checkpoint {q}`, `toy-rl export --checkpoint {q} -o DIR`"
            in text.splitlines())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["config"]["seed"] == 3
    assert "accuracy" in text  # the before/after table

    code, text = invoke(app, "train", "--max-steps", "2", "--output-dir", str(out))
    assert code == 2 and "--resume" in text and "Traceback" not in text  # a user error

    first = json.loads((out / "summary.json").read_text())
    code, text = invoke(app, "train", "--max-steps", "3", "--output-dir", str(out), "--seed", "3", "--resume")
    assert code == 0, text
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    # the finished run's summary, its step-2 evaluation included, is kept beside the new one
    assert json.loads((out / "summary.step-2.json").read_text()) == first

    after = json.loads((out / "summary.json").read_text())["eval_after"]
    code, text = invoke(app, "eval", "--checkpoint", str(out), "--set", "seed=3")
    assert code == 0, text
    assert json.loads(text.strip().splitlines()[-1]) == after  # the newest checkpoint, same metrics

    code, text = invoke(app, "sample", "--checkpoint", str(out), "--prompt", "4", "--num", "2")
    assert code == 0, text
    rows = [json.loads(line) for line in text.strip().splitlines() if line.startswith("{")]  # not the settings line
    assert len(rows) == 2 and all(r["prompt"] == 4 and len(r["completion"]) == 2 for r in rows)
    assert all(set(r) >= {"answer", "stop"} for r in rows)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--set", "optim.lrr=1"], "optim.lrr"),
        (["--set", "rollout.temperature=0"], "rollout.temperature"),
        (["--config", "nowhere.yaml"], "nowhere.yaml"),
        (["--set", "seed"], "key.path=value"),
    ],
)
def test_user_errors_exit_non_zero_without_traceback(tmp_path, args, needle):
    code, text = invoke(app, "train", "--output-dir", str(tmp_path / "x"), *args)
    assert code == 2, text
    assert needle in text and "Traceback" not in text


def test_missing_backend_says_so_after_validating_the_config():
    code, text = invoke(missing, "train")
    assert code == 3 and "not available yet" in text
    code, text = invoke(missing, "train", "--set", "method.loss.clip_hi=1")
    assert code == 2 and "method.loss.clip_hi" in text


def test_resolve_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError):
        resolve_checkpoint(tmp_path / "nope")
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(Exception, match="no complete checkpoint"):
        resolve_checkpoint(tmp_path)
    step = tmp_path / "checkpoints" / "step-00000003"
    (step / "model").mkdir(parents=True)
    (step / STATE_JSON).write_text("{}")  # what makes it complete
    # the run, its checkpoints/ directory and the checkpoint all lead to the model
    for path in (tmp_path, tmp_path / "checkpoints", step):
        assert resolve_checkpoint(path) == step / "model"


@pytest.mark.parametrize("verb", [["eval"], ["sample"], ["serve", "--port", "0"], ["export", "--out", "exported"],
                                  ["config"]])
def test_a_checkpoint_that_is_not_there_is_named_before_the_model_is_built(tmp_path, monkeypatch, verb):
    # loading a large model takes minutes: the error must not wait for it
    import toy

    def built(cfg):
        raise AssertionError("the model was built")

    monkeypatch.setattr(toy, "build", built)
    monkeypatch.chdir(tmp_path)
    code, text = invoke(app, *verb, "--checkpoint", "run/nope")
    assert code == 2 and "checkpoint run/nope does not exist" in text and "Traceback" not in text, text
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)  # a run that has saved nothing yet
    code, text = invoke(app, *verb, "--checkpoint", "run")
    if verb == ["config"]:  # its settings are what is asked for: the default config, as there is no config.yaml
        assert code == 0 and "seed:" in text, text
    else:
        assert code == 2 and "run holds no complete checkpoint" in text, text


def test_the_libraries_progress_bars_follow_logging_progress_and_the_terminal(monkeypatch):
    # transformers' "Loading weights" and "Writing model shards" bars filled a cluster job's log
    import diffusers.utils.logging as diffusers_log
    import transformers.utils.logging as transformers_log

    from mmrl.core.logging import quiet_library_bars

    transformers_log.enable_progress_bar()  # as a fresh process has them (earlier CLI tests turned them off)
    diffusers_log.enable_progress_bar()
    try:
        monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
        assert not quiet_library_bars(True, diffusers=True)  # a terminal, and progress on: bars stay
        assert transformers_log.is_progress_bar_enabled() and diffusers_log.is_progress_bar_enabled()
        assert quiet_library_bars(False)
        assert not transformers_log.is_progress_bar_enabled() and diffusers_log.is_progress_bar_enabled()
        assert quiet_library_bars(False, diffusers=True) and not diffusers_log.is_progress_bar_enabled()
        transformers_log.enable_progress_bar()
        code, text = invoke(app, "config", "--keys", "seed")  # builds nothing: transformers is not even imported for it
        assert code == 0 and transformers_log.is_progress_bar_enabled(), text
        code, text = invoke(app, "eval")  # the CLI before it loads a model, its output not a terminal
        assert code == 0 and not transformers_log.is_progress_bar_enabled(), text
    finally:
        transformers_log.enable_progress_bar()
        diffusers_log.enable_progress_bar()


def test_ctrl_c_says_what_is_kept_and_exits_130(tmp_path, monkeypatch):
    """Click's own handler would exit 130 without a word; the CLI names the checkpoint to resume
    and the command that resumes it, or says there is none. It said "the newest complete
    checkpoint is kept (resume with --resume)" also where the run had saved none (the default
    saves only at the end), and `--resume` without -o resumes the default output directory."""
    import toy

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(toy, "build", interrupted)
    run = tmp_path / "my run"  # a run stopped after its step-1 checkpoint
    (run / "checkpoints" / "step-00000001").mkdir(parents=True)
    (run / "checkpoints" / "step-00000001" / STATE_JSON).write_text("{}")
    (run / "config.yaml").write_text("seed: 0\n")
    code, text = invoke(app, "train", "--output-dir", str(run), "--resume")
    assert code == 130, text
    assert f"{run}/checkpoints/step-00000001, is kept: resume with `toy-rl train -o '{run}' --resume`" in text
    # before any checkpoint: nothing to resume, and why (save_every 0 saves only at the end)
    code, text = invoke(app, "train", "--output-dir", str(tmp_path / "new"))
    assert code == 130 and "nothing to resume" in text and "--save-every" in text and "--resume`" not in text
    code, text = invoke(app, "train", "--output-dir", str(tmp_path / "new"), "--save-every", "5")
    assert code == 130 and "nothing to resume" in text and "--save-every" not in text
    code, text = invoke(app, "eval")
    assert code == 130 and text.strip() == "interrupted"


def test_another_ranks_failure_is_an_error_line(monkeypatch):
    """A RankError (another data-parallel rank failed; that rank reports its own error) exits 1 with
    an error line, not a traceback."""
    import toy

    from mmrl.core.distributed import RankError

    def other_rank_failed(cfg):
        raise RankError("data-parallel rank 1 failed: RewardError: atom 'bad'")

    monkeypatch.setattr(toy, "build", other_rank_failed)
    code, text = invoke(app, "eval")
    assert code == 1 and text.strip() == "error: data-parallel rank 1 failed: RewardError: atom 'bad'", text


def test_a_world_size_set_by_hand_is_named_before_the_model_is_built(tmp_path, monkeypatch):
    """WORLD_SIZE exported without a launcher's RANK and MASTER_ADDR exits 2 naming it."""
    import toy

    def built(cfg):
        raise AssertionError("the model was built")

    monkeypatch.setattr(toy, "build", built)
    for name in ("RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, text = invoke(app, "train", "--output-dir", str(tmp_path / "run"))
    assert code == 2 and "error: the environment's WORLD_SIZE=2 asks for 2 processes" in text, text


def test_only_the_launchs_main_rank_prints_the_train_header(tmp_path, monkeypatch):
    """Under torchrun, before the Trainer joins the group, every rank printed the "train: method ..."
    line (and eval's "settings:" line): now only RANK 0 of WORLD_SIZE 2 does; one process always."""
    import toy

    from mmrl.core.distributed import RankError

    def stop(cfg):  # the header is printed before the model is built
        raise RankError("stop here")

    monkeypatch.setattr(toy, "build", stop)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    for world, rank, printed in (("2", "1", False), ("2", "0", True), ("1", "1", True)):
        monkeypatch.setenv("WORLD_SIZE", world)
        monkeypatch.setenv("RANK", rank)
        code, text = invoke(app, "train", "--output-dir", str(tmp_path / "run"))
        assert code == 1 and ("toy-rl train: method" in text) == printed, (world, rank, text)


def test_resume_and_eval_take_the_runs_own_settings(tmp_path, recwarn):
    """`train --resume -o RUN` continues the run as configured, and `eval --checkpoint RUN` uses
    the run's config.yaml, without repeating a flag; --set still overrides it."""
    out = tmp_path / "run"
    code, text = invoke(app, "train", "--max-steps", "2", "-o", str(out), "--seed", "3", "--set", "optim.lr=0.005",
                        "--set", "rollout.num_generations=4")
    assert code == 0, text
    code, text = invoke(app, "train", "--max-steps", "3", "-o", str(out), "--resume")
    assert code == 0, text
    assert not [w for w in recwarn if "differ from the run's" in str(w.message)]  # nothing changed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["config"]["seed"] == 3 and summary["config"]["optim"]["lr"] == 0.005
    code, text = invoke(app, "eval", "--checkpoint", str(out / "checkpoints"))
    assert code == 0 and f"the run's {out / 'config.yaml'}" in text
    assert json.loads(text.strip().splitlines()[-1]) == summary["eval_after"]
    code, text = invoke(app, "config", "--checkpoint", str(out), "--keys", "optim")
    assert code == 0 and "\n  lr: 0.005\n" in text  # the run's settings, as eval reads them
    (out / "config.yaml").write_text((out / "config.yaml").read_text() + "bogus: 1\n")  # e.g. an older version's key
    code, text = invoke(app, "train", "--max-steps", "4", "-o", str(out), "--resume")
    assert code == 2 and "'bogus'" in text and f"come from {out / 'config.yaml'}" in text


def test_auto_resume_takes_the_runs_own_settings_as_resume_does(tmp_path):
    """--auto-resume where a checkpoint is: as --resume, the run's config.yaml is the base, so a
    requeued job's shorter command (or a changed default) does not change the run's settings."""
    out = tmp_path / "run"
    code, text = invoke(app, "train", "--max-steps", "1", "-o", str(out), "--seed", "3", "--set", "optim.lr=0.005")
    assert code == 0, text
    code, text = invoke(app, "train", "--max-steps", "2", "-o", str(out), "--auto-resume")
    assert code == 0 and "resuming at step 1" in text, text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["config"]["seed"] == 3 and summary["config"]["optim"]["lr"] == 0.005


def test_auto_resume_takes_an_override_of_a_key_only_the_runs_own_variant_has(tmp_path):
    """As --resume does: the output directory is found from -o alone, so a --set naming a key of
    the run's multi_stream advantage (not of the default group one) is not refused before it."""
    out = tmp_path / "run"
    code, text = invoke(app, "train", "--max-steps", "1", "-o", str(out), "--set", "method.advantage.type=multi_stream")
    assert code == 0, text
    code, text = invoke(app, "train", "--max-steps", "2", "-o", str(out), "--auto-resume",
                        "--set", "method.advantage.mode=sum_then_normalize")
    assert code == 0 and "resuming at step 1" in text, text
    advantage = json.loads((out / "summary.json").read_text())["config"]["method"]["advantage"]
    assert advantage["type"] == "multi_stream" and advantage["mode"] == "sum_then_normalize"


def test_a_runs_config_yaml_holds_absolute_paths(tmp_path, monkeypatch):
    from mmrl.core.runconfig import absolute_paths

    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "atoms.py").write_text("")
    (tmp_path / "data.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    data = {"reward": {"atoms": ["atoms.py:short", {"path": "atoms.py:long", "weight": 2}]},
            "task": {"train_path": "data.jsonl", "type": "shapes-qa"}, "tools": ["zoom", "nope.py:f"], "lr": 0.1}
    fixed = absolute_paths(data, tmp_path / "cfg")  # the config file's directory first, then the working one
    atom = str((tmp_path / "cfg" / "atoms.py").resolve())
    assert fixed["reward"]["atoms"] == [atom + ":short", {"path": atom + ":long", "weight": 2}]
    assert fixed["task"] == {"train_path": str((tmp_path / "data.jsonl").resolve()), "type": "shapes-qa"}
    assert fixed["tools"] == ["zoom", "nope.py:f"] and fixed["lr"] == 0.1  # names and missing files stay


def test_overrides_on_resume_and_eval_may_name_the_runs_own_variant_keys(tmp_path):
    """--set was checked against the default config before the run's config.yaml was used, so a
    key only the run's variant has (here multi_stream's mode) was refused as unknown."""
    out = tmp_path / "run"
    code, text = invoke(app, "train", "--max-steps", "1", "-o", str(out), "-s", "method.advantage.type=multi_stream")
    assert code == 0, text
    mode = "method.advantage.mode=sum_then_normalize"
    code, text = invoke(app, "train", "--max-steps", "2", "-o", str(out), "--resume", "-s", mode)
    assert code == 0, text
    assert json.loads((out / "summary.json").read_text())["config"]["method"]["advantage"]["mode"] == "sum_then_normalize"
    code, text = invoke(app, "eval", "--checkpoint", str(out), "-s", mode)
    assert code == 0, text
    code, text = invoke(app, "train", "--max-steps", "2", "-o", str(tmp_path / "fresh"), "-s", mode)
    assert code == 2 and "unknown key" in text  # without a run to resume, the default config's keys


def test_user_errors_of_a_resume_and_an_output_file_exit_2_in_one_line(tmp_path):
    out = tmp_path / "run"
    assert invoke(app, "train", "--max-steps", "1", "-o", str(out))[0] == 0
    code, text = invoke(app, "train", "--max-steps", "2", "-o", str(out), "--resume", "--seed", "5")
    assert code == 2 and "differs from this run's" in text and "Traceback" not in text
    (tmp_path / "afile").write_text("")
    code, text = invoke(app, "train", "--max-steps", "1", "-o", str(tmp_path / "afile"))
    assert code == 2 and "is a file" in text and "Traceback" not in text


CLI_OF = {"vlm": "mmrl.cli", "dllm": "dllm_rl.cli", "diffusion": "diffusion_rl.cli"}
SHIPPED = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*/*.yaml"))


@pytest.mark.parametrize("module,config", [(CLI_OF[p.parent.name], f"configs/{p.parent.name}/{p.name}") for p in SHIPPED])
def test_config_prints_every_key_with_its_description_and_loads_back(module, config, tmp_path, monkeypatch):
    """`<cli> config` prints the resolved config (default <- --config <- --set) as YAML with each
    field's docstring above it; read back as a --config file from another directory (its paths
    made absolute), it is the same config. Excluded, derived keys are not printed."""
    import importlib

    import yaml

    from mmrl.core.config import load_config
    from mmrl.core.runconfig import absolute_paths

    root = Path(__file__).resolve().parents[1]
    cli = importlib.import_module(module)
    backend = importlib.import_module(cli.SPEC.module)
    code, text = invoke(cli.app, "config", "--config", str(root / config), "--set", "optim.lr=3e-4")
    assert code == 0, text
    assert ("  # Clip the global gradient norm to this; None = no clipping (0 and inf are refused, not read\n"
            "  # as off). loss/grad_norm logs the norm before clipping.\n  max_grad_norm: 1.0\n") in text
    assert ("max_new_tokens:" in text) == (module != "dllm_rl.cli")  # dLLM: derived from gen_length, not set
    (tmp_path / "printed.yaml").write_text(text)
    cls = backend.CONFIG_CLASS
    want = load_config(cls, root / config, ["optim.lr=3e-4", f"output_dir={cli.SPEC.modality}"],
                       defaults={**backend.DEFAULT_CONFIG, "output_dir": f"runs/{cli.SPEC.modality}-default"})
    want = absolute_paths(want.model_dump(mode="json"), want.base_dir)  # as printed, from where it was printed
    monkeypatch.chdir(tmp_path)
    got = load_config(cls, tmp_path / "printed.yaml", [f"output_dir={cli.SPEC.modality}"], defaults=backend.DEFAULT_CONFIG)
    assert got.model_dump(mode="json") == want
    assert yaml.safe_load(text)["optim"]["lr"] == 3e-4


def test_config_keys_prints_one_part_under_its_parents_and_names_a_bad_path():
    from mmrl.cli import app as vlm

    code, text = invoke(vlm, "config", "--keys", "rollout.tools", "--set", "rollout.tools.names=[zoom]")
    assert code == 0, text
    assert text.splitlines()[0] == "rollout:" and "  tools:" in text and "max_stuck: 4" in text
    assert "optim" not in text and "num_generations" not in text
    code, text = invoke(vlm, "config", "--keys", "rollout.tool")
    assert code == 2 and "no key 'tool' in rollout (did you mean 'tools'? its keys: num_generations," in text
    assert "Traceback" not in text
    code, text = invoke(vlm, "config", "--keys", "seed.x")
    assert code == 2 and "seed is 0, not a section" in text
    code, text = invoke(vlm, "config", "--keys", "model.lora.r")  # a section that is off: its keys, how to see them
    assert code == 2 and ("model.lora is null (off) in this config; its keys once set: r, alpha, dropout, "
                          "target_modules (with --set model.lora.r=..., --keys model.lora shows them") in text


def test_config_keys_under_a_list_or_none_field_is_no_section():
    """--keys through a field `list[str] | None` names it as no section (a TypeError on Python
    3.10, where list[str] passes isinstance(_, type))."""
    from mmrl.core.config import ConfigError
    from mmrl.core.config_doc import commented_config
    from mmrl.vlm.config import VLMTrainConfig

    with pytest.raises(ConfigError, match=r"^--keys task.kinds.x: task.kinds is None, not a section$"):
        commented_config(VLMTrainConfig(), "task.kinds.x")


def test_a_field_redefined_without_a_docstring_keeps_its_base_classs_description():
    """A backend's config that redefines a core field (a new default) without repeating its
    docstring still prints the core's description above it."""
    from mmrl.core.config import RolloutConfig, TrainConfig
    from mmrl.core.config_doc import commented_config

    class Rollout(RolloutConfig):
        max_new_tokens: int = 5

    class Config(TrainConfig):
        rollout: Rollout = Rollout()

    text = commented_config(Config(), "rollout.max_new_tokens")
    assert text.splitlines()[1].startswith("  # Most tokens sampled per completion")
    assert text.endswith("  max_new_tokens: 5\n")


def test_sample_help_says_which_samples_each_modality_scores(monkeypatch):
    """`sample --help` names the prompts that get reward atoms, per modality: a VLM --prompt
    question has no gold answer; a dLLM problem or a shapes-geneval prompt in its task's format does."""
    from diffusion_rl.cli import app as diffusion_app
    from dllm_rl.cli import app as dllm_app
    from mmrl.cli import app as vlm_app

    monkeypatch.setenv("COLUMNS", "400")  # one line per sentence: the asserts read whole phrases
    helps = {name: invoke(a, "sample", "--help") for name, a in
             (("vlm", vlm_app), ("diffusion", diffusion_app), ("dllm", dllm_app))}
    assert all(code == 0 for code, _ in helps.values()), helps
    assert "have no gold answer and are not scored" in helps["vlm"][1]
    assert "shapes-geneval's grammar" in helps["diffusion"][1] and "12+3=" not in helps["diffusion"][1]
    assert '"12+3="' in helps["dllm"][1] and "shapes-geneval" not in helps["dllm"][1]
    code, text = invoke(app, "sample", "--help")  # a backend that says nothing gets the generic sentence
    assert code == 0 and "in the task's own format, carry their reward atoms" in text


def test_train_help_names_every_file_a_run_writes(monkeypatch):
    """`train --help` lists what the README says every run writes, report.html and the
    TensorBoard events included (they were missing from it)."""
    monkeypatch.setenv("COLUMNS", "400")  # one line per sentence: the asserts read whole phrases
    code, text = invoke(app, "train", "--help")
    assert code == 0, text
    for written in ("summary.json", "metrics.jsonl", "reward_curve.png", "report.html", "environment.json",
                    "TensorBoard events", "checkpoints"):
        assert written in text, written


def test_train_help_names_each_flags_default_and_the_set_syntax(monkeypatch):
    """The flags whose default is the config's say so (--help showed none: where a first run
    writes, how many steps, that it saves only at the end); --set shows KEY=VALUE, not
    typer's `<list[str]>`, and `runs` names what it takes, not `{paths}`."""
    monkeypatch.setenv("COLUMNS", "400")
    code, text = invoke(app, "train", "--help")
    assert code == 0, text
    lines = {line.split()[1]: line for line in text.splitlines() if line.startswith("│ --")}
    for flag in ("--max-steps", "--seed", "--output-dir", "--save-every"):
        assert "default:" in lines[flag], lines[flag]
    assert "runs/toy-default" in lines["--output-dir"] and "only the final step" in lines["--save-every"]
    assert "KEY=VALUE" in lines["--set"]
    code, text = invoke(app, "runs", "--help")
    assert code == 0 and "RUN_OR_FOLDER" in text and "{paths}" not in text


def test_a_relative_config_the_working_directory_lacks_comes_from_the_repository(tmp_path, monkeypatch):
    """`--config configs/vlm/dapo.yaml` works from any directory, as model.path "assets/..." does; a
    file the working directory holds wins, and a path neither holds stays as given (for the error)."""
    from mmrl.cli import app as vlm_app
    from mmrl.core.config import load_config
    from mmrl.core.runconfig import REPOSITORY, resolve_config_file

    monkeypatch.chdir(tmp_path)
    assert resolve_config_file("configs/vlm/dapo.yaml") == REPOSITORY / "configs" / "vlm" / "dapo.yaml"
    cfg = load_config(path="configs/vlm/dapo.yaml")  # relative paths in it resolve from the repository's folder
    assert Path(cfg.base_dir) == (REPOSITORY / "configs" / "vlm").resolve()
    code, text = invoke(vlm_app, "config", "--config", "configs/vlm/dapo.yaml")
    assert code == 0 and "clip_high: 0.28" in text, text  # DAPO's clip-higher, from the repository's file
    (tmp_path / "configs" / "vlm").mkdir(parents=True)
    (tmp_path / "configs" / "vlm" / "dapo.yaml").write_text("optim: {lr: 0.125}\n")
    assert resolve_config_file("configs/vlm/dapo.yaml") == Path("configs/vlm/dapo.yaml")  # the working directory's
    assert load_config(path="configs/vlm/dapo.yaml").optim.lr == 0.125
    assert resolve_config_file("configs/vlm/nope.yaml") == Path("configs/vlm/nope.yaml")


def test_an_install_without_the_bundle_says_the_bundled_models_and_configs_are_not_in_it(tmp_path, monkeypatch):
    """An install without assets/ and configs/ (a wheel built without setup.py's bundle; the
    project's own wheels carry them, tests/test_packaging.py): the errors say so and how to get
    them, not "rebuild it"."""
    from mmrl.core import runconfig
    from mmrl.core.config import ConfigError, load_config
    from mmrl.vlm.config import VLMModelConfig
    from mmrl.vlm.models import load_vlm

    assert runconfig.not_installed_note("assets/tiny-dllm") == ""  # a source checkout: nothing to add
    monkeypatch.setattr(runconfig, "REPOSITORY", tmp_path / "site-packages")  # no assets/ or configs/ there
    note = runconfig.not_installed_note("assets/tiny-dllm")
    assert "not in this install of mmrl" in note and "pip install -e ." in note and "model.path" in note
    assert runconfig.not_installed_note(tmp_path / "site-packages" / "assets" / "tiny-flow") == note
    assert "configs/ is not in this install" in runconfig.not_installed_note("configs/vlm/dapo.yaml")
    assert runconfig.not_installed_note("my/model") == runconfig.not_installed_note(tmp_path / "elsewhere") == ""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"config file 'configs/vlm/dapo.yaml' does not exist \(configs/ is not in this install"):
        load_config(path="configs/vlm/dapo.yaml")
    with pytest.raises(ConfigError, match=r"tiny-qwen2.5-vl' is not a directory \(assets/ is not in this install"):
        load_vlm(VLMModelConfig())  # the bundled model, now looked for under the install



def test_the_repository_is_the_source_checkout_else_the_wheel_s_bundle(tmp_path, monkeypatch):
    from mmrl.core import runconfig

    root = tmp_path.resolve() / "site"
    (root / "mmrl" / "core").mkdir(parents=True)
    monkeypatch.setattr(runconfig, "__file__", str(root / "mmrl" / "core" / "runconfig.py"))
    assert runconfig._repository() == root  # neither: where a checkout's would be (the errors say they are missing)
    (root / "mmrl" / "_bundled").mkdir()
    assert runconfig._repository() == root / "mmrl" / "_bundled"  # an install of the wheel: its bundle
    (root / "pyproject.toml").write_text("[project]\n")
    assert runconfig._repository() == root  # a source checkout: its own assets/ and configs/, bundle or not


def test_not_installed_note_resolves_dot_dot_ignores_an_empty_path_and_names_model_path_for_assets_only(tmp_path, monkeypatch):
    from mmrl.core import runconfig

    monkeypatch.setattr(runconfig, "REPOSITORY", tmp_path.resolve() / "site-packages")  # no assets/ there
    note = runconfig.not_installed_note("assets/tiny-flow")
    assert note.startswith(" (assets/ is not in this install of mmrl")
    assert runconfig.not_installed_note(runconfig.REPOSITORY / "mmrl" / ".." / "assets" / "tiny-flow") == note
    assert runconfig.not_installed_note("") == runconfig.not_installed_note(".") == ""
    assert "model.path" in note and "model.path" not in runconfig.not_installed_note("configs/vlm/dapo.yaml")

# ---------------------------------------------------------------------------- paths in a config (mmrl.core.runconfig)


def test_a_relative_path_is_looked_for_in_the_config_files_directory_first(tmp_path, monkeypatch):
    from mmrl.core.runconfig import absolute_paths, resolve_file

    base, cwd = tmp_path / "cfg", tmp_path / "cwd"
    for d in (base, cwd):
        (d / "sub").mkdir(parents=True)
        (d / "data.jsonl").write_text("")
    (cwd / "only_here.jsonl").write_text("")
    monkeypatch.chdir(cwd)
    assert resolve_file("data.jsonl", base) == base / "data.jsonl"
    assert resolve_file("only_here.jsonl", base) == cwd / "only_here.jsonl"
    assert resolve_file("nope.jsonl", base) == base / "nope.jsonl"  # neither: the first, for the error
    assert resolve_file("nope.jsonl") == cwd / "nope.jsonl"
    assert absolute_paths({"p": "data.jsonl", "d": "sub/"}, base) == {"p": str((base / "data.jsonl").resolve()),
                                                                       "d": str((base / "sub").resolve())}


def test_resolve_file_expands_the_home_directory(tmp_path, monkeypatch):
    from mmrl.core.runconfig import resolve_file

    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_file("~/data.jsonl", tmp_path / "elsewhere") == tmp_path / "data.jsonl"


def test_absolute_paths_takes_a_directory_a_colon_and_a_relative_config_directory(tmp_path, monkeypatch):
    from mmrl.core.runconfig import absolute_paths

    (tmp_path / "models" / "tiny").mkdir(parents=True)  # a model directory: a "/" and no suffix
    (tmp_path / "run:1").mkdir()  # a colon in a path that is no "file.py:name"
    (tmp_path / "run:1" / "data.jsonl").write_text("")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "atoms.py").write_text("")
    monkeypatch.chdir(tmp_path)
    fixed = absolute_paths({"model": "models/tiny", "data": "run:1/data.jsonl", "atom": "atoms.py:f",
                            "name": "tiny", "url": "http://host:8000"}, "cfg")  # the config's directory, relative
    assert fixed == {"model": str((tmp_path / "models" / "tiny").resolve()),
                     "data": str((tmp_path / "run:1" / "data.jsonl").resolve()),
                     "atom": str((tmp_path / "cfg" / "atoms.py").resolve()) + ":f",
                     "name": "tiny", "url": "http://host:8000"}
    assert all(Path(v.removesuffix(":f")).is_absolute() for k, v in fixed.items() if k in ("model", "data", "atom"))


def test_resolve_dir_wants_a_directory_and_falls_back_to_the_repository(tmp_path, monkeypatch):
    from mmrl.core.runconfig import REPOSITORY, resolve_dir

    base, cwd = tmp_path / "cfg", tmp_path / "cwd"
    base.mkdir()
    (base / "m").write_text("")  # a file, not the model directory
    (cwd / "m").mkdir(parents=True)
    monkeypatch.chdir(cwd)
    assert resolve_dir("m", base) == cwd / "m"
    assert resolve_dir("assets", base) == REPOSITORY / "assets"  # "assets/..." from anywhere
    assert resolve_dir("nope", base) == Path("nope")  # as given where none holds it


def test_a_relative_config_file_comes_from_the_repository_only_when_it_is_a_file_there(tmp_path, monkeypatch):
    from mmrl.core.runconfig import resolve_config_file

    monkeypatch.chdir(tmp_path)
    assert resolve_config_file("configs") == Path("configs")  # the repository's configs/ is a directory


def test_run_dir_of_needs_config_yaml_and_checkpoints_and_starts_at_the_path(tmp_path):
    from mmrl.core.runconfig import run_dir_of

    run = tmp_path / "run"
    step = run / "checkpoints" / "step-00000002" / "model"
    step.mkdir(parents=True)
    assert run_dir_of(step) is None  # no config.yaml
    (run / "config.yaml").write_text("seed: 1\n")
    assert run_dir_of(run) == run.resolve() == run_dir_of(step) == run_dir_of(run / "checkpoints")
    (step / "config.yaml").write_text("seed: 2\n")  # a config.yaml without checkpoints/ beside it
    assert run_dir_of(step) == run.resolve()


def test_read_run_config_refuses_a_file_that_is_not_a_mapping(tmp_path):
    from mmrl.core.config import ConfigError
    from mmrl.core.runconfig import read_run_config

    (tmp_path / "config.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="the run's config is not a mapping"):
        read_run_config(tmp_path)
    with pytest.raises(ConfigError, match="cannot read the run's config"):
        read_run_config(tmp_path / "nope")


def test_settings_train_refuses_are_named_by_config_and_by_train_before_the_model_is_built(tmp_path, monkeypatch):
    """The whole-config checks (pipelined needs an engine beside the trainer) ran when the Trainer
    was made, after the model had loaded, and `config` printed the settings without a word."""
    import toy

    bad = ["--set", "rollout.scheduler.mode=pipelined", "--set", "rollout.scheduler.placement=inline"]
    result = runner.invoke(app, ["config", *bad])
    assert result.exit_code == 0 and "placement: inline" in result.stdout
    assert "warning: `toy-rl train` refuses these settings: rollout.scheduler.placement=inline cannot pipeline" in " ".join(
        result.stderr.split())
    monkeypatch.setattr(toy, "build", lambda cfg: pytest.fail("the model was built"))
    code, text = invoke(app, "train", *bad, "--output-dir", str(tmp_path / "run"))
    assert code == 2 and "placement=inline cannot pipeline" in text and "Traceback" not in text
    assert runner.invoke(app, ["config"]).stderr == ""  # a config train takes: nothing said


def test_the_evaluation_table_is_whole_on_a_narrow_console(monkeypatch, capsys):
    """Rich cut a long metric name to "consist…" at the console's width, and below ~25
    columns dropped the name column altogether: which metric was it?"""
    from mmrl.core.cli import print_eval

    monkeypatch.setenv("COLUMNS", "20")
    print_eval({"consistency_checked": 1.0, "pass@4": 0.5}, {"consistency_checked": 0.75, "pass@4": None}, 3)
    lines = capsys.readouterr().out.splitlines()
    assert any("consistency_checked" in line and "1.0000" in line and "0.7500" in line for line in lines)
    assert any("pass@4" in line and "0.5000" in line and line.rstrip(" │").endswith("-") for line in lines)


def test_a_config_that_fails_says_why_not_which_settings_it_would_ignore(recwarn):
    """A VLM config given to dllm-rl warned that rollout.max_new_tokens is not a dLLM setting,
    then named the command to run it with; a config that loads still says what it ignores."""
    from dllm_rl.cli import app as dllm_app

    repo = Path(__file__).resolve().parents[1]
    code, text = invoke(dllm_app, "config", "-c", str(repo / "configs" / "vlm" / "axpo.yaml"))
    assert code == 2 and "run it with `mmrl train`" in text
    assert not [w for w in recwarn if "max_new_tokens" in str(w.message)]
    with pytest.warns(UserWarning, match=r"rollout.threshold \(0.5\) is unused by the low_confidence decoder"):
        assert invoke(dllm_app, "config", "--set", "rollout.threshold=0.5")[0] == 0


def test_an_empty_output_dir_flag_and_a_second_keys_are_refused(tmp_path, monkeypatch):
    # -o "" (an unset $OUT) was Path("."): the run wrote its checkpoints and logs into the working
    # directory; a second --keys replaced the first without a word
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["train", "-o", "", "--max-steps", "1"])
    assert result.exit_code == 2 and "--output-dir is empty" in result.output
    assert list(tmp_path.iterdir()) == []
    result = runner.invoke(app, ["config", "--keys", "optim", "-k", "seed"])
    assert result.exit_code == 2 and "--keys/-k given 2 times (optim, seed): it takes one value" in result.output
    result = runner.invoke(app, ["config", "--keys", "optim"])
    assert result.exit_code == 0 and result.output.startswith("optim:") or "\noptim:" in result.output


@pytest.mark.parametrize("args, said", [
    (["train", "-c", "a.yaml", "--config=b.yaml"], ("--config/-c given 2 times (a.yaml, b.yaml): it takes one value, "
                                                   "and the command line would keep the last without a word; give it "
                                                   "once (one config file a run: put the other's keys in it")),
    (["eval", "--checkpoint", "r1", "--set", "seed=1", "--checkpoint", "r2"], "--checkpoint given 2 times (r1, r2)"),
    (["train", "--max-steps", "2", "--resume", "--max-steps", "3"], "--max-steps given 2 times (2, 3)"),
])
def test_an_option_of_one_value_given_twice_is_refused_before_anything_runs(tmp_path, monkeypatch, args, said):
    """`-c axpo.yaml -c mine.yaml` read only mine.yaml (click keeps an option's last value
    without a word): refused with exit 2 before any file is read or folder made. Repeatable
    options (--set), flags given twice, and an option's value that looks like an option are not."""
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and said in " ".join(result.output.split()), result.output
    assert list(tmp_path.iterdir()) == []
    result = runner.invoke(app, ["config", "--set", "seed=1", "--set", "seed=2", "-k", "seed"])
    assert result.exit_code == 0 and "seed: 2" in result.output
    import typer.main

    from mmrl.core.cli import refuse_repeated_options

    sample = typer.main.get_command(app).get_command(None, "sample")  # --prompt's value, then one --checkpoint
    refuse_repeated_options(sample, ["--prompt", "--checkpoint", "--checkpoint", "r", "--greedy", "--greedy"])


def test_a_runs_config_naming_code_is_said_before_that_code_runs(tmp_path):
    """eval / sample / serve / export on a run (perhaps someone else's) import what its
    config.yaml names: a notice lists it first, as trust_remote_code's does, with how to load
    the weights alone. A run naming no code says nothing."""
    from mmrl.core.runconfig import code_named

    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000001").mkdir(parents=True)
    (run / "checkpoints" / "step-00000001" / STATE_JSON).write_text("{}")  # a complete checkpoint, as found
    (run / "plug.py").write_text("print('PLUGIN RAN')\n")
    (run / "config.yaml").write_text(f"plugins: [{run / 'plug.py'}]\nreward: {{atoms: [{{name: mine, fn: atoms.py:score}}]}}\n")
    result = runner.invoke(app, ["eval", "--checkpoint", str(run)])
    text = " ".join(result.output.split())
    assert f"notice: {run / 'config.yaml'} names Python code that runs now: plugins[0] {run / 'plug.py'}; " \
           "reward.atoms[0].fn atoms.py:score (to load its weights alone, copy" in text
    assert text.index("notice:") < text.index("PLUGIN RAN")
    assert code_named({"model": {"trust_remote_code": True, "path": "m"}, "seed": 1}) == ["model.trust_remote_code true"]
    assert code_named({"model": {"trust_remote_code": False}, "task": {"train_path": "a.jsonl"}}) == []
