"""Data-parallel updates (mmrl.core.distributed): two processes, each with half of
the global batch's groups, make the same update as one process with all of it."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import toy
from two_ranks import free_port, process_group

from mmrl.core import distributed
from mmrl.core.advantages import atom_advantages, batch_across, group_advantages
from mmrl.core.config import TrainConfig, load_config
from mmrl.core.trainer import Trainer

AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "bfloat16"]


def global_batch(trainer: Trainer):
    """One fixed global batch: 4 prompts x 8 samples from the starting policy, scored."""
    prompts = [1, 3, 5, 7]
    batch = trainer.policy.generate(prompts, 8, trainer.cfg.rollout, torch.Generator().manual_seed(7))
    batch.scores = trainer.reward.score(batch.samples)
    batch.advantages = trainer.method.advantages(batch)
    return batch


def make(tmp, aggregation, micro):
    """`aggregation` "bfloat16" is token_mean on bfloat16 weights (float32 master weights)."""
    bf16 = aggregation == "bfloat16"
    overrides = [f"output_dir={tmp}", f"method.loss.aggregation={'token_mean' if bf16 else aggregation}",
                 "train.mini_batches=1", "optim.max_grad_norm=null"]
    if micro:
        overrides.append(f"train.micro_batch_size={micro}")
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=overrides)
    policy, task = toy.build(cfg)
    if bf16:
        policy.model.to(torch.bfloat16)
    return Trainer(cfg, policy, task)


def trained(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The model's weights, and the float32 master weights where there are some."""
    state = {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}
    return state | {f"master.{i}": m.detach().clone() for i, m in enumerate(trainer.opt_params)}


def _rank(rank, port, tmp):
    """One rank: for each aggregation, a fresh trainer updates on this rank's half of the
    groups. All three in one launch: a process start costs more than the updates."""
    with process_group(rank, port):
        for aggregation in AGGREGATIONS:
            trainer = make(f"{tmp}/{aggregation}", aggregation, micro=4)
            batch = global_batch(trainer)
            mine = torch.isin(batch.group_ids, batch.group_ids.unique()[rank::2])  # this rank's groups
            trainer.update(batch.select(mine))
            torch.save(trained(trainer), f"{tmp}/weights.{aggregation}.{rank}")


def _uneven_rank(rank, port, tmp):
    """Rank 0 holds one row, rank 1 seven: with 2 mini-batches rank 0 has an empty one."""
    with process_group(rank, port):
        cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[
            f"output_dir={tmp}", "train.mini_batches=2", "train.ppo_epochs=2"])
        trainer = Trainer(cfg, *toy.build(cfg))
        batch = global_batch(trainer).select(torch.arange(8))
        metrics = trainer.update(batch.select(torch.arange(1) if rank == 0 else torch.arange(1, 8)))
        # scale=batch: each rank holds half of the 4 groups; the std is the whole batch's
        full = global_batch(trainer)
        mine = torch.isin(full.group_ids, full.group_ids.unique()[rank::2])
        with batch_across(distributed.sum_tensor):
            adv = group_advantages(full.rewards[mine], full.group_ids[mine], scale="batch")
            atoms = atom_advantages(full.scores.values[mine], full.group_ids[mine], scale="batch")
        torch.save({"checksum": distributed_checksum(trainer), "updates": metrics["train/updates"],
                    "mine": mine, "adv": adv, "atoms": atoms, "rewards": full.rewards,
                    "values": full.scores.values, "ids": full.group_ids}, f"{tmp}/record.{rank}")


@pytest.mark.two_ranks(body=_uneven_rank)
def test_uneven_ranks_step_together_and_batch_scale_uses_every_rank(ranks_ran):
    """Uneven rows per rank (FastRL's pruning, AXPO's extra samples) can leave a rank a mini-batch
    with no rows: it still takes part in the step, or the other rank would wait forever. And
    advantage.scale=batch divides by the std of every rank's rows, as one process would."""
    r0, r1 = (torch.load(ranks_ran / f"record.{r}", weights_only=True) for r in range(2))
    assert r0["updates"] == r1["updates"] == 4  # 2 epochs x 2 mini-batches on both ranks
    assert r0["checksum"] == r1["checksum"]
    assert torch.equal(r0["rewards"], r1["rewards"])  # both ranks drew the same global batch
    whole = group_advantages(r0["rewards"], r0["ids"], scale="batch")
    whole_atoms = atom_advantages(r0["values"], r0["ids"], scale="batch")
    own = group_advantages(r0["rewards"][r0["mine"]], r0["ids"][r0["mine"]], scale="batch")
    assert not torch.allclose(own, whole[r0["mine"]])  # a per-rank std would differ
    for r in (r0, r1):
        torch.testing.assert_close(r["adv"], whole[r["mine"]])
        torch.testing.assert_close(r["atoms"], whole_atoms[r["mine"]])


@pytest.mark.two_ranks(body=_rank)
def test_two_processes_update_like_one(tmp_path, ranks_ran):
    expected = {}
    for aggregation in AGGREGATIONS:
        # bfloat16 forwards round by the rows batched together, and Adam's first step is lr * sign(g)
        # wherever |g| >> eps, so one process takes the ranks' micro-batches of 4 (half a group)
        one = make(tmp_path / "one" / aggregation, aggregation, micro=4 if aggregation == "bfloat16" else None)
        start = trained(one)
        batch = global_batch(one)
        assert batch.advantages.abs().sum() > 0  # a real update, not a no-op
        one.update(batch)
        expected[aggregation] = trained(one)
        assert any(not torch.equal(v, start[k]) for k, v in expected[aggregation].items()), aggregation

    for aggregation in AGGREGATIONS:
        ranks = [torch.load(ranks_ran / f"weights.{aggregation}.{r}", weights_only=True) for r in range(2)]
        for k, v in expected[aggregation].items():
            assert torch.equal(ranks[0][k], ranks[1][k]), f"{aggregation}: ranks disagree on {k}"
            torch.testing.assert_close(ranks[0][k], v, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, a=aggregation: f"{a}: {m}")


def test_close_leaves_the_group_and_init_registers_it_for_exit(monkeypatch):
    """A rank that exits with its gloo group alive can abort at interpreter teardown, so
    init() registers close() with atexit; close() leaves the group and is safe to repeat."""
    import atexit

    from mmrl.core import distributed

    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    distributed.close()  # no group: a no-op
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        assert distributed.world_size() == 1 and dist.is_initialized()
    finally:
        distributed.close()
    assert not dist.is_initialized()
    distributed.close()  # again: still a no-op
    # init() joins only for WORLD_SIZE > 1 (accelerate's launcher sets it); it registers close
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    joined = []
    import accelerate

    monkeypatch.setattr(accelerate, "PartialState", lambda **kw: joined.append(kw))
    distributed.init()
    assert joined == [{"cpu": not torch.cuda.is_available()}] and registered == [distributed.close]


def _train_rank(rank, port, tmp):
    with process_group(rank, port):
        cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG,
                          overrides=[f"output_dir={tmp}", "train.max_steps=2", "logging.tensorboard=false"])
        Trainer(cfg, *toy.build(cfg)).train()


@pytest.mark.two_ranks(body=_train_rank)
def test_the_logs_of_two_processes_count_the_whole_batch(tmp_path, ranks_ran):
    """Only the main rank writes metrics.jsonl; its counts are the whole step's, not its share."""
    from mmrl.core.logging import read_metrics

    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG,
                      overrides=[f"output_dir={tmp_path / 'one'}", "train.max_steps=2", "logging.tensorboard=false"])
    Trainer(cfg, *toy.build(cfg)).train()
    one = read_metrics(tmp_path / "one" / "metrics.jsonl")
    two = read_metrics(ranks_ran / "metrics.jsonl")
    assert len(two) == 2 and set(two[0]) == set(one[0]) | {"rollout/groups_trimmed"}
    for a, b in zip(one, two):
        assert b["rollout/samples"] == a["rollout/samples"] == cfg.rollout.prompts_per_step * cfg.rollout.num_generations
        assert b["rollout/groups"] == a["rollout/groups"] == cfg.rollout.prompts_per_step
        assert 0 <= b["reward/total"] <= 1 and b["time/step"] > 0


def _refill_rank(rank, port, tmp):
    """A group filter that treats two ranks unequally: rank 1 drops every group drawn before
    `cut` (every group it sees, in "starved"), with dynamic sampling's refills or without."""
    with process_group(rank, port):
        record = {}
        for name, cut, refill in (("refill", 4, True), ("starved", 10**9, True), ("filter", 2, False)):
            cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[
                f"output_dir={tmp}/{name}", f"method.dynamic_sampling.enabled={refill}",
                "method.dynamic_sampling.max_rounds=3"])
            trainer = Trainer(cfg, *toy.build(cfg))
            trainer.method.keep_groups = lambda b, c=cut: (b.group_ids >= c) if rank == 1 else None
            batch, metrics = trainer.scheduler.next_groups(version=0)
            record[name] = {"groups": [] if batch is None else batch.group_ids.unique().tolist(),
                            "position": trainer.stream.position, **metrics}
        # a whole run with the real filter and the batch std: no rank waits on a collective the other skipped
        cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[
            f"output_dir={tmp}/train", "train.max_steps=3", "rollout.num_generations=2",
            "method.dynamic_sampling.enabled=true", "method.dynamic_sampling.max_rounds=2",
            "method.advantage.scale=batch"])
        trainer = Trainer(cfg, *toy.build(cfg))
        trainer.train()
        record["checksum"] = distributed_checksum(trainer)
        torch.save(record, f"{tmp}/record.{rank}")


def distributed_checksum(trainer) -> float:
    return sum(float(p.detach().double().abs().sum()) for p in trainer.params)


@pytest.mark.two_ranks(body=_refill_rank)
def test_dynamic_sampling_refills_every_rank_to_an_equal_share(ranks_ran):
    """Each refill round draws for the rank short of the most groups, so both ranks take the
    same prompts; a rank's surplus goes to a rank short of its share, the rest is cut, and
    both train on equal shares."""
    from mmrl.core.logging import read_metrics

    r0, r1 = (torch.load(ranks_ran / f"record.{r}", weights_only=False) for r in range(2))
    # round 1 draws 0-3 (rank 0: 0, 2; rank 1: 1, 3, dropped); round 2 draws 4-7 for rank 1's
    # two missing groups, so rank 0 holds 0, 2, 4, 6 and trims 4 and 6
    assert r0["refill"]["groups"] == [0, 2] and r1["refill"]["groups"] == [5, 7]
    assert r0["refill"]["rollout/groups_trimmed"] == 2 and r1["refill"]["rollout/groups_trimmed"] == 0
    assert r0["refill"]["rollout/rounds"] == r1["refill"]["rollout/rounds"] == 2
    assert r0["refill"]["position"] == r1["refill"]["position"] == 8
    assert r1["refill"]["rollout/groups_dropped"] == 2 and r0["refill"]["rollout/groups_dropped"] == 0
    # rank 1 never keeps a group: after max_rounds rank 0 holds 8 (2 a round) and hands it 4, 6
    assert r0["starved"]["groups"] == [0, 2] and r1["starved"]["groups"] == [4, 6]
    assert r0["starved"]["rollout/rounds"] == r1["starved"]["rollout/rounds"] == 4
    assert r0["starved"]["rollout/groups_trimmed"] == 4 and r1["starved"]["rollout/groups_trimmed"] == 0
    # a filter without refills (as the dLLM methods' own): rank 1 keeps 3 of 1, 3; rank 0 is cut to one
    assert r0["filter"]["groups"] == [0] and r1["filter"]["groups"] == [3]
    assert r0["filter"]["rollout/groups_trimmed"] == 1 and r0["filter"]["rollout/rounds"] == 1
    assert r0["checksum"] == r1["checksum"]  # the ranks hold the same weights after training
    rows = read_metrics(ranks_ran / "train" / "metrics.jsonl")
    assert len(rows) == 3
    for row in rows:
        assert row.get("train/skipped") or row["rollout/groups"] % 2 == 0  # equal shares


def test_collectives_of_a_nccl_group_run_on_the_ranks_gpu(monkeypatch):
    """accelerate's --multi_gpu starts NCCL alone, which reduces CUDA tensors only: the small
    tensors of the counting collectives go to the rank's GPU there, and stay on the CPU on gloo."""
    from mmrl.core import distributed

    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    assert distributed._device() == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert distributed._device() == torch.device("cuda", 3)


def _zero_rank(rank, port, tmp):
    """Three runs of 3 steps on two ranks: AdamW whole on each rank, AdamW sharded (ZeRO stage 1),
    and the sharded one stopped after step 2 and resumed."""
    with process_group(rank, port):
        record = {}
        for name, shard, steps, resume in (("whole", False, 3, False), ("sharded", True, 3, False),
                                           ("resumed", True, 2, False), ("resumed", True, 3, True),
                                           ("whole-bf16", False, 2, False), ("sharded-bf16", True, 2, False)):
            cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[
                f"output_dir={tmp}/{name}", f"train.max_steps={steps}", "train.save_every=1",
                f"optim.shard_state={shard}", "optim.weight_decay=0.01", "logging.tensorboard=false"])
            policy, task = toy.build(cfg)
            if name.endswith("bf16"):  # the shares step float32 master weights
                policy.model.to(torch.bfloat16)
            trainer = Trainer(cfg, policy, task)
            trainer.train(resume=resume)
            moments = [t for s in getattr(trainer.optimizer, "optim", trainer.optimizer).state.values()
                       for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
            record[name] = {"weights": trained(trainer), "moments": sum(t.numel() for t in moments)}
        torch.save(record, f"{tmp}/record.{rank}")


@pytest.mark.two_ranks(body=_zero_rank)
def test_sharded_optimizer_state_makes_the_same_updates_with_half_the_moments_per_rank(ranks_ran):
    from mmrl.core.checkpoint import load_checkpoint, step_dir

    ranks = [torch.load(ranks_ran / f"record.{r}", weights_only=True) for r in range(2)]
    whole = ranks[0]["whole"]["weights"]
    for r in ranks:
        for name in ("sharded", "resumed"):
            for k, v in whole.items():
                assert torch.equal(r[name]["weights"][k], v), (name, k)
        for k, v in ranks[0]["whole-bf16"]["weights"].items():
            assert torch.equal(r["sharded-bf16"]["weights"][k], v), k
    params = sum(v.numel() for k, v in whole.items() if k.startswith("master."))
    assert ranks[0]["whole"]["moments"] == ranks[1]["whole"]["moments"] == 2 * params  # exp_avg, exp_avg_sq
    shares = [r["sharded"]["moments"] for r in ranks]
    assert sum(shares) == 2 * params and max(shares) < 0.6 * 2 * params, shares
    # the main rank writes the whole state: the checkpoint is the unsharded run's, tensor for tensor
    a, b = (load_checkpoint(step_dir(ranks_ran / name / "checkpoints", 3))[0] for name in ("whole", "sharded"))
    optim = sorted(k for k in a if k.startswith("optim."))
    assert optim and optim == sorted(k for k in b if k.startswith("optim."))
    assert all(torch.equal(a[k], b[k]) for k in optim)


class _Turns(toy.ToyPolicy):
    """Draws from the rollout generator as often as its prompts say (as the VLM agent draws one
    seed a turn while a row is active): the ranks' generators part after the first step."""

    def generate(self, prompts, num_generations, rollout, generator):
        torch.randint(0, 2**62, (1 + sum(prompts),), generator=generator)
        return super().generate(prompts, num_generations, rollout, generator)


def _resume_rank(rank, port, tmp):
    import shutil

    def run(out):
        cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[
            f"output_dir={out}", "train.max_steps=4", "train.save_every=2", "logging.tensorboard=false"])
        return Trainer(cfg, _Turns(), toy.build(cfg)[1])

    with process_group(rank, port):
        whole = run(f"{tmp}/whole")
        whole.train()
        if rank == 0:  # the uninterrupted run's step 2, resumed elsewhere
            shutil.copytree(f"{tmp}/whole/checkpoints/step-00000002", f"{tmp}/split/checkpoints/step-00000002")
        dist.barrier()
        resumed = run(f"{tmp}/split")
        resumed.train(resume=True)
        torch.save({"whole": trained(whole), "resumed": trained(resumed), "generators": [
            whole.generator.get_state(), resumed.generator.get_state()]}, f"{tmp}/rank{rank}.pt")


@pytest.mark.two_ranks(body=_resume_rank)
def test_a_resumed_run_gives_each_rank_its_own_random_state_back(ranks_ran):
    """Each rank's rollout generator and torch RNG are saved (rank 0 wrote only its own, which
    every rank loaded): resuming reproduces the uninterrupted run on every rank."""
    ranks = [torch.load(ranks_ran / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert not torch.equal(*[r["generators"][0] for r in ranks])  # the ranks drew apart
    for r in ranks:
        assert torch.equal(*r["generators"])
        for k, v in r["whole"].items():
            assert torch.equal(r["resumed"][k], v), k


def _metrics_rank(rank, port, tmp):
    with process_group(rank, port):
        mine = {"rollout/samples": 16.0, "loss/policy": float(rank), "x/resampled": 4.0 + rank, "time/step": 1.0 + rank,
                "cost/flops": 10.0 + rank, "rollout/len/max": 3.0 + rank, "rollout/len/min": 3.0 + rank,
                "time/waiting_ratio": 0.25 + 0.5 * rank, "train/bad_step": float(rank)}
        if rank == 1:  # a conditional metric only one rank logged (AXPO's resampled accuracy, DSPO's r_cf)
            mine["x/resampled_accuracy"] = 0.25
        combined = distributed.combine_metrics(mine, ("x/resampled",))
        # a value that is not a number on one rank: every rank keeps its own share, none fails
        text = distributed.combine_metrics({"loss/policy": 1.0, "note": "text"} if rank == 0 else {"loss/policy": 3.0})
        cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[f"output_dir={tmp}/run{rank}"])
        seed = Trainer(cfg, *toy.build(cfg)).generator.initial_seed()
        torch.save({"combined": combined, "text": text, "seed": seed, "cfg_seed": cfg.seed}, f"{tmp}/metrics{rank}.pt")


@pytest.mark.two_ranks(body=_metrics_rank)
def test_metrics_only_some_ranks_logged_and_a_methods_counts_combine_and_ranks_draw_their_own_noise(ranks_ran):
    """A key one rank lacks no longer turns the step's row into the main rank's share, a method's
    counts (count_metrics) are summed, and each rank's rollout generator has its own seed (the
    main rank's is the run's): alike seeded, the ranks drew the same noise for different prompts."""
    ranks = [torch.load(ranks_ran / f"metrics{r}.pt", weights_only=True) for r in range(2)]
    assert ranks[0]["combined"] == ranks[1]["combined"] == {
        "rollout/samples": 32.0, "loss/policy": 0.5, "x/resampled": 9.0, "time/step": 2.0,
        "x/resampled_accuracy": 0.25,
        # cost/* summed; maxima (and train/* flags) the largest, minima the smallest; a ratio of times averaged
        "cost/flops": 21.0, "rollout/len/max": 4.0, "rollout/len/min": 3.0, "time/waiting_ratio": 0.5,
        "train/bad_step": 1.0}
    assert ranks[0]["seed"] == ranks[0]["cfg_seed"] and ranks[1]["seed"] != ranks[0]["seed"]
    assert [r["text"] for r in ranks] == [{"loss/policy": 1.0, "note": "text"}, {"loss/policy": 3.0}]


def test_ranks_ending_with_different_weights_are_warned_of(tmp_path, monkeypatch):
    """summary.json records each rank's weight checksum; entries that differ are said, not just kept."""
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[
        f"output_dir={tmp_path}", "train.max_steps=1", "logging.tensorboard=false"])
    trainer = Trainer(cfg, *toy.build(cfg))
    monkeypatch.setattr(distributed, "weights_checksum", lambda params: [1.0, 2.0])
    with pytest.warns(UserWarning, match=r"end with different weights \(sum \|w\| per rank: \[1.0, 2.0\]\)"):
        summary = trainer.train()
    assert summary["weights_checksums"] == [1.0, 2.0]


def test_the_main_rank_seeds_with_the_runs_seed_and_each_other_rank_with_its_own(monkeypatch):
    """rank_seed: one process (or rank 0) draws as it always did, whatever the seed; another rank
    gets a seed of its own, a valid torch seed."""
    assert [distributed.rank_seed(s) for s in (0, 5, 2**40)] == [0, 5, 2**40]
    seeds = set()
    for r in (1, 2):
        monkeypatch.setattr(distributed, "rank", lambda r=r: r)
        seeds.add(distributed.rank_seed(5))
    assert len(seeds) == 2 and 5 not in seeds and all(0 <= s < 2**63 for s in seeds)
    torch.Generator().manual_seed(max(seeds))


def test_each_prompt_is_rolled_out_by_exactly_one_rank(monkeypatch):
    """shard: every world-th prompt from the rank's own index, with its draw index."""
    items, ids = list("abcde"), [10, 11, 12, 13, 14]
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    shares = []
    for r in (0, 1):
        monkeypatch.setattr(distributed, "rank", lambda r=r: r)
        shares.append(distributed.shard(items, ids))
    assert shares == [(["a", "c", "e"], [10, 12, 14]), (["b", "d"], [11, 13])]


def _deal(monkeypatch, held: list[list[int]], want: int):
    """_balance on each rank of a simulated world, rank r holding one row for each group id in
    held[r] (prompt "p<id>"): -> per rank (its groups in order, their prompts, groups trimmed),
    and what each rank put in the pool."""
    from mmrl.core.batch import RolloutBatch
    from mmrl.core.rewards import Sample
    from mmrl.core.scheduler import _balance

    def batch(ids):
        return RolloutBatch(group_ids=torch.tensor(ids, dtype=torch.long), samples=[Sample(f"p{g}", "") for g in ids],
                            prompts={g: f"p{g}" for g in ids}, data={"x": torch.zeros(len(ids))})

    local = replace(batch([0]), data={"x": torch.zeros(1, device="meta")})  # the rank's rollouts' device

    world = len(held)
    counts = [float(len(set(h))) for h in held]
    monkeypatch.setattr(distributed, "world_size", lambda: world)
    monkeypatch.setattr(distributed, "gather_scalar", lambda x: list(counts))
    pooled = [None] * world
    for r in range(world):  # first pass: what each rank gives to the pool
        monkeypatch.setattr(distributed, "rank", lambda r=r: r)
        monkeypatch.setattr(distributed, "gather_objects",
                            lambda obj, r=r: pooled.__setitem__(r, obj) or [])
        with contextlib.suppress(ValueError):  # an empty pool: a short rank has nothing to take yet
            _balance([batch(held[r])] if held[r] else [], want, local=local)
    out = []
    for r in range(world):
        monkeypatch.setattr(distributed, "rank", lambda r=r: r)
        monkeypatch.setattr(distributed, "gather_objects", lambda obj: list(pooled))
        kept, trimmed = _balance([batch(held[r])] if held[r] else [], want, local=local)
        groups = [g for b in kept for g in b.group_ids.tolist()]
        prompts = {g: p for b in kept for g, p in b.prompts.items()}
        out.append((groups, prompts, trimmed, len(kept), [b.data["x"].device.type for b in kept]))
    return out, pooled


def test_surplus_groups_are_dealt_to_the_short_ranks_in_rank_and_draw_order(monkeypatch):
    """Three ranks hold 6, 0 and 1 groups and want 2 each: share = min(7 // 3, 2) = 2. Rank 0 keeps
    its first two (0, 3) and pools 6, 9, 12, 15; rank 1 (short by 2) takes the pool's first two,
    rank 2 (short by 1) the next one; 15 is trimmed, counted once, on rank 0. What a rank takes
    from the pool lands on the device of its own rollouts (here "meta"), its own groups stay."""
    out, pooled = _deal(monkeypatch, [[0, 3, 6, 9, 12, 15], [], [7]], want=2)
    assert [o[0] for o in out] == [[0, 3], [6, 9], [7, 12]]
    assert [o[2] for o in out] == [1, 0, 0]
    assert [o[4] for o in out] == [["cpu"], ["meta"], ["cpu", "meta"]]
    for groups, prompts, *_ in out:  # each group arrives with its own prompt
        assert {g: prompts.get(g) for g in groups} == {g: f"p{g}" for g in groups}
    # only the surplus groups and their own prompts go to the pool
    assert pooled[1] is None and pooled[2] is None
    assert pooled[0].group_ids.tolist() == [6, 9, 12, 15]
    assert pooled[0].prompts == {6: "p6", 9: "p9", 12: "p12", 15: "p15"}
    # the surplus lies on a rank after a short one: rank 2 starts after rank 0's two in the pool
    out, _ = _deal(monkeypatch, [[], [1, 4, 7, 10, 13, 16], []], want=2)
    assert [o[0] for o in out] == [[7, 10], [1, 4], [13, 16]] and [o[2] for o in out] == [0, 0, 0]


def test_a_share_is_capped_at_the_groups_a_rank_wants(monkeypatch):
    """Two ranks holding 5 and 3 groups, wanting 2: each trains on 2 (not 8 // 2 = 4), nothing
    moves, 4 are trimmed."""
    out, _ = _deal(monkeypatch, [[0, 2, 4, 6, 8], [1, 3, 5]], want=2)
    assert [(o[0], o[2]) for o in out] == [([0, 2], 4), ([1, 3], 0)]


def test_a_share_of_nothing_leaves_every_rank_without_a_batch(monkeypatch):
    """One group between two ranks: share = 0, the group is trimmed and no rank keeps a batch,
    not even an empty one (the scheduler returns None for an empty list)."""
    out, _ = _deal(monkeypatch, [[4], []], want=1)
    assert [(o[0], o[2], o[3]) for o in out] == [([], 1, 0), ([], 0, 0)]


def test_equal_holdings_pass_through_untouched(monkeypatch):
    """Both ranks hold exactly their share: each keeps its own batches, nothing is pooled."""
    out, pooled = _deal(monkeypatch, [[0, 2], [1, 3]], want=2)
    assert [(o[0], o[2]) for o in out] == [([0, 2], 0), ([1, 3], 0)]
    assert pooled == [None, None]


def test_a_refill_round_draws_for_the_rank_short_of_the_most_and_the_surplus_is_trimmed(tmp_path, monkeypatch):
    """Rank 0 of two (4 prompts a step: 2 groups each) keeps every group; the other rank reports
    needing 2, then 1, then 0 more. Round 1 draws 0-3 (rank 0: 0, 2), round 2 draws 2 more
    for the other rank's one (rank 0: 4); rank 0 then holds 3, the other 2: share 2, rank 0
    trains on 0, 2 and its surplus 4 is trimmed."""
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[
        f"output_dir={tmp_path}", "rollout.num_generations=2", "method.dynamic_sampling.enabled=true",
        "method.dynamic_sampling.max_rounds=3"])
    trainer = Trainer(cfg, *toy.build(cfg))
    trainer.method.keep_groups = lambda batch: None  # rank 0 keeps what it rolls out
    other = iter([2, 1, 0, 2])  # the other rank's needs, round by round, then its groups held
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "rank", lambda: 0)
    monkeypatch.setattr(distributed, "gather_scalar", lambda x: [x, next(other)])
    monkeypatch.setattr(distributed, "gather_objects", lambda obj: [obj, None])
    monkeypatch.setattr(distributed, "sum_scalar", lambda x: x)
    monkeypatch.setattr(distributed, "sum_tensor", lambda t: t)
    batch, metrics = trainer.scheduler.next_groups(version=0)
    assert trainer.stream.position == 6 and metrics["rollout/rounds"] == 2
    assert batch.group_ids.unique().tolist() == [0, 2] and metrics["rollout/groups_trimmed"] == 1


def test_a_rank_whose_every_sample_was_pruned_still_joins_the_step(tmp_path, monkeypatch):
    """Rank 0 of two prunes all its rows while the other rank keeps 4: rank 0 gets an empty
    batch to train on (it must join the step's collectives), not None."""
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[f"output_dir={tmp_path}",
                                                                           "rollout.num_generations=2"])
    trainer = Trainer(cfg, *toy.build(cfg))
    trainer.method.__class__ = type("PruneAll", (type(trainer.method),),
                                    {"prune": lambda self, group: torch.zeros(len(group), dtype=torch.bool)})
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "rank", lambda: 0)
    monkeypatch.setattr(distributed, "gather_scalar", lambda x: [x, x])
    monkeypatch.setattr(distributed, "gather_objects", lambda obj: [obj, None])  # the round's errors: none
    monkeypatch.setattr(distributed, "sum_scalar", lambda x: x + 4.0)
    monkeypatch.setattr(distributed, "sum_tensor", lambda t: t)
    batch, metrics = trainer.scheduler.next_groups(version=0)
    assert batch is not None and len(batch) == 0 and metrics["rollout/samples_pruned"] == 4


def _failing_round(tmp_path, monkeypatch, other_error: str | None, score=None):
    """Rank 0 of two rolls out a round whose reward `score` (default: the toy's) it runs, while
    the other rank reports `other_error` from its own round; what rank 0 sent comes back too."""
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[f"output_dir={tmp_path}",
                                                                           "rollout.num_generations=2"])
    trainer = Trainer(cfg, *toy.build(cfg))
    if score is not None:
        monkeypatch.setattr(trainer.scheduler.reward, "score", score)
    _simulated(monkeypatch)
    monkeypatch.setattr(distributed, "gather_scalar", lambda x: [x, x])
    sent = _shares(monkeypatch, lambda mine: [mine, other_error])
    return trainer, sent


def test_a_rank_whose_reward_fails_in_a_rollout_stops_the_others_with_its_error(tmp_path, monkeypatch):
    """A reward function that raises on one rank only: that rank shares its error before it raises
    it, and the other rank raises a RankError naming it, both in the same round, so neither
    waits at the step's next collective for the other (before, rank 1 exited on its RewardError
    and rank 0 stopped on gloo's "Connection closed by peer" traceback, or waited there on NCCL)."""
    from mmrl.core.rewards import RewardError

    trainer, sent = _failing_round(tmp_path, monkeypatch, "RewardError: atom 'bad' failed on sample 0")
    with pytest.raises(distributed.RankError, match="^data-parallel rank 1 failed: RewardError: atom 'bad' failed"):
        trainer.scheduler.next_groups(version=0)
    assert sent == [None]  # rank 0 scored its share and said so

    def fails(samples):
        raise RewardError("atom 'bad' failed on sample 0")

    trainer, sent = _failing_round(tmp_path, monkeypatch, None, score=fails)
    with pytest.raises(RewardError, match="atom 'bad'"):  # the failing rank's own error, unchanged
        trainer.scheduler.next_groups(version=0)
    assert sent == ["RewardError: atom 'bad' failed on sample 0"]


def test_the_world_a_launcher_did_not_describe_is_a_config_error(monkeypatch):
    """WORLD_SIZE exported by hand without RANK and MASTER_ADDR (which torchrun and accelerate set
    with it) is refused by name before any group is joined (before, accelerate's ValueError
    traceback about MASTER_ADDR; with MASTER_ADDR set, rank 0 waited 30 minutes for the others),
    as is a WORLD_SIZE that is not a number; a launcher's whole environment passes."""
    from mmrl.core.config import ConfigError

    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMI_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"WORLD_SIZE=2 asks for 2 processes, but RANK and MASTER_ADDR are not "
                                          r"set.*torchrun --nproc_per_node 2"):
        distributed.init()
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="but MASTER_ADDR is not set"):
        distributed.launched_world()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert distributed.launched_world() == 2
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match="WORLD_SIZE='two' is not a number of processes"):
        distributed.launched_world()
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK")
    assert distributed.launched_world() == 1  # one process needs nothing else


def _simulated(monkeypatch, rank: int = 0, world: int = 2):
    """This process as rank `rank` of `world` on gloo; each test stands in for the collectives."""
    monkeypatch.setattr(distributed, "world_size", lambda: world)
    monkeypatch.setattr(distributed, "rank", lambda: rank)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")


def test_one_process_joins_no_group(monkeypatch):
    """init() with WORLD_SIZE 1 or unset (a plain `python` run) starts no process group."""
    import accelerate

    joined = []
    monkeypatch.setattr(accelerate, "PartialState", lambda **kw: joined.append(kw))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    distributed.init()
    monkeypatch.delenv("WORLD_SIZE")
    distributed.init()
    assert joined == []


def test_one_process_keeps_a_plain_adamw_and_nccl_refuses_to_shard_a_cpu_model(monkeypatch):
    """optim.shard_state with one process is AdamW itself; with several on NCCL, a model with
    any weight on the CPU is refused before ZeRO is built (one CPU weight among GPU ones too)."""
    from mmrl.core.config import ConfigError

    cpu = torch.nn.Parameter(torch.zeros(2))
    opt = distributed.adamw([cpu], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, shard=True)
    assert type(opt) is torch.optim.AdamW
    _simulated(monkeypatch)
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    elsewhere = torch.nn.Parameter(torch.zeros(2, device="meta"))  # not on the CPU
    with pytest.raises(ConfigError, match="model.device=cuda"):
        distributed.adamw([elsewhere, cpu], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, shard=True)


def test_another_ranks_seed_by_hand(monkeypatch):
    """rank_seed on rank r > 0: (seed * 1_000_003 + r) mod 2^63."""
    monkeypatch.setattr(distributed, "rank", lambda: 2)
    assert distributed.rank_seed(5) == 5_000_017  # 5 * 1_000_003 + 2
    monkeypatch.setattr(distributed, "rank", lambda: 1)
    # 2^62 * 1_000_003 = 2^62 * (2 * 500_001 + 1) = 2^62 mod 2^63, + 1
    assert distributed.rank_seed(2**62) == 2**62 + 1


def test_summed_and_gathered_scalars_stay_exact_past_float32(monkeypatch):
    """sum_scalar and gather_scalar travel in float64: a count of 2^24 + 1 (float32 rounds it to
    2^24) arrives whole, and gather_scalar lists the ranks in rank order."""
    _simulated(monkeypatch)
    monkeypatch.setattr(dist, "all_reduce", lambda t: t.add_(1.0))  # the other rank holds 1

    def all_gather(out, local):  # rank r holds local + r
        for r, t in enumerate(out):
            t.copy_(local + r)

    monkeypatch.setattr(dist, "all_gather", all_gather)
    assert distributed.sum_scalar(2**24) == 2**24 + 1
    assert distributed.gather_scalar(2**24) == [2**24, 2**24 + 1]


def test_a_summed_tensor_is_a_new_one_in_the_inputs_dtype(monkeypatch):
    """sum_tensor never reduces into the caller's tensor (a float64 CPU one included) and gives
    the sum back in the input's dtype."""
    _simulated(monkeypatch)
    monkeypatch.setattr(dist, "all_reduce", lambda t: t.mul_(2))  # the other rank holds the same
    t = torch.tensor([1.0, 2.5], dtype=torch.float64)
    out = distributed.sum_tensor(t)
    assert out.tolist() == [2.0, 5.0] and t.tolist() == [1.0, 2.5]
    half = distributed.sum_tensor(torch.tensor([1.5], dtype=torch.bfloat16))
    assert half.dtype == torch.bfloat16 and half.tolist() == [3.0]


def _shares(monkeypatch, shared):
    """gather_objects answering with every rank's (results, error); what this rank sent is kept."""
    sent = []
    monkeypatch.setattr(distributed, "gather_objects", lambda obj: sent.append(obj) or list(shared(obj)))
    return sent


def test_a_rank_without_a_share_does_not_call_fn_and_gets_every_result(monkeypatch):
    """map_shards of one item on rank 1 of 2: fn is not called with an empty share; the results
    come back in the items' order."""
    _simulated(monkeypatch, rank=1)
    sent = _shares(monkeypatch, lambda mine: [([70], None), mine])
    calls = []
    assert distributed.map_shards(lambda items: calls.append(items) or [], [7]) == [70]
    assert calls == [] and sent == [([], None)]


def test_fn_giving_a_wrong_number_of_results_fails_its_rank(monkeypatch):
    """Fewer or more results than items in the rank's share (here 7 and 9 of 7, 8, 9) is an error
    on that rank, shared with the others (so they stop too)."""
    _simulated(monkeypatch, rank=0)
    sent = _shares(monkeypatch, lambda mine: [mine, ([], None)])
    for results, words in (([1], "1 results for 2 items"), ([1, 2, 3], "3 results for 2 items")):
        with pytest.raises(RuntimeError, match=f"map_shards: {words}"):
            distributed.map_shards(lambda items, r=results: r, [7, 8, 9])
        assert sent.pop()[1] == f"RuntimeError: map_shards: {words}"


def test_the_main_ranks_failure_stops_every_other_rank(monkeypatch):
    """Rank 1 of 2, its own share fine, raises a RankError naming rank 0's error."""
    _simulated(monkeypatch, rank=1)
    _shares(monkeypatch, lambda mine: [([], "ValueError: bad item"), mine])
    with pytest.raises(distributed.RankError, match="^data-parallel rank 0 failed: ValueError: bad item$"):
        distributed.map_shards(lambda items: items, [1, 2])


def test_one_process_maps_to_a_list():
    assert distributed.map_shards(lambda items: (x + 1 for x in items), [1, 2]) == [2, 3]


def test_metrics_of_two_ranks_combine_by_kind_by_hand(monkeypatch):
    """combine_metrics over two ranks logging the same keys, the other rank's values 3 times this
    one's (all 1 here): counts (every rollout and reward count, a method's own, cost/*) sum to 4; maxima
    (_max and /max), train/* flags and wall times take 3; minima (_min and /min) take 1; the rest,
    a ratio of times included, average to 2."""
    _simulated(monkeypatch)
    monkeypatch.setattr(distributed, "gather_scalar", lambda x: [x, x])  # the same keys on both ranks

    def all_gather(table, local):
        table[0].copy_(local)
        table[1].copy_(local * 3)  # its "logged" flags 3: still logged

    monkeypatch.setattr(dist, "all_gather", all_gather)
    counts = ["rollout/samples", "rollout/samples_extra", "rollout/samples_pruned", "rollout/groups",
              "rollout/groups_dropped", "rollout/groups_refilled", "rollout/groups_extra", "rollout/groups_trimmed",
              "rollout/decoded_tokens", "rollout/engine_calls", "rollout/redispatched", "reward/errors"]
    sums = [*counts, "x/resampled", "cost/flops"]
    maxima = ["len_max", "rollout/len/max", "train/skipped", "time/step"]
    minima = ["len_min", "rollout/len/min"]
    means = ["loss/policy", "time/waiting_ratio"]
    metrics = {k: 1.0 for k in sums + maxima + minima + means}
    expected = {k: 4.0 for k in sums} | {k: 3.0 for k in maxima} | {k: 1.0 for k in minima} | {k: 2.0 for k in means}
    assert distributed.combine_metrics(metrics, ("x/resampled",)) == expected


def test_a_rank_logging_text_is_warned_of_once_on_the_main_rank(monkeypatch):
    """A rank whose metrics are not all numbers (its signature -1): every rank keeps its own
    metrics, and the main rank warns once a run, not every step."""
    import warnings

    _simulated(monkeypatch)
    monkeypatch.setitem(distributed._said, "keys", False)
    monkeypatch.setattr(distributed, "gather_scalar", lambda x: [x, -1.0])
    mine = {"loss/policy": 1.0}
    with pytest.warns(UserWarning, match="not a number"):
        assert distributed.combine_metrics(mine) is mine
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert distributed.combine_metrics(mine) is mine
        monkeypatch.setitem(distributed._said, "keys", False)
        monkeypatch.setattr(distributed, "rank", lambda: 1)
        assert distributed.combine_metrics(mine) is mine  # not the main rank: silent


def test_gradients_are_summed_per_dtype_and_a_missing_one_counts_as_zero(monkeypatch):
    """sum_gradients with the other rank's gradients equal to this one's: each doubles, in its own
    dtype, one all_reduce per dtype; a parameter without a gradient gets zeros."""
    _simulated(monkeypatch)
    reduced = []
    monkeypatch.setattr(dist, "all_reduce", lambda t: reduced.append(t.dtype) or t.mul_(2))
    a = torch.nn.Parameter(torch.zeros(2))
    a.grad = torch.tensor([1.0, -2.0])
    b = torch.nn.Parameter(torch.ones(2, 1))
    c = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
    c.grad = torch.tensor([0.5], dtype=torch.bfloat16)
    distributed.sum_gradients([a, b, c])
    assert a.grad.tolist() == [2.0, -4.0] and b.grad.tolist() == [[0.0], [0.0]]
    assert c.grad.dtype == torch.bfloat16 and c.grad.tolist() == [1.0]
    assert sorted(reduced, key=str) == [torch.bfloat16, torch.float32]


def test_the_weights_checksum_sums_absolute_values_in_float64():
    """One process: [sum |w|]; 2^24 + |-1| is exact in float64 (float32 gives 2^24)."""
    w = torch.nn.Parameter(torch.tensor([2.0**24, -1.0]))
    assert distributed.weights_checksum([w]) == [2**24 + 1]


def test_one_process_needs_no_barrier(monkeypatch):
    monkeypatch.setattr(dist, "barrier", lambda: pytest.fail("a barrier with one process"))
    distributed.barrier()
