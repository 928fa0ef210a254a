"""A config file built on others (`base:`), and `$$` for a literal dollar sign (mmrl.core.config)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from mmrl.core.config import (
    ConfigError,
    TrainConfig,
    dump_yaml,
    expand_env,
    load_config,
    read_config_file,
)
from mmrl.core.runconfig import absolute_paths


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_base_is_merged_under_the_file_that_names_it(tmp_path):
    """This file wins key by key; a list is replaced, not concatenated; of a list of bases the
    later wins; a section whose type changes is replaced; no `base` is left in the config."""
    write(tmp_path / "common.yaml", "seed: 1\noptim: {lr: 1.0e-4, betas: [0.8, 0.9], weight_decay: 0.1}\n"
                                    "rollout: {num_generations: 4, prompts_per_step: 2}\n"
                                    "method: {type: grpo, loss: {clip_high: 0.28}}\n"
                                    "logging: {wandb: {tags: [a, b]}}\n")
    write(tmp_path / "small.yaml", "seed: 2\nrollout: {num_generations: 2}\n")
    top = write(tmp_path / "exp.yaml", "base: [common.yaml, small.yaml]\noptim: {lr: 5.0e-5, betas: [0.7, 0.8]}\n"
                                       "logging: {wandb: {tags: [c]}}\n")
    cfg = load_config(TrainConfig, top)
    assert cfg.seed == 2  # small.yaml, the later base, over common.yaml
    assert (cfg.rollout.num_generations, cfg.rollout.prompts_per_step) == (2, 2)  # each key from the last that set it
    assert (cfg.optim.lr, cfg.optim.betas, cfg.optim.weight_decay) == (5e-5, (0.7, 0.8), 0.1)  # this file wins
    assert cfg.logging.wandb.tags == ["c"]  # replaced, not [a, b, c]
    assert cfg.method.loss.clip_high == 0.28
    assert "base" not in read_config_file(top)
    # a run's config.yaml (the trainer writes this dump) is the merged config, standing alone
    saved = dump_yaml(absolute_paths(cfg.model_dump(mode="json"), cfg.base_dir), sort_keys=False)
    assert "base" not in yaml.safe_load(saved)
    again = load_config(TrainConfig, write(tmp_path / "elsewhere" / "config.yaml", saved))
    assert again.model_dump() == cfg.model_dump()


def test_a_section_of_another_type_replaces_the_bases(tmp_path):
    write(tmp_path / "b.yaml", "method: {type: grpo, advantage: {type: group, scale: none}}\n")
    top = write(tmp_path / "t.yaml", "base: b.yaml\nmethod: {advantage: {type: rloo}}\n")
    assert load_config(TrainConfig, top).method.advantage.type == "rloo"  # no `scale` carried into rloo


def test_a_bases_relative_paths_stay_relative_to_the_base(tmp_path, monkeypatch):
    """model.path, data files and plugins written in a base name files beside the base, also
    through a base of a base; the top file's own paths still start at its directory."""
    shared = tmp_path / "shared"
    write(shared / "data" / "train.jsonl", "{}\n")
    (shared / "models" / "tiny").mkdir(parents=True)
    write(shared / "deeper" / "prompts.txt", "x\n")
    write(shared / "deeper" / "root.yaml", "task: {prompts: prompts.txt, train_path: nowhere/else.jsonl}\n")
    write(shared / "common.yaml", "base: deeper/root.yaml\nmodel: {path: models/tiny}\n"
                                  "task: {train_path: data/train.jsonl}\nplugins: [my_plugin.py]\n")
    write(shared / "my_plugin.py", "")
    write(tmp_path / "exp" / "mine.jsonl", "{}\n")
    top = write(tmp_path / "exp" / "a.yaml", "base: ../shared/common.yaml\ntask: {eval_path: mine.jsonl}\n")
    monkeypatch.chdir(tmp_path)  # none of it is relative to the working directory
    cfg = load_config(TrainConfig, Path("exp/a.yaml"))
    assert cfg.model.path == str(shared / "models" / "tiny")
    assert cfg.plugins == [str(shared / "my_plugin.py")]
    assert cfg.task == {"prompts": str(shared / "deeper" / "prompts.txt"),  # the base of the base's
                        "train_path": str(shared / "data" / "train.jsonl"),  # common.yaml's, over root.yaml's
                        "eval_path": "mine.jsonl"}  # the top file's own: resolved against base_dir, as before
    assert cfg.base_dir == str(top.parent)
    from mmrl.core import plugins

    assert plugins.requested(top, [], {}) == [str(shared / "my_plugin.py")]  # the CLI imports a base's plugins


def test_a_cycle_of_bases_is_refused_naming_the_chain(tmp_path):
    a = write(tmp_path / "a.yaml", "seed: 1\nbase: b.yaml\n")
    write(tmp_path / "b.yaml", "base: [c.yaml]\n")
    write(tmp_path / "c.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, a)
    assert str(e.value) == (f"{tmp_path}/c.yaml, line 1: base 'a.yaml' makes a cycle of bases: {tmp_path}/a.yaml -> "
                            f"{tmp_path}/b.yaml -> {tmp_path}/c.yaml -> {tmp_path}/a.yaml")
    write(tmp_path / "self.yaml", "base: ./self.yaml\n")
    with pytest.raises(ConfigError, match="makes a cycle of bases: .*self.yaml -> .*self.yaml$"):
        load_config(TrainConfig, tmp_path / "self.yaml")


def test_the_same_base_twice_is_no_cycle(tmp_path):
    write(tmp_path / "common.yaml", "seed: 3\n")
    write(tmp_path / "b.yaml", "base: common.yaml\n")
    assert load_config(TrainConfig, write(tmp_path / "a.yaml", "base: [common.yaml, b.yaml]\n")).seed == 3


@pytest.mark.parametrize(("base", "said"), [
    ("nope.yaml", r"a.yaml, line 2: base 'nope.yaml': config file '{d}/nope.yaml' does not exist$"),
    ("[sub]", r"a.yaml, line 2: base 'sub': config file '{d}/sub' is a directory, not a YAML file$"),
    ("bad.yaml", r"a.yaml, line 2: base 'bad.yaml': config file '{d}/bad.yaml' is not valid YAML: "),
    ("$MMRL_TEST_UNSET/c.yaml", (r"a.yaml, line 2: base '\$MMRL_TEST_UNSET/c.yaml' \(it names an environment "
                                 r"variable that is not set\): config file '{d}/\$MMRL_TEST_UNSET/c.yaml' does not")),
    ("3", r"a.yaml, line 2: base takes a config file's path or a list of them \(relative to {d}\), got 3$"),
    ("[a.yaml, '']", r"a.yaml, line 2: base takes a config file's path or a list of them"),
])
def test_a_bad_base_names_the_file_and_the_line_of_base(tmp_path, monkeypatch, base, said):
    monkeypatch.delenv("MMRL_TEST_UNSET", raising=False)
    (tmp_path / "sub").mkdir()
    write(tmp_path / "bad.yaml", "x: [\n")
    top = write(tmp_path / "a.yaml", f"seed: 1\nbase: {base}\n")
    with warnings.catch_warnings(), pytest.raises(ConfigError, match=said.format(d=tmp_path)):
        warnings.simplefilter("ignore")  # the unset variable's own warning
        load_config(TrainConfig, top)


def test_a_bad_key_in_a_base_names_the_base(tmp_path):
    write(tmp_path / "b.yaml", "optim: {lrr: 1}\n")
    top = write(tmp_path / "a.yaml", "base: b.yaml\nseed: 1\n")
    with pytest.raises(ConfigError, match=rf"^invalid config in {tmp_path}/b.yaml \(a base of {top}\): unknown key "
                                          r"'optim.lrr' \(did you mean 'optim.lr'\?\)$"):
        load_config(TrainConfig, top)
    with pytest.raises(ConfigError, match=r"--set base=\.\.\.: a config's base files are named in the config file"):
        load_config(TrainConfig, top, ["base=other.yaml"])


def test_a_base_of_another_backend_is_refused(tmp_path):
    """A diffusion config on a VLM one: refused even where this file replaces the method, which
    would otherwise merge into a valid config with the VLM file's other settings."""
    from diffusion_rl import cli

    vlm = Path(__file__).resolve().parents[1] / "configs" / "vlm" / "dapo.yaml"
    write(tmp_path / "on_top.yaml", f"base: {vlm}\nmethod: {{type: flow_grpo}}\n")
    write(tmp_path / "plain.yaml", f"base: {vlm}\n")
    result = CliRunner().invoke(cli.app, ["config", "--config", str(tmp_path / "on_top.yaml")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert (f"error: {vlm}, a base of {tmp_path}/on_top.yaml, sets method 'grpo', not one of this config's (flow_grpo, "
            "ftfc, cast): is it another backend's config?") in " ".join(result.output.split())
    result = CliRunner().invoke(cli.app, ["config", "--config", str(tmp_path / "plain.yaml")])
    assert result.exit_code == 2  # as a VLM config given to diffusion-rl is
    assert (f"error: {tmp_path}/plain.yaml sets method 'grpo', a `mmrl` method, not one of `diffusion-rl`'s: run it "
            "with `mmrl train`") in " ".join(result.output.split())


def test_config_prints_the_merged_config(tmp_path):
    from mmrl import cli

    write(tmp_path / "b.yaml", "optim: {lr: 2.0e-4, weight_decay: 0.5}\n")
    write(tmp_path / "a.yaml", "base: b.yaml\noptim: {lr: 3.0e-4}\n")
    result = CliRunner().invoke(cli.app, ["config", "--config", str(tmp_path / "a.yaml"), "--keys", "optim"])
    assert result.exit_code == 0, result.output
    printed = yaml.safe_load(result.output)
    assert (printed["optim"]["lr"], printed["optim"]["weight_decay"]) == (3e-4, 0.5) and "base" not in printed


def test_two_dollar_signs_are_one(monkeypatch):
    """`$$` writes a literal `$` (a price, a regex that names $HOME); $NAME and ${NAME} are as before."""
    monkeypatch.setenv("MMRL_TEST_HOME", "/h")
    monkeypatch.delenv("MMRL_TEST_UNSET", raising=False)
    data = {"price": "$$5", "literal": "$$MMRL_TEST_HOME", "both": "$$$MMRL_TEST_HOME", "braces": "${MMRL_TEST_HOME}$$",
            "plain": "$MMRL_TEST_HOME/x", "lone": "costs $5", "end": "a$"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "$$MMRL_TEST_UNSET" is no variable: nothing to say
        assert expand_env({**data, "quiet": "$$MMRL_TEST_UNSET"}, "f.yaml") == {
            "price": "$5", "literal": "$MMRL_TEST_HOME", "both": "$/h", "braces": "/h$", "plain": "/h/x",
            "lone": "costs $5", "end": "a$", "quiet": "$MMRL_TEST_UNSET"}
    with pytest.warns(UserWarning, match=r"f.yaml: x names the environment variable \$MMRL_TEST_UNSET, which is not"):
        assert expand_env({"x": "$$-$MMRL_TEST_UNSET"}, "f.yaml") == {"x": "$-$MMRL_TEST_UNSET"}


def test_a_base_is_expanded_once(tmp_path, monkeypatch):
    """A base's `$$` is one `$` in the merged config, not expanded again by the file on top."""
    monkeypatch.setenv("MMRL_TEST_HOME", "/h")
    write(tmp_path / "b.yaml", "output_dir: $$MMRL_TEST_HOME/$MMRL_TEST_HOME\n")
    assert load_config(TrainConfig, write(tmp_path / "a.yaml", "base: b.yaml\n")).output_dir == "$MMRL_TEST_HOME//h"
