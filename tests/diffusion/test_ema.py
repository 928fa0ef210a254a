"""Flow-GRPO's EMA of the trainable weights (diffusion_rl.ema) on a tiny module: the update
worked by hand, the update interval, the warm-up of the decay, swapping the average in and
out, and its state round trip."""

from __future__ import annotations

import pytest
import torch

from diffusion_rl.ema import ParameterEMA, ema_decay


def scalar_module(value: float) -> torch.nn.Linear:
    m = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        m.weight.fill_(value)
    return m


def set_weight(m: torch.nn.Linear, value: float) -> None:
    with torch.no_grad():
        m.weight.fill_(value)


def test_decay_warm_up_is_flow_grpos():
    assert ema_decay(1, 0.9) == pytest.approx(2 / 11)  # (1 + 1) / (10 + 1)
    assert ema_decay(8, 0.9) == pytest.approx(0.5)  # 9 / 18: Flow-GRPO's first update (every 8)
    assert ema_decay(80, 0.9) == pytest.approx(0.9)  # 81 / 90: the warm-up ends here
    assert ema_decay(1000, 0.9) == 0.9
    assert ema_decay(1, 0.9, warmup=False) == 0.9


def test_two_updates_by_hand_with_warm_up():
    m = scalar_module(1.0)
    ema = ParameterEMA(list(m.parameters()), decay=0.9, update_every=1)
    set_weight(m, 3.0)  # after optimizer step 1
    assert ema.update(list(m.parameters()))
    # d_1 = min(0.9, 2/11) = 2/11: avg = 1 + (9/11)(3 - 1) = 29/11
    assert ema.average[0].item() == pytest.approx(29 / 11)
    set_weight(m, 5.0)  # after step 2
    ema.update(list(m.parameters()))
    # d_2 = min(0.9, 3/12) = 1/4: avg = 29/11 + (3/4)(5 - 29/11) = 29/11 + 19.5/11 = 48.5/11 = 4.40909
    assert ema.average[0].item() == pytest.approx(48.5 / 11)
    assert m.weight.item() == 5.0  # the raw weights are untouched


def test_two_updates_by_hand_constant_decay_and_the_interval():
    m = scalar_module(1.0)
    ema = ParameterEMA(list(m.parameters()), decay=0.5, update_every=1, warmup=False)
    for w in (3.0, 5.0):
        set_weight(m, w)
        ema.update(list(m.parameters()))
    assert ema.average[0].item() == pytest.approx(3.5)  # 1 -> 0.5*1 + 0.5*3 = 2 -> 0.5*2 + 0.5*5 = 3.5

    m = scalar_module(1.0)
    ema = ParameterEMA(list(m.parameters()), decay=0.9, update_every=2)
    set_weight(m, 3.0)
    assert not ema.update(list(m.parameters()))  # step 1 of 2: no move
    assert ema.average[0].item() == 1.0
    set_weight(m, 5.0)
    assert ema.update(list(m.parameters()))
    # step 2: d_2 = min(0.9, 3/12) = 1/4: avg = 1 + (3/4)(5 - 1) = 4
    assert ema.average[0].item() == pytest.approx(4.0)
    assert ema.steps == 2


def test_applied_swaps_the_average_in_and_restores_the_raw_weights_exactly():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    params = list(m.parameters())
    ema = ParameterEMA(params, decay=0.5, update_every=1, warmup=False)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p))
    ema.update(params)
    raw = [p.detach().clone() for p in params]
    with ema.applied(params):
        assert all(torch.equal(p, a) for p, a in zip(params, ema.average))
        assert not any(torch.equal(p, r) for p, r in zip(params, raw))
    assert all(torch.equal(p, r) for p, r in zip(params, raw))  # bit for bit
    with pytest.raises(RuntimeError, match="boom"), ema.applied(params):
        raise RuntimeError("boom")
    assert all(torch.equal(p, r) for p, r in zip(params, raw))  # restored on an error too


def test_state_round_trip_and_a_mismatch_is_an_error():
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    ema = ParameterEMA(list(m.parameters()), decay=0.9, update_every=1)
    with torch.no_grad():
        m.weight.add_(1.0)
    ema.update(list(m.parameters()))
    tensors, meta = ema.state_dict()
    fresh = ParameterEMA(list(torch.nn.Linear(3, 2).parameters()), decay=0.9, update_every=1)
    fresh.load_state_dict(tensors, meta)
    assert fresh.steps == 1 and all(torch.equal(a, b) for a, b in zip(fresh.average, ema.average))
    with pytest.raises(ValueError, match="shape"):
        ParameterEMA(list(torch.nn.Linear(2, 3).parameters())).load_state_dict(tensors, meta)
    with pytest.raises(ValueError, match="do not match"):
        ema.update(list(torch.nn.Linear(2, 3).parameters()))
    with pytest.raises(ValueError, match="decay"):
        ParameterEMA(list(m.parameters()), decay=1.0)


def test_decay_and_update_every_out_of_range_are_refused():
    """decay must be strictly inside (0, 1): 0 would copy the weights, 1 never move; update_every
    at least 1 (0 updates would divide by zero)."""
    params = list(scalar_module(1.0).parameters())
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match="decay must be in"):
            ParameterEMA(params, decay=bad)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="update_every must be >= 1"):
            ParameterEMA(params, update_every=bad)


def test_the_defaults_are_flow_grpos_setting():
    """ParameterEMA(params) is Flow-GRPO's: decay 0.9, one update every 8 optimizer steps, with the
    warm-up, so the first move is after step 8 with d_8 = min(0.9, 9/18) = 0.5: 1 -> 1 + 0.5 (3 - 1) = 2."""
    m = scalar_module(1.0)
    ema = ParameterEMA(list(m.parameters()))
    set_weight(m, 3.0)
    assert [ema.update(list(m.parameters())) for _ in range(8)] == [False] * 7 + [True]
    assert ema.average[0].item() == pytest.approx(2.0)
    _, meta = ema.state_dict()
    assert meta == {"steps": 8, "decay": 0.9, "update_every": 8, "warmup": True}


def test_parameters_of_another_count_are_refused_and_leave_everything_alone():
    """update and applied check the parameters against the average: one parameter too few or too
    many is an error (zip would quietly drop the rest), and the weights are as they were."""
    m = torch.nn.Linear(2, 2)
    params = list(m.parameters())
    ema = ParameterEMA(params, decay=0.5, update_every=1, warmup=False)
    raw = [p.detach().clone() for p in params]
    for wrong in (params[:1], [*params, torch.zeros(1)]):
        with pytest.raises(ValueError, match="do not match"):
            ema.update(wrong)
        with pytest.raises(ValueError, match="do not match"), ema.applied(wrong):
            pass
    assert all(torch.equal(p, r) for p, r in zip(params, raw))
    other = torch.nn.Linear(2, 3)
    with pytest.raises(ValueError, match="do not match"), ema.applied(list(other.parameters())):
        pass
    assert ema.steps == 0  # a refused update is not a step


def test_parameters_are_checked_also_on_steps_that_do_not_update():
    m = torch.nn.Linear(2, 2)
    ema = ParameterEMA(list(m.parameters()), update_every=8)
    with pytest.raises(ValueError, match="do not match"):
        ema.update(list(m.parameters())[:1])  # step 1 of 8 moves nothing, but the list is still wrong
    assert ema.steps == 0 and ema.update(list(m.parameters())) is False and ema.steps == 1


def test_a_saved_average_with_a_tensor_too_many_or_too_few_is_refused():
    """load_state_dict takes exactly ema.0 .. ema.{n-1}: an extra ema.n or a missing one is a
    ValueError counting both sides (3 saved tensors against 2 parameters; 1 against 2), and the
    average and step count are left as they were."""
    m = torch.nn.Linear(3, 2)
    ema = ParameterEMA(list(m.parameters()), decay=0.9, update_every=1)
    tensors, _ = ema.state_dict()
    before = [a.clone() for a in ema.average]
    with pytest.raises(ValueError, match="the saved EMA has 3 tensors, the model 2 trainable parameters"):
        ema.load_state_dict({**tensors, "ema.2": torch.zeros(1)}, {"steps": 5})
    with pytest.raises(ValueError, match="the saved EMA has 1 tensors, the model 2 trainable parameters"):
        ema.load_state_dict({"ema.0": tensors["ema.0"]}, {"steps": 5})
    assert ema.steps == 0 and all(torch.equal(a, b) for a, b in zip(ema.average, before))
    ema.load_state_dict({**tensors, "other.0": torch.zeros(1)}, {"steps": 5})  # not the EMA's: ignored
    assert ema.steps == 5
