"""SD3 / SD3.5 (StableDiffusion3Pipeline): `SD3FlowModel`. Layout, conditioning and decoding:
diffusion_rl/models.py's docstring."""

from __future__ import annotations

import torch

from diffusion_rl.flow_model import FlowModel, ImageSizeError, pack, unpack


class SD3FlowModel(FlowModel):
    """SD3 / SD3.5: CLIP-L + CLIP-G (+ optional T5); the transformer patchifies itself, so the
    packed tokens are unpacked around each forward."""

    family = "sd3"

    def _setup(self) -> None:
        c = self.components
        self.clip = [(c["tokenizer"], c["text_encoder"]), (c["tokenizer_2"], c["text_encoder_2"])]
        self.tokenizer_3, self.text_encoder_3 = c.get("tokenizer_3"), c.get("text_encoder_3")
        self.clip_length = c["tokenizer"].model_max_length
        self.max_sequence_length = (
            256 if self.tokenizer_3 is None else min(256, self.tokenizer_3.model_max_length)
        )
        self.patch = self.transformer.config.patch_size

    @property
    def token_unit(self) -> int:
        return self.patch * self._vae_scale()

    def _check_grid(self) -> None:
        # SD3's learned position embedding is cropped from a pos_embed_max_size square: a larger
        # grid failed at the first forward, a diffusers traceback after the whole load
        most = self.transformer.config.get("pos_embed_max_size")
        if most is not None and max(self.grid) > most:
            side = most * self.token_unit
            raise ImageSizeError(
                f"height x width = {self.height} x {self.width} exceeds this sd3 model's largest side, {side} px "
                f"(its transformer's pos_embed_max_size {most} x {self.token_unit} px per token)"
            )

    @property
    def channels(self) -> int:
        return self.transformer.config.in_channels * self.patch**2

    def _encode(self, prompts):
        dev = self.device
        hidden, pooled = [], []
        for tokenizer, encoder in self.clip:
            self._warn_cut(tokenizer, prompts, self.clip_length, "CLIP text encoder")
            ids = tokenizer(
                prompts,
                padding="max_length",
                max_length=self.clip_length,
                truncation=True,
                return_tensors="pt",
            ).input_ids
            out = encoder(ids.to(dev), output_hidden_states=True)
            pooled.append(out[0])  # text_embeds (projected pooled output)
            hidden.append(out.hidden_states[-2])  # penultimate layer (clip_skip None)
        clip_embeds = torch.cat(hidden, dim=-1)
        if self.text_encoder_3 is None:
            t5 = torch.zeros(
                len(prompts), self.max_sequence_length, self.transformer.config.joint_attention_dim,
                device=dev, dtype=clip_embeds.dtype,
            )  # fmt: skip
        else:
            self._warn_cut(self.tokenizer_3, prompts, self.max_sequence_length, "T5 text encoder")
            ids = self.tokenizer_3(
                prompts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                add_special_tokens=True, return_tensors="pt",
            ).input_ids  # fmt: skip
            t5 = self.text_encoder_3(ids.to(dev))[0]
        clip_embeds = torch.nn.functional.pad(
            clip_embeds, (0, t5.shape[-1] - clip_embeds.shape[-1])
        )
        embeds = torch.cat([clip_embeds.to(t5.dtype), t5], dim=-2)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": torch.cat(pooled, dim=-1)}

    def _latent_hw(self) -> tuple[int, int]:
        return self.grid[0] * self.patch, self.grid[1] * self.patch

    def _draw(self, n, generator):
        c = self.transformer.config.in_channels
        return pack(self._randn((n, c, *self._latent_hw()), generator), self.patch)

    def _forward(self, x, sigma, cond):
        z = unpack(x, *self._latent_hw(), self.patch)
        out = self.transformer(
            hidden_states=z,
            timestep=sigma * 1000,  # the scheduler's timesteps, float32
            encoder_hidden_states=self._cast(cond["prompt_embeds"]),
            pooled_projections=self._cast(cond["pooled_prompt_embeds"]),
            return_dict=False,
        )[0]
        return pack(out, self.patch)

    def _to_image(self, latents):
        z = unpack(latents, *self._latent_hw(), self.patch).to(self.vae.dtype)
        z = z / self.vae.config.scaling_factor + self.vae.config.shift_factor
        return self.vae.decode(z, return_dict=False)[0]
