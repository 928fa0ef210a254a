"""Rebuild the bundled tiny VLM (assets/tiny-qwen2.5-vl) deterministically.

1. Build a tiny Qwen2.5-VL (2 layers, 64 wide) with a tokenizer trained on the
   shapes-qa wordings and the real Qwen2.5-VL processor (mmrl.vlm.tiny).
2. Supervised fine-tuning on shapes-qa reference completions
   ("a red circle , a blue square <answer>1</answer>"), loss on completion tokens.
3. Stop at the first validation where greedy held-out accuracy reaches --target
   (a middling accuracy leaves room for RL to show), and save with save_pretrained.

    python scripts/pretrain_tiny_vlm.py --out assets/tiny-qwen2.5-vl

Validation uses a separate item stream (seed 1) from the RL run's held-out set (seed 0).

--counterfactual-frac F (off by default; an experiment recorded in benchmarks/RESULTS.md):
a fraction F of the rows get one object of their description changed and the answer that
changed description implies, with the loss on the answer only, to teach the answer to
follow the reasoning.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from mmrl.vlm.config import VLMModelConfig
from mmrl.vlm.consistency import implied_answer, parse_reasoning, split_completion
from mmrl.vlm.models import load_vlm
from mmrl.vlm.policy import VLMPolicy
from mmrl.vlm.task import VLMTask
from mmrl.vlm.tasks.scenes import COLOURS, SHAPES, describe_objects
from mmrl.vlm.tasks.shapes_qa import ShapesQA, shapes_qa_reward
from mmrl.vlm.tiny import build_tiny_vlm


def counterfactual(item, g: torch.Generator, tokenizer) -> tuple[str, int]:
    """(completion, description tokens to leave untrained): the item's description with one
    object's colour or shape changed, answered as that description implies."""
    objects = parse_reasoning(split_completion(item.reference)[0])
    if not objects:
        return item.reference, 0
    for _ in range(8):
        new = list(objects)
        i = int(torch.randint(len(new), (1,), generator=g))
        c, s = new[i]
        if torch.rand((), generator=g) < 0.5:
            c = list(COLOURS)[int(torch.randint(len(COLOURS), (1,), generator=g))]
        else:
            s = SHAPES[int(torch.randint(len(SHAPES), (1,), generator=g))]
        new[i] = (c, s)
        answer = implied_answer(item.meta["kind"], item.meta["params"], new)
        if answer is not None and new != objects:
            text = describe_objects(new)
            return f"{text} <answer>{answer}</answer>", len(tokenizer.tokenize(text))
    return item.reference, 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets/tiny-qwen2.5-vl")
    ap.add_argument("--family", default="qwen2_5_vl")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=0.5, help="stop once validation accuracy reaches this")
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--num-train", type=int, default=2000)
    ap.add_argument("--num-val", type=int, default=200)
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--max-shapes", type=int, default=2)
    ap.add_argument("--shape-size", type=int, nargs=2, default=(36, 48))
    ap.add_argument("--counterfactual-frac", type=float, default=0.0,
                    help="fraction of SFT rows whose description is perturbed, answer trained only")
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    shapes = {"max_shapes": args.max_shapes, "shape_size": tuple(args.shape_size)}
    train = ShapesQA(seed=0, num_train=args.num_train, num_eval=1, **shapes).train_items()
    val = ShapesQA(seed=1, num_train=1, num_eval=args.num_val, **shapes).eval_items()
    corpus = [it.question for it in train] + [it.reference for it in train]
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_vlm(args.family, tmp, seed=args.seed, corpus=corpus,
                       hidden_size=args.hidden_size, vision_hidden=args.hidden_size)
        mcfg = VLMModelConfig(path=tmp)
        model, processor = load_vlm(mcfg)
    policy = VLMPolicy(model, processor, min_pixels=mcfg.min_pixels, max_pixels=mcfg.max_pixels)
    task = VLMTask("shapes-qa", train, val, shapes_qa_reward(), max_new_tokens=32)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)
    history, started, step = [], time.perf_counter(), 0
    print(f"{sum(p.numel() for p in params):,} parameters; {len(train)} train items", file=sys.stderr)
    while step < args.max_steps:
        model.train()
        idx = torch.randint(len(train), (args.batch_size,), generator=g).tolist()
        items = [train[i] for i in idx]
        # (no draw at frac 0: the default rebuild stays bit-identical)
        cf = args.counterfactual_frac
        refs, masked = zip(*(counterfactual(it, g, processor.tokenizer)
                             if cf > 0 and torch.rand((), generator=g) < cf else (it.reference, 0)
                             for it in items))
        batch = policy.teacher_batch(items, list(refs))
        for i, n in enumerate(masked):  # counterfactual rows: train the answer, not the wrong description
            batch.mask[i, :n] = False
        loss = policy.sft_loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % args.eval_every == 0:
            model.eval()
            metrics = task.evaluate(policy)
            history.append({"step": step, "loss": float(loss.detach()), **metrics})
            print(json.dumps(history[-1]), file=sys.stderr)
            if metrics["accuracy"] >= args.target:
                break
    model.eval()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(out)
    record = {"command": " ".join(["python", "scripts/pretrain_tiny_vlm.py", *sys.argv[1:]]),
              "args": vars(args), "steps": step, "seconds": time.perf_counter() - started,
              "final": history[-1] if history else None, "history": history}
    (out / "pretrain.json").write_text(json.dumps(record, indent=1))
    print(f"saved {out} after {step} steps: {record['final']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
