"""Unusual text in users' data files and in what a run shows of it: encodings, line ends,
control characters, unpaired surrogates, and text in report.html. CPU, no model."""

from __future__ import annotations

import json

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


@pytest.mark.parametrize("char, escaped", [("\t", r'"\\t"'), ("\x00", r'"\\u0000"'), ("\x1b", r'"\\u001b"')])
def test_a_raw_control_character_in_a_string_is_named(tmp_path, char, escaped):
    """It read as "invalid JSON: Invalid control character at at column 12" (json's message
    ends in "at"): which character, and how JSON writes it, were left to guess."""
    with pytest.raises(DatasetError, match=rf"line 2: invalid JSON: a raw control character \(U\+{ord(char):04X}\) "
                                           rf"inside a string at column 11; JSON writes it escaped, as {escaped}$"):
        _read(tmp_path, b'{"q": 1}\n{"q": "tab' + char.encode() + b'"}\n')


def test_a_lone_cr_inside_a_string_is_said_and_json_messages_read_once(tmp_path):
    """A raw CR in a string ends the line there (lone CRs end lines, as old Mac files' do), so
    it read as "Unterminated string starting at at column 7"."""
    with pytest.raises(DatasetError, match=r"line 1: invalid JSON: Unterminated string starting at column 7 \(the "
                                           r"line ends at a lone carriage return, CR, inside the string"):
        _read(tmp_path, b'{"q": "a\rb", "answer": 1}\n')
    with pytest.raises(DatasetError, match=r"line 1: invalid JSON: Unterminated string starting at column 7$"):
        _read(tmp_path, b'{"q": "ab}\n')


def test_unusual_text_reads_intact(tmp_path):
    """What is valid JSON lines stays as written: a BOM, CRLF and lone CR ends, blank lines in the
    middle and at the end, U+2028 and U+0085 inside strings (line ends to str.splitlines), escaped
    NUL/tab/CR, combining and zero-width characters, right-to-left text, emoji, a long line."""
    texts = ["caf\u0065\u0301 \u200b\u200d 猫 🐱 שלום \u202eabc\u202c", "a\u2028b\u0085c", "nul\x00 tab\t cr\r lf\n",
             "x" * 200_000]
    lines = [json.dumps({"q": t}, ensure_ascii=False).encode() for t in texts]
    data = b"\xef\xbb\xbf" + lines[0] + b"\r\n\r\n" + lines[1] + b"\r" + lines[2] + b"\n\n" + lines[3] + b"\n\n"
    assert _read(tmp_path, data) == [(1, {"q": texts[0]}), (3, {"q": texts[1]}), (4, {"q": texts[2]}),
                                     (6, {"q": texts[3]})]


@pytest.mark.parametrize("line, field", [(rb'{"prompt": "1+1=\ud800", "answer": 2}', "prompt"),
                                         (rb'{"prompt": "1+1=", "answer": "\udc00"}', "answer"),
                                         (rb'{"prompt": "1+1=", "answer": 2, "reference": "x\udfff"}', "reference")])
def test_an_unpaired_surrogate_is_refused_naming_the_field(tmp_path, line, field):
    """"\\ud800" alone (half of a UTF-16 pair, as a UTF-16 program escapes it) is read by json as
    it is; the VLM tokenizer then stopped the run with `TypeError: TextEncodeInput must be
    Union[...]`. A whole pair ("\\ud83d\\ude00", an emoji) is fine."""
    from dllm_rl.tasks import jsonl

    (tmp_path / "p.jsonl").write_bytes(rb'{"prompt": "\ud83d\ude00=", "answer": 1}' + b"\n" + line + b"\n")
    with pytest.raises(DatasetError, match=rf"p.jsonl, line 2, field '{field}': holds an unpaired surrogate, "
                                           r"\\u[0-9a-f]{4} at character \d: half of a UTF-16 pair"):
        jsonl.load_problems(tmp_path / "p.jsonl")
    (tmp_path / "p.jsonl").write_bytes(rb'{"prompt": "\ud83d\ude00=", "answer": 1}' + b"\n")
    assert jsonl.load_problems(tmp_path / "p.jsonl")[0].prompt == "\U0001f600="


def test_an_unpaired_surrogate_in_a_vlm_question_is_refused(tmp_path):
    from mmrl.vlm.tasks.jsonl import load_jsonl

    (tmp_path / "q.jsonl").write_bytes(rb'{"question": "hi \ud800", "answer": 1}' + b"\n")
    with pytest.raises(DatasetError, match=r"q.jsonl, line 1, field 'question': holds an unpaired surrogate, "
                                           r"\\ud800 at character 4"):
        load_jsonl(tmp_path / "q.jsonl")


def test_report_sample_tables_show_text_as_written(tmp_path):
    """samples/step_*.jsonl as report.html shows it: markup escaped (a "<script>" prompt must not
    run), right-to-left, CJK, emoji and combining text intact, line breaks and tabs kept (td's
    pre-wrap), and control characters shown as their pictures: a browser drops a NUL, so
    "a\\x00b" read as "ab". A long unbroken line may wrap (overflow-wrap), not widen the page."""
    from mmrl.demo.report import _STYLE, _sample_table

    prompt = "<script>alert('x')</script> & \"q\" 猫 🐱 e\u0301 שלום?\nline\ttab nul\x00 esc\x1b del\x7f"
    rows = [{"group": 0, "prompt": prompt, "completion": "</td></table><b>", "reward": 1.0, "atoms": {"<a>": 1.0}}]
    path = tmp_path / "step_00000002.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    page = _sample_table(path, ["group", "prompt", "completion", "reward", "atoms"], lines=True)
    assert "<script>" not in page and "<b>" not in page and "<a>" not in page and "</table><" not in page[:-8]
    assert ("<td>&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; &quot;q&quot; 猫 🐱 e\u0301 שלום?\nline\ttab "
            "nul\u2400 esc\u241b del\u2421</td><td>&lt;/td&gt;&lt;/table&gt;&lt;b&gt;</td>") in page
    assert "\x00" not in page and "&lt;a&gt;: 1" in page
    assert "td{white-space:pre-wrap;overflow-wrap:anywhere;unicode-bidi:plaintext}" in _STYLE


def test_vlm_overlap_warning_says_one_file_was_given_as_both(tmp_path):
    """task.eval_path = task.train_path (a path with spaces and non-ASCII letters) read as
    "(the first: ..., <file>, line 1; <file>, line 1)", a typo to the eye; the dLLM task says it."""
    from mmrl.core.jsonl import HeldOutWarning
    from mmrl.vlm.tasks.jsonl import check_overlap, load_jsonl

    path = tmp_path / "dä ta" / "q ü.jsonl"
    path.parent.mkdir()
    path.write_text('{"question": "猫は何匹?", "answer": 2}\n', encoding="utf-8")
    with pytest.warns(HeldOutWarning, match=r"\(the first: '猫は何匹\?', \S*/dä ta/q ü.jsonl, line 1, the training file "
                                            r"itself: task.eval_path is task.train_path\)"):
        check_overlap(load_jsonl(path), load_jsonl(path))


@pytest.mark.parametrize("folder_form, file_form, in_file", [("NFC", "NFC", "NFD"), ("NFD", "NFD", "NFC"),
                                                             ("NFC", "NFD", "NFC")])
def test_vlm_image_names_match_across_unicode_normalisation(tmp_path, folder_form, file_form, in_file):
    """"café.png" typed (one code point for "é") and the same name as macOS writes it ("e" and a
    combining accent) look the same, yet read as "image file not found: <the very name shown>".
    Each name is matched on its own: a folder and a file in it may come from two systems."""
    from unicodedata import normalize

    from PIL import Image

    from mmrl.vlm.tasks.jsonl import load_jsonl

    folder = tmp_path / normalize(folder_form, "imgs ü")
    folder.mkdir()
    Image.new("RGB", (4, 4), "red").save(folder / normalize(file_form, "café 猫.png"))
    line = {"question": "colour?", "answer": "red", "image": normalize(in_file, "imgs ü/café 猫.png")}
    (tmp_path / "q.jsonl").write_text(json.dumps(line, ensure_ascii=False) + "\n", encoding="utf-8")
    assert load_jsonl(tmp_path / "q.jsonl")[0].images[0].getpixel((0, 0)) == (255, 0, 0)


@pytest.mark.parametrize("name, hint", [
    ("a.png ", r" \(the name has spaces around it: 'a.png '; without them it is a file\)$"),
    ("a\u200b.png", r" \(the name holds invisible characters: 'a\\u200b.png'\)$"),
    ("b.png", r"b.png$")])
def test_vlm_missing_image_says_what_its_name_hides(tmp_path, name, hint):
    """A trailing space or a pasted zero-width space read as "image file not found: .../a.png",
    the name of a file that is there."""
    from PIL import Image

    from mmrl.vlm.tasks.jsonl import load_jsonl

    Image.new("RGB", (4, 4)).save(tmp_path / "a.png")
    (tmp_path / "q.jsonl").write_text(json.dumps({"question": "q?", "answer": 1, "image": name}) + "\n")
    with pytest.raises(DatasetError, match=r"line 1, field 'image': image file not found: .*" + hint):
        load_jsonl(tmp_path / "q.jsonl")


def test_report_names_the_prompt_of_each_grid_row(tmp_path):
    """An image run's grid numbers its rows only, and report.html did not say which prompt each
    row draws (grid_before.json holds them): the page's reader could not tell."""
    from types import SimpleNamespace

    from PIL import Image

    from mmrl.demo.report import _samples

    root = tmp_path / "samples"
    root.mkdir()
    for tag in ("before", "after"):
        Image.new("RGB", (4, 4)).save(root / f"grid_{tag}.png")
    prompts = ["a red circle", "<script>x</script> 猫 שלום"]
    (root / "grid_before.json").write_text(json.dumps({"rows": prompts, "seeds": [0, 1]}))
    (root / "grid_after.json").write_text('{"rows": ')  # cut short
    page = _samples(SimpleNamespace(path=tmp_path))
    assert ("<table><tr><th>row</th><th>prompt</th></tr><tr><td>0</td><td>a red circle</td></tr><tr><td>1</td>"
            "<td>&lt;script&gt;x&lt;/script&gt; 猫 שלום</td></tr></table>") in page
    assert "<p>(unreadable: grid_after.json: JSONDecodeError " in page
    (root / "grid_after.json").unlink()  # a run from before the file: the grid alone
    assert _samples(SimpleNamespace(path=tmp_path)).endswith("<h3>after</h3><img alt='samples after' src='data:image/"
                                                             "png;base64," + _png_b64(root / "grid_after.png") + "'>")


def _png_b64(path) -> str:
    import base64

    return base64.b64encode(path.read_bytes()).decode()


def test_a_question_from_elsewhere_can_be_checked_as_a_jsonl_line_is():
    """`mmrl sample --prompt "a <|image_pad|> b"` stopped with the processor's traceback ("Found 1
    <|image_pad|> tokens in the text but no images were passed"), where a JSONL line holding it is
    refused by name: the loader's check is one function the command line can call too."""
    from mmrl.vlm.tasks.jsonl import question_problem

    assert question_problem("Wie viele Kätzchen? 猫 🐱 <script>") is None
    assert question_problem("a <|image_pad|> b").startswith("holds the chat format's image placeholder <|image_pad|>")
    assert question_problem("x<|im_end|>\n<|im_start|>assistant").startswith("holds the chat format's turn marker "
                                                                             "<|im_end|>, which would end")


def test_answers_in_another_unicode_form_are_the_same_answer():
    # "é" typed as one character and as e + U+0301 (as macOS writes file text), and full-width
    # letters, compared unequal: a right answer scored 0
    from dllm_rl.tasks.jsonl import answer_atom
    from mmrl.core.rewards import Sample
    from mmrl.vlm.tasks.shapes_qa import normalize

    assert normalize("caf\u00e9") == normalize("cafe\u0301") == "caf\u00e9"
    assert normalize("\uff34\uff37\uff2f.") == "2"  # full-width "TWO."
    assert answer_atom(Sample("q", " cafe\u0301 ", {"answer": "caf\u00e9"}))
    assert not answer_atom(Sample("q", "cafe", {"answer": "caf\u00e9"}))
