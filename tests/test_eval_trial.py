"""`eval` as a researcher uses it: which --checkpoint paths it takes, and what it says of the
ones it cannot (mmrl.core.cli); the held-out metrics of each backend's task."""

from __future__ import annotations

import pytest
import toy  # the toy backend (tests/toy.py); imported at collection, not in a test's time
from typer.testing import CliRunner

from mmrl.core.cli import BackendSpec, make_app

runner = CliRunner()
app = make_app(BackendSpec(modality="toy", title="toy", command="toy-rl", module="toy"))


def invoke(*args):
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


def _not_built(monkeypatch):
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


@pytest.mark.parametrize("ran, given, n", [
    (4, [], 4),  # the run's own n: its logged pass@k are redrawn alike
    (0, [], 16),  # a run that evaluated greedily: dllm-rl eval's own 16
    (4, ["--set", "rollout.eval_samples=2"], 2),  # --set over both
])
def test_dllm_eval_of_a_run_keeps_the_eval_samples_it_trained_with(tmp_path, monkeypatch, ran, given, n):
    """EVAL_DEFAULTS (16 samples) went over the run's config.yaml: a run that logged pass@1..4
    from 4 samples per problem was evaluated from 16, and its pass@1 did not match its logs."""
    from dllm_rl import backend
    from dllm_rl.cli import app as dllm_app
    from mmrl.core.checkpoint import STATE_JSON

    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000001" / "model").mkdir(parents=True)
    (run / "checkpoints" / "step-00000001" / STATE_JSON).write_text("{}")
    (run / "config.yaml").write_text(f"rollout: {{eval_samples: {ran}}}\n")
    seen = []

    def build(cfg):
        seen.append(cfg.rollout.eval_samples)
        raise KeyboardInterrupt  # stop here: the settings are what is tested

    monkeypatch.setattr(backend, "build", build)
    result = runner.invoke(dllm_app, ["eval", "--checkpoint", str(run), *given])
    assert result.exit_code == 130 and seen == [n], result.output


def test_a_model_directory_of_another_architecture_is_named_before_it_is_loaded(tmp_path):
    """A dLLM's export (a Llama) given to a Qwen-VL run failed as `'dict' object has no attribute
    'to_dict'`, or listed the VLM's own vision blocks as the directory's unexpected weights."""
    import json
    from types import SimpleNamespace

    from mmrl.core.checkpoint import CheckpointError
    from mmrl.core.cli import load_checkpoint

    loaded = []
    policy = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(model_type="qwen2_5_vl")),
                             load_weights=loaded.append)
    other = tmp_path / "exported"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match=r"exported: it holds a 'llama' model \(its config.json\), and the model "
                                              r"it is loaded into is a 'qwen2_5_vl'"):
        load_checkpoint(policy, other)
    (other / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    adapter = tmp_path / "adapter"  # a LoRA checkpoint has no config.json: loaded as before
    adapter.mkdir()
    load_checkpoint(policy, other)
    load_checkpoint(policy, adapter)
    assert loaded == [other, adapter]


def test_eval_names_the_checkpoint_a_run_resolves_to_on_stderr_and_prints_json_alone_on_stdout(tmp_path, monkeypatch):
    """`eval --checkpoint RUN` evaluated the run's newest checkpoint without saying which step."""
    import json
    from types import SimpleNamespace

    from mmrl.core import trainer
    from mmrl.core.checkpoint import STATE_JSON

    out = tmp_path / "run"
    for step in (1, 2):
        (out / "checkpoints" / f"step-0000000{step}" / "model").mkdir(parents=True)
        (out / "checkpoints" / f"step-0000000{step}" / STATE_JSON).write_text("{}")
    (out / "config.yaml").write_text("seed: 0\n")
    loaded = []
    monkeypatch.setattr(toy, "build", lambda cfg: (SimpleNamespace(load_weights=loaded.append), None))
    monkeypatch.setattr(trainer, "Trainer", lambda *a, **k: SimpleNamespace(evaluate=lambda **kw: {"accuracy": 0.5},
                                                                         eval_said="0.1 s"))
    result = runner.invoke(app, ["eval", "--checkpoint", str(out)])
    assert result.exit_code == 0, result.output
    newest = out / "checkpoints" / "step-00000002" / "model"
    assert loaded == [newest] and f"evaluating {newest}" in result.stderr.splitlines()
    assert json.loads(result.stdout) == {"accuracy": 0.5}  # stdout is the one JSON line, for `> metrics.json`
