"""Reasoning-answer consistency for CORA (Consistency-Oriented Reasoning Alignment,
arXiv 2606.14691; partly a reconstruction).

CORA rewards a completion whose final answer follows from its own reasoning, right or
wrong: r_cons = lambda * P(consistent | premise, hypothesis) from an NLI-style
classifier, with premise = question + reasoning and hypothesis = "The final answer is
{a}." This module holds that classifier (`ConsistencyModel`, `consistency_atom`) and,
for shapes-qa, an exact checker (`is_consistent`): the reasoning there lists the
scene's objects left to right ("a red circle , a blue square"), so the answer it
implies can be computed from the listed objects alone, whatever the image shows.

Departures from the paper: the paper's consistency model is a large pretrained NLI
model; ours (assets/tiny-consistency-modernbert, built by
scripts/train_consistency_model.py) is a tiny ModernBERT trained from scratch on
synthetic shapes-qa pairs, so it only knows shapes-qa reasoning.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from mmrl.core.reward_models import load_sequence_classifier, sequence_classifier_config, text_limit
from mmrl.core.rewards import RewardAtom, Sample
from mmrl.core.runconfig import not_installed_note
from mmrl.vlm.models import resolve_model_path
from mmrl.vlm.tasks.scenes import COLOURS, SHAPES
from mmrl.vlm.tasks.shapes_qa import KINDS, normalize

__all__ = [
    "ConsistencyModel",
    "consistency_atom",
    "hypothesis",
    "implied_answer",
    "inconsistency_rate",
    "is_consistent",
    "parse_reasoning",
    "premise",
    "split_completion",
]

CONSISTENT = "consistent"  # the label in config.id2label whose probability is r_cons / lambda
_ANSWER_RE = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)  # as shapes_qa's

Objects = list[tuple[str, str]]  # (colour, shape), left to right


# ---------------------------------------------------------------------------- exact check


def parse_reasoning(reasoning: str) -> Objects | None:
    """The (colour, shape) objects a shapes-qa reasoning asserts, in order: "a red circle ,
    a blue square" -> [("red", "circle"), ("blue", "square")]; "nothing" -> []. Case and
    whitespace are free, a trailing "." is dropped; anything else (an unknown word, a
    missing article, an empty text) -> None."""
    text = " ".join(reasoning.lower().split()).rstrip(".").strip()
    if text == "nothing":  # describe() of an empty scene
        return []
    objects = []
    for part in text.split(","):
        words = part.split()
        if len(words) != 3 or words[0] != "a" or words[1] not in COLOURS or words[2] not in SHAPES:
            return None
        objects.append((words[1], words[2]))
    return objects


# The params each question kind's template fills (shapes_qa.KINDS): a colour or shape name, or
# for left_of the two objects, each {"colour": ..., "shape": ...}.
_PARAMS = {"count_colour": ("colour",), "count_shape": ("shape",), "colour_of": ("shape",),
           "shape_of": ("colour",), "left_of": ("a", "b")}


def implied_answer(kind: str, params: dict, objects: Objects | None) -> str | None:
    """The answer to the item's question implied by `objects` alone (normalised like
    shapes_qa.normalize); None where they do not determine one: no objects parsed, no or
    several objects of the asked shape/colour (colour_of, shape_of), or a left_of object
    missing or listed twice. `params` are checked against the kind first, whatever the
    objects (ValueError naming the missing or ill-typed param)."""
    _check_params(kind, params)
    if objects is None:
        return None
    if kind == "count_colour":
        return str(sum(c == params["colour"] for c, _ in objects))
    if kind == "count_shape":
        return str(sum(s == params["shape"] for _, s in objects))
    if kind == "colour_of":
        found = [c for c, s in objects if s == params["shape"]]
        return found[0] if len(found) == 1 else None
    if kind == "shape_of":
        found = [s for c, s in objects if c == params["colour"]]
        return found[0] if len(found) == 1 else None
    a = (params["a"]["colour"], params["a"]["shape"])
    b = (params["b"]["colour"], params["b"]["shape"])
    if a == b or objects.count(a) != 1 or objects.count(b) != 1:
        return None
    return "yes" if objects.index(a) < objects.index(b) else "no"


def _check_params(kind: str, params) -> None:
    """Up front, not where a param is read: with no objects listed, a count never reads its
    colour, and a params dict missing it would be answered "0"."""
    if kind not in KINDS:
        raise ValueError(f"unknown question kind {kind!r} (known: {', '.join(KINDS)})")
    misfit = f"params {params!r} do not fit question kind {kind!r}"
    if not isinstance(params, dict):  # a ValueError as the rest: an item's meta, not a caller's type
        raise ValueError(f"{misfit}: not a dict but {type(params).__name__}")  # noqa: TRY004
    for key in _PARAMS[kind]:
        if key not in params:
            raise ValueError(f"{misfit}: no {key!r}")
        value = params[key]
        if kind == "left_of":
            if not isinstance(value, dict) or not all(isinstance(value.get(k), str) for k in ("colour", "shape")):
                raise ValueError(f'{misfit}: {key!r} must be {{"colour": str, "shape": str}}, got {value!r}')
        elif not isinstance(value, str):
            raise ValueError(f"{misfit}: {key!r} must be a str, got {type(value).__name__}")


def split_completion(completion: str) -> tuple[str, str | None]:
    """(reasoning, answer): the text before the last <answer>...</answer> and the answer
    inside it (stripped, lower-cased, as shapes_qa.extract_answer); (completion, None)
    when there is no answer."""
    found = list(_ANSWER_RE.finditer(completion))
    if not found:
        return completion, None
    return completion[: found[-1].start()], found[-1].group(1).strip().lower()


def is_consistent(sample: Sample) -> bool | None:
    """Whether a shapes-qa completion's answer is the one its own reasoning implies
    (sample.meta holds "kind" and "params"). None when not checkable: no answer, or a
    reasoning parse_reasoning cannot read. A parsed reasoning that implies no answer
    (e.g. two squares listed for "What colour is the square?") makes any answer False."""
    meta = sample.meta or {}
    if "kind" not in meta or "params" not in meta:
        raise ValueError('is_consistent needs a shapes-qa sample: meta must hold "kind" and "params"')
    reasoning, answer = split_completion(_text(sample))
    objects = parse_reasoning(reasoning)
    if answer is None or objects is None:
        return None
    return normalize(answer) == implied_answer(meta["kind"], meta["params"], objects)


def inconsistency_rate(samples: Sequence[Sample]) -> tuple[float, int]:
    """(fraction of the checkable samples that are inconsistent, number checkable); the
    fraction is nan when none is checkable."""
    checked = [c for c in map(is_consistent, samples) if c is not None]
    if not checked:
        return math.nan, 0
    return sum(not c for c in checked) / len(checked), len(checked)


# ---------------------------------------------------------------------------- NLI classifier


def premise(question: str, reasoning: str) -> str:
    return " ".join(f"{question} {reasoning}".split())


def hypothesis(answer: str) -> str:
    return f"The final answer is {' '.join(str(answer).split())}."


class ConsistencyModel:
    """A sequence-pair classifier; `prob` is P(label "consistent" | premise, hypothesis)."""

    def __init__(self, model, tokenizer, device: str | torch.device = "cpu"):
        self.index = _consistent_index(model.config, "consistency model")
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.max_length = text_limit(model, tokenizer)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu") -> ConsistencyModel:
        """Load a local AutoModelForSequenceClassification directory with its tokenizer
        (relative paths resolve from the working directory, then the repository)."""
        if not path:
            raise ValueError("consistency model: a path is needed")
        where = resolve_model_path(str(path))
        if not (where / "config.json").is_file():
            raise FileNotFoundError(
                f"consistency model {str(path)!r}: no config.json in {str(where)!r}"
                + (not_installed_note(path) or " (build the bundled one with `python scripts/train_consistency_model.py`)")
            )
        config = sequence_classifier_config(where, f"consistency model {str(path)!r} at")
        _consistent_index(config, f"consistency model {str(path)!r}")  # before loading anything
        return cls(*load_sequence_classifier(where, config), device)

    @torch.no_grad()
    def prob(self, premises: Sequence[str], hypotheses: Sequence[str], batch_size: int = 64) -> Tensor:
        """P(consistent) per pair, [N] float32 on the CPU. A pair longer than the model's max
        length is truncated, the longer text first (in practice the premise)."""
        if len(premises) != len(hypotheses):
            raise ValueError(f"{len(premises)} premises for {len(hypotheses)} hypotheses")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model.eval()  # a caller may have trained it since
        out = []
        for i in range(0, len(premises), batch_size):
            enc = self.tokenizer(
                list(premises[i : i + batch_size]),
                list(hypotheses[i : i + batch_size]),
                padding=True,
                truncation="longest_first",
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
            out.append(logits.float().softmax(-1)[:, self.index].cpu())  # [B]
        return torch.cat(out) if out else torch.zeros(0)


def consistency_atom(
    model: ConsistencyModel | str,
    *,
    weight: float = 1.0,
    name: str = "consistency",
    parents: Sequence[str] | str = ("format",),
) -> RewardAtom:
    """A batched reward atom scoring P(consistent) of (question, reasoning, answer); its
    weight is CORA's lambda. The question is sample.prompt (policy.to_sample puts the item's
    question there) or meta["question"]. A sample without an answer scores 0."""
    if not isinstance(model, ConsistencyModel):
        model = ConsistencyModel.from_pretrained(model)

    def score(samples: list[Sample]) -> list[float]:
        values = [0.0] * len(samples)
        pairs, where = [], []
        for i, s in enumerate(samples):
            reasoning, answer = split_completion(_text(s))
            if answer is not None:
                pairs.append((premise(_question(s), reasoning), hypothesis(normalize(answer))))
                where.append(i)
        if pairs:  # one batched pass for all the answered samples
            for i, v in zip(where, model.prob(*zip(*pairs)).tolist()):
                values[i] = v
        return values

    return RewardAtom(name, score, weight=weight, parents=parents, batched=True)


def _consistent_index(config, what: str) -> int:
    labels = {str(v).lower(): int(k) for k, v in (config.id2label or {}).items()}
    if CONSISTENT not in labels:
        raise ValueError(f"{what}: config.id2label {config.id2label!r} has no {CONSISTENT!r} label")
    return labels[CONSISTENT]


def _text(sample: Sample) -> str:
    if not isinstance(sample.completion, str):
        raise TypeError(f"consistency needs the decoded completion text, got {type(sample.completion).__name__}")
    return sample.completion


def _question(sample: Sample) -> str:
    if isinstance(sample.prompt, str):
        return sample.prompt
    question = (sample.meta or {}).get("question")
    if isinstance(question, str):
        return question
    raise TypeError(f"consistency needs the question text in sample.prompt or meta['question'], "
                    f"got a {type(sample.prompt).__name__} prompt")
