"""`eval` as a researcher uses it: which --checkpoint paths it takes, and what it says of the
ones it cannot (mmrl.core.cli); the held-out metrics of each backend's task."""

from __future__ import annotations

from typer.testing import CliRunner

from mmrl.core.cli import BackendSpec, make_app

runner = CliRunner()
app = make_app(BackendSpec(modality="toy", title="toy", command="toy-rl", module="toy"))


def invoke(*args):
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


def _not_built(monkeypatch):
    import toy

    def built(cfg):
        raise AssertionError("the model was built")

    monkeypatch.setattr(toy, "build", built)


def test_a_run_that_saved_no_step_yet_is_named_so_not_read_as_a_model_directory(tmp_path, monkeypatch):
    """config.yaml is written as a run starts, checkpoints/ at its first save: a run stopped in
    between was loaded as a model directory (`OSError: no file named model.safetensors`)."""
    _not_built(monkeypatch)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    code, text = invoke("eval", "--checkpoint", str(run))
    assert code == 2 and f"{run} holds no complete checkpoint (a run that has saved no step yet)" in text, text
    assert "model.safetensors" not in text


def test_run_slash_best_of_a_run_without_a_best_metric_says_why_and_what_to_give(tmp_path, monkeypatch):
    _not_built(monkeypatch)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\n")
    code, text = invoke("eval", "--checkpoint", str(run / "best"))
    assert code == 2, text
    assert f"checkpoint {run}/best does not exist: the run {run} keeps no best checkpoint" in text
    assert "train.best_metric" in text and f"--checkpoint {run} takes its newest" in text
