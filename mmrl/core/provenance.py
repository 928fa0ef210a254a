"""What a run ran with: `<output_dir>/environment.json`, one entry per start of `train` (the
first, then each --resume), so a result can be traced to its code and library versions, and a
resume on other code is visible.

Each entry: when it started (UTC) and at which step, the command line (and, under torchrun or
`accelerate launch`, the launcher's: the workers' own argv is only the module's path and the
flags), mmrl's version and, in a
source checkout, its git commit and whether tracked files had uncommitted changes; Python, the
platform, the versions of the libraries that decide numbers, the accelerator and the number of
processes; the host name and process id of the process that wrote it (the main one, rank 0) and,
on Linux, that process's start time, so that `alive` can tell a start still going from one killed
outright. What cannot be read is null. When the start ends (finished, stopped by a signal,
interrupted, stopped by an error) its entry gets "ended"; a start killed outright has none.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import socket
import subprocess
import sys
import time
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

from mmrl.core.logging import write_atomically

ENVIRONMENT = "environment.json"
PACKAGES = ("torch", "transformers", "diffusers", "accelerate", "peft", "vllm", "xformers", "open_clip_torch",
            "wandb")
_SECRET_FLAGS = ("--token",)  # their values are never written down


def environment(step: int = 0, world_size: int = 1) -> dict[str, Any]:
    """This process's entry (see the module docstring)."""
    import torch  # here, not at the top: `runs` reads provenance files without torch

    cuda = torch.cuda.is_available()
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "step": step,
        "command": _command(sys.argv),
        "launcher": _launcher(),
        "mmrl": _version("mmrl"),
        "git": _git(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES},
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "cuda": torch.version.cuda if cuda else None,
        "processes": world_size,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_started": _process_start(os.getpid()),
    }


def record(out: str | Path, step: int = 0, world_size: int = 1) -> dict[str, Any]:
    """Append this start's entry to out/environment.json (written whole, then renamed into
    place); an unreadable earlier file is set aside as environment.json.bad, with a warning."""
    path = Path(out) / ENVIRONMENT
    entries: list = []
    if path.is_file():
        try:
            entries = json.loads(path.read_text(encoding="utf-8"))
            problem = None if isinstance(entries, list) else f"not a list but {type(entries).__name__}"
        except (OSError, ValueError) as e:
            problem = str(e)
        if problem is not None:
            warnings.warn(f"{path} is unreadable ({problem}); kept as {path.name}.bad, a new one started",
                          stacklevel=2)
            path.replace(path.with_name(path.name + ".bad"))
            entries = []
    entry = environment(step, world_size)
    write_atomically(path, json.dumps([*entries, entry], indent=2))
    return entry


def ended(out: str | Path, how: str, step: int) -> None:
    """Mark how this start ended in its entry (the last): {"at", "step", "how"}, how being
    "finished", "stopped by SIGTERM", "interrupted" or "error: ...". A start without it was
    killed (kill -9, a lost node) or is still going (`alive` tells which on the host that ran it).
    Best effort: a missing or unreadable file is left as it is (its start warned already)."""
    entries = _entries(out)
    if entries is None:
        return
    entries[-1]["ended"] = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "step": step,
                            "how": " ".join(how.split())[:500]}
    try:
        write_atomically(Path(out) / ENVIRONMENT, json.dumps(entries, indent=2))
    except OSError:
        return


def last_start(out: str | Path) -> dict[str, Any] | None:
    """The entry of the run's newest start, or None (none yet, or no readable file)."""
    entries = _entries(out)
    return entries[-1] if entries is not None else None


def last_ending(out: str | Path) -> dict[str, Any] | None:
    """The "ended" record of the run's newest start, or None (none yet, or no readable file)."""
    ended = (last_start(out) or {}).get("ended")
    return ended if isinstance(ended, dict) else None


def alive(entry: dict[str, Any]) -> bool | None:
    """Whether the process that wrote a start's entry still runs: True or False on the host that
    ran it, None where this cannot be told (another host, an entry older than its "pid", not a
    POSIX system). A PID the system has since given to another process counts as gone where the
    entry has its start time (Linux). Meant for an entry without "ended": with it, the start is
    over whatever its PID does now."""
    pid = entry.get("pid")
    if (type(pid) is not int or pid <= 0 or entry.get("host") != socket.gethostname()
            or os.name != "posix"):  # on Windows os.kill(pid, 0) is not a probe: it sends CTRL_C_EVENT
        return None
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    except (OSError, OverflowError):  # OverflowError: a damaged pid beyond a C int
        return None
    fields = _stat_fields(pid)
    if fields and fields[0] == "Z":  # ended, not yet reaped by its parent: signal 0 still finds it
        return False
    started = entry.get("pid_started")
    now = _process_start(pid)
    return started is None or now is None or now == started


def _entries(out: str | Path) -> list | None:
    """environment.json's entries where it is readable and its newest is an object, else None."""
    try:
        entries = json.loads((Path(out) / ENVIRONMENT).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return entries if isinstance(entries, list) and entries and isinstance(entries[-1], dict) else None


def _command(argv: list[str]) -> list[str]:
    """argv with the value of a secret flag (`--token T`, `--token=T`) replaced by "***"."""
    out, hide = [], False
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if hide:
            out.append("***")
        elif flag in _SECRET_FLAGS and "=" in arg:
            out.append(f"{flag}=***")
        else:
            out.append(arg)
        hide = not hide and arg in _SECRET_FLAGS
    return out


def _launcher() -> list[str] | None:
    """The command line of the launcher (torchrun, `accelerate launch`) that started this
    worker, the parent process: its --nproc_per_node and settings are the run's too. None
    without one (TORCHELASTIC_RUN_ID, which torchrun sets in its workers) or off Linux."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return None
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    return _command([a.decode(errors="replace") for a in raw.split(b"\0") if a]) or None


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3 on of /proc/<pid>/stat (the state first), after "(comm)", which may hold spaces;
    None off Linux or where unreadable."""
    try:
        return Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace").rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _process_start(pid: int) -> int | None:
    """When process `pid` started, in clock ticks after boot (field 22 of /proc/<pid>/stat), so a
    reused PID is not taken for the process that had it; None off Linux or where unreadable."""
    try:
        return int(_stat_fields(pid)[19])
    except (TypeError, ValueError, IndexError):
        return None


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@functools.cache  # one process, one code: asked once, not at every start a test makes
def _git() -> dict[str, Any] | None:
    """{"commit", "dirty"} of the source checkout mmrl is imported from; None outside one."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(status.strip())}
