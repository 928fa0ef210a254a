"""model.gradient_checkpointing (mmrl/core/memory.py): the same update as without it, with the
layers' activations recomputed in the backward pass, for each backend's bundled model."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.utils.checkpoint

from mmrl.core.config import ConfigError, load_config
from mmrl.core.trainer import Trainer

SMALL = {
    "vlm": ["rollout.prompts_per_step=2", "rollout.num_generations=4", "rollout.max_new_tokens=16",
            "task.num_train=8", "task.num_eval=2", "rollout.eval_samples=0"],
    "dllm": ["rollout.prompts_per_step=2", "rollout.num_generations=4", "task.num_train=16", "task.num_eval=2"],
    "diffusion": ["rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.num_steps=4",
                  "rollout.window_start=[0,1]", "task.num_train=8", "task.num_eval=2", "task.eval_seeds=1",
                  "task.grid_prompts=2"],
}
BACKENDS = {"vlm": "mmrl.vlm.backend", "dllm": "dllm_rl.backend", "diffusion": "diffusion_rl.backend"}


def _trained(modality, tmp_path, *more):
    b = importlib.import_module(BACKENDS[modality])
    cfg = load_config(b.CONFIG_CLASS, None, [f"output_dir={tmp_path}", "train.max_steps=1", "optim.lr=1e-3",
                                             "logging.tensorboard=false", "logging.progress=false",
                                             *SMALL[modality], *more], defaults=b.DEFAULT_CONFIG)
    policy, task = b.build(cfg)
    trainer = Trainer(cfg, policy, task)
    trainer.train_step()
    assert not policy.model.training  # back in eval mode after the update
    return {k: v.detach().clone() for k, v in policy.model.named_parameters()}


@pytest.mark.parametrize("modality", list(BACKENDS))
def test_checkpointing_recomputes_and_makes_the_same_update(modality, tmp_path, reward_spread, monkeypatch):
    import transformers.modeling_utils

    calls = []
    original = torch.utils.checkpoint.checkpoint

    def counted(*a, **kw):
        calls.append(1)
        return original(*a, **kw)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counted)
    monkeypatch.setattr(transformers.modeling_utils, "checkpoint", counted, raising=False)
    plain = _trained(modality, tmp_path / "plain")
    assert not calls
    checkpointed = _trained(modality, tmp_path / "ckpt", "model.gradient_checkpointing=true")
    assert calls  # layers ran under torch.utils.checkpoint
    changed = [k for k in plain if not torch.equal(plain[k], _start(modality)[k])]
    assert changed  # the update moved weights
    for k, v in plain.items():
        torch.testing.assert_close(checkpointed[k], v, rtol=1e-5, atol=1e-6, msg=k)


def _start(modality, cache={}):  # noqa: B006 -- the bundled model's weights, loaded once
    if modality not in cache:
        b = importlib.import_module(BACKENDS[modality])
        policy, _ = b.build(load_config(b.CONFIG_CLASS, None, SMALL[modality], defaults=b.DEFAULT_CONFIG))
        cache[modality] = {k: v.detach().clone() for k, v in policy.model.named_parameters()}
    return cache[modality]


def test_a_model_with_dropout_is_refused():
    from mmrl.core.memory import enable_gradient_checkpointing

    class WithDropout(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = {"attention_dropout": 0.1, "hidden_size": 8}

        def activation_checkpointing_enable(self, **kw):
            raise AssertionError("not reached")

    with pytest.raises(ConfigError, match=r"sets dropout \(\{'attention_dropout': 0.1\}\)"):
        enable_gradient_checkpointing(WithDropout())

    class GPTStyle(WithDropout):  # GPT-2's config names its dropouts *_pdrop
        def __init__(self):
            super().__init__()
            self.config = {"attn_pdrop": 0.1, "resid_pdrop": 0.0, "hidden_size": 8}

    with pytest.raises(ConfigError, match=r"sets dropout \(\{'attn_pdrop': 0.1\}\)"):
        enable_gradient_checkpointing(GPTStyle())
    with pytest.raises(ConfigError, match="supports no gradient checkpointing"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2))


def test_update_mode_trains_with_every_dropout_module_in_eval_mode():
    """Under checkpointing the update runs in training mode, but a dropout module stays in eval
    mode (a model may hold nn.Dropout whatever its config says); eval mode again after."""
    from mmrl.core.memory import update_mode

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 2)).eval()
    model._mmrl_checkpointing = True
    x = torch.ones(8, 4)
    expected = model(x)
    with update_mode(model):
        assert model.training and model[0].training and not model[1].training
        torch.testing.assert_close(model(x), expected)  # no unit dropped
    assert not any(m.training for m in model.modules())
    plain = torch.nn.Sequential(torch.nn.Dropout(0.5)).eval()
    with update_mode(plain):  # without checkpointing: left as it is
        assert not plain.training


def test_a_dropout_in_a_nested_config_is_refused():
    """VLM configs nest their text model's settings (text_config.attention_dropout)."""
    from mmrl.core.memory import enable_gradient_checkpointing

    class Nested(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = {"text_config": {"attention_dropout": 0.1, "hidden_size": 8}, "vision_config": {"dropout": 0.0}}

        def activation_checkpointing_enable(self, **kw):
            raise AssertionError("not reached")

    with pytest.raises(ConfigError, match=r"sets dropout \(\{'text_config.attention_dropout': 0.1\}\)"):
        enable_gradient_checkpointing(Nested())


def test_a_dropout_named_anywhere_in_a_key_is_refused():
    """BERT-style names put "dropout" inside the key (hidden_dropout_prob), not at its end."""
    from mmrl.core.memory import enable_gradient_checkpointing

    class BertStyle(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.0}

    with pytest.raises(ConfigError, match=r"sets dropout \(\{'hidden_dropout_prob': 0.1\}\)"):
        enable_gradient_checkpointing(BertStyle())


def test_a_transformers_or_diffusers_class_without_checkpointing_is_a_config_error():
    """Both libraries give every model the method and raise ValueError where the class does not
    support it (remote code often does not): a ConfigError naming the key, not a traceback."""
    from diffusers import ConfigMixin, ModelMixin
    from transformers import PretrainedConfig, PreTrainedModel

    from mmrl.core.memory import enable_gradient_checkpointing

    class NoCheckpointing(PreTrainedModel):
        config_class = PretrainedConfig
        supports_gradient_checkpointing = False

        def __init__(self, config):
            super().__init__(config)
            self.proj = torch.nn.Linear(2, 2)

    class NoCheckpointingFlow(ModelMixin, ConfigMixin):
        _supports_gradient_checkpointing = False

        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(2, 2)

    for model in (NoCheckpointing(PretrainedConfig()), NoCheckpointingFlow()):
        name = type(model).__name__
        with pytest.raises(ConfigError, match=rf"^model.gradient_checkpointing: {name} supports no gradient "
                                              rf"checkpointing \({name} does not support .*\); set "
                                              "model.gradient_checkpointing: false$"):
            enable_gradient_checkpointing(model)
        assert not getattr(model, "_mmrl_checkpointing", False)  # update_mode leaves it as it is


def test_stochastic_depth_in_the_config_is_refused_as_dropout_is():
    """Drop path and LayerDrop skip layers at random in training mode, by code or modules that
    are no nn.Dropout (update_mode cannot turn them off): checkpointing would change the update."""
    from mmrl.core.memory import enable_gradient_checkpointing

    class StochasticDepth(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config

        def activation_checkpointing_enable(self, **kw):
            raise AssertionError("not reached")

    for config, named in [({"vision_config": {"drop_path_rate": 0.1}}, "'vision_config.drop_path_rate': 0.1"),
                          ({"encoder_layerdrop": 0.05, "decoder_layerdrop": 0.0}, "'encoder_layerdrop': 0.05"),
                          ({"drop_connect_rate": 0.2}, "'drop_connect_rate': 0.2")]:
        with pytest.raises(ConfigError, match=rf"sets dropout \(\{{{named}\}}\)"):
            enable_gradient_checkpointing(StochasticDepth(config))
