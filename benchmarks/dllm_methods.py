"""The dLLM methods side by side on the bundled tiny dLLM (arith), one run per comparison:

    samplers   Fork-dLLM vs AR vs Fast-dLLM threshold sampling: pass@k, k = 1..16, and mean
               NFE, the same problems and seeds for every sampler
    budget     SLIM-RL's tau-budget decoder vs LLaDA's low-confidence decoder at matched NFE:
               accuracy and expected wrong commits (sum of 1 - confidence over commits)
    fork       ForkGRPO vs AR-GRPO vs diffu-GRPO: held-out accuracy against training compute
               (wall clock and model forward tokens)
    slim       SLIM-RL vs TraceRL: training rows and wall clock to reach TraceRL's best
               held-out accuracy

    python benchmarks/dllm_methods.py samplers --problems 200 --n 16
    python benchmarks/dllm_methods.py budget --problems 200 --n 8
    python benchmarks/dllm_methods.py fork --seeds 0 --steps 100 --set train.eval_every=20
    python benchmarks/dllm_methods.py slim --seeds 0 --steps 100 --set train.eval_every=20

The training comparisons run `configs/dllm/<method>.yaml` from the bundled model with the
same seeds and prompts per step; compute is what each step logs (cost/forward_tokens,
cost/train_rows, time/step), summed up to each held-out evaluation. --methods trains a subset
and --reuse reads a run already finished in --out (its summary.json and metrics.jsonl) instead
of training it again, so the methods can run as parallel processes and be tabled together:

    python benchmarks/dllm_methods.py fork --methods ar_grpo --out OUT ...      # one process
    python benchmarks/dllm_methods.py fork --methods fork_grpo --out OUT ...    # beside it
    python benchmarks/dllm_methods.py fork --methods ar_grpo fork_grpo --reuse --out OUT ...

Each config's held-out evaluation decodes with its own decoder (rollout.eval_strategy, else
its rollout strategy), as printed under the first table; decoders start at different
accuracies, so `--set rollout.eval_strategy=X` scores every method with one, and a method
already at the target before training is reported as such, not as 0x compute.

--smooth K compares trailing means of K held-out evaluations in the compute-to-target table:
on a plateau, the first step at the baseline's best single evaluation is decided by noise.
With several seeds the table ends with a "mean" row: the same reading on each method's curve
averaged over the seeds (accuracy and compute, evaluation by evaluation).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from dllm_rl import backend
from dllm_rl.policy import to_sample
from dllm_rl.task import pass_at_k
from mmrl.core.config import ConfigError, load_config
from mmrl.core.logging import read_metrics
from mmrl.core.trainer import Trainer, read_reused_run

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ sampling comparisons


def decode_all(policy, task, strategy: str, n: int, temperature: float, seed: int, **rollout) -> dict:
    """n answers per held-out problem with one seeded generator: per-problem correct counts,
    mean NFE and mean expected wrong commits per answer."""
    for key, value in rollout.items():
        setattr(policy.rollout, key, value)
    gen = torch.Generator().manual_seed(seed)
    problems = [p for p in task.eval_problems for _ in range(n)]
    hits, nfe, wrong = [], [], []
    for start in range(0, len(problems), 256):
        chunk = problems[start: start + 256]
        with torch.no_grad():
            result, _ = policy.decode([p.prompt for p in chunk], gen, temperature=temperature, strategy=strategy)
        texts = policy.answer_text(result.completion)
        scores = task.reward.score([to_sample(p, t) for p, t in zip(chunk, texts)])
        hits.append(scores.values[:, scores.names.index(task.answer_atom)] >= 0.5)
        nfe.append(result.nfe.float())
        wrong.append(result.expected_wrong.sum(1))
    correct = torch.cat(hits).view(-1, n).sum(1)
    return {"correct": correct, "nfe": float(torch.cat(nfe).mean()), "expected_wrong": float(torch.cat(wrong).mean())}


def pass_curve(correct: torch.Tensor, n: int) -> dict[int, float]:
    return {k: sum(pass_at_k(n, int(c), k) for c in correct) / len(correct) for k in range(1, n + 1)}


def build(args, *overrides):
    cfg = load_config(backend.CONFIG_CLASS, None, [f"task.num_eval={args.problems}", *args.extra, *overrides],
                      defaults=backend.DEFAULT_CONFIG)
    return backend.build(cfg)


def samplers(args) -> None:
    policy, task = build(args)
    rows = {}
    for name, strategy in (("Fork-dLLM (fork)", "fork"), ("AR (ar)", "ar"), ("Fast-dLLM (threshold)", "threshold")):
        t0 = time.perf_counter()
        out = decode_all(policy, task, strategy, args.n, args.temperature, args.seed, threshold=args.threshold)
        rows[name] = (pass_curve(out["correct"], args.n), out["nfe"], time.perf_counter() - t0)
        print(name, rows[name][1], f"{rows[name][2]:.0f} s", file=sys.stderr, flush=True)
    ks = [k for k in (1, 2, 4, 8, 12, 16) if k <= args.n]
    print(f"\n{args.problems} held-out problems, n = {args.n} answers each, temperature {args.temperature}, "
          f"threshold {args.threshold}, seed {args.seed}\n")
    print("| sampler | " + " | ".join(f"pass@{k}" for k in ks) + " | mean NFE | NFE / AR |")
    print("|---|" + "---|" * len(ks) + "---|---|")
    ar_nfe = rows["AR (ar)"][1]
    for name, (curve, nfe, _) in rows.items():
        print(f"| {name} | " + " | ".join(f"{curve[k]:.3f}" for k in ks) + f" | {nfe:.2f} | {nfe / ar_nfe:.2f}x |")
    fork, ar = rows["Fork-dLLM (fork)"][0][args.n], rows["AR (ar)"][0][args.n]
    print(f"\nGoal: Fork-dLLM's pass@{args.n} within 2 points of AR's at <= 0.5x its NFE: "
          f"{100 * (fork - ar):+.1f} points at {rows['Fork-dLLM (fork)'][1] / ar_nfe:.2f}x")
    print("full pass@k curves (k = 1..n):", {n: [round(v, 4) for v in c.values()] for n, (c, _, _) in rows.items()})


def budget(args) -> None:
    policy, task = build(args)
    g = policy.rollout.gen_length
    blocks = g // policy.rollout.block_length
    print(f"\n{args.problems} held-out problems, n = {args.n} answers each, temperature {args.temperature}, "
          f"gen_length {g}, {blocks} blocks, seed {args.seed}\n")
    print("| decoder | setting | accuracy (pass@1) | mean NFE | expected wrong commits per answer |")
    print("|---|---|---|---|---|")
    for tau in args.taus:
        out = decode_all(policy, task, "tau_budget", args.n, args.temperature, args.seed, tau=tau, steps=g)
        acc = float(out["correct"].sum()) / (args.n * len(out["correct"]))
        print(f"| tau_budget | tau {tau} | {acc:.3f} | {out['nfe']:.2f} | {out['expected_wrong']:.3f} |", flush=True)
    for steps in range(blocks, g + 1, blocks):
        out = decode_all(policy, task, "low_confidence", args.n, args.temperature, args.seed, steps=steps)
        acc = float(out["correct"].sum()) / (args.n * len(out["correct"]))
        print(f"| low_confidence | {steps} steps | {acc:.3f} | {out['nfe']:.2f} | {out['expected_wrong']:.3f} |",
              flush=True)


# ------------------------------------------------------------------ training comparisons


def train_run(method: str, seed: int, args) -> tuple[dict, list[dict]]:
    out = args.out / f"{method}-seed{seed}"
    overrides = [f"seed={seed}", f"output_dir={out}", "logging.progress=false", "logging.tensorboard=false", *args.extra]
    if args.steps:
        overrides.append(f"train.max_steps={args.steps}")
    cfg = load_config(backend.CONFIG_CLASS, ROOT / "configs" / "dllm" / f"{method}.yaml", overrides,
                      defaults=backend.DEFAULT_CONFIG)
    try:  # a run still going or stopped, or made with other settings: the user's to sort out
        done = read_reused_run(out, cfg) if args.reuse else None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if done:
        return done
    policy, task = backend.build(cfg)
    summary = Trainer(cfg, policy, task, backend=backend).train()
    return summary, read_metrics(out / "metrics.jsonl")


def curve(summary: dict, rows: list[dict]) -> list[tuple[int, float, float, float, float]]:
    """(step, held-out accuracy, wall s, forward tokens, training rows) at step 0, every
    evaluation and the end; compute summed over the steps up to there."""
    points = [(0, summary["eval_before"]["accuracy"], 0.0, 0.0, 0.0)]
    wall = tokens = train_rows = 0.0
    for i, row in enumerate(rows, 1):
        wall += row.get("time/step", 0.0)
        tokens += row.get("cost/forward_tokens", math.nan)
        train_rows += row.get("cost/train_rows", math.nan)
        if "eval/accuracy" in row:
            points.append((i, row["eval/accuracy"], wall, tokens, train_rows))
    points.append((len(rows), summary["eval_after"]["accuracy"], wall, tokens, train_rows))
    return points


def smooth(points: list[tuple], k: int) -> list[tuple]:
    """The curve with each evaluation's accuracy replaced by the mean of the last k evaluations
    (step 0 excluded, and kept as it is), from the k-th evaluation on. On a plateau, "first step
    at the baseline's best" otherwise rewards whichever single evaluation was noisiest."""
    if k <= 1:
        return points
    evals = points[1:]
    out = [points[0]]
    for i in range(k - 1, len(evals)):
        mean = sum(p[1] for p in evals[i - k + 1:i + 1]) / k
        out.append((evals[i][0], mean, *evals[i][2:]))
    return out


def compare(args, methods: list[str], baseline: str, what: str) -> None:
    if args.methods:
        unknown = sorted(set(args.methods) - set(methods))
        if unknown:
            raise ConfigError(f"--methods: {', '.join(unknown)} not in this comparison ({', '.join(methods)})")
        methods = [m for m in methods if m in args.methods]
    curves, decoders = {}, {}
    for seed in args.seeds:
        for method in methods:
            summary, rows = train_run(method, seed, args)
            curves[(method, seed)] = curve(summary, rows)
            r = summary["config"]["rollout"]
            decoders[method] = r.get("eval_strategy") or r["strategy"]
            print(method, seed, curves[(method, seed)][-1], file=sys.stderr, flush=True)
    print("\n| method | seed | held-out accuracy by step (step: acc) | final | wall s | forward tokens (M) | "
          "training rows |")
    print("|---|---|---|---|---|---|---|")
    for (method, seed), pts in curves.items():
        trace = ", ".join(f"{s}: {a:.3f}" for s, a, *_ in pts)
        _, a, wall, tok, rows_ = pts[-1]
        print(f"| {method} | {seed} | {trace} | {a:.3f} | {wall:.0f} | {tok / 1e6:.2f} | {rows_:.0f} |")
    # each config scores with its own decoder unless --set rollout.eval_strategy names one for all:
    # decoders start at different accuracies, which the step-0 column shows
    print("\nHeld-out decoder: " + ", ".join(f"{m} {d}" for m, d in decoders.items()))
    if baseline not in methods:
        return  # the ratios need the baseline: table the runs with --reuse once it has run too
    print("\nCompute per training step, as a multiple of the baseline's (same seed):\n")
    print("| method | seed | wall | forward tokens | training rows |")
    print("|---|---|---|---|---|")
    for (method, seed), pts in curves.items():
        base = curves[(baseline, seed)][-1]
        ratios = [pts[-1][j] / pts[-1][0] / (base[j] / base[0]) if base[j] else math.nan for j in (2, 3, 4)]
        print(f"| {method} | {seed} | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
    label = what
    if args.smooth > 1:
        curves = {key: smooth(pts, args.smooth) for key, pts in curves.items()}
        label = f"{what} (mean of {args.smooth} consecutive evaluations)"
    print(f"\nCompute to reach {baseline}'s {label} held-out accuracy (same seed), as a fraction of {baseline}'s:\n")
    print("| method | seed | target | reached at step | wall | forward tokens | training rows |")
    print("|---|---|---|---|---|---|---|")
    for seed in args.seeds:
        reach_rows(str(seed), {m: curves[(m, seed)] for m in methods}, baseline, what)
    if len(args.seeds) > 1:
        means = {m: mean_curve([curves[(m, s)] for s in args.seeds]) for m in methods}
        if all(c is not None for c in means.values()):
            reach_rows("mean", means, baseline, what)
        else:
            print("| all | mean | - | n/a: the seeds' runs were not evaluated at the same steps | - | - | - |")


def mean_curve(curves: list[list[tuple]]) -> list[tuple] | None:
    """The seeds' curves averaged point by point (accuracy and compute alike): one seed's noisy
    evaluation moves the target less. None when the runs were not evaluated at the same steps."""
    steps = [p[0] for p in curves[0]]
    if any([p[0] for p in c] != steps for c in curves):
        return None
    return [(s, *(sum(c[i][j] for c in curves) / len(curves) for j in range(1, 5))) for i, s in enumerate(steps)]


def reach_rows(seed: str, curves: dict[str, list[tuple]], baseline: str, what: str) -> None:
    """One compute-to-target row per method: the first evaluation at the baseline's target."""
    base = curves[baseline]
    target = base[-1][1] if what == "final" else max(a for _, a, *_ in base)
    first = next(p for p in base if p[1] >= target)
    if first[0] == 0:
        print(f"| all | {seed} | {target:.3f} | n/a: {baseline} never rose above its step-0 accuracy, "
              "so there is nothing to reach | - | - | - |")
        return
    for method, pts in curves.items():
        hit = next((p for p in pts if p[1] >= target), None)
        if hit is None:
            print(f"| {method} | {seed} | {target:.3f} | not reached | - | - | - |")
            continue
        if hit[0] == 0 and method != baseline:  # not something training reached
            print(f"| {method} | {seed} | {target:.3f} | 0: at the target before training (its held-out decoder "
                  "starts there; --set rollout.eval_strategy=X scores every method alike) | - | - | - |")
            continue
        frac = [hit[j] / first[j] if first[j] else math.nan for j in (2, 3, 4)]
        print(f"| {method} | {seed} | {target:.3f} | {hit[0]} | {frac[0]:.2f}x | {frac[1]:.2f}x | {frac[2]:.2f}x |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["samplers", "budget", "fork", "slim"])
    ap.add_argument("--problems", type=int, default=200, help="held-out problems (sampling parts)")
    ap.add_argument("--n", type=int, default=16, help="answers per problem (sampling parts)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--threshold", type=float, default=0.8, help="lambda of fork and threshold")
    ap.add_argument("--taus", type=float, nargs="+", default=[0.7, 0.8, 0.9, 0.95])
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: each config's)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "dllm-methods",
                    help="each run's output directory goes under it (default: the repository's runs/dllm-methods/)")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra override (repeatable)")
    ap.add_argument("--methods", nargs="+", default=None,
                    help="train (or, with --reuse, table) only these of the comparison's methods")
    ap.add_argument("--reuse", action="store_true", help="table runs already finished in --out, train the rest")
    ap.add_argument("--smooth", type=int, default=1, metavar="K",
                    help="compare trailing means of K held-out evaluations in the compute-to-target table "
                         "(training parts; default 1: each evaluation alone)")
    args = ap.parse_args(argv)
    if args.smooth < 1:
        ap.error("--smooth must be >= 1")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if args.part == "samplers":
        samplers(args)
    elif args.part == "budget":
        budget(args)
    elif args.part == "fork":
        compare(args, ["ar_grpo", "fork_grpo", "diffu_grpo"], "ar_grpo", "final")
    else:
        compare(args, ["tracerl", "slim_rl"], "tracerl", "best")
    return 0


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
