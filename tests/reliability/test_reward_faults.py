"""A reward atom that hangs, raises, or returns NaN / inf / the wrong number of values /
a non-number never gives a silent wrong reward: on_error="raise" stops with a RewardError
naming the atom and the sample; on_error="zero" scores that entry 0, counts it in
`errors` (reward/errors) and warns. Then the same through a config-named atom file in a run.

(Single faults with their exact messages are in tests/test_rewards.py; this file is the
whole fault x policy grid, the untouched entries around a failure, and the run end to end.)
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import warnings

import numpy as np
import pytest
import torch
import toy
from typer.testing import CliRunner

from mmrl.core.cli import BackendSpec, make_app
from mmrl.core.config import TrainConfig, load_config
from mmrl.core.logging import read_metrics
from mmrl.core.rewards import Reward, RewardError, Sample, reward_atom
from mmrl.core.trainer import Trainer

N = 4
BAD = 1  # the sample the per-sample faults hit
GOOD_VALUE = 0.75  # what the faulty atom returns on the other samples
TIMEOUT = 0.05


def samples() -> list[Sample]:
    return [Sample(prompt=f"prompt-{i}", completion=f"c{i}") for i in range(N)]


def per_sample(bad_value, is_async=False):
    """An atom that returns `bad_value()` on sample BAD and GOOD_VALUE elsewhere."""
    if is_async:
        async def fn(s):
            await asyncio.sleep(0)
            return bad_value() if s.prompt == f"prompt-{BAD}" else GOOD_VALUE
    else:
        def fn(s):
            return bad_value() if s.prompt == f"prompt-{BAD}" else GOOD_VALUE
    return fn


def raise_(exc):
    raise exc


async def hang(s):
    if s.prompt == f"prompt-{BAD}":
        await asyncio.sleep(30)  # far past the timeout; cancelled
    return GOOD_VALUE


def batched_wrong_count(ss):
    return [GOOD_VALUE] * (len(ss) - 1)


async def batched_wrong_count_async(ss):
    return torch.full((len(ss) + 1,), GOOD_VALUE)


def batched_raises(ss):
    raise RuntimeError("judge unreachable")


def batched_nan_element(ss):
    return [math.nan if s.prompt == f"prompt-{BAD}" else GOOD_VALUE for s in ss]


def batched_not_a_sequence(ss):
    return "0.5"


# (id, fn, batched, expected text of what went wrong). Per-sample faults hit sample BAD only;
# a batched fault of the call as a whole hits every sample of the call.
PER_SAMPLE = [
    ("hangs", hang, f"timed out after {TIMEOUT} s"),
    ("raises", per_sample(lambda: raise_(ValueError("parse error"))), "ValueError: parse error"),
    ("raises_async", per_sample(lambda: raise_(KeyError("gt")), is_async=True), "KeyError: 'gt'"),
    ("nan", per_sample(lambda: math.nan), "returned nan"),
    ("nan_async", per_sample(lambda: float("nan"), is_async=True), "returned nan"),
    ("nan_tensor", per_sample(lambda: torch.tensor(float("nan"))), "returned nan"),
    ("nan_numpy", per_sample(lambda: np.float32("nan")), "returned nan"),
    ("inf", per_sample(lambda: math.inf), "returned inf"),
    ("minus_inf", per_sample(lambda: -math.inf), "returned -inf"),
    ("huge_int", per_sample(lambda: 10**400), "returned a number too large for a float"),
    # finite as a Python float but inf in the float32 scores: was a silent inf reward
    ("beyond_float32", per_sample(lambda: 1e39), "returned 1e+39, beyond the float32 range of the scores"),
    ("beyond_float32_negative", per_sample(lambda: -1e39), "returned -1e+39, beyond the float32 range of the scores"),
    ("string", per_sample(lambda: "0.5"), "returned a str, expected a number"),
    ("none", per_sample(lambda: None), "returned None, expected a number"),
    ("vector", per_sample(lambda: torch.ones(2)), "returned a Tensor of shape (2,), expected a number"),
    ("batched_nan_element", batched_nan_element, "returned nan"),
]
WHOLE_BATCH = [
    ("wrong_count", batched_wrong_count, f"returned {N - 1} values for {N} samples"),
    ("wrong_count_async", batched_wrong_count_async, f"returned {N + 1} values for {N} samples"),
    ("batched_raises", batched_raises, "RuntimeError: judge unreachable"),
    ("batched_string", batched_not_a_sequence, f"returned a str, expected a sequence of {N} numbers"),
]
BATCHED_IDS = {"batched_nan_element", *(f[0] for f in WHOLE_BATCH)}


def make_reward(fault_id, fn, on_error) -> Reward:
    ok = reward_atom("ok", weight=2.0)(lambda s: 1.0)
    bad = reward_atom("bad", weight=1.0, batched=fault_id in BATCHED_IDS)(fn)
    return Reward([ok, bad], on_error=on_error, timeout=TIMEOUT)


@pytest.mark.parametrize("fault_id, fn, what", PER_SAMPLE, ids=[f[0] for f in PER_SAMPLE])
def test_per_sample_fault_raise_names_atom_and_sample(fault_id, fn, what):
    reward = make_reward(fault_id, fn, "raise")
    t0 = time.monotonic()
    with pytest.raises(RewardError) as err:
        reward.score(samples())
    assert time.monotonic() - t0 < 5  # a hang is cut at the timeout, not waited out
    e = err.value
    assert e.atom == "bad" and e.sample_index == BAD
    msg = str(e)
    assert f"reward atom 'bad' failed on sample {BAD} (prompt: 'prompt-{BAD}')" in msg, msg
    assert what in msg, msg


@pytest.mark.parametrize("fault_id, fn, what", PER_SAMPLE, ids=[f[0] for f in PER_SAMPLE])
def test_per_sample_fault_zero_scores_zero_counts_and_warns(fault_id, fn, what):
    reward = make_reward(fault_id, fn, "zero")
    with pytest.warns(RuntimeWarning) as record:
        scores = reward.score(samples())
    messages = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages  # once per score() call
    assert "1 reward evaluation(s) failed and scored 0" in messages[0]
    assert f"'bad' on 1 (first: sample {BAD}: {what})" in messages[0], messages[0]

    bad_col = scores.names.index("bad")
    want_bad = [0.0 if i == BAD else GOOD_VALUE for i in range(N)]
    assert scores.values[:, bad_col].tolist() == want_bad  # only the failed entry is 0
    assert scores.values[:, scores.names.index("ok")].tolist() == [1.0] * N
    # total = 2 * ok + 1 * bad: 2.75 where bad scored, 2.0 on the failed sample
    assert scores.total.tolist() == [2.0 if i == BAD else 2.75 for i in range(N)]
    assert torch.isfinite(scores.total).all()
    assert scores.errors == 1
    assert scores.failed.nonzero().tolist() == [[BAD, bad_col]]
    assert scores.metrics()["reward/errors"] == 1.0


@pytest.mark.parametrize("fault_id, fn, what", WHOLE_BATCH, ids=[f[0] for f in WHOLE_BATCH])
def test_batched_fault_raise_names_atom_and_batch(fault_id, fn, what):
    reward = make_reward(fault_id, fn, "raise")
    with pytest.raises(RewardError) as err:
        reward.score(samples())
    e = err.value
    assert e.atom == "bad" and e.sample_index is None  # the call failed as a whole
    msg = str(e)
    assert f"reward atom 'bad' failed on a batch of {N} samples (first prompt: 'prompt-0')" in msg, msg
    assert what in msg, msg


@pytest.mark.parametrize("fault_id, fn, what", WHOLE_BATCH, ids=[f[0] for f in WHOLE_BATCH])
def test_batched_fault_zero_zeroes_the_call_and_counts_each_sample(fault_id, fn, what):
    reward = make_reward(fault_id, fn, "zero")
    with pytest.warns(RuntimeWarning, match=f"{N} reward evaluation.*'bad' on {N} .*first: a batch"):
        scores = reward.score(samples())
    assert scores.values[:, scores.names.index("bad")].tolist() == [0.0] * N
    assert scores.total.tolist() == [2.0] * N
    assert scores.errors == N and scores.metrics()["reward/errors"] == float(N)


def test_a_failed_parent_gates_its_child_in_zero_mode():
    """A failed parent counts as 0, so its child is not called there (and is not an error)."""
    calls = []
    parent = reward_atom("parent")(per_sample(lambda: math.nan))
    child = reward_atom("child", parents="parent")(lambda s: calls.append(s.prompt) or 1.0)
    with pytest.warns(RuntimeWarning):
        scores = Reward([parent, child], on_error="zero").score(samples())
    assert f"prompt-{BAD}" not in calls and len(calls) == N - 1
    assert scores.values[BAD].tolist() == [0.0, 0.0] and scores.errors == 1


def test_no_warning_and_no_errors_when_nothing_fails():
    reward = make_reward("fine", lambda s: GOOD_VALUE, "zero")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scores = reward.score(samples())
    assert scores.errors == 0 and scores.total.tolist() == [2.75] * N


# --------------------------------------------------------------------------- through a run

ATOMS = """
import asyncio
import math
from mmrl.core.rewards import reward_atom

@reward_atom("flaky")
def flaky(sample):
    # NaN on even digits, 1 on odd ones
    return math.nan if sample.prompt % 2 == 0 else 1.0

@reward_atom("slow")
async def slow(sample):
    await asyncio.sleep(30)  # always past reward.timeout
    return 1.0

@reward_atom("crash")
def crash(sample):
    raise ZeroDivisionError("division by zero in my verifier")
"""


@pytest.fixture
def atoms_dir(tmp_path):
    (tmp_path / "atoms.py").write_text(ATOMS)
    return tmp_path


def run_config(tmp_path, yaml_text: str, *overrides):
    (tmp_path / "run.yaml").write_text(yaml_text)
    return load_config(TrainConfig, tmp_path / "run.yaml", defaults=toy.DEFAULT_CONFIG,
                       overrides=[f"output_dir={tmp_path / 'out'}", "train.max_steps=2",
                                  "rollout.prompts_per_step=4", "rollout.num_generations=4", *overrides])


def test_config_keys_reach_the_reward(atoms_dir):
    cfg = run_config(atoms_dir, "reward:\n  atoms: [atoms.py:flaky]\n  on_error: zero\n  timeout: 0.25\n"
                                "  max_stuck: 6\n")
    trainer = Trainer(cfg, *toy.build(cfg))
    assert trainer.reward.on_error == "zero" and trainer.reward.timeout == 0.25 and trainer.reward.max_stuck == 6
    assert trainer.reward.names == ["answer", "stop", "flaky"]
    cfg = run_config(atoms_dir, "reward:\n  atoms: [atoms.py:flaky]\n")
    trainer = Trainer(cfg, *toy.build(cfg))
    assert (trainer.reward.on_error, trainer.reward.timeout, trainer.reward.max_stuck) == ("raise", None, 4)  # defaults


def test_run_with_on_error_zero_continues_and_logs_reward_errors(atoms_dir, one_thread):
    cfg = run_config(atoms_dir, "reward:\n  atoms: [atoms.py:flaky, atoms.py:slow]\n"
                                "  on_error: zero\n  timeout: 0.05\n")
    trainer = Trainer(cfg, *toy.build(cfg))
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match="'slow' on 16 .*timed out after 0.05 s"):
        summary = trainer.train()
    assert time.monotonic() - t0 < 60  # the hanging atom never held the run up for 30 s
    assert summary["steps"] == 2
    rows = read_metrics(atoms_dir / "out" / "metrics.jsonl")
    assert len(rows) == 2
    n = 16  # 4 prompts x 4 samples per step
    for r in rows:
        assert r["reward/slow"] == 0.0
        flaky_failures = round((1.0 - r["reward/flaky"]) * n)  # flaky is 1 where it did not fail
        assert r["reward/errors"] == n + flaky_failures  # every slow call + each NaN of flaky
        assert math.isfinite(r["reward/total"]) and math.isfinite(r["loss/total"])
    assert sum(r["reward/errors"] for r in rows) > 2 * n  # some flaky NaNs happened too


@pytest.mark.parametrize("atom, what", [("flaky", "returned nan"), ("crash", "ZeroDivisionError"),
                                         ("slow", "timed out after 0.05 s")])
def test_run_with_on_error_raise_stops_naming_the_atom(atoms_dir, atom, what, one_thread):
    """Through the CLI, as a user sees it: one error line naming the atom and the sample."""
    (atoms_dir / "run.yaml").write_text(f"reward:\n  atoms: [atoms.py:{atom}]\n  timeout: 0.05\n"
                                        f"output_dir: {atoms_dir / 'out'}\n")
    app = make_app(BackendSpec(modality="toy", title="toy", command="toy-rl", module="toy"))
    result = CliRunner().invoke(app, ["train", "--config", str(atoms_dir / "run.yaml"), "--max-steps", "2",
                                      "--set", "rollout.num_generations=2", "--set", "rollout.prompts_per_step=4"])
    assert result.exit_code == 2, result.output
    out = " ".join(result.output.split())
    assert f"reward atom '{atom}' failed on sample" in out and "(prompt: " in out, out
    assert what in out and "Traceback" not in out, out
    assert not (atoms_dir / "out" / "summary.json").exists()  # the run did not finish as if fine
    rows = read_metrics(atoms_dir / "out" / "metrics.jsonl") if (atoms_dir / "out" / "metrics.jsonl").exists() else []
    assert rows == []  # no step was trained on a wrong reward


def test_summary_reports_no_errors_without_faults(tmp_path, one_thread):
    cfg = run_config(tmp_path, "seed: 0\n")
    Trainer(cfg, *toy.build(cfg)).train()
    rows = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [r["reward/errors"] for r in rows] == [0.0, 0.0]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps"] == 2
