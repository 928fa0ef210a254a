"""Tools as a researcher brings them: odd return values, odd exceptions, odd budgets
(mmrl.vlm.tools, mmrl.vlm.agent)."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_agent import ITEMS, Scripted, make_policy, rollout_cfg, tool_call

from mmrl.vlm.tasks.shapes_zoom import ShapesZoom
from mmrl.vlm.tools import ToolContext, ToolRegistry, build_registry

UNDECODABLE = b"caf\xe9 \xff".decode("utf-8", "surrogateescape")  # a Latin-1 file read as UTF-8


def test_text_with_undecodable_bytes_becomes_replacement_characters():
    """A str holding lone surrogates (bytes read with errors="surrogateescape") could not be
    tokenised: the rollout stopped on a TypeError from the tokenizer. Each becomes U+FFFD, in a
    result and in an exception's message alike; the rest of the text is kept."""
    registry = ToolRegistry()

    @registry.register
    def listing() -> str:
        return UNDECODABLE

    @registry.register
    def failing() -> str:
        raise OSError(UNDECODABLE)

    ctx = ToolContext(images=[])
    ok = registry.invoke("listing", {}, ctx)
    assert ok.ok and ok.content == ["caf\ufffd \ufffd"]
    bad = registry.invoke("failing", {}, ctx)
    assert bad.kind == "raised" and bad.content == ["error: tool failing raised OSError: caf\ufffd \ufffd"]
    for part in ok.content + bad.content + [bad.error]:
        part.encode("utf-8")  # what every tokenizer needs


def test_a_budget_shorter_than_any_call_is_said_once(qwen25_dir):
    """rollout.max_new_tokens below the tokens of the shortest call a model could write (no
    arguments, the shortest tool name): every call is cut before its closing tag, so no tool
    can ever run, which showed only as a tool_call_rate of 0. Said once per budget, and not for
    a budget a call fits."""
    policy = make_policy(qwen25_dir, registry=build_registry(["zoom", "calculator"]))
    shortest = '<tool_call>\n{"name": "zoom", "arguments": {}}\n</tool_call>'
    need = len(policy.tokenizer(shortest, add_special_tokens=False)["input_ids"])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for budget in (need - 1, need - 1, need):
            Scripted(policy, [["<answer>6</answer><|im_end|>"]]).install()
            policy.generate([ITEMS[0]], 1, rollout_cfg(max_new_tokens=budget), torch.Generator().manual_seed(0))
    message = (f"rollout.max_new_tokens ({need - 1}), each turn's budget, is shorter than the shortest tool call "
               f"({need} tokens: {shortest!r}): every call is cut before its end and not run, and its rollout "
               "truncated; raise rollout.max_new_tokens")
    assert [str(w.message) for w in said if "max_new_tokens" in str(w.message)] == [message]


def test_a_tool_in_a_plugins_file_is_the_plugins_function(tmp_path, monkeypatch):
    """A file both in `plugins:` and in rollout.tools.names was imported a second time for its
    tools: the plugin's registrations ran again and the tool kept state of its own, apart from
    the plugin's (what its reward atoms read, which do use the plugin's module)."""
    from mmrl.core.rewards import PLUGIN_MODULES, import_python_file

    path = tmp_path / "plug.py"
    path.write_text("SEEN = []\n\ndef lookup(key: str) -> str:\n    SEEN.append(key)\n    return key\n")
    plugin = import_python_file(path.resolve(), "plugins")
    monkeypatch.setitem(PLUGIN_MODULES, path.resolve(), plugin)
    registry = build_registry(["plug.py:lookup"], base_dir=tmp_path)
    assert registry.get("lookup").fn is plugin.lookup
    assert registry.invoke("lookup", {"key": "a"}, ToolContext(images=[])).content == ["a"]
    assert plugin.SEEN == ["a"]


def test_a_tool_drawing_on_its_image_leaves_the_tasks_image_alone(qwen25_dir):
    """ctx.images were the task item's own PIL images: a tool that marked a box on one in place
    changed the dataset, for every later rollout, epoch and evaluation of that prompt."""
    from PIL import ImageDraw

    registry = ToolRegistry()

    @registry.register
    def mark(*, ctx: ToolContext):
        ImageDraw.Draw(ctx.images[0]).rectangle((0, 0, 200, 200), fill="white")
        return ctx.images[0]

    item = ShapesZoom(seed=1, num_train=1, num_eval=1).train_items()[0]
    before = item.images[0].tobytes()
    policy = make_policy(qwen25_dir, registry=registry)
    Scripted(policy, [[tool_call("mark"), "<answer>red</answer><|im_end|>"]]).install()
    batch = policy.generate([item], 1, rollout_cfg(), torch.Generator().manual_seed(0))
    assert batch.data["stat/tool_calls"].tolist() == [1.0] and batch.data["stat/tool_errors"].tolist() == [0.0]
    assert batch.data["image_grid_thw"][0].prod(-1).gt(0).sum() == 2  # the marked copy was shown
    assert item.images[0].tobytes() == before


@pytest.mark.parametrize(("limits", "why"), [
    ({"max_turns": 1}, "tools.max_turns is 1: a call ends the rollout, with no turn left to read its observation"),
    ({"max_tool_calls": 0}, "tools.max_tool_calls is 0: every call gets an error observation"),
    ({"max_turns": 2, "max_tool_calls": 1}, None),
])
def test_limits_that_let_no_tool_run_are_said_once(qwen25_dir, limits, why):
    """max_turns 1 (read as "one round of tool use") or max_tool_calls 0: valid, but no tool
    can ever run, which before showed only as calls that never got an observation."""
    policy = make_policy(qwen25_dir, **limits)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(2):
            Scripted(policy, [["<answer>6</answer><|im_end|>"]]).install()
            policy.generate([ITEMS[0]], 1, rollout_cfg(), torch.Generator().manual_seed(0))
    message = (f"{why}, so no tool ever runs (calls are counted); for one call and an answer after its "
               "observation, set max_turns: 2 and max_tool_calls: 1")
    assert [str(w.message) for w in said if "no tool ever runs" in str(w.message)] == ([] if why is None else [message])
