"""The VLM policy and backend on tiny real Qwen2-VL / Qwen2.5-VL / Qwen3-VL models
built from configs (mmrl.vlm.tiny) and loaded through from_pretrained."""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from PIL import Image

from mmrl.core.batch import RolloutBatch
from mmrl.core.config import ConfigError, load_config
from mmrl.core.trainer import Trainer
from mmrl.vlm import backend
from mmrl.vlm.config import VLMModelConfig, VLMTrainConfig
from mmrl.vlm.models import load_vlm, vision_tower
from mmrl.vlm.policy import PromptTooLong, VLMPolicy, to_sample
from mmrl.vlm.task import VLMTask
from mmrl.vlm.tasks.shapes_qa import QAItem, ShapesQA, shapes_qa_reward

ITEMS = ShapesQA(seed=0, num_train=8, num_eval=4).train_items()


def make_policy(path, temperature=1.0) -> VLMPolicy:
    mcfg = VLMModelConfig(path=str(path))
    model, processor = load_vlm(mcfg)
    return VLMPolicy(model, processor, temperature=temperature,
                     min_pixels=mcfg.min_pixels, max_pixels=mcfg.max_pixels)


def rollout_cfg(**kw):
    return VLMTrainConfig().rollout.model_copy(update={"max_new_tokens": 8, **kw})


def test_one_rollout_and_one_update_per_family(model_dir, tmp_path):
    """Each Qwen family: G samples per prompt, rollout log-probs equal the training
    forward's, and one GRPO step through the shared loop changes the weights."""
    policy = make_policy(model_dir)
    batch = policy.generate(ITEMS[:2], 3, rollout_cfg(), torch.Generator().manual_seed(0))
    assert len(batch) == 6 and batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert batch.mask.any(-1).all()
    # The old log-probs come from the generation logits; the training forward must agree.
    with torch.no_grad():
        logp = policy.logprobs(batch)
    torch.testing.assert_close(logp[batch.mask], batch.old_logp[batch.mask], atol=2e-4, rtol=1e-4)
    assert all(isinstance(s.completion, str) for s in batch.samples)

    cfg = load_config(VLMTrainConfig, overrides=[
        f"model.path={model_dir}", f"output_dir={tmp_path}", "train.max_steps=1",
        "rollout.num_generations=2", "rollout.prompts_per_step=2", "rollout.max_new_tokens=6",
        "optim.lr=1e-3", "logging.tensorboard=false", "logging.progress=false",
    ])
    task = VLMTask("shapes-qa", ITEMS, ITEMS[:2], shapes_qa_reward(), max_new_tokens=6)
    trainer = Trainer(cfg, policy, task)
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    # Random init scores 0 everywhere: give the group a reward spread so the update is non-zero.
    policy_generate = policy.generate

    def spread(*a, **kw):
        b = policy_generate(*a, **kw)
        for i, s in enumerate(b.samples):
            s.completion = f"x <answer>{s.meta['answer']}</answer>" if i % 2 else s.completion
        return b

    policy.generate = spread
    summary = trainer.train()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert torch.isfinite(torch.tensor(row["loss/total"]))
    changed = [k for k, v in policy.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "no weight changed"
    assert set(summary["eval_after"]) == {"accuracy", "format", "reward"}


def test_a_group_encodes_its_images_once_with_the_same_logprobs_and_gradients(model_dir, monkeypatch):
    """Each Qwen family: G samples of a prompt share its image, so the vision tower sees each
    distinct image once, in the rollout and in the training forward; log-probs and gradients
    equal those of encoding every row."""
    policy = make_policy(model_dir)
    # the model's own forward, not the policy's check of it: a policy that stopped sharing
    # where the model allows it still fails here
    if "mm_encoder_outputs" not in inspect.signature(type(policy.model).forward).parameters:
        pytest.skip(f"transformers {transformers.__version__}'s Qwen-VL forward takes no mm_encoder_outputs "
                    "(newer releases do): every row's images are encoded, as the fallback should")
    seen = []
    hook = vision_tower(policy.model).register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    batch = policy.generate(ITEMS[:3], 4, rollout_cfg(), torch.Generator().manual_seed(0))

    def forward_backward():
        policy.model.zero_grad()
        logp = policy.logprobs(batch)
        logp.sum().backward()
        return logp.detach(), {k: p.grad.clone() for k, p in policy.model.named_parameters() if p.grad is not None}

    shared, shared_grads = forward_backward()
    monkeypatch.setattr(VLMPolicy, "_takes_encoded_images", property(lambda self: False))
    each, each_grads = forward_backward()
    hook.remove()
    patches = int(batch.data["image_grid_thw"][0].prod(-1).sum())
    assert seen == [3 * patches, 3 * patches, 12 * patches]  # rollout, shared forward: 3 images; per row: 12
    torch.testing.assert_close(shared, each, atol=1e-5, rtol=1e-5)
    assert shared_grads.keys() == each_grads.keys() and any("visual" in k for k in shared_grads)
    for k, g in shared_grads.items():
        torch.testing.assert_close(g, each_grads[k], atol=1e-5, rtol=1e-4, msg=k)


def test_mixed_batch_multi_image_and_text_only(qwen25_dir):
    policy = make_policy(qwen25_dir)
    two = QAItem(images=ITEMS[0].images + ITEMS[1].images, question="How many circles are there?",
                 answer="1", reference="", meta={"answer": "1"})
    text = QAItem(images=[], question="What colour is the square?", answer="red", reference="", meta={"answer": "red"})
    batch = policy.generate([two, text, ITEMS[2]], 2, rollout_cfg(), torch.Generator().manual_seed(1))
    grid = batch.data["image_grid_thw"]
    assert grid.shape[:2] == (6, 2)
    assert (grid.prod(-1) > 0).sum(-1).tolist() == [2, 2, 0, 0, 1, 1]  # images per sample
    with torch.no_grad():
        logp = policy.logprobs(batch)
    torch.testing.assert_close(logp[batch.mask], batch.old_logp[batch.mask], atol=2e-4, rtol=1e-4)


def test_a_rollout_encodes_each_prompt_once_as_if_repeated(qwen25_dir):
    """generate's inputs for G samples per prompt are encode() of the repeated prompts,
    multi-image and text-only prompts included."""
    policy = make_policy(qwen25_dir)
    two = QAItem(images=ITEMS[0].images + ITEMS[1].images, question="How many circles are there?",
                 answer="1", reference="", meta={"answer": "1"})
    text = QAItem(images=[], question="What colour is the square?", answer="red", reference="", meta={"answer": "red"})
    prompts = [two, text, ITEMS[2]]
    once = policy._encode_repeated(prompts, 3)
    each = policy.encode([p for p in prompts for _ in range(3)])
    assert set(once) == set(each) and {"pixel_values", "image_grid_thw"} <= set(once)
    for k in each:
        assert torch.equal(once[k], each[k]), k


def test_concat_of_rounds_with_different_prompt_lengths_scores_the_same(qwen25_dir):
    """DAPO refills concatenate rounds whose prompts pad to different lengths: the padding
    then sits inside the prompt, masked; every row's log-probs must not change."""
    policy = make_policy(qwen25_dir)
    g = torch.Generator().manual_seed(2)
    short = QAItem(images=ITEMS[0].images, question="Hi?", answer="1", reference="", meta={"answer": "1"})
    a = policy.generate([short], 2, rollout_cfg(), g)
    b = policy.generate([ITEMS[3]], 2, rollout_cfg(max_new_tokens=5), g)
    both = RolloutBatch.concat([a, b])
    with torch.no_grad():
        la, lb, lboth = policy.logprobs(a), policy.logprobs(b), policy.logprobs(both)
    assert a.data["prompt_ids"].shape[1] < b.data["prompt_ids"].shape[1]
    torch.testing.assert_close(lboth[:2, : la.shape[1]], la, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(lboth[2:, : lb.shape[1]], lb, atol=2e-4, rtol=1e-4)


def test_text_only_rounds_and_slices_of_a_mixed_dataset_score_the_same(qwen25_dir):
    """A JSONL dataset may mix text-only and image questions: a text-only round concatenates
    with an image round (a DAPO refill), and the text-only rows of a mixed batch score alone
    (a micro-batch, or a pipelined group) with the log-probs they have in the whole batch."""
    policy = make_policy(qwen25_dir)
    g = torch.Generator().manual_seed(4)
    text = QAItem(images=[], question="What colour is the square?", answer="red", reference="", meta={"answer": "red"})
    words = policy.generate([text], 2, rollout_cfg(), g)
    assert not words.data["image_grid_thw"].numel()  # width 0: all padding
    image = policy.generate([ITEMS[0]], 2, rollout_cfg(), g)
    both = RolloutBatch.concat([image, words])
    with torch.no_grad():
        lw, li, lboth = policy.logprobs(words), policy.logprobs(image), policy.logprobs(both)
        alone = policy.logprobs(both.select(torch.tensor([2, 3])))
    torch.testing.assert_close(lw[words.mask], words.old_logp[words.mask], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(lboth[:2, : li.shape[1]], li, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(lboth[2:, : lw.shape[1]], lw, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(alone, lboth[2:], atol=2e-4, rtol=1e-4)


def test_completion_mask_and_vision_tokens_never_generated(qwen25_dir):
    policy = make_policy(qwen25_dir)
    eos, pad, x = policy.eos_id, policy.pad_id, 5
    completion = torch.tensor([
        [x, x, eos, pad, pad],   # stops at eos: eos included
        [x, x, x, x, x],         # truncated: all five
        [x, pad, pad, pad, pad],  # stopped by a stop string, then padded
        [x, eos, x, eos, x],     # after the first eos nothing counts
    ])
    assert policy.completion_mask(completion).int().tolist() == [
        [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    policy.pad_id = eos  # a tokenizer whose pad is end-of-turn (or has none): end-of-turn is kept
    ended = torch.tensor([[x, x, eos, eos, eos], [x, x, x, x, x]])
    assert policy.completion_mask(ended).int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    policy.pad_id = pad
    # truncated: the budget spent without end-of-turn; a stop string's early end is not
    from mmrl.vlm.policy import budget_spent

    mask = policy.completion_mask(completion)
    assert budget_spent(completion == eos, mask, mask.sum(-1), 5).tolist() == [0.0, 1.0, 0.0, 0.0]
    batch = policy.generate(ITEMS[:4], 4, rollout_cfg(max_new_tokens=12), torch.Generator().manual_seed(3))
    generated = batch.data["completion_ids"][batch.mask]
    assert not any(int(t) in policy.banned_ids for t in generated)
    assert len(policy.banned_ids) == 5


def test_teacher_batch_scores_given_completions(qwen25_dir):
    policy = make_policy(qwen25_dir)
    batch = policy.teacher_batch(ITEMS[:2], [ITEMS[0].reference, ITEMS[1].reference])
    ids = batch.data["completion_ids"]
    assert (ids[batch.mask][-1] == policy.eos_id) and batch.mask.sum(-1).min() > 3
    text = policy.tokenizer.decode(ids[0][batch.mask[0]].tolist(), skip_special_tokens=True)
    assert text == ITEMS[0].reference
    logp = policy.logprobs(batch)
    assert torch.isfinite(logp).all() and (logp[batch.mask] < 0).all()


def test_prompt_longer_than_context_is_named(qwen25_dir):
    policy = make_policy(qwen25_dir)
    policy.max_context = 60
    long = QAItem(images=[], question="How many circles are there? " * 20, answer="1", reference="", meta={})
    for g in (1, 8):  # the prompt's index, not its row's among the group's repeats (which read 8)
        with pytest.raises(PromptTooLong, match=r"prompt 1 of this batch .*How many circles.* exceeds the model's "
                                                r"context of 60"):
            policy.generate([ITEMS[0], long], g, rollout_cfg(), torch.Generator())


def test_odd_image_modes_are_accepted(qwen25_dir):
    policy = make_policy(qwen25_dir)
    rgba = Image.new("RGBA", (64, 64), (255, 0, 0, 128))
    grey16 = Image.new("I;16", (80, 60), 40000)
    items = [QAItem(images=[im], question="What colour is the square?", answer="red", reference="", meta={})
             for im in (rgba, grey16, Image.new("L", (50, 50), 200))]
    batch = policy.generate(items, 1, rollout_cfg(max_new_tokens=3), torch.Generator())
    assert len(batch) == 3 and torch.isfinite(batch.old_logp).all()


def test_missing_model_dir_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="model.path.*not a directory"):
        load_vlm(VLMModelConfig(path=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        load_vlm(VLMModelConfig(path=str(tmp_path / "empty")))


def test_lora_trains_only_adapters_and_resumes(qwen25_dir, tmp_path):
    overrides = [f"model.path={qwen25_dir}", f"output_dir={tmp_path}", "model.lora.r=4",
                 "rollout.num_generations=2", "rollout.prompts_per_step=2", "rollout.max_new_tokens=4",
                 "task.num_train=8", "task.num_eval=2", "logging.tensorboard=false", "logging.progress=false"]
    cfg = load_config(VLMTrainConfig, overrides=[*overrides, "train.max_steps=1"])
    policy, task = backend.build(cfg)
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    Trainer(cfg, policy, task).train()
    saved = next((tmp_path / "checkpoints").glob("step-*")) / "model"
    assert (saved / "adapter_model.safetensors").is_file()
    resumed_cfg = load_config(VLMTrainConfig, overrides=[*overrides, "train.max_steps=2"])
    policy2, task2 = backend.build(resumed_cfg)
    Trainer(resumed_cfg, policy2, task2).train(resume=True)
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2
    full, _ = backend.build(load_config(VLMTrainConfig, overrides=[o for o in overrides if "lora" not in o]))
    with pytest.raises(ConfigError, match="holds a LoRA adapter, not full weights"):
        full.load_weights(saved)


def test_freeze_vision_leaves_only_the_language_side_to_the_optimizer(qwen25_dir, tmp_path):
    cfg = load_config(VLMTrainConfig, overrides=[
        f"model.path={qwen25_dir}", f"output_dir={tmp_path}", "model.freeze_vision=true",
        "task.num_train=4", "task.num_eval=2", "logging.tensorboard=false", "logging.progress=false"])
    policy, task = backend.build(cfg)
    names = {n for n, _ in policy.model.named_parameters()}
    vision = {n for n in names if ".visual." in f".{n}"}
    trainable = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert vision and trainable == names - vision
    assert len(Trainer(cfg, policy, task).params) == len(trainable)
    with pytest.raises(ConfigError, match="no module named `visual`"):
        vision_tower(torch.nn.Linear(2, 2))


def test_lora_on_the_frozen_vision_encoder_alone_names_both_settings(qwen25_dir):
    """Was the trainer's "no trainable parameters", which named neither setting."""
    mcfg = load_config(VLMTrainConfig, overrides=[
        f"model.path={qwen25_dir}", "model.freeze_vision=true", "model.lora.target_modules=[qkv]"]).model
    with pytest.raises(ConfigError, match=r"target_modules \['qkv'\] name layers of the vision encoder alone.*"
                                          "freeze_vision"):
        load_vlm(mcfg)


def test_jsonl_task_through_the_backend(tmp_path, qwen25_dir):
    from mmrl.vlm.tasks.jsonl import save_jsonl

    save_jsonl(ITEMS[:4], tmp_path / "train.jsonl", tmp_path / "img")
    save_jsonl(ITEMS[4:6], tmp_path / "eval.jsonl", tmp_path / "img")
    (tmp_path / "run.yaml").write_text(
        f"model: {{path: {qwen25_dir}}}\ntask: {{type: jsonl, train_path: train.jsonl, eval_path: eval.jsonl}}\n")
    cfg = load_config(VLMTrainConfig, tmp_path / "run.yaml")
    _policy, task = backend.build(cfg)
    assert len(task.train) == 4 and len(task.eval_items) == 2
    assert task.train[0].question == ITEMS[0].question
    (tmp_path / "bad.yaml").write_text(
        f"model: {{path: {qwen25_dir}}}\ntask: {{type: jsonl, train_path: nope.jsonl, eval_path: eval.jsonl}}\n")
    with pytest.raises(ConfigError, match="nope.jsonl"):
        backend.build(load_config(VLMTrainConfig, tmp_path / "bad.yaml"))


def test_dataset_images_the_models_resizing_cannot_take_fail_at_build(tmp_path, qwen25_dir):
    """A 1700 x 100 banner (past max_pixels / 28^2 = 16:1 at 112 x 112 its short side resizes to 0)
    stopped the run with a traceback at its first rollout, skip or not; now: at build, or skipped."""
    import dataclasses

    from mmrl.vlm.tasks.jsonl import save_jsonl

    banner = dataclasses.replace(ITEMS[0], images=[Image.new("RGB", (1700, 100), "white")])
    save_jsonl([banner, *ITEMS[1:4]], tmp_path / "train.jsonl", tmp_path / "img")
    save_jsonl(ITEMS[4:6], tmp_path / "eval.jsonl", tmp_path / "img")
    (tmp_path / "run.yaml").write_text(
        f"model: {{path: {qwen25_dir}}}\ntask: {{type: jsonl, train_path: train.jsonl, eval_path: eval.jsonl}}\n")
    with pytest.raises(ConfigError, match=r"train.jsonl, line 1: a 1700 x 100 image.*task.on_bad_image=skip"):
        backend.build(load_config(VLMTrainConfig, tmp_path / "run.yaml"))
    with pytest.warns(UserWarning, match="left out the samples with images the model's resizing cannot take"):
        _policy, task = backend.build(load_config(VLMTrainConfig, tmp_path / "run.yaml",
                                                  overrides=["task.on_bad_image=skip"]))
    assert len(task.train) == 3 and len(task.eval_items) == 2


def test_vlm_resume_reproduces_the_uninterrupted_run(qwen25_dir, tmp_path):
    """2 steps, then --resume to 3, equals 3 steps straight (weights bit-identical)."""
    def run(name, steps, resume=False):
        cfg = load_config(VLMTrainConfig, overrides=[
            f"model.path={qwen25_dir}", f"output_dir={tmp_path / name}", f"train.max_steps={steps}",
            "rollout.num_generations=2", "rollout.prompts_per_step=2", "rollout.max_new_tokens=5",
            "task.num_train=8", "task.num_eval=2", "optim.lr=1e-3",
            "logging.tensorboard=false", "logging.progress=false"])
        policy, task = backend.build(cfg)
        Trainer(cfg, policy, task).train(resume=resume)
        return policy.model.state_dict()

    full = run("full", 3)
    run("split", 2)
    resumed = run("split", 3, resume=True)
    for k, v in full.items():
        assert torch.equal(v, resumed[k]), k


def test_unreadable_image_names_the_prompt(qwen25_dir, tmp_path):
    """A prompt whose image is a broken file object stops with the prompt's index and question."""
    policy = make_policy(qwen25_dir)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    item = QAItem(images=[str(broken)], question="What colour is the circle?", answer="red", reference="", meta={})
    with pytest.raises(ValueError, match=r"prompt 1 .*What colour is the circle.*could not be read"):
        policy.generate([ITEMS[0], item], 1, rollout_cfg(), torch.Generator())


def test_reward_atom_that_returns_nan_stops_the_run_with_its_name(qwen25_dir, tmp_path):
    from mmrl.core.rewards import Reward, RewardError, reward_atom

    @reward_atom("broken")
    def broken(sample):
        return float("nan")

    cfg = load_config(VLMTrainConfig, overrides=[
        f"model.path={qwen25_dir}", f"output_dir={tmp_path}", "train.max_steps=1",
        "rollout.num_generations=2", "rollout.prompts_per_step=1", "rollout.max_new_tokens=3",
        "logging.tensorboard=false", "logging.progress=false"])
    policy = make_policy(qwen25_dir)
    task = VLMTask("shapes-qa", ITEMS, ITEMS[:1], Reward([broken]), max_new_tokens=3)
    with pytest.raises(RewardError, match="broken.*sample 0.*nan"):
        Trainer(cfg, policy, task).train()
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())


def test_generate_continues_fixed_prefixes_without_training_them(qwen25_dir):
    """AXPO's resampling: a sample may start from a fixed prefix (text or ids). The prefix is
    in the completion, its text and the attention, not in the loss; the rollout's log-probs
    of the new tokens still equal the training forward's, also next to plain samples."""
    policy = make_policy(qwen25_dir)
    head = policy.tokenizer("I see two", add_special_tokens=False)["input_ids"]
    prefixes = ["I see two", None, head[:1], None]
    batch = policy.generate(ITEMS[:2], 2, rollout_cfg(), torch.Generator().manual_seed(0), prefixes=prefixes)
    ids, mask, seen = batch.data["completion_ids"], batch.mask, batch.data["completion_attention"]
    assert ids[0, : len(head)].tolist() == head and ids[2, 0].item() == head[0]
    assert not mask[0, : len(head)].any() and seen[0, : len(head)].all() and mask[0, len(head)].item()
    assert not mask[2, 0].item() and mask[1, 0].item()
    assert batch.samples[0].completion.startswith("I see two")
    plain = policy.generate(ITEMS[2:3], 2, rollout_cfg(), torch.Generator().manual_seed(1))
    both = RolloutBatch.concat([batch, plain])
    with torch.no_grad():
        logp = policy.logprobs(both)
    torch.testing.assert_close(logp[both.mask], both.old_logp[both.mask], atol=2e-4, rtol=1e-4)
    assert (both.old_logp[~both.mask] == 0).all()


def test_pipelined_training_with_extra_samples_from_a_prefix(qwen25_dir, tmp_path, monkeypatch):
    """The VLM backend under the pipelined scheduler (a background engine with its own
    weights): a method asks extra samples continuing a group's first completion."""
    import mmrl.core.method as method_mod
    from mmrl.core.engine import Request
    from mmrl.core.grpo import GRPO

    class Extra(GRPO):
        def extra_requests(self, group):
            start = policy.tokenizer(group.samples[0].completion, add_special_tokens=False)["input_ids"][:2]
            return [Request(int(group.group_ids[0]), prompts[group.samples[0].prompt], 2, prefix=start, tag=1)]

    monkeypatch.setitem(method_mod.METHODS, "grpo", Extra)
    cfg = load_config(VLMTrainConfig, overrides=[
        f"model.path={qwen25_dir}", f"output_dir={tmp_path}", "train.max_steps=2", "train.mini_batches=2",
        "rollout.num_generations=2", "rollout.prompts_per_step=2", "rollout.max_new_tokens=6",
        "rollout.scheduler.mode=pipelined", "logging.tensorboard=false", "logging.progress=false",
        "train.log_samples_every=1"])
    policy = make_policy(qwen25_dir)
    prompts = {it.question: it for it in ITEMS}
    task = VLMTask("shapes-qa", ITEMS, ITEMS[:2], shapes_qa_reward(), max_new_tokens=6)
    Trainer(cfg, policy, task).train()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/staleness"] for r in rows] == [0, 0]
    assert [r["rollout/samples"] for r in rows] == [8, 8] and [r["train/updates"] for r in rows] == [2, 2]
    assert all(r["rollout/samples_extra"] == 4 for r in rows)


def test_lora_adapters_are_what_a_served_engine_receives(qwen25_dir, tmp_path):
    """Under LoRA, publishing to an `mmrl serve` engine pushes the adapters only, and the
    server then samples exactly as the trainer's policy does."""
    from mmrl.core.engine import PolicyEngine, Request, trainable_weights
    from mmrl.core.remote import RemoteEngine
    from mmrl.core.serve import ServedPolicyEngine, serve_in_thread

    cfg = load_config(VLMTrainConfig, overrides=[f"model.path={qwen25_dir}", "model.lora.r=4",
                                                 "rollout.max_new_tokens=6"])
    trainer_policy, _ = backend.build(cfg)
    server_policy, _ = backend.build(cfg)
    with torch.no_grad():  # the trainer's adapters move away from the server's
        for p in trainable_weights(trainer_policy.model).values():
            p.add_(0.05 * torch.randn_like(p))
    server = serve_in_thread(ServedPolicyEngine(server_policy), type(cfg.rollout))
    try:
        remote = RemoteEngine(server.url, timeout=60)
        weights = trainable_weights(trainer_policy.model)
        assert weights and all("lora_" in n for n in weights)
        remote.publish(weights, version=3)
        requests = [Request(0, ITEMS[0], 2), Request(1, ITEMS[1], 2)]
        got = remote.generate(requests, cfg.rollout, seed=5)
    finally:
        server.close()
    want = PolicyEngine(trainer_policy, own_weights=False).generate(requests, cfg.rollout, seed=5)
    assert got.policy_version == 3
    served = dict(server_policy.model.named_parameters())
    assert all(torch.equal(served[n], w) for n, w in weights.items())
    assert torch.equal(got.data["completion_ids"], want.data["completion_ids"])
    torch.testing.assert_close(got.old_logp, want.old_logp)


def test_lora_kl_reference_is_the_policy_with_adapters_off(qwen25_dir):
    """Under LoRA the KL reference keeps no second copy of the base model: it is the policy's
    own model with the adapters disabled (the starting weights, adapters starting at zero),
    while a rollout copy holds the current weights, adapters included."""
    from mmrl.core.lora import LoRAConfig, add_lora

    policy = make_policy(qwen25_dir)
    policy.model = add_lora(policy.model, LoRAConfig(r=4), seed=0)
    batch = policy.generate(ITEMS[:2], 2, rollout_cfg(), torch.Generator().manual_seed(0))
    ref = policy.reference()
    assert ref.model is policy.model
    with torch.no_grad():
        start = policy.logprobs(batch)
        torch.testing.assert_close(ref.logprobs(batch), start)
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn_like(p))
        copy_now = policy.rollout_copy()
        assert copy_now.model is not policy.model
        moved = policy.logprobs(batch)
        assert not torch.allclose(moved[batch.mask], start[batch.mask])
        torch.testing.assert_close(ref.logprobs(batch), start)  # still the starting weights
        torch.testing.assert_close(copy_now.logprobs(batch), moved)  # the adapters came along


@pytest.mark.skipif(tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 7),
                    reason="torch 2.6's attention with and without a padding mask differs by ~4e-7 "
                           "(rollout.old_logprobs documents it): exact equality holds from a newer torch")
def test_old_logprobs_from_a_forward_pass_instead_of_generates_logits(qwen25_dir, tmp_path):
    """rollout.old_logprobs=forward: the same samples (the draws do not depend on it); the
    old log-probs and entropies come from the teacher-forced pass, a few rows at a time, and
    equal the training forward's exactly (on-policy ratio 1); generate's agree to rounding."""
    policy = make_policy(qwen25_dir)
    base = policy.generate(ITEMS[:2], 3, rollout_cfg(), torch.Generator().manual_seed(0))
    scored = policy.generate(ITEMS[:2], 3, rollout_cfg(old_logprobs="forward", score_batch_size=4),
                             torch.Generator().manual_seed(0))
    assert torch.equal(scored.data["completion_ids"], base.data["completion_ids"])
    with torch.no_grad():
        assert torch.equal(scored.old_logp, policy.logprobs(scored))
    torch.testing.assert_close(scored.old_logp, base.old_logp, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(scored.data["stat/entropy"], base.data["stat/entropy"], atol=2e-4, rtol=1e-4)
    assert (scored.old_logp[~scored.mask] == 0).all()


def test_tool_rollouts_scored_by_forward_over_their_whole_transcripts(tmp_path):
    """rollout.old_logprobs=forward with tools (configs/vlm/axpo.yaml): the same transcripts,
    the model's tokens scored teacher-forced once each rollout is complete (observations off
    the mask), equal to the training forward's and to generate's up to rounding."""
    root = Path(__file__).resolve().parents[2]
    batches = {}
    for how in ("generate", "forward"):
        cfg = load_config(backend.CONFIG_CLASS, root / "configs" / "vlm" / "axpo.yaml", [
            f"output_dir={tmp_path}", "rollout.max_new_tokens=80", f"rollout.old_logprobs={how}",
            "rollout.score_batch_size=3", "rollout.tools.max_turns=2"], defaults=backend.DEFAULT_CONFIG)
        policy, task = backend.build(cfg)
        # every rollout opens with a call (AXPO's force_call prefix): whether the model calls
        # on its own depends on the draws, which differ between torch versions
        call = [[policy.agent.open_id]] * 4
        batches[how] = policy.generate(task.train_prompts()[:2], 2, cfg.rollout, torch.Generator().manual_seed(0),
                                       prefixes=call)
    base, scored = batches["generate"], batches["forward"]
    assert torch.equal(scored.data["completion_ids"], base.data["completion_ids"])
    assert (base.data["stat/tool_calls"] > 0).all()  # the rollouts did call the tool
    with torch.no_grad():
        assert torch.equal(scored.old_logp, policy.logprobs(scored))
    torch.testing.assert_close(scored.old_logp, base.old_logp, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(scored.data["stat/entropy"], base.data["stat/entropy"], atol=2e-4, rtol=1e-4)


def test_a_run_scoring_its_rollouts_by_forward_is_exactly_on_policy(tmp_path):
    from mmrl.core.logging import read_metrics

    cfg = load_config(backend.CONFIG_CLASS, None, [
        f"output_dir={tmp_path}", "train.max_steps=2", "rollout.prompts_per_step=2", "rollout.num_generations=4",
        "rollout.old_logprobs=forward", "rollout.score_batch_size=3", "task.num_train=8", "task.num_eval=2",
        "rollout.eval_samples=0", "logging.tensorboard=false", "logging.progress=false"], defaults=backend.DEFAULT_CONFIG)
    policy, task = backend.build(cfg)
    Trainer(cfg, policy, task).train()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["loss/ratio_min"], r["loss/ratio_max"]) for r in rows] == [(1.0, 1.0), (1.0, 1.0)]


def test_a_generation_config_that_changes_sampling_does_not_reach_rollouts(qwen25_dir, tmp_path):
    """generate() would apply the sampling changes a model's generation_config.json ships (Qwen
    instruct: repetition_penalty 1.05), which the old log-probs never see: rollouts and greedy
    evaluation draw as from a plain generation_config."""
    import shutil

    plain = qwen25_dir
    shipped = shutil.copytree(plain, tmp_path / "shipped")
    gen_file = shipped / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    (shipped / "generation_config.json").write_text(json.dumps(
        {**gen, "repetition_penalty": 1.3, "min_p": 0.3, "no_repeat_ngram_size": 2,
         "min_new_tokens": 12}))  # a minimum length forbids end-of-turn, which the log-probs allow
    items = ShapesQA(seed=0, num_train=2, num_eval=1).train_items()[:2]
    rollout = VLMTrainConfig().rollout.model_copy(update={"max_new_tokens": 12})
    out = {}
    for name, path in (("plain", plain), ("shipped", shipped)):
        policy = make_policy(path)
        assert name == "plain" or policy.model.generation_config.repetition_penalty == 1.3
        batch = policy.generate(items, 8, rollout, torch.Generator().manual_seed(0))
        greedy = policy.greedy_batches(items, 12, 2)
        out[name] = ([s.completion for s in batch.samples], [s.completion for b in greedy for s in b.samples])
    assert out["shipped"] == out["plain"]


def test_a_shipped_minimum_length_does_not_hold_off_end_of_turn(tmp_path):
    """The bundled model ends its greedy answers in 9-13 tokens; a generation_config.json with
    min_new_tokens 16 would forbid end-of-turn until then, in rollouts and greedy evaluation,
    where the log-probs allow it."""
    import shutil

    from mmrl.vlm.models import bundled_model_dir

    plain = bundled_model_dir()
    shipped = shutil.copytree(plain, tmp_path / "shipped")
    gen_file = shipped / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    gen_file.write_text(json.dumps({**gen, "min_new_tokens": 16}))
    items = ShapesQA(seed=0, num_train=8, num_eval=4).train_items()[:4]
    texts = {name: [s.completion for b in make_policy(path).greedy_batches(items, 16, 4) for s in b.samples]
             for name, path in (("plain", plain), ("shipped", shipped))}
    assert any(t.endswith("</answer>") for t in texts["plain"])  # answers that end their turn early
    assert texts["shipped"] == texts["plain"]


@pytest.mark.parametrize("remove, words", [
    (("tokenizer.json", "tokenizer_config.json"), "lacks the image placeholder <|image_pad|>"),
    (("chat_template.jinja", "chat_template.json"), "has no chat template"),
])
def test_a_model_directory_without_tokenizer_files_or_chat_template_fails_at_load(qwen25_dir, tmp_path, remove, words):
    """Both loaded (AutoProcessor builds a one-token tokenizer without its files) and failed at
    the first encode with a traceback."""
    import shutil

    copy = shutil.copytree(qwen25_dir, tmp_path / "m")
    for name in remove:
        (copy / name).unlink(missing_ok=True)
    with pytest.raises(ConfigError, match=f"model.path: .*{words.replace('|', '[|]')}"):
        load_vlm(VLMModelConfig(path=str(copy)))


def test_mean_over_a_mask_is_zero_for_an_empty_row():
    from mmrl.vlm.policy import mean_over

    x = torch.tensor([[1.0, 3.0, 5.0], [2.0, 4.0, 6.0]])
    mask = torch.tensor([[True, True, False], [False, False, False]])
    assert mean_over(x, mask).tolist() == [2.0, 0.0]


def test_a_completion_ending_its_turn_on_its_last_token_is_not_truncated():
    from mmrl.vlm.policy import budget_spent

    is_eos = torch.tensor([[False, False, False, False, True], [False] * 5, [False, True, False, False, False]])
    mask = torch.tensor([[True] * 5, [True] * 5, [True, True, False, False, False]])
    lengths = mask.sum(-1)
    assert budget_spent(is_eos, mask, lengths, 5).tolist() == [0.0, 1.0, 0.0]
    assert budget_spent(is_eos, mask, lengths, None).tolist() == [0.0, 1.0, 0.0]


def test_sft_loss_is_the_mean_nll_over_the_trained_tokens(qwen25_dir):
    policy = make_policy(qwen25_dir)
    batch = policy.teacher_batch(ITEMS[:2], ["<answer>red</answer>", "a longer answer, then <answer>blue</answer>"])
    assert not batch.mask.all()  # rows of different lengths: padding carries no loss
    with torch.no_grad():
        loss = policy.sft_loss(batch)
        logp = policy.logprobs(batch)
    torch.testing.assert_close(loss, -logp[batch.mask].mean())


def test_end_of_turn_is_im_end_whatever_the_tokenizers_eos(qwen25_dir):
    """A chat checkpoint whose tokenizer's eos is <|endoftext|> still ends turns at <|im_end|>."""
    model, processor = load_vlm(VLMModelConfig(path=str(qwen25_dir)))
    tok = processor.tokenizer
    tok.eos_token = "<|endoftext|>"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id != im_end
    assert VLMPolicy(model, processor).eos_id == im_end


def test_overlong_shaping_and_filtering_on_the_vlm(qwen25_dir, tmp_path):
    """DAPO's overlong rules on real rollouts: each sample carries its token count (greedy
    decodes too), the "overlong" atom scores it by eq. 13, and filtering prunes exactly the
    rollouts that spent their budget."""
    from mmrl.core.overlong import overlong_penalty

    cfg = load_config(VLMTrainConfig, overrides=[
        f"model.path={qwen25_dir}", f"output_dir={tmp_path}", "train.max_steps=1", "rollout.num_generations=4",
        "rollout.prompts_per_step=2", "rollout.max_new_tokens=6", "rollout.eval_samples=0", "task.num_train=8",
        "task.num_eval=2", "reward.overlong.buffer=3", "method.overlong_filter=true",
        "logging.tensorboard=false", "logging.progress=false"])
    policy, task = backend.build(cfg)
    trainer = Trainer(cfg, policy, task)  # adds the config's atoms to the task's reward
    batch = policy.generate(ITEMS[:2], 4, cfg.rollout, torch.Generator().manual_seed(0))
    lengths = [s.meta["completion_tokens"] for s in batch.samples]
    assert lengths == batch.data["stat/length"].int().tolist() and min(lengths) >= 1
    scores = task.reward.score(batch.samples)
    assert scores.names[-1] == "overlong"
    assert scores.values[:, -1].tolist() == [overlong_penalty(n, 6, 3) for n in lengths]
    greedy = [s.meta["completion_tokens"] for b in policy.greedy_batches(ITEMS[:2], 6) for s in b.samples]
    assert all(1 <= n <= 6 for n in greedy)
    summary = trainer.train()
    assert "overlong" in summary["eval_after"]
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["rollout/samples_pruned"] == round(row["rollout/truncated"] * 8)
    assert "reward/overlong" in row


def fixed_logits(policy: VLMPolicy, row: torch.Tensor) -> None:
    """The model's output layer gives `row` ([V]) at every position, whatever it reads: the
    distribution each step samples from is known by hand."""
    head = policy.model.lm_head
    assert row.shape == (head.out_features,)
    head.forward = lambda h: row.to(h.dtype).expand(*h.shape[:-1], row.shape[0])


def favour(policy: VLMPolicy, logits: dict[int, float]) -> torch.Tensor:
    """A row of logits: 0 everywhere except the given tokens'."""
    row = torch.zeros(policy.model.lm_head.out_features)
    for token, v in logits.items():
        row[token] = v
    return row


def test_a_model_that_ends_its_turn_at_once_gives_an_empty_answer(qwen25_dir):
    """End-of-turn far ahead of every other token: greedy and sampled completions are that
    one token (nothing forbids it first), decoded to the empty text, 1 token long, not truncated."""
    policy = make_policy(qwen25_dir)
    fixed_logits(policy, favour(policy, {policy.eos_id: 50.0}))
    (greedy,) = policy.greedy_batches(ITEMS[:2], 4)
    assert [s.completion for s in greedy.samples] == ["", ""]
    assert [s.meta["completion_tokens"] for s in greedy.samples] == [1, 1]
    batch = policy.generate(ITEMS[:2], 2, rollout_cfg(max_new_tokens=4), torch.Generator().manual_seed(0))
    assert batch.data["completion_ids"][:, 0].tolist() == [policy.eos_id] * 4
    assert batch.mask.sum(-1).tolist() == [1, 1, 1, 1] and [s.completion for s in batch.samples] == [""] * 4
    assert batch.data["stat/length"].tolist() == [1.0] * 4 and batch.data["stat/truncated"].tolist() == [0.0] * 4


def test_pad_tokens_the_model_generates_itself_are_its_own(qwen25_dir):
    """Without stop strings a row ends early only at end-of-turn: a completion of the pad token
    (Qwen's <|endoftext|>) that the model chose itself is its completion, all 4 tokens, and
    spends the budget (truncated), in rollouts and greedy decodes alike."""
    policy = make_policy(qwen25_dir)
    fixed_logits(policy, favour(policy, {policy.pad_id: 50.0}))
    batch = policy.generate(ITEMS[:1], 2, rollout_cfg(max_new_tokens=4), torch.Generator().manual_seed(0))
    assert batch.data["completion_ids"].tolist() == [[policy.pad_id] * 4] * 2
    assert batch.mask.all() and batch.data["stat/length"].tolist() == [4.0, 4.0]
    assert batch.data["stat/truncated"].tolist() == [1.0, 1.0]
    assert [s.meta["completion_tokens"] for s in batch.samples] == [4, 4]
    (greedy,) = policy.greedy_batches(ITEMS[:1], 4)
    assert greedy.samples[0].meta["completion_tokens"] == 4


def test_greedy_decoding_takes_the_argmax_with_no_repetition_penalty(qwen25_dir):
    """Token a at logit 1.0, b at 0.97, neither in the prompt: plain greedy repeats a. A
    repetition penalty of 1.05 (Qwen instruct's generation_config) would divide a's logit by
    1.05 once seen (0.952 < 0.97) and pick b second; no n-gram rule may forbid "a a" either."""
    policy = make_policy(qwen25_dir)
    tok = policy.tokenizer
    a, b = tok.convert_tokens_to_ids("~"), tok.convert_tokens_to_ids("`")
    assert a not in policy.encode(ITEMS[:1])["input_ids"][0].tolist()
    fixed_logits(policy, favour(policy, {a: 1.0, b: 0.97}))
    assert policy.greedy(ITEMS[:1], 4) == ["~~~~"]


def test_a_rollout_samples_the_whole_vocabulary_at_temperature_one(qwen25_dir):
    """Logits -t/1000 for token t (distinct ranks, nearly uniform): with top_p 1 and no top-k,
    tokens of any rank are drawn, and each old log-prob is -t/1000 - logsumexp over the
    tokens that are not banned (the 5 vision placeholders are)."""
    policy = make_policy(qwen25_dir)
    v = policy.model.lm_head.out_features
    logits = -torch.arange(v, dtype=torch.float32) / 1000
    fixed_logits(policy, logits)
    batch = policy.generate(ITEMS[:2], 4, rollout_cfg(max_new_tokens=8), torch.Generator().manual_seed(0))
    ids = batch.data["completion_ids"][batch.mask]
    assert int(ids.max()) >= 100  # top-k 50 would keep ids 0..49 only
    allowed = torch.ones(v, dtype=torch.bool)
    allowed[policy.banned_ids] = False
    norm = torch.logsumexp(logits[allowed].double(), 0)
    want = (-ids.double() / 1000 - norm).float()
    torch.testing.assert_close(batch.old_logp[batch.mask], want, atol=1e-5, rtol=0)


def test_a_prefix_counts_in_the_completions_tokens_not_in_its_trained_length(qwen25_dir):
    """Prefix ids [a, b], then end-of-turn: the sample's completion is "ab" and 3 tokens long
    (what the overlong atom reads), while stat/length counts the one token the model drew."""
    policy = make_policy(qwen25_dir)
    tok = policy.tokenizer
    head = tok("ab", add_special_tokens=False)["input_ids"]
    fixed_logits(policy, favour(policy, {policy.eos_id: 50.0}))
    batch = policy.generate(ITEMS[:1], 2, rollout_cfg(max_new_tokens=4), torch.Generator().manual_seed(0),
                            prefixes=[head, None])
    assert [s.completion for s in batch.samples] == ["ab", ""]
    assert [s.meta["completion_tokens"] for s in batch.samples] == [len(head) + 1, 1]
    assert batch.data["stat/length"].tolist() == [1.0, 1.0]


def test_a_prefix_per_sample_is_required(qwen25_dir):
    policy = make_policy(qwen25_dir)
    with pytest.raises(ValueError, match="3 prefixes for 4 samples"):
        policy.generate(ITEMS[:2], 2, rollout_cfg(), torch.Generator(), prefixes=[None, None, "a"])


def test_forward_scored_entropy_is_the_mean_over_the_trained_tokens_with_a_prefix(qwen25_dir):
    """rollout.old_logprobs=forward with a prefix: stat/entropy averages each row's entropies
    over its trained tokens (not over the prefix it attends)."""
    policy = make_policy(qwen25_dir)
    head = policy.tokenizer("I see two", add_special_tokens=False)["input_ids"]
    batch = policy.generate(ITEMS[:1], 2, rollout_cfg(max_new_tokens=3, old_logprobs="forward"),
                            torch.Generator().manual_seed(0), prefixes=[head, None])
    with torch.no_grad():
        _, ent = policy.logprobs(batch, entropy=True)
    m = batch.mask
    want = torch.stack([ent[i][m[i]].mean() for i in range(2)])
    torch.testing.assert_close(batch.data["stat/entropy"], want)


def test_token_stats_at_a_temperature_by_hand():
    """Logits [0, 2 ln 3, 0, 5] at T = 2, token 3 banned: softmax([0, ln 3, 0]) = [1/5, 3/5, 1/5];
    the log-prob of token 1 is ln(3/5), the entropy -(2/5 ln(1/5) + 3/5 ln(3/5)); float32 from
    bf16 logits too."""
    pol = VLMPolicy.__new__(VLMPolicy)
    pol.banned_ids = [3]
    step = torch.tensor([[0.0, 2 * math.log(3), 0.0, 5.0]])
    want_logp = math.log(3 / 5)
    want_ent = -(2 / 5 * math.log(1 / 5) + 3 / 5 * math.log(3 / 5))
    logp, ent = pol.token_stats([step, step], torch.tensor([[1, 0]]), 2.0)
    torch.testing.assert_close(logp, torch.tensor([[want_logp, math.log(1 / 5)]]))
    torch.testing.assert_close(ent, torch.tensor([[want_ent, want_ent]]))
    logp16, ent16 = pol.token_stats([step.bfloat16()], torch.tensor([[1]]), 2.0)
    assert logp16.dtype == ent16.dtype == torch.float32
    # bf16 logits, float32 softmax: 2 ln 3 rounds to 2.203125 in bf16
    x = torch.tensor(2 * math.log(3)).bfloat16().float() / 2
    torch.testing.assert_close(logp16, (x - torch.log(2 + x.exp())).reshape(1, 1))


def test_a_groups_multi_image_prompts_share_their_encoding_with_the_same_logprobs(qwen25_dir, monkeypatch):
    """Two-image prompts repeated in a group: the shared encoding gives each row its own two
    images in order, so log-probs equal encoding every row."""
    policy = make_policy(qwen25_dir)
    two = QAItem(images=ITEMS[0].images + ITEMS[1].images, question="How many circles are there?",
                 answer="1", reference="", meta={"answer": "1"})
    three = QAItem(images=ITEMS[2].images + ITEMS[3].images + ITEMS[4].images, question="Which is red?",
                   answer="1", reference="", meta={"answer": "1"})
    batch = policy.teacher_batch([two, two, three, three], ["a", "b", "c", "d"])
    with torch.no_grad():
        shared = policy.logprobs(batch)
        monkeypatch.setattr(VLMPolicy, "_takes_encoded_images", property(lambda self: False))
        each = policy.logprobs(batch)
    torch.testing.assert_close(shared, each, atol=1e-5, rtol=1e-5)


def test_a_rollout_encodes_its_prompts_once_not_once_per_sample(qwen25_dir, monkeypatch):
    policy = make_policy(qwen25_dir)
    calls = []
    encode = policy.encode
    monkeypatch.setattr(policy, "encode", lambda items: calls.append(len(items)) or encode(items))
    policy._encode_repeated(ITEMS[:3], 4)
    assert calls == [3]


def test_prompt_images_are_resized_within_min_and_max_pixels(qwen25_dir):
    """A prompt's messages carry min_pixels 80 x 80 and max_pixels 150 x 150 (qwen-vl-utils' own
    defaults are 56 x 56 and far above), so qwen-vl-utils sizes its images to multiples of 28
    within them: a 448 x 448 image shrinks to 140 x 140, a 28 x 28 one grows to 84 x 84."""
    from qwen_vl_utils import process_vision_info

    policy = make_policy(qwen25_dir)
    policy.min_pixels, policy.max_pixels = 80 * 80, 150 * 150
    item = QAItem(images=[Image.new("RGB", (s, s), "red") for s in (448, 28)], question="?", answer="",
                  reference="", meta={})
    found, _ = process_vision_info(policy.messages(item))
    assert [im.size for im in found] == [(140, 140), (84, 84)]


def test_a_rollout_copy_is_frozen_and_the_policy_is_not(qwen25_dir):
    policy = make_policy(qwen25_dir)
    copy = policy.rollout_copy()
    assert not any(p.requires_grad for p in copy.model.parameters())
    assert all(p.requires_grad for p in policy.model.parameters())


def test_a_sample_carries_the_items_answer_and_a_zero_token_count():
    item = QAItem(images=[], question="q?", answer="4", reference="", meta={"answer": "stale", "k": 1})
    s = to_sample(item, "text", 0)
    assert s.meta == {"answer": "4", "k": 1, "completion_tokens": 0}
    assert "completion_tokens" not in to_sample(item, "text").meta


def test_an_end_of_turn_past_the_mask_does_not_end_a_completion():
    """vLLM's batches pad with the pad token, which may be end-of-turn: a row of 2 tokens
    without end-of-turn, padded with one, spent its budget of 2 (and, with no budget known,
    counts as truncated); a row that ends its turn inside its mask does not."""
    from mmrl.vlm.policy import budget_spent

    is_eos = torch.tensor([[False, False, True], [False, True, False]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    assert budget_spent(is_eos, mask, mask.sum(-1), 2).tolist() == [1.0, 0.0]
    assert budget_spent(is_eos, mask, mask.sum(-1), None).tolist() == [1.0, 0.0]


def test_tool_images_are_resized_within_min_pixels_and_the_max_asked_for(qwen25_dir):
    """resize_images with min_pixels 80 x 80 and max_pixels 150 x 150, sides in multiples of 28:
    a 28 x 28 image grows to 84 x 84, a 448 x 448 one shrinks to 140 x 140, or to 112 x 112 where
    the caller asks for max_pixels 120 x 120."""
    policy = make_policy(qwen25_dir)
    policy.min_pixels, policy.max_pixels = 80 * 80, 150 * 150
    small, big = Image.new("RGB", (28, 28), "red"), Image.new("RGB", (448, 448), "red")
    assert [im.size for im in policy.resize_images([small, big])] == [(84, 84), (140, 140)]
    assert [im.size for im in policy.resize_images([big], max_pixels=120 * 120)] == [(112, 112)]


def test_tool_and_prompt_images_of_other_modes_are_shown_as_a_datasets_are(qwen25_dir):
    """A 16-bit image (a tool's depth map) was clipped to white by qwen-vl-utils' convert("RGB"),
    and a grey image with alpha lost its transparency to black; both now go through jsonl's
    to_rgb, for a tool's result (resize_images) and for a prompt's own images (messages)."""
    import numpy as np

    policy = make_policy(qwen25_dir)
    deep = Image.fromarray(np.full((56, 56), 1000, np.uint16))  # 1000 / 65535 of white: near black
    clear = Image.new("LA", (56, 56), (0, 0))  # fully transparent: white, as a dataset's is
    dark, light = (np.asarray(im) for im in policy.resize_images([deep, clear]))
    assert dark.max() <= 5 and light.min() == 255
    item = QAItem(images=[deep], question="q", answer="a", reference="", meta={})
    (shown,) = [part["image"] for part in policy.messages(item)[0]["content"] if part["type"] == "image"]
    assert shown.mode == "RGB" and np.asarray(shown).max() <= 5
    red = Image.new("RGB", (56, 56), "red")
    assert policy.messages(QAItem([red], "q", "a", "", {}))[0]["content"][0]["image"] is red  # RGB as it is


def test_a_tokenizer_with_an_unknown_token_keeps_its_eos_and_bans_only_real_placeholders():
    """A tokenizer that maps tokens it lacks to its unk id (0 here) and has no pad: no
    <|im_end|> means its own eos (2) ends turns and pads; of the vision placeholders only the
    one it has (<|image_pad|> = 7) is banned, never the unk id; the context is the text config's."""
    from types import SimpleNamespace

    class Tok:
        unk_token_id, eos_token_id, pad_token_id = 0, 2, None

        def convert_tokens_to_ids(self, token):
            return {"<|image_pad|>": 7}.get(token, 0)

    text = SimpleNamespace(max_position_embeddings=64)
    model = SimpleNamespace(config=SimpleNamespace(text_config=text, max_position_embeddings=32))
    policy = VLMPolicy(model, SimpleNamespace(tokenizer=Tok()))
    assert (policy.eos_id, policy.pad_id, policy.banned_ids, policy.max_context) == (2, 2, [7], 64)


def test_a_batch_has_images_when_any_row_has_one():
    from mmrl.vlm.policy import has_images

    one = torch.tensor([[[1, 2, 2]], [[0, 0, 0]]])  # row 0: an image of 1 x 2 x 2 patches; row 1: padding
    assert has_images({"image_grid_thw": one})
    assert not has_images({"image_grid_thw": torch.zeros_like(one)})
    assert not has_images({"image_grid_thw": torch.zeros((2, 0, 3), dtype=torch.long)})
    assert not has_images({})



def test_a_completion_ended_by_a_stop_string_is_not_truncated(qwen25_dir):
    """Stop string "~" and a model that writes "~" first: each completion is that one token of
    a budget of 4, ended without end-of-turn but not by the budget: 1 token, not truncated."""
    policy = make_policy(qwen25_dir)
    tilde = policy.tokenizer.convert_tokens_to_ids("~")
    fixed_logits(policy, favour(policy, {tilde: 50.0}))
    batch = policy.generate(ITEMS[:1], 2, rollout_cfg(max_new_tokens=4, stop=["~"]),
                            torch.Generator().manual_seed(0))
    assert [s.completion for s in batch.samples] == ["~", "~"]
    assert batch.data["stat/length"].tolist() == [1.0, 1.0]
    assert batch.data["stat/truncated"].tolist() == [0.0, 0.0]


def test_the_longest_prefix_of_a_rollout_counts_toward_its_prompts_length(qwen25_dir):
    """A context of prompt + max_new_tokens + 2 tokens: prefixes of 3 tokens and none make the
    longest row 3 past the budget, so the rollout is refused before it starts."""
    policy = make_policy(qwen25_dir)
    n = int(policy.encode(ITEMS[:1])["attention_mask"].sum())
    policy.max_context = n + 4 + 2
    with pytest.raises(PromptTooLong, match="prompt 0 of this batch"):
        policy.generate(ITEMS[:1], 2, rollout_cfg(max_new_tokens=4), torch.Generator(), prefixes=[[5, 6, 7], None])
    policy.max_context = n + 4 + 3  # just fits
    fixed_logits(policy, favour(policy, {policy.eos_id: 50.0}))
    assert len(policy.generate(ITEMS[:1], 2, rollout_cfg(max_new_tokens=4), torch.Generator(),
                               prefixes=[[5, 6, 7], None])) == 2


def test_banned_tokens_get_no_probability_however_low_the_other_logits():
    """Logits [-2e4, -2e4, 0] with token 2 banned: at -inf it gets none, so tokens 0 and 1 have
    1/2 each (log-prob ln(1/2), entropy ln 2), not the ~0 that any finite floor below 0 would
    leave them."""
    pol = VLMPolicy.__new__(VLMPolicy)
    pol.banned_ids = [2]
    step = torch.tensor([[-2e4, -2e4, 0.0]])
    logp, ent = pol.token_stats([step], torch.tensor([[0]]), 1.0)
    torch.testing.assert_close(logp, torch.tensor([[math.log(1 / 2)]]))
    torch.testing.assert_close(ent, torch.tensor([[math.log(2)]]))


def test_token_stats_of_no_rows_are_empty():
    """A batch of no rows with 3 steps (generate's logits are then 3 tensors [0, V]): [0, 3]
    log-probs and entropies, float32, not an error."""
    pol = VLMPolicy.__new__(VLMPolicy)
    pol.banned_ids = []
    logp, ent = pol.token_stats([torch.zeros((0, 5))] * 3, torch.zeros((0, 3), dtype=torch.long), 1.0)
    assert logp.shape == ent.shape == (0, 3) and logp.dtype == ent.dtype == torch.float32


def test_a_text_prefix_is_tokenized_without_special_tokens():
    """A tokenizer that puts BOS (1) in front when asked for special tokens: a text prefix is
    the middle of a completion, so it is its plain ids; ids and tensors are taken as given,
    None is no prefix."""

    def tokenizer(text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [10 + ord(c) - ord("a") for c in text]}

    pol = VLMPolicy.__new__(VLMPolicy)
    pol.tokenizer = tokenizer
    fixed = pol._prefix_ids(["ab", None, [7, 8], torch.tensor([9])], 4)
    assert fixed == [[10, 11], [], [7, 8], [9]]


def test_rows_share_an_encoding_only_with_the_same_patches_and_grids():
    """Rows 0 and 1: the same 4 patches in grids 1 x 2 x 2 and 1 x 1 x 4 (two different
    images), so each is its own; row 2 repeats row 1 exactly and shares its encoding."""
    from mmrl.vlm.policy import _repeated_rows

    patches = torch.arange(8.0).reshape(4, 2)
    grids = [torch.tensor([[1, 2, 2]]), torch.tensor([[1, 1, 4]]), torch.tensor([[1, 1, 4]])]
    assert _repeated_rows([patches, patches, patches.clone()], grids) == [0, 1, 1]


def test_old_logprobs_at_a_temperature_by_hand_and_zero_past_the_end_of_turn(qwen25_dir):
    """Logits 60 for end-of-turn and 60 + 2 ln 3 for "~" (the rest 0, e^-30 of them at T = 2):
    at temperature 2 "~" has 3/4 and end-of-turn 1/4, so each trained token's old log-prob is
    ln(3/4) or ln(1/4) and every step's entropy -(3/4 ln 3/4 + 1/4 ln 1/4); rows that end
    their turn early are padded, and the padding's old log-probs are 0."""
    policy = make_policy(qwen25_dir)
    tilde = policy.tokenizer.convert_tokens_to_ids("~")
    fixed_logits(policy, favour(policy, {policy.eos_id: 60.0, tilde: 60.0 + 2 * math.log(3)}))
    batch = policy.generate(ITEMS[:2], 2, rollout_cfg(max_new_tokens=4, temperature=2.0),
                            torch.Generator().manual_seed(0))
    ids, mask = batch.data["completion_ids"], batch.mask
    assert not mask.all() and mask[:, 0].all()  # some row ended its turn before the budget
    want = torch.where(ids == tilde, math.log(3 / 4), math.log(1 / 4)).masked_fill(~mask, 0.0)
    torch.testing.assert_close(batch.old_logp, want, atol=1e-5, rtol=0)
    entropy = -(3 / 4 * math.log(3 / 4) + 1 / 4 * math.log(1 / 4))
    torch.testing.assert_close(batch.data["stat/entropy"], torch.full((4,), entropy), atol=1e-5, rtol=0)


def test_greedy_decodes_every_item_in_batches_of_batch_size(qwen25_dir):
    """3 items, batch_size 2: two batches, of items 0-1 and of item 2, each its own groups; a
    model that ends its turn at once answers each with the empty text in 1 token."""
    policy = make_policy(qwen25_dir)
    fixed_logits(policy, favour(policy, {policy.eos_id: 50.0}))
    batches = policy.greedy_batches(ITEMS[:3], 4, batch_size=2)
    assert [b.group_ids.tolist() for b in batches] == [[0, 1], [0]]
    assert [s.prompt for b in batches for s in b.samples] == [it.question for it in ITEMS[:3]]
    assert [s.meta["completion_tokens"] for b in batches for s in b.samples] == [1, 1, 1]
    assert policy.greedy(ITEMS[:3], 4, batch_size=2) == ["", "", ""]


def test_a_teacher_batch_is_one_group_per_item(qwen25_dir):
    """Completions "ab" and "a" each followed by end-of-turn: groups 0 and 1, the ids of the
    text then end-of-turn (all trained), right-padded with the pad token."""
    policy = make_policy(qwen25_dir)
    batch = policy.teacher_batch(ITEMS[:2], ["ab", "a"])
    tok = policy.tokenizer
    ab, a = tok("ab", add_special_tokens=False)["input_ids"], tok("a", add_special_tokens=False)["input_ids"]
    assert batch.group_ids.tolist() == [0, 1]
    width = len(ab) + 1
    rows = [ab + [policy.eos_id], a + [policy.eos_id] + [policy.pad_id] * (width - len(a) - 1)]
    assert batch.data["completion_ids"].tolist() == rows
    assert batch.mask.sum(-1).tolist() == [len(ab) + 1, len(a) + 1]
    assert [s.completion for s in batch.samples] == ["ab", "a"]


def test_training_logprobs_are_zero_on_padding(qwen25_dir):
    """Completions "ab" and "a" of a teacher batch: row 1 is right-padded past its end-of-turn,
    and its log-prob there is 0 (as old_logp's), with or without entropies; every trained
    token's is negative."""
    policy = make_policy(qwen25_dir)
    batch = policy.teacher_batch(ITEMS[:2], ["ab", "a"])
    assert not batch.mask[1].all()
    with torch.no_grad():
        logp, _ = policy.logprobs(batch, entropy=True)
        plain = policy.logprobs(batch)
    assert (logp[~batch.mask] == 0).all() and (plain[~batch.mask] == 0).all()
    assert (logp[batch.mask] < 0).all()


# ---------------------------------------------------------------------------- audit: the backend's build checks and sample


class _Resizer:
    """A stand-in policy whose resize refuses a ratio over 10 and takes a 30 x 10 image to no
    width; it records each size it was asked to resize."""

    def __init__(self):
        self.asked = []

    def resize_images(self, images):
        (img,) = images
        self.asked.append(img.size)
        w, h = img.size
        if max(w, h) > 10 * min(w, h):
            raise ValueError("absolute aspect ratio must be smaller than 10")
        return [Image.new("RGB", (0, 28) if (w, h) == (30, 10) else (28, 28))]


def _shaped_task(train_sizes, eval_sizes):
    from types import SimpleNamespace

    def items(sizes, split):
        return [QAItem([Image.new("RGB", s)], f"{split} {k}", "red") for k, s in enumerate(sizes)]

    return SimpleNamespace(train=items(train_sizes, "train"), eval_items=items(eval_sizes, "eval"))


def test_only_images_past_two_to_one_are_tried_each_size_once():
    policy, task = _Resizer(), _shaped_task([(56, 28), (57, 28), (57, 28), (28, 84)], [(57, 28), (4, 4)])
    backend._check_image_shapes(policy, task, "raise")  # all of them resize
    assert policy.asked == [(57, 28), (28, 84)]  # 56 x 28 is exactly 2:1: not tried; 57 x 28 once


def test_skip_leaves_out_train_and_eval_samples_with_an_image_resized_to_no_pixels():
    policy = _Resizer()
    task = _shaped_task([(30, 10), (28, 28), (110, 10)], [(28, 28), (30, 10), (10, 110)])
    with pytest.warns(UserWarning, match=r"3 image size\(s\); first: train sample 0"):
        backend._check_image_shapes(policy, task, "skip")
    assert [it.question for it in task.train] == ["train 1"] and [it.question for it in task.eval_items] == ["eval 0"]


def test_skip_refuses_a_split_whose_every_sample_is_unusable():
    task = _shaped_task([(28, 28)], [(30, 10), (200, 10)])
    with pytest.raises(ConfigError, match="no usable eval samples"):
        backend._check_image_shapes(_Resizer(), task, "skip")
    task = _shaped_task([(200, 10)], [(28, 28)])
    with pytest.raises(ConfigError, match="no usable train samples"):
        backend._check_image_shapes(_Resizer(), task, "skip")
    with pytest.raises(ConfigError, match="train sample 0 .*a 30 x 10 image: the resized image has no pixels"):
        backend._check_image_shapes(_Resizer(), _shaped_task([(30, 10)], [(28, 28)]), "raise")


def test_vlm_build_task_passes_the_rollout_settings_and_shapes_qa_metrics():
    cfg = load_config(VLMTrainConfig, overrides=["task.num_train=4", "task.num_eval=3", "rollout.eval_batch_size=5",
                                                 "rollout.eval_samples=3", "rollout.max_new_tokens=11"])
    task = backend.build_task(cfg)
    assert (task.batch_size, task.eval_samples, task.max_new_tokens) == (5, 3, 11)
    assert task.rollout is cfg.rollout and task.metrics is backend.qa_consistency
    assert (len(task.train), len(task.eval_items)) == (4, 3)


def test_qa_consistency_is_the_rate_among_checkable_and_their_share():
    """Three completions to one colour_of question: reasoning "a red square" then answer red
    (consistent), the same reasoning then another colour (inconsistent), and no reasoning
    (not checkable): rate 1 of 2 checked, checked share 2 of 3."""
    from mmrl.vlm.tasks.shapes_qa import generate_items

    item = next(it for it in generate_items(40, seed=0) if it.meta["kind"] == "colour_of")
    shape, colour = item.meta["params"]["shape"], item.answer
    other = "blue" if colour != "blue" else "red"
    texts = [f"a {colour} {shape} <answer>{colour}</answer>", f"a {colour} {shape} <answer>{other}</answer>",
             f"<answer>{colour}</answer>"]
    out = backend.qa_consistency(texts, [item] * 3)
    assert out == {"inconsistency_rate": 0.5, "consistency_checked": pytest.approx(2 / 3)}


def test_mood_coverage_reports_the_modes_accuracy_beside_coverage():
    from mmrl.vlm.tasks.shapes_mood import ShapesMood

    items = ShapesMood(seed=0, num_train=2, num_eval=2).eval_items()[:1]
    mode = items[0].meta["answer"]
    out = backend.mood_coverage([f"<answer>{mode}</answer>"], items)
    assert out["mode_accuracy"] == 1.0 and set(out) == {"coverage", "mode_accuracy"}
    assert 0.0 <= out["coverage"] < 1.0  # this scene spreads its label mass over 8 moods (awe: 0.27)



def test_vlm_sample_draws_from_a_generator_seeded_by_the_config_and_scores_held_out_items():
    """No --prompt: the first two held-out items, n = 2 each, sampled from a CPU generator
    seeded by cfg.seed; each row scored by the task's atoms against its item's answer."""
    from types import SimpleNamespace

    seeds = []

    def generate(items, n, rollout, gen):
        seeds.append(gen.initial_seed())
        return SimpleNamespace(samples=[to_sample(it, f"<answer>{it.answer}</answer>") for it in items for _ in range(n)])

    items = [QAItem([], "q0", "red"), QAItem([], "q1", "blue"), QAItem([], "q2", "green")]
    task = VLMTask("shapes-qa", items, items, shapes_qa_reward(), max_new_tokens=6)
    cfg = load_config(VLMTrainConfig, overrides=["seed=5"])
    rows = backend.sample(cfg, SimpleNamespace(generate=generate), task, [], n=2)
    assert seeds == [5]
    assert [(r["question"], r["gold"]) for r in rows] == [("q0", "red"), ("q0", "red"), ("q1", "blue"), ("q1", "blue")]
    assert all(r["reward"] == pytest.approx(1.1) and r["atoms"] == {"format": 1.0, "answer": 1.0} for r in rows)
