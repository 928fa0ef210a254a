"""Fixtures shared by the backends' tests."""

import pytest
import torch
import two_ranks

from mmrl.core.rewards import Reward


@pytest.fixture(scope="session")
def _two_rank_runs(request, tmp_path_factory):
    """Every selected two-rank test's body, run in one launch (tests/two_ranks.py)."""
    items = [item for item in request.session.items if item.get_closest_marker("two_ranks")]
    return two_ranks.launch(items, tmp_path_factory.mktemp("two_ranks"))


@pytest.fixture
def ranks_ran(request, _two_rank_runs):
    """The directory in which both ranks ran this test's two_ranks body, without an error."""
    assert request.node.get_closest_marker("two_ranks"), "ranks_ran needs @pytest.mark.two_ranks(body=f)"
    return two_ranks.ran(_two_rank_runs[request.node.nodeid])


@pytest.fixture
def one_thread():
    """Tiny models: threads only add contention on a shared CPU. The count is restored
    after the test (later tests, e.g. bit-exact rebuilds, depend on it)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def reward_spread(monkeypatch):
    """A random model's samples all score alike: give each group rewards 0, 1, 0, 1, ... so
    the advantages (+-0.87 after the group std) are not zero and an update moves weights."""
    original = Reward.score

    def spread(self, samples):
        scores = original(self, samples)
        scores.total = torch.arange(len(samples), dtype=torch.float32) % 2
        return scores

    monkeypatch.setattr(Reward, "score", spread)


@pytest.fixture
def dllm_builds(monkeypatch):
    """Every (policy, CPU copy of its starting weights) that dllm_rl.backend.build makes during
    the test (the CLI's builds too), kept for inspection."""
    from dllm_rl import backend

    out = []
    original = backend.build

    def keep(cfg):
        policy, task = original(cfg)
        out.append((policy, {k: v.detach().cpu().clone() for k, v in policy.model.named_parameters()}))
        return policy, task

    monkeypatch.setattr(backend, "build", keep)
    return out
