"""What sharing a group's images saves: the G samples of a prompt carry the same image, so
VLMPolicy cuts it into patches once per rollout (`_encode_repeated`) and runs the vision
tower on it once per rollout and per training forward (`_shared_image_inputs`,
`_image_inputs`). This times the rollout and the update (forward + backward) both ways,
alternating, on the main job's batches (bundled tiny Qwen2.5-VL, shapes-qa, 8 prompts x
G 8), and checks that the two give the same samples, log-probs and gradients.

    python benchmarks/vlm_shared_images.py              # 20 batches, 3 timed repeats each
    python benchmarks/vlm_shared_images.py --batches 4  # quick

Prints per-batch mean seconds of each path and the ratio per-row / shared.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from mmrl.core.config import load_config
from mmrl.vlm import backend
from mmrl.vlm.policy import VLMPolicy


@contextlib.contextmanager
def per_row():
    """Encode every row's images, as before sharing."""
    saved = {k: VLMPolicy.__dict__[k] for k in ("_encode_repeated", "_shared_image_inputs", "_takes_encoded_images")}
    VLMPolicy._encode_repeated = lambda self, prompts, g: self.encode([p for p in prompts for _ in range(g)])
    VLMPolicy._shared_image_inputs = lambda self, inputs, rows: inputs
    VLMPolicy._takes_encoded_images = property(lambda self: False)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(VLMPolicy, k, v)


def forward_backward(policy: VLMPolicy, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    policy.model.zero_grad()
    logp = policy.logprobs(batch)
    logp.sum().backward()
    return logp.detach(), [p.grad.clone() for p in policy.model.parameters() if p.grad is not None]


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=20, help="rollout batches to time on")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats of each path per batch")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.batches < 1 or args.repeats < 1:  # no timing to take a mean of
        ap.error(f"--batches and --repeats must be >= 1, got {args.batches} and {args.repeats}")

    cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG)
    policy, task = backend.build(cfg)
    p, n = cfg.rollout.prompts_per_step, cfg.rollout.num_generations
    times = {k: [] for k in ("rollout shared", "rollout per row", "update shared", "update per row")}
    worst_logp = worst_grad = 0.0
    for b in range(args.batches):
        prompts = task.train[b * p: (b + 1) * p]
        for r in range(args.repeats):
            seed = args.seed * 100_000 + b * args.repeats + r
            dt, batch = timed(policy.generate, prompts, n, cfg.rollout, torch.Generator().manual_seed(seed))
            times["rollout shared"].append(dt)
            with per_row():
                dt, same = timed(policy.generate, prompts, n, cfg.rollout, torch.Generator().manual_seed(seed))
            times["rollout per row"].append(dt)
            if not torch.equal(batch.data["completion_ids"], same.data["completion_ids"]):
                raise SystemExit(f"batch {b}: the two rollouts sampled different completions")
            dt, (a, ga) = timed(forward_backward, policy, batch)
            times["update shared"].append(dt)
            with per_row():
                dt, (c, gc) = timed(forward_backward, policy, batch)
            times["update per row"].append(dt)
            worst_logp = max(worst_logp, (a - c).abs().max().item())
            worst_grad = max(worst_grad, max((x - y).abs().max().item() for x, y in zip(ga, gc)))
    for k, v in times.items():
        print(f"{k:16s} {statistics.mean(v):.4f} s (median {statistics.median(v):.4f})")
    for what in ("rollout", "update"):
        ratio = statistics.mean(times[f"{what} per row"]) / statistics.mean(times[f"{what} shared"])
        print(f"{what}: per row / shared = {ratio:.2f}x")
    both = [sum(statistics.mean(times[f"{w} {how}"]) for w in ("rollout", "update")) for how in ("per row", "shared")]
    print(f"rollout + update: per row / shared = {both[0] / both[1]:.2f}x")
    print(f"largest difference, shared vs per row: log-prob {worst_logp:.2e}, gradient {worst_grad:.2e}")


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
