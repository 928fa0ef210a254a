"""Shared by the diffusion tests: one torch thread in every test (tests/conftest.py), and one
tiny random FLUX-style pixel-space model for the whole session (read only: runs write elsewhere)."""

from types import SimpleNamespace

import pytest
import torch

from diffusion_rl import backend
from diffusion_rl.methods import cast as cast_module
from diffusion_rl.models import build_tiny
from mmrl.core.config import load_config


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="session")
def flux_dir(tmp_path_factory):
    return build_tiny("flux", tmp_path_factory.mktemp("flux"), seed=0, pixel_space=True)


def _flat_grads(model, out):
    """The flat gradient of a loss output over the model's parameters that get one."""
    model.zero_grad()
    out.loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.fixture
def flat_grads():
    """flat_grads(model, loss output) -> the flat gradient (the model's grads zeroed first)."""
    return _flat_grads


@pytest.fixture
def varied_verdicts(monkeypatch):
    """The tiny random model draws no shapes: alternate the verdict of each prompt's first atom
    (CAST's per-atom columns, method.atoms: nodes) so that the groups have advantages to train."""
    from diffusion_rl.tasks.shapes_geneval import parse_prompt

    calls = iter(range(10**6))

    def verdicts(image, prompt):
        return {a.name: float(j == 0 and next(calls) % 2 == 0) for j, a in enumerate(parse_prompt(prompt))}

    monkeypatch.setattr(cast_module, "cached_score_image", verdicts)


@pytest.fixture
def node_cast(flux_dir, tmp_path, varied_verdicts):
    """make(*overrides): a CAST (method.atoms: nodes) rollout of 2 prompts x 2 on the tiny model,
    with its advantages; grads(loss output) -> the flat gradient, and flow_grpo, Flow-GRPO's."""
    from diffusion_rl.methods.flow_grpo import FlowGRPO

    def make(*overrides):
        cfg = load_config(backend.CONFIG_CLASS, None, defaults=backend.DEFAULT_CONFIG,
                          overrides=[f"model.path={flux_dir}", f"output_dir={tmp_path / 'run'}", "method.type=cast",
                                     "method.atoms=nodes", "rollout.num_steps=4", "rollout.window_size=2",
                                     "rollout.window_start=[0,1]", "task.num_train=16", "task.num_eval=2", *overrides])
        policy, task = backend.build(cfg)
        batch = policy.generate(task.train[:2], 2, cfg.rollout, torch.Generator().manual_seed(0))
        batch.scores = task.reward.score(batch.samples)
        method = cast_module.CAST(cfg.method, cfg, task.reward)
        adv = method.advantages(batch)

        def grads(out):
            return _flat_grads(policy.model, out)

        flow_grpo = grads(FlowGRPO(cfg.method, cfg, task.reward).loss(policy, batch, adv))
        return SimpleNamespace(cfg=cfg, policy=policy, task=task, batch=batch, method=method, adv=adv,
                               grads=grads, flow_grpo=flow_grpo)

    return make
