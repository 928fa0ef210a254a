"""Tools run in processes of their own (`isolation="process"`, mmrl.vlm.tools): a call that
outlasts its timeout is stopped by killing its process, which a thread cannot be (a regex that
backtracks for ever holds Python's GIL, and the rollout with it). Each tool has a pool of
worker processes (`ToolProcesses`): a call takes an idle one (or starts one; its start is not
on the call's clock), and a worker killed at a timeout, or dead, is replaced at the next call.

The worker is started as a script (`python -I tool_worker.py IN_FD OUT_FD`), not as `-m mmrl...`: it imports
nothing of mmrl, so that a tool in the user's own file starts in a fraction of a second, not in
the seconds torch takes to import. It reads, from pipe IN_FD (multiprocessing Connections):
the parent's sys.path, modules to import before any call (PIL, for a `ctx` argument's images:
not on a call's clock), then how to load the tool, ("file", path,
attr, is_tool) or ("pickle", bytes); says ("ready", None) or ("error", message); then, for each call, reads its
keyword arguments and writes ("value", value), ("raised", "Type: message") or ("unsent",
message), until the parent closes the pipe or kills it (at a timeout). Standard library only.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import importlib.util
import inspect
import os
import pickle
import signal
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection


@dataclass
class ToolContext:
    """What a tool may see of the prompt besides its arguments (mmrl.vlm.tools; here, where a
    tool's process unpickles it without importing torch)."""

    # The prompt's images (may be empty), in order, at full resolution: the model saw them resized
    # within model.max_pixels, and a box it names is in these images' own pixel coordinates (zoom's).
    # In a rollout they are 8-bit RGB PIL images, copies, each the file's decoded original also where
    # a jsonl task keeps only the model's view (mmrl.vlm.tasks.jsonl.JsonlItem.full_images).
    images: list
    meta: dict = field(default_factory=dict)  # anything else (e.g. the task item's meta)


START_SECONDS = 120.0  # a worker's start and its tool's import (with mmrl.vlm.tools: torch's)


class ToolProcessTimeout(Exception):
    """The call outlasted its timeout; its process was killed."""


class ToolProcessRaised(Exception):
    """The tool raised in its process; args[0] is "Type: message"."""


class ToolProcessError(Exception):
    """The tool's process failed it (did not start, died, could not pass a value); args[0] says how."""


_LIVE: weakref.WeakSet = weakref.WeakSet()  # every worker, killed at exit (one may be stuck in a call)


class ToolProcesses:
    """The worker processes of one tool. `load`: how a worker loads it (see the module
    docstring); `preload`: modules a worker imports before its first call."""

    def __init__(self, load: tuple, preload: list[str]):
        self.load, self.preload = load, preload
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()

    def call(self, kwargs: dict, timeout: float):
        """fn(**kwargs) in a worker, waited on at most `timeout` s (ToolProcessTimeout, the
        worker killed). Raises ToolProcessRaised, ToolProcessError."""
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        worker = worker or _Worker(self.load, self.preload)
        try:
            kind, value = worker.call(kwargs, timeout)
        except BaseException:
            worker.kill()  # stuck, dead or out of step: a fresh one serves the next call
            raise
        with self._lock:
            self._idle.append(worker)
        if kind == "raised":
            raise ToolProcessRaised(value)
        if kind == "unsent":
            raise ToolProcessError(f"returned a value its process could not send back: {value}")
        return value

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()


class _Worker:
    def __init__(self, load: tuple, preload: list[str]):
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        try:  # its own session: a kill takes the processes the tool started too
            self.proc = subprocess.Popen([sys.executable, "-I", __file__, str(in_r), str(out_w)],
                                         pass_fds=(in_r, out_w), stdin=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            for fd in (in_r, in_w, out_r, out_w):
                os.close(fd)
            raise
        os.close(in_r)
        os.close(out_w)
        self.inbox, self.outbox = Connection(out_r, writable=False), Connection(in_w, readable=False)
        _LIVE.add(self)
        try:
            for message in (list(sys.path), list(preload), load):
                self.outbox.send(message)
            kind, msg = self._reply(START_SECONDS)
        except ToolProcessTimeout:
            self.kill()
            raise ToolProcessError(f"its process did not start within {START_SECONDS:g} s") from None
        except BaseException:
            self.kill()
            raise
        if kind != "ready":
            self.kill()
            raise ToolProcessError(f"its process could not load it: {msg}")

    def call(self, kwargs: dict, timeout: float) -> tuple[str, object]:
        try:
            self.outbox.send(kwargs)  # pickled whole before a byte is written
        except (BrokenPipeError, ConnectionError, EOFError):
            raise ToolProcessError(f"its process died (exit code {self.proc.wait()})") from None
        except Exception as e:  # noqa: BLE001 -- an argument (a ctx's meta) that does not pickle
            raise ToolProcessError(f"its arguments could not be sent to its process: {_describe(e)}") from None
        return self._reply(timeout)

    def _reply(self, timeout: float) -> tuple[str, object]:
        if not self.inbox.poll(timeout):  # True at end-of-file too: then recv says EOFError
            raise ToolProcessTimeout
        try:
            return self.inbox.recv()
        except EOFError:
            raise ToolProcessError(f"its process died (exit code {self.proc.wait()})") from None
        except Exception as e:  # noqa: BLE001 -- a value of a class only its process has
            raise ToolProcessError(f"returned a value that could not be read back: {_describe(e)}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.inbox.close()
        self.outbox.close()
        _LIVE.discard(self)


@atexit.register
def _kill_all() -> None:
    for w in list(_LIVE):
        w.kill()


def _describe(exc: BaseException) -> str:
    msg = str(exc)
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def _load(how):
    if how[0] == "pickle":
        return pickle.loads(how[1])
    _, path, attr, is_tool = how
    spec = importlib.util.spec_from_file_location(f"mmrl_tool_{attr}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickle look the module up here
    spec.loader.exec_module(module)
    obj = getattr(module, attr)
    return obj.fn if is_tool else obj


def main(in_fd: int, out_fd: int) -> None:
    inbox, outbox = Connection(in_fd, writable=False), Connection(out_fd, readable=False)
    try:
        sys.path[:] = inbox.recv()  # the parent's: a tool's module imports as it did there
        for name in inbox.recv():
            importlib.import_module(name)
        fn = _load(inbox.recv())
    except BaseException as e:  # noqa: BLE001 -- said to the parent, which names the tool
        outbox.send(("error", _describe(e)))
        return
    outbox.send(("ready", None))
    while True:
        try:
            kwargs = inbox.recv()
        except EOFError:  # the parent closed the pipe (or exited): done
            return
        try:
            value = fn(**kwargs)
            if inspect.isawaitable(value):
                value = asyncio.run(_wait(value))
            reply = ("value", value)
        except BaseException as e:  # noqa: BLE001 -- handed to the parent
            reply = ("raised", _describe(e))
        try:
            outbox.send(reply)  # pickled whole before a byte is written: a failure sends nothing
        except Exception as e:  # noqa: BLE001 -- a value that does not pickle
            outbox.send(("unsent", _describe(e)))


async def _wait(awaitable):
    return await awaitable


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
