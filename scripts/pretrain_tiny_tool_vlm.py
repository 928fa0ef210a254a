"""Rebuild the bundled tool-using tiny VLM (assets/tiny-qwen2.5-vl-tools) deterministically.

Starts from the bundled tiny Qwen2.5-VL (assets/tiny-qwen2.5-vl) and supervises it on
shapes-zoom (one shape per quadrant of a 448-px image the model sees at 112 px; "What
colour is the shape in the top left?") in two stages, loss on the model's tokens only
(the observation is masked), through the same multi-turn layout the rollouts use
(ToolRollout.teacher):
    1. --read-steps steps of zoom demonstrations only: learn to read the crop;
       <tool_call>{"name": "zoom", ...quadrant box...}</tool_call> [the crop]
       a red circle <answer>red</answer>
    2. --steps steps of a mix: with probability --p-tool the zoom demonstration, otherwise
       a guess without the tool ("a blue shape <answer>blue</answer>", a random colour).
The guesses keep the no-tool answers honest (a no-tool answer trained on the true colour
would teach recalling training images), and the mix leaves a model that calls the tool
sometimes but not reliably (AXPO's "thinking-acting gap"), which is what RL should fix.

--think opens each zoom demonstration with a sentence naming the asked quadrant, and
--p-wrong-box zooms a share of them into another quadrant (see demonstration()); with
--read-steps they set how reliably the model acts on the tool (AXPO's regime in
benchmarks/RESULTS.md: --think --read-steps 200, at 1 thread).

    python scripts/pretrain_tiny_tool_vlm.py --out assets/tiny-qwen2.5-vl-tools

At the end it reports, on held-out items sampled at temperature 1: the tool-call rate, the
accuracy of rollouts that called the tool and of those that did not (so the zoom's value is
measured, not assumed), and greedy accuracy.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from mmrl.vlm.config import ToolsConfig, VLMModelConfig, VLMTrainConfig
from mmrl.vlm.models import bundled_model_dir, load_vlm
from mmrl.vlm.policy import VLMPolicy
from mmrl.vlm.task import VLMTask
from mmrl.vlm.tasks.scenes import COLOURS, SHAPES, Scene
from mmrl.vlm.tasks.shapes_zoom import (
    QUADRANTS,
    ShapesZoom,
    quadrant_box,
    shape_in,
    shapes_zoom_reward,
    zoom_call,
)
from mmrl.vlm.tools import TOOL_CALL_CLOSE, ToolCallError, build_registry, parse_tool_call


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets/tiny-qwen2.5-vl-tools")
    ap.add_argument("--base", default=None, help="starting model (default: the bundled tiny Qwen2.5-VL)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--p-tool", type=float, default=0.4, help="share of demonstrations that use the zoom tool")
    ap.add_argument("--kinds", nargs="+", default=None, help="shapes-zoom question kinds (default: the task's)")
    ap.add_argument("--shape-size", type=int, nargs=2, default=None, help="default: the task's")
    ap.add_argument("--image-max-pixels", type=int, default=None, help="tools.image_max_pixels (default: the model's)")
    ap.add_argument("--p-wrong-box", type=float, default=0.0,
                    help="share of zoom demonstrations (second stage) that zoom into another quadrant and "
                         "answer what that crop shows: a model that acts on the tool unreliably")
    ap.add_argument("--think", action="store_true",
                    help="zoom demonstrations open with a sentence naming the quadrant before the call, "
                         "so that a rollout's prefix before its first tool call is not empty")
    ap.add_argument("--read-steps", type=int, default=150,
                    help="first stage: this many steps of zoom demonstrations only (learn to read the crop)")
    ap.add_argument("--num-train", type=int, default=2000)
    ap.add_argument("--num-val", type=int, default=64)
    ap.add_argument("--eval-samples", type=int, default=4)
    return ap


def demonstration(item, rng: random.Random, p_tool: float, p_wrong_box: float = 0.0,
                  think: bool = False) -> list[str]:
    """A zoom call then the answer; or, without the tool, a guess: the colour (readable at
    112 px) and a random shape. Training a no-tool answer on the true shape would teach the
    model to recall training images instead of looking.

    With p_wrong_box, a zoom demonstration zooms into another (uniformly drawn) quadrant with
    that probability and answers what its crop shows, so the model learns to read the crop
    and to pick the box unreliably. With think, the call is preceded by "Let me look at the
    {quadrant}." (the asked quadrant, even when the box is wrong: thinking right, acting
    wrong)."""
    scene, asked = Scene.from_dict(item.meta["scene"]), item.meta["params"]["quadrant"]
    shape = shape_in(scene, asked)
    if rng.random() < p_tool:
        quadrant, box = asked, item.meta["zoom_box"]
        if p_wrong_box > 0 and rng.random() < p_wrong_box:  # no draw at 0: the bundled rebuild's stream
            quadrant = rng.choice([q for q in QUADRANTS if q != asked])
            box = quadrant_box(quadrant, scene.size)
        seen = shape_in(scene, quadrant)
        answer = seen.shape if item.meta["kind"] == "shape_at" else seen.colour
        call = zoom_call(box)
        if think:
            call = f"Let me look at the {asked}. {call}"
        return [call, f"a {seen.colour} {seen.shape} <answer>{answer}</answer>"]
    if item.meta["kind"] == "shape_at":
        guess = rng.choice(SHAPES)
        return [f"a {shape.colour} {guess} <answer>{guess}</answer>"]
    guess = rng.choice(list(COLOURS))
    return [f"a {guess} shape <answer>{guess}</answer>"]


def first_box_right(text: str, item) -> bool | None:
    """Whether the first tool call in `text` zooms into the asked quadrant's box; None when
    there is no call or it cannot be read as a zoom."""
    end = text.find(TOOL_CALL_CLOSE)
    try:
        name, args = parse_tool_call(text if end < 0 else text[:end])
    except ToolCallError:
        return None
    if name != "zoom":
        return None
    return [args.get(k) for k in ("x0", "y0", "x1", "y1")] == list(item.meta["zoom_box"])


def split_accuracy(policy: VLMPolicy, task: VLMTask, items, rollout, k: int) -> dict[str, float]:
    """Sampled rollouts on held-out items: tool-call rate, accuracy with and without a call,
    AXPO's case (the share of items with a tool-using rollout whose tool users are all wrong),
    and how often a first zoom call names the asked quadrant's box."""
    gen = torch.Generator().manual_seed(1234)
    called, right, boxes = [], [], []
    for start in range(0, len(items), 8):
        chunk = items[start: start + 8]
        batch = policy.generate(chunk, k, rollout, gen)
        scores = task.reward.score(batch.samples)
        called.append(batch.data["stat/called"] > 0)
        right.append(scores.values[:, scores.names.index("answer")] > 0.5)
        boxes += [first_box_right(s.completion, chunk[i // k]) for i, s in enumerate(batch.samples)]
    c, r = torch.cat(called), torch.cat(right)
    named = [b for b in boxes if b is not None]
    used, wrong = c.view(-1, k).any(1), ~(c & r).view(-1, k).any(1)  # items (k samples in a row)
    return {"tool_call_rate": float(c.float().mean()), "accuracy": float(r.float().mean()),
            "tool_groups_all_wrong": float((used & wrong).sum() / used.sum()) if used.any() else float("nan"),
            "right_box_rate": sum(named) / len(named) if named else float("nan"),
            "accuracy_with_tool": float(r[c].float().mean()) if c.any() else float("nan"),
            "accuracy_without_tool": float(r[~c].float().mean()) if (~c).any() else float("nan")}


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    for name in ("p_tool", "p_wrong_box"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            ap.error(f"--{name.replace('_', '-')} is a probability, got {getattr(args, name)}")
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    task_args = {k: v for k, v in (("kinds", args.kinds), ("shape_size", args.shape_size and tuple(args.shape_size)))
                 if v is not None}
    train = ShapesZoom(seed=0, num_train=args.num_train, num_eval=1, **task_args).train_items()
    val = ShapesZoom(seed=1, num_train=1, num_eval=args.num_val, **task_args).eval_items()  # not the RL eval set
    tools_cfg = ToolsConfig(names=["zoom"], schema_in_prompt=False, image_max_pixels=args.image_max_pixels)
    mcfg = VLMModelConfig(path=args.base or str(bundled_model_dir()))
    model, processor = load_vlm(mcfg)
    policy = VLMPolicy(model, processor, min_pixels=mcfg.min_pixels, max_pixels=mcfg.max_pixels,
                       tools=build_registry(tools_cfg.names), tools_cfg=tools_cfg)
    rollout = VLMTrainConfig().rollout.model_copy(update={"max_new_tokens": 64, "tools": tools_cfg})
    task = VLMTask("shapes-zoom", train, val, shapes_zoom_reward(), max_new_tokens=64)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)
    started, history = time.perf_counter(), []
    print(f"{sum(p.numel() for p in params):,} parameters; {len(train)} train items", file=sys.stderr)
    for step in range(1, args.read_steps + args.steps + 1):
        model.train()
        idx = torch.randint(len(train), (args.batch_size,), generator=g).tolist()
        items = [train[i] for i in idx]
        reading = step <= args.read_steps  # the first stage: the right box, always the tool
        p_tool, p_wrong = (1.0, 0.0) if reading else (args.p_tool, args.p_wrong_box)
        batch = policy.agent.teacher(items, [demonstration(it, rng, p_tool, p_wrong, args.think) for it in items])
        loss = policy.sft_loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0:
            history.append({"step": step, "loss": float(loss.detach())})
            print(f"step {step}: loss {float(loss.detach()):.3f}", file=sys.stderr)
    model.eval()
    with torch.no_grad():
        final = {**split_accuracy(policy, task, val, rollout, args.eval_samples),
                 "greedy": task.evaluate(policy)}
    print(json.dumps(final, indent=1), file=sys.stderr)
    out = Path(args.out)
    policy.save_pretrained(out)
    record = {"command": "python " + " ".join(sys.argv), "args": vars(args), "steps": args.steps,
              "seconds": time.perf_counter() - started, "final": final, "history": history}
    (out / "pretrain.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
