"""The dLLM task for the loop: training problems, the reward, and held-out evaluation.

Held-out evaluation decodes every problem greedily (temperature 0) with the run's sampler
strategy (rollout.eval_strategy where it is set) and scores it with the task's atoms:
`accuracy` (the answer atom), every other atom, `reward`, and `nfe` (mean function
evaluations per answer). With rollout.eval_samples = n > 0 it also samples n answers per
problem at rollout.eval_temperature (else the rollout temperature; each answer's noise seeded by the problem and sample
index alone, so before and after, and any eval_batch_size, are comparable) and
reports pass@k for k = 1..min(16, n) (the unbiased estimator of Chen et al. 2021)
and their mean NFE (`sampled_nfe`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from dllm_rl.policy import to_sample
from mmrl.core import distributed
from mmrl.core.held_out import eval_temperature, sample_generators
from mmrl.core.rewards import Reward


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n - c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def problems_of(name: str, split: str, items: Sequence) -> list:
    """A task's problems from Python: each a dllm_rl.tasks.Problem, or a dict read as a line of
    a JSONL file is ({"prompt": ..., "answer": ...}, other fields into meta). A ValueError names
    the item, where a dict failed as `'dict' object has no attribute 'prompt'` deep in the
    backend and a number answer as the tokenizer's own error."""
    from dllm_rl.tasks import Problem
    from dllm_rl.tasks.jsonl import _problem
    from mmrl.core.jsonl import DatasetError

    problems = []
    for i, item in enumerate(items):
        where = f"task {name!r}: {split} item {i}"
        if isinstance(item, dict):
            try:
                item = _problem(item, f"{split} problems", i)
            except DatasetError as e:
                raise ValueError(f"{where}, field {e.field!r}: {e.problem}") from None
            item.where = f"{split} item {i}"
        if not isinstance(item, Problem):
            raise TypeError(f"{where} is a {type(item).__name__}: give a dllm_rl.tasks.Problem or a dict "
                             "{'prompt': ..., 'answer': ...}")
        for field in ("prompt", "answer", "reference"):
            value = getattr(item, field)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{where}: Problem.{field} must be a non-empty string, got {value!r}")
        problems.append(item)
    return problems


class DLLMTask:
    def __init__(self, name: str, train: Sequence, evaluation: Sequence, reward: Reward, *,
                 answer_atom: str, rollout, batch_size: int = 128, eval_samples: int = 0):
        if not train or not evaluation:
            raise ValueError(f"task {name!r} needs training and held-out problems")
        self.name = name
        self.train = problems_of(name, "train", train)
        self.eval_problems = problems_of(name, "evaluation", evaluation)
        self.reward = reward
        self.answer_atom = answer_atom
        self.rollout = rollout
        self.batch_size = batch_size
        self.eval_samples = eval_samples
        self._greedy_drawn = None  # (policy, texts, nfe): the greedy answers evaluate last decoded

    # what evaluate() logs beside each atom's mean (a config atom may not take these names)
    metric_names = ("reward", "accuracy", "nfe", "sampled_nfe")
    metric_prefixes = ("pass@",)

    def train_prompts(self) -> list:
        return self.train

    def answers(self, policy, problems, temperature: float, generator=None, progress=None):
        """Decoded answer texts of `problems` and the NFE of each, in batches of batch_size
        (temperature 0 = greedy); `progress` (mmrl.core.held_out.EvalProgress) counts them.
        `generator`: one for all, or a list of one per problem (its answer then the same in any batch)."""
        texts, nfe = [], []
        if progress is not None:
            progress.expect(len(problems))
        for start in range(0, len(problems), self.batch_size):
            chunk = problems[start: start + self.batch_size]
            gen = generator[start: start + self.batch_size] if isinstance(generator, list) else generator
            result, _ = policy.decode([p.prompt for p in chunk], gen, temperature=temperature,
                                      strategy=self.rollout.eval_strategy)
            texts += policy.answer_text(result.completion)
            nfe.append(result.nfe.float())
            if progress is not None:
                progress.advance(len(chunk))
        return texts, torch.cat(nfe)

    def dealt_answers(self, policy, problems, temperature: float, generators=None, progress=None):
        """`answers`, each data-parallel rank decoding its share (distributed.map_shards, a
        collective; sampling draws each problem's noise from its own of `generators`); all of
        them on every rank."""
        def share(chunk):
            mine = [p for p, _ in chunk]
            gens = [g for _, g in chunk] if generators else None
            texts, nfe = self.answers(policy, mine, temperature, gens, progress)
            return list(zip(texts, nfe.tolist(), strict=True))

        pairs = distributed.map_shards(share, list(zip(problems, generators or [None] * len(problems))))
        return [t for t, _ in pairs], torch.tensor([f for _, f in pairs], dtype=torch.float32)

    def evaluate(self, policy, progress=None, rows: list | None = None) -> dict[str, float]:
        """The metrics above; `progress` (mmrl.core.held_out.EvalProgress) counts the decodes, and
        `rows` gets one dict per problem: prompt, answer, completion (greedy), nfe, scores (each
        atom's), total, and with eval_samples sampled_<answer atom> (each sampled answer's score)."""
        was_training = policy.model.training
        policy.model.eval()
        try:
            return self._evaluate(policy, progress, rows)
        finally:
            policy.model.train(was_training)

    def _evaluate(self, policy, progress=None, rows: list | None = None) -> dict[str, float]:
        texts, nfe = self.dealt_answers(policy, self.eval_problems, 0.0, progress=progress)
        # save_samples, which the trainer calls next under the same weights, takes the first of
        # these instead of decoding them again
        self._greedy_drawn = (policy, texts, nfe)
        scores = self.reward.score([to_sample(p, t) for p, t in zip(self.eval_problems, texts)])
        # Means in float64: in float32, 105 right of 200 reads 0.52499998, under a 0.525 target.
        out = {"reward": float(scores.total.double().mean()), "nfe": float(nfe.double().mean())}
        for k, name in enumerate(scores.names):
            out["accuracy" if name == self.answer_atom else name] = float(scores.values[:, k].double().mean())
        n = self.eval_samples
        if n:
            # One generator per answer, seeded by (problem, sample) alone: the same answers at any
            # eval_batch_size and on any rank. CPU ones; on a GPU each seeds one there (samplers.decode).
            gens = sample_generators(len(self.eval_problems), n)
            problems = [p for p in self.eval_problems for _ in range(n)]
            drawn, sampled_nfe = self.dealt_answers(policy, problems, eval_temperature(self.rollout), gens, progress)
            sampled = self.reward.score([to_sample(p, t) for p, t in zip(problems, drawn)])
            answer_scores = sampled.values[:, sampled.names.index(self.answer_atom)].view(-1, n)
            hits = answer_scores >= 0.5
            for k in range(1, min(16, n) + 1):
                out[f"pass@{k}"] = sum(pass_at_k(n, int(c), k) for c in hits.sum(1)) / len(hits)
            out["sampled_nfe"] = float(sampled_nfe.double().mean())
        if rows is not None:
            for i, (p, t) in enumerate(zip(self.eval_problems, texts)):
                rows.append({"prompt": p.prompt, "answer": p.answer, "completion": t, "nfe": float(nfe[i]),
                             "scores": dict(zip(scores.names, scores.values[i].tolist())),
                             "total": float(scores.total[i]),
                             **({f"sampled_{self.answer_atom}": answer_scores[i].tolist()} if n else {})})
        return out

    def save_samples(self, policy, out_dir: str | Path, tag: str, count: int = 16) -> Path:
        """The greedy answers to the first held-out problems, as JSON, for before/after comparison."""
        problems = self.eval_problems[:count]
        drawn, self._greedy_drawn = self._greedy_drawn, None  # taken once: later weights decode afresh
        if drawn is not None and drawn[0] is policy:
            texts, nfe = drawn[1][:count], drawn[2][:count]  # the evaluation just before decoded them
        else:
            texts, nfe = self.answers(policy, problems, 0.0)
        rows = [{"prompt": p.prompt, "answer": p.answer, "completion": t, "nfe": float(f)}
                for p, t, f in zip(problems, texts, nfe)]
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"samples_{tag}.json"
        path.write_text(json.dumps(rows, indent=1))
        return path
