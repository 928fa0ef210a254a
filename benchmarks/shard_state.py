"""AdamW's moments per rank with and without optim.shard_state (ZeRO stage 1), two CPU
processes (gloo), each backend's bundled model and default config: one training step each,
then the bytes of optimizer state each rank holds, and whether the two runs' weights agree.

ZeRO stage 1 deals out whole parameters (the largest first, each to the rank holding the
fewest elements so far), so a rank's share is about 1 / world unless one tensor (an embedding)
outweighs the rest.

    python benchmarks/shard_state.py                       # every backend
    python benchmarks/shard_state.py --backends vlm
"""

from __future__ import annotations

import argparse
import importlib
import json
import tempfile

import torch
import two_ranks

BACKENDS = {"vlm": "mmrl.vlm.backend", "dllm": "dllm_rl.backend", "diffusion": "diffusion_rl.backend"}


def state_bytes(optimizer) -> int:
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer holds its share's AdamW
    return sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() > 0)


def _rank(rank: int, name: str) -> dict:
    from mmrl.core.config import load_config
    from mmrl.core.trainer import Trainer

    backend = importlib.import_module(BACKENDS[name])
    record = {}
    for shard in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG, overrides=[
                f"optim.shard_state={shard}", "train.max_steps=1", f"output_dir={tmp}",
                "rollout.prompts_per_step=2", "rollout.num_generations=2"])  # a small step: state is the point
            trainer = Trainer(cfg, *backend.build(cfg))
            trainer.train_step()
            record[shard] = {"bytes": state_bytes(trainer.optimizer),
                             "weights": [p.detach().clone() for p in trainer.params]}
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    args = ap.parse_args()
    for name in args.backends:
        ranks = two_ranks.run(_rank, name)
        whole = ranks[0][False]["bytes"]
        same = all(torch.equal(a, b) for r in ranks for a, b in zip(r[False]["weights"], r[True]["weights"]))
        print(json.dumps({"backend": name, "moments_bytes_unsharded_per_rank": whole,
                          "moments_bytes_sharded": [r[True]["bytes"] for r in ranks],
                          "largest_share": round(max(r[True]["bytes"] for r in ranks) / whole, 3),
                          "same_weights_after_a_step": same}), flush=True)


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
