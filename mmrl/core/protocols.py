"""What a backend hands the core loop: a policy and a task.

The core never imports a backend. A backend implements these two protocols
(structural typing: no base class to inherit) and passes them to
`mmrl.core.trainer.Trainer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from mmrl.core.batch import RolloutBatch
from mmrl.core.config import RolloutConfig
from mmrl.core.rewards import Reward


@runtime_checkable
class Policy(Protocol):
    model: torch.nn.Module
    """Holds every trainable parameter (requires_grad=True); the optimizer takes those."""

    def generate(
        self,
        prompts: Sequence[Any],
        num_generations: int,
        rollout: RolloutConfig,
        generator: torch.Generator,
    ) -> RolloutBatch:
        """`num_generations` samples per prompt, rows of one prompt contiguous.

        Fills samples, mask, old_logp (from the rollout itself where that is
        exact) and data; group_ids are 0..len(prompts)-1 (the scheduler relabels
        them). Draws randomness only from `generator`, so runs are reproducible.
        """
        ...

    def logprobs(self, batch: RolloutBatch) -> Tensor:
        """[N, T] log-probs of the batch's samples under the current weights, with grad."""
        ...

    def save_pretrained(self, path: str | Path) -> None:
        """Weights as safetensors in from_pretrained layout."""
        ...

    def load_weights(self, path: str | Path) -> None:
        """Load weights written by save_pretrained into this policy, in place."""
        ...

    def reference(self) -> Policy:
        """A frozen copy of the current weights (the KL reference). Called only when beta > 0."""
        ...


@runtime_checkable
class Task(Protocol):
    name: str
    reward: Reward

    def train_prompts(self) -> Sequence[Any]:
        """The training prompts; the scheduler draws them in a seeded order."""
        ...

    def evaluate(self, policy: Policy) -> dict[str, float]:
        """Held-out metrics of `policy` (greedy or seeded with its own generator)."""
        ...
