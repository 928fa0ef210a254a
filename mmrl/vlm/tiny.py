"""Tiny, offline-built instances of the real Qwen VL classes (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

Nothing here touches a model hub. The tokenizer is a byte-level BPE trained with the
`tokenizers` library on a built-in corpus of the synthetic tasks' text, wrapped in the real
`Qwen2Tokenizer` (same normaliser, pre-tokeniser and decoder as the real Qwen tokenizers),
with the Qwen special tokens and a Qwen-style chat template. The processors are the real
processor classes with their real image / video processors, and the models are the real
`*ForConditionalGeneration` classes with 1-2 layer, 64-wide configs. Everything is written
with `save_pretrained` and loads back through `AutoModelForImageTextToText` /
`AutoProcessor.from_pretrained` from the local directory (no model hub is touched).

    path = build_tiny_vlm("qwen2_5_vl", "assets/tiny-qwen2_5_vl", seed=0)
    model, processor = load_tiny(path)

Where we depart from the real checkpoints:
- vocabulary of ~580 ids (byte-level, so any text still round-trips) instead of ~152k;
- the chat template adds no default system prompt (like Qwen3-VL, unlike Qwen2/2.5-VL's
  "You are a helpful assistant."), so prompts are short;
- `min_pixels` / `max_pixels` default to 56*56 / 112*112, so an image costs at most 16
  (Qwen2/2.5, patch 14) or 12 (Qwen3, patch 16) visual tokens; 16 / 9 for 112x112.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import (
    AutoModelForImageTextToText,
    AutoProcessor,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2Tokenizer,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

__all__ = [
    "ADDED_TOKENS",
    "CHAT_TEMPLATE",
    "FAMILIES",
    "MODEL_CLASSES",
    "PROCESSOR_CLASSES",
    "SPECIAL_TOKENS",
    "build_processor",
    "build_tiny_vlm",
    "build_tokenizer",
    "builtin_corpus",
    "load_tiny",
    "tiny_config",
]

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

MODEL_CLASSES = {
    "qwen2_vl": Qwen2VLForConditionalGeneration,
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    "qwen3_vl": Qwen3VLForConditionalGeneration,
}
PROCESSOR_CLASSES = {
    "qwen2_vl": Qwen2VLProcessor,
    "qwen2_5_vl": Qwen2_5_VLProcessor,
    "qwen3_vl": Qwen3VLProcessor,
}
_CONFIG_CLASSES = {
    "qwen2_vl": Qwen2VLConfig,
    "qwen2_5_vl": Qwen2_5_VLConfig,
    "qwen3_vl": Qwen3VLConfig,
}

# In the order of the real Qwen vocabularies (151643, 151644, ...).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Added but not special (as in the real Qwen tokenizers): single ids, kept by
# decode(skip_special_tokens=True).
ADDED_TOKENS = (
    "<answer>",
    "</answer>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

# The real Qwen2 tokenizer's pre-tokenisation regex (transformers' tokenization_qwen2.py).
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3-VL-style template (no default system prompt). Content is a string or a list of
# {"type": "image" | "video" | "text", ...} parts; roles system / user / assistant / tool;
# `tools` and assistant `tool_calls` render as in Qwen2.5/Qwen3.
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is none -%}"
    "{%- elif content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'video' or 'video' in part -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in part -%}{{ part['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- render_content(messages[0]['content']) + '\\n\\n' -}}"
    "{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' -}}'
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- if not (tools and loop.first) -%}"
    "{{- '<|im_start|>system\\n' + render_content(message['content']) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}"
    "{{- '<|im_start|>user' -}}"
    "{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + render_content(message['content']) + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- else -%}"
    "{%- set content = render_content(message['content']) -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content -}}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] -%}"
    "{%- for tool_call in message['tool_calls'] -%}"
    "{%- if (loop.first and content) or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{%- if tool_call['function'] -%}{%- set tool_call = tool_call['function'] -%}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call['name'] + '\", \"arguments\": ' -}}"
    "{%- if tool_call['arguments'] is string -%}{{- tool_call['arguments'] -}}"
    "{%- else -%}{{- tool_call['arguments'] | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_COLOURS = ("red", "green", "blue", "yellow")
_SHAPES = ("circle", "square", "triangle")
_NUMBER_WORDS = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
)
_RELATIONS = ("left of", "right of", "above", "below")
_MOODS = (
    "happy",
    "sad",
    "calm",
    "angry",
    "scared",
    "surprised",
    "bored",
    "excited",
    "peaceful",
    "tense",
    "cheerful",
    "gloomy",
)


def builtin_corpus() -> list[str]:
    """The deterministic training text of the tiny tokenizer: the synthetic tasks' questions,
    answers, reasoning phrases, tool calls and chat boilerplate."""
    lines: list[str] = [
        "You are a helpful assistant.",
        "system",
        "user",
        "assistant",
        "tool",
        "Answer with a single word or number.",
        "Think step by step, then give the final answer inside <answer></answer>.",
        "Let me think step by step.",
        "I see the image. Let me look at each object.",
        "Let me zoom in to read the small details.",
        "The answer is",
        "So the answer is",
        "Therefore",
        "First",
        "Then",
        "Finally",
        "The image shows",
        "There is",
        "There are",
        "I count",
        "objects in total.",
        "Yes",
        "No",
        "yes",
        "no",
        "true",
        "false",
        "How does this picture feel? Answer with one emotion word.",
        "The scene feels",
        "The mood of the image is",
        "zoom",
        "crop",
        "bbox",
        "image",
        "region",
        "arguments",
        "name",
        "0123456789",
        "10",
        "11",
        "12",
        "100",
        "112",
        "224",
        "56",
        "28",
        "14",
    ]
    for c in _COLOURS:
        lines += [c, c.capitalize(), f"The answer is {c}."]
    for s in _SHAPES:
        lines += [
            f"What colour is the {s}?",
            f"What color is the {s}?",
            f"What shape is the {s} object?",
            f"How many {s}s are there?",
            f"The {s} is",
        ]
        for c in _COLOURS:
            lines += [
                f"How many {c} {s}s are there?",
                f"How many {c} objects are there?",
                f"What shape is the {c} object?",
                f"What colour is the {s} on the left?",
                f"Is there a {c} {s}?",
                f"a {c} {s}",
                f"the {c} {s}",
                f"I see a {c} {s} at the top left and a {c} {s} at the bottom right.",
                f"The {c} {s} is small.",
            ]
            for n, w in enumerate(_NUMBER_WORDS):
                lines.append(f"There are {w} {c} {s}s. <answer>{n}</answer>")
                lines.append(f"{n} {c} {s}s")
    for c1 in _COLOURS:
        for c2 in _COLOURS:
            for s1 in _SHAPES:
                for s2 in _SHAPES:
                    if (c1, s1) == (c2, s2):
                        continue
                    lines.append(f"a {c1} {s1} , a {c2} {s2}")
                    for r in _RELATIONS:
                        lines.append(f"Is the {c1} {s1} {r} the {c2} {s2}?")
                        lines.append(f"The {c1} {s1} is {r} the {c2} {s2}. <answer>yes</answer>")
    for m in _MOODS:
        lines += [f"The scene feels {m}. <answer>{m}</answer>", m]
    for x in range(0, 112, 8):
        lines.append(
            f'<tool_call>\n{{"name": "zoom", "arguments": {{"bbox": [{x}, {x}, {x + 56}, {x + 56}]}}}}'
            "\n</tool_call>"
        )
    words = (
        _COLOURS
        + _SHAPES
        + tuple(s + "s" for s in _SHAPES)
        + _NUMBER_WORDS
        + _MOODS
        + (
            "yes",
            "no",
            "left",
            "right",
            "above",
            "below",
            "top",
            "bottom",
            "middle",
            "center",
            "small",
            "large",
            "big",
            "first",
            "second",
            "image",
            "object",
            "objects",
            "colour",
            "color",
            "shape",
            "count",
            "many",
            "zoom",
            "tool",
        )
    )
    for w in words:
        lines += [f"The answer is {w}.", f"I think it is {w}, so <answer>{w}</answer>"]
    return lines


def _qwen_bpe() -> Tokenizer:
    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def build_tokenizer(
    corpus: list[str] | None = None, *, vocab_size: int = 768, model_max_length: int = 2048
) -> PreTrainedTokenizerFast:
    """A deterministic byte-level BPE tokenizer in the real `Qwen2Tokenizer` class.

    Trained with the `tokenizers` BpeTrainer on `builtin_corpus()` (+ `corpus`, when given)
    from an initial alphabet of all 256 bytes, so any text round-trips. `vocab_size` is the
    size of the BPE vocabulary before the special and added tokens are appended (fewer when
    the corpus has nothing left to merge). Special tokens follow the BPE vocabulary in
    Qwen order; eos "<|im_end|>", pad "<|endoftext|>", padding on the left.
    """
    texts = builtin_corpus() + list(corpus or [])
    bpe = _qwen_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    # Special and added tokens go into the vocabulary with fixed ids, in Qwen order, so that
    # the ids do not depend on the order in which transformers registers them.
    for token in SPECIAL_TOKENS + ADDED_TOKENS:
        vocab[token] = len(vocab)

    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        padding_side="left",
        model_max_length=model_max_length,
    )
    tok.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        special_tokens=True,
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    tok.chat_template = CHAT_TEMPLATE
    for token in SPECIAL_TOKENS + ADDED_TOKENS:
        assert tok.convert_tokens_to_ids(token) == vocab[token], token
    assert len(tok) == len(vocab)
    return tok


def build_processor(
    family: str,
    tokenizer: PreTrainedTokenizerFast,
    *,
    min_pixels: int = 56 * 56,
    max_pixels: int = 112 * 112,
):
    """The family's real processor with its real image and video processors.

    Qwen2/2.5-VL: patch 14, CLIP mean/std; Qwen3-VL: patch 16, mean/std 0.5 (as in the
    released preprocessor configs). merge_size 2, temporal_patch_size 2 for all.
    """
    _check_family(family)
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    if family == "qwen3_vl":
        image_processor = Qwen2VLImageProcessor(
            size=size,
            patch_size=16,
            temporal_patch_size=2,
            merge_size=2,
            image_mean=[0.5, 0.5, 0.5],
            image_std=[0.5, 0.5, 0.5],
        )
        # Qwen3-VL's video "longest_edge" bounds the pixels of the whole clip.
        video_processor = Qwen3VLVideoProcessor(
            size={"shortest_edge": min_pixels, "longest_edge": max_pixels * 16},
            patch_size=16,
            temporal_patch_size=2,
            merge_size=2,
            image_mean=[0.5, 0.5, 0.5],
            image_std=[0.5, 0.5, 0.5],
        )
    else:
        image_processor = Qwen2VLImageProcessor(
            size=size, patch_size=14, temporal_patch_size=2, merge_size=2
        )
        video_processor = Qwen2VLVideoProcessor(
            size=size, patch_size=14, temporal_patch_size=2, merge_size=2
        )
    return PROCESSOR_CLASSES[family](
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def tiny_config(
    family: str,
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vision_depth: int = 2,
    vision_hidden: int = 64,
    vision_heads: int = 4,
    max_position_embeddings: int = 2048,
    attn_implementation: str = "sdpa",
) -> PretrainedConfig:
    """A tiny config of the family's real class, token ids taken from `tokenizer`.

    mrope sections are the released ones scaled to head_dim // 2 (Qwen2/2.5 16:24:24 ->
    2:3:3 of 8; Qwen3 interleaved 24:20:20 -> 4:2:2 of 8).
    """
    _check_family(family)
    head_dim = hidden_size // num_heads
    if head_dim * num_heads != hidden_size or head_dim % 2:
        raise ValueError(f"hidden_size {hidden_size} must be num_heads x an even head_dim")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    pad_id, eos_id = ids["<|endoftext|>"], ids["<|im_end|>"]
    half = head_dim // 2
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "pad_token_id": pad_id,
    }
    if family == "qwen3_vl":
        # interleaved THWTHW...: T must hold at least as many frequencies as H and W.
        hw = half // 4
        text.update(
            head_dim=head_dim,
            bos_token_id=pad_id,
            eos_token_id=eos_id,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": [half - 2 * hw, hw, hw],
                "mrope_interleaved": True,
            },
        )
        n_deep = min(vision_depth - 1, num_layers) if vision_depth > 1 else 0
        vision = {
            "depth": vision_depth,
            "hidden_size": vision_hidden,
            "intermediate_size": 2 * vision_hidden,
            "num_heads": vision_heads,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": hidden_size,
            "num_position_embeddings": 256,  # a 16 x 16 grid of learned positions
            "deepstack_visual_indexes": list(range(n_deep)),
        }
    else:
        hw = (3 * half) // 8
        text.update(
            bos_token_id=pad_id,
            eos_token_id=eos_id,
            use_sliding_window=False,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": [half - 2 * hw, hw, hw],
            },
        )
        if family == "qwen2_vl":
            vision = {
                "depth": vision_depth,
                "embed_dim": vision_hidden,
                "hidden_size": hidden_size,  # Qwen2-VL: the merger's output width
                "mlp_ratio": 2,
                "num_heads": vision_heads,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
            }
        else:
            vision = {
                "depth": vision_depth,
                "hidden_size": vision_hidden,
                "intermediate_size": 2 * vision_hidden,
                "num_heads": vision_heads,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "window_size": 112,
                "out_hidden_size": hidden_size,
                # last block full attention, the others windowed (as 7, 15, 23, 31 of 32)
                "fullatt_block_indexes": [vision_depth - 1],
            }
    config = _CONFIG_CLASSES[family](
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        dtype="float32",
    )
    config._attn_implementation = attn_implementation
    return config


def build_tiny_vlm(
    family: str,
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    min_pixels: int = 56 * 56,
    max_pixels: int = 112 * 112,
    corpus: list[str] | None = None,
    **config_kwargs,
) -> Path:
    """Build a randomly initialised tiny model of `family` and save model, processor,
    tokenizer, chat template and generation config into `out_dir` (safetensors).
    Same seed -> identical tensors. `corpus`: extra tokenizer training text (task wordings)."""
    _check_family(family)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(corpus)
    processor = build_processor(family, tokenizer, min_pixels=min_pixels, max_pixels=max_pixels)
    config = tiny_config(family, tokenizer, **config_kwargs)
    torch.manual_seed(seed)
    model = MODEL_CLASSES[family](config).to(torch.float32).eval()
    pad_id = tokenizer.pad_token_id
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id,
        eos_token_id=[tokenizer.eos_token_id, pad_id],
        pad_token_id=pad_id,
    )
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def load_tiny(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32):
    """(model, processor) from a directory written by `build_tiny_vlm` (or any local
    Qwen VL checkpoint), through the Auto classes' `from_pretrained`."""
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, use_safetensors=True)
    processor = AutoProcessor.from_pretrained(path)
    return model, processor


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
