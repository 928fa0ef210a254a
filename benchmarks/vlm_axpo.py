"""AXPO vs GRPO vs GRPO with twice the rollouts on shapes-zoom, side by side, same seeds.

Every arm starts from the bundled tool-using tiny VLM (assets/tiny-qwen2.5-vl-tools) with
configs/vlm/axpo.yaml's task and tools, the same steps and prompts per step:
    grpo      method.type=grpo, G = num_generations
    grpo_2x   method.type=grpo, G = 2 x num_generations
    axpo      method.type=axpo, G = num_generations (+ its resamples)
The table: held-out tool-call rate (sampled), Pass@1 (sampled accuracy), Pass@k, greedy
accuracy, before and after, and the tokens each arm decoded in training (rollouts and
resamples, from rollout/decoded_tokens).

    python benchmarks/vlm_axpo.py                           # 2 seeds
    python benchmarks/vlm_axpo.py --seeds 0 --steps 10      # a quick look
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

from mmrl.core.config import load_config
from mmrl.core.logging import read_metrics
from mmrl.core.trainer import Trainer
from mmrl.vlm import backend

ROOT = Path(__file__).resolve().parents[1]
ARMS = {
    "grpo": ["method.type=grpo"],
    "grpo_2x": ["method.type=grpo", "rollout.num_generations={g2}"],
    "axpo": ["method.type=axpo"],
}


def run(arm: str, seed: int, steps: int, g: int, out: Path, extra: list[str]) -> dict:
    sets = [s.format(g2=2 * g) for s in ARMS[arm]]
    cfg = load_config(backend.CONFIG_CLASS, ROOT / "configs" / "vlm" / "axpo.yaml",
                      [f"seed={seed}", f"train.max_steps={steps}", f"output_dir={out}", f"rollout.num_generations={g}",
                       "logging.progress=false", "logging.tensorboard=false", *sets, *extra],
                      defaults=backend.DEFAULT_CONFIG)
    policy, task = backend.build(cfg)
    summary = Trainer(cfg, policy, task, backend=backend).train()
    rows = read_metrics(out / "metrics.jsonl")
    summary["decoded_tokens"] = sum(r.get("rollout/decoded_tokens", 0.0) for r in rows)
    summary["resampled"] = sum(r.get("axpo/resampled", 0.0) for r in rows)
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--g", type=int, default=8, help="num_generations of grpo and axpo (grpo_2x: twice)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "vlm-axpo",
                    help="each run's output directory goes under it (default: the repository's runs/vlm-axpo/)")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra override (repeatable)")
    args = ap.parse_args(argv)
    results = {}
    for seed in args.seeds:
        for arm in args.arms:
            s = run(arm, seed, args.steps, args.g, args.out / f"{arm}-seed{seed}", args.extra)
            results[(arm, seed)] = s
            print(json.dumps({"arm": arm, "seed": seed, "before": s["eval_before"], "after": s["eval_after"],
                              "decoded_tokens": s["decoded_tokens"], "resampled": s["resampled"],
                              "seconds": s.get("train_seconds")}), flush=True)
    k = next(iter(results.values()))["config"]["rollout"]["eval_samples"]
    cols = ["sampled_tool_call_rate", "sampled_accuracy", f"pass@{k}", "accuracy"]
    # the table alone did not say which command (steps, --set overrides, --out) made it
    print(f"\nfrom: python benchmarks/vlm_axpo.py {shlex.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    print(f"| arm | seed | tool calls (sampled) | Pass@1 | Pass@{k} | greedy acc | decoded tokens | resampled | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (arm, seed), s in results.items():
        b, a = s["eval_before"], s["eval_after"]
        cells = " | ".join(f"{b.get(c, float('nan')):.3f} -> {a.get(c, float('nan')):.3f}" for c in cols)
        print(f"| {arm} | {seed} | {cells} | {s['decoded_tokens']:.0f} | {s['resampled']:.0f} "
              f"| {s.get('train_seconds', float('nan')):.0f} |")
    print()
    for arm in args.arms:
        runs = [s for (a, _), s in results.items() if a == arm]
        gains = {c: statistics.mean(s["eval_after"].get(c, 0) - s["eval_before"].get(c, 0) for s in runs) for c in cols}
        tokens = statistics.mean(s["decoded_tokens"] for s in runs)
        print(f"{arm}: mean gain " + ", ".join(f"{c} {100 * v:+.1f}" for c, v in gains.items())
              + f"; mean decoded tokens {tokens:.0f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
