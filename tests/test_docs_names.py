"""README.md, docs/*.md and the comments of configs/*/*.yaml name config keys
(`rollout.num_generations`, `--set method.loss.type=dapo`), files (`configs/vlm/axpo.yaml`),
Python names (`mmrl.core.cli.run`), tests (`tests/test_lora.py::test_x`) and CLI options
(`mmrl train --resume`). Each must exist, and a key's value must fit its field, so that renaming
or moving one fails here instead of leaving the docs pointing at nothing. (docs/migrating.md's
tables have their own test, tests/test_migrating_doc.py; benchmarks/RESULTS.md is a historical
record and is not read.)

The docs are parsed once: inline code spans, fenced command lines and YAML blocks for keys and
options, the whole text for files, Python names and tests. Placeholders (RUN/..., `<tmp>`, `...`)
are not names and are skipped. Nothing is run: the source is read, the config classes walked."""

from __future__ import annotations

import fnmatch
import functools
import importlib
import json
import re
from pathlib import Path

import pytest
import typer
import yaml
from doc_keys import CLI_MODULES, fields_of, settings, value_error

from mmrl.core.config import ConfigError, parse_override

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Names the docs give on purpose that are not (or no longer) there, each with its reason.
ALLOWED = {
    "model.kind": "docs/errors.md: the example of an unknown key",
    "optim.lrr": "docs/errors.md: the example of a misspelt key",
    "rollout.gen_lenght": "docs/errors.md: the example of a misspelt key",
    "task.kinds.x": "docs/errors.md: the example of --keys through a field that is no section",
    "configs/dllm/nosuch.yaml": "docs/errors.md: the example of a missing config file",
    "configs/mine/dapo_lr5e-6.yaml": "README.md: a config of one's own, written in the example",
    "mmrl/_bundled/": "where setup.py puts configs/ and assets/ in a wheel; not in the repository",
    "docs/algo/grpo.md": "docs/migrating.md: a file of verl's repository",
    "configs/rl_llada.yaml": "docs/migrating.md: a file of dLLM-RL's repository",
    "configs/rl_sdar.yaml": "docs/migrating.md: a file of dLLM-RL's repository",
}
BAD_VALUES_SHOWN = {  # docs whose `--set key=value` examples are the bad inputs they describe
    "docs/errors.md",
}

COMMANDS = {"mmrl": "mmrl", "diffusion-rl": "diffusion-rl", "dllm-rl": "dllm-rl",
            "diffusion_rl": "diffusion-rl", "dllm_rl": "dllm-rl"}  # `python -m dllm_rl train`
MODALITY = {"vlm": "mmrl", "diffusion": "diffusion-rl", "dllm": "dllm-rl"}  # configs/<modality>/
PLACEHOLDER = re.compile(r"\.\.\.|…|<|>|\*|\$|\{|[A-Z]{2,}/|\bN\b")
PATH = re.compile(r"(?<![\w/.-])((?:configs|assets|mmrl|diffusion_rl|dllm_rl|benchmarks|tests|docs|scripts)"
                  r"/[\w./*<>…-]*)")
SET = re.compile(r"--set[ =](?:'([^']*)'|\"([^\"]*)\"|(\S+))")
KEYS = re.compile(r"--keys[ =]([\w.]+)")


# --- the docs, parsed once ------------------------------------------------------------------

def _paragraphs(text: str):
    """(first line number, text, fence language or None) of each paragraph, table row and line
    of a fenced block (a yaml block comes whole)."""
    block: list[str] = []
    start, fence = 0, None
    for n, line in enumerate(text.splitlines() + [""], 1):
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip() or "text"
            if fence == "yaml":
                start, block = n + 1, []
            elif fence is None and block:  # the end of a yaml block
                yield start, "\n".join(block), "yaml"
                block = []
            continue
        if fence == "yaml":
            block.append(line)
        elif fence or line.startswith("|") or not line.strip():
            if block:
                yield start, " ".join(block), None
                block = []
            if fence or line.startswith("|"):
                yield n, line, fence
        else:
            start = start if block else n
            block.append(line)


@functools.cache
def docs() -> list[tuple[str, int, str, str | None, list[str]]]:
    """(doc, line, text, fence language or None, spans) for each paragraph of each doc, and each
    comment of configs/*/*.yaml: its inline code spans, or the line of a command block (a python
    block has none: its dotted names are Python's)."""
    out = []
    for path in DOCS:
        for line, text, fence in _paragraphs(path.read_text()):
            if fence:
                spans = [text] if fence not in ("python", "yaml") else []
            else:
                spans = re.findall(r"`([^`]+)`", text.replace("\\|", "|"))
            out.append((str(path.relative_to(ROOT)), line, text, fence, spans))
    for path in sorted(ROOT.glob("configs/*/*.yaml")):  # each comment of a config, as prose
        for line, text in enumerate(path.read_text().splitlines(), 1):
            if "#" in text:
                comment = text.partition("#")[2]
                out.append((str(path.relative_to(ROOT)), line, comment, None, re.findall(r"`([^`]+)`", comment)))
    return out


# --- config keys ----------------------------------------------------------------------------

@functools.cache
def config_classes() -> dict[str, type]:
    return {command: settings(command).CONFIG_CLASS for command in CLI_MODULES}


def command_of(span: str) -> str | None:
    """The command line a span is for: the command it runs, or the modality of its config file."""
    if m := re.search(r"(?:^|python -m |\s)(mmrl|diffusion-rl|dllm-rl|diffusion_rl|dllm_rl)\s+[a-z]", span):
        return COMMANDS[m.group(1)]
    if m := re.search(r"configs/(vlm|diffusion|dllm)/", span):
        return MODALITY[m.group(1)]
    return None


def keys_in(span: str) -> list[tuple[str, str | None]]:
    """The (key, value or None) pairs a span names: each `--set key=value` (and `--keys key`), each
    dotted key (`rollout.num_generations`, `method.loss.type: dapo` where the span starts with it,
    `task.type=jsonl`), and `method.{rows, kl.beta}` for method.rows and method.kl.beta. A quoted
    output line (error:, warning:, one cut with ...) gives its --set keys only: its dotted names
    may be weights'."""
    sections = {name for cls in config_classes().values() for name in cls.model_fields}
    out = []
    for m in SET.finditer(span):
        key, sep, value = next(g for g in m.groups() if g is not None).partition("=")
        out.append((key, value if sep else None))
    rest = KEYS.sub(" ", SET.sub(" ", span))
    out += [(m.group(1), None) for m in KEYS.finditer(span)]
    if not re.match(r"(error|warning|UserWarning)", rest) and not re.search(r"\.\.\.|…", rest):
        for m in re.finditer(r"(?<![\w./-])([a-z_]+)\.\{([\w., ]+)\}", rest):
            out += [(f"{m.group(1)}.{name.strip()}", None) for name in m.group(2).split(",")]
        for m in re.finditer(r"(?<![\w./-])([a-z_]+(?:\.[a-z0-9_]+)+)(?:=(\S+)|(: )(.*))?(?![\w/(-])", rest):
            value = m.group(2) or (m.group(4) if m.start() == 0 else None)
            if not re.search(r"\.(py|json|jsonl|yaml|safetensors|md|html|txt|png|bin|pt)$", m.group(1)):
                out.append((m.group(1), value))  # a file name is not a key
    # base: a config file's key, not a setting; an upper-case part (method.loss.KEY) a placeholder
    return [(k, v) for k, v in out if k.split(".")[0] in sections and k != "base" and k.islower()]


def yaml_keys(text: str) -> list[tuple[str, str | None]]:
    """The dotted keys of a YAML config block (`model: {lora: {r: 16}}` gives model.lora.r), with
    their values."""
    def walk(data, prefix):
        for name, value in data.items():
            if isinstance(value, dict) and value:
                yield from walk(value, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}", json.dumps(value)
    data = yaml.safe_load(text)
    if "plugins" in data:
        return []  # a plugin's method: its keys are its own
    return [(k, v) for k, v in walk(data, "") if k != "base"]  # base: the file's key, not a setting


def key_error(key: str, value: str | None, command: str | None, check_value: bool) -> str | None:
    """Why `key` (with `value`) is not a setting of `command` (any command where None)."""
    classes = config_classes()
    fields = [f for c, cls in classes.items() if command in (None, c) for f in fields_of(cls, key)]
    if not fields:
        return f"{key}: no such key in {command or 'any command'}'s config"
    if value is None or not check_value or PLACEHOLDER.search(value) or not value:
        return None
    for one in value.split(" | "):  # `method.scale: group | none`: the values it takes
        try:
            error = value_error(fields, parse_override(f"{key}={one}")[1])
        except ConfigError as e:
            error = str(e)
        if error:
            return f"{key}={one}: {error}"
    return None


def test_every_config_key_the_docs_name_is_a_setting():
    bad, checked = [], 0
    for doc, line, text, fence, spans in docs():
        if doc == "docs/migrating.md" and text.startswith("|"):
            continue  # its tables: other codes' keys, and ours, which test_migrating_doc.py checks
        found = [(span, keys_in(span)) for span in spans]
        if fence == "yaml":
            found = [(text, yaml_keys(text))]
        elif not fence:  # the prose around the code spans
            found.append(("", [(k, None) for k, _ in keys_in(re.sub(r"`[^`]*`", " ", text))]))
        for span, keys in found:
            for key, value in keys:
                if key in ALLOWED:
                    continue
                checked += 1
                if error := key_error(key, value, command_of(span), doc not in BAD_VALUES_SHOWN):
                    bad.append(f"{doc}:{line}: {error}")
    assert checked > 500, checked  # the spans were parsed
    assert not bad, f"{len(bad)} of {checked} config keys the docs name are not settings:\n" + "\n".join(bad)


# --- files ----------------------------------------------------------------------------------

def test_every_file_the_docs_name_exists():
    bad, checked = [], 0
    for doc, line, text, _, _ in docs():
        names = [m.group(1) for m in PATH.finditer(text)]
        links = [t for t in re.findall(r"\]\(([^)#\s]+)", text) if "://" not in t]
        for name in names + [str((ROOT / doc).parent.relative_to(ROOT) / t) for t in links]:
            name = name.split("::")[0].rstrip(".,:;)")
            if PLACEHOLDER.search(name) or name in ALLOWED:
                continue
            checked += 1
            if not (ROOT / name).exists():
                bad.append(f"{doc}:{line}: {name}")
    assert checked > 100, checked
    assert not bad, f"{len(bad)} of {checked} files the docs name do not exist:\n" + "\n".join(bad)


# --- Python names -------------------------------------------------------------------------

def python_name_error(name: str) -> str | None:
    """Why `name` (`mmrl.core.cli.run`, a module and what it defines) is not in the source: its
    longest module prefix must be a file, the next part defined in it (read, not imported)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        source = next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)
        if source is None:
            continue
        if i == len(parts):
            return None
        attr = re.escape(parts[i])
        defined = rf"^\s*(?:async def|def|class)\s+{attr}\b|^{attr}\s*[:=]|^from .* import .*\b{attr}\b|^\s+{attr},"
        if re.search(defined, source.read_text(), flags=re.MULTILINE):
            return None
        return f"{name}: {source.relative_to(ROOT)} defines no {parts[i]}"
    return f"{name}: no such module"


def test_every_python_name_the_docs_give_is_defined():
    """`dllm_rl.models.load_mask_predictor`, `mmrl.core.serve`, and a README recipe's
    `from mmrl.core.rewards import reward_atom`."""
    bad, checked = [], 0
    for doc, line, text, _, _ in docs():
        names = re.findall(r"(?<![\w./])((?:mmrl|diffusion_rl|dllm_rl)\.[A-Za-z_][\w.]*\w)", text)
        for module, imported in re.findall(r"from ((?:mmrl|diffusion_rl|dllm_rl)[\w.]*) import ([\w, ]+)", text):
            names += [f"{module}.{n.strip()}" for n in imported.split(",") if n.strip()]
        for name in names:
            checked += 1
            if error := python_name_error(name):
                bad.append(f"{doc}:{line}: {error}")
    assert checked > 30, checked
    assert not bad, f"{len(bad)} of {checked} Python names the docs give are not defined:\n" + "\n".join(bad)


# --- tests ----------------------------------------------------------------------------------

@functools.cache
def defined_in(path: str) -> frozenset[str]:
    """The test functions (and classes) defined in `path` (read, not imported)."""
    return frozenset(re.findall(r"^\s*(?:async def|def|class) (\w+)", (ROOT / path).read_text(), flags=re.MULTILINE))


@functools.cache
def named_test_file(name: str) -> str | None:
    """`tests/x/test_y.py`, or a file named without its folder (`test_signal_stop.py`) where
    one test file has that name."""
    if name.startswith("tests/"):
        return name
    found = list(ROOT.glob(f"tests/**/{name}"))
    return str(found[0].relative_to(ROOT)) if len(found) == 1 else None


def test_every_test_the_docs_name_is_defined():
    """`tests/x.py::test_y` (and `::test_y[param]`: the function is checked). In docs/errors.md's
    test column a `::test_z` continues the cell's last file, and a bare `test_rows[...]` names a
    test of that file or of the section's: tests/reliability/test_bad_inputs.py, or the one its
    preamble names ("Tests are in tests/test_serve.py unless another file is named")."""
    bad, checked = [], 0
    default = None
    for doc, line, text, _, _ in docs():
        if doc == "docs/errors.md" and text.startswith("#"):
            default = "tests/reliability/test_bad_inputs.py"
        elif m := re.search(r"Tests are in (tests/[\w/]+\.py)", text):
            default = m.group(1)
        table = doc == "docs/errors.md" and text.startswith("|")
        cell = re.split(r"(?<!\\)\|", text)[-2] if table and text.count("|") > 5 else text
        file = default if table else None
        # names in the order they come; bare names (test_rows[...]) in errors.md's test column only
        bare = r"|(?<![\w:/])(test_\w+)(?![\w.])" if table else ""
        for m in re.finditer(rf"((?:tests/)?[\w/]*test_\w+\.py)?(?:::([\w*]+){bare})", cell):
            file = named_test_file(m.group(1)) if m.group(1) else file
            name = m.group(2) or (m.group(3) if table else None)
            if name is None or file is None:
                continue
            # a bare name is the cell's last file's (`tests/x.py::a, b`) or the section's file's
            owners = [file] if m.group(2) else [file, default]
            checked += 1
            if not any((ROOT / f).is_file() and fnmatch.filter(defined_in(f), name) for f in owners if f):
                bad.append(f"{doc}:{line}: {file}::{name}")
    assert checked > 100, checked
    assert not bad, f"{len(bad)} of {checked} tests the docs name are not defined:\n" + "\n".join(bad)


# --- CLI options ----------------------------------------------------------------------------

@functools.cache
def options() -> dict[str, dict[str, set[str]]]:
    """command -> verb -> its options (long and short), read from the typer apps."""
    out = {}
    for command, module in CLI_MODULES.items():
        group = typer.main.get_command(importlib.import_module(module).app)
        out[command] = {verb: {o for p in cmd.params for o in p.opts + p.secondary_opts} | {"--help"}
                        for verb, cmd in group.commands.items()}
    return out


def option_errors(span: str) -> tuple[int, list[str]]:
    """(options checked, what is wrong) in a span's commands: `mmrl VERB --opt ...` up to the
    command's end, `python -m dllm_rl VERB`, `<cli> VERB --opt` (any command's) and a span that
    starts with a verb and an option (`runs --group`: any command's)."""
    verbs = {verb for command in options().values() for verb in command}
    checked, bad = 0, []
    for m in re.finditer(r"(?:^|[\s(])(mmrl|diffusion-rl|dllm-rl|<cli>|<command>|python -m \w+|(?=[a-z-]+ --?\w))\s*"
                         r"([a-z][\w-]*)([^|;&)]*)", span):
        command, verb = COMMANDS.get(m.group(1).removeprefix("python -m ")), m.group(2)
        if command is None and (verb not in verbs or m.group(1).startswith("python")):
            continue  # not one of ours: `python -m pytest`, `srun torchrun ...`
        if command and verb not in options()[command]:
            if verb in verbs:  # `mmrl calibrate-window`: another command's verb
                bad.append(f"{command} has no verb {verb}")
            continue
        for opt in re.findall(r"(?:^|\s)(--?[a-zA-Z][\w-]*)", m.group(3)):
            checked += 1
            if not any(opt in verbs_of.get(verb, ()) for c, verbs_of in options().items() if command in (None, c)):
                bad.append(f"{command or 'no command'}'s {verb} has no option {opt}")
    return checked, bad


def test_every_cli_option_the_docs_give_a_command_exists():
    bad, checked = [], 0
    for doc, line, _, _, spans in docs():
        for span in spans:
            n, errors = option_errors(span)
            checked += n
            bad += [f"{doc}:{line}: {e}" for e in errors]
    assert checked > 100, checked
    assert not bad, f"{len(bad)} of {checked} CLI options the docs name do not exist:\n" + "\n".join(bad)


def test_the_option_reader():
    assert option_errors("mmrl train --resume -c x.yaml --set 'a=[1, -2]' | head -3") == (3, [])
    assert option_errors("dllm-rl calibrate-window --out x") == (0, ["dllm-rl has no verb calibrate-window"])
    assert option_errors("runs --group -m reward") == (2, [])
    assert option_errors("<cli> serve --hots h") == (1, ["no command's serve has no option --hots"])
    assert option_errors("python -m pytest -q -x") == (0, [])


def test_every_allowed_name_is_still_in_the_docs():
    """An allowance the docs no longer need goes, so that it cannot hide a name later."""
    text = "\n".join(text for _, _, text, _, _ in docs())
    assert not [name for name in ALLOWED if name not in text]


@pytest.mark.parametrize("span, keys", [
    ("mmrl train --set rollout.num_generations=4 --set 'a.b=[1]'", [("rollout.num_generations", "4")]),
    ("method.loss.type: dapo", [("method.loss.type", "dapo")]),
    ("task.type=jsonl task.num_train=8", [("task.type", "jsonl"), ("task.num_train", "8")]),
    ("method.{rows, kl.beta}", [("method.rows", None), ("method.kl.beta", None)]),
    ("model.safetensors", []),  # a file
    ("error: model.path: missing model.visual.blocks.2 ...", []),  # output: weights' names
    ("--set method.loss.KEY=VALUE", []),  # a placeholder
])
def test_the_key_reader(span, keys):
    assert keys_in(span) == keys


def test_the_key_check_names_a_misspelt_key_and_a_bad_value():
    assert key_error("rollout.num_generations", "4", "mmrl", True) is None
    assert key_error("task.options.digits", "[1, 2]", "dllm-rl", True) is None  # a free-form mapping
    assert key_error("method.g_steps", "50", None, True) is None  # a key of one method type (ftfc)
    assert key_error("method.g_steps", None, "mmrl", True) == "method.g_steps: no such key in mmrl's config"
    assert "valid number" in key_error("optim.lr", "abc", "mmrl", True)
    assert key_error("method.scale", "group | nope", "dllm-rl", True).startswith("method.scale=nope: ")
    assert yaml_keys("base: a.yaml\nmodel: {lora: {r: 16}}") == [("model.lora.r", "16")]
