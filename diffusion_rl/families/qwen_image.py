"""Qwen-Image (QwenImagePipeline): `QwenImageFlowModel`. Layout, conditioning and decoding:
diffusion_rl/models.py's docstring."""

from __future__ import annotations

import torch

from diffusion_rl.flow_model import FlowModel, _bare_pipeline, pack, unpack
from mmrl.core.config import ConfigError


class QwenImageFlowModel(FlowModel):
    """Qwen-Image: the last hidden layer of Qwen2.5-VL on the pipeline's prompt template, template
    tokens dropped; a video VAE used on one frame."""

    family = "qwen_image"
    default_distilled_guidance = 1.0  # only used by a guidance_embeds transformer

    def _setup(self) -> None:
        self.tokenizer, self.text_encoder = (
            self.components["tokenizer"],
            self.components["text_encoder"],
        )
        bare = _bare_pipeline("qwen_image")
        self.template = bare.prompt_template_encode
        self.tokenizer_max_length = bare.tokenizer_max_length
        # The pipeline hard-codes the number of template tokens for the real tokenizer (34);
        # count them with this tokenizer instead (equal for the real one).
        prefix = self.template.split("{}")[0]
        self.drop_idx = len(self.tokenizer(prefix).input_ids)
        # __call__'s default max_sequence_length is 512; tiny tokenizers are shorter
        self.max_sequence_length = min(512, self.tokenizer.model_max_length - self.drop_idx)
        if self.max_sequence_length < 1:
            raise ConfigError(
                f"tokenizer model_max_length {self.tokenizer.model_max_length} leaves no room for a prompt"
            )

    @property
    def token_unit(self) -> int:
        return 2 * 2 ** len(self.vae.temperal_downsample)  # the pipeline's vae_scale_factor x 2

    def _encode(self, prompts):
        dev = self.device
        texts = [self.template.format(p) for p in prompts]
        self._warn_cut(self.tokenizer, texts, self.tokenizer_max_length + self.drop_idx, "text encoder")
        tok = self.tokenizer(
            texts,
            max_length=self.tokenizer_max_length + self.drop_idx,
            padding=True,
            truncation=True,
            return_tensors="pt",
        ).to(dev)
        hidden = self.text_encoder(
            input_ids=tok.input_ids, attention_mask=tok.attention_mask, output_hidden_states=True
        ).hidden_states[-1]
        s = self.max_sequence_length
        embeds = hidden.new_zeros(len(prompts), s, hidden.shape[-1])
        mask = torch.zeros(len(prompts), s, dtype=torch.long, device=dev)
        for i in range(len(prompts)):
            row = hidden[i][tok.attention_mask[i].bool()][self.drop_idx :][:s]
            embeds[i, : len(row)] = row
            mask[i, : len(row)] = 1
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def _draw(self, n, generator):
        c = self.channels // 4
        z = self._randn((n, 1, c, 2 * self.grid[0], 2 * self.grid[1]), generator)
        return pack(z[:, 0], 2)

    def _forward(self, x, sigma, cond):
        mask = cond["prompt_embeds_mask"].to(self.device)
        used = mask.any(dim=0).nonzero()
        keep = int(used.max()) + 1 if len(used) else 1  # drop the all-padding tail
        mask = mask[:, :keep]
        return self.transformer(
            hidden_states=x,
            timestep=sigma.to(self.dtype),
            guidance=self._guidance(x.shape[0]),
            encoder_hidden_states=self._cast(cond["prompt_embeds"][:, :keep]),
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            img_shapes=[[(1, *self.grid)]] * x.shape[0],
            return_dict=False,
        )[0]

    def _combine_cfg(self, v_cond, v_uncond):
        v = super()._combine_cfg(v_cond, v_uncond)
        # QwenImagePipeline: rescale each token's prediction to the conditional one's norm
        return v * (v_cond.norm(dim=-1, keepdim=True) / v.norm(dim=-1, keepdim=True))

    def _to_image(self, latents):
        cfg = self.vae.config
        z = unpack(latents, 2 * self.grid[0], 2 * self.grid[1], 2)[:, :, None].to(self.vae.dtype)
        mean = torch.tensor(cfg.latents_mean, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
        std = torch.tensor(cfg.latents_std, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
        return self.vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
