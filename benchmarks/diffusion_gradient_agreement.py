"""How much signal a step's policy gradient carries: Flow-GRPO vs CAST on the bundled tiny flow model.

For a fixed set of training prompts, --batches independent rollout batches (seeds 0..B-1) of
G samples per prompt are drawn from the same weights and scored; each method's loss gradient
is taken on every batch (the same batches for every method). If a gradient were all signal,
two batches would give the same direction (cosine 1); if all noise, cosine 0. The mean
pairwise cosine between batches estimates |E g|^2 / E|g|^2 at that batch size.

    python benchmarks/diffusion_gradient_agreement.py --prompts 8 --batches 6
    python benchmarks/diffusion_gradient_agreement.py \
        --set 'reward.atoms=[{path: ../../benchmarks/atoms/dark.py:dark}]' --extra-atoms-only

The second line is a control: a reward any image model can move (benchmarks/atoms/dark.py:
1 - mean brightness, alone) shows what agreement looks like when the gradient does carry signal.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch

from diffusion_rl import backend
from mmrl.core.config import load_config
from mmrl.core.method import build_method
from mmrl.core.rewards import Reward
from mmrl.core.trainer import combined_reward

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {  # name -> (config, overrides)
    "flow_grpo": ("flow_grpo", []),
    "cast (scalar, part 1)": ("cast", ["method.projection=none"]),
    "cast (attention maps)": ("cast", []),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--set", dest="extra", action="append", default=[], help="override for every variant")
    ap.add_argument("--methods", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                    help="which losses to take gradients of (Flow-GRPO always)")
    ap.add_argument("--extra-atoms-only", action="store_true",
                    help="score with the config's reward.atoms alone (the control: drop the task's atoms)")
    args = ap.parse_args(argv)
    if args.batches < 3:
        ap.error("--batches must be at least 3 (pairwise cosines, and their standard error)")
    torch.manual_seed(0)
    names = ["flow_grpo", *[m for m in args.methods if m != "flow_grpo"]]
    cfgs = {name: load_config(backend.CONFIG_CLASS, ROOT / "configs" / "diffusion" / f"{VARIANTS[name][0]}.yaml",
                              [*VARIANTS[name][1], *args.extra, f"rollout.num_generations={args.generations}"],
                              defaults=backend.DEFAULT_CONFIG) for name in names}
    policy, task = backend.build(cfgs["flow_grpo"])
    reward = combined_reward(task.reward, cfgs["flow_grpo"])  # the task's atoms and any reward.atoms
    if args.extra_atoms_only:
        reward = Reward([a for a in reward.atoms if a.name not in task.reward.names])
    prompts = task.train[: args.prompts]
    named = [(n, p) for n, p in policy.model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    grads: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    t0 = time.perf_counter()
    for seed in range(args.batches):
        batch = policy.generate(prompts, args.generations, cfgs["flow_grpo"].rollout, torch.Generator().manual_seed(seed))
        batch.scores = reward.score(batch.samples)
        for name, cfg in cfgs.items():
            method = build_method(cfg, reward)
            adv = method.advantages(batch)
            policy.model.zero_grad(set_to_none=True)
            method.loss(policy, batch, adv).loss.backward()
            grads[name].append(torch.cat([p.grad.flatten() for p in params]))
        print(f"batch {seed + 1}/{args.batches}: reward {float(batch.rewards.mean()):.3f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\n{args.prompts} prompts x G {args.generations} = {args.prompts * args.generations} samples per batch, "
          f"{args.batches} batches, {len(params)} parameter tensors\n")
    print("| method | mean pairwise cosine between batches | min | max | cosine with Flow-GRPO, same batch |")
    print("|---|---|---|---|---|")
    out = {}
    for name, gs in grads.items():
        cos = [float(torch.nn.functional.cosine_similarity(a, b, 0)) for a, b in itertools.combinations(gs, 2)]
        same = [float(torch.nn.functional.cosine_similarity(a, b, 0)) for a, b in zip(gs, grads["flow_grpo"])]
        out[name] = {"mean": statistics.mean(cos), "sem": statistics.stdev(cos) / len(cos) ** 0.5}
        print(f"| {name} | {statistics.mean(cos):+.4f} (+-{out[name]['sem']:.4f}) | {min(cos):+.3f} | {max(cos):+.3f} "
              f"| {statistics.mean(same):.3f} |")
    # Where in the transformer the agreement lives: the same cosines, Flow-GRPO's gradient cut
    # by module (the block index kept: each block is one unit of the architecture).
    groups: dict[str, list[slice]] = {}
    at = 0
    for n, p in named:
        key = ".".join(n.split(".")[:2]) if n.split(".")[1:2] and n.split(".")[1].isdigit() else n.split(".")[0]
        groups.setdefault(key, []).append(slice(at, at + p.numel()))
        at += p.numel()
    print("\n| module (Flow-GRPO's gradient) | parameters | mean pairwise cosine | share of the gradient's squared norm |")
    print("|---|---|---|---|")
    total = statistics.mean(float(g.square().sum()) for g in grads["flow_grpo"])
    for key, slices in groups.items():
        part = [torch.cat([g[s] for s in slices]) for g in grads["flow_grpo"]]
        cos = [float(torch.nn.functional.cosine_similarity(a, b, 0)) for a, b in itertools.combinations(part, 2)]
        share = statistics.mean(float(g.square().sum()) for g in part) / total
        out.setdefault("modules", {})[key] = statistics.mean(cos)
        print(f"| {key} | {sum(s.stop - s.start for s in slices)} | {statistics.mean(cos):+.4f} | {share:.3f} |")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
