"""`mmrl`: the vision-language CLI (train, eval, sample) and the demo app."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from mmrl.core.cli import BackendSpec, fail, make_app, run

SPEC = BackendSpec(modality="vlm", title="vision-language", command="mmrl", module="mmrl.vlm.backend",
                   settings="mmrl.vlm.config",
                   scored_prompts="Held-out items carry their reward atoms; --prompt questions "
                                  "(with --image) have no gold answer and are not scored.")
app = make_app(SPEC)


@app.command()
def demo(
    run: list[Path] = typer.Option(None, "--run", metavar="RUN", help="A run directory whose final checkpoint is the 'after' "
                                   "model of its modality (repeatable; the last one of a modality wins). "
                                   "Without one, a modality uses its embedded default run."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; loopback by default."),
    port: int = typer.Option(7860, "--port", help="Port to serve on."),
    no_train: bool = typer.Option(False, "--no-train", help="Do not train a missing default run on first "
                                  "use; show an error in its tab instead."),
):
    """Gradio app of before/after samples for every modality, and run curves (the `demo` extra).

    Each tab samples the base model and the fine-tuned one with the same seeds and shows every
    sample's reward atoms. Works offline; nothing is sent anywhere.
    """
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before Gradio is imported: no phoning home
    try:
        import gradio  # noqa: F401
    except ModuleNotFoundError:
        fail('the demo needs Gradio: pip install "mmrl[demo]" (in a source checkout: pip install -e ".[demo]")',
             code=3)
    from mmrl.demo.app import launch
    from mmrl.demo.runs import RunError

    # launch warns of an address other machines reach (after the bind, with what it means for the
    # Runs tab), by mmrl.core.serve.is_loopback: a warning here too said it twice
    try:
        launch(run or [], host=host, port=port, train_missing=not no_train)
    except RunError as e:
        fail(str(e))


def main() -> None:
    run(app)


if __name__ == "__main__":
    main()
