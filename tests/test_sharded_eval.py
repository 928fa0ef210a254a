"""Held-out evaluation dealt out over data-parallel ranks (distributed.map_shards): each rank
generates every world-th item, and every rank gets all the results in order."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
from test_data_parallel import free_port, process_group

from mmrl.core import distributed
from mmrl.core.config import load_config


def dllm(tmp):
    from dllm_rl import backend

    cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG, overrides=[f"output_dir={tmp}"])
    return backend.build(cfg)


def _rank(rank, port, tmp, out):
    with process_group(rank, port):
        seen = []

        def times_ten(items):
            seen.extend(items)
            return [10 * x for x in items]

        record = {"five": distributed.map_shards(times_ten, list(range(5))),
                  "one": distributed.map_shards(times_ten, [7])}  # rank 1 has no share: it still joins
        record["seen"] = list(seen)
        policy, task = dllm(tmp)
        with torch.no_grad():
            record["eval"] = task.evaluate(policy)
        torch.save(record, f"{out}.{rank}")


def test_ranks_generate_a_share_each_and_evaluate_as_one_process(tmp_path):
    out = str(tmp_path / "record")
    mp.spawn(_rank, args=(free_port(), str(tmp_path), out), nprocs=2, join=True)
    r0, r1 = (torch.load(f"{out}.{r}", weights_only=True) for r in range(2))
    for r in (r0, r1):
        assert r["five"] == [0, 10, 20, 30, 40] and r["one"] == [70]
    assert r0["seen"] == [0, 2, 4, 7] and r1["seen"] == [1, 3]
    policy, task = dllm(tmp_path)
    with torch.no_grad():
        one = task.evaluate(policy)  # greedy decoding: the same answers, wherever each is decoded
    assert r0["eval"] == r1["eval"] == one and one["accuracy"] > 0
