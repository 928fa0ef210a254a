"""A run's own logs as a researcher reads them: reward_curve.png (mmrl.core.logging) from the
metrics.jsonl rows a run writes, non-finite values included."""

from __future__ import annotations

import pytest

from mmrl.core.logging import RunLogger, plot_reward_curve, read_metrics


def test_the_reward_curve_leaves_out_a_step_whose_reward_was_not_finite(tmp_path, monkeypatch):
    """RunLogger writes a NaN reward as the string "nan"; reward_curve.png (drawn as summary.json is
    written) failed on it with a TypeError in the running mean, which ended a trained run with a
    traceback."""
    import matplotlib.figure

    logger = RunLogger(tmp_path, total_steps=4, tensorboard=False, progress=False)
    for step, reward in enumerate([0.1, float("nan"), 0.3, 0.5], 1):
        logger.log(step, {"reward/total": reward})
    logger.close()
    assert [r["reward/total"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0.1, "nan", 0.3, 0.5]
    drawn = []
    savefig = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig), savefig(fig, *a, **k)))
    plot_reward_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png")
    line = drawn[0].axes[0].get_lines()[0]
    assert list(line.get_xdata()) == [1, 3, 4] and list(line.get_ydata()) == [0.1, 0.3, 0.5]
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_reports_curves_mark_whole_steps_only(tmp_path, monkeypatch):
    """report.html's curves (runs.plot_curves) had ticks at steps 1.25, 1.5, ... on a short run."""
    import matplotlib.figure
    from test_runs_table import make_run

    from mmrl.demo.runs import RunInfo, plot_curves

    run = make_run(tmp_path, "r", before={"accuracy": 0.2}, after={"accuracy": 0.5}, steps=3, metrics_rows=3)
    drawn = []
    savefig = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig), savefig(fig, *a, **k)))
    plot_curves(RunInfo.load(run))
    left, right = drawn[0].axes
    assert [t for t in left.get_xticks() if 1 <= t <= 3] == [1, 2, 3]
    assert all(t == int(t) for t in right.get_xticks()) and 1 in right.get_xticks()


def test_a_broken_tensorboard_install_says_how_to_mend_or_silence_it(tmp_path, monkeypatch):
    import sys

    from mmrl.core.logging import _tensorboard_writer

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as an uninstalled one does
    with pytest.warns(UserWarning, match=r"TensorBoard logging is off \(pip install tensorboard; "
                                         r"--set logging.tensorboard=false turns it off without this warning\)"):
        assert _tensorboard_writer(tmp_path / "tb", None) is None


def test_sample_tables_keep_text_readable_and_a_lone_surrogate_escaped(tmp_path):
    """A sample table is read by people (`less samples/step_*.jsonl`): "é" and "加" are written
    as themselves in UTF-8, where json.dumps wrote \\u00e9 and \\u52a0. A row holding a lone
    surrogate (no UTF-8 form) is escaped, not an encoding error; both read back the same."""
    import json

    from mmrl.core.logging import RunLogger

    logger = RunLogger(tmp_path, total_steps=4, tensorboard=False, progress=False)
    rows = [{"prompt": "3+4=加", "completion": "café"}, {"prompt": "x", "completion": "bad \ud800 byte"}]
    path = logger.samples(1, rows)
    logger.close()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0] == '{"prompt": "3+4=加", "completion": "café"}'
    assert "\\ud800" in lines[1]
    assert [json.loads(line) for line in lines] == rows
