"""The toy backend's command line as a script, for tests that start it as a process of its own
or under a launcher (`torchrun tests/reliability/toy_cli.py train ...`). TOY_ROLLOUT_SECONDS=s
makes each training rollout take s seconds longer, so that a test's signal comes in mid-step
(`signalled_in_step_two`)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, where toy.py is

import toy  # after the path it needs

from mmrl.core.cli import BackendSpec, make_app, run

if os.environ.get("TOY_ROLLOUT_SECONDS"):
    generate, pause = toy.ToyPolicy.generate, float(os.environ["TOY_ROLLOUT_SECONDS"])

    def slow_generate(self, *args, **kwargs):
        time.sleep(pause)
        return generate(self, *args, **kwargs)

    toy.ToyPolicy.generate = slow_generate

app = make_app(BackendSpec(modality="toy", title="toy", command="toy-rl", module="toy"))


def signalled_in_step_two(command: list[str], env: dict[str, str], out: Path, send) -> tuple[int, str]:
    """Start `command` (a run writing to `out`, its rollouts slowed by env's TOY_ROLLOUT_SECONDS)
    in a session of its own; once step 1 is logged and step 2's rollout has begun, call
    send(process, its child PIDs); then (exit code, stderr) once it ends."""
    from mmrl.core.logging import read_metrics

    proc = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while len(read_metrics(out / "metrics.jsonl")) < 1:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the run logged no step in time"
            time.sleep(0.02)
        time.sleep(0.3)  # past step 1's end (a signal there stops before step 2), into step 2's rollout
        send(proc, [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()])
        stderr = proc.communicate(timeout=180)[1]
        return proc.returncode, stderr
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

if __name__ == "__main__":
    run(app)  # as the console scripts do
