"""Token log-probabilities over a large vocabulary without float32 [N, T, V] activations.

The plain computation, log_softmax(logits.float() / T).gather(targets), materialises the
float32 copy, its scaled copy and the log-softmax (kept for the backward pass): several
[N, T, V] float32 tensors, GBs per micro-batch at a 150k vocabulary. `token_logprobs` with a
`chunk` computes the same numbers `chunk` positions at a time and keeps only the logits as they
came (bfloat16 on a GPU) and one log-sum-exp per position; the backward pass recomputes each
chunk's softmax. What Liger's fused linear cross-entropy and verl's fused kernels do, in plain
PyTorch and without fusing the output projection. `model.logprob_chunk` turns it on (VLM and
dLLM training); without it the plain computation runs, bit for bit as before.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _scaled(logits: Tensor, temperature: float, banned) -> Tensor:
    x = logits.float() / temperature
    if banned is not None and len(banned):
        x[:, banned] = float("-inf")  # x is a fresh float32 chunk: masking it in place is safe
    return x


class _ChunkedTokenLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, banned: Tensor | None, chunk: int):
        flat, tgt = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1, 1)
        lse = torch.empty(tgt.shape[0], dtype=torch.float32, device=logits.device)
        out = torch.empty_like(lse)
        for s in range(0, tgt.shape[0], chunk):
            x = _scaled(flat[s:s + chunk], temperature, banned)
            lse[s:s + chunk] = torch.logsumexp(x, -1)
            out[s:s + chunk] = x.gather(-1, tgt[s:s + chunk]).squeeze(-1) - lse[s:s + chunk]
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.banned, ctx.chunk = temperature, banned, chunk
        return out.view(targets.shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, targets, lse = ctx.saved_tensors
        flat, tgt = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1, 1)
        g = grad.reshape(-1, 1).float()
        result = torch.empty_like(logits)  # returned whole (not a view), so autograd keeps it as the grad
        out = result.view(-1, logits.shape[-1])
        for s in range(0, tgt.shape[0], ctx.chunk):
            x = _scaled(flat[s:s + ctx.chunk], ctx.temperature, ctx.banned)
            # d logp[target] / d x = onehot(target) - softmax(x)
            gx = torch.exp(x - lse[s:s + ctx.chunk, None]).mul_(-g[s:s + ctx.chunk])
            gx.scatter_add_(-1, tgt[s:s + ctx.chunk], g[s:s + ctx.chunk])
            out[s:s + ctx.chunk] = gx.div_(ctx.temperature).to(out.dtype)
        return result, None, None, None, None


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0, *, banned=None,
                   chunk: int | None = None) -> Tensor:
    """float32 log_softmax(logits / temperature) at `targets` ([..., V], [...] -> [...]), with the
    `banned` vocabulary ids (a list or tensor) at -inf. `chunk`: positions per chunk of the
    memory-saving form (module docstring); None: the plain form."""
    if chunk is None:
        x = logits.float()
        if banned is not None and len(banned):
            x = x.clone() if x is logits else x
            x[..., banned] = float("-inf")
        return (x / temperature).log_softmax(-1).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return _ChunkedTokenLogProb.apply(logits, targets.long(), float(temperature), banned, int(chunk))


def entropy_of(logp: Tensor) -> Tensor:
    """[..., V] log-probs -> [...] entropies (0 * -inf, a banned token, counts 0)."""
    return -(logp.exp() * logp.clamp(min=-1e30)).sum(-1)


@torch.no_grad()
def token_entropy(logits: Tensor, temperature: float = 1.0, *, banned=None,
                  chunk: int = 1024) -> Tensor:
    """[..., V] -> [...] float32 entropy of softmax(logits / temperature), `chunk` positions at a
    time (no gradient: for statistics)."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for s in range(0, flat.shape[0], chunk):
        out[s:s + chunk] = entropy_of(_scaled(flat[s:s + chunk], temperature, banned).log_softmax(-1))
    return out.view(logits.shape[:-1])
