"""The method hooks of the one loop, and the registry that builds a method from its config.

A method changes what the loop does at these points (the loop: mmrl/core/trainer.py):
    keep_groups     which complete groups train (DAPO's dynamic sampling drops some;
                    the scheduler refills)
    extra_requests  more samples for a complete group (AXPO: continuations of a fixed prefix)
    on_groups       reshape a synchronous round's batch before advantages
    stored_batch    a batch to train on without rolling out this step (FTFC's frozen pool)
    annotate        extra no-grad passes of the rollout policy before advantages (VPPO)
    annotate_reference  the reference pass after pruning (the KL's log-probs by default)
    advantages      [N], [N, T] or per region
    prune           drop samples of a complete group before training (FastRL's MDAP)
    group_size      the group size G of each data epoch (FastRL's adaptive rollout sampling)
    state_dict      the method's running state, saved with checkpoints (FastRL's statistics)
    weight_average  a moving average of the weights for evaluation (Flow-GRPO's EMA)
    loss            the differentiable objective of a (micro-)batch
The group hooks run in the scheduler for every modality and both scheduler modes;
in pipelined mode keep_groups, extra_requests, advantages and prune see one group.
Everything else (rollout, reward, optimizer, checkpoints, logging) is the core's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from mmrl.core.batch import SAMPLE_WEIGHT, RolloutBatch
from mmrl.core.config import TrainConfig
from mmrl.core.engine import Request
from mmrl.core.losses import LossOutput
from mmrl.core.rewards import Reward


def apply_prune(batch: RolloutBatch, keep: Tensor) -> RolloutBatch:
    """The batch after `Method.prune`'s answer for its rows: bool [N] selects; float [N]
    weights select the rows with w > 0 and multiply their loss weight
    (batch.data[SAMPLE_WEIGHT], 1 where unset) by w."""
    if keep.dtype != torch.bool:
        weight = batch.data.get(SAMPLE_WEIGHT, torch.ones(len(batch)))
        batch = replace(batch, data={**batch.data, SAMPLE_WEIGHT: weight * keep.float()})
        keep = keep > 0
    return batch if bool(keep.all()) else batch.select(keep)


class Method:
    """Base class: the identity hooks. Subclasses override what they change."""

    needs_reference: bool = False
    """True when loss() reads batch.ref_logp (the loop then builds a frozen reference)."""

    reference = None
    """That frozen reference (the starting weights), set by the trainer when needs_reference:
    for a method whose loss runs it itself (FTFC's anchor)."""

    count_metrics: tuple[str, ...] = ()
    """The keys of batch_metrics() that count what a rank did (rows, resamples): with several
    processes the step's value is their sum, where other metrics are averaged."""

    epoch: int = 0
    """The pass over the current rollout batch (0 .. train.ppo_epochs - 1), set by the trainer
    before each pass: diffu-GRPO draws a different prompt mask for each."""

    step: int = 0
    """Rollout-and-update steps done so far (0 .. train.max_steps - 1 during a step), set by
    the trainer as each step begins: FastRL's adaptive group size weighs by step / max_steps."""

    def __init__(self, cfg, run: TrainConfig, reward: Reward):
        self.cfg = cfg  # this method's section (run.method)
        self.run = run
        self.reward = reward  # the run's reward; its atoms are the columns of batch.scores

    def keep_groups(self, batch: RolloutBatch) -> Tensor | None:
        """Bool [N]: samples whose group may train; None keeps all."""
        return None

    def on_groups(self, batch: RolloutBatch) -> RolloutBatch:
        return batch

    def stored_batch(self) -> RolloutBatch | None:
        """A batch to train on this step in place of a rollout (FTFC's frozen pool when it
        does not monitor the current model): the synchronous scheduler then draws no prompts
        and runs no rollout, only annotate, advantages, prune and the reference pass. None
        (the default) rolls out as usual. Synchronous inline scheduling only."""
        return None

    def extra_requests(self, group: RolloutBatch) -> list[Request]:
        """Requests for more samples of this complete, scored group (same group id; a
        non-zero `tag` tells them apart in batch.data["request_tag"]). Asked once per
        group; the group trains when they are back, scored like the rest. The group's
        prompt object is group.prompts[group id]."""
        return []

    def annotate(self, policy, batch: RolloutBatch) -> None:
        """Extra no-grad passes of the policy that made the rollouts, before advantages, into
        batch.data (VPPO re-scores each response under a masked image). Synchronous
        scheduling only for now: the pipelined scheduler refuses a method that overrides it."""

    def advantages(self, batch: RolloutBatch) -> Tensor:
        raise NotImplementedError

    def annotate_reference(self, reference, batch: RolloutBatch) -> None:
        """The no-grad reference pass over a batch about to train (needs_reference only): by
        default what the KL needs (mmrl.core.scheduler.annotate_reference)."""
        from mmrl.core.scheduler import annotate_reference

        annotate_reference(reference, batch)

    def prune(self, group: RolloutBatch) -> Tensor | None:
        """Over one complete group with advantages: bool [N], the samples that train; or
        float [N] weights, 0 dropping a sample and w > 0 keeping it to count w times in the
        loss (`apply_prune`; the method's loss reads batch.data[SAMPLE_WEIGHT]). None keeps all."""
        return None

    def group_size(self, epoch: int, current: int) -> int:
        """G for data epoch `epoch` (called as each epoch's first prompt is drawn; `current`
        is the size so far). The scheduler saves it with the checkpoint."""
        return current

    def weight_average(self, params: list) -> object | None:
        """A moving average of the trainable weights that evaluation and checkpoints use
        (Flow-GRPO's EMA; see mmrl.core.trainer for its interface); None = none."""
        return None

    def batch_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        """The method's own metrics of a trained batch (e.g. AXPO's resamples), logged each step."""
        return {}

    def loss_denominator(self, batch: RolloutBatch) -> float | None:
        """Normaliser of a whole mini-batch, so micro-batch losses sum to its loss. It must
        add over groups (a token or sample count): pipelined training sums it group by group."""
        return None

    def loss(self, policy, batch: RolloutBatch, advantages: Tensor, denom: float | None = None) -> LossOutput:
        raise NotImplementedError

    def state_dict(self) -> dict:
        """The method's own running state (plain JSON), saved in the trainer state of every
        checkpoint so that a resumed run continues exactly (FastRL's kept-count statistics)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned ({} for a checkpoint written without any)."""


METHODS: dict[str, Callable[..., Method]] = {}


BUILT_IN = ("mmrl.", "dllm_rl.", "diffusion_rl.")  # the packages whose methods a plugin may not replace


def register_method(name: str):
    """Class decorator: `@register_method("grpo")` makes `method.type: grpo` build this class.
    A name a built-in method has is refused to other modules: a config naming it would run
    something else without a word."""

    def wrap(cls):
        old = METHODS.get(name)
        if old is not None and old.__module__ != cls.__module__:
            built_in, plugin = (old, cls) if old.__module__.startswith(BUILT_IN) else (cls, old)
            # either order: a plugin imported before its backend's methods was replaced by the
            # built-in without a word, and the config ran the built-in
            if built_in.__module__.startswith(BUILT_IN) and not plugin.__module__.startswith(BUILT_IN):
                raise ValueError(f"method {name!r} is built in ({built_in.__module__}.{built_in.__qualname__}): "
                                 f"register {plugin.__qualname__} (in {plugin.__module__}) under a name of its own")
        METHODS[name] = cls
        return cls

    return wrap


def checked_advantages(method: Method, batch: RolloutBatch) -> Tensor:
    """method.advantages(batch), refused with a MethodError naming the method where it is not a
    tensor of finite values: a NaN would only skip every update with a warning, and a list
    or a row too few fail deep inside the loop without naming the method."""
    adv = method.advantages(batch)
    where = f"{type(method).__qualname__}.advantages"
    if not isinstance(adv, Tensor):
        raise _method_error(f"{where} returned a {type(adv).__name__}; it must return a tensor "
                            f"[N], [N, T] or [N, regions] (N = {len(batch)} samples)")
    if adv.dim() == 0 or adv.shape[0] != len(batch):
        raise _method_error(f"{where} returned shape {tuple(adv.shape)}; it must have one row per sample "
                            f"(N = {len(batch)}): [N], [N, T] or [N, regions]")
    if adv.is_floating_point() and not bool(torch.isfinite(adv).all()):
        rows = (~torch.isfinite(adv.reshape(len(adv), -1))).any(dim=1).nonzero().flatten().tolist()
        more = " ..." if len(rows) > 8 else ""
        raise _method_error(f"{where} returned non-finite values (NaN or inf) in {len(rows)} of {len(adv)} rows "
                            f"({rows[:8]}{more})")
    return adv


def checked_loss(method: Method, out) -> LossOutput:
    """method.loss's answer, refused with a MethodError naming the method where backward()
    cannot run on it: not a LossOutput, or a .loss that is not a one-element tensor with a
    gradient (a Python float, a detached tensor, a per-sample vector)."""
    where = f"{type(method).__qualname__}.loss"
    want = "it must return a LossOutput(loss, metrics) whose .loss is a scalar tensor with a gradient"
    if not isinstance(out, LossOutput):
        raise _method_error(f"{where} returned a {type(out).__name__}; {want}")
    loss = out.loss
    if not isinstance(loss, Tensor):
        raise _method_error(f"{where} returned a LossOutput whose .loss is a {type(loss).__name__}; {want}")
    if loss.numel() != 1:
        raise _method_error(f"{where} returned a .loss of shape {tuple(loss.shape)}; {want} (reduce it, "
                            "e.g. with .mean())")
    if not loss.requires_grad:
        raise _method_error(f"{where} returned a .loss without a gradient (detached, or computed under "
                            f"torch.no_grad); {want}")
    return out


def _method_error(message: str) -> Exception:
    from mmrl.core.trainer import MethodError  # the trainer imports this module

    return MethodError(message)


def build_method(run: TrainConfig, reward: Reward) -> Method:
    import mmrl.core.grpo  # noqa: F401  (registers the GRPO family)

    name = run.method.type
    if name not in METHODS:
        raise ValueError(f"method {name!r} is not available (known: {', '.join(sorted(METHODS))})")
    return METHODS[name](run.method, run, reward)
