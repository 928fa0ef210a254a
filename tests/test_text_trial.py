"""Unusual text in users' data files and in what a run shows of it: encodings, line ends,
control characters, unpaired surrogates, and text in report.html. CPU, no model."""

from __future__ import annotations

import pytest

from mmrl.core.jsonl import DatasetError, read_objects


def _read(tmp_path, data: bytes):
    (tmp_path / "d.jsonl").write_bytes(data)
    return list(read_objects(tmp_path / "d.jsonl"))


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32"])
def test_a_utf16_jsonl_file_is_named_as_such(tmp_path, encoding):
    """Notepad's "Unicode" (with a byte-order mark) read as "line 1: not valid UTF-8 (byte 0xff)";
    PowerShell's UTF-16 without one as "line 1: invalid JSON: Expecting value at column 2"."""
    with pytest.raises(DatasetError, match=r"d.jsonl: is UTF-16 .*; save the file as UTF-8$"):
        _read(tmp_path, '{"question": "2+2?", "answer": 4}\n'.encode(encoding))


def test_a_latin1_file_names_the_line_the_column_and_the_character(tmp_path):
    """The column (in characters, an earlier "é" counting one) and what the byte reads as in the
    usual other encoding, so that the user sees which word and which encoding."""
    data = '{"q": "é"}\r\n{"q": "ça"}\r\n'.encode() + '{"q": "naïve"}\n'.encode("latin-1")
    with pytest.raises(DatasetError, match=r"^\S*d.jsonl, line 3: not valid UTF-8 \(byte 0xef at column 10: 'ï' in "
                                           r"Latin-1 or Windows-1252\); save the file as UTF-8$"):
        _read(tmp_path, data)
