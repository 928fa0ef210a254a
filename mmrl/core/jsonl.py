"""Reading users' JSON-lines data files, with errors that say where: the backends' own
loaders (VLM questions, dLLM problems) check the fields of each object they get here."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["DatasetError", "HeldOutWarning", "answer_text", "json_line", "json_type", "read_objects", "text_and_answer"]


class DatasetError(ValueError):
    """A problem with a dataset file. `.path`, `.line` (1-based, None for the whole
    file) and `.field` (None if no single field) say where."""

    def __init__(self, path, line: int | None, field: str | None, problem: str):
        where = str(path)
        if line is not None:
            where += f", line {line}"
        if field is not None:
            where += f", field {field!r}"
        super().__init__(f"{where}: {problem}")
        self.path = str(path)
        self.line = line
        self.field = field
        self.problem = problem


class HeldOutWarning(UserWarning):
    """A warning about what held-out evaluation measures (held-out items that are training
    items too). Only verbs that evaluate show it: `sample` and `serve` build the same task but
    report no held-out metric, so there it is noise."""


# Lines end in LF, CRLF or a lone CR (old Mac files). Not str.splitlines(): it also splits at U+2028,
# U+0085 and a form feed, which a line's text may hold, and line numbers drift from an editor's.
LINE_END = re.compile(r"\r\n|\r|\n")
LINE_END_BYTES = re.compile(rb"\r\n|\r|\n")


def text_lines(text: str) -> list[str]:
    """`text`'s lines as an editor numbers them, each without a byte-order mark at its start (a
    file's, or one where files were joined: `cat a.txt b.txt`)."""
    return [line.removeprefix("\ufeff") for line in LINE_END.split(text)]


def read_objects(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line of a UTF-8 JSONL file (a byte-order mark
    allowed, at the start of any line); a DatasetError naming the line for text that is not one JSON object."""
    path = Path(path).expanduser()
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DatasetError(path, None, None, f"cannot read the file: {e.strerror or e}") from e
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\x00" in raw[:4]:
        # Notepad's "Unicode", PowerShell's `>`: UTF-16, whose ASCII half-bytes read as NULs
        # (or, with its byte-order mark, as "line 1: not valid UTF-8 (byte 0xff)")
        raise DatasetError(path, None, None, "is UTF-16 (or another encoding of two or more bytes a "
                                             "character, with NUL bytes between the letters); save the file as UTF-8")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        *before, start = LINE_END_BYTES.split(raw[:e.start])  # the lines' ends as below
        column = len(start.decode("utf-8")) + 1  # in characters, as an editor counts
        legacy = raw[e.start:e.start + 1].decode("cp1252", errors="ignore")  # the usual other encoding
        guess = f": {legacy!r} in Latin-1 or Windows-1252" if legacy.isprintable() and legacy else ""
        raise DatasetError(path, len(before) + 1, None, f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column "
                                                        f"{column}{guess}); save the file as UTF-8") from e
    # LINE_END's lines (a lone CR too: old Mac files read as one line with "Extra data"); JSON text
    # holds a CR only escaped, and may hold U+2028 unescaped
    parts = re.split(f"({LINE_END.pattern})", text)  # lines, each followed by its end
    for lineno, (line, end) in enumerate(zip(parts[0::2], [*parts[1::2], ""]), start=1):
        # a byte-order mark opens the file, or a line where files were joined (`cat a.jsonl b.jsonl`)
        line = line.removeprefix("\ufeff")
        if not line.strip():
            continue
        try:
            obj = json.loads(line, object_pairs_hook=_no_repeated_keys)
        except json.JSONDecodeError as e:
            if e.msg.startswith("Invalid control character"):  # "... at": an editor's tab or a pasted NUL
                raise DatasetError(path, lineno, None, f"invalid JSON: a raw control character "
                                   f"(U+{ord(line[e.pos]):04X}) inside a string at column {e.colno}; JSON writes it "
                                   f"escaped, as {json.dumps(line[e.pos])}") from e
            msg = e.msg.removesuffix(" at")  # json's "Unterminated string starting at", then ours
            if msg.startswith("Unterminated string") and end == "\r":  # a raw CR in a string ends the line
                msg += (f" at column {e.colno} (the line ends at a lone carriage return, CR, inside the string; JSON "
                        "writes it escaped, as \"\\r\")")
                raise DatasetError(path, lineno, None, f"invalid JSON: {msg}") from e
            raise DatasetError(path, lineno, None, f"invalid JSON: {msg} at column {e.colno}"
                                                   f"{_not_json_lines(text, line)}") from e
        except _RepeatedKey as e:  # json keeps the last silently: an answer given twice is a data error
            raise DatasetError(path, lineno, e.key, "given twice on this line") from None
        if not isinstance(obj, dict):
            hint = _not_json_lines(text, line) if isinstance(obj, list) else ""
            raise DatasetError(path, lineno, None, f"expected a JSON object, got {json_type(obj)}{hint}")
        yield lineno, obj


def _not_json_lines(text: str, line: str) -> str:
    """Why a line does not parse where the file is JSON laid out otherwise: one array of the
    objects (a .json file), or an object pretty-printed over several lines. Both read as
    "Expecting value at column 2", as if the data were broken. Else ""."""
    try:
        whole = json.loads(text.removeprefix("\ufeff"))
    except (json.JSONDecodeError, RecursionError):
        whole = None
    if isinstance(whole, list) and whole and all(isinstance(o, dict) for o in whole):
        return (f" (the file is one JSON array of {len(whole)} objects, not JSON lines: write each object on a "
                "line of its own, e.g. with `jq -c '.[]' FILE`)")
    start = text.find(line)  # the line's first occurrence: enough for a hint
    try:
        obj, end = json.JSONDecoder().raw_decode(text, start + len(line) - len(line.lstrip()))
    except (json.JSONDecodeError, RecursionError):
        return ""
    if isinstance(obj, dict) and ("\n" in text[start:end] or "\r" in text[start:end]):
        return (" (an object spread over several lines: JSON lines hold each object on one line, e.g. written "
                "by `jq -c . FILE`)")
    return ""


class _RepeatedKey(Exception):
    def __init__(self, key: str):
        self.key = key


def _no_repeated_keys(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedKey(key)
        out[key] = value
    return out


def text_and_answer(obj: dict[str, Any], text_field: str, error: Callable[[str, str], Exception]) -> tuple[str, str]:
    """A line's `text_field` (a non-empty string: the question or prompt) and its "answer" (a
    non-empty string or a finite number, as a string); `error(field, problem)` makes the error."""
    for name in (text_field, "answer"):
        if name not in obj:  # the line's own keys show a "Prompt", an "answer " or a "question"
            keys = ", ".join(repr(k) for k in list(obj)[:8]) + (", ..." if len(obj) > 8 else "")
            raise error(name, f"missing (each line needs a {text_field} and an answer, named in lower case; "
                              f"the keys given: {keys or 'none'})")
    text = obj[text_field]
    if not isinstance(text, str):
        raise error(text_field, f"must be a string, got {json_type(text)}")
    if not text.strip():
        raise error(text_field, "is empty")
    _check_surrogates(text, text_field, error)
    return text, answer_text(obj["answer"], "answer", error)


# Half of a UTF-16 pair alone in a str (json's "\\ud800", bytes read with errors="surrogateescape"):
# no tokenizer encodes it (`TypeError: TextEncodeInput must be ...`)
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_surrogates(text: str, field: str, error: Callable[[str, str], Exception]) -> None:
    """An unpaired surrogate ("\\ud800" in the file, half of a UTF-16 pair; json reads it as it is)
    is refused here: the tokenizer stops on it with `TypeError: TextEncodeInput must be ...`."""
    half = LONE_SURROGATE.search(text)
    if half:
        raise error(field, f"holds an unpaired surrogate, \\u{ord(half[0]):04x} at character {half.start() + 1}: half "
                           "of a UTF-16 pair, which no tokenizer encodes; write the character itself, or both halves")


def answer_text(answer: Any, field: str, error: Callable[[str, str], Exception]) -> str:
    """A line's answer (or a dLLM line's reference, `field`) as the text the model should write:
    a non-empty string, or a finite number whose plain text is exact; `error(field, problem)`
    makes the error."""
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise error(field, f"must be a string or a number, got {json_type(answer)}")
    if isinstance(answer, float) and not math.isfinite(answer):
        raise error(field, f"must be a finite number, got {answer}")
    if isinstance(answer, float) and ("e" in repr(answer) or abs(answer) >= 2**53):
        # the atoms compare text: 1e30 read as "1000000000000000019884624838656" (the float's
        # digits, not the ones written) and 1e-7 as "1e-07", which no model writes
        raise error(field, f"the number {answer!r} has no exact plain text (a float this large or small is "
                           f"rounded or shown with an exponent): write the {field} as a string, as the "
                           "model should write it")
    # an integral float as the integer it is (pandas writes an int column holding a NaN as 2.0):
    # the answer atoms compare text, and "2" would never match "2.0"
    answer = str(int(answer)) if isinstance(answer, float) and answer.is_integer() else str(answer)
    if not answer.strip():
        raise error(field, "is empty")
    _check_surrogates(answer, field, error)
    return answer


def json_type(v: Any) -> str:
    """How an error names a JSON value's type ("a string", "null", ...)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    return "an object" if isinstance(v, dict) else type(v).__name__


def json_line(obj: Any) -> str:
    """One JSONL line of a file the run writes for people to read (sample tables): text as it
    is in UTF-8, so a Chinese prompt or an accented answer reads in `less`, not as \\u escapes.
    A lone surrogate (no UTF-8 form) keeps its row escaped, as json.dumps writes by default."""
    text = json.dumps(obj, ensure_ascii=False)
    if LONE_SURROGATE.search(text):
        text = json.dumps(obj)
    return text + "\n"
