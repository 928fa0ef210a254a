"""The rollout server under load or abuse: connections past its cap, bodies past what it holds at
once, a client that trickles its request or hangs up midway, and the warning of a server without
a token. Each on a toy server on a real local port (tests/toy.py)."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from types import SimpleNamespace

import pytest
from toy import ToyPolicy
from typer.testing import CliRunner

from mmrl.core import cli, remote, serve, wire
from mmrl.core.config import RolloutConfig
from mmrl.core.engine import EngineError, Request

PARTIAL = b"GET /health HTTP/1.0\r\nHost: x"  # headers that never end: the connection holds its slot


def start(**limits) -> serve.EngineServer:
    return serve.serve_in_thread(serve.ServedPolicyEngine(ToyPolicy(seed=0)), RolloutConfig, **limits)


def until(condition, seconds: float = 3.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the server never got there"
        time.sleep(0.01)


def hold(server, stack: ExitStack, sent: bytes = PARTIAL) -> socket.socket:
    """A connection that sent `sent` and then nothing (closed when `stack` closes)."""
    sock = stack.enter_context(socket.create_connection(server.server_address[:2], timeout=5))
    sock.sendall(sent)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """What the server sends until it closes ("" for a reset: nothing came)."""
    reply = b""
    try:
        while chunk := sock.recv(65536):
            reply += chunk
    except ConnectionResetError:
        pass
    return reply


def ask(server, raw: bytes) -> tuple[int, dict, bytes]:
    """(status, JSON reply, raw headers) of one request sent as bytes; status 0: closed unanswered."""
    with socket.create_connection(server.server_address[:2], timeout=5) as sock:
        sock.sendall(raw)
        reply = read_all(sock)
    if not reply:
        return 0, {}, b""
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body), head


HEALTH = b"GET /health HTTP/1.0\r\n\r\n"


def test_connections_past_the_cap_are_answered_busy_then_closed_and_use_no_more_threads():
    # every connection had a thread of its own: a client opening them without end (any user of the
    # machine reaches 127.0.0.1) exhausted the server's threads and memory
    server = start(max_connections=2, read_timeout=5)
    threads = threading.active_count()
    try:
        with ExitStack() as stack:
            for _ in range(2):
                hold(server, stack)
            until(lambda: server._serving._value == 0)  # both slots taken by the stalled clients
            status, reply, head = ask(server, HEALTH)
            assert status == 503 and b"Retry-After: 1" in head
            assert reply["error"] == ("this server is busy: it serves 2 requests at once, its limit "
                                      "(--max-connections); try again shortly")
            for _ in range(2):  # the refusals' own slots, held too
                hold(server, stack)
            until(lambda: server._refusing._value == 0)
            for _ in range(20):
                assert ask(server, HEALTH)[0] == 0  # closed at once, on no thread
            assert threading.active_count() <= threads + 4
        until(lambda: server._serving._value == 2 and server._refusing._value == 2)  # the slots come back
        assert remote.RemoteEngine(server.url, timeout=5).health()["busy"] is False
        until(lambda: threading.active_count() <= threads)  # no thread left behind
    finally:
        server.close()
    with pytest.raises(ValueError, match="max_connections must be at least 1, got 0"):
        start(max_connections=0)


def test_the_trainers_client_waits_for_a_busy_server_and_says_so_when_it_stays_busy(monkeypatch):
    monkeypatch.setattr(remote, "BUSY_WAIT", 0.05)
    server = start(max_connections=1, read_timeout=5)
    client = remote.RemoteEngine(server.url, timeout=0.5)
    try:
        with ExitStack() as stack:
            hold(server, stack)
            until(lambda: server._serving._value == 0)
            t0 = time.monotonic()
            with pytest.raises(EngineError, match=r"answered HTTP 503: this server is busy: .* try again shortly "
                                                  r"\(still busy after \d+ tries in 0\.\d s\)") as caught:
                client.health()
            assert caught.value.code == 503 and time.monotonic() - t0 < 1.5
            answers = []
            waiting = threading.Thread(target=lambda: answers.append(remote.RemoteEngine(server.url, timeout=5)
                                                                     .health()))
            waiting.start()
            time.sleep(0.2)  # refused meanwhile, and sent again
        waiting.join(5)  # the stalled client is gone: its slot frees and the call goes through
        assert answers and answers[0]["name"] == "served"
    finally:
        server.close()


class Gated(ToyPolicy):
    """A policy whose generate waits for `gate`: its request's body stays held meanwhile."""

    def __init__(self):
        super().__init__(seed=0)
        self.gate = threading.Event()

    def generate(self, *args, **kwargs):
        self.gate.wait(5)
        return super().generate(*args, **kwargs)


def generate_body(*prompts: int) -> bytes:
    requests = [Request(group=k, prompt=p, n=1) for k, p in enumerate(prompts)]
    return json.dumps({"requests": wire.encode_requests(requests), "rollout": {"max_new_tokens": 1},
                       "seed": 0}).encode()


def test_bodies_past_what_the_server_holds_at_once_wait_unread_then_are_answered_busy():
    # each of any number of connections could read a body of up to 1 GiB (/generate) or 4 GiB
    # (/weights) into memory at once, and hold it (decoded) while the engine ran
    policy = Gated()
    first, second = generate_body(1), generate_body(2, 3)
    server = serve.serve_in_thread(serve.ServedPolicyEngine(policy), RolloutConfig, read_timeout=0.5,
                                   max_request_bytes=len(second), max_weights_bytes=len(second),
                                   max_bodies_bytes=len(first) + len(second) - 1)
    post = lambda body: ask(server, b"POST /generate HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    try:
        with ThreadPoolExecutor(2) as pool:
            held = pool.submit(post, first)  # read, then held in the engine until the gate opens
            until(lambda: server.bodies_bytes == len(first))
            status, reply, head = post(second)
            assert status == 503 and b"Retry-After: 1" in head
            assert reply["error"] == (f"this server is busy: it holds {len(first)} bytes of other requests' bodies, "
                                      f"and this one's {len(second)} would pass its limit of "
                                      f"{server.max_bodies_bytes} at once for 0.5 s; try again shortly")
            waiting = pool.submit(post, second)  # it waits, unread, and is served once the first is done
            time.sleep(0.05)
            policy.gate.set()
            assert held.result()[0] == 200 and waiting.result()[0] == 200
        assert server.bodies_bytes == 0  # all given back
    finally:
        policy.gate.set()
        server.close()
    assert start(max_request_bytes=10, max_weights_bytes=20).max_bodies_bytes == 30  # one largest of each
    with pytest.raises(ValueError, match=r"max_bodies_bytes \(15\) must hold the largest body, max\(10, 20\)"):
        start(max_request_bytes=10, max_weights_bytes=20, max_bodies_bytes=15)


def trickle(server, head: bytes, data: bytes, every: float, seconds: float) -> tuple[bytes | None, float]:
    """Send `head`, then `data` a byte per `every` s for at most `seconds`; (what came back, when
    the server closed; None: it waited all along)."""
    t0 = time.monotonic()
    with socket.create_connection(server.server_address[:2], timeout=5) as sock:
        sock.sendall(head)
        sock.settimeout(every)
        for i in range(len(data)):
            try:
                sock.sendall(data[i:i + 1])
                if chunk := sock.recv(65536):
                    return chunk + read_all(sock), time.monotonic() - t0
                return b"", time.monotonic() - t0  # closed
            except TimeoutError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                return b"", time.monotonic() - t0
            if time.monotonic() - t0 > seconds:
                break
    return None, time.monotonic() - t0


def test_a_client_that_trickles_its_request_is_dropped(monkeypatch):
    # the read timeout bounds each wait: a byte every 0.1 s (a minute, with the default 60 s)
    # held a thread, and now a slot, for ever
    server = start(read_timeout=0.3)
    try:
        reply, took = trickle(server, b"GET /health HTTP/1.0\r\n", b"X-Slow: " + b"a" * 100, every=0.1, seconds=2)
        assert reply == b"" and took < 1.0  # headers: the connection is closed
        monkeypatch.setattr(serve, "MIN_BODY_RATE", 1e9)  # a body gets read_timeout, plus nothing for its size
        head = b"POST /generate HTTP/1.0\r\nContent-Length: 100\r\n\r\n"
        reply, took = trickle(server, head, b"{" * 100, every=0.1, seconds=2)
        assert took < 1.5 and reply.startswith(b"HTTP/1.0 408 "), reply
        assert b"the body of /generate arrived too slowly: " in reply and b"of its 100 bytes in 0.3 s" in reply
        assert server.bodies_bytes == 0
        assert remote.RemoteEngine(server.url, timeout=5).health()["busy"] is False  # still serving
    finally:
        server.close()


def test_a_client_that_hangs_up_midway_through_its_body_leaves_nothing_behind():
    # the short body was read as the request and answered "not valid JSON", or, if it happened to
    # parse, served as a request the client never finished
    server = start(read_timeout=5)
    threads = threading.active_count()
    try:
        with socket.create_connection(server.server_address[:2], timeout=5) as sock:
            sock.sendall(b"POST /generate HTTP/1.0\r\nContent-Length: 100\r\n\r\n{\"requests\"")
            sock.shutdown(socket.SHUT_WR)
            reply = read_all(sock)
        assert reply.startswith(b"HTTP/1.0 400 ")
        assert json.loads(reply.partition(b"\r\n\r\n")[2]) == {
            "error": "the body of /generate ended after 11 of its 100 bytes (Content-Length): the client closed "
                     "the connection"}
        until(lambda: server.bodies_bytes == 0 and server._serving._value == serve.MAX_CONNECTIONS)
        until(lambda: threading.active_count() <= threads)
    finally:
        server.close()


def test_a_server_without_a_token_warns_that_any_local_user_reaches_it(monkeypatch, capsys):
    monkeypatch.setattr(serve.EngineServer, "serve_forever", lambda self, *a: None)
    serve.serve(ToyPolicy, RolloutConfig, port=0)
    err = capsys.readouterr().err
    assert err.startswith("warning: the server at http://127.0.0.1:") and err.count("\n") == 1
    assert err.endswith(" has no token: any user of this machine can run its model and replace its weights; pass "
                        "--token (or set MMRL_SERVE_TOKEN) and give the same token to its clients\n")
    serve.serve(ToyPolicy, RolloutConfig, port=0, token="t")
    assert capsys.readouterr().err == ""


def test_max_connections_reaches_the_server_from_both_command_lines(monkeypatch, capsys):
    assert cli.MAX_CONNECTIONS == serve.MAX_CONNECTIONS  # cli.py states it: serve imports torch
    served = []
    monkeypatch.setattr(serve, "serve", lambda *a, **kw: served.append(kw))
    monkeypatch.setattr(serve, "build_policy", lambda *a: (ToyPolicy(), SimpleNamespace(rollout=RolloutConfig())))
    with pytest.raises(SystemExit) as stop:
        serve.main(["--backend", "toy", "--max-connections", "0"])
    assert stop.value.code == 2 and "--max-connections must be at least 1, got 0" in capsys.readouterr().err
    serve.main(["--backend", "toy", "--port", "0", "--max-connections", "3"])
    app = cli.make_app(cli.BackendSpec(modality="toy", title="toy", command="toy-rl", module="toy"))
    result = CliRunner().invoke(app, ["serve", "--port", "0", "--max-connections", "4"])
    assert result.exit_code == 0, result.output
    assert [kw["max_connections"] for kw in served] == [3, 4]
    result = CliRunner().invoke(app, ["serve", "--max-connections", "0"])
    assert result.exit_code == 2 and "--max-connections" in result.output
