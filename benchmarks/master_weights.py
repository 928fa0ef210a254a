"""How far training moves bfloat16 weights, with and without float32 master weights
(optim.master_weights), against float32: each backend's bundled model and default config.

For each backend, three arms from the same start and seed: float32, bfloat16 with master
weights (the default), bfloat16 without. Each trains `--steps` steps at a fine-tuning learning
rate (`--lr`, no warm-up), then reports the displacement ||theta - theta_0|| of the model's
weights and of the optimizer's (the float32 copies where there are some), and the share of the
model's weights that changed at all. AdamW moves a weight about lr per step, so without master
weights a bfloat16 weight moves only where lr is above half its rounding step.

    python benchmarks/master_weights.py                       # lr 1e-5, 20 / 5 / 5 steps
    python benchmarks/master_weights.py --lr 1e-6 --steps 1   # one step at lr 1e-6
"""

from __future__ import annotations

import argparse
import importlib
import json
import tempfile
import warnings

import torch

from mmrl.core.config import load_config
from mmrl.core.trainer import Trainer

BACKENDS = {"vlm": "mmrl.vlm.backend", "dllm": "dllm_rl.backend", "diffusion": "diffusion_rl.backend"}
ARMS = {"float32": ["model.dtype=float32"],
        "bfloat16 + master": ["model.dtype=bfloat16", "optim.master_weights=true"],
        "bfloat16 plain": ["model.dtype=bfloat16", "optim.master_weights=false"]}


def displacement(now: list[torch.Tensor], start: list[torch.Tensor]) -> float:
    return sum(float((a.detach().float() - s).square().sum()) for a, s in zip(now, start)) ** 0.5


def run(name: str, arm: list[str], lr: float, steps: int, seed: int, extra: list[str]) -> dict:
    backend = importlib.import_module(BACKENDS[name])
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG, overrides=[
            *arm, f"optim.lr={lr}", "optim.warmup_steps=0", f"seed={seed}", "train.eval_every=0",
            f"train.max_steps={steps}", f"output_dir={out}", *extra])
        trainer = Trainer(cfg, *backend.build(cfg))
        start = [p.detach().float().clone() for p in trainer.params]
        for _ in range(steps):
            trainer.train_step()
            trainer.step += 1
    changed = sum(int((p.detach().float() != s).sum()) for p, s in zip(trainer.params, start))
    return {"model_displacement": displacement(trainer.params, start),
            "optimizer_displacement": displacement(trainer.opt_params, start),
            "weights_changed": changed / sum(s.numel() for s in start)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--steps", type=int, nargs="+", default=None,
                    help="steps per backend, in --backends order (default 20 for the VLM, 5 for the others)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], help="extra config override for every run")
    args = ap.parse_args()
    steps = args.steps or [20 if b == "vlm" else 5 for b in args.backends]
    if len(steps) == 1:
        steps = steps * len(args.backends)
    if len(steps) != len(args.backends):  # zip would drop a backend or a count without a word
        ap.error(f"--steps: give one count, or one per backend ({len(args.backends)}: {' '.join(args.backends)}); "
                 f"got {len(steps)}")
    warnings.filterwarnings("ignore")
    for name, n in zip(args.backends, steps):
        rows = {arm: run(name, over, args.lr, n, args.seed, args.set) for arm, over in ARMS.items()}
        base = rows["float32"]["optimizer_displacement"]
        for arm, r in rows.items():
            ratio = round(r["optimizer_displacement"] / base, 3)
            r = {k: float(f"{v:.4g}") for k, v in r.items()}
            print(json.dumps({"backend": name, "arm": arm, "lr": args.lr, "steps": n, **r,
                              "optimizer_displacement_vs_float32": ratio}), flush=True)


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
