"""FLUX.1 (FluxPipeline): `FluxFlowModel`, latent or pixel space. Layout, conditioning and
decoding: diffusion_rl/models.py's docstring."""

from __future__ import annotations

import torch
from torch import Tensor

from diffusion_rl.flow_model import FlowModel, pack, unpack
from mmrl.core.config import ConfigError


def _flux_img_ids(h: int, w: int, device) -> Tensor:
    """FLUX's latent image ids on an h x w token grid: (0, row, col) per token, [h w, 3]."""
    ids = torch.zeros(h, w, 3, device=device)
    ids[..., 1] = torch.arange(h, device=device)[:, None]
    ids[..., 2] = torch.arange(w, device=device)[None, :]
    return ids.reshape(h * w, 3)


class FluxFlowModel(FlowModel):
    """FLUX.1: CLIP pooled + T5 sequence; 2x2-packed latents; or pixel space (see the module
    docstring of diffusion_rl/models.py)."""

    family = "flux"
    default_distilled_guidance = 3.5  # FluxPipeline.__call__'s guidance_scale

    def _setup(self) -> None:
        c = self.components
        self.tokenizer, self.text_encoder = c["tokenizer"], c["text_encoder"]
        self.tokenizer_2, self.text_encoder_2 = c["tokenizer_2"], c["text_encoder_2"]
        self.clip_length = self.tokenizer.model_max_length  # the pipeline's tokenizer_max_length
        # the pipeline's default max_sequence_length is 512; tiny tokenizers are shorter
        self.max_sequence_length = min(512, self.tokenizer_2.model_max_length)
        if self.pixel_space:
            want = 3 * self.pixel_patch**2
            if self.channels != want:
                raise ConfigError(
                    f"pixel-space FLUX with patch_size {self.pixel_patch} needs a transformer with "
                    f"in_channels = 3 x {self.pixel_patch}^2 = {want}, not {self.channels}"
                )
        self._img_ids: Tensor | None = None

    @property
    def token_unit(self) -> int:
        return self.pixel_patch if self.pixel_space else 2 * self._vae_scale()

    def _encode(self, prompts: list[str]) -> dict[str, Tensor]:
        dev = self.device
        self._warn_cut(self.tokenizer, prompts, self.clip_length, "CLIP text encoder")
        self._warn_cut(self.tokenizer_2, prompts, self.max_sequence_length, "T5 text encoder")
        ids = self.tokenizer(
            prompts,
            padding="max_length",
            max_length=self.clip_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        pooled = self.text_encoder(ids.to(dev), output_hidden_states=False).pooler_output
        ids_2 = self.tokenizer_2(
            prompts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
            return_tensors="pt",
        ).input_ids  # fmt: skip
        embeds = self.text_encoder_2(ids_2.to(dev), output_hidden_states=False)[0]
        text_ids = torch.zeros(len(prompts), embeds.shape[1], 3, device=dev)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled, "text_ids": text_ids}

    def _draw(self, n, generator):
        if self.pixel_space:
            return pack(self._randn((n, 3, self.height, self.width), generator), self.pixel_patch)
        c = self.channels // 4
        return pack(self._randn((n, c, 2 * self.grid[0], 2 * self.grid[1]), generator), 2)

    def _forward(self, x, sigma, cond):
        if self._img_ids is None:
            self._img_ids = _flux_img_ids(*self.grid, self.device)
        return self.transformer(
            hidden_states=x,
            timestep=sigma.to(self.dtype),
            guidance=self._guidance(x.shape[0]),
            pooled_projections=self._cast(cond["pooled_prompt_embeds"]),
            encoder_hidden_states=self._cast(cond["prompt_embeds"]),
            txt_ids=cond["text_ids"][0].to(self.device),
            img_ids=self._img_ids,
            return_dict=False,
        )[0]

    def _from_image(self, images):
        if self.pixel_space:
            return pack(images.float(), self.pixel_patch)
        c = self.vae.config
        z = self.vae.encode(images).latent_dist.mean
        return pack((z.float() - c.shift_factor) * c.scaling_factor, 2)

    def _to_image(self, latents):
        if self.pixel_space:
            return unpack(latents.float(), self.height, self.width, self.pixel_patch)
        z = unpack(latents, 2 * self.grid[0], 2 * self.grid[1], 2).to(self.vae.dtype)
        z = z / self.vae.config.scaling_factor + self.vae.config.shift_factor
        return self.vae.decode(z, return_dict=False)[0]
