"""`plugins`: a user's own methods on the command lines.

A plugin is a Python file that registers a method (`@register_method("name")` on a Method
subclass) and, for the method's own settings, defines CONFIG_CLASS: a subclass of the backend's
config class whose `method` union takes the method's config class (README, "a method of your
own"). A config names its plugins (`plugins: [my_method.py]`), so `--resume`, `eval` and
`sample` on the run find them again in its config.yaml, where the path is stored absolute.

Security: a config file is code. Importing a plugin runs it with the user's rights, as do
the Python files a config names for reward atoms ("file.py:fn") and tools, and the model code
that `model.trust_remote_code: true` lets a model directory bring. A run directory's
config.yaml is a config too: `train --resume`, `eval`, `sample`, `serve` and `demo` on a run
(or on any checkpoint inside one) import what it names. Use configs and runs you trust.

The plugin list is read from the raw settings (defaults, the config file, --set) before they
are validated, since validation needs the plugin's config class. Each file is imported once per
process, also where a reward atom spec names it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from mmrl.core.config import (
    ConfigError,
    TrainConfig,
    apply_overrides,
    deep_merge,
    read_config_file,
)
from mmrl.core.runconfig import resolve_file


def requested(path: str | Path | None, overrides: list[str], defaults: dict) -> list[str]:
    """The `plugins` the raw settings name: --set over the config file over the defaults."""
    data = dict(defaults)
    if path is not None:
        with warnings.catch_warnings():  # an unset variable is said once, by load_config
            warnings.simplefilter("ignore")
            data = deep_merge(data, read_config_file(path))  # `plugins: [$PROJECT/my_method.py]`, a base's plugins
    plugins = apply_overrides(data, [o for o in overrides if o.split("=", 1)[0].strip() == "plugins"]).get("plugins")
    if plugins in (None, []):
        return []
    if not isinstance(plugins, list) or not all(isinstance(p, str) and p for p in plugins):
        raise ConfigError(f"plugins: a list of Python file paths is needed, got {plugins!r}")
    return plugins


def load(plugins: list[str], base_dir: str | Path | None) -> list[Any]:
    """Import each plugin file (once per process); a file that is missing or fails to import is
    a ConfigError naming it."""
    if not plugins:  # nothing to import, nor torch (mmrl.core.method and rewards import it): `config`
        return []
    from mmrl.core.method import METHODS
    from mmrl.core.rewards import PLUGIN_MODULES, import_python_file

    _imported = PLUGIN_MODULES  # shared: a reward atom spec naming a plugin's file uses its module

    modules = []
    for name, found in zip(plugins, absolute(plugins, base_dir)):
        path = Path(found)
        if not path.is_file():
            unset = " (it names an environment variable that is not set)" if "$" in name else ""
            raise ConfigError(f"plugins: {name!r}: file not found: {path}{unset}")
        if path not in _imported:
            registered = dict(METHODS)
            try:
                _imported[path] = import_python_file(path, f"plugins: {name!r}")
            except ValueError as e:
                METHODS.clear()  # what it registered before failing goes with it
                METHODS.update(registered)
                raise ConfigError(str(e)) from None
        if _imported[path] not in modules:  # one file named twice (or two spellings of it) is one plugin
            modules.append(_imported[path])
    return modules


def absolute(plugins: list[str], base_dir: str | Path | None) -> list[str]:
    """The plugin paths made absolute, as `load` finds them (for configs handed to other processes)."""
    return [str(resolve_file(name, base_dir).resolve()) for name in plugins]


def config_class(base: type[TrainConfig], path: str | Path | None, overrides: list[str],
                 defaults: dict) -> type[TrainConfig]:
    """`base`, or the CONFIG_CLASS of the plugins the settings name (at most one may define it,
    and it must extend `base`)."""
    base_dir = Path(path).resolve().parent if path is not None else None
    modules = load(requested(path, overrides, defaults), base_dir)
    classes = [(m.__file__, m.CONFIG_CLASS) for m in modules if hasattr(m, "CONFIG_CLASS")]
    if not classes:
        return base
    if len(classes) > 1:
        raise ConfigError(f"plugins: {len(classes)} files define CONFIG_CLASS ({', '.join(f for f, _ in classes)}); "
                          "one config class can read a config")
    file, cls = classes[0]
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(f"plugins: {file}: CONFIG_CLASS must be a subclass of {base.__name__}, got {cls!r}")
    return cls


def __getattr__(name: str) -> Any:
    """`plugins._imported` (tests), the files imported so far, as when it was a module global."""
    if name == "_imported":
        from mmrl.core.rewards import PLUGIN_MODULES

        return PLUGIN_MODULES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
