"""The diffusion policy and Flow-GRPO on tiny real diffusers models (built offline by
diffusion_rl.models.build_tiny, loaded through from_pretrained): SDE rollouts, the
ratio exactly 1 on-policy, one update that changes every trainable weight, KL to the
reference, the whole loop through the core Trainer, and bad input."""

from __future__ import annotations

import json
import math
import warnings
from types import SimpleNamespace

import pytest
import torch
import yaml

from diffusion_rl import backend
from diffusion_rl.config import DiffusionTrainConfig
from diffusion_rl.models import build_tiny
from mmrl.core.config import ConfigError, load_config
from mmrl.core.trainer import Trainer, TrainingError

FAST = ["rollout.num_steps=4", "rollout.window_size=2", "rollout.num_generations=2", "rollout.prompts_per_step=2",
        "task.num_train=16", "task.num_eval=2", "task.grid_prompts=2", "logging.tensorboard=false",
        "logging.progress=false", "optim.lr=1e-3"]


def make(path, tmp_path, *overrides):
    cfg = load_config(DiffusionTrainConfig, defaults=backend.DEFAULT_CONFIG,
                      overrides=[f"model.path={path}", f"output_dir={tmp_path / 'run'}", *FAST, *overrides])
    return cfg, *backend.build(cfg)


def test_rollout_layout_and_ratio_exactly_one_on_policy(flux_dir, tmp_path):
    cfg, policy, task = make(flux_dir, tmp_path)
    batch = policy.generate(task.train[:2], 3, cfg.rollout, torch.Generator().manual_seed(0))
    n, t = 6, 2
    assert batch.old_logp.shape == (n, t) and batch.mask.all()
    assert batch.data["latents"].shape[:2] == (n, t) and batch.data["sigma"].shape == (n, t)
    assert (batch.data["sigma_next"] < batch.data["sigma"]).all()
    assert all(s.completion.size == (policy.flow.width, policy.flow.height) for s in batch.samples)
    with torch.no_grad():
        logp = policy.logprobs(batch)
    assert torch.equal(logp, batch.old_logp)  # exactly: the same weights score the same transition


def test_shared_noise_gives_a_group_one_start_and_its_window_the_only_difference(flux_dir, tmp_path):
    cfg, policy, task = make(flux_dir, tmp_path, "rollout.shared_noise=true", "rollout.window_start=[1,1]",
                             "rollout.window_size=1")
    batch = policy.generate(task.train[:2], 3, cfg.rollout, torch.Generator().manual_seed(0))
    x = batch.data["latents"][:, 0]  # the latents entering the window (step 1): ODE from the shared start
    assert torch.equal(x[0], x[1]) and torch.equal(x[1], x[2]) and torch.equal(x[3], x[5])
    assert not torch.equal(x[2], x[3])  # another prompt, another start
    nxt = batch.data["next_latents"][:, 0]
    assert not torch.equal(nxt[0], nxt[1])  # the window's noise is each sample's own
    cfg.rollout.shared_noise = False
    x = policy.generate(task.train[:2], 3, cfg.rollout, torch.Generator().manual_seed(0)).data["latents"][:, 0]
    assert not torch.equal(x[0], x[1])


def test_one_update_changes_every_trainable_weight_and_kl_starts_at_zero(flux_dir, tmp_path, reward_spread):
    cfg, policy, task = make(flux_dir, tmp_path, "train.max_steps=1", "method.kl.beta=0.04")
    before = {k: v.clone() for k, v in policy.model.named_parameters() if v.requires_grad}
    Trainer(cfg, policy, task).train()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["loss/kl"] == pytest.approx(0.0, abs=1e-10)  # on the first step theta = reference
    unchanged = [k for k, v in policy.model.named_parameters() if v.requires_grad and torch.equal(v, before[k])]
    assert not unchanged, unchanged
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert {"atom_accuracy", "prompt_accuracy", "exist", "count", "colour", "relation"} <= set(summary["eval_after"])
    assert (tmp_path / "run" / "samples" / "grid_before.png").is_file()
    assert (tmp_path / "run" / "samples" / "grid_after.png").is_file()


def test_non_finite_latents_stop_the_step_before_any_checkpoint(flux_dir, tmp_path):
    cfg, policy, task = make(flux_dir, tmp_path, "train.max_steps=2", "train.save_every=1")
    velocity = policy.flow.velocity

    def broken(*a, **kw):
        return velocity(*a, **kw) * float("nan")

    policy.flow.velocity = broken
    with pytest.raises(TrainingError, match="non-finite"):
        Trainer(cfg, policy, task).train()
    assert not list((tmp_path / "run").glob("checkpoints/step-*"))


def test_sampled_images_with_non_finite_latents_are_named_in_a_warning(flux_dir, tmp_path):
    policy = make(flux_dir, tmp_path)[1]
    velocity = policy.flow.velocity

    def broken(x, *a, **kw):  # the second image diverges, as a huge guidance_scale makes it
        v = velocity(x, *a, **kw)
        return torch.cat([v[:1], v[1:] * float("inf")])

    policy.flow.velocity = broken
    with pytest.warns(UserWarning, match=r"1 of 2 sampled images have non-finite latents \('a red circle' seed 1\)"):
        images = policy.sample_images(["a red circle"] * 2, [0, 1], 4)
    assert len(images) == 2
    policy.flow.velocity = velocity
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        policy.sample_images(["a red circle"], [0], 4)


def test_bad_model_dir_is_a_config_error(tmp_path):
    cfg = load_config(DiffusionTrainConfig, defaults=backend.DEFAULT_CONFIG,
                      overrides=[f"model.path={tmp_path / 'nowhere'}"])
    with pytest.raises(ConfigError, match="model.path"):
        backend.build(cfg)


def test_window_must_leave_the_last_step_deterministic():
    with pytest.raises(ConfigError, match="window_size"):
        load_config(DiffusionTrainConfig, defaults=backend.DEFAULT_CONFIG,
                    overrides=["rollout.num_steps=4", "rollout.window_size=4"])


@pytest.mark.parametrize("lora", [False, True])
def test_resume_reproduces_the_uninterrupted_run(flux_dir, tmp_path, lora):
    """Also under LoRA, whose checkpoints hold the adapter alone (as the VLM's and dLLM's do):
    no pipeline, no frozen text encoder or VAE; and again as diffusers' pipeline loader reads it."""
    extra = ["model.lora.r=4"] if lora else []

    def run(name, steps, resume=False):
        cfg, policy, task = make(flux_dir, tmp_path / name, f"train.max_steps={steps}", "train.save_every=1", *extra)
        Trainer(cfg, policy, task).train(resume=resume)
        return policy

    full = run("full", 2)
    run("split", 1)
    (model_dir,) = (tmp_path / "split" / "run" / "checkpoints").glob("step-*/model")
    saved = sorted(p.name for p in model_dir.iterdir())
    if lora:
        assert saved == ["adapter_config.json", "adapter_model.safetensors", "pytorch_lora_weights.safetensors"]
    else:
        assert {"model_index.json", "transformer", "text_encoder"} <= set(saved)
    resumed = run("split", 2, resume=True)
    for (k, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), k


def test_an_old_lora_checkpoint_a_pipeline_with_its_adapter_in_lora_still_loads(flux_dir, tmp_path):
    """Before 2026-12-05 a LoRA run saved the merged pipeline plus the adapter in lora/."""
    _, policy, _ = make(flux_dir, tmp_path, "model.lora.r=4")
    with torch.no_grad():
        for p in policy.model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    policy.flow.save_pretrained(tmp_path / "old")
    policy.flow.save_transformer_weights(tmp_path / "old" / "lora")
    _, other, _ = make(flux_dir, tmp_path, "model.lora.r=4")
    other.load_weights(tmp_path / "old")
    for (k, a), b in zip(policy.model.state_dict().items(), other.model.state_dict().values()):
        assert torch.equal(a, b), k


def test_a_checkpoint_loads_only_into_a_run_with_its_lora_setting(flux_dir, tmp_path):
    """An adapter into a run without model.lora added the adapter (the model's own load does):
    resuming then failed with a traceback in the optimizer's load, built over the full weights.
    A pipeline into a LoRA run said to call save_transformer_weights, not which setting to change."""
    _, lora, _ = make(flux_dir, tmp_path, "model.lora.r=4")
    lora.save_pretrained(tmp_path / "adapter")
    _, full, _ = make(flux_dir, tmp_path)
    with pytest.raises(ConfigError, match="holds a LoRA adapter, not full weights: set model.lora as the run did"):
        full.load_weights(tmp_path / "adapter")
    assert not full.flow.has_lora
    full.save_pretrained(tmp_path / "pipeline")
    with pytest.raises(ConfigError, match="holds no LoRA adapter .*model.lora set: .*or unset model.lora"):
        lora.load_weights(tmp_path / "pipeline")


def test_a_lora_checkpoint_as_model_path_is_refused_with_what_to_do(flux_dir, tmp_path):
    _, policy, _ = make(flux_dir, tmp_path, "model.lora.r=4")
    policy.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ConfigError, match="holds a LoRA adapter.*--checkpoint"):
        make(tmp_path / "adapter", tmp_path)



@pytest.mark.parametrize("lora", [False, True])
def test_a_pipelined_engine_samples_with_its_own_copy_of_the_weights(flux_dir, tmp_path, lora):
    """rollout.scheduler.mode=pipelined runs a background engine on a frozen copy of the
    weights (adapters included under LoRA, where the KL reference is the adapter-free base):
    it samples as the policy does, keeps its weights while the trainer's move, takes them on
    publish, and charges its rows to the policy's cost/model_evaluations."""
    from mmrl.core.engine import PolicyEngine, trainable_weights

    extra = ["model.lora.r=4"] if lora else []
    cfg, policy, task = make(flux_dir, tmp_path, *extra)
    engine = PolicyEngine(policy, own_weights=True)

    def final(p):
        return p.generate(task.train[:2], 2, cfg.rollout, torch.Generator().manual_seed(0)).data["final_latents"]

    policy.step_costs()
    start = final(engine.policy)
    assert policy.step_costs()["cost/model_evaluations"] > 0  # the copy's rows, on the policy's counter
    assert torch.equal(start, final(policy))
    with torch.no_grad():
        for p in policy.model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    moved = final(policy)
    assert not torch.equal(moved, start) and torch.equal(final(engine.policy), start)
    engine.publish(trainable_weights(policy.model), 1)
    assert torch.equal(final(engine.policy), moved)
    cfg, policy, task = make(flux_dir, tmp_path, "train.max_steps=2", "rollout.scheduler.mode=pipelined",
                             "task.grid_prompts=0", *extra)
    assert Trainer(cfg, policy, task).train()["steps"] == 2


def test_rows_charged_by_an_engine_thread_and_the_trainer_are_all_counted(flux_dir, tmp_path):
    """A pipelined engine's copy charges its rows to the policy's counter from its own thread
    while the trainer charges its own: none may be lost (the counter takes a lock)."""
    import sys
    import threading

    _, policy, _ = make(flux_dir, tmp_path)
    copy = policy.rollout_copy()
    policy.step_costs()

    def engine():
        for _ in range(2000):
            with copy._off():
                copy.policy.flow.charge(3)

    def trainer():
        for _ in range(2000):
            policy.flow.charge(1)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=f) for f in (engine, trainer)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    finally:
        sys.setswitchinterval(interval)
    assert policy.step_costs()["cost/model_evaluations"] == 2000 * 3 + 2000


@pytest.mark.parametrize("family", ["flux", "flux2", "sd3", "qwen_image"])
def test_one_flow_grpo_step_per_family(family, tmp_path, reward_spread):
    """Each supported diffusers family (tiny random configs with latent VAEs): one SDE rollout
    and one Flow-GRPO update through the core loop change every trainable transformer weight
    (except those no loss can reach: a last block's discarded text outputs, see test_models)."""
    from test_models import NO_GRAD

    path = build_tiny(family, tmp_path / family, seed=0)
    cfg, policy, task = make(path, tmp_path, "train.max_steps=1", "task.num_eval=1", "task.grid_prompts=0")
    before = {k: v.clone() for k, v in policy.model.named_parameters() if v.requires_grad}
    assert cfg.rollout.shift == ("sd3" if family == "sd3" else "flux")  # rollout.shift auto: the family's own
    Trainer(cfg, policy, task).train()
    unchanged = sorted(k for k, v in policy.model.named_parameters() if v.requires_grad and torch.equal(v, before[k]))
    assert unchanged == sorted(k for k in before if k.startswith(NO_GRAD[family]))
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["rollout"]["shift"] == cfg.rollout.shift  # the run records the shift it sampled with
    if family == "sd3":  # SD3's sigma' = 3 sigma / (1 + 2 sigma), not FLUX's resolution-dependent shift
        torch.testing.assert_close(policy.sampler(4).sigmas, torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0]))
        explicit = make(path, tmp_path, "rollout.shift=none")
        assert explicit[0].rollout.shift == "none"


def test_prompt_files_are_checked_line_by_line(flux_dir, tmp_path):
    good = tmp_path / "train.txt"
    good.write_text("# my prompts\ntwo red circles left of a blue square\n\na green triangle\n")
    _, _, task = make(flux_dir, tmp_path, f"task.train_path={good}")
    assert task.train == ["two red circles left of a blue square", "a green triangle"]
    bad = tmp_path / "bad.txt"
    bad.write_text("a red circle\na purple circle next to a dog\n")
    with pytest.raises(ConfigError, match=r"line 2 .*unparsed words"):
        make(flux_dir, tmp_path, f"task.eval_path={bad}")


def test_atom_weights_set_the_reward_total_and_bad_ones_are_config_errors(flux_dir, tmp_path):
    from PIL import Image

    from diffusion_rl.tasks.shapes_geneval import render
    from mmrl.core.rewards import Sample

    _, _, task = make(flux_dir, tmp_path, "task.atom_weights.all=0", "task.atom_weights.count=2.5")
    assert [a.name for a in task.reward.atoms] == ["exist", "colour", "count", "relation", "all"]
    assert task.reward.weights.tolist() == [1.0, 1.0, 2.5, 1.0, 0.0]
    prompt = "two red circles left of a blue square"
    scores = task.reward.score([Sample(prompt, render(prompt)), Sample(prompt, Image.new("RGB", (64, 64), "white"))])
    assert scores.values[0].tolist() == [1.0] * 5  # a right image: every verdict, "all" included, is kept
    assert float(scores.total[0]) == 5.5 and float(scores.total[1]) == 0.0
    for bad, match in (("task.atom_weights.colours=1", r"task.atom_weights: unknown .* atoms \['colours'\]"),
                       ("task.atom_weights.all=nan", "task.atom_weights.all: Input should be a finite number")):
        with pytest.raises(ConfigError, match=match):
            make(flux_dir, tmp_path, bad)


# ---------------------------------------------------------------------- EMA (method.ema)

EMA = ["method.ema.decay=0.5", "method.ema.update_every=1"]  # warm-up on: d_1 = 2/11, d_2 = 1/4


def test_ema_weights_are_evaluated_and_saved_while_the_raw_weights_train(flux_dir, tmp_path, reward_spread):
    cfg, policy, task = make(flux_dir, tmp_path, "train.max_steps=2", *EMA)
    trainer = Trainer(cfg, policy, task)
    start = [p.detach().clone() for p in trainer.params]
    seen = []  # (what, the trainable weights it ran with)

    def spy(name, fn):
        def wrapped(*a, **kw):
            seen.append((name, [p.detach().clone() for p in trainer.params]))
            return fn(*a, **kw)
        return wrapped

    task.evaluate = spy("evaluate", task.evaluate)
    task.save_samples = spy("grid", task.save_samples)
    trainer.train()
    assert [name for name, _ in seen] == ["evaluate", "grid", "evaluate", "grid"]  # before, after
    assert all(torch.equal(a, b) for _, ws in seen[:2] for a, b in zip(ws, start))  # the average starts as theta_0
    assert all(torch.equal(a, b) for _, ws in seen[2:] for a, b in zip(ws, trainer.ema.average))
    assert trainer.ema.steps == 2
    moved = [not torch.equal(p, a) for p, a in zip(trainer.params, trainer.ema.average)]
    assert all(moved)  # the raw weights (restored after evaluation) are not the average
    # The checkpoint's model is the average: what `evaluate` / `sample --checkpoint` load.
    _, fresh, _ = make(flux_dir, tmp_path / "fresh")
    fresh.load_weights(tmp_path / "run" / "checkpoints" / "step-00000002" / "model")
    loaded = [p for p in fresh.model.parameters() if p.requires_grad]
    assert all(torch.equal(a, b) for a, b in zip(loaded, trainer.ema.average))


def test_resume_with_ema_reproduces_the_uninterrupted_run(flux_dir, tmp_path, reward_spread):
    def run(name, steps, *extra, resume=False):
        cfg, policy, task = make(flux_dir, tmp_path / name, f"train.max_steps={steps}", "train.save_every=1", *extra)
        trainer = Trainer(cfg, policy, task)
        return trainer, trainer.train(resume=resume)

    full, full_summary = run("full", 2, *EMA)
    run("split", 1, *EMA)
    resumed, summary = run("split", 2, *EMA, resume=True)
    assert resumed.ema.steps == full.ema.steps == 2
    for a, b in zip(full.params, resumed.params):  # the raw weights
        assert torch.equal(a, b)
    for a, b in zip(full.ema.average, resumed.ema.average):
        assert torch.equal(a, b)
    # evaluated with the average (json: a metric no held-out prompt has, as relation here, is NaN on both)
    assert json.dumps(summary["eval_after"]) == json.dumps(full_summary["eval_after"])
    run("plain", 1)  # a checkpoint without an average cannot resume with one
    with pytest.raises(TrainingError, match="without averaged weights"):
        run("plain", 2, *EMA, resume=True)


# ---------------------------------------------------------------------- prompts the grammar cannot decompose

UNPARSED = "three pink clouds over a hill"


@pytest.fixture(scope="module")
def clip_atom(tmp_path_factory):
    """task.image_atoms override with a tiny random open_clip model as a CLIP-score atom."""
    from diffusion_rl.rewards import build_tiny_open_clip

    out = tmp_path_factory.mktemp("clip")
    build_tiny_open_clip(out, seed=0)
    return f'task.image_atoms=[{{type: clip_score, model: "local-dir:{out}"}}]'


def test_an_unparsed_prompt_is_an_error_naming_the_words_by_default(flux_dir, tmp_path):
    bad = tmp_path / "p.txt"
    bad.write_text(f"a red circle\n{UNPARSED}\n")
    with pytest.raises(ConfigError, match=r"line 2 .*unparsed words 'pink clouds over a hill'.*task.unparsed=whole"):
        make(flux_dir, tmp_path, f"task.train_path={bad}")
    with pytest.raises(ConfigError, match="none is configured.*clip_score"):  # no whole-prompt reward
        make(flux_dir, tmp_path, f"task.train_path={bad}", "task.unparsed=whole_prompt")


def test_whole_prompt_scores_an_unparsed_prompt_by_the_image_atom(flux_dir, clip_atom, tmp_path):
    from PIL import Image

    from mmrl.core.rewards import Sample

    prompts = tmp_path / "p.txt"
    prompts.write_text(f"a red circle\n{UNPARSED}\n")
    with pytest.warns(UserWarning, match=r"1 of 2 prompts .*clip_score.*line 2: .*'pink clouds over a hill'"):
        cfg, policy, task = make(flux_dir, tmp_path, f"task.train_path={prompts}", f"task.eval_path={prompts}",
                                 clip_atom, "task.unparsed=whole_prompt", "train.max_steps=1")
    assert task.train == ["a red circle", UNPARSED]
    image = Image.new("RGB", (32, 32), "white")
    scores = task.reward.score([Sample(UNPARSED, image), Sample("a red circle", image)])
    unparsed, parsed = scores.per_sample()
    assert {k: unparsed[k] for k in ("exist", "colour", "count", "relation", "all")} == dict.fromkeys(
        ("exist", "colour", "count", "relation", "all"), 0.0)  # no verdict from the shapes atoms
    assert unparsed["clip_score"] != 0.0
    assert float(scores.total[0]) == pytest.approx(unparsed["clip_score"])  # the whole-prompt reward alone
    assert parsed["relation"] == 1.0 and parsed["exist"] == 0.0  # a parsed prompt: the shapes verdicts
    summary = Trainer(cfg, policy, task).train()  # both prompts roll out, score and train
    after = summary["eval_after"]
    assert after["unparsed_prompts"] == 1.0 and math.isfinite(after["whole_prompt_reward"])
    assert 0.0 <= after["atom_accuracy"] <= 1.0  # over "a red circle" only


# ---------------------------------------------------------------------- advantages and KL by hand


def flow_grpo_batch(rewards, group_ids, **data):
    from mmrl.core.batch import RolloutBatch
    from mmrl.core.rewards import AtomScores, Sample

    r = torch.tensor(rewards)
    return RolloutBatch(group_ids=torch.tensor(group_ids), samples=[Sample("p", None) for _ in rewards],
                        scores=AtomScores(names=["r"], values=r[:, None], total=r), data=data,
                        mask=torch.ones(len(rewards), 2, dtype=torch.bool))


def test_flow_grpo_advantages_are_clipped_to_adv_clip():
    """method.adv_clip bounds the group z-scores (the default 5 never binds on small groups)."""
    from diffusion_rl.config import FlowGRPOConfig
    from diffusion_rl.methods.flow_grpo import FlowGRPO

    # group 0 (0, 1): +-0.5 / (0.5 + 1e-4); group 1 (0, 0, 0, 1): mean 1/4, population std sqrt(3) / 4
    batch = flow_grpo_batch([0., 1, 0, 0, 0, 1], [0, 0, 1, 1, 1, 1])
    low = -0.25 / (3 ** 0.5 / 4 + 1e-4)
    adv = FlowGRPO(FlowGRPOConfig(adv_clip=0.5), None, None).advantages(batch)
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5, -0.5, -0.5, -0.5, 0.5]))
    unclipped = FlowGRPO(FlowGRPOConfig(), None, None).advantages(batch)
    torch.testing.assert_close(unclipped, torch.tensor([-0.5 / 0.5001, 0.5 / 0.5001, low, low, low, -3 * low]))


def test_flow_grpo_advantages_use_the_population_std_as_flow_grpos_stat_tracker():
    """A = (R - mean) / (np.std(R) + 1e-4) per group (ddof 0); method.adv_std=unbiased: ddof 1."""
    import numpy as np

    from diffusion_rl.config import FlowGRPOConfig
    from diffusion_rl.methods.flow_grpo import FlowGRPO

    r = np.array([0.1, 0.7, 0.3, 0.9, 0.2, 0.6, 0.4, 0.8, 1.0, 0.0, 0.5])
    groups = [0] * 8 + [1] * 3
    batch = flow_grpo_batch(r.tolist(), groups)
    for std, ddof in (("population", 0), ("unbiased", 1)):
        want = np.concatenate([(g - g.mean()) / (np.std(g, ddof=ddof) + 1e-4) for g in (r[:8], r[8:])])
        got = FlowGRPO(FlowGRPOConfig(adv_std=std), None, None).advantages(batch)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5)
    # global (Flow-GRPO's sample.global_std): each group centred, over np.std of the whole step's rewards
    want = np.concatenate([(g - g.mean()) / (np.std(r) + 1e-4) for g in (r[:8], r[8:])])
    got = FlowGRPO(FlowGRPOConfig(adv_std="global"), None, None).advantages(batch)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5)


def test_flow_grpo_kl_is_the_squared_mean_gap_over_two_sigma_squared():
    """add_kl: KL = mean_elements((mean - ref_mean)^2) / (2 std_t^2) per step, token-mean, loss += beta KL."""
    from diffusion_rl.config import FlowGRPOConfig
    from diffusion_rl.methods.flow_grpo import FlowGRPO
    from mmrl.core.config import KLConfig
    from mmrl.core.losses import LossOutput

    ref = torch.zeros(2, 2, 4)  # [N, T, latent]
    std = torch.full((2, 4), 0.5)  # sigma 0.5: 2 sigma^2 = 0.5
    steps = [SimpleNamespace(mean=torch.ones(2, 4), kl_std=std),  # gap^2 mean 1 -> KL 2, 2
             SimpleNamespace(mean=torch.tensor([[2., 0, 0, 0], [0, 0, 0, 0]]), kl_std=std)]  # 4/4 = 1 -> 2; 0 -> 0
    batch = flow_grpo_batch([0., 1], [0, 0], ref_mean=ref)
    method = FlowGRPO(FlowGRPOConfig(kl=KLConfig(beta=0.1)), None, None)
    out = method.add_kl(LossOutput(loss=torch.tensor(1.0)), steps, batch, None)
    assert out.metrics["loss/kl"] == pytest.approx((2 + 2 + 2 + 0) / 4)
    assert float(out.loss) == pytest.approx(1.0 + 0.1 * 1.5)


def test_the_kl_std_is_flow_grpos_std_t_without_the_steps_sqrt_dt():
    """Flow-GRPO's code divides the KL by 2 std_dev_t^2, std_dev_t = a sqrt(sigma / (1 - sigma)):
    the SDE's noise scale, not the transition's std_t sqrt(-Delta) (that is 1/|Delta| times the KL)."""
    from diffusion_rl.sde import sde_step_with_logprob

    x, v = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    sigma, nxt, a = torch.tensor([0.8, 0.5]), torch.tensor([0.7, 0.3]), 0.7
    step = sde_step_with_logprob(v, x, sigma, nxt, noise_level=a, generator=torch.Generator().manual_seed(0))
    std_t = a * (sigma / (1 - sigma)).sqrt()
    torch.testing.assert_close(step.kl_std.flatten(), std_t)
    torch.testing.assert_close(step.std.flatten(), std_t * (sigma - nxt).sqrt())  # the transition's
    cps = sde_step_with_logprob(v, x, sigma, nxt, noise_level=a, kind="cps", generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(cps.kl_std, cps.std)
    ode = sde_step_with_logprob(v, x, sigma, nxt, noise_level=0.0)
    assert (ode.kl_std == 0).all()


# ---------------------------------------------------------------------- the clipped objective by hand (no model)

E = math.exp(0.1)


def stub_flow_grpo(*, mask=((True, True), (True, False)), beta=0.0, **cfg):
    """Flow-GRPO on a hand-made batch with no model: two samples, two trained steps whose
    current log-probs lie 0.1 above the stored ones at step 0 and 0.1 below at step 1 (every
    ratio e^0.1, then e^-0.1); sample 1's step 1 is not trained. The KL stubs: std_t 1, the
    reference means 0 at step 0 and 1 at step 1; the current means 1 everywhere but sample
    1's untrained step 1 (3)."""
    from diffusion_rl.config import FlowGRPOConfig
    from diffusion_rl.methods.flow_grpo import FlowGRPO
    from mmrl.core.config import KLConfig

    method = FlowGRPO(FlowGRPOConfig(kl=KLConfig(beta=beta), **cfg), None, None)
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]])  # [N, T]
    means = [torch.ones(2, 3), torch.tensor([[1.0] * 3, [3.0] * 3])]
    steps = [SimpleNamespace(log_prob=logp[:, t].clone().requires_grad_(), mean=means[t].clone().requires_grad_(),
                             kl_std=torch.ones(2, 3)) for t in range(2)]
    ref = torch.zeros(2, 2, 3)
    ref[:, 1] = 1.0
    data = {"ref_mean": ref} if beta > 0 else {}
    batch = flow_grpo_batch([0.0, 1.0], [0, 0], **data)
    batch.mask = torch.tensor(mask)
    batch.old_logp = logp - torch.tensor([0.1, -0.1])
    return method, SimpleNamespace(sde_outputs=lambda b: steps), batch, steps


def test_flow_grpo_clipped_objective_off_policy_by_hand():
    """-min(rho A, clip(rho, 1 -+ 0.05) A) with A = (1, -1): sample 0 at step 0 (rho e^0.1 > 1.05)
    is clipped to 1.05, at step 1 (e^-0.1, A > 0) takes the ratio; sample 1 at step 0 takes the
    ratio (A < 0: the min is -e^0.1). Token mean over the 3 trained (sample, step) pairs."""
    method, policy, batch, _ = stub_flow_grpo(clip_range=0.05)
    out = method.loss(policy, batch, torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(out.per_token, torch.tensor([[-1.05, -1 / E], [E, 0.0]]))
    torch.testing.assert_close(out.loss, torch.tensor((-1.05 - 1 / E + E) / 3))
    assert method.loss_denominator(batch) == 3  # trained (sample, step) pairs, not samples
    half = method.loss(policy, batch, torch.tensor([1.0, -1.0]), denom=6)
    torch.testing.assert_close(half.loss, out.loss / 2)
    # clip range 0.2: no ratio here reaches it, every term is rho A
    wide = stub_flow_grpo(clip_range=0.2)
    torch.testing.assert_close(wide[0].loss(wide[1], wide[2], torch.tensor([1.0, -1.0])).per_token,
                               torch.tensor([[-E, -1 / E], [E, 0.0]]))


def test_flow_grpo_lower_clip_binds_for_a_negative_advantage():
    """A = -1 and rho = e^-0.1 < 0.95: -min(-rho, -0.95) = 0.95 (sample 1's step 1, trained here)."""
    method, policy, batch, _ = stub_flow_grpo(mask=((True, True), (True, True)), clip_range=0.05)
    out = method.loss(policy, batch, torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(out.per_token, torch.tensor([[-1.05, -1 / E], [E, 0.95]]))


def test_flow_grpo_kl_per_step_reference_and_untrained_steps_by_hand():
    """KL per (sample, step) = mean((mean - ref[:, t])^2) / 2: step 0 gaps 1 -> 0.5, 0.5; step 1
    (reference 1) sample 0's gap 0 -> 0; sample 1's gap 2 (KL 2) is an untrained step and left
    out: token mean 1/3. Its gradient reaches the means: beta (mean - ref) / (3 elements * 3 pairs)."""
    method, policy, batch, steps = stub_flow_grpo(beta=0.1, clip_range=0.2)
    out = method.loss(policy, batch, torch.tensor([0.0, 0.0]))  # A = 0: the loss is the KL term alone
    assert out.metrics["loss/kl"] == pytest.approx(1 / 3)
    torch.testing.assert_close(out.loss, torch.tensor(0.1 / 3))
    out.loss.backward()
    torch.testing.assert_close(steps[0].mean.grad, torch.full((2, 3), 0.1 / 9))
    torch.testing.assert_close(steps[1].mean.grad, torch.zeros(2, 3))


def test_flow_grpo_without_kl_needs_no_reference():
    """beta 0 (the default): no reference model, no ref_mean in the batch, no loss/kl."""
    method, policy, batch, _ = stub_flow_grpo(clip_range=0.2)
    assert method.needs_reference is False and "ref_mean" not in batch.data
    out = method.loss(policy, batch, torch.tensor([1.0, -1.0]))
    assert "loss/kl" not in out.metrics and torch.isfinite(out.loss)


def test_flow_grpo_std_eps_comes_from_the_config():
    """Rewards (0, 1): population std 0.5, A = -+0.5 / (0.5 + std_eps) = -+0.5 with std_eps 0.5."""
    from diffusion_rl.config import FlowGRPOConfig
    from diffusion_rl.methods.flow_grpo import FlowGRPO

    adv = FlowGRPO(FlowGRPOConfig(std_eps=0.5), None, None).advantages(flow_grpo_batch([0.0, 1.0], [0, 0]))
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5]))


def test_flow_grpo_refuses_a_noiseless_rollout():
    from diffusion_rl.config import FlowGRPOConfig
    from diffusion_rl.methods.flow_grpo import FlowGRPO

    run = SimpleNamespace(rollout=SimpleNamespace(noise_level=0.0))
    with pytest.raises(ConfigError, match="rollout.noise_level 0 the steps are deterministic"):
        FlowGRPO(FlowGRPOConfig(), run, None)
    FlowGRPO(FlowGRPOConfig(), SimpleNamespace(rollout=SimpleNamespace(noise_level=0.7)), None)


def test_weight_average_takes_decay_update_every_and_warmup_from_the_config():
    """decay 0.5, update_every 2: step 1 leaves the average at theta_0 = 0; step 2 (theta = 1)
    moves it with d_2 = min(0.5, 3 / 12) = 0.25 under the warm-up (avg 0.75), d = 0.5 without (0.5)."""
    from diffusion_rl.config import EMAConfig, FlowGRPOConfig
    from diffusion_rl.methods.flow_grpo import FlowGRPO

    assert FlowGRPO(FlowGRPOConfig(), None, None).weight_average([torch.zeros(1)]) is None  # method.ema off
    for warmup, want in ((True, 0.75), (False, 0.5)):
        cfg = FlowGRPOConfig(ema=EMAConfig(decay=0.5, update_every=2, warmup=warmup))
        ema = FlowGRPO(cfg, None, None).weight_average([torch.zeros(1)])
        assert ema.update([torch.ones(1)]) is False and ema.average[0].item() == 0.0
        assert ema.update([torch.ones(1)]) is True
        assert ema.average[0].item() == pytest.approx(want)


# ------------------------------------------------------------------ the policy on a flow by hand (no model)


class HandFlow:
    """DiffusionPolicy's view of a flow, by hand: latents of 2 tokens x 1 channel, prompt
    conditioning the prompt's row number, velocity 0 (or `bad`'s NaN) recorded with its inputs."""

    family, seq_len, has_lora = "flux", 2, False

    def __init__(self, guidance_scale=1.0, bad=None):
        self.transformer, self.guidance_scale, self.bad = torch.nn.Linear(1, 1), guidance_scale, bad
        self.calls, self.seeds, self.evaluations = [], [], 0

    def encode_prompt(self, texts):
        return {"prompt_embeds": torch.arange(float(len(texts)))[:, None]}

    def noise(self, n, generator):
        self.seeds.append(generator.initial_seed())
        return torch.randn(n, 2, 1, generator=generator)

    def velocity(self, x, sigma, cond):
        self.calls.append(SimpleNamespace(x=x.clone(), sigma=torch.as_tensor(sigma).clone(), cond=dict(cond),
                                          guidance_scale=self.guidance_scale))
        v = torch.zeros_like(x)
        return v if self.bad is None else self.bad(v, sigma)

    def decode(self, x):
        return [f"image {i}" for i in range(len(x))]


def hand_policy(flow=None, **rollout):
    from diffusion_rl.policy import DiffusionPolicy

    rollout = SimpleNamespace(**{"num_steps": 4, "window_size": 2, "window_start": (0, 0), "train_fraction": 1.0,
                                 "noise_level": 0.7, "kind": "sde", "shift": "none", "shared_noise": False,
                                 **rollout})
    return DiffusionPolicy(flow or HandFlow(), rollout), rollout


def test_the_sampler_takes_the_rollouts_shift_and_auto_the_familys():
    from diffusion_rl.sde import sd3_shift

    policy, _ = hand_policy()
    assert policy.sampler(4).sigmas.tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]  # shift none on a flux model
    policy.flow.family, policy.rollout.shift = "sd3", "auto"
    torch.testing.assert_close(policy.sampler(4).sigmas, sd3_shift(torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])))


@pytest.mark.parametrize("fraction, trained", [(0.7, 3), (0.1, 1)])
def test_train_fraction_trains_a_rounded_sorted_share_of_a_window_that_stays_stochastic(fraction, trained):
    """A 4-step window (steps 0..3 of 5): round(4 x 0.7) = 3 of its steps train, at least one
    however small the fraction, in step order; every window step is an SDE step all the same."""
    from diffusion_rl.sde import FlowSDESampler

    policy, rollout = hand_policy(num_steps=5, window_size=4, train_fraction=fraction)
    sde = []

    class Recording(FlowSDESampler):
        def step(self, *a, **kw):
            sde.append(kw["sde"])
            return super().step(*a, **kw)

    def sampler(n):
        s = Recording()
        s.set_timesteps(n, shift="none")
        return s

    policy.sampler = sampler
    batch = policy.generate(["a red circle"], 2, rollout, torch.Generator().manual_seed(0))
    assert sde == [True, True, True, True, False]
    sigma = batch.data["sigma"][0]
    assert batch.old_logp.shape == (2, trained) and len(sigma) == trained
    assert {round(s, 6) for s in sigma.tolist()} <= {1.0, 0.8, 0.6, 0.4} and (sigma[1:] < sigma[:-1]).all()
    torch.testing.assert_close(batch.data["sigma_next"][0], sigma - 0.2)


def test_a_full_train_fraction_draws_nothing_from_the_generator():
    from diffusion_rl.policy import _subset

    g = torch.Generator().manual_seed(0)
    assert _subset([2, 3], 1.0, g) == [2, 3]
    assert torch.equal(g.get_state(), torch.Generator().manual_seed(0).get_state())


class HandPrompt:
    def __init__(self, text, meta):
        self.text, self.meta = text, meta


def test_generate_groups_samples_by_prompt_and_copies_each_prompts_meta():
    policy, rollout = hand_policy()
    prompts = [HandPrompt("a red circle", {"k": 0}), HandPrompt("a blue square", {"k": 1})]
    batch = policy.generate(prompts, 3, rollout, torch.Generator().manual_seed(0))
    assert batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert [s.prompt for s in batch.samples] == ["a red circle"] * 3 + ["a blue square"] * 3
    assert [s.completion for s in batch.samples] == [f"image {i}" for i in range(6)]
    assert [s.meta for s in batch.samples] == [{"k": 0}] * 3 + [{"k": 1}] * 3
    batch.samples[0].meta["k"] = 5  # a sample's meta is its own
    assert prompts[0].meta == {"k": 0} and batch.samples[1].meta == {"k": 0}
    with pytest.raises(TypeError, match="a diffusion prompt must be text, got int"):
        policy.generate([3], 1, rollout, torch.Generator().manual_seed(0))


def test_non_finite_latents_of_the_last_ode_step_stop_the_rollout():
    """The last step is an ODE step (log-prob 0): its NaN latents alone stop the rollout."""
    from diffusion_rl.policy import NonFiniteRollout

    flow = HandFlow(bad=lambda v, sigma: v * float("nan") if float(sigma[0]) == 0.25 else v)
    policy, rollout = hand_policy(flow)
    with pytest.raises(NonFiniteRollout, match="sampling step 3 "):
        policy.generate(["a red circle"], 2, rollout, torch.Generator().manual_seed(0))


def test_flow_velocity_under_guidance_by_hand():
    """x_t = (1 - t) x1 + t noise; unguided under CFG: the conditional velocity alone (scale 1,
    no neg/ conditioning), the scale put back after; guided, or with a scale of 1: as given."""
    flow = HandFlow(guidance_scale=3.0)
    policy, _ = hand_policy(flow)
    x1, noise, t = torch.ones(1, 2, 1), torch.full((1, 2, 1), 5.0), torch.tensor([0.25])
    cond = {"prompt_embeds": torch.zeros(1, 1), "neg/prompt_embeds": torch.ones(1, 1)}
    policy.flow_velocity(x1, t, noise, cond)
    call = flow.calls[-1]
    assert torch.equal(call.x, torch.full((1, 2, 1), 2.0))  # 0.75 x 1 + 0.25 x 5
    assert call.guidance_scale == 1.0 and list(call.cond) == ["prompt_embeds"] and flow.guidance_scale == 3.0
    policy.flow_velocity(x1, t, noise, cond, guided=True)
    assert flow.calls[-1].guidance_scale == 3.0 and list(flow.calls[-1].cond) == list(cond)
    flow.guidance_scale = 1.0
    policy.flow_velocity(x1, t, noise, cond)
    assert flow.calls[-1].guidance_scale == 1.0 and list(flow.calls[-1].cond) == list(cond)


def test_sample_images_seeds_sigmas_and_partly_non_finite_latents():
    """Each image's noise from a CPU generator seeded with its seed; the velocity at sigmas
    1, 0.75, 0.5, 0.25 (shift none); an image with one non-finite element is named, at most three."""
    bad_rows = []

    def bad(v, sigma):
        v = v.clone()
        for r in bad_rows:
            v[r, 0, 0] = float("inf")
        return v

    flow = HandFlow(bad=bad)
    policy, _ = hand_policy(flow)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert policy.sample_images(["a", "b"], [7, 3], 4) == ["image 0", "image 1"]
    assert flow.seeds == [7, 3]
    assert [c.sigma.tolist() for c in flow.calls] == [[1.0] * 2, [0.75] * 2, [0.5] * 2, [0.25] * 2]
    bad_rows[:] = [1]
    with pytest.warns(UserWarning, match=r"1 of 2 sampled images have non-finite latents \('b' seed 3\);"):
        policy.sample_images(["a", "b"], [7, 3], 4)
    bad_rows[:] = [0, 1, 2]
    with pytest.warns(UserWarning, match=r"3 of 3 .*\('a' seed 0, 'b' seed 1, 'c' seed 2\);"):
        policy.sample_images(["a", "b", "c"], [0, 1, 2], 4)


def test_a_full_checkpoint_loads_from_its_own_directory_even_with_a_lora_folder(tmp_path):
    policy, _ = hand_policy()
    loaded = []
    policy.flow.load_transformer_weights = loaded.append
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "adapter_config.json").write_text("{}")
    policy.load_weights(tmp_path)
    policy.flow.has_lora = True
    policy.load_weights(tmp_path)
    assert loaded == [tmp_path, tmp_path / "lora"]


def test_attention_maps_under_cfg_keep_the_conditional_rows(flux_dir, tmp_path):
    from diffusion_rl.models import load_flow_model
    from diffusion_rl.policy import DiffusionPolicy

    cfg, _, task = make(flux_dir, tmp_path)
    guided = DiffusionPolicy(load_flow_model(flux_dir, guidance_scale=3.0), cfg.rollout)
    batch = guided.generate(task.train[:1], 2, cfg.rollout, torch.Generator().manual_seed(0))
    outs, maps = guided.sde_outputs(batch, attention=None)
    assert len(outs) == len(maps) == 2 and all(m.shape[:2] == (2, guided.flow.seq_len) for m in maps)


def test_model_distilled_guidance_reaches_a_guidance_distilled_transformer(flux_dir, tmp_path):
    """FLUX.1-dev's embedded guidance had no config key: every run used the pipeline's 3.5 (the
    export line that samples with it: test_models)."""
    _, policy, _ = make(flux_dir, tmp_path, "model.distilled_guidance=2.5")
    assert policy.flow._guidance(2).tolist() == [2.5, 2.5]


def test_model_distilled_guidance_for_a_transformer_without_it_is_warned(tmp_path):
    path = build_tiny("sd3", tmp_path / "sd3", seed=0)
    with pytest.warns(UserWarning, match=r"model.distilled_guidance 2.5 is unused: the transformer in .* has no "
                                         r"guidance embedding"):
        make(path, tmp_path, "model.distilled_guidance=2.5", "task.num_eval=1", "task.grid_prompts=0")


@pytest.mark.parametrize("method", ["flow_grpo", "cast"])
def test_a_kl_kind_the_method_does_not_read_is_said_to_be_unused(method):
    """Flow-GRPO's (and CAST's) KL is the Gaussian steps' closed form; method.kl.kind, which
    `config --keys method` shows with the core's k1/k2/k3 description, was ignored without a word."""
    with pytest.warns(UserWarning, match=rf"method.kl.kind k1 is unused by method {method}: its KL is the Gaussian"):
        load_config(DiffusionTrainConfig, None, [f"method.type={method}", "method.kl.beta=0.01", "method.kl.kind=k1"],
                    defaults=backend.DEFAULT_CONFIG)
    with warnings.catch_warnings():  # the default kind: nothing said
        warnings.simplefilter("error")
        load_config(DiffusionTrainConfig, None, [f"method.type={method}", "method.kl.beta=0.01"],
                    defaults=backend.DEFAULT_CONFIG)


def test_the_kl_description_gives_the_std_each_step_kind_divides_by():
    """The KL divides by 2 std^2 with std_t = a sqrt(sigma / (1 - sigma)) for sde steps, and the
    CPS step's own std sigma_next sin(a pi / 2) for cps ones; the description gave the first alone."""
    from diffusion_rl.config import FlowGRPOConfig
    from diffusion_rl.sde import sde_step_with_logprob

    x, v = torch.zeros(1, 2, 2), torch.ones(1, 2, 2)
    sde = sde_step_with_logprob(v, x, 0.5, 0.4, noise_level=0.5, kind="sde", generator=torch.Generator())
    cps = sde_step_with_logprob(v, x, 0.5, 0.4, noise_level=0.5, kind="cps", generator=torch.Generator())
    assert float(sde.kl_std) == pytest.approx(0.5)  # 0.5 sqrt(0.5 / 0.5)
    assert float(cps.kl_std) == pytest.approx(0.4 * math.sin(0.25 * math.pi))  # 0.2828
    said = " ".join(FlowGRPOConfig.model_fields["kl"].description.split())
    assert "rollout.kind cps: the CPS step's std, sigma_next sin(a pi / 2)" in said


def test_a_noise_level_that_overflows_the_step_is_named_in_the_non_finite_rollout_error():
    """At rollout.noise_level 1e-30 the step's log-prob is NaN from a finite velocity: the error
    said only 'non-finite latents or log-probs', as for a diverged model, naming no setting."""
    from diffusion_rl.policy import NonFiniteRollout

    policy, rollout = hand_policy(noise_level=1e-30)
    with pytest.raises(NonFiniteRollout, match=r"from a finite velocity: the step's noise at rollout.noise_level "
                                               r"1e-30 \(sde\) over- or underflows"):
        policy.generate(["a red circle"], 2, rollout, torch.Generator().manual_seed(0))


def test_global_std_needs_the_whole_round_so_the_inline_scheduler():
    """method.adv_std=global divides by the std of the step's rewards: an engine beside the
    trainer completes groups one at a time, each of which would be normalised alone. Refused
    there, as the core's advantage.scale=batch is; the inline scheduler takes it."""
    from diffusion_rl import backend
    from mmrl.core.config import ConfigError, load_config
    from mmrl.core.pipeline import check_config

    def cfg(*sets):
        return load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG,
                           overrides=["method.adv_std=global", *sets])

    with pytest.raises(ConfigError, match=r"method\.adv_std=global needs the whole round at once.*'thread'"):
        check_config(cfg("rollout.scheduler.mode=sync", "rollout.scheduler.placement=thread"), 1)
    check_config(cfg(), 1)
