"""mmrl vs TRL's GRPOTrainer on the bundled tiny Qwen2.5-VL and shapes-qa, side by side.

Same model, task, group size (8), batch (8 prompts x 8 = 64 samples per step),
completion length (32), learning rate (constant), temperature (1.0), no KL, GRPO
loss (per-sample token mean), one update per rollout batch. The two trainers run
alternately in one process; throughput is samples per second of training steps
(rollout + reward + update, each side's own per-step timer), and both trained
models are scored by the same held-out evaluation (greedy and sampled accuracy).

    pip install -e ".[bench]"
    python benchmarks/vs_trl.py            # 100 steps each
    python benchmarks/vs_trl.py --quick    # 10 steps each, for a smoke test
    python benchmarks/vs_trl.py --steps 500 --lr 5e-4   # the main job's length and learning rate
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from mmrl.core.config import load_config
from mmrl.core.logging import read_metrics
from mmrl.core.rewards import Sample
from mmrl.core.trainer import Trainer
from mmrl.vlm import backend
from mmrl.vlm.models import bundled_model_dir
from mmrl.vlm.policy import VLMPolicy

G, PROMPTS, MAX_NEW = 8, 8, 32


def mmrl_run(steps: int, seed: int, out: Path, lr: float):
    cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG, overrides=[
        f"output_dir={out}", f"train.max_steps={steps}", f"seed={seed}", f"optim.lr={lr}",
        f"rollout.num_generations={G}", f"rollout.prompts_per_step={PROMPTS}",
        f"rollout.max_new_tokens={MAX_NEW}", "optim.max_grad_norm=1.0", "task.num_eval=8",
        "rollout.eval_samples=0", "logging.tensorboard=false", "logging.progress=false",
        "train.log_samples_every=0"])
    policy, task = backend.build(cfg)
    Trainer(cfg, policy, task).train()
    seconds = sum(r["time/step"] for r in read_metrics(out / "metrics.jsonl"))
    return policy, seconds


def trl_run(steps: int, seed: int, out: Path, train_items, lr: float):
    from datasets import Dataset
    from transformers import AutoProcessor
    from trl import GRPOConfig, GRPOTrainer

    from mmrl.vlm.tasks.shapes_qa import shapes_qa_reward

    reward = shapes_qa_reward()

    def shapes_reward(prompts, completions, answer, **kw):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        samples = [Sample(prompt="", completion=t, meta={"answer": a}) for t, a in zip(texts, answer)]
        return reward.score(samples).total.tolist()

    data = Dataset.from_list([
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": it.question}]}],
         "image": it.images[0], "answer": it.answer}
        for it in train_items
    ])
    path = str(bundled_model_dir())
    processor = AutoProcessor.from_pretrained(path)
    args = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=G * PROMPTS, num_generations=G,
        max_completion_length=MAX_NEW, learning_rate=lr, lr_scheduler_type="constant", max_steps=steps,
        temperature=1.0, top_k=0, top_p=1.0, beta=0.0, loss_type="grpo", num_iterations=1,
        max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
        seed=seed, disable_tqdm=True, gradient_checkpointing=False,  # mmrl does not recompute activations
    )
    trainer = GRPOTrainer(model=path, reward_funcs=[shapes_reward], args=args, train_dataset=data,
                          processing_class=processor)
    trainer.train()
    seconds = sum(float(h["step_time"]) for h in trainer.state.log_history if "step_time" in h)
    return VLMPolicy(trainer.model, processor), seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="training steps each (default 100; --quick: 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3, help="constant, both sides (the main job's: 5e-4)")
    ap.add_argument("--quick", action="store_true", help="10 steps each (an explicit --steps still counts)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    # --quick used to overwrite an explicit --steps: it only sets the default
    steps = args.steps if args.steps is not None else 10 if args.quick else 100
    if steps < 1:  # throughput divides by the steps' seconds
        ap.error(f"--steps must be >= 1, got {steps}")
    # checked first: the TRL side runs second, so a missing package surfaced as a traceback
    # only after the mmrl side had trained all its steps. Exit 3: an optional extra is missing.
    missing = [m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"error: vs_trl.py needs {' and '.join(missing)}, the bench extra: pip install -e \".[bench]\"",
              file=sys.stderr)
        return 3

    cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG)
    task = backend.build_task(cfg)  # the same held-out items for both
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("mmrl", "trl"):  # alternate: one then the other, same process
            t0 = time.perf_counter()
            if name == "mmrl":
                policy, seconds = mmrl_run(steps, args.seed, Path(tmp) / name, args.lr)
            else:
                policy, seconds = trl_run(steps, args.seed, Path(tmp) / name, task.train, args.lr)
            wall = time.perf_counter() - t0
            policy.model.eval()
            with torch.no_grad():
                metrics = task.evaluate(policy)
            results[name] = {"samples_per_s": steps * G * PROMPTS / seconds, "step_seconds": seconds,
                             "wall_seconds": wall, **metrics}
            print(f"{name}: {json.dumps(results[name])}", file=sys.stderr)
    base = backend.build(cfg)[0]
    with torch.no_grad():
        results["start"] = task.evaluate(base)
    ratio = results["mmrl"]["samples_per_s"] / results["trl"]["samples_per_s"]
    results["ratio"] = ratio
    results["steps"] = steps
    results["lr"] = args.lr
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(f"start: accuracy {results['start']['accuracy']:.3f}")
    for name in ("mmrl", "trl"):
        r = results[name]
        print(f"{name}: {r['samples_per_s']:.1f} samples/s, accuracy {r['accuracy']:.3f} "
              f"(sampled {r.get('sampled_accuracy', float('nan')):.3f})")
    print(f"samples/s ratio mmrl / trl: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
