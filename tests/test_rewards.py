"""Reward atoms (mmrl/core/rewards.py): values worked out by hand, gating, errors, loading."""

import asyncio
import math
import re
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest
import torch

from mmrl.core.rewards import (
    AtomScores,
    Reward,
    RewardAtom,
    RewardError,
    Sample,
    load_atom,
    reward_atom,
)


def make_samples(values):
    """Samples whose completion is the number an atom should return."""
    return [Sample(prompt=f"prompt {i}", completion=v) for i, v in enumerate(values)]


async def _async_value(s):  # module level: a Reward holding it pickles
    await asyncio.sleep(0)
    return s.completion


def value_atom(name, **kw):
    return RewardAtom(name, lambda s: s.completion, **kw)


# ---------------------------------------------------------------------------- values and weights


def test_sync_atoms_weights_and_total():
    @reward_atom("length")
    def length(s):
        return len(s.completion) / 4

    @reward_atom("has_a", weight=0.5)
    def has_a(s):
        return "a" in s.completion

    samples = [Sample("p", "abcd"), Sample("p", "xy")]
    scores = Reward([length, has_a]).score(samples)
    assert scores.names == ["length", "has_a"]
    assert scores.values.dtype == torch.float32 and scores.values.shape == (2, 2)
    # "abcd": length 4/4 = 1.0, has_a True -> 1.0; total = 1.0*1.0 + 0.5*1.0 = 1.5
    # "xy":   length 2/4 = 0.5, has_a False -> 0.0; total = 1.0*0.5 + 0.5*0.0 = 0.5
    assert scores.values.tolist() == [[1.0, 1.0], [0.5, 0.0]]
    assert scores.total.tolist() == [1.5, 0.5]
    assert scores.errors == 0


def test_value_coercion():
    returns = [True, False, 3, 0.25, torch.tensor(0.75), np.float32(0.5), np.int64(2), np.bool_(1)]
    scores = Reward([value_atom("v")]).score(make_samples(returns))
    # bool -> 1/0; int 3 -> 3.0; 0-d tensor / numpy scalars -> their value
    assert scores.values[:, 0].tolist() == [1.0, 0.0, 3.0, 0.25, 0.75, 0.5, 2.0, 1.0]


def test_negative_weight_and_reward_weights():
    a = value_atom("a", weight=1.0)
    b = value_atom("b", weight=-0.5)
    reward = Reward([a, b])
    assert reward.names == ["a", "b"]
    assert reward.weights.tolist() == [1.0, -0.5]
    # value 0.8 in both columns: total = 1.0*0.8 - 0.5*0.8 = 0.4
    assert reward.score(make_samples([0.8])).total.item() == pytest.approx(0.4)


def test_decorated_atom_fields_and_direct_call():
    @reward_atom("x", weight=2, parents="p", batched=False)
    def x(s):
        return 1

    @reward_atom("y", batched=True)
    async def y(samples):
        return [0] * len(samples)

    assert isinstance(x, RewardAtom)
    assert (x.name, x.weight, x.parents, x.batched, x.is_async) == ("x", 2.0, ("p",), False, False)
    assert (y.batched, y.is_async) == (True, True)
    assert x(Sample("p", "c")) == 1  # an atom can be called like its function


def test_batched_atom_gets_list_and_may_return_tensor():
    calls = []

    @reward_atom("b", batched=True)
    def b(samples):
        calls.append(len(samples))
        return torch.tensor([s.completion * 2 for s in samples])

    @reward_atom("n", batched=True, weight=0.5)
    def n(samples):
        return np.array([1.0] * len(samples))

    scores = Reward([b, n]).score(make_samples([0.0, 0.25, 0.5]))
    assert calls == [3]  # one call for the whole batch
    # b = 2*value: 0.0, 0.5, 1.0; n = 1; total = b + 0.5*1
    assert scores.values.tolist() == [[0.0, 1.0], [0.5, 1.0], [1.0, 1.0]]
    assert scores.total.tolist() == [0.5, 1.0, 1.5]


def test_empty_batch():
    scores = Reward([value_atom("a"), value_atom("b")]).score([])
    assert scores.values.shape == (0, 2)
    assert scores.total.shape == (0,)
    assert scores.per_sample() == []
    m = scores.metrics()
    assert math.isnan(m["reward/a"]) and m["reward/total_std"] == 0.0 and m["reward/errors"] == 0


# ---------------------------------------------------------------------------- async


def test_async_atoms_run_concurrently():
    @reward_atom("slow_a")
    async def slow_a(s):
        await asyncio.sleep(0.2)
        return s.completion

    @reward_atom("slow_b", batched=True)
    async def slow_b(samples):
        await asyncio.sleep(0.2)
        return [1.0] * len(samples)

    start = time.perf_counter()
    scores = Reward([slow_a, slow_b]).score(make_samples([0.0, 0.25, 0.5, 1.0]))
    elapsed = time.perf_counter() - start
    # 4 calls of slow_a + 1 of slow_b, 0.2 s each: 1.0 s one after another, ~0.2 s concurrently
    assert elapsed < 0.6
    assert scores.values[:, 0].tolist() == [0.0, 0.25, 0.5, 1.0]
    assert scores.values[:, 1].tolist() == [1.0] * 4


def test_async_called_from_a_thread_without_event_loop():
    @reward_atom("a")
    async def a(s):
        await asyncio.sleep(0)
        return 0.5

    result = {}
    t = threading.Thread(target=lambda: result.update(s=Reward([a]).score(make_samples([0, 0]))))
    t.start()
    t.join(5)
    assert result["s"].values[:, 0].tolist() == [0.5, 0.5]


def test_score_while_an_event_loop_is_running():
    @reward_atom("a")
    async def a(s):
        await asyncio.sleep(0.01)
        return s.completion

    reward = Reward([a, value_atom("b")])

    async def main():
        asyncio.get_running_loop()  # a loop is running in this thread
        return reward.score(make_samples([0.25, 1.0]))  # synchronous call inside it

    scores = asyncio.run(main())
    assert scores.values.tolist() == [[0.25, 0.25], [1.0, 1.0]]


def test_async_timeout_raises_and_zeroes():
    @reward_atom("slow")
    async def slow(s):
        await asyncio.sleep(0.5 if s.completion else 0)
        return 1.0

    samples = make_samples([0, 1])
    with pytest.raises(RewardError) as info:
        Reward([slow], timeout=0.05).score(samples)
    assert "timed out after 0.05 s" in str(info.value)
    assert (info.value.atom, info.value.sample_index) == ("slow", 1)

    start = time.perf_counter()
    with pytest.warns(RuntimeWarning, match="slow"):
        scores = Reward([slow], timeout=0.05, on_error="zero").score(samples)
    assert time.perf_counter() - start < 0.4  # did not wait for the slow call
    assert scores.values[:, 0].tolist() == [1.0, 0.0]
    assert scores.errors == 1


def test_async_atom_that_blocks_the_loop_past_the_timeout_fails_and_says_why():
    """time.sleep in an async atom holds the event loop, so no asyncio timeout can fire: the
    call's own busy time catches it afterwards, and its late value is not taken as a pass."""
    @reward_atom("blocking")
    async def blocking(s):
        time.sleep(0.2 if s.completion else 0)  # noqa: ASYNC251 -- the mistake under test
        await asyncio.sleep(0)
        return 1.0

    samples = make_samples([0, 1])
    with pytest.raises(RewardError, match=r"blocked the event loop for 0\.2\d* s, past the timeout of 0\.1 s") as info:
        Reward([blocking], timeout=0.1).score(samples)
    assert (info.value.atom, info.value.sample_index) == ("blocking", 1)
    with pytest.warns(RuntimeWarning, match="blocking"):
        scores = Reward([blocking], timeout=0.1, on_error="zero").score(samples)
    assert scores.values[:, 0].tolist() == [1.0, 0.0] and scores.errors == 1
    assert Reward([blocking], timeout=1.0).score(samples).values[:, 0].tolist() == [1.0, 1.0]  # within it: its value


@pytest.mark.parametrize("batched", [False, True])
def test_sync_timeout_raises_and_zeroes(batched):
    """A sync atom that hangs is timed out too (it was waited on forever): it runs in a thread."""
    release = threading.Event()

    def hang(s):
        if s.completion:
            release.wait(5)  # a hang the test can end
        return 1.0

    slow = reward_atom("slow", batched=batched)(lambda batch: [hang(s) for s in batch] if batched else hang(batch))
    samples = make_samples([0, 1])
    try:
        with pytest.raises(RewardError, match="timed out after 0.05 s") as info:
            Reward([slow], timeout=0.05).score(samples)
        assert info.value.atom == "slow"
        start = time.perf_counter()
        with pytest.warns(RuntimeWarning, match="slow"):
            scores = Reward([slow], timeout=0.05, on_error="zero").score(samples)
        assert time.perf_counter() - start < 1.0 and scores.errors >= 1
        assert scores.values[1, 0] == 0.0
        assert Reward([slow], timeout=5).score(make_samples([0])).values.tolist() == [[1.0]]  # in time: its value
    finally:
        release.set()


def hanging_atom(name: str, release: threading.Event, started: list):
    """A sync atom that notes each start and waits for `release` (at most 30 s)."""

    @reward_atom(name)
    def atom(s):
        started.append(1)
        release.wait(30)
        return 1.0

    return atom


def test_a_sync_atom_with_max_stuck_calls_left_running_is_not_started_again():
    """A hanging atom leaves a thread per timed-out call: at max_stuck of them still running, its
    calls fail as timed out at once and start nothing (5 samples wait out 2 timeouts, not 5);
    once they end, the atom runs again."""
    release, started = threading.Event(), []
    slow = hanging_atom("slow", release, started)
    reward = Reward([slow], timeout=0.2, on_error="zero", max_stuck=2)
    try:
        begin = time.perf_counter()
        with pytest.warns(RuntimeWarning, match="slow"):
            scores = reward.score(make_samples([1, 2, 3, 4, 5]))
        assert time.perf_counter() - begin < 0.8  # uncapped: 5 x 0.2 s
        assert (len(started), scores.errors, reward.stuck("slow")) == (2, 5, 2)
        with pytest.warns(RuntimeWarning, match=r"not run: 2 earlier calls of it are still running past the "
                                                r"timeout of 0\.2 s"):
            reward.score(make_samples([1]))
        assert len(started) == 2
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while reward.stuck("slow") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reward.score(make_samples([1])).values.tolist() == [[1.0]]
    assert len(started) == 3


# ---------------------------------------------------------------------------- gating


def test_parent_gating_skips_child_calls():
    called = []

    @reward_atom("child", weight=2.0, parents=("parent",))
    def child(s):
        called.append(s.prompt)
        return 0.5

    parent = value_atom("parent")
    # the child is listed first: column order is the user's, evaluation order parents first
    scores = Reward([child, parent]).score(make_samples([0.4, 0.5, 1.0]))
    assert scores.names == ["child", "parent"]
    # parent 0.4 < 0.5 -> child gated to 0; parent 0.5 and 1.0 open -> child 0.5
    torch.testing.assert_close(scores.values, torch.tensor([[0.0, 0.4], [0.5, 0.5], [0.5, 1.0]]))
    # total = 2.0*child + parent: 0.4, 1.5, 2.0
    assert scores.total.tolist() == pytest.approx([0.4, 1.5, 2.0])
    assert called == ["prompt 1", "prompt 2"]  # never called on the gated sample 0


def test_chained_gating_and_batched_child_gets_open_samples_only():
    seen = []

    @reward_atom("grandchild", batched=True, parents=("child",))
    def grandchild(samples):
        seen.append([s.prompt for s in samples])
        return [1.0] * len(samples)

    @reward_atom("child", parents=("root",))
    def child(s):
        return s.meta["child"]

    samples = [
        Sample("p0", 1.0, {"child": 1.0}),  # root open, child open -> grandchild 1
        Sample("p1", 0.0, {"child": 1.0}),  # root closed -> child 0 -> grandchild 0
        Sample("p2", 1.0, {"child": 0.2}),  # child 0.2 < 0.5 -> grandchild 0
    ]
    scores = Reward([grandchild, child, value_atom("root")]).score(samples)
    expected = [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.2, 1.0]]
    torch.testing.assert_close(scores.values, torch.tensor(expected))
    assert seen == [["p0"]]


def test_child_with_two_parents_needs_both():
    a, b = RewardAtom("a", lambda s: s.meta["a"]), RewardAtom("b", lambda s: s.meta["b"])
    c = RewardAtom("c", lambda s: 1.0, parents=("a", "b"))
    metas = [{"a": 1, "b": 1}, {"a": 1, "b": 0}, {"a": 0, "b": 1}]
    scores = Reward([a, b, c]).score([Sample("p", None, m) for m in metas])
    assert scores.values[:, 2].tolist() == [1.0, 0.0, 0.0]


# ---------------------------------------------------------------------------- construction errors


def test_construction_errors():
    a = value_atom("a")
    with pytest.raises(ValueError, match="duplicate reward atom name 'a'"):
        Reward([a, value_atom("a")])
    with pytest.raises(ValueError, match="'b': parent 'missing'"):
        Reward([a, value_atom("b", parents=("missing",))])
    with pytest.raises(ValueError, match="cycle: x -> y -> x"):
        Reward([a, value_atom("x", parents=("y",)), value_atom("y", parents=("x",))])
    with pytest.raises(ValueError, match="cycle: s -> s"):
        Reward([value_atom("s", parents=("s",))])
    with pytest.raises(ValueError, match="finite"):
        value_atom("w", weight=float("nan"))
    a.weight = float("inf")  # changed after construction: still caught
    with pytest.raises(ValueError, match="'a': weight must be finite"):
        Reward([a])
    with pytest.raises(ValueError, match="on_error"):
        Reward([value_atom("b")], on_error="ignore")
    with pytest.raises(ValueError, match="timeout"):
        Reward([value_atom("b")], timeout=0)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="max_stuck must be an integer >= 1"):
            Reward([value_atom("b")], timeout=1, max_stuck=bad)
    for name in ("total", "total_std", "errors", "advantage_abs"):  # the reward/<name> metrics
        with pytest.raises(ValueError, match="reserved"):
            Reward([value_atom(name)])
    with pytest.raises(TypeError, match="reward_atom"):
        Reward([lambda s: 1.0])


# ---------------------------------------------------------------------------- scoring errors


def test_atom_that_raises_names_atom_sample_and_chains_cause():
    @reward_atom("judge")
    def judge(s):
        if s.completion == "bad":
            raise KeyError("answer")
        return 1.0

    long_prompt = "q" * 200
    samples = [Sample("fine", "ok"), Sample(long_prompt, "bad")]
    with pytest.raises(RewardError) as info:
        Reward([judge]).score(samples)
    err = info.value
    msg = str(err)
    assert (err.atom, err.sample_index) == ("judge", 1)
    assert "'judge'" in msg and "sample 1" in msg and "KeyError: 'answer'" in msg
    assert "'qqqq" in msg and long_prompt not in msg  # the prompt is shown, truncated
    assert isinstance(err.__cause__, KeyError)


@pytest.mark.parametrize(
    "returned, expected",
    [
        (float("nan"), "returned nan"),
        (float("inf"), "returned inf"),
        (torch.tensor(float("nan")), "returned nan"),
        ("0.5", "returned a str, expected a number"),
        (None, "returned None, expected a number"),
        ([1.0], "returned a list, expected a number"),
        (torch.ones(2), "returned a Tensor of shape (2,), expected a number"),
    ],
)
def test_bad_values_raise(returned, expected):
    atom = RewardAtom("bad", lambda s: returned if s.completion else 1.0)
    with pytest.raises(RewardError, match="bad") as info:
        Reward([atom]).score(make_samples([0, 1]))
    assert expected in str(info.value)
    assert info.value.sample_index == 1


def test_fraction_and_decimal_values_are_numbers():
    from decimal import Decimal
    from fractions import Fraction

    scores = Reward([value_atom("v")]).score(make_samples([Fraction(1, 4), Decimal("0.5"), True]))
    assert scores.values[:, 0].tolist() == [0.25, 0.5, 1.0]
    with pytest.raises(RewardError, match="returned nan"):
        Reward([value_atom("v")]).score(make_samples([Decimal("NaN")]))
    with pytest.raises(RewardError, match="not a finite number"):
        Reward([value_atom("v")]).score(make_samples([Decimal("sNaN")]))


def test_batched_wrong_count_and_bad_element():
    three = RewardAtom("three", lambda samples: [1.0, 1.0, 1.0], batched=True)
    with pytest.raises(RewardError, match="returned 3 values for 4 samples") as info:
        Reward([three]).score(make_samples([0, 0, 0, 0]))
    assert info.value.atom == "three" and info.value.sample_index is None

    nan_at_2 = RewardAtom("nan_at_2", lambda samples: [0.0, 1.0, math.nan], batched=True)
    with pytest.raises(RewardError, match="sample 2.*returned nan") as info:
        Reward([nan_at_2]).score(make_samples([0, 0, 0]))
    assert info.value.sample_index == 2


def test_sync_function_returning_a_coroutine_is_an_error():
    async def judge(s):
        return 1.0

    atom = RewardAtom("wrapped", lambda s: judge(s))  # not declared async
    with pytest.raises(RewardError, match="async def"):
        Reward([atom]).score(make_samples([0]))


def test_on_error_zero_counts_and_warns_once():
    def flaky(s):
        if s.completion == 1:
            raise RuntimeError("boom")
        return s.completion

    flaky_atom = RewardAtom("flaky", flaky)
    nan_atom = RewardAtom("nan", lambda s: math.nan if s.completion == 0.5 else 1.0, weight=2.0)
    child = RewardAtom("child", lambda s: 1.0, parents=("flaky",))
    reward = Reward([flaky_atom, nan_atom, child], on_error="zero")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scores = reward.score(make_samples([0.5, 1, 1]))
    assert len(caught) == 1  # one summary per score() call
    text = str(caught[0].message)
    assert "3 reward evaluation(s) failed" in text
    assert "'flaky' on 2" in text and "RuntimeError: boom" in text and "'nan' on 1" in text
    # sample 0: flaky 0.5 (open? no: 0.5 >= 0.5 -> open), nan -> 0 (error), child 1
    # samples 1, 2: flaky raised -> 0 -> child gated; nan 1.0
    assert scores.values.tolist() == [[0.5, 0.0, 1.0], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]
    # total = flaky + 2*nan + child: 0.5 + 0 + 1 = 1.5; 0 + 2 + 0 = 2; 2
    assert scores.total.tolist() == [1.5, 2.0, 2.0]
    assert scores.errors == 3
    assert scores.failed.tolist() == [
        [False, True, False],
        [True, False, False],
        [True, False, False],
    ]
    assert scores.select(torch.tensor([0])).errors == 1
    assert scores.metrics()["reward/errors"] == 3.0


def test_on_error_zero_batched_call_that_raises_zeroes_the_batch():
    def broken(samples):
        raise ValueError("down")

    reward = Reward([value_atom("a"), RewardAtom("b", broken, batched=True)], on_error="zero")
    with pytest.warns(RuntimeWarning, match="'b' on 2"):
        scores = reward.score(make_samples([1.0, 0.5]))
    assert scores.values.tolist() == [[1.0, 0.0], [0.5, 0.0]]
    assert scores.errors == 2


# ---------------------------------------------------------------------------- AtomScores


def test_metrics_per_sample_and_select():
    reward = Reward([value_atom("a"), RewardAtom("b", lambda s: 1.0, weight=0.5)])
    scores = reward.score(make_samples([0.0, 0.5, 1.0]))
    # a = 0, 0.5, 1 (mean 0.5); b = 1 (mean 1); total = a + 0.5 = 0.5, 1.0, 1.5
    # total mean 1.0; unbiased std = sqrt((0.25 + 0 + 0.25) / 2) = 0.5
    m = scores.metrics()
    assert set(m) == {"reward/a", "reward/b", "reward/total", "reward/total_std", "reward/errors"}
    assert m == pytest.approx(
        {
            "reward/a": 0.5,
            "reward/b": 1.0,
            "reward/total": 1.0,
            "reward/total_std": 0.5,
            "reward/errors": 0.0,
        }
    )
    assert all(type(v) is float for v in m.values())
    assert scores.per_sample() == [{"a": 0.0, "b": 1.0}, {"a": 0.5, "b": 1.0}, {"a": 1.0, "b": 1.0}]

    sub = scores.select(torch.tensor([2, 0]))
    assert isinstance(sub, AtomScores) and sub.names == ["a", "b"]
    assert sub.values.tolist() == [[1.0, 1.0], [0.0, 1.0]]
    assert sub.total.tolist() == [1.5, 0.5]
    assert scores.select(torch.tensor([True, False, True])).total.tolist() == [0.5, 1.5]


# ---------------------------------------------------------------------------- loading from files

ATOMS_FILE = textwrap.dedent(
    """
    from mmrl.core.rewards import reward_atom

    def plain(sample):
        return len(sample.completion)

    async def plain_async(sample):
        return 1.0

    @reward_atom("decorated_name", weight=0.5, parents=("plain",))
    def decorated(sample):
        return 1.0

    NOT_CALLABLE = 3
    """
)


@pytest.fixture
def atoms_file(tmp_path):
    path = tmp_path / "my_atoms.py"
    path.write_text(ATOMS_FILE)
    return path


def test_load_atom_plain_and_decorated(atoms_file):
    plain = load_atom(f"{atoms_file}:plain")
    assert (plain.name, plain.weight, plain.parents, plain.is_async) == ("plain", 1.0, (), False)
    assert plain(Sample("p", "abc")) == 3
    assert load_atom(f"{atoms_file}:plain_async").is_async

    decorated = load_atom(f"{atoms_file}:decorated")
    assert (decorated.name, decorated.weight, decorated.parents) == (
        "decorated_name",
        0.5,
        ("plain",),
    )
    # plain = len: "ab" -> 2, "" -> 0 (gates the child); total = plain + 0.5 * decorated
    scores = Reward([plain, decorated]).score([Sample("p", "ab"), Sample("p", "")])
    assert scores.total.tolist() == [2.5, 0.0]


def test_load_atom_relative_to_base_dir(atoms_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)
    atom = load_atom("my_atoms.py:plain", base_dir=tmp_path)
    assert atom.name == "plain"
    monkeypatch.chdir(tmp_path)  # default base_dir: the current directory
    assert load_atom("my_atoms.py:plain").name == "plain"


def test_load_atom_errors(atoms_file, tmp_path):
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere_xyz\n")
    cases = [
        (str(atoms_file), "must look like 'path/to/file.py:function'"),
        (f"{atoms_file}:", "must look like"),
        (f"{tmp_path}/missing.py:fn", "file not found"),
        (f"{tmp_path}/broken.py:fn", "importing .* failed: ModuleNotFoundError"),
        (f"{atoms_file}:nope", "has no attribute 'nope'.*plain"),
        (f"{atoms_file}:NOT_CALLABLE", "'NOT_CALLABLE' is an int, not callable"),
    ]
    for spec, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            load_atom(spec)
        assert repr(spec) in str(info.value)  # every error names the spec
    with pytest.raises(ValueError) as info:
        load_atom(f"{tmp_path}/broken.py:fn")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_from_config_overrides(atoms_file, tmp_path):
    reward = Reward.from_config(
        [
            "my_atoms.py:plain",
            {"path": "my_atoms.py:plain", "name": "plain_x2", "weight": 2.0},
            {"path": "my_atoms.py:decorated", "weight": 3.0, "parents": ["plain_x2"]},
        ],
        base_dir=tmp_path,
        on_error="zero",
        timeout=1.5,
        max_stuck=3,
    )
    assert reward.names == ["plain", "plain_x2", "decorated_name"]
    assert reward.weights.tolist() == [1.0, 2.0, 3.0]
    assert reward.atoms[2].parents == ("plain_x2",)
    assert (reward.on_error, reward.timeout, reward.max_stuck) == ("zero", 1.5, 3)
    # "a": plain 1, plain_x2 1, decorated 1 -> total = 1 + 2*1 + 3*1 = 6
    # "":  plain 0, plain_x2 0 -> decorated gated 0 -> total 0
    assert reward.score([Sample("p", "a"), Sample("p", "")]).total.tolist() == [6.0, 0.0]


def test_a_dict_spec_keeps_a_batched_atom_batched(tmp_path):
    """Overriding a loaded atom's name or weight keeps how it is called: a batched atom still
    gets the list of samples (called one sample at a time, it would fail on every one)."""
    (tmp_path / "batched_atoms.py").write_text(textwrap.dedent(
        """
        from mmrl.core.rewards import reward_atom

        @reward_atom("lengths", batched=True)
        def lengths(samples):
            return [len(s.completion) for s in samples]
        """
    ))
    reward = Reward.from_config([{"path": "batched_atoms.py:lengths", "name": "n", "weight": 2.0}],
                                base_dir=tmp_path)
    assert reward.atoms[0].batched
    assert reward.score([Sample("p", "ab"), Sample("p", "abc")]).total.tolist() == [4.0, 6.0]


def test_an_atom_file_that_exits_at_import_is_a_value_error(tmp_path):
    """A script's sys.exit() at import must not end the trainer: it is the spec's error."""
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(2)\n")
    with pytest.raises(ValueError, match=r"'exits.py:fn'.*importing .*exits.py failed: SystemExit: 2"):
        load_atom("exits.py:fn", base_dir=tmp_path)


def test_a_copy_of_a_reward_whose_async_atoms_ran_scores_on_a_loop_of_its_own():
    """deepcopy (and pickle) leave the event loop behind: the copy makes its own."""
    import copy
    import pickle

    reward = Reward([RewardAtom("judge", _async_value)])
    assert reward.score(make_samples([1.0])).total.tolist() == [1.0]  # its loop thread exists now
    for twin in (copy.deepcopy(reward), pickle.loads(pickle.dumps(reward))):
        assert twin.score(make_samples([2.0])).total.tolist() == [2.0]
        assert twin._loop is not reward._loop
    assert reward.score(make_samples([3.0])).total.tolist() == [3.0]  # the original's loop still serves


def test_config_atoms_may_be_gated_by_task_atoms(atoms_file):
    """reward.atoms of a config can name the task's atoms as parents (a partial-credit
    atom gated by the task's format atom); an unknown parent is a ConfigError naming it."""
    import toy

    from mmrl.core.config import ConfigError, TrainConfig, load_config
    from mmrl.core.trainer import combined_reward

    def combined(parents):
        spec = {"path": f"{atoms_file}:plain", "weight": 2.0, "parents": parents}
        cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[f"reward.atoms={[spec]}"])
        return combined_reward(toy.ToyTask().reward, cfg)

    reward = combined(["answer"])
    assert reward.names == ["answer", "stop", "plain"]
    assert reward.atoms[2].parents == ("answer",)
    # prompt 3: completion [4, EOS] is right (answer 1, stop 1, plain 2); [5, EOS] is wrong,
    # so "answer" 0 gates "stop" and "plain" to 0
    scores = reward.score([Sample(3, [4, toy.EOS]), Sample(3, [5, toy.EOS])])
    assert scores.total.tolist() == [1.0 + 0.5 + 2.0 * 2, 0.0]
    with pytest.raises(ConfigError, match="parent 'anwser'"):
        combined(["anwser"])


def test_config_atoms_named_like_a_task_atom_or_like_each_other_say_which(atoms_file, tmp_path):
    """Both were a bare "duplicate reward atom name": which spec, and whose the name is."""
    import toy

    from mmrl.core.config import ConfigError, TrainConfig, load_config
    from mmrl.core.trainer import combined_reward

    def combined(specs):
        cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[f"reward.atoms={specs}"])
        return combined_reward(toy.ToyTask().reward, cfg)

    with pytest.raises(ConfigError, match=r"reward.atoms: atom name 'answer' is taken by one of the task's atoms "
                                          r"\(answer, stop\); give the spec another 'name'"):
        combined([{"path": f"{atoms_file}:plain", "name": "answer"}])
    (tmp_path / "more.py").write_text("from mmrl.core.rewards import reward_atom\n"
                                      "plain = reward_atom('plain')(len)\n")
    with pytest.raises(ConfigError, match=r"reward.atoms: reward specs 0 and 2 \(.*my_atoms.py:plain, .*more.py:plain\) "
                                          r"both give an atom named 'plain'"):
        combined([f"{atoms_file}:plain", f"{atoms_file}:decorated", f"{tmp_path}/more.py:plain"])
    assert combined([f"{atoms_file}:plain", {"path": f"{tmp_path}/more.py:plain", "name": "p2"}]).names[-1] == "p2"


def test_from_config_errors(atoms_file, tmp_path):
    with pytest.raises(ValueError, match="unknown keys \\['wieght'\\]"):
        Reward.from_config([{"path": "my_atoms.py:plain", "wieght": 2}], base_dir=tmp_path)
    with pytest.raises(ValueError, match="must be a list"):
        Reward.from_config("my_atoms.py:plain", base_dir=tmp_path)
    with pytest.raises(ValueError, match=r"reward specs 0 and 1 \(my_atoms.py:plain, my_atoms.py:plain\) both give "
                                         r"an atom named 'plain'; give one of them another 'name'"):
        Reward.from_config(["my_atoms.py:plain", "my_atoms.py:plain"], base_dir=tmp_path)


# ---------------------------------------------------------------------------- the async atoms' event loop


def test_async_atoms_keep_loop_bound_state_between_score_calls():
    """One event loop for the Reward's life: a semaphore that rate-limits a judge, made on the
    first call, still works on the second (a loop per call failed it from step 2 on)."""
    limit, running, most = {}, [0], [0]

    @reward_atom("judge")
    async def judge(s):
        sem = limit.setdefault("sem", asyncio.Semaphore(2))
        async with sem:
            running[0] += 1
            most[0] = max(most[0], running[0])
            await asyncio.sleep(0.01)
            running[0] -= 1
        return 1.0

    reward = Reward([judge])
    for _ in range(2):
        assert reward.score(make_samples(range(6))).values[:, 0].tolist() == [1.0] * 6
    assert most[0] == 2


def test_score_from_several_threads_and_from_async_code():
    @reward_atom("slow")
    async def slow(s):
        await asyncio.sleep(0.05)
        return s.completion

    reward = Reward([slow])
    results = {}
    threads = [threading.Thread(target=lambda k=k: results.update({k: reward.score(make_samples([k])).total.tolist()}))
               for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == {k: [float(k)] for k in range(4)}

    async def caller():  # score() inside a running loop (a notebook, an async server)
        return reward.score(make_samples([7])).total.tolist()

    assert asyncio.run(caller()) == [7.0]


def test_work_handed_to_a_thread_past_the_timeout_is_left_behind():
    """asyncio.to_thread work that outlives the timeout: score() returns at the timeout
    (closing a loop per call waited for the thread), and the next call is not held up."""
    release = threading.Event()

    @reward_atom("judge")
    async def judge(s):
        await asyncio.to_thread(release.wait, 5 if s.completion else 0)
        return 1.0

    reward = Reward([judge], timeout=0.2, on_error="zero")
    try:
        start = time.perf_counter()
        with pytest.warns(RuntimeWarning, match="judge.*timed out after 0.2 s"):
            scores = reward.score(make_samples([0, 1]))
        assert time.perf_counter() - start < 2.0 and scores.values[:, 0].tolist() == [1.0, 0.0]
        assert reward.score(make_samples([0])).values.tolist() == [[1.0]]
    finally:
        release.set()


def test_only_the_atom_that_blocks_the_loop_fails_its_timeout():
    """A blocking atom holds the loop past an innocent atom's deadline: that time is not the
    innocent atom's, which keeps its value (it was failed and named before)."""
    @reward_atom("innocent")
    async def innocent(s):
        for _ in range(3):
            await asyncio.sleep(0.01)
        return 1.0

    @reward_atom("blocker")
    async def blocker(s):
        time.sleep(0.5)  # noqa: ASYNC251 -- the mistake under test
        return 1.0

    for atoms in ([innocent, blocker], [blocker, innocent]):
        with pytest.raises(RewardError, match="blocked the event loop") as info:
            Reward(atoms, timeout=0.3).score(make_samples([0]))
        assert info.value.atom == "blocker"
        with pytest.warns(RuntimeWarning):
            scores = Reward(atoms, timeout=0.3, on_error="zero").score(make_samples([0, 1]))
        assert scores.values[:, scores.names.index("innocent")].tolist() == [1.0, 1.0]
        assert scores.values[:, scores.names.index("blocker")].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("raised", [asyncio.CancelledError, SystemExit, KeyboardInterrupt])
def test_an_async_atom_raising_a_base_exception_is_its_failure(raised):
    @reward_atom("odd")
    async def odd(s):
        raise raised()

    with pytest.raises(RewardError, match=f"'odd' failed on sample 0.*{raised.__name__}"):
        Reward([odd]).score(make_samples([0, 1]))
    with pytest.warns(RuntimeWarning, match="odd"):
        scores = Reward([odd], on_error="zero").score(make_samples([0, 1]))
    assert scores.errors == 2
    assert Reward([value_atom("v")]).score(make_samples([2.0])).total.tolist() == [2.0]  # nothing left broken


def test_a_sync_atom_calling_sys_exit_fails_as_the_atom_with_or_without_a_timeout():
    """sys.exit() in a sync atom is its failure, named, as in an async atom (without a timeout
    it used to end the run without naming the atom; under one it is not taken for a timeout);
    a KeyboardInterrupt raised on the caller's thread goes on up (it may be a Ctrl-C)."""
    def quits(s):
        raise SystemExit(3)

    for timeout in (None, 5.0):
        with pytest.raises(RewardError) as info:
            Reward([RewardAtom("quits", quits)], timeout=timeout).score(make_samples([0]))
        assert str(info.value) == "reward atom 'quits' failed on sample 0 (prompt: 'prompt 0'): SystemExit: 3"
    with pytest.warns(RuntimeWarning, match="'quits' on 2"):
        scores = Reward([RewardAtom("quits", quits)], on_error="zero").score(make_samples([0, 1]))
    assert scores.errors == 2 and scores.values.tolist() == [[0.0], [0.0]]

    def interrupted(s):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Reward([RewardAtom("ctrl_c", interrupted)], on_error="zero").score(make_samples([0]))


def test_weights_and_timeouts_out_of_range_are_refused_up_front():
    with pytest.raises(ValueError, match="weight must be finite in float32"):
        RewardAtom("big", lambda s: 1.0, weight=1e39)
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds up to"):
        Reward([value_atom("v")], timeout=1e10)
    with pytest.raises(ValueError, match="parents must be a list of atom names, got None"):
        RewardAtom("child", lambda s: 1.0, parents=None)


def test_a_negative_weight_beyond_float32_is_refused_too():
    """The float32 range bounds a weight's size either way: -1e39 is -inf in the totals."""
    with pytest.raises(ValueError, match="weight must be finite in float32"):
        RewardAtom("big", lambda s: 1.0, weight=-1e39)
    a = value_atom("a")
    a.weight = -1e39  # changed after construction: still caught
    with pytest.raises(ValueError, match="'a': weight must be finite in float32"):
        Reward([a])


def test_metrics_of_one_sample_have_a_total_std_of_zero():
    m = Reward([value_atom("a", weight=2.0)]).score(make_samples([0.5])).metrics()
    assert m["reward/total"] == 1.0 and m["reward/total_std"] == 0.0  # not the nan of an unbiased std of one


def test_an_async_atom_busy_between_its_awaits_is_charged_its_own_time():
    """Work an async atom does itself, in slices short of the timeout with awaits between,
    counts against its timeout (only other atoms' time on the loop is not its own): it times
    out at the timeout, not only once it finishes."""
    @reward_atom("grinding")
    async def grinding(s):
        for _ in range(40):
            time.sleep(0.02)  # noqa: ASYNC251 -- its own work, in short slices
            await asyncio.sleep(0)
        return 1.0

    start = time.perf_counter()
    with pytest.raises(RewardError, match=r"timed out after 0\.2 s") as info:
        Reward([grinding], timeout=0.2).score(make_samples([0]))
    assert info.value.atom == "grinding"
    assert time.perf_counter() - start < 0.6  # not the 0.8 s the whole call takes


def test_a_weighted_total_beyond_float32_names_the_sample():
    with pytest.raises(RewardError, match=r"weighted total of sample 1 .* is inf.*exceed the float32 range"):
        Reward([value_atom("v", weight=2.0)]).score(make_samples([1.0, 3e38]))


def test_a_forked_child_scores_async_atoms_on_a_loop_of_its_own():
    """A fork keeps the Reward but not its loop's thread: the child makes its own loop."""
    import multiprocessing

    @reward_atom("judge")
    async def judge(s):
        await asyncio.sleep(0)
        return s.completion

    reward = Reward([judge])
    assert reward.score(make_samples([1.0])).total.tolist() == [1.0]  # the parent's loop thread exists
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=lambda: queue.put(reward.score(make_samples([2.0])).total.tolist()))
    child.start()
    try:
        child.join(20)
        assert child.exitcode == 0 and queue.get(timeout=1) == [2.0]
    finally:  # a child stuck on the parent's loop fails the test, not hangs pytest at exit
        if child.is_alive():
            child.kill()
            child.join()


# ---------------------------------------------------------------------------- atom construction, by hand


def test_an_atom_needs_a_non_empty_string_name_and_a_callable():
    for bad in ("", None, 5):
        with pytest.raises(ValueError, match="name must be a non-empty string"):
            RewardAtom(bad, lambda s: 1.0)
    with pytest.raises(TypeError, match="'a': fn must be callable, got int"):
        RewardAtom("a", 3)
    with pytest.raises(TypeError, match="reward_atom needs a name"):
        reward_atom(lambda s: 1.0)


def test_a_weight_is_stored_as_a_float_and_must_be_a_number():
    atom = RewardAtom("a", lambda s: 1.0, weight="0.25")  # a number written as text, as from a config
    assert type(atom.weight) is float and atom.weight == 0.25
    assert type(RewardAtom("b", lambda s: 1.0, weight=2).weight) is float
    for bad in ("heavy", None, [1.0]):
        with pytest.raises(ValueError, match="weight must be a number"):
            RewardAtom("c", lambda s: 1.0, weight=bad)


def test_parents_must_all_be_names():
    with pytest.raises(ValueError, match="parents must be a list of atom names"):
        RewardAtom("child", lambda s: 1.0, parents=["a", 3])
    assert RewardAtom("child", lambda s: 1.0, parents=["a", "b"]).parents == ("a", "b")


def test_an_object_with_an_async_call_method_is_an_async_atom():
    class Judge:
        async def __call__(self, s):
            await asyncio.sleep(0)
            return s.completion / 2

    atom = RewardAtom("judge", Judge())
    assert atom.is_async
    assert Reward([atom]).score(make_samples([1.0, 0.5])).values[:, 0].tolist() == [0.5, 0.25]


def test_atom_repr_shows_only_what_is_set():
    assert repr(value_atom("a")) == "RewardAtom('a', weight=1.0)"
    child = RewardAtom("c", _async_value, weight=2, parents="p", batched=True)
    assert repr(child) == "RewardAtom('c', weight=2.0, parents=('p',), batched=True, async)"


def test_a_reward_needs_atoms_and_a_numeric_timeout():
    with pytest.raises(ValueError, match="at least one atom"):
        Reward([])
    for bad in ("1", [1.0]):
        with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
            Reward([value_atom("v")], timeout=bad)
    reward = Reward([value_atom("v")], timeout=2)
    assert type(reward.timeout) is float and reward.timeout == 2.0


# ---------------------------------------------------------------------------- gating, level by level


def test_a_batched_child_gated_on_every_sample_is_not_called():
    calls = []

    @reward_atom("child", batched=True, parents="root")
    def child(samples):
        calls.append(len(samples))
        return [1.0] * len(samples)

    scores = Reward([value_atom("root"), child]).score(make_samples([0.0, 0.25]))
    assert calls == []  # not even with an empty list
    assert scores.values.tolist() == [[0.0, 0.0], [0.25, 0.0]]


def test_a_fully_gated_atom_does_not_stop_the_rest_of_its_level():
    gated = RewardAtom("gated", lambda s: 1.0, parents="closed")
    open_ = RewardAtom("open", lambda s: 0.5, weight=2.0, parents="root")
    closed = RewardAtom("closed", lambda s: 0.0)
    scores = Reward([value_atom("root"), closed, gated, open_]).score(make_samples([1.0, 0.75]))
    # gated: its parent is 0 on both samples; open: root >= 0.5 on both -> 0.5
    # total = root + closed + gated + 2 * open = root + 1.0
    assert scores.values.tolist() == [[1.0, 0.0, 0.0, 0.5], [0.75, 0.0, 0.0, 0.5]]
    assert scores.total.tolist() == [2.0, 1.75]


# ---------------------------------------------------------------------------- metrics


def test_total_std_of_two_samples_is_the_unbiased_one():
    # totals 0 and 1: mean 0.5, unbiased variance (0.25 + 0.25) / 1 = 0.5 -> std sqrt(0.5)
    m = Reward([value_atom("a")]).score(make_samples([0.0, 1.0])).metrics()
    assert m["reward/total_std"] == pytest.approx(math.sqrt(0.5))


# ---------------------------------------------------------------------------- timeouts


def test_an_async_atom_is_timed_out_at_its_timeout_not_later():
    """timeout 0.2 s, an atom done after 1 s: it is failed at 0.2 s, its late value not taken."""
    @reward_atom("late")
    async def late(s):
        await asyncio.sleep(1.0)
        return 1.0

    with pytest.raises(RewardError, match=r"'late' failed on sample 0 \(prompt: 'prompt 0'\): timed out after 0\.2 s$"):
        Reward([late], timeout=0.2).score(make_samples([0]))


def test_a_timed_out_async_atom_is_cancelled_and_its_cleanup_may_await():
    cancelled = threading.Event()

    @reward_atom("judge")
    async def judge(s):
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            await asyncio.sleep(0)  # e.g. closing a connection, which awaits
            cancelled.set()
            raise
        return 1.0

    with pytest.warns(RuntimeWarning, match="judge"):
        scores = Reward([judge], timeout=0.05, on_error="zero").score(make_samples([0]))
    assert scores.values.tolist() == [[0.0]]
    assert cancelled.wait(2)


def test_a_copy_of_a_reward_keeps_its_max_stuck():
    """A copy counts its own stuck calls, up to the same max_stuck as the original."""
    import copy

    release, started = threading.Event(), []
    hangs = hanging_atom("hangs", release, started)
    twin = copy.deepcopy(Reward([hangs], timeout=0.05, on_error="zero", max_stuck=1))
    try:
        with pytest.warns(RuntimeWarning, match="'hangs' on 3"):
            twin.score(make_samples([0, 1, 2]))
        assert (twin.max_stuck, len(started), twin.stuck("hangs")) == (1, 1, 1)  # 1 left running, 2 not started
    finally:
        release.set()


def test_work_handed_to_a_thread_past_the_timeout_does_not_hold_up_the_process_exit():
    import subprocess
    import sys

    script = textwrap.dedent(
        """
        import asyncio, threading
        from mmrl.core.rewards import Reward, Sample, reward_atom

        @reward_atom("judge")
        async def judge(s):
            await asyncio.to_thread(threading.Event().wait, 20)
            return 1.0

        scores = Reward([judge], timeout=0.05, on_error="zero").score([Sample("p", None)])
        print(scores.errors)
        """
    )
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", script], check=False, capture_output=True,
                          text=True, timeout=15)
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr


# ---------------------------------------------------------------------------- values at the edges


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def test_the_largest_float32_is_a_usable_value_and_weight():
    big = RewardAtom("big", lambda s: s.completion, weight=FLOAT32_MAX)
    assert big.weight == FLOAT32_MAX
    scores = Reward([value_atom("v")]).score(make_samples([FLOAT32_MAX, -FLOAT32_MAX]))
    assert scores.values[:, 0].tolist() == [FLOAT32_MAX, -FLOAT32_MAX]
    assert Reward([big]).score(make_samples([1.0])).total.tolist() == [FLOAT32_MAX]


def test_a_sync_atom_returning_a_coroutine_leaves_no_never_awaited_warning():
    import gc

    async def judge(s):
        return 1.0

    atom = RewardAtom("wrapped", lambda s: judge(s))  # not declared async
    gc.collect()  # other tests' garbage (unclosed files) would warn inside the block
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scores = Reward([atom], on_error="zero").score(make_samples([0]))
        gc.collect()
    assert scores.errors == 1
    messages = [str(w.message) for w in caught if not issubclass(w.category, ResourceWarning)]
    assert len(messages) == 1 and "async def" in messages[0], messages  # the summary only


@pytest.mark.parametrize("returned, shape", [(torch.ones(2, 1), "(2, 1)"), (torch.tensor(1.0), "()"),
                                             (np.zeros((2, 1)), "(2, 1)")])
def test_a_batched_atom_must_return_a_flat_list_of_values(returned, shape):
    atom = RewardAtom("b", lambda samples: returned, batched=True)
    with pytest.raises(RewardError, match=rf"of shape {re.escape(shape)}, expected 2 values$") as info:
        Reward([atom]).score(make_samples([0, 0]))
    assert info.value.sample_index is None


def test_error_messages_word_one_sample_and_exceptions_without_text():
    two = RewardAtom("two", lambda samples: [1.0, 1.0], batched=True)
    with pytest.raises(RewardError) as info:
        Reward([two]).score(make_samples([0]))
    assert str(info.value) == (
        "reward atom 'two' failed on a batch of 1 sample (first prompt: 'prompt 0'): returned 2 values for 1 sample"
    )

    def quiet(s):
        raise RuntimeError

    with pytest.raises(RewardError) as info:
        Reward([RewardAtom("quiet", quiet)]).score(make_samples([0]))
    assert str(info.value) == "reward atom 'quiet' failed on sample 0 (prompt: 'prompt 0'): RuntimeError"


def test_a_prompt_is_shown_whole_up_to_80_characters_then_cut_to_80():
    atom = RewardAtom("nan", lambda s: math.nan)
    fits = "q" * 78  # repr with its quotes: 80 characters
    with pytest.raises(RewardError) as info:
        Reward([atom]).score([Sample(fits, None)])
    assert f"(prompt: '{fits}')" in str(info.value)
    with pytest.raises(RewardError) as info:
        Reward([atom]).score([Sample(fits + "q", None)])  # repr 81 characters -> 77 of them and "..."
    assert "(prompt: '" + "q" * 76 + "...)" in str(info.value)


def test_atoms_of_one_level_run_in_the_users_order():
    order = []
    first = RewardAtom("first", lambda s: order.append("first") or 1.0)
    second = RewardAtom("second", lambda s: order.append("second") or 1.0)
    Reward([second, first]).score(make_samples([0]))
    assert order == ["second", "first"]


# ---------------------------------------------------------------------------- loading, by hand


def test_a_spec_dict_without_a_path_is_a_value_error():
    from mmrl.core.rewards import load_atoms

    for bad in ({"weight": 2.0}, 5):
        with pytest.raises(ValueError, match="reward spec 0 must be 'file.py:fn' or a dict with a 'path'"):
            load_atoms([bad])


def test_a_spec_path_may_contain_a_colon(tmp_path):
    folder = tmp_path / "run:1"
    folder.mkdir()
    (folder / "atoms.py").write_text("def one(sample):\n    return 1.0\n")
    atom = load_atom(f"{folder}/atoms.py:one")
    assert atom.name == "one" and atom(Sample("p", "c")) == 1.0


def test_atoms_of_one_file_share_one_import_and_pickle(tmp_path):
    import pickle

    from mmrl.core.rewards import load_atoms

    (tmp_path / "two.py").write_text("def a(sample):\n    return 1.0\n\ndef b(sample):\n    return 0.5\n")
    a, b = load_atoms(["two.py:a", "two.py:b"], base_dir=tmp_path)
    assert a.fn.__globals__ is b.fn.__globals__  # the file's module-level state is one
    twin = pickle.loads(pickle.dumps(Reward([a, b])))
    assert twin.score(make_samples([0])).total.tolist() == [1.5]


def test_a_failed_import_lists_public_callables_and_leaves_no_module(tmp_path):
    import sys

    (tmp_path / "helpers.py").write_text("def _private(s):\n    return 0\n\ndef public(s):\n    return 1\n")
    with pytest.raises(ValueError, match=r"has no attribute 'nope' \(callables defined: public\)$"):
        load_atom("helpers.py:nope", base_dir=tmp_path)
    (tmp_path / "broken_here.py").write_text("raise RuntimeError('bad file')\n")
    with pytest.raises(ValueError, match="RuntimeError: bad file"):
        load_atom("broken_here.py:f", base_dir=tmp_path)
    assert not [n for n in sys.modules if n.startswith("mmrl_user_broken_here_")]


def test_a_wait_cut_short_by_another_atom_resumes_for_only_the_time_left():
    """slow waits forever; blocker holds the loop 0.1 s early on. At 1.0 s slow has been charged
    0.9 s (the 0.1 s was blocker's), so it is timed out at 1.1 s, not after a fresh 1.0 s wait."""
    @reward_atom("slow")
    async def slow(s):
        await asyncio.sleep(30)
        return 1.0

    @reward_atom("blocker")
    async def blocker(s):
        await asyncio.sleep(0.05)
        time.sleep(0.1)  # noqa: ASYNC251 -- holds the loop, short of its own timeout
        return 1.0

    start = time.perf_counter()
    with pytest.warns(RuntimeWarning, match="'slow' on 1 .*timed out after 1.0 s"):
        scores = Reward([slow, blocker], timeout=1.0, on_error="zero").score(make_samples([0]))
    assert time.perf_counter() - start < 1.6
    assert scores.values.tolist() == [[0.0, 1.0]]


def test_an_atom_from_a_file_with_dots_in_its_name_pickles(tmp_path):
    import pickle

    (tmp_path / "rules.v2.py").write_text("def one(sample):\n    return 1.0\n")
    atom = load_atom("rules.v2.py:one", base_dir=tmp_path)
    assert pickle.loads(pickle.dumps(atom)).fn(Sample("p", "c")) == 1.0


# ---------------------------------------------------------------------------- edges: levels, async batches, cancels, messages


def test_a_batched_flag_is_stored_as_a_bool():
    assert RewardAtom("a", lambda samples: [1.0], batched=1).batched is True
    assert RewardAtom("b", lambda s: 1.0, batched=0).batched is False


def test_the_longest_wait_a_thread_allows_is_a_valid_timeout():
    # "up to MAX_TIMEOUT" includes it; a second more is refused
    assert Reward([value_atom("v")], timeout=threading.TIMEOUT_MAX).timeout == threading.TIMEOUT_MAX
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds up to"):
        Reward([value_atom("v")], timeout=threading.TIMEOUT_MAX + 1)


def test_an_async_batched_child_gets_only_its_open_samples():
    seen = []

    @reward_atom("child", batched=True, parents="root")
    async def child(samples):
        seen.append([s.prompt for s in samples])
        return [2.0 * s.completion for s in samples]

    scores = Reward([value_atom("root"), child]).score(make_samples([1.0, 0.25, 0.5]))
    # root 1.0 and 0.5 (>= 0.5) open the child, 0.25 gates it: one call with samples 0 and 2
    assert seen == [["prompt 0", "prompt 2"]]
    # child = 2 * value on the open samples: 2.0, (gated) 0.0, 1.0
    assert scores.values.tolist() == [[1.0, 2.0], [0.25, 0.0], [0.5, 1.0]]


def test_an_atom_is_scored_after_its_deepest_parent():
    """c's parents are a (level 0) and b (level 1): c is on level 2, after b, even when listed
    before b (on b's level it would see b's 0 and be gated)."""
    a = value_atom("a")
    b = RewardAtom("b", lambda s: 1.0, parents="a")
    c = RewardAtom("c", lambda s: 0.5, parents=("a", "b"))
    scores = Reward([a, c, b]).score(make_samples([1.0, 0.0]))
    # sample 0: a 1 opens b (1), a and b open c (0.5); sample 1: a 0 gates b and c
    assert scores.values.tolist() == [[1.0, 0.5, 1.0], [0.0, 0.0, 0.0]]


def test_a_parent_cycle_is_named_without_the_atoms_leading_into_it():
    z = value_atom("z", parents="x")  # leads into the cycle, is not in it
    x, y = value_atom("x", parents="y"), value_atom("y", parents="x")
    with pytest.raises(ValueError, match=r"'x' is in a parent cycle: x -> y -> x$"):
        Reward([z, x, y])


def test_a_weighted_total_beyond_float32_names_the_first_such_sample():
    # weight 2: 2 * 3e38 = 6e38 > float32 max (3.4e38) on samples 1 and 2; the first is named
    with pytest.raises(RewardError, match=r"weighted total of sample 1 \(prompt: 'prompt 1'\) is inf") as info:
        Reward([value_atom("v", weight=2.0)]).score(make_samples([1.0, 3e38, 3e38]))
    assert (info.value.atom, info.value.sample_index) == (None, 1)


def test_the_failure_warning_names_each_atoms_first_failure():
    def picky(s):
        if s.completion:
            raise ValueError(f"bad {s.completion}")
        return 1.0

    with pytest.warns(RuntimeWarning) as record:
        Reward([RewardAtom("picky", picky)], on_error="zero").score(make_samples([0, 1, 2]))
    assert len(record) == 1
    assert str(record[0].message) == (
        "2 reward evaluation(s) failed and scored 0: 'picky' on 2 (first: sample 1: ValueError: bad 1)"
    )


def test_the_failure_warning_points_at_the_caller_of_score():
    reward = Reward([RewardAtom("nan", lambda s: math.nan)], on_error="zero")
    with pytest.warns(RuntimeWarning) as record:
        reward.score(make_samples([0]))
    assert record[0].filename == __file__  # this file, not rewards.py


def test_a_complex_number_is_not_a_score():
    with pytest.raises(RewardError) as info:
        Reward([RewardAtom("z", lambda s: complex(1, 0))]).score(make_samples([0]))
    assert str(info.value) == "reward atom 'z' failed on sample 0 (prompt: 'prompt 0'): returned a complex, expected a number"


def test_an_async_atom_raising_system_exit_is_reported_as_system_exit():
    @reward_atom("quits")
    async def quits(s):
        raise SystemExit(3)

    with pytest.raises(RewardError) as info:
        Reward([quits]).score(make_samples([0]))
    assert str(info.value) == "reward atom 'quits' failed on sample 0 (prompt: 'prompt 0'): SystemExit: 3"


def test_a_returned_object_is_named_with_its_article():
    class Unknown:
        pass

    with pytest.raises(RewardError, match=r"returned an Unknown, expected a number$"):
        Reward([RewardAtom("v", lambda s: Unknown())]).score(make_samples([0]))


def test_an_async_atom_raising_a_base_exception_of_its_own_is_its_failure():
    class Halt(BaseException):  # neither an Exception nor one of those the loop handles itself
        pass

    @reward_atom("halts")
    async def halts(s):
        raise Halt("stop")

    with pytest.raises(RewardError) as info:
        Reward([halts]).score(make_samples([0]))
    assert str(info.value) == "reward atom 'halts' failed on sample 0 (prompt: 'prompt 0'): Halt: stop"
    with pytest.warns(RuntimeWarning, match="'halts' on 2"):
        scores = Reward([halts], on_error="zero").score(make_samples([0, 1]))
    assert scores.errors == 2 and scores.values.tolist() == [[0.0], [0.0]]


def test_a_timed_out_async_atom_between_awaits_is_cancelled_too():
    """An atom that only yields the loop (sleep(0), waiting on no future) is cancelled at its next
    await: the cancellation is thrown into it, not lost, and it stops spinning."""
    cancelled = threading.Event()

    @reward_atom("spinner")
    async def spinner(s):
        try:
            while True:
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.warns(RuntimeWarning, match="'spinner' on 1 .*timed out after 0.05 s"):
        scores = Reward([spinner], timeout=0.05, on_error="zero").score(make_samples([0]))
    assert scores.values.tolist() == [[0.0]]
    assert cancelled.wait(2)


def test_a_failed_batched_child_names_the_batch_it_was_called_with():
    def broken(samples):
        raise RuntimeError("judge down")

    child = RewardAtom("child", broken, batched=True, parents="root")
    with pytest.raises(RewardError) as info:
        Reward([value_atom("root"), child]).score(make_samples([0.0, 1.0, 0.5]))
    # root 0.0 gates sample 0: the child is called with samples 1 and 2
    assert str(info.value) == ("reward atom 'child' failed on a batch of 2 samples (first prompt: 'prompt 1'): "
                               "RuntimeError: judge down")
    assert (info.value.atom, info.value.sample_index) == ("child", None)


def test_a_call_left_on_the_loop_is_cancelled_again_when_the_reward_is_gone():
    """An atom that swallows its timeout's cancel keeps awaiting; once the Reward (and its loop)
    is gone, what is left on the loop is cancelled once more, so its cleanup runs."""
    import gc

    cancels = []
    finished = threading.Event()

    @reward_atom("stubborn")
    async def stubborn(s):
        try:
            for _ in range(2):
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    cancels.append(1)  # the first is swallowed
            return 1.0
        finally:
            finished.set()

    reward = Reward([stubborn], timeout=0.05, on_error="zero")
    with pytest.warns(RuntimeWarning, match="'stubborn' on 1"):
        reward.score(make_samples([0]))
    assert cancels == [1] and not finished.is_set()  # still awaiting on the loop
    del reward
    gc.collect()
    assert finished.wait(5) and cancels == [1, 1]  # cancelled again (not only closed with its loop)


def test_a_boolean_weight_is_refused_not_read_as_one(atoms_file):
    """float(True) is 1.0: `weight: true` in a spec weighed 1 silently (config keys refuse a
    boolean for a number the same way); numpy's bool too."""
    for bad in (True, False, np.bool_(True)):
        with pytest.raises(ValueError, match=r"reward atom 'a': weight must be a number, got .* \(a boolean\)"):
            RewardAtom("a", lambda s: 1.0, weight=bad)
    with pytest.raises(ValueError, match="weight must be a number, got True"):
        Reward.from_config([{"path": f"{atoms_file}:plain", "weight": True}])
    assert RewardAtom("a", lambda s: 1.0, weight=np.float32(0.5)).weight == 0.5  # a numpy number is one


def test_a_missing_atom_function_suggests_the_near_name_and_the_function_of_an_atom_name(tmp_path):
    """A spec names the function, not the name @reward_atom gives it: 'has_len' is found as
    'length_fn'; a typo gets the nearest name; what the file imports is not listed as its own."""
    (tmp_path / "mine.py").write_text(textwrap.dedent(
        """
        from math import floor
        from mmrl.core.rewards import Sample, reward_atom

        @reward_atom("has_len")
        def length_fn(s):
            return 1.0

        def length(s):
            return 0.5
        """
    ))
    cases = {
        "lenght": "has no attribute 'lenght'; did you mean 'length'? (callables defined: length, length_fn)",
        "has_len": "has no attribute 'has_len', the name the atom 'length_fn' is given (a spec names the "
                   "function); did you mean 'length_fn'? (callables defined: length, length_fn)",
        "zzz": "has no attribute 'zzz' (callables defined: length, length_fn)",  # no near name: no guess
    }
    for attr, message in cases.items():
        with pytest.raises(ValueError) as info:
            load_atom(f"{tmp_path}/mine.py:{attr}")
        assert str(info.value).endswith(f"mine.py {message}"), str(info.value)


def test_a_tensor_whose_values_cannot_be_read_fails_its_atom_not_score():
    """.item() / .tolist() of a meta tensor raise: that was a RuntimeError traceback out of
    score(), not a RewardError naming the atom (nor a 0 under on_error="zero")."""
    meta = torch.tensor(1.0, device="meta")
    single = RewardAtom("single", lambda s: meta)
    batched = RewardAtom("batched", lambda ss: torch.ones(len(ss), device="meta"), batched=True)
    with pytest.raises(RewardError, match=r"reward atom 'single' failed on sample 0 .*: returned a Tensor on device "
                                          r"meta whose values cannot be read: (RuntimeError|NotImplementedError)"):
        Reward([single]).score(make_samples([1]))
    with pytest.raises(RewardError, match=r"reward atom 'batched' failed on a batch of 2 samples .*: returned a "
                                          r"Tensor on device meta whose values cannot be read"):
        Reward([batched]).score(make_samples([1, 2]))
    with pytest.warns(RuntimeWarning, match="2 reward evaluation"):
        scores = Reward([single, value_atom("ok")], on_error="zero").score(make_samples([1, 2]))
    assert scores.values.tolist() == [[0.0, 1.0], [0.0, 2.0]]


def test_a_batched_atom_with_one_value_for_several_samples_says_value():
    with pytest.raises(RewardError, match="returned 1 value for 3 samples"):
        Reward([RewardAtom("one", lambda ss: [1.0], batched=True)]).score(make_samples([1, 2, 3]))


def test_a_spec_naming_a_class_is_refused_when_loaded(tmp_path):
    """A class is callable, so it was taken as the atom: each sample made an instance, and the
    run stopped at its first score ("Judge() takes no arguments"). Its instance is the atom."""
    (tmp_path / "judges.py").write_text(textwrap.dedent(
        """
        class Judge:
            def __call__(self, sample):
                return 0.5

        judge = Judge()
        """
    ))
    with pytest.raises(ValueError, match=r"reward atom spec 'judges.py:Judge': 'Judge' is a class; name a function or "
                                         r"an instance of it \(e.g. add `judge = Judge\(\)` to judges.py and name "
                                         r"'judges.py:judge'\)"):
        load_atom("judges.py:Judge", base_dir=tmp_path)
    atom = load_atom("judges.py:judge", base_dir=tmp_path)
    assert Reward([atom]).score(make_samples([1])).total.tolist() == [0.5]


def test_a_function_that_cannot_take_one_sample_is_refused_when_made_an_atom(tmp_path):
    """TRL's reward_func(prompts, completions, **kwargs), or a second required argument, failed
    only at the first score (after the model loaded and rolled out): now when the atom is made."""
    def trl_style(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    def needs_keyword(sample, *, tokenizer):
        return 1.0

    def no_argument():
        return 1.0

    for fn, sig in [(trl_style, r"\(prompts, completions, \*\*kwargs\)"),
                    (needs_keyword, r"\(sample, \*, tokenizer\)"), (no_argument, r"\(\)")]:
        with pytest.raises(ValueError, match=rf"reward atom 'x': its function takes {sig}, and an atom is called as "
                                             r"fn\(sample\) with one Sample"):
            RewardAtom("x", fn)
    with pytest.raises(ValueError, match=r"called as fn\(samples\) with the list of samples"):
        reward_atom("x", batched=True)(trl_style)

    class Judge:
        def __call__(self, sample, temperature=0.0, **options):
            return 0.5

    # one argument, with or without optional others, *args, an object's __call__, a builtin: fine
    for fn in [Judge(), lambda *args: 0.5, lambda s, scale=1.0: 0.5 * scale, float]:
        assert RewardAtom("ok", fn).name == "ok"
    (tmp_path / "trl.py").write_text("def f(prompts, completions):\n    return 1.0\n")
    with pytest.raises(ValueError, match=r"reward atom 'f': its function takes \(prompts, completions\)"):
        load_atom(f"{tmp_path}/trl.py:f")


def test_sample_tables_show_float32_scores_as_their_shortest_decimals():
    # float() of a float32 0.1 is 0.10000000149011612: `sample` printed a weight-0.1 atom's score so
    from mmrl.core.rewards import AtomScores, shortest

    scores = AtomScores(["a", "b"], torch.tensor([[0.1, 1.0], [0.3, 0.0]]), torch.tensor([0.2, 0.03]))
    assert scores.per_sample() == [{"a": 0.1, "b": 1.0}, {"a": 0.3, "b": 0.0}]
    assert scores.totals() == [0.2, 0.03]
    assert all(torch.tensor(shortest(v), dtype=torch.float32) == torch.tensor(v, dtype=torch.float32)
               for v in (0.1, 1 / 3, 1e-30, 3.4e38, -2.5))  # the same float32, read back
    assert math.isnan(shortest(float("nan"))) and shortest(0.1) == 0.1  # a float64 value: kept
