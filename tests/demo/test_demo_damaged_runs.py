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
import torch
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


# ------------------------------------------------------------------ runs.py: modality, loading, model_dir, curves


def test_modality_of_needs_only_one_of_each_backends_keys():
    from mmrl.demo.runs import modality_of

    assert modality_of({"rollout": {"window_size": 2}}) == "diffusion"  # a flow run without noise_level set
    assert modality_of({"rollout": {"noise_level": 0.7}}) == "diffusion"
    assert modality_of({"rollout": {"block_length": 4}}) == "dllm"
    assert modality_of({"rollout": None}) == modality_of({}) == "vlm"


def test_an_unknown_modality_is_a_value_error_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown modality 'toy' .known: vlm, diffusion, dllm"):
        backend("toy")


def test_an_empty_config_is_a_vlm_run_and_undecodable_bytes_are_a_run_error(tmp_path):
    run = RunInfo.load(make_run(tmp_path / "empty", config=""))
    assert run.config == {} and run.modality == "vlm" and run.base_model() is None
    bad = make_run(tmp_path / "bad")
    (bad / "config.yaml").write_bytes(b"rollout: {gen_length: 8}\nname: caf\xe9\n")  # latin-1, not UTF-8
    with pytest.raises(RunError, match="config.yaml: not a readable YAML file"):
        RunInfo.load(bad)


def test_a_relative_checkpoint_in_the_summary_is_read_from_the_run_directory(tmp_path, monkeypatch):
    run = make_run(tmp_path / "run")
    (run / "elsewhere" / "step-3" / "model").mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"steps": 3, "checkpoint": "elsewhere/step-3/model"}))
    monkeypatch.chdir(tmp_path)  # not the run directory: a relative path must not be read from here
    assert RunInfo.load(run).model_dir() == run / "elsewhere" / "step-3" / "model"


def test_without_a_summary_checkpoint_the_newest_complete_one_with_a_model_is_the_model(tmp_path):
    run = make_run(tmp_path / "run")
    for step in (1, 2):
        (run / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
        (run / "checkpoints" / f"step-{step:08d}" / "trainer_state.json").write_text("{}")
    (run / "checkpoints" / "step-00000001" / "model").mkdir()
    assert RunInfo.load(run).model_dir() is None  # the newest (step 2) has no model directory
    (run / "checkpoints" / "step-00000002" / "model").mkdir()
    assert RunInfo.load(run).model_dir() == run / "checkpoints" / "step-00000002" / "model"
    (run / "summary.json").write_text(json.dumps({"steps": 2, "checkpoint": None}))  # a summary naming none
    assert RunInfo.load(run).model_dir() == run / "checkpoints" / "step-00000002" / "model"


def test_curves_hold_reward_total_and_eval_accuracies_only(tmp_path):
    row = {"step": 1, "reward/total": 0.5, "reward/format": 0.9, "eval/accuracy": 0.3, "eval/loss": 2.0,
           "loss/total": 1.0}
    run = RunInfo.load(make_run(tmp_path / "run", metrics=json.dumps(row) + "\n"))
    assert run.curves() == {"reward/total": ([1], [0.5]), "eval/accuracy": ([1], [0.3])}


def test_the_after_point_is_at_the_summarys_steps_else_the_last_logged_step(tmp_path):
    rows = "".join(json.dumps({"step": s, "reward/total": 0.1 * s}) + "\n" for s in (1, 2, 3))
    run = make_run(tmp_path / "run", metrics=rows)
    summary = {"eval_before": {"accuracy": 0.25, "hard/accuracy": 0.1, "pending_accuracy": None},
               "eval_after": {"accuracy": 0.5}}
    (run / "summary.json").write_text(json.dumps(summary))  # no "steps": the last row's step, 3
    curves = RunInfo.load(run).curves()
    # only the plain numeric accuracies: "hard/accuracy" (a subset) and a null are left out
    assert set(curves) == {"reward/total", "eval/accuracy"}
    assert curves["eval/accuracy"] == ([0, 3], [0.25, 0.5])
    (run / "summary.json").write_text(json.dumps({**summary, "steps": 5}))  # the summary's count wins
    assert RunInfo.load(run).curves()["eval/accuracy"] == ([0, 5], [0.25, 0.5])


def test_an_evaluation_logged_at_the_last_step_is_not_drawn_twice(tmp_path):
    rows = [{"step": 1, "reward/total": 0.1}, {"step": 2, "reward/total": 0.2, "eval/accuracy": 0.5}]
    run = make_run(tmp_path / "run", metrics="".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"steps": 2, "eval_before": {"accuracy": 0.25},
                                                  "eval_after": {"accuracy": 0.5}}))
    assert RunInfo.load(run).curves()["eval/accuracy"] == ([0, 2], [0.25, 0.5])


def test_a_run_of_no_steps_has_its_evaluation_at_step_0_only(tmp_path):
    run = make_run(tmp_path / "run", metrics="")
    (run / "summary.json").write_text(json.dumps({"steps": 0, "eval_before": {"accuracy": 0.25},
                                                  "eval_after": {"accuracy": 0.25}}))
    assert RunInfo.load(run).curves() == {"eval/accuracy": ([0], [0.25])}  # before and after are one point


# ------------------------------------------------------------------ report.py: cells, tables, metrics, samples


@pytest.fixture
def no_curves(monkeypatch):
    """render without matplotlib (seconds on a loaded machine): the curves image is a blank pixel."""
    from PIL import Image

    from mmrl.demo import report

    monkeypatch.setattr(report, "plot_curves", lambda run: Image.new("RGB", (1, 1)))


def test_report_cells_show_floats_to_four_significant_digits_also_inside_dicts():
    from mmrl.demo.report import _cell

    assert _cell(0.123456) == "0.1235" and _cell(2) == "2" and _cell("<b>") == "&lt;b&gt;"
    assert _cell({"format": 1.0, "<answer>": 0.333333}) == "format: 1, &lt;answer&gt;: 0.3333"


def test_a_sample_table_shows_its_columns_and_at_most_max_rows_rows():
    from mmrl.demo.report import MAX_ROWS, _table

    assert MAX_ROWS == 24
    rows = [{"prompt": f"p{i}", "completion": "c", "extra": 1} for i in range(24)]
    page = _table(rows, ["prompt", "completion"])
    assert page.count("<tr>") == 1 + 24 and "more</p>" not in page and "extra" not in page
    page = _table([*rows, {"prompt": "p24"}], ["prompt", "completion"])
    assert page.count("<tr>") == 1 + 24 and "<td>p24</td>" not in page and page.endswith("<p>... and 1 more</p>")
    assert _table([]) == "<p>(none)</p>"


def test_the_metrics_table_shows_every_key_and_the_signed_change():
    from mmrl.demo.report import _metrics_table

    page = _metrics_table({"eval_before": {"accuracy": 0.25, "loss": 0.5, "same": 1.0, "missing": None},
                           "eval_after": {"accuracy": 0.5, "loss": 0.25, "same": 1.0, "missing": 0.5, "new": 0.75}})
    assert '<tr><td>accuracy</td><td>0.25</td><td>0.5</td><td><span class="up">+0.25</span></td></tr>' in page
    assert '<tr><td>loss</td><td>0.5</td><td>0.25</td><td><span class="down">-0.25</span></td></tr>' in page
    assert '<tr><td>same</td><td>1</td><td>1</td><td><span class="">+0</span></td></tr>' in page
    assert "<tr><td>missing</td><td>n/a</td><td>0.5</td><td></td></tr>" in page  # no change without a before
    assert "<tr><td>new</td><td>n/a</td><td>0.75</td><td></td></tr>" in page  # a metric only after


def test_sample_rows_skip_blank_lines_and_only_an_unfinished_last_line(tmp_path):
    from mmrl.demo.report import _json_rows

    row = json.dumps({"prompt": "1+1=", "completion": "2"})
    path = tmp_path / "step_00000001.jsonl"
    path.write_text(f"{row}\n\n{row}\n")
    assert len(_json_rows(path, lines=True)) == 2
    path.write_text(f'{row}\n{{"prompt": "cut\n')  # a bad line that ends in a newline was written whole
    with pytest.raises(ValueError, match="line 2"):
        _json_rows(path, lines=True)


@pytest.mark.parametrize("text", ["{}", "5", "[1, 2]", '"rows"'])
def test_a_samples_file_that_is_not_a_list_of_objects_is_unreadable_not_an_error(tmp_path, text):
    from mmrl.demo.report import _sample_table

    (tmp_path / "samples_after.json").write_text(text)
    assert _sample_table(tmp_path / "samples_after.json") == \
        "<p>(unreadable: samples_after.json: not a list of JSON objects)</p>"


def test_the_report_shows_the_newest_training_samples_or_says_there_are_none(tmp_path, no_curves):
    run = make_run(tmp_path / "run")
    assert "<p>(this run saved no samples)</p>" in render(RunInfo.load(run))
    (run / "samples").mkdir()
    for step in (2, 10):
        (run / "samples" / f"step_{step:08d}.jsonl").write_text(json.dumps({"prompt": f"at {step}"}) + "\n")
    page = render(RunInfo.load(run))
    assert "<h3>training samples, step 10</h3>" in page and "<td>at 10</td>" in page and "at 2<" not in page


def test_the_environment_rows_show_the_commit_dirty_flag_and_command(tmp_path, no_curves):
    run = make_run(tmp_path / "run")
    entries = [{"started": "2026-12-01T00:00:00Z", "step": 0, "mmrl": "0.3", "git": {"commit": "0123456789abcdef"},
                "packages": {"torch": "2.5"}, "device": "cpu", "processes": 1, "command": ["mmrl", "train", 3]},
               {"step": 4, "mmrl": "0.3", "git": {"commit": "fedcba9876543210", "dirty": True}}]
    (run / "environment.json").write_text(json.dumps(entries))
    env = render(RunInfo.load(run)).split("<h2>Environment</h2>")[1].split("<h2>")[0]
    assert "<td>0.3 (0123456789)</td>" in env and "<td>0.3 (fedcba9876, uncommitted changes)</td>" in env
    assert "<td>mmrl train 3</td>" in env
    (run / "environment.json").write_text("5")  # not a list: iterating it is a TypeError
    assert "(environment.json is unreadable: TypeError)" in render(RunInfo.load(run))


def test_the_reports_facts_steps_seconds_and_best_checkpoint(tmp_path, no_curves):
    run = finished(make_run(tmp_path / "run"), step=7)  # metrics.jsonl has one row, the summary says 7 steps
    summary = json.loads((run / "summary.json").read_text())
    summary.update(train_seconds=0.0, best={"metric": "accuracy", "value": 0.5, "step": 4, "checkpoint": "ck/step-4"})
    (run / "summary.json").write_text(json.dumps(summary))
    facts = render(RunInfo.load(run)).split("<p>")[1].split("</p>")[0]
    assert facts.startswith("Diffusion LM run, 7 steps; 0 s of training; final model: ")
    assert facts.endswith("; best by held-out accuracy: 0.5 at step 4, <code>ck/step-4/model</code>")


# ------------------------------------------------------------------ compare.py with stand-in models


def test_the_pair_samples_on_auto_device_without_a_window_and_an_old_lora_checkpoint_merged(tmp_path):
    """config(model_path): the run's config with the model path, device auto; CAST's SDE window is
    dropped (sampling needs none); the tuned model of an old diffusion LoRA run is a pipeline with
    the adapter merged in, so it is built without LoRA, while the base keeps it."""
    b = backend("diffusion")
    cfg = b.CONFIG_CLASS.model_validate({**b.DEFAULT_CONFIG, "method": {"type": "cast"},
                                         "model": {"lora": {"r": 4}, "device": "cpu"}}).model_dump(mode="json")
    assert cfg["method"]["window_from"] == "model"
    pair = ModelPair(RunInfo.load(finished(make_run(tmp_path / "run", config=yaml.safe_dump(cfg)))))
    base, tuned = pair.config(None), pair.config(pair.tuned_path)
    assert base.model.path is None and base.model.device == "auto" and base.model.lora.r == 4
    assert tuned.model.path == str(pair.tuned_path) and tuned.model.device == "auto" and tuned.model.lora is None
    assert base.method.window_from is None and tuned.method.window_from is None


def test_a_default_run_whose_checkpoint_is_gone_is_trained_again(tmp_path, monkeypatch):
    from mmrl.demo import compare

    def no_training(modality):
        raise RuntimeError(f"would train {modality}")

    monkeypatch.setattr(compare, "backend", no_training)
    run = finished(make_run(tmp_path / "run"))
    assert compare.ensure_default_run("dllm", run_dir=run).path == run  # finished: loaded, not trained
    shutil.rmtree(run / "checkpoints")  # a summary, but no model to show
    with pytest.raises(RuntimeError, match="would train dllm"):
        compare.ensure_default_run("dllm", run_dir=run)


class StandInTokenizer:
    def decode(self, ids):
        return {5: "4", 6: "2", 7: ""}[ids[0]]


def stand_in_scores(samples):
    """format 1 and answer 0 for every sample; total 0.1 * format + answer."""
    return SimpleNamespace(names=["format", "answer"], values=torch.tensor([[1.0, 0.0]] * len(samples)),
                           total=torch.tensor([0.1] * len(samples), dtype=torch.float64))


def test_the_denoising_order_stops_at_eos_and_marks_fallback_steps():
    from mmrl.demo.compare import denoising_order

    policy = SimpleNamespace(predictor=SimpleNamespace(tokenizer=StandInTokenizer(), eos_token_id=0))
    # tokens "4", "" then eos, then "2" after it; fallback holds steps 0 and 1: step 2 is past its end
    result = SimpleNamespace(completion=torch.tensor([[5, 7, 0, 6]]), commit_step=torch.tensor([[2, 1, 0, 0]]),
                             fallback=torch.tensor([[False, True]]))
    page = denoising_order(policy, result, 0)
    assert page.count('class="tok"') == 2 and ">2<sub>" not in page  # nothing after eos
    assert 'title="step 2">4<sub>2</sub>' in page  # step 2: no fallback record, not a fallback
    assert 'title="step 1 (fallback)">&nbsp;<sub>1</sub>' in page  # an empty token is still a cell
    result.completion = torch.tensor([[0, 5, 5, 5]])
    assert denoising_order(policy, result, 0) == "(empty)"


def test_compare_dllm_labels_samples_by_seed_and_hides_only_the_answer_atom_without_a_reference():
    from mmrl.demo.compare import compare_dllm

    calls = []

    def decode(prompts, gen, temperature, strategy):
        calls.append((len(prompts), gen is None, temperature))
        n = len(prompts)
        return SimpleNamespace(completion=torch.tensor([[5, 0]] * n), commit_step=torch.tensor([[0, 0]] * n),
                               fallback=torch.zeros(n, 0, dtype=torch.bool), nfe=torch.tensor([3] * n)), None

    policy = SimpleNamespace(rollout=SimpleNamespace(temperature=0.7), decode=decode, prompt_length=8,
                             answer_text=lambda completion: ["4"] * len(completion),
                             predictor=SimpleNamespace(tokenizer=StandInTokenizer(), eos_token_id=0))
    task = SimpleNamespace(reward=SimpleNamespace(score=stand_in_scores), answer_atom="answer")
    pair = SimpleNamespace(get=lambda which: (policy, task))
    out = compare_dllm(pair, SimpleNamespace(prompt="hello=", answer="", meta={}), n=2, seed=5)
    assert calls == [(1, True, 0.0), (2, False, 0.7)] * 2  # greedy, then n at the rollout temperature
    for shown in out.values():
        assert [s.label for s in shown] == ["greedy", "sample 1 (seed 5)", "sample 2 (seed 5)"]
        assert all(s.atoms == {"format": 1.0, "answer": None} and s.total is None for s in shown)
        assert shown[1].extra == {"nfe": 3, "fallback_steps": 0}
    known = compare_dllm(pair, SimpleNamespace(prompt="2+2=", answer="4", meta={}), n=0)["after"]
    assert [(s.label, s.atoms, s.total) for s in known] == [("greedy", {"format": 1.0, "answer": 0.0}, 0.1)]


def test_compare_dllm_takes_a_problem_longer_than_the_tasks_prompts():
    # the arith task's prompts are 6 tokens wide: "123+456=" (8) was refused ("this run's prompts may
    # have at most 6"), though `dllm-rl sample --prompt` widens for it
    from dllm_rl import backend
    from mmrl.core.config import load_config
    from mmrl.demo.compare import compare_dllm, dllm_problem

    cfg = load_config(backend.CONFIG_CLASS, None, ["task.num_train=8", "task.num_eval=4"],
                      defaults=backend.DEFAULT_CONFIG)
    policy, task = backend.build(cfg)
    assert policy.prompt_length == 6
    pair = SimpleNamespace(get=lambda which: (policy, task))
    out = compare_dllm(pair, dllm_problem("123+456="), n=1, seed=0)
    assert [s.label for s in out["after"]] == ["greedy", "sample 1 (seed 0)"]
    assert all(s.total is not None for s in out["after"])  # the answer 579 is known, so scored
    with pytest.raises(ValueError, match=r"^prompts of up to \d+ tokens plus gen_length \d+ exceed the model's context"):
        compare_dllm(pair, dllm_problem("1+" * 100 + "1"), n=1, seed=0)


def test_compare_vlm_hides_only_the_answer_atom_of_an_uploaded_image():
    from mmrl.core.rewards import Sample
    from mmrl.demo.compare import compare_vlm

    policy = SimpleNamespace(
        greedy_batches=lambda items, max_new, stop: [SimpleNamespace(samples=[Sample("q", "g")])],
        generate=lambda items, n, rollout, gen: SimpleNamespace(samples=[Sample("q", f"s{k}") for k in range(n)]))
    task = SimpleNamespace(reward=SimpleNamespace(score=stand_in_scores), max_new_tokens=8, stop=None)
    pair = SimpleNamespace(get=lambda which: (policy, task), base_path=None, tuned_path="tuned",
                           config=lambda path: SimpleNamespace(rollout=None))
    upload = SimpleNamespace(answer="")
    for shown in compare_vlm(pair, upload, n=1, seed=2).values():
        assert [(s.label, s.output) for s in shown] == [("greedy", "g"), ("sample 1 (seed 2)", "s0")]
        assert all(s.atoms == {"format": 1.0, "answer": None} and s.total is None for s in shown)
    (greedy,) = compare_vlm(pair, SimpleNamespace(answer="7"), n=0)["before"]
    assert greedy.atoms == {"format": 1.0, "answer": 0.0} and greedy.total == pytest.approx(0.1)


def test_an_empty_summary_shows_no_metrics_table(tmp_path, no_curves):
    run = make_run(tmp_path / "run")
    (run / "summary.json").write_text("{}")  # nothing in it: no before/after table with no rows
    page = render(RunInfo.load(run))
    assert "<p>(no summary.json yet: the run has not finished)</p>" in page and "<th>metric</th>" not in page
