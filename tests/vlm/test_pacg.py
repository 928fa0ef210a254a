"""PACG (mmrl.vlm.methods.pacg, mmrl.vlm.claims): claim spans, their tokens, persistence and
the gate by hand; the annotation on the bundled tiny VLM; a step of each config."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mmrl.core.config import load_config
from mmrl.core.logging import read_metrics
from mmrl.core.trainer import Trainer
from mmrl.vlm import backend
from mmrl.vlm.claims import claim_persistence, claim_spans, shapes_claim_holds, token_claims
from mmrl.vlm.methods.pacg import pacg_gate

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "assets" / "tiny-qwen2.5-vl"


def test_claim_spans_segments_naming_image_content():
    text = "I look closely. a red circle , a blue square ; so 2 <answer>2</answer>"
    spans = claim_spans(text)
    assert [text[s:e] for s, e in spans] == ["a red circle", "a blue square", "so 2"]
    assert claim_spans("nothing visual here. <answer>yes</answer>") == []
    two = "Two Circles and more"
    assert [two[s:e] for s, e in claim_spans(two, words=("circle",))] == [two]
    # without the tag the whole text is reasoning; words only match whole words
    assert claim_spans("a reddish thing") == [] and claim_spans("the reds") != []


def test_token_claims_follow_the_text():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(BUNDLED)
    text = "a red circle , a blue square <answer>1</answer>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    claims = token_claims(tok, ids, claim_spans(text))
    by_claim = {c: tok.decode([i for i, k in zip(ids, claims) if k == c]).strip() for c in set(claims)}
    assert by_claim[0] == "a red circle" and by_claim[1] == "a blue square"
    assert "answer" in by_claim[-1] and "," in by_claim[-1]


def test_claim_persistence_by_hand():
    """Claim 0 of sample 0: ratios min(1, e^0), min(1, e^-1) -> (1 + 1/e) / 2; claim 1:
    l' > l clips to 1. Sample 1 has no claims."""
    logp = torch.zeros((2, 4))
    inter = torch.tensor([[0.0, -1.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    ids = torch.tensor([[0, 0, 1, -1], [-1, -1, -1, -1]])
    p, index = claim_persistence(logp, inter, ids)
    torch.testing.assert_close(p, torch.tensor([(1 + math.exp(-1)) / 2, 1.0]))
    assert index.tolist() == [[0, 0], [0, 1]]
    empty, none = claim_persistence(logp, inter, torch.full((2, 4), -1))
    assert empty.numel() == 0 and none.shape == (0, 2)


def test_pacg_gate_attenuates_only_persistent_positive_claims():
    """Persistence [0.1, 0.1, 0.1, 0.9]: mean 0.3, std 0.4 -> z = [-0.5, -0.5, -0.5, 1.5].
    z0 = 1, eta = 0.5 -> the last claim's gate is 1 - 0.5 * 0.5 = 0.75, the rest 1."""
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, -1.0, -1.0]])
    ids = torch.tensor([[0, 0, 1, 2], [0, 0, 0, -1]])
    # claims (0,0), (0,1), (1,0), (0,2); the persistent one is sample 0's claim 2
    persistence = torch.tensor([0.1, 0.1, 0.1, 0.9])
    index = torch.tensor([[0, 0], [0, 1], [1, 0], [0, 2]])
    out, gates = pacg_gate(adv, persistence, index, ids, z0=1.0, eta=0.5, g_min=0.5)
    torch.testing.assert_close(gates, torch.tensor([1.0, 1.0, 1.0, 0.75]))
    torch.testing.assert_close(out, torch.tensor([[1.0, 1.0, 1.0, 0.75], [-1.0, -1.0, -1.0, -1.0]]))
    # the same persistent claim on a negative sample is never touched; g_min floors the gate
    index_neg = torch.tensor([[0, 0], [0, 1], [0, 2], [1, 0]])
    out, gates = pacg_gate(adv, persistence, index_neg, ids, z0=1.0, eta=5.0, g_min=0.5)
    assert float(gates[3]) == 0.5 and torch.equal(out, adv)
    same, ones = pacg_gate(adv, torch.full((4,), 0.5), index, ids, z0=1.0, eta=0.5, g_min=0.5)
    assert torch.equal(same, adv) and bool((ones == 1).all())  # equal persistence: nothing gated


def test_shapes_claim_holds():
    scene = {"shapes": [{"colour": "red", "shape": "circle"}, {"colour": "blue", "shape": "square"}]}
    assert shapes_claim_holds("a red circle", scene) is True
    assert shapes_claim_holds("a red square", scene) is False
    assert shapes_claim_holds("two Blue Squares", scene) is True
    assert shapes_claim_holds("so 2", scene) is None


def _pacg_cfg(tmp_path, model, config="pacg.yaml", extra=()):
    return load_config(backend.CONFIG_CLASS, ROOT / "configs" / "vlm" / config, [
        f"model.path={model}", f"output_dir={tmp_path}", "train.max_steps=1", "task.num_train=8",
        "task.num_eval=2", "rollout.eval_samples=0", "rollout.prompts_per_step=2", "rollout.num_generations=4",
        "rollout.max_new_tokens=16", "method.dynamic_sampling.enabled=false", "logging.progress=false",
        "logging.tensorboard=false", *extra], defaults=backend.DEFAULT_CONFIG)


def test_annotate_marks_claim_tokens_and_rescores(tmp_path, one_thread):
    from mmrl.core.method import build_method
    from mmrl.vlm.tasks.shapes_qa import generate_items

    cfg = _pacg_cfg(tmp_path, BUNDLED)
    policy, task = backend.build(cfg)
    method = build_method(cfg, task.reward)
    items = generate_items(2, seed=3)
    batch = policy.teacher_batch(items, [it.reference for it in items])
    batch.old_logp = policy.logprobs(batch).detach()
    method.annotate(policy, batch)
    claims = batch.data["claim_ids"]
    for i, it in enumerate(items):
        n_objects = len(it.meta["scene"]["shapes"])
        assert set(claims[i][batch.mask[i]].tolist()) - {-1} == set(range(n_objects))
        assert bool((claims[i][~batch.mask[i]] == -1).all())
    assert not torch.allclose(batch.data["logp_intervened"], batch.old_logp)  # the image mattered
    assert "visual_dependency" not in batch.data  # base: dapo


@pytest.mark.parametrize("config,extra", [("pacg.yaml", []), ("pacg_vppo.yaml", []),
                                          ("pacg.yaml", ["method.intervention=blur"])])
def test_pacg_configs_run_a_step(config, extra, tmp_path, reward_spread, one_thread):
    cfg = _pacg_cfg(tmp_path, BUNDLED, config, extra)
    policy, task = backend.build(cfg)
    before = {k: v.detach().clone() for k, v in policy.model.named_parameters()}
    Trainer(cfg, policy, task, backend=backend).train()
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert row["pacg/claims"] > 0 and 0 <= row["pacg/gated"] <= 1 and math.isfinite(row["loss/total"])
    assert ("vppo/visual_dependency" in row) == (config == "pacg_vppo.yaml")
    assert any(not torch.equal(v, before[k]) for k, v in policy.model.named_parameters())


def test_claim_report_reads_the_claims_of_greedy_decodes_cut_at_the_stop_strings(tmp_path, one_thread):
    """PACG's measure of unsupported claims scores the greedy texts as training's rollouts end
    them: with stop [","] the bundled model's "a <colour> <shape> , a ... <answer>" keeps one
    claim a response, and the true/false split is shapes_claim_holds on those texts."""
    from mmrl.vlm.methods.pacg import claim_report
    from mmrl.vlm.tasks.shapes_qa import generate_items

    policy, _ = backend.build(_pacg_cfg(tmp_path, BUNDLED))
    items = generate_items(6, seed=3)
    whole = claim_report(policy, items, max_new_tokens=32)
    cut = claim_report(policy, items, max_new_tokens=32, stop=[","])
    texts = policy.greedy(items, 32, stop=[","])
    spans = [claim_spans(t) for t in texts]
    assert cut["claims_per_response"] == 1.0 and whole["claims_per_response"] > 1.0
    holds = [shapes_claim_holds(t[s:e], it.meta["scene"]) for t, sp, it in zip(texts, spans, items) for s, e in sp]
    assert (cut["claims_true"], cut["claims_false"]) == (holds.count(True), holds.count(False))
    assert cut["false_claim_rate"] == holds.count(False) / len(holds)
    assert 0 < cut["persistence_false"] <= 1 and 0 < cut["persistence_true"] <= 1
