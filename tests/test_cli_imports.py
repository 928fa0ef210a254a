"""The verbs that need no model answer at once: `--help` of every verb, `config`, `runs` and a
mistyped flag import neither torch nor transformers or diffusers (their import took seconds of the
4 that `mmrl --help` made a user wait, and of `config`'s 5). The imports that do are in the
functions that use them (mmrl/core/cli.py, mmrl/demo/table.py, mmrl/core/checkpoint.py); `config`
reads a backend's settings module (BackendSpec.settings), not the backend with its model code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import typer

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

# Each CLI's --help and every verb's, its `config` (a part of it, --set, a run's settings), `runs`
# over a finished run and over a folder with an unfinished one, and two bad inputs, in one fresh
# interpreter (torch is imported in this one already); prints what got imported.
SCRIPT = """
import json, sys
from typer.testing import CliRunner
import diffusion_rl.cli, dllm_rl.cli, mmrl.cli

codes, configs = [], []
for cli in (mmrl.cli, diffusion_rl.cli, dllm_rl.cli):
    verbs = [c.name or c.callback.__name__.replace("_", "-") for c in cli.app.registered_commands]
    more = [["train", "--bogus"], ["runs", sys.argv[1]], ["runs", sys.argv[2]]]
    for args in [["--help"]] + [[verb, "--help"] for verb in verbs] + more:
        result = CliRunner().invoke(cli.app, args)
        codes.append([args, result.exit_code, result.output[:1000]])
    for args in (["config"], ["config", "-k", "rollout", "--set", "seed=3"], ["config", "--checkpoint", sys.argv[3]]):
        result = CliRunner().invoke(cli.app, args)
        configs.append([cli.SPEC.command, args[:2], result.exit_code, result.output])
codes.append([["runs", "/no/such/run"], CliRunner().invoke(mmrl.cli.app, ["runs", "/no/such/run"]).exit_code, ""])
heavy = [m for m in ("torch", "transformers", "diffusers") if m in sys.modules]
print(json.dumps({"codes": codes, "configs": configs, "heavy": heavy}))
"""


def test_help_config_runs_and_bad_flags_import_no_torch(tmp_path):
    run = tmp_path / "sweep" / "grpo-0"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\nmethod: {type: grpo}\ntrain: {max_steps: 2}\n")
    (run / "summary.json").write_text(json.dumps({"eval_before": {"accuracy": 0.25}, "eval_after": {"accuracy": 0.5},
                                                  "steps": 2, "train_seconds": 3.0}))
    # unfinished: interrupted at step 3 with step 2 saved (its status reads environment.json and
    # checkpoints/); also `config --checkpoint`'s run
    stopped = tmp_path / "sweep" / "grpo-1"
    (stopped / "checkpoints" / "step-00000002").mkdir(parents=True)
    (stopped / "checkpoints" / "step-00000002" / "trainer_state.json").write_text("{}")
    (stopped / "config.yaml").write_text("seed: 1\nmethod: {type: grpo}\ntrain: {max_steps: 10}\n")
    (stopped / "environment.json").write_text(json.dumps([{"ended": {"how": "interrupted", "step": 3}}]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(run), str(run.parent), str(stopped)], check=False,
                          env=ENV, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    codes = {" ".join(args): (code, text) for args, code, text in got["codes"]}
    helps = [args for args, code, text in got["codes"] if args[-1] == "--help" and code == 0 and "Usage:" in text]
    assert len(helps) == 3 + 8 + 8 + 7  # each CLI's, and its verbs': mmrl's demo, diffusion-rl's calibrate-window
    code, text = codes[f"runs {run}"]
    assert code == 0 and "0.250 → 0.500" in text
    code, text = codes[f"runs {run.parent}"]
    assert code == 0 and "interrupted (at step 3 of 10; --resume goes on from step 2)" in text
    configs = {(command, " ".join(args)): (code, text) for command, args, code, text in got["configs"]}
    for command in ("mmrl", "diffusion-rl", "dllm-rl"):
        code, text = configs[command, "config"]
        assert code == 0 and "\nseed: 0\n" in text and "\nrollout:\n" in text, text[-500:]  # the whole config
        code, text = configs[command, "config -k"]
        assert code == 0 and "\nrollout:\n" in text and "\nseed:" not in text, text[-500:]  # that part alone
    code, text = configs["mmrl", "config --checkpoint"]  # the unfinished run's settings
    assert code == 0 and "\nseed: 1\n" in text and "max_steps: 10\n" in text, text[-500:]
    for command in ("diffusion-rl", "dllm-rl"):  # a VLM run: the other config classes name its command
        code, text = configs[command, "config --checkpoint"]
        assert code == 2 and "a `mmrl` method" in text, text[-500:]
    assert codes["train --bogus"][0] == 2 and codes["runs /no/such/run"][0] == 2
    assert got["heavy"] == []


def test_serve_max_samples_default_is_the_servers():
    """cli.py states serve --max-samples' default itself: mmrl.core.serve imports torch."""
    from mmrl.core import serve
    from mmrl.core.cli import MAX_SAMPLES, BackendSpec, make_app

    command = typer.main.get_command(make_app(BackendSpec(modality="toy", title="toy", command="toy-rl",
                                                          module="toy"))).commands["serve"]
    assert MAX_SAMPLES == serve.MAX_SAMPLES == next(p.default for p in command.params if p.name == "max_samples")
