"""`<cli> runs --plot FILE.png` (mmrl/demo/plot.py): the series it draws, worked out by hand from
run directories written here, and the figure the CLI writes."""

from __future__ import annotations

import json
import math

import pytest
from PIL import Image
from test_runs_table import app, make_run
from typer.testing import CliRunner

from mmrl.demo import plot, table


def write_metrics(path, rows):
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def rewards(*values, evals=None):
    """metrics.jsonl rows of steps 1, 2, ...: reward/total, and eval/accuracy at the steps `evals` names."""
    return [{"step": s, "reward/total": v, **({"eval/accuracy": evals[s]} if s in (evals or {}) else {})}
            for s, v in enumerate(values, 1)]


def loaded(root):
    return [table.load(p) for p in table.find([root])]


def test_a_runs_series_are_its_reward_per_step_and_the_metric_before_during_and_after(tmp_path):
    a = make_run(tmp_path, "a", before={"accuracy": 0.2}, after={"accuracy": 0.8}, steps=4)
    write_metrics(a, rewards(0.1, 0.3, "nan", 0.5, evals={2: 0.5}) + [{"reward/total": 9.0}])  # "nan": logged NaN
    b = make_run(tmp_path, "b", lr=1e-3, steps=4)  # stopped at step 3: no summary.json, so no before and after
    write_metrics(b, rewards(0.0, 0.4, 0.6, evals={2: 0.3}))
    runs = loaded(tmp_path)
    assert plot.metric_of(runs, table.metric_names(runs, [])) == "accuracy"
    sa, sb = plot.run_series(runs, "accuracy")
    assert sa.label == "a: optim.lr=0.0001" and sb.label == "b: optim.lr=0.001"  # as the table labels them
    assert (sa.reward.steps, sa.reward.values) == ([1, 2, 4], [0.1, 0.3, 0.5])  # no step, or not finite: left out
    assert (sa.metric.steps, sa.metric.values) == ([0, 2, 4], [0.2, 0.5, 0.8])  # before, eval/accuracy, after
    assert sa.reward.sd is None and sa.seeds == 1
    assert (sb.metric.steps, sb.metric.values) == ([2], [0.3])  # an unfinished run: what it has


def test_a_groups_series_are_the_mean_and_sample_sd_over_its_seeds_at_the_steps_all_have(tmp_path):
    finished = {"before": {"accuracy": 0.2}, "steps": 3}
    write_metrics(make_run(tmp_path, "s0", seed=0, after={"accuracy": 0.6}, **finished),
                  rewards(0.0, 0.2, 0.4, evals={2: 0.3}))
    write_metrics(make_run(tmp_path, "s1", seed=1, after={"accuracy": 0.8}, **finished),
                  rewards(0.2, 0.4, 0.6, evals={2: 0.5}))
    write_metrics(make_run(tmp_path, "s2", seed=2, steps=3), rewards(0.4, 0.9, evals={2: 0.4}))  # still going
    write_metrics(make_run(tmp_path, "t", lr=1e-3, **finished, after={"accuracy": 0.5}), rewards(0.5, evals={1: 0.1}))
    seeds, single = plot.group_series(loaded(tmp_path), "accuracy")
    assert seeds.label == "optim.lr=0.0001 (3 seeds)" and seeds.seeds == 3
    assert seeds.reward.steps == [1, 2]  # step 3 is not in s2 yet
    assert seeds.reward.values == pytest.approx([0.2, 0.5])  # (0 + .2 + .4) / 3; (.2 + .4 + .9) / 3
    # sqrt(((-.2)^2 + 0 + .2^2) / 2) = .2; sqrt(((-.3)^2 + (-.1)^2 + .4^2) / 2) = sqrt(.13)
    assert seeds.reward.sd == pytest.approx([0.2, math.sqrt(0.13)])
    # s2 has no summary: steps 0 and 3 (before, after) are not in every seed, eval/accuracy at 2 is
    assert seeds.metric.steps == [2]
    assert seeds.metric.values == pytest.approx([0.4]) and seeds.metric.sd == pytest.approx([0.1])
    assert single.label == "optim.lr=0.001 (1 seed)" and single.reward.sd is None and single.metric.sd is None
    assert (single.metric.steps, single.metric.values) == ([0, 1, 3], [0.2, 0.1, 0.5])


def test_runs_that_never_finished_plot_the_first_metric_they_evaluated(tmp_path):
    write_metrics(make_run(tmp_path, "a"), [{"step": 1, "reward/total": 0.0, "eval/format": 0.5,
                                            "eval/accuracy": 0.25}])
    runs = loaded(tmp_path)
    assert table.metric_names(runs, []) == [] and plot.metric_of(runs, []) == "format"
    write_metrics(tmp_path / "a", [{"step": 1, "reward/total": 0.0}])
    assert plot.metric_of(loaded(tmp_path), []) is None


def test_the_cli_writes_a_png_beside_the_table_and_warns_of_a_run_without_metrics(tmp_path):
    runs = tmp_path / "sweep"
    for seed in (0, 1):
        write_metrics(make_run(runs, f"s{seed}", seed=seed, before={"accuracy": 0.2}, after={"accuracy": 0.5},
                               steps=3), rewards(0.1, 0.2 + seed / 10, 0.3, evals={2: 0.4}))
    make_run(runs, "empty", lr=1e-3)  # a run that never logged a step
    runner = CliRunner()
    for args, name in (([], "runs.png"), (["--group"], "groups.png")):
        out = tmp_path / name
        with pytest.warns(UserWarning, match=r"sweep/empty is not plotted: it has no metrics.jsonl"):
            result = runner.invoke(app, ["runs", str(runs), "--plot", str(out), *args])
        assert result.exit_code == 0, result.output
        assert result.output.startswith("| run |" if not args else "| config |")  # the table, as without --plot
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 1000
        with Image.open(out) as image:
            image.verify()
            assert image.size == (1100, 400)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["groups.png", "runs.png", "sweep"]  # no temporary file


@pytest.mark.parametrize("where, message", [
    ("missing/curves.png", "--plot {tmp}/missing/curves.png: the directory {tmp}/missing does not exist"),
    ("curves.xyz", "--plot {tmp}/curves.xyz: matplotlib cannot write .xyz (it writes "),
    ("curves", "--plot {tmp}/curves: matplotlib cannot write a file without a suffix"),
    ("notes", "--plot {tmp}/notes is a directory; give a file name, such as {tmp}/notes/curves.png"),
])
def test_a_plot_path_matplotlib_cannot_write_is_refused_before_any_run_is_read(tmp_path, where, message):
    (tmp_path / "notes").mkdir()  # not a run: its error would come first, were the runs read first
    result = CliRunner().invoke(app, ["runs", str(tmp_path / "notes"), "--plot", f"{tmp_path}/{where}"])
    assert result.exit_code == 2, result.output
    assert message.format(tmp=tmp_path) in " ".join(result.output.split()) and "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]


def test_a_pgf_plot_without_tex_is_refused_before_any_run_is_read(tmp_path, monkeypatch):
    # matplotlib writes PGF by running TeX: without it, savefig's traceback came after the table
    monkeypatch.setattr("shutil.which", lambda name: None)
    (tmp_path / "notes").mkdir()
    result = CliRunner().invoke(app, ["runs", str(tmp_path / "notes"), "--plot", f"{tmp_path}/curves.PGF"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "matplotlib writes .pgf through xelatex, which is not installed" in " ".join(result.output.split())
    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}")
    plot.check_output(tmp_path / "curves.pgf")  # with TeX installed, it may be written


def test_a_figure_that_cannot_be_written_is_a_user_error_after_the_table_and_keeps_the_old_file(tmp_path, monkeypatch):
    import matplotlib.figure

    write_metrics(make_run(tmp_path / "runs", "a", before={"accuracy": 0.2}, after={"accuracy": 0.5}, steps=2),
                  rewards(0.1, 0.2))
    out = tmp_path / "curves.png"
    out.write_bytes(b"the figure of an earlier call")

    def full_disk(self, fname, **kwargs):
        open(fname, "wb").write(b"half a fig")  # noqa: SIM115 -- a half-written file, as a full disk leaves
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    result = CliRunner().invoke(app, ["runs", str(tmp_path / "runs"), "--plot", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output.startswith("| run |")  # the table came out first
    assert (f"--plot {out}: the figure could not be written: OSError: [Errno 28] No space left on device"
            in " ".join(result.output.split()))
    assert out.read_bytes() == b"the figure of an earlier call"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "runs"]  # no temporary file left


def test_the_running_mean_is_over_the_last_tenth_of_the_steps():
    from mmrl.core.logging import running_mean

    assert running_mean([4.0, 8.0]) == [4.0, 8.0]  # fewer than 20 values: a window of one
    assert running_mean([float(v) for v in range(19)]) == [float(v) for v in range(19)]
    values = [float(v) for v in range(20)]  # a window of two
    assert running_mean(values) == [0.0] + [v - 0.5 for v in values[1:]]
    assert running_mean([float(v) for v in range(30)])[5] == 4.0  # (3 + 4 + 5) / 3
    assert running_mean([]) == []


def test_the_plotted_metric_is_the_first_asked_for_or_the_first_eval_slash_entry(tmp_path):
    write_metrics(make_run(tmp_path, "a"), [{"step": 1, "reward/total": 0.0, "eval_seconds": 3.0, "eval/format": 0.5}])
    runs = loaded(tmp_path)
    assert plot.metric_of(runs, []) == "format"  # "eval_seconds" is no evaluation
    assert plot.metric_of(runs, ["accuracy", "format"]) == "accuracy"


def test_a_row_whose_step_is_not_a_whole_number_is_left_out(tmp_path):
    write_metrics(make_run(tmp_path, "a"), [{"step": True, "reward/total": 5.0}, {"step": 2.0, "reward/total": 6.0},
                                            {"step": 3, "reward/total": 0.5}])
    (run,) = loaded(tmp_path)
    assert (plot.reward_curve(run).steps, plot.reward_curve(run).values) == ([3], [0.5])


def test_a_plot_suffix_in_capitals_is_written(tmp_path):
    plot.check_output(tmp_path / "curves.PNG")  # matplotlib's file types are lower case; the check is not


def test_the_cli_draws_the_runs_or_the_groups_and_the_first_metric(tmp_path, monkeypatch):
    for seed in (0, 1):
        write_metrics(make_run(tmp_path, f"s{seed}", seed=seed, before={"accuracy": 0.2, "format": 1.0},
                               after={"accuracy": 0.5, "format": 1.0}, steps=2), rewards(0.1, 0.2))
    drawn = []
    monkeypatch.setattr(plot, "draw", lambda series, metric, out: drawn.append(([s.label for s in series], metric)))
    for args in ([], ["--group"]):
        result = CliRunner().invoke(app, ["runs", str(tmp_path), "--plot", str(tmp_path / "c.png"), "-m", "format",
                                          "-m", "accuracy", *args])
        assert result.exit_code == 0, result.output
    assert drawn == [(["s0", "s1"], "format"), (["(one configuration) (2 seeds)"], "format")]


def test_both_panels_mark_whole_steps_only(tmp_path, monkeypatch):
    """A short run's axes had ticks at steps 1.25, 1.5, ... which no step has."""
    import matplotlib.figure

    drawn = []
    savefig = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig), savefig(fig, *a, **k)))
    series = [plot.Series("a", plot.Curve([1, 2, 3], [0.1, 0.2, 0.3]), plot.Curve([0, 3], [0.2, 0.5]))]
    plot.draw(series, "accuracy", tmp_path / "c.png")
    left, right = drawn[0].axes
    assert [t for t in left.get_xticks() if 1 <= t <= 3] == [1, 2, 3]
    assert all(t == int(t) for t in right.get_xticks()) and 1 in right.get_xticks()
