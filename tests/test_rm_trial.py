"""Learned reward models (mmrl.core.reward_models) as a researcher uses them: other
architectures and tokenizers, broken weights, sharing with rule atoms."""

from __future__ import annotations

import pytest
import torch
from test_reward_models import ROOT, SAMPLES, build_rm
from transformers import AutoTokenizer, GPT2Config, GPT2ForSequenceClassification

from mmrl.core.reward_models import RewardModel
from mmrl.core.rewards import load_atoms


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


def test_weights_with_nan_are_named_when_the_model_loads(tmp_path):
    """They scored every sample nan, found as a failed atom only after the first rollout."""
    from safetensors.torch import load_file, save_file

    path = build_rm(tmp_path / "rm")
    weights = load_file(path / "model.safetensors")
    weights["score.weight"][0, 3] = float("nan")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"reward spec 0 \(rm\): .*weights hold NaN or inf values \(score.weight\)"):
        load_atoms([{"reward_model": "rm"}], base_dir=tmp_path)


def test_the_same_reward_model_in_two_atoms_is_loaded_once(tmp_path, monkeypatch):
    """Two atoms on one directory (two templates here) held two copies of the weights."""
    import mmrl.core.reward_models as rm

    build_rm(tmp_path / "rm")
    loads = []
    real = rm.load_sequence_classifier
    monkeypatch.setattr(rm, "load_sequence_classifier", lambda *a, **k: loads.append(a[0]) or real(*a, **k))
    a, b = load_atoms([{"reward_model": "rm", "name": "a"},
                       {"reward_model": "rm", "name": "b", "template": "Q: {prompt} A: {completion}"}],
                      base_dir=tmp_path)
    assert a.fn.model is b.fn.model and len(loads) == 1
    assert a.fn(SAMPLES[:1]) != b.fn(SAMPLES[:1])  # each reads through its own template
    assert load_atoms([{"reward_model": "rm", "dtype": "bfloat16"}], base_dir=tmp_path)[0].fn.model is not a.fn.model
    build_rm(tmp_path / "rm", seed=1)  # saved over: loads afresh
    assert load_atoms([{"reward_model": "rm"}], base_dir=tmp_path)[0].fn.model is not a.fn.model
    assert len(loads) == 3


def test_an_open_clip_tag_as_pretrained_is_named_as_a_download(tmp_path):
    """`pretrained: laion2b_s34b_b79k` (open_clip's README) was "file or directory not found:
    <config dir>/laion2b_s34b_b79k"."""
    from diffusion_rl.rewards import build_image_reward_atoms

    spec = {"type": "clip_score", "model": "ViT-B-32", "pretrained": "laion2b_s34b_b79k"}
    with pytest.raises(ValueError, match=r"spec 0 \(clip_score\): key 'pretrained': 'laion2b_s34b_b79k' is an "
                                         r"open_clip tag, which downloads, and nothing downloads here"):
        build_image_reward_atoms([spec], base_dir=tmp_path)
    (tmp_path / "laion2b_s34b_b79k").write_bytes(b"")  # a local file of that name is that file (read lazily)
    assert build_image_reward_atoms([spec], base_dir=tmp_path)[0].fn.source.weights == str(tmp_path / "laion2b_s34b_b79k")


def test_a_checkpoint_without_the_score_head_is_refused(tmp_path):
    """A causal LM whose config was edited to name a classifier loaded with a random score head:
    scores that changed from one load to the next, behind a load report easily missed."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(ROOT / "assets/tiny-qwen2.5-vl")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    config.update(architectures=["LlamaForSequenceClassification"], id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    (tmp_path / "base" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"reward spec 0 \(base\): reward model '.*base': its checkpoint lacks "
                                         r"score.weight \(missing weights start random"):
        load_atoms([{"reward_model": "base"}], base_dir=tmp_path)


def test_a_spec_without_a_dtype_takes_the_default_given_and_its_own_wins(tmp_path):
    """load_atoms(dtype=model.dtype): the trainer can load a reward model as the policy is."""
    build_rm(tmp_path / "rm")
    atom, = load_atoms([{"reward_model": "rm"}], base_dir=tmp_path, dtype="bfloat16")
    assert atom.fn.model.dtype == torch.bfloat16
    atom, = load_atoms([{"reward_model": "rm", "dtype": "float32"}], base_dir=tmp_path, dtype="bfloat16")
    assert atom.fn.model.dtype == torch.float32
    atom, = load_atoms([{"reward_model": "rm"}], base_dir=tmp_path)
    assert atom.fn.model.dtype == torch.float32  # float32 where nothing is said
