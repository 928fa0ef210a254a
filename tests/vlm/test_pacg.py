"""PACG (mmrl.vlm.methods.pacg, mmrl.vlm.claims): claim spans, their tokens, persistence and
the gate by hand; the annotation on the bundled tiny VLM; a step of each config."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

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


def test_claim_spans_answer_tag_at_the_start_or_empty_and_words_inside_words():
    """A response that opens with the answer tag has no reasoning, so no claims; an empty tag
    means no tag (the whole text is reasoning); a claim word inside a longer word is none."""
    assert claim_spans("<answer>a red circle</answer>") == []
    assert claim_spans("a red circle", answer_tag="") == [(0, 12)]
    assert claim_spans("I was bored, then scared") == []  # "red" ends both words, starts neither


def test_claim_spans_read_the_answer_tag_in_any_case():
    """As shapes-mood's format check and DSPO read tags: "<ANSWER>" ends the reasoning, so the
    answer's "2 blue squares" is no claim; "İ" (two characters lower-cased) does not shift the cut."""
    assert claim_spans("a red circle. <ANSWER>2 blue squares</ANSWER>") == [(0, 12)]
    assert claim_spans("İ saw a red circle <Answer>2</Answer>") == [(0, 18)]
    assert claim_spans("a red circle <FINAL>2", answer_tag="<final>") == [(0, 12)]
    # the tag is text, not a pattern: "(answer)" is not found in "answer"
    assert claim_spans("a red circle; answer: a blue square (answer) 2", answer_tag="(answer)") == [
        (0, 12), (14, 35)]


class _PieceTokenizer:
    """Token id k decodes to PIECES[k]; id 0 is a special token (skipped when asked, as the
    rollout's text was decoded)."""

    PIECES = ("<s>", "so", " re", "d,b", "lue", " 2", "x", ",", " ", "red", ".", " y", "<pad>")

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.PIECES[i] for i in ids if not (skip_special_tokens and i in (0, 12)))


def test_token_claims_by_hand_half_open_spans_first_claim_and_special_tokens():
    """"so red,blue 2": claims "so red" [0, 6) and "blue 2" [7, 13). Tokens <s> | so | " re" |
    "d,b" | lue | " 2" cover [0, 0) [0, 2) [2, 5) [5, 8) [8, 11) [11, 13): <s> (skipped, empty)
    is in no claim; "d,b" overlaps both and takes the first. "x, red. y": the one claim "red"
    is [3, 6); the space before it ends at 3 and the "." after it starts at 6, both outside."""
    tok = _PieceTokenizer()
    text = "so red,blue 2"
    assert claim_spans(text) == [(0, 6), (7, 13)]
    assert token_claims(tok, [0, 1, 2, 3, 4, 5], claim_spans(text)) == [-1, 0, 0, 0, 1, 1]
    assert claim_spans("x, red. y") == [(3, 6)]
    assert token_claims(tok, [6, 7, 8, 9, 10, 11], [(3, 6)]) == [-1, -1, -1, 0, -1, -1]


def test_batch_claims_reads_the_masked_tokens_and_leaves_the_rest_at_minus_one():
    """Row 0: the tokens of "so red,blue 2" then two pads outside the mask; row 1 has no
    claims (no spans): all -1."""
    from mmrl.vlm.claims import batch_claims

    ids = torch.tensor([[0, 1, 2, 3, 4, 5, 12, 12], [6, 7, 8, 9, 10, 11, 12, 12]])
    mask = torch.tensor([[True] * 6 + [False] * 2, [True] * 6 + [False] * 2])
    out = batch_claims(_PieceTokenizer(), ids, mask, [[(0, 6), (7, 13)], []])
    assert out.dtype == torch.long
    assert out.tolist() == [[-1, 0, 0, 0, 1, 1, -1, -1], [-1] * 8]


def test_claim_persistence_of_no_claims_has_a_long_index_and_scattered_tokens_average():
    """A claim's tokens need not be contiguous: claim 0 at tokens 0 and 3 -> (1 + e^-2) / 2;
    the empty index is long, like a non-empty one (read as ints)."""
    logp = torch.zeros((1, 4))
    inter = torch.tensor([[0.0, -5.0, -5.0, -2.0]])
    p, index = claim_persistence(logp, inter, torch.tensor([[0, 1, 1, 0]]))
    torch.testing.assert_close(p, torch.tensor([(1 + math.exp(-2)) / 2, math.exp(-5)]))
    assert index.tolist() == [[0, 0], [0, 1]] and index.dtype == torch.long
    _, none = claim_persistence(logp, inter, torch.full((1, 4), -1))
    assert none.dtype == torch.long


def test_shapes_claim_holds_needs_every_named_shape():
    """One true and one false "<colour> <shape>" in a claim: the claim is false (an unsupported
    claim must not count as supported); the words may be apart by more than one space."""
    scene = {"shapes": [{"colour": "red", "shape": "circle"}, {"colour": "blue", "shape": "square"}]}
    assert shapes_claim_holds("a red circle and a green triangle", scene) is False
    assert shapes_claim_holds("a green triangle and a red circle", scene) is False
    assert shapes_claim_holds("a red circle and a blue square", scene) is True
    assert shapes_claim_holds("a red  circle", scene) is True
    assert shapes_claim_holds("a red\tsquare", scene) is False


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


def test_pacg_gate_two_claims_are_enough():
    """Persistence [0.2, 0.8]: mean 0.5, std sqrt(2 * 0.09 / 1) = 0.4243 -> z = [-0.7071, 0.7071];
    z0 = 0.5, eta = 1 -> claim 1's gate is 1 - (0.7071 - 0.5) = 0.7929."""
    adv = torch.tensor([[1.0, 1.0]])
    out, gates = pacg_gate(adv, torch.tensor([0.2, 0.8]), torch.tensor([[0, 0], [0, 1]]), torch.tensor([[0, 1]]),
                           z0=0.5, eta=1.0, g_min=0.5)
    g = 1 - (1 / math.sqrt(2) - 0.5)
    torch.testing.assert_close(gates, torch.tensor([1.0, g]))
    torch.testing.assert_close(out, torch.tensor([[1.0, g]]))


def test_pacg_gate_scales_only_the_gated_claims_tokens_and_leaves_its_input():
    """Persistence [0.9, 0.1, 0.1, 0.1] -> z = [1.5, -0.5, -0.5, -0.5]; z0 = 1, eta = 0.5 -> claim
    (0, 0) gated by 0.75: its two tokens 2 -> 1.5; claim (0, 1) and the unclaimed token keep 2."""
    adv = torch.tensor([[2.0, 2.0, 2.0, 2.0], [1.0, 1.0, 1.0, 1.0]])
    ids = torch.tensor([[0, 0, 1, -1], [0, 1, -1, -1]])
    index = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]])
    before = adv.clone()
    out, _ = pacg_gate(adv, torch.tensor([0.9, 0.1, 0.1, 0.1]), index, ids, z0=1.0, eta=0.5, g_min=0.5)
    torch.testing.assert_close(out, torch.tensor([[1.5, 1.5, 2.0, 2.0], [1.0, 1.0, 1.0, 1.0]]))
    assert torch.equal(adv, before)  # the caller's advantages are not written


def _pacg_method(tmp_path, config="pacg.yaml", extra=()):
    from mmrl.vlm.methods.pacg import PACG

    cfg = load_config(backend.CONFIG_CLASS, ROOT / "configs" / "vlm" / config, [f"output_dir={tmp_path}", *extra],
                      defaults=backend.DEFAULT_CONFIG)
    return PACG(cfg.method, cfg, None)


def test_empty_or_blank_claim_words_are_refused(tmp_path):
    """claim_words [] fell back to the default vocabulary (`or`), and a blank word matched at
    every word boundary, making every segment a claim; both are errors now."""
    from mmrl.core.config import ConfigError

    for words in ("[]", "['', red]"):
        with pytest.raises(ConfigError, match=r"invalid config: method: claim_words .*: give claim words, none blank"):
            _pacg_method(tmp_path, extra=[f"method.claim_words={words}"])
    assert _pacg_method(tmp_path, extra=["method.claim_words=[red]"]).cfg.claim_words == ["red"]
    text = "I think so, 2 reds here. A circle. <answer>x</answer>"
    assert claim_spans(text, ["", "red"]) == claim_spans(text, ["red"]) == [(12, 23)]  # Python callers
    assert claim_spans(text, []) == [(12, 23)]  # digits alone


def _claims_batch():
    """Two samples of one group, rewards [1, 0] -> A = +-1/sqrt(2). Claims (0, 0), (0, 1), (1, 0),
    (1, 1) with re-scored log-probs log 0.9, log 0.1, ... against old_logp 0 -> persistence
    [0.9, 0.1, 0.1, 0.1], z = [1.5, -0.5, -0.5, -0.5]."""
    from mmrl.core.batch import RolloutBatch
    from mmrl.core.rewards import AtomScores, Sample

    ids = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1]])
    ratio = torch.tensor([[0.9, 0.9, 0.1, 0.1], [0.1, 0.1, 0.1, 0.1]])
    return RolloutBatch(group_ids=torch.tensor([0, 0]), samples=[Sample("q", "a")] * 2,
                        mask=torch.ones((2, 4), dtype=torch.bool), old_logp=torch.zeros((2, 4)),
                        scores=AtomScores(names=["answer"], values=torch.tensor([[1.0], [0.0]]),
                                          total=torch.tensor([1.0, 0.0])),
                        data={"claim_ids": ids, "logp_intervened": ratio.log()})


@pytest.mark.parametrize("z0,eta,g_min,gate", [(0.5, 0.25, 0.6, 0.75), (0.5, 0.5, 0.6, 0.6)])
def test_pacg_advantages_gate_with_the_configured_z0_eta_g_min(tmp_path, z0, eta, g_min, gate):
    """z = 1.5 for claim (0, 0): 1 - 0.25 (1.5 - 0.5) = 0.75; 1 - 0.5 * 1 = 0.5, floored at g_min 0.6.
    Sample 1's negative advantage is untouched. Metrics: 4 claims over 2 samples, mean persistence
    0.3, one of four gated, mean gate (3 + gate) / 4."""
    method = _pacg_method(tmp_path, extra=[f"method.z0={z0}", f"method.eta={eta}", f"method.g_min={g_min}"])
    batch = _claims_batch()
    a = 1 / math.sqrt(2)
    torch.testing.assert_close(method.advantages(batch), torch.tensor([[a * gate, a * gate, a, a], [-a] * 4]),
                               atol=1e-5, rtol=0)
    assert method.batch_metrics(batch) == pytest.approx(
        {"pacg/claims": 2.0, "pacg/persistence": 0.3, "pacg/gated": 0.25, "pacg/gate_mean": (3 + gate) / 4})


def test_pacg_on_vppo_gates_vppos_shaped_advantages_once(tmp_path):
    """base vppo, beta_min 0.5, top_frac 1: mean dependencies [2, 0] -> n = [1, 0] -> scale [1.5, 0.5];
    then the gate (z0 1, eta 0.5: 1 - 0.5 * 0.5 = 0.75) on claim (0, 0)."""
    method = _pacg_method(tmp_path, "pacg_vppo.yaml", ["method.beta_min=0.5", "method.top_frac=1.0"])
    batch = _claims_batch()
    batch.data["visual_dependency"] = torch.tensor([[2.0] * 4, [0.0] * 4])
    a = 1 / math.sqrt(2)
    torch.testing.assert_close(method.advantages(batch),
                               torch.tensor([[1.5 * a * 0.75] * 2 + [1.5 * a] * 2, [-0.5 * a] * 4]),
                               atol=1e-5, rtol=0)


def test_pacg_metrics_without_claims_are_left_out(tmp_path):
    method = _pacg_method(tmp_path)
    batch = _claims_batch()
    batch.data["claim_ids"] = torch.full((2, 4), -1)
    a = 1 / math.sqrt(2)
    torch.testing.assert_close(method.advantages(batch), torch.tensor([[a] * 4, [-a] * 4]), atol=1e-5, rtol=0)
    assert method.batch_metrics(batch) == {}



def test_pacg_metrics_of_a_batch_without_images_are_not_the_last_batchs(tmp_path):
    """A batch without images gets no claims (annotate re-scores nothing): its metrics are empty, where
    they were the previous batch's persistence and gates, reported again."""
    method = _pacg_method(tmp_path)
    method.advantages(_claims_batch())
    assert method.batch_metrics(_claims_batch())["pacg/claims"] == 2.0
    plain = _claims_batch()
    del plain.data["claim_ids"], plain.data["logp_intervened"]
    method.advantages(plain)
    assert method.batch_metrics(plain) == {}

def test_annotate_reads_claims_with_the_configured_words_and_answer_tag(tmp_path, monkeypatch):
    """claim_words [zebra], answer_tag <final>: "a zebra here, a red circle <final>2 zebras</final>"
    has one claim, "a zebra here" = [0, 12) (no colour word, nothing after the tag). On VPPO,
    d = logp_intervened - old_logp = [1, -1] -> s = [min(e - 2, cap 0.5), 1/e]."""
    from mmrl.core.batch import RolloutBatch
    from mmrl.core.rewards import Sample
    from mmrl.vlm.methods import pacg

    seen = {}

    def fake_claims(tokenizer, ids, mask, spans):
        seen["spans"] = spans
        return torch.zeros(ids.shape, dtype=torch.long)

    monkeypatch.setattr(pacg, "batch_claims", fake_claims)
    method = _pacg_method(tmp_path, "pacg_vppo.yaml", ["method.claim_words=[zebra]", "method.answer_tag=<final>",
                                                       "method.cap=0.5"])
    method.intervened_logp = lambda policy, b: torch.tensor([[1.0, -1.0]])
    text = "a zebra here, a red circle <final>2 zebras</final>"
    batch = RolloutBatch(group_ids=torch.tensor([0]), samples=[Sample("q", text)], mask=torch.ones((1, 2), dtype=torch.bool),
                         old_logp=torch.zeros((1, 2)), data={"completion_ids": torch.zeros((1, 2), dtype=torch.long)})
    method.annotate(SimpleNamespace(tokenizer=None), batch)
    assert seen["spans"] == [[(0, 12)]]
    torch.testing.assert_close(batch.data["visual_dependency"], torch.tensor([[0.5, 1 / math.e]]))
    torch.testing.assert_close(batch.data["logp_intervened"], torch.tensor([[1.0, -1.0]]))


def test_claim_report_by_hand_with_a_scripted_policy(monkeypatch):
    """Words (circle, square, zebra), scene: one red circle. Response 0: "a red circle" (true, persistence
    0.8), "a blue square" (false, 0.5); response 1: "a zebra" (not checkable, 0.9), "a red square"
    (false, mean(0.3, 0.1) = 0.2). -> true 0.8 (1 claim), false 0.35 (2), rate 2/3, 4 claims / 2.
    One response per chunk (batch_size 1); masking with p = 0.5 from a generator seeded `seed`."""
    from mmrl.core.batch import RolloutBatch
    from mmrl.core.rewards import Sample
    from mmrl.vlm.methods import pacg

    texts = {"a": "a red circle, a blue square <answer>1</answer>", "b": "a zebra, a red square <answer>0</answer>",
             "c": "a red circle <answer>1</answer>"}
    claims = {"a": [0, 0, 1, 1], "b": [0, 1, 1, -1], "c": [0, 0, -1, -1]}
    ratio = {"a": [0.8, 0.8, 0.5, 0.5], "b": [0.9, 0.3, 0.1, 1.0], "c": [0.6, 0.6, 1.0, 1.0]}
    seen = []

    class Policy:
        processor = SimpleNamespace(image_processor=SimpleNamespace(image_mean=[0.5] * 3, image_std=[0.5] * 3))
        tokenizer = None  # batch_claims is scripted below

        def greedy(self, items, max_new_tokens, batch_size, stop):
            return [texts[it.key] for it in items]

        def teacher_batch(self, chunk, done):
            n = len(chunk)
            keys = [it.key for it in chunk]
            return RolloutBatch(group_ids=torch.zeros(n, dtype=torch.long), samples=[Sample("q", t) for t in done],
                                mask=torch.ones((n, 4), dtype=torch.bool),
                                data={"pixel_values": torch.ones((n, 2, 3)), "image_grid_thw": torch.ones((n, 1, 3)),
                                      "completion_ids": torch.tensor([claims[k] for k in keys]),
                                      "ratio": torch.tensor([ratio[k] for k in keys])})

        def logprobs(self, batch):
            return torch.zeros(batch.mask.shape)

        def rescore(self, batch, pixels):
            return batch.data["ratio"].log()

    def fake_mask(pixels, grid, *, p, fill, generator):
        seen.append((p, generator.initial_seed()))
        return pixels

    monkeypatch.setattr(pacg, "mask_patches", fake_mask)
    monkeypatch.setattr(pacg, "batch_claims", lambda tok, ids, mask, spans: ids.clone())  # the ids are the claims
    scene = {"shapes": [{"colour": "red", "shape": "circle"}]}
    items = [SimpleNamespace(key=k, meta={"scene": scene}) for k in ("a", "b")]
    out = pacg.claim_report(Policy(), items, max_new_tokens=8, seed=3, words=("circle", "square", "zebra"),
                            batch_size=1)
    assert out == pytest.approx({"persistence_false": 0.35, "persistence_true": 0.8, "claims_false": 2.0,
                                 "claims_true": 1.0, "false_claim_rate": 2 / 3, "claims_per_response": 2.0})
    assert seen == [(0.5, 3), (0.5, 3)]
    only_true = pacg.claim_report(Policy(), [SimpleNamespace(key="c", meta={"scene": scene})], max_new_tokens=8)
    assert math.isnan(only_true["persistence_false"]) and only_true["persistence_true"] == pytest.approx(0.6)
    assert only_true["false_claim_rate"] == 0.0 and only_true["claims_per_response"] == 1.0


def test_pacg_gate_leaves_claims_that_persist_equally_alone_whatever_the_rounding():
    """Seven claims all at 0.7: their float32 mean rounds, so std() is ~6e-8, not 0, and each
    z-score would be sqrt(6 / 7) = 0.93 > z0 = 0.5; equal persistence has no outlier to gate."""
    persistence = torch.full((7,), 0.7)
    assert float(persistence.std()) > 0.0  # the rounding the gate must not read as a spread
    adv, gates = pacg_gate(torch.ones(7, 1), persistence, torch.tensor([[i, 0] for i in range(7)]),
                           torch.zeros(7, 1, dtype=torch.long), z0=0.5, eta=0.5, g_min=0.5)
    assert gates.tolist() == [1.0] * 7 and adv.tolist() == [[1.0]] * 7
