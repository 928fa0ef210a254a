"""A toy backend for testing the core loop: a tiny real Llama on a verifiable task.

Task "successor": the prompt is a digit d (tokens [BOS, d]); the policy writes
two tokens. Atom `answer` = 1 if the first is (d + 1) mod 10; atom `stop`
(gated by `answer`) = 1 if the second is EOS. A random policy scores ~1/12 on
`answer`; RL should push greedy accuracy up within a few dozen steps.

It is also a backend module in the sense of mmrl.core.cli (CONFIG_CLASS,
DEFAULT_CONFIG, build, sample), so the CLI can be tested end to end.
"""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mmrl.core.batch import RolloutBatch
from mmrl.core.checkpoint import load_module_weights
from mmrl.core.config import TrainConfig
from mmrl.core.rewards import Reward, Sample, reward_atom

BOS, EOS, VOCAB = 10, 11, 12


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
        tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS,
    )
    return LlamaForCausalLM(cfg).float()


class ToyPolicy:
    def __init__(self, seed: int = 0, model: LlamaForCausalLM | None = None):
        self.model = model if model is not None else tiny_llama(seed)

    def generate(self, prompts, num_generations, rollout, generator) -> RolloutBatch:
        ids = torch.tensor([[BOS, d] for d in prompts for _ in range(num_generations)])  # [N, 2]
        logps = []
        for _ in range(rollout.max_new_tokens):
            logits = self.model(input_ids=ids).logits[:, -1].float() / rollout.temperature  # [N, V]
            tok = torch.multinomial(logits.softmax(-1), 1, generator=generator)  # [N, 1]
            logps.append(logits.log_softmax(-1).gather(-1, tok))
            ids = torch.cat([ids, tok], dim=1)
        completion = ids[:, 2:]  # [N, T]
        n = len(prompts)
        return RolloutBatch(
            group_ids=torch.arange(n).repeat_interleave(num_generations),
            samples=[Sample(prompt=int(ids[i, 1]), completion=completion[i].tolist()) for i in range(len(ids))],
            mask=torch.ones_like(completion, dtype=torch.bool),
            old_logp=torch.cat(logps, dim=1),
            data={"input_ids": ids},
        )

    def logprobs(self, batch: RolloutBatch) -> torch.Tensor:  # [N, T]
        ids = batch.data["input_ids"]
        logits = self.model(input_ids=ids[:, :-1]).logits[:, 1:].float()  # predicts ids[:, 2:]
        return logits.log_softmax(-1).gather(-1, ids[:, 2:, None]).squeeze(-1)

    def save_pretrained(self, path) -> None:
        self.model.save_pretrained(path)

    def load_weights(self, path) -> None:
        load_module_weights(self.model, path)

    def reference(self) -> ToyPolicy:
        ref = ToyPolicy(model=copy.deepcopy(self.model))
        ref.model.requires_grad_(False)
        return ref


@reward_atom("answer")
def answer(sample: Sample) -> bool:
    return sample.completion[0] == (sample.prompt + 1) % 10


@reward_atom("stop", weight=0.5, parents=("answer",))
def stop(sample: Sample) -> bool:
    return len(sample.completion) > 1 and sample.completion[1] == EOS


class ToyTask:
    name = "successor"

    def __init__(self):
        self.reward = Reward([answer, stop])

    def train_prompts(self):
        return list(range(10))

    def evaluate(self, policy: ToyPolicy) -> dict[str, float]:
        ids = torch.tensor([[BOS, d] for d in range(10)])
        first = policy.model(input_ids=ids).logits[:, -1].argmax(-1)  # greedy
        target = (torch.arange(10) + 1) % 10
        return {"accuracy": float((first == target).float().mean())}


# ------------------------------------------------------------------ backend module interface

CONFIG_CLASS = TrainConfig
DEFAULT_CONFIG = {
    "rollout": {"num_generations": 8, "prompts_per_step": 4, "max_new_tokens": 2},
    "optim": {"lr": 3e-3, "max_grad_norm": 1.0},
    "train": {"max_steps": 30, "log_samples_every": 10},
    "logging": {"tensorboard": False, "progress": False},
}


def build(cfg: TrainConfig):
    return ToyPolicy(seed=cfg.seed), ToyTask()


def sample(cfg, policy, task, prompts, n):
    gen = torch.Generator().manual_seed(cfg.seed)
    prompts = [int(p) for p in prompts] or [0, 1]
    with torch.no_grad():
        batch = policy.generate(prompts, n, cfg.rollout, gen)
    scores = task.reward.score(batch.samples)
    return [{"prompt": s.prompt, "completion": s.completion, **a}
            for s, a in zip(batch.samples, scores.per_sample())]


def log_constant(method, key: str, value: float) -> None:
    """Make every micro-batch's loss log `key` = value: a metric whose logged mean is known, to
    check how a step averages metrics over its passes."""
    loss = method.loss

    def with_constant(*a, **kw):
        out = loss(*a, **kw)
        out.metrics[key] = value
        return out

    method.loss = with_constant
