"""`dllm-rl`: the diffusion language CLI (train, eval, sample)."""

from __future__ import annotations

from mmrl.core.cli import BackendSpec, make_app, run

SPEC = BackendSpec(modality="dllm", title="diffusion language", command="dllm-rl", module="dllm_rl.backend",
                   settings="dllm_rl.config",
                   scored_prompts="Held-out problems, and --prompt problems of the task (a jsonl file's "
                                  "prompts) or in its format (\"12+3=\", a sudoku with one solution), carry "
                                  "their reward atoms.")
app = make_app(SPEC)


def main() -> None:
    run(app)


if __name__ == "__main__":
    main()
