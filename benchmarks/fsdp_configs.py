"""Every method's shipped config under optim.fsdp: two CPU processes (gloo), each config in
configs/ with 2 prompts a step, two training steps with the model whole on each rank and two
with it sharded, from the same start. Reports how far the float32 weights moved and how far
the two runs ended apart, and the sharded run's losses. A rank that waits over 90 s for the
other (the ranks' collectives out of step) fails the config instead of hanging.

    python benchmarks/fsdp_configs.py                      # all of configs/
    python benchmarks/fsdp_configs.py configs/dllm/slim_rl.yaml --set rollout.prompts_per_step=8
"""

from __future__ import annotations

import argparse
import importlib
import json
import tempfile
from pathlib import Path

import torch
import two_ranks

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = {"vlm": "mmrl.vlm.backend", "dllm": "dllm_rl.backend", "diffusion": "diffusion_rl.backend"}


def _rank(rank: int, path: str, extra: list[str]) -> dict:
    from mmrl.core.config import load_config
    from mmrl.core.fsdp import Sharded
    from mmrl.core.trainer import Trainer

    backend = importlib.import_module(BACKENDS[Path(path).parent.name])
    record = {}
    for on in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(backend.CONFIG_CLASS, path, defaults=backend.DEFAULT_CONFIG, overrides=[
                f"optim.fsdp={on}", f"output_dir={tmp}", "rollout.prompts_per_step=2",
                "logging.progress=false", "logging.tensorboard=false", *extra])
            trainer = Trainer(cfg, *backend.build(cfg))
            start = [Sharded.whole(p.detach()).clone() for p in trainer.opt_params]
            losses = [trainer.train_step().get("loss/total", float("nan")) for _ in range(2)]
            record[str(on)] = {"start": start, "losses": torch.tensor(losses),
                               "end": [Sharded.whole(p.detach()).clone() for p in trainer.opt_params]}
    return record


def largest(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="*", help="config files (default: every file in configs/*/)")
    # one override per --set, as in the other benchmarks: nargs="*" took the config files after it as overrides
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for every config (repeatable)")
    args = ap.parse_args()
    for override in args.set:
        if "=" not in override:
            ap.error(f"--set takes KEY=VALUE, got {override!r}")
    for path in args.configs:  # the backend is the folder's name: anything else failed in both ranks (KeyError)
        if not Path(path).is_file() or Path(path).parent.name not in BACKENDS:
            ap.error(f"{path}: not a config file in a folder named for its backend "
                     f"({', '.join(f'configs/{b}/' for b in BACKENDS)})")
    for path in args.configs or sorted(map(str, ROOT.glob("configs/*/*.yaml"))):
        r = two_ranks.run(_rank, path, args.set, timeout=90)[0]
        whole, sharded = r["False"], r["True"]
        print(json.dumps({"config": str(Path(path).relative_to(ROOT) if Path(path).is_relative_to(ROOT) else path),
                          "moved": largest(whole["start"], whole["end"]),
                          "sharded_vs_whole": largest(whole["end"], sharded["end"]),
                          "same_start": largest(whole["start"], sharded["start"]) == 0.0,
                          "losses_sharded": [round(x, 6) for x in sharded["losses"].tolist()],
                          "losses_whole": [round(x, 6) for x in whole["losses"].tolist()]}), flush=True)


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
