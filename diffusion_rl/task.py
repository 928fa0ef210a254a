"""The diffusion backend's task: prompts to train on, the reward, and held-out evaluation.

Evaluation samples every held-out prompt with the ODE (no noise) from fixed seeds, the
same before and after training, and checks each atom with the shapes-geneval detector:
per-type atom accuracy (exist, count, colour, relation), all atoms, whole prompts. Held-out
prompts the shapes grammar cannot decompose (task.unparsed=whole_prompt) are left out of
those (nan if none is left) and scored by the task's reward instead, whose shapes atoms give
them 0: `unparsed_prompts` (how many) and `whole_prompt_reward` (the mean total over their images).
The hardest prompts, those with at least `hard_min_atoms` atoms, are also scored on their own
under `hard/` (the same keys). A run with other atoms (task.image_atoms, such as a CLIP score,
or reward.atoms) also gets `reward` (the mean total over every image) and each such atom's mean. In shapes-geneval a prompt has 3 atoms (one phrase) or 7 (two
phrases and a relation), so the default 4 picks the relational prompts.
`save_samples` draws a grid of the first held-out prompts for before/after comparison.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from diffusion_rl.policy import to_sample
from diffusion_rl.tasks.shapes_geneval import (
    ATOM_TYPES,
    atom_accuracy,
    cached_detect,
    can_parse,
    evaluate_atoms,
    parse_prompt,
)
from mmrl.core import distributed
from mmrl.core.jsonl import HeldOutWarning
from mmrl.core.rewards import Reward


class DiffusionTask:
    def __init__(self, name: str, train: Sequence[str], evaluation: Sequence[str], reward: Reward, *,
                 eval_seeds: int = 1, eval_steps: int = 10, grid_prompts: int = 8, hard_min_atoms: int = 4):
        self.name = name
        self.train = list(train)
        self.eval_prompts = list(evaluation)
        self.reward = reward
        self.eval_seeds = eval_seeds
        self.eval_steps = eval_steps
        self.grid_prompts = grid_prompts
        self.hard_min_atoms = hard_min_atoms
        self._grid_drawn = None  # (policy, images): the grid's images as evaluate last drew them
        if self.eval_prompts and not any(can_parse(p) and len(parse_prompt(p)) >= hard_min_atoms
                                         for p in self.eval_prompts):
            warnings.warn(f"task.hard_min_atoms={hard_min_atoms}: no held-out prompt has that many atoms, so "
                          "evaluation reports no hard/* metrics", HeldOutWarning, stacklevel=2)

    # what evaluate() logs beside each atom's mean (a config atom may not take these names)
    metric_names = ("reward", "atom_accuracy", "prompt_accuracy", "unparsed_prompts", "whole_prompt_reward")
    metric_prefixes = ("hard/",)

    def train_prompts(self) -> list[str]:
        return self.train

    def other_atoms(self) -> list[str]:
        """The reward's atoms beside the scene-graph types: task.image_atoms (a CLIP score...)
        and the run's reward.atoms, which evaluation and sampling report one by one."""
        return [name for name in self.reward.names if name not in (*ATOM_TYPES, "all")]

    def _jobs(self, prompts: Sequence[str]) -> tuple[list[str], list[int]]:
        """(prompt, seed) pairs: seed j of prompt i is 1000 j + i, fixed for the run's life."""
        pairs = [(p, 1000 * j + i) for i, p in enumerate(prompts) for j in range(self.eval_seeds)]
        return [p for p, _ in pairs], [s for _, s in pairs]

    def evaluate(self, policy, batch_size: int = 32, progress=None, rows: list | None = None) -> dict[str, float]:
        """The metrics above; `progress` (mmrl.core.held_out.EvalProgress) counts the images, and
        `rows` gets one dict per image: prompt, seed, atoms (each scene-graph atom's verdict, for a
        prompt the grammar parses) and prompt_correct (all of them pass), scores and total (the reward's, where evaluation scores the
        image with it). The images are not kept: at FLUX's sizes a held-out set's are gigabytes
        (the grid, save_samples, keeps the first prompts')."""
        prompts, seeds = self._jobs(self.eval_prompts)

        extra = self.other_atoms()

        def sample(jobs):  # each image's noise is fixed by its seed: any rank draws it alike
            images = draw(policy, [p for p, _ in jobs], [s for _, s in jobs], self.eval_steps, batch_size, progress)
            # the reward's scores where evaluation reports them (below), each rank its share's:
            # every image for the other atoms (a CLIP or reward model), else the unparsed prompts'
            scored = [k for k, (p, _) in enumerate(jobs) if extra or not can_parse(p)]
            rows = [None] * len(jobs)
            if scored:
                scores = self.reward.score([to_sample(jobs[k][0], images[k]) for k in scored])
                for j, k in enumerate(scored):
                    rows[k] = (scores.values[j].tolist(), float(scores.total[j]))
            return list(zip(images, rows))

        sampled = distributed.map_shards(sample, list(zip(prompts, seeds)))  # each rank samples and scores its share
        images = [i for i, _ in sampled]
        # The grid's (prompt, seed) jobs are the first ones here: save_samples, which the trainer
        # calls next under the same weights, takes these images instead of drawing them again.
        self._grid_drawn = (policy, images[: len(self.eval_prompts[: self.grid_prompts]) * self.eval_seeds])
        ok = [can_parse(p) for p in prompts]
        if any(ok):
            acc = atom_accuracy([i for i, k in zip(images, ok) if k], [p for p, k in zip(prompts, ok) if k])
        else:
            acc = dict.fromkeys((*ATOM_TYPES, "atoms", "all"), float("nan"))
        out = _named(acc)
        hard = [k and len(parse_prompt(p)) >= self.hard_min_atoms for p, k in zip(prompts, ok)]
        if any(hard):
            sub = atom_accuracy([i for i, h in zip(images, hard) if h], [p for p, h in zip(prompts, hard) if h])
            out.update({f"hard/{k}": v for k, v in _named(sub).items()})
            out["hard/num_prompts"] = float(len({p for p, h in zip(prompts, hard) if h}))
        if not all(ok):
            out["unparsed_prompts"] = float(len({p for p, k in zip(prompts, ok) if not k}))
            out["whole_prompt_reward"] = float(torch.tensor([r[1] for (_, r), k in zip(sampled, ok) if not k],
                                                            dtype=torch.float32).double().mean())  # as "reward"
        if extra:  # scored as training scores them
            values = torch.tensor([r[0] for _, r in sampled], dtype=torch.float32).reshape(len(sampled), len(self.reward.names))
            out["reward"] = float(torch.tensor([r[1] for _, r in sampled], dtype=torch.float32).double().mean())
            out.update({name: float(values[:, self.reward.names.index(name)].double().mean()) for name in extra})
        if rows is not None:
            for prompt, seed, image, scored, parsed in zip(prompts, seeds, images, (r for _, r in sampled), ok):
                row = {"prompt": prompt, "seed": seed}
                if parsed:  # atom_accuracy's detections (cached): none made again
                    row["atoms"] = evaluate_atoms(parse_prompt(prompt), cached_detect(image))
                    row["prompt_correct"] = all(v >= 0.5 for v in row["atoms"].values())  # as prompt_accuracy counts
                if scored is not None:
                    row.update(scores=dict(zip(self.reward.names, scored[0])), total=scored[1])
                rows.append(row)
        return out

    def save_samples(self, policy, out_dir: str | Path, tag: str, batch_size: int = 32) -> Path | None:
        """A grid PNG (one row per prompt, one column per seed) and the prompts as JSON; drawn
        batch_size images at a time, as evaluate draws them (grid_prompts x eval_seeds may be many)."""
        prompts = self.eval_prompts[: self.grid_prompts]
        if not prompts:
            return None
        texts, seeds = self._jobs(prompts)
        drawn, self._grid_drawn = self._grid_drawn, None  # taken once: later weights draw afresh
        if drawn is not None and drawn[0] is policy and len(drawn[1]) == len(texts):
            images = drawn[1]  # the evaluation just before drew these (a second draw took ~10% of it)
        else:
            images = draw(policy, texts, seeds, self.eval_steps, batch_size)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"grid_{tag}.png"
        grid(images, len(prompts), self.eval_seeds).save(path)
        (out / f"grid_{tag}.json").write_text(json.dumps({"rows": prompts, "seeds": seeds}, indent=1))
        return path


def draw(policy, texts: list[str], seeds: list[int], steps: int, batch_size: int = 32,
         progress=None) -> list[Image.Image]:
    """policy.sample_images of each (text, seed), batch_size images at a time: evaluation's, the
    grids' and `sample`'s draws may be many more than a GPU holds at once at FLUX's sizes.
    `progress` (mmrl.core.held_out.EvalProgress) counts them."""
    images = []
    if progress is not None:
        progress.expect(len(texts))
    for start in range(0, len(texts), batch_size):
        images += policy.sample_images(texts[start: start + batch_size], seeds[start: start + batch_size], steps)
        if progress is not None:
            progress.advance(len(texts[start: start + batch_size]))
    return images


def grid(images: Sequence[Image.Image], rows: int, cols: int, pad: int = 2, label: int = 10) -> Image.Image:
    """Tile images row-major with a white margin and the row number on the left."""
    w, h = images[0].size
    sheet = Image.new("RGB", (label + cols * (w + pad) + pad, rows * (h + pad) + pad), "white")
    draw = ImageDraw.Draw(sheet)
    for k, img in enumerate(images):
        r, c = divmod(k, cols)
        sheet.paste(img.convert("RGB"), (label + pad + c * (w + pad), pad + r * (h + pad)))
        if c == 0:
            draw.text((1, pad + r * (h + pad) + h // 2 - 5), str(r), fill="black")
    return sheet


def _named(acc: dict[str, float]) -> dict[str, float]:
    return {("atom_accuracy" if k == "atoms" else "prompt_accuracy" if k == "all" else k): v
            for k, v in acc.items() if k != "num_images"}
