"""Shared by the resume tests: a resumed run must end exactly where the uninterrupted one did."""

from __future__ import annotations

from pathlib import Path

import torch

from mmrl.core.logging import read_metrics


def comparable(rows: list[dict]) -> list[dict]:
    """metrics.jsonl rows without the wall-clock keys (time/*), which no two runs share."""
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def assert_same_run(full_policy, resumed_policy, full_dir: Path, resumed_dir: Path) -> None:
    """The same weights, tensor by tensor, and the same metrics rows (time/* aside)."""
    resumed = resumed_policy.model.state_dict()
    for k, v in full_policy.model.state_dict().items():
        assert torch.equal(v, resumed[k]), k
    assert comparable(read_metrics(Path(resumed_dir) / "metrics.jsonl")) == comparable(
        read_metrics(Path(full_dir) / "metrics.jsonl"))
