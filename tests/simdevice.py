"""A simulated accelerator for CPU tests of model.device (no GPU here).

`SimulatedDevice` (a dispatch mode): tensors made on or moved to `SIM` say they are on the
"meta" device but hold real CPU values, so whole runs (checks, .item(), images) go on; an op
that mixes such a tensor with a CPU tensor of one or more dims raises as CUDA would (a 0-d CPU
tensor is a scalar there, as on CUDA; copies and indexing with CPU indices are allowed, as on
CUDA; torch.tensor(data, device=SIM) and its kin, which PyTorch builds past dispatch modes, are
made on the CPU and moved). Modules move by swapping their parameters
(torch.__future__.set_swap_module_params_on_conversion). Built on private PyTorch APIs
(torch.utils._python_dispatch): a PyTorch upgrade may need it adjusted.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

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


_INDEX_PUT = {"aten.index_put_.default", "aten.index_put.default", "aten._index_put_impl_.default"}


def _leaves(x, out: list) -> list:
    """The leaves of an op's nested lists, tuples and dicts (torch.utils._pytree's walk, without its
    registry: aten ops take no other containers, and this walk runs for every op)."""
    if isinstance(x, (list, tuple)):
        for y in x:
            _leaves(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _leaves(y, out)
    else:
        out.append(x)
    return out


def _map(fn, x):
    """x with fn applied to its leaves, its containers rebuilt (named tuples too)."""
    if isinstance(x, (list, tuple)):
        items = [_map(fn, y) for y in x]
        if type(x) in (list, tuple):
            return type(x)(items)
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    if isinstance(x, dict):
        return {k: _map(fn, v) for k, v in x.items()}
    return fn(x)


def _cuda_rules(name, args, kwargs, leaves):
    """What CUDA refuses among the ops `_MIXED_OK` lets mix, and in random draws: a CPU tensor
    indexed by device indices; a value of one or more dims put into a tensor of the other device;
    a CPU generator drawing device numbers (CUDA wants a CUDA generator)."""
    if name == "aten.index.Tensor" or name in _INDEX_PUT:
        target, indices = args[0], [i for i in args[1] if i is not None]
        if not isinstance(target, _OnDevice) and any(isinstance(i, _OnDevice) for i in indices):
            raise RuntimeError(f"{name}: indices should be either on cpu or on the same device as the indexed "
                               "tensor (cpu)")
        value = args[2] if name in _INDEX_PUT else None
        if value is not None and value.dim() > 0 and isinstance(value, _OnDevice) != isinstance(target, _OnDevice):
            raise RuntimeError(f"{name}: Expected all tensors to be on the same device (the value put is on "
                               f"{value.device}, the tensor on {target.device})")
    target = kwargs.get("device")
    to_sim = target is not None and torch.device(target) == SIM
    on = to_sim or any(isinstance(a, _OnDevice) for a in leaves)
    if on and any(isinstance(g, torch.Generator) and g.device.type == "cpu" for g in leaves):
        raise RuntimeError(f"{name}: Expected a 'cuda' device type for generator but found 'cpu' (simulated)")


class SimulatedDevice(TorchDispatchMode):
    """Within the block, tensors made or moved to `SIM` compute on the CPU and keep reporting SIM."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        leaves = _leaves((args, kwargs), [])
        tensors = [a for a in leaves if isinstance(a, torch.Tensor)]
        on = any(isinstance(a, _OnDevice) for a in tensors)
        cpu = [tuple(a.shape) for a in tensors if not isinstance(a, _OnDevice) and a.dim() > 0]
        name = str(func)
        hollow = [tuple(a.shape) for a in tensors if type(a) is not _OnDevice and a.device == SIM]
        if hollow and len(hollow) < len(tensors):  # a harness gap, not a device mix-up: never compute garbage
            raise RuntimeError(f"{name}: a real meta tensor (no values; shapes {hollow}) met the simulated device: "
                               "PyTorch built it past the simulation (tests/simdevice.py must make it)")
        if on and cpu and name not in _MIXED_OK:
            raise RuntimeError(f"{name}: Expected all tensors to be on the same device, but found at least two "
                               f"devices, {SIM} (simulated) and cpu (CPU shapes {cpu})")
        if on or kwargs.get("device") is not None:
            _cuda_rules(name, args, kwargs, leaves)
        target = kwargs.get("device")
        to_sim = target is not None and torch.device(target) == SIM
        if to_sim:
            kwargs["device"] = torch.device("cpu")
        out = func(*_map(_unwrap, args), **_map(_unwrap, kwargs)) if on else func(*args, **kwargs)
        if name.split(".")[1].endswith("_") and args and isinstance(args[0], _OnDevice):
            return args[0]  # in place: the wrapper itself (its elem was written)
        if name == "aten._local_scalar_dense.default" or (target is not None and not to_sim):
            return out
        if to_sim or on:
            return _map(lambda o: _OnDevice(o) if type(o) is torch.Tensor else o, out)
        return out


_FROM_DATA = (torch.tensor, torch.as_tensor, torch.asarray)
_INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)


class _HostData(TorchFunctionMode):
    """What PyTorch builds from Python data past dispatch modes, where the simulated device is
    involved: torch.tensor / as_tensor / asarray / Tensor.new_tensor, and the index tensors of
    a Python list index (x[..., [3, 5]]). Left alone they would be real meta tensors without
    values (or meta scalars it cannot read); instead the data's device tensors are read on the
    host (a sync, as CUDA's) and the tensor is made on the CPU, then moved where asked (as a
    CUDA one is: a host copy, then a transfer)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INDEXING and isinstance(args[0], _OnDevice):
            return func(args[0], _device_index(args[1]), *args[2:], **kwargs)
        new = func is torch.Tensor.new_tensor
        if not (new or func in _FROM_DATA):
            return func(*args, **kwargs)
        rest = dict(kwargs)
        data = args[1] if new else args[0] if args else rest.pop("data", rest.pop("obj", None))
        device = rest.pop("device", None)
        if device is None and (new or isinstance(data, torch.Tensor)):
            device = (args[0] if new else data).device  # new_tensor: its tensor's; a tensor's own
        to_sim = device is not None and torch.device(device) == SIM
        if not (to_sim or any(isinstance(x, _OnDevice) for x in _leaves(data, []))):
            return func(*args, **kwargs)
        if new:
            rest.setdefault("dtype", args[0].dtype)
        if func is not torch.tensor and isinstance(data, _OnDevice) and to_sim:  # no copy where none is needed
            return data.to(dtype=rest.get("dtype") or data.dtype)
        grad = rest.pop("requires_grad", False)
        make = torch.tensor if new else func  # new_tensor: torch.tensor with its tensor's dtype
        out = make(_map(_unwrap, data), device=torch.device("cpu"), **rest)
        return (out.to(SIM) if to_sim else out.to(device) if device is not None else out).requires_grad_(grad)


def _device_index(index):
    """An index with its Python lists (and arrays) of ints or bools made into tensors on the
    simulated device, as PyTorch makes them on the indexed tensor's device."""
    if isinstance(index, tuple):
        return tuple(_device_index(i) for i in index)
    if isinstance(index, np.ndarray) or (isinstance(index, list) and all(
            isinstance(x, (int, bool, list, np.integer, np.bool_)) for x in _leaves(index, []))):
        return torch.tensor(index).to(SIM)  # (inside the mode: made on the CPU and moved by hand)
    return index


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
    """The simulation on, with modules' .to() swapping parameters (as a real move does), in this
    thread and in the threads started within it (PyTorch's modes are per thread; a CUDA tensor is
    usable from any thread, though the current GPU is per thread: mmrl's threads set theirs,
    mmrl.core.device.use_cuda, which the simulation cannot show)."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    bootstrap = threading.Thread._bootstrap_inner  # private: runs every thread's run(), subclasses' too

    def simulated_thread(self):
        with SimulatedDevice(), _HostData():
            bootstrap(self)

    threading.Thread._bootstrap_inner = simulated_thread
    try:
        with SimulatedDevice(), _HostData():
            yield SIM
    finally:
        threading.Thread._bootstrap_inner = bootstrap
        torch.__future__.set_swap_module_params_on_conversion(swap)
