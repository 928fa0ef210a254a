"""Where a backend puts its model: `model.device` resolved to a torch.device.

Every backend calls `model_device(cfg.model.device)` once, moves the policy there, and makes
the tensors of a rollout and an update on the device of the policy's parameters (ids and
bookkeeping may stay on the CPU; the trainer moves a batch from elsewhere with
RolloutBatch.onto)."""

from __future__ import annotations

import os

import torch

from .config import ConfigError


def model_device(spec: str = "cpu", make_current: bool = True) -> torch.device:
    """The torch.device for model.device `spec` ("cpu", "cuda", "cuda:N", "auto"). "cuda" and
    "auto" pick this process's GPU: LOCAL_RANK's under a data-parallel launcher, else GPU 0.
    A ConfigError when a GPU is asked for and none is visible. `make_current`: the GPU becomes
    the process's current one (the policy's; not a reward model's)."""
    if spec == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if spec == "auto":
            return torch.device("cpu")
        raise ConfigError(f"model.device {spec}: no CUDA device is visible to this process "
                          "(torch.cuda.is_available() is False); use model.device=cpu or auto")
    if spec in ("auto", "cuda"):
        # LOCAL_RANK's GPU; GPU 0 where the launcher shows each rank only its own (SLURM, k8s)
        index = int(os.environ.get("LOCAL_RANK", "0")) if torch.cuda.device_count() > 1 else 0
    else:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError(f"model.device {spec} with several processes would put every rank on GPU "
                              f"{spec.split(':')[1]}; use cuda or auto (each rank its own GPU, LOCAL_RANK)")
        index = int(spec.split(":", 1)[1])
    if index >= torch.cuda.device_count():
        raise ConfigError(f"model.device {spec}: GPU {index} does not exist (this process sees "
                          f"{torch.cuda.device_count()}; LOCAL_RANK={os.environ.get('LOCAL_RANK', 'unset')})")
    if make_current:
        torch.cuda.set_device(index)  # NCCL collectives and torch.cuda.current_device() follow it
    return torch.device("cuda", index)


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of a module's parameters (the CPU for a module without any)."""
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def fork_rng(module: torch.nn.Module):
    """torch.random.fork_rng over the CPU RNG and, for a module on a GPU, that GPU's RNG: what
    the block draws (evaluation, a seeded rollout) leaves the training draws unchanged."""
    dev = module_device(module)
    return torch.random.fork_rng(devices=[dev.index or 0] if dev.type == "cuda" else [])


def current_cuda() -> int | None:
    """This thread's current GPU, where CUDA is in use (None otherwise). PyTorch keeps the current
    device per thread, and a new thread starts on GPU 0: `use_cuda(current_cuda())` at the top of
    a thread started here puts it on this thread's GPU (model.device cuda:1, a rank's GPU)."""
    return torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def use_cuda(index: int | None) -> None:
    if index is not None:
        torch.cuda.set_device(index)
