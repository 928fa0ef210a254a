"""model.lora's settings (LoRAConfig), apart from mmrl.core.lora: that imports torch and PEFT,
seconds that `config` and the VLM and dLLM config classes, which take this section, need not
wait for (tests/test_cli_imports.py). mmrl.core.lora re-exports it."""

from __future__ import annotations

from pydantic import Field, field_validator

from mmrl.core.config import Section


class LoRAConfig(Section):
    """Train low-rank adapters (PEFT) instead of every weight."""

    r: int = Field(8, ge=1)
    """Rank of each adapter's low-rank update."""
    alpha: float = Field(16.0, gt=0)
    """LoRA's scale: the adapter's update is multiplied by alpha / r."""
    dropout: float = Field(0.0, ge=0)
    """Must stay 0: every forward, the update's included, runs with dropout off, so that the
    importance ratio is exactly 1 on-policy; a LoRA dropout would never run."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Names of the linear layers that get adapters: each matches every layer whose name ends with
    it (`q_proj`, every layer's; `layers.0.self_attn.q_proj`, one), not as a regular expression.
    In a VLM a name its vision encoder shares (gate_proj, up_proj, down_proj) adapts that too
    (model.freeze_vision keeps those adapters fixed)."""

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, value: list[str]) -> list[str]:
        if not value:  # PEFT's own message speaks of target_parameters, which are not ours
            raise ValueError("an empty list gives no layer an adapter; name the linear layers to adapt, "
                             "e.g. [q_proj, k_proj, v_proj, o_proj]")
        return value

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, value: float) -> float:
        if value:
            raise ValueError("training forwards run with dropout off (the importance ratio "
                             "is exactly 1 on-policy), so a LoRA dropout would never run; set it to 0")
        return value
