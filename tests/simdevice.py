"""A simulated accelerator for CPU tests of model.device (no GPU here).

`SimulatedDevice` (a dispatch mode): tensors made on or moved to `SIM` say they are on the
"meta" device but hold real CPU values, so whole runs (checks, .item(), images) go on; an op
that mixes such a tensor with a CPU tensor of one or more dims raises as CUDA would (a 0-d CPU
tensor is a scalar there, as on CUDA; copies and indexing with CPU indices are allowed, as on
CUDA). Modules move by swapping their parameters
(torch.__future__.set_swap_module_params_on_conversion). Built on private PyTorch APIs
(torch.utils._python_dispatch): a PyTorch upgrade may need it adjusted.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

SIM = torch.device("meta")
# ops that may take tensors of two devices on CUDA too (a transfer, CPU indices, a scalar read)
_MIXED_OK = {"aten._to_copy.default", "aten.copy_.default", "aten.index.Tensor", "aten.index_put_.default",
             "aten.index_put.default", "aten._index_put_impl_.default", "aten._local_scalar_dense.default"}


class _OnDevice(torch.Tensor):
    """A CPU tensor `elem` that reports the simulated device."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(), dtype=elem.dtype,
                                                   device=SIM, requires_grad=elem.requires_grad,
                                                   storage_offset=elem.storage_offset())

    def __init__(self, elem):
        self.elem = elem

    def tolist(self):  # a device tensor's .tolist() syncs and works; a subclass's is refused by torch
        return self.elem.tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        with SimulatedDevice():
            return func(*args, **(kwargs or {}))


class SimulatedDevice(TorchDispatchMode):
    """Within the block, tensors made or moved to `SIM` compute on the CPU and keep reporting SIM."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        on = any(isinstance(a, _OnDevice) for a in tensors)
        cpu = [tuple(a.shape) for a in tensors if not isinstance(a, _OnDevice) and a.dim() > 0]
        name = str(func)
        if on and cpu and name not in _MIXED_OK:
            raise RuntimeError(f"{name}: Expected all tensors to be on the same device, but found at least two "
                               f"devices, {SIM} (simulated) and cpu (CPU shapes {cpu})")
        target = kwargs.get("device")
        to_sim = target is not None and torch.device(target) == SIM
        if to_sim:
            kwargs["device"] = torch.device("cpu")
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if name.split(".")[1].endswith("_") and args and isinstance(args[0], _OnDevice):
            return args[0]  # in place: the wrapper itself (its elem was written)
        if name == "aten._local_scalar_dense.default" or (target is not None and not to_sim):
            return out
        if to_sim or on:
            return tree_map(lambda o: _OnDevice(o) if type(o) is torch.Tensor else o, out)
        return out


def _unwrap(a):
    return a.elem if isinstance(a, _OnDevice) else a


def outside(fn):
    """fn run with the simulation off (loaders that build on the real meta device first)."""

    def run(*a, **kw):
        with _disable_current_modes():
            return fn(*a, **kw)

    return run


@contextlib.contextmanager
def simulated_device():
    """The simulation on, with modules' .to() swapping parameters (as a real move does)."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with SimulatedDevice():
            yield SIM
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
