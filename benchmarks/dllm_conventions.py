"""Which answer convention a dLLM writes on held-out arith problems: the task's (most
significant digit first) or the other one of a mixed pre-training corpus
(scripts/pretrain_tiny_dllm.py --reversed-share or --marked-share). With --task sudoku
(--other marked only): whether the grid is solved as the task writes it or with the mark
after it (--marked-share with --mark-tasks sudoku).

Per model: greedy and sampled answers on the same held-out problems, each counted as
"forward" (the task's answer atom scores 1), "other" (the right answer in the other
convention: its digits reversed, where that reads as a different integer, or with the "?"
mark before or after it) or wrong. forward + other is what the model computes right in
either convention: the ceiling an RL run that only picks the convention could reach.

    python benchmarks/dllm_conventions.py --models /tmp/mixed runs/x/checkpoints/step-00000300/model
    python benchmarks/dllm_conventions.py --other marked --models /tmp/marked
    python benchmarks/dllm_conventions.py --task sudoku --other marked --models /tmp/marked-sudoku \
        --set rollout.gen_length=24 --set rollout.steps=24
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dllm_rl import backend
from dllm_rl.tasks import get_task, sudoku
from dllm_rl.tasks.arith import MARK, answer_atom, parse_integer, reverse_digits, to_sample
from mmrl.core.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def right(task: str, problem, text: str) -> bool:
    """The task's success atom on `text` (arith: answer; sudoku: solved, gated by its format atom)."""
    if task == "arith":
        return bool(answer_atom(to_sample(problem, text)))
    return sudoku.accuracy([problem], [text]) == 1.0


def in_other(task: str, problem, text: str, other: str) -> bool:
    """Whether `text` is the right answer to `problem` written in the `other` convention."""
    text, answer = text.strip(), problem.answer
    if task == "sudoku":  # marked: the grid, then the mark
        return text.endswith(MARK) and right(task, problem, text[: -len(MARK)])
    if other == "marked":
        return text in (MARK + answer, answer + MARK)
    return parse_integer(text) is not None and text == reverse_digits(answer) != answer


def conventions(problems, texts, other: str = "reversed", task: str = "arith") -> dict[str, float]:
    """Shares of `texts` right in the task's convention, right only in the other one, and their sum."""
    forward = backward = 0
    for p, t in zip(problems, texts, strict=True):
        if right(task, p, t):
            forward += 1
        elif in_other(task, p, t, other):
            backward += 1
    n = len(problems)
    return {"forward": forward / n, "other": backward / n, "either": (forward + backward) / n}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=[str(ROOT / "assets" / "tiny-dllm")])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "dllm" / "diffu_grpo.yaml",
                    help="the sampler settings (rollout block) of this config are used")
    ap.add_argument("--problems", type=int, default=200, help="held-out problems")
    ap.add_argument("--samples", type=int, default=8, help="sampled answers per problem")
    ap.add_argument("--seed", type=int, default=0, help="seed of the problem draw and of the sampler")
    ap.add_argument("--other", choices=("reversed", "marked"), default="reversed",
                    help="the corpus's second convention")
    ap.add_argument("--task", choices=("arith", "sudoku"), default="arith",
                    help="held-out problems of this task (sudoku: the task's default 4-10 blanks)")
    ap.add_argument("--set", dest="extra", action="append", default=[],
                    help="a config override (repeatable), e.g. rollout.gen_length=24")
    args = ap.parse_args(argv)
    if args.problems < 1 or args.samples < 1:
        ap.error("--problems and --samples must be >= 1")
    if args.task == "sudoku" and args.other != "marked":
        ap.error("--task sudoku has one other convention: --other marked")
    problems = get_task(args.task).sample_problems(args.problems, seed=args.seed, split="eval")
    # the table alone did not say what it was measured on
    print(f"{args.task}: {args.problems} held-out problems (seed {args.seed}), greedy and {args.samples} sampled "
          f"answers each, sampler settings of {args.config}{''.join(f', --set {e}' for e in args.extra)}\n")
    print(f"| model | greedy forward | greedy {args.other} | greedy either | sampled forward | sampled {args.other} "
          "| sampled either |")
    print("|---|---|---|---|---|---|---|")
    for model in args.models:
        cfg = load_config(backend.CONFIG_CLASS, args.config,
                          [f"model.path={model}", f"task.type={args.task}", *args.extra], defaults=backend.DEFAULT_CONFIG)
        policy, task = backend.build(cfg)
        policy.model.eval()
        with torch.no_grad():
            greedy = conventions(problems, task.answers(policy, problems, 0.0)[0], args.other, args.task)
            repeated = [p for p in problems for _ in range(args.samples)]
            gen = torch.Generator().manual_seed(args.seed)
            texts, _ = task.answers(policy, repeated, cfg.rollout.temperature, gen)
            sampled = conventions(repeated, texts, args.other, args.task)
        cells = [f"{d[k]:.3f}" for d in (greedy, sampled) for k in ("forward", "other", "either")]
        print(f"| {model} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
