"""`serve` as a client author meets it: a served run whose data files are gone."""

from __future__ import annotations

import importlib

import pytest

from mmrl.core import serve


@pytest.mark.parametrize("modality, task", [
    ("vlm", "task: {type: jsonl, train_path: gone/train.jsonl, eval_path: gone/eval.jsonl}\n"),
    ("diffusion", "task: {train_path: gone/train.txt, eval_path: gone/eval.txt}\n")])
def test_serve_needs_no_data_files(tmp_path, monkeypatch, modality, task):
    # serving needs the model only: a run copied to another machine without its data used to stop
    # with "task: .../gone/train.jsonl: cannot read the file"
    from typer.testing import CliRunner

    app = importlib.import_module({"vlm": "mmrl.cli", "diffusion": "diffusion_rl.cli"}[modality]).app
    served = []
    monkeypatch.setattr(serve, "serve", lambda engine, *a, **kw: served.append(engine))
    (tmp_path / "run.yaml").write_text(task)
    result = CliRunner().invoke(app, ["serve", "--config", str(tmp_path / "run.yaml"), "--port", "0"])
    assert result.exit_code == 0, result.output
    assert len(served) == 1 and served[0].policy.model is not None
