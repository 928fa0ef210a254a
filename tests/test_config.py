"""Config loading (mmrl/core/config.py): every file in configs/ validates, every bad
config is one ConfigError naming the key or the file, layers merge in the right order."""

import importlib
import importlib.util
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from mmrl.core.config import (
    ConfigError,
    GroupAdvantageConfig,
    ModelConfig,
    MultiStreamAdvantageConfig,
    RLOOAdvantageConfig,
    TrainConfig,
    apply_overrides,
    check_remote_code,
    deep_merge,
    load_config,
    parse_override,
    read_yaml,
    remote_code_maps,
)

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
CONFIG_FILES = (
    sorted(p for p in CONFIGS.rglob("*") if p.is_file() and p.suffix in (".yaml", ".yml"))
    if CONFIGS.is_dir()
    else []
)

# configs/<modality>/ -> the backend module whose CONFIG_CLASS narrows TrainConfig (as the CLI does)
BACKENDS = {
    "vlm": "mmrl.vlm.backend",
    "diffusion": "diffusion_rl.backend",
    "dllm": "dllm_rl.backend",
}


def config_class_for(path: Path) -> type[TrainConfig]:
    """The backend's config class when that backend exists yet, else the base TrainConfig."""
    module = BACKENDS.get(path.relative_to(CONFIGS).parts[0])
    if module is None:
        return TrainConfig
    try:
        found = importlib.util.find_spec(module)
    except ModuleNotFoundError:  # the backend's package itself is missing
        found = None
    if found is None:
        return TrainConfig
    cls = getattr(importlib.import_module(module), "CONFIG_CLASS", TrainConfig)
    assert issubclass(cls, TrainConfig)
    return cls


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def config_error(**kwargs) -> str:
    """The message of the ConfigError load_config raises; it must be one line."""
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg, f"ConfigError message spans lines: {msg!r}"
    return msg


# ---------------------------------------------------------------------------- configs/ on disk


def test_configs_dir_holds_yaml():
    # The parametrised test below silently runs zero cases on an empty configs/; this one fails.
    assert CONFIG_FILES, f"no *.yaml under {CONFIGS}"


@pytest.mark.parametrize(
    "path", CONFIG_FILES, ids=[str(p.relative_to(CONFIGS)) for p in CONFIG_FILES]
)
def test_every_config_file_validates(path):
    cls = config_class_for(path)
    cfg = load_config(cls, path)
    assert isinstance(cfg, cls)
    assert cfg.base_dir == str(path.resolve().parent)
    # the validated config is a fixed point: dumping and re-validating changes nothing
    dumped = cfg.model_dump(mode="json")
    assert cls.model_validate(dumped).model_dump(mode="json") == dumped


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[str(p.relative_to(CONFIGS)) for p in CONFIG_FILES])
def test_no_config_file_warns_as_the_cli_loads_it(path):
    """A shipped config loads without a warning, on its own and over its backend's defaults (the CLI's)."""
    cls = config_class_for(path)
    module = BACKENDS.get(path.relative_to(CONFIGS).parts[0])
    defaults = getattr(importlib.import_module(module), "DEFAULT_CONFIG", None) if module else None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(cls, path)
        load_config(cls, path, defaults=defaults)


# ---------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize("overrides, message", [
    # one string was read character by character: "override 't' must look like key.path=value"
    ("train.max_steps=3", "not one string: write ['train.max_steps=3']"),
    ({"train.max_steps": 3}, "not a dict: write ['train.max_steps=3']"),
    ([("train.max_steps", 3)], "('train.max_steps', 3) is not a string (tuple)"),
    ([3], "3 is not a string (int)"),  # was a TypeError from inside the parser
])
def test_overrides_from_python_must_be_a_list_of_strings(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, overrides=overrides)
    assert message in str(e.value) and "key.path=value" in str(e.value)


def test_a_mapping_given_as_the_path_or_defaults_not_a_mapping_is_a_config_error():
    # the path was a TypeError from pathlib, a list of defaults an AttributeError from deep_merge
    with pytest.raises(ConfigError, match=r"path is a dict: pass a mapping as defaults=\.\.\."):
        load_config(TrainConfig, {"train": {"max_steps": 2}})
    with pytest.raises(ConfigError, match="defaults must be a mapping of sections, got a list"):
        load_config(TrainConfig, defaults=["train.max_steps=2"])
    assert load_config(TrainConfig, defaults={"train": {"max_steps": 2}}).train.max_steps == 2


def test_overrides_none_and_a_tuple_are_fine():
    assert load_config(TrainConfig, overrides=None).seed == TrainConfig().seed
    assert load_config(TrainConfig, overrides=("seed=5",)).seed == 5


def test_unknown_top_level_key_names_key_and_suggestion():
    msg = config_error(overrides=["seeed=3"])
    assert "'seeed'" in msg
    assert "did you mean 'seed'" in msg


def test_unknown_top_level_key_without_close_match_lists_allowed_keys():
    msg = config_error(overrides=["zzzz=3"])
    assert "'zzzz'" in msg
    assert "allowed here:" in msg and "optim" in msg and "rollout" in msg


def test_unknown_nested_key_names_full_dotted_path():
    msg = config_error(overrides=["optim.lrr=1"])
    assert "'optim.lrr'" in msg
    assert "did you mean 'optim.lr'" in msg


def test_unknown_key_inside_union_section_drops_the_union_tag():
    # pydantic reports loc ("method", "grpo", "loss", "aggregatoin"); the message must not say "grpo"
    msg = config_error(overrides=["method.loss.aggregatoin=token_mean"])
    assert "'method.loss.aggregatoin'" in msg
    assert "did you mean 'method.loss.aggregation'" in msg
    assert "grpo" not in msg


def test_unknown_key_suggestion_follows_the_selected_variant():
    # multi_stream has `mode`; the suggestion must come from that variant, not from `group`
    msg = config_error(overrides=["method.advantage.type=multi_stream", "method.advantage.mod=x"])
    assert "'method.advantage.mod'" in msg
    assert "did you mean 'method.advantage.mode'" in msg


def test_unknown_key_in_file_names_the_file_and_the_key(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 1.0e-4\n  lrr: 1\n")
    msg = config_error(path=path)
    assert str(path) in msg
    assert "'optim.lrr'" in msg and "did you mean 'optim.lr'" in msg


# ---------------------------------------------------------------------------- bad values


def test_wrong_type_names_key_and_value():
    msg = config_error(overrides=["train.max_steps=ten"])
    assert "train.max_steps" in msg and "'ten'" in msg


def test_clip_low_out_of_range():
    msg = config_error(overrides=["method.loss.clip_low=2"])  # Field(lt=1)
    assert "method.loss.clip_low" in msg and "less than 1" in msg
    assert "grpo" not in msg


def test_zero_temperature_rejected():
    msg = config_error(overrides=["rollout.temperature=0"])  # Field(gt=0)
    assert "rollout.temperature" in msg and "greater than 0" in msg


def test_betas_validator_names_section():
    msg = config_error(overrides=["optim.betas=[0.9, 1.5]"])
    assert "optim" in msg and "betas must lie in [0, 1)" in msg


def test_bad_discriminator_tag():
    msg = config_error(overrides=["method.type=nope"])
    assert "method" in msg and "'nope'" in msg


def test_several_errors_are_joined_on_one_line():
    msg = config_error(overrides=["optim.lrr=1", "rollout.temperature=0"])
    assert "'optim.lrr'" in msg and "rollout.temperature" in msg
    assert "; " in msg


@pytest.mark.parametrize(("override", "needle"), [
    ("train.max_steps=true", "train.max_steps: true is a boolean; this key takes a number"),
    ("optim.lr=false", "optim.lr: false is a boolean"),  # float
    ("train.micro_batch_size=true", "train.micro_batch_size: true is a boolean"),  # int | None
    ("method.loss.clip_high=true", "method.loss.clip_high: true is a boolean"),  # inside a union's variant
    ("optim.betas=[0.9, true]", "optim.betas: [0.9, true] holds a boolean where this key takes numbers"),
])
def test_a_boolean_for_a_number_is_refused_naming_the_key(override, needle):
    # pydantic alone reads true as 1: max_steps: true trained one step
    assert needle in config_error(overrides=[override])


def test_a_boolean_for_a_number_in_a_file_or_a_mapping_or_an_assignment_is_refused(tmp_path):
    from diffusion_rl import backend

    path = tmp_path / "run.yaml"
    path.write_text("train:\n  eval_every: true\n")
    msg = config_error(path=path)
    assert str(path) in msg and "train.eval_every: true is a boolean" in msg
    with pytest.raises(ConfigError, match=r"task.atom_weights: \{\"count\": true\} holds a boolean"):
        load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG, overrides=["task.atom_weights={count: true}"])
    cfg = load_config(TrainConfig)
    with pytest.raises(ValueError, match="true is a boolean"):
        cfg.train.max_steps = True
    cfg.train.max_steps = 5  # a number still goes in, and a bool key still takes a bool
    cfg.logging.tensorboard = False
    assert (cfg.train.max_steps, cfg.logging.tensorboard) == (5, False)


# ---------------------------------------------------------------------------- bad overrides


def test_override_without_equals():
    msg = config_error(overrides=["optim.lr"])
    assert "'optim.lr'" in msg and "key.path=value" in msg


def test_override_with_empty_key_part():
    msg = config_error(overrides=["optim..lr=1"])
    assert "optim..lr" in msg


def test_override_into_a_value():
    msg = config_error(overrides=["optim.lr.x=1"])
    assert "optim.lr is a value, not a section" in msg


# ---------------------------------------------------------------------------- bad files


def test_missing_config_file_names_the_file(tmp_path):
    path = tmp_path / "nope.yaml"
    msg = config_error(path=path)
    assert str(path) in msg and "does not exist" in msg


def test_yaml_that_is_not_a_mapping(tmp_path):
    path = write(tmp_path, "- 1\n- 2\n")
    msg = config_error(path=path)
    assert str(path) in msg and "mapping" in msg and "list" in msg


def test_invalid_yaml_raises_config_error_naming_the_file(tmp_path):
    path = write(tmp_path, "optim: {lr: [1, 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, path)
    assert str(path) in str(info.value) and "not valid YAML" in str(info.value)


def test_duplicate_key_raises_config_error_naming_both_lines(tmp_path):
    path = write(tmp_path, "method:\n  type: grpo\noptim: {lr: 0.1}\nmethod: {type: grpo}\n")
    msg = config_error(path=path)
    assert str(path) in msg and "duplicate key 'method' (lines 1 and 4)" in msg
    with pytest.raises(ConfigError, match="duplicate key 'lr'"):
        load_config(TrainConfig, overrides=["optim={lr: 1, lr: 2}"])


def test_non_utf8_file_raises_config_error(tmp_path):
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"\xff\xfe\x00x")
    msg = config_error(path=path)
    assert str(path) in msg and "not valid YAML" in msg


def test_invalid_yaml_file_message_is_one_line(tmp_path):
    path = write(tmp_path, "a: b: c\n")
    config_error(path=path)  # asserts no newline in the message


def test_invalid_yaml_override_message_is_one_line():
    config_error(overrides=["optim.betas=[0.9, 0.99"])


def test_empty_file_is_the_defaults(tmp_path):
    path = write(tmp_path, "")
    assert read_yaml(path) == {}
    cfg = load_config(TrainConfig, path)
    assert cfg.model_dump() == TrainConfig().model_dump()
    assert cfg.base_dir == str(tmp_path.resolve())


# ---------------------------------------------------------------------------- override values


@pytest.mark.parametrize(
    "item, expected",
    [
        ("a.b=3", (["a", "b"], 3)),
        ("a=0.5", (["a"], 0.5)),
        ("a=1.0e-5", (["a"], 1e-5)),
        ("a=null", (["a"], None)),
        ("a=[1, 2]", (["a"], [1, 2])),
        ("a=true", (["a"], True)),
        ("a=false", (["a"], False)),
        ("a=hello", (["a"], "hello")),
        ("a=", (["a"], "")),
        ("a=x=y", (["a"], "x=y")),  # only the first '=' splits
        (" a.b =2", (["a", "b"], 2)),
        ("a={type: rloo}", (["a"], {"type": "rloo"})),
        # YAML 1.2 integers: YAML 1.1 read "010" as octal 8 and "20:00" as base-60 1200
        ("a=010", (["a"], 10)),
        ("a=20:00", (["a"], "20:00")),
        ("a=0x1f", (["a"], 31)),
        ("a=0o17", (["a"], 15)),
        ("a=-1_000", (["a"], -1000)),
        # YAML 1.2 booleans: YAML 1.1 read yes/no/on/off as booleans ("no" as an answer became False)
        ("a=no", (["a"], "no")),
        ("a=On", (["a"], "On")),
        ("a=True", (["a"], True)),
        ("a=FALSE", (["a"], False)),
    ],
)
def test_parse_override_values(item, expected):
    assert parse_override(item) == expected


def test_overrides_a_type_change_wipes_are_named():
    """A new variant starts from its own defaults, so keys of that section given before its type
    no longer apply (a shared list of overrides may hold keys another variant lacks); that is
    said, where it was silent."""
    from dllm_rl.config import DLLMTrainConfig

    cfg = load_config(DLLMTrainConfig, overrides=["method.type=tracerl", "method.kl.beta=0.5"])
    assert cfg.method.type == "tracerl" and cfg.method.kl.beta == 0.5
    with pytest.warns(UserWarning, match=r"method.kl.beta=0.5 given before method.type=tracerl no longer applies: "
                                         r"a new method type starts from its own defaults"):
        cfg = load_config(DLLMTrainConfig, overrides=["method.kl.beta=0.5", "seed=3", "method.type=tracerl"])
    assert cfg.method.kl.beta == 0.01 and cfg.seed == 3


def test_a_type_change_names_only_the_earlier_keys_of_its_own_section():
    import warnings

    with pytest.warns(UserWarning) as record:
        cfg = load_config(TrainConfig, overrides=["method.advantage.scale=none", "method.kl.beta=0.5",
                                                  "method.advantage.type=rloo"])
    assert [str(w.message) for w in record] == [
        ("method.advantage.scale=none given before method.advantage.type=rloo no longer applies: a new "
         "method.advantage type starts from its own defaults (give the type first to keep them)")]
    assert isinstance(cfg.method.advantage, RLOOAdvantageConfig) and cfg.method.kl.beta == 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # method.kl is another section: kept, and nothing to say
        assert load_config(TrainConfig, overrides=["method.kl.beta=0.5", "method.advantage.type=rloo"]).method.kl.beta == 0.5


def test_a_type_change_after_the_whole_section_was_given_says_that_it_no_longer_applies():
    with pytest.warns(UserWarning, match=r"method.advantage=\{type: group, scale: none\} given before "
                                         r"method.advantage.type=rloo no longer applies"):
        cfg = load_config(TrainConfig, overrides=["method.advantage={type: group, scale: none}",
                                                  "method.advantage.type=rloo"])
    assert isinstance(cfg.method.advantage, RLOOAdvantageConfig)


def test_a_bool_setting_still_takes_yes_and_off():
    import toy

    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=["logging.tensorboard=yes",
                                                                           "logging.progress=off"])
    assert cfg.logging.tensorboard is True and cfg.logging.progress is False


def test_parse_override_exponent_without_dot_is_a_float():
    assert parse_override("task.lr=1e-5") == (["task", "lr"], 1e-5)


def test_override_values_reach_typed_fields():
    cfg = load_config(
        TrainConfig,
        overrides=[
            "seed=7",
            "optim.lr=1e-5",  # a string to YAML 1.1; the float field coerces it
            "optim.max_grad_norm=null",
            "optim.betas=[0.5, 0.75]",
            "logging.progress=false",
            "method.kl.beta=0.04",
            "reward.atoms=[a.py:f, {path: b.py:g, weight: 2}]",
        ],
    )
    assert cfg.seed == 7 and isinstance(cfg.seed, int)
    assert cfg.optim.lr == 1e-5 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.max_grad_norm is None
    assert cfg.optim.betas == (0.5, 0.75)
    assert cfg.logging.progress is False
    assert cfg.method.kl.beta == 0.04
    assert cfg.reward.atoms == ["a.py:f", {"path": "b.py:g", "weight": 2}]
    # untouched keys keep their defaults
    assert cfg.optim.weight_decay == 0.0 and cfg.rollout.num_generations == 8


def test_later_override_wins():
    cfg = load_config(TrainConfig, overrides=["optim.lr=0.1", "optim.lr=0.2"])
    assert cfg.optim.lr == 0.2


def test_override_creates_task_section():
    cfg = load_config(TrainConfig, overrides=["task.name=count", "task.size.width=4"])
    assert cfg.task == {"name": "count", "size": {"width": 4}}


# ---------------------------------------------------------------------------- layering


def test_override_beats_file_beats_defaults(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 2.0e-3\n  warmup_steps: 5\nseed: 11\n")
    cfg = load_config(
        TrainConfig,
        path,
        overrides=["optim.lr=3.0e-3"],
        defaults={"optim": {"lr": 1.0e-3, "weight_decay": 0.1, "warmup_steps": 1}, "seed": 4},
    )
    assert cfg.optim.lr == 3.0e-3  # override
    assert cfg.optim.warmup_steps == 5  # file over defaults
    assert cfg.seed == 11  # file over defaults
    assert cfg.optim.weight_decay == 0.1  # defaults over the class default
    assert cfg.optim.eps == 1e-8  # class default


def test_file_changes_advantage_variant_over_defaults(tmp_path):
    # defaults choose multi_stream with a mode; the file switches to rloo: no `mode` may leak
    path = write(tmp_path, "method:\n  advantage: {type: rloo}\n")
    cfg = load_config(
        TrainConfig,
        path,
        defaults={"method": {"advantage": {"type": "multi_stream", "mode": "sum_then_normalize"}}},
    )
    assert isinstance(cfg.method.advantage, RLOOAdvantageConfig)


def test_override_type_replaces_the_section_not_merges(tmp_path):
    path = write(tmp_path, "method:\n  advantage: {type: group, scale: none}\n")
    assert load_config(TrainConfig, path).method.advantage == GroupAdvantageConfig(scale="none")
    cfg = load_config(TrainConfig, path, overrides=["method.advantage.type=rloo"])
    assert isinstance(cfg.method.advantage, RLOOAdvantageConfig)
    # and the new variant starts from its own defaults
    cfg = load_config(TrainConfig, path, overrides=["method.advantage.type=multi_stream"])
    assert cfg.method.advantage == MultiStreamAdvantageConfig()


def test_override_same_type_keeps_the_section(tmp_path):
    path = write(tmp_path, "method:\n  advantage: {type: group, scale: none}\n")
    cfg = load_config(TrainConfig, path, overrides=["method.advantage.type=group"])
    assert cfg.method.advantage.scale == "none"


def test_deep_merge_nested():
    base = {"a": {"x": 1, "y": {"p": 1, "q": 2}}, "b": 1}
    update = {"a": {"y": {"q": 3}, "z": 4}, "c": 5}
    out = deep_merge(base, update)
    assert out == {"a": {"x": 1, "y": {"p": 1, "q": 3}, "z": 4}, "b": 1, "c": 5}
    assert base == {"a": {"x": 1, "y": {"p": 1, "q": 2}}, "b": 1}  # inputs untouched
    out["a"]["y"]["p"] = 99
    assert base["a"]["y"]["p"] == 1  # no aliasing into the base


def test_deep_merge_type_change_replaces():
    base = {"adv": {"type": "group", "scale": "none", "eps": 0.1}}
    assert deep_merge(base, {"adv": {"type": "rloo"}}) == {"adv": {"type": "rloo"}}
    # same type (or no type given) merges
    assert deep_merge(base, {"adv": {"type": "group", "eps": 0.2}}) == {
        "adv": {"type": "group", "scale": "none", "eps": 0.2}
    }
    assert deep_merge(base, {"adv": {"eps": 0.2}})["adv"]["scale"] == "none"


def test_deep_merge_non_dict_replaces():
    assert deep_merge({"a": {"x": 1}}, {"a": None}) == {"a": None}
    assert deep_merge({"a": [1, 2]}, {"a": [3]}) == {"a": [3]}


def test_apply_overrides_does_not_mutate_input():
    data = {"optim": {"lr": 1.0}}
    out = apply_overrides(data, ["optim.lr=2"])
    assert out == {"optim": {"lr": 2}} and data == {"optim": {"lr": 1.0}}


def test_base_dir(tmp_path):
    assert load_config(TrainConfig).base_dir is None
    path = write(tmp_path, "seed: 1\n", name="sub/dir/run.yaml")
    assert load_config(TrainConfig, path).base_dir == str((tmp_path / "sub" / "dir").resolve())


def test_base_dir_of_relative_path_is_absolute(tmp_path, monkeypatch):
    write(tmp_path, "seed: 1\n", name="cfgs/run.yaml")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(TrainConfig, "cfgs/run.yaml")
    assert cfg.base_dir == str((tmp_path / "cfgs").resolve())
    assert os.path.isabs(cfg.base_dir)


def test_validate_assignment():
    cfg = load_config(TrainConfig)
    with pytest.raises(ValueError):
        cfg.rollout.temperature = 0.0


# ---------------------------------------------------------------------------- the CLI


def run_clis(*commands: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """`python -m <command>` for each command, all at once (each is mostly imports)."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=REPO, env=env) for args in commands]
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def test_each_cli_helps_and_a_bad_override_is_one_clean_error():
    *helps, bad = run_clis(*[(module, "--help") for module in ("mmrl", "diffusion_rl", "dllm_rl")],
                           ("mmrl", "train", "--set", "optim.lrr=1"))
    for proc in helps:
        assert proc.returncode == 0, (proc.args, proc.stderr)
        assert "Usage" in proc.stdout, proc.args
    assert bad.returncode != 0
    assert "optim.lrr" in bad.stderr
    assert "Traceback" not in bad.stderr + bad.stdout


# ---------------------------------------------------------------------------- model directories and devices


def test_device_takes_any_gpu_index_and_only_a_whole_spelling():
    from pydantic import ValidationError

    assert ModelConfig(device="cuda:10").device == "cuda:10"  # N is any index, not one digit
    for bad in ("cpux", "autox", "cuda:1x", "cuda0"):  # a known spelling followed by more is not it
        with pytest.raises(ValidationError, match="not one of cpu, cuda, cuda:N, auto"):
            ModelConfig(device=bad)


def test_remote_code_maps_reads_every_file_and_counts_only_a_non_empty_auto_map(tmp_path):
    assert remote_code_maps(tmp_path) == []
    # no config.json (absent files are skipped, not the end of the search)
    (tmp_path / "tokenizer_config.json").write_text('{"auto_map": {"AutoTokenizer": "tok.Tok"}}')
    assert remote_code_maps(tmp_path) == ["tokenizer_config.json"]
    (tmp_path / "config.json").write_text('{"auto_map": {}, "model_type": "x"}')  # an empty map loads no code
    (tmp_path / "processor_config.json").write_text("{not json")  # unreadable: the loader reports it
    (tmp_path / "preprocessor_config.json").write_text('["auto_map"]')  # not a mapping
    assert remote_code_maps(tmp_path) == ["tokenizer_config.json"]
    (tmp_path / "config.json").write_text('{"auto_map": {"AutoModel": "m.M"}}')
    assert remote_code_maps(tmp_path) == ["config.json", "tokenizer_config.json"]  # in _CODE_MAPS order


def test_check_remote_code_refuses_only_code_and_names_the_directory_when_trusted(tmp_path, capsys):
    check_remote_code(tmp_path, False)  # no auto_map: nothing to refuse, nothing said
    assert capsys.readouterr().err == ""
    check_remote_code(tmp_path, True)
    assert capsys.readouterr().err == (f"notice: model.trust_remote_code is on: {tmp_path} ships no Python code "
                                       "(no auto_map), so none of it runs\n")
    (tmp_path / "config.json").write_text('{"auto_map": {"AutoModel": "m.M"}}')
    with pytest.raises(ConfigError, match=r"ships its own Python code \(auto_map in config.json\); .* Set "
                                          r"model.trust_remote_code=true if you trust it"):
        check_remote_code(tmp_path, False)
    check_remote_code(tmp_path, True)
    assert capsys.readouterr().err == (f"notice: model.trust_remote_code is on: about to run the Python code in "
                                       f"{tmp_path} (auto_map in config.json)\n")


# ---------------------------------------------------------------------------- bounds and defaults


@pytest.mark.parametrize("item", [
    "rollout.top_p=1",  # the whole softmax
    "method.loss.clip_low=0",
    "method.fastrl.tau=1",  # le=1
    "method.fastrl.min_group_size=2",
    "optim.betas=[0, 0]",  # [0, 1): 0 is in
    "rollout.scheduler.max_redispatch=0",  # no retry
    "reward.max_stuck=1",
])
def test_a_value_at_its_bound_is_accepted(item):
    load_config(TrainConfig, overrides=[item])


@pytest.mark.parametrize("item, needle", [
    ("rollout.top_p=0", "rollout.top_p: Input should be greater than 0"),
    ("method.loss.clip_low=1", "method.loss.clip_low: Input should be less than 1"),  # 1 - clip_low > 0
    ("method.fastrl.min_group_size=1", "greater than or equal to 2"),  # a group of one has no advantage
    ("optim.betas=[0.9, 1]", "optim: betas must lie in [0, 1), got [0.9, 1.0]"),
    ("reward.max_stuck=0", "reward.max_stuck: Input should be greater than or equal to 1"),
    ("reward.overlong={buffer: 0}", "reward.overlong.buffer: Input should be greater than or equal to 1"),
])
def test_a_value_just_past_its_bound_is_refused(item, needle):
    assert needle in config_error(overrides=[item])


def test_grpo_defaults_are_the_documented_ones():
    """docs/methods.md section 1: GRPO clips 0.2 / 0.2, eps 1e-6, KL estimator k3 by default, beta 0."""
    method = TrainConfig().method
    assert (method.loss.clip_low, method.loss.clip_high) == (0.2, 0.2)
    assert method.kl.kind == "k3" and method.kl.beta == 0.0
    assert method.advantage == GroupAdvantageConfig(type="group", scale="group", eps=1e-6)


def test_an_overlong_buffer_as_long_as_the_budget_is_accepted():
    # DAPO: the penalty starts at max_len - buffer; a buffer equal to max_len starts it at the first token
    cfg = load_config(TrainConfig, overrides=["rollout.max_new_tokens=4", "reward.overlong.buffer=4"])
    assert cfg.reward.overlong.buffer == 4
    cfg = load_config(TrainConfig, overrides=["rollout.max_new_tokens=2", "reward.overlong={buffer: 3, max_len: 3}"])
    assert cfg.reward.overlong.max_len == 3  # max_len, not the budget, bounds the buffer


# ---------------------------------------------------------------------------- merging and YAML values


def test_deep_merge_output_shares_nothing_with_its_inputs():
    base = {"a": {"x": 1}, "b": {"y": [1]}}
    update = {"a": {"x": 2}, "c": {"z": [3]}}
    out = deep_merge(base, update)
    assert out == {"a": {"x": 2}, "b": {"y": [1]}, "c": {"z": [3]}}
    out["b"]["y"].append(2)  # a section only the base has
    out["c"]["z"].append(4)  # a section only the update has
    assert base == {"a": {"x": 1}, "b": {"y": [1]}} and update == {"a": {"x": 2}, "c": {"z": [3]}}


@pytest.mark.parametrize("item, expected", [
    ("a=1e5", 100000.0),  # YAML 1.2: the exponent's sign is optional
    ("a=1.e5", 100000.0),  # and so are the digits after the dot
    ("a=2.5E3", 2500.0),
    ("a=TRUE", True),  # YAML 1.2's three spellings of each boolean
    ("a=1__000", 1000),  # underscores anywhere after the first digit are dropped
    ("a=10_", 10),
    ("a=   ", ""),  # a blank value is the empty string, as "a=" is
])
def test_parse_override_yaml_1_2_scalars(item, expected):
    key, value = parse_override(item)
    assert key == ["a"] and value == expected and type(value) is type(expected)


@pytest.mark.parametrize("item", [".a=1", "a.=1", "a..b=1", "=1"])
def test_override_with_an_empty_key_part_anywhere_is_refused(item):
    with pytest.raises(ConfigError, match="has an empty key"):
        parse_override(item)


def test_a_directory_given_as_config_file_is_named_as_one(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not a YAML file"):
        read_yaml(tmp_path)
    assert "is a directory" in config_error(path=tmp_path)


# ---------------------------------------------------------------------------- error messages


def test_a_section_validator_error_from_a_set_value_reads_cleanly_and_blames_no_file(tmp_path):
    path = write(tmp_path, "seed: 1\n")
    msg = config_error(path=path, overrides=["optim.betas=[0.9, 1.5]"])
    # the validator's own words: no pydantic "Value error, " prefix, no "(got {...})" dump of the section
    assert msg == "invalid config: optim: betas must lie in [0, 1), got [0.9, 1.5]"


def test_a_file_error_beside_a_set_error_still_names_the_file(tmp_path):
    path = write(tmp_path, "optim:\n  lrr: 1\n")
    msg = config_error(path=path, overrides=["rollout.temperature=0"])
    assert msg.startswith(f"invalid config in {path}: ") and "'optim.lrr'" in msg and "rollout.temperature" in msg


def test_an_error_of_the_whole_config_is_named_top_level():
    msg = config_error(overrides=["rollout.max_new_tokens=2", "reward.overlong.buffer=3"])
    assert msg == ("invalid config: (top level): reward.overlong.buffer (3) is longer than "
                   "rollout.max_new_tokens (2): the penalty would start before the first token")


# ---------------------------------------------------------------------------- each backend's own sections


def test_vlm_min_pixels_may_equal_max_pixels_but_not_exceed_it():
    from mmrl.vlm.config import VLMModelConfig

    model = VLMModelConfig(min_pixels=1000, max_pixels=1000)  # one area, 1000 px, fits both
    assert (model.min_pixels, model.max_pixels) == (1000, 1000)
    with pytest.raises(ValueError, match=r"min_pixels \(1001\) is above max_pixels \(1000\)"):
        VLMModelConfig(min_pixels=1001, max_pixels=1000)


def test_vlm_scene_ranges_are_checked_when_the_config_loads():
    from mmrl.vlm.config import ShapesMoodTaskConfig, ShapesQATaskConfig, ShapesZoomTaskConfig

    assert ShapesQATaskConfig(min_shapes=2, max_shapes=2, shape_size=(40, 40)).max_shapes == 2  # equal ends fit
    for cls in (ShapesQATaskConfig, ShapesMoodTaskConfig):
        with pytest.raises(ValueError, match=r"got min_shapes=4, max_shapes=3"):
            cls(min_shapes=4, max_shapes=3)
        with pytest.raises(ValueError, match=r"got \(48, 36\)"):
            cls(shape_size=(48, 36))
    with pytest.raises(ValueError, match=r"1 <= lo <= hi, got \(0, 10\)"):
        ShapesZoomTaskConfig(shape_size=(0, 10))
    assert ShapesZoomTaskConfig(shape_size=(1, 1)).shape_size == (1, 1)


def test_vlm_task_and_rollout_defaults_are_the_documented_ones():
    from mmrl.vlm.config import ShapesMoodTaskConfig, ToolsConfig, VLMTrainConfig

    cfg = VLMTrainConfig()
    assert (cfg.model.min_pixels, cfg.model.max_pixels) == (56 * 56, 112 * 112)
    assert cfg.task.type == "shapes-qa" and cfg.task.image_size == 112
    assert (cfg.task.min_shapes, cfg.task.max_shapes) == (1, 2) and cfg.task.shape_size == (36, 48)
    assert cfg.rollout.max_new_tokens == 48 and cfg.rollout.eval_samples == 4
    assert cfg.rollout.old_logprobs == "generate" and cfg.rollout.tools is None  # single-turn, free log-probs
    mood = ShapesMoodTaskConfig()
    assert mood.diversity_weight == 0.3  # DSPO's 0.3 R_div
    assert (mood.min_shapes, mood.max_shapes, mood.num_ood) == (1, 3, 200)
    tools = ToolsConfig()
    assert tools.names == ["zoom", "calculator"] and (tools.max_turns, tools.max_tool_calls) == (3, 2)


def test_vlm_method_defaults_are_the_papers():
    from mmrl.vlm.config import AXPOConfig, CORAConfig, DSPOConfig, PACGConfig, VPPOConfig

    axpo = AXPOConfig()
    assert (axpo.resample.k, axpo.resample.budget, axpo.success) == (2, 0.25, 0.5)  # ~25% extra decoding
    assert axpo.resample.force_call is False
    vppo = VPPOConfig()  # p = 0.5, beta_min = 0.9, the top 40% of tokens, s_t clamped to 10
    assert (vppo.intervention, vppo.mask_p, vppo.beta_min, vppo.top_frac, vppo.cap) == ("mask", 0.5, 0.9, 0.4, 10.0)
    pacg = PACGConfig()  # z0 ~ 1, g_min ~ 0.5, on DAPO
    assert (pacg.base, pacg.z0, pacg.eta, pacg.g_min) == ("dapo", 1.0, 0.5, 0.5)
    cora = CORAConfig()  # alpha = 1, beta in 0.1-0.3
    assert (cora.lam, cora.alpha, cora.beta, cora.warmup_steps) == (1.0, 1.0, 0.2, 20)
    dspo = DSPOConfig()  # R = R_acc + 0.1 R_fmt + 0.1 R_cf + 0.3 R_div
    assert (dspo.div_weight, dspo.cf_weight) == (0.3, 0.1)


@pytest.mark.parametrize("section", [
    {"rollout": {"tools": {"max_tool_calls": 0}}},  # tools offered, none run
    {"method": {"type": "axpo", "resample": {"k": 2}}},  # two continuations: the fewest that z-score
    {"method": {"type": "vppo", "mask_p": 1.0, "top_frac": 1.0, "beta_min": 1.0}},
    {"method": {"type": "pacg", "g_min": 1.0, "eta": 0.0}},
    {"method": {"type": "cora", "warmup_steps": 0, "alpha": 0.0}},
    {"task": {"type": "shapes-qa", "image_size": 28}},
    {"task": {"type": "shapes-mood", "num_ood": 0, "diversity_weight": 0.0}},
])
def test_vlm_a_value_at_its_bound_is_accepted(section):
    from mmrl.vlm.config import VLMTrainConfig

    VLMTrainConfig(**section)


@pytest.mark.parametrize("section, key", [
    ({"rollout": {"tools": {"max_tool_calls": -1}}}, "max_tool_calls"),
    ({"method": {"type": "axpo", "resample": {"k": 1}}}, "k"),  # one continuation has no z-score
    ({"method": {"type": "vppo", "mask_p": 1.01}}, "mask_p"),
    ({"method": {"type": "vppo", "top_frac": 0.0}}, "top_frac"),
    ({"method": {"type": "pacg", "g_min": 1.01}}, "g_min"),
    ({"method": {"type": "cora", "lam": 0.0}}, "lam"),  # r_cons = lambda P(consistent): 0 is no stream
    ({"task": {"type": "shapes-qa", "image_size": 27}}, "image_size"),
    ({"task": {"type": "shapes-zoom", "image_size": 55}}, "image_size"),
])
def test_vlm_a_value_just_past_its_bound_is_refused(section, key):
    from mmrl.vlm.config import VLMTrainConfig

    with pytest.raises(ValueError, match=key):
        VLMTrainConfig(**section)


def test_dllm_rollout_defaults_and_max_new_tokens_follow_gen_length():
    import warnings

    from dllm_rl.config import DLLMRolloutConfig, DLLMTrainConfig

    r = DLLMTrainConfig().rollout
    assert (r.gen_length, r.block_length, r.steps, r.strategy) == (16, 8, 16, "low_confidence")
    assert (r.threshold, r.tau, r.m) == (0.8, 0.9, 1.0)  # Fork-dLLM's lambda; SLIM-RL's tau and m
    assert r.eval_samples == 0 and r.max_new_tokens == 16
    # 32 tokens in blocks of 8 (4 blocks) by 8 steps: max_new_tokens becomes 32, out of the dump
    r = DLLMRolloutConfig(gen_length=32, block_length=8, steps=8)
    assert r.max_new_tokens == 32 and "max_new_tokens" not in r.model_dump()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same value as gen_length (given or default) is no news
        assert DLLMRolloutConfig(max_new_tokens=16).max_new_tokens == 16
        assert DLLMRolloutConfig(gen_length=32, max_new_tokens=32).max_new_tokens == 32
    with pytest.warns(UserWarning, match=r"max_new_tokens \(8\) is not a dLLM setting.*gen_length \(16\)"):
        assert DLLMRolloutConfig(max_new_tokens=8).max_new_tokens == 16


def test_dllm_threshold_and_tau_lie_strictly_inside_0_1():
    from dllm_rl.config import DLLMRolloutConfig

    assert DLLMRolloutConfig(threshold=0.999, tau=0.001).threshold == 0.999
    for key in ("threshold", "tau"):
        for value in (0.0, 1.0):
            with pytest.raises(ValueError, match=key):
                DLLMRolloutConfig(**{key: value})


@pytest.mark.parametrize("band, ok", [
    ((0.5, 0.5), True),  # one accuracy kept
    ((0.0, 1.0), True),  # every group kept
    ((0.6, 0.4), False),
    ((-0.1, 0.5), False),
    ((0.5, 1.1), False),
])
def test_dllm_accuracy_band_needs_0_le_lo_le_hi_le_1(band, ok):
    from dllm_rl.config import SLIMRLConfig, TraceRLConfig

    if ok:
        assert SLIMRLConfig(accuracy_band=band).accuracy_band == band
        assert TraceRLConfig(accuracy_band=band).accuracy_band == band
    else:
        with pytest.raises(ValueError, match=r"needs 0 <= lo <= hi <= 1"):
            SLIMRLConfig(accuracy_band=band)


def test_dllm_method_defaults_are_the_papers():
    from dllm_rl.config import (
        ARGRPOConfig,
        DiffuGRPOConfig,
        ForkGRPOConfig,
        SLIMRLConfig,
        TraceRLConfig,
    )

    d1 = DiffuGRPOConfig()  # p = 0.15, clip 0.5, beta 0.04, d1's code does not divide by the std
    assert (d1.p_mask_prompt, d1.clip, d1.kl.beta, d1.scale) == (0.15, 0.5, 0.04, "none")
    trace = TraceRLConfig()  # clip 0.2, k3 KL 0.01
    assert (trace.clip, trace.kl.beta, trace.scale, trace.accuracy_band) == (0.2, 0.01, "group", None)
    slim = SLIMRLConfig()  # 3 nodes, s <= 0.2, clip(s, 0.9, 1.1), +-10, Dr.GRPO, 0.01 KL, band [0.2, 0.8]
    assert (slim.quadrature_points, slim.max_spread, slim.clip, slim.max_log_ratio) == (3, 0.2, 0.1, 10.0)
    assert (slim.scale, slim.kl.beta, slim.accuracy_band, slim.length_limit_wrong) == ("none", 0.01, (0.2, 0.8), True)
    fork = ForkGRPOConfig()  # beta = 0
    assert (fork.rows, fork.clip, fork.kl.beta, fork.scale) == ("fallback", 0.2, 0.0, "group")
    assert ARGRPOConfig().rows == "all"  # under strategy ar every token is a one-token step


def test_diffusion_model_and_rollout_bounds():
    from diffusion_rl.config import DiffusionModelConfig, DiffusionRolloutConfig

    assert DiffusionModelConfig(height=8, width=8).height == 8
    with pytest.raises(ValueError, match="height"):
        DiffusionModelConfig(height=7)
    with pytest.raises(ValueError, match="logprob_chunk chunks a language model's log-softmax"):
        DiffusionModelConfig(logprob_chunk=4)
    assert DiffusionRolloutConfig(num_steps=2, train_fraction=1.0).num_steps == 2
    with pytest.raises(ValueError, match="num_steps"):
        DiffusionRolloutConfig(num_steps=1)  # one step is the last, never stochastic
    assert DiffusionRolloutConfig(kind="cps", noise_level=1.0).noise_level == 1.0  # sin(pi / 2) = 1: std sigma_next
    with pytest.raises(ValueError, match=r"noise_level must lie in \[0, 1\] for kind cps, got 1.01"):
        DiffusionRolloutConfig(kind="cps", noise_level=1.01)
    with pytest.warns(UserWarning, match="above sqrt"):  # the SDE's a is unbounded, above sqrt(2) warned of
        assert DiffusionRolloutConfig(kind="sde", noise_level=1.5).noise_level == 1.5


def test_diffusion_window_stays_off_the_last_step():
    from diffusion_rl.config import DiffusionRolloutConfig

    # 10 steps (0..9), window 3: it may start at 0..6, so that it ends at step 8 at the latest
    assert DiffusionRolloutConfig(num_steps=10, window_size=9).window_size == 9
    assert DiffusionRolloutConfig(num_steps=10, window_size=3, window_start=(0, 6)).window_start == (0, 6)
    assert DiffusionRolloutConfig(num_steps=10, window_size=3, window_start=(4, 4)).window_start == (4, 4)
    with pytest.raises(ValueError, match=r"window_size \(10\) must be below num_steps \(10\)"):
        DiffusionRolloutConfig(num_steps=10, window_size=10)
    with pytest.raises(ValueError, match=r"window_start \[0, 7\] must be a range lo <= hi within 0..6"):
        DiffusionRolloutConfig(num_steps=10, window_size=3, window_start=(0, 7))
    with pytest.raises(ValueError, match=r"window_start \[5, 4\]"):
        DiffusionRolloutConfig(num_steps=10, window_size=3, window_start=(5, 4))


@pytest.mark.parametrize(("overrides", "said"), [
    (["method.type=cast", "method.projection=none", "method.global_weight=0.5", "method.patch_clip_range=0.1"],
     r"method.global_weight 0.5, method.patch_clip_range 0.1 unused with method.projection none"),
    (["method.type=ftfc", "method.guided=true"], r"method.guided true is unused with model.guidance_scale 1"),
])
def test_diffusion_settings_their_method_does_not_read_are_said_to_be_unused(overrides, said):
    from diffusion_rl import backend
    from diffusion_rl.config import DiffusionTrainConfig

    with pytest.warns(UserWarning, match=said):
        load_config(DiffusionTrainConfig, None, overrides, defaults=backend.DEFAULT_CONFIG)
    with warnings.catch_warnings():  # where they are read, or left at their defaults: nothing said
        warnings.simplefilter("error")
        for quiet in (["method.type=cast", "method.global_weight=0.5", "method.patch_clip_range=0.1"],
                      ["method.type=cast", "method.projection=none"],
                      ["method.type=ftfc", "method.guided=true", "model.guidance_scale=3.5"]):
            load_config(DiffusionTrainConfig, None, quiet, defaults=backend.DEFAULT_CONFIG)


def test_a_diffusion_window_start_without_a_window_size_is_said_to_be_unused():
    """window_start only places a window of window_size steps; without one every step but the last
    is stochastic and the start is ignored, with a warning that names the caller's line. The
    default (None), and a start with a size, say nothing."""
    from diffusion_rl import backend
    from diffusion_rl.config import DiffusionRolloutConfig, DiffusionTrainConfig

    with pytest.warns(UserWarning, match=r"rollout.window_start \[1, 2\] is unused without rollout.window_size: "
                                         r"every step but the last") as record:
        r = DiffusionRolloutConfig(num_steps=10, window_start=(1, 2))
    assert r.window_start == (1, 2) and r.window_size is None
    assert [w.filename for w in record] == [__file__]
    with pytest.warns(UserWarning, match=r"window_start \[0, 1\] is unused") as record:  # the CLI's default start
        load_config(DiffusionTrainConfig, None, ["rollout.window_size=null"], defaults=backend.DEFAULT_CONFIG)
    assert [w.filename for w in record] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DiffusionRolloutConfig(num_steps=10)
        DiffusionRolloutConfig(num_steps=10, window_size=2, window_start=(0, 1))
        load_config(DiffusionTrainConfig, None, [], defaults=backend.DEFAULT_CONFIG)  # the default run
        load_config(DiffusionTrainConfig, None, ["rollout.window_size=null", "rollout.window_start=null"],
                    defaults=backend.DEFAULT_CONFIG)


def test_diffusion_task_method_and_whole_config_checks():
    from diffusion_rl.config import CASTConfig, DiffusionTrainConfig, ShapesGenevalTaskConfig

    with pytest.raises(ValueError, match="unparsed=whole_prompt .* add an image atom"):
        ShapesGenevalTaskConfig(unparsed="whole_prompt")
    atoms = [{"type": "clip_score"}]
    assert ShapesGenevalTaskConfig(unparsed="whole_prompt", image_atoms=atoms).unparsed == "whole_prompt"
    assert ShapesGenevalTaskConfig(image_atoms=atoms).unparsed == "error"
    assert CASTConfig(atoms="nodes").parser == "shapes-geneval"
    assert CASTConfig(atoms="types", parser="mine.py:parse").atoms == "types"
    with pytest.raises(ValueError, match="atoms=nodes .* parser 'mine.py:parse' cannot name them"):
        CASTConfig(atoms="nodes", parser="mine.py:parse")
    with pytest.raises(ValueError, match="a reward_model atom scores text"):
        DiffusionTrainConfig(reward={"atoms": [{"reward_model": "some/model"}]})
    assert DiffusionTrainConfig().reward.overlong is None


def test_diffusion_method_defaults_are_flow_grpos():
    from diffusion_rl.config import (
        CASTConfig,
        DiffusionTrainConfig,
        EMAConfig,
        FTFCConfig,
        LoRAConfig,
    )

    cfg = DiffusionTrainConfig()
    assert cfg.task.held_out == "disjoint"  # held-out prompts never trained on
    r = cfg.rollout
    assert (r.num_steps, r.noise_level, r.kind, r.train_fraction, r.window_size) == (10, 0.7, "sde", 1.0, None)
    m = cfg.method  # A = (R - mean) / (std + 1e-4) clipped to +-5; ratio eps 1e-4; np.std's population std
    assert (m.type, m.adv_clip, m.std_eps, m.clip_range, m.adv_std, m.kl.beta, m.ema) == (
        "flow_grpo", 5.0, 1e-4, 1e-4, "population", 0.0, None)
    ema = EMAConfig()  # Flow-GRPO's train.ema: 0.9 every 8 steps, with warm-up
    assert (ema.decay, ema.update_every, ema.warmup) == (0.9, 8, True)
    assert (LoRAConfig().r, LoRAConfig().alpha) == (8, 16.0)
    ftfc = FTFCConfig()
    assert (ftfc.beta, ftfc.cap, ftfc.divergence, ftfc.pool_refresh) == (0.5, 4.0, "kl", 0)
    assert FTFCConfig(cap=1.0).cap == 1.0  # a cap of the mean weight: every group uniform
    with pytest.raises(ValueError, match="cap"):
        FTFCConfig(cap=0.99)
    cast = CASTConfig()
    assert (cast.window_from, cast.calibration_prompts, cast.global_weight, cast.atoms) == ("model", 32, 1.0, "types")


def test_a_config_files_environment_variables_are_expanded_and_an_unset_one_is_said(tmp_path, monkeypatch):
    """`output_dir: $SCRATCH/runs/x` in a file made a directory named "$SCRATCH" in the working
    directory without a word; set variables are expanded as a shell would, an unset one is kept
    with one warning, text that only looks like one ("$5") is left alone quietly, and "$$" is one "$"."""
    monkeypatch.setenv("MMRL_TEST_SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.delenv("MMRL_TEST_UNSET", raising=False)
    (tmp_path / "env.yaml").write_text("output_dir: $MMRL_TEST_SCRATCH/runs/x\n"
                                       "plugins: ['${MMRL_TEST_SCRATCH}/plugin.py']\n"
                                       "rollout: {stop: ['$$', 'costs $5']}\n")
    from mmrl.vlm.config import VLMTrainConfig  # its rollout has stop strings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(VLMTrainConfig, tmp_path / "env.yaml")
    assert cfg.output_dir == f"{tmp_path}/scratch/runs/x" and cfg.plugins == [f"{tmp_path}/scratch/plugin.py"]
    assert cfg.rollout.stop == ["$", "costs $5"]
    (tmp_path / "env.yaml").write_text("output_dir: $MMRL_TEST_UNSET/runs/x\n")
    with pytest.warns(UserWarning, match=r"env.yaml: output_dir names the environment variable \$MMRL_TEST_UNSET, "
                                         "which is not set: kept as written"):
        cfg = load_config(TrainConfig, tmp_path / "env.yaml")
    assert cfg.output_dir == "$MMRL_TEST_UNSET/runs/x"


@pytest.mark.parametrize(("overrides", "said"), [
    (["method.loss.max_len=64"], (r"method.loss.max_len 64 unused with method.loss.aggregation seq_mean_token_mean: "
                                 r"only seq_mean_token_sum_norm")),
    (["method.kl.kind=k1"], r"method.kl.kind k1 unused with method.kl.beta 0: there is no KL term"),
    (["method.dynamic_sampling.max_rounds=5"], (r"method.dynamic_sampling.max_rounds 5 unused with "
                                               r"method.dynamic_sampling.enabled false")),
    (["method.fastrl.tau=0.5", "method.fastrl.ars=true"], (r"method.fastrl.tau 0.5, method.fastrl.ars True unused "
                                                          r"with method.fastrl.enabled false: nothing is pruned")),
])
def test_grpo_settings_their_switch_leaves_off_are_said_to_be_unused(overrides, said):
    from mmrl.vlm.config import VLMTrainConfig

    with pytest.warns(UserWarning, match=said):
        load_config(VLMTrainConfig, None, overrides)
    with warnings.catch_warnings():  # switched on, they are read: nothing said
        warnings.simplefilter("error")
        for quiet in (["method.loss.max_len=64", "method.loss.aggregation=seq_mean_token_sum_norm"],
                      ["method.kl.kind=k1", "method.kl.beta=0.01"],
                      ["method.dynamic_sampling.max_rounds=5", "method.dynamic_sampling.enabled=true"],
                      ["method.fastrl.tau=0.5", "method.fastrl.enabled=true"]):
            load_config(VLMTrainConfig, None, quiet)
