"""Before / after: the base model and a fine-tuned one of the same run, sampled side by side.

`ModelPair(run)` builds both through the run's backend with the run's own config (the base
from the config's model.path, the bundled tiny model when that is empty; the fine-tuned one
from the run's final checkpoint), so both decode the same way. Each modality's `compare_*`
samples both with the same seeds and scores every sample with the task's reward atoms:

    compare_vlm(pair, item, n, seed)          greedy answer + n sampled ones per model
    compare_diffusion(pair, prompt, seeds)    one ODE image per seed per model
    compare_dllm(pair, problem, n, seed)      n answers per model, with the denoising order

and returns {"before": [Shown, ...], "after": [...]}. `ensure_default_run` trains a modality's
embedded default run when its checkpoint is missing (the demo's first use).
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mmrl.core import plugins
from mmrl.core.lora import is_adapter_dir
from mmrl.demo.runs import RunInfo, backend, default_run_dir


@dataclass
class Shown:
    """One sample as the demo shows it."""

    label: str  # "greedy", "seed 3", ...
    output: Any  # text, or a PIL image
    atoms: dict[str, float | None]  # None: the atom cannot be checked (no reference answer)
    total: float | None
    order: str = ""  # dLLM: HTML of the denoising order
    extra: dict[str, Any] = field(default_factory=dict)


class ModelPair:
    def __init__(self, run: RunInfo):
        tuned = run.model_dir()
        if tuned is None:
            raise FileNotFoundError(f"{run.path} has no finished checkpoint yet (checkpoints/step-*/model)")
        self.run, self.modality, self.backend = run, run.modality, backend(run.modality)
        self.base_path, self.tuned_path = run.base_model(), tuned
        self._built: dict[str, tuple[Any, Any]] = {}

    def config(self, model_path: str | Path | None):
        cfg = dict(self.run.config)
        cfg["model"] = {**(cfg.get("model") or {}), "path": None if model_path is None else str(model_path),
                        "device": "auto"}  # a run trained on a GPU is shown on a laptop too
        if self.modality == "diffusion" and cfg["model"].get("lora") and model_path == self.tuned_path:
            cfg["model"]["lora"] = None  # an old (before 2026-12-05) LoRA checkpoint: a pipeline, adapter merged in
        if (cfg.get("method") or {}).get("window_from"):
            cfg["method"] = {**cfg["method"], "window_from": None}  # sampling needs no SDE window
        cfg = {k: v for k, v in cfg.items() if v is not None}
        # A run of a plugin's method validates only with the plugin's config class (as serve.build_policy).
        cls = plugins.config_class(self.backend.CONFIG_CLASS, None, [], cfg)
        return cls.model_validate(cfg)

    def get(self, which: str):
        """(policy, task) of "before" or "after", built once."""
        if which not in self._built:
            from mmrl.core.trainer import with_config_atoms

            # A LoRA run's checkpoint holds the adapter alone: build the base, load it.
            adapter = which == "after" and is_adapter_dir(self.tuned_path)
            path = self.base_path if which == "before" or adapter else self.tuned_path
            cfg = self.config(path)
            policy, task = self.backend.build(cfg)
            with_config_atoms(task, cfg)  # the run's reward.atoms: totals are the training reward
            if adapter:
                policy.load_weights(self.tuned_path)
            policy.model.eval()
            self._built[which] = (policy, task)
        return self._built[which]


def _scored(reward, samples) -> list[tuple[dict[str, float], float]]:
    scores = reward.score(samples)
    return [(dict(zip(scores.names, row)), float(t)) for row, t in zip(scores.values.tolist(), scores.total.tolist())]


# ------------------------------------------------------------------ vision-language


def compare_vlm(pair: ModelPair, item, n: int = 2, seed: int = 0) -> dict[str, list[Shown]]:
    """item: a QAItem (images, question, answer; answer "" for an uploaded image: the answer
    atom is then shown as unknown)."""
    out = {}
    for which in ("before", "after"):
        policy, task = pair.get(which)
        with torch.no_grad():  # the samples as decoded: their meta holds what atoms read (lengths, tool calls)
            samples = [("greedy", policy.greedy_batches([item], task.max_new_tokens, stop=task.stop)[0].samples[0])]
            if n:
                batch = policy.generate([item], n, pair_rollout(pair, which), torch.Generator().manual_seed(seed))
                samples += [(f"sample {k + 1} (seed {seed})", s) for k, s in enumerate(batch.samples)]
        scored = _scored(task.reward, [s for _, s in samples])
        unknown = not str(item.answer)
        out[which] = [Shown(label, s.completion, {k: (None if unknown and k == "answer" else v) for k, v in atoms.items()},
                            None if unknown else total) for (label, s), (atoms, total) in zip(samples, scored)]
    return out


def pair_rollout(pair: ModelPair, which: str):
    return pair.config(pair.base_path if which == "before" else pair.tuned_path).rollout


# ------------------------------------------------------------------ flow / diffusion


def compare_diffusion(pair: ModelPair, prompt: str, seeds: list[int]) -> dict[str, list[Shown]]:
    """One ODE image per seed per model, each scored by the shapes-geneval detector (a prompt
    its grammar cannot parse is drawn but not scored)."""
    from diffusion_rl.tasks.shapes_geneval import score_image
    from mmrl.core.rewards import Sample

    out = {}
    for which in ("before", "after"):
        policy, task = pair.get(which)
        images = policy.sample_images([prompt] * len(seeds), seeds, task.eval_steps)
        shown = []
        for s, image in zip(seeds, images):
            try:
                atoms: dict[str, float | None] = score_image(image, prompt)  # every atom of the scene graph
                scores = task.reward.score([Sample(prompt, image)])  # the training reward
                atoms.update({n: float(scores.values[0, scores.names.index(n)]) for n in task.other_atoms()})
                total = float(scores.total[0])
            except ValueError as e:
                atoms, total = {"(not scored)": None}, None
                shown.append(Shown(f"seed {s}", image, atoms, total, extra={"why": str(e)}))
                continue
            shown.append(Shown(f"seed {s}", image, atoms, total))
        out[which] = shown
    return out


# ------------------------------------------------------------------ diffusion LMs

def dllm_problem(text: str, task_type: str = "arith"):
    """A typed prompt as a Problem: one in the task's format (spaces and the final "=" may be
    left out: " 12 + 7") gets its exact answer; anything else an empty answer (the answer atom
    is then shown as unknown)."""
    from dllm_rl.tasks import Problem, parse_problem

    prompt = "".join(text.split())
    prompt += "" if prompt.endswith("=") else "="
    return parse_problem(task_type, prompt) or Problem(text, "", "", {"answer": ""})


def denoising_order(policy, result, row: int) -> str:
    """HTML: each answer token with the step that committed it; fallback steps (Fork-dLLM) in red."""
    tok = policy.predictor.tokenizer
    cells = []
    fallback = result.fallback[row].tolist() if result.fallback.numel() else []
    for token, step in zip(result.completion[row].tolist(), result.commit_step[row].tolist()):
        if token == policy.predictor.eos_token_id:
            break
        text = html.escape(tok.decode([token])) or "&nbsp;"
        fb = 0 <= step < len(fallback) and fallback[step]
        style = "background:#fdd;border-color:#c00" if fb else "background:#eef"
        cells.append(f'<span class="tok" style="display:inline-block;border:1px solid #99c;margin:1px;'
                     f'padding:2px 4px;{style}" title="step {step}{" (fallback)" if fb else ""}">{text}'
                     f"<sub>{step}</sub></span>")
    return "".join(cells) or "(empty)"


def compare_dllm(pair: ModelPair, problem, n: int = 4, seed: int = 0, strategy: str | None = None
                 ) -> dict[str, list[Shown]]:
    """Greedy plus n answers at the rollout temperature (one seeded generator, the same for
    both models), each with its denoising order and NFE."""
    from dllm_rl.backend import fit_prompts
    from dllm_rl.policy import to_sample
    from mmrl.core.config import ConfigError

    out = {}
    for which in ("before", "after"):
        policy, task = pair.get(which)
        try:  # a typed problem longer than the task's (123+456=) widens the prompt, as `sample --prompt` does
            policy = fit_prompts(policy, [problem.prompt])
        except ConfigError as e:  # past the model's context: said without sample's flag name
            raise ValueError(str(e).removeprefix("--prompt: ")) from None
        shown = []
        for label, temperature, gen, count in (("greedy", 0.0, None, 1),
                                                ("sample", policy.rollout.temperature,
                                                 torch.Generator().manual_seed(seed), n)):
            if count == 0:
                continue
            with torch.no_grad():
                result, _ = policy.decode([problem.prompt] * count, gen, temperature=temperature, strategy=strategy)
            texts = policy.answer_text(result.completion)
            for k, ((atoms, total), text) in enumerate(zip(_scored(task.reward, [to_sample(problem, t) for t in texts]),
                                                           texts)):
                if not problem.answer:
                    atoms = {a: (None if a == task.answer_atom else v) for a, v in atoms.items()}
                    total = None
                name = label if label == "greedy" else f"sample {k + 1} (seed {seed})"
                shown.append(Shown(name, text, atoms, total, denoising_order(policy, result, k),
                                   {"nfe": int(result.nfe[k]), "fallback_steps": int(result.fallback[k].sum())
                                    if result.fallback.numel() else 0}))
        out[which] = shown
    return out


# ------------------------------------------------------------------ the default runs


def ensure_default_run(modality: str, progress: Callable[[int, int], None] | None = None,
                       run_dir: str | Path | None = None, overrides: list[str] | None = None) -> RunInfo:
    """The modality's embedded default run (`<cli> train` with no config), trained now if it
    has no final checkpoint; progress(step, total) is called after every step. overrides:
    extra key=value settings (tests use fewer steps)."""
    from mmrl.core.config import load_config
    from mmrl.core.trainer import Trainer

    path = Path(run_dir) if run_dir is not None else default_run_dir(modality)
    try:
        run = RunInfo.load(path)
        if run.summary and run.model_dir() is not None:
            return run
    except (ValueError, OSError):
        pass
    b = backend(modality)
    cfg = load_config(b.CONFIG_CLASS, None, [f"output_dir={path}", "logging.progress=false", *(overrides or [])],
                      defaults=b.DEFAULT_CONFIG)
    policy, task = b.build(cfg)
    trainer = Trainer(cfg, policy, task, backend=b)
    step = trainer.train_step

    def tracked(*args, **kwargs):
        out = step(*args, **kwargs)
        if progress is not None:
            progress(trainer.step + 1, cfg.train.max_steps)
        return out

    trainer.train_step = tracked
    trainer.train()
    return RunInfo.load(path)
