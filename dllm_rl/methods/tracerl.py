"""TraceRL (Wang et al., "Revolutionizing reinforcement learning framework for diffusion large
language models"; code: Gen-Verse/dLLM-RL), docs/methods.md section 5.

    rollout    G answers per prompt; the sampler records the step at which each token was
               committed (its trajectory)
    rows       every s = merge_steps consecutive decoding steps of a rollout make one training
               row: its input masks every token committed at or after the row's first step, its
               targets are the tokens committed within those steps (<= ceil(K / s) rows; a row
               whose steps committed only the filler after <eos> is not run)
    log-prob   log pi(o_k) = the row's prediction of o_k given that partially decoded state:
               the policy is trained on the states it actually decoded through
    advantage  A = (r - group mean) / group std
    loss       token-level PPO clip 0.2, averaged over answer tokens; + 0.01 k3 KL to the
               pre-update policy

Departures: TraceRL trains a value model for token-level advantages in its full form; this
baseline uses the group advantage of the reward (its "without value model" variant). For
block-causal (SDAR) models TraceRL merges steps within each block and packs the r-th group
of every block into one sequence [prompt | clean answer | noisy answer] with a block mask;
here every model gets the full-attention rule (merge across blocks, one row per group, the
row's input the decoding state at the group's first step) under its own attention mask,
which is exact for s = 1 and costs more forward passes than the packing. Groups: the config
drops (and refills) groups whose rewards are all equal; dLLM-RL's code instead drops groups
whose accuracy lies outside [0.2, 0.8] and does not refill (method.accuracy_band=[0.2,0.8],
method.dynamic_sampling.enabled=false).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dllm_rl.logprob import token_logprobs, trace_rows
from dllm_rl.methods.common import ESTIMATORS, DLLMMethod, EstimatorBase, scatter_rows
from mmrl.core.batch import RolloutBatch
from mmrl.core.method import register_method


class Trace(EstimatorBase):
    def __init__(self, run):
        self.s = run.method.merge_steps
        self.temperature = run.method.logprob_temperature  # None: the rollout's

    def prepare(self, policy, batch: RolloutBatch, generator: torch.Generator) -> None:
        if not self.skip_old(batch):
            batch.old_logp = self.logprobs(policy, batch, 0).float()

    def logprobs(self, policy, batch: RolloutBatch, iteration: int) -> Tensor:  # [N, C]
        # Steps are merged across block boundaries (TraceRL's full-attention rule): one row per
        # merged group, its input the state at the group's first step.
        rows = trace_rows(batch.data["commit_step"], s=self.s)
        target = rows.target & batch.mask[rows.sample]  # answer tokens only (not the eos filler)
        # A row whose steps committed only the filler after <eos> has nothing to train: it gets
        # no forward pass (with short answers that is 40% of the rows).
        keep = target.any(-1)
        sample, target = rows.sample[keep], target[keep]
        completion = batch.data["completion"][sample]
        noisy = torch.where(rows.input_masked[keep], torch.full_like(completion, policy.predictor.mask_token_id),
                            completion)
        x = torch.cat([batch.data["prompt_ids"][sample], noisy], 1)
        logits = policy.logits(x, batch.data["prompt_valid"][sample])[:, policy.prompt_length:]
        temperature = self.temperature or policy.rollout.temperature
        logp = token_logprobs(logits, completion, temperature, policy.logprob_chunk)  # [R, C]
        return scatter_rows(logp, sample, target, len(batch))


ESTIMATORS["tracerl"] = Trace


@register_method("tracerl")
class TraceRL(DLLMMethod):
    pass
