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


def _classifier_dir(directory: Path, files: dict[str, dict]) -> Path:
    """A model directory of JSON files alone: what is checked before any weights are read."""
    import json

    directory.mkdir()
    config = {"architectures": ["LlamaForSequenceClassification"], "model_type": "llama", "num_labels": 1}
    for name, data in {"config.json": config, "tokenizer_config.json": {}, **files}.items():
        (directory / name).write_text(json.dumps({**(config if name == "config.json" else {}), **data}))
    return directory


def test_a_reward_model_that_ships_code_is_refused_before_transformers_reads_it(tmp_path):
    # no config key lets a reward (or consistency) model run its directory's code, but transformers
    # asked "Do you wish to run the custom code? [y/N]" on a terminal and ran it on a "y"; a
    # tokenizer's auto_map on a built-in architecture was not checked at all
    import pytest

    from mmrl.core.reward_models import RewardModel

    ran = tmp_path / "ran"
    for file, auto_map in (("config.json", {"AutoConfig": "evil.EvilConfig"}),
                           ("tokenizer_config.json", {"AutoTokenizer": ["evil.EvilTokenizer", None]})):
        rm = _classifier_dir(tmp_path / file, {file: {"auto_map": auto_map}})
        (rm / "evil.py").write_text(f"open({str(ran)!r}, 'w').write('ran')\n")
        with pytest.raises(ValueError, match=rf"reward model '.*{file}' ships its own Python code "
                                             rf"\(auto_map in {file}\); mmrl never runs a scorer's code"):
            RewardModel(rm)
    assert not ran.exists()


def test_a_raw_image_is_checked_against_its_bytes_before_it_is_allocated():
    # 2 bytes claiming a 16384 x 16384 RGBA image made the decoder allocate 1 GiB (1.8 s, 1.5 GB
    # resident) before Pillow said "not enough image data": a few such requests at once, from
    # any client, took the server's memory
    import base64

    import numpy as np
    import pytest
    from PIL import Image

    from mmrl.core import wire

    def message(mode: str, size: list[int], raw: bytes) -> dict:
        return {"value": {"__t": "image", "mode": mode, "size": size, "raw": base64.b64encode(raw).decode()},
                "tensors": None}

    with pytest.raises(wire.WireError, match="raw image data is 2 bytes, a 16384 x 16384 RGBA image is 1073741824"):
        wire.unpack(message("RGBA", [16384, 16384], b"xx"))
    with pytest.raises(wire.WireError, match="raw image data is 7 bytes, a 10 x 3 1 image is 6"):
        wire.unpack(message("1", [10, 3], bytes(7)))  # a bit a pixel, rows padded to a byte
    with pytest.raises(wire.WireError, match="malformed 'image' value: ValueError: unrecognized image mode"):
        wire.unpack(message("nope", [1, 1], b"x"))
    rng = np.random.default_rng(0)
    for im in (Image.fromarray(rng.random((3, 5), dtype=np.float32), mode="F"),
               Image.frombytes("1", (10, 3), bytes([0xA5, 0xC0] * 3)),
               Image.fromarray(rng.integers(0, 256, (2, 3, 3), dtype=np.uint8)).convert("YCbCr")):
        sent = {"__t": "image", "mode": im.mode, "size": list(im.size),
                "raw": base64.b64encode(im.tobytes()).decode()}  # each as raw bytes, as encode sends "F"
        back = wire.unpack({"value": sent, "tensors": None})
        assert (back.mode, back.size, back.tobytes()) == (im.mode, im.size, im.tobytes())


def test_the_pixel_bound_is_on_all_the_images_of_a_request_together(monkeypatch):
    # each image was bounded alone: a PNG of a few kilobytes may be 12000 x 12000 (576 MB of RGBA
    # decoded), so one request of many such images took tens of gigabytes
    import pytest
    from PIL import Image

    from mmrl.core import wire
    from mmrl.core.engine import Request

    monkeypatch.setattr(wire, "MAX_RAW_PIXELS", 250)
    request = [Request(group=0, prompt=[Image.new("RGB", (10, 10))] * 2, n=1)]
    assert len(wire.decode_requests(wire.encode_requests(request))[0].prompt) == 2  # 200 pixels
    request[0].prompt.append(Image.new("RGB", (10, 10)))
    with pytest.raises(wire.WireError, match=r"the images of this message have more than 250 pixels in all "
                                             r"\(the 10 x 10 image is past that\)"):
        wire.decode_requests(wire.encode_requests(request))
    # a trainer's own server's batch of images is not bounded in all (a diffusion batch is images)
    assert len(wire.unpack(wire.pack(request), max_pixels=float("inf"))[0].prompt) == 3


def test_a_demo_that_other_machines_reach_reads_only_its_own_runs_in_the_runs_tab(tmp_path):
    # the Runs tab reads any directory a client types (config.yaml, summary.json, metrics.jsonl,
    # and a YAML error quotes the file); with --host 0.0.0.0 that was anyone's, with no password
    import json

    import pytest

    from mmrl.demo.app import Demo
    from mmrl.demo.runs import RunError, RunInfo

    runs = []
    for name in ("mine", "elsewhere"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text("rollout: {gen_length: 8}\n")
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/total": 0.5}) + "\n")
        runs.append(tmp_path / name)
    served = Demo([RunInfo.load(runs[0])], train_missing=False, any_path=False)
    assert served.run_info(f"{runs[0]}/").modality == "dllm"  # a run it was started with, however spelled
    with pytest.raises(RunError, match=r"elsewhere: this demo serves other machines, so its Runs tab shows only "
                                       r"the runs it was started with \(mmrl demo --run DIR\)"):
        served.run_info(str(runs[1]))
    local = Demo([RunInfo.load(runs[0])], train_missing=False)  # on loopback (the default): any run, as documented
    assert local.run_info(str(runs[1])).path == runs[1]


def test_the_demo_on_another_address_says_it_has_no_password_and_limits_the_runs_tab(monkeypatch, capsys):
    from types import SimpleNamespace

    from mmrl.demo import app

    built = []

    class FakeApp:
        local_url = "http://0.0.0.0:7860/"

        def queue(self, **kwargs):
            return self

        def launch(self, **kwargs):
            built.append(kwargs["server_name"])

    monkeypatch.setitem(sys.modules, "gradio", SimpleNamespace(themes=SimpleNamespace(Default=lambda **kw: None)))
    monkeypatch.setattr(app, "build_app", lambda demo: built.append(demo.any_path) or FakeApp())
    monkeypatch.setattr("mmrl.core.serve.check_port", lambda host, port: None)
    app.launch([], host="0.0.0.0", block=False)
    assert built == [False, "0.0.0.0"]
    assert ("warning: the demo on 0.0.0.0:7860 has no password: anyone who can reach it can sample its models; "
            "its Runs tab shows only the runs it was started with") in capsys.readouterr().err
    app.launch([], block=False)  # loopback: the documented any-path Runs tab, no warning
    assert built[2:] == [True, "127.0.0.1"] and "warning" not in capsys.readouterr().err


def test_mmrl_demo_on_another_address_warns_once(monkeypatch):
    """The command line left the warning to launch: it printed one of its own too (two at start,
    where docs/errors.md says one)."""
    from types import SimpleNamespace

    from typer.testing import CliRunner

    from mmrl import cli
    from mmrl.demo import app

    class FakeApp:
        local_url = "http://0.0.0.0:7860/"

        def queue(self, **kwargs):
            return self

        def launch(self, **kwargs):
            pass

    monkeypatch.setitem(sys.modules, "gradio", SimpleNamespace(themes=SimpleNamespace(Default=lambda **kw: None)))
    monkeypatch.setattr(app, "build_app", lambda demo: FakeApp())
    monkeypatch.setattr("mmrl.core.serve.check_port", lambda host, port: None)
    monkeypatch.setattr(app, "wait_until_interrupted", lambda demo_app: None)
    result = CliRunner().invoke(cli.app, ["demo", "--host", "0.0.0.0", "--no-train"])
    assert result.exit_code == 0, result.output
    assert result.output.count("warning") == 1, result.output
    assert "warning: the demo on 0.0.0.0:7860 has no password" in result.output
