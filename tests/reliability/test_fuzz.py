"""Hypothesis fuzzing of the user-facing config loader and of the advantage / loss functions.

- load_config of every backend's CONFIG_CLASS, with random `key=value` overrides built from
  the real key paths (and some made-up ones) and random YAML files of nested mappings: the
  only exception that may escape is ConfigError (a ValueError with a one-paragraph message).
- advantages (group_advantages, rloo, atom, multi_stream, group_stats, zero_variance_groups)
  on random finite rewards, random group ids, groups of one included: finite outputs.
- policy_loss, kl_penalty, aggregate, loss_denominator on random log-probs within +-50,
  random advantages and masks (all-False rows included): finite loss, metrics and gradients,
  or a ValueError for a shape error.

Sized to run in well under a minute on one thread (hypothesis' database is off: the examples
are drawn afresh, from a fixed seed per test via derandomize).
"""

from __future__ import annotations

import importlib
import math
import tempfile
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmrl.core.advantages import (
    atom_advantages,
    group_advantages,
    group_stats,
    multi_stream_advantages,
    rloo_advantages,
    zero_variance_groups,
)
from mmrl.core.config import ConfigError, TrainConfig, load_config
from mmrl.core.losses import (
    AGGREGATIONS,
    KL_KINDS,
    LEVELS,
    aggregate,
    kl_penalty,
    loss_denominator,
    policy_loss,
)

FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])
BACKENDS = ["tests.toy", "mmrl.vlm.backend", "diffusion_rl.backend", "dllm_rl.backend"]

# --------------------------------------------------------------------------- config loader


def _leaves(node, prefix=()):
    if isinstance(node, dict) and node:
        for k, v in node.items():
            yield from _leaves(v, (*prefix, str(k)))
    else:
        yield ".".join(prefix)


def backend_config(module: str):
    try:
        backend = importlib.import_module(module)
    except ModuleNotFoundError:  # tests.toy as "toy" when tests/ is on the path
        backend = importlib.import_module(module.split(".")[-1])
    cls = getattr(backend, "CONFIG_CLASS", TrainConfig)
    defaults = dict(getattr(backend, "DEFAULT_CONFIG", {}))
    keys = sorted(set(_leaves(load_config(cls, defaults=defaults).model_dump(mode="json"))))
    return cls, defaults, keys


CONFIGS = {}


def config_of(module):
    if module not in CONFIGS:
        CONFIGS[module] = backend_config(module)
    return CONFIGS[module]


yaml_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
)
raw_values = st.one_of(
    st.sampled_from(["", "null", "~", "true", "no", "1e-5", "-1", "0", "1e400", ".nan", "-.inf", "[1, 2]",
                     "[a, {b: c}]", "{type: group}", "{x: 1}", "{", "]", "&a [*a]", "!!python/object:os.system x",
                     "2024-01-01", "0x1F", "1_000", "'quoted'", "a: b: c", "- 1\n- 2", "\t", "%TAG"]),
    yaml_scalars.map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()),
    st.text(max_size=20),
)
nested = st.recursive(
    yaml_scalars,
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(st.text(max_size=8), children, max_size=3)),
    max_leaves=8,
)


@st.composite
def overrides(draw, keys):
    items = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.integers(0, 9))
        if kind <= 6:
            key = draw(st.sampled_from(keys))
            if kind == 6:  # a section, or a child of a value
                key = draw(st.sampled_from([key.rsplit(".", 1)[0], key + ".sub", key + ".type"]))
        elif kind == 7:
            key = draw(st.text(max_size=12))
        else:
            key = draw(st.sampled_from(keys)).replace(".", draw(st.sampled_from(["..", ". ", "."])), 1)
        sep = draw(st.sampled_from(["=", "=", "=", "", "=="]))
        items.append(f"{key}{sep}{draw(raw_values)}")
    return items


@pytest.mark.parametrize("module", BACKENDS)
def test_fuzz_overrides_only_raise_config_error(module):
    cls, defaults, keys = config_of(module)
    assert len(keys) > 20, keys

    @FUZZ
    @given(overrides(keys))
    def check(items):
        try:
            cfg = load_config(cls, overrides=items, defaults=defaults)
        except ConfigError as e:
            msg = str(e)
            assert msg and ("\n" not in msg.strip() or "override" in msg or "invalid config" in msg)
            return
        assert isinstance(cfg, cls)
        cls.model_validate(cfg.model_dump())  # what loaded is a valid config

    check()


@pytest.mark.parametrize("module", BACKENDS)
def test_fuzz_yaml_files_only_raise_config_error(module):
    cls, defaults, keys = config_of(module)
    sections = sorted({k.split(".")[0] for k in keys})

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.yaml"

        @FUZZ
        @given(st.one_of(
            nested,
            st.dictionaries(st.sampled_from(sections), nested, max_size=3),
            st.dictionaries(st.sampled_from(sections),
                            st.dictionaries(st.sampled_from([k.split(".", 1)[-1].split(".")[0] for k in keys]),
                                            nested, max_size=3), max_size=3),
            st.binary(max_size=30),
        ))
        def check(data):
            if isinstance(data, bytes):
                path.write_bytes(data)
            else:
                path.write_text(yaml.safe_dump(data), encoding="utf-8")
            try:
                cfg = load_config(cls, path, defaults=defaults)
            except ConfigError as e:
                assert str(e)
                return
            assert isinstance(cfg, cls)

        check()


# --------------------------------------------------------------------------- advantages

finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def grouped(draw, columns: int = 0):
    """(values [N] or [N, K], group ids [N] with random labels, groups of one likely)."""
    n = draw(st.integers(0, 12))
    ids = draw(st.lists(st.integers(-3, 50), min_size=n, max_size=n))
    shape = (n, columns) if columns else (n,)
    flat = draw(st.lists(finite, min_size=n * max(columns, 1), max_size=n * max(columns, 1)))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    values = torch.tensor(flat, dtype=torch.float64).reshape(shape).to(dtype)
    return values, torch.tensor(ids, dtype=torch.long)


def assert_finite(x, what):
    assert torch.isfinite(x.float()).all(), (what, x)


@FUZZ
@given(grouped(), st.sampled_from(["group", "batch", "none"]), st.floats(1e-8, 1.0))
def test_fuzz_group_and_rloo_advantages_are_finite(data, scale, eps):
    rewards, ids = data
    adv = group_advantages(rewards, ids, scale=scale, eps=eps)
    assert adv.shape == rewards.shape
    assert_finite(adv, "group_advantages")
    rloo = rloo_advantages(rewards, ids)
    assert rloo.shape == rewards.shape
    assert_finite(rloo, "rloo_advantages")
    mean, std, count = group_stats(rewards, ids)
    assert_finite(mean, "mean") and assert_finite(std, "std")
    assert (std >= 0).all() and (count >= 1).all()
    zv = zero_variance_groups(rewards, ids)
    assert zv.dtype == torch.bool and zv.shape == rewards.shape
    singles = torch.tensor([int((ids == g).sum()) == 1 for g in ids.tolist()], dtype=torch.bool)
    assert (adv[singles] == 0).all() and (rloo[singles] == 0).all() and zv[singles].all()


@FUZZ
@given(st.integers(1, 4).flatmap(lambda k: st.tuples(grouped(columns=k), st.lists(finite, min_size=k, max_size=k))),
       st.sampled_from(["normalize_then_sum", "sum_then_normalize"]), st.sampled_from(["group", "batch", "none"]))
def test_fuzz_atom_and_multi_stream_advantages_are_finite(data, mode, scale):
    (scores, ids), weights = data
    atom = atom_advantages(scores, ids, scale=scale)
    assert atom.shape == scores.shape
    assert_finite(atom, "atom_advantages")
    w = torch.tensor(weights) / 1e3  # weights are small numbers; rewards reach 1e6
    adv = multi_stream_advantages(scores, ids, w, mode=mode, scale=scale)
    assert adv.shape == scores.shape[:1]
    assert_finite(adv, "multi_stream_advantages")


@FUZZ
@given(st.integers(0, 5), st.integers(0, 5), st.integers(1, 3))
def test_fuzz_advantage_shape_errors_are_value_errors(n, m, k):
    if n == m:
        m += 1
    for call in (lambda: group_advantages(torch.zeros(n), torch.zeros(m, dtype=torch.long)),
                 lambda: rloo_advantages(torch.zeros(n), torch.zeros(m, dtype=torch.long)),
                 lambda: atom_advantages(torch.zeros(n, k), torch.zeros(m, dtype=torch.long)),
                 lambda: multi_stream_advantages(torch.zeros(n, k), torch.zeros(n, dtype=torch.long),
                                                 torch.ones(k + 1)),
                 lambda: group_advantages(torch.zeros(n, k, 2), torch.zeros(n, dtype=torch.long))):
        with pytest.raises(ValueError):
            call()


# --------------------------------------------------------------------------- losses


@st.composite
def loss_inputs(draw):
    n = draw(st.integers(0, 6))
    t = draw(st.integers(0, 8))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    old = (torch.rand(n, t, generator=g, dtype=torch.float64) * 100 - 50).to(dtype)  # within +-50
    logp = (torch.rand(n, t, generator=g, dtype=torch.float64) * 100 - 50).to(dtype)
    shape = draw(st.sampled_from(["uniform", "near", "corners"]))
    if shape == "near":  # near-policy: the usual case
        logp = (old.double() + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.1).clamp(-50, 50).to(dtype)
    elif shape == "corners":  # the extremes: log-ratios of +-100
        sign = (torch.rand(n, t, generator=g) < 0.5).to(torch.float64) * 2 - 1
        logp, old = (50 * sign).to(dtype), (-50 * sign).to(dtype)
    scale = draw(st.sampled_from([1.0, 1e3, 1e6]))
    adv = torch.randn(n, generator=g, dtype=torch.float64) * scale
    if draw(st.booleans()):
        adv = torch.randn(n, t, generator=g, dtype=torch.float64) * scale
    mask = torch.rand(n, t, generator=g) < draw(st.floats(0.0, 1.0))
    if n and draw(st.booleans()):
        mask[draw(st.integers(0, n - 1))] = False  # an all-False row
    if draw(st.booleans()):
        mask = mask.float()
    return logp, old, adv, mask


@FUZZ
@given(loss_inputs(), st.sampled_from(LEVELS), st.sampled_from(AGGREGATIONS),
       st.floats(0.0, 0.99), st.floats(0.0, 10.0), st.integers(1, 16), st.sampled_from([20.0, 5.0, 1.0]))
def test_fuzz_policy_loss_is_finite(batch, level, aggregation, clip_low, clip_high, max_len, max_log_ratio):
    """(max_log_ratio=None opts out of the guard that keeps exp(log-ratio) finite: not fuzzed.)"""
    logp, old, adv, mask = batch
    logp = logp.clone().requires_grad_(logp.is_floating_point())
    try:
        out = policy_loss(logp, old, adv, mask, clip_low=clip_low, clip_high=clip_high, level=level,
                          aggregation=aggregation, max_len=max_len, max_log_ratio=max_log_ratio)
    except ValueError as e:
        pytest.fail(f"valid shapes raised {e}")
    assert out.loss.dim() == 0
    assert_finite(out.loss.detach(), "loss")
    assert_finite(out.per_token.detach(), "per_token")
    assert all(math.isfinite(v) for v in out.metrics.values()), out.metrics
    if logp.numel():
        out.loss.backward()
        assert_finite(logp.grad, "grad")
        m = mask != 0
        assert (logp.grad[~m] == 0).all()  # nothing flows into padding


@FUZZ
@given(loss_inputs(), st.sampled_from(KL_KINDS), st.sampled_from(AGGREGATIONS))
def test_fuzz_kl_penalty_and_aggregate_are_finite(batch, kind, aggregation):
    logp, ref, _, mask = batch
    logp = logp.clone().requires_grad_(True)
    kl = kl_penalty(logp, ref, kind)  # k3 was inf at logp - ref < -88 before max_log_ratio
    assert kl.shape == logp.shape
    assert_finite(kl.detach(), f"kl {kind}")
    if kind != "k1":
        assert (kl >= 0).all()
    total = aggregate(kl, mask, aggregation, max_len=8)
    denom = loss_denominator(mask, aggregation)
    assert denom >= 1 and math.isfinite(denom)
    assert_finite(total.detach(), "aggregate")
    if logp.numel():
        total.backward()
        assert_finite(logp.grad, "kl grad")


@FUZZ
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 3))
def test_fuzz_loss_shape_errors_are_value_errors(n, t, which):
    logp, old, adv, mask = torch.zeros(n, t), torch.zeros(n, t), torch.zeros(n), torch.ones(n, t, dtype=torch.bool)
    bad = [(torch.zeros(n, t + 1), old, adv, mask), (logp, torch.zeros(n + 1, t), adv, mask),
           (logp, old, torch.zeros(n + 1), mask), (logp, old, adv, torch.ones(n, t + 1))][which]
    with pytest.raises(ValueError):
        policy_loss(*bad)
    with pytest.raises(ValueError):
        kl_penalty(torch.zeros(n, t), torch.zeros(n, t + 1))
    with pytest.raises(ValueError):
        aggregate(torch.zeros(n, t), torch.ones(n + 1, t))
