"""Pre-train the bundled tiny diffusion LM (assets/tiny-dllm) on arith and sudoku.

A LLaDA-style mask predictor (dllm_rl.tiny.build_tiny_dllm: a small Llama run with full
bidirectional attention, a character tokenizer) is trained with LLaDA's masked-diffusion
objective (docs/methods.md section 5, dllm_rl.logprob.elbo_loss): t ~ U(0, 1), each answer token
masked with p = (1 - 1e-3) t + 1e-3, loss = sum over masked tokens of CE / p per answer
token; the prompt is never masked. Answers are padded with <eos> to the task's generation
length (arith 8, sudoku 20), and the <eos> filler is trained like any answer token, as in
LLaDA's SFT. Batches alternate between the tasks (two arith batches per sudoku batch).

Training stops after `--steps`; every `--eval-every` steps the held-out greedy accuracy
(low_confidence decoding, the RL default sampler) is logged. The defaults made the bundled
model: 3000 steps, about 10 minutes on 2 cores; held-out greedy accuracy 0.275 on arith
(digits 2: +, - and * of 1-2 digit numbers; sampled pass@8 0.49) and 0.975 on sudoku with
4-10 blanks (0.74 with 10-12 blanks): a middling arithmetic model, room for RL
(assets/tiny-dllm/pretrain.json has the record).

    python scripts/pretrain_tiny_dllm.py                 # rebuilds assets/tiny-dllm
    python scripts/pretrain_tiny_dllm.py --out /tmp/d --steps 4000
    python scripts/pretrain_tiny_dllm.py --out /tmp/d --reversed-share 0.7   # two answer conventions
    python scripts/pretrain_tiny_dllm.py --out assets/tiny-dllm-marked --marked-share 0.5 \
        --mark-at suffix --threads 1    # rebuilds the marked model (about 25 minutes)
    python scripts/pretrain_tiny_dllm.py --out assets/tiny-dllm-marked-sudoku --marked-share 0.5 \
        --mark-tasks sudoku --threads 1 --eval-every 1000   # the sudoku-marked model (about 27 minutes)

--reversed-share writes that share of the arith answers with their digits reversed (a
probe: can RL pick the task's convention out of a mixed corpus? benchmarks/RESULTS.md says
what it found; benchmarks/dllm_conventions.py counts which convention a model writes).
--marked-share writes that share of the arith answers with a "?" mark ("?82", or "82?" with
--mark-at suffix): the same computation in a form the task's format atom rejects, a
behaviour RL can unlearn on every problem at once (a probe of whether the loop's gains carry
over to held-out problems). At --marked-share 0.5 --mark-at suffix the model marks about a
third of its greedy answers, and diffu-GRPO and TraceRL gain on held-out problems by
dropping the mark (benchmarks/RESULTS.md, "A positive control"). That model is bundled too,
as assets/tiny-dllm-marked (the command above, at one thread: the thread count is part of
the recipe).
--mark-tasks sudoku marks sudoku grids instead ("1234|3412|2143|4321?"; the model then learns
sudoku at generation length 24, so RL runs from it set rollout.gen_length=24): a task whose
answers are long enough for Fork-dLLM's parallel commits to matter (issue 10's ForkGRPO vs
AR-GRPO on sudoku in benchmarks/RESULTS.md). That model is bundled as
assets/tiny-dllm-marked-sudoku (the command above; its rebuild was not repeated).

Deterministic for a seed on a CPU with the same thread count (`--threads`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from dllm_rl.config import DLLMRolloutConfig
from dllm_rl.logprob import elbo_loss, forward_mask
from dllm_rl.models import load_mask_predictor
from dllm_rl.policy import DLLMPolicy
from dllm_rl.task import DLLMTask
from dllm_rl.tasks import get_task
from dllm_rl.tasks.arith import MARK, reverse_digits
from dllm_rl.tiny import build_tiny_dllm

ROOT = Path(__file__).resolve().parents[1]
GEN_LENGTH = {"arith": 8, "sudoku": 20}
MARKED_GEN_LENGTH = {"arith": 8, "sudoku": 24}  # a marked grid (20 chars) and its <eos>, in blocks of 4
SCHEDULE = ("arith", "arith", "sudoku")  # task of batch k: SCHEDULE[k % 3]
OPTIONS = {"arith": {"digits": 2}, "sudoku": {"blanks": (4, 10)}}


def with_conventions(problems, reversed_share: float, rng: random.Random):
    """The batch with each arith answer written little-endian with probability reversed_share.

    Drawn per occurrence, not per problem, so every problem is seen both ways: the corpus
    mixes two conventions and nothing in a prompt says which one an answer follows.
    """
    if reversed_share <= 0:
        return problems
    return [dataclasses.replace(p, reference=reverse_digits(p.reference)) if rng.random() < reversed_share else p
            for p in problems]


def with_marker(problems, marked_share: float, rng: random.Random, at: str = "prefix"):
    """The batch with each answer written as MARK + answer (at="prefix") or answer + MARK
    (at="suffix") with probability marked_share (drawn per occurrence, like with_conventions)."""
    if at not in ("prefix", "suffix"):
        raise ValueError(f"mark position must be 'prefix' or 'suffix', got {at!r}")
    if marked_share <= 0:
        return problems
    mark = (lambda a: MARK + a) if at == "prefix" else (lambda a: a + MARK)
    return [dataclasses.replace(p, reference=mark(p.reference)) if rng.random() < marked_share else p
            for p in problems]


def rl_policy(predictor, name: str, prompt_length: int, gen_length: dict[str, int] = GEN_LENGTH) -> DLLMPolicy:
    """The predictor as an RL run of task `name` sees it: its prompt layout and default sampler."""
    g = gen_length[name]
    return DLLMPolicy(predictor, DLLMRolloutConfig(gen_length=g, block_length=4, steps=g), prompt_length)


def encode(policy: DLLMPolicy, problems):
    """Left-padded prompts and <eos>-padded reference answers: ids [B, P + C], valid [B, P + C]."""
    prompt_ids, prompt_valid = policy.encode_prompts([p.prompt for p in problems])
    answer = policy.predictor.answer_ids([p.reference for p in problems], policy.rollout.gen_length)
    return torch.cat([prompt_ids, answer], 1), torch.cat([prompt_valid, torch.ones_like(answer, dtype=torch.bool)], 1)


def evaluate(policy: DLLMPolicy, name: str, problems) -> dict[str, float]:
    """Greedy held-out accuracy and format share with the RL run's default sampler."""
    spec = get_task(name)
    task = DLLMTask(name, problems, problems, spec.reward(), answer_atom=spec.success_atom, rollout=policy.rollout)
    with torch.no_grad():
        out = task.evaluate(policy)
    return {k: round(v, 4) for k, v in out.items() if k in ("accuracy", "format", "reward")}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "assets" / "tiny-dllm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--num-eval", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden-size", type=int, default=128, help="model width (the MLP is twice as wide)")
    ap.add_argument("--layers", type=int, default=4, help="transformer layers")
    ap.add_argument("--reversed-share", type=float, default=0.0,
                    help="share of arith training answers written with their digits reversed "
                         "(a second convention the task's reward does not accept; 0 = none)")
    ap.add_argument("--marked-share", type=float, default=0.0,
                    help=f"share of arith training answers written with a {MARK!r} mark (see "
                         "--mark-at): the same answer in a form the task's format atom rejects; 0 = none")
    ap.add_argument("--mark-at", choices=("prefix", "suffix"), default="prefix",
                    help='where --marked-share puts the mark: "?82" (prefix, which shifts the digits '
                         'one place) or "82?" (suffix, digits where the task writes them)')
    # SUPPRESS: absent from pretrain.json unless given, so the records of the models built before
    # it existed still match their commands
    ap.add_argument("--mark-tasks", nargs="+", choices=tuple(GEN_LENGTH), default=argparse.SUPPRESS,
                    help="the tasks whose answers --marked-share marks (default: arith); a sudoku "
                         'answer is marked at its end ("1234|3412|2143|4321?", whatever --mark-at says) '
                         "and the model learns sudoku at generation length 24 (RL runs: "
                         "rollout.gen_length=24), to leave room for the mark and its <eos>")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    for name in ("reversed_share", "marked_share"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise SystemExit(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name)}")
    if args.hidden_size < 4 or args.hidden_size % 4 or args.layers < 1:
        raise SystemExit(f"--hidden-size must be a positive multiple of 4 (the model has 4 heads) and "
                         f"--layers >= 1, got {args.hidden_size} and {args.layers}")
    mark_tasks = getattr(args, "mark_tasks", ["arith"])
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_dllm(Path(tmp) / "init", kind="llada", seed=args.seed, hidden_size=args.hidden_size,
                        num_layers=args.layers, intermediate_size=2 * args.hidden_size)
        predictor = load_mask_predictor(Path(tmp) / "init")
    model = predictor.model
    train = {n: get_task(n).sample_problems(20000, args.seed, "train", **OPTIONS[n]) for n in GEN_LENGTH}
    held_out = {n: get_task(n).sample_problems(args.num_eval, args.seed, "eval", **OPTIONS[n]) for n in GEN_LENGTH}
    prompt_length = {n: max(len(p.prompt) for p in train[n] + held_out[n]) for n in GEN_LENGTH}
    gen_length = {n: (MARKED_GEN_LENGTH if n in mark_tasks else GEN_LENGTH)[n] for n in GEN_LENGTH}
    policies = {n: rl_policy(predictor, n, prompt_length[n], gen_length) for n in GEN_LENGTH}

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + torch.cos(torch.tensor(s / args.steps * 3.14159)).item()))
    gen = torch.Generator().manual_seed(args.seed)
    conventions = random.Random(f"conventions/{args.seed}")  # its own stream: share 0 leaves the run unchanged
    marker = random.Random(f"marker/{args.seed}")  # likewise
    cursor = dict.fromkeys(GEN_LENGTH, 0)
    record, started = [], time.perf_counter()
    model.train()
    for step in range(args.steps):
        name = SCHEDULE[step % len(SCHEDULE)]
        pool = train[name]
        batch = [pool[(cursor[name] + i) % len(pool)] for i in range(args.batch)]
        if name == "arith":
            batch = with_conventions(batch, args.reversed_share, conventions)
        if name in mark_tasks:  # sudoku: at the end, a prefix would shift every cell
            batch = with_marker(batch, args.marked_share, marker, args.mark_at if name == "arith" else "suffix")
        cursor[name] += args.batch
        p_len = prompt_length[name]
        ids, valid = encode(policies[name], batch)
        answer = ids[:, p_len:]
        masked, p = forward_mask(torch.ones_like(answer, dtype=torch.bool), generator=gen)
        noisy = torch.cat([ids[:, :p_len], torch.where(masked, predictor.mask_token_id, answer)], 1)
        logits = predictor(noisy, prompt_length=p_len, valid=valid)[:, p_len:]
        loss = elbo_loss(logits, answer, masked, p, torch.ones_like(masked))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            model.eval()
            row = {"step": step + 1, "loss": round(float(loss.detach()), 4),
                   "seconds": round(time.perf_counter() - started, 1)}
            for n in GEN_LENGTH:
                row[n] = evaluate(policies[n], n, held_out[n])
            record.append(row)
            print(json.dumps(row), flush=True)
            model.train()

    model.eval()
    out = args.out
    if out.exists():
        shutil.rmtree(out)
    predictor.save_pretrained(out)
    (out / "pretrain.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                   "record": record}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
