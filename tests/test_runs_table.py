"""`<cli> runs`: finished runs side by side (mmrl/demo/table.py). Run directories are written by
hand, so every mean and standard deviation below is worked out from the numbers in them."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from mmrl.core.cli import BackendSpec, make_app
from mmrl.demo import table

app = make_app(BackendSpec(modality="toy", title="toy", command="toy-rl", module="toy"))


def make_run(root, name, seed=0, lr=1e-4, before=None, after=None, steps=10, best=None, seconds=60.0,
             metrics_rows=0, **config):
    path = root / name
    path.mkdir(parents=True)
    cfg = {"seed": seed, "output_dir": str(path), "logging": {"tensorboard": True, "wandb": {"name": name}},
           "optim": {"lr": lr}, "train": {"max_steps": steps}, "method": {"type": "grpo"}, **config}
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    if metrics_rows:
        (path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/total": 0.1})
                                                    + "\n" for s in range(1, metrics_rows + 1)))
    if after is not None:
        summary = {"eval_before": before, "eval_after": after, "steps": steps, "train_seconds": seconds}
        if best:
            summary["best"] = best
        (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_seeds_of_one_configuration_make_one_row_with_mean_and_sample_sd(tmp_path):
    for seed, acc in [(0, 0.5), (1, 0.7), (2, 0.9)]:
        make_run(tmp_path, f"grpo-{seed}", seed=seed, before={"accuracy": 0.4}, after={"accuracy": acc},
                 seconds=10.0 * (seed + 1))
    make_run(tmp_path, "fast", lr=1e-3, before={"accuracy": 0.4}, after={"accuracy": 0.3})
    runs = [table.load(p) for p in table.find([tmp_path])]
    rows = table.group_rows(runs, ["accuracy"])
    assert [r["config"] for r in rows] == [{"optim.lr": 0.001}, {"optim.lr": 0.0001}]
    fast, grpo = rows
    assert grpo["seeds"] == [0, 1, 2] and grpo["finished"] == 3
    s = grpo["metrics"]["accuracy"]
    assert s["n"] == 3 and s["after_mean"] == pytest.approx(0.7)
    assert s["after_sd"] == pytest.approx(0.2)  # sqrt(((-0.2)^2 + 0 + 0.2^2) / (3 - 1))
    assert s["change_mean"] == pytest.approx(0.3) and s["change_sd"] == pytest.approx(0.2)
    assert grpo["train_seconds_mean"] == pytest.approx(20.0)
    assert fast["metrics"]["accuracy"]["after_sd"] is None  # one run: no spread
    assert fast["metrics"]["accuracy"]["change_mean"] == pytest.approx(-0.1)

    text = table.markdown_groups(rows, ["accuracy"])
    assert "| optim.lr=0.0001 | 0, 1, 2 | 3 of 3 | 0.700 ± 0.200 (+0.300 ± 0.200) | 20 |" in text
    assert "| optim.lr=0.001 | 0 | 1 of 1 | 0.300 (-0.100) | 60 |" in text


def test_an_unfinished_run_is_listed_and_counts_in_no_mean(tmp_path):
    make_run(tmp_path, "a", seed=0, before={"accuracy": 0.2}, after={"accuracy": 0.6})
    make_run(tmp_path, "b", seed=1, metrics_rows=4)  # killed at step 4: no summary.json
    runs = [table.load(p) for p in table.find([tmp_path])]
    assert runs[1].status == "no summary.json (step 4 of 10): running, or killed"
    (row,) = table.group_rows(runs, ["accuracy"])
    assert row["finished"] == 1 and row["metrics"]["accuracy"]["after_mean"] == pytest.approx(0.6)
    assert "| (one configuration) | 0, 1 | 1 of 2 | 0.600 (+0.400) |" in table.markdown_groups([row], ["accuracy"])
    lines = table.markdown_runs(table.run_rows(runs, ["accuracy"]), ["accuracy"]).splitlines()
    assert lines[0] == "| run | seed | steps | accuracy | best | train s | status |"  # no config column: one config
    assert lines[3].endswith("| 1 | 4 |  |  |  | no summary.json (step 4 of 10): running, or killed |")


def test_run_rows_show_before_and_after_the_best_checkpoint_and_null_metrics(tmp_path):
    best = {"metric": "accuracy", "mode": "max", "step": 6, "value": 0.75, "checkpoint": "x"}
    make_run(tmp_path, "r", before={"accuracy": 0.25, "reward": None}, after={"accuracy": 0.5, "reward": 1.5},
             best=best, seconds=125.4)
    rows = table.run_rows([table.load(tmp_path / "r")], ["accuracy", "reward"])
    assert rows[0]["before"] == {"accuracy": 0.25, "reward": None} and rows[0]["after"]["reward"] == 1.5
    line = table.markdown_runs(rows, ["accuracy", "reward"]).splitlines()[2]
    assert line == f"| {tmp_path / 'r'} | 0 | 10 | 0.250 → 0.500 | – → 1.500 | accuracy 0.750 @ 6 | 125 | finished |"


def test_a_null_metric_is_left_out_of_the_mean_and_the_change(tmp_path):
    make_run(tmp_path, "a", seed=0, before={"m": 1.0}, after={"m": 2.0})
    make_run(tmp_path, "b", seed=1, before={"m": None}, after={"m": 4.0})
    make_run(tmp_path, "c", seed=2, before={"m": 1.0}, after={"m": None})
    (row,) = table.group_rows([table.load(p) for p in table.find([tmp_path])], ["m"])
    s = row["metrics"]["m"]
    assert s["n"] == 2 and s["after_mean"] == pytest.approx(3.0) and s["after_sd"] == pytest.approx(math.sqrt(2))
    assert s["change_mean"] == pytest.approx(1.0) and s["change_sd"] is None  # only run a has both
    # the cell says the mean is over 2 of the 3 finished runs
    assert "| 0, 1, 2 | 3 of 3 | 3.000 ± 1.414 (+1.000) [2 of 3] |" in table.markdown_groups([row], ["m"])


def test_varying_keys_label_rows_and_a_key_one_run_lacks_counts(tmp_path):
    make_run(tmp_path, "a", before={}, after={}, rollout={"num_generations": 8})
    make_run(tmp_path, "b", before={}, after={}, rollout={"num_generations": 4, "max_rounds": 2})
    runs = [table.load(p) for p in table.find([tmp_path])]
    assert table.varying(runs) == ["rollout.num_generations", "rollout.max_rounds"]
    rows = table.run_rows(runs, [])
    assert [r["config"] for r in rows] == [{"rollout.num_generations": 8, "rollout.max_rounds": None},
                                          {"rollout.num_generations": 4, "rollout.max_rounds": 2}]
    assert "| rollout.num_generations=4 rollout.max_rounds=2 |" in table.markdown_runs(rows, [])


def test_where_a_sections_type_differs_only_the_type_labels_it_first(tmp_path):
    # another method has other settings anyway: method.type says which, its keys are left out
    make_run(tmp_path, "a", before={}, after={}, lr=1e-4, task=None,
             method={"type": "grpo", "loss": {"clip": 0.2}, "advantage": {"type": "group"}})
    make_run(tmp_path, "b", before={}, after={}, lr=1e-5, task=None,
             method={"type": "dapo", "loss": {"clip": 0.28}, "advantage": {"type": "rloo"}, "overlong": 4})
    make_run(tmp_path, "c", before={}, after={}, lr=1e-5, task=None, method={"type": "dapo", "loss": {"clip": 0.28}})
    runs = [table.load(p) for p in table.find([tmp_path])]
    assert table.varying(runs) == ["method.type", "optim.lr"]
    make_run(tmp_path, "d", before={}, after={}, task={"type": "arith", "digits": 2})  # the others: task null
    runs = [table.load(p) for p in table.find([tmp_path])]
    assert table.varying(runs)[:2] == ["method.type", "task.type"] and "task" not in table.varying(runs)


def test_a_section_null_in_one_run_and_set_in_another_is_labelled_by_its_keys(tmp_path):
    # the run with tools was labelled rollout.tools=None too: a key only the other run has
    make_run(tmp_path, "a", before={}, after={}, rollout={"tools": None})
    make_run(tmp_path, "b", before={}, after={}, rollout={"tools": {"names": ["zoom"], "max_turns": 3}})
    runs = [table.load(p) for p in table.find([tmp_path])]
    assert table.varying(runs) == ["rollout.tools.max_turns", "rollout.tools.names"]  # make_run sorts
    assert [r["config"] for r in table.run_rows(runs, [])] == [
        {"rollout.tools.names": None, "rollout.tools.max_turns": None},
        {"rollout.tools.names": ["zoom"], "rollout.tools.max_turns": 3}]


def test_runs_of_several_backends_are_labelled_by_the_modality_not_by_settings_one_backend_lacks(tmp_path):
    # model.kind: a dLLM setting the VLM run lacks, which labelled both runs "model.kind=null" first
    make_run(tmp_path, "d", before={}, after={}, rollout={"gen_length": 8, "num_generations": 4}, model={"kind": None})
    make_run(tmp_path, "v", before={}, after={}, rollout={"num_generations": 8}, model={})
    runs = [table.load(p) for p in table.find([tmp_path])]
    assert table.varying(runs) == ["modality", "rollout.num_generations"]
    rows = table.markdown_runs(table.run_rows(runs, []), [])
    assert "| modality=dllm rollout.num_generations=4 |" in rows and "| modality=vlm rollout.num_generations=8 |" in rows
    make_run(tmp_path, "v2", before={}, after={}, rollout={"num_generations": 8, "max_rounds": 2})
    vlm = [table.load(tmp_path / n) for n in ("v", "v2")]  # one backend: a key one run lacks still counts
    assert table.varying(vlm) == ["model", "rollout.max_rounds"]


def test_a_label_shows_four_settings_and_counts_the_rest():
    config = {f"k{i}": i for i in range(6)}
    assert table._label(config) == "k0=0 k1=1 k2=2 k3=3 (+2 more)"
    assert table._label({"a": "x", "b": [1, 2]}) == "a=x b=[1, 2]"


def test_find_takes_runs_and_folders_of_runs_and_refuses_anything_else(tmp_path):
    a = make_run(tmp_path / "sweep", "a", before={}, after={})
    b = make_run(tmp_path / "sweep", "b", before={}, after={})
    (tmp_path / "sweep" / "notes").mkdir()
    assert table.find([tmp_path / "sweep", a]) == [a, b]  # a run named twice is listed once
    with pytest.raises(ValueError, match="does not exist"):
        table.find([tmp_path / "nope"])
    with pytest.raises(ValueError, match="holds none one level down"):
        table.find([tmp_path / "sweep" / "notes"])
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        table.find([tmp_path / "file"])


def test_a_run_named_by_two_spellings_counts_once_in_its_groups_mean(tmp_path, monkeypatch):
    # a relative and an absolute path, a "..", a symlink in the sweep: each made the run a second seed
    a = make_run(tmp_path / "sweep", "a", seed=0, before={"accuracy": 0.0}, after={"accuracy": 0.2})
    make_run(tmp_path / "sweep", "b", seed=1, before={"accuracy": 0.0}, after={"accuracy": 0.6})
    (tmp_path / "sweep" / "z").symlink_to(a)
    monkeypatch.chdir(tmp_path)
    found = table.find([Path("sweep"), a, Path("sweep/b/../a")])
    assert found == [Path("sweep/a"), Path("sweep/b")]
    (row,) = table.group_rows([table.load(p) for p in found], ["accuracy"])
    assert row["seeds"] == [0, 1] and row["metrics"]["accuracy"]["after_mean"] == pytest.approx(0.4)  # (0.2 + 0.6) / 2


def test_a_damaged_run_is_a_row_with_the_reason_and_the_others_still_show(tmp_path):
    make_run(tmp_path, "good", before={"accuracy": 0.1}, after={"accuracy": 0.2})
    bad = make_run(tmp_path, "bad", before={"accuracy": 0.1}, after={"accuracy": 0.9})
    (bad / "summary.json").write_text("{not json")
    runs = [table.load(p) for p in table.find([tmp_path])]
    assert runs[0].error and "summary.json" in runs[0].error and runs[0].status.startswith("unreadable: ")
    groups = table.group_rows(runs, ["accuracy"])
    assert [g["finished"] for g in groups] == [0, 1]  # the damaged run is not mixed into the good one's mean
    assert groups[1]["metrics"]["accuracy"]["after_mean"] == pytest.approx(0.2)


def test_cli_runs_prints_markdown_json_and_refuses_an_unknown_metric(tmp_path):
    for seed, acc in [(0, 0.25), (1, 0.75)]:
        make_run(tmp_path, f"s{seed}", seed=seed, before={"accuracy": 0.5, "reward": 1.0},
                 after={"accuracy": acc, "reward": 2.0})
    runner = CliRunner()
    result = runner.invoke(app, ["runs", str(tmp_path), "--group", "-m", "accuracy"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[2] == "| (one configuration) | 0, 1 | 2 of 2 | 0.500 ± 0.354 (+0.000 ± 0.354) | 60 |"
    result = runner.invoke(app, ["runs", str(tmp_path / "s0"), str(tmp_path / "s1"), "--json"])
    rows = json.loads(result.output)
    assert [r["after"] for r in rows] == [{"accuracy": 0.25, "reward": 2.0}, {"accuracy": 0.75, "reward": 2.0}]
    result = runner.invoke(app, ["runs", str(tmp_path), "-m", "acc"])
    assert result.exit_code == 2 and "--metric acc: no run reports it" in result.output
    assert "accuracy, reward" in result.output and "Traceback" not in result.output


def test_a_run_without_metrics_yet_is_at_step_0(tmp_path):
    make_run(tmp_path, "new", steps=8)  # started, no step logged: no metrics.jsonl, no summary.json
    run = table.load(tmp_path / "new")
    assert run.steps is None and run.status == "no summary.json (step 0 of 8): running, or killed"


def test_a_finished_runs_steps_are_its_summarys_not_the_last_metrics_row(tmp_path):
    make_run(tmp_path, "r", before={}, after={}, steps=10, metrics_rows=4)  # summary.json: 10 steps; metrics end at 4
    assert table.load(tmp_path / "r").steps == 10


def test_only_top_level_per_seed_keys_are_left_out_of_the_settings():
    flat = table.flatten({"seed": 1, "output_dir": "x", "logging": {"wandb": True}, "task": {"seed": 3}})
    assert flat == {"task.seed": "3"}  # a task's own seed picks its data: a setting, not the run's seed


def test_an_empty_section_is_a_value_of_its_own():
    assert table.flatten({"rollout": {}, "optim": {"lr": 0.1}}) == {"rollout": "{}", "optim.lr": "0.1"}


def test_lists_of_mappings_compare_whatever_their_key_order():
    def run(name, atom):
        return table.Run(Path(name), {"seed": 0, "reward": {"atoms": [atom]}, "optim": {"lr": 0.1}}, None, None)

    same = [run("a", {"name": "acc", "weight": 1.0}), run("b", {"weight": 1.0, "name": "acc"})]
    assert table.varying(same) == []
    assert len(table.group_rows(same, [])) == 1  # one configuration, two seeds' worth


def test_seeds_group_whatever_the_key_order_of_their_configs():
    a = table.Run(Path("a"), {"seed": 0, "optim": {"lr": 0.1, "betas": [0.9, 0.99]}, "train": {"max_steps": 4}}, None, 4)
    b = table.Run(Path("b"), {"train": {"max_steps": 4}, "optim": {"betas": [0.9, 0.99], "lr": 0.1}, "seed": 1}, None, 4)
    (row,) = table.group_rows([a, b], [])
    assert row["seeds"] == [0, 1] and row["runs"] == ["a", "b"]


def test_a_damaged_run_changes_no_label_and_no_group(tmp_path):
    for seed in (0, 1):
        make_run(tmp_path, f"ok{seed}", seed=seed, before={"m": 0.0}, after={"m": 1.0})
    for name in ("bad1", "bad2"):
        (make_run(tmp_path, name, before={}, after={}) / "summary.json").write_text("{not json")
    runs = [table.load(p) for p in table.find([tmp_path])]
    assert table.varying(runs) == []  # the damaged runs' empty configs do not make every key differ
    rows = table.run_rows(runs, ["m"])
    assert [r["config"] for r in rows] == [{}, {}, {}, {}]
    assert table.markdown_runs(rows, ["m"]).splitlines()[0] == "| run | seed | steps | m | best | train s | status |"
    groups = table.group_rows(runs, ["m"])
    assert [(len(g["runs"]), g["finished"]) for g in groups] == [(1, 0), (1, 0), (2, 2)]  # each damaged run alone
    assert all(g["status"].startswith("unreadable: ") for g in groups[:2])


def test_the_config_column_shows_when_runs_differ_even_beside_a_damaged_run(tmp_path):
    make_run(tmp_path, "a", lr=1e-4, before={}, after={})
    make_run(tmp_path, "b", lr=1e-3, before={}, after={})
    (make_run(tmp_path, "c", before={}, after={}) / "config.yaml").write_text("[not: a mapping")
    runs = [table.load(p) for p in table.find([tmp_path])]
    assert runs[2].error
    rows = table.run_rows(runs, [])
    assert rows[2]["config"] == {}  # no settings known, not optim.lr=null
    lines = table.markdown_runs(rows, []).splitlines()
    assert lines[0] == "| run | config | seed | steps | best | train s | status |"
    assert lines[2].startswith(f"| {tmp_path / 'a'} | optim.lr=0.0001 | 0 | 10 |")
    assert lines[4].startswith(f"| {tmp_path / 'c'} |  |  |  |  |  | unreadable: ")


def test_metric_names_come_from_before_and_after_and_skip_unfinished_runs(tmp_path):
    make_run(tmp_path, "a", before={"kl": 0.0}, after={"accuracy": 0.5})
    make_run(tmp_path, "b", metrics_rows=2)  # unfinished: no summary
    runs = [table.load(p) for p in table.find([tmp_path])]
    assert table.metric_names(runs, []) == ["kl", "accuracy"]
    assert table.metric_names(runs, ["kl"]) == ["kl"]


def test_the_cli_lists_a_folder_with_an_unfinished_run(tmp_path):
    make_run(tmp_path, "a", before={"accuracy": 0.5}, after={"accuracy": 0.75})
    make_run(tmp_path, "b", seed=1, metrics_rows=2)
    result = CliRunner().invoke(app, ["runs", str(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[2].endswith("| 0 | 10 | 0.500 → 0.750 |  | 60 | finished |")
    assert lines[3].endswith("| 1 | 2 |  |  |  | no summary.json (step 2 of 10): running, or killed |")
    assert result.output.endswith("running, or killed |\n")  # the table's own last newline, no blank line after


def test_numbers_that_are_not_finite_or_are_booleans_are_null(tmp_path):
    path = make_run(tmp_path, "a", seed=0, before={"m": 1.0, "ok": 0.0}, after={"m": 2.0, "ok": 1.0}, seconds=30.0)
    (path / "summary.json").write_text('{"eval_before": {"m": NaN, "ok": false}, "eval_after": {"m": Infinity, '
                                       '"ok": true}, "steps": 10, "train_seconds": NaN}')
    make_run(tmp_path, "b", seed=1, before={"m": 1.0}, after={"m": 4.0}, seconds=30.0)
    runs = [table.load(p) for p in table.find([tmp_path])]
    row = table.run_rows(runs, ["m", "ok"])[0]
    assert row["before"] == {"m": None, "ok": None} and row["after"] == {"m": None, "ok": None}
    assert row["train_seconds"] is None
    (g,) = table.group_rows(runs, ["m"])
    s = g["metrics"]["m"]
    assert s["n"] == 1 and s["after_mean"] == 4.0 and s["change_mean"] == 3.0  # run b alone: 4 - 1
    assert g["train_seconds_mean"] == 30.0  # run a's NaN is not counted


def test_a_run_without_training_time_is_left_out_of_the_mean_time(tmp_path):
    make_run(tmp_path, "a", seed=0, before={}, after={}, seconds=40.0)
    path = make_run(tmp_path, "b", seed=1, before={}, after={})
    (path / "summary.json").write_text(json.dumps({"eval_before": {}, "eval_after": {}, "steps": 10}))
    (g,) = table.group_rows([table.load(p) for p in table.find([tmp_path])], [])
    assert g["finished"] == 2 and g["train_seconds_mean"] == 40.0


def test_group_cells_with_no_finished_value_or_no_change(tmp_path):
    make_run(tmp_path, "done", lr=1e-4, before={"m": None}, after={"m": 0.5})  # after, but no change
    make_run(tmp_path, "going", lr=1e-3, metrics_rows=3)  # nothing finished
    runs = [table.load(p) for p in table.find([tmp_path])]
    text = table.markdown_groups(table.group_rows(runs, ["m"]), ["m"])
    assert "| optim.lr=0.0001 | 0 | 1 of 1 | 0.500 | 60 |" in text
    assert "| optim.lr=0.001 | 0 | 0 of 1 |  |  |" in text


def test_a_pipe_or_a_newline_in_a_cell_keeps_the_table_whole():
    text = table._table(["a", "b"], [["x|y", "one\ntwo"]])
    assert text == "| a | b |\n| --- | --- |\n| x\\|y | one two |\n"


def test_a_label_of_exactly_four_settings_counts_none_more():
    assert table._label({"a": 1, "b": 2, "c": 3, "d": 4}) == "a=1 b=2 c=3 d=4"


def test_a_type_like_key_that_is_not_a_sections_type_hides_nothing(tmp_path):
    make_run(tmp_path, "a", before={}, after={}, model={"dtype": "float32", "device": "cpu"})
    make_run(tmp_path, "b", before={}, after={}, model={"dtype": "bfloat16", "device": "cuda"})
    runs = [table.load(p) for p in table.find([tmp_path])]
    assert table.varying(runs) == ["model.device", "model.dtype"]  # config order (make_run's YAML is sorted)


def test_a_metric_chosen_twice_is_one_column(tmp_path):
    make_run(tmp_path, "a", before={"accuracy": 0.5, "reward": 1.0}, after={"accuracy": 0.75, "reward": 2.0})
    runs = [table.load(tmp_path / "a")]
    assert table.metric_names(runs, ["accuracy", "accuracy"]) == ["accuracy"]


def test_two_finished_runs_of_one_seed_in_a_group_are_warned_of(tmp_path):
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        make_run(tmp_path, name, seed=seed, before={"m": 0.0}, after={"m": 1.0})
    runs = [table.load(p) for p in table.find([tmp_path])]
    with pytest.warns(UserWarning, match=r"share seed 0 \(.*/a, .*/b\)"):
        (row,) = table.group_rows(runs, ["m"])
    assert row["metrics"]["m"]["n"] == 3  # still counted, as the warning says


def _checkpoint(run, step):
    """A complete checkpoint of `step` in `run` (as list_checkpoints sees one: its trainer state)."""
    from mmrl.core.checkpoint import STATE_JSON, step_dir

    d = step_dir(run / "checkpoints", step)
    d.mkdir(parents=True)
    (d / STATE_JSON).write_text("{}")


def test_an_unfinished_run_says_how_its_last_start_ended_where_environment_json_records_it(tmp_path):
    from mmrl.core import provenance

    path = make_run(tmp_path, "r", seed=0, metrics_rows=3)
    provenance.record(path, step=0)  # this process: still going
    assert table.load(path).status == f"running (pid {os.getpid()}; step 3 of 10)"  # no "ended" yet
    provenance.ended(path, "stopped by SIGTERM", 3)
    assert table.load(path).status == "stopped by SIGTERM (at step 3 of 10; no checkpoint to resume from)"
    _checkpoint(path, 3)  # what SIGTERM saves: the step it came in
    assert table.load(path).status == "stopped by SIGTERM (at step 3 of 10)"
    provenance.ended(path, "interrupted", 5)  # Ctrl-C at step 5 keeps step 3's checkpoint, not step 5
    assert table.load(path).status == "interrupted (at step 5 of 10; --resume goes on from step 3)"
    provenance.record(path, step=3)  # a --resume: its start has not ended
    assert table.load(path).status.startswith("running (pid ")


def test_a_finished_ending_without_summary_json_says_so(tmp_path):
    from mmrl.core import provenance

    path = make_run(tmp_path, "r", seed=0, metrics_rows=3)
    provenance.record(path, step=0)
    provenance.ended(path, "finished", 3)  # recorded, then the kill came before summary.json
    assert table.load(path).status == ("finished at step 3 of 10, but no summary.json "
                                       "(deleted, or killed as it was written)")


def _newest_start(path, **fields):
    """Rewrite the newest entry of path/environment.json with `fields` (None: drop the key)."""
    env = path / "environment.json"
    entries = json.loads(env.read_text())
    entries[-1].update(fields)
    entries[-1] = {k: v for k, v in entries[-1].items() if v is not None}
    env.write_text(json.dumps(entries))


def test_a_start_without_an_ending_is_running_or_killed_by_its_process_on_this_host(tmp_path):
    from mmrl.core import provenance

    path = make_run(tmp_path, "r", seed=0, metrics_rows=3)
    provenance.record(path, step=0)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its PID names no process now (or, reused, one that started later)
    _newest_start(path, pid=child.pid)
    assert table.load(path).status == "killed (no ending recorded; step 3 of 10; no checkpoint to resume from)"
    _newest_start(path, pid=os.getpid(), host="another-node")  # its process cannot be seen from here
    assert table.load(path).status == "no summary.json (step 3 of 10): running, or killed"
    _newest_start(path, host=None, pid=None, pid_started=None)  # written before environment.json had them
    assert table.load(path).status == "no summary.json (step 3 of 10): running, or killed"
    _newest_start(path, host=socket.gethostname(), pid=os.getpid())
    assert table.load(path).status == f"running (pid {os.getpid()}; step 3 of 10)"
    (row,) = table.run_rows([table.load(path)], [])
    assert row["status"] == f"running (pid {os.getpid()}; step 3 of 10)"  # --json says it too


def test_a_damaged_ending_counts_as_none(tmp_path):
    from mmrl.core import provenance

    path = make_run(tmp_path, "r", seed=0, metrics_rows=3)
    provenance.record(path, step=0)
    _newest_start(path, ended="stopped by SIGTERM")  # not the {"at", "step", "how"} object
    assert provenance.last_ending(path) is None
    assert table.load(path).status == f"running (pid {os.getpid()}; step 3 of 10)"
    from mmrl.demo.report import _ending

    assert _ending(json.loads((path / "environment.json").read_text())[-1]) == f"running (pid {os.getpid()})"


def test_a_start_that_logged_no_step_yet_is_at_step_0(tmp_path):
    from mmrl.core import provenance

    path = make_run(tmp_path, "r", seed=0)  # no metrics.jsonl: the evaluation before training, say
    provenance.record(path, step=0)
    assert table.load(path).status == f"running (pid {os.getpid()}; step 0 of 10)"
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    _newest_start(path, pid=child.pid)
    assert table.load(path).status == "killed (no ending recorded; step 0 of 10; no checkpoint to resume from)"
