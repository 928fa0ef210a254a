"""Policy-gradient losses, KL estimators and loss aggregation, as pure tensor functions.

Notation: N = samples (rows), T = tokens (columns); ``mask`` ([N, T], bool or 0/1 float;
any nonzero entry counts as "in the loss") marks the tokens that are trained.

- :func:`policy_loss`  the PPO-clip surrogate of the GRPO family: token-level ratio (GRPO,
  DAPO, Dr.GRPO) or sequence-level ratio (GSPO), asymmetric clipping (DAPO's clip-higher),
  optional dual clip (verl's clip_ratio_c) and the three aggregations below. Returns a
  :class:`LossOutput`.
- :func:`aggregate`    reduces a per-token loss [N, T] to a scalar:

  ===========================  ====================================================  =========
  aggregation                  loss                                                  used by
  ===========================  ====================================================  =========
  ``token_mean``               sum over all masked tokens / number of masked tokens  DAPO
  ``seq_mean_token_mean``      mean over samples of (sample's masked-token mean)     GRPO
  ``seq_mean_token_sum_norm``  mean over samples of (sample's masked-token sum /     Dr.GRPO
                               max_len)
  ===========================  ====================================================  =========

  A sample (row) with no masked token contributes 0 and is still counted as a sample by the
  ``seq_*`` aggregations.
- :func:`loss_denominator`  the normaliser of a whole mini-batch, passed as ``denom`` to each
  micro-batch under gradient accumulation so that the micro-batch losses (and their
  gradients) sum exactly to the mini-batch's.
- :func:`kl_penalty`   per-token KL estimators k1 / k2 / k3 (Schulman's).

Metrics are returned (python floats, namespaced ``loss/...``), never logged here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from mmrl.core.advantages import _check_choice, _compute_dtype  # shared argument checks

__all__ = [
    "AGGREGATIONS",
    "KL_KINDS",
    "LEVELS",
    "LossOutput",
    "aggregate",
    "kl_penalty",
    "loss_denominator",
    "policy_loss",
]

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
LEVELS = ("token", "sequence")
KL_KINDS = ("k1", "k2", "k3")


# Metrics that are loss terms aggregated with the caller's `denom`: a micro-batch's value is
# then its share of the mini-batch's term (the shares sum to it), not a mean to be weighted.
DENOM_SHARES = frozenset({"loss/policy", "loss/kl"})


@dataclass
class LossOutput:
    """What a loss function returns: the scalar to backpropagate and its metrics."""

    loss: Tensor  # [] scalar, differentiable
    metrics: dict[str, float] = field(default_factory=dict)  # namespaced "loss/..." floats
    per_token: Tensor | None = None  # [N, T] unaggregated surrogate loss, zero where mask is 0


# --------------------------------------------------------------------------- helpers


def _bool_mask(mask: Tensor, shape: torch.Size, name: str = "mask") -> Tensor:
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} ([N, T]); got {tuple(mask.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def _check_denom(denom) -> None:
    if denom is not None and not isinstance(denom, Tensor) and not denom > 0:
        raise ValueError(f"denom must be > 0 (the mini-batch's normaliser); got {denom}")


# --------------------------------------------------------------------------- aggregation


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    aggregation: str = "token_mean",
    *,
    max_len: int | None = None,
    denom: float | Tensor | None = None,
    weights: Tensor | None = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar, the way :func:`policy_loss` does.

    Args:
        per_token: ``[N, T]`` per-token loss. Entries where ``mask`` is 0 are ignored (even
            NaN or inf ones).
        mask: ``[N, T]`` bool or 0/1 float; nonzero = the token is in the loss.
        aggregation: ``"token_mean"``, ``"seq_mean_token_mean"`` or
            ``"seq_mean_token_sum_norm"`` (see the module docstring).
        max_len: the constant length that ``"seq_mean_token_sum_norm"`` divides each
            sample's token sum by (Dr.GRPO); required for it, ignored otherwise.
        denom: the final normaliser, for gradient accumulation: the masked-token count of
            the whole mini-batch for ``"token_mean"``, its number of samples for the
            ``seq_*`` aggregations (see :func:`loss_denominator`). ``None``: this call's own.
        weights: ``[N]`` sample weights >= 0 (a sample standing for w of them, as FastRL's
            MDAP with counts): its tokens count w times, in the loss and in the normaliser.

    Returns:
        ``[]`` scalar. A sample without masked tokens contributes 0, never NaN.
    """
    _check_choice(aggregation, AGGREGATIONS, "aggregation")
    if per_token.dim() != 2:
        raise ValueError(f"per_token must have shape [N, T]; got {tuple(per_token.shape)}")
    m = _bool_mask(mask, per_token.shape)  # [N, T]
    _check_denom(denom)
    x = torch.where(m, per_token, per_token.new_zeros(()))  # [N, T], masked-out -> exactly 0
    w = _check_weights(weights, x.shape[0], x.device)
    if w is not None:
        x = x * w.to(x.dtype)[:, None]

    d = _normaliser(m, aggregation, w) if denom is None else denom
    if aggregation == "token_mean":
        return x.sum() / d

    if aggregation == "seq_mean_token_mean":
        per_sample = x.sum(dim=-1) / m.sum(dim=-1).clamp(min=1)  # [N]
    else:  # "seq_mean_token_sum_norm"
        if max_len is None:
            raise ValueError(
                "aggregation 'seq_mean_token_sum_norm' (Dr.GRPO) needs max_len, the constant "
                "length each sample's token sum is divided by"
            )
        if not max_len > 0:
            raise ValueError(f"max_len must be > 0; got {max_len}")
        per_sample = x.sum(dim=-1) / max_len  # [N]
    return per_sample.sum() / d


def loss_denominator(mask: Tensor, aggregation: str, weights: Tensor | None = None) -> float:
    """The ``denom`` to pass to every micro-batch of a mini-batch whose mask is ``mask``.

    ``"token_mean"``: the number of masked tokens (at least 1); the ``seq_*`` aggregations:
    the number of samples (rows, at least 1). With sample ``weights`` ([N]), a sample counts
    w times in either (a weighted token count may then be below 1; 0 counts as 1). With it,
    the micro-batch losses sum to the mini-batch loss exactly, and so do their gradients.
    """
    _check_choice(aggregation, AGGREGATIONS, "aggregation")
    if mask.dim() != 2:
        raise ValueError(f"mask must have shape [N, T]; got {tuple(mask.shape)}")
    w = _check_weights(weights, mask.shape[0], mask.device)
    return float(_normaliser(mask != 0, aggregation, w))


def _normaliser(m: Tensor, aggregation: str, w: Tensor | None) -> Tensor:
    """What loss_denominator returns, as a tensor (no host sync in `aggregate`), for a bool mask
    [N, T] and weights already checked: masked tokens (at least 1) for "token_mean", samples
    (at least one) for the seq_* aggregations, a sample counting w times in either (a weighted
    token count may be below 1; 0 is 1)."""
    if aggregation == "token_mean":
        if w is None:
            return m.sum().clamp(min=1)
        # weighted: a count below 1 is real (a quarter-weight sample of 2 tokens counts 0.5);
        # none at all is 1, as without weights
        tokens = (m.float().sum(dim=-1) * w).sum()
        return torch.where(tokens > 0, tokens, torch.ones_like(tokens))
    if w is None:
        return torch.tensor(float(max(m.shape[0], 1)))
    return w.sum().clamp(min=1e-12)


def _check_weights(weights: Tensor | None, n: int, device) -> Tensor | None:
    if weights is None:
        return None
    if tuple(weights.shape) != (n,):
        raise ValueError(f"weights must have shape [N] = [{n}]; got {tuple(weights.shape)}")
    bad = ~torch.isfinite(weights) | (weights < 0)
    if bool(bad.any()):
        raise ValueError(f"weights must be finite and >= 0; got {float(weights[bad][0])}")
    return weights.detach().to(device=device, dtype=torch.float32)



# --------------------------------------------------------------------------- losses


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    level: str = "token",
    aggregation: str = "token_mean",
    max_len: int | None = None,
    denom: float | Tensor | None = None,
    max_log_ratio: float | None = 20.0,
    weights: Tensor | None = None,
    dual_clip: float | None = None,
) -> LossOutput:
    """PPO-clip surrogate: -min(rho*A, clip(rho, 1-clip_low, 1+clip_high)*A).

    level="token": rho_t = exp(logp_t - old_logp_t). level="sequence" (GSPO):
    rho = exp(mean over the sample's masked tokens of (logp - old_logp)), shared by its
    tokens; the gradient flows through that mean.

    Args:
        logp: ``[N, T]`` log-probabilities of the sampled tokens under the current policy
            (differentiable). Computed in float32 at least.
        old_logp: ``[N, T]`` the same under the rollout policy (treated as a constant).
        advantages: ``[N]`` (broadcast over tokens) or ``[N, T]`` (treated as a constant).
        mask: ``[N, T]`` bool or 0/1 float; nonzero = the token is trained.
        clip_low, clip_high: the clip range ``[1 - clip_low, 1 + clip_high]`` (DAPO's
            clip-higher: 0.2 / 0.28; GSPO: ~3e-4 / 4e-4).
        level: ``"token"`` or ``"sequence"``.
        aggregation, max_len, denom, weights: see :func:`aggregate`.
        max_log_ratio: ``logp - old_logp`` is clamped to ``[-max_log_ratio, max_log_ratio]``
            before the exponential so that the ratio stays finite (verl does the same with 20);
            ``None`` disables it. On-policy and near-policy values are unaffected.
        dual_clip: c > 1 of Dual-Clip PPO (Ye et al. 2020; verl's ``clip_ratio_c``, 3.0): a
            token with A < 0 has its loss capped at -c A = c |A|, i.e.
            min(-min(rho A, clip(rho) A), -c A), so a ratio far above 1 on a bad sample
            neither dominates the loss nor has a gradient. ``None`` (the default): no cap.

    Returns:
        :class:`LossOutput` with ``loss`` (scalar), ``per_token`` (``[N, T]``, zero where
        ``mask`` is 0) and ``metrics`` (computed without gradient, over masked tokens):
        ``loss/policy``; ``loss/clip_frac`` (the clipped term was chosen by the min and
        differs from the unclipped one); ``loss/clip_frac_low`` (rho < 1 - clip_low with
        A < 0); ``loss/clip_frac_high`` (rho > 1 + clip_high with A > 0);
        ``loss/ratio_mean``, ``loss/ratio_min``, ``loss/ratio_max``; ``loss/approx_kl``
        (mean of old_logp - logp); with ``dual_clip``, ``loss/dual_clip_frac`` (the cap
        binds: A < 0 and the clipped surrogate's loss above -c A). With no masked token at
        all, fractions and approx_kl are 0 and the ratio statistics 1.
    """
    _check_choice(level, LEVELS, "level")
    _check_choice(aggregation, AGGREGATIONS, "aggregation")
    if not (clip_low >= 0 and clip_high >= 0):  # also refuses NaN (a lower bound 1 - clip_low < 0 never binds)
        raise ValueError(f"clip_low and clip_high must be >= 0; got {clip_low}, {clip_high}")
    _check_max_log_ratio(max_log_ratio)
    if dual_clip is not None and not dual_clip > 1:  # c <= 1 would cap even on-policy tokens (rho = 1)
        raise ValueError(f"dual_clip must be > 1 (or None: off); got {dual_clip}")
    if logp.dim() != 2:
        raise ValueError(f"logp must have shape [N, T]; got {tuple(logp.shape)}")
    if old_logp.shape != logp.shape:
        raise ValueError(
            f"old_logp must have the shape of logp {tuple(logp.shape)}; got {tuple(old_logp.shape)}"
        )
    m = _bool_mask(mask, logp.shape)  # [N, T]
    n, t = logp.shape
    adv = torch.as_tensor(advantages, device=logp.device).detach()
    if adv.dim() == 1 and adv.shape[0] == n:
        adv = adv[:, None].expand(n, t)  # [N, T]
    elif tuple(adv.shape) != (n, t):
        raise ValueError(
            f"advantages must have shape [N] = [{n}] or [N, T] = [{n}, {t}]; got {tuple(adv.shape)}"
        )

    dtype = _compute_dtype(logp)
    zero = logp.new_zeros((), dtype=dtype)
    adv = adv.to(dtype)
    # Padding positions may hold garbage (-inf log-probs): zero their log-ratio first.
    log_ratio = torch.where(m, logp.to(dtype) - old_logp.detach().to(dtype), zero)  # [N, T]
    if level == "sequence":
        seq_log_ratio = log_ratio.sum(dim=-1) / m.sum(dim=-1).clamp(min=1)  # [N]
        log_ratio = seq_log_ratio[:, None].expand(n, t)  # [N, T], shared by the sample's tokens
    if max_log_ratio is not None:
        log_ratio = log_ratio.clamp(-max_log_ratio, max_log_ratio)
    ratio = torch.exp(log_ratio)  # [N, T]

    unclipped = ratio * adv  # [N, T]
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv  # [N, T]
    surrogate = -torch.minimum(unclipped, clipped)  # [N, T]
    if dual_clip is not None:
        cap = -dual_clip * adv  # [N, T], c |A| where A < 0
        dual = (adv < 0) & (surrogate > cap)  # [N, T]; strict, as verl's pg_clipfrac_lower
        surrogate = torch.where(dual, cap, surrogate)  # the cap is a constant: no gradient there
    per_token = torch.where(m, surrogate, zero)  # [N, T]
    loss = aggregate(per_token, m, aggregation, max_len=max_len, denom=denom, weights=weights)

    with torch.no_grad():
        mf = m.to(dtype)
        n_tok = mf.sum().clamp(min=1)
        any_tok = m.any()
        clip_frac = ((clipped < unclipped) & m).to(dtype).sum() / n_tok
        clip_low_frac = ((ratio < 1.0 - clip_low) & (adv < 0) & m).to(dtype).sum() / n_tok
        clip_high_frac = ((ratio > 1.0 + clip_high) & (adv > 0) & m).to(dtype).sum() / n_tok
        one = torch.ones((), dtype=dtype, device=logp.device)
        ratio_mean = torch.where(any_tok, (ratio * mf).sum() / n_tok, one)
        if m.numel() > 0:  # amin / amax of an empty tensor raise
            ratio_min = torch.where(any_tok, torch.where(m, ratio, torch.inf).amin(), one)
            ratio_max = torch.where(any_tok, torch.where(m, ratio, -torch.inf).amax(), one)
        else:
            ratio_min = ratio_max = one
        diff = torch.where(m, old_logp.to(dtype) - logp.detach().to(dtype), zero)
        approx_kl = diff.sum() / n_tok
        values = torch.stack(
            [
                loss.detach().to(dtype),
                clip_frac,
                clip_low_frac,
                clip_high_frac,
                ratio_mean,
                ratio_min,
                ratio_max,
                approx_kl,
                *([(dual & m).to(dtype).sum() / n_tok] if dual_clip is not None else []),
            ]
        ).tolist()  # one device sync for all metrics
    keys = (
        "loss/policy",
        "loss/clip_frac",
        "loss/clip_frac_low",
        "loss/clip_frac_high",
        "loss/ratio_mean",
        "loss/ratio_min",
        "loss/ratio_max",
        "loss/approx_kl",
    ) + (("loss/dual_clip_frac",) if dual_clip is not None else ())  # off, the metrics are as before
    return LossOutput(loss=loss, metrics=dict(zip(keys, values)), per_token=per_token)


def kl_penalty(
    logp: Tensor, ref_logp: Tensor, kind: str = "k3", *, max_log_ratio: float | None = 20.0
) -> Tensor:
    """Per token. k1 = logp - ref; k2 = (logp - ref)^2 / 2; k3 = exp(ref - logp) - (ref - logp) - 1.

    With d = logp - ref_logp: k1 = d (unbiased, can be negative), k2 = d^2 / 2,
    k3 = exp(-d) + d - 1 (unbiased, >= 0; computed as ``expm1(-d) + d`` so that it never
    rounds below 0). Shapes are whatever ``logp`` has (typically ``[N, T]``); aggregate the
    result with :func:`aggregate`. Computed in float32 at least; differentiable in both inputs.

    max_log_ratio: for k3 only, d is clamped to ``[-max_log_ratio, max_log_ratio]`` first, so
    that exp(-d) stays finite (float32 overflows past d = -88; verl clamps at 20 too). Tokens
    beyond it get the penalty at the bound and no gradient; ``None`` disables it.
    """
    _check_choice(kind, KL_KINDS, "kind")
    _check_max_log_ratio(max_log_ratio)
    if logp.shape != ref_logp.shape:
        raise ValueError(
            f"ref_logp must have the shape of logp {tuple(logp.shape)}; got {tuple(ref_logp.shape)}"
        )
    dtype = _compute_dtype(logp)
    d = logp.to(dtype) - ref_logp.to(dtype)
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if max_log_ratio is not None:  # found by tests/reliability/test_fuzz.py: k3 was inf at d < -88
        d = d.clamp(-max_log_ratio, max_log_ratio)
    return torch.expm1(-d) + d


def _check_max_log_ratio(max_log_ratio: float | None) -> None:
    """A bound of 0 or below would clamp every log-ratio to it (k3's on-policy value then > 0)."""
    if max_log_ratio is not None and not max_log_ratio > 0:
        raise ValueError(f"max_log_ratio must be > 0 (or None: no clamp); got {max_log_ratio}")
