"""Loading a run's config: YAML files, `base:` files, $NAME variables, --set overrides, and the
ConfigError messages of a config that does not validate.

    embedded default (the backend's)  <-  YAML file  <-  --set key.path=value

load_config builds a `TrainConfig` (mmrl.core.config, the section classes) from those three
layers, later ones winning. A YAML file may build on others: `base: common.yaml` (or a list)
layers it over them (read_config_file), so a variant of an experiment holds only what differs.
The YAML read is 1.2's (`1e-5` a float, `no` a string, no duplicate keys: _Loader), and
dump_yaml writes what reads back the same.

Every error is turned into one `ConfigError` whose message names the key path (and the file
that set it), so a CLI can print it instead of a traceback. The names here stay importable
from mmrl.core.config, where they were before this module was split from it.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
import warnings
from pathlib import Path
from typing import Annotated, Any, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from mmrl.core.config import ConfigError, KeyValueError, TrainConfig, _members, config_warning
from mmrl.core.runconfig import absolute_paths, not_installed_note, resolve_config_file

# --------------------------------------------------------------------------- loading


def deep_merge(base: dict, update: dict) -> dict:
    """Recursive dict merge, `update` winning. A section whose `type` changes is replaced,
    not merged, so switching method or task does not drag the old variant's keys along."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        old = out.get(key)
        if (
            isinstance(old, dict)
            and isinstance(value, dict)
            and value.get("type", old.get("type")) == old.get("type")
        ):
            out[key] = deep_merge(old, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class _Loader(yaml.SafeLoader):
    """safe_load with YAML 1.2 floats (`1e-5` is a float, not the string '1e-5') and no
    duplicate keys: plain YAML keeps the last silently, and a config would lose a section.
    Anchors and merge keys (`<<: *anchor`) work as in safe_load."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor`: flatten_mapping (in the base) merges it, the keys written here winning
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (lines {seen[key]} and {line})", key_node.start_mark)
            except TypeError:  # an unhashable key: the base constructor reports it
                continue
            seen[key] = line
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


# YAML 1.2 integers: decimal (a leading 0 is still decimal), 0o octal, 0x hex. YAML 1.1's
# base-60 ("20:00" read as 1200) and leading-0 octal ("010" read as 8) are strings or decimals.
for _first, _resolvers in list(_Loader.yaml_implicit_resolvers.items()):
    _Loader.yaml_implicit_resolvers[_first] = [(tag, rx) for tag, rx in _resolvers if tag != "tag:yaml.org,2002:int"]
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+)$"), list("-+0123456789"))


def _construct_int(loader: yaml.SafeLoader, node) -> int:
    text = loader.construct_scalar(node).replace("_", "")
    if text.startswith(("0o", "0x")):
        return int(text, 8 if text[1] == "o" else 16)
    return int(text, 10)


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)

# YAML 1.2 booleans: true and false only. YAML 1.1's yes/no/on/off/y/n were read as booleans,
# so `task.answer=no` or a prompt "on" became False; a bool field still takes them (pydantic).
for _first, _resolvers in list(_Loader.yaml_implicit_resolvers.items()):
    _Loader.yaml_implicit_resolvers[_first] = [(tag, rx) for tag, rx in _resolvers if tag != "tag:yaml.org,2002:bool"]
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


class _Dumper(yaml.SafeDumper):
    """safe_dump that quotes every string _Loader or safe_load would read as something else:
    safe_dump knows YAML 1.1 only, so it wrote the strings "1e-5" and "0o17" plain, and a
    dumped config (`config`, a run's config.yaml) loaded back with a float and an int there."""


for _first, _resolvers in _Loader.yaml_implicit_resolvers.items():
    for _tag, _regexp in _resolvers:
        _Dumper.add_implicit_resolver(_tag, _regexp, [_first])


def dump_yaml(data: Any, **kwargs: Any) -> str:
    """yaml.safe_dump(data, **kwargs) that loads back as it was by load_config (read_yaml) and
    by yaml.safe_load alike."""
    return yaml.dump(data, Dumper=_Dumper, **kwargs)


def _yaml(text: str, name: str | None = None) -> Any:
    """`text` read as YAML; an error's marks name `name` (a file's path) where yaml's would
    say "<unicode string>"."""
    loader = _Loader(text)
    if name is not None:
        loader.name = name
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def parse_override(item: str) -> tuple[list[str], Any]:
    """"a.b.c=value" -> (["a", "b", "c"], value parsed as YAML: 3 -> int, [1, 2] -> list, x -> str)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.path=value")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r} has an empty key in {key!r}")
    try:
        value = _yaml(raw, "the value") if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({_one_line(e)})") from None
    return parts, value


def _override_list(overrides) -> tuple[str, ...]:
    """load_config's `overrides` from Python: a list of strings. One string would be read
    character by character ("override 't' must look like ..."), and a dict's keys without
    their values, so both are refused with the list to write instead."""
    if overrides is None:
        return ()
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of 'key.path=value' strings, not one string: "
                          f"write [{overrides!r}]")
    if isinstance(overrides, dict):
        hint = ", ".join(repr(f"{k}={v}") for k, v in list(overrides.items())[:2])
        raise ConfigError(f"overrides must be a list of 'key.path=value' strings, not a dict: write [{hint}]")
    bad = [o for o in overrides if not isinstance(o, str)]
    if bad:
        raise ConfigError(f"overrides must be a list of 'key.path=value' strings; {bad[0]!r} is not a string ("
                          f"{type(bad[0]).__name__})")
    return tuple(overrides)


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    data = copy.deepcopy(data)
    done: list[tuple[list[str], str]] = []  # (key, override) applied so far
    for item in overrides:
        parts, value = parse_override(item)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if isinstance(child, list):  # `reward.atoms.0.weight=2`: items have no key path
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"override {item!r}: {where} is a list, and --set reaches into sections "
                                  f"only: give the whole list, e.g. --set '{where}=[...]'")
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"override {item!r}: {where} is a value, not a section")
            node = child
        if parts[-1] == "type" and node.get("type") != value:
            node.clear()  # a new variant starts from its own defaults
            section = parts[:-1]
            # the section's keys given before, or the whole section given as a mapping
            wiped = [o for key, o in done if key[: len(section)] == section and len(key) >= len(section)]
            if wiped:  # said, not silent: the same keys given after the type would stay
                warnings.warn(f"{', '.join(wiped)} given before {item.strip()} no longer applies: a new "
                              f"{'.'.join(section)} type starts from its own defaults (give the type first "
                              "to keep them)", stacklevel=3)
        node[parts[-1]] = value
        done.append((parts, item.strip()))
    return data


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory, not a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist{not_installed_note(path)}")
    try:
        data = _yaml(path.read_text(encoding="utf-8"), str(path))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {_one_line(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top, got {type(data).__name__}")
    return data


_ENV_VAR = re.compile(r"\$([A-Za-z_]\w*|\{[A-Za-z_]\w*\})")


def expand_env(data: Any, path: str | Path) -> Any:
    """A config file's values with $NAME and ${NAME} replaced by set environment variables, as
    a shell would (`output_dir: $SCRATCH/runs/axpo` on a cluster; a --set value the shell has
    expanded already), and `$$` by one `$` (`price: $$5`; `$$HOME` is the text "$HOME"). An
    unset variable stays as written, with one warning: it would otherwise become a directory
    named "$SCRATCH" without a word."""
    unset: dict[str, str] = {}

    def walk(value: Any, key: str) -> Any:
        if isinstance(value, dict):
            return {k: walk(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, f"{key}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, str) and "$" in value:
            # each piece between the `$$`s on its own: "$$HOME" is "$" and "HOME", never $HOME
            pieces = [os.path.expandvars(piece) for piece in value.split("$$")]
            for m in (m for piece in pieces for m in _ENV_VAR.finditer(piece)):
                unset.setdefault(m.group(1).strip("{}"), key)
            value = "$".join(pieces)
        return value

    data = walk(data, "")
    if unset:
        name, key = next(iter(unset.items()))
        config_warning(f"{path}: {key} names the environment variable ${name}, which is not set: kept as written")
    return data


BASE_KEY = "base"


def read_config_file(path: str | Path, layers: list[tuple[Path, dict]] | None = None) -> dict:
    """A config file's settings as load_config layers them: the file read (read_yaml), its
    variables expanded (expand_env), over the config files its `base:` names (a path or a list,
    relative to the file), the later of a list over the earlier, each read the same way (bases
    of bases too), merged with deep_merge. A relative path in a base that names an existing
    file or directory there is made absolute (runconfig.absolute_paths), so it still means the
    file beside the base. `layers`, when given, gets each file's own settings (path, dict), the
    bases first: whose key an error is."""
    return _read_layered(Path(path), (), None, [] if layers is None else layers)


def _read_layered(path: Path, chain: tuple[Path, ...], named_by: str | None,
                  layers: list[tuple[Path, dict]]) -> dict:
    """read_config_file of `path`, reached through the files of `chain` (named_by: the `base:`
    entry that named it, for its errors)."""
    try:
        data = expand_env(read_yaml(path), path)
    except ConfigError as e:
        raise ConfigError(f"{named_by}: {e}" if named_by else str(e)) from None
    bases = data.pop(BASE_KEY, None)
    names = [bases] if isinstance(bases, str) else [] if bases is None else bases
    if bases is not None:
        where = f"{path}, line {_key_line(path, BASE_KEY)}: {BASE_KEY}"
    if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names):
        raise ConfigError(f"{where} takes a config file's path or a list of them (relative to "
                          f"{path.resolve().parent}), got {bases!r}")
    merged: dict = {}
    chain = (*chain, path.resolve())
    for name in names:
        file = (path.parent / Path(name).expanduser()).resolve()  # an absolute name stays as it is
        if file in chain:
            cycle = " -> ".join(map(str, [*chain[chain.index(file):], file]))
            raise ConfigError(f"{where} {name!r} makes a cycle of bases: {cycle}")
        unset = " (it names an environment variable that is not set)" if _ENV_VAR.search(name) else ""
        base = _read_layered(file, chain, f"{where} {name!r}{unset}", layers)
        merged = deep_merge(merged, absolute_paths(base, file.parent))  # its paths start beside it
    layers.append((path, data))
    return deep_merge(merged, data)


def _key_line(path: Path, key: str) -> int | str:
    """The line of the top-level `key` in YAML file `path` ("?" where it cannot be read)."""
    try:
        node = yaml.compose(path.read_text(encoding="utf-8"), Loader=_Loader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return "?"
    for k, _ in getattr(node, "value", None) or ():
        if isinstance(k, yaml.ScalarNode) and k.value == key:
            return k.start_mark.line + 1
    return "?"


def _is_model(annotation: Any) -> bool:
    """Whether an annotation is a pydantic model class. On Python 3.10 a parametrized generic
    (dict[str, Any]) passes isinstance(_, type) but makes issubclass raise, hence get_origin."""
    return isinstance(annotation, type) and get_origin(annotation) is None and issubclass(annotation, BaseModel)


def _foreign_bases(cls: type[BaseModel], layers: list[tuple[Path, dict]]) -> None:
    """A ConfigError where a base file picks a method or task type that `cls` has none of: a
    base written for another backend (a diffusion config on a VLM one), which may still merge
    into a valid config where the file on top replaces that section."""
    top = layers[-1][0]
    for file, data in layers[:-1]:
        for section in ("method", "task"):
            given = data.get(section)
            kind = given.get("type") if isinstance(given, dict) else None
            field = cls.model_fields.get(section)
            tags = [m.model_fields["type"].default for m in _members(field.annotation)
                    if _is_model(m) and "type" in m.model_fields] if field is not None else []
            if kind is not None and tags and kind not in tags:
                raise ConfigError(f"{file}, a base of {top}, sets {section} {kind!r}, not one of this config's "
                                  f"({', '.join(map(str, tags))}): is it another backend's config?")


def _file_of(key: str, layers: list[tuple[Path, dict]]) -> Path | None:
    """The file of `layers` that sets most of dotted `key` (the later one of a tie): where a
    key an error names, or the section a validator's error names, was written."""
    best, depth = None, 0
    for file, data in layers:
        node, n = data, 0
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                break
            node, n = node[part], n + 1
        if n and n >= depth:
            best, depth = file, n
    return best


def load_config(
    cls: type[TrainConfig] = TrainConfig,
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    defaults: dict | None = None,
) -> TrainConfig:
    """Build a validated config: `defaults` <- YAML file at `path` <- dotted `overrides`, a list
    of "key.path=value" strings as --set takes them (the value read as YAML)."""
    overrides = _override_list(overrides)
    if isinstance(path, dict):  # load_config(Cfg, {...}): the second argument is the file's path
        raise ConfigError("load_config's path is a dict: pass a mapping as defaults=..., e.g. "
                          "load_config(cls, defaults={'train': {'max_steps': 2}})")
    if defaults is not None and not isinstance(defaults, dict):
        raise ConfigError(f"load_config's defaults must be a mapping of sections, got a {type(defaults).__name__}")
    # Start from the full default dump, so every union section carries its `type`.
    data = deep_merge(cls().model_dump(mode="json"), defaults or {})
    layers: list[tuple[Path, dict]] = []  # each file's own settings: whose key an error is
    if path is not None:
        path = resolve_config_file(path)
        data = deep_merge(data, read_config_file(path, layers))
        _foreign_bases(cls, layers)
    if any(parse_override(o)[0][0] == BASE_KEY for o in overrides):
        raise ConfigError(f"--set {BASE_KEY}=...: a config's base files are named in the config file itself "
                          f"(`{BASE_KEY}: FILE` in the --config file), not by --set")
    before, data = data, apply_overrides(data, overrides)
    try:
        cfg = cls.model_validate(data)
    except ValidationError as e:
        set_keys = {".".join(parse_override(o)[0]) for o in overrides}
        keys = [".".join(map(str, _error_loc(err, data))) for err in e.errors()]
        # an error of a whole section (a validator's) may come from a --set inside it: blame no one then
        files = dict.fromkeys(_file_of(k, layers) or path for k in keys
                              if not any(k == s or k.startswith(s + ".") or s.startswith(k + ".") for s in set_keys))
        # a --set value is not the file's fault; a base's key is the base's
        named = [str(f) if f == path else f"{f} (a base of {path})" for f in files if f is not None]
        where = f" in {' and '.join(named)}" if named else ""
        raise ConfigError(f"invalid config{where}: " + "; ".join(_describe(e, cls, data))) from None
    _say_replaced_sections(cfg, before, overrides)
    if path is not None:
        cfg._base_dir = str(Path(path).resolve().parent)
    return cfg


def _say_replaced_sections(cfg: BaseModel, before: dict, overrides: tuple[str, ...]) -> None:
    """A warning where a --set gave a whole section as a mapping (`method.loss={clip_high: 0.3}`)
    and so returned keys the file or the backend's defaults had set (DAPO's token_mean) to their
    class defaults: the section is replaced, not merged as a file's is, and that went unsaid."""
    parsed = [(item, *parse_override(item)) for item in overrides]
    mappings = [(item, parts, value) for item, parts, value in parsed if isinstance(value, dict)]
    if not mappings:  # the usual case: no dump of the whole config
        return
    after = cfg.model_dump(mode="json", warnings=False)
    for item, parts, value in mappings:
        old, new, section = before, after, cfg
        for part in parts:
            old, new = (d.get(part) if isinstance(d, dict) else None for d in (old, new))
            section = getattr(section, part, None)
        if not (isinstance(section, BaseModel) and isinstance(old, dict) and isinstance(new, dict)) \
                or new.get("type") != old.get("type"):
            continue  # a new variant (given here or by a later --set) starts from its own defaults
        where = ".".join(parts)
        lost = [f"{where}.{k} {json.dumps(v)} -> {json.dumps(new[k])}" for k, v in old.items()
                if k not in value and v != new.get(k)]
        if lost:
            config_warning(f"--set {item.strip()} replaces the whole {where} section: {', '.join(lost)} (its "
                           f"defaults); give only the keys to change (--set {where}.KEY=VALUE) to keep the others")


def check_built(cfg: BaseModel) -> None:
    """A config that a Trainer is handed, validated again: pydantic's model_copy(update=...)
    does not validate, so `cfg.model_copy(update={"train": {"max_steps": 5}})` put a dict where
    the section was (an AttributeError deep in the trainer) and a max_steps of -3 trained
    nothing without a word. ConfigError naming the key; the config itself is not replaced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a validator's warnings were shown when it was built
        data = cfg.model_dump(mode="json", warnings=False)
        try:
            fresh = type(cfg).model_validate(data)
        except ValidationError as e:
            raise ConfigError("invalid config (model_copy(update=...) does not validate what it sets): "
                              + "; ".join(_describe(e, type(cfg), data))) from None
    _check_sections(cfg, fresh, "")


def _check_sections(cfg: BaseModel, fresh: BaseModel, prefix: str) -> None:
    for name in type(fresh).model_fields:
        top = (prefix + name).split(".")[0]  # the example below updates a top-level section
        want, got = getattr(fresh, name), getattr(cfg, name, None)
        if isinstance(want, BaseModel):
            if not isinstance(got, type(want)):
                raise ConfigError(f"config section {prefix}{name} is a {type(got).__name__}, not a "
                                  f"{type(want).__name__}: model_copy(update=...) sets values as given; "
                                  f"update a section with its own model_copy, e.g. "
                                  f"cfg.model_copy(update={{{top!r}: cfg.{top}.model_copy(update={{...}})}}), "
                                  f"or build the config with load_config(..., overrides=[...])")
            _check_sections(got, want, f"{prefix}{name}.")


# --------------------------------------------------------------------------- error messages


def _describe(error: ValidationError, cls: type[BaseModel], data: dict) -> list[str]:
    lines = []
    for err in error.errors():
        loc = _error_loc(err, data)
        key = ".".join(str(p) for p in loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            known = _known_keys(cls, data, loc[:-1])
            hint = difflib.get_close_matches(str(loc[-1]), known, n=1)
            msg = f"unknown key {key!r}"
            if hint:
                msg += f" (did you mean {'.'.join([*map(str, loc[:-1]), hint[0]])!r}?)"
            elif known:
                msg += f" (allowed here: {', '.join(sorted(known))})"
        elif (err["type"] in ("model_attributes_type", "model_type") and isinstance(err.get("input"), str)
              and "type" in _known_keys(cls, data, loc)):  # `method: axpo`, for `method: {type: axpo}`
            got = err["input"]
            msg = f"{key}: {got!r} is given where a mapping is due: write `{key}: {{type: {got}}}` in a file, or --set {key}.type={got}"
        elif err["type"] in ("model_type", "model_attributes_type") and err.get("input", "") is None:
            # `optim:` with every key under it commented out, or --set optim=null
            msg = f"{key} is empty (null) where a section is due: leave {key} out for its defaults"
        else:
            text = err["msg"].removeprefix("Value error, ")  # pydantic's prefix to a validator's message
            msg = f"{key}: {text}"
            if err["type"] not in ("missing",) and "input" in err and not isinstance(err["input"], dict):
                msg += f" (got {err['input']!r}){_input_note(err['type'], err['input'])}"
        lines.append(msg)
    return lines


def _input_note(kind: str, got: Any) -> str:
    """Why a value YAML read is not the one meant, where that shows: a Python None (YAML's null
    is null or ~), or a name or tag YAML read as a number or a boolean (2024, 1e-5, true)."""
    if got in ("None", "none"):
        return ": 'None' is a string in YAML; null (or ~) is none"
    if kind == "string_type" and isinstance(got, int | float):  # bool is an int
        read = "a boolean" if isinstance(got, bool) else "an integer" if isinstance(got, int) else "a number"
        return f": YAML read it as {read}; quote it to give a string (\"...\")"
    return ""


def _error_loc(err: dict, data: Any) -> list:
    """The key path of one pydantic error, down to the key a section validator named."""
    loc = _clean_loc(err["loc"], data)
    cause = (err.get("ctx") or {}).get("error")
    return [*loc, cause.key] if isinstance(cause, KeyValueError) else loc


def _clean_loc(loc: tuple, data: Any) -> list:
    """Drop the union tags pydantic inserts ("method.grpo.loss" -> "method.loss")."""
    out, node = [], data
    for part in loc:
        if isinstance(node, dict) and part not in node and node.get("type") == part:
            continue
        out.append(part)
        node = node.get(part) if isinstance(node, dict) else None
    return out


def _known_keys(cls: type[BaseModel], data: Any, loc: list) -> list[str]:
    """Field names of the section at `loc`, following unions by the data's `type`."""
    model: Any = cls
    node = data
    for part in loc:
        node = node.get(part) if isinstance(node, dict) else None
        field = model.model_fields.get(part) if isinstance(model, type) else None
        if field is None:
            return []
        model = _resolve(field.annotation, node)
    if _is_model(model):
        return list(model.model_fields)
    return []


def _resolve(annotation: Any, node: Any) -> Any:
    import typing

    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Annotated:
        return _resolve(args[0], node)
    if args:
        models = [a for a in args if _is_model(a)]
        tag = node.get("type") if isinstance(node, dict) else None
        for m in models:
            f = m.model_fields.get("type")
            if f is not None and tag is not None and f.default == tag:
                return m
        return models[0] if models else None
    return annotation
