"""The rollout server under load or abuse: connections past its cap, bodies past what it holds at
once, a client that trickles its request or hangs up midway, and the warning of a server without
a token. Each on a toy server on a real local port (tests/toy.py)."""

from __future__ import annotations

import json
import socket
import threading
import time

from toy import ToyPolicy

from mmrl.core import remote, serve
from mmrl.core.config import RolloutConfig


def start(**limits) -> serve.EngineServer:
    return serve.serve_in_thread(serve.ServedPolicyEngine(ToyPolicy(seed=0)), RolloutConfig, **limits)


def until(condition, seconds: float = 3.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the server never got there"
        time.sleep(0.01)


def read_all(sock: socket.socket) -> bytes:
    """What the server sends until it closes ("" for a reset: nothing came)."""
    reply = b""
    try:
        while chunk := sock.recv(65536):
            reply += chunk
    except ConnectionResetError:
        pass
    return reply


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
