"""Run directories as the demo and the run report see them.

A training run writes into its output_dir: config.yaml, metrics.jsonl (one JSON row per step),
summary.json (eval_before / eval_after, the final checkpoint), reward_curve.png,
checkpoints/step-N/model (from_pretrained directories) and samples/. `RunInfo.load` reads
what is there (a run still going has no summary yet) and tells its modality from the config.
"""

from __future__ import annotations

import bisect
import importlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mmrl.core.logging import nulled_summary, read_metrics, running_mean

MODALITIES = ("vlm", "diffusion", "dllm")
BACKENDS = {"vlm": "mmrl.vlm.backend", "diffusion": "diffusion_rl.backend", "dllm": "dllm_rl.backend"}
TITLES = {"vlm": "Vision-language", "diffusion": "Flow / diffusion", "dllm": "Diffusion LM"}


class RunError(ValueError):
    """A directory that is not a run (or not one the demo can use); the message names it."""


def modality_of(config: dict[str, Any]) -> str:
    """Which backend a run's config belongs to, from keys only that backend's configs have."""
    rollout = config.get("rollout") or {}
    if "noise_level" in rollout or "window_size" in rollout:
        return "diffusion"
    if "gen_length" in rollout or "block_length" in rollout:
        return "dllm"
    return "vlm"


def backend(modality: str):
    if modality not in BACKENDS:
        raise ValueError(f"unknown modality {modality!r} (known: {', '.join(MODALITIES)})")
    return importlib.import_module(BACKENDS[modality])


def default_run_dir(modality: str) -> Path:
    """Where `<cli> train` with no config writes: the backend's embedded default run."""
    return Path(backend(modality).DEFAULT_CONFIG["output_dir"])


@dataclass
class RunInfo:
    path: Path
    config: dict[str, Any]
    modality: str
    summary: dict[str, Any] | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    kept: dict[int, dict[str, Any]] = field(default_factory=dict)  # kept_summaries: step -> its summary

    @classmethod
    def load(cls, path: str | Path, metrics: list[dict[str, Any]] | None = None) -> RunInfo:
        """`metrics`: the run's metrics.jsonl rows where the caller has read them already (the
        trainer's end of run), so the file is not parsed again."""
        path = Path(path)
        cfg_file = path / "config.yaml"
        if not cfg_file.is_file():
            raise RunError(f"{path} is not a run directory: it has no config.yaml (a training run writes one)")
        try:
            config = yaml.safe_load(cfg_file.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise RunError(f"{cfg_file}: not a readable YAML file: {e}") from e
        summary = None
        if (path / "summary.json").is_file():
            try:
                summary = json.loads((path / "summary.json").read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RunError(f"{path / 'summary.json'}: not valid JSON: {e}") from e
            summary = nulled_summary(summary)  # an older run's "nan" texts and bare NaNs: null, as a new run's
        try:  # a torn last line (a run killed mid-write) is dropped, as the trainer's resume drops it
            metrics = read_metrics(path / "metrics.jsonl") if metrics is None else metrics
        except ValueError as e:  # a bad line before the last: names the file and line
            raise RunError(str(e)) from None
        return cls(path, config, modality_of(config), summary, metrics, kept_summaries(path))

    @property
    def name(self) -> str:
        return self.path.name

    def model_dir(self) -> Path | None:
        """The fine-tuned model: the summary's final checkpoint, else the newest complete one.

        summary.json stores the checkpoint as an absolute path: a run that was copied or moved
        would load the original's model, so this run's own checkpoints/<step>/model comes first."""
        if self.summary and self.summary.get("checkpoint"):
            stored = Path(self.summary["checkpoint"])
            own = self.path / "checkpoints" / stored.parent.name / stored.name
            for final in (own, stored if stored.is_absolute() else self.path / stored):
                if final.is_dir():
                    return final
        # here, not at the top: it imports torch, which `runs` (mmrl.demo.table) need not wait for
        from mmrl.core.checkpoint import latest_checkpoint

        step = latest_checkpoint(self.path / "checkpoints") if (self.path / "checkpoints").is_dir() else None
        return step / "model" if step is not None and (step / "model").is_dir() else None

    def base_model(self) -> str | None:
        """The model the run started from (None: the backend's bundled tiny model)."""
        return (self.config.get("model") or {}).get("path")

    def curves(self) -> dict[str, tuple[list[int], list[float]]]:
        """reward/total per step and every held-out eval/* accuracy logged during training,
        with the before (step 0) and after (last step) evaluations when the summary has them."""
        out: dict[str, tuple[list[int], list[float]]] = {}
        # A row a user or another tool wrote may lack its step or hold a null: it is not plotted.
        rows = [r for r in self.metrics if isinstance(r, dict) and isinstance(r.get("step"), int)]
        for row in rows:
            for key, value in row.items():
                if (key == "reward/total" or (key.startswith("eval/") and "accuracy" in key)) \
                        and isinstance(value, int | float) and math.isfinite(value):  # a JSON NaN: a gap
                    steps, values = out.setdefault(key, ([], []))
                    steps.append(row["step"])
                    values.append(float(value))
        last = int((self.summary or {}).get("steps") or (rows[-1]["step"] if rows else 0))
        for step, kept in self.kept.items():  # the final evaluation of an earlier end (no row holds it)
            for key, value in (kept.get("eval_after") or {}).items():
                if step <= last and key in _accuracy_keys({key: value}):
                    steps, values = out.setdefault(f"eval/{key}", ([], []))
                    if step not in steps:
                        at = bisect.bisect(steps, step)
                        steps.insert(at, step)
                        values.insert(at, float(value))
        if self.summary:
            for key in _accuracy_keys(self.summary.get("eval_before") or {}):
                steps, values = out.setdefault(f"eval/{key}", ([], []))
                before, after = self.summary["eval_before"][key], (self.summary.get("eval_after") or {}).get(key)
                steps.insert(0, 0)
                values.insert(0, float(before))
                if after is not None and (not steps or steps[-1] != last):
                    steps.append(last)
                    values.append(float(after))
        return out


def kept_summaries(path: Path) -> dict[int, dict[str, Any]]:
    """The summaries of the run's earlier ends, by step: --resume of a finished run (max_steps
    raised) keeps its summary.json as summary.step-N.json, whose eval_after is the evaluation at
    step N that no metrics.jsonl row holds. One that cannot be read is left out (the curves lack
    its point, nothing else)."""
    out = {}
    for p in path.glob("summary.step-*.json"):
        step = p.name.removeprefix("summary.step-").removesuffix(".json")
        try:
            summary = json.loads(p.read_text(encoding="utf-8")) if step.isdigit() else None
        except (OSError, ValueError):  # a damaged file; UnicodeDecodeError is a ValueError
            continue
        if isinstance(summary, dict):
            out[int(step)] = nulled_summary(summary)
    return dict(sorted(out.items()))


def _accuracy_keys(metrics: dict[str, Any]) -> list[str]:
    return [k for k, v in metrics.items() if "accuracy" in k and isinstance(v, int | float) and "/" not in k]


def plot_curves(run: RunInfo, out: str | Path | None = None):
    """A two-panel figure: training reward per step, held-out accuracies. Saved as PNG when
    `out` is given; returned as a PIL image otherwise."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    from PIL import Image

    curves = run.curves()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4), dpi=100)
    if "reward/total" in curves:
        steps, values = curves["reward/total"]
        left.plot(steps, values, alpha=0.5, label="batch mean", marker="." if len(values) < 30 else None)
        left.plot(steps, running_mean(values), label=f"running mean ({max(1, len(values) // 10)})")
        left.legend(fontsize=8)
    left.set(title="training reward", xlabel="step")
    for key, (steps, values) in sorted(curves.items()):
        if key.startswith("eval/"):
            right.plot(steps, values, marker="o", label=key[5:])
    if any(k.startswith("eval/") for k in curves):
        right.legend(fontsize=8)
    right.set(title="held-out accuracy", xlabel="step")
    for ax in (left, right):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: no 1.25 or 2.5 on a short run's axes
        ax.grid(alpha=0.3)
    fig.suptitle(f"{run.name} ({TITLES[run.modality]})", fontsize=10)
    fig.tight_layout()
    if out is not None:
        fig.savefig(out)
        plt.close(fig)
        return Path(out)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    buf.seek(0)
    return Image.open(buf).convert("RGB")
