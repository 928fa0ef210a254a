"""A resolved config as YAML with each key's description above it (`<cli> config`).

The descriptions are the docstrings under the fields of the config classes (mmrl.core.config
and each backend's config.py), so what `config` prints is what the code says. The YAML loads
back as a `--config` file: paths are made absolute, as in a run's config.yaml, and a file's
`base:` files are merged in (the key itself is not a setting, so it is not printed).
"""

from __future__ import annotations

import difflib
import textwrap
import typing
from typing import Any

from pydantic import BaseModel

from mmrl.core.config import ConfigError, dump_yaml
from mmrl.core.config_loading import _is_model
from mmrl.core.runconfig import absolute_paths

__all__ = ["commented_config"]

WIDTH = 96


def commented_config(cfg: BaseModel, keys: str | None = None) -> str:
    """`cfg` as commented YAML; `keys` ("rollout.tools", "method") keeps that part only, under
    its parents' keys so that it still loads as a config. An unknown key path -> ConfigError."""
    data = absolute_paths(cfg.model_dump(mode="json"), getattr(cfg, "base_dir", None))
    lines: list[str] = []
    model, values, indent = cfg, data, ""
    if keys:
        path = keys.split(".")
        for depth, name in enumerate(path):
            fields = _shown(model)
            if name not in fields:
                where = ".".join(path[:depth]) or "the config"
                close = difflib.get_close_matches(name, fields, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ConfigError(f"--keys {keys}: no key {name!r} in {where} ({hint}its keys: {', '.join(fields)})")
            if depth == len(path) - 1:
                _field(lines, model, values, name, indent)
                return "\n".join(lines) + "\n"
            lines.append(f"{indent}{name}:")
            parent = model
            model, values, indent = getattr(model, name), values[name], indent + "  "
            if not isinstance(model, BaseModel):
                where = ".".join(path[:depth + 1])
                section = _section_class(type(parent), name)
                if model is None and section is not None:  # a section that is off (model.lora: null)
                    first = _shown(section)[0]
                    raise ConfigError(f"--keys {keys}: {where} is null (off) in this config; its keys once set: "
                                      f"{', '.join(_shown(section))} (with --set {where}.{first}=..., --keys "
                                      f"{where} shows them with their defaults)")
                raise ConfigError(f"--keys {keys}: {where} is {model!r}, not a section")
    for name in _shown(model):
        _field(lines, model, values, name, indent)
    return "\n".join(lines) + "\n"


def _field(lines: list[str], model: BaseModel, values: dict, name: str, indent: str) -> None:
    description = _description(type(model), name)
    if description:
        text = " ".join(description.split())
        lines.extend(textwrap.wrap(text, WIDTH - len(indent), initial_indent=f"{indent}# ",
                                   subsequent_indent=f"{indent}# ", break_on_hyphens=False))
    value = getattr(model, name)
    if isinstance(value, BaseModel):
        lines.append(f"{indent}{name}:")
        for sub in _shown(value):
            _field(lines, value, values[name], sub, indent + "  ")
    else:
        lines.append(f"{indent}{name}: {_flow(values[name])}")


def _section_class(cls: type[BaseModel], name: str) -> type[BaseModel] | None:
    """The section class a field `X | None` takes (None for a plain value)."""
    annotation = cls.model_fields[name].annotation
    for arg in typing.get_args(annotation) or (annotation,):
        if _is_model(arg):  # (a dict[str, Any] | None's dict[...] is no model, on Python 3.10 too)
            return arg
    return None


def _description(cls: type[BaseModel], name: str) -> str | None:
    """The field's docstring, or, where a subclass redefines the field without one (a new
    default or type), the nearest base class's."""
    for base in cls.__mro__:
        info = getattr(base, "model_fields", {}).get(name) if isinstance(base, type) else None
        if info is not None and info.description:
            return info.description
    return None


def _shown(model: BaseModel) -> list[str]:
    """The fields a config file sets (not those excluded from dumps: derived from others)."""
    cls = model if isinstance(model, type) else type(model)
    return [name for name, info in cls.model_fields.items() if not info.exclude]


def _flow(value: Any) -> str:
    """One value in YAML's flow style, on one line."""
    text = dump_yaml(value, default_flow_style=True, width=float("inf"), sort_keys=False).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()
