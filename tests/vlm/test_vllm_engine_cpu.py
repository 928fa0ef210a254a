"""The vLLM engines' parts that need neither CUDA nor vllm (mmrl/vlm/vllm_engine.py).

The samples the engines "return" here are real: VLMPolicy.generate draws them from the
bundled tiny Qwen2.5-VL, and a fake HTTP server (http.server in a thread) or a stand-in
`vllm` module replays their token ids with log-probs offset by +0.01 as vLLM would send
them. A batch an engine builds from them must then equal the policy's own batch of the
same samples, and its trainer-side old log-probs must equal the policy's generation
log-probs (and differ from the engine's by exactly 0.01). The real vLLM runs in tests/gpu/.
"""

from __future__ import annotations

import base64
import copy
import io
import json
import sys
import threading
import types
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from mmrl.core.config import ConfigError
from mmrl.core.engine import EngineError, Request, trainable_weights
from mmrl.vlm.config import LoRAConfig, VLMModelConfig, VLMTrainConfig
from mmrl.vlm.models import bundled_model_dir, load_vlm
from mmrl.vlm.policy import VLMPolicy
from mmrl.vlm.tasks.shapes_qa import QAItem, ShapesQA
from mmrl.vlm.tiny import FAMILIES, build_tiny_vlm
from mmrl.vlm.vllm_engine import (
    Completion,
    VLLMEngine,
    VLLMServerEngine,
    assemble_batch,
    build_engine,
    checkpoint_name,
    parse_chat_completion,
    vllm_weights,
)

ITEMS = ShapesQA(seed=0, num_train=8, num_eval=4).train_items()
TWO_IMAGES = QAItem(images=ITEMS[2].images + ITEMS[3].images, question="How many circles are there?",
                    answer="1", meta={"answer": "1"})
TEXT_ONLY = QAItem(images=[], question="What colour is the square?", answer="red", meta={"answer": "red"})
PROMPTS = [ITEMS[0], TEXT_ONLY, TWO_IMAGES]
COUNTS = [3, 1, 2]  # mixed group sizes: rows must follow the requests
OFFSET = 0.01  # engine log-prob = policy's generation log-prob + OFFSET


def make_policy(lora: LoRAConfig | None = None) -> VLMPolicy:
    """The bundled tiny Qwen2.5-VL as backend.build makes it."""
    mcfg = VLMModelConfig(lora=lora)
    model, processor = load_vlm(mcfg)
    return VLMPolicy(model, processor, min_pixels=mcfg.min_pixels, max_pixels=mcfg.max_pixels)


def rollout_cfg(**kw):
    return VLMTrainConfig().rollout.model_copy(update={"max_new_tokens": 8, **kw})


@pytest.fixture(scope="module")
def policy() -> VLMPolicy:
    return make_policy()


@pytest.fixture(scope="module")
def reference(policy):
    """The policy's own batch, one row per sample, and per prompt what vLLM would send
    for those samples: every sampled token (up to and including the first end-of-turn)
    with its log-prob + OFFSET."""
    rows = [p for p, n in zip(PROMPTS, COUNTS) for _ in range(n)]
    batch = policy.generate(rows, 1, rollout_cfg(), torch.Generator().manual_seed(0))
    replies, r = [], 0
    for n in COUNTS:
        group = []
        for _ in range(n):
            ids = batch.data["completion_ids"][r].tolist()
            if policy.eos_id in ids:
                ids = ids[: ids.index(policy.eos_id) + 1]
            logp = (batch.old_logp[r, : len(ids)] + OFFSET).tolist()
            group.append(Completion(ids, logp))
            r += 1
        replies.append(group)
    return batch, replies


def question_of(text: str) -> int:
    """Which of PROMPTS a prompt text or a request asks."""
    hits = [i for i, p in enumerate(PROMPTS) if p.question in text]
    assert len(hits) == 1, text
    return hits[0]


def assert_same_batch(batch, ref, policy):
    """An engine's batch equals the policy's batch of the same samples."""
    for key in ("prompt_ids", "prompt_mask", "pixel_values", "image_grid_thw", "completion_ids",
                "stat/length", "stat/truncated"):
        assert torch.equal(batch.data[key], ref.data[key]), key
    assert torch.equal(batch.mask, ref.mask)
    assert [s.completion for s in batch.samples] == [s.completion for s in ref.samples]
    assert [s.meta["answer"] for s in batch.samples] == [s.meta["answer"] for s in ref.samples]
    m = batch.mask
    # trainer-side recompute = the policy's generation log-probs (as test_vlm_policy checks)
    torch.testing.assert_close(batch.old_logp[m], ref.old_logp[m], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(batch.data["engine_logp"][m], ref.old_logp[m] + OFFSET, atol=1e-6, rtol=0)
    assert (batch.data["engine_logp"][~m] == 0).all() and (batch.old_logp[~m] == 0).all()
    # every token differs by OFFSET, so the per-sample mean |difference| is OFFSET
    torch.testing.assert_close(batch.data["stat/engine_logp_diff"], torch.full((len(batch),), OFFSET),
                               atol=3e-4, rtol=0)


REQUESTS = [Request(group=10 + i, prompt=p, n=n, tag=i % 2) for i, (p, n) in enumerate(zip(PROMPTS, COUNTS))]


# --------------------------------------------------------------------------- weights


def test_checkpoint_names_by_family():
    assert checkpoint_name("model.language_model.layers.0.mlp.up_proj.weight", "qwen2_5_vl") == \
        "model.layers.0.mlp.up_proj.weight"
    assert checkpoint_name("model.visual.blocks.1.attn.qkv.bias", "qwen2_vl") == "visual.blocks.1.attn.qkv.bias"
    assert checkpoint_name("lm_head.weight", "qwen2_5_vl") == "lm_head.weight"
    assert checkpoint_name("model.layers.0.mlp.up_proj.weight", "qwen2_5_vl") == "model.layers.0.mlp.up_proj.weight"
    assert checkpoint_name("model.language_model.norm.weight", "qwen3_vl") == "model.language_model.norm.weight"


@pytest.mark.parametrize("family", FAMILIES)
def test_published_names_are_the_checkpoint_files_names(family, tmp_path):
    """What vLLM reads from the model directory at start-up is what publish must send."""
    build_tiny_vlm(family, tmp_path, seed=0)
    model, _ = load_vlm(VLMModelConfig(path=str(tmp_path)))
    published = vllm_weights(model, trainable_weights(model))
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    assert set(published) == set(on_disk)
    for name, value in published.items():
        assert torch.equal(value, on_disk[name]), name


def test_lora_is_published_merged_like_peft():
    policy = make_policy(lora=LoRAConfig(r=4, alpha=8.0))
    model = policy.model
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: give the adapters an effect
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    merged = copy.deepcopy(model).merge_and_unload()
    want = {checkpoint_name(k, "qwen2_5_vl"): v for k, v in merged.named_parameters()}

    published = vllm_weights(model, trainable_weights(model))
    # 2 layers x q, k, v, o: only the adapted weights, merged W + B A * alpha / r
    assert sorted(published) == sorted(f"model.layers.{i}.self_attn.{m}_proj.weight"
                                       for i in range(2) for m in "qkvo")
    params = dict(model.named_parameters())
    for name, value in published.items():
        torch.testing.assert_close(value, want[name], atol=1e-6, rtol=1e-6)
        layer = name[len("model."): -len(".weight")]
        unmerged = f"base_model.model.model.language_model.{layer}.base_layer.weight"
        assert not torch.equal(value, params[unmerged]), name  # the adapters changed it

    full = vllm_weights(model, {**dict(model.named_parameters()), **trainable_weights(model)})
    assert set(full) == set(safe_open(str(bundled_model_dir() / "model.safetensors"), "pt").keys())
    for name, value in full.items():
        torch.testing.assert_close(value, want[name], atol=1e-6, rtol=1e-6)


def test_lora_half_pair_is_refused():
    policy = make_policy(lora=LoRAConfig(r=4))
    only_a = {k: v for k, v in trainable_weights(policy.model).items() if "lora_A" in k}
    with pytest.raises(EngineError, match="lora_B"):
        vllm_weights(policy.model, only_a)


# --------------------------------------------------------------------------- batch assembly


def test_assembled_batch_is_the_policy_batch(policy, reference):
    ref, replies = reference
    enc = policy.encode(PROMPTS)
    batch = assemble_batch(policy, enc, PROMPTS, replies)
    assert batch.group_ids.tolist() == [0, 0, 0, 1, 2, 2]
    for key in ("prompt_ids", "prompt_mask", "pixel_values", "image_grid_thw", "completion_ids"):
        assert torch.equal(batch.data[key], ref.data[key]), key
    assert torch.equal(batch.mask, ref.mask)
    # the engine's log-probs are the batch's old log-probs until the trainer recomputes them
    assert torch.equal(batch.old_logp, batch.data["engine_logp"])
    with pytest.raises(EngineError, match="2 tokens but 1 log-probs"):
        assemble_batch(policy, enc, PROMPTS[:1], [[Completion([5, 6], [-1.0])]])


def test_parse_chat_completion():
    content = [{"token": "token_id:7", "logprob": -0.5}, {"token": "token_id:569", "logprob": -1.25}]
    reply = {"choices": [{"index": 1, "logprobs": {"content": content[:1]}},
                         {"index": 0, "logprobs": {"content": content}}]}
    samples, prompt = parse_chat_completion(reply, 2)
    assert [s.token_ids for s in samples] == [[7, 569], [7]]  # ordered by index
    assert [s.logprobs for s in samples] == [[-0.5, -1.25], [-0.5]]
    assert prompt is None
    reply["choices"][0]["token_ids"], reply["prompt_token_ids"] = [8], [1, 2]
    samples, prompt = parse_chat_completion(reply, 2)
    assert samples[1].token_ids == [8] and prompt == [1, 2]  # token_ids win over the strings
    with pytest.raises(ValueError, match="2 choices for n=3"):
        parse_chat_completion(reply, 3)
    with pytest.raises(ValueError, match="not 'token_id:<id>'"):
        parse_chat_completion({"choices": [{"logprobs": {"content": [{"token": "a", "logprob": 0}]}}]}, 1)


# --------------------------------------------------------------------------- fake vLLM server


class FakeServer:
    """A vLLM server's HTTP surface with canned answers. `routes[path](body) -> (status, json)`."""

    def __init__(self):
        self.calls: list[tuple[str, object]] = []
        self.routes: dict = {"/v1/models": lambda _: (200, {"data": [{"id": "tiny"}]})}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, body):
                outer.calls.append((self.path, body))
                route = outer.routes.get(self.path)
                status, reply = (404, {"detail": "Not Found"}) if route is None else route(body)
                data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer(None)

            def do_POST(self):
                self._answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def bodies(self, path):
        return [b for p, b in self.calls if p == path]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


def chat_route(policy, replies, *, token_ids: bool, prompt_ids: bool = True, tamper: bool = False):
    """/v1/chat/completions answering each prompt with its canned samples."""
    enc = policy.encode(PROMPTS)

    def answer(body):
        text = next(p["text"] for p in body["messages"][0]["content"] if p["type"] == "text")
        i = question_of(text)
        choices = []
        for k, c in enumerate(replies[i]):
            ended = c.token_ids[-1] == policy.eos_id
            choice = {"index": k, "message": {"role": "assistant", "content": "..."},
                      "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp}
                                               for t, lp in zip(c.token_ids, c.logprobs)]},
                      "finish_reason": "stop" if ended else "length",
                      "stop_reason": policy.eos_id if ended else None}
            if token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        reply = {"id": "x", "object": "chat.completion", "model": body["model"], "choices": choices}
        if prompt_ids:
            ids = enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
            if tamper:
                ids[-3] += 1
            reply["prompt_token_ids"] = ids
        return 200, reply

    return answer


@pytest.mark.parametrize("token_ids", [True, False], ids=["token_ids", "token_id-strings"])
def test_server_engine_batch_equals_policy_batch(policy, reference, server, token_ids):
    ref, replies = reference
    server.routes["/v1/chat/completions"] = chat_route(policy, replies, token_ids=token_ids,
                                                       prompt_ids=token_ids)
    engine = VLLMServerEngine(server.url, policy, timeout=30)
    batch = engine.generate(REQUESTS, rollout_cfg(temperature=0.7, top_p=0.9), seed=5)
    assert batch.group_ids.tolist() == [10, 10, 10, 11, 12, 12]
    assert batch.data["request_tag"].tolist() == [0, 0, 0, 1, 0, 0]
    assert_same_batch(batch, ref, policy)
    assert torch.isfinite(batch.data["stat/entropy"]).all() and (batch.data["stat/entropy"] > 0).all()

    bodies = sorted(server.bodies("/v1/chat/completions"), key=lambda b: question_of(
        next(p["text"] for p in b["messages"][0]["content"] if p["type"] == "text")))
    assert [b["n"] for b in bodies] == COUNTS
    b = bodies[0]
    assert b["model"] == "tiny"  # from /v1/models
    assert (b["temperature"], b["top_p"], b["top_k"], b["max_tokens"]) == (0.7, 0.9, 0, 8)
    assert b["logprobs"] is True and b["top_logprobs"] == 0 and b["return_tokens_as_token_ids"] is True
    assert b["stop_token_ids"] == [policy.eos_id] and b["ignore_eos"] is True
    assert {int(k): v for k, v in b["logit_bias"].items()} == dict.fromkeys(policy.banned_ids, -100)
    assert len({x["seed"] for x in bodies}) == 3
    # images: one data URL per image, the pixels the trainer's processor saw (qwen-vl-utils' resize)
    urls = [p["image_url"]["url"] for p in bodies[2]["messages"][0]["content"] if p["type"] == "image_url"]
    assert len(urls) == 2 and not any(p["type"] == "image_url" for p in bodies[1]["messages"][0]["content"])
    from qwen_vl_utils import process_vision_info

    resized = process_vision_info(policy.messages(TWO_IMAGES))[0]
    for url, want in zip(urls, resized):
        got = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
        assert got.size == want.size and got.tobytes() == want.convert(got.mode).tobytes()

    # the same seed asks for the same per-request seeds
    engine.generate(REQUESTS, rollout_cfg(temperature=0.7, top_p=0.9), seed=5)
    again = server.bodies("/v1/chat/completions")[3:]
    assert sorted(x["seed"] for x in again) == sorted(x["seed"] for x in bodies)


def test_server_engine_old_logp_from_engine(policy, reference, server):
    ref, replies = reference
    server.routes["/v1/chat/completions"] = chat_route(policy, replies, token_ids=True)
    engine = VLLMServerEngine(server.url, policy, timeout=30, old_logp="engine")
    assert engine.scorer is None  # no copy of the model is kept
    batch = engine.generate(REQUESTS, rollout_cfg(), seed=0)
    assert torch.equal(batch.old_logp, batch.data["engine_logp"])
    assert "stat/engine_logp_diff" not in batch.data
    torch.testing.assert_close(batch.old_logp[batch.mask], ref.old_logp[batch.mask] + OFFSET, atol=1e-6, rtol=0)


def test_server_engine_refuses_a_differently_tokenised_prompt(policy, reference, server):
    server.routes["/v1/chat/completions"] = chat_route(policy, reference[1], token_ids=True, tamper=True)
    engine = VLLMServerEngine(server.url, policy, timeout=30, model="tiny", own_weights=False)
    with pytest.raises(EngineError, match="tokenised prompt . differently from the trainer"):
        engine.generate(REQUESTS, rollout_cfg(), seed=0)


def test_prompt_check_accepts_unexpanded_image_slots_only(policy):
    engine = VLLMServerEngine("http://127.0.0.1:9", policy, old_logp="engine")
    enc = policy.encode(PROMPTS)
    ids = enc["input_ids"][0][enc["attention_mask"][0].bool()].tolist()
    pad = policy.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert ids.count(pad) == 16  # a 112x112 image: 16 visual tokens
    engine._check_prompt(0, ids, enc)
    unexpanded = [t for k, t in enumerate(ids) if not (t == pad and ids[k - 1] == pad)]
    engine._check_prompt(0, unexpanded, enc)  # one placeholder per image: vLLM may report that
    fewer = list(ids)
    fewer.remove(pad)
    with pytest.raises(EngineError, match="resized differently"):
        engine._check_prompt(0, fewer, enc)


def test_server_engine_errors_name_the_url(policy, reference, server):
    engine = VLLMServerEngine(server.url, policy, timeout=30, model="tiny", own_weights=False)
    where = f"{server.url}/v1/chat/completions"
    server.routes["/v1/chat/completions"] = lambda _: (400, {"error": {"message": "n too large", "code": 400}})
    with pytest.raises(EngineError, match=f"{where} answered HTTP 400: n too large"):
        engine.generate(REQUESTS, rollout_cfg(), seed=0)
    server.routes["/v1/chat/completions"] = lambda _: (200, b"<html>proxy</html>")
    with pytest.raises(EngineError, match=f"{where} sent a reply that is not JSON"):
        engine.generate(REQUESTS, rollout_cfg(), seed=0)
    server.routes["/v1/chat/completions"] = lambda _: (200, {"choices": []})
    with pytest.raises(EngineError, match=f"bad reply from {where} for prompt 0: 0 choices for n=3"):
        engine.generate(REQUESTS, rollout_cfg(), seed=0)
    with pytest.raises(EngineError, match="cannot continue from a prefix"):
        engine.generate([Request(0, ITEMS[0], 2, prefix="a")], rollout_cfg(), seed=0)
    server.close()
    with pytest.raises(EngineError, match=f"cannot reach {where}"):
        engine.generate(REQUESTS, rollout_cfg(), seed=0)


def test_server_publish_reloads_full_weights(server, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    policy = make_policy()
    policy.max_pixels = 6272  # the run's, below the bundled processor's 12544
    server.routes["/collective_rpc"] = lambda body: (200, {"results": [None]})
    server.routes["/reset_prefix_cache"] = lambda _: (200, b"")
    engine = VLLMServerEngine(server.url, policy, timeout=30, model="tiny", weights_dir=tmp_path)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.5)
    weights = trainable_weights(policy.model)
    engine.publish(weights, 1)
    path = tmp_path / "mmrl-v1"
    assert server.bodies("/collective_rpc")[0]["method"] == "reload_weights"
    assert server.bodies("/collective_rpc")[0]["kwargs"] == {"weights_path": str(path)}
    assert len(server.bodies("/reset_prefix_cache")) == 1
    assert len(server.bodies("/reset_encoder_cache")) == 1  # tried; 404 on this server is fine
    # the directory is a checkpoint transformers (and so vLLM) reads: the published weights
    loaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(path)
    got = dict(loaded.named_parameters())
    assert set(got) == set(weights)
    for name, value in weights.items():
        assert torch.equal(got[name], value), name
    # and the processor beside them holds the run's image bounds, as a checkpoint's does
    from transformers import AutoProcessor

    assert AutoProcessor.from_pretrained(path).image_processor.size["longest_edge"] == 6272
    # the copy for old log-probs took the weights too; the engine's version moved
    assert engine.version == 1
    assert all(torch.equal(p, weights[k]) for k, p in engine.scorer.model.named_parameters())

    # an older vLLM (reload_weights without weights_path) -> update_config + reload_weights
    def older(body):
        if body["kwargs"]:
            return 500, {"object": "error", "message": "unexpected keyword argument 'weights_path'"}
        return 200, {"results": [None]}

    server.routes["/collective_rpc"] = older
    engine.publish(weights, 2)
    calls = [(b["method"], b["args"], b["kwargs"]) for b in server.bodies("/collective_rpc")[1:]]
    assert calls == [("reload_weights", [], {"weights_path": str(tmp_path / "mmrl-v2")}),
                     ("update_config", [{"model_config": {"model": str(tmp_path / "mmrl-v2")}}], {}),
                     ("reload_weights", [], {})]
    assert not path.exists() and (tmp_path / "mmrl-v2" / "model.safetensors").is_file()  # old one removed

    del server.routes["/collective_rpc"]
    with pytest.raises(EngineError, match="VLLM_SERVER_DEV_MODE=1"):
        engine.publish(weights, 3)
    with pytest.raises(EngineError, match="needs weights_dir"):
        VLLMServerEngine(server.url, policy, model="tiny").publish(weights, 1)


def test_server_publish_loads_lora_adapters(reference, server, tmp_path):
    policy = make_policy(lora=LoRAConfig(r=4))
    _, replies = reference
    server.routes["/v1/load_lora_adapter"] = lambda _: (200, b"Success")
    server.routes["/v1/unload_lora_adapter"] = lambda _: (200, b"Success")
    server.routes["/v1/chat/completions"] = chat_route(policy, replies, token_ids=True, prompt_ids=False)
    engine = VLLMServerEngine(server.url, policy, timeout=30, weights_dir=tmp_path)
    assert engine.weight_sync == "lora"
    weights = trainable_weights(policy.model)
    engine.publish(weights, 1)
    assert server.bodies("/v1/load_lora_adapter") == [{"lora_name": "mmrl-v1", "lora_path": str(tmp_path / "mmrl-v1")}]
    saved = load_file(str(tmp_path / "mmrl-v1" / "adapter_model.safetensors"))
    assert {k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.") for k in saved} \
        == set(weights)
    engine.generate(REQUESTS[:1], rollout_cfg(), seed=0)
    assert server.bodies("/v1/chat/completions")[-1]["model"] == "mmrl-v1"
    engine.publish(weights, 2)
    assert server.bodies("/v1/unload_lora_adapter") == [{"lora_name": "mmrl-v1"}]
    del server.routes["/v1/load_lora_adapter"]
    with pytest.raises(EngineError, match="--enable-lora"):
        engine.publish(weights, 3)


# --------------------------------------------------------------------------- in-process engine, stand-in vllm


@dataclass
class _Logprob:
    logprob: float


@dataclass
class _Out:
    index: int
    token_ids: list
    logprobs: list


@dataclass
class _RequestOutput:
    prompt_token_ids: list
    outputs: list


def fake_vllm(policy, replies, events: list):
    """A `vllm` module with the surface VLLMEngine uses, replaying `replies`."""
    mod = types.ModuleType("vllm")
    enc = policy.encode(PROMPTS)
    banned = policy.banned_ids[0]  # never sampled: a stand-in for a top-1 entry

    @dataclass
    class EngineArgs:  # the fields this engine looks for
        model: str = ""
        enable_sleep_mode: bool = False
        logprobs_mode: str = "raw_logprobs"

    class SamplingParams:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class Model:
        def load_weights(self, weights):
            events.append(("load_weights", list(weights)))
            return {n for n, _ in weights}

    class LLM:
        def __init__(self, **kw):
            self.kwargs = kw
            self.model = Model()
            self.llm_engine = types.SimpleNamespace(reset_encoder_cache=lambda: events.append("reset_encoder"))
            events.append("init")

        def generate(self, inputs, sampling_params, use_tqdm):
            events.append(("generate", inputs, sampling_params))
            outs = []
            for x in inputs:
                i = question_of(x["prompt"])
                outs.append(_RequestOutput(
                    enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist(),
                    [_Out(k, c.token_ids, [{banned: _Logprob(-9.0), t: _Logprob(lp)}  # + a top-1 entry
                                           for t, lp in zip(c.token_ids, c.logprobs)])
                     for k, c in reversed(list(enumerate(replies[i])))],  # any order: sorted by index
                ))
            return outs

        def apply_model(self, fn):
            return [fn(self.model)]

        def reset_prefix_cache(self):
            events.append("reset_prefix")

        def sleep(self, level):
            events.append(f"sleep{level}")

        def wake_up(self):
            events.append("wake")

    mod.EngineArgs, mod.SamplingParams, mod.LLM = EngineArgs, SamplingParams, LLM
    return mod


def test_in_process_engine_against_a_stand_in_vllm(policy, reference, monkeypatch):
    ref, replies = reference
    events: list = []
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm(policy, replies, events))
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    engine = VLLMEngine(policy, "/models/tiny", gpu_memory_utilization=0.25, seed=3, enforce_eager=True)
    import os

    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the engine core in this process
    assert engine.llm.kwargs == {"model": "/models/tiny", "dtype": "bfloat16", "seed": 3,
                                 "gpu_memory_utilization": 0.25, "enable_sleep_mode": True,
                                 "logprobs_mode": "processed_logprobs", "enforce_eager": True}
    assert events == ["init", "sleep1"]  # asleep until the first rollout

    batch = engine.generate(REQUESTS, rollout_cfg(temperature=0.7, stop=["</answer>"]), seed=5)
    assert [e if isinstance(e, str) else e[0] for e in events[2:]] == ["wake", "generate", "sleep1"]
    _, inputs, params = events[3]
    assert batch.group_ids.tolist() == [10, 10, 10, 11, 12, 12]
    assert_same_batch(batch, ref, policy)
    # prompts: the policy's chat-template text, images resized as the trainer resizes them
    assert inputs[0]["prompt"] == policy.processor.apply_chat_template(
        policy.messages(ITEMS[0]), tokenize=False, add_generation_prompt=True)
    assert "multi_modal_data" not in inputs[1] and len(inputs[2]["multi_modal_data"]["image"]) == 2
    assert inputs[2]["mm_processor_kwargs"] == {"do_resize": False} and "mm_processor_kwargs" not in inputs[1]
    p = params[0]
    assert (p.n, p.temperature, p.top_p, p.max_tokens, p.stop, p.logprobs) == (3, 0.7, 1.0, 8, ["</answer>"], 0)
    assert p.stop_token_ids == [policy.eos_id] and p.ignore_eos is True
    assert p.logit_bias == dict.fromkeys(policy.banned_ids, float("-inf"))
    assert len({q.seed for q in params}) == 3

    # publish: checkpoint names into load_weights, caches reset, asleep again; the copy follows
    del events[:]
    perturbed = {k: v + 0.5 for k, v in trainable_weights(policy.model).items()}
    engine.publish(perturbed, 7)
    assert [e if isinstance(e, str) else e[0] for e in events] == [
        "wake", "load_weights", "reset_prefix", "reset_encoder", "sleep1"]
    loaded = dict(events[1][1])
    assert set(loaded) == set(safe_open(str(bundled_model_dir() / "model.safetensors"), "pt").keys())
    assert torch.equal(loaded["model.layers.0.self_attn.q_proj.weight"],
                       perturbed["model.language_model.layers.0.self_attn.q_proj.weight"])
    assert engine.version == 7
    assert all(torch.equal(p, perturbed[k]) for k, p in engine.scorer.model.named_parameters())
    assert not any(torch.equal(p, perturbed[k]) for k, p in policy.model.named_parameters())  # trainer's untouched
    engine.close()
    assert not hasattr(engine, "llm")


def test_in_process_engine_old_logp_from_engine_without_sleep(policy, reference, monkeypatch):
    ref, replies = reference
    events: list = []
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm(policy, replies, events))
    engine = VLLMEngine(policy, "/models/tiny", sleep=False, old_logp="engine")
    assert "enable_sleep_mode" not in engine.llm.kwargs
    batch = engine.generate(REQUESTS, rollout_cfg(), seed=0)
    assert [e if isinstance(e, str) else e[0] for e in events] == ["init", "generate"]
    torch.testing.assert_close(batch.old_logp[batch.mask], ref.old_logp[batch.mask] + OFFSET, atol=1e-6, rtol=0)
    entropy = -(batch.old_logp * batch.mask).sum(-1) / batch.mask.sum(-1)  # the sampled-token estimate
    torch.testing.assert_close(batch.data["stat/entropy"], entropy)


def test_missing_vllm_says_how_to_install(policy, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(EngineError, match=r"pip install 'mmrl\[vllm\]'"):
        VLLMEngine(policy, bundled_model_dir())


def test_backend_hook_builds_engines(policy):
    cfg = VLMTrainConfig()
    engine = build_engine("vllm-server", cfg, policy, url="http://127.0.0.1:9")
    assert isinstance(engine, VLLMServerEngine) and engine.scorer is policy  # sync: no copy needed
    cfg.rollout.scheduler.mode = "pipelined"
    assert build_engine("vllm-server", cfg, policy, url="http://127.0.0.1:9").scorer is not policy
    with pytest.raises(ConfigError, match="needs a URL"):
        build_engine("vllm-server", cfg, policy)
    with pytest.raises(ConfigError, match="'sglang'"):
        build_engine("sglang", cfg, policy)
