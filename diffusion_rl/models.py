"""Flow-matching text-to-image models for RL: one adapter over diffusers' FLUX.1, FLUX.2, SD3 /
SD3.5 and Qwen-Image, loaded from a local diffusers pipeline directory.

Files: this one holds the loader (`load_flow_model`, with its checks of a pipeline directory)
and the sampler's time shift per family (`time_shift`); the base class `FlowModel`, with
`pack`, `unpack` and `pil_to_tensor`, is in diffusion_rl/flow_model.py, and each family's
subclass in diffusion_rl/families/ (flux.py, flux2.py, sd3.py, qwen_image.py). This module
re-exports them all (import them from here), and this docstring describes them all.

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

import importlib
import json
import os
import warnings
from pathlib import Path

import torch

# Every name of the files this module was split into stays importable from here.
from diffusion_rl.families.flux import FluxFlowModel, _flux_img_ids  # noqa: F401 (re-exported)
from diffusion_rl.families.flux2 import Flux2FlowModel
from diffusion_rl.families.qwen_image import QwenImageFlowModel
from diffusion_rl.families.sd3 import SD3FlowModel
from diffusion_rl.flow_model import (  # noqa: F401 (re-exported)
    _ADAPTER,
    DEFAULT_LORA_TARGETS,
    FAMILIES,
    FlowModel,
    ImageSizeError,
    _bare_pipeline,
    _class_of,
    pack,
    pil_to_tensor,
    unpack,
)
from mmrl.core.checkpoint import refuse_pickled_weights
from mmrl.core.config import ConfigError, remote_code_maps

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
    to 8192 tokens was read as 1.15 up to 4096), and `shift_terminal` where the config sets it
    (Qwen-Image's 0.02: the pipeline stretches its schedule so the last sigma before 0 is 0.02;
    before, this sampler's was 0.16 at 10 steps and 1024 image tokens)."""
    settings = {"image_seq_len": seq_len}
    terminal = shift_terminal(scheduler)
    if terminal is not None:
        settings["shift_terminal"] = terminal
    if not scheduler.get("use_dynamic_shifting") and "shift" in scheduler:
        settings["shift_value"] = float(scheduler["shift"])  # an explicit sd3 shift keeps 3.0 otherwise
    for ours, theirs in (("base_seq_len", "base_image_seq_len"), ("max_seq_len", "max_image_seq_len"),
                         ("base_shift", "base_shift"), ("max_shift", "max_shift")):
        if scheduler.get(theirs) is not None:
            settings[ours] = scheduler[theirs]
    if family == "flux2":  # Flux2Pipeline's own mu, fitted to image tokens and steps
        settings["mu"] = flux2_mu(seq_len, num_steps)
    return settings


def shift_terminal(scheduler: dict, where: str = "scheduler config") -> float | None:
    """The config's `shift_terminal` where it stretches the schedule (diffusers applies it where
    truthy: null and 0 are off), a ConfigError naming `where` for one outside (0, 1): diffusers
    would sample a schedule that rises back to 0 or stays at 1."""
    terminal = scheduler.get("shift_terminal")
    if not terminal:
        return None
    if isinstance(terminal, bool) or not isinstance(terminal, (int, float)) or not 0 < terminal < 1:
        raise ConfigError(f"{where}: shift_terminal must be a number in (0, 1) (the last sigma before 0; "
                          f"null: off); got {terminal!r}")
    return float(terminal)


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
    maps = remote_code_maps(root / name)
    if maps:  # transformers' Auto classes would ask on a terminal whether to run it, and run it on "y"
        raise ConfigError(f"component {name!r} in {root / name} ships its own Python code (auto_map in "
                          f"{', '.join(maps)}); diffusion pipelines never run a model directory's code: use a "
                          "component of a class diffusers or transformers has built in")
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
            shift_terminal(dict(getattr(components[name], "config", None) or {}),
                           str(root / name / "scheduler_config.json"))  # refused before minutes of loading
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
