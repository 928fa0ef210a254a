"""Train the tiny VAE of the bundled latent flow model on shapes-geneval scenes.

A diffusers AutoencoderKL (FLUX-style: no quant convs, 4 latent channels; 3 blocks, so 64 x 64
images become 16 x 16 x 4 latents, 12x fewer noise dimensions than the pixels) trained on
rendered scenes with an L1 + MSE reconstruction loss and a small KL term (Stable Diffusion's
VAE recipe without the GAN and perceptual losses, which flat-coloured shapes do not need).
Afterwards scaling_factor and shift_factor are set from the latents of the training scenes
(1 / std and mean, as FLUX's and SD3's VAE configs hold), and the shapes-geneval detector is
run on held-out reconstructions: its atom accuracy on them, next to that on the renderings
themselves, says what the VAE costs the reward (written to vae_record.json).

    python scripts/train_tiny_vae.py --out /tmp/tiny-vae
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from diffusion_rl.models import pil_to_tensor
from diffusion_rl.tasks.shapes_geneval import atom_accuracy, render, sample_prompts


def tensor_to_images(x: torch.Tensor):
    from PIL import Image

    a = ((x.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(im) for im in a]


def build_vae(size: int, channels: tuple[int, ...]):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * len(channels),
        up_block_types=("UpDecoderBlock2D",) * len(channels),
        block_out_channels=channels,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=size,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory the VAE is saved to (save_pretrained)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=int, default=6000, help="rendered training scenes")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--kl", type=float, default=1e-6, help="weight of the KL term")
    p.add_argument("--channels", type=int, nargs="+", default=[16, 32, 32],
                   help="block widths; n blocks downsample by 2^(n-1)")
    p.add_argument("--eval-scenes", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    # Scenes from their own prompt seed (as the flow model's pre-training): RL's streams stay unseen.
    prompts = sample_prompts(args.data, args.seed + 2000, split="train")
    x = pil_to_tensor([render(q, seed=i) for i, q in enumerate(prompts)])
    vae = build_vae(x.shape[-1], tuple(args.channels))
    opt = torch.optim.AdamW(vae.parameters(), lr=args.lr, weight_decay=0.0)
    warm = max(1, args.steps // 20)  # linear warm-up, then cosine to zero
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda n: min((n + 1) / warm, 0.5 * (1 + np.cos(np.pi * min(n, args.steps) / args.steps))))
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    vae.train()
    for step in (bar := tqdm(range(args.steps), desc="vae", mininterval=5)):
        batch = x[torch.randint(0, len(x), (args.batch,), generator=gen)]
        post = vae.encode(batch).latent_dist
        rec = vae.decode(post.sample(generator=gen)).sample
        loss = (rec - batch).abs().mean() + ((rec - batch) ** 2).mean() + args.kl * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
    vae.eval()

    with torch.no_grad():  # latent statistics -> the config's scaling and shift (unit-variance latents)
        z = torch.cat([vae.encode(x[i: i + 256]).latent_dist.mean for i in range(0, len(x), 256)])
        vae.register_to_config(shift_factor=float(z.mean()), scaling_factor=float(1.0 / z.std()))
        held = sample_prompts(args.eval_scenes, args.seed + 3000, split="eval")
        clean = [render(q, seed=10_000 + i) for i, q in enumerate(held)]
        rec = vae.decode(vae.encode(pil_to_tensor(clean)).latent_dist.mean).sample
    before, after = atom_accuracy(clean, held), atom_accuracy(tensor_to_images(rec), held)
    out = Path(args.out)
    vae.save_pretrained(out)
    record = {"seed": args.seed, "steps": args.steps, "batch": args.batch, "lr": args.lr, "kl": args.kl,
              "channels": args.channels, "data": args.data, "threads": args.threads,
              "scaling_factor": vae.config.scaling_factor, "shift_factor": vae.config.shift_factor,
              "detector_on_renderings": before, "detector_on_reconstructions": after,
              "seconds": round(time.perf_counter() - t0)}
    (out / "vae_record.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
