"""AXPO, Agent eXplorative Policy Optimization (arXiv 2605.28774), on multi-turn tool rollouts.

The problem it fixes: under GRPO few rollouts call a tool, and on many questions every
tool-using rollout is wrong, so tool-call tokens get zero or negative credit exactly where
learning is needed. AXPO changes which rollouts exist (docs/methods.md section 2):

    T = rollouts of the group that made >= 1 tool call
    if T is non-empty and every rollout in T is wrong:
        u_i = mean pi_old(token) over the tokens of rollout i's first tool call   (confidence)
        take the M rollouts of T with the lowest u_i; M = max(1, round(budget * G / K)) (budget 0: none;
            round is Python's, ties to even: budget 0.25, G = 20, K = 2 give round(2.5) = 2)
        for each: keep p_i (the tokens before its first tool call) fixed and resample K
                  continuations that start at the tool call (resample.force_call: p_i keeps
                  the call's opening tag, so that every continuation is a call)
    advantages: original rollouts, the usual group advantage (GRPO's settings);
                each K-sibling set of continuations, the same advantage among its siblings;
                applied only after the prefix (prefix tokens carry no loss)
    tool-observation tokens never carry loss (mmrl.vlm.agent)

The loss is GRPO's (mmrl.core.grpo), with its clip, aggregation and KL settings. The
continuations are requested through the core's `extra_requests` hook, so they are sampled
by whichever engine rolled out the group, in both scheduler modes, and scored like the rest.

RECONSTRUCTED (docs/methods.md section 2 marks AXPO partly reconstructed): the choice of M from a budget
("extra decoding ~ 25% of G"), u_i over the first call's tokens only (the call the prefix
ends before), "wrong" as the `answer` atom (else the total reward) below `success`, and the
default K = 2 continuations per prefix (the method's description gives no K; budget 0.25 is its 25%).
Departures: a rollout counts as tool-using when it emitted a tool call (first_call), whether
or not the call succeeded or was complete (one left unclosed, or cut by the turn's budget or a
stop string, counts: its continuations get a fresh budget to finish it); resampled
continuations are never resampled again.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmrl.core import distributed
from mmrl.core.batch import RolloutBatch
from mmrl.core.config import ConfigError
from mmrl.core.engine import Request
from mmrl.core.grpo import GRPO
from mmrl.core.method import register_method


@register_method("axpo")
class AXPO(GRPO):
    count_metrics = ("axpo/all_wrong_tool_groups", "axpo/resampled")

    def __init__(self, cfg, run, reward):
        super().__init__(cfg, run, reward)
        if cfg.advantage.scale == "batch" and distributed.world_size() > 1:
            # the sibling sets get a batch std of their own, which only ranks with resamples compute
            raise ConfigError("method.advantage.scale=batch with AXPO is not supported with several processes "
                              "(use scale group or none)")

    def extra_requests(self, group: RolloutBatch) -> list[Request]:
        own = _tags(group) == 0
        first = group.data["first_call"].cpu()  # positions: bookkeeping, with the tags on the CPU
        used = own & (first >= 0)  # T
        if not bool(used.any()) or bool(self.right(group)[used].any()):
            return []
        rc = self.cfg.resample
        if rc.budget == 0:  # resampling off: GRPO with AXPO's metrics (an ablation), not max(1, 0) = 1 prefix
            return []
        size = int(own.sum())
        m = min(int(used.sum()), max(1, round(rc.budget * size / rc.k)))
        rows = used.nonzero(as_tuple=True)[0]
        u = torch.stack([first_call_confidence(group, int(i)) for i in rows]).cpu()  # ranks CPU row ids
        picked = rows[torch.argsort(u, stable=True)[:m]]
        gid = int(group.group_ids[0])
        if gid not in group.prompts:
            raise ValueError(f"AXPO needs the prompt of group {gid} to resample it (batch.prompts, set by the scheduler)")
        ids, keep = group.data["completion_ids"], int(rc.force_call)  # force_call: keep the opening tag
        return [Request(gid, group.prompts[gid], rc.k, prefix=ids[int(i), : int(first[i]) + keep].tolist(), tag=j + 1)
                for j, i in enumerate(picked.tolist())]

    def advantages(self, batch: RolloutBatch) -> Tensor:  # [N]
        tags = _tags(batch)
        adv = torch.zeros(len(batch))
        own = tags == 0
        adv[own] = super().advantages(batch.select(own))
        extra = ~own
        if bool(extra.any()):  # each (group, tag) sibling set is a group of its own
            sub = batch.select(extra)
            pairs = torch.stack([sub.group_ids, tags[extra]], dim=1)
            sub.group_ids = torch.unique(pairs, dim=0, return_inverse=True)[1]
            adv[extra] = super().advantages(sub)
        return adv

    def right(self, batch: RolloutBatch) -> Tensor:  # [N] bool
        s = batch.scores
        value = s.values[:, s.names.index("answer")] if "answer" in s.names else s.total
        return value >= self.cfg.success

    def batch_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        tags = _tags(batch)
        own = tags == 0
        used = (batch.data["first_call"] >= 0).cpu()  # with the tags and the rewards on the CPU
        right = self.right(batch)
        all_wrong = 0
        for rows in batch.groups():
            t = rows[own[rows] & used[rows]]
            all_wrong += int(len(t) > 0 and not bool(right[t].any()))
        out = {
            "axpo/tool_call_rate": float(used[own].float().mean()),
            "axpo/all_wrong_tool_groups": float(all_wrong),
            "axpo/resampled": float((~own).sum()),
        }
        if bool((~own).any()):
            out["axpo/resampled_accuracy"] = float(right[~own].float().mean())
            out["axpo/resampled_tool_call_rate"] = float(used[~own].float().mean())
        return out


def first_call_confidence(batch: RolloutBatch, i: int) -> Tensor:
    """u_i: the mean old probability of the tokens of rollout i's first tool call."""
    start = int(batch.data["first_call"][i])
    calls = batch.data["call_mask"][i].tolist()  # one copy, not a device sync per token
    end = start
    while end < len(calls) and calls[end]:
        end += 1
    return batch.old_logp[i, start:end].exp().mean()


def _tags(batch: RolloutBatch) -> Tensor:
    tags = batch.data.get("request_tag")
    # bookkeeping on the CPU, with the rewards and group ids: the engines make the tags there, but
    # the trainer's batch.onto(model.device) moves every data field (a no-op on the CPU)
    return torch.zeros(len(batch), dtype=torch.long) if tags is None else tags.cpu()
