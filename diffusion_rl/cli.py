"""`diffusion-rl`: the flow / diffusion image CLI (train, eval, sample)."""

from __future__ import annotations

from mmrl.core.cli import BackendSpec, make_app, run

SPEC = BackendSpec(modality="diffusion", title="flow / diffusion image", command="diffusion-rl", module="diffusion_rl.backend")
app = make_app(SPEC)


def main() -> None:
    run(app)


if __name__ == "__main__":
    main()
