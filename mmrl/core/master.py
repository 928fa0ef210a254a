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
they are their own master, and a float32 run is unchanged.
"""

from __future__ import annotations

import torch


class MasterWeights:
    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.masters = [p if p.dtype == torch.float32 else self._copy(p) for p in params]
        for p, m in zip(params, self.masters):
            if m is not p:
                p.register_post_accumulate_grad_hook(self._hook(m))

    @staticmethod
    def _copy(p: torch.Tensor) -> torch.nn.Parameter:
        return torch.nn.Parameter(p.detach().to(torch.float32, copy=True))

    @staticmethod
    def _hook(master: torch.nn.Parameter):
        def move_grad(p: torch.Tensor) -> None:
            g = p.grad.to(torch.float32)
            master.grad = g if master.grad is None else master.grad.add_(g)
            p.grad = None

        return move_grad

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
