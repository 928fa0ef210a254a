"""Rebuild the bundled mood-reasoning tiny VLM (assets/tiny-qwen2.5-vl-mood) deterministically.

Starts from the bundled tiny Qwen2.5-VL (assets/tiny-qwen2.5-vl) and supervises it on
shapes-mood in the DSPO template (mmrl.vlm.tasks.shapes_mood), loss on the completion only:

    <step1>[ymin,xmin,ymax,xmax]</step1> <step2>a red triangle</step2>
    <step3>anger, fear, excitement, awe, sadness</step3> <answer>anger</answer>

Each demonstration is one annotator's, not the label distribution's summary: the answer is
drawn from the item's label distribution p(e) and the five candidates are drawn from p
without replacement (the answer among them; listed most likely first), the box and the reaction cite the object that
adds most to the drawn answer. A model trained on such labels learns to sample emotions
roughly as annotators do; RL then has the mode's accuracy and the candidates' coverage of
p to improve, which is what DSPO vs GRPO is measured on.

    python scripts/pretrain_tiny_mood_vlm.py --out assets/tiny-qwen2.5-vl-mood

At the end it reports, on held-out and out-of-distribution items: greedy accuracy on the
mode, format rate and coverage of p by the candidates (mood_metrics).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from mmrl.vlm.config import VLMModelConfig
from mmrl.vlm.models import bundled_model_dir, load_vlm
from mmrl.vlm.policy import VLMPolicy
from mmrl.vlm.tasks.scenes import Scene
from mmrl.vlm.tasks.shapes_mood import K, ShapesMood, mood_metrics, object_weights, shape_box


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets/tiny-qwen2.5-vl-mood")
    ap.add_argument("--base", default=None, help="starting model (default: the bundled tiny Qwen2.5-VL)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--num-train", type=int, default=2000)
    ap.add_argument("--num-val", type=int, default=100)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    return ap


def annotator(item, rng: random.Random) -> str:
    """One annotator's completion: answer ~ p, candidates ~ p without replacement (answer included)."""
    dist = item.meta["label_dist"]
    words, probs = list(dist), list(dist.values())
    answer = rng.choices(words, probs)[0]
    rest = [w for w in words if w != answer]
    cands = [answer]
    while len(cands) < K:
        pick = rng.choices(rest, [dist[w] for w in rest])[0]
        cands.append(pick)
        rest.remove(pick)
    cands.sort(key=lambda w: -dist[w])  # most likely first, as the task's reference lists them
    scene = Scene.from_dict(item.meta["scene"])
    cause = max(scene.shapes, key=lambda sh: object_weights(sh)[answer])
    box = ",".join(str(v) for v in shape_box(cause, scene.size))
    return (f"<step1>[{box}]</step1> <step2>a {cause.colour} {cause.shape}</step2> "
            f"<step3>{', '.join(cands)}</step3> <answer>{answer}</answer>")


def report(policy: VLMPolicy, items, max_new_tokens: int) -> dict[str, float]:
    return mood_metrics(policy.greedy(items, max_new_tokens), items)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    data = ShapesMood(seed=0, num_train=args.num_train, num_eval=1, num_ood=1)
    train = data.train_items()
    held = ShapesMood(seed=1, num_train=1, num_eval=args.num_val, num_ood=args.num_val)  # not the RL eval sets
    val, ood = held.eval_items(), held.ood_items()
    mcfg = VLMModelConfig(path=args.base or str(bundled_model_dir()))
    model, processor = load_vlm(mcfg)
    policy = VLMPolicy(model, processor, min_pixels=mcfg.min_pixels, max_pixels=mcfg.max_pixels)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)
    started, history = time.perf_counter(), []
    print(f"{sum(p.numel() for p in params):,} parameters; {len(train)} train items", file=sys.stderr)
    for step in range(1, args.steps + 1):
        model.train()
        items = [train[i] for i in torch.randint(len(train), (args.batch_size,), generator=g).tolist()]
        loss = policy.sft_loss(policy.teacher_batch(items, [annotator(it, rng) for it in items]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0:
            history.append({"step": step, "loss": float(loss.detach())})
            print(f"step {step}: loss {float(loss.detach()):.3f}", file=sys.stderr)
    model.eval()
    with torch.no_grad():
        final = {"held_out": report(policy, val, args.max_new_tokens), "ood": report(policy, ood, args.max_new_tokens)}
    print(json.dumps(final, indent=1), file=sys.stderr)
    out = Path(args.out)
    policy.save_pretrained(out)
    record = {"command": "python " + " ".join(sys.argv), "args": vars(args),
              "seconds": time.perf_counter() - started, "final": final, "history": history}
    (out / "pretrain.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
