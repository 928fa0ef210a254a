"""The end of a long run (100,000+ steps): what it reads and writes once the steps are done,
and what piles up while they run (sample tables), kept to a fixed cost."""

from __future__ import annotations

import json

import pytest
import toy

from mmrl.core import logging as mlog
from mmrl.core.config import ConfigError, TrainConfig, load_config
from mmrl.core.logging import RunLogger, read_finished_run, read_metrics
from mmrl.core.trainer import Trainer


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 3-step toy run that logs samples every step and keeps the last 2 tables: (its directory,
    its summary, the metrics.jsonl parses each write_summary call made)."""
    out = tmp_path_factory.mktemp("long_end") / "run"
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[
        f"output_dir={out}", "train.max_steps=3", "rollout.prompts_per_step=2", "rollout.num_generations=2",
        "logging.tensorboard=false", "logging.progress=false", "train.log_samples_every=1",
        "logging.keep_last_samples=2"])
    trainer = Trainer(cfg, *toy.build(cfg))
    toy.log_constant(trainer.method, "x/nan", float("nan"))  # a metric without a finite value
    toy.log_constant(trainer.method, "x/inf", float("inf"))
    reads, during = [], []
    read, write_summary = mlog._read_metrics, trainer.write_summary

    def counted(*a, **kw):
        before = len(reads)
        try:
            return write_summary(*a, **kw)
        finally:
            during.append(len(reads) - before)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mlog, "_read_metrics", lambda path: reads.append(path) or read(path))
        mp.setattr(trainer, "write_summary", counted)
        summary = trainer.train()
    return out, summary, during


def test_the_end_of_a_run_parses_metrics_jsonl_once(finished):
    # summary.json, reward_curve.png and report.html each parsed it: 3 x 5 s of a 100,000-row file
    out, summary, during = finished
    assert during == [1]
    assert summary["final_metrics"]["step"] == 3
    assert (out / "reward_curve.png").stat().st_size > 0
    assert "3 steps" in (out / "report.html").read_text()


def test_logging_keep_last_samples_keeps_the_newest_sample_tables(finished):
    out, _, _ = finished
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["step_00000002.jsonl", "step_00000003.jsonl"]
    assert "training samples, step 3" in (out / "report.html").read_text()


def tables(root):
    return sorted(p.name for p in (root / "samples").glob("step_*.jsonl"))


def test_sample_tables_are_all_kept_by_default_and_other_samples_files_always(tmp_path):
    logger = RunLogger(tmp_path, total_steps=40, tensorboard=False, progress=False)
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "grid_before.png").write_bytes(b"png")
    for step in (10, 20, 30):
        logger.samples(step, [{"prompt": "p", "reward": 1.0}])
    assert tables(tmp_path) == ["step_00000010.jsonl", "step_00000020.jsonl", "step_00000030.jsonl"]
    kept = RunLogger(tmp_path, total_steps=40, tensorboard=False, progress=False, keep_samples=1)
    kept.samples(40, [{"prompt": "p", "reward": 1.0}])
    assert tables(tmp_path) == ["step_00000040.jsonl"]
    assert (tmp_path / "samples" / "grid_before.png").read_bytes() == b"png"


def test_a_resumed_run_keeps_its_new_table_not_the_killed_starts_later_ones(tmp_path):
    # the killed start logged steps 10-30 and saved step 10: the resume writes step 20 again.
    # Newest by name would keep the stale step 30 and delete the step 20 just written.
    for step in (10, 20, 30):
        RunLogger(tmp_path, total_steps=40, tensorboard=False, progress=False).samples(step, [{"reward": 0.0}])
    resumed = RunLogger(tmp_path, total_steps=40, start_step=10, tensorboard=False, progress=False, keep_samples=2)
    resumed.samples(20, [{"reward": 1.0}])
    assert tables(tmp_path) == ["step_00000010.jsonl", "step_00000020.jsonl"]
    assert '"reward": 1.0' in (tmp_path / "samples" / "step_00000020.jsonl").read_text()


def test_keep_last_samples_below_one_is_refused():
    with pytest.raises(ConfigError, match=r"logging.keep_last_samples: Input should be greater than or equal to 1"):
        load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=["logging.keep_last_samples=0"])


def strict(text: str):
    """json.loads as jq and JavaScript parse: a bare NaN or Infinity is an error."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))


def test_summary_json_holds_null_for_a_metric_without_a_finite_value(finished):
    # final_metrics held metrics.jsonl's text "nan": pandas read the column as text, jq's
    # `.final_metrics["x/nan"] == null` was false; eval_before / eval_after already held null
    out, summary, _ = finished
    written = strict((out / "summary.json").read_text())
    assert written["final_metrics"]["x/nan"] is None and written["final_metrics"]["x/inf"] is None
    assert summary["final_metrics"]["x/nan"] is None
    assert written["final_metrics"]["loss/total"] == summary["final_metrics"]["loss/total"]
    last = read_metrics(out / "metrics.jsonl")[-1]  # the log keeps which non-finite value it was
    assert (last["x/nan"], last["x/inf"]) == ("nan", "inf")


def test_an_older_summary_with_nan_texts_and_bare_nans_reads_as_null_everywhere(tmp_path):
    from mmrl.demo import report, runs, table

    run = tmp_path / "old"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "reward/total": 0.5}\n{"step": 2, "reward/total": "nan"}\n')
    (run / "summary.json").write_text(  # as written before: a bare NaN in eval_*, "nan" in final_metrics
        '{"steps": 2, "eval_before": {"accuracy": NaN, "format": 0.5}, "eval_after": {"accuracy": "nan", '
        '"format": 0.75}, "final_metrics": {"step": 2, "reward/total": "nan", "loss/total": "-inf"}}')
    info = runs.RunInfo.load(run)
    assert info.summary["eval_before"] == {"accuracy": None, "format": 0.5}
    assert info.summary["eval_after"] == {"accuracy": None, "format": 0.75}
    assert info.summary["final_metrics"] == {"step": 2, "reward/total": None, "loss/total": None}
    assert read_finished_run(run)[0] == info.summary  # a benchmark's --reuse reads it so too
    assert "eval/accuracy" not in info.curves()  # no NaN point at step 0
    loaded = table.load(run)
    assert (loaded.evaluation("before", "accuracy"), loaded.evaluation("after", "format")) == (None, 0.75)
    rows = table.run_rows([loaded], ["accuracy", "format"])
    assert strict(json.dumps(rows))[0]["after"] == {"accuracy": None, "format": 0.75}  # `runs --json`
    metrics = report.render(info).split("<h2>Curves</h2>")[0]  # before the base64 images
    assert "<td>accuracy</td><td>n/a</td><td>n/a</td><td></td>" in metrics and "nan" not in metrics.lower()


def test_runs_plot_and_the_report_show_the_final_evaluation_of_a_resumed_runs_earlier_end(tmp_path):
    # trained to step 4 (its final evaluation, 0.6, only in summary.json), then --resume with
    # max_steps=6: summary.json moved to summary.step-4.json, and the plots lost the step-4 point
    from mmrl.demo import plot, runs, table

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    evals = {2: 0.5, 5: 0.7}
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "reward/total": 0.1, **({"eval/accuracy": evals[s]} if s in evals else {})}) + "\n"
        for s in range(1, 7)))
    (run / "summary.step-4.json").write_text(json.dumps(
        {"steps": 4, "eval_before": {"accuracy": 0.2}, "eval_after": {"accuracy": 0.6, "format": 1.0}}))
    (run / "summary.step-3.json").write_text("{damaged")  # left out, not an error
    (run / "summary.json").write_text(json.dumps(
        {"steps": 6, "eval_before": {"accuracy": 0.2}, "eval_after": {"accuracy": 0.9}}))
    curve = plot.metric_curve(table.load(run), "accuracy")
    assert (curve.steps, curve.values) == ([0, 2, 4, 5, 6], [0.2, 0.5, 0.6, 0.7, 0.9])
    assert runs.RunInfo.load(run).curves()["eval/accuracy"] == ([0, 2, 4, 5, 6], [0.2, 0.5, 0.6, 0.7, 0.9])
    (run / "summary.json").unlink()  # the resumed start still going: what it has, with step 4's
    curve = plot.metric_curve(table.load(run), "accuracy")
    assert (curve.steps, curve.values) == ([2, 4, 5], [0.5, 0.6, 0.7])
    assert runs.RunInfo.load(run).curves()["eval/accuracy"] == ([2, 4, 5], [0.5, 0.6, 0.7])
