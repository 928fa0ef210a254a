"""The sampler table: pass@1, pass@8 and mean NFE of one dLLM under every commit strategy of
dllm_rl.samplers (low_confidence, threshold = Fast-dLLM, fork = Fork-dLLM, tau_budget =
SLIM-RL, ar), on the same held-out problems with the same seeds, side by side in one run.

Each problem gets n answers at the given temperature (seeded generator, identical for every
strategy); pass@k is the unbiased estimator from those n; NFE is forward passes per answer.

    python benchmarks/dllm_samplers.py                       # bundled model, arith, n=16
    python benchmarks/dllm_samplers.py --model runs/x/checkpoints/step-00000100/model
    python benchmarks/dllm_samplers.py --quick               # 40 problems, n=8

Prints a Markdown table (the one in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from dllm_rl import backend
from dllm_rl.samplers import STRATEGIES
from mmrl.core.config import load_config


def table(args) -> list[dict]:
    overrides = [f"task.type={args.task}", f"task.num_eval={args.problems}", f"rollout.eval_samples={args.n}",
                 f"rollout.temperature={args.temperature}", f"rollout.gen_length={args.gen_length}",
                 f"rollout.block_length={args.block_length}", f"rollout.steps={args.gen_length}"]
    own = {"threshold": [f"rollout.threshold={args.threshold}"], "fork": [f"rollout.threshold={args.threshold}"],
           "tau_budget": [f"rollout.tau={args.tau}"]}  # each to the decoders that read it (no unused-key warning)
    if args.model:
        overrides.append(f"model.path={args.model}")
    rows = []
    for strategy in STRATEGIES:
        cfg = load_config(backend.CONFIG_CLASS, None, overrides + own.get(strategy, []) + [f"rollout.strategy={strategy}"],
                          defaults=backend.DEFAULT_CONFIG)
        policy, task = backend.build(cfg)
        t0 = time.perf_counter()
        with torch.no_grad():
            m = task.evaluate(policy)
        rows.append({"strategy": strategy, "greedy accuracy": m["accuracy"], "greedy NFE": m["nfe"],
                     "pass@1": m["pass@1"], "pass@8": m.get("pass@8", float("nan")),
                     "NFE": m["sampled_nfe"], "seconds": time.perf_counter() - t0})
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the bundled tiny dLLM)")
    ap.add_argument("--task", default="arith")
    ap.add_argument("--problems", type=int, default=None, help="held-out problems (default 200; --quick: 40)")
    ap.add_argument("--n", type=int, default=None, help="answers per problem (default 16; --quick: 8)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--gen-length", type=int, default=8)
    ap.add_argument("--block-length", type=int, default=4)
    ap.add_argument("--threshold", type=float, default=0.8)
    ap.add_argument("--tau", type=float, default=0.9)
    ap.add_argument("--quick", action="store_true",
                    help="40 problems x 8 answers, about a minute; an explicit --problems or --n still counts")
    args = ap.parse_args(argv)
    # --quick used to overwrite an explicit --problems / --n, so the table's header named counts not asked for
    problems, n = (40, 8) if args.quick else (200, 16)
    args.problems = problems if args.problems is None else args.problems
    args.n = n if args.n is None else args.n
    torch.set_num_threads(min(2, torch.get_num_threads()))
    rows = table(args)
    print(f"\n{args.task}, {args.problems} held-out problems, n={args.n} answers each at temperature "
          f"{args.temperature}, gen_length {args.gen_length}, block {args.block_length}, "
          f"steps {args.gen_length}, threshold {args.threshold}, tau {args.tau}\n")
    print("| strategy | pass@1 | pass@8 | mean NFE | NFE / ar | greedy acc. | greedy NFE |")
    print("|---|---|---|---|---|---|---|")
    ar = next(r for r in rows if r["strategy"] == "ar")["NFE"]
    for r in rows:
        print(f"| {r['strategy']} | {r['pass@1']:.3f} | {r['pass@8']:.3f} | {r['NFE']:.2f} | "
              f"{r['NFE'] / ar:.2f}x | {r['greedy accuracy']:.3f} | {r['greedy NFE']:.2f} |")
    return 0


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
