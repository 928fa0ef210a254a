"""CAST's pixel-space projection: teacher-forced attention of image queries to text keys.

CAST (docs/methods.md section 4, step 4; a RECONSTRUCTION, see diffusion_rl/methods/cast.py) re-runs
the model on the stored x_t of the window and reads, in the joint attention of FLUX-style and
SD3-style transformers, how much each image token attends to each text token:

    with TextAttention(flow, layers) as rec:      # the layers: indices into joint_attention_modules
        v = flow.velocity(x, sigma, cond)         # the ordinary forward, gradients as usual
    att = rec.result()                            # [N, L_img, S_txt], mean over heads and layers

The probabilities are the attention's own softmax over ALL keys (text and image), restricted to
the text columns; they are computed again from the layer's query and key, detached, so the
forward itself and its gradients are untouched. Under classifier-free guidance only the
conditional rows are kept.

How: a forward pre-hook on each chosen attention module marks it as running, and the attention
primitive its processor calls (diffusers' `dispatch_attention_fn`, [B, S, H, D], in FLUX's
processor; `F.scaled_dot_product_attention`, [B, H, S, D], in SD3's JointAttnProcessor2_0) is
wrapped in that processor's module for the duration of the block. FLUX puts the text tokens
first in the joint sequence, SD3 last.

`atom_maps` then turns the attention into one normalised map per reward atom from the atom's
text tokens: the character spans a prompt parser (diffusion_rl/scene_graph.py) gives, matched to
the text keys' character offsets (`text_key_spans`). `region_maps` makes the same maps from
pixel masks instead (method.projection: detector, the detected objects' boxes).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

FAMILIES = ("flux", "sd3")  # joint attention whose layout this module knows
TEXT_FIRST = {"flux": True, "sd3": False}

__all__ = ["FAMILIES", "TextAttention", "atom_maps", "default_layers", "image_tokens_inside",
           "joint_attention_modules", "text_key_spans"]


def joint_attention_modules(flow) -> list[nn.Module]:
    """The joint (text + image) attention modules in forward order: the double-stream blocks,
    then FLUX's single-stream blocks."""
    tr = flow.transformer
    blocks = [*getattr(tr, "transformer_blocks", []), *getattr(tr, "single_transformer_blocks", [])]
    return [b.attn for b in blocks]


def default_layers(n: int) -> list[int]:
    """The middle half of n layers (at least one): CAST's "middle layers"."""
    lo, hi = n // 4, n - n // 4
    return list(range(lo, hi)) if hi > lo else [n // 2]


class TextAttention(contextlib.AbstractContextManager):
    """Records image-query -> text-key attention in the chosen joint-attention layers (module
    docstring). Use one instance per forward; `result()` averages what it recorded. rows: keep
    only the first rows of each batch (under CFG the conditional half: the rest is neither
    computed nor held).

    The wrapped primitives are module globals, which a pipelined engine thread sampling with its
    own copy of the model calls too: only the thread whose chosen module is running records."""

    def __init__(self, flow, layers: Sequence[int] | None = None, rows: int | None = None):
        if flow.family not in FAMILIES:
            raise ValueError(f"CAST's attention maps support the {' and '.join(FAMILIES)} families, not "
                             f"{flow.family!r}; set method.projection: none")
        mods = joint_attention_modules(flow)
        layers = default_layers(len(mods)) if layers is None else list(layers)
        bad = [i for i in layers if not -len(mods) <= i < len(mods)]
        if bad or not layers:
            raise ValueError(f"attention layers {layers} out of range: the model has {len(mods)} joint-attention "
                             "layers (indices 0..n-1, or -n..-1 from the end, over its double- then single-stream blocks)")
        self.flow, self.modules = flow, [mods[i] for i in layers]
        self.text_first = TEXT_FIRST[flow.family]
        self.n_img = flow.seq_len
        self.rows = rows
        self._active: int | None = None  # the ident of the thread inside a chosen module
        self._maps: list[Tensor] = []
        self._undo: list = []

    # -------------------------------------------------------------- recording

    def _record(self, q: Tensor, k: Tensor, scale: float | None) -> None:
        """q, k [B, H, S, D] of one attention call -> [B, L_img, S_txt] appended."""
        s = q.shape[2]
        img = slice(s - self.n_img, s) if self.text_first else slice(0, self.n_img)
        txt = slice(0, s - self.n_img) if self.text_first else slice(self.n_img, s)
        with torch.no_grad():
            q, k = q[: self.rows].detach().float(), k[: self.rows].detach().float()
            scale = scale if scale is not None else q.shape[-1] ** -0.5
            probs = torch.softmax(q[:, :, img] @ k.transpose(-1, -2) * scale, dim=-1)  # [B, H, L, S]
            self._maps.append(probs[..., txt].mean(1))

    def _dispatch(self, fn):
        def wrapped(query, key, value, *args, **kwargs):
            if self._active == threading.get_ident():  # [B, S, H, D]
                self._active = None  # a primitive calling another records once
                self._record(query.transpose(1, 2), key.transpose(1, 2), kwargs.get("scale"))
            return fn(query, key, value, *args, **kwargs)
        return wrapped

    def _sdpa(self, fn):
        def wrapped(query, key, value, *args, **kwargs):
            if self._active == threading.get_ident():  # [B, H, S, D]
                self._active = None
                self._record(query, key, kwargs.get("scale"))
            return fn(query, key, value, *args, **kwargs)
        return wrapped

    def __enter__(self):
        patched = set()
        for mod in self.modules:
            module = sys.modules[type(mod.processor).__module__]
            if module.__name__ in patched:
                continue
            patched.add(module.__name__)
            if hasattr(module, "dispatch_attention_fn"):
                self._set(module, "dispatch_attention_fn", self._dispatch(module.dispatch_attention_fn))
            if hasattr(module, "F"):
                sdpa = self._sdpa(module.F.scaled_dot_product_attention)
                self._set(module, "F", _Override(module.F, scaled_dot_product_attention=sdpa))
        for mod in self.modules:
            self._undo.append(mod.register_forward_pre_hook(self._enter_module).remove)
            self._undo.append(mod.register_forward_hook(lambda *_: setattr(self, "_active", None)).remove)
        return self

    def _enter_module(self, *_) -> None:
        self._active = threading.get_ident()

    def _set(self, module, name: str, value) -> None:
        old = getattr(module, name)
        setattr(module, name, value)
        self._undo.append(lambda: setattr(module, name, old))

    def __exit__(self, *exc):
        for undo in reversed(self._undo):
            undo()
        self._undo, self._active = [], None
        return False

    def result(self, n: int | None = None) -> Tensor:
        """[N, L_img, S_txt]: the mean over the recorded layers (and heads). n: the number of
        samples, to keep the conditional half of a CFG forward (its first n rows)."""
        if not self._maps:
            raise RuntimeError("no attention was recorded: the chosen layers did not run inside the block, "
                               "or their processor calls an attention primitive this module does not wrap")
        att = torch.stack(self._maps).mean(0)
        return att[:n] if n is not None else att


class _Override:
    """`base` with some attributes replaced (torch.nn.functional as one processor module sees it)."""

    def __init__(self, base, **override):
        self._base, self._override = base, override

    def __getattr__(self, name):
        return self._override[name] if name in self._override else getattr(self._base, name)


# ------------------------------------------------------------------ text tokens and atom maps


def _offsets(tokenizer, prompts: list[str], length: int) -> list[list[tuple[int, int] | None]]:
    enc = tokenizer(prompts, padding="max_length", max_length=length, truncation=True,
                    return_offsets_mapping=True)
    return [[(a, b) if b > a else None for a, b in row] for row in enc["offset_mapping"]]


def text_key_spans(flow, prompts: Sequence[str]) -> list[list[tuple[int, int] | None]]:
    """For each prompt, the character span of the prompt each text key covers (None: padding,
    special tokens, SD3's zero T5 block), in the order of the transformer's text sequence."""
    prompts = list(prompts)
    if flow.family == "flux":
        return _offsets(flow.tokenizer_2, prompts, flow.max_sequence_length)
    if flow.family == "sd3":
        clip = _offsets(flow.clip[0][0], prompts, flow.clip_length)  # CLIP-L and -G share positions
        if flow.tokenizer_3 is None:
            return [row + [None] * flow.max_sequence_length for row in clip]
        t5 = _offsets(flow.tokenizer_3, prompts, flow.max_sequence_length)
        return [a + b for a, b in zip(clip, t5)]
    raise ValueError(f"text_key_spans: the {flow.family!r} family is not supported (only {FAMILIES})")


def atom_maps(att: Tensor, key_spans: Sequence[Sequence[tuple[int, int] | None]],
              atom_spans: Sequence[dict[str, list[tuple[int, int]]]], columns: Sequence[str],
              norm: str = "mean") -> Tensor:
    """[N, K, L] normalised maps M_k: for sample n and column k, the attention of every image
    token to the text keys overlapping the column's character spans, summed over those keys,
    then divided by its mean over the image ("mean": the map averages 1, so it moves the
    advantage around without scaling it) or by its maximum ("max"). A column without spans, or
    whose spans no text key covers (truncated), gets the uniform map 1.

    att [N, L, S]; key_spans: N rows of S spans (text_key_spans); atom_spans: N parser outputs."""
    if norm not in ("mean", "max"):
        raise ValueError(f"map norm must be 'mean' or 'max'; got {norm!r}")
    n, length, s = att.shape
    out = torch.ones(n, len(columns), length, dtype=torch.float32, device=att.device)
    for i in range(n):
        if len(key_spans[i]) != s:
            raise ValueError(f"sample {i}: {len(key_spans[i])} text key spans for {s} attended text keys")
        for k, col in enumerate(columns):
            want = atom_spans[i].get(col) or []
            keys = [j for j, span in enumerate(key_spans[i])
                    if span is not None and any(span[0] < b and a < span[1] for a, b in want)]
            if not keys:
                continue
            m = att[i, :, keys].float().sum(-1)  # [L]
            d = m.mean() if norm == "mean" else m.max()
            out[i, k] = torch.where(d > 0, m / d, out[i, k])  # d = 0: uniform; no device sync per map
    return out


def region_maps(regions: Sequence[Mapping[str, object]], columns: Sequence[str], grid: tuple[int, int],
                norm: str = "mean") -> Tensor:
    """[N, K, L] maps M_k from pixel masks: for sample n and column k, the share of each image
    token's pixels inside regions[n][k] (an [H, W] bool mask; the grid's tokens in the maps'
    row-major order), divided by its mean or maximum as in atom_maps. A column without a mask
    (None or missing), or whose mask is empty, gets the uniform map 1. On the CPU, where the
    detector's NumPy masks are; the caller moves the maps to the model's device."""
    if norm not in ("mean", "max"):
        raise ValueError(f"map norm must be 'mean' or 'max'; got {norm!r}")
    out = torch.ones(len(regions), len(columns), grid[0] * grid[1])
    for i, masks in enumerate(regions):
        for k, col in enumerate(columns):
            mask = masks.get(col)
            if mask is None:
                continue
            m = torch.nn.functional.adaptive_avg_pool2d(torch.as_tensor(mask).float()[None], grid).flatten()
            d = m.mean() if norm == "mean" else m.max()
            if d > 0:
                out[i, k] = m / d
    return out


def image_tokens_inside(mask, grid: int) -> Tensor:
    """[grid * grid] bool, in the maps' token order: the image tokens whose pixels lie more than
    half inside a [size, size] pixel mask (size a multiple of grid), e.g. Scene.box_mask()."""
    m = torch.as_tensor(mask).float()
    size = m.shape[0]
    if m.shape != (size, size) or size % grid:
        raise ValueError(f"image_tokens_inside: a square mask with a side that is a multiple of {grid} "
                         f"is expected, got shape {tuple(m.shape)}")
    return m.view(grid, size // grid, grid, size // grid).mean((1, 3)).flatten() > 0.5
