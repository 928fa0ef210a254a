"""Shared by the diffusion tests: one torch thread in every test (tests/conftest.py)."""

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield
