"""Tools as a researcher brings them: odd return values, odd exceptions, odd budgets
(mmrl.vlm.tools, mmrl.vlm.agent)."""

from __future__ import annotations

from mmrl.vlm.tools import ToolContext, ToolRegistry

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
