"""The config schemas that the docs' tests (test_migrating_doc.py, test_docs_names.py) check
the keys the docs name against: each command line's config class, and a walk of a key down it."""

from __future__ import annotations

import importlib
import re
import typing
from typing import Annotated, Any

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from mmrl.core.cli import load_backend
from mmrl.core.config import load_config
from mmrl.core.config_doc import _shown
from mmrl.core.config_loading import _is_model

CLI_MODULES = {"mmrl": "mmrl.cli", "diffusion-rl": "diffusion_rl.cli", "dllm-rl": "dllm_rl.cli"}
KEY = re.compile(r"[a-z_]+(\.[a-z0-9_]+)+")  # a dotted key path; values like 0.2 or q_proj are not


def settings(command: str):
    """The settings module of `command` (its CONFIG_CLASS and DEFAULT_CONFIG), as `config` loads it."""
    return load_backend(importlib.import_module(CLI_MODULES[command]).SPEC, settings_only=True)


def schema(command: str, method: str):
    """The config class and a default config of `command` with `method.type`, as `config` builds them."""
    backend = settings(command)
    cls, defaults = backend.CONFIG_CLASS, backend.DEFAULT_CONFIG
    return cls, defaults, load_config(cls, overrides=[f"method.type={method}"], defaults=defaults)


def _models(annotation: Any) -> list[type[BaseModel]]:
    """Every config class a field of `annotation` can hold: each member of a union (a method's
    types), of an Optional (model.lora), of a list or dict (reward.atoms)."""
    if _is_model(annotation):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _mapping(annotation: Any) -> bool:
    """Whether a field of `annotation` can hold a free-form mapping (task.options, an atom's dict)."""
    return dict in (annotation, typing.get_origin(annotation)) or any(_mapping(a) for a in typing.get_args(annotation))


def fields_of(cls: type[BaseModel], key: str) -> list[FieldInfo]:
    """The fields `key` names in `cls` under any of its variants (`method.g_steps` is a key of
    method.type ftfc only); a number steps into a list (`reward.atoms.0.weight`), any name into
    a free-form mapping (`task.options.digits`, which takes any value). [] when it names none."""
    classes, found = [cls], []
    for name in key.split("."):
        if name.isdigit():
            continue
        if not classes and any(_mapping(f.annotation) for f in found):
            return [FieldInfo(annotation=Any)]  # below a mapping: its keys and values are the user's
        found = [c.model_fields[name] for c in classes if name in _shown(c)]
        classes = [m for f in found for m in _models(f.annotation)]
    return found


def value_error(fields: list[FieldInfo], value: Any) -> str | None:
    """Why `value` fits none of `fields` (their type and bounds); None when one takes it."""
    errors = []
    for field in fields:
        try:
            TypeAdapter(Annotated[field.annotation, field]).validate_python(value)
            return None
        except ValidationError as e:
            errors.append(e.errors()[0]["msg"])
    return "; ".join(dict.fromkeys(errors))  # one message per distinct reason
