"""Training state per rank with and without optim.fsdp (FSDP2, ZeRO stage 3), two CPU processes
(gloo), each backend's bundled model and default config, in float32 and in bfloat16: one
training step each, then the bytes each rank holds of weights, float32 master weights,
gradients and AdamW's moments, and how far the sharded run's weights are from the whole run's.

Without FSDP a bfloat16 run holds its bfloat16 weights plus float32 master weights, gradients
and moments (optim.master_weights); with it each rank holds 1 / processes of the float32
weights, gradients and moments. With `--kl BETA` the methods keep a KL reference (a frozen copy
of the starting weights in the model's dtype), counted as "reference": whole on each rank
without FSDP, sharded with it. Not counted: the whole weights that rollouts gather for their
duration (the model's size in its dtype, as without FSDP), activations.

    python benchmarks/fsdp.py                       # every backend, float32 and bfloat16
    python benchmarks/fsdp.py --backends dllm --dtypes bfloat16
    python benchmarks/fsdp.py --kl 0.04               # with a KL reference
    python benchmarks/fsdp.py --uneven                # 1 micro-batch on rank 0 against 4 on rank 1
"""

from __future__ import annotations

import argparse
import importlib
import json
import tempfile

import torch
import two_ranks

BACKENDS = {"vlm": "mmrl.vlm.backend", "dllm": "dllm_rl.backend", "diffusion": "diffusion_rl.backend"}


def _bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors if t is not None]
    return sum(t.numel() * t.element_size() for t in local)


def state_bytes(trainer) -> dict[str, int]:
    """What the rank holds for training, by kind (gradients as the step left them)."""
    moments = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    return {"weights": _bytes(trainer.params),
            "master": _bytes([m for _, _, m in trainer.master.copied]) if trainer.master is not None else 0,
            "grads": _bytes([p.grad for p in trainer.opt_params]),
            "moments": _bytes(moments),
            **({"reference": _bytes(trainer.reference.model.parameters())} if trainer.reference is not None else {})}


def _rank(rank: int, name: str, dtypes: list[str], extra: list[str]) -> dict:
    from mmrl.core.config import load_config
    from mmrl.core.fsdp import Sharded
    from mmrl.core.trainer import Trainer

    backend = importlib.import_module(BACKENDS[name])
    record = {}
    for dtype in dtypes:
        for on in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG, overrides=[
                    f"optim.fsdp={on}", f"model.dtype={dtype}", "train.max_steps=1", f"output_dir={tmp}",
                    "rollout.prompts_per_step=2", "rollout.num_generations=2", *extra])  # a small step: state is the point
                trainer = Trainer(cfg, *backend.build(cfg))
                trainer.train_step()
                record[f"{dtype}/{on}"] = {"bytes": state_bytes(trainer),
                                           "weights": [Sharded.whole(p.detach()).float() for p in trainer.opt_params]}
    return record


def _uneven(rank: int, name: str) -> dict:
    """One update on uneven shares, whole and sharded: rank 0 keeps 1 row of its group and rank 1
    all 4, in micro-batches of 1, so rank 0 runs 3 passes of no weight beside rank 1's."""
    from mmrl.core.config import load_config
    from mmrl.core.fsdp import Sharded
    from mmrl.core.trainer import Trainer

    backend = importlib.import_module(BACKENDS[name])
    record = {}
    for on in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG, overrides=[
                f"optim.fsdp={on}", f"output_dir={tmp}", "rollout.prompts_per_step=2",
                "rollout.num_generations=4", "train.micro_batch_size=1"])
            trainer = Trainer(cfg, *backend.build(cfg))
            with trainer.gathered():
                batch, _ = trainer.scheduler.next_groups(0, 4)
            metrics = trainer.update(batch.select(torch.arange(1) if rank == 0 else torch.arange(len(batch))))
            record[str(on)] = {"updates": metrics["train/updates"],
                               "weights": [Sharded.whole(p.detach()).float() for p in trainer.opt_params]}
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--kl", type=float, default=0.0, metavar="BETA", help="method.kl.beta (> 0: with a KL reference)")
    ap.add_argument("--uneven", action="store_true", help="instead: an update on uneven shares, whole vs sharded")
    args = ap.parse_args()
    for name in args.backends:
        if args.uneven:
            whole, sharded = (two_ranks.run(_uneven, name)[0][k] for k in ("False", "True"))
            diff = max(float((a - b).abs().max()) for a, b in zip(whole["weights"], sharded["weights"]))
            print(json.dumps({"backend": name, "updates": [whole["updates"], sharded["updates"]],
                              "max_weight_difference": diff}), flush=True)
            continue
        ranks = two_ranks.run(_rank, name, args.dtypes, [f"method.kl.beta={args.kl}"] if args.kl else [])
        for dtype in args.dtypes:
            whole = ranks[0][f"{dtype}/False"]["bytes"]
            sharded = [r[f"{dtype}/True"]["bytes"] for r in ranks]
            diff = max(float((a - b).abs().max()) for a, b in zip(ranks[0][f"{dtype}/False"]["weights"],
                                                                 ranks[0][f"{dtype}/True"]["weights"]))
            print(json.dumps({"backend": name, "dtype": dtype, "bytes_per_rank_whole": whole,
                              "bytes_per_rank_fsdp": sharded,
                              "largest_share": round(max(sum(s.values()) for s in sharded) / sum(whole.values()), 3),
                              "max_weight_difference_after_a_step": diff}), flush=True)


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
