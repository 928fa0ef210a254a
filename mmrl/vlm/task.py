"""A VLM task for the loop: training prompts, the reward, and held-out evaluation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mmrl.core import distributed
from mmrl.core.rewards import Reward


class VLMTask:
    """Question-answer items (QAItem: images, question, answer, reference, meta).

    Held-out evaluation decodes greedily (stopping at rollout.stop's strings, as rollouts do)
    and scores with the same reward atoms:
    `accuracy` is the mean of the `answer` atom, `format` of the `format` atom,
    `reward` of the weighted total. With `rollout` and eval_samples > 0 it also
    reports `sampled_accuracy`: the mean `answer` over eval_samples completions per
    item sampled at the rollout temperature (seeded, so before/after are comparable);
    that is the quantity RL optimises, greedy accuracy the one a user decodes with."""

    def __init__(self, name: str, train: Sequence[Any], eval_items: Sequence[Any], reward: Reward,
                 *, max_new_tokens: int, batch_size: int = 64, rollout=None, eval_samples: int = 0,
                 metrics: Callable[[list[str], list[Any]], dict[str, float]] | None = None,
                 extra_eval: dict[str, Sequence[Any]] | None = None):
        if not train:
            raise ValueError(f"task {name!r} has no training items")
        if not eval_items:
            raise ValueError(f"task {name!r} has no evaluation items")
        self.name = name
        self.train = list(train)
        self.eval_items = list(eval_items)
        self.reward = reward
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.rollout = rollout
        self.eval_samples = eval_samples
        self.metrics = metrics  # task-specific measures of the greedy completions (coverage, ...)
        self.extra_eval = {k: list(v) for k, v in (extra_eval or {}).items() if v}  # e.g. "ood" items

    # what evaluate() logs beside each atom's mean (a config atom may not take these names)
    metric_names = ("reward", "accuracy", "tool_call_rate", "sampled_accuracy", "sampled_tool_call_rate",
                    "coverage", "mode_accuracy", "inconsistency_rate", "consistency_checked")
    metric_prefixes = ("pass@", "ood/")

    @property
    def stop(self) -> list[str] | None:
        """The rollouts' stop strings (rollout.stop), which greedy decodes stop at too."""
        return getattr(self.rollout, "stop", None) or None

    def train_prompts(self) -> Sequence[Any]:
        return self.train

    def evaluate(self, policy) -> dict[str, float]:
        out = self._greedy(policy, self.eval_items)
        for name, items in self.extra_eval.items():
            out.update({f"{name}/{k}": v for k, v in self._greedy(policy, items).items()})
        if self.rollout is not None and self.eval_samples > 0 and "answer" in self.reward.names:
            out.update(self._sampled(policy))
        return out

    def _greedy(self, policy, items: list[Any]) -> dict[str, float]:
        def answer(share):  # (completion, its atom scores and total, whether it called a tool or None) per item
            batches = policy.greedy_batches(share, self.max_new_tokens, self.batch_size, self.stop)
            samples = [s for b in batches for s in b.samples]  # with their lengths and tool calls in meta
            called = [c for b in batches for c in b.data["stat/called"].tolist()] if (
                batches and "stat/called" in batches[0].data) else [None] * len(share)
            scores = self.reward.score(samples)  # a reward model's share too
            texts = [s.completion for s in samples]
            return list(zip(texts, scores.values.tolist(), scores.total.tolist(), called))

        answered = distributed.map_shards(answer, list(items))  # each rank generates and scores its share
        texts = [t for t, *_ in answered]
        values = torch.tensor([v for _, v, _, _ in answered], dtype=torch.float32).reshape(len(answered),
                                                                                         len(self.reward.names))
        total = torch.tensor([t for _, _, t, _ in answered], dtype=torch.float32)
        # Means in float64: in float32, 105 right of 200 reads 0.52499998, under a 0.525 target.
        out = {"reward": float(total.double().mean())}
        for k, name in enumerate(self.reward.names):
            key = "accuracy" if name == "answer" else name
            out[key] = float(values[:, k].double().mean())
        if answered and answered[0][3] is not None:  # tool rollouts: how often the greedy answer used a tool
            out["tool_call_rate"] = float(torch.tensor([c for *_, c in answered], dtype=torch.float64).mean())
        if self.metrics is not None:
            out.update(self.metrics(texts, items))
        return out

    def _sampled(self, policy) -> dict[str, float]:
        """eval_samples completions per item at the rollout temperature (a fixed seed):
        sampled_accuracy (Pass@1 estimated from k samples), pass@k, and the tool-call rate."""
        k = self.eval_samples
        gen = torch.Generator().manual_seed(distributed.rank_seed(1234))  # each rank's share its own seed
        per_batch = max(1, self.batch_size // k)

        def sample(share):  # per item: the k samples' answer scores, and their tool calls (or None)
            out = []
            for start in range(0, len(share), per_batch):
                batch = policy.generate(share[start: start + per_batch], k, self.rollout, gen)
                sampled = self.reward.score(batch.samples)
                hits = sampled.values[:, sampled.names.index("answer")].view(-1, k)  # an item's rows are contiguous
                called = batch.data["stat/called"].view(-1, k) if "stat/called" in batch.data else None
                out += [(hits[i].tolist(), None if called is None else called[i].tolist()) for i in range(len(hits))]
            return out

        answered = distributed.map_shards(sample, list(self.eval_items))
        hits_t = torch.tensor([h for h, _ in answered], dtype=torch.float64)  # [items, k]
        # a success: an answer score of at least 0.5 (a partial-credit check's half counts), as the dLLM's pass@k
        out = {"sampled_accuracy": float(hits_t.mean()), f"pass@{k}": float((hits_t >= 0.5).any(-1).double().mean())}
        if answered and answered[0][1] is not None:
            out["sampled_tool_call_rate"] = float(torch.tensor([c for _, cs in answered for c in cs],
                                                               dtype=torch.float64).mean())
        return out
