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
they are their own master, and a float32 run is unchanged. A bfloat16 parameter costs 6
bytes more: its copy, and its gradient in float32.

A parameter has one hook for the life of the process, and it sends the gradient to the copy
that the newest MasterWeights made (a second Trainer on the same policy takes them over;
`release` gives a parameter its gradient back). The routes are weak, so a MasterWeights that
is no longer used is freed with its copies.
"""

from __future__ import annotations

import weakref

import torch

# id(parameter) -> (weak parameter, weak float32 copy), and the parameters that have the hook.
# Keyed by id with the parameter's weakref checked, since tensors compare elementwise (no
# WeakKeyDictionary); a dead parameter's entries go with it.
_ROUTES: dict[int, tuple[weakref.ref, weakref.ref]] = {}
_HOOKED: dict[int, weakref.ref] = {}


def _weak(p: torch.Tensor, table: dict) -> weakref.ref:
    """A weakref to `p` whose death removes p's entry from `table` (if the entry is still p's)."""
    key = id(p)

    def gone(ref: weakref.ref) -> None:
        entry = table.get(key)
        if (entry[0] if isinstance(entry, tuple) else entry) is ref:
            del table[key]

    return weakref.ref(p, gone)


def _route(p: torch.Tensor):
    entry = _ROUTES.get(id(p))
    return entry[1]() if entry is not None and entry[0]() is p else None


def _move_grad(p: torch.Tensor) -> None:
    master = _route(p)
    if master is None or p.grad is None:  # released: the gradient stays on the parameter
        return
    g = p.grad.to(torch.float32)
    master.grad = g if master.grad is None else master.grad.add_(g)
    p.grad = None


def release(params: list[torch.nn.Parameter]) -> None:
    """Gradients of `params` stay on them again (a Trainer without master weights)."""
    for p in params:
        if _route(p) is not None:
            del _ROUTES[id(p)]


class MasterWeights:
    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.masters = [p if p.dtype == torch.float32 else self._copy(p) for p in params]
        release(params)
        for p, m in zip(params, self.masters):
            if m is p:
                continue
            _ROUTES[id(p)] = (_weak(p, _ROUTES), weakref.ref(m))
            hooked = _HOOKED.get(id(p))
            if hooked is None or hooked() is not p:
                p.register_post_accumulate_grad_hook(_move_grad)
                _HOOKED[id(p)] = _weak(p, _HOOKED)

    @staticmethod
    def _copy(p: torch.Tensor) -> torch.nn.Parameter:
        return torch.nn.Parameter(p.detach().to(torch.float32, copy=True))

    @property
    def active(self) -> bool:
        """Whether any parameter has a float32 copy (False: every parameter is float32)."""
        return any(m is not p for p, m in zip(self.params, self.masters))

    @torch.no_grad()
    def push(self) -> None:
        """Round the stepped copies into the model's parameters."""
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.copy_(m)

    @torch.no_grad()
    def pull(self) -> None:
        """Take the model's parameters as the copies (after weights were loaded into the model)."""
        for p, m in zip(self.params, self.masters):
            if m is not p:
                m.copy_(p)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"master.{i}": m.detach() for i, (p, m) in enumerate(zip(self.params, self.masters)) if m is not p}

    @torch.no_grad()
    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> bool:
        """The copies saved by `state_dict`; False (and the model's rounding kept) where the
        checkpoint has none, e.g. one saved with master weights off."""
        saved = {i: tensors.get(f"master.{i}") for i, (p, m) in enumerate(zip(self.params, self.masters)) if m is not p}
        if not saved or any(t is None or t.shape != self.masters[i].shape for i, t in saved.items()):
            return False
        for i, t in saved.items():
            self.masters[i].copy_(t)
        return True
