"""Tiny, offline-built masked-diffusion LMs of real transformers architectures.

`build_tiny_dllm(out_dir, kind=...)` writes a from_pretrained directory (config.json,
model.safetensors, the tokenizer files and `dllm.json`) of a randomly initialised small
instance of the architecture each dLLM family is built on, which
`dllm_rl.models.load_mask_predictor` reads back through the real `from_pretrained`.
Nothing touches a model hub.

    kind        class              like                                   run as
    llada       LlamaForCausalLM   LLaDA (RoPE, RMSNorm, SwiGLU, no bias)  full attention
    dream       Qwen2ForCausalLM   Dream (Qwen2.5 base)                    full attention, shifted logits
    sdar        Qwen3ForCausalLM   SDAR (Qwen3 base, q/k norm)             block-causal attention
    masked_lm   BertForMaskedLM    any AutoModelForMaskedLM                full attention

Where we depart from the real checkpoints (besides the sizes): a character-level vocabulary of
53 tokens (`build_tokenizer`), input and output embeddings untied, and no dropout (BERT's
dropout probabilities are 0, so training-mode logits equal eval-mode logits as for the
decoders). Same seed -> byte-identical safetensors.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel

from dllm_rl.models import KINDS, DllmSpec

__all__ = ["CHARSET", "SPECIAL_TOKENS", "build_tiny_dllm", "build_tokenizer", "tiny_config"]

SPECIAL_TOKENS = ("<pad>", "<mask>", "<eos>")  # ids 0, 1, 2
CHARSET = "0123456789" + "+-*/=()., :|?" + "\n" + "abcdefghijklmnopqrstuvwxyz"


def build_tokenizer(*, model_max_length: int = 96):
    """A character-level `PreTrainedTokenizerFast`: ids 0, 1, 2 = <pad>, <mask>, <eos>, then
    one token per character of CHARSET (digits, `+-*/=()., :|?`, newline, a-z) in that order.

    No normalisation and no special tokens added on encode; the decoder concatenates the
    tokens, so `decode(encode(s)) == s` for any string over CHARSET. A character outside
    CHARSET cannot be encoded (the tokenizer raises; there is no <unk>). Padding on the left
    (prompts are left-padded; `MaskPredictor.forward` takes the padding as `valid`).
    """
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in CHARSET:
        vocab[ch] = len(vocab)
    tok = Tokenizer(WordLevel(vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        mask_token="<mask>",
        eos_token="<eos>",
        clean_up_tokenization_spaces=False,
        padding_side="left",
        model_max_length=model_max_length,
    )


def tiny_config(
    kind: str,
    tokenizer,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 256,
    max_position_embeddings: int = 96,
):
    """The transformers config of the tiny `kind` model, token ids taken from `tokenizer`."""
    from transformers import BertConfig, LlamaConfig, Qwen2Config, Qwen3Config

    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {KINDS}")
    if hidden_size % num_heads or (hidden_size // num_heads) % 2:
        raise ValueError(f"hidden_size {hidden_size} must be num_heads x an even head_dim")
    ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.eos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": False,
        **ids,
    }
    if kind == "masked_lm":
        return BertConfig(
            **common,
            type_vocab_size=1,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    decoder = {
        **common,
        "num_key_value_heads": num_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_dropout": 0.0,
        "use_cache": False,
    }
    if kind == "llada":  # LLaDA-8B: rope_theta 500000, no biases
        return LlamaConfig(
            **decoder,
            attention_bias=False,
            mlp_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
        )
    if kind == "dream":  # Dream-7B is Qwen2.5-7B: q/k/v biases, rope_theta 1e6
        return Qwen2Config(
            **decoder,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
    return Qwen3Config(  # sdar: SDAR is Qwen3-based (q/k RMSNorm)
        **decoder,
        head_dim=hidden_size // num_heads,
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )


def build_tiny_dllm(
    out_dir: str | os.PathLike,
    *,
    kind: str = "llada",
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 256,
    max_position_embeddings: int = 96,
    block_length: int | None = None,
) -> Path:
    """Build a randomly initialised tiny `kind` model (seeded) and save model (safetensors),
    tokenizer and `dllm.json` into `out_dir`; returns the directory.
    `block_length` applies to "sdar" (default 4); the other kinds use full attention."""
    from transformers import BertForMaskedLM, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {KINDS}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(model_max_length=max_position_embeddings)
    config = tiny_config(
        kind, tokenizer, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
    )  # fmt: skip
    cls = {
        "llada": LlamaForCausalLM,
        "dream": Qwen2ForCausalLM,
        "sdar": Qwen3ForCausalLM,
        "masked_lm": BertForMaskedLM,
    }[kind]
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    spec = DllmSpec(
        kind=kind,
        mask_token_id=tokenizer.mask_token_id,
        attention="block_causal" if kind == "sdar" else "full",
        block_length=(block_length or 4) if kind == "sdar" else None,
        shift_logits=kind == "dream",
    )
    spec.write(out)
    return out
