"""CORA (mmrl.vlm.methods.cora): HRAS by hand, the warm-up, the streams of a real reward,
and a step of configs/vlm/cora.yaml with the bundled consistency model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mmrl.core.batch import RolloutBatch
from mmrl.core.config import load_config
from mmrl.core.logging import read_metrics
from mmrl.core.trainer import Trainer
from mmrl.vlm import backend
from mmrl.vlm.methods.cora import CORA, hras_advantages

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "assets" / "tiny-qwen2.5-vl"


def test_hras_by_hand():
    """Group 0: task [1, 0] -> z = [0.707, -0.707]; cons [0.9, 0.1] -> z = [0.707, -0.707].
    Group 1: task [1, 1] -> 0; cons [0.2, 0.2] -> 0 (a constant stream adds nothing)."""
    task = torch.tensor([1.0, 0.0, 1.0, 1.0])
    cons = torch.tensor([0.9, 0.1, 0.2, 0.2])
    gids = torch.tensor([0, 0, 1, 1])
    a = hras_advantages(task, cons, gids, alpha=1.0, beta=0.5)
    z = 1 / math.sqrt(2)
    torch.testing.assert_close(a, torch.tensor([1.5 * z, -1.5 * z, 0.0, 0.0]), atol=1e-5, rtol=0)
    # normalise-then-sum: the small consistency stream counts as much as its z-score, not its scale
    small = hras_advantages(task, cons * 1e-3, gids, alpha=1.0, beta=0.5)
    torch.testing.assert_close(small, a, atol=1e-3, rtol=0)


def _cfg(tmp_path, extra=()):
    return load_config(backend.CONFIG_CLASS, ROOT / "configs" / "vlm" / "cora.yaml", [
        f"model.path={BUNDLED}", f"output_dir={tmp_path}", "train.max_steps=2", "task.num_train=8",
        "task.num_eval=4", "rollout.eval_samples=0", "rollout.prompts_per_step=2", "rollout.num_generations=4",
        "rollout.max_new_tokens=24", "logging.progress=false", "logging.tensorboard=false", *extra],
        defaults=backend.DEFAULT_CONFIG)


def test_warmup_and_streams(tmp_path):
    from mmrl.core.method import build_method
    from mmrl.core.rewards import Sample

    cfg = _cfg(tmp_path, ["method.warmup_steps=4", "method.beta=0.4"])
    reward = backend.build_task(cfg).reward
    assert reward.names[-1] == "consistency"
    method = build_method(cfg, reward)
    assert isinstance(method, CORA)
    betas = []
    for step in (0, 2, 4, 9):
        method.step = step
        betas.append(method.beta_now())
    assert betas == pytest.approx([0.0, 0.2, 0.4, 0.4])
    meta = {"kind": "count_colour", "params": {"colour": "red"}, "answer": "1",
            "scene": {"shapes": [], "size": 112}}
    texts = ["a red circle <answer>1</answer>", "a red circle <answer>3</answer>", "no answer", "a red circle"]
    samples = [Sample(prompt="How many red shapes are there?", completion=t, meta=meta) for t in texts]
    scores = reward.score(samples)
    batch = RolloutBatch(group_ids=torch.tensor([0, 0, 1, 1]), samples=samples, scores=scores)
    task, cons = method.streams(batch)
    # the task stream is the weighted task atoms only; the total adds lambda * P(consistent)
    torch.testing.assert_close(task + cons, scores.total)
    assert float(task[0]) == pytest.approx(1.1) and float(task[1]) == pytest.approx(0.1)
    assert float(cons[0]) > float(cons[1])  # "1" follows from one red circle, "3" does not
    assert float(cons[2]) == 0.0 and float(cons[3]) == 0.0  # no answer: nothing to be consistent with


def test_cora_config_runs_steps(tmp_path, one_thread):
    cfg = _cfg(tmp_path, ["method.warmup_steps=1"])
    policy, task = backend.build(cfg)
    before = {k: v.detach().clone() for k, v in policy.model.named_parameters()}
    summary = Trainer(cfg, policy, task, backend=backend).train()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["cora/beta"] for r in rows] == pytest.approx([0.0, 0.2])
    assert all(0 <= r["reward/consistency"] <= 1 and math.isfinite(r["loss/total"]) for r in rows)
    assert "inconsistency_rate" in summary["eval_after"] and 0 <= summary["eval_after"]["consistency"] <= 1
    assert any(not torch.equal(v, before[k]) for k, v in policy.model.named_parameters())


def test_missing_consistency_model_is_a_config_error(tmp_path):
    from mmrl.core.config import ConfigError

    cfg = _cfg(tmp_path, [f"method.consistency_model={tmp_path / 'nowhere'}"])
    with pytest.raises(ConfigError, match="consistency_model.*nowhere"):
        backend.build_task(cfg)


def test_advantage_settings_cora_would_ignore_are_refused(tmp_path):
    """CORA's advantages are HRAS's: a method.advantage it would not read is an error, not a no-op."""
    from mmrl.core.config import ConfigError

    for extra in ("method.advantage.scale=none", "method.advantage.type=rloo"):
        with pytest.raises(ConfigError, match=r"invalid config: method: CORA's advantages are HRAS's"):
            _cfg(tmp_path, [extra])


def test_both_stream_weights_zero_is_refused(tmp_path):
    """alpha 0 and beta 0 make every advantage 0: a run that trains nothing, which went on silently."""
    from mmrl.core.config import ConfigError

    with pytest.raises(ConfigError, match=r"invalid config: method: alpha and beta are both 0: every advantage is 0"):
        _cfg(tmp_path, ["method.alpha=0", "method.beta=0"])
    assert _cfg(tmp_path, ["method.alpha=0"]).method.beta == 0.2  # one stream alone still trains


def test_a_relative_consistency_model_is_found_from_the_configs_directory(tmp_path, monkeypatch):
    """method.consistency_model, like model.path: relative to the config file's directory first."""
    import shutil

    shutil.copytree(ROOT / "assets" / "tiny-consistency-modernbert", tmp_path / "exp" / "judge")
    (tmp_path / "exp" / "cora.yaml").write_text("method:\n  type: cora\n  consistency_model: judge\n")
    monkeypatch.chdir(tmp_path)  # neither the working directory nor the repository holds "judge"
    cfg = load_config(backend.CONFIG_CLASS, tmp_path / "exp" / "cora.yaml", [f"output_dir={tmp_path / 'run'}"],
                      defaults=backend.DEFAULT_CONFIG)
    task = backend.build_task(cfg)
    assert any(a.name == "consistency" for a in task.reward.atoms)


def _scored(names, values, weights, group_ids):
    from types import SimpleNamespace

    from mmrl.core.rewards import AtomScores, Sample

    values = torch.tensor(values)
    reward = SimpleNamespace(atoms=[SimpleNamespace(weight=w) for w in weights])
    scores = AtomScores(names=names, values=values, total=values @ torch.tensor(weights))
    batch = RolloutBatch(group_ids=torch.tensor(group_ids), samples=[Sample("q", "a")] * len(group_ids),
                         scores=scores)
    return reward, batch


def test_no_warmup_is_the_full_beta_from_step_0(tmp_path):
    cfg = _cfg(tmp_path, ["method.warmup_steps=0", "method.beta=0.3"])
    method = CORA(cfg.method, cfg, None)
    method.step = 0
    assert method.beta_now() == pytest.approx(0.3)


def test_cora_advantages_weight_the_streams_by_alpha_and_the_warmed_up_beta(tmp_path):
    """One group, task [1, 0] -> z = [0.7071, -0.7071]; consistency 0.5 * [0.2, 0.6] -> z = [-0.7071, 0.7071].
    alpha 2, beta 0.4 warmed up over 4 steps, at step 2: beta_t = 0.2 -> A = (2 - 0.2) * [0.7071, -0.7071]."""
    cfg = _cfg(tmp_path, ["method.alpha=2.0", "method.beta=0.4", "method.warmup_steps=4"])
    reward, batch = _scored(["answer", "consistency"], [[1.0, 0.2], [0.0, 0.6]], [1.0, 0.5], [0, 0])
    method = CORA(cfg.method, cfg, reward)
    method.step = 2
    z = 1 / math.sqrt(2)
    torch.testing.assert_close(method.advantages(batch), torch.tensor([1.8 * z, -1.8 * z]), atol=1e-5, rtol=0)


def test_streams_without_the_consistency_atom_are_an_error_that_says_so(tmp_path):
    cfg = _cfg(tmp_path)
    reward, batch = _scored(["answer", "format"], [[1.0, 1.0]], [1.0, 0.1], [0])
    with pytest.raises(ValueError, match=r"CORA needs the 'consistency' reward atom; the reward has \['answer', 'format'\]"):
        CORA(cfg.method, cfg, reward).streams(batch)


def test_the_consistency_atom_follows_shapes_qas_atoms_weighted_by_lambda(tmp_path):
    """method.lam = 0.25: Reward([format 0.1, answer 1.0, consistency 0.25]), lambda its weight."""
    reward = backend.build_task(_cfg(tmp_path, ["method.lam=0.25"])).reward
    assert reward.names == ["format", "answer", "consistency"]
    assert reward.weights.tolist() == pytest.approx([0.1, 1.0, 0.25])



def test_lam_scales_the_consistency_stream_out_of_hras():
    """lam multiplies P(consistent) in the reward, and HRAS z-scores the stream in its group: the
    advantages are the same for every lam (to the z-score's eps), and method.lam's description,
    which `mmrl config` prints, says so (it read as the stream's weight, which beta is)."""
    from mmrl.core.config_doc import _description
    from mmrl.vlm.config import CORAConfig

    task, cons = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0.9, 0.2, 0.5, 0.7])
    gid = torch.tensor([0, 0, 1, 1])
    base = hras_advantages(task, cons, gid, alpha=1.0, beta=0.2)
    for lam in (0.01, 10.0, 1e6):
        assert torch.allclose(hras_advantages(task, lam * cons, gid, alpha=1.0, beta=0.2), base, atol=1e-4)
    assert "lam does not change CORA's advantages" in " ".join(_description(CORAConfig, "lam").split())
