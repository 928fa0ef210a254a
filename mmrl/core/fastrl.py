"""FastRL: differential-aware advantage pruning (MDAP) + adaptive rollout sampling (ARS).

FastRL (code announced at github.com/Nicozwy/FastRL; docs/methods.md section 2) speeds up the
GRPO family by training on fewer, more informative samples:

MDAP, per question, after advantages. Split the G rollouts into sets S_k whose
advantages are equal (|A_i - A_j| < 1e-4). Inside a set, theta_ij = 1 - Jaccard(n-gram
set of o_i, n-gram set of o_j) measures how different two rollouts are; greedily keep
o_i unless an already-kept o_j of the same set has theta_ij < tau (tau = 0.8): a
near-copy with the same advantage adds little gradient signal. Every set keeps >= 1.
The kept set is padded to a multiple of the data-parallel size with the dropped
rollouts of highest |A|. Only kept rollouts go through the training passes.

ARS, at each epoch boundary, from |S(q)| (rollouts kept for question q) over the epoch:
    G'_t   = alpha * mean|S(q)| + (1 - alpha) * max|S(q)|,   alpha = step / total_steps
    G'_ref = (mean|S(q)| + max|S(q)|) / 2 of the previous epoch
    n      = max(round(G_1 - (G'_ref - G'_t)), 2)  if G'_t < G'_ref  else  G_1
and n is the group size (num_generations) of the next epoch.

Everything here is a pure function or a small stateful counter; mmrl.core.grpo wires
them into the method hooks `prune(group)` and `group_size(epoch, current)`.

Departures and interpretations (ours):
- Advantage sets are formed greedily in index order: a sample joins the first set
  whose *first member* is within `tol` of it (so a set's spread is < 2 tol at most).
- Padding is per question (per group), to a multiple of `multiple` and never above G;
  ties in |A| go to the lower index.
- A token-level advantage [N, T] is reduced to the per-sample mean over the mask
  before the sets are formed.
- The rollout a sample is compared by (`sequences_of`): its trained token ids when the
  backend stores `data["completion_ids"]`; else the completion itself when it is a list
  or tuple of tokens; else the whitespace-split words of `str(completion)`.
- "Epoch" for ARS is the span between two calls of `next_size` (the trainer calls the
  method's group_size hook at the first step that draws from a new data epoch, so the
  step that straddles the boundary counts toward the epoch it started in).
- The first boundary has no previous epoch: G'_ref is taken from the finished epoch
  itself (then G'_t < G'_ref exactly when alpha > 1/2 and mean < max).
- round() is Python's (ties to even); the lower bound (2 in the paper) is configurable.
- With several data-parallel processes every rank records the kept counts of every rank's
  groups (mmrl.core.grpo), so all ranks choose the same G and a checkpoint holds them all.
- The KL reference pass runs after pruning, on the kept samples only (as in the paper);
  old log-probs come with the rollout, so the reference and actor passes are what is saved.

An option of ours (`weight: count`; off by default, as in the paper and the released code):
MDAP keeps one rollout for several near-copies, so without weights a set's pull on the update
shrinks to that of one rollout and the group's advantages no longer sum to zero (of three
right copies and one wrong answer, the right answer pulls a third as hard as before).
`mdap_counts` gives each kept rollout the number it stands for, and the loss counts it that
many times, in its sum and in its normaliser (mmrl.core.method.apply_prune, SAMPLE_WEIGHT):
where the dropped rollouts are exact copies and a round is one optimizer step, the update is the
unpruned one. (With several mini-batches it is not: the copies would have been spread over
them, and the kept one brings their whole weight into one.) `zero_sets: one`
(also ours) keeps a single rollout of a set whose advantage is 0: such rollouts carry no
policy gradient, and with counts the kept one still holds their place in the normaliser.
With a KL term it is not exact: each dropped rollout had a KL gradient of its own, and the
kept one stands in for them with its own.
Exact copies only: `ngram` at least the longest completion (a shorter sequence is one
n-gram) and any tau in (0, 1].

The config's defaults follow the released code (`ngram: 1`, `against: seed`, `ars: false`;
benchmarks/RESULTS.md compares them with the paper's reading). Where the released code
(Nicozwy/FastRL, verl/trainer/ray_trainer.py, read 2026-12-02) differs from the above,
which follows the paper: it buckets advantages by rounding the per-sample mean to 4
decimals; it compares token-id sets (1-grams: `ngram: 1` here), and each rollout only
with its set's seed, the highest |A| (`against: seed` here), not with every kept one; it
pads the whole batch to a multiple of (mini-batch x G), round-robin over questions; its
reference G'_ref is fixed at the first boundary; and its FastRL launch script turns ARS
off (RolloutSA=false; here `ars: false`), shrinking the mini-batch instead so the number
of optimizer updates per step stays about the baseline's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from mmrl.core.batch import RolloutBatch

__all__ = [
    "AdaptiveGroupSize",
    "advantage_sets",
    "jaccard_distance",
    "mdap_counts",
    "mdap_keep",
    "ngrams",
    "sample_advantages",
    "sequences_of",
]


# --------------------------------------------------------------------------- MDAP


def ngrams(tokens: Sequence, n: int) -> set:
    """The set of n-grams (tuples) of a sequence. Shorter than n: the whole sequence as one
    tuple; empty: the empty set."""
    tokens = list(tokens)
    if not tokens:
        return set()
    if len(tokens) < n:
        return {tuple(tokens)}
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


def jaccard_distance(a: set, b: set) -> float:
    """1 - |a & b| / |a | b|; two empty sets are identical (0.0)."""
    union = len(a | b)
    if union == 0:
        return 0.0
    return 1.0 - len(a & b) / union


def sample_advantages(advantages: Tensor, mask: Tensor | None = None) -> Tensor:  # [N]
    """One advantage per sample: [N] as is; [N, T] averaged over the mask's positions."""
    if advantages.dim() == 1:
        return advantages.float()
    adv = advantages.float()
    if mask is None:
        return adv.mean(dim=1)
    m = mask.float()  # [N, T]
    return (adv * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)


def advantage_sets(advantages: Tensor, tol: float = 1e-4) -> list[list[int]]:
    """Partition sample indices into sets of equal advantage: in index order, a sample joins
    the first set whose first member is within `tol` (|A_i - A_j| < tol), else starts one.
    advantages: [G]."""
    values = advantages.tolist()
    sets: list[list[int]] = []
    for i, a in enumerate(values):
        for s in sets:
            if abs(a - values[s[0]]) < tol:
                s.append(i)
                break
        else:
            sets.append([i])
    return sets


def mdap_counts(
    advantages: Tensor,
    sequences: list[Sequence],
    *,
    tau: float = 0.8,
    n: int = 2,
    tol: float = 1e-4,
    multiple: int = 1,
    against: str = "kept",
    zero_sets: str = "prune",
) -> Tensor:  # float [G]
    """MDAP on one question's G rollouts, with how many rollouts each kept one stands for.
    advantages: [G]; sequences: G token (or word) lists. Returns [G]: 0 for a dropped
    rollout; for a kept one, 1 + the near-copies dropped because of it (the counts sum to G).

    Inside each set of equal advantage, keep rollouts in index order unless an already-kept
    one of the same set is too similar (theta = Jaccard distance of n-gram sets < tau; the
    first such kept one is the one it is dropped for); the first of every set is kept.
    against="seed" (the released code) compares each rollout only with its set's seed, the
    member of highest |A| (ties: lower index), which is kept. Then re-add dropped rollouts
    of highest |A| (ties: lower index) until the kept count is a multiple of `multiple`,
    never beyond G; a re-added rollout stands for itself only. zero_sets="one": a set whose
    advantage is within `tol` of 0 keeps only its seed, which stands for the whole set."""
    g = advantages.shape[0]
    if len(sequences) != g:
        raise ValueError(f"mdap: {g} advantages but {len(sequences)} sequences")
    if multiple < 1:
        raise ValueError(f"mdap: multiple must be >= 1, got {multiple}")
    if against not in ("kept", "seed"):
        raise ValueError(f"mdap: against must be 'kept' or 'seed', got {against!r}")
    if zero_sets not in ("prune", "one"):
        raise ValueError(f"mdap: zero_sets must be 'prune' or 'one', got {zero_sets!r}")
    grams = [ngrams(s, n) for s in sequences]

    def rank(i: int) -> tuple[float, int]:  # highest |A| first, ties to the lower index
        return -abs(float(advantages[i])), i

    dropped_for: dict[int, int] = {}  # dropped rollout -> the kept one it is a near-copy of
    for members in advantage_sets(advantages, tol):
        if zero_sets == "one" and abs(float(advantages[members[0]])) < tol:
            seed = min(members, key=rank)
            dropped_for.update((i, seed) for i in members if i != seed)
        elif against == "seed":
            seed = min(members, key=rank)
            for i in members:
                if i != seed and jaccard_distance(grams[i], grams[seed]) < tau:
                    dropped_for[i] = seed
        else:
            kept: list[int] = []
            for i in members:
                close = next((j for j in kept if jaccard_distance(grams[i], grams[j]) < tau), None)
                if close is None:
                    kept.append(i)
                else:
                    dropped_for[i] = close
    order = sorted(dropped_for, key=rank)
    count = g - len(dropped_for)
    for i in order:
        if count % multiple == 0:
            break
        del dropped_for[i]
        count += 1
    counts = torch.ones(g)
    for i, j in dropped_for.items():
        counts[i] -= 1
        counts[j] += 1
    return counts


def mdap_keep(advantages: Tensor, sequences: list[Sequence], **kwargs) -> Tensor:  # bool [G]
    """MDAP's kept rollouts of one question (bool [G]); arguments as `mdap_counts`."""
    return mdap_counts(advantages, sequences, **kwargs) > 0


def sequences_of(batch: RolloutBatch) -> list[list]:
    """What MDAP compares, one list per sample: the trained token ids
    (data["completion_ids"][i][mask[i]]) when the backend stores them; else the completion
    when it is a list or tuple (token ids); else the whitespace-split words of its text."""
    ids = batch.data.get("completion_ids")
    if ids is not None and batch.mask is not None:
        return [ids[i][batch.mask[i]].tolist() for i in range(len(batch))]
    out = []
    for s in batch.samples:
        c = s.completion
        out.append(list(c) if isinstance(c, (list, tuple)) else str(c).split())
    return out


# --------------------------------------------------------------------------- ARS


def _empty() -> dict:
    return {"groups": 0, "kept": 0, "max": 0}  # questions seen, sum of |S(q)|, max |S(q)|


class AdaptiveGroupSize:
    """ARS: the group size of the next epoch from the kept counts |S(q)| of the last ones.

    `record(kept)` once per question after MDAP; `next_size(step, total_steps)` at an epoch
    boundary, which also starts the statistics of the new epoch. The statistics are three
    integers per epoch, so `state_dict()` is plain JSON and a resumed run continues exactly."""

    def __init__(self, base: int, min_size: int = 2):
        if base < 1 or min_size < 1:
            raise ValueError(f"AdaptiveGroupSize: base ({base}) and min_size ({min_size}) must be >= 1")
        self.base = base  # G_1: the configured num_generations
        self.min_size = min_size
        self.current = _empty()  # the epoch in progress
        self.previous: dict | None = None  # the last finished epoch (None before the first boundary)

    def record(self, kept: int) -> None:
        """|S(q)| of one question of the current epoch."""
        kept = int(kept)
        self.current["groups"] += 1
        self.current["kept"] += kept
        self.current["max"] = max(self.current["max"], kept)

    def next_size(self, step: int, total_steps: int) -> int:
        """The group size of the epoch that starts now; rolls the statistics."""
        c = self.current
        if c["groups"] == 0:
            return self.base
        alpha = min(max(step / max(total_steps, 1), 0.0), 1.0)
        mean, top = c["kept"] / c["groups"], c["max"]
        g_t = alpha * mean + (1 - alpha) * top
        ref = self.previous if self.previous is not None else c
        g_ref = (ref["kept"] / ref["groups"] + ref["max"]) / 2
        size = max(round(self.base - (g_ref - g_t)), self.min_size) if g_t < g_ref else self.base
        self.previous, self.current = c, _empty()
        return int(size)

    def state_dict(self) -> dict:
        return {"current": dict(self.current),
                "previous": None if self.previous is None else dict(self.previous)}

    def load_state_dict(self, state: dict) -> None:
        self.current = {**_empty(), **state.get("current", {})}
        prev = state.get("previous")
        self.previous = None if prev is None else {**_empty(), **prev}
