"""Which words of a prompt each reward atom is about: CAST's prompt parsers (docs/methods.md section 4).

CAST projects each atom's advantage to pixels through the attention of image queries to the
atom's text tokens (diffusion_rl/attention_maps.py). A prompt parser says which characters of
the prompt those tokens must cover:

    parser(prompt: str) -> {atom column name: [(start, end) character spans of the prompt]}

The columns are the reward's atom names (batch.scores.names). A column the parser leaves out,
or gives no spans, gets a uniform map: its advantage is spread over the whole image, as in
Flow-GRPO. The built-in parser is shapes-geneval's; any other prompt set plugs in a function
named in the config as "path/to/file.py:function" (method.parser), imported only then.

shapes-geneval (one phrase "count colour shape", optionally a relation and a second phrase):

    exist     the shape words
    colour    each phrase's colour and shape words
    count     each phrase's count and shape words
    relation  the relation's words and both shape words
    all       left out (uniform: the whole-prompt atom is about the whole image)

Choices of ours (the paper's parser was not available): a phrase's shape word is in every
atom about that phrase, since the shape noun is where an object's attention is sharpest; "all"
is global rather than the union of the others.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from mmrl.core.config import ConfigError

Spans = dict[str, list[tuple[int, int]]]
PromptParser = Callable[[str], Spans]

__all__ = ["PromptParser", "Spans", "load_parser", "shapes_geneval_atom_spans", "shapes_geneval_spans"]


def shapes_geneval_spans(prompt: str) -> Spans:
    """The built-in parser (module docstring). ValueError names the words the grammar cannot parse."""
    from diffusion_rl.tasks.shapes_geneval import parse_objects

    _, relation = parse_objects(prompt)  # validates the grammar, with its own error message
    words = _words(prompt)
    phrases = [words[:3]] if relation is None else [words[:3], words[-3:]]
    rel_words = words[3:-3] if relation is not None else []
    spans: Spans = {"exist": [], "colour": [], "count": [], "relation": []}
    for count, colour, shape in phrases:
        spans["exist"].append(shape)
        spans["colour"] += [colour, shape]
        spans["count"] += [count, shape]
    if relation is not None:
        spans["relation"] = rel_words + [phrases[0][2], phrases[1][2]]
    return {k: v for k, v in spans.items() if v}


def shapes_geneval_atom_spans(prompt: str) -> Spans:
    """{atom name (shapes_geneval.parse_prompt's, in its order): character spans}, for CAST's
    per-atom columns (method.atoms: nodes). exist[s]: the shape words of the phrases of shape s;
    colour[c s] and count[c s]=n: the colour (count) and shape words of the phrases of that
    kind; the relation: its words and both shape words. ValueError as shapes_geneval_spans."""
    from diffusion_rl.tasks.shapes_geneval import parse_objects, parse_prompt

    objects, relation = parse_objects(prompt)
    words = _words(prompt)
    phrases = [words[:3]] if relation is None else [words[:3], words[-3:]]
    spans: Spans = {}
    for atom in parse_prompt(prompt):
        if atom.kind == "relation":
            spans[atom.name] = words[3:-3] + [phrases[0][2], phrases[1][2]]
            continue
        slot = {"exist": None, "colour": 1, "count": 0}[atom.kind]  # which word of the phrase, besides the shape
        same = [p for p, o in zip(phrases, objects)
                if (o.shape == atom.objects[0].shape if slot is None else o.kind == atom.objects[0].kind)]
        spans[atom.name] = [w for p in same for w in ([p[2]] if slot is None else [p[slot], p[2]])]
    return spans


def _words(prompt: str) -> list[tuple[int, int]]:
    """Character spans of the prompt's words, a final full stop left out as the grammar drops it
    (shapes_geneval._normalise: "circles." and "circles ." alike)."""
    text = prompt.rstrip().removesuffix(".")  # the same offsets: only the end is cut
    return [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]


BUILTIN: dict[str, PromptParser] = {"shapes-geneval": shapes_geneval_spans}


def load_parser(spec: str, base_dir: str | Path | None = None) -> PromptParser:
    """A built-in parser's name, or "path/to/file.py:function" (relative to base_dir, the
    config's directory). ConfigError names what is wrong."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    from mmrl.core.rewards import import_python_file, module_attribute, spec_file

    what = f"method.parser {spec!r}"
    if ":" not in spec or spec.endswith(":"):
        raise ConfigError(f"{what}: expected one of {sorted(BUILTIN)} or 'path/to/file.py:function'")
    file_part, attr = spec.rsplit(":", 1)
    path = spec_file(file_part, base_dir)
    if not path.is_file():
        raise ConfigError(f"{what}: file not found: {path}")
    try:
        fn = module_attribute(import_python_file(path, what), attr, what, path.name)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if not callable(fn):
        raise ConfigError(f"{what}: {attr!r} is not callable")
    return fn


def checked_spans(parser: PromptParser, prompt: str) -> Spans:
    """parser(prompt), checked: a dict of column -> list of (start, end) within the prompt.
    A parser that raises or returns anything else is a ValueError naming the prompt."""
    try:
        out = parser(prompt)
    except Exception as e:  # the parser is user code: name the prompt it failed on
        raise ValueError(f"the prompt parser failed on {prompt!r}: {type(e).__name__}: {e}") from e
    if not isinstance(out, dict):
        raise ValueError(  # noqa: TRY004 -- user code returned the wrong thing: a config-level error
            f"the prompt parser returned {type(out).__name__} for {prompt!r}; "
            "expected {atom name: [(start, end), ...]}")
    for name, spans in out.items():
        ok = isinstance(spans, list | tuple) and all(
            isinstance(s, list | tuple) and len(s) == 2 and all(isinstance(i, int) for i in s)
            and 0 <= s[0] < s[1] <= len(prompt) for s in spans)
        if not isinstance(name, str) or not ok:
            raise ValueError(f"the prompt parser gave atom {name!r} of {prompt!r} the spans {spans!r}; expected "
                             f"a list of (start, end) character offsets with 0 <= start < end <= {len(prompt)}")
    return out
