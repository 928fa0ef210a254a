"""`serve` as a client author meets it: requests written by hand (a plain string as the prompt,
the wrong prompt form, no requests, a seed out of range) against the three backends' bundled
policies served on a real local port; a served run whose data files are gone."""

from __future__ import annotations

import importlib
import json
import urllib.error
import urllib.request

import pytest
from PIL import Image
from toy import ToyPolicy

from mmrl.core import serve, wire
from mmrl.core.config import RolloutConfig, load_config
from mmrl.core.engine import Request

BACKENDS = {"vlm": "mmrl.vlm.backend", "dllm": "dllm_rl.backend", "diffusion": "diffusion_rl.backend"}
TINY = {"vlm": {"max_new_tokens": 4}, "dllm": {"gen_length": 4, "steps": 2, "block_length": 4},
        "diffusion": {"num_steps": 2}}


def post(server, obj) -> tuple[int, dict]:
    """(status, JSON reply) of POST /generate with `obj` as its JSON body."""
    req = urllib.request.Request(server.url + "/generate", data=json.dumps(obj).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def by_hand(*prompts, seed: int = 0) -> dict:
    """A /generate body as a client writes it: each Request's fields, its prompt as given."""
    requests = [{"__t": "dataclass", "cls": "mmrl.core.engine:Request", "fields": {"group": k, "prompt": p, "n": 2}}
                for k, p in enumerate(prompts)]
    return {"requests": {"value": requests, "tensors": None}, "rollout": {}, "seed": seed}


@pytest.fixture(scope="module", params=list(BACKENDS))
def served(request):
    """(modality, server) of the backend's bundled policy, at tiny rollout settings."""
    backend = importlib.import_module(BACKENDS[request.param])
    cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG)
    server = serve.serve_in_thread(serve.ServedPolicyEngine(serve.served_policy(backend, cfg)),
                                   type(cfg.rollout))
    server.tiny = TINY[request.param]
    yield request.param, server
    server.close()


def test_a_plain_string_prompt_is_served_as_the_backends_text_prompt(served):
    # it used to be a 500 (AttributeError: 'str' object has no attribute 'images') for the VLM and dLLM
    modality, server = served
    first, second = ("12+3=", "7*4=") if modality == "dllm" else ("two red circles", "a blue square")  # arith's width: 6
    status, reply = post(server, {**by_hand(first, second), "rollout": server.tiny})
    assert status == 200, reply
    batch = wire.decode_batch(reply)
    assert [s.prompt for s in batch.samples] == [first] * 2 + [second] * 2
    assert batch.group_ids.tolist() == [0, 0, 1, 1]


def test_a_prompt_of_the_wrong_form_is_a_400_naming_the_request_and_the_form(served):
    modality, server = served
    status, reply = post(server, by_hand("fine", {"question": "a dict"}))
    form = {"vlm": "a string (a question without an image) or a mmrl.vlm.tasks.shapes_qa:QAItem",
            "dllm": "a string or a dllm_rl.tasks:Problem", "diffusion": "a diffusion prompt must be text"}[modality]
    assert status == 400 and reply["error"].startswith("bad request to /generate: requests[1].prompt: "), reply
    assert form in reply["error"] and ("got a dict" in reply["error"] or "got dict" in reply["error"]), reply


def test_weights_of_another_backend_are_a_400_naming_what_the_server_serves(served):
    # they were a 500 ("engine served failed"), with a traceback in the server's log, that named
    # neither side: a toy trainer's weights against each backend's server
    from mmrl.core.engine import EngineError, trainable_weights
    from mmrl.core.remote import RemoteEngine

    modality, server = served
    served_as = {"vlm": "mmrl.vlm.policy.VLMPolicy (Qwen2_5_VLForConditionalGeneration from ",
                 "dllm": "dllm_rl.policy.DLLMPolicy (LlamaForCausalLM from ",
                 "diffusion": "diffusion_rl.policy.DiffusionPolicy (FluxTransformer2DModel from "}[modality]
    with pytest.raises(EngineError) as caught:
        RemoteEngine(server.url, timeout=30).publish(trainable_weights(ToyPolicy(seed=0).model), version=1)
    message = str(caught.value)
    assert "answered HTTP 400: bad request to /weights: published weights do not fit the engine's model" in message
    assert f"This server serves {served_as}" in message and "serve the trainer's backend and model" in message
    assert "model.layers.0." in message  # the trainer's weights, by name (and shape where the names fit)


def qa_item(images) -> dict:
    return {"__t": "dataclass", "cls": "mmrl.vlm.tasks.shapes_qa:QAItem",
            "fields": {"images": images, "question": "What colour is the circle?", "answer": ""}}


def test_a_vlm_prompt_the_model_cannot_take_is_a_400_before_the_engine_runs():
    backend = importlib.import_module(BACKENDS["vlm"])
    cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG)
    server = serve.serve_in_thread(serve.ServedPolicyEngine(backend.build_policy(cfg)), type(cfg.rollout))
    try:
        # an image by URL or path: the server opens neither (a wire image carries its pixels)
        for image in ("http://example.com/a.png", "/etc/passwd"):
            status, reply = post(server, by_hand(qa_item([image])))
            assert status == 400 and "requests[0].prompt: images[0] must be a wire image" in reply["error"], reply
            assert "opens no paths or URLs), got a string" in reply["error"]
        thin = wire.pack(Image.new("RGB", (4000, 10)))["value"]  # an aspect ratio Qwen's resizing refuses
        status, reply = post(server, by_hand(qa_item([thin])))
        assert status == 400 and "images[0]: a 4000 x 10 image the model's resizing cannot take" in reply["error"]
        status, reply = post(server, by_hand("why " * 3000))  # past the model's context of 2048
        assert status == 400 and "requests[0].prompt: prompt 0 of this batch ('why why" in reply["error"], reply
        assert "exceeds the model's context of 2048" in reply["error"]
        good = wire.pack(Image.new("RGB", (112, 112), "red"))["value"]
        status, reply = post(server, {**by_hand(qa_item([good])), "rollout": TINY["vlm"]})
        assert status == 200 and len(wire.decode_batch(reply)) == 2
    finally:
        server.close()


def test_a_dllm_prompt_wider_than_the_served_width_is_a_400():
    backend = importlib.import_module(BACKENDS["dllm"])
    cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG)
    policy = serve.served_policy(backend, cfg)
    server = serve.serve_in_thread(serve.ServedPolicyEngine(policy), type(cfg.rollout))
    try:
        status, reply = post(server, by_hand("1+" * 200 + "1"))
        assert status == 400 and reply["error"].startswith("bad request to /generate: requests[0].prompt: prompt "), reply
        assert f"this run's prompts may have at most {policy.prompt_length}" in reply["error"]
    finally:
        server.close()


def test_no_requests_and_a_seed_torch_cannot_take_are_400s():
    # both were 500s: an IndexError in the engine, and "Overflow when unpacking long long"
    server = serve.serve_in_thread(serve.ServedPolicyEngine(ToyPolicy(seed=0)), RolloutConfig)
    try:
        good = {"requests": wire.encode_requests([Request(group=0, prompt=1, n=2)]), "rollout": {}, "seed": 0}
        assert post(server, good)[0] == 200
        assert post(server, {**good, "requests": wire.encode_requests([])}) == (
            400, {"error": "requests is an empty list: send at least one Request"})
        for seed in (2**64, -(2**63) - 1):
            assert post(server, {**good, "seed": seed}) == (
                400, {"error": f"seed must be an integer from -2**63 to 2**64 - 1, got {seed}"})
        for seed in (2**64 - 1, -(2**63)):  # the ends of torch's range are served
            assert post(server, {**good, "seed": seed})[0] == 200
    finally:
        server.close()


@pytest.mark.parametrize("modality, task", [
    ("vlm", "task: {type: jsonl, train_path: gone/train.jsonl, eval_path: gone/eval.jsonl}\n"),
    ("diffusion", "task: {train_path: gone/train.txt, eval_path: gone/eval.txt}\n")])
def test_serve_needs_no_data_files(tmp_path, monkeypatch, modality, task):
    # serving needs the model only: a run copied to another machine without its data used to stop
    # with "task: .../gone/train.jsonl: cannot read the file"
    from typer.testing import CliRunner

    app = importlib.import_module({"vlm": "mmrl.cli", "diffusion": "diffusion_rl.cli"}[modality]).app
    served = []
    served, limits = [], []
    monkeypatch.setattr(serve, "serve", lambda engine, *a, **kw: (served.append(engine), limits.append(kw["max_samples"])))
    (tmp_path / "run.yaml").write_text(task)
    result = CliRunner().invoke(app, ["serve", "--config", str(tmp_path / "run.yaml"), "--port", "0",
                                      "--max-samples", "12"])
    assert result.exit_code == 0, result.output
    assert len(served) == 1 and served[0].policy.model is not None
    assert limits == [12]  # the verb's cap reaches the server


def test_ctrl_c_ends_serve_with_status_130(monkeypatch, capsys):
    # serve() swallowed it: `serve` exited 0 without a word (docs/errors.md: 130 on Ctrl-C), and with
    # a request in the engine the interpreter's exit under its thread aborted (SIGABRT)
    from typer.testing import CliRunner

    from dllm_rl.cli import app

    def interrupted(self, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr(serve.EngineServer, "serve_forever", interrupted)
    result = CliRunner().invoke(app, ["serve", "--port", "0"])
    assert result.exit_code == 130 and result.output.strip().endswith("interrupted"), result.output
    with pytest.raises(SystemExit) as stop:
        serve.main(["--backend", "toy", "--port", "0"])
    warned, said = capsys.readouterr().err.splitlines()  # no token: the warning at start, then the exit
    assert stop.value.code == 130 and said == "interrupted" and warned.startswith("warning: the server at ")

    def busy(self, *args):
        self.lock.acquire()  # as a request inside the engine holds it
        raise KeyboardInterrupt

    exits = []
    monkeypatch.setattr(serve.EngineServer, "serve_forever", busy)
    monkeypatch.setattr(serve.os, "_exit", exits.append)  # the real one would end pytest
    with pytest.raises(KeyboardInterrupt):  # only because the stand-in _exit returns
        serve.serve(serve.ServedPolicyEngine(ToyPolicy(seed=0)), RolloutConfig, port=0)
    assert exits == [130] and "the request in the engine was dropped" in capsys.readouterr().err


def test_a_port_in_use_is_named_before_the_model_is_built(monkeypatch, capsys):
    # it was named only once the model had loaded (minutes for a large one)
    from typer.testing import CliRunner

    from dllm_rl.cli import app

    def built(*args):
        raise AssertionError("the model was built")

    monkeypatch.setattr(serve, "served_policy", built)
    monkeypatch.setattr(serve, "build_policy", built)
    taken = serve.serve_in_thread(serve.ServedPolicyEngine(ToyPolicy(seed=0)), RolloutConfig)
    port = taken.server_address[1]
    try:
        result = CliRunner().invoke(app, ["serve", "--port", str(port)])
        assert result.exit_code == 2, result.output
        assert f"error: cannot serve on 127.0.0.1:{port}: Address already in use" in result.output
        with pytest.raises(SystemExit) as stop:
            serve.main(["--backend", "toy", "--port", str(port)])
        assert stop.value.code == 2
        assert capsys.readouterr().err == f"error: cannot serve on 127.0.0.1:{port}: Address already in use\n"
    finally:
        taken.close()


def test_a_port_out_of_range_or_an_address_not_ours_is_named_before_the_model_is_built(monkeypatch, capsys):
    # --port 99999 was an OverflowError traceback; --port 0 on another machine's address was
    # not probed, so it failed with a traceback once the model had loaded
    def built(*args):
        raise AssertionError("the model was built")

    monkeypatch.setattr(serve, "build_policy", built)
    for host, port, why in (("127.0.0.1", "99999", "a port is from 0 to 65535 (0 picks a free one)"),
                            ("192.0.2.1", "0", "Cannot assign requested address")):  # TEST-NET-1: no one's
        with pytest.raises(SystemExit) as stop:
            serve.main(["--backend", "toy", "--host", host, "--port", port, "--token", "t"])
        assert stop.value.code == 2
        assert capsys.readouterr().err == f"error: cannot serve on {host}:{port}: {why}\n"


def test_a_client_asking_for_more_samples_than_the_cap_is_a_400_before_the_engine_runs():
    # there was no cap: one call for a million samples held the engine (and its memory) for hours
    class Counting(ToyPolicy):
        calls = 0

        def generate(self, *args, **kwargs):
            Counting.calls += 1
            return super().generate(*args, **kwargs)

    ask = lambda *ns: {"requests": wire.encode_requests([Request(group=k, prompt=1, n=n) for k, n in enumerate(ns)]),
                       "rollout": {"max_new_tokens": 1}, "seed": 0}
    server = serve.serve_in_thread(serve.ServedPolicyEngine(Counting()), RolloutConfig)
    small = serve.serve_in_thread(serve.ServedPolicyEngine(Counting()), RolloutConfig, max_samples=5)
    try:
        status, reply = post(server, ask(1_000_000))
        assert status == 400 and reply["error"] == (
            "the requests ask for 1000000 samples in all (their n, summed), over this server's limit of 65536 per "
            "call (its --max-samples): split them into several calls (a trainer: lower "
            "rollout.scheduler.engine_batch)"), reply
        assert post(small, ask(3, 3))[0] == 400  # the requests' n together
        status, reply = post(small, ask(3, 2))
        assert status == 200 and len(wire.decode_batch(reply)) == 5
        assert Counting.calls == 1  # only the call within the cap reached the engine
    finally:
        server.close()
        small.close()
    with pytest.raises(ValueError, match="max_samples must be at least 1, got 0"):
        serve.EngineServer(serve.ServedPolicyEngine(ToyPolicy()), RolloutConfig, max_samples=0)


def test_rollout_keys_a_request_leaves_out_are_the_served_runs(monkeypatch):
    # they were the rollout class's defaults: a client asking only for a temperature got
    # max_new_tokens 32, not the served run's 3
    run = RolloutConfig(max_new_tokens=3, temperature=0.5)
    server = serve.serve_in_thread(serve.ServedPolicyEngine(ToyPolicy(seed=0)), RolloutConfig, rollout=run)
    try:
        requests = wire.encode_requests([Request(group=0, prompt=1, n=2)])
        for sent, tokens in (({}, 3), ({"temperature": 2.0}, 3), ({"max_new_tokens": 1}, 1)):
            status, reply = post(server, {"requests": requests, "rollout": sent, "seed": 0})
            assert status == 200 and wire.decode_batch(reply).old_logp.shape == (2, tokens), (sent, reply)
    finally:
        server.close()
    assert wire.decode_rollout({"top_p": 0.5}, RolloutConfig, run) == run.model_copy(update={"top_p": 0.5})
    assert wire.decode_rollout({}, RolloutConfig) == RolloutConfig()  # no run: the class defaults

    from typer.testing import CliRunner

    from dllm_rl.cli import app

    kwargs = []
    monkeypatch.setattr(serve, "serve", lambda *args, **kw: kwargs.append(kw))
    result = CliRunner().invoke(app, ["serve", "--port", "0", "--set", "rollout.temperature=0.25"])
    assert result.exit_code == 0 and kwargs[0]["rollout"].temperature == 0.25, result.output


def test_a_bad_rollout_value_is_named_by_its_key_without_pydantics_boilerplate():
    server = serve.serve_in_thread(serve.ServedPolicyEngine(ToyPolicy(seed=0)), RolloutConfig)
    try:
        requests = wire.encode_requests([Request(group=0, prompt=1, n=2)])
        for sent, why in (({"temperature": "hot"}, ("rollout.temperature: Input should be a valid number, unable to "
                                                   "parse string as a number (got 'hot')")),
                          ({"temperature": -1}, "rollout.temperature: Input should be greater than 0 (got -1)"),
                          ({"max_new_tokens": 0, "nope": 1}, ("rollout.max_new_tokens: Input should be greater than "
                                                             "or equal to 1 (got 0); rollout.nope: Extra inputs are "
                                                             "not permitted (got 1)"))):
            status, reply = post(server, {"requests": requests, "rollout": sent, "seed": 0})
            assert (status, reply) == (400, {"error": f"bad request to /generate: invalid rollout config: {why}"})
    finally:
        server.close()


def test_a_route_asked_with_the_wrong_method_is_a_405_saying_which():
    # both were 404 "no such endpoint", as if the route did not exist
    server = serve.serve_in_thread(serve.ServedPolicyEngine(ToyPolicy(seed=0)), RolloutConfig)
    try:
        for path, method, allow in (("/generate", "GET", "POST"), ("/weights", "GET", "POST"), ("/health", "POST", "GET")):
            req = urllib.request.Request(server.url + path, data=b"{}" if method == "POST" else None, method=method)
            with pytest.raises(urllib.error.HTTPError) as reply:
                urllib.request.urlopen(req, timeout=10)
            assert reply.value.code == 405 and reply.value.headers["Allow"] == allow
            assert json.loads(reply.value.read()) == {"error": f"{path} takes {allow}, not {method}"}
        with pytest.raises(urllib.error.HTTPError) as reply:
            urllib.request.urlopen(server.url + "/nope", timeout=10)
        assert reply.value.code == 404
    finally:
        server.close()
