"""VPPO (mmrl.vlm.methods.vppo): the token visual dependency and the advantage shaping by
hand, then a step of configs/vlm/vppo.yaml through the loop on a tiny Qwen2.5-VL."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mmrl.core.config import load_config
from mmrl.core.logging import read_metrics
from mmrl.core.trainer import Trainer
from mmrl.vlm import backend
from mmrl.vlm.methods.vppo import shape_advantages, visual_dependency

ROOT = Path(__file__).resolve().parents[2]


def test_visual_dependency_by_hand():
    """d = 0 -> 0; d = 1 -> e - 2 = 0.7183; d = -1 -> 1/e = 0.3679; d = 4 -> e^4 - 5 = 49.6,
    clamped to 10; off the mask 0."""
    logp = torch.zeros((1, 5))
    aug = torch.tensor([[0.0, 1.0, -1.0, 4.0, 3.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    s = visual_dependency(aug, logp, mask)
    torch.testing.assert_close(s, torch.tensor([[0.0, math.e - 2, 1 / math.e, 10.0, 0.0]]))


def test_shape_advantages_by_hand():
    """Sample 0: s = 0..4 (mean 2), sample 1: s = 0 (mean 0) -> n = [1, 0], mean(n) = 0.5,
    scale = 0.9 + n * 0.1 / 0.5 = [1.1, 0.9]. Top 40% of 5 tokens = 2: sample 0 keeps
    tokens 3 and 4 (A = 1.1 there), sample 1 keeps two of its tied tokens (A = -0.9)."""
    adv = torch.tensor([1.0, -1.0])
    s = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 0.0], [0.0] * 6])
    mask = torch.tensor([[True] * 5 + [False], [True] * 5 + [False]])
    out = shape_advantages(adv, s, mask)
    torch.testing.assert_close(out[0], torch.tensor([0.0, 0.0, 0.0, 1.1, 1.1, 0.0]))
    assert int((out[1] != 0).sum()) == 2 and torch.allclose(out[1][out[1] != 0], torch.tensor(-0.9))
    assert not bool((out[:, 5] != 0).any())  # padding never trains


def test_vppo_config_runs_a_step(qwen25_dir, tmp_path, reward_spread, one_thread):
    cfg = load_config(backend.CONFIG_CLASS, ROOT / "configs" / "vlm" / "vppo.yaml", [
        f"model.path={qwen25_dir}", f"output_dir={tmp_path}", "train.max_steps=1", "task.num_train=8",
        "task.num_eval=2", "rollout.eval_samples=0", "rollout.prompts_per_step=2", "rollout.num_generations=4",
        "rollout.max_new_tokens=8", "method.dynamic_sampling.enabled=false", "logging.progress=false",
        "logging.tensorboard=false"], defaults=backend.DEFAULT_CONFIG)
    policy, task = backend.build(cfg)
    before = {k: v.detach().clone() for k, v in policy.model.named_parameters()}
    Trainer(cfg, policy, task, backend=backend).train()
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert row["vppo/visual_dependency"] > 0 and math.isfinite(row["loss/total"])
    assert any(not torch.equal(v, before[k]) for k, v in policy.model.named_parameters())


def test_vppo_refuses_engines_beside_the_trainer(qwen25_dir, tmp_path):
    import pytest

    from mmrl.core.config import ConfigError

    cfg = load_config(backend.CONFIG_CLASS, ROOT / "configs" / "vlm" / "vppo.yaml", [
        f"model.path={qwen25_dir}", f"output_dir={tmp_path}", "rollout.scheduler.mode=pipelined",
        "task.num_train=8", "task.num_eval=2"], defaults=backend.DEFAULT_CONFIG)
    policy, task = backend.build(cfg)
    with pytest.raises(ConfigError, match="re-scores rollouts"):
        Trainer(cfg, policy, task, backend=backend)


def test_visual_dependency_clamps_at_the_given_cap():
    """cap 0.5: d = 1 -> e - 2 = 0.718 and d = 4 -> e^4 - 5 both clamp to 0.5; d = -1 -> 1/e = 0.368 stays."""
    s = visual_dependency(torch.tensor([[1.0, 4.0, -1.0]]), torch.zeros((1, 3)), torch.ones((1, 3), dtype=torch.bool),
                          cap=0.5)
    torch.testing.assert_close(s, torch.tensor([[0.5, 0.5, 1 / math.e]]))


def test_shape_advantages_reads_only_the_masked_tokens():
    """Padding dependencies count neither in the means nor in the top-k, and a response with no
    tokens is left out of the normalisation (as VPPO's code). Means over the mask: [(1 + 3 + 0) / 3,
    0] -> n = [1, 0], mean(n) = 1/2, scale = 0.9 + n * 0.1 * 2 = [1.1, 0.9]. k = ceil(0.4 * 3) = 2 of the 3 tokens (not 1):
    sample 0 keeps s = 3 and s = 1; sample 1 two of its three tied tokens, never its padding."""
    adv = torch.tensor([1.0, -1.0, 1.0])
    s = torch.tensor([[1.0, 3.0, 0.0, 9.0], [0.0, 0.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, False], [False] * 4])
    out = shape_advantages(adv, s, mask)
    torch.testing.assert_close(out[0], torch.tensor([1.1, 1.1, 0.0, 0.0]))
    assert float(out[1, 3]) == 0.0 and int((out[1] != 0).sum()) == 2
    torch.testing.assert_close(out[1][out[1] != 0], torch.tensor([-0.9, -0.9]))
    assert not bool(out[2].any())


def test_shape_advantages_equal_dependencies_leave_the_advantages_unscaled():
    """Every response as visually dependent as the others: n = 0 everywhere, so the scale is 1
    (not beta_min); top_frac 1 keeps every response token."""
    adv = torch.tensor([2.0, -1.0])
    s = torch.ones((2, 3))
    mask = torch.ones((2, 3), dtype=torch.bool)
    torch.testing.assert_close(shape_advantages(adv, s, mask, top_frac=1.0), torch.tensor([[2.0] * 3, [-1.0] * 3]))


def _vppo(tmp_path, extra=()):
    from mmrl.vlm.methods.vppo import VPPO

    cfg = load_config(backend.CONFIG_CLASS, ROOT / "configs" / "vlm" / "vppo.yaml", [
        f"output_dir={tmp_path}", *extra], defaults=backend.DEFAULT_CONFIG)
    return VPPO(cfg.method, cfg, None)


def test_mask_p_0_is_refused_where_the_patches_are_masked(tmp_path):
    """mask_p 0 re-scored the image unchanged: every visual dependency 0 (logged so) and the method
    shaped and filtered by nothing. With intervention blur mask_p is not read, so 0 runs there (with
    the warning that says so)."""
    from mmrl.core.config import ConfigError

    for config in ("vppo", "pacg", "pacg_vppo"):
        with pytest.raises(ConfigError, match=r"invalid config: method: mask_p 0 blacks out no patch"):
            load_config(backend.CONFIG_CLASS, ROOT / "configs" / "vlm" / f"{config}.yaml",
                        [f"output_dir={tmp_path}", "method.mask_p=0"], defaults=backend.DEFAULT_CONFIG)
    with pytest.warns(UserWarning, match="method.mask_p 0.0 unused with method.intervention blur"):  # said, not read
        assert _vppo(tmp_path, ["method.mask_p=0", "method.intervention=blur"]).cfg.mask_p == 0
    assert _vppo(tmp_path, ["method.mask_p=1"]).cfg.mask_p == 1


def _image_batch(group_ids, t=3):
    from mmrl.core.batch import RolloutBatch
    from mmrl.core.rewards import Sample

    n = len(group_ids)
    return RolloutBatch(group_ids=torch.tensor(group_ids), samples=[Sample("q", "a")] * n,
                        mask=torch.ones((n, t), dtype=torch.bool), old_logp=torch.zeros((n, t)),
                        data={"pixel_values": torch.ones((n, 4, 6)),
                              "image_grid_thw": torch.tensor([[[1, 2, 2]]] * n)})


class _ScriptedPolicy:
    """What VPPO's re-scoring pass reads of a policy: the image processor, and rescore (here
    it hands back the pixels it was given)."""

    def __init__(self):
        from types import SimpleNamespace

        self.processor = SimpleNamespace(image_processor=SimpleNamespace(
            image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], merge_size=1, patch_size=1))

    def rescore(self, batch, pixels):
        return pixels


def test_the_masked_pass_uses_mask_p_and_a_generator_seeded_by_run_and_first_group(tmp_path, monkeypatch):
    """seed 7, groups 4 and 5: the draw's seed is 7 * 1_000_003 + 4 (the smallest group id), p = mask_p."""
    from mmrl.vlm.methods import vppo

    seen = {}

    def fake_mask(pixels, grid, *, p, fill, generator):
        seen.update(p=p, seed=generator.initial_seed())
        return pixels + 1

    def no_blur(*args, **kwargs):
        raise AssertionError("intervention mask does not blur")

    monkeypatch.setattr(vppo, "mask_patches", fake_mask)
    monkeypatch.setattr(vppo, "blur", no_blur)
    method = _vppo(tmp_path, ["seed=7", "method.mask_p=0.3"])
    out = method.intervened_logp(_ScriptedPolicy(), _image_batch([5, 4, 4, 5]))
    assert seen == {"p": 0.3, "seed": 7 * 1_000_003 + 4}
    assert bool((out == 2).all())  # the masked pixels went to rescore


def test_the_blur_intervention_blurs_with_blur_sigma(tmp_path, monkeypatch):
    from mmrl.vlm.methods import vppo

    seen = {}

    def fake_blur(pixels, grid, *, merge, patch, sigma):
        seen.update(merge=merge, patch=patch, sigma=sigma)
        return pixels * 3

    def no_mask(*args, **kwargs):
        raise AssertionError("intervention blur masks no patches")

    monkeypatch.setattr(vppo, "blur", fake_blur)
    monkeypatch.setattr(vppo, "mask_patches", no_mask)
    method = _vppo(tmp_path, ["method.intervention=blur", "method.blur_sigma=2.5"])
    out = method.intervened_logp(_ScriptedPolicy(), _image_batch([0, 0]))
    assert seen == {"merge": 1, "patch": 1, "sigma": 2.5} and bool((out == 3).all())


def test_a_batch_without_images_is_not_rescored(tmp_path):
    batch = _image_batch([0, 0])
    batch.data["image_grid_thw"] = torch.zeros((2, 1, 3), dtype=torch.long)
    method = _vppo(tmp_path)
    assert method.intervened_logp(None, batch) is None  # the policy is never asked
    method.annotate(None, batch)
    assert "visual_dependency" not in batch.data


def test_annotate_dependency_of_the_intervened_pass_against_the_rollout_with_the_configured_cap(tmp_path):
    """d = logp_aug - old_logp = [1, -1, 0] -> s = [min(e - 2, 0.5), 1/e, 0] with method.cap 0.5."""
    method = _vppo(tmp_path, ["method.cap=0.5"])
    batch = _image_batch([0])
    method.intervened_logp = lambda policy, b: torch.tensor([[1.0, -1.0, 0.0]])
    method.annotate(None, batch)
    torch.testing.assert_close(batch.data["visual_dependency"], torch.tensor([[0.5, 1 / math.e, 0.0]]))


def test_vppo_advantages_use_the_configured_beta_min_and_top_frac(tmp_path):
    """Rewards [1, 0] in one group -> A = +-0.5 / std = +-0.7071. Mean dependencies [0.5, 0] ->
    n = [1, 0], mean 0.5 -> scale = 0.5 + n * 0.5 / 0.5 = [1.5, 0.5] (beta_min 0.5); top_frac
    0.25 of 4 tokens keeps 1: sample 0 its s = 2 token, sample 1 one of its tied ones."""
    from mmrl.core.rewards import AtomScores

    method = _vppo(tmp_path, ["method.beta_min=0.5", "method.top_frac=0.25"])
    batch = _image_batch([0, 0], t=4)
    batch.scores = AtomScores(names=["answer"], values=torch.tensor([[1.0], [0.0]]), total=torch.tensor([1.0, 0.0]))
    batch.data["visual_dependency"] = torch.tensor([[0.0, 2.0, 0.0, 0.0], [0.0] * 4])
    adv = method.advantages(batch)
    a = 1 / math.sqrt(2)
    torch.testing.assert_close(adv[0], torch.tensor([0.0, 1.5 * a, 0.0, 0.0]), atol=1e-5, rtol=0)
    assert int((adv[1] != 0).sum()) == 1
    torch.testing.assert_close(adv[1].sum(), torch.tensor(-0.5 * a), atol=1e-5, rtol=0)


def test_vppo_metric_is_the_mean_dependency_over_response_tokens(tmp_path):
    """(1 + 3 + 2) / 3 tokens = 2; the padding's 9 and its slot do not count."""
    batch = _image_batch([0, 0], t=2)
    batch.mask = torch.tensor([[True, True], [True, False]])
    batch.data["visual_dependency"] = torch.tensor([[1.0, 3.0], [2.0, 9.0]])
    assert _vppo(tmp_path).batch_metrics(batch) == {"vppo/visual_dependency": 2.0}
