"""Security checks (docs/reliability.md, "Security"; the table is tests/reliability/SECURITY.md):

- no unsafe deserialisation in the code: a scan of the syntax tree of every module
  (comments and docstrings do not count) for pickle and friends, eval/exec, torch.load
  without weights_only=True, unsafe YAML, pickled NumPy, a literal trust_remote_code=True;
- weights are safetensors: bundled assets and the trainer's checkpoints, read back with
  pickle switched off;
- the rollout server binds 127.0.0.1 by default, refuses another address without a token,
  and with a token answers 401 to requests without it; the demo binds 127.0.0.1 by default;
- reward atom files (any user Python file) are imported only when a config names them.
"""

from __future__ import annotations

import ast
import hmac
import inspect
import json
import pickle
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import toy
import typer
import yaml
from typer.testing import CliRunner

from mmrl.core import remote, serve
from mmrl.core.cli import BackendSpec, make_app
from mmrl.core.config import RolloutConfig, TrainConfig, load_config
from mmrl.core.engine import EngineError, Request, trainable_weights
from mmrl.core.trainer import Trainer, combined_reward

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("mmrl", "diffusion_rl", "dllm_rl", "scripts", "benchmarks")
ROLLOUT = RolloutConfig(max_new_tokens=2)
REQUESTS = [Request(group=0, prompt=3, n=2)]

# --------------------------------------------------------------------------- source scan

UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib", "marshal", "shelve"}
UNSAFE_CALLS = {  # the last part of a called name -> why
    "read_pickle": "pandas.read_pickle unpickles",
    "unsafe_load": "yaml.unsafe_load runs arbitrary constructors",
    "full_load": "yaml.full_load is not the safe loader",
}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "_Loader"}  # _Loader: mmrl/core/config_loading.py, checked below
# Legitimate exceptions, each with its reason: (path relative to the root, line text) -> why.
# User files are imported with importlib (import_python_file), never exec'd as text.
ALLOWED: dict[tuple[str, str], str] = {
    ("mmrl/vlm/tool_process.py", "import pickle"):
        "rollout.tools.isolation: process: the trainer and the tool worker it spawned talk over a "
        "private pipe (multiprocessing Connections pickle); the worker unpickles a tool function the "
        "trainer sent, the trainer the value the user's own tool returned. No file or network data.",
    ("mmrl/vlm/tools.py", "import pickle"):
        "pickle.dumps only: whether a tool can be sent to its worker process (isolation process)",
}


def scan_source(source: str, filename: str = "<string>") -> list[tuple[int, str]]:
    """(line, problem) for every unsafe load in `source`, found in its syntax tree."""
    tree = ast.parse(source, filename)
    torch_names = {"torch"}  # names bound to the torch module (import torch as th)
    numpy_names = {"numpy", "np"}
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch":
                    torch_names.add(a.asname or "torch")
                if a.name == "numpy":
                    numpy_names.add(a.asname or "numpy")
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names]
            if isinstance(node, ast.ImportFrom):
                if node.module and node.module.split(".")[0] in UNSAFE_MODULES:
                    problems.append((node.lineno, f"imports from {node.module}"))
                if node.module == "torch" and "load" in names:
                    problems.append((node.lineno, "imports torch.load by name (call torch.load(..., weights_only=True))"))
                if node.module == "yaml" and {"unsafe_load", "full_load", "UnsafeLoader", "FullLoader"} & set(names):
                    problems.append((node.lineno, "imports an unsafe YAML loader"))
            else:
                for n in names:
                    if n.split(".")[0] in UNSAFE_MODULES:
                        problems.append((node.lineno, f"imports {n}"))
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        kw = {k.arg: k.value for k in node.keywords if k.arg is not None}
        if isinstance(func, ast.Name) and func.id in ("eval", "exec"):
            problems.append((node.lineno, f"calls {func.id}()"))
        if not isinstance(func, ast.Attribute):
            continue
        base = ast.unparse(func.value)
        if func.attr == "load" and base in torch_names:
            w = kw.get("weights_only")
            if not (isinstance(w, ast.Constant) and w.value is True):
                problems.append((node.lineno, "torch.load without weights_only=True"))
        if func.attr == "load" and base in numpy_names:
            a = kw.get("allow_pickle")
            if a is not None and not (isinstance(a, ast.Constant) and a.value is False):
                problems.append((node.lineno, "numpy.load with allow_pickle"))
        if func.attr == "load" and base == "yaml":
            loader = kw.get("Loader", node.args[1] if len(node.args) > 1 else None)
            name = ast.unparse(loader).split(".")[-1] if loader is not None else None
            if name not in SAFE_YAML_LOADERS:
                problems.append((node.lineno, f"yaml.load with Loader={name} (use yaml.safe_load)"))
        if func.attr in UNSAFE_CALLS:
            problems.append((node.lineno, UNSAFE_CALLS[func.attr]))
        t = kw.get("trust_remote_code")
        if isinstance(t, ast.Constant) and t.value is True:
            problems.append((node.lineno, "trust_remote_code=True hard-coded (it must come from the config)"))
        s = kw.get("shell")
        if isinstance(s, ast.Constant) and s.value is True:
            problems.append((node.lineno, "subprocess with shell=True"))
    return problems


def python_files() -> list[Path]:
    files = [f for d in SCANNED for f in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 50, files  # the scan really sees the code
    return files


def test_scanner_finds_unsafe_loads_and_ignores_comments_and_docstrings():
    bad = '''
import pickle, dill
import torch as th
from joblib import load
import numpy
import yaml
x = pickle.loads(b"")
th.load("w.pt")
torch.load("w.pt", weights_only=False)
numpy.load("a.npy", allow_pickle=True)
yaml.load(text, Loader=yaml.Loader)
yaml.unsafe_load(text)
eval("1 + 1")
exec(code)
AutoModel.from_pretrained(p, trust_remote_code=True)
subprocess.run(cmd, shell=True)
'''
    lines = sorted(line for line, _ in scan_source(bad))
    assert lines == [2, 2, 4, 8, 9, 10, 11, 12, 13, 14, 15, 16], scan_source(bad)
    good = '''
"""Docstring: pickle.load(f), torch.load(p), eval(x), exec(y) are only words here."""
import torch
import yaml
# torch.load("w.pt")  pickle.loads(b)  eval("x")
w = torch.load("w.pt", weights_only=True)
d = yaml.load(text, Loader=yaml.SafeLoader)
model.eval()  # a method named eval is not the builtin
s = "exec(code)"
AutoModel.from_pretrained(p, trust_remote_code=cfg.trust_remote_code)
'''
    assert scan_source(good) == []


def test_no_unsafe_load_anywhere_in_the_code():
    found = []
    for f in python_files():
        source = f.read_text(encoding="utf-8")
        lines = source.splitlines()
        rel = str(f.relative_to(ROOT))
        for lineno, problem in scan_source(source, rel):
            if (rel, lines[lineno - 1].strip()) not in ALLOWED:
                found.append(f"{rel}:{lineno}: {problem}: {lines[lineno - 1].strip()}")
    assert found == [], "unsafe loads (allow-list one in ALLOWED only with a reason):\n" + "\n".join(found)


def test_the_config_yaml_loader_is_the_safe_loader():
    from mmrl.core import config

    assert issubclass(config._Loader, yaml.SafeLoader)
    with pytest.raises(yaml.constructor.ConstructorError):  # a python object tag is refused
        config._yaml("!!python/object/apply:os.system ['echo pwned']")


def test_user_python_files_are_imported_only_at_known_call_sites():
    """Every place that imports a user's Python file (atom, tool, parser, preference factory, plugin)
    goes through import_python_file, called from a loader that is handed a config's spec."""
    sites = set()
    for f in python_files():
        tree = ast.parse(f.read_text(encoding="utf-8"))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call):
                    name = ast.unparse(node.func).split(".")[-1]
                    if name in ("import_python_file", "spec_from_file_location", "exec_module", "run_path"):
                        sites.add((str(f.relative_to(ROOT)), fn.name, name))
    assert sites == {
        ("mmrl/core/rewards.py", "_import_file", "import_python_file"),  # reward.atoms specs
        ("mmrl/core/rewards.py", "import_python_file", "spec_from_file_location"),
        ("mmrl/core/rewards.py", "import_python_file", "exec_module"),
        ("mmrl/vlm/tools.py", "build_registry", "import_python_file"),  # task tools: "file.py:fn"
        # the same "file.py:fn" tool, imported again in its worker process (isolation process)
        ("mmrl/vlm/tool_process.py", "_load", "spec_from_file_location"),
        ("mmrl/vlm/tool_process.py", "_load", "exec_module"),
        ("diffusion_rl/scene_graph.py", "load_parser", "import_python_file"),  # method.parser
        ("diffusion_rl/image_rewards/preference.py", "_load_factory", "import_python_file"),  # preference kind "custom"
        ("mmrl/core/plugins.py", "load", "import_python_file"),  # a config's plugins: [file.py]
    }, f"a new place imports user files: review it, then list it here: {sorted(sites)}"


# --------------------------------------------------------------------------- weights are safetensors

PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".joblib", ".npy", ".npz", ".h5"}


def test_bundled_assets_hold_safetensors_weights_only():
    files = [f for f in (ROOT / "assets").rglob("*") if f.is_file()]
    assert files
    assert [f for f in files if f.suffix in PICKLE_SUFFIXES] == []
    weights = [f for f in files if f.suffix == ".safetensors"]
    assert len(weights) >= 4  # one per bundled tiny model at least
    from safetensors import safe_open

    for f in weights:  # each really is a safetensors file (the header parses)
        with safe_open(str(f), framework="pt") as h:
            assert len(list(h.keys())) > 0, f


def test_trainer_checkpoints_are_safetensors_and_json_and_load_without_pickle(tmp_path, monkeypatch, one_thread):
    from mmrl.core.checkpoint import latest_checkpoint, load_checkpoint, load_module_weights

    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG,
                      overrides=[f"output_dir={tmp_path / 'run'}", "train.max_steps=1",
                                 "rollout.prompts_per_step=2", "rollout.num_generations=2"])
    Trainer(cfg, *toy.build(cfg)).train()
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert ckpt is not None
    files = [f for f in ckpt.rglob("*") if f.is_file()]
    assert {f.suffix for f in files} <= {".safetensors", ".json"}, files
    assert (ckpt / "model" / "model.safetensors").is_file()

    def refuse(*args, **kwargs):
        raise AssertionError("pickle was used to read a checkpoint")

    for attr in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, attr, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    tensors, meta = load_checkpoint(ckpt)
    assert tensors and meta["step"] == 1
    fresh = toy.ToyPolicy(seed=1)
    load_module_weights(fresh.model, ckpt / "model")
    trained = Trainer(cfg, *toy.build(cfg))  # the same run config, resumed: reads everything back
    trained.train(resume=True)  # nothing left to do, but the checkpoint is loaded with pickle off
    for k, v in fresh.model.state_dict().items():
        assert torch.equal(v, trained.policy.model.state_dict()[k]), k


# --------------------------------------------------------------------------- the rollout server


def engine():
    return serve.ServedPolicyEngine(toy.ToyPolicy(seed=0))


def test_every_server_entry_point_defaults_to_loopback():
    for fn in (serve.EngineServer.__init__, serve.serve, serve.serve_in_thread, remote.spawn_server):
        assert inspect.signature(fn).parameters["host"].default == "127.0.0.1", fn
    app = make_app(BackendSpec(modality="toy", title="toy", command="toy-rl", module="toy"))
    params = {p.name: p for p in typer.main.get_command(app).commands["serve"].params}
    assert params["host"].default == "127.0.0.1"
    assert params["token"].default is None


def test_server_binds_loopback_by_default_and_needs_no_token_there(monkeypatch):
    monkeypatch.delenv(serve.TOKEN_ENV, raising=False)
    server = serve.serve_in_thread(engine(), RolloutConfig)  # port 0: a free one
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1" and port > 0
        client = remote.RemoteEngine(server.url, timeout=10)
        assert client.health()["name"] == "served"
        assert len(client.generate(REQUESTS, ROLLOUT, seed=0)) == 2
    finally:
        server.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "", "example.org"])
def test_server_refuses_a_non_loopback_address_without_a_token(host, monkeypatch):
    monkeypatch.delenv(serve.TOKEN_ENV, raising=False)
    with pytest.raises(serve.InsecureServeError, match="without a token.*--token.*MMRL_SERVE_TOKEN"):
        serve.EngineServer(engine(), RolloutConfig, host=host, port=0)
    with pytest.raises(serve.InsecureServeError):
        serve.serve_in_thread(engine(), RolloutConfig, host=host, token="")  # empty = none
    assert serve.is_loopback("127.0.0.1") and serve.is_loopback("127.1.2.3") and serve.is_loopback("localhost")
    assert not serve.is_loopback(host)


def test_serve_module_and_cli_verb_refuse_a_public_address_without_a_token(monkeypatch, capsys):
    monkeypatch.delenv(serve.TOKEN_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_:
        serve.main(["--backend", "toy", "--host", "0.0.0.0", "--port", "0"])
    assert exit_.value.code == 2
    assert "refusing to serve on 0.0.0.0 without a token" in capsys.readouterr().err

    app = make_app(BackendSpec(modality="toy", title="toy", command="toy-rl", module="toy"))
    result = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0", "--port", "0"])
    assert result.exit_code == 2, result.output
    assert "without a token" in result.output and "Traceback" not in result.output


def raw(url: str, path: str, headers: dict[str, str] | None = None, body: bytes | None = None):
    """(status, parsed JSON) of one request, without the client."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url + path, data=body, headers=headers or {},
                                 method="GET" if body is None else "POST")
    try:
        with opener.open(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_token_is_required_and_checked_in_constant_time(monkeypatch):
    monkeypatch.delenv(serve.TOKEN_ENV, raising=False)
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(serve.hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    # Bound to every interface (allowed: there is a token), reached over loopback.
    server = serve.serve_in_thread(engine(), RolloutConfig, host="0.0.0.0", token="s3cret-token")
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert raw(url, "/health")[0] == 401
        assert raw(url, "/health", {"Authorization": "Bearer wrong"})[0] == 401
        assert raw(url, "/health", {"Authorization": "Basic s3cret-token"})[0] == 401
        status, reply = raw(url, "/health", {"Authorization": "Bearer s3cret-token"})
        assert status == 200 and reply["name"] == "served"
        assert compared  # hmac.compare_digest did the comparison

        # A POST without the token is refused before anything runs: the weights stay.
        from mmrl.core import wire

        other = trainable_weights(toy.ToyPolicy(seed=1).model)
        status, reply = raw(url, "/weights", {serve.VERSION_HEADER: "5"}, wire.encode_weights(other))
        assert status == 401 and "missing token" in reply["error"]
        assert server.version == 0

        without = remote.RemoteEngine(url, timeout=10)
        wrong = remote.RemoteEngine(url, timeout=10, token="nope")
        right = remote.RemoteEngine(url, timeout=10, token="s3cret-token")
        for client in (without, wrong):
            with pytest.raises(remote.HTTPStatusError, match="HTTP 401") as err:
                client.generate(REQUESTS, ROLLOUT, seed=0)
            assert err.value.code == 401 and isinstance(err.value, EngineError)
            with pytest.raises(remote.HTTPStatusError, match="HTTP 401"):
                client.publish(other, version=5)
        assert server.version == 0
        assert len(right.generate(REQUESTS, ROLLOUT, seed=0)) == 2
        right.publish(other, version=5)
        assert right.health()["version"] == 5

        monkeypatch.setenv(serve.TOKEN_ENV, "s3cret-token")  # the client's default comes from the env
        assert remote.RemoteEngine(url, timeout=10).health()["version"] == 5
    finally:
        server.close()


def test_loopback_addresses_and_empty_tokens(monkeypatch):
    for host in ("127.0.0.1", "127.255.0.9", "::1", "localhost"):
        assert serve.is_loopback(host), host
    for host in ("10.0.0.1", "192.168.1.2", "fd00::1", "0.0.0.0", "::", "", "localhost.example.org"):
        assert not serve.is_loopback(host), host
    monkeypatch.delenv(serve.TOKEN_ENV, raising=False)
    assert serve.resolve_token(None) is None and serve.resolve_token("") is None
    assert serve.resolve_token("t") == "t"
    monkeypatch.setenv(serve.TOKEN_ENV, "")
    assert serve.resolve_token(None) is None
    monkeypatch.setenv(serve.TOKEN_ENV, "env-token")
    assert serve.resolve_token(None) == "env-token" and serve.resolve_token("flag") == "flag"
    serve.check_bind("10.0.0.1", "t")  # a token: any address
    with pytest.raises(serve.InsecureServeError, match="refusing to serve on 10.0.0.1 without a token"):
        serve.check_bind("10.0.0.1", "")
    server = serve.EngineServer(engine(), RolloutConfig, token="")
    try:
        assert server.token is None
    finally:
        server.close()


def test_an_empty_token_given_does_not_fall_back_to_the_environment(monkeypatch):
    """resolve_token: a token given, even "", is the answer ("" meaning none); only None reads
    $MMRL_SERVE_TOKEN."""
    monkeypatch.setenv(serve.TOKEN_ENV, "env-token")
    assert serve.resolve_token("") is None and serve.resolve_token(None) == "env-token"


def test_a_refused_request_gets_its_401_with_the_bearer_challenge():
    server = serve.serve_in_thread(engine(), RolloutConfig, token="s3cret-token", read_timeout=5)
    url = server.url
    try:
        for headers, message in [({}, "missing token"), ({"Authorization": "Bearer wrong"}, "wrong token"),
                                 ({"Authorization": "Bearer s3cret"}, "wrong token"),
                                 ({"Authorization": "Bearer s3cret-token-and-more"}, "wrong token"),
                                 ({"Authorization": "s3cret-token"}, "wrong token")]:
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            with pytest.raises(urllib.error.HTTPError) as err:
                opener.open(urllib.request.Request(url + "/weights", data=b"x" * 1000, headers=headers), timeout=10)
            assert err.value.code == 401 and err.value.headers["WWW-Authenticate"] == "Bearer"
            assert json.loads(err.value.read())["error"] == (
                f"{message}: this server needs 'Authorization: Bearer <token>'")
        # The scheme is case-insensitive and the token's surrounding blanks do not count.
        for given in ("bearer s3cret-token", "BEARER s3cret-token", "Bearer  s3cret-token "):
            assert raw(url, "/health", {"Authorization": given})[0] == 200, given
        assert raw(url, "/nope", {"Authorization": "Bearer s3cret-token"})[0] == 404
        assert server.version == 0
        # A refused body past the drain limit is not waited for: the reply comes at once.
        t0 = time.monotonic()
        with socket.create_connection(server.server_address[:2], timeout=10) as sock:
            sock.sendall(b"POST /weights HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % (serve._DRAIN_LIMIT + 1))
            reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.0 401 ") and time.monotonic() - t0 < 2.0
    finally:
        server.close()


def test_cli_serve_verb_binds_loopback_and_passes_the_token(monkeypatch):
    """`<cli> serve` end to end, with serve() replaced by a background server we can stop."""
    started = []

    def fake_serve(engine, rollout_cls, host="127.0.0.1", port=8400, *, ready=None, **kw):
        server = serve.serve_in_thread(engine, rollout_cls, host, port, **kw)
        started.append(server)
        if ready is not None:
            ready(server.url)

    monkeypatch.setattr(serve, "serve", fake_serve)
    monkeypatch.delenv(serve.TOKEN_ENV, raising=False)
    app = make_app(BackendSpec(modality="toy", title="toy", command="toy-rl", module="toy"))
    runner = CliRunner()
    try:
        result = runner.invoke(app, ["serve", "--port", "0", "--set", "rollout.max_new_tokens=2"])
        assert result.exit_code == 0, result.output
        assert started[0].server_address[0] == "127.0.0.1" and started[0].token is None
        assert "serving the toy policy at http://127.0.0.1:" in result.output

        monkeypatch.setenv(serve.TOKEN_ENV, "from-env")
        result = runner.invoke(app, ["serve", "--port", "0", "--host", "0.0.0.0"])
        assert result.exit_code == 0, result.output
        assert started[1].token == "from-env"
        monkeypatch.delenv(serve.TOKEN_ENV)
        result = runner.invoke(app, ["serve", "--port", "0", "--token", "flag-token"])
        assert result.exit_code == 0, result.output
        url = started[2].url
        assert raw(url, "/health")[0] == 401
        assert remote.RemoteEngine(url, timeout=10, token="flag-token").health()["name"] == "served"
    finally:
        for s in started:
            s.close()


@pytest.mark.slow  # a child process: ~10 s to import torch and transformers
def test_spawned_server_gets_its_token_through_the_environment(monkeypatch):
    monkeypatch.delenv(serve.TOKEN_ENV, raising=False)
    proc, url = remote.spawn_server("tests.toy", {"rollout": {"max_new_tokens": 2}}, cwd=ROOT,
                                    timeout=60, host="0.0.0.0", token="child-token")
    try:
        assert "child-token" not in " ".join(proc.args)  # not on the command line (ps)
        port = url.rsplit(":", 1)[1]
        local = f"http://127.0.0.1:{port}"
        with pytest.raises(remote.HTTPStatusError, match="HTTP 401"):
            remote.RemoteEngine(local, timeout=30).health()
        assert remote.RemoteEngine(local, timeout=30, token="child-token").health()["name"] == "served"
    finally:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- the demo


def test_demo_binds_loopback_by_default():
    pytest.importorskip("gradio")
    import mmrl.cli
    from mmrl.demo import app as demo_app

    assert inspect.signature(demo_app.launch).parameters["host"].default == "127.0.0.1"
    params = {p.name: p for p in typer.main.get_command(mmrl.cli.app).commands["demo"].params}
    assert params["host"].default == "127.0.0.1"
    # launch() hands the host to Gradio and never opens a public share link.
    tree = ast.parse(inspect.getsource(demo_app.launch))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "launch"]
    assert calls
    for call in calls:
        kw = {k.arg: ast.unparse(k.value) for k in call.keywords}
        assert kw.get("server_name") == "host" and kw.get("share") == "False", kw


# --------------------------------------------------------------------------- atom files


MARKER_ATOM = """
from pathlib import Path
Path(__file__).with_suffix(".imported").write_text("imported")
from mmrl.core.rewards import reward_atom

@reward_atom("marker")
def marker(sample):
    return 1.0
"""


def user_modules() -> set[str]:
    return {k for k in sys.modules if k.startswith("mmrl_user_")}


def test_atom_file_is_imported_only_when_a_config_names_it(tmp_path, one_thread):
    (tmp_path / "atoms.py").write_text(MARKER_ATOM)
    marker = tmp_path / "atoms.imported"
    (tmp_path / "plain.yaml").write_text("seed: 0\n")
    (tmp_path / "named.yaml").write_text("reward:\n  atoms: [atoms.py:marker]\n")

    before = user_modules()
    cfg = load_config(TrainConfig, tmp_path / "plain.yaml", defaults=toy.DEFAULT_CONFIG,
                      overrides=[f"output_dir={tmp_path / 'out'}"])
    trainer = Trainer(cfg, *toy.build(cfg))
    trainer.reward.score(toy.ToyPolicy().generate([1], 2, cfg.rollout, torch.Generator().manual_seed(0)).samples)
    assert not marker.exists() and user_modules() == before
    assert trainer.reward.names == ["answer", "stop"]

    cfg = load_config(TrainConfig, tmp_path / "named.yaml", defaults=toy.DEFAULT_CONFIG)
    assert not marker.exists()  # loading the config alone imports nothing
    reward = combined_reward(toy.ToyTask().reward, cfg)
    assert marker.exists() and len(user_modules() - before) == 1
    assert reward.names == ["answer", "stop", "marker"]


@pytest.mark.slow
@pytest.mark.parametrize("module", ["mmrl.vlm.backend", "diffusion_rl.backend", "dllm_rl.backend"])
def test_backend_defaults_import_no_user_file(module, one_thread):
    import importlib

    backend = importlib.import_module(module)
    before = user_modules()
    cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG)
    _, task = backend.build(cfg)
    combined_reward(task.reward, cfg)
    assert user_modules() == before
