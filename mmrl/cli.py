"""`mmrl`: the vision-language CLI (train, eval, sample) and the demo app."""

from __future__ import annotations

import typer

from mmrl.core.cli import BackendSpec, fail, make_app, run

SPEC = BackendSpec(modality="vlm", title="vision-language", command="mmrl", module="mmrl.vlm.backend")
app = make_app(SPEC)


@app.command()
def demo(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; loopback by default."),
    port: int = typer.Option(7860, "--port", help="Port to serve on."),
):
    """Gradio app of before/after samples for every modality (the `demo` extra)."""
    fail("the demo app is not available yet in this version of mmrl.", code=3)


def main() -> None:
    run(app)


if __name__ == "__main__":
    main()
