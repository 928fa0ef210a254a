"""The rollout scheduler side by side: sync vs pipelined (CGP) vs pipelined + frontier
dispatch (CGP + FGD), on the bundled tiny Qwen2.5-VL and shapes-qa, same seeds, one run.

All three train the same batches shape: P prompts x G samples per step, split into
`mini_batches` optimizer steps of U = P / mini_batches groups (RolloutPipe's setting:
one round, several updates). sync rolls out the round in the trainer's thread, then
trains; the pipelined modes roll out in a background engine (its own copy of the
weights, published after each round) while the trainer trains on complete groups.

Reported per mode (means over steps after the first, which warms up):
    round      seconds from a round's first rollout to its last optimizer step
               (RolloutPipe's rollout-to-train-end)
    waiting    the trainer's waiting ratio: time blocked on rollouts / (blocked + training)

    python benchmarks/scheduler.py           # 3 seeds x 12 steps per mode
    python benchmarks/scheduler.py --quick   # 1 seed x 4 steps, under 2 minutes

The last line reads `trainer waiting ratio: sync X, pipelined Y` (Y: CGP + FGD).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from mmrl.core.config import load_config
from mmrl.core.logging import read_metrics
from mmrl.core.trainer import Trainer
from mmrl.vlm import backend

MODES = {
    "sync": ["rollout.scheduler.mode=sync"],
    "pipelined (CGP)": ["rollout.scheduler.mode=pipelined", "rollout.scheduler.frontier=0"],
    "pipelined (CGP+FGD)": ["rollout.scheduler.mode=pipelined"],
}


def run(mode: str, seed: int, steps: int, out: Path, args) -> list[dict]:
    cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG, overrides=[
        f"output_dir={out}", f"seed={seed}", f"train.max_steps={steps}",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.num_generations={args.group}",
        f"train.mini_batches={args.mini_batches}", f"rollout.max_new_tokens={args.max_new_tokens}",
        "task.num_eval=4", "rollout.eval_samples=0", "train.log_samples_every=0",
        "logging.tensorboard=false", "logging.progress=false", "optim.lr=1e-3", *MODES[mode]])
    policy, task = backend.build(cfg)
    Trainer(cfg, policy, task).train()
    return read_metrics(out / "metrics.jsonl")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 seed x 4 steps per mode (under 2 minutes); an explicit "
                   "--seeds or --steps still counts")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (--quick: 0)")
    p.add_argument("--steps", type=int, default=None, help="default 12 (--quick: 4)")
    p.add_argument("--prompts", type=int, default=8, help="prompts (groups) per round")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--mini-batches", type=int, default=4, help="optimizer steps per round (U = prompts / this)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    args = p.parse_args(argv)
    # --quick used to overwrite an explicit --seeds / --steps: it only sets their defaults
    seeds, steps = ([0], 4) if args.quick else ([0, 1, 2], 12)
    args.seeds = seeds if args.seeds is None else args.seeds
    args.steps = steps if args.steps is None else args.steps
    if args.steps < 2:
        p.error("--steps must be at least 2 (the first step warms up and is left out of the means)")
    print(f"tiny Qwen2.5-VL, shapes-qa: {args.prompts} prompts x G {args.group}, {args.mini_batches} "
          f"updates per round, {args.max_new_tokens} new tokens, {args.steps} steps, seeds {args.seeds}")
    totals = {m: {"round": 0.0, "wait": 0.0, "busy": 0.0, "n": 0, "stale": 0} for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for mode in MODES:  # alternating: machine noise hits every mode alike
                rows = run(mode, seed, args.steps, Path(tmp) / f"{seed}-{len(mode)}", args)
                t = totals[mode]
                for r in rows[1:]:  # the first step warms up
                    t["round"] += r["time/round"]
                    t["wait"] += r["time/trainer_wait"]
                    t["busy"] += r["time/trainer_busy"]
                    t["stale"] = max(t["stale"], r["rollout/staleness"])
                    t["n"] += 1
                ratio = sum(r["time/trainer_wait"] for r in rows[1:]) / max(
                    1e-9, sum(r["time/trainer_wait"] + r["time/trainer_busy"] for r in rows[1:]))
                print(f"  seed {seed} {mode:20s} round {sum(r['time/round'] for r in rows[1:]) / (len(rows) - 1):.3f} s"
                      f"  waiting ratio {ratio:.3f}  reward {rows[-1]['reward/total']:.3f}", flush=True)
    base = totals["sync"]["round"] / totals["sync"]["n"]
    ratio = {}
    for mode, t in totals.items():
        ratio[mode] = t["wait"] / (t["wait"] + t["busy"])
        mean = t["round"] / t["n"]
        print(f"{mode:20s} round {mean:.3f} s ({mean / base:.2f}x sync)  waiting ratio {ratio[mode]:.3f} "
              f"({ratio[mode] / ratio['sync']:.2f}x sync)  max staleness {t['stale']}")
    print(f"trainer waiting ratio: sync {ratio['sync']:.3f}, pipelined {ratio['pipelined (CGP+FGD)']:.3f}")


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
