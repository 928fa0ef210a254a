"""Does FTFC's learned effective reward g_phi generalise? Held-out check on a stored pool.

Reads the pool an FTFC run keeps in its checkpoint (trainer_state.json, method state), and for
each setting fits g_phi on the pool less a fraction of its prompts and scores its tilt of the
held-out ones (diffusion_rl.effective_reward.heldout_metrics), over several split seeds:

    python benchmarks/ftfc_effective_reward.py RUN/checkpoints/step-00000001 \\
        --g-steps 30 100 300 --split-seeds 0 1 2

Prints one row per setting: the held-out share of the observed tilt's value it recovers
(1 = all of it, 0 = no better than uniform weights, < 0 = worse) and the within-prompt
correlation of g with the reward, as mean and range over the split seeds.
"""

from __future__ import annotations

import argparse
import base64
import json
from pathlib import Path

import torch
from safetensors.torch import load as st_load

from diffusion_rl.effective_reward import heldout_metrics
from mmrl.core.config import ConfigError


def load_pool(checkpoint: Path) -> tuple[torch.Tensor, dict, torch.Tensor, torch.Tensor, dict]:
    state_path = checkpoint / "trainer_state.json"
    if not state_path.is_file():
        raise ConfigError(f"no trainer_state.json in {checkpoint}: give a checkpoint directory of an FTFC run")
    state = json.loads(state_path.read_text())
    method = state.get("method") or {}
    if "tensors" not in method:
        raise ConfigError(f"{state_path} holds no FTFC pool (method state keys: {sorted(method)})")
    t = st_load(base64.b64decode(method["tensors"]))
    cond = {k[len("data/cond/"):]: v for k, v in t.items() if k.startswith("data/cond/")}
    return t["data/final_latents"], cond, t["total"], t["group_ids"], state["config"]["method"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="an FTFC run's checkpoint directory (holds trainer_state.json)")
    ap.add_argument("--g-steps", type=int, nargs="+", default=[30, 100, 300], help="fit lengths to try")
    ap.add_argument("--split-seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the held-out choice")
    ap.add_argument("--heldout", type=float, default=0.25, help="fraction of the pool's prompts held out")
    args = ap.parse_args(argv)
    x1, cond, rewards, groups, cfg = load_pool(args.checkpoint)
    print(f"pool: {len(groups.unique())} prompts, {len(x1)} samples; {cfg['divergence']}, beta {cfg['beta']}, "
          f"g_hidden {cfg['g_hidden']}, g_lr {cfg['g_lr']}, g_weight_decay {cfg['g_weight_decay']}")
    print("| g_steps | held-out recovered (mean, min..max) | held-out corr (mean, min..max) |")
    print("|---|---|---|")
    for steps in args.g_steps:
        rows = [heldout_metrics(x1, cond, rewards, groups, args.heldout, beta=cfg["beta"], divergence=cfg["divergence"],
                                hidden=cfg["g_hidden"], steps=steps, lr=cfg["g_lr"],
                                weight_decay=cfg["g_weight_decay"], seed=s) for s in args.split_seeds]
        print(f"| {steps} | {_cell(rows, 'ftfc/g_heldout_recovered')} | {_cell(rows, 'ftfc/g_heldout_corr')} |",
              flush=True)


def _cell(rows: list[dict], key: str) -> str:
    """Mean and range of one metric over the split seeds."""
    v = [r[key] for r in rows]
    return f"{sum(v) / len(v):.3f} ({min(v):.3f}..{max(v):.3f})"


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
