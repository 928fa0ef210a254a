"""Loading vision-language models and their processors from a local directory.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL are supported and tested (tiny instances of
each are built from configs in tests). Any other `AutoModelForImageTextToText`
checkpoint is tried best-effort, with a warning. Nothing is ever downloaded:
`model.path` must be a directory on disk.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from mmrl.core.checkpoint import refuse_pickled_weights
from mmrl.core.config import ConfigError, check_remote_code
from mmrl.core.lora import add_lora
from mmrl.core.runconfig import REPOSITORY, bundled, model_dir_note, not_installed_note, resolve_dir

SUPPORTED = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
}
BUNDLED = "tiny-qwen2.5-vl"


def repo_root() -> Path:
    return REPOSITORY


def bundled_model_dir() -> Path:
    return bundled(BUNDLED)


def resolve_model_path(path: str | None, base_dir: str | None = None) -> Path:
    """The bundled tiny model for None; else as runconfig.resolve_dir: a relative path from
    the config file's directory, the working directory, then the repository."""
    return resolve_dir(path, base_dir) if path else bundled_model_dir()


def load_vlm(mcfg, seed: int = 0, base_dir: str | None = None):
    """(model, processor) from mcfg.path (a relative one from base_dir, the config file's
    directory, first), or the bundled tiny Qwen2.5-VL when path is None; `seed` draws LoRA's
    initial adapters (model.lora)."""
    path = resolve_model_path(mcfg.path, base_dir)
    if not path.is_dir():
        hint = not_installed_note(mcfg.path or path) or model_dir_note(path) or (
            " (rebuild it with `python scripts/pretrain_tiny_vlm.py`)" if mcfg.path is None else "")
        raise ConfigError(f"model.path: {str(path)!r} is not a directory{hint}")
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path: {str(path)!r} has no config.json; is it a from_pretrained directory?"
                          f"{model_dir_note(path)}")
    import transformers  # after the checks: a wrong path is told before seconds of imports
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    check_remote_code(path, mcfg.trust_remote_code)  # refuse, or name the directory whose code runs
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=mcfg.trust_remote_code)
    except Exception as e:  # ValueError, or huggingface_hub's StrictDataclassError (an invalid config.json)
        raise ConfigError(f"model.path: {path}/config.json could not be read as a model config: {e}") from e
    family = getattr(config, "model_type", "?")
    if family in SUPPORTED:
        cls = getattr(transformers, SUPPORTED[family])
    else:
        _check_best_effort(config, path)  # before the weights: a model the policy cannot feed fails now
        warnings.warn(
            f"model family {family!r} is not one mmrl tests (supported: {', '.join(SUPPORTED)}); "
            "trying AutoModelForImageTextToText",
            stacklevel=2,
        )
        cls = AutoModelForImageTextToText
    refuse_pickled_weights(path, "model.path")
    # The processor first: its files missing is told in a second, not after the weights have
    # loaded, and as the processor's fault (it read "could not load the model").
    try:
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=mcfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path: could not load the processor in {path} (the image processor's "
                          f"processor_config.json or preprocessor_config.json, and the tokenizer files): {e}") from e
    # what the policy needs of the processor, checked before the weights load
    _check_processor(processor, path)
    _check_patches(processor, config, path)
    _check_vision_tokens(processor.tokenizer, config, path)
    _fill_pad_token(processor.tokenizer, path)
    _check_vocab(processor.tokenizer, config, path)
    try:
        model, info = cls.from_pretrained(
            path, dtype=getattr(torch, mcfg.dtype), attn_implementation=mcfg.attn_implementation,
            trust_remote_code=mcfg.trust_remote_code, output_loading_info=True,
            use_safetensors=True,  # never unpickle: a .bin-only directory is refused
        )
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path: could not load the model in {path}: {e}") from e
    except RuntimeError as e:  # transformers' shape check: config.json does not fit the weights
        if "mismatch" not in str(e):
            raise
        raise ConfigError(f"model.path: the weights in {path} do not fit its config.json (tensor shapes "
                          f"differ; the load report above lists them): {e}") from e
    if info.get("missing_keys"):  # config.json asks for weights the checkpoint lacks: they would be random
        raise ConfigError(f"model.path: the weights in {path} do not fit its config.json: "
                          f"{missing_weights(info['missing_keys'])}")
    if mcfg.lora is not None:
        model = add_lora(model, mcfg.lora, seed=seed)
    if mcfg.freeze_vision:
        vision_tower(model).requires_grad_(False)
        if mcfg.lora is not None and not any(p.requires_grad for p in model.parameters()):
            # else the trainer's "no trainable parameters", which names neither setting
            raise ConfigError(f"model.lora.target_modules {list(mcfg.lora.target_modules)} name layers of the vision "
                              "encoder alone, which model.freeze_vision keeps fixed: nothing would train; name "
                              "language-model layers too (q_proj, ...), or unset freeze_vision")
    return model, processor


def _check_best_effort(config, path) -> None:
    """A ConfigError for a family outside SUPPORTED that cannot work: a text-only model
    (AutoModelForImageTextToText has no class for it), or one whose forward does not take the
    Qwen-VL image inputs the policy feeds it (image_grid_thw: LLaVA, Idefics, ...). Either
    loaded, then failed at the first generate with a traceback. Remote-code classes are let
    through: their forward is not known before their code runs."""
    import inspect

    from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    family = getattr(config, "model_type", "?")
    supported = ", ".join(SUPPORTED)
    if "AutoModelForImageTextToText" in (getattr(config, "auto_map", None) or {}):
        return
    if type(config) not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        raise ConfigError(f"model.path: {path} holds a {family!r} model, not a vision-language one "
                          f"(transformers' AutoModelForImageTextToText has no class for it); mmrl's VLM "
                          f"backend trains vision-language checkpoints (supported families: {supported})")
    cls = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]
    if "image_grid_thw" not in inspect.signature(cls.forward).parameters:
        raise ConfigError(f"model.path: {path} holds a {family!r} model ({cls.__name__}), which does not take "
                          "the Qwen-VL image inputs (image_grid_thw) that mmrl's VLM policy feeds it; "
                          f"supported families: {supported}")


def _check_processor(processor, path) -> None:
    """What encoding needs of the directory's tokenizer, checked at load: without its files
    AutoProcessor builds a tokenizer of one token, and without a chat template no prompt can be
    written; either failed at the first encode with a traceback."""
    tok = getattr(processor, "tokenizer", None)
    if tok is None:
        raise ConfigError(f"model.path: {path} gives no tokenizer with its processor")
    if tok.convert_tokens_to_ids("<|image_pad|>") in (None, tok.unk_token_id) or len(tok) < 100:
        raise ConfigError(f"model.path: the tokenizer in {path} ({len(tok)} tokens) lacks the image placeholder "
                          "<|image_pad|>: are its tokenizer files (tokenizer.json, tokenizer_config.json) there?")
    if not (getattr(processor, "chat_template", None) or getattr(tok, "chat_template", None)):
        raise ConfigError(f"model.path: {path} has no chat template, which writes the prompts: transformers reads "
                          "chat_template.jinja or chat_template.json beside config.json, or chat_template in "
                          "tokenizer_config.json. Copy the file of the checkpoint this model comes from")


def _check_patches(processor, config, path) -> None:
    """The image processor must cut the patches the vision encoder was built for: a processor
    copied from another family (Qwen2.5-VL's 14-pixel patches for Qwen3-VL's 16) loaded, then
    failed in the first forward with a tensor-size RuntimeError."""
    images = getattr(processor, "image_processor", None)
    vision = getattr(config, "vision_config", None)
    if images is None or vision is None:
        return
    for ours, theirs in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                         ("temporal_patch_size", "temporal_patch_size")):
        cut, built = getattr(images, ours, None), getattr(vision, theirs, None)
        if isinstance(cut, int) and isinstance(built, int) and cut != built:
            raise ConfigError(
                f"model.path: the image processor in {path} (processor_config.json or preprocessor_config.json) "
                f"has {ours} {cut}, but the model's vision encoder takes {built} (config.json "
                f"vision_config.{theirs}): the processor files are another model's. Save this model's own "
                "processor beside it (AutoProcessor.from_pretrained(<its source>).save_pretrained(<dir>))")


def _check_vision_tokens(tok, config, path) -> None:
    """config.json's image_token_id and vision_start_token_id must be the tokenizer's ids of
    <|image_pad|> and <|vision_start|>: the model finds the image slots (and their positions) by
    those ids. A tokenizer of another checkpoint, or a config left at the released ids, loaded,
    then failed in the first forward ('Image features and image tokens do not match, tokens: 0')."""
    for key, token in (("image_token_id", "<|image_pad|>"), ("vision_start_token_id", "<|vision_start|>")):
        want, got = getattr(config, key, None), tok.convert_tokens_to_ids(token)
        if isinstance(want, int) and isinstance(got, int) and want != got:
            raise ConfigError(f"model.path: config.json in {path} has {key} {want}, but its tokenizer's {token} "
                              f"is id {got}: the model finds image slots by that id. Are the tokenizer files "
                              f"another model's? Else set {key} to {got} in config.json")


def _check_vocab(tok, config, path) -> None:
    """The tokens every prompt holds (the chat template's, the image slots', the padding) must
    have rows in the model's embedding: a tokenizer of a larger model, or tokens added without
    resizing the embeddings, loaded, then failed in the first forward with IndexError (a device
    assert on a GPU)."""
    text = getattr(config, "text_config", None) or config
    vocab = getattr(text, "vocab_size", None)
    if not isinstance(vocab, int):
        return
    for token in ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", tok.pad_token):
        i = tok.convert_tokens_to_ids(token)
        if isinstance(i, int) and i >= vocab:
            raise ConfigError(f"model.path: the tokenizer in {path} gives {token} id {i}, past the model's vocabulary "
                              f"of {vocab} ids (config.json vocab_size): the tokenizer files are another model's, or "
                              "tokens were added to them without resizing the model's embeddings "
                              "(model.resize_token_embeddings(len(tokenizer)))")


def _fill_pad_token(tok, path) -> None:
    """A tokenizer without a pad token pads with the end-of-turn token, as VLMPolicy's generate
    already did (its pad_id); batched prompts are left-padded and the attention mask hides the
    padding, so which token fills it does not matter. Unset, the processor refused to pad the
    first batch of prompts with a traceback."""
    if tok.pad_token is not None:
        return
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    fill = "<|im_end|>" if isinstance(im_end, int) and im_end != tok.unk_token_id else tok.eos_token
    if fill is None:
        raise ConfigError(f"model.path: the tokenizer in {path} has neither a pad token nor an end token "
                          "(pad_token, eos_token in tokenizer_config.json), which batched prompts are padded with")
    tok.pad_token = fill
    warnings.warn(f"model.path: the tokenizer in {path} has no pad token (pad_token in tokenizer_config.json): "
                  f"prompts are left-padded with {fill!r}, which the attention mask hides", stacklevel=3)


def vision_tower(model) -> torch.nn.Module:
    """The model's vision encoder: the module named `visual` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL;
    under PEFT's wrapper too), else ConfigError."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "visual":
            return module
    raise ConfigError(f"model.freeze_vision: {type(model).__name__} has no module named `visual` "
                      "(the Qwen-VL families' vision encoder); unset freeze_vision for this model")


def missing_weights(keys) -> str:
    """The message for weights config.json needs but the checkpoint lacks (a few named)."""
    keys = sorted(keys)
    more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
    return (f"{len(keys)} weight(s) it needs are missing from the checkpoint ({', '.join(keys[:5])}{more}); "
            "transformers would initialise them at random")
