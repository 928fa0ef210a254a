"""Shared by the diffusion tests: one torch thread in every test (tests/conftest.py), and one
tiny random FLUX-style pixel-space model for the whole session (read only: runs write elsewhere)."""

import pytest

from diffusion_rl.models import build_tiny


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="session")
def flux_dir(tmp_path_factory):
    return build_tiny("flux", tmp_path_factory.mktemp("flux"), seed=0, pixel_space=True)
