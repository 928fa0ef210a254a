"""The flow / diffusion backend as the CLI and the loop see it (mmrl.core.cli).

    CONFIG_CLASS    DiffusionTrainConfig
    DEFAULT_CONFIG  the main job: the bundled tiny flow model, shapes-geneval, Flow-GRPO, on a CPU
    build(cfg)      -> (DiffusionPolicy, DiffusionTask)
    sample(...)     -> images written as PNG, scored by the task's atoms (`diffusion-rl sample`)
"""

from __future__ import annotations

import warnings
from pathlib import Path

from diffusion_rl.config import DiffusionTrainConfig
from diffusion_rl.policy import DiffusionPolicy
from diffusion_rl.task import DiffusionTask
from mmrl.core.config import ConfigError
from mmrl.core.rewards import Reward

CONFIG_CLASS = DiffusionTrainConfig
DEFAULT_CONFIG = {
    "output_dir": "runs/diffusion-default",
    "method": {"type": "flow_grpo"},
    "rollout": {"num_generations": 8, "prompts_per_step": 4, "num_steps": 10, "window_size": 4,
                "noise_level": 0.7},
    "optim": {"lr": 1e-4, "max_grad_norm": 1.0},
    "train": {"max_steps": 100, "log_samples_every": 0},
    "task": {"type": "shapes-geneval", "num_train": 2000, "num_eval": 64},
}


def bundled_model_dir() -> Path:
    return Path(__file__).resolve().parents[1] / "assets" / "tiny-flow"


def build_task(cfg: DiffusionTrainConfig) -> DiffusionTask:
    from diffusion_rl.tasks.shapes_geneval import reward_atoms, sample_prompts

    t = cfg.task
    base = Path(cfg.base_dir) if cfg.base_dir else Path.cwd()
    train = _prompt_file(t.train_path, base, "train_path") or sample_prompts(t.num_train, t.seed, split="train")
    evaluation = _prompt_file(t.eval_path, base, "eval_path") or sample_prompts(t.num_eval, t.seed, split="eval")
    atoms = list(reward_atoms())
    if t.image_atoms:
        from diffusion_rl.rewards import build_image_reward_atoms

        try:
            atoms += build_image_reward_atoms(t.image_atoms)
        except ValueError as e:
            raise ConfigError(f"task.image_atoms: {e}") from e
    return DiffusionTask(t.type, train, evaluation, Reward(atoms), eval_seeds=t.eval_seeds,
                         eval_steps=cfg.rollout.eval_steps or cfg.rollout.num_steps, grid_prompts=t.grid_prompts)


def _prompt_file(path: str | None, base: Path, key: str) -> list[str] | None:
    """Prompts from a text file, one per line (blank lines and # comments skipped), each
    checked by the shapes-geneval parser."""
    from diffusion_rl.tasks.shapes_geneval import parse_prompt

    if path is None:
        return None
    file = Path(path) if Path(path).is_absolute() else base / path
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"task.{key}: cannot read {file}: {e.strerror or e}") from e
    prompts = []
    for n, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            parse_prompt(text)
        except ValueError as e:
            raise ConfigError(f"task.{key}: {file}, line {n} ({text!r}): {e}") from e
        prompts.append(text)
    if not prompts:
        raise ConfigError(f"task.{key}: {file} holds no prompts")
    return prompts


def build(cfg: DiffusionTrainConfig):
    import diffusion_rl.methods  # noqa: F401  (registers flow_grpo)
    from diffusion_rl.models import load_flow_model

    m = cfg.model
    path = Path(m.path) if m.path else bundled_model_dir()
    if not path.is_dir():
        raise ConfigError(f"model.path: {path} is not a directory (a diffusers pipeline directory is expected)")
    try:
        flow = load_flow_model(path, dtype=m.dtype, height=m.height, width=m.width,
                               guidance_scale=m.guidance_scale)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path: cannot load {path}: {e}") from e
    if m.lora is not None:
        flow.add_lora(m.lora.r, m.lora.alpha, m.lora.target_modules)
    return DiffusionPolicy(flow, cfg.rollout), build_task(cfg)


def sample(cfg: DiffusionTrainConfig, policy: DiffusionPolicy, task: DiffusionTask, prompts: list[str],
           n: int) -> list[dict]:
    """n images for each prompt (default: the first held-out prompts), ODE from seeds 0..n-1,
    written to <output_dir>/cli_samples/ and scored."""
    from diffusion_rl.tasks.shapes_geneval import score_image

    prompts = prompts or task.eval_prompts[:2]
    texts = [p for p in prompts for _ in range(n)]
    seeds = [j for _ in prompts for j in range(n)]
    images = policy.sample_images(texts, seeds, cfg.rollout.eval_steps or cfg.rollout.num_steps)
    out = Path(cfg.output_dir) / "cli_samples"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for k, (text, seed, image) in enumerate(zip(texts, seeds, images)):
        path = out / f"{k:03d}_seed{seed}.png"
        image.save(path)
        try:
            atoms = score_image(image, text)
        except ValueError as e:  # a free-form prompt the shapes grammar does not cover
            warnings.warn(f"{text!r}: not scored ({e})", stacklevel=2)
            atoms = {}
        rows.append({"prompt": text, "seed": seed, "image": str(path), **atoms})
    return rows

