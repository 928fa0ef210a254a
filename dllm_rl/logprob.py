"""Log-probability estimators and masking for masked diffusion language models.

A masked diffusion LM (LLaDA) has no exact sequence likelihood; RL methods estimate
per-token log-probs from one or a few forward passes on partially masked inputs. This file
builds those inputs and reads the estimates out of the logits. Every function is a pure
tensor function: the caller runs the model.

* ``token_logprobs``: log_softmax(logits / T) gathered at the targets, in float32.
* ``d1_masked_input``: diffu-GRPO's one-step mean-field estimate (Zhao et al. 2025,
  "d1: Scaling Reasoning in Diffusion LLMs via RL"; dllm-reasoning/d1
  ``diffu_grpo_trainer.py`` forward_process / _get_per_token_logps). Mask the whole
  completion and each prompt token with probability p_mask = 0.15; log pi(o_k) ~
  log p(o_k | masked prompt, fully masked completion), read at logits[:, P:].
  Departures: d1 reseeds the global RNG (``set_seed``); we draw from a local
  ``torch.Generator`` so nothing else's randomness moves. d1 also masks left padding of
  the prompt; we never mask positions where ``prompt_valid`` is False.
* ``coupled_masks`` / ``coupled_logprob``: coupled-GRPO (Gong et al. 2025, "DiffuCoder";
  apple/ml-diffucoder ``coupled_grpo.py``). Two passes with complementary masks, so every
  completion token is scored exactly once, in the pass where it is masked. Departures:
  DiffuCoder draws one t ~ U(0.2, 0.8) per batch with Python's ``random``; we draw one t per
  row from ``generator`` (same default range). DiffuCoder also masks completion padding,
  adds a third fully masked pass and returns (logp_full + w * logp_coupled) / 2 with
  w = 1/t or 1/(1-t); we return the unweighted coupled log-prob (the caller may weight).
* ``trace_rows``: TraceRL's trajectory slicing (Wang et al. 2025, "Revolutionizing RL
  Framework for Diffusion LLMs"; Gen-Verse/dLLM-RL ``train/rl_llada.py`` and
  ``train/rl_sdar.py``). See its docstring for the block-boundary rules.
* ``forward_mask`` / ``elbo_loss``: LLaDA's masked-diffusion objective (Nie et al. 2025,
  "Large Language Diffusion Models"; ML-GSAI/LLaDA ``GUIDELINES.md``). t ~ U(0,1),
  p = (1 - eps) t + eps, mask each response token with probability p; loss = sum over masked
  positions of CE / p, divided by the number of valid tokens. Departure: LLaDA's SFT code
  divides each row by its own answer length and averages rows; we divide by the batch's
  token count (the same when all rows have equal length), and positions the caller marks
  invalid are never masked (LLaDA counts padded <EOS> as answer tokens: mark them valid
  to match).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmrl.core.logprob import token_logprobs as core_token_logprobs


def uniform(shape, *, generator: torch.Generator | None, device, dtype=torch.float32) -> torch.Tensor:
    """U(0, 1) draws of ``shape`` on ``device``, made on the generator's device and moved there.
    The callers' generators are CPU ones (the trainer's, seeded per rollout): the draws, and so
    the masks, of a seed are then the same whichever device the model is on. No generator:
    the global RNG of ``device``."""
    where = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, device=where, dtype=dtype).to(device)


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, chunk: int | None = None
) -> torch.Tensor:
    """float32 log_softmax(logits / temperature) at ``targets``; temperature <= 0 means 1.
    ``chunk``: positions at a time, without float32 [B, L, V] copies (mmrl.core.logprob).

    logits [B, L, V], targets [B, L] long -> [B, L] float32.
    """
    return core_token_logprobs(logits, targets, temperature if temperature > 0 else 1.0, chunk=chunk)


def masked_input(ids: torch.Tensor, mask: torch.Tensor, mask_id: int) -> torch.Tensor:
    """``ids`` with ``mask_id`` wherever ``mask`` is True. ids [B, L] long, mask [B, L] bool."""
    return torch.where(mask, torch.full_like(ids, mask_id), ids)  # [B, L]


def d1_masked_input(
    prompt_ids: torch.Tensor,
    completion_ids: torch.Tensor,
    *,
    mask_id: int,
    p_mask: float = 0.15,
    seed: int,
    prompt_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """diffu-GRPO input: the completion fully masked, valid prompt tokens masked w.p. p_mask.

    prompt_ids [B, P], completion_ids [B, C], prompt_valid [B, P] bool (None: all valid)
    -> [B, P + C] long. The same ``seed`` gives the same mask (old and new log-probs of one
    inner iteration must see the same input). Then
    ``token_logprobs(logits[:, P:], completion_ids)`` is the per-token estimate.
    """
    gen = torch.Generator().manual_seed(int(seed))  # on the CPU: one seed, one mask on any device
    u = uniform(prompt_ids.shape, generator=gen, device=prompt_ids.device)  # [B, P]
    mask_prompt = u < p_mask  # [B, P]
    if prompt_valid is not None:
        mask_prompt &= prompt_valid.bool()
    prompt = masked_input(prompt_ids, mask_prompt, mask_id)  # [B, P]
    completion = torch.full_like(completion_ids, mask_id)  # [B, C]
    return torch.cat([prompt, completion], dim=1)  # [B, P + C]


def coupled_masks(
    valid: torch.Tensor, *, generator: torch.Generator, t_range: tuple[float, float] = (0.2, 0.8)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Complementary masks over valid completion positions.

    valid [B, C] bool -> (m1, m2), both [B, C] bool. Per row t ~ U(t_range); m1 masks each
    valid position w.p. t, m2 = valid & ~m1: every valid token is masked in exactly one pass.
    """
    lo, hi = t_range
    B, C = valid.shape
    dev = valid.device
    t = lo + (hi - lo) * uniform((B, 1), generator=generator, device=dev)  # [B, 1]
    m1 = valid & (uniform((B, C), generator=generator, device=dev) < t)  # [B, C]
    m2 = valid & ~m1  # [B, C]
    return m1, m2


def coupled_logprob(
    logp1: torch.Tensor, logp2: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor
) -> torch.Tensor:
    """Each token's log-prob from the pass where it was masked; 0 where masked in neither.

    logp1, logp2 [B, C] (token_logprobs of the passes with m1 / m2), m1, m2 [B, C] bool -> [B, C].
    """
    zero = torch.zeros_like(logp1)
    return torch.where(m1, logp1, torch.where(m2, logp2, zero))  # [B, C]


@dataclass
class TraceRows:
    """Training rows sliced from denoising trajectories (R rows in all)."""

    sample: torch.Tensor  # [R] long: rollout index of each row
    step: torch.Tensor  # [R] long: first (smallest) commit step among the row's targets
    input_masked: torch.Tensor  # [R, C] bool: positions fed as mask_id
    target: torch.Tensor  # [R, C] bool: positions whose log-prob the row trains


def trace_rows(
    commit_step: torch.Tensor, *, s: int = 1, block_length: int | None = None
) -> TraceRows:
    """TraceRL: one training row per merged group of s consecutive commit steps.

    commit_step [B, C] long: the denoising step at which each completion token was committed;
    < 0 means padding / never generated (never masked, never a target). Steps need not be
    contiguous. Per rollout, sort its distinct steps and cut them into groups of s.

    Block boundaries follow TraceRL's two trainers:

    * ``block_length=None`` (full-attention models: LLaDA, Dream, MMaDA; ``rl_llada.py``
      ``collapse_k_unique`` over the whole response). Groups are cut over ALL distinct steps
      of the rollout and may straddle the sampler's block boundaries. Row g targets the tokens
      of group g; its input masks every token with commit_step >= the group's first step
      (``step``). K distinct steps give exactly ceil(K/s) rows.
    * ``block_length=b`` (block-attention models: SDAR, TraDo; ``rl_sdar.py``). Steps are
      grouped WITHIN each block of b positions, and row r packs the r-th group of every block:
      within each block its input masks the tokens of groups >= r (blocks already finished
      are clean), for the [prompt | clean response | noisy response] layout with a
      block-causal attention mask. Rows = max over blocks of ceil(K_b/s) <= ceil(K/s).
      Here ``step`` is the smallest first step among the packed groups.

    Departure: TraceRL gives generated EOS/padding a step and trains on the first
    ``post_num`` of them; here the caller decides by setting commit_step < 0.
    """
    if s < 1:
        raise ValueError(f"s must be >= 1, got {s}")
    B, C = commit_step.shape
    dev = commit_step.device
    cs = commit_step.long()  # [B, C]
    valid = cs >= 0  # [B, C]
    if cs.numel() == 0:
        empty = torch.zeros(0, dtype=torch.long, device=dev)
        no_rows = torch.zeros(0, C, dtype=torch.bool, device=dev)
        return TraceRows(sample=empty, step=empty, input_masked=no_rows, target=no_rows)
    pos = torch.arange(C, device=dev)  # [C]
    blk = pos // block_length if block_length is not None else torch.zeros_like(pos)  # [C]
    n_blk = int(blk.max().item()) + 1
    # One segment per (rollout, block); rank each step among its segment's distinct steps.
    seg = torch.arange(B, device=dev)[:, None] * n_blk + blk[None, :]  # [B, C]
    big = int(cs.max().item()) + 2
    key = seg * big + cs.clamp(min=0)  # [B, C], sorts by segment then by step
    uniq, inverse = torch.unique(key[valid], sorted=True, return_inverse=True)  # [U], [N]
    seg_first = torch.searchsorted(uniq, (uniq // big) * big)  # [U] index of segment's first key
    group = torch.full_like(cs, -1)  # [B, C], -1 at invalid positions
    group[valid] = (inverse - seg_first[inverse]) // s
    rows_per = (group.max(dim=1).values + 1).clamp(min=0)  # [B]
    sample = torch.repeat_interleave(torch.arange(B, device=dev), rows_per)  # [R]
    first_row = torch.cumsum(rows_per, 0) - rows_per  # [B]
    r = torch.arange(sample.numel(), device=dev) - first_row[sample]  # [R] round within rollout
    g = group[sample]  # [R, C]
    target = g == r[:, None]  # [R, C]
    input_masked = g >= r[:, None]  # [R, C] (invalid positions have g = -1)
    step = cs[sample].masked_fill(~target, big).amin(dim=1)  # [R]
    return TraceRows(sample=sample, step=step, input_masked=input_masked, target=target)


def forward_mask(
    valid: torch.Tensor, *, generator: torch.Generator, eps: float = 1e-3
) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaDA's forward process on the response: t ~ U(0,1), p = (1 - eps) t + eps.

    valid [B, C] bool -> (masked [B, C] bool, p [B] float32); each valid token is masked
    independently with probability p of its row; invalid positions are never masked.
    """
    B, C = valid.shape
    dev = valid.device
    t = uniform((B,), generator=generator, device=dev)  # [B]
    p = (1 - eps) * t + eps  # [B]
    masked = valid & (uniform((B, C), generator=generator, device=dev) < p[:, None])  # [B, C]
    return masked, p


def elbo_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    masked: torch.Tensor,
    p: torch.Tensor,
    valid: torch.Tensor,
) -> torch.Tensor:
    """Sum over masked valid positions of CE / p, divided by the number of valid tokens.

    logits [B, C, V], targets [B, C] long, masked [B, C] bool, p [B], valid [B, C] bool
    -> scalar float32. For logits that do not depend on the mask, its expectation over
    ``forward_mask`` is the mean CE of the valid tokens, since E[1{masked} / p] = 1.
    """
    ce = -token_logprobs(logits, targets)  # [B, C]
    w = (masked & valid).float() / p.float()[:, None]  # [B, C]
    return (ce * w).sum() / valid.sum().clamp(min=1)
