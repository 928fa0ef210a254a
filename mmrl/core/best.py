"""The best checkpoint by a held-out metric (`train.best_metric`), kept past `train.keep_last`.

RL fine-tuning does not improve monotonically: a policy can peak and then lose its greedy
decode (the VLM main job's seed 2 did, between steps 500 and 600). With `best_metric` set, each
periodic evaluation (`train.eval_every`) and the final one compare that metric with the best so
far; a better one makes the step's checkpoint the best (written then if the step is not
saved anyway), recorded in `<output_dir>/best.json` ({"metric", "mode", "value", "step",
"checkpoint"}) and in summary.json. Checkpoint pruning spares it, so a run holds at most
keep_last + 1 checkpoints. Only trained steps compete: the model before training is not a
checkpoint of the run (its score is summary.json's eval_before). On --resume the resumed
checkpoint's evaluation, as metrics.jsonl logged it, competes again (`adopt`): a kill between
writing the best checkpoint and best.json otherwise left the record naming the older best.
A record of a step after the resumed checkpoint (newer ones deleted by hand) is dropped, and
the checkpoints on disk compete by their logged evaluations: that step trains again.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

from mmrl.core.config import ConfigError
from mmrl.core.logging import write_atomically

BEST = "best.json"


class BestCheckpoint:
    def __init__(self, out: str | Path, metric: str | None, mode: str = "max"):
        self.path = Path(out) / BEST
        self.metric, self.mode = metric, mode
        self.record: dict[str, Any] | None = None

    @property
    def enabled(self) -> bool:
        return self.metric is not None

    @property
    def step(self) -> int | None:
        """The best checkpoint's step, which pruning spares (None: none yet)."""
        return None if self.record is None else self.record["step"]

    def check(self, metrics: dict[str, float]) -> None:
        """At the first evaluation, before any step: the metric is one the task reports."""
        if self.enabled and self.metric not in metrics:
            raise ConfigError(f"train.best_metric: {self.metric!r} is not a held-out metric of this task; "
                              f"it reports {', '.join(sorted(metrics)) or 'none'}")

    def start_fresh(self) -> None:
        """A fresh run (not --resume) in a directory an earlier one left a record in (it may run
        where that run's checkpoints are gone): the record names none of this run's checkpoints."""
        self.path.unlink(missing_ok=True)

    def resume(self, step: int | None = None) -> None:
        """On --resume from checkpoint `step`: the record of the earlier attempts, where it is for
        the same metric and mode (another one starts afresh, with a warning), and names a step up
        to `step`. One past it (the newer checkpoints deleted by hand) names a checkpoint whose
        step trains again, to other weights: it is removed, with a warning, and the best chosen
        afresh (the trainer lets the checkpoints on disk compete, `adopt`)."""
        if not self.enabled or not self.path.is_file():
            return
        try:
            record = read_record(self.path)
        except ValueError as e:
            warnings.warn(f"{self.path} is unreadable ({e}): the best checkpoint is chosen afresh", stacklevel=3)
            return
        if (record.get("metric"), record.get("mode")) != (self.metric, self.mode):
            warnings.warn(f"{self.path} ranks by {record.get('metric')} ({record.get('mode')}), this run by "
                          f"{self.metric} ({self.mode}): the best checkpoint is chosen afresh", stacklevel=3)
        elif step is not None and record["step"] > step:
            warnings.warn(f"{self.path} names step {record['step']}, past the checkpoint resumed from (step {step}), "
                          "whose steps train again: the best checkpoint is chosen afresh", stacklevel=3)
            self.path.unlink()
        else:
            self.record = record

    def adopt(self, step: int, row: dict[str, Any] | None, checkpoint: Path) -> bool:
        """On --resume from checkpoint `step`: its evaluation during training, as metrics.jsonl's
        row of the step logged it (`eval/<metric>`), competes as it did when it ran; True where it
        beats the record and is now the best. The row is logged before the step's checkpoint and
        best.json are written, so a kill between the two (the checkpoint written, best.json still
        naming the earlier best) loses nothing. Where best.json was written, the row does not beat
        it (it is the record, or a better one came before) and nothing changes. A bad step's
        (train/bad_step) never competed; the final evaluation, which no row holds, runs again on a
        resume at max_steps."""
        value = None if row is None or row.get("train/bad_step") else row.get(f"eval/{self.metric}")
        if type(value) not in (int, float) or not self.improves({self.metric: value}):  # "nan": logged as text
            return False
        self.update(step, {self.metric: value}, checkpoint)
        return True

    def improves(self, metrics: dict[str, float]) -> bool:
        """Whether `metrics` beat the best so far (strictly; a NaN never does)."""
        if not self.enabled:
            return False
        value = metrics.get(self.metric)
        if value is None or not math.isfinite(value):
            return False
        if self.record is None:
            return True
        best = self.record["value"]
        return value > best if self.mode == "max" else value < best

    def update(self, step: int, metrics: dict[str, float], checkpoint: Path) -> None:
        """Record step's checkpoint as the best (written whole, then renamed into place)."""
        self.record = {"metric": self.metric, "mode": self.mode, "value": metrics[self.metric], "step": step,
                       "checkpoint": str(Path(checkpoint).resolve())}
        write_atomically(self.path, json.dumps(self.record, indent=1))


def read_record(path: Path) -> dict[str, Any]:
    """best.json as written by BestCheckpoint.update; ValueError saying what is wrong with it."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{type(e).__name__}: {e}") from None
    if not isinstance(record, dict):
        raise ValueError(f"not an object but {type(record).__name__}")  # noqa: TRY004 -- a file's content
    step, value = record.get("step"), record.get("value")
    if type(step) is not int or step < 0:  # type(): a bool is not a step
        raise ValueError(f"step {step!r} is not a whole number >= 0")
    if type(value) not in (int, float):
        raise ValueError(f"value {value!r} is not a number")
    return record
