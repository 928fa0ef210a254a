"""The README's Python recipe for a method of one's own runs as written (two dLLM steps)."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

from mmrl.core.method import METHODS

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_method_recipe_trains(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    (recipe,) = [b for b in blocks if "@register_method" in b]
    script = tmp_path / "recipe.py"
    script.write_text(recipe.replace('"train.max_steps=2"', '"train.max_steps=2", "task.num_eval=8"'))
    monkeypatch.chdir(tmp_path)  # its output_dir is relative
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        summary = runpy.run_path(str(script))["summary"]
    finally:
        METHODS.pop("half_neg", None)  # the registry as the other tests expect it
    run = tmp_path / "runs" / "half_neg"
    assert summary["steps"] == 2 and "method:\n  type: half_neg" in (run / "config.yaml").read_text()
    assert set(summary["eval_before"]) == set(summary["eval_after"]) >= {"accuracy", "reward"}
