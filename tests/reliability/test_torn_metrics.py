"""A kill -9 in the middle of writing a metrics row leaves half a line at the end of
metrics.jsonl: resuming drops it (and only it), and rows go on after whole lines."""

from __future__ import annotations

import json

import pytest

from mmrl.core.logging import RunLogger, read_finished_run, read_metrics, truncate_metrics


def write(path, rows, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail, encoding="utf-8")


def test_a_torn_last_line_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}]
    write(path, rows, tail='{"step": 3, "lo')  # the kill landed mid-write
    assert read_metrics(path) == rows
    logger = RunLogger(tmp_path, total_steps=4, start_step=2, tensorboard=False, progress=False)
    logger.log(3, {"loss": 0.3})
    logger.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert all(json.loads(line) for line in path.read_text().splitlines())  # every line whole


def test_a_bad_line_in_the_middle_is_an_error_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2"):
        read_metrics(path)


def test_a_bad_line_met_on_resume_is_a_user_error_naming_it(tmp_path):
    from mmrl.core.checkpoint import CheckpointError

    path = tmp_path / "metrics.jsonl"
    path.write_text('garbage\n{"step": 2}\n', encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"metrics.jsonl, line 1: not a JSON metrics row .*fix or remove"):
        truncate_metrics(path, 2)


def test_truncate_keeps_whole_rows_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write(path, [{"step": s} for s in (1, 2, 3)], tail='{"st')
    truncate_metrics(path, 2)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_a_finished_run_is_read_and_an_unfinished_one_refused(tmp_path):
    """What the benchmarks' --reuse tables: a run with its summary; none where nothing ran; a
    run with metrics but no summary (going, or killed) is an error, never trained over."""
    assert read_finished_run(tmp_path / "none") is None
    write(tmp_path / "metrics.jsonl", [{"step": 1}], tail='{"st')
    with pytest.raises(ValueError, match="no summary.json"):
        read_finished_run(tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps({"eval_after": {"accuracy": 0.5}}))
    assert read_finished_run(tmp_path) == ({"eval_after": {"accuracy": 0.5}}, [{"step": 1}])


def test_a_resumed_runs_tensorboard_drops_the_steps_after_its_checkpoint(tmp_path):
    """metrics.jsonl is cut back to the checkpoint on resume; TensorBoard's events now are too
    (purge_step): the plot held both the discarded steps 3-4 and their replacements."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = RunLogger(tmp_path, total_steps=4, progress=False)
    for step in range(1, 5):
        first.log(step, {"optim/lr": 0.003})
    first.close()
    again = RunLogger(tmp_path, total_steps=4, start_step=2, progress=False)  # resumed from step 2
    for step in (3, 4):
        again.log(step, {"optim/lr": 0.03})
    again.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("optim/lr")] == [
        (1, 0.003), (2, 0.003), (3, 0.03), (4, 0.03)]
