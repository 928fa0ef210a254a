"""VLM methods side by side on one task: each `configs/vlm/<method>.yaml` from the same
start, same seeds and steps; held-out greedy and sampled accuracy before and after.

    python benchmarks/vlm_methods.py --methods dapo vppo --seeds 0 1 --steps 100
    python benchmarks/vlm_methods.py --methods dapo vppo pacg pacg_vppo --claims
    python benchmarks/vlm_methods.py --methods grpo_mood dspo --columns accuracy mode_accuracy coverage \
        ood/mode_accuracy ood/coverage

Every run trains at optim.lr=1e-3 (the rate RESULTS.md's tables ran at), not its config's own,
unless --set optim.lr=X says otherwise; the line above the table gives the rate used.

--claims adds PACG's measure (mmrl.vlm.methods.pacg.claim_report): how persistent the
greedy reasoning's claims are when half the image patches are blacked out, for claims
false of the scene and claims true of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from mmrl.core.config import load_config
from mmrl.core.trainer import Trainer
from mmrl.vlm import backend
from mmrl.vlm.methods.pacg import claim_report

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("accuracy", "sampled_accuracy")
CLAIM_COLUMNS = ("persistence_false", "persistence_true", "false_claim_rate", "claims_per_response")


def run(method: str, seed: int, steps: int, out: Path, extra: list[str], claims: bool = False) -> dict:
    cfg = load_config(backend.CONFIG_CLASS, ROOT / "configs" / "vlm" / f"{method}.yaml",
                      [f"seed={seed}", f"train.max_steps={steps}", f"output_dir={out}", "logging.progress=false",
                       "logging.tensorboard=false", "optim.lr=1e-3", *extra],  # RESULTS.md's tables ran at 1e-3
                      defaults=backend.DEFAULT_CONFIG)
    policy, task = backend.build(cfg)
    measure = (lambda: claim_report(policy, task.eval_items, max_new_tokens=cfg.rollout.max_new_tokens,
                                    seed=seed, stop=task.stop)) if claims else dict
    before = measure()
    summary = Trainer(cfg, policy, task, backend=backend).train()
    summary["eval_before"].update(before)
    summary["eval_after"].update(measure())
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["dapo", "vppo"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "vlm-methods",
                    help="each run's output directory goes under it (default: the repository's runs/vlm-methods/)")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra override (repeatable)")
    ap.add_argument("--claims", action="store_true", help="also measure claim persistence (PACG's check)")
    ap.add_argument("--columns", nargs="+", default=list(COLUMNS),
                    help="evaluation keys to tabulate (shapes-mood: mode_accuracy coverage ood/mode_accuracy ...)")
    args = ap.parse_args(argv)
    columns = tuple(args.columns) + (CLAIM_COLUMNS if args.claims else ())
    results = {}
    for seed in args.seeds:
        for method in args.methods:
            s = run(method, seed, args.steps, args.out / f"{method}-seed{seed}", args.extra, args.claims)
            results[(method, seed)] = s
            print(json.dumps({"method": method, "seed": seed, "before": s["eval_before"], "after": s["eval_after"],
                              "seconds": s.get("train_seconds")}), flush=True)
    # the table alone did not say its steps, learning rate (1e-3 by this script, not the config's) or overrides
    lrs = sorted({s["config"]["optim"]["lr"] for s in results.values()})
    print(f"\n{args.steps} steps, optim.lr {' / '.join(map(str, lrs))}{''.join(f', --set {e}' for e in args.extra)}; "
          f"runs in {args.out}")
    print("| method | seed | " + " | ".join(columns) + " | seconds |")
    print("|---|---|" + "---|" * len(columns) + "---|")
    for (method, seed), s in results.items():
        cells = " | ".join(f"{s['eval_before'][c]:.3f} -> {s['eval_after'][c]:.3f}" if c in s["eval_after"] else "-"
                           for c in columns)  # a metric of one method only (CORA's consistency) is "-" for the rest
        print(f"| {method} | {seed} | {cells} | {s.get('train_seconds', float('nan')):.0f} |")
    for method in args.methods:
        runs = [s for (m, _), s in results.items() if m == method]
        gains = [f"{c} {100 * statistics.mean(s['eval_after'][c] - s['eval_before'][c] for s in runs):+.1f}"
                 for c in columns if all(c in s["eval_after"] for s in runs)]
        print(f"{method}: mean gain " + ", ".join(gains))
    return 0


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
