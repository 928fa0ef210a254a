"""sudoku: 4x4 sudoku (digits 1-4, 2x2 boxes) with a unique solution.

A multi-step reasoning task whose answer is a whole grid, suited to parallel decoding:
cells constrain one another, so committing the easy cells first helps the hard ones.

Prompt: the 16 cells row by row, 0 for a blank, "|" between rows, then "=" (20 chars);
reference completion: the solution in the same row format, without "=" (19 chars).

    "1204|0012|2100|4320="  -> "1234|3412|2143|4321"

Cells are numbered 0..15 row by row; box b covers rows 2*(b//2)..+1, columns 2*(b%2)..+1.
The solver enumerates all 288 valid 4x4 grids once (`all_grids`, cached) and matches a
puzzle against them (a bitmask per (cell, digit)), so `solve` is exact and fast. Puzzles
are made by blanking the cells of a random valid grid, in random order, skipping any cell
whose blanking would admit a second solution, until the drawn number of blanks is reached.

Rewards (reward-atom API; `sudoku_reward()` bundles them):
    format (weight 0.1)                 exactly 4 groups of 4 digits 1-4 separated by "|";
                                        surrounding whitespace allowed.
    givens (weight 0.2; format)         every clue of meta["puzzle"] is kept.
    constraints (weight 0.3; format)    fraction of the 12 rows, columns and boxes that hold
                                        1, 2, 3, 4 once each.
    solved (weight 1.0; format)         the grid equals meta["answer"], the unique solution.
"""

from __future__ import annotations

import functools
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
    "GROUPS",
    "MAX_BLANKS",
    "accuracy",
    "all_grids",
    "constraints_atom",
    "count_satisfied",
    "format_atom",
    "from_rows",
    "givens_atom",
    "parse_grid",
    "parse_problem",
    "sample_problems",
    "solve",
    "solved_atom",
    "sudoku_reward",
    "to_rows",
    "to_sample",
]

ROWS = tuple(tuple(range(4 * r, 4 * r + 4)) for r in range(4))
COLS = tuple(tuple(range(c, 16, 4)) for c in range(4))
BOXES = tuple(
    tuple(
        4 * r + c for r in (2 * (b // 2), 2 * (b // 2) + 1) for c in (2 * (b % 2), 2 * (b % 2) + 1)
    )
    for b in range(4)
)
GROUPS = ROWS + COLS + BOXES  # the 12 constraints, each a tuple of 4 cell indices
MAX_BLANKS = 12  # a 4x4 sudoku with a unique solution needs at least 4 clues
_TRIES_PER_PROBLEM = 1000

_GRID_RE = re.compile(r"\s*([1-4]{4})\|([1-4]{4})\|([1-4]{4})\|([1-4]{4})\s*")


# ---------------------------------------------------------------------------- grids and solver


def to_rows(flat: str) -> str:
    """16 cells -> "abcd|efgh|ijkl|mnop"."""
    return "|".join(flat[i : i + 4] for i in range(0, 16, 4))


def from_rows(text: str) -> str:
    """Row format (with or without a trailing "=") or 16 flat cells -> 16 flat cells "0"-"4"."""
    body = text.removesuffix("=")
    flat = body.replace("|", "")
    rows = body.split("|")
    if len(flat) != 16 or any(ch not in "01234" for ch in flat) or (
        len(rows) > 1 and [len(r) for r in rows] != [4, 4, 4, 4]  # "|" only between rows
    ):
        raise ValueError(f"not a 4x4 sudoku: {text!r}")
    return flat


@functools.cache
def all_grids() -> tuple[str, ...]:
    """Every valid 4x4 sudoku grid as 16 flat digits, in lexicographic order (288 of them)."""
    grids: list[str] = []
    cells = ["0"] * 16
    peers = [{j for g in GROUPS if i in g for j in g if j != i} for i in range(16)]

    def fill(i: int) -> None:
        if i == 16:
            grids.append("".join(cells))
            return
        for d in "1234":
            if all(cells[j] != d for j in peers[i]):
                cells[i] = d
                fill(i + 1)
        cells[i] = "0"

    fill(0)
    return tuple(grids)


@functools.cache
def _digit_masks() -> dict[tuple[int, str], int]:
    """(cell, digit) -> bitmask over all_grids() of the grids with that digit in that cell."""
    masks = {(i, d): 0 for i in range(16) for d in "1234"}
    for k, grid in enumerate(all_grids()):
        for i, d in enumerate(grid):
            masks[(i, d)] |= 1 << k
    return masks


def _candidates(flat: str) -> int:
    """Bitmask over all_grids() of the grids that keep every clue of the flat puzzle."""
    masks = _digit_masks()
    mask = (1 << len(all_grids())) - 1
    for i, d in enumerate(flat):
        if d != "0":
            mask &= masks[(i, d)]
    return mask


def solve(puzzle: str) -> list[str]:
    """Every solution of `puzzle` (row format, optional "=", or 16 flat cells; 0 = blank),
    in row format and lexicographic order."""
    mask = _candidates(from_rows(puzzle))
    return [to_rows(g) for k, g in enumerate(all_grids()) if mask >> k & 1]


def count_satisfied(flat: str) -> int:
    """How many of the 12 rows, columns and boxes of a full flat grid hold 1-4 once each."""
    return sum(len({flat[i] for i in group}) == 4 for group in GROUPS)


# ---------------------------------------------------------------------------- generation


def _blank(rng: random.Random, grid: str, k: int) -> str | None:
    """`grid` with k cells set to "0" and a unique solution, or None if the greedy pass
    (cells in random order, each blanked unless that admits a second solution) stops short."""
    order = list(range(16))
    rng.shuffle(order)
    cells = list(grid)
    blanks = 0
    for i in order:
        if blanks == k:
            break
        cells[i] = "0"
        if _candidates("".join(cells)).bit_count() == 1:
            blanks += 1
        else:
            cells[i] = grid[i]
    return "".join(cells) if blanks == k else None


def _check_blanks(blanks) -> tuple[int, int]:
    lo, hi = (blanks, blanks) if isinstance(blanks, int) else tuple(blanks)
    if (not all(isinstance(x, int) and not isinstance(x, bool) for x in (lo, hi))  # True is no count
            or not 0 <= lo <= hi <= MAX_BLANKS):
        raise ValueError(
            f"blanks must be an int or (lo, hi) with 0 <= lo <= hi <= {MAX_BLANKS}, got {blanks!r}"
        )
    return lo, hi


def sample_problems(
    n: int, seed: int, split: str = "train", *, blanks: int | tuple[int, int] = (4, 10)
) -> list[Problem]:
    """n puzzles of `split` ("train" or "eval"), deterministic given the arguments.

    Each candidate: a valid grid uniform from all_grids(), a number of blanks uniform in
    `blanks` (an int or an inclusive (lo, hi)), blanked as the module docstring says. It is
    kept if `split_of("sudoku", prompt)` is `split`, so a longer list extends a shorter one
    and the splits share no puzzle. meta: {"answer", "puzzle" (row format, no "="),
    "blanks", "task": "sudoku"}.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    check_split(split)
    lo, hi = _check_blanks(blanks)
    rng = random.Random(f"sudoku/{seed}/{lo}/{hi}")
    grids = all_grids()
    problems: list[Problem] = []
    for _ in range(_TRIES_PER_PROBLEM * n):
        if len(problems) == n:
            break
        grid, k = rng.choice(grids), rng.randint(lo, hi)
        flat = _blank(rng, grid, k)
        if flat is None:
            continue
        puzzle = to_rows(flat)
        prompt = puzzle + "="
        if split_of("sudoku", prompt) != split:
            continue
        answer = to_rows(grid)
        assert len(prompt) + len(answer) <= MAX_CHARS
        meta = {"answer": answer, "puzzle": puzzle, "blanks": k, "task": "sudoku"}
        problems.append(Problem(prompt, answer, answer, meta))
    if len(problems) < n:
        raise ValueError(f"could not draw {n} {split!r} sudoku puzzles with blanks={blanks}")
    return problems


# ---------------------------------------------------------------------------- rewards


_PUZZLE_RE = re.compile(r"[0-4]{4}\|[0-4]{4}\|[0-4]{4}\|[0-4]{4}=")


def parse_problem(prompt: str) -> Problem | None:
    """The puzzle a free prompt states in this task's format ("1204|0012|2100|4320="), with its
    solution; None for any other text, and for a puzzle without exactly one solution (the
    "solved" atom needs the one answer)."""
    if _PUZZLE_RE.fullmatch(prompt) is None:
        return None
    solutions = solve(prompt)
    if len(solutions) != 1:
        return None
    puzzle = prompt[:-1]
    blanks = puzzle.count("0")
    return Problem(prompt, solutions[0], solutions[0],
                   {"answer": solutions[0], "puzzle": puzzle, "blanks": blanks, "task": "sudoku"})


def parse_grid(text: str) -> str | None:
    """16 flat digits if `text` is a 4x4 grid in row format (digits 1-4, whitespace around
    allowed), else None."""
    m = _GRID_RE.fullmatch(text)
    return "".join(m.groups()) if m else None


def _grid(sample: Sample) -> str:
    """The completion's grid; only called once "format" passed (the atoms' parent)."""
    flat = parse_grid(completion_text(sample, "sudoku"))
    if flat is None:
        raise ValueError(f"completion is not a 4x4 grid: {sample.completion!r}")
    return flat


@reward_atom("format", weight=0.1)
def format_atom(sample: Sample) -> bool:
    """1 if the completion is 4 groups of 4 digits 1-4 separated by "|"."""
    return parse_grid(completion_text(sample, "sudoku")) is not None


@reward_atom("givens", weight=0.2, parents=("format",))
def givens_atom(sample: Sample) -> bool:
    """1 if every clue (non-zero cell) of meta["puzzle"] is unchanged."""
    puzzle = from_rows(meta_field(sample, "puzzle", "sudoku"))
    grid = _grid(sample)
    return all(p == "0" or p == g for p, g in zip(puzzle, grid))


@reward_atom("constraints", weight=0.3, parents=("format",))
def constraints_atom(sample: Sample) -> float:
    """Fraction of the 12 rows, columns and boxes holding 1-4 once each."""
    return count_satisfied(_grid(sample)) / len(GROUPS)


@reward_atom("solved", weight=1.0, parents=("format",))
def solved_atom(sample: Sample) -> bool:
    """1 if the grid equals meta["answer"]."""
    return _grid(sample) == from_rows(meta_field(sample, "answer", "sudoku"))


def sudoku_reward(**kwargs) -> Reward:
    """Reward([format (0.1), givens (0.2), constraints (0.3), solved (1.0)]), the last three
    gated by format; kwargs (on_error, timeout) go to Reward."""
    return Reward([format_atom, givens_atom, constraints_atom, solved_atom], **kwargs)


def accuracy(problems: Sequence[Problem], completions: Sequence[str]) -> float:
    """Fraction of completions whose "solved" atom scores 1."""
    return atom_accuracy(sudoku_reward(), "solved", problems, completions)
