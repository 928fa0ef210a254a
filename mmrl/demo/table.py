"""`<cli> runs`: finished runs side by side, and the mean and spread over seeds.

One row per run directory: its steps, each held-out metric of summary.json before and after
training, the best checkpoint (train.best_metric) and the training time. With `group=True`, runs
whose configs differ only in `seed` (and in where they write: output_dir, logging) make one row:
each metric's mean and sample standard deviation after training, and of its change, over the
runs that finished. The settings that tell rows apart (method.type=axpo, optim.lr=1e-05, ...)
label them, so a sweep's table reads without opening its configs (where method.type or
task.type differs, the type stands for that section's other settings).

A run still going, or stopped before its final evaluation, has no summary.json: its row says
so (with how its last start ended, where environment.json records it: a signal, Ctrl-C, an
error) and it counts in no mean. A start with no ending recorded is "running (pid N)" where its
process still runs on this host and "killed (no ending recorded)" where it is gone (kill -9, the
OOM killer, a rebooted node); on another host, or for a start recorded before environment.json
had its process, whether it runs cannot be told from here and the row says "running, or killed".
A directory that cannot be read is a row with the reason, and the other runs are still shown.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# mmrl.core.provenance and checkpoint are imported where an unfinished run needs them: they
# import torch, seconds that `runs` over finished runs need not wait for (tests/test_cli_imports.py)
from mmrl.demo.runs import RunError, RunInfo, modality_of

# what the seeds of one configuration may differ in
PER_SEED = ("seed", "output_dir", "logging")


@dataclass
class Run:
    path: Path
    config: dict[str, Any]
    summary: dict[str, Any] | None
    steps: int | None  # done: summary.json's, else the last metrics.jsonl row's
    error: str | None = None  # why the directory could not be read
    metrics: list[dict[str, Any]] = field(default_factory=list, repr=False)  # metrics.jsonl's rows (--plot)
    kept: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False)  # earlier ends' summaries (--plot)

    @property
    def status(self) -> str:
        if self.error:
            return f"unreadable: {self.error}"
        if self.summary is not None:
            return "finished"
        from mmrl.core import provenance

        total = (self.config.get("train") or {}).get("max_steps")
        start = provenance.last_start(self.path) or {}  # its newest start, where environment.json has it
        ended = start.get("ended")
        if isinstance(ended, dict):
            if ended.get("how") == "finished":  # recorded just before summary.json is written
                return (f"finished at step {ended.get('step')} of {total}, but no summary.json "
                        "(deleted, or killed as it was written)")
            return f"{ended.get('how')} (at step {ended.get('step')} of {total}{self._resumes(ended.get('step'))})"
        elif (alive := provenance.alive(start)) is not None:  # on the host that ran it
            return (f"running (pid {start['pid']}; step {self.steps or 0} of {total})" if alive
                    else f"killed (no ending recorded; step {self.steps or 0} of {total}{self._resumes(self.steps)})")
        return f"no summary.json (step {self.steps or 0} of {total}): running, or killed"

    def _resumes(self, step: Any) -> str:
        """Where --resume would go on from, where that is not the step the run reached (a Ctrl-C
        or a kill keeps the newest checkpoint, not the step in progress)."""
        from mmrl.core.checkpoint import list_checkpoints

        found = list_checkpoints(self.path / "checkpoints")
        if not found:
            return "; no checkpoint to resume from"
        return "" if found[-1][0] == step else f"; --resume goes on from step {found[-1][0]}"

    @functools.cached_property
    def flat(self) -> dict[str, str]:
        """The config as this mmrl reads it (runconfig.upgraded) flattened (see flatten) after its
        modality (vlm, diffusion, dllm), read once however often rows and groups need it."""
        from mmrl.core.runconfig import upgraded

        return {"modality": json.dumps(modality_of(self.config)), **flatten(upgraded(self.config))}

    @functools.cached_property
    def defaults(self) -> dict[str, str]:
        """`flat` with this mmrl's defaults where an older one's run lacks a setting (complete);
        {} where this mmrl does not validate the config."""
        done = complete(self.config)
        return {} if done is None else flatten(done)

    def evaluation(self, when: str, metric: str) -> float | None:
        """summary.json's eval_<when>[metric] ("before" / "after") where it is a finite number."""
        return _number(((self.summary or {}).get(f"eval_{when}") or {}).get(metric))


def find(paths: list[Path]) -> list[Path]:
    """Run directories: each path holding a config.yaml, else the subdirectories of it that hold
    one (sorted by name). ValueError for a path that is neither. A run named twice (`runs sweep
    sweep/s0`, a relative and an absolute path, a symlink to it) is shown once, as first named:
    twice, it counted twice in its group's mean and standard deviation."""
    found = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise ValueError(f"{path} is not a directory" if path.exists() else f"{path} does not exist")
        if (path / "config.yaml").is_file():
            found.append(path)
            continue
        inside = sorted(p for p in path.iterdir() if (p / "config.yaml").is_file())
        if not inside:
            raise ValueError(f"{path} is not a run directory (no config.yaml) and holds none one level down")
        found += inside
    first: dict[Path, Path] = {}
    for path in found:
        first.setdefault(path.resolve(), path)
    return list(first.values())


def load(path: Path) -> Run:
    try:
        info = RunInfo.load(path)
    except RunError as e:
        return Run(path, {}, None, None, error=str(e))
    steps = info.summary.get("steps") if info.summary else None
    if steps is None and info.metrics:
        steps = info.metrics[-1].get("step")
    return Run(path, info.config, info.summary, steps, metrics=info.metrics, kept=info.kept)


# each modality's config class, imported where a run is compared (no torch: `runs` stays quick)
CONFIG_CLASSES = {"vlm": ("mmrl.vlm.config", "VLMTrainConfig"), "dllm": ("dllm_rl.config", "DLLMTrainConfig"),
                  "diffusion": ("diffusion_rl.config", "DiffusionTrainConfig")}


def complete(config: dict[str, Any]) -> dict[str, Any] | None:
    """A run's config as this mmrl reads it (runconfig.upgraded), with each setting it lacks at
    its default: the settings added since an older mmrl made the run (its config.yaml is a full
    dump of that mmrl's settings); the run's own values as written. None where this
    mmrl does not validate it, or would have to import a plugin's code to (a plugin's method)."""
    import importlib

    from mmrl.core.config import ConfigError, load_config
    from mmrl.core.config_loading import deep_merge
    from mmrl.core.runconfig import upgraded

    config = upgraded(config)
    if config.get("plugins"):
        return None
    module, name = CONFIG_CLASSES[modality_of(config)]
    try:
        with warnings.catch_warnings():  # what it says of its settings is eval's and train's to say
            warnings.simplefilter("ignore")
            full = load_config(getattr(importlib.import_module(module), name), None, [], defaults=config)
    except (ConfigError, ValueError, TypeError):
        return None
    return deep_merge(full.model_dump(mode="json"), config)


def compared(runs: list[Run]) -> dict[int, dict[str, str]]:
    """id(run) -> its flattened config as the table compares it, for each readable run: a key
    another run has and this one lacks is its default (Run.defaults) where its config validates,
    so that a run of an older mmrl and one of today's with the same settings do not differ in
    each key added since (`method.fastrl.against=null`) and make two groups."""
    readable = [r for r in runs if not r.error]
    keys = list(dict.fromkeys(k for r in readable for k in r.flat))
    return {id(r): {k: r.flat[k] if k in r.flat else r.defaults[k] for k in keys
                    if k in r.flat or k in r.defaults} for r in readable}


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Dotted keys -> JSON text of the value (lists whole), without the per-seed keys."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if not prefix and key in PER_SEED:
            continue
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = json.dumps(value, sort_keys=True)
    return flat


def varying(runs: list[Run]) -> list[str]:
    """The config keys whose value is not the same in every readable run (a key one run lacks
    counts as differing): `modality` and `type` keys first (method.type, task.type), then in
    config order. Where a section's `type` differs, its other keys are left out: another method or
    task has other settings anyway, and its type says which. Where the modality differs, so are
    the keys some run lacks: another backend's settings, which read as `model.kind=null` in the
    label of every run (a key a run lacks is None) and took the label's first places."""
    flats = list(compared(runs).values())
    keys = list(dict.fromkeys(k for f in flats for k in f))
    differ = [k for k in keys if len({f.get(k) for f in flats}) > 1]
    if "modality" in differ:
        differ = [k for k in differ if all(k in f for f in flats)]
    typed = [k[: -len("type")] for k in differ if k.endswith(".type")]  # "method.", "task."
    differ = [k for k in differ if not any(k.startswith(p) and k != p + "type" or k + "." == p for p in typed)]
    # a section null in one run and set in another (rollout.tools): its keys say how they differ,
    # and the section itself, a key the run that sets it lacks, labelled that run `rollout.tools=None`
    differ = [k for k in differ if not any(j.startswith(k + ".") for j in differ)]
    return sorted(differ, key=lambda k: (k != "modality", not k.endswith(".type")))  # stable: config order otherwise


def label(run: Run, keys: list[str], flats: dict[int, dict[str, str]] | None = None) -> dict[str, Any]:
    """The run's values of `keys` (None where its config lacks one), from `flats` (compared)
    where given."""
    flat = flats[id(run)] if flats is not None else run.flat
    return {k: json.loads(flat[k]) if k in flat else None for k in keys}


def metric_names(runs: list[Run], chosen: list[str]) -> list[str]:
    """Every held-out metric of the finished runs (first-seen order), or the `chosen` ones;
    ValueError naming a chosen metric no run reports."""
    known = list(dict.fromkeys(k for r in runs if r.summary for when in ("eval_before", "eval_after")
                               for k in (r.summary.get(when) or {})))
    unknown = [m for m in chosen if m not in known]
    if unknown:
        raise ValueError(f"--metric {', '.join(unknown)}: no run reports it (the runs' held-out metrics: "
                         f"{', '.join(known) or 'none, as no run has finished'})")
    return list(dict.fromkeys(chosen)) or known  # a metric named twice is one column


def run_rows(runs: list[Run], metrics: list[str]) -> list[dict[str, Any]]:
    """One record per run: its label, seed, steps, status, metrics before/after, best, seconds."""
    keys, flats = varying(runs), compared(runs)
    rows = []
    for r in runs:
        s = r.summary or {}
        rows.append({
            "run": str(r.path), "config": {} if r.error else label(r, keys, flats), "seed": r.config.get("seed"),
            "steps": r.steps, "status": r.status,
            "before": {m: r.evaluation("before", m) for m in metrics},
            "after": {m: r.evaluation("after", m) for m in metrics},
            "best": s.get("best"), "train_seconds": _number(s.get("train_seconds")),
        })
    return rows


def groups(runs: list[Run]) -> list[list[Run]]:
    """The runs whose configs are equal but for PER_SEED, in order of first appearance; an
    unreadable run is a group of its own."""
    found: dict[str, list[Run]] = {}
    flats = compared(runs)
    for r in runs:
        found.setdefault("\0" + str(r.path) if r.error else json.dumps(flats[id(r)], sort_keys=True), []).append(r)
    return list(found.values())


def group_rows(runs: list[Run], metrics: list[str]) -> list[dict[str, Any]]:
    """One record per configuration (runs equal but for PER_SEED): its seeds, runs, how many
    finished, and per metric the n, mean and sample sd after training and of the change."""
    keys, flats = varying(runs), compared(runs)
    rows = []
    for members in groups(runs):
        done = [r for r in members if r.summary is not None]
        stats = {}
        for m in metrics:
            after = [r.evaluation("after", m) for r in done]
            before = [r.evaluation("before", m) for r in done]
            change = [a - b for a, b in zip(after, before) if a is not None and b is not None]
            after = [a for a in after if a is not None]
            stats[m] = {"n": len(after), "after_mean": _mean(after), "after_sd": _sd(after),
                        "change_mean": _mean(change), "change_sd": _sd(change)}
        seeds = [r.config.get("seed") for r in done]
        twice = sorted({str(x) for x in seeds if seeds.count(x) > 1})
        if twice:  # a copied run, or one trained twice: not two draws of the spread
            warnings.warn(f"runs of one configuration share seed {', '.join(twice)} "
                          f"({', '.join(str(r.path) for r in done if str(r.config.get('seed')) in twice)}): "
                          "the mean and standard deviation count each of them", stacklevel=2)
        first = members[0]
        rows.append({
            "config": {} if first.error else label(first, keys, flats), "status": first.status if first.error else None,
            "seeds": [r.config.get("seed") for r in members],
            "runs": [str(r.path) for r in members], "finished": len(done), "metrics": stats,
            "train_seconds_mean": _mean([t for t in (_number(r.summary.get("train_seconds")) for r in done)
                                         if t is not None]),
        })
    return rows


def markdown_runs(rows: list[dict[str, Any]], metrics: list[str]) -> str:
    """A Markdown table of run_rows: a metric's cell is `before → after`."""
    show_config = any(r["config"] for r in rows)  # runs that differ in more than their seed
    head = ["run"] + (["config"] if show_config else []) + ["seed", "steps"] + metrics + ["best", "train s", "status"]
    body = []
    for r in rows:
        best = r["best"]
        body.append([r["run"]] + ([_label(r["config"])] if show_config else []) + [_cell(r["seed"]), _cell(r["steps"])]
                    + [_arrow(r["before"][m], r["after"][m]) for m in metrics]
                    + [f"{best['metric']} {_num(best['value'])} @ {best['step']}" if best else "",
                       _seconds(r["train_seconds"]), r["status"]])
    return _table(head, body)


def markdown_groups(rows: list[dict[str, Any]], metrics: list[str]) -> str:
    """A Markdown table of group_rows: a metric's cell is `mean ± sd (change mean ± sd)` after
    training, over the finished runs (no ± where one run finished), and `[n of N]` where only n
    of the N finished runs have a value for it (null in the others' summary.json)."""
    head = ["config", "seeds", "finished"] + metrics + ["train s"]
    body = []
    for r in rows:
        cells = []
        for m in metrics:
            s = r["metrics"][m]
            cell = _pm(s["after_mean"], s["after_sd"]) if s["n"] else ""
            if s["change_mean"] is not None:
                cell += f" ({_pm(s['change_mean'], s['change_sd'], signed=True)})"
            if 0 < s["n"] < r["finished"]:  # else "finished 3 of 3" read as a mean over all three
                cell += f" [{s['n']} of {r['finished']}]"
            cells.append(cell)
        body.append([r["status"] or _label(r["config"]) or "(one configuration)", ", ".join(map(_cell, r["seeds"])),
                     f"{r['finished']} of {len(r['runs'])}"] + cells + [_seconds(r["train_seconds_mean"])])
    return _table(head, body)


def _table(head: list[str], body: list[list[str]]) -> str:
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

    return "\n".join([line(head), line(["---"] * len(head))] + [line(row) for row in body]) + "\n"


def _number(v: Any) -> float | None:
    """A finite number, else None (summary.json writes a metric without data as null)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _sd(values: list[float]) -> float | None:
    return statistics.stdev(values) if len(values) > 1 else None


def _num(v: float | None, signed: bool = False) -> str:
    return "–" if v is None else f"{v:+.3f}" if signed else f"{v:.3f}"


def _pm(mean: float | None, sd: float | None, signed: bool = False) -> str:
    return _num(mean, signed) + ("" if sd is None else f" ± {sd:.3f}")


def _arrow(before: float | None, after: float | None) -> str:
    return "" if before is None and after is None else f"{_num(before)} → {_num(after)}"


def _seconds(v: float | None) -> str:
    return "" if v is None else f"{v:.0f}"


def _cell(v: Any) -> str:
    return "" if v is None else str(v)


def _label(config: dict[str, Any], most: int = 4) -> str:
    """The first `most` settings of a row (--json has them all)."""
    shown = [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in list(config.items())[:most]]
    return " ".join(shown) + (f" (+{len(config) - most} more)" if len(config) > most else "")
