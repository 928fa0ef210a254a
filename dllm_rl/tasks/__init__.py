"""Synthetic verifiable tasks for the tiny masked-diffusion LM: `arith` and `sudoku` (and
`jsonl`, users' own problems from files: dllm_rl.tasks.jsonl).

Both tasks are written for a character-level model whose vocabulary is exactly CHARSET
(digits, ``+-*/=()., :|?``, newline, lowercase a-z) plus the special tokens <pad>,
<mask> and <eos>. Prompts and completions use only CHARSET, and a prompt plus its
reference completion fits in MAX_CHARS (64) characters. The model generates a
fixed-length completion whose tail is <eos>; the caller decodes the text before the
first <eos> and hands only that to the rewards.

    task  prompt                   reference (SFT target)   atoms (weight; parents)
    arith "37+45="                 "82"                     format (0.1), answer (1.0; format)
    sudoku "1204|0012|2100|4320="  "1234|3412|2143|4321"    format (0.1), givens (0.2; format),
                                                            constraints (0.3; format),
                                                            solved (1.0; format)

Every task module exposes:
    sample_problems(n, seed, split="train", **kwargs) -> list[Problem]
    <task>_reward(**kwargs) -> Reward       (kwargs: on_error, timeout -> Reward)
    to_sample(problem, completion) -> Sample
    accuracy(problems, completions) -> float
and TASKS / get_task(name) bundle them as a `Task`.

Splits: a prompt belongs to "eval" iff a hash of (task, prompt) falls below
EVAL_FRACTION (`split_of`), else to "train"; `sample_problems` draws from a seeded stream
and keeps only prompts of the requested split. So the two splits never share a prompt,
whatever the seeds and settings of the two calls, and each call is deterministic.
Problems may repeat within a split where the problem space is small (1-digit arith).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mmrl.core.jsonl import HeldOutWarning
from mmrl.core.rewards import Reward, Sample

__all__ = [
    "CHARSET",
    "EVAL_FRACTION",
    "MAX_CHARS",
    "SPLITS",
    "TASKS",
    "Problem",
    "Task",
    "get_task",
    "parse_problem",
    "split_of",
    "to_sample",
]

CHARSET = "0123456789+-*/=()., :|?\n" + "abcdefghijklmnopqrstuvwxyz"  # the tokenizer's characters
MAX_CHARS = 64  # the model's context: prompt + completion
EVAL_FRACTION = 0.1  # share of the prompt space held out for "eval" (fixed: splits stay disjoint)
SPLITS = ("train", "eval")


@dataclass
class Problem:
    """One task instance. `answer` is what the rewards check (also in meta["answer"]);
    `reference` is the SFT target completion (without <eos>); meta is what the rewards
    read (the Sample's meta) plus generator details. `where` is the file and line of a
    problem read from a file ("train.jsonl, line 3"), for the errors that name it."""

    prompt: str
    answer: str
    reference: str
    meta: dict = field(default_factory=dict)
    where: str = field(default="", compare=False, repr=False)


def split_of(task: str, prompt: str) -> str:
    """The split of a prompt: "eval" for a fixed EVAL_FRACTION of prompts (by a sha256 of task
    and prompt), else "train". Stable across processes and Python versions."""
    digest = hashlib.sha256(f"{task}\x00{prompt}".encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") < EVAL_FRACTION * 2**64 else "train"


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def completion_text(sample: Sample, task: str) -> str:
    """The decoded completion, or TypeError: the rewards judge text only."""
    if not isinstance(sample.completion, str):
        raise TypeError(
            f"{task} rewards need the decoded completion text, got "
            f"{type(sample.completion).__name__}"
        )
    return sample.completion


def to_sample(problem: Problem, completion: str) -> Sample:
    """What a task's atoms see: the prompt, the decoded completion and the problem's meta."""
    return Sample(prompt=problem.prompt, completion=completion, meta=problem.meta)


def meta_field(sample: Sample, key: str, task: str):
    if not sample.meta or key not in sample.meta:
        raise ValueError(f"{task}: sample.meta must hold {key!r}")
    return sample.meta[key]


def atom_accuracy(
    reward: Reward, atom: str, problems: Sequence[Problem], completions: Sequence[str]
) -> float:
    """Fraction of problems whose completion scores >= 0.5 on `atom` of `reward` (after gating)."""
    if len(problems) != len(completions):
        raise ValueError(f"{len(completions)} completions for {len(problems)} problems")
    if not problems:
        raise ValueError("accuracy of an empty list")
    samples = [Sample(p.prompt, c, p.meta) for p, c in zip(problems, completions)]
    scores = reward.score(samples)
    column = scores.values[:, scores.names.index(atom)]  # [N]
    return float((column >= 0.5).float().mean())


@dataclass(frozen=True)
class Task:
    """A task's entry points. `success_atom` is the atom that `accuracy` counts."""

    name: str
    sample_problems: Callable[..., list[Problem]]
    reward: Callable[..., Reward]
    to_sample: Callable[[Problem, str], Sample]
    accuracy: Callable[[Sequence[Problem], Sequence[str]], float]
    success_atom: str
    parse_problem: Callable[[str], Problem | None]  # a free prompt in the task's format, with its answer


def _generator(task: str, sample_problems: Callable[..., list[Problem]]) -> Callable[..., list[Problem]]:
    """`sample_problems` as the registry gives it: an option it does not take is refused by name,
    listing those it takes (task.options reaches it as keywords: a misspelt or guessed one read as
    Python's "sample_problems() got an unexpected keyword argument 'difficulty'"), and held-out
    problems that are mostly repeats are warned of (HeldOutWarning)."""
    known = [p.name for p in inspect.signature(sample_problems).parameters.values() if p.kind is p.KEYWORD_ONLY]

    @functools.wraps(sample_problems)
    def checked(n, seed, split="train", **options):
        unknown = [k for k in options if k not in known]
        if unknown:
            raise ValueError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                             f"(the {task} generator takes {', '.join(known)})")
        problems = sample_problems(n, seed, split, **options)
        # A small problem space (1-digit arith, sudoku without blanks) holds few held-out prompts,
        # drawn again and again: accuracy over 200 draws of 32 prompts weighs each by its draws.
        distinct = len({p.prompt for p in problems})
        if split == "eval" and 2 * distinct < n:
            warnings.warn(f"{n} held-out {task} problems drawn (task.num_eval) hold only {distinct} distinct prompts "
                          f"({f'options {options}' if options else 'the default options'} leave few in the held-out "
                          f"split), so held-out accuracy counts each about {round(n / distinct)} times; lower "
                          "task.num_eval or widen the problems (task.options)", HeldOutWarning, stacklevel=2)
        return problems

    return checked


# The task modules import Problem and the helpers above, so they come after them.
from dllm_rl.tasks import arith, jsonl, sudoku

TASKS: dict[str, Task] = {
    "arith": Task(
        "arith",
        _generator("arith", arith.sample_problems),
        arith.arith_reward,
        arith.to_sample,
        arith.accuracy,
        "answer",
        arith.parse_problem,
    ),
    "sudoku": Task(
        "sudoku",
        _generator("sudoku", sudoku.sample_problems),
        sudoku.sudoku_reward,
        sudoku.to_sample,
        sudoku.accuracy,
        "solved",
        sudoku.parse_problem,
    ),
    # users' own problems (task.train_path, task.eval_path): dllm_rl.tasks.jsonl
    "jsonl": Task("jsonl", jsonl.sample_problems, jsonl.jsonl_reward, jsonl.to_sample, jsonl.accuracy,
                  "answer", jsonl.parse_problem),
}


def parse_problem(task: str, text: str) -> Problem | None:
    """`text` as a problem of the task named `task`, with its exact answer, where it is in the
    task's format (Task.parse_problem); None for other text or an unknown task."""
    spec = TASKS.get(task)
    return spec.parse_problem(text) if spec is not None else None


def get_task(name: str) -> Task:
    """TASKS[name]; ValueError listing the known names for any other name."""
    try:
        return TASKS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown task {name!r} (known: {', '.join(TASKS)})") from None
