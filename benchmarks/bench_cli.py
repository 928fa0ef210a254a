"""How every benchmark script ends on a bad input: `raise SystemExit(bench_cli.run(main))` runs
the script's main and turns the project's user errors (a config file or model directory that
is not there, a setting out of bounds, an --out that already holds a run) into one `error:`
line and exit status 2, as `mmrl train` does, instead of a traceback. Other exceptions (a bug)
still raise with their traceback.

Imported in the scripts' `__main__` block only (the script's folder is on sys.path there), so
the tests that load a script with import_python_file need nothing else on sys.path."""

from __future__ import annotations

import sys
from collections.abc import Callable


def run(main: Callable[[], int | None]) -> int:
    try:
        return main() or 0
    except Exception as e:
        # imported here, not at the top: mmrl.core.cli takes seconds to import, and --help needs none of it
        from mmrl.core.cli import USER_ERRORS
        from mmrl.core.trainer import OutputDirError

        if not isinstance(e, USER_ERRORS):
            raise
        message = str(e)
        if isinstance(e, OutputDirError):
            # the trainer's message names `mmrl train`'s flags; a benchmark writes each run under --out
            message += ("\n(in a benchmark: each run goes to a folder of --out; give another --out, remove that "
                        "folder, or pass --reuse where the script has it to table a finished run)")
        print(f"error: {message}", file=sys.stderr)
        return 2
