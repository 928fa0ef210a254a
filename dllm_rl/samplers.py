"""Semi-autoregressive block decoding for masked diffusion LMs, and its commit rules.

The loop (LLaDA, Nie et al. 2025, arXiv:2502.09992, `generate.py` of ML-GSAI/LLaDA):
the answer of `gen_length` tokens starts fully masked and is split into blocks of
`block_length`, decoded left to right. Each block gets `steps // num_blocks` steps. At
each step (one forward = one NFE):

1. logits = model(x), cast to float64;
2. x0 = argmax(logits / T + Gumbel noise) (Gumbel-max, i.e. a sample of
   softmax(logits / T); T = 0 is the argmax);
3. confidence = softmax(logits)[x0] (temperature-free, as LLaDA and Fast-dLLM), except
   for "tau_budget": softmax(logits / T)[x0], the drawn token's probability under the
   distribution it was drawn from, as SLIM-RL's code takes it (its risk 1 - c is then the
   chance that draw is not the one the sampler would make); positions outside the
   current block or already filled are not candidates;
4. `select_commits` picks which masked positions of the block take their x0 now:
   "low_confidence"  LLaDA: the n most confident, n from `num_transfer_tokens`;
   "threshold"       Fast-dLLM (Wu et al. 2025, arXiv:2505.22618, NVlabs/Fast-dLLM):
                     all with confidence > threshold, else the most confident one;
   "fork"            Fork-dLLM: as "threshold", but the fallback is the LEFTMOST masked
                     position, and that step is flagged (ForkGRPO trains on those steps);
   "tau_budget"      SLIM-RL (laolaorkkkkk/SLIM-RL): the most confident
                     k = min(max(k_budget, n), |masked|) where k_budget is the largest j
                     whose summed risk sum_{i<=j} (1 - c_(i)) over positions with c > tau
                     stays within m (1 - tau);
   "ar"              autoregressive reference: the leftmost masked position.

Tokens are never re-masked, so the whole trajectory is given by the final tokens and the
step at which each one was committed (`state_at`). For RL we also return the log-prob of
each token at its commit step under the sampling distribution softmax(logits / T).

Departures from the reference code:
- "low_confidence" stops a block early once it is filled (LLaDA would run the remaining
  steps, which commit nothing when steps_per_block > block_length).
- "threshold" / "fork" / "tau_budget" run until the block is filled; their per-step n
  (used only by tau_budget) is the LLaDA schedule at step min(i, steps_per_block - 1),
  at least 1. "ar" takes block_length steps per block whatever `steps` says.
- Rows that finish a block early wait (commit nothing) until the batch finishes it; those
  steps are not counted in their NFE (`active`). With `rows_arg=True` the model is not run
  on them either: `logits_fn(x[rows], rows)` gets only the rows still decoding, so their
  NFE saving is a compute saving. The random draws are still made for the whole batch, so
  a seed samples the same answers either way.
- `generator` may be one generator per row (held-out evaluation's, mmrl.core.held_out.
  sample_generators): row r's noise then comes from its own generator, drawn only at the
  steps where r decodes, so its answer is the same in any batch. One generator (training's
  rollouts) draws the whole batch's noise at once, as before.
- `stop_id` (ours; LLaDA2's `eos_early_stop`): a row stops once it has committed that token
  (<eos>) with every position before it filled. Its answer is then final, since tokens are
  never re-masked; the positions after it stay masked (commit_step -1) and its later steps
  cost no NFE. Off (None) by default, as LLaDA decodes the whole gen_length.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

STRATEGIES = ("low_confidence", "threshold", "fork", "tau_budget", "ar")
_TOL = 1e-9  # float slack for the tau_budget risk comparison


@dataclass
class Commit:
    mask: Tensor            # [B, L] bool: positions to commit now
    fallback: Tensor        # [B] bool: "fork" fell back to the leftmost position
    expected_wrong: Tensor  # [B] float: sum of (1 - confidence) over committed positions


def _rank_mask(conf: Tensor, k: Tensor) -> Tensor:
    """Bool [B, L]: True at the k[b] highest entries of conf[b] (ties: leftmost first)."""
    order = torch.sort(conf, dim=1, descending=True, stable=True).indices  # [B, L]
    ranks = torch.arange(conf.shape[1], device=conf.device).expand_as(conf)
    take = ranks < k.unsqueeze(1)
    return torch.zeros_like(take).scatter(1, order, take)


def _leftmost(masked: Tensor) -> Tensor:
    """Bool [B, L]: the first True of each row (nothing for rows with none)."""
    return masked & (masked.long().cumsum(1) == 1)


def select_commits(confidence: Tensor, masked: Tensor, *, strategy: str,
                   num_commit: int | Tensor | None = None, threshold: float = 0.8,
                   tau: float = 0.9, m: float = 1.0) -> Commit:
    """Which masked positions to commit at this step.

    confidence [B, L]: probability of the drawn token (its value at unmasked positions is
    ignored, -inf allowed); masked [B, L] bool: still masked and inside the current block.
    num_commit: int or LongTensor [B]; the count for "low_confidence" and the static n_s
    of "tau_budget". Rows with nothing masked commit nothing. See the module docstring.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown commit strategy {strategy!r}; expected one of {STRATEGIES}")
    if confidence.shape != masked.shape or confidence.dim() != 2:
        raise ValueError(f"confidence {tuple(confidence.shape)} and masked {tuple(masked.shape)} "
                         "must both be [B, L]")
    masked = masked.bool()
    B, device = masked.shape[0], masked.device
    n_masked = masked.sum(1)                                                  # [B]
    conf = torch.where(masked, confidence.double(), torch.tensor(float("-inf"),
                       dtype=torch.float64, device=device))                   # [B, L]
    fallback = torch.zeros(B, dtype=torch.bool, device=device)

    def counts() -> Tensor:
        if num_commit is None:
            raise ValueError(f"strategy {strategy!r} needs num_commit")
        n = torch.as_tensor(num_commit, device=device).long().expand(B)
        return torch.minimum(n.clamp_min(0), n_masked)

    if strategy == "low_confidence":
        mask = _rank_mask(conf, counts())
    elif strategy in ("threshold", "fork"):
        mask = masked & (conf > threshold)
        none = ~mask.any(1) & (n_masked > 0)                                  # [B]
        if strategy == "threshold":
            alt = _rank_mask(conf, torch.ones_like(n_masked))
        else:
            alt = _leftmost(masked)
            fallback = none
        mask = torch.where(none.unsqueeze(1), alt, mask)
    elif strategy == "tau_budget":
        n_s = counts()
        c_sorted = torch.sort(conf, dim=1, descending=True).values           # [B, L]
        in_a = c_sorted > tau                                                 # A comes first
        risk = torch.where(in_a, 1.0 - c_sorted, torch.zeros_like(c_sorted)).cumsum(1)
        k_budget = (in_a & (risk <= m * (1.0 - tau) + _TOL)).sum(1)          # [B]
        k = torch.minimum(torch.maximum(k_budget, n_s), n_masked)
        mask = _rank_mask(conf, k)
    else:  # "ar"
        mask = _leftmost(masked)

    mask = mask & masked
    ew = torch.where(mask, 1.0 - conf, torch.zeros_like(conf)).sum(1)
    return Commit(mask=mask, fallback=fallback, expected_wrong=ew.to(
        confidence.dtype if confidence.is_floating_point() else torch.float32))


def num_transfer_tokens(mask_count: Tensor, steps: int, width: int | None = None) -> Tensor:
    """LLaDA schedule: [B] masked counts -> [B, steps] tokens per step, split evenly,
    remainder to the first steps (10 over 4 steps -> 3, 3, 2, 2). `width`: only the first
    `width` steps (with more steps than tokens every later step commits 0); width 0 gives none."""
    mask_count = mask_count.long()
    base, rem = mask_count // steps, mask_count % steps                       # [B]
    idx = torch.arange(steps if width is None else min(steps, width), device=mask_count.device)
    return base.unsqueeze(1) + (idx.unsqueeze(0) < rem.unsqueeze(1)).long()


@dataclass
class DecodeResult:
    tokens: Tensor             # [B, P+G] final ids
    completion: Tensor         # [B, G]
    commit_step: Tensor        # [B, G] long: global step at which each token was committed
    commit_logp: Tensor        # [B, G] float32: log-prob under softmax(logits / T) at commit
    commit_confidence: Tensor  # [B, G] float32: the confidence at commit (step 3 of the docstring)
    fallback: Tensor           # [B, S] bool: "fork" fallback steps
    active: Tensor             # [B, S] bool: row had masked positions in the block
    nfe: Tensor                # [B] long: active.sum(1)
    expected_wrong: Tensor     # [B, S] float32: sum of (1 - c) over the step's commits
    block_length: int
    prompt_length: int
    mask_id: int
    states: Tensor | None = None  # [S, B, P+G]: x before each step (record_states)

    @property
    def num_steps(self) -> int:
        return self.active.shape[1]

    def state(self, step: int | Tensor) -> Tensor:
        """x before `step` (int or LongTensor [B]); see `state_at`."""
        return state_at(self.tokens, self.commit_step, step, mask_id=self.mask_id)


def state_at(tokens: Tensor, commit_step: Tensor, step: int | Tensor, *,
             mask_id: int) -> Tensor:
    """x before `step` of the batch loop: tokens [B, P+G], commit_step [B, G], step an int
    or LongTensor [B] (one step per row). Generated tokens committed at a step >= `step`
    are replaced by mask_id; the prompt (first P = P+G - G columns) is kept. Exact,
    because tokens are never re-masked."""
    P = tokens.shape[1] - commit_step.shape[1]
    step = torch.as_tensor(step, device=tokens.device).long().reshape(-1, 1)  # [B or 1, 1]
    hidden = commit_step >= step                                              # [B, G]
    out = tokens.clone()
    out[:, P:] = torch.where(hidden, torch.full_like(tokens[:, P:], mask_id), tokens[:, P:])
    return out


def _block_logits(logits_fn, x: Tensor, active: Tensor | None, lo: int, hi: int) -> Tensor:
    """float64 [B, hi - lo, V] logits of the block. With `active`, only those rows are run; the
    others get zeros, which nothing reads (they have no masked position to commit) but which
    keep the Gumbel draws the batch's."""
    if active is None:
        return logits_fn(x)[:, lo:hi].double()
    rows = active.nonzero().squeeze(1)
    if len(rows) == len(x):  # every row decodes: no copies
        return logits_fn(x, rows)[:, lo:hi].double()
    part = logits_fn(x[rows], rows)[:, lo:hi].double()
    out = part.new_zeros(x.shape[0], *part.shape[1:])
    out[rows] = part
    return out


def _uniform(shape, generator: torch.Generator | None, device) -> Tensor:
    """u ~ U(0, 1) float64 of `shape`, drawn on the generator's device, moved to `device`."""
    dev = generator.device if generator is not None else device
    return torch.rand(shape, dtype=torch.float64, generator=generator, device=dev).to(device)


def _draw(logits: Tensor, temperature: float, generator: torch.Generator | list | None,
          tempered: bool = False, active: Tensor | None = None):
    """logits [B, L, V] float64 -> (x0 [B, L], confidence [B, L], logp [B, L]).
    Gumbel-max: argmax(logits / T + g), g = -log(-log(u)), u ~ U(0, 1) in float64.
    The confidence is softmax(logits)[x0], or with `tempered` softmax(logits / T)[x0].
    `generator` a list: row r's u from generator[r], drawn only for the `active` rows (the others
    commit nothing, so their u, 1/2, is never read)."""
    if temperature > 0:
        scaled = logits / temperature
        # The noise is drawn on the generator's device, then moved to the logits'. The trainer's
        # and the CLI's generators are CPU ones: on the CPU (and the tests' simulated device) a
        # seed gives the same float64 noise; on a GPU, decode() hands a GPU generator seeded from
        # the CPU one instead (see there).
        if isinstance(generator, list):
            u = torch.full(logits.shape, 0.5, dtype=torch.float64, device=logits.device)
            for r in active.nonzero().flatten().tolist():
                u[r] = _uniform(logits.shape[1:], generator[r], logits.device)
        else:
            u = _uniform(logits.shape, generator, logits.device)
        u = u.clamp_min(torch.finfo(torch.float64).tiny)
        x0 = (scaled - torch.log(-torch.log(u))).argmax(-1)
    else:
        scaled = logits
        x0 = logits.argmax(-1)
    idx = x0.unsqueeze(-1)
    conf = torch.softmax(scaled if tempered else logits, -1).gather(-1, idx).squeeze(-1)
    logp = torch.log_softmax(scaled, -1).gather(-1, idx).squeeze(-1)
    return x0, conf, logp


def _on(device: torch.device, generator: torch.Generator) -> torch.Generator:
    """A generator that draws on `device`. A float64 [B, block, V] draw per step on the CPU, then
    copied, would dominate a GPU step (1 GB at LLaDA's vocabulary, 64 rows x 16 positions): draw
    on the GPU from a generator seeded by the CPU one, so a seed still fixes the rollout (on that
    GPU)."""
    if device.type != "cuda" or generator.device.type == "cuda":
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return torch.Generator(device).manual_seed(seed)


@torch.no_grad()
def decode(logits_fn: Callable[[Tensor], Tensor], prompt_ids: Tensor, *, gen_length: int,
           block_length: int, steps: int, mask_id: int, strategy: str = "low_confidence",
           temperature: float = 0.0, threshold: float = 0.8, tau: float = 0.9, m: float = 1.0,
           generator: torch.Generator | list[torch.Generator] | None = None,
           record_states: bool = False, stop_id: int | None = None,
           rows_arg: bool = False) -> DecodeResult:
    """Block-wise masked-diffusion decoding; see the module docstring.

    logits_fn: x [B, P+gen_length] -> logits [B, P+gen_length, V] (one call per step);
      with rows_arg, (x[rows] [b, P+gen_length], rows LongTensor [b]) -> [b, P+gen_length, V]
      for the b rows still decoding (a row's logits must not depend on the other rows).
    prompt_ids [B, P]: left-padded by the caller, never modified.
    generator: one for the whole batch, or a list of one per row (each row's noise its own).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown commit strategy {strategy!r}; expected one of {STRATEGIES}")
    if gen_length <= 0 or block_length <= 0 or steps <= 0:
        raise ValueError(f"gen_length ({gen_length}), block_length ({block_length}) and "
                         f"steps ({steps}) must be positive")
    if gen_length % block_length != 0:
        raise ValueError(f"gen_length ({gen_length}) must be divisible by block_length "
                         f"({block_length})")
    num_blocks = gen_length // block_length
    if steps % num_blocks != 0:
        raise ValueError(f"steps ({steps}) must be divisible by the number of blocks "
                         f"({num_blocks} = gen_length {gen_length} / block_length {block_length})")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature ({temperature}) must be a finite number >= 0")
    for name, value in (("threshold", threshold), ("tau", tau)):
        if not 0 < value < 1:  # also refuses NaN
            raise ValueError(f"{name} ({value}) must be in (0, 1)")
    if not (m > 0 and math.isfinite(m)):
        raise ValueError(f"m ({m}) must be a finite number > 0")
    steps_per_block = steps // num_blocks

    B, P = prompt_ids.shape
    device = prompt_ids.device
    if isinstance(generator, (list, tuple)):
        if len(generator) != B:
            raise ValueError(f"{len(generator)} generators for {B} rows")
        generator = [_on(device, g) for g in generator]
    elif generator is not None:
        generator = _on(device, generator)
    x = torch.cat([prompt_ids, prompt_ids.new_full((B, gen_length), mask_id)], dim=1)
    is_masked = torch.ones(B, gen_length, dtype=torch.bool, device=device)
    commit_step = torch.full((B, gen_length), -1, dtype=torch.long, device=device)
    commit_logp = torch.zeros(B, gen_length, dtype=torch.float32, device=device)
    commit_conf = torch.zeros(B, gen_length, dtype=torch.float32, device=device)
    fallbacks, actives, wrongs, states = [], [], [], []
    s = 0  # global step index
    done = torch.zeros(B, dtype=torch.bool, device=device)  # stopped at stop_id
    before = torch.arange(gen_length, device=device)

    for b in range(num_blocks):
        lo, hi = b * block_length, (b + 1) * block_length                     # in completion
        # at most block_length columns: a block is filled by then (a huge steps must not allocate them all)
        schedule = num_transfer_tokens(is_masked[:, lo:hi].sum(1), steps_per_block, width=block_length)
        i = 0
        while True:
            masked = is_masked[:, lo:hi] & ~done[:, None]                     # [B, bl]
            active = masked.any(1)                                            # [B]
            if not active.any() or (strategy == "low_confidence" and i >= steps_per_block):
                break
            if i >= block_length:  # each step commits one or more positions of every active row
                raise RuntimeError(f"block {b} still has masked positions after {i} {strategy} steps "
                                   "(each step must commit at least one per row): the commit rule stalled")
            if record_states:
                states.append(x.clone())
            logits = _block_logits(logits_fn, x, active if rows_arg else None, P + lo, P + hi)
            x0, conf, logp = _draw(logits, temperature, generator, tempered=strategy == "tau_budget", active=active)
            n = schedule[:, min(i, schedule.shape[1] - 1)]
            if strategy == "tau_budget":
                n = n.clamp_min(1)
            c = select_commits(conf, masked, strategy=strategy, num_commit=n,
                               threshold=threshold, tau=tau, m=m)
            x[:, P + lo:P + hi] = torch.where(c.mask, x0, x[:, P + lo:P + hi])
            is_masked[:, lo:hi] &= ~c.mask
            commit_step[:, lo:hi][c.mask] = s
            commit_logp[:, lo:hi][c.mask] = logp[c.mask].float()
            commit_conf[:, lo:hi][c.mask] = conf[c.mask].float()
            fallbacks.append(c.fallback & active)
            actives.append(active)
            wrongs.append(c.expected_wrong.float())
            i += 1
            s += 1
            if stop_id is not None:  # a stop token committed with nothing masked before it
                stop = ~is_masked & (x[:, P:] == stop_id)
                first = torch.where(stop.any(1), stop.int().argmax(1), gen_length)
                done |= stop.any(1) & ~(is_masked & (before[None] < first[:, None])).any(1)
        if (is_masked[:, lo:hi] & ~done[:, None]).any():  # unreachable: the schedule sums to the masked count
            raise RuntimeError(f"block {b} left masked positions after {i} steps")

    def stack(xs, dtype):
        return torch.stack(xs, 1) if xs else torch.zeros(B, 0, dtype=dtype, device=device)

    active_t = stack(actives, torch.bool)
    return DecodeResult(
        tokens=x, completion=x[:, P:].clone(), commit_step=commit_step,
        commit_logp=commit_logp, commit_confidence=commit_conf,
        fallback=stack(fallbacks, torch.bool), active=active_t, nfe=active_t.sum(1),
        expected_wrong=stack(wrongs, torch.float32), block_length=block_length,
        prompt_length=P, mask_id=mask_id,
        states=torch.stack(states) if record_states else None)
