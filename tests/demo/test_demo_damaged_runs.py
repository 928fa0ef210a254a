"""Run directories the demo and the report meet in the wild: a user's run still going (no
checkpoint yet), files torn by a kill or holding stray bytes, a run copied elsewhere, a run of a
plugin's method, names with HTML in them. Built by hand, no training: each test writes only the
files it is about."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from typer.testing import CliRunner

from mmrl.cli import app as mmrl_app
from mmrl.demo.compare import ModelPair, Shown
from mmrl.demo.report import render
from mmrl.demo.runs import RunError, RunInfo, backend

DLLM = "rollout: {gen_length: 8}\n"  # enough config for modality_of to say "dllm"
ROW = {"step": 1, "reward/total": 0.5}


def make_run(path: Path, config: str = DLLM, metrics: str = json.dumps(ROW) + "\n") -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(config)
    (path / "metrics.jsonl").write_text(metrics)
    return path


def finished(path: Path, step: int = 2) -> Path:
    """A run with one checkpoint and a summary naming it by absolute path, as the trainer writes."""
    model = path / "checkpoints" / f"step-{step:08d}" / "model"
    model.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps({"steps": step, "checkpoint": str(model),
                                                   "eval_before": {"accuracy": 0.25}, "eval_after": {"accuracy": 0.5}}))
    return path


def handlers(demo):
    from mmrl.demo.app import build_app

    return {bf.fn.__name__: bf.fn for bf in build_app(demo).fns.values() if bf.fn is not None}


# ------------------------------------------------------------------ a user's run is never trained over


def test_a_users_run_without_a_checkpoint_is_an_error_not_trained_over(tmp_path, monkeypatch):
    """Only the embedded default run is trained on first use: training into a user's --run
    directory would replace its config.yaml and metrics.jsonl with the default run's."""
    from mmrl.demo import app
    from mmrl.demo.runs import default_run_dir

    trained = []

    def spy(modality, progress=None, run_dir=None, overrides=None):
        trained.append(Path(run_dir))
        raise RuntimeError("would train here")

    monkeypatch.setattr(app, "ensure_default_run", spy)
    mine = make_run(tmp_path / "mine")
    before = {f: (mine / f).read_bytes() for f in ("config.yaml", "metrics.jsonl")}
    demo = app.Demo([RunInfo.load(mine)], train_missing=True)
    with pytest.raises(FileNotFoundError, match="mine has no checkpoint yet"):
        demo.pair("dllm")
    assert trained == [] and {f: (mine / f).read_bytes() for f in before} == before

    monkeypatch.chdir(tmp_path)  # the default run dir is relative: runs/dllm-default, not there yet
    with pytest.raises(RuntimeError, match="would train here"):
        app.Demo([], train_missing=True).pair("dllm")
    assert trained == [default_run_dir("dllm")]


# ------------------------------------------------------------------ metrics.jsonl: torn last line, bad line


def test_metrics_a_torn_last_line_is_dropped_a_bad_line_is_a_run_error(tmp_path):
    torn = make_run(tmp_path / "torn", metrics=json.dumps(ROW) + '\n{"step": 2, "rew')  # killed mid-write
    assert RunInfo.load(torn).metrics == [ROW]  # as the trainer's own reader (resume) drops it
    bad = make_run(tmp_path / "bad", metrics="garbage\n" + json.dumps(ROW) + "\n")
    with pytest.raises(RunError, match=r"bad/metrics.jsonl, line 1: not a JSON metrics row"):
        RunInfo.load(bad)
    proc = subprocess.run([sys.executable, "-m", "mmrl.demo.report", str(bad)], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 2 and "line 1" in proc.stderr and "Traceback" not in proc.stderr


def test_a_bad_metrics_line_is_a_message_in_the_cli_and_the_runs_tab(tmp_path):
    gr = pytest.importorskip("gradio")
    from mmrl.demo.app import Demo

    bad = make_run(tmp_path / "bad", metrics="garbage\n" + json.dumps(ROW) + "\n")
    result = CliRunner().invoke(mmrl_app, ["demo", "--run", str(bad), "--port", "0"])
    assert result.exit_code == 2 and "line 1" in result.output and "Traceback" not in result.output
    with pytest.raises(gr.Error, match="line 1: not a JSON metrics row"):  # not Gradio's bare "Error"
        handlers(Demo([], train_missing=False))["run_view"](str(bad))


def test_metrics_rows_without_a_step_or_with_a_null_are_not_plotted(tmp_path):
    rows = [{"reward/total": 0.1}, {"step": 1, "reward/total": None}, ROW, ["not", "a", "row"]]
    run = RunInfo.load(make_run(tmp_path / "run", metrics="".join(json.dumps(r) + "\n" for r in rows)))
    assert run.curves() == {"reward/total": ([1], [0.5])}
    assert "<h2>Curves</h2>" in render(run)


# ------------------------------------------------------------------ report.html: damaged sample files


def test_the_report_shows_damaged_sample_files_and_the_rest(tmp_path):
    run = make_run(tmp_path / "run")
    samples = run / "samples"
    samples.mkdir()
    rows = [{"group": 0, "prompt": "12+7=", "completion": "19", "reward": 1.0}]
    # appended while the run goes: a kill left half a row after the whole ones; a model wrote a stray byte
    (samples / "step_00000001.jsonl").write_bytes(json.dumps(rows[0]).encode() + b"\n"
                                                  + b'{"group": 0, "prompt": "caf\xe9=", "completion": "1"}\n'
                                                  + b'{"group": 1, "prom')
    (samples / "samples_before.json").write_text("[{")  # cut short
    (samples / "samples_after.json").write_text(json.dumps(rows))
    page = render(RunInfo.load(run))
    assert "<td>12+7=</td>" in page and "<td>caf\ufffd=</td>" in page  # both whole rows; the stray byte replaced
    assert "(unreadable: samples_before.json: " in page and "<td>19</td>" in page  # after still shown

    (samples / "step_00000001.jsonl").write_text("not json\n" + json.dumps(rows[0]) + "\n")  # a bad line, not the last
    page = render(RunInfo.load(run))
    assert "(unreadable: step_00000001.jsonl: line 1: " in page


# ------------------------------------------------------------------ a run copied elsewhere


def test_a_copied_run_loads_its_own_checkpoint_not_the_originals(tmp_path):
    original = finished(make_run(tmp_path / "original"))
    copy = Path(shutil.copytree(original, tmp_path / "copy"))  # summary.json still names original/...
    assert RunInfo.load(copy).model_dir() == copy / "checkpoints" / "step-00000002" / "model"
    assert RunInfo.load(original).model_dir() == original / "checkpoints" / "step-00000002" / "model"
    shutil.rmtree(copy / "checkpoints")  # the copy took no checkpoints: the stored path is all there is
    assert RunInfo.load(copy).model_dir() == original / "checkpoints" / "step-00000002" / "model"


# ------------------------------------------------------------------ a plugin's method


def test_a_run_of_a_plugins_method_is_built_with_the_plugins_config_class(tmp_path):
    """The run's config names its plugin: its method validates only with the plugin's CONFIG_CLASS."""
    (tmp_path / "half_neg.py").write_text(
        "from typing import Annotated, Literal\n"
        "from pydantic import Field\n"
        "from dllm_rl.config import DiffuGRPOConfig, DLLMTrainConfig, MethodConfig\n"
        "from dllm_rl.methods.diffu_grpo import DiffuGRPO\n"
        "from mmrl.core.method import register_method\n\n\n"
        "class HalfNegConfig(DiffuGRPOConfig):\n"
        "    type: Literal['demo_half_neg'] = 'demo_half_neg'\n"
        "    neg_scale: float = 0.5\n\n\n"
        "class CONFIG_CLASS(DLLMTrainConfig):\n"
        "    method: Annotated[MethodConfig | HalfNegConfig, Field(discriminator='type')] = Field(\n"
        "        default_factory=DiffuGRPOConfig)\n\n\n"
        "@register_method('demo_half_neg')\n"
        "class HalfNeg(DiffuGRPO):\n"
        "    pass\n")
    b = backend("dllm")
    cfg = b.CONFIG_CLASS.model_validate(b.DEFAULT_CONFIG).model_dump(mode="json")
    cfg["method"] = {**cfg["method"], "type": "demo_half_neg", "neg_scale": 0.25}
    cfg["plugins"] = [str(tmp_path / "half_neg.py")]
    run = finished(make_run(tmp_path / "run", config=yaml.safe_dump(cfg)))
    pair = ModelPair(RunInfo.load(run))
    assert pair.config(None).method.neg_scale == 0.25
    policy, task = pair.get("before")  # the bundled tiny model, with the run's config
    assert not policy.model.training and task.eval_problems


# ------------------------------------------------------------------ HTML in names; null and empty values


def test_atom_names_run_paths_and_metric_keys_are_escaped(tmp_path):
    from mmrl.demo.app import atoms_html

    page = atoms_html(Shown("greedy", "19", {"<b>mine</b>": 1.0, "<i>na</i>": None}, 1.0))
    assert "&lt;b&gt;mine&lt;/b&gt;: &#10003;" in page and "&lt;i&gt;na&lt;/i&gt;: n/a" in page
    assert "<b>mine</b>" not in page and "<i>" not in page

    pytest.importorskip("gradio")
    from mmrl.demo.app import Demo

    run = finished(make_run(tmp_path / "x<img src=x onerror=alert(1)>"))
    summary = json.loads((run / "summary.json").read_text())
    summary["eval_before"]["<b>k</b>"] = 1.0
    (run / "summary.json").write_text(json.dumps(summary))
    _, table = handlers(Demo([], train_missing=False))["run_view"](str(run))
    assert "x&lt;img src=x onerror=alert(1)&gt;" in table and "<img" not in table
    assert "<td>&lt;b&gt;k&lt;/b&gt;</td>" in table and "<b>k</b>" not in table


def test_a_null_summary_value_is_na_and_no_held_out_items_is_a_message(tmp_path):
    gr = pytest.importorskip("gradio")
    from mmrl.demo.app import Demo

    run = finished(make_run(tmp_path / "run"))
    summary = json.loads((run / "summary.json").read_text())
    summary["eval_after"]["accuracy"] = None  # an eval that did not run
    (run / "summary.json").write_text(json.dumps(summary))
    demo = Demo([], train_missing=False)
    fns = handlers(demo)
    _, table = fns["run_view"](str(run))
    assert "<tr><td>accuracy</td><td>0.25</td><td>n/a</td></tr>" in table

    # a run trained with task.num_eval=0: nothing to draw a held-out problem from
    demo.pairs["dllm"] = SimpleNamespace(run=SimpleNamespace(path=run),
                                         get=lambda which: (None, SimpleNamespace(eval_problems=[])))
    with pytest.raises(ValueError, match="no held-out items"):
        demo.held_out("dllm", 0)
    with pytest.raises(gr.Error, match="no held-out items"):
        fns["dllm_new"](0)
