"""FLUX.2 (Flux2Pipeline): `Flux2FlowModel`. Layout, conditioning and decoding:
diffusion_rl/models.py's docstring."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from diffusion_rl.flow_model import FlowModel, _bare_pipeline
from mmrl.core.config import ConfigError


class Flux2FlowModel(FlowModel):
    """FLUX.2: Mistral3 hidden states 10/20/30 on the pipeline's chat prompt; 4-axis position
    ids; latents patchified 2x2 and batch-normalised by the VAE's running statistics."""

    family = "flux2"
    default_distilled_guidance = 4.0  # Flux2Pipeline.__call__'s guidance_scale
    text_encoder_out_layers = (10, 20, 30)  # Flux2Pipeline.encode_prompt's default

    def _setup(self) -> None:
        self.processor, self.text_encoder = (
            self.components["tokenizer"],
            self.components["text_encoder"],
        )
        bare = _bare_pipeline("flux2")
        self.system_message = bare.system_message
        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.max_sequence_length = min(bare.tokenizer_max_length, tokenizer.model_max_length)  # 512
        layers = self.text_encoder.config.get_text_config().num_hidden_layers
        if max(self.text_encoder_out_layers) > layers:
            raise ConfigError(
                f"FLUX.2 reads text-encoder hidden states {self.text_encoder_out_layers}, but the text "
                f"encoder has only {layers} layers"
            )
        self._img_ids: Tensor | None = None

    @property
    def token_unit(self) -> int:
        return 2 * self._vae_scale()

    def _lora_targets(self, targets):
        # FLUX.2's single-stream blocks (48 of FLUX.2-dev's 56) have no to_q / to_k / to_v: they
        # fuse q, k, v and the MLP's input into attn.to_qkv_mlp_proj, so those names left every
        # one of them without an adapter. FLUX.1's single blocks have to_q / to_k / to_v.
        fused = "to_qkv_mlp_proj"
        if fused in targets or not {"to_q", "to_k", "to_v"} & set(targets):
            return targets
        blocks = len(self.transformer.single_transformer_blocks)
        warnings.warn(f"LoRA target_modules {targets}: FLUX.2's {blocks} single-stream block(s) fuse q, k, v "
                      f"(and the MLP's input) into attn.{fused}, which gets adapters too; name the "
                      "double-stream layers alone (attn.to_q, ...) to leave those blocks without",
                      stacklevel=3)
        return [*targets, fused]

    def _encode(self, prompts):
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input

        dev = self.device
        inputs = self.processor.apply_chat_template(
            format_input(prompts=prompts, system_message=self.system_message),
            add_generation_prompt=False,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            processor_kwargs={
                "padding": "max_length",
                "truncation": True,
                "max_length": self.max_sequence_length,
            },
        )
        out = self.text_encoder(
            input_ids=inputs["input_ids"].to(dev),
            attention_mask=inputs["attention_mask"].to(dev),
            output_hidden_states=True,
            use_cache=False,
        )
        stacked = torch.stack([out.hidden_states[k] for k in self.text_encoder_out_layers], dim=1)
        n, k, s, d = stacked.shape
        embeds = stacked.permute(0, 2, 1, 3).reshape(n, s, k * d)
        zero = torch.arange(1, device=dev)
        text_ids = torch.cartesian_prod(zero, zero, zero, torch.arange(s, device=dev))  # (t, h, w, l)
        return {"prompt_embeds": embeds, "text_ids": text_ids.expand(n, s, 4).clone()}

    def _draw(self, n, generator):
        z = self._randn((n, self.channels, *self.grid), generator)  # patchified latent shape
        return z.flatten(2).transpose(1, 2)

    def _forward(self, x, sigma, cond):
        if self._img_ids is None:
            zero = torch.arange(1, device=self.device)
            h, w = self.grid
            self._img_ids = torch.cartesian_prod(
                zero, torch.arange(h, device=self.device), torch.arange(w, device=self.device), zero
            )
        out = self.transformer(
            hidden_states=x,
            timestep=sigma.to(self.dtype),
            guidance=self._guidance(x.shape[0]),
            encoder_hidden_states=self._cast(cond["prompt_embeds"]),
            txt_ids=cond["text_ids"][0].to(self.device),
            img_ids=self._img_ids,
            return_dict=False,
        )[0]
        return out[:, : x.shape[1]]

    def _to_image(self, latents):
        n, _, c4 = latents.shape
        h, w = self.grid
        z = latents.transpose(1, 2).reshape(n, c4, h, w).to(self.vae.dtype)
        bn = self.vae.bn
        z = z * torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps)
        z = z + bn.running_mean.view(1, -1, 1, 1)
        c = c4 // 4  # un-patchify: (C, 2, 2) channels -> 2x2 pixels
        z = z.reshape(n, c, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(n, c, 2 * h, 2 * w)
        return self.vae.decode(z, return_dict=False)[0]
