"""Tiny offline Qwen VL models (mmrl/vlm/tiny.py): build, save, load back through the real
from_pretrained code paths with the hub switched off, and run them end to end on CPU."""

from __future__ import annotations

import importlib.util
import socket
import string
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageDraw
from qwen_vl_utils import process_vision_info
from safetensors.torch import load_file

from mmrl.vlm.tiny import (
    ADDED_TOKENS,
    CHAT_TEMPLATE,
    FAMILIES,
    MODEL_CLASSES,
    PROCESSOR_CLASSES,
    SPECIAL_TOKENS,
    build_processor,
    build_tiny_vlm,
    build_tokenizer,
    load_tiny,
    tiny_config,
)

REPO = Path(__file__).resolve().parents[2]
PATCH_SIZE = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16}
# 112x112 image, merge_size 2. Qwen2/2.5: 112/14 = 8 -> 8x8 patches -> 64 / 4 = 16 tokens.
# Qwen3 (patch 16, factor 32): 112 rounds to 128, 128^2 > max_pixels 112^2, so it is scaled
# down to floor(112 / 32) * 32 = 96 -> 6x6 patches -> 36 / 4 = 9 tokens.
IMAGE_TOKENS_112 = {"qwen2_vl": 16, "qwen2_5_vl": 16, "qwen3_vl": 9}

TASK_STRINGS = [
    "How many red circles are there?",
    "What colour is the triangle?",
    "What shape is the yellow object?",
    "Is the green square left of the blue triangle?",
    "a red circle , a blue square",
    "There are three red circles. <answer>3</answer>",
    "<think>I count two.</think><answer>two</answer>",
    '<tool_call>\n{"name": "zoom", "arguments": {"bbox": [0, 0, 56, 56]}}\n</tool_call>',
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Is it above?<|im_end|>\n",
    "  leading and trailing spaces  \n\n\ttabs\r\n",
    "",
]
_TOKENIZER = build_tokenizer()  # for hypothesis, which cannot take function-scoped fixtures


@pytest.fixture
def offline(monkeypatch):
    """Hub off (as HF_HUB_OFFLINE=1 does) and every socket connection refused."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def refuse(*args, **kwargs):
        raise OSError("network access attempted in an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> directory written by build_tiny_vlm(seed=0)."""
    root = tmp_path_factory.mktemp("tiny")
    return {f: build_tiny_vlm(f, root / f, seed=0) for f in FAMILIES}


def _image(colour=(255, 0, 0)):
    img = Image.new("RGB", (112, 112), (255, 255, 255))
    ImageDraw.Draw(img).ellipse((20, 20, 60, 60), fill=colour)
    return img


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_special_tokens_are_single_ids(tokenizer):
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + ADDED_TOKENS]
    assert len(set(ids)) == len(ids)
    for token, i in zip(SPECIAL_TOKENS + ADDED_TOKENS, ids, strict=True):
        assert tokenizer.encode(token) == [i], token
        assert tokenizer.decode([i], skip_special_tokens=False) == token
    # Qwen order: <|endoftext|>, <|im_start|>, <|im_end|>, ... right after the BPE vocab
    assert ids[: len(SPECIAL_TOKENS)] == list(range(ids[0], ids[0] + len(SPECIAL_TOKENS)))
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.padding_side == "left"
    assert tokenizer.bos_token is None
    assert 256 < len(tokenizer) <= 1024
    assert sorted(tokenizer.get_vocab().values()) == list(range(len(tokenizer)))
    # <answer> etc. are added but not special: kept when special tokens are skipped
    ans = tokenizer.encode("<answer>4</answer><|im_end|>")
    assert tokenizer.decode(ans, skip_special_tokens=True) == "<answer>4</answer>"


def test_tokenizer_covers_task_words_compactly(tokenizer):
    for word in [
        "red",
        "green",
        "blue",
        "yellow",
        "circle",
        "square",
        "triangle",
        "circles",
        "squares",
        "triangles",
        "left",
        "right",
        "above",
        "below",
        "yes",
        "no",
        "zero",
        "three",
        "ten",
        "colour",
        "shape",
        "many",
    ]:
        assert len(tokenizer.encode(" " + word)) == 1, word
    assert len(tokenizer.encode("How many red circles are there?")) == 7


@pytest.mark.parametrize("text", TASK_STRINGS)
def test_tokenizer_round_trip_task_strings(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=string.printable, max_size=80))
def test_tokenizer_round_trip_ascii(text):
    tok = _TOKENIZER
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("text", ["café", "naïve — “quoted”", "红色的圆", "🙂 ok"])
def test_tokenizer_round_trip_unicode(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_tokenizer_is_deterministic(tokenizer):
    again = build_tokenizer()
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


def test_tokenizer_extra_corpus_adds_merges(tokenizer):
    bigger = build_tokenizer(["xylophone zebra quokka"] * 50, vocab_size=1024)
    assert len(bigger.encode(" quokka")) < len(tokenizer.encode(" quokka"))
    assert bigger.decode(bigger.encode(" quokka")) == " quokka"


# --------------------------------------------------------------------------- chat template


def test_chat_template_image_and_text(tokenizer):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "How many red circles are there?"},
            ],
        }
    ]
    out = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        "How many red circles are there?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_text_only(tokenizer):
    messages = [{"role": "user", "content": "What colour is the square?"}]
    out = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out == "<|im_start|>user\nWhat colour is the square?<|im_end|>\n<|im_start|>assistant\n"
    out = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert out == "<|im_start|>user\nWhat colour is the square?<|im_end|>\n"


def test_chat_template_multi_image_system_assistant_tool(tokenizer):
    img = _image()
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": img},
                {"type": "text", "text": "and"},
                {"type": "image", "image": img},
                {"type": "text", "text": "Same?"},
            ],
        },
        {
            "role": "assistant",
            "content": "Let me zoom.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "zoom", "arguments": {"bbox": [0, 0, 56, 56]}},
                }
            ],
        },
        {"role": "tool", "content": [{"type": "image", "image": img}]},
        {"role": "assistant", "content": "<answer>yes</answer>"},
    ]
    out = tokenizer.apply_chat_template(messages, tokenize=False)
    vis = "<|vision_start|><|image_pad|><|vision_end|>"
    assert out == (
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n"
        f"<|im_start|>user\n{vis}and{vis}Same?<|im_end|>\n"
        "<|im_start|>assistant\nLet me zoom.\n<tool_call>\n"
        '{"name": "zoom", "arguments": {"bbox": [0, 0, 56, 56]}}\n</tool_call><|im_end|>\n'
        f"<|im_start|>user\n<tool_response>\n{vis}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<answer>yes</answer><|im_end|>\n"
    )


def test_chat_template_tools_block(tokenizer):
    tools = [{"type": "function", "function": {"name": "zoom", "parameters": {}}}]
    out = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert out.startswith("<|im_start|>system\n# Tools\n\n")
    assert (
        '<tools>\n{"type": "function", "function": {"name": "zoom", "parameters": {}}}\n</tools>'
        in out
    )
    assert out.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# --------------------------------------------------------------------------- config / processor


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_config_fields(family, tokenizer):
    cfg = tiny_config(family, tokenizer)
    text, vision = cfg.text_config, cfg.vision_config
    head_dim = text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    assert text.vocab_size == len(tokenizer)
    assert cfg.tie_word_embeddings
    assert cfg.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert cfg.video_token_id == tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert cfg.vision_start_token_id == tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert cfg.vision_end_token_id == tokenizer.convert_tokens_to_ids("<|vision_end|>")
    assert text.eos_token_id == tokenizer.eos_token_id
    assert text.pad_token_id == tokenizer.pad_token_id
    assert vision.patch_size == PATCH_SIZE[family]
    merger_out = vision.hidden_size if family == "qwen2_vl" else vision.out_hidden_size
    assert merger_out == text.hidden_size
    with pytest.raises(ValueError):
        tiny_config("llava", tokenizer)


@pytest.mark.parametrize("family", FAMILIES)
def test_build_processor_classes(family, tokenizer):
    proc = build_processor(family, tokenizer)
    assert type(proc) is PROCESSOR_CLASSES[family]
    assert proc.image_processor.patch_size == PATCH_SIZE[family]
    assert proc.image_processor.merge_size == 2
    assert proc.video_processor.patch_size == PATCH_SIZE[family]
    assert proc.chat_template == CHAT_TEMPLATE


# --------------------------------------------------------------------------- saved checkpoints


@pytest.mark.parametrize("family", FAMILIES)
def test_load_back_offline(family, built, offline):
    path = built[family]
    model, processor = load_tiny(path)
    assert type(model) is MODEL_CLASSES[family]
    assert type(processor) is PROCESSOR_CLASSES[family]
    assert type(processor.tokenizer).__name__ == "Qwen2Tokenizer"
    assert processor.tokenizer.padding_side == "left"
    assert processor.tokenizer.eos_token == "<|im_end|>"
    assert processor.chat_template == CHAT_TEMPLATE
    assert processor.tokenizer.chat_template == CHAT_TEMPLATE
    assert model.dtype == torch.float32
    emb = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()  # tied
    assert emb.shape[0] == len(processor.tokenizer)
    assert model.generation_config.eos_token_id == [
        processor.tokenizer.eos_token_id,
        processor.tokenizer.pad_token_id,
    ]
    # the concrete class loads the same weights
    direct = MODEL_CLASSES[family].from_pretrained(path)
    for (n, a), (_, b) in zip(model.state_dict().items(), direct.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    size = sum(f.stat().st_size for f in Path(path).iterdir())
    assert size < 5 * 2**20, size
    assert (Path(path) / "model.safetensors").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_build_is_deterministic(family, built, tmp_path):
    again = build_tiny_vlm(family, tmp_path / "again", seed=0)
    assert (again / "model.safetensors").read_bytes() == (
        built[family] / "model.safetensors"
    ).read_bytes()
    for name in ("config.json", "tokenizer.json", "processor_config.json"):
        assert (again / name).read_text() == (built[family] / name).read_text()
    other = load_file(build_tiny_vlm(family, tmp_path / "other", seed=1) / "model.safetensors")
    ref = load_file(built[family] / "model.safetensors")
    assert any(not torch.equal(other[k], ref[k]) for k in ref)


def test_cli_script(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "build_tiny_vlm", REPO / "scripts" / "build_tiny_vlm.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--family", "qwen2_vl", "--out", str(tmp_path / "cli"), "--seed", "0"])
    assert (tmp_path / "cli" / "model.safetensors").exists()
    assert (tmp_path / "cli" / "processor_config.json").exists()


# --------------------------------------------------------------------------- end to end


def _batch(family, processor):
    """Two prompts of different lengths; the second has two images."""
    messages = [
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": _image((255, 0, 0))},
                    {"type": "text", "text": "How many red circles are there?"},
                ],
            }
        ],
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": _image((0, 0, 255))},
                    {"type": "image", "image": _image((0, 255, 0))},
                    {
                        "type": "text",
                        "text": "Is the blue circle in the first image left of the "
                        "green circle in the second image? Answer yes or no.",
                    },
                ],
            }
        ],
    ]
    texts = [
        processor.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        for m in messages
    ]
    images, videos = process_vision_info(messages, image_patch_size=PATCH_SIZE[family])
    assert videos is None and len(images) == 3
    return processor(text=texts, images=images, padding=True, return_tensors="pt")


@pytest.mark.parametrize("family", FAMILIES)
def test_process_forward_generate_backward(family, built, offline):
    torch.manual_seed(0)
    model, processor = load_tiny(built[family])
    tok = processor.tokenizer
    batch = _batch(family, processor)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    B, L = ids.shape
    assert B == 2

    # image tokens: one <|image_pad|> per merged patch
    merge = processor.image_processor.merge_size
    grid = batch["image_grid_thw"]
    assert grid.shape == (3, 3)
    n_image_tokens = int((ids == model.config.image_token_id).sum())
    assert n_image_tokens == int(grid.prod(-1).sum()) // merge**2
    assert n_image_tokens == 3 * IMAGE_TOKENS_112[family]
    assert batch["pixel_values"].shape[0] == int(grid.prod(-1).sum())
    # left padding: the first (shorter) prompt starts with pads, both end on the prompt
    assert mask[0, 0] == 0 and mask[1].all()
    assert (ids[0][mask[0] == 0] == tok.pad_token_id).all()
    assert (ids[:, -1] == ids[1, -1]).all()  # "\n" after "<|im_start|>assistant"
    assert int(mask[0].sum()) < L

    # forward
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (B, L, len(tok))
    assert torch.isfinite(logits).all()

    # sampling
    out = model.generate(**batch, max_new_tokens=5, do_sample=True)
    assert out.shape[0] == B and L < out.shape[1] <= L + 5
    assert torch.equal(out[:, :L], ids)

    # backward: mean log-prob of the prompt's text tokens
    model.train()
    logits = model(**batch).logits
    logp = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    keep = mask[:, 1:].bool() & (ids[:, 1:] != model.config.image_token_id)
    loss = -logp[keep].mean()
    loss.backward()
    assert torch.isfinite(loss)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads, "no parameter got a gradient"
    for n, g in grads.items():
        assert torch.isfinite(g).all(), n
    # the gradient reaches the vision tower through the image tokens
    assert any(("visual" in n) and g.abs().sum() > 0 for n, g in grads.items())


@pytest.mark.parametrize("family", FAMILIES)
def test_text_only_prompt(family, built):
    model, processor = load_tiny(built[family])
    text = processor.apply_chat_template(
        [{"role": "user", "content": "What colour is the square?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    batch = processor(text=[text], return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (1, batch["input_ids"].shape[1], len(processor.tokenizer))
    assert torch.isfinite(logits).all()


# --------------------------------------------------------------------------- values the builders write


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_config_writes_the_documented_layout(family, tokenizer):
    """The values the module docstring and tiny_config's promise, not only their sums: mrope
    2:3:3 (Qwen2/2.5) or interleaved 4:2:2 (Qwen3) of head_dim // 2 = 8; the text config says
    tied too (vLLM reads the text config); the last vision block is the full-attention one and
    Qwen3's deepstack taps every vision block but the last."""
    cfg = tiny_config(family, tokenizer)
    text, vision = cfg.text_config, cfg.vision_config
    assert text.rope_parameters["mrope_section"] == ([4, 2, 2] if family == "qwen3_vl" else [2, 3, 3])
    assert text.tie_word_embeddings and text.intermediate_size == 2 * text.hidden_size
    if family == "qwen2_5_vl":
        assert vision.fullatt_block_indexes == [1]
        assert tiny_config(family, tokenizer, vision_depth=4).vision_config.fullatt_block_indexes == [3]
    if family == "qwen3_vl":
        assert vision.deepstack_visual_indexes == [0]
        assert tiny_config(family, tokenizer, vision_depth=1).vision_config.deepstack_visual_indexes == []
        assert tiny_config(family, tokenizer, vision_depth=4, num_layers=2).vision_config.deepstack_visual_indexes \
            == [0, 1]  # at most one per text layer


def test_tiny_config_refuses_an_odd_head_dim(tokenizer):
    with pytest.raises(ValueError, match="hidden_size 60 must be num_heads x an even head_dim"):
        tiny_config("qwen2_vl", tokenizer, hidden_size=60, num_heads=4)  # head_dim 15: no rotary pairs
    with pytest.raises(ValueError, match="hidden_size 66 must be"):
        tiny_config("qwen2_vl", tokenizer, hidden_size=66, num_heads=4)


@pytest.mark.parametrize("family", FAMILIES)
def test_build_processor_pixel_bounds(family, tokenizer):
    """min/max_pixels reach both processors; Qwen3-VL's video bound is for a whole clip (16 frames)."""
    proc = build_processor(family, tokenizer, min_pixels=28 * 28, max_pixels=56 * 56)
    assert proc.image_processor.size == {"shortest_edge": 28 * 28, "longest_edge": 56 * 56}
    video = 56 * 56 * (16 if family == "qwen3_vl" else 1)
    assert proc.video_processor.size["longest_edge"] == video
    assert proc.video_processor.size["shortest_edge"] == 28 * 28


def test_build_tiny_vlm_saves_the_pixel_bounds_it_is_given(tmp_path):
    path = build_tiny_vlm("qwen2_vl", tmp_path / "m", min_pixels=28 * 28, max_pixels=56 * 56, num_layers=1,
                          vision_depth=1)
    _, processor = load_tiny(path)
    assert processor.image_processor.size == {"shortest_edge": 28 * 28, "longest_edge": 56 * 56}
    assert processor.video_processor.size["longest_edge"] == 56 * 56
