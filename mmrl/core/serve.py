"""A rollout engine behind HTTP, so the scheduler can use engines in other processes or machines.

    POST /generate  JSON {"requests", "rollout", "seed"} (mmrl.core.wire)  -> a packed RolloutBatch
    POST /weights   safetensors bytes, version in the X-MMRL-Version header -> {"ok", "version"}
    GET  /health                                                 -> {"name", "version", "busy", "weights"}

A request's rollout keys that it leaves out take the served run's values (`rollout=`), and a
prompt may be a plain string: the backend's text prompt (its policy's `serve_prompt` hook).

An error inside the engine answers 500 with {"error": "..."}; input that cannot
be decoded answers 400, as do requests for more than `max_samples` samples in all (MAX_SAMPLES
by default, `--max-samples`), an over-long body 413, a body that stalls for
`read_timeout` seconds 408 (stalled headers: the connection is closed), so a
client that stops sending does not hold a server thread forever. Nor does one that sends a byte
a minute: the headers must all arrive within `read_timeout`, a body within `read_timeout` plus a
second per MiB (MIN_BODY_RATE).

Load: at most `max_connections` requests are served at once (MAX_CONNECTIONS, `--max-connections`);
as many more are answered 503 ("busy", Retry-After), and connections past those are closed at
once, so no number of clients exhausts the server's threads. The bodies held at once (read, being
read, or decoded) are bounded too (`max_bodies_bytes`: by default one largest /generate and one
largest /weights): a request whose body would pass that waits, unread, for others to end, and
is answered 503 if they do not within `read_timeout`. A 503 comes before the request is acted
on, so RemoteEngine sends it again (mmrl.core.remote).

Calls into the engine are serialized with one lock (an engine runs one job at a time; a publish
never lands in the middle of a generation). Nothing a client sends is unpickled.

A RemoteEngine tags the weights it publishes (X-MMRL-Weights: "<client>/<version>") and sends
the tag again with each /generate; a server whose weights are not those answers 409 instead of
sampling: it restarted since (the weights it started with), or another trainer published its
own (a server serves one trainer). Either would train on samples of other weights without a
word. A client that sends no tag (a script, curl) gets whatever weights the server holds.
It also sends (X-MMRL-Base) a fingerprint of the weights it does not publish (LoRA's base model:
path, names, shapes, a few values); a server whose own differ answers the publish with a 400, as
it does weights of another shape, instead of sampling with adapters on another base.

Access: it binds 127.0.0.1 unless told otherwise. With a token (`--token`, or the
MMRL_SERVE_TOKEN environment variable, which keeps it out of `ps`), every request
must carry `Authorization: Bearer <token>` (else 401; compared in constant time).
Bound to any address that is not loopback, it refuses to start without a token; on loopback
without one, `serve` warns at start that every user of the machine can reach it.
The token travels in clear over HTTP: across machines, use a trusted network or a tunnel.

    python -m mmrl.core.serve --backend tests.toy --config-json cfg.json --port 0

builds the backend's policy and serves it; `mmrl serve` does the same from a
run config, and `mmrl.core.remote.spawn_server` starts it as a child process.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import io
import ipaddress
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Collection
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmrl.core import wire
from mmrl.core.engine import Engine, EngineError, PolicyEngine, load_named

log = logging.getLogger("mmrl.serve")

READY = "mmrl-serve listening on "  # the stdout line a parent process waits for, then the URL
VERSION_HEADER = "X-MMRL-Version"
WEIGHTS_HEADER = "X-MMRL-Weights"  # "<client>/<version>": whose weights, set by /weights, checked by /generate
BASE_HEADER = "X-MMRL-Base"  # /weights: JSON base_fingerprint of the weights the client does not publish
MAX_REQUEST_BYTES = 1 << 30  # /generate: prompts (images included)
MAX_WEIGHTS_BYTES = 4 << 30  # /weights: full weights of a few-billion-parameter bf16 model
# /generate: samples one call may ask for (the requests' n, summed). A trainer's call is a round's
# or a mini-batch's share (rollout.scheduler.engine_batch), far below; a client asking for millions
# would hold the engine (and its memory) for hours, with every other client waiting behind it.
MAX_SAMPLES = 1 << 16
TOKEN_ENV = "MMRL_SERVE_TOKEN"  # the token, when --token / token= is not given
READ_TIMEOUT = 60.0  # seconds a client may stay silent while sending a request (each wait), and its headers' total
# A body may take read_timeout plus a second per MiB: a trickle (a byte a minute) is dropped, not
# waited on for hours; 1 MiB/s is far below any cluster network or tunnel (a 4 GiB publish: 70 min).
MIN_BODY_RATE = 1 << 20
# Requests served at once (each on a thread); as many more are answered 503, the rest are closed.
# A trainer keeps one or two open per server (a call, a health check); 32 leaves room for scripts.
MAX_CONNECTIONS = 32
_DRAIN_LIMIT = 1 << 20  # a refused request's body is read (so the client sees the 401 or 503) up to this


class InsecureServeError(ValueError):
    """Refusing to serve on a non-loopback address without a token."""


def resolve_token(token: str | None) -> str | None:
    """`token`, else $MMRL_SERVE_TOKEN, else None (an empty string counts as none)."""
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    return token or None


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (127.0.0.0/8, ::1, "localhost")."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


class ServedPolicyEngine(PolicyEngine):
    """A policy that only this server uses: publish loads the weights into it in place,
    without the frozen copy PolicyEngine(own_weights=True) would keep (nobody else steps it)."""

    def __init__(self, policy, name: str = "served"):
        super().__init__(policy, own_weights=False, name=name)

    def publish(self, weights: dict[str, Tensor], version: int) -> None:
        try:
            load_named(self.policy.model, weights)
        except EngineError as e:  # the client's weights are of another model: its error (400), not the engine's
            raise wire.WireError(f"{e}. This server serves {describe_policy(self.policy)}: serve the trainer's "
                                 "backend and model (its config), or train the served one") from None
        self.version = version

    def check_base(self, theirs: dict[str, Any], weights: dict[str, Tensor]) -> None:
        """WireError (a 400) unless the weights a publish leaves as they are (LoRA's base model)
        are the trainer's: `theirs` is its base_fingerprint, sent with the weights."""
        mine = base_fingerprint(self.policy.model, published=weights.keys())
        why = base_mismatch(theirs, mine)
        if why is not None:
            raise wire.WireError(
                f"the trainer's base model (the weights it does not publish) is not this server's: {why}; the "
                f"trainer's is from {theirs.get('path') or 'an unnamed path'}, this server's from "
                f"{mine['path'] or 'an unnamed path'}. This server serves {describe_policy(self.policy)}: "
                "start it from the trainer's model (its model.path)")

    def check_requests(self, requests: list, rollout) -> None:
        """Each prompt in the form the policy's generate takes, through its `serve_prompt` hook
        (a plain string becomes the backend's prompt item); a prompt it refuses is the client's
        error (400), named here, not an engine failure (500) met mid-generation."""
        convert = getattr(self.policy, "serve_prompt", None)
        if convert is None:
            return
        for i, r in enumerate(requests):
            try:
                r.prompt = convert(r.prompt, rollout)
            except (TypeError, ValueError) as e:
                raise wire.WireError(f"requests[{i}].prompt: {e}") from None


def describe_policy(policy) -> str:
    """What a server serves, for a client whose weights do not fit: "dllm_rl.policy.DLLMPolicy
    (LlamaForCausalLM from /models/llada)"."""
    model = policy.model
    path = model_path(model)
    return (f"{type(policy).__module__}.{type(policy).__qualname__} "
            f"({type(model).__name__}{f' from {path}' if path else ''})")


def model_path(model) -> str | None:
    """Where a Hugging Face model was loaded from, if it says."""
    return getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)


def base_fingerprint(model: torch.nn.Module, published: Collection[str] | None = None) -> dict[str, Any]:
    """A cheap fingerprint of the weights a publish leaves as they are: those not in `published`
    (None: the frozen ones, requires_grad False), i.e. LoRA's base model. Under LoRA only the
    adapters travel, so a server started from another base checkpoint of the same architecture
    would take them and sample with the wrong base without a word. It holds the model's path,
    a digest of every such tensor's name and shape, and a few values of a few tensors (each
    with its dtype, so that a bfloat16 server and a float32 trainer compare at bfloat16)."""
    params = [(n, p) for n, p in model.named_parameters()
              if (not p.requires_grad if published is None else n not in published)]
    shapes = hashlib.sha256("".join(f"{n}{tuple(p.shape)};" for n, p in params).encode()).hexdigest()[:16]
    values = {}
    for n, p in params[:: -(-len(params) // 8) or 1]:  # 8 tensors spread over the model
        flat = p.detach().reshape(-1)
        if not flat.numel():
            continue
        at = torch.linspace(0, flat.numel() - 1, 4).round().long().to(flat.device)  # 4 values, first to last
        values[n] = [str(p.dtype).removeprefix("torch."), flat[at].double().tolist()]
    return {"path": model_path(model), "tensors": len(params), "shapes": shapes, "values": values}


def base_mismatch(theirs: dict[str, Any], mine: dict[str, Any]) -> str | None:
    """How the trainer's fingerprint (`theirs`) differs from this server's, or None."""
    if theirs.get("shapes") != mine["shapes"]:
        return (f"{theirs.get('tensors')} tensors that are not published, of other names or shapes than "
                f"this server's {mine['tensors']}")
    fine = {"float64": 3, "float32": 2, "bfloat16": 1, "float16": 1}  # how many bits a value keeps, in order
    for name, (dtype, values) in theirs.get("values", {}).items():
        my_dtype, my_values = mine["values"].get(name, (None, None))
        if my_dtype is None or fine.get(dtype, 0) == fine.get(my_dtype, 0) and dtype != my_dtype:
            continue  # bfloat16 against float16: neither holds the other's values exactly
        coarse = getattr(torch, min((dtype, my_dtype), key=lambda d: fine.get(d, 0)))
        same = (torch.tensor(values, dtype=torch.float64).to(coarse)
                == torch.tensor(my_values, dtype=torch.float64).to(coarse)).tolist()
        if not all(same):
            i = same.index(False)
            return f"other values in {name} ({values[i]:.6g} in the trainer's, {my_values[i]:.6g} in this server's)"
    return None


def check_bind(host: str, token: str | None) -> None:
    """InsecureServeError unless `host` is loopback or there is a token."""
    # Security: the API runs the model on whatever it is sent and replaces its weights, so
    # it is never reachable from other machines without a token.
    if not token and not is_loopback(host):
        raise InsecureServeError(
            f"refusing to serve on {host or '0.0.0.0'} without a token: anyone who can reach it "
            f"could run the model and replace its weights. Pass --token (or set {TOKEN_ENV}) and "
            "give the same token to the clients (RemoteEngine(token=...) or that variable), "
            "or bind 127.0.0.1"
        )


def no_token_warning(url: str) -> str:
    """What `serve` warns of when it has no token (so binds loopback): every user of the machine
    (of a shared cluster node) can reach 127.0.0.1."""
    return (f"the server at {url} has no token: any user of this machine can run its model and replace its "
            f"weights; pass --token (or set {TOKEN_ENV}) and give the same token to its clients")


def check_port(host: str, port: int) -> None:
    """OSError naming the address if `host:port` cannot be bound (taken, not this machine's, or
    no port), tried before the model loads (minutes for a large one) rather than after. Port 0
    is probed too: it always finds a port, but not on an address that is not this machine's."""
    if not 0 <= port <= 65535:  # bind() raises OverflowError, a traceback past the CLIs' OSError
        raise OSError(f"cannot serve on {host}:{port}: a port is from 0 to 65535 (0 picks a free one)")
    with socket.socket(EngineServer.address_family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds (allow_reuse_address)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise OSError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None


class EngineServer(ThreadingHTTPServer):
    """The HTTP server of one engine. `url` is where it listens; `close()` stops it."""

    daemon_threads = True  # a hung engine call must not keep the process alive

    def __init__(self, engine: Engine, rollout_cls: type, host: str = "127.0.0.1", port: int = 0, *,
                 max_request_bytes: int = MAX_REQUEST_BYTES, max_weights_bytes: int = MAX_WEIGHTS_BYTES,
                 token: str | None = None, read_timeout: float | None = READ_TIMEOUT, rollout: Any = None,
                 max_samples: int = MAX_SAMPLES, max_connections: int = MAX_CONNECTIONS,
                 max_bodies_bytes: int | None = None):
        """`token`: required of every request (Authorization: Bearer); None or "" = no check,
        allowed only on a loopback address. (The environment is read by the CLIs, not here.)
        `read_timeout`: seconds each read of a request (and write of its reply) may wait on the
        client; None waits forever. `rollout`: the served run's rollout config, whose values
        fill what a request's rollout leaves out (None: the rollout class's defaults).
        `max_samples`: the most samples one /generate may ask for, all its requests' n together.
        `max_connections`: requests served at once (as many more get a 503, the rest are closed).
        `max_bodies_bytes`: the bytes of request bodies held at once (None: one largest /generate
        body and one largest /weights body)."""
        check_bind(host, token)  # before binding
        if read_timeout is not None and not read_timeout > 0:
            raise ValueError(f"read_timeout must be > 0 seconds (or None), got {read_timeout!r}")
        if max_samples < 1:
            raise ValueError(f"max_samples must be at least 1, got {max_samples!r}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections!r}")
        if max_bodies_bytes is not None and max_bodies_bytes < max(max_request_bytes, max_weights_bytes):
            # a largest body would never be taken
            raise ValueError(f"max_bodies_bytes ({max_bodies_bytes}) must hold the largest body, "
                             f"max({max_request_bytes}, {max_weights_bytes})")
        self.token = token or None
        super().__init__((host, port), _Handler)
        self.engine = engine
        self.rollout_cls = rollout_cls
        self.rollout = rollout
        self.max_request_bytes = max_request_bytes
        self.max_weights_bytes = max_weights_bytes
        self.max_samples = max_samples
        self.read_timeout = read_timeout
        self.version = getattr(engine, "version", 0)
        self.weights: str | None = None  # the tag of the weights last published; None: those it started with
        self.lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.max_connections = max_connections
        self._serving = threading.BoundedSemaphore(max_connections)  # a slot per request served
        self._refusing = threading.BoundedSemaphore(max_connections)  # a slot per 503 being answered
        self._turned_away = 0.0  # when a connection was last closed unanswered (its warning, once a minute)
        self._max_bodies_bytes = max_bodies_bytes
        self.bodies_bytes = 0  # of the bodies held now, under _bodies
        self._bodies = threading.Condition()  # notified as bodies are let go

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> EngineServer:
        """Serve in a background thread (for tests and in-process use)."""
        # A short poll interval only makes close() quick; the loop sleeps in select meanwhile.
        self._thread = threading.Thread(target=self.serve_forever, args=(0.05,),
                                        name=f"mmrl-serve-{self.url}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self.shutdown()  # only returns once serve_forever has stopped, so only when it runs
            self._thread.join()
        self.server_close()

    def process_request(self, request, client_address) -> None:
        """Serve the connection on a thread of its own if a slot is free; else answer 503 on one
        of as many refusal slots; else close it at once (ThreadingMixIn started a thread for each:
        a client opening connections without end exhausted the process's threads and memory)."""
        if self._serving.acquire(blocking=False):
            slots, handler = self._serving, _Handler
        elif self._refusing.acquire(blocking=False):
            slots, handler = self._refusing, _Busy
        else:
            if time.monotonic() - self._turned_away > 60:
                log.warning("%d requests at once and as many answered busy: closing new connections unanswered",
                            self.max_connections)
            self._turned_away = time.monotonic()
            self.shutdown_request(request)
            return
        try:
            threading.Thread(target=self._serve_connection, args=(request, client_address, handler, slots),
                             daemon=True).start()
        except RuntimeError:  # can't start new thread: the machine's limit, whatever ours is
            slots.release()
            self.shutdown_request(request)

    def _serve_connection(self, request, client_address, handler: type, slots: threading.BoundedSemaphore) -> None:
        try:
            handler(request, client_address, self)
        except Exception:  # noqa: BLE001 -- as ThreadingMixIn: logged, and the server serves on
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            slots.release()

    @property
    def max_bodies_bytes(self) -> int:
        """The bytes of request bodies held at once; by default one largest of each kind."""
        return self._max_bodies_bytes or self.max_request_bytes + self.max_weights_bytes

    def hold_body(self, size: int) -> bool:
        """Count `size` bytes of a body as held once that keeps within max_bodies_bytes; False if it
        does not within read_timeout. (Waiting costs no memory: the client's bytes wait in its socket.)"""
        with self._bodies:
            if not self._bodies.wait_for(lambda: self.bodies_bytes + size <= self.max_bodies_bytes,
                                         self.read_timeout):
                return False
            self.bodies_bytes += size
            return True

    def drop_body(self, size: int) -> None:
        with self._bodies:
            self.bodies_bytes -= size
            self._bodies.notify_all()


def serve(engine: Engine, rollout_cls: type, host: str = "127.0.0.1", port: int = 8400, *,
          ready: Callable[[str], Any] | None = None, **limits) -> None:
    """Serve `engine` until interrupted; `ready(url)` is called once the port is bound. Ctrl-C
    raises KeyboardInterrupt on (the CLIs exit 130); with a request inside the engine the
    process ends at once, with status 130."""
    server = EngineServer(engine, rollout_cls, host, port, **limits)
    if server.token is None:  # on loopback (elsewhere a token is required): not private on a shared machine
        print(f"warning: {no_token_warning(server.url)}", file=sys.stderr, flush=True)
    if ready is not None:
        ready(server.url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        if server.lock.locked():
            # The request runs in the engine on a daemon thread: the interpreter finalizing under
            # it aborted the process ("terminate called without an active exception", SIGABRT).
            # Its client sees the connection close, as for any server that stops.
            server.server_close()
            print("interrupted: the request in the engine was dropped", file=sys.stderr, flush=True)
            os._exit(130)
        raise
    finally:
        server.server_close()


def serve_in_thread(engine: Engine, rollout_cls: type, host: str = "127.0.0.1", port: int = 0,
                    **limits) -> EngineServer:
    """Start serving in a background thread; port 0 picks a free port (see server.url)."""
    return EngineServer(engine, rollout_cls, host, port, **limits).start()


class _BadInput(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers


class _Late(TimeoutError):
    """A request's headers, or its body, took longer in all than they may."""


class _DeadlineReader(io.RawIOBase):
    """A connection's bytes: each wait on the client is at most `timeout` seconds (None: no
    bound), and all of them end at `deadline` (time.monotonic(); None: none). The socket's own
    timeout bounds each wait only, so a client sending a byte a minute held a thread for ever."""

    def __init__(self, sock: socket.socket, timeout: float | None):
        self.sock, self.timeout = sock, timeout
        self.deadline: float | None = None
        self.count = 0  # bytes read since the deadline was set

    def limit(self, seconds: float | None) -> None:
        """Let what is read from now take at most `seconds` in all (None: no bound)."""
        self.deadline = None if seconds is None else time.monotonic() + seconds
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        wait = self.timeout
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise _Late("past its deadline")
            wait = left if wait is None else min(wait, left)
        self.sock.settimeout(wait)
        try:
            n = self.sock.recv_into(buffer)
        except TimeoutError:
            if wait != self.timeout:  # cut short by the deadline; else the client fell silent
                raise _Late("past its deadline") from None
            raise
        finally:
            self.sock.settimeout(self.timeout)  # what the replies' writes wait
        self.count += n
        return n


class _Handler(BaseHTTPRequestHandler):
    server: EngineServer
    busy = False  # _Busy: answers 503 to whatever it is asked

    def setup(self) -> None:
        self.timeout = self.server.read_timeout  # the socket's timeout, set by StreamRequestHandler.setup
        super().setup()
        self.reader = _DeadlineReader(self.connection, self.timeout)
        self.rfile = io.BufferedReader(self.reader)
        self.held = 0  # bytes of this request's body counted in server.bodies_bytes

    def handle_one_request(self) -> None:
        self.reader.limit(self.timeout)  # the request line and headers, in all
        super().handle_one_request()

    def _refuse(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        """Answer `status` without reading the body: a small one is read and dropped first
        (unread bytes would reset the connection before the client reads our reply)."""
        length = self.headers.get("Content-Length", "")
        try:
            if length.isdigit() and int(length) <= _DRAIN_LIMIT:
                self.reader.limit(self.timeout)
                self.rfile.read(int(length))
            else:
                self.close_connection = True
        except TimeoutError:
            self.close_connection = True
        self._reply(status, {"error": message}, headers)

    def _gate(self) -> bool:
        """True if the request may go on; else answer it (503 busy, 401 no token) and say False."""
        if self.busy:
            self._refuse(503, f"this server is busy: it serves {self.server.max_connections} requests at once, "
                              "its limit (--max-connections); try again shortly", {"Retry-After": "1"})
            return False
        token = self.server.token
        if token is None:
            return True
        given = self.headers.get("Authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode()):
            return True
        message = "missing token" if not given else "wrong token"
        self._refuse(401, f"{message}: this server needs 'Authorization: Bearer <token>'", {"WWW-Authenticate": "Bearer"})
        return False

    def do_GET(self) -> None:
        if not self._gate():
            return
        if self.path in ("/generate", "/weights"):
            return self._reply(405, {"error": f"{self.path} takes POST, not GET"}, {"Allow": "POST"})
        if self.path != "/health":
            return self._reply(404, {"error": f"no such endpoint: GET {self.path}"})
        s = self.server
        # weights: the tag of the weights last published (None: those it started with), so a trainer
        # can tell a restarted server, which it may take back, from one another trainer took
        self._reply(200, {"name": s.engine.name, "version": s.version, "busy": s.lock.locked(), "weights": s.weights})

    def do_POST(self) -> None:
        if not self._gate():
            return
        route = {"/generate": self._generate, "/weights": self._weights}.get(self.path)
        if route is None:
            self.close_connection = True  # its body is not read: it must not be taken for the next request
            if self.path == "/health":
                return self._reply(405, {"error": "/health takes GET, not POST"}, {"Allow": "GET"})
            return self._reply(404, {"error": f"no such endpoint: POST {self.path}"})
        try:
            route()
        except _BadInput as e:
            self._reply(e.status, {"error": str(e)}, e.headers)
        except wire.WireError as e:
            self._reply(400, {"error": f"bad request to {self.path}: {e}"})
        except Exception as e:  # the client is told; the server keeps serving
            log.exception("engine call %s failed", self.path)
            self._reply(500, {"error": f"engine {self.server.engine.name} failed in {self.path}: "
                                       f"{type(e).__name__}: {e}"})
        finally:
            self.server.drop_body(self.held)  # held until the reply is sent: its decoded form lived as long
            self.held = 0

    def _generate(self) -> None:
        try:
            body = json.loads(self._body(self.server.max_request_bytes))
        except (ValueError, RecursionError) as e:
            raise _BadInput(400, f"body of /generate is not valid JSON: {e}") from None
        if not isinstance(body, dict) or set(body) != {"requests", "rollout", "seed"}:
            raise _BadInput(400, "body of /generate must be an object with keys requests, rollout, seed")
        requests = wire.decode_requests(body["requests"])
        rollout = wire.decode_rollout(body["rollout"], self.server.rollout_cls, self.server.rollout)
        seed = body["seed"]
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise _BadInput(400, f"seed must be an integer, got {seed!r}")
        if not -(2**63) <= seed < 2**64:  # what torch.Generator.manual_seed takes
            raise _BadInput(400, f"seed must be an integer from -2**63 to 2**64 - 1, got {seed}")
        if not requests:  # an engine batch of no rows is no batch
            raise _BadInput(400, "requests is an empty list: send at least one Request")
        samples = sum(r.n for r in requests)
        if samples > self.server.max_samples:
            raise _BadInput(400, f"the requests ask for {samples} samples in all (their n, summed), over this "
                                 f"server's limit of {self.server.max_samples} per call (its --max-samples): "
                                 "split them into several calls (a trainer: lower rollout.scheduler.engine_batch)")
        check = getattr(self.server.engine, "check_requests", None)
        if check is not None:
            check(requests, rollout)
        with self.server.lock:  # checked under the lock: no publish lands between the check and the call
            self._check_weights(self.headers.get(WEIGHTS_HEADER))
            batch = self.server.engine.generate(requests, rollout, seed)
        self._reply(200, wire.encode_batch(batch))

    def _weights(self) -> None:
        try:
            version = int(self.headers.get(VERSION_HEADER, ""))
        except ValueError:
            raise _BadInput(400, f"/weights needs an integer {VERSION_HEADER} header") from None
        weights = wire.decode_weights(self._body(self.server.max_weights_bytes))
        base, check = self.headers.get(BASE_HEADER), getattr(self.server.engine, "check_base", None)
        if base is not None and check is not None:
            try:
                base = json.loads(base)
            except ValueError as e:
                raise _BadInput(400, f"the {BASE_HEADER} header is not valid JSON: {e}") from None
            if not isinstance(base, dict):
                raise _BadInput(400, f"the {BASE_HEADER} header must be a JSON object (a base_fingerprint)")
            check(base, weights)
        with self.server.lock:
            self.server.engine.publish(weights, version)
            self.server.version = version
            self.server.weights = self.headers.get(WEIGHTS_HEADER) or None
        self._reply(200, {"ok": True, "version": version})

    def _check_weights(self, expected: str | None) -> None:
        """409 unless the weights held are those the client says it published (no tag: no check)."""
        held = self.server.weights
        if expected is None or expected == held:
            return
        mine = _describe_tag(expected)
        if held is None:
            why = (f"it holds the weights it started with, not {mine} that this client published: "
                   "it restarted since (publish again to use it)")
        else:
            why = (f"it holds {_describe_tag(held)}, published after this client's {mine}: another trainer "
                   "(or a second engine of this one) publishes to the same server; a server serves one "
                   "trainer, start one for each")
        raise _BadInput(409, f"this server would sample with other weights than the client's: {why}")

    def _body(self, limit: int) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise _BadInput(411, "a Content-Length header is required")
        size = int(length)
        if size > limit:
            raise _BadInput(413, f"body of {size} bytes is over this server's limit of {limit}")
        if not self.server.hold_body(size):
            # The body is not read: the connection closes, and a client still sending a large one
            # sees it broken, not this reply (RemoteEngine: unreachable, which the scheduler retries).
            self.close_connection = True
            raise _BadInput(503, f"this server is busy: it holds {self.server.bodies_bytes} bytes of other requests' "
                                 f"bodies, and this one's {size} would pass its limit of {self.server.max_bodies_bytes} "
                                 f"at once for {self.timeout:g} s; try again shortly", {"Retry-After": "1"})
        self.held = size
        allowed = None if self.timeout is None else self.timeout + size / MIN_BODY_RATE
        self.reader.limit(allowed)
        try:
            body = self.rfile.read(size)
        except _Late:
            self.close_connection = True
            raise _BadInput(408, f"the body of {self.path} arrived too slowly: {self.reader.count} of its {size} "
                                 f"bytes in {allowed:.1f} s (a body may take {self.timeout:g} s plus a second "
                                 "per MiB)") from None
        except TimeoutError:
            self.close_connection = True
            raise _BadInput(408, f"the body of {self.path} stopped arriving: nothing for {self.timeout:g} s") from None
        if len(body) < size:  # the client hung up: what came is not the request it meant
            self.close_connection = True
            raise _BadInput(400, f"the body of {self.path} ended after {len(body)} of its {size} bytes "
                                 "(Content-Length): the client closed the connection")
        return body

    def _reply(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        try:
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            # The client hung up first (its timeout ran out during a long generation): nothing to
            # answer, and not the engine's failure (it was logged as one, with a 500 that failed
            # to send in turn and a second traceback from the server loop).
            self.close_connection = True
            log.info("%s hung up before the reply to %s (%d)", self.address_string(), self.path, status)

    def log_message(self, format: str, *args) -> None:
        log.debug("%s " + format, self.address_string(), *args)


class _Busy(_Handler):
    """A connection past max_connections: its request is read and answered 503, whatever it asks."""

    busy = True


def _describe_tag(tag: str) -> str:
    client, _, version = tag.rpartition("/")
    return f"version {version} of client {client}" if client else repr(tag)


# --------------------------------------------------------------------------- command line


def served_policy(backend, cfg):
    """The policy to serve. Serving needs the model only: where the backend builds its policy
    alone (`build_policy`, as for export), the run's data files need not be there (a run copied
    to another machine without them). A backend whose policy takes a setting from its task (the
    dLLM's prompt width, which a trainer's batches must share) says so with SERVE_READS_TASK."""
    if hasattr(backend, "build_policy") and not getattr(backend, "SERVE_READS_TASK", False):
        return backend.build_policy(cfg)
    return backend.build(cfg)[0]


def build_policy(backend_module: str, config: dict, checkpoint: str | None = None):
    """The backend's policy for a config dict (merged over the backend's defaults) and its config."""
    import importlib

    from mmrl.core import plugins
    from mmrl.core.config import TrainConfig, deep_merge, load_config

    backend = importlib.import_module(backend_module)
    defaults = deep_merge(dict(getattr(backend, "DEFAULT_CONFIG", {})), config)
    cls = plugins.config_class(getattr(backend, "CONFIG_CLASS", TrainConfig), None, [], defaults)  # a plugin's method
    cfg = load_config(cls, defaults=defaults)
    policy = served_policy(backend, cfg)
    if checkpoint is not None:
        from mmrl.core.cli import load_checkpoint

        load_checkpoint(policy, checkpoint)
    return policy, cfg


def exit_when_closed(fd: int, why: str) -> threading.Thread:
    """End the process once file descriptor `fd` (the read end of a pipe) reaches its end: its writer, the
    process that started this server, is gone, even if it was killed (SIGKILL, out of memory)
    and could not stop the server itself, which would otherwise hold its memory and GPU for good."""
    def watch() -> None:
        # os.read, not sys.stdin's buffered reader: a daemon thread blocked holding its lock
        # aborts the interpreter's shutdown ("could not acquire lock ... at interpreter shutdown")
        while os.read(fd, 1 << 16):  # nothing is ever sent: b"" once the writer is gone
            pass
        try:
            print(f"exiting: {why}", file=sys.stderr, flush=True)
        except OSError:  # stderr was a pipe to that process too: no one reads it any more
            pass
        os._exit(0)  # from a thread: the main one is in serve_forever (or still loading the model)

    thread = threading.Thread(target=watch, name="mmrl-serve-parent", daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m mmrl.core.serve",
        description="Serve a backend's policy as a rollout engine over HTTP "
        "(POST /generate, POST /weights, GET /health). Prints '" + READY + "<url>' once listening.",
    )
    parser.add_argument("--backend", required=True, help="backend module, e.g. mmrl.vlm.backend")
    parser.add_argument("--config-json", type=Path, help="JSON file of the run config (merged over the backend's defaults)")
    parser.add_argument("--checkpoint", help="checkpoint or run directory to load weights from")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: loopback only; any other address needs a token)")
    parser.add_argument("--token", default=None,
                        help=f"require 'Authorization: Bearer <token>' on every request (default: ${TOKEN_ENV}, "
                        "which, unlike this flag, does not show in the process list)")
    parser.add_argument("--port", type=int, default=8400, help="port; 0 picks a free one (default: 8400)")
    parser.add_argument("--name", default="served", help="engine name in /health and error messages")
    parser.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES, help="largest /generate body")
    parser.add_argument("--max-weights-bytes", type=int, default=MAX_WEIGHTS_BYTES, help="largest /weights body")
    parser.add_argument("--max-samples", type=int, default=MAX_SAMPLES,
                        help=f"most samples one /generate may ask for, its requests' n summed (default: {MAX_SAMPLES})")
    parser.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                        help=f"requests served at once; as many more are answered 503 (default: {MAX_CONNECTIONS})")
    parser.add_argument("--read-timeout", type=float, default=READ_TIMEOUT,
                        help=f"seconds a client may stay silent while sending a request (default: {READ_TIMEOUT:g})")
    parser.add_argument("--ignore-stop-signals", action="store_true",
                        help="ignore SIGTERM and SIGUSR1: a trainer's engine, which the trainer kills itself once it "
                        "has saved the step it was in (a cluster scheduler signals every process of a job)")
    parser.add_argument("--exit-with-stdin", action="store_true",
                        help="exit once stdin closes: a server that spawn_server started ends with the trainer "
                        "that holds the other end of the pipe, however that ends")
    args = parser.parse_args(argv)
    if args.exit_with_stdin:
        exit_when_closed(0, "stdin closed: the process that started this server is gone")
    if args.ignore_stop_signals:
        import signal

        from mmrl.core.stop import stop_signals

        for sig in stop_signals():
            signal.signal(sig, signal.SIG_IGN)
    if not args.read_timeout > 0:
        parser.error(f"--read-timeout must be > 0, got {args.read_timeout:g}")
    if args.max_samples < 1:
        parser.error(f"--max-samples must be at least 1, got {args.max_samples}")
    if args.max_connections < 1:
        parser.error(f"--max-connections must be at least 1, got {args.max_connections}")

    from mmrl.core.checkpoint import CheckpointError
    from mmrl.core.config import ConfigError

    token = resolve_token(args.token)
    try:
        check_bind(args.host, token)  # before building a model, not after
        check_port(args.host, args.port)
        config = json.loads(args.config_json.read_text()) if args.config_json else {}
        policy, cfg = build_policy(args.backend, config, args.checkpoint)
    except (ConfigError, CheckpointError, OSError, ValueError, ImportError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    try:
        serve(ServedPolicyEngine(policy, name=args.name), type(cfg.rollout), args.host, args.port,
              ready=lambda url: print(READY + url, flush=True), token=token,
              max_request_bytes=args.max_request_bytes, max_weights_bytes=args.max_weights_bytes,
              read_timeout=args.read_timeout, rollout=cfg.rollout, max_samples=args.max_samples,
              max_connections=args.max_connections)
    except KeyboardInterrupt:  # exit 130 as the CLIs do, without a traceback
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
