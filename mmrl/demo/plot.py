"""`<cli> runs --plot FILE.png`: the runs the table lists, as curves in one figure.

Left, the training reward: `reward/total` of each metrics.jsonl row, a light line and its running
mean (over a tenth of the steps, as logging.plot_reward_curve draws a run's reward_curve.png).
Right, one held-out metric M: summary.json's eval_before[M] at step 0, the evaluations during
training (the `eval/M` entries of metrics.jsonl, every train.eval_every steps), the final ones of
the earlier ends of a run --resume took further (summary.step-N.json's eval_after[M] at step N)
and eval_after[M] at the run's last step. One colour per run, labelled by the settings that tell the table's rows
apart.

With group=True, one curve per configuration (the table's groups): the mean over its seeds at each
step every seed has, and a band of ± one sample standard deviation (none for one seed). So a
seed still going ends its group's curve where it stands, and an unfinished seed (no summary.json)
leaves out its group's before and after points. A run without metrics.jsonl, or one the table
cannot read, is left out with a warning naming it.

`run_series` / `group_series` are pure functions of the loaded runs, tested without pixels;
`draw` alone touches matplotlib.
"""

from __future__ import annotations

import statistics
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path

from mmrl.core.logging import METRICS, atomic_path, running_mean
from mmrl.demo import table
from mmrl.demo.table import Run


@dataclass
class Curve:
    steps: list[int]
    values: list[float]  # a run's values, or the mean over a group's seeds
    sd: list[float] | None = None  # per step, the sample standard deviation over two or more seeds


@dataclass
class Series:
    label: str
    reward: Curve  # reward/total per step
    metric: Curve  # the held-out metric: before (step 0), during, after training
    seeds: int = 1  # the runs it is drawn from


def check_output(path: Path) -> None:
    """ValueError unless matplotlib can write a figure at `path`: its directory exists and
    matplotlib writes files of its suffix. Checked before any run is read."""
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    if path.is_dir():
        raise ValueError(f"--plot {path} is a directory; give a file name, such as {path / 'curves.png'}")
    if not path.parent.is_dir():
        raise ValueError(f"--plot {path}: the directory {path.parent} "
                         f"{'is not a directory' if path.parent.exists() else 'does not exist'}")
    if path.suffix[1:].lower() not in kinds:
        raise ValueError(f"--plot {path}: matplotlib cannot write {path.suffix or 'a file without a suffix'} "
                         f"(it writes .{', .'.join(sorted(kinds))}); use .png")
    if path.suffix.lower() == ".pgf":  # matplotlib runs TeX to write PGF
        import shutil

        from matplotlib import rcParams

        if shutil.which(rcParams["pgf.texsystem"]) is None:
            raise ValueError(f"--plot {path}: matplotlib writes .pgf through {rcParams['pgf.texsystem']}, "
                             "which is not installed; use .pdf or .svg for a vector figure")


def metric_of(runs: list[Run], metrics: list[str]) -> str | None:
    """The held-out metric to plot: the table's first; where no run has finished, the first
    `eval/` entry of the runs' metrics.jsonl (None: none was evaluated)."""
    if metrics:
        return metrics[0]
    logged = (k for r in runs for row in r.metrics if isinstance(row, dict) for k in row)
    return next((k[len("eval/"):] for k in logged if k.startswith("eval/")), None)


def plotted(runs: list[Run]) -> list[Run]:
    """The runs with curves to draw; each other one is named in a warning."""
    kept = []
    for r in runs:
        if r.error:
            warnings.warn(f"{r.path} is not plotted: {r.error}", stacklevel=2)
        elif not (r.path / METRICS).is_file():
            warnings.warn(f"{r.path} is not plotted: it has no metrics.jsonl", stacklevel=2)
        else:
            kept.append(r)
    return kept


def reward_curve(run: Run) -> Curve:
    """reward/total per step (rows without a step or a finite reward are left out)."""
    return _curve({s: v for row in run.metrics if (s := _step(row)) is not None
                   and (v := table._number(row.get("reward/total"))) is not None})


def metric_curve(run: Run, metric: str) -> Curve:
    """`metric` before training (step 0), at each evaluation during it, and after it (the
    summary's steps), where those are finite numbers. A run that --resume took past a finished
    end also has that end's final evaluation (its summary.step-N.json), which no row holds."""
    points = {0: run.evaluation("before", metric)}
    points.update({s: table._number(row.get(f"eval/{metric}")) for row in run.metrics
                   if (s := _step(row)) is not None and f"eval/{metric}" in row})
    points.update({s: table._number((kept.get("eval_after") or {}).get(metric)) for s, kept in run.kept.items()
                   if s not in points and isinstance(run.steps, int) and s <= run.steps})
    if run.summary is not None and isinstance(run.steps, int):
        points[run.steps] = run.evaluation("after", metric)
    return _curve({s: v for s, v in points.items() if v is not None})


def run_series(runs: list[Run], metric: str | None) -> list[Series]:
    """One series per run: the run's name, then the settings its table row shows."""
    keys = table.varying(runs)  # the table's label: over every run it lists
    return [Series(_name(r.path.name, table._label(table.label(r, keys))), reward_curve(r),
                   metric_curve(r, metric) if metric else Curve([], []))
            for r in plotted(runs)]


def group_series(runs: list[Run], metric: str | None) -> list[Series]:
    """One series per configuration: the mean and sample sd over its plotted seeds."""
    keys = table.varying(runs)
    out = []
    for members in table.groups(plotted(runs)):
        n = len(members)
        name = table._label(table.label(members[0], keys)) or "(one configuration)"
        out.append(Series(f"{name} ({n} seed{'s' if n > 1 else ''})", mean_curve([reward_curve(r) for r in members]),
                          mean_curve([metric_curve(r, metric) for r in members]) if metric else Curve([], []), n))
    return out


def mean_curve(curves: list[Curve]) -> Curve:
    """The mean over `curves` at each step all of them have; the sample sd where two or more."""
    if not curves:
        return Curve([], [])
    common = sorted(set.intersection(*(set(c.steps) for c in curves)))
    by_step = [dict(zip(c.steps, c.values)) for c in curves]
    columns = [[values[s] for values in by_step] for s in common]
    return Curve(common, [statistics.fmean(c) for c in columns],
                 [statistics.stdev(c) for c in columns] if len(curves) > 1 else None)


def draw(series: list[Series], metric: str | None, out: Path) -> Path:
    """Both panels, one colour per series, written whole to `out` (logging.atomic_path).
    ValueError where it cannot be written (the file as it was is kept)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), dpi=100, layout="constrained")
    colours = [f"C{i}" for i in range(10)] if len(series) <= 10 else \
        [plt.get_cmap("turbo")(i / (len(series) - 1)) for i in range(len(series))]
    for s, colour in zip(series, colours):
        if s.reward.steps:
            left.plot(s.reward.steps, s.reward.values, color=colour, alpha=0.3, linewidth=0.8)
            left.plot(s.reward.steps, running_mean(s.reward.values), color=colour)
            _band(left, s.reward, colour)
        if s.metric.steps:
            right.plot(s.metric.steps, s.metric.values, color=colour, marker="o", markersize=4)
            _band(right, s.metric, colour)
    left.set(title="training reward (reward/total; bold: running mean)", xlabel="step")
    right.set(title=f"held-out {metric}" if metric else "held-out metric (none evaluated)", xlabel="step")
    for ax in (left, right):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: no 1.25 or 2.5 on short runs' axes
        ax.grid(alpha=0.3)
    if series:  # one column where labels are long (many differing settings), so none is cut off
        labels = [textwrap.shorten(s.label, 170, placeholder=" ...") for s in series]
        fig.legend(handles=[Line2D([], [], color=c, label=lab) for lab, c in zip(labels, colours)],
                   loc="outside lower center", fontsize=8,
                   ncols=min(3, len(series)) if max(map(len, labels)) <= 50 else 1)
    out = Path(out)
    try:
        with atomic_path(out) as tmp:  # the format from out's suffix: tmp's is ".tmp"
            fig.savefig(tmp, format=out.suffix[1:].lower())
    except (OSError, RuntimeError) as e:  # a full disk, a writer matplotlib lacks a library for
        raise ValueError(f"--plot {out}: the figure could not be written: {type(e).__name__}: {e}") from e
    finally:
        plt.close(fig)
    return out


def _band(ax, curve: Curve, colour) -> None:
    if curve.sd is not None:
        ax.fill_between(curve.steps, [m - d for m, d in zip(curve.values, curve.sd)],
                        [m + d for m, d in zip(curve.values, curve.sd)], color=colour, alpha=0.2, linewidth=0)


def _curve(points: dict[int, float]) -> Curve:
    steps = sorted(points)
    return Curve(steps, [points[s] for s in steps])


def _step(row) -> int | None:
    """A row's step; None for a row a user or another tool wrote without one."""
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _name(name: str, settings: str) -> str:
    return f"{name}: {settings}" if settings else name
