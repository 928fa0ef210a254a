"""`FlowModel`, the base class of the flow-matching model adapters, and what it and the family
subclasses (diffusion_rl/families/) share: the pipeline classes (`FAMILIES`), FLUX's patch
packing (`pack`, `unpack`), `pil_to_tensor`, the default LoRA targets and `ImageSizeError`.

The conventions it implements (packed latents, conditioning keys, guidance, pixel space, what
trains) are described in diffusion_rl/models.py's docstring; build a model with
`diffusion_rl.models.load_flow_model`, which re-exports every name here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

from mmrl.core.config import ConfigError
from mmrl.core.lora import check_adapter_config, seeded, target_modules_error

FAMILIES = {
    "FluxPipeline": "flux",
    "Flux2Pipeline": "flux2",
    "StableDiffusion3Pipeline": "sd3",
    "QwenImagePipeline": "qwen_image",
}
# Flow-GRPO's LoRA targets: every attention projection of both streams.
DEFAULT_LORA_TARGETS = (
    "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
)  # fmt: skip
_ADAPTER = "default"


def pil_to_tensor(images) -> Tensor:
    """RGB (or convertible) PIL images of one size -> float [N, 3, H, W] in [-1, 1]: what
    `FlowModel.encode_images` takes, the inverse of `decode`'s PIL output."""
    import numpy as np

    a = np.stack([np.asarray(im.convert("RGB"), dtype=np.float32) for im in images])  # [N, H, W, 3]
    return torch.from_numpy(a).permute(0, 3, 1, 2) / 127.5 - 1.0


def pack(x: Tensor, p: int) -> Tensor:
    """[N, C, H, W] -> [N, (H/p)(W/p), C p^2]: FLUX's patch packing (tokens row-major over the
    patch grid; within a token, channel-major then the p x p pixels row-major)."""
    n, c, h, w = x.shape
    if h % p or w % p:
        raise ValueError(f"cannot pack a {h}x{w} grid into {p}x{p} patches")
    x = x.reshape(n, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(n, (h // p) * (w // p), c * p * p)


def unpack(tokens: Tensor, height: int, width: int, p: int) -> Tensor:
    """Inverse of `pack`: [N, (H/p)(W/p), C p^2] -> [N, C, H, W] (height, width = H, W)."""
    n, length, d = tokens.shape
    if length != (height // p) * (width // p) or d % (p * p):
        raise ValueError(
            f"{tuple(tokens.shape)} tokens do not unpack to {height}x{width} in {p}x{p} patches"
        )
    x = tokens.reshape(n, height // p, width // p, d // (p * p), p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(n, d // (p * p), height, width)


def _bare_pipeline(family: str):
    """The family's pipeline with no components: the source of its prompt templates and
    lengths, read rather than copied."""
    import diffusers

    cls = getattr(diffusers, _class_of(family))
    names = [k for k in cls._get_signature_keys(cls)[0]]
    return cls(**{k: None for k in names})


def _class_of(family: str) -> str:
    return next(k for k, v in FAMILIES.items() if v == family)


class ImageSizeError(ConfigError):
    """An image height or width the model cannot draw (not a multiple of its pixels per token):
    the config's model.height / model.width, not its model.path, are at fault."""


class FlowModel:
    """A flow-matching text-to-image model: frozen text encoders and VAE around a trainable
    transformer. Build one with `load_flow_model`; the family subclasses differ only in
    prompt encoding, latent layout, the transformer call and decoding (diffusion_rl/families/;
    the conventions: diffusion_rl/models.py's docstring)."""

    family: str = ""
    default_distilled_guidance: float | None = None

    def __init__(
        self,
        components: dict,
        *,
        height: int,
        width: int,
        guidance_scale: float = 1.0,
        distilled_guidance: float | None = None,
        pixel_space: dict | None = None,
        device: str | torch.device = "cpu",
    ):
        self.components = components  # name -> loaded object, None for [null, null] entries
        self.carried_files: list[Path] = []  # files of the source directory that save_pretrained copies
        self._measured: set[tuple[str, str]] = set()  # (encoder, prompt) lengths _warn_cut has checked
        self._warned_cut = False
        self.transformer = components["transformer"]
        self.scheduler = components["scheduler"]
        self.vae = components.get("vae")
        self.pixel_space = pixel_space is not None
        self.pixel_patch = int(pixel_space["patch_size"]) if pixel_space else None
        self.prediction = (pixel_space or {}).get("prediction", "velocity")
        self.evaluations = 0  # transformer rows run by `velocity` (2 per sample under CFG): compute spent
        self._evaluations_lock = threading.Lock()  # a pipelined engine's copy charges rows from its thread
        if self.prediction not in ("velocity", "sample"):
            raise ConfigError(f"pixel_space.json: prediction must be 'velocity' or 'sample', not {self.prediction!r}")
        self.height, self.width = int(height), int(width)
        if guidance_scale < 1.0:
            raise ConfigError(f"guidance_scale must be >= 1 (1 = no CFG), got {guidance_scale}")
        self.guidance_scale = float(guidance_scale)
        self.distilled_guidance = (
            self.default_distilled_guidance
            if distilled_guidance is None
            else float(distilled_guidance)
        )
        self.device = torch.device(device)
        for name, comp in components.items():
            if isinstance(comp, torch.nn.Module):
                comp.to(self.device)
                if name != "transformer":
                    comp.requires_grad_(False)
                comp.eval()
        self.transformer.requires_grad_(True)
        self._setup()
        unit = self.token_unit
        if self.height % unit or self.width % unit or self.height <= 0 or self.width <= 0:
            raise ImageSizeError(
                f"height x width = {self.height} x {self.width} must be positive multiples of {unit} "
                f"for this {self.family} model (VAE factor x patch size)"
            )
        self.grid = (self.height // unit, self.width // unit)  # image-token grid
        self.seq_len = self.grid[0] * self.grid[1]
        self._check_grid()

    def _warn_cut(self, tokenizer, texts: list[str], max_length: int, what: str) -> None:
        """Say once per model where a prompt is longer than an encoder reads (it is cut there,
        as the diffusers pipelines cut it); each prompt is measured once. (FLUX.2's chat
        template is not measured.)"""
        fresh = [t for t in dict.fromkeys(texts) if (what, t) not in self._measured]
        self._measured.update((what, t) for t in fresh)
        # verbose=False: the tokenizer would add that running such a sequence "will result in indexing
        # errors", which it will not (the encoders get it cut)
        long = [t for t in fresh if len(tokenizer(t, truncation=False, verbose=False).input_ids) > max_length]
        if long and not self._warned_cut:
            self._warned_cut = True
            warnings.warn(f"a prompt is longer than the {what}'s {max_length} tokens and is cut there "
                          f"(said once per model): {long[0][:120]!r}", stacklevel=3)

    # ------------------------------------------------------------------ family hooks

    def _setup(self) -> None:
        """Family-specific checks and constants (after the components are placed)."""

    @property
    def token_unit(self) -> int:
        """Pixels per image token along each side."""
        raise NotImplementedError

    def _check_grid(self) -> None:
        """Refuse (ImageSizeError) a token grid the transformer cannot take."""

    def _encode(self, prompts: list[str]) -> dict[str, Tensor]:
        raise NotImplementedError

    def _draw(self, n: int, generator: torch.Generator | None) -> Tensor:
        raise NotImplementedError

    def _forward(self, x: Tensor, sigma: Tensor, cond: dict[str, Tensor]) -> Tensor:
        raise NotImplementedError

    def _to_image(self, latents: Tensor) -> Tensor:
        """Packed latents -> images [N, 3, H, W] in (about) [-1, 1]."""
        raise NotImplementedError

    # ------------------------------------------------------------------ public API

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def channels(self) -> int:
        """C of the packed [N, L, C] latents."""
        return self.transformer.config.in_channels

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str] | str) -> dict[str, Tensor]:
        """Everything the transformer needs besides latents and time, one row per prompt (keys:
        diffusion_rl/models.py's docstring); with guidance_scale > 1 also the empty prompt's under
        "neg/..."."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts:
            raise ValueError("encode_prompt needs at least one prompt")
        cond = self._encode(prompts)
        if self.guidance_scale > 1.0:
            neg = self._encode([""])
            cond.update(
                {f"neg/{k}": v.expand(len(prompts), *v.shape[1:]).clone() for k, v in neg.items()}
            )
        return cond

    def noise(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """Initial latents (sigma = 1), [n, seq_len, channels] float32 on `device`, drawn on the
        generator's device in the pipeline's own latent shape, then packed. (A CPU generator, the
        trainer's and evaluation's, draws the same latents whatever `device` is.)"""
        return self._draw(n, generator).float().to(self.device)

    def charge(self, rows: int) -> None:
        """Add transformer rows to `evaluations` (thread-safe: copies share the lock)."""
        with self._evaluations_lock:
            self.evaluations += rows

    def velocity(self, latents: Tensor, sigma: Tensor | float, cond: dict[str, Tensor]) -> Tensor:
        """One transformer forward (two rows per sample with CFG) -> v [N, L, C] float32.
        Differentiable w.r.t. the transformer's parameters; computed in its dtype."""
        n = latents.shape[0]
        x = latents.to(self.device, self.dtype)
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device)
        sigma = sigma.expand(n) if sigma.ndim == 0 else sigma.reshape(n)
        pos = {k: v for k, v in cond.items() if not k.startswith("neg/")}
        self.charge(n if self.guidance_scale <= 1.0 else 2 * n)
        if self.guidance_scale <= 1.0:
            return self._as_velocity(self._forward(x, sigma, self._rows(pos, n)).float(), x, sigma)
        neg = {k[4:]: v for k, v in cond.items() if k.startswith("neg/")}
        if set(neg) != set(pos):
            raise KeyError(
                f"guidance_scale={self.guidance_scale} needs the negative conditioning ('neg/' keys) "
                "from encode_prompt of a model with the same guidance_scale"
            )
        both = {k: torch.cat([self._rows(pos, n)[k], self._rows(neg, n)[k]]) for k in pos}
        out = self._forward(torch.cat([x, x]), torch.cat([sigma, sigma]), both).float()
        v_cond, v_uncond = self._as_velocity(out, torch.cat([x, x]), torch.cat([sigma, sigma])).chunk(2)
        return self._combine_cfg(v_cond, v_uncond)

    def _as_velocity(self, out: Tensor, x: Tensor, sigma: Tensor) -> Tensor:
        if self.prediction == "velocity":
            return out
        return (x.float() - out) / sigma.float().clamp(min=0.05).reshape(-1, 1, 1)

    def _combine_cfg(self, v_cond: Tensor, v_uncond: Tensor) -> Tensor:
        return v_uncond + self.guidance_scale * (v_cond - v_uncond)

    @torch.no_grad()
    def decode(self, latents: Tensor, output_type: str = "pil"):
        """Packed latents -> RGB PIL images (output_type "pil") or a float tensor [N, 3, H, W]
        in [0, 1] ("pt"), postprocessed as diffusers' VaeImageProcessor does."""
        images = self._to_image(latents.to(self.device)).float()
        images = (images / 2 + 0.5).clamp(0, 1)
        if output_type == "pt":
            return images
        if output_type != "pil":
            raise ValueError(f"output_type must be 'pil' or 'pt', not {output_type!r}")
        from PIL import Image

        arr = (images.permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype("uint8")
        return [Image.fromarray(a) for a in arr]

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        """Images [N, 3, H, W] in [-1, 1] -> packed clean latents, the inverse of `decode` (the
        VAE posterior's mean under the pipeline's scale and shift; pixel space: the patches).
        What flow-matching data and teacher-forced probes start from. FLUX family only."""
        return self._from_image(images.to(self.device, self.dtype if self.vae is None else self.vae.dtype))

    def _from_image(self, images: Tensor) -> Tensor:
        raise NotImplementedError(f"encode_images is implemented for the FLUX family, not {self.family!r}")

    # ------------------------------------------------------------------ LoRA

    @property
    def has_lora(self) -> bool:
        return _ADAPTER in (getattr(self.transformer, "peft_config", None) or {})

    def add_lora(
        self,
        r: int = 16,
        alpha: float = 32,
        target_modules: list[str] | tuple[str, ...] | None = None,
        dropout: float = 0.0,
        seed: int = 0,
    ) -> None:
        """PEFT LoRA adapters on the transformer (diffusers' `add_adapter`); afterwards only the
        adapters are trainable. B starts at zero, so the model is unchanged until trained; A is
        drawn from `seed` (the run's). target_modules: module-name suffixes, default
        DEFAULT_LORA_TARGETS (FLUX.2 adds attn.to_qkv_mlp_proj where they name to_q, to_k or
        to_v: its single-stream blocks' fused projection, with a warning)."""
        from peft import LoraConfig

        if self.has_lora:
            raise RuntimeError("this model already has a LoRA adapter")
        config = LoraConfig(
            r=r,
            lora_alpha=alpha,
            lora_dropout=dropout,
            target_modules=self._lora_targets(list(target_modules or DEFAULT_LORA_TARGETS)),
            init_lora_weights=True,
        )
        try:
            with seeded(seed):
                self.transformer.add_adapter(config, adapter_name=_ADAPTER)
        except ValueError as e:  # PEFT: no layer matched, or one LoRA cannot adapt (its whole printout)
            if not any(".lora_" in name for name, _ in self.transformer.named_parameters()):
                # diffusers marks the model as holding adapters before PEFT refuses: unmark it, so that
                # add_lora with other targets works (else an AttributeError on peft_config)
                self.transformer._hf_peft_config_loaded = False
            raise target_modules_error(self.transformer, list(target_modules or DEFAULT_LORA_TARGETS), e) from e
        for name, param in self.transformer.named_parameters():
            param.requires_grad_(".lora_" in name)

    def _lora_targets(self, targets: list[str]) -> list[str]:
        """The module-name suffixes PEFT gets for `targets` (a family whose layers other names
        fuse extends them)."""
        return targets

    @contextlib.contextmanager
    def disable_adapter(self):
        """Within the block the transformer runs with its base weights (the KL reference)."""
        if not self.has_lora:
            raise RuntimeError(
                "disable_adapter needs a LoRA adapter (add_lora); a fully fine-tuned model needs a "
                "separate reference copy"
            )
        self.transformer.disable_adapters()
        try:
            yield self
        finally:
            self.transformer.enable_adapters()

    # ------------------------------------------------------------------ saving / loading

    def save_pretrained(self, path: str | os.PathLike) -> Path:
        """The whole model as a diffusers pipeline directory (model_index.json + every component
        via its own save_pretrained, safetensors; LoRA merged into the transformer weights)."""
        import diffusers

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        index: dict = {
            "_class_name": _class_of(self.family),
            "_diffusers_version": diffusers.__version__,
        }
        for name, comp in sorted(self.components.items()):
            if comp is None:
                index[name] = [None, None]
                continue
            library = type(comp).__module__.split(".")[0]
            index[name] = [library, type(comp).__name__]
            if name == "transformer":
                self._save_full_transformer(out / name)
            else:
                comp.save_pretrained(out / name)
        (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        if self.pixel_space:
            # one side for a square image (what older files hold), else [height, width] as diffusers writes it
            size = self.height if self.height == self.width else [self.height, self.width]
            spec = {"patch_size": self.pixel_patch, "channels": 3, "sample_size": size, "prediction": self.prediction}
            (out / "pixel_space.json").write_text(json.dumps(spec, indent=2) + "\n")
        self.copy_carried_files(out)
        return out

    def copy_carried_files(self, out: str | os.PathLike) -> None:
        """Copy `carried_files` (e.g. CAST's calibrated window, which describes these weights'
        sampler) into `out`."""
        for extra in self.carried_files:
            if Path(extra).is_file():
                shutil.copyfile(extra, Path(out) / Path(extra).name)

    def save_transformer_weights(self, path: str | os.PathLike) -> Path:
        """Just the trained part: the LoRA adapter (PEFT format) when there is one, else the
        whole transformer (diffusers format). `load_transformer_weights` reads either."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        if not self.has_lora:
            self.transformer.save_pretrained(out, safe_serialization=True)
            return out
        state = get_peft_model_state_dict(self.transformer, adapter_name=_ADAPTER)
        self.transformer.peft_config[_ADAPTER].save_pretrained(out)
        save_file(
            {k: v.detach().contiguous() for k, v in state.items()},
            out / "adapter_model.safetensors",
        )
        return out

    @torch.no_grad()
    def load_transformer_weights(self, path: str | os.PathLike) -> None:
        """Load, in place, a saved transformer (a diffusers model directory, or a pipeline
        directory: its transformer/) or a PEFT LoRA adapter directory (adds the adapter first
        when the model has none). Keys must match exactly. A model with LoRA only takes an
        adapter (full weights, e.g. from save_pretrained, already have the adapter merged)."""
        from safetensors.torch import load_file

        src = Path(path)
        if (src / "model_index.json").is_file():
            src = src / "transformer"
        if (src / "adapter_config.json").is_file():
            self._load_lora(src)
            return
        files = sorted(src.glob("diffusion_pytorch_model*.safetensors"))
        if files and self.has_lora:
            # e.g. a save_pretrained checkpoint, whose weights already contain the adapter
            raise ConfigError(
                f"{str(src)!r} holds full transformer weights but this model has a LoRA adapter: "
                "load an adapter directory (save_transformer_weights) instead, or load full "
                "weights before add_lora"
            )
        if not files:
            raise ConfigError(
                f"{str(src)!r} holds neither a transformer (diffusion_pytorch_model*.safetensors) "
                "nor a LoRA adapter (adapter_config.json)"
            )
        state: dict[str, Tensor] = {}
        for f in files:
            state.update(load_file(f))
        target = self._base_tensors()
        missing, unexpected = sorted(set(target) - set(state)), sorted(set(state) - set(target))
        if missing or unexpected:
            raise ConfigError(
                f"transformer weights in {src} do not match this {self.family} model: "
                f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
            )
        for k, t in target.items():  # every shape checked before any copy: a refusal leaves the model whole
            if t.shape != state[k].shape:
                raise ConfigError(
                    f"{src}: {k} has shape {tuple(state[k].shape)}, expected {tuple(t.shape)}"
                )
        for k, t in target.items():
            t.copy_(state[k])

    def _load_lora(self, src: Path) -> None:
        from peft import LoraConfig, set_peft_model_state_dict
        from safetensors.torch import load_file

        config = LoraConfig.from_pretrained(src)
        if not self.has_lora:
            self.add_lora(
                config.r, config.lora_alpha, sorted(config.target_modules), config.lora_dropout
            )
        mine = self.transformer.peft_config[_ADAPTER]
        if (mine.r, set(mine.target_modules)) != (config.r, set(config.target_modules)):
            raise ConfigError(
                f"LoRA adapter in {src} (r={config.r}, targets {sorted(config.target_modules)}) does not "
                f"match this model's (r={mine.r}, targets {sorted(mine.target_modules)})"
            )
        check_adapter_config(mine, src)  # alpha: the scaling the adapter trained with
        state = load_file(src / "adapter_model.safetensors")
        result = set_peft_model_state_dict(self.transformer, state, adapter_name=_ADAPTER)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise ConfigError(f"LoRA adapter in {src} has keys this model lacks: {unexpected[:5]}")

    def _base_tensors(self) -> dict[str, Tensor]:
        """The transformer's parameters and buffers under their plain (non-PEFT) names."""
        tensors = dict(self.transformer.named_parameters())
        tensors.update(dict(self.transformer.named_buffers()))
        return {k.replace(".base_layer.", "."): v for k, v in tensors.items() if ".lora_" not in k}

    def _save_full_transformer(self, out: Path) -> None:
        if not self.has_lora:
            self.transformer.save_pretrained(out, safe_serialization=True)
            return
        from peft.tuners.lora import LoraLayer
        from safetensors.torch import save_file

        state = {k: v.detach() for k, v in self._base_tensors().items()}
        for name, module in self.transformer.named_modules():
            if isinstance(module, LoraLayer) and _ADAPTER in module.lora_A:
                w = module.get_base_layer().weight
                delta = module.get_delta_weight(_ADAPTER)
                state[f"{name}.weight"] = (w.detach().float() + delta.detach().float()).to(w.dtype)
        out.mkdir(parents=True, exist_ok=True)
        self.transformer.save_config(out)
        save_file(
            {k: v.contiguous() for k, v in state.items()},
            out / "diffusion_pytorch_model.safetensors",
            metadata={"format": "pt"},
        )

    # ------------------------------------------------------------------ helpers

    def _rows(self, cond: dict[str, Tensor], n: int) -> dict[str, Tensor]:
        for k, v in cond.items():
            if v.shape[0] != n:
                raise ValueError(f"conditioning {k!r} has {v.shape[0]} rows for {n} latents")
        return cond

    def _cast(self, t: Tensor) -> Tensor:
        return t.to(self.device, self.dtype) if t.is_floating_point() else t.to(self.device)

    def _guidance(self, n: int) -> Tensor | None:
        """The embedded (distilled) guidance, as the pipelines pass it (float32, [N])."""
        if not self.transformer.config.get("guidance_embeds", False):
            return None
        return torch.full((n,), self.distilled_guidance, dtype=torch.float32, device=self.device)

    def _vae_scale(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    def _randn(self, shape: tuple[int, ...], generator: torch.Generator | None) -> Tensor:
        device = generator.device if generator is not None else torch.device("cpu")
        return torch.randn(shape, generator=generator, device=device, dtype=torch.float32)

    def __repr__(self) -> str:
        n = sum(p.numel() for p in self.transformer.parameters())
        kind = f"pixel space, patch {self.pixel_patch}" if self.pixel_space else "latent"
        return (
            f"{type(self).__name__}(family={self.family!r}, {self.height}x{self.width}, {kind}, "
            f"seq_len={self.seq_len}, transformer {n / 1e6:.2f}M params, dtype={self.dtype}, "
            f"guidance_scale={self.guidance_scale}, lora={self.has_lora})"
        )
