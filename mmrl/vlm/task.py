"""A VLM task for the loop: training prompts, the reward, and held-out evaluation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mmrl.core import distributed
from mmrl.core.held_out import eval_temperature, sample_generators
from mmrl.core.rewards import Reward


class VLMTask:
    """Question-answer items (QAItem: images, question, answer, reference, meta).

    Held-out evaluation decodes greedily (stopping at rollout.stop's strings, as rollouts do)
    and scores with the same reward atoms:
    `accuracy` is the mean of the `answer` atom, `format` of the `format` atom,
    `reward` of the weighted total. With `rollout` and eval_samples > 0 it also
    reports `sampled_accuracy`: the mean `answer` over eval_samples completions per
    item sampled at rollout.eval_temperature (else the rollout temperature; each sample seeded by its item and index alone,
    so before/after and any eval_batch_size are comparable);
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

    def evaluate(self, policy, progress=None, rows: list | None = None) -> dict[str, float]:
        """The metrics above; `progress` (mmrl.core.held_out.EvalProgress) counts the decodes, and
        `rows` gets one dict per item (question, answer, where or kind, completion, scores: each
        atom's, total; `called` in tool rollouts, `sampled_answer` with eval_samples; `split`
        for extra_eval's items), from what evaluation decoded and scored anyway."""
        made = [] if rows is not None else None  # the held-out items' rows, then each extra set's
        out = self._greedy(policy, self.eval_items, progress, made)
        for name, items in self.extra_eval.items():
            extra = [] if rows is not None else None
            out.update({f"{name}/{k}": v for k, v in self._greedy(policy, items, progress, extra).items()})
            if extra is not None:
                made += [{"split": name, **row} for row in extra]
        if self.rollout is not None and self.eval_samples > 0 and "answer" in self.reward.names:
            out.update(self._sampled(policy, progress, made))
        if rows is not None:
            rows += made
        return out

    def _greedy(self, policy, items: list[Any], progress=None, rows: list | None = None) -> dict[str, float]:
        def answer(share):  # (completion, its atom scores and total, whether it called a tool or None) per item
            if progress is not None:
                progress.expect(len(share))
            batches = []
            for start in range(0, len(share), self.batch_size):  # a batch at a time, for the progress
                chunk = share[start: start + self.batch_size]
                batches += policy.greedy_batches(chunk, self.max_new_tokens, self.batch_size, self.stop)
                if progress is not None:
                    progress.advance(len(chunk))
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
        if rows is not None:
            for item, (text, scores, total, called) in zip(items, answered):
                rows.append({**_described(item), "completion": text, "scores": dict(zip(self.reward.names, scores)), "total": total,
                             **({} if called is None else {"called": called})})
        return out

    def _sampled(self, policy, progress=None, rows: list | None = None) -> dict[str, float]:
        """eval_samples completions per item at rollout.eval_temperature, else the rollout
        temperature (each seeded by its item and sample index alone): sampled_accuracy (Pass@1
        estimated from k samples), pass@k, and the tool-call rate; each item's k answer scores
        into its row of `rows` (the held-out items' first)."""
        k = self.eval_samples
        per_batch = max(1, self.batch_size // k)
        rollout = self.rollout  # at rollout.eval_temperature where set
        if getattr(rollout, "eval_temperature", None) is not None:
            rollout = rollout.model_copy(update={"temperature": eval_temperature(rollout)})

        def sample(share):  # per item: the k samples' answer scores, and their tool calls (or None)
            out = []
            if progress is not None:
                progress.expect(len(share) * k)
            for start in range(0, len(share), per_batch):
                part = share[start: start + per_batch]
                gens = [g for _, item_gens in part for g in item_gens]  # each sample's own (RowSampler)
                batch = policy.generate([item for item, _ in part], k, rollout, gens)
                sampled = self.reward.score(batch.samples)
                hits = sampled.values[:, sampled.names.index("answer")].view(-1, k)  # an item's rows are contiguous
                called = batch.data["stat/called"].view(-1, k) if "stat/called" in batch.data else None
                out += [(hits[i].tolist(), None if called is None else called[i].tolist()) for i in range(len(hits))]
                if progress is not None:
                    progress.advance(hits.numel())
            return out

        # one generator per sample, seeded by (item, sample) alone: the same samples at any
        # eval_batch_size and on any rank
        gens = sample_generators(len(self.eval_items), k)
        shares = [(item, gens[i * k: (i + 1) * k]) for i, item in enumerate(self.eval_items)]
        answered = distributed.map_shards(sample, shares)
        if rows is not None:
            for row, (hits, _) in zip(rows, answered):
                row["sampled_answer"] = hits
        hits_t = torch.tensor([h for h, _ in answered], dtype=torch.float64)  # [items, k]
        # a success: an answer score of at least 0.5 (a partial-credit check's half counts), as the dLLM's pass@k
        out = {"sampled_accuracy": float(hits_t.mean()), f"pass@{k}": float((hits_t >= 0.5).any(-1).double().mean())}
        if answered and answered[0][1] is not None:
            out["sampled_tool_call_rate"] = float(torch.tensor([c for _, cs in answered for c in cs],
                                                               dtype=torch.float64).mean())
        return out


def _described(item) -> dict[str, Any]:
    """What an evaluation row says of its item: the question, the answer the reward checks, and
    where it came from: a data file's line (whose images it names), or a generated item's kind."""
    out = {"question": getattr(item, "question", None), "answer": getattr(item, "answer", None)}
    meta = getattr(item, "meta", None) or {}
    if getattr(item, "where", ""):
        out["where"] = item.where
    elif "kind" in meta:
        out["kind"] = meta["kind"]
    return out
