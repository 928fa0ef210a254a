"""`mmrl demo`: a Gradio app with a tab per modality (before / after samples) and a run tab.

    mmrl demo                                   the embedded default runs (trained on first use)
    mmrl demo --run runs/x --run runs/y         these runs' checkpoints as the "after" models
    mmrl demo --host 0.0.0.0 --port 8080

Each modality tab loads the base model and the fine-tuned one of its run (the last --run of
that modality, else the modality's default run), samples both with the same seeds and shows
every sample's reward atoms, passed or failed, and the total. The run tab plots the reward
and held-out accuracy curves of any run directory's metrics.jsonl.

Offline by construction: analytics off, system fonts (no font download), no share link, no
server-side rendering process; it binds to 127.0.0.1 unless --host says otherwise.
"""

from __future__ import annotations

import functools
import html
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from mmrl.demo.compare import (
    ModelPair,
    Shown,
    compare_diffusion,
    compare_dllm,
    compare_vlm,
    dllm_problem,
    ensure_default_run,
)
from mmrl.demo.runs import MODALITIES, TITLES, RunError, RunInfo, default_run_dir, plot_curves

BEFORE, AFTER = "### Before: the base model", "### After: the fine-tuned checkpoint"
CSS = ".atom-ok{color:#070}.atom-bad{color:#b00}.atom-na{color:#888}.sample{margin:.4em 0;padding:.4em;border:1px solid #ddd}"


def atoms_html(s: Shown) -> str:
    marks = []
    for name, v in s.atoms.items():
        name = html.escape(name)  # a run's own reward.atoms are named by the user
        if v is None:
            marks.append(f'<span class="atom-na" title="cannot be checked">{name}: n/a</span>')
        else:
            ok = v >= 0.5
            marks.append(f'<span class="{"atom-ok" if ok else "atom-bad"}">{name}: {"&#10003;" if ok else "&#10007;"}'
                         f"{'' if v in (0.0, 1.0) else f' ({v:.2f})'}</span>")
    total = "n/a" if s.total is None else f"{s.total:.3f}"
    return " &middot; ".join(marks) + f" &middot; <b>total {total}</b>"


def samples_html(shown: list[Shown], kind: str) -> str:
    rows = []
    for s in shown:
        body = "" if kind == "image" else f"<pre style='margin:.2em 0'>{html.escape(str(s.output))}</pre>"
        order = f"<div>denoising order: {s.order}</div>" if s.order else ""
        extra = " ".join(f"{k} {v}" for k, v in s.extra.items())
        rows.append(f"<div class='sample'><b>{html.escape(s.label)}</b> <small>{html.escape(extra)}</small>"
                    f"{body}{order}<div>{atoms_html(s)}</div></div>")
    return "".join(rows)


class Demo:
    """The app's state: one run per modality (its pair built on first use) and the run list."""

    def __init__(self, runs: list[RunInfo], train_missing: bool = True, any_path: bool = True):
        """`any_path`: the Runs tab reads any directory typed into it; else only these runs and
        the default ones (a demo that other machines reach: nothing asks who types)."""
        self.runs = runs
        self.train_missing = train_missing
        self.any_path = any_path
        self.chosen: dict[str, Path] = {m: default_run_dir(m) for m in MODALITIES}
        for run in runs:  # the last run of each modality wins
            self.chosen[run.modality] = run.path
        self.pairs: dict[str, ModelPair] = {}
        self.lock = threading.RLock()  # one model build / generation at a time (loaders are not thread-safe)

    def pair(self, modality: str, progress=None) -> ModelPair:
        with self.lock:
            return self._pair(modality, progress)

    def _pair(self, modality: str, progress=None) -> ModelPair:
        if modality not in self.pairs:
            path = self.chosen[modality]
            # Only the embedded default run is trained here: training into a user's --run
            # directory would overwrite its config.yaml and metrics.jsonl with the default's.
            default = Path(path).resolve() == default_run_dir(modality).resolve()
            try:
                run = RunInfo.load(path)
                ready = run.model_dir() is not None
            except (ValueError, OSError):
                if not default:  # a user's run that cannot be read: its own message, not "no checkpoint"
                    raise
                ready = False
            if not ready:
                if not (default and self.train_missing):
                    raise FileNotFoundError(f"{path} has no checkpoint yet; pass --run DIR with a finished run")
                track = (lambda i, n: progress((i, n), desc=f"training the default {modality} run")) if progress else None
                run = ensure_default_run(modality, track, path)
            self.pairs[modality] = ModelPair(run)
        return self.pairs[modality]

    def run_info(self, path: str | Path) -> RunInfo:
        """The run at `path` for the Runs tab; a RunError for a path it may not read."""
        listed = {Path(p).resolve() for p in [*(r.path for r in self.runs), *self.chosen.values()]}
        if not self.any_path and Path(path).resolve() not in listed:
            # Security: every client may type a path, and the demo has no password; reading any
            # directory's config.yaml, summary.json and metrics.jsonl is for its owner's browser.
            raise RunError(f"{path}: this demo serves other machines, so its Runs tab shows only the runs it was "
                           "started with (mmrl demo --run DIR), not any path typed in")
        return RunInfo.load(path)

    def held_out(self, modality: str, index: int):
        with self.lock:
            pair = self.pair(modality)
            _, task = pair.get("before")
        items = task.eval_items if modality == "vlm" else task.eval_prompts if modality == "diffusion" \
            else task.eval_problems
        if not items:  # a run with task.num_eval=0 (the modulo below would be a bare "Error" in Gradio)
            raise ValueError(f"{pair.run.path}: the run's task has no held-out items (task.num_eval=0); "
                             "type your own input instead")
        return items[int(index) % len(items)]


def before_after(gr, prefix: str, gallery: bool = False) -> list:
    """Two columns, before and after: an HTML panel each (#<prefix>-before, #<prefix>-after),
    under an image gallery each when `gallery` (#<prefix>-before-images, ...)."""
    out = []
    with gr.Row():
        for side, title in (("before", BEFORE), ("after", AFTER)):
            with gr.Column():
                gr.Markdown(title)
                if gallery:
                    out.append(gr.Gallery(label=side, columns=4, height=200, elem_id=f"{prefix}-{side}-images"))
                out.append(gr.HTML(elem_id=f"{prefix}-{side}"))
    return out


def shown_errors(gr, fn):
    """fn, whose user errors (a missing run, a bad prompt or setting: ValueError and its kin,
    FileNotFoundError) reach the page as their message: Gradio shows any other exception as a
    bare "Error"."""

    @functools.wraps(fn)  # Gradio reads the signature (its progress argument) through __wrapped__
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except gr.Error:
            raise
        except (ValueError, FileNotFoundError) as e:
            raise gr.Error(str(e)) from e

    return wrapper


SEED_MAX = 2**63 - 1  # the largest seed every generator takes (a larger one was "Overflow when unpacking long long")


def _number(gr, value, name: str, least: int = 0, most: int = SEED_MAX) -> int:
    """A Number or Slider's value as an int; a cleared field (None) is an error that names it."""
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise gr.Error(f"{name} must be a whole number; got {value!r}") from None
    if out < least:
        raise gr.Error(f"{name} must be at least {least}; got {out}")
    if out > most:
        raise gr.Error(f"{name} must be at most {most}; got {out}")
    return out


def _metric(value) -> str:
    """A summary value as a table cell: a missing or null one (an eval that did not run) is n/a."""
    return f"{value:.4g}" if isinstance(value, int | float) and not isinstance(value, bool) else "n/a"


def _text(gr, value, what: str) -> str:
    text = "" if value is None else str(value)
    if not text.strip():
        raise gr.Error(f"give {what}")
    return text


def build_app(demo: Demo):
    import gradio as gr

    def vlm_new(i):
        item = demo.held_out("vlm", i)
        return item.images[0], item.question, int(i) + 1, int(i)

    def vlm_run(image, question, current, n, seed, progress=gr.Progress()):
        from mmrl.vlm.tasks.shapes_qa import QAItem

        if image is None or not str(question or "").strip():
            raise gr.Error("give an image and a question (or press 'New held-out question')")
        n, seed = _number(gr, n, "samples"), _number(gr, seed, "seed")
        pair = demo.pair("vlm", progress)
        item = demo.held_out("vlm", current) if current is not None and current >= 0 else None
        if item is None or item.question != question:
            item = QAItem([image.convert("RGB")], str(question), "")
        with demo.lock:
            out = compare_vlm(pair, item, n, seed)
        return samples_html(out["before"], "text"), samples_html(out["after"], "text")

    def diffusion_new(i):
        return demo.held_out("diffusion", i), int(i) + 1

    def diffusion_run(prompt, seeds, progress=gr.Progress()):
        prompt = _text(gr, prompt, "a prompt (or press 'New held-out prompt')")
        try:
            seed_list = [int(s) for s in str(seeds or "").replace(",", " ").split()] or [0]
        except ValueError:
            raise gr.Error(f"seeds must be integers separated by commas; got {seeds!r}") from None
        for s in seed_list:
            _number(gr, s, "each seed", -SEED_MAX - 1)
        pair = demo.pair("diffusion", progress)
        with demo.lock:
            out = compare_diffusion(pair, prompt, seed_list)
        gallery = {w: [(s.output, f"{s.label}: total {s.total if s.total is not None else 'n/a'}") for s in out[w]]
                   for w in out}
        return gallery["before"], gallery["after"], samples_html(out["before"], "image"), \
            samples_html(out["after"], "image")

    def dllm_new(i):
        return demo.held_out("dllm", i).prompt, int(i) + 1

    def dllm_run(text, n, seed, strategy, progress=gr.Progress()):
        text = _text(gr, text, "a problem (or press 'New held-out problem')")
        n, seed = _number(gr, n, "samples"), _number(gr, seed, "seed")
        pair = demo.pair("dllm", progress)
        with demo.lock:
            held = {p.prompt: p for p in pair.get("before")[1].eval_problems}
            problem = held.get(text.strip()) or dllm_problem(text, pair.run.config["task"]["type"])
            out = compare_dllm(pair, problem, n, seed, strategy or None)
        return samples_html(out["before"], "text"), samples_html(out["after"], "text")

    def run_view(path):
        if not path:
            return None, ""
        try:
            run = demo.run_info(path)
        except (RunError, OSError) as e:
            raise gr.Error(str(e)) from None
        s = run.summary or {}
        after = s.get("eval_after") or {}
        rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{_metric(v)}</td><td>{_metric(after.get(k))}</td></tr>"
                       for k, v in (s.get("eval_before") or {}).items() if isinstance(v, int | float))
        table = (f"<p>{TITLES[run.modality]} run <code>{html.escape(str(run.path))}</code>, "
                 f"{len(run.metrics)} logged steps</p>"
                 f"<table><tr><th>metric</th><th>before</th><th>after</th></tr>{rows}</table>")
        return plot_curves(run), table

    vlm_new, vlm_run, diffusion_new, diffusion_run, dllm_new, dllm_run = (
        shown_errors(gr, fn) for fn in (vlm_new, vlm_run, diffusion_new, diffusion_run, dllm_new, dllm_run))
    with gr.Blocks(title="mmrl: before / after", analytics_enabled=False) as app:
        gr.Markdown("# mmrl: before / after RL fine-tuning\nThe base model and the fine-tuned one, "
                    "the same seeds, every sample's reward atoms.")
        with gr.Tab(TITLES["vlm"], elem_id="tab-vlm"):
            vlm_idx, vlm_cur = gr.State(0), gr.State(-1)
            with gr.Row():
                image = gr.Image(type="pil", label="image (upload one, or draw a held-out question)", height=224)
                with gr.Column():
                    question = gr.Textbox(label="question", elem_id="vlm-question")
                    with gr.Row():
                        n = gr.Slider(0, 8, value=2, step=1, label="sampled answers")
                        seed = gr.Number(0, precision=0, label="seed")
                    with gr.Row():
                        new = gr.Button("New held-out question", elem_id="vlm-new")
                        go = gr.Button("Generate", variant="primary", elem_id="vlm-generate")
            before, after = before_after(gr, "vlm")
            new.click(vlm_new, [vlm_idx], [image, question, vlm_idx, vlm_cur])
            image.upload(lambda: -1, None, vlm_cur)
            go.click(vlm_run, [image, question, vlm_cur, n, seed], [before, after])
        with gr.Tab(TITLES["diffusion"], elem_id="tab-diffusion"):
            d_idx = gr.State(0)
            prompt = gr.Textbox(label="prompt", value="two red circles left of a blue square", elem_id="diffusion-prompt")
            with gr.Row():
                seeds = gr.Textbox(label="seeds", value="0, 1, 2, 3")
                d_new = gr.Button("New held-out prompt", elem_id="diffusion-new")
                d_go = gr.Button("Generate", variant="primary", elem_id="diffusion-generate")
            g_before, h_before, g_after, h_after = before_after(gr, "diffusion", gallery=True)
            d_new.click(diffusion_new, [d_idx], [prompt, d_idx])
            d_go.click(diffusion_run, [prompt, seeds], [g_before, g_after, h_before, h_after])
        with gr.Tab(TITLES["dllm"], elem_id="tab-dllm"):
            l_idx = gr.State(0)
            problem = gr.Textbox(label="problem (arith: e.g. 12+7=)", value="37+45=", elem_id="dllm-problem")
            with gr.Row():
                ln = gr.Slider(0, 8, value=3, step=1, label="sampled answers")
                lseed = gr.Number(0, precision=0, label="seed")
                strategy = gr.Dropdown(["", "low_confidence", "threshold", "fork", "tau_budget", "ar"], value="fork",
                                       label="decoder (empty: the run's)")
            with gr.Row():
                l_new = gr.Button("New held-out problem", elem_id="dllm-new")
                l_go = gr.Button("Generate", variant="primary", elem_id="dllm-generate")
            l_before, l_after = before_after(gr, "dllm")
            l_new.click(dllm_new, [l_idx], [problem, l_idx])
            l_go.click(dllm_run, [problem, ln, lseed, strategy], [l_before, l_after])
        with gr.Tab("Runs", elem_id="tab-runs"):
            choices = [str(r.path) for r in demo.runs] + [str(p) for p in demo.chosen.values()
                                                          if str(p) not in {str(r.path) for r in demo.runs}]
            run_dir = gr.Dropdown(choices, label="run directory (any path with a metrics.jsonl)",
                                  allow_custom_value=True, elem_id="run-dir")
            plot = gr.Image(label="curves", elem_id="run-plot")
            info = gr.HTML(elem_id="run-info")
            run_dir.change(run_view, [run_dir], [plot, info])
    return app


def launch(run_dirs: list[str | Path], host: str = "127.0.0.1", port: int = 7860, train_missing: bool = True,
           block: bool = True) -> Any:
    """Build and serve the app; returns the Blocks (block=False leaves it serving in a thread)."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from mmrl.core.serve import check_port, is_loopback

    try:  # before Gradio is imported and the app built (tens of seconds): Gradio's own OSError was a traceback
        check_port(host, port)
    except OSError as e:
        raise RunError(f"the demo {e}; choose another --port") from None
    import gradio as gr

    runs = [RunInfo.load(d) for d in run_dirs]
    local = is_loopback(host)
    app = build_app(Demo(runs, train_missing, any_path=local))
    theme = gr.themes.Default(font=["system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"])
    # quiet: Gradio's own lines end with "To create a public link, set `share=True`", which the
    # demo has not (docs: it serves this machine alone); the address is printed here instead
    try:
        app.queue(default_concurrency_limit=1).launch(
            server_name=host, server_port=port, share=False, prevent_thread_lock=True, ssr_mode=False, theme=theme,
            css=CSS, footer_links=[], quiet=True)
    except OSError as e:  # taken since the check above (Gradio binds without SO_REUSEADDR)
        raise RunError(f"the demo cannot serve on {host}:{port}: {e}") from None
    if not local:
        print(f"warning: the demo on {host}:{port} has no password: anyone who can reach it can sample its models; "
              "its Runs tab shows only the runs it was started with", file=sys.stderr, flush=True)
    print(f"demo at {app.local_url} (Ctrl-C stops it)", flush=True)
    if block:
        wait_until_interrupted(app)
    return app


def wait_until_interrupted(app) -> None:
    """Serve until Ctrl-C, then close the server and exit 130 with "interrupted", as `serve` and
    every other verb do: Gradio's block_thread printed its own "Keyboard interruption in main
    thread... closing server." and let the demo exit 0, as if it had finished."""
    try:
        while app.is_running:
            time.sleep(0.1)
    except KeyboardInterrupt:
        app.close()
        print("interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
