"""environment.json: what each start of a run ran with (mmrl.core.provenance)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
import toy

from mmrl.core import provenance
from mmrl.core.config import TrainConfig, load_config
from mmrl.core.provenance import ENVIRONMENT, _command, record
from mmrl.core.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def make(tmp_path, *overrides):
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[f"output_dir={tmp_path / 'run'}", *overrides])
    return Trainer(cfg, *toy.build(cfg))


def test_each_start_of_a_run_appends_its_entry_with_its_step(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["toy-rl", "train", "--max-steps", "2"])
    make(tmp_path, "train.max_steps=2").train()
    make(tmp_path, "train.max_steps=3").train(resume=True)
    entries = json.loads((tmp_path / "run" / ENVIRONMENT).read_text())
    assert [e["step"] for e in entries] == [0, 2]  # the fresh start, then the resume at step 2
    first = entries[0]
    assert first["command"] == ["toy-rl", "train", "--max-steps", "2"]
    assert first["mmrl"] == metadata.version("mmrl")
    assert first["packages"]["torch"] == metadata.version("torch")
    assert first["packages"]["transformers"] == metadata.version("transformers")
    assert first["python"] == platform.python_version()
    assert first["device"] == "cpu" and first["cuda"] is None and first["processes"] == 1
    assert first["started"].endswith("Z") and first["started"][:2] == "20"
    # report.html shows a row per start
    report = (tmp_path / "run" / "report.html").read_text()
    env = report.split("<h2>Environment</h2>")[1].split("<h2>")[0]
    assert env.count("<tr>") == 3  # the header and two starts
    assert "toy-rl train --max-steps 2" in env and metadata.version("torch") in env
    assert [(e["ended"]["how"], e["ended"]["step"]) for e in entries] == [("finished", 2), ("finished", 3)]
    assert "finished at step 3" in env  # the report says how each start ended


@pytest.mark.parametrize(("error", "how"), [(KeyboardInterrupt(), "interrupted"),
                                            (RuntimeError("disk\non fire"), "error: RuntimeError: disk on fire")])
def test_a_start_stopped_by_ctrl_c_or_an_error_says_so_and_a_killed_one_says_nothing(tmp_path, error, how):
    trainer = make(tmp_path, "train.max_steps=4")
    generate, calls = trainer.policy.generate, {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # in step 3's rollout
            raise error
        return generate(*args, **kwargs)

    trainer.policy.generate = failing
    with pytest.raises(type(error)):
        trainer.train()
    (entry,) = json.loads((tmp_path / "run" / ENVIRONMENT).read_text())
    assert entry["ended"]["how"] == how and entry["ended"]["step"] == 2 and entry["ended"]["at"].endswith("Z")
    record(tmp_path / "run", step=2)  # a start that was then killed outright: no "ended"
    assert provenance.last_ending(tmp_path / "run") is None


def test_ended_leaves_a_missing_or_damaged_file_alone(tmp_path):
    provenance.ended(tmp_path, "finished", 1)
    assert not (tmp_path / ENVIRONMENT).exists()
    (tmp_path / ENVIRONMENT).write_text("{not json")
    provenance.ended(tmp_path, "finished", 1)
    assert (tmp_path / ENVIRONMENT).read_text() == "{not json" and provenance.last_ending(tmp_path) is None


def test_a_report_says_an_environment_file_is_missing_or_damaged_and_is_still_written(tmp_path):
    from mmrl.demo.report import write_report

    make(tmp_path, "train.max_steps=1").train()
    run = tmp_path / "run"
    (run / ENVIRONMENT).unlink()
    assert "(no environment.json: the run predates it)" in write_report(run).read_text()
    (run / ENVIRONMENT).write_text('{"step": 0}')  # an object, not the list of starts
    assert "(environment.json is unreadable: AttributeError)" in write_report(run).read_text()


def test_the_git_commit_is_the_checkout_s_own(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    entry = record(tmp_path)
    assert entry["git"]["commit"] == head and len(head) == 40
    assert isinstance(entry["git"]["dirty"], bool)


def test_outside_a_checkout_git_is_null(tmp_path, monkeypatch):
    fake = tmp_path / "site-packages" / "mmrl" / "core" / "provenance.py"
    monkeypatch.setattr(provenance, "__file__", str(fake))  # parents[2]: no .git there
    provenance._git.cache_clear()
    try:
        assert provenance._git() is None
    finally:
        provenance._git.cache_clear()


def test_a_secret_flag_s_value_is_never_written():
    assert _command(["mmrl", "serve", "--token", "s3cret", "--port", "1"]) == ["mmrl", "serve", "--token", "***",
                                                                          "--port", "1"]
    assert _command(["mmrl", "serve", "--token=s3cret"]) == ["mmrl", "serve", "--token=***"]
    assert _command(["x", "--token", "--token", "y"]) == ["x", "--token", "***", "y"]  # a value that looks like a flag


@pytest.mark.parametrize("earlier", ["{not json", '{"step": 0}'])
def test_an_unreadable_earlier_file_is_set_aside_not_lost(tmp_path, earlier):
    (tmp_path / ENVIRONMENT).write_text(earlier)
    with pytest.warns(UserWarning, match=r"environment.json is unreadable .*kept as environment.json.bad"):
        record(tmp_path, step=5)
    assert (tmp_path / "environment.json.bad").read_text() == earlier
    assert [e["step"] for e in json.loads((tmp_path / ENVIRONMENT).read_text())] == [5]


def test_each_record_keeps_every_earlier_start_and_its_process_count(tmp_path):
    for step, world in ((0, 1), (3, 2), (7, 4)):
        record(tmp_path, step=step, world_size=world)
    entries = json.loads((tmp_path / ENVIRONMENT).read_text())
    assert [(e["step"], e["processes"]) for e in entries] == [(0, 1), (3, 2), (7, 4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [ENVIRONMENT]  # no .tmp left


def test_untracked_files_leave_a_checkout_clean_and_a_changed_tracked_file_does_not(tmp_path, monkeypatch):
    root = tmp_path / "checkout"
    (root / "mmrl" / "core").mkdir(parents=True)
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    (root / "tracked.txt").write_text("a\n")
    subprocess.run([*git, "add", "tracked.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    (root / "scratch.txt").write_text("untracked")
    monkeypatch.setattr(provenance, "__file__", str(root / "mmrl" / "core" / "provenance.py"))
    provenance._git.cache_clear()
    try:
        assert provenance._git() == {"commit": head, "dirty": False}
        (root / "tracked.txt").write_text("b\n")
        provenance._git.cache_clear()
        assert provenance._git() == {"commit": head, "dirty": True}
    finally:
        provenance._git.cache_clear()


def test_each_entry_names_its_process_so_a_start_still_going_is_told_from_a_killed_one(tmp_path):
    entry = record(tmp_path)
    assert entry["host"] == socket.gethostname() and entry["pid"] == os.getpid()
    assert provenance.alive(entry) is True  # this very process
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # gone, and reaped
    assert provenance.alive({**entry, "pid": child.pid, "pid_started": None}) is False
    assert provenance.alive({**entry, "pid": 2**22 + 1}) is False  # above Linux's largest PID: none such
    assert provenance.alive({**entry, "host": "another-node"}) is None  # cannot be told from here
    old = {k: v for k, v in entry.items() if k not in ("host", "pid", "pid_started")}
    assert provenance.alive(old) is None  # an entry written before these fields
    assert provenance.alive({**entry, "pid": "12"}) is None and provenance.alive({**entry, "pid": 2**70}) is None
    if sys.platform.startswith("linux"):
        assert isinstance(entry["pid_started"], int)
        # this PID, but a process that started at another time: the PID was given to another one
        assert provenance.alive({**entry, "pid_started": entry["pid_started"] + 1}) is False
    # report.html's Environment table says the same
    from mmrl.demo.report import _ending

    assert _ending(entry) == f"running (pid {os.getpid()})"
    assert _ending({**entry, "pid": child.pid, "pid_started": None}) == "killed (no ending recorded)"
    assert _ending(old) == "(no record: killed, or still going)"
    assert _ending({**entry, "ended": {"how": "finished", "step": 4}}) == "finished at step 4"


def test_alive_cannot_tell_from_a_damaged_pid_or_off_posix(tmp_path, monkeypatch):
    entry = record(tmp_path)
    # os.kill(0, 0) and os.kill(-1, 0) probe a process group or every process, and True is 1 (init)
    for pid in (0, -1, True):
        assert provenance.alive({**entry, "pid": pid}) is None, pid
    with monkeypatch.context() as m:  # os.name back before pytest reports (its paths need it)
        m.setattr(provenance.os, "name", "nt")  # there os.kill(pid, 0) would send CTRL_C_EVENT
        off_posix = provenance.alive(entry)
    assert off_posix is None


def test_a_process_that_cannot_be_probed_or_read_counts_as_running(tmp_path, monkeypatch):
    entry = record(tmp_path)

    def not_permitted(pid, sig):
        raise PermissionError(pid)

    with monkeypatch.context() as m:
        m.setattr(provenance.os, "kill", not_permitted)  # another user's process: it exists
        assert provenance.alive(entry) is True
    monkeypatch.setattr(provenance, "_process_start", lambda pid: None)  # /proc hidden (hidepid)
    assert provenance.alive(entry) is True
    assert provenance.alive({**entry, "pid_started": None}) is True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/<pid>/stat is Linux's")
def test_a_process_start_is_its_start_time_also_where_its_name_has_brackets_and_spaces(tmp_path):
    """Two processes started about half a second apart start that far apart by _process_start,
    also where the name in /proc/<pid>/stat's "(comm)" holds ")" and spaces."""
    exe = tmp_path / "a) b c d"
    exe.symlink_to(shutil.which("sleep"))
    children = []
    try:
        children.append(subprocess.Popen([str(exe), "30"]))
        first = time.monotonic()
        time.sleep(0.5)
        children.append(subprocess.Popen([str(exe), "30"]))
        gap = time.monotonic() - first
        ticks = [provenance._process_start(c.pid) for c in children]
        assert all(isinstance(t, int) for t in ticks), ticks
        assert abs((ticks[1] - ticks[0]) / os.sysconf("SC_CLK_TCK") - gap) < 0.3, (ticks, gap)
    finally:
        for c in children:
            c.kill()
            c.wait()


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc (Linux)")
def test_a_worker_of_a_launcher_records_the_launchers_command_line(monkeypatch):
    """Under torchrun a worker's argv is the module's path and its flags alone: how many
    processes, and with which launcher settings, was nowhere in environment.json."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert provenance.environment()["launcher"] is None  # no launcher: nothing to say
    parent = os.getpid()  # this process stands in for the launcher: its command line is known
    own = [a.decode() for a in Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0") if a]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setattr(os, "getppid", lambda: parent)
    assert provenance.environment()["launcher"] == own
