"""What sharing a group's images saves: the G samples of a prompt carry the same image, so
VLMPolicy cuts it into patches once per rollout (`_encode_repeated`) and runs the vision
tower on it once per training forward (`_image_inputs`). This times both side by side with
doing it for every row, alternating, on the main job's batches (bundled tiny Qwen2.5-VL,
shapes-qa, 8 prompts x G 8), and checks that the two give the same log-probs and gradients.

    python benchmarks/vlm_shared_images.py              # 20 batches, 3 timed repeats each
    python benchmarks/vlm_shared_images.py --batches 4  # quick

Prints per-batch mean seconds of each path and the ratio per-row / shared.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mmrl.core.config import load_config
from mmrl.vlm import backend
from mmrl.vlm.policy import VLMPolicy


def forward_backward(policy: VLMPolicy, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    policy.model.zero_grad()
    logp = policy.logprobs(batch)
    logp.sum().backward()
    return logp.detach(), [p.grad.clone() for p in policy.model.parameters() if p.grad is not None]


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=20, help="rollout batches to time on")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats of each path per batch")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG)
    policy, task = backend.build(cfg)
    g = torch.Generator().manual_seed(args.seed)
    p, n = cfg.rollout.prompts_per_step, cfg.rollout.num_generations
    shared_cls = VLMPolicy._takes_encoded_images
    per_row_cls = property(lambda self: False)
    times = {k: [] for k in ("encode shared", "encode per row", "update shared", "update per row")}
    worst_logp = worst_grad = 0.0
    for b in range(args.batches):
        prompts = task.train[b * p: (b + 1) * p]
        items = [x for x in prompts for _ in range(n)]
        batch = policy.generate(prompts, n, cfg.rollout, g)
        for _ in range(args.repeats):
            times["encode shared"].append(timed(policy._encode_repeated, prompts, n))
            times["encode per row"].append(timed(policy.encode, items))
            VLMPolicy._takes_encoded_images = shared_cls
            times["update shared"].append(timed(forward_backward, policy, batch))
            VLMPolicy._takes_encoded_images = per_row_cls
            times["update per row"].append(timed(forward_backward, policy, batch))
        VLMPolicy._takes_encoded_images = shared_cls
        a, ga = forward_backward(policy, batch)
        VLMPolicy._takes_encoded_images = per_row_cls
        c, gc = forward_backward(policy, batch)
        VLMPolicy._takes_encoded_images = shared_cls
        worst_logp = max(worst_logp, (a - c).abs().max().item())
        worst_grad = max(worst_grad, max((x - y).abs().max().item() for x, y in zip(ga, gc)))
    for k, v in times.items():
        print(f"{k:16s} {statistics.mean(v):.4f} s (median {statistics.median(v):.4f})")
    for what in ("encode", "update"):
        ratio = statistics.mean(times[f"{what} per row"]) / statistics.mean(times[f"{what} shared"])
        print(f"{what}: per row / shared = {ratio:.2f}x")
    print(f"largest difference, shared vs per row: log-prob {worst_logp:.2e}, gradient {worst_grad:.2e}")


if __name__ == "__main__":
    main()
