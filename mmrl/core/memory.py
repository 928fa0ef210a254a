"""Gradient checkpointing (model.gradient_checkpointing): activations recomputed in the backward
pass instead of kept, for models too large for a GPU's memory otherwise.

transformers checkpoints a layer only while the layer is in training mode, and the trainer
keeps the model in eval mode (no dropout: the on-policy ratio is exactly 1). So the update's
forwards run under `update_mode`: training mode, with every dropout module still in eval mode;
a model whose config asks for dropout anywhere is refused (attention code reads its own
`training` flag, not a module's), stochastic depth too (drop path, LayerDrop: layers skipped at
random in training mode, by code or modules that are no nn.Dropout). diffusers checkpoints
whenever gradients are on."""

from __future__ import annotations

import contextlib

import torch

from .config import ConfigError


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Turn checkpointing on for a transformers model (PEFT-wrapped too) or a diffusers one;
    a ConfigError for a model that supports neither, or whose config sets a dropout."""
    config = getattr(model, "config", None)
    items = config.to_dict().items() if hasattr(config, "to_dict") else dict(config or {}).items()
    dropouts = {k: v for k, v in _flat(items) if _is_dropout(k) and isinstance(v, float) and v > 0}
    if dropouts:
        raise ConfigError(f"model.gradient_checkpointing: the model's config sets dropout ({dropouts}); the "
                          "update would run it (checkpointing needs training mode). Set those to 0 in config.json")
    none = f"model.gradient_checkpointing: {type(model).__name__} supports no gradient checkpointing"
    try:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (and PEFT's wrapper)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif hasattr(model, "gradient_checkpointing_enable"):  # transformers before 5
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif hasattr(model, "enable_gradient_checkpointing"):  # diffusers
            model.enable_gradient_checkpointing()
        else:
            raise ConfigError(none)
    except ValueError as e:
        # every transformers and diffusers model has the method; a class (often a checkpoint's own
        # remote code) without support for it raises ValueError, which would be a traceback
        raise ConfigError(f"{none} ({str(e).rstrip('. ')}); set model.gradient_checkpointing: false") from None
    model._mmrl_checkpointing = True


def _is_dropout(key: str) -> bool:
    """"dropout" (most configs), GPT-style "*_pdrop" (attn_pdrop, resid_pdrop), or stochastic
    depth: "drop_path_rate" (vision towers), "layerdrop" (encoder_layerdrop), "drop_connect_rate"."""
    return ("dropout" in key or key.endswith("pdrop") or "drop_path" in key or "layerdrop" in key
            or "drop_connect" in key)


def _flat(items, prefix=""):
    for k, v in items:
        if isinstance(v, dict):
            yield from _flat(v.items(), f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


@contextlib.contextmanager
def update_mode(model: torch.nn.Module):
    """The update's forward and backward: training mode with dropout off where the model
    checkpoints (see the module docstring); nothing changes otherwise."""
    if not getattr(model, "_mmrl_checkpointing", False):
        yield
        return
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.eval()
    try:
        yield
    finally:
        model.eval()
