"""Which joint-attention layers of a flow model point at the objects: for CAST's projection.

Held-out shapes-geneval scenes are rendered, encoded and noised to sigma; teacher-forced, each
layer's image-query -> text-key attention to the "exist" words (the objects' names) gives a
map; the ratio of its mean inside the objects' boxes to its mean outside, per prompt, is
reported as the median and the share of prompts above 1 (1 = no preference).

    python benchmarks/cast_attention_layers.py                         # the bundled model
    python benchmarks/cast_attention_layers.py --model assets/tiny-flow-pixel --sigmas 0.7
"""

from __future__ import annotations

import argparse

import torch

from diffusion_rl import backend
from diffusion_rl.attention_maps import (
    TextAttention,
    atom_maps,
    image_tokens_inside,
    joint_attention_modules,
    text_key_spans,
)
from diffusion_rl.models import load_flow_model, pil_to_tensor
from diffusion_rl.scene_graph import shapes_geneval_spans
from diffusion_rl.tasks.shapes_geneval import make_scene, render, sample_prompts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the bundled tiny flow model)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--sigmas", type=float, nargs="+", default=[0.95, 0.85, 0.7])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.prompts < 1:
        ap.error(f"--prompts must be >= 1, got {args.prompts}")
    flow = load_flow_model(args.model or backend.bundled_model_dir())
    n = args.prompts
    prompts = sample_prompts(n, 1, split="eval")
    scenes = [make_scene(p, seed=i) for i, p in enumerate(prompts)]
    inside = [image_tokens_inside(s.box_mask(), flow.grid[0]) for s in scenes]
    x0 = flow.encode_images(pil_to_tensor([render(s) for s in scenes]))
    eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(args.seed))
    cond = flow.encode_prompt(prompts)
    spans = text_key_spans(flow, prompts)
    atoms = [shapes_geneval_spans(p) for p in prompts]
    print("| sigma | layers | median inside / outside | share of prompts > 1 |\n|---|---|---|---|")
    for sigma in args.sigmas:
        for layers in [[i] for i in range(len(joint_attention_modules(flow)))] + [None]:
            with TextAttention(flow, layers) as rec, torch.no_grad():
                flow.velocity((1 - sigma) * x0 + sigma * eps, torch.full((n,), sigma), cond)
            maps = atom_maps(rec.result(n), spans, atoms, ["exist"])
            ratio = torch.stack([maps[i, 0][inside[i]].mean() / maps[i, 0][~inside[i]].mean() for i in range(n)])
            name = "middle half (default)" if layers is None else str(layers)
            print(f"| {sigma} | {name} | {ratio.median():.2f} | {(ratio > 1).float().mean():.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
