"""mmrl.core.lora: adapters drawn from the run's seed (not from wherever the global RNG
happens to be), a clear error for target modules that name no layer, and the adapter file
checks of load_adapter / check_not_adapter."""

from __future__ import annotations

import pytest
import torch

from mmrl.core.config import ConfigError
from mmrl.core.lora import (
    LoRAConfig,
    add_lora,
    check_not_adapter,
    is_lora,
    load_adapter,
    load_model_weights,
    seeded,
)


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


def test_lora_config_defaults_and_bounds():
    cfg = LoRAConfig()
    assert (cfg.r, cfg.alpha, cfg.dropout) == (8, 16.0, 0.0)
    assert cfg.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    for bad in ({"r": 0}, {"alpha": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LoRAConfig(**bad)


def test_the_adapters_update_is_scaled_by_alpha_over_r_without_dropout():
    """y = W x + b + (alpha / r) B A x. With W, b = 0, A and B all ones, x all ones of width 64,
    r = 2 and alpha = 6: A x = [64, 64], B A x = 128 in every row, times 3 = 384. In train mode,
    forward after forward (a LoRA dropout would drop parts of x)."""
    base = torch.nn.Sequential(torch.nn.Linear(64, 4))
    torch.nn.init.zeros_(base[0].weight), torch.nn.init.zeros_(base[0].bias)
    model = add_lora(base, LoRAConfig(r=2, alpha=6, target_modules=["0"])).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.fill_(1.0)
    assert model.peft_config["default"].lora_dropout == 0
    for _ in range(3):
        assert model(torch.ones(1, 64)).tolist() == [[384.0] * 4]


def test_seeded_draws_what_manual_seed_draws():
    """Inside seeded(s) the global RNG is where torch.manual_seed(s) puts it: the adapters are
    drawn from the run's seed itself."""
    with seeded(5):
        inside = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(inside, torch.rand(3))


def test_bad_target_modules_name_nested_layers_by_their_last_name():
    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.head = Tiny(), torch.nn.Linear(8, 2)

    # named_modules: block.q_proj, block.v_proj, head -> q_proj, v_proj, head, sorted
    with pytest.raises(ConfigError, match=r"of Outer \(its linear layers: head, q_proj, v_proj\)"):
        add_lora(Outer(), LoRAConfig(target_modules=["query"]))


def saved_adapter(path, r: int = 2) -> dict[str, torch.Tensor]:
    """A q_proj adapter of rank r with B = 0.5 everywhere (not its zero init) saved to `path`;
    its LoRA weights by name."""
    model = add_lora(Tiny(), LoRAConfig(r=r, target_modules=["q_proj"]))
    with torch.no_grad():
        model.base_model.model.q_proj.lora_B["default"].weight.fill_(0.5)
    model.save_pretrained(path)
    return {k: v.detach().clone() for k, v in model.named_parameters() if ".lora_" in k}


def test_load_model_weights_loads_a_saved_adapter_into_a_lora_model(tmp_path):
    saved = saved_adapter(tmp_path)
    model = add_lora(Tiny(), LoRAConfig(r=2, target_modules=["q_proj"]), seed=1)  # other A, B = 0
    assert is_lora(model) and not is_lora(Tiny())
    load_model_weights(model, tmp_path)
    loaded = {k: v for k, v in model.named_parameters() if ".lora_" in k}
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert {v.unique().item() for k, v in loaded.items() if ".lora_B." in k} == {0.5}


def test_a_full_weights_model_refuses_an_adapter_directory_however_saved(tmp_path):
    """save_pretrained writes adapter_config.json with safetensors weights or, unsafe, with
    adapter_model.bin: both are adapters, which a model without LoRA cannot load."""
    model = add_lora(Tiny(), LoRAConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "safe")
    model.save_pretrained(tmp_path / "bin", safe_serialization=False)
    assert not (tmp_path / "bin" / "adapter_model.safetensors").exists()
    for kind in ("safe", "bin"):
        with pytest.raises(ConfigError, match="holds a LoRA adapter, not full weights"):
            load_model_weights(Tiny(), tmp_path / kind)


def test_a_wider_adapter_names_its_first_mismatch_and_counts_the_rest(tmp_path):
    saved_adapter(tmp_path, r=2)
    # rank 4 against the saved 2: A [4, 8] vs [2, 8] and B [8, 4] vs [8, 2], A named, B counted
    wider = add_lora(Tiny(), LoRAConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ConfigError) as info:
        load_adapter(wider, tmp_path)
    assert str(info.value).startswith(f"the adapter in {tmp_path} does not fit this run's model.lora: "
                                      "size mismatch for base_model.model.q_proj.lora_A.default.weight")
    assert str(info.value).endswith(" (and 1 more)")
    # one weight of another shape (A alone, B kept): named, and no "(and 0 more)"
    from safetensors.torch import load_file, save_file

    file = tmp_path / "adapter_model.safetensors"
    weights = load_file(file)
    weights["base_model.model.q_proj.lora_A.weight"] = torch.zeros(3, 8)
    save_file(weights, file)
    with pytest.raises(ConfigError) as info:
        load_adapter(add_lora(Tiny(), LoRAConfig(r=2, target_modules=["q_proj"])), tmp_path)
    assert "size mismatch for base_model.model.q_proj.lora_A.default.weight" in str(info.value)
    assert str(info.value).endswith("torch.Size([2, 8]).")


def test_an_adapter_of_other_layers_names_the_weights_it_has_no_place_for(tmp_path):
    saved_adapter(tmp_path)
    other = add_lora(Tiny(), LoRAConfig(r=2, target_modules=["v_proj"]))
    with pytest.raises(ConfigError) as info:
        load_adapter(other, tmp_path)
    assert str(info.value).endswith("(weights it has no place for: base_model.model.q_proj.lora_A.weight, "
                                    "base_model.model.q_proj.lora_B.weight)")


def test_weights_without_a_place_are_named_as_the_file_names_them_on_an_older_peft(tmp_path, monkeypatch):
    # peft before 0.21 reports unexpected keys with the adapter's name inserted
    from types import SimpleNamespace

    import peft

    saved_adapter(tmp_path)
    old = SimpleNamespace(unexpected_keys=["base_model.model.q_proj.lora_A.default.weight"], missing_keys=[])
    monkeypatch.setattr(peft, "set_peft_model_state_dict", lambda model, weights: old)
    with pytest.raises(ConfigError, match=r"no place for: base_model.model.q_proj.lora_A.weight\)$"):
        load_adapter(add_lora(Tiny(), LoRAConfig(r=2, target_modules=["q_proj"])), tmp_path)


def test_the_adapter_config_is_checked_for_rslora_and_dora_and_may_lack_them(tmp_path):
    import json

    saved_adapter(tmp_path)
    config_file = tmp_path / "adapter_config.json"
    written = json.loads(config_file.read_text())
    model = add_lora(Tiny(), LoRAConfig(r=2, target_modules=["q_proj"]))
    for key in ("use_rslora", "use_dora"):
        config_file.write_text(json.dumps({**written, key: True}))
        with pytest.raises(ConfigError, match=rf"other LoRA settings \({key} True there, False here\)"):
            load_adapter(model, tmp_path)
    # an adapter_config.json without the fields (an older PEFT's) is not a mismatch
    config_file.write_text(json.dumps({k: v for k, v in written.items() if k not in ("use_rslora", "use_dora")}))
    load_adapter(model, tmp_path)
    config_file.write_text("{not json")
    with pytest.raises(ConfigError, match="adapter_config.json is unreadable"):
        load_adapter(model, tmp_path)


def test_a_target_that_is_not_a_linear_layer_is_named_with_its_type_not_printed_whole():
    """PEFT's message printed the whole module (an attention block: every layer in it, over
    many lines); the error names the module's type and the linear layers there are."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.norm = Tiny(), torch.nn.LayerNorm(8)
            self.out = torch.nn.Sequential(torch.nn.Linear(8, 8))

    with pytest.raises(ConfigError) as err:
        add_lora(Block(), LoRAConfig(target_modules=["attn", "q_proj"]))
    msg = str(err.value)
    assert "\n" not in msg and "Linear(" not in msg
    assert "'attn' names Tiny, not a linear layer" in msg
    assert "(its linear layers: out.0, q_proj, v_proj)" in msg  # a Sequential's layer by its index
    with pytest.raises(ConfigError, match="'norm' names LayerNorm, not a linear layer"):
        add_lora(Block(), LoRAConfig(target_modules=["norm"]))


def test_an_empty_target_list_and_any_dropout_say_what_to_set():
    with pytest.raises(ValueError, match=r"empty list gives no layer an adapter.*\[q_proj"):
        LoRAConfig(target_modules=[])
    with pytest.raises(ValueError, match="set it to 0"):  # was "should be less than 1"
        LoRAConfig(dropout=1)


def test_a_peft_that_is_installed_but_does_not_import_is_told_from_a_missing_one(monkeypatch):
    """"needs the `peft` package (pip install peft)" was said also where peft is installed and its
    import fails (a version that does not fit this transformers): pip install changes nothing there."""
    import sys
    import types

    cfg = LoRAConfig(r=2, target_modules=["q_proj"])
    monkeypatch.setitem(sys.modules, "peft", None)  # not installed: ModuleNotFoundError
    with pytest.raises(ConfigError, match=r"needs the `peft` package \(pip install peft\)"):
        add_lora(Tiny(), cfg, seed=0)
    monkeypatch.setitem(sys.modules, "peft", types.ModuleType("peft"))  # installed, lacks its names
    with pytest.raises(ConfigError, match=r"installed but does not import here \(ImportError: cannot import name "
                                          r"'LoraConfig' from 'peft'.*pyproject.toml"):
        add_lora(Tiny(), cfg, seed=0)
