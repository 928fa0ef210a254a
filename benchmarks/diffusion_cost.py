"""What Flow-GRPO's log-probs cost: SDE rollout and rollout + update vs plain ODE sampling
of the same model, same batch, same steps, measured side by side (alternating, repeated).

    python benchmarks/diffusion_cost.py            # bundled tiny flow model, 64 images, 10 steps, window 2
    python benchmarks/diffusion_cost.py --repeats 3 --batch 16

Reported: seconds per batch (median over repeats) and the ratios to ODE sampling.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from diffusion_rl import backend
from mmrl.core.config import load_config
from mmrl.core.trainer import Trainer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64, help="images per batch (prompts x G; the default run: 8 x 8)")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--window", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="/tmp/mmrl-diffusion-cost", help="the trainer's output directory (nothing is saved)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.group < 1:
        p.error(f"--repeats and --group must be >= 1, got {args.repeats} and {args.group}")
    if args.batch < args.group or args.batch % args.group:  # else it would time fewer images than it reports
        p.error(f"--batch ({args.batch}) must be a multiple of --group ({args.group}): prompts x G images")
    # the default run's window starts in steps 0-1; with fewer steps it starts anywhere that fits
    start = [] if args.steps >= args.window + 2 else ["rollout.window_start=null"]
    cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG, overrides=[
        f"rollout.num_generations={args.group}", f"rollout.prompts_per_step={args.batch // args.group}",
        f"rollout.num_steps={args.steps}", f"rollout.window_size={args.window}", *start, "task.num_eval=1",
        "logging.tensorboard=false", "logging.progress=false", f"output_dir={args.out}"])
    policy, task = backend.build(cfg)
    trainer = Trainer(cfg, policy, task)
    prompts = task.train[: args.batch // args.group]
    texts = [q for q in prompts for _ in range(args.group)]
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"ode sampling": [], "sde rollout": [], "sde rollout + update": []}
    for r in range(args.repeats + 1):  # the first round warms up
        t0 = time.perf_counter()
        policy.sample_images(texts, list(range(len(texts))), args.steps)
        t1 = time.perf_counter()
        with torch.no_grad():
            batch = policy.generate(prompts, args.group, cfg.rollout, gen)
        t2 = time.perf_counter()
        batch.scores = trainer.reward.score(batch.samples)
        batch.advantages = trainer.method.advantages(batch)
        t3 = time.perf_counter()
        trainer.update(batch)
        t4 = time.perf_counter()
        if r:
            times["ode sampling"].append(t1 - t0)
            times["sde rollout"].append(t2 - t1)
            times["sde rollout + update"].append((t2 - t1) + (t4 - t3))
    base = statistics.median(times["ode sampling"])
    print(f"{args.batch} images, {args.steps} steps, SDE window {args.window}, {args.repeats} repeats "
          f"(medians); the reward is not counted")
    for k, v in times.items():
        m = statistics.median(v)
        print(f"  {k:22s} {m:.3f} s   {m / base:.2f}x ODE sampling")
    return 0


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
