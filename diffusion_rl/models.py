"""Flow-matching text-to-image models for RL: one adapter over diffusers' FLUX.1, FLUX.2, SD3 /
SD3.5 and Qwen-Image, loaded from a local diffusers pipeline directory.

RL needs four things from a model, and `FlowModel` gives exactly those, built on the model
classes rather than on `pipeline.__call__` (whose loop hides the per-step log-probs RL needs):

    model = load_flow_model("path/to/pipeline_dir", dtype="bfloat16", guidance_scale=1.0)
    cond = model.encode_prompt(["two red circles left of a blue square"] * 4)  # rows = samples
    x = model.noise(4, torch.Generator().manual_seed(0))          # [N, L, C] float32, sigma = 1
    v = model.velocity(x, sigma, cond)                             # [N, L, C] float32, v ~ eps - x0
    images = model.decode(x)                                       # list of RGB PIL images

Convention (diffusers', docs/methods.md section 4): sigma in [0, 1], 1 = noise,
x_sigma = (1 - sigma) x0 + sigma eps; the transformer predicts v ~ eps - x0; an Euler step is
x' = x + (sigma' - sigma) v. Latents always travel in the *packed token layout* the family's
transformer consumes, [N, L, C] with L = `seq_len` image tokens:

    family      pipeline class             tokens                                     timestep passed
    flux        FluxPipeline               2x2 latent patches, C = 4 x VAE channels   sigma  (model x1000)
    flux2       Flux2Pipeline              2x2 patchified latents, batch-normalised   sigma  (model x1000)
    sd3         StableDiffusion3Pipeline   p x p latent patches (p = transformer's    1000 sigma
                                           patch_size; unpacked before the forward)
    qwen_image  QwenImagePipeline          2x2 latent patches                         sigma  (model x1000)

`noise` draws the same numbers as the pipeline's `prepare_latents` for the same generator (the
pipeline's unpacked shape, then packed). `decode` undoes the packing and the latent
normalisation exactly as each pipeline does (FLUX / SD3: x / scaling_factor + shift_factor;
Qwen-Image: x * latents_std + latents_mean; FLUX.2: x * sqrt(bn.running_var + eps) +
bn.running_mean, then un-patchify) before `vae.decode`.

Conditioning (`encode_prompt`) is a dict of tensors with one row per prompt, so a batch can be
sliced and concatenated row-wise; with `guidance_scale > 1` it also holds the empty-prompt
conditioning under the same keys prefixed "neg/":

    flux        prompt_embeds [N, S, D] (T5), pooled_prompt_embeds [N, Dp] (CLIP), text_ids [N, S, 3]
    sd3         prompt_embeds [N, S_clip + S_t5, D] (CLIP-L and CLIP-G penultimate layers side by
                side, zero-padded to the T5 width, followed by T5's tokens),
                pooled_prompt_embeds [N, Dl + Dg]
    qwen_image  prompt_embeds [N, S, D] (last layer of Qwen2.5-VL, template tokens dropped),
                prompt_embeds_mask [N, S] (1 = token); padded to a fixed S = max_sequence_length
                so rows concatenate; `velocity` trims the all-padding tail columns
    flux2       prompt_embeds [N, S, 3 D] (Mistral3 hidden states 10, 20, 30 stacked),
                text_ids [N, S, 4]

Position ids are stored per row; `velocity` uses row 0 (diffusers wants them without a batch dim).
Image position ids depend only on the resolution and are built once, inside the model.

Guidance: `guidance_scale > 1` is classifier-free guidance, uncond + s (cond - uncond), with the
empty prompt as uncond, in one batched forward (Qwen-Image then rescales each token to the norm
of the conditional prediction, as its pipeline does). Guidance-distilled transformers
(`config.guidance_embeds`: FLUX.1-dev, FLUX.2-dev) also get the embedded guidance
`distilled_guidance`, default the pipeline's (FLUX 3.5, FLUX.2 4.0).

Pixel space: a directory whose model_index.json lists no VAE (`"vae": [null, null]`) and that
holds `pixel_space.json` = {"patch_size": p, "channels": 3[, "sample_size": side or [height, width]]} is a
pixel-space model (FLUX family): the latents ARE the image in [-1, 1], cut into p x p patches,
(H/p)(W/p) tokens of 3 p^2 channels, position ids FLUX's latent-image ids on the (H/p, W/p)
grid. `decode` just un-packs them. The project's bundled tiny model is one (see tiny.py).
An optional `"prediction": "sample"` in pixel_space.json means the transformer predicts the
clean image x0 rather than v (x-prediction, which trains far better than v-prediction when a
token's patch has more pixel values than the transformer has width: Li & He, "Back to
Basics: Let Denoising Generative Models Denoise", 2025); `velocity` then returns
v = (x - x0_hat) / max(sigma, 0.05), so every caller still sees a velocity.

Image size: `height` / `width` when given; else a `sample_size` found in the directory
(pixel_space.json in pixels, one side or [height, width]: save_pretrained writes the latter for a
non-square model; SD3's transformer config in latent units x the VAE factor; the
VAE config in pixels, which real FLUX.1 / FLUX.2 / SD3 VAEs carry = 1024); else 64, the tiny
models' size, with a warning. Qwen-Image's VAE has no sample_size: give its height / width explicitly.

Training: `transformer` is the only module with gradients (full fine-tuning), or only its
LoRA adapters after `add_lora`; text encoders and VAE are frozen and in eval mode; the
transformer is left in eval mode too (none of these have dropout; PEFT's lora_dropout needs
`model.transformer.train()`). `disable_adapter()` gives the base weights (the KL reference).
`save_pretrained` writes a plain diffusers pipeline directory (LoRA merged into the weights);
`save_transformer_weights` / `load_transformer_weights` move just the trained part (a full
transformer, or a PEFT LoRA adapter: adapter_config.json + adapter_model.safetensors) and load
in place, so an optimizer keeps its parameters.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

from mmrl.core.checkpoint import refuse_pickled_weights
from mmrl.core.config import ConfigError
from mmrl.core.lora import check_adapter_config, seeded, target_modules_error

__all__ = [
    "DEFAULT_LORA_TARGETS",
    "FAMILIES",
    "FlowModel",
    "build_tiny",
    "load_flow_model",
    "pack",
    "pil_to_tensor",
    "unpack",
]

FAMILIES = {
    "FluxPipeline": "flux",
    "Flux2Pipeline": "flux2",
    "StableDiffusion3Pipeline": "sd3",
    "QwenImagePipeline": "qwen_image",
}
# The time shift each family's sampler uses where its scheduler's config does not say (rollout.shift
# auto; diffusion_rl.sde); time_shift reads the config, as the family's pipeline does
FAMILY_SHIFT = {"flux": "flux", "flux2": "flux", "sd3": "sd3", "qwen_image": "flux"}


def time_shift(family: str, scheduler: dict) -> str:
    """rollout.shift auto: the shift the family's diffusers pipeline samples with, from its
    scheduler's config: resolution-dependent ("flux") where use_dynamic_shifting (FLUX.2's
    pipeline always), else the static shift ("sd3": s sigma / (1 + (s - 1) sigma), s = the
    config's `shift`), none at s = 1 (FLUX.1-schnell)."""
    if family == "flux2" or scheduler.get("use_dynamic_shifting"):
        return "flux"
    if "use_dynamic_shifting" not in scheduler:  # not a FlowMatchEulerDiscreteScheduler config
        return FAMILY_SHIFT[family]
    return "none" if float(scheduler.get("shift", 1.0)) == 1.0 else "sd3"


def time_shift_settings(family: str, scheduler: dict, seq_len: int, num_steps: int) -> dict:
    """FlowSDESampler.set_timesteps's shift parameters as the pipeline computes them from the
    scheduler's config (before, FLUX's were used for every model: Qwen-Image's max_shift 0.9 up
    to 8192 tokens was read as 1.15 up to 4096). Not applied: Qwen-Image's `shift_terminal`,
    which ends the pipeline's schedule at 0.02, where this sampler's ends at 0 (diffusion_rl.sde)."""
    settings = {"image_seq_len": seq_len}
    if not scheduler.get("use_dynamic_shifting") and "shift" in scheduler:
        settings["shift_value"] = float(scheduler["shift"])  # an explicit sd3 shift keeps 3.0 otherwise
    for ours, theirs in (("base_seq_len", "base_image_seq_len"), ("max_seq_len", "max_image_seq_len"),
                         ("base_shift", "base_shift"), ("max_shift", "max_shift")):
        if scheduler.get(theirs) is not None:
            settings[ours] = scheduler[theirs]
    if family == "flux2":  # Flux2Pipeline's own mu, fitted to image tokens and steps
        settings["mu"] = flux2_mu(seq_len, num_steps)
    return settings


def flux2_mu(seq_len: int, num_steps: int) -> float:
    """FLUX.2's empirical mu: linear in the image tokens L, on two lines fitted at 10 and 200
    steps; between them linear in the steps; past 4300 tokens the 200-step line alone."""
    at_200 = 0.00016927 * seq_len + 0.45666666
    if seq_len > 4300:
        return at_200
    at_10 = 8.73809524e-05 * seq_len + 1.89833333
    return at_200 + (num_steps - 200) * (at_200 - at_10) / 190.0


def pipeline_family(root: str | os.PathLike) -> str | None:
    """The family of the pipeline directory `root` from its model_index.json (None where it
    cannot be read: loading it says why)."""
    try:
        index = json.loads((Path(root) / "model_index.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return FAMILIES.get(index.get("_class_name")) if isinstance(index, dict) else None


# Components every directory of the family must have (SD3's T5 is optional, as in diffusers).
_REQUIRED = {
    "flux": ("transformer", "scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"),
    "sd3": ("transformer", "scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"),
    "qwen_image": ("transformer", "scheduler", "vae", "text_encoder", "tokenizer"),
    "flux2": ("transformer", "scheduler", "vae", "text_encoder", "tokenizer"),
}  # fmt: skip
_OPTIONAL = {"sd3": ("text_encoder_3", "tokenizer_3")}
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
    prompt encoding, latent layout, the transformer call and decoding (module docstring)."""

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
        module docstring); with guidance_scale > 1 also the empty prompt's under "neg/..."."""
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


def _flux_img_ids(h: int, w: int, device) -> Tensor:
    """FLUX's latent image ids on an h x w token grid: (0, row, col) per token, [h w, 3]."""
    ids = torch.zeros(h, w, 3, device=device)
    ids[..., 1] = torch.arange(h, device=device)[:, None]
    ids[..., 2] = torch.arange(w, device=device)[None, :]
    return ids.reshape(h * w, 3)


class FluxFlowModel(FlowModel):
    """FLUX.1: CLIP pooled + T5 sequence; 2x2-packed latents; or pixel space (module docstring)."""

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


_MODEL_CLASSES = {
    "flux": FluxFlowModel,
    "flux2": Flux2FlowModel,
    "sd3": SD3FlowModel,
    "qwen_image": QwenImageFlowModel,
}


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"could not read {what} {str(path)!r}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {str(path)!r} is not a JSON object")
    return data


def _load_component(root: Path, name: str, entry, dtype: torch.dtype):
    library, class_name = entry
    if library not in ("diffusers", "transformers"):
        raise ConfigError(
            f"model_index.json: component {name!r} comes from {library!r}; only diffusers and "
            "transformers components are loaded"
        )
    cls = getattr(importlib.import_module(library), class_name, None)
    if cls is None:
        raise ConfigError(
            f"model_index.json: {library} has no class {class_name!r} (component {name!r})"
        )
    kwargs: dict = {"subfolder": name, "local_files_only": True}
    module = isinstance(cls, type) and issubclass(cls, torch.nn.Module)
    if module:
        kwargs["torch_dtype" if library == "diffusers" else "dtype"] = dtype
        kwargs["output_loading_info"] = True
        kwargs["use_safetensors"] = True  # never unpickle: a .bin-only component is refused
        refuse_pickled_weights(root / name, f"component {name!r}")
        if library == "diffusers":
            _check_saved_class(root, name, class_name)
    try:
        loaded = cls.from_pretrained(str(root), **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"could not load component {name!r} ({class_name}) from {root / name}: {e}"
        ) from e
    if not module:
        return loaded
    comp, info = loaded
    # diffusers would leave missing weights uninitialised (on the meta device) and drop extra ones
    # silently: a config.json that does not fit its weights is refused, as for the other backends
    for kind, what in (("missing_keys", "it needs are missing from the checkpoint"),
                       ("unexpected_keys", "in the checkpoint are not in the model its config.json describes")):
        keys = sorted(info.get(kind) or [])
        if keys:
            more = f", ... and {len(keys) - 3} more" if len(keys) > 3 else ""
            raise ConfigError(f"component {name!r} ({class_name}) in {root / name} does not fit its config.json: "
                              f"{len(keys)} weight(s) {what} ({', '.join(keys[:3])}{more})")
    return comp


def _check_saved_class(root: Path, name: str, class_name: str) -> None:
    """Refuse a model_index.json entry whose diffusers class is not the one its folder's
    config.json was saved from (_class_name): loading would build the named class and report the
    weights as not fitting it, hiding that the index names the wrong class. (transformers'
    `architectures` is not held to this: an encoder loads from a checkpoint saved as a bigger model.)"""
    try:
        saved = json.loads((root / name / "config.json").read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return  # loading says what is wrong with it
    if isinstance(saved, str) and saved != class_name:
        raise ConfigError(f"model_index.json names {class_name} for component {name!r}, but "
                          f"{root / name / 'config.json'} was saved from {saved}: if that is the model, list "
                          f'"{name}": ["diffusers", "{saved}"] in model_index.json')


def load_flow_model(
    path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "float32",
    height: int | None = None,
    width: int | None = None,
    guidance_scale: float = 1.0,
    device: str | torch.device = "cpu",
    distilled_guidance: float | None = None,
) -> FlowModel:
    """A `FlowModel` from a local diffusers pipeline directory: every component through its
    class's real `from_pretrained(path, subfolder=name)`. The family comes from
    model_index.json's `_class_name`. Nothing is downloaded (local_files_only).

    dtype: of every model component ("float32", "bfloat16", ...). height / width: default
    from the directory's sample_size, else 64 (module docstring). guidance_scale: CFG scale,
    1 = off. distilled_guidance: the embedded guidance of guidance-distilled transformers
    (default: the pipeline's). Errors (a missing directory or component, an unsupported
    pipeline class) are ConfigError (a ValueError) with a message that names the problem.
    """
    root = Path(path)
    if root.is_file():
        raise ConfigError(single_file_message(root))
    if not root.is_dir():
        raise ConfigError(f"model path {str(root)!r} is not a directory")
    index_path = root / "model_index.json"
    if not index_path.is_file() and (root / "adapter_config.json").is_file():
        raise ConfigError(
            f"model path {str(root)!r} holds a LoRA adapter (a LoRA run's checkpoint), not a pipeline: "
            "set model.path to the base model and model.lora as the run did, and load the adapter "
            "with --checkpoint (the run's config.yaml has both)"
        )
    if not index_path.is_file():
        raise ConfigError(
            f"model path {str(root)!r} has no model_index.json; is it a diffusers pipeline directory "
            "(written by save_pretrained)?"
        )
    index = _read_json(index_path, "pipeline index")
    class_name = index.get("_class_name")
    if class_name not in FAMILIES:
        raise ValueError(
            f"{index_path}: pipeline class {class_name!r} is not supported; supported: "
            f"{', '.join(f'{k} ({v})' for k, v in FAMILIES.items())}"
        )
    family = FAMILIES[class_name]
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ConfigError(f"dtype {dtype!r} is not a torch dtype (e.g. 'float32', 'bfloat16')")
        dtype = getattr(torch, dtype)

    pixel = None
    if (root / "pixel_space.json").is_file():
        pixel = _read_json(root / "pixel_space.json", "pixel-space spec")
        if family != "flux":
            raise ConfigError(
                f"{root}: pixel_space.json is supported for FluxPipeline only, not {class_name}"
            )
        p = pixel.get("patch_size")
        if not isinstance(p, int) or p < 1 or pixel.get("channels", 3) != 3:
            raise ConfigError(
                f"{root / 'pixel_space.json'}: needs an integer patch_size >= 1 and channels 3"
            )
        if pixel.get("sample_size") is not None and _sides(pixel["sample_size"]) is None:
            raise ConfigError(f"{root / 'pixel_space.json'}: sample_size must be a side in pixels or [height, width], "
                              f"not {pixel['sample_size']!r}")
        if index.get("vae") not in (None, [None, None]):
            raise ConfigError(
                f"{root}: has both a vae and pixel_space.json; a pixel-space model has no vae"
            )

    missing = []
    for name in _REQUIRED[family]:
        if name == "vae" and pixel is not None:
            continue
        entry = index.get(name)
        if not (isinstance(entry, list) and len(entry) == 2 and all(entry)):
            hint = " (or pixel_space.json, for a pixel-space model)" if name == "vae" else ""
            missing.append(f"{name!r} is not listed in model_index.json{hint}")
        elif not (root / name).is_dir():
            missing.append(f"the {name}/ folder is missing")
    if missing:
        raise ConfigError(
            f"{class_name} directory {str(root)!r} is incomplete: " + "; ".join(missing)
        )

    components = {}
    for name, entry in index.items():
        if name.startswith("_"):
            continue
        wanted = name in _REQUIRED[family] or name in _OPTIONAL.get(family, ())
        if not wanted or not (isinstance(entry, list) and len(entry) == 2 and all(entry)):
            if wanted or entry in ([None, None], None):
                components[name] = None
            continue
        if not (root / name).is_dir():
            raise ConfigError(
                f"{class_name} directory {str(root)!r} is incomplete: the {name}/ folder is missing"
            )
        components[name] = _load_component(root, name, entry, dtype)
        if name == "scheduler":  # before the transformer and text encoders (minutes, for a real model)
            _check_flow_matching(root, components[name])
    components.setdefault("vae", None)

    if height is None or width is None:
        found = _default_size(family, components, pixel)
        if found is None:  # say it: a real model (Qwen-Image's VAE carries no size) would draw 64 px thumbnails
            found = (64, 64)
            unset = " and ".join(k for k, v in (("height", height), ("width", width)) if v is None)
            warnings.warn(f"{root} names no image size (no sample_size in its vae or transformer config): "
                          f"{unset} default{'' if ' and ' in unset else 's'} to 64 px, the tiny models' size; set model.height and model.width "
                          f"({class_name} draws a full-size model at 1024 x 1024 by default)", stacklevel=2)
        h, w = found
        height, width = h if height is None else height, w if width is None else width  # 0 stays 0: refused
    cls = _MODEL_CLASSES[family]
    return cls(
        components,
        height=height,
        width=width,
        guidance_scale=guidance_scale,
        distilled_guidance=distilled_guidance,
        pixel_space=pixel,
        device=device,
    )


def single_file_message(file: Path) -> str:
    """Why a single file (a checkpoint as the hubs and UIs hand them out) is not a model path,
    and how to make the pipeline directory that is."""
    return (f"{file} is a single file; a diffusers pipeline directory is expected (model_index.json and "
            "a folder per component: transformer, vae, text encoders, tokenizers, scheduler). A single-file "
            "checkpoint becomes one through diffusers: load the base pipeline with this transformer, e.g. "
            "FluxPipeline.from_pretrained(BASE, transformer=FluxTransformer2DModel.from_single_file(FILE)) "
            "(or the pipeline's own from_single_file where the file holds every component), then "
            "save_pretrained(DIR) and set model.path to DIR")


def _check_flow_matching(root: Path, scheduler) -> None:
    """Refuse a scheduler that is not flow matching (DDIM, DDPM, an epsilon-prediction DPM-Solver):
    the sampler never calls it, so its model would be sampled and trained as a velocity predictor
    it is not, without a word."""
    config = getattr(scheduler, "config", {}) or {}
    name = type(scheduler).__name__
    if (name.startswith("FlowMatch") or config.get("prediction_type") == "flow_prediction"
            or config.get("use_flow_sigmas")):
        return
    raise ConfigError(
        f"{root / 'scheduler'}: {name} is not a flow-matching scheduler; these models are sampled as "
        "flow matching (x_sigma = (1 - sigma) x0 + sigma eps, the transformer predicting eps - x0), "
        "which a model trained for this scheduler is not. If the transformer is a flow-matching one, "
        "save the pipeline with its FlowMatchEulerDiscreteScheduler"
    )


def _sides(size) -> tuple[int, int] | None:
    """A sample_size -> (height, width): one side (square) or [height, width]; None if it is neither."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size, size
    if (isinstance(size, (list, tuple)) and len(size) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)):
        return int(size[0]), int(size[1])
    return None


def _default_size(family: str, components: dict, pixel: dict | None) -> tuple[int, int] | None:
    """(height, width) of a model loaded without either (module docstring, "Image size"); None
    where the directory names none."""
    if pixel is not None and pixel.get("sample_size"):
        return _sides(pixel["sample_size"])  # checked when the spec was read
    vae = components.get("vae")
    t = components["transformer"].config
    if family == "sd3" and t.get("sample_size") and vae is not None:
        side = int(t["sample_size"]) * 2 ** (len(vae.config.block_out_channels) - 1)
        return side, side
    if vae is not None and vae.config.get("sample_size"):
        side = int(vae.config["sample_size"])
        return side, side
    return None


def build_tiny(family: str, out_dir: str | os.PathLike, **kwargs) -> Path:
    """`diffusion_rl.tiny.build_tiny` (tiny random checkpoints of each family), re-exported."""
    from diffusion_rl.tiny import build_tiny as _build

    return _build(family, out_dir, **kwargs)
