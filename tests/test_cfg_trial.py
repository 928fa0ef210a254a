"""A researcher's own config files and --set lines (mmrl/core/config.py): YAML features and
edge cases that a hand-written config meets."""

import pytest

from mmrl.core.config import ConfigError, TrainConfig, load_config, read_yaml


def test_merge_keys_take_an_anchored_mapping_and_the_keys_written_beside_them_win(tmp_path):
    # `<<: *anchor` was refused as "could not determine a constructor for the tag ...merge":
    # the duplicate-key check constructed the merge key itself before the base merged it
    path = tmp_path / "run.yaml"
    path.write_text("method:\n  loss: &loss {clip_low: 0.1, clip_high: 0.3}\n"
                    "  kl:\n    beta: 0.01\n"
                    "optim:\n  <<: {lr: 3.0e-6, weight_decay: 0.1}\n  weight_decay: 0.2\n")
    cfg = load_config(TrainConfig, path)
    assert (cfg.optim.lr, cfg.optim.weight_decay) == (3e-6, 0.2)  # the key written beside << wins
    assert (cfg.method.loss.clip_low, cfg.method.loss.clip_high) == (0.1, 0.3)


def test_a_key_written_twice_beside_a_merge_key_is_still_a_duplicate(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  <<: {lr: 3.0e-6}\n  lr: 1.0e-6\n  lr: 2.0e-6\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'lr' \(lines 3 and 4\)"):
        read_yaml(path)


def test_a_yaml_error_points_into_the_file_not_into_a_unicode_string(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n\tlr: 1.0e-6\n")  # a tab indents
    with pytest.raises(ConfigError) as e:
        read_yaml(path)
    assert f'in "{path}", line 2, column 1' in str(e.value) and "<unicode string>" not in str(e.value)


@pytest.mark.parametrize("text", ["1e5", "1e-5", "-2E+3", "0o17", "0x1F", "1_000", "no", "on", "010", "20:00",
                                  "True", "~", "null", ".inf", "3.0", "lr1e-5", "plain"])
def test_dump_yaml_quotes_each_string_a_loader_would_read_as_another_type(text):
    import yaml

    from mmrl.core.config import _yaml, dump_yaml

    # yaml.safe_dump wrote "1e-5" and "0o17" plain; read_yaml (YAML 1.2) loads those as numbers
    dumped = dump_yaml({"name": text, "lr": 1e-5, "n": 8, "on": True, "none": None})
    for load in (_yaml, yaml.safe_load):
        assert load(dumped) == {"name": text, "lr": 1e-5, "n": 8, "on": True, "none": None}, dumped


@pytest.mark.parametrize("override, key", [("output_dir=", "output_dir"), ("output_dir=' '", "output_dir"),
                                           ("model.path=", "model.path")])
def test_an_empty_output_dir_or_model_path_is_refused_naming_the_key(override, key):
    # `--set output_dir=$OUT` with OUT unset: "" wrote the run into the working directory, and
    # a model.path of "" resolved to the config file's directory
    with pytest.raises(ConfigError, match=rf"invalid config: {key}: '\s*' is empty"):
        load_config(TrainConfig, overrides=[override])


@pytest.mark.parametrize("given", ["optim=null", "rollout.scheduler=~"])
def test_a_section_given_as_null_says_to_leave_it_out(given, tmp_path):
    key = given.split("=")[0]
    with pytest.raises(ConfigError, match=rf"invalid config: {key} is empty \(null\) where a section is due: "
                                          rf"leave {key} out for its defaults$"):
        load_config(TrainConfig, overrides=[given])
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  # lr: 1.0e-6\n")  # every key under it commented out: null
    with pytest.raises(ConfigError, match=r"optim is empty \(null\) where a section is due"):
        load_config(TrainConfig, path)


@pytest.mark.parametrize("given, note", [
    ("optim.max_grad_norm=None", r"\(got 'None'\): 'None' is a string in YAML; null \(or ~\) is none"),
    ("logging.wandb.name=1e-5", r"\(got 1e-05\): YAML read it as a number; quote it to give a string"),
    ("logging.wandb.tags=[2024]", r"tags.0: .*\(got 2024\): YAML read it as an integer; quote it"),
    ("output_dir=true", r"\(got True\): YAML read it as a boolean; quote it"),
])
def test_a_value_yaml_read_otherwise_than_meant_says_how_to_write_it(given, note):
    with pytest.raises(ConfigError, match=note):
        load_config(TrainConfig, overrides=[given])
    assert load_config(TrainConfig, overrides=["logging.wandb.name='1e-5'"]).logging.wandb.name == "1e-5"


def test_a_key_path_into_a_list_says_to_give_the_whole_list():
    # was "reward.atoms is a value, not a section": a list is none of the two
    with pytest.raises(ConfigError, match=r"override 'reward.atoms.0.weight=2': reward.atoms is a list, and --set "
                                          r"reaches into sections only: give the whole list, e.g. "
                                          r"--set 'reward.atoms=\[...\]'"):
        load_config(TrainConfig, overrides=["reward.atoms=[{path: a.py:f}]", "reward.atoms.0.weight=2"])


def test_plugins_in_a_config_file_take_environment_variables_as_its_other_paths_do(tmp_path, monkeypatch):
    import warnings

    from mmrl.core import plugins

    # the CLI reads `plugins` before the config (plugins.requested): "$PROJECT/my_method.py"
    # stayed as written there, "file not found: <config dir>/$PROJECT/my_method.py"
    monkeypatch.setenv("MMRL_TEST_PROJECT", str(tmp_path))
    path = tmp_path / "run.yaml"
    path.write_text("plugins: [$MMRL_TEST_PROJECT/my_method.py]\n")
    assert plugins.requested(path, [], {}) == [f"{tmp_path}/my_method.py"]
    monkeypatch.delenv("MMRL_TEST_PROJECT")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # unset: said once, when load_config reads the file
        assert plugins.requested(path, [], {}) == ["$MMRL_TEST_PROJECT/my_method.py"]
    with pytest.raises(ConfigError, match=r"file not found: .*my_method.py \(it names an environment variable "
                                          r"that is not set\)"):
        plugins.config_class(TrainConfig, path, [], {})


def test_a_whole_section_given_by_set_says_which_keys_it_returned_to_their_defaults(tmp_path):
    import warnings

    # --set replaces a section given as a mapping (a file's merges): DAPO's token_mean went back
    # to seq_mean_token_mean without a word
    path = tmp_path / "dapo.yaml"
    path.write_text("method: {loss: {clip_high: 0.28, aggregation: token_mean}}\n")
    with pytest.warns(UserWarning, match=r"--set method.loss=\{clip_high: 0.3\} replaces the whole method.loss "
                                         r"section: method.loss.aggregation \"token_mean\" -> \"seq_mean_token_mean\" "
                                         r"\(its defaults\); give only the keys to change"):
        cfg = load_config(TrainConfig, path, ["method.loss={clip_high: 0.3}"])
    assert (cfg.method.loss.clip_high, cfg.method.loss.aggregation) == (0.3, "seq_mean_token_mean")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing lost: every key given, or set again after, or a new type
        load_config(TrainConfig, path, ["method.loss={clip_high: 0.3, aggregation: token_mean}"])
        load_config(TrainConfig, path, ["method.loss={clip_high: 0.3}", "method.loss.aggregation=token_mean"])
        load_config(TrainConfig, None, ["optim={lr: 2e-6}", "method.advantage={type: rloo}"])
    with warnings.catch_warnings(record=True) as said:  # a later type change: only that is said
        warnings.simplefilter("always")
        load_config(TrainConfig, None, ["method.advantage={scale: none}", "method.advantage.type=rloo"])
    assert [str(w.message) for w in said if "replaces the whole" in str(w.message)] == []


def test_a_name_that_looks_like_a_number_round_trips_through_config_and_a_runs_config_yaml(tmp_path):
    # `config` (commented_config) and the run's config.yaml wrote "1e-5" plain with safe_dump, and
    # the config loader's YAML 1.2 rules read it back as a float: exit 2 on the printed file
    from mmrl.core.config_doc import commented_config
    from mmrl.core.trainer import Trainer

    overrides = ["logging.wandb={name: '1e-5', tags: ['0o17', '2e3']}"]
    cfg = load_config(TrainConfig, overrides=overrides)
    printed = tmp_path / "printed.yaml"
    printed.write_text(commented_config(cfg))
    again = load_config(TrainConfig, printed)
    assert (again.logging.wandb.name, again.logging.wandb.tags) == ("1e-5", ["0o17", "2e3"])
    # the run's config.yaml, as a 1-step toy run writes it, loads back as its --config
    from tests import toy
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG,
                      overrides=[f"output_dir={tmp_path / 'run'}", "train.max_steps=1", *overrides])
    Trainer(cfg, *toy.build(cfg)).train()
    run = load_config(TrainConfig, tmp_path / "run" / "config.yaml")
    assert (run.logging.wandb.name, run.logging.wandb.tags) == ("1e-5", ["0o17", "2e3"])


@pytest.mark.parametrize("given, expected", [("~/runs/x", "{home}/runs/x"), ("runs/x/", "runs/x"), ("/", "/")])
def test_output_dir_takes_a_home_folder_and_no_trailing_slash(given, expected):
    # a file's or a quoted --set's "~/runs" made a folder named "~" in the working directory (no
    # shell expanded it), and "run/" printed its files as run//summary.json
    import os

    cfg = load_config(TrainConfig, overrides=[f"output_dir={given}"])
    assert cfg.output_dir == expected.format(home=os.path.expanduser("~"))
