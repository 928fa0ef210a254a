"""Learned reward models (mmrl.core.reward_models) as a researcher uses them: other
architectures and tokenizers, broken weights, sharing with rule atoms."""

from __future__ import annotations

import pytest
import torch
from test_reward_models import ROOT, SAMPLES
from transformers import AutoTokenizer, GPT2Config, GPT2ForSequenceClassification

from mmrl.core.reward_models import RewardModel


def build_gpt2_rm(out):
    """A random 2-layer GPT-2 reward model (absolute position embeddings) with the bundled VLM's
    tokenizer, which pads on the left as a generator's does."""
    tok = AutoTokenizer.from_pretrained(ROOT / "assets/tiny-qwen2.5-vl")
    tok.chat_template = None
    assert tok.padding_side == "left"
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=128, num_labels=1,
                     pad_token_id=tok.pad_token_id)
    GPT2ForSequenceClassification(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_a_left_padding_tokenizer_scores_a_text_batched_as_alone(tmp_path):
    """Left padding moved the shorter text's positions: under GPT-2's absolute position
    embeddings it scored 0.140 batched and 0.159 alone."""
    path = build_gpt2_rm(tmp_path / "rm")
    batched = RewardModel(path, batch_size=3)(SAMPLES)
    alone = [RewardModel(path, batch_size=1)([s])[0] for s in SAMPLES]
    assert batched == pytest.approx(alone, abs=1e-5)
