"""DAPO's two overlong rules (Yu et al., arXiv 2503.14476, section 3.4).

Soft overlong punishment (DAPO eq. 13), a reward atom "overlong" added to the task's
(`reward.overlong`): with L_max = max_len and L_cache = buffer, a completion of |y| tokens
scores

    0                                   |y| <= L_max - L_cache
    ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
    -1                                  L_max < |y|

times `penalty`: the last L_cache tokens of the budget cost linearly more, so the policy
learns to finish before it is cut off. verl's DAPO recipe computes the same (its
min(-exceed / L_cache * penalty, 0) is unbounded past L_max, which its rollouts never reach).

Overlong filtering (`method.overlong_filter`, mmrl.core.grpo): a truncated completion (one
that spent its token budget without ending its turn) carries no loss, so that a good
reasoning cut short is not punished as a wrong one. The truncated samples still count in
their group's advantage statistics, as in TRL's `mask_truncated_completions`.

The atom reads the completion's token count from `sample.meta["completion_tokens"]`, which
the VLM backend's rollouts, greedy decodes and tool rollouts (the model's own tokens:
observations excluded) record.
"""

from __future__ import annotations

import math

from mmrl.core.rewards import RewardAtom, Sample

NAME = "overlong"
LENGTH_KEY = "completion_tokens"


def overlong_penalty(length: int, max_len: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO eq. 13, scaled by `penalty`: 0 up to max_len - buffer tokens, then falling
    linearly to -penalty at max_len, and -penalty past it."""
    expected = max_len - buffer
    if length <= expected:
        return 0.0
    return -penalty * min(length - expected, buffer) / buffer


def overlong_atom(max_len: int, buffer: int, penalty: float = 1.0) -> RewardAtom:
    """The soft overlong punishment as the reward atom "overlong" (weight 1: the scale is
    `penalty`)."""
    if not 1 <= buffer <= max_len:
        raise ValueError(f"the overlong buffer must be 1..max_len ({max_len}) tokens, got {buffer}")
    if not (math.isfinite(penalty) and penalty > 0):
        raise ValueError(f"the overlong penalty must be a positive number, got {penalty}")

    def overlong(sample: Sample) -> float:
        length = (sample.meta or {}).get(LENGTH_KEY)
        if length is None:
            raise ValueError(f"reward.overlong needs each completion's token count (sample.meta"
                             f"[{LENGTH_KEY!r}]), and this sample has none: only the VLM backend's "
                             "rollouts record it")
        return overlong_penalty(int(length), max_len, buffer, penalty)

    return RewardAtom(NAME, overlong)
