"""CAST's SDE window from the model's own trajectory (docs/methods.md section 4, CAST item 3).

RECONSTRUCTION: no paper text or code was available; the rules below are ours.

Calibration (`calibrate_window`): ODE rollouts (noise level 0, the evaluation sampler) of the
policy on held-out shapes-geneval prompts, `seeds` noise seeds each. At every denoising step
i = 0 .. N-1 (before that step's update) the clean-image estimate

    x0_hat(i) = x_i - sigma_i * v(x_i, sigma_i)

is decoded to an image exactly as the final latents are (the pipeline's VAE, `flow.decode`), and
the shapes-geneval detector gives the prompt's atom verdicts on it (`score_image`, causally
gated, each atom passed iff its score >= 0.5). At the last step x0_hat(N-1) is the final sample
itself (the last Euler step goes to sigma = 0), so the verdicts end at the final image's.

Commit step (`commit_step`): for a sample's verdict sequence V_0 .. V_{N-1}, t* is the smallest
i with V_i = V_{i+1} = ... = V_{N-1} (the first step after which its verdicts no longer change);
0 if they never change. V_i is judged on x_i, before step i's update, so the last change was
made by step t* - 1 (x_{t*-1} -> x_{t*}). "The window ends at t*" is read literally: a window of
W >= 2 steps holds that step and the one after it, W = 1 only the step after it
(method.window_offset = -1 ends the window at the changing step instead).

Window (`window_from_commits`): with m = the lower median of the samples' t* plus `offset`, the
window is W consecutive SDE steps whose last step is m, clamped so that it fits and the last
denoising step (N-1) is never an SDE step:

    end   = min(max(m, W - 1), N - 2)
    start = end - W + 1

(W must be <= N - 1). `diffusion-rl calibrate-window` writes the result as window.json in the
run's directory and stores a copy in the model's directory (cast_window.json, next to its
model_index.json), so the window travels with the checkpoint it was calibrated on. CAST reads
it at build time (`apply_window_file`), setting rollout.window_size = W and a fixed
rollout.window_start = (start, start): from method.window_from when that is a path, else
(method.window_from = "model", the default) from the model's cast_window.json when there is
one. An explicit rollout.window_start always wins.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mmrl.core.config import ConfigError
from mmrl.core.logging import write_atomically
from mmrl.core.runconfig import resolve_file

WINDOW_FILE = "window.json"
MODEL_WINDOW_FILE = "cast_window.json"  # the calibrated window stored in a model directory


@dataclass
class WindowCalibration:
    num_steps: int  # N denoising steps of the calibration rollouts
    window_start: int  # first SDE step of the calibrated window
    window_size: int  # W
    median_commit: int  # lower median of the commit steps (before offset and clamping)
    commit_histogram: list[int]  # [N]: samples whose commit step is i
    change_rate: list[float]  # [N - 1]: fraction of samples whose verdicts change from step i to i + 1
    num_samples: int
    prompts: list[str]
    sigmas: list[float]  # [N + 1] the sampler's schedule
    shift: str
    offset: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def commit_step(verdicts: Sequence) -> int:
    """The first index after which the verdicts no longer change: the smallest i such that
    verdicts[j] == verdicts[-1] for every j >= i. verdicts: one comparable entry per step."""
    if len(verdicts) == 0:
        raise ValueError("commit_step needs at least one step's verdicts")
    t = len(verdicts) - 1
    while t > 0 and verdicts[t - 1] == verdicts[-1]:
        t -= 1
    return t


def window_from_commits(commits: Sequence[int], num_steps: int, window_size: int, offset: int = 0
                        ) -> tuple[int, int, int]:
    """(start, size, median) of the W-step window ending at the lower median commit step plus
    offset, clamped into [0, num_steps - 2] (module docstring)."""
    if not commits:
        raise ValueError("no commit steps: the calibration set is empty")
    if not 1 <= window_size <= num_steps - 1:
        raise ValueError(f"window_size must lie in [1, {num_steps - 1}] (the last of {num_steps} steps is "
                         f"never an SDE step); got {window_size}")
    median = sorted(commits)[(len(commits) - 1) // 2]
    end = min(max(median + offset, window_size - 1), num_steps - 2)
    return end - window_size + 1, window_size, median


def _verdicts(scores: dict[str, float]) -> tuple[bool, ...]:
    return tuple(scores[k] >= 0.5 for k in sorted(scores))


@torch.no_grad()
def calibrate_window(policy, prompts: Sequence[str], num_steps: int, window_size: int, *, seeds: int = 1,
                     offset: int = 0, batch_size: int = 8) -> WindowCalibration:
    """ODE rollouts of `policy` (a DiffusionPolicy) on `prompts` x seeds 0..seeds-1, the atom
    verdicts on x0_hat at every step, and the window they give (module docstring)."""
    from diffusion_rl.tasks.shapes_geneval import can_parse, score_image

    prompts = [p for p in prompts if can_parse(p)]
    if not prompts:
        raise ValueError("calibrate_window needs at least one prompt the shapes-geneval grammar parses")
    flow = policy.flow
    sampler = policy.sampler(num_steps)
    pairs = [(p, s) for p in prompts for s in range(seeds)]
    sequences: list[list[tuple]] = []
    for b in range(0, len(pairs), batch_size):
        chunk = pairs[b:b + batch_size]
        texts = [p for p, _ in chunk]
        cond = flow.encode_prompt(texts)
        x = torch.cat([flow.noise(1, torch.Generator().manual_seed(s)) for _, s in chunk])
        seqs = [[] for _ in chunk]
        for i in range(num_steps):
            sigma = sampler.sigmas[i]
            v = flow.velocity(x, sigma.expand(len(x)), cond)
            x0_hat = x.float() - sigma * v.float()
            for j, (image, text) in enumerate(zip(flow.decode(x0_hat.to(x.dtype)), texts)):
                seqs[j].append(_verdicts(score_image(image, text)))
            x = sampler.step(v, x, i, noise_level=0.0, sde=False).prev_sample
        sequences.extend(seqs)
    commits = [commit_step(s) for s in sequences]
    start, size, median = window_from_commits(commits, num_steps, window_size, offset)
    n = len(sequences)
    change = [sum(s[i] != s[i + 1] for s in sequences) / n for i in range(num_steps - 1)]
    hist = [commits.count(i) for i in range(num_steps)]
    return WindowCalibration(num_steps=num_steps, window_start=start, window_size=size, median_commit=median,
                             commit_histogram=hist, change_rate=change, num_samples=n, prompts=list(prompts),
                             sigmas=[float(s) for s in sampler.sigmas], shift=policy.rollout.shift, offset=offset)


def write_window(cal: WindowCalibration, out_dir: str | Path) -> Path:
    path = Path(out_dir) / WINDOW_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cal.to_dict(), indent=2) + "\n", encoding="utf-8")
    return path


def store_in_model(cal: WindowCalibration, model_dir: str | Path) -> Path:
    """The calibration as cast_window.json in the model's directory; ConfigError when the
    directory cannot be written (nothing is half-written: a temporary file is renamed)."""
    path = Path(model_dir) / MODEL_WINDOW_FILE
    try:
        write_atomically(path, json.dumps(cal.to_dict(), indent=2) + "\n")
    except OSError as e:
        raise ConfigError(f"calibrate-window: cannot store the window in the model directory {model_dir} "
                          f"({e.strerror or e}); pass --no-into-model to write only window.json") from e
    return path


def load_window(path: str | Path, num_steps: int, where: str | None = None,
                shift: str | None = None) -> tuple[int, int]:
    """(start, size) from a window.json, checked against the run's num_steps (and its time
    `shift`, where the file records one: the same steps are other noise levels under another);
    ConfigError naming the file when it is missing, unreadable or inconsistent."""
    path = Path(path)
    where = where or f"method.window_from: {path}"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror or e}); write it with "
                          "`diffusion-rl calibrate-window --config ...`") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object with window_start, window_size and num_steps")
    vals = {}
    for key in ("window_start", "window_size", "num_steps"):
        v = data.get(key)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{where}: {key} must be an integer, got {v!r}")
        vals[key] = v
    start, size, n = vals["window_start"], vals["window_size"], vals["num_steps"]
    if n != num_steps:
        raise ConfigError(f"{where}: calibrated for {n} denoising steps, but rollout.num_steps is {num_steps}; "
                          "re-run calibrate-window with this config")
    if shift is not None and data.get("shift", shift) != shift:
        raise ConfigError(f"{where}: calibrated with rollout.shift {data['shift']!r}, but this run's is {shift!r} "
                          "(its steps are other noise levels); re-run calibrate-window with this config")
    if size < 1 or start < 0 or start + size > num_steps - 1:
        raise ConfigError(f"{where}: window (start {start}, size {size}) does not fit in {num_steps} steps with "
                          "the last step deterministic")
    return start, size


def apply_window_file(cfg, model_dir: str | Path) -> Path | None:
    """CAST at build time: set cfg.rollout's window from method.window_from (a path, or "model":
    the model directory's cast_window.json if it has one) unless rollout.window_start is set
    explicitly. -> the file whose window was applied, or None."""
    source = getattr(cfg.method, "window_from", None)
    if source is None:
        return None
    from_model = source == "model"
    # a path: as the config's other files, from its directory, else the working directory (the
    # run's config.yaml records it so resolved)
    path = Path(model_dir) / MODEL_WINDOW_FILE if from_model else resolve_file(source, getattr(cfg, "base_dir", None))
    if from_model and not path.is_file():
        if cfg.rollout.window_start is None:
            warnings.warn(f"CAST: {model_dir} holds no calibrated window ({MODEL_WINDOW_FILE}): the rollout's own "
                          "window is used (`diffusion-rl calibrate-window` stores one; method.window_from=null "
                          "silences this)", stacklevel=2)
        return None
    if cfg.rollout.window_start is not None:  # the explicit window wins; a named file is worth a word
        if not from_model:
            warnings.warn(f"method.window_from={source} is not used: rollout.window_start="
                          f"{tuple(cfg.rollout.window_start)} is set (configs/diffusion/cast.yaml sets it to "
                          "null; or --set rollout.window_start=null)", stacklevel=2)
        return None
    where = f"{path} (the window stored with the model)" if from_model else None
    steps, shift = _calibrated_with(path) if from_model else (None, None)
    for key, got, want in (("denoising steps", steps, cfg.rollout.num_steps), ("rollout.shift", shift, cfg.rollout.shift)):
        if got not in (None, want):
            warnings.warn(f"{path} was calibrated for {key} {got!r}, not this run's {want!r}: the rollout's own "
                          "window is used (re-run calibrate-window with this config, or set method.window_from=null "
                          "to silence this)", stacklevel=2)
            return None
    start, size = load_window(path, cfg.rollout.num_steps, where, shift=cfg.rollout.shift)
    cfg.rollout.window_size = size
    cfg.rollout.window_start = (start, start)
    return path


def _calibrated_with(path: Path) -> tuple:
    """(num_steps, shift) a window file records, None for what it does not say."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data.get("num_steps"), data.get("shift")
    except (OSError, ValueError, AttributeError):
        return None, None  # load_window then names what is wrong with the file


def summary_line(cal: WindowCalibration) -> str:
    rates = ", ".join(f"{r:.2f}" for r in cal.change_rate)
    return (f"window: steps {cal.window_start}..{cal.window_start + cal.window_size - 1} of {cal.num_steps} "
            f"(median commit step {cal.median_commit}, {cal.num_samples} samples); verdict-change rate per step: "
            f"[{rates}]; commit histogram: {cal.commit_histogram}")


__all__ = ["MODEL_WINDOW_FILE", "WINDOW_FILE", "WindowCalibration", "apply_window_file", "calibrate_window",
           "commit_step", "load_window", "store_in_model", "summary_line", "window_from_commits", "write_window"]
