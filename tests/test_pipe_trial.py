"""What a trial of rollout servers found: a server listed twice, engines dropped without a word
or for good, a dLLM server of another prompt width, a LoRA server on another base model."""

from __future__ import annotations

import pytest
import toy
from test_pipeline import FakeEngine, SeededToy, config, round_over

from mmrl.core.config import ConfigError, TrainConfig, load_config
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
