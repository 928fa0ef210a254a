"""A user's own inputs to the image backend, each checked where it is given: task.image_atoms
specs whose names or parents do not fit the task's reward."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from diffusion_rl import backend
from diffusion_rl.config import DiffusionTrainConfig
from mmrl.core.config import ConfigError, load_config

SCORER = "def make(device):\n    return lambda images, prompts: [0.5] * len(images)\n"


def _cfg(tmp_path, **task):
    """The default run with these task keys, from a config file in tmp_path (beside scorer.py)."""
    (tmp_path / "scorer.py").write_text(SCORER)
    (tmp_path / "run.yaml").write_text(json.dumps({"task": {"num_train": 4, "num_eval": 8, **task}}))
    return load_config(DiffusionTrainConfig, tmp_path / "run.yaml", defaults=backend.DEFAULT_CONFIG)


def _atom(**extra):
    return {"type": "preference", "kind": "custom", "path": "scorer.py:make", **extra}


@pytest.mark.parametrize(("extra", "message"), [
    # evaluation's "reward" (the mean total) was overwritten by this atom's mean, silently
    ({"name": "reward"}, r"task.image_atoms: atom name 'reward' is taken by an evaluation metric"),
    ({"name": "hard/x"}, r"task.image_atoms: atom name 'hard/x' is taken by an evaluation metric"),
    # these two were tracebacks from the core Reward
    ({"name": "exist"}, r"task.image_atoms: atom name 'exist' is a shapes-geneval atom's \(exist, colour"),
    ({"parents": ["nope"]}, r"task.image_atoms: reward atom 'preference': parent 'nope' is not an atom"),
])
def test_image_atom_names_and_parents_that_do_not_fit_are_config_errors(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        backend.build_task(_cfg(tmp_path, image_atoms=[_atom(**extra)]))


def test_an_image_atom_may_be_gated_on_a_shapes_atom(tmp_path):
    task = backend.build_task(_cfg(tmp_path, image_atoms=[_atom(parents=["exist"])]))
    assert task.other_atoms() == ["preference"]



def test_an_image_size_the_model_cannot_draw_names_model_height_and_width_not_the_path(tmp_path, monkeypatch):
    """A size off the token grid is refused as model.height / model.width (it read `model.path:
    cannot load .../tiny-flow: ...`, as if the model were at fault). The model's own refusal is
    an ImageSizeError (tests/diffusion/test_models.py::test_a_size_of_0_or_off_the_token_grid_is_refused)."""
    from diffusion_rl import models

    def load(path, **kw):
        raise models.ImageSizeError(f"height x width = {kw['height']} x 64 must be positive multiples of 8")

    monkeypatch.setattr(models, "load_flow_model", load)
    cfg = _cfg(tmp_path)
    cfg.model.height = 30
    with pytest.raises(ConfigError) as e:
        backend.build(cfg)
    assert str(e.value) == "model.height / model.width: height x width = 30 x 64 must be positive multiples of 8"


def test_a_bad_prompt_file_is_named_before_the_model_loads(tmp_path, monkeypatch):
    """build read the prompt files after loading the model (minutes for a FLUX checkpoint) only
    to refuse line 2."""
    from diffusion_rl import models

    def load(path, **kw):
        raise AssertionError("the model was loaded before the prompt file was read")

    monkeypatch.setattr(models, "load_flow_model", load)
    (tmp_path / "prompts.txt").write_text("a red circle\nthree pink clouds\n")
    with pytest.raises(ConfigError, match=r"task.train_path: .*prompts.txt, line 2 \('three pink clouds'\)"):
        backend.build(_cfg(tmp_path, train_path="prompts.txt"))


def test_a_long_unparsable_prompt_line_is_shown_cut_not_three_times_whole(tmp_path):
    """A paragraph of a prompt: the error named it whole three times (the line, the prompt, the
    unparsed words), over 2,000 characters for a 100-word line; each is now cut at 80."""
    from diffusion_rl.backend import _prompt_file

    path = tmp_path / "p.txt"
    path.write_text("a red circle\na " + "very " * 100 + "red circle\n")
    with pytest.raises(ConfigError) as e:
        _prompt_file(str(path), None, "train_path")
    message = str(e.value)
    assert "line 2 ('a very very" in message and "unparsed words 'very very" in message
    assert "expected a colour" in message and message.count("...'") == 3 and len(message) - len(str(path)) < 500, message


@pytest.mark.skipif(torch.cuda.device_count() > 3, reason="needs a machine with at most 3 GPUs")
@pytest.mark.parametrize("device", ["cuda", "cuda:3"])
def test_an_image_atom_on_a_gpu_this_machine_lacks_is_refused_when_built(tmp_path, device):
    """It failed at the first score, when its model loaded, after a whole rollout."""
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match=rf"task.image_atoms: image reward spec 0 \(preference\): device '{device}'"):
        backend.build_task(_cfg(tmp_path, image_atoms=[_atom(device=device)]))


def test_an_atom_reading_sample_image_is_told_the_image_is_sample_completion():
    """README says an image atom sees "the image", and the natural guess, sample.image, failed
    with a bare AttributeError."""
    from PIL import Image

    from diffusion_rl.policy import to_sample
    from mmrl.core.rewards import Reward, RewardAtom, RewardError

    bright = RewardAtom("bright", lambda s: s.image.getpixel((0, 0))[0] > 100)
    with pytest.raises(RewardError, match=r"AttributeError: 'Sample' object has no attribute 'image' \(a Sample "
                                          r"has prompt, completion and meta: .* is sample.completion\)"):
        Reward([bright]).score([to_sample("a red circle", Image.new("RGB", (8, 8)))])


def _sample(tmp_path, prompt, atom, **reward):
    """backend.sample of one prompt drawn black, scored by the shapes atoms and `atom`."""
    from types import SimpleNamespace

    from PIL import Image

    from diffusion_rl.tasks.shapes_geneval import reward_atoms
    from mmrl.core.rewards import Reward

    policy = SimpleNamespace(sample_images=lambda texts, seeds, steps: [Image.new("RGB", (8, 8)) for _ in texts])
    task = SimpleNamespace(reward=Reward([*reward_atoms(), atom], **reward), other_atoms=lambda: [atom.name])
    cfg = SimpleNamespace(output_dir=str(tmp_path), rollout=SimpleNamespace(eval_steps=2, num_steps=4))
    return backend.sample(cfg, policy, task, [prompt], 1)


def _boom(sample):
    raise RuntimeError("my atom broke")


def test_sample_reports_a_config_atom_that_fails_as_training_would(tmp_path):
    """`sample` swallowed every RewardError: a reward.atoms atom that raised left its row without
    that atom and the reward, with no word; only the shapes atoms refusing a free-form prompt
    (said in a warning) are passed over."""
    from mmrl.core.rewards import RewardAtom, RewardError

    boom = RewardAtom("boom", _boom)
    with pytest.raises(RewardError, match="reward atom 'boom' failed on sample 0 .*my atom broke"):
        _sample(tmp_path, "a red circle", boom)


def test_sample_shows_an_atom_the_sample_training_shows_it(tmp_path):
    """Training's samples have meta {} (policy.to_sample, README: "an empty meta"); `sample`
    gave None, so an atom reading sample.meta.get(...) failed there alone."""
    from mmrl.core.rewards import RewardAtom

    (row,) = _sample(tmp_path, "a red circle", RewardAtom("bonus", lambda s: s.meta.get("bonus", 0.25)))
    assert row["bonus"] == 0.25


def test_sample_passes_over_the_shapes_atoms_refusing_a_free_form_prompt(tmp_path):
    from mmrl.core.rewards import RewardAtom

    with pytest.warns(UserWarning, match="'a cat': no scene-graph verdicts"):
        (row,) = _sample(tmp_path, "a cat", RewardAtom("boom", _boom))
    assert row["prompt"] == "a cat" and "boom" not in row and "reward" not in row
    (row,) = _sample(tmp_path, "a red circle", RewardAtom("boom", _boom), on_error="zero")
    assert row["boom"] == 0.0 and "colour[red circle]" in row


def test_held_out_prompts_that_are_training_prompts_too_are_said_to_be(tmp_path):
    """The same file as train_path and eval_path (or a line in both) trained on the held-out
    prompts without a word; generated prompts keep their split and are not checked."""
    from mmrl.core.jsonl import HeldOutWarning

    (tmp_path / "train.txt").write_text("a red circle\ntwo blue squares\n")
    (tmp_path / "eval.txt").write_text("a green circle\nTwo blue  squares.\n")  # the same prompt to the reward
    with pytest.warns(HeldOutWarning, match=r"task.eval_path: 1 of 2 held-out prompts are training prompts too "
                                         r"\('Two blue  squares.'\), as the reward reads prompts \(case, spacing and a "
                                         r"final period aside\), so held-out evaluation scores them as trained on"):
        backend.build_task(_cfg(tmp_path, train_path="train.txt", eval_path="eval.txt"))
    with pytest.warns(UserWarning, match=r"2 of 2 held-out prompts .*\('a red circle', \.\.\.\)"):
        backend.build_task(_cfg(tmp_path, train_path="train.txt", eval_path="train.txt"))
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*training prompts too")
        backend.build_task(_cfg(tmp_path))
        # the generated held-out prompts are of the eval split, and both lines of train.txt of the train split
        backend.build_task(_cfg(tmp_path, train_path="train.txt"))


def test_sample_without_prompts_draws_the_first_two_distinct_held_out_prompts(tmp_path):
    """The generated held-out prompts repeat (the first two are both "three green circles"), and
    `sample` drew the first two: the same prompt from the same seeds, twice the same images."""
    from types import SimpleNamespace

    from PIL import Image

    from diffusion_rl.tasks.shapes_geneval import sample_prompts

    held_out = sample_prompts(8, 0, split="eval", disjoint=True)
    assert held_out[0] == held_out[1]  # what made the default draw one prompt twice
    policy = SimpleNamespace(sample_images=lambda texts, seeds, steps: [Image.new("RGB", (8, 8)) for _ in texts])
    task = SimpleNamespace(eval_prompts=held_out, other_atoms=list)
    cfg = SimpleNamespace(output_dir=str(tmp_path), rollout=SimpleNamespace(eval_steps=2, num_steps=4))
    rows = backend.sample(cfg, policy, task, [], 1)
    assert [r["prompt"] for r in rows] == [held_out[0], next(p for p in held_out if p != held_out[0])]


def test_a_cast_parser_that_fails_or_names_no_atom_of_the_reward_is_a_config_error(tmp_path):
    """method.parser is the user's code: one that raised was a traceback (exit 1), and one that
    gave words to a name the reward has not ("colours") left that column's map uniform, silently."""
    from types import SimpleNamespace

    from diffusion_rl.config import CASTConfig
    from diffusion_rl.methods.cast import CAST

    (tmp_path / "p.py").write_text("def typo(prompt):\n    return {'colours': [(2, 5)], 'exist': [(6, 12)]}\n"
                                   "def raises(prompt):\n    raise KeyError('x')\n")
    run = SimpleNamespace(base_dir=str(tmp_path), rollout=SimpleNamespace(noise_level=0.7))
    reward = SimpleNamespace(names=["exist", "colour", "count", "relation", "all"], weights=torch.ones(5))
    typo = CAST(CASTConfig(parser="p.py:typo"), run, reward)
    with pytest.raises(ConfigError, match=r"method.parser 'p.py:typo' gave 'a red circle' words for \['colours'\], "
                                          r"which are not atoms of the reward \(its atoms: exist, colour, count"):
        typo.atom_spans("a red circle")
    with pytest.raises(ConfigError, match=r"method.parser 'p.py:raises': the prompt parser failed on 'a red circle': "
                                          r"KeyError"):
        CAST(CASTConfig(parser="p.py:raises"), run, reward).atom_spans("a red circle")
    assert CAST(CASTConfig(), run, reward).atom_spans("a cat") == {}  # the built-in grammar: uniform maps


def test_a_prompt_over_the_text_encoders_length_is_warned_about_once_without_the_tokenizers_false_alarm(capfd):
    """Measuring a long prompt made the tokenizer log that running it "will result in indexing
    errors", which it does not (the encoders get it cut): beside our own warning, a false alarm."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from diffusion_rl.backend import bundled_model_dir
    from diffusion_rl.models import FlowModel

    tokenizer = AutoTokenizer.from_pretrained(bundled_model_dir() / "tokenizer")
    capfd.readouterr()
    model = SimpleNamespace(_measured=set(), _warned_cut=False)
    with pytest.warns(UserWarning, match="longer than the CLIP text encoder's 32 tokens and is cut there"):
        FlowModel._warn_cut(model, tokenizer, ["a red circle " * 40], 32, "CLIP text encoder")
    assert "indexing errors" not in capfd.readouterr().err


def test_a_cast_window_file_is_found_beside_the_config(tmp_path, monkeypatch):
    """method.window_from resolved from the working directory alone, unlike every other file a
    config names (and unlike the run's config.yaml, which records it resolved from the config's
    directory): a window.json beside the config was "missing" when run from elsewhere."""
    from diffusion_rl.calibrate import apply_window_file

    (tmp_path / "window.json").write_text(json.dumps({"num_steps": 4, "window_start": 1, "window_size": 2}))
    (tmp_path / "run.yaml").write_text(json.dumps({
        "method": {"type": "cast", "window_from": "window.json"},
        "rollout": {"num_steps": 4, "window_size": 2, "window_start": None}}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(DiffusionTrainConfig, tmp_path / "run.yaml", defaults=backend.DEFAULT_CONFIG)
    assert apply_window_file(cfg, backend.bundled_model_dir()) == tmp_path / "window.json"
    assert cfg.rollout.window_start == (1, 1) and cfg.rollout.window_size == 2


def test_sample_draws_many_images_in_batches_as_evaluation_does(tmp_path):
    """`sample --num 40` of two prompts drew its 80 images in one batch (evaluation draws 32 at
    a time): more than a GPU holds at FLUX's image sizes."""
    from types import SimpleNamespace

    from PIL import Image

    calls = []

    def sample_images(texts, seeds, steps):
        calls.append(list(zip(texts, seeds)))
        return [Image.new("RGB", (8, 8)) for _ in texts]

    task = SimpleNamespace(eval_prompts=[], other_atoms=list)
    cfg = SimpleNamespace(output_dir=str(tmp_path), rollout=SimpleNamespace(eval_steps=2, num_steps=4))
    rows = backend.sample(cfg, SimpleNamespace(sample_images=sample_images), task, ["a red circle", "a cat"], 40)
    assert [len(c) for c in calls] == [32, 32, 16]
    assert [(r["prompt"], r["seed"]) for r in rows] == [pair for c in calls for pair in c]
    assert rows[40] == {**rows[40], "prompt": "a cat", "seed": 0} and len({r["image"] for r in rows}) == 80


def test_the_sample_grids_are_drawn_in_batches(tmp_path):
    """task.grid_prompts x task.eval_seeds images were drawn in one batch."""
    from types import SimpleNamespace

    from PIL import Image

    from diffusion_rl.task import DiffusionTask
    from diffusion_rl.tasks.shapes_geneval import sample_prompts, shapes_geneval_reward

    calls = []

    def sample_images(texts, seeds, steps):
        calls.append(len(texts))
        return [Image.new("RGB", (8, 8), (k % 251, 0, 0)) for k in seeds]

    prompts = sample_prompts(20, 0, split="eval", disjoint=True)
    task = DiffusionTask("shapes-geneval", [], prompts, shapes_geneval_reward(), eval_seeds=3, grid_prompts=20)
    path = task.save_samples(SimpleNamespace(sample_images=sample_images), tmp_path, "before")
    assert calls == [32, 28]
    assert json.loads((tmp_path / "grid_before.json").read_text())["seeds"][:4] == [0, 1000, 2000, 1]
    grid = Image.open(path)
    assert grid.getpixel((10 + 2 + 8 + 2 + 1, 2 + 1)) == (1000 % 251, 0, 0)  # row 0, column 1: seed 1000, in place


def test_calibrate_window_counts_only_the_held_out_prompts_the_grammar_decomposes(tmp_path, monkeypatch):
    """Held-out prompts of a whole-prompt reward (task.unparsed=whole_prompt) have no atoms to
    check: with none left, calibrate_window's ValueError was a traceback; with some, fewer than
    the prompts asked for were calibrated on, silently."""
    from types import SimpleNamespace

    from diffusion_rl import calibrate

    used = []
    monkeypatch.setattr(calibrate, "calibrate_window", lambda policy, prompts, *a, **k: used.append(prompts))
    monkeypatch.setattr(calibrate, "write_window", lambda cal, out: None)
    task = SimpleNamespace(eval_prompts=["a cat", "a red circle", "a dog", "two blue squares"])
    monkeypatch.setattr(backend, "build", lambda cfg: (None, task))
    cfg = _cfg(tmp_path)
    backend.calibrate(cfg, tmp_path, 2, into_model=False)
    assert used == [["a red circle", "two blue squares"]]
    with pytest.raises(ConfigError, match=r"calibrate-window: 3 calibration prompts asked, but the task holds 2 "
                                          r"held-out prompts \(task.num_eval, or task.eval_path\) the shapes grammar "
                                          r"decomposes \(2 it cannot\)"):
        backend.calibrate(cfg, tmp_path, 3, into_model=False)


def test_a_utf16_prompt_file_is_named_as_such(tmp_path):
    """Notepad's "Unicode" (UTF-16 with a byte-order mark) read as 'line 1: not valid UTF-8 (byte 0xff)'."""
    from diffusion_rl.backend import _prompt_file

    for bom, encoding in ((b"\xff\xfe", "utf-16-le"), (b"\xfe\xff", "utf-16-be")):
        path = tmp_path / "p.txt"
        path.write_bytes(bom + "a red circle\n".encode(encoding))
        with pytest.raises(ConfigError, match=r"task.train_path: .*p.txt is UTF-16 \(it starts with a UTF-16 "
                                              r"byte-order mark\); save the file as UTF-8"):
            _prompt_file(str(path), None, "train_path")


def test_the_generators_sizes_seed_and_split_unused_with_prompt_files_are_said_to_be():
    """task.num_train=8 with train_path trained on every line of the file without a word (the
    dLLM's jsonl task warns of the same); the defaults, as a run's config.yaml writes them, pass
    quietly, and a key that still drives a generated half (num_eval beside train_path) too."""
    import warnings

    from diffusion_rl.config import ShapesGenevalTaskConfig

    with pytest.warns(UserWarning, match=r"^task.num_train \(8\) is for the generated prompts, unused where "
                                         r"task.train_path / task.eval_path give them"):
        ShapesGenevalTaskConfig(train_path="p.txt", num_train=8)
    with pytest.warns(UserWarning, match=r"^task.num_eval \(5\), task.seed \(3\), task.held_out \(overlapping\) are"):
        ShapesGenevalTaskConfig(train_path="p.txt", eval_path="q.txt", num_eval=5, seed=3, held_out="overlapping")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShapesGenevalTaskConfig(train_path="p.txt", eval_path="q.txt", num_train=2000, num_eval=64, seed=0)
        ShapesGenevalTaskConfig(train_path="p.txt", num_eval=8, seed=3)  # the held-out prompts are generated
        ShapesGenevalTaskConfig(num_train=8, seed=3)


def test_a_json_lines_or_quoted_prompt_file_line_is_named_as_such(tmp_path):
    """A prompt file written as JSON lines ({"prompt": "two red circles"}) or with a CSV's quotes
    read as "unparsed words ...; expected a count", as if the words were wrong, not the format."""
    from diffusion_rl.backend import _prompt_file

    path = tmp_path / "p.jsonl"
    json_object = r"\(a JSON object: a prompt file holds plain text, one prompt per line, such as 'two red circles"
    for line, hint in [('{"prompt": "two red circles"}', json_object),
                       ('"two red circles"', r"\(in quotes: write the prompt without them\)")]:
        path.write_text(f"a red circle\n{line}\n")
        with pytest.raises(ConfigError, match=r"p.jsonl, line 2 .*expected a count \(a, an, one, two, three, four\) "
                                              + hint) as raised:
            _prompt_file(str(path), None, "train_path")
        assert "whole_prompt" not in str(raised.value)  # the format is at fault: no reward would read it
    path.write_text("a red circle\ndeux cercles rouges\n")  # no JSON, no hint
    with pytest.raises(ConfigError, match=r"expected a count \(a, an, one, two, three, four\); to score"):
        _prompt_file(str(path), None, "train_path")


@pytest.mark.parametrize(("overrides", "said"), [
    # map_norm and parser were ignored without a word under projection none
    (["method.projection=none", "method.map_norm=max", "method.parser=p.py:f"],
     r"method.map_norm max, method.parser p.py:f unused with method.projection none: its scalar advantage"),
    # the detector's maps are boxes: the attention layers and the words' parser are not read
    (["method.projection=detector", "method.attention_layers=[1]", "method.parser=p.py:f"],
     r"method.attention_layers \[1\], method.parser p.py:f unused with method.projection detector: its maps"),
])
def test_cast_settings_its_projection_does_not_read_are_said_to_be_unused(overrides, said):
    with pytest.warns(UserWarning, match=said):
        load_config(DiffusionTrainConfig, None, ["method.type=cast", *overrides], defaults=backend.DEFAULT_CONFIG)
    with warnings.catch_warnings():  # read by attention projection: nothing said
        warnings.simplefilter("error")
        load_config(DiffusionTrainConfig, None, ["method.type=cast", "method.map_norm=max", "method.attention_layers=[1]"],
                    defaults=backend.DEFAULT_CONFIG)
        load_config(DiffusionTrainConfig, None, ["method.type=cast", "method.projection=detector", "method.map_norm=max"],
                    defaults=backend.DEFAULT_CONFIG)


@pytest.mark.parametrize(("overrides", "said"), [
    (["method.t_sampling=uniform", "method.logit_std=2"],
     r"method.logit_std 2.0 unused with method.t_sampling uniform: t is drawn from U\(0, 1\)"),
    (["method.g_steps=50", "method.g_heldout=0.5"],
     r"method.g_steps 50, method.g_heldout 0.5 unused with method.effective_reward observed: the weights come"),
])
def test_ftfc_settings_it_does_not_read_are_said_to_be_unused(overrides, said):
    """They were ignored without a word (a g_phi ablation on the default observed rewards ran
    the observed tilt)."""
    with pytest.warns(UserWarning, match=said):
        load_config(DiffusionTrainConfig, None, ["method.type=ftfc", *overrides], defaults=backend.DEFAULT_CONFIG)
    with warnings.catch_warnings():  # where they are read: nothing said
        warnings.simplefilter("error")
        load_config(DiffusionTrainConfig, None, ["method.type=ftfc", "method.logit_std=2", "method.effective_reward=learned",
                                                 "method.g_steps=50"], defaults=backend.DEFAULT_CONFIG)
