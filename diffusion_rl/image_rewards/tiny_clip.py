"""Tiny random CLIP models of the real classes, written offline from a seed, for tests and smoke
runs: an open_clip CLIP (`build_tiny_open_clip`, for clip_score atoms) and a transformers
CLIPModel with its processor (`build_tiny_hf_clip`, for preference atoms of kind "clip").
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def build_tiny_open_clip(out_dir: str | os.PathLike, seed: int = 0) -> tuple[str, str]:
    """Write a tiny random open_clip CLIP (1-layer 32-wide ViT on 32x32 images with 8x8 patches,
    1-layer 32-wide text transformer with the bundled BPE vocabulary, 32-d embeddings) into
    out_dir in open_clip's hub layout: open_clip_config.json + open_clip_model.safetensors.
    Returns (config path, weights path); out_dir itself is also a "local-dir:" model.
    Deterministic for a seed; nothing is downloaded."""
    import open_clip
    from safetensors.torch import save_file

    model_cfg = {
        "embed_dim": 32,
        "vision_cfg": {
            "image_size": 32,
            "layers": 1,
            "width": 32,
            "patch_size": 8,
            "head_width": 16,
        },
        "text_cfg": {
            "context_length": 16,
            "vocab_size": 49408,
            "width": 32,
            "heads": 2,
            "layers": 1,
        },
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = open_clip.CLIP(**model_cfg)
    config_path = out / "open_clip_config.json"
    config_path.write_text(json.dumps({"model_cfg": model_cfg, "preprocess_cfg": {}}, indent=2))
    weights_path = out / "open_clip_model.safetensors"
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(weights_path))
    return str(config_path), str(weights_path)


_CLIP_PRETOKENIZE = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


def build_tiny_hf_clip(out_dir: str | os.PathLike, seed: int = 0) -> str:
    """Write a tiny random transformers CLIPModel with its CLIPProcessor into out_dir
    (save_pretrained layout, the PickScore format) and return out_dir.

    The tokenizer is the real CLIPTokenizer over a byte-level BPE trained offline with the
    `tokenizers` library on prompts of the shapes tasks (CLIP's lower-casing normaliser,
    pre-tokeniser and "</w>" word ends; every byte, with and without "</w>", is in the
    vocabulary, so any text encodes without unknown tokens). The image processor is
    CLIPImageProcessor at 32x32. The model: 1-layer, 32-wide towers, 16-d projections,
    16 text positions. Deterministic for a seed; nothing is downloaded."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import (
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        CLIPProcessor,
        CLIPTokenizer,
    )

    bpe = Tokenizer(BPE(continuing_subword_prefix="", end_of_word_suffix="</w>"))
    bpe.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_CLIP_PRETOKENIZE), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=alphabet,
        end_of_word_suffix="</w>",
        special_tokens=[],
    )
    bpe.train_from_iterator(_tiny_corpus(), trainer=trainer)
    trained = json.loads(bpe.to_str())["model"]
    vocab: dict[str, int] = dict(trained["vocab"])
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    for ch in alphabet:
        for token in (ch, ch + "</w>"):
            vocab.setdefault(token, len(vocab))
    for token in ("<|startoftext|>", "<|endoftext|>"):
        vocab[token] = len(vocab)
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=16)
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    )
    config = CLIPConfig(
        text_config={
            "vocab_size": len(vocab),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": 16,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 8,
        },
        projection_dim=16,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPModel(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out)
    return str(out)


def _tiny_corpus() -> list[str]:
    colours = ("red", "green", "blue", "yellow")
    shapes = ("circle", "square", "triangle")
    counts = ("a", "an", "one", "two", "three", "four")
    relations = ("left of", "right of", "above", "below")
    lines = [
        f"{n} {c} {s}{'s' if n not in ('a', 'an', 'one') else ''}"
        for n in counts
        for c in colours
        for s in shapes
    ]
    lines += [
        f"a {c1} {s1} {r} a {c2} {s2}"
        for c1 in colours
        for s1 in shapes
        for r in relations
        for c2 in colours[:2]
        for s2 in shapes[:2]
    ]
    lines += ["a photo of", "an image of", "on a white background"]
    return lines
