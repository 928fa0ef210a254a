"""Pre-train the bundled tiny flow model (assets/tiny-flow) on shapes-geneval scenes.

A FLUX-style pipeline (diffusion_rl.tiny.build_tiny: FluxTransformer2DModel, tiny CLIP + T5 text
encoders) is trained by plain flow matching on rendered scenes of generated prompts:
x_sigma = (1 - sigma) x0 + sigma eps, target v = eps - x0, sigma logit-normal. Two spaces:

- latent (`--vae DIR`, the bundled model): x0 is the scene through the tiny VAE that
  scripts/train_tiny_vae.py trains (64 x 64 pixels -> 16 x 16 x 4 latents, 2 x 2-packed: 64
  tokens of 16), FLUX's own layout; the transformer predicts v.
- pixel (no --vae; assets/tiny-flow-pixel, the bundled model until 2026-11-30): 4 x 4-pixel
  patches (256 tokens of 48), the transformer predicts the clean image and the loss is on the
  velocity it implies (x-prediction, v-loss: see diffusion_rl/models.py).

Only the transformer trains; the random text encoders are frozen, as RL keeps them. Every
`--eval-every` steps the held-out atom accuracy (ODE sampling, the shapes-geneval detector) is
measured; training stops after `--steps`, or earlier at the first evaluation at or above
`--target`. The defaults made both models: 2500 steps (latent: about 9 min on 2 cores, held-out
atom accuracy 0.38; pixel: about 30 min, 0.46) -- recognisable shapes in mostly the right
colours, counts and relations often wrong: room for RL (pretrain.json has the whole record).

    python scripts/train_tiny_vae.py --out /tmp/tiny-vae        # rebuilds assets/tiny-flow:
    python scripts/pretrain_tiny_flow.py --vae /tmp/tiny-vae    #   the VAE, then the flow model
    python scripts/pretrain_tiny_flow.py                         # rebuilds assets/tiny-flow-pixel

Deterministic for a seed on a CPU with the same thread count (`--threads`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from diffusion_rl.models import load_flow_model, pil_to_tensor
from diffusion_rl.policy import DiffusionPolicy
from diffusion_rl.task import DiffusionTask
from diffusion_rl.tasks.shapes_geneval import render, sample_prompts, shapes_geneval_reward
from diffusion_rl.tiny import build_tiny

ROOT = Path(__file__).resolve().parents[1]
TRANSFORMER = {"num_layers": 2, "num_single_layers": 2, "attention_head_dim": 32, "num_attention_heads": 4,
               "axes_dims_rope": (8, 12, 12)}


class _Rollout:  # what DiffusionPolicy reads for evaluation (ODE: no noise)
    shift, noise_level, kind = "flux", 0.0, "sde"


def evaluate(flow, prompts, steps: int) -> dict[str, float]:
    task = DiffusionTask("shapes-geneval", [], prompts, shapes_geneval_reward(), eval_steps=steps)
    with torch.no_grad():
        return task.evaluate(DiffusionPolicy(flow, _Rollout()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="default: assets/tiny-flow with --vae, else assets/tiny-flow-pixel")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=int, default=6000, help="rendered training scenes")
    p.add_argument("--steps", type=int, default=2500, help="most training steps")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-prompts", type=int, default=48)
    p.add_argument("--eval-steps", type=int, default=10)
    p.add_argument("--target", type=float, default=0.9, help="stop early at this held-out atom accuracy")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prediction", choices=["sample", "velocity"], default=None,
                   help="what the transformer outputs: the clean image (x-prediction; pixel space's default) "
                        "or v (latent space's default and only choice)")
    p.add_argument("--patch", type=int, default=4, help="pixels per token side (64 px / 4 = 16 x 16 tokens)")
    p.add_argument("--vae", default=None,
                   help="a trained AutoencoderKL directory (scripts/train_tiny_vae.py): pre-train in its latent "
                        "space (2 x 2-packed latents, FLUX's layout) instead of pixel space")
    args = p.parse_args(argv)
    args.out = args.out or str(ROOT / "assets" / ("tiny-flow" if args.vae else "tiny-flow-pixel"))
    args.prediction = args.prediction or ("velocity" if args.vae else "sample")
    if args.vae and args.prediction != "velocity":
        p.error("--vae: latent models predict the velocity (x-prediction is a pixel-space option)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    work = Path(tempfile.mkdtemp(prefix="tiny-flow-"))
    build_tiny("flux", work, seed=args.seed, pixel_space=not args.vae, patch_size=args.patch, transformer=TRANSFORMER,
               text_width=64, prediction=args.prediction)
    if args.vae:  # the trained VAE replaces build_tiny's random one
        shutil.rmtree(work / "vae")
        shutil.copytree(args.vae, work / "vae")
    flow = load_flow_model(work)
    n_params = sum(x.numel() for x in flow.transformer.parameters())
    print(f"transformer: {n_params / 1e6:.2f} M parameters; {flow.seq_len} image tokens of {flow.channels}")

    t0 = time.perf_counter()
    # Pre-training prompts come from their own seed: the RL task's train/eval streams stay unseen.
    prompts = sample_prompts(args.data, args.seed + 1000, split="train")
    images = pil_to_tensor([render(q, seed=i) for i, q in enumerate(prompts)])
    x0 = torch.cat([flow.encode_images(images[i: i + 256]) for i in range(0, len(images), 256)])
    cond = {}
    for start in range(0, len(prompts), 256):
        part = flow.encode_prompt(prompts[start: start + 256])
        for k, v in part.items():
            cond.setdefault(k, []).append(v)
    cond = {k: torch.cat(v) for k, v in cond.items()}
    eval_prompts = sample_prompts(args.eval_prompts, args.seed, split="eval")
    print(f"data: {len(prompts)} scenes rendered and encoded in {time.perf_counter() - t0:.0f} s")

    params = [q for q in flow.transformer.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    warmup = 100
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: min(1.0, (n + 1) / warmup))
    gen = torch.Generator().manual_seed(args.seed)
    history = []
    flow.transformer.train()
    step, acc = 0, {}
    t0 = time.perf_counter()
    while step < args.steps:
        idx = torch.randint(0, len(prompts), (args.batch,), generator=gen)
        x = x0[idx]
        eps = torch.randn(x.shape, generator=gen)
        sigma = torch.sigmoid(torch.randn(args.batch, generator=gen))  # logit-normal (SD3)
        xt = (1 - sigma)[:, None, None] * x + sigma[:, None, None] * eps
        v = flow.velocity(xt, sigma, {k: t[idx] for k, t in cond.items()})
        loss = torch.nn.functional.mse_loss(v, eps - x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        if step % 50 == 0:
            print(f"step {step}: loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        if step % args.eval_every == 0:
            flow.transformer.eval()
            acc = evaluate(flow, eval_prompts, args.eval_steps)
            flow.transformer.train()
            history.append({"step": step, "loss": loss.item(), **acc})
            print(f"step {step}: held-out atom accuracy {acc['atom_accuracy']:.3f} "
                  + " ".join(f"{k} {v:.2f}" for k, v in acc.items() if k != "atom_accuracy"), flush=True)
            if acc["atom_accuracy"] >= args.target:
                break
    flow.transformer.eval()
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    flow.save_pretrained(out)
    record = {"seed": args.seed, "steps": step, "batch": args.batch, "lr": args.lr, "data": args.data,
              "patch": None if args.vae else args.patch, "prediction": args.prediction,
              "space": "latent (vae/vae_record.json)" if args.vae else "pixel", "eval_prompts": args.eval_prompts,
              "eval_every": args.eval_every,
              "target": args.target, "threads": args.threads, "transformer": TRANSFORMER,
              "final": acc, "history": history, "seconds": round(time.perf_counter() - t0)}
    if args.vae and (Path(args.vae) / "vae_record.json").is_file():  # how the VAE was made travels with it
        shutil.copy(Path(args.vae) / "vae_record.json", out / "vae" / "vae_record.json")
    (out / "pretrain.json").write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(work)
    print(f"saved {out} after {step} steps: atom accuracy {acc.get('atom_accuracy', float('nan')):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
