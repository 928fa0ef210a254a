"""Float32 master weights for bfloat16 parameters (mmrl.core.master, optim.master_weights)."""

from __future__ import annotations

import warnings

import pytest
import torch
import toy

from mmrl.core.config import TrainConfig, load_config
from mmrl.core.master import MasterWeights
from mmrl.core.trainer import Trainer


def make_bf16(tmp_path, *overrides, name="run"):
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG,
                      overrides=[f"output_dir={tmp_path / name}", "optim.max_grad_norm=null", *overrides])
    policy, task = toy.build(cfg)
    policy.model.to(torch.bfloat16)
    return Trainer(cfg, policy, task)


def test_gradients_accumulate_in_the_float32_copy_and_leave_the_model():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3).to(torch.bfloat16)
    master = MasterWeights(list(layer.parameters()))
    assert master.active and all(m.dtype == torch.float32 for m in master.masters)
    xs = [torch.randn(5, 4).to(torch.bfloat16) for _ in range(2)]
    expected = [torch.zeros_like(m) for m in master.masters]
    for x in xs:  # each backward's bfloat16 gradient, as autograd makes it without the hook
        ref = torch.nn.Linear(4, 3).to(torch.bfloat16)
        ref.load_state_dict(layer.state_dict())
        ref(x).square().sum().backward()
        for e, p in zip(expected, ref.parameters()):
            e += p.grad.float()
    for x in xs:
        layer(x).square().sum().backward()
    assert all(p.grad is None for p in layer.parameters())
    for m, e in zip(master.masters, expected):
        assert torch.equal(m.grad, e)


def test_float32_parameters_are_their_own_master(tmp_path):
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[f"output_dir={tmp_path}"])
    trainer = Trainer(cfg, *toy.build(cfg))
    assert not trainer.master.active
    assert all(m is p for m, p in zip(trainer.opt_params, trainer.params))


@pytest.mark.filterwarnings("ignore:optim.master_weights is off")  # its plain arm, on purpose
@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("lr", [1e-6])
def test_a_fine_tuning_step_in_bfloat16_moves_every_master_weight_by_lr(tmp_path, lr):
    """Adam's first step is -lr * g / (|g| + eps): in float32 copies every weight with a
    gradient moves by lr; in the bfloat16 weights themselves almost none can."""
    runs = {}
    for master in (True, False):
        trainer = make_bf16(tmp_path, f"optim.lr={lr}", f"optim.master_weights={master}", name=str(master))
        start = [p.detach().float().clone() for p in trainer.params]
        batch, _ = trainer.scheduler.next_groups(version=0)
        grads = []
        step = trainer.optimizer.step

        def recording(*a, _step=step, _t=trainer, _grads=grads, **kw):
            _grads.extend(p.grad.clone() if p.grad is not None else None for p in _t.opt_params)
            return _step(*a, **kw)

        trainer.optimizer.step = recording
        trainer.update(batch)
        runs[master] = trainer, start, grads
    trainer, start, grads = runs[True]
    for p, m, s, g in zip(trainer.params, trainer.opt_params, start, grads):
        live = g.abs() > 1e-5  # where eps does not shrink the step (unused embedding rows have none)
        torch.testing.assert_close((m.detach() - s)[live], -lr * g.sign()[live], rtol=0.02,
                                   atol=float(s.abs().max()) * 2**-23)  # float32 spacing of the weights
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))  # the model holds the rounding
    moved = [sum(int((p.detach().float() != s).sum()) for p, s in zip(t.opt_params, st)) / sum(s.numel() for s in st)
             for t, st, _ in (runs[True], runs[False])]
    assert moved[0] > 0.5 and moved[1] < 0.2, moved


def test_bfloat16_resume_2_plus_2_equals_4_steps_with_the_masters(tmp_path):
    full = make_bf16(tmp_path, "train.max_steps=4", "optim.lr=1e-4", name="full")
    full.train()
    first = make_bf16(tmp_path, "train.max_steps=2", "optim.lr=1e-4", name="split")
    first.train()
    second = make_bf16(tmp_path, "train.max_steps=4", "optim.lr=1e-4", name="split")
    second.train(resume=True)
    assert full.master.active
    for a, b in zip(full.opt_params, second.opt_params):
        assert torch.equal(a, b)
    for a, b in zip(full.params, second.params):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def test_a_second_trainer_on_the_same_policy_takes_the_gradients_over(tmp_path):
    """Each parameter has one hook for life, routed to the newest training trainer's copies; a
    trainer built only to evaluate makes no copies and leaves the routes alone; one without
    master weights gives the gradients back to the parameters."""
    first = make_bf16(tmp_path, name="a")
    cfg = first.cfg.model_copy(update={"output_dir": str(tmp_path / "b")})
    evaluating = Trainer(cfg, first.policy, first.task, training=False)
    assert evaluating.master is None and evaluating.opt_params is evaluating.params
    batch, _ = first.scheduler.next_groups(version=0)
    evaluating.method.loss(evaluating.policy, batch, batch.advantages, denom=None).loss.backward()
    assert all(p.grad is None for p in first.params) and any(m.grad is not None for m in first.opt_params)
    first.optimizer.zero_grad(set_to_none=True)
    second = Trainer(cfg, first.policy, first.task)
    before = [m.detach().clone() for m in first.opt_params]
    second.update(batch)
    assert all(torch.equal(m, b) for m, b in zip(first.opt_params, before))  # the first's copies untouched
    assert any(m.grad is not None for m in second.opt_params)
    assert not torch.equal(torch.cat([m.detach().flatten() for m in second.opt_params]),
                           torch.cat([b.flatten() for b in before]))
    plain = Trainer(cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"master_weights": False})}),
                    first.policy, first.task)
    assert plain.master is None
    plain.method.loss(plain.policy, batch, batch.advantages, denom=None).loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in plain.params)


def test_the_weight_average_is_kept_of_the_float32_copies(tmp_path, monkeypatch):
    """A method's EMA (Flow-GRPO's) averages the float32 copies: a bfloat16 average would round
    away most of each small step toward them."""
    from diffusion_rl.ema import ParameterEMA
    from mmrl.core.method import Method

    monkeypatch.setattr(Method, "weight_average", lambda self, params: ParameterEMA(params, 0.5, 1, warmup=False))
    trainer = make_bf16(tmp_path, "optim.lr=1e-5")
    assert all(a.dtype == torch.float32 for a in trainer.ema.average)
    start = [a.clone() for a in trainer.ema.average]
    batch, _ = trainer.scheduler.next_groups(version=0)
    trainer.update(batch)
    for a, s, m in zip(trainer.ema.average, start, trainer.opt_params):
        torch.testing.assert_close(a, s + 0.5 * (m.detach() - s))


def test_routes_leave_the_parameters_movable_picklable_and_their_deep_copies_alone():
    """No weakref to a parameter (torch.utils.swap_tensors, used to move modules of tensor
    subclasses, refuses those), nothing unpicklable on it, and a deep copy is not routed."""
    import copy
    import io

    layer = torch.nn.Linear(4, 3).to(torch.bfloat16)
    master = MasterWeights(list(layer.parameters()))
    twin = copy.deepcopy(layer)
    twin(torch.randn(2, 4).to(torch.bfloat16)).sum().backward()
    assert all(p.grad is not None for p in twin.parameters()) and all(m.grad is None for m in master.masters)
    torch.save(layer, io.BytesIO())
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        layer.to(torch.float32)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


def test_a_pickled_copys_release_leaves_the_originals_route():
    """A copy made through pickling (torch.save / torch.load) carries the route number; releasing
    the copy (a trainer without master weights on it) must not take the original's route."""
    import io

    from mmrl.core.master import release

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3).to(torch.bfloat16)
    master = MasterWeights(list(layer.parameters()))
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    twin = torch.load(buf, weights_only=False)
    release(list(twin.parameters()))
    layer(torch.randn(2, 4).to(torch.bfloat16)).sum().backward()
    assert all(p.grad is None for p in layer.parameters())
    assert all(m.grad is not None and m.grad.dtype == torch.float32 for m in master.masters)


def test_a_parameter_made_float32_since_an_older_master_keeps_its_gradient():
    """A bfloat16 model trained with master weights, then cast to float32 in place (module.float()):
    a new MasterWeights has no copy for it, so its gradient must stay on it, not go to the older
    copies."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3).to(torch.bfloat16)
    older = MasterWeights(list(layer.parameters()))
    layer.float()
    newer = MasterWeights(list(layer.parameters()))
    assert not newer.active
    layer(torch.randn(2, 4)).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in layer.parameters())
    assert all(m.grad is None for m in older.masters)


def test_state_dict_is_keyed_by_the_parameters_index_and_refuses_what_does_not_fit():
    """master.<i> with i the parameter's index among all the trainable ones (a float32 one has no
    copy; an FSDP checkpoint saves master.<i> for every i): a fresh MasterWeights takes them back;
    a checkpoint without copies, or with other shapes, leaves the copies as they are (False)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2).to(torch.bfloat16))]
    master = MasterWeights(params)
    with torch.no_grad():
        master.masters[1].add_(1e-3)  # a float32 value the bfloat16 weight cannot hold
    saved = master.state_dict()
    assert set(saved) == {"master.1"}
    fresh = MasterWeights(params)
    assert not torch.equal(fresh.masters[1], master.masters[1])
    assert fresh.load_state_dict(saved) and torch.equal(fresh.masters[1], master.masters[1])
    before = fresh.masters[1].clone()
    assert not fresh.load_state_dict({"master.1": torch.zeros(4)})
    assert not fresh.load_state_dict({})
    assert torch.equal(fresh.masters[1], before)
    assert not MasterWeights([params[0]]).load_state_dict(saved)  # no copies: nothing of the checkpoint's taken


def test_resuming_a_run_saved_without_master_weights_starts_the_copies_from_its_weights(tmp_path):
    """A checkpoint with no float32 copies (optim.master_weights=false): the copies start from
    the loaded bfloat16 weights, not from the weights the model had before loading."""
    from mmrl.core.checkpoint import latest_checkpoint

    with pytest.warns(UserWarning, match="master_weights is off"):
        first = make_bf16(tmp_path, "train.max_steps=1", "optim.lr=1e-2", "optim.master_weights=false", name="run")
    first.train()
    resumed = make_bf16(tmp_path, "train.max_steps=2", "optim.lr=1e-2", name="run")
    assert resumed.master.active
    start = [m.detach().clone() for m in resumed.opt_params]
    resumed.load(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    assert any(not torch.equal(m, s) for m, s in zip(resumed.opt_params, start))
    for p, m, q in zip(resumed.params, resumed.opt_params, first.params):
        assert torch.equal(p, q) and torch.equal(m.detach(), q.detach().float())


def test_each_parameter_keeps_one_hook_however_many_masters_it_had():
    """One hook a parameter for the life of the process: three MasterWeights in turn (a second
    and third Trainer) add none; the gradient goes to the newest one's copy only."""
    layer = torch.nn.Linear(4, 3).to(torch.bfloat16)
    masters = [MasterWeights(list(layer.parameters())) for _ in range(3)]
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in layer.parameters())
    layer(torch.ones(2, 4).to(torch.bfloat16)).sum().backward()
    assert all(m.grad is None for m in masters[0].masters + masters[1].masters)
    assert torch.equal(masters[2].masters[1].grad, torch.full((3,), 2.0))  # d(sum)/d(bias): 2 rows


def test_a_master_no_longer_used_is_freed_and_the_gradients_stay_on_the_parameters():
    """The route holds its copy weakly: dropping the MasterWeights frees its float32 copies, and
    a later backward leaves the gradient on the bfloat16 parameters (nothing to send it to)."""
    import weakref

    layer = torch.nn.Linear(4, 3).to(torch.bfloat16)
    master = MasterWeights(list(layer.parameters()))
    copies = [weakref.ref(m) for m in master.masters]
    del master  # no cycle holds it: freed at once, without a garbage collection
    assert all(c() is None for c in copies)
    layer(torch.ones(2, 4).to(torch.bfloat16)).sum().backward()
    assert torch.equal(layer.bias.grad, torch.full((3,), 2.0, dtype=torch.bfloat16))
    assert layer.weight.grad is not None and layer.weight.grad.dtype == torch.bfloat16


def test_a_checkpoint_missing_one_of_the_copies_loads_none_of_them():
    """Two bfloat16 parameters, a checkpoint with master.0 only: False, and neither copy taken
    from it (half the copies from a checkpoint and half from the model's rounding would mix two
    states)."""
    params = [torch.nn.Parameter(torch.zeros(2).to(torch.bfloat16)), torch.nn.Parameter(torch.zeros(3).to(torch.bfloat16))]
    master = MasterWeights(params)
    assert not master.load_state_dict({"master.0": torch.full((2,), 0.5)})
    assert torch.equal(master.masters[0], torch.zeros(2)) and torch.equal(master.masters[1], torch.zeros(3))
    assert master.load_state_dict({"master.0": torch.full((2,), 0.5), "master.1": torch.full((3,), 0.25)})
    assert torch.equal(master.masters[0], torch.full((2,), 0.5)) and torch.equal(master.masters[1], torch.full((3,), 0.25))


def test_a_bfloat16_runs_copies_become_the_weights_of_a_float32_resume():
    """A checkpoint of bfloat16 weights (model/ their rounding) with their float32 copies,
    resumed with model.dtype float32: the weights are their own masters and take the copies,
    not the rounding (the updates since the copies' last representable change were lost)."""
    torch.manual_seed(0)
    bf16 = [torch.nn.Parameter(torch.randn(3).to(torch.bfloat16)), torch.nn.Parameter(torch.randn(2, 2).to(torch.bfloat16))]
    saving = MasterWeights(bf16)
    with torch.no_grad():
        for m in saving.masters:
            m.add_(1e-3)  # float32 values the bfloat16 weights cannot hold
    saved = saving.state_dict()
    resumed = [torch.nn.Parameter(p.detach().float()) for p in bf16]  # model/ loaded in float32
    assert MasterWeights(resumed).load_state_dict(saved)
    for p, m in zip(resumed, saving.masters):
        assert torch.equal(p.detach(), m.detach())
    other = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2, 2))]  # master.0 does not fit
    assert not MasterWeights(other).load_state_dict(saved)
    assert all(float(p.abs().sum()) == 0.0 for p in other)


def test_bfloat16_weights_without_master_weights_are_warned(tmp_path):
    """optim.master_weights=false on bfloat16 weights steps them in bfloat16, where a fine-tuning
    lr's updates mostly round away: said, where it trained on as a near no-op without a word.
    Float32 weights, or the copies on, say nothing."""
    with pytest.warns(UserWarning, match=r"optim\.master_weights is off and \d+ trainable parameters are "
                                         r"torch\.bfloat16: .* at lr 1e-05 round away"):
        make_bf16(tmp_path, "optim.master_weights=false", "optim.lr=1e-5")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_bf16(tmp_path, name="on")
        cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG,
                          overrides=[f"output_dir={tmp_path / 'f32'}", "optim.master_weights=false"])
        Trainer(cfg, *toy.build(cfg))
