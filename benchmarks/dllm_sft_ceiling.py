"""What supervision could do at an RL run's budget: the bundled tiny dLLM fine-tuned with the
masked-diffusion ELBO (the pre-training loss) on the very prompts, batch and number of
optimizer steps of the default diffu-GRPO run, and held-out greedy accuracy along the way.

Two kinds of targets:
    reference   the task's exact answers: every prompt supervised, every answer right.
                Nothing a reward-driven update sees carries more information per prompt,
                so this bounds what RL at this budget could be expected to teach.
    own         the model's own correct samples (G at the rollout temperature, the right
                ones kept, re-sampled every step): rejection-sampling fine-tuning, RL's
                positive half with no negative signal and no ratio.

Each step takes the next `prompts_per_step` prompts of the training stream (the trainer's
PromptStream, same seed), repeats each `num_generations` times with independent masks, and
takes `ppo_epochs` optimizer steps (AdamW, the config's betas and clipping) on fresh masks.

    python benchmarks/dllm_sft_ceiling.py --lrs 3e-5 1e-4 3e-4 1e-3
    python benchmarks/dllm_sft_ceiling.py --targets own --lrs 3e-5 1e-4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dllm_rl import backend
from dllm_rl.logprob import elbo_loss, forward_mask
from dllm_rl.policy import to_sample
from mmrl.core.config import load_config
from mmrl.core.scheduler import PromptStream

ROOT = Path(__file__).resolve().parents[1]


def own_correct(policy, task, problems, g: int, temperature: float, gen) -> tuple[list, list[str], float]:
    """The problems and answers among g samples per problem that the answer atom accepts."""
    reps = [p for p in problems for _ in range(g)]
    texts, _ = task.answers(policy, reps, temperature, gen)
    scores = task.reward.score([to_sample(p, t) for p, t in zip(reps, texts)])
    ok = scores.values[:, scores.names.index(task.answer_atom)] >= 0.5
    keep = [i for i in range(len(reps)) if ok[i]]
    return [reps[i] for i in keep], [texts[i] for i in keep], float(ok.float().mean())


def run(cfg_path: Path | None, lr: float, targets: str, steps: int, eval_every: int, seed: int, extra: list[str],
        keep_policy: bool = False) -> dict:
    """One fine-tuning run; its held-out evaluations ("curve"), and the policy if keep_policy."""
    cfg = load_config(backend.CONFIG_CLASS, cfg_path, [f"seed={seed}", f"optim.lr={lr}", *extra],
                      defaults=backend.DEFAULT_CONFIG)
    torch.manual_seed(seed)
    policy, task = backend.build(cfg)
    model = policy.model
    oc, r = cfg.optim, cfg.rollout
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=oc.betas,
                            eps=oc.eps, weight_decay=oc.weight_decay)
    stream = PromptStream(task.train_prompts(), seed)
    gen = torch.Generator().manual_seed(seed)
    curve = [{"step": 0, **task.evaluate(policy)}]
    print(json.dumps({"lr": lr, "targets": targets, **curve[-1]}), flush=True)
    kept = []
    for step in range(1, steps + 1):
        problems, _ = stream.take(r.prompts_per_step)
        if targets == "reference":
            batch = [p for p in problems for _ in range(r.num_generations)]
            answers = [p.reference for p in batch]
        else:
            model.eval()
            with torch.no_grad():
                batch, answers, share = own_correct(policy, task, problems, r.num_generations, r.temperature, gen)
            kept.append(share)
            model.train()
        if batch:
            prompt_ids, prompt_valid = policy.encode_prompts([p.prompt for p in batch])
            target = policy.predictor.answer_ids(answers, policy.rollout.gen_length)
            valid = policy.completion_mask(target)
            for _ in range(cfg.train.ppo_epochs):
                masked, p = forward_mask(valid, generator=gen)
                noisy = torch.where(masked, policy.predictor.mask_token_id, target)
                logits = policy.logits(torch.cat([prompt_ids, noisy], 1), prompt_valid)[:, policy.prompt_length:]
                loss = elbo_loss(logits, target, masked, p, valid)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if oc.max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), oc.max_grad_norm)
                opt.step()
        if step % eval_every == 0 or step == steps:
            row = {"step": step, **task.evaluate(policy)}
            if kept:
                row["kept"] = sum(kept) / len(kept)
                kept = []
            curve.append(row)
            print(json.dumps({"lr": lr, "targets": targets, **row}), flush=True)
    return {"lr": lr, "targets": targets, "curve": curve, **({"policy": policy} if keep_policy else {})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "dllm" / "diffu_grpo.yaml",
                    help="the RL config whose prompts, batch and steps are matched")
    ap.add_argument("--lrs", nargs="+", type=float, default=[3e-5, 1e-4, 3e-4, 1e-3])
    ap.add_argument("--targets", choices=("reference", "own"), default="reference")
    ap.add_argument("--steps", type=int, default=None, help="default: the config's train.max_steps")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="extra", action="append", default=[], help="config override (repeatable)")
    args = ap.parse_args(argv)
    if args.eval_every < 1 or (args.steps is not None and args.steps < 1):
        ap.error(f"--eval-every and --steps must be >= 1, got {args.eval_every} and {args.steps}")
    steps = args.steps if args.steps is not None else load_config(backend.CONFIG_CLASS, args.config, args.extra,
                                      defaults=backend.DEFAULT_CONFIG).train.max_steps
    results = [run(args.config, lr, args.targets, steps, args.eval_every, args.seed, args.extra) for lr in args.lrs]
    marks = [row["step"] for row in results[0]["curve"]]
    print(f"\n| targets | lr | held-out greedy at steps {' / '.join(map(str, marks))} | gain (points) |")
    print("|---|---|---|---|")
    for res in results:
        acc = [row["accuracy"] for row in res["curve"]]
        print(f"| {res['targets']} | {res['lr']:g} | {' / '.join(f'{a:.3f}' for a in acc)} | {100 * (acc[-1] - acc[0]):+.1f} |")
    return 0


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
