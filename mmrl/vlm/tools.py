"""Tools a VLM can call during a multi-turn rollout, and the registry that runs them.

Syntax (Qwen2.5/Qwen3's, as the chat template in tiny.py renders it): the model ends
its turn with one call,

    <tool_call>
    {"name": "zoom", "arguments": {"x0": 0, "y0": 0, "x1": 224, "y1": 224}}
    </tool_call>

and the rollout loop passes the turn's text to `ToolRegistry.call`, which parses the
LAST call in it (`parse_tool_call`), checks it against the tool's signature, runs the
tool and returns a `ToolResult`: the observation parts (text and/or PIL images) for
the next user turn inside <tool_response>...</tool_response>. The closing tag may be
missing at the very end (generation stopped at "</tool_call>" and dropped it).

A tool is a plain Python function, sync or `async def`. Its name, its docstring's
first paragraph and its signature give the JSON schema shown to the model
(`Tool.schema`). A keyword parameter named `ctx` is not shown to the model; it
receives the `ToolContext` of the prompt: ctx.images are its images at full resolution
(a jsonl task keeps each at the size the model sees and decodes the original again for
the call; each a copy the tool may change), ctx.meta the task item's meta. The
rollout makes the context only for a tool that takes `ctx` (`ToolRegistry.call` takes a
function that makes it).

Error policy: `ToolRegistry.call` never raises. Every failure of the model or of the
tool becomes a ToolResult with `error` set, a `kind` saying which failure, and the
content ["error: <message>"], a short message the model can read and correct
itself from:

    malformed      no call, not JSON, no "name", "arguments" not an object
    unknown_tool   the name is not registered
    bad_arguments  unknown, missing or wrongly typed arguments
    raised         the tool raised ("tool zoom raised ValueError: ...")
    timeout        the tool ran longer than the registry's `timeout`; its worker
                   thread is abandoned (a daemon; an async tool's task is cancelled),
                   or, under isolation "process", its process killed (and replaced).
                   A thread cannot be stopped, nor time out while the tool holds the GIL
                   in C code (a regex that backtracks): a call that ends far past its
                   timeout that way is a timeout too, and a warning says to isolate it.
                   While `max_stuck` calls of a tool still run past their timeout, a
                   new call of it is not started and gets this kind at once: each
                   abandoned thread may spin for ever, and a policy that keeps calling
                   a hanging tool would otherwise slow the run without bound
    bad_result     the tool returned something other than text, an image, a
                   number or a list of those

Errors in the registry's own setup (a duplicate name, an unusable signature, an
unknown builtin in `build_registry`) are ValueErrors raised at once.

Builtins (BUILTIN_TOOLS): `zoom` (a crop of the prompt's first image, in its original
pixel coordinates) and `calculator` (safe arithmetic, no eval). A config names tools
as builtins or as "path/to/file.py:function", like reward atoms (`build_registry`).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import math
import numbers
import operator
import pickle
import re
import time
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from mmrl.core.jsonl import LONE_SURROGATE, json_type
from mmrl.core.rewards import PLUGIN_MODULES, import_python_file, module_attribute, spec_file
from mmrl.core.timeouts import Stuck, StuckCalls
from mmrl.vlm.tool_process import (  # ToolContext lives there: a tool's process unpickles it without torch
    ToolContext,
    ToolProcessError,
    ToolProcesses,
    ToolProcessRaised,
    ToolProcessTimeout,
)

__all__ = [
    "BUILTIN_TOOLS",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "Tool",
    "ToolCallError",
    "ToolContext",
    "ToolRegistry",
    "ToolResult",
    "build_registry",
    "calculator",
    "parse_tool_call",
    "zoom",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
RESULT_KINDS = (
    "ok",
    "malformed",
    "unknown_tool",
    "bad_arguments",
    "raised",
    "timeout",
    "bad_result",
)

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what OpenAI/Qwen function names allow
_CTX = "ctx"  # the keyword parameter that receives the ToolContext
_SHOWN = 60  # characters of a model's value quoted back in an error message


@dataclass
class ToolResult:
    """The outcome of one call. On error, content is ["error: <error>"]."""

    content: list  # observation parts in order: str and/or PIL.Image.Image
    error: str | None = None  # None on success; else a short reason
    name: str | None = None  # the tool called, if the call could be parsed that far
    kind: str = "ok"  # one of RESULT_KINDS

    @property
    def ok(self) -> bool:
        return self.error is None


class ToolCallError(ValueError):
    """A tool call the model wrote cannot be parsed; the message is meant for the model."""


# ---------------------------------------------------------------------------- parsing


def parse_tool_call(text: str) -> tuple[str, dict]:
    """(name, arguments) of the LAST <tool_call>...</tool_call> in `text`.

    The closing tag may be missing (then everything after the last open tag is the
    call). The call is a JSON object with "name" (a non-empty string) and "arguments"
    (an object; a JSON string holding an object is accepted; missing or null -> {}).
    A tag inside a call's JSON strings (`{"arguments": {"expr": "</tool_call>"}}`) is
    text, not a tag (`_last_call_body`). Raises ToolCallError with a message a model
    could read."""
    if not isinstance(text, str):
        raise ToolCallError(f"tool call text must be a string, got {type(text).__name__}")
    body, call = _last_call_body(text)
    if call is _UNREAD:
        if not body:
            raise ToolCallError("tool call is empty")
        try:
            call = json.loads(body)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, an integer of over 4300 digits, deep nesting
            raise ToolCallError(f"tool call is not valid JSON: {_json_error(e)}") from None
    if not isinstance(call, dict):
        raise ToolCallError(
            f'tool call must be a JSON object with "name" and "arguments", got {_json_type(call)}'
        )
    if "name" not in call:
        raise ToolCallError('tool call has no "name"')
    name = call["name"]
    if not isinstance(name, str) or not name.strip():
        raise ToolCallError(f'tool call "name" must be a non-empty string, got {_show(name)}')
    arguments = call.get("arguments")
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):  # OpenAI-style: the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as e:
            raise ToolCallError(f'tool call "arguments" string is not valid JSON: {_json_error(e)}') from None
        if arguments is None:  # "null" as a string, as null itself
            arguments = {}
    if not isinstance(arguments, dict):
        raise ToolCallError(
            f'tool call "arguments" must be a JSON object, got {_json_type(arguments)}'
        )
    return name.strip(), arguments


_UNREAD = object()  # _last_call_body's mark for a body that is not one JSON value up to its close tag
_DECODER = json.JSONDecoder()


def _last_call_body(text: str) -> tuple[str, object]:
    """The body of the last call in `text` and its JSON value (_UNREAD where it has none).

    Read left to right: a call whose body is one JSON value followed by the close tag (or
    by nothing) ends after that value, so a tag inside its strings is never taken for the
    next call's opening tag or for its own close tag. Any other body ends at the first
    close tag after its opening tag, as a model's malformed call is cut for the error
    message; a later opening tag then still starts the next call."""
    found, at = None, text.find(TOOL_CALL_OPEN)
    if at < 0:
        raise ToolCallError(f"no tool call found (expected {TOOL_CALL_OPEN} ... {TOOL_CALL_CLOSE})")
    while at >= 0:
        start = at + len(TOOL_CALL_OPEN)
        begin = len(text) - len(text[start:].lstrip())
        try:
            value, end = _DECODER.raw_decode(text, begin)
        except (ValueError, RecursionError):
            value, end = _UNREAD, None
        rest = text[end:].lstrip() if end is not None else None
        if rest is not None and (not rest or rest.startswith(TOOL_CALL_CLOSE)):
            found, after = (text[begin:end], value), end
        else:
            close = text.find(TOOL_CALL_CLOSE, start)
            found = (text[start:close if close >= 0 else len(text)].strip(), _UNREAD)
            # inside a JSON value that parsed, a tag is text: the next call opens after it
            after = end if end is not None else start
        at = text.find(TOOL_CALL_OPEN, after)
    return found


def _json_error(e: Exception) -> str:
    return "nested too deeply" if isinstance(e, RecursionError) else str(e)


def _json_type(value) -> str:
    """As the data loaders name types, but in JSON's words for the model: a list is "an array"."""
    return "an array" if isinstance(value, list) else json_type(value)


def _show(value) -> str:
    text = (
        json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
    )
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


# ---------------------------------------------------------------------------- tools

# Python annotation -> (JSON schema type, the check applied to a model's value).
_JSON_TYPES = {
    int: "integer",
    float: "number",
    str: "string",
    bool: "boolean",
    list: "array",
    dict: "object",
}
_TYPE_WORDS = {
    "integer": "an integer",
    "number": "a number",
    "string": "a string",
    "boolean": "true or false",
    "array": "an array",
    "object": "an object",
}


@dataclass
class _Param:
    name: str
    json_types: tuple[str, ...]  # () for any JSON value; several for a union like `int | str`
    nullable: bool  # annotated `X | None`
    required: bool
    default: object = None


class Tool:
    """A callable the model may call by name.

    fn: a sync or `async def` function (or an object with such a __call__). Its
        parameters are the tool's arguments; annotations int, float, str, bool, list,
        dict and unions of them (optionally `| None`) give the schema types and the
        argument checks; a keyword parameter named `ctx` receives the ToolContext and is
        hidden from the model. *args and positional-only parameters are not allowed; **kwargs accepts
        extra arguments unchecked.
    name: default fn.__name__; letters, digits, "_" and "-", at most 64.
    description: default the first paragraph of fn's docstring.
    isolation: "thread" or "process" (see ToolRegistry); None (default): the registry's.
    """

    def __init__(self, fn: Callable, *, name: str | None = None, description: str | None = None,
                 isolation: str | None = None):
        if not callable(fn):
            raise TypeError(f"a tool must be callable, got {type(fn).__name__}")
        name = name if name is not None else getattr(fn, "__name__", None)
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(
                f"tool name {name!r} must be 1-64 letters, digits, '_' or '-' "
                "(pass name= for lambdas and callable objects)"
            )
        if description is None:
            doc = inspect.getdoc(fn) or ""
            description = " ".join(doc.split("\n\n")[0].split())
        self.name = name
        self.fn = fn
        self.description = description
        self.isolation = _check_isolation(isolation, allow_none=True)
        self.origin: tuple[str, str, bool] | None = None  # (file, attribute, a Tool there) of a "file.py:fn" tool
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            type(fn).__call__  # an object with an `async def __call__`
        )
        self._params, self.wants_context, self._extra_ok = _read_signature(fn, name)
        self.parameters = _parameters_schema(self._params)

    def schema(self) -> dict:
        """{"type": "function", "function": {"name", "description", "parameters"}}."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def bind(self, arguments: dict) -> dict:
        """The keyword arguments to call fn with (without ctx), checked and converted
        (integral floats -> int for int parameters, ints -> float for float ones).
        Raises ValueError with a message for the model."""
        problems = []
        known = {p.name for p in self._params}
        unknown = [a for a in arguments if a not in known]
        if unknown and not self._extra_ok:
            problems.append(f"unknown argument{'s' if len(unknown) > 1 else ''} {_names(unknown)}")
        missing = [p.name for p in self._params if p.required and p.name not in arguments]
        if missing:
            problems.append(f"missing argument{'s' if len(missing) > 1 else ''} {_names(missing)}")
        kwargs = {}
        for p in self._params:
            if p.name in arguments:
                value, problem = _convert(p, arguments[p.name])
                if problem:
                    problems.append(problem)
                kwargs[p.name] = value
        if self._extra_ok:
            kwargs.update({a: arguments[a] for a in unknown})
        if problems:
            params = ", ".join(p.name for p in self._params) or "none"
            raise ValueError(f"tool {self.name}: {'; '.join(problems)} (parameters: {params})")
        return kwargs

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        params = ", ".join(p.name for p in self._params)
        return f"Tool({self.name!r}, ({params}){', async' if self.is_async else ''})"


def _read_signature(fn: Callable, name: str) -> tuple[list[_Param], bool, bool]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ValueError(f"tool {name}: cannot read its signature: {e}") from e
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 -- unresolvable annotations: fall back to the raw ones
        hints = {}
    params, wants_context, extra_ok = [], False, False
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL or p.kind is p.POSITIONAL_ONLY:
            raise ValueError(
                f"tool {name}: parameter {p.name!r} cannot be passed by name; "
                "tools take keyword arguments only"
            )
        if p.kind is p.VAR_KEYWORD:
            extra_ok = True
            continue
        if p.name == _CTX:
            wants_context = True
            continue
        annotation = hints.get(p.name, p.annotation)
        json_types, nullable = _json_types_of(annotation)
        nullable = nullable or p.default is None  # `x: int = None` means `int | None`: the model may pass null
        required = p.default is p.empty
        params.append(
            _Param(p.name, json_types, nullable, required, None if required else p.default)
        )
    return params, wants_context, extra_ok


def _json_types_of(annotation) -> tuple[tuple[str, ...], bool]:
    """(JSON schema types, () for any; whether None is allowed). A union is checked
    member by member, so `int | float` refuses a string; a union with a member JSON
    has no type for (a class, Any) takes any value."""
    if annotation is inspect.Parameter.empty or annotation is typing.Any:
        return (), False
    members, nullable = [annotation], False
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        nullable = len(members) < len(typing.get_args(annotation))
    json_types = []
    for member in members:
        base = typing.get_origin(member) or member
        if base is tuple or base is Sequence:
            base = list
        if base not in _JSON_TYPES:
            return (), nullable
        if _JSON_TYPES[base] not in json_types:
            json_types.append(_JSON_TYPES[base])
    return tuple(json_types), nullable


def _parameters_schema(params: list[_Param]) -> dict:
    properties = {}
    for p in params:
        prop: dict = {}
        if p.json_types:
            types_ = [*p.json_types, "null"] if p.nullable else list(p.json_types)
            prop["type"] = types_[0] if len(types_) == 1 else types_
        if not p.required and _is_json(p.default):
            prop["default"] = p.default
        properties[p.name] = prop
    return {
        "type": "object",
        "properties": properties,
        "required": [p.name for p in params if p.required],
    }


def _is_json(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _convert(p: _Param, value) -> tuple[object, str | None]:
    """(value to pass, problem or None) for a model's argument `value`."""
    if not p.json_types or (value is None and p.nullable):
        return value, None
    converted = [c for c in (_as_json_type(t, value) for t in p.json_types) if c is not _WRONG]
    # A union takes the value as it is where a member fits it unchanged (3 stays an
    # int for `int | float`), else the first member's conversion (3.0 -> 3 for `int | str`).
    for c in converted:
        if type(c) is type(value):
            return c, None
    if converted:
        return converted[0], None
    words = " or ".join([*(_TYPE_WORDS[t] for t in p.json_types), *(["null"] if p.nullable else [])])
    return value, f'argument "{p.name}" must be {words}, got {_show(value)}'


_WRONG = object()


def _as_json_type(kind: str, value):
    """`value` as JSON type `kind` (integral floats -> int, ints -> float), or _WRONG."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "integer":
        if is_number and isinstance(value, float) and value.is_integer():
            value = int(value)
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "number":
        if is_number and isinstance(value, int):
            try:
                value = float(value)
            except OverflowError:  # a whole number past the float range: the model's mistake
                return _WRONG
        ok = is_number and math.isfinite(value)
    elif kind == "string":
        ok = isinstance(value, str)
    elif kind == "boolean":
        ok = isinstance(value, bool)
    elif kind == "array":
        ok = isinstance(value, list)
    else:  # "object"
        ok = isinstance(value, dict)
    return value if ok else _WRONG


def _names(names: list[str]) -> str:
    return ", ".join(f'"{n}"' for n in names)


# ---------------------------------------------------------------------------- registry


class _ToolTimeout(Exception):
    pass


class _HeldGIL(Exception):
    """A call that ended past its timeout, holding the GIL; args[0] says so."""


ISOLATIONS = ("thread", "process")


def _check_isolation(isolation, allow_none: bool = False):
    if (isolation is None and allow_none) or isolation in ISOLATIONS:
        return isolation
    raise ValueError(f"isolation must be 'thread' or 'process', got {isolation!r}")


class ToolRegistry:
    """The tools of a rollout, by name; `call` runs one from a model's text.

    tools: callables (wrapped as Tool(fn)) or Tool objects.
    timeout: seconds one call may run (> 0). A call that runs longer returns kind
        "timeout" at once; its worker thread is left to finish on its own (a daemon).
    max_stuck: calls of one tool that may be left running past their timeout (>= 1);
        while that many still run, the tool's calls return "timeout" without running.
    isolation: where a tool runs (a Tool's own `isolation` overrides it). "thread" (default):
        a thread of this process, which a call that outlasts its timeout leaves
        running, and which cannot time out at all while the tool holds the GIL in C code (a
        regex that backtracks for ever hangs the rollout). "process": a worker process per
        concurrent call (mmrl.vlm.tool_process), killed at the timeout and replaced; the tool
        must be importable there (a builtin, a "file.py:fn" tool, a module-level function),
        and its arguments and result are pickled (a calculator call costs what a thread's does,
        about 0.1 ms; a fresh process's start is not on the call's clock).
    """

    def __init__(self, tools: Iterable[Callable | Tool] = (), *, timeout: float = 10.0, max_stuck: int = 4,
                 isolation: str = "thread"):
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, numbers.Real)
            or not (math.isfinite(timeout) and timeout > 0)
        ):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self._stuck = StuckCalls(max_stuck, "tool")  # per tool: calls left running past the timeout
        self.max_stuck = self._stuck.limit
        self.isolation = _check_isolation(isolation)
        self._processes: dict[str, ToolProcesses] = {}
        self._gil_warned: set[str] = set()
        self._tools: dict[str, Tool] = {}
        for t in tools:
            self.register(t)

    def register(self, fn=None, *, name: str | None = None, description: str | None = None):
        """Add a tool. Use as `registry.register(fn)`, `@registry.register` or
        `@registry.register(name="x", description="...")`; returns fn unchanged.
        A name already registered -> ValueError."""
        if fn is None:
            return lambda f: self.register(f, name=name, description=description)
        if isinstance(fn, Tool):
            tool = fn
            if name is not None or description is not None:
                tool = Tool(fn.fn, name=fn.name if name is None else name,  # "" is refused, not the old name
                            description=fn.description if description is None else description,
                            isolation=fn.isolation)
                tool.origin = fn.origin  # its file still holds it under its attribute's name
        else:
            tool = Tool(fn, name=name, description=description)
        if tool.name in self._tools:
            raise ValueError(f"a tool named {tool.name!r} is already registered")
        if self._isolated(tool) and tool.origin is None:  # a file's tool is imported from its file there
            try:  # another process imports it by name: said now, not at the model's first call
                pickle.dumps(tool.fn)
            except Exception as e:  # noqa: BLE001 -- a lambda, a closure, a local function
                raise ValueError(f"tool {tool.name!r}: isolation 'process' runs it in another process, which "
                                 f"cannot import it ({_describe(e)}); define it at the top level of a module, "
                                 "or name it as 'path/to/file.py:function'") from None
        self._tools[tool.name] = tool
        return fn

    def names(self) -> list[str]:
        return list(self._tools)

    def schemas(self) -> list[dict]:
        """Each tool's schema, in registration order (the chat template's `tools`)."""
        return [t.schema() for t in self._tools.values()]

    def get(self, name: str) -> Tool:
        if name not in self._tools:
            raise KeyError(
                f"unknown tool {name!r} (registered: {', '.join(self._tools) or 'none'})"
            )
        return self._tools[name]

    def __contains__(self, name) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def __repr__(self) -> str:
        return (f"ToolRegistry({self.names()!r}, timeout={self.timeout}, max_stuck={self.max_stuck}, "
                f"isolation={self.isolation!r})")

    def stuck(self, name: str) -> int:
        """Calls of tool `name` abandoned at their timeout and still running."""
        return self._stuck(name)

    def call(self, text: str, ctx: ToolContext | Callable[[], ToolContext]) -> ToolResult:
        """Parse the last tool call in `text` and run it (see the module docstring). `ctx` may be
        a function that makes the context, called only for a tool that takes one (a rollout's
        decodes full-resolution images). Never raises."""
        try:
            name, arguments = parse_tool_call(text)
        except ToolCallError as e:
            return _error(str(e), "malformed")
        except Exception as e:  # noqa: BLE001 -- the contract: call never raises
            return _error(f"the tool call could not be read: {_describe(e)}", "malformed")
        return self.invoke(name, arguments, ctx)

    def invoke(self, name: str, arguments: dict, ctx: ToolContext | Callable[[], ToolContext]) -> ToolResult:
        """Run tool `name` with already parsed `arguments` (`ctx` as for `call`). Never raises."""
        try:
            if name not in self._tools:
                available = ", ".join(self._tools) or "none"
                return _error(
                    f"unknown tool {_show(name)} (available: {available})", "unknown_tool"
                )
            tool = self._tools[name]
            try:
                kwargs = tool.bind(arguments)
            except ValueError as e:
                return _error(str(e), "bad_arguments", name)
            if tool.wants_context:  # made here, outside the tool's timeout: decoding is not the tool's time
                try:
                    kwargs[_CTX] = ctx() if callable(ctx) else ctx
                except Exception as e:  # noqa: BLE001 -- e.g. an image file changed since load
                    return _error(f"tool {name} not run: the prompt's images could not be read: {_describe(e)}",
                                  "raised", name)
            try:
                value = self._run(tool, kwargs)
            except _ToolTimeout:
                return _error(f"tool {name} timed out after {self.timeout:g} s", "timeout", name)
            except _HeldGIL as e:
                return _error(e.args[0], "timeout", name)
            except Stuck as e:
                return _error(f"tool {name} not run: {e.args[0]} earlier calls of it are still running past "
                              f"the {self.timeout:g} s timeout", "timeout", name)
            except ToolProcessRaised as e:  # described in its process
                return _error(f"tool {name} raised {e.args[0]}", "raised", name)
            except ToolProcessError as e:
                return _error(f"tool {name}: {e.args[0]}", "raised", name)
            except BaseException as e:  # noqa: BLE001 -- whatever the tool raised goes to the model
                return _error(f"tool {name} raised {_describe(e)}", "raised", name)
            try:
                content = _as_content(value)
            except ValueError as e:
                return _error(f"tool {name} returned {e}", "bad_result", name)
            return ToolResult(content=content, name=name)
        except Exception as e:  # noqa: BLE001 -- the contract: call never raises
            return _error(f"tool {_show(name)} failed: {_describe(e)}", "raised", name)

    def _isolated(self, tool: Tool) -> bool:
        return (tool.isolation or self.isolation) == "process"

    def _run(self, tool: Tool, kwargs: dict):
        """tool.fn(**kwargs) in a daemon thread (an async fn on its own event loop there),
        waiting at most self.timeout seconds; not started while max_stuck calls of it are
        still running past theirs (mmrl.core.timeouts). Isolated: in a worker process."""
        if self._isolated(tool):
            return self._run_in_process(tool, kwargs)
        box: dict = {}
        timeout = self.timeout

        def work():
            try:
                if tool.is_async:
                    box["value"] = asyncio.run(_await_with_timeout(tool.fn(**kwargs), timeout))
                else:
                    box["value"] = tool.fn(**kwargs)
            except BaseException as e:  # noqa: BLE001 -- handed to the caller
                box["error"] = e

        start = time.perf_counter()
        if not self._stuck.run(tool.name, work, timeout):  # Stuck: not started, for invoke to report
            raise _ToolTimeout
        took = time.perf_counter() - start
        # the timeout's wait woke this late: the tool held the GIL past the timeout (the margin is
        # for a loaded machine that wakes a waiting thread late)
        if took > 2 * timeout + 0.1:
            self._held_gil(tool.name, took)
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _held_gil(self, name: str, took: float):
        """A call that finished far past its timeout, the timeout's wait kept from waking: the
        tool held the GIL (C code: a regex, big-integer arithmetic). It is a timeout, and said
        once per tool: the same call with other input may never end, and hang the rollout."""
        message = (f"tool {name} ran {took:.3g} s, past its {self.timeout:g} s timeout, holding Python's GIL "
                   "(C code such as a regex or big-integer arithmetic), which no thread can interrupt")
        if name not in self._gil_warned:
            self._gil_warned.add(name)
            warnings.warn(f"{message}: a call that never ends would hang the rollout; run it in a process "
                          "killed at the timeout: rollout.tools.isolation: process (or Tool(fn, "
                          "isolation='process'))", stacklevel=4)
        raise _HeldGIL(message)

    def _run_in_process(self, tool: Tool, kwargs: dict):
        procs = self._processes.get(tool.name)
        if procs is None:
            load = (("file", *tool.origin) if tool.origin is not None
                    else ("pickle", pickle.dumps(tool.fn)))
            # a ctx's images unpickle with PIL: imported as the process starts, not on the call's clock
            procs = self._processes.setdefault(tool.name, ToolProcesses(load, ["PIL.Image"] if tool.wants_context else []))
        try:
            return procs.call(kwargs, self.timeout)
        except ToolProcessTimeout:
            raise _ToolTimeout from None

    def close(self) -> None:
        """Stop the tools' idle worker processes (isolation "process"); a later call starts new ones."""
        for procs in self._processes.values():
            procs.close()


async def _await_with_timeout(awaitable, timeout: float):
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        task.cancel()  # asyncio.run waits for the cancellation as the loop closes
        raise _ToolTimeout
    return task.result()


def _error(message: str, kind: str, name: str | None = None) -> ToolResult:
    message = _utf8(message)  # an exception's message may quote undecodable bytes too
    return ToolResult(content=[f"error: {message}"], error=message, name=name, kind=kind)


def _utf8(text: str) -> str:
    """`text` with each lone surrogate replaced by U+FFFD: bytes read with errors="surrogateescape"
    (os.listdir, subprocess output, a file of another encoding) leave them in a str, and no
    tokenizer takes such a str (a TypeError that stopped the run)."""
    return LONE_SURROGATE.sub("\ufffd", text)


def _describe(exc: BaseException) -> str:
    msg = str(exc)
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def _as_content(value) -> list:
    """A tool's return value -> observation parts; ValueError says what was wrong."""
    parts = value if isinstance(value, (list, tuple)) else [value]
    if isinstance(value, (list, tuple)) and not value:
        raise ValueError("an empty list")
    content = []
    for part in parts:
        if isinstance(part, str):
            content.append(_utf8(part))
        elif isinstance(part, Image.Image):
            content.append(part)
        elif isinstance(part, bool):  # the model writes JSON: true, not Python's True
            content.append(json.dumps(part))
        elif isinstance(part, numbers.Number) and not isinstance(part, complex):
            content.append(str(part))
        else:
            if inspect.iscoroutine(part):
                part.close()  # no "never awaited" warning
                raise ValueError("a coroutine; declare the function with async def")
            raise ValueError(  # noqa: TRY004 -- reported to the model as a bad_result
                f"{type(part).__name__}, expected text, an image, a number or a list of those"
            )
    return content


# ---------------------------------------------------------------------------- builtin tools


def zoom(x0: int, y0: int, x1: int, y1: int, *, ctx: ToolContext) -> Image.Image:
    """Zoom into the image: returns the part of the original full-resolution image
    inside the box from (x0, y0) to (x1, y1), in that image's pixel coordinates
    (right and bottom edges excluded).

    Uses the first image of the prompt (ctx.images[0], at full resolution). The crop is
    shown to the model resized within tools.image_max_pixels. A box partly outside the
    image is clipped to it.
    ValueError: no image in the prompt, x1 <= x0 or y1 <= y0, a box outside the image.
    """
    x0, y0, x1, y1 = (_as_int(v, n) for v, n in ((x0, "x0"), (y0, "y0"), (x1, "x1"), (y1, "y1")))
    if not ctx.images:
        raise ValueError("there is no image in the prompt to zoom into")
    image = ctx.images[0]
    if not isinstance(image, Image.Image):
        raise ValueError(  # noqa: TRY004 -- tools report every failure as a ValueError
            f"the prompt's image is {type(image).__name__}, not a PIL image"
        )
    if x1 <= x0:
        raise ValueError(f"x1 must be greater than x0, got x0={x0}, x1={x1}")
    if y1 <= y0:
        raise ValueError(f"y1 must be greater than y0, got y0={y0}, y1={y1}")
    width, height = image.size
    cx0, cy0, cx1, cy1 = max(x0, 0), max(y0, 0), min(x1, width), min(y1, height)
    if cx1 <= cx0 or cy1 <= cy0:
        raise ValueError(
            f"the box ({x0}, {y0}, {x1}, {y1}) lies outside the image, which is "
            f"{width}x{height} pixels (x in 0..{width}, y in 0..{height})"
        )
    return image.crop((cx0, cy0, cx1, cy1))


def _as_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be an integer, got {value!r}")  # noqa: TRY004
    if isinstance(value, numbers.Integral):
        return int(value)
    if not float(value).is_integer():
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


_MAX_EXPRESSION = 200  # characters
_MAX_EXPONENT = 100
_MAX_MAGNITUDE = 1e100
_BINARY_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_NODE_WORDS = {
    ast.Name: "names",
    ast.Call: "function calls",
    ast.Attribute: "attributes",
    ast.Subscript: "indexing",
    ast.Compare: "comparisons",
    ast.BoolOp: "and/or",
    ast.Lambda: "lambdas",
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses,
    e.g. "(3 + 4) * 2 / 7". Returns the result as text.

    Safe: parsed with `ast`, never eval'd. ValueError for anything else (names, calls,
    attributes, ...), division by zero, |exponent| > 100, results or numbers beyond
    1e100 in magnitude, and expressions longer than 200 characters.
    """
    if not isinstance(expression, str):
        raise ValueError(  # noqa: TRY004 -- tools report every failure as a ValueError
            f"expression must be a string, got {type(expression).__name__}"
        )
    if len(expression) > _MAX_EXPRESSION:
        raise ValueError(
            f"expression is {len(expression)} characters long; at most {_MAX_EXPRESSION} allowed"
        )
    if not expression.strip():
        raise ValueError("expression is empty")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"invalid syntax: {e.msg}") from None
    return _format_number(_evaluate(tree.body))


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"only numbers are allowed, got {value!r}")  # noqa: TRY004
        return _checked(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        return _UNARY_OPS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(
                f"exponent too large: {_format_number(right)} (at most {_MAX_EXPONENT})"
            )
        try:
            result = _BINARY_OPS[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError(f"result too large (beyond {_MAX_MAGNITUDE:g})") from None
        if isinstance(result, complex):
            raise ValueError("result is not a real number")
        return _checked(result)
    what = _NODE_WORDS.get(type(node))
    if what is None:
        op = getattr(node, "op", None)
        what = f"the operator {type(op).__name__}" if op is not None else type(node).__name__
    raise ValueError(f"{what} not allowed: use only numbers, + - * / // % ** and parentheses")


def _checked(value: float) -> float:
    if isinstance(value, float) and math.isnan(value):
        raise ValueError("result is not a number")
    if abs(value) > _MAX_MAGNITUDE:
        raise ValueError(f"result too large (beyond {_MAX_MAGNITUDE:g})")
    return value


def _format_number(value: float) -> str:
    """Integers (and integral floats below 2**53) without a decimal point, other floats
    to 12 significant digits: 0.1 + 0.2 -> "0.3", 1 / 3 -> "0.333333333333"."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return f"{value:.12g}"


BUILTIN_TOOLS: dict[str, Callable] = {"zoom": zoom, "calculator": calculator}


def build_registry(
    names: Sequence[str], *, timeout: float = 10.0, base_dir: str | Path | None = None, max_stuck: int = 4,
    isolation: str = "thread",
) -> ToolRegistry:
    """A registry of the named tools. Each name is a builtin (BUILTIN_TOOLS) or
    "path/to/file.py:function" for a user's sync or async function (or Tool object);
    a relative path resolves against base_dir (default: the current directory), as
    for reward atoms. Each file is imported once, a plugin's file (`plugins:`) not again:
    its tools share the module (and its state) with the plugin's other code. An unknown
    builtin or a bad path -> ValueError naming it and listing the builtins. `isolation`: the
    registry's (a file's tool runs in a process that imports its file again)."""
    if isinstance(names, str):
        names = [names]
    builtins = ", ".join(BUILTIN_TOOLS)
    registry = ToolRegistry(timeout=timeout, max_stuck=max_stuck, isolation=isolation)
    modules: dict[Path, object] = {}
    given: dict[str, str] = {}  # tool name -> the spec that registered it, for a clash's message

    def add(spec: str, tool, name: str, origin: tuple | None = None) -> None:
        if name in given:
            first = given[name]
            by = f"the builtin {first}" if first in BUILTIN_TOOLS else repr(first)
            same = " (named twice)" if first == spec else ""
            raise ValueError(f"tool {spec!r}: the name {name!r} is taken by {by}{same}; tools need "
                             "distinct names (rename the function, or give it one with Tool(fn, name=...))")
        if not isinstance(tool, Tool):
            tool = Tool(tool, name=name)
        # where an isolated tool's process imports it from: set before register, which needs no
        # pickle of a tool its process loads from its file (a Tool there may wrap a closure)
        tool.origin = origin
        registry.register(tool)
        given[name] = spec

    for spec in names:
        if not isinstance(spec, str):
            raise ValueError(  # noqa: TRY004 -- a config error, like the others here
                f"tool names must be strings, got {spec!r} (builtins: {builtins})"
            )
        if spec in BUILTIN_TOOLS:
            add(spec, BUILTIN_TOOLS[spec], spec)
            continue
        file_part, _, attr = spec.rpartition(":")
        if not file_part or not attr:
            raise ValueError(
                f"unknown tool {spec!r}: not a builtin ({builtins}) "
                "and not 'path/to/file.py:function'"
            )
        what = f"tool {spec!r}"
        path = spec_file(file_part, base_dir)
        if not path.is_file():
            raise ValueError(f"{what}: file not found: {path} (builtins: {builtins})")
        if path not in modules:  # a plugin's file is that module, as for reward atoms: imported once
            modules[path] = PLUGIN_MODULES.get(path) or import_python_file(path, what)
        obj = module_attribute(modules[path], attr, what, path.name)
        if isinstance(obj, Tool):
            add(spec, obj, obj.name, (str(path), attr, True))
        elif callable(obj):
            add(spec, obj, attr, (str(path), attr, False))
        else:
            raise ValueError(  # noqa: TRY004 -- a config error, like the others here
                f"{what}: {attr!r} is not callable (it is {type(obj).__name__})"
            )
    return registry
