"""CPU tests of diffusion_rl.rewards: CLIP score through a tiny random open_clip model, the
PickScore-style preference score through a tiny random transformers CLIPModel, custom
preference factories, input conversion and validation, the atoms inside a core Reward, and
config specs. Every model is built offline into a temporary directory."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image

from diffusion_rl.rewards import (
    build_image_reward_atoms,
    build_tiny_hf_clip,
    build_tiny_open_clip,
    clear_model_cache,
    clip_score_atom,
    preference_atom,
    to_rgb,
)
from mmrl.core.rewards import Reward, RewardError, Sample


@pytest.fixture(scope="module")
def tiny_open_clip(tmp_path_factory):
    """(model directory, config path, weights path) of a tiny random open_clip CLIP."""
    out = tmp_path_factory.mktemp("tiny_open_clip")
    config, weights = build_tiny_open_clip(out, seed=0)
    return str(out), config, weights


@pytest.fixture(scope="module")
def tiny_hf_clip(tmp_path_factory):
    """Directory of a tiny random transformers CLIPModel + CLIPProcessor."""
    return build_tiny_hf_clip(tmp_path_factory.mktemp("tiny_hf_clip"), seed=0)


def noise_image(seed: int, size=(40, 36)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


PROMPTS = ("a red circle", "two blue squares left of a green triangle", "a yellow square")


def samples(n: int = 6) -> list[Sample]:
    """n samples cycling over 3 prompts and 4 images."""
    return [Sample(PROMPTS[i % 3], noise_image(i % 4)) for i in range(n)]


def open_clip_cosines(directory: str, batch: list[Sample]) -> list[float]:
    """The cosine through open_clip's own forward (normalised features), pair by pair."""
    model, preprocess = open_clip.create_model_from_pretrained(f"local-dir:{directory}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{directory}")
    model.eval()
    with torch.no_grad():
        pixels = torch.stack([preprocess(s.completion) for s in batch])
        image_features, text_features, _ = model(pixels, tokenizer([s.prompt for s in batch]))
    return (image_features * text_features).sum(-1).tolist()


# ---------------------------------------------------------------------------- CLIP score


def test_clip_score_is_the_cosine_of_open_clip(tiny_open_clip):
    directory, config, weights = tiny_open_clip
    batch = samples(6)
    scores = clip_score_atom(config, weights)(batch)
    assert len(scores) == 6
    assert all(math.isfinite(s) and -1.0 <= s <= 1.0 for s in scores)  # raw cosine
    assert scores == pytest.approx(open_clip_cosines(directory, batch), abs=1e-5)


def test_clip_score_identical_inputs_agree_and_different_inputs_differ(tiny_open_clip):
    _, config, weights = tiny_open_clip
    atom = clip_score_atom(config, weights)
    a, b = noise_image(0), noise_image(1)
    s = atom(
        [
            Sample(PROMPTS[0], a),
            Sample(PROMPTS[0], a.copy()),  # identical pair
            Sample(PROMPTS[1], a),  # other prompt, same image
            Sample(PROMPTS[0], b),  # same prompt, other image
        ]
    )
    assert s[0] == s[1]
    assert abs(s[0] - s[2]) > 1e-4
    assert abs(s[0] - s[3]) > 1e-4


def test_clip_score_batched_equals_one_by_one(tiny_open_clip):
    _, config, weights = tiny_open_clip
    batch = samples(7)
    batched = clip_score_atom(config, weights, batch_size=3)(batch)  # chunks of 3, 3, 1
    single = [clip_score_atom(config, weights, batch_size=1)([s])[0] for s in batch]
    assert batched == pytest.approx(single, abs=1e-6)


def test_clip_score_scale_and_clamp(tiny_open_clip):
    _, config, weights = tiny_open_clip
    batch = samples(6)
    cos = clip_score_atom(config, weights)(batch)
    assert min(cos) < 0 < max(cos)  # the fixture has both signs, so clamp is exercised
    clip_s = clip_score_atom(config, weights, scale=2.5, clamp=True)(batch)  # Hessel et al.
    assert clip_s == pytest.approx([2.5 * max(c, 0.0) for c in cos], abs=1e-6)
    assert all(0.0 <= s <= 2.5 for s in clip_s)


def test_clip_score_loads_the_same_model_from_every_source(tiny_open_clip):
    directory, config, weights = tiny_open_clip
    batch = samples(4)
    expected = clip_score_atom(config, weights)(batch)
    model_cfg = json.loads(Path(config).read_text())["model_cfg"]
    for model_name, pretrained in [
        (f"local-dir:{directory}", None),  # open_clip's local-dir schema
        ("tiny", directory),  # a hub-layout directory as `pretrained`
        (model_cfg, weights),  # a config dict (registered with open_clip.add_model_config)
    ]:
        assert clip_score_atom(model_name, pretrained)(batch) == pytest.approx(expected, abs=1e-6)


def test_clip_score_model_is_loaded_once_and_shared(tiny_open_clip, monkeypatch):
    directory, config, weights = tiny_open_clip
    loads = []
    real = open_clip.create_model_from_pretrained

    def counting(*args, **kwargs):
        loads.append(args)
        time.sleep(0.2)  # widen the window for racing threads
        return real(*args, **kwargs)

    monkeypatch.setattr(open_clip, "create_model_from_pretrained", counting)
    clear_model_cache()
    try:
        first = clip_score_atom(config, weights)
        second = clip_score_atom(config, weights, name="clip_s", scale=2.5, clamp=True)
        assert loads == []  # lazily: nothing loads before the first call
        first(samples(2))
        first(samples(3))
        second(samples(2))
        assert len(loads) == 1  # one load shared by both atoms
        assert first.fn.load()[0] is second.fn.load()[0]

        clear_model_cache()
        atom = clip_score_atom(f"local-dir:{directory}")
        results, errors = [], []

        def score():
            try:
                results.append(atom(samples(2)))
            except Exception as e:  # noqa: BLE001 -- reported below
                errors.append(e)

        threads = [threading.Thread(target=score) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert len(loads) == 2  # the four racing threads loaded it once
        assert all(r == results[0] for r in results)
        model = atom.fn.load()[0]
        assert not model.training
        assert not any(p.requires_grad for p in model.parameters())
    finally:
        clear_model_cache()


def test_clip_score_refuses_bad_sources(tiny_open_clip, tmp_path):
    _, config, weights = tiny_open_clip
    with pytest.raises(ValueError, match="hf-hub"):
        clip_score_atom("hf-hub:laion/CLIP-ViT-B-32-laion2B-s34B-b79K")
    with pytest.raises(ValueError, match="no such file or directory"):
        clip_score_atom("ViT-B-32", "laion2b_s34b_b79k")  # a tag: would download
    with pytest.raises(ValueError, match="not an open_clip architecture"):
        clip_score_atom("ViT-Nope-99", weights)
    with pytest.raises(ValueError, match="needs weights"):
        clip_score_atom(config)
    with pytest.raises(ValueError, match="file not found"):
        clip_score_atom(str(tmp_path / "missing.json"), weights)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"embed_dim": 8}))
    with pytest.raises(ValueError, match="missing vision_cfg, text_cfg"):
        clip_score_atom(str(bad), weights)
    with pytest.raises(ValueError, match="no open_clip_config.json"):
        clip_score_atom("tiny", str(tmp_path))
    with pytest.raises(ValueError, match="batch_size"):
        clip_score_atom(config, weights, batch_size=0)


def test_clip_score_weights_that_do_not_fit_fail_naming_the_source(tiny_open_clip, tmp_path):
    _, config, _ = tiny_open_clip
    other = tmp_path / "other.safetensors"
    from safetensors.torch import save_file

    save_file({"nothing": torch.zeros(1)}, str(other))
    atom = clip_score_atom(config, str(other))
    with pytest.raises(RewardError, match=r"clip_score.*loading the open_clip model.*other"):
        Reward([atom]).score(samples(1))


def test_a_nan_from_the_model_is_caught_by_the_core_reward(tiny_open_clip):
    _, config, weights = tiny_open_clip
    clear_model_cache()
    try:
        atom = clip_score_atom(config, weights)
        model = atom.fn.load()[0]
        with torch.no_grad():
            model.visual.proj.fill_(float("nan"))
        assert all(math.isnan(s) for s in atom(samples(2)))  # returned as is ...
        with pytest.raises(RewardError, match="'clip_score' failed on sample 0.*returned nan") as e:
            Reward([atom]).score(samples(2))  # ... and rejected by the core
        assert e.value.atom == "clip_score" and e.value.sample_index == 0
    finally:
        clear_model_cache()


# ---------------------------------------------------------------------------- inputs


def test_to_rgb_conversions():
    # RGBA over white: 255 * (1 - a) + c * a with a = 128/255: red 0 -> 127, blue 255 -> 255.
    rgba = to_rgb(Image.new("RGBA", (2, 2), (0, 0, 255, 128)))
    assert rgba.mode == "RGB" and rgba.getpixel((0, 0)) == (127, 127, 255)
    assert to_rgb(Image.new("RGBA", (2, 2), (9, 9, 9, 0))).getpixel((0, 0)) == (255, 255, 255)
    assert to_rgb(Image.new("LA", (2, 2), (10, 255))).getpixel((0, 0)) == (10, 10, 10)
    assert to_rgb(Image.new("L", (2, 2), 77)).getpixel((0, 0)) == (77, 77, 77)
    # 16-bit: v * 255 / 65535: 65535 -> 255, 32896 -> 128.
    assert to_rgb(Image.new("I;16", (2, 2), 65535)).getpixel((0, 0)) == (255, 255, 255)
    assert to_rgb(Image.new("I;16", (2, 2), 32896)).getpixel((0, 0)) == (128, 128, 128)
    # "I": 16-bit when a value exceeds 255 (1028 -> 4), else already 8-bit (200 -> 200).
    assert to_rgb(Image.new("I", (2, 2), 1028)).getpixel((0, 0)) == (4, 4, 4)
    assert to_rgb(Image.new("I", (2, 2), 200)).getpixel((0, 0)) == (200, 200, 200)
    palette = Image.new("P", (2, 2), 1)
    palette.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
    assert to_rgb(palette).getpixel((0, 0)) == (10, 20, 30)
    rgb = Image.new("RGB", (2, 2), (1, 2, 3))
    assert to_rgb(rgb) is rgb
    with pytest.raises(TypeError, match="expected a PIL image"):
        to_rgb(np.zeros((2, 2, 3)))


def test_atoms_accept_other_image_modes(tiny_open_clip):
    _, config, weights = tiny_open_clip
    atom = clip_score_atom(config, weights)
    rgb = noise_image(3)
    opaque = rgb.convert("RGBA")  # alpha 255 everywhere: the same picture
    grey16 = Image.fromarray(np.asarray(rgb.convert("L"), np.uint16) * 257)
    assert grey16.mode == "I;16"
    s = atom([Sample("a red circle", rgb), Sample("a red circle", opaque), Sample("x", grey16)])
    assert s[0] == pytest.approx(s[1], abs=1e-6)
    assert math.isfinite(s[2])


def test_bad_completions_and_prompts_name_the_sample(tiny_open_clip):
    _, config, weights = tiny_open_clip
    reward = Reward([clip_score_atom(config, weights)])
    bad_completion = [Sample("a red circle", noise_image(0)), Sample("a red circle", "a circle")]
    with pytest.raises(
        RewardError, match=r"'clip_score'.*sample 1 of the batch.*a str, expected a PIL"
    ):
        reward.score(bad_completion)
    bad_prompt = [Sample(["a", "list"], noise_image(0))]
    with pytest.raises(RewardError, match=r"sample 0 of the batch: the prompt is a list"):
        reward.score(bad_prompt)
    with pytest.raises(RewardError, match=r"sample 0 of the batch.*the image is empty"):
        reward.score([Sample("a red circle", Image.new("RGB", (0, 4)))])


# ---------------------------------------------------------------------------- preference: clip


def test_preference_clip_matches_pickscore_by_hand(tiny_hf_clip):
    from transformers import CLIPModel, CLIPProcessor

    batch = samples(5)
    scores = preference_atom(tiny_hf_clip, batch_size=2)(batch)
    cosines = preference_atom(tiny_hf_clip, scale=1.0, name="cos")(batch)

    # By hand: CLIPModel's own forward gives logits_per_image = logit_scale.exp() * cos for
    # every (image, text) pair; the score of sample i is the diagonal entry.
    model = CLIPModel.from_pretrained(tiny_hf_clip).eval()
    processor = CLIPProcessor.from_pretrained(tiny_hf_clip)
    inputs = processor(
        text=[s.prompt for s in batch],
        images=[s.completion for s in batch],
        padding=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        logits = model(**inputs).logits_per_image.diagonal()
    logit_scale = model.logit_scale.exp().item()
    assert logit_scale == pytest.approx(1 / 0.07, rel=1e-4)  # CLIP's initial temperature
    assert scores == pytest.approx(logits.tolist(), abs=1e-4)
    assert cosines == pytest.approx((logits / logit_scale).tolist(), abs=1e-6)
    assert all(-1.0 <= c <= 1.0 for c in cosines)
    assert len({round(s, 6) for s in scores}) == 5  # distinct pairs score differently


def test_preference_clip_separate_processor_and_errors(tiny_hf_clip, tmp_path):
    batch = samples(2)
    expected = preference_atom(tiny_hf_clip)(batch)
    assert preference_atom(tiny_hf_clip, processor=tiny_hf_clip)(batch) == expected
    with pytest.raises(ValueError, match="preference model directory not found"):
        preference_atom(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="has no config.json"):
        preference_atom(str(tmp_path))
    with pytest.raises(ValueError, match="processor directory not found"):
        preference_atom(tiny_hf_clip, processor=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="preference kind"):
        preference_atom(tiny_hf_clip, kind="imagereward")


# ---------------------------------------------------------------------------- preference: custom

FACTORY = """
import math

class Scorer:
    def __init__(self, device):
        self.device = device
        self.calls = []

    def __call__(self, images, prompts):
        import torch

        self.grad = torch.is_grad_enabled()
        self.calls.append([(im.mode, im.size, p) for im, p in zip(images, prompts)])
        return [len(p) + im.size[0] / 100 for im, p in zip(images, prompts)]

FACTORY_CALLS = []

def make(device):
    FACTORY_CALLS.append(device)
    return Scorer(device)

def make_nan(device):
    return lambda images, prompts: [math.nan] + [1.0] * (len(images) - 1)

def make_raising(device):
    raise OSError("weights missing")

def make_broken_scorer(device):
    def scorer(images, prompts):
        raise KeyError("boom")
    return scorer

def make_short(device):
    return lambda images, prompts: [0.5]

def make_not_callable(device):
    return 42
"""


@pytest.fixture
def factory_file(tmp_path):
    path = tmp_path / "my_scorers.py"
    path.write_text(FACTORY)
    return path


def test_custom_preference_scores_in_batches(factory_file):
    atom = preference_atom(f"{factory_file}:make", kind="custom", batch_size=2, device="cpu")
    batch = samples(5)
    batch[1] = Sample(batch[1].prompt, batch[1].completion.convert("RGBA"))
    scores = atom(batch)
    # len(prompt) + width / 100, width 40: e.g. "a red circle" -> 12 + 0.4.
    assert scores == pytest.approx([len(s.prompt) + 0.4 for s in batch])
    assert scores[0] == pytest.approx(12.4)
    scorer = atom.fn.load()
    assert scorer.device == "cpu" and scorer.grad is False  # scored without gradients, as the built-ins
    assert [len(c) for c in scorer.calls] == [2, 2, 1]  # batch_size 2
    assert all(mode == "RGB" for call in scorer.calls for mode, _, _ in call)
    atom(batch)
    assert [len(c) for c in scorer.calls] == [2, 2, 1, 2, 2, 1]  # the same scorer, reused
    assert preference_atom(f"{factory_file}:make", kind="custom", scale=0.5)(batch[:1]) == [6.2]


def test_custom_preference_errors_name_the_file(factory_file, tmp_path):
    with pytest.raises(ValueError, match=r"file not found: .*nowhere\.py"):
        preference_atom(f"{tmp_path}/nowhere.py:make", kind="custom")
    with pytest.raises(ValueError, match=r"my_scorers\.py has no attribute 'nope'.*make"):
        preference_atom(f"{factory_file}:nope", kind="custom")
    with pytest.raises(ValueError, match="file.py:factory"):
        preference_atom(str(factory_file), kind="custom")
    broken = tmp_path / "broken.py"
    broken.write_text("def make(device:\n")
    with pytest.raises(ValueError, match=r"importing .*broken\.py failed: SyntaxError"):
        preference_atom(f"{broken}:make", kind="custom")

    cases = {
        "make_raising": r"factory .*my_scorers\.py:make_raising\(device='cpu'\) failed: "
        r"OSError: weights missing",
        "make_broken_scorer": r"scorer from .*my_scorers\.py:make_broken_scorer failed: KeyError",
        "make_short": r"my_scorers\.py:make_short returned 1 scores for 2 images",
        "make_not_callable": r"my_scorers\.py:make_not_callable returned an int",
    }
    for factory, message in cases.items():
        atom = preference_atom(f"{factory_file}:{factory}", kind="custom", name=factory)
        with pytest.raises(RewardError, match=f"'{factory}' failed on .*{message}"):
            Reward([atom]).score(samples(2))
    # A failed load is not cached: the next call tries again (and fails again).
    atom = preference_atom(f"{factory_file}:make_raising", kind="custom")
    with pytest.raises(RuntimeError, match="weights missing"):
        atom(samples(1))


def test_nan_from_a_scorer_is_reported_by_reward_score(factory_file):
    atom = preference_atom(f"{factory_file}:make_nan", kind="custom", name="pref")
    with pytest.raises(RewardError, match=r"'pref' failed on sample 0 .*returned nan") as e:
        Reward([atom]).score(samples(3))
    assert e.value.atom == "pref" and e.value.sample_index == 0
    with pytest.warns(RuntimeWarning, match="'pref'"):
        scores = Reward([atom], on_error="zero").score(samples(3))
    assert scores.values[:, 0].tolist() == [0.0, 1.0, 1.0] and scores.errors == 1


# ---------------------------------------------------------------------------- in a core Reward


def test_atoms_score_samples_inside_a_reward(tiny_open_clip, tiny_hf_clip, factory_file):
    _, config, weights = tiny_open_clip
    clip = clip_score_atom(config, weights, weight=2.0)
    pick = preference_atom(tiny_hf_clip, name="pickscore", weight=0.5)
    custom = preference_atom(f"{factory_file}:make", kind="custom", name="custom", weight=-1.0)
    batch = samples(4)
    scores = Reward([clip, pick, custom]).score(batch)
    assert scores.names == ["clip_score", "pickscore", "custom"]
    expected = torch.tensor([clip(batch), pick(batch), custom(batch)]).T  # [N, K]
    torch.testing.assert_close(scores.values, expected, atol=1e-5, rtol=0)
    total = 2.0 * expected[:, 0] + 0.5 * expected[:, 1] - 1.0 * expected[:, 2]
    torch.testing.assert_close(scores.total, total, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------- config specs


def test_build_image_reward_atoms(tiny_open_clip, tiny_hf_clip, factory_file):
    directory, config, weights = tiny_open_clip
    specs = [
        {"type": "clip_score", "model": config, "pretrained": weights, "weight": 0.5},
        {
            "type": "clip_score",
            "model": f"local-dir:{directory}",
            "name": "clip2",
            "scale": 2.5,
            "clamp": True,
        },
        {"type": "preference", "path": tiny_hf_clip, "name": "pickscore", "batch_size": 2},
        {
            "type": "preference",
            "path": f"{factory_file.name}:make",
            "kind": "custom",
            "name": "mine",
            "parents": ["clip_score"],
        },
    ]
    atoms = build_image_reward_atoms(specs, base_dir=factory_file.parent)  # relative path
    assert [a.name for a in atoms] == ["clip_score", "clip2", "pickscore", "mine"]
    assert [a.weight for a in atoms] == [0.5, 1.0, 1.0, 1.0]
    assert atoms[3].parents == ("clip_score",) and all(a.batched for a in atoms)
    batch = samples(3)
    cos = clip_score_atom(config, weights)(batch)
    assert atoms[0](batch) == pytest.approx(cos, abs=1e-6)
    assert atoms[1](batch) == pytest.approx([2.5 * max(c, 0) for c in cos], abs=1e-6)
    assert atoms[2](batch) == pytest.approx(preference_atom(tiny_hf_clip)(batch), abs=1e-5)
    assert atoms[3](batch) == pytest.approx([len(s.prompt) + 0.4 for s in batch])
    assert build_image_reward_atoms([]) == []


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("clip_score", r"spec 0: expected a dict"),
        ({"model": "x"}, r"spec 0: key 'type': unknown type None"),
        ({"type": "aesthetic"}, r"spec 0: key 'type': unknown type 'aesthetic'"),
        (
            {"type": "clip_score", "model": "m", "pretrained": "w", "temperature": 1},
            r"spec 0 \(clip_score\): unknown key 'temperature'",
        ),
        ({"type": "clip_score", "pretrained": "w"}, r"spec 0 \(clip_score\): missing key 'model'"),
        (
            {"type": "clip_score", "model": "ViT-B-32"},
            r"spec 0 \(clip_score\): missing key 'pretrained'",
        ),
        (
            {"type": "clip_score", "model": "ViT-B-32", "pretrained": "nowhere.pt"},
            r"spec 0 \(clip_score\): key 'pretrained': file or directory not found: .*nowhere\.pt",
        ),
        (
            {"type": "clip_score", "model": "cfg.json", "pretrained": "nowhere.pt"},
            r"spec 0 \(clip_score\): key 'model': file not found: .*cfg\.json",
        ),
        (
            {"type": "clip_score", "model": "local-dir:nowhere"},
            r"spec 0 \(clip_score\): key 'model': directory not found",
        ),
        ({"type": "preference"}, r"spec 0 \(preference\): missing key 'path'"),
        (
            {"type": "preference", "path": "nowhere"},
            r"spec 0 \(preference\): key 'path': directory not found: .*nowhere",
        ),
        (
            {"type": "preference", "path": "nowhere.py:make", "kind": "custom"},
            r"spec 0 \(preference\): key 'path': file not found: .*nowhere\.py",
        ),
        (
            {"type": "preference", "path": "x", "kind": "reward_model"},
            r"spec 0 \(preference\): key 'kind': unknown kind 'reward_model'",
        ),
        (
            {"type": "preference", "path": ".", "processor": "nowhere"},
            r"spec 0 \(preference\): key 'processor': directory not found",
        ),
    ],
)
def test_build_image_reward_atoms_rejects_bad_specs(spec, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        build_image_reward_atoms([spec], base_dir=tmp_path)


def test_build_image_reward_atoms_names_the_spec_index(tiny_open_clip, factory_file):
    _, config, weights = tiny_open_clip
    good = {"type": "clip_score", "model": config, "pretrained": weights}
    with pytest.raises(
        ValueError, match=r"spec 1 \(clip_score\): key 'name'.*already used by spec 0"
    ):
        build_image_reward_atoms([good, dict(good)])
    with pytest.raises(ValueError, match=r"spec 1 \(clip_score\): batch_size must be"):
        build_image_reward_atoms([good, {**good, "name": "b", "batch_size": -1}])
    with pytest.raises(ValueError, match=r"spec 2 \(preference\): .*has no attribute 'nope'"):
        build_image_reward_atoms(
            [
                good,
                {**good, "name": "b"},
                {"type": "preference", "path": f"{factory_file}:nope", "kind": "custom"},
            ]
        )
    with pytest.raises(ValueError, match="must be a list"):
        build_image_reward_atoms(good)


def test_image_atom_paths_are_the_configs_like_its_other_paths(factory_file, tmp_path, monkeypatch):
    """task.image_atoms paths resolve from the config's directory, else the working directory,
    as reward.atoms and task.train_path do (they resolved from the working directory only)."""
    from diffusion_rl import backend
    from diffusion_rl.config import DiffusionTrainConfig
    from mmrl.core.config import load_config

    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "scorers.py").write_text(FACTORY)
    (conf / "run.yaml").write_text(
        "task: {image_atoms: [{type: preference, kind: custom, path: scorers.py:make}]}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(DiffusionTrainConfig, conf / "run.yaml", defaults=backend.DEFAULT_CONFIG)
    assert "preference" in backend.build_task(cfg).reward.names
