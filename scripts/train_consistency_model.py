"""Train the bundled CORA consistency classifier (assets/tiny-consistency-modernbert).

A tiny ModernBERT sequence-pair classifier, random init, learns whether a shapes-qa
answer follows from the completion's own reasoning (mmrl.vlm.consistency): premise =
question + reasoning, hypothesis = "The final answer is {a}.", labels inconsistent (0) /
consistent (1). The tokenizer is word-level over the task's closed vocabulary.

Training pairs come from shapes_qa.generate_items (all kinds, 1-4 shapes). The reasoning
is the scene's description or, half the time, a perturbed one (an object dropped, added,
recoloured, reshaped, or two swapped; once or twice), so the label must be read off the
reasoning: consistent iff the answer equals implied_answer(kind, params, listed objects).
Half the pairs are consistent; a negative's answer is another answer of that kind, often
(for a perturbed reasoning) the scene's true answer, the hard case for a model that
guesses. Every step sees fresh pairs.

Two departures from plain fine-tuning, both because from scratch the 1-bit label alone
left the tiny model on a plateau (about 0.72 held-out after 1500 steps; left_of at chance):
- auxiliary role supervision: a linear head on the encoder's token states (dropped at
  save) predicts the role of each listed object's colour and shape word, ROLES below:
  which objects the question is about and, for left_of, whether object a comes first;
- a larger init (initializer_range 0.2, BERT's is 0.02), so attention is not uniform at
  the start.
Held-out accuracy, per kind, is measured on pairs from another seed and split and written
to train.json with the command. The defaults (3500 steps) take about 5 minutes on 1 thread.

    python scripts/train_consistency_model.py        # rebuilds assets/tiny-consistency-modernbert
    python scripts/train_consistency_model.py --out /tmp/c --steps 500

Deterministic for a seed on a CPU with one thread (the script sets it).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from mmrl.vlm.consistency import hypothesis, implied_answer, parse_reasoning, premise
from mmrl.vlm.tasks.scenes import COLOURS, SHAPES, Scene, describe
from mmrl.vlm.tasks.shapes_qa import KINDS, PLURALS, generate_items

ROOT = Path(__file__).resolve().parents[1]

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MAX_OBJECTS = 5  # an "add" perturbation of a 4-shape scene
ANSWERS = {  # every answer of a kind; negatives draw from these
    "count_colour": [str(i) for i in range(MAX_OBJECTS + 1)],
    "count_shape": [str(i) for i in range(MAX_OBJECTS + 1)],
    "colour_of": list(COLOURS),
    "shape_of": list(SHAPES),
    "left_of": ["yes", "no"],
}
# Role of a listed object (the label of its colour and shape tokens): 0 not named by the
# question; 1 named (counted, asked about, or object b of left_of); 2 / 3 object a of
# left_of, listed before / after b (3 also where the list implies no answer).
ROLES = 4
PERTURBED_P = 0.5  # share of pairs whose reasoning is not the scene's description
HARD_NEGATIVE_P = 0.5  # share of perturbed negatives answered with the scene's true answer
OTHER_KIND_P = 0.25  # share of negatives answered with another kind's answer ("1" to "What shape ...?"):
# without them the classifier never sees a type mismatch, and a policy trained on its score
# learned to answer "1" to everything (CORA at beta 1.0, benchmarks/RESULTS.md)


# ---------------------------------------------------------------------------- data


def text_of(objects) -> str:
    return " , ".join(f"a {c} {s}" for c, s in objects) if objects else "nothing"


def perturb(objects: list, rng: random.Random) -> list:
    """One random edit of the listed objects: drop, add, recolour, reshape or swap two."""
    objects = list(objects)
    ops = ["add"] if not objects else ["drop", "recolour", "reshape"]
    ops += ["swap"] if len(objects) >= 2 else []
    ops += ["add"] if 0 < len(objects) < MAX_OBJECTS else []
    op = rng.choice(ops)
    i = rng.randrange(len(objects)) if objects else 0
    if op == "drop":
        del objects[i]
    elif op == "add":
        objects.insert(rng.randint(0, len(objects)), (rng.choice(list(COLOURS)), rng.choice(SHAPES)))
    elif op == "recolour":
        objects[i] = (rng.choice([c for c in COLOURS if c != objects[i][0]]), objects[i][1])
    elif op == "reshape":
        objects[i] = (objects[i][0], rng.choice([s for s in SHAPES if s != objects[i][1]]))
    else:
        j = rng.choice([k for k in range(len(objects)) if k != i])
        objects[i], objects[j] = objects[j], objects[i]
    return objects


def roles(kind: str, params: dict, objects: list) -> list[int]:
    """The ROLES of the listed objects for a question."""
    key = {"count_colour": 0, "shape_of": 0, "count_shape": 1, "colour_of": 1}.get(kind)
    if key is not None:
        slot = params["colour" if key == 0 else "shape"]
        return [int(o[key] == slot) for o in objects]
    a = (params["a"]["colour"], params["a"]["shape"])
    b = (params["b"]["colour"], params["b"]["shape"])
    first = 2 if implied_answer(kind, params, objects) == "yes" else 3
    return [first if o == a else int(o == b) for o in objects]


def make_pairs(n: int, seed: int, split: str = "train", per_item: int = 1) -> list[dict]:
    """n labelled pairs {kind, params, question, reasoning, roles, answer, premise,
    hypothesis, label}, alternating label 1 (consistent), 0. Each shapes-qa item serves
    `per_item` pairs in a row (drawing an item costs more than drawing a pair)."""
    items = generate_items(-(-n // per_item), seed, split=f"consistency-{split}")
    pairs = []
    for i in range(n):
        item = items[i // per_item]
        rng = random.Random(f"consistency/{split}/{seed}/{i}")
        kind, params = item.meta["kind"], item.meta["params"]
        scene = parse_reasoning(describe(Scene.from_dict(item.meta["scene"])))
        want = 1 - i % 2
        for _ in range(10):  # a perturbed reasoning may imply no answer; a positive needs one
            objects, perturbed = scene, rng.random() < PERTURBED_P
            if perturbed:
                objects = perturb(objects, rng)
                if rng.random() < 0.3:
                    objects = perturb(objects, rng)
            implied = implied_answer(kind, params, objects)
            if not (want and implied is None):
                break
        else:
            objects, perturbed, implied = scene, False, item.answer
        if want:
            answer = implied
        elif perturbed and item.answer != implied and rng.random() < HARD_NEGATIVE_P:
            answer = item.answer
        elif rng.random() < OTHER_KIND_P:
            answer = rng.choice(sorted({a for k, v in ANSWERS.items() if k != kind for a in v} - set(ANSWERS[kind])))
        else:
            answer = rng.choice([a for a in ANSWERS[kind] if a != implied])
        reasoning = text_of(objects)
        pairs.append({
            "kind": kind, "params": params, "question": item.question, "reasoning": reasoning,
            "roles": roles(kind, params, objects), "answer": answer, "label": int(answer == implied),
            "premise": premise(item.question, reasoning), "hypothesis": hypothesis(answer),
        })
    return pairs


# ---------------------------------------------------------------------------- tokenizer, model


def build_tokenizer(max_length: int):
    """Word-level tokenizer over the closed shapes-qa vocabulary, with BERT's pair template."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    pre = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation("isolated"),
                                   pre_tokenizers.Digits(individual_digits=True)])
    texts = [hypothesis("yes"), "nothing", *(str(d) for d in range(10)), *ANSWERS["left_of"]]
    texts += [f"a {c} {s} , {PLURALS[s]}" for c in COLOURS for s in SHAPES]
    for item in generate_items(2000, 0, split="consistency-vocab"):  # every template and slot
        texts += [item.question, item.reference.split("<answer>")[0], item.answer]
    words = sorted({w for t in texts for w, _ in pre.pre_tokenize_str(t.lower())})
    vocab = {w: i for i, w in enumerate(SPECIALS + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", model_max_length=max_length,
        model_input_names=["input_ids", "attention_mask"])  # ModernBERT takes no token_type_ids


def build_model(tokenizer, args):
    from transformers import ModernBertConfig, ModernBertForSequenceClassification

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    config = ModernBertConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, intermediate_size=2 * args.hidden,
        max_position_embeddings=args.max_length, initializer_range=args.init,
        layer_types=["full_attention"] * args.layers,  # sequences are short: no sliding window
        # ModernBERT's global theta (160000) is for 8k contexts; ours stay under 64 tokens
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        pad_token_id=ids["[PAD]"], cls_token_id=ids["[CLS]"], sep_token_id=ids["[SEP]"],
        bos_token_id=ids["[CLS]"], eos_token_id=ids["[SEP]"], classifier_pooling="cls",
        num_labels=2, id2label={0: "inconsistent", 1: "consistent"},
        label2id={"inconsistent": 0, "consistent": 1})
    torch.manual_seed(args.seed)
    return ModernBertForSequenceClassification(config)


def encode(tokenizer, pairs):
    """ids [B, T], attention mask [B, T], labels [B] and role labels [B, T] (-100 but at
    the colour and shape word of each listed object)."""
    enc = tokenizer([p["premise"] for p in pairs], [p["hypothesis"] for p in pairs],
                    padding=True, return_tensors="pt")
    ids = enc["input_ids"]
    role = torch.full_like(ids, -100)
    starts = [1 + len(q) for q in tokenizer([p["question"] for p in pairs], add_special_tokens=False)["input_ids"]]
    for i, (p, start) in enumerate(zip(pairs, starts)):
        for j, r in enumerate(p["roles"]):  # object j is "a <colour> <shape> ," from start + 4j
            role[i, start + 4 * j + 1 : start + 4 * j + 3] = r
    words = {tokenizer.convert_tokens_to_ids(w) for w in [*COLOURS, *SHAPES]}
    if not set(ids[role >= 0].tolist()) <= words:  # a premise not laid out as text_of writes it
        raise RuntimeError("role labels fell on tokens other than colour and shape words")
    return ids, enc["attention_mask"], torch.tensor([p["label"] for p in pairs]), role


@torch.no_grad()
def evaluate(model, tokenizer, pairs) -> dict[str, float]:
    """Accuracy (argmax) per kind and overall."""
    model.eval()
    right, count = defaultdict(int), defaultdict(int)
    for i in range(0, len(pairs), 256):
        chunk = pairs[i : i + 256]
        ids, mask, labels, _ = encode(tokenizer, chunk)
        pred = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
        for p, ok in zip(chunk, (pred == labels).tolist()):
            for key in (p["kind"], "all"):
                right[key] += ok
                count[key] += 1
    model.train()
    return {k: round(right[k] / count[k], 4) for k in [*KINDS, "all"] if count[k]}


# ---------------------------------------------------------------------------- main


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="assets/tiny-consistency-modernbert")
    ap.add_argument("--steps", type=int, default=3500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--init", type=float, default=0.2, help="initializer_range (see the docstring)")
    ap.add_argument("--role-weight", type=float, default=1.0, help="weight of the auxiliary role loss")
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--num-eval", type=int, default=2000)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.num_eval < 1:
        ap.error("--steps, --batch and --num-eval must be >= 1")
    torch.set_num_threads(1)  # determinism, and the CPUs are shared
    start = time.time()
    out = Path(args.out) if Path(args.out).is_absolute() else ROOT / args.out

    tokenizer = build_tokenizer(args.max_length)
    model = build_model(tokenizer, args)
    role_head = torch.nn.Linear(args.hidden, ROLES)  # auxiliary, not saved
    states = {}  # the encoder's last hidden states, [B, T, H], caught on the way to the classifier
    model.model.register_forward_hook(lambda mod, inp, out: states.update(h=out.last_hidden_state))
    train = make_pairs(args.steps * args.batch, args.seed, "train", per_item=4)
    held_out = make_pairs(args.num_eval, args.seed + 1000, "eval")
    unknown = sum(tokenizer.unk_token_id in ids for ids in encode(tokenizer, held_out)[0].tolist())
    if unknown:
        raise RuntimeError(f"{unknown} held-out pairs hold words outside the vocabulary")
    params = [*model.parameters(), *role_head.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warmup, cosine decay to 0
        opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * s / args.steps))))
    record = []
    model.train()
    for step in range(args.steps):
        ids, mask, labels, role = encode(tokenizer, train[step * args.batch : (step + 1) * args.batch])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        role_loss = torch.nn.functional.cross_entropy(role_head(states["h"]).flatten(0, 1), role.flatten())
        (loss + args.role_weight * role_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % max(1, args.steps // 7) == 0 or step + 1 == args.steps:
            acc = evaluate(model, tokenizer, held_out[:500])
            record.append({"step": step + 1, "loss": round(loss.item(), 4), "role_loss": round(role_loss.item(), 4),
                           "held_out_500": acc["all"], "seconds": round(time.time() - start, 1)})
            print(json.dumps(record[-1]), flush=True)

    accuracy = evaluate(model, tokenizer, held_out)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {
        "command": " ".join(["python scripts/train_consistency_model.py", *(sys.argv[1:] if argv is None else argv)]),
        "args": vars(args), "seed": args.seed, "steps": args.steps,
        "parameters": sum(p.numel() for p in model.parameters()),
        "held_out": {"pairs": len(held_out), "seed": args.seed + 1000, "split": "eval", "accuracy": accuracy},
        "record": record, "seconds": round(time.time() - start, 1), "threads": torch.get_num_threads(),
    }
    (out / "train.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps({"accuracy": accuracy, "seconds": info["seconds"]}))
    return info


if __name__ == "__main__":
    main()
