"""Tiny, offline-built flow-matching text-to-image models of the real diffusers architectures.

`build_tiny(family, out_dir)` writes a complete diffusers pipeline directory (model_index.json,
every component saved with its own `save_pretrained`, safetensors) of randomly initialised,
1-2 layer, 16-64 wide instances of the family's real classes, which
`diffusion_rl.models.load_flow_model` (or diffusers' own `DiffusionPipeline.from_pretrained`)
reads back through `from_pretrained`. Nothing touches a model hub: the tokenizers are trained
here with the `tokenizers` library on the shapes-geneval vocabulary and wrapped in the real
tokenizer classes.

    family       pipeline                   text side                                     VAE
    flux         FluxPipeline               CLIPTextModel (pooled) + T5EncoderModel       AutoencoderKL
    sd3          StableDiffusion3Pipeline   2 x CLIPTextModelWithProjection + T5Encoder   AutoencoderKL
    qwen_image   QwenImagePipeline          Qwen2_5_VLForConditionalGeneration            AutoencoderKLQwenImage
    flux2        Flux2Pipeline              Mistral3ForConditionalGeneration (+ Pixtral   AutoencoderKLFlux2
                                            processor as its "tokenizer")

Tiny sizes (64 x 64 images by default): every VAE downsamples 4x (the real ones 8x) to a 16 x 16
latent with 4 channels (real: 16, or 32 for FLUX.2), so every latent model sees 8 x 8 = 64 image
tokens of 16 channels (2 x 2 latent patches); transformers are 32 wide (2 heads of 16), FLUX /
FLUX.2 one double- and one single-stream block, SD3 and Qwen-Image two blocks. Text encoders are
1-2 layers, 16-32 wide, except FLUX.2's Mistral3 which keeps 30 (16-wide) layers because the
pipeline reads hidden states 10, 20 and 30. CLIP and T5 tokenizers pad to 32 tokens.

`pixel_space=True` (FLUX family only) writes no VAE: model_index.json lists `vae` as
[null, null] and `pixel_space.json` = {"patch_size": p, "channels": 3} says that the transformer
works on the image itself, in [-1, 1], cut into p x p patches: (H/p)(W/p) tokens of 3 p^2
channels (64 x 64, p = 4: 256 tokens of 48). This is the layout of assets/tiny-flow-pixel (the
bundled assets/tiny-flow is latent: 64 tokens of 16 channels).

Where we depart from the real checkpoints (besides the sizes): vocabularies of a few hundred
tokens (CLIP and Mistral byte-level BPE, so any text still encodes; T5 a Unigram with <unk> for
characters outside its alphabet); the VAEs' scaling / shift factors are the real ones but the
latent statistics of the Qwen-Image and FLUX.2 VAEs are made-up fixed values.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE

__all__ = [
    "FAMILIES",
    "PIPELINE_CLASSES",
    "build_clip_tokenizer",
    "build_mistral_processor",
    "build_qwen_tokenizer",
    "build_t5_tokenizer",
    "build_tiny",
    "shapes_corpus",
]

FAMILIES = ("flux", "flux2", "sd3", "qwen_image")
PIPELINE_CLASSES = {
    "flux": "FluxPipeline",
    "flux2": "Flux2Pipeline",
    "sd3": "StableDiffusion3Pipeline",
    "qwen_image": "QwenImagePipeline",
}

_COUNTS = ("a", "an", "one", "two", "three", "four")
_COLOURS = ("red", "green", "blue", "yellow")
_SHAPES = ("circle", "square", "triangle")
_RELATIONS = ("left of", "right of", "above", "below", "to the left of", "to the right of")
TEXT_LEN = 32  # CLIP / T5 padding length of the tiny tokenizers (real: 77 / 256-512)


def shapes_corpus() -> list[str]:
    """Deterministic tokenizer training text: every shapes-geneval phrase, and phrases joined
    by every relation (a fixed subset of the pairs)."""
    phrases = [
        f"{n} {c} {s}{'s' if n not in ('a', 'an', 'one') else ''}"
        for n in _COUNTS
        for c in _COLOURS
        for s in _SHAPES
    ]
    lines = list(phrases)
    for i, p in enumerate(phrases):
        for j, r in enumerate(_RELATIONS):
            q = phrases[(7 * i + 11 * j + 3) % len(phrases)]
            lines.append(f"{p} {r} {q}")
    lines += [f"a photo of {p}." for p in phrases]
    lines += ["an image of", "a picture with", "circles squares triangles", "the and of on in"]
    return lines


# --------------------------------------------------------------------------- tokenizers


def build_clip_tokenizer(*, vocab_size: int = 400, model_max_length: int = TEXT_LEN):
    """A byte-level BPE in the real `CLIPTokenizer` class (lower-casing, "</w>" word ends),
    trained on `shapes_corpus()`. Every byte is in the vocabulary both mid-word and word-final,
    so any text encodes without <unk>. bos "<|startoftext|>", eos = pad = "<|endoftext|>",
    the last two ids (as in CLIP)."""
    from transformers import CLIPTokenizer

    bos, eos = "<|startoftext|>", "<|endoftext|>"
    tok = Tokenizer(BPE(unk_token=eos, end_of_word_suffix="</w>", continuing_subword_prefix=""))
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""),
                behavior="removed",
                invert=True,
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        end_of_word_suffix="</w>",
        special_tokens=[],
    )
    tok.train_from_iterator(shapes_corpus(), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = {}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):  # CLIP order: bytes, bytes</w>, merges
        vocab[ch] = len(vocab)
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch + "</w>"] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    vocab[bos] = len(vocab)
    vocab[eos] = len(vocab)
    return CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=eos,
        bos_token=bos,
        eos_token=eos,
        pad_token=eos,
        model_max_length=model_max_length,
    )


def build_t5_tokenizer(*, model_max_length: int = TEXT_LEN):
    """A SentencePiece-style Unigram (metaspace "▁" word starts) in the real `T5Tokenizer`
    class; ids 0, 1, 2 = <pad>, </s>, <unk> as in T5. Pieces: "▁word" for every word of
    `shapes_corpus()` (score = log frequency), then "▁" and single letters, digits and common
    punctuation (low scores), so other words spell out; any other character is <unk>.
    No <extra_id_*> sentinels."""
    from collections import Counter

    from transformers import T5Tokenizer

    counts = Counter(w for line in shapes_corpus() for w in re.findall(r"[a-z]+", line.lower()))
    total = sum(counts.values())
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [
        ("▁" + w, math.log(n / total))
        for w, n in sorted(counts.items(), key=lambda x: (-x[1], x[0]))
    ]
    floor = math.log(1 / total) - 2.0
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?'\"-()"
    pieces += [("▁", floor)] + [(c, floor - 1.0) for c in alphabet]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


# Mistral (tekken) control tokens, in the order of the real vocabulary ([IMG] = 10, pad = 11).
_MISTRAL_SPECIAL = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
    "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
)  # fmt: skip
# Mistral-Small-3 style: [SYSTEM_PROMPT]..[/SYSTEM_PROMPT][INST]..[/INST]; content is a string
# or a list of {"type": "text" | "image", ...} parts (what diffusers' Flux2Pipeline sends).
MISTRAL_CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] in ['image', 'image_url'] -%}[IMG]"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}[SYSTEM_PROMPT]{{ render(message['content']) }}[/SYSTEM_PROMPT]"
    "{%- elif message['role'] == 'user' -%}[INST]{{ render(message['content']) }}[/INST]"
    "{%- elif message['role'] == 'assistant' -%}{{ render(message['content']) }}{{ eos_token }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def build_mistral_processor(*, vocab_size: int = 512, model_max_length: int = 96):
    """FLUX.2's "tokenizer" component: the real `PixtralProcessor` around a byte-level BPE
    (`PreTrainedTokenizerFast`) with Mistral's control tokens and a Mistral-style chat template,
    trained on `shapes_corpus()` + diffusers' FLUX.2 system message. `model_max_length` bounds
    the padded prompt (the pipeline pads to min(512, model_max_length) tokens here)."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(
                    r"""[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
                ),
                behavior="isolated",
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(_MISTRAL_SPECIAL),
    )
    tok.train_from_iterator(shapes_corpus() + [SYSTEM_MESSAGE] * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=model_max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [t for t in _MISTRAL_SPECIAL if t.startswith("[")]}
    )
    image_processor = PixtralImageProcessor(
        size={"longest_edge": 64}, patch_size={"height": 16, "width": 16}
    )
    return PixtralProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=16,
        spatial_merge_size=2,
        chat_template=MISTRAL_CHAT_TEMPLATE,
    )


def build_qwen_tokenizer(*, model_max_length: int = 128):
    """Qwen-Image's tokenizer: mmrl.vlm.tiny's byte-level BPE in the real `Qwen2Tokenizer`,
    trained also on `shapes_corpus()` and the pipeline's prompt template; right padding."""
    from diffusers import QwenImagePipeline

    from mmrl.vlm.tiny import build_tokenizer

    bare = QwenImagePipeline(
        scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None
    )
    template = bare.prompt_template_encode
    tok = build_tokenizer(
        shapes_corpus() + [template.format("")] * 4, model_max_length=model_max_length
    )
    tok.padding_side = "right"
    return tok


# --------------------------------------------------------------------------- components


def _tiny_autoencoder_kl(*, scaling_factor: float, shift_factor: float, sample_size: int):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 8, 8),  # 3 blocks: 4x downsampling (real: 4 blocks, 8x)
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=sample_size,
        scaling_factor=scaling_factor,  # the real FLUX.1 / SD3 values
        shift_factor=shift_factor,
        use_quant_conv=False,  # as in the FLUX.1 and SD3 VAEs
        use_post_quant_conv=False,
    )


def _clip_text_config(tokenizer, hidden: int):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        projection_dim=hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,  # != 2: pooled output at the first eos
        pad_token_id=tokenizer.pad_token_id,
    )


def _t5_encoder(tokenizer, d_model: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=d_model // 2,
        d_ff=2 * d_model,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",  # T5 v1.1, as FLUX / SD3 use
        dropout_rate=0.0,
        is_encoder_decoder=False,
        use_cache=False,
    )
    return T5EncoderModel(config)


def _scheduler(family: str):
    from diffusers import FlowMatchEulerDiscreteScheduler

    if family == "sd3":
        return FlowMatchEulerDiscreteScheduler(shift=3.0)
    if family == "qwen_image":  # the released Qwen-Image scheduler config
        return FlowMatchEulerDiscreteScheduler(
            shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
            base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
        )  # fmt: skip
    return FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )  # fmt: skip


def _flux_components(*, seed: int, size: int, pixel_space: bool, patch_size: int,
                     transformer: dict | None = None, text_width: int = 32) -> dict:
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextModel

    tokenizer, tokenizer_2 = build_clip_tokenizer(), build_t5_tokenizer()
    torch.manual_seed(16 * seed + 1)
    text_encoder = CLIPTextModel(_clip_text_config(tokenizer, text_width))
    torch.manual_seed(16 * seed + 2)
    text_encoder_2 = _t5_encoder(tokenizer_2, text_width)
    torch.manual_seed(16 * seed + 3)
    vae = None
    if not pixel_space:
        vae = _tiny_autoencoder_kl(scaling_factor=0.3611, shift_factor=0.1159, sample_size=size)
    torch.manual_seed(16 * seed + 4)
    config = {
        "patch_size": 1,
        "in_channels": 3 * patch_size**2 if pixel_space else 4 * 4,  # packed 2 x 2 latent patches
        "num_layers": 1,
        "num_single_layers": 1,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": text_encoder_2.config.d_model,
        "pooled_projection_dim": text_encoder.config.hidden_size,
        "guidance_embeds": True,  # FLUX.1-dev (guidance-distilled)
        "axes_dims_rope": (4, 6, 6),
    }
    transformer = FluxTransformer2DModel(**{**config, **(transformer or {})})
    return {
        "scheduler": _scheduler("flux"),
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "text_encoder_2": text_encoder_2,
        "tokenizer_2": tokenizer_2,
        "transformer": transformer,
    }


def _sd3_components(*, seed: int, size: int) -> dict:
    from diffusers import SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection

    tokenizer, tokenizer_3 = build_clip_tokenizer(), build_t5_tokenizer()
    tokenizer_2 = build_clip_tokenizer()
    torch.manual_seed(16 * seed + 1)
    text_encoder = CLIPTextModelWithProjection(_clip_text_config(tokenizer, 16))
    torch.manual_seed(16 * seed + 2)
    text_encoder_2 = CLIPTextModelWithProjection(_clip_text_config(tokenizer_2, 32))
    torch.manual_seed(16 * seed + 3)
    text_encoder_3 = _t5_encoder(tokenizer_3, 64)  # wider than CLIP 16 + 32: CLIP is zero-padded
    torch.manual_seed(16 * seed + 4)
    vae = _tiny_autoencoder_kl(scaling_factor=1.5305, shift_factor=0.0609, sample_size=size)
    torch.manual_seed(16 * seed + 5)
    transformer = SD3Transformer2DModel(
        sample_size=size // 4,  # latent units, as in the real config (128 for 1024 px)
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=64,
        caption_projection_dim=32,
        pooled_projection_dim=16 + 32,
        pos_embed_max_size=max(16, size // 8),
        qk_norm="rms_norm",  # SD3.5
    )
    return {
        "transformer": transformer,
        "scheduler": _scheduler("sd3"),
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "text_encoder_2": text_encoder_2,
        "tokenizer_2": tokenizer_2,
        "text_encoder_3": text_encoder_3,
        "tokenizer_3": tokenizer_3,
    }


def _qwen_image_components(*, seed: int) -> dict:
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    from mmrl.vlm.tiny import tiny_config

    tokenizer = build_qwen_tokenizer()
    config = tiny_config(
        "qwen2_5_vl", tokenizer, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
        vision_depth=1, vision_hidden=32, vision_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(16 * seed + 1)
    text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    torch.manual_seed(16 * seed + 2)
    vae = AutoencoderKLQwenImage(
        base_dim=16,
        z_dim=4,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],  # 2 ** len(...) = 4x (real: 8x)
        latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075],  # first 4 of the real 16
        latents_std=[2.8184, 1.4541, 2.3275, 2.6558],
    )
    torch.manual_seed(16 * seed + 3)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * 4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=config.text_config.hidden_size,
        axes_dims_rope=(4, 6, 6),
    )
    return {
        "scheduler": _scheduler("qwen_image"),
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": transformer,
    }


def _flux2_components(*, seed: int, size: int) -> dict:
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralVisionConfig,
    )

    processor = build_mistral_processor()
    tok = processor.tokenizer
    text = MistralConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=30,  # the pipeline stacks hidden states 10, 20 and 30
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=1024,
        sliding_window=None,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    vision = PixtralVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        image_size=64, patch_size=16,
    )  # fmt: skip
    config = Mistral3Config(
        text_config=text,
        vision_config=vision,
        image_token_index=tok.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(16 * seed + 1)
    text_encoder = Mistral3ForConditionalGeneration(config)
    torch.manual_seed(16 * seed + 2)
    vae = AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 8, 8),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=size,
    )
    # made-up but fixed latent statistics, so that decode's de-normalisation is exercised
    g = torch.Generator().manual_seed(seed)
    vae.bn.running_mean.copy_(0.1 * torch.randn(vae.bn.num_features, generator=g))
    vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.num_features, generator=g))
    torch.manual_seed(16 * seed + 3)
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * 4,  # patchified 2 x 2 latent patches
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=3 * text.hidden_size,  # three stacked hidden states
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=True,  # FLUX.2-dev (guidance-distilled)
    )
    return {
        "scheduler": _scheduler("flux2"),
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": processor,
        "transformer": transformer,
    }


def build_tiny(
    family: str,
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    height: int = 64,
    width: int = 64,
    pixel_space: bool = False,
    patch_size: int = 4,
    transformer: dict | None = None,
    text_width: int = 32,
    prediction: str = "velocity",
) -> Path:
    """Write a tiny random `family` pipeline directory to `out_dir` and return its path.

    Every component is saved by the family's real diffusers pipeline class
    (`Pipeline(**components).save_pretrained`), so the directory is an ordinary diffusers
    pipeline. Same `seed` -> identical tensors (the caller's torch RNG is left untouched).
    `height` / `width` (square) set the VAEs' (and SD3's) `sample_size`, which
    `load_flow_model` takes as the default image size (Qwen-Image's VAE has no sample_size:
    its default is 64, pass height / width to load it at another size). `pixel_space=True` (FLUX only): no VAE, the transformer
    works on p x p patches of the image (`patch_size` = p), see the module docstring.
    FLUX only: `transformer` overrides FluxTransformer2DModel config keys (layers, heads, rope
    axes) and `text_width` sets both text encoders' width, for models bigger than the tests'.
    `prediction` (pixel space): "velocity" or "sample" (x0-prediction, see models.py).
    """
    import diffusers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    if pixel_space and family != "flux":
        raise ValueError(f"pixel_space is supported for the 'flux' family only, not {family!r}")
    if height != width:
        raise ValueError(f"tiny models are square; got height={height}, width={width}")
    unit = patch_size if pixel_space else 8  # 4x VAE x 2x2 packing
    if height % unit:
        raise ValueError(f"height/width {height} must be a multiple of {unit}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        if family == "flux":
            components = _flux_components(
                seed=seed, size=height, pixel_space=pixel_space, patch_size=patch_size,
                transformer=transformer, text_width=text_width,
            )
        elif family == "sd3":
            components = _sd3_components(seed=seed, size=height)
        elif family == "qwen_image":
            components = _qwen_image_components(seed=seed)
        else:
            components = _flux2_components(seed=seed, size=height)
    pipeline = getattr(diffusers, PIPELINE_CLASSES[family])(**components)
    pipeline.save_pretrained(out, safe_serialization=True)
    if pixel_space:
        spec = {"patch_size": patch_size, "channels": 3, "sample_size": height, "prediction": prediction}
        (out / "pixel_space.json").write_text(json.dumps(spec, indent=2) + "\n")
    return out
