"""Greedy accuracy of dLLMs on arith problems of the train split (what pre-training and RL
draw from) against the held-out split: how much of a model's accuracy is memory.

    python benchmarks/dllm_split_gap.py                         # the bundled model
    python benchmarks/dllm_split_gap.py --models assets/tiny-dllm /tmp/other --problems 400
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dllm_rl import backend
from dllm_rl.tasks import get_task
from mmrl.core.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=[str(ROOT / "assets" / "tiny-dllm")])
    ap.add_argument("--problems", type=int, default=400, help="problems per split")
    ap.add_argument("--seed", type=int, default=123, help="seed of the problem draw")
    ap.add_argument("--digits", type=int, default=2)
    args = ap.parse_args(argv)
    if args.problems < 1:
        ap.error(f"--problems must be >= 1, got {args.problems}")
    arith = get_task("arith")
    # the table alone did not say what it was measured on
    print(f"arith, {args.digits}-digit operands: {args.problems} problems per split (seed {args.seed}), greedy "
          "accuracy\n")
    print("| model | train split | held-out split | gap (points) |\n|---|---|---|---|")
    for model in args.models:
        cfg = load_config(backend.CONFIG_CLASS, ROOT / "configs" / "dllm" / "diffu_grpo.yaml",
                          [f"model.path={model}", f"task.options.digits={args.digits}"],
                          defaults=backend.DEFAULT_CONFIG)
        policy, task = backend.build(cfg)
        acc = {}
        for split in ("train", "eval"):
            problems = arith.sample_problems(args.problems, seed=args.seed, split=split, digits=args.digits)
            texts, _ = task.answers(policy, problems, 0.0)  # greedy, the config's sampler
            acc[split] = arith.accuracy(problems, texts)
        print(f"| {model} | {acc['train']:.3f} | {acc['eval']:.3f} | {100 * (acc['train'] - acc['eval']):+.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
