"""The VLM policy: batched sampling with per-token log-probs, and the training forward.

`generate` samples G completions per prompt with transformers' `generate` and
keeps the log-probs of the sampled tokens from the generation logits themselves
(log_softmax(logits / temperature), the distribution before top-p, as the
training pass computes it), so no second forward is needed for old log-probs.

Rows of a batch are laid out as [prompt (left-padded) | completion (right-padded)]:
    data["prompt_ids"], data["prompt_mask"]    [N, P]
    data["completion_ids"], batch.mask          [N, T]  (mask: tokens up to and including end-of-turn)
    data["pixel_values"]                        [N, patches, D]  each sample's own patches, zero-padded
    data["image_grid_thw"]                      [N, images, 3]   zero rows are padding
                                                (both of width 0 in a round without images)
    data["prompt/<key>"]                        any other per-token processor output ([N, P])
Batches of different rounds concatenate with zero padding (RolloutBatch.concat);
padding inside a prompt is masked out, and Qwen's rope index skips masked tokens.

Devices: every tensor above, batch.mask and batch.old_logp live on the model's device
(model.device, `VLMPolicy.device`); group_ids stay on the CPU (bookkeeping, as the shared
loop's). Texts are decoded from a CPU copy of the completion ids.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from mmrl.core.batch import RolloutBatch
from mmrl.core.config import ConfigError
from mmrl.core.device import fork_rng, module_device
from mmrl.core.logprob import entropy_of, token_entropy, token_logprobs
from mmrl.core.lora import is_lora, load_model_weights, merge_lora
from mmrl.core.overlong import LENGTH_KEY
from mmrl.core.rewards import Sample

STATS_CHUNK = 2**26  # logits per chunk of VLMPolicy.token_stats: 256 MiB in float32


def scores_by_forward(rollout) -> bool:
    """rollout.old_logprobs forward: a rollout's log-probs come from a teacher-forced pass
    (VLMPolicy.score_old_logprobs), not from generate's logits."""
    return getattr(rollout, "old_logprobs", "generate") == "forward"


def mean_over(x: Tensor, mask: Tensor) -> Tensor:
    """[N, T] -> [N]: the mean of each row over its mask (0 for an empty one)."""
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def budget_spent(is_eos: Tensor, mask: Tensor, lengths: Tensor, max_new_tokens: int | None) -> Tensor:
    """[N] float: 1 where a completion used its whole token budget without ending its turn (a
    row that stopped on a stop string, or before the budget, is not truncated)."""
    ended = (is_eos & mask).any(-1)
    spent = lengths >= max_new_tokens if max_new_tokens is not None else torch.ones_like(ended)
    return (~ended & spent).float()


class RowSampler:
    """generate's sampling step with one generator per row, for draws that do not depend on
    the batch (held-out evaluation's samples, mmrl.core.held_out.sample_generators): generate's
    own draw (do_sample) takes a whole batch's noise from the global RNG, so an item sampled in
    another batch got other answers. As generate's last logits processor (after its banned
    tokens), it applies generate's own temperature and top-p warpers, draws Gumbel-max
    argmax(scores + g) with row r's g from generators[r], and returns 0 at the drawn token and
    -inf elsewhere, which greedy decoding (do_sample=False) then takes: a sample of the same
    distribution as do_sample's. Row r's t-th token takes its generator's t-th draw."""

    def __init__(self, generators: Sequence[torch.Generator], temperature: float, top_p: float, device):
        from transformers import TemperatureLogitsWarper, TopPLogitsWarper

        # CPU generators (a seed's draws then the same anywhere) seed ones on a GPU: a [rows, V]
        # draw per token on the CPU, then copied, would cost more than the step
        self.generators = [g if torch.device(device).type != "cuda" else
                           torch.Generator(device).manual_seed(int(torch.randint(0, 2**62, (1,), generator=g)))
                           for g in generators]
        self.warpers = [TemperatureLogitsWarper(temperature)] + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:  # scores [rows, V]
        if len(scores) != len(self.generators):
            raise ValueError(f"{len(self.generators)} generators for {len(scores)} rows")
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        u = torch.stack([torch.rand(scores.shape[-1], generator=g, device=g.device) for g in self.generators])
        u = u.to(scores.device).clamp_min(torch.finfo(u.dtype).tiny)
        drawn = (scores - torch.log(-torch.log(u))).argmax(-1, keepdim=True)  # [rows, 1]
        return torch.full_like(scores, float("-inf")).scatter_(-1, drawn, 0.0)


def sampling_kwargs(rollout, generators: Sequence[torch.Generator] | None, device) -> dict:
    """generate's sampling arguments at the rollout's temperature and top_p: its own draw (from
    the global RNG, which the caller seeds), or with `generators` (one per row) RowSampler's."""
    if generators is None:
        return {"do_sample": True, "temperature": rollout.temperature, "top_p": rollout.top_p, "top_k": 0}
    from transformers import LogitsProcessorList

    return {"do_sample": False, "logits_processor": LogitsProcessorList([
        RowSampler(generators, rollout.temperature, rollout.top_p, device)])}


class PromptTooLong(ConfigError):
    """A prompt (with max_new_tokens) longer than the model's context. A ConfigError (so a
    ValueError) because it is the user's data or settings: the CLI prints it without a
    traceback, naming the prompt (docs/errors.md)."""


class VLMPolicy:
    def __init__(self, model, processor, *, temperature: float = 1.0, min_pixels: int | None = None,
                 max_pixels: int | None = None, tools=None, tools_cfg=None, logprob_chunk: int | None = None):
        """`tools` (a mmrl.vlm.tools.ToolRegistry) with `tools_cfg` (rollout.tools) makes every
        rollout and greedy decode a multi-turn tool rollout (mmrl.vlm.agent)."""
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.temperature = temperature
        self.logprob_chunk = logprob_chunk  # model.logprob_chunk (mmrl.core.logprob)
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.patch_size = image_patch_size(processor)  # qwen-vl-utils resizes to multiples of twice this
        tok = self.tokenizer
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        self.eos_id = im_end if isinstance(im_end, int) and im_end != tok.unk_token_id else tok.eos_token_id
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_id
        # Vision placeholders must never be generated: in a training forward the model would
        # take them for image slots. They are suppressed in sampling and get no probability
        # in every log-prob we compute, so old and new log-probs use the same distribution.
        vision = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>"]
        ids = [tok.convert_tokens_to_ids(t) for t in vision]
        self.banned_ids = sorted({i for i in ids if isinstance(i, int) and i != tok.unk_token_id})
        text_cfg = getattr(model.config, "text_config", model.config)
        self.max_context = getattr(text_cfg, "max_position_embeddings", None)
        self.tools_cfg = tools_cfg
        self.agent = None
        if tools is not None:
            from mmrl.vlm.agent import ToolRollout

            self.agent = ToolRollout(self, tools, tools_cfg)

    @property
    def device(self) -> torch.device:
        """The device of the model's parameters: where rollouts and updates run."""
        return module_device(self.model)

    def on_device(self, data: dict[str, Tensor]) -> dict[str, Tensor]:
        """`data` with every tensor on the model's device (no copy where one is there already)."""
        device = self.device
        return {k: v.to(device) if torch.is_tensor(v) else v for k, v in data.items()}

    # ------------------------------------------------------------------ prompts

    def serve_prompt(self, prompt: Any, rollout):
        """A served request's prompt as generate takes it (mmrl.core.serve): a QAItem, or a
        plain string, asked without an image as `sample --prompt` asks it; TypeError or
        ValueError (the server's 400) for anything else, or for a prompt that with
        rollout.max_new_tokens exceeds the model's context, before the engine runs."""
        from PIL import Image

        from mmrl.core.wire import describe
        from mmrl.vlm.tasks.jsonl import prompt_problem
        from mmrl.vlm.tasks.shapes_qa import QAItem

        if isinstance(prompt, str):
            prompt = QAItem(images=[], question=prompt, answer="")
        form = ("a string (a question without an image) or a mmrl.vlm.tasks.shapes_qa:QAItem dataclass whose "
                'images are wire images ({"__t": "image", ...}: the server opens no paths or URLs)')
        if not isinstance(prompt, QAItem) or not isinstance(prompt.question, str):
            raise TypeError(f"expected {form}, got {describe(prompt)}")
        if not isinstance(prompt.images, list):
            raise TypeError(f"images must be a list of wire images, got {describe(prompt.images)}")
        problem = prompt_problem(prompt.question, len(prompt.images))
        if problem:  # as a data file's line is refused: messages() would send the placeholders as text
            raise ValueError(f"the question {problem}")
        for k, image in enumerate(prompt.images):
            if not isinstance(image, Image.Image):
                raise TypeError(f"images[{k}] must be a wire image ({{\"__t\": \"image\", ...}}: the server "
                                f"opens no paths or URLs), got {describe(image)}")
            try:  # what generate would meet mid-batch: the model's resizing refusing its shape
                self.resize_images([image])
            except Exception as e:  # noqa: BLE001 -- qwen-vl-utils raises ValueError and assertion errors
                raise ValueError(f"images[{k}]: a {image.width} x {image.height} image the model's resizing "
                                 f"cannot take: {e or type(e).__name__}") from None
        self._check_length(self.encode([prompt]), [prompt], rollout.max_new_tokens)  # PromptTooLong: a ValueError
        return prompt

    def messages(self, item) -> list[dict[str, Any]]:
        """The user's turn: the images, then the question; where the question holds one "<image>"
        placeholder per image (LLaVA-format data), each image goes in its placeholder's place."""
        from mmrl.vlm.tasks.jsonl import IMAGE_PLACEHOLDER

        texts = item.question.split(IMAGE_PLACEHOLDER)
        if not item.images or len(texts) != len(item.images) + 1:
            texts = [""] * len(item.images) + [item.question]
        content: list[dict[str, Any]] = [{"type": "text", "text": texts[0]}] if texts[0] else []
        for image, text in zip(item.images, texts[1:]):
            part = {"type": "image", "image": _rgb(image)}
            if self.min_pixels is not None:
                part["min_pixels"] = self.min_pixels
            if self.max_pixels is not None:
                part["max_pixels"] = self.max_pixels
            content.append(part)
            if text:
                content.append({"type": "text", "text": text})
        return [{"role": "user", "content": content}]

    def encode(self, items: Sequence[Any]):
        """Processor inputs for a batch of prompts (left-padded), images resized by qwen-vl-utils,
        on the model's device."""
        texts, images = [], []
        for i, item in enumerate(items):
            msgs = self.messages(item)
            texts.append(self.processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                                            **self._tool_schemas()))
            if item.images:
                try:
                    images.extend(self.prompt_images(msgs))
                except Exception as e:
                    raise ValueError(f"prompt {i} ({item.question[:60]!r}): its image could not be read: {e}") from e
        self.tokenizer.padding_side = "left"
        return self.processor(text=texts, images=images or None, padding=True, return_tensors="pt",
                              **self.as_resized(images)).to(self.device)

    @staticmethod
    def as_resized(images: Sequence[Any]) -> dict[str, Any]:
        """The processor's keywords for images prompt_images / resize_images already resized: cut
        them as they are (do_resize=False, as Qwen3-VL's README does after qwen-vl-utils). The
        processor would resize them again within its own size bounds: a released Qwen3-VL's
        shortest_edge (65536 px) scaled a 128 x 96 image up to 70 tokens, where the run's
        model.max_pixels allowed 12."""
        return {"do_resize": False} if images else {}

    def _encode_repeated(self, prompts: Sequence[Any], g: int) -> dict[str, Tensor]:
        """encode() of each prompt repeated g times, with every image resized and cut into
        patches once rather than g times (the same tensors)."""
        enc = self.encode(prompts)
        n = len(prompts)
        rows = torch.arange(n).repeat_interleave(g)  # indices: a CPU index reads a tensor on any device
        out: dict[str, Tensor] = {}
        if "pixel_values" in enc:  # flat over images: repeat each prompt's slab of patches and grid rows
            grid = enc["image_grid_thw"]
            counts = [len(p.images) for p in prompts]
            grids = torch.split(grid, counts)
            slabs = torch.split(enc["pixel_values"], [int(x.prod(-1).sum()) for x in grids])
            out["pixel_values"] = torch.cat([slabs[i] for i in rows.tolist()])
            out["image_grid_thw"] = torch.cat([grids[i] for i in rows.tolist()])
        for k, v in enc.items():
            if k in out:
                continue
            if not (torch.is_tensor(v) and v.shape[:1] == (n,)):  # an output we do not know how to repeat
                return self.encode([p for p in prompts for _ in range(g)])
            out[k] = v[rows]
        return out

    def _tool_schemas(self) -> dict:
        """The tools' JSON schemas for the chat template's system prompt, where configured."""
        if self.agent is None or not self.tools_cfg.schema_in_prompt:
            return {}
        return {"tools": self.agent.registry.schemas()}

    def prompt_images(self, msgs: list[dict[str, Any]]) -> list:
        """The images of messages() as the processor receives them (encode, the vLLM engines):
        resized by qwen-vl-utils within their min/max pixels, to multiples of the model's patch
        side times the merge (2): 28 for Qwen2/2.5-VL, 32 for Qwen3-VL. At its default patch (14)
        a Qwen3-VL image came in 28-multiples, which the processor resampled again to 32-multiples."""
        from qwen_vl_utils import process_vision_info

        found, _ = process_vision_info(msgs, image_patch_size=self.patch_size)
        return list(found or [])

    def resize_images(self, images: Sequence[Any], max_pixels: int | None = None) -> list:
        """Images as the prompt's are: resized by qwen-vl-utils within min/max pixels."""
        return resize_for_model(images, self.min_pixels, max_pixels or self.max_pixels, patch_size=self.patch_size)

    def _check_length(self, enc, items, max_new_tokens: int, repeats: int = 1) -> None:
        """`items` may repeat each prompt `repeats` times (a group's rows): the error counts prompts."""
        if self.max_context is None:
            return
        lengths = enc["attention_mask"].sum(-1)
        for i, n in enumerate(lengths.tolist()):
            if n + max_new_tokens > self.max_context:
                raise PromptTooLong(
                    f"prompt {i // repeats} of this batch ({items[i].question[:60]!r}) has {n} tokens; with "
                    f"rollout.max_new_tokens {max_new_tokens} it exceeds the model's context of {self.max_context}"
                )

    # ------------------------------------------------------------------ rollout

    def generate(self, prompts, num_generations: int, rollout, generator: torch.Generator | list[torch.Generator],
                 prefixes: Sequence[Any] | None = None) -> RolloutBatch:
        """`prefixes` (one per sample, rows of a prompt contiguous): None, or a fixed start of
        the completion (token ids or text) to continue from. A prefix is part of the
        sample's completion and its text, but carries no loss (mask False there). `generator`:
        one for the batch, or a list of one per sample (RowSampler: each sample's draws its own,
        the same in any batch)."""
        items = [item for item in prompts for _ in range(num_generations)]
        fixed = self._prefix_ids(prefixes, len(items))
        if self.agent is not None:  # multi-turn: generate, call tools, observe, continue
            batch = self.agent.run(items, rollout, generator, fixed)
            batch.group_ids = torch.arange(len(prompts)).repeat_interleave(num_generations)
            return batch
        enc = self._encode_repeated(prompts, num_generations)
        self._check_length(enc, items, rollout.max_new_tokens + max(map(len, fixed), default=0), num_generations)
        prompt_rows = self._prompt_rows(enc, items)
        inputs = self._with_prefixes(enc, fixed) if any(fixed) else enc
        inputs = self._shared_image_inputs(inputs, prompt_rows)
        rows = generator if isinstance(generator, list) else None
        if rows is not None and len(rows) != len(items):
            raise ValueError(f"{len(rows)} generators for {len(items)} samples")
        # a CPU generator: the same draws anywhere
        seed = None if rows else int(torch.randint(0, 2**62, (1,), generator=generator))
        forward = scores_by_forward(rollout)  # else the log-probs come from generate's logits
        with fork_rng(self.model), torch.no_grad():
            if seed is not None:
                torch.manual_seed(seed)  # generate draws from the global RNG (the model's GPU's too): pin it to ours
            out = self.model.generate(
                **inputs, **sampling_kwargs(rollout, rows, self.device),
                max_new_tokens=rollout.max_new_tokens, return_dict_in_generate=True, output_logits=not forward,
                eos_token_id=self.eos_id, pad_token_id=self.pad_id, suppress_tokens=self.banned_ids or None,
                **self._stop_kwargs(getattr(rollout, "stop", None)), **self._plain_sampling(),
                synced_gpus=False,  # under optim.fsdp too: the weights are gathered, ranks decode on their own
            )
        p = inputs["input_ids"].shape[1]
        completion = out.sequences[:, p:]  # [N, T]
        if forward:  # rescored below, once the batch exists
            old_logp = entropy = torch.zeros(completion.shape, device=completion.device)
        else:
            old_logp, entropy = self.token_stats(out.logits, completion, rollout.temperature)  # [N, T] each
        mask = self.completion_mask(completion, trailing_pads=bool(getattr(rollout, "stop", None)))
        lengths = mask.sum(-1)
        truncated = budget_spent(completion == self.eos_id, mask, lengths, rollout.max_new_tokens)
        entropy = mean_over(entropy, mask)
        present = mask
        if any(fixed):  # the prefix goes in front: in the completion and its attention, not the loss
            completion = _prepend(fixed, completion, lambda f: f, self.pad_id)
            present = _prepend(fixed, mask, lambda f: [True] * len(f), False)
            old_logp = _prepend(fixed, old_logp, lambda f: [0.0] * len(f), 0.0)
            mask = _prepend(fixed, mask, lambda f: [False] * len(f), False)
        texts = self.decode(completion, present)
        n = len(prompts)
        batch = RolloutBatch(
            group_ids=torch.arange(n).repeat_interleave(num_generations),  # bookkeeping: on the CPU
            samples=[to_sample(item, text, k) for item, text, k in zip(items, texts, present.sum(-1).tolist())],
            mask=mask,
            old_logp=old_logp.masked_fill(~mask, 0.0),
            data={
                **prompt_rows,
                "completion_ids": completion,
                "completion_attention": present,
                "stat/length": lengths.float(),
                "stat/entropy": entropy,
                "stat/truncated": truncated,
            },
        )
        if forward:
            self.score_old_logprobs(batch, rollout.score_batch_size)
        return batch

    @torch.no_grad()
    def score_old_logprobs(self, batch: RolloutBatch, rows: int) -> None:
        """batch.old_logp and its "stat/entropy" from the current weights, teacher-forced as in
        training, `rows` samples per pass (rollout.old_logprobs forward)."""
        parts = [self.logprobs(batch.select(idx), entropy=True) for idx in torch.arange(len(batch)).split(rows)]
        batch.old_logp = torch.cat([p[0] for p in parts])
        batch.data["stat/entropy"] = mean_over(torch.cat([p[1] for p in parts]), batch.mask)

    def teacher_batch(self, items: Sequence[Any], completions: Sequence[str]) -> RolloutBatch:
        """A batch of given completions (each followed by end-of-turn), for supervised
        fine-tuning and for scoring fixed texts with `logprobs`. One group per item."""
        enc = self.encode(items)
        rows = [self.tokenizer(c, add_special_tokens=False)["input_ids"] + [self.eos_id] for c in completions]
        t = max(len(r) for r in rows)
        # filled row by row from Python lists on the CPU, then moved to the model's device at once
        completion = torch.full((len(rows), t), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), t), dtype=torch.bool)
        for i, r in enumerate(rows):
            completion[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = True
        completion, mask = completion.to(self.device), mask.to(self.device)
        return RolloutBatch(
            group_ids=torch.arange(len(items)),
            samples=[to_sample(it, c) for it, c in zip(items, completions)],
            mask=mask,
            data={**self._prompt_rows(enc, items), "completion_ids": completion, "completion_attention": mask},
        )

    def _prefix_ids(self, prefixes, n: int) -> list[list[int]]:
        if prefixes is None:
            return [[] for _ in range(n)]
        if len(prefixes) != n:
            raise ValueError(f"{len(prefixes)} prefixes for {n} samples")
        out = []
        for x in prefixes:
            if x is None:
                out.append([])
            elif isinstance(x, str):
                out.append(self.tokenizer(x, add_special_tokens=False)["input_ids"])
            else:
                out.append([int(t) for t in (x.tolist() if torch.is_tensor(x) else x)])
        return out

    def _with_prefixes(self, enc, fixed: list[list[int]]) -> dict[str, Tensor]:
        """The processor's inputs with each row's prefix appended after its prompt (re-left-padded)."""
        keep = enc["attention_mask"].bool()
        device = enc["input_ids"].device
        rows = [torch.cat([enc["input_ids"][i][keep[i]], torch.tensor(f, dtype=torch.long, device=device)])
                for i, f in enumerate(fixed)]
        width = max(len(r) for r in rows)
        out = dict(enc)
        out["input_ids"] = torch.full((len(rows), width), self.pad_id, dtype=torch.long, device=device)
        out["attention_mask"] = torch.zeros((len(rows), width), dtype=enc["attention_mask"].dtype, device=device)
        others = [k for k, v in enc.items() if _per_token(k, v, enc)]
        for k in others:  # e.g. token types: the prefix is text (0)
            out[k] = torch.zeros((len(rows), width), dtype=enc[k].dtype, device=device)
        for i, r in enumerate(rows):
            out["input_ids"][i, width - len(r):] = r
            out["attention_mask"][i, width - len(r):] = 1
            for k in others:
                out[k][i, width - len(r): width - len(fixed[i])] = enc[k][i][keep[i]]
        return out

    def token_stats(self, step_logits: Sequence[Tensor], tokens: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
        """The log-prob of each sampled token and the entropy at each step ([N, T] float32 each)
        from generate's logits (T tensors [N, V]), under log_softmax(logits / temperature) with
        the banned tokens at -inf. A few rows at a time: a float32 [N, T, V] and its log-softmax
        at once would be several times the logits generate holds (a 150k vocabulary: GBs)."""
        n, t = tokens.shape
        vocab = step_logits[0].shape[-1] if t else 1
        rows = max(1, STATS_CHUNK // max(1, t * vocab))
        logps, entropies = [], []
        for r in range(0, n, rows):
            logits = self._ban(torch.stack([s[r:r + rows] for s in step_logits], dim=1).float()) / temperature
            logp_all = logits.log_softmax(-1)  # [rows, T, V]
            logps.append(logp_all.gather(-1, tokens[r:r + rows].unsqueeze(-1)).squeeze(-1))
            entropies.append(entropy_of(logp_all))
        if not logps:
            empty = torch.zeros((0, t), device=tokens.device)
            return empty, empty
        return torch.cat(logps), torch.cat(entropies)

    def _ban(self, logits: Tensor) -> Tensor:
        if self.banned_ids:
            logits = logits.clone()
            logits[..., self.banned_ids] = float("-inf")
        return logits

    @staticmethod
    def _plain_sampling() -> dict:
        """generate() applies the sampling changes a model's generation_config.json ships (Qwen
        instruct checkpoints: repetition_penalty 1.05) unless told otherwise; rollouts must draw
        from softmax(logits / T) with top_p alone, as their log-probs assume (as the vLLM
        engine's requests say too)."""
        return {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_repetition_penalty": 1.0,
                "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "min_p": None,
                "bad_words_ids": None, "sequence_bias": None,
                # a minimum length forbids end-of-turn, which the log-probs allow
                "min_new_tokens": None, "min_length": 0, "begin_suppress_tokens": None,
                "forced_bos_token_id": None, "forced_eos_token_id": None,
                "exponential_decay_length_penalty": None}

    def _stop_kwargs(self, stop) -> dict:
        return {"stop_strings": list(stop), "tokenizer": self.tokenizer} if stop else {}

    def completion_mask(self, completion: Tensor, trailing_pads: bool = True) -> Tensor:
        """True up to and including the first end-of-turn token; with `trailing_pads`, trailing
        pad tokens of a row without end-of-turn are False too: generate's padding of rows that
        ended early on a stop string (a row with end-of-turn keeps it, even where the pad token
        is end-of-turn). Without stop strings (trailing_pads False) a row ends early only at
        end-of-turn, and a pad token the model generated itself (Qwen's pad is <|endoftext|>)
        stays its own."""
        is_eos = completion == self.eos_id
        after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0  # strictly after the first eos
        if not trailing_pads:
            return ~after_eos
        not_pad = completion != self.pad_id
        # last non-pad position + 1 (generate pads finished rows, e.g. after a stop string)
        idx = torch.arange(completion.shape[1], device=completion.device)
        last = torch.where(not_pad, idx, torch.full_like(idx, -1)).max(-1).values  # [N]
        return ~after_eos & ((idx[None] <= last[:, None]) | is_eos.any(-1, keepdim=True))

    def decode(self, completion: Tensor, mask: Tensor) -> list[str]:
        completion, mask = completion.cpu(), mask.cpu()  # one copy for the tokenizer, not one per row
        return [
            self.tokenizer.decode(row[m].tolist(), skip_special_tokens=True)
            for row, m in zip(completion, mask)
        ]

    def _prompt_rows(self, enc, items) -> dict[str, Tensor]:
        """The prompt side of a batch's data: ids, mask, per-sample vision rows, other per-token outputs."""
        return {
            "prompt_ids": enc["input_ids"],
            "prompt_mask": enc["attention_mask"],
            **self._vision_rows(enc, items),
            **{f"prompt/{k}": v for k, v in enc.items() if _per_token(k, v, enc)},
        }

    def _vision_rows(self, enc, items) -> dict[str, Tensor]:
        """Split the processor's flat pixel_values / image_grid_thw into per-sample rows."""
        if "pixel_values" not in enc:
            return self._no_vision_rows(len(items))
        grid = enc["image_grid_thw"]  # [images, 3]
        patches = grid.prod(-1).tolist()
        counts = [len(item.images) for item in items]
        most_images, most_patches = max(counts), 0
        rows, start, img = [], 0, 0
        for c in counts:
            n = sum(patches[img: img + c])
            rows.append((start, n, grid[img: img + c]))
            most_patches = max(most_patches, n)
            start, img = start + n, img + c
        pv = enc["pixel_values"]
        pixel = torch.zeros((len(items), most_patches, pv.shape[-1]), dtype=pv.dtype, device=pv.device)
        thw = torch.zeros((len(items), most_images, 3), dtype=grid.dtype, device=grid.device)
        for i, (s, n, g) in enumerate(rows):
            pixel[i, :n] = pv[s: s + n]
            thw[i, : len(g)] = g
        return {"pixel_values": pixel, "image_grid_thw": thw}

    def _no_vision_rows(self, n: int) -> dict[str, Tensor]:
        """Vision rows of width 0 for a round without images, where the processor cuts images
        into patches (the Qwen-VL families): all padding, so that the round concatenates with
        rounds that have images (a JSONL dataset mixing text-only and image questions)."""
        ip = getattr(self.processor, "image_processor", None)
        size, frames = getattr(ip, "patch_size", None), getattr(ip, "temporal_patch_size", None)
        if not (isinstance(size, int) and isinstance(frames, int)):
            return {}
        return {"pixel_values": torch.zeros((n, 0, 3 * frames * size * size), device=self.device),
                "image_grid_thw": torch.zeros((n, 0, 3), dtype=torch.long, device=self.device)}

    # ------------------------------------------------------------------ training forward

    def logprobs(self, batch: RolloutBatch, entropy: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """[N, T] log-probs of the completion tokens under the current weights (with grad), on
        the model's device (a batch from elsewhere, e.g. over the wire, is moved there); with
        `entropy`, also each position's entropy [N, T]."""
        d = self._left_align(self.on_device(batch.data))
        mask = batch.mask.to(self.device)
        prompt, completion = d["prompt_ids"], d["completion_ids"]
        _p, t = prompt.shape[1], completion.shape[1]
        present = d.get("completion_attention", mask)  # a fixed prefix is attended, not trained
        attn = torch.cat([d["prompt_mask"], present.to(d["prompt_mask"].dtype)], dim=1)
        ids = torch.cat([prompt, completion], dim=1).masked_fill(attn == 0, self.pad_id)
        kwargs: dict[str, Any] = self._image_inputs(d, len(batch)) if "pixel_values" in d else {}
        for k, v in d.items():
            if k.startswith("prompt/"):  # completion side: the rollout's values (tool images), else 0
                side = d.get("completion/" + k[len("prompt/"):], v.new_zeros((len(batch), t)))
                kwargs[k[len("prompt/"):]] = torch.cat([v, side.to(v.dtype)], dim=1)
        out = self.model(input_ids=ids, attention_mask=attn, use_cache=False, logits_to_keep=t + 1, **kwargs)
        logits = out.logits[:, :-1]  # [N, T, V]: positions P-1 .. P+T-2
        logp = token_logprobs(logits, completion, self.temperature, banned=self.banned_ids, chunk=self.logprob_chunk)
        logp = logp.masked_fill(~mask, 0.0)
        if not entropy:
            return logp
        return logp, token_entropy(logits, self.temperature, banned=self.banned_ids,
                                   chunk=self.logprob_chunk or max(1, logits.shape[1]))

    def _image_inputs(self, d: dict[str, Tensor], n: int) -> dict[str, Any]:
        """The model's image inputs for n rows. The G samples of a group carry the same images,
        so where the model takes encoded images (`mm_encoder_outputs`: the Qwen-VL families)
        each run of identical rows is encoded once and its features shared: the same forward
        and gradient (the shared features sum their rows' gradients) with 1/G of the vision
        tower's work."""
        grid = d["image_grid_thw"]
        per_image = grid.prod(-1)  # [N, images]; 0 = padding
        counts = per_image.sum(-1).tolist()  # one device sync for every row's patch count
        rows = [d["pixel_values"][i, : int(counts[i])] for i in range(n)]
        grids = [grid[i][per_image[i] > 0] for i in range(n)]
        flat_grid = grid[per_image > 0]
        if not len(flat_grid):  # no row has an image: a text-only part of a mixed batch
            return {}
        first = _repeated_rows(rows, grids) if self._takes_encoded_images else list(range(n))
        if len(set(first)) == n:  # nothing to share, or a model that only takes pixels
            return {"pixel_values": torch.cat(rows), "image_grid_thw": flat_grid}
        keep = sorted(set(first))
        encoded = self.model.get_image_features(
            torch.cat([rows[i] for i in keep]), torch.cat([grids[i] for i in keep]), return_dict=True
        )
        start, offset = {}, 0  # row kept -> index of its first image among the encoded ones
        for i in keep:
            start[i], offset = offset, offset + len(grids[i])
        order = [start[first[i]] + j for i in range(n) for j in range(len(grids[i]))]
        encoded.pooler_output = tuple(encoded.pooler_output[j] for j in order)
        if getattr(encoded, "deepstack_features", None):  # Qwen3-VL: features for some LM layers too
            encoded.deepstack_features = [tuple(f[j] for j in order) for f in encoded.deepstack_features]
        return {"mm_encoder_outputs": {"image": encoded}, "image_grid_thw": flat_grid}

    @torch.no_grad()
    def _shared_image_inputs(self, inputs: dict[str, Tensor], rows: dict[str, Tensor]) -> dict[str, Tensor]:
        """generate's inputs with each group's images encoded once (as in `_image_inputs`; `rows`:
        the batch's per-row vision data, `_prompt_rows`), where the model takes encoded images;
        generate then skips its own encoding of every row."""
        if "pixel_values" not in inputs or not self._takes_encoded_images:
            return inputs
        shared = self._image_inputs(rows, len(rows["pixel_values"]))
        if "mm_encoder_outputs" not in shared:
            return inputs
        return {**{k: v for k, v in inputs.items() if k != "pixel_values"},
                "mm_encoder_outputs": shared["mm_encoder_outputs"]}

    def check_sharded(self, prompts) -> None:
        """optim.fsdp: the sharded vision tower's blocks gather their weights in every rank's
        forward alike, so a training prompt without an image (a rank's micro-batch that skips the
        tower while another's runs it) would stall the ranks: refused."""
        bare = sum(1 for p in prompts if not getattr(p, "images", None))
        if bare:
            raise ConfigError(f"optim.fsdp: {bare} of {len(prompts)} training prompts have no image; with the "
                              "vision tower sharded every training prompt needs one (or set optim.fsdp=false)")

    @property
    def _takes_encoded_images(self) -> bool:
        from mmrl.core.fsdp import is_sharded

        base = self.model.get_base_model() if self.is_lora else self.model
        if is_sharded(base):  # sharded (optim.fsdp): the vision tower's weights are only
            return False      # whole inside the model's own forward, which encodes the pixels
        return (getattr(base.config, "model_type", None) in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
                and "mm_encoder_outputs" in inspect.signature(base.forward).parameters)

    def sft_loss(self, batch: RolloutBatch) -> Tensor:
        """Mean negative log-likelihood of the batch's trained tokens (supervised fine-tuning
        on teacher batches; the scripts that build the bundled tiny VLMs)."""
        logp = self.logprobs(batch)
        mask = batch.mask.to(logp.device)
        return -(logp * mask).sum() / mask.sum()

    @torch.no_grad()
    def rescore(self, batch: RolloutBatch, pixel_values: Tensor) -> Tensor:
        """[N, T] log-probs of the batch's own completions with its images replaced by
        `pixel_values` (an intervened copy, mmrl.vlm.interventions): teacher-forced, no grad,
        one extra pass (VPPO's visual dependency, PACG's persistence)."""
        data = dict(batch.data)
        data["pixel_values"] = pixel_values
        return self.logprobs(replace(batch, data=data))

    @staticmethod
    def _left_align(data: dict[str, Tensor]) -> dict[str, Tensor]:
        """Move padding that concat appended after a prompt back in front of it, so the
        last prompt column is every row's real last prompt token (it predicts the first
        completion token)."""
        mask = data["prompt_mask"]
        p = mask.shape[1]
        trailing = (mask.flip(-1).cumsum(-1) == 0).sum(-1)  # [N] padding after the prompt
        if not bool(trailing.any()):
            return data
        idx = (torch.arange(p, device=mask.device)[None] - trailing[:, None]) % p  # roll each row right
        out = dict(data)
        for k in ("prompt_ids", "prompt_mask", *[k for k in data if k.startswith("prompt/")]):
            out[k] = data[k].gather(1, idx)
        return out

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def greedy(self, items: Sequence[Any], max_new_tokens: int, batch_size: int = 64,
               stop: Sequence[str] | None = None) -> list[str]:
        return [s.completion for b in self.greedy_batches(items, max_new_tokens, batch_size, stop) for s in b.samples]

    @torch.no_grad()
    def greedy_batches(self, items: Sequence[Any], max_new_tokens: int, batch_size: int = 64,
                       stop: Sequence[str] | None = None) -> list[RolloutBatch]:
        """Greedy decodes as batches (samples and rollout stats, e.g. tool calls), batch_size items
        each; `stop`: stop strings, as rollout.stop ends the training rollouts."""
        out: list[RolloutBatch] = []
        for start in range(0, len(items), batch_size):
            chunk = items[start: start + batch_size]
            if self.agent is not None:
                settings = SimpleNamespace(max_new_tokens=max_new_tokens, stop=stop)
                out.append(self.agent.run(chunk, settings, None, greedy=True))
                continue
            enc = self.encode(chunk)
            self._check_length(enc, chunk, max_new_tokens)
            seqs = self.model.generate(
                **enc, do_sample=False, max_new_tokens=max_new_tokens,
                eos_token_id=self.eos_id, pad_token_id=self.pad_id, suppress_tokens=self.banned_ids or None,
                **self._stop_kwargs(stop), **self._plain_sampling(), synced_gpus=False,  # as in generate
            )
            completion = seqs[:, enc["input_ids"].shape[1]:]
            mask = self.completion_mask(completion, trailing_pads=bool(stop))
            texts = self.decode(completion, mask)
            out.append(RolloutBatch(group_ids=torch.arange(len(chunk)), samples=[
                to_sample(it, x, k) for it, x, k in zip(chunk, texts, mask.sum(-1).tolist())]))
        return out

    # ------------------------------------------------------------------ weights

    @property
    def is_lora(self) -> bool:
        return is_lora(self.model)

    def save_pretrained(self, path: str | Path) -> None:
        """from_pretrained layout; with LoRA, the adapter (adapter_model.safetensors) only. The
        processor keeps images within the run's model.min_pixels / max_pixels (saved_processor)."""
        self.model.save_pretrained(path)
        self.saved_processor().save_pretrained(path)

    def saved_processor(self):
        """The processor as a checkpoint or export holds it: its image size bounds set to the
        run's model.min_pixels / max_pixels (qwen-vl-utils' defaults at the model's patch where
        unset), the bounds every image the run saw was resized within and then cut as it was
        (encode: do_resize=False). A plain AutoProcessor or vLLM given an original image then
        resizes it to the run's grid, and one the run resized keeps its size; the base's own
        bounds (a released Qwen3-VL's shortest_edge: 65536 px) would show them other pixels.
        A copy: the run's own is left as is."""
        image = getattr(self.processor, "image_processor", None)
        size = dict(getattr(image, "size", None) or {})
        if not ("shortest_edge" in size and "longest_edge" in size):  # not Qwen-VL's bounds in pixels
            return self.processor
        factor = 2 * self.patch_size  # qwen-vl-utils' defaults: 4 .. 16384 tokens of factor^2 px
        bounds = {"shortest_edge": self.min_pixels or 4 * factor**2,
                  "longest_edge": self.max_pixels or 16384 * factor**2}
        if all(size[k] == v for k, v in bounds.items()):
            return self.processor
        processor = copy.copy(self.processor)  # the tokenizer shared, the image processor its own
        processor.image_processor = copy.deepcopy(image)
        processor.image_processor.size = bounds
        return processor

    def export_pretrained(self, path: str | Path) -> None:
        """A standalone from_pretrained directory (weights and processor): under LoRA the adapters
        merged into the base weights, in place (the policy's last use: `export`). The processor
        is saved_processor(), and its image and video processors are also written on their own
        (preprocessor_config.json, video_preprocessor_config.json), as tools built on
        transformers 4 look them up."""
        self.model = merge_lora(self.model)
        self.save_pretrained(path)
        processor = self.saved_processor()
        for part in ("image_processor", "video_processor"):
            if getattr(processor, part, None) is not None:
                getattr(processor, part).save_pretrained(path)

    def load_weights(self, path: str | Path) -> None:
        load_model_weights(self.model, path)

    def reference(self) -> VLMPolicy | _AdaptersOff:
        """The KL reference, the starting weights. Under LoRA that is this policy with its
        adapters off (they start at zero), so no second copy of the base model is kept."""
        return _AdaptersOff(self) if self.is_lora else self.rollout_copy()

    def rollout_copy(self) -> VLMPolicy:
        """A frozen copy of the current weights, adapters included: a pipelined engine's own
        (mmrl.core.engine.PolicyEngine) or a scorer of old log-probs; publish loads new ones."""
        ref = copy.copy(self)
        ref.model = copy.deepcopy(self.model).requires_grad_(False)
        if self.agent is not None:  # the copy's tool rollouts must sample with the copy's weights
            from mmrl.vlm.agent import ToolRollout

            ref.agent = ToolRollout(ref, self.agent.registry, self.tools_cfg)
        return ref


class _AdaptersOff:
    """The KL reference under LoRA: the policy's own model with its adapters disabled."""

    def __init__(self, policy: VLMPolicy):
        self.policy, self.model = policy, policy.model

    def logprobs(self, batch: RolloutBatch) -> Tensor:
        with torch.no_grad(), self.model.disable_adapter():
            return self.policy.logprobs(batch)


def _prepend(fixed: list[list[int]], t: Tensor, head, pad) -> Tensor:
    """Row i becomes head(fixed[i]) + t[i], right-padded with `pad` to a common width."""
    width = max(len(f) for f in fixed) + t.shape[1]
    out = torch.full((t.shape[0], width), pad, dtype=t.dtype, device=t.device)
    for i, f in enumerate(fixed):
        k = len(f)
        if k:
            out[i, :k] = torch.tensor(head(f), dtype=t.dtype, device=t.device)
        out[i, k: k + t.shape[1]] = t[i]
    return out


def _repeated_rows(rows: list[Tensor], grids: list[Tensor]) -> list[int]:
    """For each row, the first row of the run of consecutive rows with exactly its images
    (a group's samples are consecutive)."""
    first = []
    for i in range(len(rows)):
        j = first[-1] if i else None
        same = (j is not None and grids[i].shape == grids[j].shape and torch.equal(grids[i], grids[j])
                and rows[i].shape == rows[j].shape and torch.equal(rows[i], rows[j]))
        first.append(j if same else i)
    return first


DEFAULT_PATCH_SIZE = 14  # qwen-vl-utils' image_patch_size default: Qwen2/2.5-VL's patch


def image_patch_size(processor) -> int:
    """The patch side in pixels of the processor's images (image_processor.patch_size: 14 for
    Qwen2/2.5-VL, 16 for Qwen3-VL), which qwen-vl-utils' resize must be given; its own default
    where the processor names none."""
    return patch_or_default(getattr(getattr(processor, "image_processor", None), "patch_size", None))


def patch_or_default(size: Any) -> int:
    """A processor's patch_size as qwen-vl-utils takes it: a positive int, else its default."""
    return size if isinstance(size, int) and size > 0 else DEFAULT_PATCH_SIZE


def resize_for_model(images: Sequence[Any], min_pixels: int | None, max_pixels: int | None, *,
                     patch_size: int = DEFAULT_PATCH_SIZE) -> list:
    """`images` as a prompt's reach the model: in RGB (`_rgb`), resized by qwen-vl-utils within
    min/max pixels to multiples of 2 x `patch_size` (the model's: image_patch_size), as
    messages() asks it. No policy needed: the jsonl task keeps each image at this size from the
    start (mmrl.vlm.backend.model_view)."""
    from qwen_vl_utils import process_vision_info

    parts = [{"type": "image", "image": _rgb(im), **({"min_pixels": min_pixels} if min_pixels else {}),
              **({"max_pixels": max_pixels} if max_pixels else {})} for im in images]
    found, _ = process_vision_info([{"role": "user", "content": parts}], image_patch_size=patch_size)
    return found


def _rgb(image: Any) -> Any:
    """A PIL image in 8-bit RGB (mmrl.vlm.tasks.jsonl.to_rgb), as a dataset's images are
    loaded: qwen-vl-utils' own convert("RGB") clips a 16-bit image (a tool's depth map, a
    Python item's scan) to white and drops an LA or P image's transparency to black. An RGB
    image goes as it is unless it has a transparency colour or an EXIF rotation (a photo
    opened with Image.open in Python): qwen-vl-utils would show it sideways. A dataset's
    images, loaded by to_rgb, have neither, so they are not copied at every rollout."""
    from PIL import Image

    from mmrl.vlm.tasks.jsonl import to_rgb

    if not isinstance(image, Image.Image):
        return image
    rotated = image.getexif().get(0x0112, 1) != 1  # the Orientation tag; parsed once per image
    return to_rgb(image) if image.mode != "RGB" or "transparency" in image.info or rotated else image


def has_images(data: dict[str, Tensor]) -> bool:
    """Whether any row of a batch's data (the layout above) carries an image."""
    grid = data.get("image_grid_thw")
    return grid is not None and bool(grid.prod(-1).any())


def to_sample(item, completion: str, tokens: int | None = None) -> Sample:
    """What reward atoms see of a question-answer item and one completion; `tokens`, the
    completion's length in tokens where the caller knows it (meta["completion_tokens"], what
    DAPO's overlong atom reads)."""
    meta = {**item.meta, "answer": item.answer}
    if tokens is not None:
        meta[LENGTH_KEY] = int(tokens)
    return Sample(prompt=item.question, completion=completion, meta=meta)


def _per_token(key: str, value: Any, enc) -> bool:
    """Processor outputs aligned with input_ids besides ids and mask (e.g. mm_token_type_ids)."""
    return (
        key not in ("input_ids", "attention_mask")
        and torch.is_tensor(value)
        and value.shape == enc["input_ids"].shape
    )
