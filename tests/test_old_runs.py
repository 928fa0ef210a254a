"""Run folders made by an older mmrl, used by this one (eval, sample, export, --resume). Each
folder is built by hand in the old form, not by running old code."""

from __future__ import annotations

import json

import pytest
import yaml
from toy import tiny_llama
from transformers import LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from mmrl.core.checkpoint import STATE_JSON, STATE_TENSORS, save_file
from mmrl.core.cli import BackendSpec, make_app

runner = CliRunner()
app = make_app(BackendSpec(modality="toy", title="toy", command="toy-rl", module="toy"))


def old_run(tmp_path, model) -> tuple:
    """A run of the bundled model (model.path null) whose step-1 checkpoint holds `model`."""
    run = tmp_path / "old run"
    step = run / "checkpoints" / "step-00000001"
    model.save_pretrained(step / "model")
    # the keys every trainer state has held (trainer.STATE_KEYS); the weights load first
    state = {"step": 1, "bad_steps": 0, "eval_before": {}, "optimizer": {}, "lr_scheduler": {}, "rng": {}, "data": {}}
    (step / STATE_JSON).write_text(json.dumps(state))
    save_file({}, step / STATE_TENSORS)
    (run / "config.yaml").write_text(yaml.safe_dump({"seed": 0, "output_dir": str(run), "model": {"path": None}}))
    return run, step / "model"


def wider_llama() -> LlamaForCausalLM:
    """The toy model of another width: what an older mmrl's bundled tiny model was to today's
    (assets/tiny-flow was a pixel-space model until 2026-11-30)."""
    base = tiny_llama().config.to_dict()
    return LlamaForCausalLM(LlamaConfig(**{**base, "hidden_size": 64, "intermediate_size": 128}))


@pytest.mark.parametrize("verb", ["eval", "sample", "export"])
def test_an_older_bundled_models_checkpoint_names_model_path(tmp_path, verb):
    run, model = old_run(tmp_path, wider_llama())
    args = [verb, "--checkpoint", str(run)] + (["-o", str(tmp_path / "out")] if verb == "export" else [])
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())  # rich wraps the error line
    assert "has shape" in text  # what does not fit, as before
    assert "the run trained the bundled tiny model (model.path null) of the older mmrl that made it" in text
    assert f"--set model.path={model}" in text


def test_an_older_bundled_models_run_is_not_resumed_and_says_how_to_go_on(tmp_path):
    run, model = old_run(tmp_path, wider_llama())
    result = runner.invoke(app, ["train", "-o", str(run), "--resume", "--max-steps", "2"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "--resume: weights in" in text and "this mmrl cannot resume it" in text
    assert f"train --set model.path={model} -o NEW_DIR" in text


def test_a_checkpoint_that_fits_gets_no_note(tmp_path):
    run, _ = old_run(tmp_path, tiny_llama())
    result = runner.invoke(app, ["eval", "--checkpoint", str(run)])
    assert result.exit_code == 0, result.output
    assert "older mmrl" not in result.output
    assert "accuracy" in json.loads(result.output.strip().splitlines()[-1])


def test_an_older_runs_defaults_of_fastrl_switched_off_are_not_warned_of(tmp_path, recwarn):
    """Until 2026-12-02 FastRL's defaults were ngram 2 and ars true (off, they change nothing):
    every run's config.yaml holds them, and eval and --resume warned of them as set and unused,
    and --resume as settings changed since the run."""
    run = tmp_path / "run"
    assert runner.invoke(app, ["train", "-o", str(run), "--max-steps", "1", "--save-every", "1"]).exit_code == 0
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["method"]["fastrl"]["enabled"] is False
    config["method"]["fastrl"].update(ngram=2, ars=True)  # as an older mmrl wrote it
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    recwarn.clear()
    for args in (["eval", "--checkpoint", str(run)], ["train", "-o", str(run), "--resume", "--max-steps", "2"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
    said = [str(w.message) for w in recwarn]
    assert not [w for w in said if "unused" in w or "differ" in w], said
    assert not list(run.glob("config.before-step-*.yaml"))  # nothing counted as changed


def test_fastrl_settings_a_run_chose_are_kept(tmp_path):
    from mmrl.core.runconfig import upgraded

    old = {"method": {"fastrl": {"enabled": False, "ngram": 2, "ars": True, "tau": 0.8}}}
    assert upgraded(old) == {"method": {"fastrl": {"enabled": False, "tau": 0.8}}}
    assert old["method"]["fastrl"]["ngram"] == 2  # the caller's dict is left as it is
    on = {"method": {"fastrl": {"enabled": True, "ngram": 2, "ars": True}}}  # pruning with them: they matter
    assert upgraded(on) == on
    chosen = {"method": {"fastrl": {"enabled": False, "ngram": 3}}}  # not the old default: the user's
    assert upgraded(chosen) == chosen
    assert upgraded({"method": {"type": "tracerl"}}) == {"method": {"type": "tracerl"}}  # no such section


def test_runs_of_one_configuration_by_an_older_and_this_mmrl_make_one_group(tmp_path):
    """A run's config.yaml is a full dump of the mmrl that made it: an older one lacks the
    settings added since, and holds FastRL's older defaults (off). Same settings otherwise: one
    configuration, not two rows told apart by `method.fastrl.against=null`."""
    from mmrl.core.config import load_config
    from mmrl.demo import table
    from mmrl.vlm.config import VLMTrainConfig

    new = load_config(VLMTrainConfig).model_dump(mode="json")
    old = json.loads(json.dumps(new))
    del old["method"]["fastrl"]["against"], old["plugins"]  # added since
    old["method"]["fastrl"].update(ngram=2, ars=True)
    for name, config, seed, after in (("old", old, 0, 0.5), ("new", new, 1, 0.7), ("lr", new, 2, 0.9)):
        run = tmp_path / name
        run.mkdir()
        config = {**config, "seed": seed, "output_dir": str(run)}
        if name == "lr":
            config["optim"] = {**config["optim"], "lr": 0.5}
        (run / "config.yaml").write_text(yaml.safe_dump(config))
        (run / "summary.json").write_text(json.dumps({"eval_before": {"accuracy": 0.4}, "eval_after": {"accuracy": after},
                                                      "steps": 2, "train_seconds": 3.0}))  # the oldest form
    runs = [table.load(tmp_path / name) for name in ("old", "new", "lr")]
    assert table.varying(runs) == ["optim.lr"]
    rows = table.group_rows(runs, ["accuracy"])
    assert [(r["config"], r["seeds"]) for r in rows] == [({"optim.lr": new["optim"]["lr"]}, [0, 1]), ({"optim.lr": 0.5}, [2])]
    assert rows[0]["metrics"]["accuracy"]["after_mean"] == pytest.approx(0.6)  # (0.5 + 0.7) / 2


def test_a_mismatch_of_a_model_bundled_today_gets_no_note(tmp_path):
    """The note is for an architecture no bundled model has: a checkpoint of today's bundled
    model that does not load (another LoRA setting, a damaged file) keeps its own message."""
    from mmrl.core.runconfig import REPOSITORY, bundled_model_note

    flow = tmp_path / "model"
    (flow / "transformer").mkdir(parents=True)
    (flow / "model_index.json").write_text("{}")
    bundled = json.loads((REPOSITORY / "assets" / "tiny-flow" / "transformer" / "config.json").read_text())
    (flow / "transformer" / "config.json").write_text(json.dumps({**bundled, "_diffusers_version": "0.1"}))
    assert bundled_model_note(None, flow) == ""
    (flow / "transformer" / "config.json").write_text(json.dumps({**bundled, "in_channels": 48}))  # 2026-11-29's
    kept = REPOSITORY / "assets" / "tiny-flow-pixel"  # that model, bundled today under another name
    assert f"{kept} has the run's architecture" in bundled_model_note(None, flow, resume=True)
    (flow / "transformer" / "config.json").write_text(json.dumps({**bundled, "in_channels": 12}))  # none bundled
    assert f"--set model.path={flow}" in bundled_model_note(None, flow)
    assert bundled_model_note("assets/tiny-flow", flow) == ""  # a model named: not the bundled one
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    assert bundled_model_note(None, adapter) == ""


def test_an_image_run_from_before_disjoint_held_out_prompts_keeps_its_prompts():
    """task.held_out came on 2026-12-05 with the default disjoint; a run made before drew its
    held-out prompts from the whole space: `eval --checkpoint` of it scored other prompts than
    its summary.json's (0.75 for its 0.83 exist accuracy), and --resume trained on others."""
    from diffusion_rl.config import DiffusionTrainConfig
    from mmrl.core.config import load_config
    from mmrl.core.runconfig import upgraded

    old = {"task": {"type": "shapes-geneval", "num_eval": 2}}
    assert load_config(DiffusionTrainConfig, defaults=upgraded(old)).task.held_out == "overlapping"
    new = {"task": {"type": "shapes-geneval", "held_out": "disjoint"}}  # a run of today says which
    assert upgraded(new) == new
    assert upgraded({"task": {"type": "arith"}}) == {"task": {"type": "arith"}}  # another task: nothing added
