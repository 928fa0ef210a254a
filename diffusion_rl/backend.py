"""The flow / diffusion backend as the CLI and the loop see it (mmrl.core.cli).

    CONFIG_CLASS    DiffusionTrainConfig
    DEFAULT_CONFIG  the main job: the bundled tiny flow model, shapes-geneval, Flow-GRPO, on a CPU
    build(cfg)      -> (DiffusionPolicy, DiffusionTask)
    sample(...)     -> images written as PNG, scored by the task's atoms (`diffusion-rl sample`)
    calibrate(...)  -> CAST's SDE window from ODE trajectories, window.json (`diffusion-rl calibrate-window`)
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

from diffusion_rl.config import CONFIG_CLASS, DEFAULT_CONFIG, DiffusionTrainConfig  # noqa: F401 -- the CLI's settings: torch-free there
from diffusion_rl.policy import DiffusionPolicy, to_sample
from diffusion_rl.task import DiffusionTask, draw
from mmrl.core.config import ConfigError
from mmrl.core.device import model_device
from mmrl.core.jsonl import LINE_END_BYTES, HeldOutWarning, text_lines
from mmrl.core.memory import enable_gradient_checkpointing
from mmrl.core.rewards import Reward
from mmrl.core.runconfig import bundled, not_installed_note, resolve_dir, resolve_file


def bundled_model_dir() -> Path:
    return bundled("tiny-flow")


def model_dir(cfg: DiffusionTrainConfig) -> Path:
    """model.path as runconfig.resolve_dir reads it (the config's directory, the working directory,
    the repository), or the bundled model for none."""
    return resolve_dir(cfg.model.path, cfg.base_dir) if cfg.model.path else bundled_model_dir()


def build_task(cfg: DiffusionTrainConfig) -> DiffusionTask:
    from diffusion_rl.tasks.shapes_geneval import reward_atoms, sample_prompts

    t = cfg.task
    # The image atoms (CLIP score, preference models) are neural and heavy (a ViT-H-14 scores
    # every rollout image): one whose spec names no device runs on the model's. The
    # shapes-geneval detector is NumPy on PIL images and stays on the CPU.
    device = str(model_device(cfg.model.device))
    try:  # reward_atoms names an unknown atom, RewardAtom a non-finite weight
        shapes = reward_atoms(t.atom_weights, unparsed="zero" if t.unparsed == "whole_prompt" else "error")
    except ValueError as e:
        raise ConfigError(f"task.atom_weights: {e}") from e
    image_atoms = []
    if t.image_atoms:
        from diffusion_rl.rewards import build_image_reward_atoms

        try:
            image_atoms = build_image_reward_atoms([{"device": device, **spec} for spec in t.image_atoms],
                                                   base_dir=cfg.base_dir)  # relative paths: the config's directory
        except ValueError as e:
            raise ConfigError(f"task.image_atoms: {e}") from e
        for a in image_atoms:  # evaluation logs each atom's mean under its name, beside its own metrics
            if a.name in DiffusionTask.metric_names or a.name.startswith(DiffusionTask.metric_prefixes):
                raise ConfigError(f"task.image_atoms: atom name {a.name!r} is taken by an evaluation metric "
                                  "(held-out evaluation logs each atom's mean under its name); give the spec "
                                  "another 'name'")
            if a.name in {s.name for s in shapes}:
                raise ConfigError(f"task.image_atoms: atom name {a.name!r} is a shapes-geneval atom's "
                                  f"({', '.join(s.name for s in shapes)}); give the spec another 'name'")
    whole = None  # the whole-prompt reward: image atoms not gated by a shapes atom (those score 0)
    if t.unparsed == "whole_prompt":
        whole = [a.name for a in image_atoms if not {s.name for s in shapes} & set(a.parents)]
        if not whole:
            raise ConfigError("task.unparsed=whole_prompt: every image atom is gated by a shapes atom, which "
                              "scores an undecomposable prompt 0; add an ungated one (e.g. type clip_score)")
    try:  # an image atom gated on an atom that is not there
        reward = Reward([*shapes, *image_atoms])
    except ValueError as e:
        raise ConfigError(f"task.image_atoms: {e}") from e
    disjoint = t.held_out == "disjoint"
    train = (_prompt_file(t.train_path, cfg.base_dir, "train_path", whole)
             or sample_prompts(t.num_train, t.seed, split="train", disjoint=disjoint))
    evaluation = (_prompt_file(t.eval_path, cfg.base_dir, "eval_path", whole)
                  or sample_prompts(t.num_eval, t.seed, split="eval", disjoint=disjoint))
    if t.train_path or t.eval_path:  # generated prompts keep their split (task.held_out); a file may not
        from diffusion_rl.tasks.shapes_geneval import prompt_key

        # "A red circle." in a file is the generated "a red circle": compared as the parser reads them
        trained = {prompt_key(p) for p in train}
        shared = {prompt_key(p) for p in evaluation} & trained
        if shared:
            first = next(p for p in evaluation if prompt_key(p) in shared)
            warnings.warn(f"task.eval_path: {len(shared)} of {len({prompt_key(p) for p in evaluation})} held-out "
                          f"prompts are training prompts too ({first!r}{', ...' if len(shared) > 1 else ''}), as the "
                          "reward reads prompts (case, spacing and a final period aside), so held-out evaluation "
                          "scores them as trained on", HeldOutWarning, stacklevel=2)
    return DiffusionTask(t.type, train, evaluation, reward, eval_seeds=t.eval_seeds,
                         eval_steps=cfg.rollout.eval_steps or cfg.rollout.num_steps, grid_prompts=t.grid_prompts,
                         hard_min_atoms=t.hard_min_atoms)


def _prompt_file(path: str | None, base: str | None, key: str, whole_prompt: list[str] | None = None
                 ) -> list[str] | None:
    """Prompts from a text file, one per line (blank lines and # comments skipped), each
    checked by the shapes-geneval parser. A line it cannot decompose is a ConfigError naming
    the line and the unparsed words, or with `whole_prompt` (the names of the whole-prompt
    reward atoms: task.unparsed=whole_prompt) it is kept, and one warning names every such line."""
    from diffusion_rl.tasks.shapes_geneval import json_hint, parse_prompt, shorten

    if path is None:
        return None
    file = resolve_file(path, base)  # the config's directory, else the working directory
    try:
        raw = file.read_bytes()
    except OSError as e:
        raise ConfigError(f"task.{key}: cannot read {file}: {e.strerror or e}") from e
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):  # Windows Notepad's "Unicode": not a stray byte on line 1
        raise ConfigError(f"task.{key}: {file} is UTF-16 (it starts with a UTF-16 byte-order mark); save the "
                          "file as UTF-8")
    try:
        lines = text_lines(raw.decode("utf-8"))  # a byte-order mark (Windows editors) is not line 1's text
    except UnicodeDecodeError as e:  # a user's file, not a bug: name the file and the line
        line = len(LINE_END_BYTES.split(raw[:e.start]))  # lone-CR line ends count too
        raise ConfigError(f"task.{key}: {file}, line {line}: not valid UTF-8 (byte 0x{raw[e.start]:02x}); "
                          "save the file as UTF-8") from None
    prompts, unparsed = [], []
    for n, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            parse_prompt(text)
        except ValueError as e:
            if whole_prompt is None:
                # a JSON line is the file's format at fault, not words a whole-prompt reward could score
                advice = "" if json_hint(text) else ("; to score such prompts with a whole-prompt reward instead, "
                                                     "set task.unparsed=whole_prompt")
                raise ConfigError(f"task.{key}: {file}, line {n} ({shorten(text)!r}): {e}{advice}") from e
            unparsed.append(f"line {n}: {e}")
        prompts.append(text)
    if not prompts:
        raise ConfigError(f"task.{key}: {file} holds no prompts")
    if unparsed:
        shown = "; ".join(unparsed[:10]) + (f"; and {len(unparsed) - 10} more" if len(unparsed) > 10 else "")
        warnings.warn(f"task.{key}: {file}: {len(unparsed)} of {len(prompts)} prompts cannot be decomposed into "
                      f"shapes atoms; they are scored by the whole-prompt reward ({', '.join(whole_prompt)}) "
                      f"only, the shapes atoms giving them 0 (task.unparsed=whole_prompt): {shown}", stacklevel=2)
    return prompts


def resolve_settings(cfg: DiffusionTrainConfig) -> Path:
    """The settings the model decides, in cfg, as build makes them (so config.yaml, a calibrated
    window's check and a benchmark's --reuse see what the run samples with): rollout.shift auto
    -> the model family's, and CAST's calibrated window (method.window_from). -> the model's
    directory (model.path: the config's directory, the working directory or the repo's)."""
    from diffusion_rl.calibrate import apply_window_file
    from diffusion_rl.models import pipeline_family, time_shift

    path = model_dir(cfg)
    if path.is_file():  # a downloaded checkpoint file: say how to make the directory, not just "not one"
        from diffusion_rl.models import single_file_message

        raise ConfigError(f"model.path: {single_file_message(path)}")
    if not path.is_dir():
        raise ConfigError(f"model.path: {path} is not a directory"
                          f"{not_installed_note(cfg.model.path or path) or ' (a diffusers pipeline directory is expected)'}")
    if cfg.rollout.shift == "auto":
        family = pipeline_family(path)
        if family is not None:
            try:  # the scheduler's config says which; loading the model says what is wrong with it
                scheduler = json.loads((path / "scheduler" / "scheduler_config.json").read_text(encoding="utf-8"))
            except (OSError, ValueError):
                scheduler = {}
            cfg.rollout.shift = time_shift(family, scheduler if isinstance(scheduler, dict) else {})
    if cfg.method.type == "cast":  # the calibrated SDE window (method.window_from) sets the rollout's
        used = apply_window_file(cfg, path)
        if used is not None:
            start, size = cfg.rollout.window_start[0], cfg.rollout.window_size
            print(f"CAST: SDE window steps {start}..{start + size - 1} of {cfg.rollout.num_steps}, calibrated "
                  f"({used})", file=sys.stderr, flush=True)
    return path


def build(cfg: DiffusionTrainConfig):
    path, device = _settings(cfg)
    # the prompt files and image atoms first: a bad line is named before a model of minutes' loading
    task = build_task(cfg)
    return _load_policy(cfg, path, device), task


def build_policy(cfg: DiffusionTrainConfig) -> DiffusionPolicy:
    """The policy alone: `export` draws nothing, so it needs not the task's prompt files (a run
    copied to another machine without them) nor its image atoms' models."""
    return _load_policy(cfg, *_settings(cfg))


def _settings(cfg: DiffusionTrainConfig):
    """(the model's directory, the device), checked before any loading, with build's notices."""
    device = model_device(cfg.model.device)  # a GPU asked for and absent is a ConfigError now
    path = resolve_settings(cfg)
    if cfg.model.trust_remote_code:  # say so: the flag does nothing here (security row of docs/errors.md)
        print(f"notice: model.trust_remote_code has no effect for diffusion pipelines: only diffusers and "
              f"transformers classes are loaded, never Python code from {path}", file=sys.stderr, flush=True)
    return path, device


def _load_policy(cfg: DiffusionTrainConfig, path: Path, device) -> DiffusionPolicy:
    import diffusion_rl.methods  # noqa: F401  (registers flow_grpo)
    from diffusion_rl.models import ImageSizeError, load_flow_model

    m = cfg.model
    try:
        flow = load_flow_model(path, dtype=m.dtype, height=m.height, width=m.width,
                               guidance_scale=m.guidance_scale, distilled_guidance=m.distilled_guidance,
                               device=device)  # transformer, VAE, text encoders
    except ImageSizeError as e:
        raise ConfigError(f"model.height / model.width: {e}") from e
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path: cannot load {path}: {e}") from e
    if m.distilled_guidance is not None and not flow.transformer.config.get("guidance_embeds", False):
        warnings.warn(f"model.distilled_guidance {m.distilled_guidance} is unused: the transformer in {path} has "
                      "no guidance embedding (config guidance_embeds); model.guidance_scale is classifier-free "
                      "guidance", stacklevel=2)
    from diffusion_rl.calibrate import MODEL_WINDOW_FILE

    flow.carried_files.append(path / MODEL_WINDOW_FILE)  # checkpoints keep the model's calibrated window
    if cfg.method.type == "cast" and cfg.method.projection == "attention":
        from diffusion_rl.attention_maps import FAMILIES, TextAttention

        if flow.family not in FAMILIES:
            raise ConfigError(f"method.projection=attention: CAST's attention maps support the {' and '.join(FAMILIES)} "
                              f"families; {path} is {flow.family!r}; set method.projection: none")
        try:  # checked here, not at the first update after a whole rollout
            TextAttention(flow, cfg.method.attention_layers)
        except ValueError as e:
            raise ConfigError(f"method.attention_layers: {e}") from e
    if m.lora is not None:  # PEFT draws A on the CPU (seeded) and puts it on its base layer's device
        flow.add_lora(m.lora.r, m.lora.alpha, m.lora.target_modules, seed=cfg.seed)
    if m.gradient_checkpointing:
        enable_gradient_checkpointing(flow.transformer)
    return DiffusionPolicy(flow, cfg.rollout)


# `sample --greedy` (the language backends' greedy decode) is refused before the model is built, with this reason
NO_GREEDY = "an image model has no greedy decode; its samples are deterministic ODE draws from seeds 0..n-1 (--num 1: seed 0)"


def sample(cfg: DiffusionTrainConfig, policy: DiffusionPolicy, task: DiffusionTask, prompts: list[str],
           n: int, batch_size: int = 32) -> list[dict]:
    """n images for each prompt (default: the first two distinct held-out prompts), ODE from seeds 0..n-1,
    written to <output_dir>/cli_samples/NNN/ (a new NNN each call, so no call overwrites
    another's images) and scored: the scene-graph verdicts, and where the task has other atoms
    (task.image_atoms, reward.atoms) each of those and the reward's total. Drawn batch_size
    images at a time, as evaluation draws them."""
    from diffusion_rl.tasks.shapes_geneval import ATOM_TYPES, score_image, shorten
    from mmrl.core.rewards import RewardError

    # the first two distinct held-out prompts: the generated ones repeat ("three green circles" is the
    # first two), and a repeat's images are its first's, drawn from the same seeds
    prompts = prompts or list(dict.fromkeys(task.eval_prompts))[:2]
    texts = [p for p in prompts for _ in range(n)]
    seeds = [j for _ in prompts for j in range(n)]
    # in batches: --num 64 of a few prompts in one batch would not fit a GPU at FLUX's sizes
    images = draw(policy, texts, seeds, cfg.rollout.eval_steps or cfg.rollout.num_steps, batch_size)
    root = Path(cfg.output_dir) / "cli_samples"
    root.mkdir(parents=True, exist_ok=True)
    taken = [int(d.name) for d in root.iterdir() if d.is_dir() and d.name.isdigit()]
    out = root / f"{max(taken, default=-1) + 1:03d}"
    out.mkdir()
    extra = task.other_atoms()
    rows = []
    for k, (text, seed, image) in enumerate(zip(texts, seeds, images)):
        path = out / f"{k:03d}_seed{seed}.png"
        image.save(path)
        parsed = True
        try:
            atoms = score_image(image, text)
        except ValueError as e:  # a free-form prompt the shapes grammar does not cover
            parsed = False
            warnings.warn(f"{shorten(text)!r}: no scene-graph verdicts ({e})", stacklevel=2)
            atoms = {}
        if extra:
            try:  # an unparsed prompt scores where task.unparsed=whole_prompt, as in evaluation
                scores = task.reward.score([to_sample(text, image)])  # as training makes it: meta {}, not None
            except RewardError as e:
                if parsed or e.atom not in (*ATOM_TYPES, "all"):
                    raise  # another atom failed (reward.on_error=zero scores it 0), as it would in training
                scores = None  # its shapes atoms refuse it: the warning above said so
            if scores is not None:
                scored = scores.per_sample()[0]
                atoms.update({name: scored[name] for name in extra})
                atoms["reward"] = scores.totals()[0]
        rows.append({"prompt": text, "seed": seed, "image": str(path), **atoms})
    return rows



def calibrate(cfg: DiffusionTrainConfig, out_dir: str | Path | None = None, num_prompts: int | None = None,
              into_model: bool | None = True):
    """CAST's window calibration (diffusion_rl.calibrate) on the first held-out prompts, written
    as window.json into out_dir (default: the run's output_dir) and, with into_model (None: for a
    model.path, not for the bundled model), stored in the model's directory as cast_window.json
    (where CAST finds it by default). Neither
    method.window_from nor a stored window is read (the window is what is being made).
    -> (WindowCalibration, [paths written])."""
    from diffusion_rl.calibrate import calibrate_window, store_in_model, write_window
    from diffusion_rl.tasks.shapes_geneval import can_parse

    if cfg.rollout.window_size is None:
        raise ConfigError("calibrate-window: rollout.window_size must be set (the size of the window to place)")
    if cfg.rollout.window_size >= cfg.rollout.num_steps:
        raise ConfigError("calibrate-window: rollout.window_size must be below rollout.num_steps")
    method = cfg.method
    if getattr(method, "window_from", None) is not None:
        cfg = cfg.model_copy(update={"method": method.model_copy(update={"window_from": None})})
    n = num_prompts or getattr(method, "calibration_prompts", 32)
    seeds = getattr(method, "calibration_seeds", 1)
    policy, task = build(cfg)
    # the atoms are checked on every step's image: only prompts the shapes grammar decomposes say
    # anything (calibrate_window would drop the others, leaving fewer than n, or none)
    prompts = [p for p in task.eval_prompts if can_parse(p)]
    if n > len(prompts):
        unparsed = len(task.eval_prompts) - len(prompts)
        raise ConfigError(f"calibrate-window: {n} calibration prompts asked, but the task holds {len(prompts)} "
                          f"held-out prompts (task.num_eval, or task.eval_path)"
                          + (f" the shapes grammar decomposes ({unparsed} it cannot)" if unparsed else ""))
    cal = calibrate_window(policy, prompts[:n], cfg.rollout.num_steps, cfg.rollout.window_size,
                           seeds=seeds, offset=getattr(method, "window_offset", 0))
    written = [write_window(cal, out_dir if out_dir is not None else cfg.output_dir)]
    if into_model is None:  # the bundled model's files belong to the package: rewritten only on request
        into_model = cfg.model.path is not None
    if into_model:
        written.append(store_in_model(cal, model_dir(cfg)))
    return cal, written
