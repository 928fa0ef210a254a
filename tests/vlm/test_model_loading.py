"""load_vlm on model directories a user brings (mmrl/vlm/models.py): families it cannot run
and tokenizers missing a token are named at load, not met as a traceback mid-training."""

from __future__ import annotations

import pytest
import transformers

from mmrl.core.config import ConfigError
from mmrl.vlm.config import VLMModelConfig
from mmrl.vlm.models import load_vlm

TEXT = {"vocab_size": 583, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.mark.parametrize("config, words", [
    # a text-only causal LM: AutoModelForImageTextToText has no class for it
    (lambda: transformers.Qwen2Config(**TEXT), ["'qwen2' model, not a vision-language one", "qwen2_5_vl"]),
    # a VLM whose forward takes no image_grid_thw: it loaded, then generate raised a ValueError
    (lambda: transformers.LlavaConfig(text_config=transformers.LlamaConfig(**TEXT)),
     ["'llava' model (LlavaForConditionalGeneration)", "image_grid_thw", "qwen2_5_vl"]),
], ids=["text-only-lm", "llava"])
def test_a_family_the_policy_cannot_feed_is_refused_before_its_weights(tmp_path, config, words):
    config().save_pretrained(tmp_path)  # config.json alone: the check comes before any weights are read
    with pytest.raises(ConfigError) as e:
        load_vlm(VLMModelConfig(path=str(tmp_path)))
    assert str(tmp_path) in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_a_tokenizer_without_a_pad_token_pads_with_the_end_token(tmp_path):
    import json
    import shutil

    from mmrl.vlm.models import bundled_model_dir
    from mmrl.vlm.policy import VLMPolicy
    from mmrl.vlm.tasks.shapes_qa import QAItem

    model = tmp_path / "model"
    shutil.copytree(bundled_model_dir(), model)
    tc = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**tc, "pad_token": None}))
    with pytest.warns(UserWarning, match="has no pad token .* left-padded with '<\\|im_end\\|>'"):
        vlm, processor = load_vlm(VLMModelConfig(path=str(model)))
    tok = processor.tokenizer
    assert tok.pad_token == "<|im_end|>"
    # two prompts of different lengths: padding them raised "Asking to pad but the tokenizer
    # does not have a padding token" at the first rollout
    policy = VLMPolicy(vlm, processor)
    items = [QAItem(images=[], question=q, answer="", reference="", meta={}) for q in ("red?", "what colour is it?")]
    enc = policy.encode(items)
    assert enc["input_ids"][0, 0].item() == tok.convert_tokens_to_ids("<|im_end|>")
    assert enc["attention_mask"][0, 0].item() == 0 and enc["attention_mask"][1].all()


def _hf_cache_entry(root):
    """models--me--tiny as huggingface_hub lays it out: the files are links into blobs/."""
    entry = root / "models--me--tiny"
    snapshot = entry / "snapshots" / "abc123"
    (entry / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("abc123")
    (entry / "blobs" / "f00d").write_text("{}")
    (snapshot / "config.json").symlink_to(entry / "blobs" / "f00d")
    return entry, snapshot


def test_a_file_or_a_hub_cache_entry_given_as_model_path_names_the_directory_meant(tmp_path):
    """A config.json given for its directory, and a cache entry given for its snapshot, were told
    only "is not a directory" / "has no config.json"."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"is not a directory \(it is a file: model.path takes the directory "
                                          rf"that holds config.json, .*this file's is {tmp_path}/mine\)"):
        load_vlm(VLMModelConfig(path=str(tmp_path / "mine" / "config.json")))
    entry, snapshot = _hf_cache_entry(tmp_path)
    with pytest.raises(ConfigError, match=r"has no config.json; is it a from_pretrained directory\? \(a Hugging "
                                          rf"Face cache entry: its model directory is the snapshot {snapshot}\)"):
        load_vlm(VLMModelConfig(path=str(entry)))
    (entry / "refs" / "main").unlink()  # no ref: any snapshot is named
    with pytest.raises(ConfigError, match=rf"one of its snapshots, e.g. {snapshot}\)"):
        load_vlm(VLMModelConfig(path=str(entry)))


@pytest.mark.parametrize("key, value, words", [
    ("patch_size", 16, "has patch_size 16, but the model's vision encoder takes 14 (config.json vision_config.patch_size)"),
    ("merge_size", 4, ("has merge_size 4, but the model's vision encoder takes 2 (config.json "
                       "vision_config.spatial_merge_size)")),
])
def test_an_image_processor_of_another_model_is_refused_at_load(tmp_path, key, value, words):
    """A Qwen2.5-VL processor (14-pixel patches) copied beside a Qwen3-VL (16) loaded, then failed
    in the first forward: 'The size of tensor a (98) must match the size of tensor b (128)'."""
    import json
    import shutil

    from mmrl.vlm.models import bundled_model_dir

    model = shutil.copytree(bundled_model_dir(), tmp_path / "model")
    config = json.loads((model / "processor_config.json").read_text())
    config["image_processor"][key] = value
    (model / "processor_config.json").write_text(json.dumps(config))
    (model / "model.safetensors").unlink()  # told before the weights are read
    with pytest.raises(ConfigError) as e:
        load_vlm(VLMModelConfig(path=str(model)))
    assert f"the image processor in {model}" in str(e.value) and words in str(e.value), str(e.value)


def test_an_image_token_id_other_than_the_tokenizers_is_refused_at_load(tmp_path):
    """config.json's image_token_id not the tokenizer's <|image_pad|>: the model found no image
    slot and the first forward raised 'Image features and image tokens do not match, tokens: 0'."""
    import json
    import shutil

    from mmrl.vlm.models import bundled_model_dir

    model = shutil.copytree(bundled_model_dir(), tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "image_token_id": 151655}))  # Qwen2.5-VL's released id
    (model / "model.safetensors").unlink()  # told before the weights are read
    with pytest.raises(ConfigError) as e:
        load_vlm(VLMModelConfig(path=str(model)))
    assert (f"config.json in {model} has image_token_id 151655, but its tokenizer's <|image_pad|> is id "
            f"{config['image_token_id']}") in str(e.value), str(e.value)


def test_a_model_without_a_chat_template_is_told_the_files_transformers_reads(tmp_path):
    """The message named chat_template.json alone, while transformers saves (and the bundled
    models ship) chat_template.jinja."""
    import shutil

    from mmrl.vlm.models import bundled_model_dir

    model = shutil.copytree(bundled_model_dir(), tmp_path / "model")
    (model / "chat_template.jinja").unlink()
    with pytest.raises(ConfigError) as e:
        load_vlm(VLMModelConfig(path=str(model)))
    assert f"{model} has no chat template" in str(e.value)
    assert all(name in str(e.value) for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"))


def test_a_model_without_its_image_processor_file_is_told_so_before_the_weights_load(tmp_path):
    """Without processor_config.json the error read "could not load the model in ...", though
    the model was there, and came after its weights had loaded."""
    import shutil

    from mmrl.vlm.models import bundled_model_dir

    model = shutil.copytree(bundled_model_dir(), tmp_path / "model")
    (model / "processor_config.json").unlink()
    (model / "model.safetensors").unlink()  # the processor is named first, before the weights are looked for
    with pytest.raises(ConfigError, match=rf"model.path: could not load the processor in {model} \(the image "
                                          r"processor's processor_config.json or preprocessor_config.json"):
        load_vlm(VLMModelConfig(path=str(model)))


def test_a_tokenizer_with_ids_past_the_models_vocabulary_is_refused_at_load(tmp_path):
    """A tokenizer of a larger model (or with added tokens, the embeddings not resized): the
    first forward raised IndexError ('index out of range in self'); with config.json's
    pad_token_id past the vocabulary too, from_pretrained raised an AssertionError."""
    import json
    import shutil

    from mmrl.vlm.models import bundled_model_dir

    model = shutil.copytree(bundled_model_dir(), tmp_path / "model")
    (model / "model.safetensors").unlink()  # told before the weights are read
    config = json.loads((model / "config.json").read_text())
    config["text_config"]["vocab_size"] = 560  # the bundled tokenizer's special tokens are ids 567..582
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"model.path: the tokenizer in {model} gives <\|im_start\|> id 568, past "
                                          r"the model's vocabulary of 560 ids \(config.json vocab_size\)"):
        load_vlm(VLMModelConfig(path=str(model)))
