"""The flow-model policy: SDE rollouts with per-step log-probs, and the training forward.

`generate` runs the sampler of diffusion_rl.sde from pure noise: ODE steps, except in
the SDE window, where each step is a Gaussian transition whose log-prob is kept
(Flow-GRPO). The steps that train are the window's (or a random `train_fraction` of
them, drawn with the rollout generator). A batch's positions are those trained steps:

    mask, old_logp                  [N, T]          T = trained steps
    data["latents"]                 [N, T, L, C]    x before each trained step
    data["next_latents"]            [N, T, L, C]    the sample the SDE drew
    data["sigma"], ["sigma_next"]   [N, T]
    data["cond/<key>"]              the model's prompt conditioning, one row per sample
    data["final_latents"]           [N, L, C]       the clean sample x1 (sigma = 0) the image decodes from
    data["token_logp"]              [N, T, L]       each latent token's log-prob (the mean over its
                                                    channels; old_logp is its mean over L): CAST's
                                                    per-patch ratios

`logprobs` re-scores next_latents under the current weights: on-policy the ratio is
exactly 1. Samples are Sample(prompt text, PIL image, meta). `flow_matching_error` is the
plain flow-matching regression on clean latents (FTFC trains with it).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from diffusion_rl.sde import FlowSDESampler, SDEStep, sde_step_with_logprob
from mmrl.core.batch import RolloutBatch
from mmrl.core.config import ConfigError
from mmrl.core.lora import check_not_adapter, is_adapter_dir, is_lora
from mmrl.core.rewards import Sample
from mmrl.core.trainer import TrainingError


class NonFiniteRollout(TrainingError):
    """Latents or log-probs became NaN / inf during sampling: the step stops, nothing is saved."""


class DiffusionPolicy:
    def __init__(self, flow, rollout):
        self.flow = flow
        self.model = flow.transformer
        self.rollout = rollout  # noise level and kind: the same in rollout and training
        self._counted = 0  # flow.evaluations at the last step_costs()

    # ------------------------------------------------------------------ rollout

    def sampler(self, num_steps: int) -> FlowSDESampler:
        """The sampler of `num_steps` steps. Its sigmas stay on the CPU (so do a batch's "sigma",
        "sigma_next"): the step checks them there without a device sync and moves them itself."""
        from diffusion_rl.models import time_shift, time_shift_settings

        s = FlowSDESampler()
        family, config = self.flow.family, dict(getattr(getattr(self.flow, "scheduler", None), "config", None) or {})
        shift = time_shift(family, config) if self.rollout.shift == "auto" else self.rollout.shift
        s.set_timesteps(num_steps, shift=shift, **time_shift_settings(family, config, self.flow.seq_len, num_steps))
        return s

    def serve_prompt(self, prompt: Any, rollout):
        """A served request's prompt (mmrl.core.serve): text, checked before the engine runs."""
        prompt_text(prompt)  # TypeError (the server's 400) for anything that is not text
        return prompt

    def generate(self, prompts: Sequence[Any], num_generations: int, rollout, generator: torch.Generator
                 ) -> RolloutBatch:
        texts = [prompt_text(p) for p in prompts for _ in range(num_generations)]
        n = len(texts)
        cond = self.flow.encode_prompt(texts)
        sampler = self.sampler(rollout.num_steps)
        window = sampler.sde_steps(rollout.window_size, rollout.window_start, generator)
        trained = _subset(window, rollout.train_fraction, generator)
        # the trainer's CPU generator draws the noise (flow.noise moves it to the model's device),
        # so a seed gives the same rollout on every device
        if getattr(rollout, "shared_noise", False):
            x = self.flow.noise(len(prompts), generator).repeat_interleave(num_generations, 0)
        else:
            x = self.flow.noise(n, generator)
        xs, nexts, logps, tok_logps, sig, sig_next = [], [], [], [], [], []
        with torch.no_grad():
            for i in range(rollout.num_steps):
                sigma = sampler.sigmas[i].expand(n)
                v = self.flow.velocity(x, sigma, cond)
                out = sampler.step(v, x, i, noise_level=rollout.noise_level, kind=rollout.kind,
                                   sde=i in window, generator=generator)
                if not (torch.isfinite(out.prev_sample).all() and torch.isfinite(out.log_prob).all()):
                    cause = ("the model's velocity was not finite (diverged weights, or latents out of range)"
                             if not torch.isfinite(v).all() else
                             f"from a finite velocity: the step's noise at rollout.noise_level {rollout.noise_level:g} "
                             f"({rollout.kind}) over- or underflows; set rollout.noise_level nearer the default 0.7")
                    raise NonFiniteRollout(f"sampling step {i} (sigma {float(sampler.sigmas[i]):.3f}) produced "
                                           f"non-finite latents or log-probs, {cause}; the step is not trained")
                if i in trained:
                    xs.append(x)
                    nexts.append(out.prev_sample)
                    logps.append(out.log_prob)
                    tok_logps.append(out.elem_log_prob.mean(-1).float())
                    sig.append(sigma)
                    sig_next.append(sampler.sigmas[i + 1].expand(n))
                x = out.prev_sample
            images = self.flow.decode(x)
        t = len(xs)
        return RolloutBatch(
            group_ids=torch.arange(len(prompts)).repeat_interleave(num_generations),  # ids: CPU
            samples=[to_sample(p, img) for p, img in zip([p for p in prompts for _ in range(num_generations)],
                                                         images)],
            mask=torch.ones((n, t), dtype=torch.bool, device=x.device),
            old_logp=torch.stack(logps, 1).float(),
            data={
                "latents": torch.stack(xs, 1),
                "next_latents": torch.stack(nexts, 1),
                "sigma": torch.stack(sig, 1),
                "sigma_next": torch.stack(sig_next, 1),
                "final_latents": x,
                "token_logp": torch.stack(tok_logps, 1),
                **{f"cond/{k}": v for k, v in cond.items()},
            },
        )

    # ------------------------------------------------------------------ training forward

    def sde_outputs(self, batch: RolloutBatch, attention: list[int] | None | bool = False
                    ) -> list[SDEStep] | tuple[list[SDEStep], list[Tensor]]:
        """Each trained step re-scored under the current weights (with grad). attention: False,
        or the joint-attention layers (None = the middle ones) whose image-to-text attention
        is recorded in the same forwards; then also returns one [N, L, S_txt] map per step
        (CAST, diffusion_rl.attention_maps)."""
        from diffusion_rl.attention_maps import TextAttention

        d = batch.data
        cond = {k[len("cond/"):]: v for k, v in d.items() if k.startswith("cond/")}
        # the step checks its sigmas on the CPU (no device sync per step): back there, if the
        # batch came onto the model's device whole (RolloutBatch.onto)
        sigma, sigma_next = d["sigma"].cpu(), d["sigma_next"].cpu()
        outs, maps = [], []
        for t in range(d["latents"].shape[1]):
            x = d["latents"][:, t]
            with (TextAttention(self.flow, attention, rows=len(x)) if attention is not False
                  else contextlib.nullcontext()) as rec:
                v = self.flow.velocity(x, sigma[:, t], cond)
            if rec is not None:
                maps.append(rec.result())
            outs.append(sde_step_with_logprob(
                v, x, sigma[:, t], sigma_next[:, t], noise_level=self.rollout.noise_level,
                kind=self.rollout.kind, prev_sample=d["next_latents"][:, t]))
        return outs if attention is False else (outs, maps)

    def logprobs(self, batch: RolloutBatch) -> Tensor:
        return torch.stack([o.log_prob for o in self.sde_outputs(batch)], 1)

    def flow_velocity(self, x1: Tensor, t: Tensor, noise: Tensor, cond: dict[str, Tensor],
                      guided: bool = False) -> Tensor:
        """v_theta(x_t, t, c) [N, L, C] at x_t = (1 - t) x1 + t noise (t is sigma: 1 = noise).
        x1, noise [N, L, C]; t [N]. Under CFG (guidance_scale > 1) guided=False gives the
        conditional velocity alone."""
        tt = t.to(x1).reshape(-1, *([1] * (x1.dim() - 1)))
        x_t = (1 - tt) * x1 + tt * noise
        if guided or self.flow.guidance_scale <= 1.0:
            return self.flow.velocity(x_t, t, cond)
        scale, self.flow.guidance_scale = self.flow.guidance_scale, 1.0
        try:
            return self.flow.velocity(x_t, t, {k: c for k, c in cond.items() if not k.startswith("neg/")})
        finally:
            self.flow.guidance_scale = scale

    def flow_matching_error(self, x1: Tensor, t: Tensor, noise: Tensor, cond: dict[str, Tensor],
                            guided: bool = False, target: Tensor | None = None) -> Tensor:
        """[N]: mean over latent elements of (v_theta(x_t, t, c) - target)^2, with grad; the
        target is flow matching's noise - x1 unless given ([N, L, C]). See flow_velocity."""
        v = self.flow_velocity(x1, t, noise, cond, guided)
        target = noise - x1 if target is None else target
        return ((v - target.to(v)) ** 2).flatten(1).mean(1)

    @torch.no_grad()
    def sample_images(self, prompts: Sequence[str], seeds: Sequence[int], num_steps: int) -> list:
        """ODE sampling (evaluation): one image per (prompt, seed), the noise fixed by the seed."""
        sampler = self.sampler(num_steps)
        cond = self.flow.encode_prompt(list(prompts))
        # CPU generators: a seed's image does not depend on model.device; noise() moves it there
        x = torch.cat([self.flow.noise(1, torch.Generator().manual_seed(int(s))) for s in seeds])
        for i in range(num_steps):
            v = self.flow.velocity(x, sampler.sigmas[i].expand(len(x)), cond)
            x = sampler.step(v, x, i, noise_level=0.0, sde=False).prev_sample
        bad = (~torch.isfinite(x.flatten(1)).all(1)).nonzero().flatten().tolist()
        if bad:  # such images decode to noise or black and score 0: say so rather than report a low score
            shown = ", ".join(f"{prompts[k]!r} seed {int(seeds[k])}" for k in bad[:3]) + (" ..." if len(bad) > 3 else "")
            warnings.warn(f"{len(bad)} of {len(x)} sampled images have non-finite latents ({shown}); they "
                          "score as blank images (a diverging model, or a guidance_scale too large?)", stacklevel=2)
        return self.flow.decode(x)

    def step_costs(self) -> dict[str, float]:
        """Transformer rows run since the last call (rollouts, re-scoring, reference passes),
        logged per training step as cost/model_evaluations (the core calls this)."""
        n, self._counted = self.flow.evaluations - self._counted, self.flow.evaluations
        return {"cost/model_evaluations": float(n)}

    # ------------------------------------------------------------------ weights

    def export_pretrained(self, path: str | Path) -> None:
        """The whole pipeline directory diffusers loads, under LoRA with the adapters merged into
        the transformer's weights (`export`)."""
        self.flow.save_pretrained(path)

    def export_usage(self) -> str:
        """The pipeline arguments that sample an export at this run's size and steps: a diffusers
        pipeline's own defaults are its full-size model's (FluxPipeline draws the bundled tiny
        model's images at 512 x 512 px, eight times the side it was trained at)."""
        f, steps = self.flow, self.rollout.eval_steps or self.rollout.num_steps
        text = (f"this run samples {f.height}x{f.width} px in {steps} steps: call the pipeline with "
                f"height={f.height}, width={f.width}, num_inference_steps={steps}")
        if f.pixel_space:  # FluxPipeline needs a VAE; our pixel-space layout is not a diffusers one
            return (text.split(":")[0] + "; diffusers cannot sample this pixel-space model (FluxPipeline needs "
                    "a vae): load it with diffusion_rl.models.load_flow_model")
        # the text length: each pipeline pads to its own default (FLUX 512 T5 tokens), which a model
        # whose tokenizer reads fewer (the tiny ones) does not pad to
        default_length = {"flux": 512, "flux2": 512, "sd3": 256}.get(f.family)
        if default_length is not None and f.max_sequence_length != default_length:
            text += f", max_sequence_length={f.max_sequence_length}"
        # the guidance: SD3's guidance_scale is CFG at 7.0 by default; FLUX and Qwen-Image take
        # true_cfg_scale with a negative prompt (the run's unconditional prompt is the empty one)
        s = f.guidance_scale
        if f._guidance(1) is not None and f.distilled_guidance != f.default_distilled_guidance:
            text += f", guidance_scale={f.distilled_guidance:g}"  # a distilled transformer's embedded guidance
        if f.family == "sd3":
            text += f", guidance_scale={s:g}"
            if self.rollout.shift in ("auto", "sd3"):
                # SD3Pipeline's own schedule runs from linspace(1, 1/1000): give it ours, unshifted
                # (its scheduler applies the same shift 3), as FluxPipeline does by itself
                text += f", sigmas=[{', '.join(f'{1 - i / steps:.4g}' for i in range(steps))}]"
        elif s > 1 and f.family in ("flux", "qwen_image"):
            text += f', true_cfg_scale={s:g}, negative_prompt=""'
        elif s > 1:  # flux2: Flux2Pipeline's guidance_scale is the embedded one alone
            text += (f" (Flux2Pipeline has no classifier-free guidance: its images are not this run's, which "
                     f"used model.guidance_scale={s:g})")
        return text

    def save_pretrained(self, path: str | Path) -> None:
        """The whole pipeline directory (from_pretrained loads it as is); under LoRA the adapter
        alone (adapter_config.json, adapter_model.safetensors, and for diffusers' pipeline loader
        pytorch_lora_weights.safetensors: describe_adapter), as the VLM and dLLM backends save
        theirs: the text encoders and VAE are frozen and the base model's, and for a FLUX-size
        model a whole pipeline costs tens of GB a checkpoint. Loading it needs the base
        (model.path) built with the same model.lora, as `--checkpoint` and resuming do."""
        if not self.flow.has_lora:
            self.flow.save_pretrained(path)
            return
        from diffusion_rl.models import _class_of

        self.flow.save_transformer_weights(path)
        describe_adapter(Path(path), self.flow.transformer, _class_of(self.flow.family))
        self.flow.copy_carried_files(path)  # the record of the window the base was calibrated to

    def load_weights(self, path: str | Path) -> None:
        """What save_pretrained wrote, in place. Checkpoints written before 2026-12-05 under
        LoRA hold a merged pipeline with the adapter in lora/: that adapter is what loads."""
        path = Path(path)
        if self.flow.has_lora and (path / "lora" / "adapter_config.json").is_file():
            path = path / "lora"
        if not self.flow.has_lora:
            # the model's own load would add the adapter: a run without model.lora would then hold
            # adapters its optimizer was not built over (resuming failed in the optimizer's load)
            check_not_adapter(path)
        elif not is_adapter_dir(path):
            raise ConfigError(f"{path} holds no LoRA adapter (adapter_config.json), but this run's model has "
                              "model.lora set: point at a checkpoint of a LoRA run, or unset model.lora")
        self.flow.load_transformer_weights(path)

    def reference(self) -> _Reference:
        """The KL reference: the starting weights (under LoRA, the base with adapters disabled)."""
        return _Reference(self)

    def rollout_copy(self) -> _Reference:
        """A pipelined engine's own weights (mmrl.core.engine.PolicyEngine): a frozen copy of
        the current ones, adapters included, that samples; publish loads new weights into it."""
        return _Reference(self, share_base=False)


def describe_adapter(path: Path, transformer: torch.nn.Module, pipeline: str) -> None:
    """Make a LoRA checkpoint's adapter loadable without mmrl: adapter_config.json names its base
    (the transformer folder it was loaded from; PEFT leaves it null for a diffusers model), and the
    safetensors carry the LoRA config as diffusers' `lora_adapter_metadata`, without which
    `transformer.load_lora_adapter(path, weight_name="adapter_model.safetensors", prefix=None)`
    silently scales the update by 1, not by alpha / r. Beside it, the same adapter as the
    pipeline class `pipeline` (e.g. "FluxPipeline") saves one: pytorch_lora_weights.safetensors,
    its keys under `transformer.`, which `pipe.load_lora_weights(path)` reads (it found no
    `transformer.` key in adapter_model.safetensors and silently loaded nothing: the base model)."""
    import json

    import diffusers
    from safetensors.torch import load_file, save_file

    config_file, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    config = json.loads(config_file.read_text())
    base = Path(str(getattr(transformer.config, "_name_or_path", "") or ""))  # the pipeline it was loaded from
    if config.get("base_model_name_or_path") is None and (base / "transformer").is_dir():
        config["base_model_name_or_path"] = str((base / "transformer").resolve())
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    state = load_file(weights)
    tmp = weights.with_suffix(".tmp")  # written aside: the tensors read may still map the old file
    save_file(state, tmp, metadata={"format": "pt", "lora_adapter_metadata": json.dumps(config)})
    tmp.replace(weights)
    # resume and load_lora_adapter read adapter_model.safetensors; this copy is for the pipeline's
    # loader (the Hub's LoRA format). A pipeline class without a LoRA loader gets none.
    save_lora = getattr(getattr(diffusers, pipeline, None), "save_lora_weights", None)
    if save_lora is not None:
        save_lora(path, transformer_lora_layers=state, transformer_lora_adapter_metadata=config)


class _Reference:
    """A frozen copy of the policy's weights: the KL reference (the starting weights) or an
    engine's (`rollout_copy`). Its transformer rows count in the policy's
    cost/model_evaluations like the policy's own."""

    def __init__(self, policy: DiffusionPolicy, *, share_base: bool = True):
        # Under LoRA the KL reference is the policy's own model with its adapters disabled,
        # so no second copy is kept; a rollout copy always holds weights of its own.
        self.lora = share_base and is_lora(policy.model)
        self.owner = policy.flow  # whose evaluations counter the rows are charged to
        if self.lora:
            self.policy = policy
        else:
            self.policy = copy.copy(policy)
            self.policy.flow = copy.copy(policy.flow)
            frozen = copy.deepcopy(policy.model).requires_grad_(False)
            self.policy.flow.transformer = self.policy.model = frozen
        self.model = self.policy.model

    @contextlib.contextmanager
    def _off(self):
        """Base weights inside; a copy's rows are charged to the policy's counter on the way out."""
        before = self.policy.flow.evaluations
        try:
            with self.policy.flow.disable_adapter() if self.lora else contextlib.nullcontext():
                yield
        finally:
            if not self.lora:
                self.owner.charge(self.policy.flow.evaluations - before)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Any], num_generations: int, rollout, generator: torch.Generator
                 ) -> RolloutBatch:
        with self._off():
            return self.policy.generate(prompts, num_generations, rollout, generator)

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch) -> Tensor:
        with self._off():
            return self.policy.logprobs(batch)

    @torch.no_grad()
    def flow_velocity(self, x1: Tensor, t: Tensor, noise: Tensor, cond: dict[str, Tensor],
                      guided: bool = False) -> Tensor:
        """The starting weights' velocity (DiffusionPolicy.flow_velocity)."""
        with self._off():
            return self.policy.flow_velocity(x1, t, noise, cond, guided)

    @torch.no_grad()
    def reference_data(self, batch: RolloutBatch) -> dict[str, Tensor]:
        """The reference's step means (Flow-GRPO's KL compares means), [N, T, L, C]."""
        with self._off():
            return {"ref_mean": torch.stack([o.mean for o in self.policy.sde_outputs(batch)], 1)}


def prompt_text(prompt: Any) -> str:
    text = prompt if isinstance(prompt, str) else getattr(prompt, "text", None)
    if not isinstance(text, str):
        raise TypeError(f"a diffusion prompt must be text, got {type(prompt).__name__}")
    return text


def to_sample(prompt: Any, image) -> Sample:
    meta = dict(getattr(prompt, "meta", None) or {})
    return Sample(prompt=prompt_text(prompt), completion=image, meta=meta)


def _subset(window: list[int], fraction: float, generator: torch.Generator) -> list[int]:
    if fraction >= 1.0:
        return list(window)
    k = max(1, round(len(window) * fraction))
    pick = torch.randperm(len(window), generator=generator,
                          device=None if generator is None else generator.device)[:k].sort().values
    return [window[i] for i in pick.tolist()]
