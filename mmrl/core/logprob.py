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
        x[..., banned] = float("-inf")  # x is a fresh float32 tensor (the division's): masking it in place is safe
    return x


def _spans(logits: Tensor, chunk: int):
    """(row, start, stop) covering logits [B, L, V] `chunk` positions at a time, so that each
    logits[row, start:stop] is a view: a slice such as out.logits[:, :-1] cannot be flattened
    to [B * L, V] without copying all of it."""
    for row in range(logits.shape[0]):
        for start in range(0, logits.shape[1], chunk):
            yield row, start, min(start + chunk, logits.shape[1])


class _ChunkedTokenLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, banned: Tensor | None, chunk: int):
        lse = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)  # [B, L]
        out = torch.empty_like(lse)
        for r, a, b in _spans(logits, chunk):
            x = _scaled(logits[r, a:b], temperature, banned)
            lse[r, a:b] = torch.logsumexp(x, -1)
            out[r, a:b] = x.gather(-1, targets[r, a:b, None]).squeeze(-1) - lse[r, a:b]
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.banned, ctx.chunk = temperature, banned, chunk
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, targets, lse = ctx.saved_tensors
        g = grad.float()
        # contiguous whatever the logits' strides, and returned whole, so autograd keeps it as the grad
        result = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for r, a, b in _spans(logits, ctx.chunk):
            x = _scaled(logits[r, a:b], ctx.temperature, ctx.banned)
            # d logp[target] / d x = onehot(target) - softmax(x)
            gx = torch.exp(x - lse[r, a:b, None]).mul_(-g[r, a:b, None])
            gx.scatter_add_(-1, targets[r, a:b, None], g[r, a:b, None])
            result[r, a:b] = gx.div_(ctx.temperature).to(result.dtype)
        return result, None, None, None, None


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0, *, banned=None,
                   chunk: int | None = None) -> Tensor:
    """float32 log_softmax(logits / temperature) at `targets` ([..., V], [...] -> [...]), with the
    `banned` vocabulary ids (a list or tensor) at -inf. `chunk`: positions per chunk of the
    memory-saving form (module docstring); None: the plain form."""
    if chunk is None:
        return _scaled(logits, temperature, banned).log_softmax(-1).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if banned is not None:  # one index tensor where the logits are (not a list, per chunk)
        banned = torch.as_tensor(banned, dtype=torch.long, device=logits.device)
    if logits.dim() != 3:  # [..., L, V] as [B, L, V] rows (a view where the leading dims allow)
        out = token_logprobs(logits.reshape(-1, *logits.shape[-2:]), targets.reshape(-1, targets.shape[-1]),
                             temperature, banned=banned, chunk=chunk)
        return out.view(targets.shape)
    return _ChunkedTokenLogProb.apply(logits, targets.long(), float(temperature), banned, int(chunk))


def entropy_of(logp: Tensor) -> Tensor:
    """[..., V] log-probs -> [...] entropies (0 * -inf, a banned token, counts 0)."""
    return -(logp.exp() * logp.clamp(min=-1e30)).sum(-1)


@torch.no_grad()
def token_entropy(logits: Tensor, temperature: float = 1.0, *, banned=None,
                  chunk: int = 1024) -> Tensor:
    """[..., V] -> [...] float32 entropy of softmax(logits / temperature), `chunk` positions at a
    time (no gradient: for statistics)."""
    rows = logits if logits.dim() == 3 else logits.reshape(-1, *logits.shape[-2:])
    out = torch.empty(rows.shape[:-1], dtype=torch.float32, device=logits.device)
    for r, a, b in _spans(rows, max(1, chunk)):
        out[r, a:b] = entropy_of(_scaled(rows[r, a:b], temperature, banned).log_softmax(-1))
    return out.view(logits.shape[:-1])
