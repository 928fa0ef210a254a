"""Group advantage estimators of the GRPO family, as pure tensor functions.

Notation: a batch holds N samples; ``group_ids`` ([N], integer labels, any values, in any
order) says which prompt's group each sample belongs to. K = reward atoms (streams).

- :func:`group_advantages`  GRPO (``scale="group"``), batch-std variants (``"batch"``) and
  Dr.GRPO (``"none"``): one knob for "the std dial" (docs/methods.md section 1).
- :func:`rloo_advantages`   RLOO: reward minus the mean of the *other* samples of the group.
- :func:`atom_advantages`   the group advantage of every reward atom, column by column.
- :func:`multi_stream_advantages`  combining K reward streams: "normalize_then_sum"
  (GDPO, CORA's HRAS, PASS) or "sum_then_normalize" (plain GRPO on the weighted total).
- :func:`zero_variance_groups`  the samples of groups whose rewards are all equal (DAPO's
  dynamic sampling drops them).
- :func:`group_stats`  per-group mean / std / count broadcast back to the samples.

Conventions shared by every function here:

- Statistics use the unbiased sample std (``torch.std``'s default), as TRL and verl do.
- A group whose rewards are all exactly equal -- in particular a group of one sample -- gets
  advantage exactly 0 under every scale (never NaN, whatever ``eps``).
- Everything is vectorised: group statistics come from ``torch.unique(return_inverse=True)``
  plus ``index_add_`` / ``scatter_reduce``; there is no Python loop over samples or groups.
- Computation runs in float32 at least (half / bfloat16 / integer inputs are upcast; float64
  stays float64). The result has the input's dtype when that is floating point, else float32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "MULTI_STREAM_MODES",
    "SCALES",
    "atom_advantages",
    "batch_across",
    "group_advantages",
    "group_stats",
    "multi_stream_advantages",
    "rloo_advantages",
    "zero_variance_groups",
]

SCALES = ("group", "batch", "none")
MULTI_STREAM_MODES = ("normalize_then_sum", "sum_then_normalize")


# --------------------------------------------------------------------------- helpers


def _check_choice(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def _compute_dtype(x: Tensor) -> torch.dtype:
    """float32 at least: float64 stays float64, everything else computes in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _out_dtype(x: Tensor) -> torch.dtype:
    return x.dtype if x.is_floating_point() else torch.float32


def _as_values(values, name: str, ndim: int) -> Tensor:
    values = torch.as_tensor(values)
    if values.dim() != ndim:
        shape = "[N]" if ndim == 1 else "[N, K]"
        raise ValueError(f"{name} must have shape {shape}; got shape {tuple(values.shape)}")
    if values.is_complex():
        raise ValueError(f"{name} must be real-valued; got dtype {values.dtype}")
    if values.is_floating_point() and not bool(torch.isfinite(values).all()):
        # one NaN would spread through its group's mean (under batch scale, through every group)
        bad = (~torch.isfinite(values)).nonzero()[0].tolist()
        raise ValueError(f"{name} must be finite; entry {bad[0] if ndim == 1 else tuple(bad)} is "
                         f"{values[tuple(bad)].item()}")
    return values


def _group_index(group_ids, n: int, device: torch.device) -> tuple[Tensor, int]:
    """Dense group index in [0, M) for every sample ([N]) and the number of groups M."""
    gid = torch.as_tensor(group_ids, device=device)
    if gid.dim() != 1 or gid.shape[0] != n:
        raise ValueError(
            f"group_ids must have shape [N] = [{n}] (one label per sample); "
            f"got shape {tuple(gid.shape)}"
        )
    if gid.is_floating_point() or gid.is_complex():
        raise ValueError(f"group_ids must be integer labels; got dtype {gid.dtype}")
    labels, inverse = torch.unique(gid, return_inverse=True)  # [M], [N] in [0, M)
    return inverse, labels.numel()


class _Moments(NamedTuple):
    mean: Tensor  # [N] or [N, K]: the sample's group mean
    std: Tensor  # [N] or [N, K]: unbiased group std, 0 for a group of one
    count: Tensor  # [N] int64: the size of the sample's group
    zero_var: Tensor  # [N] or [N, K] bool: every value of the sample's group is equal


def _moments(values: Tensor, group_ids) -> _Moments:
    """Group statistics of ``values`` ([N] or [N, K], already in the compute dtype)."""
    n = values.shape[0]
    inverse, m = _group_index(group_ids, n, values.device)  # [N]
    rest = tuple(values.shape[1:])  # () or (K,)
    col = (m,) + (1,) * len(rest)  # per-group scalars broadcast over the K columns

    count_g = values.new_zeros(m).index_add_(0, inverse, values.new_ones(n))  # [M]
    sum_g = values.new_zeros((m,) + rest).index_add_(0, inverse, values)  # [M(, K)]
    mean_g = sum_g / count_g.view(col)
    dev = values - mean_g[inverse]  # two-pass: numerically stable variance
    sq_g = values.new_zeros((m,) + rest).index_add_(0, inverse, dev * dev)  # [M(, K)]
    std_g = (sq_g / (count_g - 1).clamp(min=1).view(col)).sqrt()  # unbiased; 0 for one sample

    # Exact "all equal" test (max == min), immune to the rounding error of mean / std.
    index = inverse.view((n,) + (1,) * len(rest)).expand_as(values)  # [N(, K)]
    hi = values.new_zeros((m,) + rest).scatter_reduce(0, index, values, "amax", include_self=False)
    lo = values.new_zeros((m,) + rest).scatter_reduce(0, index, values, "amin", include_self=False)

    return _Moments(
        mean=mean_g[inverse],
        std=std_g[inverse],
        count=count_g.long()[inverse],
        zero_var=(hi == lo)[inverse],
    )


_ACROSS: list[Callable[[Tensor], Tensor]] = []  # the sum over processes, inside batch_across()


@contextlib.contextmanager
def batch_across(sum_over_processes: Callable[[Tensor], Tensor]) -> Iterator[None]:
    """Within this context ``scale="batch"`` divides by the std of the whole data-parallel
    batch, every process's share: ``sum_over_processes(t)`` returns ``t`` summed over them
    (an all-reduce). Every process must compute its advantages inside it at the same time."""
    _ACROSS.append(sum_over_processes)
    try:
        yield
    finally:
        _ACROSS.pop()


def _batch_std(values: Tensor, population: bool = False) -> Tensor:
    """Unbiased std over the whole batch (per column for [N, K]), or with ``population`` the
    one that divides by N (np.std); 0 for fewer than 2 samples."""
    if _ACROSS:  # the same two passes over every process's rows
        total = _ACROSS[-1]
        n = float(total(values.new_tensor([values.shape[0]])))
        if n < 2:
            return values.new_zeros(values.shape[1:])
        mean = total(values.sum(dim=0)) / n
        return (total(((values - mean) ** 2).sum(dim=0)) / (n if population else n - 1)).sqrt()
    if values.shape[0] < 2:
        return values.new_zeros(values.shape[1:])
    return values.std(dim=0, correction=0 if population else 1)  # [] or [K]


def _normalised(values: Tensor, group_ids, scale: str, eps: float, population: bool = False) -> Tensor:
    """Shared body of group_advantages / atom_advantages; ``values`` [N] or [N, K]. With
    ``population`` the std divides by G (or the batch's N), not G - 1 (NumPy's np.std, as Flow-GRPO)."""
    _check_choice(scale, SCALES, "scale")
    if not eps >= 0:  # also refuses NaN
        raise ValueError(f"eps must be >= 0; got {eps}")
    v = values.to(_compute_dtype(values))
    stats = _moments(v, group_ids)
    centred = v - stats.mean  # [N(, K)]
    if scale == "group":
        std = stats.std
        if population:
            g = stats.count.to(v.dtype).view((-1,) + (1,) * (v.dim() - 1))
            std = std * ((g - 1) / g).sqrt()
    elif scale == "batch":
        std = _batch_std(v, population)
    else:  # "none" (Dr.GRPO)
        std = v.new_zeros(())
    if not (bool(torch.isfinite(std).all()) and bool(torch.isfinite(centred).all())):
        # Squared deviations of rewards beyond ~1e19 overflow float32: the std would read inf
        # and every advantage 0, without a word. float64 holds them; past it, say so.
        if v.dtype == torch.float32:
            return _normalised(values.double(), group_ids, scale, eps, population)
        raise ValueError(f"rewards too large for their group statistics (largest magnitude "
                         f"{v.abs().max().item():.3g}): scale them down")
    adv = centred if scale == "none" else centred / (std + eps)
    # All-equal groups: exactly 0, not rounding noise / (tiny std + eps), nor 0 / 0 at eps = 0.
    return adv.masked_fill(stats.zero_var, 0.0)


# --------------------------------------------------------------------------- public API


def group_stats(values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group statistics broadcast back to every sample.

    Args:
        values: ``[N]`` (or ``[N, K]``: statistics per column).
        group_ids: ``[N]`` integer group labels (any values, any order).

    Returns:
        ``(mean, std, count)``: ``mean`` and ``std`` shaped like ``values`` (float32 at
        least), the mean and unbiased std of the sample's group; ``std`` is 0 for a group of
        one sample (where ``torch.std`` would give NaN). ``count`` is ``[N]`` int64, the size
        of the sample's group.
    """
    values = torch.as_tensor(values)
    if values.dim() not in (1, 2):
        raise ValueError(f"values must have shape [N] or [N, K]; got {tuple(values.shape)}")
    stats = _moments(values.to(_compute_dtype(values)), group_ids)
    return stats.mean, stats.std, stats.count


def group_advantages(
    rewards: Tensor, group_ids: Tensor, *, scale: str = "group", eps: float = 1e-6, population: bool = False
) -> Tensor:
    """GRPO family. A_i = r_i - mean_g; then / (std_g + eps) for scale="group" (GRPO),
    / (std of the rewards over the whole batch + eps) for "batch", nothing for "none" (Dr.GRPO).
    std is the unbiased sample std (torch.std default), as TRL and verl compute it; with
    ``population`` the population std (np.std), as Flow-GRPO computes it.
    A group of one sample gets advantage 0.

    Args:
        rewards: ``[N]`` rewards.
        group_ids: ``[N]`` integer group labels (any values, any order).
        scale: ``"group"``, ``"batch"`` or ``"none"``.
        eps: added to the std before dividing.

    Returns:
        ``[N]`` advantages. Every group whose rewards are all equal (a group of one
        included) gets exactly 0, under every scale.
    """
    rewards = _as_values(rewards, "rewards", 1)
    return _normalised(rewards, group_ids, scale, eps, population).to(_out_dtype(rewards))


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """A_i = r_i - mean of the other samples of its group (0 for a group of one).

    Computed as ``G / (G - 1) * (r_i - mean_g)``, the same quantity without the loop.

    Args:
        rewards: ``[N]`` rewards.
        group_ids: ``[N]`` integer group labels (any values, any order).

    Returns:
        ``[N]`` advantages; they sum to zero over each group.
    """
    rewards = _as_values(rewards, "rewards", 1)
    r = rewards.to(_compute_dtype(rewards))
    stats = _moments(r, group_ids)
    g = stats.count.to(r.dtype)  # [N]
    centred = (r - stats.mean).masked_fill(stats.zero_var, 0.0)  # 0 for a group of one
    return (centred * g / (g - 1).clamp(min=1)).to(_out_dtype(rewards))


def atom_advantages(
    scores: Tensor, group_ids: Tensor, *, scale: str = "group", eps: float = 1e-6, population: bool = False
) -> Tensor:
    """[N, K] -> [N, K]: group_advantages applied to each atom column independently.

    With ``scale="batch"`` each column is divided by that atom's std over the batch.
    Vectorised over samples, groups and atoms alike.
    """
    scores = _as_values(scores, "scores", 2)
    return _normalised(scores, group_ids, scale, eps, population).to(_out_dtype(scores))


def multi_stream_advantages(
    scores: Tensor,
    group_ids: Tensor,
    weights: Tensor,
    *,
    mode: str = "normalize_then_sum",
    scale: str = "group",
    eps: float = 1e-6,
) -> Tensor:
    """[N, K] -> [N]. "normalize_then_sum": sum_k w_k * atom_advantages[:, k]
    (GDPO, CORA's HRAS, PASS advantage fusion). "sum_then_normalize":
    group_advantages(scores @ weights).

    Args:
        scores: ``[N, K]`` per-stream rewards.
        group_ids: ``[N]`` integer group labels.
        weights: ``[K]`` stream weights.
        mode: ``"normalize_then_sum"`` or ``"sum_then_normalize"``.
        scale, eps: as in :func:`group_advantages`.

    Returns:
        ``[N]`` advantages.
    """
    _check_choice(mode, MULTI_STREAM_MODES, "mode")
    scores = _as_values(scores, "scores", 2)
    dtype = _compute_dtype(scores)
    w = torch.as_tensor(weights, device=scores.device).to(dtype)  # [K]
    if w.dim() != 1 or w.shape[0] != scores.shape[1]:
        raise ValueError(
            f"weights must have shape [K] = [{scores.shape[1]}] (one per score column); "
            f"got shape {tuple(w.shape)}"
        )
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"weights must be finite; got {w.tolist()}")
    s = scores.to(dtype)
    if mode == "normalize_then_sum":
        adv = (_normalised(s, group_ids, scale, eps) * w).sum(dim=-1)  # [N]
    else:
        adv = _normalised(s @ w, group_ids, scale, eps)  # [N]
    return adv.to(_out_dtype(scores))


def zero_variance_groups(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Bool [N]: True for every sample whose group's rewards are all equal (DAPO drops these).

    A group of one sample counts as zero-variance. Equality is exact (max == min).
    """
    rewards = _as_values(rewards, "rewards", 1)
    return _moments(rewards.to(_compute_dtype(rewards)), group_ids).zero_var
