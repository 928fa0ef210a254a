"""Shared by the diffusion tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: threads only add contention on a shared CPU. The count is restored
    after each test (later tests, e.g. bit-exact rebuilds, depend on it)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
