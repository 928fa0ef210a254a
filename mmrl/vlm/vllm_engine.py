"""vLLM rollout engines for the VLM backend (the optional GPU extra: pip install 'mmrl[vllm]').

Both engines implement mmrl.core.engine's Engine interface (generate / publish / close)
and return a `RolloutBatch` laid out exactly as `VLMPolicy.generate` lays it out
(mmrl/vlm/policy.py), so the methods and the training forward cannot tell which engine
sampled. The prompt side of every batch is built by the policy itself (`policy.encode`,
`policy._prompt_rows`: same chat template, same qwen-vl-utils resizing, same processor);
the engine only supplies the completion tokens and their log-probs.

    VLLMEngine(policy, model_path)       an in-process `vllm.LLM` on the trainer's GPU
                                         (colocated; sleeps between rollouts when sleep=True)
    VLLMServerEngine(url, policy)        a `vllm serve` server, over its OpenAI-compatible
                                         /v1/chat/completions (stdlib urllib, no new dependency)

Sampling matches VLMPolicy.generate: temperature, top_p, no top-k, `max_new_tokens`, the
rollout's stop strings; the only end-of-turn token is the policy's (`<|im_end|>`; vLLM's
own EOS list from generation_config.json is switched off with ignore_eos + stop_token_ids,
as transformers' generate is told eos_token_id=<|im_end|> only); vision placeholder tokens
get a logit bias of -inf (in-process) or -100 (server: the OpenAI bound), so they are
never sampled; every sampled token's log-prob comes back (logprobs=0).

Old log-probs: the trade-off (`old_logp=`)
    "trainer" (default)  recompute them with the trainer-side model (policy.logprobs under
                         no_grad), one extra forward over the batch. vLLM's numbers differ
                         from the training forward's (bf16 weights, other attention kernels
                         and reduction orders: the GPU test measures by how much); with the
                         trainer's own numbers the PPO ratio is exactly 1 on-policy and the
                         clip acts only on real policy change. With own_weights=True (the
                         default) the recompute uses a frozen copy of the policy that
                         changes only on publish, so it is exact even while the trainer
                         steps during a round (pipelined mode); own_weights=False scores
                         with the trainer's live model (no copy in memory; exact only when
                         the trainer does not step while the engine samples: sync mode).
    "engine"             use vLLM's log-probs as old_logp: no extra forward, but the ratio
                         then carries the engine/trainer numerical mismatch (importance
                         weights != 1 on-policy). vLLM returns processed log-probs (after
                         temperature, the logit bias and top-p) only with
                         logprobs_mode="processed_logprobs" (vLLM >= 0.10.2, set here where
                         the installed version has it; a server must be started with
                         --logprobs-mode processed_logprobs); with top_p < 1 they are
                         renormalised over the nucleus, unlike the trainer's.
    Either way vLLM's own numbers are kept in data["engine_logp"] [N, T], and with
    "trainer" data["stat/engine_logp_diff"] [N] (mean |trainer - engine| over the sample's
    tokens, logged as rollout/engine_logp_diff) measures the mismatch.
    data["stat/entropy"] is the sampled-token estimate -mean(old_logp) (its expectation is
    the per-token entropy; vLLM does not return the full distribution).

Weights (`publish`): the trainer's trainable weights by parameter name (mmrl.core.engine.
trainable_weights). `vllm_weights` turns them into what vLLM's `model.load_weights` takes:
PEFT wrappers dropped, LoRA pairs merged into their base weight (W + B A * scaling), names
renamed from transformers' in-memory layout (model.language_model.*, model.visual.*) to
the layout of the model's own checkpoint files (Qwen2/2.5-VL: model.*, visual.*; Qwen3-VL
keeps the in-memory layout), i.e. exactly what vLLM reads from the model directory at
start-up. The hf_to_vllm_mapper of vLLM 0.10.2 and 0.33 accepts these names (and the
in-memory ones) for Qwen2-VL and Qwen2.5-VL, and 0.33's for Qwen3-VL (0.10.2 has no Qwen3-VL).
    In-process: `llm.apply_model(lambda m: m.load_weights(...))` (vLLM 0.10.2 and 0.33 have it;
    the engine core runs in this process, VLLM_ENABLE_V1_MULTIPROCESSING=0, so nothing is
    serialised), else
    `llm.llm_engine.model_executor.driver_worker[.worker].model_runner.model.load_weights`
    (older releases), else EngineError. Then the prefix cache (KV computed with the old
    weights) and, where vLLM has it (0.33 does, 0.10.2 does not), the encoder cache (vision
    embeddings kept across requests) are reset.
    Server: see VLLMServerEngine.

Sleep (in-process, sleep=True, vLLM >= 0.7.3): `LLM(enable_sleep_mode=True)`; the engine
sleeps (level 1: weights offloaded to CPU, KV cache freed) after start-up, after each
generate and after each publish, and wakes up before each. Level 1 keeps a CPU copy of the
weights, refreshed at every sleep, so weights loaded while awake survive the next sleep
(level 2 would discard them and need a reload from disk, vLLM issue #29341).

What is tested where
    tests/vlm/test_vllm_engine_cpu.py (CPU, no vllm): the weight mapping against the
        checkpoints transformers writes (all three Qwen families, LoRA merge against PEFT's
        merge_and_unload); the batch assembly (a batch built from canned engine replies equals
        VLMPolicy.generate's own batch of the same samples); the server engine against a fake
        HTTP server (request body, reply parsing with and without token_ids, errors naming the
        URL, both publish paths and the files they write); the in-process engine's calls into
        a stand-in `vllm` module (sampling params, prompts, publish, sleep/wake order); the
        error when vllm is missing.
    tests/gpu/test_vllm_engine.py (CUDA + vllm): generate / publish / sleep with a real vLLM on
        the bundled tiny model, engine vs trainer log-prob mismatch before and after publish,
        throughput vs PolicyEngine; with MMRL_TEST_VLLM_SERVER=1 also the server engine
        against a `vllm serve` it starts (generate, publish by reload).
    NOT verified without a GPU (this file was written on a machine with neither CUDA nor vllm,
    from the vLLM 0.10.2 and 0.33.0 sources): that a real vLLM accepts these calls and
    names, that its prompt tokens equal the trainer's (checked at run time: a difference
    raises EngineError), the size of the log-prob mismatch, sleep/wake with publish, and the
    server's weight-update endpoints against a real `vllm serve`.
"""

from __future__ import annotations

import base64
import concurrent.futures
import gc
import io
import json
import os
import re
import shutil
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from mmrl.core.batch import RolloutBatch
from mmrl.core.engine import EngineError, Request, label, load_named
from mmrl.core.lora import is_lora
from mmrl.core.remote import HTTPStatusError, http_call
from mmrl.vlm.policy import budget_spent, to_sample

__all__ = [
    "Completion",
    "VLLMEngine",
    "VLLMServerEngine",
    "assemble_batch",
    "build_engine",
    "checkpoint_name",
    "parse_chat_completion",
    "vllm_weights",
]

OldLogp = Literal["trainer", "engine"]
_VISION_PADS = ("<|image_pad|>", "<|video_pad|>")
_SEED_SPAN = 2**31 - 2**16  # per-request seeds; vLLM gives the k-th of n samples seed + k


# --------------------------------------------------------------------------- weights

# transformers >= 4.52 holds Qwen2/2.5-VL's text model under model.language_model and its
# vision tower under model.visual, but reads and writes their checkpoints in the original
# layout (model.layers.*, visual.*); Qwen3-VL checkpoints use the in-memory layout.
_CHECKPOINT_PREFIXES: dict[str, tuple[tuple[str, str], ...]] = {
    "qwen2_vl": (("model.language_model.", "model."), ("model.visual.", "visual.")),
    "qwen2_5_vl": (("model.language_model.", "model."), ("model.visual.", "visual.")),
}
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<part>A|B)\.(?P<adapter>[^.]+)\.weight$")


def checkpoint_name(name: str, model_type: str) -> str:
    """A parameter's name in the model's checkpoint files (what vLLM loads at start-up),
    from its name in transformers' module tree. Names already in checkpoint layout
    (older transformers) and unknown families pass unchanged."""
    for old, new in _CHECKPOINT_PREFIXES.get(model_type, ()):
        if name.startswith(old):
            return new + name[len(old):]
    return name


@torch.no_grad()
def vllm_weights(model: torch.nn.Module, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """The published trainer weights as vLLM's `load_weights` takes them: checkpoint names,
    PEFT wrappers dropped, each LoRA pair merged into its base weight (W + B @ A * scaling,
    the base taken from `weights` if there, else from `model`). `model` is the trainer's
    (a PEFT model or not); `weights` maps its parameter names to tensors. To get the whole
    merged model pass {**dict(model.named_parameters()), **weights}."""
    peft = is_lora(model)
    base = model.get_base_model() if peft else model
    model_type = getattr(base.config, "model_type", "")
    prefix = "base_model.model." if peft else ""
    plain: dict[str, Tensor] = {}
    pairs: dict[tuple[str, str], dict[str, Tensor]] = {}
    for name, value in weights.items():
        if re.search(r"\.lora_(embedding_[AB]|magnitude_vector)\.", name):
            raise EngineError(f"cannot merge {name!r}: only LoRA on linear layers (no DoRA, no "
                              "embedding LoRA) can be published to vLLM as merged weights")
        m = _LORA.match(name)
        if m:
            pairs.setdefault((m["module"], m["adapter"]), {})[m["part"]] = value
            continue
        if ".original_module." in name:  # PEFT's frozen copy of a modules_to_save module
            continue
        name = re.sub(r"\.modules_to_save\.[^.]+\.", ".", name).replace(".base_layer.", ".")
        plain[name] = value
    for (module_name, adapter), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise EngineError(f"LoRA weights of {module_name} came without their lora_"
                              f"{'B' if 'A' in ab else 'A'} partner; publish both")
        module = model.get_submodule(module_name)
        key = module_name + ".weight"
        w = plain.get(key, module.base_layer.weight)
        delta = ab["B"].float() @ ab["A"].float() * module.scaling[adapter]
        if getattr(module, "fan_in_fan_out", False):
            delta = delta.T
        plain[key] = (w.float() + delta.to(w.device)).to(w.dtype)
    out = {}
    for name, value in plain.items():
        if not name.startswith(prefix):
            raise EngineError(f"published weight {name!r} is not a parameter of the PEFT model")
        out[checkpoint_name(name[len(prefix):], model_type)] = value
    return out


def _load_into_llm(llm, named: list[tuple[str, Tensor]]) -> None:
    """Hand named checkpoint-layout tensors to an in-process vLLM model's load_weights."""
    if hasattr(llm, "apply_model"):  # runs fn on the worker: in this process here
        llm.apply_model(lambda model: model.load_weights(named))
        return
    executor = getattr(getattr(llm, "llm_engine", None), "model_executor", None)
    worker = getattr(executor, "driver_worker", None)
    worker = getattr(worker, "worker", worker)  # V1 wraps the worker in WorkerWrapperBase
    model = getattr(getattr(worker, "model_runner", None), "model", None)
    if model is None or not hasattr(model, "load_weights"):
        raise EngineError("this vLLM version offers no way to load weights into its model "
                          "(neither LLM.apply_model nor llm_engine.model_executor.driver_worker."
                          "model_runner.model); install vllm >= 0.10")
    model.load_weights(named)


# --------------------------------------------------------------------------- batch assembly


@dataclass
class Completion:
    """One sampled completion as an engine returns it."""

    token_ids: list[int]  # including the end-of-turn token if it ended with one
    logprobs: list[float]  # of each token, under the engine's weights


def assemble_batch(policy, enc, prompts: Sequence[Any], completions: Sequence[Sequence[Completion]],
                   max_new_tokens: int | None = None) -> RolloutBatch:
    """A batch in VLMPolicy.generate's layout: `enc` = policy.encode(prompts) (one row per
    prompt), completions[i] = the samples of prompt i. Rows are prompt-major. old_logp is
    the engine's (see the module docstring for the trainer-side recompute). As the policy's
    own batches: tensors on the policy's device, group ids on the CPU."""
    counts = [len(c) for c in completions]
    rows = torch.arange(len(prompts)).repeat_interleave(torch.tensor(counts))
    flat = [c for group in completions for c in group]
    t = max([1] + [len(c.token_ids) for c in flat])
    # filled row by row from the engine's Python lists on the CPU; moved to the policy's device below
    completion = torch.full((len(flat), t), policy.pad_id, dtype=torch.long)  # [N, T]
    engine_logp = torch.zeros((len(flat), t))  # [N, T]
    for i, c in enumerate(flat):
        if len(c.logprobs) != len(c.token_ids):
            raise EngineError(f"sample {i}: {len(c.token_ids)} tokens but {len(c.logprobs)} log-probs")
        completion[i, : len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
        engine_logp[i, : len(c.logprobs)] = torch.tensor(c.logprobs, dtype=torch.float32)
    # the engine says how many tokens each row has: the mask is those, up to the first
    # end-of-turn (padding is told apart by length, not by the pad token, which may be
    # end-of-turn or a token the model generated)
    sizes = torch.tensor([len(c.token_ids) for c in flat])
    present = torch.arange(t)[None] < sizes[:, None]
    completion, engine_logp = completion.to(policy.device), engine_logp.to(policy.device)
    mask = policy.completion_mask(completion, trailing_pads=False) & present.to(completion.device)
    engine_logp = engine_logp.masked_fill(~mask, 0.0)
    lengths = mask.sum(-1)
    items = [prompts[i] for i in rows.tolist()]
    texts = policy.decode(completion, mask)
    prompt_rows = {k: v[rows] for k, v in policy._prompt_rows(enc, prompts).items()}
    return RolloutBatch(
        group_ids=rows.clone(),
        samples=[to_sample(item, text) for item, text in zip(items, texts)],
        mask=mask,
        old_logp=engine_logp.clone(),
        data={
            **prompt_rows,
            "completion_ids": completion,
            "engine_logp": engine_logp,
            "stat/length": lengths.float(),
            "stat/truncated": budget_spent(completion == policy.eos_id, mask, lengths, max_new_tokens),
        },
    )


def _collapse(ids: Sequence[int], pads: set[int]) -> list[int]:
    """Token ids with each run of a vision placeholder reduced to one (vLLM may report a
    prompt with its image slots expanded or not)."""
    out: list[int] = []
    for i in ids:
        if not (out and i in pads and out[-1] == i):
            out.append(i)
    return out


# --------------------------------------------------------------------------- shared engine logic


class _VLLMBase:
    """What both engines share: prompts, the batch, old log-probs, the scorer copy."""

    def __init__(self, policy, *, name: str, old_logp: OldLogp, own_weights: bool,
                 logprob_batch_size: int):
        if old_logp not in ("trainer", "engine"):
            raise ValueError(f"old_logp must be 'trainer' or 'engine', got {old_logp!r}")
        self.policy = policy
        self.name = name
        self.old_logp = old_logp
        self.version = 0
        self.logprob_batch_size = logprob_batch_size
        # the model the trainer-side old log-probs come from (None with old_logp="engine")
        self.scorer = None if old_logp == "engine" else (policy.rollout_copy() if own_weights else policy)
        self._own_scorer = old_logp == "trainer" and own_weights
        tok = policy.tokenizer
        pads = [tok.convert_tokens_to_ids(t) for t in _VISION_PADS]
        self._pads = {i for i in pads if isinstance(i, int) and i != tok.unk_token_id}

    # ------------------------------------------------------------------ prompts

    def _check(self, requests: Sequence[Request]) -> None:
        if any(r.prefix is not None for r in requests):
            raise EngineError(f"engine {self.name}: the VLM engines cannot continue from a prefix "
                              "(Request.prefix); VLMPolicy.generate cannot either")
        if any(r.n < 1 for r in requests):
            raise EngineError(f"engine {self.name}: every request must ask for at least one sample")

    def _chat(self, item) -> tuple[list[dict], str, list]:
        """(messages, the chat-template text, the resized images): what policy.encode uses."""
        msgs = self.policy.messages(item)
        text = self.policy.processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        images: list = []
        if item.images:
            images = self.policy.prompt_images(msgs)  # resized as encode resizes them
        return msgs, text, images

    def _as_resized(self, images: list) -> dict:
        """A request's mm_processor_kwargs: vLLM's processor, like encode's (policy.as_resized),
        cuts the images as they are, not resized again within the bounds of the processor vLLM
        loaded (the base's: a released Qwen3-VL's would scale a 128 x 96 image up to 256^2 px)."""
        return {"mm_processor_kwargs": self.policy.as_resized(images)} if images else {}

    @staticmethod
    def _seeds(seed: int, k: int) -> list[int]:
        gen = torch.Generator().manual_seed(int(seed))
        return torch.randint(0, _SEED_SPAN, (k,), generator=gen).tolist()

    def _check_prompt(self, i: int, got: Sequence[int] | None, enc) -> None:
        """vLLM tokenised prompt i as the trainer did (else the trainer would score samples
        of another prompt). vLLM may report the prompt with one placeholder per image
        instead of the expanded slots: then only the rest is compared."""
        if not got:
            return
        got, want = list(got), enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
        if got == want:
            return
        a, b = _collapse(got, self._pads), _collapse(want, self._pads)
        if a == b and got == a:  # unexpanded placeholders, same text and image count
            return
        if a == b:
            why = "the same text but another number of image tokens: its images were resized differently"
        else:
            j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            why = f"{len(got)} vs {len(want)} tokens, the text differs from token {j} on"
        raise EngineError(f"engine {self.name}: vLLM tokenised prompt {i} differently from the trainer "
                          f"({why}); vLLM must use the policy's model directory (chat template, "
                          "tokenizer and processor)")

    # ------------------------------------------------------------------ batch

    def _finish(self, batch: RolloutBatch, requests: Sequence[Request]) -> RolloutBatch:
        mask = batch.mask
        lengths = mask.sum(-1).clamp(min=1)
        if self.old_logp == "trainer":
            logp = self._score(batch).to(mask.device)
            batch.old_logp = logp
            diff = (logp - batch.data["engine_logp"]).abs() * mask
            batch.data["stat/engine_logp_diff"] = diff.sum(-1) / lengths
        batch.data["stat/entropy"] = -(batch.old_logp * mask).sum(-1) / lengths
        batch.policy_version = self.version
        return label(batch, requests, self.name)

    @torch.no_grad()
    def _score(self, batch: RolloutBatch) -> Tensor:
        """[N, T] log-probs under the scorer's weights, in chunks, on its device."""
        device = next(self.scorer.model.parameters()).device
        parts = []
        for start in range(0, len(batch), self.logprob_batch_size):
            part = batch.select(torch.arange(start, min(start + self.logprob_batch_size, len(batch))))
            part = replace(part, mask=part.mask.to(device), old_logp=None,
                           data={k: v.to(device) for k, v in part.data.items()
                                 if not k.startswith("stat/") and k != "engine_logp"})
            parts.append(self.scorer.logprobs(part).float().cpu())
        return torch.cat(parts)

    def _publish_scorer(self, weights: dict[str, Tensor]) -> None:
        if self._own_scorer:
            load_named(self.scorer.model, weights)


# --------------------------------------------------------------------------- in-process engine


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise EngineError("the vLLM engine needs the `vllm` package, which is not installed: "
                          "pip install 'mmrl[vllm]' (a CUDA machine)") from e
    return vllm


def _engine_fields(vllm) -> set[str] | None:
    """The keyword arguments this vLLM's LLM understands (its EngineArgs), or None if unknown."""
    args = getattr(vllm, "EngineArgs", None)
    return {f.name for f in fields(args)} if args is not None and is_dataclass(args) else None


class VLLMEngine(_VLLMBase):
    """An in-process `vllm.LLM`, colocated with the trainer on its GPU. `model_path` is the
    model directory the policy was loaded from (vLLM reads config, tokenizer, processor
    and start-up weights there; publish keeps the weights in step with the trainer).
    `gpu_memory_utilization`: the fraction of the GPU vLLM may take (weights + KV cache),
    leave the rest to the trainer. `sleep`: release vLLM's GPU memory between rollouts.
    `llm_kwargs` go to `vllm.LLM` as they are (enforce_eager, limit_mm_per_prompt, ...).
    vLLM seeds this process's global RNGs (torch, numpy, random) with `seed` when it starts;
    sampling uses per-request seeds drawn from generate's `seed`."""

    def __init__(self, policy, model_path: str | Path, *, gpu_memory_utilization: float = 0.3,
                 sleep: bool = True, dtype: str = "bfloat16", seed: int = 0,
                 max_model_len: int | None = None, name: str = "vllm", old_logp: OldLogp = "trainer",
                 own_weights: bool = True, logprob_batch_size: int = 16, **llm_kwargs):
        vllm = _import_vllm()
        super().__init__(policy, name=name, old_logp=old_logp, own_weights=own_weights,
                         logprob_batch_size=logprob_batch_size)
        self._vllm = vllm
        # The engine core in this process: publish hands tensors over by reference, and
        # apply_model needs no serialisation. An explicit setting by the user wins.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        known = _engine_fields(vllm)
        kwargs: dict[str, Any] = {"model": str(model_path), "dtype": dtype, "seed": seed,
                                  "gpu_memory_utilization": gpu_memory_utilization}
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        self.sleep = bool(sleep) and (known is None or "enable_sleep_mode" in known)
        if self.sleep:
            kwargs["enable_sleep_mode"] = True
        if known is None or "logprobs_mode" in known:  # vLLM >= 0.10.2
            kwargs["logprobs_mode"] = "processed_logprobs"
        kwargs.update(llm_kwargs)
        try:
            self.llm = vllm.LLM(**kwargs)
        except Exception as e:
            raise EngineError(f"engine {name}: vLLM could not start on {model_path}: "
                              f"{type(e).__name__}: {e}") from e
        self._asleep = False
        self._sleep()

    def _sleep(self) -> None:
        if self.sleep and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def _sampling_params(self, request: Request, rollout, seed: int):
        stop = list(getattr(rollout, "stop", None) or [])
        return self._vllm.SamplingParams(
            n=request.n, temperature=rollout.temperature, top_p=rollout.top_p,
            max_tokens=rollout.max_new_tokens, stop=stop or None,
            stop_token_ids=[self.policy.eos_id], ignore_eos=True, seed=seed, logprobs=0,
            logit_bias={i: float("-inf") for i in self.policy.banned_ids} or None,
        )

    def generate(self, requests: Sequence[Request], rollout, seed: int) -> RolloutBatch:
        self._check(requests)
        prompts = [r.prompt for r in requests]
        enc = self.policy.encode(prompts)
        self.policy._check_length(enc, prompts, rollout.max_new_tokens)
        inputs = []
        for item in prompts:
            _, text, images = self._chat(item)
            inputs.append({"prompt": text, **({"multi_modal_data": {"image": images}} if images else {}),
                           **self._as_resized(images)})
        params = [self._sampling_params(r, rollout, s) for r, s in zip(requests, self._seeds(seed, len(requests)))]
        self._wake()
        try:
            outputs = self.llm.generate(inputs, sampling_params=params, use_tqdm=False)
        except Exception as e:
            raise EngineError(f"engine {self.name}: vLLM generate failed: {type(e).__name__}: {e}") from e
        finally:
            self._sleep()
        if len(outputs) != len(requests):
            raise EngineError(f"engine {self.name}: vLLM answered {len(outputs)} of {len(requests)} prompts")
        completions = []
        for i, (r, out) in enumerate(zip(requests, outputs)):
            self._check_prompt(i, getattr(out, "prompt_token_ids", None), enc)
            samples = sorted(out.outputs, key=lambda c: c.index)
            if len(samples) != r.n:
                raise EngineError(f"engine {self.name}: vLLM returned {len(samples)} samples for prompt {i}, "
                                  f"asked for {r.n}")
            completions.append([_completion(c, self.name) for c in samples])
        return self._finish(assemble_batch(self.policy, enc, prompts, completions, rollout.max_new_tokens), requests)

    def publish(self, weights: dict[str, Tensor], version: int) -> None:
        named = list(vllm_weights(self.policy.model, weights).items())
        self._wake()
        try:
            _load_into_llm(self.llm, named)
            self.llm.reset_prefix_cache()  # KV blocks computed with the old weights
            reset_encoder = getattr(getattr(self.llm, "llm_engine", None), "reset_encoder_cache", None)
            if reset_encoder is not None:  # newer vLLM keeps vision embeddings across requests
                reset_encoder()
        except EngineError:
            raise
        except Exception as e:
            raise EngineError(f"engine {self.name}: vLLM could not take the weights of version {version}: "
                              f"{type(e).__name__}: {e}") from e
        finally:
            self._sleep()
        self._publish_scorer(weights)
        self.version = version

    def close(self) -> None:
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if hasattr(core, "shutdown"):
            core.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _completion(output, engine: str) -> Completion:
    """A vllm CompletionOutput (token_ids, logprobs: one {token id: Logprob} per token)."""
    ids = [int(t) for t in output.token_ids]
    if output.logprobs is None:
        raise EngineError(f"engine {engine}: vLLM returned no log-probs (SamplingParams.logprobs=0 ignored?)")
    try:
        logprobs = [float(step[t].logprob) for step, t in zip(output.logprobs, ids, strict=True)]
    except (KeyError, TypeError, ValueError) as e:
        raise EngineError(f"engine {engine}: vLLM's log-probs do not cover the sampled tokens: {e}") from e
    return Completion(ids, logprobs)


# --------------------------------------------------------------------------- server engine


def parse_chat_completion(reply: Any, n: int) -> tuple[list[Completion], list[int] | None]:
    """The n samples of a /v1/chat/completions reply made with logprobs=true,
    top_logprobs=0 and return_tokens_as_token_ids=true (tokens as "token_id:123"); vLLM
    >= 0.10.2 with return_token_ids=true also sends each choice's token_ids and the
    prompt's prompt_token_ids (returned second, None if absent). Raises ValueError or
    TypeError on a reply of another shape."""
    if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list):
        raise TypeError(f"no 'choices' list in the reply: {reply!r:.200}")
    choices = sorted(reply["choices"], key=lambda c: c.get("index", 0))
    if len(choices) != n:
        raise ValueError(f"{len(choices)} choices for n={n}")
    out = []
    for k, choice in enumerate(choices):
        content = (choice.get("logprobs") or {}).get("content")
        if content is None:
            raise ValueError(f"choice {k} has no logprobs.content (was logprobs=true honoured?)")
        logprobs = [float(c["logprob"]) for c in content]
        ids = choice.get("token_ids")
        if ids is None:
            ids = []
            for c in content:
                token = str(c.get("token", ""))
                if not token.startswith("token_id:"):
                    raise ValueError(f"choice {k}: token {token!r} is not 'token_id:<id>' "
                                     "(was return_tokens_as_token_ids=true honoured?)")
                ids.append(int(token[len("token_id:"):]))
        if len(ids) != len(logprobs):
            raise ValueError(f"choice {k}: {len(ids)} token ids but {len(logprobs)} log-probs")
        out.append(Completion([int(i) for i in ids], logprobs))
    prompt_ids = reply.get("prompt_token_ids")
    return out, (list(prompt_ids) if prompt_ids else None)


class VLLMServerEngine(_VLLMBase):
    """A `vllm serve <model dir>` server at `url` (http://host:port), through its
    OpenAI-compatible chat completions: one POST per request (prompt) with n samples,
    images as base64 PNG data URLs, sent concurrently (up to `max_concurrency`) so the
    server batches them. `model`: the served model name (None = the first of /v1/models).
    Every HTTP failure raises EngineError naming the URL; `timeout` (s) bounds each call.

    publish (`weights_dir`: a directory this process writes and the server reads, e.g. a
    shared file system; without it publish raises EngineError):
      "reload" (the default without LoRA): writes the whole model (LoRA merged) as
          `<weights_dir>/mmrl-v<version>/model.safetensors` in checkpoint layout with its
          config and processor, then asks the server to reload from there through the
          development endpoint /collective_rpc (vLLM 0.10.2 and 0.33, server started with
          VLLM_SERVER_DEV_MODE=1): method reload_weights(weights_path=...) (vLLM 0.33), else
          update_config(model_config.model=...) + reload_weights() (vLLM 0.10.2, where
          reload_weights takes no arguments); then POST /reset_prefix_cache (and
          /reset_encoder_cache where it exists: 0.33).
      "lora" (the default for a PEFT policy): saves the adapter to
          `<weights_dir>/mmrl-v<version>/` and loads it with POST /v1/load_lora_adapter
          (vLLM 0.10.2 and 0.33; server started with --enable-lora --max-lora-rank >= r and
          VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); later requests use it as their model and
          the previous adapter is unloaded.
    Neither path was run against a real server here (see the module docstring)."""

    def __init__(self, url: str, policy, *, timeout: float = 600, model: str | None = None,
                 name: str | None = None, old_logp: OldLogp = "trainer", own_weights: bool = True,
                 weights_dir: str | Path | None = None,
                 weight_sync: Literal["auto", "reload", "lora"] = "auto",
                 max_concurrency: int = 64, logprob_batch_size: int = 16):
        self.url = url.rstrip("/")
        super().__init__(policy, name=name or urllib.parse.urlsplit(self.url).netloc or self.url,
                         old_logp=old_logp, own_weights=own_weights, logprob_batch_size=logprob_batch_size)
        if weight_sync not in ("auto", "reload", "lora"):
            raise ValueError(f"weight_sync must be 'auto', 'reload' or 'lora', got {weight_sync!r}")
        self.timeout = timeout
        self.model = model
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self.weight_sync = ("lora" if policy.is_lora else "reload") if weight_sync == "auto" else weight_sync
        self.max_concurrency = max_concurrency
        self._published: Path | None = None  # the directory of the weights the server holds
        self._adapter: str | None = None  # the LoRA adapter requests use, once one is loaded
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # ------------------------------------------------------------------ HTTP

    def _call(self, path: str, body: Any = None, *, json_reply: bool = True) -> Any:
        """POST body as JSON (GET without one); the reply's JSON (None if empty), or with
        json_reply=False its text (vLLM's LoRA and cache endpoints answer plain text)."""
        where = self.url + path
        data = None if body is None else json.dumps(body).encode()
        raw = http_call(self._opener, where, engine=self.name, timeout=self.timeout, body=data,
                        headers={"Content-Type": "application/json"} if data else {})
        if not json_reply:
            return raw.decode("utf-8", "replace")
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise EngineError(f"engine {self.name}: {where} sent a reply that is not JSON: {raw[:200]!r}") from None

    def _model_name(self) -> str:
        if self._adapter is not None:
            return self._adapter
        if self.model is None:
            reply = self._call("/v1/models")
            try:
                self.model = str(reply["data"][0]["id"])
            except (TypeError, KeyError, IndexError):
                raise EngineError(f"engine {self.name}: {self.url}/v1/models lists no model: {reply!r:.200}") from None
        return self.model

    # ------------------------------------------------------------------ rollout

    def _body(self, item, request: Request, rollout, seed: int) -> dict:
        msgs, _, images = self._chat(item)
        content: list[dict] = []
        shown = iter(images)
        for part in msgs[0]["content"]:
            if part["type"] == "image":
                content.append({"type": "image_url", "image_url": {"url": _data_url(next(shown))}})
            else:
                content.append({"type": "text", "text": part["text"]})
        stop = list(getattr(rollout, "stop", None) or [])
        return {
            "model": self._model_name(), "messages": [{"role": msgs[0]["role"], "content": content}],
            "n": request.n, "temperature": rollout.temperature, "top_p": rollout.top_p,
            # explicit, so the server's generation_config defaults cannot change sampling
            "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "max_tokens": rollout.max_new_tokens, "seed": seed,
            **({"stop": stop} if stop else {}),
            "stop_token_ids": [self.policy.eos_id], "ignore_eos": True,
            "logit_bias": {str(i): -100 for i in self.policy.banned_ids},
            "logprobs": True, "top_logprobs": 0, "return_tokens_as_token_ids": True,
            "return_token_ids": True, "add_generation_prompt": True, **self._as_resized(images),
        }

    def generate(self, requests: Sequence[Request], rollout, seed: int) -> RolloutBatch:
        self._check(requests)
        prompts = [r.prompt for r in requests]
        enc = self.policy.encode(prompts)
        self.policy._check_length(enc, prompts, rollout.max_new_tokens)
        bodies = [self._body(item, r, rollout, s)
                  for item, r, s in zip(prompts, requests, self._seeds(seed, len(requests)))]
        where = self.url + "/v1/chat/completions"
        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(bodies), self.max_concurrency))) as pool:
            replies = list(pool.map(lambda b: self._call("/v1/chat/completions", b), bodies))
        completions = []
        for i, (r, reply) in enumerate(zip(requests, replies)):
            try:
                samples, prompt_ids = parse_chat_completion(reply, r.n)
            except (ValueError, TypeError, KeyError) as e:
                raise EngineError(f"engine {self.name}: bad reply from {where} for prompt {i}: {e}") from e
            self._check_prompt(i, prompt_ids, enc)
            completions.append(samples)
        return self._finish(assemble_batch(self.policy, enc, prompts, completions, rollout.max_new_tokens), requests)

    # ------------------------------------------------------------------ weights

    def publish(self, weights: dict[str, Tensor], version: int) -> None:
        if self.weights_dir is None:
            raise EngineError(f"engine {self.name}: publishing weights to {self.url} needs weights_dir, "
                              "a directory this process writes and the vLLM server reads")
        path = self.weights_dir / f"mmrl-v{int(version)}"
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        if self.weight_sync == "lora":
            self._publish_lora(path, version)
        else:
            self._publish_reload(path, weights)
        if self._published is not None and self._published != path:
            shutil.rmtree(self._published, ignore_errors=True)
        self._published = path
        self._publish_scorer(weights)
        self.version = version

    def _publish_reload(self, path: Path, weights: dict[str, Tensor]) -> None:
        from safetensors.torch import save_file

        model = self.policy.model
        full = vllm_weights(model, {**{k: p.detach() for k, p in model.named_parameters()}, **weights})
        save_file({k: v.detach().to("cpu").contiguous() for k, v in full.items()},
                  str(path / "model.safetensors"), metadata={"format": "pt"})
        base = model.get_base_model() if is_lora(model) else model
        base.config.save_pretrained(path)
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(path)
        self.policy.saved_processor().save_pretrained(path)  # the run's image bounds, as a checkpoint's
        try:
            self._rpc("reload_weights", kwargs={"weights_path": str(path)})
        except HTTPStatusError as first:
            if first.code == 404:
                raise EngineError(f"engine {self.name}: {self.url} has no /collective_rpc; start the server "
                                  "with VLLM_SERVER_DEV_MODE=1 (vLLM >= 0.10.2) to publish weights to it") from None
            try:  # vLLM before reload_weights(weights_path=...): point the model config there, reload
                self._rpc("update_config", args=[{"model_config": {"model": str(path)}}])
                self._rpc("reload_weights")
            except EngineError as second:
                raise EngineError(f"engine {self.name}: {self.url} could not reload weights from {path}: "
                                  f"{first}; the older way failed too: {second}") from None
        self._call("/reset_prefix_cache", {}, json_reply=False)
        try:
            self._call("/reset_encoder_cache", {}, json_reply=False)  # newer vLLM caches vision embeddings
        except HTTPStatusError as e:
            if e.code not in (404, 405):
                raise

    def _rpc(self, method: str, args: list | None = None, kwargs: dict | None = None) -> Any:
        return self._call("/collective_rpc", {"method": method, "args": args or [], "kwargs": kwargs or {},
                                              "timeout": self.timeout})

    def _publish_lora(self, path: Path, version: int) -> None:
        if not self.policy.is_lora:
            raise EngineError(f"engine {self.name}: weight_sync='lora' needs a LoRA (PEFT) policy")
        self.policy.model.save_pretrained(path)  # the published adapters: the trainer waits on publish
        name = f"mmrl-v{int(version)}"
        try:
            self._call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, json_reply=False)
        except HTTPStatusError as e:
            if e.code == 404:
                raise EngineError(f"engine {self.name}: {self.url} has no /v1/load_lora_adapter; start the "
                                  "server with --enable-lora --max-lora-rank <r> and "
                                  "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True") from None
            raise
        old, self._adapter = self._adapter, name
        if old is not None and old != name:
            try:
                self._call("/v1/unload_lora_adapter", {"lora_name": old}, json_reply=False)
            except EngineError:
                pass  # a stale adapter only costs the server memory; the new one is in use

    def close(self) -> None:
        pass  # the server belongs to whoever started it


def _data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")  # lossless: the server sees the pixels the trainer sees
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


# --------------------------------------------------------------------------- the backend's hook


def build_engine(kind: str, cfg, policy, url: str | None = None):
    """Engines for mmrl.core.pipeline.build_engines (the backend's `build_engine`):
    kind "vllm" -> VLLMEngine on cfg.model.path (or the bundled model); "vllm-server" ->
    VLLMServerEngine at url. The copy for old log-probs is kept only where the trainer
    steps while engines sample (rollout.scheduler.mode=pipelined)."""
    from mmrl.core.config import ConfigError
    from mmrl.vlm.models import resolve_model_path

    scheduler = getattr(cfg.rollout, "scheduler", None)
    own = getattr(scheduler, "mode", "sync") == "pipelined"
    if kind == "vllm":
        model_dir = resolve_model_path(cfg.model.path, cfg.base_dir)
        return VLLMEngine(policy, model_dir, seed=cfg.seed, own_weights=own)
    if kind == "vllm-server":
        if not url:
            raise ConfigError("a vLLM server engine needs a URL (rollout.scheduler.servers: vllm+http://...)")
        return VLLMServerEngine(url, policy, timeout=getattr(scheduler, "timeout", 600), own_weights=own)
    raise ConfigError(f"rollout.engine={kind!r}: the VLM backend has 'hf', 'vllm' and vLLM servers")
