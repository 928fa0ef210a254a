"""Synthetic, verifiable vision-language tasks (shapes-qa, shapes-zoom) and users' own JSONL data."""

from __future__ import annotations

import importlib
from typing import Any

# Each name is imported from its module on first use (PEP 562): importing one task module,
# as mmrl.vlm.config does scenes', then imports not every one, and with shapes_qa's reward
# atoms torch, seconds that `mmrl config` need not wait for (tests/test_cli_imports.py).
_HOMES = {
    "jsonl": ("DatasetError", "QADataset", "load_jsonl", "save_jsonl"),
    "scenes": ("COLOURS", "SHAPES", "Scene", "Shape", "describe", "random_scene", "render"),
    "shapes_qa": ("KINDS", "QAItem", "ShapesQA", "accuracy", "answer_atom", "extract_answer", "format_atom",
                  "generate_items", "normalize", "shapes_qa_reward", "to_sample"),
    "shapes_zoom": ("ShapesZoom", "generate_zoom_items", "shapes_zoom_reward", "zoom_call"),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "COLOURS",
    "KINDS",
    "SHAPES",
    "DatasetError",
    "QADataset",
    "QAItem",
    "Scene",
    "Shape",
    "ShapesQA",
    "ShapesZoom",
    "accuracy",
    "answer_atom",
    "describe",
    "extract_answer",
    "format_atom",
    "generate_items",
    "generate_zoom_items",
    "load_jsonl",
    "normalize",
    "random_scene",
    "render",
    "save_jsonl",
    "shapes_qa_reward",
    "shapes_zoom_reward",
    "to_sample",
    "zoom_call",
]


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

