"""The rollout server under load or abuse: connections past its cap, bodies past what it holds at
once, a client that trickles its request or hangs up midway, and the warning of a server without
a token. Each on a toy server on a real local port (tests/toy.py)."""

from __future__ import annotations

from toy import ToyPolicy

from mmrl.core import serve
from mmrl.core.config import RolloutConfig


def test_a_server_without_a_token_warns_that_any_local_user_reaches_it(monkeypatch, capsys):
    monkeypatch.setattr(serve.EngineServer, "serve_forever", lambda self, *a: None)
    serve.serve(ToyPolicy, RolloutConfig, port=0)
    err = capsys.readouterr().err
    assert err.startswith("warning: the server at http://127.0.0.1:") and err.count("\n") == 1
    assert err.endswith(" has no token: any user of this machine can run its model and replace its weights; pass "
                        "--token (or set MMRL_SERVE_TOKEN) and give the same token to its clients\n")
    serve.serve(ToyPolicy, RolloutConfig, port=0, token="t")
    assert capsys.readouterr().err == ""
