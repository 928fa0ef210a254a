"""What a trial of rollout servers found: a server listed twice, engines dropped without a word
or for good, a dLLM server of another prompt width, a LoRA server on another base model."""

from __future__ import annotations

import json

import pytest
import torch
import toy
from test_pipeline import FakeEngine, SeededToy, config, round_over, scheduler

from mmrl.core.config import ConfigError, TrainConfig, load_config
from mmrl.core.engine import EngineError
from mmrl.core.pipeline import check_config


def remote_config(tmp_path, servers: str):
    return load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[
        f"output_dir={tmp_path / 'run'}", "rollout.prompts_per_step=8", "rollout.num_generations=4",
        "rollout.scheduler.mode=pipelined", "train.mini_batches=4", "rollout.scheduler.placement=remote",
        f"rollout.scheduler.servers={servers}"])


def test_a_server_listed_twice_is_a_config_error_naming_it(tmp_path):
    # before: both engines published to it, and one of them was dropped with a 409 mid-round
    with pytest.raises(ConfigError, match=r"servers\[2\] is 'http://b:1/' again \(as servers\[1\]\)"):
        check_config(remote_config(tmp_path, "[http://a:1, http://b:1, http://b:1/]"), 1)
    with pytest.raises(ConfigError, match=r"servers\[1\]"):  # an mmrl and a vLLM engine on one server, too
        check_config(remote_config(tmp_path, "[http://a:1, vllm+http://a:1]"), 1)
    check_config(remote_config(tmp_path, "[http://a:1, http://a:2]"), 1)  # two servers on one host


def test_an_engine_dropped_mid_round_is_warned_of_once_naming_it_its_error_and_the_engines_left(tmp_path):
    # before: dropped without a word, counted only in rollout/redispatched
    cfg = config(tmp_path)
    bad = FakeEngine(SeededToy(), name="bad", fail_after=0)  # its running and its queued call both fail
    good = FakeEngine(SeededToy(), name="good")
    with pytest.warns(UserWarning) as caught:
        _, rnd, groups = round_over(cfg, [bad, good])
    assert len(groups) == 8 and rnd.metrics["rollout/redispatched"] >= 1
    dropped = [str(w.message) for w in caught if "dropped" in str(w.message)]
    assert dropped == [("rollout engine bad failed: engine bad crashed; dropped: the run goes on with the "
                        "other 1 of 2 engines")]


def test_a_dllm_server_of_another_prompt_width_is_an_engine_error_naming_it_and_both_widths(tmp_path):
    # before: the batch went on to training, which failed deep in the model with
    # "ValueError: valid has shape (4, 18), input_ids (4, 16)", naming neither the server nor the setting
    import copy
    import importlib

    from mmrl.core import serve
    from mmrl.core.engine import EngineError, Request
    from mmrl.core.pipeline import build_engines
    from mmrl.core.remote import RemoteEngine

    backend = importlib.import_module("dllm_rl.backend")
    cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG)
    tiny = cfg.rollout.model_copy(update={"gen_length": 4, "block_length": 4, "steps": 2})
    policy = serve.served_policy(backend, cfg)
    width = policy.prompt_length
    trainer = copy.copy(policy)  # a trainer whose task's longest prompt is 2 tokens shorter
    trainer.prompt_length = width - 2
    # the trainer's engines check each batch with its policy
    (engine,) = build_engines(remote_config(tmp_path, "[http://a:1]"), trainer)
    assert engine.check == trainer.check_rollout
    server = serve.serve_in_thread(serve.ServedPolicyEngine(policy), type(cfg.rollout))
    try:
        requests = [Request(0, "12+3=", 2)]
        assert len(RemoteEngine(server.url, timeout=30, check=policy.check_rollout)
                   .generate(requests, tiny, seed=0)) == 2  # the same width: fine
        with pytest.raises(EngineError) as caught:
            RemoteEngine(server.url, timeout=30, check=trainer.check_rollout).generate(requests, tiny, seed=0)
    finally:
        server.close()
    assert str(caught.value) == (f"engine {server.url[7:]}: the batch from {server.url} does not fit the trainer's "
                                 f"policy: its prompts are {width} tokens wide, this trainer's {width - 2} (the "
                                 "width is the task's longest prompt): serve with the trainer's task settings")


def lora_like(seed: int, dtype=torch.float32) -> toy.ToyPolicy:
    """A toy policy whose lm_head alone trains (as LoRA's adapters): the rest is its base model."""
    policy = toy.ToyPolicy(seed=seed)
    policy.model.to(dtype).requires_grad_(False).lm_head.requires_grad_(True)
    policy.model.name_or_path = f"/models/base-{seed}"
    return policy


def test_a_server_on_another_base_model_refuses_the_adapters_with_a_400_naming_both(tmp_path):
    # before: under LoRA only the adapters are published, and a server started from another base
    # checkpoint of the same architecture took them and sampled with the wrong base without a word
    from mmrl.core import serve
    from mmrl.core.config import RolloutConfig
    from mmrl.core.engine import EngineError, trainable_weights
    from mmrl.core.pipeline import build_engines
    from mmrl.core.remote import RemoteEngine

    trainer = lora_like(seed=1)
    (engine,) = build_engines(remote_config(tmp_path, "[http://a:1]"), trainer)  # the trainer's engines send it
    assert engine._base == {serve.BASE_HEADER: json.dumps(serve.base_fingerprint(trainer.model))}
    weights = trainable_weights(trainer.model)
    assert list(weights) == ["lm_head.weight"]
    other = serve.serve_in_thread(serve.ServedPolicyEngine(lora_like(seed=0)), RolloutConfig)
    same = serve.serve_in_thread(serve.ServedPolicyEngine(lora_like(seed=1, dtype=torch.bfloat16)), RolloutConfig)
    try:
        with pytest.raises(EngineError) as caught:
            RemoteEngine(other.url, timeout=30, base=serve.base_fingerprint(trainer.model)).publish(weights, 1)
        # the same base, held in bfloat16 by the server (a float32 trainer): compared at bfloat16
        RemoteEngine(same.url, timeout=30, base=serve.base_fingerprint(trainer.model)).publish(weights, 1)
        RemoteEngine(other.url, timeout=30).publish(weights, 1)  # a client that sends none is not checked
    finally:
        other.close()
        same.close()
    message = str(caught.value)
    assert "answered HTTP 400: bad request to /weights: the trainer's base model (the weights it does not " \
           "publish) is not this server's: other values in model.embed_tokens.weight (" in message
    assert "the trainer's is from /models/base-1, this server's from /models/base-0. This server serves " \
           "toy.ToyPolicy (LlamaForCausalLM from /models/base-0): start it from the trainer's model" in message


def test_a_base_fingerprint_tells_names_shapes_and_values_apart():
    from mmrl.core.serve import base_fingerprint, base_mismatch

    a = base_fingerprint(lora_like(seed=0).model)
    assert a["tensors"] == 11 and len(a["values"]) == 6 and base_mismatch(a, a) is None  # every 2nd of 11
    # all but lm_head published: the server's count, shapes and values are of what is left
    model = lora_like(seed=0).model
    assert base_mismatch(a, base_fingerprint(model, published=["lm_head.weight"])) is None
    fewer = base_fingerprint(model, published=["lm_head.weight", "model.norm.weight"])
    assert base_mismatch(a, fewer) == "11 tensors that are not published, of other names or shapes than this server's 10"
    half = base_fingerprint(lora_like(seed=0, dtype=torch.float16).model)
    assert base_mismatch(a, half) is None and base_mismatch(half, a) is None
    brain = base_fingerprint(lora_like(seed=0, dtype=torch.bfloat16).model)
    assert base_mismatch(half, brain) is None  # neither holds the other's values: not compared


def test_a_server_that_comes_back_is_taken_back_at_the_next_round(tmp_path):
    # before: an engine dropped once was never used again, even once its server was restarted
    from mmrl.core.remote import RemoteEngine, UnreachableError
    from mmrl.core.serve import ServedPolicyEngine, serve_in_thread

    cfg = config(tmp_path)
    servers = [serve_in_thread(ServedPolicyEngine(toy.ToyPolicy()), type(cfg.rollout)) for _ in range(2)]
    port = servers[0].server_address[1]
    engines = [RemoteEngine(s.url, timeout=30) for s in servers]
    sched, _ = scheduler(cfg, engines)
    try:
        servers[0].close()  # down when the round's weights are published: dropped
        with pytest.warns(UserWarning, match="cannot reach"):
            rnd, _ = sched.start_round(0, 4)
        assert len(list(rnd)) == 8 and not sched.workers[0].alive
        rnd, _ = sched.start_round(1, 4)  # still down: it stays out, at the cost of one refused /health
        assert len(list(rnd)) == 8 and not sched.workers[0].alive
        servers[0] = serve_in_thread(ServedPolicyEngine(toy.ToyPolicy()), type(cfg.rollout), port=port)
        with pytest.warns(UserWarning, match=r"rollout engine 127.0.0.1:\d+ answers again \(it was dropped: failed "
                                             r"to take new weights: .*cannot reach.*\): it has this round's weights "
                                             r"and rolls out again; 2 of 2 engines"):
            rnd, _ = sched.start_round(2, 4)
        assert len(list(rnd)) == 8 and sched.workers[0].alive
        assert servers[0].version == 2 and servers[0].engine.version == 2  # the restarted server has the weights
        assert sched.workers[0].busy_seconds > 0
    finally:
        sched.close()
        for s in servers:
            s.close()
    assert issubclass(UnreachableError, EngineError)


class Comeback(FakeEngine):
    """A thread engine with a server to ask: `busy` is what its /health says."""

    busy = False
    asked = 0
    weights = None  # the tag of the weights its server holds (None: those it started with)

    def health(self, timeout=None):
        self.asked += 1
        return {"busy": self.busy, "weights": self.weights}


def test_only_an_engine_dropped_for_a_fault_a_restart_cures_is_tried_again_and_not_while_busy(tmp_path):
    from mmrl.core.remote import HTTPStatusError

    cfg = config(tmp_path)
    refused = Comeback(SeededToy(), name="refused", fail_after=0, error=HTTPStatusError("HTTP 400: no", 400))
    down = Comeback(SeededToy(), name="down", fail_after=0, error=ConnectionRefusedError("refused"))
    taken = Comeback(SeededToy(), name="taken", fail_after=0, error=HTTPStatusError("HTTP 409: it holds ...", 409))
    taken.weights = "0123abcd/4"  # another trainer published to its server since
    good = FakeEngine(SeededToy(), name="good")
    sched, _ = scheduler(cfg, [refused, down, good, taken])
    try:
        with pytest.warns(UserWarning, match="dropped"):
            assert len(list(sched.start_round(0, 4)[0])) == 8
        assert sched.gone == {sched.workers[1], sched.workers[3]}  # a 400 would come again: not tried again
        refused_calls = len(refused.calls)
        down.fail_after, down.busy = None, True
        assert len(list(sched.start_round(1, 4)[0])) == 8  # busy: perhaps still in a call of ours
        assert not sched.workers[1].alive and down.asked == 1 and refused.asked == 0
        assert taken.asked == 1 and sched.gone == {sched.workers[1]}  # another trainer's now: for good
        down.busy, calls = False, len(down.calls)
        with pytest.warns(UserWarning, match="rollout engine down answers again"):
            assert len(list(sched.start_round(2, 4)[0])) == 8
        assert sched.workers[1].alive and len(down.calls) > calls and down.version == 2
        assert not sched.workers[0].alive and len(refused.calls) == refused_calls and not sched.workers[3].alive
    finally:
        sched.close()


def test_a_server_busy_past_the_clients_retries_is_one_a_restart_or_a_wait_cures():
    """A 503 (the server's cap of requests at once, reached by other clients too) that outlasts
    RemoteEngine's retries drops the engine for now, not for good: it is asked again later, as
    one down or restarted is; a 400 would come again."""
    from mmrl.core.pipeline import server_may_come_back
    from mmrl.core.remote import HTTPStatusError

    assert server_may_come_back(HTTPStatusError("HTTP 503: this server is busy", 503))
    assert server_may_come_back(HTTPStatusError("HTTP 409: it holds ...", 409))
    assert not server_may_come_back(HTTPStatusError("HTTP 400: no", 400))
