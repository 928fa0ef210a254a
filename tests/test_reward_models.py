"""Learned reward models as atoms (mmrl.core.reward_models): tiny sequence classifiers built
here with the bundled tokenizers, saved and loaded through from_pretrained."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import yaml
from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

from mmrl.core.reward_models import RewardModel, reward_model_atom
from mmrl.core.rewards import Reward, Sample, load_atoms

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def build_rm(out, chat=False, num_labels=1, seed=0):
    """A random 2-layer Llama reward model with the bundled VLM's tokenizer (byte-level BPE),
    without its chat template unless `chat`."""
    tok = AutoTokenizer.from_pretrained(ROOT / "assets/tiny-qwen2.5-vl")
    if not chat:
        tok.chat_template = None
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      num_labels=num_labels, pad_token_id=tok.pad_token_id)
    LlamaForSequenceClassification(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


SAMPLES = [Sample("12+7=", "19", {"answer": "19"}), Sample("3*4=", "12", {"answer": "12"}),
           Sample("99-9=", "90 and more words to make it longer", {"answer": "90"})]


def by_hand(path, text, last=False):
    """The model's score of `text` alone; `last`: read at its last token, even one that is the
    config's pad token (which the model's own pooling would pass over)."""
    tok = AutoTokenizer.from_pretrained(path)
    model = LlamaForSequenceClassification.from_pretrained(path).eval()
    if last:
        model.config.pad_token_id = None
    with torch.no_grad():
        return float(model(**tok(text, return_tensors="pt")).logits[0, 0])


def test_scores_are_the_models_logit_on_prompt_and_completion_alone_or_batched(tmp_path):
    path = build_rm(tmp_path / "rm")
    rm = RewardModel(path, batch_size=2)
    batched = rm(SAMPLES)
    alone = [RewardModel(path, batch_size=1)([s])[0] for s in SAMPLES]
    expected = [by_hand(path, f"{s.prompt}\n{s.completion}") for s in SAMPLES]
    assert batched == pytest.approx(alone, abs=1e-5) and batched == pytest.approx(expected, abs=1e-5)
    assert len({round(v, 5) for v in batched}) == 3  # the text matters
    custom = RewardModel(path, template="Q: {prompt} A: {completion}")(SAMPLES[:1])[0]
    assert custom == pytest.approx(by_hand(path, "Q: 12+7= A: 19"), abs=1e-5)


def test_a_tokenizer_with_a_chat_template_reads_a_user_and_an_assistant_turn(tmp_path):
    path = build_rm(tmp_path / "rm", chat=True)
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template([{"role": "user", "content": "12+7="}, {"role": "assistant", "content": "19"}],
                                   tokenize=False)
    assert "12+7=" in text and "19" in text
    assert RewardModel(path)(SAMPLES[:1])[0] == pytest.approx(by_hand(path, text), abs=1e-5)


def test_a_long_text_keeps_its_end_and_is_counted_once(tmp_path):
    path = build_rm(tmp_path / "rm")
    rm = RewardModel(path, max_length=8)
    long = Sample("1+1=1+1=1+1=1+1=", "2")
    with pytest.warns(UserWarning, match="1 of 2 texts were longer than max_length 8"):
        scores = rm([long, SAMPLES[0]])
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(f"{long.prompt}\n{long.completion}")["input_ids"]
    model = LlamaForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        tail = float(model(input_ids=torch.tensor([ids[-8:]])).logits[0, 0])
    assert scores[0] == pytest.approx(tail, abs=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rm([long])  # warned once


def test_config_spec_resolves_against_the_config_dir_and_joins_a_reward(tmp_path):
    build_rm(tmp_path / "models" / "rm")
    atoms = load_atoms([{"reward_model": "models/rm", "name": "rm", "weight": 0.5, "batch_size": 2}],
                       base_dir=tmp_path)
    reward = Reward(atoms)
    scores = reward.score(SAMPLES)
    assert scores.names == ["rm"] and torch.allclose(scores.total, 0.5 * scores.values[:, 0])
    assert atoms[0].fn.device == torch.device("cpu")


@pytest.mark.parametrize(("spec", "match"), [
    ({"reward_model": "nowhere"}, "no config.json"),
    ({"reward_model": "rm", "temperature": 1}, "unknown keys \\['temperature'\\]"),
    ({"reward_model": "rm", "dtype": "int8"}, "dtype must be"),
    ({"reward_model": "rm", "batch_size": 0}, "batch_size must be"),
    ({"reward_model": "rm", "template": "{prompt}"}, "template must contain"),
    # other braces fail now, not when the first rollout is scored
    ({"reward_model": "rm", "template": '{"q": "{prompt}", "a": "{completion}"}'}, "fields \\[\'\"q\"\'\\]"),
    ({"reward_model": "rm", "template": "{prompt} } {completion}"}, "literal brace"),
    ({"reward_model": "rm", "template": "{prompt} {completion} {extra}"}, "fields \\['extra'\\]"),
    ({"reward_model": "rm", "max_length": 0}, "max_length must be an integer >= 1"),
    ({"reward_model": "rm", "max_length": 8.5}, "max_length must be an integer >= 1"),
    ({"reward_model": "rm", "batch_size": 2.5}, "batch_size must be an integer >= 1, got 2.5"),
    ({"reward_model": "rm", "batch_size": True}, "batch_size must be an integer >= 1, got True"),  # YAML's yes
    ({"reward_model": "rm", "max_length": True}, "max_length must be an integer >= 1"),
    # past the position table it failed when scoring, with "IndexError: index out of range in self"
    ({"reward_model": "rm", "max_length": 129}, "max_length 129 is more than .* \\(max_position_embeddings 128\\)"),
    ({"reward_model": "rm", "template": 5}, "expected str, got int"),  # a TypeError, named like the others
    ({"reward_model": "rm", "device": "gpu"}, "device must be cpu, auto, cuda or cuda:N, got 'gpu'"),
    ({"reward_model": "rm", "device": 0}, "device must be cpu, auto, cuda or cuda:N, got 0"),
    # the spec's key, where model_device's words named model.device (on a GPU machine: no GPU 99)
    ({"reward_model": "rm", "device": "cuda:99"}, "(?<!model\\.)device cuda:99: (no CUDA device|GPU 99)"),
    ({"reward_model": "two"}, "has 2 outputs"),
    ({"reward_model": "notrm"}, "is not a sequence classifier"),
])
def test_bad_reward_model_specs_name_the_spec_and_the_problem(tmp_path, spec, match):
    build_rm(tmp_path / "rm")
    build_rm(tmp_path / "two", num_labels=2)
    (tmp_path / "notrm").mkdir()
    (tmp_path / "notrm" / "config.json").write_text(json.dumps({"model_type": "llama",
                                                                "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match=f"reward spec 0 \\({spec['reward_model']}\\): .*{match}"):
        load_atoms([spec], base_dir=tmp_path)


def test_a_bad_name_weight_or_parents_is_named_before_the_model_loads(tmp_path, monkeypatch):
    """They were checked once the weights had loaded (minutes for a 7B reward model)."""
    import mmrl.core.reward_models as rm

    build_rm(tmp_path / "rm")
    monkeypatch.setattr(rm, "load_sequence_classifier", lambda *a, **k: pytest.fail("the model was loaded"))
    for spec, match in [({"weight": "heavy"}, "weight must be a number, got 'heavy'"),
                        ({"weight": True}, "weight must be a number, got True"),
                        ({"name": ""}, "name must be a non-empty string"),
                        ({"parents": [3]}, "parents must be a list of atom names")]:
        with pytest.raises(ValueError, match=f"reward spec 0 \\(rm\\): .*{match}"):
            load_atoms([{"reward_model": "rm", **spec}], base_dir=tmp_path)


def test_the_text_limit_is_the_smaller_real_limit_else_512():
    from types import SimpleNamespace

    from mmrl.core.reward_models import text_limit

    def limit(positions, tokenizer_max):
        config = SimpleNamespace() if positions is None else SimpleNamespace(max_position_embeddings=positions)
        return text_limit(SimpleNamespace(config=config), SimpleNamespace(model_max_length=tokenizer_max))

    assert limit(64, 128) == 64 and limit(256, 128) == 128
    assert limit(None, int(1e30)) == 512  # transformers' "no limit" sentinel is no limit
    assert limit(None, 300) == 300


def test_a_given_template_wins_over_the_tokenizers_chat_template(tmp_path):
    path = build_rm(tmp_path / "rm", chat=True)
    rm = RewardModel(path, template="Q: {prompt} A: {completion}")
    assert rm(SAMPLES[:1])[0] == pytest.approx(by_hand(path, "Q: 12+7= A: 19"), abs=1e-5)


def test_a_non_text_sample_is_a_clear_error(tmp_path):
    atom = reward_model_atom(build_rm(tmp_path / "rm"))
    with pytest.raises(TypeError, match="a reward model scores text"):
        atom.fn([Sample("a prompt", torch.tensor([1, 2]))])


def test_a_dllm_run_trains_on_a_reward_model_atom(tmp_path):
    """Through the command line: the atom's score is logged and evaluated; a bad spec is a
    clean error (exit 2), not a traceback."""
    from typer.testing import CliRunner

    from dllm_rl.cli import app

    build_rm(tmp_path / "rm")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "reward": {"atoms": [{"reward_model": "rm", "name": "rm", "weight": 0.1}]},
        "rollout": {"prompts_per_step": 2, "num_generations": 4},
        "task": {"num_train": 20, "num_eval": 4}, "logging": {"tensorboard": False, "progress": False}}))
    result = CliRunner().invoke(app, ["train", "--config", str(config), "--max-steps", "1",
                                      "-o", str(tmp_path / "run")])
    assert result.exit_code == 0, (result.output[-2000:], result.exception)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert "reward/rm" in row and row["reward/rm"] == row["reward/rm"]  # logged and finite
    assert "rm" in json.loads((tmp_path / "run" / "summary.json").read_text())["eval_after"]
    config.write_text(yaml.safe_dump({"reward": {"atoms": [{"reward_model": "missing"}]}}))
    result = CliRunner().invoke(app, ["train", "--config", str(config), "-o", str(tmp_path / "bad")])
    assert result.exit_code == 2 and "reward.atoms: reward spec 0 (missing): " in result.output
    assert "Traceback" not in result.output


def _cls_chat_template_model(tmp_path):
    """A tiny Llama reward model in tmp_path/rm whose tokenizer adds [CLS] and whose chat
    template writes [CLS] itself too; returns the tokenizer."""
    tok = AutoTokenizer.from_pretrained(ROOT / "assets/tiny-consistency-modernbert")
    tok.chat_template = "{{ cls_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      num_labels=1, pad_token_id=tok.pad_token_id)
    LlamaForSequenceClassification(cfg).save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    return tok


def test_a_chat_template_that_writes_the_start_token_is_not_given_a_second_one(tmp_path):
    """A tokenizer that adds a start token ([CLS] here) with a chat template that writes it too:
    the model sees it once, as apply_chat_template's own tokens have it."""
    tok = _cls_chat_template_model(tmp_path)
    rm = RewardModel(tmp_path / "rm")
    seen = []
    rm.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"][0].tolist()), with_kwargs=True)
    rm([Sample("red circle", "yes")])
    assert seen[0].count(tok.cls_token_id) == 1 and seen[0][0] == tok.cls_token_id


@pytest.mark.parametrize("pad", ["none", "eos", "in_text"])
def test_a_batch_scores_each_text_at_its_own_last_token_whatever_the_pad_token(tmp_path, pad):
    """No pad token, the end-of-sequence token as pad, or a pad token the texts hold: texts of
    different lengths ending with that token are scored batched, in one forward of the model (the
    first two once went one at a time), each at its last real token, that token included."""
    path = build_rm(tmp_path / "rm")
    tok = AutoTokenizer.from_pretrained(path)
    if pad != "in_text":
        tok.pad_token = None if pad == "none" else tok.eos_token
        tok.save_pretrained(path)
    template = "{prompt}\n{completion}" + (tok.eos_token if pad != "in_text" else tok.pad_token)
    rm = RewardModel(path, template=template, batch_size=4)
    forwards = []
    rm.model.register_forward_pre_hook(lambda m, a, kw: forwards.append(kw["input_ids"].shape), with_kwargs=True)
    scores = rm(SAMPLES)
    expected = [by_hand(path, template.format(prompt=s.prompt, completion=s.completion), last=True) for s in SAMPLES]
    assert len(forwards) == 1 and forwards[0][0] == 3
    assert scores == pytest.approx(expected, abs=1e-5)
    assert scores == pytest.approx([rm([s])[0] for s in SAMPLES], abs=1e-5)  # batched == one by one


def test_a_config_without_architectures_is_not_a_sequence_classifier(tmp_path):
    from mmrl.core.reward_models import sequence_classifier_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"is not a sequence classifier \(architectures: \[\]\)"):
        sequence_classifier_config(tmp_path, "reward model")


@pytest.mark.parametrize(("dtype", "expected"), [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                                 (None, torch.float32)])
def test_the_model_is_loaded_in_the_dtype_asked_for(tmp_path, dtype, expected):
    rm = RewardModel(build_rm(tmp_path / "rm"), dtype=dtype)
    assert rm.model.dtype == expected
    assert all(p.dtype == expected for p in rm.model.parameters())


def test_scores_are_deterministic_for_a_model_with_dropout(tmp_path):
    """from_pretrained's model is put in eval mode: dropout does not make scores random."""
    path = build_rm(tmp_path / "rm")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "attention_dropout": 0.5}))
    rm = RewardModel(path)
    assert rm.model.config.attention_dropout == 0.5 and not rm.model.training
    torch.manual_seed(1)
    first = rm(SAMPLES)
    assert rm(SAMPLES) == first and first == pytest.approx(RewardModel(path, batch_size=1)(SAMPLES), abs=1e-5)


def test_long_texts_are_counted_over_every_batch(tmp_path):
    rm = RewardModel(build_rm(tmp_path / "rm"), max_length=8, batch_size=1)
    long = Sample("1+1=1+1=1+1=1+1=", "2")
    with pytest.warns(UserWarning, match="2 of 3 texts were longer than max_length 8"):
        rm([long, SAMPLES[0], long])


def test_a_chat_text_of_exactly_max_length_tokens_is_not_counted_as_cut(tmp_path):
    """The count reads the tokens the model gets: a chat template's own, without the tokenizer's
    [CLS] and [SEP] added on top."""
    tok = _cls_chat_template_model(tmp_path)
    sample = Sample("red circle", "yes")
    n = len(tok("[CLS]red circle yes ", add_special_tokens=False)["input_ids"])
    rm = RewardModel(tmp_path / "rm", max_length=n)
    assert rm.text(sample) == "[CLS]red circle yes "
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rm([sample])
    with pytest.warns(UserWarning, match="1 of 1 texts were longer than max_length"):
        RewardModel(tmp_path / "rm", max_length=n - 1)([sample])


def test_a_spec_without_a_name_is_the_reward_model_atom_and_its_device_beats_the_default(tmp_path):
    from mmrl.core.reward_models import atom_from_spec

    build_rm(tmp_path / "rm")
    atom = atom_from_spec({"reward_model": "rm", "device": "cpu"}, 0, tmp_path, "cuda:99")
    assert atom.name == "reward_model" and atom.parents == () and atom.weight == 1.0
    assert atom.fn.device == torch.device("cpu")


def test_the_model_gets_only_input_ids_and_the_attention_mask(tmp_path):
    """A tokenizer that also returns token_type_ids: the classifier is not handed them."""
    rm = RewardModel(build_rm(tmp_path / "rm"))
    rm.tokenizer.model_input_names = ["input_ids", "token_type_ids", "attention_mask"]
    assert "token_type_ids" in rm.tokenizer(["12+7=\n19"])
    seen = []
    rm.model.register_forward_pre_hook(lambda m, a, kw: seen.append(sorted(kw)), with_kwargs=True)
    rm(SAMPLES[:1])
    assert seen == [["attention_mask", "input_ids"]]


def test_a_config_reward_model_follows_the_policys_dtype_unless_its_spec_names_one(tmp_path):
    """TRL loads a reward model with the policy's init kwargs: a bfloat16 run's reward model is
    bfloat16 (it was float32, twice the memory), and a spec's own dtype still wins."""
    from dllm_rl.config import DLLMTrainConfig
    from mmrl.core.config import load_config
    from mmrl.core.rewards import Reward, RewardAtom
    from mmrl.core.trainer import combined_reward

    build_rm(tmp_path / "rm")
    atoms = [{"reward_model": str(tmp_path / "rm"), "name": "rm"},
             {"reward_model": str(tmp_path / "rm"), "name": "rm32", "dtype": "float32"}]
    cfg = load_config(DLLMTrainConfig, None, ["model.dtype=bfloat16"], defaults={"reward": {"atoms": atoms}})
    reward = combined_reward(Reward([RewardAtom("task", len)]), cfg)
    dtypes = {a.name: next(a.fn.model.parameters()).dtype for a in reward.atoms if a.name != "task"}
    assert dtypes == {"rm": torch.bfloat16, "rm32": torch.float32}
