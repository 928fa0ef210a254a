"""Data-parallel training across processes (`accelerate launch`, torchrun).

The design keeps algorithm code single-process. Every rank draws the same
prompts from the stream and rolls out its share (every world-th prompt), so
groups stay complete on one rank and advantages need no communication; where a
group filter keeps more on one rank, the scheduler deals the kept groups out equally
(moving the surplus), so all ranks make the same optimizer steps (and collectives). After
backward, gradients are summed across ranks; the loss normaliser of a
mini-batch is summed first, so the update equals that of one process holding
the whole global batch. The main rank alone writes logs and checkpoints; each step's
metrics are combined over the ranks first (combine_metrics).

One process (the default) touches none of this: every function is a no-op.
"""

from __future__ import annotations

import atexit
import contextlib
import warnings
import zlib

import torch
import torch.distributed as dist

from .config import ConfigError
from .launch import RANK_VARIABLES, launched_main, launched_world  # noqa: F401 -- torch-free, re-exported


def init() -> None:
    """Join the process group that a launcher described in the environment."""
    if launched_world() > 1 and not dist.is_initialized():
        from accelerate import PartialState

        PartialState(cpu=not torch.cuda.is_available())  # sets up gloo / nccl from the env
        # A process that exits with its group alive can abort at interpreter teardown
        # (gloo's worker threads still hold tensors): leave the group while Python is whole.
        atexit.register(close)


def close() -> None:
    """Leave the process group (a no-op when there is none or it is gone)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def adamw(params: list, lr: float, betas, eps: float, weight_decay: float, shard: bool = False):
    """AdamW over `params`. With `shard` and several processes, ZeRO stage 1: each rank keeps
    the moments of its own share of the parameters, steps that share and broadcasts it, so the
    update is the same and the optimizer state per rank is about 1 / world of it."""
    kw = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
    if shard and world_size() > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if dist.get_backend() == "nccl" and any(p.device.type == "cpu" for p in params):
            raise ConfigError("optim.shard_state broadcasts the parameters between ranks, which NCCL (a GPU "
                              "launch) cannot do for a model on the CPU: set model.device=cuda, or "
                              "optim.shard_state=false")

        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **kw)
    return torch.optim.AdamW(params, **kw)


def gather_optimizer_state(optimizer) -> None:
    """Every rank: a sharded optimizer's shares go to the main rank, whose state_dict() is then
    the whole state (a collective; a no-op for an unsharded optimizer)."""
    if hasattr(optimizer, "consolidate_state_dict"):
        optimizer.consolidate_state_dict(to=0)


def _device() -> torch.device:
    """Where collectives run: a process group on NCCL alone reduces CUDA tensors only (accelerate's
    --multi_gpu starts one), so the small tensors of these helpers go to this rank's GPU there."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank_seed(seed: int) -> int:
    """A seed of this rank's own for per-sample noise: `seed` on the main rank (so one process
    draws as it always did), another on each other rank. Seeded alike, the ranks drew the same
    noise for different prompts (and identical samples for a prompt two ranks both hold)."""
    r = rank()
    return seed if r == 0 else (seed * 1_000_003 + r) % 2**63


def shard(items: list, ids: list[int]) -> tuple[list, list[int]]:
    """This rank's share of a global list of prompts (and their draw indices)."""
    n, r = world_size(), rank()
    return items[r::n], ids[r::n]


def sum_scalar(x: float) -> float:
    if world_size() == 1:
        return x
    t = torch.tensor([float(x)], dtype=torch.float64, device=_device())
    dist.all_reduce(t)
    return float(t.item())


def sum_tensor(t: torch.Tensor) -> torch.Tensor:
    """t summed over the ranks (in float64, on the collective device), back in t's dtype and device."""
    if world_size() == 1:
        return t
    out = t.detach().to(_device(), torch.float64, copy=True)
    dist.all_reduce(out)
    return out.to(t.device, t.dtype)


def gather_scalar(x: float) -> list[float]:
    """x of every rank, in rank order ([x] with one process)."""
    if world_size() == 1:
        return [x]
    local = torch.tensor([float(x)], dtype=torch.float64, device=_device())
    out = [torch.zeros_like(local) for _ in range(world_size())]
    dist.all_gather(out, local)
    return [t.item() for t in out]


def gather_objects(obj) -> list:
    """obj of every rank (picklable; tensors on the CPU), in rank order ([obj] with one process)."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def map_shards(fn, items: list) -> list:
    """fn(items) -> one result per item, with the work dealt out: each rank runs fn on every
    world-th item, and every rank gets all the results, in the items' order (a collective; the
    results are pickled, tensors on the CPU). Held-out evaluation generates and scores this
    way, so its time (a reward model's included) falls with the ranks instead of each rank
    doing the whole set. Where fn raises on a rank, that rank raises its error and every other
    a RankError naming it, once all have joined: no rank waits for ever on one that stopped.
    With one process, fn(items)."""
    if world_size() == 1:
        return list(fn(items))
    n, r = world_size(), rank()
    mine = items[r::n]
    part, failure = [], None
    try:  # a rank that fails must still join the gather, or the others wait on it for ever
        part = list(fn(mine)) if mine else []
        if len(part) != len(mine):
            raise RuntimeError(f"map_shards: {len(part)} results for {len(mine)} items")
    except Exception as e:  # noqa: BLE001 -- raised again below, and named on every other rank
        failure = e
    shared = gather_objects((part, _said_of(failure)))
    _raise_any(failure, [error for _, error in shared])
    out: list = [None] * len(items)
    for k, (got, _) in enumerate(shared):
        out[k::n] = got
    return out


class RankError(RuntimeError):
    """Another data-parallel rank failed in a collective step (its message says how)."""


@contextlib.contextmanager
def failing_together():
    """A block of rank-local work (no collectives in it) that every rank leaves alike: where it
    raises on some ranks, each of those raises its error and every other a RankError naming the
    first, once all have finished the block (a collective). Without it, a rank whose reward
    function raised exits, and the others stop at their next collective on the backend's
    traceback (gloo: "Connection closed by peer"), or wait there (NCCL) until the launcher
    kills them. With one process, the block as it is."""
    if world_size() == 1:
        yield
        return
    failure = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 -- raised again below, and named on every other rank
        failure = e
    _raise_any(failure, gather_objects(_said_of(failure)))


def _said_of(failure: BaseException | None) -> str | None:
    return None if failure is None else f"{type(failure).__name__}: {failure}"


def _raise_any(failure: BaseException | None, errors: list[str | None]) -> None:
    """Every rank stops alike: the failing rank raises its own error, the others the first rank's."""
    if failure is not None:
        raise failure
    for other, error in enumerate(errors):
        if error is not None:
            raise RankError(f"data-parallel rank {other} failed: {error}")


# Metrics that count what a rank did: the step's value is their sum over ranks.
COUNTS = ("rollout/samples", "rollout/samples_extra", "rollout/samples_pruned", "rollout/groups",
          "rollout/groups_dropped", "rollout/groups_refilled", "rollout/groups_extra", "rollout/groups_trimmed", "rollout/decoded_tokens",
          "rollout/engine_calls", "rollout/redispatched", "reward/errors")


def combine_metrics(metrics: dict[str, float], counts: tuple[str, ...] | frozenset = ()) -> dict[str, float]:
    """A step's metrics over every rank, for the main rank's logs: counts (COUNTS, `counts` (a
    method's own), cost/*) summed; wall times, maxima and train/* flags the largest; minima the
    smallest; the rest (means of equal shares of the batch) averaged. A rank's std is averaged
    too, which is not the batch's std. A key only some ranks logged (a method's conditional
    metric) is combined over those ranks; the others' keys are not lost for it."""
    if world_size() == 1:
        return metrics
    try:
        numeric = {k: float(v) for k, v in metrics.items()}
    except (TypeError, ValueError):
        numeric = None
    # one scalar per rank says both whether its values are numbers and which keys it logged
    signature = zlib.crc32("\n".join(sorted(numeric)).encode()) if numeric is not None else -1.0
    signatures = gather_scalar(float(signature))
    if -1.0 in signatures:  # every rank decides alike
        if is_main() and not _said["keys"]:
            _said["keys"] = True
            warnings.warn("a rank logged a metric that is not a number this step: the logs hold the main "
                          "rank's share", stacklevel=2)
        return metrics
    # the union of the ranks' keys, gathered only on the steps whose key sets differ
    keys = sorted(numeric) if len(set(signatures)) == 1 else sorted(set().union(*gather_objects(sorted(numeric))))
    local = torch.tensor([[numeric.get(k, 0.0), float(k in numeric)] for k in keys], dtype=torch.float64,
                         device=_device())  # [K, 2]: value, whether this rank logged it
    table = [torch.zeros_like(local) for _ in range(world_size())]
    dist.all_gather(table, local)
    values = torch.stack(table).cpu()  # [world, K, 2]
    out = {}
    for j, k in enumerate(keys):
        col = values[:, j, 0][values[:, j, 1] > 0]  # the ranks that logged it
        if k in COUNTS or k in counts or k.startswith("cost/"):
            v = col.sum()
        elif extreme(k) is max or k.startswith("train/") or (k.startswith("time/") and "ratio" not in k):
            v = col.max()
        elif extreme(k) is min:
            v = col.min()
        else:
            v = col.mean()
        out[k] = float(v)
    return out


_said = {"keys": False}


def extreme(key: str):
    """`min` or `max` for a metric named as a minimum or maximum ("loss/ratio_min"), else None:
    its value over ranks, micro-batches and passes is that extreme, not a mean."""
    if key.endswith(("_min", "/min")):
        return min
    if key.endswith(("_max", "/max")):
        return max
    return None


def sum_gradients(params: list[torch.nn.Parameter]) -> None:
    """Sum every parameter's gradient over the ranks (a rank without one contributes 0)."""
    if world_size() == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    # one collective for all of them, on the collective device, in each gradient's dtype
    for dtype in sorted({p.grad.dtype for p in params}, key=str):  # the same order on every rank
        grads = [p.grad for p in params if p.grad.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in grads]).to(_device())
        dist.all_reduce(flat)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def weights_checksum(params: list[torch.nn.Parameter]) -> list[float]:
    """Each rank's sum of |w| (float64): equal entries mean the ranks hold the same weights."""
    local = torch.tensor([sum(float(p.detach().double().abs().sum()) for p in params)], dtype=torch.float64)
    if world_size() == 1:
        return [local.item()]
    local = local.to(_device())
    out = [torch.zeros_like(local) for _ in range(world_size())]
    dist.all_gather(out, local)
    return [t.item() for t in out]


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()
