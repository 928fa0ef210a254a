"""Prompt images are resized once, by qwen-vl-utils at the model's patch size: to multiples of
28 for Qwen2/2.5-VL (patch 14) and of 32 for Qwen3-VL (patch 16), so that the processor cuts
them as they are. At qwen-vl-utils' default (14) a Qwen3-VL image came in 28-multiples, which
the processor resampled again to 32-multiples."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from mmrl.core.config import load_config
from mmrl.vlm import backend
from mmrl.vlm.agent import ToolRollout, _Row
from mmrl.vlm.config import ToolsConfig
from mmrl.vlm.models import bundled_model_dir
from mmrl.vlm.policy import VLMPolicy, resize_for_model
from mmrl.vlm.tasks.shapes_qa import QAItem
from mmrl.vlm.tiny import build_processor
from mmrl.vlm.tools import ToolRegistry
from mmrl.vlm.vllm_engine import _VLLMBase

MIN, MAX = 56 * 56, 112 * 112  # model.min_pixels / max_pixels' defaults, the tiny processors' bounds
FACTOR = {"qwen2_5_vl": 28, "qwen3_vl": 32}  # patch 14 or 16, merged 2 x 2


def photo(w, h, seed=0):
    """Noise, so that any resampling shows in the pixels."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3)).astype(np.uint8), "RGB")


@pytest.fixture(scope="module")
def processors():
    """family -> its real processor (mmrl.vlm.tiny), with the bundled model's tokenizer."""
    tokenizer = AutoProcessor.from_pretrained(bundled_model_dir()).tokenizer
    return {family: build_processor(family, tokenizer) for family in FACTOR}


class Spy:
    """The processor, noting the images each call is given."""

    def __init__(self, processor):
        self.processor, self.images = processor, []

    def __call__(self, *args, images=None, **kwargs):
        self.images.append(images)
        return self.processor(*args, images=images, **kwargs)

    def __getattr__(self, name):
        return getattr(self.processor, name)


def policy_of(processor) -> VLMPolicy:
    """A policy around the processor alone: encode and the resize checks run no model."""
    model = torch.nn.Linear(1, 1)
    model.config = SimpleNamespace()
    return VLMPolicy(model, Spy(processor), min_pixels=MIN, max_pixels=MAX)


@pytest.mark.parametrize("family", FACTOR)
def test_encode_resizes_once_to_multiples_of_the_models_patch(processors, family):
    """A 200 x 150 image within 112^2 pixels: beta = sqrt(30000 / 12544) = 1.546, so 200 -> 129.3
    and 150 -> 97.0, floored to multiples of 28 (112 x 84) or of 32 (128 x 96). The processor
    receives that image and cuts it as it is: its grid is the image's size over the patch, and
    its patches are those of the image processed with no resizing at all."""
    policy = policy_of(processors[family])
    enc = policy.encode([QAItem(images=[photo(200, 150)], question="What?", answer="")])
    ((image,),) = policy.processor.images
    assert image.size == {"qwen2_5_vl": (112, 84), "qwen3_vl": (128, 96)}[family]
    patch = FACTOR[family] // 2
    assert enc["image_grid_thw"].tolist() == [[1, image.height // patch, image.width // patch]]
    once = processors[family].image_processor(images=[image], do_resize=False, return_tensors="pt")
    assert torch.equal(enc["pixel_values"], once["pixel_values"])
    # the checks that refuse images resize them as encode does
    assert policy.resize_images([photo(200, 150)])[0].size == image.size
    # an export's processor, fed the original, takes it to the same grid
    plain = policy.saved_processor().image_processor(images=[photo(200, 150)], return_tensors="pt")
    assert torch.equal(plain["image_grid_thw"], enc["image_grid_thw"])


def test_a_processor_with_larger_bounds_cuts_the_runs_image_as_it_is(processors):
    """A released Qwen3-VL's processor bounds images to 65536 .. 16777216 px (256^2 .. 4096^2).
    encode's 128 x 96 image (within the run's 112^2) is cut as it is: a grid of [1, 6, 8] 16-px
    patches, 12 tokens after the 2 x 2 merge (the processor scaled it up to its 65536 px:
    [1, 14, 20], 70 tokens); a tool's image likewise (agent). The saved processor holds the
    run's bounds, not max(65536, 56^2) .. min(16777216, 112^2) = 65536 .. 12544, an empty
    range, and takes the original image to the run's grid."""
    released = build_processor("qwen3_vl", processors["qwen3_vl"].tokenizer, min_pixels=256 * 256,
                               max_pixels=4096 * 4096)
    policy = policy_of(released)
    enc = policy.encode([QAItem(images=[photo(200, 150)], question="What?", answer="")])
    assert enc["image_grid_thw"].tolist() == [[1, 96 // 16, 128 // 16]]
    assert int((enc["input_ids"] == released.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum()) == 12
    row = _Row(item=None)  # a tool's image, as the tool loop shows it to the model
    ToolRollout(policy, ToolRegistry(), ToolsConfig())._observe(row, [photo(200, 150)])
    assert [g.tolist() for g in row.grids] == [[[1, 6, 8]]]
    saved = VLMPolicy(policy.model, released, min_pixels=MIN, max_pixels=MAX).saved_processor()  # no Spy
    assert dict(saved.image_processor.size) == {"shortest_edge": MIN, "longest_edge": MAX}
    assert released.image_processor.size["shortest_edge"] == 256 * 256  # the run's own is left as is
    plain = saved.image_processor(images=[photo(200, 150)], return_tensors="pt")
    assert plain["image_grid_thw"].tolist() == [[1, 6, 8]]


def test_a_saved_processor_without_the_runs_bounds_has_qwen_vl_utils_defaults(processors):
    """Where the run sets no bounds, qwen-vl-utils resized within its own: 4 .. 16384 tokens of
    32 x 32 px for Qwen3-VL; the saved processor says so, and takes a 1000 x 750 photo, within
    them, to qwen-vl-utils' 992 x 736 (31 x 23 tokens, grid [1, 46, 62])."""
    policy = VLMPolicy(policy_of(processors["qwen3_vl"]).model, processors["qwen3_vl"])  # no bounds
    saved = policy.saved_processor()
    assert dict(saved.image_processor.size) == {"shortest_edge": 4 * 32 * 32, "longest_edge": 16384 * 32 * 32}
    assert policy.resize_images([photo(1000, 750)])[0].size == (992, 736)
    plain = saved.image_processor(images=[photo(1000, 750)], return_tensors="pt")
    assert plain["image_grid_thw"].tolist() == [[1, 46, 62]]


def test_the_vllm_engines_resize_as_encode_does(processors):
    """The vLLM engines' prompt images (_VLLMBase._chat) are encode's: 128 x 96 for Qwen3-VL."""
    policy = policy_of(processors["qwen3_vl"])
    item = QAItem(images=[photo(200, 150)], question="What?", answer="")
    _, _, images = _VLLMBase._chat(SimpleNamespace(policy=policy), item)
    assert [im.size for im in images] == [(128, 96)]


def test_vllm_is_asked_to_cut_the_images_as_they_are(processors):
    """vLLM's processor is the served model's, with the base's bounds (a released Qwen3-VL's
    65536 px would scale the 128 x 96 image up, and vLLM's prompt would not be the trainer's):
    a request with images asks it not to resize them (mm_processor_kwargs), one without does not."""
    from mmrl.core.engine import Request
    from mmrl.vlm.vllm_engine import VLLMServerEngine

    engine = VLLMServerEngine("http://127.0.0.1:9", policy_of(processors["qwen3_vl"]), model="tiny", own_weights=False)
    rollout = SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=8, stop=None)
    with_image, text_only = (QAItem(images=images, question="What?", answer="") for images in ([photo(200, 150)], []))
    assert engine._body(with_image, Request(0, with_image, 1), rollout, 0)["mm_processor_kwargs"] == {"do_resize": False}
    assert "mm_processor_kwargs" not in engine._body(text_only, Request(1, text_only, 1), rollout, 0)


def test_the_resize_checks_use_the_models_patch(processors):
    """A 1300 x 100 image at most 112^2 pixels: beta = sqrt(130000 / 12544) = 3.22 and its short
    side 100 / 3.22 = 31.1 floors to 28 for Qwen2.5-VL but to 0 for Qwen3-VL's 32, so the check
    that refuses images at build refuses it for Qwen3-VL only (it let it through, to fail in
    the first rollout)."""
    assert backend._resize_problem(policy_of(processors["qwen2_5_vl"]), 1300, 100) is None
    problem = backend._resize_problem(policy_of(processors["qwen3_vl"]), 1300, 100)
    assert problem is not None and "> 0" in problem  # the resize's own words: "height and width must be > 0"


def test_a_jsonl_image_is_kept_at_the_models_size(processors, tmp_path):
    """model_view, which keeps a jsonl photo at the model's size when the task loads (before the
    processor), reads the patch from model.path: a 600 x 400 photo within 112^2 pixels is
    600 / 4.374 = 137.2 by 91.4, floored to 128 x 64 for Qwen3-VL (it was 112 x 84, 28-multiples),
    and the policy's resize of the kept image is the resize of the original."""
    model = tmp_path / "qwen3"
    processors["qwen3_vl"].save_pretrained(model)
    photo(600, 400).save(tmp_path / "big.png")
    lines = "".join(json.dumps({"question": q, "answer": "x", "image": "big.png"}) + "\n" for q in ("a?", "b?"))
    (tmp_path / "train.jsonl").write_text(lines)
    cfg = load_config(backend.CONFIG_CLASS, None, ["task.type=jsonl", f"task.train_path={tmp_path / 'train.jsonl'}",
                                                   f"task.eval_path={tmp_path / 'train.jsonl'}", f"model.path={model}"],
                      defaults=backend.DEFAULT_CONFIG)
    with pytest.warns(UserWarning, match="held-out"):  # the same file twice: the overlap warning
        task = backend.build_task(cfg)
    (kept,) = task.train[0].images
    assert kept.size == (128, 64)
    policy = policy_of(processors["qwen3_vl"])
    (now,), (before,) = policy.resize_images([kept]), policy.resize_images([Image.open(tmp_path / "big.png")])
    assert np.array_equal(np.asarray(now), np.asarray(before))


def test_the_patch_is_read_as_transformers_reads_it(tmp_path):
    """processor_config.json's image_processor first (transformers 5's layout), else a released
    checkpoint's preprocessor_config.json, else qwen-vl-utils' default 14."""

    def patch(**files):
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        for name, content in files.items():
            (d / f"{name}.json").write_text(json.dumps(content))
        return backend.saved_patch_size(SimpleNamespace(model=SimpleNamespace(path=str(d)), base_dir=None))

    assert patch(preprocessor_config={"patch_size": 16, "merge_size": 2}) == 16
    assert patch(processor_config={"image_processor": {"patch_size": 16}}, preprocessor_config={"patch_size": 14}) == 16
    assert patch(processor_config={"processor_class": "X"}, preprocessor_config={"patch_size": 16}) == 16
    assert patch() == patch(preprocessor_config={"patch_size": "16"}) == 14
    assert backend.saved_patch_size(SimpleNamespace(model=SimpleNamespace(path=None), base_dir=None)) == 14  # bundled


def test_resize_for_model_keeps_qwen_vl_utils_default():
    """Qwen2/2.5-VL's 28-multiples where no patch is given (the bundled model's, as before)."""
    assert resize_for_model([photo(200, 150)], MIN, MAX)[0].size == (112, 84)
    assert resize_for_model([photo(200, 150)], MIN, MAX, patch_size=16)[0].size == (128, 96)


def test_a_processor_whose_patch_differs_from_its_files_is_warned_of(tmp_path, monkeypatch):
    """The data's images are kept at the patch read from model.path's files, before the processor
    loads; where the loaded processor cuts another (a remote-code processor naming none in its
    JSON), each rollout resizes that view again: said once, at build. The bundled model: silent."""
    import warnings

    photo(600, 400).save(tmp_path / "big.png")
    lines = "".join(json.dumps({"question": q, "answer": "x", "image": "big.png"}) + "\n" for q in ("a?", "b?"))
    (tmp_path / "train.jsonl").write_text(lines)
    (tmp_path / "eval.jsonl").write_text(lines.replace("a?", "c?").replace("b?", "d?"))
    cfg = load_config(backend.CONFIG_CLASS, None, ["task.type=jsonl", f"task.train_path={tmp_path / 'train.jsonl'}",
                                                   f"task.eval_path={tmp_path / 'eval.jsonl'}"],
                      defaults=backend.DEFAULT_CONFIG)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backend.build(cfg)
    monkeypatch.setattr(backend, "saved_patch_size", lambda cfg: 16)
    with pytest.warns(UserWarning, match=r"cuts 14-pixel patches, but its JSON files name 16 .*multiples of 32"):
        backend.build(cfg)
