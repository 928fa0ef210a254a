"""Users' own problems for the dLLM, as JSON lines (blank lines are ignored):

    {"prompt": "12+7=", "answer": 19}
    {"prompt": "opposite of up:", "answer": "down", "source": "quiz"}

- "prompt": a non-empty string (required), in characters the model's tokenizer can encode
  (the bundled tiny model's are `dllm_rl.tasks.CHARSET`; the backend checks every prompt).
- "answer": a non-empty string or a number (required); meta["answer"] = str(answer).
- "reference": the SFT target completion (optional; default: the answer), a non-empty string
  or a number read as the answer is.
- every other field is copied into meta, where reward atoms read it.

One atom scores: `answer` (weight 1), 1 where the decoded completion equals the answer,
surrounding whitespace aside (case counts). Atoms of your own join it through
reward.atoms. Every error is a DatasetError naming the file, the line and the field.
"""

from __future__ import annotations

import os
import unicodedata
import warnings
from collections.abc import Sequence

from dllm_rl.tasks import Problem, atom_accuracy, completion_text, meta_field, to_sample  # noqa: F401  (exposed)
from mmrl.core.jsonl import DatasetError, HeldOutWarning, answer_text, read_objects, text_and_answer
from mmrl.core.rewards import Reward, Sample, reward_atom

RESERVED_FIELDS = ("prompt", "answer", "reference")


def load_problems(path: str | os.PathLike) -> list[Problem]:
    """The problems of a JSONL file (see the module docstring)."""
    problems = [_problem(obj, path, lineno) for lineno, obj in read_objects(path)]
    if not problems:
        raise DatasetError(path, None, None, "empty dataset: no problems")
    return problems


def check_overlap(train: Sequence[Problem], evaluation: Sequence[Problem]) -> None:
    """Warn (one warning each, naming the first case) where held-out prompts are also training
    prompts (held-out accuracy then counts problems the model trained on), and where one prompt
    has two answers (the answer atom can reward only one of them on a given line). Both may
    be meant; neither was said."""
    first: dict[str, Problem] = {}
    for p in train:
        first.setdefault(p.prompt, p)
    seen = [p for p in evaluation if p.prompt in first]
    if seen:
        p, n = seen[0], len(seen)
        # one file given as both (its "line 1; line 1" read as a typo): say so
        where = (f"{p.where}, the training file itself: task.eval_path is task.train_path"
                 if p.where and p.where == first[p.prompt].where else f"{p.where}; {first[p.prompt].where}")
        warnings.warn(f"{n} of the {len(evaluation)} held-out problems {'has' if n == 1 else 'have'} a training "
                      f"problem's prompt (the first: {p.prompt!r}, {where}): held-out accuracy counts problems the "
                      "model trains on", HeldOutWarning, stacklevel=2)
    for p in evaluation:
        first.setdefault(p.prompt, p)
    clash = [p for p in (*train, *evaluation) if p.answer != first[p.prompt].answer]
    if clash:
        p, q, n = clash[0], first[clash[0].prompt], len(clash)
        warnings.warn(f"{n} problem{'s' if n > 1 else ''} repeat{'' if n > 1 else 's'} a prompt with another answer "
                      f"(the first: {p.prompt!r}, answer {q.answer!r} on {q.where}; {p.answer!r} on {p.where}): "
                      "a completion can be right on one of them only", UserWarning, stacklevel=2)


def _problem(obj: dict, path, lineno: int) -> Problem:
    def error(field, problem):
        return DatasetError(path, lineno, field, problem)

    prompt, answer = text_and_answer(obj, "prompt", error)
    reference = obj.get("reference", answer)
    if isinstance(reference, str) and not reference.strip():
        raise error("reference", f"must be a non-empty string, got {reference!r}")
    # a number as the answer is read: {"answer": 19, "reference": 19} was refused as "not a string"
    reference = answer_text(reference, "reference", error)
    meta = {k: v for k, v in obj.items() if k not in RESERVED_FIELDS}
    meta["answer"] = answer
    return Problem(prompt, answer, reference, meta, where=f"{path}, line {lineno}")


@reward_atom("answer", weight=1.0)
def answer_atom(sample: Sample) -> bool:
    """1 if the completion, stripped, equals meta["answer"], stripped, both in Unicode's composed
    form (NFC: "é" as one character and as e + accent, as macOS writes file text, are one answer)."""
    given, answer = completion_text(sample, "jsonl"), str(meta_field(sample, "answer", "jsonl"))
    return unicodedata.normalize("NFC", given.strip()) == unicodedata.normalize("NFC", answer.strip())


def jsonl_reward(**kwargs) -> Reward:
    """Reward([answer]); kwargs (on_error, timeout) go to Reward."""
    return Reward([answer_atom], **kwargs)


def accuracy(problems: Sequence[Problem], completions: Sequence[str]) -> float:
    return atom_accuracy(jsonl_reward(), "answer", problems, completions)


def sample_problems(n: int, seed: int, split: str = "train", **kwargs) -> list[Problem]:
    raise ValueError("jsonl problems are read from task.train_path and task.eval_path, not generated")


def parse_problem(prompt: str) -> Problem | None:
    """None: a free prompt has no known answer (sample reports it unscored)."""
    return None
