"""Mask-predictor loading (dllm_rl/models.py) on tiny real architectures (dllm_rl/tiny.py).

Every model is built into tmp_path and read back through the real `from_pretrained`.
"""

from __future__ import annotations

import hashlib
import json
import re
import textwrap
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dllm_rl.models import (
    SIDECAR,
    DllmSpec,
    MaskPredictor,
    _guess_kind,
    _model_class,
    build_attention_mask,
    load_mask_predictor,
    position_ids_from_valid,
    read_sidecar,
)
from dllm_rl.tiny import CHARSET, build_tiny_dllm, build_tokenizer

TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "intermediate_size": 64}
KINDS = ("llada", "dream", "sdar", "masked_lm")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_dllm")
    return {kind: build_tiny_dllm(root / kind, kind=kind, seed=0, **TINY) for kind in KINDS}


@pytest.fixture(scope="module")
def predictors(tiny_dirs):
    return {kind: load_mask_predictor(path) for kind, path in tiny_dirs.items()}


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 53, (batch, length), generator=g)  # characters, no specials


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_ids():
    tok = build_tokenizer()
    assert (tok.pad_token_id, tok.mask_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) == 3 + len(CHARSET) == 53
    for s in [CHARSET, "12 + 3 = ?\n  (a, b): x|y.", "  leading and trailing  ", "\n\n", ""]:
        ids = tok.encode(s)
        assert len(ids) == len(s)  # one token per character, nothing added
        assert tok.decode(ids) == s
    assert tok.convert_ids_to_tokens(tok.encode(" \n")) == [" ", "\n"]


def test_tokenizer_round_trip_after_save(tmp_path):
    build_tokenizer().save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path)
    s = "7 * (8 - 2) = 42\nanswer: 42"
    assert tok.decode(tok.encode(s)) == s
    assert tok.mask_token_id == 1


def test_tokenizer_pads_on_the_left():
    batch = build_tokenizer()(["7", "123"], padding=True)
    assert batch.input_ids == [[0, 0, 10], [4, 5, 6]]  # "1" -> 4 (CHARSET[i] is id i + 3), <pad> 0
    assert batch.attention_mask[0] == [0, 0, 1]


# --------------------------------------------------------------------------- building / loading


def test_build_is_deterministic(tmp_path):
    def digest(path):
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    a = build_tiny_dllm(tmp_path / "a", kind="llada", seed=3, **TINY)
    b = build_tiny_dllm(tmp_path / "b", kind="llada", seed=3, **TINY)
    c = build_tiny_dllm(tmp_path / "c", kind="llada", seed=4, **TINY)
    assert digest(a) == digest(b)
    assert digest(a) != digest(c)
    assert json.loads((a / SIDECAR).read_text()) == json.loads((b / SIDECAR).read_text())


def test_tiny_config_refuses_an_odd_head_dim_and_bert_has_no_dropout():
    from dllm_rl.tiny import tiny_config

    tok = build_tokenizer()
    for hidden in (30, 60):  # 4 heads: head_dim 7.5 (no whole split) or 15 (no rotary pairs)
        with pytest.raises(ValueError, match=f"hidden_size {hidden} must be num_heads x an even head_dim"):
            tiny_config("llada", tok, hidden_size=hidden, num_heads=4)
    with pytest.raises(ValueError, match="kind 'gpt' is not one of"):
        tiny_config("gpt", tok)
    bert = tiny_config("masked_lm", tok)
    assert bert.hidden_dropout_prob == bert.attention_probs_dropout_prob == 0.0  # train-mode logits = eval's


def test_sdar_takes_the_block_length_and_the_tokenizer_the_context_it_is_given(tmp_path):
    from transformers import AutoTokenizer

    small = {**TINY, "num_layers": 1}
    a = build_tiny_dllm(tmp_path / "a", kind="sdar", block_length=8, max_position_embeddings=48, **small)
    assert json.loads((a / SIDECAR).read_text())["block_length"] == 8
    assert AutoTokenizer.from_pretrained(a).model_max_length == 48  # not the default 96
    assert json.loads((build_tiny_dllm(tmp_path / "b", kind="sdar", **small) / SIDECAR).read_text())["block_length"] == 4


@pytest.mark.parametrize("kind", KINDS)
def test_load_each_kind_gives_finite_logits(kind, tiny_dirs, predictors):
    mp = predictors[kind]
    sidecar = json.loads((tiny_dirs[kind] / SIDECAR).read_text())
    assert sidecar["kind"] == kind and sidecar["mask_token_id"] == 1
    assert isinstance(mp, MaskPredictor) and mp.kind == kind
    assert mp.mask_token_id == 1 and mp.pad_token_id == 0 and mp.eos_token_id == 2
    assert mp.vocab_size == 53 and mp.max_length == 96
    assert mp.attention == ("block_causal" if kind == "sdar" else "full")
    assert mp.block_length == (4 if kind == "sdar" else None)
    assert mp.shift_logits == (kind == "dream")
    # the wrapper owns no parameters of its own
    assert sum(p.numel() for p in mp.parameters()) == sum(p.numel() for p in mp.model.parameters())
    x = _ids(2, 12)
    x[:, 6:] = mp.mask_token_id
    logits = mp(x, prompt_length=6)
    assert logits.shape == (2, 12, 53) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_save_pretrained_round_trip(predictors, tmp_path):
    mp = predictors["sdar"]
    mp.save_pretrained(tmp_path / "copy")
    back = load_mask_predictor(tmp_path / "copy")
    assert (back.kind, back.attention, back.block_length) == ("sdar", "block_causal", 4)
    x = _ids(1, 10)
    torch.testing.assert_close(back(x, prompt_length=4), mp(x, prompt_length=4), rtol=0, atol=0)


def test_a_block_length_without_block_attention_is_warned(tiny_dirs):
    with pytest.warns(UserWarning, match="model.block_length 4 is not used: the llada model's attention is 'full'"):
        mp = load_mask_predictor(tiny_dirs["llada"], block_length=4)
    assert mp.attention == "full" and mp.block_length is None  # as DllmSpec says: None for full attention


def test_arguments_override_sidecar(tiny_dirs):
    with pytest.warns(UserWarning, match="not the model's own mask token"):
        mp = load_mask_predictor(tiny_dirs["llada"], attention="block_causal", block_length=2,
                                 shift_logits=True, mask_token_id=5)  # fmt: skip
    assert (mp.kind, mp.attention, mp.block_length) == ("llada", "block_causal", 2)
    assert mp.shift_logits is True
    assert mp.mask_token_id == 5
    # another kind: the sidecar's attention no longer applies, the kind's default does
    sdar = load_mask_predictor(tiny_dirs["llada"], kind="sdar", block_length=3)
    assert (sdar.attention, sdar.block_length, sdar.shift_logits) == ("block_causal", 3, False)


def test_kind_guessed_without_sidecar(tiny_dirs, tmp_path):
    import shutil

    bert = shutil.copytree(tiny_dirs["masked_lm"], tmp_path / "bert")
    (bert / SIDECAR).unlink()
    mp = load_mask_predictor(bert)  # a masked LM, mask id from the tokenizer
    assert (mp.kind, mp.attention, mp.mask_token_id) == ("masked_lm", "full", 1)
    llama = shutil.copytree(tiny_dirs["llada"], tmp_path / "llama")
    (llama / SIDECAR).unlink()
    with pytest.raises(ValueError, match="kind"):
        load_mask_predictor(llama)
    assert load_mask_predictor(llama, kind="llada").kind == "llada"


def test_a_mask_token_other_than_the_models_own_is_warned(tiny_dirs):
    own = json.loads((tiny_dirs["llada"] / SIDECAR).read_text())["mask_token_id"]
    other = 0 if own != 0 else 2
    with pytest.warns(UserWarning, match=f"mask_token_id {other} is not the model's own mask token \\({own}, from"):
        assert load_mask_predictor(tiny_dirs["llada"], mask_token_id=other).mask_token_id == other
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_mask_predictor(tiny_dirs["llada"], mask_token_id=own)


def test_mask_token_out_of_vocab_is_a_clear_error(tiny_dirs, tmp_path):
    with pytest.raises(ValueError, match=r"mask_token_id 126336 .*vocab_size 53"):
        load_mask_predictor(tiny_dirs["llada"], mask_token_id=126336)
    with pytest.raises(ValueError, match="-1"):
        load_mask_predictor(tiny_dirs["llada"], mask_token_id=-1)
    import shutil

    bad = shutil.copytree(tiny_dirs["dream"], tmp_path / "bad")
    spec = json.loads((bad / SIDECAR).read_text())
    (bad / SIDECAR).write_text(json.dumps({**spec, "mask_token_id": 53}))
    with pytest.raises(ValueError, match="mask_token_id 53"):
        load_mask_predictor(bad)


def test_bad_paths_name_the_path(tmp_path, tiny_dirs):
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match="nowhere"):
        load_mask_predictor(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_mask_predictor(empty)
    import shutil

    broken = shutil.copytree(tiny_dirs["llada"], tmp_path / "broken")
    (broken / SIDECAR).write_text('{"kind": "gpt"}')
    with pytest.raises(ValueError, match="broken.*gpt"):
        load_mask_predictor(broken)


@pytest.mark.parametrize("key, value, words", [
    ("shift_logits", "false", "shift_logits must be true or false, got 'false'"),
    ("mask_token_id", 2.9, "mask_token_id must be an integer, got 2.9"),
    ("mask_token_id", True, "mask_token_id must be an integer"),
    ("block_length", "4", "block_length must be an integer or null"),
    ("trust_remote_code", 1, "trust_remote_code must be true or false"),
])
def test_sidecar_values_of_the_wrong_json_type_are_refused(tmp_path, tiny_dirs, key, value, words):
    """A string "false" is true, and 2.9 was truncated to id 2 (the tiny model's <eos>), without a word."""
    import shutil

    bad = shutil.copytree(tiny_dirs["dream"], tmp_path / "bad")
    spec = json.loads((bad / SIDECAR).read_text())
    (bad / SIDECAR).write_text(json.dumps({**spec, key: value}))
    with pytest.raises(ValueError, match=f"bad/{SIDECAR}: {words}"):
        load_mask_predictor(bad)


# --------------------------------------------------------------------------- attention


def test_attention_mask_layout():
    valid = torch.tensor([[False, True, True, True, True, True, True]])
    m = build_attention_mask(valid, prompt_length=3, attention="block_causal", block_length=2)
    # prompt = 0..2 (block -1; position 0 padding), response blocks {3, 4} and {5, 6}
    expected = torch.tensor(
        [
            [1, 1, 1, 0, 0, 0, 0],  # padding query (prompt block): the valid prompt + itself
            [0, 1, 1, 0, 0, 0, 0],  # prompt: the valid prompt
            [0, 1, 1, 0, 0, 0, 0],
            [0, 1, 1, 1, 1, 0, 0],  # block 0: prompt + block 0
            [0, 1, 1, 1, 1, 0, 0],
            [0, 1, 1, 1, 1, 1, 1],  # block 1: prompt + blocks 0, 1
            [0, 1, 1, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert m.shape == (1, 1, 7, 7) and torch.equal(m[0, 0], expected)
    full = build_attention_mask(valid, prompt_length=3)
    assert torch.equal(full[0, 0, 1:], valid.expand(6, 7))
    assert full[0, 0, 0].all()  # the padding query: every valid key and itself
    assert torch.equal(position_ids_from_valid(valid), torch.tensor([[0, 0, 1, 2, 3, 4, 5]]))


@pytest.mark.parametrize("kind", ["llada", "dream", "masked_lm"])
def test_full_attention_sees_later_tokens(kind, predictors):
    mp = predictors[kind]
    x = _ids(1, 12)
    y = x.clone()
    y[0, 10] = 3 if x[0, 10] != 3 else 4  # change a late response token
    a, b = mp(x, prompt_length=4), mp(y, prompt_length=4)
    first = 1 if mp.shift_logits else 0  # position 0 is a copy of 1 under shift_logits
    assert (a[0, first:5] - b[0, first:5]).abs().amax() > 1e-6  # prompt logits moved too


def test_block_causal_isolates_later_blocks(predictors):
    mp = predictors["sdar"]  # block_length 4; prompt 0..3, block 0 = 4..7, block 1 = 8..11
    x = _ids(2, 12, seed=1)
    y = x.clone()
    y[:, 9] = torch.where(x[:, 9] == 3, 4, 3)
    a, b = mp(x, prompt_length=4), mp(y, prompt_length=4)
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=0, atol=0)  # prompt + block 0: exact
    assert (a[:, 8:] - b[:, 8:]).abs().amax(dim=(1, 2)).min() > 1e-6
    # a change in block 0 reaches block 1 but not the prompt
    z = x.clone()
    z[:, 5] = torch.where(x[:, 5] == 3, 4, 3)
    c = mp(z, prompt_length=4)
    torch.testing.assert_close(a[:, :4], c[:, :4], rtol=0, atol=0)
    assert (a[:, 8:] - c[:, 8:]).abs().amax() > 1e-6


@pytest.mark.parametrize("kind", KINDS)
def test_left_padding_matches_unpadded(kind, predictors):
    mp = predictors[kind]
    prompt, response, pad = _ids(1, 5, seed=2), _ids(1, 6, seed=3), 3
    unpadded = torch.cat([prompt, response], 1)
    ref = mp(unpadded, prompt_length=5)
    padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), unpadded], 1)
    valid = torch.ones_like(padded, dtype=torch.bool)
    valid[:, :pad] = False
    out = mp(padded, prompt_length=5 + pad, valid=valid)
    first = 1 if mp.shift_logits else 0  # shifted: the first real position reads a pad row
    torch.testing.assert_close(out[:, pad + first :], ref[:, first:], rtol=0, atol=1e-5)
    assert torch.isfinite(out).all()
    # the same in a batch with an unpadded row
    batch = torch.cat([padded, torch.cat([_ids(1, pad, seed=4), unpadded], 1)])
    vb = torch.cat([valid, torch.ones_like(valid)])
    out_b = mp(batch, prompt_length=5 + pad, valid=vb)
    torch.testing.assert_close(out_b[:1, pad + first :], ref[:, first:], rtol=0, atol=1e-5)


def test_shift_logits(tiny_dirs, predictors):
    dream = predictors["dream"]
    plain = load_mask_predictor(tiny_dirs["dream"], shift_logits=False)
    x = _ids(2, 9)
    shifted, raw = dream(x, prompt_length=3), plain(x, prompt_length=3)
    torch.testing.assert_close(shifted[:, 1:], raw[:, :-1], rtol=0, atol=0)
    torch.testing.assert_close(shifted[:, 0], raw[:, 0], rtol=0, atol=0)


def test_eager_attention_matches_sdpa(tiny_dirs, predictors):
    eager = load_mask_predictor(tiny_dirs["sdar"], attn_implementation="eager")
    x = _ids(2, 12, seed=5)
    valid = torch.ones_like(x, dtype=torch.bool)
    valid[0, :2] = False
    torch.testing.assert_close(
        eager(x, prompt_length=4, valid=valid),
        predictors["sdar"](x, prompt_length=4, valid=valid),
        rtol=1e-4, atol=1e-5,
    )  # fmt: skip


def test_forward_input_errors(predictors):
    mp = predictors["llada"]
    with pytest.raises(ValueError, match="prompt_length"):
        mp(_ids(1, 5), prompt_length=6)
    with pytest.raises(ValueError, match="context 96"):
        mp(_ids(1, 97), prompt_length=2)


# --------------------------------------------------------------------------- remote code

_CONFIGURATION = """
from transformers import PretrainedConfig


class TinyMLMConfig(PretrainedConfig):
    model_type = "tinymlm"

    def __init__(self, vocab_size=53, hidden_size=16, max_position_embeddings=32, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.max_position_embeddings = max_position_embeddings
        super().__init__(**kwargs)
"""

_MODELING = """
import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput

from .configuration_tinymlm import TinyMLMConfig


class TinyMLMForMaskedLM(PreTrainedModel):
    # One bidirectional attention layer: enough to see a 4D mask at work.

    config_class = TinyMLMConfig
    base_model_prefix = "tinymlm"

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.head = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1])[None]
        h = self.embed(input_ids) + self.pos(position_ids)
        q, k, v = self.qkv(h)[:, None].chunk(3, dim=-1)
        h = h + torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask
        )[:, 0]
        return MaskedLMOutput(logits=self.head(h))
"""


@pytest.fixture
def remote_dir(tmp_path, monkeypatch):
    import importlib.util
    import sys

    import transformers.dynamic_module_utils as dmu

    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    src = tmp_path / "src" / "tinymlm_src"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "configuration_tinymlm.py").write_text(textwrap.dedent(_CONFIGURATION))
    (src / "modeling_tinymlm.py").write_text(textwrap.dedent(_MODELING))
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    spec = importlib.util.find_spec("tinymlm_src.modeling_tinymlm")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        torch.manual_seed(0)
        model = module.TinyMLMForMaskedLM(module.TinyMLMConfig())
    finally:
        for name in [n for n in sys.modules if n.startswith("tinymlm_src")]:
            del sys.modules[name]
    out = tmp_path / "tinymlm"
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    for name in ("configuration_tinymlm.py", "modeling_tinymlm.py"):
        (out / name).write_text((src / name).read_text())
    config = json.loads((out / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "configuration_tinymlm.TinyMLMConfig",
        "AutoModelForMaskedLM": "modeling_tinymlm.TinyMLMForMaskedLM",
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_remote_code_needs_opt_in(remote_dir):
    with pytest.raises(ValueError, match=r"model\.trust_remote_code=true"):
        load_mask_predictor(remote_dir)
    with pytest.warns(UserWarning, match="trust_remote_code"):
        mp = load_mask_predictor(remote_dir, trust_remote_code=True)
    assert type(mp.model).__name__ == "TinyMLMForMaskedLM"
    assert (mp.kind, mp.mask_token_id, mp.vocab_size, mp.max_length) == ("masked_lm", 1, 53, 32)
    x = _ids(2, 10)
    valid = torch.ones_like(x, dtype=torch.bool)
    valid[0, :2] = False
    logits = mp(x, prompt_length=4, valid=valid)
    assert logits.shape == (2, 10, 53) and torch.isfinite(logits).all()
    # the mask reaches the custom forward: row 0's real tokens ignore its padding
    ref = mp(x[:1, 2:], prompt_length=2)
    torch.testing.assert_close(logits[:1, 2:], ref, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- the spec, the sidecar and the masks by hand


def test_spec_refuses_what_no_model_runs_with():
    assert DllmSpec("sdar", 1, attention="block_causal", block_length=1).block_length == 1  # the smallest block
    for kw, words in [({"kind": "gpt"}, "kind 'gpt' is not one of"),
                      ({"attention": "causal"}, "attention 'causal' is not one of"),
                      ({"mask_token_id": True}, "mask_token_id must be an integer, got True"),
                      ({"attention": "block_causal", "block_length": 0}, "positive integer block_length, got 0")]:
        with pytest.raises(ValueError, match=words):
            DllmSpec(**{"kind": "sdar", "mask_token_id": 1, **kw})


def test_read_sidecar_refuses_a_list_unknown_keys_and_an_unknown_attention(tmp_path):
    assert read_sidecar(tmp_path) is None  # no dllm.json: nothing to say
    (tmp_path / SIDECAR).write_text(json.dumps({"kind": "llada", "block_length": None}))
    assert read_sidecar(tmp_path) == {"kind": "llada", "block_length": None}  # a null block is no block
    for text, words in [("[]", "expected a JSON object, got list"),
                        ('{"kind": "llada", "blocks": 4}', "unknown keys \\['blocks'\\]"),
                        ('{"kind": "llada", "attention": "causal"}', "attention 'causal' is not one of")]:
        (tmp_path / SIDECAR).write_text(text)
        with pytest.raises(ValueError, match=re.escape(f"{tmp_path / SIDECAR}: ") + words):
            read_sidecar(tmp_path)


def test_block_attention_of_one_token_blocks_and_the_masks_it_refuses():
    valid = torch.ones(1, 4, dtype=torch.bool)
    m = build_attention_mask(valid, prompt_length=2, attention="block_causal", block_length=1)
    # prompt 0, 1 (block -1); response 2 (block 0) and 3 (block 1): each sees the prompt and what precedes it
    assert m[0, 0].long().tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    with pytest.raises(ValueError, match="block_length >= 1, got 0"):
        build_attention_mask(valid, prompt_length=2, attention="block_causal", block_length=0)
    with pytest.raises(ValueError, match="attention 'causal' is not one of"):
        build_attention_mask(valid, prompt_length=2, attention="causal")


# --------------------------------------------------------------------------- the wrapper on a stand-in model

TOK = SimpleNamespace(pad_token_id=0, eos_token_id=2)


class _Recorder(nn.Module):
    """A stand-in transformers model: the logits of token t are row t of a fixed table, and the
    keyword arguments of every call are kept for the test to read."""

    def __init__(self, vocab: int = 6, dtype: torch.dtype = torch.float32, **config):
        super().__init__()
        self.config = SimpleNamespace(**{"vocab_size": vocab, "max_position_embeddings": 8, **config})
        self.table = nn.Parameter(torch.arange(vocab * vocab, dtype=torch.float32).reshape(vocab, vocab).to(dtype))
        self.calls = []

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        self.calls.append({"attention_mask": attention_mask, "position_ids": position_ids, "use_cache": use_cache})
        return SimpleNamespace(logits=self.table[input_ids])


class _Biased(_Recorder):
    """LLaDA's remote code: the 4D mask goes in `attention_bias`."""

    def forward(self, input_ids, attention_bias=None, attention_mask=None, position_ids=None):
        self.calls.append({"attention_bias": attention_bias, "attention_mask": attention_mask})
        return SimpleNamespace(logits=self.table[input_ids])


def test_a_predictor_built_directly_takes_its_kinds_attention_and_shift():
    sdar = MaskPredictor(_Recorder(), TOK, kind="sdar", mask_token_id=1, block_length=2)
    assert (sdar.attention, sdar.block_length, sdar.shift_logits) == ("block_causal", 2, False)
    dream = MaskPredictor(_Recorder(), TOK, kind="dream", mask_token_id=1)
    assert (dream.attention, dream.shift_logits) == ("full", True)
    assert MaskPredictor(_Recorder(), TOK, kind="dream", mask_token_id=1, shift_logits=False).shift_logits is False
    with pytest.raises(ValueError, match="kind 'gpt' is not one of"):
        MaskPredictor(_Recorder(), TOK, kind="gpt", mask_token_id=1)


def test_answer_ids_fill_with_eos_and_refuse_an_answer_with_no_room_for_it():
    mp = MaskPredictor(_Recorder(vocab=53), build_tokenizer(), kind="llada", mask_token_id=1)
    # "1" -> 4, "2" -> 5, "3" -> 6 (CHARSET[i] is id i + 3); <eos> is 2 to the end
    assert mp.answer_ids(["12", "123", ""], 4).tolist() == [[4, 5, 2, 2], [4, 5, 6, 2], [2, 2, 2, 2]]
    with pytest.raises(ValueError, match="answer '1234' does not fit gen_length 4 with its <eos>"):
        mp.answer_ids(["1234"], 4)


def test_a_predictor_refuses_a_mask_token_outside_its_vocabulary():
    assert MaskPredictor(_Recorder(vocab=6), TOK, kind="llada", mask_token_id=5).mask_token_id == 5  # the last id
    for bad in (6, -1):
        with pytest.raises(ValueError, match=re.escape(f"mask_token_id {bad} is not in the model's vocabulary "
                                                       "(vocab_size 6: ids 0..5)")):
            MaskPredictor(_Recorder(vocab=6), TOK, kind="llada", mask_token_id=bad)


def test_vocab_size_is_the_rows_of_the_output_layer_not_the_config():
    class Padded(_Recorder):  # an output layer padded past config.vocab_size, as some checkpoints ship
        def get_output_embeddings(self):
            return nn.Linear(4, 8, bias=False)

    mp = MaskPredictor(Padded(vocab=6), TOK, kind="llada", mask_token_id=7)
    assert mp.vocab_size == 8 and mp.mask_token_id == 7


def test_flash_attention_is_refused_for_its_lack_of_4d_masks():
    with pytest.raises(ValueError, match="'flash_attention_2' cannot take the custom 4D attention masks"):
        MaskPredictor(_Recorder(_attn_implementation="flash_attention_2"), TOK, kind="llada", mask_token_id=1)


def test_forward_passes_a_bool_mask_positions_over_valid_tokens_and_no_cache():
    model = _Recorder()
    mp = MaskPredictor(model, TOK, kind="llada", mask_token_id=1)
    x = torch.tensor([[0, 3, 4, 1, 1]])
    valid = torch.tensor([[False, True, True, True, True]])
    out = mp(x, prompt_length=3, valid=valid)
    torch.testing.assert_close(out, model.table.detach()[x], rtol=0, atol=0)
    call = model.calls[-1]
    assert call["use_cache"] is False  # never a KV cache: every step re-reads the whole sequence
    assert call["position_ids"].tolist() == [[0, 0, 1, 2, 3]]  # the padding counts no position
    mask = call["attention_mask"]
    assert mask.dtype == torch.bool and mask.shape == (1, 1, 5, 5)
    assert mask[0, 0, 0].all() and mask[0, 0, 1:].long().tolist() == [[0, 1, 1, 1, 1]] * 4
    # an int validity reads as the bool one
    assert torch.equal(mp(x, prompt_length=3, valid=valid.long()), out)
    assert model.calls[-1]["attention_mask"].dtype == torch.bool


def test_eager_attention_gets_the_additive_float_mask():
    model = _Recorder(_attn_implementation="eager")
    mp = MaskPredictor(model, TOK, kind="llada", mask_token_id=1)
    mp(torch.tensor([[0, 3, 4]]), prompt_length=2, valid=torch.tensor([[False, True, True]]))
    mask = model.calls[-1]["attention_mask"]
    lo = torch.finfo(torch.float32).min
    assert mask.dtype == torch.float32
    assert mask[0, 0].tolist() == [[0.0, 0.0, 0.0], [lo, 0.0, 0.0], [lo, 0.0, 0.0]]  # 0 = attend, min = not


def test_the_4d_mask_goes_to_attention_bias_only_for_llada():
    llada = _Biased(model_type="llada")
    MaskPredictor(llada, TOK, kind="llada", mask_token_id=1)(torch.tensor([[3, 4]]), prompt_length=1)
    assert llada.calls[-1]["attention_bias"].shape == (1, 1, 2, 2) and llada.calls[-1]["attention_mask"] is None
    other = _Biased(model_type="llama")
    MaskPredictor(other, TOK, kind="llada", mask_token_id=1)(torch.tensor([[3, 4]]), prompt_length=1)
    assert other.calls[-1]["attention_mask"].shape == (1, 1, 2, 2) and other.calls[-1]["attention_bias"] is None


def test_forward_takes_an_all_prompt_row_at_the_full_context_and_refuses_the_rest():
    mp = MaskPredictor(_Recorder(), TOK, kind="llada", mask_token_id=1)  # a context of 8
    x = torch.full((1, 8), 3)
    assert mp(x, prompt_length=8).shape == (1, 8, 6)  # all prompt, all 8 positions
    with pytest.raises(ValueError, match=re.escape("prompt_length -1 is outside [0, 8]")):
        mp(x, prompt_length=-1)
    with pytest.raises(ValueError, match=re.escape("valid has shape (1, 7), input_ids (1, 8)")):
        mp(x, prompt_length=4, valid=torch.ones(1, 7, dtype=torch.bool))


def test_logits_are_float32_from_a_bf16_model():
    model = _Recorder(dtype=torch.bfloat16)
    out = MaskPredictor(model, TOK, kind="llada", mask_token_id=1)(torch.tensor([[3, 5]]), prompt_length=1)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, model.table.detach().float()[torch.tensor([[3, 5]])], rtol=0, atol=0)


def test_token_ids_take_the_tokenizer_first_then_the_configs_first_listed_id():
    both = MaskPredictor(_Recorder(eos_token_id=2), SimpleNamespace(pad_token_id=0, eos_token_id=3),
                         kind="llada", mask_token_id=1)
    assert both.eos_token_id == 3
    listed = MaskPredictor(_Recorder(eos_token_id=[2, 5], pad_token_id=False), SimpleNamespace(),
                           kind="llada", mask_token_id=1)
    assert (listed.eos_token_id, listed.pad_token_id) == (2, None)  # a bool is no token id
    # a bool is no context length either: the next name gives it
    assert MaskPredictor(_Recorder(max_position_embeddings=True, max_sequence_length=16), TOK,
                         kind="llada", mask_token_id=1).max_length == 16


def test_model_class_and_kind_guess_by_hand():
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

    assert _model_class("llada", {"AutoConfig": "c.C", "AutoModel": "m.M"}) is AutoModel  # LLaDA's remote code
    assert _model_class("dream", {"AutoModel": "m.M", "AutoModelForCausalLM": "m.L"}) is AutoModelForCausalLM
    assert _model_class("sdar", {}) is AutoModelForCausalLM
    assert _model_class("masked_lm", {"AutoModel": "m.M"}) is AutoModelForMaskedLM
    for model_type, kind in [("LLaDA", "llada"), ("dream", "dream"), ("SDAR", "sdar")]:
        assert _guess_kind(SimpleNamespace(model_type=model_type), {}, Path("m")) == kind


# --------------------------------------------------------------------------- loading: the settings it resolves


def test_load_refuses_an_unknown_dtype_and_passes_attn_implementation(tiny_dirs):
    with pytest.raises(ValueError, match="dtype 'float64' is not one of"):
        load_mask_predictor(tiny_dirs["llada"], dtype="float64")
    eager = load_mask_predictor(tiny_dirs["sdar"], attn_implementation="eager")
    assert eager.model.config._attn_implementation == "eager"


def test_trust_remote_code_on_a_plain_directory_runs_and_records_nothing(tiny_dirs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mp = load_mask_predictor(tiny_dirs["llada"], trust_remote_code=True)
    assert not [w for w in caught if "trust_remote_code" in str(w.message)]
    assert mp.trust_remote_code is False and mp.spec.trust_remote_code is False
    assert mp.model.training is False  # loaded for inference: no dropout


def test_a_sidecar_of_another_kind_gives_neither_its_shift_nor_its_block(tiny_dirs):
    assert load_mask_predictor(tiny_dirs["dream"], kind="llada").shift_logits is False
    # the sdar sidecar's block_length 4 belongs to sdar; Qwen3's config has none
    with pytest.raises(ValueError, match=r"block_causal attention needs block_length \(config: model.block_length"):
        load_mask_predictor(tiny_dirs["sdar"], kind="llada", attention="block_causal")


def test_the_sidecars_mask_token_comes_before_the_tokenizers(tiny_dirs, tmp_path):
    import shutil

    own = shutil.copytree(tiny_dirs["llada"], tmp_path / "own")
    spec = json.loads((own / SIDECAR).read_text())
    (own / SIDECAR).write_text(json.dumps({**spec, "mask_token_id": 5}))  # the tokenizer's mask is 1
    assert load_mask_predictor(own).mask_token_id == 5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_mask_predictor(own, mask_token_id=5)  # the model's own, as its sidecar says
    assert not [w for w in caught if "mask token" in str(w.message)]
    with pytest.warns(UserWarning, match=f"mask_token_id 1 is not the model's own mask token \\(5, from {SIDECAR}"):
        load_mask_predictor(own, mask_token_id=1)


def test_a_sidecar_mask_token_past_the_vocabulary_is_refused_before_the_weights_load(tiny_dirs, tmp_path, monkeypatch):
    import shutil

    from transformers import AutoModelForCausalLM

    bad = shutil.copytree(tiny_dirs["llada"], tmp_path / "bad")
    spec = json.loads((bad / SIDECAR).read_text())
    (bad / SIDECAR).write_text(json.dumps({**spec, "mask_token_id": 53}))  # ids 0..52

    def no_weights(*a, **kw):
        raise AssertionError("loaded the weights before checking the mask token")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    with pytest.raises(ValueError, match=re.escape(f"{bad}: mask_token_id 53 is not in the model's vocabulary")):
        load_mask_predictor(bad)


def test_a_runtime_error_other_than_a_shape_mismatch_is_raised_as_it_is(tiny_dirs, monkeypatch):
    """Only transformers' shape check ("size mismatch") is said as config.json not fitting the
    weights; any other RuntimeError in the load (CUDA out of memory, a kernel's own) goes up
    unchanged, not reworded as a config problem."""
    from transformers import AutoModelForCausalLM

    oom = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def out_of_memory(*a, **kw):
        raise oom

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", out_of_memory)
    with pytest.raises(RuntimeError) as raised:
        load_mask_predictor(tiny_dirs["llada"])
    assert raised.value is oom


def test_a_tokenizer_with_its_own_code_needs_trust_remote_code(tiny_dirs, tmp_path):
    import shutil

    remote = shutil.copytree(tiny_dirs["llada"], tmp_path / "remote")
    conf = json.loads((remote / "tokenizer_config.json").read_text())
    (remote / "tokenizer_config.json").write_text(json.dumps({**conf, "auto_map": {"AutoTokenizer": ["t.T", None]}}))
    with pytest.raises(ValueError, match=r"ships its own Python code .*model\.trust_remote_code=true"):
        load_mask_predictor(remote)


def test_a_model_without_an_end_token_is_refused_at_load(tiny_dirs, tmp_path):
    """Answers end with <eos> and are padded with it: without one the first rollout raised
    AttributeError ('bool' object has no attribute 'long') in DLLMPolicy.completion_mask."""
    import shutil

    bare = shutil.copytree(tiny_dirs["llada"], tmp_path / "bare")
    for name, key in (("tokenizer_config.json", "eos_token"), ("config.json", "eos_token_id")):
        data = json.loads((bare / name).read_text())
        (bare / name).write_text(json.dumps({**data, key: None}))  # null: LlamaConfig's default eos is 2
    with pytest.raises(ValueError, match=r"bare: no end-of-text token: the tokenizer has no eos_token .*"
                                         r"Set eos_token in tokenizer_config.json"):
        load_mask_predictor(bare)
    (bare / "model.safetensors").unlink()  # refused before the weights are read
    with pytest.raises(ValueError, match="no end-of-text token"):
        load_mask_predictor(bare)


def test_decoding_blocks_unlike_a_block_causal_models_attention_block_are_warned_of(tiny_dirs):
    import warnings

    from dllm_rl import backend
    from dllm_rl.config import DLLMTrainConfig
    from mmrl.core.config import load_config

    def built(kind, block):
        cfg = load_config(DLLMTrainConfig, overrides=[f"model.path={tiny_dirs[kind]}", "rollout.gen_length=8",
                                                      f"rollout.block_length={block}"])
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            backend.build_policy(cfg)
        return [str(w.message) for w in seen if "attention block" in str(w.message)]

    assert built("sdar", 4) == [] and built("llada", 8) == []  # its own block; a full-attention model
    (message,) = built("sdar", 8)
    assert message.startswith("rollout.block_length 8 differs from the attention block (4) of the block-causal")
    assert "set rollout.block_length: 4" in message


def test_a_file_or_a_hub_cache_entry_given_as_model_path_names_the_directory_meant(tmp_path):
    from dllm_rl import backend
    from dllm_rl.config import DLLMTrainConfig
    from mmrl.core.config import ConfigError, load_config

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "model.safetensors").write_bytes(b"")
    cfg = load_config(DLLMTrainConfig, overrides=[f"model.path={tmp_path}/mine/model.safetensors"])
    with pytest.raises(ConfigError, match=rf"is not a directory \(it is a file: .*this file's is {tmp_path}/mine\)"):
        backend.build_policy(cfg)
    snapshot = tmp_path / "models--me--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    with pytest.raises(ValueError, match=rf"has no config.json; .* one of its snapshots, e.g. {snapshot}\)"):
        load_mask_predictor(tmp_path / "models--me--tiny")


def test_a_tokenizer_with_tokens_past_the_models_vocabulary_is_named_before_any_rollout(tmp_path):
    """Tokens added to the tokenizer without resizing the model's embeddings: a prompt using one
    raised IndexError ('index out of range in self') in the embedding at the first rollout (a
    device assert on a GPU). The tiny tokenizer's letters are ids 29..52; this model has 40."""
    import shutil

    import transformers

    from dllm_rl import backend
    from dllm_rl.config import DLLMTrainConfig
    from mmrl.core.config import ConfigError, load_config

    model = tmp_path / "model"
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=96,
                                      pad_token_id=0, eos_token_id=2, bos_token_id=2)
    transformers.LlamaForCausalLM(config).save_pretrained(model)
    for name in ("tokenizer.json", "tokenizer_config.json", SIDECAR):
        shutil.copy(backend.bundled_model_dir() / name, model / name)
    rows = [{"prompt": f"opposite of {w}:", "answer": a} for w, a in (("up", "down"), ("in", "out"), ("on", "off"))]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    (tmp_path / "eval.jsonl").write_text(json.dumps(rows[2]) + "\n")

    def cfg(*sets):
        return load_config(DLLMTrainConfig, None, [f"model.path={model}", *sets], defaults=backend.DEFAULT_CONFIG)

    jsonl = cfg("task.type=jsonl", f"task.train_path={tmp_path}/train.jsonl", f"task.eval_path={tmp_path}/eval.jsonl")
    with pytest.raises(ConfigError, match=rf"model.path: the tokenizer in {model} encodes the prompt 'opposite of up:' "
                                          r"in .*train.jsonl, line 1 with token 4\d \('.'\), past the model's "
                                          r"vocabulary of 40 ids: .*resize_token_embeddings"):
        backend.build(jsonl)
    arith = cfg("task.num_train=4", "task.num_eval=2")  # digits only: ids under 40, the policy builds
    policy, _task = backend.build(arith)
    with pytest.raises(ConfigError, match=r"--prompt: the model's tokenizer encodes 'opposite of up:' with token"):
        backend.fit_prompts(policy, ["opposite of up:"])
