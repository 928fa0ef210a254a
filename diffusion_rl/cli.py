"""`diffusion-rl`: the flow / diffusion image CLI (train, eval, sample, calibrate-window)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from mmrl.core.cli import PLAIN, BackendSpec, console, fail, make_app, run, user_errors

SPEC = BackendSpec(modality="diffusion", title="flow / diffusion image", command="diffusion-rl", module="diffusion_rl.backend",
                   settings="diffusion_rl.config",
                   scored_prompts="Held-out prompts, and --prompt prompts in shapes-geneval's "
                                  "grammar (\"two red circles left of a blue square\"), carry their reward atoms.")
app = make_app(SPEC)


@app.command("calibrate-window")
def calibrate_window(
    config: Path | None = typer.Option(None, "--config", "-c", help="YAML config of the run (model, task, rollout)."),
    set_: list[str] = typer.Option([], "--set", "-s", metavar="KEY=VALUE", help="Override a key (repeatable)."),
    out: Path | None = typer.Option(None, "--out", help="Directory for window.json; default: the run's output_dir."),
    prompts: int | None = typer.Option(None, "--prompts", min=1, help="Held-out calibration prompts (method.calibration_prompts, 32 unless the config sets it)."),
    into_model: bool | None = typer.Option(
        None, "--into-model/--no-into-model",
        help="Also store the window in the model's directory (cast_window.json); default: yes for a "
             "model.path, no for the bundled model (its files belong to the package)."),
):
    """CAST: place the SDE window where the model's atom verdicts commit along ODE rollouts
    (diffusion_rl.calibrate); writes window.json and prints it. With --into-model (the default
    for a model.path) the window is also stored with the model (cast_window.json), and CAST uses it
    whenever it trains from that model, unless method.window_from names another file (or null:
    the rollout's own window) or rollout.window_start is set."""
    from diffusion_rl import backend
    from diffusion_rl.calibrate import summary_line
    from mmrl.core.config import load_config

    try:
        cfg = load_config(backend.CONFIG_CLASS, config, list(set_), defaults=dict(backend.DEFAULT_CONFIG))
        cal, paths = backend.calibrate(cfg, out, prompts, into_model=into_model)
    except user_errors() as e:
        fail(str(e))
    print(json.dumps(cal.to_dict()))
    console.print(summary_line(cal), highlight=False)
    for path in paths:
        console.print(f"wrote {path}", **PLAIN)  # a path: never broken across lines, "[" as it is


def main() -> None:
    run(app)


if __name__ == "__main__":
    main()
