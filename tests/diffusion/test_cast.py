"""CAST part 1 (diffusion_rl/methods/cast.py, diffusion_rl/calibrate.py; a RECONSTRUCTION):
per-atom signed group advantages by hand, the commit-step and window rules, calibration on a
tiny real flow model, the calibrate-window CLI and the window it stores with the model, one
training step of configs/diffusion/cast.yaml with a calibrated window, and bad window files."""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from diffusion_rl import backend
from diffusion_rl.calibrate import (
    MODEL_WINDOW_FILE,
    WINDOW_FILE,
    calibrate_window,
    commit_step,
    load_window,
    store_in_model,
    window_from_commits,
)
from diffusion_rl.config import CASTConfig, DiffusionTrainConfig
from diffusion_rl.methods.cast import ATOM_ADVANTAGES, CAST, cast_advantages
from mmrl.core.batch import RolloutBatch
from mmrl.core.config import ConfigError, load_config
from mmrl.core.rewards import AtomScores, Reward, Sample
from mmrl.core.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
FAST = ["rollout.num_steps=4", "rollout.window_size=2", "rollout.num_generations=2", "rollout.prompts_per_step=2",
        "task.num_train=16", "task.num_eval=2", "task.grid_prompts=0", "logging.tensorboard=false",
        "logging.progress=false", "optim.lr=1e-3", "rollout.window_start=null"]
S3 = 1 / math.sqrt(3)  # 0.57735: |deviation| 1/3 over the unbiased std sqrt(1/3) of (1, 1, 0)


# ------------------------------------------------------------------ advantages


def hand_batch():
    # columns exist, colour (child of exist), count (child of colour), all
    # group 0 (3 samples): exist 1 1 0; colour 1 0 0 (sample 2 gated: exist failed); count, all 0
    # group 1 (2 samples): exist 0 1; colour gated / failed: 0 0 (constant); count, all 0
    # group 2 (1 sample): a group of one
    values = torch.tensor([[1., 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0],
                           [0, 0, 0, 0], [1, 0, 0, 0],
                           [1, 1, 1, 1]])
    names = ["exist", "colour", "count", "all"]
    w = torch.tensor([1., 2, 1, 1])
    scores = AtomScores(names=names, values=values, total=values @ w)
    batch = RolloutBatch(group_ids=torch.tensor([0, 0, 0, 1, 1, 2]),
                         samples=[Sample(prompt="a red circle", completion=None) for _ in range(6)], scores=scores)
    return batch, w


def test_per_atom_advantages_by_hand():
    batch, w = hand_batch()
    out = cast_advantages(batch.scores.values, batch.group_ids, w, eps=1e-4)
    s2 = 1 / math.sqrt(2)  # group 1's exist: (0, 1) -> -+0.5 / sqrt(0.5)
    expected = torch.tensor([
        [S3, 2 * S3, 0, 0], [S3, -S3, 0, 0], [-2 * S3, -S3, 0, 0],  # exist mean 2/3, colour mean 1/3, std sqrt(1/3)
        [-s2, 0, 0, 0], [s2, 0, 0, 0],  # colour constant (gated at 0) -> 0
        [0, 0, 0, 0],  # a group of one -> 0
    ])
    torch.testing.assert_close(out.atom, expected, atol=1e-3, rtol=1e-3)
    # A_i = sum_k w_k A_ik, w = (1, 2, 1, 1): 1/sqrt3 + 4/sqrt3 = 2.8868; 1/sqrt3 - 2/sqrt3 = -0.5774; -4/sqrt3 = -2.3094
    torch.testing.assert_close(out.total, torch.tensor([5 * S3, -S3, -4 * S3, -s2, s2, 0.]), atol=1e-3, rtol=1e-3)
    for g in range(3):  # each group's advantages sum to zero
        assert abs(float(out.total[batch.group_ids == g].sum())) < 1e-5
    assert (out.atom[:, 2:] == 0).all()  # constant columns are exactly 0
    assert cast_advantages(batch.scores.values, batch.group_ids, w, clip=1.0).total.abs().max() <= 1.0
    # method.adv_std=global: each atom's group-centred scores over that atom's np.std of the whole batch
    v = batch.scores.values.double()
    glob = cast_advantages(batch.scores.values, batch.group_ids, w, eps=1e-4, scale="batch", population=True)
    exist = v[:, 0] - torch.tensor([2 / 3] * 3 + [0.5] * 2 + [float(v[5, 0])], dtype=torch.float64)
    torch.testing.assert_close(glob.atom[:, 0].double(), exist / (v[:, 0].std(correction=0) + 1e-4), rtol=1e-5, atol=1e-6)


def test_cast_method_stores_atom_advantages_and_logs_per_atom():
    batch, w = hand_batch()
    method = CAST(CASTConfig(adv_clip=5.0), None, SimpleNamespace(weights=w))
    adv = method.advantages(batch)
    assert adv.shape == (6,) and batch.data[ATOM_ADVANTAGES].shape == (6, 4)
    # Flow-GRPO's population std: sqrt(G / (G - 1)) times the unbiased z-scores of the hand test
    torch.testing.assert_close(adv[0], torch.tensor(5 * S3 * math.sqrt(3 / 2)), atol=1e-3, rtol=1e-3)
    unbiased = CAST(CASTConfig(adv_clip=5.0, adv_std="unbiased"), None, SimpleNamespace(weights=w))
    torch.testing.assert_close(unbiased.advantages(batch)[0], torch.tensor(5 * S3), atol=1e-3, rtol=1e-3)
    m = method.batch_metrics(batch)
    assert m["cast/adv_nonzero/count"] == 0.0 and m["cast/adv_nonzero/exist"] == pytest.approx(5 / 6)


# ------------------------------------------------------------------ commit step and window


def test_commit_step_rule_by_hand():
    a, b, c = (True, False), (True, True), (False, False)
    assert commit_step([c, a, b, a, a]) == 3  # changes last between steps 2 and 3
    assert commit_step([a, a, a]) == 0  # never changes
    assert commit_step([a, b]) == 1  # only the final verdicts count as committed
    assert commit_step([a, b, a, a]) == 2  # a return to an earlier verdict is still a change
    with pytest.raises(ValueError):
        commit_step([])


def test_window_rule_by_hand():
    # lower median of (1, 3, 4, 6) is 3: W=2 ends there -> steps 2..3 of 10
    assert window_from_commits([6, 1, 4, 3], 10, 2) == (2, 2, 3)
    assert window_from_commits([0, 0, 1], 10, 3) == (0, 3, 0)  # clamped to start at 0, keeps size 3
    assert window_from_commits([9, 9], 10, 2) == (7, 2, 9)  # last SDE step 8: step 9 is never SDE
    assert window_from_commits([5], 10, 2, offset=-1) == (3, 2, 5)
    with pytest.raises(ValueError, match="window_size"):
        window_from_commits([1], 4, 4)


# ------------------------------------------------------------------ calibration on a tiny model


def make(path, tmp_path, *overrides, config=None):
    cfg = load_config(DiffusionTrainConfig, config, defaults=backend.DEFAULT_CONFIG,
                      overrides=[f"model.path={path}", f"output_dir={tmp_path / 'run'}", *FAST, *overrides])
    return cfg


def test_calibrate_on_tiny_model_returns_a_valid_window(flux_dir, tmp_path):
    cfg = make(flux_dir, tmp_path, "method.type=cast")
    policy, task = backend.build(cfg)
    cal = calibrate_window(policy, task.eval_prompts[:2], num_steps=4, window_size=2)
    assert cal.num_samples == 2 and sum(cal.commit_histogram) == 2 and len(cal.commit_histogram) == 4
    assert len(cal.change_rate) == 3 and all(0 <= r <= 1 for r in cal.change_rate)
    assert cal.window_size == 2 and 0 <= cal.window_start and cal.window_start + 2 <= 3  # step 3 never SDE
    assert 0 <= cal.median_commit <= 3


def test_cli_writes_window_json_and_stores_it_with_the_model(flux_dir, tmp_path):
    """calibrate-window writes window.json to --out and cast_window.json into the model's
    directory (a copy here: flux_dir is shared); CAST then trains from that model with it."""
    model = tmp_path / "model"
    shutil.copytree(flux_dir, model)
    out = tmp_path / "cal"
    from typer.testing import CliRunner

    from diffusion_rl.cli import app

    r = CliRunner().invoke(app, ["calibrate-window", "--config", str(REPO / "configs/diffusion/cast.yaml"),
                                 "--out", str(out), "--prompts", "2",
                                 *[x for o in [f"model.path={model}", *FAST] for x in ("--set", o)]])
    assert r.exit_code == 0, (r.output[-2000:], r.exception)
    data = json.loads((out / WINDOW_FILE).read_text())
    assert data["num_steps"] == 4 and data["window_size"] == 2 and data["num_samples"] == 2
    assert load_window(out / WINDOW_FILE, 4) == (data["window_start"], 2)
    # each path on one line, however long (rich broke them at 80 columns)
    assert "window_start" in r.stdout and f"wrote {model / MODEL_WINDOW_FILE}" in r.stdout.splitlines()
    assert json.loads((model / MODEL_WINDOW_FILE).read_text()) == data
    cfg = make(model, tmp_path, config=REPO / "configs/diffusion/cast.yaml")
    assert cfg.method.window_from == "model" and cfg.rollout.window_start is None
    backend.build(cfg)
    assert cfg.rollout.window_start == (data["window_start"],) * 2 and cfg.rollout.window_size == 2
    assert not (flux_dir / MODEL_WINDOW_FILE).exists()


def test_no_into_model_leaves_the_model_directory_alone(flux_dir, tmp_path):
    cfg = make(flux_dir, tmp_path, "method.type=cast")
    cal, written = backend.calibrate(cfg, tmp_path / "cal", 1, into_model=False)
    assert written == [tmp_path / "cal" / WINDOW_FILE] and not (flux_dir / MODEL_WINDOW_FILE).exists()
    assert cal.num_samples == 1


def test_the_bundled_model_is_calibrated_without_rewriting_its_files(tmp_path, monkeypatch):
    """calibrate-window's default stores the window with a model.path, not in the package's bundled model."""
    from diffusion_rl import calibrate

    monkeypatch.setattr(calibrate, "store_in_model", lambda *a: pytest.fail("wrote into the bundled model"))
    cfg = load_config(DiffusionTrainConfig, defaults=backend.DEFAULT_CONFIG,
                      overrides=[f"output_dir={tmp_path / 'run'}", *FAST, "method.type=cast"])
    assert cfg.model.path is None  # the bundled model
    _, written = backend.calibrate(cfg, tmp_path / "cal", 1, into_model=None)
    assert written == [tmp_path / "cal" / WINDOW_FILE]


def test_the_window_stored_with_the_model_and_what_overrides_it(flux_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(flux_dir, model)
    (model / MODEL_WINDOW_FILE).write_text(json.dumps({"num_steps": 4, "window_start": 1, "window_size": 2}))
    cast = ["method.type=cast"]

    cfg = make(model, tmp_path, *cast)  # window_from defaults to "model"
    backend.build(cfg)
    assert cfg.rollout.window_start == (1, 1) and cfg.rollout.window_size == 2
    cfg = make(model, tmp_path, *cast, "method.window_from=null")  # the rollout's own window
    backend.build(cfg)
    assert cfg.rollout.window_start is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit window wins without a warning
        warnings.filterwarnings("ignore", message="task.hard_min_atoms")  # 2 held-out prompts, no relational one
        cfg = make(model, tmp_path, *cast, "rollout.window_start=[0,1]")
        backend.build(cfg)
    assert cfg.rollout.window_start == (0, 1)
    other = tmp_path / "w.json"
    other.write_text(json.dumps({"num_steps": 4, "window_start": 0, "window_size": 2}))
    cfg = make(model, tmp_path, *cast, f"method.window_from={other}")  # a named file beats the model's
    backend.build(cfg)
    assert cfg.rollout.window_start == (0, 0)
    cfg = make(model, tmp_path, *cast, "rollout.num_steps=6")  # calibrated for 4 steps: skipped, said
    with pytest.warns(UserWarning, match="calibrated for denoising steps 4, not this run's 6"):
        backend.build(cfg)
    assert cfg.rollout.window_start is None
    (model / MODEL_WINDOW_FILE).write_text(json.dumps({"num_steps": 4, "window_start": 1, "window_size": 2,
                                                       "shift": "flux"}))
    cfg = make(model, tmp_path, *cast, "rollout.shift=sd3")  # its steps are other noise levels: skipped, said
    with pytest.warns(UserWarning, match="calibrated for rollout.shift 'flux', not this run's 'sd3'"):
        backend.build(cfg)
    assert cfg.rollout.window_start is None
    (model / MODEL_WINDOW_FILE).write_text("{not json")
    with pytest.raises(ConfigError, match="the window stored with the model.*not valid JSON"):
        backend.build(make(model, tmp_path, *cast))
    cfg = make(flux_dir, tmp_path, *cast)  # a model without a stored window: the rollout's own, said
    with pytest.warns(UserWarning, match=f"CAST: {flux_dir} holds no calibrated window"):
        backend.build(cfg)
    assert cfg.rollout.window_start is None
    (model / MODEL_WINDOW_FILE).write_text(json.dumps({"num_steps": 4, "window_start": 1, "window_size": 2}))
    policy, _ = backend.build(make(model, tmp_path, *cast))
    policy.save_pretrained(tmp_path / "checkpoint")  # a checkpoint carries the window of its base model
    assert (tmp_path / "checkpoint" / MODEL_WINDOW_FILE).read_text() == (model / MODEL_WINDOW_FILE).read_text()


def test_a_model_directory_that_cannot_be_written_is_a_clear_error(flux_dir, tmp_path):
    cal = calibrate_window(backend.build(make(flux_dir, tmp_path, "method.type=cast"))[0],
                           ["a red circle"], num_steps=4, window_size=2)
    with pytest.raises(ConfigError, match="cannot store the window in the model directory .*--no-into-model"):
        store_in_model(cal, tmp_path / "absent")
    assert not (tmp_path / "absent").exists()


# ------------------------------------------------------------------ training with a stored window


@pytest.fixture
def atom_spread(monkeypatch):
    """A random model's samples all score alike: make the exist column 0, 1, 0, 1, ... (and
    the total with it) so that CAST's advantages are not zero and an update moves weights."""
    original = Reward.score

    def spread(self, samples):
        s = original(self, samples)
        s.values[:, 0] = torch.arange(len(samples), dtype=torch.float32) % 2
        s.total = s.values @ self.weights
        return s

    monkeypatch.setattr(Reward, "score", spread)


def test_one_training_step_of_cast_yaml(flux_dir, tmp_path, atom_spread):
    window = tmp_path / WINDOW_FILE
    window.write_text(json.dumps({"num_steps": 4, "window_start": 1, "window_size": 2}))
    cfg = make(flux_dir, tmp_path, "train.max_steps=1", f"method.window_from={window}",
               config=REPO / "configs/diffusion/cast.yaml")
    policy, task = backend.build(cfg)
    assert cfg.method.type == "cast" and cfg.rollout.window_start == (1, 1) and cfg.rollout.window_size == 2
    before = {k: v.clone() for k, v in policy.model.named_parameters() if v.requires_grad}
    Trainer(cfg, policy, task).train()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [v for k, v in rows[0].items() if k.startswith("loss/")]
    assert losses and all(math.isfinite(v) for v in losses)
    assert rows[0]["cast/adv_abs/exist"] > 0
    unchanged = [k for k, v in policy.model.named_parameters() if v.requires_grad and torch.equal(v, before[k])]
    assert not unchanged, unchanged


def test_explicit_window_start_wins_over_the_file(flux_dir, tmp_path):
    cfg = make(flux_dir, tmp_path, "method.type=cast", f"method.window_from={tmp_path / 'absent.json'}",
               "rollout.window_start=[0,1]")
    with pytest.warns(UserWarning, match="window_from=.* is not used: rollout.window_start=\\(0, 1\\)"):
        backend.build(cfg)  # the file is not read
    assert cfg.rollout.window_start == (0, 1)


@pytest.mark.parametrize("content, match", [
    (None, "cannot read"),
    ("{not json", "not valid JSON"),
    ('{"num_steps": 4, "window_start": "a", "window_size": 2}', "window_start must be an integer"),
    ('{"num_steps": 10, "window_start": 1, "window_size": 2}', "calibrated for 10"),
    ('{"num_steps": 4, "window_start": 2, "window_size": 2}', "does not fit"),
    ('{"num_steps": 4, "window_start": 1, "window_size": 2, "shift": "none"}', "calibrated with rollout.shift 'none'"),
])
def test_bad_window_file_is_a_clear_config_error(flux_dir, tmp_path, content, match):
    path = tmp_path / "w.json"
    if content is not None:
        path.write_text(content)
    cfg = make(flux_dir, tmp_path, "method.type=cast", f"method.window_from={path}")
    with pytest.raises(ConfigError, match=match) as e:
        backend.build(cfg)
    assert str(path) in str(e.value)


def test_attention_layers_out_of_range_fail_at_build(flux_dir, tmp_path):
    """Checked when the model is built, not at the first update after a whole rollout."""
    cfg = make(flux_dir, tmp_path, "method.type=cast", "method.projection=attention", "method.attention_layers=[99]")
    with pytest.raises(ConfigError, match=r"method.attention_layers: attention layers \[99\] out of range"):
        backend.build(cfg)


def test_clip_bounds_the_total_only_never_the_atom_advantages():
    """cast_advantages(clip=c): atom is the unclipped A_ik; total is the unclipped sum clamped to +-c."""
    batch, w = hand_batch()
    free = cast_advantages(batch.scores.values, batch.group_ids, w, eps=1e-4)
    clipped = cast_advantages(batch.scores.values, batch.group_ids, w, eps=1e-4, clip=1.0)
    assert free.atom.abs().max() > 1.0  # colour's 2/sqrt3 would be clipped were the atoms clipped
    assert torch.equal(clipped.atom, free.atom)
    assert torch.equal(clipped.total, free.total.clamp(-1.0, 1.0))
    torch.testing.assert_close(clipped.total, torch.tensor([1.0, -S3, -1.0, -1 / math.sqrt(2), 1 / math.sqrt(2), 0.]),
                               atol=1e-3, rtol=1e-3)


# ------------------------------------------------------------------ advantages and metrics by hand


def test_std_eps_and_adv_clip_come_from_the_config():
    """hand_batch's group 1 (exist 0, 1; unbiased std sqrt(1/2)): A = -+0.5 / (sqrt(1/2) + std_eps);
    adv_clip clamps the totals (5/sqrt3 and -4/sqrt3 to +-1)."""
    batch, w = hand_batch()
    method = CAST(CASTConfig(adv_std="unbiased", std_eps=0.5), None, SimpleNamespace(weights=w))
    a = 0.5 / (1 / math.sqrt(2) + 0.5)
    torch.testing.assert_close(method.advantages(batch)[3:5], torch.tensor([-a, a]))
    clipped = CAST(CASTConfig(adv_std="unbiased", adv_clip=1.0), None, SimpleNamespace(weights=w))
    s2 = 1 / math.sqrt(2)
    torch.testing.assert_close(clipped.advantages(batch), torch.tensor([1.0, -S3, -1.0, -s2, s2, 0.0]),
                               atol=1e-3, rtol=1e-3)


def test_batch_metrics_mean_absolute_advantage_by_hand():
    batch, w = hand_batch()
    method = CAST(CASTConfig(adv_std="unbiased"), None, SimpleNamespace(weights=w))
    assert method.batch_metrics(batch) == {}  # before the advantages: nothing to log
    method.advantages(batch)
    m = method.batch_metrics(batch)
    s2 = 1 / math.sqrt(2)
    assert m["cast/adv_abs/exist"] == pytest.approx((4 * S3 + 2 * s2) / 6, rel=1e-3)  # |S3, S3, -2S3, -s2, s2, 0|
    assert m["cast/adv_abs/colour"] == pytest.approx(4 * S3 / 6, rel=1e-3)
    assert m["cast/adv_abs/count"] == 0.0


def test_advantages_without_atom_scores_are_an_error():
    batch, w = hand_batch()
    batch.scores = None
    with pytest.raises(ValueError, match="per-atom scores"):
        CAST(CASTConfig(), None, SimpleNamespace(weights=w)).advantages(batch)




def test_weights_of_another_shape_are_an_error():
    """One weight per atom column, or one per sample and column; anything else is refused."""
    batch, w = hand_batch()
    values, groups = batch.scores.values, batch.group_ids
    per_sample = cast_advantages(values, groups, w.expand(6, 4), eps=1e-4)
    torch.testing.assert_close(per_sample.total, cast_advantages(values, groups, w, eps=1e-4).total)
    for bad in (w[:3], w.expand(4, 4), w.expand(6, 4).T):
        with pytest.raises(ValueError, match=r"weights must have shape \[4\] \(one per atom\) or \[6, 4\]"):
            cast_advantages(values, groups, bad)


def test_default_std_eps_is_flow_grpos_1e_4():
    """hand_batch's group 1 (exist 0, 1; unbiased std sqrt(1/2)) without an explicit eps:
    A = -+0.5 / (sqrt(1/2) + 1e-4) = -+0.70701 (1e-2 would give -+0.69726)."""
    batch, w = hand_batch()
    out = cast_advantages(batch.scores.values, batch.group_ids, w)
    a = 0.5 / (1 / math.sqrt(2) + 1e-4)
    torch.testing.assert_close(out.atom[3:5, 0], torch.tensor([-a, a]), rtol=1e-6, atol=1e-6)


def test_scores_of_any_dtype_give_float32_advantages():
    """Half, double, integer or bool verdicts: the advantages are computed and returned in float32."""
    batch, w = hand_batch()
    want = cast_advantages(batch.scores.values, batch.group_ids, w, eps=1e-4)
    for dtype in (torch.float16, torch.float64, torch.long, torch.bool):
        got = cast_advantages(batch.scores.values.to(dtype), batch.group_ids, w, eps=1e-4)
        assert got.atom.dtype == torch.float32 and got.total.dtype == torch.float32, dtype
        torch.testing.assert_close(got.total, want.total)


def test_a_negative_atom_weight_subtracts_its_advantage():
    """w = (1, -2, 0, 0) on hand_batch's group 0: A = A_exist - 2 A_colour = S3 - 4 S3, S3 + 2 S3,
    -2 S3 + 2 S3; the same with the weights given per sample."""
    batch, _ = hand_batch()
    w = torch.tensor([1.0, -2.0, 0.0, 0.0])
    for weights in (w, w.expand(6, 4)):
        out = cast_advantages(batch.scores.values, batch.group_ids, weights, eps=1e-4)
        torch.testing.assert_close(out.total[:3], torch.tensor([-3 * S3, 3 * S3, 0.0]), atol=1e-3, rtol=1e-3)


# ------------------------------------------------------------------ calibration by hand


class _ConstantFlow:
    """calibrate_window's view of a flow, by hand: the velocity is 1 everywhere, so x0_hat =
    x_i - sigma_i * 1 stays at x_0 - 1 along the whole ODE path; each seed's noise is the seed
    itself, and decode hands x0_hat through as the "image"."""

    def __init__(self):
        self.batches = []

    def encode_prompt(self, texts):
        self.batches.append(list(texts))
        return {}

    def noise(self, n, generator):
        return torch.full((n, 2, 1), float(generator.initial_seed()))

    def velocity(self, x, sigma, cond):
        return torch.ones_like(x)

    def decode(self, x):
        return list(x)


def test_calibrate_window_by_hand_on_scripted_verdicts(monkeypatch):
    """Two parsed prompts (an unparsed one is dropped) x seeds 0, 1 in batches of 3: the verdicts
    at each of 4 steps come from a script keyed by (prompt, seed), the seed read back from the
    decoded x0_hat = seed - 1; a score of exactly 0.5 passes."""
    from diffusion_rl.sde import FlowSDESampler
    from diffusion_rl.tasks import shapes_geneval

    circle, triangles = "a red circle", "two blue triangles left of a red circle"
    script = {(circle, 0): [0.0, 0.5, 0.5, 0.5],  # F T T T: commit step 1
              (circle, 1): [1.0, 1.0, 1.0, 1.0],  # never changes: 0
              (triangles, 0): [1.0, 0.0, 1.0, 1.0],  # T F T T: 2
              (triangles, 1): [0.0, 1.0, 1.0, 1.0]}  # F T T T: 1
    seen = []

    def score_image(image, text):
        assert torch.equal(image, image.flatten()[0].expand_as(image))
        seed = int(image.flatten()[0]) + 1  # x0_hat = seed - 1 exactly
        seen.append((text, seed))
        return {"atom": script[text, seed][sum(s == (text, seed) for s in seen) - 1]}

    monkeypatch.setattr(shapes_geneval, "score_image", score_image)
    flow, sampler = _ConstantFlow(), FlowSDESampler()
    sampler.set_timesteps(4, shift="none")  # sigmas 1, 0.75, 0.5, 0.25, 0
    policy = SimpleNamespace(flow=flow, sampler=lambda n: sampler, rollout=SimpleNamespace(shift="none"))
    cal = calibrate_window(policy, [circle, "hello there", triangles], num_steps=4, window_size=2, seeds=2,
                           offset=1, batch_size=3)
    assert flow.batches == [[circle, circle, triangles], [triangles]]
    assert sorted(set(seen)) == sorted(script) and len(seen) == 4 * 4
    assert cal.prompts == [circle, triangles] and cal.num_samples == 4
    assert cal.commit_histogram == [1, 2, 1, 0]  # commits 1, 0, 2, 1
    # step 0 -> 1: circle seed 0, triangles seeds 0 and 1 change; 1 -> 2: triangles seed 0; 2 -> 3: none
    assert cal.change_rate == [0.75, 0.25, 0.0]
    # lower median of (0, 1, 1, 2) is 1; + offset 1 = 2 ends the 2-step window: steps 1..2
    assert (cal.median_commit, cal.window_start, cal.window_size, cal.offset) == (1, 1, 2, 1)
    assert cal.sigmas == [1.0, 0.75, 0.5, 0.25, 0.0] and cal.shift == "none" and cal.num_steps == 4


def test_calibrate_window_without_a_parsed_prompt_says_so():
    policy = SimpleNamespace(flow=None, sampler=None, rollout=None)
    with pytest.raises(ValueError, match="at least one prompt the shapes-geneval grammar parses"):
        calibrate_window(policy, ["hello there"], num_steps=4, window_size=2)


def test_window_rule_refuses_an_empty_window():
    with pytest.raises(ValueError, match=r"window_size must lie in \[1, 9\]"):
        window_from_commits([1], 10, 0)


@pytest.mark.parametrize("content, match", [
    ('{"num_steps": 4, "window_start": 0, "window_size": 0}', "does not fit"),
    ('{"num_steps": 4, "window_start": -1, "window_size": 2}', "does not fit"),
    ('{"num_steps": 4, "window_start": true, "window_size": 2}', "window_start must be an integer, got True"),
    ('[4, 0, 2]', "expected a JSON object"),
])
def test_load_window_refuses_an_empty_or_negative_window_a_bool_and_a_list(tmp_path, content, match):
    path = tmp_path / "w.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        load_window(path, 4)
    path.write_text('{"num_steps": 4, "window_start": 1, "window_size": 2}')
    assert load_window(path, 4) == (1, 2)  # steps 1..2: the last start that keeps step 3 deterministic


def _cast_cfg(window_start=None):
    return SimpleNamespace(method=SimpleNamespace(window_from="model"),
                           rollout=SimpleNamespace(window_start=window_start, window_size=2, num_steps=4, shift="auto"))


def test_a_model_window_file_that_is_not_an_object_is_a_config_error(tmp_path):
    from diffusion_rl.calibrate import apply_window_file

    (tmp_path / MODEL_WINDOW_FILE).write_text("[4, 1, 2]")
    with pytest.raises(ConfigError, match="the window stored with the model.*expected a JSON object"):
        apply_window_file(_cast_cfg(), tmp_path)


def test_an_explicit_window_and_a_model_without_one_say_nothing(tmp_path):
    from diffusion_rl.calibrate import apply_window_file

    cfg = _cast_cfg(window_start=(0, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert apply_window_file(cfg, tmp_path) is None
    assert cfg.rollout.window_start == (0, 1) and cfg.rollout.window_size == 2


def test_a_window_that_cannot_replace_the_models_file_leaves_no_temporary_file(tmp_path):
    from diffusion_rl.calibrate import WindowCalibration

    cal = WindowCalibration(num_steps=4, window_start=1, window_size=2, median_commit=2, commit_histogram=[0, 0, 2, 0],
                            change_rate=[0.0, 1.0, 0.0], num_samples=2, prompts=["a red circle"],
                            sigmas=[1.0, 0.75, 0.5, 0.25, 0.0], shift="none")
    (tmp_path / MODEL_WINDOW_FILE).mkdir()  # a directory in the way: the rename fails
    (tmp_path / MODEL_WINDOW_FILE / "x").write_text("")
    with pytest.raises(ConfigError, match="cannot store the window"):
        store_in_model(cal, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [MODEL_WINDOW_FILE]


def test_summary_line_by_hand():
    from diffusion_rl.calibrate import WindowCalibration, summary_line

    cal = WindowCalibration(num_steps=4, window_start=1, window_size=2, median_commit=2, commit_histogram=[0, 1, 1, 0],
                            change_rate=[0.5, 0.25, 0.0], num_samples=2, prompts=["a red circle"],
                            sigmas=[1.0, 0.75, 0.5, 0.25, 0.0], shift="none")
    assert summary_line(cal) == ("window: steps 1..2 of 4 (median commit step 2, 2 samples); verdict-change rate "
                                 "per step: [0.50, 0.25, 0.00]; commit histogram: [0, 1, 1, 0]")
