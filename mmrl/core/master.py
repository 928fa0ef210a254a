"""Float32 master weights for trainable parameters kept in lower precision (bfloat16).

AdamW's step is about lr per element. A bfloat16 weight carries 8 significant bits, so a
weight of 0.02 cannot move by less than about 1e-4: at a fine-tuning learning rate (1e-6)
nearly every update rounds away. Measured on the bundled VLM: one step at lr 1e-6 changed
1.0% of its bfloat16 weights against 99.9% in float32. Mixed-precision trainers (apex's
master weights, FSDP's MixedPrecision, DeepSpeed's bf16 optimizer) keep a float32 copy that
the optimizer steps, and the model holds its rounding; so does this.

The model's parameter keeps its dtype, so its forwards and memory for activations are as
before. As each backward finishes with a parameter, a hook adds its gradient into the
float32 copy's and frees the low-precision one, so micro-batches also accumulate in float32.
The trainer then reduces, clips and steps the copies, and `push` rounds them into the
model. Float32 parameters (and LoRA adapters, which PEFT keeps in float32) need no copy:
they are their own master, and a float32 run is unchanged. A bfloat16 parameter costs 10
bytes more: its copy, and its gradient and AdamW's two moments in float32.

A parameter has one hook for the life of the process, and it sends the gradient to the copy
that the newest MasterWeights made (a second Trainer on the same policy takes them over;
`release` gives a parameter its gradient back). The route is a number on the parameter and a
weak reference to the copy in a table here: no reference to the parameter itself (a weakref
to it would stop torch.utils.swap_tensors from moving its module), nothing unpicklable on it,
and a MasterWeights no longer used is freed with its copies.
"""

from __future__ import annotations

import itertools
import weakref

import torch

_ATTR = "_mmrl_master_route"
_ROUTES: dict[int, tuple[int, weakref.ref]] = {}  # route number -> (id of its parameter, weak copy)
_numbers = itertools.count()


def _route(p: torch.Tensor):
    entry = _ROUTES.get(p.__dict__.get(_ATTR, -1))
    # a deep copy of the parameter carries the number, not the route: the id tells them apart
    return entry[1]() if entry is not None and entry[0] == id(p) else None


def _move_grad(p: torch.Tensor) -> None:
    master = _route(p)
    if master is None or p.grad is None:  # released: the gradient stays on the parameter
        return
    g = p.grad.to(torch.float32)
    master.grad = g if master.grad is None else master.grad.add_(g)
    p.grad = None


def _hooked(p: torch.Tensor) -> bool:
    hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}
    return any(h is _move_grad for h in hooks.values())


def release(params: list[torch.nn.Parameter]) -> None:
    """Gradients of `params` stay on them again (a Trainer without master weights)."""
    for p in params:
        number = p.__dict__.pop(_ATTR, None)
        entry = _ROUTES.get(number)
        if entry is not None and entry[0] == id(p):  # not a deep copy's: the original keeps its route
            del _ROUTES[number]


class MasterWeights:
    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.masters = [p if p.dtype == torch.float32 else self._copy(p) for p in params]
        release(params)
        for p, m in zip(params, self.masters):
            if m is p:
                continue
            number = next(_numbers)
            p.__dict__[_ATTR] = number
            _ROUTES[number] = (id(p), weakref.ref(m, lambda _ref, n=number: _ROUTES.pop(n, None)))
            if not _hooked(p):
                p.register_post_accumulate_grad_hook(_move_grad)
        # (index, parameter, its float32 copy) for the parameters that have one
        self.copied = [(i, p, m) for i, (p, m) in enumerate(zip(params, self.masters)) if m is not p]

    @staticmethod
    def _copy(p: torch.Tensor) -> torch.nn.Parameter:
        return torch.nn.Parameter(p.detach().to(torch.float32, copy=True))

    @property
    def active(self) -> bool:
        """Whether any parameter has a float32 copy (False: every parameter is float32)."""
        return bool(self.copied)

    @torch.no_grad()
    def push(self) -> None:
        """Round the stepped copies into the model's parameters."""
        for _, p, m in self.copied:
            p.copy_(m)

    @torch.no_grad()
    def pull(self) -> None:
        """Take the model's parameters as the copies (after weights were loaded into the model)."""
        for _, p, m in self.copied:
            m.copy_(p)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"master.{i}": m.detach() for i, _, m in self.copied}

    @torch.no_grad()
    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> bool:
        """The copies saved by `state_dict`; False (and the model's rounding kept) where the
        checkpoint has none, e.g. one saved with master weights off. A float32 parameter (its own
        master) takes a saved copy too: a bfloat16 run resumed in float32 goes on from its
        float32 weights, not from their bfloat16 rounding in model/ (which lost up to the last
        few steps' updates). A float32 parameter without one was float32 there: model/ had it."""
        own = [(tensors.get(f"master.{i}"), p) for i, (p, m) in enumerate(zip(self.params, self.masters)) if m is p]
        own = [(t, p) for t, p in own if t is not None]
        if any(t.shape != p.shape for t, p in own):  # another model's: none of them (as for the copies)
            own = []
        for t, p in own:
            p.copy_(t)
        saved = [(tensors.get(f"master.{i}"), m) for i, _, m in self.copied]
        if not saved or any(t is None or t.shape != m.shape for t, m in saved):
            return bool(own)
        for t, m in saved:
            m.copy_(t)
        return True
