"""Visual claims in a response's reasoning, their tokens, and how persistent they are
(PACG, docs/methods.md section 2; the claim rule is our RECONSTRUCTION from the abstract).

A claim span is a sentence-like segment of the reasoning (the text before the answer tag,
split at . , ; ! ? and newlines) that names image content: a number, a colour, a position
or an object name from `CLAIM_WORDS` (or a user's list). Its persistence under an
intervened image I' is

    persistence(c) = mean_{t in c} min(1, exp(l'_t - l_t))

with l_t = log pi(y_t | x, I, y_<t) and l'_t the same token under I': 1 means the image
change did not make the claim any less likely (nothing in it depended on what was
masked), near 0 that the claim is retracted without the image.

For the shapes scenes, `shapes_claim_holds` checks a claim against the scene itself, so
the persistence of claims that are false of the scene can be measured (the issue's check).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from mmrl.vlm.tasks.scenes import COLOURS, SHAPES

__all__ = ["CLAIM_WORDS", "batch_claims", "claim_persistence", "claim_spans", "shapes_claim_holds", "token_claims"]

_NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
            "single", "pair", "both", "several", "many", "none")
_COLOURS = ("red", "green", "blue", "yellow", "orange", "purple", "pink", "black", "white", "gray", "grey",
            "brown")
_POSITIONS = ("left", "right", "top", "bottom", "above", "below", "middle", "center", "centre", "corner",
              "upper", "lower", "beside", "behind", "front", "next")
_OBJECTS = ("circle", "square", "triangle", "rectangle", "shape", "object", "ball", "box", "line",
            "person", "man", "woman", "car", "dog", "cat", "tree", "building", "sign", "table", "chart")
CLAIM_WORDS: tuple[str, ...] = _NUMBERS + _COLOURS + _POSITIONS + _OBJECTS
"""Default claim vocabulary: a segment naming any of these (a plural 's' allowed) or a digit
asserts image content."""

_SPLIT = re.compile(r"[.,;!?\n]")


def claim_spans(text: str, words: Iterable[str] = CLAIM_WORDS, answer_tag: str = "<answer>") -> list[tuple[int, int]]:
    """Character spans [start, end) of the claim segments of `text`'s reasoning (before
    `answer_tag`'s first occurrence in any case, as shapes-mood's format check and DSPO read
    tags; the whole text if it has none), whitespace trimmed."""
    # re's case folding, not text.lower(): "İ".lower() is two characters and would shift the cut
    tag = re.search(re.escape(answer_tag), text, re.IGNORECASE) if answer_tag else None
    reasoning = text if tag is None else text[: tag.start()]
    words = sorted({w.strip() for w in words if w.strip()}, key=len, reverse=True)  # a blank word matches anywhere
    vocab = re.compile((r"\b(?:" + "|".join(map(re.escape, words)) + r")s?\b|" if words else "") + r"\d",
                       re.IGNORECASE)
    spans, start = [], 0
    for m in [*_SPLIT.finditer(reasoning), None]:
        stop = m.start() if m else len(reasoning)
        seg = reasoning[start:stop]
        if vocab.search(seg):
            lead = len(seg) - len(seg.lstrip())
            spans.append((start + lead, start + len(seg.rstrip())))
        start = stop + 1
    return spans


def token_claims(tokenizer, ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> list[int]:
    """Per token of `ids`, the index of the claim span its text overlaps, or -1.

    Character offsets come from decoding growing prefixes (skip_special_tokens, as the
    rollout's text was decoded), which is exact for byte-level BPE where a single token
    need not decode to whole characters."""
    out, prev = [], 0
    for k in range(len(ids)):
        end = len(tokenizer.decode(list(ids[: k + 1]), skip_special_tokens=True))
        claim = -1
        for c, (s, e) in enumerate(spans):
            if prev < e and end > s:
                claim = c
                break
        out.append(claim)
        prev = end
    return out


def batch_claims(tokenizer, ids: Tensor, mask: Tensor, spans: Sequence[Sequence[tuple[int, int]]]) -> Tensor:
    """[N, T] long: the claim index of every trained token of a batch (-1 elsewhere), from each
    response's completion ids [N, T], mask [N, T] and the claim spans of its text."""
    out = torch.full(ids.shape, -1, dtype=torch.long)  # filled from Python lists on the CPU, then moved
    ids_cpu, mask_cpu = ids.cpu(), mask.cpu()
    for i, sp in enumerate(spans):
        if sp:
            out[i, mask_cpu[i]] = torch.tensor(token_claims(tokenizer, ids_cpu[i][mask_cpu[i]].tolist(), sp))
    return out.to(ids.device)


def claim_persistence(logp: Tensor, logp_intervened: Tensor, claim_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Persistence of every claim of a batch: logp, logp_intervened [N, T]; claim_ids [N, T]
    long (-1 outside claims). Returns (persistence [C] on logp's device, (sample, claim) index
    [C, 2] on the CPU: bookkeeping, read as Python ints)."""
    ratio = (logp_intervened - logp).clamp(max=0.0).exp()  # min(1, exp(l' - l))
    values, index = [], []
    for i in range(claim_ids.shape[0]):
        for c in torch.unique(claim_ids[i]).tolist():
            if c < 0:
                continue
            at = claim_ids[i] == c
            values.append(ratio[i][at].mean())
            index.append((i, c))
    if not values:
        return torch.zeros(0, device=logp.device), torch.zeros((0, 2), dtype=torch.long)
    return torch.stack(values), torch.tensor(index, dtype=torch.long)


_SHAPE_CLAIM = re.compile(r"\b(" + "|".join(COLOURS) + r")\s+(" + "|".join(SHAPES) + r")s?\b", re.IGNORECASE)


def shapes_claim_holds(claim: str, scene: dict) -> bool | None:
    """Whether every "<colour> <shape>" a claim names is in the scene (Scene.to_dict());
    None when the claim names none (not checkable)."""
    named = _SHAPE_CLAIM.findall(claim)
    if not named:
        return None
    present = {(s["colour"], s["shape"]) for s in scene["shapes"]}
    return all((c.lower(), s.lower()) in present for c, s in named)
