"""An exponential moving average (EMA) of the trainable weights, as Flow-GRPO keeps one.

Flow-GRPO (yifan123/flow_grpo, `flow_grpo/ema.py`, `scripts/train_sd3.py`) averages the
trainable parameters while training, evaluates and draws its evaluation images with the
average swapped in, and saves the average as the checkpoint; rollouts and gradients always
use the raw weights. Its setting is decay 0.9, one update every 8 optimizer steps, and a
warm-up that lowers the decay early on:

    after optimizer step n (n = 1, 2, ...), when n % update_every == 0:
        d_n     = min(decay, (1 + n) / (10 + n))      (d_n = decay with warmup=False)
        avg    <- avg + (1 - d_n) * (theta - avg)     (= d_n avg + (1 - d_n) theta)

The average starts at the weights it is built from. The core trainer (mmrl.core.trainer)
drives it through four calls: `update(params)` after every optimizer step, `applied(params)`
around evaluation and around writing a checkpoint's model, and `state_dict()` /
`load_state_dict()` for the rest of the checkpoint. Nothing here is specific to images.

Departures from Flow-GRPO: it calls its update once per training micro-batch with the
optimizer-step count, so under gradient accumulation one optimizer step may update the
average several times, and its first update falls after step update_every - 1; here the
average moves exactly once per `update_every` optimizer steps. The swapped-out raw
weights are kept on the CPU during evaluation, as Flow-GRPO does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor


def ema_decay(n: int, decay: float, warmup: bool = True) -> float:
    """The decay of the update after optimizer step n (1-based): min(decay, (1 + n) / (10 + n))
    with Flow-GRPO's warm-up, else `decay`."""
    return min(decay, (1 + n) / (10 + n)) if warmup else decay


class ParameterEMA:
    """EMA of a fixed list of parameters (the trainer's trainable ones, in its order).

    decay: in (0, 1); update_every: optimizer steps per update (>= 1); warmup: Flow-GRPO's
    lower decay early in training (see `ema_decay`). The average has each parameter's
    dtype and device."""

    def __init__(self, params: Sequence[Tensor], decay: float = 0.9, update_every: int = 8,
                 warmup: bool = True):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        if update_every < 1:
            raise ValueError(f"EMA update_every must be >= 1, got {update_every}")
        self.decay = float(decay)
        self.update_every = int(update_every)
        self.warmup = bool(warmup)
        self.average = [p.detach().clone() for p in params]
        self.steps = 0  # optimizer steps seen

    @torch.no_grad()
    def update(self, params: Sequence[Tensor]) -> bool:
        """Count one optimizer step; move the average toward `params` on every update_every-th.
        Returns whether it moved. Parameters of another count are refused on every step, before
        the step is counted."""
        params = _checked(self.average, params)
        self.steps += 1
        if self.steps % self.update_every:
            return False
        d = ema_decay(self.steps, self.decay, self.warmup)
        for avg, p in zip(self.average, params, strict=True):
            avg.lerp_(p.detach(), 1.0 - d)  # avg + (1 - d) (p - avg)
        return True

    @contextlib.contextmanager
    def applied(self, params: Sequence[Tensor]) -> Iterator[None]:
        """The average in `params` for the duration (evaluation, saving); the raw weights
        are put back bit for bit afterwards, even on an error."""
        params = _checked(self.average, params)
        with torch.no_grad():
            raw = [p.detach().to("cpu", copy=True) for p in params]
            for p, avg in zip(params, self.average):
                p.copy_(avg)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, r in zip(params, raw):
                    p.copy_(r)

    def state_dict(self) -> tuple[dict[str, Tensor], dict]:
        """(tensors for safetensors, JSON-able metadata)."""
        return ({f"ema.{i}": a for i, a in enumerate(self.average)},
                {"steps": self.steps, "decay": self.decay, "update_every": self.update_every,
                 "warmup": self.warmup})

    def load_state_dict(self, tensors: dict[str, Tensor], meta: dict) -> None:
        """The average and step count of `state_dict()`; decay, update_every and warmup stay
        as configured. ValueError if the tensors do not fit the parameters."""
        missing = [f"ema.{i}" for i in range(len(self.average)) if f"ema.{i}" not in tensors]
        extra = sum(k.startswith("ema.") for k in tensors) - (len(self.average) - len(missing))
        if missing or extra:
            raise ValueError(f"the saved EMA has {len(self.average) - len(missing) + extra} tensors, "
                             f"the model {len(self.average)} trainable parameters")
        with torch.no_grad():
            for i, avg in enumerate(self.average):
                saved = tensors[f"ema.{i}"]
                if saved.shape != avg.shape:
                    raise ValueError(f"saved EMA tensor {i} has shape {tuple(saved.shape)}, "
                                     f"the parameter {tuple(avg.shape)}")
                avg.copy_(saved)
        self.steps = int(meta["steps"])


def _checked(average: list[Tensor], params: Sequence[Tensor]) -> list[Tensor]:
    params = list(params)
    if len(params) != len(average) or any(p.shape != a.shape for p, a in zip(params, average)):
        raise ValueError("the parameters do not match those the EMA was built from")
    return params
