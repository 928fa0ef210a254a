"""What mmrl reads and serves, from the side of a user on a shared machine: the rollout server's
access, what a client's bytes can make it allocate, and model directories that ship code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mmrl.core import remote, serve


def test_a_spawned_server_gets_a_random_token_that_its_engine_sends(monkeypatch):
    # loopback is every local user's on a cluster node: a trainer's own server (placement=process)
    # took anyone's weights and generations without a token
    monkeypatch.delenv(serve.TOKEN_ENV, raising=False)
    seen = []
    real_popen = subprocess.Popen

    def popen(cmd, **kwargs):
        seen.append((cmd, kwargs["env"]))
        return real_popen([sys.executable, "-c", f"print({serve.READY + 'http://127.0.0.1:5'!r})"], **kwargs)

    monkeypatch.setattr(remote.subprocess, "Popen", popen)
    first, _ = remote.spawn_server("tests.toy", {}, timeout=30)
    second, _ = remote.spawn_server("tests.toy", {}, timeout=30)
    for proc in (first, second):
        proc.wait()
    tokens = [env.get(serve.TOKEN_ENV) for _, env in seen]
    assert all(t and len(t) >= 32 for t in tokens) and tokens[0] != tokens[1]  # random, one per server
    assert tokens == [first.mmrl_token, second.mmrl_token]
    assert not any(t in " ".join(cmd) for t, (cmd, _) in zip(tokens, seen))  # not on the command line (ps)
    engine = remote.RemoteEngine("http://127.0.0.1:5", timeout=1, process=first)
    assert engine._auth == {"Authorization": f"Bearer {tokens[0]}"}
    # a token given (or in the environment) is the one used, by the server and by its engine
    monkeypatch.setenv(serve.TOKEN_ENV, "from-env")
    third, _ = remote.spawn_server("tests.toy", {}, timeout=30)
    third.wait()
    assert seen[-1][1][serve.TOKEN_ENV] == "from-env" == third.mmrl_token
    engine = remote.RemoteEngine("http://127.0.0.1:5", timeout=1, process=first, token="mine")
    assert engine._auth == {"Authorization": "Bearer mine"}


ROOT = Path(__file__).resolve().parents[1]
