"""mmrl.core.lora: adapters drawn from the run's seed (not from wherever the global RNG
happens to be), a clear error for target modules that name no layer, and the adapter file
checks of load_adapter / check_not_adapter."""

from __future__ import annotations

import pytest
import torch

from mmrl.core.config import ConfigError
from mmrl.core.lora import LoRAConfig, add_lora, check_not_adapter, load_adapter


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.v_proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.v_proj(self.q_proj(x))


def adapters(seed: int, draws: int = 0) -> dict[str, torch.Tensor]:
    torch.rand(draws)  # the global RNG wherever it is
    model = add_lora(Tiny(), LoRAConfig(r=2, target_modules=["q_proj", "v_proj"]), seed=seed)
    return {k: v.detach().clone() for k, v in model.named_parameters() if ".lora_A." in k}


def test_the_seed_fixes_the_initial_adapters_and_the_global_rng_is_left_alone():
    a, b, c = adapters(0), adapters(0, draws=5), adapters(1)
    assert a.keys() == b.keys() == c.keys() and len(a) == 2
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not any(torch.equal(a[k], c[k]) for k in a)
    model = Tiny()
    state = torch.get_rng_state()
    add_lora(model, LoRAConfig(r=2, target_modules=["q_proj"]), seed=3)
    assert torch.equal(torch.get_rng_state(), state)


def test_only_adapters_train_and_bad_target_modules_name_the_layers():
    model = add_lora(Tiny(), LoRAConfig(r=2, target_modules=["q_proj"]))
    assert all(".lora_" in k for k, v in model.named_parameters() if v.requires_grad)
    with pytest.raises(ConfigError, match=r"do not name layers of Tiny \(its linear layers: q_proj, v_proj\)"):
        add_lora(Tiny(), LoRAConfig(target_modules=["query"]))


def test_adapter_and_full_weight_directories_are_told_apart(tmp_path):
    model = add_lora(Tiny(), LoRAConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ConfigError, match="holds a LoRA adapter, not full weights"):
        check_not_adapter(tmp_path / "adapter")
    with pytest.raises(ConfigError, match="holds no LoRA adapter"):
        load_adapter(model, tmp_path)
    other = add_lora(Tiny(), LoRAConfig(r=2, target_modules=["v_proj"]))
    with pytest.raises(ConfigError, match="does not fit this run's model.lora"):
        load_adapter(other, tmp_path / "adapter")
    more = add_lora(Tiny(), LoRAConfig(r=2, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ConfigError, match="adapters it lacks, left as initialised: .*v_proj"):
        load_adapter(more, tmp_path / "adapter")
    wider = add_lora(Tiny(), LoRAConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ConfigError, match="does not fit this run's model.lora"):
        load_adapter(wider, tmp_path / "adapter")
    scaled = add_lora(Tiny(), LoRAConfig(r=2, alpha=64, target_modules=["q_proj"]))  # loads, but scales by 32
    with pytest.raises(ConfigError, match=r"other LoRA settings \(alpha 16.0 there, 64.0 here\)"):
        load_adapter(scaled, tmp_path / "adapter")


def test_lora_dropout_is_refused_as_it_would_never_run():
    with pytest.raises(ValueError, match="dropout off.*set it to 0"):
        LoRAConfig(dropout=0.05)
    assert LoRAConfig(dropout=0).dropout == 0


def test_the_lora_wrapper_keeps_the_models_mode():
    """PEFT's wrapper would start in train mode over an eval-mode model: a copy of it made before
    the trainer's eval() (a pipelined engine's) then switched the model to train mode."""
    for training in (False, True):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4)).train(training)
        wrapped = add_lora(model, LoRAConfig(r=2, target_modules=["0"]))
        assert {m.training for m in wrapped.modules()} == {training}
