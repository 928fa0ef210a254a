"""Flow-GRPO, CAST and FTFC side by side on the bundled tiny flow model (shapes-geneval):
each `configs/diffusion/<method>.yaml` from the same start, same seeds, steps and prompts
per step; held-out atom accuracy per atom type before and after, and how long each
method took to reach Flow-GRPO's final training reward.

    python benchmarks/diffusion_methods.py --methods flow_grpo cast ftfc --seeds 0 --steps 30
    python benchmarks/diffusion_methods.py --methods flow_grpo cast --only cast:method.window_from=window.json
    python benchmarks/diffusion_methods.py --methods flow_grpo ftfc --divergences kl pearson reverse_kl hellinger \
        --steps 300 --only ftfc:train.max_steps=100 --set train.eval_every=25

"Reach" is the first step whose trailing mean training reward (--window steps) is at least
Flow-GRPO's over its last --window steps of the same seed; its wall time is the sum of
time/step up to it, its model evaluations the sum of cost/model_evaluations (transformer rows:
rollouts, re-scoring, reference passes). Training rewards are not alike across methods (an SDE
window, or FTFC's ODE pool), so "reach" is also read on the held-out evaluations (with
--set train.eval_every=N): the first evaluation whose atom accuracy is at least Flow-GRPO's
final one. The hardest held-out prompts (hard/*: the relational ones, 7 atoms) are reported
alone too, and each method's gain there over Flow-GRPO's.

--reuse reads a run that already finished in --out (its summary.json and metrics.jsonl)
instead of training it again, so the methods can run as parallel processes and be tabled
together afterwards.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
from pathlib import Path

from diffusion_rl import backend
from diffusion_rl.ftfc import DIVERGENCES
from mmrl.core.config import ConfigError, load_config
from mmrl.core.logging import read_metrics
from mmrl.core.trainer import Trainer, read_reused_run

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("atom_accuracy", "exist", "colour", "count", "relation", "prompt_accuracy")
HARD = ("hard/atom_accuracy", "hard/exist", "hard/colour", "hard/count", "hard/relation", "hard/prompt_accuracy")


def run(method: str, seed: int, steps: int, out: Path, extra: list[str],
        reuse: bool = False) -> tuple[dict, list[dict]]:
    cfg = load_config(backend.CONFIG_CLASS, ROOT / "configs" / "diffusion" / f"{method}.yaml",
                      [f"seed={seed}", f"train.max_steps={steps}", f"output_dir={out}", "logging.progress=false",
                       "logging.tensorboard=false", *extra], defaults=backend.DEFAULT_CONFIG)
    backend.resolve_settings(cfg)  # rollout.shift auto, CAST's stored window: as the run recorded them
    try:  # a run still going or stopped, or made with other settings: the user's to sort out
        done = read_reused_run(out, cfg) if reuse else None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if done:
        return done
    policy, task = backend.build(cfg)
    summary = Trainer(cfg, policy, task, backend=backend).train()
    return summary, read_metrics(out / "metrics.jsonl")


def trailing(rows: list[dict], window: int) -> list[float]:
    r = [row["reward/total"] for row in rows]
    return [statistics.mean(r[max(0, i - window + 1): i + 1]) for i in range(len(r))]


def logs_rewards(rows: list[dict]) -> bool:
    """Whether every step logged a training reward (FTFC with method.monitor=false rolls out
    only when it draws its pool, so there is no training-reward curve to read)."""
    return all("reward/total" in row for row in rows)


def first_hit(rows: list[dict], hits) -> tuple[int | None, float | None, float | None]:
    """(step, wall seconds, model evaluations) up to the first row whose hit is true; Nones if
    none. The wall time sums time/step, the evaluations cost/model_evaluations."""
    wall = evals = 0.0
    for row, hit in zip(rows, hits):
        wall += row.get("time/step", 0.0)
        evals += row.get("cost/model_evaluations", float("nan"))
        if hit:
            return row["step"], wall, evals
    return None, None, None


def reach(rows: list[dict], target: float, window: int) -> tuple[int | None, float | None, float | None]:
    """Where the trailing mean training reward first reaches target; a mean over a full window
    only (the target is one), so one early noisy step does not count as reaching it."""
    return first_hit(rows, (i >= window - 1 and mean >= target for i, mean in enumerate(trailing(rows, window))))


def reach_eval(rows: list[dict], summary: dict, target: float) -> tuple[int | None, float | None, float | None]:
    """Where a held-out evaluation's atom accuracy first reaches target; the run's final
    evaluation (summary.json) counts at its last step."""
    hits = [row.get("eval/atom_accuracy", -1.0) >= target for row in rows]
    if hits:
        hits[-1] = hits[-1] or summary["eval_after"].get("atom_accuracy", -1.0) >= target
    return first_hit(rows, hits)


def metric(metrics: dict, key: str) -> float:
    """A held-out metric, nan where the run has none or summary.json holds null for it (no
    relational prompt among a few held-out ones: its accuracy is undefined)."""
    value = metrics.get(key)
    return float("nan") if value is None else value


def before_after(summary: dict, key: str) -> str:
    return " -> ".join("-" if math.isnan(v) else f"{v:.3f}"
                       for v in (metric(summary["eval_before"], key), metric(summary["eval_after"], key)))


def gain(summary: dict, key: str) -> float:
    return metric(summary["eval_after"], key) - metric(summary["eval_before"], key)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["flow_grpo", "cast", "ftfc"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--window", type=int, default=5, help="steps of the trailing mean reward")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "diffusion-methods",
                    help="each run's output directory goes under it (default: the repository's runs/diffusion-methods/)")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra override (repeatable)")
    ap.add_argument("--reuse", action="store_true", help="table runs already finished in --out, train the rest")
    ap.add_argument("--only", action="append", default=[], metavar="METHOD:KEY=VALUE",
                    help="an override for one method only (repeatable), e.g. ftfc:train.max_steps=100")
    ap.add_argument("--divergences", nargs="+", default=None, choices=DIVERGENCES,
                    help="run FTFC once per divergence, as ftfc-<divergence> (default: the config's alone, as ftfc)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.window < 1:  # the tables read the last --window steps' rewards
        ap.error(f"--steps and --window must be >= 1, got {args.steps} and {args.window}")
    only: dict[str, list[str]] = {}
    for item in args.only:
        method, sep, override = item.partition(":")
        if not sep or "=" not in override:
            ap.error(f"--only takes METHOD:KEY=VALUE, got {item!r}")
        only.setdefault(method, []).append(override)
    if "flow_grpo" not in args.methods:
        ap.error("the comparison is against flow_grpo: include it in --methods")
    # both were ignored without a word for a method not run (a typo: --only fftc:...)
    if stray := sorted(set(only) - set(args.methods)):
        ap.error(f"--only names {', '.join(stray)}, not in --methods ({' '.join(args.methods)})")
    if args.divergences and "ftfc" not in args.methods:
        ap.error("--divergences runs FTFC once per divergence: include ftfc in --methods")
    arms = []  # (label, config name, its own overrides)
    for method in args.methods:
        if method == "ftfc" and args.divergences:
            arms += [(f"ftfc-{d}", "ftfc", [f"method.divergence={d}"]) for d in args.divergences]
        else:
            arms.append((method, method, []))
    results = {}
    for seed in args.seeds:
        for label, method, own in arms:
            summary, rows = run(method, seed, args.steps, args.out / f"{label}-seed{seed}",
                                [*args.extra, *only.get(method, []), *own], reuse=args.reuse)
            results[(label, seed)] = (summary, rows)
            print(json.dumps({"method": label, "seed": seed, "before": summary["eval_before"],
                              "after": summary["eval_after"], "seconds": summary.get("train_seconds")}), flush=True)
    # the table alone did not say which command (steps, --set overrides, --out) made it
    print(f"\nfrom: python benchmarks/diffusion_methods.py {shlex.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    print("| method | seed | " + " | ".join(COLUMNS) + " | train s | model evals | steps (s, evals) to "
          "Flow-GRPO's final reward | to its final held-out atom accuracy |")
    print("|---|---|" + "---|" * len(COLUMNS) + "---|---|---|---|")
    for (method, seed), (s, rows) in results.items():
        target = trailing(results[("flow_grpo", seed)][1], args.window)[-1]
        cells = " | ".join(before_after(s, c) for c in COLUMNS)
        if logs_rewards(rows):
            step, wall, evals = reach(rows, target, args.window)
            got = f"{step} ({wall:.0f} s, {evals:.0f})" if step else "not reached"
        else:
            got = "n/a (no training reward per step)"
        e_step, e_wall, e_evals = reach_eval(rows, s, results[("flow_grpo", seed)][0]["eval_after"]["atom_accuracy"])
        got_eval = f"{e_step} ({e_wall:.0f} s, {e_evals:.0f})" if e_step else "not reached"
        total = sum(r.get("cost/model_evaluations", float("nan")) for r in rows)
        train_s = sum(r.get("time/step", 0.0) for r in rows)  # training alone: no evaluation, save or report
        print(f"| {method} | {seed} | {cells} | {train_s:.0f} | {total:.0f} | {got} "
              f"| {got_eval} |")
    print("\nHardest held-out prompts (hard/*), and the gain over the base model as a multiple of Flow-GRPO's:")
    print("\n| method | seed | " + " | ".join(c[5:] for c in HARD) + " | atom gain / Flow-GRPO's | prompt gain / "
          "Flow-GRPO's |")
    print("|---|---|" + "---|" * len(HARD) + "---|---|")
    for (method, seed), (s, _) in results.items():
        base = results[("flow_grpo", seed)][0]
        cells = " | ".join(before_after(s, c) for c in HARD)
        ratios = [gain(s, k) / gain(base, k) if gain(base, k) > 0 else float("nan")
                  for k in ("hard/atom_accuracy", "hard/prompt_accuracy")]
        text = [f"{r:.2f}x" if not math.isnan(r) else "n/a (Flow-GRPO did not gain)" for r in ratios]
        print(f"| {method} | {seed} | {cells} | {text[0]} | {text[1]} |")
    return 0


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
