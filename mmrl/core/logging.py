"""Run outputs: a progress bar, metrics.jsonl, TensorBoard events (and W&B, where enabled), sample
tables, a reward curve.

`RunLogger` is the only writer of a run directory's logs. On resume it first
cuts metrics.jsonl back to the checkpoint's step, so the file of a resumed run
equals that of a run that was never interrupted.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mmrl.core.jsonl import json_line


@contextlib.contextmanager
def atomic_path(path: str | Path):
    """A temporary path beside `path` for the block to write; renamed into place when the block
    ends, so a reader or a crash never sees half a file (the temporary file is removed if the
    block or the rename fails)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomically(path: str | Path, text: str) -> None:
    """`text` into `path` whole (atomic_path)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def quiet_library_bars(progress: bool, diffusers: bool = False) -> bool:
    """Turn off the libraries' progress bars (transformers loading and writing weights, and with
    `diffusers` diffusers loading a pipeline) where logging.progress is off or stderr is not a
    terminal, as RunLogger's own bar is: in a cluster job's log every bar's carriage returns
    leave a line per update, and each checkpoint adds one. Call it before the model is loaded.
    Whether they were turned off."""
    if progress and sys.stderr.isatty():
        return False
    import transformers.utils.logging  # its bars, and huggingface_hub's (every backend loads transformers)

    transformers.utils.logging.disable_progress_bar()
    if diffusers:  # diffusers keeps a switch of its own (and costs seconds to import where unused)
        import diffusers.utils.logging

        diffusers.utils.logging.disable_progress_bar()
    return True


class ReaderGoneSafe:
    """sys.stdout or sys.stderr of a command: where the stream's reader goes away (`| head`, a
    `less` quit early, a closed terminal), what is written to it from then on is dropped without
    a word, instead of a BrokenPipeError in the middle of a step (which stopped `train 2>&1 |
    head` at step 0) or click's silent exit 1 (`train | head`): the run goes on writing its files
    and ends with the code it would have had. The stream's descriptor is pointed at /dev/null,
    so the text still buffered, Python's flush at exit and whatever else writes to the
    descriptor (a library, a child process) are dropped as well. Text the stream's encoding
    cannot hold is written with backslash escapes."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            try:
                return self._stream.write(text)
            except UnicodeEncodeError:  # a non-ASCII path or prompt on an ASCII console (LANG=C,
                # PYTHONIOENCODING=ascii): escaped as Python's stderr escapes it, not a traceback
                encoding = self._stream.encoding or "ascii"
                self._stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
                return len(text)
        except BrokenPipeError:
            self._reader_gone()
            return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._reader_gone()

    def _reader_gone(self) -> None:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
        except OSError:
            return
        try:
            os.dup2(devnull, self._stream.fileno())
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):  # not a descriptor's stream
            pass
        finally:
            os.close(devnull)

    def __getattr__(self, name):  # encoding, isatty, fileno, buffer, ...: the stream's own
        return getattr(self._stream, name)


def survive_reader_gone() -> None:
    """sys.stdout and sys.stderr as ReaderGoneSafe streams (the command line's entry point). One
    closed at the start (`2>&-`: Python's is None, which `sys.stderr.isatty()` failed on) is
    /dev/null, at its descriptor where that is free: a file the run opens later (metrics.jsonl)
    cannot take descriptor 1 or 2 and receive what is written there."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = getattr(sys, name)
        if stream is None:
            try:
                os.fstat(fd)
            except OSError:  # closed: /dev/null in its place
                devnull = os.open(os.devnull, os.O_WRONLY)
                if devnull != fd:
                    os.dup2(devnull, fd)
                    os.close(devnull)
            stream = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 -- for the process's life
        if not isinstance(stream, ReaderGoneSafe):
            setattr(sys, name, ReaderGoneSafe(stream))


METRICS = "metrics.jsonl"
CURVE = "reward_curve.png"


class RunLogger:
    def __init__(self, output_dir: str | Path, *, total_steps: int, start_step: int = 0,
                 tensorboard: bool = True, progress: bool = True, description: str = "train",
                 keep_samples: int | None = None,
                 wandb: dict[str, Any] | None = None, config: dict[str, Any] | None = None):
        """`keep_samples`: the sample tables kept (logging.keep_last_samples; None: all).
        `wandb`: logging.wandb's settings where enabled (mmrl.core.wandb_run), with the run's
        `config`; a start_step above 0 continues the W&B run of the directory."""
        self.dir = Path(output_dir)
        self._keep_samples = keep_samples
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / METRICS
        truncate_metrics(self.metrics_path, start_step)
        self._wandb = None
        if wandb is not None:  # first: a W&B that cannot start stops the run before anything else
            from mmrl.core.wandb_run import WandbRun

            self._wandb = WandbRun(wandb, self.dir, config or {}, resume=start_step > 0)
        self._tb = _tensorboard_writer(self.dir / "tensorboard", start_step + 1) if tensorboard else None
        self._tensorboard = self._tb is not None
        self._progress = None
        if progress and sys.stderr.isatty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("reward {task.fields[reward]}"), TextColumn("{task.fields[step_time]} s/step"),
                TimeRemainingColumn(), transient=False,
            )
            self._task = self._progress.add_task(
                description, total=total_steps, completed=start_step, reward="-", step_time="-"
            )
            self._progress.start()
        # without a terminal (nohup, CI, a pipe) a bar cannot redraw: a plain line every 5% instead
        self._plain = progress and self._progress is None
        self._notes = progress
        self._every, self._total, self._description = max(1, total_steps // 20), total_steps, description
        self._last = self._since = time.perf_counter()
        self._since_step = start_step

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One line of metrics.jsonl per step; the same scalars to TensorBoard and the bar."""
        now = time.perf_counter()
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        scalars = finite_scalars(metrics)
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(step, scalars)
        if self._progress is not None:
            reward = metrics.get("reward/total")
            self._progress.update(
                self._task, completed=step,
                reward="-" if reward is None else f"{reward:.3f}", step_time=f"{now - self._last:.2f}",
            )
        if self._plain and (step % self._every == 0 or step == self._total):
            reward = metrics.get("reward/total")
            per_step = (now - self._since) / max(step - self._since_step, 1)
            left = self._total - step  # the bar's time remaining, from the latest steps' pace
            print(f"{self._description} step {step}/{self._total}"
                  + ("" if reward is None else f"  reward {reward:.3f}") + f"  {per_step:.2f} s/step"
                  + (f"  ~{_duration(left * per_step)} left" if left > 0 else ""),
                  file=sys.stderr, flush=True)
            self._since, self._since_step = now, step
        self._last = now

    def held_out(self, step: int, metrics: dict[str, float]) -> None:
        """The held-out evaluations before and after training, which metrics.jsonl leaves to
        summary.json, as TensorBoard's and W&B's eval/* scalars at step 0 and the last step: their
        held-out curves then span the run, as the evaluations during it (eval/* in `log`) do not.
        W&B merges the last step's into that step's row (it is still open: no later step came)."""
        scalars = {f"eval/{k}": v for k, v in finite_scalars(metrics).items()}
        if self._wandb is not None:
            self._wandb.held_out(step, scalars)
        if not self._tensorboard:
            return
        writer = self._tb
        if writer is None:  # after close (the final evaluation): a writer of its own, briefly
            writer = _tensorboard_writer(self.dir / "tensorboard", None)
            if writer is None:
                return
        for k, v in scalars.items():
            writer.add_scalar(k, v, step)
        if writer is not self._tb:
            writer.close()

    def pause(self, seconds: float) -> None:
        """Leave `seconds` spent outside the steps (an evaluation) out of the s/step and time left."""
        self._since += seconds
        self._last += seconds

    def note(self, text: str) -> None:
        """A line on stderr beside the progress (above the bar on a terminal), where it is on;
        also after close."""
        if self._progress is not None:
            self._progress.console.print(text, highlight=False, markup=False)
        elif self._notes:
            print(text, file=sys.stderr, flush=True)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> Path:
        """A sample table: samples/step_00000010.jsonl, one row per sample; then the older ones
        past keep_samples are deleted."""
        path = self.dir / "samples" / f"step_{step:08d}.jsonl"
        path.parent.mkdir(exist_ok=True)
        rows = [{k: _clean(v) for k, v in row.items()} for row in rows]
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json_line(row) for row in rows)
        if self._keep_samples is not None:
            prune_samples(path.parent, self._keep_samples, step)
        if self._wandb is not None:
            self._wandb.samples(step, rows)
        return path

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def finish(self, summary: dict[str, Any] | None, failed: bool = False, signum: int | None = None) -> None:
        """After close: the run's summary.json (its held-out metrics) to W&B, and the W&B run
        closed; `failed`: the run stopped on an error; `signum`: on that signal, its step saved
        (W&B marks it preempted). Nothing without W&B."""
        if self._wandb is not None:
            self._wandb.finish(summary, failed, signum)
            self._wandb = None


def prune_samples(root: Path, keep: int, step: int) -> None:
    """Delete all sample tables of `root` (step_*.jsonl) but the newest `keep` up to `step`, the
    one just written. Those after it go too: a resumed run's killed start wrote them, and the
    steps are being trained again (a resume with fewer kept would otherwise keep them as newest
    and delete the new ones). The before/after grids and answers (grid_*, samples_*) stay."""
    tables = {int(p.stem[5:]): p for p in root.glob("step_*.jsonl") if p.stem[5:].isdigit()}
    kept = sorted(s for s in tables if s <= step)[-keep:]
    for s, p in tables.items():
        if s not in kept:
            p.unlink(missing_ok=True)


NON_FINITE = ("nan", "inf", "-inf")  # a non-finite float as metrics.jsonl holds it (_clean)


def nulled(metrics: dict[str, Any] | None) -> dict[str, Any] | None:
    """A metrics dict as summary.json holds it: a value without a finite number (NaN, an
    infinity, or its text in a metrics.jsonl row: "nan") is JSON null, which json.load, jq and
    pandas read as missing (a bare NaN is not JSON; "nan" made pandas' column text). Readers of
    an older summary.json apply it too, so its "nan" strings and bare NaNs read the same."""
    if not isinstance(metrics, dict):
        return metrics
    return {k: None if (isinstance(v, float) and not math.isfinite(v)) or (isinstance(v, str) and v in NON_FINITE)
            else v for k, v in metrics.items()}


def nulled_summary(summary: Any) -> Any:
    """A summary.json as read: its metrics (eval_before, eval_after, final_metrics) `nulled`, so
    that one written before they were null reads as a new one."""
    if not isinstance(summary, dict):
        return summary
    return {k: nulled(v) if k in ("eval_before", "eval_after", "final_metrics") else v for k, v in summary.items()}


def finite_scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """What TensorBoard and W&B plot of a metrics dict: its finite numbers, as floats."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def read_metrics(path: str | Path) -> list[dict]:
    return _read_metrics(Path(path))[0]


def read_finished_run(out: str | Path) -> tuple[dict, list[dict]] | None:
    """(summary.json, metrics.jsonl rows) of a run that finished in `out`; None where no run
    started there. A run with metrics but no summary (still going, or stopped) is a
    ValueError: whoever would train there again would overwrite it."""
    out = Path(out)
    if (out / "summary.json").is_file():
        return nulled_summary(json.loads((out / "summary.json").read_text())), read_metrics(out / "metrics.jsonl")
    if (out / "metrics.jsonl").exists():
        raise ValueError(f"{out} has metrics but no summary.json: a run still going or stopped; "
                         "wait for it, or remove the directory to train it again")
    return None


def _read_metrics(path: Path) -> tuple[list[dict], bool]:
    """(rows, torn): a last line cut short by a kill (no newline, not JSON) is dropped and
    reported as torn; a bad line anywhere else is a ValueError naming the file and line."""
    if not path.is_file():
        return [], False
    rows = []
    # line by line: a long run's file (1.3 GB at a million steps) is never held whole beside its rows
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                if not line.endswith("\n"):  # the unterminated last line: a write the process did not finish
                    return rows, True
                raise ValueError(f"{path}, line {n}: not a JSON metrics row ({e})") from None
    return rows, False


def truncate_metrics(path: Path, step: int) -> None:
    """Keep only the lines of steps <= `step` (a resume rewinds to its checkpoint), and drop a
    last line torn by a kill, so that new rows are not appended to half a line."""
    try:
        rows, torn = _read_metrics(path)
    except ValueError as e:  # a user's edit or a disk fault, not a bug: said in one line (CLI exit 2)
        from mmrl.core.checkpoint import CheckpointError

        raise CheckpointError(f"{e}; fix or remove that line to resume") from None
    kept = [r for r in rows if r.get("step", 0) <= step]
    if torn or len(kept) != len(rows):
        write_atomically(path, "".join(json.dumps(r) + "\n" for r in kept))


def running_mean(values: list[float]) -> list[float]:
    """The mean of the last tenth of the values (at least one) up to each point: the smoothed
    reward of reward_curve.png and of `runs --plot`. From prefix sums, in time linear in the
    steps: summing each window afresh took minutes at the end of a run of a million steps (the
    window grows with the run). The values are finite (both plots leave the others out)."""
    window = max(1, len(values) // 10)
    sums = [0.0, *itertools.accumulate(values)]  # sums[i]: the first i values' sum
    return [(sums[i + 1] - sums[max(0, i - window + 1)]) / min(i + 1, window) for i in range(len(values))]


def plot_reward_curve(metrics_path: str | Path, out: str | Path, eval_points: dict | None = None,
                      rows: list[dict] | None = None) -> Path:
    """reward/total per step (and its running mean); held-out metrics as markers if given.
    `rows`: metrics_path's rows where the caller has read them (the end of a run reads them once
    for summary.json, this plot and report.html: each parse took 5 s at 100,000 steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    # a step whose reward was not finite holds the string "nan" (_clean): a gap, not a TypeError
    rows = [r for r in (read_metrics(metrics_path) if rows is None else rows) if _finite(r.get("reward/total"))]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    if rows:
        steps = [r["step"] for r in rows]
        rewards = [r["reward/total"] for r in rows]
        ax.plot(steps, rewards, alpha=0.4, label="reward (batch mean)")
        ax.plot(steps, running_mean(rewards), label=f"running mean ({max(1, len(rows) // 10)})")
    for label, (step, value) in (eval_points or {}).items():
        ax.scatter([step], [value], marker="o", zorder=3, label=label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: no 1.5 or 2.5 on a short run's axis
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    if rows or eval_points:
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out)
    plt.close(fig)
    return out


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _duration(seconds: float) -> str:
    """45s, 3m07s, 2h05m."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _tensorboard_writer(path: Path, first_step: int | None):
    """A writer whose steps from `first_step` on replace the earlier event files' (TensorBoard's
    purge_step): a resumed run's plots drop the steps after its checkpoint, as metrics.jsonl does."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is a core dependency, but a broken install must not stop a run
        warnings.warn("tensorboard is not importable; TensorBoard logging is off (pip install tensorboard; "
                      "--set logging.tensorboard=false turns it off without this warning)", stacklevel=3)
        return None
    return SummaryWriter(log_dir=str(path), purge_step=first_step)


def _clean(v: Any) -> Any:
    """JSON-safe: tensors to numbers, non-finite floats to strings (JSON has no NaN; metrics.jsonl
    keeps which of NaN and an infinity it was; summary.json makes them null, `nulled`)."""
    return json_safe(v)


def json_safe(v: Any, floats: Callable[[float], Any] = lambda x: x if math.isfinite(x) else str(x),
              other: Callable[[Any], Any] = repr) -> Any:
    """`v` as JSON can hold it: a 0-d tensor or NumPy number as its Python number, each float
    through `floats`, lists, tuples and dicts (str keys) walked, anything else through `other`."""
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
        v = v.item()
    if isinstance(v, float):
        return floats(v)
    if isinstance(v, (str, int, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [json_safe(x, floats, other) for x in v]
    if isinstance(v, dict):
        return {str(k): json_safe(x, floats, other) for k, x in v.items()}
    return other(v)
