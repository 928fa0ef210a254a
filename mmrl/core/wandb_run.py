"""Weights & Biases logging of a run (`logging.wandb`; the `wandb` extra), on the main process.

What goes there: the run's config, each step's finite scalar metrics at their step (as
metrics.jsonl has them), the held-out evaluations before and after training as eval/* at step 0
and the last step (as TensorBoard has them), the sample tables (train.log_samples_every) as W&B
tables, and at the end the held-out metrics before and after training in the W&B run's summary. metrics.jsonl and
TensorBoard are written either way; W&B is a copy.

Resume: the W&B run's id is kept in <output_dir>/wandb.json, and `train --resume` continues that
W&B run. Steps the interrupted attempt logged after its checkpoint are logged again; W&B keeps
the values it has for them (a resumed run repeats them exactly: docs/reliability.md) and drops
the repeats with a warning.

How the W&B run ends: finished (exit code 0) after the final evaluation; failed (exit code 1)
on an error or Ctrl-C; preempted on a scheduler's SIGTERM or SIGUSR1 (mmrl.core.stop), after
the step it came in is saved: `run.mark_preempting()`, then the exit code the process ends with,
128 + the signal's number. W&B shows such a run as preempted, not crashed or failed, and (in a
sweep) requeues it; `train --resume` continues the same W&B run.

A scheduler's signal reaches W&B's own service too: SLURM signals every process of the job step
(its cgroup), and wandb-core, the process wandb.init starts, ends at once on SIGTERM (or SIGINT)
with what it had not yet written (an offline run folder is left with its header alone, measured
with wandb 0.31). Nothing keeps it alive: it catches SIGTERM itself (os/signal), so an ignored or
blocked SIGTERM it inherits does not help, and its own session (wandb starts it in one) only keeps
a signal to our process group away. So the run is ended in a fresh service instead: where the
connection to the service was lost and the run stops on a signal, finish() starts W&B again on
the same W&B run (resume), logs this start's steps again from metrics.jsonl, then marks it
preempting and finishes it. Steps the lost service had already sent are kept by W&B and the
repeats dropped; sample tables logged before the signal are not sent again. SIGUSR1 (`sbatch
--signal=USR1@120`) does not stop wandb-core, which leaves that signal to its default (ignored).

A W&B that cannot start (not logged in, no network in online mode) is a ConfigError before the
first step. One that fails mid-run is warned about once and left off: the run goes on.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import warnings
from pathlib import Path
from typing import Any

from mmrl.core.config import ConfigError
from mmrl.core.logging import METRICS, finite_scalars, read_metrics, write_atomically

RUN_ID = "wandb.json"  # {"id", "project"}: the W&B run a --resume continues


class WandbRun:
    def __init__(self, settings: dict[str, Any], output_dir: Path, config: dict[str, Any], resume: bool):
        try:
            import wandb
        except ImportError:
            raise ConfigError("logging.wandb.enabled needs the wandb package: pip install -e '.[wandb]' "
                              "(or set logging.wandb.enabled=false)") from None
        self._wandb = wandb
        record = output_dir / RUN_ID
        previous = _read_id(record) if resume else None
        run_id = previous or secrets.token_hex(4)  # 8 characters of [0-9a-f], as W&B's own ids
        self._init = {  # wandb.init's arguments, again for a run whose service a signal ended
            "project": settings["project"], "entity": settings["entity"], "group": settings["group"],
            "name": settings["name"] or output_dir.resolve().name, "tags": list(settings["tags"]) or None,
            "mode": settings["mode"], "dir": str(output_dir), "config": config, "id": run_id,
            "resume": "allow",
        }
        try:
            self.run = wandb.init(**self._init)
        except Exception as e:  # noqa: BLE001 -- wandb raises many kinds (UsageError, CommError, ...)
            raise ConfigError(f"logging.wandb: W&B could not start: {type(e).__name__}: {e} (log in with "
                              "`wandb login`, or set logging.wandb.mode=offline)") from None
        write_atomically(record, json.dumps({"id": run_id, "project": settings["project"]}))
        self._metrics = output_dir / METRICS
        self._first_step: int | None = None  # the first step this start logged
        self._held_out: list[tuple[int, dict[str, float]]] = []  # held_out's, which metrics.jsonl lacks
        self._failed = False
        self._lost = False  # a call failed on the connection to W&B's service: the service is gone

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """A step's finite scalar metrics (logging.finite_scalars, as TensorBoard gets them)."""
        if self._first_step is None:
            self._first_step = step
        self._call(self.run.log, scalars, step=step)

    def held_out(self, step: int, scalars: dict[str, float]) -> None:
        """A held-out evaluation before or after training (eval/* scalars) at `step`: logged as a
        step's metrics are, and kept to be logged again in a fresh service (_restart)."""
        self._held_out.append((step, scalars))
        self.log(step, scalars)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A sample table (the rows of samples/step_*.jsonl) as the W&B table "samples" at `step`;
        nested values (the atoms) as JSON text, images as their description."""
        if not rows:
            return
        columns = list(dict.fromkeys(k for row in rows for k in row))
        data = [[json.dumps(v) if isinstance(v, (dict, list)) else v for v in (row.get(c) for c in columns)]
                for row in rows]
        # mixed types: a column may hold a number in one row and "nan" (its JSON text) in another
        self._call(lambda: self.run.log(
            {"samples": self._wandb.Table(columns=columns, data=data, allow_mixed_types=True)}, step=step))

    def finish(self, summary: dict[str, Any] | None, failed: bool = False, signum: int | None = None) -> None:
        """The held-out metrics before and after (eval_before/<name>, eval_after/<name>) and the
        best checkpoint's step and score (best/step, best/value) into the W&B run's summary, then
        close it; `failed`: the run stopped on an error; `signum`: it stopped on that signal with
        its step saved, so the W&B run is marked preempting and ends with 128 + signum (W&B takes a
        preempting run with a non-zero exit code as preempted; with 0 it would be finished). Where
        the signal ended W&B's service too, in a fresh one (the module docstring)."""
        self._end(summary, failed, signum)
        if signum is not None and self._lost and self._restart():
            self._end(summary, failed, signum)
        self._failed = True  # nothing more goes to a finished run

    def _end(self, summary: dict[str, Any] | None, failed: bool, signum: int | None) -> None:
        if summary is not None:
            flat = {f"{when}/{k}": v for when in ("eval_before", "eval_after")
                    for k, v in finite_scalars(summary.get(when) or {}).items()}
            flat["train_seconds"] = summary.get("train_seconds")
            if summary.get("best"):  # train.best_metric: the best checkpoint's step and score
                flat.update({"best/step": summary["best"]["step"], "best/value": summary["best"]["value"]})
            self._call(self.run.summary.update, flat)
        if signum is not None:
            self._call(self.run.mark_preempting)
        self._call(self.run.finish, exit_code=128 + signum if signum is not None else 1 if failed else 0)

    def _restart(self) -> bool:
        """W&B in a fresh service on the same W&B run, with this start's steps logged again from
        metrics.jsonl; False (and a warning) where it cannot start."""
        wandb = self._wandb
        # the lost service's teardown fails on its connection, after clearing the token (the
        # environment's WANDB_SERVICE) that would connect wandb.init to it again
        with contextlib.suppress(Exception):
            wandb.teardown()
        try:
            self.run = wandb.init(**self._init)
            rows = [r for r in read_metrics(self._metrics)
                    if self._first_step is not None and r["step"] >= self._first_step]
            logs = [(row["step"], 1, {k: v for k, v in finite_scalars(row).items() if k != "step"}) for row in rows]
            # the evaluation before training (step 0) first: W&B drops a step below one it has
            for step, _, scalars in sorted(logs + [(step, 0, scalars) for step, scalars in self._held_out],
                                           key=lambda log: log[:2]):
                self.run.log(scalars, step=step)
        except Exception as e:  # noqa: BLE001 -- as _call: W&B is a copy
            warnings.warn(f"W&B could not be started again after its service was lost: {type(e).__name__}: "
                          f"{e} (the W&B run shows as crashed; metrics.jsonl has every step)", stacklevel=3)
            return False
        self._failed = self._lost = False
        steps = f"steps {rows[0]['step']}-{rows[-1]['step']}" if rows else "no steps"
        warnings.warn(f"W&B's service was stopped by the signal too (a scheduler signals every process of "
                      f"the job); W&B was started again on the same run and {steps} of this start logged "
                      "again from metrics.jsonl", stacklevel=3)
        return True

    def _call(self, fn, *args, **kwargs) -> None:
        if self._failed:
            return
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 -- W&B is a copy of what the run writes itself
            self._failed = True
            self._lost = isinstance(e, ConnectionError)  # ConnectionResetError, BrokenPipeError
            warnings.warn(f"W&B logging stopped: {type(e).__name__}: {e} (metrics.jsonl and TensorBoard "
                          "go on)", stacklevel=3)


def _read_id(path: Path) -> str | None:
    try:
        return str(json.loads(path.read_text(encoding="utf-8"))["id"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):  # damaged: a new W&B run, said
        warnings.warn(f"{path} is not a W&B run record; the resumed run logs to a new W&B run", stacklevel=3)
        return None
