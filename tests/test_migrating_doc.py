"""docs/migrating.md maps other codes' settings to mmrl keys. Every key its tables name in the
mmrl and notes columns must exist in the config schema of the section's command line (the schema
`<command> config --keys` walks), and a key written with a value (`method.adv_std: global`)
must load with that value, so that renaming or removing a key fails here instead of leaving
the page wrong."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from doc_keys import KEY, schema
from pydantic import BaseModel

from mmrl.core.config import ConfigError, load_config
from mmrl.core.config_doc import _section_class, _shown

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "migrating.md"


def sections() -> dict[str, tuple[str, str, list[list[str]]]]:
    """Title -> (command line, method type, table rows as [theirs, mmrl, notes])."""
    out = {}
    for part in DOC.read_text().split("\n## ")[1:]:
        title, _, body = part.partition("\n")
        command = re.search(r"Command line: `([\w-]+)`", body)
        method = re.search(r"`method\.type: (\w+)`", body)
        assert command and method, f"section {title!r} names no `Command line: ...` and `method.type: ...`"
        lines = [ln for ln in body.splitlines() if ln.startswith("|")]
        rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]  # after header, ---
        out[title] = (command.group(1), method.group(1), rows)
    return out


def key_exists(cfg: BaseModel, key: str) -> bool:
    """Walk `key` down the config as `config --keys` does; a section that is off (null) is
    walked through its class (`model.lora.r` with `model.lora: null`)."""
    node = cfg
    for name in key.split("."):
        if node is None or name not in _shown(node):
            return False
        value = None if isinstance(node, type) else getattr(node, name)
        node = value if isinstance(value, BaseModel) else _section_class(
            node if isinstance(node, type) else type(node), name)
    return True


def mmrl_keys(cell: str) -> list[tuple[str, str | None]]:
    """The (key, value or None) pairs of a table cell: `a.b`, `a.b: value`, or a top-level `seed`."""
    out = []
    for token in re.findall(r"`([^`]+)`", cell):
        head, sep, value = token.partition(": ")
        if KEY.fullmatch(head) or head in ("seed", "output_dir", "plugins"):
            out.append((head, value if sep else None))
    return out


def load_error(cls, defaults, method: str, keys: list[tuple[str, str | None]]) -> str | None:
    """Why the keys' values, set together over `method.type`, fail to load or the keys are not
    all in the loaded config; None when they are fine."""
    overrides = [f"method.type={method}"] + [f"{k}={v}" for k, v in keys if v is not None]
    try:
        cfg = load_config(cls, overrides=overrides, defaults=defaults)
    except ConfigError as e:
        return f"{', '.join(overrides[1:])} does not load: {e}"
    missing = [k for k, _ in keys if not key_exists(cfg, k)]
    return f"{', '.join(missing)}: no such key" if missing else None


SECTIONS = sections()


def test_the_page_has_the_five_codes_and_the_readme_links_it():
    titles = " ".join(SECTIONS)
    for name in ("TRL", "verl", "Flow-GRPO", "d1", "dLLM-RL"):
        assert name in titles, f"docs/migrating.md has no section for {name}"
    assert all(len(rows) >= 20 for _, _, rows in SECTIONS.values())  # the tables were parsed
    assert "(docs/migrating.md)" in (ROOT / "README.md").read_text()


def test_the_key_walk_finds_null_sections_and_refuses_typos():
    """The checker itself: a key under an off section exists, a misspelt one does not."""
    _, _, cfg = schema("mmrl", "grpo")
    assert cfg.model.lora is None and key_exists(cfg, "model.lora.r")
    assert key_exists(cfg, "method.loss.clip_high")
    assert not key_exists(cfg, "method.loss.clip_hihg")
    assert not key_exists(cfg, "method.loss.clip_high.x")  # below a value
    assert mmrl_keys("`method.kl.beta`, `optim.betas`, `seed`, `0.28`, `q_proj`") == [
        ("method.kl.beta", None), ("optim.betas", None), ("seed", None)]


@pytest.mark.parametrize("title", list(SECTIONS))
def test_every_mmrl_key_of_the_section_exists_and_its_value_loads(title):
    """A row's mmrl values are set together (`method.advantage.type: multi_stream` makes
    `method.advantage.mode` a key), over the section's method type."""
    command, method, rows = SECTIONS[title]
    cls, defaults, _ = schema(command, method)
    bad = []
    for theirs, ours, notes in rows:
        keys = mmrl_keys(ours)
        if not keys and "no equivalent" not in ours:
            bad.append(f"{theirs}: the mmrl column names no key and does not say 'no equivalent'")
        elif error := load_error(cls, defaults, method, keys):
            bad.append(f"{theirs}: {error}")
        for key in mmrl_keys(notes):  # the notes name keys too, each with its value on its own
            if error := load_error(cls, defaults, method, [key]):
                bad.append(f"{theirs}, notes: {error}")
    assert not bad, f"docs/migrating.md, section {title} (`{command}`, method.type {method}):\n" + "\n".join(bad)
