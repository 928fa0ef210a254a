"""Tiny real Qwen VL models built from configs (mmrl.vlm.tiny), shared by the VLM tests."""

import pytest

from mmrl.vlm.tiny import FAMILIES, build_tiny_vlm


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request, tmp_path_factory):
    """Each Qwen family in turn (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), random weights."""
    out = tmp_path_factory.mktemp(request.param)
    build_tiny_vlm(request.param, out, seed=0)
    return out


@pytest.fixture(scope="module")
def qwen25_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen2_5_vl")
    build_tiny_vlm("qwen2_5_vl", out, seed=0)
    return out
