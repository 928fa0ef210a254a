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
