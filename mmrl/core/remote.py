"""Rollout engines in other processes: an HTTP client with the Engine interface, and a launcher.

`RemoteEngine(url, timeout=...)` talks to a server of mmrl.core.serve (started by
`mmrl serve`, `python -m mmrl.core.serve` or `spawn_server`) and is used like any
engine: a Worker runs it, the scheduler owns re-dispatch. Every failure the
trainer cannot fix by itself (no connection, a timeout, an HTTP error, a reply
that does not decode) raises `EngineError` naming the server's URL, so the
scheduler can mark the engine dead and send its jobs elsewhere. A value that
cannot be encoded on this side raises `WireError` instead: no engine would take it.
A server that answers 503 (busy: its connections or the bodies it holds at their limit) has not
acted on the request, so it is sent again, for up to the engine's `timeout`.

`spawn_server(backend_module, config)` starts a server for a backend's policy as
a child process on this machine and returns it with its URL: an engine in a
separate process, with its own interpreter, memory and (optionally) device.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from http.client import HTTPException
from pathlib import Path
from typing import Any

from torch import Tensor

from mmrl.core import wire
from mmrl.core.batch import RolloutBatch
from mmrl.core.engine import EngineError, Request, label
from mmrl.core.serve import (
    BASE_HEADER,
    READY,
    TOKEN_ENV,
    VERSION_HEADER,
    WEIGHTS_HEADER,
    resolve_token,
)


class RemoteEngine:
    """An engine served over HTTP at `url`. `timeout` (seconds) bounds each wait for
    the server: connecting, and each read of its reply (a generation must answer within it)."""

    def __init__(self, url: str, *, timeout: float, name: str | None = None,
                 process: subprocess.Popen | None = None, token: str | None = None,
                 check: Callable[[RolloutBatch], None] | None = None, base: dict[str, Any] | None = None):
        """`process`: a server this engine owns (from spawn_server); close() stops it.
        `token`: sent as `Authorization: Bearer <token>` (the server's --token); default
        $MMRL_SERVE_TOKEN; none sends no header. `check`: the trainer's policy's `check_rollout`,
        a ValueError for a batch that does not fit it (a server built with other settings).
        `base`: the trainer's serve.base_fingerprint, sent with each publish; a server whose
        weights that are not published (LoRA's base model) differ refuses them (400)."""
        self.process = process
        self.check = check
        self._base = {BASE_HEADER: json.dumps(base)} if base is not None else {}
        token = token if token is not None else getattr(process, "mmrl_token", None)
        self._auth = {"Authorization": f"Bearer {t}"} if (t := resolve_token(token)) else {}
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.name = name or urllib.parse.urlsplit(self.url).netloc or self.url
        # No proxies: rollout servers are on this machine or the cluster's network, and a
        # proxy from the environment would turn "server down" into a confusing proxy error.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        # Tags the weights this client publishes; each generate asks the server to sample with
        # exactly those (a 409 if it restarted or another trainer published since: mmrl.core.serve).
        self._client = uuid.uuid4().hex[:8]
        self._weights: dict[str, str] = {}  # the header generate sends, once weights were published

    def generate(self, requests: Sequence[Request], rollout, seed: int) -> RolloutBatch:
        body = {"requests": wire.encode_requests(requests), "rollout": wire.encode_rollout(rollout),
                "seed": int(seed)}
        reply = self._call("/generate", json.dumps(body).encode(), "application/json", self._weights)
        try:
            batch = wire.decode_batch(json.loads(reply))
        except Exception as e:  # a reply that does not decode is this server's failure: the
            # scheduler drops the server (anything but an EngineError would stop the run)
            raise EngineError(f"engine {self.name}: bad reply from {self.url}/generate: "
                              f"{type(e).__name__}: {e}") from e
        batch = label(batch, requests, self.name)
        if self.check is not None:
            try:
                self.check(batch)
            except ValueError as e:  # this server's settings: the scheduler drops it, naming it
                raise EngineError(f"engine {self.name}: the batch from {self.url} does not fit the trainer's "
                                  f"policy: {e}") from None
        return batch

    def publish(self, weights: dict[str, Tensor], version: int) -> None:
        tag = {WEIGHTS_HEADER: f"{self._client}/{int(version)}"}
        self._call("/weights", wire.encode_weights(weights), "application/octet-stream",
                   {VERSION_HEADER: str(int(version)), **tag, **self._base})
        self._weights = tag

    @property
    def published_tag(self) -> str | None:
        """The tag of the weights this client last published (the server's /health "weights" while it holds them)."""
        return self._weights.get(WEIGHTS_HEADER)

    def health(self, timeout: float | None = None) -> dict[str, Any]:
        """The server's {"name", "version", "busy", "weights"}; `timeout`: this call's, instead of the engine's."""
        try:
            return json.loads(self._call("/health", timeout=timeout))
        except ValueError as e:
            raise EngineError(f"engine {self.name}: bad reply from {self.url}/health: {e}") from e

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:  # otherwise: whoever started it
            self.process.kill()
            self.process.wait()
        if self.process is not None and self.process.stdin is not None:
            self.process.stdin.close()  # spawn_server's pipe, which kept it alive

    def _call(self, path: str, body: bytes | None = None, content_type: str | None = None,
              headers: dict[str, str] | None = None, timeout: float | None = None) -> bytes:
        timeout = timeout or self.timeout
        headers = {**({"Content-Type": content_type} if content_type else {}), **(headers or {}), **self._auth}
        # A 503 comes before the server acts on the request (mmrl.core.serve), so sending it again
        # is safe: a busy server is waited for, in growing steps, for up to `timeout` in all.
        start, wait, tries = time.monotonic(), BUSY_WAIT, 1
        while True:
            try:
                return http_call(self._opener, self.url + path, engine=self.name, timeout=timeout, body=body,
                                 headers=headers)
            except HTTPStatusError as e:
                waited = time.monotonic() - start
                if e.code != 503:
                    raise
                if waited + wait > timeout:
                    raise HTTPStatusError(f"{e} (still busy after {tries} tries in {waited:.1f} s)", 503) from None
            time.sleep(wait)
            wait, tries = min(2 * wait, 5.0), tries + 1


BUSY_WAIT = 0.25  # seconds before a request a busy server refused (503) is sent again; doubled each time, up to 5


class UnreachableError(EngineError):
    """No answer from the server: it cannot be reached, the connection broke, or it did not
    answer in time. Unlike an answer that refuses, a server that restarts cures it, so the
    scheduler tries a dropped engine again once its server answers (mmrl.core.pipeline)."""


class HTTPStatusError(EngineError):
    """The server answered with an HTTP error status (`code`)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def http_call(opener, where: str, *, engine: str, timeout: float, body: bytes | None = None,
              headers: dict[str, str] | None = None) -> bytes:
    """GET (no body) or POST `where`; the reply's bytes. Every failure is an EngineError
    naming the engine and the URL (HTTPStatusError for an error status, UnreachableError for
    no answer)."""
    request = urllib.request.Request(where, data=body, method="GET" if body is None else "POST",
                                     headers=headers or {})
    try:
        with opener.open(request, timeout=timeout) as response:
            return response.read()
    except urllib.error.HTTPError as e:  # before URLError: it is one
        raise HTTPStatusError(f"engine {engine}: {where} answered HTTP {e.code}: {_error_text(e)}", e.code) from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise UnreachableError(f"engine {engine}: no answer from {where} within {timeout:g} s") from e
        raise UnreachableError(f"engine {engine}: cannot reach {where}: {e.reason}") from e
    except TimeoutError as e:
        raise UnreachableError(f"engine {engine}: no answer from {where} within {timeout:g} s") from e
    except (HTTPException, OSError) as e:  # reset, closed mid-reply, ...
        raise UnreachableError(f"engine {engine}: connection to {where} failed: {type(e).__name__}: {e}") from e


def _error_text(e: urllib.error.HTTPError) -> str:
    """The server's message: mmrl's {"error": "..."}, vLLM's {"error": {"message"}} or
    {"message"}, FastAPI's {"detail"}; else the start of whatever it sent."""
    try:
        text = e.read().decode("utf-8", "replace")
    except (OSError, HTTPException):
        return str(e.reason)
    try:
        body = json.loads(text)
        err = body.get("error", body)
        return str(err.get("message") or err.get("detail") or err) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        return text[:500] or str(e.reason)


# --------------------------------------------------------------------------- child processes


def spawn_server(backend_module: str, config: dict, *, checkpoint: str | Path | None = None,
                 timeout: float = 120.0, host: str = "127.0.0.1", name: str = "served",
                 cwd: str | Path | None = None, token: str | None = None) -> tuple[subprocess.Popen, str]:
    """Start `python -m mmrl.core.serve` for a backend's policy as a child process; returns
    (process, url) once it listens. `config` is a run config dict, merged over the backend's
    defaults; the child runs in `cwd` (default: ours), which is on its import path.
    The caller owns the process: kill it when done (it ignores SIGTERM and SIGUSR1, which a
    cluster scheduler sends every process of a job: the trainer stops first). It ends by itself
    once the caller is gone (it holds the write end of the child's stdin, `proc.stdin`: a caller
    killed outright leaves no orphan server), or once proc.stdin is closed. Raises
    EngineError, quoting the child's stderr, if it exits or stays silent for `timeout` seconds
    during start-up.
    `token`: the server's token, passed in the child's environment (not its command line,
    which any user of the machine can read); default: $MMRL_SERVE_TOKEN, else a random one.
    It is kept on `proc.mmrl_token`, where RemoteEngine(process=proc) finds it."""
    fd, config_path = tempfile.mkstemp(prefix="mmrl-serve-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(config, f, default=str)
    cmd = [sys.executable, "-m", "mmrl.core.serve", "--backend", backend_module, "--config-json", config_path,
           "--host", host, "--port", "0", "--name", name,
           "--ignore-stop-signals",  # the caller kills it; a scheduler's SIGTERM to the job is the trainer's (mmrl.core.stop)
           "--exit-with-stdin"]  # and if the caller dies without killing it (SIGKILL, OOM), its end of the pipe closes
    if checkpoint is not None:
        cmd += ["--checkpoint", str(checkpoint)]
    # Security: loopback is not private on a shared machine (every user of a cluster node can
    # reach 127.0.0.1), and without a token any of them could publish weights to this trainer's
    # engine or run its model. The trainer is the only client, so a random token costs nothing.
    token = resolve_token(token) or secrets.token_urlsafe(32)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", TOKEN_ENV: token}
    proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    # Both pipes are drained for the child's whole life, so it can never block on a full pipe;
    # the last lines of stderr stay on proc.stderr_tail for error messages.
    urls: queue.Queue = queue.Queue()
    proc.stderr_tail = tail = collections.deque(maxlen=30)
    proc.mmrl_token = token
    threading.Thread(target=_drain, args=(proc.stdout, urls, None), daemon=True).start()
    stderr_reader = threading.Thread(target=_drain, args=(proc.stderr, None, tail), daemon=True)
    stderr_reader.start()
    what = f"engine server for {backend_module}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                return proc, urls.get(timeout=0.05)
            except queue.Empty:
                pass
            if proc.poll() is not None:
                proc.stdin.close()
                stderr_reader.join(timeout=2)  # the child's last words
                raise EngineError(f"{what} exited with code {proc.returncode} during start-up:\n" + "".join(tail))
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                proc.stdin.close()
                raise EngineError(f"{what} did not start within {timeout:g} s; its stderr:\n" + "".join(tail))
    finally:
        os.unlink(config_path)  # the child read it before printing its URL, or is gone


def _drain(stream, urls: queue.Queue | None, tail: collections.deque | None) -> None:
    for line in stream:
        if urls is not None and line.startswith(READY):
            urls.put(line[len(READY):].strip())
        if tail is not None:
            tail.append(line)
