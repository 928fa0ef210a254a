"""Held-out accuracy by question kind (VLM, shapes-qa) or by problem class (dLLM, arith), for
the bundled model or any checkpoint: where the accuracy comes from, and where RL has room.

    python benchmarks/breakdown.py vlm                          # bundled tiny VLM, default kinds
    python benchmarks/breakdown.py vlm --model RUN/checkpoints/step-00000200/model --set task.kinds=null
    python benchmarks/breakdown.py dllm --samples 16            # bundled tiny dLLM, arith

VLM: per kind, greedy accuracy, how often the scene description is exactly right, and the
greedy answers it gives (an answer that never changes is a prior, not perception); overall,
how often the answer agrees with what the model's own description implies.
dLLM: per operator and operand digits, greedy accuracy, and with --samples n the mean
sampled accuracy and pass@n at the config's rollout temperature (seeded).
Prints Markdown.
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict

import torch

from mmrl.core.config import ConfigError, load_config


def _config(backend, args):
    overrides = [f"model.path={args.model}"] if args.model else []
    return load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG, overrides=overrides + args.set)


def vlm(args) -> None:
    from mmrl.vlm import backend
    from mmrl.vlm.consistency import implied_answer, parse_reasoning, split_completion
    from mmrl.vlm.tasks.shapes_qa import extract_answer, normalize

    cfg = _config(backend, args)
    if cfg.task.type != "shapes-qa":
        raise ConfigError("the VLM breakdown reads shapes-qa items (task.type=shapes-qa)")
    policy, task = backend.build(cfg)
    items = task.eval_items
    texts = [s.completion for b in policy.greedy_batches(items, cfg.rollout.max_new_tokens, 50, task.stop) for s in b.samples]
    rows: dict[str, list] = defaultdict(list)
    agree = determined = 0
    for it, text in zip(items, texts):
        reasoning = split_completion(text)[0]
        answer = normalize(extract_answer(text))
        truth = split_completion(it.reference)[0].strip()
        rows[it.meta["kind"]].append((answer == normalize(it.answer), reasoning.strip() == truth, answer))
        implied = implied_answer(it.meta["kind"], it.meta["params"], parse_reasoning(reasoning))
        if implied is not None:
            determined += 1
            agree += implied == answer
    print("| kind | n | greedy accuracy | description exactly right | greedy answers (count) |")
    print("|---|---|---|---|---|")
    for kind, r in sorted(rows.items()):
        answers = ", ".join(f"{a} {n}" for a, n in Counter(x[2] for x in r).most_common())
        print(f"| {kind} | {len(r)} | {sum(x[0] for x in r) / len(r):.2f} | {sum(x[1] for x in r) / len(r):.2f} "
              f"| {answers} |")
    total = sum(x[0] for r in rows.values() for x in r) / len(items)
    print(f"\nall {len(items)} items: greedy accuracy {total:.3f}; the answer agrees with its own description "
          f"on {agree} of the {determined} items whose description determines an answer")


def dllm(args) -> None:
    from dllm_rl import backend
    from dllm_rl.tasks.arith import answer_atom, to_sample

    cfg = _config(backend, args)
    if cfg.task.type != "arith":
        raise ConfigError("the dLLM breakdown reads arith problems (task.type=arith)")
    policy, task = backend.build(cfg)
    policy.model.eval()
    problems = task.eval_problems
    greedy, _ = task.answers(policy, problems, 0.0)
    n = args.samples
    sampled = []
    if n:
        many = [p for p in problems for _ in range(n)]
        sampled, _ = task.answers(policy, many, cfg.rollout.temperature, torch.Generator().manual_seed(args.seed))
    rows: dict[str, list] = defaultdict(list)
    for i, p in enumerate(problems):
        m = p.meta
        hits = [answer_atom(to_sample(p, t)) for t in sampled[i * n:(i + 1) * n]]
        rows[f"{m['op']} {len(str(m['a']))}x{len(str(m['b']))}"].append(
            (answer_atom(to_sample(p, greedy[i])), sum(hits) / n if n else 0.0, any(hits)))
    head = "| class | n | greedy accuracy |" + (f" sampled accuracy (T {cfg.rollout.temperature}) | pass@{n} |" if n else "")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for cls, r in sorted(rows.items()):
        line = f"| {cls} | {len(r)} | {sum(x[0] for x in r) / len(r):.2f} |"
        if n:
            line += f" {sum(x[1] for x in r) / len(r):.2f} | {sum(x[2] for x in r) / len(r):.2f} |"
        print(line)
    print(f"\nall {len(problems)} problems: greedy accuracy {sum(x[0] for r in rows.values() for x in r) / len(problems):.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("backend", choices=["vlm", "dllm"])
    ap.add_argument("--model", default=None, help="a checkpoint's model directory (default: the bundled model)")
    ap.add_argument("--set", action="append", default=[], help="config override, e.g. task.kinds=null (repeatable)")
    ap.add_argument("--samples", type=int, default=0, help="dLLM: sampled answers per problem (0: greedy only)")
    ap.add_argument("--seed", type=int, default=1, help="dLLM: the sampling generator's seed")
    args = ap.parse_args(argv)
    if args.samples < 0:
        ap.error(f"--samples must be >= 0 (0: greedy only), got {args.samples}")
    vlm(args) if args.backend == "vlm" else dllm(args)
    return 0


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
