"""What a VLM update costs against what it trains on: the bundled tiny VLM, one real rollout
batch of the main job (configs/vlm/grpo.yaml: 8 prompts x G 8), and `Trainer.update` on
subsets of it, timed.

Two kinds of subset:
    k rows of every group   as MDAP leaves a batch: fewer rows, every prompt's image kept
    whole groups            fewer rows and fewer images

A least-squares fit, update seconds = a + b * rows + c * images, splits the cost into a fixed
part (the optimizer step and per-update overhead), a part per row (the language model's forward
and backward) and a part per image (the vision encoder, run once per group). With the measured
rollout time R per step, the fit bounds what any pruning that keeps every group can save at
equal steps: (R + update(64 rows)) / (R + update(n rows)). FastRL's goal (issue 7) asks 1.8x.

    python benchmarks/update_cost.py                                  # one optimizer step
    python benchmarks/update_cost.py --set train.mini_batches=4       # the released config's four
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from mmrl.core.config import load_config
from mmrl.core.trainer import Trainer
from mmrl.vlm import backend

ROOT = Path(__file__).resolve().parents[1]


def subsets(batch) -> list[tuple[str, int, int, torch.Tensor]]:
    """(kind, rows, images, row index) for k rows of every group and for whole groups."""
    groups = batch.groups()
    size = min(len(g) for g in groups)
    out = []
    for k in (size, size // 2, size // 4, 1):
        if k >= 1:
            out.append(("k of every group", k * len(groups), len(groups), torch.cat([g[:k] for g in groups])))
    for n in (len(groups) // 2, len(groups) // 4, 1):
        if n >= 1:
            out.append(("whole groups", sum(len(g) for g in groups[:n]), n, torch.cat(groups[:n])))
    return out


def fit(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Least squares t = a + b rows + c images."""
    x = torch.tensor([[1.0, r, i] for r, i, _ in points], dtype=torch.float64)
    y = torch.tensor([t for _, _, t in points], dtype=torch.float64)
    a, b, c = torch.linalg.lstsq(x, y[:, None]).solution.flatten().tolist()
    return a, b, c


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "vlm" / "grpo.yaml")
    ap.add_argument("--repeats", type=int, default=5, help="timings per subset (the median is kept)")
    ap.add_argument("--rollouts", type=int, default=3, help="rollout steps timed for R")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--set", dest="extra", action="append", default=[], help="config override (repeatable)")
    ap.add_argument("--out", type=Path, default=None, help="write the measurements as JSON here")
    args = ap.parse_args(argv)
    if min(args.repeats, args.rollouts, args.threads) < 1:  # no timing to take a median of
        ap.error(f"--repeats, --rollouts and --threads must be >= 1, got {args.repeats}, {args.rollouts} and "
                 f"{args.threads}")
    torch.set_num_threads(args.threads)

    sets = [f"seed={args.seed}", "optim.lr=5e-4", "output_dir=/tmp/mmrl-update-cost", "logging.progress=false",
            "logging.tensorboard=false", "rollout.eval_samples=0", *args.extra]
    cfg = load_config(backend.CONFIG_CLASS, args.config, sets, defaults=backend.DEFAULT_CONFIG)
    policy, task = backend.build(cfg)
    trainer = Trainer(cfg, policy, task, backend=backend)
    policy.model.eval()  # as Trainer.train_step: no dropout

    rollout_s, batch = [], None
    for step in range(args.rollouts):
        t0 = time.perf_counter()
        batch, _ = trainer.scheduler.next_groups(step, trainer.num_generations)
        rollout_s.append(time.perf_counter() - t0)
    rollout = statistics.median(rollout_s)

    cases = subsets(batch)
    times: dict[int, list[float]] = {j: [] for j in range(len(cases))}
    for rep in range(args.repeats):
        order = list(range(len(cases)))
        order = order[rep % len(order):] + order[:rep % len(order)]  # rotate: drift hits every case
        for j in order:
            sub = batch.select(cases[j][3])
            t0 = time.perf_counter()
            trainer.update(sub)
            times[j].append(time.perf_counter() - t0)
    rows = [{"kind": kind, "rows": r, "images": i, "update_s": statistics.median(times[j]),
             "spread_s": [min(times[j]), max(times[j])]} for j, (kind, r, i, _) in enumerate(cases)]
    a, b, c = fit([(row["rows"], row["images"], row["update_s"]) for row in rows])
    full = rows[0]["update_s"]

    print(f"rollout, median of {args.rollouts} steps: {rollout:.2f} s; "
          f"mini_batches {cfg.train.mini_batches}, {args.repeats} timings per subset\n")
    print("| subset | rows | images | update s (median) | x the full batch's | step at equal steps, "
          "full / this |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['kind']} | {row['rows']} | {row['images']} | {row['update_s']:.3f} | "
              f"{row['update_s'] / full:.2f}x | {(rollout + full) / (rollout + row['update_s']):.2f}x |")
    print(f"\nfit: update s = {a:.3f} + {b * 1000:.2f} ms x rows + {c * 1000:.1f} ms x images")
    print(f"the update's fixed part: {a / full:.0%} of the full batch's; per-row part {b * rows[0]['rows'] / full:.0%}; "
          f"per-image part {c * rows[0]['images'] / full:.0%}")
    print(f"no rows at all (every image kept): {(rollout + full) / (rollout + a + c * rows[0]['images']):.2f}x at equal steps")
    if args.out:
        args.out.write_text(json.dumps({"rollout_s": rollout_s, "mini_batches": cfg.train.mini_batches,
                                        "subsets": rows, "fit": {"a": a, "b": b, "c": c}}, indent=1))
    return 0


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
