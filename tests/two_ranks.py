"""Two-rank tests: two processes on this CPU joined by gloo, as `accelerate launch` joins ranks.

A test marked `@pytest.mark.two_ranks(body=f)` takes the `ranks_ran` fixture (tests/conftest.py):
the directory in which both ranks ran `f(rank, port, tmp)`, `tmp` being that directory. The
body writes what the test checks there (records per rank, a run's output); tests marked with
the same body share one run of it.

Every selected two-rank test's body runs in one launch of two processes for the whole session,
one body after another, each in a process group of its own: a process start costs about 6 s
here (imports), more than most bodies. A body that raises is written to its directory and
fails its own test only; the other rank's collectives time out (process_group's timeout) and
the next body runs once both ranks reach it. Each body starts from the random state of a fresh
process.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process_group(rank: int, port: int, timeout: float = 180.0):
    """This process as rank `rank` of two (gloo, 127.0.0.1:`port`) for the block, then out of the
    group. `timeout`: seconds a collective waits for the other rank before it fails (a rank whose
    body raised fails the other in that time, not gloo's 30 minutes)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=timeout))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _meet(rank: int, tmp: str) -> int:
    """Both ranks at this body, then its port. Each rank waits in the body's directory for the
    other, so a rank held up by the body before (waiting out a collective its partner left when
    it raised) does not make this body's rendezvous time out; then rank 0 picks a free port,
    just before the group starts (one picked at launch could be taken by then), and leaves it
    there for rank 1."""
    def wait_for(path: str) -> None:
        deadline = time.monotonic() + 600
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the other rank never reached {tmp}")
            time.sleep(0.01)

    def leave(path: str, text: str) -> None:
        with open(f"{path}.tmp", "w") as f:
            f.write(text)
        os.replace(f"{path}.tmp", path)

    leave(f"{tmp}/ready.{rank}", "")
    wait_for(f"{tmp}/ready.{1 - rank}")
    if rank == 0:
        leave(f"{tmp}/port", str(free_port()))
    wait_for(f"{tmp}/port")
    with open(f"{tmp}/port") as f:
        return int(f.read())


def _bodies(rank: int, jobs: list[tuple[str, object]], root: str) -> None:
    fresh = torch.get_rng_state()
    for name, body in jobs:
        tmp = f"{root}/{name}"
        os.makedirs(tmp, exist_ok=True)
        try:
            torch.set_rng_state(fresh)  # as in a process of its own: no body draws from another's leftovers
            body(rank, _meet(rank, tmp), tmp)
        except BaseException:  # noqa: BLE001 -- reported by its test, whatever it was
            with open(f"{tmp}/error.{rank}", "w") as f:
                f.write(traceback.format_exc())


def launch(items, root: Path) -> dict[str, Path]:
    """Runs the bodies of the marked `items` (pytest items) in one launch, each body once (tests
    that check one body's records share its directory); their directories by node id."""
    jobs, dirs, named = [], {}, {}
    for item in items:
        body = item.get_closest_marker("two_ranks").kwargs["body"]
        if body not in named:
            named[body] = f"{len(jobs):03d}-{item.module.__name__}.{body.__name__}"[:100]
            jobs.append((named[body], body))
        dirs[item.nodeid] = root / named[body]
    if jobs:
        mp.spawn(_bodies, args=(jobs, str(root)), nprocs=2, join=True)
    return dirs


def ran(out: Path) -> Path:
    """`out`, once both ranks ran its body without an error."""
    assert out.is_dir(), f"{out}: the body was not run"
    errors = [(out / f"error.{r}").read_text() for r in range(2) if (out / f"error.{r}").is_file()]
    if errors:
        import pytest

        pytest.fail("a rank's body raised:\n" + "\n".join(errors), pytrace=False)
    return out
