"""The functions behind `mmrl demo` and report.html, without a browser: run directories, curves,
the report page, the before/after comparisons of each modality, training a missing default run."""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from typer.testing import CliRunner

from mmrl.cli import app as mmrl_app
from mmrl.demo.compare import (
    ModelPair,
    compare_diffusion,
    compare_dllm,
    compare_vlm,
    denoising_order,
    dllm_problem,
    ensure_default_run,
)
from mmrl.demo.report import REPORT, render
from mmrl.demo.runs import RunError, RunInfo, backend, modality_of, plot_curves


@pytest.mark.parametrize("modality", ["vlm", "diffusion", "dllm"])
def test_modality_of_each_backends_config(modality):
    b = backend(modality)
    cfg = b.CONFIG_CLASS.model_validate(b.DEFAULT_CONFIG).model_dump(mode="json")
    assert modality_of(cfg) == modality


def test_run_info_of_a_finished_run(tiny_runs):
    for modality, path in tiny_runs.items():
        run = RunInfo.load(path)
        assert run.modality == modality and run.summary is not None and len(run.metrics) == 1
        assert (run.model_dir() / "config.json").is_file() or (run.model_dir() / "model_index.json").is_file()
        curves = run.curves()
        assert curves["reward/total"][0] == [1]
        before = run.summary["eval_before"]
        key = "atom_accuracy" if modality == "diffusion" else "accuracy"
        steps, values = curves[f"eval/{key}"]
        assert steps == [0, 1] and values == [before[key], run.summary["eval_after"][key]]
    image = plot_curves(RunInfo.load(tiny_runs["dllm"]))
    assert image.size[0] > 500 and len(image.getcolors(1 << 20)) > 10  # drawn, not blank


def test_runs_lists_real_runs_of_every_modality_with_their_summaries(tiny_runs):
    # `mmrl runs` on what the trainer writes (tests/test_runs_table.py works the numbers by hand)
    result = CliRunner().invoke(mmrl_app, ["runs", *map(str, tiny_runs.values()), "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    for row, path in zip(rows, tiny_runs.values()):
        summary = json.loads((path / "summary.json").read_text())
        assert row["run"] == str(path) and row["steps"] == 1 and row["status"] == "finished"
        for when in ("before", "after"):
            got = {k: v for k, v in row[when].items() if v is not None}
            # a metric without data (NaN in summary.json) is null
            assert got == {k: v for k, v in summary[f"eval_{when}"].items() if v is not None and not math.isnan(v)}
        assert row["train_seconds"] == summary["train_seconds"]
    assert "method.type" in rows[0]["config"]  # grpo, flow_grpo, diffu_grpo tell the runs apart
    text = CliRunner().invoke(mmrl_app, ["runs", *map(str, tiny_runs.values()), "-m", "accuracy"]).output
    assert text.count("finished") == 3 and " → " in text


def test_run_info_errors_name_the_directory(tmp_path):
    with pytest.raises(RunError, match=re.escape(str(tmp_path)) + ".*no config.yaml"):
        RunInfo.load(tmp_path)
    (tmp_path / "config.yaml").write_text("rollout: {gen_length: 8}\n")
    (tmp_path / "summary.json").write_text("{not json")
    with pytest.raises(RunError, match="summary.json: not valid JSON"):
        RunInfo.load(tmp_path)
    (tmp_path / "summary.json").unlink()
    run = RunInfo.load(tmp_path)  # a run that has not finished: no summary, no checkpoint
    assert run.modality == "dllm" and run.model_dir() is None
    with pytest.raises(FileNotFoundError, match="no finished checkpoint"):
        ModelPair(run)


def test_every_run_writes_a_self_contained_report(tiny_runs):
    for path in tiny_runs.values():
        page = (path / REPORT).read_text()  # written by the trainer at the end of the run
        assert "Held-out metrics, before and after" in page and "data:image/png;base64," in page
        assert "<script" not in page and not re.search(r'(src|href)="https?:', page)  # opens offline
        summary = json.loads((path / "summary.json").read_text())
        for key in summary["eval_before"]:
            assert f"<td>{key}</td>" in page
    assert page == render(RunInfo.load(tiny_runs["dllm"]))  # re-rendering gives the same page
    assert "grid_before" not in page and "samples_before" not in page  # dLLM: answer tables, no grid
    assert "<h3>before</h3><table>" in page
    assert "alt='samples before'" in (tiny_runs["diffusion"] / REPORT).read_text()  # the image grids


def test_compare_vlm_same_seed_same_samples_and_uploads(tiny_runs):
    pair = ModelPair(RunInfo.load(tiny_runs["vlm"]))
    _, task = pair.get("before")
    item = task.eval_items[0]
    first, again = compare_vlm(pair, item, 2, seed=3), compare_vlm(pair, item, 2, seed=3)
    for side in ("before", "after"):
        assert [s.label for s in first[side]] == ["greedy", "sample 1 (seed 3)", "sample 2 (seed 3)"]
        assert [s.output for s in first[side]] == [s.output for s in again[side]]
        assert all(set(s.atoms) == {"format", "answer"} and s.total is not None for s in first[side])
    upload = SimpleNamespace(images=[Image.new("RGB", (64, 64), "white")], question="What colour is it?",
                             answer="", reference="", meta={})
    shown = compare_vlm(pair, upload, 0)["after"]
    assert shown[0].atoms["answer"] is None and shown[0].total is None  # no reference answer to check


def test_compare_diffusion_scores_every_atom_and_refuses_nothing(tiny_runs):
    pair = ModelPair(RunInfo.load(tiny_runs["diffusion"]))
    out = compare_diffusion(pair, "two red circles left of a blue square", [0, 1])
    for side in ("before", "after"):
        assert [s.label for s in out[side]] == ["seed 0", "seed 1"]
        assert all(isinstance(s.output, Image.Image) and len(s.atoms) == 7 for s in out[side])
    free = compare_diffusion(pair, "a cat on a mat", [0])["before"][0]  # outside the grammar: drawn, not scored
    assert free.total is None and "cat" in free.extra["why"]


def test_dllm_problems_and_the_denoising_order(tiny_runs):
    assert dllm_problem("12+7=").answer == "19" and dllm_problem(" 3 * 4 ").prompt == "3*4="
    assert dllm_problem("5-9").answer == "-4" and dllm_problem("hello").answer == ""
    assert dllm_problem("1204|0012|2100|4320=", "sudoku").answer == "1234|3412|2143|4321"
    pair = ModelPair(RunInfo.load(tiny_runs["dllm"]))
    out = compare_dllm(pair, dllm_problem("12+7="), n=2, seed=0, strategy="fork")
    for side in ("before", "after"):
        assert out[side][0].label == "greedy" and len(out[side]) == 3
        assert all("tok" in s.order and s.extra["nfe"] >= 1 for s in out[side])
    policy, _ = pair.get("before")
    tok = policy.predictor.tokenizer
    ids = tok("42", add_special_tokens=False)["input_ids"]
    result = SimpleNamespace(completion=torch.tensor([ids + [policy.predictor.eos_token_id]]),
                             commit_step=torch.tensor([[1, 0, 1]]), fallback=torch.tensor([[True, False]]))
    html = denoising_order(policy, result, 0)
    assert html.count('class="tok"') == 2 and html.count("(fallback)") == 1  # step 0 fell back; eos not shown


def test_the_runs_own_atoms_are_shown_and_counted_in_the_total(tmp_path, train_run):
    """A run trained with reward.atoms: the demo scores with them, so its totals are the training reward."""
    (tmp_path / "atoms.py").write_text("def two(sample):\n    return 1.0\n")
    spec = json.dumps([{"path": str(tmp_path / "atoms.py") + ":two", "weight": 2.0}])
    train_run("dllm", tmp_path / "run", f"reward.atoms={spec}")
    pair = ModelPair(RunInfo.load(tmp_path / "run"))
    for shown in compare_dllm(pair, dllm_problem("12+7="), n=1).values():
        for s in shown:
            assert s.atoms["two"] == 1.0
            assert s.total == pytest.approx(0.1 * s.atoms["format"] + s.atoms["answer"] + 2.0)


@pytest.mark.parametrize("modality", ["vlm", "diffusion", "dllm"])
def test_a_lora_runs_after_model_is_the_base_with_its_trained_adapter(modality, tmp_path, reward_spread, train_run):
    """A LoRA run's checkpoint holds the adapter alone (no weights of the base): "after" is the base
    model with that adapter loaded, "before" the base as it was."""
    train_run(modality, tmp_path / "run", "model.lora.r=4", "optim.lr=1e-2")
    pair = ModelPair(RunInfo.load(tmp_path / "run"))
    assert (pair.tuned_path / "adapter_config.json").is_file()
    after, _ = pair.get("after")
    saved = load_file(pair.tuned_path / "adapter_model.safetensors")
    lora = {k: v for k, v in after.model.state_dict().items() if ".lora_" in k}
    assert len(lora) == len(saved) and all(torch.equal(lora[k.replace(".weight", ".default.weight")], v)
                                           for k, v in saved.items())
    assert any(v.abs().sum() > 0 for k, v in lora.items() if ".lora_B." in k)  # trained: B moved off 0


def test_missing_default_run_is_trained_with_progress(tmp_path):
    calls = []
    run = ensure_default_run("dllm", lambda i, n: calls.append((i, n)), tmp_path / "dllm-default",
                             overrides=["train.max_steps=2", "rollout.prompts_per_step=2", "rollout.num_generations=2",
                                        "task.num_eval=4", "logging.tensorboard=false"])
    assert calls == [(1, 2), (2, 2)] and run.model_dir() is not None
    again = ensure_default_run("dllm", lambda i, n: calls.append((i, n)), tmp_path / "dllm-default")
    assert calls == [(1, 2), (2, 2)] and again.path == run.path  # finished: not trained again


def test_demo_cli_rejects_a_directory_that_is_not_a_run(tmp_path):
    pytest.importorskip("gradio")
    result = CliRunner().invoke(mmrl_app, ["demo", "--run", str(tmp_path), "--port", "0"])
    assert result.exit_code == 2 and "no config.yaml" in result.output and "Traceback" not in result.output


def test_report_of_a_directory_that_is_no_run_is_one_line(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "mmrl.demo.report", str(tmp_path)], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {tmp_path} is not a run directory")
    assert "Traceback" not in proc.stderr


def test_handlers_show_user_errors_as_their_message(tiny_runs, tmp_path):
    """Gradio shows any exception but gr.Error as a bare "Error": every tab's handlers turn
    empty input, cleared numbers, a missing run and bad settings into their message."""
    gr = pytest.importorskip("gradio")
    from mmrl.demo.app import Demo, build_app

    demo = Demo([RunInfo.load(tiny_runs[m]) for m in ("vlm", "diffusion", "dllm")], train_missing=False)
    fns = {bf.fn.__name__: bf.fn for bf in build_app(demo).fns.values() if bf.fn is not None}
    image = Image.new("RGB", (32, 32), "white")
    cases = [
        (lambda: fns["diffusion_run"]("  ", "0"), "give a prompt"),
        (lambda: fns["dllm_run"]("", 1, 0, "fork"), "give a problem"),
        (lambda: fns["vlm_run"](image, "q?", -1, None, 0), "samples must be a whole number; got None"),
        (lambda: fns["dllm_run"]("12+7=", 1, -3, "fork"), "seed must be at least 0"),
        (lambda: fns["dllm_run"]("12+7=", 1, 0, "bogus"), "bogus"),
        (lambda: fns["dllm_run"]("1" * 500 + "+2=", 1, 0, "fork"), "context"),
    ]
    for call, message in cases:
        with pytest.raises(gr.Error, match=message):
            call()
    demo.chosen["vlm"] = tmp_path / "missing"
    demo.pairs.pop("vlm", None)
    with pytest.raises(gr.Error, match="missing is not a run directory"):  # a user's run: its own message
        fns["vlm_run"](image, "q?", -1, 1, 0)
