"""A method of one's own on the command line (mmrl.core.plugins): a config names a plugin file
that registers the method and defines CONFIG_CLASS; train, --resume from elsewhere and eval
find it again through the run's config.yaml."""

from __future__ import annotations

import json
import re
import textwrap
import warnings

import pytest
import yaml
from typer.testing import CliRunner

from dllm_rl.cli import app
from mmrl.core import plugins

PLUGIN = textwrap.dedent('''
    from typing import Annotated, Literal

    from pydantic import Field

    from dllm_rl.config import DiffuGRPOConfig, DLLMTrainConfig, MethodConfig
    from dllm_rl.methods.diffu_grpo import DiffuGRPO
    from mmrl.core.method import register_method

    CALLS = []


    class HalfNegConfig(DiffuGRPOConfig):
        type: Literal["half_neg"] = "half_neg"
        neg_scale: float = 0.5


    class CONFIG_CLASS(DLLMTrainConfig):
        method: Annotated[MethodConfig | HalfNegConfig, Field(discriminator="type")] = Field(
            default_factory=DiffuGRPOConfig)


    @register_method("half_neg")
    class HalfNeg(DiffuGRPO):
        def advantages(self, batch):
            adv = super().advantages(batch)
            CALLS.append(self.cfg.neg_scale)
            return adv.where(adv > 0, adv * self.cfg.neg_scale)
''')
SMALL = {"rollout": {"prompts_per_step": 2, "num_generations": 4}, "task": {"num_train": 20, "num_eval": 4},
         "logging": {"tensorboard": False, "progress": False}}


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_a_plugin_method_trains_resumes_elsewhere_and_evaluates(tmp_path, monkeypatch, one_thread):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "half_neg.py").write_text(PLUGIN)
    config = tmp_path / "cfg" / "run.yaml"
    config.write_text(yaml.safe_dump({"plugins": ["half_neg.py"], "method": {"type": "half_neg", "neg_scale": 0.25},
                                      **SMALL}))
    run = tmp_path / "run"
    r = invoke("train", "-c", config, "--max-steps", 1, "-o", run)
    assert r.exit_code == 0, (r.output[-2000:], r.exception)
    module = plugins._imported[(tmp_path / "cfg" / "half_neg.py").resolve()]
    assert module.CALLS == [0.25]  # the plugin's method trained, with its own setting
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["plugins"] == [str((tmp_path / "cfg" / "half_neg.py").resolve())]
    assert saved["method"]["type"] == "half_neg" and saved["method"]["neg_scale"] == 0.25
    monkeypatch.chdir(tmp_path)  # the run's config.yaml names the plugin by its absolute path
    r = invoke("train", "--resume", "-o", run, "--max-steps", 2)
    assert r.exit_code == 0, (r.output[-2000:], r.exception)
    assert module.CALLS == [0.25, 0.25]
    r = invoke("eval", "--checkpoint", run)
    assert r.exit_code == 0, (r.output[-2000:], r.exception)
    (metrics,) = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert "accuracy" in metrics


@pytest.mark.parametrize(("files", "plugin_list", "match"), [
    ({}, ["nope.py"], "plugins: 'nope.py': file not found"),
    ({"bad.py": "raise RuntimeError('broken plugin')\n"}, ["bad.py"], "plugins: 'bad.py': importing .*broken plugin"),
    ({"a.py": "from dllm_rl.config import DLLMTrainConfig as CONFIG_CLASS\n",
      "b.py": "from dllm_rl.config import DLLMTrainConfig as CONFIG_CLASS\n"}, ["a.py", "b.py"],
     "2 files define CONFIG_CLASS"),
    ({"c.py": "from mmrl.vlm.config import VLMTrainConfig as CONFIG_CLASS\n"}, ["c.py"],
     "CONFIG_CLASS must be a subclass of DLLMTrainConfig"),
    ({}, "half_neg.py", "plugins: a list of Python file paths is needed"),
    ({"mine.py": "from dllm_rl.methods.diffu_grpo import DiffuGRPO\nfrom mmrl.core.method import register_method\n"
                 "register_method('diffu_grpo')(type('Mine', (DiffuGRPO,), {}))\n"}, ["mine.py"],
     r"method 'diffu_grpo' is built in \(dllm_rl.methods.diffu_grpo.DiffuGRPO\): register Mine \(in .*\) under a name"),
    ({"script.py": "import sys\nsys.exit('usage: script.py ARG')\n"}, ["script.py"],
     "plugins: 'script.py': importing .*usage: script.py ARG"),
])
def test_bad_plugins_are_one_line_errors(tmp_path, files, plugin_list, match):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"plugins": plugin_list}))
    r = invoke("train", "-c", config, "-o", tmp_path / "run")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output[-2000:]
    assert re.search(match, r.output), r.output[-2000:]


def test_only_a_built_in_name_is_refused_and_the_newest_registration_wins(monkeypatch):
    """register_method: a plugin may take over a name another plugin registered (the newer class
    builds it), and a built-in package may take over a built-in name; only a plugin naming a
    built-in method is refused, and the built-in one stays."""
    from mmrl.core import method as core_method
    from mmrl.core.method import Method, register_method

    monkeypatch.setattr(core_method, "METHODS", dict(core_method.METHODS))  # this test's registrations only

    def cls(module):
        return type(f"From_{module.replace('.', '_')}", (Method,), {"__module__": module})

    first, second = cls("plugin_a"), cls("plugin_b")
    assert register_method("shared_only_here")(first) is first
    assert register_method("shared_only_here")(second) is second
    assert core_method.METHODS["shared_only_here"] is second
    builtin, newer_builtin = cls("dllm_rl.one"), cls("mmrl.other")
    register_method("built_in_only_here")(builtin)
    register_method("built_in_only_here")(newer_builtin)
    assert core_method.METHODS["built_in_only_here"] is newer_builtin
    with pytest.raises(ValueError, match="'built_in_only_here' is built in"):
        register_method("built_in_only_here")(cls("plugin_c"))
    assert core_method.METHODS["built_in_only_here"] is newer_builtin
    # the other order: a plugin registered before its backend's methods were imported
    register_method("plugin_first_here")(cls("plugin_d"))
    with pytest.raises(ValueError, match=r"'plugin_first_here' is built in \(mmrl.late.*From_plugin_d \(in plugin_d\)"):
        register_method("plugin_first_here")(cls("mmrl.late"))


def test_a_plugin_that_fails_after_registering_leaves_no_method_behind(tmp_path):
    from mmrl.core.method import METHODS

    before = dict(METHODS)
    (tmp_path / "half.py").write_text(PLUGIN + "\nraise RuntimeError('late failure')\n")
    with pytest.raises(plugins.ConfigError, match="late failure"):
        plugins.load(["half.py"], tmp_path)
    assert METHODS == before


def test_a_method_registered_by_a_plugin_that_then_fails_is_unregistered(tmp_path):
    """Whatever ran before: a name no other test registers, so it cannot be in METHODS already."""
    from mmrl.core.method import METHODS

    (tmp_path / "late.py").write_text(PLUGIN.replace('"half_neg"', '"late_failure_only"')
                                      + "\nraise RuntimeError('late failure')\n")
    with pytest.raises(plugins.ConfigError, match="late failure"):
        plugins.load(["late.py"], tmp_path)
    assert "late_failure_only" not in METHODS


def test_requested_reads_only_the_plugins_override_and_refuses_empty_names():
    assert plugins.requested(None, ["plugins=[a.py, b.py]", "method.type=x"], {"plugins": []}) == ["a.py", "b.py"]
    assert plugins.requested(None, ["train.max_steps=3"], {"plugins": ["d.py"]}) == ["d.py"]
    with pytest.raises(plugins.ConfigError, match="a list of Python file paths is needed"):
        plugins.requested(None, [], {"plugins": [""]})


def test_a_plugin_file_named_as_a_reward_atom_too_is_imported_once(tmp_path, one_thread):
    (tmp_path / "half_neg.py").write_text(PLUGIN + "\nCALLS.append(__name__)\n\n\ndef positive(sample):\n"
                                          "    return 1.0\n")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"plugins": ["half_neg.py"], "method": {"type": "half_neg", "neg_scale": 0.25},
                                      "reward": {"atoms": ["half_neg.py:positive"]}, **SMALL}))
    r = invoke("train", "-c", config, "--max-steps", 1, "-o", tmp_path / "run")
    assert r.exit_code == 0, (r.output[-2000:], r.exception)
    module = plugins._imported[(tmp_path / "half_neg.py").resolve()]
    assert module.CALLS == [module.__name__, 0.25]  # one import; its own method trained


def test_a_process_engine_reads_the_plugins_config_too(tmp_path):
    """`placement: process` hands the config to `python -m mmrl.core.serve`, which must know the
    plugin's method to read it: the plugin paths travel absolute."""
    from mmrl.core.serve import build_policy

    (tmp_path / "half_neg.py").write_text(PLUGIN)
    assert plugins.absolute(["half_neg.py"], tmp_path) == [str((tmp_path / "half_neg.py").resolve())]
    _, cfg = build_policy("dllm_rl.backend", {"plugins": plugins.absolute(["half_neg.py"], tmp_path),
                                              "method": {"type": "half_neg", "neg_scale": 0.1}})
    assert cfg.method.type == "half_neg" and cfg.method.neg_scale == 0.1


# ---------------------------------------------------------------------------- audit: what the suite let through


def test_requested_applies_no_override_but_plugins():
    # the others are applied once, when the config is read: here they would warn twice (a type
    # given after its section's keys) or fail early (a value made a section)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = plugins.requested(None, ["method.clip=1", "method.type=x", "train=3", "train.max_steps=2",
                                       "plugins=[a.py]"], {})
    assert got == ["a.py"]


def test_a_directory_named_as_a_plugin_is_not_found(tmp_path):
    (tmp_path / "pkg.py").mkdir()
    with pytest.raises(plugins.ConfigError, match="plugins: 'pkg.py': file not found"):
        plugins.load(["pkg.py"], tmp_path)


def test_absolute_plugin_paths_are_resolved(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "p.py").write_text("")
    assert plugins.absolute(["sub/../p.py"], tmp_path) == [str((tmp_path / "p.py").resolve())]


def test_a_config_class_that_is_not_a_class_is_a_config_error(tmp_path):
    from dllm_rl.config import DLLMTrainConfig

    (tmp_path / "five.py").write_text("CONFIG_CLASS = 5\n")
    with pytest.raises(plugins.ConfigError, match="five.py: CONFIG_CLASS must be a subclass of DLLMTrainConfig, got 5"):
        plugins.config_class(DLLMTrainConfig, None, [], {"plugins": [str(tmp_path / "five.py")]})


def test_one_plugin_file_named_twice_is_one_plugin(tmp_path):
    from dllm_rl.config import DLLMTrainConfig

    (tmp_path / "sub").mkdir()
    (tmp_path / "twice.py").write_text("from dllm_rl.config import DLLMTrainConfig\n\n"
                                       "class CONFIG_CLASS(DLLMTrainConfig):\n    pass\n")
    names = ["twice.py", str(tmp_path / "twice.py"), "sub/../twice.py"]  # three spellings of one file
    assert len(plugins.load(names, tmp_path)) == 1
    cls = plugins.config_class(DLLMTrainConfig, None, [], {"plugins": [str(tmp_path / "twice.py")] * 2})
    assert cls.__name__ == "CONFIG_CLASS" and issubclass(cls, DLLMTrainConfig)
