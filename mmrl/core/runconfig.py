"""A run's config.yaml: written with its file paths absolute, and read back as the base
config of `train --resume` and of `eval`, `sample` and `serve` on the run's checkpoints.

Precedence, lowest first: the embedded default, the run's config.yaml, a verb's defaults
(EVAL_DEFAULTS), --config, --set. So `train --resume -o RUN` continues the run as it was
configured, and `eval --checkpoint RUN` evaluates the run's model on the run's task, without
repeating a flag.

Relative paths in a config (task files, reward-atom and tool files "file.py:name", model
directories) resolve against the config file's directory or the working directory. The
record is read from elsewhere (the run directory, another working directory), so it holds
every such path that exists, made absolute (`absolute_paths`).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import yaml

from mmrl.core.config import ConfigError

RUN_CONFIG = "config.yaml"

def _repository() -> Path:
    """Where assets/ (the bundled tiny models) and configs/ live: the root of a source checkout
    (an editable install's); in a non-editable install, the copy its wheel carries as
    mmrl/_bundled/ (setup.py). An install built without it falls back to site-packages, which
    has neither, and its errors say so (not_installed_note)."""
    source, wheel = Path(__file__).resolve().parents[2], Path(__file__).resolve().parents[1] / "_bundled"
    return wheel if not (source / "pyproject.toml").is_file() and wheel.is_dir() else source


REPOSITORY = _repository()
_FILE_SUFFIXES = (".py", ".json", ".jsonl", ".txt", ".yaml", ".yml")


def _roots(base_dir: str | Path | None) -> list[Path]:
    """Where a relative path in a config is looked for: the config file's directory, then the
    working directory."""
    return ([Path(base_dir)] if base_dir else []) + [Path.cwd()]


def absolute_paths(data: Any, base_dir: str | Path | None) -> Any:
    """`data` (a config dump) with each relative path that names an existing file or directory
    (under base_dir first, else the working directory) made absolute. A path is a string with
    a "/" or a file suffix; in "file.py:name" the file part. Nothing else changes."""
    roots = _roots(base_dir)

    def fix(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: fix(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fix(v) for v in value]
        if not isinstance(value, str):
            return value
        file, sep, name = value.partition(":") if ".py:" in value else (value, "", "")
        if Path(file).is_absolute() or not ("/" in file or file.endswith(_FILE_SUFFIXES)):
            return value
        for root in roots:
            if (root / file).exists():
                return str((root / file).resolve()) + sep + name
        return value

    return fix(data)


def resolve_file(path: str | Path, base_dir: str | Path | None = None) -> Path:
    """A data file named in a config: absolute as given; a relative one from the config file's
    directory, else the working directory; where neither holds it, the first (for the error)."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    roots = _roots(base_dir)
    return next((root / p for root in roots if (root / p).exists()), roots[0] / p)


def resolve_dir(path: str | Path, base_dir: str | Path | None = None) -> Path:
    """A directory named in a config (model.path): absolute as given; a relative one from the
    config file's directory, else the working directory, else the repository (so configs can
    name "assets/..." from anywhere). As given where none holds it (the caller says so)."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    roots = [*_roots(base_dir), REPOSITORY]
    return next((root / p for root in roots if (root / p).is_dir()), p)


def resolve_config_file(path: str | Path) -> Path:
    """A --config file: as given (absolute, or from the working directory); a relative one the
    working directory does not hold from the repository, so `--config configs/vlm/dapo.yaml`
    works from anywhere, as model.path "assets/..." does. As given where neither holds it."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists() or not (REPOSITORY / p).is_file():
        return p
    return REPOSITORY / p


def bundled(name: str) -> Path:
    """The bundled tiny model `name` (a directory of the repository's assets/)."""
    return REPOSITORY / "assets" / name


def not_installed_note(path: str | Path) -> str:
    """Why `path`, under the repository's assets/ or configs/ (absolute, or relative as a config
    names it), is missing where the whole of assets/ or configs/ is: an install built without
    them (a wheel built other than by setup.py). "" where the directory is there (a source
    checkout, a wheel's bundle: then only `path` is missing), or for any other path."""
    p = Path(path).expanduser()
    if p.is_absolute():
        try:
            p = p.resolve().relative_to(REPOSITORY)
        except ValueError:
            return ""
    top = p.parts[0] if p.parts else ""
    if top not in ("assets", "configs") or (REPOSITORY / top).is_dir():  # there: just this path is missing
        return ""
    other = ", or set model.path to a model directory" if top == "assets" else ""
    return (f" ({top}/ is not in this install of mmrl: it ships with the source repository; clone it and "
            f"`pip install -e .` there{other})")


def model_dir_note(path: str | Path) -> str:
    """What model.path likely meant where `path` is no from_pretrained directory: the directory
    of a file given (its config.json, a weights file), or a snapshot of a Hugging Face cache
    entry given whole (models--org--name holds blobs/, refs/ and snapshots/<commit>/, the
    from_pretrained directory). "" for any other path."""
    p = Path(path).expanduser()
    if p.is_file():
        return (f" (it is a file: model.path takes the directory that holds config.json, the weights and "
                f"the tokenizer; this file's is {p.parent})")
    snapshots = p / "snapshots"
    if not snapshots.is_dir():
        return ""
    ref = p / "refs" / "main"  # the commit that "main" resolved to when the model was downloaded
    main = snapshots / ref.read_text().strip() if ref.is_file() else None
    if main is not None and main.is_dir():
        return f" (a Hugging Face cache entry: its model directory is the snapshot {main})"
    found = sorted(d for d in snapshots.iterdir() if d.is_dir())
    if not found:
        return " (a Hugging Face cache entry with no snapshot downloaded)"
    return f" (a Hugging Face cache entry: its model directory is one of its snapshots, e.g. {found[0]})"


def run_dir_of(path: str | Path) -> Path | None:
    """The run directory `path` lies in: a run, its checkpoints/, a step-*/ or its model/;
    the nearest of them and their parents that holds config.yaml and checkpoints/."""
    path = Path(path).resolve()
    for d in (path, *path.parents):
        if (d / RUN_CONFIG).is_file() and (d / "checkpoints").is_dir():
            return d
    return None


def _architecture(model_dir: Path) -> dict | None:
    """A model directory's config.json (a diffusers pipeline's transformer/config.json) without
    what says where and by which library version it was saved; None for none (a LoRA adapter)."""
    for f in (model_dir / "transformer" / "config.json", model_dir / "config.json"):
        if f.is_file():
            try:
                data = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return None
            ignored = ("transformers_version", "torch_dtype", "dtype")
            return {k: v for k, v in data.items() if not k.startswith("_") and k not in ignored} \
                if isinstance(data, dict) else None
    return None


def bundled_model_note(model_path: str | None, model_dir: str | Path, resume: bool = False) -> str:
    """What to do where a checkpoint's weights (`model_dir`) do not fit the model built for them
    and that model is the bundled tiny one (`model_path` None): model.path null names the bundled
    model of the mmrl that runs, and an older mmrl bundled another (assets/tiny-flow was a
    pixel-space model until 2026-11-30, a latent one since), so a run it made holds weights of
    another shape. A checkpoint holds its whole model: eval, sample and export can load that as
    model.path; a resume cannot go on exactly (its starting model, the KL reference, is gone), but a
    new run can start from it. "" where model.path names a model, or the checkpoint is a LoRA
    adapter or of a model that is bundled today (the mismatch is something else: its message stands)."""
    if model_path is not None:
        return ""
    model_dir = Path(model_dir)
    theirs = _architecture(model_dir)
    if theirs is None:
        return ""
    same = [d for d in sorted((REPOSITORY / "assets").iterdir()) if d.is_dir() and _architecture(d) == theirs]
    if any(d.name in _BUNDLED_DEFAULTS for d in same):  # today's bundled model: the mismatch is something else
        return ""
    why = ("; the run trained the bundled tiny model (model.path null) of the older mmrl that made it, and this "
           "mmrl bundles another")
    if same:  # an older bundled model kept under another name (assets/tiny-flow-pixel: tiny-flow until 2026-11-30)
        return (f"{why}; {same[0]} has the run's architecture (the model it started from, where the older mmrl "
                f"bundled it): pass --set model.path={same[0]}")
    if resume:
        return (f"{why}: this mmrl cannot resume it (its starting model, the KL reference, is gone); go on from its "
                f"checkpoint as a new run: train --set model.path={model_dir} -o NEW_DIR, or resume it with the mmrl "
                f"version that made it")
    return f"{why}: load the checkpoint as the whole model with --set model.path={model_dir}"


# The models model.path null builds (each backend's bundled default).
_BUNDLED_DEFAULTS = ("tiny-qwen2.5-vl", "tiny-dllm", "tiny-flow")


# Settings an older mmrl wrote into every run's config.yaml as its defaults, in a section that
# its switch leaves off: (section, switch, {key: that default}). This mmrl's defaults differ, so
# its config warned of them as set and unused at each eval, sample and --resume of such a run,
# as if the user had set them. Off, they change nothing: a run's config is read without them.
_OLD_DEFAULTS_WHEN_OFF = (
    ("method.fastrl", "enabled", {"ngram": 2, "ars": True}),  # FastRL's defaults until 2026-12-02
)


# Settings added since a run was made whose default is not what the run did: (section, its type,
# key, the value that does what the older mmrl did). A run's config lacks the key, and read
# with the default it evaluated (and resumed) on other prompts than it had, without a word.
_ADDED_SINCE = (
    # 2026-12-05 17:46: held-out prompts disjoint from the training ones; before, both streams
    # drew from the whole space
    ("task", "shapes-geneval", "held_out", "overlapping"),
)


def upgraded(data: dict) -> dict:
    """A run's config (a dict, as its config.yaml holds it) as this mmrl reads it: without the
    older defaults of switched-off sections (_OLD_DEFAULTS_WHEN_OFF), and with the settings
    added since it was made that do what it did (_ADDED_SINCE); `data` itself is left as it is."""
    data = copy.deepcopy(data)
    for section, kind, key, then in _ADDED_SINCE:
        node = data.get(section)
        if isinstance(node, dict) and node.get("type") == kind and key not in node:
            node[key] = then
    for section, switch, defaults in _OLD_DEFAULTS_WHEN_OFF:
        node = data
        for part in section.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(switch) is False:
            for key, value in defaults.items():
                if key in node and node[key] == value:
                    del node[key]
    return data


def read_run_config(run_dir: str | Path) -> dict:
    """The run's config.yaml as a dict (upgraded), or a ConfigError naming it."""
    path = Path(run_dir) / RUN_CONFIG
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read the run's config ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the run's config is not a mapping")
    return upgraded(data)


def code_named(data: Any, key: str = "") -> list[str]:
    """What a run's config (a dict) names that runs Python code when it is loaded: its plugins,
    `file.py` / `file.py:name` values (reward atoms, tools) and trust_remote_code, as
    "key value" strings. A run directory's config.yaml is code, as a config file is."""
    found: list[str] = []
    if isinstance(data, dict):
        for k, v in data.items():
            path = f"{key}.{k}" if key else str(k)
            if path.endswith("trust_remote_code") and v is True:
                found.append(f"{path} true")
            else:
                found += code_named(v, path)
    elif isinstance(data, list):
        for i, v in enumerate(data):
            found += code_named(v, f"{key}[{i}]")
    elif isinstance(data, str) and (key == "plugins" or key.startswith("plugins[")
                                    or re.search(r"\.py(:\w+)?$", data)):
        found.append(f"{key} {data}")
    return found
