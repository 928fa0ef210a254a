"""Config of a vision-language run: the core TrainConfig with VLM model, task and rollout sections."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from mmrl.core.config import ModelConfig, RolloutConfig, Section, TrainConfig


class LoRAConfig(Section):
    """Train low-rank adapters (PEFT) instead of every weight."""

    r: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names (of the language model) that get adapters."""


class VLMModelConfig(ModelConfig):
    min_pixels: int = Field(56 * 56, ge=1)
    """Smallest image area after qwen-vl-utils' smart resize (pixels)."""
    max_pixels: int = Field(112 * 112, ge=1)
    """Largest image area after resize; bigger images are scaled down to it."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    lora: LoRAConfig | None = None
    """None = full fine-tuning (the default for the tiny model)."""


class ShapesQATaskConfig(Section):
    """Synthetic images of coloured shapes with questions on counts, colours and positions."""

    type: Literal["shapes-qa"] = "shapes-qa"
    seed: int = 0
    """Seed of the item generator (the run's seed orders the prompts, this one makes them)."""
    num_train: int = Field(2000, ge=1)
    num_eval: int = Field(200, ge=1)
    image_size: int = Field(112, ge=28)
    min_shapes: int = Field(1, ge=1)
    max_shapes: int = Field(2, ge=1)
    shape_size: tuple[int, int] = (36, 48)
    """Smallest and largest shape side in pixels. The bundled tiny model's 28-px vision
    tokens learn to read objects this size quickly; much smaller ones it barely sees."""
    kinds: list[str] | None = None
    """Question kinds to draw from (None = all)."""


class JSONLTaskConfig(Section):
    """Your own data: one JSON object per line with question, answer and image(s)."""

    type: Literal["jsonl"] = "jsonl"
    train_path: str
    eval_path: str
    on_bad_image: Literal["raise", "skip"] = "raise"
    """A missing or corrupt image: stop with an error naming it, or skip the sample with a warning."""


TaskConfig = Annotated[ShapesQATaskConfig | JSONLTaskConfig, Field(discriminator="type")]


class VLMRolloutConfig(RolloutConfig):
    max_new_tokens: int = Field(48, ge=1)
    stop: list[str] = Field(default_factory=list)
    """Stop strings (besides the end-of-turn token)."""
    eval_batch_size: int = Field(64, ge=1)
    """Prompts per greedy decoding batch in held-out evaluation."""
    eval_samples: int = Field(4, ge=0)
    """Completions sampled per held-out item for `sampled_accuracy` (0 = greedy only)."""


class VLMTrainConfig(TrainConfig):
    model: VLMModelConfig = Field(default_factory=VLMModelConfig)
    task: TaskConfig = Field(default_factory=ShapesQATaskConfig)
    rollout: VLMRolloutConfig = Field(default_factory=VLMRolloutConfig)
