"""LoRA adapters (PEFT) for the backends whose models are transformers models (VLM, dLLM).

    model = add_lora(model, cfg.model.lora)   # only the adapters train from here on
    is_lora(model)                            # True for a PEFT-wrapped model
    load_adapter(model, directory)            # what model.save_pretrained wrote, in place
    load_model_weights(model, directory)      # the same, or every weight for a model without LoRA
    merge_lora(model)                         # the base model with the adapters folded in (export)

A LoRA model's save_pretrained writes the adapter alone (adapter_model.safetensors and
adapter_config.json); loading it needs a model built with the same `model.lora`.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch

from mmrl.core.checkpoint import load_weights_in_place
from mmrl.core.config import ConfigError
from mmrl.core.lora_config import LoRAConfig  # torch-free there; importable from here too

ADAPTER_FILE = "adapter_model.safetensors"


def add_lora(model: torch.nn.Module, lcfg: LoRAConfig, seed: int = 0) -> torch.nn.Module:
    """Wrap the model's `target_modules` with PEFT LoRA adapters; only adapters train.
    A's random init is drawn from `seed` (the run's), so a run's seed fixes its adapters.
    The wrapper is in the model's mode (train or eval)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        # installed but failing to import (a version that does not fit this transformers or torch)
        # is another fix than a missing package: say which
        missing = isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "peft"
        raise ConfigError("model.lora needs the `peft` package (pip install peft)" if missing else
                          f"model.lora needs `peft`, which is installed but does not import here "
                          f"({type(e).__name__}: {e}); pyproject.toml names the versions that fit") from e
    config = LoraConfig(
        r=lcfg.r, lora_alpha=lcfg.alpha, lora_dropout=lcfg.dropout,
        target_modules=list(lcfg.target_modules), bias="none",
    )
    try:
        with warnings.catch_warnings(), seeded(seed):
            # PEFT reads a property transformers has deprecated: not the user's to fix
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            # PEFT's wrapper starts in train mode: keep the model's own mode (a copy made before
            # the trainer's eval(), a pipelined engine's, would else switch it to train mode
            # after its rollouts: LoRA dropout in the old log-probs)
            return get_peft_model(model, config).train(model.training)
    except ValueError as e:  # PEFT: "Target modules {...} not found in the base model"
        raise target_modules_error(model, lcfg.target_modules, e) from e


def _short_name(name: str) -> str:
    """How target_modules names a layer: its last name (`q_proj`), with its parent's where that is
    an index (`to_out.0`, a Sequential's first layer)."""
    parts = name.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]


def target_modules_error(model: torch.nn.Module, targets, error: Exception) -> ConfigError:
    """The ConfigError for target_modules PEFT refused with `error`: the model's linear layers,
    and where a name matches modules LoRA cannot adapt (an attention block, a norm), which ones,
    instead of PEFT's printout of the whole module."""
    linear = sorted({_short_name(name) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    name, listing = type(model).__name__, f"(its linear layers: {', '.join(linear)})"
    # PEFT matches a name against the end of each module's name, at a dot
    other = {t: sorted({type(m).__name__ for name, m in model.named_modules()
                        if (name == t or name.endswith("." + t)) and not isinstance(m, torch.nn.Linear)})
             for t in targets}
    other = {t: kinds for t, kinds in other.items() if kinds}
    if other and "is not supported" in str(error):
        what = "; ".join(f"{t!r} names {', '.join(kinds)}" for t, kinds in other.items())
        return ConfigError(f"model.lora.target_modules {list(targets)}: {what}, not a linear layer; LoRA "
                           f"adapts linear layers: name those of {name} instead {listing}")
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return ConfigError(f"model.lora.target_modules {list(targets)} do not name layers of {name} {listing}: {first}")


@contextlib.contextmanager
def seeded(seed: int):
    """The global RNG (which PEFT's init draws from) at `seed` inside, as it was outside."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def is_lora(model: torch.nn.Module) -> bool:
    """Whether a PEFT adapter is attached (a peft model, or diffusers' own PEFT integration)."""
    return hasattr(model, "peft_config")


def merge_lora(model: torch.nn.Module) -> torch.nn.Module:
    """The base model with each adapter's update folded into its layer's weight (W + B A alpha/r),
    for a standalone export: what PEFT's merge_and_unload gives, in place (the PEFT wrapper is
    spent). A model without LoRA as is."""
    return model.merge_and_unload() if is_lora(model) else model


def load_adapter(model: torch.nn.Module, directory: str | Path) -> None:
    """Load the adapter a LoRA model's save_pretrained wrote to `directory`, in place."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    file = Path(directory) / ADAPTER_FILE
    if not file.is_file():
        raise ConfigError(f"{directory} holds no LoRA adapter ({ADAPTER_FILE}), but this run's model has "
                          "model.lora set: point at a checkpoint of a LoRA run, or unset model.lora")
    check_adapter_config(model.peft_config["default"], directory)
    try:
        result = set_peft_model_state_dict(model, load_file(file))
    except RuntimeError as e:  # another rank: one "size mismatch for <weight>: ..." line per weight
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        first = lines[1] if len(lines) > 1 else lines[0]
        more = f" (and {len(lines) - 2} more)" if len(lines) > 2 else ""
        raise ConfigError(f"the adapter in {directory} does not fit this run's model.lora: {first}{more}") from e
    # adapters on other layers, named as the file names them (peft < 0.21 inserts the adapter's
    # name: lora_A.default.weight)
    unexpected = [k.replace(".default.", ".") for k in getattr(result, "unexpected_keys", None) or []]
    missing = [k for k in getattr(result, "missing_keys", None) or [] if ".lora_" in k]  # on fewer layers
    if unexpected or missing:
        what = (f"weights it has no place for: {', '.join(sorted(unexpected)[:3])}" if unexpected
                else f"adapters it lacks, left as initialised: {', '.join(sorted(missing)[:3])}")
        raise ConfigError(f"the adapter in {directory} does not fit this run's model.lora ({what})")


# what scales an adapter's output: a mismatch loads without error and changes the model (another
# rank or other target layers do not load: the weights' shapes and names say so)
_ADAPTER_FIELDS = {"lora_alpha": "alpha", "use_rslora": "use_rslora", "use_dora": "use_dora"}


def check_adapter_config(mine, directory: str | Path) -> None:
    """ConfigError where the adapter_config.json in `directory` differs from this model's LoRA
    config (a peft LoraConfig) in alpha, rsLoRA or DoRA: the weights would load and the scaling
    alpha/r be this run's, not the trained one's."""
    import json

    try:
        saved = json.loads((Path(directory) / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{directory}/adapter_config.json is unreadable: {e}") from e
    wrong = [f"{name} {saved[key]!r} there, {getattr(mine, key)!r} here" for key, name in _ADAPTER_FIELDS.items()
             if key in saved and saved[key] != getattr(mine, key)]
    if wrong:
        raise ConfigError(f"the adapter in {directory} was trained with other LoRA settings ({'; '.join(wrong)}): "
                          "set model.lora as its run did (its config.yaml has it)")


def is_adapter_dir(directory: str | Path) -> bool:
    """Whether a LoRA model's save_pretrained wrote this directory (the adapter alone)."""
    return (Path(directory) / "adapter_config.json").is_file()


def load_model_weights(model: torch.nn.Module, directory: str | Path) -> None:
    """What the model's save_pretrained wrote, in place: the adapter under LoRA, else every weight."""
    if is_lora(model):
        load_adapter(model, directory)
        return
    check_not_adapter(directory)
    load_weights_in_place(model, directory)


def check_not_adapter(directory: str | Path) -> None:
    """A full-weights model cannot load an adapter: say so, instead of a missing-file error."""
    if is_adapter_dir(directory):
        raise ConfigError(f"{directory} holds a LoRA adapter, not full weights: set model.lora as the run "
                          "did (its config.yaml has it; pass --config <run>/config.yaml)")
