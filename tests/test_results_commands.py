"""benchmarks/RESULTS.md's commands still name what exists: a researcher who copies one to
reproduce a row must not meet a config file that moved, a --set key that was renamed or a
script option that is gone. Checked without running anything: every command (the indented
blocks and the inline `...` ones) is read, its --config must exist, its --set overrides must
load onto the config its run uses (mmrl.core.config.load_config: an unknown key or a value
out of bounds fails), its CLI options must be the verb's, and a script's options must be
among the ones its argparse parser defines (read from the script's source, not imported).

RESULTS.md writes placeholders for what a reader fills in (`--seed S`, `-o OUT`,
`--set optim.lr=LR`), alternatives (`posterior|sample`, `{fork,ar}`) and optional parts
(`[--set ...]`): options are checked, the placeholders' values are not."""

from __future__ import annotations

import ast
import copy
import functools
import importlib
import re
import shlex
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import typer

from mmrl.core.config import ConfigError, deep_merge, load_config, read_config_file

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"

# a CLI's modality and the module with its CONFIG_CLASS and DEFAULT_CONFIG (torch-free)
CLIS = {"mmrl": ("vlm", "mmrl.vlm.config", "mmrl.cli"),
        "diffusion-rl": ("diffusion", "diffusion_rl.config", "diffusion_rl.cli"),
        "dllm-rl": ("dllm", "dllm_rl.config", "dllm_rl.cli")}
CLI_ALIASES = {"python -m mmrl": "mmrl", "python -m diffusion_rl": "diffusion-rl", "python -m dllm_rl": "dllm-rl"}
START = re.compile(r"((mmrl|diffusion-rl|dllm-rl|python -m (mmrl|diffusion_rl|dllm_rl)) |"
                   r"(bash|python) (benchmarks|scripts)/\S+\.(py|sh)\b)")

# Each benchmark's --set goes onto configs/<modality>/<method>.yaml for the methods it runs
# (--methods, or --bases for fastrl.py), else for its default methods named here (None: the
# CLI's default config; a dict: by the script's first word).
SCRIPT_CONFIGS = {
    "breakdown.py": None,  # its first word names the modality
    "diffusion_methods.py": ("diffusion", ["flow_grpo", "cast", "ftfc"]),
    "diffusion_gradient_agreement.py": ("diffusion", ["flow_grpo"]),
    "dllm_learning.py": ("dllm", ["diffu_grpo", "tracerl"]),
    "dllm_conventions.py": ("dllm", ["diffu_grpo"]),
    "dllm_sft_ceiling.py": ("dllm", ["diffu_grpo"]),
    "dllm_methods.py": ("dllm", {"samplers": [None], "budget": [None], "fork": ["ar_grpo", "fork_grpo", "diffu_grpo"],
                                 "slim": ["tracerl", "slim_rl"]}),
    "fastrl.py": ("vlm", ["grpo", "dapo", "gspo"]),
    "update_cost.py": ("vlm", ["grpo"]),
    "vlm_axpo.py": ("vlm", ["axpo"]),
    "vlm_methods.py": ("vlm", ["dapo", "vppo"]),
    "master_weights.py": ("vlm", ["grpo"]),
}
METHOD_OPTIONS = ("--methods", "--bases")

# What a placeholder value of a --set stands for, by key: a value to load in its place.
EXAMPLES = {"optim.lr": "1e-4", "rollout.temperature": "0.7", "rollout.stop_at_eos": "true",
            "train.mini_batches": "4", "method.beta": "0.04", "rollout.prompts_per_step": "4",
            "model.path": "assets/tiny-dllm-marked", "task.held_out": "overlapping", "task.eval_path": "prompts.txt"}

# Commands kept as they ran although they no longer load today (deliberately historical): a
# fragment of the command's text -> why it stays. None now; a stale command is fixed instead, with
# a dated "Since then" note where a rerun would run another experiment.
HISTORICAL: dict[str, str] = {}


@dataclass
class Command:
    line: int  # 1-based line in RESULTS.md where it starts
    text: str  # as written, on one line
    words: list[str] = field(default_factory=list)  # after placeholders and brackets are resolved


def _unquote(lines: list[str]) -> list[str]:
    """Blockquoted paragraphs ("> ...") read as the lines they quote."""
    return [re.sub(r"^> ?", "", line) for line in lines]


def commands(text: str) -> list[Command]:
    lines = _unquote(text.splitlines())
    found: list[Command] = []
    variables: dict[str, str] = {}  # VAR="..." of a block, for the $VAR of later commands
    last = None  # the command of the block being read
    # indented blocks: a command, or a variable, with its backslash continuations
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("    "):
            start, joined = i, line.strip()
            while joined.endswith("\\") and i + 1 < len(lines):
                i += 1
                joined = joined[:-1].rstrip() + " " + lines[i].strip()
            # S="...", or a loop's variable (for d in kl pearson: its first value)
            if m := re.fullmatch(r'([A-Z]\w*)="([^"]*)"', joined) or re.match(r"for (\w+) in (\S+)", joined):
                variables[m[1]] = m[2]
            elif START.match(joined):
                found.append(Command(start + 1, joined, words(joined, variables)))
                last = found[-1]
            elif joined.startswith("#") and "--set " in joined and last is not None:
                # a variant of the block's last command, noted under it: "# R3: --set optim.lr=5e-5"
                sets = re.findall(r"--set '?([\w.]+=[^\s']+)", joined)
                sets = [o for o in sets if not placeholder(o.partition("=")[0].split(".")[-1])]
                found.append(Command(start + 1, joined, last.words + [w for o in sets for w in ("--set", o)]))
        elif line.strip():
            last = None
        i += 1
    # inline: a code span (which may run over lines of its paragraph) that starts a command
    flat = "\n".join(lines)
    for m in re.finditer(r"`([^`]+)`", flat):
        span = " ".join(m[1].split())
        if START.match(span):
            line = flat.count("\n", 0, m.start()) + 1
            found.append(Command(line, span, words(span, variables)))
    return sorted(found, key=lambda c: c.line)


def words(text: str, variables: dict[str, str]) -> list[str]:
    text = re.sub(r"(^|\s)#.*", "", text)  # a shell comment
    text = re.sub(r"\$(\w+)", lambda m: variables.get(m[1], m[0]), text)
    out = []
    for word in shlex.split(text):
        word = word.strip("[]") if not re.search(r"=\[.*\]$", word) else word.lstrip("[")
        if word in ("", "...", "ARM"):  # "[ARM]": the arms written under the command, read as its variants
            continue
        word = re.sub(r"\{(\w+),[\w,]+\}", r"\1", word)  # {fork,ar}: the first
        word = re.sub(r"=(\w[\w.\-]*)(\|[\w.\-]+)+$", r"=\1", word)  # posterior|sample: the first
        out.append(word)
    return out


def placeholder(value: str) -> bool:
    """S, LR, OUT, POOL.txt, ...: a value the reader fills in."""
    return value in ("...", "") or "$" in value or bool(re.fullmatch(r"[A-Z][A-Z_0-9]*(\.\w+)?", value))


def config_problems(modality: str, configs: list[Path | None], overrides: list[str]) -> list[str]:
    """Each config file exists, and the overrides load onto each."""
    sets = []
    for o in overrides:
        key, eq, value = o.partition("=")
        if not eq:
            if not placeholder(o):  # --set OVERRIDE: a reader's own
                sets.append(o)  # load_config says what is wrong with it
            continue
        if placeholder(value):
            if key not in EXAMPLES:
                return [f"--set {o}: a placeholder value for {key}, which EXAMPLES has no value for"]
            value = EXAMPLES[key]
        sets.append(f"{key}={value}")
    return [p for config in configs for p in [loads(modality, config, tuple(sets))] if p]


@functools.cache  # each config file parsed once: YAML parsing was most of this test's time
def file_settings(config: Path) -> dict:
    return read_config_file(ROOT / config)


@functools.cache  # many commands repeat one setting
def loads(modality: str, config: Path | None, sets: tuple[str, ...]) -> str | None:
    """What is wrong with the config that --config and --set give, or None."""
    settings = importlib.import_module(CLIS[next(c for c, m in CLIS.items() if m[0] == modality)][1])
    if config is not None and not (ROOT / config).is_file():
        return f"config file {config} does not exist"
    defaults = dict(settings.DEFAULT_CONFIG)
    try:
        if config is not None:  # the file under the overrides, as load_config layers it
            defaults = deep_merge(defaults, copy.deepcopy(file_settings(config)))
        with warnings.catch_warnings():  # a setting the variant leaves unused is said at run time
            warnings.simplefilter("ignore")
            load_config(settings.CONFIG_CLASS, None, list(sets), defaults=defaults)
    except ConfigError as e:
        return f"{config or f'the {modality} default'}: {e}"
    return None


def config_files(modality: str, path: str | None) -> list[Path | None]:
    """configs/dllm/M.yaml (a placeholder method) stands for every config of the modality."""
    if path is None:
        return [None]
    p = Path(path)
    if placeholder(p.stem):
        return sorted(f.relative_to(ROOT) for f in (ROOT / p.parent).glob("*.yaml"))
    return [p]


@functools.cache
def verbs(cli: str):
    """The click commands of a CLI's verbs."""
    return typer.main.get_command(importlib.import_module(cli).app).commands


def cli_problems(words: list[str]) -> list[str]:
    program = words[0]
    if words[:2] == ["python", "-m"]:
        program, words = CLI_ALIASES[" ".join(words[:3])], words[2:]
    modality, _, cli = CLIS[program]
    verb, args = words[1], words[2:]
    if verb not in verbs(cli):
        return [f"{program} has no verb {verb!r}"]
    params = {o: p for p in verbs(cli)[verb].params for o in p.opts + getattr(p, "secondary_opts", [])}
    problems, config, overrides = [], None, []
    it = iter(args)
    for word in it:
        name, eq, value = word.partition("=") if word.startswith("--") else (word, "", "")
        if not name.startswith("-"):
            problems.append(f"{program} {verb} takes no argument {word!r}")
            continue
        if name not in params:
            problems.append(f"{program} {verb} has no option {name}")
            continue
        if not params[name].is_flag and not eq:
            value = next(it, "")
        if name in ("--config", "-c"):
            config = value
        elif name in ("--set", "-s"):
            overrides.append(value)
    if problems:
        return problems
    return config_problems(modality, config_files(modality, config), overrides)


@functools.cache
def script_options(path: Path) -> tuple[set[str], list[str] | None]:
    """The option strings of a script's argparse parser, and its first positional's choices
    (dllm_methods.py's part), read from its add_argument calls."""
    options, choices = set(), None
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant)]
            options.update(n for n in names if n.startswith("-"))
            for k in node.keywords:
                if k.arg == "choices" and names and not names[0].startswith("-") and choices is None:
                    choices = ast.literal_eval(k.value)
    return options, choices


def script_problems(words: list[str]) -> list[str]:
    path = ROOT / words[1]
    if not path.is_file():
        return [f"{words[1]} does not exist"]
    if path.suffix != ".py":
        return []
    options, choices = script_options(path)
    problems, given, name = [], {}, None
    for word in words[2:]:
        if word.startswith("-") and not re.fullmatch(r"-\d.*", word):
            name = word.partition("=")[0]
            # argparse takes a unique prefix of an option
            matches = [o for o in options if o == name] or [o for o in options if o.startswith(name)]
            if len(matches) != 1:
                problems.append(f"{words[1]} has no option {name}")
            name = matches[0] if len(matches) == 1 else name
            given.setdefault(name, [])
            if "=" in word:
                given[name].append(word.partition("=")[2])
        elif name is None:
            given.setdefault("", []).append(word)
        else:
            given[name].append(word)
    positional = given.get("", [])
    if choices is not None and (not positional or positional[0] not in choices):
        problems.append(f"{words[1]} starts with one of {choices}, not {positional[:1]}")
    for word in (w for values in given.values() for w in values):
        if word.endswith(".yaml") and not placeholder(Path(word).stem) and not (ROOT / word).is_file():
            problems.append(f"{word} does not exist")
    script = path.name
    if problems or script not in SCRIPT_CONFIGS or not (given.get("--set") or given.get("--only")):
        return problems
    if SCRIPT_CONFIGS[script] is None:  # breakdown.py vlm|dllm|diffusion: the CLI's default config
        modality, configs = positional[0], [None]
    else:
        modality, methods = SCRIPT_CONFIGS[script]
        methods = methods[positional[0]] if isinstance(methods, dict) else methods
        named = [m for o in METHOD_OPTIONS for m in given.get(o, []) if not placeholder(m)]
        configs = [m and Path(f"configs/{modality}/{m}.yaml") for m in named or methods]
        if "--config" in given:
            configs = [Path(given["--config"][0])]
    problems = config_problems(modality, configs, given.get("--set", []))
    for only in given.get("--only", []):  # diffusion_methods.py --only METHOD:KEY=VALUE
        method, _, setting = only.partition(":")
        problems += config_problems(modality, [Path(f"configs/{modality}/{method}.yaml")],
                                    given.get("--set", []) + [setting])
    return problems


def problems_of(command: Command) -> list[str]:
    # a bundled model or file it names (model.path=assets/..., --models assets/...) is still there
    problems = [f"{p} does not exist" for w in command.words for p in [w.partition("=")[2] or w]
                if p.startswith("assets/") and not placeholder(Path(p).name) and not (ROOT / p).exists()]
    if command.words[0] in ("bash", "python") and command.words[1].startswith(("benchmarks/", "scripts/")):
        return problems + script_problems(command.words)
    return problems + cli_problems(command.words)


COMMANDS = commands(RESULTS.read_text())


def test_results_md_has_its_commands():
    """The reader finds them all: a change to the parser that lost most of them fails here."""
    assert len(COMMANDS) > 150
    assert {c.words[0] for c in COMMANDS} >= {"mmrl", "diffusion-rl", "dllm-rl", "python", "bash"}


def test_every_command_in_results_md_names_what_exists():
    """Config files, --set keys and values, verbs, options and bundled assets, for every command."""
    problems = [f"line {c.line}: {p}\n    {c.text}" for c in COMMANDS for p in problems_of(c)
                if not any(fragment in c.text for fragment in HISTORICAL)]
    assert not problems, "RESULTS.md's commands that no longer run as written:\n" + "\n".join(problems)


def test_every_historical_command_is_still_in_results_md():
    """An allow-list entry whose command was fixed or removed goes too."""
    for fragment in HISTORICAL:
        assert any(fragment in c.text for c in COMMANDS), fragment
