"""train.best_metric: the best checkpoint by a held-out metric, kept past keep_last (mmrl.core.best)."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
import toy
from transformers import LlamaForCausalLM

from mmrl.core.best import BEST, BestCheckpoint
from mmrl.core.checkpoint import CheckpointError, list_checkpoints
from mmrl.core.config import ConfigError, TrainConfig, load_config
from mmrl.core.trainer import Trainer


def make(tmp_path, *overrides):
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG,
                      overrides=[f"output_dir={tmp_path / 'run'}", "train.eval_every=2", "train.keep_last=1",
                                 "train.best_metric=accuracy", *overrides])
    return Trainer(cfg, *toy.build(cfg))


def scripted(trainer, by_step: dict[int, float], seen: dict | None = None):
    """The trainer's held-out evaluation gives accuracy by_step[step]; `seen` collects the
    weights each evaluation saw."""
    def evaluate(samples_tag=None, **kw):
        if seen is not None:
            seen[trainer.step] = {k: v.detach().clone() for k, v in trainer.policy.model.state_dict().items()}
        return {"accuracy": by_step[trainer.step], "format": 1.0}

    trainer.evaluate = evaluate
    return trainer


def steps_on_disk(tmp_path):
    return [n for n, _ in list_checkpoints(tmp_path / "run" / "checkpoints")]


def test_the_best_evaluation_s_checkpoint_is_kept_past_keep_last_and_holds_its_weights(tmp_path):
    seen = {}
    trainer = scripted(make(tmp_path, "train.max_steps=6"), {0: 0.1, 2: 0.5, 4: 0.9, 6: 0.3}, seen)
    summary = trainer.train()
    best = json.loads((tmp_path / "run" / "best.json").read_text())
    assert best["step"] == 4 and best["value"] == 0.9 and (best["metric"], best["mode"]) == ("accuracy", "max")
    assert summary["best"] == best
    assert steps_on_disk(tmp_path) == [4, 6]  # keep_last 1: the newest, and the best apart from it
    loaded = LlamaForCausalLM.from_pretrained(f"{best['checkpoint']}/model").state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in seen[4].items())
    assert not all(torch.equal(loaded[k], v) for k, v in seen[6].items())  # it is not the final model
    report = (tmp_path / "run" / "report.html").read_text()
    assert f"best by held-out accuracy: 0.9 at step 4, <code>{best['checkpoint']}/model</code>" in report


def test_mode_min_keeps_the_lowest_and_a_later_best_replaces_the_earlier(tmp_path):
    trainer = scripted(make(tmp_path, "train.max_steps=6", "train.best_mode=min"), {0: 0.5, 2: 0.4, 4: 0.2, 6: 0.3})
    assert trainer.train()["best"]["step"] == 4
    # step 2 was the best until step 4 replaced it; then it was an old checkpoint, pruned
    assert steps_on_disk(tmp_path) == [4, 6]


def test_the_final_evaluation_competes_and_ties_keep_the_earlier(tmp_path):
    trainer = scripted(make(tmp_path, "train.max_steps=6"), {0: 0.1, 2: 0.5, 4: 0.5, 6: 0.7})
    assert trainer.train()["best"]["step"] == 6
    assert steps_on_disk(tmp_path) == [6]  # the best is the newest: nothing else kept
    trainer = scripted(make(tmp_path / "b", "train.max_steps=6"), {0: 0.1, 2: 0.5, 4: 0.5, 6: 0.4})
    assert trainer.train()["best"]["step"] == 2  # 0.5 at step 4 only equals it


def test_a_nan_evaluation_is_never_the_best(tmp_path):
    trainer = scripted(make(tmp_path, "train.max_steps=4"), {0: 0.1, 2: math.nan, 4: 0.2})
    assert trainer.train()["best"]["step"] == 4
    trainer = scripted(make(tmp_path / "b", "train.max_steps=4"), {0: 0.1, 2: math.nan, 4: math.nan})
    assert trainer.train()["best"] is None
    assert not (tmp_path / "b" / "run" / "best.json").exists()


def test_after_a_skipped_last_step_the_final_evaluation_of_the_same_weights_keeps_the_earlier_best(tmp_path):
    """The last step's update is skipped (an inf gradient): its checkpoint, written at the end as
    any run's is, holds step 2's weights, and the final evaluation scores them again. It still
    competes (it scores that checkpoint's weights), but equal scores keep the earlier step, so it
    only names checkpoint 3 where it beats every step evaluated before, as for any final step."""
    trainer = make(tmp_path, "train.max_steps=3")  # the toy task's real, greedy evaluation
    logprobs = trainer.policy.logprobs

    def inf_gradient_in_step_3(batch):
        out = logprobs(batch)
        if torch.is_grad_enabled() and trainer.step + 1 == 3:
            out.register_hook(lambda g: torch.full_like(g, math.inf))
        return out

    trainer.policy.logprobs = inf_gradient_in_step_3
    with pytest.warns(UserWarning, match="step 3: 1 update"):
        summary = trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["train/bad_step"] == 1.0 and summary["eval_after"]["accuracy"] == rows[1]["eval/accuracy"]
    assert summary["best"]["step"] == 2 and steps_on_disk(tmp_path) == [2, 3]


def test_a_metric_the_task_does_not_report_stops_the_run_before_its_first_step(tmp_path):
    trainer = scripted(make(tmp_path, "train.max_steps=4", "train.best_metric=acc"), {0: 0.1})
    with pytest.raises(ConfigError, match=r"train.best_metric: 'acc' is not a held-out metric of this task; "
                                          r"it reports accuracy, format"):
        trainer.train()
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and steps_on_disk(tmp_path) == []


def test_best_metric_without_evaluations_during_training_is_refused():
    with pytest.raises(ConfigError, match="best_metric needs eval_every > 0"):
        load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=["train.best_metric=accuracy"])


def test_resume_goes_on_from_the_recorded_best_and_spares_it(tmp_path):
    scripted(make(tmp_path, "train.max_steps=4"), {0: 0.1, 2: 0.5, 4: 0.9}).train()
    summary = scripted(make(tmp_path, "train.max_steps=8"), {4: 0.9, 6: 0.7, 8: 0.8}).train(resume=True)
    assert summary["best"]["step"] == 4 and summary["best"]["value"] == 0.9  # 0.7 and 0.8 do not beat it
    assert steps_on_disk(tmp_path) == [4, 8]


class Killed(BaseException):
    """A kill -9 stand-in: no handler of the trainer's catches it, so nothing more is written."""


def killed_before_recording(trainer, at: int):
    """The run dies once step `at`'s checkpoint is written, before best.json names it."""
    update = trainer.best.update

    def dies(step, metrics, checkpoint):
        if step == at:
            raise Killed
        update(step, metrics, checkpoint)

    trainer.best.update = dies
    return trainer


@pytest.mark.parametrize("save_every", [0, 4], ids=["saved-as-the-best", "saved-by-save_every"])
def test_a_kill_between_the_best_checkpoint_and_best_json_loses_nothing_on_resume(tmp_path, save_every):
    """Step 4 beats step 2; the run dies after writing checkpoint 4 (by _save_best, or by
    save_every just before it) and before best.json names it. The resume from checkpoint 4
    takes its evaluation from metrics.jsonl: step 6's 0.7 does not beat it, and keep_last
    does not prune it."""
    trainer = killed_before_recording(
        scripted(make(tmp_path, "train.max_steps=8", f"train.save_every={save_every}"), {0: 0.1, 2: 0.5, 4: 0.9}),
        at=4)
    with pytest.raises(Killed):
        trainer.train()
    assert json.loads((tmp_path / "run" / BEST).read_text())["step"] == 2 and steps_on_disk(tmp_path) == [2, 4]
    resumed = scripted(make(tmp_path, "train.max_steps=8", f"train.save_every={save_every}"), {6: 0.7, 8: 0.8})
    summary = resumed.train(resume=True)
    assert (summary["best"]["step"], summary["best"]["value"]) == (4, 0.9)
    assert json.loads((tmp_path / "run" / BEST).read_text()) == summary["best"]
    assert steps_on_disk(tmp_path) == [4, 8]  # step 2, the best it replaced, pruned


def test_the_best_a_resume_adopts_prunes_the_one_it_replaces_before_any_step(tmp_path):
    trainer = killed_before_recording(scripted(make(tmp_path, "train.max_steps=8"), {0: 0.1, 2: 0.5, 4: 0.9}), at=4)
    with pytest.raises(Killed):
        trainer.train()
    resumed = make(tmp_path, "train.max_steps=8")

    def killed_at_once(logger=None):
        raise Killed

    resumed.train_step = killed_at_once  # no later save prunes it
    with pytest.raises(Killed):
        resumed.train(resume=True)
    assert json.loads((tmp_path / "run" / BEST).read_text())["step"] == 4 and steps_on_disk(tmp_path) == [4]


def test_a_resume_with_a_damaged_metrics_file_says_which_line_even_with_a_best_metric(tmp_path):
    scripted(make(tmp_path, "train.max_steps=4", "train.save_every=2"), {0: 0.1, 2: 0.5, 4: 0.9}).train()
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text("{bad\n" + metrics.read_text().split("\n", 1)[1])
    with pytest.raises(CheckpointError, match=r"metrics.jsonl, line 1: not a JSON metrics row .*fix or remove"):
        scripted(make(tmp_path, "train.max_steps=6"), {6: 0.7}).train(resume=True)


def test_a_resumed_bad_step_or_a_nan_evaluation_is_not_adopted(tmp_path):
    """As they ran: a bad step's evaluation never competed, and a NaN (logged as "nan") never beats."""
    ckpt = tmp_path / "checkpoints" / "step-00000004"
    for row in (None, {"step": 4}, {"step": 4, "eval/accuracy": 0.9, "train/bad_step": 1.0},
                {"step": 4, "eval/accuracy": "nan"}, {"step": 4, "eval/accuracy": 0.4}, {"step": 4, "eval/format": 1.0}):
        best = BestCheckpoint(tmp_path, "accuracy")
        best.record = _record()  # 0.5 at step 2
        assert not best.adopt(4, row, ckpt) and best.step == 2
    assert not (tmp_path / BEST).exists()
    assert not BestCheckpoint(tmp_path, None).adopt(4, {"step": 4, "eval/accuracy": 0.9}, ckpt)
    best = BestCheckpoint(tmp_path, "accuracy")  # no record yet: a finite score is the best
    assert best.adopt(4, {"step": 4, "eval/accuracy": 0.25}, ckpt)
    assert json.loads((tmp_path / BEST).read_text())["step"] == 4 == best.step
    assert best.adopt(6, {"step": 6, "eval/accuracy": 1}, ckpt) and best.record["value"] == 1  # a whole number is a score


@pytest.mark.filterwarnings("ignore:--resume at step 4 with settings that differ")
def test_resume_ranking_by_another_metric_starts_afresh_with_a_warning(tmp_path):
    scripted(make(tmp_path, "train.max_steps=4"), {0: 0.1, 2: 0.5, 4: 0.9}).train()
    trainer = scripted(make(tmp_path, "train.max_steps=8", "train.best_mode=min"), {4: 0.9, 6: 0.7, 8: 0.8})
    with pytest.warns(UserWarning, match=r"best.json ranks by accuracy \(max\), this run by accuracy \(min\)"):
        summary = trainer.train(resume=True)
    assert summary["best"]["step"] == 6 and summary["best"]["mode"] == "min"


def _best_rank(rank, port, tmp):
    from two_ranks import process_group

    with process_group(rank, port, timeout=60):
        cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG,
                          overrides=[f"output_dir={tmp}", "train.max_steps=6", "train.eval_every=2", "train.keep_last=1",
                                     "train.best_metric=accuracy", "logging.tensorboard=false"])
        trainer = Trainer(cfg, *toy.build(cfg))
        # every rank scores alike (held-out evaluation gathers the ranks' shares); steps 4 and 6 are worse
        scripted(trainer, {0: 0.1, 2: 0.9, 4: 0.5, 6: 0.3})
        trainer.train()


@pytest.mark.two_ranks(body=_best_rank)
def test_two_processes_keep_one_best_checkpoint_and_save_together(ranks_ran):
    """The main rank keeps the record and decides for both: a rank deciding alone would save
    (a collective) where the other does not, and the run would hang."""
    assert json.loads((ranks_ran / "best.json").read_text())["step"] == 2
    assert [n for n, _ in list_checkpoints(ranks_ran / "checkpoints")] == [2, 6]


def test_run_slash_best_names_the_best_checkpoint_for_eval(tmp_path):
    from typer.testing import CliRunner

    from mmrl.core.checkpoint import CheckpointError
    from mmrl.core.cli import BackendSpec, make_app, resolve_checkpoint

    app = make_app(BackendSpec(modality="toy", title="toy", command="toy-rl", module="toy"))
    run = tmp_path / "run"
    scripted(make(tmp_path, "train.max_steps=4"), {0: 0.1, 2: 0.9, 4: 0.5}).train()
    assert resolve_checkpoint(run / "best") == run / "checkpoints" / "step-00000002" / "model"
    assert resolve_checkpoint(run) == run / "checkpoints" / "step-00000004" / "model"  # the newest, as before
    def evaluate(checkpoint):
        result = CliRunner().invoke(app, ["eval", "--checkpoint", str(checkpoint)])
        assert result.exit_code == 0, result.output
        assert "settings: the run's" in result.output  # RUN/best lies in the run: its settings
        return json.loads(result.output[result.output.index("{"):])

    assert evaluate(run / "best") == evaluate(run / "checkpoints" / "step-00000002")
    (run / "best.json").write_text(json.dumps({"step": 3, "value": 0.5}))
    with pytest.raises(CheckpointError, match=r"best.json names step 3, but .*step-00000003 is gone"):
        resolve_checkpoint(run / "best")


def _run_with_best(tmp_path, record=None):
    """A run whose checkpoint 2 has its model/, and a best.json (by default naming step 2)."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000002" / "model").mkdir(parents=True)
    (run / BEST).write_text(json.dumps({"step": 2, "value": 0.5} if record is None else record))
    return run


def test_best_alias_leaves_a_real_best_directory_and_other_paths_as_they_are(tmp_path):
    from mmrl.core.cli import best_alias, resolve_checkpoint

    run = _run_with_best(tmp_path)
    assert best_alias(run / "best") == run / "checkpoints" / "step-00000002"
    assert best_alias(run / "checkpoints") == run / "checkpoints"
    (run / "best" / "model").mkdir(parents=True)  # a directory named best is what was meant
    assert resolve_checkpoint(run / "best") == run / "best" / "model"
    with pytest.raises(FileNotFoundError, match=r"checkpoint .*elsewhere/best does not exist"):
        resolve_checkpoint(tmp_path / "elsewhere" / "best")  # no best.json beside it: not the alias


@pytest.mark.parametrize("record, error", [
    ({}, "step None is not a whole number"), ({"step": "two", "value": 1}, "step 'two' is not a whole number"),
    ([2], "not an object but list"), ({"step": True, "value": 1}, "step True is not a whole number"),
    ({"step": 2.7, "value": 1}, "step 2.7 is not a whole number"), ({"step": 2}, "value None is not a number"),
])
def test_best_alias_says_its_best_json_is_unreadable(tmp_path, record, error):
    """As --resume reads it (mmrl.core.best.read_record): a bool or fractional step names no step."""
    from mmrl.core.checkpoint import CheckpointError
    from mmrl.core.cli import best_alias

    run = _run_with_best(tmp_path, record)
    with pytest.raises(CheckpointError, match=rf"checkpoint .*best: .*best.json is unreadable \({error}"):
        best_alias(run / "best")


def test_best_alias_refuses_a_step_left_without_its_model(tmp_path):
    from mmrl.core.checkpoint import CheckpointError
    from mmrl.core.cli import best_alias

    run = _run_with_best(tmp_path)
    (run / "checkpoints" / "step-00000002" / "model").rmdir()
    with pytest.raises(CheckpointError, match=r"names step 2, but .*step-00000002 is gone"):
        best_alias(run / "best")


def test_train_prints_the_best_checkpoint_and_its_alias(tmp_path):
    from typer.testing import CliRunner

    from mmrl.core.cli import BackendSpec, make_app

    app = make_app(BackendSpec(modality="toy", title="toy", command="toy-rl", module="toy"))
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "--max-steps", "1", "-o", str(run), "--set", "train.eval_every=1",
                                      "--set", "train.best_metric=accuracy"])
    assert result.exit_code == 0, result.output
    best = json.loads((run / BEST).read_text())
    assert best["step"] == 1  # the final evaluation, the only one after a step
    line = f"best checkpoint by held-out accuracy ({best['value']:.4g}, step 1): {best['checkpoint']}/model " \
           f"(--checkpoint {run}/best)"
    assert "".join(line.split()) in "".join(result.output.split())  # the console wraps it, paths included


# ---------------------------------------------------------------------------- mutation audit: BestCheckpoint alone


def _record(**changes):
    return {"metric": "accuracy", "mode": "max", "value": 0.5, "step": 2, "checkpoint": "/run/checkpoints/step-2",
            **changes}


def test_check_says_none_where_the_task_reports_no_held_out_metric(tmp_path):
    with pytest.raises(ConfigError, match=r"'accuracy' is not a held-out metric of this task; it reports none$"):
        BestCheckpoint(tmp_path, "accuracy").check({})
    BestCheckpoint(tmp_path, None).check({})  # no best_metric: nothing to check


def test_resume_without_best_metric_leaves_an_earlier_record_alone(tmp_path):
    (tmp_path / BEST).write_text(json.dumps(_record()))
    best = BestCheckpoint(tmp_path, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not "ranks by accuracy (max), this run by None"
        best.resume()
    assert best.record is None and best.step is None and not best.improves({"accuracy": 1.0})


@pytest.mark.parametrize("text", [
    "{not json",
    json.dumps([_record()]),
    json.dumps({k: v for k, v in _record().items() if k != "step"}),  # no step to spare
    json.dumps(_record(step="2")),
    json.dumps(_record(value="0.5")),
    json.dumps(_record(step=True)),
    json.dumps(_record(step=2.5)),
], ids=["not JSON", "a list", "no step", "a string step", "a string value", "a bool step", "a fractional step"])
def test_resume_chooses_afresh_where_the_record_is_unreadable(tmp_path, text):
    (tmp_path / BEST).write_text(text)
    best = BestCheckpoint(tmp_path, "accuracy")
    with pytest.warns(UserWarning, match=r"best.json is unreadable \(.+\): the best checkpoint is chosen afresh"):
        best.resume()
    assert best.record is None and best.step is None and best.improves({"accuracy": 0.0})


def test_resume_takes_a_whole_number_value_and_mode_min_wants_strictly_lower(tmp_path):
    (tmp_path / BEST).write_text(json.dumps(_record(metric="loss", mode="min", value=3, step=4)))
    best = BestCheckpoint(tmp_path, "loss", "min")
    best.resume()
    assert best.step == 4 and best.record["value"] == 3
    assert not best.improves({"loss": 3})  # a tie keeps the earlier checkpoint
    assert not best.improves({"loss": 3.5}) and best.improves({"loss": 2.5})


def test_a_missing_or_non_finite_score_is_never_the_best(tmp_path):
    best = BestCheckpoint(tmp_path, "loss", "min")
    for value in (math.inf, -math.inf, math.nan):
        assert not best.improves({"loss": value})
    assert not best.improves({"format": 0.5})  # the metric is not there
    assert best.improves({"loss": 0.25})  # the first finite score is the best so far


def test_update_records_the_checkpoint_by_its_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    best = BestCheckpoint("run", "accuracy")  # -o run: a relative output directory
    best.update(6, {"accuracy": 0.75, "format": 1.0}, Path("run/checkpoints/step-00000006"))
    expected = {"metric": "accuracy", "mode": "max", "value": 0.75, "step": 6,
                "checkpoint": str(tmp_path.resolve() / "run" / "checkpoints" / "step-00000006")}
    assert json.loads((tmp_path / "run" / BEST).read_text()) == expected == best.record
    assert best.step == 6 and [p.name for p in (tmp_path / "run").iterdir()] == [BEST]  # no .tmp left


def test_a_fresh_run_removes_an_earlier_runs_best_json(tmp_path):
    """A fresh run may start where an earlier one's checkpoints are gone; that run's best.json
    would make RUN/best name this run's checkpoint of the same step, which no evaluation chose."""
    run = tmp_path / "run"
    run.mkdir()
    (run / BEST).write_text(json.dumps({"metric": "accuracy", "mode": "max", "value": 0.9, "step": 2}))
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[f"output_dir={run}", "train.max_steps=2"])
    assert Trainer(cfg, *toy.build(cfg)).train()["best"] is None
    assert not (run / BEST).exists()


def test_a_resume_from_before_the_recorded_best_chooses_it_afresh_among_the_checkpoints_left(tmp_path):
    """best.json names step 4; the user deletes checkpoints 4 and 6 and resumes from 2, so steps 3-6
    train again (to other weights, as with other settings). The record of the old step 4 is dropped
    with a warning, not kept as the bar (0.9) and the name of the new step 4's checkpoint: step 2's
    logged 0.5 competes again and stays the best over the new 0.4 and 0.3."""
    import shutil

    scripted(make(tmp_path, "train.max_steps=6", "train.save_every=2", "train.keep_last=3"),
             {0: 0.1, 2: 0.5, 4: 0.9, 6: 0.3}).train()
    assert json.loads((tmp_path / "run" / BEST).read_text())["step"] == 4 and steps_on_disk(tmp_path) == [2, 4, 6]
    for step in (4, 6):
        shutil.rmtree(tmp_path / "run" / "checkpoints" / f"step-{step:08d}")
    trainer = scripted(make(tmp_path, "train.max_steps=6", "train.save_every=2", "train.keep_last=1"),
                       {4: 0.4, 6: 0.3})
    with pytest.warns(UserWarning, match=r"best.json names step 4, past the checkpoint resumed from \(step 2\), "
                                         r"whose steps train again: the best checkpoint is chosen afresh"):
        summary = trainer.train(resume=True)
    assert (summary["best"]["step"], summary["best"]["value"]) == (2, 0.5)
    assert json.loads((tmp_path / "run" / BEST).read_text()) == summary["best"]
    assert steps_on_disk(tmp_path) == [2, 6]  # the best spared by keep_last 1
