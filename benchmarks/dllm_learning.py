"""diffu-GRPO and TraceRL side by side on the bundled tiny dLLM: held-out greedy accuracy
before and after the same budget (steps, prompts x samples per step), over several seeds.

Each run is `dllm-rl train --config configs/dllm/<method>.yaml --seed S --max-steps N`
(through the Python API); the table reports eval_before / eval_after of each summary.json.

    python benchmarks/dllm_learning.py                        # 3 seeds, both methods
    python benchmarks/dllm_learning.py --seeds 0 --steps 20   # a quick look
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

from dllm_rl import backend
from mmrl.core.config import load_config
from mmrl.core.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def run(method: str, seed: int, steps: int, out: Path, extra: list[str]) -> dict:
    cfg = load_config(backend.CONFIG_CLASS, ROOT / "configs" / "dllm" / f"{method}.yaml",
                      [f"seed={seed}", f"train.max_steps={steps}", f"output_dir={out}",
                       "logging.progress=false", *extra], defaults=backend.DEFAULT_CONFIG)
    policy, task = backend.build(cfg)
    return Trainer(cfg, policy, task, backend=backend).train()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["diffu_grpo", "tracerl"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=None, help="default: the config's train.max_steps")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "dllm-learning",
                    help="each run's output directory goes under it (default: the repository's runs/dllm-learning/)")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra override (repeatable)")
    args = ap.parse_args(argv)
    results = {}
    for method in args.methods:
        for seed in args.seeds:
            steps = args.steps
            if steps is None:
                steps = load_config(backend.CONFIG_CLASS, ROOT / "configs" / "dllm" / f"{method}.yaml",
                                    defaults=backend.DEFAULT_CONFIG).train.max_steps
            s = run(method, seed, steps, args.out / f"{method}-seed{seed}", args.extra)
            results[(method, seed)] = s
            print(json.dumps({"method": method, "seed": seed, "before": s["eval_before"],
                              "after": s["eval_after"], "seconds": s.get("train_seconds")}), flush=True)
    # the table alone did not say which command (steps, --set overrides, --out) made it
    print(f"\nfrom: python benchmarks/dllm_learning.py {shlex.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    print("| method | seed | accuracy before | accuracy after | gain (points) | format after | seconds |")
    print("|---|---|---|---|---|---|---|")
    for (method, seed), s in results.items():
        b, a = s["eval_before"]["accuracy"], s["eval_after"]["accuracy"]
        print(f"| {method} | {seed} | {b:.3f} | {a:.3f} | {100 * (a - b):+.1f} | {s['eval_after'].get('format', float('nan')):.3f} "
              f"| {s.get('train_seconds', float('nan')):.0f} |")
    for method in args.methods:
        gains = [100 * (s["eval_after"]["accuracy"] - s["eval_before"]["accuracy"])
                 for (m, _), s in results.items() if m == method]
        spread = statistics.stdev(gains) if len(gains) > 1 else 0.0
        print(f"{method}: mean gain {statistics.mean(gains):+.1f} points (sd {spread:.1f}) over {len(gains)} seeds")
    return 0


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
