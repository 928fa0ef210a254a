"""Held-out evaluation in one process against two (distributed.map_shards: each rank generates
every other item), each backend's bundled model and default config, one thread a process: the
seconds of `task.evaluate` and whether the metrics agree. Sampled metrics (pass@k) draw other
samples with two ranks; greedy and ODE ones should agree exactly.

    python benchmarks/sharded_eval.py                   # every backend
    python benchmarks/sharded_eval.py --backends vlm
"""

from __future__ import annotations

import argparse
import importlib
import json
import time

import torch
import two_ranks

BACKENDS = {"vlm": "mmrl.vlm.backend", "dllm": "dllm_rl.backend", "diffusion": "diffusion_rl.backend"}


def evaluate(rank: int, name: str) -> dict:
    import tempfile

    from mmrl.core.config import load_config

    backend = importlib.import_module(BACKENDS[name])
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG, overrides=[f"output_dir={tmp}"])
        policy, task = backend.build(cfg)
        start = time.perf_counter()
        with torch.no_grad():
            metrics = task.evaluate(policy)
    return {"metrics": metrics, "seconds": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    args = ap.parse_args()
    torch.set_num_threads(1)  # as each of the two processes runs
    for name in args.backends:
        one = evaluate(0, name)
        two = two_ranks.run(evaluate, name)
        slowest = max(r["seconds"] for r in two)
        differ = sorted(k for k, v in one["metrics"].items() if two[0]["metrics"].get(k) != v)
        print(json.dumps({"backend": name, "seconds_one_process": round(one["seconds"], 2),
                          "seconds_two_processes": round(slowest, 2),
                          "time_ratio": round(slowest / one["seconds"], 3),
                          "ranks_agree": two[0]["metrics"] == two[1]["metrics"],
                          "metrics_that_differ_from_one_process": differ}), flush=True)


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
