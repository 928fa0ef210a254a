"""The method hooks of the one loop, and the registry that builds a method from its config.

A method changes what the loop does at three points (DESIGN.md, "The loop"):
    keep_groups   which complete groups train (DAPO's dynamic sampling drops some;
                  the scheduler refills)
    on_groups     reshape the batch before advantages (resample, prune)
    advantages    [N], [N, T] or per region
    loss          the differentiable objective of a (micro-)batch
Everything else (rollout, reward, optimizer, checkpoints, logging) is the core's.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from mmrl.core.batch import RolloutBatch
from mmrl.core.config import TrainConfig
from mmrl.core.losses import LossOutput
from mmrl.core.rewards import Reward


class Method:
    """Base class: the identity hooks. Subclasses override what they change."""

    needs_reference: bool = False
    """True when loss() reads batch.ref_logp (the loop then builds a frozen reference)."""

    def __init__(self, cfg, run: TrainConfig, reward: Reward):
        self.cfg = cfg  # this method's section (run.method)
        self.run = run
        self.reward = reward  # the run's reward; its atoms are the columns of batch.scores

    def keep_groups(self, batch: RolloutBatch) -> Tensor | None:
        """Bool [N]: samples whose group may train; None keeps all."""
        return None

    def on_groups(self, batch: RolloutBatch) -> RolloutBatch:
        return batch

    def advantages(self, batch: RolloutBatch) -> Tensor:
        raise NotImplementedError

    def loss_denominator(self, batch: RolloutBatch) -> float | None:
        """Normaliser of a whole mini-batch, so micro-batch losses sum to its loss."""
        return None

    def loss(self, policy, batch: RolloutBatch, advantages: Tensor, denom: float | None = None) -> LossOutput:
        raise NotImplementedError


METHODS: dict[str, Callable[..., Method]] = {}


def register_method(name: str):
    """Class decorator: `@register_method("grpo")` makes `method.type: grpo` build this class."""

    def wrap(cls):
        METHODS[name] = cls
        return cls

    return wrap


def build_method(run: TrainConfig, reward: Reward) -> Method:
    import mmrl.core.grpo  # noqa: F401  (registers the GRPO family)

    name = run.method.type
    if name not in METHODS:
        raise ValueError(f"method {name!r} is not available (known: {', '.join(sorted(METHODS))})")
    return METHODS[name](run.method, run, reward)
