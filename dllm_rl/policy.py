"""The diffusion-LLM policy the core loop drives: block-decoded rollouts of a mask predictor,
and the log-probs of its answers through the method's estimator.

A masked diffusion LM has no exact sequence likelihood, so each method brings an estimator
(dllm_rl.methods): diffu-GRPO's one-step mean-field pass, TraceRL's trajectory rows. The
estimator's `prepare` runs at the end of a rollout, under the weights that made it, and
stores the old log-probs; its `logprobs` recomputes them with grad at training time.

Every prompt is left-padded to one fixed length (the task's longest prompt), so batches of
different rounds concatenate without re-padding.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from dllm_rl.models import MaskPredictor
from dllm_rl.samplers import DecodeResult, decode
from mmrl.core.batch import RolloutBatch
from mmrl.core.device import module_device
from mmrl.core.lora import load_model_weights, merge_lora
from mmrl.core.rewards import Sample


class PromptError(ValueError):
    """A prompt the model cannot take: its tokenizer cannot encode it, or it does not fit."""


class PromptTooLong(PromptError):
    """A prompt and its answer do not fit the model's context."""


def unencodable(tokenizer, text: str, error: Exception) -> str:
    """The first character of `text` the tokenizer cannot encode, by its code point and place
    ("'é' (U+00E9) at character 4"), where one alone fails; else the tokenizer's own error (a
    character-level one says only "WordLevel error: Missing [UNK] token")."""
    for k, ch in enumerate(text):
        try:
            tokenizer(ch, add_special_tokens=False)
        except Exception:  # noqa: BLE001 -- a fast tokenizer raises a bare Exception
            return f"{ch!r} (U+{ord(ch):04X}) at character {k + 1} has no token"
    return str(error)


class Estimator(Protocol):
    def prepare(self, policy: DLLMPolicy, batch: RolloutBatch, generator: torch.Generator) -> None:
        """Fill batch.old_logp (and whatever logprobs needs in batch.data) under the rollout's
        weights; with `on_policy` set (the first pass is on-policy) number the rows instead of
        scoring them (dllm_rl.methods.common.EstimatorBase)."""

    def logprobs(self, policy: DLLMPolicy, batch: RolloutBatch, iteration: int) -> Tensor:
        """[N, C] log-probs of the answer tokens under the current weights, with grad."""


class DLLMPolicy:
    def __init__(self, predictor: MaskPredictor, rollout, prompt_length: int, estimator: Estimator | None = None,
                 logprob_chunk: int | None = None):
        self.predictor = predictor
        self.logprob_chunk = logprob_chunk  # model.logprob_chunk: the methods' training log-probs (mmrl.core.logprob)
        self.model = predictor.model
        self.rollout = rollout
        self.prompt_length = prompt_length
        self.estimator = estimator
        banned = {predictor.mask_token_id, predictor.pad_token_id} - {predictor.eos_token_id, None}
        self.banned = torch.tensor(sorted(banned), dtype=torch.long)
        self._costs = {"forward_tokens": 0, "train_rows": 0}
        limit = predictor.max_length
        if limit is not None and prompt_length + rollout.gen_length > limit:
            raise PromptTooLong(f"prompts of up to {prompt_length} tokens plus gen_length {rollout.gen_length} "
                                f"exceed the model's context of {limit} positions")

    # ------------------------------------------------------------------ tokens

    def serve_prompt(self, prompt: Any, rollout):
        """A served request's prompt as generate takes it (mmrl.core.serve): a Problem, or a
        plain string (the problem's text); TypeError or ValueError (the server's 400) for
        anything else, or for a prompt this policy's width cannot hold, before the engine runs."""
        from dllm_rl.tasks import Problem
        from mmrl.core.wire import describe

        if isinstance(prompt, str):
            prompt = Problem(prompt=prompt, answer="", reference="")
        if not isinstance(prompt, Problem) or not isinstance(prompt.prompt, str):
            raise TypeError(f"expected a string or a dllm_rl.tasks:Problem dataclass, got {describe(prompt)}")
        self.encode_prompts([prompt.prompt])  # PromptError (a ValueError): a character without a token, too long
        return prompt


    def encode_prompts(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """Left-padded prompt ids [B, P] and their validity [B, P], on the model's device."""
        tok, p = self.predictor.tokenizer, self.prompt_length
        # Filled row by row on the CPU, then moved in one copy.
        pred = self.predictor  # a model without a pad token pads with eos (or the mask): `valid` hides it either way
        pad = next(t for t in (pred.pad_token_id, pred.eos_token_id, pred.mask_token_id) if t is not None)
        ids = torch.full((len(texts), p), pad, dtype=torch.long)
        valid = torch.zeros((len(texts), p), dtype=torch.bool)
        for i, text in enumerate(texts):
            try:
                row = tok(text, add_special_tokens=False)["input_ids"]
            except Exception as e:  # a fast tokenizer raises a bare Exception, e.g. for a character without a token
                raise PromptError(f"prompt {text!r} cannot be encoded by the model's tokenizer: "
                                  f"{unencodable(tok, text, e)}") from e
            if len(row) > p:
                raise PromptTooLong(f"prompt {text!r} has {len(row)} tokens; this run's prompts may have "
                                    f"at most {p} (the model's context is {self.predictor.max_length})")
            if row:
                ids[i, p - len(row):] = torch.tensor(row)
                valid[i, p - len(row):] = True
        device = module_device(self.model)
        return ids.to(device), valid.to(device)

    def answer_text(self, completion: Tensor) -> list[str]:
        """The text of each answer up to its first <eos>."""
        eos, out = self.predictor.eos_token_id, []
        for row in completion.tolist():
            if eos in row:
                row = row[: row.index(eos)]
            out.append(self.predictor.tokenizer.decode(row, skip_special_tokens=True))
        return out

    def completion_mask(self, completion: Tensor) -> Tensor:  # [N, C] bool
        """The answer tokens that train: everything up to and including the first <eos> (d1)."""
        is_eos = completion == self.predictor.eos_token_id
        before = is_eos.long().cumsum(1) - is_eos.long()  # eos seen strictly before
        return before == 0

    def logits(self, x: Tensor, prompt_valid: Tensor) -> Tensor:
        """[B, P + C, V] for prompt + answer ids x; the answer part is always valid."""
        valid = torch.cat([prompt_valid, torch.ones_like(x[:, self.prompt_length:], dtype=torch.bool)], 1)
        self._costs["forward_tokens"] += x.numel()  # what every method pays: sampling, old log-probs, training
        if torch.is_grad_enabled():
            self._costs["train_rows"] += x.shape[0]
        logits = self.predictor(x, prompt_length=self.prompt_length, valid=valid)
        # <mask> and <pad> are never answer tokens: ban them in sampling and in every log-prob
        # alike (a committed <mask> would look undecoded to the model later).
        if self.banned.device != logits.device:  # made on the CPU; moved once, on the first forward
            self.banned = self.banned.to(logits.device)
        return logits.index_fill(-1, self.banned, float("-inf"))

    # ------------------------------------------------------------------ sampling

    def decode(self, texts: Sequence[str], generator: torch.Generator | list[torch.Generator] | None, *,
               temperature: float, strategy: str | None = None,
               record_states: bool = False) -> tuple[DecodeResult, Tensor]:
        r = self.rollout
        ids, valid = self.encode_prompts(texts)
        # rows_arg: rows that finished the block (or stopped at <eos>) are not run
        result = decode(lambda x, rows: self.logits(x, valid[rows]), ids, gen_length=r.gen_length,
                        block_length=r.block_length, steps=r.steps, mask_id=self.predictor.mask_token_id,
                        strategy=strategy or r.strategy, temperature=temperature, threshold=r.threshold,
                        tau=r.tau, m=r.m, generator=generator, record_states=record_states,
                        stop_id=self.predictor.eos_token_id if r.stop_at_eos else None, rows_arg=True)
        return result, valid

    def generate(self, prompts: Sequence[Any], num_generations: int, rollout, generator: torch.Generator,
                 prefixes=None) -> RolloutBatch:
        if prefixes is not None and any(prefixes):
            raise ValueError("the dLLM policy does not continue fixed prefixes")
        problems = [p for p in prompts for _ in range(num_generations)]
        was_training = self.model.training
        self.model.eval()
        try:
            result, valid = self.decode([p.prompt for p in problems], generator,
                                        temperature=rollout.temperature, strategy=rollout.strategy)
        finally:
            self.model.train(was_training)
        completion = result.completion
        texts = self.answer_text(completion)
        samples = [to_sample(p, t) for p, t in zip(problems, texts)]
        # ids on the CPU (bookkeeping: the scores and advantages they group are the CPU's too)
        group_ids = torch.arange(len(prompts)).repeat_interleave(num_generations)
        mask = self.completion_mask(completion)
        data = {
            "prompt_ids": result.tokens[:, : self.prompt_length], "prompt_valid": valid,
            "completion": completion, "commit_step": result.commit_step,
            "commit_logp": result.commit_logp, "fallback": result.fallback, "active": result.active,
            "stat/nfe": result.nfe.float(), "stat/fallback_steps": result.fallback.sum(1).float(),
            "stat/expected_wrong": result.expected_wrong.sum(1).float(),
            "stat/answer_tokens": mask.sum(1).float(),
            # positions decoded (the <eos> filler too, unless rollout.stop_at_eos): the core's
            # rollout/decoded_tokens, what a rollout costs in tokens
            "stat/length": (result.commit_step >= 0).sum(1).float(),
        }
        batch = RolloutBatch(group_ids=group_ids, samples=samples, mask=mask,
                             old_logp=result.commit_logp.float(), data=data)
        if self.estimator is not None:
            with torch.no_grad():
                self.estimator.prepare(self, batch, generator)
        return batch

    def check_rollout(self, batch: RolloutBatch) -> None:
        """ValueError unless a batch from an engine in another process fits this policy: a server
        built with other task settings pads prompts to another width, which fails deep in the
        model at training time (mmrl.core.remote.RemoteEngine calls this on each batch)."""
        width = batch.data["prompt_ids"].shape[1] if "prompt_ids" in batch.data else None
        if width is not None and width != self.prompt_length:
            raise ValueError(f"its prompts are {width} tokens wide, this trainer's {self.prompt_length} (the width "
                             "is the task's longest prompt): serve with the trainer's task settings")

    def logprobs(self, batch: RolloutBatch, iteration: int = 0) -> Tensor:
        if self.estimator is None:
            raise ValueError("this policy has no log-prob estimator (it is built by the run's method)")
        return self.estimator.logprobs(self, batch, iteration)

    def step_costs(self) -> dict[str, float]:
        """Compute since the last call, logged per training step (the core calls this):
        cost/forward_tokens, the positions fed to the model in every forward (rollout steps,
        old log-probs, training rows), and cost/train_rows, the rows run with gradients."""
        out = {f"cost/{k}": float(v) for k, v in self._costs.items()}
        # zeroed in place: copies (reference(), a pipelined engine's sampler) count into this dict too
        self._costs.update(dict.fromkeys(self._costs, 0))
        return out

    # ------------------------------------------------------------------ weights

    def save_pretrained(self, path: str | Path) -> None:
        """from_pretrained layout with tokenizer and dllm.json; under LoRA the adapter only."""
        self.predictor.save_pretrained(path)

    def export_pretrained(self, path: str | Path) -> None:
        """A standalone directory load_mask_predictor reads (weights, tokenizer, dllm.json): under
        LoRA the adapters merged into the base weights, in place (the policy's last use: `export`)."""
        self.model = self.predictor.model = merge_lora(self.model)
        self.save_pretrained(path)

    def load_weights(self, path: str | Path) -> None:
        load_model_weights(self.model, path)

    def reference(self) -> DLLMPolicy:
        ref = copy.copy(self)
        ref.predictor = copy.deepcopy(self.predictor)
        ref.model = ref.predictor.model.requires_grad_(False)
        return ref


def to_sample(problem, completion: str) -> Sample:
    """What reward atoms see of a problem and one answer."""
    return Sample(prompt=problem.prompt, completion=completion, meta={**problem.meta, "answer": problem.answer})
