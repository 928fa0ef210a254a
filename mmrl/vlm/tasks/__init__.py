"""Synthetic, verifiable vision-language tasks (shapes-qa, shapes-zoom) and users' own JSONL data."""

from mmrl.vlm.tasks.jsonl import DatasetError, QADataset, load_jsonl, save_jsonl
from mmrl.vlm.tasks.scenes import COLOURS, SHAPES, Scene, Shape, describe, random_scene, render
from mmrl.vlm.tasks.shapes_qa import (
    KINDS,
    QAItem,
    ShapesQA,
    accuracy,
    answer_atom,
    extract_answer,
    format_atom,
    generate_items,
    normalize,
    shapes_qa_reward,
    to_sample,
)
from mmrl.vlm.tasks.shapes_zoom import (
    ShapesZoom,
    generate_zoom_items,
    shapes_zoom_reward,
    zoom_call,
)

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
