"""What a launcher (torchrun, accelerate launch, mpirun) told this process in its environment,
read without torch: the CLI asks before anything is built, and `config` builds nothing
(importing torch took seconds of it; tests/test_cli_imports.py). mmrl.core.distributed
re-exports these."""

from __future__ import annotations

import os
import sys

from mmrl.core.config import ConfigError

# where a launcher (torchrun, accelerate launch, mpirun) puts this process's rank
RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMI_RANK")


def launched_world() -> int:
    """The processes a launcher described in the environment (WORLD_SIZE), 1 without one. A
    ConfigError where WORLD_SIZE is not a number, or asks for several processes without the
    rank and address a launcher sets with it (WORLD_SIZE exported by hand): joining would stop
    on accelerate's traceback, or wait half an hour for ranks that were never started."""
    text = os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(text)
    except ValueError:
        raise ConfigError(f"the environment's WORLD_SIZE={text!r} is not a number of processes; "
                          "unset it (one process) or start the run with torchrun or accelerate launch") from None
    missing = [name for name, there in (("RANK", any(v in os.environ for v in RANK_VARIABLES)),
                                        ("MASTER_ADDR", "MASTER_ADDR" in os.environ)) if not there]
    if world > 1 and missing:
        raise ConfigError(f"the environment's WORLD_SIZE={world} asks for {world} processes, but {' and '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not set, as a launcher sets them: start the run "
                          f"with `torchrun --nproc_per_node {world} -m ...` or `accelerate launch`, or unset "
                          "WORLD_SIZE to run one process")
    return max(1, world)


def launched_main() -> bool:
    """Whether this process is its launch's main one, also before the process group is joined
    (is_main() is True on every rank then): what the CLI prints before the Trainer starts (the
    run's header, where its settings come from) is printed once per launch, not once per rank."""
    dist = sys.modules.get("torch.distributed")  # a process group is joined only where torch is imported
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0  # distributed.is_main()
    rank = next((os.environ[name] for name in RANK_VARIABLES if name in os.environ), "0")  # as launched_world reads it
    return os.environ.get("WORLD_SIZE", "1").strip() in ("", "0", "1") or rank.strip() == "0"
