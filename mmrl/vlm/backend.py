"""The vision-language backend as the CLI and the loop see it (mmrl.core.cli).

    CONFIG_CLASS    VLMTrainConfig
    DEFAULT_CONFIG  the main job: the bundled tiny Qwen2.5-VL, shapes-qa, GRPO, on a CPU in minutes
    build(cfg)      -> (VLMPolicy, VLMTask)
    build_engine    vLLM rollout engines (rollout.engine: vllm; vllm+http:// servers)
    sample(...)     -> scored samples for `mmrl sample`
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

import mmrl.vlm.methods  # noqa: F401  (registers the VLM methods: axpo)
from mmrl.core.config import ConfigError, config_warning
from mmrl.core.device import model_device
from mmrl.core.memory import enable_gradient_checkpointing
from mmrl.core.runconfig import resolve_dir, resolve_file
from mmrl.vlm.config import CONFIG_CLASS, DEFAULT_CONFIG, VLMTrainConfig  # noqa: F401 -- the CLI's settings: torch-free there
from mmrl.vlm.models import load_vlm, resolve_model_path
from mmrl.vlm.policy import DEFAULT_PATCH_SIZE, VLMPolicy, patch_or_default
from mmrl.vlm.task import VLMTask


def build_task(cfg: VLMTrainConfig) -> VLMTask:
    from mmrl.vlm.tasks.shapes_qa import ShapesQA, shapes_qa_reward

    t = cfg.task
    reward = shapes_qa_reward()  # shapes-zoom and jsonl answers are checked like shapes-qa's
    extra: dict = {}
    if t.type == "shapes-qa":
        try:
            data = ShapesQA(seed=t.seed, num_train=t.num_train, num_eval=t.num_eval, image_size=t.image_size,
                            min_shapes=t.min_shapes, max_shapes=t.max_shapes, kinds=t.kinds,
                            shape_size=tuple(t.shape_size))
            train, evaluation = data.train_items(), data.eval_items()
        except ValueError as e:
            raise ConfigError(f"task (shapes-qa): {e}") from e
        extra["metrics"] = qa_consistency
    elif t.type == "shapes-zoom":
        from mmrl.vlm.tasks.shapes_zoom import ShapesZoom

        try:
            data = ShapesZoom(seed=t.seed, num_train=t.num_train, num_eval=t.num_eval, image_size=t.image_size,
                              shape_size=tuple(t.shape_size), kinds=t.kinds)
        except ValueError as e:
            raise ConfigError(f"task (shapes-zoom): {e}") from e
        train, evaluation = data.train_items(), data.eval_items()
    elif t.type == "shapes-mood":
        from mmrl.vlm.tasks.shapes_mood import ShapesMood, shapes_mood_reward

        try:  # the config's fields are ShapesMood's arguments (its OOD items: data.ood_items())
            data = ShapesMood(**t.model_dump(exclude={"type", "diversity_weight"}))
        except ValueError as e:
            raise ConfigError(f"task (shapes-mood): {e}") from e
        train, evaluation = data.train_items(), data.eval_items()
        reward = shapes_mood_reward(diversity_weight=t.diversity_weight)
        extra["metrics"], extra["extra_eval"] = mood_coverage, {"ood": data.ood_items()}
    else:
        from mmrl.vlm.tasks.jsonl import DatasetError, check_overlap, load_jsonl

        # The model only ever sees an image within model.max_pixels: keep that, not a photo's full
        # resolution (3000 12-megapixel photos are 100 GiB decoded). A tool (zoom) crops the
        # full-resolution original, in its pixel coordinates: with tools each item also says where
        # its original is, decoded again when a tool asks (JsonlItem.full_images).
        fit = model_view(cfg.model.min_pixels, cfg.model.max_pixels, patch_size=saved_patch_size(cfg))
        kw = {"on_bad_image": t.on_bad_image, "fit": fit, "originals": cfg.rollout.tools is not None}
        try:
            train = load_jsonl(resolve_file(t.train_path, cfg.base_dir), **kw)
            evaluation = load_jsonl(resolve_file(t.eval_path, cfg.base_dir), **kw)
        except DatasetError as e:
            raise ConfigError(f"task: {e}") from e
        check_overlap(train, evaluation)
    if cfg.method.type == "cora":  # CORA's second reward stream: P(the reasoning supports the answer)
        from mmrl.core.rewards import Reward
        from mmrl.vlm.consistency import ConsistencyModel, consistency_atom

        device = model_device(cfg.model.device)  # the classifier runs where the policy does; scores come back on the CPU
        try:
            where = resolve_dir(cfg.method.consistency_model, cfg.base_dir)  # the config's directory first
            judge = ConsistencyModel.from_pretrained(where, device=device)
            atom = consistency_atom(judge, weight=cfg.method.lam)
        except (OSError, ValueError) as e:
            raise ConfigError(f"method.consistency_model: {e}") from e
        reward = Reward([*reward.atoms, atom])
    return VLMTask(t.type, train, evaluation, reward,
                   max_new_tokens=cfg.rollout.max_new_tokens, batch_size=cfg.rollout.eval_batch_size,
                   rollout=cfg.rollout, eval_samples=cfg.rollout.eval_samples, **extra)


def saved_patch_size(cfg: VLMTrainConfig) -> int:
    """The patch side of model.path's image processor (VLMPolicy.patch_size), read from its JSON
    files as transformers reads them (processor_config.json's "image_processor", else
    preprocessor_config.json), for model_view before the processor loads; qwen-vl-utils' default
    (Qwen2/2.5-VL's 14) where neither names one. A directory at fault is load_vlm's to name."""
    import json

    path = resolve_model_path(cfg.model.path, cfg.base_dir)
    for name, key in (("processor_config.json", "image_processor"), ("preprocessor_config.json", None)):
        try:
            found = json.loads((path / name).read_text())
            found = found[key] if key else found
        except (OSError, ValueError, KeyError, TypeError):
            continue
        return patch_or_default(found.get("patch_size") if isinstance(found, dict) else None)
    return DEFAULT_PATCH_SIZE


def model_view(min_pixels: int, max_pixels: int, *, patch_size: int = DEFAULT_PATCH_SIZE):
    """A jsonl image -> the image as the model sees it (the policy's resize, qwen-vl-utils',
    within model.min_pixels and model.max_pixels, to multiples of 2 x the model's `patch_size`),
    for an image over max_pixels; else the image itself. The policy's resize of the smaller
    image is that same image (a copy, the same pixels), so rollouts, training and evaluation see
    exactly what they saw of the original. An image the resize refuses, or would resize again,
    is kept whole: _check_image_shapes then names it by its own size, as before."""
    from mmrl.vlm.policy import resize_for_model

    def fit(image):
        if image.width * image.height <= max_pixels:  # no smaller than the model's view: as it is
            return image
        try:
            (seen,) = resize_for_model([image], min_pixels, max_pixels, patch_size=patch_size)
            (again,) = resize_for_model([seen], min_pixels, max_pixels, patch_size=patch_size)
        except Exception:  # noqa: BLE001 -- qwen-vl-utils raises ValueError and assertion errors
            return image
        return seen if min(seen.size) >= 1 and again.size == seen.size else image

    return fit


def qa_consistency(texts, items) -> dict[str, float]:
    """shapes-qa's exact inconsistency rate: answers that the completion's own reasoning does
    not imply, among completions whose reasoning and answer can be read (CORA's measure)."""
    from mmrl.vlm.consistency import inconsistency_rate
    from mmrl.vlm.tasks.shapes_qa import to_sample

    rate, checked = inconsistency_rate([to_sample(it, t) for it, t in zip(items, texts)])
    return {"inconsistency_rate": rate, "consistency_checked": checked / len(items)}


def mood_coverage(texts, items) -> dict[str, float]:
    """shapes-mood's own measures: how much of the label distribution the K candidates cover,
    and the final choice's accuracy on the mode whatever the format ("accuracy" needs it)."""
    from mmrl.vlm.tasks.shapes_mood import mood_metrics

    m = mood_metrics(texts, items)
    return {"coverage": m["coverage"], "mode_accuracy": m["accuracy"]}


def build(cfg: VLMTrainConfig):
    model_device(cfg.model.device)  # a ConfigError for a GPU this machine lacks, before any reading
    # The data first: a missing or malformed jsonl file (or image) is named in a second, not
    # after the model has loaded (minutes for a 7B one).
    task = build_task(cfg)
    policy = build_policy(cfg)
    if cfg.task.type == "jsonl":  # the synthetic tasks draw images the model takes
        _check_image_shapes(policy, task, cfg.task.on_bad_image)
        saved = saved_patch_size(cfg)  # read from the files before the processor loaded (build_task)
        if policy.patch_size != saved:
            config_warning(f"model.path: its processor cuts {policy.patch_size}-pixel patches, but its JSON files "
                           f"name {saved} (a remote-code processor?): the data's images were kept at "
                           f"multiples of {2 * saved} pixels, and each rollout resizes that view "
                           "again, not the original: other pixels than the processor's own patch would give")
    return policy, task


def build_policy(cfg: VLMTrainConfig) -> VLMPolicy:
    """The policy alone: `export` decodes nothing, so it needs not the task's data files (a run
    copied to another machine without them)."""
    device = model_device(cfg.model.device)  # a ConfigError for a GPU this machine lacks, before any loading
    tools = build_tools(cfg)
    model, processor = load_vlm(cfg.model, seed=cfg.seed, base_dir=cfg.base_dir)
    # LoRA's adapters are drawn on the CPU (load_vlm), then moved: the same start on any device.
    # The KL reference (adapters off, or a copy) and rollout copies follow the policy's device.
    if cfg.model.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return VLMPolicy(model.to(device), processor, temperature=cfg.rollout.temperature,
                     min_pixels=cfg.model.min_pixels, max_pixels=cfg.model.max_pixels,
                     tools=tools, tools_cfg=cfg.rollout.tools, logprob_chunk=cfg.model.logprob_chunk)


def _check_image_shapes(policy: VLMPolicy, task, on_bad_image: str) -> None:
    """A dataset image the model's resizing cannot take fails here, not at its first rollout:
    Qwen's resize refuses an aspect ratio over 200, and makes the short side 0 once the ratio is
    past about max_pixels / (2 x patch)^2 (at the default 112 x 112: 16:1 for Qwen2/2.5-VL's
    28-multiples, 12:1 for Qwen3-VL's 32). Only elongated images are tried (on a blank of their
    size, resized as the policy resizes); with task.on_bad_image=skip their samples are left out."""
    bad: dict[tuple, str] = {}
    tried: set[tuple] = set()  # sizes already resized: a dataset's images often share one
    for split, items in (("train", task.train), ("eval", task.eval_items)):
        for i, item in enumerate(items):
            for image in item.images:
                w, h = image.size
                if (w, h) in tried or max(w, h) <= 2 * min(w, h):
                    continue
                tried.add((w, h))
                problem = _resize_problem(policy, w, h)
                if problem:
                    sample = item.where or f"{split} sample {i} ({item.question[:40]!r})"
                    bad[(w, h)] = f"{sample}: a {w} x {h} image: {problem}"
    if not bad:
        return
    if on_bad_image == "raise":
        raise ConfigError(f"task: {next(iter(bad.values()))} (the model's resizing, within model.min_pixels and "
                          "model.max_pixels, cannot take it; task.on_bad_image=skip leaves such samples out)")
    shapes = set(bad)
    for split in ("train", "eval_items"):
        items = getattr(task, split)
        kept = [it for it in items if not any(im.size in shapes for im in it.images)]
        if not kept:
            raise ConfigError(f"task: no usable {split.split('_')[0]} samples: every one has an image the model's "
                              f"resizing cannot take ({next(iter(bad.values()))})")
        setattr(task, split, kept)
    warnings.warn(f"task: left out the samples with images the model's resizing cannot take "
                  f"({len(shapes)} image size(s); first: {next(iter(bad.values()))})", UserWarning, stacklevel=2)


def _resize_problem(policy: VLMPolicy, w: int, h: int) -> str | None:
    """Why the model's resizing cannot take a w x h image (tried on a blank of that size), or None."""
    from PIL import Image

    try:
        (out,) = policy.resize_images([Image.new("RGB", (w, h))])
        if min(out.size) < 1:
            return "the resized image has no pixels"
    except Exception as e:  # noqa: BLE001 -- qwen-vl-utils raises ValueError and assertion errors
        return str(e) or type(e).__name__
    return None


def build_tools(cfg: VLMTrainConfig):
    """The tool registry of rollout.tools (None without tools); AXPO needs tools."""
    tc = cfg.rollout.tools
    if tc is None:
        if cfg.method.type == "axpo":
            raise ConfigError("method.type=axpo resamples tool-call prefixes: it needs multi-turn tool "
                              "rollouts (set rollout.tools, e.g. --set rollout.tools.names=[zoom])")
        return None
    from mmrl.vlm.tools import build_registry

    try:
        return build_registry(tc.names, timeout=tc.timeout, base_dir=cfg.base_dir, max_stuck=tc.max_stuck,
                              isolation=tc.isolation)
    except ValueError as e:
        raise ConfigError(f"rollout.tools.names: {e}") from e


def build_engine(kind: str, cfg: VLMTrainConfig, policy: VLMPolicy, url: str | None = None):
    """Engines besides HF for mmrl.core.pipeline.build_engines: "vllm" (in process, on the
    trainer's GPU) and "vllm-server" (vLLM's OpenAI-compatible server at `url`)."""
    from mmrl.vlm.vllm_engine import build_engine as build_vllm

    if cfg.rollout.tools is not None:
        raise ConfigError(f"rollout.engine {kind}: multi-turn tool rollouts (rollout.tools) run on the hf "
                          "engine only for now")
    return build_vllm(kind, cfg, policy, url=url)


def sample(cfg: VLMTrainConfig, policy: VLMPolicy, task: VLMTask, prompts: list[str], n: int,
           greedy: bool = False, images: list[Path] | None = None) -> list[dict]:
    """n samples (greedy: the one greedy answer, as held-out evaluation decodes) for each of
    the first held-out items, scored by the task's atoms, or for each --prompt question (no
    gold answer, so not scored), asked of `images` (one image for every question, or one
    per question; none: text only)."""
    from mmrl.vlm.tasks.jsonl import prompt_problem
    from mmrl.vlm.tasks.shapes_qa import QAItem

    for k, p in enumerate(prompts):  # as a data file's questions are checked: an error, not the processor's traceback
        problem = prompt_problem(p, 1 if images else 0)
        if problem:
            raise ConfigError(f"--prompt {k + 1} ({p!r}) {problem}")
    images = images or []
    if images and len(images) not in (1, len(prompts)):
        raise ConfigError(f"--image: {len(images)} images for {len(prompts)} --prompt questions "
                          "(give one image for them all, or one per question)")
    asks = [images[min(k, len(images) - 1)] for k in range(len(prompts))] if images else []  # each question's image
    pictures = {path: _read_image(path) for path in asks}  # each file read once
    for path, picture in pictures.items():  # as training checks a dataset's: an error, not a traceback mid-generation
        problem = _resize_problem(policy, *picture.size)
        if problem:
            raise ConfigError(f"--image: {path}: a {picture.width} x {picture.height} image the model's resizing, "
                              f"within model.min_pixels and model.max_pixels, cannot take: {problem}")
    items = [QAItem(images=[pictures[asks[k]]] if asks else [], question=p, answer="", reference="", meta={})
             for k, p in enumerate(prompts)]
    asked = items or task.eval_items[:2]
    if greedy:
        samples = [s for b in policy.greedy_batches(asked, task.max_new_tokens, stop=task.stop) for s in b.samples]
    else:
        # a CPU generator: it draws the sampling seeds only, the same on any model.device
        samples = policy.generate(asked, n, cfg.rollout, torch.Generator().manual_seed(cfg.seed)).samples
    if items:
        return [{"question": s.prompt, "completion": s.completion, **({"image": str(asks[k // n])} if asks else {})}
                for k, s in enumerate(samples)]
    scores = task.reward.score(samples)
    return [{"question": s.prompt, "gold": s.meta.get("answer"), "completion": s.completion,
             "reward": float(total), "atoms": atoms}
            for s, atoms, total in zip(samples, scores.per_sample(), scores.totals())]


def _read_image(path: Path):
    from mmrl.vlm.tasks.jsonl import open_rgb, unreadable, warnings_named

    try:
        with warnings_named(f"--image {path}"):
            return open_rgb(path)
    except Exception as e:  # decoders raise many kinds of errors
        raise ConfigError(f"--image: cannot read {path}: {unreadable(path, e)}") from e
