"""A run's own logs as a researcher reads them: reward_curve.png (mmrl.core.logging) from the
metrics.jsonl rows a run writes, non-finite values included."""

from __future__ import annotations

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
