"""diffu-GRPO (d1: Zhao et al., arXiv 2504.12216; code: dllm-reasoning/d1), docs/methods.md section 5.

    rollout    G answers per prompt by the block sampler (rollout.strategy, low_confidence in d1)
    log-prob   one forward: every answer token masked, each prompt token masked with p = 0.15;
               log pi(o_k) ~ log p(o_k | masked prompt, fully masked answer) (mean-field)
    inner      mu = train.ppo_epochs passes per rollout, each with its own prompt-mask seed,
               shared by the old and the new log-probs of that pass (d1: mu = 12)
    advantage  A = r - group mean (d1's code; scale: group divides by the group std)
    loss       token-level PPO clip 0.5, averaged over the batch's answer tokens; + beta k3 KL

Departures: d1's KL (beta 0.04) is to a frozen reference model; here it is to the pre-update
policy (the rollout's weights), as the issue asks, so no reference copy is kept. The old
log-probs of all mu masks are computed right after the rollout, under the rollout's weights.
Prompt-mask seeds are drawn per sample (from the rollout generator), so a sample's mask does
not depend on how the batch is split into micro-batches.

d1's released code (``diffu-grpo/diffu_grpo_trainer.py`` and ``slurm_scripts/train.yaml``, read
2026-12-02) differs from the summary above in ways the config can follow or not. The defaults
follow the first two (since 2026-12-02; before: z-scores, dynamic sampling on):
- A = r - group mean: the group std is computed for logging only (``scale: none``).
- Every group trains, zero-std ones included (no filter, no refill: ``dynamic_sampling`` off).
- Rollouts at temperature 0.9, and the log-probs from the unscaled logits; here both use
  rollout.temperature unless ``logprob_temperature`` is set (1.0 for d1's). The ratio is 1 at
  the first pass either way: old and new log-probs share the temperature.
- One prompt-mask seed per inner iteration, shared by the whole batch; max_grad_norm 0.2,
  weight decay 0.1, AdamW betas (0.9, 0.99), LoRA on the 8B model with the adapter-free
  base as the KL reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dllm_rl.logprob import token_logprobs
from dllm_rl.methods.common import ESTIMATORS, DLLMMethod, EstimatorBase
from mmrl.core.batch import RolloutBatch
from mmrl.core.method import register_method


class MeanField(EstimatorBase):
    """d1's estimator; batch.data["old_logp_mu"] [N, mu, C] and ["mask_seed"] [N, mu]."""

    per_pass_inputs = True  # pass k masks the prompt with seed k

    def __init__(self, run):
        self.p = run.method.p_mask_prompt
        self.mu = run.train.ppo_epochs
        self.temperature = run.method.logprob_temperature  # None: the rollout's

    def prepare(self, policy, batch: RolloutBatch, generator: torch.Generator) -> None:
        n = len(batch)
        # seeds on the CPU, where the generator is: masked_input reads them as Python ints
        batch.data["mask_seed"] = torch.randint(0, 2**62, (n, self.mu), generator=generator)
        if self.skip_old(batch):
            return
        old = torch.stack([self.logprobs(policy, batch, k) for k in range(self.mu)], 1)
        batch.data["old_logp_mu"] = old.float()
        batch.old_logp = old[:, 0].float()

    def masked_input(self, policy, batch: RolloutBatch, iteration: int) -> Tensor:  # [N, P + C]
        prompt, valid = batch.data["prompt_ids"], batch.data["prompt_valid"]
        seeds = batch.data["mask_seed"][:, iteration % self.mu].tolist()
        hide = torch.stack([torch.rand(prompt.shape[1], generator=torch.Generator().manual_seed(s))
                            for s in seeds]).to(valid.device) < self.p  # seeded on the CPU, used where valid is
        mask_id = policy.predictor.mask_token_id
        prompt = torch.where(hide & valid, torch.full_like(prompt, mask_id), prompt)
        return torch.cat([prompt, torch.full_like(batch.data["completion"], mask_id)], 1)

    def logprobs(self, policy, batch: RolloutBatch, iteration: int) -> Tensor:  # [N, C]
        x = self.masked_input(policy, batch, iteration)
        logits = policy.logits(x, batch.data["prompt_valid"])[:, policy.prompt_length:]
        return token_logprobs(logits, batch.data["completion"], self.temperature or policy.rollout.temperature,
                              policy.logprob_chunk)


ESTIMATORS["diffu_grpo"] = MeanField


@register_method("diffu_grpo")
class DiffuGRPO(DLLMMethod):
    def old_logp(self, batch: RolloutBatch) -> Tensor:
        old = batch.data["old_logp_mu"]  # [N, mu, C]
        return old[:, self.epoch % old.shape[1]]
