"""What a command prints, where its reader goes away (`train | head`, `2>&1 | head`, a `less`
quit early) or its streams are closed: mmrl.core.logging.ReaderGoneSafe, installed by the
command line's entry point (mmrl.core.cli.run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

# Lines on both streams long after the reader has gone, then a file: what a run does.
SCRIPT = """
import sys
from pathlib import Path
from mmrl.core.logging import survive_reader_gone
survive_reader_gone()
print("first", flush=True)
sys.stdin.readline()  # the test has closed its end of the pipe
for i in range(3000):
    print("row", i, flush=i % 7 == 0)
    print("note", i, file=sys.stderr, flush=True)
Path(sys.argv[1]).write_text("written after the reader went away")
"""


def start_then_close_the_reader(command: list[str], both: bool, **kw) -> subprocess.Popen:
    """`command | head -1` (`both`: `command 2>&1 | head -1`): its first line read, the pipe
    closed; stderr otherwise to a pipe of its own (proc.stderr)."""
    read, write = os.pipe()
    proc = subprocess.Popen(command, stdout=write, stderr=write if both else subprocess.PIPE, env=ENV,
                            text=True, **kw)
    os.close(write)
    with os.fdopen(read) as reader:
        assert reader.readline()  # the first line, as head -1
    return proc


@pytest.mark.parametrize("both", [False, True], ids=["stdout-closed", "stdout-and-stderr-closed"])
def test_a_command_whose_reader_went_away_goes_on_silently(tmp_path, both):
    out = tmp_path / "file"
    proc = start_then_close_the_reader([sys.executable, "-c", SCRIPT, str(out)], both, stdin=subprocess.PIPE)
    proc.stdin.close()
    err = "" if both else proc.stderr.read()
    assert proc.wait(timeout=60) == 0, err[-2000:]
    assert out.read_text() == "written after the reader went away"
    if not both:  # the other stream is whole, and says nothing of the pipe
        assert err.splitlines() == [f"note {i}" for i in range(3000)]


def test_closed_streams_are_dev_null_and_not_reused_by_later_files(tmp_path):
    """`train >&- 2>&-`: Python's sys.stderr is None (`sys.stderr.isatty()` failed on it), and
    the next file opened would take descriptor 1 and receive whatever is written there."""
    code = ("import os, sys\nfrom mmrl.core.logging import survive_reader_gone\nsurvive_reader_gone()\n"
            "sys.stderr.isatty(); print('dropped'); print('dropped', file=sys.stderr)\n"
            "f = open(sys.argv[1], 'w'); os.write(1, b'stdout'); os.write(2, b'stderr'); f.write('mine'); f.close()")
    out = tmp_path / "file"
    proc = subprocess.run([sys.executable, "-c", code, str(out)], check=False, env=ENV, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, close_fds=True, timeout=60,
                          preexec_fn=lambda: (os.close(1), os.close(2)))
    assert proc.returncode == 0
    assert out.read_text() == "mine"


@pytest.mark.slow
@pytest.mark.parametrize("both", [False, True], ids=["train|head", "train 2>&1|head"])
def test_train_goes_on_and_finishes_when_the_console_reader_goes_away(tmp_path, both):
    """`train 2>&1 | head` stopped at step 0 with a BrokenPipeError (recorded in
    environment.json); `train | head` finished and exited 1 without a word."""
    run = tmp_path / "run"
    script = ROOT / "tests" / "reliability" / "toy_cli.py"
    proc = start_then_close_the_reader([sys.executable, str(script), "train", "--max-steps", "3", "--set",
                                        "train.eval_every=1", "--set", "logging.progress=true", "-o", str(run)],
                                       both)
    err = "" if both else proc.stderr.read()
    assert proc.wait(timeout=300) == 0, err[-3000:]
    assert json.loads((run / "summary.json").read_text())["steps"] == 3
    assert json.loads((run / "environment.json").read_text())[-1]["ended"]["how"] == "finished"
    assert (run / "report.html").is_file()
    if not both:
        assert "Traceback" not in err and "held-out evaluation after training" in err


def test_a_non_ascii_path_on_an_ascii_console_is_escaped_not_a_traceback(tmp_path):
    """LANG=C PYTHONIOENCODING=ascii with `-o runs/rüné`: rich raised UnicodeEncodeError on
    `train`'s first line and the run stopped before it began."""
    code = ("from rich.console import Console\nfrom mmrl.core.logging import survive_reader_gone\n"
            "survive_reader_gone()\nConsole().print('output runs/r\\u00fcn\\u00e9', highlight=False)\n"
            "print('prompt \\u00bfqu\\u00e9?')")
    proc = subprocess.run([sys.executable, "-c", code], env={**ENV, "LANG": "C", "LC_ALL": "C",
                          "PYTHONIOENCODING": "ascii"}, capture_output=True, check=False, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert proc.stdout.decode("ascii").splitlines() == ["output runs/r\\xfcn\\xe9", "prompt \\xbfqu\\xe9?"]


def test_the_reward_curve_marks_whole_steps(tmp_path, monkeypatch):
    """A short run's reward_curve.png had ticks at steps 1.5, 2.5, ... that no step has."""
    import matplotlib.figure

    from mmrl.core.logging import plot_reward_curve

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "reward/total": s / 10}) + "\n" for s in (1, 2, 3)))
    drawn = []
    savefig = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig), savefig(fig, *a, **k)))
    plot_reward_curve(metrics, tmp_path / "curve.png")
    ticks = [t for t in drawn[0].axes[0].get_xticks() if 1 <= t <= 3]
    assert ticks == [1, 2, 3] and (tmp_path / "curve.png").stat().st_size > 0


def test_a_stop_signal_with_the_console_reader_gone_still_stops_after_the_step():
    """SIGTERM to `train 2>&1 | head` whose reader had gone: the handler's line to stderr raised
    BrokenPipeError in the middle of the step, which then stopped the run as an error (exit 1,
    environment.json "error: BrokenPipeError") instead of saving it and exiting 143."""
    import signal

    from mmrl.core.stop import SignalStop

    saved = os.dup(2)
    read, write = os.pipe()
    os.close(read)
    try:
        os.dup2(write, 2)  # stderr: a pipe nobody reads any more
        with SignalStop() as stop:
            signal.raise_signal(signal.SIGTERM)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(write)
    assert stop.received == signal.SIGTERM
