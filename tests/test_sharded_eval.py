"""Held-out evaluation dealt out over data-parallel ranks (distributed.map_shards): each rank
generates every world-th item, and every rank gets all the results in order."""

from __future__ import annotations

import pytest
import torch
from two_ranks import process_group

from mmrl.core import distributed
from mmrl.core.config import load_config


def dllm(tmp):
    from dllm_rl import backend

    cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG, overrides=[f"output_dir={tmp}"])
    return backend.build(cfg)


def vlm(tmp):
    from mmrl.vlm import backend

    cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG, overrides=[
        f"output_dir={tmp}", "task.num_eval=12", "rollout.eval_samples=2", "rollout.eval_batch_size=4"])
    return backend.build(cfg)


def _rank(rank, port, tmp):
    with process_group(rank, port):
        seen = []

        def times_ten(items):
            seen.extend(items)
            return [10 * x for x in items]

        record = {"five": distributed.map_shards(times_ten, list(range(5))),
                  "one": distributed.map_shards(times_ten, [7])}  # rank 1 has no share: it still joins
        record["seen"] = list(seen)

        def fail_on_rank_1(items):
            if rank == 1:
                raise ValueError("item 3 is bad")
            return items

        try:  # one rank's error reaches every rank instead of leaving the others waiting
            distributed.map_shards(fail_on_rank_1, [1, 2, 3])
        except Exception as e:  # noqa: BLE001 -- what arrives is the point
            record["failure"] = (type(e).__name__, str(e))
        policy, task = dllm(tmp)
        with torch.no_grad():
            record["eval"] = task.evaluate(policy)
            policy, task = vlm(tmp)
            record["vlm"] = task.evaluate(policy)  # each rank generates and scores its share
        torch.save(record, f"{tmp}/record.{rank}")


@pytest.mark.two_ranks(body=_rank)
def test_ranks_generate_a_share_each_and_evaluate_as_one_process(tmp_path, ranks_ran):
    r0, r1 = (torch.load(ranks_ran / f"record.{r}", weights_only=True) for r in range(2))
    for r in (r0, r1):
        assert r["five"] == [0, 10, 20, 30, 40] and r["one"] == [70]
    assert r0["seen"] == [0, 2, 4, 7] and r1["seen"] == [1, 3]
    assert r1["failure"] == ("ValueError", "item 3 is bad")  # its own, as raised
    assert r0["failure"] == ("RankError", "data-parallel rank 1 failed: ValueError: item 3 is bad")
    policy, task = dllm(tmp_path)
    with torch.no_grad():
        one = task.evaluate(policy)  # greedy decoding: the same answers, wherever each is decoded
    assert r0["eval"] == r1["eval"] == one and one["accuracy"] > 0
    policy, task = vlm(tmp_path)
    with torch.no_grad():
        one = task.evaluate(policy)
    # greedy and sampled answers and their scores as one process's: each sample draws from its
    # own generator, seeded by its item and index, whichever rank decodes it
    assert r0["vlm"] == r1["vlm"] == one
    assert one["reward"] > 0 and "pass@2" in one
