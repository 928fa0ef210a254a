"""Build hook (the project itself is described in pyproject.toml).

A wheel carries the bundled tiny models (assets/) and the runnable configs (configs/) as
mmrl/_bundled/, so a non-editable install (`pip install .`, `pip install git+URL`, a wheel)
runs `mmrl train` and `--config configs/...` as a clone does; mmrl.core.runconfig looks there
when it is not in a source checkout. An editable install reads the checkout's own.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

BUNDLED = ("assets", "configs")


class BuildPyWithBundled(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return
        root = Path(__file__).resolve().parent
        target = Path(self.build_lib) / "mmrl" / "_bundled"
        for name in BUNDLED:
            if (root / name).is_dir():
                shutil.copytree(root / name, target / name, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildPyWithBundled})
