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
