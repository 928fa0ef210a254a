"""Tools for multi-turn rollouts (mmrl/vlm/tools.py): parsing, the registry, zoom, calculator."""

import asyncio
import json
import os
import threading
import time

import numpy as np
import pytest
from PIL import Image

from mmrl.vlm.tools import (
    BUILTIN_TOOLS,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Tool,
    ToolCallError,
    ToolContext,
    ToolRegistry,
    ToolResult,
    build_registry,
    calculator,
    parse_tool_call,
    zoom,
)

NO_CTX = ToolContext(images=[])


def call_text(name, arguments=None, close=True):
    call = {"name": name} if arguments is None else {"name": name, "arguments": arguments}
    return f"{TOOL_CALL_OPEN}\n{json.dumps(call)}\n{TOOL_CALL_CLOSE if close else ''}"


def gradient_image(width=40, height=30):
    """Pixel (x, y) = (x, y, x + y): every pixel tells where it came from."""
    ys, xs = np.mgrid[0:height, 0:width]
    arr = np.stack([xs, ys, xs + ys], axis=-1).astype(np.uint8)
    return Image.fromarray(arr, "RGB"), arr


def assert_error(result, kind, *fragments, name=None):
    assert isinstance(result, ToolResult)
    assert result.kind == kind, result
    assert result.error is not None
    assert result.content == [f"error: {result.error}"]
    assert result.name == name
    for f in fragments:
        assert f in result.error, (f, result.error)


# ---------------------------------------------------------------------------- parsing


def test_parse_valid_call():
    text = (
        'I will zoom.\n<tool_call>\n{"name": "zoom", "arguments": {"x0": 1, "y0": 2}}\n</tool_call>'
    )
    assert parse_tool_call(text) == ("zoom", {"x0": 1, "y0": 2})


def test_parse_missing_close_tag_at_the_end():
    assert parse_tool_call('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n') == (
        "f",
        {"a": [1, 2]},
    )


def test_parse_takes_the_last_of_several_calls():
    text = call_text("first", {"a": 1}) + " then " + call_text("second", {"b": 2})
    assert parse_tool_call(text) == ("second", {"b": 2})
    # the last call counts even when it is unfinished and an earlier one is complete
    assert parse_tool_call(call_text("first") + call_text("third", close=False)) == ("third", {})


def test_parse_arguments_as_json_string_or_missing():
    text = call_text("f", json.dumps({"x": 3}))
    assert parse_tool_call(text) == ("f", {"x": 3})
    assert parse_tool_call(call_text("f")) == ("f", {})
    assert parse_tool_call(call_text("f", None)) == ("f", {})
    assert parse_tool_call('<tool_call>{"name": "f", "arguments": null}</tool_call>') == ("f", {})


@pytest.mark.parametrize(
    "text, message",
    [
        ("no call here", "no tool call found"),
        ("<tool_call>\n</tool_call>", "tool call is empty"),
        ("<tool_call>{'name': 'zoom'}</tool_call>", "tool call is not valid JSON: "),
        ('<tool_call>{"name": "zoom", </tool_call>', "tool call is not valid JSON: "),
        ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'tool call has no "name"'),
        ('<tool_call>{"name": 3}</tool_call>', '"name" must be a non-empty string'),
        ('<tool_call>{"name": ""}</tool_call>', '"name" must be a non-empty string'),
        (
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            '"arguments" must be a JSON object, got an array',
        ),
        (
            '<tool_call>{"name": "f", "arguments": "{x"}</tool_call>',
            '"arguments" string is not valid JSON',
        ),
        (
            '<tool_call>{"name": "f", "arguments": "[1]"}</tool_call>',
            '"arguments" must be a JSON object',
        ),
        # what json raises beside JSONDecodeError (a degenerate policy repeating one token)
        ("<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>", "not valid JSON: nested too deeply"),
        ('<tool_call>{"name": "f", "arguments": {"x": ' + "9" * 5000 + "}}</tool_call>",
         "not valid JSON: Exceeds the limit"),
        ('<tool_call>{"name": "f", "arguments": "' + "[" * 5000 + '"}</tool_call>', "nested too deeply"),
    ],
)
def test_parse_errors(text, message):
    with pytest.raises(ToolCallError, match=None) as err:
        parse_tool_call(text)
    assert message in str(err.value)
    assert isinstance(err.value, ValueError)


# ---------------------------------------------------------------------------- registry


def add(a: int, b: float = 0.5) -> float:
    """Add two numbers.

    Second paragraph: not part of the description."""
    return a + b


async def async_echo(text: str) -> str:
    """Echo text back, after awaiting."""
    await asyncio.sleep(0)
    return f"echo {text}"


def image_size(*, ctx: ToolContext) -> str:
    """The size of the prompt's first image."""
    return f"{ctx.images[0].size} {ctx.meta.get('tag')}"


def test_sync_tool_result_and_number_to_str():
    reg = ToolRegistry([add])
    res = reg.call(call_text("add", {"a": 2, "b": 1.5}), NO_CTX)
    assert res == ToolResult(content=["3.5"], error=None, name="add", kind="ok")
    assert res.ok
    # default used; int accepted for a float parameter
    assert reg.call(call_text("add", {"a": 2}), NO_CTX).content == ["2.5"]
    assert reg.call(call_text("add", {"a": 2, "b": 1}), NO_CTX).content == ["3.0"]
    # an integral float is accepted for an int parameter (and passed as an int)
    assert reg.call(call_text("add", {"a": 2.0, "b": 1}), NO_CTX).content == ["3.0"]


def test_async_tool():
    reg = ToolRegistry([async_echo])
    assert reg.get("async_echo").is_async
    res = reg.call(call_text("async_echo", {"text": "hi"}), NO_CTX)
    assert (res.kind, res.content) == ("ok", ["echo hi"])


def test_async_tool_from_inside_a_running_event_loop():
    reg = ToolRegistry([async_echo])

    async def main():
        return reg.call(call_text("async_echo", {"text": "x"}), NO_CTX)

    assert asyncio.run(main()).content == ["echo x"]


def test_context_is_injected_and_hidden_from_the_model():
    reg = ToolRegistry([image_size])
    tool = reg.get("image_size")
    assert tool.wants_context and not tool.is_async
    assert tool.parameters == {"type": "object", "properties": {}, "required": []}
    img, _ = gradient_image(40, 30)
    res = reg.call(call_text("image_size"), ToolContext(images=[img], meta={"tag": "t"}))
    assert res.content == ["(40, 30) t"]
    # the model cannot pass ctx itself
    res = reg.call(call_text("image_size", {"ctx": 1}), ToolContext(images=[img]))
    assert_error(res, "bad_arguments", 'unknown argument "ctx"', name="image_size")


def test_unknown_tool():
    reg = ToolRegistry([add, async_echo])
    assert_error(
        reg.call(call_text("mul", {"a": 1}), NO_CTX),
        "unknown_tool",
        'unknown tool "mul"',
        "available: add, async_echo",
    )


def test_malformed_call_is_reported_not_raised():
    reg = ToolRegistry([add])
    assert_error(reg.call("<tool_call>{oops</tool_call>", NO_CTX), "malformed", "not valid JSON")
    assert_error(reg.call("just text", NO_CTX), "malformed", "no tool call found")


@pytest.mark.parametrize(
    "arguments, fragments",
    [
        ({}, ['missing argument "a"']),
        ({"b": 1}, ['missing argument "a"']),
        ({"a": 1, "c": 2, "d": 3}, ['unknown arguments "c", "d"', "parameters: a, b"]),
        ({"a": "two"}, ['argument "a" must be an integer, got "two"']),
        ({"a": 1.5}, ['argument "a" must be an integer, got 1.5']),
        ({"a": True}, ['argument "a" must be an integer, got true']),
        ({"a": 1, "b": "x"}, ['argument "b" must be a number, got "x"']),
        ({"a": [1]}, ['argument "a" must be an integer']),
        (
            {"c": 1, "b": None},
            ['unknown argument "c"', 'missing argument "a"', '"b" must be a number'],
        ),
    ],
)
def test_bad_arguments(arguments, fragments):
    res = ToolRegistry([add]).call(call_text("add", arguments), NO_CTX)
    assert_error(res, "bad_arguments", "tool add: ", *fragments, name="add")


def test_string_bool_list_checks():
    def f(s: str, flag: bool, items: list[int], opt: str | None = None) -> str:
        return f"{s} {flag} {items} {opt}"

    reg = ToolRegistry([f])
    ok = reg.call(call_text("f", {"s": "a", "flag": False, "items": [1], "opt": None}), NO_CTX)
    assert ok.content == ["a False [1] None"]
    for bad, word in [
        ({"s": 1}, "a string"),
        ({"flag": 1}, "true or false"),
        ({"items": {}}, "an array"),
    ]:
        args = {"s": "a", "flag": True, "items": [], **bad}
        assert_error(reg.call(call_text("f", args), NO_CTX), "bad_arguments", word, name="f")


def test_a_none_default_lets_the_model_pass_null():
    """`limit: int = None` is Python's old spelling of `int | None = None`: the schema offered
    null as its default, yet the model's null was refused as "must be an integer"."""
    def top(q: str, limit: int = None) -> str:  # noqa: RUF013 -- the spelling under test
        return f"{q} {limit}"

    reg = ToolRegistry([top])
    assert Tool(top).parameters["properties"]["limit"] == {"type": ["integer", "null"], "default": None}
    assert reg.call(call_text("top", {"q": "a", "limit": None}), NO_CTX).content == ["a None"]
    assert reg.call(call_text("top", {"q": "a", "limit": 3}), NO_CTX).content == ["a 3"]
    assert_error(reg.call(call_text("top", {"q": "a", "limit": "x"}), NO_CTX), "bad_arguments",
                 'argument "limit" must be an integer or null', name="top")


def test_tool_that_raises():
    def explode(x: int) -> str:
        raise ValueError(f"no good: {x}")

    res = ToolRegistry([explode]).call(call_text("explode", {"x": 7}), NO_CTX)
    assert_error(res, "raised", "tool explode raised ValueError: no good: 7", name="explode")


def test_async_tool_that_raises():
    async def boom() -> str:
        raise KeyError("k")

    res = ToolRegistry([boom]).call(call_text("boom"), NO_CTX)
    assert_error(res, "raised", "tool boom raised KeyError: 'k'", name="boom")


def test_sync_tool_timeout_returns_promptly():
    finished = threading.Event()

    def slow() -> str:
        time.sleep(5)
        finished.set()
        return "late"

    reg = ToolRegistry([slow], timeout=0.2)
    start = time.monotonic()
    res = reg.call(call_text("slow"), NO_CTX)
    elapsed = time.monotonic() - start
    assert_error(res, "timeout", "tool slow timed out after 0.2 s", name="slow")
    assert 0.15 < elapsed < 2.0
    assert not finished.is_set()  # abandoned, still running in its daemon thread


def test_async_tool_that_hangs_times_out_and_is_cancelled():
    cancelled = threading.Event()

    async def hang() -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    reg = ToolRegistry([hang], timeout=0.2)
    start = time.monotonic()
    res = reg.call(call_text("hang"), NO_CTX)
    assert time.monotonic() - start < 2.0
    assert_error(res, "timeout", "timed out after 0.2 s", name="hang")
    assert cancelled.wait(2.0)  # the task was cancelled, its thread can finish


def test_async_tool_blocking_its_loop_still_times_out():
    async def blocking() -> str:
        time.sleep(5)  # noqa: ASYNC251 -- never yields: only the outer wait can stop it
        return "late"

    start = time.monotonic()
    res = ToolRegistry([blocking], timeout=0.2).call(call_text("blocking"), NO_CTX)
    assert time.monotonic() - start < 2.0
    assert res.kind == "timeout"


def test_a_tool_with_max_stuck_calls_still_running_is_not_started_again():
    """Each timed-out call leaves a thread that cannot be stopped: at max_stuck of them still
    running, further calls return a timeout observation at once and start no thread; once the
    stuck calls finish, the tool runs again. Other tools are not held back."""
    release, started = threading.Event(), []

    def block() -> str:
        started.append(1)
        release.wait(30)
        return "free"

    def quick() -> str:
        return "quick"

    reg = ToolRegistry([block, quick], timeout=0.1, max_stuck=2)
    for _ in range(2):
        assert_error(reg.call(call_text("block"), NO_CTX), "timeout", "tool block timed out after 0.1 s", name="block")
    assert reg.stuck("block") == 2
    start = time.monotonic()
    res = reg.call(call_text("block"), NO_CTX)
    assert time.monotonic() - start < 0.09  # did not wait out a timeout
    assert_error(res, "timeout", "tool block not run: 2 earlier calls of it are still running past the 0.1 s timeout",
                 name="block")
    assert len(started) == 2
    assert reg.call(call_text("quick"), NO_CTX).content == ["quick"]
    release.set()
    deadline = time.monotonic() + 10
    while reg.stuck("block") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reg.stuck("block") == 0
    assert reg.call(call_text("block"), NO_CTX).content == ["free"]
    assert len(started) == 3


@pytest.mark.parametrize("max_stuck", [0, -1, 1.5, True, "2"])
def test_max_stuck_must_be_a_positive_integer(max_stuck):
    with pytest.raises(ValueError, match="max_stuck must be an integer >= 1"):
        ToolRegistry(max_stuck=max_stuck)


@pytest.mark.parametrize(
    "value, content",
    [
        ("text", ["text"]),
        (3, ["3"]),
        (2.5, ["2.5"]),
        (["a", 1], ["a", "1"]),
        (True, ["true"]),  # as the model writes it in JSON, not Python's True
        ([False, 0], ["false", "0"]),
    ],
)
def test_result_conversion(value, content):
    def f():
        return value

    assert ToolRegistry([f]).call(call_text("f"), NO_CTX).content == content


def test_result_with_images_keeps_order():
    img, _ = gradient_image()

    def f():
        return ["before", img, "after"]

    res = ToolRegistry([f]).call(call_text("f"), NO_CTX)
    assert res.kind == "ok" and res.content[0] == "before" and res.content[2] == "after"
    assert res.content[1] is img


@pytest.mark.parametrize(
    "value, fragment",
    [
        ({"a": 1}, "dict, expected text, an image, a number or a list of those"),
        (None, "NoneType"),
        ([], "an empty list"),
        (["ok", object()], "object, expected"),
    ],
)
def test_bad_result(value, fragment):
    def f():
        return value

    res = ToolRegistry([f]).call(call_text("f"), NO_CTX)
    assert_error(res, "bad_result", "tool f returned ", fragment, name="f")


def test_sync_tool_returning_a_coroutine_is_a_bad_result():
    async def inner():
        return "x"

    def f():
        return inner()

    res = ToolRegistry([f]).call(call_text("f"), NO_CTX)
    assert_error(res, "bad_result", "declare the function with async def", name="f")


def test_schemas():
    reg = ToolRegistry([add, async_echo])
    assert reg.names() == ["add", "async_echo"]
    assert reg.schemas()[0] == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "number", "default": 0.5}},
                "required": ["a"],
            },
        },
    }
    assert reg.schemas()[1]["function"]["parameters"]["properties"] == {"text": {"type": "string"}}
    json.dumps(reg.schemas())  # the chat template serialises them

    def g(flag: bool, items: list, opt: int | None = None, anything=None):
        pass

    props = Tool(g).parameters["properties"]
    assert props == {
        "flag": {"type": "boolean"},
        "items": {"type": "array"},
        "opt": {"type": ["integer", "null"], "default": None},
        "anything": {"default": None},
    }


def test_register_forms_and_duplicates():
    reg = ToolRegistry(timeout=1.0)

    @reg.register
    def one() -> str:
        return "1"

    @reg.register(name="two_renamed", description="Returns 2.")
    def two() -> str:
        return "2"

    assert one() == "1" and two() == "2"  # the decorators return the functions
    reg.register(Tool(lambda: "3", name="three"))
    assert reg.names() == ["one", "two_renamed", "three"]
    assert reg.schemas()[1]["function"]["description"] == "Returns 2."
    assert reg.call(call_text("three"), NO_CTX).content == ["3"]
    assert "one" in reg and len(reg) == 3
    with pytest.raises(ValueError, match="'one' is already registered"):
        reg.register(one)
    with pytest.raises(ValueError, match="tool name '<lambda>'"):
        reg.register(lambda: "x")
    with pytest.raises(ValueError, match="keyword arguments only"):
        reg.register(lambda *a: "x", name="star")
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        ToolRegistry(timeout=0)


# ---------------------------------------------------------------------------- zoom


def test_zoom_exact_crop():
    img, arr = gradient_image(40, 30)
    crop = zoom(5, 7, 15, 12, ctx=ToolContext(images=[img]))
    assert crop.size == (10, 5)
    np.testing.assert_array_equal(np.asarray(crop), arr[7:12, 5:15])
    # pixel (0, 0) of the crop is source pixel (5, 7): (x, y, x + y)
    assert crop.getpixel((0, 0)) == (5, 7, 12)


def test_zoom_uses_the_first_image_through_the_registry():
    img, arr = gradient_image(40, 30)
    other, _ = gradient_image(8, 8)
    reg = build_registry(["zoom"])
    res = reg.call(
        call_text("zoom", {"x0": 0, "y0": 0, "x1": 20, "y1": 10}), ToolContext([img, other])
    )
    assert res.kind == "ok" and len(res.content) == 1
    np.testing.assert_array_equal(np.asarray(res.content[0]), arr[0:10, 0:20])


def test_zoom_clips_to_the_image():
    img, arr = gradient_image(40, 30)
    crop = zoom(-10, 20, 50, 100, ctx=ToolContext(images=[img]))
    assert crop.size == (40, 10)
    np.testing.assert_array_equal(np.asarray(crop), arr[20:30, 0:40])


@pytest.mark.parametrize(
    "box, message",
    [
        ((10, 0, 10, 5), "x1 must be greater than x0, got x0=10, x1=10"),
        ((0, 8, 5, 3), "y1 must be greater than y0, got y0=8, y1=3"),
        ((40, 0, 60, 10), "lies outside the image, which is 40x30 pixels"),
        ((-20, -20, 0, 0), "lies outside the image"),
        ((0, 30, 10, 40), "lies outside the image"),
        ((0.5, 0, 10, 10), "x0 must be an integer"),
    ],
)
def test_zoom_errors(box, message):
    img, _ = gradient_image(40, 30)
    with pytest.raises(ValueError, match=None) as err:
        zoom(*box, ctx=ToolContext(images=[img]))
    assert message in str(err.value)


def test_zoom_without_image():
    with pytest.raises(ValueError, match="no image in the prompt"):
        zoom(0, 0, 1, 1, ctx=NO_CTX)
    res = build_registry(["zoom"]).call(
        call_text("zoom", {"x0": 0, "y0": 0, "x1": 1, "y1": 1}), NO_CTX
    )
    assert_error(res, "raised", "tool zoom raised ValueError: there is no image", name="zoom")


# ---------------------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    "expression, value",
    [
        ("1 + 2", "3"),
        ("(3 + 4) * 2 / 7", "2"),  # 14 / 7 = 2.0 -> integral -> "2"
        ("1 / 2", "0.5"),
        ("0.1 + 0.2", "0.3"),  # 0.30000000000000004 to 12 significant digits
        ("1 / 3", "0.333333333333"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("2 ** 10", "1024"),
        ("2 ** -1", "0.5"),
        ("-(3 - 5)", "2"),
        ("+4", "4"),
        ("10 ** 100", "1" + "0" * 100),  # exactly at the limits
        ("1.5e3", "1500"),
        ("  2*3  ", "6"),
    ],
)
def test_calculator_values(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, message",
    [
        ("x + 1", "names not allowed"),
        ("abs(-1)", "function calls not allowed"),
        ("(1).real", "attributes not allowed"),
        ("__import__('os')", "function calls not allowed"),
        ("1 < 2", "comparisons not allowed"),
        ("'a' * 3", "only numbers are allowed"),
        ("True + 1", "only numbers are allowed"),
        ("1 & 2", "BitAnd not allowed"),
        ("[1][0]", "not allowed"),
        ("1 / 0", "division by zero"),
        ("1 // 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("2 ** 101", "exponent too large"),
        ("2 ** -101", "exponent too large"),
        ("10 ** 100 * 10", "result too large"),
        ("1e101", "result too large"),
        ("9.9e99 ** 2", "result too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "invalid syntax"),
        ("", "expression is empty"),
        ("1+" * 100 + "1", "at most 200"),
    ],
)
def test_calculator_errors(expression, message):
    with pytest.raises(ValueError, match=None) as err:
        calculator(expression)
    assert message in str(err.value)


def test_calculator_through_the_registry():
    reg = build_registry(["calculator"])
    assert reg.call(call_text("calculator", {"expression": "6 * 7"}), NO_CTX).content == ["42"]
    res = reg.call(call_text("calculator", {"expression": "1/0"}), NO_CTX)
    assert_error(
        res, "raised", "tool calculator raised ValueError: division by zero", name="calculator"
    )


# ---------------------------------------------------------------------------- build_registry


def test_build_registry_builtins():
    reg = build_registry(["zoom", "calculator"], timeout=3.0, max_stuck=3)
    assert reg.names() == ["zoom", "calculator"] == list(BUILTIN_TOOLS)
    assert (reg.timeout, reg.max_stuck) == (3.0, 3)
    assert [s["function"]["name"] for s in reg.schemas()] == ["zoom", "calculator"]
    zoom_params = reg.schemas()[0]["function"]["parameters"]
    assert zoom_params["required"] == ["x0", "y0", "x1", "y1"]
    assert "ctx" not in zoom_params["properties"]


def test_build_registry_user_tools(tmp_path):
    (tmp_path / "my_tools.py").write_text(
        "import asyncio\n"
        "def double(n: int) -> int:\n"
        '    """Twice n."""\n'
        "    return 2 * n\n"
        "async def shout(text: str, *, ctx) -> str:\n"
        "    await asyncio.sleep(0)\n"
        "    return text.upper() + str(len(ctx.images))\n"
    )
    reg = build_registry(
        ["calculator", "my_tools.py:double", "my_tools.py:shout"], base_dir=tmp_path
    )
    assert reg.names() == ["calculator", "double", "shout"]
    assert reg.schemas()[1]["function"]["description"] == "Twice n."
    assert reg.call(call_text("double", {"n": 21}), NO_CTX).content == ["42"]
    assert reg.call(call_text("shout", {"text": "hi"}), NO_CTX).content == ["HI0"]
    # an absolute path needs no base_dir
    reg = build_registry([f"{tmp_path / 'my_tools.py'}:double"])
    assert reg.names() == ["double"]


def test_build_registry_bad_names(tmp_path):
    (tmp_path / "t.py").write_text("X = 3\ndef f():\n    return 'f'\n")
    with pytest.raises(ValueError, match=r"unknown tool 'zooom'.*zoom, calculator"):
        build_registry(["zooom"])
    with pytest.raises(ValueError, match=r"file not found.*builtins: zoom, calculator"):
        build_registry(["missing.py:f"], base_dir=tmp_path)
    with pytest.raises(ValueError, match=r"t.py has no attribute 'g' \(callables defined: f\)"):
        build_registry(["t.py:g"], base_dir=tmp_path)
    with pytest.raises(ValueError, match=r"'X' is not callable \(it is int\)"):
        build_registry(["t.py:X"], base_dir=tmp_path)
    with pytest.raises(ValueError, match=r"tool 'zoom': the name 'zoom' is taken by the builtin zoom \(named twice\)"):
        build_registry(["zoom", "zoom"])


def test_a_tool_named_like_another_says_which_two_clash(tmp_path):
    """A file's `zoom` beside the builtin was "a tool named 'zoom' is already registered", which
    named neither the file nor the builtin it clashed with."""
    (tmp_path / "t.py").write_text("def zoom(x: int):\n    return 'mine'\n")
    with pytest.raises(ValueError, match=r"^tool 't.py:zoom': the name 'zoom' is taken by the builtin zoom; tools need "
                                         r"distinct names \(rename the function"):
        build_registry(["zoom", "t.py:zoom"], base_dir=tmp_path)
    assert build_registry(["t.py:zoom"], base_dir=tmp_path).names() == ["zoom"]  # alone it is fine


def test_rollout_tools_config_reaches_the_registry():
    """rollout.tools.{timeout, max_stuck} are the registry's, as the VLM backend builds it."""
    from pathlib import Path

    from mmrl.core.config import load_config
    from mmrl.vlm import backend

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(backend.CONFIG_CLASS, root / "configs" / "vlm" / "axpo.yaml",
                      ["rollout.tools.timeout=2.5", "rollout.tools.max_stuck=7"], defaults=backend.DEFAULT_CONFIG)
    reg = backend.build_tools(cfg)
    assert (reg.timeout, reg.max_stuck, reg.isolation) == (2.5, 7, "thread")
    cfg = load_config(backend.CONFIG_CLASS, root / "configs" / "vlm" / "axpo.yaml",
                      ["rollout.tools.isolation=process"], defaults=backend.DEFAULT_CONFIG)
    assert backend.build_tools(cfg).isolation == "process"


# ---------------------------------------------------------------------------- isolation

HANGING_TOOLS = (  # a regex that backtracks: C code that holds the GIL, 2**n steps
    "import os, re\n"
    "def backtrack(n: int) -> str:\n"
    '    """Match a pathological regex."""\n'
    "    return str(bool(re.match(r'(a+)+$', 'a' * n + 'b')))\n"
    "def die() -> str:\n"
    "    os._exit(3)\n"
    "def pid(*, ctx) -> str:\n"
    "    return f'{os.getpid()} {ctx.images[0].size}'\n"
)


def test_a_tool_holding_the_gil_is_killed_at_its_timeout_under_isolation_process(tmp_path):
    """A regex that backtracks for ever (2**40 steps) holds the GIL: a thread could not time it out,
    and the rollout hung. In its own process it is killed at the 0.5 s timeout, the same timeout
    observation as a thread's, and the next call gets a fresh process; a tool that raises or
    kills its process is an error observation; a ctx tool gets its images there."""
    (tmp_path / "hang.py").write_text(HANGING_TOOLS)
    reg = build_registry(["hang.py:backtrack", "hang.py:die", "hang.py:pid"], base_dir=tmp_path, timeout=0.5,
                         isolation="process")
    try:
        assert reg.call(call_text("backtrack", {"n": 3}), NO_CTX).content == ["False"]  # starts its process
        start = time.monotonic()
        res = reg.call(call_text("backtrack", {"n": 40}), NO_CTX)
        assert_error(res, "timeout", "tool backtrack timed out after 0.5 s", name="backtrack")
        assert time.monotonic() - start < 2.0
        assert reg.call(call_text("backtrack", {"n": 3}), NO_CTX).content == ["False"]  # a new process
        assert_error(reg.call(call_text("backtrack", {"n": "x"}), NO_CTX), "bad_arguments", name="backtrack")
        assert_error(reg.call(call_text("die"), NO_CTX), "raised", "tool die: its process died (exit code 3)",
                     name="die")
        ctx = ToolContext(images=[gradient_image()[0]])
        first, second = (reg.call(call_text("pid"), ctx).content[0] for _ in range(2))
        assert first == second and first.endswith("(40, 30)")  # one process serves both calls
        assert int(first.split()[0]) != os.getpid()
    finally:
        reg.close()


def test_one_tool_can_be_isolated_and_a_tool_that_cannot_be_imported_is_refused():
    """Tool(fn, isolation="process") isolates that tool only (re.match, whose module its process
    imports at once); a lambda cannot be imported by another process, so isolating one is
    refused at registration, naming it."""
    import re

    reg = ToolRegistry([Tool(re.match, name="match", isolation="process"), calculator], timeout=0.5)
    try:
        assert reg.isolation == "thread" and reg.get("match").isolation == "process"
        res = reg.call(call_text("match", {"pattern": "(a+)+$", "string": "a" * 40 + "b"}), NO_CTX)
        assert_error(res, "timeout", "tool match timed out after 0.5 s", name="match")
        assert reg.call(call_text("calculator", {"expression": "2*3"}), NO_CTX).content == ["6"]
        assert reg._processes.keys() == {"match"}  # the calculator ran here
    finally:
        reg.close()
    with pytest.raises(ValueError, match=r"tool 'f': isolation 'process' runs it in another process, which cannot "
                                         r"import it .*name it as 'path/to/file.py:function'"):
        ToolRegistry([Tool(lambda: "x", name="f")], isolation="process")
    with pytest.raises(ValueError, match="isolation must be 'thread' or 'process', got 'fork'"):
        ToolRegistry(isolation="fork")


def test_a_files_tool_object_wrapping_a_closure_runs_isolated(tmp_path):
    """A "file.py:name" tool's process imports the file, so a Tool there may wrap what pickle
    cannot name (a closure): it was refused, told to name it as 'path/to/file.py:function',
    which it was."""
    (tmp_path / "made.py").write_text(
        "from mmrl.vlm.tools import Tool\n"
        "def _make():\n"
        "    def shout(text: str) -> str:\n"
        '        """Upper-case the text."""\n'
        "        return text.upper()\n"
        "    return shout\n"
        "shout = Tool(_make(), name='shout')\n"
    )
    reg = build_registry(["made.py:shout"], base_dir=tmp_path, isolation="process")
    try:
        assert reg.call(call_text("shout", {"text": "hi"}), NO_CTX).content == ["HI"]
        assert reg._processes.keys() == {"shout"}  # it ran in its process
    finally:
        reg.close()


def test_a_thread_tool_that_held_the_gil_past_its_timeout_is_a_timeout_naming_it(tmp_path):
    """In a thread (the default) a GIL-holding call cannot be timed out; one that ends far past
    its 0.05 s timeout (2**24 regex steps, about 0.6 s) was a success observation: it is a
    timeout saying which tool held the GIL, and a warning, once per tool, says to isolate it."""
    (tmp_path / "hang.py").write_text(HANGING_TOOLS)
    reg = build_registry(["hang.py:backtrack"], base_dir=tmp_path, timeout=0.05)
    with pytest.warns(UserWarning, match=r"tool backtrack ran .* s, past its 0.05 s timeout, holding Python's GIL.*"
                                         r"rollout.tools.isolation: process"):
        res = reg.call(call_text("backtrack", {"n": 24}), NO_CTX)
    assert_error(res, "timeout", "tool backtrack ran", "holding Python's GIL", name="backtrack")
    assert reg.call(call_text("backtrack", {"n": 3}), NO_CTX).content == ["False"]  # quick calls are fine


# ---------------------------------------------------------------------------- edge cases by hand


def test_parse_rejects_text_that_is_not_a_string():
    with pytest.raises(ToolCallError, match="tool call text must be a string, got NoneType"):
        parse_tool_call(None)
    res = ToolRegistry([add]).call(b"<tool_call>", NO_CTX)
    assert_error(res, "malformed", "tool call text must be a string, got bytes")


def test_parse_ends_the_call_at_its_first_close_tag():
    text = '<tool_call>{"name": "f"}</tool_call> and a stray </tool_call> after it'
    assert parse_tool_call(text) == ("f", {})


def test_parse_open_tag_right_before_the_close_tag_is_an_empty_call():
    with pytest.raises(ToolCallError, match="tool call is empty"):
        parse_tool_call("<tool_call></tool_call>")


def test_parse_strips_the_name_and_rejects_a_blank_one():
    assert parse_tool_call('<tool_call>{"name": "  f \\n"}</tool_call>') == ("f", {})
    with pytest.raises(ToolCallError, match='"name" must be a non-empty string, got "  "'):
        parse_tool_call('<tool_call>{"name": "  "}</tool_call>')


def test_parse_blank_arguments_string_means_no_arguments():
    assert parse_tool_call('<tool_call>{"name": "f", "arguments": ""}</tool_call>') == ("f", {})
    assert parse_tool_call('<tool_call>{"name": "f", "arguments": "  "}</tool_call>') == ("f", {})
    # "null" in a string means what null itself means
    assert parse_tool_call('<tool_call>{"name": "f", "arguments": "null"}</tool_call>') == ("f", {})
    with pytest.raises(ToolCallError, match='"arguments" must be a JSON object, got an array'):
        parse_tool_call('<tool_call>{"name": "f", "arguments": "[1]"}</tool_call>')


def test_a_model_value_is_quoted_whole_up_to_60_characters_then_cut():
    reg = ToolRegistry([add])
    # json.dumps adds the two quotes: 58 letters -> 60 characters, shown whole
    res = reg.call(call_text("a" * 58), NO_CTX)
    assert res.error == f'unknown tool "{"a" * 58}" (available: add)'
    # 59 letters -> 61 characters: the first 57 then "..."
    res = reg.call(call_text("b" * 59), NO_CTX)
    assert res.error == f'unknown tool "{"b" * 56}... (available: add)'


def test_an_empty_registry_says_none_are_available():
    assert_error(ToolRegistry().call(call_text("f"), NO_CTX), "unknown_tool", "(available: none)")


def test_get_of_an_unknown_tool_is_a_key_error_listing_the_registered_ones():
    reg = ToolRegistry([add])
    with pytest.raises(KeyError, match=r"unknown tool 'mul' \(registered: add\)"):
        reg.get("mul")


def test_a_tool_must_be_callable():
    with pytest.raises(TypeError, match="a tool must be callable, got int"):
        Tool(3, name="three")


def test_tool_name_is_1_to_64_characters():
    def f():
        pass

    assert Tool(f, name="n" * 64).name == "n" * 64
    for bad in ["n" * 65, "", "a b", "a.b"]:
        with pytest.raises(ValueError, match="must be 1-64 letters"):
            Tool(f, name=bad)


def test_description_is_the_first_paragraph_on_one_line():
    def f():
        """First line
        goes on here.

        Not this."""

    assert Tool(f).description == "First line goes on here."
    assert Tool(zoom).description.startswith("Zoom into the image: returns the part of the original")
    assert "\n" not in Tool(zoom).description


def test_callable_object_with_async_call_is_an_async_tool():
    class Echo:
        async def __call__(self, text: str) -> str:
            await asyncio.sleep(0)
            return "async " + text

    reg = ToolRegistry()
    reg.register(Echo(), name="echo")
    assert reg.get("echo").is_async
    assert reg.call(call_text("echo", {"text": "hi"}), NO_CTX).content == ["async hi"]


def test_var_keyword_tool_takes_extra_arguments_unchecked():
    def f(a: int, **extra) -> str:
        return f"{a} {sorted(extra.items())}"

    tool = Tool(f)
    assert tool.parameters == {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    res = ToolRegistry([f]).call(call_text("f", {"a": 1, "z": "x", "y": [2]}), NO_CTX)
    assert res.content == ["1 [('y', [2]), ('z', 'x')]"]
    # the named ones are still checked
    assert_error(ToolRegistry([f]).call(call_text("f", {"z": 1}), NO_CTX), "bad_arguments",
                 'missing argument "a"', name="f")


def test_two_missing_arguments_are_named_in_the_plural():
    def f(a: int, b: int) -> int:
        return a + b

    res = ToolRegistry([f]).call(call_text("f"), NO_CTX)
    assert res.error == 'tool f: missing arguments "a", "b" (parameters: a, b)'


def test_a_tool_without_parameters_lists_none():
    def f() -> str:
        return "x"

    res = ToolRegistry([f]).call(call_text("f", {"q": 1}), NO_CTX)
    assert res.error == 'tool f: unknown argument "q" (parameters: none)'


def test_integral_float_reaches_an_int_parameter_as_an_int():
    def kind(n: int, x: float) -> str:
        return f"{type(n).__name__} {type(x).__name__}"

    assert ToolRegistry([kind]).call(call_text("kind", {"n": 3.0, "x": 2}), NO_CTX).content == ["int float"]


def test_number_parameter_rejects_booleans_and_non_finite_values():
    reg = ToolRegistry([add])
    assert_error(reg.call(call_text("add", {"a": 1, "b": True}), NO_CTX), "bad_arguments",
                 'argument "b" must be a number, got true', name="add")
    for value, text in ((float("inf"), "Infinity"), (float("-inf"), "-Infinity"), (float("nan"), "NaN")):
        res = reg.call(call_text("add", {"a": 1, "b": value}), NO_CTX)  # json.dumps writes Infinity, NaN
        assert_error(res, "bad_arguments", f'argument "b" must be a number, got {text}', name="add")


def test_object_parameter_takes_only_an_object_and_unannotated_takes_anything():
    def f(opts: dict, anything=None) -> str:
        return f"{opts} {anything!r}"

    reg = ToolRegistry([f])
    assert reg.call(call_text("f", {"opts": {"k": 1}, "anything": [1, "x"]}), NO_CTX).content == ["{'k': 1} [1, 'x']"]
    assert_error(reg.call(call_text("f", {"opts": [1]}), NO_CTX), "bad_arguments",
                 'argument "opts" must be an object, got [1]', name="f")


def test_signature_errors():
    with pytest.raises(ValueError, match="tool d: cannot read its signature"):
        Tool(dict, name="d")

    def pos_only(a, /):
        pass

    with pytest.raises(ValueError, match="parameter 'a' cannot be passed by name"):
        Tool(pos_only)


def test_unresolvable_annotations_fall_back_to_the_raw_ones():
    def f(a: "NoSuchType", b: int) -> str:  # noqa: F821
        return f"{a} {b}"

    tool = Tool(f)
    assert tool.parameters["properties"] == {"a": {}, "b": {"type": "integer"}}
    assert ToolRegistry([tool]).call(call_text("f", {"a": [1], "b": 2}), NO_CTX).content == ["[1] 2"]


def test_schema_types_from_string_annotations():
    # tools.py has `from __future__ import annotations`: zoom's annotations are strings
    props = Tool(zoom).parameters["properties"]
    assert props == {n: {"type": "integer"} for n in ("x0", "y0", "x1", "y1")}


def test_schema_of_optional_union_and_sequence_annotations():
    import typing
    from collections.abc import Sequence

    def g(
        a: typing.Optional[int],  # noqa: UP045 -- the typing.Union spelling on purpose
        b: int | str,
        c: list[int] | None,
        d: tuple,
        e: Sequence[str],
        f: typing.Any = None,
    ):
        pass

    assert Tool(g).parameters["properties"] == {
        "a": {"type": ["integer", "null"]},
        "b": {"type": ["integer", "string"]},
        "c": {"type": ["array", "null"]},
        "d": {"type": "array"},
        "e": {"type": "array"},
        "f": {"default": None},
    }


def test_a_union_checks_each_member_and_keeps_a_value_one_member_fits_unchanged():
    # int | float keeps an int an int; float alone makes it a float
    def f(a: int | float, b: int | str, c: float | str | None = None, d: int | object = 0):  # noqa: PYI041
        pass

    t = Tool(f)
    assert t.parameters["properties"]["c"] == {"type": ["number", "string", "null"], "default": None}
    assert t.parameters["properties"]["d"] == {"default": 0}  # object has no JSON type: any value
    assert t.bind({"a": 3, "b": "x"}) == {"a": 3, "b": "x"}
    assert type(t.bind({"a": 3, "b": 1})["a"]) is int  # int fits 3 as it is: not made 3.0
    assert type(t.bind({"a": 2.5, "b": 1})["a"]) is float
    # 4.0 fits neither int nor str unchanged: the first member's conversion, an int
    assert t.bind({"a": 1, "b": 4.0})["b"] == 4 and type(t.bind({"a": 1, "b": 4.0})["b"]) is int
    assert type(t.bind({"a": 1, "b": 1, "c": 2})["c"]) is float  # int -> float for float | str
    assert t.bind({"a": 1, "b": 1, "c": None, "d": [1]})["d"] == [1]
    with pytest.raises(ValueError, match=r'"a" must be an integer or a number, got "3"'):
        t.bind({"a": "3", "b": 1})
    with pytest.raises(ValueError, match=r'"b" must be an integer or a string, got 2\.5'):
        t.bind({"a": 1, "b": 2.5})
    with pytest.raises(ValueError, match=r'"a" must be an integer or a number, got true'):
        t.bind({"a": True, "b": 1})
    with pytest.raises(ValueError, match=r'"a" must be an integer or a number, got null'):
        t.bind({"a": None, "b": 1})  # not nullable


def test_a_default_that_is_not_json_is_left_out_of_the_schema():
    marker = object()

    def f(a: int = 2, b: object = marker, c: str = "x"):
        pass

    props = Tool(f).parameters["properties"]
    assert props == {"a": {"type": "integer", "default": 2}, "b": {}, "c": {"type": "string", "default": "x"}}
    json.dumps(Tool(f).schema())


@pytest.mark.parametrize("timeout", [True, float("inf"), float("nan"), -1, "1"])
def test_timeout_must_be_a_positive_finite_number(timeout):
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        ToolRegistry(timeout=timeout)


def test_registry_repr_and_timeout_as_float():
    reg = ToolRegistry([add], timeout=2, max_stuck=3)
    assert isinstance(reg.timeout, float)
    assert repr(reg) == "ToolRegistry(['add'], timeout=2.0, max_stuck=3, isolation='thread')"


def test_register_a_tool_object_under_a_new_name_or_description():
    base = Tool(add, name="sum2", description="Base.")
    reg = ToolRegistry()
    reg.register(base, description="Sums.")  # keeps the Tool's own name
    reg.register(base, name="plus")  # keeps the Tool's own description
    assert reg.names() == ["sum2", "plus"]
    assert reg.get("sum2").description == "Sums."
    assert reg.get("plus").description == "Base."
    assert reg.call(call_text("plus", {"a": 1}), NO_CTX).content == ["1.5"]
    assert (base.name, base.description) == ("sum2", "Base.")  # the one passed is left as it was


def test_register_returns_what_it_was_given():
    reg = ToolRegistry()

    def f():
        return "f"

    assert reg.register(f) is f
    tool = Tool(add)
    assert reg.register(tool) is tool
    assert reg.register(name="g")(f) is f


def test_a_call_that_cannot_be_read_for_any_reason_is_malformed():
    class Weird(str):
        def rfind(self, *args):
            raise RuntimeError("boom")

    res = ToolRegistry([add]).call(Weird("<tool_call>"), NO_CTX)
    assert_error(res, "malformed", "the tool call could not be read: RuntimeError: boom")


def test_a_tool_that_exits_is_reported_not_raised():
    import sys

    def leave() -> str:
        sys.exit(3)

    res = ToolRegistry([leave]).call(call_text("leave"), NO_CTX)
    assert_error(res, "raised", name="leave")
    assert res.error == "tool leave raised SystemExit: 3"


def test_an_exception_without_a_message_is_named_alone():
    def f() -> str:
        raise ValueError

    assert ToolRegistry([f]).call(call_text("f"), NO_CTX).error == "tool f raised ValueError"


def test_a_huge_integer_for_a_number_argument_is_an_error_not_an_exception():
    # 400 digits: valid JSON, beyond any float; call never raises
    res = ToolRegistry([add]).call(call_text("add", {"a": 1, "b": 10**400}), NO_CTX)
    assert not res.ok and res.name == "add" and res.content == [f"error: {res.error}"]


def test_tuple_result_and_complex_result():
    def pair():
        return ("a", 2)

    def cplx():
        return 1j

    assert ToolRegistry([pair]).call(call_text("pair"), NO_CTX).content == ["a", "2"]
    assert_error(ToolRegistry([cplx]).call(call_text("cplx"), NO_CTX), "bad_result",
                 "tool cplx returned complex, expected text", name="cplx")


def test_zoom_more_edge_cases():
    img, arr = gradient_image(40, 30)
    ctx = ToolContext(images=[img])
    # a negative top edge is clipped to 0 like a negative left edge
    crop = zoom(2, -5, 12, 10, ctx=ctx)
    assert crop.size == (10, 10)
    np.testing.assert_array_equal(np.asarray(crop), arr[0:10, 2:12])
    with pytest.raises(ValueError, match="y1 must be greater than y0, got y0=5, y1=5"):
        zoom(0, 5, 10, 5, ctx=ctx)
    with pytest.raises(ValueError, match="x0 must be an integer, got True"):
        zoom(True, 0, 10, 10, ctx=ctx)
    with pytest.raises(ValueError, match="y1 must be an integer, got 0.5"):
        zoom(0, 0, 10, 0.5, ctx=ctx)
    assert zoom(0.0, 0, 10.0, 10, ctx=ctx).size == (10, 10)  # integral floats are fine
    with pytest.raises(ValueError, match="the prompt's image is ndarray, not a PIL image"):
        zoom(0, 0, 10, 10, ctx=ToolContext(images=[arr]))


@pytest.mark.parametrize(
    "expression, value",
    [
        (" " * 199 + "7", "7"),  # exactly 200 characters
        ("2.0 ** 52", "4503599627370496"),  # integral floats below 2**53 print as integers
        ("2.0 ** 53", "9.00719925474e+15"),  # from 2**53 on, as other floats
        ("-(2.0 ** 53)", "-9.00719925474e+15"),
        ("-(2.0 ** 52)", "-4503599627370496"),
        ("-10 ** 100", "-1" + "0" * 100),
        ("1e100", "1e+100"),  # exactly the largest magnitude allowed
        ("-1e100", "-1e+100"),
    ],
)
def test_calculator_boundaries(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, message",
    [
        (" " * 200 + "7", "expression is 201 characters long; at most 200 allowed"),
        ("1e100 ** 4", "result too large (beyond 1e+100)"),  # float pow raises OverflowError
        ("2j", "only numbers are allowed, got 2j"),
        ("1 and 2", "and/or not allowed"),
        ("lambda: 1", "lambdas not allowed"),
        ("[1][0]", "indexing not allowed"),
        ("-(10 ** 100) * 2", "result too large"),  # negative results are bounded too
    ],
)
def test_calculator_more_errors(expression, message):
    with pytest.raises(ValueError, match=None) as err:
        calculator(expression)
    assert message in str(err.value)


def test_calculator_rejects_a_non_string():
    with pytest.raises(ValueError, match="expression must be a string, got int"):
        calculator(5)


def test_build_registry_more_forms(tmp_path):
    log = tmp_path / "imports.log"
    folder = tmp_path / "a:b"
    folder.mkdir()
    (folder / "t.py").write_text(
        "from mmrl.vlm.tools import Tool\n"
        f"open({str(log)!r}, 'a').write('x')\n"
        "def f() -> str:\n"
        "    return 'f'\n"
        "alias = f\n"
        "named = Tool(f, name='renamed')\n"
    )
    reg = build_registry([f"{folder / 't.py'}:f", f"{folder / 't.py'}:alias", f"{folder / 't.py'}:named"])
    assert reg.names() == ["f", "alias", "renamed"]
    assert log.read_text() == "x"  # imported once
    assert build_registry("calculator").names() == ["calculator"]  # one name as a string
    with pytest.raises(ValueError, match=r"tool names must be strings, got 3 \(builtins: zoom, calculator\)"):
        build_registry([3])
    with pytest.raises(ValueError, match=r"unknown tool 't.py:': not a builtin"):
        build_registry(["t.py:"], base_dir=folder)


def test_async_wait_ends_in_a_timeout_at_its_deadline():
    from mmrl.vlm.tools import _await_with_timeout, _ToolTimeout

    with pytest.raises(_ToolTimeout):
        asyncio.run(_await_with_timeout(asyncio.sleep(10), 0.05))
    assert asyncio.run(_await_with_timeout(asyncio.sleep(0, result="done"), 1.0)) == "done"


def test_timeout_message_writes_a_whole_number_of_seconds_without_a_point():
    release = threading.Event()

    def wait() -> str:
        release.wait(10)
        return "late"

    try:
        res = ToolRegistry([wait], timeout=1).call(call_text("wait"), NO_CTX)
    finally:
        release.set()
    assert_error(res, "timeout", name="wait")
    assert res.error == "tool wait timed out after 1 s"


def test_a_number_argument_beyond_the_float_range_is_a_bad_argument():
    """The model's mistake (bad_arguments), not a tool failure (raised), as infinity is."""
    res = ToolRegistry([add]).call(call_text("add", {"a": 1, "b": 10**400}), NO_CTX)
    assert_error(res, "bad_arguments", 'argument "b" must be a number', name="add")


# ---------------------------------------------------------------------------- mutation audit


def test_a_nullable_parameter_takes_null_but_still_checks_other_values():
    """`int | None` lets null through unchecked; any other value is checked as an int."""

    def f(n: int | None = None) -> str:
        return repr(n)

    reg = ToolRegistry([f])
    assert reg.call(call_text("f", {"n": None}), NO_CTX).content == ["None"]
    assert reg.call(call_text("f", {"n": 4.0}), NO_CTX).content == ["4"]  # converted like an int parameter
    assert_error(reg.call(call_text("f", {"n": "x"}), NO_CTX), "bad_arguments",
                 'argument "n" must be an integer or null, got "x"', name="f")


def test_get_on_an_empty_registry_says_none_are_registered():
    with pytest.raises(KeyError, match=r"unknown tool 'f' \(registered: none\)"):
        ToolRegistry().get("f")


def test_any_number_type_a_tool_returns_becomes_its_text():
    """A number is any numbers.Number but complex: numpy's integers and fractions too."""
    from fractions import Fraction

    def count():
        return np.int64(3)  # not an int subclass

    def third():
        return [Fraction(1, 3), np.float32(0.5)]

    assert ToolRegistry([count]).call(call_text("count"), NO_CTX).content == ["3"]
    assert ToolRegistry([third]).call(call_text("third"), NO_CTX).content == ["1/3", "0.5"]


def test_a_returned_coroutine_is_closed_without_a_never_awaited_warning():
    import warnings

    async def inner():
        return "x"

    def f():
        return inner()

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        res = ToolRegistry([f]).call(call_text("f"), NO_CTX)
    assert res.kind == "bad_result"
    assert not [w for w in seen if "never awaited" in str(w.message)], [str(w.message) for w in seen]


@pytest.mark.parametrize(
    "expression, value",
    [
        ("2 * 101", "202"),  # the exponent limit is for ** only: 101 is any other right operand
        ("1000 - 101", "899"),
        ("3 * -200", "-600"),
        ("202 / 101", "2"),
        ("1000 // 101", "9"),  # 9 * 101 = 909, 10 * 101 = 1010
        ("1000 % 101", "91"),  # 1000 - 909
    ],
)
def test_calculator_bounds_only_the_exponent_of_a_power(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, op", [("~5", "Invert"), ("not 1", "Not")])
def test_calculator_names_a_unary_operator_it_does_not_allow(expression, op):
    with pytest.raises(ValueError, match=f"the operator {op} not allowed: use only numbers"):
        calculator(expression)


def test_registry_defaults_are_the_rollout_tools_config_defaults():
    """A registry built without timeout / max_stuck behaves as rollout.tools' defaults
    (10 s, 4 stuck calls), whether made directly or by build_registry."""
    from mmrl.vlm.config import ToolsConfig

    cfg = ToolsConfig()
    assert (cfg.timeout, cfg.max_stuck) == (10.0, 4)
    for reg in (ToolRegistry(), build_registry(["calculator"])):
        assert (reg.timeout, reg.max_stuck) == (10.0, 4)


def test_re_registering_a_tool_under_an_empty_name_is_refused_not_renamed_back():
    """A Tool given name="" is refused as Tool(fn, name="") is; it does not keep its old name."""
    def ping() -> str:
        """Answer pong."""
        return "pong"

    with pytest.raises(ValueError, match="tool name '' must be"):
        ToolRegistry().register(Tool(ping), name="")
    registry = ToolRegistry()
    registry.register(Tool(ping), name="pong", description="")
    assert registry.names() == ["pong"] and registry.get("pong").description == ""


def test_a_union_s_schema_names_each_json_type_once():
    def f(a: list[int] | tuple[int, ...] | None = None):
        pass

    assert Tool(f).parameters["properties"] == {"a": {"type": ["array", "null"], "default": None}}


def test_a_union_with_number_first_keeps_an_int_an_int():
    def f(a: float | int, b: float | str = "x"):  # noqa: PYI041
        pass

    t = Tool(f)
    assert type(t.bind({"a": 3})["a"]) is int  # int fits 3 unchanged: not the first member's 3.0
    assert type(t.bind({"a": 3.0})["a"]) is float and type(t.bind({"a": 3, "b": 2})["b"]) is float


def test_a_union_takes_a_whole_number_past_the_float_range_only_as_an_integer():
    def f(y: int | float = 0, z: float | str = ""):  # noqa: PYI041
        pass

    t = Tool(f)
    huge = 10**400  # float(huge) overflows
    with pytest.raises(ValueError, match=r'argument "z" must be a number or a string, got 1000'):
        t.bind({"z": huge})
    assert t.bind({"y": huge}) == {"y": huge}  # the int member takes it as it is


@pytest.mark.parametrize("tag", [TOOL_CALL_OPEN, TOOL_CALL_CLOSE, f"{TOOL_CALL_OPEN}{{}}{TOOL_CALL_CLOSE}"])
def test_parse_a_tag_inside_a_json_string_is_text(tag):
    # a call's own argument quoting the markup: neither the last <tool_call> nor the
    # first </tool_call> in the text bounds the call
    call = json.dumps({"name": "calc", "arguments": {"expr": tag}})
    for text in (f"{TOOL_CALL_OPEN}{call}{TOOL_CALL_CLOSE}", f"{TOOL_CALL_OPEN}\n{call}\n"):
        assert parse_tool_call(text) == ("calc", {"expr": tag})
    # the same inside an OpenAI-style arguments string, after an earlier call
    inner = json.dumps({"name": "calc", "arguments": json.dumps({"expr": tag})})
    assert parse_tool_call(call_text("first") + f" {TOOL_CALL_OPEN}{inner}{TOOL_CALL_CLOSE}") == (
        "calc", {"expr": tag})


def test_parse_a_call_after_a_malformed_one_is_still_the_last():
    # a malformed call ends at its first close tag (or runs on to the next opening tag's call)
    assert parse_tool_call('<tool_call>{"name": "a", </tool_call> <tool_call>{"name": "b"}') == ("b", {})
    assert parse_tool_call('<tool_call>{"name": "a"} junk <tool_call>{"name": "b"}</tool_call>') == ("b", {})
    with pytest.raises(ToolCallError, match="not valid JSON: Extra data"):
        parse_tool_call('<tool_call>{"name": "a"}</tool_call> <tool_call>{"name": "b"} junk</tool_call>')


def test_parse_a_malformed_call_is_cut_at_its_first_close_tag_and_a_tag_in_its_json_is_text():
    # the error names where the body, cut at the first </tool_call>, went wrong: column 14 of
    # '{"name": "a",' (a cut at the last close tag would add ' </tool_call> x' and say column 15)
    with pytest.raises(ToolCallError, match=r"Expecting property name .*line 1 column 14 \(char 13\)$"):
        parse_tool_call('<tool_call>{"name": "a", </tool_call> x </tool_call>')
    # a JSON value followed by junk: the open tag inside its string does not start another call
    with pytest.raises(ToolCallError, match=r"not valid JSON: Extra data: line 1 column 50"):
        parse_tool_call('<tool_call>{"name": "a", "arguments": {"x": "<tool_call>"}} junk</tool_call>')
