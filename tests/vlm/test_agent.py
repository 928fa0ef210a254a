"""Multi-turn tool rollouts (mmrl.vlm.agent) on a tiny real Qwen2.5-VL.

The model's turns are scripted (a wrapper around the real model's forward picks the
tokens, and reports the real logits), so a test decides when the model calls a tool
and what it writes, while the log-probs, images and masks are the real thing."""

from __future__ import annotations

import json
import warnings
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mmrl.core.batch import RolloutBatch
from mmrl.core.rewards import Reward, reward_atom
from mmrl.vlm.agent import _TOKENIZED_CHARS
from mmrl.vlm.config import ToolsConfig, VLMModelConfig, VLMTrainConfig
from mmrl.vlm.models import load_vlm
from mmrl.vlm.policy import PromptTooLong, VLMPolicy
from mmrl.vlm.tasks.shapes_zoom import ShapesZoom, zoom_call
from mmrl.vlm.tools import ToolRegistry, build_registry

ITEMS = ShapesZoom(seed=0, num_train=4, num_eval=2).train_items()


def tool_call(name: str, **arguments) -> str:
    """A well-formed call in Qwen's syntax, as zoom_call writes one."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def make_policy(path, registry=None, **tools) -> VLMPolicy:
    mcfg = VLMModelConfig(path=str(path))
    model, processor = load_vlm(mcfg)
    cfg = ToolsConfig(schema_in_prompt=False, **tools)
    registry = registry if registry is not None else build_registry(["zoom", "calculator"], timeout=2.0)
    return VLMPolicy(model, processor, min_pixels=mcfg.min_pixels, max_pixels=mcfg.max_pixels,
                     tools=registry, tools_cfg=cfg)


def rollout_cfg(**kw):
    return VLMTrainConfig().rollout.model_copy(update={"max_new_tokens": 48, **kw})


class Scripted:
    """Stands in for model.generate: each call, every row still going writes the next text
    of its script (end-of-turn once the script is used up); the logits are the real
    model's on those tokens. A row goes on after a turn that ends with </tool_call>, or while
its script has turns left (an unclosed call ends its turn with end-of-turn and goes on)."""

    def __init__(self, policy, scripts: list[list[str]]):
        self.policy = policy
        tok = policy.tokenizer
        self.turns = [[tok(t, add_special_tokens=False)["input_ids"] for t in s] for s in scripts]
        self.going = list(range(len(scripts)))
        self.close = tok.convert_tokens_to_ids("</tool_call>")

    def install(self):
        self.model = self.policy.model
        self.model.generate = self

    def __call__(self, *, input_ids, attention_mask, max_new_tokens, **kw):
        pol = self.policy
        assert len(self.going) == input_ids.shape[0]
        new = [(self.turns[r].pop(0) if self.turns[r] else [pol.eos_id])[:max_new_tokens] for r in self.going]
        self.going = [r for r, t in zip(self.going, new) if t[-1] == self.close or self.turns[r]]
        seq = torch.full((len(new), max(map(len, new))), pol.pad_id, dtype=torch.long)
        for j, t in enumerate(new):
            seq[j, : len(t)] = torch.tensor(t)
        extra = {k: kw[k] for k in ("pixel_values", "image_grid_thw") if k in kw}
        if "mm_token_type_ids" in kw:
            extra["mm_token_type_ids"] = torch.cat([kw["mm_token_type_ids"], torch.zeros_like(seq)], 1)
        ids = torch.cat([input_ids, seq], 1)
        with torch.no_grad():
            logits = self.model(input_ids=ids, attention_mask=torch.cat([attention_mask, torch.ones_like(seq)], 1),
                                **extra).logits
        p = input_ids.shape[1]
        return SimpleNamespace(sequences=ids, logits=tuple(logits[:, p - 1 + k] for k in range(seq.shape[1])))


def test_a_tool_call_gets_an_image_observation_and_exact_logprobs(model_dir):
    """Row 0 zooms, then answers; row 1 answers at once. The observation (a crop as
    image tokens) is attended but carries no loss; the training forward reproduces
    every turn's old log-probs; the crop's pixels reach the model."""
    policy = make_policy(model_dir)
    item = ITEMS[0]
    call = zoom_call(item.meta["zoom_box"])
    script = Scripted(policy, [[call, f"a red circle <answer>{item.answer}</answer><|im_end|>"],
                               ["<answer>square</answer><|im_end|>"]])
    script.install()
    batch = policy.generate([item], 2, rollout_cfg(), torch.Generator().manual_seed(0))
    data = batch.data
    assert data["stat/tool_calls"].tolist() == [1.0, 0.0] and data["stat/tool_errors"].tolist() == [0.0, 0.0]
    assert data["stat/turns"].tolist() == [2.0, 1.0]
    image_pad = policy.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ids, mask, seen = data["completion_ids"], batch.mask, data["completion_attention"]
    obs = seen[0] & ~mask[0]
    assert obs.any() and (ids[0][obs] == image_pad).sum() > 0  # the crop is in the observation
    assert not (mask & (ids == image_pad)).any()  # image tokens never carry loss
    assert data["image_grid_thw"][0, 1].prod() > 0 and data["image_grid_thw"][1, 1].prod() == 0
    # The call is the model's own: trained, and marked for AXPO's confidence.
    first = int(data["first_call"][0])
    assert first == 0 and data["first_call"][1].item() == -1
    assert data["call_mask"][0].sum() == len(policy.tokenizer(call, add_special_tokens=False)["input_ids"])
    assert mask[0, : int(data["call_mask"][0].sum())].all()
    assert "tool_response" in batch.samples[0].completion and batch.samples[0].meta["tool_calls"] == 1
    # what DAPO's overlong atom reads: the model's own tokens, the observation's not counted
    assert [s.meta["completion_tokens"] for s in batch.samples] == mask.sum(-1).tolist()
    with torch.no_grad():
        logp = policy.logprobs(batch)
    torch.testing.assert_close(logp[mask], batch.old_logp[mask], atol=2e-4, rtol=1e-4)
    assert (batch.old_logp[~mask] == 0).all()


def test_training_forward_reads_the_observation_image(qwen25_dir):
    """Changing the cropped pixels changes the log-probs of the answer after the call."""
    policy = make_policy(qwen25_dir)
    item = ITEMS[1]
    Scripted(policy, [[zoom_call(item.meta["zoom_box"]), "<answer>circle</answer><|im_end|>"]]).install()
    batch = policy.generate([item], 1, rollout_cfg(), torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = policy.logprobs(batch)
        n = int(batch.data["image_grid_thw"][0, 0].prod())  # the prompt image's patches come first
        batch.data["pixel_values"][0, n:] = -batch.data["pixel_values"][0, n:]
        b = policy.logprobs(batch)
    after = batch.mask[0].clone()
    after[: int(batch.data["call_mask"][0].sum())] = False
    assert not torch.allclose(a[0][after], b[0][after])


@pytest.mark.parametrize("text,kind", [
    ('<tool_call>\n{"name": "zoom", "arguments": {"x0": 0}\n</tool_call>', "malformed"),
    ('<tool_call>\n{"name": "paint", "arguments": {}}\n</tool_call>', "unknown_tool"),
    ('<tool_call>\n{"name": "zoom", "arguments": {"x0": 0, "y0": 0}}\n</tool_call>', "bad_arguments"),
    ('<tool_call>\n{"name": "boom", "arguments": {}}\n</tool_call>', "raised"),
    ('<tool_call>\n{"name": "slow", "arguments": {}}\n</tool_call>', "timeout"),
    ('<tool_call>\n{"name": "zoom", "arguments": {"x0": 0, "y0": 0, "x1": 224, "y1": 1}}\n</tool_call>',
     "bad_image"),  # a 224x1 crop: no image processor takes it
    ('<tool_call>\n{"name": "odd", "arguments": {}}\n</tool_call>', "bad_result"),
])
def test_bad_tool_calls_become_error_observations(qwen25_dir, text, kind):
    """Every failure comes back as an observation "error: ..."; the rollout goes on to answer."""
    registry = build_registry(["zoom"], timeout=0.3)

    @registry.register
    def boom() -> str:
        raise RuntimeError("exploded")

    @registry.register
    def slow() -> str:
        import time
        time.sleep(3)
        return "late"

    @registry.register
    def odd() -> object:
        return object()  # neither text nor an image

    policy = make_policy(qwen25_dir, registry=registry)
    Scripted(policy, [[text, "<answer>circle</answer><|im_end|>"]]).install()
    failed = kind in ("raised", "timeout", "bad_result", "bad_image")  # the tool's fault: said once, counted apart
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        batch = policy.generate([ITEMS[0]], 1, rollout_cfg(), torch.Generator().manual_seed(0))
    assert [str(w.message).split(":")[0] for w in said if "tool_failures" in str(w.message)] == (
        [f"tool {'(observation)' if kind == 'bad_image' else text.split(chr(34))[3]}"] if failed else [])
    assert batch.data["stat/tool_errors"].tolist() == [1.0]
    assert batch.data["stat/tool_failures"].tolist() == [float(failed)]
    assert batch.data["stat/turns"].tolist() == [2.0]
    text_out = batch.samples[0].completion
    assert "error:" in text_out and text_out.rstrip().endswith("</answer>")


def test_an_unclosed_call_is_a_malformed_call(qwen25_dir):
    """A turn that ends with end-of-turn inside <tool_call>: the call is counted as an error,
    the model is told, and the rollout goes on; end-of-turn is written once, and the call's
    span stops before it."""
    policy = make_policy(qwen25_dir)
    Scripted(policy, [['<tool_call>\n{"name": "zoom", "arguments": {"x0": 0}}<|im_end|>',
                       "<answer>circle</answer><|im_end|>"]]).install()
    batch = policy.generate([ITEMS[0]], 1, rollout_cfg(), torch.Generator().manual_seed(0))
    data = batch.data
    assert data["stat/tool_calls"].tolist() == [1.0] and data["stat/tool_errors"].tolist() == [1.0]
    assert data["stat/turns"].tolist() == [2.0] and data["stat/truncated"].tolist() == [0.0]
    text = batch.samples[0].completion
    assert "not closed with </tool_call>" in text and text.rstrip().endswith("</answer>")
    ids = data["completion_ids"][0][data["completion_attention"][0]].tolist()
    eos = [j for j, t in enumerate(ids) if t == policy.eos_id]
    assert all(b - a > 1 for a, b in pairwise(eos))  # never <|im_end|><|im_end|>
    calls = data["call_mask"][0].nonzero().flatten().tolist()
    assert calls[0] == int(data["first_call"][0]) and ids[calls[-1] + 1] == policy.eos_id
    assert batch.mask[0, calls[-1] + 1]  # the model's end-of-turn is its own token: trained
    assert not batch.mask[0, calls[-1] + 2]  # the observation is not


def test_a_call_cut_off_by_the_token_budget_is_counted(qwen25_dir):
    """A turn whose budget (rollout.max_new_tokens 20) runs out inside <tool_call>: the rollout
    ends truncated, and the call is counted (a call, an error, and stat/tool_cut -> rollout/tool_cut)
    where it was counted nowhere; a row that answers within the budget counts none."""
    from mmrl.core.scheduler import round_metrics

    policy = make_policy(qwen25_dir)
    long_call = tool_call("zoom", x0=0.125, y0=0.25, x1=0.875, y1=0.9375, note="a rather long argument")
    Scripted(policy, [[long_call], ["<answer>circle</answer><|im_end|>"]]).install()
    batch = policy.generate(ITEMS[:2], 1, rollout_cfg(max_new_tokens=20), torch.Generator().manual_seed(0))
    data = batch.data
    assert "</tool_call>" not in batch.samples[0].completion  # cut before its end
    assert data["stat/truncated"].tolist() == [1.0, 0.0] and data["stat/turns"].tolist() == [1.0, 1.0]
    assert data["stat/tool_cut"].tolist() == [1.0, 0.0]
    assert data["stat/tool_calls"].tolist() == [1.0, 0.0] and data["stat/tool_errors"].tolist() == [1.0, 0.0]
    assert data["stat/tool_failures"].tolist() == [0.0, 0.0]  # the budget's fault, not the tool's
    # its 20 tokens are a call's, as stat/called says (AXPO's first_call and call confidence)
    assert data["stat/called"].tolist() == [1.0, 0.0] and data["first_call"].tolist() == [0, -1]
    assert data["call_mask"][0].tolist() == batch.mask[0].tolist() and int(data["call_mask"][0].sum()) == 20
    batch.scores = Reward([reward_atom("one")(lambda s: 1.0)]).score(batch.samples)
    assert round_metrics(batch)["rollout/tool_cut"] == 0.5


def test_a_call_ended_by_a_stop_string_is_counted_as_cut_and_said(qwen25_dir):
    """rollout.stop ["</answer>"] ends row 0's turn inside its call (the script stops where the
    string would): the call is counted as the budget's cut ones are (a call, an error, tool_cut,
    its tokens in call_mask and first_call) where it was counted nowhere, the rollout is not
    truncated, and a warning names the stop strings; row 1's answer stopped there counts none."""
    policy = make_policy(qwen25_dir)
    cut = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "</answer>'
    Scripted(policy, [[cut], ["<answer>red</answer>"]]).install()
    with pytest.warns(UserWarning, match=r"rollout.stop \['</answer>'\]: a stop string ended a turn inside a tool call"):
        batch = policy.generate([ITEMS[0]], 2, rollout_cfg(stop=["</answer>"]), torch.Generator().manual_seed(0))
    data = batch.data
    n = len(policy.tokenizer(cut, add_special_tokens=False)["input_ids"])
    assert data["stat/truncated"].tolist() == [0.0, 0.0] and data["stat/tool_cut"].tolist() == [1.0, 0.0]
    assert data["stat/tool_calls"].tolist() == [1.0, 0.0] and data["stat/tool_errors"].tolist() == [1.0, 0.0]
    assert data["first_call"].tolist() == [0, -1] and int(data["call_mask"][0].sum()) == n
    assert batch.samples[0].meta["tool_calls"] == 1 and "tool_response" not in batch.samples[0].completion


def test_limits_on_turns_and_tool_calls(qwen25_dir):
    """max_tool_calls: a second call gets an error observation; max_turns: a call in the
    last turn ends the rollout (truncated)."""
    policy = make_policy(qwen25_dir, max_turns=3, max_tool_calls=1)
    call = tool_call("calculator", expression="2*3")
    Scripted(policy, [[call, call, call]]).install()
    batch = policy.generate([ITEMS[0]], 1, rollout_cfg(), torch.Generator().manual_seed(0))
    text = batch.samples[0].completion
    assert "6" in text and "at most 1 tool calls" in text
    assert batch.data["stat/turns"].tolist() == [3.0] and batch.data["stat/truncated"].tolist() == [1.0]
    # the last turn's call is made (counted) but not run: no turn is left to read its observation
    assert batch.data["stat/tool_calls"].tolist() == [3.0] and batch.data["stat/tool_errors"].tolist() == [1.0]
    assert (batch.samples[0].meta["tool_calls"], batch.samples[0].meta["tool_errors"]) == (3, 1)  # the limit's error


def test_a_call_in_the_only_turn_counts_as_a_call(qwen25_dir):
    """max_turns 1: the call cannot run, but it is a call (stat/called as first_call says),
    and an unclosed one is a malformed call, as in any other turn."""
    policy = make_policy(qwen25_dir, max_turns=1)
    call = tool_call("calculator", expression="2*3")
    Scripted(policy, [[call], ['<tool_call>\n{"name": "zoom"<|im_end|>']]).install()
    batch = policy.generate([ITEMS[0]], 2, rollout_cfg(), torch.Generator().manual_seed(0))
    data = batch.data
    assert data["stat/tool_calls"].tolist() == [1.0, 1.0] and data["stat/called"].tolist() == [1.0, 1.0]
    assert data["first_call"].tolist() == [0, 0] and data["stat/tool_errors"].tolist() == [0.0, 1.0]
    assert [s.meta["tool_calls"] for s in batch.samples] == [1, 1]


def test_a_rollouts_meta_counts_every_error_not_every_kind(qwen25_dir):
    """Two calls of an unknown tool: two errors of one kind, in the sample's meta (what reward
    atoms read) as in stat/tool_errors; the rollout that called is the one stat/called marks."""
    policy = make_policy(qwen25_dir, max_turns=3, max_tool_calls=2)
    call = tool_call("paint")
    Scripted(policy, [[call, call, "<answer>red</answer><|im_end|>"], ["<answer>red</answer><|im_end|>"]]).install()
    batch = policy.generate([ITEMS[0]], 2, rollout_cfg(), torch.Generator().manual_seed(0))
    assert batch.data["stat/tool_errors"].tolist() == [2.0, 0.0] and batch.data["stat/called"].tolist() == [1.0, 0.0]
    assert [(s.meta["tool_calls"], s.meta["tool_errors"]) for s in batch.samples] == [(2, 2), (0, 0)]


def test_a_demonstrations_last_turn_left_inside_a_call_is_a_malformed_call(qwen25_dir):
    """teacher(): a last turn that ends inside an unclosed call is counted as a (malformed) call,
    not run, and the transcript is truncated there, as a model's would be; it is not refused."""
    policy = make_policy(qwen25_dir, max_turns=1)
    batch = policy.agent.teacher([ITEMS[0]], [['<tool_call>\n{"name": "zoom"']])
    data = batch.data
    assert data["stat/tool_calls"].tolist() == [1.0] and data["stat/tool_errors"].tolist() == [1.0]
    assert data["stat/truncated"].tolist() == [1.0] and "tool_response" not in batch.samples[0].completion


def test_a_demonstrations_last_turn_ending_with_a_call_is_kept_as_a_rollouts_would_be(qwen25_dir):
    """At tools.max_turns, a last turn that ends with a closed call is what a rollout's turn
    stopped at </tool_call> would be: the call counted (stat/called, call_mask), not run,
    truncated, no end-of-turn after it. With turns left, a rollout would get an observation and
    go on, so a transcript ending in a call there, closed or not, is refused."""
    call = tool_call("calculator", expression="2*3")
    policy = make_policy(qwen25_dir, max_turns=1)
    batch = policy.agent.teacher([ITEMS[0]], [[call]])
    data = batch.data
    n = len(policy.tokenizer(call, add_special_tokens=False)["input_ids"])
    assert data["stat/tool_calls"].tolist() == [1.0] and data["stat/called"].tolist() == [1.0]
    assert data["stat/truncated"].tolist() == [1.0] and data["stat/tool_errors"].tolist() == [0.0]
    assert int(data["call_mask"][0].sum()) == n and int(batch.mask[0].sum()) == n  # no <|im_end|> added
    assert batch.samples[0].completion == call
    policy = make_policy(qwen25_dir, max_turns=3)
    for last in (call, '<tool_call>\n{"name": "zoom"'):
        with pytest.raises(ValueError, match="turn 1 of 1, the last, ends with a tool call"):
            policy.agent.teacher([ITEMS[0]], [[last]])
    with pytest.raises(ValueError, match="turn 2 of 2, the last, ends with a tool call"):
        policy.agent.teacher([ITEMS[0]], [[call, call]])


def test_markup_in_a_tools_text_stays_text(qwen25_dir):
    """A tool's text (or an error quoting the model's) that holds the chat format's markup:
    an <|image_pad|> with no image would crash the next turn's generate; it stays text."""
    registry = build_registry([], timeout=2.0)

    @registry.register
    def echo() -> str:
        return "see <|image_pad|> and <|im_end|> and <tool_call>"

    policy = make_policy(qwen25_dir, registry=registry)
    Scripted(policy, [['<tool_call>\n{"name": "echo", "arguments": {}}\n</tool_call>',
                       "<answer>circle</answer><|im_end|>"]]).install()
    batch = policy.generate([ITEMS[0]], 1, rollout_cfg(), torch.Generator().manual_seed(0))
    tok = policy.tokenizer
    ids = batch.data["completion_ids"][0][batch.data["completion_attention"][0]].tolist()
    assert tok.convert_tokens_to_ids("<|image_pad|>") not in ids
    assert ids.count(policy.eos_id) == 3  # the call's turn, the observation's, the answer's: none from the text
    assert tok.convert_tokens_to_ids("<tool_call>") in ids[ids.index(policy.eos_id):]  # an ordinary token: as is
    assert batch.data["stat/tool_errors"].tolist() == [0.0] and batch.data["stat/turns"].tolist() == [2.0]
    assert "image_pad" in batch.samples[0].completion and batch.samples[0].completion.rstrip().endswith("</answer>")


def _calls_dump(qwen25_dir, text: str, timeout: float):
    """A policy (observations cut at 64 tokens) scripted to call the tool `dump`, which returns
    `text`, then answer."""
    registry = build_registry([], timeout=timeout)

    @registry.register
    def dump() -> str:
        return text

    policy = make_policy(qwen25_dir, registry=registry, max_observation_tokens=64)
    Scripted(policy, [['<tool_call>\n{"name": "dump", "arguments": {}}\n</tool_call>',
                       "<answer>circle</answer><|im_end|>"]]).install()
    return policy


def test_a_tools_long_text_is_cut_and_counted(qwen25_dir):
    policy = _calls_dump(qwen25_dir, "word " * 5000, timeout=2.0)
    with pytest.warns(UserWarning, match=r"tool dump: returned \d+ tokens of text, cut to tools.max_observation_tokens "
                                         r"64 \(the rollout reads the text up to there") as said:
        batch = policy.generate([ITEMS[0]], 1, rollout_cfg(), torch.Generator().manual_seed(0))
    total = int(str(said[0].message).split()[3])
    assert total >= 5000 and f"[cut: {total - 64} more tokens]" in batch.samples[0].completion
    assert batch.data["completion_attention"][0].sum() < 200  # not 5000 tokens to train on
    assert batch.data["stat/tool_failures"].tolist() == [1.0] and batch.data["stat/turns"].tolist() == [2.0]


def test_a_tools_text_of_megabytes_is_cut_before_it_is_tokenised(qwen25_dir):
    """Tokenising 10 MB took 24 s a call: past agent._TOKENIZED_CHARS (and 32 characters a token
    of the budget) the text is cut unread, and the observation and the warning say so."""
    words = "word " * 2_000_000  # 10 MB
    policy = _calls_dump(qwen25_dir, words, timeout=5.0)
    with pytest.warns(UserWarning, match=r"tool dump: returned more than \d+ tokens of text, cut to "
                                         r"tools.max_observation_tokens 64") as said:
        batch = policy.generate([ITEMS[0]], 1, rollout_cfg(), torch.Generator().manual_seed(0))
    read = int(str(said[0].message).split()[5])  # the tokens of the part tokenised
    limit = _TOKENIZED_CHARS + 32 * 64
    assert abs(read - limit / 5) < 5  # about one token a "word "
    assert f"[cut: {read - 64} more tokens and {len(words) - limit} more characters]" in batch.samples[0].completion
    assert batch.data["stat/tool_failures"].tolist() == [1.0] and batch.data["stat/turns"].tolist() == [2.0]


def test_a_turn_ending_on_generated_pad_tokens_keeps_them(qwen25_dir):
    """Qwen's pad token is <|endoftext|>, which a model can write: a turn that runs out of tokens
    on it keeps them as its own and is truncated (they were taken for padding and dropped)."""
    policy = make_policy(qwen25_dir)
    pad = policy.tokenizer.convert_ids_to_tokens(policy.pad_id)
    turn = "<answer>red" + pad * 2
    n = len(policy.tokenizer(turn, add_special_tokens=False)["input_ids"])
    Scripted(policy, [[turn]]).install()
    batch = policy.generate([ITEMS[0]], 1, rollout_cfg(max_new_tokens=n), torch.Generator().manual_seed(0))
    assert batch.mask[0].sum() == n and batch.data["stat/truncated"].tolist() == [1.0]


def test_a_turn_ended_by_a_stop_string_drops_generates_padding(qwen25_dir):
    """With rollout.stop, generate pads a row that stopped early: those pads are not the row's.
    Row 0 stops after "<answer>red</answer>" (padded to row 1's length), row 1 after its longer
    answer; neither ran out of tokens."""
    policy = make_policy(qwen25_dir)
    short, long = "<answer>red</answer>", "<answer>a red circle, not a square</answer>"
    Scripted(policy, [[short], [long]]).install()
    batch = policy.generate([ITEMS[0]], 2, rollout_cfg(stop=["</answer>"]), torch.Generator().manual_seed(0))
    n = [len(policy.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in (short, long)]
    assert n[0] < n[1] and batch.mask.sum(-1).tolist() == n
    assert [s.completion for s in batch.samples] == [short, long]
    assert batch.data["stat/truncated"].tolist() == [0.0, 0.0]


def test_a_demonstration_turn_after_a_turn_without_a_call_is_refused(qwen25_dir):
    policy = make_policy(qwen25_dir)
    call = zoom_call(ITEMS[0].meta["zoom_box"])
    batch = policy.agent.teacher([ITEMS[0]], [[call, "<answer>red</answer>"]])
    assert batch.data["stat/tool_calls"].tolist() == [1.0]
    with pytest.raises(ValueError, match="turn 1 of 2 .* does not end with a tool call"):
        policy.agent.teacher([ITEMS[0]], [[call + "\n", "<answer>red</answer>"]])


def test_prefix_continues_before_the_tool_call_and_batches_concat(qwen25_dir):
    """AXPO's resampling: a fixed prefix (no loss) and a continuation that calls the tool;
    concatenated with a plain tool batch, the log-probs still match."""
    policy = make_policy(qwen25_dir)
    item = ITEMS[2]
    head = policy.tokenizer("I see", add_special_tokens=False)["input_ids"]
    Scripted(policy, [[" a shape " + zoom_call(item.meta["zoom_box"]), "<answer>circle</answer><|im_end|>"],
                      ["<answer>square</answer><|im_end|>"]]).install()
    batch = policy.generate([item, item], 1, rollout_cfg(max_new_tokens=96), torch.Generator().manual_seed(0), prefixes=[head, None])
    assert batch.data["completion_ids"][0, : len(head)].tolist() == head
    assert not batch.mask[0, : len(head)].any() and batch.mask[0, len(head)]
    assert int(batch.data["first_call"][0]) > len(head)
    Scripted(policy, [["<answer>circle</answer><|im_end|>"]]).install()
    plain = policy.generate([ITEMS[3]], 1, rollout_cfg(), torch.Generator().manual_seed(1))
    both = RolloutBatch.concat([batch, plain])
    with torch.no_grad():
        logp = policy.logprobs(both)
    torch.testing.assert_close(logp[both.mask], both.old_logp[both.mask], atol=2e-4, rtol=1e-4)


def test_a_call_whose_opening_tag_is_in_the_prefix_runs_the_tool(qwen25_dir):
    """AXPO's force_call: the prefix ends with <tool_call>; the continuation writes the rest
    of the call, and the tool runs on the whole turn's text."""
    policy = make_policy(qwen25_dir)
    item = ITEMS[2]
    call = zoom_call(item.meta["zoom_box"])
    head = policy.tokenizer("I see <tool_call>", add_special_tokens=False)["input_ids"]
    assert head[-1] == policy.agent.open_id
    Scripted(policy, [[call[len("<tool_call>"):], "<answer>circle</answer><|im_end|>"]]).install()
    batch = policy.generate([item], 1, rollout_cfg(max_new_tokens=96), torch.Generator().manual_seed(0), prefixes=[head])
    assert batch.data["stat/tool_errors"].sum() == 0 and batch.data["stat/called"][0] == 1
    assert int(batch.data["first_call"][0]) == len(head) - 1  # the call starts at the prefix's tag
    assert batch.data["call_mask"][0, len(head) - 1] and not batch.mask[0, len(head) - 1]


def test_greedy_evaluation_reports_the_tool_call_rate(qwen25_dir):
    from mmrl.vlm.task import VLMTask
    from mmrl.vlm.tasks.shapes_zoom import shapes_zoom_reward

    policy = make_policy(qwen25_dir)
    items = ITEMS[:2]
    Scripted(policy, [[zoom_call(items[0].meta["zoom_box"]), f"<answer>{items[0].answer}</answer><|im_end|>"],
                      ["<answer>none</answer><|im_end|>"]]).install()
    # an atom reading what the tool rollout put in the sample's meta scores the evaluation too
    called = reward_atom("called")(lambda s: s.meta["tool_calls"] > 0)
    task = VLMTask("shapes-zoom", ITEMS, items, Reward([*shapes_zoom_reward().atoms, called]), max_new_tokens=48)
    out = task.evaluate(policy)
    assert out["tool_call_rate"] == 0.5 and out["accuracy"] == 0.5 and out["called"] == 0.5


def test_registry_is_never_shared_state_between_policies():
    a, b = ToolRegistry(), ToolRegistry()
    a.register(lambda: "x", name="x")
    assert a.names() == ["x"] and b.names() == []


def test_tool_rollouts_config_errors():
    """Unknown tools and engines that cannot run tools are refused with the key named."""
    from mmrl.core.config import ConfigError, load_config
    from mmrl.vlm import backend

    cfg = load_config(VLMTrainConfig, overrides=["rollout.tools.names=[zoom, paint]"])
    with pytest.raises(ConfigError, match="rollout.tools.names.*paint"):
        backend.build_tools(cfg)
    cfg = load_config(VLMTrainConfig, overrides=["rollout.tools.names=[zoom]"])
    with pytest.raises(ConfigError, match="hf engine only"):
        backend.build_engine("vllm", cfg, policy=None)


def test_a_tools_section_without_tools_is_refused_with_the_way_to_single_turn():
    """rollout.tools.names: [] ran multi-turn rollouts in which every call failed as unknown, without
    a word; refused at load, naming the key, with the way to mean single-turn (tools: null)."""
    from mmrl.core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"rollout\.tools\.names: no tools: .*--set rollout\.tools=null"):
        load_config(VLMTrainConfig, overrides=["rollout.tools.names=[]"])
    assert load_config(VLMTrainConfig, overrides=["rollout.tools=null"]).rollout.tools is None


def test_a_frozen_copy_rolls_out_with_its_own_weights(qwen25_dir):
    """policy.rollout_copy() (a background engine's own weights; also the KL reference without
    LoRA): its tool rollouts use the copy's model, so the trainer's updates do not leak into them."""
    policy = make_policy(qwen25_dir)
    ref = policy.rollout_copy()
    assert ref.agent.policy is ref and ref.agent.policy.model is not policy.model
    assert ref.agent.registry is policy.agent.registry


def _text_of(tok, n: int) -> str:
    """A plain text of exactly n tokens."""
    for k in range(1, 4 * n):
        text = "a" + " b" * k
        if len(tok(text, add_special_tokens=False)["input_ids"]) == n:
            return text
    raise AssertionError(f"no text of {n} tokens")


def call_and_observation(batch) -> int:
    """Tokens of row 0's call and its observation: the completion's attended tokens less the
    model's own (call and answer), plus the call's."""
    call = len(batch.data["call_mask"][0].nonzero())
    return int(batch.data["completion_attention"][0].sum()) - int(batch.mask[0].sum()) + call


def text_tool_policy(path, tokens: int, budget: int):
    """A policy whose one tool, `text`, returns a plain text of `tokens` tokens, with
    tools.max_observation_tokens `budget`; the policy and the text."""
    registry = build_registry([], timeout=2.0)
    policy = make_policy(path, registry=registry, max_observation_tokens=budget)
    words = _text_of(policy.tokenizer, tokens)

    @registry.register
    def text() -> str:
        return words

    return policy, words


def test_a_turn_that_just_fits_the_context_is_started(qwen25_dir):
    """A turn starts where prompt + completion so far + max_new_tokens is the context exactly;
    the next, which would outgrow it, is not (the rollout is truncated after the call)."""
    policy = make_policy(qwen25_dir)
    call = tool_call("calculator", expression="2*3")
    Scripted(policy, [[call, "<answer>6</answer><|im_end|>"]]).install()
    prompt = int(policy.encode([ITEMS[0]])["attention_mask"].sum())
    policy.max_context = prompt + 48  # rollout_cfg's max_new_tokens
    batch = policy.generate([ITEMS[0]], 1, rollout_cfg(), torch.Generator().manual_seed(0))
    data = batch.data
    assert data["stat/turns"].tolist() == [1.0] and data["stat/tool_calls"].tolist() == [1.0]
    assert data["stat/truncated"].tolist() == [1.0] and "<answer>" not in batch.samples[0].completion


def test_an_observation_that_would_outgrow_the_context_is_not_shown(qwen25_dir):
    """Training reads the whole transcript: an observation that would take it past the model's
    context ends the rollout at the call, truncated; one that fits is shown. A demonstration
    whose observation would not fit is refused, naming the context."""
    policy, text = text_tool_policy(qwen25_dir, 64, budget=200)
    call = tool_call("text")
    script = [[call, "<answer>circle</answer><|im_end|>"]]
    Scripted(policy, script).install()
    full = policy.generate([ITEMS[0]], 1, rollout_cfg(), torch.Generator().manual_seed(0))
    first = call_and_observation(full)
    assert first - 1 >= 48  # the first turn (max_new_tokens 48) starts in either context below
    prompt = int(policy.encode([ITEMS[0]])["attention_mask"].sum())
    for room, shown in ((prompt + first - 1, False), (prompt + first, True)):
        policy.max_context = room
        Scripted(policy, script).install()
        batch = policy.generate([ITEMS[0]], 1, rollout_cfg(), torch.Generator().manual_seed(0))
        assert prompt + int(batch.data["completion_attention"][0].sum()) <= room
        assert batch.data["stat/tool_calls"].tolist() == [1.0] and batch.data["stat/truncated"].tolist() == [1.0]
        assert (text in batch.samples[0].completion) == shown  # shown or not, no room for a second turn
    assert text in full.samples[0].completion and full.samples[0].completion.endswith("<answer>circle</answer>")
    policy.max_context = prompt + first - 1
    with pytest.raises(ValueError, match=f"turn 1 of 2: its tool's observation would take the transcript past "
                                         f"the model's context of {prompt + first - 1} tokens"):
        policy.agent.teacher([ITEMS[0]], [[call, "<answer>circle</answer>"]])


def test_a_tools_text_of_exactly_the_budget_is_not_cut(qwen25_dir):
    policy, text = text_tool_policy(qwen25_dir, 16, budget=16)
    Scripted(policy, [[tool_call("text"),
                       "<answer>circle</answer><|im_end|>"]]).install()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "cut to tools.max_observation_tokens" warning
        batch = policy.generate([ITEMS[0]], 1, rollout_cfg(), torch.Generator().manual_seed(0))
    assert text in batch.samples[0].completion and "[cut:" not in batch.samples[0].completion
    assert batch.data["stat/tool_errors"].tolist() == [0.0] and batch.data["stat/tool_failures"].tolist() == [0.0]


def test_a_cut_text_keeps_exactly_the_budgets_tokens(qwen25_dir):
    """A text of 24 tokens ("a" and 23 " b") with a budget of 16: the observation holds its first
    16 tokens, then the note of the 8 cut."""
    policy, text = text_tool_policy(qwen25_dir, 24, budget=16)
    assert text == "a" + " b" * 23
    Scripted(policy, [[tool_call("text"), "<answer>circle</answer><|im_end|>"]]).install()
    with pytest.warns(UserWarning, match="returned 24 tokens of text, cut to tools.max_observation_tokens 16"):
        batch = policy.generate([ITEMS[0]], 1, rollout_cfg(), torch.Generator().manual_seed(0))
    assert "<tool_response>\na" + " b" * 15 + " ... [cut: 8 more tokens]\n</tool_response>" in batch.samples[0].completion


def test_the_observation_budget_is_shared_by_a_results_texts(qwen25_dir):
    """tools.max_observation_tokens bounds an observation's text in all, not each part's."""
    registry = build_registry([], timeout=2.0)
    policy = make_policy(qwen25_dir, registry=registry, max_observation_tokens=16)
    part = _text_of(policy.tokenizer, 12)

    @registry.register
    def two_parts() -> list:
        return [part, part]

    Scripted(policy, [[tool_call("two_parts"),
                       "<answer>circle</answer><|im_end|>"]]).install()
    with pytest.warns(UserWarning, match="returned 24 tokens of text, cut to tools.max_observation_tokens 16"):
        batch = policy.generate([ITEMS[0]], 1, rollout_cfg(), torch.Generator().manual_seed(0))
    assert "[cut: 8 more tokens]" in batch.samples[0].completion
    assert batch.data["stat/tool_failures"].tolist() == [1.0]


def test_a_long_error_observation_is_cut_but_keeps_its_kind(qwen25_dir):
    """The model's own mistake (an unknown tool) quoted at length is cut like any text, but it
    stays the model's error: not a tool failure, and no warning."""
    policy = make_policy(qwen25_dir, max_observation_tokens=16)
    name = "no_such_tool_" * 3
    Scripted(policy, [[tool_call(name),
                       "<answer>circle</answer><|im_end|>"]]).install()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch = policy.generate([ITEMS[0]], 1, rollout_cfg(max_new_tokens=96), torch.Generator().manual_seed(0))
    assert "error: unknown tool" in batch.samples[0].completion and "[cut:" in batch.samples[0].completion
    assert batch.data["stat/tool_errors"].tolist() == [1.0] and batch.data["stat/tool_failures"].tolist() == [0.0]


def test_a_tools_failure_is_warned_once_per_tool_and_kind(qwen25_dir):
    registry = build_registry([], timeout=2.0)

    @registry.register
    def broken() -> str:
        raise RuntimeError("always")

    policy = make_policy(qwen25_dir, registry=registry)
    call = tool_call("broken")
    Scripted(policy, [[call, "<answer>circle</answer><|im_end|>"]] * 2).install()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        batch = policy.generate([ITEMS[0]], 2, rollout_cfg(), torch.Generator().manual_seed(0))
    assert batch.data["stat/tool_failures"].tolist() == [1.0, 1.0]  # every failure counted
    assert len([w for w in said if "tool broken" in str(w.message)]) == 1  # said once


def test_a_second_calls_span_is_its_own_and_first_call_is_the_first(qwen25_dir):
    """call_mask marks every call's own tokens (a later turn's call where it is, after the
    observations); first_call is the first call's position."""
    policy = make_policy(qwen25_dir, max_turns=3, max_tool_calls=2)
    call = tool_call("calculator", expression="2*3")
    Scripted(policy, [[call, " so " + call, "<answer>6</answer><|im_end|>"]]).install()
    batch = policy.generate([ITEMS[0]], 1, rollout_cfg(), torch.Generator().manual_seed(0))
    data = batch.data
    assert data["stat/tool_calls"].tolist() == [2.0] and data["stat/tool_errors"].tolist() == [0.0]
    ids, calls = data["completion_ids"][0], data["call_mask"][0]
    assert policy.tokenizer.decode(ids[calls].tolist()) == call + call
    assert int(data["first_call"][0]) == 0
    assert batch.mask[0][calls].all()  # the model's own tokens: trained
    assert (batch.samples[0].meta["tool_calls"], batch.samples[0].meta["tool_errors"]) == (2, 0)


def test_a_closed_call_followed_by_more_text_is_not_an_unclosed_call(qwen25_dir):
    """A turn that closes its call and goes on to end-of-turn did not end inside the call:
    no malformed-call error, no observation (a demonstration's last turn)."""
    policy = make_policy(qwen25_dir)
    call = tool_call("calculator", expression="2*3")
    batch = policy.agent.teacher([ITEMS[0]], [[call + " or not: <answer>red</answer>"]])
    data = batch.data
    assert data["stat/tool_errors"].tolist() == [0.0] and data["stat/turns"].tolist() == [1.0]
    assert "tool_response" not in batch.samples[0].completion
    assert batch.samples[0].completion.rstrip().endswith("</answer>")


def test_a_demonstration_of_max_turns_turns_ends_with_a_trained_end_of_turn(qwen25_dir):
    """teacher(): a transcript may use every turn tools.max_turns allows (one more is refused),
    and its last turn ends with end-of-turn, which is trained like the model's own."""
    policy = make_policy(qwen25_dir, max_turns=2)
    call = zoom_call(ITEMS[0].meta["zoom_box"])
    batch = policy.agent.teacher([ITEMS[0]], [[call, "<answer>red</answer>"]])
    data = batch.data
    assert data["stat/turns"].tolist() == [2.0] and data["stat/truncated"].tolist() == [0.0]
    ids = data["completion_ids"][0][data["completion_attention"][0]].tolist()
    assert ids[-1] == policy.eos_id and batch.mask[0, len(ids) - 1]
    with pytest.raises(ValueError, match="a transcript of 3 turns; tools.max_turns is 2"):
        policy.agent.teacher([ITEMS[0]], [[call, call, "<answer>red</answer>"]])


def test_observation_image_tokens_are_typed_as_images(qwen25_dir):
    """completion/mm_token_type_ids marks an observation's image placeholders as the processor
    marks a prompt's (1), and nothing else: the model reads token types to place image tokens."""
    policy = make_policy(qwen25_dir)
    item = ITEMS[0]
    Scripted(policy, [[zoom_call(item.meta["zoom_box"]), "<answer>red</answer><|im_end|>"]]).install()
    batch = policy.generate([item], 1, rollout_cfg(), torch.Generator().manual_seed(0))
    ids, types = batch.data["completion_ids"][0], batch.data["completion/mm_token_type_ids"][0]
    image_pad = policy.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert (ids == image_pad).sum() > 0
    assert types.tolist() == (ids == image_pad).long().tolist()
    prompt_pads = batch.data["prompt_ids"][0] == image_pad
    assert (batch.data["prompt/mm_token_type_ids"][0][prompt_pads] == 1).all()  # as the processor types them


def test_completion_token_types_mark_image_and_video_placeholders(qwen25_dir):
    """completion/mm_token_type_ids types vision placeholders in the completion as the processor
    types them in a prompt: <|image_pad|> 1, <|video_pad|> 2, any other token 0."""
    policy = make_policy(qwen25_dir)
    batch = policy.agent.teacher([ITEMS[0]], [["<|image_pad|><|video_pad|><|vision_start|> red"]])
    ids, types = batch.data["completion_ids"][0].tolist(), batch.data["completion/mm_token_type_ids"][0].tolist()
    tok = policy.tokenizer
    assert ids[:3] == tok.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>"])
    assert types == [1, 2] + [0] * (len(ids) - 2)


def test_a_prefix_counts_toward_the_prompts_length(qwen25_dir):
    """A tool rollout's prompt, with its fixed prefix and max_new_tokens, must fit the context."""
    policy = make_policy(qwen25_dir)
    head = policy.tokenizer("I see", add_special_tokens=False)["input_ids"]
    prompt = int(policy.encode([ITEMS[0]])["attention_mask"].sum())
    policy.max_context = prompt + 48 + len(head) - 1
    with pytest.raises(PromptTooLong, match="exceeds the model's context"):
        policy.generate([ITEMS[0]], 1, rollout_cfg(), torch.Generator().manual_seed(0), prefixes=[head])


def test_the_longest_prefix_counts_toward_the_prompts_length(qwen25_dir):
    """Rows with different prefixes: the longest (with max_new_tokens) must fit, not the shortest."""
    policy = make_policy(qwen25_dir)
    Scripted(policy, [["<answer>red</answer><|im_end|>"]] * 2).install()
    head = policy.tokenizer("I see", add_special_tokens=False)["input_ids"]
    prompt = int(policy.encode([ITEMS[0]])["attention_mask"].sum())
    policy.max_context = prompt + 48 + len(head) - 1
    with pytest.raises(PromptTooLong, match="exceeds the model's context"):
        policy.generate([ITEMS[0], ITEMS[0]], 1, rollout_cfg(), torch.Generator().manual_seed(0), prefixes=[None, head])


def test_a_tool_batchs_groups_are_its_prompts(qwen25_dir):
    policy = make_policy(qwen25_dir)
    Scripted(policy, [["<answer>red</answer><|im_end|>"]] * 4).install()
    batch = policy.generate(ITEMS[:2], 2, rollout_cfg(), torch.Generator().manual_seed(0))
    assert batch.group_ids.tolist() == [0, 0, 1, 1]


def test_a_tokenizer_that_splits_the_tool_tags_is_refused_at_start():
    """Tool rollouts stop a turn at </tool_call>'s token: where a tokenizer writes the tags as
    several tokens, every call would pass as text, never run. Refused when the loop is built."""
    from transformers import AutoTokenizer

    from mmrl.core.config import ConfigError
    from mmrl.vlm.agent import ToolRollout

    tok = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "assets/tiny-consistency-modernbert")
    assert len(tok("</tool_call>", add_special_tokens=False)["input_ids"]) > 1
    policy = SimpleNamespace(tokenizer=tok, eos_id=0)
    with pytest.raises(ConfigError, match=r"<tool_call>, </tool_call>, <\|im_end\|> must each be one token"):
        ToolRollout(policy, ToolRegistry(), ToolsConfig())


def test_a_demonstration_needs_one_transcript_per_item(qwen25_dir):
    policy = make_policy(qwen25_dir)
    with pytest.raises(ValueError, match="1 transcripts for 2 items"):
        policy.agent.teacher(ITEMS[:2], [["<answer>red</answer>"]])


def test_an_empty_demonstration_turn_is_a_turn_without_a_call(qwen25_dir):
    """An empty turn has no tool call to end with: a turn after it is refused as after any other."""
    policy = make_policy(qwen25_dir)
    with pytest.raises(ValueError, match="turn 1 of 2 .* does not end with a tool call"):
        policy.agent.teacher([ITEMS[0]], [["", "<answer>red</answer>"]])


def test_a_later_turn_is_not_started_where_prompt_and_completion_would_outgrow_the_context(qwen25_dir):
    """The room a turn needs counts the prompt as well as the completion so far: with the
    context one token short of prompt + first turn + observation + max_new_tokens, the second
    turn is not started; with that token, it is."""
    policy = make_policy(qwen25_dir)
    call = tool_call("calculator", expression="2*3")
    script = [[call, "<answer>6</answer><|im_end|>"]]
    Scripted(policy, script).install()
    full = policy.generate([ITEMS[0]], 1, rollout_cfg(), torch.Generator().manual_seed(0))
    first = call_and_observation(full)
    prompt = int(policy.encode([ITEMS[0]])["attention_mask"].sum())
    for room, turns in ((prompt + first + 48 - 1, 1.0), (prompt + first + 48, 2.0)):
        policy.max_context = room
        Scripted(policy, script).install()
        batch = policy.generate([ITEMS[0]], 1, rollout_cfg(), torch.Generator().manual_seed(0))
        assert batch.data["stat/turns"].tolist() == [turns]
        assert batch.data["stat/truncated"].tolist() == [float(turns == 1.0)]


def test_a_call_opened_after_a_closed_one_and_left_open_is_malformed(qwen25_dir):
    """A demonstration turn that closes one call and then opens another it never closes ends
    (at its end-of-turn) inside the second: a malformed call (the model is told), its span from
    the second tag."""
    policy = make_policy(qwen25_dir)
    call = tool_call("calculator", expression="2*3")
    turn = call + ' then <tool_call>\n{"name": "zoom"<|im_end|>'
    batch = policy.agent.teacher([ITEMS[0]], [[turn, "<answer>6</answer>"]])
    data = batch.data
    assert data["stat/tool_calls"].tolist() == [1.0] and data["stat/tool_errors"].tolist() == [1.0]
    assert "not closed with </tool_call>" in batch.samples[0].completion
    ids = data["completion_ids"][0].tolist()
    opened = [j for j, t in enumerate(ids) if t == policy.agent.open_id]
    assert len(opened) == 2 and int(data["first_call"][0]) == opened[1]


def test_a_tool_sees_the_items_meta_and_images(qwen25_dir):
    """The tool's ctx holds the rollout's own item: its meta and its prompt images."""
    registry = build_registry([], timeout=2.0)

    @registry.register
    def peek(*, ctx) -> str:
        return f"box {ctx.meta['zoom_box']} of {len(ctx.images)} image(s)"

    policy = make_policy(qwen25_dir, registry=registry)
    Scripted(policy, [[tool_call("peek"), "<answer>circle</answer><|im_end|>"]] * 2).install()
    batch = policy.generate(ITEMS[:2], 1, rollout_cfg(max_new_tokens=96), torch.Generator().manual_seed(0))
    assert batch.data["stat/tool_errors"].tolist() == [0.0, 0.0]
    for item, sample in zip(ITEMS[:2], batch.samples):
        assert f"box {item.meta['zoom_box']} of 1 image(s)" in sample.completion


def test_an_observation_image_is_resized_within_tools_image_max_pixels(qwen25_dir):
    """tools.image_max_pixels bounds a tool's image as the model sees it (56 x 56 pixels, the
    model's min_pixels: at most 4 x 4 patches of 14), where model.max_pixels (112 x 112) alone
    lets the crop through larger."""
    grids = []
    for most in (None, 56 * 56):
        policy = make_policy(qwen25_dir, image_max_pixels=most)
        item = ITEMS[0]
        Scripted(policy, [[zoom_call(item.meta["zoom_box"]), "<answer>red</answer><|im_end|>"]]).install()
        batch = policy.generate([item], 1, rollout_cfg(), torch.Generator().manual_seed(0))
        grids.append(batch.data["image_grid_thw"][0, 1].tolist())
    assert grids[1][0] * grids[1][1] * grids[1][2] <= 16 < grids[0][0] * grids[0][1] * grids[0][2]


def test_each_rollout_sees_its_own_prompt_images(qwen25_dir):
    """Items of different image sizes in one tool batch: each row's prompt patches and grid are
    its own item's, as the processor makes them for that item alone."""
    from dataclasses import replace

    policy = make_policy(qwen25_dir)
    small = ITEMS[0]
    w, h = small.images[0].size
    big = replace(ITEMS[1], images=[ITEMS[1].images[0].resize((2 * w, h))])
    Scripted(policy, [["<answer>red</answer><|im_end|>"]] * 2).install()
    batch = policy.generate([small, big], 1, rollout_cfg(), torch.Generator().manual_seed(0))
    for i, item in enumerate((small, big)):
        alone = policy.encode([item])
        n = int(alone["image_grid_thw"][0].prod())
        assert batch.data["image_grid_thw"][i, 0].tolist() == alone["image_grid_thw"][0].tolist()
        torch.testing.assert_close(batch.data["pixel_values"][i, :n], alone["pixel_values"])
    assert batch.data["image_grid_thw"][0, 0].tolist() != batch.data["image_grid_thw"][1, 0].tolist()


def test_a_rollouts_old_logprobs_are_at_the_sampling_temperature(qwen25_dir):
    """Each turn's old log-probs are log_softmax(logits / rollout.temperature): the training
    forward at the same temperature reproduces them."""
    policy = make_policy(qwen25_dir)
    policy.temperature = 0.5
    item = ITEMS[0]
    Scripted(policy, [[zoom_call(item.meta["zoom_box"]), "<answer>red</answer><|im_end|>"]]).install()
    batch = policy.generate([item], 1, rollout_cfg(temperature=0.5), torch.Generator().manual_seed(0))
    with torch.no_grad():
        logp = policy.logprobs(batch)
    torch.testing.assert_close(logp[batch.mask], batch.old_logp[batch.mask], atol=2e-4, rtol=1e-4)


def test_stat_entropy_is_the_mean_over_the_models_own_tokens(qwen25_dir):
    """stat/entropy averages the model's tokens only: an observation's tokens (entropy 0, no
    loss) do not dilute it."""
    policy = make_policy(qwen25_dir)
    item = ITEMS[0]
    Scripted(policy, [[zoom_call(item.meta["zoom_box"]), "<answer>red</answer><|im_end|>"]]).install()
    batch = policy.generate([item], 1, rollout_cfg(), torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, ent = policy.logprobs(batch, entropy=True)
    mask = batch.mask[0]
    assert (batch.data["completion_attention"][0] & ~mask).sum() > 0  # there is an observation
    torch.testing.assert_close(batch.data["stat/entropy"][0], ent[0][mask].mean(), atol=1e-4, rtol=1e-4)


def test_stat_length_counts_the_models_own_tokens_not_the_observations(qwen25_dir):
    """stat/length of a rollout that calls, reads "6" and answers: its call's tokens and its
    answer's, the observation between them not counted."""
    policy = make_policy(qwen25_dir)
    call, answer = tool_call("calculator", expression="2*3"), "<answer>6</answer><|im_end|>"
    Scripted(policy, [[call, answer]]).install()
    batch = policy.generate([ITEMS[0]], 1, rollout_cfg(), torch.Generator().manual_seed(0))
    n = sum(len(policy.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in (call, answer))
    assert batch.data["completion_attention"][0].sum() > n  # the observation is there
    assert batch.data["stat/length"].tolist() == [float(n)]


def test_a_demonstration_batch_has_one_group_per_item(qwen25_dir):
    policy = make_policy(qwen25_dir)
    batch = policy.agent.teacher(ITEMS[:2], [["<answer>red</answer>"], ["<answer>blue</answer>"]])
    assert batch.group_ids.tolist() == [0, 1]


def test_a_text_only_tool_batch_has_no_image_rows(qwen25_dir):
    """Items without images, a call whose result is text: the batch carries no image patches."""
    from dataclasses import replace

    policy = make_policy(qwen25_dir)
    item = replace(ITEMS[0], images=[])
    Scripted(policy, [[tool_call("calculator", expression="2*3"), "<answer>6</answer><|im_end|>"]]).install()
    batch = policy.generate([item], 1, rollout_cfg(), torch.Generator().manual_seed(0))
    assert batch.data["pixel_values"].shape[:2] == (1, 0) and batch.data["image_grid_thw"].shape[:2] == (1, 0)
    assert batch.data["stat/tool_calls"].tolist() == [1.0] and "6" in batch.samples[0].completion


class Recording(Scripted):
    """A Scripted model that keeps the keyword arguments of each generate call."""

    def __init__(self, policy, scripts):
        super().__init__(policy, scripts)
        self.calls = []

    def __call__(self, **kw):
        self.calls.append({k: v for k, v in kw.items() if k not in ("input_ids", "attention_mask")})
        return super().__call__(**kw)


def test_a_turn_samples_at_the_rollouts_settings_and_stops_at_the_closing_tag(qwen25_dir):
    """Plain temperature / top-p sampling (no top-k, as VLMPolicy.generate), each turn at most
    max_new_tokens, ending at end-of-turn or </tool_call>; generate's logits are asked for only
    where they give the old log-probs (not under old_logprobs=forward)."""
    policy = make_policy(qwen25_dir)
    item = ITEMS[0]
    for how, logits in (("generate", True), ("forward", False)):
        spy = Recording(policy, [[zoom_call(item.meta["zoom_box"]), "<answer>red</answer><|im_end|>"]])
        spy.install()
        policy.generate([item], 1, rollout_cfg(temperature=0.7, top_p=0.9, old_logprobs=how),
                        torch.Generator().manual_seed(0))
        assert len(spy.calls) == 2
        for kw in spy.calls:
            assert (kw["do_sample"], kw["temperature"], kw["top_p"], kw["top_k"]) == (True, 0.7, 0.9, 0)
            assert kw["max_new_tokens"] == 48 and kw["output_logits"] is logits
            assert kw["eos_token_id"] == [policy.eos_id, policy.agent.close_id]


def test_a_call_turn_shorter_than_the_others_ends_at_its_closing_tag(qwen25_dir):
    """Generate pads a row that stopped at </tool_call> while another row went on: the pads are
    not its turn's, the call runs, and the row's own tokens are its call's and its answer's."""
    policy = make_policy(qwen25_dir)
    call, answer = tool_call("calculator", expression="2*3"), "<answer>6</answer><|im_end|>"
    long = "<answer>" + "a red circle and a blue square " * 5 + "</answer><|im_end|>"
    n = {t: len(policy.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in (call, answer, long)}
    assert n[call] < n[long] <= 48  # rollout_cfg's max_new_tokens
    Scripted(policy, [[call, answer], [long]]).install()
    batch = policy.generate([ITEMS[0]], 2, rollout_cfg(), torch.Generator().manual_seed(0))
    assert batch.data["stat/tool_calls"].tolist() == [1.0, 0.0] and batch.data["stat/turns"].tolist() == [2.0, 1.0]
    assert batch.mask.sum(-1).tolist() == [n[call] + n[answer], n[long]]
    assert int(batch.data["call_mask"][0].sum()) == n[call]


def test_greedy_tool_rollouts_read_generates_logits_under_forward_scoring(qwen25_dir):
    """Greedy evaluation needs no scoring pass: under rollout.old_logprobs=forward too, it
    decodes greedily and reads generate's logits (one generate call per turn, nothing else)."""
    policy = make_policy(qwen25_dir)
    item = ITEMS[0]
    spy = Recording(policy, [[zoom_call(item.meta["zoom_box"]), "<answer>red</answer><|im_end|>"]])
    spy.install()
    scored = []
    policy.score_old_logprobs = lambda *a, **k: scored.append(a)
    batch = policy.agent.run([item], rollout_cfg(old_logprobs="forward"), None, greedy=True)
    assert scored == [] and [(kw["do_sample"], kw["output_logits"]) for kw in spy.calls] == [(False, True)] * 2
    assert batch.data["stat/turns"].tolist() == [2.0]


def test_a_text_observation_is_written_in_qwens_chat_format(qwen25_dir):
    """Between a closed call and the next turn: the call's end-of-turn, a user turn holding the
    tool's text in <tool_response>, and the assistant's turn opened (none of it trained)."""
    policy = make_policy(qwen25_dir)
    Scripted(policy, [[tool_call("calculator", expression="2*3"), "<answer>6</answer><|im_end|>"]]).install()
    batch = policy.generate([ITEMS[0]], 1, rollout_cfg(), torch.Generator().manual_seed(0))
    seen, mask = batch.data["completion_attention"][0], batch.mask[0]
    obs = batch.data["completion_ids"][0][seen & ~mask].tolist()
    assert policy.tokenizer.decode(obs, skip_special_tokens=False) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_sampled_tool_rollouts_follow_the_generator(qwen25_dir):
    """The real model samples: the same generator seed draws the same rollouts, another seed others."""
    policy = make_policy(qwen25_dir, max_turns=1)

    def draw(seed):
        batch = policy.generate([ITEMS[0]], 2, rollout_cfg(max_new_tokens=12), torch.Generator().manual_seed(seed))
        return batch.data["completion_ids"].tolist()

    first = draw(0)
    assert draw(0) == first and draw(1) != first


def test_tool_schemas_are_in_the_prompt_only_where_configured(qwen25_dir):
    """rollout.tools.schema_in_prompt (the default) renders each tool's JSON schema into the
    chat template's system prompt; off (a model that learned its tools from demonstrations)
    the prompt is the plain user turn, as it is without tools."""
    mcfg = VLMModelConfig(path=str(qwen25_dir))
    model, processor = load_vlm(mcfg)
    registry = build_registry(["zoom", "calculator"], timeout=2.0)

    def prompt(**tools):
        policy = VLMPolicy(model, processor, **tools)
        return policy.tokenizer.decode(policy.encode(ITEMS[:1])["input_ids"][0])

    shown = prompt(tools=registry, tools_cfg=ToolsConfig(schema_in_prompt=True))
    assert shown.startswith("<|im_start|>system\n# Tools") and "<tools>" in shown
    assert '"name": "zoom"' in shown and '"name": "calculator"' in shown
    plain = prompt()
    assert plain.startswith("<|im_start|>user\n") and "<tools>" not in plain
    assert prompt(tools=registry, tools_cfg=ToolsConfig(schema_in_prompt=False)) == plain


def test_tool_rollouts_with_a_generator_per_row_sample_each_row_as_alone(qwen25_dir):
    """Held-out evaluation's sampled tool rollouts (a generator per row, VLMPolicy.generate
    hands the active rows' own to each turn's generate): 3 items sampled together give each
    item the completion it gets sampled alone with its generator."""
    policy = make_policy(qwen25_dir)
    rollout = rollout_cfg(max_new_tokens=16, temperature=1.0)

    def gens(rows):
        return [torch.Generator().manual_seed(100 + r) for r in rows]
    together = policy.generate(ITEMS[:3], 1, rollout, gens(range(3)))
    alone = [policy.generate(ITEMS[r:r + 1], 1, rollout, gens([r])).samples[0].completion for r in range(3)]
    assert [s.completion for s in together.samples] == alone and len(set(alone)) > 1
