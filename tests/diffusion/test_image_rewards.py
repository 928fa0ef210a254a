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


def test_clip_score_uses_the_preprocess_cfg_of_a_config_file(tiny_open_clip, tmp_path):
    """A config file's preprocess_cfg (mean, std) normalises the pixels, as open_clip does for
    the same config in a local-dir model; the same weights with the plain config (open_clip's
    default mean and std) score otherwise, and each config gets its own cached model."""
    _, config, weights = tiny_open_clip
    raw = json.loads(Path(config).read_text())
    raw["preprocess_cfg"] = {"mean": [0.1, 0.2, 0.3], "std": [0.5, 0.5, 0.5]}
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "open_clip_config.json").write_text(json.dumps(raw))
    (model_dir / "open_clip_model.safetensors").write_bytes(Path(weights).read_bytes())
    custom = model_dir / "custom.json"
    custom.write_text(json.dumps(raw))
    batch = samples(3)
    plain = clip_score_atom(config, weights)(batch)  # the default preprocessing first
    by_dir = clip_score_atom(f"local-dir:{model_dir}")(batch)
    by_config = clip_score_atom(str(custom), weights)(batch)
    assert by_config == pytest.approx(by_dir, abs=1e-6)
    assert all(abs(a - b) > 1e-4 for a, b in zip(by_config, plain))


def test_clip_score_in_bf16_scores_close_to_fp32(tiny_open_clip):
    """precision="bf16": weights and pixels in bfloat16 (float32 pixels would not go through
    the bf16 patch embedding); the cosine agrees with fp32 to bf16's ~3 significant digits."""
    _, config, weights = tiny_open_clip
    batch = samples(3)
    atom = clip_score_atom(config, weights, precision="bf16")
    assert atom.fn.load()[0].visual.conv1.weight.dtype == torch.bfloat16
    assert atom(batch) == pytest.approx(clip_score_atom(config, weights)(batch), abs=0.02)


def test_atoms_score_an_empty_batch_as_no_scores(tiny_open_clip, tiny_hf_clip, factory_file):
    _, config, weights = tiny_open_clip
    assert clip_score_atom(config, weights)([]) == []
    assert preference_atom(tiny_hf_clip)([]) == []
    assert preference_atom(f"{factory_file}:make", kind="custom")([]) == []


def test_scale_and_batch_size_must_be_finite_numbers_and_positive_ints(tiny_open_clip, tiny_hf_clip):
    _, config, weights = tiny_open_clip
    for bad in (float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="scale must be a finite number"):
            clip_score_atom(config, weights, scale=bad)
        with pytest.raises(ValueError, match="scale must be a finite number"):
            preference_atom(tiny_hf_clip, scale=bad)
    with pytest.raises(ValueError, match="scale must be a number"):
        preference_atom(tiny_hf_clip, scale="big")
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got True"):
        clip_score_atom(config, weights, batch_size=True)
    with pytest.raises(ValueError, match="pretrained"):  # a model directory has its own weights
        clip_score_atom(f"local-dir:{Path(config).parent}", weights)


@pytest.mark.parametrize(("key", "bad", "message"), [
    ("clamp", "false", r"clamp must be true or false, got 'false'"),  # bool("false") was True
    ("precision", "bfloat16", r"precision must be one of fp32, fp16, bf16.*got 'bfloat16'"),  # was fp32
    ("precision", "fp8", r"precision must be one of .*got 'fp8'"),
])
def test_clamp_and_precision_of_a_spec_are_checked_not_coerced(tiny_open_clip, key, bad, message):
    _, config, weights = tiny_open_clip
    spec = {"type": "clip_score", "model": config, "pretrained": weights, key: bad}
    with pytest.raises(ValueError, match=r"image reward spec 0 \(clip_score\): " + message):
        build_image_reward_atoms([spec])


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


def test_to_rgb_rounds_and_clips_grey_levels():
    def grey(mode, value):
        return to_rgb(Image.new(mode, (2, 2), value)).getpixel((0, 0))[0]

    # 16-bit, v * 255 / 65535 rounded to nearest: 65407 -> 254.502 -> 255 (254 truncated, or
    # 254.498 with / 65536), 129 -> 0.502 -> 1, 128 -> 0.498 -> 0.
    assert [grey("I;16", v) for v in (65407, 129, 128)] == [255, 1, 0]
    assert grey("I;16B", 25700) == 100  # big-endian 16-bit: 25700 / 257
    # "I" at most 255 is 8-bit already (255 stays 255); above it is 16-bit, and past 65535 it
    # clips: 70000 -> 272.4 -> 255. Negative values clip to 0.
    assert [grey("I", v) for v in (255, 70000, -5)] == [255, 255, 0]


def test_to_rgb_composites_a_palette_transparency_over_white():
    palette = [0, 0, 0, 10, 20, 30] + [0] * 762
    keyed = Image.new("P", (2, 2), 1)
    keyed.putpalette(palette)
    keyed.info["transparency"] = 1  # colour 1 is transparent
    assert keyed.convert("RGB").getpixel((0, 0)) == (10, 20, 30)  # what a plain convert gives
    assert to_rgb(keyed).getpixel((0, 0)) == (255, 255, 255)
    pa = Image.new("PA", (2, 2), (1, 0))  # colour 1 at alpha 0
    pa.putpalette(palette)
    assert to_rgb(pa).getpixel((0, 0)) == (255, 255, 255)


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


def test_preference_clip_uses_the_processor_it_is_given(tiny_hf_clip, tmp_path):
    """processor=DIR preprocesses with DIR's processor: the same model with another image_mean
    scores as a model directory that carries that processor itself, not as the model's own."""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_hf_clip, other)
    pre = json.loads((other / "processor_config.json").read_text())
    pre["image_processor"]["image_mean"] = [0.9, 0.1, 0.5]
    (other / "processor_config.json").write_text(json.dumps(pre))
    batch = samples(3)
    own = preference_atom(tiny_hf_clip, scale=1.0)(batch)
    given = preference_atom(tiny_hf_clip, processor=str(other), scale=1.0)(batch)
    assert given == pytest.approx(preference_atom(str(other), scale=1.0)(batch), abs=1e-6)
    assert all(abs(a - b) > 1e-4 for a, b in zip(given, own))


def test_preference_clip_truncates_prompts_to_the_text_positions(tiny_hf_clip):
    """A prompt longer than the model's 16 text positions is cut to them, also when the
    tokenizer sets no limit of its own (transformers' 1e30 default): two prompts that agree on
    their first 16 tokens score the same."""
    long = "a red circle left of a blue square above a green triangle below a yellow circle"
    batch = [Sample(long, noise_image(0)), Sample(long + " and two more squares", noise_image(0))]
    clear_model_cache()
    try:
        atom = preference_atom(tiny_hf_clip, scale=1.0)
        tokenizer = atom.fn.load()[2]
        assert len(tokenizer(long)["input_ids"]) > 16
        s = atom(batch)
        tokenizer.model_max_length = int(1e30)
        assert atom(batch) == pytest.approx(s, abs=1e-6)
        assert s[0] == pytest.approx(s[1], abs=1e-6) and -1.0 <= s[0] <= 1.0
    finally:
        clear_model_cache()


def test_preference_clip_dtype_loads_the_model_in_it(tiny_hf_clip):
    batch = samples(3)
    bf16 = preference_atom(tiny_hf_clip, dtype="bfloat16", scale=1.0)
    fp32 = preference_atom(tiny_hf_clip, scale=1.0)
    model = bf16.fn.load()[0]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert fp32.fn.load()[0].text_projection.weight.dtype == torch.float32  # its own model
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert bf16(batch) == pytest.approx(fp32(batch), abs=0.03)  # bf16's ~3 digits
    with pytest.raises(ValueError, match="dtype must be"):
        preference_atom(tiny_hf_clip, dtype="float64")


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

def make_array(device):
    import numpy as np
    return lambda images, prompts: np.array([float(len(p)) for p in prompts])

def make_tensor(device):
    import torch
    return lambda images, prompts: torch.tensor([float(len(p)) for p in prompts])

def make_scalar(device):
    import torch
    return lambda images, prompts: torch.tensor(1.0)

def make_long(device):
    return lambda images, prompts: [0.5] * (len(images) + 1)

def make_text(device):
    return lambda images, prompts: ["0.5"] * len(images)

def make_huge(device):
    return lambda images, prompts: [10**400] * len(images)
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


def test_custom_scorer_may_return_an_array_or_a_tensor(factory_file):
    batch = samples(3)  # prompts of 12, 41 and 15 characters
    for factory in ("make_array", "make_tensor"):
        atom = preference_atom(f"{factory_file}:{factory}", kind="custom", batch_size=2)
        assert atom(batch) == [12.0, 41.0, 15.0]


def test_custom_scorer_must_return_one_score_per_image(factory_file):
    for factory, message in {
        "make_long": r"returned 3 scores for 2 images",
        "make_scalar": r"returned a Tensor of shape \(\), expected 2 scores",
    }.items():
        atom = preference_atom(f"{factory_file}:{factory}", kind="custom", name=factory)
        with pytest.raises(RewardError, match=message):
            Reward([atom]).score(samples(2))
    # A scale leaves what is not a number (here the string "0.5") for the core to refuse.
    atom = preference_atom(f"{factory_file}:make_text", kind="custom", scale=2.0)
    with pytest.raises(RewardError, match=r"returned a str, expected a number"):
        Reward([atom]).score(samples(1))
    # so does an int past float's range: the core names the sample, as without a scale
    for scale in (2.0, None):
        atom = preference_atom(f"{factory_file}:make_huge", kind="custom", scale=scale)
        with pytest.raises(RewardError, match=r"failed on sample 0 .*too large for a float"):
            Reward([atom]).score(samples(1))


def test_custom_scorer_is_made_once_per_device(factory_file):
    """The factory runs once per (file:factory, device): atoms on one device share a scorer,
    an atom on another device gets a scorer made for its device."""
    cpu = preference_atom(f"{factory_file}:make", kind="custom")
    cpu0 = preference_atom(f"{factory_file}:make", kind="custom", device="cpu:0")
    assert cpu.fn.load().device == "cpu"
    assert cpu0.fn.load().device == "cpu:0"
    assert preference_atom(f"{factory_file}:make", kind="custom").fn.load() is cpu.fn.load()


def test_custom_preference_refuses_clip_only_options_and_bad_factories(factory_file, tmp_path):
    with pytest.raises(ValueError, match='kind="clip" only'):
        preference_atom(f"{factory_file}:make", kind="custom", dtype="float16")
    with pytest.raises(ValueError, match='kind="clip" only'):
        preference_atom(f"{factory_file}:make", kind="custom", processor=str(tmp_path))
    with pytest.raises(ValueError, match="must look like"):
        preference_atom(f"{factory_file}:not-a-name", kind="custom")
    atom_file = tmp_path / "atoms.py"
    atom_file.write_text(
        "from mmrl.core.rewards import RewardAtom\nscore = RewardAtom('s', lambda s: 1.0)\n"
    )
    with pytest.raises(ValueError, match="is a reward atom"):
        preference_atom(f"{atom_file}:score", kind="custom")


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


def test_build_image_reward_atoms_passes_every_key_on(tiny_open_clip, tiny_hf_clip, tmp_path):
    """Relative model, pretrained and processor paths resolve from base_dir (pretrained may be
    a model directory); precision, dtype, device and batch_size reach the atom."""
    import shutil

    directory, config, weights = tiny_open_clip
    base = tmp_path / "conf"
    shutil.copytree(directory, base / "oc")
    shutil.copytree(tiny_hf_clip, base / "hf")
    (base / "scorers.py").write_text(FACTORY)
    specs = [
        {"type": "clip_score", "model": "oc/open_clip_config.json",
         "pretrained": "oc/open_clip_model.safetensors", "precision": "bf16"},
        {"type": "clip_score", "model": "tiny", "pretrained": "oc", "name": "by_dir"},
        {"type": "preference", "path": "hf", "processor": "hf", "dtype": "bfloat16"},
        {"type": "preference", "path": "scorers.py:make", "kind": "custom", "name": "mine",
         "device": "cpu:0", "batch_size": 2},
    ]
    atoms = build_image_reward_atoms(specs, base_dir=base)
    batch = samples(3)
    assert atoms[0].fn.load()[0].visual.conv1.weight.dtype == torch.bfloat16
    assert atoms[1](batch) == pytest.approx(clip_score_atom(config, weights)(batch), abs=1e-6)
    assert next(atoms[2].fn.load()[0].parameters()).dtype == torch.bfloat16
    atoms[3](batch)
    scorer = atoms[3].fn.load()
    assert scorer.device == "cpu:0" and [len(c) for c in scorer.calls] == [2, 1]
