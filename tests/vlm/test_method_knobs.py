"""VLM method settings at their edges: a setting the method does not read under the others is
said (a warning), not silently ignored; the bundled configs, and settings that are read, say nothing."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from mmrl.core.config import load_config
from mmrl.vlm import backend

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "vlm"


def _load(config, overrides):
    return load_config(backend.CONFIG_CLASS, CONFIGS / config, overrides, defaults=backend.DEFAULT_CONFIG)


@pytest.mark.parametrize("config, overrides, said", [
    ("vppo.yaml", ["method.intervention=blur", "method.mask_p=0.3"],
     r"method.mask_p 0.3 unused with method.intervention blur: the whole image is blurred"),
    ("vppo.yaml", ["method.blur_sigma=2"], r"method.blur_sigma 2.0 unused with method.intervention mask"),
    ("pacg.yaml", ["method.top_frac=0.1", "method.cap=5"],
     (r"method.top_frac 0.1, method.cap 5.0 unused with method.base dapo: VPPO's advantage shaping and token "
      r"filter run only with base vppo")),
    ("axpo.yaml", ["method.resample.budget=0", "method.resample.force_call=true"],
     r"method.resample.force_call True unused with method.resample.budget 0: nothing is resampled"),
    ("cora.yaml", ["method.beta=0", "method.warmup_steps=50"],
     r"method.warmup_steps 50 unused with method.beta 0: there is no consistency weight to warm up"),
    ("cora.yaml", ["method.warmup_steps=1000"],
     (r"method.warmup_steps 1000 is not shorter than the run \(train.max_steps 500\): the consistency weight "
      r"rises to 0.0998 at most, never method.beta 0.2")),  # 0.2 x 499 / 1000
    ("dspo.yaml", ["method.div_weight=0", "method.tau_div=0.1"],
     r"method.tau_div 0.1 unused with method.div_weight 0: each shapes R_div"),
    ("axpo.yaml", ["method.dynamic_sampling.enabled=true"],
     (r"method.dynamic_sampling drops a group whose rewards are all equal before AXPO looks at it: a group whose "
      r"rollouts are all wrong \(and score alike\) is dropped, never resampled")),
], ids=["vppo-mask_p-with-blur", "vppo-blur_sigma-with-mask", "pacg-vppo-shaping-on-dapo", "axpo-no-budget",
        "cora-no-beta", "cora-warmup-past-the-run", "dspo-no-div-weight", "axpo-dynamic-sampling"])
def test_settings_their_method_does_not_read_are_said_to_be_unused(config, overrides, said):
    with pytest.warns(UserWarning, match=said) as record:
        _load(config, overrides)
    assert [w.filename for w in record] == [__file__]  # the caller's line, not the validator's


@pytest.mark.parametrize("config, overrides", [
    *[(p.name, []) for p in sorted(CONFIGS.glob("*.yaml"))],
    ("vppo.yaml", ["method.intervention=blur", "method.blur_sigma=2"]),
    ("pacg_vppo.yaml", ["method.top_frac=0.1", "method.beta_min=0.5", "method.cap=5"]),
    ("axpo.yaml", ["method.resample.budget=0"]),
    ("axpo.yaml", ["method.resample.budget=0", "method.dynamic_sampling.enabled=true"]),  # GRPO-like: DAPO's rule
    ("axpo.yaml", ["method.resample.k=4", "method.resample.force_call=true"]),
    ("cora.yaml", ["method.beta=0"]),
    ("cora.yaml", ["method.warmup_steps=50"]),
    ("cora.yaml", ["train.max_steps=2"]),  # the default warm-up in a short (smoke) run
    ("dspo.yaml", ["method.div_weight=0"]),
    ("dspo.yaml", ["method.tau=0.1", "method.tau_div=0.1"]),
])
def test_settings_that_are_read_say_nothing(config, overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _load(config, overrides)


@pytest.mark.parametrize("task", ["shapes-qa", "shapes-zoom"])
def test_dspo_on_a_task_without_mood_responses_is_refused(task):
    """DSPO on shapes-qa ran as GRPO: no response is in its template, so R_cf = R_div = 0 for all
    (dspo/cvig_scored 0), at the cost of CVIG's passes."""
    from mmrl.core.config import ConfigError

    with pytest.raises(ConfigError, match=rf"method.type dspo scores shapes-mood's responses .*task.type {task} has "
                                          r"none, so every R_cf and R_div would be 0"):
        _load("grpo.yaml", ["method.type=dspo", f"task.type={task}"])
    assert _load("dspo.yaml", []).task.type == "shapes-mood"


def test_a_blur_too_narrow_to_change_the_image_is_refused():
    """blur_sigma 1e-6 left the image as it was (vppo/visual_dependency exactly 0, as with mask_p 0):
    refused under intervention blur, with the bound; unread (and allowed) under mask."""

    from mmrl.core.config import ConfigError
    from mmrl.vlm.interventions import gaussian_blur

    image = torch.rand(1, 8, 8)
    assert torch.equal(gaussian_blur(image, 0.1), image)  # the identity in float32
    assert not torch.equal(gaussian_blur(image, 0.2), image)
    for sigma in (1e-6, 0.1):
        with pytest.raises(ConfigError, match=rf"method: blur_sigma {sigma} blurs nothing .*every token's visual "
                                              r"dependency is 0; give blur_sigma >= 0.2 pixels"):
            _load("vppo.yaml", ["method.intervention=blur", f"method.blur_sigma={sigma}"])
    assert _load("pacg.yaml", ["method.intervention=blur", "method.blur_sigma=0.2"]).method.blur_sigma == 0.2
    with pytest.warns(UserWarning, match="blur_sigma 0.1 unused with method.intervention mask"):
        _load("vppo.yaml", ["method.blur_sigma=0.1"])


def test_edge_values_that_make_vppo_and_pacg_their_base_method():
    """beta_min 1 and top_frac 1 leave VPPO's advantages as DAPO's on every response token; eta 0,
    g_min 1 or an unreachable z0 gate no claim (PACG = its base). Runs of configs/vlm/vppo.yaml and
    pacg.yaml so set gave dapo.yaml's per-step losses exactly."""
    from mmrl.vlm.methods.pacg import pacg_gate
    from mmrl.vlm.methods.vppo import shape_advantages

    gen = torch.Generator().manual_seed(0)
    adv = torch.tensor([0.7, -0.7, 1.2])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    s = torch.rand(3, 4, generator=gen) * mask
    torch.testing.assert_close(shape_advantages(adv, s, mask, beta_min=1.0, top_frac=1.0), adv[:, None] * mask)
    full = adv[:, None].expand(3, 4).clone()
    claim_ids = torch.tensor([[0, 0, 1, -1], [0, 0, -1, -1], [0, 1, 1, 2]])
    index = torch.tensor([[0, 0], [0, 1], [1, 0], [2, 0], [2, 1], [2, 2]])
    persistence = torch.tensor([0.99, 0.1, 0.2, 0.15, 0.1, 0.12])  # claim (0, 0) stands out: z ~ 2
    gated, _ = pacg_gate(full, persistence, index, claim_ids, z0=1.0, eta=0.5, g_min=0.5)
    assert not torch.equal(gated, full)  # the defaults gate it
    for z0, eta, g_min in ((1.0, 0.0, 0.5), (1.0, 0.5, 1.0), (1e9, 0.5, 0.5)):
        out, gates = pacg_gate(full, persistence, index, claim_ids, z0=z0, eta=eta, g_min=g_min)
        assert torch.equal(out, full) and bool((gates == 1).all())
