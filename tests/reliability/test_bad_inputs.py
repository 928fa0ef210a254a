"""The bad-input catalogue (docs/errors.md): one parametrised case per row.

Every row runs the real CLI of its modality in process (typer's CliRunner) with tiny
settings and checks what a user sees: the exit code (2 for a user error, 0 for a row that is
a documented counted skip or a resize), that the output names the key, file or sample at
fault, and that no traceback is printed. Bad model directories are damaged copies of the
bundled tiny models (assets/ is never touched).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import diffusers.utils.logging
import pytest
import transformers.utils.logging
from PIL import Image
from typer.testing import CliRunner

from diffusion_rl.cli import app as diffusion_app
from dllm_rl.cli import app as dllm_app
from mmrl.cli import app as vlm_app

# transformers binds its log handler to sys.stderr on first use; do that now, not inside a
# CliRunner call whose stderr is closed afterwards ("--- Logging error ---" in later tests).
transformers.utils.logging.get_logger("transformers")
diffusers.utils.logging.get_logger("diffusers")

ASSETS = Path(__file__).resolve().parents[2] / "assets"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
APPS = {"vlm": vlm_app, "diffusion": diffusion_app, "dllm": dllm_app}
MODULES = {"vlm": "mmrl", "diffusion": "diffusion_rl", "dllm": "dllm_rl"}

# Tiny settings that make a run (or a build) take seconds on one CPU thread.
QUICK = ["logging.tensorboard=false", "logging.progress=false", "train.max_steps=1"]
TINY = {
    "vlm": ["rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_new_tokens=8",
            "rollout.eval_samples=0", "task.num_train=4", "task.num_eval=2"],
    "diffusion": ["rollout.prompts_per_step=1", "rollout.num_generations=2", "rollout.num_steps=2",
                  "rollout.window_size=1", "rollout.window_start=[0,0]", "task.num_train=4", "task.num_eval=2", "task.grid_prompts=2"],
    "dllm": ["rollout.prompts_per_step=2", "rollout.num_generations=2", "task.num_train=4", "task.num_eval=2"],
    # a jsonl task has no num_train / num_eval: its files are small
    "vlm-jsonl": ["rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_new_tokens=8",
                  "rollout.eval_samples=0"],
    "dllm-jsonl": ["rollout.prompts_per_step=2", "rollout.num_generations=2"],
}


@dataclass
class Row:
    modality: str
    args: Callable[[Path], list[str]]
    """The command line after the program name, given the test's tmp_path (which it may fill)."""
    needles: Callable[[Path], list[str]]
    """Strings the output must contain: the key, file or sample at fault."""
    code: int = 2
    warns: str | None = None
    """A counted skip: a UserWarning matching this is expected (pytest captures warnings)."""
    tiny: str | None = ""
    """Which TINY settings to add: "" = the modality's, None = none (the row sets its own)."""
    extra: Callable[[Path, str], None] | None = field(default=None)
    """More checks on (tmp_path, output)."""
    isolated: bool = False
    """Run the CLI in a subprocess: running a model's own code registers its classes with
    transformers' Auto* mappings for the rest of the process, which would leak into later tests."""


def invoke(modality: str, args: list[str]):
    return CliRunner().invoke(APPS[modality], [str(a) for a in args])


def sets(*pairs: str) -> list[str]:
    return [x for p in pairs for x in ("--set", p)]


def train(tmp: Path, *pairs: str, verb: str = "train") -> list[str]:
    out = ["--output-dir", str(tmp / "run")] if verb == "train" else sets(f"output_dir={tmp / 'run'}")
    return [verb, *out, *sets(*pairs)]


def check(row: Row, tmp_path: Path) -> str:
    args = row.args(tmp_path)
    if row.tiny is not None:  # right after the verb, so the row's own (bad) settings win
        tiny = sets(*QUICK[:2], *(QUICK[2:] if args[0] == "train" else []), *TINY[row.tiny or row.modality])
        args = [args[0], *tiny, *args[1:]]
    if row.isolated:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",  # one stream, in order
               "HF_MODULES_CACHE": str(tmp_path / "hf_modules")}
        proc = subprocess.run([sys.executable, "-m", MODULES[row.modality], *map(str, args)], check=False,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=600)
        text, code, exception = proc.stdout, proc.returncode, None
    elif row.warns:
        with pytest.warns(UserWarning, match=row.warns):
            result = invoke(row.modality, args)
        text, code, exception = result.output, result.exit_code, result.exception
    else:
        result = invoke(row.modality, args)
        text, code, exception = result.output, result.exit_code, result.exception
    assert code == row.code, (text[-3000:], exception)
    assert "Traceback" not in text
    if row.code == 2:  # a user error: one paragraph, no exception escaped the CLI
        assert row.isolated or isinstance(exception, SystemExit), exception
        assert "error:" in text
    for needle in row.needles(tmp_path):
        assert needle in text, (needle, text[-3000:])
    if row.extra is not None:
        row.extra(tmp_path, text)
    return text


# ============================================================================ configs


def config_file(tmp: Path, text: str | bytes, name: str = "bad.yaml") -> Path:
    p = tmp / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


def atom_file(tmp: Path) -> Path:
    p = tmp / "broken_atom.py"
    p.write_text("raise RuntimeError('this reward file is broken')\n\ndef f(sample):\n    return 1.0\n")
    return p


CONFIG_ROWS = {
    # unknown key: named, with a suggestion
    "unknown-key-vlm": Row("vlm", lambda t: train(t, "optim.lrr=1"), lambda t: ["optim.lrr", "optim.lr"]),
    "unknown-key-diffusion": Row("diffusion", lambda t: train(t, "rollout.num_stepz=3"),
                                 lambda t: ["rollout.num_stepz", "rollout.num_steps"]),
    "unknown-key-dllm": Row("dllm", lambda t: train(t, "rollout.gen_lenght=8"),
                            lambda t: ["rollout.gen_lenght", "rollout.gen_length"]),
    "unknown-key-in-file": Row("vlm", lambda t: ["train", "--config", config_file(t, "optim:\n  lrr: 1\n")],
                               lambda t: ["optim.lrr", "bad.yaml"]),
    # wrong type
    "wrong-type-vlm": Row("vlm", lambda t: train(t, "optim.lr=abc"), lambda t: ["optim.lr", "'abc'"]),
    "wrong-type-dllm": Row("dllm", lambda t: train(t, "rollout.num_generations=many"),
                           lambda t: ["rollout.num_generations", "'many'"]),
    # a boolean for a number (pydantic alone reads true as 1)
    "boolean-for-a-number-dllm": Row("dllm", lambda t: train(t, "rollout.num_generations=true"),
                                     lambda t: ["rollout.num_generations", "true is a boolean; this key takes a number"]),
    # out of range
    "out-of-range-dllm": Row("dllm", lambda t: train(t, "rollout.num_generations=0"),
                             lambda t: ["rollout.num_generations", "greater than or equal to 1"]),
    "out-of-range-diffusion": Row("diffusion", lambda t: train(t, "optim.lr=-1"),
                                  lambda t: ["optim.lr", "greater than or equal to 0"]),
    # missing, unreadable config file
    "missing-config-file": Row("vlm", lambda t: ["train", "--config", t / "nope.yaml"],
                               lambda t: ["nope.yaml", "does not exist"]),
    "config-not-yaml": Row("diffusion", lambda t: ["train", "--config", config_file(t, "optim: [1, 2\n")],
                           lambda t: ["bad.yaml", "not valid YAML"]),
    "config-duplicate-key": Row("vlm", lambda t: ["train", "--config", config_file(t, "seed: 1\noptim: {lr: 0.1}\nseed: 2\n")],
                                lambda t: ["bad.yaml", "duplicate key 'seed' (lines 1 and 3)"]),
    "config-not-utf8": Row("dllm", lambda t: ["train", "--config", config_file(t, b"seed: 1\n\xff\xfe\n")],
                           lambda t: ["bad.yaml", "not valid YAML"]),
    # a method of another modality
    "method-of-another-modality-vlm": Row("vlm", lambda t: train(t, "method.type=flow_grpo"),
                                          lambda t: ["method 'flow_grpo', a `diffusion-rl` method, not one of `mmrl`'s"]),
    "method-of-another-modality-diffusion": Row("diffusion", lambda t: train(t, "method.type=diffu_grpo"),
                                                lambda t: ["method 'diffu_grpo', a `dllm-rl` method", "`dllm-rl train`"]),
    "method-of-another-modality-dllm": Row("dllm", lambda t: train(t, "method.type=flow_grpo"),
                                           lambda t: ["method", "flow_grpo", "`diffusion-rl train`"]),
    "config-of-another-modality-vlm": Row("vlm", lambda t: ["train", "--config", CONFIGS / "dllm" / "slim_rl.yaml"],
                                          lambda t: ["slim_rl.yaml sets method 'slim_rl', a `dllm-rl` method",
                                                     "not one of `mmrl`'s: run it with `dllm-rl train`"]),
    "section-given-as-its-type-vlm": Row("vlm", lambda t: train(t, "method=axpo"),
                                         lambda t: ["method: 'axpo' is given where a mapping is due",
                                                    "write `method: {type: axpo}` in a file, or --set method.type=axpo"]),
    "section-given-as-its-type-in-a-file-dllm": Row("dllm", lambda t: ["train", "--config", config_file(t, "task: jsonl\n")],
                                                    lambda t: ["bad.yaml", "task: 'jsonl' is given where a mapping is due"],
                                                    tiny=None),  # the tiny settings' task.num_train would fail first
    "method-misspelt-vlm": Row("vlm", lambda t: train(t, "method.type=grpoo"),
                               lambda t: ["method: Input tag 'grpoo' found", "'grpo', 'axpo'"]),
    # reward atoms that do not import
    "atom-file-missing": Row("dllm", lambda t: train(t, 'reward.atoms=["nope.py:f"]'),
                             lambda t: ["reward.atoms", "nope.py", "file not found"]),
    "atom-file-raises-on-import": Row("dllm", lambda t: train(t, f'reward.atoms=["{atom_file(t)}:f"]'),
                                      lambda t: ["reward.atoms", "broken_atom.py", "this reward file is broken"]),
    "atom-function-missing": Row("vlm", lambda t: train(t, f'reward.atoms=["{atom_file(t).with_name("ok.py")}:g"]'),
                                 lambda t: ["reward.atoms", "ok.py", "'g'"]),
    "atom-named-like-a-metric": Row("diffusion", lambda t: train(t, f'reward.atoms=["{t / "ok.py"}:atom_accuracy"]'),
                                    lambda t: ["reward.atoms", "'atom_accuracy' is taken by an evaluation metric"]),
    # a bad --set value beside a good config file: the message blames the value, not the file
    "set-value-beside-a-config-file": Row(
        "vlm", lambda t: ["train", "--config", config_file(t, "seed: 1\n"), *sets("rollout.tools.names=zoom")],
        lambda t: ["error: invalid config: rollout.tools.names: Input should be a valid list (got 'zoom')"],
        extra=lambda t, text: ("bad.yaml" not in text) or pytest.fail("blamed the config file")),
    "sde-window-start-out-of-range-diffusion": Row(
        "diffusion", lambda t: train(t, "rollout.num_steps=3", "rollout.window_size=2", "rollout.window_start=[0,1]"),  # the default's
        lambda t: ["rollout: window_start [0, 1] must be a range lo <= hi within 0..0"]),
    "token-sampling-key-diffusion": Row("diffusion", lambda t: train(t, "rollout.temperature=0.5"),
                                        lambda t: ["rollout: temperature is a language model's sampling setting"]),
    "top-p-dllm": Row("dllm", lambda t: train(t, "rollout.top_p=0.9"),
                      lambda t: ["rollout: top_p (0.9) is not used by the dLLM sampler"]),
    "token-length-key-diffusion": Row("diffusion", lambda t: train(t, "rollout.max_new_tokens=64"),
                                      lambda t: ["rollout: max_new_tokens is a language model's sampling setting",
                                                 "rollout.num_steps"]),
    "reward-model-atom-diffusion": Row("diffusion", lambda t: train(t, "reward.atoms=[{reward_model: rm}]"),
                                       lambda t: ["a reward_model atom scores text", "task.image_atoms"]),
    # inf and nan: no config number takes them (a bound such as gt=0 lets inf through)
    "inf-number-dllm": Row("dllm", lambda t: train(t, "optim.lr=inf"), lambda t: ["optim.lr", "finite number"]),
    "nan-number-vlm": Row("vlm", lambda t: train(t, "method.kl.beta=nan"), lambda t: ["method.kl.beta", "finite number"]),
    # cross-field and method checks at the start, not mid-run
    "frontier-negative": Row("vlm", lambda t: train(t, "rollout.scheduler.frontier=-1"),
                             lambda t: ["rollout.scheduler.frontier", "greater than or equal to 0"]),
    "min-pixels-above-max-pixels": Row("vlm", lambda t: train(t, "model.max_pixels=1000"),
                                       lambda t: ["min_pixels (3136) is above max_pixels (1000)"]),
    "tool-image-below-min-pixels": Row(
        "vlm", lambda t: train(t, "rollout.tools.names=[zoom]", "rollout.tools.image_max_pixels=100"),
        lambda t: ["rollout.tools.image_max_pixels: 100 is below model.min_pixels (3136)"]),
    "ema-that-never-moves-diffusion": Row("diffusion", lambda t: train(t, "method.ema.update_every=8"),  # 1 step
                                          lambda t: ["method.ema.update_every: 8 is more than the run's optimizer",
                                                     "(train.max_steps 1 x ppo_epochs 1 x mini_batches 1 = 1)"]),
    "noiseless-sde-policy-gradient": Row("diffusion", lambda t: train(t, "rollout.noise_level=0"),
                                         lambda t: ["method flow_grpo", "rollout.noise_level 0"]),
    "accuracy-band-inverted": Row("dllm", lambda t: train(t, "method.type=tracerl", "method.accuracy_band=[0.9,0.1]"),
                                  lambda t: ["method.accuracy_band", "0 <= lo <= hi <= 1"]),
    "ftfc-heldout-with-one-prompt": Row(
        "diffusion", lambda t: train(t, "method.type=ftfc", "rollout.noise_level=0", "method.effective_reward=learned",
                                     "method.g_heldout=0.5"),
        lambda t: ["method.g_heldout=0.5", "at least two prompts per pool"]),
    "mood-without-ood-compositions": Row(
        "vlm", lambda t: train(t, "task.type=shapes-mood", "method.type=grpo", "task.ood_compositions=[]"),
        lambda t: ["no ood_compositions", "num_ood"]),
    # task options the task's generator rejects
    "shapes-qa-unknown-kind": Row("vlm", lambda t: train(t, "task.kinds=[colour]"),
                                  lambda t: ["task (shapes-qa): unknown question kind 'colour'", "colour_of"]),
    # `config --keys` with a part the config does not have
    "config-keys-unknown": Row("dllm", lambda t: ["config", "--keys", "rollout.gen_lenght"], tiny=None,
                               needles=lambda t: ["--keys rollout.gen_lenght: no key 'gen_lenght' in rollout",
                                                  "did you mean 'gen_length'?"]),
}


@pytest.fixture
def ok_atom(tmp_path):
    (tmp_path / "ok.py").write_text("def f(sample):\n    return 1.0\n\n\ndef atom_accuracy(sample):\n    return 1.0\n")


@pytest.mark.parametrize("name", list(CONFIG_ROWS))
def test_config_rows(name, tmp_path, ok_atom, one_thread):
    check(CONFIG_ROWS[name], tmp_path)


# ============================================================================ data


def png(path: Path, size=(32, 32), colour=(255, 0, 0)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


def header_only_png(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims width x height (no pixel data): Pillow refuses it at open."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def vlm_data(tmp: Path, bad_line: dict | bytes | None, *, verb: str = "train", extra: tuple = ()) -> list[str]:
    """A jsonl task whose train file's second line is `bad_line` (raw bytes for the whole file)."""
    good = {"question": "What colour is the square?", "answer": "red", "image": "good.png"}
    png(tmp / "good.png")
    eval_path = jsonl(tmp / "eval.jsonl", [good, good])
    train_path = tmp / "train.jsonl"
    if isinstance(bad_line, bytes):
        train_path.write_bytes(bad_line)
    else:
        jsonl(train_path, [good] + ([bad_line] if bad_line is not None else []))
    return train(tmp, "task.type=jsonl", f"task.train_path={train_path}", f"task.eval_path={eval_path}",
                 *extra, verb=verb)


def corrupt_image_args(tmp: Path) -> list[str]:
    (tmp / "junk.png").write_bytes(b"\x13\x37not a png at all" * 40)  # random bytes named .png
    return vlm_data(tmp, {"question": "q?", "answer": "a", "image": str((tmp / "junk.png").absolute())})


def _resized_to_max_pixels(tmp: Path, text: str) -> None:
    """The CLI sampled the huge image; qwen-vl-utils resizes it to within model.max_pixels."""
    from qwen_vl_utils import process_vision_info

    row, _ = json.JSONDecoder().raw_decode(text[text.index('{"question"'):])  # stderr's progress bar may precede it
    assert row["gold"] == "blue" and isinstance(row["completion"], str)
    (found,), _ = process_vision_info([{"role": "user", "content": [
        {"type": "image", "image": Image.open(tmp / "huge.png"), "max_pixels": 112 * 112}]}])
    assert found.size[0] * found.size[1] <= 112 * 112


def huge_image_args(tmp: Path) -> list[str]:
    Image.new("RGB", (6000, 6000), (0, 0, 255)).save(tmp / "huge.png", compress_level=1)
    big = {"question": "What colour is the square?", "answer": "blue", "image": "huge.png"}
    eval_path = jsonl(tmp / "eval.jsonl", [big])
    return ["sample", "--num", "1", *sets(f"output_dir={tmp / 'run'}", "task.type=jsonl",
                                          f"task.train_path={eval_path}", f"task.eval_path={eval_path}",
                                          "rollout.max_new_tokens=4")]


def dllm_data(tmp: Path, bad_line: dict) -> list[str]:
    """A dLLM jsonl task whose train file's second line is `bad_line`."""
    good = {"prompt": "1+2=", "answer": 3}
    eval_path = jsonl(tmp / "eval.jsonl", [good])
    train_path = jsonl(tmp / "train.jsonl", [good, bad_line])
    return train(tmp, "task.type=jsonl", f"task.train_path={train_path}", f"task.eval_path={eval_path}")


def jrow(args, needles, **kw) -> Row:
    """A VLM row on a jsonl task."""
    return Row("vlm", args, needles, tiny="vlm-jsonl", **kw)


DATA_ROWS = {
    "missing-image": jrow(lambda t: vlm_data(t, {"question": "q?", "answer": "a", "image": "gone.png"}),
                         lambda t: ["train.jsonl, line 2, field 'image'", "gone.png", "not found"]),
    "missing-image-skipped": jrow(
        lambda t: vlm_data(t, {"question": "q?", "answer": "a", "image": "gone.png"}, verb="sample",
                                  extra=("task.on_bad_image=skip",)) + ["--num", "1"],
        lambda t: ['"completion"'], code=0, warns=r"skipped 1 sample\(s\) .*line 2 \(image: image file not found"),
    "corrupt-image": jrow(corrupt_image_args,
        lambda t: ["train.jsonl, line 2, field 'image'", "junk.png", "cannot read image"]),
    "empty-dataset": jrow(lambda t: vlm_data(t, b"\n\n"), lambda t: ["train.jsonl", "empty dataset"]),
    "non-utf8-dataset": jrow(lambda t: vlm_data(t, b'{"question": "caf\xe9?", "answer": "a"}\n\xff\xfe\n'),
                            lambda t: ["train.jsonl, line 1", "not valid UTF-8"]),
    "prompt-over-context-vlm": jrow(lambda t: vlm_data(t, {"question": "two " * 2100, "answer": "2"}),
                                   lambda t: ["two two two", "with rollout.max_new_tokens", "exceeds the model's context of 2048"]),
    "image-far-above-max-pixels": Row("vlm", huge_image_args, lambda t: ['"completion"'], code=0,
                                      extra=_resized_to_max_pixels, tiny=None),
    "image-above-decompression-limit": jrow(
        lambda t: vlm_data(t, {"question": "q?", "answer": "a",
                                      "image": header_only_png(t / "bomb.png", 30000, 30000).name}),
        lambda t: ["train.jsonl, line 2, field 'image'", "bomb.png", "DecompressionBombError"]),
    "prompt-file-empty-diffusion": Row(
        "diffusion", lambda t: train(t, "task.train_path=" + str(config_file(t, "# nothing\n\n", "prompts.txt"))),
        lambda t: ["task.train_path", "prompts.txt", "holds no prompts"]),
    "prompt-file-non-utf8-diffusion": Row(
        "diffusion", lambda t: train(t, "task.train_path=" + str(config_file(t, b"a red circle\n\xff\xfe\n", "prompts.txt"))),
        lambda t: ["task.train_path", "prompts.txt", "line 2", "UTF-8"]),
    "prompt-file-missing-diffusion": Row(
        "diffusion", lambda t: train(t, f"task.train_path={t / 'nope.txt'}"),
        lambda t: ["task.train_path", "nope.txt"]),
    "prompt-over-context-dllm": Row(
        "dllm", lambda t: ["sample", "--num", "1", "--prompt", "1+" * 60 + "1=", *sets(f"output_dir={t / 'run'}")],
        lambda t: ["--prompt", "1+1+1+1", "122 tokens", "exceed the model's context of 96"]),
    "missing-answer-dllm": Row("dllm", lambda t: dllm_data(t, {"prompt": "2+2="}), tiny="dllm-jsonl",
                               needles=lambda t: ["train.jsonl, line 2, field 'answer'", "missing"]),
    "prompt-out-of-vocabulary-dllm": Row(
        "dllm", lambda t: dllm_data(t, {"prompt": "What is 2+2?", "answer": 4}), tiny="dllm-jsonl",
        needles=lambda t: ["task: the model's tokenizer cannot encode the prompt 'What is 2+2?'", "CHARSET"]),
    "generation-over-context-dllm": Row(
        "dllm", lambda t: train(t, "rollout.gen_length=96", "rollout.block_length=4", "rollout.steps=24"),
        lambda t: ["rollout.gen_length", "exceed the model's context of 96"]),
}


@pytest.mark.parametrize("name", list(DATA_ROWS))
def test_data_rows(name, tmp_path, one_thread):
    check(DATA_ROWS[name], tmp_path)


# ============================================================================ models

CODE = "print('REMOTE CODE RAN')\nfrom transformers import {cls} as CustomConfig  # noqa: F401\n"


def model_copy(tmp: Path, asset: str) -> Path:
    out = tmp / "model"
    shutil.copytree(ASSETS / asset, out)
    return out


def without(tmp: Path, asset: str, file: str) -> Path:
    d = model_copy(tmp, asset)
    (d / file).unlink()
    return d


def edit_json(tmp: Path, asset: str, file: str, edit: Callable[[dict], None]) -> Path:
    d = model_copy(tmp, asset)
    data = json.loads((d / file).read_text())
    edit(data)
    (d / file).write_text(json.dumps(data))
    return d


def remote_code(tmp: Path, asset: str, cls: str) -> Path:
    d = edit_json(tmp, asset, "config.json", lambda c: c.update(auto_map={"AutoConfig": "custom_config.CustomConfig"}))
    (d / "custom_config.py").write_text(CODE.format(cls=cls))
    return d


def _set(key: str, value):
    def edit(c: dict) -> None:
        node = c
        *parents, last = key.split(".")
        for p in parents:
            node = node[p]
        node[last] = value
    return edit


def _more_layers(c: dict) -> None:
    t = c["text_config"]
    t["num_hidden_layers"] += 1
    t["layer_types"] = [*t["layer_types"], t["layer_types"][-1]]


def pickled(tmp: Path, asset: str, weights: str, name: str = "pytorch_model.bin") -> Path:
    """The asset with `weights` (a safetensors file) saved by torch.save as `name` instead: a
    file that would unpickle, and must never be loaded."""
    import torch
    from safetensors.torch import load_file

    d = model_copy(tmp, asset)
    f = d / weights
    torch.save(load_file(f), f.with_name(name))
    f.unlink()
    return d


def model_args(modality: str, make: Callable[[Path], Path], *more: str, verb: str = "train"):
    return lambda t: train(t, f"model.path={make(t)}", *more, verb=verb)


def _notice_before_code(tmp: Path, text: str) -> None:
    """With model.trust_remote_code=true the CLI names the directory before its code runs."""
    notice = text.index("trust_remote_code")
    assert str(tmp / "model") in text[notice:notice + 400]
    if "REMOTE CODE RAN" in text:
        assert notice < text.index("REMOTE CODE RAN")


MODEL_ROWS = {
    "checkpoint-without-weights-vlm": Row(
        "vlm", model_args("vlm", lambda t: without(t, "tiny-qwen2.5-vl", "model.safetensors")),
        lambda t: ["model.path", str(t / "model")]),
    "checkpoint-without-weights-dllm": Row(
        "dllm", model_args("dllm", lambda t: without(t, "tiny-dllm", "model.safetensors")),
        lambda t: ["model.path", str(t / "model")]),
    "checkpoint-without-weights-diffusion": Row(
        "diffusion", model_args("diffusion", lambda t: without(
            t, "tiny-flow", "transformer/diffusion_pytorch_model.safetensors")),
        lambda t: ["model.path", str(t / "model"), "transformer"]),
    "checkpoint-without-config-vlm": Row(
        "vlm", model_args("vlm", lambda t: without(t, "tiny-qwen2.5-vl", "config.json")),
        lambda t: ["model.path", str(t / "model"), "config.json"]),
    "config-weights-mismatch-vlm": Row(
        "vlm", model_args("vlm", lambda t: edit_json(t, "tiny-qwen2.5-vl", "config.json",
                                                     _set("text_config.hidden_size", 96))),
        lambda t: ["model.path", str(t / "model"), "do not fit", "config.json"]),
    "config-weights-mismatch-dllm": Row(
        "dllm", model_args("dllm", lambda t: edit_json(t, "tiny-dllm", "config.json", _set("hidden_size", 96))),
        lambda t: ["model.path", str(t / "model"), "do not fit", "config.json"]),
    "config-more-layers-than-weights-vlm": Row(
        "vlm", model_args("vlm", lambda t: edit_json(t, "tiny-qwen2.5-vl", "config.json", _more_layers)),
        lambda t: ["model.path", str(t / "model"), "do not fit", "missing from the checkpoint"]),
    "config-more-layers-than-weights-dllm": Row(
        "dllm", model_args("dllm", lambda t: edit_json(t, "tiny-dllm", "config.json", _set("num_hidden_layers", 5))),
        lambda t: ["model.path", str(t / "model"), "do not fit", "model.layers.4"]),
    "config-more-layers-than-weights-diffusion": Row(
        "diffusion", model_args("diffusion", lambda t: edit_json(t, "tiny-flow", "transformer/config.json",
                                                                 _set("num_layers", 3))),
        lambda t: ["model.path", str(t / "model" / "transformer"), "does not fit its config.json",
                   "missing from the checkpoint", "transformer_blocks.2."]),
    "config-fewer-layers-than-weights-diffusion": Row(
        "diffusion", model_args("diffusion", lambda t: edit_json(t, "tiny-flow", "transformer/config.json",
                                                                 _set("num_layers", 1))),
        lambda t: ["model.path", "not in the model its config.json describes", "transformer_blocks.1."]),
    "config-weights-mismatch-diffusion": Row(
        "diffusion", model_args("diffusion", lambda t: edit_json(
            t, "tiny-flow", "transformer/config.json", _set("num_attention_heads", 3))),
        lambda t: ["model.path", str(t / "model"), "transformer"]),
    "pickled-weights-vlm": Row(
        "vlm", model_args("vlm", lambda t: pickled(t, "tiny-qwen2.5-vl", "model.safetensors")),
        lambda t: ["model.path", str(t / "model"), "pickled weights only (pytorch_model.bin)", "safe_serialization=True"]),
    "pickled-weights-dllm": Row(
        "dllm", model_args("dllm", lambda t: pickled(t, "tiny-dllm", "model.safetensors")),
        lambda t: ["model.path", str(t / "model"), "pickled weights only (pytorch_model.bin)"]),
    "pickled-weights-diffusion": Row(
        "diffusion", model_args("diffusion", lambda t: pickled(t, "tiny-flow", "transformer/diffusion_pytorch_model"
                                                               ".safetensors", "diffusion_pytorch_model.bin")),
        lambda t: ["component 'transformer'", "pickled weights only (diffusion_pytorch_model.bin)"]),
    "remote-code-off-vlm": Row(
        "vlm", model_args("vlm", lambda t: remote_code(t, "tiny-qwen2.5-vl", "Qwen2_5_VLConfig")),
        lambda t: ["model.trust_remote_code=true", str(t / "model")],
        extra=lambda t, text: ("REMOTE CODE RAN" not in text) or pytest.fail("remote code ran")),
    "remote-code-off-dllm": Row(
        "dllm", model_args("dllm", lambda t: remote_code(t, "tiny-dllm", "LlamaConfig")),
        lambda t: ["model.trust_remote_code=true", str(t / "model")],
        extra=lambda t, text: ("REMOTE CODE RAN" not in text) or pytest.fail("remote code ran")),
    "remote-code-on-vlm": Row(
        "vlm", model_args("vlm", lambda t: remote_code(t, "tiny-qwen2.5-vl", "Qwen2_5_VLConfig"),
                          "model.trust_remote_code=true", verb="sample") ,
        lambda t: ["notice:", str(t / "model")], code=0, extra=_notice_before_code, isolated=True),
    "remote-code-on-dllm": Row(
        "dllm", model_args("dllm", lambda t: remote_code(t, "tiny-dllm", "LlamaConfig"),
                           "model.trust_remote_code=true", verb="sample"),
        lambda t: ["notice:", str(t / "model")], code=0, extra=_notice_before_code, isolated=True),
    "remote-code-on-diffusion": Row(  # diffusion pipelines never run a directory's code: the flag says so
        "diffusion", lambda t: ["sample", "--prompt", "a red circle", *sets(
            f"output_dir={t / 'run'}", "model.trust_remote_code=true")],
        lambda t: ["notice:", "no effect", str(ASSETS / "tiny-flow")], code=0),
    "custom-component-diffusion": Row(
        "diffusion", model_args("diffusion", lambda t: edit_json(
            t, "tiny-flow", "model_index.json", _set("transformer", ["my_pipelines", "MyTransformer"]))),
        lambda t: ["model.path", str(t / "model"), "'transformer'", "my_pipelines"]),
    **{f"gpu-without-a-gpu-{m}": Row(  # model.device names a GPU this machine lacks: refused before loading
        m, lambda t: ["train", *sets(f"output_dir={t / 'run'}", "model.device=cuda")],
        lambda t: ["model.device cuda: no CUDA device is visible", "model.device=cpu or auto"])
       for m in ("vlm", "dllm", "diffusion")},
    "device-misspelt-dllm": Row(
        "dllm", lambda t: ["train", *sets(f"output_dir={t / 'run'}", "model.device=gpu")],
        lambda t: ["model", "device 'gpu' is not one of cpu, cuda, cuda:N, auto"]),
    "checkpoint-not-a-model-dllm": Row(
        "dllm", lambda t: ["eval", "--checkpoint", _empty(t), *sets(f"output_dir={t / 'run'}")],
        lambda t: ["--checkpoint", str(t / "empty"), "cannot load", "model.safetensors"]),
    "checkpoint-of-another-model-dllm": Row(
        "dllm", lambda t: ["eval", "--checkpoint", ASSETS / "tiny-qwen2.5-vl", *sets(f"output_dir={t / 'run'}")],
        lambda t: ["--checkpoint", str(ASSETS / "tiny-qwen2.5-vl"), "cannot load"]),
}


def _empty(tmp: Path) -> Path:
    (tmp / "empty").mkdir()
    return tmp / "empty"


def _finished_run(tmp: Path) -> Path:
    """An output directory holding a complete checkpoint (what list_checkpoints counts)."""
    from mmrl.core.checkpoint import STATE_JSON

    step = tmp / "run" / "checkpoints" / "step-00000001"
    step.mkdir(parents=True)
    (step / STATE_JSON).write_text("{}")
    return tmp / "run"


def _run_of(tmp: Path, config: dict) -> Path:
    """A run directory with this config.yaml and an empty checkpoints/."""
    import yaml

    (tmp / "other" / "checkpoints").mkdir(parents=True)
    (tmp / "other" / "config.yaml").write_text(yaml.safe_dump(config))
    return tmp / "other"


RUN_ROWS = {
    "checkpoint-is-a-file-dllm": Row(
        "dllm", lambda t: ["eval", "--checkpoint", config_file(t, "seed: 1\n"), *sets(f"output_dir={t / 'run'}")],
        lambda t: [f"checkpoint {t / 'bad.yaml'} is a file"]),
    "checkpoint-of-another-modality-vlm": Row(
        "vlm", lambda t: ["eval", "--checkpoint", _run_of(t, {"method": {"type": "diffu_grpo"}, "model": {"kind": "llada"}}),
                          *sets(f"output_dir={t / 'run'}")],
        lambda t: [str(t / "other"), "method 'diffu_grpo', a `dllm-rl` method, not one of `mmrl`'s",
                   "run it with `dllm-rl eval`"]),
    "checkpoint-of-an-unknown-method-vlm": Row(
        "vlm", lambda t: ["eval", "--checkpoint", _run_of(t, {"method": {"type": "mine"}, "model": {"kind": "llada"}}),
                          *sets(f"output_dir={t / 'run'}")],
        lambda t: [str(t / "other"), "method 'mine', which is not one of `mmrl`'s: a run of another modality?"]),
    # eval does not train: what only training refuses is let through
    "eval-with-one-sample-per-group-in-float16-dllm": Row(
        "dllm", lambda t: ["eval", *sets(f"output_dir={t / 'run'}", "rollout.num_generations=1", "model.dtype=float16")],
        lambda t: ['"accuracy"'], code=0),
    "output-dir-holds-a-run": Row(
        "dllm", lambda t: ["train", "--output-dir", _finished_run(t)],
        lambda t: [str(t / "run"), "already holds checkpoints", "--resume"]),
    "resume-with-nothing-to-resume": Row(
        "vlm", lambda t: ["train", "--resume", "--output-dir", t / "fresh"],
        lambda t: ["--resume: no complete checkpoint in", str(t / "fresh")]),
}


@pytest.mark.parametrize("name", list(RUN_ROWS))
def test_run_rows(name, tmp_path, one_thread):
    check(RUN_ROWS[name], tmp_path)


@pytest.mark.parametrize("name", list(MODEL_ROWS))
def test_model_rows(name, tmp_path, one_thread):
    row = MODEL_ROWS[name]
    if name.startswith("gpu-without-a-gpu"):
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU (tests/gpu/ trains on it)")
    if row.code == 0:  # sample: --num 1 and a couple of eval items
        row = Row(**{**row.__dict__, "args": lambda t, a=row.args: a(t) + ["--num", "1"]})
    check(row, tmp_path)
