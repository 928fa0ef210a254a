"""Multi-turn tool rollouts: generate until a tool call or the end, run the tool, append its
observation, continue (AXPO's environment loop; docs/methods.md section 2).

One rollout's completion is one token row in Qwen's chat format:

    <model tokens ...><tool_call>{"name": ..., "arguments": {...}}</tool_call>        mask True
    <|im_end|>\\n<|im_start|>user\\n<tool_response>\\n OBSERVATION \\n</tool_response>
    <|im_end|>\\n<|im_start|>assistant\\n                                              mask False
    <model tokens ...><|im_end|>                                                     mask True

OBSERVATION is the tool's text, or its image as <|vision_start|><|image_pad|>*k<|vision_end|>
expanded by the processor. Observation tokens are attended (completion_attention) but carry
no loss (mask False, old log-prob 0). Each turn's old log-probs come from that turn's
generation logits, computed on the whole context so far, so they are exact. A turn ends at
end-of-turn, at `</tool_call>` (a single token in Qwen vocabularies, so it is an extra stop
id) or at rollout.max_new_tokens (the rollout is then truncated).

Bad tool calls never stop a run: a malformed call (a turn that ends inside an unclosed
<tool_call> is one), an unknown tool, wrong arguments, a tool that raises or outlasts its
timeout all come back as an observation "error: ..." and the rollout goes on; they are
counted (data["stat/tool_errors"]). A call that rollout.max_new_tokens cuts off is counted as a
call and an error, and in data["stat/tool_cut"] (rollout/tool_cut: the turn budget is too short
for the model's calls), as is one that a stop string ends (warned about once); a cut call's
tokens are in call_mask and first_call, as a closed call's. Where the tool itself fails (it
raises, outlasts its timeout, returns what cannot be shown) the count is also
data["stat/tool_failures"], and a warning quotes the first failure of each tool and kind.
Limits: tools.max_turns model turns and tools.max_tool_calls calls per rollout; a call past
the limit gets an error observation instead of running, and a call in the last turn is
counted but not run (settings that let no tool run, max_turns 1, max_tool_calls 0 or a
rollout.max_new_tokens shorter than any call, are warned about once). An observation's text
stays text (special tokens it quotes, e.g. <|image_pad|>, are broken by a word joiner) and is
cut at tools.max_observation_tokens (a tool failure, too_long).

Extra data of a tool batch (beside VLMPolicy.generate's layout):
    data["call_mask"]           [N, T] bool  tokens of the model's tool calls (<tool_call> .. </tool_call>)
    data["first_call"]          [N] long     position of the first <tool_call> token, -1 if none
    data["completion/<key>"]    [N, T]       per-token processor outputs on the completion side
                                             (mm_token_type_ids: 1 on observation image tokens)
    data["stat/tool_calls"], ["stat/tool_errors"], ["stat/tool_failures"], ["stat/tool_cut"],
        ["stat/turns"], ["stat/called"]   [N]
Each sample's meta gets "tool_calls" and "tool_errors" (reward atoms may use them).
As VLMPolicy.generate's, the batch's tensors are on the model's device and group_ids on the CPU;
a turn's tokens, log-probs and entropies come back to Python lists (the rows grow there).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from mmrl.core.batch import RolloutBatch
from mmrl.core.config import ConfigError
from mmrl.core.device import fork_rng
from mmrl.vlm.policy import _per_token, mean_over, sampling_kwargs, scores_by_forward, to_sample
from mmrl.vlm.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolContext, ToolRegistry

TOOL_FAILURES = ("raised", "timeout", "bad_result", "bad_image", "too_long")  # the tool failed, not the model's call

_END = "<|im_end|>"
_OBS_OPEN = _END + "\n<|im_start|>user\n<tool_response>\n"
_OBS_CLOSE = "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
_TYPE_IDS = {"<|image_pad|>": 1, "<|video_pad|>": 2}  # mm_token_type_ids of vision placeholders
# Characters of a tool's text tokenised, beyond 32 per token of the budget: tokenising a text of
# megabytes takes seconds per call (10 MB: 24 s), and all but the budget's start is cut anyway.
_TOKENIZED_CHARS = 100_000


@dataclass
class _Row:
    """One rollout in progress: its completion so far and its observation images."""

    item: Any
    ids: list[int] = field(default_factory=list)
    train: list[bool] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    pixels: list[Tensor] = field(default_factory=list)  # observation images' patch rows
    grids: list[Tensor] = field(default_factory=list)  # their [1, 3] grids
    call_spans: list[tuple[int, int]] = field(default_factory=list)
    calls: int = 0
    errors: Counter = field(default_factory=Counter)
    turns: int = 0
    turn_start: int = 0  # where the model's current turn began (a fixed prefix is part of the first)
    room: float = float("inf")  # tokens the completion may hold: the model's context less the prompt
    done: bool = False
    truncated: bool = False


class ToolRollout:
    """The environment loop over a VLMPolicy and a ToolRegistry.

    `cfg` is the rollout's tools section (max_turns, max_tool_calls)."""

    def __init__(self, policy, registry: ToolRegistry, cfg):
        self.policy = policy
        self.registry = registry
        self.warned: set[tuple[str | None, str]] = set()  # (tool, kind) failures already warned about
        self.checked: set[tuple] = set()  # settings checks done: ("limits",), ("budget", max_new_tokens)
        self.cfg = cfg
        tok = policy.tokenizer
        # The loop writes Qwen's chat format and stops a turn at the closing tag's token: in a
        # vocabulary where these are several tokens, every call would pass as plain text, unrun.
        ids = {t: _single_id(tok, t) for t in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, _END)}
        if split := [t for t, i in ids.items() if i is None]:
            raise ConfigError(
                f"rollout.tools: tool rollouts write Qwen's chat format, whose {', '.join(split)} must each be "
                f"one token of the tokenizer; {type(tok).__name__} of this model splits them (as Qwen2-VL, "
                "Qwen2.5-VL and Qwen3-VL do not). Use a Qwen-VL model, or add them to the tokenizer "
                "(tokenizer.add_tokens, model.resize_token_embeddings) and save both, or leave rollout.tools unset")
        self.open_id, self.close_id = ids[TOOL_CALL_OPEN], ids[TOOL_CALL_CLOSE]
        self.stop_ids = [policy.eos_id, self.close_id]
        self.type_ids = {i: v for t, v in _TYPE_IDS.items() if (i := _single_id(tok, t)) is not None}
        # the tokenizer's special tokens (<|im_end|>, <|image_pad|>, ...; not <tool_call>, which Qwen's
        # vocabulary adds as an ordinary token), longest first
        self.markup = sorted({a.content for a in tok.added_tokens_decoder.values() if a.special and len(a.content) > 1},
                             key=len, reverse=True)

    # ------------------------------------------------------------------ the loop

    def run(self, items: Sequence[Any], rollout, generator: torch.Generator | None,
            prefixes: list[list[int]] | None = None, greedy: bool = False) -> RolloutBatch:
        """One rollout per item (repeat items for G per prompt); `prefixes`: fixed completion
        starts (no loss). Sampling draws only from `generator` (None with greedy)."""
        pol = self.policy
        self._check_limits()
        self._check_budget(rollout)
        enc = pol.encode(items)
        prefixes = prefixes or [[] for _ in items]
        pol._check_length(enc, items, rollout.max_new_tokens + max(map(len, prefixes), default=0))
        prompt = self._prompt_parts(enc, items)
        rows = [_Row(item, ids=list(f), train=[False] * len(f), logp=[0.0] * len(f), entropy=[0.0] * len(f),
                     room=self._room(p)) for item, f, p in zip(items, prefixes, prompt)]
        for _ in range(self.cfg.max_turns):
            for r in rows:  # a turn that could outgrow the context is not started
                if not r.done and len(r.ids) + rollout.max_new_tokens > r.room:
                    r.done = r.truncated = True
            active = [i for i, r in enumerate(rows) if not r.done]
            if not active:
                break
            if greedy:
                seed = None
            elif isinstance(generator, list):  # one per row (VLMPolicy.generate): the active rows' own
                seed = [generator[i] for i in active]
            else:
                seed = int(torch.randint(0, 2**62, (1,), generator=generator))  # CPU generator
            new, logp, ent = self._generate(prompt, rows, active, rollout, seed, greedy)
            for k, i in enumerate(active):
                self._take_turn(rows[i], new[k], logp[k], ent[k], rollout)
        for r in rows:
            if not r.done:  # out of turns in the middle of a tool exchange
                r.truncated = r.done = True
        batch = self._batch(enc, items, rows, prompt)
        if _scored_by_forward(rollout, greedy):  # the whole transcript, teacher-forced
            pol.score_old_logprobs(batch, rollout.score_batch_size)
        return batch

    def teacher(self, items: Sequence[Any], turns: Sequence[Sequence[str]]) -> RolloutBatch:
        """Rollouts whose model turns are given as text (tool-use demonstrations for supervised
        fine-tuning, or fixed transcripts to score): a turn that ends with a tool call gets the
        tool's real observation; the last turn gets end-of-turn. Old log-probs are 0.
        A last turn may end with a call only at tools.max_turns, where a rollout's would stop
        (truncated, the call counted, not run, no end-of-turn after a closed one); before it,
        an observation and another turn would follow, so such a transcript is refused."""
        if len(turns) != len(items):
            raise ValueError(f"{len(turns)} transcripts for {len(items)} items")
        tok = self.policy.tokenizer
        enc = self.policy.encode(items)
        prompt = self._prompt_parts(enc, items)
        rows = [_Row(item, room=self._room(p)) for item, p in zip(items, prompt)]
        unlimited = SimpleNamespace(max_new_tokens=float("inf"))
        for row, texts in zip(rows, turns):
            if len(texts) > self.cfg.max_turns:
                raise ValueError(f"a transcript of {len(texts)} turns; tools.max_turns is {self.cfg.max_turns}")
            for j, text in enumerate(texts):
                ids = tok(text, add_special_tokens=False)["input_ids"]
                if j == len(texts) - 1:
                    self._check_last_turn(ids, j, len(texts))
                    ids += [] if ids and ids[-1] == self.close_id else [self.policy.eos_id]
                self._take_turn(row, ids, [0.0] * len(ids), [0.0] * len(ids), unlimited)
                if row.truncated and j < len(texts) - 1:
                    raise ValueError(f"turn {j + 1} of {len(texts)}: its tool's observation would take the transcript "
                                     f"past the model's context of {self.policy.max_context} tokens")
                if row.done and j < len(texts) - 1:
                    raise ValueError(f"turn {j + 1} of {len(texts)} ({text[-60:]!r}) does not end with a tool call "
                                     f"({TOOL_CALL_CLOSE} last), so no observation follows it and the next turn "
                                     "cannot be one")
        return self._batch(enc, items, rows, prompt)

    def _check_last_turn(self, ids: list[int], j: int, n: int) -> None:
        """A demonstration's last turn (the j-th of n, 0-based) may end in a call, closed or
        not, only where no turn is left after it."""
        in_call = (bool(ids) and ids[-1] == self.close_id) or self._last_call_tag(ids)[1]
        if in_call and j + 1 < self.cfg.max_turns:
            raise ValueError(f"turn {j + 1} of {n}, the last, ends with a tool call: a rollout would get its "
                             f"observation and another turn (tools.max_turns is {self.cfg.max_turns}), so the "
                             "transcript cannot end there; end it with an answer")

    def _last_call_tag(self, turn: list[int]) -> tuple[int | None, bool]:
        """Where the turn's last call opening tag is (None: it has none), and whether no closing
        tag follows it (the turn is left inside that call)."""
        opened = [i for i, t in enumerate(turn) if t == self.open_id]
        last = opened[-1] if opened else None
        return last, last is not None and self.close_id not in turn[last:]

    def _room(self, prompt: dict) -> float:
        """Tokens a rollout's completion may hold: the model's context less its prompt."""
        context = self.policy.max_context
        return context - len(prompt["ids"]) if context else float("inf")

    def _take_turn(self, row: _Row, new: list[int], logp: list[float], ent: list[float], rollout) -> None:
        row.turns += 1
        start = len(row.ids)
        row.ids += new
        row.train += [True] * len(new)
        row.logp += logp
        row.entropy += ent
        if not new or new[-1] not in self.stop_ids:  # a stop string or the token budget ended it
            row.done, row.truncated = True, len(new) >= rollout.max_new_tokens
            last_open, left_open = self._last_call_tag(row.ids[row.turn_start:])
            if left_open:
                # the budget or a stop string ended the turn inside a call: a call made, not run,
                # counted (as "cut") so that settings that cut the model's calls show in the tool
                # metrics; its tokens are a call's (call_mask, first_call), as stat/called says
                row.calls += 1
                row.errors["cut"] += 1
                row.call_spans.append((row.turn_start + last_open, len(row.ids)))
                if not row.truncated and getattr(rollout, "stop", None):  # (teacher() has no stop strings)
                    self._warn_stop_in_call(rollout.stop)
            return
        # the whole turn: a fixed prefix may hold the call's opening tag (AXPO's force_call)
        turn = row.ids[row.turn_start:]
        last_open, left_open = self._last_call_tag(turn)
        unclosed = new[-1] != self.close_id and left_open
        if new[-1] != self.close_id and not unclosed:
            row.done = True
            return
        end = len(row.ids) - 1 if unclosed else len(row.ids)  # an unclosed call's span stops before <|im_end|>
        row.call_spans.append((row.turn_start + last_open if last_open is not None else start, end))
        text = self.policy.tokenizer.decode(turn, skip_special_tokens=False)
        if row.turns >= self.cfg.max_turns:  # no turn left to read an observation: a call made, not run
            row.calls += 1
            if unclosed:
                row.errors["malformed"] += 1
            row.done = row.truncated = True
            return
        name = None  # the tool's, where one ran
        if unclosed:  # ended its turn inside a call: malformed, and the model is told so
            content, kind = [f"error: the tool call was not closed with {TOOL_CALL_CLOSE}"], "malformed"
        elif row.calls >= self.cfg.max_tool_calls:
            content, kind = [f"error: at most {self.cfg.max_tool_calls} tool calls per answer"], "limit"
        else:
            item = row.item
            result = self.registry.call(text, lambda: ToolContext(images=_tool_images(item), meta=dict(item.meta)))
            content, kind, name = result.content, result.kind, result.name
            self._warn_failure(name, kind, result.error)
        row.calls += 1
        content, cut = self._literal_text(content)
        if cut and kind == "ok":
            kind = "too_long"
            self._warn_failure(name, kind, f"returned {cut} tokens of text, cut to tools.max_observation_tokens "
                                           f"{self.cfg.max_observation_tokens}", reads="reads the text up to there")
        try:
            self._observe(row, content, ended=unclosed)
        except Exception as e:  # noqa: BLE001 -- e.g. a 224x1 crop the image processor refuses
            content, kind = [f"error: the tool's image could not be shown: {e}"], "bad_image"
            self._warn_failure(None, kind, content[0].removeprefix("error: "))
            self._observe(row, content)
        if kind != "ok":
            row.errors[kind] += 1

    def _literal_text(self, content: list) -> tuple[list, str]:
        """The content's text as text: markup it quotes (an unknown tool's name echoed back, a
        tool's own output) must not become the chat format's special tokens (an <|image_pad|>
        with no image crashes the next turn), so a zero-width word joiner goes after each such
        string's first character. Text past tools.max_observation_tokens in all is cut, and the
        number of tokens it had comes back as text ("" if none was cut; "more than N" where a
        text past _TOKENIZED_CHARS was cut unread)."""
        tok, budget, total, out = self.policy.tokenizer, self.cfg.max_observation_tokens, 0, []
        limit, unread = _TOKENIZED_CHARS + 32 * budget, False
        for part in content:
            if not isinstance(part, str):
                out.append(part)
                continue
            rest = max(len(part) - limit, 0)
            part = part[:limit]
            for m in self.markup:
                part = part.replace(m, m[0] + "\u2060" + m[1:])
            ids = tok(part, add_special_tokens=False, verbose=False)["input_ids"]  # no "longer than the model" note
            total += len(ids)
            if len(ids) > budget or rest:
                more = [f"{len(ids) - budget} more tokens"] if len(ids) > budget else []
                more += [f"{rest} more characters"] if rest else []
                part = tok.decode(ids[:budget]) + f" ... [cut: {' and '.join(more)}]"
                unread = unread or bool(rest)
            budget = max(budget - len(ids), 0)
            out.append(part)
        if unread:
            return out, f"more than {total}"
        return out, str(total) if total > self.cfg.max_observation_tokens else ""

    def _warn_failure(self, name: str | None, kind: str, error: str | None,
                      reads: str = "reads it as an error observation") -> None:
        """A tool's own failure is said once per tool and kind (the model's mistakes are not:
        they are what RL trains away); every one is counted in stat/tool_failures."""
        if kind in TOOL_FAILURES and (name, kind) not in self.warned:
            self.warned.add((name, kind))
            warnings.warn(f"tool {name or '(observation)'}: {error} (the rollout {reads}; "
                          "counted in rollout/tool_failures; said once per tool and kind)", stacklevel=2)

    def _warn_stop_in_call(self, stop) -> None:
        """Said once: a stop string that ends turns inside tool calls keeps the tools from running."""
        if ("stop_in_call",) not in self.checked:
            self.checked.add(("stop_in_call",))
            warnings.warn(f"rollout.stop {list(stop)!r}: a stop string ended a turn inside a tool call, "
                          "so the call did not run (counted in rollout/tool_cut; said once); use stop strings "
                          "that a tool call cannot hold", stacklevel=3)

    def _check_limits(self) -> None:
        """Warn (once) where tools.max_turns or tools.max_tool_calls leave no call able to run: each
        is a valid setting (an ablation that counts calls), but also what max_turns 1, read as "one
        round of tool use", gives without a word: a rollout whose tools never run."""
        if ("limits",) in self.checked:
            return
        self.checked.add(("limits",))
        why = ("tools.max_turns is 1: a call ends the rollout, with no turn left to read its observation"
               if self.cfg.max_turns < 2 else
               "tools.max_tool_calls is 0: every call gets an error observation" if self.cfg.max_tool_calls < 1 else None)
        if why and len(self.registry):
            warnings.warn(f"{why}, so no tool ever runs (calls are counted); for one call and an answer after "
                          "its observation, set max_turns: 2 and max_tool_calls: 1", stacklevel=3)

    def _check_budget(self, rollout) -> None:
        """Warn (once) where rollout.max_new_tokens is shorter than the shortest call a model could
        write: every call would be cut before its closing tag and no tool would ever run, which
        showed only as a tool-call rate of 0 and every rollout truncated."""
        if not len(self.registry) or ("budget", rollout.max_new_tokens) in self.checked:
            return
        self.checked.add(("budget", rollout.max_new_tokens))
        tok = self.policy.tokenizer
        calls = (f'{TOOL_CALL_OPEN}\n{{"name": "{n}", "arguments": {{}}}}\n{TOOL_CALL_CLOSE}' for n in self.registry.names())
        need, shortest = min((len(tok(c, add_special_tokens=False)["input_ids"]), c) for c in calls)
        if rollout.max_new_tokens < need:
            warnings.warn(f"rollout.max_new_tokens ({rollout.max_new_tokens}), each turn's budget, is shorter than "
                          f"the shortest tool call ({need} tokens: {shortest!r}): every call is cut before its "
                          "end and not run, and its rollout truncated; raise rollout.max_new_tokens",
                          stacklevel=3)

    def _observe(self, row: _Row, content: list, ended: bool = False) -> None:
        """Append the observation tokens (and images) of one tool result; `ended`: the model's
        turn already ends with end-of-turn, so the observation does not repeat it. An observation
        that would take the row past the model's context is not shown: the rollout ends at the
        call, truncated (training reads the whole transcript, which must fit)."""
        pol = self.policy
        text, images = _OBS_OPEN.removeprefix(_END) if ended else _OBS_OPEN, []
        for part in content:
            if isinstance(part, str):
                text += part
            else:
                text += "<|vision_start|><|image_pad|><|vision_end|>"
                images.append(part)
        text += _OBS_CLOSE
        if images:  # processed before anything is appended: a failure leaves the row as it was
            resized = pol.resize_images(images, getattr(self.cfg, "image_max_pixels", None))
            out = pol.processor(text=[text], images=resized, return_tensors="pt", **pol.as_resized(resized))
            ids = out["input_ids"][0].tolist()
        else:
            ids = pol.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(row.ids) + len(ids) > row.room:
            row.done = row.truncated = True
            return
        if images:
            row.pixels.append(out["pixel_values"].to(pol.device))  # generate and the batch read them there
            row.grids.append(out["image_grid_thw"].to(pol.device))
        row.ids += ids
        row.train += [False] * len(ids)
        row.logp += [0.0] * len(ids)
        row.entropy += [0.0] * len(ids)
        row.turn_start = len(row.ids)

    # ------------------------------------------------------------------ one turn for the active rows

    def _prompt_parts(self, enc, items) -> list[dict]:
        """Per item: its unpadded prompt ids, per-token processor outputs, image patches and grids."""
        keep = enc["attention_mask"].bool()
        per_token = [k for k, v in enc.items() if _per_token(k, v, enc)]
        grid = enc.get("image_grid_thw")
        counts = [len(it.images) for it in items]
        patches = grid.prod(-1).tolist() if grid is not None else []
        parts, start, img = [], 0, 0
        for i, c in enumerate(counts):
            n = sum(patches[img: img + c])
            parts.append({
                "ids": enc["input_ids"][i][keep[i]],
                "tokens": {k: enc[k][i][keep[i]] for k in per_token},
                "pixels": enc["pixel_values"][start: start + n] if n else None,
                "grid": grid[img: img + c] if c else None,
            })
            start, img = start + n, img + c
        return parts

    def _generate(self, prompt, rows, active, rollout, seed, greedy):
        pol = self.policy
        device = pol.device
        seqs, token_keys = [], {}
        pixels, grids = [], []
        for i in active:
            p, r = prompt[i], rows[i]
            comp = torch.tensor(r.ids, dtype=torch.long, device=device)
            seqs.append(torch.cat([p["ids"], comp]))
            for k, v in p["tokens"].items():
                token_keys.setdefault(k, []).append(torch.cat([v, self._completion_values(k, comp, v.dtype)]))
            if p["pixels"] is not None:
                pixels.append(p["pixels"])
                grids.append(p["grid"])
            pixels += r.pixels
            grids += r.grids
        width = max(len(s) for s in seqs)
        inputs = {"input_ids": torch.full((len(seqs), width), pol.pad_id, dtype=torch.long, device=device),
                  "attention_mask": torch.zeros((len(seqs), width), dtype=torch.long, device=device)}
        for k, vs in token_keys.items():
            inputs[k] = torch.zeros((len(seqs), width), dtype=vs[0].dtype, device=device)
        for j, s in enumerate(seqs):  # left padding
            inputs["input_ids"][j, width - len(s):] = s
            inputs["attention_mask"][j, width - len(s):] = 1
            for k, vs in token_keys.items():
                inputs[k][j, width - len(s):] = vs[j]
        if pixels:
            inputs["pixel_values"] = torch.cat(pixels)
            inputs["image_grid_thw"] = torch.cat(grids)
        rowwise = isinstance(seed, list)  # a generator per row, or a seed for generate's own draw
        sampling = {"do_sample": False} if greedy else sampling_kwargs(rollout, seed if rowwise else None, device)
        with fork_rng(pol.model), torch.no_grad():
            if seed is not None and not rowwise:
                torch.manual_seed(seed)
            out = pol.model.generate(
                **inputs, **sampling, max_new_tokens=rollout.max_new_tokens, return_dict_in_generate=True,
                output_logits=not _scored_by_forward(rollout, greedy), eos_token_id=self.stop_ids, pad_token_id=pol.pad_id,
                suppress_tokens=pol.banned_ids or None, **pol._stop_kwargs(getattr(rollout, "stop", None)),
                **pol._plain_sampling(),
                synced_gpus=False,  # ranks decode on their own, under optim.fsdp too (VLMPolicy.generate)
            )
        new = out.sequences[:, width:]  # [A, t]
        temperature = 1.0 if greedy else rollout.temperature
        if _scored_by_forward(rollout, greedy):  # run() scores the whole transcripts afterwards
            logp = ent = torch.zeros(new.shape)
        else:
            logp, ent = pol.token_stats(out.logits, new, temperature)
        new, logp, ent = new.cpu(), logp.cpu(), ent.cpu()  # to the rows' Python lists: one copy each
        lengths = _turn_lengths(new, self.stop_ids, pol.pad_id, trailing_pads=bool(getattr(rollout, "stop", None)))
        return ([new[j, :n].tolist() for j, n in enumerate(lengths)],
                [logp[j, :n].tolist() for j, n in enumerate(lengths)],
                [ent[j, :n].tolist() for j, n in enumerate(lengths)])

    def _completion_values(self, key: str, comp: Tensor, dtype) -> Tensor:
        """A per-token processor output on completion tokens: vision placeholders typed, text 0."""
        out = torch.zeros(len(comp), dtype=dtype, device=comp.device)
        if key == "mm_token_type_ids":
            for tid, v in self.type_ids.items():
                out[comp == tid] = v
        return out

    # ------------------------------------------------------------------ the batch

    def _batch(self, enc, items, rows: list[_Row], prompt: list[dict]) -> RolloutBatch:
        pol = self.policy
        n, t = len(rows), max(1, max(len(r.ids) for r in rows))
        # Filled from the rows' Python lists on the CPU, then moved to the model's device at once
        # (below); the texts are decoded from the CPU copy.
        completion = torch.full((n, t), pol.pad_id, dtype=torch.long)
        present = torch.zeros((n, t), dtype=torch.bool)
        mask = torch.zeros((n, t), dtype=torch.bool)
        old_logp = torch.zeros((n, t))
        entropy = torch.zeros((n, t))
        call_mask = torch.zeros((n, t), dtype=torch.bool)
        for i, r in enumerate(rows):
            k = len(r.ids)
            completion[i, :k] = torch.tensor(r.ids, dtype=torch.long)
            present[i, :k] = True
            mask[i, :k] = torch.tensor(r.train, dtype=torch.bool)
            old_logp[i, :k] = torch.tensor(r.logp)
            entropy[i, :k] = torch.tensor(r.entropy)
            for a, b in r.call_spans:
                call_mask[i, a:b] = True
        first_call = torch.tensor([r.call_spans[0][0] if r.call_spans else -1 for r in rows])
        texts = pol.decode(completion, present)
        samples = []
        for item, text, r in zip(items, texts, rows):
            s = to_sample(item, text, sum(r.train))  # the model's own tokens, observations excluded
            s.meta.update(tool_calls=r.calls, tool_errors=sum(r.errors.values()))
            samples.append(s)
        prompt_rows = pol._prompt_rows(enc, items)
        prompt_rows.update(self._vision_rows(prompt, rows))
        completion_keys = {f"completion/{k}": torch.stack([self._completion_values(k, c, v.dtype) for c in completion])
                           for k, v in enc.items() if _per_token(k, v, enc)}
        lengths = mask.sum(-1)
        data = pol.on_device({
            "completion_ids": completion,
            "completion_attention": present,
            **completion_keys,
            "call_mask": call_mask,
            "first_call": first_call,
            "stat/length": lengths.float(),
            "stat/entropy": mean_over(entropy, mask),
            "stat/truncated": torch.tensor([float(r.truncated) for r in rows]),
            "stat/tool_calls": torch.tensor([float(r.calls) for r in rows]),
            "stat/called": torch.tensor([float(r.calls > 0) for r in rows]),
            "stat/tool_errors": torch.tensor([float(sum(r.errors.values())) for r in rows]),
            "stat/tool_failures": torch.tensor([float(sum(r.errors[k] for k in TOOL_FAILURES)) for r in rows]),
            "stat/tool_cut": torch.tensor([float(r.errors["cut"]) for r in rows]),
            "stat/turns": torch.tensor([float(r.turns) for r in rows]),
        })
        mask = mask.to(pol.device)
        return RolloutBatch(
            group_ids=torch.arange(n),  # bookkeeping: on the CPU
            samples=samples,
            mask=mask,
            old_logp=old_logp.to(pol.device).masked_fill(~mask, 0.0),
            data={**prompt_rows, **data},
        )

    @staticmethod
    def _vision_rows(parts: list[dict], rows: list[_Row]) -> dict[str, Tensor]:
        """Each sample's image patches and grids: its prompt images, then its observation images."""
        pix = [[p["pixels"]] if p["pixels"] is not None else [] for p in parts]
        grd = [[p["grid"]] if p["grid"] is not None else [] for p in parts]
        for i, r in enumerate(rows):
            pix[i] += r.pixels
            grd[i] += r.grids
        if not any(pix):
            return {}
        first = next(x for ps in pix for x in ps)  # on the model's device, as all of them
        dim, device = first.shape[-1], first.device
        pix = [torch.cat(ps) if ps else torch.zeros((0, dim), device=device) for ps in pix]
        grd = [torch.cat(gs) if gs else torch.zeros((0, 3), dtype=torch.long, device=device) for gs in grd]
        pixel = torch.zeros((len(rows), max(len(p) for p in pix), dim), dtype=pix[0].dtype, device=device)
        thw = torch.zeros((len(rows), max(1, max(len(g) for g in grd)), 3), dtype=grd[0].dtype, device=device)
        for i, (p, g) in enumerate(zip(pix, grd)):
            pixel[i, : len(p)] = p
            thw[i, : len(g)] = g
        return {"pixel_values": pixel, "image_grid_thw": thw}


def _scored_by_forward(rollout, greedy: bool) -> bool:
    """rollout.old_logprobs forward: log-probs from a teacher-forced pass, not generate's logits
    (greedy evaluation needs none)."""
    return not greedy and scores_by_forward(rollout)


def _turn_lengths(new: Tensor, stop_ids: list[int], pad_id: int, trailing_pads: bool) -> list[int]:
    """Tokens of each row's turn: up to and including its first stop id, else (with
    `trailing_pads`: stop strings end rows early, and generate pads them) up to the last
    non-pad token, else all: a pad token the model generated (Qwen's <|endoftext|>) is its own."""
    out = []
    for row in new.tolist():
        cut = next((j + 1 for j, tok in enumerate(row) if tok in stop_ids), None)
        if cut is None:
            cut = len(row)
            while trailing_pads and cut > 0 and row[cut - 1] == pad_id:
                cut -= 1
        out.append(cut)
    return out


def _tool_images(item) -> list:
    """ctx.images of a tool call on `item`: its images at full resolution, where a jsonl task kept
    only the model's view the original decoded again (JsonlItem.full_images: held decoded for the
    whole run, 3000 12-megapixel photos were 100 GiB), and copies: a tool that draws on its image in
    place (ImageDraw) changed the task's own item, and so what every later rollout, epoch and
    evaluation of that prompt saw."""
    images = item.full_images() if hasattr(item, "full_images") else item.images
    return [im.copy() if isinstance(im, Image.Image) else im for im in images]


def _single_id(tok, text: str) -> int | None:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 else None
