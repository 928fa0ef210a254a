"""optim.fsdp (mmrl.core.fsdp): two processes with the model fully sharded train as two processes
with it whole, hold half of it each, write the unsharded run's checkpoints and resume exactly."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import toy
from test_data_parallel import global_batch
from two_ranks import process_group

from mmrl.core import fsdp
from mmrl.core.checkpoint import load_checkpoint, step_dir
from mmrl.core.config import ConfigError, TrainConfig, load_config
from mmrl.core.trainer import Trainer

RUNS = (("whole", False, 3, False), ("sharded", True, 3, False), ("resumed", True, 2, False),
        ("resumed", True, 3, True), ("whole-bf16", False, 2, False), ("sharded-bf16", True, 2, False),
        # either kind of run resumes the other's bfloat16 checkpoints
        ("whole3-bf16", False, 3, False), ("to-sharded-bf16", False, 2, False), ("to-sharded-bf16", True, 3, True),
        ("to-whole-bf16", True, 2, False), ("to-whole-bf16", False, 3, True),
        # a KL reference, sharded beside the policy
        ("whole-kl", False, 2, False), ("sharded-kl", True, 2, False),
        ("whole-kl-bf16", False, 2, False), ("sharded-kl-bf16", True, 2, False))


def _config(out, fsdp_on, steps, *extra):
    return load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[
        f"output_dir={out}", f"train.max_steps={steps}", "train.save_every=1", f"optim.fsdp={fsdp_on}",
        "optim.weight_decay=0.01", "train.micro_batch_size=8", *extra])


def whole_weights(trainer):
    """The float32 weights the optimizer steps (master weights where the model is bfloat16)."""
    return [fsdp.Sharded.whole(p.detach()).clone() for p in trainer.opt_params]


def _rank(rank, port, tmp):
    with process_group(rank, port):
        record = {}
        for name, on, steps, resume in RUNS:
            kl = ("method.kl.beta=0.5",) if "-kl" in name else ()
            policy, task = toy.build(cfg := _config(f"{tmp}/{name}", on, steps, *kl))
            if name.endswith("bf16"):
                policy.model.to(torch.bfloat16)
            trainer = Trainer(cfg, policy, task)
            summary = trainer.train(resume=resume)
            record[name] = {"weights": whole_weights(trainer), "eval": summary["eval_after"],
                            "local": sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in trainer.params),
                            "total": sum(p.numel() for p in trainer.params),
                            "sharded": trainer.sharded is not None}
            if kl:
                ref = trainer.reference.model
                record[name].update(ref_sharded=fsdp.is_sharded(ref), ref_dtypes={str(p.dtype) for p in ref.parameters()},
                                    ref_local=sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in ref.parameters()))
        # uneven shares: rank 0 one row, rank 1 seven, micro-batches of 2 (1 against 4 passes)
        for name, on in (("uneven-whole", False), ("uneven-sharded", True)):
            trainer = Trainer(cfg := _config(f"{tmp}/{name}", on, 1, "train.micro_batch_size=2"), *toy.build(cfg))
            batch = global_batch(trainer).select(torch.arange(8))
            metrics = trainer.update(batch.select(torch.arange(1) if rank == 0 else torch.arange(1, 8)))
            record[name] = {"weights": whole_weights(trainer), "updates": metrics["train/updates"]}
        # tied weights (an output layer sharing the embedding) stay one tensor for save_pretrained
        from transformers import LlamaConfig, LlamaForCausalLM

        tied = LlamaForCausalLM(LlamaConfig(**{**toy.tiny_llama().config.to_dict(), "tie_word_embeddings": True}))
        sharded = fsdp.Sharded(tied)
        gathered = sharded.whole_state(list(tied.parameters()), keep=rank == 0)
        record["tied"] = gathered is None or gathered[0]["lm_head.weight"] is gathered[0]["model.embed_tokens.weight"]
        torch.save(record, f"{tmp}/record.{rank}")


# sharding needs FSDP2 from torch 2.8 (fsdp.check refuses older ones): those tests skip there
shards = pytest.mark.skipif(fsdp._fsdp_module() is None, reason="optim.fsdp needs torch>=2.8")


def on_the_runs(test):
    """The tests that check RUNS share one run of them."""
    return shards(pytest.mark.two_ranks(body=_rank)(test))


@pytest.fixture
def runs(ranks_ran):
    return ranks_ran, [torch.load(ranks_ran / f"record.{r}", weights_only=True) for r in range(2)]


def close(a, b, atol=1e-6):
    return all(torch.allclose(x.float(), y.float(), atol=atol, rtol=0) for x, y in zip(a, b, strict=True))


@on_the_runs
def test_sharded_ranks_train_as_whole_ones_with_half_the_weights_each(runs):
    _, ranks = runs
    for r in ranks:
        assert r["sharded"]["sharded"] and not r["whole"]["sharded"]
        # the same sums in another order: equal to float32 rounding, after 3 steps at lr 3e-3
        assert close(r["sharded"]["weights"], r["whole"]["weights"])
        assert not close(r["sharded"]["weights"], list(toy.build(_config("start", False, 1))[0].model.parameters()),
                         atol=1e-3)  # it trained
        assert r["sharded"]["eval"] == r["whole"]["eval"]
        assert r["whole"]["local"] == r["whole"]["total"]
    shares = [r["sharded"]["local"] for r in ranks]
    assert sum(shares) == ranks[0]["whole"]["total"] and max(shares) <= 0.55 * sum(shares), shares


@on_the_runs
def test_a_sharded_run_resumes_bit_for_bit_and_writes_the_whole_runs_checkpoints(runs):
    tmp, ranks = runs
    for r in ranks:
        for a, b in zip(r["resumed"]["weights"], r["sharded"]["weights"], strict=True):
            assert torch.equal(a, b)
    a, b = (load_checkpoint(step_dir(tmp / name / "checkpoints", 3))[0] for name in ("whole", "sharded"))
    optim = sorted(k for k in a if k.startswith("optim."))
    assert optim and optim == sorted(k for k in b if k.startswith("optim."))
    assert all(a[k].shape == b[k].shape and torch.allclose(a[k], b[k], atol=1e-6) for k in optim)
    # model/ loads with from_pretrained, whole, and holds the trained weights
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(step_dir(tmp / "sharded" / "checkpoints", 3) / "model")
    assert close([p for p in model.parameters()], ranks[0]["sharded"]["weights"], atol=0)


@on_the_runs
def test_a_bfloat16_run_resumes_sharded_from_a_whole_runs_checkpoint_and_whole_from_a_sharded_one(runs):
    _, ranks = runs
    for r in ranks:
        for name in ("to-sharded-bf16", "to-whole-bf16"):  # 2 steps one way, then the 3rd the other
            assert close(r[name]["weights"], r["whole3-bf16"]["weights"]), name


@on_the_runs
def test_bfloat16_shards_are_float32_master_weights_and_model_holds_bfloat16(runs):
    tmp, ranks = runs
    for r in ranks:
        # the float32 weights the optimizer steps: FSDP's shards and the whole run's master weights
        assert close(r["sharded-bf16"]["weights"], r["whole-bf16"]["weights"])
        assert all(w.dtype == torch.float32 for w in r["sharded-bf16"]["weights"])
    tensors, _ = load_checkpoint(step_dir(tmp / "sharded-bf16" / "checkpoints", 2))
    masters = [tensors[f"master.{i}"] for i in range(len(ranks[0]["sharded-bf16"]["weights"]))]
    assert all(m.dtype == torch.float32 for m in masters)
    assert close(masters, ranks[0]["sharded-bf16"]["weights"], atol=0)
    import json

    from safetensors.torch import load_file

    config = json.loads((step_dir(tmp / "sharded-bf16" / "checkpoints", 2) / "model" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"  # save_pretrained reads the gathered weights' dtype
    assert all(r["tied"] for r in ranks)

    saved = load_file(step_dir(tmp / "sharded-bf16" / "checkpoints", 2) / "model" / "model.safetensors")
    assert {v.dtype for v in saved.values()} == {torch.bfloat16}


@on_the_runs
def test_a_kl_reference_is_sharded_in_its_dtype_and_gives_the_whole_runs_kl(runs):
    tmp, ranks = runs
    for r in ranks:
        for dtype in ("", "-bf16"):
            whole, sharded = r[f"whole-kl{dtype}"], r[f"sharded-kl{dtype}"]
            assert sharded["ref_sharded"] and not whole["ref_sharded"]
            assert sharded["ref_dtypes"] == whole["ref_dtypes"] == {"torch.bfloat16" if dtype else "torch.float32"}
            assert 2 * sharded["ref_local"] <= 1.1 * whole["ref_local"]  # half each
            assert close(sharded["weights"], whole["weights"], atol=1e-6 if not dtype else 1e-5)
    for dtype in ("", "-bf16"):
        kl = [[json.loads(line)["loss/kl"] for line in (tmp / f"{name}{dtype}" / "metrics.jsonl").open()]
              for name in ("whole-kl", "sharded-kl")]
        assert kl[0][1] > 0  # the second step's policy has moved from the reference
        assert kl[1] == pytest.approx(kl[0], rel=1e-4, abs=1e-9), kl


@on_the_runs
def test_a_rank_with_fewer_micro_batches_joins_the_others_forward_passes(runs):
    _, ranks = runs
    for r in ranks:
        assert r["uneven-sharded"]["updates"] == 1
        assert close(r["uneven-sharded"]["weights"], r["uneven-whole"]["weights"])


@pytest.mark.parametrize("override, words", [
    ("rollout.scheduler.mode=pipelined", "mode=sync"),
    ("optim.shard_state=true", "shard_state"),
])
def test_settings_fsdp_is_not_built_for_are_refused(override, words):
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=["optim.fsdp=true", override])
    from mmrl.core.pipeline import placement

    with pytest.raises(ConfigError, match=words):
        fsdp.check(cfg, placement(cfg))


def test_lora_and_a_weight_average_are_refused():
    from diffusion_rl.backend import CONFIG_CLASS as FLOW
    from diffusion_rl.backend import DEFAULT_CONFIG as FLOW_DEFAULT
    from dllm_rl.backend import CONFIG_CLASS as DLLM
    from dllm_rl.backend import DEFAULT_CONFIG as DLLM_DEFAULT

    lora = load_config(DLLM, defaults=DLLM_DEFAULT, overrides=["optim.fsdp=true", "model.lora.r=4"])
    with pytest.raises(ConfigError, match="model.lora"):
        fsdp.check(lora, "inline")
    ema = load_config(FLOW, defaults=FLOW_DEFAULT, overrides=["optim.fsdp=true", "method.ema.decay=0.9"])
    with pytest.raises(ConfigError, match="method.ema"):
        fsdp.check(ema, "inline")


def test_a_torch_without_fsdp2_is_refused_by_name_and_trains_unsharded(monkeypatch):
    # torch 2.4/2.5 have no public FSDPModule (nor DTensor in 2.4): a run without optim.fsdp must
    # not import them (every optimizer step asks for the whole gradient norm)
    import torch.distributed.fsdp as fsdp_api

    monkeypatch.delattr(fsdp_api, "FSDPModule")
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=["optim.fsdp=true"])
    with pytest.raises(ConfigError, match=r"optim.fsdp needs torch>=2.8 .* set optim.fsdp=false"):
        fsdp.check(cfg, "inline")
    model = torch.nn.Linear(2, 2)
    norm = torch.tensor(3.0)
    assert not fsdp.is_sharded(model) and fsdp.Sharded.whole(norm) is norm


def test_one_process_trains_unsharded_and_says_so(tmp_path):
    cfg = _config(tmp_path, True, 1)
    with pytest.warns(UserWarning, match="with one process it stays whole"):
        trainer = Trainer(cfg, *toy.build(cfg))
    assert trainer.sharded is None and all(type(p) is torch.nn.Parameter for p in trainer.params)


def _vlm_rank(rank, port, tmp):
    with process_group(rank, port, timeout=60):
        from mmrl.vlm import backend

        cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG, overrides=[f"output_dir={tmp}/run"])
        policy, task = backend.build(cfg)
        sharded = fsdp.Sharded(policy.model)
        with sharded.gathered(), torch.no_grad():
            for _ in range(1 + rank):  # ranks generate different numbers of times (AXPO's extra samples)
                batch = policy.generate(task.train_prompts()[:1], 2, cfg.rollout, torch.Generator().manual_seed(0))
        total = torch.ones(1)
        dist.all_reduce(total)  # the loop's next collective meets the other rank's
        torch.save({"rows": len(batch), "total": float(total)}, f"{tmp}/record.{rank}")


@shards
@pytest.mark.two_ranks(body=_vlm_rank)
def test_vlm_ranks_generate_on_their_own_with_the_weights_gathered(ranks_ran):
    """transformers makes generate a collective on a sharded model (synced_gpus) unless told
    otherwise: ranks that generate different numbers of times would wait for each other."""
    assert [torch.load(ranks_ran / f"record.{r}", weights_only=True) for r in range(2)] == [{"rows": 2, "total": 2.0}] * 2


def test_vlm_training_prompts_without_images_are_refused_under_fsdp():
    from types import SimpleNamespace

    from mmrl.vlm.policy import VLMPolicy

    prompts = [SimpleNamespace(images=["a.png"]), SimpleNamespace(images=[])]
    with pytest.raises(ConfigError, match="1 of 2 training prompts have no image"):
        VLMPolicy.check_sharded(None, prompts)


def test_a_model_without_declared_blocks_is_sharded_by_its_outermost_layers():
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ff = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])  # inner lists stay in their block

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block(), Block(), nn.Dropout()])  # no weights: no unit
            self.head = nn.Linear(2, 2)

    model = Model()
    assert fsdp._blocks(model) == [model.layers[1], model.layers[0]]  # innermost first


def test_filler_passes_match_the_rank_with_the_most_micro_batches(monkeypatch):
    """Each rank adds passes up to the busiest rank's count; a rank that needs some but has no
    rows to make them with stops every rank alike (one that needs none may have no rows)."""
    def ranks(*counts):
        monkeypatch.setattr(fsdp.distributed, "gather_objects", lambda mine: list(counts))

    ranks((1, 1), (4, 7))
    assert fsdp.filler_passes(1, 1) == 3 and fsdp.filler_passes(4, 7) == 0
    ranks((2, 0), (2, 5))
    assert fsdp.filler_passes(2, 0) == 0
    ranks((3, 4), (0, 0))
    with pytest.raises(RuntimeError, match="rank 1 has no rows"):
        fsdp.filler_passes(3, 4)


def test_a_reference_that_cannot_be_sharded_is_left_whole():
    from types import SimpleNamespace

    from torch import nn

    model = nn.Linear(2, 2)
    assert fsdp.shard_reference(None, model) is None  # no KL reference
    assert fsdp.shard_reference(SimpleNamespace(model=model), model) is None  # the policy's own model
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to(torch.bfloat16))
    assert fsdp.shard_reference(SimpleNamespace(model=mixed), model) is None  # several dtypes
    assert fsdp.shard_reference(SimpleNamespace(model=nn.ReLU()), model) is None  # no weights at all


def test_the_checksum_sums_absolute_values_in_float64():
    """One process: sum |w| over plain weights; 2^24 + |-1| is exact in float64 (not in float32)."""
    assert fsdp.checksum([torch.tensor([2.0**24, -1.0]), torch.tensor([[-0.5]])]) == 2**24 + 1.5


def test_filler_passes_name_the_first_rank_that_cannot_join(monkeypatch):
    monkeypatch.setattr(fsdp.distributed, "gather_objects", lambda mine: [(3, 4), (1, 0), (2, 0)])
    with pytest.raises(RuntimeError, match="rank 1 has no rows"):
        fsdp.filler_passes(3, 4)


def test_declared_blocks_are_the_units_innermost_first_and_never_the_model_itself():
    """_no_split_modules names the block types, wherever they sit (here outside any ModuleList);
    the model is not one of its own blocks even where its class is named too."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(2, 2)

    class Tower(nn.Module):
        _no_split_modules = ("Block", "Tower")

        def __init__(self):
            super().__init__()
            self.first, self.second = Block(), Block()

    model = Tower()
    assert fsdp._blocks(model) == [model.second, model.first]


def test_a_cpu_model_under_nccl_is_refused(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_backend", lambda: "nccl")
    with pytest.raises(ConfigError, match="model.device=cuda"):
        fsdp.Sharded(torch.nn.Linear(2, 2))


@pytest.fixture
def one_rank(monkeypatch):
    """A gloo group of one process: FSDP shards over a mesh of one rank, in this process."""
    from two_ranks import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_weights_in_two_low_dtypes_are_refused(one_rank):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2).half(), torch.nn.Linear(2, 2).to(torch.bfloat16))
    with pytest.raises(ConfigError, match="several dtypes"):
        fsdp.Sharded(model)


@shards
def test_nested_gathered_blocks_keep_the_weights_whole_until_the_outer_one_ends(one_rank):
    from torch.distributed.tensor import DTensor

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    sharded = fsdp.Sharded(model)

    def whole():
        return [not isinstance(p, DTensor) for p in model.parameters()]

    assert whole() == [False] * 4
    with sharded.gathered():
        with sharded.gathered():
            assert whole() == [True] * 4
        assert whole() == [True] * 4  # the inner block ended: still whole
    assert whole() == [False] * 4
    # a sharded tensor whole on the writer, None on the other ranks
    p = next(model.parameters())
    assert isinstance(p, DTensor) and fsdp.Sharded.whole(p, keep=False) is None
    assert fsdp.Sharded.whole(p).shape == (2, 2)


@shards
def test_tied_bfloat16_weights_are_written_as_one_tensor(one_rank):
    """whole_state of a bfloat16 model whose output layer shares the embedding: the two names
    hold one bfloat16 tensor (a cast per name would make two, which save_pretrained writes twice);
    the master weights stay float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tied = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True))
    tied.to(torch.bfloat16)
    sharded = fsdp.Sharded(tied)
    state, masters = sharded.whole_state(list(tied.parameters()), keep=True)
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    assert state["lm_head.weight"].dtype == torch.bfloat16 and all(m.dtype == torch.float32 for m in masters)
