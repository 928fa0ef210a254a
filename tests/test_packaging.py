"""A real wheel of the repository: it carries the bundled tiny models and the configs, and an
install of it alone (no source checkout) finds them, as a clone's editable install does."""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

# Run with -S (no site-packages processing, so no editable install's finder that would import
# the checkout's mmrl instead), the wheel's install first on the path, then this environment's
# site-packages for torch and the rest.
PROBE = """
import json, sys
sys.path[:0] = [sys.argv[1]]
sys.path += json.loads(sys.argv[2])
from mmrl.core import runconfig
from mmrl.core.config import load_config
from mmrl.vlm.config import VLMModelConfig
from mmrl.vlm.models import bundled_model_dir, load_vlm
model, processor = load_vlm(VLMModelConfig())
print(json.dumps({
    "mmrl": runconfig.__file__,
    "repository": str(runconfig.REPOSITORY),
    "bundled": str(bundled_model_dir()),
    "dapo_clip_high": load_config(path="configs/vlm/dapo.yaml").method.loss.clip_high,
    "params": sum(p.numel() for p in model.parameters()),
    "typo_note": runconfig.not_installed_note("assets/tiny-qwen2.5-vI"),
}))
"""


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.fail("the packaging test builds from the git checkout's tracked files; git ls-files failed")
    return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]


def test_a_wheel_carries_the_bundled_models_and_configs_and_its_install_runs_from_them(tmp_path):
    pytest.importorskip("setuptools", minversion="77")  # in the dev extra: the build backend, offline
    src = tmp_path / "src"
    for f in _tracked_files():  # a copy: the build writes build/ and *.egg-info beside the sources
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    str(src), "-w", str(tmp_path / "dist")], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("mmrl-*.whl")
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(target), str(wheel)], check=True, capture_output=True)

    bundle = target / "mmrl" / "_bundled"
    tracked = sorted(f for f in _tracked_files() if f.startswith(("assets/", "configs/")))
    assert any(f.startswith("assets/tiny-qwen2.5-vl/") for f in tracked)
    assert sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()) == tracked
    assert (bundle / "assets" / "tiny-flow" / "model_index.json").read_bytes() == (
        ROOT / "assets" / "tiny-flow" / "model_index.json").read_bytes()

    elsewhere = tmp_path / "elsewhere"  # no configs/ or assets/ in the working directory
    elsewhere.mkdir()
    run = subprocess.run([sys.executable, "-S", "-c", PROBE, str(target), json.dumps(site.getsitepackages())],
                         check=False, cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(got["mmrl"]).is_relative_to(target)  # the wheel's mmrl, not the checkout's
    assert Path(got["repository"]) == bundle
    assert Path(got["bundled"]) == bundle / "assets" / "tiny-qwen2.5-vl"
    dapo = yaml.safe_load((ROOT / "configs" / "vlm" / "dapo.yaml").read_text())
    assert got["dapo_clip_high"] == dapo["method"]["loss"]["clip_high"] == 0.28
    assert got["params"] > 100_000  # the bundled tiny Qwen2.5-VL, 350k parameters
    assert got["typo_note"] == ""  # assets/ is there: a missing model is only that, no install advice
