"""The typed rollout batch: the one contract between rollout and training.

Every backend's rollout produces a `RolloutBatch`; every method consumes one.
Rows are samples (N of them), grouped by `group_ids` (one group = the G samples
of one prompt; groups are always complete). Per-position tensors are [N, T]
where T is whatever the backend trains on: completion tokens for the VLM,
denoising steps for flow models, committed tokens or masked rows for dLLMs.
Anything else a backend needs at training time (input ids, pixel values,
latents, timesteps) goes in `data`, one tensor per key with N leading rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from mmrl.core.rewards import AtomScores, Sample

SAMPLE_WEIGHT = "sample_weight"
"""batch.data key of per-sample loss weights [N] (FastRL's MDAP with counts): a sample with
weight w counts w times in the loss and its normaliser (mmrl.core.losses.aggregate)."""


@dataclass
class RolloutBatch:
    group_ids: Tensor  # [N] long: the prompt each sample answers
    samples: list[Sample]  # what reward atoms see: prompt, completion, meta
    mask: Tensor | None = None  # [N, T] bool: positions that carry loss
    old_logp: Tensor | None = None  # [N, T] log-probs under the weights that produced the sample
    ref_logp: Tensor | None = None  # [N, T] log-probs under the reference policy (KL, beta > 0)
    scores: AtomScores | None = None  # atom values [N, K] and totals [N]
    advantages: Tensor | None = None  # [N] or [N, T]
    policy_version: int = 0  # the optimizer step whose weights produced these samples
    data: dict[str, Tensor] = field(default_factory=dict)  # backend tensors, [N, ...] each;
    # keys "stat/<name>" are per-sample rollout statistics, logged as rollout/<name> means
    prompts: dict[int, Any] = field(default_factory=dict)  # group id -> its prompt object, set by
    # the scheduler: what a method's extra requests (AXPO's resampling) are made of

    def __post_init__(self):
        self.validate()

    def __len__(self) -> int:
        return int(self.group_ids.shape[0])

    @property
    def rewards(self) -> Tensor:  # [N]
        if self.scores is None:
            raise ValueError("this batch has not been scored yet (batch.scores is None)")
        return self.scores.total

    @property
    def num_groups(self) -> int:
        return int(torch.unique(self.group_ids).numel())

    def validate(self) -> None:
        """Every per-sample field has N rows; per-position fields share one [N, T] shape."""
        n = len(self)
        if self.group_ids.dim() != 1:
            raise ValueError(f"group_ids must be 1-D [N], got shape {tuple(self.group_ids.shape)}")
        if len(self.samples) != n:
            raise ValueError(f"batch has {n} group ids but {len(self.samples)} samples")
        for name in ("mask", "old_logp", "ref_logp", "advantages"):
            t = getattr(self, name)
            if t is not None and t.shape[0] != n:
                raise ValueError(f"batch.{name} has {t.shape[0]} rows, expected {n}")
        for name in ("old_logp", "ref_logp"):
            t = getattr(self, name)
            if t is not None and self.mask is not None and t.shape != self.mask.shape:
                raise ValueError(f"batch.{name} shape {tuple(t.shape)} != mask shape {tuple(self.mask.shape)}")
        if self.scores is not None and self.scores.values.shape[0] != n:
            raise ValueError(f"batch.scores has {self.scores.values.shape[0]} rows, expected {n}")
        for key, t in self.data.items():
            if t.shape[0] != n:
                raise ValueError(f"batch.data[{key!r}] has {t.shape[0]} rows, expected {n}")

    def select(self, idx: Tensor) -> RolloutBatch:
        """The rows `idx` (long indices or a bool mask [N]), every field sliced alike; `prompts`
        keeps the groups that have rows left."""
        idx = torch.as_tensor(idx)
        if idx.dtype == torch.bool:
            idx = idx.nonzero(as_tuple=True)[0]
        rows = idx.tolist()
        group_ids = self.group_ids[idx]
        kept = set(group_ids.tolist())

        def take(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[idx]

        return replace(
            self,
            group_ids=group_ids,
            samples=[self.samples[i] for i in rows],
            mask=take(self.mask),
            old_logp=take(self.old_logp),
            ref_logp=take(self.ref_logp),
            scores=None if self.scores is None else self.scores.select(idx),
            advantages=take(self.advantages),
            data={k: v[idx] for k, v in self.data.items()},
            prompts={g: p for g, p in self.prompts.items() if g in kept},
        )

    def to(self, device: torch.device | str | RolloutBatch) -> RolloutBatch:
        """The batch with every tensor on `device`, or, given a batch, each tensor on the device
        of that batch's same field (a backend keeps ids on the CPU and model inputs on its GPU;
        what crosses between processes goes by the CPU and comes back so)."""
        like = device if isinstance(device, RolloutBatch) else None

        def move(t: Tensor | None, there: Tensor | None) -> Tensor | None:
            """t on `device`; given a batch, on the device of its field `there` (kept where it has none)."""
            if t is None or (like is not None and there is None):
                return t
            return t.to(device if like is None else there.device)

        def fields(obj, other, names: tuple[str, ...]) -> dict:
            return {n: move(getattr(obj, n), getattr(other, n, None)) for n in names}

        scores = self.scores
        if scores is not None:
            scores = replace(scores, **fields(scores, getattr(like, "scores", None), ("values", "total", "failed")))
        data = {k: move(v, getattr(like, "data", {}).get(k)) for k, v in self.data.items()}
        return replace(self, **fields(self, like, ("group_ids", "mask", "old_logp", "ref_logp", "advantages")),
                       scores=scores, data=data)

    def onto(self, device: torch.device | str) -> RolloutBatch:
        """The batch with what a model or a loss reads on `device` (mask, log-probs, advantages,
        data); group ids and scores stay where they are: bookkeeping, read as Python numbers.
        For batches from an engine elsewhere (a server, a worker on the CPU)."""
        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device)

        return replace(self, mask=move(self.mask), old_logp=move(self.old_logp), ref_logp=move(self.ref_logp),
                       advantages=move(self.advantages), data={k: v.to(device) for k, v in self.data.items()})

    def groups(self) -> list[Tensor]:
        """Row indices of each group, in order of first appearance."""
        _, inverse = torch.unique(self.group_ids, return_inverse=True)
        first = {}
        for row, g in enumerate(inverse.tolist()):
            first.setdefault(g, []).append(row)
        return [torch.tensor(rows) for rows in first.values()]

    @staticmethod
    def concat(batches: list[RolloutBatch]) -> RolloutBatch:
        """Stack batches row-wise. [N, T] fields of different T are right-padded with
        zeros (mask False there), so rounds of different lengths can share one batch.
        `prompts` are merged; two batches giving one group id different prompts is a
        ValueError (group ids are the scheduler's draw indices: one prompt each)."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        if len(batches) == 1:
            return batches[0]

        def cat(name: str) -> Tensor | None:
            ts = [getattr(b, name) for b in batches]
            if all(t is None for t in ts):
                return None
            if any(t is None for t in ts):
                raise ValueError(f"cannot concat batches where only some have {name}")
            return _cat_padded(ts)

        scores = None
        if any(b.scores is None for b in batches) and not all(b.scores is None for b in batches):
            raise ValueError("cannot concat batches where only some have scores")
        if all(b.scores is not None for b in batches):
            names = batches[0].scores.names
            if any(b.scores.names != names for b in batches):
                raise ValueError("cannot concat batches scored with different reward atoms")
            scores = AtomScores(
                names=list(names),
                values=torch.cat([b.scores.values for b in batches]),
                total=torch.cat([b.scores.total for b in batches]),
                errors=sum(b.scores.errors for b in batches),
                failed=None if any(b.scores.failed is None for b in batches)
                else torch.cat([b.scores.failed for b in batches]),
            )
        if any(SAMPLE_WEIGHT in b.data for b in batches):  # a batch without weights weighs 1 a row
            batches = [b if SAMPLE_WEIGHT in b.data else
                       replace(b, data={**b.data, SAMPLE_WEIGHT: torch.ones(len(b))}) for b in batches]
        keys = batches[0].data.keys()
        if any(b.data.keys() != keys for b in batches):
            raise ValueError("cannot concat batches with different data keys")
        return RolloutBatch(
            group_ids=torch.cat([b.group_ids for b in batches]),
            samples=[s for b in batches for s in b.samples],
            mask=cat("mask"),
            old_logp=cat("old_logp"),
            ref_logp=cat("ref_logp"),
            scores=scores,
            advantages=cat("advantages"),
            policy_version=min(b.policy_version for b in batches),
            data={k: _cat_padded([b.data[k] for b in batches]) for k in keys},
            prompts=_merged_prompts(batches),
        )

    def summary(self) -> dict[str, Any]:
        return {"samples": len(self), "groups": self.num_groups, "version": self.policy_version}


def _merged_prompts(batches: list[RolloutBatch]) -> dict[int, Any]:
    """Every batch's group id -> prompt. The same group in several batches (a group's parts,
    its extra samples) must carry the same prompt: a clash means two draws got one id, and
    keeping either prompt would pair some rows with a prompt they did not answer."""
    out: dict[int, Any] = {}
    for b in batches:
        for gid, prompt in b.prompts.items():
            if gid in out and not _same_prompt(out[gid], prompt):
                raise ValueError(f"cannot concat batches that give group {gid} different prompts "
                                 f"({_brief(out[gid])} and {_brief(prompt)})")
            out[gid] = prompt
    return out


def _same_prompt(a: Any, b: Any) -> bool:
    """The one object (as the scheduler hands a group's batches), else ==: a copy that crossed
    processes. Where == has no single truth value (tensors inside), the prompts pass: a run is
    not stopped on a comparison that cannot tell."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except (RuntimeError, ValueError, TypeError):
        return True


def _brief(prompt: Any, limit: int = 60) -> str:
    text = repr(prompt)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _cat_padded(ts: list[Tensor]) -> Tensor:
    if ts[0].dim() < 2 or all(t.shape[1:] == ts[0].shape[1:] for t in ts):
        return torch.cat(ts)
    if any(t.shape[2:] != ts[0].shape[2:] for t in ts):
        raise ValueError("cannot concat tensors that differ beyond their second dimension")
    width = max(t.shape[1] for t in ts)
    padded = []
    for t in ts:
        pad = torch.zeros((t.shape[0], width - t.shape[1], *t.shape[2:]), dtype=t.dtype, device=t.device)
        padded.append(torch.cat([t, pad], dim=1))
    return torch.cat(padded)
