"""What a first user meets on a laptop, following the README: the demo on a port in use."""

from __future__ import annotations

import socket

import pytest

from mmrl.demo import app
from mmrl.demo.runs import RunError


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_the_demo_on_a_port_in_use_is_named_before_the_app_is_built(taken_port, monkeypatch):
    """Gradio's 'Cannot find empty port' OSError came out as a traceback, after the app was
    built (tens of seconds); now a RunError, which `mmrl demo` prints as its exit-2 error line,
    names the port first (Gradio's import is left out: a CLI test spent 12 s on it)."""
    monkeypatch.setattr(app, "build_app", lambda demo: pytest.fail("built the app before checking the port"))
    with pytest.raises(RunError, match=f"127.0.0.1:{taken_port}: .*choose another --port"):
        app.launch([], port=taken_port, train_missing=False)


def test_ctrl_c_on_the_demo_closes_it_and_exits_130(capsys):
    """Gradio's block_thread caught Ctrl-C, printed its own line and let `mmrl demo` exit 0, as
    if it had finished; every other verb (`serve` too) says "interrupted" and exits 130."""

    class Served:
        closed = False
        polls = 0

        @property
        def is_running(self):
            self.polls += 1
            if self.polls == 2:
                raise KeyboardInterrupt
            return True

        def close(self):
            self.closed = True

    served = Served()
    with pytest.raises(SystemExit) as stop:
        app.wait_until_interrupted(served)
    assert stop.value.code == 130 and served.closed
    assert capsys.readouterr().err == "interrupted\n"


def test_every_verbs_set_and_the_demos_run_show_what_they_take_in_help():
    # typer showed `<list[str]>` / `<list[Path]>` where eval's and calibrate-window's --set and the
    # demo's --run take KEY=VALUE and a run directory
    from typer.testing import CliRunner

    from diffusion_rl.cli import app as diffusion_app
    from mmrl.cli import app as mmrl_app

    for cli, verb in ((mmrl_app, "eval"), (diffusion_app, "calibrate-window"), (mmrl_app, "demo")):
        out = CliRunner().invoke(cli, [verb, "--help"], env={"COLUMNS": "200"}).output
        assert "<list[" not in out, (verb, out)
    assert "KEY=VALUE" in CliRunner().invoke(mmrl_app, ["eval", "--help"], env={"COLUMNS": "200"}).output
