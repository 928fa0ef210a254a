"""The toy backend's command line as a script, for tests that start it under a launcher
(`torchrun tests/reliability/toy_cli.py train ...`). TOY_ROLLOUT_SECONDS=s makes each training
rollout take s seconds longer, so that a test's signal comes in mid-step."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, where toy.py is

import toy  # after the path it needs

from mmrl.core.cli import BackendSpec, make_app

if os.environ.get("TOY_ROLLOUT_SECONDS"):
    generate, pause = toy.ToyPolicy.generate, float(os.environ["TOY_ROLLOUT_SECONDS"])

    def slow_generate(self, *args, **kwargs):
        time.sleep(pause)
        return generate(self, *args, **kwargs)

    toy.ToyPolicy.generate = slow_generate

app = make_app(BackendSpec(modality="toy", title="toy", command="toy-rl", module="toy"))

if __name__ == "__main__":
    app()
