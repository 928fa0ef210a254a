"""report.html: one self-contained page per training run, next to its reward_curve.png.

    config            the run's config.yaml
    before / after    every held-out metric of summary.json, with the change
    curves            training reward and held-out accuracies (mmrl.demo.runs.plot_curves)
    samples           the before/after sample grids an image task writes (samples/grid_*.png,
                      with the prompt of each row),
                      the before/after answers a text task writes (samples/samples_*.json), and
                      the last logged training samples (samples/step_*.jsonl)
    environment       each start of the run (environment.json): code, libraries, device, and how
                      it ended (or that its process still runs, or is gone, on this host)

Images are embedded as base64 and the page has no script and no external link, so it opens
offline and can be mailed as one file. The trainer writes it at the end of every run
(`write_report`); `python -m mmrl.demo.report RUN_DIR` rewrites it.
"""

from __future__ import annotations

import base64
import html
import io
import json
import sys
from pathlib import Path
from typing import Any

from mmrl.core import provenance
from mmrl.core.logging import write_atomically
from mmrl.demo.runs import TITLES, RunError, RunInfo, plot_curves

REPORT = "report.html"
MAX_ROWS = 24  # rows of a sample table

_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}
td{white-space:pre-wrap;overflow-wrap:anywhere;unicode-bidi:plaintext}
th{background:#f3f3f3}pre{background:#f7f7f7;padding:1em;overflow:auto;font-size:12px;max-height:420px}
.up{color:#070}.down{color:#a00}img{max-width:100%}h2{border-bottom:1px solid #ddd}
"""


def _png(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _file_png(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


# C0 controls but tab, LF and CR, and DEL, as their Unicode pictures ("\x00" -> "␀"): a browser
# drops a NUL and shows the others as nothing, so a prompt holding one read as if it did not
_CONTROLS = {c: 0x2400 + c for c in (*range(0x09), 0x0b, 0x0c, *range(0x0e, 0x20))} | {0x7f: 0x2421}


def _text(value: str) -> str:
    """A model's or a dataset's text as HTML: escaped (a "<script>" prompt is text, not a
    script), its control characters shown; its line breaks and tabs kept by td's pre-wrap."""
    return html.escape(value.translate(_CONTROLS))


def _cell(value: Any) -> str:
    if value is None:  # a metric without data (null in summary.json), as the demo's runs tab shows it
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{_text(str(k))}: {_cell(v)}" for k, v in value.items())
    return _text(str(value))


def _table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    if not rows:
        return "<p>(none)</p>"
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_cell(r.get(c, ''))}</td>" for c in columns) + "</tr>"
                   for r in rows[:MAX_ROWS])
    more = f"<p>... and {len(rows) - MAX_ROWS} more</p>" if len(rows) > MAX_ROWS else ""
    return f"<table><tr>{head}</tr>{body}</table>{more}"


def _metrics_table(summary: dict[str, Any]) -> str:
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    rows = []
    for key in dict.fromkeys([*before, *after]):
        b, a = before.get(key), after.get(key)
        change = ""
        if isinstance(b, int | float) and isinstance(a, int | float):
            d = a - b
            change = f'<span class="{"up" if d > 0 else "down" if d < 0 else ""}">{d:+.4g}</span>'
        rows.append(f"<tr><td>{html.escape(key)}</td><td>{_cell(b)}</td><td>{_cell(a)}</td><td>{change}</td></tr>")
    return ("<table><tr><th>metric</th><th>before</th><th>after</th><th>change</th></tr>"
            + "".join(rows) + "</table>")


def _json_rows(path: Path, lines: bool) -> list[dict[str, Any]]:
    """The rows of a samples file: a JSON list, or (lines) one JSON row per line. A model's
    text may hold any bytes (errors="replace"); step_*.jsonl is appended while the run goes, so
    a last line a kill cut short is dropped. Anything else unreadable is a ValueError."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if not lines:
        rows = json.loads(text)
    else:
        split = text.split("\n")
        rows = []
        for n, line in enumerate(split, 1):
            try:
                if line.strip():
                    rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                if n == len(split):  # no newline after it: a write the process did not finish
                    break
                raise ValueError(f"line {n}: {e}") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError("not a list of JSON objects")
    return rows


def _sample_table(path: Path, columns: list[str] | None = None, lines: bool = False) -> str:
    """The table of one samples file; a file that cannot be read says why instead of failing
    the whole report (the report is written at the end of every run)."""
    try:
        return _table(_json_rows(path, lines), columns)
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        return f"<p>(unreadable: {html.escape(f'{path.name}: {e}')})</p>"


def _grid_prompts(path: Path) -> str:
    """The prompt of each row of a sample grid (its grid_*.json): the image numbers its rows
    only. "" where there is no such file (a run that predates it); said where it is unreadable."""
    try:
        prompts = json.loads(path.read_text(encoding="utf-8"))["rows"]
        if not isinstance(prompts, list):
            raise TypeError("its rows are not a list")
    except FileNotFoundError:
        return ""
    except (OSError, ValueError, TypeError, KeyError) as e:  # a damaged file
        return f"<p>(unreadable: {html.escape(f'{path.name}: {type(e).__name__} {e}')})</p>"
    return _table([{"row": i, "prompt": p} for i, p in enumerate(prompts)])


def _samples(run: RunInfo) -> str:
    root, parts = run.path / "samples", []
    for tag in ("before", "after"):
        grid = root / f"grid_{tag}.png"
        if grid.is_file():
            parts.append(f"<h3>{tag}</h3><img alt='samples {tag}' src='{_file_png(grid)}'>"
                         + _grid_prompts(grid.with_suffix(".json")))
        answers = root / f"samples_{tag}.json"
        if answers.is_file():
            parts.append(f"<h3>{tag}</h3>" + _sample_table(answers))
    logged = sorted(root.glob("step_*.jsonl")) if root.is_dir() else []
    if logged:
        step = logged[-1].stem.removeprefix("step_")  # step_00000005.jsonl: step 5
        step = str(int(step)) if step.isdigit() else step
        parts.append(f"<h3>training samples, step {html.escape(step)}</h3>"
                     + _sample_table(logged[-1], ["group", "prompt", "completion", "reward", "atoms", "advantage"],
                                     lines=True))
    return "".join(parts) or "<p>(this run saved no samples)</p>"


def _environment(run: RunInfo) -> str:
    """A row per start of the run (mmrl.core.provenance); an unreadable file is said, not raised."""
    try:
        entries = json.loads((run.path / "environment.json").read_text(encoding="utf-8"))
        rows = []
        for e in entries:
            git = e.get("git") or {}
            code = e.get("mmrl") or "?"
            if git.get("commit"):
                code += f" ({git['commit'][:10]}{', uncommitted changes' if git.get('dirty') else ''})"
            packages = e.get("packages") or {}
            rows.append({"started": e.get("started"), "at step": e.get("step"), "mmrl": code,
                         "torch": packages.get("torch"), "transformers": packages.get("transformers"),
                         "device": e.get("device"), "processes": e.get("processes"),
                         "command": " ".join(map(str, e.get("command") or [])),
                         "ended": _ending(e)})
    except FileNotFoundError:
        return "<p>(no environment.json: the run predates it)</p>"
    except (OSError, ValueError, TypeError, AttributeError) as e:  # a damaged file
        return f"<p>(environment.json is unreadable: {html.escape(type(e).__name__)})</p>"
    return _table(rows)


def _ending(entry: dict[str, Any]) -> str:
    """How a start ended (environment.json's "ended"); none: killed outright, or still going,
    which its process tells where it ran on this host (provenance.alive)."""
    ended = entry.get("ended")
    if isinstance(ended, dict):
        return f"{ended.get('how')} at step {ended.get('step')}"
    alive = provenance.alive(entry)
    if alive is None:
        return "(no record: killed, or still going)"
    return f"running (pid {entry['pid']})" if alive else "killed (no ending recorded)"


def render(run: RunInfo) -> str:
    """The report of a run as one HTML string."""
    s = run.summary or {}
    config = (run.path / "config.yaml").read_text(encoding="utf-8")
    facts = [f"{TITLES[run.modality]} run, {s.get('steps', len(run.metrics))} steps"]
    if s.get("train_seconds") is not None:
        facts.append(f"{s['train_seconds']:.0f} s of training")
    if s.get("checkpoint"):
        facts.append(f"final model: <code>{html.escape(str(s['checkpoint']))}</code>")
    best = s.get("best")
    if isinstance(best, dict) and {"metric", "value", "step", "checkpoint"} <= set(best):
        facts.append(f"best by held-out {html.escape(str(best['metric']))}: {_cell(best['value'])} at step "
                     f"{_cell(best['step'])}, <code>{html.escape(str(best['checkpoint']))}/model</code>")
    metrics = _metrics_table(s) if s else "<p>(no summary.json yet: the run has not finished)</p>"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(run.name)}: mmrl run report</title>
<style>{_STYLE}</style></head><body>
<h1>{html.escape(run.name)}</h1><p>{"; ".join(facts)}</p>
<h2>Held-out metrics, before and after</h2>{metrics}
<h2>Curves</h2><img alt="curves" src="{_png(plot_curves(run))}">
<h2>Samples</h2>{_samples(run)}
<h2>Environment</h2>{_environment(run)}
<h2>Config</h2><pre>{html.escape(config)}</pre>
</body></html>
"""


def write_report(run_dir: str | Path, metrics: list[dict[str, Any]] | None = None) -> Path:
    """Write <run_dir>/report.html (atomically: a reader never sees half a page). `metrics`: its
    metrics.jsonl rows where the caller has them (RunInfo.load)."""
    run = RunInfo.load(run_dir, metrics)
    out = run.path / REPORT
    write_atomically(out, render(run))
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["-h"]:
        if arg in ("-h", "--help"):
            print("usage: python -m mmrl.demo.report RUN_DIR [RUN_DIR ...]  (rewrites RUN_DIR/report.html)")
            continue
        try:
            print(write_report(arg))
        except RunError as e:  # not a run directory: one line, not a traceback
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
