"""arith: integer addition, subtraction and multiplication with exact answers.

Prompt: "<a><op><b>=" with op in "+", "-", "*" and non-negative operands without
leading zeros; reference completion: the exact result, "-" first if negative.

    "37+45="  -> "82"
    "7-19="   -> "-12"
    "23*8="   -> "184"
    "41*32="  -> "1312"

Difficulty: each operand's number of digits is drawn uniformly from 1..digits (from
1..mul_digits for "*", default digits), then its value uniformly among numbers of that
many digits (0-9 for one digit). So digits=2 mixes 1x1, 1x2, 2x1 and 2x2-digit problems.
Subtraction is not reordered, so about half of its answers are negative.

Rewards (reward-atom API; `arith_reward()` bundles them):
    format (weight 0.1)             the completion is one integer: optional leading "-",
                                    digits, nothing else; surrounding whitespace allowed.
    answer (weight 1.0; format)     that integer equals int(meta["answer"]) (so "082" counts
                                    as 82, "-0" as 0).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from dllm_rl.tasks import (
    MAX_CHARS,
    Problem,
    atom_accuracy,
    check_split,
    completion_text,
    meta_field,
    split_of,
    to_sample,
)
from mmrl.core.rewards import Reward, Sample, reward_atom

__all__ = [
    "MARK",
    "MAX_DIGITS",
    "OPS",
    "accuracy",
    "answer_atom",
    "arith_reward",
    "format_atom",
    "parse_integer",
    "parse_problem",
    "reverse_digits",
    "sample_problems",
    "solve",
    "to_sample",
]

OPS = ("+", "-", "*")
MAX_DIGITS = 9  # "999999999*999999999=" + an 18-digit answer = 38 characters
_TRIES_PER_PROBLEM = 1000  # draws allowed per kept problem before the split is declared empty

_INTEGER_RE = re.compile(r"\s*(-?[0-9]+)\s*")


def solve(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operator {op!r} (known: {' '.join(OPS)})")


def _operand(rng: random.Random, max_digits: int) -> int:
    d = rng.randint(1, max_digits)
    return rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1)


def _check(digits: int, mul_digits: int, ops: Sequence[str]) -> tuple[str, ...]:
    for name, value in (("digits", digits), ("mul_digits", mul_digits)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_DIGITS:  # True is no count
            raise ValueError(f"{name} must be an integer in [1, {MAX_DIGITS}], got {value!r}")
    ops = (ops,) if isinstance(ops, str) else tuple(ops)
    if not ops or any(op not in OPS for op in ops):
        raise ValueError(f"ops must be a non-empty subset of {OPS}, got {ops!r}")
    return ops


def sample_problems(
    n: int,
    seed: int,
    split: str = "train",
    *,
    digits: int = 2,
    mul_digits: int | None = None,
    ops: Sequence[str] = OPS,
) -> list[Problem]:
    """n problems of `split` ("train" or "eval"), deterministic given the arguments.

    One seeded stream of candidates, each op uniform from `ops`; a candidate is kept if
    `split_of("arith", prompt)` is `split`, so a longer list extends a shorter one and the
    splits share no prompt. Problems may repeat when the problem space is small.
    meta: {"answer", "a", "op", "b", "task": "arith"}.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    check_split(split)
    mul_digits = digits if mul_digits is None else mul_digits
    ops = _check(digits, mul_digits, ops)
    rng = random.Random(f"arith/{seed}/{digits}/{mul_digits}/{''.join(ops)}")
    problems: list[Problem] = []
    for _ in range(_TRIES_PER_PROBLEM * n):
        if len(problems) == n:
            break
        op = rng.choice(ops)
        width = mul_digits if op == "*" else digits
        a, b = _operand(rng, width), _operand(rng, width)
        prompt = f"{a}{op}{b}="
        if split_of("arith", prompt) != split:
            continue
        answer = str(solve(a, op, b))
        assert len(prompt) + len(answer) <= MAX_CHARS
        meta = {"answer": answer, "a": a, "op": op, "b": b, "task": "arith"}
        problems.append(Problem(prompt, answer, answer, meta))
    if len(problems) < n:
        raise ValueError(
            f"could not draw {n} {split!r} arith problems (ops={ops}, digits={digits})"
        )
    return problems


_PROBLEM_RE = re.compile(r"(0|[1-9][0-9]*)([-+*])(0|[1-9][0-9]*)=")


def parse_problem(prompt: str) -> Problem | None:
    """The problem a free prompt states in this task's format ("37+45=": operands without
    leading zeros, at most MAX_DIGITS digits), with its exact answer; None for any other text."""
    m = _PROBLEM_RE.fullmatch(prompt)
    if m is None or max(len(m[1]), len(m[3])) > MAX_DIGITS:
        return None
    a, op, b = int(m[1]), m[2], int(m[3])
    answer = str(solve(a, op, b))
    return Problem(prompt, answer, answer, {"answer": answer, "a": a, "op": op, "b": b, "task": "arith"})


def reverse_digits(answer: str) -> str:
    """The answer's digits in reverse order, a leading "-" kept first: "184" -> "481", "-12" -> "-21".

    The little-endian convention of scripts/pretrain_tiny_dllm.py --reversed-share; the
    answer atom does not accept it (unless the reversal reads as the same integer).
    """
    sign = "-" if answer.startswith("-") else ""
    return sign + answer[len(sign):][::-1]


MARK = "?"
"""The mark of scripts/pretrain_tiny_dllm.py --marked-share, before ("?82") or after ("82?")
the answer: the right number in a form the format atom, and so the answer atom, rejects."""


def parse_integer(text: str) -> int | None:
    """The integer `text` holds (surrounding whitespace allowed), else None; None too past
    Python's 4300-digit limit on int(text), which no answer comes near."""
    m = _INTEGER_RE.fullmatch(text)
    try:
        return int(m.group(1)) if m else None
    except ValueError:
        return None


@reward_atom("format", weight=0.1)
def format_atom(sample: Sample) -> bool:
    """1 if the completion is a single integer (optional "-"), whitespace around it allowed."""
    return _INTEGER_RE.fullmatch(completion_text(sample, "arith")) is not None


@reward_atom("answer", weight=1.0, parents=("format",))
def answer_atom(sample: Sample) -> bool:
    """1 if the completion's integer equals meta["answer"]."""
    want = int(meta_field(sample, "answer", "arith"))
    return parse_integer(completion_text(sample, "arith")) == want


def arith_reward(**kwargs) -> Reward:
    """Reward([format (0.1), answer (1.0, gated by format)]); kwargs (on_error, timeout) go to Reward."""
    return Reward([format_atom, answer_atom], **kwargs)


def accuracy(problems: Sequence[Problem], completions: Sequence[str]) -> float:
    """Fraction of completions whose "answer" atom scores 1 (so the format must hold too)."""
    return atom_accuracy(arith_reward(), "answer", problems, completions)
